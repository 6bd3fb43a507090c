//! Constrained decoding for WASTE: a [`Constraint`] masks the next token so
//! the output stays inside a grammar (llguidance: Lark grammars with embedded
//! JSON schemas), and goes to `Session::generate_constrained`.
//!
//! The grammars for K3's chat format are written here: a JSON answer
//! ([`json_lark`]), forced tool calls ([`tool_calls_lark`]) and the body of a
//! tool section the model opened itself ([`tool_section_lark`], used with
//! [`Grammars::lazy`]).

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use std::sync::Arc;
use waste_tokenizer::Tokenizer;

/// Errors of grammar construction and matching.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The grammar or schema is not accepted.
    #[error("{0}")]
    Grammar(String),
}

/// Result alias.
pub type Result<T> = std::result::Result<T, Error>;

/// Longest line of a grammar engine message kept, in chars.
const MESSAGE_LINE_CHARS: usize = 200;
/// Most lines of a grammar engine message kept.
const MESSAGE_LINES: usize = 8;

/// The grammar engine's message, cut to a readable size: its listing of
/// the compiled grammar repeats the whole schema (a 1 MB schema gave a
/// 0.9 MB error, echoed into a server's 400 response). The listing and its
/// position (`at 2(9): `, ` 1 | start: …`, `^`) are of the grammar this
/// crate wrote around the schema — the chat format's markers included —
/// not of anything the user gave: they are dropped, the cause kept.
fn concise(e: &impl std::fmt::Display) -> String {
    let text = e.to_string();
    let listing = |l: &str| {
        let t = l.trim_start();
        let digits = t.chars().take_while(char::is_ascii_digit).count();
        (digits > 0 && t[digits..].trim_start().starts_with('|')) || (!t.is_empty() && t.trim_end() == "^")
    };
    let kept: Vec<&str> = text.lines().filter(|l| !listing(l)).collect();
    let mut out: Vec<String> = kept
        .iter()
        .take(MESSAGE_LINES)
        .map(|l| {
            let l = strip_position(l);
            match l.char_indices().nth(MESSAGE_LINE_CHARS) {
                Some((cut, _)) => format!("{}…", &l[..cut]),
                None => l.to_string(),
            }
        })
        .collect();
    if kept.len() > MESSAGE_LINES {
        out.push("…".into());
    }
    out.join("\n")
}

/// A line without a leading `at LINE(COLUMN): ` (a place in the generated
/// grammar).
fn strip_position(l: &str) -> &str {
    let Some(rest) = l.strip_prefix("at ") else { return l };
    let Some((pos, after)) = rest.split_once("): ") else { return l };
    let ok = pos.split_once('(').is_some_and(|(a, b)| {
        !a.is_empty() && !b.is_empty() && a.chars().all(|c| c.is_ascii_digit()) && b.chars().all(|c| c.is_ascii_digit())
    });
    if ok {
        after
    } else {
        l
    }
}

struct Env {
    trie: TokTrie,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.trie.greedy_tokenize(s)
    }
}

/// The token trie and parser factory of one model; build once, then make
/// constraints cheaply.
pub struct Grammars {
    factory: Arc<ParserFactory>,
    env: TokEnv,
}

