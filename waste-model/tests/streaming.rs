//! Placement decides speed, never the answer (VQ3R, VQ4P and Q4G experts; the
//! Q4G chunk batching each expert's tokens): every cache size, read-ahead
//! on/off, router lookahead on/off, any I/O thread count and chunked prefill
//! give bit-identical logits. The plan equals what the engine allocates; the
//! budget floor is enforced; the usage hotlist round-trips and a corrupt one
//! is skipped.

use std::path::{Path, PathBuf};
use waste_model::{Error, Model, ModelOptions, Policy, PrefillShape};

mod common;

fn fixture(name: &str) -> PathBuf {
    common::fixtures().join(name)
}

const CTX: usize = 96;

fn run(path: &Path, o: ModelOptions) -> (Vec<u32>, waste_model::Stats) {
    let m = Model::open(path, ModelOptions { ctx: CTX, ..o }).unwrap();
    common::greedy_bits(&m, &common::prompt(37), 12)
}

/// A prompt's last layer runs its experts for the prompt's last token only:
/// the other tokens' outputs there feed nothing (their states are made in
/// the attention before). Expert uses of an 8-token prefill, in one chunk
/// or several, are every earlier MoE layer's 8 × top-k and the last
/// layer's top-k; a decoded token then uses every layer's top-k.
#[test]
fn a_prompt_reads_the_last_layer_experts_of_its_last_token_only() {
    for name in ["tiny.waste", "tiny-q4g.waste"] {
        let path = fixture(name);
        for max_chunk in [1, 3, 16] {
            let m = Model::open(&path, ModelOptions { ctx: CTX, max_chunk, ..ModelOptions::exact() }).unwrap();
            let (moe, k) = (m.config().n_moe_layers() as u64, m.config().top_k as u64);
            assert!(moe >= 2, "{name}: the count below needs an earlier MoE layer");
            let mut s = m.session();
            s.eval(&[3, 14, 15, 92, 65, 35, 89, 79]).unwrap();
            let uses = |s: &waste_model::Session<'_>| s.stats().experts_hit + s.stats().experts_missed;
            assert_eq!(uses(&s), ((moe - 1) * 8 + 1) * k, "{name}, chunks of {max_chunk}");
            s.eval(&[2]).unwrap();
            assert_eq!(uses(&s), ((moe - 1) * 8 + 1) * k + moe * k, "{name}, chunks of {max_chunk}");
        }
    }
}

#[test]
fn every_placement_gives_bit_identical_logits() {
    for name in ["tiny.waste", "tiny-b.waste", "tiny-q4g.waste"] {
        let path = fixture(name);
        let plan = waste_model::plan(&path, CTX).unwrap();
        let rec = plan.record_bytes;
        let base = ModelOptions {
            budget: plan.floor_bytes,
            max_chunk: 1,
            lookahead: Some(0),
            io_threads: 1,
            threads: 1,
            ..ModelOptions::exact()
        };
        let (want, st0) = run(&path, base.clone());
        assert!(st0.experts_missed > 0);
        let variants = vec![
            ("cache +6 records", ModelOptions { budget: plan.floor_bytes + 6 * rec, ..base.clone() }),
            ("whole model cached", ModelOptions { budget: plan.floor_bytes + 200 * rec, ..base.clone() }),
            // the arena (≥ 1 MiB here) is faulted in while reads land in it, or not at all
            (
                "whole model cached, no prefault",
                ModelOptions { prefault: false, budget: plan.floor_bytes + 200 * rec, ..base.clone() },
            ),
            ("read-ahead off", ModelOptions { readahead: false, budget: plan.floor_bytes + 6 * rec, ..base.clone() }),
            ("lookahead 2", ModelOptions { lookahead: Some(2), budget: plan.floor_bytes + 6 * rec, ..base.clone() }),
            ("lookahead top-k, tiny cache", ModelOptions { lookahead: Some(2), ..base.clone() }),
            (
                "the open's lookahead",
                ModelOptions { lookahead: None, budget: plan.floor_bytes + 12 * rec, ..base.clone() },
            ),
            ("4 I/O threads", ModelOptions { io_threads: 4, budget: plan.floor_bytes + 3 * rec, ..base.clone() }),
            ("chunked prefill", ModelOptions { max_chunk: 16, budget: plan.floor_bytes + 64 * rec, ..base.clone() }),
            (
                "chunked prefill, small cache",
                ModelOptions { max_chunk: 16, budget: plan.floor_bytes + 4 * rec, ..base.clone() },
            ),
            (
                "LRU, 2 compute threads",
                ModelOptions { policy: Policy::Lru, threads: 2, budget: plan.floor_bytes + 5 * rec, ..base.clone() },
            ),
        ];
        for (what, o) in variants {
            let (got, st) = run(&path, o);
            assert!(got == want, "{name}: {what}: logits differ from the plain path");
            assert_eq!(
                st.experts_hit + st.experts_missed,
                st0.experts_hit + st0.experts_missed,
                "{name}: {what}: expert uses"
            );
        }
    }
}

