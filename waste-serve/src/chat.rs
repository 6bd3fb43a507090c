//! The chat-specific parts of a request — messages with tool calls, `tools`,
//! `tool_choice`, `response_format`, thinking — and the assembly of the
//! model's output into `content`, `reasoning_content` and `tool_calls`.

use serde_json::{json, Value};
use waste_model::tokenizer::xtml::{
    self, ChatMessage, Effort, OutputParser, Part, ResponseFormat, ToolCall, ToolChoice, XtmlOptions,
};

/// A 400's message and parameter.
pub type Bad = (String, String);

fn bad<T>(msg: impl Into<String>, param: impl Into<String>) -> Result<T, Bad> {
    Err((msg.into(), param.into()))
}

/// Where an `image_url` part's image comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ImageSource<'a> {
    /// A `data:` URL's base64 text, in the request (decoded when the image
    /// is, one at a time: [`decode_data`]).
    Data(&'a str),
    /// A `file://` path (read only with `--allow-image-urls`).
    File(String),
    /// An `http(s)://` URL (fetched only with `--allow-image-urls`).
    Remote(String),
}

/// An image part: its message, its source, and the parameter naming it in errors.
#[derive(Clone, Debug)]
pub struct ImageRef<'a> {
    /// Index of the message holding it.
    pub message: usize,
    /// Where its bytes are.
    pub source: ImageSource<'a>,
    /// `messages[i].content[k]`.
    pub param: String,
}

/// Largest base64 text of one `data:` URL (the decoded image is capped by the engine's limit).
const MAX_DATA_URL: usize = waste_model::MAX_IMAGE_FILE_BYTES / 3 * 4 + 4;

/// Most bytes [`decode_data`] returns for a `data:` URL's base64 text.
pub fn decoded_len(data: &str) -> usize {
    data.len().div_ceil(4) * 3
}

/// A `data:` URL's base64 text (from [`ImageSource::Data`]) decoded.
///
/// # Errors
/// Text that is not base64.
pub fn decode_data(data: &str, param: &str) -> Result<Vec<u8>, Bad> {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD
        .decode(data.trim_end())
        .map_err(|e| (format!("the data: URL is not valid base64: {e}"), param.to_string()))
}

fn image_part<'a>(p: &'a Value, param: &str) -> Result<ImageSource<'a>, Bad> {
    let url = p.get("image_url").and_then(|u| u.get("url").or(Some(u))).and_then(|u| u.as_str()).unwrap_or("");
    if let Some(rest) = url.strip_prefix("data:") {
        let Some((_, data)) = rest.split_once(";base64,") else {
            return bad("a data: image URL must be base64 (data:image/png;base64,...)", param);
        };
        if data.len() > MAX_DATA_URL {
            return bad(format!("the image is larger than {} bytes", waste_model::MAX_IMAGE_FILE_BYTES), param);
        }
        return Ok(ImageSource::Data(data));
    }
    if let Some(path) = url.strip_prefix("file://") {
        return Ok(ImageSource::File(path.to_string()));
    }
    if url.is_empty() {
        return bad("image_url needs a url", param);
    }
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        return bad("image URLs must be data:, http(s):// or file://", param);
    }
    if url.len() > 4096 {
        return bad("the image URL is longer than 4096 bytes", param);
    }
    Ok(ImageSource::Remote(url.to_string()))
}

/// A message's text, and its images (in order) into `images`.
fn content_text<'a>(m: &'a Value, i: usize, images: &mut Vec<ImageRef<'a>>) -> Result<String, Bad> {
    let param = format!("messages[{i}].content");
    match m.get("content") {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut s = String::new();
            for (k, p) in parts.iter().enumerate() {
                match p.get("type").and_then(|t| t.as_str()) {
                    Some("text") => match p.get("text").and_then(|t| t.as_str()) {
                        Some(t) => s.push_str(t),
                        None => return bad("text parts need a text string", param),
                    },
                    Some("image_url") => {
                        let at = format!("{param}[{k}]");
                        if m.get("role").and_then(|r| r.as_str()) != Some("user") {
                            return bad("images are accepted in user messages", at);
                        }
                        let source = image_part(p, &at)?;
                        images.push(ImageRef { message: i, source, param: at });
                    }
                    _ => return bad("unknown content part type", param),
                }
            }
            Ok(s)
        }
        Some(_) => bad("content must be a string or an array of parts", param),
    }
}

/// OpenAI function names: letters, digits, `_`, `-`, at most 64.
fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 64
        && n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.')
}

