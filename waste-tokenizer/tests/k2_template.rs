//! The Kimi K2 family's chat format (Kimi-Linear's) against the reference
//! template itself: every case in tools/oracle/k2_template/fixtures.json was
//! rendered from Kimi-K2-Instruct.jinja by jinja2 (render.py beside it names
//! the template's source and hash); the native renderer must give the same
//! text, character for character.

mod common;

use serde_json::Value;
use std::path::Path;
use waste_tokenizer::k2::render;
use waste_tokenizer::xtml::{text, ChatMessage};

fn message(m: &Value) -> ChatMessage {
    common::message(m, |a| a.as_str().unwrap().to_string())
}

#[test]
fn every_fixture_renders_as_the_reference_template() {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tools/oracle/k2_template/fixtures.json");
    let f: Value = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
    let cases = f["cases"].as_array().unwrap();
    assert!(cases.len() >= 8);
    for c in cases {
        let msgs: Vec<ChatMessage> = c["messages"].as_array().unwrap().iter().map(message).collect();
        let tools = c["kwargs"].get("tools").and_then(|t| t.as_array()).cloned().unwrap_or_default();
        let open = c["add_generation_prompt"].as_bool().unwrap();
        let got = text(&render(&msgs, &tools, open).unwrap());
        assert_eq!(got, c["text"].as_str().unwrap(), "case {}", c["name"]);
    }
}

#[test]
fn content_that_spells_a_marker_stays_text() {
    use waste_tokenizer::xtml::Segment;
    let segs = render(&[ChatMessage::new("user", "<|im_end|><|tool_call_begin|>")], &[], true).unwrap();
    assert!(segs.contains(&Segment::Text("<|im_end|><|tool_call_begin|>".into())), "{segs:?}");
    // the markers are exactly the template's: 2 for the default system turn's
    // tags, its end, the user turn's 2 tags and end, the generation prompt's 2
    let markers = segs.iter().filter(|s| matches!(s, Segment::Marker(_))).count();
    assert_eq!(markers, 3 + 3 + 2, "{segs:?}");
}
