//! Disk bandwidth probe: direct reads of a given record size at a given
//! queue depth, over a file.

use crate::{AlignedBuf, DirectFile, Priority, ReaderPool, Result, ALIGN};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// What the probe measured.
#[derive(Clone, Copy, Debug)]
pub struct ProbeResult {
    /// Bytes read.
    pub bytes: u64,
    /// Seconds taken.
    pub seconds: f64,
    /// GB/s (10^9 bytes per second).
    pub gbps: f64,
    /// Whether reads were direct.
    pub direct: bool,
    /// Whether buffers got huge pages.
    pub huge: bool,
}

/// Read up to `max_bytes` of `path` in records of `rec` bytes (rounded to
/// 4 KiB) with `qd` reads in flight, in a scattered order (stride walk), and
/// report the bandwidth.
pub fn probe_bandwidth(
    path: &Path,
    rec: usize,
    qd: usize,
    max_bytes: u64,
    direct: bool,
    huge: bool,
) -> Result<ProbeResult> {
    let rec = rec.max(1).div_ceil(ALIGN) * ALIGN;
    let f = Arc::new(DirectFile::open(path, direct)?);
    let n_rec = (f.len() / rec as u64).max(1);
    let n = (max_bytes / rec as u64).clamp(1, n_rec);
    let qd = qd.max(1);
    let pool = ReaderPool::new(qd);
    // a stride co-prime with n_rec visits records out of order, defeating read-ahead
    let stride = (1..n_rec).rev().find(|s| gcd(*s, n_rec) == 1 && *s < n_rec / 2 + 1).unwrap_or(1);
    let mut bufs: Vec<AlignedBuf> = (0..qd).map(|_| AlignedBuf::new(rec, huge)).collect();
    let got_huge = bufs.iter().all(|b| b.is_huge());
    let t0 = Instant::now();
    let mut inflight = std::collections::VecDeque::new();
    let mut idx = 0u64;
    for i in 0..n {
        let buf = match bufs.pop() {
            Some(b) => b,
            None => {
                let t: crate::Ticket = inflight.pop_front().expect("in flight");
                let (b, r) = t.wait();
                r?;
                b
            }
        };
        let _ = i;
        inflight.push_back(pool.submit(f.clone(), idx * rec as u64, buf, Priority::Demand));
        idx = (idx + stride) % n_rec;
    }
    for t in inflight {
        t.wait().1?;
    }
    let seconds = t0.elapsed().as_secs_f64();
    let bytes = n * rec as u64;
    Ok(ProbeResult { bytes, seconds, gbps: bytes as f64 / seconds / 1e9, direct: f.is_direct(), huge: got_huge })
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}
