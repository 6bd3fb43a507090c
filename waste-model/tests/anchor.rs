//! The C WASTE 0.6.6's anchor container and its reference logits
//! (`testdata/anchor-tiny`): every case within 5e-4 max abs, greedy
//! continuations token for token, for every SIMD level and thread count,
//! and bit-identical logits across them.

use serde_json::Value;
use std::path::{Path, PathBuf};
use waste_model::{Model, ModelOptions};
use waste_quant::Level;

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
        ModelOptions { ctx: 256, threads, simd: Some(simd), ..Default::default() },
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

/// A check this machine cannot run: listed by `cargo xtask check` (through
/// `WASTE_SKIP_LOG`) and printed, never a silent pass; a required one fails
/// the test when `WASTE_REQUIRE_ALL=1` (CI).
fn report_skip(what: &str, required: bool) {
    let line = format!("{what}{}", if required { " (required)" } else { "" });
    if required && std::env::var("WASTE_REQUIRE_ALL").is_ok_and(|v| v == "1") {
        panic!("required check skipped: {line}");
    }
    if let Some(p) = std::env::var_os("WASTE_SKIP_LOG") {
        use std::io::Write;
        if let Ok(mut f) = std::fs::OpenOptions::new().append(true).create(true).open(p) {
            let _ = writeln!(f, "{line}");
        }
    }
    println!("SKIP: {line}");
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
