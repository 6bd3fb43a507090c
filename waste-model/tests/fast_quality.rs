//! The `fast` numeric mode's quality contract (issue 50), measured against
//! references on two fixtures:
//!
//! * a random Kimi-Linear made by transformers (hidden 256, 16 experts
//!   top-4, 4 layers), converted with VQ3R experts and a Q4 trunk
//!   (tools/oracle/make_fast_quality.py made the container and
//!   transformers' float32 logits of the checkpoint it came from);
//! * the tiny K3 of the oracle configurations (hidden 128, 8 experts top-3,
//!   5 layers), converted the same way, against the float64 K3 oracle
//!   (tools/oracle/make_fast_quality_k3.sh).
//!
//! Over 256 teacher-forced positions, `fast`'s mean KL divergence from the
//! reference must be at most 1.10 × `exact`'s, and its top-1 agreement with
//! the reference no lower than `exact`'s minus 1 point. The negative control
//! — activations and VQ tables at 4 bits — must fail the contract.

use std::path::Path;
use waste_model::quality::{agreement, kl, meets, read_reference, Agreement};
use waste_model::{Model, ModelOptions, Numeric};

mod common;

struct Quality {
    /// Agreement with the reference.
    at: Agreement,
    /// The logits, for KL(exact ‖ fast).
    logits: Vec<Vec<f32>>,
}

fn measure(fixture: &str, numeric: Numeric, ids: &[u32], want: &[Vec<f32>]) -> Quality {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tools/oracle/fixtures").join(fixture).join("model.waste");
    let m = Model::open(&dir, ModelOptions { ctx: 512, numeric: Some(numeric), ..ModelOptions::exact() }).unwrap();
    assert_eq!(m.numeric(), numeric);
    let mut s = m.session();
    let logits: Vec<Vec<f32>> = ids.iter().map(|&t| s.eval(&[t]).unwrap().to_vec()).collect();
    Quality { at: agreement(want, &logits), logits }
}

/// The contract on one fixture: `fast` meets it, the 4-bit control does not.
fn contract(fixture: &str) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tools/oracle/fixtures").join(fixture);
    let (ids, want) = if dir.join("reference.json").exists() {
        let r: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
        let ids: Vec<u32> = r["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let want: Vec<Vec<f32>> = r["logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|row| row.as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect())
            .collect();
        (ids, want)
    } else {
        read_reference(&dir).unwrap()
    };
    assert!(ids.len() >= 64, "the contract is measured over at least 64 positions");
    let exact = measure(fixture, Numeric::Exact, &ids, &want);
    let fast = measure(fixture, Numeric::Fast, &ids, &want);
    let control = measure(fixture, Numeric::Control4, &ids, &want);
    let between: f64 = exact.logits.iter().zip(&fast.logits).map(|(e, f)| kl(e, f)).sum::<f64>() / ids.len() as f64;
    eprintln!(
        "{fixture} over {} positions: exact KL {:.3e} top-1 {:.1} %; fast KL {:.3e} ({:.3}×) top-1 {:.1} %; KL(exact‖fast) {:.3e}; \
         4-bit control KL {:.3e} ({:.2}×) top-1 {:.1} %",
        ids.len(),
        exact.at.kl,
        exact.at.top1,
        fast.at.kl,
        fast.at.kl / exact.at.kl,
        fast.at.top1,
        between,
        control.at.kl,
        control.at.kl / exact.at.kl,
        control.at.top1
    );
    // the quantized weights cost something, and fast is not exact
    assert!(exact.at.kl > 0.0 && between > 0.0);
    assert!(meets(&fast.at, &exact.at), "{fixture}: fast misses the contract");
    assert!(!meets(&control.at, &exact.at), "{fixture}: the 4-bit control meets the contract: the test cannot tell");
}

/// A random Kimi-Linear made by transformers (KDA and MLA layers).
#[test]
fn fast_meets_its_quality_contract_and_4_bit_activations_do_not() {
    contract("fast-quality");
}

/// The HF oracle configuration of the Kimi-Linear tests (`hf-tiny`:
/// hidden 64, 4 layers) against transformers' float32 logits.
#[test]
fn fast_meets_its_quality_contract_on_the_tiny_hf_oracle() {
    contract("fast-quality-tiny");
}

/// The K3 oracle configuration (hidden 128, 8 experts top-3, 5 layers:
/// KDA, MLA, latent MoE, SiTU, AttnRes) against the float64 oracle.
#[test]
fn fast_meets_its_quality_contract_on_k3() {
    contract("fast-quality-k3");
}

