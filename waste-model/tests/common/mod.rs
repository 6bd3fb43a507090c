//! Shared by the oracle tests: the worst relative error of a container
//! against reference logits, and copies of a container perturbed by the size
//! of a real bug (negative controls: a bound that such a copy still meets
//! could not catch that bug).

use serde_json::Value;
use std::path::{Path, PathBuf};
use waste_model::{Model, ModelOptions};

/// Worst over positions of max |ours − reference| / max |reference|,
/// evaluating `ids` one token at a time.
pub fn worst_rel(container: &Path, ids: &[u32], want: &[Vec<f32>], ctx: usize) -> f32 {
    let m = Model::open(container, ModelOptions { ctx, threads: 2, ..Default::default() }).unwrap();
    let mut s = m.session();
    let mut worst = 0f32;
    for (p, &t) in ids.iter().enumerate() {
        let got = s.eval(&[t]).unwrap();
        let max_abs = got.iter().zip(&want[p]).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        let max_ref = want[p].iter().fold(0f32, |a, b| a.max(b.abs()));
        worst = worst.max(max_abs / max_ref);
    }
    worst
}

/// A copy of a container in a fresh temporary folder.
pub fn copy_container(src: &Path, tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("waste-perturb-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), d.join(e.file_name())).unwrap();
    }
    d
}

/// The copy's `rms_norm_eps` multiplied by `factor` (an epsilon bug).
pub fn scale_eps(dir: &Path, factor: f64) {
    let p = dir.join("manifest.json");
    let mut m: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    let eps = m["config"]["rms_norm_eps"].as_f64().unwrap_or(1e-6);
    m["config"]["rms_norm_eps"] = Value::from(eps * factor);
    std::fs::write(&p, serde_json::to_vec(&m).unwrap()).unwrap();
}

/// The copy's F32 tensor `name` multiplied by `factor` (a scale bug; on the
/// final norm it moves the logits by `factor − 1` relative).
pub fn scale_tensor(dir: &Path, name: &str, factor: f32) {
    edit_f32(dir, name, |v| v * factor);
}

fn edit_f32(dir: &Path, name: &str, f: impl Fn(f32) -> f32) -> usize {
    let m: Value = serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap();
    let t = m["trunk"].as_array().unwrap().iter().find(|t| t["name"].as_str().unwrap().ends_with(name)).unwrap();
    assert_eq!(t["fmt"], 0, "{name} must be stored as F32");
    let off = t["off"].as_u64().unwrap() as usize;
    let n: usize = t["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap() as usize).product();
    let p = dir.join("trunk.bin");
    let mut b = std::fs::read(&p).unwrap();
    let mut changed = 0;
    for c in b[off..off + 4 * n].chunks_exact_mut(4) {
        let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        let r = f(v);
        changed += (r.to_bits() != v.to_bits()) as usize;
        c.copy_from_slice(&r.to_le_bytes());
    }
    std::fs::write(&p, b).unwrap();
    changed
}

/// The copy's F32 tensor `name` rounded to bf16 (round to nearest even), as
/// a converter that stored it at 16 bits would leave it.
/// Returns how many values changed (none when the weights came from a bf16
/// source: then this bug cannot happen to them).
pub fn round_to_bf16(dir: &Path, name: &str) -> usize {
    edit_f32(dir, name, |v| {
        let bits = v.to_bits();
        f32::from_bits(bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) & 0xFFFF_0000)
    })
}

/// The negative controls for a fixture: each perturbed copy must miss
/// `bound`, else the bound could not catch a bug of that size — an epsilon
/// ×10, a bf16-rounded weight, and (the finest) the final norm scaled by
/// `1 + 2·bound`, which moves the logits by about twice the bound.
pub fn negative_controls(container: &Path, tag: &str, ids: &[u32], want: &[Vec<f32>], ctx: usize, bound: f32) {
    let eps = copy_container(container, &format!("{tag}-eps"));
    scale_eps(&eps, 10.0);
    let e = worst_rel(&eps, ids, want, ctx);
    assert!(e > bound, "{tag}: rms_norm_eps ×10 stays within the bound {bound:.1e} (worst {e:.2e})");
    let bf = copy_container(container, &format!("{tag}-bf16"));
    let b = if round_to_bf16(&bf, "model.norm.weight") > 0 {
        let b = worst_rel(&bf, ids, want, ctx);
        assert!(b > bound, "{tag}: a bf16-rounded final norm stays within the bound {bound:.1e} (worst {b:.2e})");
        b
    } else {
        eprintln!("{tag}: the final norm is bf16-exact already (a bf16 source): no bf16 control");
        f32::NAN
    };
    let fine = copy_container(container, &format!("{tag}-scale"));
    scale_tensor(&fine, "model.norm.weight", 1.0 + 2.0 * bound);
    let f = worst_rel(&fine, ids, want, ctx);
    assert!(
        f > bound,
        "{tag}: the final norm scaled by 1 + {:.1e} stays within the bound {bound:.1e} (worst {f:.2e})",
        2.0 * bound
    );
    eprintln!("{tag}: negative controls: eps×10 → {e:.2e}, bf16 norm → {b:.2e}, norm ×(1+2·bound) → {f:.2e} (bound {bound:.1e})");
    for d in [&eps, &bf, &fine] {
        std::fs::remove_dir_all(d).ok();
    }
}

/// The K3 features every K3 fixture must have switched on (a converter or
/// loader that silently drops one would otherwise pass on the rest).
#[allow(dead_code)] // not every test crate including this module checks K3
pub fn assert_k3_features(m: &Model) {
    let c = m.config();
    assert!(c.latent.is_some(), "latent MoE");
    assert!(c.attn_res_block.is_some(), "attention residuals");
    assert!(c.q_lora.is_some(), "q-LoRA");
    assert!(c.mla_output_gate, "MLA output gate");
    assert!(c.kda_full_rank_gate, "full-rank KDA gate");
    assert_eq!(c.shared_experts, 2, "shared experts");
}
