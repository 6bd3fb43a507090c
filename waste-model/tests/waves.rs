//! A prefill chunk whose layer routes to more experts than the cache can
//! pin at once runs them in waves (`Model::expert_wave`): each wave pinned,
//! read and computed in ascending id before the next, every token's sum
//! still adding its experts in ascending id — so the chunk keeps its length
//! (it used to shrink to the tokens whose experts fit, each chunk then
//! reading nearly every route) and the logits are those of a cache that
//! pins them all, bit for bit, for every expert path: token by token
//! (exact VQ), once a chunk for all its tokens (Q4G), and the fast mode's
//! tokens in pairs and quads (AVX2 gathers) — alone and with two sessions
//! prefilling at once on the same small cache.

use std::path::{Path, PathBuf};
use waste_model::{Model, ModelOptions, Stats};

mod common;

const CTX: usize = 96;

/// A prompt of `n` ids under 250.
fn ids(n: u32, seed: u32) -> Vec<u32> {
    (0..n).map(|i| (i * 53 + seed * 17 + 7) % 250).collect()
}

/// The prompt's logits and 4 greedy steps' as bits, and the stats.
fn run(m: &Model, prompt: &[u32]) -> (Vec<u32>, Stats) {
    let mut s = m.session();
    let mut bits: Vec<u32> = s.eval(prompt).unwrap().iter().map(|v| v.to_bits()).collect();
    for _ in 0..4 {
        let next = waste_model::argmax(s.logits()) as u32;
        bits.extend(s.eval(&[next]).unwrap().iter().map(|v| v.to_bits()));
    }
    (bits, s.stats())
}

/// The model at the floor budget (waves) and with the whole model's
/// cache (no waves), each with chunks of 16.
fn both(path: &Path, o: &ModelOptions) -> (Model, Model) {
    let whole = Model::open(path, ModelOptions { max_chunk: 16, ..o.clone() }).unwrap();
    let floor = whole.plan().floor_bytes;
    let small = Model::open(path, ModelOptions { budget: floor, max_chunk: 16, ..o.clone() }).unwrap();
    assert_eq!(whole.expert_wave(), None, "{}: the whole cache pins a layer", path.display());
    let n = small.expert_wave().unwrap_or_else(|| panic!("{}: the floor's cache pins a layer", path.display()));
    assert!(n < small.config().experts, "{}: waves of {n}", path.display());
    assert_eq!(small.session().chunk_len(), 16, "{}: waves keep the chunk", path.display());
    (whole, small)
}

fn fixture(name: &str) -> PathBuf {
    common::fixtures().join(name)
}

#[test]
fn waves_give_the_logits_of_a_cache_that_pins_a_layer_in_exact_mode() {
    let prompt = ids(40, 1);
    // VQ experts token by token, Q4G once a chunk, K3's latent MoE
    for name in ["tiny.waste", "tiny-q4g.waste", "tiny-k3.waste"] {
        for threads in [1, 2] {
            let o = ModelOptions { ctx: CTX, threads, ..ModelOptions::exact() };
            let (whole, small) = both(&fixture(name), &o);
            let (want, st) = run(&whole, &prompt);
            assert_eq!(st.expert_waves, 0, "{name}: {st:?}");
            let (got, st) = run(&small, &prompt);
            assert!(st.expert_waves > 0, "{name}, {threads} threads: no wave ran: {st:?}");
            assert!(got == want, "{name}, {threads} threads: the waves' logits differ from the whole cache's");
            // each expert of a chunk's layer is read at most once a chunk:
            // the misses never exceed what the chunks acquired
            assert!(st.experts_missed <= st.experts_acquired, "{name}: {st:?}");
        }
    }
}

