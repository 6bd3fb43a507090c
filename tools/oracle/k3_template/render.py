"""Render K3's reference chat template (Kimi-K3.jinja) for every case the
XTML renderer's tests cover, with jinja2 set up as transformers'
apply_chat_template sets it up (sandboxed environment, trim_blocks,
lstrip_blocks, loop controls, `tojson` = json.dumps(ensure_ascii=False),
`raise_exception`). Writes fixtures.json beside this script; the Rust test
`waste-tokenizer/tests/k3_template.rs` renders the same cases natively and
compares the text exactly.

The template is not copied into this repository. It ships in the
llama-cpp-python 0.3.36 sdist on PyPI (sha256 of the tarball
832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e) as
vendor/llama.cpp/models/templates/Kimi-K3.jinja (sha256
4578103bf225f58d5b7ceb613ccc2ac8fe82b6707b7289211b3d4825e87806b3):

    pip download --no-deps --no-binary llama-cpp-python -d /tmp/lcp llama-cpp-python==0.3.36
    tar xzf /tmp/lcp/llama_cpp_python-0.3.36.tar.gz -C /tmp/lcp
    python render.py /tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/Kimi-K3.jinja

Run with the oracle venv (../shared/tools/oracle-venv: jinja2 3.1).
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from template_env import load  # noqa: E402

path = sys.argv[1]
template, digest, _ = load(path, mutable=False)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
LATE = {"type": "function", "function": {"name": "late", "parameters": {"type": "object"}}}
SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "required": ["a"]}

cases = [
    ("tool_round_trip_no_thinking", [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ], {"tools": [WEATHER], "thinking": False}),
    ("effort_high_notices", [
        {"role": "system", "content": "Be brief."},
        {"role": "assistant", "content": "Hi", "reasoning_content": "greet"},
    ], {"thinking": True, "thinking_effort": "high", "tool_choice": "required", "response_format": {"type": "json_object"}}),
    ("object_and_array_arguments", [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments":
            {"opts": {"k": "v", "n": 1.5}, "list": [1, "two", None], "flag": True, "tiny": 1e-07, "über": "ä"}}}]},
    ], {"thinking": False}),
    ("system_message_tools", [
        {"role": "user", "content": "hi"},
        {"role": "system", "content": "ignored", "tools": [LATE]},
    ], {"thinking": False}),
    ("default_kwargs", [{"role": "user", "content": "Hello."}], {}),
    ("effort_low", [{"role": "user", "content": "x"}], {"thinking": True, "thinking_effort": "low"}),
    ("effort_max", [{"role": "user", "content": "x"}], {"thinking": True, "thinking_effort": "max"}),
    ("tool_choice_none_json_schema", [{"role": "user", "content": "give json"}],
     {"thinking": False, "tools": [WEATHER], "tool_choice": "none",
      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}),
    ("tool_results_reordered_by_call_id", [
        {"role": "user", "content": "two cities"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
            {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lima"}}}]},
        {"role": "tool", "tool_call_id": "b", "content": "warm"},
        {"role": "tool", "tool_call_id": "a", "content": "cold"},
    ], {"thinking": False, "tools": [WEATHER]}),
]

out = {"template_sha256": digest, "template": os.path.basename(path), "cases": []}
for name, messages, kw in cases:
    text = template.render(messages=messages, add_generation_prompt=True, **kw)
    out["cases"].append({"name": name, "messages": messages, "kwargs": kw, "text": text})
dst = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures.json")
with open(dst, "w", encoding="utf-8") as f:
    json.dump(out, f, ensure_ascii=False, indent=1)
print(f"wrote {dst}: {len(cases)} cases, template sha256 {digest}")
