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
/// reads the template ([`serve_child`]); a child still running after
/// [`CHILD_WALL_SECONDS`] is killed. One child at a time per process.
///
/// # Errors
/// [`Error::Template`] naming `chat_template.jinja`: the child's own
/// error (Jinja, fuel, nesting, the output bound), a child that passed
/// its limits, ran too long or died, markup past
/// [`tok::TEMPLATE_OUTPUT_BYTES`] or not UTF-8, a helper that could not be
/// started; a template over [`tok::MAX_TEMPLATE_BYTES`] (what the engine
/// reads of a file) or roles making the request over what the child reads
/// (64 MiB), refused before a child starts.
pub fn render_with(helper: &Path, src: &str, roles: &[&str], open: bool) -> tok::Result<String> {
    render_within(helper, src, roles, open, std::time::Duration::from_secs(CHILD_WALL_SECONDS))
}

/// The child's wall-clock time, in seconds: past its CPU limit, a child
/// that waits on nothing (a helper that is stopped, or is not one and
/// never exits) is killed instead of holding every later rendering.
pub const CHILD_WALL_SECONDS: u64 = 2 * CHILD_CPU_SECONDS;

/// The request, in a file of its own (created new, removed on drop): the
/// child reads it as its stdin, so the parent writes no pipe — a child that
/// exits without reading cannot raise `SIGPIPE` in a host that does not
/// ignore it (a C program), nor block the parent on a full pipe.
struct RequestFile(PathBuf);

impl RequestFile {
    fn new(req: &[u8]) -> std::io::Result<(RequestFile, std::fs::File)> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("waste-render-{}-{n}.json", std::process::id()));
        let mut f = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(&path)?;
        let guard = RequestFile(path);
        f.write_all(req)?;
        std::io::Seek::rewind(&mut f)?;
        Ok((guard, f))
    }
}

