//! Request validation, the OpenAI response shapes, SSE streaming.

use crate::chat::{self, Assembler};
use crate::engine::{Event, Job};
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use waste_model::tokenizer::xtml::{ResponseFormat, ToolChoice};
use waste_model::tokenizer::Message;
use waste_model::{GenerateParams, Model, SamplingParams};

/// A sink for the server's log lines (panics with their request id, refused
/// connections). The library never prints; the CLI passes `eprintln!`.
pub type LogFn = Arc<dyn Fn(&str) + Send + Sync>;

/// Server options. Every limit has a CLI flag (`waste serve --help`).
#[derive(Clone)]
pub struct ServeOptions {
    /// Bind address.
    pub host: String,
    /// Port (0 = any).
    pub port: u16,
    /// Bearer key (None = no auth; then only the `Host` names below and
    /// same-origin browser requests are served).
    pub api_key: Option<String>,
    /// Model id reported and accepted.
    pub model_id: String,
    /// Cap on tokens per request.
    pub max_tokens: usize,
    /// Largest request body in bytes (a larger `Content-Length` is refused
    /// with 413 before the body is read).
    pub body_limit: usize,
    /// Memory all requests being read and prepared may hold together: their
    /// bodies while read (the `Content-Length`, or `body_limit` without one)
    /// and their parsed JSON until their prompt is queued, as bounded by a
    /// scan of the body before it is parsed ([`crate::json_parse_bytes`]).
    /// A request waits for room up to `body_timeout` (then 503 +
    /// Retry-After); one that alone needs more is refused with 413.
    pub request_memory: usize,
    /// Time a client has to send a request's line and headers.
    pub header_timeout: Duration,
    /// Time a client has to send a request's body once its headers arrived.
    pub body_timeout: Duration,
    /// Time a connection may sit without a request (a new one, or between
    /// keep-alive requests) before it is closed.
    pub idle_timeout: Duration,
    /// Open connections at most; more are closed at once.
    pub max_connections: usize,
    /// Requests waiting for the engine at most; more get 503 + Retry-After.
    pub max_queue: usize,
    /// Extra `Host` names a key-less server answers to (loopback names and
    /// the bound address always work).
    pub allowed_hosts: Vec<String>,
    /// Browser origins a key-less server accepts cross-site requests from.
    pub allowed_origins: Vec<String>,
    /// Where log lines go (None: nowhere).
    pub log: Option<LogFn>,
    /// Fetch `http(s)://` image URLs and read `file://` paths (otherwise
    /// only inline base64 `data:` URLs are accepted: no SSRF).
    pub allow_image_urls: bool,
    /// Requests decoded together at most (engine slots, each with its own
    /// session and prefix-reuse snapshot; the model must be opened
    /// planning for as many: `ModelOptions::parallel` and
    /// `ModelOptions::snapshots`). More wait in the queue.
    pub parallel: usize,
}

impl std::fmt::Debug for ServeOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServeOptions")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("api_key", &self.api_key.as_ref().map(|_| "<set>"))
            .field("model_id", &self.model_id)
            .field("max_tokens", &self.max_tokens)
            .field("body_limit", &self.body_limit)
            .field("request_memory", &self.request_memory)
            .field("header_timeout", &self.header_timeout)
            .field("body_timeout", &self.body_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .field("max_connections", &self.max_connections)
            .field("max_queue", &self.max_queue)
            .field("parallel", &self.parallel)
            .field("allowed_hosts", &self.allowed_hosts)
            .field("allowed_origins", &self.allowed_origins)
            .finish()
    }
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            host: "127.0.0.1".into(),
            port: 8000,
            api_key: None,
            model_id: "waste".into(),
            max_tokens: 4096,
            body_limit: 4 << 20,
            request_memory: 256 << 20,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(30),
            max_connections: 256,
            max_queue: 64,
            allowed_hosts: vec![],
            allowed_origins: vec![],
            log: None,
            allow_image_urls: false,
            parallel: 1,
        }
    }
}

impl ServeOptions {
    pub(crate) fn log(&self, line: &str) {
        if let Some(l) = &self.log {
            l(line);
        }
    }
}

/// Shared state of the handlers.
pub struct AppState {
    model: Arc<Model>,
    opts: ServeOptions,
    jobs: Mutex<std::sync::mpsc::Sender<Job>>,
    started: Instant,
    next_id: AtomicU64,
    /// Tokens generated by the engine so far, and whether it is busy.
    pub counters: Arc<crate::engine::Counters>,
    grammars: std::sync::OnceLock<Result<waste_grammar::Grammars, String>>,
    /// The address the listener is bound to (for the `Host` check).
    bound: Option<std::net::SocketAddr>,
    /// `opts.request_memory` in KiB permits.
    request_memory: Arc<tokio::sync::Semaphore>,
}

impl AppState {
    /// State for a model and the engine's job queue.
    pub fn new(
        model: Arc<Model>,
        opts: ServeOptions,
        jobs: std::sync::mpsc::Sender<Job>,
        counters: Arc<crate::engine::Counters>,
    ) -> AppState {
        AppState {
            model,
            jobs: Mutex::new(jobs),
            started: Instant::now(),
            next_id: AtomicU64::new(1),
            counters,
            grammars: std::sync::OnceLock::new(),
            bound: None,
            request_memory: Arc::new(tokio::sync::Semaphore::new(
                kib(opts.request_memory as u64).min(tokio::sync::Semaphore::MAX_PERMITS as u64) as usize,
            )),
            opts,
        }
    }

    /// The same state, knowing the address the server is reachable at.
    pub fn bound_to(mut self, addr: std::net::SocketAddr) -> AppState {
        self.bound = Some(addr);
        self
    }

    /// Whether a `Host` header (name with or without a port) names this
    /// server: loopback names, the bound address, `allowed_hosts`.
    fn host_allowed(&self, host: &str) -> bool {
        let name = host_name(host);
        if name.is_empty() {
            return false;
        }
        let bound = self.bound.map(|a| a.ip().to_string());
        ["localhost", "127.0.0.1", "::1"].iter().any(|n| name.eq_ignore_ascii_case(n))
            || bound.as_deref().is_some_and(|b| b == name)
            || name.eq_ignore_ascii_case(&self.opts.host)
            || self.opts.allowed_hosts.iter().any(|h| host_name(h).eq_ignore_ascii_case(name))
    }

    /// Whether a browser `Origin` may call a key-less server: one of
    /// `allowed_origins` exactly, or a page served from a name this server
    /// answers to (same site).
    fn origin_allowed(&self, origin: &str) -> bool {
        if self.opts.allowed_origins.iter().any(|o| o.trim_end_matches('/') == origin.trim_end_matches('/')) {
            return true;
        }
        match origin.split_once("://") {
            Some(("http" | "https", rest)) => self.host_allowed(rest.split('/').next().unwrap_or("")),
            _ => false,
        }
    }
}

/// The host name of a `Host` value: `[::1]:8000` → `::1`, `a.b:80` → `a.b`.
fn host_name(h: &str) -> &str {
    let h = h.trim();
    if let Some(rest) = h.strip_prefix('[') {
        return rest.split(']').next().unwrap_or("");
    }
    match h.rsplit_once(':') {
        Some((n, p)) if !n.contains(':') && p.chars().all(|c| c.is_ascii_digit()) => n,
        _ => h,
    }
}

/// What a request's log line says beyond its method, path, status and
/// time: the completion handlers fill it when they finish (id, tokens,
/// finish reason).
#[derive(Clone, Default)]
pub(crate) struct LogNote(Arc<Mutex<Option<String>>>);

impl LogNote {
    fn set(&self, note: String) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(note);
    }
}

