//! # waste-capi
//!
//! The C ABI of the engine (`libwaste`, header `include/waste.h`): opaque
//! handles, status codes, a thread-local last-error message. Every entry
//! point catches panics, so a Rust panic never unwinds into C; nothing
//! prints and nothing exits.
#![allow(non_camel_case_types)]
#![deny(missing_docs)]

use ::waste_model as engine;
use engine::tokenizer::Message;
use engine::{Control, Finish, GenerateParams, Model, ModelOptions, SamplingParams, Session, TokenConstraint};
use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, OnceLock};

/// Status codes (`waste_status`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum waste_status {
    /// Success.
    WASTE_OK = 0,
    /// File or device error.
    WASTE_E_IO = 1,
    /// Malformed or damaged input file.
    WASTE_E_FORMAT = 2,
    /// The budget is below the floor.
    WASTE_E_BUDGET = 3,
    /// An allocation failed.
    WASTE_E_OOM = 4,
    /// A bad argument.
    WASTE_E_ARG = 5,
    /// Not implemented.
    WASTE_E_UNSUPPORTED = 6,
    /// Cancelled.
    WASTE_E_CANCELLED = 7,
    /// An engine bug (a caught panic).
    WASTE_E_INTERNAL = 8,
    /// A session partly updated by a failed step: reset or load a state first.
    WASTE_E_INCOMPLETE = 9,
}
use waste_status::*;

/// Why generation ended (`waste_finish`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum waste_finish {
    /// An end token or a stop string.
    WASTE_FINISH_STOP = 0,
    /// `max_tokens` reached.
    WASTE_FINISH_LENGTH = 1,
    /// The context filled first.
    WASTE_FINISH_CONTEXT_FULL = 2,
    /// The callback cancelled.
    WASTE_FINISH_CANCELLED = 3,
}

/// Open options (`waste_options`).
#[repr(C)]
pub struct waste_options {
    /// RAM budget in bytes (0 = pick).
    pub budget_bytes: u64,
    /// Context bound in tokens.
    pub ctx_tokens: u32,
    /// Compute threads (0 = all cores).
    pub threads: u32,
    /// Reader threads (0 = default).
    pub io_threads: u32,
    /// Direct I/O for experts.
    pub direct_io: i32,
    /// CRC every expert read.
    pub verify_records: i32,
    /// Usage hotlist path or NULL.
    pub usage_path: *const c_char,
    /// 1 = load K3's vision tower (images in prompts; its bytes come out of the expert cache).
    pub images: i32,
    /// 1 = the fast numeric mode (8-bit activations for Q8G/Q4G products;
    /// issue 50's quality contract), 0 = exact, −1 = the engine's default
    /// (`waste_options_init`'s: `WASTE_NUMERIC` if set, else fast on AVX2
    /// and on AVX-512 with VNNI and VBMI, exact elsewhere). Sits in what was the
    /// struct's tail padding: its size is unchanged.
    pub fast: i32,
}

/// The memory plan (`waste_plan`).
#[repr(C)]
#[derive(Default)]
pub struct waste_plan {
    /// Resident trunk.
    pub trunk_bytes: u64,
    /// Attention state for the context.
    pub state_bytes: u64,
    /// Other buffers (a session's and those its model shares).
    pub scratch_bytes: u64,
    /// Smallest expert cache.
    pub min_expert_cache_bytes: u64,
    /// The floor.
    pub floor_bytes: u64,
    /// One token's experts.
    pub working_set_bytes: u64,
    /// floor + 3 × working set.
    pub recommended_bytes: u64,
    /// One expert record.
    pub record_bytes: u64,
    /// Context of the plan.
    pub ctx: u64,
}

/// Model facts (`waste_info`).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct waste_info {
    /// Layers.
    pub layers: u32,
    /// MoE layers.
    pub moe_layers: u32,
    /// Routed experts per layer.
    pub experts: u32,
    /// Experts per token.
    pub top_k: u32,
    /// Shared experts.
    pub shared_experts: u32,
    /// Hidden size.
    pub hidden: u32,
    /// Vocabulary (logits per token).
    pub vocab: u32,
    /// Parameters.
    pub params_total: u64,
    /// Parameters active per token.
    pub params_active: u64,
    /// Bytes of one expert record.
    pub expert_record_bytes: u64,
}

/// Session statistics (`waste_stats`).
#[repr(C)]
#[derive(Default)]
pub struct waste_stats {
    /// Tokens evaluated.
    pub tokens: u64,
    /// Expert uses served from the cache.
    pub experts_hit: u64,
    /// Expert uses read from disk.
    pub experts_missed: u64,
    /// Bytes read.
    pub bytes_read: u64,
    /// Speculative reads issued.
    pub prefetch_issued: u64,
    /// Seconds waiting for I/O.
    pub io_seconds: f64,
    /// Seconds in the trunk.
    pub trunk_seconds: f64,
    /// Seconds in attention.
    pub attn_seconds: f64,
    /// Seconds in expert compute.
    pub expert_seconds: f64,
}

/// A chat message (`waste_message`).
#[repr(C)]
pub struct waste_message {
    /// Role.
    pub role: *const c_char,
    /// Content (plain text).
    pub content: *const c_char,
}

/// Generation parameters (`waste_generate_params`).
#[repr(C)]
pub struct waste_generate_params {
    /// Temperature (0 = greedy).
    pub temperature: f32,
    /// Nucleus mass.
    pub top_p: f32,
    /// Min-p.
    pub min_p: f32,
    /// Top-k (0 = off).
    pub top_k: u32,
    /// Seed.
    pub seed: u64,
    /// Most tokens.
    pub max_tokens: u32,
    /// Stop strings.
    pub stop_strings: *const *const c_char,
    /// Their count.
    pub n_stop_strings: usize,
    /// Extra stop tokens.
    pub stop_tokens: *const u32,
    /// Their count.
    pub n_stop_tokens: usize,
    /// JSON schema text or NULL.
    pub json_schema: *const c_char,
    /// Alternatives per token event.
    pub top_logprobs: u32,
}

