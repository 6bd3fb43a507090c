//! The chat REPL's input: in a terminal a line editor (arrows, history kept
//! in the user's data directory), otherwise bounded plain lines (pipes,
//! scripts); and Ctrl-C, which cancels a running generation instead of
//! ending the process (the conversation is kept).

use anyhow::{bail, Result};
use std::io::BufRead;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

/// What one read gave.
pub enum Line {
    /// A line (without its newline).
    Text(String),
    /// Ctrl-C at the prompt: nothing to cancel, the REPL goes on.
    Interrupted,
    /// Ctrl-D or the end of the input.
    End,
}

/// The REPL's line source.
pub struct Input {
    editor: Option<(rustyline::DefaultEditor, Option<PathBuf>)>,
}

/// Where the chat history is kept: `$XDG_DATA_HOME/waste/chat_history`, else
/// `~/.local/share/waste/chat_history`; `None` without either variable.
pub fn history_path() -> Option<PathBuf> {
    let data = std::env::var_os("XDG_DATA_HOME").filter(|d| !d.is_empty()).map(PathBuf::from).or_else(|| {
        std::env::var_os("HOME").filter(|h| !h.is_empty()).map(|h| PathBuf::from(h).join(".local/share"))
    })?;
    Some(data.join("waste").join("chat_history"))
}

impl Input {
    /// A line editor when stdin and stdout are a terminal (history loaded
    /// from [`history_path`]; a missing or unreadable file starts empty),
    /// plain lines otherwise.
    pub fn new() -> Input {
        use std::io::IsTerminal;
        if !(std::io::stdin().is_terminal() && std::io::stdout().is_terminal()) {
            return Input { editor: None };
        }
        let Ok(mut ed) = rustyline::DefaultEditor::new() else { return Input { editor: None } };
        let path = history_path();
        if let Some(p) = &path {
            let _ = ed.load_history(p);
        }
        Input { editor: Some((ed, path)) }
    }

    /// Whether the line editor reads (stdin and stdout are a terminal).
    pub fn is_terminal(&self) -> bool {
        self.editor.is_some()
    }

    /// The next line.
    ///
    /// # Errors
    /// A read error, or a plain line longer than the CLI's text bound.
    pub fn read(&mut self) -> Result<Line> {
        match &mut self.editor {
            Some((ed, path)) => match ed.readline("> ") {
                Ok(l) => {
                    if !l.trim().is_empty() {
                        let _ = ed.add_history_entry(l.as_str());
                        if let Some(p) = path {
                            // kept after every line: a killed REPL loses none
                            let _ = p.parent().map(std::fs::create_dir_all);
                            let _ = ed.save_history(p);
                        }
                    }
                    Ok(Line::Text(l))
                }
                Err(rustyline::error::ReadlineError::Interrupted) => Ok(Line::Interrupted),
                Err(rustyline::error::ReadlineError::Eof) => Ok(Line::End),
                Err(e) => bail!("reading the terminal: {e}"),
            },
            None => {
                // a line is bounded like any text input (`chat < /dev/zero`
                // grew without end looking for a newline)
                let mut line = String::new();
                let max = crate::cmd_eval::MAX_TEXT_BYTES;
                let n = std::io::Read::take(std::io::stdin().lock(), max + 1).read_line(&mut line)?;
                if n == 0 {
                    return Ok(Line::End);
                }
                if n as u64 > max {
                    bail!("a line of more than {} MiB on stdin", max >> 20);
                }
                Ok(Line::Text(line.trim_end_matches(['\n', '\r']).to_string()))
            }
        }
    }
}

/// Set by Ctrl-C (SIGINT) while the REPL runs; taken by the generation.
static CANCEL: AtomicBool = AtomicBool::new(false);

#[cfg(unix)]
extern "C" fn on_sigint(_: libc::c_int) {
    // async-signal-safe: one atomic store
    CANCEL.store(true, Ordering::Relaxed);
}

/// From now on Ctrl-C (SIGINT) sets a flag ([`take_cancel`]) instead of
/// ending the process. (At the prompt the line editor reads Ctrl-C itself.)
pub fn catch_ctrl_c() {
    #[cfg(unix)]
    // SAFETY: installs a handler that only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_sigint as *const () as libc::sighandler_t);
    }
}

/// Whether Ctrl-C came since the last call (and clears it).
pub fn take_cancel() -> bool {
    CANCEL.swap(false, Ordering::Relaxed)
}
