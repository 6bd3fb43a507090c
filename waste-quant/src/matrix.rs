//! Dense (trunk) matrices in F32 / F16 / BF16 / Q8G / Q4G and their
//! matrix-vector products.

use crate::formats::Stored;
use crate::level::Level;
use crate::scalar::{self, LANES};
use waste_format::Fmt;

/// A borrowed matrix `[rows, cols]` in one of the trunk formats.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a> {
    /// Storage format.
    pub fmt: Fmt,
    /// Rows (outputs).
    pub rows: usize,
    /// Columns (inputs).
    pub cols: usize,
    /// Group size (Q8G/Q4G).
    pub group: usize,
    /// Payload, `rows × row_bytes`.
    pub data: &'a [u8],
    /// Per-group scales, `rows × groups_per_row` (Q8G/Q4G), f16 bits (as stored).
    pub scales: &'a [u16],
}

/// Errors building a matrix view from untrusted sizes.
#[derive(Debug, PartialEq, Eq)]
pub struct ShapeError(pub String);

impl std::fmt::Display for ShapeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::error::Error for ShapeError {}

impl<'a> MatRef<'a> {
    /// Columns padded to the group (grouped formats), else `cols`.
    pub fn cols_padded(&self) -> usize {
        self.fmt.cols_padded(self.cols as u64, self.group as u64) as usize
    }
    /// Payload bytes per row.
    pub fn row_bytes(&self) -> usize {
        self.fmt.row_bytes(self.cols as u64, self.group as u64) as usize
    }
    /// Scale groups per row.
    pub fn groups(&self) -> usize {
        self.fmt.groups_per_row(self.cols as u64, self.group as u64) as usize
    }
    /// Build a view, checking every size.
    ///
    /// # Errors
    /// [`ShapeError`] for an odd or zero group, an overflowing size, or a payload or scales too short.
    pub fn new(
        fmt: Fmt,
        rows: usize,
        cols: usize,
        group: usize,
        data: &'a [u8],
        scales: &'a [u16],
    ) -> Result<Self, ShapeError> {
        let m = MatRef { fmt, rows, cols, group, data, scales };
        if fmt.is_grouped() && (group == 0 || !group.is_multiple_of(2)) {
            return Err(ShapeError(format!("group {group} must be even and non-zero")));
        }
        let need = rows.checked_mul(m.row_bytes()).ok_or_else(|| ShapeError("size overflows".into()))?;
        if data.len() < need {
            return Err(ShapeError(format!("payload {} bytes, {rows}x{cols} {} needs {need}", data.len(), fmt.name())));
        }
        if scales.len() < rows * m.groups() {
            return Err(ShapeError(format!("{} scales, need {}", scales.len(), rows * m.groups())));
        }
        Ok(m)
    }

    /// Dequantize `len` weights of row `r` starting at column `c0` (exact):
    /// the format's registered definition ([`crate::formats`]).
    pub fn dequant(&self, r: usize, c0: usize, out: &mut [f32]) {
        (crate::formats::tensor_format(self.fmt).dequant)(self, r, c0, out)
    }

    /// Dequantize a whole row.
    pub fn row(&self, r: usize, out: &mut [f32]) {
        self.dequant(r, 0, &mut out[..self.cols]);
    }

