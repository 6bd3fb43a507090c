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
    /// The record size read (the request rounded up to 4 KiB).
    pub record: usize,
    /// Reads in flight.
    pub qd: usize,
}

/// Most reads in flight a probe runs (one reader thread each; the engine
/// caps its reader threads at the same).
pub const PROBE_MAX_QD: usize = 64;
/// Most bytes of buffers a probe holds (`qd` records).
pub const PROBE_MAX_BUFFERS: u64 = 1 << 30;

/// Read up to `max_bytes` of `path` in records of `rec` bytes (rounded to
/// 4 KiB) with `qd` reads in flight, in a scattered order (stride walk), and
/// report the bandwidth.
///
/// # Errors
/// [`crate::Error::Arg`] for `qd` outside `1..=`[`PROBE_MAX_QD`] or `qd`
/// records over [`PROBE_MAX_BUFFERS`] bytes, or a file smaller than one
/// record; [`crate::Error::Io`] when the file cannot be opened, and any
/// read's error.
///
/// # Panics
/// When the OS refuses to start a reader thread (at most [`PROBE_MAX_QD`]).
pub fn probe_bandwidth(
    path: &Path,
    rec: usize,
    qd: usize,
    max_bytes: u64,
    direct: bool,
    huge: bool,
) -> Result<ProbeResult> {
    if !(1..=PROBE_MAX_QD).contains(&qd) {
        return Err(crate::Error::Arg(format!("{qd} reads in flight: expected 1 to {PROBE_MAX_QD}")));
    }
    let rec = rec
        .max(1)
        .checked_next_multiple_of(ALIGN)
        .filter(|&r| (r as u64).checked_mul(qd as u64).is_some_and(|b| b <= PROBE_MAX_BUFFERS))
        .ok_or_else(|| {
            crate::Error::Arg(format!(
                "{qd} records of {rec} bytes exceed the probe's {} MiB of buffers",
                PROBE_MAX_BUFFERS >> 20
            ))
        })?;
    let f = Arc::new(DirectFile::open(path, direct)?);
    if f.len() < rec as u64 {
        // not even one whole record to read (was: a short read at offset 0)
        return Err(crate::Error::Arg(format!(
            "{}: {} bytes, smaller than one read of {rec} bytes: measure a larger file (an expert bank), or a smaller --record-size",
            path.display(),
            f.len()
        )));
    }
    let n_rec = (f.len() / rec as u64).max(1);
    let n = (max_bytes / rec as u64).clamp(1, n_rec);
    let pool = ReaderPool::try_new(qd)?;
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
    Ok(ProbeResult {
        bytes,
        seconds,
        gbps: bytes as f64 / seconds / 1e9,
        direct: f.is_direct(),
        huge: got_huge,
        record: rec,
        qd,
    })
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Bytes a [`read_bandwidth`] pass reads at least: a smaller set of slices
/// is read over and over within the pass, so that starting and joining the
/// threads (tens of µs) does not pass for the memory's time — a trunk of a
/// few hundred KB read once measured 3.5 GB/s and a roofline share of 240 %.
pub const READ_PROBE_MIN_BYTES: usize = 64 << 20;

/// Most readings of the set in one [`read_bandwidth`] pass: a set under 1
/// KiB (no real trunk) is read this often and no more, so the loop stays
/// bounded whatever the container says.
pub const READ_PROBE_MAX_REPEATS: usize = 1 << 16;

/// How many times a [`read_bandwidth`] pass reads `total` bytes: enough to
/// reach [`READ_PROBE_MIN_BYTES`], at least once (once when there is
/// nothing), at most [`READ_PROBE_MAX_REPEATS`].
pub fn read_repeats(total: usize) -> usize {
    if total == 0 {
        1
    } else {
        READ_PROBE_MIN_BYTES.div_ceil(total).clamp(1, READ_PROBE_MAX_REPEATS)
    }
}

/// Seconds (best of `passes`) for `threads` threads to read every byte of
/// `slices` once, the bytes split evenly between the threads. Reads 64-bit
/// words with four independent sums so the loads, not the adds, set the
/// pace. Slices smaller than [`READ_PROBE_MIN_BYTES`] in all are read
/// [`read_repeats`] times a pass (the time returned is one reading's), so
/// a set that fits in the CPU's caches measures the caches' speed.
pub fn read_bandwidth(slices: &[&[u8]], threads: usize, passes: usize) -> f64 {
    let threads = threads.max(1);
    let total: usize = slices.iter().map(|s| s.len()).sum();
    let per = total.div_ceil(threads).max(1);
    // each thread's share as (slice, start, end) pieces
    let mut shares: Vec<Vec<(usize, usize, usize)>> = vec![Vec::new(); threads];
    let (mut t, mut room) = (0, per);
    for (i, s) in slices.iter().enumerate() {
        let mut a = 0;
        while a < s.len() {
            let n = room.min(s.len() - a);
            shares[t.min(threads - 1)].push((i, a, a + n));
            a += n;
            room -= n;
            if room == 0 {
                t += 1;
                room = per;
            }
        }
    }
    let reps = read_repeats(total);
    let mut best = f64::INFINITY;
    for _ in 0..passes.max(1) {
        let t0 = Instant::now();
        let sum: u64 = std::thread::scope(|sc| {
            let hs: Vec<_> = shares
                .iter()
                .map(|sh| {
                    sc.spawn(move || {
                        (0..reps)
                            .flat_map(|_| sh.iter())
                            // black_box: each reading is done, not hoisted out of the repeats
                            .map(|&(i, a, b)| sum_words(std::hint::black_box(&slices[i][a..b])))
                            .fold(0, u64::wrapping_add)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap_or(0)).fold(0, u64::wrapping_add)
        });
        std::hint::black_box(sum);
        best = best.min(t0.elapsed().as_secs_f64() / reps as f64);
    }
    best
}

/// How far ahead of its reads [`sum_words`] asks for lines on x86_64: the
/// distance the engine's streaming kernels prefetch at (waste-quant's
/// `ROW_PREFETCH`), so the probe measures the bandwidth they can reach.
/// Without it the probe read 10.4 GB/s on one thread of an Intel Xeon VM
/// while the Q8G head's matvec streamed faster, and `roofline_share`
/// came out above 1 (docs/lab, thirty-fourth session).
#[cfg(target_arch = "x86_64")]
const PREFETCH: usize = 4096;

fn sum_words(b: &[u8]) -> u64 {
    let mut acc = [0u64; 4];
    let mut ch = b.chunks_exact(64);
    for c in &mut ch {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a prefetch is a hint: it never faults and reads nothing
        // architecturally, wherever the address points.
        unsafe {
            core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(
                c.as_ptr().wrapping_add(PREFETCH) as *const i8
            )
        };
        for (k, a) in acc.iter_mut().enumerate() {
            let lo = u64::from_le_bytes(c[8 * k..8 * k + 8].try_into().unwrap_or([0; 8]));
            let hi = u64::from_le_bytes(c[32 + 8 * k..40 + 8 * k].try_into().unwrap_or([0; 8]));
            *a = a.wrapping_add(lo).wrapping_add(hi);
        }
    }
    let tail: u64 = ch.remainder().iter().map(|&x| x as u64).sum();
    acc.iter().fold(tail, |s, a| s.wrapping_add(*a))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_arguments_out_of_range_are_errors() {
        let p = std::env::temp_dir().join(format!("waste-probe-{}", std::process::id()));
        std::fs::write(&p, vec![7u8; 64 << 10]).unwrap();
        let err = |rec: usize, qd: usize| probe_bandwidth(&p, rec, qd, 1 << 20, false, false).unwrap_err().to_string();
        assert!(err(4096, 0).contains("expected 1 to 64"));
        assert!(err(4096, 65).contains("expected 1 to 64"));
        assert!(err(usize::MAX, 1).contains("exceed the probe's 1024 MiB"));
        assert!(err(512 << 20, 4).contains("exceed"));
        // in range: the request rounded up to 4 KiB, reported as read
        let r = probe_bandwidth(&p, 1, 2, 1 << 20, false, false).unwrap();
        assert_eq!((r.record, r.qd, r.bytes), (4096, 2, 64 << 10));
        // a file smaller than one read: said so, not a short read
        let e = err(1 << 20, 1);
        assert!(e.contains("smaller than one read of 1048576 bytes") && e.contains("--record-size"), "{e}");
        std::fs::remove_file(&p).ok();
    }

    #[test]
    fn read_bandwidth_reads_every_share() {
        // uneven slices over 3 threads: a positive, finite time
        let a = vec![1u8; 1 << 20];
        let b = vec![2u8; 12345];
        let s = read_bandwidth(&[&a, &b, &[]], 3, 2);
        assert!(s.is_finite() && s > 0.0);
        assert_eq!(sum_words(&[1, 0, 0, 0, 0, 0, 0, 0, 5]), 6);
        // whole 64-byte lines and a tail: every word and byte counted once
        let words: Vec<u8> = (0..200u64).flat_map(|i| i.to_le_bytes()).chain([7, 9]).collect();
        assert_eq!(sum_words(&words), (0..200).sum::<u64>() + 16);
    }

    #[test]
    fn a_small_set_is_read_until_the_probe_minimum() {
        // a trunk of a few hundred KB: read often enough that thread start-up
        // is small beside it; a trunk past the minimum: read once
        for total in [READ_PROBE_MIN_BYTES / READ_PROBE_MAX_REPEATS, 361_192, READ_PROBE_MIN_BYTES - 1] {
            let r = read_repeats(total);
            assert!(r >= 2 && r * total >= READ_PROBE_MIN_BYTES, "{total}: {r}");
            assert!((r - 1) * total < READ_PROBE_MIN_BYTES, "{total}: {r} reads more than needed");
        }
        // a set of a few bytes: bounded, not 64 M readings
        assert_eq!(read_repeats(1), READ_PROBE_MAX_REPEATS);
        for total in [0, READ_PROBE_MIN_BYTES, 700 << 20, usize::MAX] {
            assert_eq!(read_repeats(total), 1);
        }
    }
}
