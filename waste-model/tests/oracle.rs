//! Whole model against transformers (the reference): four synthetic
//! containers of different shapes (layer patterns, head counts,
//! first_k_dense_replace 0/1/2, renormalize on/off, q-LoRA on/off, VQ3R /
//! VQ4P / F16 / Q4G experts), logits at every position of a 40-token prompt within
//! a bound per fixture of twice its measured worst relative error (max abs
//! / max |logit|; the logits are bit-identical on every SIMD level and
//! thread count, so the worst is the same on every machine), and the same
//! greedy continuation. Beside each, negative controls: the same comparison
//! on a copy with `rms_norm_eps` ×10, and on one with the final norm rounded
//! to bf16, must miss the bound. Fixtures: tools/oracle/make_fixtures.sh.

mod common;

use common::Reference;
use waste_model::Model;

/// `bound`: twice the fixture's measured worst relative error (stated at
/// each test).
fn check(name: &str, bound: f32) {
    let Reference { ids, logits: want, greedy } = common::reference(name);
    let m = common::open_fixture(name, 128);
    let mut s = m.session();
    let mut worst = 0f32;
    for (p, &t) in ids.iter().enumerate() {
        let rel = common::rel_err(s.eval(&[t]).unwrap(), &want[p]);
        worst = worst.max(rel);
        assert!(rel <= bound, "{name}: position {p}: relative error {rel}");
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
    common::negative_controls(&common::fixtures().join(format!("{name}.waste")), name, &ids, &want, 128, bound);
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
    check("tiny", 1.4e-5); // measured worst 7.01e-6
}

#[test]
fn tiny_b_vq4p_qlora_no_renorm_matches_transformers() {
    check("tiny-b", 2.0e-5); // measured worst 1.01e-5
}

#[test]
fn tiny_c_f16_experts_all_moe_matches_transformers() {
    check("tiny-c", 9.4e-6); // measured worst 4.68e-6
}

#[test]
fn tiny_q4g_experts_matches_transformers() {
    check("tiny-q4g", 1.7e-5); // measured worst 8.46e-6
}