/// Logs the request's line when its response is done.
struct LogOnDrop {
    st: Arc<AppState>,
    line: String,
    note: LogNote,
    t0: std::time::Instant,
}

impl Drop for LogOnDrop {
    fn drop(&mut self) {
        let note = self.note.0.lock().unwrap_or_else(|e| e.into_inner()).take();
        let note = note.map_or(String::new(), |n| format!(", {n}"));
        self.st.opts.log(&format!("{}{note}, {} ms", self.line, self.t0.elapsed().as_millis()));
    }
}

/// One log line a request (`POST /v1/chat/completions 200, chatcmpl-7: 12
/// prompt + 8 completion tokens, stop, 153 ms`), written when its response
/// is fully sent — a stream's last chunk, or the client leaving. Successful
/// `/health` checks are not logged (a monitor polls it).
async fn log_requests(
    State(st): State<Arc<AppState>>,
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if st.opts.log.is_none() {
        return next.run(req).await;
    }
    let (method, path) = (req.method().clone(), req.uri().path().to_owned());
    let note = LogNote::default();
    req.extensions_mut().insert(note.clone());
    let t0 = std::time::Instant::now();
    let resp = next.run(req).await;
    let status = resp.status();
    if path == "/health" && status.is_success() {
        return resp;
    }
    let guard = LogOnDrop { st, line: format!("{method} {path} {}", status.as_u16()), note, t0 };
    resp.map(|b| Body::new(crate::Guarded { inner: b, _guard: guard }))
}

/// The router.
pub fn router(state: Arc<AppState>) -> Router {
    let guard = axum::middleware::from_fn_with_state(state.clone(), guard);
    let log = axum::middleware::from_fn_with_state(state.clone(), log_requests);
    Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model_one))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .fallback(|| async {
            err(StatusCode::NOT_FOUND, "unknown route", "invalid_request_error", None, Some("not_found"))
        })
        .layer(guard)
        .layer(log)
        .with_state(state)
}

/// Before every handler of a key-less server: the `Host` must name this
/// server (no DNS rebinding), a browser `Origin` must be same-site or
/// allowed (CORS preflight answered for those), and POST bodies must be
/// declared `application/json` (a form a web page can send without asking
/// is refused). With an API key, requests pass unchanged.
async fn guard(State(st): State<Arc<AppState>>, req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    if st.opts.api_key.is_some() {
        return next.run(req).await;
    }
    let h = req.headers();
    let header = |k: axum::http::HeaderName| h.get(k).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let host = header(axum::http::header::HOST).unwrap_or_default();
    if !st.host_allowed(&host) {
        return err(
            StatusCode::FORBIDDEN,
            &format!("Host {host:?} is not a name of this server (add it with --allow-host)"),
            "invalid_request_error",
            None,
            Some("host_not_allowed"),
        );
    }
    let origin = header(axum::http::header::ORIGIN);
    if let Some(o) = &origin {
        if !st.origin_allowed(o) {
            return err(
                StatusCode::FORBIDDEN,
                &format!("Origin {o:?} may not call this server (allow it with --allow-origin)"),
                "invalid_request_error",
                None,
                Some("origin_not_allowed"),
            );
        }
    }
    let cors = |mut r: Response| {
        if let Some(v) = origin.as_deref().and_then(|o| axum::http::HeaderValue::from_str(o).ok()) {
            let hs = r.headers_mut();
            hs.insert(axum::http::header::ACCESS_CONTROL_ALLOW_ORIGIN, v);
            hs.insert(axum::http::header::VARY, axum::http::HeaderValue::from_static("Origin"));
        }
        r
    };
    if req.method() == axum::http::Method::OPTIONS {
        let mut r = StatusCode::NO_CONTENT.into_response();
        let hs = r.headers_mut();
        hs.insert(
            axum::http::header::ACCESS_CONTROL_ALLOW_METHODS,
            axum::http::HeaderValue::from_static("GET, POST, OPTIONS"),
        );
        hs.insert(
            axum::http::header::ACCESS_CONTROL_ALLOW_HEADERS,
            axum::http::HeaderValue::from_static("authorization, content-type"),
        );
        return cors(r);
    }
    if req.method() == axum::http::Method::POST {
        let ct = header(axum::http::header::CONTENT_TYPE).unwrap_or_default();
        let mime = ct.split(';').next().unwrap_or("").trim();
        if !mime.eq_ignore_ascii_case("application/json") {
            return err(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                &format!("Content-Type {ct:?}: send application/json"),
                "invalid_request_error",
                None,
                Some("unsupported_media_type"),
            );
        }
    }
    cors(next.run(req).await)
}

fn err(status: StatusCode, msg: &str, kind: &str, param: Option<&str>, code: Option<&str>) -> Response {
    (status, Json(json!({"error": {"message": msg, "type": kind, "param": param, "code": code}}))).into_response()
}
fn bad(msg: impl AsRef<str>, param: &str) -> Response {
    err(StatusCode::BAD_REQUEST, msg.as_ref(), "invalid_request_error", Some(param), None)
}

/// Constant-time equality (length is not secret).
fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn authorize(st: &AppState, h: &HeaderMap) -> Result<(), Response> {
    let Some(key) = &st.opts.api_key else { return Ok(()) };
    let header = h.get("authorization");
    let given = header.and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer ")).unwrap_or("");
    if ct_eq(given.as_bytes(), key.as_bytes()) {
        return Ok(());
    }
    // say which: none sent (a client not configured) or a wrong one
    let msg = match header {
        None => "missing API key: this server needs `Authorization: Bearer KEY`",
        Some(_) if given.is_empty() => "missing API key: the Authorization header is not `Bearer KEY`",
        Some(_) => "invalid API key",
    };
    Err(err(StatusCode::UNAUTHORIZED, msg, "invalid_request_error", None, Some("invalid_api_key")))
}

/// Request memory held by a request until its prompt is queued (see
/// `ServeOptions::request_memory`).
type Reserved = tokio::sync::OwnedSemaphorePermit;

/// KiB, rounded up, at least 1 (the request memory's unit).
fn kib(bytes: u64) -> u64 {
    bytes.div_ceil(1024).max(1)
}

/// The request-memory permits for `bytes`, or the 413 when they and what
/// the request already holds (`own` permits, KiB) exceed the whole request
/// memory: waiting for other requests could never make that room.
fn permits_for(st: &AppState, bytes: u64, what: &str, own: u64) -> Result<u32, Response> {
    let pool = st.opts.request_memory as u64;
    let need = own.saturating_add(kib(bytes));
    if bytes > pool || need > kib(pool) {
        let beside = if own > 0 {
            format!(" beside the {} this request holds", own.saturating_mul(1024))
        } else {
            String::new()
        };
        return Err(err(
            StatusCode::PAYLOAD_TOO_LARGE,
            &format!(
                "{what} would take about {bytes} bytes{beside}, more than the server's request memory ({pool} bytes)"
            ),
            "invalid_request_error",
            None,
            Some("body_too_complex"),
        ));
    }
    Ok(kib(bytes).min(u32::MAX as u64) as u32)
}

/// 503 with `Retry-After: 2`: the server is busy, not the request wrong.
fn retry_later(msg: &str, code: &str) -> Response {
    let mut r = err(StatusCode::SERVICE_UNAVAILABLE, msg, "server_error", None, Some(code));
    r.headers_mut().insert(axum::http::header::RETRY_AFTER, axum::http::HeaderValue::from_static("2"));
    r
}

/// The request memory is held by other requests.
fn memory_full(st: &AppState) -> Response {
    retry_later(
        &format!("other requests hold the server's request memory ({} bytes); retry later", st.opts.request_memory),
        "request_memory_full",
    )
}

