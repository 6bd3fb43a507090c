//! Chat templates: `chat.json` (prefix/suffix per role + generation prefix)
//! or `chat_template.jinja` (minijinja). Template text is encoded as markup,
//! message content as plain text — never concatenated then encoded, so
//! content can never forge a control token.

use crate::{Error, Result, Tokenizer};
use std::path::Path;

/// One chat message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    /// `system`, `user`, `assistant`, `tool`.
    pub role: String,
    /// Content (plain text).
    pub content: String,
    /// Images announced before the content, by their files' `(width,
    /// height)`: each renders as [`image_markup`] (specials recognised).
    pub images: Vec<(u32, u32)>,
}

impl Message {
    /// A message.
    pub fn new(role: &str, content: &str) -> Message {
        Message { role: role.into(), content: content.into(), images: Vec::new() }
    }
    /// The message with images announced before its content.
    pub fn with_images(mut self, images: &[(u32, u32)]) -> Message {
        self.images = images.to_vec();
        self
    }
}

/// Opens an image announcement.
pub const MEDIA_BEGIN: &str = "<|media_begin|>";
/// Separates the announcement's text from the image.
pub const MEDIA_CONTENT: &str = "<|media_content|>";
/// The image itself: one placeholder, expanded by the engine to the image's positions.
pub const MEDIA_PAD: &str = "<|media_pad|>";
/// Closes the announcement.
pub const MEDIA_END: &str = "<|media_end|>";

/// How K3 announces an image of a file's `width × height` (MODEL.md):
/// `<|media_begin|>image {W}x{H}<|media_content|><|media_pad|><|media_end|>`,
/// to be encoded with specials recognised.
pub fn image_markup(width: u32, height: u32) -> String {
    format!("{MEDIA_BEGIN}image {width}x{height}{MEDIA_CONTENT}{MEDIA_PAD}{MEDIA_END}")
}

fn encode_images(tok: &Tokenizer, images: &[(u32, u32)], out: &mut Vec<u32>) {
    for &(w, h) in images {
        out.extend(tok.encode_markup(&image_markup(w, h)));
    }
}

/// A chat template.
#[derive(Clone, Debug)]
pub enum ChatTemplate {
    /// Prefix/suffix per role and a generation prefix (`chat.json`).
    Affix {
        /// `(role, prefix, suffix)`.
        roles: Vec<(String, String, String)>,
        /// Generation prefix.
        open: String,
    },
    /// A Jinja template (`chat_template.jinja`).
    Jinja(String),
    /// Kimi K3's tagged format, rendered natively ([`crate::xtml`]): tools,
    /// thinking and structured output need it.
    Xtml,
    /// The Kimi K2 family's format (Kimi-Linear's), rendered natively
    /// ([`crate::k2`]): tools need it.
    K2,
}

/// Template instructions one rendering may execute (a 1,000-message
/// conversation through a real template takes well under 1 M).
pub const TEMPLATE_FUEL: u64 = 20_000_000;
/// Deepest nesting of calls, includes and blocks a template may reach.
pub const TEMPLATE_RECURSION: usize = 64;
/// Most bytes one rendering of a `chat_template.jinja` may write. Contents
/// are not in it (each renders as a short placeholder), so this is markup:
/// a 1,000-message conversation through a real template writes ≈ 50 KB.
/// Fuel counts instructions, not bytes — `{{ 'x' * 100000000 }}` is one —
/// so without this a loop of a few instructions wrote gigabytes and the
/// process died on a failed allocation.
pub const TEMPLATE_OUTPUT_BYTES: usize = 1 << 20;

/// Sentinels delimiting content inside a rendered Jinja template (private-use code points).
const OPEN: char = '\u{F8F0}';
const CLOSE: char = '\u{F8F1}';

/// What renders a `chat_template.jinja` for a conversation of `roles`
/// (every content a placeholder) into its markup: [`render_jinja`], or what
/// [`set_jinja_renderer`] installed.
pub type JinjaRenderer = fn(src: &str, roles: &[&str], open: bool) -> Result<String>;

