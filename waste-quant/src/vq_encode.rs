//! The residual-VQ encoder for the converter: k-means codebooks per stage
//! (fitted on residuals of a sample), per-row RMS scales, greedy residual
//! encoding with a fused nearest-centroid search (no distance matrix).

use crate::level::{level, Level};
use crate::vq::{VqBook, VqLayout};
use crate::SplitMix64 as Rng;
use waste_format::half::{f16_to_f32, f32_to_f16};

/// A codebook prepared for nearest-entry search: entries transposed
/// (`dim × entries`) for 8-wide SIMD, and their squared norms.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // the transposed form feeds the x86 kernel
pub struct Searcher {
    entries: usize,
    dim: usize,
    book: Vec<f32>,
    bt: Vec<f32>,
    norms: Vec<f32>,
    level: Level,
}

impl Searcher {
    /// Prepare `book` (`entries × dim`).
    pub fn new(book: &[f32], dim: usize, level: Level) -> Searcher {
        let entries = book.len() / dim;
        let mut bt = vec![0f32; entries * dim];
        for e in 0..entries {
            for d in 0..dim {
                bt[d * entries + e] = book[e * dim + d];
            }
        }
        let norms = book.chunks_exact(dim).map(|c| c.iter().map(|v| v * v).sum()).collect();
        Searcher { entries, dim, book: book.to_vec(), bt, norms, level }
    }
    /// Index of the entry nearest to `x`: the scalar [`nearest`], computed
    /// 8 entries at a time where the CPU allows, bit-identically (mul then
    /// add per dim, `‖c‖² − 2·dot`, first minimum wins).
    pub fn find(&self, x: &[f32]) -> usize {
        #[cfg(target_arch = "x86_64")]
        if self.level.avx2_kernels() && self.entries.is_multiple_of(8) {
            // SAFETY: AVX2 checked; bt holds dim × entries floats; x holds dim floats.
            return unsafe { find_avx2(&self.bt, &self.norms, self.entries, self.dim, x) };
        }
        nearest(&self.book, &self.norms, self.dim, x)
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn find_avx2(bt: &[f32], norms: &[f32], entries: usize, dim: usize, x: &[f32]) -> usize {
    use core::arch::x86_64::*;
    let mut best_d = _mm256_set1_ps(f32::INFINITY);
    let mut best_i = _mm256_set1_epi32(0);
    let two = _mm256_set1_ps(2.0);
    let mut idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let eight = _mm256_set1_epi32(8);
    for e in (0..entries).step_by(8) {
        // SAFETY: e + 8 <= entries; every row of bt has `entries` floats.
        unsafe {
            let mut dot = _mm256_mul_ps(_mm256_set1_ps(x[0]), _mm256_loadu_ps(bt.as_ptr().add(e)));
            for d in 1..dim {
                dot = _mm256_add_ps(
                    dot,
                    _mm256_mul_ps(_mm256_set1_ps(x[d]), _mm256_loadu_ps(bt.as_ptr().add(d * entries + e))),
                );
            }
            let dist = _mm256_sub_ps(_mm256_loadu_ps(norms.as_ptr().add(e)), _mm256_mul_ps(two, dot));
            // strictly less: the earlier entry of a lane keeps ties
            let lt = _mm256_cmp_ps::<_CMP_LT_OQ>(dist, best_d);
            best_d = _mm256_blendv_ps(best_d, dist, lt);
            best_i = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(best_i), _mm256_castsi256_ps(idx), lt));
        }
        idx = _mm256_add_epi32(idx, eight);
    }
    let mut bd = [0f32; 8];
    let mut bi = [0i32; 8];
    // SAFETY: 8-element arrays.
    unsafe {
        _mm256_storeu_ps(bd.as_mut_ptr(), best_d);
        _mm256_storeu_si256(bi.as_mut_ptr() as *mut __m256i, best_i);
    }
    // across lanes: the smallest distance, then the lowest index
    let mut k = 0;
    for j in 1..8 {
        if bd[j] < bd[k] || (bd[j] == bd[k] && bi[j] < bi[k]) {
            k = j;
        }
    }
    bi[k] as usize
}