    /// `acc[j] = fma(coef[i], W[r0 + i][j], acc[j])` over the rows `i` in
    /// order: the transposed product of a row range (MLA's absorbed query
    /// `W_kbᵀ q`). Defined as dequantizing each row and [`crate::ops::axpy`];
    /// AVX-512 and AVX2 decode the weights in registers instead, bit-identical.
    ///
    /// # Panics
    /// When `acc.len() != cols` or the rows are out of range.
    pub fn rows_axpy(&self, level: Level, r0: usize, coef: &[f32], acc: &mut [f32]) {
        assert_eq!(acc.len(), self.cols, "rows_axpy output length");
        assert!(r0 + coef.len() <= self.rows, "rows_axpy rows out of range");
        #[cfg(target_arch = "x86_64")]
        if level == Level::Avx512
            && Level::Avx512.supported()
            && self.cols.is_multiple_of(crate::scalar::LANES)
            && (!self.fmt.is_grouped() || self.group.is_multiple_of(crate::scalar::LANES))
        {
            // SAFETY: AVX-512 F/BW/VL + F16C verified; lengths, rows and the group asserted.
            unsafe { crate::x86_64::avx512::rows_axpy(self, r0, coef, acc) };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if level.avx2_kernels()
            && self.cols.is_multiple_of(crate::scalar::LANES)
            && (!self.fmt.is_grouped() || self.group.is_multiple_of(crate::scalar::LANES))
        {
            // SAFETY: AVX2/FMA/F16C verified; lengths, rows and the group asserted.
            unsafe { crate::x86_64::avx2::rows_axpy(self, r0, coef, acc) };
            return;
        }
        // a stack buffer of up to 256 weights at a time (no allocation per call)
        let mut buf = [0f32; 256];
        for (i, &c) in coef.iter().enumerate() {
            for (c0, part) in (0..self.cols).step_by(buf.len()).zip(acc.chunks_mut(buf.len())) {
                let w = &mut buf[..part.len()];
                self.dequant(r0 + i, c0, w);
                crate::ops::axpy_at(level, c, w, part);
            }
        }
    }

    /// `y[i] = W[row0 + i] · x` for `i < y.len()`, at a given SIMD level.
    /// Bit-identical across levels. `x.len() == cols`.
    ///
    /// # Panics
    /// When `x.len() != cols` or the rows `row0..row0 + y.len()` are out of range.
    pub fn matvec_rows(&self, level: Level, x: &[f32], row0: usize, y: &mut [f32]) {
        assert_eq!(x.len(), self.cols, "matvec input length");
        assert!(row0 + y.len() <= self.rows, "matvec rows out of range");
        #[cfg(target_arch = "x86_64")]
        if level == Level::Avx512 && Level::Avx512.supported() {
            // SAFETY: AVX-512 F/BW/VL + AVX2/FMA/F16C verified just above; sizes checked by MatRef::new and the asserts.
            unsafe { crate::x86_64::avx512::matvec_rows(self, x, row0, y) };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if level.avx2_kernels() {
            // SAFETY: AVX2/FMA/F16C verified just above; sizes checked by MatRef::new and the asserts.
            unsafe { crate::x86_64::avx2::matvec_rows(self, x, row0, y) };
            return;
        }
        #[cfg(target_arch = "aarch64")]
        if level.neon_kernels() {
            // SAFETY: NEON verified just above; sizes checked by MatRef::new and the asserts.
            unsafe { crate::aarch64::neon::matvec_rows(self, x, row0, y) };
            return;
        }
        let _ = level;
        for (i, yo) in y.iter_mut().enumerate() {
            *yo = self.row_dot_scalar(row0 + i, x);
        }
    }

    /// Several inputs at once: `ys[t·ys_stride + i] = W[row0 + i] · xs[t·cols..]`
    /// for `i < n`, `t < nt`. Each weight row is read once for all `nt` inputs
    /// (it stays in L1 across them) and every element is the same dot as
    /// [`MatRef::matvec_rows`] computes — bit-identical to `nt` matvecs.
    ///
    /// # Safety
    /// `ys` must be valid for writes at every `t·ys_stride + i` (`t < nt`,
    /// `i < n`), and no other thread may touch those elements meanwhile.
    ///
    /// # Panics
    /// When `xs.len() != nt · cols`, the rows are out of range, or `ys_stride < n` with several inputs.
    pub unsafe fn matmat_rows(
        &self,
        level: Level,
        xs: &[f32],
        nt: usize,
        row0: usize,
        n: usize,
        ys: *mut f32,
        ys_stride: usize,
    ) {
        assert_eq!(xs.len(), nt * self.cols, "matmat input length");
        assert!(row0 + n <= self.rows, "matmat rows out of range");
        assert!(nt <= 1 || ys_stride >= n);
        #[cfg(target_arch = "x86_64")]
        if level == Level::Avx512 && Level::Avx512.supported() {
            // SAFETY: AVX-512 F/BW/VL + AVX2/FMA/F16C verified just above; sizes asserted; ys per the contract.
            unsafe { crate::x86_64::avx512::matmat_rows(self, xs, nt, row0, n, ys, ys_stride) };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if level.avx2_kernels() {
            // SAFETY: AVX2/FMA/F16C verified just above; sizes asserted; ys per the contract.
            unsafe { crate::x86_64::avx2::matmat_rows(self, xs, nt, row0, n, ys, ys_stride) };
            return;
        }
        #[cfg(target_arch = "aarch64")]
        if level.neon_kernels() {
            // SAFETY: NEON verified just above; sizes asserted; ys per the contract.
            unsafe { crate::aarch64::neon::matmat_rows(self, xs, nt, row0, n, ys, ys_stride) };
            return;
        }
        let _ = level; // the scalar definition serves every other level
                       // SAFETY: per the contract.
        unsafe {
            matmat_groups::<1>(self, xs, nt, row0, n, ys, ys_stride, |r, x, out| out[0] = self.row_dot_scalar(r, x))
        };
    }

    /// Canonical scalar dot of row `r` with `x`.
    pub fn row_dot_scalar(&self, r: usize, x: &[f32]) -> f32 {
        const CH: usize = 8 * LANES;
        let mut acc = [0f32; LANES];
        let mut w = [0f32; CH];
        let mut c = 0;
        while c < self.cols {
            let n = (self.cols - c).min(CH);
            let np = n.div_ceil(LANES) * LANES;
            self.dequant(r, c, &mut w[..n]);
            w[n..np].fill(0.0);
            if n == np {
                scalar::dot_acc(&mut acc, &w[..np], &x[c..c + n]);
            } else {
                let mut xt = [0f32; CH];
                xt[..n].copy_from_slice(&x[c..c + n]);
                scalar::dot_acc(&mut acc, &w[..np], &xt[..np]);
            }
            c += n;
        }
        scalar::reduce(&acc)
    }
}

/// The loop every matmat kernel shares: for each row `row0 + i` (`i < n`)
/// and each group of up to `M` consecutive tokens, `dots(row, inputs, out)`
/// computes the row's dot with each of the group's inputs (`inputs` holds
/// `out.len()` of them, `cols` floats each) and the results are stored at
/// `ys[t·ys_stride + i]`.
///
/// # Safety
/// As [`MatRef::matmat_rows`]: `ys` valid for writes at every
/// `t·ys_stride + i` and touched by no other thread meanwhile.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn matmat_groups<const M: usize>(
    m: &MatRef<'_>,
    xs: &[f32],
    nt: usize,
    row0: usize,
    n: usize,
    ys: *mut f32,
    ys_stride: usize,
    mut dots: impl FnMut(usize, &[f32], &mut [f32]),
) {
    let cols = m.cols;
    for i in 0..n {
        let mut t = 0;
        while t < nt {
            let k = (nt - t).min(M);
            let mut out = [0f32; M];
            dots(row0 + i, &xs[t * cols..(t + k) * cols], &mut out[..k]);
            for (j, v) in out[..k].iter().enumerate() {
                // SAFETY: per the contract.
                unsafe { *ys.add((t + j) * ys_stride + i) = *v };
            }
            t += k;
        }
    }
}

/// An owned matrix (trunk tensor loaded in RAM).
#[derive(Clone, Debug)]
pub struct Matrix {
    /// Format.
    pub fmt: Fmt,
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// Group size.
    pub group: usize,
    /// Payload.
    pub data: Payload,
    /// Scales as f16 bits (converted in the kernels; half the memory of f32).
    pub scales: Vec<u16>,
}

/// A matrix's payload bytes: from the allocator, or a buffer of its own
/// that starts on a 2 MiB boundary with huge pages behind its whole 2 MiB
/// blocks ([`waste_io::AlignedBuf::try_huge_blocks`]: the trunk's matrices,
/// streamed once a token, whole in huge pages but their tails).
pub enum Payload {
    /// From the allocator.
    Vec(Vec<u8>),
    /// A buffer of its own.
    Aligned(waste_io::AlignedBuf),
}

impl Payload {
    /// Bytes allocated for it.
    pub fn capacity(&self) -> usize {
        match self {
            Payload::Vec(v) => v.capacity(),
            Payload::Aligned(b) => b.capacity(),
        }
    }
}

impl core::ops::Deref for Payload {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Payload::Vec(v) => v,
            Payload::Aligned(b) => b,
        }
    }
}