fn tool_calls(m: &Value, i: usize) -> Result<Vec<ToolCall>, Bad> {
    let param = format!("messages[{i}].tool_calls");
    let Some(tc) = m.get("tool_calls").filter(|t| !t.is_null()) else {
        return Ok(vec![]);
    };
    let Some(arr) = tc.as_array() else {
        return bad("tool_calls must be an array", param);
    };
    let mut out = Vec::new();
    for (k, c) in arr.iter().enumerate() {
        let f = c.get("function").ok_or_else(|| (format!("tool_calls[{k}] needs a function"), param.clone()))?;
        let name = f
            .get("name")
            .and_then(|n| n.as_str())
            .ok_or_else(|| (format!("tool_calls[{k}].function needs a name"), param.clone()))?;
        let arguments = match f.get("arguments") {
            None | Some(Value::Null) => "{}".to_string(),
            Some(Value::String(s)) => s.clone(),
            Some(v @ Value::Object(_)) => v.to_string(),
            Some(_) => return bad(format!("tool_calls[{k}].function.arguments must be a JSON string"), param),
        };
        let id = c.get("id").and_then(|x| x.as_str()).unwrap_or_default().to_string();
        out.push(ToolCall { id, name: name.to_string(), arguments });
    }
    Ok(out)
}

/// `messages`.
pub fn messages(v: &Value) -> Result<Vec<ChatMessage>, Bad> {
    messages_with_images(v).map(|(m, _)| m)
}

/// [`messages`], and the image parts of the user messages in order (their
/// messages' `images` are filled in once the images' sizes are known).
///
/// # Errors
/// As [`messages`], and for an image part that is malformed or outside a user message.
pub fn messages_with_images(v: &Value) -> Result<(Vec<ChatMessage>, Vec<ImageRef<'_>>), Bad> {
    let mut images = Vec::new();
    let arr = match v.get("messages") {
        Some(Value::Array(a)) if !a.is_empty() => a,
        Some(Value::Array(_)) => return bad("messages must not be empty", "messages"),
        Some(_) => return bad("messages must be an array", "messages"),
        None => return bad("messages is required", "messages"),
    };
    let mut out = Vec::with_capacity(arr.len());
    for (i, m) in arr.iter().enumerate() {
        let role = m
            .get("role")
            .and_then(|r| r.as_str())
            .ok_or_else(|| ("each message needs a role".to_string(), format!("messages[{i}].role")))?;
        let role = match role {
            "system" | "developer" => "system",
            "user" | "assistant" | "tool" => role,
            r => return bad(format!("unknown role {r:?}"), format!("messages[{i}].role")),
        };
        let mut msg = ChatMessage::new(role, &content_text(m, i, &mut images)?);
        if role == "assistant" {
            msg.tool_calls = tool_calls(m, i)?;
            msg.reasoning = m
                .get("reasoning_content")
                .or(m.get("reasoning"))
                .and_then(|r| r.as_str())
                .unwrap_or_default()
                .to_string();
        }
        if role == "tool" {
            msg.tool_call_id = m.get("tool_call_id").and_then(|x| x.as_str()).map(str::to_string);
        }
        if role == "system" {
            // tools that become available mid-conversation (the reference's
            // "New Tools Available" block), validated as the top-level ones
            if let Some(t) = m.get("tools").filter(|t| !t.is_null()) {
                msg.tools = tool_list(t, &format!("messages[{i}].tools"))?;
            }
        }
        msg.name = m.get("name").and_then(|x| x.as_str()).map(str::to_string);
        out.push(msg);
    }
    Ok((out, images))
}

/// A `tools` array: function tools with valid, distinct names and object
/// schemas (`at` names it in errors).
fn tool_list(t: &Value, at: &str) -> Result<Vec<Value>, Bad> {
    let Value::Array(a) = t else { return bad("tools must be an array", at) };
    let mut out: Vec<Value> = Vec::with_capacity(a.len());
    for (i, t) in a.iter().enumerate() {
        let p = format!("{at}[{i}]");
        if t.get("type").and_then(|x| x.as_str()) != Some("function") {
            return bad("only tools of type \"function\" are supported", p);
        }
        let f = t
            .get("function")
            .filter(|f| f.is_object())
            .ok_or_else(|| ("a tool needs a function object".to_string(), p.clone()))?;
        let name = f.get("name").and_then(|n| n.as_str()).unwrap_or_default();
        if !valid_name(name) {
            return bad("function names are 1-64 letters, digits, '_', '-' or '.'", format!("{p}.function.name"));
        }
        if f.get("parameters").is_some_and(|x| !x.is_object() && !x.is_null()) {
            return bad("function parameters must be a JSON schema object", format!("{p}.function.parameters"));
        }
        if out.iter().any(|x| x["function"]["name"] == name) {
            return bad(format!("two tools are named {name:?}"), p);
        }
        out.push(t.clone());
    }
    Ok(out)
}

