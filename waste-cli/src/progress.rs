//! Progress bars on a terminal, silence when piped.

use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;

/// A byte progress bar shown only when stderr is a terminal and not quiet.
pub fn bytes_bar(msg: &str, quiet: bool) -> ProgressBar {
    if quiet || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let b = ProgressBar::new(0);
    b.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    b.set_message(msg.to_string());
    b
}

/// A count progress bar (layers, tokens) shown only on a terminal.
pub fn count_bar(msg: &str, quiet: bool) -> ProgressBar {
    if quiet || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let b = ProgressBar::new(0);
    b.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} ETA {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    b.set_message(msg.to_string());
    b
}
