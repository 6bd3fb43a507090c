//! No render's watchdog outlives it: when `render_with` returns, its
//! watchdog thread has ended (a process of its own, so no other test's
//! rendering is in flight). A detached watchdog that was still waking up
//! when the call returned showed in a fuzzer's leak check; a server
//! rendering many prompts would carry such threads too.

#![cfg(target_os = "linux")]

use std::path::Path;

/// Threads of this process named `name` (`/proc/self/task/*/comm`).
fn threads_named(name: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .flatten()
        .filter(|t| std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim_end() == name))
        .count()
}

#[test]
fn every_rendering_ends_its_watchdog_before_returning() {
    let helper = Path::new(env!("CARGO_BIN_EXE_waste-render-template"));
    for i in 0..50 {
        // a rendering and a Jinja error, each with its own watchdog
        let src = if i % 2 == 0 { "{{ messages[0].role }}" } else { "{% for %}" };
        let _ = waste_sandbox::render_with(helper, src, &["user"], true);
        // the name is cut to 15 bytes by the kernel
        assert_eq!(threads_named("waste-render-wa"), 0, "a watchdog alive after rendering {i}");
    }
}
