//! Generation with a per-token callback: sampling, stop tokens, stop strings
//! matched across token boundaries (never emitted), logprobs, cancellation,
//! a clear signal when the context filled.

use crate::sample::{log_softmax, Sampler, SamplingParams};
use crate::{Error, Result, Session};
use std::time::Instant;
use waste_tokenizer::StreamDecoder;

/// The `token` of an event that only releases held-back text at the end.
pub const NO_TOKEN: u32 = u32::MAX;

/// What to generate.
#[derive(Clone, Debug, Default)]
pub struct GenerateParams {
    /// Sampling.
    pub sampling: SamplingParams,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Tokens that end generation (in addition to the model's EOS ids), not emitted.
    pub stop_tokens: Vec<u32>,
    /// Strings that end generation, matched across token boundaries, never emitted.
    pub stop_strings: Vec<String>,
    /// Alternatives to report with each token's logprob (0 = none).
    pub top_logprobs: usize,
    /// Emit special tokens into the text wrapped in [`MARK_OPEN`]…[`MARK_CLOSE`]
    /// (and replace those two characters in ordinary text with U+FFFD), so a
    /// parser of the output can tell markup from text that merely looks like it.
    pub mark_specials: bool,
}

/// Opens a special token in marked text (see [`GenerateParams::mark_specials`]).
pub const MARK_OPEN: char = '\u{F8F2}';
/// Closes a special token in marked text.
pub const MARK_CLOSE: char = '\u{F8F3}';

/// Restricts which token may come next: defined beside the tokens
/// (`waste_tokenizer`), driven here by [`Session::generate_constrained`],
/// which asks before every sample and reports every token it commits.
pub use waste_tokenizer::TokenConstraint;

/// Why generation ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Finish {
    /// An EOS or stop token.
    StopToken(u32),
    /// A stop string (the index into `stop_strings`).
    StopString(usize),
    /// `max_tokens` reached.
    Length,
    /// The context bound filled before the model finished.
    ContextFull,
    /// The callback cancelled.
    Cancelled,
}

impl Finish {
    /// OpenAI-style reason: `stop`, `length`, `cancelled`.
    pub fn reason(&self) -> &'static str {
        match self {
            Finish::StopToken(_) | Finish::StopString(_) => "stop",
            Finish::Length | Finish::ContextFull => "length",
            Finish::Cancelled => "cancelled",
        }
    }
}

/// One generated token, as the callback sees it.
#[derive(Clone, Debug)]
pub struct TokenEvent {
    /// Token id.
    pub token: u32,
    /// Text that became final with this token (held-back text is released later).
    pub piece: String,
    /// Log-probability of the token under the model.
    pub logprob: f32,
    /// The most likely alternatives `(id, logprob)`.
    pub top: Vec<(u32, f32)>,
    /// Expert uses served from the cache for this token.
    pub experts_hit: u64,
    /// Expert uses that needed a read.
    pub experts_missed: u64,
    /// Bytes read for this token.
    pub bytes_read: u64,
    /// Seconds for this token.
    pub seconds: f64,
    /// Seconds of it waiting for I/O.
    pub io_seconds: f64,
}

/// What the callback wants next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Control {
    /// Keep going.
    Continue,
    /// Stop now (reported as [`Finish::Cancelled`]).
    Cancel,
}

/// The outcome of [`Session::generate`].
#[derive(Clone, Debug)]
pub struct Generation {
    /// Generated tokens (stop tokens excluded).
    pub tokens: Vec<u32>,
    /// Generated text (stop strings excluded).
    pub text: String,
    /// Why it ended.
    pub finish: Finish,
    /// Prompt tokens evaluated by this call.
    pub prompt_tokens: usize,
}

