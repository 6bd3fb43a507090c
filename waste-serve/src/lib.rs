//! # waste-serve
//!
//! An OpenAI-compatible HTTP server for the WASTE engine (axum + tokio):
//! `GET /health`, `GET /v1/models`, `GET /v1/models/{id}`,
//! `POST /v1/chat/completions` (streamed over SSE or not), `POST
//! /v1/completions`. The engine runs on its own thread; requests queue in
//! arrival order and up to `ServeOptions::parallel` of them decode
//! together, a token each a step (each gets the tokens it would alone); a client that disconnects cancels its generation at the
//! next token; a conversation that extends the previous one reuses the
//! engine state (prefix reuse). Message content is encoded as plain text, so
//! it can never forge control tokens.
//!
//! With K3's tagged chat format: `tools` and `tool_choice` (calls parsed
//! from the output and streamed as `tool_calls` deltas; `required` / a named
//! function and the arguments of every call held to the tool's schema by
//! constrained decoding), thinking with `reasoning_content` apart from
//! `content`. `response_format` `json_object` / `json_schema` is enforced by
//! constrained decoding (waste-grammar) on every model. Images (K3 with a
//! vision tower) arrive as `image_url` parts: base64 `data:` URLs, and
//! `http(s)://` / `file://` only when the operator allows it. Refused with a
//! 400 rather than ignored: images on a model without a tower, `n > 1`.
#![deny(missing_docs)]

mod api;
mod chat;
mod engine;
mod memory;

pub use api::{router, AppState, LogFn, ServeOptions};
pub use memory::json_parse_bytes;

/// Validate the chat-specific fields of a `/v1/chat/completions` body
/// (`messages`, `tools`, `tool_choice`, `response_format`, thinking) as the
/// server does: `Err((message, param))` is what becomes a 400. For fuzzing
/// and for hosts that check requests before queueing them.
///
/// # Errors
/// `(message, param)` — what the server answers with a 400.
pub fn check_chat_request(body: &serde_json::Value) -> Result<(), (String, String)> {
    chat::messages(body)?;
    chat::options(body)?;
    Ok(())
}
pub use engine::{Counters, Event, Job};

use std::sync::Arc;
use waste_model::Model;

/// Errors starting the server.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Binding or serving failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// Serve `model` until the process ends. `on_ready` gets the bound address
/// (useful with port 0).
///
/// Connections are handled as a production server does: at most
/// `max_connections` open (more are closed at once; the open-file limit is
/// raised to its hard maximum where allowed), a connection that sends no
/// request within `idle_timeout` is closed, request headers must arrive
/// within `header_timeout` and bodies within `body_timeout`, and HTTP/1.1
/// keep-alive connections idle for `idle_timeout` between requests are
/// closed.
///
/// # Errors
/// [`Error::Io`] when the runtime cannot start or the address cannot be bound.
pub fn serve(
    model: Model,
    opts: ServeOptions,
    on_ready: impl FnOnce(std::net::SocketAddr) + Send,
) -> Result<(), Error> {
    raise_open_file_limit();
    let model = Arc::new(model);
    let (jobs, rx) = std::sync::mpsc::channel::<Job>();
    let m2 = model.clone();
    let counters = Arc::new(engine::Counters::default());
    let c2 = counters.clone();
    let parallel = opts.parallel;
    std::thread::Builder::new().name("waste-engine".into()).spawn(move || engine::run(&m2, rx, &c2, parallel))?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        // the address in the error: "Address already in use" alone does not say which
        let listener = tokio::net::TcpListener::bind((opts.host.as_str(), opts.port))
            .await
            .map_err(|e| std::io::Error::new(e.kind(), format!("listening on {}:{}: {e}", opts.host, opts.port)))?;
        let addr = listener.local_addr()?;
        let state = Arc::new(AppState::new(model, opts.clone(), jobs, counters).bound_to(addr));
        on_ready(addr);
        accept_loop(listener, router(state), &opts).await
    })?;
    Ok(())
}

