//! `waste plan` and `waste bench`.

use crate::cmd_eval::{parse_budget, EngineArgs};
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
    /// Plan for this many sequences decoded together (`serve --parallel`,
    /// `bench --parallel`): their states and scratch in the floor, and
    /// whether the cache lets a step take them all.
    #[arg(long, default_value_t = 1)]
    parallel: usize,
    /// The disk's read speed in GB/s for the estimate of a budget below
    /// the floor (default: measured on the container's largest expert
    /// bank, when it has one).
    #[arg(long)]
    disk_gbps: Option<f64>,
}

/// `--parallel N` (plan, bench, serve): 1 to [`waste_model::MAX_PARALLEL`].
pub(crate) fn check_parallel(n: usize) -> Result<()> {
    let most = waste_model::MAX_PARALLEL;
    if n == 0 || n > most {
        anyhow::bail!("--parallel {n}: 1 to {most} sequences (one step's buffers hold {most} tokens)");
    }
    Ok(())
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

pub fn plan(a: PlanArgs) -> Result<ExitCode> {
    check_parallel(a.parallel)?;
    if a.disk_gbps.is_some_and(|g| !(g.is_finite() && g > 0.0)) {
        anyhow::bail!("--disk-gbps: a speed above 0 GB/s");
    }
    let resident = waste_model::plan(&a.model, a.ctx)
        .with_context(|| format!("planning {}", a.model.display()))?
        .with_parallel(a.parallel);
    // below the floor, the layers that stream (issue 48), or why none can
    let usable = waste_model::usable_ram();
    let split = waste_model::split(&a.model, &resident, a.budget, usable);
    let p = resident.with_split(split.as_ref().unwrap_or(&waste_model::Split::default()));
    let vocab = p.vocab as usize;
    let resolved = match &split {
        Err(e) => Err(e.to_string()),
        Ok(_) => waste_cache_resolve(&p, a.budget, usable),
    };
    let (budget, mut cache, note) = match &resolved {
        Ok((b, c, w)) => (*b, *c, w.clone()),
        Err(e) => (a.budget, 0, Some(e.clone())),
    };
    // a prefill chunk above the floor's where the cache leaves room (as
    // `Model::open` chooses it): its buffers out of the cache's share
    let p = match resolved.is_ok() && p.streamed_layers == 0 {
        true => {
            let wide = p.with_chunk(p.chunk_for(cache, waste_model::MAX_CHUNK));
            cache -= wide.floor_bytes - p.floor_bytes;
            wide
        }
        false => p,
    };
    let slots = p.cache_slots(cache, true);
    // what the cache allocates for those slots (less than its share of the
    // budget when the slots hold every record of the container)
    let arena = p.cache_arena_bytes(slots, true);
    let every = slots as u64 >= p.expert_records && p.expert_records > 0;
    // the router lookahead the open would choose keeps its slots out of a step's
    let lookahead = waste_model::lookahead_for(None, p.expert_records, p.top_k as usize, slots);
    let max_parallel = p.max_batch(slots, lookahead);
    // a layer's experts a step pins at once where the slots cannot pin
    // them all beside the lookahead (as a session): a chunk's in waves
    let wave = waste_model::expert_wave(slots, lookahead, p.layer_experts as usize);
    // a prompt of several chunks a span at a time, layer by layer, where
    // that saves reads (as a session)
    let reads = p.layer_experts > 0 && (!every || p.streamed_layers > 0);
    let span = waste_model::prefill_span(p.chunk as usize, p.chunk as usize, reads);
    // a batched step as two halves in turn: off where the cache holds every
    // expert or layers stream, else chosen by measured step times
    let halves = match waste_model::halves_for(None, p.expert_records, slots) {
        None if p.streamed_layers == 0 => json!("measured"),
        _ => json!(false),
    };
    let resolved = match resolved {
        Ok(_) if a.parallel > max_parallel => Err(format!(
            "--parallel {}: a cache of {slots} expert slots takes {max_parallel} sequences a step at most (each token's {} experts pinned at once); raise --budget",
            a.parallel, p.top_k
        )),
        r => r,
    };
    let note = match &resolved {
        Err(e) => Some(e.clone()),
        Ok(_) => note,
    };
    let stream = split.as_ref().ok().filter(|s| s.streams()).map(|s| stream_estimate(&a, &p, s, slots));
    if a.json {
        let mut v = json!({
            "trunk_bytes": p.trunk_bytes, "state_bytes": p.state_bytes, "scratch_bytes": p.scratch_bytes, "shared_scratch_bytes": p.shared_scratch_bytes, "tokenizer_bytes": p.tokenizer_bytes, "tokenize_bytes": p.tokenize_bytes, "template_bytes": p.template_bytes,
            "grammar_bytes_when_constrained": p.with_grammar(vocab).grammar_bytes,
            "vision_bytes": p.vision_bytes(), "vision_weight_bytes": p.vision_weight_bytes, "vision_scratch_bytes": p.vision_scratch_bytes,
            "min_expert_cache_bytes": p.min_expert_cache_bytes, "floor_bytes": p.floor_bytes,
            "working_set_bytes": p.working_set_bytes, "recommended_bytes": p.recommended_bytes,
            "usable_ram_bytes": usable, "budget_bytes": budget, "expert_cache_bytes": arena,
            "expert_cache_budget_bytes": cache, "cache_holds_every_expert": every,
            "expert_record_bytes": p.record_bytes, "cache_slots": slots, "ctx": a.ctx, "ok": resolved.is_ok(), "note": note,
            "expert_lanes": p.expert_lanes, "expert_lane_bytes": p.expert_lane_bytes,
            "parallel": p.parallel, "parallel_bytes": p.parallel_bytes, "max_parallel": max_parallel,
            "snapshot_bytes_when_serving": p.with_snapshots(a.parallel).snapshot_bytes,
            "resident_floor_bytes": resident.floor_bytes, "streamed_layers": p.streamed_layers,
            "chunk": p.chunk, "prefill_chunk": p.chunk, "expert_wave": wave, "prefill_span": span, "lookahead": lookahead, "halves": halves,
        });
        if let (Some(o), Some(st)) = (v.as_object_mut(), &stream) {
            o.extend(st.json().as_object().into_iter().flatten().map(|(k, x)| (k.clone(), x.clone())));
        }
        print_json(&v)?;
    } else {
        outln!("{} at {} tokens of context", a.model.display(), a.ctx);
        outln!("  trunk (resident)     {:>14} bytes  {}", p.trunk_bytes, gib(p.trunk_bytes));
        outln!("  state (KDA + MLA)    {:>14} bytes  {}", p.state_bytes, gib(p.state_bytes));
        outln!(
            "  scratch              {:>14} bytes  {} (prefill chunks of {} tokens)",
            p.scratch_bytes,
            gib(p.scratch_bytes),
            p.chunk
        );
        if let Some(n) = span.filter(|_| resolved.is_ok()) {
            outln!(
                "  (a prompt prefills {n} tokens at a time layer by layer: each expert read once a span, not once a chunk)"
            );
        }
        if let Some(n) = wave.filter(|_| resolved.is_ok()) {
            // within a span the waves are the span's: each expert read once a span
            let unit = if span.is_some() { "span" } else { "chunk" };
            outln!(
                "  (the cache cannot pin a layer's {} experts at once: a prefill {unit} runs them in waves of {n}, each read once a {unit} — a larger --budget reads fewer a prompt)",
                p.layer_experts
            );
        }
        if p.shared_scratch_bytes > 0 {
            outln!(
                "  shared scratch       {:>14} bytes  {} (VQ tokens in pairs; once for all sessions)",
                p.shared_scratch_bytes,
                gib(p.shared_scratch_bytes)
            );
        }
        outln!("  tokenizer tables     {:>14} bytes  {}", p.tokenizer_bytes, gib(p.tokenizer_bytes));
        outln!("  tokenizing a prompt  {:>14} bytes  {}", p.tokenize_bytes, gib(p.tokenize_bytes));
        if p.template_bytes > 0 {
            outln!("  chat template        {:>14} bytes  {}", p.template_bytes, gib(p.template_bytes));
        }
        let g = p.with_grammar(vocab).grammar_bytes;
        outln!("  (grammar tables      {:>14} bytes  {} more for `serve` and `run --json-schema`)", g, gib(g));
        let sn = p.with_snapshots(a.parallel).snapshot_bytes;
        outln!(
            "  (snapshots           {:>14} bytes  {} more for `serve`'s prefix reuse, one a request slot)",
            sn,
            gib(sn)
        );
        if p.vision_bytes() > 0 {
            let v = p.vision_bytes();
            outln!("  (with images: +{v} bytes  {} — the vision tower {} + one image's buffers {}, taken from the expert cache)", gib(v), p.vision_weight_bytes, p.vision_scratch_bytes);
        }
        if p.parallel > 1 {
            outln!(
                "  {} more sequences    {:>14} bytes  {}  (their state and scratch, a step's logits)",
                p.parallel - 1,
                p.parallel_bytes,
                gib(p.parallel_bytes)
            );
        }
        outln!("  minimum expert cache {:>14} bytes  {}", p.min_expert_cache_bytes, gib(p.min_expert_cache_bytes));
        if let Some(st) = &stream {
            st.print(&resident)?;
        }
        outln!("  floor                {:>14} bytes  {}", p.floor_bytes, gib(p.floor_bytes));
        outln!("  working set / token  {:>14} bytes  {}", p.working_set_bytes, gib(p.working_set_bytes));
        outln!("  recommended          {:>14} bytes  {}", p.recommended_bytes, gib(p.recommended_bytes));
        outln!("  usable RAM           {:>14} bytes  {}", usable, gib(usable));
        match &resolved {
            Ok(_) => outln!(
                "  budget {} buys an expert cache of {} ({} records of {} bytes){}",
                gib(budget),
                gib(arena),
                slots,
                p.record_bytes,
                if every { ": every expert of the container; a larger budget buys nothing more" } else { "" }
            ),
            Err(e) => outln!("  {e}"),
        }
        if resolved.is_ok() && p.expert_records > 0 {
            outln!("  sequences a step can decode together: {max_parallel} (--parallel; each token's experts pinned at once)");
            outln!(
                "  router lookahead: {lookahead} experts of the next layer read ahead{}",
                if lookahead == 0 {
                    " (none: the cache holds every expert, or too few for two layers)"
                } else {
                    " (--lookahead)"
                }
            );
            if a.parallel >= 2 || max_parallel >= 2 {
                outln!(
                    "  batched steps as two halves in turn: {}",
                    if halves == "measured" {
                        "whichever form the step times measure faster (--halves)"
                    } else {
                        "off (every expert cached, or layers stream from disk)"
                    }
                );
            }
        }
        if let (Ok(_), Some(n)) = (&resolved, &note) {
            outln!("  warning: {n}");
        }
    }
    Ok(if resolved.is_ok() { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

/// What a budget below the floor streams and what a token then reads.
struct StreamEstimate<'a> {
    split: &'a waste_model::Split,
    /// A token's expert reads with this cache if routing were uniform.
    expert_bytes: f64,
    disk_gbps: Option<f64>,
    measured: bool,
    /// Decoder layers of the model.
    layers: u64,
}

fn stream_estimate<'a>(
    a: &PlanArgs,
    p: &waste_model::Plan,
    s: &'a waste_model::Split,
    slots: usize,
) -> StreamEstimate<'a> {
    let held = if p.expert_records > 0 { (slots as f64 / p.expert_records as f64).min(1.0) } else { 1.0 };
    let measured = a.disk_gbps.is_none();
    let disk_gbps = a.disk_gbps.or_else(|| disk_bandwidth(&a.model, 4, true));
    StreamEstimate {
        split: s,
        expert_bytes: p.working_set_bytes as f64 * (1.0 - held),
        disk_gbps,
        measured,
        layers: p.layers,
    }
}

impl StreamEstimate<'_> {
    fn read_bytes(&self) -> f64 {
        self.split.read_bytes as f64 + self.expert_bytes
    }
    fn ms(&self) -> Option<f64> {
        self.disk_gbps.map(|g| self.read_bytes() / (g * 1e9) * 1e3)
    }
    fn json(&self) -> serde_json::Value {
        json!({
            "streamed_layer_ids": self.split.streamed, "streamed_head": self.split.head, "streamed_bytes": self.split.streamed_bytes,
            "stream_buffer_bytes": self.split.buffer_bytes, "trunk_read_bytes_per_token": self.split.read_bytes,
            "expert_read_bytes_per_token_uniform": self.expert_bytes, "read_bytes_per_token": self.read_bytes(),
            "disk_gbps": self.disk_gbps, "disk_gbps_measured": self.disk_gbps.is_some() && self.measured,
            "ms_per_token_estimate": self.ms(),
        })
    }
    fn print(&self, resident: &waste_model::Plan) -> Result<()> {
        let s = &self.split;
        outln!(
            "  resident floor       {:>14} bytes  {}  (every layer in memory)",
            resident.floor_bytes,
            gib(resident.floor_bytes)
        );
        outln!(
            "  below it: {} of {} decoder layers{} stream from disk, {} of them ({} read a token); two pieces in memory at a time: {} bytes  {}",
            s.streamed.len(),
            self.layers,
            if s.head { " and the head" } else { "" },
            gib(s.streamed_bytes),
            gib(s.read_bytes),
            s.buffer_bytes,
            gib(s.buffer_bytes)
        );
        if !s.streamed.is_empty() {
            outln!("  streamed layers      {}", ranges(&s.streamed));
        }
        let speed = match (self.disk_gbps, self.measured) {
            (Some(g), true) => format!("{g:.2} GB/s measured"),
            (Some(g), false) => format!("{g:.2} GB/s given"),
            (None, _) => "unknown (--disk-gbps)".into(),
        };
        outln!(
            "  a token reads {:.2} GB: streamed trunk {:.2} + experts {:.2} (uniform routing over the cache); disk {speed}{}",
            self.read_bytes() / 1e9,
            s.read_bytes as f64 / 1e9,
            self.expert_bytes / 1e9,
            self.ms().map_or(String::new(), |ms| format!(" → about {:.0} ms/token ({:.2} s)", ms, ms / 1e3))
        );
        Ok(())
    }
}