/// Reserve `bytes` of the request memory for `what`, waiting up to the body
/// timeout for other requests to release theirs (`own`: what this request
/// already holds, [`permits_for`]).
async fn reserve(st: &AppState, bytes: u64, what: &str, own: u64) -> Result<Reserved, Response> {
    let permits = permits_for(st, bytes, what, own)?;
    match tokio::time::timeout(st.opts.body_timeout, st.request_memory.clone().acquire_many_owned(permits)).await {
        Ok(Ok(p)) => Ok(p),
        _ => Err(memory_full(st)),
    }
}

/// [`reserve`] from request work on the blocking pool: at once or 503.
fn reserve_now(st: &AppState, bytes: u64, what: &str, own: u64) -> Result<Reserved, Response> {
    let permits = permits_for(st, bytes, what, own)?;
    st.request_memory.clone().try_acquire_many_owned(permits).map_err(|_| memory_full(st))
}

/// Request-memory permits (KiB) reservations hold.
fn held_kib<'a>(rs: impl IntoIterator<Item = &'a Reserved>) -> u64 {
    rs.into_iter().map(|r| r.num_permits() as u64).sum()
}

/// Read and parse a JSON object body. The body's bytes are reserved from
/// the request memory while it is read, then what parsing it takes (bounded
/// by a scan, [`crate::json_parse_bytes`]) before it is parsed; scan and
/// parse run on the blocking pool (a 4 MiB body can take 0.7 s to parse).
/// The returned reservation (the parse's and the body's size again, for the
/// text a handler copies out) is held until the request's prompt is queued;
/// with it, the body's length.
async fn read_json(st: &AppState, h: &HeaderMap, body: Body) -> Result<(Value, Reserved, u64), Response> {
    let too_large = || {
        err(
            StatusCode::PAYLOAD_TOO_LARGE,
            &format!("request body exceeds {} bytes", st.opts.body_limit),
            "invalid_request_error",
            None,
            Some("body_too_large"),
        )
    };
    // refused from the header, before a byte of the body is read
    let declared =
        h.get(axum::http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).map(|v| v.trim().parse::<u64>());
    let limit = st.opts.body_limit as u64;
    let raw = match declared {
        Some(Ok(n)) if n > limit => return Err(too_large()),
        Some(Err(_)) => return Err(bad("Content-Length is not a number", "body")),
        Some(Ok(n)) => n,
        None => limit,
    };
    let reading = reserve(st, raw, "the request body", 0).await?;
    let bytes: Bytes =
        match tokio::time::timeout(st.opts.body_timeout, axum::body::to_bytes(body, st.opts.body_limit)).await {
            Ok(Ok(b)) => b,
            Ok(Err(_)) => return Err(too_large()),
            Err(_) => {
                return Err(err(
                    StatusCode::REQUEST_TIMEOUT,
                    &format!("the request body did not arrive within {} s", st.opts.body_timeout.as_secs_f64()),
                    "invalid_request_error",
                    None,
                    Some("body_timeout"),
                ))
            }
        };
    let (cost, bytes) =
        blocking_with(&st.next_id, &st.opts, move || Ok((crate::json_parse_bytes(&bytes), bytes))).await?;
    let mut parsed = reserve(st, cost, "parsing the request body", held_kib([&reading])).await?;
    let len = bytes.len() as u64;
    let v = blocking_with(&st.next_id, &st.opts, move || {
        serde_json::from_slice::<Value>(&bytes).map_err(|e| bad(format!("malformed JSON: {e}"), "body"))
    })
    .await?;
    // the body's bytes are freed; their reservation now stands for the text
    // a handler copies out of the value (messages, a prompt: together no
    // longer than the body)
    parsed.merge(reading);
    if !v.is_object() {
        return Err(bad("the request body must be a JSON object", "body"));
    }
    Ok((v, parsed, len))
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    Json(json!({"status": "ok", "model": st.opts.model_id, "engine": format!("waste {}", waste_model::VERSION), "uptime_seconds": st.started.elapsed().as_secs(),
        "simd": st.model.simd().name(), "numeric_mode": st.model.numeric().name(),
        "generated_tokens": st.counters.generated.load(Ordering::Relaxed), "busy": st.counters.busy.load(Ordering::Relaxed), "queued": st.counters.queued.load(Ordering::Relaxed)}))
    .into_response()
}

fn model_obj(st: &AppState) -> Value {
    json!({"id": st.opts.model_id, "object": "model", "created": 0, "owned_by": "waste"})
}

async fn models(State(st): State<Arc<AppState>>, h: HeaderMap) -> Response {
    if let Err(r) = authorize(&st, &h) {
        return r;
    }
    Json(json!({"object": "list", "data": [model_obj(&st)]})).into_response()
}

async fn model_one(State(st): State<Arc<AppState>>, h: HeaderMap, Path(id): Path<String>) -> Response {
    if let Err(r) = authorize(&st, &h) {
        return r;
    }
    if id != st.opts.model_id {
        return err(
            StatusCode::NOT_FOUND,
            &format!("model {id:?} does not exist"),
            "invalid_request_error",
            Some("model"),
            Some("model_not_found"),
        );
    }
    Json(model_obj(&st)).into_response()
}

/// Parameters common to both endpoints.
struct Common {
    params: GenerateParams,
    stream: bool,
    include_usage: bool,
    logprobs: bool,
}

fn num(v: &Value, k: &str) -> Result<Option<f64>, Response> {
    match v.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x.as_f64().map(Some).ok_or_else(|| bad(format!("{k} must be a number"), k)),
    }
}
fn uint(v: &Value, k: &str) -> Result<Option<u64>, Response> {
    match v.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x.as_u64().map(Some).ok_or_else(|| bad(format!("{k} must be a non-negative integer"), k)),
    }
}
fn boolean(v: &Value, k: &str) -> Result<bool, Response> {
    match v.get(k) {
        None | Some(Value::Null) => Ok(false),
        Some(x) => x.as_bool().ok_or_else(|| bad(format!("{k} must be a boolean"), k)),
    }
}

