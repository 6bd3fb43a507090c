//! Residual vector-quantized expert matrices (VQ3R / VQ2R / VQ4P).
//!
//! A matvec never dequantizes the matrix: a per-input table holds
//! `x[8v..8v+8] · C_s[e]` for every vector position `v`, stage `s` and entry
//! `e`; a row's output is `σ_r · Σ_v Σ_s T[v][s][idx(r,v,s)]`.

use crate::level::Level;
#[cfg(target_arch = "x86_64")]
use crate::vq_loads::{most_used, next_form, record, IndexFamily, RowsKernel};
use waste_format::half::f16_to_f32;

/// One codebook in f32: `entries × dim`, plus its transpose for SIMD table builds.
#[derive(Clone, Debug)]
pub struct VqBook {
    /// Entries.
    pub entries: usize,
    /// Vector length.
    pub dim: usize,
    /// `[entry][dim]`.
    pub cb: Vec<f32>,
    /// `[dim][entry]`.
    pub cbt: Vec<f32>,
}

impl VqBook {
    /// From f16 bits `[entries][dim]`.
    pub fn from_f16(bits: &[u16], entries: usize, dim: usize) -> VqBook {
        let cb: Vec<f32> = bits[..entries * dim].iter().map(|&h| f16_to_f32(h)).collect();
        let mut cbt = vec![0f32; entries * dim];
        for e in 0..entries {
            for d in 0..dim {
                cbt[d * entries + e] = cb[e * dim + d];
            }
        }
        VqBook { entries, dim, cb, cbt }
    }
}

/// The index layout of one VQ matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VqLayout {
    /// Rows (outputs).
    pub rows: usize,
    /// Vector positions per row (`cols / dim`).
    pub nvec: usize,
    /// Stages.
    pub stages: usize,
    /// Index block rows (0 = row-major).
    pub block: usize,
    /// 6-bit packed indices (VQ4P) instead of one byte per stage.
    pub packed6: bool,
}

impl VqLayout {
    /// The layout of an expert matrix `[rows, cols]` quantized as `q` (a
    /// VQ scheme; `cols` a multiple of its vector length).
    pub fn for_expert(q: &waste_format::ExpertQuant, rows: usize, cols: usize) -> VqLayout {
        VqLayout {
            rows,
            nvec: cols / q.vec_dim.max(1),
            stages: q.stages,
            block: q.index_block,
            packed6: q.index_bits == 6,
        }
    }
    /// Index bytes per (row, vector).
    pub fn bpv(&self) -> usize {
        if self.packed6 {
            self.stages * 6 / 8
        } else {
            self.stages
        }
    }
    /// Table entries per (v, s): 2^index_bits.
    pub fn table_entries(&self) -> usize {
        if self.packed6 {
            64
        } else {
            256
        }
    }
    /// Table length in floats.
    /// Saturates at `usize::MAX` for a layout too large to address, so the
    /// kernels' length checks refuse it instead of a wrapped size passing.
    pub fn table_len(&self) -> usize {
        self.nvec.saturating_mul(self.stages).saturating_mul(self.table_entries())
    }
    /// Total index bytes (saturating at `usize::MAX`, as [`VqLayout::table_len`]).
    pub fn index_bytes(&self) -> usize {
        let rp = match self.block {
            0 => self.rows,
            b => self.rows.div_ceil(b).saturating_mul(b),
        };
        rp.saturating_mul(self.nvec).saturating_mul(self.bpv())
    }
    /// Byte offset of the stage group of (row, v).
    #[inline]
    pub fn offset(&self, r: usize, v: usize) -> usize {
        match r.checked_div(self.block) {
            Some(rb) => ((rb * self.nvec + v) * self.block + r % self.block) * self.bpv(),
            None => (r * self.nvec + v) * self.bpv(),
        }
    }
    /// Bytes from (row, v)'s stage group to (row, v + 1)'s: `offset(r, v)
    /// = offset(r, 0) + v · vstride()` for every row, so a kernel walking
    /// the positions adds instead of dividing. Saturates like
    /// [`VqLayout::index_bytes`] (a layout that large is refused by every
    /// kernel's length check before a stride is used).
    #[inline]
    pub fn vstride(&self) -> usize {
        self.block.max(1).saturating_mul(self.bpv())
    }
    /// Stage indices of (row, v).
    #[inline]
    pub fn indices(&self, idx: &[u8], r: usize, v: usize, out: &mut [usize; 8]) {
        self.indices_at(idx, self.offset(r, v), out);
    }
    /// Stage indices of the stage group at byte offset `o` (an
    /// [`VqLayout::offset`]).
    #[inline]
    pub fn indices_at(&self, idx: &[u8], o: usize, out: &mut [usize; 8]) {
        if self.packed6 {
            let (b0, b1, b2) = (idx[o] as usize, idx[o + 1] as usize, idx[o + 2] as usize);
            out[0] = b0 & 63;
            out[1] = (b0 >> 6) | (b1 & 15) << 2;
            out[2] = (b1 >> 4) | (b2 & 3) << 4;
            out[3] = b2 >> 2;
        } else {
            for s in 0..self.stages {
                out[s] = idx[o + s] as usize;
            }
        }
    }
}