impl core::fmt::Debug for Payload {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let kind = if matches!(self, Payload::Vec(_)) { "Vec" } else { "Aligned" };
        write!(f, "Payload::{kind}({} bytes)", self.len())
    }
}

impl Clone for Payload {
    /// A copy from the allocator (a clone is no trunk matrix).
    fn clone(&self) -> Self {
        Payload::Vec(self.to_vec())
    }
}

impl From<Vec<u8>> for Payload {
    fn from(v: Vec<u8>) -> Self {
        Payload::Vec(v)
    }
}

impl From<waste_io::AlignedBuf> for Payload {
    fn from(b: waste_io::AlignedBuf) -> Self {
        Payload::Aligned(b)
    }
}

impl Matrix {
    /// Build from stored bytes: payload and raw f16 scale bytes.
    ///
    /// # Errors
    /// [`ShapeError`] when the payload or scales are shorter than the shape
    /// needs, or a stored value is not finite (an f16 scale, or an F32 /
    /// F16 / BF16 weight, that is infinite or NaN): such a matrix would turn
    /// every activation it touches into NaN, so it is refused where it is
    /// loaded, naming the element, not found later as wrong text.
    pub fn from_stored(
        fmt: Fmt,
        rows: usize,
        cols: usize,
        group: usize,
        data: Vec<u8>,
        scale_bytes: &[u8],
    ) -> Result<Matrix, ShapeError> {
        Self::from_payload(fmt, rows, cols, group, Payload::Vec(data), scale_bytes)
    }
    /// [`Matrix::from_stored`] for a payload in either of its homes.
    ///
    /// # Errors
    /// As [`Matrix::from_stored`].
    pub fn from_payload(
        fmt: Fmt,
        rows: usize,
        cols: usize,
        group: usize,
        data: Payload,
        scale_bytes: &[u8],
    ) -> Result<Matrix, ShapeError> {
        let scales: Vec<u16> = scale_bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
        let m = Matrix { fmt, rows, cols, group, data, scales };
        m.view_checked()?;
        m.check_finite()?;
        Ok(m)
    }
    /// The first non-finite stored value, as an error naming it.
    fn check_finite(&self) -> Result<(), ShapeError> {
        // f16 and bf16 are non-finite when their exponent bits are all ones
        let half_bad = |h: u16, exp: u16| h & exp == exp;
        let v = self.view();
        let bad = |what: &str, row: usize, at: usize, bits: String| {
            Err(ShapeError(format!("{what} {at} of row {row} is not finite ({bits}): the tensor is damaged")))
        };
        let used = &self.scales[..v.rows * v.groups()];
        if let Some(i) = used.iter().position(|&h| !waste_format::half::f16_is_finite(h)) {
            return bad("scale group", i / v.groups(), i % v.groups(), format!("f16 0x{:04x}", used[i]));
        }
        let data = &self.data[..v.rows * v.row_bytes()];
        match crate::formats::tensor_format(self.fmt).stored {
            Stored::F32Words => {
                let words = data.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]));
                if let Some((i, w)) = words.enumerate().find(|(_, w)| w & 0x7F80_0000 == 0x7F80_0000) {
                    return bad("column", i / v.cols, i % v.cols, format!("f32 0x{w:08x}"));
                }
            }
            Stored::Halves(exp) => {
                let halves = data.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]]));
                if let Some((i, h)) = halves.enumerate().find(|&(_, h)| half_bad(h, exp)) {
                    return bad("column", i / v.cols, i % v.cols, format!("{} 0x{h:04x}", self.fmt.name()));
                }
            }
            Stored::Codes => {}
        }
        Ok(())
    }
    fn view_checked(&self) -> Result<MatRef<'_>, ShapeError> {
        MatRef::new(self.fmt, self.rows, self.cols, self.group, &self.data, &self.scales)
    }
    /// Borrow as a view.
    pub fn view(&self) -> MatRef<'_> {
        MatRef {
            fmt: self.fmt,
            rows: self.rows,
            cols: self.cols,
            group: self.group,
            data: &self.data,
            scales: &self.scales,
        }
    }
    /// Dequantize everything to f32 (for vectors and small tensors).
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        let v = self.view();
        for r in 0..self.rows {
            v.row(r, &mut out[r * self.cols..(r + 1) * self.cols]);
        }
        out
    }
    /// Bytes held in RAM.
    pub fn heap_bytes(&self) -> usize {
        self.data.len() + self.scales.len() * 2
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::f32_to_f16;

    /// `dequant` from any column, any length, against FORMAT.md's rule
    /// applied weight by weight (nibble `j % 2` of byte `j / 2`, minus 8,
    /// times the group's scale).
    #[test]
    fn q4g_dequant_from_any_column_matches_the_format() {
        let mut r = crate::SplitMix64::new(7);
        for (cols, group) in [(37usize, 2usize), (64, 16), (129, 32), (300, 128)] {
            let rows = 3;
            let np = cols.div_ceil(group) * group;
            let data: Vec<u8> = (0..rows * np / 2).map(|_| r.next_u64() as u8).collect();
            let scales: Vec<u8> =
                (0..rows * np / group).flat_map(|i| f32_to_f16(0.01 + i as f32 * 0.003).to_le_bytes()).collect();
            let m = Matrix::from_stored(Fmt::Q4G, rows, cols, group, data.clone(), &scales).unwrap();
            let v = m.view();
            for row in 0..rows {
                let want: Vec<f32> = (0..cols)
                    .map(|j| {
                        let b = data[row * np / 2 + j / 2];
                        let q = if j % 2 == 0 { b & 15 } else { b >> 4 } as i32 - 8;
                        let si = row * np / group + j / group;
                        let s =
                            waste_format::half::f16_to_f32(u16::from_le_bytes([scales[2 * si], scales[2 * si + 1]]));
                        q as f32 * s
                    })
                    .collect();
                for c0 in 0..cols {
                    for len in [0, 1, 2, 3, cols - c0] {
                        let len = len.min(cols - c0);
                        let mut got = vec![f32::NAN; len];
                        v.dequant(row, c0, &mut got);
                        assert_eq!(got, want[c0..c0 + len], "cols {cols} group {group} row {row} from {c0} len {len}");
                    }
                }
            }
        }
    }

    /// Infinite or NaN stored values are refused where the matrix is built,
    /// naming the row and the group or column; every finite value —
    /// subnormals, the largest, negative zero — is accepted.
    #[test]
    fn non_finite_stored_values_are_refused_naming_where() {
        let h = |v: u16| v.to_le_bytes();
        let (rows, cols, g) = (2usize, 8usize, 4usize);
        let q8 = vec![1u8; rows * cols];
        let finite = [0x0001u16, 0x7BFF, 0x8000, 0x3C00];
        let ok: Vec<u8> = finite.iter().flat_map(|&v| h(v)).collect();
        assert!(Matrix::from_stored(Fmt::Q8G, rows, cols, g, q8.clone(), &ok).is_ok());
        for (bits, at) in [(0x7C00u16, 3usize), (0xFC00, 0), (0x7E00, 2), (0x7C01, 1)] {
            let mut sc = ok.clone();
            sc[2 * at..2 * at + 2].copy_from_slice(&h(bits));
            let e = Matrix::from_stored(Fmt::Q8G, rows, cols, g, q8.clone(), &sc).unwrap_err().0;
            let want = format!("scale group {} of row {} is not finite (f16 0x{bits:04x})", at % 2, at / 2);
            assert!(e.contains(&want), "{e:?} lacks {want:?}");
        }
        // a longer scale run than the shape uses is not looked at
        let mut long = ok.clone();
        long.extend(h(0x7C00));
        assert!(Matrix::from_stored(Fmt::Q8G, rows, cols, g, q8, &long).is_ok());
        let f32s: Vec<u8> = (0..rows * cols).flat_map(|i| (i as f32 - 3.5).to_le_bytes()).collect();
        assert!(Matrix::from_stored(Fmt::F32, rows, cols, 0, f32s.clone(), &[]).is_ok());
        for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
            let mut d = f32s.clone();
            d[4 * 13..4 * 14].copy_from_slice(&bad.to_le_bytes());
            let e = Matrix::from_stored(Fmt::F32, rows, cols, 0, d, &[]).unwrap_err().0;
            assert!(e.contains("column 5 of row 1 is not finite"), "{e:?}");
        }
        for (fmt, inf) in [(Fmt::F16, 0x7C00u16), (Fmt::Bf16, 0x7F80)] {
            let mut d: Vec<u8> = (0..rows * cols).flat_map(|_| h(0x3C00)).collect();
            assert!(Matrix::from_stored(fmt, rows, cols, 0, d.clone(), &[]).is_ok());
            d[2 * 2..2 * 3].copy_from_slice(&h(inf | 1));
            let e = Matrix::from_stored(fmt, rows, cols, 0, d, &[]).unwrap_err().0;
            assert!(e.contains("column 2 of row 0 is not finite"), "{fmt:?}: {e:?}");
        }
    }
}
