//! `waste serve`.

use crate::cmd_eval::EngineArgs;
use anyhow::Result;
use clap::Args;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Args)]
pub struct ServeArgs {
    /// Container directory.
    model: PathBuf,
    /// Address to bind (loopback by default).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port (0 = any free port).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Require `Authorization: Bearer KEY` (or set WASTE_API_KEY).
    #[arg(long)]
    api_key: Option<String>,
    /// Model id to report (default: the container's directory name).
    #[arg(long)]
    model_id: Option<String>,
    /// Cap on tokens per request.
    #[arg(long, default_value_t = 4096)]
    max_tokens: usize,
    /// Largest request body, e.g. 4M (a larger Content-Length gets 413 at once).
    #[arg(long, default_value = "4M", value_parser = crate::cmd_eval::parse_bytes_usize)]
    body_limit: usize,
    /// Memory all requests being read and prepared may hold together (their
    /// bodies, their parsed JSON as bounded by a scan before parsing, the
    /// text copied out and rendered, images while decoded):
    /// a request waits for room (then 503), one that alone needs more gets 413.
    #[arg(long, default_value = "256M", value_parser = crate::cmd_eval::parse_bytes)]
    request_memory: u64,
    /// Seconds a client has to send a request's headers.
    #[arg(long, default_value_t = 10.0)]
    header_timeout: f64,
    /// Seconds a client has to send a request's body.
    #[arg(long, default_value_t = 30.0)]
    body_timeout: f64,
    /// Seconds a connection may stay open without a request.
    #[arg(long, default_value_t = 30.0)]
    idle_timeout: f64,
    /// Open connections at most (more are closed at once).
    #[arg(long, default_value_t = 256)]
    max_connections: usize,
    /// Requests waiting for the engine at most (more get 503 with Retry-After).
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// Another Host name a key-less server answers to (repeatable; loopback
    /// names and the bound address always work).
    #[arg(long = "allow-host")]
    allow_host: Vec<String>,
    /// A browser origin (scheme://host:port) a key-less server accepts
    /// cross-site requests from (repeatable).
    #[arg(long = "allow-origin")]
    allow_origin: Vec<String>,
    /// Fetch `http(s)://` image URLs and read `file://` paths (by default
    /// only inline base64 `data:` URLs are accepted: no SSRF).
    #[arg(long)]
    allow_image_urls: bool,
    /// Do not load the vision tower (saves its memory; image requests get a 400).
    #[arg(long)]
    no_images: bool,
    /// Requests decoded together, a token each a step (each its own session
    /// and state in the budget; more wait in the queue). Default: up to 4,
    /// as many as take at most an eighth of the budget and fit the expert
    /// cache's slots (stated at start).
    #[arg(long)]
    parallel: Option<usize>,
    #[command(flatten)]
    engine: EngineArgs,
}

fn seconds(v: f64, flag: &str) -> Result<std::time::Duration> {
    anyhow::ensure!(v.is_finite() && v > 0.0 && v <= 86_400.0, "{flag} {v}: expected seconds in (0, 86400]");
    Ok(std::time::Duration::from_secs_f64(v))
}

