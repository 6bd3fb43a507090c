//! The delta-rule state's row operations (KDA's recurrence): decay and
//! project a state row, the rank-one update and read-out, and both over a
//! whole state — at every SIMD level the scalar forms' bits (one fused
//! multiply-add per element, in order). Moved here from `waste-quant`
//! (issue 49: the KDA ops with KDA); the level comes from
//! `waste_quant::Level`.

use waste_quant::Level;

#[cfg(target_arch = "aarch64")]
mod aarch64;
#[cfg(target_arch = "x86_64")]
mod x86_64;

waste_quant::fma_scalar! {
    /// The scalar form of [`decay_project`].
    fn decay_project_scalar(e: f32, k: f32, row: &mut [f32], u: &mut [f32]) {
        for (sv, uj) in row.iter_mut().zip(u.iter_mut()) {
            *sv *= e;
            *uj = k.mul_add(*sv, *uj);
        }
    }
}

waste_quant::fma_scalar! {
    /// The scalar form of [`update_read`].
    fn update_read_scalar(k: f32, d: &[f32], row: &mut [f32], q: f32, o: &mut [f32]) {
        for ((sv, &dj), oj) in row.iter_mut().zip(d).zip(o.iter_mut()) {
            *sv = k.mul_add(dj, *sv);
            *oj = q.mul_add(*sv, *oj);
        }
    }
}

/// `row[j] *= e; u[j] = fma(k, row[j], u[j])` — the decay-and-project step
/// of a delta-rule state row.
///
/// # Panics
/// When the slices' lengths differ.
pub fn decay_project(level: Level, e: f32, k: f32, row: &mut [f32], u: &mut [f32]) {
    assert_eq!(row.len(), u.len());
    #[allow(unused_mut)]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if level.avx2_kernels() {
        // SAFETY: AVX2/FMA verified; equal lengths asserted.
        done = unsafe { x86_64::decay_project(e, k, row, u) };
    }
    #[cfg(target_arch = "aarch64")]
    if level.neon_kernels() {
        done = aarch64::decay_project(e, k, row, u);
    }
    let _ = level;
    decay_project_scalar(e, k, &mut row[done..], &mut u[done..]);
}

/// `row[j] = fma(k, d[j], row[j]); o[j] = fma(q, row[j], o[j])` — the
/// rank-one update of a delta-rule state row and its read-out.
///
/// # Panics
/// When the slices' lengths differ.
pub fn update_read(level: Level, k: f32, d: &[f32], row: &mut [f32], q: f32, o: &mut [f32]) {
    assert!(d.len() == row.len() && row.len() == o.len());
    #[allow(unused_mut)]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if level.avx2_kernels() {
        // SAFETY: AVX2/FMA verified; equal lengths asserted.
        done = unsafe { x86_64::update_read(k, d, row, q, o) };
    }
    #[cfg(target_arch = "aarch64")]
    if level.neon_kernels() {
        done = aarch64::update_read(k, d, row, q, o);
    }
    let _ = level;
    update_read_scalar(k, &d[done..], &mut row[done..], q, &mut o[done..]);
}

/// [`decay_project`] over a whole state: `s` holds `e.len()` rows of
/// `u.len()` columns, row `i` decayed by `e[i]` and projected with `k[i]`,
/// rows in order ([`head_step`] fuses both passes at AVX2 and above).
///
/// # Panics
/// When the lengths disagree.
pub fn decay_project_rows(level: Level, e: &[f32], k: &[f32], s: &mut [f32], u: &mut [f32]) {
    let w = u.len();
    assert!(k.len() == e.len() && s.len() == e.len() * w);
    for (i, (&ei, &ki)) in e.iter().zip(k).enumerate() {
        decay_project(level, ei, ki, &mut s[i * w..(i + 1) * w], u);
    }
}

/// [`update_read`] over a whole state: `s` holds `k.len()` rows of
/// `d.len()` columns, rows in order.
///
/// # Panics
/// When the lengths disagree.
pub fn update_read_rows(level: Level, k: &[f32], d: &[f32], s: &mut [f32], q: &[f32], o: &mut [f32]) {
    let w = d.len();
    assert!(q.len() == k.len() && o.len() == w && s.len() == k.len() * w);
    for (i, (&ki, &qi)) in k.iter().zip(q).enumerate() {
        update_read(level, ki, d, &mut s[i * w..(i + 1) * w], qi, o);
    }
}