/// Index of the entry nearest to `x` (`‖c‖² − 2 x·c`, lowest index on ties).
#[inline]
pub fn nearest(book: &[f32], norms: &[f32], dim: usize, x: &[f32]) -> usize {
    let mut best = 0;
    let mut bd = f32::INFINITY;
    for (e, c) in book.chunks_exact(dim).enumerate() {
        let mut dot = 0f32;
        for d in 0..dim {
            dot += x[d] * c[d];
        }
        let dist = norms[e] - 2.0 * dot;
        if dist < bd {
            bd = dist;
            best = e;
        }
    }
    best
}

/// k-means (Lloyd) on `points` (`n × dim`), `k` centroids rounded to f16.
/// Returns the f16 bits.
pub fn kmeans(points: &[f32], dim: usize, k: usize, iters: usize, seed: u64) -> Vec<u16> {
    let n = points.len() / dim;
    let mut rng = Rng::new(seed ^ 0xC0DE);
    let mut cent: Vec<f32> = (0..k)
        .flat_map(|_| {
            let i = rng.below(n);
            points[i * dim..(i + 1) * dim].to_vec()
        })
        .collect();
    if n == 0 {
        cent.fill(0.0);
    }
    let mut assign = vec![0usize; n];
    for _ in 0..iters {
        let srch = Searcher::new(&cent, dim, level());
        for (i, a) in assign.iter_mut().enumerate() {
            *a = srch.find(&points[i * dim..(i + 1) * dim]);
        }
        let mut sum = vec![0f64; k * dim];
        let mut cnt = vec![0usize; k];
        for (i, &a) in assign.iter().enumerate() {
            cnt[a] += 1;
            for d in 0..dim {
                sum[a * dim + d] += points[i * dim + d] as f64;
            }
        }
        for e in 0..k {
            if cnt[e] == 0 {
                // re-seed an empty cluster on a random point
                let i = rng.below(n);
                cent[e * dim..(e + 1) * dim].copy_from_slice(&points[i * dim..(i + 1) * dim]);
            } else {
                for d in 0..dim {
                    cent[e * dim + d] = (sum[e * dim + d] / cnt[e] as f64) as f32;
                }
            }
        }
    }
    cent.iter().map(|&v| f32_to_f16(v)).collect()
}

/// Fit `stages` residual codebooks on normalized sample vectors (`n × dim`).
pub fn fit_books(samples: &[f32], dim: usize, stages: usize, entries: usize, iters: usize, seed: u64) -> Vec<Vec<u16>> {
    let mut resid = samples.to_vec();
    let mut books = Vec::with_capacity(stages);
    for s in 0..stages {
        let bits = kmeans(&resid, dim, entries, iters, seed.wrapping_add(s as u64 * 7919));
        let book: Vec<f32> = bits.iter().map(|&b| f16_to_f32(b)).collect();
        let srch = Searcher::new(&book, dim, level());
        for x in resid.chunks_exact_mut(dim) {
            let e = srch.find(x);
            for d in 0..dim {
                x[d] -= book[e * dim + d];
            }
        }
        books.push(bits);
    }
    books
}

/// Per-row scale: the row's RMS, rounded to f16 (1 for an all-zero row).
pub fn row_scale(row: &[f32]) -> u16 {
    let ms = row.iter().map(|v| (*v as f64) * (*v as f64)).sum::<f64>() / row.len().max(1) as f64;
    let s = ms.sqrt() as f32;
    f32_to_f16(if s > 0.0 && s.is_finite() { s } else { 1.0 })
}

/// Normalized sample vectors of a matrix: up to `max` random rows' vectors.
pub fn sample_vectors(w: &[f32], rows: usize, cols: usize, dim: usize, max_rows: usize, seed: u64, out: &mut Vec<f32>) {
    let mut rng = Rng::new(seed);
    for _ in 0..max_rows.min(rows) {
        let r = rng.below(rows);
        let row = &w[r * cols..(r + 1) * cols];
        let s = f16_to_f32(row_scale(row));
        out.extend(row.iter().map(|v| v / s));
    }
    let _ = dim;
}