/// Build the lookup table for input `x` (`len = nvec · dim`) against one
/// book per stage. Entries a book lacks are NaN, so a damaged index shows.
///
/// # Panics
/// When the books do not match the layout's stages, `x` is not `nvec · dim` long, or `table` is too short.
pub fn build_table(level: Level, books: &[&VqBook], lay: &VqLayout, x: &[f32], table: &mut [f32]) {
    let te = lay.table_entries();
    assert_eq!(books.len(), lay.stages);
    let dim = books[0].dim;
    assert_eq!(x.len(), lay.nvec * dim);
    assert!(table.len() >= lay.table_len());
    for (s, b) in books.iter().enumerate() {
        for v in 0..lay.nvec {
            let t = &mut table[(v * lay.stages + s) * te..][..te];
            let xv = &x[v * dim..(v + 1) * dim];
            #[allow(unused_mut)]
            let mut done = 0;
            #[cfg(target_arch = "x86_64")]
            if level == Level::Avx512 && Level::Avx512.supported() {
                // SAFETY: features checked; slices sized above.
                done = unsafe { crate::x86_64::avx512::table_entries(b, xv, t) };
            }
            #[cfg(target_arch = "x86_64")]
            if level.avx2_kernels() && done < b.entries {
                // SAFETY: features checked; slices sized above (the AVX2
                // kernel covers whole 8-entry vectors from the start: the
                // same bits as the AVX-512 ones it repeats).
                done = unsafe { crate::x86_64::avx2::table_entries(b, xv, t) };
            }
            #[cfg(target_arch = "aarch64")]
            if level.neon_kernels() {
                done = crate::aarch64::neon::table_entries(b, xv, t);
            }
            let _ = level;
            table_rest(b, xv, t, done);
            t[b.entries..].fill(f32::NAN);
        }
    }
}

fma_scalar! {
    /// Table entries `done..` of one (position, stage) in the canonical order
    /// (`x0·c0`, then `fma(x_d, c_d, ·)`): every entry at the scalar level.
    fn table_rest(b: &VqBook, xv: &[f32], t: &mut [f32], done: usize) {
        let dim = b.dim;
        for e in done..b.entries {
            let c = &b.cb[e * dim..(e + 1) * dim];
            let mut acc = xv[0] * c[0];
            for d in 1..dim {
                acc = xv[d].mul_add(c[d], acc);
            }
            t[e] = acc;
        }
    }
}

/// How the AVX-512 VBMI byte-plane kernel looks up a 256-entry byte plane
/// (other kernels ignore it). Both forms give the same bytes (so the same
/// results); which is faster depends on the CPU's shuffle unit (docs/lab/2026-12-02-40-vpermb-instead-of-vpermt2b-in-the-vq-planes-integer.md, "vpermb", "per CPU").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlaneLookup {
    /// Two two-register permutes (`vpermt2b`, 128 entries each) and a blend
    /// on the index's top bit: 8 permutes per 64 lookups. Faster where
    /// `vpermt2b` issues at one a cycle (AMD Zen 4: 17–40 % faster lookups).
    TwoSource,
    /// Four one-register permutes (`vpermb`, 64 entries each) merged under
    /// masks of the index's top two bits: 16 permutes per 64 lookups, each
    /// one cycle. Faster where `vpermt2b` takes two cycles of the one 512-bit
    /// shuffle port (the Intel Xeons measured: 4–12 % faster lookups).
    OneSource,
}

/// 0: not yet detected; 1 + the [`PlaneLookup`] in use otherwise.
static PLANE_LOOKUP: core::sync::atomic::AtomicU8 = core::sync::atomic::AtomicU8::new(0);