/// Accept connections forever, each served on its own task within the
/// limits of `opts` (see [`serve`]).
async fn accept_loop(listener: tokio::net::TcpListener, app: axum::Router, opts: &ServeOptions) -> std::io::Result<()> {
    use hyper_util::rt::{TokioIo, TokioTimer};
    let slots = Arc::new(tokio::sync::Semaphore::new(opts.max_connections.max(1)));
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                // out of file descriptors or a transient network error: wait a
                // moment rather than spin; the listener itself stays up
                opts.log(&format!("accept: {e}"));
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            opts.log(&format!("{peer}: refused, {} connections open", opts.max_connections));
            drop(tcp);
            continue;
        };
        let app = app.clone();
        let (idle, header) = (opts.idle_timeout, opts.header_timeout);
        tokio::spawn(async move {
            let _permit = permit;
            // a connection must start a request within the idle timeout
            let mut first = [0u8; 1];
            match tokio::time::timeout(idle, tcp.peek(&mut first)).await {
                Ok(Ok(n)) if n > 0 => {}
                _ => return,
            }
            let activity = Arc::new(conn::Activity::default());
            let svc = conn::tracked(app, activity.clone());
            let mut http = hyper::server::conn::http1::Builder::new();
            http.timer(TokioTimer::new()).header_read_timeout(header).keep_alive(true);
            let served = http.serve_connection(TokioIo::new(tcp), svc);
            tokio::pin!(served);
            // keep-alive: close a connection idle (no request in flight) for `idle`
            loop {
                tokio::select! {
                    _ = &mut served => return,
                    _ = tokio::time::sleep(idle / 4) => {
                        if activity.idle_for() >= idle {
                            return;
                        }
                    }
                }
            }
        });
    }
}

/// Raise the soft open-file limit to the hard one (each connection is a
/// descriptor). Best effort: a failure leaves the limit as it was.
fn raise_open_file_limit() {
    #[cfg(unix)]
    {
        let mut l = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        // SAFETY: getrlimit/setrlimit write/read the struct we own.
        unsafe {
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) == 0 && l.rlim_cur < l.rlim_max {
                l.rlim_cur = l.rlim_max;
                libc::setrlimit(libc::RLIMIT_NOFILE, &l);
            }
        }
    }
}

/// A response body that holds a guard until it is done (dropped after its
/// last frame, or when the client leaves): the guard's `Drop` does what
/// must follow the whole response (connection activity, the request log).
pub(crate) struct Guarded<G> {
    pub(crate) inner: axum::body::Body,
    pub(crate) _guard: G,
}

impl<G: Unpin> hyper::body::Body for Guarded<G> {
    type Data = axum::body::Bytes;
    type Error = axum::Error;
    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        std::pin::Pin::new(&mut self.inner).poll_frame(cx)
    }
    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }
    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

mod conn {
    //! Per-connection activity: requests in flight and the time the last
    //! one ended, so an idle keep-alive connection can be closed.
    use axum::body::Body;
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    /// Requests in flight (until their response body is finished) and when
    /// the connection was last busy.
    pub struct Activity {
        start: Instant,
        in_flight: AtomicUsize,
        last_ms: AtomicU64,
    }

    impl Default for Activity {
        fn default() -> Self {
            Activity { start: Instant::now(), in_flight: AtomicUsize::new(0), last_ms: AtomicU64::new(0) }
        }
    }

    impl Activity {
        fn touch(&self) {
            self.last_ms.store(self.start.elapsed().as_millis() as u64, Ordering::Relaxed);
        }
        /// How long no request has been in flight (zero while one is).
        pub fn idle_for(&self) -> Duration {
            if self.in_flight.load(Ordering::Relaxed) > 0 {
                return Duration::ZERO;
            }
            let now = self.start.elapsed().as_millis() as u64;
            Duration::from_millis(now.saturating_sub(self.last_ms.load(Ordering::Relaxed)))
        }
    }

    /// Ends a request's activity when its response body is dropped.
    struct InFlight(Arc<Activity>);
    impl Drop for InFlight {
        fn drop(&mut self) {
            self.0.touch();
            self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// The app as a hyper service whose requests count as activity until
    /// their responses are fully sent.
    pub fn tracked(
        app: axum::Router,
        activity: Arc<Activity>,
    ) -> impl hyper::service::Service<
        hyper::Request<hyper::body::Incoming>,
        Response = axum::response::Response,
        Error = std::convert::Infallible,
        Future = impl Send,
    > + Clone {
        hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
            let app = app.clone();
            let activity = activity.clone();
            activity.in_flight.fetch_add(1, Ordering::Relaxed);
            let guard = InFlight(activity);
            async move {
                use tower::ServiceExt;
                let resp = app.oneshot(req.map(Body::new)).await?;
                Ok(resp.map(|b| Body::new(crate::Guarded { inner: b, _guard: guard })))
            }
        })
    }
}