impl Drop for RequestFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Kills a child still running at a deadline — with every process in its
/// group (what it started) — never after it is reaped:
/// the kill happens under the lock `finish` takes before the caller waits
/// for the child, so the pid is still the child's (at worst a zombie).
struct Watchdog {
    state: std::sync::Arc<(std::sync::Mutex<(bool, bool)>, std::sync::Condvar)>,
    /// Joined by `finish`, so no watchdog outlives its rendering (a fuzzer's
    /// leak check saw a detached one's thread-local registration).
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watchdog {
    fn start(pid: u32, wall: std::time::Duration) -> Watchdog {
        let state = std::sync::Arc::new((std::sync::Mutex::new((false, false)), std::sync::Condvar::new()));
        let s = state.clone();
        let watch = move || {
            let (m, cv) = &*s;
            let g = m.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let (mut g, _) = cv.wait_timeout_while(g, wall, |(done, _)| !*done).unwrap_or_else(|e| e.into_inner());
            if !g.0 {
                #[cfg(unix)]
                // SAFETY: kill(2) on our child's process group (its pid,
                // `process_group(0)`), the child not yet reaped (see above),
                // so the group is still its own.
                unsafe {
                    libc::kill(-(pid as libc::pid_t), libc::SIGKILL)
                };
                g.1 = true;
            }
        };
        // no thread, no deadline: the CPU limit still bounds a busy child
        let thread = std::thread::Builder::new().name("waste-render-watchdog".into()).spawn(watch).ok();
        Watchdog { state, thread }
    }

    /// Stop watching (before waiting for the child) and wait for the
    /// watchdog to end; whether it killed the child.
    fn finish(mut self) -> bool {
        let killed = {
            let (m, cv) = &*self.state;
            let mut g = m.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            g.0 = true;
            cv.notify_all();
            g.1
        };
        // the lock released: the watchdog wakes, sees `done` and returns
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        killed
    }
}

fn render_within(
    helper: &Path,
    src: &str,
    roles: &[&str],
    open: bool,
    wall: std::time::Duration,
) -> tok::Result<String> {
    // one child at a time (a rendering takes ≈ 2 ms): a server's concurrent
    // requests on a hostile template hold one child's memory, not hundreds
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let fail = |m: String| Error::Template(format!("chat_template.jinja: {m}"));
    // the engine reads at most MAX_TEMPLATE_BYTES of template; an embedder
    // may pass anything — refuse before copying it into a request file
    if src.len() as u64 > tok::MAX_TEMPLATE_BYTES {
        return Err(fail(format!(
            "{} bytes, more than the {} a template may have",
            src.len(),
            tok::MAX_TEMPLATE_BYTES
        )));
    }
    // many or long roles: the child would read a truncated request. Their
    // raw bytes (+ quotes and a comma each) are a lower bound of the JSON,
    // checked before serializing anything; the JSON itself after
    let too_long = |n: u64| {
        fail(format!(
            "its request with {} roles is {n} bytes or more, more than the {MAX_REQUEST} the renderer reads",
            roles.len()
        ))
    };
    let raw = roles.iter().fold(src.len() as u64, |n, r| n.saturating_add(r.len() as u64 + 3));
    if raw > MAX_REQUEST {
        return Err(too_long(raw));
    }
    let req = serde_json::json!({"template": src, "roles": roles, "open": open}).to_string();
    if req.len() as u64 > MAX_REQUEST {
        return Err(too_long(req.len() as u64));
    }
    let (_req_file, input) =
        RequestFile::new(req.as_bytes()).map_err(|e| fail(format!("writing its request to a file: {e}")))?;
    drop(req);
    let mut cmd = Command::new(helper);
    cmd.arg(SUBCOMMAND).stdin(Stdio::from(input)).stdout(Stdio::piped()).stderr(Stdio::piped());
    // no pre_exec: the child limits itself before it reads the template, so
    // std can spawn without fork's copy of this process's page tables
    // (measured: 54 ms per spawn beside 2 GB of resident memory, 139 ms
    // beside 6 GB, against 3.5 ms without)
    // a group of its own, killed whole at the deadline: a helper that left
    // a process holding its stdout (a background job) cannot block the
    // read below past it (posix_spawn sets the group: still no fork)
    #[cfg(unix)]
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let mut child = cmd.spawn().map_err(|e| fail(format!("starting {} to render it: {e}", helper.display())))?;
    let watchdog = Watchdog::start(child.id(), wall);
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
    let timed_out = watchdog.finish();
    let status = child.wait().map_err(|e| fail(format!("waiting for its process: {e}")))?;
    if timed_out {
        return Err(fail(format!("rendering it took more than {} s", wall.as_secs_f64())));
    }
    if status.success() && matches!(read, Some(Ok(_))) {
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

    /// A directory removed on drop.
    struct Dir(PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// A helper script in a fresh directory (removed with the guard).
    #[cfg(unix)]
    fn script(tag: &str, body: &str) -> (Dir, PathBuf) {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("waste-sandbox-test-{}-{tag}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("helper.sh");
        std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        (Dir(dir), p)
    }

    #[test]
    fn an_oversized_template_or_request_is_refused_before_a_child_starts() {
        // a helper that does not exist: reaching the spawn would say so
        let none = Path::new("/nonexistent/waste-render-helper");
        let at = "x".repeat(tok::MAX_TEMPLATE_BYTES as usize);
        let e = render_with(none, &at, &["user"], true).unwrap_err().to_string();
        assert!(e.contains("starting"), "the largest template a file may have is rendered: {e}");
        let over = "x".repeat(tok::MAX_TEMPLATE_BYTES as usize + 1);
        let e = render_with(none, &over, &["user"], true).unwrap_err().to_string();
        assert!(e.contains(&format!("{} bytes, more than", over.len())), "{e}");
        // roles that make the request larger than the child reads
        let role = "r".repeat(1 << 20);
        let roles: Vec<&str> = vec![&role; (MAX_REQUEST >> 20) as usize + 1];
        let e = render_with(none, "x", &roles, true).unwrap_err().to_string();
        assert!(e.contains("more than the 67108864") && e.contains(&format!("{} roles", roles.len())), "{e}");
        // or short ones whose JSON escaping (6 bytes a control character)
        // takes the request past it
        let ctl = "\u{1}".repeat(1 << 20);
        let roles: Vec<&str> = vec![&ctl; 11];
        let e = render_with(none, "x", &roles, true).unwrap_err().to_string();
        assert!(e.contains("more than the 67108864") && e.contains("11 roles is 69206"), "{e}");
    }

    /// Render with a helper script and a 0.3 s deadline: it must end in
    /// the deadline's error, not wait for what the script left running.
    #[cfg(unix)]
    fn ends_at_the_deadline(tag: &str, body: &str) {
        let (_g, helper) = script(tag, body);
        let t0 = std::time::Instant::now();
        let e = render_within(&helper, "x", &["user"], true, std::time::Duration::from_millis(300)).unwrap_err();
        assert!(e.to_string().contains("took more than 0.3 s"), "{tag}: {e}");
        assert!(t0.elapsed() < std::time::Duration::from_secs(100), "{tag}: killed, not waited for");
    }

    #[cfg(unix)]
    #[test]
    fn a_child_past_the_wall_clock_is_killed_and_the_next_rendering_runs() {
        // waits on nothing, using no CPU: only the wall clock ends it
        ends_at_the_deadline("hang", "exec sleep 1000");
        let (_g2, ok) = script("ok", "cat > /dev/null; printf ok");
        assert_eq!(render_within(&ok, "x", &[], false, std::time::Duration::from_secs(60)).unwrap(), "ok");
    }

    #[cfg(unix)]
    #[test]
    fn a_process_left_holding_the_childs_output_is_killed_at_the_deadline() {
        // the helper exits at once, its background job keeps stdout open:
        // reading the markup to its end waited for the job (1000 s)
        ends_at_the_deadline("bg", "cat > /dev/null; sleep 1000 & printf ok");
    }

    #[cfg(unix)]
    #[test]
    fn the_request_reaches_the_child_whole() {
        // the helper echoes its stdin: the request, read from the file
        let (_g, echo) = script("echo", "cat");
        let src = "y".repeat(300_000);
        let got = render_within(&echo, &src, &["user"], true, std::time::Duration::from_secs(60)).unwrap();
        let v: serde_json::Value = serde_json::from_str(&got).unwrap();
        assert_eq!(v["template"].as_str().unwrap(), src);
        assert_eq!(v["roles"], serde_json::json!(["user"]));
    }

    #[test]
    fn a_request_file_is_new_and_removed_with_its_guard() {
        let (g, mut f) = RequestFile::new(b"{}").unwrap();
        let path = g.0.clone();
        let mut back = String::new();
        f.read_to_string(&mut back).unwrap();
        assert_eq!(back, "{}", "rewound for the child");
        drop(g);
        assert!(!path.exists());
    }

    #[test]
    fn a_helper_that_cannot_start_is_an_error_naming_it() {
        let e = render_with(Path::new("/nonexistent/helper"), "{{ 1 }}", &["user"], true).unwrap_err();
        let m = e.to_string();
        assert!(m.contains("chat_template.jinja") && m.contains("/nonexistent/helper"), "{m}");
    }
}
