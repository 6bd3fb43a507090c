//! The RAM budget is a hard ceiling, and the test can tell: `waste bench` on
//! a container whose experts are several times the budget, with the cache
//! filled to its last slot at open (a usage hotlist naming every expert), at
//! two budgets. Each run's peak RSS (the OS's, `wait4` of that child) stays at
//! or under its budget plus a stated slack, and the two budgets' peaks (each
//! the lower of two runs) differ by the budgets' difference within a stated
//! margin — a cache over its budget, or one never filled, fails.

#![cfg(target_os = "linux")] // peak RSS by wait4 / ru_maxrss in kilobytes: Linux

use std::process::Command;
use waste_model::format::{ExpertFmt, Usage, UsageEntry};
use waste_synth::{synth, SynthOptions};

/// Slack over the budget: the binary's mapped code and data, the C runtime,
/// thread stacks and allocator overhead — none of which the engine plans.
/// The cache difference below (~38 MB) is several times this.
const RSS_SLACK_BYTES: u64 = 16 << 20;
/// How far the peak-RSS difference may stray from the budget difference
/// (slot rounding of the cache arena to 2 MiB pages, allocator noise).
const TRACK_MARGIN_BYTES: u64 = 6 << 20;

/// Run `waste` with `args` and return (stdout, that child's peak RSS in bytes).
#[cfg(target_os = "linux")]
#[allow(clippy::zombie_processes)] // reaped by wait4 below, which std's Child cannot see
fn run_measured(args: &[&str]) -> (String, u64) {
    use std::io::Read;
    let mut child =
        Command::new(env!("CARGO_BIN_EXE_waste")).args(args).stdout(std::process::Stdio::piped()).spawn().unwrap();
    let mut out = String::new();
    child.stdout.take().unwrap().read_to_string(&mut out).unwrap();
    let mut status = 0;
    // SAFETY: wait4 on our own child writes the status and the struct we own.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    let pid = unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut ru) };
    assert_eq!(pid, child.id() as i32);
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "waste {args:?} failed");
    (out, ru.ru_maxrss as u64 * 1024) // kilobytes on Linux
}

/// A synthetic VQ3R container of `config` in `dir`.
fn synth_vq3r(dir: &std::path::Path, config: serde_json::Value, seed: u64) {
    let o = SynthOptions {
        config,
        layers: None,
        experts: ExpertFmt::Vq3r,
        seed,
        manifest_only: false,
        skewed: false,
        jobs: 2,
    };
    synth(dir, &o, &|_, _| {}).unwrap();
}