/// The plane lookup the byte-plane kernel uses: detected once from the CPU's vendor
/// (AMD: [`PlaneLookup::TwoSource`], every other: [`PlaneLookup::OneSource`])
/// unless [`set_plane_lookup`] chose one.
pub fn plane_lookup() -> PlaneLookup {
    use core::sync::atomic::Ordering::Relaxed;
    match PLANE_LOOKUP.load(Relaxed) {
        1 => PlaneLookup::TwoSource,
        2 => PlaneLookup::OneSource,
        _ => {
            let l = if cpu_is_amd() { PlaneLookup::TwoSource } else { PlaneLookup::OneSource };
            // a concurrent set_plane_lookup wins over detection
            let _ = PLANE_LOOKUP.compare_exchange(0, 1 + l as u8, Relaxed, Relaxed);
            plane_lookup()
        }
    }
}

/// Chooses the plane lookup for the whole process — for benchmarks comparing
/// the two forms on a new CPU; results do not change (the same bytes).
pub fn set_plane_lookup(l: PlaneLookup) {
    PLANE_LOOKUP.store(1 + l as u8, core::sync::atomic::Ordering::Relaxed);
}

impl PlaneLookup {
    /// Both forms, for tests and benchmarks that run each.
    pub const ALL: [PlaneLookup; 2] = [PlaneLookup::TwoSource, PlaneLookup::OneSource];
}

/// Whether the CPU's vendor is AMD (CPUID leaf 0, "AuthenticAMD").
#[cfg(target_arch = "x86_64")]
fn cpu_is_amd() -> bool {
    // SAFETY: leaf 0 exists on every x86_64 CPU (the intrinsic is safe from
    // Rust 1.94, unsafe before: the block stays for the MSRV).
    #[allow(unused_unsafe)]
    let v = unsafe { core::arch::x86_64::__cpuid(0) };
    [v.ebx, v.edx, v.ecx] == [0x6874_7541, 0x6974_6e65, 0x444d_4163]
}

#[cfg(not(target_arch = "x86_64"))]
fn cpu_is_amd() -> bool {
    false
}

/// `y[i] = σ_{r0+i} · Σ_v Σ_s T[v][s][idx(r0+i, v, s)]`. `scales` holds one
/// f16 per row (little-endian bytes). Bit-identical across levels.
///
/// # Panics
/// When the indices, scales or table are shorter than the layout needs, or the rows are out of range.
pub fn matvec_rows(level: Level, lay: &VqLayout, idx: &[u8], scales: &[u8], table: &[f32], r0: usize, y: &mut [f32]) {
    matvec_rows_planes(level, lay, idx, scales, table, None, r0, y)
}

/// Whether tables of this layout can be looked up as byte planes (8-bit
/// indices, 256 entries, 1 to 3 stages, index blocks of a multiple of 64
/// rows) — whatever the CPU. Callers size plane buffers by this, so memory
/// does not depend on the machine.
pub fn planes_fit(lay: &VqLayout) -> bool {
    !lay.packed6 && (1..=3).contains(&lay.stages) && lay.block > 0 && lay.block.is_multiple_of(64)
}

/// Whether `level` on this CPU looks tables of this layout up as byte
/// planes ([`build_planes`]; AVX-512 VBMI and [`planes_fit`]).
pub fn uses_planes(level: Level, lay: &VqLayout) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        vbmi(level) && planes_fit(lay)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (level, lay);
        false
    }
}

/// Whether `level` on this CPU sums VQ4P rows with the whole 64-entry
/// tables in registers (AVX-512 VBMI; 4 stages, index blocks of a multiple
/// of 64 rows), 64 rows at a time: callers splitting rows across threads
/// split them at multiples of 64.
pub fn uses_vq4p_rows64(level: Level, lay: &VqLayout) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        vbmi(level) && packed4_in_blocks_of(lay, 64)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (level, lay);
        false
    }
}

/// VQ4P's layout (4 stages of 6-bit indices) in index blocks of a multiple
/// of `rows` rows: what its register-table kernels (x86, NEON) take.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
fn packed4_in_blocks_of(lay: &VqLayout, rows: usize) -> bool {
    lay.packed6 && lay.stages == 4 && lay.block > 0 && lay.block.is_multiple_of(rows)
}