/// `0-3, 5, 7-9` for a sorted list.
fn ranges(v: &[usize]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < v.len() {
        let mut j = i;
        while j + 1 < v.len() && v[j + 1] == v[j] + 1 {
            j += 1;
        }
        out.push(if i == j { v[i].to_string() } else { format!("{}-{}", v[i], v[j]) });
        i = j + 1;
    }
    out.join(", ")
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
    pub(crate) model: PathBuf,
    /// Decode steps to time.
    #[arg(short = 'n', default_value_t = 16)]
    pub(crate) n: usize,
    /// Prompt length (token ids 1..=P, prefill timed separately).
    #[arg(long, default_value_t = 8)]
    pub(crate) prompt_len: usize,
    /// Machine-readable output.
    #[arg(long)]
    pub(crate) json: bool,
    /// Decode this many sequences together (`Model::step_many`), each with
    /// its own prompt and sampler and, with --routing, the trace from its
    /// own offset: reports aggregate and per-sequence tokens/s and the
    /// experts a token reads (`--parallel 1` runs one sequence the same
    /// way, for a like-for-like table; without the flag, the
    /// single-sequence benchmark).
    #[arg(long)]
    pub(crate) parallel: Option<usize>,
    /// Replay a recorded routing (JSONL, the `cachesim` trace format)
    /// instead of the router's choice: a synthetic container then streams
    /// experts like the real model (testdata/routing/).
    #[arg(long)]
    pub(crate) routing: Option<PathBuf>,
    /// Sample decode tokens at this temperature instead of greedy (0): a
    /// random model's greedy loop repeats one token, and so its experts.
    #[arg(long, default_value_t = 0.0)]
    pub(crate) temp: f32,
    /// Seed for `--temp`.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// After the decode, prefill the same prompt this many more times, each
    /// on a reset session (its experts as the runs before left the cache):
    /// `prefill_warm_ms_per_token` is their median (the upper middle one
    /// for an even count) — a later prompt in a
    /// running process, where the first prefill also pays the process's
    /// first use of its cores after the open (0 = skip; at most 1000).
    #[arg(long, default_value_t = 3)]
    prefill_repeats: usize,
    #[command(flatten)]
    pub(crate) engine: EngineArgs,
}