impl Grammars {
    /// From the model's tokenizer, its vocabulary size (logit count) and the
    /// token that ends a constrained output. Special tokens are entered with
    /// llguidance's 0xFF marker, so only a grammar naming them (`<|open|>`)
    /// can allow them; ids without a token are unreachable specials.
    ///
    /// # Errors
    /// [`Error`] when the token trie cannot be built from the tokenizer.
    pub fn new(tok: &Tokenizer, vocab: usize, eos: u32) -> Result<Grammars> {
        let words: Vec<Vec<u8>> = (0..vocab as u32)
            .map(|id| {
                let b = tok.token_bytes(id);
                if tok.is_special(id) || b.is_empty() {
                    let name = if b.is_empty() { format!("<|unused_{id}|>").into_bytes() } else { b.to_vec() };
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend(name);
                    w
                } else {
                    b.to_vec()
                }
            })
            .collect();
        let info = TokRxInfo::new(vocab as u32, eos);
        let env: TokEnv = Arc::new(Env { trie: TokTrie::from(&info, &words) });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| Error::Grammar(concise(&e)))?;
        factory.set_stderr_log_level(0);
        Ok(Grammars { factory: Arc::new(factory), env })
    }

    /// From a model's parts: its tokenizer (a model may have none), its
    /// logit count and the token that ends a constrained output (the
    /// engine's `Model::constraint_end`).
    ///
    /// # Errors
    /// [`Error`] without a tokenizer or an end token, or when the tables cannot be built.
    pub fn for_parts(tok: Option<&Tokenizer>, vocab: usize, end: Option<u32>) -> Result<Grammars> {
        let tok = tok.ok_or_else(|| Error::Grammar("this container has no tokenizer".into()))?;
        let end = end.ok_or_else(|| Error::Grammar("the model has no token to end a constrained output".into()))?;
        Grammars::new(tok, vocab, end)
    }

    fn matcher(&self, lark: &str) -> Result<Matcher> {
        let parser = self
            .factory
            .create_parser(TopLevelGrammar::from_lark(lark.to_string()))
            .map_err(|e| Error::Grammar(concise(&e)))?;
        Ok(Matcher::new(Ok(parser)))
    }

    /// A constraint active from the first token.
    ///
    /// # Errors
    /// [`Error`] when the grammar does not compile (the engine's message, without its panic text).
    pub fn constraint(&self, lark: &str) -> Result<Constraint> {
        Ok(Constraint { state: State::Active(self.matcher(lark)?), env: self.env.clone() })
    }

    /// A constraint that lets the model write freely until its output ends
    /// with `trigger` (token bytes; specials as 0xFF + name, see
    /// [`marker_bytes`]), then holds the rest to `lark`. The grammar is
    /// checked now, so a bad one fails before generation.
    ///
    /// # Errors
    /// [`Error`] when the grammar does not compile.
    pub fn lazy(&self, trigger: Vec<u8>, lark: &str) -> Result<Constraint> {
        self.matcher(lark)?;
        Ok(Constraint {
            state: State::Waiting {
                trigger,
                recent: Vec::new(),
                lark: lark.to_string(),
                factory: self.factory.clone(),
            },
            env: self.env.clone(),
        })
    }
}

/// Bytes of a special token as the trie holds it (for lazy triggers).
pub fn marker_bytes(name: &str) -> Vec<u8> {
    let mut v = vec![TokTrie::SPECIAL_TOKEN_MARKER];
    v.extend(name.as_bytes());
    v
}

enum State {
    Waiting { trigger: Vec<u8>, recent: Vec<u8>, lark: String, factory: Arc<ParserFactory> },
    Active(Matcher),
}

/// One generation's constraint (see [`Grammars`]).
pub struct Constraint {
    state: State,
    env: TokEnv,
}

impl Constraint {
    /// Whether the grammar is in force (a lazy one after its trigger).
    pub fn active(&self) -> bool {
        matches!(self.state, State::Active(_))
    }
}

use waste_tokenizer::ConstraintError;

impl waste_tokenizer::TokenConstraint for Constraint {
    fn allowed(&mut self, mask: &mut [bool]) -> std::result::Result<bool, ConstraintError> {
        let State::Active(m) = &mut self.state else {
            return Ok(false);
        };
        let v = m.compute_mask_or_eos().map_err(|e| ConstraintError(e.to_string()))?;
        for (i, a) in mask.iter_mut().enumerate() {
            *a = v.is_allowed(i as u32);
        }
        Ok(true)
    }

    fn commit(&mut self, token: u32) -> std::result::Result<(), ConstraintError> {
        match &mut self.state {
            // the grammar is complete: only its end (EOS) may follow
            State::Active(m) if m.is_stopped() => match token == self.env.tok_trie().eos_token() {
                true => Ok(()),
                false => Err(ConstraintError(format!("token {token} after the grammar finished"))),
            },
            State::Active(m) => m.consume_token(token).map_err(|e| ConstraintError(e.to_string())),
            State::Waiting { trigger, recent, lark, factory } => {
                recent.extend(self.env.tok_trie().token(token));
                if recent.ends_with(trigger) {
                    let parser = factory
                        .create_parser(TopLevelGrammar::from_lark(lark.clone()))
                        .map_err(|e| ConstraintError(e.to_string()))?;
                    self.state = State::Active(Matcher::new(Ok(parser)));
                } else if recent.len() > 4 * trigger.len() + 64 {
                    let cut = recent.len() - trigger.len();
                    recent.drain(..cut);
                }
                Ok(())
            }
        }
    }
}

