//! Kimi K3's chat format ("XTML"): tagged sections built from three markers,
//! `<|open|>tag k="v"…<|sep|>` … `<|close|>tag<|sep|>`, each message ended by
//! `<|end_of_msg|>`. This renders a whole conversation — tool declarations,
//! thinking, assistant tool calls, tool results, `tool_choice` and
//! `response_format` notices — the way the reference template
//! (`Kimi-K3.jinja`, shipped with llama.cpp) does, and parses the model's
//! output back into reasoning, content and tool calls.
//!
//! Rendering produces [`Segment`]s: markers become their special token ids,
//! every run of text between two markers is tokenized as one plain run. So
//! nothing a client sends (content, tool names, schemas) can become a marker,
//! and a run is split exactly where the reference splits it.

use crate::{Error, Result, Tokenizer};
use serde_json::Value;

/// The opening marker.
pub const OPEN: &str = "<|open|>";
/// The closing marker.
pub const CLOSE: &str = "<|close|>";
/// Ends a tag header.
pub const SEP: &str = "<|sep|>";
/// Ends a message.
pub const END_OF_MSG: &str = "<|end_of_msg|>";

/// A tool call made by the assistant.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    /// Call id (OpenAI `tool_calls[].id`).
    pub id: String,
    /// Function name.
    pub name: String,
    /// Arguments as JSON text (an object).
    pub arguments: String,
}

/// One message of a conversation.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`.
    pub role: String,
    /// Text content.
    pub content: String,
    /// The assistant's reasoning (rendered only when thinking is on).
    pub reasoning: String,
    /// The assistant's tool calls.
    pub tool_calls: Vec<ToolCall>,
    /// A tool result's call id.
    pub tool_call_id: Option<String>,
    /// Optional participant / tool name.
    pub name: Option<String>,
    /// Tools that become available at this point (a system message carrying
    /// `tools`: rendered as the reference's "New Tools Available" block).
    pub tools: Vec<Value>,
    /// Images announced at the start of a user message's body, by their
    /// files' `(width, height)` ([`crate::chat::image_markup`]).
    pub images: Vec<(u32, u32)>,
}

impl ChatMessage {
    /// A plain message.
    pub fn new(role: &str, content: &str) -> ChatMessage {
        ChatMessage { role: role.into(), content: content.into(), ..Default::default() }
    }
}

/// `tool_choice`.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum ToolChoice {
    /// The model decides.
    #[default]
    Auto,
    /// No tool calls.
    None,
    /// At least one tool call.
    Required,
    /// A call of this function.
    Function(String),
}

/// How hard to think (K3's `thinking_effort`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Effort {
    /// `low`.
    Low,
    /// `medium`.
    Medium,
    /// `high`.
    High,
    /// `max` (the reference default).
    Max,
}

impl Effort {
    fn name(self) -> &'static str {
        match self {
            Effort::Low => "low",
            Effort::Medium => "medium",
            Effort::High => "high",
            Effort::Max => "max",
        }
    }
}

/// `response_format`.
#[derive(Clone, Debug, PartialEq)]
pub enum ResponseFormat {
    /// Any JSON object.
    JsonObject,
    /// JSON matching this schema.
    JsonSchema(Value),
}

/// Everything besides the messages that shapes the prompt.
#[derive(Clone, Debug, Default)]
pub struct XtmlOptions {
    /// OpenAI tool objects (`{"type": "function", "function": {...}}`).
    pub tools: Vec<Value>,
    /// `tool_choice`.
    pub tool_choice: ToolChoice,
    /// Thinking on (with an effort) or off.
    pub thinking: Option<Effort>,
    /// `response_format`.
    pub response_format: Option<ResponseFormat>,
}

/// A piece of a rendered prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Segment {
    /// A marker (special token).
    Marker(&'static str),
    /// Text, tokenized as plain text.
    Text(String),
}

/// A rendered prompt as plain text, each marker written as its token's text
/// (what the reference template prints; for display and comparison).
pub fn text(segs: &[Segment]) -> String {
    segs.iter()
        .map(|s| match s {
            Segment::Marker(m) => m,
            Segment::Text(t) => t.as_str(),
        })
        .collect()
}

/// Whether a tokenizer has the markers this format needs.
pub fn supported(tok: &Tokenizer) -> bool {
    [OPEN, CLOSE, SEP, END_OF_MSG].iter().all(|m| tok.special_id(m).is_some())
}

fn escape_attr(v: &str) -> String {
    v.replace('&', "&amp;").replace('"', "&quot;")
}

/// JSON with object keys sorted and no spaces, non-ASCII kept (the
/// reference's `json_sorted`).
pub fn json_sorted(v: &Value) -> String {
    match v {
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            let inner: Vec<String> =
                keys.iter().map(|k| format!("{}:{}", Value::String((*k).clone()), json_sorted(&m[*k]))).collect();
            format!("{{{}}}", inner.join(","))
        }
        Value::Array(a) => format!("[{}]", a.iter().map(json_sorted).collect::<Vec<_>>().join(",")),
        other => other.to_string(),
    }
}