fn common(st: &AppState, v: &Value, prompt_len: usize, chat: bool) -> Result<Common, Response> {
    let temperature = num(v, "temperature")?.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(bad("temperature must be between 0 and 2", "temperature"));
    }
    let top_p = num(v, "top_p")?.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(bad("top_p must be in (0, 1]", "top_p"));
    }
    let top_k = uint(v, "top_k")?.unwrap_or(0);
    if top_k > 1 << 20 {
        return Err(bad("top_k must be at most 1048576", "top_k"));
    }
    let seed = match v.get("seed") {
        None | Some(Value::Null) => 0,
        Some(x) => x.as_i64().map(|s| s as u64).ok_or_else(|| bad("seed must be an integer", "seed"))?,
    };
    if let Some(n) = uint(v, "n")? {
        if n != 1 {
            return Err(bad("only n = 1 is supported", "n"));
        }
    }
    // sampling controls this engine does not implement: their neutral
    // values (what clients send by default) pass, any other is refused
    // rather than silently sampling differently from what was asked
    for k in ["frequency_penalty", "presence_penalty"] {
        match num(v, k)? {
            Some(x) if !(-2.0..=2.0).contains(&x) => return Err(bad(format!("{k} must be between -2 and 2"), k)),
            Some(x) if x != 0.0 => return Err(bad(format!("{k} is not supported (only 0)"), k)),
            _ => {}
        }
    }
    match v.get("logit_bias") {
        None | Some(Value::Null) => {}
        Some(Value::Object(m)) if m.is_empty() => {}
        Some(Value::Object(_)) => return Err(bad("logit_bias is not supported (only {})", "logit_bias")),
        Some(_) => return Err(bad("logit_bias must be an object", "logit_bias")),
    }
    let stop: Vec<String> = match v.get("stop") {
        None | Some(Value::Null) => vec![],
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| {
                x.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| bad("stop must be a string or an array of strings", "stop"))
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(bad("stop must be a string or an array of strings", "stop")),
    };
    if stop.len() > 16 || stop.iter().any(|s| s.is_empty()) {
        return Err(bad("stop allows up to 16 non-empty strings", "stop"));
    }
    let ctx = st.model.options().ctx;
    if prompt_len >= ctx {
        return Err(err(
            StatusCode::BAD_REQUEST,
            &format!("the prompt has {prompt_len} tokens; the context holds {ctx}"),
            "invalid_request_error",
            Some("messages"),
            Some("context_length_exceeded"),
        ));
    }
    let asked = match uint(v, "max_completion_tokens")? {
        Some(n) => Some(n),
        None => uint(v, "max_tokens")?,
    };
    if asked == Some(0) {
        return Err(bad("max_tokens must be at least 1", "max_tokens"));
    }
    let max_tokens =
        (asked.unwrap_or(st.opts.max_tokens as u64) as usize).min(st.opts.max_tokens).min(ctx - prompt_len);
    let (logprobs, top) = if chat {
        (boolean(v, "logprobs")?, uint(v, "top_logprobs")?.unwrap_or(0))
    } else {
        let lp = uint(v, "logprobs")?;
        (lp.is_some(), lp.unwrap_or(0))
    };
    if top > 20 {
        return Err(bad("top_logprobs must be at most 20", "top_logprobs"));
    }
    let stream = boolean(v, "stream")?;
    let include_usage =
        v.get("stream_options").and_then(|o| o.get("include_usage")).and_then(|b| b.as_bool()).unwrap_or(false);
    Ok(Common {
        params: GenerateParams {
            sampling: SamplingParams {
                temperature: temperature as f32,
                top_p: top_p as f32,
                top_k: top_k as usize,
                min_p: 0.0,
                seed,
            },
            max_tokens,
            stop_tokens: vec![],
            stop_strings: stop,
            top_logprobs: top as usize,
            mark_specials: false,
        },
        stream,
        include_usage,
        logprobs,
    })
}

fn token_text(model: &Model, id: u32) -> (String, Vec<u8>) {
    let b = model.tokenizer().map(|t| t.token_bytes(id).to_vec()).unwrap_or_default();
    (String::from_utf8_lossy(&b).into_owned(), b)
}

/// `/v1/completions`' logprobs in OpenAI's legacy shape — parallel lists
/// `tokens`, `token_logprobs`, `top_logprobs` (a map of token text to
/// logprob a position: the `logprobs` most likely, and the chosen token)
/// and `text_offset` (each token's start in the completion's text, in
/// characters) — which the completions clients read (`choice.logprobs.
/// token_logprobs`); the chat shape (`content`) left them empty. A token
/// whose bytes are not UTF-8 alone (a piece of a character) is written as
/// OpenAI writes it, `bytes:\xe2\x80`, so no two tokens share a key.
#[derive(Default)]
struct LegacyLogprobs {
    tokens: Vec<Value>,
    token_logprobs: Vec<Value>,
    top_logprobs: Vec<Value>,
    text_offset: Vec<Value>,
    /// The characters of the tokens so far (the offsets).
    chars: CharCount,
}

/// A token as the legacy shape names it: its text, or `bytes:` and its
/// bytes escaped where they are not UTF-8 alone.
fn legacy_token(b: &[u8]) -> String {
    match std::str::from_utf8(b) {
        Ok(t) => t.to_string(),
        Err(_) => b.iter().fold(String::from("bytes:"), |mut s, x| {
            s.push_str(&format!("\\x{x:02x}"));
            s
        }),
    }
}

/// Characters of a text arriving in pieces of bytes, counted as it comes
/// (a token's offset in constant time, not a scan of all before it): a
/// piece of a character at the end is not yet one — it becomes one with
/// the next bytes, or the replacement character it is shown as.
#[derive(Default)]
struct CharCount {
    /// Whole characters so far.
    done: usize,
    /// The unfinished character's bytes (at most 3).
    pending: Vec<u8>,
}

impl CharCount {
    fn add(&mut self, bytes: &[u8]) {
        let mut b = std::mem::take(&mut self.pending);
        b.extend_from_slice(bytes);
        let whole = b.len() - unfinished_tail(&b);
        self.done += String::from_utf8_lossy(&b[..whole]).chars().count();
        self.pending = b.split_off(whole);
    }
}

/// Bytes at the end of `b` that begin a character not yet finished (0 to
/// 3): the longest such suffix that is a valid start of one.
fn unfinished_tail(b: &[u8]) -> usize {
    (1..=b.len().min(3))
        .rev()
        .find(|&k| matches!(std::str::from_utf8(&b[b.len() - k..]), Err(e) if e.valid_up_to() == 0 && e.error_len().is_none()))
        .unwrap_or(0)
}

impl LegacyLogprobs {
    fn push(&mut self, model: &Model, token: u32, lp: f32, top: &[(u32, f32)]) {
        let bytes = token_text(model, token).1;
        let t = legacy_token(&bytes);
        let mut alts = serde_json::Map::new();
        for &(id, l) in top {
            alts.entry(legacy_token(&token_text(model, id).1)).or_insert(json!(l));
        }
        alts.entry(t.clone()).or_insert(json!(lp));
        self.text_offset.push(json!(self.chars.done));
        self.chars.add(&bytes);
        self.tokens.push(json!(t));
        self.token_logprobs.push(json!(lp));
        self.top_logprobs.push(Value::Object(alts));
    }

    /// The lists so far as the response's `logprobs`, and empty again
    /// (a stream sends each token's own; the offsets go on counting).
    fn take(&mut self) -> Value {
        json!({
            "tokens": std::mem::take(&mut self.tokens),
            "token_logprobs": std::mem::take(&mut self.token_logprobs),
            "top_logprobs": std::mem::take(&mut self.top_logprobs),
            "text_offset": std::mem::take(&mut self.text_offset),
        })
    }
}

fn logprob_entry(model: &Model, token: u32, lp: f32, top: &[(u32, f32)]) -> Value {
    let (t, b) = token_text(model, token);
    json!({"token": t, "logprob": lp, "bytes": b, "top_logprobs": top.iter().map(|&(id, l)| {
        let (t, b) = token_text(model, id);
        json!({"token": t, "logprob": l, "bytes": b})
    }).collect::<Vec<_>>()})
}

fn waste_stats(stats: &waste_model::Stats, direct_io: bool, reused: usize) -> Value {
    let total = stats.experts_hit + stats.experts_missed;
    json!({"experts_hit": stats.experts_hit, "experts_missed": stats.experts_missed,
        "hit_rate": if total > 0 { stats.experts_hit as f64 / total as f64 } else { 0.0 },
        "bytes_read": stats.bytes_read, "direct_io": direct_io, "reused_prompt_tokens": reused})
}