static JINJA_RENDERER: std::sync::OnceLock<JinjaRenderer> = std::sync::OnceLock::new();

/// Render Jinja templates with `f` instead of [`render_jinja`] in this
/// process, from now on (once per process: false when a renderer was
/// already set). A template is code from the container, and fuel, nesting
/// and the output bound do not bound a value it grows without writing it,
/// nor the time one instruction takes: the `waste` binary renders in a child
/// process with memory and CPU limits, so a hostile template is an error
/// there, not the end of the process.
pub fn set_jinja_renderer(f: JinjaRenderer) -> bool {
    JINJA_RENDERER.set(f).is_ok()
}

/// Render a `chat_template.jinja` in this process for a conversation of
/// `roles` (message `i`'s content rendered as a placeholder that
/// [`ChatTemplate::encode`] replaces), with `add_generation_prompt = open`:
/// bounded in instructions ([`TEMPLATE_FUEL`]), nesting
/// ([`TEMPLATE_RECURSION`]) and output ([`TEMPLATE_OUTPUT_BYTES`]).
///
/// # Errors
/// [`Error::Template`] naming `chat_template.jinja`: a Jinja error, a limit.
pub fn render_jinja(src: &str, roles: &[&str], open: bool) -> Result<String> {
    // third-party templates are untrusted code: bounded in work (fuel),
    // nesting and output, so a hostile one is an error, not a hang
    let mut env = minijinja::Environment::new();
    env.set_fuel(Some(TEMPLATE_FUEL));
    env.set_recursion_limit(TEMPLATE_RECURSION);
    env.add_template("chat", src).map_err(|e| Error::Template(format!("chat_template.jinja: {e}")))?;
    let msgs: Vec<serde_json::Value> = roles
        .iter()
        .enumerate()
        .map(|(i, r)| serde_json::json!({"role": r, "content": format!("{OPEN}{i}{CLOSE}")}))
        .collect();
    let mut out = Capped::default();
    let ctx = minijinja::context! { messages => msgs, add_generation_prompt => open };
    if let Err(e) = env.get_template("chat").and_then(|t| t.render_captured_to(ctx, &mut out).map(drop)) {
        return Err(Error::Template(if out.over {
            format!("chat_template.jinja renders more than {TEMPLATE_OUTPUT_BYTES} bytes of markup")
        } else {
            format!("chat_template.jinja: {e}")
        }));
    }
    String::from_utf8(out.buf).map_err(|_| Error::Template("chat_template.jinja rendered invalid UTF-8".into()))
}

/// A template's output, refused past [`TEMPLATE_OUTPUT_BYTES`] (before the
/// bytes are kept).
#[derive(Default)]
struct Capped {
    buf: Vec<u8>,
    over: bool,
}

impl std::io::Write for Capped {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if b.len() > TEMPLATE_OUTPUT_BYTES - self.buf.len() {
            self.over = true;
            return Err(std::io::Error::other("template output over its bound"));
        }
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Plain messages as the tagged formats' messages (content and images).
fn tagged(messages: &[Message]) -> Vec<crate::xtml::ChatMessage> {
    messages
        .iter()
        .map(|m| crate::xtml::ChatMessage {
            images: m.images.clone(),
            ..crate::xtml::ChatMessage::new(&m.role, &m.content)
        })
        .collect()
}

impl ChatTemplate {
    /// Parse `chat.json`: `{"system": [prefix, suffix], "user": [...], "assistant": [...], "open": "..."}`.
    ///
    /// # Errors
    /// [`Error::Json`] naming `chat.json` for malformed JSON or fields.
    pub fn parse_json(text: &str) -> Result<ChatTemplate> {
        let err = |m: String| Error::Json { file: "chat.json".into(), msg: m };
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| err(e.to_string()))?;
        let o = v.as_object().ok_or_else(|| err("expected an object".into()))?;
        let mut roles = Vec::new();
        let mut open = String::new();
        for (k, val) in o {
            if k == "open" {
                open = val.as_str().ok_or_else(|| err("\"open\" must be a string".into()))?.to_string();
                continue;
            }
            let a = val
                .as_array()
                .filter(|a| a.len() == 2)
                .ok_or_else(|| err(format!("{k:?} must be [prefix, suffix]")))?;
            let s = |x: &serde_json::Value| {
                x.as_str().map(str::to_string).ok_or_else(|| err(format!("{k:?}: strings expected")))
            };
            roles.push((k.clone(), s(&a[0])?, s(&a[1])?));
        }
        Ok(ChatTemplate::Affix { roles, open })
    }

