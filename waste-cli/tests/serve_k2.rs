//! `waste serve` on a model in the Kimi K2 family's chat format (Kimi-Linear's
//! markup): tool calls forced, named, streamed and refused, held to the
//! tools' schemas, and a conversation with tool results; the prompt as the
//! reference template renders it.

mod common;
use common::{copy_anchor_k2, post_chat, start_with};
use serde_json::{json, Value};

fn weather() -> Value {
    json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city", "days"]}}})
}

fn noop() -> Value {
    json!({"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}})
}

/// The arguments of a call, checked against `weather`'s schema.
fn valid_weather_args(args: &str) {
    let a: Value = serde_json::from_str(args).unwrap_or_else(|e| panic!("{args}: {e}"));
    assert!(["Paris", "Oslo"].contains(&a["city"].as_str().unwrap()), "{args}");
    let d = a["days"].as_i64().unwrap();
    assert!((1..=9).contains(&d), "{args}");
}

#[test]
fn tools_on_the_k2_format_are_calls_held_to_their_schemas() {
    let d = copy_anchor_k2("k2-tools");
    let s = start_with(&d, &["--model-id", "tiny"]);
    let ask = json!([{"role": "user", "content": "Weather in Paris for 3 days?"}]);
    // forced, one call
    for seed in [1, 2, 3] {
        let (st, v) = post_chat(
            &s.addr,
            &json!({"messages": ask, "tools": [weather(), noop()], "tool_choice": "required", "parallel_tool_calls": false,
                    "max_tokens": 200, "temperature": 1, "seed": seed}),
        );
        assert_eq!(st, 200, "{v}");
        let ch = &v["choices"][0];
        assert_eq!(ch["finish_reason"], "tool_calls", "{v}");
        let calls = ch["message"]["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1, "{v}");
        let f = &calls[0]["function"];
        match f["name"].as_str().unwrap() {
            "get_weather" => valid_weather_args(f["arguments"].as_str().unwrap()),
            "noop" => assert!(serde_json::from_str::<Value>(f["arguments"].as_str().unwrap()).unwrap().is_object()),
            n => panic!("unknown tool {n}: {v}"),
        }
        // no markup leaks into the answer
        assert!(!v.to_string().contains("<|tool_call"), "{v}");
    }
    // named: that function, parallel allowed (one or more calls, each valid)
    let (st, v) = post_chat(
        &s.addr,
        &json!({"messages": ask, "tools": [weather(), noop()], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                "max_tokens": 400, "temperature": 1, "seed": 7}),
    );
    assert_eq!(st, 200, "{v}");
    let calls = v["choices"][0]["message"]["tool_calls"].as_array().unwrap();
    assert!(!calls.is_empty(), "{v}");
    for c in calls {
        assert_eq!(c["function"]["name"], "get_weather", "{v}");
        valid_weather_args(c["function"]["arguments"].as_str().unwrap());
    }
    // the call goes back with its result; tool_choice none answers in text
    let follow = json!([
        {"role": "user", "content": "Weather in Paris for 3 days?"},
        {"role": "assistant", "content": null, "tool_calls": [calls[0]]},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "{\"forecast\": \"sunny\"}"}
    ]);
    let (st, v) = post_chat(
        &s.addr,
        &json!({"messages": follow, "tools": [weather()], "tool_choice": "none", "max_tokens": 8, "temperature": 0}),
    );
    assert_eq!(st, 200, "{v}");
    assert!(v["choices"][0]["message"].get("tool_calls").is_none(), "{v}");
    assert!(v["choices"][0]["message"]["content"].is_string(), "{v}");
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn the_k2_prompt_costs_what_the_reference_template_renders() {
    // usage.prompt_tokens counts the rendered prompt: BOS + its tokens
    let d = copy_anchor_k2("k2-usage");
    let s = start_with(&d, &["--model-id", "tiny"]);
    let (st, v) = post_chat(
        &s.addr,
        &json!({"messages": [{"role": "user", "content": "Hi"}], "tools": [noop()], "max_tokens": 1, "temperature": 0}),
    );
    assert_eq!(st, 200, "{v}");
    // as Kimi-K2-Instruct.jinja renders it (tools/oracle/k2_template)
    let text = format!(
        "<|im_system|>tool_declare<|im_middle|>{}<|im_end|><|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>\n<|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_middle|>",
        r#"[{"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}]"#
    );
    // markup tokenization splits the text at each marker, as the prompt's
    // runs are split (no content here spells one)
    let (code, out, err) = common::waste(&["tokenize", d.to_str().unwrap(), "--markup", "--json", "-"], &text);
    assert_eq!(code, 0, "{err}");
    let ids: Value = serde_json::from_str(&out).unwrap();
    let n = ids.as_array().or_else(|| ids["ids"].as_array()).unwrap().len();
    assert_eq!(v["usage"]["prompt_tokens"], 1 + n, "{v}\n{out}");
    std::fs::remove_dir_all(&d).ok();
}