/// One token, as the callback sees it (`waste_token_event`).
#[repr(C)]
pub struct waste_token_event {
    /// Token id (`u32::MAX` for a final flush).
    pub token: u32,
    /// Text released with it.
    pub piece: *const c_char,
    /// Its length in bytes.
    pub piece_len: usize,
    /// Log-probability.
    pub logprob: f32,
    /// Alternative ids.
    pub top_ids: *const u32,
    /// Alternative logprobs.
    pub top_logprobs: *const f32,
    /// Alternatives.
    pub n_top: usize,
    /// Cache hits for this token.
    pub experts_hit: u64,
    /// Reads for this token.
    pub experts_missed: u64,
    /// Bytes read for this token.
    pub bytes_read: u64,
    /// Seconds for this token.
    pub seconds: f64,
    /// Seconds of I/O wait.
    pub io_seconds: f64,
}

/// The per-token callback; non-zero cancels.
pub type waste_token_callback = Option<unsafe extern "C" fn(*const waste_token_event, *mut c_void) -> c_int>;

/// The outcome of `waste_generate`.
#[repr(C)]
pub struct waste_generate_result {
    /// Why it ended.
    pub finish: waste_finish,
    /// The stop token, when a token stopped it.
    pub stop_token: u32,
    /// Tokens generated.
    pub n_tokens: usize,
    /// Prompt tokens evaluated.
    pub prompt_tokens: usize,
}

struct Inner {
    model: Model,
    info: waste_info,
    grammars: OnceLock<Result<waste_grammar::Grammars, String>>,
}

/// An open model (`waste_model`).
pub struct waste_model(Arc<Inner>);

/// A session (`waste_session`); holds its model.
pub struct waste_session {
    // declared first: dropped before the model it borrows
    session: Session<'static>,
    inner: Arc<Inner>,
}

thread_local! {
    static LAST: RefCell<CString> = RefCell::new(CString::default());
}

type Fail = (waste_status, String);

fn set_last(msg: &str) {
    LAST.with(|l| *l.borrow_mut() = CString::new(msg.replace('\0', " ")).unwrap_or_default());
}

fn fail(e: engine::Error) -> Fail {
    let s = match &e {
        engine::Error::Io(_) | engine::Error::Cache(engine::CacheError::ReadFailed { .. }) => WASTE_E_IO,
        // damaged files: the container's tokenizer or tower, not the caller's input
        engine::Error::Format(_)
        | engine::Error::NonFinite { .. }
        | engine::Error::Tokenizer(_)
        | engine::Error::Vision(engine::VisionError::Config(_) | engine::VisionError::Weights(_)) => WASTE_E_FORMAT,
        engine::Error::Budget { .. } | engine::Error::FloorAboveRam { .. } => WASTE_E_BUDGET,
        engine::Error::Oom(_) => WASTE_E_OOM,
        // a half-updated session the caller must reset (it said WASTE_E_ARG:
        // nothing wrong with the arguments)
        engine::Error::Incomplete(_) => WASTE_E_INCOMPLETE,
        // the caller's input (more tokens or text than the context holds, a
        // grammar, an image)
        engine::Error::Arg(_)
        | engine::Error::ContextFull { .. }
        | engine::Error::TextTooLong { .. }
        | engine::Error::Constraint(_)
        | engine::Error::Vision(engine::VisionError::Image(_)) => WASTE_E_ARG,
        engine::Error::Unsupported(_) => WASTE_E_UNSUPPORTED,
        engine::Error::Cancelled => WASTE_E_CANCELLED,
        _ => WASTE_E_INTERNAL,
    };
    (s, e.to_string())
}

fn arg<T>(msg: impl Into<String>) -> Result<T, Fail> {
    Err((WASTE_E_ARG, msg.into()))
}

/// Run `f`, record its error (or clear it), never unwind.
fn guard(f: impl FnOnce() -> Result<(), Fail>) -> waste_status {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => {
            set_last("");
            WASTE_OK
        }
        Ok(Err((s, m))) => {
            set_last(&m);
            s
        }
        Err(_) => {
            set_last("internal error: the engine panicked");
            WASTE_E_INTERNAL
        }
    }
}

unsafe fn text<'a>(p: *const c_char, what: &str) -> Result<&'a str, Fail> {
    if p.is_null() {
        return arg(format!("{what} is NULL"));
    }
    // SAFETY: the caller passes a NUL-terminated string
    unsafe { CStr::from_ptr(p) }.to_str().or_else(|_| arg(format!("{what} is not UTF-8")))
}

unsafe fn out<'a, T>(p: *mut T, what: &str) -> Result<&'a mut T, Fail> {
    // SAFETY: the caller passes a valid pointer or NULL
    unsafe { p.as_mut() }.ok_or_else(|| (WASTE_E_ARG, format!("{what} is NULL")))
}

unsafe fn slice<'a, T>(p: *const T, n: usize, what: &str) -> Result<&'a [T], Fail> {
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return arg(format!("{what} is NULL"));
    }
    // SAFETY: the caller passes n valid elements
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// Copy `src` to (`dst`, `cap`), `*n` = needed size; too small → WASTE_E_ARG.
unsafe fn fill<T: Copy>(src: &[T], dst: *mut T, cap: usize, n: *mut usize) -> Result<(), Fail> {
    // SAFETY: n is a valid pointer (checked)
    *unsafe { out(n, "the length pointer") }? = src.len();
    if src.len() > cap {
        return arg(format!("the buffer holds {cap}, {} needed", src.len()));
    }
    if !src.is_empty() {
        if dst.is_null() {
            return arg("the buffer is NULL");
        }
        // SAFETY: dst has room for cap ≥ len elements
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
    }
    Ok(())
}

