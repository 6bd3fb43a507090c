//! K3's tagged chat format against the reference template itself: every
//! case in tools/oracle/k3_template/fixtures.json was rendered from
//! Kimi-K3.jinja by jinja2 set up as transformers sets it up (render.py
//! beside it names the template's source and hash); the native renderer
//! must give the same text, character for character.

use serde_json::Value;
use std::path::Path;
use waste_tokenizer::xtml::{render, text, ChatMessage, Effort, ResponseFormat, ToolCall, ToolChoice, XtmlOptions};

fn message(m: &Value) -> ChatMessage {
    let s = |k: &str| m.get(k).and_then(|v| v.as_str()).map(str::to_string);
    ChatMessage {
        role: s("role").unwrap(),
        content: s("content").unwrap_or_default(),
        reasoning: s("reasoning_content").unwrap_or_default(),
        tool_calls: m
            .get("tool_calls")
            .and_then(|t| t.as_array())
            .map(|a| {
                a.iter()
                    .map(|c| ToolCall {
                        id: c["id"].as_str().unwrap().to_string(),
                        name: c["function"]["name"].as_str().unwrap().to_string(),
                        arguments: c["function"]["arguments"].to_string(),
                    })
                    .collect()
            })
            .unwrap_or_default(),
        tool_call_id: s("tool_call_id"),
        name: s("name"),
        tools: m.get("tools").and_then(|t| t.as_array()).cloned().unwrap_or_default(),
        images: vec![],
    }
}

fn options(kw: &Value) -> XtmlOptions {
    let thinking = kw.get("thinking").and_then(|t| t.as_bool()).unwrap_or(true);
    let effort = match kw.get("thinking_effort").and_then(|e| e.as_str()).unwrap_or("max") {
        "low" => Effort::Low,
        "medium" => Effort::Medium,
        "high" => Effort::High,
        _ => Effort::Max,
    };
    XtmlOptions {
        tools: kw.get("tools").and_then(|t| t.as_array()).cloned().unwrap_or_default(),
        tool_choice: match kw.get("tool_choice").and_then(|t| t.as_str()) {
            Some("required") => ToolChoice::Required,
            Some("none") => ToolChoice::None,
            _ => ToolChoice::Auto,
        },
        thinking: thinking.then_some(effort),
        response_format: kw.get("response_format").map(|rf| match rf["type"].as_str() {
            Some("json_schema") => ResponseFormat::JsonSchema(rf["json_schema"]["schema"].clone()),
            _ => ResponseFormat::JsonObject,
        }),
    }
}

#[test]
fn every_case_renders_as_the_reference_template_does() {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tools/oracle/k3_template/fixtures.json");
    let f: Value = serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap();
    let cases = f["cases"].as_array().unwrap();
    assert!(cases.len() >= 9);
    for c in cases {
        let msgs: Vec<ChatMessage> = c["messages"].as_array().unwrap().iter().map(message).collect();
        let got = text(&render(&msgs, &options(&c["kwargs"]), true).unwrap());
        assert_eq!(got, c["text"].as_str().unwrap(), "case {}", c["name"]);
    }
}
