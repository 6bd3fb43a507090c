//! `waste eval` and `waste run` (token-id interface).

use crate::print_json;
use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::json;
use std::path::PathBuf;
use std::process::ExitCode;
use waste_model::{Model, ModelOptions};

/// Engine options shared by commands that open a model.
#[derive(Args, Clone, Debug)]
pub struct EngineArgs {
    /// RAM budget, e.g. 8G, 1.5G, 512M (0 = pick automatically).
    #[arg(long, default_value = "0", value_parser = parse_budget)]
    pub budget: u64,
    /// Context bound in tokens.
    #[arg(long, default_value_t = 4096)]
    pub ctx: usize,
    /// Compute threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Reader threads for expert I/O (0 = 4).
    #[arg(long, default_value_t = 0)]
    pub io_threads: usize,
    /// Expert cache policy: lfru or lru.
    #[arg(long, default_value = "lfru")]
    pub cache: String,
    /// Experts of the next layer to prefetch from a router lookahead (0 = off).
    #[arg(long, default_value_t = 0)]
    pub lookahead: usize,
    /// Read a layer's missing experts one at a time instead of all at once.
    #[arg(long)]
    pub no_readahead: bool,
    /// Read experts through the page cache.
    #[arg(long)]
    pub no_direct_io: bool,
    /// Do not ask for 2 MiB huge pages for the cache.
    #[arg(long)]
    pub no_huge_pages: bool,
    /// Check every expert record's CRC when read.
    #[arg(long)]
    pub verify: bool,
    /// Usage hotlist to preload (default: the container's usage.waste).
    #[arg(long)]
    pub usage: Option<PathBuf>,
    /// Most tokens a prefill chunk evaluates together (1 = token by token).
    #[arg(long, default_value_t = 16)]
    pub chunk: usize,
    /// Write which experts this run used to the usage hotlist when done.
    #[arg(long)]
    pub learn: bool,
}

pub fn parse_budget(s: &str) -> Result<u64, String> {
    waste_model::parse_size(s).ok_or_else(|| format!("{s:?} is not a size (examples: 8G, 1.5G, 512M, 0)"))
}

impl EngineArgs {
    pub fn open(&self, model: &PathBuf) -> Result<Model> {
        let policy = match self.cache.as_str() {
            "lfru" => waste_model::Policy::Lfru,
            "lru" => waste_model::Policy::Lru,
            o => bail!("--cache {o:?}: expected lfru or lru"),
        };
        let opts = ModelOptions {
            budget: self.budget,
            ctx: self.ctx,
            threads: self.threads,
            io_threads: self.io_threads,
            direct_io: !self.no_direct_io,
            verify_records: self.verify || ModelOptions::default().verify_records,
            simd: None,
            policy,
            readahead: !self.no_readahead,
            lookahead: self.lookahead,
            huge_pages: !self.no_huge_pages,
            max_chunk: self.chunk,
            usage: self.usage.clone(),
        };
        let m = Model::open(model, opts).with_context(|| format!("opening {}", model.display()))?;
        if let Some(w) = m.budget_warning() {
            eprintln!("warning: {w}");
        }
        Ok(m)
    }

    /// Save the usage hotlist if --learn.
    pub fn finish(&self, model: &Model, model_path: &std::path::Path, tokens: u64) -> Result<()> {
        if self.learn {
            let p = self.usage.clone().unwrap_or_else(|| model_path.join("usage.waste"));
            model.save_usage(&p, tokens).with_context(|| format!("writing {}", p.display()))?;
        }
        Ok(())
    }
}

pub fn parse_ids(s: &str) -> Result<Vec<u32>> {
    let ids: Result<Vec<u32>, _> = s.split(',').map(|t| t.trim()).filter(|t| !t.is_empty()).map(|t| t.parse::<u32>()).collect();
    let ids = ids.with_context(|| format!("--ids {s:?}: expected comma-separated token ids"))?;
    if ids.is_empty() {
        bail!("--ids is empty");
    }
    Ok(ids)
}

#[derive(Args)]
pub struct EvalArgs {
    /// Container directory.
    model: PathBuf,
    /// Prompt text (needs the container's tokenizer).
    prompt: Option<String>,
    /// Prompt as token ids, comma-separated.
    #[arg(long)]
    ids: Option<String>,
    /// How many top tokens to show.
    #[arg(long, default_value_t = 10)]
    top: usize,
    /// Include the full logit vector (with --json).
    #[arg(long)]
    logits: bool,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    engine: EngineArgs,
}

