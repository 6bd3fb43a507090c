//! The engine thread: owns the model and one session per slot
//! (`--parallel`), takes jobs in FIFO order into free slots, decodes the
//! slots' requests together a token a step, reuses a slot's state for a
//! prompt that extends its previous conversation, and cancels a job as
//! soon as its client is gone.

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

/// Prompt tokens a slot evaluates between two decode steps: a long prompt
/// is taken in pieces so the requests already decoding go on meanwhile —
/// four chunks, at most [`PREFILL_PIECE_TOKENS`] or one chunk; a whole
/// prefill span (`Model::prefill_span`) while no request is decoding.
const PREFILL_PIECE_CHUNKS: usize = 4;

/// The most tokens a prompt piece takes when a chunk is smaller (so the
/// larger chunks a roomy budget gets do not lengthen the others' waits).
const PREFILL_PIECE_TOKENS: usize = 64;

/// One engine slot: a session, the tokens whose state it holds, a snapshot
/// taken right after its last prompt (a follow-up turn extends the prompt,
/// not the generated tokens, which the client re-sends as text), and the
/// request it is serving.
struct Slot<'m> {
    s: waste_model::Session<'m>,
    held: Vec<u64>,
    snap: Option<(Vec<u64>, waste_model::Snapshot)>,
    /// When it last took a request (the least recently used free slot takes
    /// a request that extends none).
    used: u64,
    active: Option<Active<'m>>,
}

/// A request a slot is serving.
struct Active<'m> {
    job: Job,
    keys: Vec<u64>,
    /// Prompt positions served from the reused state.
    reused: usize,
    pos0: usize,
    st0: waste_model::Stats,
    /// The prompt's next token to evaluate; its snapshot boundary.
    next: usize,
    boundary: usize,
    /// Set once the prompt is evaluated.
    gen: Option<waste_model::Generator<'m>>,
    prompt_positions: usize,
}

/// Run jobs until the channel closes, up to `parallel` at once: a new
/// request's prompt is evaluated in pieces between decode steps, and every
/// request that is decoding advances by one token a step, together
/// ([`Model::step_many`]). Each request's tokens are those it would get
/// alone.
pub fn run(model: &Model, rx: std::sync::mpsc::Receiver<Job>, counters: &Counters, parallel: usize) {
    let mut slots: Vec<Slot<'_>> = (0..parallel.max(1))
        .map(|_| Slot { s: model.session(), held: Vec::new(), snap: None, used: 0, active: None })
        .collect();
    let mut waiting: std::collections::VecDeque<Job> = Default::default();
    let mut clock = 0u64;
    loop {
        let idle = slots.iter().all(|s| s.active.is_none());
        if idle && waiting.is_empty() {
            counters.busy.store(false, Ordering::Relaxed);
            match rx.recv() {
                Ok(j) => waiting.push_back(j),
                Err(_) => return,
            }
        }
        while let Ok(j) = rx.try_recv() {
            waiting.push_back(j);
        }
        // new requests into free slots, in arrival order
        while let Some(free) = slots.iter().position(|s| s.active.is_none()) {
            let Some(job) = waiting.pop_front() else { break };
            counters.queued.fetch_sub(1, Ordering::Relaxed);
            if job.cancel.load(Ordering::Relaxed) || job.tx.is_closed() {
                continue;
            }
            counters.busy.store(true, Ordering::Relaxed);
            clock += 1;
            let keys = keys(&job.prompt, model.vision().map(|v| v.placeholder), &job.images);
            let i = best_slot(&slots, &keys).unwrap_or(free);
            slots[i].used = clock;
            start(model, &mut slots[i], job, keys);
        }
        // with no request decoding, nobody waits on a prompt: whole spans
        let decoding = slots.iter().any(|s| s.active.as_ref().is_some_and(|a| a.gen.is_some()));
        for slot in &mut slots {
            prefill_piece(model, slot, decoding);
        }
        decode_step(model, &mut slots, counters);
    }
}

/// The free slot whose held state or snapshot the job's prompt extends
/// furthest, else the least recently used free slot.
fn best_slot(slots: &[Slot<'_>], keys: &[u64]) -> Option<usize> {
    let extends = |base: &[u64]| !base.is_empty() && base.len() < keys.len() && keys.starts_with(base);
    let reach = |s: &Slot<'_>| {
        let snap = s.snap.as_ref().filter(|(t, _)| extends(t)).map_or(0, |(t, _)| t.len());
        if extends(&s.held) {
            s.held.len().max(snap)
        } else {
            snap
        }
    };
    let free = slots.iter().enumerate().filter(|(_, s)| s.active.is_none());
    let best = free.clone().max_by_key(|(i, s)| (reach(s), std::cmp::Reverse(*i)));
    match best {
        Some((i, s)) if reach(s) > 0 => Some(i),
        _ => free.min_by_key(|(_, s)| s.used).map(|(i, _)| i),
    }
}