/// Within the fast mode, placement never changes a bit: threads, the cache
/// size and the prefill chunk give the same logits, on the quality fixture
/// (Q4G trunk, VQ3R experts) and on an oracle fixture with Q4G experts
/// (whose products the fast mode takes, split across the pool or whole on
/// one thread).
#[test]
fn the_fast_mode_is_bit_identical_across_placements() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tools/oracle/fixtures");
    for dir in [root.join("fast-quality/model.waste"), root.join("tiny-q4g.waste")] {
        let plan = waste_model::plan(&dir, 128).unwrap();
        let base = ModelOptions { ctx: 128, numeric: Some(Numeric::Fast), ..ModelOptions::exact() };
        let ids: Vec<u32> = (0..24).map(|i| (i * 37 + 5) % 250).collect();
        let run = |o: ModelOptions| -> Vec<u32> {
            let m = Model::open(&dir, o).unwrap();
            let mut s = m.session();
            let mut bits: Vec<u32> = s.eval(&ids).unwrap().iter().map(|v| v.to_bits()).collect();
            bits.extend(s.eval(&[7]).unwrap().iter().map(|v| v.to_bits()));
            bits
        };
        let want = run(ModelOptions { threads: 1, max_chunk: 1, ..base.clone() });
        for (name, o) in [
            ("2 threads", ModelOptions { threads: 2, ..base.clone() }),
            ("3 threads, chunks of 16", ModelOptions { threads: 3, max_chunk: 16, ..base.clone() }),
            ("the smallest cache", ModelOptions { budget: plan.floor_bytes, threads: 2, ..base.clone() }),
        ] {
            assert_eq!(run(o), want, "{}: {name}", dir.display());
        }
        // and the mode does something here
        assert_ne!(run(ModelOptions { numeric: Some(Numeric::Exact), ..base.clone() }), want, "{}", dir.display());
    }
}

/// A prefill chunk whose VQ experts serve two tokens at once (the AVX2
/// gathers' pairs: every token's tables, one gather for two tokens' rows)
/// gives the logits of the prompt fed token by token, on one thread and
/// two, and the pairs ran (fewer expert runs than uses); `bench`'s cores'
/// bound probes those groups. On a CPU without AVX2 there is nothing to
/// pair.
#[test]
fn a_prefill_of_paired_tokens_is_token_by_token() {
    let Some((dir, base)) = common::paired_gathers(128) else { return };
    let ids: Vec<u32> = (0..40).map(|i| (i * 53 + 11) % 250).collect();
    let run = |o: ModelOptions| {
        let m = Model::open(&dir, o).unwrap();
        let mut s = m.session();
        let bits: Vec<u32> = s.eval(&ids).unwrap().iter().map(|v| v.to_bits()).collect();
        (bits, s.stats())
    };
    let (want, alone) = run(ModelOptions { threads: 1, max_chunk: 1, ..base.clone() });
    assert_eq!(alone.expert_runs, alone.experts_hit + alone.experts_missed, "token by token: a run a use");
    // chunks of 16, and the whole prompt in one (a roomy budget's buffers)
    for (threads, max_chunk, budget) in [(1, 16, 0), (2, 16, 0), (2, waste_model::MAX_CHUNK, 1 << 34)] {
        let (got, st) = run(ModelOptions { threads, max_chunk, budget, ..base.clone() });
        assert_eq!(got, want, "{threads} threads, chunks of {max_chunk}");
        assert!(st.expert_runs < st.experts_hit + st.experts_missed, "{threads} threads: no pair ran: {st:?}");
    }
    // the cores' bound of such a prefill probes the groups (pairs, and
    // quads at more than two tokens a run): finite, positive, and the
    // probes leave the answer as it was
    let m = Model::open(&dir, ModelOptions { threads: 2, ..base.clone() }).unwrap();
    for users in [1.0, 1.5, 2.5, 3.5, 4.0] {
        let (_, p) = m.compute_bounds(waste_model::PrefillShape { tokens: 40, chunk: 16, users }).unwrap();
        assert!(p.moe_layer_ms.is_finite() && p.moe_layer_ms > 0.0, "{users} a run: {p:?}");
    }
    let bits: Vec<u32> = m.session().eval(&ids).unwrap().iter().map(|v| v.to_bits()).collect();
    assert_eq!(bits, want, "after the probes");
}
