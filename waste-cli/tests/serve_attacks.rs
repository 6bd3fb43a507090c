//! `waste serve` under hostile and careless clients: idle and slow sockets
//! are closed within their timeouts, a huge declared body is refused from
//! its header, the job queue is bounded, a key-less server answers only to
//! its own names and same-site pages, and a load of idle sockets, slow
//! headers and 32 concurrent streams leaves `/health` answering and every
//! stream exactly as when run alone, and a body that would parse into
//! hundreds of megabytes is refused before it is parsed, and a container
//! whose chat template exhausts memory fails its requests, not the server.

mod common;

#[cfg(target_os = "linux")]
use common::anchor;
use common::{copy_anchor, post_chat, start, start_with};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpStream;
#[cfg(target_os = "linux")]
use std::process::Command;
use std::time::Duration;

/// Send raw bytes, read until the server closes (or `wait` passes): the
/// response text, and whether the server closed the connection.
fn raw(addr: &str, bytes: &[u8], wait: Duration) -> (String, bool) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(wait)).unwrap();
    s.write_all(bytes).unwrap();
    let mut out = Vec::new();
    let closed = match s.read_to_end(&mut out) {
        Ok(_) => true,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock && e.kind() != std::io::ErrorKind::TimedOut,
    };
    (String::from_utf8_lossy(&out).into_owned(), closed)
}

fn status(resp: &str) -> u16 {
    resp.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0)
}

fn request(addr: &str, host: &str, extra: &str, body: &str) -> String {
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Length: {}\r\n{extra}\r\n{body}",
        body.len()
    );
    raw(addr, req.as_bytes(), Duration::from_secs(30)).0
}

/// POST a JSON body to /v1/completions; the raw response.
fn post_completion(addr: &str, body: &str) -> String {
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    raw(addr, req.as_bytes(), Duration::from_secs(30)).0
}

/// `n` clients posting the same JSON body at once (threads of `sc`); join
/// the handles for their responses.
fn post_json_at_once<'s>(
    sc: &'s std::thread::Scope<'s, '_>,
    addr: &str,
    body: &str,
    n: usize,
) -> Vec<std::thread::ScopedJoinHandle<'s, String>> {
    (0..n)
        .map(|_| {
            let (addr, body) = (addr.to_string(), body.to_string());
            sc.spawn(move || request(&addr, &addr, "Content-Type: application/json\r\n", &body))
        })
        .collect()
}

