//! The Kimi K2 family's chat format, which Kimi-Linear speaks: turns
//! `<|im_user|>NAME<|im_middle|>…<|im_end|>`, tools declared in a
//! `tool_declare` system turn, the assistant's calls in a
//! `<|tool_calls_section_begin|>` section of
//! `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{…}<|tool_call_end|>`,
//! and results as `## Return of ID`. This renders a conversation the way the
//! reference template (`Kimi-K2-Instruct.jinja`, shipped with llama.cpp;
//! `tools/oracle/k2_template/render.py` names its source and hash) does, and
//! parses the model's output back into content and tool calls.
//!
//! As in [`crate::xtml`], rendering produces [`Segment`]s: markers become
//! their special token ids and every run of text between two markers is one
//! plain run, so nothing a client sends (content, names, schemas, arguments)
//! can become a marker. The template has no thinking channel, no
//! `tool_choice` and no `response_format` notice: those are held by
//! constrained decoding alone.

use crate::xtml::{json_py, ChatMessage, Encoded, Part, Segment};
use crate::{Error, Result, Tokenizer};
use serde_json::Value;

/// Opens a system turn (system prompts, tool declarations, tool results).
pub const IM_SYSTEM: &str = "<|im_system|>";
/// Opens a user turn.
pub const IM_USER: &str = "<|im_user|>";
/// Opens an assistant turn.
pub const IM_ASSISTANT: &str = "<|im_assistant|>";
/// Separates a turn's name from its body.
pub const IM_MIDDLE: &str = "<|im_middle|>";
/// Ends a turn (the models' end-of-sequence token).
pub const IM_END: &str = "<|im_end|>";
/// Opens the assistant's tool-call section.
pub const SECTION_BEGIN: &str = "<|tool_calls_section_begin|>";
/// Closes the tool-call section.
pub const SECTION_END: &str = "<|tool_calls_section_end|>";
/// Opens one call (its id follows).
pub const CALL_BEGIN: &str = "<|tool_call_begin|>";
/// Ends a call's id; its JSON arguments follow.
pub const ARGUMENT_BEGIN: &str = "<|tool_call_argument_begin|>";
/// Ends one call.
pub const CALL_END: &str = "<|tool_call_end|>";

const MARKERS: [&str; 10] = [
    IM_SYSTEM,
    IM_USER,
    IM_ASSISTANT,
    IM_MIDDLE,
    IM_END,
    SECTION_BEGIN,
    SECTION_END,
    CALL_BEGIN,
    ARGUMENT_BEGIN,
    CALL_END,
];

/// The system prompt the template puts first when the conversation does not
/// start with one.
pub const DEFAULT_SYSTEM: &str = "You are Kimi, an AI assistant created by Moonshot AI.";

/// Whether a tokenizer has every marker of this format.
pub fn supported(tok: &Tokenizer) -> bool {
    MARKERS.iter().all(|m| tok.special_id(m).is_some())
}

/// The call id the template writes for a call: `functions.NAME:N`, `N`
/// counting the conversation's calls from 0.
pub fn call_id(name: &str, n: usize) -> String {
    format!("functions.{name}:{n}")
}

/// The function name in a call id the model wrote (`functions.NAME:IDX`,
/// as vLLM's `kimi_k2` parser reads it: the prefix and the index dropped).
pub fn name_of_id(id: &str) -> String {
    let id = id.trim();
    let id = id.strip_prefix("functions.").unwrap_or(id);
    id.rsplit_once(':').map_or(id, |(n, _)| n).to_string()
}

#[derive(Default)]
struct Out {
    segs: Vec<Segment>,
}

impl Out {
    fn marker(&mut self, m: &'static str) {
        self.segs.push(Segment::Marker(m));
    }
    fn text(&mut self, t: &str) {
        if t.is_empty() {
            return;
        }
        if let Some(Segment::Text(s)) = self.segs.last_mut() {
            s.push_str(t);
        } else {
            self.segs.push(Segment::Text(t.to_string()));
        }
    }
    fn turn(&mut self, tag: &'static str, name: &str) {
        self.marker(tag);
        self.text(name);
        self.marker(IM_MIDDLE);
    }
}

/// Where a rendering's parts end, in segments.
struct Rendered {
    segs: Vec<Segment>,
    head: usize,
    messages_end: usize,
}

/// Render a conversation with `tools` declared; with `open`, end with the
/// assistant's generation prompt.
///
/// # Errors
/// [`Error::Template`] for an unknown role.
pub fn render(messages: &[ChatMessage], tools: &[Value], open: bool) -> Result<Vec<Segment>> {
    Ok(render_parts(messages, tools, open)?.segs)
}