/// JSON as Python's `json.dumps(v, ensure_ascii=False)` writes it — what the
/// reference template's `tojson` gives for a non-string tool-call argument:
/// `", "` and `": "` separators, keys in their order, floats as Python's
/// `repr` (`1e-07`, `1e+16`).
pub fn json_py(v: &Value) -> String {
    match v {
        Value::Object(m) => {
            let inner: Vec<String> =
                m.iter().map(|(k, x)| format!("{}: {}", Value::String(k.clone()), json_py(x))).collect();
            format!("{{{}}}", inner.join(", "))
        }
        Value::Array(a) => format!("[{}]", a.iter().map(json_py).collect::<Vec<_>>().join(", ")),
        Value::Number(n) if n.is_f64() => {
            let t = n.to_string();
            match t.split_once('e') {
                // Python: an explicit sign and at least two exponent digits
                Some((m, e)) => {
                    let (sign, digits) = e.strip_prefix('-').map_or(("+", e), |d| ("-", d));
                    format!("{m}e{sign}{digits:0>2}")
                }
                None => t,
            }
        }
        other => other.to_string(),
    }
}

/// XTML type name of a JSON value.
fn xtml_type(v: &Value) -> &'static str {
    match v {
        Value::Bool(_) => "boolean",
        Value::Null => "null",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Object(_) => "object",
        Value::Array(_) => "array",
    }
}

struct Out(Vec<Segment>);

impl Out {
    fn marker(&mut self, m: &'static str) {
        self.0.push(Segment::Marker(m));
    }
    fn text(&mut self, t: &str) {
        if t.is_empty() {
            return;
        }
        if let Some(Segment::Text(s)) = self.0.last_mut() {
            s.push_str(t);
        } else {
            self.0.push(Segment::Text(t.to_string()));
        }
    }
    fn open(&mut self, tag: &str, attrs: &[(&str, &str)]) {
        self.marker(OPEN);
        let mut h = tag.to_string();
        for (k, v) in attrs {
            h.push_str(&format!(" {k}=\"{}\"", escape_attr(v)));
        }
        self.text(&h);
        self.marker(SEP);
    }
    fn close(&mut self, tag: &str) {
        self.marker(CLOSE);
        self.text(tag);
        self.marker(SEP);
    }
    fn message(&mut self, attrs: &[(&str, &str)], body: &str) {
        self.message_with_images(attrs, &[], body);
    }
    fn message_with_images(&mut self, attrs: &[(&str, &str)], images: &[(u32, u32)], body: &str) {
        use crate::chat::{MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD};
        self.open("message", attrs);
        for (w, h) in images {
            self.marker(MEDIA_BEGIN);
            self.text(&format!("image {w}x{h}"));
            self.marker(MEDIA_CONTENT);
            self.marker(MEDIA_PAD);
            self.marker(MEDIA_END);
        }
        self.text(body);
        self.close("message");
        self.marker(END_OF_MSG);
    }
    fn system_notice(&mut self, kind: &str, body: &str) {
        self.message(&[("role", "system"), ("type", kind)], body.trim());
    }
}

fn render_assistant(o: &mut Out, m: &ChatMessage, thinking: bool) {
    if thinking {
        o.open("think", &[]);
        if !m.reasoning.trim().is_empty() {
            o.text(&m.reasoning);
        }
        o.close("think");
    }
    o.open("response", &[]);
    o.text(&m.content);
    o.close("response");
    if m.tool_calls.is_empty() {
        return;
    }
    o.open("tools", &[]);
    for (i, c) in m.tool_calls.iter().enumerate() {
        o.open("call", &[("tool", &c.name), ("index", &(i + 1).to_string())]);
        match serde_json::from_str::<Value>(&c.arguments) {
            Ok(Value::Object(args)) => {
                for (k, v) in &args {
                    o.open("argument", &[("key", k), ("type", xtml_type(v))]);
                    match v {
                        Value::String(s) => o.text(s),
                        v => o.text(&json_py(v)),
                    }
                    o.close("argument");
                }
            }
            _ if !c.arguments.trim().is_empty() => {
                o.open("json", &[("type", "object")]);
                o.text(&c.arguments);
                o.close("json");
            }
            _ => {}
        }
        o.close("call");
    }
    o.close("tools");
}

/// A rendered conversation and where its parts end (segment indices).
struct Rendered {
    segs: Vec<Segment>,
    /// End of the leading notices (tools, thinking effort).
    head: usize,
    /// End of the last message.
    messages_end: usize,
}