fn submit(
    st: &AppState,
    prompt: Vec<u32>,
    boundary: usize,
    params: GenerateParams,
    constraint: Option<waste_grammar::Constraint>,
    (images, held): (Vec<waste_model::PreparedImage>, Vec<Reserved>),
) -> Result<(tokio::sync::mpsc::UnboundedReceiver<Event>, Arc<AtomicBool>), Response> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let constraint = constraint.map(|c| Box::new(c) as Box<dyn waste_model::TokenConstraint + Send>);
    let job = Job { prompt, boundary, params, tx, cancel: cancel.clone(), constraint, images, held };
    // a bounded queue: past it, come back later (the engine runs one job at a time)
    let waiting = st.counters.queued.fetch_add(1, Ordering::Relaxed);
    if waiting >= st.opts.max_queue as u64 {
        st.counters.queued.fetch_sub(1, Ordering::Relaxed);
        return Err(retry_later(
            &format!(
                "{waiting} requests are waiting for the engine (the queue holds {}); retry later",
                st.opts.max_queue
            ),
            "queue_full",
        ));
    }
    st.jobs
        .lock()
        .map_err(|_| err(StatusCode::INTERNAL_SERVER_ERROR, "engine queue poisoned", "server_error", None, None))?
        .send(job)
        .map_err(|_| err(StatusCode::SERVICE_UNAVAILABLE, "the engine has stopped", "server_error", None, None))?;
    Ok((rx, cancel))
}

/// Cancels the job when dropped (the client went away mid-request).
struct CancelOnDrop(Arc<AtomicBool>);
impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Authorization, then the JSON body (and the request memory it holds).
async fn prologue(st: &AppState, h: &HeaderMap, body: Body) -> Result<(Value, Reserved, u64), Response> {
    authorize(st, h)?;
    read_json(st, h, body).await
}

/// How a chat request is turned into tokens and read back.
struct ChatPlan {
    /// Prompt tokens up to the end of the messages (see `Job::boundary`).
    boundary: usize,
    /// The images for the prompt's placeholders, in order.
    images: Vec<waste_model::PreparedImage>,
    /// Their request memory, held until the job is done with them.
    held: Vec<Reserved>,
    markup: chat::Markup,
    thinking: bool,
    keep_calls: bool,
    constraint: Option<waste_grammar::Constraint>,
}

/// The constrained-decoding tables, built by the first request that needs
/// them (about 1 s and 87 MiB for a 200K vocabulary, outside the memory plan:
/// a server whose clients never constrain never pays it).
fn grammars(st: &AppState) -> Result<&waste_grammar::Grammars, Response> {
    let g = st.grammars.get_or_init(|| {
        let m = &st.model;
        waste_grammar::Grammars::for_parts(m.tokenizer(), m.config().vocab, m.constraint_end(m.is_xtml()))
            .map_err(|e| e.to_string())
    });
    g.as_ref().map_err(|e| {
        err(
            StatusCode::BAD_REQUEST,
            &format!("constrained decoding is unavailable: {}", public_message(e)),
            "invalid_request_error",
            Some("response_format"),
            None,
        )
    })
}

/// A message fit for a response body: library and grammar-engine errors can
/// carry panic text and build-machine paths; those lines are dropped (the
/// server's log keeps nothing less: the detail is not lost, only not sent).
fn public_message(s: &str) -> String {
    let keep: Vec<&str> = s
        .lines()
        .filter(|l| {
            !(l.contains("panicked")
                || l.contains(".rs:")
                || l.contains("/.cargo/")
                || l.contains("/rustc/")
                || l.trim_start().starts_with("stack backtrace"))
        })
        .collect();
    let out = keep.join(" ").trim().to_string();
    if out.is_empty() {
        "the grammar engine could not handle this request".into()
    } else {
        out
    }
}

/// Run a request's CPU work (template rendering, tokenizing, grammar
/// compilation) on the blocking pool so the async workers stay free. A panic
/// there becomes a generic 500 naming a request id; its detail goes to the log.
async fn blocking<T: Send + 'static>(
    st: &Arc<AppState>,
    f: impl FnOnce() -> Result<T, Response> + Send + 'static,
) -> Result<T, Response> {
    blocking_with(&st.next_id, &st.opts, f).await
}

async fn blocking_with<T: Send + 'static>(
    ids: &AtomicU64,
    opts: &ServeOptions,
    f: impl FnOnce() -> Result<T, Response> + Send + 'static,
) -> Result<T, Response> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r,
        Err(e) => {
            let id = ids.fetch_add(1, Ordering::Relaxed);
            let detail = if e.is_panic() {
                let p = e.into_panic();
                p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            } else {
                None
            };
            opts.log(&format!("request {id}: internal error: {}", detail.as_deref().unwrap_or("cancelled")));
            Err(err(
                StatusCode::INTERNAL_SERVER_ERROR,
                &format!("internal error (request {id}; the server log has the detail)"),
                "server_error",
                None,
                Some("internal_error"),
            ))
        }
    }
}

/// Parse, render and tokenize a chat request, check its length against the
/// context, and only then compile its grammar (the costly part).
fn chat_prompt(st: &AppState, v: &Value, own: u64) -> Result<(Vec<u32>, ChatPlan, Common), Response> {
    let to400 = |(m, p): chat::Bad| bad(m, &p);
    let (mut msgs, refs) = chat::messages_with_images(v).map_err(to400)?;
    let (images, held) = prepare_images(st, &refs, own)?;
    for (r, img) in refs.iter().zip(&images) {
        msgs[r.message].images.push(img.size());
    }
    let opts = chat::options(v).map_err(to400)?;
    let markup = chat::Markup::of(&st.model);
    let xtml = markup == chat::Markup::Xtml;
    let (prompt, boundary) = match markup {
        chat::Markup::Xtml => {
            let e = st.model.encode_xtml(&msgs, &opts, true).map_err(|e| encode_err(e, "messages"))?;
            (e.ids, e.messages_end)
        }
        chat::Markup::K2 => {
            let e = st.model.encode_k2(&msgs, &opts.tools, true).map_err(|e| encode_err(e, "messages"))?;
            (e.ids, e.messages_end)
        }
        chat::Markup::Plain => {
            if !opts.tools.is_empty() || msgs.iter().any(|m| !m.tool_calls.is_empty() || m.role == "tool") {
                return Err(bad(
                    "this model's chat template has no tool-call format (tools need K3's tagged format or the K2 family's)",
                    "tools",
                ));
            }
            let plain: Vec<Message> =
                msgs.iter().map(|m| Message::new(&m.role, &m.content).with_images(&m.images)).collect();
            let p = st.model.encode_chat(&plain, true).map_err(|e| encode_err(e, "messages"))?;
            let b = st.model.encode_chat(&plain, false).map_err(|e| encode_err(e, "messages"))?;
            // a template could render the messages differently when a turn is open
            let b = if p.starts_with(&b) { b.len() } else { 0 };
            (p, b)
        }
    };
    let thinking = xtml && opts.thinking.is_some();
    // the cheap checks first: a request the context cannot hold never compiles a grammar;
    // each image's placeholder stands for its positions
    let positions = prompt.len() - images.len() + images.iter().map(|i| i.positions()).sum::<usize>();
    let common = common(st, v, positions, true)?;
    let parallel = match v.get("parallel_tool_calls") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(bad("parallel_tool_calls must be a boolean", "parallel_tool_calls")),
    };
    let grammar_err = |e: waste_grammar::Error, p: &str| bad(public_message(&e.to_string()), p);
    let only = match &opts.tool_choice {
        ToolChoice::Function(n) => Some(n.as_str()),
        _ => None,
    };
    let forced = matches!(opts.tool_choice, ToolChoice::Required | ToolChoice::Function(_));
    let auto = opts.tool_choice == ToolChoice::Auto && !opts.tools.is_empty();
    // the K2 template numbers a conversation's calls: the next is this one
    let first = msgs.iter().map(|m| m.tool_calls.len()).sum::<usize>();
    let constraint = match (&opts.response_format, markup) {
        (Some(rf), _) => {
            let schema = match rf {
                ResponseFormat::JsonSchema(s) => Some(s),
                ResponseFormat::JsonObject => None,
            };
            Some(
                grammars(st)?
                    .constraint(&waste_grammar::json_lark(schema, xtml, thinking))
                    .map_err(|e| grammar_err(e, "response_format"))?,
            )
        }
        (None, chat::Markup::Xtml) if forced => {
            let lark = waste_grammar::tool_calls_lark(&opts.tools, only, parallel && only.is_none(), thinking)
                .map_err(|e| grammar_err(e, "tools"))?;
            Some(grammars(st)?.constraint(&lark).map_err(|e| grammar_err(e, "tools"))?)
        }
        (None, chat::Markup::K2) if forced => {
            let lark = waste_grammar::k2_tool_calls_lark(&opts.tools, only, parallel && only.is_none(), first)
                .map_err(|e| grammar_err(e, "tools"))?;
            Some(grammars(st)?.constraint(&lark).map_err(|e| grammar_err(e, "tools"))?)
        }
        (None, chat::Markup::Xtml) if auto => {
            let lark = waste_grammar::tool_section_lark(&opts.tools, parallel).map_err(|e| grammar_err(e, "tools"))?;
            Some(
                grammars(st)?
                    .lazy(waste_grammar::tool_section_trigger(), &lark)
                    .map_err(|e| grammar_err(e, "tools"))?,
            )
        }
        (None, chat::Markup::K2) if auto => {
            let lark = waste_grammar::k2_tool_section_lark(&opts.tools, parallel, first)
                .map_err(|e| grammar_err(e, "tools"))?;
            Some(
                grammars(st)?
                    .lazy(waste_grammar::k2_tool_section_trigger(), &lark)
                    .map_err(|e| grammar_err(e, "tools"))?,
            )
        }
        _ => None,
    };
    let keep_calls = !opts.tools.is_empty() && opts.tool_choice != ToolChoice::None;
    Ok((prompt, ChatPlan { boundary, markup, thinking, keep_calls, constraint, images, held }, common))
}

