//! # waste-attn
//!
//! The attention math of the Kimi family, for one token or a prefill chunk:
//! Kimi Delta Attention ([`kda`]: short causal conv with a ring state, the
//! Kimi-Linear softplus decay or K3's bounded decay, beta, the delta-rule
//! state update, gated RMSNorm output) and multi-head latent attention
//! ([`mla`]: a latent cache of `kv_lora + qk_rope` floats per position,
//! absorbed decode, optional q-LoRA and sigmoid output gate), and K3's
//! Attention Residuals ([`res`]). States are plain vectors so a session can
//! serialize them.
//!
//! Matches `transformers`' `modeling_kimi_linear.py` (the reference):
//! softplus as `ln(1+exp(z))` below 20, q/k L2 norm with `+1e-6` inside the
//! square root, latent norms with eps 1e-6.
#![deny(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

pub mod delta;
pub mod kda;
pub mod mla;
pub mod res;

pub use kda::{KdaConfig, KdaGate, KdaScratch, KdaState, KdaWeights};
pub use mla::{ContextFull, MlaConfig, MlaQuery, MlaScratch, MlaState, MlaWeights};
pub use res::{attn_res, attn_res_in_place};

#[cfg(test)]
mod chunk_tests {
    //! A chunk of tokens (batched projections) against the same tokens one
    //! step at a time: bit-identical outputs and states, for 1–3 threads.
    use crate::{kda, mla};
    use waste_quant::{Matrix, Pool};

    struct Rng(u64);
    impl Rng {
        fn f(&mut self) -> f32 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
        fn v(&mut self, n: usize, s: f32) -> Vec<f32> {
            (0..n).map(|_| self.f() * s).collect()
        }
        fn m(&mut self, rows: usize, cols: usize) -> Matrix {
            let w = self.v(rows * cols, 1.0 / (cols as f32).sqrt());
            Matrix::from_stored(
                waste_format::Fmt::F32,
                rows,
                cols,
                0,
                w.iter().flat_map(|x| x.to_le_bytes()).collect(),
                &[],
            )
            .unwrap()
        }
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Every element within `tol` × the largest magnitude of `want`.
    fn within(got: &[f32], want: &[f32], tol: f32, what: &str) {
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        let err = got.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(err <= tol * scale, "{what}: max error {err} against {tol} × {scale}");
    }

    #[test]
    fn kda_chunk_equals_steps() {
        // 2 tokens: fewer than the conv ring holds; 5: more
        for nt in [2, 5] {
            kda_chunk_of(nt);
        }
    }

    fn kda_chunk_of(nt: usize) {
        let hid = 48;
        for full_gate in [false, true] {
            let c = kda::KdaConfig {
                heads: 3,
                dim: 8,
                kernel: 4,
                eps: 1e-6,
                lower_bound: full_gate.then_some(-5.0),
                chunked: false,
            };
            let ch = c.channels();
            let mut r = Rng(7 + full_gate as u64);
            let gate = if full_gate {
                kda::KdaGate::Full(r.m(ch, hid))
            } else {
                kda::KdaGate::LowRank { a: r.m(c.dim, hid), b: r.m(ch, c.dim) }
            };
            let w = kda::KdaWeights {
                q: r.m(ch, hid),
                k: r.m(ch, hid),
                v: r.m(ch, hid),
                conv: [r.v(ch * 4, 0.5), r.v(ch * 4, 0.5), r.v(ch * 4, 0.5)],
                f_a: r.m(c.dim, hid),
                f_b: r.m(ch, c.dim),
                b: r.m(c.heads, hid),
                a_log: r.v(c.heads, 0.5),
                dt_bias: r.v(ch, 0.5),
                gate,
                o_norm: r.v(c.dim, 1.0),
                o: r.m(hid, ch),
            };
            let xs = r.v(nt * hid, 1.0);
            for threads in 1..=3 {
                let pool = Pool::new(threads);
                let mut a = kda::KdaState::new(&c);
                let mut sa = kda::KdaScratch::new(&c, 1);
                let mut sb = kda::KdaScratch::new(&c, nt);
                let mut want = vec![0f32; nt * hid];
                for t in 0..nt {
                    kda::step(
                        &pool,
                        &c,
                        &w,
                        &mut a,
                        &mut sa,
                        &xs[t * hid..(t + 1) * hid],
                        &mut want[t * hid..(t + 1) * hid],
                    );
                }
                // outputs from token `first` on (a last layer's); the state takes every token
                for first in [0, 1, nt - 1, nt] {
                    let mut b = kda::KdaState::new(&c);
                    let mut got = vec![f32::NAN; nt * hid];
                    kda::chunk(&pool, &c, &w, &mut b, &mut sb, &xs, nt, first, &mut got);
                    assert_eq!(bits(&got[first * hid..]), bits(&want[first * hid..]), "from {first}");
                    assert!(got[..first * hid].iter().all(|v| v.is_nan()), "rows below {first} untouched");
                    assert_eq!(bits(&a.s), bits(&b.s));
                    assert_eq!(bits(&a.conv), bits(&b.conv));
                }
                // the chunked (WY) form: within its stated bound, the conv ring exact
                let cw = kda::KdaConfig { chunked: true, ..c };
                let mut bw = kda::KdaState::new(&c);
                let mut got = vec![0f32; nt * hid];
                kda::chunk(&pool, &cw, &w, &mut bw, &mut sb, &xs, nt, 0, &mut got);
                within(&got, &want, kda::CHUNKED_REL_TOL, "chunked outputs");
                within(&bw.s, &a.s, kda::CHUNKED_REL_TOL, "chunked state");
                assert_eq!(bits(&a.conv), bits(&bw.conv));
            }
        }
    }