/// Render a conversation; with `open`, end with the assistant's generation
/// prompt (which opens `think` when thinking is on, else `response`).
///
/// # Errors
/// [`Error::Template`] for an unknown role or a tool message whose tool cannot be named.
pub fn render(messages: &[ChatMessage], opts: &XtmlOptions, open: bool) -> Result<Vec<Segment>> {
    Ok(render_parts(messages, opts, open)?.segs)
}

// Every part ends with a marker (`<|end_of_msg|>`), so no text run spans
// two parts and the parts tokenize independently.
fn render_parts(messages: &[ChatMessage], opts: &XtmlOptions, open: bool) -> Result<Rendered> {
    let mut o = Out(Vec::new());
    if !opts.tools.is_empty() {
        let body = format!(
            "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{}\n```",
            json_sorted(&Value::Array(opts.tools.clone()))
        );
        o.system_notice("tool-declare", &body);
    }
    if let Some(e) = opts.thinking {
        o.system_notice("thinking-effort", &format!("`thinking_effort` guides on how much to think in your thinking channel (not including the response channel), supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked with `thinking_effort={}`.", e.name()));
    }
    let head = o.0.len();
    let mut calls: &[ToolCall] = &[];
    let mut i = 0;
    while i < messages.len() {
        let m = &messages[i];
        let named = |role: &'static str| -> Vec<(&str, &str)> {
            let mut a = vec![("role", role)];
            if let Some(n) = m.name.as_deref().filter(|n| !n.is_empty()) {
                a.push(("name", n));
            }
            a
        };
        match m.role.as_str() {
            "user" => o.message_with_images(&named("user"), &m.images, &m.content),
            "system" if !m.tools.is_empty() => {
                let body = format!(
                    "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\nYou have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n```json\n{}\n```",
                    json_sorted(&Value::Array(m.tools.clone()))
                );
                o.message(&[("role", "system"), ("type", "tool-declare")], &body);
            }
            "system" => o.message(&named("system"), &m.content),
            "assistant" => {
                calls = &m.tool_calls;
                o.open("message", &named("assistant"));
                render_assistant(&mut o, m, opts.thinking.is_some());
                o.close("message");
                o.marker(END_OF_MSG);
            }
            "tool" => {
                // a run of tool results: in the calls' order when every id resolves
                let run: Vec<&ChatMessage> = messages[i..].iter().take_while(|t| t.role == "tool").collect();
                let by_id = |t: &ChatMessage| t.tool_call_id.as_ref().and_then(|id| calls.iter().find(|c| &c.id == id));
                let ordered: Vec<(&ChatMessage, String)> = if run.iter().all(|t| by_id(t).is_some()) {
                    let mut seen: Vec<&str> = Vec::new();
                    let mut v = Vec::new();
                    for c in calls {
                        if seen.contains(&c.id.as_str()) {
                            continue;
                        }
                        seen.push(&c.id);
                        v.extend(
                            run.iter()
                                .filter(|t| t.tool_call_id.as_deref() == Some(c.id.as_str()))
                                .map(|t| (*t, c.name.clone())),
                        );
                    }
                    v
                } else {
                    let mut v = Vec::new();
                    for (k, t) in run.iter().enumerate() {
                        let name =
                            t.name.clone().or_else(|| calls.get(k).map(|c| c.name.clone())).ok_or_else(|| {
                                Error::Template(format!(
                                    "tool message {}: no tool name (give tool_call_id of a preceding call, or name)",
                                    i + k
                                ))
                            })?;
                        v.push((*t, name));
                    }
                    v
                };
                for (k, (t, name)) in ordered.iter().enumerate() {
                    o.message(&[("role", "tool"), ("tool", name), ("index", &(k + 1).to_string())], &t.content);
                }
                i += run.len();
                continue;
            }
            r => return Err(Error::Template(format!("no template for role {r:?}"))),
        }
        i += 1;
    }
    let messages_end = o.0.len();
    match opts.tool_choice {
        ToolChoice::Required => o.system_notice(
            "tool-choice",
            "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
        ),
        ToolChoice::None if !opts.tools.is_empty() => o.system_notice(
            "tool-choice",
            "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.",
        ),
        _ => {}
    }
    match &opts.response_format {
        Some(ResponseFormat::JsonObject) => o.system_notice("response-format", "The system is invoked with `response_format=json_object`.\nYour response must be raw JSON data without markdown code blocks (```json) or any additional formatting."),
        Some(ResponseFormat::JsonSchema(s)) => o.system_notice("response-format", &format!("The system is invoked with `response_format=json_schema`.\nYour response must be raw JSON data without markdown code blocks (```json) or any additional formatting.\nThe JSON data must match the following schema:\n```json\n{}\n```", json_sorted(s))),
        None => {}
    }
    if open {
        o.open("message", &[("role", "assistant")]);
        o.open(if opts.thinking.is_some() { "think" } else { "response" }, &[]);
    }
    Ok(Rendered { segs: o.0, head, messages_end })
}

