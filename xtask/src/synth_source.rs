//! `cargo xtask synth-source`: a synthetic Hugging Face-style source (bf16
//! or MXFP4 experts) at real expert shapes, to measure conversion speed
//! without downloading anything.

use anyhow::{bail, Result};
use std::io::Write;
use std::path::Path;
use waste_format::half::f32_to_bf16;
use waste_quant::SplitMix64 as Rng;

/// Write `config.json` + `model.safetensors` with `experts` experts in one
/// MoE layer into `out`: absent, empty, or synthetic output written before
/// (anything else is refused untouched).
pub fn run(out: &Path, shape: &str, experts: usize, mxfp4: bool, seed: u64) -> Result<()> {
    let (hidden, inter, latent) = match shape {
        "kimi-linear" => (2304usize, 1024usize, None),
        "k3" => (7168, 3072, Some(3584usize)),
        o => bail!("unknown --shape {o:?} (kimi-linear, k3)"),
    };
    let lat = latent.unwrap_or(hidden);
    // never over a real checkpoint: only an empty folder or our own output
    waste_synth::clear_own(out)?;
    std::fs::create_dir_all(out)?;
    std::fs::write(out.join(waste_synth::SYNTH_MARKER), "synth-source")?;
    let mut cfg = serde_json::json!({"model_type": "kimi_linear", "hidden_size": hidden, "num_hidden_layers": 1, "first_k_dense_replace": 0,
        "moe_intermediate_size": inter, "num_experts": experts, "num_experts_per_token": 2, "num_shared_experts": 0, "vocab_size": 256,
        "rms_norm_eps": 1e-5, "num_attention_heads": 1, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "kv_lora_rank": 16,
        "linear_attn_config": {"head_dim": 16, "num_heads": 1, "kda_layers": [1], "full_attn_layers": []}});
    if let Some(l) = latent {
        cfg["routed_expert_hidden_size"] = l.into();
    }
    std::fs::write(out.join("config.json"), serde_json::to_string_pretty(&cfg)?)?;
    let c = waste_format::ModelConfig::from_json(&cfg)?;
    // header first: every tensor's dtype, shape, offsets
    let mut tensors: Vec<(String, &str, Vec<usize>, usize)> = Vec::new();
    for r in waste_format::required_tensors(&c) {
        let shape = match r.expect {
            waste_format::Expect::Mat(a, b) => vec![a, b],
            _ => vec![r.expect.numel()],
        };
        let n: usize = shape.iter().product();
        tensors.push((r.name.clone(), "BF16", shape, n * 2));
    }
    for e in 0..experts {
        for (w, rows, cols) in [("w1", inter, lat), ("w3", inter, lat), ("w2", lat, inter)] {
            let base = format!("model.layers.0.block_sparse_moe.experts.{e}.{w}");
            if mxfp4 {
                tensors.push((format!("{base}.weight_packed"), "U8", vec![rows, cols / 2], rows * cols / 2));
                tensors.push((format!("{base}.weight_scale"), "U8", vec![rows, cols / 32], rows * cols / 32));
            } else {
                tensors.push((format!("{base}.weight"), "BF16", vec![rows, cols], rows * cols * 2));
            }
        }
    }
    let mut header = serde_json::Map::new();
    let mut off = 0usize;
    for (n, dt, shape, bytes) in &tensors {
        header.insert(n.clone(), serde_json::json!({"dtype": dt, "shape": shape, "data_offsets": [off, off + bytes]}));
        off += bytes;
    }
    let mut h = serde_json::to_vec(&header)?;
    while h.len() % 8 != 0 {
        h.push(b' ');
    }
    let mut f = std::io::BufWriter::with_capacity(8 << 20, std::fs::File::create(out.join("model.safetensors"))?);
    f.write_all(&(h.len() as u64).to_le_bytes())?;
    f.write_all(&h)?;
    let mut rng = Rng::new(seed);
    for (n, dt, shape, bytes) in &tensors {
        if *dt == "U8" {
            let mut b = vec![0u8; *bytes];
            if n.ends_with("weight_scale") {
                b.iter_mut().for_each(|x| *x = 118 + (rng.next_u64() % 4) as u8);
            } else {
                rng.fill(&mut b);
            }
            f.write_all(&b)?;
        } else {
            let std = 1.0 / (*shape.last().unwrap_or(&1) as f32).sqrt();
            let is_norm = n.contains("norm");
            for _ in 0..bytes / 2 {
                let v = if is_norm { 1.0 } else { std * rng.gauss() };
                f.write_all(&f32_to_bf16(v).to_le_bytes())?;
            }
        }
    }
    f.flush()?;
    Ok(())
}