/// Seconds a remote image may take to arrive (connect, redirects and body).
#[cfg(feature = "remote-images")]
const IMAGE_FETCH_SECONDS: u64 = 20;

/// Fetch an `http(s)://` image (blocking; called on the blocking pool):
/// bounded in time, redirects and size.
#[cfg(not(feature = "remote-images"))]
fn fetch_image(url: &str) -> Result<Vec<u8>, String> {
    Err(format!(
        "this build fetches no image URLs (built without the `remote-images` feature): {url:?}; send a data: URL"
    ))
}

/// Fetch an `http(s)://` image (blocking; called on the blocking pool):
/// bounded in time, redirects and size.
#[cfg(feature = "remote-images")]
fn fetch_image(url: &str) -> Result<Vec<u8>, String> {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(std::time::Duration::from_secs(IMAGE_FETCH_SECONDS)))
        .max_redirects(3)
        .http_status_as_error(true)
        .build()
        .into();
    let mut resp = agent.get(url).call().map_err(|e| format!("fetching the image {url:?}: {e}"))?;
    resp.body_mut()
        .with_config()
        .limit(waste_model::MAX_IMAGE_FILE_BYTES as u64)
        .read_to_vec()
        .map_err(|e| format!("reading the image {url:?}: {e}"))
}

/// Read and decode a request's images, in order, on the blocking pool:
/// `data:` URLs always; `http(s)://` URLs and `file://` paths only with
/// `--allow-image-urls`. Each is reserved from the request memory — its
/// file's bytes while it is decoded (a `data:` URL's too, decoded here one
/// at a time, not all at once when the request is read), then its patches,
/// held with the job; `own` is what the request already holds — and their
/// positions are counted as they come: a request whose images alone
/// outgrow the context stops at the first one too many (a 1 KB PNG can
/// decode to the largest patch grid, ≈ 9.6 MB of patches, so thousands of
/// them in one body were thousands of such buffers).
fn prepare_images(
    st: &AppState,
    refs: &[chat::ImageRef],
    own: u64,
) -> Result<(Vec<waste_model::PreparedImage>, Vec<Reserved>), Response> {
    if refs.is_empty() {
        return Ok((vec![], vec![]));
    }
    if st.model.vision().is_none() {
        let why = if let Some(e) = st.model.vision_error() {
            format!("images are off on this server: the model's vision tower could not load ({e})")
        } else if st.model.plan().vision_weight_bytes > 0 {
            "images are off on this server (started with --no-images)".into()
        } else {
            "this model has no vision tower".into()
        };
        return Err(bad(why, &refs[0].param));
    }
    let ctx = st.model.options().ctx;
    let (mut images, mut held, mut positions, mut own) = (Vec::new(), Vec::new(), 0usize, own);
    for r in refs {
        let file = waste_model::MAX_IMAGE_FILE_BYTES as u64;
        // the image file's bytes (decoded from base64, fetched or read) are
        // reserved until the image is decoded: one file at a time
        let (reading, bytes) = match &r.source {
            chat::ImageSource::Data(text) => {
                let res = reserve_now(st, chat::decoded_len(text) as u64, "decoding an image", own)?;
                (res, chat::decode_data(text, &r.param).map_err(|(m, p)| bad(m, &p))?)
            }
            chat::ImageSource::Remote(u) if !st.opts.allow_image_urls => {
                return Err(bad(
                    format!("remote image URLs are not fetched (no SSRF; start the server with --allow-image-urls to allow it): {u:?}; send the image inline as a base64 data: URL"),
                    &r.param,
                ))
            }
            chat::ImageSource::Remote(u) => {
                let res = reserve_now(st, file, "fetching an image", own)?;
                (res, fetch_image(u).map_err(|e| bad(e, &r.param))?)
            }
            chat::ImageSource::File(_) if !st.opts.allow_image_urls => {
                return Err(bad("file:// image URLs need a server started with --allow-image-urls", &r.param))
            }
            chat::ImageSource::File(p) => {
                let res = reserve_now(st, file, "reading an image", own)?;
                let read = waste_model::format::read_regular(std::path::Path::new(p), file);
                (res, read.map_err(|e| bad(format!("reading {p}: {e}"), &r.param))?)
            }
        };
        // the decoder's pixels, their RGB copy, the resampled image and the
        // patches, read from the header before any of them is allocated
        let need = st.model.image_prepare_bytes(&bytes).map_err(|e| bad(e.to_string(), &r.param))?;
        let working = reserve_now(st, need, "decoding an image's pixels", own + held_kib([&reading]))?;
        let img = st.model.prepare_image(&bytes).map_err(|e| bad(e.to_string(), &r.param))?;
        drop((bytes, reading, working));
        positions = positions.saturating_add(img.positions());
        if positions >= ctx {
            return Err(err(
                StatusCode::BAD_REQUEST,
                &format!("the first {} images take {positions} positions; the context holds {ctx}", images.len() + 1),
                "invalid_request_error",
                Some(&r.param),
                Some("context_length_exceeded"),
            ));
        }
        let patches = reserve_now(st, img.heap_bytes() as u64, "an image's patches", own)?;
        own += held_kib([&patches]);
        held.push(patches);
        images.push(img);
    }
    Ok((images, held))
}