/// A tokenized conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Encoded {
    /// Token ids.
    pub ids: Vec<u32>,
    /// Tokens before the first message (the tools and thinking notices).
    pub head: usize,
    /// Tokens up to the end of the last message — before the `tool_choice`
    /// / `response_format` notices and the generation prompt, which change
    /// from request to request (where a follow-up turn can resume).
    pub messages_end: usize,
}

/// Render and tokenize: markers by id, each text run as plain text.
///
/// # Errors
/// As [`render`], and [`Error::Template`] when the tokenizer lacks a marker.
pub fn encode(tok: &Tokenizer, messages: &[ChatMessage], opts: &XtmlOptions, open: bool) -> Result<Encoded> {
    let r = render_parts(messages, opts, open)?;
    encode_segments(tok, r.segs, r.head, r.messages_end)
}

/// Tokenize rendered segments (markers by id, text runs plain), with the
/// token counts where the segments `head` and `messages_end` begin.
pub(crate) fn encode_segments(
    tok: &Tokenizer,
    segs: Vec<Segment>,
    head: usize,
    messages_end: usize,
) -> Result<Encoded> {
    let total = segs.len();
    let mut out = Encoded { ids: Vec::new(), head: 0, messages_end: 0 };
    for (k, s) in segs.into_iter().enumerate() {
        if k == head {
            out.head = out.ids.len();
        }
        if k == messages_end {
            out.messages_end = out.ids.len();
        }
        match s {
            Segment::Marker(m) => {
                out.ids.push(tok.special_id(m).ok_or_else(|| Error::Template(format!("the tokenizer has no {m}")))?)
            }
            Segment::Text(t) => out.ids.extend(tok.encode_plain(&t)),
        }
    }
    // a part that ends the rendering ends at the last token
    if head == total {
        out.head = out.ids.len();
    }
    if messages_end == total {
        out.messages_end = out.ids.len();
    }
    Ok(out)
}

/// What the parser found in a piece of output.
#[derive(Clone, Debug, PartialEq)]
pub enum Part {
    /// Reasoning text (the `think` section).
    Reasoning(String),
    /// Answer text (the `response` section).
    Content(String),
    /// A complete tool call (`index` counts calls from 0).
    ToolCall {
        /// 0-based call number.
        index: usize,
        /// Function name.
        name: String,
        /// Arguments as JSON text.
        arguments: String,
    },
}

#[derive(Clone, Debug, PartialEq)]
enum Sec {
    Think,
    Response,
    Tools,
    Call { name: String, args: serde_json::Map<String, Value>, json: Option<String> },
    Argument { key: String, kind: String, value: String },
    Json(String),
    Other(String),
}

fn sec_name(s: &Sec) -> &str {
    match s {
        Sec::Think => "think",
        Sec::Response => "response",
        Sec::Tools => "tools",
        Sec::Call { .. } => "call",
        Sec::Argument { .. } => "argument",
        Sec::Json(_) => "json",
        Sec::Other(n) => n,
    }
}

/// `tag k="v" …` → (tag, attributes), attribute values unescaped.
fn parse_header(h: &str) -> (String, Vec<(String, String)>) {
    let h = h.trim();
    let (tag, mut rest) = h.split_once(' ').unwrap_or((h, ""));
    let mut attrs = Vec::new();
    while let Some(eq) = rest.find("=\"") {
        let key = rest[..eq].trim().to_string();
        let after = &rest[eq + 2..];
        let end = after.find('"').unwrap_or(after.len());
        attrs.push((key, after[..end].replace("&quot;", "\"").replace("&amp;", "&")));
        rest = after.get(end + 1..).unwrap_or("");
    }
    (tag.to_string(), attrs)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Body,
    Header,
    Closer,
}

/// Streaming parser of the assistant's output, given as *marked* text (see
/// `waste_model::GenerateParams::mark_specials`: markers arrive as
/// `U+F8F2 <|open|> U+F8F3`, so text that merely looks like a marker stays
/// text). Feed pieces as they come; every call returns what became final.
#[derive(Clone, Debug)]
pub struct OutputParser {
    stack: Vec<Sec>,
    mode: Mode,
    buf: String,
    raw: String,
    calls: usize,
    ended: bool,
}

const MARK_OPEN: char = '\u{F8F2}';
const MARK_CLOSE: char = '\u{F8F3}';