fn model_ref<'a>(m: *const waste_model) -> Result<&'a Inner, Fail> {
    // SAFETY: m came from waste_open and was not closed
    unsafe { m.as_ref() }.map(|m| &*m.0).ok_or_else(|| (WASTE_E_ARG, "the model is NULL".into()))
}

fn session_mut<'a>(s: *mut waste_session) -> Result<&'a mut waste_session, Fail> {
    // SAFETY: s came from waste_session_new and was not freed
    unsafe { s.as_mut() }.ok_or_else(|| (WASTE_E_ARG, "the session is NULL".into()))
}

/// `"0.1.0 (avx2)"`.
#[no_mangle]
pub extern "C" fn waste_version() -> *const c_char {
    static V: OnceLock<CString> = OnceLock::new();
    V.get_or_init(|| {
        let b = engine::build_info();
        CString::new(format!("{} ({})", b.version, b.simd)).unwrap_or_default()
    })
    .as_ptr()
}

/// The last failure's message on this thread ("" after a success).
#[no_mangle]
pub extern "C" fn waste_last_error() -> *const c_char {
    LAST.with(|l| l.borrow().as_ptr())
}

/// Physical RAM in bytes.
#[no_mangle]
pub extern "C" fn waste_physical_ram() -> u64 {
    catch_unwind(engine::physical_ram).unwrap_or(0)
}

/// Usable RAM in bytes (cgroup-aware).
#[no_mangle]
pub extern "C" fn waste_usable_ram() -> u64 {
    catch_unwind(engine::usable_ram).unwrap_or(0)
}

/// Default options.
///
/// # Safety
/// `o` is NULL or points to a `waste_options`.
#[no_mangle]
pub unsafe extern "C" fn waste_options_init(o: *mut waste_options) {
    let d = ModelOptions::default();
    // SAFETY: per the contract
    if let Some(o) = unsafe { o.as_mut() } {
        *o = waste_options {
            budget_bytes: d.budget,
            ctx_tokens: d.ctx as u32,
            threads: d.threads as u32,
            io_threads: d.io_threads as u32,
            direct_io: d.direct_io as i32,
            verify_records: d.verify_records as i32,
            usage_path: std::ptr::null(),
            images: 0,
            fast: -1,
        };
    }
}

/// The memory plan of a container for `ctx_tokens`, without loading weights.
///
/// # Safety
/// `path` is a C string; `out` points to a `waste_plan`.
#[no_mangle]
pub unsafe extern "C" fn waste_plan_for(
    path: *const c_char,
    ctx_tokens: u32,
    out_plan: *mut waste_plan,
) -> waste_status {
    guard(|| {
        // SAFETY: per the contract
        let (path, o) = unsafe { (text(path, "path")?, out(out_plan, "out")?) };
        let p = engine::plan(path, ctx_tokens as usize).map_err(fail)?;
        *o = waste_plan {
            trunk_bytes: p.trunk_bytes,
            state_bytes: p.state_bytes,
            scratch_bytes: p.scratch_bytes + p.shared_scratch_bytes,
            min_expert_cache_bytes: p.min_expert_cache_bytes,
            floor_bytes: p.floor_bytes,
            working_set_bytes: p.working_set_bytes,
            recommended_bytes: p.recommended_bytes,
            record_bytes: p.record_bytes,
            ctx: p.ctx,
        };
        Ok(())
    })
}

/// Open a container.
///
/// # Safety
/// `path` is a C string; `options` is NULL (defaults) or a `waste_options`;
/// `out` points to a `waste_model *`.
#[no_mangle]
pub unsafe extern "C" fn waste_open(
    path: *const c_char,
    options: *const waste_options,
    out_model: *mut *mut waste_model,
) -> waste_status {
    guard(|| {
        // SAFETY: per the contract
        let (path, slot) = unsafe { (text(path, "path")?, out(out_model, "out")?) };
        *slot = std::ptr::null_mut();
        let mut o = ModelOptions::default();
        // SAFETY: per the contract
        if let Some(x) = unsafe { options.as_ref() } {
            o.budget = x.budget_bytes;
            o.ctx = x.ctx_tokens as usize;
            o.threads = x.threads as usize;
            o.io_threads = x.io_threads as usize;
            o.direct_io = x.direct_io != 0;
            o.verify_records = x.verify_records != 0;
            o.vision = x.images != 0;
            o.numeric = match x.fast {
                0 => Some(engine::Numeric::Exact),
                f if f > 0 => Some(engine::Numeric::Fast),
                _ => None,
            };
            if !x.usage_path.is_null() {
                // SAFETY: per the contract
                o.usage = Some(unsafe { text(x.usage_path, "usage_path")? }.into());
            }
        }
        let model = Model::open(path, o).map_err(fail)?;
        let ct = &model.container;
        let c = &ct.config;
        let p = ct.param_counts();
        let info = waste_info {
            layers: c.layers as u32,
            moe_layers: c.n_moe_layers() as u32,
            experts: c.experts as u32,
            top_k: c.top_k as u32,
            shared_experts: c.shared_experts as u32,
            hidden: c.hidden as u32,
            vocab: c.vocab as u32,
            params_total: p.total,
            params_active: p.active,
            expert_record_bytes: ct.experts.as_ref().map_or(0, |(_, l)| l.rec_bytes as u64),
        };
        *slot = Box::into_raw(Box::new(waste_model(Arc::new(Inner { model, info, grammars: OnceLock::new() }))));
        Ok(())
    })
}

