//! Several sequences decoded together (`Model::step_many`): each sequence's
//! logits are bit-identical to evaluating it alone — sequences of mixed
//! prompt lengths joining and leaving between steps, on Kimi-Linear (KDA +
//! MLA, VQ3R / VQ4P / Q4G experts; the anchor's shared expert and Q8
//! head) and K3 (MLA with attention residuals)
//! fixtures, with the cache holding everything or a few records, on one or
//! two threads, in both numeric modes, as one batch or as two halves in
//! turn ([`ModelOptions::halves`]).

use std::path::{Path, PathBuf};
use waste_model::{Error, Model, ModelOptions, Numeric};

/// An oracle fixture, or the anchor container (`anchor`).
fn fixture(name: &str) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    match name {
        "anchor" => root.join("testdata/anchor-tiny/kimi-linear-tiny.waste"),
        _ => root.join("tools/oracle/fixtures").join(name),
    }
}

const CTX: usize = 64;
const STEPS: usize = 9;

/// Sequence `i`'s prompt (lengths 1 to 13) and the tokens it is fed after
/// it, one a step (fixed, so the reference does not depend on the batch).
fn script(i: usize, vocab: u32) -> (Vec<u32>, Vec<u32>) {
    let len = 1 + (i * 5) % 13;
    let prompt = (0..len).map(|j| ((i * 97 + j * 31 + 5) as u32) % vocab).collect();
    let feed = (0..STEPS).map(|j| ((i * 13 + j * 71 + 2) as u32) % vocab).collect();
    (prompt, feed)
}

fn bits(l: &[f32]) -> Vec<u32> {
    l.iter().map(|v| v.to_bits()).collect()
}

/// Sequence `i` alone: its logits after each fed token.
fn alone(m: &Model, i: usize, steps: usize) -> Vec<Vec<u32>> {
    let (prompt, feed) = script(i, m.config().vocab as u32);
    let mut s = m.session();
    s.eval(&prompt).unwrap();
    feed[..steps].iter().map(|&t| bits(s.eval(&[t]).unwrap())).collect()
}

/// Sequence `i` joins at step `i` and leaves after `STEPS - (i % 3)` of
/// its own tokens; every step advances the sequences present together.
fn together(m: &Model, n: usize) -> Vec<Vec<Vec<u32>>> {
    let vocab = m.config().vocab as u32;
    let mut sessions: Vec<_> = (0..n).map(|_| m.session()).collect();
    let mut fed = vec![0usize; n];
    let mut got = vec![Vec::new(); n];
    let stay = |i: usize| STEPS - (i % 3);
    for step in 0.. {
        let mut here: Vec<usize> = Vec::new();
        for i in 0..n {
            if i == step {
                // a new sequence's prompt runs alone, between steps
                sessions[i].eval(&script(i, vocab).0).unwrap();
            }
            if i <= step && fed[i] < stay(i) {
                here.push(i);
            }
        }
        if here.is_empty() && step >= n {
            break;
        }
        let tokens: Vec<u32> = here.iter().map(|&i| script(i, vocab).1[fed[i]]).collect();
        let mut refs: Vec<&mut waste_model::Session<'_>> =
            sessions.iter_mut().enumerate().filter(|(i, _)| here.contains(i)).map(|(_, s)| s).collect();
        m.step_many(&mut refs, &tokens).unwrap();
        for (&i, s) in here.iter().zip(&refs) {
            got[i].push(bits(s.logits()));
            fed[i] += 1;
        }
    }
    got
}

