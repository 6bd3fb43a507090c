//! Shared by the oracle tests: the committed fixtures (reference runs,
//! containers), the relative error of logits against a reference, and copies of a container perturbed by the size
//! of a real bug (negative controls: a bound that such a copy still meets
//! could not catch that bug).
#![allow(dead_code)] // each test crate including this module uses part of it

use serde_json::Value;
use std::path::{Path, PathBuf};
use waste_model::{Model, ModelOptions};

/// The committed oracle fixtures (`tools/oracle/fixtures`).
pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tools/oracle/fixtures")
}

/// A reference run: the prompt ids, the logits at every position, the
/// greedy continuation (`NAME.logits.json`).
pub struct Reference {
    /// Prompt ids.
    pub ids: Vec<u32>,
    /// Logits after each prompt position.
    pub logits: Vec<Vec<f32>>,
    /// Greedy continuation after the prompt.
    pub greedy: Vec<u32>,
}

/// `NAME.logits.json` of the fixtures.
pub fn reference(name: &str) -> Reference {
    let f: Value =
        serde_json::from_slice(&std::fs::read(fixtures().join(format!("{name}.logits.json"))).unwrap()).unwrap();
    let ids = |k: &str| -> Vec<u32> { f[k].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect() };
    let row = |r: &Value| -> Vec<f32> { r.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect() };
    Reference {
        ids: ids("ids"),
        logits: f["logits"].as_array().unwrap().iter().map(row).collect(),
        greedy: ids("greedy"),
    }
}

/// The fixture container `NAME.waste`, two threads.
pub fn open_fixture(name: &str, ctx: usize) -> Model {
    Model::open(fixtures().join(format!("{name}.waste")), ModelOptions { ctx, threads: 2, ..ModelOptions::exact() })
        .unwrap()
}

/// max |got − want| / max |want|.
pub fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let max_abs = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    max_abs / want.iter().fold(0f32, |a, b| a.max(b.abs()))
}

/// Worst over positions of [`rel_err`], evaluating `ids` one token at a time.
pub fn worst_rel(container: &Path, ids: &[u32], want: &[Vec<f32>], ctx: usize) -> f32 {
    let m = Model::open(container, ModelOptions { ctx, threads: 2, ..ModelOptions::exact() }).unwrap();
    let mut s = m.session();
    let mut worst = 0f32;
    for (p, &t) in ids.iter().enumerate() {
        worst = worst.max(rel_err(s.eval(&[t]).unwrap(), &want[p]));
    }
    worst
}

/// A copy of a container in a fresh temporary folder, removed when dropped
/// (also when a failed assertion unwinds past it).
pub struct TempCopy(PathBuf);

impl std::ops::Deref for TempCopy {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for TempCopy {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempCopy {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}

/// A copy of a container in a fresh temporary folder.
pub fn copy_container(src: &Path, tag: &str) -> TempCopy {
    let d = std::env::temp_dir().join(format!("waste-perturb-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    let copy = TempCopy(d);
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), copy.join(e.file_name())).unwrap();
    }
    copy
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
    // the copies are removed as they drop
}

/// The K3 features every K3 fixture must have switched on (a converter or
/// loader that silently drops one would otherwise pass on the rest).
pub fn assert_k3_features(m: &Model) {
    let c = m.config();
    assert!(c.latent.is_some(), "latent MoE");
    assert!(c.attn_res_block.is_some(), "attention residuals");
    assert!(c.q_lora.is_some(), "q-LoRA");
    assert!(c.mla_output_gate, "MLA output gate");
    assert!(c.kda_full_rank_gate, "full-rank KDA gate");
    assert_eq!(c.shared_experts, 2, "shared experts");
}

/// A prompt of `n` ids below 250 (every fixture's vocabulary holds them).
pub fn prompt(n: u32) -> Vec<u32> {
    (0..n).map(|i| (i * 53 + 7) % 250).collect()
}

/// The bits of `prompt`'s logits, then of `steps` greedy steps' (the first
/// from token 1), and the session's stats: what placement tests compare.
pub fn greedy_bits(m: &Model, prompt: &[u32], steps: usize) -> (Vec<u32>, waste_model::Stats) {
    let mut s = m.session();
    let mut bits: Vec<u32> = s.eval(prompt).unwrap().iter().map(|v| v.to_bits()).collect();
    let mut next = 1;
    for _ in 0..steps {
        let l = s.eval(&[next]).unwrap();
        next = waste_model::argmax(l);
        bits.extend(l.iter().map(|v| v.to_bits()));
    }
    (bits, s.stats())
}

/// Where the CPU has AVX2: the fast-quality fixture's path, with the AVX2
/// VQ lookup fixed to the gathers (so a chunk's tokens pair), and options
/// for the fast mode at the AVX2 level; `None` elsewhere (nothing pairs).
pub fn paired_gathers(ctx: usize) -> Option<(PathBuf, ModelOptions)> {
    use waste_quant::vq_fast::{set_avx2_lookup, Avx2Lookup};
    if !waste_quant::Level::Avx2.supported() {
        return None;
    }
    set_avx2_lookup(Avx2Lookup::Gathers);
    let path = fixtures().join("fast-quality/model.waste");
    let o = ModelOptions {
        ctx,
        numeric: Some(waste_model::Numeric::Fast),
        simd: Some(waste_quant::Level::Avx2),
        ..ModelOptions::exact()
    };
    Some((path, o))
}