/// The fast mode's tokens in pairs and quads (the AVX2 gathers, which
/// share the model's pair tables between sessions): the waves give the
/// whole cache's logits, and so do two sessions prefilling at once on the
/// floor's cache (each wave lets go of the tables and its pins before the
/// next is pinned, so neither waits on the other for good).
#[test]
fn waves_of_paired_tokens_give_the_whole_cache_s_logits_with_two_sessions_at_once() {
    let Some((path, o)) = common::paired_gathers(CTX) else { return };
    let o = ModelOptions { threads: 2, ..o };
    let (whole, small) = both(&path, &o);
    let (a, b) = (ids(48, 2), ids(37, 3));
    let (want_a, st) = run(&whole, &a);
    assert!(st.expert_runs < st.experts_hit + st.experts_missed, "no pair ran: {st:?}");
    let (want_b, _) = run(&whole, &b);
    let (got, st) = run(&small, &a);
    assert!(st.expert_waves > 0 && st.expert_runs < st.experts_hit + st.experts_missed, "{st:?}");
    assert!(got == want_a, "the waves' logits differ from the whole cache's");
    for round in 0..3 {
        let (ga, gb) = std::thread::scope(|s| {
            let ha = s.spawn(|| run(&small, &a).0);
            let hb = s.spawn(|| run(&small, &b).0);
            (ha.join().unwrap(), hb.join().unwrap())
        });
        assert!(ga == want_a && gb == want_b, "round {round}: two sessions at once differ from each alone");
    }
}

/// A prompt of several chunks prefills a span of chunks at a time, layer
/// by layer (`Model::spans`: the cache cannot hold every expert): the
/// logits are those of the prompt chunk by chunk (`span: false`), bit for
/// bit — VQ token by token, Q4G once a chunk, K3's latent MoE and
/// attention residuals, with and without waves — and each expert of a
/// layer is read at most once a span, not once a chunk.
#[test]
fn a_span_of_chunks_layer_by_layer_gives_the_chunk_by_chunk_logits() {
    let prompt = ids(60, 4);
    for name in ["tiny.waste", "tiny-q4g.waste", "tiny-k3.waste", "tiny-k3-4.waste"] {
        let path = fixture(name);
        let plan = waste_model::plan(&path, CTX).unwrap();
        // the floor (waves), and a cache that pins a layer but not the model
        let experts = plan.layer_experts as u64;
        for (what, budget) in
            [("floor", plan.floor_bytes), ("a layer", plan.floor_bytes + (experts + 2) * plan.record_bytes)]
        {
            let o =
                |span: bool| ModelOptions { ctx: CTX, budget, max_chunk: 8, span, threads: 2, ..ModelOptions::exact() };
            let (on, off) = (Model::open(&path, o(true)).unwrap(), Model::open(&path, o(false)).unwrap());
            assert!(on.spans() && !off.spans(), "{name} at {what}");
            assert!((on.cache_slots() as u64) < plan.expert_records, "{name} at {what}: the cache holds every expert");
            let (want, by_chunk) = run(&off, &prompt);
            let (got, by_span) = run(&on, &prompt);
            assert!(got == want, "{name} at {what}: a span's logits differ from chunk by chunk");
            assert!(
                by_span.experts_acquired < by_chunk.experts_acquired,
                "{name} at {what}: the span acquires no fewer experts: {by_span:?} against {by_chunk:?}"
            );
            assert!(by_span.experts_missed <= by_span.experts_acquired, "{name} at {what}: {by_span:?}");
        }
    }
}

/// KDA's chunked (WY) prefill form takes the step's chunks as they come: a
/// span's are the chunk-by-chunk order's, so its logits are too, bit for
/// bit (the form itself is within 1e-5 of the token-by-token one, not
/// equal to it).
#[test]
fn a_span_with_kda_s_chunked_form_gives_the_chunk_by_chunk_logits() {
    let path = fixture("tiny.waste");
    let floor = waste_model::plan(&path, CTX).unwrap().floor_bytes;
    let prompt = ids(60, 5);
    let o = |span: bool, kda_chunked: bool| ModelOptions {
        ctx: CTX,
        budget: floor,
        max_chunk: 8,
        span,
        kda_chunked,
        threads: 2,
        ..ModelOptions::exact()
    };
    let (on, off) = (Model::open(&path, o(true, true)).unwrap(), Model::open(&path, o(false, true)).unwrap());
    assert!(on.spans());
    let (want, _) = run(&off, &prompt);
    let (got, _) = run(&on, &prompt);
    assert!(got == want, "a span's logits differ from chunk by chunk in the chunked KDA form");
    // and the chunked form is another form: not the token-by-token bits
    let (plain, _) = run(&Model::open(&path, o(false, false)).unwrap(), &prompt);
    assert!(plain != want, "the chunked form gave the token-by-token form's bits: the option did nothing");
}