fn render_parts(messages: &[ChatMessage], tools: &[Value], open: bool) -> Result<Rendered> {
    let mut o = Out::default();
    if !tools.is_empty() {
        o.turn(IM_SYSTEM, "tool_declare");
        o.text(&json_py(&Value::Array(tools.to_vec())));
        o.marker(IM_END);
    }
    if messages.first().is_some_and(|m| m.role != "system") {
        o.turn(IM_SYSTEM, "system");
        o.text(DEFAULT_SYSTEM);
        o.marker(IM_END);
        // the template's `{% endif %}` sits on its own line after this turn
        o.text("\n");
    }
    let head = o.segs.len();
    // ids of the calls made so far, taken in order by the tool results
    let (mut calls, mut queue) = (0usize, std::collections::VecDeque::new());
    for m in messages {
        let name = m.name.as_deref().filter(|n| !n.is_empty()).unwrap_or(&m.role);
        match m.role.as_str() {
            "user" => o.turn(IM_USER, name),
            "assistant" => o.turn(IM_ASSISTANT, name),
            "system" | "tool" => o.turn(IM_SYSTEM, name),
            r => return Err(Error::Template(format!("no template for role {r:?}"))),
        }
        if m.role == "assistant" && !m.tool_calls.is_empty() {
            o.text(&m.content);
            o.marker(SECTION_BEGIN);
            for c in &m.tool_calls {
                let id = call_id(&c.name, calls);
                calls += 1;
                o.marker(CALL_BEGIN);
                o.text(&id);
                queue.push_back(id);
                o.marker(ARGUMENT_BEGIN);
                o.text(&c.arguments);
                o.marker(CALL_END);
            }
            o.marker(SECTION_END);
        } else if m.role == "tool" {
            let id = queue.pop_front().unwrap_or_else(|| call_id(m.name.as_deref().unwrap_or("unknown"), calls));
            o.text(&format!("## Return of {id}\n"));
            o.text(&m.content);
        } else {
            if m.role == "user" {
                encode_images(&mut o, &m.images);
            }
            o.text(&m.content);
        }
        o.marker(IM_END);
    }
    let messages_end = o.segs.len();
    if open {
        o.turn(IM_ASSISTANT, "assistant");
    }
    Ok(Rendered { segs: o.segs, head, messages_end })
}

fn encode_images(o: &mut Out, images: &[(u32, u32)]) {
    use crate::chat::{MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD};
    // as the other formats announce an image (`chat::image_markup`): a
    // K2-format model with a vision tower has no reference to follow
    for &(w, h) in images {
        o.marker(MEDIA_BEGIN);
        o.text(&format!("image {w}x{h}"));
        o.marker(MEDIA_CONTENT);
        o.marker(MEDIA_PAD);
        o.marker(MEDIA_END);
    }
}

/// Render and tokenize: markers by id, each text run as plain text; `head`
/// ends after the tool declaration and the default system prompt (what a
/// follow-up turn in the same session leaves out), `messages_end` before the
/// generation prompt.
///
/// # Errors
/// As [`render`], and [`Error::Template`] when the tokenizer lacks a marker.
pub fn encode(tok: &Tokenizer, messages: &[ChatMessage], tools: &[Value], open: bool) -> Result<Encoded> {
    let r = render_parts(messages, tools, open)?;
    crate::xtml::encode_segments(tok, r.segs, r.head, r.messages_end)
}

/// Where the parser is in the model's output.
#[derive(Clone, Debug, PartialEq)]
enum Mode {
    /// Answer text.
    Content,
    /// Inside the tool-call section, between calls.
    Section,
    /// A call's id.
    Id(String),
    /// A call's arguments, after its id.
    Arguments(String, String),
}

/// Streaming parser of the assistant's output, given as *marked* text (see
/// `waste_model::GenerateParams::mark_specials`: markers arrive as
/// `U+F8F2 <|tool_call_begin|> U+F8F3`, so text that merely looks like a
/// marker stays text). Feed pieces as they come; every call returns what
/// became final: content, and each call once its `<|tool_call_end|>` came.
#[derive(Clone, Debug)]
pub struct OutputParser {
    mode: Mode,
    raw: String,
    calls: usize,
    ended: bool,
}

impl Default for OutputParser {
    fn default() -> Self {
        OutputParser::new()
    }
}

impl OutputParser {
    /// A parser for output that continues the generation prompt.
    pub fn new() -> OutputParser {
        OutputParser { mode: Mode::Content, raw: String::new(), calls: 0, ended: false }
    }

    /// Whether the turn has ended (`<|im_end|>`).
    pub fn ended(&self) -> bool {
        self.ended
    }

