//! Reporting a check this machine cannot run, shared by the test suites
//! that force each SIMD level (included with `#[path]`).

/// A check this machine cannot run: listed by `cargo xtask check` (through
/// `WASTE_SKIP_LOG`) and printed, never a silent pass; a required one fails
/// the test when `WASTE_REQUIRE_ALL=1` (CI).
pub fn report_skip(what: &str, required: bool) {
    let line = format!("{what}{}", if required { " (required)" } else { "" });
    if required && std::env::var("WASTE_REQUIRE_ALL").is_ok_and(|v| v == "1") {
        panic!("required check skipped: {line}");
    }
    if let Some(p) = std::env::var_os("WASTE_SKIP_LOG") {
        use std::io::Write;
        if let Ok(mut f) = std::fs::OpenOptions::new().append(true).create(true).open(p) {
            let _ = writeln!(f, "{line}");
        }
    }
    println!("SKIP: {line}");
}
