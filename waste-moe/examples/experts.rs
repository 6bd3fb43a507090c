//! A token's routed experts on the Kimi-Linear-48B shape (VQ3R records,
//! 1024×2304 gate/up, 2304×1024 down, 8 experts per token): the gate/up
//! tables once, then the 8 experts either one at a time with each
//! expert's rows split across the pool (`forward`), or each whole on one
//! thread (`forward_each`). The records come from memory, as a token's do:
//! 64 tokens' worth of distinct records (170 MB) are cycled. The two ways
//! alternate in one process; prints medians and ranges per token.
//!
//! `cargo run --release -p waste-moe --example experts [-- REPS [THREADS [exact|fast]]]`

use std::time::Instant;
use waste_format::{Activation, ExpertFmt, ExpertQuant, ModelConfig, RecordLayout};
use waste_moe::{ExpertKernel, LayerBooks};
use waste_quant::vq::VqBook;
use waste_quant::{f32_to_f16, Pool};

fn main() {
    let mut args = std::env::args().skip(1);
    let reps: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(9);
    let threads: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(2);
    let fast = args.next().as_deref() == Some("fast");
    let q = ExpertQuant::standard(ExpertFmt::Vq3r);
    let cfg = ModelConfig::from_json(&serde_json::json!({"hidden_size": 2304, "num_hidden_layers": 1, "vocab_size": 4,
        "num_experts": 256, "num_experts_per_token": 8, "moe_intermediate_size": 1024, "num_attention_heads": 1,
        "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4, "kv_lora_rank": 4}))
    .unwrap();
    let lay = RecordLayout::new(&cfg, q).unwrap();
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let k = 8;
    let nrec = 64 * k;
    let scale = f32_to_f16(0.01).to_le_bytes();
    let recs: Vec<Vec<u8>> = (0..nrec)
        .map(|e| {
            let mut r: Vec<u8> = (0..lay.rec_bytes).map(|_| next() as u8).collect();
            for c in r[lay.scales_off..lay.scales_off + lay.scales_len].chunks_exact_mut(2) {
                c.copy_from_slice(&scale);
            }
            waste_format::seal_record(&mut r, 0, e, &lay, 0);
            r
        })
        .collect();
    let book = |n: &mut dyn FnMut() -> u64| {
        let bits: Vec<u16> = (0..256 * 8).map(|_| f32_to_f16(((n() % 2000) as f32 - 1000.0) * 1e-4)).collect();
        VqBook::from_f16(&bits, 256, 8)
    };
    let books = LayerBooks { books: core::array::from_fn(|_| (0..3).map(|_| book(&mut next)).collect()) };
    let kernel = ExpertKernel { lay, act: Activation::Silu, batch: 0 };
    let mut pool = Pool::new(threads);
    if fast {
        pool.set_numeric(waste_quant::fast::Numeric::Fast);
    }
    let lanes = waste_moe::lanes_for(threads, k);
    let mut sc = kernel.scratch(lanes);
    let h: Vec<f32> = (0..2304).map(|_| ((next() % 2000) as f32 - 1000.0) * 1e-3).collect();
    let mut outs = vec![0f32; k * 2304];
    let mut token = 0usize;
    let mut one_token = |each: bool, outs: &mut [f32]| {
        let t0 = Instant::now();
        kernel.prepare(&pool, &books, &h, &mut sc);
        let base = (token % 64) * k;
        token += 1;
        if each {
            let jobs: Vec<(&[u8], usize)> = (0..k).map(|i| (&recs[base + i][..], i)).collect();
            kernel.forward_each(&pool, &books, &jobs, &h, &mut sc, outs);
        } else {
            for i in 0..k {
                kernel.forward(&pool, &books, &recs[base + i], &h, &mut sc, &mut outs[i * 2304..(i + 1) * 2304]);
            }
        }
        t0.elapsed().as_secs_f64() * 1e3
    };
    let (mut a, mut b) = (vec![], vec![]);
    for _ in 0..reps {
        for _ in 0..8 {
            a.push(one_token(false, &mut outs));
            b.push(one_token(true, &mut outs));
        }
    }
    let stat = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        format!("{:.3} ms ({:.3}–{:.3})", v[v.len() / 2], v[0], v[v.len() - 1])
    };
    println!(
        "{threads} threads, {k} experts per token, {lanes} lanes, simd {}, {}",
        pool.level().name(),
        kernel.kernel_name(pool.level(), pool.numeric())
    );
    println!("  one at a time, rows split (forward):  {}", stat(&mut a));
    println!("  whole experts per thread (forward_each): {}", stat(&mut b));
}
