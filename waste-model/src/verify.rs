//! Whole-container verification: every record header, CRC and scale, every
//! trunk tensor's values, trunk and codebook bounds (by opening), read with
//! direct I/O at disk speed.

use crate::{Error, Result};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;
use waste_format::{check_record, Container};
use waste_io::{AlignedBuf, DirectFile, Priority, ReaderPool};

/// The most bytes one read of [`verify`] asks for (`records_per_read`
/// records): the reads in flight stay within `queue_depth` times this.
pub const MAX_VERIFY_READ: usize = 1 << 30;

/// Options of [`verify`].
#[derive(Clone, Copy, Debug)]
pub struct VerifyOptions {
    /// Bypass the page cache.
    pub direct_io: bool,
    /// Reads in flight.
    pub queue_depth: usize,
    /// Records per read (several records per read make big sequential transfers).
    pub records_per_read: usize,
}

impl Default for VerifyOptions {
    fn default() -> Self {
        VerifyOptions { direct_io: true, queue_depth: 4, records_per_read: 16 }
    }
}

/// What [`verify`] found.
#[derive(Clone, Debug, Default)]
pub struct VerifyReport {
    /// Every problem, one precise line each (empty = healthy).
    pub problems: Vec<String>,
    /// Records checked.
    pub records: u64,
    /// Trunk tensors checked (every value or scale finite).
    pub tensors: u64,
    /// Bytes of expert banks read.
    pub bytes: u64,
    /// Seconds spent reading and checking banks.
    pub seconds: f64,
    /// Whether every bank was read with direct I/O.
    pub direct_io: bool,
}

/// Verify a container: structural validation (manifest, trunk bounds,
/// codebooks), every trunk tensor's stored values (scales and F32/F16/BF16
/// weights finite — the embedding table too, which opening a model only
/// reads row by row), and every expert record's header, CRC and per-row
/// scales (finite: a record sealed with an infinite scale passes its CRC).
/// A container that
/// cannot even be opened is an `Err`; damage inside banks is listed in
/// [`VerifyReport::problems`]. `progress(done, total)` gets bank bytes.
///
/// # Errors
/// [`Error::Format`] when the container does not open; damaged records are
/// counted in the report, not returned. [`Error::Arg`] for more reads in
/// flight than [`crate::MAX_IO_THREADS`] (a reader thread each) or a read
/// of more than [`MAX_VERIFY_READ`] bytes; [`Error::Io`] when the OS
/// refuses a reader thread.
pub fn verify(path: &Path, opts: VerifyOptions, progress: &dyn Fn(u64, u64)) -> Result<VerifyReport> {
    if opts.queue_depth > crate::MAX_IO_THREADS {
        return Err(Error::Arg(format!(
            "queue_depth {}: at most {} reads in flight (a reader thread each)",
            opts.queue_depth,
            crate::MAX_IO_THREADS
        )));
    }
    let c = Container::open(path)?;
    // the read size is refused before any reading (the trunk's checks read
    // the whole trunk)
    let per = opts.records_per_read.max(1);
    if let Some((_, lay)) = &c.experts {
        if per.saturating_mul(lay.rec_bytes) > MAX_VERIFY_READ {
            return Err(Error::Arg(format!(
                "records_per_read {per}: {per} records of {} bytes exceed one read's {} MiB",
                lay.rec_bytes,
                MAX_VERIFY_READ >> 20
            )));
        }
    }
    let mut rep = VerifyReport { direct_io: true, ..Default::default() };
    let mut trunk = crate::weights::TrunkReader::new(&c)?;
    let mut names: Vec<&String> = c.tensors.keys().collect();
    names.sort_by_key(|n| c.tensors[*n].off);
    for name in names {
        if let Err(e) = trunk.matrix_full(name) {
            rep.problems.push(e.to_string());
        }
        rep.tensors += 1;
    }
    let Some((_, lay)) = c.experts else { return Ok(rep) };
    let total: u64 = c.banks.iter().flatten().map(|b| b.experts as u64 * lay.rec_bytes as u64).sum();
    let pool = ReaderPool::try_new(opts.queue_depth.max(1))?;
    let t0 = Instant::now();
    for bank in c.banks.iter().flatten() {
        let f = Arc::new(DirectFile::open(&bank.path, opts.direct_io)?);
        rep.direct_io &= f.is_direct();
        let mut pending = std::collections::VecDeque::new();
        let mut e0 = 0;
        let drain_one = |pending: &mut std::collections::VecDeque<(usize, usize, waste_io::Ticket)>,
                         rep: &mut VerifyReport|
         -> Result<()> {
            let Some((first, n, t)) = pending.pop_front() else { return Ok(()) };
            let (buf, r) = t.wait();
            r.map_err(Error::Io)?;
            for k in 0..n {
                let rec = &buf[k * lay.rec_bytes..(k + 1) * lay.rec_bytes];
                if let Err(e) =
                    check_record(rec, bank.layer, first + k, &lay, bank.codebook_base, c.codebooks.count, true)
                {
                    rep.problems.push(e.to_string());
                }
                rep.records += 1;
            }
            rep.bytes += (n * lay.rec_bytes) as u64;
            progress(rep.bytes, total);
            Ok(())
        };
        while e0 < bank.experts {
            let n = per.min(bank.experts - e0);
            let buf = AlignedBuf::new(n * lay.rec_bytes, true);
            pending.push_back((e0, n, pool.submit(f.clone(), bank.record_offset(e0, &lay), buf, Priority::Demand)));
            e0 += n;
            if pending.len() >= opts.queue_depth.max(1) {
                drain_one(&mut pending, &mut rep)?;
            }
        }
        while !pending.is_empty() {
            drain_one(&mut pending, &mut rep)?;
        }
    }
    rep.seconds = t0.elapsed().as_secs_f64();
    Ok(rep)
}
