//! One Q4G expert of the Kimi-Linear-48B shape (1024×2304 gate/up,
//! 2304×1024 down, 3.6 MB) over a batch of n tokens (`forward_batch`: one
//! matmat per matrix, rows split across the pool) against the same n
//! tokens one at a time (`forward`), for n = 1, 2, 4, 8, 16, 32. 64
//! distinct records (230 MB) are cycled, so weights come from memory as a
//! prefill chunk's do. Prints the median time per token-use of each form,
//! then single-token experts two at a time, each whole on one thread
//! (`forward_each`, the decode form), against one at a time rows split.
//!
//! `cargo run --release -p waste-moe --example q4g_batch [-- REPS [THREADS]]`

use std::time::Instant;
use waste_format::{Activation, ExpertFmt, ExpertQuant, ModelConfig, RecordLayout};
use waste_moe::{ExpertKernel, LayerBooks};
use waste_quant::{f32_to_f16, Pool, SplitMix64};

fn main() {
    let mut args = std::env::args().skip(1);
    let reps: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(9);
    let threads: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(2);
    let cfg = ModelConfig::from_json(&serde_json::json!({"hidden_size": 2304, "num_hidden_layers": 1, "vocab_size": 4,
        "num_experts": 64, "num_experts_per_token": 8, "moe_intermediate_size": 1024, "num_attention_heads": 1,
        "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4, "kv_lora_rank": 4}))
    .unwrap();
    let lay = RecordLayout::new(&cfg, ExpertQuant::standard(ExpertFmt::Q4g)).unwrap();
    let mut rng = SplitMix64::new(7);
    let scale = f32_to_f16(0.004).to_le_bytes();
    let recs: Vec<Vec<u8>> = (0..64)
        .map(|e| {
            let mut r: Vec<u8> = (0..lay.rec_bytes).map(|_| rng.next_u64() as u8).collect();
            for c in r[lay.scales_off..lay.scales_off + lay.scales_len].chunks_exact_mut(2) {
                c.copy_from_slice(&scale);
            }
            waste_format::seal_record(&mut r, 0, e, &lay, 0);
            r
        })
        .collect();
    let kernel = ExpertKernel { lay, act: Activation::Silu, batch: 32 };
    let pool = Pool::new(threads);
    let mut sc = kernel.scratch(1);
    let books = LayerBooks::default();
    let xs: Vec<f32> = (0..32 * 2304).map(|_| (rng.next_u64() % 2001) as f32 * 1e-3 - 1.0).collect();
    let mut out = vec![0f32; 2304];
    let mut r = 0usize;
    println!("threads {threads}, level {:?}; µs per token-use, median of {reps} (range)", pool.level());
    for n in [1usize, 2, 4, 8, 16, 32] {
        let (mut tb, mut t1) = (vec![], vec![]);
        for _ in 0..reps {
            // 16 experts per measurement, each over the same n tokens
            let t0 = Instant::now();
            for _ in 0..16 {
                r = (r + 1) % recs.len();
                sc.batch_in[..n * 2304].copy_from_slice(&xs[..n * 2304]);
                kernel.forward_batch(&pool, &recs[r], n, &mut sc);
            }
            tb.push(t0.elapsed().as_secs_f64() * 1e6 / (16 * n) as f64);
            let t0 = Instant::now();
            for _ in 0..16 {
                r = (r + 1) % recs.len();
                for t in 0..n {
                    kernel.forward(&pool, &books, &recs[r], &xs[t * 2304..(t + 1) * 2304], &mut sc, &mut out);
                }
            }
            t1.push(t0.elapsed().as_secs_f64() * 1e6 / (16 * n) as f64);
        }
        let med = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            format!("{:.0} ({:.0}–{:.0})", v[v.len() / 2], v[0], v[v.len() - 1])
        };
        println!("n {n:2}: batch {} µs, one at a time {} µs", med(&mut tb), med(&mut t1));
    }
    // single-token experts two at a time, each whole on one thread (the
    // decode form, `forward_each`) against one at a time with rows split
    let mut sc2 = kernel.scratch(threads);
    let mut outs = vec![0f32; threads * 2304];
    let (mut te, mut t1) = (vec![], vec![]);
    for _ in 0..reps {
        let t0 = Instant::now();
        for _ in 0..16 / threads {
            let jobs: Vec<(&[u8], usize)> = (0..threads)
                .map(|j| {
                    r = (r + 1) % recs.len();
                    (&recs[r][..], j)
                })
                .collect();
            kernel.forward_each(&pool, &books, &jobs, &xs[..2304], &mut sc2, &mut outs);
        }
        te.push(t0.elapsed().as_secs_f64() * 1e6 / (16 / threads * threads) as f64);
        let t0 = Instant::now();
        for _ in 0..16 {
            r = (r + 1) % recs.len();
            kernel.forward(&pool, &books, &recs[r], &xs[..2304], &mut sc, &mut out);
        }
        t1.push(t0.elapsed().as_secs_f64() * 1e6 / 16.0);
    }
    te.sort_by(f64::total_cmp);
    t1.sort_by(f64::total_cmp);
    println!(
        "single-token experts: whole per thread {:.0} µs, rows split {:.0} µs",
        te[te.len() / 2],
        t1[t1.len() / 2]
    );
}
