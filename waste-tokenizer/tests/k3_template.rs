//! K3's tagged chat format against the reference template itself: every
//! case in tools/oracle/k3_template/fixtures.json was rendered from
//! Kimi-K3.jinja by jinja2 set up as transformers sets it up (render.py
//! beside it names the template's source and hash); the native renderer
//! must give the same text, character for character.

mod common;

use serde_json::Value;
use std::path::Path;
use waste_tokenizer::xtml::{render, text, ChatMessage, Effort, ResponseFormat, ToolChoice, XtmlOptions};

fn message(m: &Value) -> ChatMessage {
    common::message(m, |a| a.to_string())
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
