"""Drive `waste serve` with the official openai Python client.

    python tools/serve_test/openai_client.py WASTE_BINARY CONTAINER [VISION_CONTAINER IMAGE.png] [--k2 K2_CONTAINER]

CONTAINER uses K3's tagged chat format (the C engine's anchor or a synthetic
model): chat, streaming, thinking, tools, structured output. K2_CONTAINER
speaks the Kimi K2 family's format (Kimi-Linear's markup): tools forced,
named, automatic and streamed, with results. Prints "N passed, N failed",
exits non-zero on any failure.
"""
import json
import subprocess
import sys

import jsonschema
import openai

k2_container = None
if "--k2" in sys.argv:
    i = sys.argv.index("--k2")
    k2_container = sys.argv[i + 1]
    del sys.argv[i:i + 2]
waste, container = sys.argv[1], sys.argv[2]
procs = []


def start(path, model_id):
    proc = subprocess.Popen([waste, "serve", path, "--port", "0", "--model-id", model_id], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    procs.append(proc)
    addr = proc.stdout.readline().strip().rsplit("http://", 1)[1]
    return openai.OpenAI(base_url=f"http://{addr}/v1", api_key="unused")


client = start(container, "tiny")
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
NO_THINK = {"reasoning_effort": "none"}


def create(**kw):
    args = {"model": "tiny", "messages": msgs, "temperature": 0}
    args.update(kw)
    return client.chat.completions.create(**args)


def chat():
    r = create(max_tokens=8, **NO_THINK)
    m = r.choices[0].message
    assert m.role == "assistant" and isinstance(m.content, str) and m.content
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8


def stream():
    full = create(max_tokens=8, **NO_THINK).choices[0].message.content
    parts, usage = [], None
    for ch in create(max_tokens=8, stream=True, stream_options={"include_usage": True}, **NO_THINK):
        if ch.usage:
            usage = ch.usage
        for c in ch.choices:
            if c.delta.content:
                parts.append(c.delta.content)
    assert full and "".join(parts) == full, ("".join(parts), full)
    assert usage is not None and usage.completion_tokens == 8


def thinking():
    # thinking is on by default (K3's template): the text goes to reasoning_content
    r = create(max_tokens=12)
    m = r.choices[0].message
    reasoning = getattr(m, "reasoning_content", None)
    assert reasoning, m
    parts = []
    for ch in create(max_tokens=12, stream=True):
        for c in ch.choices:
            rc = getattr(c.delta, "reasoning_content", None)
            if rc:
                parts.append(rc)
    assert "".join(parts) == reasoning, ("".join(parts), reasoning)
    # turned off, the same request answers in content
    assert create(max_tokens=12, **NO_THINK).choices[0].message.content


def stops():
    full = create(max_tokens=24, **NO_THINK).choices[0].message.content
    stop = full[4:6]
    r = create(max_tokens=24, stop=["never-xyz", stop, "also-not"], **NO_THINK)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == full[: full.index(stop)]


def logprobs():
    r = create(max_tokens=4, logprobs=True, top_logprobs=2, **NO_THINK)
    c = r.choices[0].logprobs.content
    assert len(c) == 4 and all(len(x.top_logprobs) == 2 and x.logprob <= 0 for x in c)


def completions():
    r = client.completions.create(model="tiny", prompt="The city of", max_tokens=5, temperature=0)
    assert r.object == "text_completion" and isinstance(r.choices[0].text, str)
    # logprobs in the legacy completions shape the client types
    r = client.completions.create(model="tiny", prompt="The city of", max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 5 and len(lp.token_logprobs) == 5 and len(lp.text_offset) == 5, lp
    assert lp.text_offset[0] == 0 and all(x <= 0 for x in lp.token_logprobs), lp
    assert all(len(t) == 2 and max(t.values()) == l for t, l in zip(lp.top_logprobs, lp.token_logprobs)), lp


def models():
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"


def seeded():
    a = create(max_tokens=10, temperature=1.0, seed=7, **NO_THINK).choices[0].message.content
    b = create(max_tokens=10, temperature=1.0, seed=7, **NO_THINK).choices[0].message.content
    assert a == b
    # the controls: the seed and the temperature are used (other seeds give
    # other samples, and temperature 0 is the greedy answer every time)
    others = {create(max_tokens=10, temperature=1.0, seed=s, **NO_THINK).choices[0].message.content for s in (8, 9, 10)}
    assert others - {a}, f"seeds 7-10 all gave {a!r}"
    g1 = create(max_tokens=10, temperature=0, seed=1, **NO_THINK).choices[0].message.content
    g2 = create(max_tokens=10, temperature=0, seed=2, **NO_THINK).choices[0].message.content
    assert g1 == g2, (g1, g2)
    assert {a} | others != {g1}, "sampling at temperature 1 never left the greedy answer"


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                            "metric": {"type": "boolean"}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast for a city.", "parameters": WEATHER}}]


def streamed_calls(stream):
    """The tool calls of a streamed answer, assembled from their deltas: {index: {name, arguments}}."""
    got = {}
    for chunk in stream:
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                e = got.setdefault(d.index, {"name": "", "arguments": ""})
                e["name"] += d.function.name or ""
                e["arguments"] += d.function.arguments or ""
    return got


def tool_round_trip():
    ask = [{"role": "user", "content": "What's the weather in Paris for 3 days?"}]
    r = create(messages=ask, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=1, seed=11, max_tokens=300, **NO_THINK)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    calls = ch.message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_weather" and calls[0].id
    args = json.loads(calls[0].function.arguments)
    jsonschema.validate(args, WEATHER)
    # the same call, streamed as tool_calls deltas
    got = streamed_calls(create(messages=ask, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=1, seed=11, max_tokens=300, stream=True, **NO_THINK))
    assert got == {0: {"name": "get_weather", "arguments": calls[0].function.arguments}}, got
    # the tool's result goes back; the model answers (no further call allowed)
    follow = ask + [{"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
                    {"role": "tool", "tool_call_id": calls[0].id, "content": json.dumps({"forecast": "sunny", "high_c": 21})}]
    r2 = create(messages=follow, tools=TOOLS, tool_choice="none", max_tokens=8, **NO_THINK)
    assert r2.choices[0].message.content and not r2.choices[0].message.tool_calls
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens
    # the conversation extends the previous one's messages: their state is reused
    # (not the tool_choice notice, which the template puts after the messages)
    assert r2.model_extra["waste"]["reused_prompt_tokens"] > 0, r2.model_extra["waste"]


def named_tool():
    r = create(messages=[{"role": "user", "content": "hi"}], tools=TOOLS + [{"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}],
               tool_choice={"type": "function", "function": {"name": "noop"}}, temperature=1, seed=2, max_tokens=200, **NO_THINK)
    calls = r.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["noop"] and json.loads(calls[0].function.arguments) == {}


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pet": {"enum": ["cat", "dog", None]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    "home": {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90}}, "required": ["lat"], "additionalProperties": False}},
    "required": ["name", "age", "pet", "home"], "additionalProperties": False}


def json_schema_samples(c, model, think):
    def f():
        for seed in range(20):
            r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Describe a person."}], temperature=1, seed=seed, max_tokens=400,
                                          response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}, **think)
            ch = r.choices[0]
            assert ch.finish_reason == "stop", (seed, ch)
            jsonschema.validate(json.loads(ch.message.content), PERSON)
    return f


def json_object():
    r = create(temperature=0, max_tokens=400, response_format={"type": "json_object"}, **NO_THINK)
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    assert isinstance(json.loads(text), dict), text


def refused(**kw):
    def f():
        try:
            create(max_tokens=4, **kw)
        except openai.BadRequestError as e:
            assert e.status_code == 400
            assert isinstance(e.body, dict) and e.body.get("message"), e.body
            return
        raise AssertionError("accepted silently")
    return f


def bad_request():
    try:
        create(messages=[], max_tokens=4)
    except openai.BadRequestError as e:
        assert isinstance(e.body, dict), e.body
        assert e.body["param"] == "messages", e.body
        return
    raise AssertionError("empty messages accepted")


checks = [("chat", chat), ("stream + include_usage", stream), ("thinking -> reasoning_content", thinking), ("several stop strings", stops),
          ("logprobs", logprobs), ("completions", completions), ("models", models), ("seeded sampling", seeded),
          ("tool call round trip", tool_round_trip), ("named tool_choice", named_tool),
          ("json_schema: 20 seeded samples at temperature 1 validate", json_schema_samples(client, "tiny", NO_THINK)),
          ("json_object", json_object), ("empty messages -> 400", bad_request),
          ("tool_choice naming an unknown function -> 400", refused(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})),
          ("json_schema without a schema -> 400", refused(response_format={"type": "json_schema", "json_schema": {"name": "x"}})),
          ("remote image URL -> 400", refused(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]}]))]
