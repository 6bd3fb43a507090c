//! Agreement of a model's logits with reference logits: the measures of the
//! `fast` numeric mode's quality contract (issue 50; docs/FINDINGS.md,
//! "Numeric modes"), shared by its test and its large-model example.

/// Agreement over teacher-forced positions.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Agreement {
    /// Mean KL(reference ‖ model) per position, nats.
    pub kl: f64,
    /// Positions whose top token is the reference's, percent.
    pub top1: f64,
}

/// Log-softmax in f64.
fn log_softmax64(l: &[f32]) -> Vec<f64> {
    let m = l.iter().fold(f64::MIN, |a, &v| a.max(v as f64));
    let s: f64 = l.iter().map(|&v| (v as f64 - m).exp()).sum();
    l.iter().map(|&v| v as f64 - m - s.ln()).collect()
}

/// KL(p ‖ q) of the distributions of two logit vectors, nats.
pub fn kl(p: &[f32], q: &[f32]) -> f64 {
    let (lp, lq) = (log_softmax64(p), log_softmax64(q));
    lp.iter().zip(&lq).map(|(a, b)| a.exp() * (a - b)).sum()
}

/// How `got` agrees with `reference`, position by position (the shorter
/// of the two counts).
pub fn agreement(reference: &[Vec<f32>], got: &[Vec<f32>]) -> Agreement {
    let n = reference.len().min(got.len()).max(1) as f64;
    let pairs = reference.iter().zip(got);
    Agreement {
        kl: pairs.clone().map(|(w, g)| kl(w, g)).sum::<f64>() / n,
        top1: 100.0 * pairs.filter(|(w, g)| crate::argmax(w) == crate::argmax(g)).count() as f64 / n,
    }
}

/// The contract: `mode`'s mean KL at most 1.10 × `exact`'s, its top-1
/// agreement no lower than `exact`'s minus 1 point.
pub fn meets(mode: &Agreement, exact: &Agreement) -> bool {
    mode.kl <= 1.10 * exact.kl && mode.top1 >= exact.top1 - 1.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kl_is_zero_for_equal_and_positive_otherwise() {
        let a = vec![1.0f32, 2.0, 3.0];
        assert!(kl(&a, &a).abs() < 1e-12);
        // shifting every logit leaves the distribution
        assert!(kl(&a, &[2.0, 3.0, 4.0]).abs() < 1e-12);
        // p = softmax(0, ln 3) = (1/4, 3/4), q uniform: ¼ ln ½ + ¾ ln 3/2
        let want = 0.25 * (0.5f64).ln() + 0.75 * (1.5f64).ln();
        assert!((kl(&[0.0, 3f32.ln()], &[0.0, 0.0]) - want).abs() < 1e-7);
    }

    #[test]
    fn the_contract_allows_ten_percent_and_one_point() {
        let exact = Agreement { kl: 1.0, top1: 50.0 };
        assert!(meets(&Agreement { kl: 1.1, top1: 49.0 }, &exact));
        assert!(!meets(&Agreement { kl: 1.11, top1: 50.0 }, &exact));
        assert!(!meets(&Agreement { kl: 1.0, top1: 48.9 }, &exact));
        let r = vec![vec![0.0f32, 1.0], vec![1.0, 0.0]];
        let g = vec![vec![0.0f32, 1.0], vec![0.0, 1.0]];
        assert_eq!(agreement(&r, &g).top1, 50.0);
    }
}