/// `tools`, `tool_choice`, `response_format`, thinking.
pub fn options(v: &Value) -> Result<XtmlOptions, Bad> {
    let mut o = XtmlOptions::default();
    if let Some(t) = v.get("tools").filter(|t| !t.is_null()) {
        o.tools = tool_list(t, "tools")?;
    }
    if v.get("functions").is_some_and(|f| !f.is_null()) {
        return bad("the deprecated functions parameter is not supported; use tools", "functions");
    }
    o.tool_choice = match v.get("tool_choice") {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            _ => return bad("tool_choice must be none, auto, required or a function", "tool_choice"),
        },
        Some(x) => match x.get("function").and_then(|f| f.get("name")).and_then(|n| n.as_str()) {
            Some(n) => ToolChoice::Function(n.to_string()),
            None => return bad(
                "tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                "tool_choice",
            ),
        },
    };
    match &o.tool_choice {
        ToolChoice::Required if o.tools.is_empty() => return bad("tool_choice required needs tools", "tool_choice"),
        ToolChoice::Function(n) if !o.tools.iter().any(|t| t["function"]["name"] == n.as_str()) => {
            return bad(format!("tool_choice names {n:?}, which is not among the tools"), "tool_choice")
        }
        _ => {}
    }
    o.response_format = match v.get("response_format") {
        None | Some(Value::Null) => None,
        Some(rf) => match rf.get("type").and_then(|t| t.as_str()) {
            Some("text") => None,
            Some("json_object") => Some(ResponseFormat::JsonObject),
            Some("json_schema") => match rf.get("json_schema").and_then(|j| j.get("schema")) {
                Some(s) if s.is_object() => Some(ResponseFormat::JsonSchema(s.clone())),
                _ => return bad("response_format json_schema needs json_schema.schema (an object)", "response_format"),
            },
            _ => return bad("response_format type must be text, json_object or json_schema", "response_format"),
        },
    };
    if o.response_format.is_some() && matches!(o.tool_choice, ToolChoice::Required | ToolChoice::Function(_)) {
        return bad("response_format cannot be combined with a forced tool_choice", "response_format");
    }
    // thinking: on (the reference template's default: thinking_effort max) unless turned off
    o.thinking = Some(Effort::Max);
    let effort = v.get("reasoning_effort").filter(|e| !e.is_null());
    match v.get("thinking") {
        Some(Value::Bool(_)) if effort.is_some() => {
            return bad("thinking (a boolean) and reasoning_effort cannot be combined: send one of them", "thinking")
        }
        Some(Value::Bool(false)) => o.thinking = None,
        _ => {}
    }
    if let Some(e) = effort {
        o.thinking = match e.as_str() {
            Some("none") => None,
            Some("minimal") | Some("low") => Some(Effort::Low),
            Some("medium") => Some(Effort::Medium),
            Some("high") => Some(Effort::High),
            Some("xhigh") | Some("max") => Some(Effort::Max),
            _ => {
                return bad(
                    "reasoning_effort must be none, minimal, low, medium, high, xhigh or max",
                    "reasoning_effort",
                )
            }
        };
    }
    let kw = v.get("chat_template_kwargs");
    match kw.and_then(|k| k.get("thinking")).or_else(|| kw.and_then(|k| k.get("enable_thinking"))) {
        None | Some(Value::Null) => {}
        Some(Value::Bool(false)) => o.thinking = None,
        Some(Value::Bool(true)) => o.thinking = o.thinking.or(Some(Effort::Max)),
        Some(_) => return bad("chat_template_kwargs.thinking must be a boolean", "chat_template_kwargs"),
    }
    if let Some(t) = v.get("thinking").filter(|t| t.is_object()).and_then(|t| t.get("type")).and_then(|t| t.as_str()) {
        match t {
            "disabled" => o.thinking = None,
            "enabled" => o.thinking = o.thinking.or(Some(Effort::Max)),
            _ => return bad("thinking.type must be enabled or disabled", "thinking"),
        }
    }
    Ok(o)
}

/// The chat format a model's prompts and answers are written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Markup {
    /// A template with no tool or thinking markup: the output is the answer.
    Plain,
    /// K3's tagged format (tools, thinking, structured output).
    Xtml,
    /// The Kimi K2 family's format (Kimi-Linear's: tools).
    K2,
}