    /// The container's template: `chat_template.jinja`, else `chat.json`,
    /// else a default built from the specials the tokenizer has.
    ///
    /// # Errors
    /// [`Error::Io`] for an unreadable template file, and the parse errors of `chat.json`.
    pub fn from_container_dir(dir: &Path, tok: &Tokenizer) -> Result<ChatTemplate> {
        let read = |p: &Path| crate::read_text(p, crate::MAX_TEMPLATE_BYTES);
        let j = dir.join("chat_template.jinja");
        if j.exists() {
            let src = read(&j)?;
            // a K2-family template (Kimi-Linear's release ships one) is the
            // format the native renderer writes as the reference does, with
            // tools; docs/REFERENCE-DIFFERENCES.md says where it may differ
            if src.contains(crate::k2::SECTION_BEGIN) && src.contains("tool_declare") && crate::k2::supported(tok) {
                return Ok(ChatTemplate::K2);
            }
            return Ok(ChatTemplate::Jinja(src));
        }
        let c = dir.join("chat.json");
        if c.exists() {
            let t = Self::parse_json(&read(&c)?)?;
            // the C converter writes K3's markers as plain affixes; on a
            // tokenizer that has them that means K3's format (tools,
            // thinking, the output parser), never text to show
            if let ChatTemplate::Affix { roles, open } = &t {
                let k3 = roles.iter().any(|(_, pre, _)| pre.contains("<|open|>message role="))
                    || open.contains("<|open|>message role=");
                if k3 && crate::xtml::supported(tok) {
                    return Ok(ChatTemplate::Xtml);
                }
            }
            return Ok(t);
        }
        Ok(Self::default_for(tok))
    }

    /// A default template from the tokenizer's specials (the K2 family's
    /// format when every one of its markers is there, else Kimi's `<|im_*|>`
    /// turns, the K3-style `<|open|>…<|sep|>` markup, or plain text).
    pub fn default_for(tok: &Tokenizer) -> ChatTemplate {
        let roles = ["system", "user", "assistant", "tool"];
        if crate::k2::supported(tok) {
            return ChatTemplate::K2;
        }
        if tok.special_id("<|im_user|>").is_some() && tok.special_id("<|im_middle|>").is_some() {
            let tag = |r: &str| match r {
                "user" => "<|im_user|>",
                "assistant" => "<|im_assistant|>",
                _ => "<|im_system|>",
            };
            return ChatTemplate::Affix {
                roles: roles
                    .iter()
                    .map(|r| (r.to_string(), format!("{}{r}<|im_middle|>", tag(r)), "<|im_end|>".to_string()))
                    .collect(),
                open: "<|im_assistant|>assistant<|im_middle|>".into(),
            };
        }
        if crate::xtml::supported(tok) {
            return ChatTemplate::Xtml;
        }
        ChatTemplate::Affix {
            roles: roles.iter().map(|r| (r.to_string(), format!("{r}: "), "\n".to_string())).collect(),
            open: "assistant: ".into(),
        }
    }

