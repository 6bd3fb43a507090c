//! `waste serve --parallel N`: requests decoded together each get exactly
//! the answer they get alone — mixed prompts, lengths, temperatures (seeded),
//! stop strings, a JSON schema, a completion — while `/health` answers.

mod common;

use common::{anchor, start_with};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// One request over raw HTTP; (status, body with SSE data lines joined).
fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, text.split_once("\r\n\r\n").map(|x| x.1.to_string()).unwrap_or_default())
}

/// The text and finish reason of a streamed answer (chat or completion).
fn streamed(body: &str) -> (String, String) {
    let (mut text, mut finish) = (String::new(), String::new());
    for line in body.lines() {
        let Some(d) = line.strip_prefix("data: ") else { continue };
        if d == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(d).unwrap();
        let c = &v["choices"][0];
        for t in [&c["delta"]["content"], &c["text"]] {
            text.push_str(t.as_str().unwrap_or(""));
        }
        if let Some(f) = c["finish_reason"].as_str() {
            finish = f.to_string();
        }
    }
    (text, finish)
}

/// Request `i`: (path, body), streamed.
fn request(i: usize) -> (&'static str, Value) {
    let topics = ["Paris", "the weather", "json", "cities", "rivers", "a story", "numbers", "birds"];
    let mut v = json!({
        "messages": [{"role": "user", "content": format!("request {i}: tell me about {}", topics[i % 8])}],
        "max_tokens": 6 + 3 * (i % 5), "stream": true, "reasoning_effort": "none",
        "temperature": if i.is_multiple_of(2) { 0.0 } else { 0.8 }, "seed": 1000 + i,
    });
    match i % 4 {
        1 => v["stop"] = json!(["e", "\n"]),
        2 => {
            v["response_format"] = json!({"type": "json_schema", "json_schema": {"name": "x", "schema":
                {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}});
        }
        _ => {}
    }
    if i == 7 {
        return (
            "/v1/completions",
            json!({"prompt": "The river", "max_tokens": 9, "stream": true, "temperature": 0.5, "seed": 7}),
        );
    }
    ("/v1/chat/completions", v)
}

#[test]
fn requests_decoded_together_equal_each_alone() {
    let n = 8;
    let alone = start_with(&anchor(), &["--parallel", "1", "--budget", "64M"]);
    let want: Vec<(String, String)> = (0..n)
        .map(|i| {
            let (path, body) = request(i);
            let (st, b) = http(&alone.addr, "POST", path, &body.to_string());
            assert_eq!(st, 200, "{b}");
            streamed(&b)
        })
        .collect();
    assert!(want.iter().all(|(t, f)| !t.is_empty() && !f.is_empty()), "{want:?}");
    assert!(want.iter().any(|w| w.1 == "length") && want.iter().any(|w| w.1 == "stop"), "{want:?}");
    let together = start_with(&anchor(), &["--parallel", "8", "--budget", "64M"]);
    for round in 0..2 {
        let (got, healthy) = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..n)
                .map(|i| {
                    let addr = together.addr.clone();
                    sc.spawn(move || {
                        let (path, body) = request(i);
                        let (st, b) = http(&addr, "POST", path, &body.to_string());
                        assert_eq!(st, 200, "{b}");
                        streamed(&b)
                    })
                })
                .collect();
            // the HTTP side answers while the engine decodes
            let h = http(&together.addr, "GET", "/health", "");
            (hs.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>(), h)
        });
        assert_eq!(healthy.0, 200, "{}", healthy.1);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "round {round}, request {i}: decoded together differs from alone");
        }
    }
}