/// Bytes of [`build_planes`]' output for a layout (the table's size).
pub fn planes_len(lay: &VqLayout) -> usize {
    lay.table_len().saturating_mul(4)
}

/// The table of [`build_table`] as byte planes for [`matvec_rows_planes`]
/// (a byte transpose; nothing when [`uses_planes`] is false).
///
/// # Panics
/// When `table` or `planes` are shorter than the layout needs.
pub fn build_planes(level: Level, lay: &VqLayout, table: &[f32], planes: &mut [u8]) {
    assert!(table.len() >= lay.table_len() && planes.len() >= planes_len(lay));
    #[cfg(target_arch = "x86_64")]
    if uses_planes(level, lay) {
        // SAFETY: features checked by uses_planes; sizes asserted above.
        unsafe { crate::x86_64::avx512::vq_planes(table, planes, lay.nvec * lay.stages) };
    }
    let _ = level;
}

/// [`build_table`] and, where the level uses them, [`build_planes`] in one
/// pass: each (vector position, stage) table is computed in registers and
/// stored both ways (AVX-512 VBMI with 256-entry, 8-dimensional books);
/// the same bits as the two calls. Where the planes serve every row
/// ([`planes_cover`]) `table` may be empty: only the planes are written.
///
/// # Panics
/// As [`build_table`]; when `planes` is shorter than [`planes_len`] and the
/// level uses planes; when `table` is empty and the planes do not cover the rows.
pub fn build_table_planes(
    level: Level,
    books: &[&VqBook],
    lay: &VqLayout,
    x: &[f32],
    table: &mut [f32],
    planes: &mut [u8],
) {
    if !uses_planes(level, lay) {
        return build_table(level, books, lay, x, table);
    }
    assert!(!table.is_empty() || planes_cover(level, lay), "a table is needed: the planes do not serve every row");
    #[cfg(target_arch = "x86_64")]
    if books.iter().all(|b| b.entries == 256 && b.dim == 8) {
        assert_eq!(books.len(), lay.stages);
        assert_eq!(x.len(), lay.nvec * 8);
        assert!((table.is_empty() || table.len() >= lay.table_len()) && planes.len() >= planes_len(lay));
        for v in 0..lay.nvec {
            for (s, b) in books.iter().enumerate() {
                let i = v * lay.stages + s;
                let t = if table.is_empty() { &mut [][..] } else { &mut table[256 * i..256 * (i + 1)] };
                // SAFETY: features checked by uses_planes; the book's shape and every length asserted above.
                unsafe {
                    crate::x86_64::avx512::table_planes(
                        b,
                        &x[8 * v..8 * v + 8],
                        t,
                        &mut planes[1024 * i..1024 * (i + 1)],
                    )
                };
            }
        }
        return;
    }
    if table.is_empty() {
        let mut t = vec![0f32; lay.table_len()];
        build_table(level, books, lay, x, &mut t);
        return build_planes(level, lay, &t, planes);
    }
    build_table(level, books, lay, x, table);
    build_planes(level, lay, table, planes);
}

/// Whether the byte planes serve every row of this layout at `level` (they
/// are used, [`uses_planes`], and the rows are whole 64-row groups), so a
/// caller that splits rows at multiples of 64 needs no f32 table.
pub fn planes_cover(level: Level, lay: &VqLayout) -> bool {
    uses_planes(level, lay) && lay.rows.is_multiple_of(64)
}