/// The container's direct-read bandwidth (GB/s): records of the expert size
/// read scattered from its largest bank with `qd` reads in flight, at most
/// 256 MB. Run before the model is opened, so its buffers never add to the
/// engine's peak memory.
pub(crate) fn disk_bandwidth(path: &std::path::Path, qd: usize, direct: bool) -> Option<f64> {
    // the record size only: the manifest, not the tokenizer `plan` would load
    let ct = waste_model::format::Container::open(path).ok()?;
    let p = waste_model::Plan::for_container(&ct, 1).ok()?;
    if p.record_bytes == 0 {
        return None;
    }
    let bank = std::fs::read_dir(path)
        .ok()?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("experts-"))
        .max_by_key(|e| e.metadata().map(|m| m.len()).unwrap_or(0))?;
    // as many reads in flight as the probe's buffer bound allows for this record size
    let qd = qd.min((waste_io::PROBE_MAX_BUFFERS / p.record_bytes).max(1) as usize);
    let r = waste_io::probe_bandwidth(&bank.path(), p.record_bytes as usize, qd, 256 << 20, direct, false).ok()?;
    Some(r.gbps)
}

/// The router lookahead a bench runs with: the model's, none for a
/// replayed routing (whose sessions read nothing ahead).
pub(crate) fn lookahead_in_use(a: &BenchArgs, model: &waste_model::Model) -> usize {
    if a.routing.is_some() {
        0
    } else {
        model.lookahead()
    }
}

