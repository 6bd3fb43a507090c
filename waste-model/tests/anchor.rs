//! The C WASTE 0.6.6's anchor container and its reference logits
//! (`testdata/anchor-tiny`): every case within 5e-4 max abs, greedy
//! continuations token for token, for every SIMD level and thread count,
//! and bit-identical logits across them.

use serde_json::Value;
use std::path::{Path, PathBuf};
use waste_model::{Model, ModelOptions};
use waste_quant::Level;

#[path = "../../waste-quant/tests/support/skip.rs"]
mod skip;
use skip::report_skip;

/// Twice the measured worst (1.18e-4 max abs, the 1-token case; 2.4e-5 and
/// 5.4e-5 for the others). testdata/README.md allows 5e-4 and explains the
/// gap: the C engine uses rms_norm_eps in the latent norms and 1e-12 in the
/// KDA L2 norm where the reference (which this engine follows) uses 1e-6.
const ANCHOR_MAX_ABS: f32 = 2.4e-4;

fn data() -> PathBuf {
    let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata");
    assert!(base.join("anchor-tiny/reference-logits.json").exists(), "test data missing at {}", base.display());
    base.join("anchor-tiny")
}

/// (prompt ids, reference logits, reference argmax, greedy continuation).
type Case = (Vec<u32>, Vec<f32>, u32, Vec<u32>);

fn cases() -> Vec<Case> {
    let v: Value = serde_json::from_slice(&std::fs::read(data().join("reference-logits.json")).unwrap()).unwrap();
    v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let ids = c["ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
            let lg = c["last_logits"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
            let g = c["greedy_8"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
            (ids, lg, c["argmax"].as_u64().unwrap() as u32, g)
        })
        .collect()
}

fn argmax(l: &[f32]) -> u32 {
    (0..l.len()).fold(0, |b, i| if l[i] > l[b] { i } else { b }) as u32
}

fn open(threads: usize, simd: Level) -> Model {
    Model::open(
        data().join("kimi-linear-tiny.waste"),
        ModelOptions { ctx: 256, threads, simd: Some(simd), ..ModelOptions::exact() },
    )
    .unwrap()
}

#[test]
fn reproduces_the_c_engine_logits_and_greedy_continuations() {
    let m = open(2, waste_quant::level());
    for (ids, want, am, greedy) in cases() {
        let mut s = m.session();
        let got = s.eval(&ids).unwrap().to_vec();
        let max_abs = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        eprintln!("anchor case of {} tokens: max abs {max_abs:.3e}", ids.len());
        assert!(max_abs <= ANCHOR_MAX_ABS, "prompt of {} tokens: max abs {max_abs}", ids.len());
        assert_eq!(argmax(&got), am);
        let mut next = am;
        let mut cont = vec![];
        for _ in 0..8 {
            next = argmax(s.eval(&[next]).unwrap());
            cont.push(next);
        }
        assert_eq!(cont, greedy, "greedy continuation of a {}-token prompt", ids.len());
    }
}

#[test]
fn logits_are_bit_identical_across_threads_and_simd_levels() {
    let (ids, _, _, _) = cases().remove(2);
    let mut runs = vec![];
    for lv in Level::available() {
        for t in [1, 2, 3] {
            let m = open(t, lv);
            let mut s = m.session();
            let mut l = s.eval(&ids).unwrap().to_vec();
            l.extend_from_slice(s.eval(&[7]).unwrap());
            runs.push(((lv, t), l.iter().map(|v| v.to_bits()).collect::<Vec<_>>()));
        }
    }
    for (k, r) in &runs[1..] {
        assert!(r == &runs[0].1, "{k:?} differs from {:?}", runs[0].0);
    }
    for l in Level::ALL {
        if !l.supported() {
            report_skip(
                &format!("waste-model anchor bit-identity: SIMD level {} not supported here", l.name()),
                l.required(),
            );
        }
    }
}

#[test]
fn prefill_equals_token_by_token_exactly() {
    let (ids, _, _, _) = cases().remove(0);
    let m = open(2, waste_quant::level());
    let mut a = m.session();
    let la = a.eval(&ids).unwrap().to_vec();
    let mut b = m.session();
    let mut lb = vec![];
    for &t in &ids {
        lb = b.eval(&[t]).unwrap().to_vec();
    }
    assert_eq!(la, lb);
}

/// Logits of the anchor's three prompts (prefill, then 3 greedy steps) as
/// f32 bit patterns, written on x86_64 (`WASTE_WRITE_ARCH_FIXTURE=1 cargo
/// test -p waste-model --test anchor`) and compared bit for bit on every
/// architecture: the canonical arithmetic order makes aarch64 (scalar today)
/// and x86_64 (any level) identical. Rewrite it only when the canonical
/// definition changes on purpose — the oracle tests bound it independently.
#[test]
fn logits_are_bit_identical_across_architectures() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tools/oracle/fixtures/anchor-logits-x86_64.json");
    let m = open(2, waste_quant::level());
    let mut all: Vec<Vec<u32>> = vec![];
    for (ids, _, _, _) in cases() {
        let mut s = m.session();
        let mut l = s.eval(&ids).unwrap().to_vec();
        let mut bits: Vec<u32> = l.iter().map(|v| v.to_bits()).collect();
        for _ in 0..3 {
            l = s.eval(&[waste_model::argmax(&l)]).unwrap().to_vec();
            bits.extend(l.iter().map(|v| v.to_bits()));
        }
        all.push(bits);
    }
    // written only on x86_64, and only when asked
    #[cfg(target_arch = "x86_64")]
    if std::env::var("WASTE_WRITE_ARCH_FIXTURE").is_ok_and(|v| v == "1") {
        std::fs::write(&path, serde_json::to_vec(&serde_json::json!({"arch": "x86_64", "logit_bits": all})).unwrap())
            .unwrap();
    }
    let want: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let want: Vec<Vec<u32>> = serde_json::from_value(want["logit_bits"].clone()).unwrap();
    assert_eq!(want.len(), all.len());
    for (i, (w, g)) in want.iter().zip(&all).enumerate() {
        let diff = w.iter().zip(g).filter(|(a, b)| a != b).count();
        assert_eq!(diff, 0, "prompt {i}: {diff} of {} logits differ from x86_64", w.len());
    }
}