async fn chat(
    State(st): State<Arc<AppState>>,
    h: HeaderMap,
    note: Option<axum::Extension<LogNote>>,
    body: Body,
) -> Response {
    let (v, reserved, len) = match prologue(&st, &h, body).await {
        Ok(v) => v,
        Err(r) => return r,
    };
    let st2 = st.clone();
    let prepared = blocking(&st, move || {
        // the parsed body's memory is released after it (`v` drops first), once the prompt is made
        let (parsed, v) = (reserved, v);
        // rendering copies the messages' text once more (the template's
        // segments, or the plain messages a template takes) beside the
        // markup a template writes
        let rendering = len.saturating_add(waste_model::tokenizer::TEMPLATE_OUTPUT_BYTES as u64);
        let rendering = reserve_now(&st2, rendering, "rendering the messages", held_kib([&parsed]))?;
        let (prompt, plan, mut c) = chat_prompt(&st2, &v, held_kib([&parsed, &rendering]))?;
        let end = match plan.markup {
            chat::Markup::Xtml => Some(chat::END_OF_MSG),
            chat::Markup::K2 => Some(waste_model::tokenizer::k2::IM_END),
            chat::Markup::Plain => None,
        };
        if let Some(end) = end {
            c.params.mark_specials = true;
            c.params.stop_tokens.extend(st2.model.tokenizer().and_then(|t| t.special_id(end)));
        }
        Ok((prompt, plan, c))
    })
    .await;
    match prepared {
        Ok((prompt, plan, c)) => run(st, prompt, c, Some(plan), note.map(|n| n.0).unwrap_or_default()).await,
        Err(r) => r,
    }
}

async fn completions(
    State(st): State<Arc<AppState>>,
    h: HeaderMap,
    note: Option<axum::Extension<LogNote>>,
    body: Body,
) -> Response {
    let (v, reserved, _) = match prologue(&st, &h, body).await {
        Ok(v) => v,
        Err(r) => return r,
    };
    let given = match completion_prompt(v.get("prompt"), st.model.config().vocab) {
        Ok(p) => p,
        Err(r) => return r,
    };
    // legacy options this endpoint does not implement: refused unless neutral
    match boolean(&v, "echo") {
        Ok(false) => {}
        Ok(true) => return bad("echo is not supported", "echo"),
        Err(r) => return r,
    }
    match uint(&v, "best_of") {
        Ok(None | Some(1)) => {}
        Ok(Some(_)) => return bad("only best_of = 1 is supported", "best_of"),
        Err(r) => return r,
    }
    match v.get("suffix") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s.is_empty() => {}
        Some(_) => return bad("suffix is not supported", "suffix"),
    }
    let st2 = st.clone();
    let prepared = blocking(&st, move || {
        let (_reserved, v) = (reserved, v);
        let prompt = match given {
            Prompt::Text(text) => st2.model.encode_raw(&text).map_err(|e| encode_err(e, "prompt"))?,
            Prompt::Ids(ids) => ids,
        };
        let c = common(&st2, &v, prompt.len(), false)?;
        Ok((prompt, c))
    })
    .await;
    match prepared {
        Ok((prompt, c)) => run(st, prompt, c, None, note.map(|n| n.0).unwrap_or_default()).await,
        Err(r) => r,
    }
}

async fn run(st: Arc<AppState>, prompt: Vec<u32>, c: Common, plan: Option<ChatPlan>, note: LogNote) -> Response {
    let chat = plan.is_some();
    let n = st.next_id.fetch_add(1, Ordering::Relaxed);
    let id = format!("{}-{n}", if chat { "chatcmpl" } else { "cmpl" });
    let created = now();
    let model_id = st.opts.model_id.clone();
    let (mut asm, constraint, boundary, images) = match plan {
        Some(p) => (
            Assembler::new(p.markup, p.thinking, p.keep_calls, &n.to_string()),
            p.constraint,
            p.boundary,
            (p.images, p.held),
        ),
        None => (Assembler::new(chat::Markup::Plain, false, false, &n.to_string()), None, 0, (vec![], vec![])),
    };
    let (mut rx, cancel) = match submit(&st, prompt, boundary, c.params.clone(), constraint, images) {
        Ok(x) => x,
        Err(r) => return r,
    };
    if !c.stream {
        let _guard = CancelOnDrop(cancel);
        let (mut lps, mut legacy) = (Vec::new(), LegacyLogprobs::default());
        while let Some(ev) = rx.recv().await {
            match ev {
                Event::Token { token, piece, logprob, top } => {
                    asm.push(&piece);
                    if c.logprobs && token != waste_model::NO_TOKEN {
                        if chat {
                            lps.push(logprob_entry(&st.model, token, logprob, &top));
                        } else {
                            legacy.push(&st.model, token, logprob, &top);
                        }
                    }
                }
                Event::Done { finish, prompt_tokens, completion_tokens, reused_tokens, stats, direct_io } => {
                    note.set(format!(
                        "{id}: {prompt_tokens} prompt + {completion_tokens} completion tokens ({reused_tokens} reused), {finish}"
                    ));
                    let usage = json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens});
                    let lp = match (c.logprobs, chat) {
                        (false, _) => Value::Null,
                        (true, true) => json!({"content": lps}),
                        (true, false) => legacy.take(),
                    };
                    let choice = if chat {
                        json!({"index": 0, "message": asm.message(), "logprobs": lp, "finish_reason": asm.finish_reason(finish)})
                    } else {
                        json!({"index": 0, "text": asm.content, "logprobs": lp, "finish_reason": finish})
                    };
                    return Json(json!({"id": id, "object": if chat { "chat.completion" } else { "text_completion" }, "created": created, "model": model_id,
                        "choices": [choice], "usage": usage, "waste": waste_stats(&stats, direct_io, reused_tokens)}))
                    .into_response();
                }
                Event::Error(e) => return err(StatusCode::INTERNAL_SERVER_ERROR, &e, "server_error", None, None),
            }
        }
        return err(StatusCode::INTERNAL_SERVER_ERROR, "the engine dropped the request", "server_error", None, None);
    }
    // streaming: one SSE event per token; dropping the stream cancels the job
    let st2 = st.clone();
    let guard = CancelOnDrop(cancel);
    let object = if chat { "chat.completion.chunk" } else { "text_completion" };
    let stream = async_stream(move |yield_| async move {
        let _g = guard;
        let chunk = |delta: Value, finish: Value, lp: Value| {
            let choice = if chat {
                json!({"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish})
            } else {
                json!({"index": 0, "text": delta.get("content").cloned().unwrap_or(json!("")), "logprobs": lp, "finish_reason": finish})
            };
            json!({"id": id, "object": object, "created": created, "model": model_id, "choices": [choice]})
        };
        if chat && !yield_(chunk(json!({"role": "assistant", "content": ""}), Value::Null, Value::Null)) {
            return;
        }
        let mut legacy = LegacyLogprobs::default();
        while let Some(ev) = rx.recv().await {
            match ev {
                Event::Token { token, piece, logprob, top } => {
                    let mut lp = if !c.logprobs || token == waste_model::NO_TOKEN {
                        Value::Null
                    } else if chat {
                        json!({"content": [logprob_entry(&st2.model, token, logprob, &top)]})
                    } else {
                        legacy.push(&st2.model, token, logprob, &top);
                        legacy.take()
                    };
                    let mut deltas = asm.push(&piece);
                    if deltas.is_empty() && !lp.is_null() {
                        deltas.push(json!({"content": ""}));
                    }
                    for d in deltas {
                        if !yield_(chunk(d, Value::Null, std::mem::take(&mut lp))) {
                            return;
                        }
                    }
                }
                Event::Done { finish, prompt_tokens, completion_tokens, reused_tokens, stats, direct_io } => {
                    note.set(format!(
                        "{id}: {prompt_tokens} prompt + {completion_tokens} completion tokens ({reused_tokens} reused), {finish}"
                    ));
                    let mut last = chunk(json!({}), json!(asm.finish_reason(finish)), Value::Null);
                    last["waste"] = waste_stats(&stats, direct_io, reused_tokens);
                    if !yield_(last) {
                        return;
                    }
                    if c.include_usage {
                        let u = json!({"id": id, "object": object, "created": created, "model": model_id, "choices": [],
                            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}});
                        yield_(u);
                    }
                    return;
                }
                Event::Error(e) => {
                    yield_(json!({"error": {"message": e, "type": "server_error", "param": null, "code": null}}));
                    return;
                }
            }
        }
    });
    Sse::new(stream).keep_alive(KeepAlive::default()).into_response()
}