/// Close a model (sessions keep it alive until they are freed).
///
/// # Safety
/// `m` is NULL or came from `waste_open` and is not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn waste_close(m: *mut waste_model) {
    if !m.is_null() {
        // SAFETY: per the contract
        let _ = catch_unwind(AssertUnwindSafe(|| drop(unsafe { Box::from_raw(m) })));
    }
}

/// Model facts.
///
/// # Safety
/// `m` is an open model; `out` points to a `waste_info`.
#[no_mangle]
pub unsafe extern "C" fn waste_model_info(m: *const waste_model, out_info: *mut waste_info) -> waste_status {
    guard(|| {
        let inner = model_ref(m)?;
        // SAFETY: per the contract
        *unsafe { out(out_info, "out")? } = inner.info;
        Ok(())
    })
}

/// Bytes the model has allocated (trunk + cache arena); agrees with the plan.
///
/// # Safety
/// `m` is an open model.
#[no_mangle]
pub unsafe extern "C" fn waste_memory_used(m: *const waste_model) -> u64 {
    model_ref(m)
        .map(|i| {
            let (a, b) = i.model.allocated_bytes();
            a + b
        })
        .unwrap_or(0)
}

/// Write the usage hotlist.
///
/// # Safety
/// `m` is an open model; `path` a C string.
#[no_mangle]
pub unsafe extern "C" fn waste_save_usage(m: *const waste_model, path: *const c_char, tokens: u64) -> waste_status {
    guard(|| {
        let inner = model_ref(m)?;
        // SAFETY: per the contract
        let path = unsafe { text(path, "path")? };
        inner.model.save_usage(path, tokens).map_err(fail)
    })
}

fn tokenizer(inner: &Inner) -> Result<&engine::tokenizer::Tokenizer, Fail> {
    inner.model.tokenizer().ok_or_else(|| (WASTE_E_UNSUPPORTED, "this container has no tokenizer".into()))
}

/// Tokenize: plain (special-token text stays text) or `markup` (specials recognised).
///
/// # Safety
/// `m` is an open model; `text_` a C string; `ids` has room for `cap`; `n` is valid.
#[no_mangle]
pub unsafe extern "C" fn waste_tokenize(
    m: *const waste_model,
    text_: *const c_char,
    markup: i32,
    ids: *mut u32,
    cap: usize,
    n: *mut usize,
) -> waste_status {
    guard(|| {
        let tok = tokenizer(model_ref(m)?)?;
        // SAFETY: per the contract
        let t = unsafe { text(text_, "text")? };
        let v = if markup != 0 { tok.encode_markup(t) } else { tok.encode_plain(t) };
        // SAFETY: per the contract
        unsafe { fill(&v, ids, cap, n) }
    })
}

/// Detokenize to UTF-8 (invalid sequences replaced), NUL-terminated; `*len`
/// excludes the NUL, `cap` must hold it too.
///
/// # Safety
/// `m` is an open model; `ids` has `n_ids` ids; `buf` has room for `cap`.
#[no_mangle]
pub unsafe extern "C" fn waste_detokenize(
    m: *const waste_model,
    ids: *const u32,
    n_ids: usize,
    buf: *mut c_char,
    cap: usize,
    len: *mut usize,
) -> waste_status {
    guard(|| {
        let tok = tokenizer(model_ref(m)?)?;
        // SAFETY: per the contract
        let ids = unsafe { slice(ids, n_ids, "ids")? };
        let mut s = tok.decode(ids).into_bytes();
        s.push(0);
        // SAFETY: per the contract
        unsafe { fill(&s, buf as *mut u8, cap, len)? };
        // SAFETY: len is valid (fill checked it)
        unsafe { *len -= 1 };
        Ok(())
    })
}

/// Encode a conversation with the model's chat template (BOS first when the
/// model has one); `open` ends with the assistant's generation prompt.
/// Thinking is off (K3's format; [`waste_chat_encode_think`] sets it).
///
/// # Safety
/// `m` is an open model; `messages` has `n_messages` entries of C strings.
#[no_mangle]
pub unsafe extern "C" fn waste_chat_encode(
    m: *const waste_model,
    messages: *const waste_message,
    n_messages: usize,
    open: i32,
    ids: *mut u32,
    cap: usize,
    n: *mut usize,
) -> waste_status {
    // SAFETY: the same contract
    unsafe { waste_chat_encode_think(m, messages, n_messages, open, 0, ids, cap, n) }
}

