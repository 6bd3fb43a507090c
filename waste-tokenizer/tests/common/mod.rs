//! Shared by the chat-template fixture tests: a fixture's message (the
//! OpenAI-style JSON the reference template rendered) as the renderers'.

use serde_json::Value;
use waste_tokenizer::xtml::{ChatMessage, ToolCall};

/// `m` as a `ChatMessage`; `arguments` writes a tool call's arguments as
/// the engine receives them (K3's fixtures hold objects, K2's strings).
pub fn message(m: &Value, arguments: fn(&Value) -> String) -> ChatMessage {
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
                        arguments: arguments(&c["function"]["arguments"]),
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