/// More than the cache can pin at once: `plan` says so and fails; `serve`
/// reduces it, with a message.
#[test]
fn a_parallel_the_cache_cannot_take_is_refused_or_reduced() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_waste"))
        .args(["plan", anchor().to_str().unwrap(), "--parallel", "16", "--ctx", "128", "--budget", "22M", "--json"])
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["ok"], false, "{v}");
    assert!(v["note"].as_str().unwrap().contains("--parallel 16"), "{v}");
    let most = v["max_parallel"].as_u64().unwrap();
    assert!((1..16).contains(&most), "{v}");
    assert!(v["parallel_bytes"].as_u64().unwrap() > 0);
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_waste"))
        .args([
            "serve",
            anchor().to_str().unwrap(),
            "--port",
            "0",
            "--parallel",
            "16",
            "--ctx",
            "128",
            "--budget",
            "22M",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().unwrap()), &mut line).unwrap();
    assert!(line.contains("http://"), "{line}");
    let _ = child.kill();
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    let _ = child.wait();
    assert!(err.contains(&format!("--parallel 16 reduced to {most}")), "{err}");
    assert!(err.contains(&format!("up to {most} requests decoded together")), "{err}");
}

/// The prefill policy: a long prompt arriving while another request decodes
/// is evaluated in pieces between decode steps, so the decoding request
/// keeps streaming (its events keep arriving between the long request's
/// send and its first token: counted by order, not time); and a client that
/// disconnects mid-stream leaves the batch while the other goes on to the
/// same answer it gets alone.
#[test]
fn a_long_prompt_does_not_stall_a_decoding_request_and_a_disconnect_leaves_the_batch() {
    use std::io::BufRead;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let s = start_with(&anchor(), &["--parallel", "4", "--budget", "64M"]);
    let long: Vec<u32> = (0..1200).map(|i| 1 + (i * 7) % 250).collect();
    let a_body = json!({"prompt": [1, 2, 3, 4], "max_tokens": 400, "temperature": 0, "stream": true}).to_string();
    let b_body = json!({"prompt": long, "max_tokens": 2, "temperature": 0, "stream": true}).to_string();
    let c_body = json!({"prompt": [9, 8, 7], "max_tokens": 400, "temperature": 0, "stream": true}).to_string();
    let (_, alone) = http(&s.addr, "POST", "/v1/completions", &a_body);
    let want = streamed(&alone);
    let clock = AtomicUsize::new(0);
    let open = |body: &str| {
        let mut c = TcpStream::connect(&s.addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        write!(
            c,
            "POST /v1/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            s.addr,
            body.len()
        )
        .unwrap();
        c
    };
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let (a_ticks, got, (b_sent, b_first)) = std::thread::scope(|sc| {
        let a = sc.spawn(|| {
            let mut r = std::io::BufReader::new(open(&a_body));
            let (mut ticks, mut body, mut line) = (Vec::new(), String::new(), String::new());
            while r.read_line(&mut line).unwrap() > 0 {
                if line.starts_with("data: ") {
                    ticks.push(clock.fetch_add(1, Ordering::SeqCst));
                    if ticks.len() == 20 {
                        tx.send(()).unwrap();
                    }
                }
                body.push_str(&line);
                line.clear();
            }
            (ticks, body)
        });
        // a third client that leaves after a few tokens
        let c = sc.spawn(|| {
            let mut r = std::io::BufReader::new(open(&c_body));
            let (mut n, mut line) = (0, String::new());
            while n < 5 && r.read_line(&mut line).unwrap() > 0 {
                n += line.starts_with("data: ") as usize;
                line.clear();
            }
            r.get_ref().shutdown(std::net::Shutdown::Both).unwrap();
        });
        rx.recv().unwrap();
        let sent = clock.load(Ordering::SeqCst);
        let mut r = std::io::BufReader::new(open(&b_body));
        let mut line = String::new();
        let mut first = None;
        while r.read_line(&mut line).unwrap() > 0 {
            if line.starts_with("data: ") && first.is_none() {
                first = Some(clock.fetch_add(1, Ordering::SeqCst));
            }
            line.clear();
        }
        c.join().unwrap();
        let (ticks, body) = a.join().unwrap();
        (ticks, body, (sent, first.expect("the long request answered")))
    });
    let between = a_ticks.iter().filter(|&&t| t > b_sent && t < b_first).count();
    assert!(between >= 3, "the decoding request got {between} tokens while a 1200-token prompt was evaluated");
    assert_eq!(streamed(&got), want, "the decoding request's answer changed in the batch");
    let h: Value = serde_json::from_str(&http(&s.addr, "GET", "/health", "").1).unwrap();
    assert_eq!(h["queued"], 0, "{h}");
}