/// Take the next run of text from marked output and the marker after it:
/// `(text, Some(marker))` when a whole marker came; `(text, None)` for all
/// the text when no marker follows, or for the text before a marker that
/// has not fully arrived (kept in `raw` for the next piece); `None` once
/// `raw` is empty.
pub(crate) fn next_marker(raw: &mut String) -> Option<(String, Option<String>)> {
    if raw.is_empty() {
        return None;
    }
    let Some(a) = raw.find(MARK_OPEN) else { return Some((std::mem::take(raw), None)) };
    let Some(b) = raw[a..].find(MARK_CLOSE).map(|b| a + b) else {
        let t = raw[..a].to_string();
        raw.drain(..a);
        return Some((t, None));
    };
    let t = raw[..a].to_string();
    let m = raw[a + MARK_OPEN.len_utf8()..b].to_string();
    raw.drain(..b + MARK_CLOSE.len_utf8());
    Some((t, Some(m)))
}

impl OutputParser {
    /// A parser for output that continues a generation prompt which opened
    /// `think` (`thinking`) or `response`.
    pub fn new(thinking: bool) -> OutputParser {
        OutputParser {
            stack: vec![if thinking { Sec::Think } else { Sec::Response }],
            mode: Mode::Body,
            buf: String::new(),
            raw: String::new(),
            calls: 0,
            ended: false,
        }
    }

    /// Whether the message has ended (`<|close|>message` or `<|end_of_msg|>`).
    pub fn ended(&self) -> bool {
        self.ended
    }

    /// Feed marked text.
    pub fn push(&mut self, text: &str) -> Vec<Part> {
        self.raw.push_str(text);
        let mut out = Vec::new();
        while let Some((t, m)) = next_marker(&mut self.raw) {
            self.text(&t, &mut out);
            match m {
                Some(m) => self.marker(&m, &mut out),
                None => break,
            }
        }
        merge_parts(out)
    }

    fn text(&mut self, t: &str, out: &mut Vec<Part>) {
        if t.is_empty() || self.ended {
            return;
        }
        if self.mode != Mode::Body {
            self.buf.push_str(t);
            return;
        }
        match self.stack.last_mut() {
            Some(Sec::Think) => out.push(Part::Reasoning(t.to_string())),
            Some(Sec::Response) | None => out.push(Part::Content(t.to_string())),
            Some(Sec::Argument { value, .. }) => value.push_str(t),
            Some(Sec::Json(s)) => s.push_str(t),
            _ => {} // text between tags of a tools section is layout
        }
    }

    fn marker(&mut self, m: &str, out: &mut Vec<Part>) {
        if self.ended {
            return;
        }
        match m {
            OPEN => {
                self.mode = Mode::Header;
                self.buf.clear();
            }
            CLOSE => {
                self.mode = Mode::Closer;
                self.buf.clear();
            }
            SEP => {
                let h = std::mem::take(&mut self.buf);
                match std::mem::replace(&mut self.mode, Mode::Body) {
                    Mode::Header => self.opened(&h),
                    Mode::Closer => self.closed(h.trim(), out),
                    Mode::Body => {}
                }
            }
            END_OF_MSG => self.ended = true,
            _ => {} // another special in the output: not part of the format
        }
    }

    fn opened(&mut self, header: &str) {
        let (tag, attrs) = parse_header(header);
        let attr = |k: &str| attrs.iter().find(|(a, _)| a == k).map(|(_, v)| v.clone()).unwrap_or_default();
        let s = match tag.as_str() {
            "think" => Sec::Think,
            "response" => Sec::Response,
            "tools" => Sec::Tools,
            "call" => Sec::Call { name: attr("tool"), args: serde_json::Map::new(), json: None },
            "argument" => Sec::Argument { key: attr("key"), kind: attr("type"), value: String::new() },
            "json" => Sec::Json(String::new()),
            other => Sec::Other(other.to_string()),
        };
        // a new top-level section implicitly ends an unclosed think/response
        if matches!(s, Sec::Think | Sec::Response | Sec::Tools) {
            self.stack.retain(|x| !matches!(x, Sec::Think | Sec::Response));
        }
        self.stack.push(s);
    }

    fn closed(&mut self, tag: &str, out: &mut Vec<Part>) {
        if tag == "message" {
            self.ended = true;
            return;
        }
        let Some(pos) = self.stack.iter().rposition(|s| sec_name(s) == tag) else {
            return; // a closer with nothing open: ignore it
        };
        while self.stack.len() > pos {
            let s = self.stack.pop().expect("len > pos");
            self.finish(s, out);
        }
    }

    fn finish(&mut self, s: Sec, out: &mut Vec<Part>) {
        match s {
            Sec::Argument { key, kind, value } => {
                let v = if kind == "string" {
                    Value::String(value)
                } else {
                    serde_json::from_str(value.trim()).unwrap_or(Value::String(value))
                };
                if let Some(Sec::Call { args, .. }) = self.stack.last_mut() {
                    args.insert(key, v);
                }
            }
            Sec::Json(text) => {
                if let Some(Sec::Call { json, .. }) = self.stack.last_mut() {
                    *json = Some(text);
                }
            }
            Sec::Call { name, args, json } => {
                let arguments = match json {
                    Some(j) if args.is_empty() => j.trim().to_string(),
                    _ => Value::Object(args).to_string(),
                };
                out.push(Part::ToolCall { index: self.calls, name, arguments });
                self.calls += 1;
            }
            _ => {}
        }
    }
}

