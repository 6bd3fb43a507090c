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
        p.sampling.validate().map_err(Error::Arg)?;
        let tok = self.model().tokenizer();
        if !p.stop_strings.is_empty() && tok.is_none() {
            return Err(Error::Arg("stop strings need the container's tokenizer".into()));
        }
        if p.stop_strings.iter().any(|s| s.is_empty()) {
            // it would match before any text (the server refuses it too)
            return Err(Error::Arg("a stop string is empty".into()));
        }
        let eos: Vec<u32> = self.model().config().eos.iter().copied().chain(p.stop_tokens.iter().copied()).collect();
        let mut sampler = Sampler::new(p.sampling.clone());
        let pos0 = self.position();
        if !prompt.is_empty() {
            self.eval(prompt)?;
        } else if self.position() == 0 {
            return Err(Error::Arg("generate needs a prompt on a fresh session".into()));
        }
        let prompt_tokens = self.position() - pos0;
        let mut out = Generation { tokens: Vec::new(), text: String::new(), finish: Finish::Length, prompt_tokens };
        let mut dec = StreamDecoder::new();
        let mut pending = String::new();
        let stop_prefixes = StopPrefixes::new(&p.stop_strings);
        let ctx = self.model().options().ctx;
        let mut mask = Vec::new();
        while out.tokens.len() < p.max_tokens {
            let st0 = self.stats();
            let t0 = Instant::now();
            let logits = self.logits();
            let constrained = match constraint.as_deref_mut() {
                Some(c) => {
                    mask.resize(logits.len(), false);
                    c.allowed(&mut mask)?
                }
                None => false,
            };
            if constrained && !mask.iter().any(|&a| a) {
                return Err(Error::Arg("constraint: no token is allowed next".into()));
            }
            let id = if constrained {
                sampler.pick(logits, Some(&|i: u32| mask[i as usize]))
            } else {
                sampler.pick(logits, None)
            };
            if let Some(c) = constraint.as_deref_mut() {
                c.commit(id)?;
            }
            let lp = log_softmax(logits);
            let mut top = Vec::new();
            if p.top_logprobs > 0 {
                let mut idx: Vec<usize> = (0..lp.len()).collect();
                let k = p.top_logprobs.min(lp.len());
                idx.select_nth_unstable_by(k - 1, |&a, &b| lp[b].total_cmp(&lp[a]).then(a.cmp(&b)));
                idx.truncate(k);
                idx.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]).then(a.cmp(&b)));
                top = idx.into_iter().map(|i| (i as u32, lp[i])).collect();
            }
            if eos.contains(&id) {
                out.finish = Finish::StopToken(id);
                break;
            }
            out.tokens.push(id);
            // text: decode, then hold back what could start a stop string
            if let Some(t) = tok {
                if p.mark_specials && t.is_special(id) {
                    pending.push_str(&dec.finish());
                    pending.push(MARK_OPEN);
                    pending.push_str(&String::from_utf8_lossy(t.token_bytes(id)));
                    pending.push(MARK_CLOSE);
                } else if p.mark_specials {
                    pending.push_str(&dec.push(t.token_bytes(id)).replace([MARK_OPEN, MARK_CLOSE], "\u{FFFD}"));
                } else {
                    pending.push_str(&dec.push(t.token_bytes(id)));
                }
            }
            let mut stopped = None;
            for (si, s) in p.stop_strings.iter().enumerate() {
                if let Some(pos) = pending.find(s.as_str()) {
                    if stopped.is_none_or(|(_, bp)| pos < bp) {
                        stopped = Some((si, pos));
                    }
                }
            }
            let last = out.tokens.len() >= p.max_tokens;
            if last && stopped.is_none() {
                // no token follows: nothing can complete a stop string any more
                pending.push_str(&dec.finish());
            }
            let emit = match stopped {
                Some((_, pos)) => pos,
                None if last => pending.len(),
                None => pending.len() - stop_prefixes.holdback(&pending),
            };
            let piece: String = pending[..emit].to_string();
            pending.drain(..emit);
            out.text.push_str(&piece);
            // advance the model unless this token ends it
            let ends = stopped.is_some() || out.tokens.len() >= p.max_tokens;
            let full = self.position() >= ctx;
            if !ends && !full {
                self.eval_inner(&[id], false)?;
            }
            let st = self.stats() - st0;
            let ev = TokenEvent {
                token: id,
                piece,
                logprob: lp[id as usize],
                top,
                experts_hit: st.experts_hit,
                experts_missed: st.experts_missed,
                bytes_read: st.bytes_read,
                seconds: t0.elapsed().as_secs_f64(),
                io_seconds: st.io_seconds,
            };
            let ctl = callback(&ev);
            if let Some((si, _)) = stopped {
                out.finish = Finish::StopString(si);
                return Ok(out);
            }
            if ctl == Control::Cancel {
                out.finish = Finish::Cancelled;
                return Ok(out);
            }
            if full && !ends {
                out.finish = Finish::ContextFull;
                break;
            }
        }
        // release held-back text that never became a stop string
        let tail = dec.finish();
        pending.push_str(&tail);
        if !pending.is_empty() && !matches!(out.finish, Finish::StopString(_)) {
            out.text.push_str(&pending);
            callback(&TokenEvent {
                token: NO_TOKEN,
                piece: pending,
                logprob: 0.0,
                top: vec![],
                experts_hit: 0,
                experts_missed: 0,
                bytes_read: 0,
                seconds: 0.0,
                io_seconds: 0.0,
            });
        }
        Ok(out)
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