pub fn serve(mut a: ServeArgs) -> Result<ExitCode> {
    // an explicit empty key (`--api-key "$UNSET"`) would serve without one
    if a.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
        anyhow::bail!("--api-key is empty (an unset variable?): give a key, or leave the option out");
    }
    // limits that would make a server refuse or empty every answer
    for (flag, v, least) in [
        ("--max-tokens", a.max_tokens, 1),
        ("--max-queue", a.max_queue, 1),
        ("--max-connections", a.max_connections, 1),
        ("--body-limit", a.body_limit, 1024),
        ("--request-memory", usize::try_from(a.request_memory).unwrap_or(usize::MAX), a.body_limit),
    ] {
        anyhow::ensure!(v >= least, "{flag} {v}: at least {least} (the server could answer nothing)");
    }
    // the timeouts too, before a model that may take minutes to open
    let (header_timeout, body_timeout, idle_timeout) = (
        seconds(a.header_timeout, "--header-timeout")?,
        seconds(a.body_timeout, "--body-timeout")?,
        seconds(a.idle_timeout, "--idle-timeout")?,
    );
    // images: the tower is loaded when the container has one, unless --no-images
    a.engine.vision = !a.no_images && a.model.join("vision.json").is_file();
    // a tower that cannot load takes only the images down, not the text model
    a.engine.vision_optional = true;
    if let Some(n) = a.parallel {
        crate::cmd_plan::check_parallel(n)?;
    }
    let asked = a.parallel.unwrap_or_else(|| default_parallel(&a));
    // a server may get constrained requests: their tables are in its budget
    // each slot keeps a snapshot of its last prompt's state (prefix reuse)
    let model = a.engine.open_with(&a.model, true, asked, asked)?;
    eprintln!("waste serve: {}", crate::cmd_eval::budget_line(&model));
    eprintln!(
        "waste serve: simd {}, numeric mode {} (--exact / --fast choose)",
        model.simd().name(),
        model.numeric().name()
    );
    let parallel = asked.min(model.max_batch());
    if parallel < asked {
        eprintln!(
            "waste serve: --parallel {asked} reduced to {parallel}: the expert cache's {} slots pin {} experts a request at once (raise --budget)",
            model.cache_slots(),
            model.config().top_k
        );
    }
    eprintln!("waste serve: up to {parallel} requests decoded together (--parallel)");
    if parallel >= 2 {
        let halves = match model.halves() {
            Some(true) => "always",
            Some(false) => "never",
            None => "where the step times measure it faster",
        };
        eprintln!("waste serve: a step of several requests as two halves in turn: {halves} (--halves)");
    }
    let api_key = a.api_key.clone().or_else(|| std::env::var("WASTE_API_KEY").ok()).filter(|k| !k.is_empty());
    let loopback = a.host == "127.0.0.1" || a.host == "::1" || a.host == "localhost";
    if !loopback && api_key.is_none() {
        eprintln!("warning: serving on {} without an API key: anyone who can reach this port can use the model (set --api-key or WASTE_API_KEY)", a.host);
    }
    let model_id = a.model_id.clone().unwrap_or_else(|| {
        a.model.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "waste".into())
    });
    let opts = waste_serve::ServeOptions {
        host: a.host.clone(),
        port: a.port,
        api_key,
        model_id: model_id.clone(),
        max_tokens: a.max_tokens,
        body_limit: a.body_limit,
        request_memory: usize::try_from(a.request_memory).unwrap_or(usize::MAX),
        header_timeout,
        body_timeout,
        idle_timeout,
        max_connections: a.max_connections,
        max_queue: a.max_queue,
        allowed_hosts: a.allow_host.clone(),
        allowed_origins: a.allow_origin.clone(),
        log: Some(std::sync::Arc::new(|line: &str| eprintln!("waste serve: {line}"))),
        allow_image_urls: a.allow_image_urls,
        parallel,
    };
    waste_serve::serve(model, opts, |addr| {
        // one line on stdout so scripts can find the port
        println!("waste serve: {model_id} on http://{addr}");
        use std::io::Write;
        let _ = std::io::stdout().flush();
    })?;
    Ok(ExitCode::SUCCESS)
}

/// `--parallel`'s default: the most requests, up to 4, whose extra
/// sessions (state, scratch, a step's logits) and snapshots (one a slot)
/// take at most an eighth of the budget the plan resolves (1 when the plan cannot be made: the open then
/// reports why).
fn default_parallel(a: &ServeArgs) -> usize {
    let Ok(p) = waste_model::plan(&a.model, a.engine.ctx) else { return 1 };
    let Ok(b) = waste_model::resolve_budget(&p, a.engine.budget, waste_model::usable_ram()) else { return 1 };
    let extra = |n: usize| {
        let q = p.with_parallel(n).with_snapshots(n);
        q.parallel_bytes + q.snapshot_bytes
    };
    (1..=4usize).rev().find(|&n| extra(n) <= b.budget / 8).unwrap_or(1)
}
