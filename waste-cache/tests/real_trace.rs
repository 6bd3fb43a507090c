//! The real Kimi-Linear-48B routing trace (testdata/routing): LFRU must
//! not collapse where LRU does, and Belady bounds every online policy.

use std::path::Path;
use waste_cache::{parse_trace, simulate, Policy};

fn trace() -> waste_cache::Trace {
    let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata");
    parse_trace(
        &std::fs::read_to_string(base.join("routing/kimi-linear-48b-300tok.jsonl")).expect("shared routing trace"),
    )
    .unwrap()
}

#[test]
fn lfru_survives_small_caches_and_belady_bounds_all() {
    let t = trace();
    assert_eq!(t.len(), 300);
    for slots in [100, 200, 399, 799, 1597, 3195] {
        let lfru = simulate(&t, slots, Policy::Lfru).unwrap().hit_rate();
        let lru = simulate(&t, slots, Policy::Lru).unwrap().hit_rate();
        let bel = simulate(&t, slots, Policy::Belady).unwrap().hit_rate();
        assert!(bel >= lfru && bel >= lru, "{slots}: belady {bel} below lfru {lfru} / lru {lru}");
        if slots <= 200 {
            // 1.5% and 3% of the 6,656 experts: LRU thrashes, LFRU keeps a useful fraction
            assert!(lfru > lru + 0.1, "{slots}: lfru {lfru} vs lru {lru}");
        }
    }
}
