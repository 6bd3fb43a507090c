//! Budgets below the resident floor (issue 48): the plan streams decoder
//! layers from disk a layer at a time and the logits stay bit-identical to
//! the resident run — at several budgets down to the lowest any split
//! reaches, in prefill chunks and decode, for every fixture architecture.

use std::path::PathBuf;
use waste_model::{Error, Model, ModelOptions};

mod common;

fn fixture(name: &str) -> PathBuf {
    common::fixtures().join(name)
}

const CTX: usize = 64;

/// The prompt's logits, then 6 greedy steps' logits, as bits; and the stats.
fn run(m: &Model) -> (Vec<u32>, waste_model::Stats) {
    common::greedy_bits(m, &common::prompt(21), 6)
}

#[test]
fn budgets_below_the_floor_stream_layers_and_give_the_resident_logits() {
    for name in ["tiny.waste", "tiny-q4g.waste", "tiny-k3.waste", "tiny-k3-4.waste"] {
        let path = fixture(name);
        let o = |budget: u64| ModelOptions { ctx: CTX, budget, max_chunk: 8, ..ModelOptions::exact() };
        let resident = Model::open(&path, o(0)).unwrap();
        assert!(resident.streamed_layers().is_empty());
        let plan = *resident.plan();
        let (want, _) = run(&resident);
        drop(resident);
        // the lowest budget any split reaches, from the refusal below it
        let e = Model::open(&path, o(1 << 20)).err().expect("1 MiB is below any split");
        let Error::Budget { floor: lowest, .. } = e else { panic!("{name}: {e}") };
        assert!(lowest < plan.floor_bytes, "{name}: streaming lowers the floor ({lowest} vs {})", plan.floor_bytes);
        let (mut heads, mut layers) = (false, false);
        for budget in [plan.floor_bytes - 1, (plan.floor_bytes + lowest) / 2, lowest] {
            let m = Model::open(&path, o(budget)).unwrap_or_else(|e| panic!("{name} at {budget}: {e}"));
            let streamed = m.streamed_layers().to_vec();
            assert!(!streamed.is_empty() || m.streams_head(), "{name} at {budget}: nothing streams");
            assert!(m.plan().floor_bytes <= budget, "{name}: the split plan's floor is within the budget");
            let (got, st) = run(&m);
            assert!(
                got == want,
                "{name} at budget {budget} (streaming {streamed:?}): logits differ from the resident run"
            );
            // every streamed layer read once a step (a prefill chunk of at
            // most 8 tokens — fewer when the small cache cannot pin a
            // chunk's experts — or a decoded token); a streamed head once
            // a step that wants logits: 7 here
            let read = m.plan().streamed_read_bytes;
            assert!(
                (7 * read..=27 * read).contains(&st.trunk_bytes_read),
                "{name} at {budget}: read {} for {read} a step",
                st.trunk_bytes_read
            );
            heads |= m.streams_head();
            layers |= !streamed.is_empty();
            if m.streams_head() {
                batched_equals_alone(&m, &want);
            }
        }
        assert!(heads && layers, "{name}: the budgets stream the head and layers");
        // the automatic budget on a machine below the floor: streams
        // within its RAM, says so, same logits; a machine that holds the
        // floor runs resident even when the floor is above 7/8 of it
        let usable = plan.floor_bytes - 1;
        let m = Model::open(&path, ModelOptions { usable_ram: Some(usable), ..o(0) }).unwrap();
        assert!(m.plan().streamed_layers > 0 || m.streams_head(), "{name}: the automatic budget streams");
        assert!(m.budget() <= usable, "{name}: {} within {usable}", m.budget());
        let at_floor = Model::open(&path, ModelOptions { usable_ram: Some(plan.floor_bytes), ..o(0) }).unwrap();
        assert!(at_floor.streamed_layers().is_empty() && !at_floor.streams_head(), "{name}");
        drop(at_floor);
        assert!(m.warnings().iter().any(|w| w.contains("stream from disk")), "{name}: {:?}", m.warnings());
        assert!(run(&m).0 == want, "{name}: the automatic budget's split changes the logits");
    }
}

/// Two sessions decoded together (a batched step: the streamed head's
/// pieces as matmats) each give what the resident model gave alone.
fn batched_equals_alone(m: &Model, want: &[u32]) {
    let prompt = common::prompt(21);
    let other: Vec<u32> = (0..9).map(|i| (i * 31 + 5) % 250).collect();
    let (mut a, mut b) = (m.session(), m.session());
    let vocab = m.config().vocab;
    assert!(a.eval(&prompt).unwrap().iter().map(|v| v.to_bits()).eq(want[..vocab].iter().copied()));
    b.eval(&other).unwrap();
    m.step_many(&mut [&mut a, &mut b], &[1, 2]).unwrap();
    let got: Vec<u32> = a.logits().iter().map(|v| v.to_bits()).collect();
    assert!(got == want[vocab..2 * vocab], "a batched step with the head streamed differs from the resident run");
}