#[test]
#[cfg(target_os = "linux")]
fn bench_peak_rss_stays_under_the_budget_and_tracks_it() {
    let dir = std::env::temp_dir().join(format!("waste-rss-{}", std::process::id()));
    let config = serde_json::json!({"model_type": "kimi_linear", "hidden_size": 512, "num_hidden_layers": 3, "first_k_dense_replace": 0,
        "moe_intermediate_size": 1024, "num_experts": 64, "num_experts_per_token": 4, "num_shared_experts": 1, "routed_scaling_factor": 1.0,
        "num_attention_heads": 4, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "kv_lora_rank": 64, "vocab_size": 512,
        "rms_norm_eps": 1e-5, "bos_token_id": 256, "eos_token_id": 257,
        "linear_attn_config": {"head_dim": 64, "num_heads": 4, "short_conv_kernel_size": 4, "kda_layers": [1, 3], "full_attn_layers": [2]}});
    synth_vq3r(&dir, config, 3);
    // a hotlist naming every expert: the cache preloads until it is full
    let entries = (0..3u16)
        .flat_map(|l| (0..64u16).map(move |e| UsageEntry { layer: l, expert: e, hits: 1000 - e as u32, last_seen: 1 }))
        .collect();
    std::fs::write(dir.join("usage.waste"), Usage { total_tokens: 1000, entries }.encode()).unwrap();
    let d = dir.to_str().unwrap();
    let (plan, _) = run_measured(&["plan", d, "--ctx", "512", "--json"]);
    let plan: serde_json::Value = serde_json::from_str(&plan).unwrap();
    let floor = plan["floor_bytes"].as_u64().unwrap();
    let rec = plan["expert_record_bytes"].as_u64().unwrap();
    let experts_bytes = 3 * 64 * rec;
    let mut peaks = vec![];
    for records in [24u64, 120] {
        let budget = floor + records * rec;
        assert!(experts_bytes > budget, "experts {experts_bytes} should exceed the budget {budget}");
        let b = budget.to_string();
        // every run keeps the ceiling; the tracking compares each budget's
        // lower peak of two runs (one CI run under load read a peak ~13 MB
        // off its usual value, once in dozens: a transient the ceiling's
        // slack absorbs but the 6 MB tracking margin does not)
        let mut low = u64::MAX;
        for _ in 0..2 {
            let (out, rss) =
                run_measured(&["bench", d, "--budget", &b, "--ctx", "512", "-n", "8", "--prompt-len", "20", "--json"]);
            let v: serde_json::Value = serde_json::from_str(&out).unwrap();
            let slots = v["cache_slots"].as_u64().unwrap();
            assert!(v["preloaded"].as_u64().unwrap() >= slots, "the cache was not filled: {v}");
            eprintln!("budget {budget} bytes ({slots} slots), peak RSS {rss} bytes");
            assert!(rss <= budget + RSS_SLACK_BYTES, "peak RSS {rss} > budget {budget} + slack {RSS_SLACK_BYTES}");
            low = low.min(rss);
        }
        peaks.push((budget, low));
    }
    let (db, dr) = (peaks[1].0 - peaks[0].0, peaks[1].1 as i64 - peaks[0].1 as i64);
    assert!(
        (dr - db as i64).unsigned_abs() <= TRACK_MARGIN_BYTES,
        "peak RSS grew {dr} bytes for {db} more bytes of budget (margin {TRACK_MARGIN_BYTES})"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Below the resident floor (issue 48) the ceiling holds too: a container
/// whose trunk (8 layers at hidden 1024, a 32768-row head) is several times
/// the slack, at a budget so far below its floor that a resident trunk
/// would break the ceiling; the run streams layers and the head, and its
/// peak RSS stays within the budget plus the slack.
#[test]
#[cfg(target_os = "linux")]
fn below_the_floor_peak_rss_stays_under_the_budget() {
    let dir = std::env::temp_dir().join(format!("waste-rss-below-{}", std::process::id()));
    let config = serde_json::json!({"model_type": "kimi_linear", "hidden_size": 1024, "num_hidden_layers": 8, "first_k_dense_replace": 1,
        "intermediate_size": 2048, "moe_intermediate_size": 512, "num_experts": 16, "num_experts_per_token": 2, "num_shared_experts": 1,
        "routed_scaling_factor": 1.0, "num_attention_heads": 8, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64,
        "kv_lora_rank": 256, "vocab_size": 32768, "rms_norm_eps": 1e-5, "bos_token_id": 256, "eos_token_id": 257,
        "linear_attn_config": {"head_dim": 64, "num_heads": 8, "short_conv_kernel_size": 4, "kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8]}});
    synth_vq3r(&dir, config, 5);
    let d = dir.to_str().unwrap();
    let plan = |budget: u64| -> serde_json::Value {
        let b = budget.to_string();
        serde_json::from_str(
            &run_measured(&["plan", d, "--ctx", "512", "--json", "--budget", &b, "--disk-gbps", "1"]).0,
        )
        .unwrap()
    };
    let floor = plan(0)["floor_bytes"].as_u64().unwrap();
    let budget = floor - 2 * RSS_SLACK_BYTES;
    assert!(budget + RSS_SLACK_BYTES < floor, "the test needs a resident trunk that would break the ceiling");
    let p = plan(budget);
    eprintln!("resident floor {floor}, budget {budget}: {p}");
    assert!(p["ok"].as_bool().unwrap(), "{p}");
    assert!(p["streamed_layers"].as_u64().unwrap() > 0, "{p}");
    let b = budget.to_string();
    let (out, rss) =
        run_measured(&["bench", d, "--budget", &b, "--ctx", "512", "-n", "8", "--prompt-len", "20", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    eprintln!("peak RSS {rss} bytes at budget {budget} (resident floor {floor})");
    assert!(v["trunk_bytes_read_per_token"].as_f64().unwrap() > 0.0, "{v}");
    assert!(rss <= budget + RSS_SLACK_BYTES, "peak RSS {rss} > budget {budget} + slack {RSS_SLACK_BYTES}");
    std::fs::remove_dir_all(&dir).ok();
}