/// Take `job` (its prompt as `keys`) into `slot`: resume from the held
/// state or the snapshot the prompt extends (else start over), queue the
/// images past the reused prefix. A job that cannot start gets its error.
fn start<'m>(model: &'m Model, slot: &mut Slot<'m>, job: Job, keys: Vec<u64>) {
    let pad = model.vision().map(|v| v.placeholder);
    let pads = job.prompt.iter().filter(|&&t| Some(t) == pad).count();
    if pads != job.images.len() {
        let _ = job.tx.send(Event::Error(format!("{pads} image placeholders for {} images", job.images.len())));
        return;
    }
    let extends = |base: &[u64]| !base.is_empty() && base.len() < keys.len() && keys.starts_with(base);
    let s = &mut slot.s;
    let start = match slot.snap.as_ref() {
        _ if extends(&slot.held) => slot.held.len(),
        // the session's own snapshot: it restores (checked all the same)
        Some((toks, sn)) if extends(toks) && s.restore_snapshot(sn).is_ok() => toks.len(),
        _ => {
            s.reset();
            0
        }
    };
    // positions of the reused prefix (an image's placeholder stands for its positions)
    let pads_before = job.prompt[..start].iter().filter(|&&t| Some(t) == pad).count();
    let reused = start - pads_before + job.images[..pads_before].iter().map(|i| i.positions()).sum::<usize>();
    let boundary = if job.boundary == 0 { job.prompt.len() } else { job.boundary.min(job.prompt.len()) };
    let (st0, pos0) = (s.stats(), s.position());
    // the tower runs for the images past the reused prefix only
    s.clear_images();
    let queued = job.images[pads_before..].iter().try_for_each(|img| s.add_image(model.encode_prepared(img)?));
    let a = Active { job, keys, reused, pos0, st0, next: start, boundary, gen: None, prompt_positions: 0 };
    slot.active = Some(a);
    if let Err(e) = queued.and_then(|_| check_fits(model, slot)) {
        fail(slot, e);
    }
}

/// [`Error::ContextFull`] when the prompt's positions past the reused
/// state (both of its ranges: to the snapshot boundary, and after it) do
/// not fit, before any of it is evaluated — as one `eval` of each range
/// would refuse it.
fn check_fits(model: &Model, slot: &Slot<'_>) -> waste_model::Result<()> {
    let a = slot.active.as_ref().expect("active");
    let pad = model.vision().map(|v| v.placeholder);
    let (ctx, mut pos) = (model.options().ctx, slot.s.position());
    let mut img = a.job.prompt[..a.next].iter().filter(|&&t| Some(t) == pad).count();
    let cut = a.boundary.max(a.next);
    for (lo, hi) in [(a.next, cut), (cut, a.job.prompt.len())] {
        let mut n = 0;
        for &t in &a.job.prompt[lo..hi] {
            if Some(t) == pad {
                n += a.job.images.get(img).map_or(1, |i| i.positions());
                img += 1;
            } else {
                n += 1;
            }
        }
        if pos + n > ctx {
            return Err(waste_model::Error::ContextFull { pos, n, ctx });
        }
        pos += n;
    }
    Ok(())
}

/// Evaluate the next piece of a slot's prompt (to its snapshot boundary
/// first, snapshotting there); when the prompt is done, start its generation.
fn prefill_piece<'m>(model: &'m Model, slot: &mut Slot<'m>, decoding: bool) {
    let Some(a) = slot.active.as_mut() else { return };
    if a.gen.is_some() {
        return;
    }
    let s = &mut slot.s;
    let mut piece = (s.chunk_len() * PREFILL_PIECE_CHUNKS).min(PREFILL_PIECE_TOKENS.max(s.chunk_len()));
    // where prompts prefill a span at a time (each expert read once a span)
    // and no other request is decoding, a whole span
    if !decoding {
        piece = piece.max(model.prefill_span().unwrap_or(0));
    }
    let len = a.job.prompt.len();
    let end = if a.next < a.boundary { a.boundary } else { len };
    let to = end.min(a.next + piece);
    let mut r = Ok(());
    if to > a.next {
        r = s.eval(&a.job.prompt[a.next..to]).map(|_| ());
        a.next = to;
        if r.is_ok() && to == a.boundary && a.boundary <= len {
            // the old snapshot goes first: never two at once (the plan counts one a slot)
            slot.snap = None;
            slot.snap = Some((a.keys[..a.boundary].to_vec(), s.snapshot()));
        }
    }
    if r.is_ok() && a.next >= len {
        a.prompt_positions = a.reused + s.position().saturating_sub(a.pos0);
        r = if s.position() == 0 {
            Err(waste_model::Error::Arg("generate needs a prompt on a fresh session".into()))
        } else {
            waste_model::Generator::new(model, &a.job.params, a.prompt_positions).map(|g| a.gen = Some(g))
        };
    }
    if let Err(e) = r {
        fail(slot, e);
    }
}