impl Markup {
    /// The format of `model`'s chat template.
    pub fn of(model: &waste_model::Model) -> Markup {
        if model.is_xtml() {
            Markup::Xtml
        } else if model.is_k2() {
            Markup::K2
        } else {
            Markup::Plain
        }
    }
}

enum Parser {
    Xtml(OutputParser),
    K2(waste_model::tokenizer::k2::OutputParser),
}

/// The output of one generation, parsed as it streams.
pub struct Assembler {
    parser: Option<Parser>,
    keep_calls: bool,
    id_base: String,
    /// Answer text.
    pub content: String,
    /// Reasoning text.
    pub reasoning: String,
    /// Tool calls as OpenAI objects.
    pub calls: Vec<Value>,
}

impl Assembler {
    /// For output in `markup` (thinking: the prompt opened K3's `think`),
    /// reporting tool calls when `keep_calls`.
    pub fn new(markup: Markup, thinking: bool, keep_calls: bool, id_base: &str) -> Assembler {
        Assembler {
            parser: match markup {
                Markup::Plain => None,
                Markup::Xtml => Some(Parser::Xtml(OutputParser::new(thinking))),
                Markup::K2 => Some(Parser::K2(Default::default())),
            },
            keep_calls,
            id_base: id_base.to_string(),
            content: String::new(),
            reasoning: String::new(),
            calls: Vec::new(),
        }
    }

    /// Feed a piece; returns the delta objects it produced (for streaming).
    pub fn push(&mut self, piece: &str) -> Vec<Value> {
        let parts = match self.parser.as_mut() {
            None => {
                self.content.push_str(piece);
                return if piece.is_empty() { vec![] } else { vec![json!({"content": piece})] };
            }
            Some(Parser::Xtml(p)) => p.push(piece),
            Some(Parser::K2(p)) => p.push(piece),
        };
        let mut out = Vec::new();
        for part in parts {
            match part {
                Part::Reasoning(r) => {
                    self.reasoning.push_str(&r);
                    out.push(json!({"reasoning_content": r}));
                }
                Part::Content(c) => {
                    self.content.push_str(&c);
                    out.push(json!({"content": c}));
                }
                Part::ToolCall { index, name, arguments } if self.keep_calls => {
                    let call = json!({"id": format!("call_{}_{index}", self.id_base), "type": "function", "function": {"name": name, "arguments": arguments}});
                    let mut d = call.clone();
                    d["index"] = json!(index);
                    self.calls.push(call);
                    out.push(json!({"tool_calls": [d]}));
                }
                Part::ToolCall { .. } => {}
            }
        }
        out
    }

    /// OpenAI's finish reason given the engine's.
    pub fn finish_reason(&self, engine: &str) -> &'static str {
        match engine {
            "stop" if !self.calls.is_empty() => "tool_calls",
            "stop" => "stop",
            "length" => "length",
            _ => "stop",
        }
    }

    /// The assistant message of a non-streamed response.
    pub fn message(&self) -> Value {
        let mut m = json!({"role": "assistant", "content": if self.content.is_empty() && !self.calls.is_empty() { Value::Null } else { json!(self.content) }});
        if !self.reasoning.is_empty() {
            m["reasoning_content"] = json!(self.reasoning);
        }
        if !self.calls.is_empty() {
            m["tool_calls"] = json!(self.calls);
        }
        m
    }
}

