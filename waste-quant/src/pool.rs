//! A persistent compute pool: no thread spawn per call. Work is split into
//! tasks whose outputs are disjoint (e.g. row ranges of a matvec), so the
//! result is bit-identical for any thread count.

use crate::fast::{Numeric, QInput};
use crate::level::{level, Level};
use crate::matrix::MatRef;
use parking_lot::{Condvar, Mutex};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a worker (for the next call) and the caller (for the workers'
/// last tasks) poll before sleeping on the condition variable. A decode
/// token makes hundreds of short pool calls; waking a sleeping thread cost
/// ~9 µs a call on a 2-vCPU VM, more than a 5 µs task (docs/lab/2026-12-01-30-matvec-streams-the-pool-s-per-call-cost-byte.md,
/// "The pool's per-call cost"), and on the Intel Xeon VM of docs/lab entry
/// 78 a pass after the worker slept streamed 0.12 ms slower (a vCPU that
/// halted wakes late). At 100 µs a 48B AVX2 token still slept about 11
/// times (the experts' lanes end up to ~0.2 ms apart); at 3 ms, none.
/// Polling stops after this, so an idle process sleeps.
const SPIN: Duration = Duration::from_micros(3000);

/// Poll `ready` for up to [`SPIN`]; whether it became true.
fn spin_until(ready: impl Fn() -> bool) -> bool {
    let t0 = Instant::now();
    loop {
        for _ in 0..64 {
            if ready() {
                return true;
            }
            std::hint::spin_loop();
        }
        if t0.elapsed() >= SPIN {
            return ready();
        }
    }
}

type Task = dyn Fn(usize) + Sync;

#[derive(Clone, Copy)]
struct TaskPtr(*const Task);
// SAFETY: the pointee is Sync and outlives every use (run() waits for all tasks).
unsafe impl Send for TaskPtr {}

struct State {
    gen: u64,
    task: Option<TaskPtr>,
    ntasks: usize,
    next: usize,
    done: usize,
    panicked: bool,
    quit: bool,
}

struct Inner {
    m: Mutex<State>,
    start: Condvar,
    finished: Condvar,
    /// `State::gen`, readable without the lock (workers poll it).
    gen: AtomicU64,
    /// `State::done`, readable without the lock (the caller polls it).
    done: AtomicUsize,
}

/// The compute pool (`threads` includes the calling thread).
pub struct Pool {
    inner: Arc<Inner>,
    handles: Vec<JoinHandle<()>>,
    threads: usize,
    level: Level,
    numeric: Numeric,
    run_lock: Mutex<()>,
}

/// Rows below which a matvec is not split.
const MIN_ROWS_SPLIT: usize = 32;

impl Pool {
    /// A pool of `threads` (≥ 1) computing at the process's SIMD level.
    pub fn new(threads: usize) -> Pool {
        Self::with_level(threads, level())
    }
    /// A pool at an explicit SIMD level (tests force each level).
    ///
    /// # Panics
    /// When the OS refuses to start a compute thread; the engine uses
    /// [`Pool::try_with_level`].
    pub fn with_level(threads: usize, level: Level) -> Pool {
        Self::try_with_level(threads, level).expect("spawn compute thread")
    }
    /// [`Pool::with_level`], with a thread the OS refuses to start an error
    /// instead of a panic; the threads already started are stopped before
    /// it returns.
    ///
    /// # Errors
    /// The OS error when it refuses a compute thread.
    pub fn try_with_level(threads: usize, level: Level) -> std::io::Result<Pool> {
        Self::start(threads, level, |i, inner| {
            std::thread::Builder::new().name(format!("waste-compute-{i}")).spawn(move || {
                // macOS: on performance cores (threads without a class may land on efficiency cores)
                waste_io::user_initiated_qos();
                worker(&inner)
            })
        })
    }
    /// The pool with its `threads - 1` workers started by `spawn(i, inner)`.
    fn start(
        threads: usize,
        level: Level,
        mut spawn: impl FnMut(usize, Arc<Inner>) -> std::io::Result<JoinHandle<()>>,
    ) -> std::io::Result<Pool> {
        let threads = threads.max(1);
        let inner = Arc::new(Inner {
            m: Mutex::new(State { gen: 0, task: None, ntasks: 0, next: 0, done: 0, panicked: false, quit: false }),
            start: Condvar::new(),
            finished: Condvar::new(),
            gen: AtomicU64::new(0),
            done: AtomicUsize::new(0),
        });
        let mut pool =
            Pool { inner, handles: Vec::new(), threads, level, numeric: Numeric::Exact, run_lock: Mutex::new(()) };
        for i in 1..threads {
            // on an error the pool is dropped: its Drop stops the workers started
            let h = spawn(i, pool.inner.clone())?;
            pool.handles.push(h);
        }
        Ok(pool)
    }
    /// Threads (including the caller).
    pub fn threads(&self) -> usize {
        self.threads
    }
    /// SIMD level used by this pool's kernels.
    pub fn level(&self) -> Level {
        self.level
    }
    /// The numeric mode of this pool's products (`exact` unless set).
    pub fn numeric(&self) -> Numeric {
        self.numeric
    }
    /// Compute the products in `numeric` from now on: in `fast`, Q8G and
    /// Q4G matrices take 8-bit activations ([`crate::fast`]); every other
    /// format computes as in `exact`.
    pub fn set_numeric(&mut self, numeric: Numeric) {
        self.numeric = numeric;
    }
    /// The inputs of a product quantized for the fast mode, when the pool
    /// computes `m` in it (None: compute as in `exact`).
    fn fast_inputs(&self, m: &MatRef<'_>, xs: &[f32], nt: usize) -> Option<Vec<QInput>> {
        let qmax = self.numeric.qmax().filter(|_| crate::fast::applies(m))?;
        let cp = m.cols_padded();
        Some(
            (0..nt)
                .map(|t| crate::fast::quantize_at(self.level, &xs[t * m.cols..(t + 1) * m.cols], cp, qmax))
                .collect(),
        )
    }

    /// Run `f(0..ntasks)` across the pool; returns when all are done.
    ///
    /// # Panics
    /// When a task panicked (re-raised on the caller after every task ended).
    pub fn run(&self, ntasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if ntasks == 0 {
            return;
        }
        if self.threads == 1 || ntasks == 1 {
            (0..ntasks).for_each(f);
            return;
        }
        let _g = self.run_lock.lock();
        // SAFETY: erase the lifetime; we wait below until no worker holds the pointer.
        let short: *const (dyn Fn(usize) + Sync + '_) = f;
        let ptr = TaskPtr(unsafe { std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), *const Task>(short) });
        {
            let mut s = self.inner.m.lock();
            s.task = Some(ptr);
            s.ntasks = ntasks;
            s.next = 0;
            s.done = 0;
            self.inner.done.store(0, Ordering::Release);
            s.panicked = false;
            s.gen += 1;
            self.inner.gen.store(s.gen, Ordering::Release);
            self.inner.start.notify_all();
        }
        work(&self.inner);
        spin_until(|| self.inner.done.load(Ordering::Acquire) >= ntasks);
        let mut s = self.inner.m.lock();
        while s.done < s.ntasks {
            self.inner.finished.wait(&mut s);
        }
        s.task = None;
        if s.panicked {
            drop(s);
            panic!("a compute task panicked");
        }
    }

    /// `y = W · x` split by rows across the pool (bit-identical for any thread count).
    pub fn matvec(&self, m: &MatRef<'_>, x: &[f32], y: &mut [f32]) {
        self.matvec_rows(m, x, 0, y)
    }

    /// `y[i] = W[row0 + i] · x`, split across the pool.
    pub fn matvec_rows(&self, m: &MatRef<'_>, x: &[f32], row0: usize, y: &mut [f32]) {
        let n = y.len();
        let parts = self.threads.min(n / MIN_ROWS_SPLIT).max(1);
        let fast = self.fast_inputs(m, x, 1);
        let rows = |x0: &[f32], r: usize, ys: &mut [f32]| match &fast {
            Some(q) => m.matvec_rows_fast(self.level, &q[0], r, ys),
            None => m.matvec_rows(self.level, x0, r, ys),
        };
        if parts == 1 {
            rows(x, row0, y);
            return;
        }
        let out = SyncSlice::new(y);
        self.run(parts, &|p| {
            let (a, b) = (n * p / parts, n * (p + 1) / parts);
            // SAFETY: parts write disjoint ranges [a, b).
            let ys = unsafe { out.range(a, b) };
            rows(x, row0 + a, ys);
        });
    }

    /// `ys[t] = W · xs[t]` for `nt` token-major inputs (`xs`: `nt × cols`,
    /// `ys`: `nt × rows`), rows split across the pool; each weight row is
    /// read once for all inputs. Bit-identical to `nt` calls of [`Pool::matvec`].
    ///
    /// # Panics
    /// When `xs`/`ys` are shorter than `nt` inputs/outputs of the matrix's widths.
    pub fn matmat(&self, m: &MatRef<'_>, xs: &[f32], nt: usize, ys: &mut [f32]) {
        let n = m.rows;
        assert_eq!(ys.len(), nt * n, "matmat output length");
        if nt == 1 {
            return self.matvec(m, xs, ys);
        }
        let parts = self.threads.min(n / MIN_ROWS_SPLIT).max(1);
        let fast = self.fast_inputs(m, xs, nt);
        let out = SyncSlice::new(ys);
        self.run(parts, &|p| {
            let (a, b) = (n * p / parts, n * (p + 1) / parts);
            match &fast {
                Some(q) => {
                    // SAFETY: part p writes only rows [a, b) of each token's output; disjoint, in bounds.
                    let mut outs: Vec<&mut [f32]> =
                        (0..nt).map(|t| unsafe { out.range(t * n + a, t * n + b) }).collect();
                    m.matmat_rows_fast(self.level, q, a, &mut outs)
                }
                // SAFETY: part p writes only rows [a, b) of every token's output;
                // the parts' row ranges are disjoint and in bounds.
                None => unsafe { m.matmat_rows(self.level, xs, nt, a, b - a, out.ptr_at(a), n) },
            }
        });
    }

    /// Several products in one pass of the pool: `job.ys = job.m · job.xs`
    /// for each job's token-major inputs (matrices that read the same input,
    /// like q/k/v, or independent small ones; each job has its own token
    /// count, `xs.len() / m.cols`, which may be 0). Their rows are split
    /// across the threads together, weighted by their work, so a layer's
    /// projections cost one synchronisation instead of one each and small
    /// matrices no longer run alone on one thread. Bit-identical to a
    /// [`Pool::matmat`] per job.
    ///
    /// # Panics
    /// When a job's input is not a whole number of its matrix's rows of
    /// input, or its output does not hold as many tokens.
    pub fn matmats(&self, jobs: &mut [MatJob<'_>]) {
        // each job's matrix, input, output and token count
        let views: Vec<(MatRef<'_>, &[f32], SyncSlice<f32>, usize)> = jobs
            .iter_mut()
            .map(|j| {
                let n = j.xs.len() / j.m.cols.max(1);
                assert_eq!(j.xs.len(), n * j.m.cols, "matmats input length");
                assert_eq!(j.ys.len(), n * j.m.rows, "matmats output length");
                (*j.m, j.xs, SyncSlice::new(&mut *j.ys), n)
            })
            .collect();
        // work offsets: a row of job j costs its width times its tokens
        let row_work = |j: usize| (views[j].0.cols.max(1) * views[j].3) as u64;
        let mut offs = Vec::with_capacity(views.len());
        let mut total = 0u64;
        for (j, v) in views.iter().enumerate() {
            offs.push(total);
            total += v.0.rows as u64 * row_work(j);
        }
        let rows: usize = views.iter().filter(|v| v.3 > 0).map(|v| v.0.rows).sum();
        let parts = self.threads.min(rows / MIN_ROWS_SPLIT).max(1);
        // the first row of job j at work position w (rows whose work starts before w go earlier)
        let row_at = |j: usize, w: u64| -> usize {
            (w.saturating_sub(offs[j]).div_ceil(row_work(j).max(1)) as usize).min(views[j].0.rows)
        };
        let level = self.level;
        // the fast mode's quantized inputs, once per distinct input (q, k, v
        // and gate/up read the same one): `fast[j]` indexes `quantized`
        let mut quantized: Vec<Vec<QInput>> = Vec::new();
        let mut fast: Vec<Option<usize>> = Vec::with_capacity(views.len());
        for (j, &(m, xs, _, nt)) in views.iter().enumerate() {
            let same = (0..j).find(|&e| {
                let (em, exs) = (views[e].0, views[e].1);
                fast[e].is_some() && std::ptr::eq(exs, xs) && em.cols == m.cols && em.cols_padded() == m.cols_padded()
            });
            fast.push(match same {
                Some(e) if crate::fast::applies(&m) => fast[e],
                _ => self.fast_inputs(&m, xs, nt).map(|q| {
                    quantized.push(q);
                    quantized.len() - 1
                }),
            });
        }
        self.run(parts, &|p| {
            let (wa, wb) = (total * p as u64 / parts as u64, total * (p as u64 + 1) / parts as u64);
            for (j, &(m, xs, ref ys, nt)) in views.iter().enumerate() {
                let (a, b) = (row_at(j, wa), row_at(j, wb));
                if a >= b || nt == 0 {
                    continue;
                }
                if let Some(q) = fast[j].map(|k| &quantized[k]) {
                    // SAFETY: rows [a, b) of each token's output: the parts' ranges tile each job.
                    let mut outs: Vec<&mut [f32]> =
                        (0..nt).map(|t| unsafe { ys.range(t * m.rows + a, t * m.rows + b) }).collect();
                    m.matmat_rows_fast(level, q, a, &mut outs);
                } else if nt == 1 {
                    // SAFETY: the parts' row ranges of each job tile it without overlap.
                    m.matvec_rows(level, xs, a, unsafe { ys.range(a, b) });
                } else {
                    // SAFETY: as above: rows [a, b) of every token's output, in bounds.
                    unsafe { m.matmat_rows(level, xs, nt, a, b - a, ys.ptr_at(a), m.rows) };
                }
            }
        });
    }

    /// Split `0..n` into contiguous chunks, one task per thread.
    pub fn chunks(&self, n: usize, f: &(dyn Fn(usize, usize) + Sync)) {
        let parts = self.threads.min(n).max(1);
        self.run(parts, &|p| f(n * p / parts, n * (p + 1) / parts));
    }
}

/// One product of [`Pool::matmats`]: `ys = m · xs` (`xs`: `nt × m.cols`
/// token-major, `ys`: `nt × m.rows`, `nt` the job's own token count).
pub struct MatJob<'a> {
    /// The matrix.
    pub m: &'a MatRef<'a>,
    /// Its inputs.
    pub xs: &'a [f32],
    /// Its outputs.
    pub ys: &'a mut [f32],
}

/// A mutable slice shared by tasks that write disjoint ranges.
pub struct SyncSlice<T> {
    ptr: *mut T,
    len: usize,
}
// SAFETY: users promise disjoint access (see `range`).
unsafe impl<T: Send> Sync for SyncSlice<T> {}
unsafe impl<T: Send> Send for SyncSlice<T> {}

impl<T> SyncSlice<T> {
    /// Wrap a slice.
    pub fn new(s: &mut [T]) -> Self {
        SyncSlice { ptr: s.as_mut_ptr(), len: s.len() }
    }
    /// A raw pointer to element `a` (for strided disjoint writes).
    ///
    /// # Panics
    /// When `a` is out of range.
    pub fn ptr_at(&self, a: usize) -> *mut T {
        assert!(a <= self.len);
        // SAFETY: in bounds.
        unsafe { self.ptr.add(a) }
    }
    /// A sub-slice `[a, b)`.
    ///
    /// # Safety
    /// No two live sub-slices may overlap, and the wrapped slice must outlive them.
    ///
    /// # Panics
    /// When `a..b` is out of range.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn range(&self, a: usize, b: usize) -> &mut [T] {
        assert!(a <= b && b <= self.len);
        // SAFETY: in bounds; exclusivity promised by the caller.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(a), b - a) }
    }
}

fn work(inner: &Inner) {
    loop {
        let (task, i) = {
            let mut s = inner.m.lock();
            match s.task {
                Some(t) if s.next < s.ntasks => {
                    s.next += 1;
                    (t, s.next - 1)
                }
                _ => return,
            }
        };
        // SAFETY: run() keeps the closure alive until done == ntasks.
        let f = unsafe { &*task.0 };
        let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(i))).is_ok();
        let mut s = inner.m.lock();
        s.done += 1;
        inner.done.store(s.done, Ordering::Release);
        s.panicked |= !ok;
        if s.done == s.ntasks {
            inner.finished.notify_all();
        }
    }
}