/// Left to the open, the router lookahead reads ahead
/// [`waste_model::AUTO_LOOKAHEAD`] experts (at most top-k) where the cache
/// cannot hold every expert but holds two layers' worth, and nothing where
/// it holds every expert or too few; a number asked for is kept.
#[test]
fn the_open_chooses_the_lookahead_by_what_the_cache_holds() {
    let path = fixture("tiny.waste");
    let plan = waste_model::plan(&path, CTX).unwrap();
    let rec = plan.record_bytes;
    let open = |budget: u64, lookahead: Option<usize>| {
        Model::open(&path, ModelOptions { ctx: CTX, budget, lookahead, ..ModelOptions::exact() }).unwrap()
    };
    let m = open(plan.floor_bytes + 12 * rec, None);
    let c = m.config();
    let (k, all) = (c.top_k, c.n_moe_layers() * c.experts);
    assert!(
        m.cache_slots() >= 2 * k + waste_model::AUTO_LOOKAHEAD && m.cache_slots() < all,
        "{} slots",
        m.cache_slots()
    );
    assert_eq!(m.lookahead(), waste_model::AUTO_LOOKAHEAD.min(k));
    let (_, st) = common::greedy_bits(&m, &common::prompt(37), 12);
    assert!(st.prefetch_issued > 0, "the lookahead read nothing ahead");
    let whole = open(plan.floor_bytes + 200 * rec, None);
    assert!(whole.cache_slots() >= all);
    assert_eq!(whole.lookahead(), 0, "every expert fits: nothing to read ahead");
    let floor = open(plan.floor_bytes, None);
    assert!(floor.cache_slots() < 2 * k + waste_model::AUTO_LOOKAHEAD, "{} slots at the floor", floor.cache_slots());
    assert_eq!(floor.lookahead(), 0, "a cache of one layer's experts");
    assert_eq!(open(plan.floor_bytes + 200 * rec, Some(1)).lookahead(), 1);
    assert_eq!(open(plan.floor_bytes + 12 * rec, Some(0)).lookahead(), 0);
}

/// The one exception to bit-identity: KDA's chunked (WY) prefill form
/// (`kda_chunked`) gives logits near, not equal to, the token form's.
#[test]
fn kda_chunked_prefill_is_close_not_identical() {
    let path = fixture("tiny.waste");
    let m = Model::open(&path, ModelOptions { ctx: CTX, max_chunk: 16, ..ModelOptions::exact() }).unwrap();
    let mw = Model::open(&path, ModelOptions { ctx: CTX, max_chunk: 16, kda_chunked: true, ..ModelOptions::exact() })
        .unwrap();
    let prompt: Vec<u32> = (0..37).map(|i| (i * 53 + 7) % 250).collect();
    let (mut s, mut sw) = (m.session(), mw.session());
    assert!(sw.chunk_len() >= 8, "chunk {}", sw.chunk_len());
    let a = s.eval(&prompt).unwrap().to_vec();
    let b = sw.eval(&prompt).unwrap().to_vec();
    let scale = a.iter().fold(0f32, |x, v| x.max(v.abs()));
    let err = a.iter().zip(&b).fold(0f32, |x, (p, q)| x.max((p - q).abs()));
    assert!(err <= 1e-4 * scale, "max logit difference {err} against {scale}");
    assert!(a.iter().zip(&b).any(|(p, q)| p.to_bits() != q.to_bits()), "the chunked form was not used");
}

