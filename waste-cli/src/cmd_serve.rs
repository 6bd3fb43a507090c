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
    /// Largest request body in bytes.
    #[arg(long, default_value_t = 4 << 20)]
    body_limit: usize,
    #[command(flatten)]
    engine: EngineArgs,
}

pub fn serve(a: ServeArgs) -> Result<ExitCode> {
    let model = a.engine.open(&a.model)?;
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
    };
    waste_serve::serve(model, opts, |addr| {
        // one line on stdout so scripts can find the port
        println!("waste serve: {model_id} on http://{addr}");
        use std::io::Write;
        let _ = std::io::stdout().flush();
    })?;
    Ok(ExitCode::SUCCESS)
}