/// [`matvec_rows`] with the table's byte planes when the level uses them
/// ([`uses_planes`]; `planes` from [`build_planes`] on the same table).
/// Bit-identical to [`matvec_rows`] at every level. `table` may be empty
/// when the planes serve the rows asked for (they are used, `r0` and
/// `y.len()` are multiples of 64).
///
/// # Panics
/// As [`matvec_rows`]; when `planes` is given but shorter than the layout
/// needs; when `table` is empty and a row asked for needs it.
#[allow(clippy::too_many_arguments)]
pub fn matvec_rows_planes(
    level: Level,
    lay: &VqLayout,
    idx: &[u8],
    scales: &[u8],
    table: &[f32],
    planes: Option<&[u8]>,
    r0: usize,
    y: &mut [f32],
) {
    assert!(idx.len() >= lay.index_bytes() && scales.len() >= lay.rows * 2);
    assert!(table.is_empty() || table.len() >= lay.table_len());
    assert!(r0 + y.len() <= lay.rows);
    let scale = |r: usize| f16_to_f32(u16::from_le_bytes([scales[2 * r], scales[2 * r + 1]]));
    #[cfg_attr(not(any(target_arch = "x86_64", target_arch = "aarch64")), allow(unused_mut))]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if let Some(pl) = planes.filter(|_| uses_planes(level, lay) && r0.is_multiple_of(64)) {
        assert!(pl.len() >= planes_len(lay));
        let n64 = y.len() / 64 * 64;
        // SAFETY: features checked by uses_planes; sizes asserted above.
        unsafe { crate::x86_64::avx512::vq_rows64(lay, idx, pl, r0, &mut y[..n64]) };
        done = n64;
    }
    assert!(!table.is_empty() || done == y.len(), "rows {}.. need the f32 table, none was given", r0 + done);
    #[cfg(target_arch = "x86_64")]
    if uses_vq4p_rows64(level, lay) && (r0 + done).is_multiple_of(64) {
        let n64 = done + (y.len() - done) / 64 * 64;
        // SAFETY: features checked by uses_vq4p_rows64; sizes asserted above.
        unsafe { crate::x86_64::avx512::vq4p_rows64(lay, idx, table, r0 + done, &mut y[done..n64]) };
        done = n64;
    }
    // the AVX2 level's row form for this layout's index family (the trial
    // of vq_loads::next_form times the call until the form is chosen)
    #[cfg(target_arch = "x86_64")]
    let (form, timed) = if avx2_rows(level, lay) {
        let (k, timed) = next_form(IndexFamily::of(lay));
        (Some(k), timed.then(std::time::Instant::now))
    } else {
        (None, None)
    };
    #[cfg(target_arch = "x86_64")]
    if level.avx2_kernels()
        && packed4_in_blocks_of(lay, 8)
        && (r0 + done).is_multiple_of(8)
        && form == Some(RowsKernel::Vector)
    {
        let n8 = done + (y.len() - done) / 8 * 8;
        // SAFETY: features checked; sizes asserted above.
        unsafe { crate::x86_64::avx2::vq4p_rows8(lay, idx, table, r0 + done, &mut y[done..n8]) };
        done = n8;
    }
    #[cfg(target_arch = "x86_64")]
    if uses_rows16(level, lay) && (r0 + done).is_multiple_of(16) {
        let n16 = done + (y.len() - done) / 16 * 16;
        // SAFETY: features checked; sizes asserted above.
        unsafe { crate::x86_64::avx512::vq_rows16(lay, idx, table, r0 + done, &mut y[done..n16]) };
        done = n16;
    }
    #[cfg(target_arch = "x86_64")]
    if level.avx2_kernels()
        && lay.block > 0
        && lay.block.is_multiple_of(8)
        && (r0 + done).is_multiple_of(8)
        && !lay.packed6
        && form == Some(RowsKernel::Vector)
    {
        let n8 = done + (y.len() - done) / 8 * 8;
        // SAFETY: features checked; sizes asserted above.
        unsafe { crate::x86_64::avx2::vq_rows8(lay, idx, table, r0 + done, &mut y[done..n8]) };
        done = n8;
    }
    #[cfg(target_arch = "aarch64")]
    if level.neon_kernels() && packed4_in_blocks_of(lay, 16) && r0.is_multiple_of(16) {
        let n16 = y.len() / 16 * 16;
        crate::aarch64::neon::vq4p_rows16(lay, idx, table, r0, &mut y[..n16]);
        done = n16;
    }
    #[cfg(target_arch = "aarch64")]
    if level.neon_kernels() && lay.block > 0 && lay.block.is_multiple_of(4) && (r0 + done).is_multiple_of(4) {
        let n4 = done + (y.len() - done) / 4 * 4;
        crate::aarch64::neon::vq_rows4(lay, idx, table, r0 + done, &mut y[done..n4]);
        done = n4;
    }
    let _ = (level, planes);
    // the rest (every row at the scalar level; VQ3R/VQ2R at AVX2 where
    // scalar loads beat the gathers): plain loads, the same order
    crate::vq_loads::rows(lay, idx, table, r0 + done, &mut y[done..]);
    #[cfg(target_arch = "x86_64")]
    if let (Some(k), Some(t0)) = (form, timed) {
        record(IndexFamily::of(lay), k, t0.elapsed().as_secs_f64(), y.len() * lay.nvec * lay.stages);
    }
    for (i, yo) in y.iter_mut().enumerate() {
        *yo *= scale(r0 + i);
    }
}