/// `n` clients post `body` at once; meanwhile `/health` must answer within
/// 1 s, five times. Their responses.
fn posted_while_health_answers(addr: &str, body: &str, n: usize) -> Vec<String> {
    std::thread::scope(|sc| {
        let hs = post_json_at_once(sc, addr, body, n);
        std::thread::sleep(Duration::from_millis(200));
        for _ in 0..5 {
            assert!(health_ok(addr, Duration::from_secs(1)), "/health stalled behind request work");
            std::thread::sleep(Duration::from_millis(100));
        }
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn health_ok(addr: &str, within: Duration) -> bool {
    let req = format!("GET /health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    let (r, _) = raw(addr, req.as_bytes(), within);
    status(&r) == 200
}

#[test]
fn idle_and_slow_connections_are_closed_within_their_timeouts() {
    let s = start(&["--idle-timeout", "1", "--header-timeout", "1", "--body-timeout", "1"]);
    let wait = Duration::from_secs(10);
    // an idle socket
    let (_, closed) = raw(&s.addr, b"", wait);
    assert!(closed, "an idle connection stayed open");
    // half-sent headers
    let (_, closed) =
        raw(&s.addr, format!("POST /v1/chat/completions HTTP/1.1\r\nHost: {}\r\n", s.addr).as_bytes(), wait);
    assert!(closed, "a half-sent header stayed open");
    // a half-sent body: 408 from the body timeout
    let (r, closed) = raw(
        &s.addr,
        format!("POST /v1/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"prom", s.addr)
            .as_bytes(),
        wait,
    );
    assert!(closed && status(&r) == 408, "{r}");
    // a keep-alive connection idle after its request
    let mut c = TcpStream::connect(&s.addr).unwrap();
    c.set_read_timeout(Some(wait)).unwrap();
    write!(c, "GET /health HTTP/1.1\r\nHost: {}\r\n\r\n", s.addr).unwrap();
    let mut out = Vec::new();
    let closed = c.read_to_end(&mut out).is_ok();
    assert!(closed && status(&String::from_utf8_lossy(&out)) == 200, "an idle keep-alive connection stayed open");
}

#[test]
fn a_huge_declared_body_is_refused_from_its_header() {
    let s = start(&[]);
    // no body follows: the answer can only come from the header
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: 1073741824\r\n\r\n",
        s.addr
    );
    let (r, _) = raw(&s.addr, req.as_bytes(), Duration::from_secs(10));
    assert_eq!(status(&r), 413, "{r}");
    assert!(r.contains("body_too_large"), "{r}");
}

#[test]
fn past_the_queue_bound_requests_get_503_with_retry_after() {
    let s = start(&["--max-queue", "1"]);
    let body =
        json!({"messages": [{"role": "user", "content": "count"}], "max_tokens": 3000, "temperature": 0}).to_string();
    let answers: Vec<String> = std::thread::scope(|sc| {
        let hs = post_json_at_once(sc, &s.addr, &body, 6);
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let refused: Vec<&String> = answers.iter().filter(|r| status(r) == 503).collect();
    let served = answers.iter().filter(|r| status(r) == 200).count();
    assert!(!refused.is_empty() && served >= 1, "{:?}", answers.iter().map(|r| status(r)).collect::<Vec<_>>());
    for r in refused {
        assert!(r.to_ascii_lowercase().contains("retry-after: "), "{r}");
        assert!(r.contains("queue_full"), "{r}");
    }
    assert!(health_ok(&s.addr, Duration::from_secs(5)));
}

#[test]
fn a_keyless_server_answers_only_its_own_names_and_same_site_pages() {
    let s = start(&["--allow-host", "my.box", "--allow-origin", "https://app.example"]);
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).to_string();
    let json_ct = "Content-Type: application/json\r\n";
    let port = s.port;
    // loopback names, the bound address and --allow-host names work
    for host in [s.addr.clone(), format!("localhost:{port}"), format!("[::1]:{port}"), "my.box".into()] {
        let r = request(&s.addr, &host, json_ct, &body);
        assert_eq!(status(&r), 200, "{host}: {r}");
    }
    // DNS rebinding: a foreign name pointing at us
    let r = request(&s.addr, &format!("attacker.example:{port}"), json_ct, &body);
    assert_eq!(status(&r), 403, "{r}");
    assert!(r.contains("host_not_allowed"));
    // a cross-site page, unless named
    let r = request(&s.addr, &s.addr, &format!("{json_ct}Origin: https://evil.example\r\n"), &body);
    assert_eq!(status(&r), 403, "{r}");
    assert!(r.contains("origin_not_allowed"));
    let r = request(&s.addr, &s.addr, &format!("{json_ct}Origin: https://app.example\r\n"), &body);
    assert_eq!(status(&r), 200, "{r}");
    assert!(r.to_ascii_lowercase().contains("access-control-allow-origin: https://app.example"), "{r}");
    let r = request(&s.addr, &s.addr, &format!("{json_ct}Origin: http://localhost:{port}\r\n"), &body);
    assert_eq!(status(&r), 200, "same-site: {r}");
    // a form a web page can post without asking
    let r = request(&s.addr, &s.addr, "Content-Type: text/plain\r\n", &body);
    assert_eq!(status(&r), 415, "{r}");
    let r = request(&s.addr, &s.addr, "", &body);
    assert_eq!(status(&r), 415, "{r}");
    // with an API key the key is the guard: any Host, as before
    let k = start(&["--api-key", "sekret"]);
    let r = request(
        &k.addr,
        "attacker.example",
        "Authorization: Bearer sekret\r\nContent-Type: application/json\r\n",
        &body,
    );
    assert_eq!(status(&r), 200, "{r}");
}

#[cfg(target_os = "linux")]
fn peak_rss_bytes(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0)
        * 1024
}

/// Margin over the budget for the server's own memory: the tokio runtime,
/// the binary, one task and buffer per connection (282 here), the SSE
/// channels of 32 streams.
#[cfg(target_os = "linux")]
const SERVER_MARGIN_BYTES: u64 = 64 << 20;

#[test]
#[cfg(target_os = "linux")]
fn under_a_load_of_idle_slow_and_streaming_clients_health_answers_and_streams_are_exact() {
    let plan = Command::new(env!("CARGO_BIN_EXE_waste"))
        .args(["plan", anchor().to_str().unwrap(), "--ctx", "4096", "--json"])
        .output()
        .unwrap();
    let plan: Value = serde_json::from_slice(&plan.stdout).unwrap();
    let budget = plan["floor_bytes"].as_u64().unwrap() + (8 << 20);
    let s = start(&["--budget", &budget.to_string(), "--max-connections", "400", "--max-queue", "64"]);
    let prompts: Vec<String> =
        (0..32).map(|i| format!("client {i} asks about {}", ["rain", "maps", "json", "tea"][i % 4])).collect();
    let body = |p: &str, stream: bool| {
        json!({"messages": [{"role": "user", "content": p}], "max_tokens": 10, "temperature": 0, "stream": stream, "reasoning_effort": "none"})
            .to_string()
    };
    let ct = "Content-Type: application/json\r\n";
    // each prompt alone first
    let alone: Vec<String> = prompts
        .iter()
        .map(|p| {
            let r = request(&s.addr, &s.addr, ct, &body(p, false));
            let v: Value = serde_json::from_str(r.split_once("\r\n\r\n").unwrap().1).unwrap();
            v["choices"][0]["message"]["content"].as_str().unwrap().to_string()
        })
        .collect();
    // the attack: 200 idle sockets and 50 clients stuck in their headers
    let mut held = Vec::new();
    for i in 0..250 {
        let mut c = TcpStream::connect(&s.addr).unwrap();
        if i >= 200 {
            write!(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: {}\r\nContent-Le", s.addr).unwrap();
        }
        held.push(c);
    }
    assert!(health_ok(&s.addr, Duration::from_secs(1)), "/health under attack");
    let got: Vec<String> = std::thread::scope(|sc| {
        let hs: Vec<_> = prompts
            .iter()
            .map(|p| {
                let (addr, b) = (s.addr.clone(), body(p, true));
                sc.spawn(move || {
                    let r = request(&addr, &addr, ct, &b);
                    assert_eq!(status(&r), 200, "{r}");
                    let mut text = String::new();
                    for line in r.lines() {
                        if let Some(d) = line.strip_prefix("data: ") {
                            if let Ok(v) = serde_json::from_str::<Value>(d) {
                                text.push_str(v["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
                            }
                        }
                    }
                    text
                })
            })
            .collect();
        // /health stays responsive while the streams run
        for _ in 0..5 {
            assert!(health_ok(&s.addr, Duration::from_secs(1)), "/health during the streams");
            std::thread::sleep(Duration::from_millis(100));
        }
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(alone.iter().all(|a| !a.is_empty()));
    assert_eq!(got, alone, "a stream under load differs from the same request alone");
    let rss = peak_rss_bytes(s.child.id());
    assert!(rss > 0 && rss <= budget + SERVER_MARGIN_BYTES, "peak RSS {rss} over budget {budget} + margin");
    drop(held);
}

#[test]
fn heavy_request_work_does_not_stall_the_async_workers() {
    // two requests with 2,000 tools each and a forced call: rendering and
    // tokenizing them is CPU work for the blocking pool; on this model's
    // byte-level tokenizer the prompt (~199K tokens) exceeds the context, and
    // that cheap check comes before any grammar is compiled
    let s = start(&[]);
    let tools: Vec<Value> = (0..2000)
        .map(|i| {
            json!({"type": "function", "function": {"name": format!("tool_{i}"), "parameters": {"type": "object",
            "properties": {"x": {"type": "string"}}}}})
        })
        .collect();
    let body = json!({"messages": [{"role": "user", "content": "call one"}], "tools": tools, "tool_choice": "required",
        "max_tokens": 4, "reasoning_effort": "none"})
    .to_string();
    for r in posted_while_health_answers(&s.addr, &body, 2) {
        assert_eq!(status(&r), 400, "{r}");
        assert!(r.contains("context_length_exceeded"), "{r}");
    }
}

/// A 4 MiB body of nested empty arrays parses into ≈ 420 MB of JSON values
/// and took ≈ 0.7 s to parse on an async worker: now the body is scanned on
/// the blocking pool first and refused with 413 (more than the default 256
/// MiB of request memory) without being parsed, `/health` answers while
/// several arrive, and the memory is free again for an ordinary request.
#[test]
fn a_body_that_would_parse_into_hundreds_of_megabytes_is_refused_unparsed() {
    let s = start(&[]);
    let unit = "[[[]]],";
    let mut items = unit.repeat((4 << 20) / unit.len() - 4);
    items.pop();
    let body = format!("{{\"messages\":[{items}],\"max_tokens\":2}}");
    assert!(body.len() <= 4 << 20);
    for r in posted_while_health_answers(&s.addr, &body, 6) {
        assert_eq!(status(&r), 413, "{r}");
        assert!(r.contains("body_too_complex") && r.contains("request memory"), "{r}");
    }
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).to_string();
    let r = request(&s.addr, &s.addr, "Content-Type: application/json\r\n", &body);
    assert_eq!(status(&r), 200, "{r}");
}

/// A message longer than the context can hold whatever its tokens (more
/// bytes than ctx × the longest token) is refused before it is tokenized,
/// with OpenAI's `context_length_exceeded` code like a prompt of too many
/// tokens (it was tokenized first: a 4 MB body of one run of a character
/// is ~128 MB of merge work); /v1/completions the same.
#[test]
fn text_longer_than_the_context_is_context_length_exceeded() {
    // the anchor's longest token is 26 bytes: 4096 × 26 < 120 000
    let s = start(&[]);
    let long = "a".repeat(120_000);
    let body = json!({"messages": [{"role": "user", "content": long}], "max_tokens": 2}).to_string();
    let r = request(&s.addr, &s.addr, "Content-Type: application/json\r\n", &body);
    assert_eq!(status(&r), 400, "{r}");
    assert!(r.contains("context_length_exceeded") && r.contains("the text is 120000 bytes"), "{r}");
    let r = post_completion(&s.addr, &json!({"prompt": long, "max_tokens": 2}).to_string());
    assert_eq!(status(&r), 400, "{r}");
    assert!(r.contains("context_length_exceeded") && r.contains("\"param\":\"prompt\""), "{r}");
}

/// A container's `chat_template.jinja` that doubles a string 40 times
/// (minijinja's fuel does not bound it) ended the server on its first chat
/// request — a failed allocation aborts the process. Rendered in a limited
/// child process, the request gets an error naming the file and the server
/// goes on: `/health` answers and a completion (no template) is served.
#[test]
fn a_chat_template_that_exhausts_memory_fails_the_request_not_the_server() {
    let d = copy_anchor("serve-template");
    std::fs::write(
        d.join("chat_template.jinja"),
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    )
    .unwrap();
    let s = start_with(&d, &[]);
    let (st, v) = post_chat(&s.addr, &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}));
    assert_eq!(st, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("chat_template.jinja"), "{v}");
    assert!(health_ok(&s.addr, Duration::from_secs(10)));
    let r = post_completion(&s.addr, &json!({"prompt": "hi", "max_tokens": 2}).to_string());
    assert_eq!(status(&r), 200, "{r}");
    drop(s);
    std::fs::remove_dir_all(&d).ok();
}
