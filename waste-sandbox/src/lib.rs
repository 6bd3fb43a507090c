//! Chat templates rendered in a child process. A `chat_template.jinja` is
//! code from the container, and minijinja's fuel and nesting limit do not
//! bound a value a template grows without writing it (`{% set ns.s = ns.s
//! ~ ns.s %}` in a loop doubles a string an iteration: the allocation
//! failure ends the whole process) nor the time one instruction takes (a
//! 100 MB repetition is one). Rendered by a helper child limited in address
//! space and CPU time, a hostile template is an error naming the file, and
//! the process — a server with its other requests — goes on.
//!
//! The helper is any program that serves one request with
//! [`serve_child`]: the `waste` binary (`waste __render-template`, what the
//! command line installs for itself) or this crate's small
//! `waste-render-template`, for a program that embeds the engine (the C
//! ABI's `waste_use_template_sandbox`). [`install`] makes every rendering
//! of the process go through it.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::OnceLock;
use waste_tokenizer::{self as tok, Error};

/// The argument a helper is started with (the `waste` binary's hidden
/// subcommand; `waste-render-template` ignores its arguments).
pub const SUBCOMMAND: &str = "__render-template";
/// The child's address space (Linux's `RLIMIT_AS`): a real template
/// renders within 16 MiB of it, binary and libraries included (measured
/// with `prlimit --as`). One child runs at a time, so this is all the
/// memory rendering can take beside the process's own.
pub const CHILD_MEMORY: u64 = 256 << 20;
/// The child's CPU time, in seconds (`RLIMIT_CPU`; a real template takes
/// milliseconds, the fuel's 20 M instructions about a second).
pub const CHILD_CPU_SECONDS: u64 = 20;

/// Largest request the child reads: the template (the engine reads at
/// most `MAX_TEMPLATE_BYTES`) and the roles, JSON-quoted.
const MAX_REQUEST: u64 = 64 << 20;
/// Most of the child's error message the parent keeps.
const MAX_MESSAGE: usize = 4096;

static HELPER: OnceLock<PathBuf> = OnceLock::new();

/// Render every chat template of this process through the helper program
/// at `helper` ([`render_with`]), from now on. Once per process, like the
/// tokenizer's [`tok::set_jinja_renderer`]: false (and nothing changed)
/// when a helper or another renderer was already installed. The path is
/// not checked here: a helper that cannot be started makes each rendering
/// an error saying so (never a rendering in this process).
pub fn install(helper: PathBuf) -> bool {
    // the hook first: a helper is recorded only when it is the renderer in
    // use (a rendering between the two — install runs at start — is an error)
    HELPER.get().is_none() && tok::set_jinja_renderer(render_installed) && HELPER.set(helper).is_ok()
}

/// The helper [`install`] set, if any.
pub fn installed() -> Option<&'static Path> {
    HELPER.get().map(PathBuf::as_path)
}

fn render_installed(src: &str, roles: &[&str], open: bool) -> tok::Result<String> {
    match HELPER.get() {
        Some(h) => render_with(h, src, roles, open),
        // only while `install` runs, between the hook and the helper
        None => Err(Error::Template("chat_template.jinja: no renderer helper installed".into())),
    }
}