fn worker(inner: &Inner) {
    let mut seen = 0u64;
    loop {
        spin_until(|| inner.gen.load(Ordering::Acquire) != seen);
        {
            let mut s = inner.m.lock();
            while s.gen == seen && !s.quit {
                inner.start.wait(&mut s);
            }
            if s.quit {
                return;
            }
            seen = s.gen;
        }
        work(inner);
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.inner.m.lock().quit = true;
        self.inner.start.notify_all();
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
#[path = "../../tests-support/refusing_spawn.rs"]
mod refusing_spawn;

#[cfg(test)]
mod tests {
    use super::refusing_spawn::refusing_spawn;
    use super::*;
    use waste_format::Fmt;

    /// A worker the OS refuses is an error, not a panic, and the workers
    /// started before it stop (the pool's Drop joins them).
    #[test]
    fn a_refused_thread_is_an_error_and_the_started_ones_stop() {
        let exited = Arc::new(AtomicUsize::new(0));
        let r = Pool::start(5, Level::Scalar, refusing_spawn(3, exited.clone(), |i: &Arc<Inner>| worker(i)));
        assert!(r.is_err(), "a refused thread was not reported");
        assert_eq!(exited.load(Ordering::SeqCst), 2, "the two started workers were not stopped");
    }

    #[test]
    fn matvec_is_bit_identical_for_any_thread_count() {
        let rows = 257;
        let cols = 100;
        let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919) % 1000) as f32 / 997.0 - 0.5).collect();
        let x: Vec<f32> = (0..cols).map(|i| (i as f32).sin()).collect();
        let m = MatRef::new(Fmt::F32, rows, cols, 0, bytemuck::cast_slice(&w), &[]).unwrap();
        let mut y1 = vec![0f32; rows];
        Pool::new(1).matvec(&m, &x, &mut y1);
        for t in [2, 3, 5] {
            let p = Pool::new(t);
            for _ in 0..3 {
                let mut y = vec![0f32; rows];
                p.matvec(&m, &x, &mut y);
                assert_eq!(
                    y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    y1.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                );
            }
        }
    }

    /// In the fast mode every product (matvec, matmat, matmats) gives the
    /// definition's bits for each token, at any thread count; Q4G takes it,
    /// F32 stays exact.
    #[test]
    fn fast_products_are_the_definition_for_any_thread_count() {
        let (rows, cols, nt) = (200, 256, 3);
        let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919) % 1000) as f32 / 997.0 - 0.5).collect();
        let enc = (crate::formats::tensor_format(Fmt::Q4G).encode)(&w, rows, cols, 128).unwrap();
        let q = crate::Matrix::from_stored(Fmt::Q4G, rows, cols, 128, enc.0, &enc.1).unwrap();
        let f = crate::Matrix::from_stored(Fmt::F32, rows, cols, 0, bytemuck::cast_slice(&w).to_vec(), &[]).unwrap();
        let xs: Vec<f32> = (0..nt * cols).map(|i| (i as f32 * 0.37).sin()).collect();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let (qv, fv) = (q.view(), f.view());
        let (mut want, mut exact_f32) = (Vec::new(), Vec::new());
        for t in 0..nt {
            let x = &xs[t * cols..(t + 1) * cols];
            let qx = crate::fast::quantize(x, cols);
            want.extend((0..rows).map(|r| crate::fast::row_dot_scalar(&qv, r, &qx)));
            exact_f32.extend((0..rows).map(|r| fv.row_dot_scalar(r, x)));
        }
        for threads in [1, 2, 3] {
            let mut p = Pool::new(threads);
            p.set_numeric(Numeric::Fast);
            let mut y = vec![0f32; rows];
            p.matvec(&qv, &xs[..cols], &mut y);
            assert_eq!(bits(&y), bits(&want[..rows]), "matvec, {threads} threads");
            let mut ys = vec![0f32; nt * rows];
            p.matmat(&qv, &xs, nt, &mut ys);
            assert_eq!(bits(&ys), bits(&want), "matmat, {threads} threads");
            // two Q4G jobs on one input (quantized once) beside an F32 one
            let (mut a, mut b, mut c) = (vec![0f32; nt * rows], vec![0f32; nt * rows], vec![0f32; nt * rows]);
            p.matmats(&mut [
                MatJob { m: &qv, xs: &xs, ys: &mut a },
                MatJob { m: &fv, xs: &xs, ys: &mut b },
                MatJob { m: &qv, xs: &xs, ys: &mut c },
            ]);
            assert_eq!(bits(&a), bits(&want), "matmats, {threads} threads");
            assert_eq!(bits(&c), bits(&want), "matmats, the input's second job, {threads} threads");
            assert_eq!(bits(&b), bits(&exact_f32), "F32 stays exact");
        }
        // and the exact mode is not the fast one
        let mut y = vec![0f32; rows];
        Pool::new(1).matvec(&qv, &xs[..cols], &mut y);
        assert_ne!(bits(&y), bits(&want[..rows]));
    }

    #[test]
    fn run_covers_every_task_once() {
        let p = Pool::new(3);
        let hits: Vec<std::sync::atomic::AtomicUsize> = (0..50).map(|_| Default::default()).collect();
        p.run(50, &|i| {
            hits[i].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        });
        assert!(hits.iter().all(|h| h.load(std::sync::atomic::Ordering::Relaxed) == 1));
    }
}