/// Encode `w` (`rows × cols`) into indices (laid out by `lay`) and per-row
/// f16 scales; returns `(Σ error², Σ w²)` of the reconstruction.
pub fn encode_matrix(
    w: &[f32],
    cols: usize,
    books: &[&VqBook],
    lay: &VqLayout,
    idx: &mut [u8],
    scales: &mut [u8],
) -> (f64, f64) {
    let dim = books[0].dim;
    let searchers: Vec<Searcher> = books.iter().map(|b| Searcher::new(&b.cb, dim, level())).collect();
    let (mut err, mut tot) = (0f64, 0f64);
    let mut x = vec![0f32; dim];
    for r in 0..lay.rows {
        let row = &w[r * cols..(r + 1) * cols];
        let sb = row_scale(row);
        scales[2 * r..2 * r + 2].copy_from_slice(&sb.to_le_bytes());
        let s = f16_to_f32(sb);
        for v in 0..lay.nvec {
            for d in 0..dim {
                x[d] = row[v * dim + d] / s;
            }
            let mut ix = [0usize; 8];
            for (st, b) in books.iter().enumerate() {
                let e = searchers[st].find(&x);
                ix[st] = e;
                for d in 0..dim {
                    x[d] -= b.cb[e * dim + d];
                }
            }
            // x now holds the normalized residual: the error is x·σ
            for d in 0..dim {
                let orig = row[v * dim + d] as f64;
                err += ((x[d] * s) as f64).powi(2);
                tot += orig * orig;
            }
            let o = lay.offset(r, v);
            if lay.packed6 {
                let bits = ix[0] | ix[1] << 6 | ix[2] << 12 | ix[3] << 18;
                idx[o] = bits as u8;
                idx[o + 1] = (bits >> 8) as u8;
                idx[o + 2] = (bits >> 16) as u8;
            } else {
                for st in 0..lay.stages {
                    idx[o + st] = ix[st] as u8;
                }
            }
        }
    }
    (err, tot)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vq::dequant_row;

    #[test]
    fn simd_search_is_bit_identical_to_scalar() {
        let mut rng = Rng::new(11);
        let mut g = || ((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0;
        for entries in [64usize, 256] {
            let book: Vec<f32> = (0..entries * 8).map(|_| g()).collect();
            // duplicate entries create exact ties: the first must win everywhere
            let mut book = book;
            let (a, b) = book.split_at_mut(40 * 8);
            b[..8].copy_from_slice(&a[8..16]);
            let scalar = Searcher::new(&book, 8, Level::Scalar);
            for lv in Level::available() {
                let s = Searcher::new(&book, 8, lv);
                for i in 0..2000 {
                    let x: Vec<f32> = if i % 10 == 0 { book[8..16].to_vec() } else { (0..8).map(|_| g()).collect() };
                    assert_eq!(s.find(&x), scalar.find(&x), "level {lv:?}");
                }
            }
        }
    }

    #[test]
    fn encode_decode_roundtrip_error_is_small_and_matches_the_decoder() {
        let (rows, cols, dim) = (40, 64, 8);
        let mut rng = Rng::new(5);
        let w: Vec<f32> =
            (0..rows * cols).map(|_| ((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.2).collect();
        let mut samples = Vec::new();
        sample_vectors(&w, rows, cols, dim, rows, 1, &mut samples);
        for (stages, entries, packed) in [(3, 256, false), (4, 64, true), (2, 256, false)] {
            let bits = fit_books(&samples, dim, stages, entries, 6, 9);
            let books: Vec<VqBook> = bits.iter().map(|b| VqBook::from_f16(b, entries, dim)).collect();
            let br: Vec<&VqBook> = books.iter().collect();
            let lay = VqLayout { rows, nvec: cols / dim, stages, block: 64, packed6: packed };
            let mut idx = vec![0u8; lay.index_bytes()];
            let mut sc = vec![0u8; rows * 2];
            let (err, tot) = encode_matrix(&w, cols, &br, &lay, &mut idx, &mut sc);
            let rel = (err / tot).sqrt();
            assert!(rel < 0.35, "stages {stages}: rel {rel}");
            // the decoder reproduces what the encoder measured
            let mut e2 = 0f64;
            let mut row = vec![0f32; cols];
            for r in 0..rows {
                dequant_row(&br, &lay, &idx, &sc, r, &mut row);
                e2 += row.iter().zip(&w[r * cols..]).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>();
            }
            assert!(((e2 / tot).sqrt() - rel).abs() < 1e-3, "{} vs {rel}", (e2 / tot).sqrt());
        }
    }
}