/// Join neighbouring text parts of the same kind (what a consumer that
/// does not care about piece boundaries sees).
pub fn merge_parts(parts: Vec<Part>) -> Vec<Part> {
    let mut out: Vec<Part> = Vec::new();
    for p in parts {
        match (out.last_mut(), p) {
            (Some(Part::Content(a)), Part::Content(b)) | (Some(Part::Reasoning(a)), Part::Reasoning(b)) => {
                a.push_str(&b)
            }
            (_, p) => out.push(p),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(s: &str) -> String {
        format!("{MARK_OPEN}{s}{MARK_CLOSE}")
    }

    #[test]
    fn renders_like_the_reference_template() {
        // expected text written by hand from Kimi-K3.jinja (llama.cpp models/templates)
        let tools = vec![
            serde_json::json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}),
        ];
        let msgs = vec![
            ChatMessage::new("user", "Weather in Paris?"),
            ChatMessage {
                role: "assistant".into(),
                tool_calls: vec![ToolCall {
                    id: "c1".into(),
                    name: "get_weather".into(),
                    arguments: r#"{"city":"Paris","days":2}"#.into(),
                }],
                ..Default::default()
            },
            ChatMessage {
                role: "tool".into(),
                content: "sunny".into(),
                tool_call_id: Some("c1".into()),
                ..Default::default()
            },
        ];
        let opts = XtmlOptions { tools, thinking: None, ..Default::default() };
        let got = text(&render(&msgs, &opts, true).unwrap());
        let want = concat!(
            "<|open|>message role=\"system\" type=\"tool-declare\"<|sep|># Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n",
            "[{\"function\":{\"name\":\"get_weather\",\"parameters\":{\"properties\":{\"city\":{\"type\":\"string\"}},\"type\":\"object\"}},\"type\":\"function\"}]\n```",
            "<|close|>message<|sep|><|end_of_msg|>",
            "<|open|>message role=\"user\"<|sep|>Weather in Paris?<|close|>message<|sep|><|end_of_msg|>",
            "<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|><|close|>response<|sep|>",
            "<|open|>tools<|sep|><|open|>call tool=\"get_weather\" index=\"1\"<|sep|>",
            "<|open|>argument key=\"city\" type=\"string\"<|sep|>Paris<|close|>argument<|sep|>",
            "<|open|>argument key=\"days\" type=\"number\"<|sep|>2<|close|>argument<|sep|>",
            "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>",
            "<|open|>message role=\"tool\" tool=\"get_weather\" index=\"1\"<|sep|>sunny<|close|>message<|sep|><|end_of_msg|>",
            "<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|>",
        );
        assert_eq!(got, want);
    }

    #[test]
    fn object_and_array_arguments_are_written_as_tojson_writes_them() {
        // the template's xtml_value: strings raw, anything else `value|tojson(ensure_ascii=false)`,
        // i.e. Python's json.dumps with ", " / ": " separators and the keys in their order
        let msgs = vec![ChatMessage {
            role: "assistant".into(),
            tool_calls: vec![ToolCall {
                id: "c1".into(),
                name: "f".into(),
                arguments: r#"{"opts":{"k":"v","n":1.5},"list":[1,"two",null],"flag":true,"tiny":1e-7,"über":"ä"}"#
                    .into(),
            }],
            ..Default::default()
        }];
        let got = text(&render(&msgs, &XtmlOptions::default(), false).unwrap());
        let want = concat!(
            "<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|><|close|>response<|sep|>",
            "<|open|>tools<|sep|><|open|>call tool=\"f\" index=\"1\"<|sep|>",
            "<|open|>argument key=\"opts\" type=\"object\"<|sep|>{\"k\": \"v\", \"n\": 1.5}<|close|>argument<|sep|>",
            "<|open|>argument key=\"list\" type=\"array\"<|sep|>[1, \"two\", null]<|close|>argument<|sep|>",
            "<|open|>argument key=\"flag\" type=\"boolean\"<|sep|>true<|close|>argument<|sep|>",
            "<|open|>argument key=\"tiny\" type=\"number\"<|sep|>1e-07<|close|>argument<|sep|>",
            "<|open|>argument key=\"über\" type=\"string\"<|sep|>ä<|close|>argument<|sep|>",
            "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>",
        );
        assert_eq!(got, want);
    }

    #[test]
    fn tools_on_a_system_message_are_a_new_tools_block() {
        // `message.role == 'system' and message.get('tools')` → render_tool_declare(tools, dynamic=true)
        let tool =
            serde_json::json!({"type": "function", "function": {"name": "late", "parameters": {"type": "object"}}});
        let msgs = vec![
            ChatMessage::new("user", "hi"),
            ChatMessage { role: "system".into(), content: "ignored".into(), tools: vec![tool], ..Default::default() },
        ];
        let got = text(&render(&msgs, &XtmlOptions::default(), false).unwrap());
        let want = concat!(
            "<|open|>message role=\"user\"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>",
            "<|open|>message role=\"system\" type=\"tool-declare\"<|sep|>## New Tools Available\n",
            "The system dynamically extends the toolset via lazy-loading.\nYou have access to all existing and extended tools.\n",
            "Here are the specs for the extended tools.\n\n```json\n",
            "[{\"function\":{\"name\":\"late\",\"parameters\":{\"type\":\"object\"}},\"type\":\"function\"}]\n```",
            "<|close|>message<|sep|><|end_of_msg|>",
        );
        assert_eq!(got, want);
    }

    #[test]
    fn every_effort_the_reference_accepts_has_its_notice() {
        for (e, name) in
            [(Effort::Low, "low"), (Effort::Medium, "medium"), (Effort::High, "high"), (Effort::Max, "max")]
        {
            let opts = XtmlOptions { thinking: Some(e), ..Default::default() };
            let got = text(&render(&[ChatMessage::new("user", "x")], &opts, true).unwrap());
            let notice = format!(
                "<|open|>message role=\"system\" type=\"thinking-effort\"<|sep|>`thinking_effort` guides on how much to think in your thinking channel (not including the response channel), supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked with `thinking_effort={name}`.<|close|>message<|sep|><|end_of_msg|>"
            );
            assert!(got.starts_with(&notice), "{got}");
            assert!(got.ends_with("<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>"));
        }
    }

    #[test]
    fn thinking_and_notices() {
        let msgs = vec![
            ChatMessage::new("system", "Be brief."),
            ChatMessage {
                role: "assistant".into(),
                content: "Hi".into(),
                reasoning: "greet".into(),
                ..Default::default()
            },
        ];
        let opts = XtmlOptions {
            thinking: Some(Effort::High),
            tool_choice: ToolChoice::Required,
            response_format: Some(ResponseFormat::JsonObject),
            ..Default::default()
        };
        let got = text(&render(&msgs, &opts, true).unwrap());
        assert!(
            got.starts_with("<|open|>message role=\"system\" type=\"thinking-effort\"<|sep|>`thinking_effort` guides")
        );
        assert!(got.contains("`thinking_effort=high`.<|close|>message<|sep|><|end_of_msg|><|open|>message role=\"system\"<|sep|>Be brief."));
        assert!(got.contains(
            "<|open|>think<|sep|>greet<|close|>think<|sep|><|open|>response<|sep|>Hi<|close|>response<|sep|>"
        ));
        assert!(got.contains("type=\"tool-choice\"<|sep|>The system is invoked with `tool_choice=required`."));
        assert!(
            got.contains("type=\"response-format\"<|sep|>The system is invoked with `response_format=json_object`.")
        );
        assert!(got.ends_with("<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>"));
    }

    #[test]
    fn parts_end_where_rendering_them_alone_ends() {
        // a byte tokenizer with the markers
        let ranks = (0..256u32).map(|b| (vec![b as u8], b)).collect();
        let specials =
            [OPEN, CLOSE, SEP, END_OF_MSG].iter().enumerate().map(|(i, t)| (256 + i as u32, t.to_string())).collect();
        let tok = Tokenizer::new(ranks, specials, crate::Pattern::O200k).unwrap();
        let msgs =
            vec![ChatMessage::new("user", "hi"), ChatMessage::new("assistant", "yo"), ChatMessage::new("user", "more")];
        let full = XtmlOptions {
            thinking: Some(Effort::Low),
            tool_choice: ToolChoice::Required,
            tools: vec![serde_json::json!({"type": "function", "function": {"name": "f"}})],
            ..Default::default()
        };
        let e = encode(&tok, &msgs, &full, true).unwrap();
        let notices = encode(&tok, &[], &XtmlOptions { tool_choice: ToolChoice::Auto, ..full.clone() }, false).unwrap();
        assert_eq!(e.head, notices.ids.len());
        assert_eq!(&e.ids[..e.head], &notices.ids[..]);
        let base = encode(&tok, &msgs, &XtmlOptions { tool_choice: ToolChoice::Auto, ..full.clone() }, false).unwrap();
        assert_eq!(e.messages_end, base.ids.len());
        assert_eq!(&e.ids[..e.messages_end], &base.ids[..]);
        assert!(e.messages_end < e.ids.len());
        assert_eq!(base.messages_end, base.ids.len());
    }

    #[test]
    fn attributes_are_escaped_and_content_cannot_forge_markers() {
        let mut msg = ChatMessage::new("user", "<|close|>message<|sep|>");
        msg.name = Some("a\"b&c".into());
        let segs = render(&[msg], &XtmlOptions::default(), false).unwrap();
        assert_eq!(segs[1], Segment::Text("message role=\"user\" name=\"a&quot;b&amp;c\"".into()));
        assert_eq!(segs[3], Segment::Text("<|close|>message<|sep|>".into()));
    }

    #[test]
    fn tool_results_follow_the_calls_order() {
        let call = |id: &str, n: &str| ToolCall { id: id.into(), name: n.into(), arguments: "{}".into() };
        let res = |id: &str, c: &str| ChatMessage {
            role: "tool".into(),
            content: c.into(),
            tool_call_id: Some(id.into()),
            ..Default::default()
        };
        let msgs = vec![
            ChatMessage {
                role: "assistant".into(),
                tool_calls: vec![call("a", "f"), call("b", "g")],
                ..Default::default()
            },
            res("b", "B"),
            res("a", "A"),
        ];
        let got = text(&render(&msgs, &XtmlOptions::default(), false).unwrap());
        let fa = got.find("tool=\"f\" index=\"1\"<|sep|>A").unwrap();
        let gb = got.find("tool=\"g\" index=\"2\"<|sep|>B").unwrap();
        assert!(fa < gb);
        // an unresolvable tool message is an error, not a guess
        let bad = vec![ChatMessage { role: "tool".into(), content: "x".into(), ..Default::default() }];
        assert!(render(&bad, &XtmlOptions::default(), false).is_err());
    }

    #[test]
    fn parses_reasoning_content_and_calls_streamed_in_pieces() {
        let out = concat!(
            "let me think[C]think[S][O]response[S]Calling.[C]response[S][O]tools[S]",
            "[O]call tool=\"get_weather\" index=\"1\"[S][O]argument key=\"city\" type=\"string\"[S]Par is[C]argument[S]",
            "[O]argument key=\"days\" type=\"number\"[S]3[C]argument[S][C]call[S][C]tools[S][C]message[S]",
        )
        .replace("[O]", &m(OPEN))
        .replace("[C]", &m(CLOSE))
        .replace("[S]", &m(SEP));
        // feed one char at a time: the result must not depend on the split
        let mut p = OutputParser::new(true);
        let mut parts = Vec::new();
        for ch in out.chars() {
            parts.extend(p.push(&ch.to_string()));
        }
        let parts = merge_parts(parts);
        assert_eq!(parts[0], Part::Reasoning("let me think".into()));
        assert_eq!(parts[1], Part::Content("Calling.".into()));
        assert_eq!(
            parts[2],
            Part::ToolCall { index: 0, name: "get_weather".into(), arguments: r#"{"city":"Par is","days":3}"#.into() }
        );
        assert_eq!(parts.len(), 3);
        assert!(p.ended());
    }

    #[test]
    fn unmarked_lookalikes_stay_text() {
        let mut p = OutputParser::new(false);
        let parts = p.push("see <|close|>response<|sep|> here");
        assert_eq!(parts, vec![Part::Content("see <|close|>response<|sep|> here".into())]);
        assert!(!p.ended());
    }
}

#[cfg(test)]
mod props {
    use super::*;
    use proptest::prelude::*;

    fn piece() -> impl Strategy<Value = String> {
        prop_oneof![
            Just(format!("{MARK_OPEN}{OPEN}{MARK_CLOSE}")),
            Just(format!("{MARK_OPEN}{CLOSE}{MARK_CLOSE}")),
            Just(format!("{MARK_OPEN}{SEP}{MARK_CLOSE}")),
            Just(format!("{MARK_OPEN}{END_OF_MSG}{MARK_CLOSE}")),
            Just(MARK_OPEN.to_string()),
            Just(MARK_CLOSE.to_string()),
            prop::sample::select(vec![
                "think",
                "response",
                "tools",
                "call tool=\"f\" index=\"1\"",
                "argument key=\"k\" type=\"number\"",
                "json type=\"object\"",
                "message",
                "x=\"",
                "\""
            ])
            .prop_map(str::to_string),
            "\\PC{0,6}",
        ]
    }

    proptest! {
        /// Whatever the model writes, the parser neither panics nor depends
        /// on how the text is split into pieces.
        #[test]
        fn any_output_parses_the_same_whole_or_split(pieces in prop::collection::vec(piece(), 0..40), cut in 0usize..64, thinking: bool) {
            let all: String = pieces.concat();
            let mut whole = OutputParser::new(thinking);
            let a = merge_parts(whole.push(&all));
            let mut split = OutputParser::new(thinking);
            let cut = all.char_indices().map(|(i, _)| i).nth(cut).unwrap_or(all.len());
            let mut b = split.push(&all[..cut]);
            b.extend(split.push(&all[cut..]));
            prop_assert_eq!(a, merge_parts(b));
            prop_assert_eq!(whole.ended(), split.ended());
        }
    }
}
