//! [`Rows`]: a step's per-token vectors, one buffer of rows of one width —
//! so a block asks for token `t`'s row or tokens `a..b`'s rows, never
//! computes `[t*h..(t+1)*h]` by hand.

use std::ops::Range;

/// `rows × width` f32s, row-major: one row per token of a chunk (or per
/// chosen expert), each `width` wide.
pub(crate) struct Rows {
    data: Vec<f32>,
    width: usize,
}

impl Rows {
    /// `rows` zeroed rows of `width`.
    pub(crate) fn new(rows: usize, width: usize) -> Rows {
        Rows { data: vec![0.0; rows * width], width }
    }
    /// Row `t`.
    pub(crate) fn row(&self, t: usize) -> &[f32] {
        &self.data[t * self.width..(t + 1) * self.width]
    }
    /// Row `t`, to write.
    pub(crate) fn row_mut(&mut self, t: usize) -> &mut [f32] {
        &mut self.data[t * self.width..(t + 1) * self.width]
    }
    /// Rows `r` as one slice (what a batched kernel reads).
    pub(crate) fn rows(&self, r: Range<usize>) -> &[f32] {
        &self.data[r.start * self.width..r.end * self.width]
    }
    /// Rows `r` as one slice, to write.
    pub(crate) fn rows_mut(&mut self, r: Range<usize>) -> &mut [f32] {
        &mut self.data[r.start * self.width..r.end * self.width]
    }
    /// Bytes allocated (the capacity).
    pub(crate) fn allocated_bytes(&self) -> u64 {
        4 * self.data.capacity() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::Rows;

    #[test]
    fn rows_are_consecutive_slices_of_their_width() {
        let mut r = Rows::new(3, 2);
        r.row_mut(1).copy_from_slice(&[1.0, 2.0]);
        r.rows_mut(2..3).copy_from_slice(&[3.0, 4.0]);
        assert_eq!(r.rows(0..3), [0.0, 0.0, 1.0, 2.0, 3.0, 4.0]);
        assert_eq!(r.row(2), [3.0, 4.0]);
        assert_eq!(r.rows(1..1), [] as [f32; 0]);
        assert_eq!(r.allocated_bytes(), 24);
        assert!(std::panic::catch_unwind(|| Rows::new(2, 2).row(2).len()).is_err());
    }
}