/// The stop strings with their KMP prefix functions: the longest suffix
/// of the pending text that could still grow into a stop string is found
/// in one pass over its last `len − 1` bytes per stop string — linear,
/// where trying every prefix length was quadratic in the stop string (a
/// 1 MB stop string of newlines in a request, and a model writing
/// newlines: ~5·10¹¹ byte comparisons a token).
struct StopPrefixes {
    /// Each stop string's bytes and `pi[i]` = the length of the longest
    /// proper prefix of `s[..=i]` that is also its suffix.
    stops: Vec<(Vec<u8>, Vec<usize>)>,
}

impl StopPrefixes {
    fn new(stops: &[String]) -> StopPrefixes {
        let stops = stops
            .iter()
            .map(|st| {
                let s = st.as_bytes().to_vec();
                let mut pi = vec![0usize; s.len()];
                let mut k = 0;
                for i in 1..s.len() {
                    while k > 0 && s[i] != s[k] {
                        k = pi[k - 1];
                    }
                    if s[i] == s[k] {
                        k += 1;
                    }
                    pi[i] = k;
                }
                (s, pi)
            })
            .collect();
        StopPrefixes { stops }
    }

    /// Longest suffix of `text` that is a proper prefix of some stop string
    /// (when no stop string occurs in `text`). Byte-exact, so the cut is a
    /// char boundary: a prefix of a stop string starts with a lead byte,
    /// and `text` ends on a whole char.
    fn holdback(&self, text: &str) -> usize {
        let t = text.as_bytes();
        let mut best = 0;
        for (s, pi) in &self.stops {
            // only the last len − 1 bytes can hold a proper prefix
            let from = t.len().saturating_sub(s.len().saturating_sub(1));
            let mut k = 0;
            for &c in &t[from..] {
                while k > 0 && (k == s.len() || c != s[k]) {
                    k = pi[k - 1];
                }
                if c == s[k] {
                    k += 1;
                }
            }
            if k < s.len() {
                best = best.max(k);
            }
        }
        best
    }
}

/// One generation's sampling, stop tokens, stop strings and text, driven a
/// token at a time by whatever advances its session:
/// [`Session::generate_constrained`] drives one alone; a server decoding
/// several requests together drives one per request and advances their
/// sessions with [`crate::Model::step_many`]. Each round: [`Generator::pick`]
/// from the session's logits, advance the session by [`Pick::token`] when
/// [`Pick::advance`], report the token, then [`Generator::settle`].
pub struct Generator<'m> {
    p: GenerateParams,
    tok: Option<&'m waste_tokenizer::Tokenizer>,
    eos: Vec<u32>,
    sampler: Sampler,
    out: Generation,
    dec: StreamDecoder,
    pending: String,
    stop_prefixes: StopPrefixes,
    ctx: usize,
    mask: Vec<bool>,
    /// Set when the generation has ended and what remains is the tail
    /// release ([`Generator::finish`]) or nothing (`Some(false)`).
    ended: Option<bool>,
}

/// One sampled token of a [`Generator`].
#[derive(Clone, Debug)]
pub struct Pick {
    /// Token id ([`NO_TOKEN`] never: an end token is [`Pick::eos`]).
    pub token: u32,
    /// Text that became final with it.
    pub piece: String,
    /// Its log-probability under the model.
    pub logprob: f32,
    /// The most likely alternatives.
    pub top: Vec<(u32, f32)>,
    /// The session must evaluate `token` before the next pick (false when
    /// it ends the generation or the context is full).
    pub advance: bool,
    /// An EOS or stop token: the generation ended without a token to
    /// report ([`Generator::finish`] next).
    pub eos: bool,
    stopped: Option<usize>,
    ends: bool,
    full: bool,
}

