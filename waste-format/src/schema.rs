//! The tensors the forward pass needs, derived from the config alone.

use crate::config::ModelConfig;

/// The expected shape of a required tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// A matrix `[rows, cols]` (leading dims flattened into rows).
    Mat(usize, usize),
    /// A vector of exactly `n` elements (any rank).
    Vec(usize),
    /// At least `n` elements (A_log: per head, maybe zero-padded).
    AtLeast(usize),
}

impl Expect {
    /// Whether a tensor of `rows × cols` satisfies this expectation.
    pub fn accepts(&self, rows: usize, cols: usize) -> bool {
        match *self {
            Expect::Mat(r, c) => rows == r && cols == c,
            Expect::Vec(n) => rows * cols == n,
            Expect::AtLeast(n) => rows * cols >= n,
        }
    }
    /// Whether a source tensor of this `shape` is this expectation stored
    /// without transposition: a vector's element count, or a matrix whose
    /// leading dimensions multiply to its rows and trailing ones to its
    /// columns (`[rows, cols]`, `[D, 3, 14, 14]` for `[D, 588]`, `[H, W, D]`
    /// for `[H·W, D]`). A transposed `[cols, rows]` has the right element
    /// count but no such split, unless the matrix is square or a row.
    pub fn accepts_shape(&self, shape: &[usize]) -> bool {
        let prod = |d: &[usize]| d.iter().try_fold(1usize, |a, &x| a.checked_mul(x));
        match *self {
            Expect::Mat(r, c) => {
                (0..=shape.len()).any(|k| prod(&shape[..k]) == Some(r) && prod(&shape[k..]) == Some(c))
            }
            Expect::Vec(n) => prod(shape) == Some(n),
            Expect::AtLeast(n) => prod(shape).is_some_and(|p| p >= n),
        }
    }
    /// Element count implied (for synthesis).
    pub fn numel(&self) -> usize {
        match *self {
            Expect::Mat(r, c) => r * c,
            Expect::Vec(n) | Expect::AtLeast(n) => n,
        }
    }
}

/// One required tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Required {
    /// Name without `tensor_prefix`.
    pub name: String,
    /// Expected shape.
    pub expect: Expect,
    /// Stays on disk (the embedding table): not counted as resident.
    pub on_disk: bool,
}

/// A resident required tensor.
pub(crate) fn r(name: String, expect: Expect) -> Required {
    Required { name, expect, on_disk: false }
}

/// Every tensor the forward pass reads, in forward order: the config's
/// family declares them ([`crate::arch::Architecture::tensors`]).
pub fn required_tensors(c: &ModelConfig) -> Vec<Required> {
    (c.family.def().tensors)(c)
}

#[cfg(test)]
mod tests {
    use super::Expect::{self, *};

    #[test]
    fn a_matrix_is_accepted_in_any_untransposed_layout() {
        let m = Mat(6, 4);
        for ok in [&[6, 4][..], &[2, 3, 4], &[6, 2, 2], &[2, 3, 2, 2], &[6, 4, 1], &[1, 6, 4]] {
            assert!(m.accepts_shape(ok), "{ok:?}");
        }
        // the same 24 elements transposed or regrouped across the split
        for bad in [&[4, 6][..], &[24], &[3, 8], &[2, 12], &[4, 3, 2], &[]] {
            assert!(!m.accepts_shape(bad), "{bad:?}");
        }
        // a row vector, and a square matrix, cannot tell
        assert!(Mat(1, 5).accepts_shape(&[5]));
        assert!(Mat(3, 3).accepts_shape(&[3, 3]));
    }

    #[test]
    fn vectors_count_elements_and_overflowing_shapes_are_refused() {
        assert!(Vec(12).accepts_shape(&[3, 1, 4]));
        assert!(!Vec(12).accepts_shape(&[13]));
        assert!(AtLeast(4).accepts_shape(&[1, 8]));
        assert!(!AtLeast(4).accepts_shape(&[3]));
        let huge = [usize::MAX, 2, 2];
        for e in [Mat(1, 0), Vec(0), AtLeast(1)] {
            assert!(!Expect::accepts_shape(&e, &huge), "{e:?}");
        }
    }
}
