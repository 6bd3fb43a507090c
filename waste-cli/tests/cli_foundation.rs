//! The `waste` binary on the C WASTE's anchor container and on synthetic ones.

#[path = "../../waste-quant/tests/support/skip.rs"]
mod skip;

use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;

fn anchor() -> PathBuf {
    let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata");
    let p = base.join("anchor-tiny/kimi-linear-tiny.waste");
    assert!(p.join("manifest.json").exists(), "test data missing at {} (testdata/ in the repository)", p.display());
    p
}

fn waste(args: &[&str]) -> (i32, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_waste")).args(args).output().unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into(),
        String::from_utf8_lossy(&o.stderr).into(),
    )
}

#[test]
fn info_json_reports_the_c_engines_figures() {
    let a = anchor();
    let (code, out, err) = waste(&["info", a.to_str().unwrap(), "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["layers"], 4);
    assert_eq!(v["experts"], 8);
    assert_eq!(v["top_k"], 2);
    assert_eq!(v["hidden"], 128);
    assert_eq!(v["vocab"], 316);
    assert_eq!(v["family"], "kimi-linear");
    // the C WASTE 0.6.6's figures for this container
    assert_eq!(v["params_total"], 1_129_124);
    assert_eq!(v["params_active"], 646_308);
    let q = v["quantization"].as_str().unwrap();
    assert!(q.contains("VQ3R") && q.contains("Q4G") && q.contains("Q8G") && q.contains("F32"), "{q}");
}

#[test]
fn verify_passes_on_the_anchor_and_fails_on_damage_naming_the_expert() {
    let a = anchor();
    let (code, out, _) = waste(&["verify", a.to_str().unwrap(), "--json"]);
    assert_eq!(code, 0);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["ok"], true);
    assert_eq!(v["records"], 24);

    let d = std::env::temp_dir().join(format!("waste-cli-verify-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    for e in std::fs::read_dir(&a).unwrap() {
        let e = e.unwrap();
        std::fs::write(d.join(e.file_name()), std::fs::read(e.path()).unwrap()).unwrap();
    }
    let p = d.join("experts-L2.bin");
    let mut b = std::fs::read(&p).unwrap();
    b[3 * 12288 + 100] ^= 1;
    std::fs::write(&p, b).unwrap();
    let (code, _, err) = waste(&["verify", d.to_str().unwrap()]);
    assert_ne!(code, 0);
    assert!(err.contains("expert 3 of layer 2: checksum mismatch"), "{err}");
    std::fs::remove_dir_all(&d).ok();
}

/// A usage error says all that clap says about it — the missing arguments
/// by name, "a similar argument exists", the possible values — and points
/// to --help instead of printing the usage page; never a panic.
fn usage_error_of(args: &[&str]) -> String {
    let (code, _, err) = waste(args);
    assert_eq!(code, 2, "{args:?}: {err}");
    assert!(!err.contains("panicked") && !err.contains("Usage:"), "{err}");
    assert!(err.trim_end().ends_with("(see --help)") && err.starts_with("error: "), "{err}");
    err
}

#[test]
fn bad_arguments_say_what_is_wrong_without_the_usage_page() {
    let err = usage_error_of(&["info"]);
    assert!(err.contains("<MODEL>"), "the missing argument by name: {err}");
    let err = usage_error_of(&["run"]);
    assert!(err.contains("<MODEL>"), "{err}");
    let err = usage_error_of(&["run", "m", "x", "--temprature", "0.5"]);
    assert!(err.contains("similar argument exists: '--temperature'"), "the similar argument: {err}");
    let err = usage_error_of(&["run", "m", "x", "--think=foo"]);
    assert!(err.contains("possible values") && err.contains("high"), "{err}");
    assert!(!err.contains("For more information"), "{err}");
    // a value that looks like an option is a missing value
    let err = usage_error_of(&["run", "m", "x", "--temp", "-1"]);
    assert!(err.contains("'-1'") && err.contains("-- -1"), "{err}");
    let err = usage_error_of(&["bench", "m", "--budget"]);
    assert!(err.contains("--budget"), "{err}");
    let (code, _, err) = waste(&["info", "/nonexistent/model.waste"]);
    assert_eq!(code, 1);
    assert!(err.starts_with("error: ") && err.contains("/nonexistent/model.waste"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
}

#[test]
fn version_names_the_simd_level() {
    let (code, out, _) = waste(&["version", "--json"]);
    assert_eq!(code, 0);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert!(v["simd"].is_string() && v["format_version"] == 0);
}

#[test]
fn plan_and_the_engine_agree_on_cache_slots() {
    let a = anchor();
    let a = a.to_str().unwrap();
    let (code, out, err) = waste(&["plan", a, "--json"]);
    assert_eq!(code, 0, "{err}");
    let p: Value = serde_json::from_str(&out).unwrap();
    let floor = p["floor_bytes"].as_u64().expect("floor_bytes");
    let rec = p["expert_record_bytes"].as_u64().unwrap();
    let mut seen = vec![];
    let (mut waves, mut whole) = (false, false);
    // at the floor, a few records above it, and past the whole model (capped)
    for budget in [floor, floor + 3 * rec + 100, floor + 7 * rec, floor + (64 << 20)] {
        let b = budget.to_string();
        let (_, out, err) = waste(&["plan", a, "--budget", &b, "--json"]);
        let plan = serde_json::from_str::<Value>(&out).unwrap();
        let planned = plan["cache_slots"].as_u64().expect("plan slots");
        let (code, out, _) = waste(&["bench", a, "--budget", &b, "-n", "1", "--json"]);
        assert_eq!(code, 0, "{err}");
        let run = serde_json::from_str::<Value>(&out).unwrap();
        let opened = run["cache_slots"].as_u64().expect("bench slots");
        assert_eq!(planned, opened, "budget {budget}: plan says {planned} slots, the engine allocates {opened}");
        seen.push(opened);
        // the chunk and the experts' waves the plan states are the ones a
        // session runs: the buffers' chunk, and waves where the slots
        // cannot pin a layer's experts at once
        let (chunk, wave) = (plan["chunk"].as_u64().unwrap(), &plan["expert_wave"]);
        assert_eq!(plan["prefill_chunk"].as_u64(), Some(chunk), "budget {budget}: {plan}");
        assert_eq!(run["prefill_chunk"].as_u64(), Some(chunk), "budget {budget}: {run}");
        assert_eq!(wave, &run["expert_wave"], "budget {budget}: plan {plan}");
        match wave.as_u64() {
            Some(n) => {
                assert!(n >= 1 && n <= plan["cache_slots"].as_u64().unwrap(), "budget {budget}: {wave}");
                waves = true;
            }
            None => whole |= wave.is_null(),
        }
    }
    // the budgets above buy different caches and chunks (not vacuous)
    seen.dedup();
    assert!(seen.len() >= 3, "{seen:?}");
    assert!(waves && whole, "a cache in waves and one that pins a layer among the budgets");
    // the text says when a chunk's experts come in waves — a span's where
    // the prompt prefills in spans (each expert then read once a span)
    let (code, out, err) = waste(&["plan", a, "--budget", &floor.to_string()]);
    assert_eq!(code, 0, "{err}");
    let (_, js, _) = waste(&["plan", a, "--budget", &floor.to_string(), "--json"]);
    let unit = if serde_json::from_str::<Value>(&js).unwrap()["prefill_span"].is_u64() { "span" } else { "chunk" };
    assert!(out.contains(&format!("a prefill {unit} runs them in waves of")), "{out}");
    assert!(out.contains(&format!("each read once a {unit}")), "{out}");
}

/// The figure `v[key]` names: disk, memory or compute of `[disk, memory, compute]`.
fn named_bound(v: &Value, key: &str, [disk, mem, cores]: [f64; 3]) -> f64 {
    match v[key].as_str() {
        Some("disk") => disk,
        Some("memory") => mem,
        Some("compute") => cores,
        other => panic!("{key} {other:?}: {v}"),
    }
}

/// `bench --json` carries the roofline and the split the speed work is
/// judged by (issue 12's keys, a contract for scripts), and they agree
/// with each other: the roofline is the slower of its disk and memory
/// parts, the share is roofline / measured, the split adds up to no more
/// than the decode time, and the prefaulted bytes fit the budget.
#[test]
fn bench_json_roofline_and_split_are_consistent() {
    let a = anchor();
    let (code, out, err) = waste(&["bench", a.to_str().unwrap(), "-n", "4", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    let f = |k: &str| v[k].as_f64().unwrap_or_else(|| panic!("bench --json lacks {k}: {out}"));
    let (ms, roof, share) = (f("ms_per_token"), f("roofline_ms_per_token"), f("roofline_share"));
    let (disk, mem) = (f("roofline_disk_ms_per_token"), f("roofline_memory_ms_per_token"));
    assert!(ms > 0.0 && roof > 0.0 && mem > 0.0, "{out}");
    assert_eq!(roof, disk.max(mem));
    assert!((share - roof / ms).abs() <= 1e-9 * share.max(1.0), "{out}");
    let split =
        f("expert_ms_per_token") + f("attention_ms_per_token") + f("trunk_ms_per_token") + f("io_wait_ms_per_token");
    assert!(split > 0.0 && split <= ms * 1.0001, "split {split} ms against {ms} ms per token");
    assert!(f("open_seconds") > 0.0 && f("prefill_ms_per_token") > 0.0);
    // the prefill's own roofline, by the same rule; a fresh process has
    // nothing cached, so its prompt's experts were read from disk
    let (p_ms, p_roof, p_share) =
        (f("prefill_ms_per_token"), f("prefill_roofline_ms_per_token"), f("prefill_roofline_share"));
    let (p_disk, p_mem) = (f("prefill_roofline_disk_ms_per_token"), f("prefill_roofline_memory_ms_per_token"));
    assert_eq!(p_roof, p_disk.max(p_mem));
    assert!(p_mem > 0.0 && (p_share - p_roof / p_ms).abs() <= 1e-9 * p_share.max(1.0), "{out}");
    assert!(f("prefill_bytes_read") > 0.0 && f("prefill_hit_rate") < 1.0, "{out}");
    let p_split = f("prefill_expert_ms_per_token")
        + f("prefill_attention_ms_per_token")
        + f("prefill_trunk_ms_per_token")
        + f("prefill_io_wait_ms_per_token");
    assert!(p_split > 0.0 && p_split <= p_ms * 1.0001, "prefill split {p_split} ms against {p_ms} ms per token");
    assert!(f("memory_gbps") > 0.0 && f("memory_gbps_1_thread") > 0.0);
    // the cores' bound: the anchor's matrices and experts at in-cache
    // speed (the experts a part of it); the attainable time is the largest
    // of disk, memory and cores, named by `roofline_bound`
    let (cores, cores_x) = (f("roofline_compute_ms_per_token"), f("roofline_compute_expert_ms_per_token"));
    assert!(cores > cores_x && cores_x > 0.0, "{out}");
    let attain = f("attainable_ms_per_token");
    assert_eq!(attain, disk.max(mem).max(cores));
    assert_eq!(named_bound(&v, "roofline_bound", [disk, mem, cores]), attain, "{out}");
    assert!((f("attainable_share") - attain / ms).abs() <= 1e-9 * attain.max(1.0) / ms, "{out}");
    // the prefill's cores' bound, by the same rule against its own disk and
    // memory figures; the anchor's experts run token by token or batched,
    // so an expert run served at least one token
    let (p_cores, p_cores_x) =
        (f("prefill_roofline_compute_ms_per_token"), f("prefill_roofline_compute_expert_ms_per_token"));
    assert!(p_cores > p_cores_x && p_cores_x > 0.0, "{out}");
    assert!(f("prefill_tokens_per_expert_run") >= 1.0, "{out}");
    let p_attain = f("prefill_attainable_ms_per_token");
    assert_eq!(p_attain, p_disk.max(p_mem).max(p_cores));
    assert_eq!(named_bound(&v, "prefill_roofline_bound", [p_disk, p_mem, p_cores]), p_attain, "{out}");
    assert!((f("prefill_attainable_share") - p_attain / p_ms).abs() <= 1e-9 * p_attain.max(1.0) / p_ms, "{out}");
    assert!(v["prefaulted_bytes"].is_u64() && f("prefaulted_bytes") <= f("budget_bytes"), "{out}");
    // the huge pages the OS granted: whole 2 MiB pages, inside the budget
    // (Linux; no figure where there is no smaps_rollup)
    if std::path::Path::new("/proc/self/smaps_rollup").exists() {
        let h = v["huge_page_bytes"].as_u64().unwrap_or_else(|| panic!("{out}"));
        assert!(h.is_multiple_of(2 << 20) && h <= v["budget_bytes"].as_u64().unwrap(), "{out}");
    } else {
        assert!(v["huge_page_bytes"].is_null(), "{out}");
    }
    assert!(v["simd"].is_string() && v["kda_chunked"].is_boolean());
    // the anchor's VQ3R experts and the kernel that sums their rows here
    let ek = v["expert_kernel"].as_str().unwrap_or_else(|| panic!("{out}"));
    assert!(ek.starts_with("vq3r ") && ek.len() > 5, "{out}");
    // the prompt again, three times by default: a median of real timings
    assert_eq!(v["prefill_warm_runs"].as_u64(), Some(3), "{out}");
    assert!(f("prefill_warm_ms_per_token") > 0.0, "{out}");
}

/// `--prefill-repeats 0` skips the repeated prefills (no warm figure, not
/// 0 ms); a count past the bound is refused.
#[test]
fn bench_prefill_repeats_zero_and_past_the_bound() {
    let a = anchor();
    let (code, out, err) = waste(&["bench", a.to_str().unwrap(), "-n", "1", "--prefill-repeats", "0", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert!(v["prefill_warm_ms_per_token"].is_null() && v["prefill_warm_runs"] == 0, "{out}");
    // a count past the bound is an error naming it, before anything runs
    let (code, _, err) = waste(&["bench", a.to_str().unwrap(), "--prefill-repeats", "18446744073709551615"]);
    assert!(code != 0 && err.contains("--prefill-repeats") && err.contains("at most 1000"), "{err}");
}

/// `bench --parallel N` decodes N sequences together: its JSON counts N
/// tokens a step, a union of experts no larger than the uses, the keys the
/// issue names; `--parallel 0` and more than the cache can pin are refused.
#[test]
fn bench_parallel_reports_the_batch() {
    let a = anchor();
    let a = a.to_str().unwrap();
    let (code, out, err) =
        waste(&["bench", a, "-n", "3", "--parallel", "3", "--budget", "64M", "--ctx", "256", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    let f = |k: &str| v[k].as_f64().unwrap_or_else(|| panic!("bench --parallel --json lacks {k}: {out}"));
    assert_eq!((v["parallel"].as_u64(), v["decode_tokens"].as_u64()), (Some(3), Some(9)), "{out}");
    assert!(f("experts_per_token") > 0.0 && f("experts_per_token") <= f("expert_uses_per_token"), "{out}");
    assert!((f("tok_per_s") - 3.0 * f("tok_per_s_per_stream")).abs() <= 1e-6 * f("tok_per_s"), "{out}");
    for k in [
        "ms_per_step",
        "expert_reads_per_token",
        "io_wait_ms_per_step",
        "roofline_ms_per_token",
        "attainable_ms_per_token",
    ] {
        f(k);
    }
    assert!(["disk", "memory", "compute"].contains(&v["roofline_bound"].as_str().unwrap_or("")), "{out}");
    // the router lookahead in use and what its guesses read and served
    assert!(v["lookahead"].is_u64() && f("prefetch_used") <= f("prefetch_issued"), "{out}");
    // `plan` at the same budget names the same batch and lookahead as the
    // open: the anchor's 24 experts all cached (no lookahead), and 16 of
    // them (the floor at the smallest chunk and 12 records: a lookahead of
    // top-k = 2)
    let plan = |budget: &str| {
        let (code, out, err) = waste(&["plan", a, "--parallel", "3", "--budget", budget, "--ctx", "256", "--json"]);
        assert_eq!(code, 0, "{err}");
        serde_json::from_str::<Value>(&out).unwrap()
    };
    let floor = plan("64M")["resident_floor_bytes"].as_u64().unwrap();
    let partial = (floor + 12 * plan("64M")["expert_record_bytes"].as_u64().unwrap()).to_string();
    for (budget, lookahead) in [("64M", 0), (partial.as_str(), 2)] {
        let p = plan(budget);
        let args = ["bench", a, "-n", "1", "--parallel", "3", "--budget", budget, "--ctx", "256", "--json"];
        let (code, out, err) = waste(&args);
        assert_eq!(code, 0, "{err}");
        let run: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(p["lookahead"], lookahead, "{budget}: plan {p}");
        assert_eq!(p["max_parallel"], run["max_batch"], "{budget}: plan {p}\nbench {run}");
        assert_eq!(p["lookahead"], run["lookahead"], "{budget}");
        assert_eq!(p["cache_slots"], run["cache_slots"], "{budget}");
        // the halves in turn: off with every expert cached, else measured
        // (one batch first, then each form in turn); --halves forces either
        let (halves, steps) = if lookahead == 0 { (json!(false), 0) } else { (json!("measured"), 0) };
        assert_eq!((&run["halves"], run["halves_steps"].as_u64()), (&halves, Some(steps)), "{budget}: {run}");
        assert_eq!(p["halves"], halves, "{budget}: plan {p}");
    }
    let args = ["bench", a, "-n", "3", "--parallel", "2", "--budget", &partial, "--ctx", "256", "--json"];
    for (force, steps) in [("on", 3), ("off", 0)] {
        let (code, out, err) = waste(&[&args[..], &["--halves", force]].concat());
        assert_eq!(code, 0, "{err}");
        let run: Value = serde_json::from_str(&out).unwrap();
        assert_eq!((&run["halves"], run["halves_steps"].as_u64()), (&json!(force == "on"), Some(steps)), "{run}");
    }
    let (code, _, err) = waste(&[&args[..], &["--halves", "maybe"]].concat());
    assert!(code != 0 && err.contains("expected on or off"), "{err}");
    for n in ["0", "17", "18446744073709551615"] {
        let (code, _, err) = waste(&["bench", a, "--parallel", n]);
        assert!(code != 0 && err.contains(&format!("--parallel {n}: 1 to 16")), "{err}");
        let (code, _, err) = waste(&["plan", a, "--parallel", n]);
        assert!(code != 0 && err.contains(&format!("--parallel {n}: 1 to 16")), "{err}");
    }
    let (code, _, err) = waste(&["bench", a, "--parallel", "16", "--budget", "20M", "--ctx", "128"]);
    assert!(code != 0 && err.contains("--parallel 16") && err.contains("raise --budget"), "{err}");
}

/// `WASTE_VQ_ROWS` overrides the probe's choice of the AVX2 VQ row kernel
/// (the gathers or scalar loads), `bench --json` names what runs, and the
/// logits do not change with the form or the level.
#[test]
fn expert_kernel_is_named_and_every_form_gives_the_same_logits() {
    let a = anchor();
    let run = |simd: &str, rows: &str, args: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_waste"))
            .args(args)
            .env("WASTE_SIMD", simd)
            .env("WASTE_VQ_ROWS", rows)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice::<Value>(&o.stdout).unwrap()
    };
    // the exact mode's VQ kernels (the fast mode names its own: cli_text's numeric test)
    let ids = ["eval", a.to_str().unwrap(), "--ids", "1,2,3,4,5", "--logits", "--json", "--exact"];
    let want = run("scalar", "loads", &ids)["logits"].clone();
    assert!(want.as_array().is_some_and(|l| !l.is_empty()), "{want}");
    let bench = ["bench", a.to_str().unwrap(), "-n", "1", "--prefill-repeats", "0", "--json", "--exact"];
    assert_eq!(run("scalar", "vector", &bench)["expert_kernel"], "vq3r scalar-loads");
    if !cfg!(target_arch = "x86_64") || !waste_has_avx2() {
        // AVX2 is a required level on x86_64 (as in waste-quant's suites)
        skip::report_skip("expert kernel forms at AVX2 (no AVX2 here)", cfg!(target_arch = "x86_64"));
        return;
    }
    for (rows, name) in [("vector", "vq3r avx2-gather"), ("loads", "vq3r scalar-loads")] {
        assert_eq!(run("avx2", rows, &bench)["expert_kernel"], name, "WASTE_VQ_ROWS={rows}");
        assert_eq!(run("avx2", rows, &ids)["logits"], want, "WASTE_VQ_ROWS={rows}");
    }
}

/// Whether the CPU has the AVX2 level (as `waste version --json` reports).
fn waste_has_avx2() -> bool {
    let (_, out, _) = waste(&["version", "--json"]);
    let v: Value = serde_json::from_str(&out).unwrap();
    v["simd_available"].as_array().is_some_and(|l| l.iter().any(|x| x == "avx2"))
}

/// Things that are not containers get an error that says what they are and
/// what to do (a GGUF file, any other file, a Hugging Face folder), and
/// `verify` on them exits 1 (an error), not 3 (damage found).
#[test]
fn not_a_container_says_what_it_is() {
    let d = std::env::temp_dir().join(format!("waste-not-a-container-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    let gguf = d.join("model.gguf");
    std::fs::write(&gguf, b"GGUF\x03\x00\x00\x00rest").unwrap();
    let other = d.join("notes.txt");
    std::fs::write(&other, b"hello").unwrap();
    let hf = d.join("hf");
    std::fs::create_dir_all(&hf).unwrap();
    std::fs::write(hf.join("config.json"), b"{}").unwrap();
    for (p, want) in [(&gguf, "a GGUF file"), (&other, "a file, not a WASTE container"), (&hf, "Hugging Face")] {
        let ps = p.to_str().unwrap();
        let (code, _, err) = waste(&["info", ps]);
        assert_eq!(code, 1, "{err}");
        assert!(err.contains(want) && err.contains("waste convert"), "{err}");
        let (code, _, err) = waste(&["verify", ps]);
        assert_eq!(code, 1, "verify {ps}: {err}");
    }
    let (code, _, err) = waste(&["verify", d.join("missing").to_str().unwrap()]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("nothing there"), "{err}");
    std::fs::remove_dir_all(&d).ok();
}

/// Every size flag takes the same sizes (`64K`, `4M`, or bytes); a bad one
/// is refused saying what a size is (not "0 = automatic" where 0 is not
/// allowed); a budget past usable RAM is taken with a warning that says so.
#[test]
fn size_flags_take_units_and_a_budget_past_ram_warns() {
    let a = anchor();
    let bank = a.join("experts-L1.bin");
    let (code, out, err) =
        waste(&["diskbench", bank.to_str().unwrap(), "--record-size", "64K", "--max-bytes", "1M", "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["record_size"], 65536, "{out}");
    let (code, _, err) = waste(&["serve", a.to_str().unwrap(), "--request-memory", "abc"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("is not a size") && !err.contains("automatic"), "{err}");
    let (code, _, err) = waste(&["serve", a.to_str().unwrap(), "--body-limit", "1.5Q"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--body-limit") && err.contains("is not a size"), "{err}");
    let (code, out, err) = waste(&["plan", a.to_str().unwrap(), "--budget", "10T"]);
    assert_eq!(code, 0, "{err}");
    assert!(format!("{out}{err}").contains("exceeds usable RAM"), "{out}{err}");
    // more bytes than a u64 holds: refused, not taken as u64::MAX
    let (code, _, err) = waste(&["plan", a.to_str().unwrap(), "--budget", "99999999999999999999"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("is not a size"), "{err}");
    // a chunk of 0 tokens: refused, not run token by token unannounced
    let (code, _, err) = waste(&["eval", a.to_str().unwrap(), "--ids", "1,2,3", "--chunk", "0"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--chunk") && err.contains("at least 1"), "{err}");
}

/// `waste plan` below the floor (issue 48) on a manifest with Kimi K3's
/// shape: at 16 and 28 GiB a split and an estimate instead of an error
/// (the keys are a contract for scripts), the estimate the bytes a token
/// reads at the given disk speed; below the lowest split, an error naming
/// that floor.
#[test]
fn plan_below_the_floor_prints_a_split_and_an_estimate() {
    let dir = std::env::temp_dir().join(format!("waste-cli-k3-split-{}", std::process::id()));
    let o = waste_synth::SynthOptions {
        config: waste_synth::shape_config("k3").unwrap(),
        layers: None,
        experts: waste_model::format::ExpertFmt::Vq3r,
        seed: 0,
        manifest_only: true,
        skewed: false,
        jobs: 2,
    };
    waste_synth::synth(&dir, &o, &|_, _| {}).unwrap();
    let d = dir.to_str().unwrap();
    let (code, out, err) = waste(&["plan", d, "--json"]);
    assert_eq!(code, 0, "{err}");
    let resident: Value = serde_json::from_str(&out).unwrap();
    let floor = resident["resident_floor_bytes"].as_u64().unwrap();
    // the automatic budget streams only on a machine below the floor
    let below = resident["usable_ram_bytes"].as_u64().unwrap() < floor;
    let streams = resident["streamed_layers"].as_u64().unwrap() > 0 || resident["streamed_head"] == true;
    assert_eq!(streams, below, "{resident}");
    for budget in ["16G", "28G"] {
        let (code, out, err) = waste(&["plan", d, "--budget", budget, "--disk-gbps", "3.2", "--json"]);
        assert_eq!(code, 0, "{budget}: {err} {out}");
        let v: Value = serde_json::from_str(&out).unwrap();
        assert!(v["ok"].as_bool().unwrap() && v["resident_floor_bytes"].as_u64() == Some(floor), "{v}");
        assert!(v["floor_bytes"].as_u64().unwrap() <= v["budget_bytes"].as_u64().unwrap(), "{v}");
        let n = v["streamed_layer_ids"].as_array().unwrap().len() as u64;
        assert!(n == v["streamed_layers"].as_u64().unwrap() && (n > 0 || v["streamed_head"] == true), "{v}");
        let read = v["read_bytes_per_token"].as_f64().unwrap();
        assert!(read >= v["trunk_read_bytes_per_token"].as_f64().unwrap() && read > 0.0, "{v}");
        let ms = v["ms_per_token_estimate"].as_f64().unwrap();
        assert!((ms - read / 3.2e9 * 1e3).abs() < 1e-6 * ms, "{v}");
        let (code, text, _) = waste(&["plan", d, "--budget", budget, "--disk-gbps", "3.2"]);
        assert_eq!(code, 0);
        assert!(text.contains("stream from disk") && text.contains("ms/token"), "{text}");
    }
    let (code, out, _) = waste(&["plan", d, "--budget", "1G"]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("every decoder layer and the head streamed"), "{out}");
    let (code, _, err) = waste(&["plan", d, "--budget", "16G", "--disk-gbps", "0"]);
    assert!(code != 0 && err.contains("--disk-gbps"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}
