//! Time the vision tower at the release's shape (hidden 1024, 12 heads,
//! 27 blocks, MLP 4096, projector 4096 → 4096 → 7168) on random Q8G weights:
//!
//!     cargo run --release -p waste-vision --example tower_bench -- [PATCHES_SIDE] [RUNS] [THREADS]
//!
//! Prints each run's seconds, the median, and the achieved GFLOP/s of the
//! matrix products (2 · rows · cols per patch and matrix, attention included).

use std::time::Instant;
use waste_quant::{Pool, SplitMix64};
use waste_vision::{from_rgb8, Tower, VisionConfig};

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let side = args.first().copied().unwrap_or(32);
    let runs = args.get(1).copied().unwrap_or(3);
    let threads = args.get(2).copied().unwrap_or(0);
    let cfg = VisionConfig::from_json(
        &serde_json::json!({"text_hidden_size": 7168, "media_placeholder_token_id": 1, "max_patches": side * side}),
        7168,
        4,
    )
    .unwrap();
    let t0 = Instant::now();
    let tower = Tower::random(&cfg, 1);
    let mut rng = SplitMix64::new(2);
    eprintln!("built {:.0} MB of weights in {:.1} s", tower.weight_bytes() as f64 / 1e6, t0.elapsed().as_secs_f64());
    let px_side = side * 14;
    let mut rgb = vec![0u8; px_side * px_side * 3];
    rng.fill(&mut rgb);
    let px = from_rgb8(&cfg, px_side as u32, px_side as u32, &rgb).unwrap();
    let n = px.grid.patches() as f64;
    let (d, q, f) = (cfg.hidden as f64, cfg.qkv_hidden as f64, cfg.intermediate as f64);
    let per_block = 2.0 * n * (d * 3.0 * q + q * d + 2.0 * d * f) + 2.0 * 2.0 * n * n * q;
    let m = n / 4.0;
    let flops = 2.0 * n * d * 588.0 + cfg.layers as f64 * per_block + 2.0 * m * (16.0 * d * d + 4.0 * d * 7168.0);
    let pool = Pool::new(threads);
    let mut secs = vec![];
    for _ in 0..runs {
        let t = Instant::now();
        let out = tower.encode(&pool, &px).unwrap();
        secs.push(t.elapsed().as_secs_f64());
        assert_eq!(out.len(), px.grid.positions() * 7168);
        eprintln!("run: {:.2} s", secs.last().unwrap());
    }
    secs.sort_by(f64::total_cmp);
    let med = secs[secs.len() / 2];
    println!(
        "tower {}x{} patches, {} threads, {}: median {:.2} s (range {:.2}-{:.2}), {:.1} GFLOP, {:.1} GFLOP/s",
        side,
        side,
        pool.threads(),
        pool.level().name(),
        med,
        secs[0],
        secs[secs.len() - 1],
        flops / 1e9,
        flops / 1e9 / med
    );
}