/// [`waste_chat_encode`] with thinking: `think` 0 = off, 1 = low, 2 =
/// medium, 3 = high, 4 = max (the server's `reasoning_effort` levels). On
/// in a model whose chat format has no thinking mode (only K3's tagged
/// format has one), or another value, is `WASTE_E_ARG`.
///
/// # Safety
/// `m` is an open model; `messages` has `n_messages` entries of C strings.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn waste_chat_encode_think(
    m: *const waste_model,
    messages: *const waste_message,
    n_messages: usize,
    open: i32,
    think: i32,
    ids: *mut u32,
    cap: usize,
    n: *mut usize,
) -> waste_status {
    use engine::tokenizer::xtml::{ChatMessage, Effort, XtmlOptions};
    guard(|| {
        let inner = model_ref(m)?;
        let effort = match think {
            0 => None,
            1 => Some(Effort::Low),
            2 => Some(Effort::Medium),
            3 => Some(Effort::High),
            4 => Some(Effort::Max),
            t => return arg(format!("think is 0 (off), 1 (low), 2 (medium), 3 (high) or 4 (max), not {t}")),
        };
        // SAFETY: per the contract
        let msgs = unsafe { slice(messages, n_messages, "messages")? };
        let mut v = Vec::with_capacity(msgs.len());
        for (i, x) in msgs.iter().enumerate() {
            // SAFETY: per the contract
            let (r, c) = unsafe {
                (text(x.role, &format!("messages[{i}].role"))?, text(x.content, &format!("messages[{i}].content"))?)
            };
            v.push(Message::new(r, c));
        }
        let out_ids = match effort {
            None => inner.model.encode_chat(&v, open != 0).map_err(fail)?,
            Some(_) if !inner.model.is_xtml() => {
                return arg("this model's chat format has no thinking mode (K3's tagged format has): think must be 0")
            }
            Some(e) => {
                let cm: Vec<ChatMessage> = v.iter().map(|m| ChatMessage::new(&m.role, &m.content)).collect();
                let opts = XtmlOptions { thinking: Some(e), ..Default::default() };
                inner.model.encode_xtml(&cm, &opts, open != 0).map_err(fail)?.ids
            }
        };
        // SAFETY: per the contract
        unsafe { fill(&out_ids, ids, cap, n) }
    })
}

/// Render chat templates (`chat_template.jinja`, code from the container)
/// in a child process limited in memory and CPU time from now on, for every
/// model of this process: `helper` is the `waste` binary or
/// `waste-render-template` (the waste-sandbox crate). It is tried once
/// here. Once per process: installing the same helper again is
/// `WASTE_OK`, another one `WASTE_E_ARG`.
///
/// # Safety
/// `helper` is a C string.
#[no_mangle]
pub unsafe extern "C" fn waste_use_template_sandbox(helper: *const c_char) -> waste_status {
    guard(|| {
        // SAFETY: per the contract
        let path = std::path::PathBuf::from(unsafe { text(helper, "helper")? });
        if let Some(h) = waste_sandbox::installed() {
            return if h == path {
                Ok(())
            } else {
                arg(format!("a template helper is already in use: {}", h.display()))
            };
        }
        // a helper that cannot render now would fail every chat later
        match waste_sandbox::render_with(&path, "{{ 'ok' }}", &[], false) {
            Ok(s) if s == "ok" => {}
            Ok(_) => return arg(format!("{}: not a template helper (its output was wrong)", path.display())),
            Err(e) => return arg(format!("{}: not a working template helper: {e}", path.display())),
        }
        if !waste_sandbox::install(path) {
            return arg("a template renderer is already installed in this process");
        }
        Ok(())
    })
}

/// A new session on a model.
///
/// # Safety
/// `m` is an open model; `out` points to a `waste_session *`.
#[no_mangle]
pub unsafe extern "C" fn waste_session_new(m: *mut waste_model, out_session: *mut *mut waste_session) -> waste_status {
    guard(|| {
        // SAFETY: per the contract
        let slot = unsafe { out(out_session, "out")? };
        *slot = std::ptr::null_mut();
        // SAFETY: per the contract
        let inner = unsafe { m.as_ref() }.ok_or_else(|| (WASTE_E_ARG, "the model is NULL".to_string()))?.0.clone();
        // SAFETY: the session borrows the model inside `inner`, an Arc the
        // session handle owns and drops after the session (field order)
        let model: &'static Model = unsafe { &*(&inner.model as *const Model) };
        *slot = Box::into_raw(Box::new(waste_session { session: model.session(), inner }));
        Ok(())
    })
}

/// Free a session.
///
/// # Safety
/// `s` is NULL or came from `waste_session_new` and is not used afterwards.
#[no_mangle]
pub unsafe extern "C" fn waste_session_free(s: *mut waste_session) {
    if !s.is_null() {
        // SAFETY: per the contract
        let _ = catch_unwind(AssertUnwindSafe(|| drop(unsafe { Box::from_raw(s) })));
    }
}

/// Back to an empty context.
///
/// # Safety
/// `s` is a live session.
#[no_mangle]
pub unsafe extern "C" fn waste_session_reset(s: *mut waste_session) -> waste_status {
    guard(|| {
        session_mut(s)?.session.reset();
        Ok(())
    })
}

/// Tokens in the context.
///
/// # Safety
/// `s` is a live session or NULL.
#[no_mangle]
pub unsafe extern "C" fn waste_session_position(s: *const waste_session) -> usize {
    // SAFETY: per the contract
    unsafe { s.as_ref() }.map_or(0, |s| s.session.position())
}

/// Aggregate statistics.
///
/// # Safety
/// `s` is a live session; `out` points to a `waste_stats`.
#[no_mangle]
pub unsafe extern "C" fn waste_session_stats(s: *const waste_session, out_stats: *mut waste_stats) -> waste_status {
    guard(|| {
        // SAFETY: per the contract
        let s = unsafe { s.as_ref() }.ok_or_else(|| (WASTE_E_ARG, "the session is NULL".to_string()))?;
        let st = s.session.stats();
        // SAFETY: per the contract
        *unsafe { out(out_stats, "out")? } = waste_stats {
            tokens: st.tokens,
            experts_hit: st.experts_hit,
            experts_missed: st.experts_missed,
            bytes_read: st.bytes_read,
            prefetch_issued: st.prefetch_issued,
            io_seconds: st.io_seconds,
            trunk_seconds: st.trunk_seconds,
            attn_seconds: st.attn_seconds,
            expert_seconds: st.expert_seconds,
        };
        Ok(())
    })
}