    /// Encode a conversation; with `open`, end with the generation prefix.
    ///
    /// # Errors
    /// [`Error::Template`] when a template fails (a Jinja error, its fuel or recursion limit, an unknown role), naming `chat_template.jinja`.
    pub fn encode(&self, tok: &Tokenizer, messages: &[Message], open: bool) -> Result<Vec<u32>> {
        match self {
            ChatTemplate::Affix { roles, open: gen } => {
                let mut out = Vec::new();
                for m in messages {
                    let (_, pre, suf) = roles
                        .iter()
                        .find(|(r, _, _)| *r == m.role)
                        .ok_or_else(|| Error::Template(format!("no template for role {:?}", m.role)))?;
                    out.extend(tok.encode_markup(pre));
                    encode_images(tok, &m.images, &mut out);
                    out.extend(tok.encode_plain(&m.content));
                    out.extend(tok.encode_markup(suf));
                }
                if open {
                    out.extend(tok.encode_markup(gen));
                }
                Ok(out)
            }
            ChatTemplate::Xtml => {
                crate::xtml::encode(tok, &tagged(messages), &crate::xtml::XtmlOptions::default(), open).map(|e| e.ids)
            }
            ChatTemplate::K2 => crate::k2::encode(tok, &tagged(messages), &[], open).map(|e| e.ids),
            ChatTemplate::Jinja(src) => {
                let roles: Vec<&str> = messages.iter().map(|m| m.role.as_str()).collect();
                let rendered = match JINJA_RENDERER.get() {
                    Some(f) => f(src, &roles, open)?,
                    None => render_jinja(src, &roles, open)?,
                };
                // template text → markup; each content placeholder → that message's content, plain
                let mut out = Vec::new();
                let mut rest = rendered.as_str();
                while let Some(a) = rest.find(OPEN) {
                    out.extend(tok.encode_markup(&rest[..a]));
                    let after = &rest[a + OPEN.len_utf8()..];
                    let b = after
                        .find(CLOSE)
                        .ok_or_else(|| Error::Template("template altered a content placeholder".into()))?;
                    let idx: usize = after[..b]
                        .parse()
                        .map_err(|_| Error::Template("template altered a content placeholder".into()))?;
                    let m = messages.get(idx).ok_or_else(|| Error::Template("bad content placeholder".into()))?;
                    encode_images(tok, &m.images, &mut out);
                    out.extend(tok.encode_plain(&m.content));
                    rest = &after[b + CLOSE.len_utf8()..];
                }
                out.extend(tok.encode_markup(rest));
                Ok(out)
            }
        }
    }
}

#[cfg(test)]
mod template_fuzz_twin {
    //! The `chat_template` fuzz target's twin: templates assembled from Jinja
    //! fragments (loops, recursion, filters, broken syntax) render or fail
    //! with an error naming the file — never a panic or a hang.
    use super::*;
    use proptest::prelude::*;

    fn tok() -> Tokenizer {
        let specials: Vec<(u32, String)> = vec![(256, "<|im_end|>".to_string())];
        Tokenizer::new((0..256u32).map(|b| (vec![b as u8], b)).collect(), specials, crate::Pattern::O200k)
            .expect("a byte tokenizer")
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn assembled_templates_render_or_fail_cleanly(parts in proptest::collection::vec(0usize..12, 1..8)) {
            const FRAG: [&str; 12] = [
                "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
                "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}",
                "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
                "{{ messages[0].content | upper }}",
                "{% if add_generation_prompt %}assistant:{% endif %}",
                "{{ undefined_thing.attr }}",
                "{% for",
                "{{ 1 / 0 }}",
                "{{ messages | length }}",
                "{% set x = 'a' * 1000 %}{{ x }}",
                "<|im_end|>",
                "{{ raise_exception('no') }}",
            ];
            let src: String = parts.iter().map(|&i| FRAG[i]).collect();
            match ChatTemplate::Jinja(src).encode(&tok(), &[Message::new("user", "hi")], true) {
                Ok(_) => {}
                Err(e) => prop_assert!(e.to_string().contains("chat_template.jinja"), "{}", e),
            }
        }
    }
}

#[cfg(test)]
mod output_bound {
    use super::*;

    fn tok() -> Tokenizer {
        Tokenizer::new((0..256u32).map(|b| (vec![b as u8], b)).collect(), vec![], crate::Pattern::O200k)
            .expect("a byte tokenizer")
    }