/// Render `src` for a conversation of `roles` (as
/// [`tok::render_jinja`]) in a child: `helper __render-template`, which
/// limits itself to [`CHILD_MEMORY`] and [`CHILD_CPU_SECONDS`] before it
/// reads the template ([`serve_child`]). One child at a time per process.
///
/// # Errors
/// [`Error::Template`] naming `chat_template.jinja`: the child's own
/// error (Jinja, fuel, nesting, the output bound), a child that passed
/// its limits or died, markup past [`tok::TEMPLATE_OUTPUT_BYTES`] or not
/// UTF-8, a helper that could not be started.
pub fn render_with(helper: &Path, src: &str, roles: &[&str], open: bool) -> tok::Result<String> {
    // one child at a time (a rendering takes ≈ 2 ms): a server's concurrent
    // requests on a hostile template hold one child's memory, not hundreds
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let fail = |m: String| Error::Template(format!("chat_template.jinja: {m}"));
    let mut cmd = Command::new(helper);
    cmd.arg(SUBCOMMAND).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
    // no pre_exec: the child limits itself before it reads the template, so
    // std can spawn without fork's copy of this process's page tables
    // (measured: 54 ms per spawn beside 2 GB of resident memory, 139 ms
    // beside 6 GB, against 3.5 ms without)
    let mut child = cmd.spawn().map_err(|e| fail(format!("starting {} to render it: {e}", helper.display())))?;
    let req = serde_json::json!({"template": src, "roles": roles, "open": open}).to_string();
    // the child reads the whole request before it writes: no pipe deadlock;
    // a child that died early makes this write fail, and its status says why
    let wrote = child.stdin.take().map(|mut w| w.write_all(req.as_bytes()));
    let mut out = Vec::new();
    let read = child.stdout.take().map(|r| r.take(tok::TEMPLATE_OUTPUT_BYTES as u64 + 1).read_to_end(&mut out));
    if out.len() > tok::TEMPLATE_OUTPUT_BYTES {
        // more than the bound (the child's own renderer stops at it): stop
        // it before waiting, it may be blocked on the pipe
        let _ = child.kill();
    }
    let mut err = Vec::new();
    if let Some(mut r) = child.stderr.take() {
        let _ = (&mut r).take(MAX_MESSAGE as u64).read_to_end(&mut err);
        // drain the rest (a child blocked on a full stderr would never exit)
        let _ = std::io::copy(&mut r, &mut std::io::sink());
    }
    let err = String::from_utf8_lossy(&err);
    let status = child.wait().map_err(|e| fail(format!("waiting for its process: {e}")))?;
    if status.success() && !matches!(wrote, Some(Err(_))) && matches!(read, Some(Ok(_))) {
        if out.len() > tok::TEMPLATE_OUTPUT_BYTES {
            return Err(fail(format!("renders more than {} bytes of markup", tok::TEMPLATE_OUTPUT_BYTES)));
        }
        return String::from_utf8(out).map_err(|_| fail("rendered invalid UTF-8".into()));
    }
    if status.code() == Some(2) && !err.trim().is_empty() {
        // the child's own error (a Jinja error, fuel, nesting, output bound)
        return Err(Error::Template(err.trim_end().to_string()));
    }
    Err(fail(format!(
        "rendering it exceeded the renderer's limits ({} MiB of memory, {CHILD_CPU_SECONDS} s of CPU) or failed ({status})",
        CHILD_MEMORY >> 20
    )))
}

/// Limit this process (the child) before it reads a template.
#[cfg(unix)]
fn limit_self() {
    let set = |what, n: u64| {
        let l = libc::rlimit { rlim_cur: n as libc::rlim_t, rlim_max: n as libc::rlim_t };
        // SAFETY: a valid rlimit struct; failure (a platform that does not
        // enforce one of them) leaves that limit as it was.
        unsafe { libc::setrlimit(what, &l) };
    };
    set(libc::RLIMIT_AS, CHILD_MEMORY);
    set(libc::RLIMIT_CPU, CHILD_CPU_SECONDS);
}

/// The helper's whole work, as its `main`: limit this process
/// ([`CHILD_MEMORY`], [`CHILD_CPU_SECONDS`]; it stays limited, so call
/// this only in a process of its own), read one request from `input`,
/// render it here ([`tok::render_jinja`]) and write the markup to `out`
/// (exit 0) or the error to `err` (exit 2); a malformed request or a
/// failed write is exit 1.
pub fn serve_child(input: impl Read, mut out: impl Write, mut err: impl Write) -> ExitCode {
    #[cfg(unix)]
    limit_self();
    let mut req = Vec::new();
    if input.take(MAX_REQUEST).read_to_end(&mut req).is_err() {
        return ExitCode::from(1);
    }
    let parsed: Option<(String, Vec<String>, bool)> =
        serde_json::from_slice::<serde_json::Value>(&req).ok().and_then(|v| {
            let roles =
                v["roles"].as_array()?.iter().map(|r| r.as_str().map(str::to_string)).collect::<Option<Vec<_>>>()?;
            Some((v["template"].as_str()?.to_string(), roles, v["open"].as_bool()?))
        });
    let Some((src, roles, open)) = parsed else {
        let _ = writeln!(err, "malformed render request");
        return ExitCode::from(1);
    };
    drop(req);
    let roles: Vec<&str> = roles.iter().map(String::as_str).collect();
    match tok::render_jinja(&src, &roles, open) {
        Ok(s) => {
            if out.write_all(s.as_bytes()).and_then(|_| out.flush()).is_err() {
                return ExitCode::from(1);
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            let m = match e {
                Error::Template(m) => m,
                e => e.to_string(),
            };
            // short enough for the pipe's buffer: the parent reads stderr
            // after stdout, so a longer message could block this process
            let end = (0..=m.len().min(2048)).rev().find(|&i| m.is_char_boundary(i)).unwrap_or(0);
            let _ = writeln!(err, "{}", &m[..end]).and_then(|_| err.flush());
            ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_helper_that_cannot_start_is_an_error_naming_it() {
        let e = render_with(Path::new("/nonexistent/helper"), "{{ 1 }}", &["user"], true).unwrap_err();
        let m = e.to_string();
        assert!(m.contains("chat_template.jinja") && m.contains("/nonexistent/helper"), "{m}");
    }
}