/// Evaluate tokens; `*logits` points at the last position's logits
/// (`*n_logits` of them), valid until the session's next call.
///
/// # Safety
/// `s` is a live session; `ids` has `n_ids` ids; the out pointers are valid.
#[no_mangle]
pub unsafe extern "C" fn waste_eval(
    s: *mut waste_session,
    ids: *const u32,
    n_ids: usize,
    logits: *mut *const f32,
    n_logits: *mut usize,
) -> waste_status {
    guard(|| {
        let s = session_mut(s)?;
        // SAFETY: per the contract
        let ids = unsafe { slice(ids, n_ids, "ids")? };
        let l = s.session.eval(ids).map_err(fail)?;
        // SAFETY: per the contract
        unsafe {
            *out(logits, "logits")? = l.as_ptr();
            *out(n_logits, "n_logits")? = l.len();
        }
        Ok(())
    })
}

/// The logits of the session's last evaluated position (`*n_logits` of
/// them), valid until the session's next call.
///
/// # Safety
/// `s` is a live session; the out pointers are valid.
#[no_mangle]
pub unsafe extern "C" fn waste_session_logits(
    s: *const waste_session,
    logits: *mut *const f32,
    n_logits: *mut usize,
) -> waste_status {
    guard(|| {
        // SAFETY: per the contract
        let s = unsafe { s.as_ref() }.ok_or_else(|| (WASTE_E_ARG, "the session is NULL".to_string()))?;
        let l = s.session.logits();
        // SAFETY: per the contract
        unsafe {
            *out(logits, "logits")? = l.as_ptr();
            *out(n_logits, "n_logits")? = l.len();
        }
        Ok(())
    })
}

/// Advance `n` sessions of one model by one token each, together
/// (`Model::step_many`): each layer's weights and each routed expert are
/// read once for all; each session's logits (`waste_session_logits`) are
/// bit-identical to evaluating its token alone. At most `waste_max_batch`
/// sessions, each listed once.
///
/// # Safety
/// `sessions` has `n` live sessions; `ids` has `n` ids.
#[no_mangle]
pub unsafe extern "C" fn waste_step_many(
    sessions: *const *mut waste_session,
    n: usize,
    ids: *const u32,
) -> waste_status {
    guard(|| {
        // SAFETY: per the contract
        let ptrs = unsafe { slice(sessions, n, "sessions")? };
        // SAFETY: per the contract
        let ids = unsafe { slice(ids, n, "ids")? };
        if ptrs.is_empty() {
            return Err((WASTE_E_ARG, "no sessions".into()));
        }
        for (i, p) in ptrs.iter().enumerate() {
            if p.is_null() {
                return Err((WASTE_E_ARG, format!("session {i} is NULL")));
            }
            if ptrs[..i].contains(p) {
                return Err((WASTE_E_ARG, format!("session {i} is listed twice")));
            }
        }
        let model: &Model = {
            // SAFETY: live, checked non-NULL above
            let first = unsafe { &*ptrs[0] };
            // SAFETY: the model outlives the call (every session holds its Arc)
            unsafe { &*(&first.inner.model as *const Model) }
        };
        // SAFETY: live, distinct (checked above), not used elsewhere during the call
        let mut refs: Vec<&mut Session<'static>> = ptrs.iter().map(|&p| unsafe { &mut (*p).session }).collect();
        model.step_many(&mut refs, ids).map_err(fail)
    })
}

/// The most sessions one `waste_step_many` takes on this model (each
/// token's experts are pinned in the cache at once); 0 for NULL.
///
/// # Safety
/// `m` is an open model or NULL.
#[no_mangle]
pub unsafe extern "C" fn waste_max_batch(m: *const waste_model) -> usize {
    // SAFETY: per the contract
    unsafe { m.as_ref() }.map_or(0, |m| m.0.model.max_batch())
}

/// An image's header: its file's size and the sequence positions it will
/// take (needs a model opened with `images = 1`). Nothing is decoded.
///
/// # Safety
/// `m` is an open model; `data` has `len` bytes; the out pointers are valid or NULL.
#[no_mangle]
pub unsafe extern "C" fn waste_image_info(
    m: *const waste_model,
    data: *const u8,
    len: usize,
    width: *mut u32,
    height: *mut u32,
    positions: *mut usize,
) -> waste_status {
    guard(|| {
        let inner = model_ref(m)?;
        // SAFETY: per the contract
        let b = unsafe { slice(data, len, "data")? };
        let i = inner.model.image_info(b).map_err(fail)?;
        let n = inner.model.image_positions(b).map_err(fail)?;
        // SAFETY: per the contract (NULL outputs are skipped)
        unsafe {
            if let Some(w) = width.as_mut() {
                *w = i.width;
            }
            if let Some(h) = height.as_mut() {
                *h = i.height;
            }
            if let Some(p) = positions.as_mut() {
                *p = n;
            }
        }
        Ok(())
    })
}

/// Decode and encode an image (PNG, JPEG, WebP, GIF) and queue it on the
/// session for the next `<|media_pad|>` placeholder `waste_eval` or
/// `waste_generate` meets (announce it in the prompt with the markup
/// `<|media_begin|>image WxH<|media_content|><|media_pad|><|media_end|>`,
/// tokenized with `markup = 1`). `*positions` gets the positions it takes.
///
/// # Safety
/// `s` is a live session; `data` has `len` bytes; `positions` is valid or NULL.
#[no_mangle]
pub unsafe extern "C" fn waste_image_add(
    s: *mut waste_session,
    data: *const u8,
    len: usize,
    positions: *mut usize,
) -> waste_status {
    guard(|| {
        let s = session_mut(s)?;
        // SAFETY: per the contract
        let b = unsafe { slice(data, len, "data")? };
        let img = s.session.model().encode_image(b).map_err(fail)?;
        let n = img.positions();
        s.session.add_image(img).map_err(fail)?;
        // SAFETY: per the contract
        if let Some(p) = unsafe { positions.as_mut() } {
            *p = n;
        }
        Ok(())
    })
}