    #[test]
    fn a_template_writing_past_its_bound_is_an_error_not_gigabytes() {
        // ten instructions asking for 10 GB: before the bound, the process
        // died on a failed allocation (or filled the machine)
        let src = "{% for i in range(100) %}{{ 'x' * 100000000 }}{% endfor %}";
        let e = ChatTemplate::Jinja(src.into()).encode(&tok(), &[Message::new("user", "hi")], true).unwrap_err();
        assert!(e.to_string().contains(&format!("renders more than {TEMPLATE_OUTPUT_BYTES} bytes")), "{e}");
        // one byte under the bound renders; one byte over does not
        let exactly =
            |n: usize| format!("{{{{ 'x' * {n} }}}}{{% for m in messages %}}{{{{ m.content }}}}{{% endfor %}}");
        let placeholder = format!("{OPEN}0{CLOSE}").len();
        let fits = ChatTemplate::Jinja(exactly(TEMPLATE_OUTPUT_BYTES - placeholder));
        assert_eq!(
            fits.encode(&tok(), &[Message::new("user", "hi")], true).unwrap().len(),
            TEMPLATE_OUTPUT_BYTES - placeholder + 2
        );
        let over = ChatTemplate::Jinja(exactly(TEMPLATE_OUTPUT_BYTES - placeholder + 1));
        assert!(over.encode(&tok(), &[Message::new("user", "hi")], true).is_err());
    }

    #[test]
    fn a_long_conversation_through_a_real_template_stays_far_below_the_bound() {
        // the shape of Kimi's template: tags around each turn
        let src = "{% for m in messages %}<|im_{{ m.role }}|>{{ m.role }}<|im_middle|>{{ m.content }}<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}";
        let msgs: Vec<Message> = (0..1000).map(|i| Message::new(["user", "assistant"][i % 2], "hi")).collect();
        let roles: Vec<&str> = msgs.iter().map(|m| m.role.as_str()).collect();
        let markup = render_jinja(src, &roles, true).unwrap();
        assert!(markup.len() < TEMPLATE_OUTPUT_BYTES / 10, "{} bytes", markup.len());
        assert!(ChatTemplate::Jinja(src.into()).encode(&tok(), &msgs, true).is_ok());
    }
}

#[cfg(test)]
mod images {
    use super::*;

    fn tok() -> Tokenizer {
        let specials: Vec<(u32, String)> = [
            MEDIA_BEGIN,
            MEDIA_CONTENT,
            MEDIA_PAD,
            MEDIA_END,
            crate::xtml::OPEN,
            crate::xtml::CLOSE,
            crate::xtml::SEP,
            crate::xtml::END_OF_MSG,
        ]
        .iter()
        .enumerate()
        .map(|(i, s)| (256 + i as u32, s.to_string()))
        .collect();
        Tokenizer::new((0..256u32).map(|b| (vec![b as u8], b)).collect(), specials, crate::Pattern::O200k).unwrap()
    }

    /// The announcement as ids: begin, "image WxH", content, pad, end.
    fn announced(w: u32, h: u32) -> Vec<u32> {
        let mut v = vec![256];
        v.extend(format!("image {w}x{h}").bytes().map(u32::from));
        v.extend([257, 258, 259]);
        v
    }

    #[test]
    fn images_are_announced_before_the_content_in_every_template() {
        let t = tok();
        let m = [Message::new("user", "hi <|media_pad|>").with_images(&[(84, 56), (3, 4)])];
        let mut want = announced(84, 56);
        want.extend(announced(3, 4));
        // the content stays plain text even when it spells a special
        let content: Vec<u32> = "hi <|media_pad|>".bytes().map(u32::from).collect();
        want.extend(&content);
        let plain = ChatTemplate::Affix {
            roles: vec![("user".into(), "user: ".into(), "\n".into())],
            open: "assistant: ".into(),
        };
        for tpl in [
            plain,
            ChatTemplate::Xtml,
            ChatTemplate::Jinja("{% for m in messages %}[{{ m.content }}]{% endfor %}".into()),
        ] {
            let ids = tpl.encode(&t, &m, false).unwrap();
            let at = ids.windows(want.len()).position(|w| w == want.as_slice());
            assert!(at.is_some(), "{tpl:?}: {ids:?}");
            assert_eq!(ids.iter().filter(|&&i| i == 258).count(), 2, "{tpl:?}: exactly the two placeholders");
        }
    }
}