/// `bench --json`'s `vq_lookup_probes_us`: each probe that chose the AVX2
/// fast VQ lookup form, its best time per form in µs, two inputs' by the
/// pair kernel (`pairs`: whether tokens share the gathers) and four inputs'
/// by the quad kernel (`quads`: whether four tokens share them).
pub(crate) fn lookup_probes_json(model: &waste_model::Model) -> serde_json::Value {
    let us = |t: f64| (t * 1e7).round() / 10.0;
    model
        .vq_lookup_probes()
        .iter()
        .map(|[b, c, g, p, q]| {
            json!({"blends": us(*b), "chains": us(*c), "gathers": us(*g), "pairs": us(*p), "quads": us(*q)})
        })
        .collect()
}

/// The largest of the disk's, memory's and cores' bounds and its name
/// (memory on a tie with the disk, the cores only when strictly larger).
pub(crate) fn bound_of(disk_ms: f64, mem_ms: f64, compute_ms: f64) -> (&'static str, f64) {
    [("disk", disk_ms), ("memory", mem_ms), ("compute", compute_ms)].into_iter().fold(("memory", mem_ms), |b, c| {
        if c.1 > b.1 {
            c
        } else {
            b
        }
    })
}

/// Most repeated prefills `bench --prefill-repeats` runs (a median needs a
/// few; the bound keeps a mistyped count from running for days).
const MAX_PREFILL_REPEATS: usize = 1000;

