//! The RAM budget is a hard ceiling: `waste bench` on a container whose
//! experts are ~5× the budget keeps its peak RSS (measured by the OS,
//! getrusage of the child) at or under the budget plus a stated slack.

use std::process::Command;
use waste_model::format::ExpertFmt;
use waste_synth::{synth, SynthOptions};

/// Slack over the budget: the binary's mapped code and data, the C runtime,
/// thread stacks and allocator overhead — none of which the engine allocates.
const RSS_SLACK_BYTES: u64 = 16 << 20;

fn child_peak_rss() -> u64 {
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes into the struct we own.
    unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru) };
    ru.ru_maxrss as u64 * 1024 // kilobytes on Linux
}

#[test]
#[cfg(target_os = "linux")]
fn bench_peak_rss_stays_under_the_budget() {
    let dir = std::env::temp_dir().join(format!("waste-rss-{}", std::process::id()));
    let config = serde_json::json!({"model_type": "kimi_linear", "hidden_size": 512, "num_hidden_layers": 3, "first_k_dense_replace": 0,
        "moe_intermediate_size": 1024, "num_experts": 64, "num_experts_per_token": 4, "num_shared_experts": 1, "routed_scaling_factor": 1.0,
        "num_attention_heads": 4, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "kv_lora_rank": 64, "vocab_size": 512,
        "rms_norm_eps": 1e-5, "bos_token_id": 256, "eos_token_id": 257,
        "linear_attn_config": {"head_dim": 64, "num_heads": 4, "short_conv_kernel_size": 4, "kda_layers": [1, 3], "full_attn_layers": [2]}});
    let o = SynthOptions {
        config,
        layers: None,
        experts: ExpertFmt::Vq3r,
        seed: 3,
        manifest_only: false,
        skewed: false,
        jobs: 2,
    };
    synth(&dir, &o, &|_, _| {}).unwrap();
    let waste = env!("CARGO_BIN_EXE_waste");
    let plan_out =
        Command::new(waste).args(["plan", dir.to_str().unwrap(), "--ctx", "512", "--json"]).output().unwrap();
    let plan: serde_json::Value = serde_json::from_slice(&plan_out.stdout).unwrap();
    let floor = plan["floor_bytes"].as_u64().unwrap();
    let rec = plan["expert_record_bytes"].as_u64().unwrap();
    let budget = floor + 24 * rec;
    let experts_bytes = 3 * 64 * rec;
    assert!(experts_bytes > 4 * budget, "experts {experts_bytes} should be several times the budget {budget}");
    let out = Command::new(waste)
        .args([
            "bench",
            dir.to_str().unwrap(),
            "--budget",
            &budget.to_string(),
            "--ctx",
            "512",
            "-n",
            "12",
            "--prompt-len",
            "20",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["experts_missed"].as_u64().unwrap() > 0, "the run must stream experts");
    let rss = child_peak_rss();
    eprintln!("budget {budget} bytes, peak RSS {rss} bytes, experts on disk {experts_bytes} bytes");
    assert!(rss <= budget + RSS_SLACK_BYTES, "peak RSS {rss} > budget {budget} + slack {RSS_SLACK_BYTES}");
    std::fs::remove_dir_all(&dir).ok();
}