/// The special-token name that ends an assistant message in XTML.
pub const END_OF_MSG: &str = xtml::END_OF_MSG;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const KEYS: &[&str] = &[
        "role",
        "content",
        "tool_calls",
        "function",
        "name",
        "arguments",
        "type",
        "tools",
        "tool_choice",
        "response_format",
        "json_schema",
        "schema",
        "reasoning_effort",
        "chat_template_kwargs",
        "thinking",
        "enable_thinking",
        "parameters",
        "messages",
        "id",
        "tool_call_id",
        "text",
        "image_url",
        "url",
        "reasoning_content",
        "functions",
    ];
    const WORDS: &[&str] = &[
        "user",
        "assistant",
        "system",
        "tool",
        "developer",
        "function",
        "auto",
        "none",
        "required",
        "json_object",
        "json_schema",
        "text",
        "image_url",
        "low",
        "max",
        "disabled",
        "enabled",
        "f",
        "data:x",
        "{}",
        "{\"a\":1}",
    ];

    fn json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i32>().prop_map(|i| json!(i)),
            prop::sample::select(WORDS).prop_map(|w| json!(w)),
            "\\PC{0,8}".prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 48, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
                prop::collection::vec((prop::sample::select(KEYS), inner), 0..6)
                    .prop_map(|kv| Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect())),
            ]
        })
    }

    proptest! {
        /// Any request body: a value or a 400, never a panic.
        #[test]
        fn any_request_is_parsed_or_refused(v in json()) {
            let _ = messages(&v);
            let _ = options(&v);
        }
    }

    #[test]
    fn assembler_reports_tool_calls_and_reasoning() {
        let mk = |s: &str| format!("\u{F8F2}{s}\u{F8F3}");
        let mut a = Assembler::new(Markup::Xtml, true, true, "7");
        let text = format!(
            "hm{}think{}{}call tool=\"f\" index=\"1\"{}{}call{}",
            mk("<|close|>"),
            mk("<|sep|>"),
            mk("<|open|>"),
            mk("<|sep|>"),
            mk("<|close|>"),
            mk("<|sep|>")
        );
        let deltas = a.push(&text);
        assert_eq!(deltas[0], json!({"reasoning_content": "hm"}));
        assert_eq!(deltas[1]["tool_calls"][0]["function"]["name"], "f");
        assert_eq!(deltas[1]["tool_calls"][0]["index"], 0);
        assert_eq!(a.finish_reason("stop"), "tool_calls");
        assert_eq!(a.message()["content"], Value::Null);
        assert_eq!(a.message()["tool_calls"][0]["id"], "call_7_0");
        // with tool_choice none, calls are not reported
        let mut b = Assembler::new(Markup::Xtml, true, false, "8");
        b.push(&text);
        assert_eq!(b.finish_reason("stop"), "stop");
        assert!(b.message().get("tool_calls").is_none());
    }

    #[test]
    fn thinking_as_the_reference_takes_it() {
        // a boolean `thinking` turns it off or on; beside reasoning_effort it is refused
        assert!(options(&json!({"thinking": false})).unwrap().thinking.is_none());
        assert_eq!(options(&json!({"thinking": true})).unwrap().thinking, Some(Effort::Max));
        let e = options(&json!({"thinking": false, "reasoning_effort": "low"})).unwrap_err();
        assert_eq!(e.1, "thinking");
        assert!(options(&json!({"thinking": true, "reasoning_effort": "high"})).is_err());
        // every value the reference template accepts, medium included
        for (v, e) in [("low", Effort::Low), ("medium", Effort::Medium), ("high", Effort::High), ("max", Effort::Max)] {
            assert_eq!(options(&json!({"reasoning_effort": v})).unwrap().thinking, Some(e), "{v}");
        }
        // tools on a system message are validated like top-level ones
        let ok =
            json!({"messages": [{"role": "system", "tools": [{"type": "function", "function": {"name": "late"}}]}]});
        assert_eq!(messages(&ok).unwrap()[0].tools.len(), 1);
        let bad =
            json!({"messages": [{"role": "system", "tools": [{"type": "function", "function": {"name": "a b"}}]}]});
        assert_eq!(messages(&bad).unwrap_err().1, "messages[0].tools[0].function.name");
    }

    #[test]
    fn options_validate_what_openai_validates() {
        let t = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]);
        assert!(options(
            &json!({"tools": t, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
        )
        .is_ok());
        assert_eq!(
            options(&json!({"tools": t, "tool_choice": {"type": "function", "function": {"name": "other"}}}))
                .unwrap_err()
                .1,
            "tool_choice"
        );
        assert_eq!(options(&json!({"tool_choice": "required"})).unwrap_err().1, "tool_choice");
        assert_eq!(
            options(&json!({"tools": [{"type": "function", "function": {"name": "a b"}}]})).unwrap_err().1,
            "tools[0].function.name"
        );
        assert_eq!(
            options(&json!({"tools": t.as_array().unwrap().iter().chain(t.as_array().unwrap()).collect::<Vec<_>>()}))
                .unwrap_err()
                .1,
            "tools[1]"
        );
        assert_eq!(
            options(&json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})).unwrap_err().1,
            "response_format"
        );
        assert!(options(&json!({"reasoning_effort": "none"})).unwrap().thinking.is_none());
        assert_eq!(options(&json!({})).unwrap().thinking, Some(Effort::Max));
        assert!(options(&json!({"chat_template_kwargs": {"thinking": false}})).unwrap().thinking.is_none());
        assert!(options(&json!({"thinking": {"type": "disabled"}})).unwrap().thinking.is_none());
        let m = messages(&json!({"messages": [{"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{\"x\":1}"}}]}, {"role": "tool", "tool_call_id": "c", "content": "ok"}]})).unwrap();
        assert_eq!(m[0].tool_calls[0].arguments, "{\"x\":1}");
        assert_eq!(m[1].tool_call_id.as_deref(), Some("c"));
    }
}
