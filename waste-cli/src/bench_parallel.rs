//! `waste bench --parallel N`: N sequences decoded together
//! (`Model::step_many`), each with its own prompt, sampler and (with
//! `--routing`) the trace replayed from its own offset.

use crate::cmd_plan::{bound_of, disk_bandwidth, BenchArgs};
use crate::print_json;
use anyhow::{bail, Result};
use serde_json::json;
use std::process::ExitCode;

/// Stream `i`'s prompt: `len` ids, distinct per stream.
fn prompt(i: usize, len: usize, vocab: u32) -> Vec<u32> {
    (0..len as u32).map(|j| 1 + ((j + 7 * i as u32) * 7919) % (vocab - 1).max(1)).collect()
}

/// The trace rotated to start at stream `i` of `n`'s offset.
fn rotated(trace: &waste_cache::Trace, i: usize, n: usize) -> waste_cache::Trace {
    let off = i * trace.len() / n.max(1);
    trace[off..].iter().chain(&trace[..off]).cloned().collect()
}

/// `trace`: `--routing`'s, read before the open.
pub fn bench_parallel(a: &BenchArgs, np: usize, trace: Option<waste_cache::Trace>) -> Result<ExitCode> {
    let io_qd = if a.engine.io_threads == 0 { 4 } else { a.engine.io_threads.min(waste_model::MAX_IO_THREADS) };
    let disk_gbps = disk_bandwidth(&a.model, io_qd, !a.engine.no_direct_io);
    let model = a.engine.open_parallel(&a.model, false, np)?;
    if np > model.max_batch() {
        bail!(
            "--parallel {np}: this cache of {} expert slots takes {} sequences a step at most (each token's experts pinned at once); raise --budget",
            model.cache_slots(),
            model.max_batch()
        );
    }
    let (vocab, ctx) = (model.config().vocab as u32, model.options().ctx);
    if a.prompt_len + a.n > ctx {
        bail!("--prompt-len {} and -n {} do not fit a context of {ctx} tokens (--ctx)", a.prompt_len, a.n);
    }
    let mut sessions: Vec<_> = (0..np).map(|_| model.session()).collect();
    let mut samplers = Vec::with_capacity(np);
    let mut next = Vec::with_capacity(np);
    let t0 = std::time::Instant::now();
    for (i, s) in sessions.iter_mut().enumerate() {
        if let Some(t) = &trace {
            s.replay_routing(std::sync::Arc::new(rotated(t, i, np)))?;
        }
        let params = waste_model::SamplingParams {
            temperature: a.temp,
            seed: a.seed.wrapping_add(i as u64),
            ..Default::default()
        };
        params.validate().map_err(|e| anyhow::anyhow!("--temp: {e}"))?;
        let mut sampler = waste_model::Sampler::new(params);
        next.push(sampler.pick(s.eval(&prompt(i, a.prompt_len, vocab))?, None));
        samplers.push(sampler);
    }
    let prefill_s = t0.elapsed().as_secs_f64();
    let sum = |ss: &[waste_model::Session<'_>]| ss.iter().fold(waste_model::Stats::default(), |acc, s| acc + s.stats());
    let (st0, cs0) = (sum(&sessions), model.cache_stats());
    let t1 = std::time::Instant::now();
    for _ in 0..a.n {
        let mut refs: Vec<&mut waste_model::Session<'_>> = sessions.iter_mut().collect();
        model.step_many(&mut refs, &next)?;
        for ((s, smp), nx) in sessions.iter().zip(&mut samplers).zip(&mut next) {
            *nx = smp.pick(s.logits(), None);
        }
    }
    let dec_s = t1.elapsed().as_secs_f64();
    let (d, cs) = (sum(&sessions) - st0, model.cache_stats());
    let (steps, tokens) = (a.n as f64, d.tokens.max(1) as f64);
    let plan = model.plan();
    let bytes = d.bytes_read + (cs.prefetch_issued - cs0.prefetch_issued) * plan.record_bytes;
    let uses = (d.experts_hit + d.experts_missed) as f64;
    // the roofline of a token: the disk for what it read; memory for what
    // its step touched (the trunk once, each distinct expert once, every
    // sequence's state) shared by the step's tokens
    let (mem1, mem_n) = model.memory_bandwidth(model.threads(), 3);
    let touched = (plan.trunk_bytes as f64 * steps
        + d.experts_acquired as f64 * plan.record_bytes as f64
        + plan.state_bytes as f64 * tokens)
        / tokens;
    let disk_ms = disk_gbps.map_or(0.0, |g| bytes as f64 / tokens / (g * 1e9) * 1e3);
    let mem_ms = if mem_n > 0.0 { touched / (mem_n * 1e9) * 1e3 } else { 0.0 };
    // the cores' bound: the trunk as decode's; a step's experts as a
    // chunk's of its tokens run (each run serving uses / runs of them:
    // batched, or VQ tokens in pairs)
    let users = if d.expert_runs > 0 { uses / d.expert_runs as f64 } else { 1.0 };
    let shape = waste_model::PrefillShape { tokens: a.prompt_len.max(np), chunk: np, users };
    let (cb, step) = model.compute_bounds(shape)?;
    let cb = waste_model::ComputeBound { moe_layer_ms: step.moe_layer_ms, ..cb };
    let compute_ms = cb.ms_per_token(uses / tokens);
    let roofline_ms = disk_ms.max(mem_ms);
    let ms_per_token = 1e3 * dec_s / tokens;
    let (bound, attainable_ms) = bound_of(disk_ms, mem_ms, compute_ms);
    let share = |ms: f64| if ms_per_token > 0.0 { ms / ms_per_token } else { 0.0 };
    let mut v = json!({
        "parallel": np, "decode_steps": a.n, "decode_tokens": d.tokens,
        "tok_per_s": tokens / dec_s, "tok_per_s_per_stream": steps / dec_s,
        "ms_per_step": 1e3 * dec_s / steps, "ms_per_token": ms_per_token,
        "experts_per_token": d.experts_acquired as f64 / tokens, "expert_reads_per_token": d.experts_missed as f64 / tokens,
        "expert_uses_per_token": uses / tokens, "tokens_per_expert_run": users,
        "hit_rate": if uses > 0.0 { d.experts_hit as f64 / uses } else { 0.0 },
        "bytes_per_token": bytes as f64 / tokens,
        "io_wait_ms_per_step": 1e3 * d.io_seconds / steps, "expert_ms_per_step": 1e3 * d.expert_seconds / steps,
        "attention_ms_per_step": 1e3 * d.attn_seconds / steps, "trunk_ms_per_step": 1e3 * d.trunk_seconds / steps,
        "roofline_ms_per_token": roofline_ms, "roofline_share": share(roofline_ms),
        "roofline_disk_ms_per_token": disk_ms, "roofline_memory_ms_per_token": mem_ms,
        "roofline_compute_ms_per_token": compute_ms, "roofline_bound": bound,
        "attainable_ms_per_token": attainable_ms, "attainable_share": share(attainable_ms),
        "bytes_touched_per_token": touched, "disk_gbps": disk_gbps, "memory_gbps_1_thread": mem1, "memory_gbps": mem_n,
        "prefill_seconds": prefill_s, "prefill_ms_per_token": 1e3 * prefill_s / (np * a.prompt_len) as f64,
        "budget_bytes": model.budget(), "cache_slots": model.cache_slots(), "max_batch": model.max_batch(),
        "threads": model.threads(), "simd": model.simd().name(), "numeric_mode": model.numeric().name(),
        "expert_kernel": model.expert_kernel(), "vq_lookup_probes_us": crate::cmd_plan::lookup_probes_json(&model),
        "temperature": a.temp, "routing": a.routing.is_some(),
    });
    // the router lookahead in use and what its guesses read and served
    v["lookahead"] = json!(crate::cmd_plan::lookahead_in_use(a, &model));
    // fixed on or off, or "measured": then the share of steps it chose halves
    v["halves"] = match model.halves() {
        _ if np < 2 => json!(false),
        Some(h) => json!(h),
        None => json!("measured"),
    };
    v["halves_steps"] = json!(d.halves_steps);
    v["prefetch_issued"] = json!(cs.prefetch_issued - cs0.prefetch_issued);
    v["prefetch_used"] = json!(cs.prefetch_used - cs0.prefetch_used);
    if a.json {
        print_json(&v)?;
    } else {
        outln!(
            "decode, {np} sequences together: {:.2} tok/s ({:.2} per sequence), {:.1} ms a step | {:.2} experts a token ({:.2} read from disk), hit rate {:.1}% | {:.1} MB read/token",
            tokens / dec_s,
            steps / dec_s,
            1e3 * dec_s / steps,
            d.experts_acquired as f64 / tokens,
            d.experts_missed as f64 / tokens,
            100.0 * v["hit_rate"].as_f64().unwrap_or(0.0),
            bytes as f64 / tokens / 1e6
        );
        outln!(
            "roofline a token: {:.1} ms ({:.0}% reached) = max(disk {:.1} ms, memory {:.1} ms) | cores {:.1} ms | bound: {bound} | SIMD {}",
            roofline_ms,
            100.0 * share(roofline_ms),
            disk_ms,
            mem_ms,
            compute_ms,
            model.simd().name()
        );
        outln!(
            "a step: experts {:.1} ms, attention {:.1} ms, trunk {:.1} ms, I/O wait {:.1} ms | prefill of {np} prompts {:.2} s",
            1e3 * d.expert_seconds / steps,
            1e3 * d.attn_seconds / steps,
            1e3 * d.trunk_seconds / steps,
            1e3 * d.io_seconds / steps,
            prefill_s
        );
    }
    Ok(ExitCode::SUCCESS)
}