/// One head's delta-rule step over its state `s` (`e.len()` rows of
/// `v.len()` columns): [`decay_project_rows`] into `u` (from zeros), `d[j]
/// = beta·(v[j] − u[j])`, then [`update_read_rows`] into `o` (from zeros).
/// At AVX2 (and above) for widths that are a multiple of 32, by blocks of
/// 32 columns (each column's sums depend on its own column alone), each
/// block's state read from memory once and its second pass from L1;
/// bit-identical to the two passes either way.
///
/// # Panics
/// When the lengths disagree.
#[allow(clippy::too_many_arguments)]
pub fn head_step(level: Level, e: &[f32], k: &[f32], v: &[f32], beta: f32, q: &[f32], s: &mut [f32], o: &mut [f32]) {
    let w = v.len();
    assert!(k.len() == e.len() && q.len() == e.len() && o.len() == w && s.len() == e.len() * w);
    #[cfg(target_arch = "x86_64")]
    if level.avx2_kernels() && w.is_multiple_of(32) {
        // SAFETY: AVX2/FMA verified by the level; lengths asserted above.
        return unsafe { x86_64::head_step_blocks(e, k, v, beta, q, s, o) };
    }
    let mut on_stack = [0f32; 512];
    let mut on_heap = Vec::new();
    let u = if w <= on_stack.len() {
        &mut on_stack[..w]
    } else {
        on_heap.resize(w, 0f32);
        &mut on_heap[..]
    };
    decay_project_rows(level, e, k, s, u);
    for (uj, &vj) in u.iter_mut().zip(v) {
        *uj = beta * (vj - *uj);
    }
    o.fill(0.0);
    update_read_rows(level, k, u, s, q, o);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A state of `rows × w`, its decays, keys and queries (`rows`), and a
    /// `w`-long vector (values, or the update's `d`): deterministic, mixed signs.
    struct State {
        s0: Vec<f32>,
        e: Vec<f32>,
        k: Vec<f32>,
        q: Vec<f32>,
        v: Vec<f32>,
    }
    fn state(rows: usize, w: usize) -> State {
        let f = |i: usize, m: usize, a: f32| ((i * m) % 113) as f32 / 57.0 - a;
        State {
            s0: (0..rows * w).map(|i| f(i, 7919, 1.0)).collect(),
            e: (0..rows).map(|i| 0.5 + f(i, 31, 0.0) / 4.0).collect(),
            k: (0..rows).map(|i| f(i, 104729, 0.9)).collect(),
            q: (0..rows).map(|i| f(i, 7, 1.1)).collect(),
            v: (0..w).map(|i| f(i, 97, 0.8)).collect(),
        }
    }

    /// The whole-state passes equal the scalar per-row definition bit for
    /// bit at every level, for the blocks' widths and others.
    #[test]
    fn state_passes_are_the_per_row_ops() {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (rows, w) in [(128, 128), (64, 64), (5, 128), (7, 48), (3, 37)] {
            let State { s0, e, k, q, v: d } = state(rows, w);
            let (mut s1, mut u1, mut o1) = (s0.clone(), d.clone(), d.clone());
            for i in 0..rows {
                let row = &mut s1[i * w..(i + 1) * w];
                for (sv, uj) in row.iter_mut().zip(u1.iter_mut()) {
                    *sv *= e[i];
                    *uj = k[i].mul_add(*sv, *uj);
                }
            }
            for i in 0..rows {
                let row = &mut s1[i * w..(i + 1) * w];
                for ((sv, &dj), oj) in row.iter_mut().zip(&d).zip(o1.iter_mut()) {
                    *sv = k[i].mul_add(dj, *sv);
                    *oj = q[i].mul_add(*sv, *oj);
                }
            }
            for lv in Level::available() {
                let (mut s2, mut u2, mut o2) = (s0.clone(), d.clone(), d.clone());
                decay_project_rows(lv, &e, &k, &mut s2, &mut u2);
                assert_eq!(bits(&u2), bits(&u1), "u, {rows}×{w}, level {lv:?}");
                update_read_rows(lv, &k, &d, &mut s2, &q, &mut o2);
                assert_eq!(bits(&s2), bits(&s1), "state, {rows}×{w}, level {lv:?}");
                assert_eq!(bits(&o2), bits(&o1), "read-out, {rows}×{w}, level {lv:?}");
            }
        }
    }
    /// The fused head step (blocks of 32 columns at AVX2 and above) is the
    /// two whole-state passes with `d = beta·(v − u)` between them, bit for
    /// bit at every level: widths of whole blocks (one, several, with rows
    /// fewer or more than the columns) and others (the passes themselves).
    #[test]
    fn head_step_is_the_two_passes() {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (rows, w) in [(128, 128), (64, 64), (32, 32), (5, 96), (130, 64), (7, 48), (3, 37)] {
            let State { s0, e, k, q, v } = state(rows, w);
            let beta = 0.37;
            let (mut s1, mut u, mut o1) = (s0.clone(), vec![0f32; w], vec![0f32; w]);
            decay_project_rows(Level::Scalar, &e, &k, &mut s1, &mut u);
            let d: Vec<f32> = u.iter().zip(&v).map(|(&uj, &vj)| beta * (vj - uj)).collect();
            update_read_rows(Level::Scalar, &k, &d, &mut s1, &q, &mut o1);
            for lv in Level::available() {
                let (mut s2, mut o2) = (s0.clone(), vec![f32::NAN; w]);
                head_step(lv, &e, &k, &v, beta, &q, &mut s2, &mut o2);
                assert_eq!(bits(&s2), bits(&s1), "state, {rows}×{w}, level {lv:?}");
                assert_eq!(bits(&o2), bits(&o1), "read-out, {rows}×{w}, level {lv:?}");
            }
        }
    }
    #[test]
    fn state_row_ops_are_bit_identical_across_levels() {
        // 37: two 16-wide vectors and a scalar tail; 45: 16-, 8-wide and scalar parts
        for n in [37, 45] {
            let x: Vec<f32> = (0..n).map(|i| ((i * 7919) % 113) as f32 / 57.0 - 1.0).collect();
            let d: Vec<f32> = (0..n).map(|i| ((i * 104729) % 97) as f32 / 31.0 - 1.5).collect();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let (mut row, mut u, mut o) = (x.clone(), d.clone(), x.clone());
            decay_project_scalar(0.93, -0.41, &mut row, &mut u);
            update_read_scalar(0.21, &d, &mut row, 1.7, &mut o);
            let want = (bits(&row), bits(&u), bits(&o));
            for lv in Level::available() {
                let (mut row, mut u, mut o) = (x.clone(), d.clone(), x.clone());
                decay_project(lv, 0.93, -0.41, &mut row, &mut u);
                update_read(lv, 0.21, &d, &mut row, 1.7, &mut o);
                assert_eq!((bits(&row), bits(&u), bits(&o)), want, "{n} at level {lv:?}");
            }
        }
    }
}