/// The kernel that sums this layout's rows at `level` on this CPU (the
/// rows of whole 64-row groups from row 0, as an expert's matvec takes
/// them): `avx512-planes`, `avx512-vq4p-registers`, `avx512-gather`,
/// `avx2-gather`, `avx2-permute`, `neon-vq4p-tbl`, `neon-lanes` or
/// `scalar-loads` ([`crate::vq_loads::rows`]). Which AVX2 form runs is
/// measured on the process's own calls ([`crate::vq_loads::next_form`]):
/// the name is the form that ran most of them so far
/// ([`crate::vq_loads::most_used`]).
pub fn rows_kernel_name(level: Level, lay: &VqLayout) -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if uses_planes(level, lay) {
            return "avx512-planes";
        }
        if uses_vq4p_rows64(level, lay) {
            return "avx512-vq4p-registers";
        }
        let avx2_vector = avx2_rows(level, lay) && most_used(IndexFamily::of(lay)) == RowsKernel::Vector;
        if avx2_vector && packed4_in_blocks_of(lay, 8) {
            return "avx2-permute";
        }
        if uses_rows16(level, lay) {
            return "avx512-gather";
        }
        if avx2_vector && !lay.packed6 {
            return "avx2-gather";
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        if level.neon_kernels() && packed4_in_blocks_of(lay, 16) {
            return "neon-vq4p-tbl";
        }
        if level.neon_kernels() && lay.block > 0 && lay.block.is_multiple_of(4) {
            return "neon-lanes";
        }
    }
    let _ = (level, lay);
    "scalar-loads"
}

/// Whether the AVX2 row forms ([`crate::vq_loads::RowsKernel`]) sum this
/// layout's rows at `level`: AVX2, or AVX-512 without VBMI (with it, its
/// own kernels take them); index blocks of a multiple of 8 rows.
#[cfg(target_arch = "x86_64")]
fn avx2_rows(level: Level, lay: &VqLayout) -> bool {
    level.avx2_kernels() && !vbmi(level) && lay.block > 0 && lay.block.is_multiple_of(8)
}

/// Whether `level` is AVX-512 with VBMI on this CPU (its own VQ kernels).
#[cfg(target_arch = "x86_64")]
fn vbmi(level: Level) -> bool {
    level == Level::Avx512 && Level::Avx512.supported() && crate::x86_64::avx512::has_vbmi()
}

/// Whether the AVX-512 16-row gathers can take this layout's rows (VBMI;
/// index blocks of a multiple of 16; byte indices of up to 4 stages or
/// VQ4P's 3 packed bytes).
#[cfg(target_arch = "x86_64")]
fn uses_rows16(level: Level, lay: &VqLayout) -> bool {
    vbmi(level) && lay.block > 0 && lay.block.is_multiple_of(16) && lay.bpv() <= 4 && (!lay.packed6 || lay.bpv() == 3)
}

/// Dequantize one row (reference / converter use): `W[r, :]`.
pub fn dequant_row(books: &[&VqBook], lay: &VqLayout, idx: &[u8], scales: &[u8], r: usize, out: &mut [f32]) {
    let dim = books[0].dim;
    let sigma = f16_to_f32(u16::from_le_bytes([scales[2 * r], scales[2 * r + 1]]));
    let mut ix = [0usize; 8];
    for v in 0..lay.nvec {
        lay.indices(idx, r, v, &mut ix);
        for d in 0..dim {
            let mut w = 0f32;
            for s in 0..lay.stages {
                w += books[s].cb.get(ix[s] * dim + d).copied().unwrap_or(f32::NAN);
            }
            out[v * dim + d] = sigma * w;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::VqLayout;

    /// Kernels walk the positions by `vstride` from a row's position-0
    /// offset: that must land on `offset(r, v)` for every layout, blocked or
    /// row-major, byte or packed indices, rows short of a whole block.
    #[test]
    fn offsets_walk_by_vstride() {
        for block in [0, 4, 16, 64] {
            for (stages, packed6) in [(1, false), (3, false), (4, true)] {
                let lay = VqLayout { rows: 70, nvec: 5, stages, block, packed6 };
                for r in 0..lay.rows {
                    for v in 0..lay.nvec {
                        assert_eq!(lay.offset(r, v), lay.offset(r, 0) + v * lay.vstride(), "{lay:?} r {r} v {v}");
                    }
                }
            }
        }
    }
}