#[test]
fn batched_steps_equal_each_sequence_alone() {
    let all =
        ["anchor", "tiny.waste", "tiny-b.waste", "tiny-q4g.waste", "tiny-c.waste", "tiny-k3.waste", "tiny-k3-4.waste"];
    // under emulation (CI's qemu step, `WASTE_EMULATED`: 62 s there for
    // all seven) one fixture of each expert path: VQ token by token, Q4G
    // once a step, K3's latent MoE with attention residuals
    let names: &[&str] = if std::env::var_os("WASTE_EMULATED").is_some() {
        &["tiny.waste", "tiny-q4g.waste", "tiny-k3-4.waste"]
    } else {
        &all
    };
    for &name in names {
        let path = fixture(name);
        let plan = waste_model::plan(&path, CTX).unwrap();
        let rec = plan.record_bytes;
        let mut variants = vec![
            (
                "everything cached, 1 thread",
                ModelOptions { budget: plan.floor_bytes + 400 * rec, threads: 1, ..ModelOptions::exact() },
            ),
            // the open's choice: measured, so both forms run (reads to hide)
            (
                "12 records, 2 threads",
                ModelOptions { budget: plan.floor_bytes + 12 * rec, threads: 2, ..ModelOptions::exact() },
            ),
            (
                "12 records, one batch",
                ModelOptions { budget: plan.floor_bytes + 12 * rec, halves: Some(false), ..ModelOptions::exact() },
            ),
            (
                "12 records, halves in turn, 2 threads",
                ModelOptions {
                    budget: plan.floor_bytes + 12 * rec,
                    threads: 2,
                    halves: Some(true),
                    ..ModelOptions::exact()
                },
            ),
            (
                "everything cached, halves in turn",
                ModelOptions { budget: plan.floor_bytes + 400 * rec, halves: Some(true), ..ModelOptions::exact() },
            ),
        ];
        if name == "tiny-q4g.waste" {
            variants.push((
                "fast mode",
                ModelOptions {
                    budget: plan.floor_bytes + 400 * rec,
                    numeric: Some(Numeric::Fast),
                    ..ModelOptions::exact()
                },
            ));
        }
        // VQ experts in the fast mode looked up by the AVX2 gathers: a
        // step's sequences on one expert share its gathers, two by two
        if ["anchor", "tiny.waste"].contains(&name) && waste_quant::Level::Avx2.supported() {
            waste_quant::vq_fast::set_avx2_lookup(waste_quant::vq_fast::Avx2Lookup::Gathers);
            variants.push((
                "fast mode, AVX2 gathers in pairs, 2 threads",
                ModelOptions {
                    budget: plan.floor_bytes + 400 * rec,
                    threads: 2,
                    numeric: Some(Numeric::Fast),
                    simd: Some(waste_quant::Level::Avx2),
                    ..ModelOptions::exact()
                },
            ));
        }
        for (what, o) in variants {
            let m = Model::open(&path, ModelOptions { ctx: CTX, ..o.clone() }).unwrap();
            // the halves: as asked, else off where the cache holds every expert, else measured
            let halves = o.halves.or(((m.cache_slots() as u64) >= plan.expert_records).then_some(false));
            assert_eq!(m.halves(), halves, "{name}, {what}: the halves in turn");
            let n = m.max_batch().min(6);
            assert!(n >= 3, "{name}, {what}: only {n} sequences fit a step");
            let got = together(&m, n);
            for (i, g) in got.iter().enumerate() {
                let want = alone(&m, i, g.len());
                assert_eq!(g.len(), STEPS - (i % 3), "{name}, {what}: sequence {i}'s steps");
                for (step, (a, b)) in g.iter().zip(&want).enumerate() {
                    assert!(a == b, "{name}, {what}: sequence {i} step {step}: logits differ from the sequence alone");
                }
            }
        }
    }
}

/// A batched step reads each distinct expert once: sequences fed the same
/// token from a cold cache miss one sequence's experts (the union of
/// identical routes), while every token counts its uses (the repeats as
/// hits) and its position. As two halves in turn, each half acquires its
/// union and the second finds the first's reads (hits): still one read.
#[test]
fn a_batched_step_reads_the_union_of_its_experts() {
    for halves in [false, true] {
        let open = || {
            let o = ModelOptions { ctx: CTX, lookahead: Some(0), halves: Some(halves), ..ModelOptions::exact() };
            Model::open(fixture("tiny.waste"), o).unwrap()
        };
        let (m, m1) = (open(), open());
        let (moe, k) = (m.config().n_moe_layers() as u64, m.config().top_k as u64);
        let n = m.max_batch().min(4);
        assert!(n >= 2);
        let mut one = m1.session();
        one.eval(&[11]).unwrap();
        assert_eq!(one.stats().experts_missed, moe * k);
        let mut ss: Vec<_> = (0..n).map(|_| m.session()).collect();
        let mut refs: Vec<_> = ss.iter_mut().collect();
        m.step_many(&mut refs, &vec![11; n]).unwrap();
        // the work is counted in each half's first session
        let counted = if halves { vec![0, n.div_ceil(2)] } else { vec![0] };
        let st = counted.iter().fold(waste_model::Stats::default(), |a, &i| a + ss[i].stats());
        assert_eq!(st.experts_missed, moe * k, "halves {halves}: each distinct expert read once");
        assert_eq!(st.bytes_read, one.stats().bytes_read);
        assert_eq!(st.experts_hit + st.experts_missed, n as u64 * moe * k, "halves {halves}: every token's uses");
        assert_eq!(st.experts_acquired, counted.len() as u64 * moe * k, "halves {halves}: the union acquired");
        assert_eq!(one.stats().experts_acquired, moe * k);
        assert!(ss.iter().all(|s| s.position() == 1 && s.stats().tokens == 1));
        for (i, s) in ss.iter().enumerate().skip(1) {
            if !counted.contains(&i) {
                let uses = s.stats().experts_hit + s.stats().experts_missed;
                assert_eq!(uses, 0, "halves {halves}: shared work is counted in a half's first session");
            }
            assert!(bits(s.logits()) == bits(one.logits()));
        }
    }
}

