"""Render the Kimi K2 family's chat template (Kimi-K2-Instruct.jinja: the
markup Kimi-Linear's release speaks — `<|im_user|>…<|im_middle|>`, tool
declarations in a `tool_declare` system turn, `<|tool_calls_section_begin|>`
calls, `## Return of ID` results) for every case the native K2 renderer's
tests cover, with jinja2 set up as transformers' apply_chat_template sets it
up (trim_blocks, lstrip_blocks, loop controls, `tojson` =
json.dumps(ensure_ascii=False)) — but in jinja2's mutable sandbox: the
template keeps its tool-call ids in a list it appends to, which
transformers' immutable sandbox refuses ("access to attribute 'append' of
'list' object is unsafe"); llama.cpp's Jinja engine, which ships it, allows
it. Writes fixtures.json beside this
script; `waste-tokenizer/tests/k2_template.rs` renders the same cases
natively and compares the text exactly.

The template is not copied into this repository. It ships in the
llama-cpp-python 0.3.36 sdist on PyPI (sha256 of the tarball
832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e) as
vendor/llama.cpp/models/templates/Kimi-K2-Instruct.jinja (sha256
1d396d5b128cdb9b2a4ef73434fa08d31c75604a11daa77bcb4b622d32dddd41):

    pip download --no-deps --no-binary llama-cpp-python -d /tmp/lcp llama-cpp-python==0.3.36
    tar xzf /tmp/lcp/llama_cpp_python-0.3.36.tar.gz -C /tmp/lcp
    python render.py /tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/Kimi-K2-Instruct.jinja

Run with the oracle venv (../shared/tools/oracle-venv: jinja2 3.1).
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from template_env import load  # noqa: E402

path = sys.argv[1]
template, digest, _ = load(path, mutable=True)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now, ° and all",
                                             "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
                                                            "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}}}}

cases = [
    ("plain_no_system", [{"role": "user", "content": "Hello."}], {}, True),
    ("plain_with_system", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], {}, True),
    ("closed_conversation", [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}], {}, False),
    ("tools_declared", [{"role": "user", "content": "Weather in Paris?"}], {"tools": [WEATHER, TIME]}, True),
    ("tool_round_trip", [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris and the time?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "functions.get_weather:0", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
            {"id": "functions.get_time:1", "type": "function", "function": {"name": "get_time", "arguments": "{\"zone\":\"CET\"}"}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny, 21 °C"},
        {"role": "tool", "tool_call_id": "functions.get_time:1", "content": "14:02"},
        {"role": "assistant", "content": "Sunny, 21 °C; it is 14:02."},
        {"role": "user", "content": "And Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_x", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "call_x", "content": "snow"},
    ], {"tools": [WEATHER, TIME]}, True),
    ("tool_result_without_a_call", [{"role": "user", "content": "x"}, {"role": "tool", "name": "get_time", "content": "12:00"}], {}, True),
    ("named_participants", [{"role": "user", "name": "ann", "content": "hi"}, {"role": "assistant", "name": "bot", "content": "yo"}], {}, True),
    ("markup_lookalikes_in_content", [{"role": "user", "content": "<|im_end|> and <|tool_call_begin|> are text"}], {}, True),
]

out = {"template_sha256": digest, "source": os.path.basename(path), "cases": []}
for name, messages, kw, open_ in cases:
    text = template.render(messages=messages, add_generation_prompt=open_, **kw)
    out["cases"].append({"name": name, "messages": messages, "kwargs": kw, "add_generation_prompt": open_, "text": text})

dst = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures.json")
with open(dst, "w", encoding="utf-8") as f:
    json.dump(out, f, ensure_ascii=False, indent=1)
    f.write("\n")
print(f"wrote {dst}: {len(out['cases'])} cases, template sha256 {digest}")