fn prompt_ids(ids: &Option<String>, prompt: &Option<String>) -> Result<Vec<u32>> {
    match (ids, prompt) {
        (Some(i), None) => parse_ids(i),
        (None, Some(_)) => bail!("text prompts need the tokenizer, which this build does not have yet: pass --ids"),
        (Some(_), Some(_)) => bail!("give either --ids or a prompt, not both"),
        (None, None) => bail!("no prompt: pass --ids 1,2,3"),
    }
}

pub fn eval(a: EvalArgs) -> Result<ExitCode> {
    let ids = prompt_ids(&a.ids, &a.prompt)?;
    let model = a.engine.open(&a.model)?;
    let mut s = model.session();
    let logits = s.eval(&ids)?.to_vec();
    let mut probs = logits.clone();
    waste_model::softmax_in_place(&mut probs);
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&x, &y| logits[y].total_cmp(&logits[x]).then(x.cmp(&y)));
    let top: Vec<_> = order.iter().take(a.top).map(|&i| json!({"id": i, "logit": logits[i], "prob": probs[i]})).collect();
    if a.json {
        let mut v = json!({"ids": ids, "argmax": order[0], "top": top});
        if a.logits {
            v["logits"] = json!(logits);
        }
        print_json(&v)?;
    } else {
        for &i in order.iter().take(a.top) {
            println!("{i:>8}  logit {:>10.5}  p {:.5}", logits[i], probs[i]);
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(Args)]
pub struct RunArgs {
    /// Container directory.
    model: PathBuf,
    /// Prompt text (needs the container's tokenizer).
    prompt: Option<String>,
    /// Prompt as token ids, comma-separated.
    #[arg(long)]
    ids: Option<String>,
    /// Tokens to generate.
    #[arg(short = 'n', long = "max-tokens", default_value_t = 32)]
    n: usize,
    /// Temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    temp: f32,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    engine: EngineArgs,
}

pub fn run(a: RunArgs) -> Result<ExitCode> {
    let ids = prompt_ids(&a.ids, &a.prompt)?;
    if a.temp != 0.0 {
        bail!("only --temp 0 (greedy) is available in this build");
    }
    let model = a.engine.open(&a.model)?;
    let mut s = model.session();
    let t0 = std::time::Instant::now();
    let mut out = Vec::with_capacity(a.n);
    let mut next = argmax(s.eval(&ids)?);
    let mut ctx_full = false;
    for i in 0..a.n {
        out.push(next);
        if i + 1 == a.n {
            break;
        }
        if s.position() >= model.options().ctx {
            ctx_full = true;
            break;
        }
        next = argmax(s.eval(&[next])?);
    }
    let secs = t0.elapsed().as_secs_f64();
    let st = s.stats();
    a.engine.finish(&model, &a.model, st.tokens)?;
    if a.json {
        print_json(&json!({"prompt_ids": ids, "tokens": out, "context_full": ctx_full, "seconds": secs,
            "experts_hit": st.experts_hit, "experts_missed": st.experts_missed, "bytes_read": st.bytes_read,
            "direct_io": model.direct_io(), "threads": model.threads(), "simd": model.simd().name(),
            "ms_per_token": {"total": 1e3 * secs / st.tokens.max(1) as f64, "trunk": 1e3 * st.trunk_seconds / st.tokens.max(1) as f64,
                "attention": 1e3 * st.attn_seconds / st.tokens.max(1) as f64, "expert_compute": 1e3 * st.expert_seconds / st.tokens.max(1) as f64,
                "expert_io": 1e3 * st.io_seconds / st.tokens.max(1) as f64}}))?;
    } else {
        println!("{}", out.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(","));
        let total = st.experts_hit + st.experts_missed;
        eprintln!("[{} tokens, {secs:.2} s, {:.2} tok/s | experts {} hit / {} miss = {:.0}%]", out.len(), out.len() as f64 / secs, st.experts_hit, st.experts_missed, if total > 0 { 100.0 * st.experts_hit as f64 / total as f64 } else { 0.0 });
    }
    Ok(ExitCode::SUCCESS)
}

/// Greedy choice: highest logit, lowest id on ties.
pub fn argmax(l: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in l.iter().enumerate() {
        if *v > l[best] {
            best = i;
        }
    }
    best as u32
}