/// Default generation parameters (greedy, 128 tokens).
///
/// # Safety
/// `p` is NULL or points to a `waste_generate_params`.
#[no_mangle]
pub unsafe extern "C" fn waste_generate_params_init(p: *mut waste_generate_params) {
    // SAFETY: per the contract
    if let Some(p) = unsafe { p.as_mut() } {
        *p = waste_generate_params {
            temperature: 0.0,
            top_p: 1.0,
            min_p: 0.0,
            top_k: 0,
            seed: 0,
            max_tokens: 128,
            stop_strings: std::ptr::null(),
            n_stop_strings: 0,
            stop_tokens: std::ptr::null(),
            n_stop_tokens: 0,
            json_schema: std::ptr::null(),
            top_logprobs: 0,
        };
    }
}

fn constraint(inner: &Inner, schema: &str) -> Result<waste_grammar::Constraint, Fail> {
    let schema: serde_json::Value = serde_json::from_str(schema).or_else(|e| arg(format!("json_schema: {e}")))?;
    let g = inner.grammars.get_or_init(|| {
        let m = &inner.model;
        waste_grammar::Grammars::for_parts(m.tokenizer(), m.config().vocab, m.constraint_end(false))
            .map_err(|e| e.to_string())
    });
    let g = g.as_ref().map_err(|e| (WASTE_E_UNSUPPORTED, e.clone()))?;
    g.constraint(&waste_grammar::json_lark(Some(&schema), false, false)).or_else(|e| arg(format!("json_schema: {e}")))
}

/// Generate after `prompt` (may be empty to continue); the callback sees
/// every token and may cancel.
///
/// # Safety
/// `s` is a live session; `prompt` has `n_prompt` ids; `params` is NULL
/// (defaults) or valid with valid arrays; `out` points to a result.
#[no_mangle]
pub unsafe extern "C" fn waste_generate(
    s: *mut waste_session,
    prompt: *const u32,
    n_prompt: usize,
    params: *const waste_generate_params,
    callback: waste_token_callback,
    user: *mut c_void,
    out_result: *mut waste_generate_result,
) -> waste_status {
    guard(|| {
        let s = session_mut(s)?;
        // SAFETY: per the contract
        let (prompt, res) = unsafe { (slice(prompt, n_prompt, "prompt")?, out(out_result, "out")?) };
        let mut d = std::mem::MaybeUninit::<waste_generate_params>::uninit();
        // SAFETY: init writes every field
        unsafe { waste_generate_params_init(d.as_mut_ptr()) };
        // SAFETY: params is NULL or valid; d was initialised
        let p = unsafe { params.as_ref() }.unwrap_or_else(|| unsafe { d.assume_init_ref() });
        let mut stop_strings = Vec::new();
        // SAFETY: per the contract
        for (i, &ptr) in unsafe { slice(p.stop_strings, p.n_stop_strings, "stop_strings")? }.iter().enumerate() {
            // SAFETY: per the contract
            stop_strings.push(unsafe { text(ptr, &format!("stop_strings[{i}]"))? }.to_string());
        }
        let gp = GenerateParams {
            sampling: SamplingParams {
                temperature: p.temperature,
                top_p: p.top_p,
                top_k: p.top_k as usize,
                min_p: p.min_p,
                seed: p.seed,
            },
            max_tokens: p.max_tokens as usize,
            // SAFETY: per the contract
            stop_tokens: unsafe { slice(p.stop_tokens, p.n_stop_tokens, "stop_tokens")? }.to_vec(),
            stop_strings,
            top_logprobs: (p.top_logprobs as usize).min(20),
            mark_specials: false,
        };
        let mut c = match p.json_schema.is_null() {
            true => None,
            // SAFETY: per the contract
            false => Some(constraint(&s.inner, unsafe { text(p.json_schema, "json_schema")? })?),
        };
        let g = s.session.generate_constrained(prompt, &gp, c.as_mut().map(|c| c as &mut dyn TokenConstraint), |ev| {
            let Some(cb) = callback else { return Control::Continue };
            let (ids, lps): (Vec<u32>, Vec<f32>) = ev.top.iter().copied().unzip();
            let e = waste_token_event {
                token: ev.token,
                piece: ev.piece.as_ptr() as *const c_char,
                piece_len: ev.piece.len(),
                logprob: ev.logprob,
                top_ids: ids.as_ptr(),
                top_logprobs: lps.as_ptr(),
                n_top: ids.len(),
                experts_hit: ev.experts_hit,
                experts_missed: ev.experts_missed,
                bytes_read: ev.bytes_read,
                seconds: ev.seconds,
                io_seconds: ev.io_seconds,
            };
            // SAFETY: a C callback given by the host, called with a valid event
            if unsafe { cb(&e, user) } != 0 {
                Control::Cancel
            } else {
                Control::Continue
            }
        });
        let g = g.map_err(fail)?;
        *res = waste_generate_result {
            finish: match g.finish {
                Finish::StopToken(_) | Finish::StopString(_) => waste_finish::WASTE_FINISH_STOP,
                Finish::Length => waste_finish::WASTE_FINISH_LENGTH,
                Finish::ContextFull => waste_finish::WASTE_FINISH_CONTEXT_FULL,
                _ => waste_finish::WASTE_FINISH_CANCELLED,
            },
            stop_token: match g.finish {
                Finish::StopToken(t) => t,
                _ => u32::MAX,
            },
            n_tokens: g.tokens.len(),
            prompt_tokens: g.prompt_tokens,
        };
        Ok(())
    })
}