#[test]
fn a_batched_step_refuses_what_it_cannot_do_before_changing_anything() {
    let path = fixture("tiny.waste");
    let m = Model::open(&path, ModelOptions { ctx: 4, ..ModelOptions::exact() }).unwrap();
    let other = Model::open(&path, ModelOptions { ctx: 4, ..ModelOptions::exact() }).unwrap();
    let (mut a, mut b, mut c) = (m.session(), m.session(), other.session());
    a.eval(&[1, 2, 3]).unwrap();
    let a0 = bits(a.logits());
    let arg = |r: waste_model::Result<()>, what: &str| match r {
        Err(Error::Arg(msg)) => assert!(msg.contains(what), "{msg}"),
        other => panic!("expected an argument error naming {what:?}: {other:?}"),
    };
    arg(m.step_many(&mut [&mut a, &mut b], &[1]), "one token per session");
    arg(m.step_many(&mut [], &[]), "one token per session");
    arg(m.step_many(&mut [&mut a, &mut c], &[1, 2]), "another model");
    arg(m.step_many(&mut [&mut a, &mut b], &[1, 1 << 30]), "outside the vocabulary");
    // a plan for more sessions than a step takes is refused at the open
    for o in [
        ModelOptions { parallel: 17, ..ModelOptions::exact() },
        ModelOptions { snapshots: usize::MAX, ..ModelOptions::exact() },
    ] {
        match Model::open(&path, o) {
            Err(Error::Arg(msg)) => assert!(msg.contains("at most 16"), "{msg}"),
            other => panic!("opened: {:?}", other.err()),
        }
    }
    let mut many: Vec<_> = (0..m.max_batch() + 1).map(|_| m.session()).collect();
    let mut refs: Vec<_> = many.iter_mut().collect();
    let toks = vec![1; refs.len()];
    arg(m.step_many(&mut refs, &toks), "at most");
    a.eval(&[4]).unwrap();
    let a1 = bits(a.logits());
    assert_ne!(a0, a1);
    assert!(matches!(m.step_many(&mut [&mut b, &mut a], &[1, 2]), Err(Error::ContextFull { .. })));
    assert_eq!((a.position(), b.position()), (4, 0), "a refused step changes nothing");
    assert_eq!(bits(a.logits()), a1);
}

/// The plan for `n` sessions equals what `n` sessions and their batched
/// step allocate: each one's state and scratch, and the step's logits.
#[test]
fn the_plan_for_parallel_sessions_is_what_they_allocate() {
    for name in ["tiny.waste", "tiny-k3.waste"] {
        let path = fixture(name);
        let n = 3;
        let one = waste_model::plan(&path, CTX).unwrap().with_threads(1);
        let plan = one.with_parallel(n);
        let m = Model::open(
            &path,
            ModelOptions {
                ctx: CTX,
                threads: 1,
                parallel: n,
                budget: plan.floor_bytes + 40 * plan.record_bytes,
                ..ModelOptions::exact()
            },
        )
        .unwrap();
        assert_eq!(m.plan(), &plan, "{name}: the model's plan");
        assert_eq!(plan.floor_bytes - one.floor_bytes, plan.parallel_bytes);
        let mut ss: Vec<_> = (0..n).map(|_| m.session()).collect();
        let mut refs: Vec<_> = ss.iter_mut().collect();
        m.step_many(&mut refs, &[1, 2, 3]).unwrap();
        let (state, scratch) = ss.iter().fold((0, 0), |(a, b), s| {
            let (x, y) = s.allocated_bytes();
            (a + x, b + y)
        });
        assert_eq!(state + scratch, plan.state_bytes + plan.scratch_bytes + plan.parallel_bytes, "{name}");
    }
}

/// A snapshot of a session at its full context takes at most what the plan
/// counts for one ([`waste_model::Plan::with_snapshots`]): the state at full
/// context and the logits.
#[test]
fn a_snapshot_at_full_context_fits_its_plan() {
    for name in ["tiny.waste", "tiny-k3.waste"] {
        let path = fixture(name);
        let ctx = 24;
        let m = Model::open(&path, ModelOptions { ctx, snapshots: 2, ..ModelOptions::exact() }).unwrap();
        let plan = waste_model::plan(&path, ctx).unwrap();
        let per = plan.with_snapshots(1).snapshot_bytes;
        assert_eq!(m.plan().snapshot_bytes, 2 * per, "{name}");
        let mut s = m.session();
        s.eval(&(1..=ctx as u32).collect::<Vec<_>>()).unwrap();
        let snap = s.snapshot().bytes() as u64;
        assert!(snap <= per && snap * 10 >= per * 9, "{name}: a full-context snapshot {snap}, planned {per}");
    }
}