impl<'m> Generator<'m> {
    /// A generation on `model` of `prompt_tokens` evaluated prompt tokens.
    ///
    /// # Errors
    /// [`Error::Arg`] for invalid sampling parameters, stop strings without
    /// the container's tokenizer, or an empty stop string.
    pub fn new(model: &'m crate::Model, p: &GenerateParams, prompt_tokens: usize) -> Result<Generator<'m>> {
        p.sampling.validate().map_err(Error::Arg)?;
        let tok = model.tokenizer();
        if !p.stop_strings.is_empty() && tok.is_none() {
            return Err(Error::Arg("stop strings need the container's tokenizer".into()));
        }
        if p.stop_strings.iter().any(|s| s.is_empty()) {
            // it would match before any text (the server refuses it too)
            return Err(Error::Arg("a stop string is empty".into()));
        }
        Ok(Generator {
            p: p.clone(),
            tok,
            eos: model.config().eos.iter().copied().chain(p.stop_tokens.iter().copied()).collect(),
            sampler: Sampler::new(p.sampling.clone()),
            out: Generation { tokens: Vec::new(), text: String::new(), finish: Finish::Length, prompt_tokens },
            dec: StreamDecoder::new(),
            pending: String::new(),
            stop_prefixes: StopPrefixes::new(&p.stop_strings),
            ctx: model.options().ctx,
            mask: Vec::new(),
            ended: None,
        })
    }

    /// Whether another token is wanted (not ended, below `max_tokens`).
    pub fn wants_more(&self) -> bool {
        self.ended.is_none() && self.out.tokens.len() < self.p.max_tokens
    }

    /// Sample the next token from `logits` (the session at `position`),
    /// under `constraint` if any; decode its text, holding back what could
    /// start a stop string.
    ///
    /// # Errors
    /// [`Error::Constraint`] when the constraint fails, [`Error::Arg`] when it allows no token.
    pub fn pick(
        &mut self,
        logits: &[f32],
        position: usize,
        constraint: Option<&mut (dyn TokenConstraint + '_)>,
    ) -> Result<Pick> {
        let mut constraint = constraint;
        let constrained = match constraint.as_deref_mut() {
            Some(c) => {
                self.mask.resize(logits.len(), false);
                c.allowed(&mut self.mask)?
            }
            None => false,
        };
        if constrained && !self.mask.iter().any(|&a| a) {
            return Err(Error::Arg("constraint: no token is allowed next".into()));
        }
        let mask = &self.mask;
        let id = if constrained {
            self.sampler.pick(logits, Some(&|i: u32| mask[i as usize]))
        } else {
            self.sampler.pick(logits, None)
        };
        if let Some(c) = constraint {
            c.commit(id)?;
        }
        let lp = log_softmax(logits);
        let top = top_logprobs(&lp, self.p.top_logprobs);
        let logprob = lp[id as usize];
        if self.eos.contains(&id) {
            self.out.finish = Finish::StopToken(id);
            self.ended = Some(true);
            let (piece, stopped) = (String::new(), None);
            return Ok(Pick {
                token: id,
                piece,
                logprob,
                top,
                advance: false,
                eos: true,
                stopped,
                ends: true,
                full: false,
            });
        }
        self.out.tokens.push(id);
        self.push_text(id);
        let stopped = first_stop(&self.p.stop_strings, &self.pending);
        let last = self.out.tokens.len() >= self.p.max_tokens;
        if last && stopped.is_none() {
            // no token follows: nothing can complete a stop string any more
            self.pending.push_str(&self.dec.finish());
        }
        let emit = match stopped {
            Some((_, pos)) => pos,
            None if last => self.pending.len(),
            None => self.pending.len() - self.stop_prefixes.holdback(&self.pending),
        };
        let piece: String = self.pending[..emit].to_string();
        self.pending.drain(..emit);
        self.out.text.push_str(&piece);
        // the session advances unless this token ends it
        let ends = stopped.is_some() || last;
        let full = position >= self.ctx;
        Ok(Pick {
            token: id,
            piece,
            logprob,
            top,
            advance: !ends && !full,
            eos: false,
            stopped: stopped.map(|s| s.0),
            ends,
            full,
        })
    }

    /// A token's text into the pending text.
    fn push_text(&mut self, id: u32) {
        let Some(t) = self.tok else { return };
        if self.p.mark_specials && t.is_special(id) {
            self.pending.push_str(&self.dec.finish());
            self.pending.push(MARK_OPEN);
            self.pending.push_str(&String::from_utf8_lossy(t.token_bytes(id)));
            self.pending.push(MARK_CLOSE);
        } else if self.p.mark_specials {
            self.pending.push_str(&self.dec.push(t.token_bytes(id)).replace([MARK_OPEN, MARK_CLOSE], "\u{FFFD}"));
        } else {
            self.pending.push_str(&self.dec.push(t.token_bytes(id)));
        }
    }

    /// After `pick` was reported and the caller answered `ctl`: whether the
    /// generation ended (a stop string, a cancel, a full context).
    pub fn settle(&mut self, pick: &Pick, ctl: Control) {
        if let Some(si) = pick.stopped {
            self.out.finish = Finish::StopString(si);
            self.ended = Some(false);
        } else if ctl == Control::Cancel {
            self.out.finish = Finish::Cancelled;
            self.ended = Some(false);
        } else if pick.full && !pick.ends {
            self.out.finish = Finish::ContextFull;
            self.ended = Some(true);
        }
    }

    /// The generation, releasing held-back text that never became a stop
    /// string (one last event with [`NO_TOKEN`]) unless it ended on a stop
    /// string or a cancel.
    pub fn finish(mut self, mut callback: impl FnMut(&TokenEvent) -> Control) -> Generation {
        if self.ended == Some(false) {
            return self.out;
        }
        let tail = self.dec.finish();
        self.pending.push_str(&tail);
        if !self.pending.is_empty() && !matches!(self.out.finish, Finish::StopString(_)) {
            self.out.text.push_str(&self.pending);
            callback(&TokenEvent {
                token: NO_TOKEN,
                piece: std::mem::take(&mut self.pending),
                logprob: 0.0,
                top: vec![],
                experts_hit: 0,
                experts_missed: 0,
                bytes_read: 0,
                seconds: 0.0,
                io_seconds: 0.0,
            });
        }
        self.out
    }
}

/// The `k` most likely tokens of `lp` (log-probabilities), most likely
/// first, ties by id.
fn top_logprobs(lp: &[f32], k: usize) -> Vec<(u32, f32)> {
    if k == 0 {
        return Vec::new();
    }
    let mut idx: Vec<usize> = (0..lp.len()).collect();
    let k = k.min(lp.len());
    idx.select_nth_unstable_by(k - 1, |&a, &b| lp[b].total_cmp(&lp[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]).then(a.cmp(&b)));
    idx.into_iter().map(|i| (i as u32, lp[i])).collect()
}

/// The stop string that occurs first in `text` (index, byte position),
/// the earliest listed on a tie.
fn first_stop(stops: &[String], text: &str) -> Option<(usize, usize)> {
    let mut stopped: Option<(usize, usize)> = None;
    for (si, s) in stops.iter().enumerate() {
        if let Some(pos) = text.find(s.as_str()) {
            if stopped.is_none_or(|(_, bp)| pos < bp) {
                stopped = Some((si, pos));
            }
        }
    }
    stopped
}

impl Pick {
    /// The event reporting this token, with the step's counters and time.
    pub fn event(&self, st: crate::Stats, seconds: f64) -> TokenEvent {
        TokenEvent {
            token: self.token,
            piece: self.piece.clone(),
            logprob: self.logprob,
            top: self.top.clone(),
            experts_hit: st.experts_hit,
            experts_missed: st.experts_missed,
            bytes_read: st.bytes_read,
            seconds,
            io_seconds: st.io_seconds,
        }
    }
}

impl Session<'_> {
    /// Evaluate `prompt` (may be empty to continue from the current state's
    /// last logits) and generate. The callback sees every token.
    ///
    /// # Errors
    /// [`Error::Arg`] for invalid sampling parameters or an empty prompt; [`Error::ContextFull`] when the prompt does not fit; the engine's I/O and record errors.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        p: &GenerateParams,
        callback: impl FnMut(&TokenEvent) -> Control,
    ) -> Result<Generation> {
        self.generate_constrained(prompt, p, None, callback)
    }