/// Save the session state to a file.
///
/// # Safety
/// `s` is a live session; `path` a C string.
#[no_mangle]
pub unsafe extern "C" fn waste_state_save(s: *const waste_session, path: *const c_char) -> waste_status {
    guard(|| {
        // SAFETY: per the contract
        let s = unsafe { s.as_ref() }.ok_or_else(|| (WASTE_E_ARG, "the session is NULL".to_string()))?;
        // SAFETY: per the contract
        s.session.save_state(unsafe { text(path, "path")? }).map_err(fail)
    })
}

/// Load a state file (validated against this model before use).
///
/// # Safety
/// `s` is a live session; `path` a C string.
#[no_mangle]
pub unsafe extern "C" fn waste_state_load(s: *mut waste_session, path: *const c_char) -> waste_status {
    guard(|| {
        let s = session_mut(s)?;
        // SAFETY: per the contract
        s.session.load_state(unsafe { text(path, "path")? }).map_err(fail)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn last() -> String {
        // SAFETY: waste_last_error returns a valid C string
        unsafe { CStr::from_ptr(waste_last_error()) }.to_string_lossy().into_owned()
    }

    #[test]
    fn null_arguments_are_errors_with_a_message() {
        let mut m: *mut waste_model = std::ptr::null_mut();
        // SAFETY: exercising the NULL checks
        unsafe {
            assert_eq!(waste_open(std::ptr::null(), std::ptr::null(), &mut m), WASTE_E_ARG);
            assert!(last().contains("path is NULL"));
            assert!(m.is_null());
            assert_eq!(waste_model_info(std::ptr::null(), std::ptr::null_mut()), WASTE_E_ARG);
            assert_eq!(
                waste_eval(std::ptr::null_mut(), std::ptr::null(), 0, std::ptr::null_mut(), std::ptr::null_mut()),
                WASTE_E_ARG
            );
            assert_eq!(waste_session_position(std::ptr::null()), 0);
            waste_close(std::ptr::null_mut());
            waste_session_free(std::ptr::null_mut());
        }
    }

    #[test]
    fn a_missing_container_is_an_io_or_format_error_naming_it() {
        let mut m: *mut waste_model = std::ptr::null_mut();
        let p = CString::new("/nonexistent/x.waste").unwrap();
        // SAFETY: valid arguments
        let s = unsafe { waste_open(p.as_ptr(), std::ptr::null(), &mut m) };
        assert!(s == WASTE_E_IO || s == WASTE_E_FORMAT, "{s:?}");
        assert!(last().contains("/nonexistent/x.waste"), "{}", last());
        // a success clears it
        let mut o = std::mem::MaybeUninit::<waste_options>::uninit();
        // SAFETY: init writes every field
        unsafe { waste_options_init(o.as_mut_ptr()) };
        assert_eq!(guard(|| Ok(())), WASTE_OK);
        assert_eq!(last(), "");
    }

    #[test]
    fn engine_errors_map_to_the_header_statuses() {
        let cases = [
            (
                engine::Error::NonFinite { pos: 3, at: engine::NonFiniteAt::Logit { token: 7 }, value: f32::NAN },
                WASTE_E_FORMAT,
            ),
            // a half-updated session: the caller has to reset it (waste.h)
            (engine::Error::Incomplete("checksum mismatch".into()), WASTE_E_INCOMPLETE),
            (engine::Error::Arg("x".into()), WASTE_E_ARG),
            (engine::Error::Oom("x".into()), WASTE_E_OOM),
            (engine::Error::Unsupported("x".into()), WASTE_E_UNSUPPORTED),
            (engine::Error::Cancelled, WASTE_E_CANCELLED),
            // the caller's input, not an engine bug (these all said WASTE_E_INTERNAL)
            (engine::Error::ContextFull { pos: 1, n: 9, ctx: 4 }, WASTE_E_ARG),
            (engine::Error::TextTooLong { bytes: 9, ctx: 1, max_token_bytes: 2 }, WASTE_E_ARG),
            (engine::Error::Vision(engine::VisionError::Image("damaged".into())), WASTE_E_ARG),
            (engine::Error::Vision(engine::VisionError::Config("x".into())), WASTE_E_FORMAT),
            (engine::Error::Tokenizer(engine::tokenizer::Error::Vocabulary("x".into())), WASTE_E_FORMAT),
            (engine::Error::FloorAboveRam { floor: 9, ctx: 1, usable: 1, max_ctx: None }, WASTE_E_BUDGET),
            (
                engine::Error::Cache(engine::CacheError::ReadFailed {
                    layer: 1,
                    expert: 2,
                    cause: "checksum mismatch".into(),
                }),
                WASTE_E_IO,
            ),
        ];
        for (e, want) in cases {
            let msg = e.to_string();
            let (got, text) = fail(e);
            assert_eq!(got, want, "{msg}");
            assert_eq!(text, msg);
        }
    }

    #[test]
    fn small_buffers_report_the_size_needed() {
        let mut n = 0usize;
        let mut buf = [0u32; 2];
        // SAFETY: valid buffer and length pointer
        let r = unsafe { fill(&[1u32, 2, 3], buf.as_mut_ptr(), buf.len(), &mut n) };
        assert_eq!(r.unwrap_err().0, WASTE_E_ARG);
        assert_eq!(n, 3);
        let mut big = [0u32; 4];
        // SAFETY: valid buffer and length pointer
        unsafe { fill(&[1u32, 2, 3], big.as_mut_ptr(), big.len(), &mut n) }.unwrap();
        assert_eq!(&big[..3], &[1, 2, 3]);
    }

    #[test]
    fn a_panic_becomes_an_internal_error() {
        assert_eq!(guard(|| panic!("boom")), WASTE_E_INTERNAL);
        assert!(last().contains("panicked"));
    }
}