if len(sys.argv) > 4:
    import base64
    vclient = start(sys.argv[3], "k3-vision")
    url = "data:image/png;base64," + base64.b64encode(open(sys.argv[4], "rb").read()).decode()

    def image_chat():
        def ask(parts):
            return vclient.chat.completions.create(model="k3-vision", max_tokens=3, temperature=0,
                                                   messages=[{"role": "user", "content": parts}], extra_body={"reasoning_effort": "none"})
        text = {"type": "text", "text": "what is this?"}
        with_image = ask([{"type": "image_url", "image_url": {"url": url}}, text])
        without = ask([text])
        assert with_image.choices[0].message.content is not None
        # the image's markup and its merged positions are counted in the prompt
        assert with_image.usage.prompt_tokens > without.usage.prompt_tokens + 4, (with_image.usage, without.usage)
    checks.append(("an image as a base64 data: URL", image_chat))
if k2_container:
    k2 = start(k2_container, "k2")

    def k2_create(**kw):
        args = {"model": "k2", "messages": [{"role": "user", "content": "What's the weather in Paris for 3 days?"}], "tools": TOOLS}
        args.update(kw)
        return k2.chat.completions.create(**args)

    def k2_forced_streamed_and_answered():
        r = k2_create(tool_choice="required", parallel_tool_calls=False, temperature=1, seed=5, max_tokens=300)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", ch
        calls = ch.message.tool_calls
        assert len(calls) == 1 and calls[0].function.name == "get_weather" and calls[0].id, calls
        jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)
        assert "<|tool_call" not in (ch.message.content or "")
        got = streamed_calls(k2_create(tool_choice="required", parallel_tool_calls=False, temperature=1, seed=5, max_tokens=300, stream=True))
        assert got == {0: {"name": "get_weather", "arguments": calls[0].function.arguments}}, got
        follow = [{"role": "user", "content": "What's the weather in Paris for 3 days?"},
                  {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
                  {"role": "tool", "tool_call_id": calls[0].id, "content": json.dumps({"forecast": "sunny"})}]
        r2 = k2_create(messages=follow, tool_choice="none", max_tokens=8, temperature=0)
        assert isinstance(r2.choices[0].message.content, str) and not r2.choices[0].message.tool_calls, r2
        assert r2.model_extra["waste"]["reused_prompt_tokens"] > 0, r2.model_extra["waste"]

    def k2_named_and_parallel():
        noop = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}
        r = k2_create(tools=TOOLS + [noop], tool_choice={"type": "function", "function": {"name": "noop"}}, temperature=1, seed=2, max_tokens=200)
        calls = r.choices[0].message.tool_calls
        assert calls and all(c.function.name == "noop" and json.loads(c.function.arguments) == {} for c in calls), calls
        r = k2_create(tool_choice="required", temperature=1, seed=8, max_tokens=600)
        calls = r.choices[0].message.tool_calls
        assert calls, r
        for c in calls:
            jsonschema.validate(json.loads(c.function.arguments), WEATHER)

    def k2_auto():
        # the model decides; whatever it writes is an answer, and any call it opens is held to the schema
        for seed in (1, 2, 3):
            r = k2_create(temperature=1, seed=seed, max_tokens=120)
            m = r.choices[0].message
            assert m.content is not None or m.tool_calls, r
            for c in m.tool_calls or []:
                jsonschema.validate(json.loads(c.function.arguments), WEATHER)

    checks += [("K2 format: forced call, streamed, answered with its result", k2_forced_streamed_and_answered),
               ("K2 format: named and parallel calls", k2_named_and_parallel), ("K2 format: tool_choice auto", k2_auto)]
for n, f in checks:
    check(n, f)
for p in procs:
    p.kill()
print(f"{passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
