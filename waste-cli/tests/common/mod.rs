//! Shared by the CLI and server tests: the anchor container, running the
//! `waste` binary, and a `waste serve` child that is killed when dropped.
#![allow(dead_code)] // each test binary uses its own part

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// The C engine's anchor container (testdata/).
pub fn anchor() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/anchor-tiny/kimi-linear-tiny.waste");
    assert!(p.join("manifest.json").exists(), "test data missing at {} (testdata/ in the repository)", p.display());
    p
}

/// The oracle fixtures (Hugging Face-style sources and reference outputs).
pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tools/oracle/fixtures")
}

/// A writable copy of the anchor in a temp dir named for this process and `tag`.
pub fn copy_anchor(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("waste-hard-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    for e in std::fs::read_dir(anchor()).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), d.join(e.file_name())).unwrap();
    }
    d
}

/// Flip a payload byte in every record of layer 2 of an anchor copy: each
/// fails its CRC (read with `--verify`), naming the expert and layer.
pub fn damage_layer2(d: &Path) {
    let bank = d.join("experts-L2.bin");
    let mut b = std::fs::read(&bank).unwrap();
    for e in 0..8 {
        b[e * 12288 + 500] ^= 0x10;
    }
    std::fs::write(&bank, b).unwrap();
}

/// Run `waste args` with `stdin`: (exit code, stdout, stderr).
pub fn waste(args: &[&str], stdin: &str) -> (i32, String, String) {
    waste_in(args, stdin, |c| c)
}

/// [`waste`] without stdin, with `WASTE_NUMERIC` set to `numeric` (unset
/// when `None`, whatever this process has).
#[allow(dead_code)]
pub fn waste_numeric(args: &[&str], numeric: Option<&str>) -> (i32, String, String) {
    waste_in(args, "", |c| match numeric {
        Some(n) => c.env("WASTE_NUMERIC", n),
        None => c.env_remove("WASTE_NUMERIC"),
    })
}

/// [`waste`] with `env` applied to the command.
pub fn waste_in(args: &[&str], stdin: &str, env: impl FnOnce(&mut Command) -> &mut Command) -> (i32, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_waste"));
    env(&mut cmd);
    let mut c = cmd.args(args).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    c.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
    let o = c.wait_with_output().unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into(),
        String::from_utf8_lossy(&o.stderr).into(),
    )
}

/// A running `waste serve` (killed on drop).
pub struct Server {
    pub child: Child,
    /// `host:port` it listens on.
    pub addr: String,
    pub port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `waste serve MODEL --port 0 --ctx 4096 EXTRA…` (`--ctx` in EXTRA
/// replaces the 4096), once it printed its address.
pub fn start_with(model: &Path, extra: &[&str]) -> Server {
    let ctx: &[&str] = if extra.contains(&"--ctx") { &[] } else { &["--ctx", "4096"] };
    let mut child = Command::new(env!("CARGO_BIN_EXE_waste"))
        .args(["serve", model.to_str().unwrap(), "--port", "0"])
        .args(ctx)
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let addr = line.trim().rsplit("http://").next().unwrap().to_string();
    let port = addr.rsplit(':').next().unwrap().parse().unwrap();
    Server { child, addr, port }
}

/// [`start_with`] on the anchor.
pub fn start(extra: &[&str]) -> Server {
    start_with(&anchor(), extra)
}

/// POST a chat completion (non-streaming) over raw HTTP; (status, JSON body).
pub fn post_chat(addr: &str, v: &serde_json::Value) -> (u16, serde_json::Value) {
    use std::io::Read;
    let body = v.to_string();
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(60))).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = out.split_once("\r\n\r\n").map(|x| x.1).unwrap_or("");
    (status, serde_json::from_str(body).unwrap_or(serde_json::Value::Null))
}

/// The K2 family's markers (Kimi-Linear's chat format) in place of the
/// anchor's K3 specials, `<|im_end|>` at the config's end-of-sequence id
/// (307): the anchor's weights with Kimi-Linear's chat format. The same
/// names and ids as `xtask`'s copy for the openai client test.
pub const K2_SPECIALS: [(u32, &str); 11] = [
    (305, "[BOS]"),
    (306, "<|im_user|>"),
    (307, "<|im_end|>"),
    (308, "<|im_assistant|>"),
    (309, "<|im_system|>"),
    (310, "<|im_middle|>"),
    (311, "<|tool_calls_section_begin|>"),
    (312, "<|tool_calls_section_end|>"),
    (313, "<|tool_call_begin|>"),
    (314, "<|tool_call_argument_begin|>"),
    (315, "<|tool_call_end|>"),
];

/// A copy of the anchor speaking the K2 family's chat format ([`K2_SPECIALS`]).
pub fn copy_anchor_k2(tag: &str) -> PathBuf {
    let d = copy_anchor(tag);
    let sp: Vec<serde_json::Value> =
        K2_SPECIALS.iter().map(|(id, t)| serde_json::json!({"id": id, "text": t})).collect();
    std::fs::write(d.join("specials.json"), serde_json::to_string_pretty(&sp).unwrap()).unwrap();
    d
}
