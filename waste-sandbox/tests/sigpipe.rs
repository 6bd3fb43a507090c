//! A host that does not ignore `SIGPIPE` (a C program's default) survives
//! a helper that exits without reading its request: the request is a file
//! the child reads as stdin, so the parent never writes into a pipe whose
//! reader is gone (a process of its own: the signal's disposition is
//! process-wide).

#![cfg(unix)]

use std::path::Path;

#[test]
fn a_helper_that_does_not_read_cannot_kill_the_host_with_sigpipe() {
    // SAFETY: restoring the default disposition, as a C host has it.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    // the largest template, larger than a pipe's buffer (64 KiB on Linux):
    // a writer would block, then take SIGPIPE
    let src = "x".repeat(waste_tokenizer::MAX_TEMPLATE_BYTES as usize);
    for _ in 0..20 {
        let e = waste_sandbox::render_with(Path::new("/bin/true"), &src, &["user"], true);
        assert!(matches!(e.as_deref(), Ok("")), "{e:?}");
    }
}