#[test]
fn chunked_prefill_reads_each_distinct_expert_once_per_chunk() {
    let path = fixture("tiny-b.waste");
    let plan = waste_model::plan(&path, CTX).unwrap();
    // a cache too small to keep anything across chunks isolates the dedup effect
    let o = ModelOptions { budget: plan.floor_bytes + 60 * plan.record_bytes, io_threads: 2, ..ModelOptions::exact() };
    let m = Model::open(
        &path,
        // token by token through every layer (no span of chunks, which
        // would share reads across its tokens as a chunk does)
        ModelOptions {
            ctx: CTX,
            max_chunk: 1,
            policy: Policy::Lru,
            budget: plan.floor_bytes,
            span: false,
            ..o.clone()
        },
    )
    .unwrap();
    let prompt: Vec<u32> = (0..32).map(|i| (i * 31 + 3) % 250).collect();
    let mut s = m.session();
    s.eval(&prompt).unwrap();
    let tok_by_tok = s.stats().experts_missed;
    let m2 = Model::open(&path, ModelOptions { ctx: CTX, max_chunk: 16, ..o }).unwrap();
    let mut s2 = m2.session();
    assert!(s2.chunk_len() >= 8, "chunk {}", s2.chunk_len());
    s2.eval(&prompt).unwrap();
    let chunked = s2.stats().experts_missed;
    // 3 MoE layers × 16 experts: a chunk reads at most 48 records
    assert!(chunked <= 2 * 3 * 16, "chunked prefill read {chunked} records");
    assert!(chunked * 2 < tok_by_tok, "chunked {chunked} vs token-by-token {tok_by_tok}");
}

