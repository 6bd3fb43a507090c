//! `waste plan` and `waste bench`.

use crate::cmd_eval::{argmax, parse_budget, EngineArgs};
use crate::print_json;
use anyhow::{Context, Result};
use clap::Args;
use serde_json::json;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Args)]
pub struct PlanArgs {
    /// Container directory.
    model: PathBuf,
    /// A RAM budget to evaluate, e.g. 4G (0 = the default rule).
    #[arg(long, default_value = "0", value_parser = parse_budget)]
    budget: u64,
    /// Context in tokens.
    #[arg(long, default_value_t = 4096)]
    ctx: usize,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

pub fn plan(a: PlanArgs) -> Result<ExitCode> {
    let p = waste_model::plan(&a.model, a.ctx).with_context(|| format!("planning {}", a.model.display()))?;
    let usable = waste_model::usable_ram();
    let resolved = waste_cache_resolve(&p, a.budget, usable);
    let (budget, cache, note) = match &resolved {
        Ok((b, c, w)) => (*b, *c, w.clone()),
        Err(e) => (a.budget, 0, Some(e.clone())),
    };
    let slots = p.cache_slots(cache, true);
    if a.json {
        print_json(&json!({
            "trunk_bytes": p.trunk_bytes, "state_bytes": p.state_bytes, "scratch_bytes": p.scratch_bytes,
            "min_expert_cache_bytes": p.min_expert_cache_bytes, "floor_bytes": p.floor_bytes,
            "working_set_bytes": p.working_set_bytes, "recommended_bytes": p.recommended_bytes,
            "usable_ram_bytes": usable, "budget_bytes": budget, "expert_cache_bytes": cache,
            "expert_record_bytes": p.record_bytes, "cache_slots": slots, "ctx": a.ctx, "ok": resolved.is_ok(), "note": note,
        }))?;
    } else {
        println!("{} at {} tokens of context", a.model.display(), a.ctx);
        println!("  trunk (resident)     {:>14} bytes  {}", p.trunk_bytes, gib(p.trunk_bytes));
        println!("  state (KDA + MLA)    {:>14} bytes  {}", p.state_bytes, gib(p.state_bytes));
        println!("  scratch              {:>14} bytes  {}", p.scratch_bytes, gib(p.scratch_bytes));
        println!("  minimum expert cache {:>14} bytes  {}", p.min_expert_cache_bytes, gib(p.min_expert_cache_bytes));
        println!("  floor                {:>14} bytes  {}", p.floor_bytes, gib(p.floor_bytes));
        println!("  working set / token  {:>14} bytes  {}", p.working_set_bytes, gib(p.working_set_bytes));
        println!("  recommended          {:>14} bytes  {}", p.recommended_bytes, gib(p.recommended_bytes));
        println!("  usable RAM           {:>14} bytes  {}", usable, gib(usable));
        match &resolved {
            Ok(_) => println!(
                "  budget {} buys an expert cache of {} ({} records of {} bytes)",
                gib(budget),
                gib(cache),
                slots,
                p.record_bytes
            ),
            Err(e) => println!("  {e}"),
        }
        if let (Ok(_), Some(n)) = (&resolved, &note) {
            println!("  warning: {n}");
        }
    }
    Ok(if resolved.is_ok() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

fn waste_cache_resolve(p: &waste_model::Plan, budget: u64, usable: u64) -> Result<(u64, u64, Option<String>), String> {
    match waste_model::resolve_budget(p, budget, usable) {
        Ok(b) => Ok((b.budget, b.cache_bytes, b.warning)),
        Err(e) => Err(format!("budget {} bytes is below the floor of {} bytes ({})", e.budget, e.floor, gib(e.floor))),
    }
}

#[derive(Args)]
pub struct BenchArgs {
    /// Container directory.
    model: PathBuf,
    /// Decode steps to time.
    #[arg(short = 'n', default_value_t = 16)]
    n: usize,
    /// Prompt length (token ids 1..=P, prefill timed separately).
    #[arg(long, default_value_t = 8)]
    prompt_len: usize,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    engine: EngineArgs,
}

pub fn bench(a: BenchArgs) -> Result<ExitCode> {
    let model = a.engine.open(&a.model)?;
    let vocab = model.config().vocab as u32;
    let prompt: Vec<u32> = (0..a.prompt_len.max(1) as u32).map(|i| 1 + (i * 7919) % (vocab - 1).max(1)).collect();
    let mut s = model.session();
    let t0 = std::time::Instant::now();
    let mut next = argmax(s.eval(&prompt)?);
    let prefill_s = t0.elapsed().as_secs_f64();
    let st0 = s.stats();
    let cs0 = model.cache_stats();
    let t1 = std::time::Instant::now();
    let mut steps = 0;
    for _ in 0..a.n {
        if s.position() >= model.options().ctx {
            break;
        }
        next = argmax(s.eval(&[next])?);
        steps += 1;
    }
    let dec_s = t1.elapsed().as_secs_f64();
    let st = s.stats();
    let cs = model.cache_stats();
    a.engine.finish(&model, &a.model, st.tokens)?;
    let n = steps.max(1) as f64;
    let hit = st.experts_hit - st0.experts_hit;
    let miss = st.experts_missed - st0.experts_missed;
    let hit_rate = if hit + miss > 0 { hit as f64 / (hit + miss) as f64 } else { 0.0 };
    let bytes =
        (st.bytes_read - st0.bytes_read) + (cs.prefetch_issued - cs0.prefetch_issued) * model.plan().record_bytes;
    let v = json!({
        "tok_per_s": steps as f64 / dec_s, "ms_per_token": 1e3 * dec_s / n, "hit_rate": hit_rate,
        "bytes_per_token": bytes as f64 / n, "direct_io": model.direct_io(), "experts_hit": hit, "experts_missed": miss,
        "decode_tokens": steps, "prefill_tokens": prompt.len(), "prefill_seconds": prefill_s, "prefill_tok_per_s": prompt.len() as f64 / prefill_s,
        "prefetch_issued": cs.prefetch_issued - cs0.prefetch_issued, "prefetch_used": cs.prefetch_used - cs0.prefetch_used,
        "io_wait_ms_per_token": 1e3 * (st.io_seconds - st0.io_seconds) / n,
        "expert_ms_per_token": 1e3 * (st.expert_seconds - st0.expert_seconds) / n,
        "attention_ms_per_token": 1e3 * (st.attn_seconds - st0.attn_seconds) / n,
        "trunk_ms_per_token": 1e3 * (st.trunk_seconds - st0.trunk_seconds) / n,
        "budget_bytes": model.budget(), "cache_slots": model.cache_slots(), "huge_pages": model.huge_pages(),
        "threads": model.threads(), "io_threads": model.options().io_threads, "simd": model.simd().name(),
        "lookahead": model.options().lookahead, "readahead": model.options().readahead, "preloaded": model.preloaded(),
    });
    if a.json {
        print_json(&v)?;
    } else {
        println!("decode: {:.2} tok/s, {:.1} ms/token | hit rate {:.1}% | {:.1} MB read/token | direct I/O {} | huge pages {}", steps as f64 / dec_s, 1e3 * dec_s / n, 100.0 * hit_rate, bytes as f64 / n / 1e6, model.direct_io(), model.huge_pages());
        println!(
            "prefill: {} tokens in {:.2} s ({:.2} tok/s); cache {} slots, budget {} bytes",
            prompt.len(),
            prefill_s,
            prompt.len() as f64 / prefill_s,
            model.cache_slots(),
            model.budget()
        );
    }
    let _ = next;
    Ok(ExitCode::SUCCESS)
}
