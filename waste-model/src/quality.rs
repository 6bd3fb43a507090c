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

/// Teacher-forced ids and reference logits from a directory holding
/// `ids.json` (a JSON array of token ids) and `logits.f32` (little-endian
/// f32, one row of the vocabulary per id): the format the contract's
/// reference scripts write (tools/oracle/make_fast_quality_*.py).
///
/// # Errors
/// Unreadable files, or logits that are not one whole row per id.
pub fn read_reference(dir: &std::path::Path) -> Result<(Vec<u32>, Vec<Vec<f32>>), String> {
    let ids_text = std::fs::read_to_string(dir.join("ids.json")).map_err(|e| format!("ids.json: {e}"))?;
    let ids: Vec<u32> = serde_json::from_str(&ids_text).map_err(|e| format!("ids.json: {e}"))?;
    let raw = std::fs::read(dir.join("logits.f32")).map_err(|e| format!("logits.f32: {e}"))?;
    if ids.is_empty() || raw.is_empty() || !raw.len().is_multiple_of(4 * ids.len()) {
        return Err(format!("logits.f32: {} bytes is not {} whole rows of f32", raw.len(), ids.len()));
    }
    let vocab = raw.len() / 4 / ids.len();
    let floats: Vec<f32> = raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    Ok((ids, floats.chunks_exact(vocab).map(<[f32]>::to_vec).collect()))
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
    fn a_reference_is_whole_rows() {
        let dir = std::env::temp_dir().join(format!("waste-quality-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("ids.json"), "[1, 2]").unwrap();
        let row: Vec<u8> = [0.5f32, -1.0, 2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(dir.join("logits.f32"), [row.clone(), row.clone()].concat()).unwrap();
        let (ids, l) = read_reference(&dir).unwrap();
        assert_eq!((ids, l), (vec![1, 2], vec![vec![0.5, -1.0, 2.0]; 2]));
        // 14 bytes: not two rows of f32 of any width
        std::fs::write(dir.join("logits.f32"), [row.clone(), vec![0u8; 2]].concat()).unwrap();
        assert!(read_reference(&dir).unwrap_err().contains("whole rows"));
        std::fs::remove_dir_all(&dir).unwrap();
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