    /// [`Session::generate`] with an optional constraint on every sampled
    /// token. Logprobs stay those of the unconstrained model.
    ///
    /// # Errors
    /// As [`Session::generate`], and [`Error::Constraint`] when the constraint fails or allows no token.
    pub fn generate_constrained(
        &mut self,
        prompt: &[u32],
        p: &GenerateParams,
        mut constraint: Option<&mut dyn TokenConstraint>,
        mut callback: impl FnMut(&TokenEvent) -> Control,
    ) -> Result<Generation> {
        let mut gen = Generator::new(self.model(), p, 0)?;
        let pos0 = self.position();
        if !prompt.is_empty() {
            self.eval(prompt)?;
        } else if self.position() == 0 {
            return Err(Error::Arg("generate needs a prompt on a fresh session".into()));
        }
        gen.out.prompt_tokens = self.position() - pos0;
        while gen.wants_more() {
            let st0 = self.stats();
            let t0 = Instant::now();
            let pk = gen.pick(self.logits(), self.position(), constraint.as_deref_mut())?;
            if pk.eos {
                break;
            }
            if pk.advance {
                self.eval_inner(&[pk.token], false)?;
            }
            let ctl = callback(&pk.event(self.stats() - st0, t0.elapsed().as_secs_f64()));
            gen.settle(&pk, ctl);
        }
        Ok(gen.finish(callback))
    }
}