#[test]
fn plan_equals_what_the_engine_allocates() {
    // the default threads (every core), one thread, and three (the expert
    // lanes follow the threads up to top_k)
    for (name, threads) in [
        ("tiny.waste", 0),
        ("tiny-b.waste", 0),
        ("tiny-c.waste", 0),
        ("tiny-q4g.waste", 2),
        ("tiny.waste", 1),
        ("tiny.waste", 3),
    ] {
        let path = fixture(name);
        let plan = waste_model::plan(&path, CTX).unwrap();
        let plan = if threads > 0 { plan.with_threads(threads) } else { plan };
        let m = Model::open(
            &path,
            ModelOptions {
                ctx: CTX,
                threads,
                budget: plan.floor_bytes + 3 * plan.record_bytes,
                ..ModelOptions::exact()
            },
        )
        .unwrap();
        assert_eq!(m.plan(), &plan, "{name}, {threads} threads: the model's plan");
        let (trunk, arena) = m.allocated_bytes();
        assert_eq!(trunk, plan.trunk_bytes, "{name}: trunk");
        let s = m.session();
        let (state, scratch) = s.allocated_bytes();
        assert_eq!(state, plan.state_bytes, "{name}: state");
        assert_eq!(scratch, plan.scratch_bytes, "{name}: scratch");
        assert!(
            arena <= m.budget() - plan.trunk_bytes - plan.state_bytes - plan.scratch_bytes,
            "{name}: arena {arena} beyond the cache budget"
        );
        assert!(trunk + state + scratch + arena <= m.budget());
        assert_eq!(arena, plan.cache_arena_bytes(m.cache_slots(), m.huge_pages()), "{name}: the plan's arena");
    }
    // a budget with room for the largest chunks: the buffers the plan
    // extrapolates from the floor's chunk are the ones the engine allocates
    for name in ["tiny.waste", "tiny-b.waste", "tiny-q4g.waste"] {
        let path = fixture(name);
        let plan = waste_model::plan(&path, CTX).unwrap();
        let m = Model::open(&path, ModelOptions { ctx: CTX, budget: 1 << 34, ..ModelOptions::exact() }).unwrap();
        assert_eq!(m.chunk(), waste_model::MAX_CHUNK, "{name}: a roomy budget's chunk");
        let wide = plan.with_chunk(m.chunk());
        assert!(wide.scratch_bytes > plan.scratch_bytes, "{name}: larger buffers");
        assert_eq!(m.plan(), &wide, "{name}: the model's plan");
        let (state, scratch) = m.session().allocated_bytes();
        assert_eq!((state, scratch), (wide.state_bytes, wide.scratch_bytes), "{name}: chunks of {}", m.chunk());
        // and the options' cap holds the buffers to the floor's chunk
        let o = ModelOptions { ctx: CTX, budget: 1 << 34, max_chunk: 16, ..ModelOptions::exact() };
        assert_eq!(Model::open(&path, o).unwrap().plan(), &plan, "{name}: max_chunk 16");
    }
    // a budget far beyond the records: the cache holds every record and
    // allocates only their arena, which the plan says (not the budget's share)
    let path = fixture("tiny.waste");
    let plan = waste_model::plan(&path, CTX).unwrap();
    let m = Model::open(&path, ModelOptions { ctx: CTX, budget: 1 << 40, ..ModelOptions::exact() }).unwrap();
    let (_, arena) = m.allocated_bytes();
    assert_eq!(m.cache_slots() as u64, plan.expert_records);
    assert_eq!(arena, plan.cache_arena_bytes(m.cache_slots(), m.huge_pages()));
    assert!(arena < 1 << 30, "arena {arena}");
}

/// Below the resident floor layers stream (tests/below_floor.rs); below
/// the lowest floor any split reaches, the open is refused naming that
/// floor — which itself opens.
#[test]
fn below_the_floor_is_refused_naming_the_floor() {
    let path = fixture("tiny.waste");
    let plan = waste_model::plan(&path, CTX).unwrap();
    let e =
        Model::open(&path, ModelOptions { ctx: CTX, budget: 1 << 20, ..ModelOptions::exact() }).err().expect("refused");
    let Error::Budget { floor, .. } = &e else { panic!("{e}") };
    let msg = e.to_string();
    assert!(msg.contains(&floor.to_string()) && msg.contains("floor") && msg.contains("streamed"), "{msg}");
    assert!(*floor < plan.floor_bytes && *floor > 1 << 20, "{floor}");
    Model::open(&path, ModelOptions { ctx: CTX, budget: *floor, ..ModelOptions::exact() }).unwrap();
    let e = Model::open(&path, ModelOptions { ctx: CTX, budget: floor - 1, ..ModelOptions::exact() })
        .err()
        .expect("refused");
    assert!(matches!(e, Error::Budget { floor: f, .. } if f == *floor), "{e}");
}