/// One `/v1/completions` prompt.
enum Prompt {
    /// Text, encoded as plain text after the BOS.
    Text(String),
    /// Token ids, used as given (no BOS added).
    Ids(Vec<u32>),
}

/// The OpenAI forms of one prompt: a string, a one-string array, token ids,
/// or a one-array array of token ids; several prompts are refused (one per
/// request), as are ids outside the vocabulary.
fn completion_prompt(p: Option<&Value>, vocab: usize) -> Result<Prompt, Response> {
    let ids = |a: &[Value]| -> Result<Prompt, Response> {
        a.iter()
            .map(|x| x.as_u64().filter(|&t| t < vocab as u64).map(|t| t as u32))
            .collect::<Option<Vec<u32>>>()
            .map(Prompt::Ids)
            .ok_or_else(|| {
                bad(format!("prompt: token ids must be integers below the vocabulary size {vocab}"), "prompt")
            })
    };
    match p {
        Some(Value::String(s)) => Ok(Prompt::Text(s.clone())),
        Some(Value::Array(a)) => match &a[..] {
            [Value::String(s)] => Ok(Prompt::Text(s.clone())),
            [Value::Array(t)] if !t.is_empty() => ids(t),
            t if !t.is_empty() && t.iter().all(Value::is_number) => ids(t),
            t if t.len() > 1 && t.iter().all(|x| x.is_string() || x.is_array()) => {
                Err(bad("only one prompt per request is supported", "prompt"))
            }
            _ => Err(bad("prompt must be a string or an array of token ids", "prompt")),
        },
        Some(_) => Err(bad("prompt must be a string or an array of token ids", "prompt")),
        None => Err(bad("prompt is required", "prompt")),
    }
}

/// A failed encoding of the request's text as a 400: text longer than the
/// context can hold whatever its tokens carries OpenAI's
/// `context_length_exceeded` code, as a prompt of too many tokens does.
fn encode_err(e: waste_model::Error, param: &str) -> Response {
    match e {
        waste_model::Error::TextTooLong { .. } => err(
            StatusCode::BAD_REQUEST,
            &e.to_string(),
            "invalid_request_error",
            Some(param),
            Some("context_length_exceeded"),
        ),
        e => bad(e.to_string(), param),
    }
}

/// A stream of SSE events fed by an async producer; `yield_` returns false
/// once the client is gone. Ends with `data: [DONE]`.
fn async_stream<F, Fut>(producer: F) -> impl tokio_stream::Stream<Item = Result<SseEvent, std::convert::Infallible>>
where
    F: FnOnce(Box<dyn Fn(Value) -> bool + Send + Sync>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    // unbounded: a request holds at most max_tokens events; a failed send means the client left
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<SseEvent>();
    let tx2 = tx.clone();
    tokio::spawn(async move {
        let send: Box<dyn Fn(Value) -> bool + Send + Sync> =
            Box::new(move |v: Value| tx2.send(SseEvent::default().data(v.to_string())).is_ok());
        producer(send).await;
        let _ = tx.send(SseEvent::default().data("[DONE]"));
    });
    tokio_stream::StreamExt::map(tokio_stream::wrappers::UnboundedReceiverStream::new(rx), Ok)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The legacy offsets count a character once it is whole: a piece of
    /// one at the end waits for the next token's bytes; one that never
    /// completes counts as the replacement character it is shown as. The
    /// count as pieces arrive equals the whole text's at every split.
    #[test]
    fn char_count_counts_whole_characters_as_pieces_arrive() {
        // the whole bytes' characters, a trailing piece of one left out
        let whole = |b: &[u8]| String::from_utf8_lossy(&b[..b.len() - unfinished_tail(b)]).chars().count();
        for (b, n) in [
            (&b""[..], 0),
            (b"ab", 2),
            (&[0xc3], 0),
            (&[b'a', 0xc3], 1),
            (&[0xc3, 0xa9], 1),
            (&[0xc3, b'a'], 2),
            (&[0xe2, 0x80, 0x94, 0xe2], 1),
            // a broken character before an unfinished one: only the latter waits
            (&[0xe2, 0x80, b'z', 0xf0, 0x9f], 2),
            (&[0x80, 0x80], 2),
        ] {
            assert_eq!(whole(b), n, "{b:?}");
        }
        // every split of mixed text (whole, cut and broken characters)
        let text: Vec<u8> =
            [&b"a"[..], "é—😀".as_bytes(), &[0xe2, 0x80], b"z", &[0xff], "😀".as_bytes(), &[0xf0, 0x9f]].concat();
        for cut in 0..=text.len() {
            for cut2 in cut..=text.len() {
                let mut c = CharCount::default();
                for piece in [&text[..cut], &text[cut..cut2], &text[cut2..]] {
                    c.add(piece);
                }
                assert_eq!(c.done, whole(&text), "split at {cut}, {cut2}");
                let mut c = CharCount::default();
                c.add(&text[..cut]);
                assert_eq!(c.done, whole(&text[..cut]), "prefix {cut}");
            }
        }
    }

    #[test]
    fn panic_text_and_paths_never_reach_a_body() {
        let msg = "grammar error\nthread 'x' panicked at /root/.cargo/registry/src/llguidance-1.9.1/src/earley.rs:42:5:\nindex out of bounds";
        let p = public_message(msg);
        assert!(!p.contains("panicked") && !p.contains(".rs:") && !p.contains("/.cargo/"), "{p}");
        assert!(p.contains("grammar error") && p.contains("index out of bounds"), "{p}");
        assert_eq!(
            public_message("thread 'x' panicked at src/a.rs:1:1:"),
            "the grammar engine could not handle this request"
        );
        assert_eq!(public_message("schema: unsupported keyword"), "schema: unsupported keyword");
    }

    #[tokio::test]
    async fn a_panic_in_request_work_is_a_500_with_a_request_id_and_the_detail_in_the_log() {
        let logged = Arc::new(Mutex::new(Vec::<String>::new()));
        let l2 = logged.clone();
        let opts = ServeOptions {
            log: Some(Arc::new(move |s: &str| l2.lock().unwrap().push(s.to_string()))),
            ..Default::default()
        };
        let ids = AtomicU64::new(7);
        let r: Result<(), Response> = blocking_with(&ids, &opts, || panic!("secret detail at /build/src/x.rs:1")).await;
        let resp = r.unwrap_err();
        assert_eq!(resp.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let body = axum::body::to_bytes(resp.into_body(), 1 << 16).await.unwrap();
        let text = String::from_utf8_lossy(&body);
        assert!(text.contains("request 7") && !text.contains("secret") && !text.contains(".rs"), "{text}");
        let log = logged.lock().unwrap();
        assert!(log.iter().any(|l| l.contains("request 7") && l.contains("secret detail")), "{log:?}");
    }

    #[test]
    fn host_names_with_and_without_ports() {
        assert_eq!(host_name("[::1]:8000"), "::1");
        assert_eq!(host_name("localhost:80"), "localhost");
        assert_eq!(host_name("a.example"), "a.example");
        assert_eq!(host_name("::1"), "::1");
    }
}