#[cfg(test)]
mod tests {
    use super::StopPrefixes;
    use proptest::prelude::*;

    /// The definition: every prefix length tried.
    fn holdback_naive(s: &str, stops: &[String]) -> usize {
        let mut best = 0;
        for st in stops {
            for (i, _) in st.char_indices().skip(1) {
                if s.ends_with(&st[..i]) {
                    best = best.max(i);
                }
            }
        }
        best
    }

    fn holdback(s: &str, stops: &[String]) -> usize {
        StopPrefixes::new(stops).holdback(s)
    }

    #[test]
    fn holdback_keeps_possible_stop_prefixes() {
        let stops = vec!["END".to_string(), "\n\n".to_string()];
        assert_eq!(holdback("abc E", &stops), 1);
        assert_eq!(holdback("abc EN", &stops), 2);
        assert_eq!(holdback("abc\n", &stops), 1);
        assert_eq!(holdback("abc", &stops), 0);
        // self-overlapping stop strings, multi-byte chars
        assert_eq!(holdback("xaabaa", &["aabaab".to_string()]), 5);
        assert_eq!(holdback("xaabaa", &["aabaac".to_string(), "aa".to_string()]), 5);
        assert_eq!(holdback("€€", &["€€€".to_string()]), 6);
        assert_eq!(holdback("a€", &["€x".to_string()]), 3);
    }

    /// A 100 000-byte stop string of newlines over as many pending
    /// newlines: one pass (trying every prefix length compared ~5·10⁹
    /// bytes per token).
    #[test]
    fn a_long_repetitive_stop_string_is_one_pass() {
        let stop = vec!["\n".repeat(100_000)];
        assert_eq!(holdback(&"\n".repeat(99_999), &stop), 99_999);
        assert_eq!(holdback(&format!("{}x{}", "\n".repeat(50_000), "\n".repeat(40_000)), &stop), 40_000);
    }

    proptest! {
        #[test]
        fn holdback_equals_the_definition(
            text in "[ab€\n]{0,24}",
            stops in proptest::collection::vec("[ab€\n]{1,8}", 1..4),
        ) {
            // holdback is asked only when no stop string occurs in the text
            prop_assume!(stops.iter().all(|s| !text.contains(s.as_str())));
            prop_assert_eq!(holdback(&text, &stops), holdback_naive(&text, &stops));
        }
    }
}
