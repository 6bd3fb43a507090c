//! Chat-mode prompts and output for `run` and `chat`: with K3's tagged chat
//! format, thinking on or off (`--think`), the answer on stdout and the
//! reasoning dimmed on stderr, generation ending at the end of the message;
//! a JSON schema held by constrained decoding (`--json-schema`).

use anyhow::{bail, Result};
use std::io::{IsTerminal, Write};
use waste_model::tokenizer::xtml::{self, ChatMessage, Effort, OutputParser, Part, ResponseFormat, XtmlOptions};
use waste_model::tokenizer::Message;
use waste_model::{GenerateParams, Model};

/// `--think` levels.
/// The levels `--think=LEVEL` takes: the server's `reasoning_effort` ones.
pub const LEVELS: [&str; 5] = ["none", "low", "medium", "high", "max"];

pub fn effort(level: Option<&str>) -> Result<Option<Effort>> {
    Ok(match level {
        None | Some("none") => None,
        Some("low") => Some(Effort::Low),
        Some("medium") => Some(Effort::Medium),
        Some("high") => Some(Effort::High),
        Some("max") | Some("") => Some(Effort::Max),
        Some(o) => bail!("--think takes {}, not {o:?}", LEVELS.join(", ")),
    })
}

/// Plain chat messages as the tagged formats' messages.
fn chat_messages(msgs: &[Message]) -> Vec<ChatMessage> {
    msgs.iter().map(|m| ChatMessage { images: m.images.clone(), ..ChatMessage::new(&m.role, &m.content) }).collect()
}

/// How one model's chat turns are encoded and read back.
pub struct Chat<'m> {
    model: &'m Model,
    opts: XtmlOptions,
}

impl<'m> Chat<'m> {
    /// For `model`, thinking at `think` (without the tagged format there is
    /// no thinking: a warning says so), answering in JSON matching `schema`
    /// when given.
    pub fn new(model: &'m Model, think: Option<Effort>, schema: Option<serde_json::Value>) -> Chat<'m> {
        if think.is_some() && !model.is_xtml() {
            eprintln!("warning: --think has no effect: this model's chat format has no thinking mode (K3's tagged format has)");
        }
        let response_format = schema.map(|s| {
            if s == serde_json::json!({"type": "object"}) {
                ResponseFormat::JsonObject
            } else {
                ResponseFormat::JsonSchema(s)
            }
        });
        Chat { model, opts: XtmlOptions { thinking: think, response_format, ..Default::default() } }
    }

    fn xtml(&self) -> bool {
        self.model.is_xtml()
    }

    /// The prompt of a conversation; `follow_up` drops BOS and the notices
    /// that open a conversation (the session already holds them).
    pub fn encode(&self, msgs: &[Message], follow_up: bool) -> Result<Vec<u32>> {
        if self.model.is_k2() {
            // the K2 template's default system turn opens a conversation only
            let e = self.model.encode_k2(&chat_messages(msgs), &[], true)?;
            return Ok(if follow_up { e.ids[e.head..].to_vec() } else { e.ids });
        }
        if !self.xtml() {
            let ids = self.model.encode_chat(msgs, true)?;
            return Ok(if follow_up { ids[self.model.bos().map_or(0, |_| 1)..].to_vec() } else { ids });
        }
        let e = self.model.encode_xtml(&chat_messages(msgs), &self.opts, true)?;
        Ok(if follow_up { e.ids[e.head..].to_vec() } else { e.ids })
    }

    /// Generation parameters: the tagged format marks its specials and ends
    /// at `<|end_of_msg|>`.
    pub fn params(&self, mut p: GenerateParams) -> GenerateParams {
        if self.xtml() {
            p.mark_specials = true;
            p.stop_tokens.extend(self.end_of_msg());
        }
        p
    }

    fn end_of_msg(&self) -> Option<u32> {
        self.model.tokenizer().and_then(|t| t.special_id(xtml::END_OF_MSG))
    }

    /// The constraint for `--json-schema`, if any; `templated`: the prompt
    /// went through the chat template (else the output is the JSON alone).
    pub fn constraint(&self, templated: bool) -> Result<Option<waste_grammar::Constraint>> {
        let Some(rf) = &self.opts.response_format else { return Ok(None) };
        let xtml = templated && self.xtml();
        let m = self.model;
        let g = waste_grammar::Grammars::for_parts(m.tokenizer(), m.config().vocab, m.constraint_end(xtml))?;
        let schema = match rf {
            ResponseFormat::JsonSchema(s) => Some(s),
            ResponseFormat::JsonObject => None,
        };
        Ok(Some(g.constraint(&waste_grammar::json_lark(schema, xtml, xtml && self.opts.thinking.is_some()))?))
    }

    /// A printer for one turn's output (`templated`: it answers a chat
    /// prompt, else the text is shown as it is).
    pub fn printer(&self, templated: bool) -> Printer {
        let parser = (templated && self.xtml()).then(|| OutputParser::new(self.opts.thinking.is_some()));
        Printer { parser, dim: std::io::stderr().is_terminal(), answer: String::new(), reasoning: String::new() }
    }

    /// Tokens that leave the session after a turn exactly as the next
    /// prompt assumes: the message closed and ended.
    pub fn close(&self, printer: &Printer, finish: &waste_model::Finish) -> Result<Vec<u32>> {
        let eom = self.end_of_msg();
        if self.xtml() && printer.parser.as_ref().is_some_and(|p| p.ended()) {
            // the model closed the message itself; only the stop token is not in the state yet
            return Ok(match (finish, eom) {
                (waste_model::Finish::StopToken(t), Some(e)) if *t == e => vec![e],
                _ => vec![],
            });
        }
        let (Some(tok), Some(tpl)) = (self.model.tokenizer(), self.model.chat_template()) else { return Ok(vec![]) };
        if self.model.is_k2() {
            // a turn ends with `<|im_end|>` (the stop token, not in the state)
            return Ok(tok.special_id(waste_model::tokenizer::k2::IM_END).into_iter().collect());
        }
        let msg = tpl.encode(tok, &[Message::new("assistant", "")], false)?;
        let open = tpl.encode(tok, &[], true)?;
        Ok(if msg.starts_with(&open) { msg[open.len()..].to_vec() } else { vec![] })
    }
}

/// Splits a turn's output into the answer (stdout) and the reasoning
/// (stderr, dimmed on a terminal).
pub struct Printer {
    parser: Option<OutputParser>,
    dim: bool,
    /// The answer so far.
    pub answer: String,
    /// The reasoning so far.
    pub reasoning: String,
}

impl Printer {
    /// Show a piece; `stream` false only collects.
    pub fn push(&mut self, piece: &str, out: &mut impl Write, stream: bool) -> std::io::Result<()> {
        let parts = match self.parser.as_mut() {
            Some(p) => p.push(piece),
            None => vec![Part::Content(piece.to_string())],
        };
        for part in parts {
            match part {
                Part::Content(c) => {
                    self.answer.push_str(&c);
                    if stream {
                        out.write_all(c.as_bytes())?;
                        out.flush()?;
                    }
                }
                Part::Reasoning(r) => {
                    self.reasoning.push_str(&r);
                    if stream {
                        let mut e = std::io::stderr().lock();
                        if self.dim {
                            write!(e, "\x1b[2m{r}\x1b[0m")?;
                        } else {
                            e.write_all(r.as_bytes())?;
                        }
                    }
                }
                Part::ToolCall { .. } => {}
            }
        }
        Ok(())
    }
}
