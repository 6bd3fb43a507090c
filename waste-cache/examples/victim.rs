//! Time `ExpertCache::reserve` once the cache is full (every reserve
//! evicts): `cargo run --release -p waste-cache --example victim [SLOTS...]`.
use std::time::Instant;
use waste_cache::{ExpertCache, Policy};

fn main() {
    // at most a million slots (64 B each here): a size past it is skipped
    let sizes: Vec<usize> =
        std::env::args().skip(1).filter_map(|s| s.parse().ok()).filter(|&n| (1..=1 << 20).contains(&n)).collect();
    let sizes = if sizes.is_empty() { vec![500, 2000, 4000, 16000] } else { sizes };
    let (layers, experts, k) = (26u32, 256u32, 8usize);
    let moe: Vec<u32> = (1..=layers).collect();
    for slots in sizes {
        for policy in [Policy::Eta, Policy::Lru] {
            let mut c = ExpertCache::new(slots, 64, policy, false);
            c.set_layers(&moe, k);
            let mut x = 0x9e37_79b9_7f4a_7c15u64;
            let mut next = || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            };
            let (mut n, mut t) = (0u64, 0f64);
            for round in 0..200 {
                for &l in &moe {
                    for _ in 0..k {
                        // a skewed expert choice: a third of the experts take most uses
                        let e = (next() % u64::from(if next() % 4 == 0 { experts } else { experts / 3 })) as u32;
                        let key = (l, e);
                        if let waste_cache::Lookup::Ready(s) = c.lookup(key) {
                            c.touch(s);
                            continue;
                        }
                        if !matches!(c.lookup(key), waste_cache::Lookup::Miss) {
                            continue;
                        }
                        let t0 = Instant::now();
                        let s = c.reserve(key, false).expect("a slot");
                        if round >= 20 {
                            t += t0.elapsed().as_secs_f64();
                            n += 1;
                        }
                        c.mark_ready(s);
                        c.unpin(s).unwrap();
                        c.touch(s);
                    }
                }
            }
            println!(
                "{slots:>6} slots {:>4}: {:.2} µs a reserve ({n} timed)",
                policy.name(),
                t / n.max(1) as f64 * 1e6
            );
        }
    }
}