    #[test]
    fn mla_chunk_equals_steps() {
        let (hid, nt) = (40, 6);
        let c = mla::MlaConfig { heads: 2, nope: 8, rope: 4, v: 8, kv_lora: 12, latent_eps: 1e-6, max_ctx: 16 };
        for lora in [false, true] {
            let mut r = Rng(11 + lora as u64);
            let qd = c.heads * (c.nope + c.rope);
            let q = if lora {
                mla::MlaQuery::Lora { a: r.m(10, hid), norm: r.v(10, 1.0), b: r.m(qd, 10) }
            } else {
                mla::MlaQuery::Plain(r.m(qd, hid))
            };
            let w = mla::MlaWeights {
                q,
                kv_a: r.m(c.latent(), hid),
                kv_a_norm: r.v(c.kv_lora, 1.0),
                kv_b: r.m(c.heads * (c.nope + c.v), c.kv_lora),
                g: lora.then(|| r.m(c.heads * c.v, hid)),
                o: r.m(hid, c.heads * c.v),
            };
            let xs = r.v(nt * hid, 1.0);
            for threads in 1..=3 {
                let pool = Pool::new(threads);
                let (mut a, mut b) = (mla::MlaState::new(&c), mla::MlaState::new(&c));
                let mut sa = mla::MlaScratch::new(&c, 10, 1);
                let mut sb = mla::MlaScratch::new(&c, 10, nt);
                let mut want = vec![0f32; nt * hid];
                for t in 0..nt {
                    mla::step(
                        &pool,
                        &c,
                        &w,
                        &mut a,
                        &mut sa,
                        &xs[t * hid..(t + 1) * hid],
                        &mut want[t * hid..(t + 1) * hid],
                    )
                    .unwrap();
                }
                // outputs from token `first` on (a last layer's); the cache takes every token
                for first in [0, 1, nt - 1, nt] {
                    b = mla::MlaState::new(&c);
                    let mut got = vec![f32::NAN; nt * hid];
                    mla::chunk(&pool, &c, &w, &mut b, &mut sb, &xs, nt, first, &mut got).unwrap();
                    assert_eq!(bits(&got[first * hid..]), bits(&want[first * hid..]), "from {first}");
                    assert!(got[..first * hid].iter().all(|v| v.is_nan()), "rows below {first} untouched");
                    assert_eq!(a.len, b.len);
                    assert_eq!(bits(&a.cache[..a.len * c.latent()]), bits(&b.cache[..b.len * c.latent()]));
                }
                // a chunk that would overflow the context is refused, state untouched
                let len = b.len;
                let mut more = vec![0f32; 3 * hid];
                let big = vec![0f32; 3 * hid];
                let mut sc = mla::MlaScratch::new(&c, 10, 3);
                let mut full = mla::MlaState::new(&c);
                full.len = c.max_ctx - 2;
                assert!(mla::chunk(&pool, &c, &w, &mut full, &mut sc, &big, 3, 0, &mut more).is_err());
                assert_eq!(full.len, c.max_ctx - 2);
                assert_eq!(b.len, len);
            }
        }
    }
}
