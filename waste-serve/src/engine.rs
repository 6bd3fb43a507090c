//! The engine thread: owns the model and one session, serves jobs in FIFO
//! order, reuses the session state for a prompt that extends the previous
//! conversation, and cancels a job as soon as its client is gone.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tokio::sync::mpsc::UnboundedSender;
use waste_model::{Control, GenerateParams, Model, TokenConstraint};

/// Engine counters, readable from the HTTP side.
#[derive(Debug, Default)]
pub struct Counters {
    /// Tokens generated so far.
    pub generated: std::sync::atomic::AtomicU64,
    /// Whether a job is running.
    pub busy: AtomicBool,
    /// Jobs waiting or running.
    pub queued: std::sync::atomic::AtomicU64,
}

/// One generation request.
pub struct Job {
    /// Prompt token ids (template applied).
    pub prompt: Vec<u32>,
    /// Generation parameters.
    pub params: GenerateParams,
    /// Where events go; a failed send means the client left.
    pub tx: UnboundedSender<Event>,
    /// Set to cancel.
    pub cancel: Arc<AtomicBool>,
    /// Where the conversation's messages end in `prompt` (before trailing
    /// notices and the generation prompt): the state there is kept, so the
    /// next turn — which extends the messages, not this request's notices —
    /// resumes from it. 0 = after the whole prompt.
    pub boundary: usize,
    /// Constrained decoding (JSON schema, tool calls), if any.
    pub constraint: Option<Box<dyn TokenConstraint + Send>>,
    /// The images for the prompt's `<|media_pad|>` placeholders, in order
    /// (decoded; the tower runs here, only for images past the reused prefix).
    pub images: Vec<waste_model::PreparedImage>,
    /// The server's request memory reserved for `images`: released when
    /// the job is dropped, done or not.
    pub held: Vec<tokio::sync::OwnedSemaphorePermit>,
}

/// A prompt as comparable keys, one per token: the id, or for an image
/// placeholder its image's digest (top bit set) — two prompts share a prefix
/// only when their images are the same files.
fn keys(prompt: &[u32], pad: Option<u32>, images: &[waste_model::PreparedImage]) -> Vec<u64> {
    let mut next = images.iter();
    prompt
        .iter()
        .map(|&t| {
            if Some(t) == pad {
                if let Some(i) = next.next() {
                    return (1 << 63) | i.key();
                }
            }
            t as u64
        })
        .collect()
}

/// Events of a job.
#[derive(Debug)]
pub enum Event {
    /// A token (piece may be empty while text is held back).
    Token {
        /// Id.
        token: u32,
        /// Text released with it.
        piece: String,
        /// Its logprob.
        logprob: f32,
        /// Alternatives.
        top: Vec<(u32, f32)>,
    },
    /// Finished.
    Done {
        /// OpenAI finish reason.
        finish: &'static str,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Completion tokens.
        completion_tokens: usize,
        /// Prompt tokens served from the reused state.
        reused_tokens: usize,
        /// Engine statistics for this job.
        stats: waste_model::Stats,
        /// Whether expert reads bypass the page cache.
        direct_io: bool,
    },
    /// Failed.
    Error(String),
}

/// Run jobs until the channel closes.
pub fn run(model: &Model, rx: std::sync::mpsc::Receiver<Job>, counters: &Counters) {
    let mut s = model.session();
    // the tokens whose state the session holds, and a snapshot taken right
    // after the last prompt (a follow-up turn extends the prompt, not the
    // generated tokens, which the client re-sends as text)
    let mut held: Vec<u64> = Vec::new();
    let mut snap: Option<(Vec<u64>, waste_model::Snapshot)> = None;
    let pad = model.vision().map(|v| v.placeholder);
    for mut job in rx {
        counters.queued.fetch_sub(1, Ordering::Relaxed);
        if job.cancel.load(Ordering::Relaxed) || job.tx.is_closed() {
            continue;
        }
        counters.busy.store(true, Ordering::Relaxed);
        let pads = job.prompt.iter().filter(|&&t| Some(t) == pad).count();
        if pads != job.images.len() {
            let _ = job.tx.send(Event::Error(format!("{pads} image placeholders for {} images", job.images.len())));
            counters.busy.store(false, Ordering::Relaxed);
            continue;
        }
        let keys = keys(&job.prompt, pad, &job.images);
        let extends = |base: &[u64]| !base.is_empty() && base.len() < keys.len() && keys.starts_with(base);
        let start = match snap.as_ref() {
            _ if extends(&held) => held.len(),
            // the session's own snapshot: it restores (checked all the same)
            Some((toks, sn)) if extends(toks) && s.restore_snapshot(sn).is_ok() => toks.len(),
            _ => {
                s.reset();
                0
            }
        };
        let st0 = s.stats();
        let pos0 = s.position();
        // positions of the reused prefix (an image's placeholder stands for its positions)
        let is_pad = |t: &u32| Some(*t) == pad;
        let pads_before = job.prompt[..start].iter().filter(|t| is_pad(t)).count();
        let reused = start - pads_before + job.images[..pads_before].iter().map(|i| i.positions()).sum::<usize>();
        let mut generated = Vec::new();
        let boundary = if job.boundary == 0 { job.prompt.len() } else { job.boundary.min(job.prompt.len()) };
        // the tower runs for the images past the reused prefix only
        s.clear_images();
        let mut r = Ok(());
        for img in &job.images[pads_before..] {
            r = r.and_then(|_| s.add_image(model.encode_prepared(img)?));
        }
        let r = r.and_then(|_| {
            if boundary > start {
                s.eval(&job.prompt[start..boundary])?;
                snap = Some((keys[..boundary].to_vec(), s.snapshot()));
            }
            Ok(())
        });
        let rest = &job.prompt[boundary.max(start)..];
        let r = r.and_then(|_| if rest.is_empty() { Ok(()) } else { s.eval(rest).map(|_| ()) });
        let prompt_positions = reused + s.position().saturating_sub(pos0);
        let constraint = job.constraint.as_deref_mut().map(|c| c as &mut dyn TokenConstraint);
        let r = r.and_then(|_| {
            s.generate_constrained(&[], &job.params, constraint, |ev| {
                if ev.token != waste_model::NO_TOKEN {
                    generated.push(ev.token);
                    counters.generated.fetch_add(1, Ordering::Relaxed);
                }
                let ok = job
                    .tx
                    .send(Event::Token {
                        token: ev.token,
                        piece: ev.piece.clone(),
                        logprob: ev.logprob,
                        top: ev.top.clone(),
                    })
                    .is_ok();
                if !ok || job.cancel.load(Ordering::Relaxed) {
                    Control::Cancel
                } else {
                    Control::Continue
                }
            })
        });
        match r {
            Ok(g) => {
                // the prompt and the generated tokens the session evaluated (not the last sampled one)
                let evaluated = (reused + s.position() - pos0).saturating_sub(prompt_positions);
                let mut all = keys;
                all.extend(g.tokens.iter().take(evaluated).map(|&t| t as u64));
                held = all;
                let stats = s.stats() - st0;
                let _ = job.tx.send(Event::Done {
                    finish: g.finish.reason(),
                    prompt_tokens: prompt_positions,
                    completion_tokens: g.tokens.len(),
                    reused_tokens: reused,
                    stats,
                    direct_io: model.direct_io(),
                });
            }
            Err(e) => {
                s.reset();
                held.clear();
                snap = None;
                let _ = job.tx.send(Event::Error(e.to_string()));
            }
        }
        counters.busy.store(false, Ordering::Relaxed);
    }
}
