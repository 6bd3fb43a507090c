//! A new KDA state's pages are written when it is made, not left to the
//! allocator's lazily zeroed mapping: the delta rule reads the state before
//! it writes it, and a lazily zeroed page first read then written faults
//! twice and flushes the other threads' TLBs (docs/lab/2026-12-03-42-matmat-tiles-that-prefetch-where-a-first-prefill-s.md, eighteenth
//! session). Its own test binary: resident memory is per process.

#[cfg(target_os = "linux")]
#[test]
fn a_new_kda_state_is_resident() {
    use waste_attn::{KdaConfig, KdaState};
    // resident bytes of this process (`VmRSS` in `/proc/self/status`, in kB
    // whatever the page size)
    let resident = || -> u64 {
        let s = std::fs::read_to_string("/proc/self/status").expect("status");
        let line = s.lines().find(|l| l.starts_with("VmRSS:")).expect("a VmRSS line");
        let kb: u64 = line.split_whitespace().nth(1).expect("its value").parse().expect("a number");
        kb * 1024
    };
    // 64 heads of 256×256: a 16 MiB state, far above the allocator's mmap threshold
    let c = KdaConfig { heads: 64, dim: 256, kernel: 4, eps: 1e-6, lower_bound: None, chunked: false };
    let bytes = (c.heads * c.dim * c.dim * 4) as u64;
    let before = resident();
    let st = KdaState::new(&c);
    let grown = resident().saturating_sub(before);
    assert!(st.s.iter().all(|&v| v == 0.0));
    assert!(grown >= bytes * 9 / 10, "a new state made {grown} bytes resident of its {bytes}");
}