/// A request failed: its error to the client; the slot starts over.
fn fail(slot: &mut Slot<'_>, e: impl std::fmt::Display) {
    if let Some(a) = slot.active.take() {
        let _ = a.job.tx.send(Event::Error(e.to_string()));
    }
    slot.s.reset();
    slot.held.clear();
    slot.snap = None;
}

/// One token for every slot that is decoding: sample each from its logits,
/// advance the ones that go on together (in groups of at most
/// [`Model::max_batch`]), report each token, end the generations that end.
fn decode_step<'m>(model: &'m Model, slots: &mut [Slot<'m>], counters: &Counters) {
    let t0 = std::time::Instant::now();
    let mut picks: Vec<(usize, waste_model::Pick, waste_model::Stats)> = Vec::new();
    for (i, slot) in slots.iter_mut().enumerate() {
        let Some(a) = slot.active.as_mut() else { continue };
        let Some(gen) = a.gen.as_mut() else { continue };
        if !gen.wants_more() {
            finish(slot, counters);
            continue;
        }
        let constraint = a.job.constraint.as_deref_mut().map(|c| c as &mut dyn TokenConstraint);
        match gen.pick(slot.s.logits(), slot.s.position(), constraint) {
            Ok(pk) if pk.eos => finish(slot, counters),
            Ok(pk) => picks.push((i, pk, slot.s.stats())),
            Err(e) => fail(slot, e),
        }
    }
    let going: Vec<usize> = picks.iter().filter(|p| p.1.advance).map(|p| p.0).collect();
    for group in going.chunks(model.max_batch().max(1)) {
        let tokens: Vec<u32> =
            group.iter().map(|&i| picks.iter().find(|p| p.0 == i).expect("picked").1.token).collect();
        let mut refs: Vec<&mut waste_model::Session<'m>> =
            slots.iter_mut().enumerate().filter(|(i, _)| group.contains(i)).map(|(_, s)| &mut s.s).collect();
        let r = match refs.len() {
            1 => refs[0].eval_generated(tokens[0]),
            _ => model.step_many(&mut refs, &tokens),
        };
        if let Err(e) = r {
            let msg = e.to_string();
            for &i in group {
                picks.retain(|p| p.0 != i);
                fail(&mut slots[i], &msg);
            }
        }
    }
    let seconds = t0.elapsed().as_secs_f64();
    for (i, pk, st0) in picks {
        let slot = &mut slots[i];
        let Some(a) = slot.active.as_mut() else { continue };
        let ev = pk.event(slot.s.stats() - st0, seconds);
        counters.generated.fetch_add(1, Ordering::Relaxed);
        let sent = a.job.tx.send(Event::Token { token: ev.token, piece: ev.piece, logprob: ev.logprob, top: ev.top });
        let ctl =
            if sent.is_err() || a.job.cancel.load(Ordering::Relaxed) { Control::Cancel } else { Control::Continue };
        let gen = a.gen.as_mut().expect("decoding");
        gen.settle(&pk, ctl);
        if !gen.wants_more() {
            finish(slot, counters);
        }
    }
}

/// A generation ended: release its held-back text, report it done, keep
/// the state it leaves for a follow-up turn.
fn finish(slot: &mut Slot<'_>, counters: &Counters) {
    let Some(mut a) = slot.active.take() else { return };
    let gen = a.gen.take().expect("decoding");
    let tx = a.job.tx.clone();
    let g = gen.finish(|ev| {
        if ev.token != waste_model::NO_TOKEN {
            counters.generated.fetch_add(1, Ordering::Relaxed);
        }
        let ev = Event::Token { token: ev.token, piece: ev.piece.clone(), logprob: ev.logprob, top: ev.top.clone() };
        let _ = tx.send(ev);
        Control::Continue
    });
    let s = &slot.s;
    // the prompt and the generated tokens the session evaluated (not the last sampled one)
    let evaluated = (a.reused + s.position() - a.pos0).saturating_sub(a.prompt_positions);
    let mut all = a.keys;
    all.extend(g.tokens.iter().take(evaluated).map(|&t| t as u64));
    slot.held = all;
    let _ = tx.send(Event::Done {
        finish: g.finish.reason(),
        prompt_tokens: a.prompt_positions,
        completion_tokens: g.tokens.len(),
        reused_tokens: a.reused,
        stats: s.stats() - a.st0,
        direct_io: s.model().direct_io(),
    });
}
