//! Whole model against transformers (the reference): three synthetic
//! containers of different shapes (layer patterns, head counts,
//! first_k_dense_replace 0/1/2, renormalize on/off, q-LoRA on/off, VQ3R /
//! VQ4P / F16 experts), logits at every position of a 40-token prompt within
//! 1e-4 relative (max abs / max |logit|), and the same greedy continuation.
//! Fixtures: tools/oracle/make_fixtures.sh.

use serde_json::Value;
use std::path::{Path, PathBuf};
use waste_model::{Model, ModelOptions};

const REL_TOL: f32 = 1e-4;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tools/oracle/fixtures")
}

fn check(name: &str) {
    let f: Value =
        serde_json::from_slice(&std::fs::read(fixtures().join(format!("{name}.logits.json"))).unwrap()).unwrap();
    let ids: Vec<u32> = f["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let want: Vec<Vec<f32>> = f["logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect())
        .collect();
    let greedy: Vec<u32> = f["greedy"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let m = Model::open(
        fixtures().join(format!("{name}.waste")),
        ModelOptions { ctx: 128, threads: 2, ..Default::default() },
    )
    .unwrap();
    let mut s = m.session();
    let mut worst = 0f32;
    for (p, &t) in ids.iter().enumerate() {
        let got = s.eval(&[t]).unwrap();
        let max_abs = got.iter().zip(&want[p]).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        let max_ref = want[p].iter().fold(0f32, |a, b| a.max(b.abs()));
        let rel = max_abs / max_ref;
        worst = worst.max(rel);
        assert!(rel <= REL_TOL, "{name}: position {p}: max abs {max_abs} / max |logit| {max_ref} = {rel}");
    }
    eprintln!("{name}: worst relative error over {} positions {worst:.2e}", ids.len());
    let argmax = |l: &[f32]| (0..l.len()).fold(0, |b, i| if l[i] > l[b] { i } else { b }) as u32;
    let mut next = argmax(s.logits());
    let mut cont = vec![];
    for _ in 0..greedy.len() {
        cont.push(next);
        next = argmax(s.eval(&[next]).unwrap());
    }
    assert_eq!(cont, greedy, "{name}: greedy continuation");
    // prefill in one call gives the same last logits as the steps
    let mut b = m.session();
    assert_eq!(b.eval(&ids).unwrap(), &want_last(&m, &ids)[..]);
}

fn want_last(m: &Model, ids: &[u32]) -> Vec<f32> {
    let mut s = m.session();
    let mut l = vec![];
    for &t in ids {
        l = s.eval(&[t]).unwrap().to_vec();
    }
    l
}

#[test]
fn tiny_vq3r_matches_transformers() {
    check("tiny");
}

#[test]
fn tiny_b_vq4p_qlora_no_renorm_matches_transformers() {
    check("tiny-b");
}

#[test]
fn tiny_c_f16_experts_all_moe_matches_transformers() {
    check("tiny-c");
}
