"""Drive `waste serve` with the official openai Python client.

    python tools/serve_test/openai_client.py WASTE_BINARY CONTAINER

Starts the server on a free port, runs the checks, prints
"N passed, N failed", exits non-zero on any failure.
"""
import json
import subprocess
import sys

import openai

waste, container = sys.argv[1], sys.argv[2]
proc = subprocess.Popen([waste, "serve", container, "--port", "0", "--model-id", "tiny"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
addr = proc.stdout.readline().strip().rsplit("http://", 1)[1]
client = openai.OpenAI(base_url=f"http://{addr}/v1", api_key="unused")
passed, failed = 0, 0


def check(name, fn):
    global passed, failed
    try:
        fn()
        passed += 1
        print(f"ok   {name}")
    except Exception as e:  # noqa: BLE001
        failed += 1
        print(f"FAIL {name}: {e!r}")


msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me about Paris."}]


def chat():
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
    assert r.choices[0].message.role == "assistant" and isinstance(r.choices[0].message.content, str)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8


def stream():
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0).choices[0].message.content
    parts, usage = [], None
    for ch in client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}):
        if ch.usage:
            usage = ch.usage
        for c in ch.choices:
            if c.delta.content:
                parts.append(c.delta.content)
    assert "".join(parts) == full, ("".join(parts), full)
    assert usage is not None and usage.completion_tokens == 8


def stops():
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=24, temperature=0).choices[0].message.content
    stop = full[4:6]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=24, temperature=0, stop=["never-xyz", stop, "also-not"])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == full[: full.index(stop)]


def logprobs():
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    c = r.choices[0].logprobs.content
    assert len(c) == 4 and all(len(x.top_logprobs) == 2 and x.logprob <= 0 for x in c)


def completions():
    r = client.completions.create(model="tiny", prompt="The city of", max_tokens=5, temperature=0)
    assert r.object == "text_completion" and isinstance(r.choices[0].text, str)


def models():
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"


def seeded():
    a = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=1.0, seed=7).choices[0].message.content
    b = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=1.0, seed=7).choices[0].message.content
    assert a == b


def refused(**kw):
    def f():
        try:
            client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, **kw)
        except openai.BadRequestError as e:
            assert e.status_code == 400
            return
        raise AssertionError("accepted silently")
    return f


def bad_request():
    try:
        client.chat.completions.create(model="tiny", messages=[], max_tokens=4)
    except openai.BadRequestError as e:
        assert e.body["param"] == "messages" if isinstance(e.body, dict) else True
        return
    raise AssertionError("empty messages accepted")


for n, f in [("chat", chat), ("stream + include_usage", stream), ("several stop strings", stops), ("logprobs", logprobs),
             ("completions", completions), ("models", models), ("seeded sampling", seeded), ("empty messages -> 400", bad_request),
             ("tools refused, not ignored", refused(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])),
             ("json_schema refused, not ignored", refused(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}))]:
    check(n, f)
proc.kill()
print(f"{passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
