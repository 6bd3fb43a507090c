//! A synthetic model routes like a model, not like a stuck one: on a slice
//! of the 48B shape (its real widths — the trunk matrices large enough to be
//! written as random codes, where routing once collapsed onto one expert
//! set for every token — two layers, 32 experts top-8, a small vocabulary),
//! token after token brings experts not used before. Collapsed routing
//! (every token the same 8, as before e504d6a) reads exactly 8 experts.

use waste_format::ExpertFmt;
use waste_model::{Model, ModelOptions};
use waste_synth::{shape_config, synth, SynthOptions};

#[test]
fn a_synthetic_48b_slice_routes_differently_token_to_token() {
    let dir = std::env::temp_dir().join(format!("waste-synth-routing-{}", std::process::id()));
    let mut config = shape_config("kimi-linear-48b").unwrap();
    for (k, v) in [("num_experts", 32), ("vocab_size", 1024), ("bos_token_id", 1000), ("eos_token_id", 1001)] {
        config[k] = v.into();
    }
    let o = SynthOptions {
        config,
        layers: Some(2),
        experts: ExpertFmt::Vq3r,
        seed: 7,
        manifest_only: false,
        skewed: false,
        jobs: 2,
    };
    synth(&dir, &o, &|_, _| {}).unwrap();
    // every expert fits: a miss is an expert no earlier token used
    let m = Model::open(&dir, ModelOptions { ctx: 256, budget: 1 << 30, lookahead: Some(0), ..ModelOptions::exact() })
        .unwrap();
    assert_eq!((m.config().n_moe_layers(), m.config().top_k), (1, 8));
    let mut s = m.session();
    let (mut new_at, mut last) = (0, 0);
    const M: usize = 24;
    for i in 0..M as u32 {
        s.eval(&[(i * 37 + 11) % 1000]).unwrap();
        let missed = s.stats().experts_missed;
        if i > 0 && missed > last {
            new_at += 1;
        }
        last = missed;
    }
    drop(s);
    drop(m);
    std::fs::remove_dir_all(&dir).ok();
    assert!(last >= 16, "{M} tokens read only {last} distinct experts of 32 (collapsed routing reads 8)");
    assert!(new_at >= 4, "only {new_at} of the {} later tokens used an expert not used before", M - 1);
}
