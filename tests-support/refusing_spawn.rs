//! A thread spawner for a pool's private `start(n, spawn)` that refuses
//! the thread at one index — as an OS at its thread or memory limit does —
//! and counts the threads that return, so a test sees both the error and
//! that the threads started before it were stopped (included by `#[path]`
//! from the unit tests of `waste-io/src/pool.rs` and
//! `waste-quant/src/pool.rs`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

/// `spawn(i, arg)`: an error for `i == refuse`, else a thread running
/// `run(&arg)` that counts itself in `exited` when `run` returns.
pub fn refusing_spawn<A: Send + 'static>(
    refuse: usize,
    exited: Arc<AtomicUsize>,
    run: fn(&A),
) -> impl FnMut(usize, A) -> std::io::Result<JoinHandle<()>> {
    move |i, arg| {
        if i == refuse {
            return Err(std::io::Error::new(std::io::ErrorKind::WouldBlock, "no more threads"));
        }
        let e = exited.clone();
        Ok(std::thread::spawn(move || {
            run(&arg);
            e.fetch_add(1, Ordering::SeqCst);
        }))
    }
}