#[test]
fn usage_hotlist_roundtrip_and_corrupt_file_skipped() {
    let path = fixture("tiny.waste");
    let usage = std::env::temp_dir().join(format!("waste-usage-{}.waste", std::process::id()));
    let plan = waste_model::plan(&path, CTX).unwrap();
    let o = ModelOptions {
        ctx: CTX,
        budget: plan.floor_bytes + 4 * plan.record_bytes,
        usage: Some(usage.clone()),
        ..ModelOptions::exact()
    };
    {
        let m = Model::open(&path, o.clone()).unwrap();
        assert_eq!(m.preloaded(), 0);
        let mut s = m.session();
        s.eval(&[256, 1, 2, 3, 4, 5]).unwrap();
        m.save_usage(&usage, 6).unwrap();
    }
    let (want, _) = run(&path, ModelOptions { usage: Some(PathBuf::from("/nonexistent")), ..o.clone() });
    // each skipped file says why (a missing, corrupt or foreign one), a good one nothing
    let usage_warning = |o: &ModelOptions| {
        let m = Model::open(&path, o.clone()).unwrap();
        (m.preloaded(), m.warnings().iter().find(|w| w.starts_with("usage file")).cloned())
    };
    let (n, w) = usage_warning(&ModelOptions { usage: Some(PathBuf::from("/nonexistent")), ..o.clone() });
    assert!(n == 0 && w.as_ref().is_some_and(|w| w.contains("/nonexistent: not read")), "{w:?}");
    let m = Model::open(&path, o.clone()).unwrap();
    assert!(m.preloaded() > 0 && m.preloaded() <= m.cache_slots());
    assert!(!m.warnings().iter().any(|w| w.starts_with("usage file")), "{:?}", m.warnings());
    drop(m);
    // a warm start changes speed, never the answer
    let (got, st) = run(&path, o.clone());
    assert!(got == want);
    assert!(st.experts_hit > 0);
    // corrupt and foreign files are skipped, never trusted
    std::fs::write(&usage, b"WUSG\x01\x00\x00\x00garbage").unwrap();
    let (n, w) = usage_warning(&o);
    assert!(n == 0 && w.as_ref().is_some_and(|w| w.contains("skipped")), "{w:?}");
    let foreign = waste_format::Usage {
        total_tokens: 1,
        entries: vec![
            waste_format::UsageEntry { layer: 99, expert: 3, hits: 9, last_seen: 0 },
            waste_format::UsageEntry { layer: 1, expert: 999, hits: 9, last_seen: 0 },
        ],
    };
    std::fs::write(&usage, foreign.encode()).unwrap();
    let (n, w) = usage_warning(&o);
    assert!(n == 0 && w.as_ref().is_some_and(|w| w.contains("2 of 2 entries name experts")), "{w:?}");
    std::fs::remove_file(&usage).ok();
}

#[test]
fn a_context_beyond_the_machine_is_an_error_naming_the_largest_that_fits() {
    let path = fixture("tiny.waste");
    // far beyond any size the engine plans for: a precise error, no overflow
    for ctx in [0usize, waste_model::MAX_CTX + 1, usize::MAX / 2, usize::MAX] {
        let e = waste_model::plan(&path, ctx).unwrap_err().to_string();
        assert!(e.contains("ctx") && e.contains(&waste_model::MAX_CTX.to_string()), "{ctx}: {e}");
        let e = Model::open(&path, ModelOptions { ctx, ..ModelOptions::exact() }).err().expect("refused").to_string();
        assert!(e.contains("ctx"), "{ctx}: {e}");
    }
    // a floor above the RAM planned against: refused with the figures and the largest ctx that fits
    let small = waste_model::plan(&path, 64).unwrap().floor_bytes;
    let ram = small + (4 << 20);
    let big = 1 << 20;
    assert!(waste_model::plan(&path, big).unwrap().floor_bytes > ram, "the test needs a floor above {ram}");
    let e = Model::open(&path, ModelOptions { ctx: big, usable_ram: Some(ram), ..ModelOptions::exact() })
        .err()
        .expect("refused");
    let Error::FloorAboveRam { floor, usable, max_ctx: Some(max), .. } = e else { panic!("{e}") };
    assert_eq!(usable, ram);
    assert!(floor > ram);
    assert!(waste_model::plan(&path, max).unwrap().floor_bytes <= ram);
    assert!(waste_model::plan(&path, max + 1).unwrap().floor_bytes > ram);
    assert!(max >= 64);
    assert!(e.to_string().contains(&format!("the largest ctx that fits is {max}")), "{e}");
    // the largest ctx opens; --force opens past the floor check
    Model::open(&path, ModelOptions { ctx: max, usable_ram: Some(ram), ..ModelOptions::exact() }).unwrap();
    Model::open(
        &path,
        ModelOptions { ctx: 2 * max, usable_ram: Some(ram), force: true, budget: 0, ..ModelOptions::exact() },
    )
    .unwrap();
}