/// A Lark string literal.
fn lit(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

/// The schema with compact, fixed JSON layout (no free whitespace: a model
/// cannot pad the output forever).
fn compact(schema: &Value) -> Value {
    let mut s = schema.clone();
    if let Value::Object(o) = &mut s {
        o.insert(
            "x-guidance".into(),
            json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    s
}

const CLOSE_MESSAGE: &str = "<|close|> \"message\" <|sep|>";

/// The prefix that leads from the generation prompt to the response body:
/// with thinking, free reasoning, then the closed `think` and an open `response`.
fn to_response(thinking: bool) -> &'static str {
    if thinking {
        "/(?s:.*)/ <|close|> \"think\" <|sep|> <|open|> \"response\" <|sep|> "
    } else {
        ""
    }
}

/// A JSON answer (any object when `schema` is `None`). With `xtml`, the
/// answer is the K3 `response` section, closed with the message (`thinking`:
/// the prompt opened `think`, which is written freely first); without, the
/// output is the JSON alone.
pub fn json_lark(schema: Option<&Value>, xtml: bool, thinking: bool) -> String {
    let schema = compact(schema.unwrap_or(&json!({"type": "object"})));
    if xtml {
        format!(
            "start: {}answer <|close|> \"response\" <|sep|> {CLOSE_MESSAGE}\nanswer: %json {schema}\n",
            to_response(thinking)
        )
    } else {
        format!("start: answer\nanswer: %json {schema}\n")
    }
}

fn function(tool: &Value) -> Result<(&str, &Value)> {
    let f = tool.get("function").unwrap_or(tool);
    let name =
        f.get("name").and_then(|n| n.as_str()).ok_or_else(|| Error::Grammar("a tool has no function name".into()))?;
    static EMPTY: Value = Value::Null;
    Ok((name, f.get("parameters").unwrap_or(&EMPTY)))
}

/// The XTML `type` attribute and the value rule for one argument schema.
fn argument_value(p: &Value) -> (&'static str, String) {
    let ty = p.get("type").and_then(|t| t.as_str());
    let strings: Option<Vec<&str>> =
        p.get("enum").and_then(|e| e.as_array()).and_then(|a| a.iter().map(|x| x.as_str()).collect());
    match ty {
        Some("string") | None if strings.is_some() => (
            "string",
            format!("({})", strings.unwrap_or_default().iter().map(|s| lit(s)).collect::<Vec<_>>().join(" | ")),
        ),
        Some("string") | None => {
            let max = p.get("maxLength").and_then(|m| m.as_u64());
            let min = p.get("minLength").and_then(|m| m.as_u64()).unwrap_or(0);
            match max {
                Some(max) => ("string", format!("/(?s:.{{{min},{max}}})/")),
                None => ("string", format!("/(?s:.{{{min},}})/")),
            }
        }
        Some("integer") | Some("number") => ("number", format!("%json {}", compact(p))),
        Some("boolean") => ("boolean", format!("%json {}", compact(p))),
        Some("array") => ("array", format!("%json {}", compact(p))),
        Some("null") => ("null", "\"null\"".into()),
        Some(_) => ("object", format!("%json {}", compact(p))),
    }
}

/// Most calls in one tools section.
pub const MAX_PARALLEL_CALLS: usize = 16;

/// The tools a call may name — all of them, or only `only` — with their
/// index, name and parameter schema.
fn callable<'a>(tools: &'a [Value], only: Option<&str>) -> Result<Vec<(usize, &'a str, &'a Value)>> {
    let mut v = Vec::new();
    for (ti, t) in tools.iter().enumerate() {
        let (name, params) = function(t)?;
        if only.is_none_or(|o| o == name) {
            v.push((ti, name, params));
        }
    }
    Ok(v)
}

/// Rules for the calls of `tools` (all, or only `only`), numbered from 1 in
/// their `index` attribute as the reference template writes them: one call,
/// or with `parallel` up to [`MAX_PARALLEL_CALLS`]. Returns the rule of the
/// whole sequence.
fn call_rules(tools: &[Value], only: Option<&str>, parallel: bool, g: &mut String) -> Result<String> {
    let most = if parallel { MAX_PARALLEL_CALLS } else { 1 };
    let mut alts: Vec<Vec<String>> = vec![Vec::new(); most];
    for (ti, name, params) in callable(tools, only)? {
        let required: Vec<&str> = params
            .get("required")
            .and_then(|r| r.as_array())
            .map(|a| a.iter().filter_map(|x| x.as_str()).collect())
            .unwrap_or_default();
        let mut args = Vec::new();
        if let Some(props) = params.get("properties").and_then(|p| p.as_object()) {
            for (pi, (key, p)) in props.iter().enumerate() {
                let (ty, value) = argument_value(p);
                let rule = format!("arg_{ti}_{pi}");
                let head =
                    format!("argument key=\"{}\" type=\"{ty}\"", key.replace('&', "&amp;").replace('"', "&quot;"));
                g.push_str(&format!(
                    "{rule}: <|open|> {} <|sep|> {value} <|close|> \"argument\" <|sep|>\n",
                    lit(&head)
                ));
                args.push(if required.contains(&key.as_str()) { rule } else { format!("{rule}?") });
            }
        }
        let tool = name.replace('&', "&amp;").replace('"', "&quot;");
        for (k, alt) in alts.iter_mut().enumerate() {
            let head = format!("call tool=\"{tool}\" index=\"{}\"", k + 1);
            g.push_str(&format!(
                "call_{ti}_{k}: <|open|> {} <|sep|> {} <|close|> \"call\" <|sep|>\n",
                lit(&head),
                args.join(" ")
            ));
            alt.push(format!("call_{ti}_{k}"));
        }
    }
    call_sequence(&alts, only, "at", g)
}

/// The rule `calls`: the call at position 0, then optionally the one at 1,
/// and so on (`alts[k]`: the rules a call at position `k` may be, joined in
/// the rule `{at}_{k}`). An error when no tool can be called.
fn call_sequence(alts: &[Vec<String>], only: Option<&str>, at: &str, g: &mut String) -> Result<String> {
    if alts.first().is_none_or(|a| a.is_empty()) {
        return Err(Error::Grammar(match only {
            Some(o) => format!("tool_choice names {o:?}, which is not among the tools"),
            None => "no tools".into(),
        }));
    }
    let mut seq = String::new();
    for (k, alt) in alts.iter().enumerate().rev() {
        g.push_str(&format!("{at}_{k}: {}\n", alt.join(" | ")));
        seq = if seq.is_empty() { format!("{at}_{k}") } else { format!("{at}_{k} ({seq})?") };
    }
    g.push_str(&format!("calls: {seq}\n"));
    Ok("calls".into())
}

/// Forced tool calls, from the generation prompt on: (reasoning, then) an
/// empty response and a tools section with calls of `only` (or of any
/// tool) — one or more with `parallel`, else exactly one.
///
/// # Errors
/// [`Error`] for a tool without a usable name or schema, or `only` naming no tool.
pub fn tool_calls_lark(tools: &[Value], only: Option<&str>, parallel: bool, thinking: bool) -> Result<String> {
    let mut g = String::new();
    let calls = call_rules(tools, only, parallel, &mut g)?;
    Ok(format!(
        "start: {}<|close|> \"response\" <|sep|> <|open|> \"tools\" <|sep|> {calls} <|close|> \"tools\" <|sep|> {CLOSE_MESSAGE}\n{g}",
        to_response(thinking)
    ))
}

/// The body of a tools section after the model opened it
/// (`<|open|>tools<|sep|>`): well-formed calls (one or more with `parallel`,
/// else one), then the closers.
///
/// # Errors
/// [`Error`] for a tool without a usable name or schema.
pub fn tool_section_lark(tools: &[Value], parallel: bool) -> Result<String> {
    let mut g = String::new();
    let calls = call_rules(tools, None, parallel, &mut g)?;
    Ok(format!("start: {calls} <|close|> \"tools\" <|sep|> {CLOSE_MESSAGE}\n{g}"))
}

/// The trigger of [`tool_section_lark`]: `<|open|>tools<|sep|>`.
pub fn tool_section_trigger() -> Vec<u8> {
    let mut t = marker_bytes("<|open|>");
    t.extend(b"tools");
    t.extend(marker_bytes("<|sep|>"));
    t
}

/// Rules for the calls of `tools` (all, or only `only`) in the K2 family's
/// markup (`<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{…}<|tool_call_end|>`,
/// the arguments held to the tool's schema): one call, or with `parallel`
/// up to [`MAX_PARALLEL_CALLS`], numbered from `first` as the reference
/// template numbers a conversation's calls. Returns the rule of the sequence.
fn k2_call_rules(tools: &[Value], only: Option<&str>, parallel: bool, first: usize, g: &mut String) -> Result<String> {
    use waste_tokenizer::k2::{call_id, ARGUMENT_BEGIN, CALL_BEGIN, CALL_END};
    let most = if parallel { MAX_PARALLEL_CALLS } else { 1 };
    let mut alts: Vec<Vec<String>> = vec![Vec::new(); most];
    for (ti, name, params) in callable(tools, only)? {
        // arguments are the declared properties only (as K3's calls, which
        // name each argument): a schema that does not say otherwise gets
        // `additionalProperties: false` — without it, a key is any string
        let mut schema = if params.is_object() { params.clone() } else { json!({"type": "object"}) };
        if let Value::Object(o) = &mut schema {
            o.entry("additionalProperties").or_insert(Value::Bool(false));
        }
        g.push_str(&format!("k2args_{ti}: %json {}\n", compact(&schema)));
        for (k, alt) in alts.iter_mut().enumerate() {
            g.push_str(&format!(
                "k2call_{ti}_{k}: {CALL_BEGIN} {} {ARGUMENT_BEGIN} k2args_{ti} {CALL_END}\n",
                lit(&call_id(name, first + k))
            ));
            alt.push(format!("k2call_{ti}_{k}"));
        }
    }
    call_sequence(&alts, only, "k2at", g)
}

/// Forced tool calls in the K2 family's format, from the generation prompt
/// on: a tool-call section of calls of `only` (or of any tool) — one or more
/// with `parallel`, else exactly one — then the turn's end. `first`: the
/// calls the conversation made before (the template numbers them all).
///
/// # Errors
/// [`Error`] for a tool without a usable name or schema, or `only` naming no tool.
pub fn k2_tool_calls_lark(tools: &[Value], only: Option<&str>, parallel: bool, first: usize) -> Result<String> {
    use waste_tokenizer::k2::{SECTION_BEGIN, SECTION_END};
    let mut g = String::new();
    let calls = k2_call_rules(tools, only, parallel, first, &mut g)?;
    Ok(format!("start: {SECTION_BEGIN} {calls} {SECTION_END}\n{g}"))
}

/// The body of a K2 tool-call section after the model opened it
/// (`<|tool_calls_section_begin|>`): well-formed calls (one or more with
/// `parallel`, else one), numbered from `first`, then the section's end.
///
/// # Errors
/// [`Error`] for a tool without a usable name or schema.
pub fn k2_tool_section_lark(tools: &[Value], parallel: bool, first: usize) -> Result<String> {
    use waste_tokenizer::k2::SECTION_END;
    let mut g = String::new();
    let calls = k2_call_rules(tools, None, parallel, first, &mut g)?;
    Ok(format!("start: {calls} {SECTION_END}\n{g}"))
}

/// The trigger of [`k2_tool_section_lark`]: `<|tool_calls_section_begin|>`.
pub fn k2_tool_section_trigger() -> Vec<u8> {
    marker_bytes(waste_tokenizer::k2::SECTION_BEGIN)
}