pub fn bench(a: BenchArgs) -> Result<ExitCode> {
    // every figure is per decode step: none to time is an error, not 0 ms
    if a.n == 0 {
        anyhow::bail!("-n 0: bench times decode steps, at least 1");
    }
    if a.prompt_len == 0 {
        anyhow::bail!("--prompt-len 0: the prompt needs at least 1 token");
    }
    if a.prefill_repeats > MAX_PREFILL_REPEATS {
        anyhow::bail!("--prefill-repeats {}: at most {MAX_PREFILL_REPEATS}", a.prefill_repeats);
    }
    // before the open (a 48B's takes seconds)
    let params = waste_model::SamplingParams { temperature: a.temp, seed: a.seed, ..Default::default() };
    params.validate().map_err(|e| anyhow::anyhow!("--temp: {e}"))?;
    let trace = a.routing.as_ref().map(|p| crate::cmd_cache::load_trace(p)).transpose()?;
    if let Some(n) = a.parallel {
        check_parallel(n)?;
        return crate::bench_parallel::bench_parallel(&a, n, trace);
    }
    // the engine caps its readers at MAX_IO_THREADS; the probe does the same
    let io_qd = if a.engine.io_threads == 0 { 4 } else { a.engine.io_threads.min(waste_model::MAX_IO_THREADS) };
    let disk_gbps = disk_bandwidth(&a.model, io_qd, !a.engine.no_direct_io);
    let t_open = std::time::Instant::now();
    let model = a.engine.open(&a.model)?;
    let open_s = t_open.elapsed().as_secs_f64();
    let vocab = model.config().vocab as u32;
    let ctx = model.options().ctx;
    if a.prompt_len >= ctx {
        anyhow::bail!("--prompt-len {} leaves no room to decode in a context of {ctx} tokens (--ctx)", a.prompt_len);
    }
    let prompt: Vec<u32> = (0..a.prompt_len as u32).map(|i| 1 + (i * 7919) % (vocab - 1).max(1)).collect();
    let mut s = model.session();
    if let Some(trace) = trace {
        s.replay_routing(std::sync::Arc::new(trace))?;
    }
    let mut sampler = waste_model::Sampler::new(params);
    let t0 = std::time::Instant::now();
    let mut next = sampler.pick(s.eval(&prompt)?, None);
    let prefill_s = t0.elapsed().as_secs_f64();
    let st0 = s.stats();
    let cs0 = model.cache_stats();
    let t1 = std::time::Instant::now();
    let mut steps = 0;
    for _ in 0..a.n {
        if s.position() >= ctx {
            eprintln!("warning: decoded {steps} of {} steps: the context of {ctx} tokens is full (--ctx)", a.n);
            break;
        }
        next = sampler.pick(s.eval(&[next])?, None);
        steps += 1;
    }
    let dec_s = t1.elapsed().as_secs_f64();
    let st = s.stats();
    let cs = model.cache_stats();
    a.engine.finish(&model, &a.model, st.tokens)?;
    // the same prompt again (after the usage is written: the repeats are
    // not a workload the hotlist should learn)
    let mut warm = Vec::with_capacity(a.prefill_repeats);
    for _ in 0..a.prefill_repeats {
        s.reset();
        let t = std::time::Instant::now();
        s.eval(&prompt)?;
        warm.push(1e3 * t.elapsed().as_secs_f64() / prompt.len() as f64);
    }
    warm.sort_by(f64::total_cmp);
    let warm_ms = warm.get(warm.len() / 2).copied();
    let n = steps.max(1) as f64;
    let d = st - st0;
    let (hit, miss) = (d.experts_hit, d.experts_missed);
    let rate = |hit: u64, miss: u64| if hit + miss > 0 { hit as f64 / (hit + miss) as f64 } else { 0.0 };
    let hit_rate = rate(hit, miss);
    let expert_bytes = d.bytes_read + (cs.prefetch_issued - cs0.prefetch_issued) * model.plan().record_bytes;
    // below the floor, the streamed layers' bytes too (issue 48)
    let bytes = expert_bytes + d.trunk_bytes_read;
    // the roofline: the slower of the disk (bytes read) and memory (bytes a
    // token touches: the trunk, every expert it uses, the attention state)
    let (mem1, mem_n) = model.memory_bandwidth(model.threads(), 3);
    let plan = model.plan();
    let touched =
        plan.trunk_bytes as f64 + (hit + miss) as f64 / n * plan.record_bytes as f64 + plan.state_bytes as f64;
    let disk_ms = disk_gbps.map_or(0.0, |g| bytes as f64 / n / (g * 1e9) * 1e3);
    let mem_ms = if mem_n > 0.0 { touched / (mem_n * 1e9) * 1e3 } else { 0.0 };
    let roofline_ms = disk_ms.max(mem_ms);
    let ms_per_token = 1e3 * dec_s / n;
    let share = |ms: f64| if ms_per_token > 0.0 { ms / ms_per_token } else { 0.0 };
    let roofline_share = share(roofline_ms);
    // the cores' bounds: the token's matrix work at in-cache kernel speed,
    // and a prefill token's (its matrices as chunks, its experts as it ran
    // them: a batching kernel's runs served uses / runs tokens each)
    let p_len = prompt.len() as f64;
    let p_uses = (st0.experts_hit + st0.experts_missed) as f64;
    let users = if st0.expert_runs > 0 { p_uses / st0.expert_runs as f64 } else { 1.0 };
    let shape = waste_model::PrefillShape { tokens: prompt.len(), chunk: s.chunk_len(), users };
    let (cb, pcb) = model.compute_bounds(shape)?;
    let used = (hit + miss) as f64 / n;
    let compute_ms = cb.ms_per_token(used);
    let (bound, attainable_ms) = bound_of(disk_ms, mem_ms, compute_ms);
    // the prefill's own roofline: what it read (misses and prefetches), and
    // what it touched — the trunk once a chunk, each chunk's distinct
    // experts once (the engine's unit of reuse), the state once a chunk
    let p_bytes = st0.bytes_read + st0.prefetch_issued * plan.record_bytes + st0.trunk_bytes_read;
    let chunks = prompt.len().div_ceil(s.chunk_len().max(1)) as f64;
    let p_touched = chunks * (plan.trunk_bytes + plan.state_bytes) as f64
        + (st0.experts_hit + st0.experts_missed) as f64 * plan.record_bytes as f64;
    let p_disk_ms = disk_gbps.map_or(0.0, |g| p_bytes as f64 / p_len / (g * 1e9) * 1e3);
    let p_mem_ms = if mem_n > 0.0 { p_touched / p_len / (mem_n * 1e9) * 1e3 } else { 0.0 };
    let p_roof_ms = p_disk_ms.max(p_mem_ms);
    let p_ms = 1e3 * prefill_s / p_len;
    let p_share = if p_ms > 0.0 { p_roof_ms / p_ms } else { 0.0 };
    let p_compute_ms = pcb.ms_per_token(p_uses / p_len);
    let (p_bound, p_attain_ms) = bound_of(p_disk_ms, p_mem_ms, p_compute_ms);
    let p_attain_share = if p_ms > 0.0 { p_attain_ms / p_ms } else { 0.0 };
    let prefill = json!({
        "prefill_roofline_ms_per_token": p_roof_ms, "prefill_roofline_share": p_share,
        "prefill_roofline_disk_ms_per_token": p_disk_ms, "prefill_roofline_memory_ms_per_token": p_mem_ms,
        "prefill_bytes_read": p_bytes, "prefill_hit_rate": rate(st0.experts_hit, st0.experts_missed),
        "prefill_expert_ms_per_token": 1e3 * st0.expert_seconds / p_len,
        "prefill_attention_ms_per_token": 1e3 * st0.attn_seconds / p_len,
        "prefill_trunk_ms_per_token": 1e3 * st0.trunk_seconds / p_len,
        "prefill_io_wait_ms_per_token": 1e3 * st0.io_seconds / p_len,
        "prefill_warm_ms_per_token": warm_ms, "prefill_warm_runs": warm.len(),
        "prefill_roofline_compute_ms_per_token": p_compute_ms,
        "prefill_roofline_compute_expert_ms_per_token": pcb.expert_ms_per_token(p_uses / p_len),
        "prefill_roofline_bound": p_bound, "prefill_tokens_per_expert_run": users, "prefill_chunk": s.chunk_len(),
        "expert_wave": model.expert_wave(), "prefill_expert_waves": st0.expert_waves,
        "prefill_span": model.prefill_span(),
        "prefill_attainable_ms_per_token": p_attain_ms, "prefill_attainable_share": p_attain_share,
    });
    // what the OS gave of the huge pages asked for (the trunk, the cache), after the runs
    let huge_bytes = waste_io::huge_page_bytes();
    let mut v = json!({
        "open_seconds": open_s, "prefill_ms_per_token": p_ms,
        "roofline_ms_per_token": roofline_ms, "roofline_share": roofline_share,
        "roofline_disk_ms_per_token": disk_ms, "roofline_memory_ms_per_token": mem_ms,
        "bytes_touched_per_token": touched, "disk_gbps": disk_gbps, "memory_gbps_1_thread": mem1, "memory_gbps": mem_n,
        "tok_per_s": steps as f64 / dec_s, "ms_per_token": 1e3 * dec_s / n, "hit_rate": hit_rate,
        "bytes_per_token": bytes as f64 / n, "direct_io": model.direct_io(), "experts_hit": hit, "experts_missed": miss,
        "decode_tokens": steps, "prefill_tokens": prompt.len(), "prefill_seconds": prefill_s, "prefill_tok_per_s": prompt.len() as f64 / prefill_s,
        "prefetch_issued": cs.prefetch_issued - cs0.prefetch_issued, "prefetch_used": cs.prefetch_used - cs0.prefetch_used,
        "io_wait_ms_per_token": 1e3 * d.io_seconds / n,
        "expert_ms_per_token": 1e3 * d.expert_seconds / n,
        "attention_ms_per_token": 1e3 * d.attn_seconds / n,
        "trunk_ms_per_token": 1e3 * d.trunk_seconds / n,
        "budget_bytes": model.budget(), "cache_slots": model.cache_slots(), "huge_pages": model.huge_pages(),
        "huge_page_bytes": huge_bytes, "prefaulted_bytes": model.prefaulted_bytes(),
        "threads": model.threads(), "io_threads": model.options().io_threads, "simd": model.simd().name(),
        "lookahead": lookahead_in_use(&a, &model), "readahead": model.options().readahead, "preloaded": model.preloaded(),
        "policy": model.options().policy.name(), "temperature": a.temp, "kda_chunked": model.options().kda_chunked,
    });
    v["numeric_mode"] = json!(model.numeric().name());
    v["avx_vnni"] = json!(model.avx_vnni());
    // below the floor (issue 48): the streamed layers' reads apart from the experts'
    let below = json!({
        "streamed_layers": model.streamed_layers().len(),
        "streamed_head": model.streams_head(),
        "trunk_bytes_read_per_token": d.trunk_bytes_read as f64 / n,
        "expert_bytes_read_per_token": expert_bytes as f64 / n,
        "trunk_io_wait_ms_per_token": 1e3 * d.trunk_io_seconds / n,
        "roofline_disk_trunk_ms_per_token": disk_gbps.map_or(0.0, |g| d.trunk_bytes_read as f64 / n / (g * 1e9) * 1e3),
    });
    let cores = json!({
        "roofline_compute_ms_per_token": compute_ms, "roofline_compute_expert_ms_per_token": cb.expert_ms_per_token(used),
        "roofline_bound": bound,
        "attainable_ms_per_token": attainable_ms, "attainable_share": share(attainable_ms),
    });
    // what sums the experts here (the AVX2 VQ row kernel by the open's probe)
    v["expert_kernel"] = json!(model.expert_kernel());
    v["vq_lookup_probes_us"] = lookup_probes_json(&model);
    if let Some(o) = v.as_object_mut() {
        for part in [&prefill, &cores, &below] {
            o.extend(part.as_object().into_iter().flatten().map(|(k, x)| (k.clone(), x.clone())));
        }
    }
    if a.json {
        print_json(&v)?;
    } else {
        let huge = huge_bytes.map_or(String::new(), |b| format!(" ({:.0} MB in them)", b as f64 / 1e6));
        outln!("decode: {:.2} tok/s, {:.1} ms/token | hit rate {:.1}% | {:.1} MB read/token | direct I/O {} | huge pages {}{huge}", steps as f64 / dec_s, ms_per_token, 100.0 * hit_rate, bytes as f64 / n / 1e6, model.direct_io(), model.huge_pages());
        outln!(
            "roofline: {:.1} ms/token ({:.0}% reached) = max(disk {:.1} ms at {}, memory {:.1} ms: {:.0} MB touched at {:.1} GB/s) | open {:.2} s | SIMD {}{}",
            roofline_ms,
            100.0 * roofline_share,
            disk_ms,
            disk_gbps.map_or("n/a".into(), |g| format!("{g:.2} GB/s")),
            mem_ms,
            touched / 1e6,
            mem_n,
            open_s,
            model.simd().name(),
            model.expert_kernel().map_or(String::new(), |k| format!(", experts {k}"))
        );
        if !model.streamed_layers().is_empty() || model.streams_head() {
            outln!(
                "below the floor: {} layers{} streamed | read/token: trunk {:.1} MB + experts {:.1} MB | waiting for layers {:.1} ms/token",
                model.streamed_layers().len(),
                if model.streams_head() { " and the head" } else { "" },
                d.trunk_bytes_read as f64 / n / 1e6,
                expert_bytes as f64 / n / 1e6,
                1e3 * d.trunk_io_seconds / n
            );
        }
        outln!(
            "cores: {:.1} ms/token at in-cache kernel speed | bound: {bound}, {:.1} ms ({:.0}% reached)",
            compute_ms,
            attainable_ms,
            100.0 * share(attainable_ms)
        );
        outln!(
            "prefill: {} tokens in {:.2} s ({:.2} tok/s, {:.1} ms/token, {:.0}% of its roofline: disk {:.1} ms for {:.1} MB read, memory {:.1} ms){}; cache {} slots, budget {} bytes",
            prompt.len(),
            prefill_s,
            p_len / prefill_s,
            p_ms,
            100.0 * p_share,
            p_disk_ms,
            p_bytes as f64 / 1e6,
            p_mem_ms,
            warm_ms.map_or(String::new(), |w| format!(" | again: {w:.1} ms/token (median of {})", warm.len())),
            model.cache_slots(),
            model.budget()
        );
        outln!(
            "prefill cores: {:.1} ms/token at in-cache kernel speed ({:.1} tokens an expert run) | bound: {p_bound}, {:.1} ms ({:.0}% reached)",
            p_compute_ms,
            users,
            p_attain_ms,
            100.0 * p_attain_share
        );
    }
    let _ = next;
    Ok(ExitCode::SUCCESS)
}