#[test]
fn four_sessions_on_four_threads_share_one_model_exactly() {
    let path = fixture("tiny.waste");
    let plan = waste_model::plan(&path, CTX).unwrap();
    let prompts: Vec<Vec<u32>> =
        (0..4u32).map(|i| (0..14u32).map(|t| 3 + (t * 37 + i * 101) % 250).collect()).collect();
    // each session: its prompt's logits, then 6 greedy steps' logits
    let drive = |m: &Model, p: &[u32]| -> Vec<u32> {
        let mut s = m.session();
        let mut last = s.eval(p).unwrap().to_vec();
        let mut out: Vec<u32> = last.iter().map(|v| v.to_bits()).collect();
        for _ in 0..6 {
            last = s.eval(&[waste_model::argmax(&last)]).unwrap().to_vec();
            out.extend(last.iter().map(|v| v.to_bits()));
        }
        out
    };
    for readahead in [true, false] {
        // 10 slots for a combined working set of 4 sessions × 2 experts × 3
        // MoE layers a token, over 24 records: constant eviction and sharing
        let o = ModelOptions {
            ctx: CTX,
            budget: plan.floor_bytes + 6 * plan.record_bytes,
            readahead,
            io_threads: 2,
            threads: 1,
            max_chunk: 1,
            ..ModelOptions::exact()
        };
        let alone: Vec<Vec<u32>> = prompts.iter().map(|p| drive(&Model::open(&path, o.clone()).unwrap(), p)).collect();
        let m = Model::open(&path, o.clone()).unwrap();
        assert!(m.cache_slots() < 24, "the cache must be smaller than the model's records");
        for round in 0..3 {
            let together: Vec<Vec<u32>> = std::thread::scope(|sc| {
                let hs: Vec<_> = prompts.iter().map(|p| sc.spawn(|| drive(&m, p))).collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
                assert!(a == t, "readahead {readahead}, round {round}: session {i} differs from running alone");
            }
        }
        assert!(m.cache_stats().evictions > 0, "the cache never evicted: the test shares nothing");
    }
}

#[test]
fn a_recorded_routing_is_replayed_and_a_bad_one_refused() {
    let path = fixture("tiny.waste");
    let plan = waste_model::plan(&path, CTX).unwrap();
    let m = Model::open(
        &path,
        ModelOptions { ctx: CTX, budget: plan.floor_bytes + 16 * plan.record_bytes, ..ModelOptions::exact() },
    )
    .unwrap();
    let c = m.config();
    let (moe, k) = (c.n_moe_layers(), c.top_k);
    let fixed: Vec<u32> = (0..k as u32).collect();
    // every token routes to experts 0..k in every layer: each is read once, then hit
    let trace = std::sync::Arc::new(vec![vec![fixed.clone(); moe]; 5]);
    let mut s = m.session();
    s.replay_routing(trace).unwrap();
    let ids: Vec<u32> = (1..=12).collect();
    for &t in &ids {
        s.eval(&[t]).unwrap();
    }
    let st = s.stats();
    assert_eq!(st.experts_missed, (moe * k) as u64, "{st:?}");
    assert_eq!(st.experts_hit, ((ids.len() - 1) * moe * k) as u64, "{st:?}");
    // the control: left to the router, the same tokens use other experts
    let mut r = m.session();
    for &t in &ids {
        r.eval(&[t]).unwrap();
    }
    assert_ne!(r.stats().experts_missed, st.experts_missed, "the router chose exactly the replayed experts");
    // bad traces: precise errors naming token and layer
    let mut s = m.session();
    let mut bad = |v: Vec<Vec<Vec<u32>>>| s.replay_routing(std::sync::Arc::new(v)).unwrap_err().to_string();
    let mut dup = vec![vec![fixed.clone(); moe]; 2];
    dup[1][0] = vec![0; k];
    let e = bad(dup);
    assert!(e.contains("token 1") && e.contains("MoE layer 0"), "{e}");
    let mut big = vec![vec![fixed.clone(); moe]; 1];
    big[0][moe - 1][0] = 999;
    assert!(bad(big).contains("below"));
    assert!(bad(vec![vec![fixed.clone(); moe - 1]]).contains("MoE layers"));
    assert!(bad(vec![]).contains("no tokens"));
}

#[test]
fn reserving_the_grammar_tables_takes_them_from_the_cache() {
    let path = fixture("tiny.waste");
    let plan = waste_model::plan(&path, CTX).unwrap();
    let vocab = Model::open(&path, ModelOptions { ctx: CTX, ..ModelOptions::exact() }).unwrap().config().vocab;
    let grammar = waste_model::GRAMMAR_BYTES_PER_TOKEN * vocab as u64;
    assert_eq!(plan.with_grammar(vocab).grammar_bytes, grammar);
    // a budget where the cache is not capped by the record count either way
    let budget = plan.with_grammar(vocab).floor_bytes + 4 * plan.record_bytes;
    let open =
        |grammar| Model::open(&path, ModelOptions { ctx: CTX, budget, grammar, ..ModelOptions::exact() }).unwrap();
    let (plain, constrained) = (open(false), open(true));
    assert_eq!(plain.plan().grammar_bytes, 0);
    assert_eq!(constrained.plan().grammar_bytes, grammar);
    assert_eq!(constrained.plan().floor_bytes - plain.plan().floor_bytes, grammar);
    // the budget is the same; the cache gets the grammar's share less
    let (a, b) = (plain.cache_slots() as u64, constrained.cache_slots() as u64);
    assert!(b < a, "{b} slots with the grammar reserved, {a} without");
    assert!((a - b) * plan.record_bytes <= grammar + 2 * plan.record_bytes);
}

/// The cores' bound `bench` reports: every trunk format and one MoE layer
/// probed on the model's own weights (VQ3R and Q4G experts), positive and
/// finite; the expert probe pins one record through the cache and leaves
/// every answer as it was.
#[test]
fn the_compute_bound_probes_the_trunk_and_one_moe_layer() {
    for name in ["tiny.waste", "tiny-q4g.waste"] {
        let m = Model::open(fixture(name), ModelOptions { ctx: CTX, ..ModelOptions::exact() }).unwrap();
        let before = m.session().eval(&[1, 2, 3]).unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let b = m.compute_bound().unwrap();
        assert!(b.trunk_ms.is_finite() && b.trunk_ms > 0.0, "{name}: {b:?}");
        assert!(b.moe_layer_ms.is_finite() && b.moe_layer_ms > 0.0, "{name}: {b:?}");
        assert_eq!(b.top_k, m.config().top_k);
        // decode's again and a prefill's, from one set of probes (per
        // token, every part probed); VQ experts run token by token in a
        // prefill too, so its expert probe is decode's
        for users in [1.0, 2.5] {
            let (d, p) = m.compute_bounds(PrefillShape { tokens: 8, chunk: 4, users }).unwrap();
            assert!(d.trunk_ms > 0.0 && d.moe_layer_ms > 0.0 && d.top_k == b.top_k, "{name}: {d:?}");
            assert!(p.trunk_ms.is_finite() && p.trunk_ms > 0.0, "{name}: {p:?}");
            assert!(p.moe_layer_ms.is_finite() && p.moe_layer_ms > 0.0, "{name}: {p:?}");
            assert_eq!(p.top_k, m.config().top_k);
            if name == "tiny.waste" {
                assert_eq!(p.moe_layer_ms, d.moe_layer_ms, "{name}");
            }
        }
        // a caller's sizes past the engine's do not size the probe
        let (_, p) = m.compute_bounds(PrefillShape { tokens: usize::MAX, chunk: usize::MAX, users: f64::MAX }).unwrap();
        assert!(p.trunk_ms.is_finite() && p.moe_layer_ms.is_finite() && p.moe_layer_ms > 0.0, "{name}: {p:?}");
        // chunks of one token: every format's experts run token by token
        let (d, p) = m.compute_bounds(PrefillShape { tokens: 8, chunk: 1, users: 1.0 }).unwrap();
        assert_eq!(p.moe_layer_ms, d.moe_layer_ms, "{name}");
        assert!(
            p.trunk_ms > 0.0 && p.trunk_ms <= d.trunk_ms,
            "{name}: one token a chunk pays decode's matvecs, less the shared last layer and head: {p:?} {d:?}"
        );
        let after = m.session().eval(&[1, 2, 3]).unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(before, after, "{name}");
    }
}

/// `Stats::expert_runs`: token by token (every decode step, every VQ
/// prefill) one run per expert use; a Q4G prefill chunk runs each distinct
/// expert once for its tokens, so its runs are the chunk's distinct experts.
#[test]
fn expert_runs_count_one_per_use_or_one_per_distinct_expert_of_a_chunk() {
    for (name, batches) in [("tiny.waste", false), ("tiny-q4g.waste", true)] {
        let m = Model::open(fixture(name), ModelOptions { ctx: CTX, ..ModelOptions::exact() }).unwrap();
        let mut s = m.session();
        let prompt = [1u32, 2, 3, 4, 5, 6];
        s.eval(&prompt).unwrap();
        let p = s.stats();
        let uses = p.experts_hit + p.experts_missed;
        assert!(uses > 0, "{name}: {p:?}");
        if batches {
            // every MoE layer but the last took all 6 tokens in one chunk
            // (the last layer only the last token): at least top_k distinct
            // experts a layer, and 6 tokens × top_k 2 uses among 8 experts
            // must meet, so fewer runs than uses
            assert!(s.chunk_len() >= prompt.len() && m.config().experts < prompt.len() * m.config().top_k);
            let k = m.config().top_k as u64;
            let layers = m.config().n_moe_layers() as u64;
            assert!(p.expert_runs >= k * layers && p.expert_runs < uses, "{name}: {p:?}");
        } else {
            assert_eq!(p.expert_runs, uses, "{name}: {p:?}");
        }
        s.eval(&[7]).unwrap();
        let d = s.stats() - p;
        assert_eq!(d.expert_runs, d.experts_hit + d.experts_missed, "{name}: a decode step runs each use");
    }
}

/// A layer's distinct experts are pinned at once, so a cache with room for
/// a whole MoE layer's feeds a chunk of any length; a smaller one feeds it
/// too, its experts in waves of half its free slots — and the logits are
/// the same either way.
#[test]
fn a_cache_holding_a_layer_feeds_any_chunk() {
    let path = fixture("tiny.waste");
    let plan = waste_model::plan(&path, CTX).unwrap();
    let open = |records: u64| {
        let budget = plan.floor_bytes + records * plan.record_bytes;
        Model::open(&path, ModelOptions { ctx: CTX, budget, huge_pages: false, ..ModelOptions::exact() }).unwrap()
    };
    let prompt: Vec<u32> = (1..=12).collect();
    let (mut logits, mut whole) = (Vec::new(), Vec::new());
    for records in [0, 6] {
        let m = open(records);
        let (slots, c) = (m.cache_slots(), m.config());
        whole.push(slots >= c.experts);
        let s = m.session();
        assert_eq!(s.chunk_len(), m.chunk(), "{slots} slots for {} experts a layer", c.experts);
        if slots >= c.experts {
            assert_eq!(m.expert_wave(), None, "{slots} slots");
        } else {
            assert_eq!(m.expert_wave(), Some(slots.div_ceil(2)), "{slots} slots");
        }
        let mut s = s;
        logits.push(s.eval(&prompt).unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        assert_eq!(s.stats().expert_waves > 0, slots < c.experts, "{slots} slots: {:?}", s.stats());
    }
    assert_eq!(whole, [false, true], "both regimes");
    assert_eq!(logits[0], logits[1]);
}
