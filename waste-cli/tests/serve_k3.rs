//! K3 requests rendered as the reference template (`Kimi-K3.jinja`) does,
//! through `waste serve`: the default prompt's length, `top_k` honoured, and
//! a container whose `chat.json` (written by the C converter) carries the K3
//! markers as plain affixes served exactly like one without it.

mod common;

use common::{anchor, copy_anchor, post_chat as post, start_with};
use serde_json::{json, Value};
use std::process::Command;

fn tokens_of(text: &str) -> usize {
    let o = Command::new(env!("CARGO_BIN_EXE_waste"))
        .args(["tokenize", anchor().to_str().unwrap(), "--markup", "--json", text])
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    v["ids"].as_array().unwrap().len()
}

#[test]
fn a_default_request_costs_what_the_reference_template_renders() {
    let s = start_with(&anchor(), &["--model-id", "tiny"]);
    let (st, v) = post(&s.addr, &json!({"messages": [{"role": "user", "content": "Hello."}], "max_tokens": 1}));
    assert_eq!(st, 200, "{v}");
    // Kimi-K3.jinja with no kwargs: thinking defaults to true and
    // thinking_effort to 'max', so the effort notice is rendered; then the
    // message and the generation prompt opening `think`
    let reference = concat!(
        "<|open|>message role=\"system\" type=\"thinking-effort\"<|sep|>`thinking_effort` guides on how much to think in your thinking channel (not including the response channel), supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked with `thinking_effort=max`.<|close|>message<|sep|><|end_of_msg|>",
        "<|open|>message role=\"user\"<|sep|>Hello.<|close|>message<|sep|><|end_of_msg|>",
        "<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>",
    );
    // + 1: the engine starts every prompt with the model's BOS, as the C
    // engine does (the template itself writes none)
    assert_eq!(v["usage"]["prompt_tokens"].as_u64().unwrap() as usize, tokens_of(reference) + 1);
    // thinking off (boolean): no notice, the generation prompt opens `response`
    let (st, v) = post(
        &s.addr,
        &json!({"messages": [{"role": "user", "content": "Hello."}], "max_tokens": 1, "thinking": false}),
    );
    assert_eq!(st, 200, "{v}");
    let off = concat!(
        "<|open|>message role=\"user\"<|sep|>Hello.<|close|>message<|sep|><|end_of_msg|>",
        "<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|>",
    );
    assert_eq!(v["usage"]["prompt_tokens"].as_u64().unwrap() as usize, tokens_of(off) + 1);
    assert!(v["choices"][0]["message"].get("reasoning_content").is_none_or(|r| r.is_null()), "{v}");
}

#[test]
fn top_k_is_honoured() {
    let s = start_with(&anchor(), &["--model-id", "tiny"]);
    let ask = |extra: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 12, "reasoning_effort": "none"});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let (st, v) = post(&s.addr, &body);
        assert_eq!(st, 200, "{v}");
        v["choices"][0]["message"]["content"].as_str().unwrap().to_string()
    };
    let greedy = ask(json!({"temperature": 0}));
    // top_k 1 leaves one candidate: sampling at a high temperature is greedy
    for seed in [1, 2, 3] {
        assert_eq!(ask(json!({"temperature": 1.8, "top_k": 1, "seed": seed})), greedy, "seed {seed}");
    }
    // the control: without top_k those samples leave the greedy path
    let free: Vec<String> = [1, 2, 3].iter().map(|&seed| ask(json!({"temperature": 1.8, "seed": seed}))).collect();
    assert!(free.iter().any(|f| f != &greedy), "the control did not differ from greedy: {free:?}");
}

#[test]
fn a_c_converted_chat_json_means_the_k3_format() {
    let d = copy_anchor("k3-chatjson");
    // the affixes the C WASTE's converter writes for K3
    let aff =
        |r: &str| json!([format!("<|open|>message role=\"{r}\"<|sep|>"), "<|close|>message<|sep|><|end_of_msg|>"]);
    std::fs::write(
        d.join("chat.json"),
        json!({"system": aff("system"), "user": aff("user"), "assistant": aff("assistant"),
               "open": "<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|>"})
        .to_string(),
    )
    .unwrap();
    let plain = start_with(&anchor(), &["--model-id", "tiny"]);
    let converted = start_with(&d, &["--model-id", "tiny"]);
    let tool = json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}}, "required": ["city"]}}});
    let requests = [
        json!({"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [tool], "tool_choice": "required", "parallel_tool_calls": false, "max_tokens": 64, "temperature": 0, "reasoning_effort": "none"}),
        json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16, "temperature": 0}),
        json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16, "temperature": 0, "reasoning_effort": "none"}),
    ];
    for r in &requests {
        let (sa, a) = post(&plain.addr, r);
        let (sb, b) = post(&converted.addr, r);
        assert_eq!((sa, sb), (200, 200), "{a} / {b}");
        assert_eq!(a["choices"], b["choices"], "{r}");
        assert_eq!(a["usage"], b["usage"], "{r}");
    }
    // the tools request came back as tool calls, not as marker text
    let (_, b) = post(&converted.addr, &requests[0]);
    let call = &b["choices"][0]["message"]["tool_calls"][0]["function"];
    assert_eq!(call["name"], "get_weather", "{b}");
    let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert!(["Paris", "Oslo"].contains(&args["city"].as_str().unwrap()), "{b}");
    assert!(!b.to_string().contains("<|open|>"), "{b}");
    std::fs::remove_dir_all(&d).ok();
}
