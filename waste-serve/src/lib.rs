//! # waste-serve
//!
//! An OpenAI-compatible HTTP server for the WASTE engine (axum + tokio):
//! `GET /health`, `GET /v1/models`, `GET /v1/models/{id}`,
//! `POST /v1/chat/completions` (streamed over SSE or not), `POST
//! /v1/completions`. The engine runs on its own thread; requests queue in
//! arrival order; a client that disconnects cancels its generation at the
//! next token; a conversation that extends the previous one reuses the
//! engine state (prefix reuse). Message content is encoded as plain text, so
//! it can never forge control tokens.
//!
//! With K3's tagged chat format: `tools` and `tool_choice` (calls parsed
//! from the output and streamed as `tool_calls` deltas; `required` / a named
//! function and the arguments of every call held to the tool's schema by
//! constrained decoding), thinking with `reasoning_content` apart from
//! `content`. `response_format` `json_object` / `json_schema` is enforced by
//! constrained decoding (waste-grammar) on every model. Refused with a 400
//! rather than ignored: images (no vision tower yet), `n > 1`.
#![deny(missing_docs)]

mod api;
mod chat;
mod engine;

pub use api::{router, AppState, ServeOptions};

/// Validate the chat-specific fields of a `/v1/chat/completions` body
/// (`messages`, `tools`, `tool_choice`, `response_format`, thinking) as the
/// server does: `Err((message, param))` is what becomes a 400. For fuzzing
/// and for hosts that check requests before queueing them.
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
pub fn serve(
    model: Model,
    opts: ServeOptions,
    on_ready: impl FnOnce(std::net::SocketAddr) + Send,
) -> Result<(), Error> {
    let model = Arc::new(model);
    let (jobs, rx) = std::sync::mpsc::channel::<Job>();
    let m2 = model.clone();
    let counters = Arc::new(engine::Counters::default());
    let c2 = counters.clone();
    std::thread::Builder::new().name("waste-engine".into()).spawn(move || engine::run(&m2, rx, &c2))?;
    let state = Arc::new(AppState::new(model, opts.clone(), jobs, counters));
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind((opts.host.as_str(), opts.port)).await?;
        on_ready(listener.local_addr()?);
        axum::serve(listener, router(state)).await
    })?;
    Ok(())
}