    /// Feed marked text.
    pub fn push(&mut self, text: &str) -> Vec<Part> {
        self.raw.push_str(text);
        let mut out = Vec::new();
        while let Some((before, marker)) = crate::xtml::next_marker(&mut self.raw) {
            self.text(&before, &mut out);
            match marker {
                Some(m) => self.marker(&m, &mut out),
                None => break,
            }
        }
        crate::xtml::merge_parts(out)
    }

    fn text(&mut self, t: &str, out: &mut Vec<Part>) {
        if t.is_empty() || self.ended {
            return;
        }
        match &mut self.mode {
            Mode::Content => out.push(Part::Content(t.to_string())),
            Mode::Section => {} // layout between calls
            Mode::Id(s) | Mode::Arguments(_, s) => s.push_str(t),
        }
    }

    fn marker(&mut self, m: &str, out: &mut Vec<Part>) {
        if self.ended {
            return;
        }
        match m {
            SECTION_BEGIN => self.mode = Mode::Section,
            CALL_BEGIN => self.mode = Mode::Id(String::new()),
            ARGUMENT_BEGIN => {
                if let Mode::Id(id) = std::mem::replace(&mut self.mode, Mode::Section) {
                    self.mode = Mode::Arguments(id, String::new());
                }
            }
            CALL_END => {
                if let Mode::Arguments(id, args) = std::mem::replace(&mut self.mode, Mode::Section) {
                    out.push(Part::ToolCall {
                        index: self.calls,
                        name: name_of_id(&id),
                        arguments: args.trim().to_string(),
                    });
                    self.calls += 1;
                }
            }
            SECTION_END => self.mode = Mode::Content,
            IM_END => self.ended = true,
            _ => {} // another special in the output: not part of the format
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::xtml::ToolCall;

    fn mk(s: &str) -> String {
        format!("\u{F8F2}{s}\u{F8F3}")
    }

    #[test]
    fn the_parser_reads_calls_in_any_split_and_ends_at_im_end() {
        let out = format!(
            "Let me check.{}{}functions.get_weather:0{}{{\"city\": \"Paris\"}}{}{}functions.get_time:1{} {{}} {}{}{}after",
            mk(SECTION_BEGIN),
            mk(CALL_BEGIN),
            mk(ARGUMENT_BEGIN),
            mk(CALL_END),
            mk(CALL_BEGIN),
            mk(ARGUMENT_BEGIN),
            mk(CALL_END),
            mk(SECTION_END),
            mk(IM_END)
        );
        let want = vec![
            Part::Content("Let me check.".into()),
            Part::ToolCall { index: 0, name: "get_weather".into(), arguments: "{\"city\": \"Paris\"}".into() },
            Part::ToolCall { index: 1, name: "get_time".into(), arguments: "{}".into() },
        ];
        // whole, and one character at a time (a marker split across pieces)
        let mut p = OutputParser::new();
        assert_eq!(p.push(&out), want);
        assert!(p.ended());
        let mut p = OutputParser::new();
        let mut got = Vec::new();
        for ch in out.chars() {
            got.extend(p.push(&ch.to_string()));
        }
        assert_eq!(crate::xtml::merge_parts(got), want);
        // text that spells a marker without being one stays content
        let mut p = OutputParser::new();
        assert_eq!(p.push("<|tool_call_begin|>x"), vec![Part::Content("<|tool_call_begin|>x".into())]);
    }

    #[test]
    fn call_names_come_from_the_ids_the_model_writes() {
        assert_eq!(name_of_id("functions.get_weather:0"), "get_weather");
        assert_eq!(name_of_id(" functions.a.b:12 "), "a.b");
        assert_eq!(name_of_id("plain"), "plain");
    }

    #[test]
    fn tool_results_take_the_ids_of_the_calls_in_order() {
        let call = |n: &str| ToolCall { id: "anything".into(), name: n.into(), arguments: "{}".into() };
        let msgs = vec![
            ChatMessage::new("user", "q"),
            ChatMessage { tool_calls: vec![call("a"), call("b")], ..ChatMessage::new("assistant", "") },
            ChatMessage::new("tool", "1"),
            ChatMessage::new("tool", "2"),
            ChatMessage::new("tool", "3"),
        ];
        let t = crate::xtml::text(&render(&msgs, &[], false).unwrap());
        assert!(t.contains("## Return of functions.a:0\n1"), "{t}");
        assert!(t.contains("## Return of functions.b:1\n2"), "{t}");
        // a result with no call left is numbered after the calls
        assert!(t.contains("## Return of functions.unknown:2\n3"), "{t}");
    }
}
