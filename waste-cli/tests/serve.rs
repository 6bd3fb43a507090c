//! `waste serve` over raw HTTP: error paths in OpenAI's shape, 16 concurrent
//! streaming clients each getting exactly their own answer, a disconnect
//! stopping its generation, prefix reuse giving the same tokens as a fresh
//! prefill.

mod common;

use common::{copy_anchor, damage_layer2, start, start_with};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// One HTTP/1.1 request; returns (status, body).
fn http(addr: &str, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\nContent-Type: application/json\r\n", body.len());
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).unwrap();
    let _ = s.write_all(body);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map(|x| x.1.to_string()).unwrap_or_default();
    let body = if text.to_ascii_lowercase().contains("transfer-encoding: chunked") { dechunk(&body) } else { body };
    (status, body)
}

fn dechunk(b: &str) -> String {
    let mut out = String::new();
    let mut rest = b;
    while let Some((size, after)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || after.len() < n {
            break;
        }
        out.push_str(&after[..n]);
        rest = after[n..].trim_start_matches("\r\n");
    }
    out
}

fn post(addr: &str, path: &str, v: &Value) -> (u16, Value) {
    let (st, body) = http(addr, "POST", path, &[], v.to_string().as_bytes());
    (st, serde_json::from_str(&body).unwrap_or(Value::Null))
}

fn assert_error(st: u16, v: &Value, want: u16, param: Option<&str>) {
    assert_eq!(st, want, "{v}");
    let e = &v["error"];
    assert!(
        e["message"].is_string() && e["type"].is_string() && e.get("param").is_some() && e.get("code").is_some(),
        "{v}"
    );
    if let Some(p) = param {
        assert_eq!(e["param"], p, "{v}");
    }
}

/// Content of an SSE chat stream.
fn sse_content(body: &str) -> (String, Value) {
    let mut text = String::new();
    let mut last = Value::Null;
    for line in body.lines() {
        if let Some(d) = line.strip_prefix("data: ") {
            if d == "[DONE]" {
                break;
            }
            let v: Value = serde_json::from_str(d).unwrap();
            if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
                text.push_str(c);
            }
            last = v;
        }
    }
    (text, last)
}

#[test]
fn error_paths_use_openai_error_shape() {
    let s = start(&["--body-limit", "2000"]);
    let a = &s.addr;
    let (st, body) = http(a, "POST", "/v1/chat/completions", &[], b"{not json");
    assert_error(st, &serde_json::from_str(&body).unwrap(), 400, Some("body"));
    let (st, v) = post(
        a,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}),
    );
    assert_error(st, &v, 400, Some("temperature"));
    let (st, v) = post(a, "/v1/chat/completions", &json!({"model": "x"}));
    assert_error(st, &v, 400, Some("messages"));
    // sampling controls the engine lacks: refused unless neutral (it used to
    // ignore them and sample as if they were absent)
    let hi = json!([{"role": "user", "content": "hi"}]);
    for (k, val) in
        [("frequency_penalty", json!(0.5)), ("presence_penalty", json!(-3)), ("logit_bias", json!({"5": 10}))]
    {
        let (st, v) = post(a, "/v1/chat/completions", &json!({"messages": hi, k: val, "max_tokens": 2}));
        assert_error(st, &v, 400, Some(k));
    }
    let neutral =
        json!({"messages": hi, "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "max_tokens": 2});
    let (st, v) = post(a, "/v1/chat/completions", &neutral);
    assert_eq!(st, 200, "{v}");
    for (k, val) in [("echo", json!(true)), ("best_of", json!(3)), ("suffix", json!("end"))] {
        let (st, v) = post(a, "/v1/completions", &json!({"prompt": "hi", k: val, "max_tokens": 2}));
        assert_error(st, &v, 400, Some(k));
    }
    let (st, v) = post(
        a,
        "/v1/completions",
        &json!({"prompt": "hi", "echo": false, "best_of": 1, "suffix": "", "max_tokens": 2}),
    );
    assert_eq!(st, 200, "{v}");
    let (st, v) = post(a, "/v1/chat/completions", &json!({"messages": [{"role": "wizard", "content": "hi"}]}));
    assert_error(st, &v, 400, Some("messages[0].role"));
    let (st, v) =
        post(a, "/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "x".repeat(5000)}]}));
    assert_error(st, &v, 413, None);
    let (st, v) = post(
        a,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "bad name!"}}]}),
    );
    assert_error(st, &v, 400, Some("tools[0].function.name"));
    let (st, v) = post(
        a,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "retrieval"}]}),
    );
    assert_error(st, &v, 400, Some("tools[0]"));
    let (st, v) = post(
        a,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}),
    );
    assert_error(st, &v, 400, Some("tool_choice"));
    let (st, v) = post(
        a,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}}),
    );
    assert_error(st, &v, 400, Some("response_format"));
    let (st, v) = post(
        a,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "oneOf": [{"type": "object"}, {"type": "object"}]}}}}),
    );
    assert_error(st, &v, 400, Some("response_format"));
    let (st, v) = post(
        a,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "extreme"}),
    );
    assert_error(st, &v, 400, Some("reasoning_effort"));
    let (st, v) = post(a, "/v1/chat/completions", &json!({"messages": [{"role": "tool", "content": "orphan result"}]}));
    assert_error(st, &v, 400, Some("messages"));
    let (st, v) = post(
        a,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://example.com/x.png"}}]}]}),
    );
    assert_error(st, &v, 400, None);
    let (st, body) = http(a, "GET", "/v2/nothing", &[], b"");
    assert_error(st, &serde_json::from_str(&body).unwrap(), 404, None);
    // unknown fields are ignored
    let (st, v) = post(
        a,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "frobnicate": true}),
    );
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 2);
    assert!(v["waste"]["experts_hit"].is_u64());
}

#[test]
fn api_key_is_required_when_set() {
    let s = start(&["--api-key", "sekret", "--exact"]);
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).to_string();
    let (st, b) = http(&s.addr, "POST", "/v1/chat/completions", &[("Authorization", "Bearer wrong")], body.as_bytes());
    assert_error(st, &serde_json::from_str(&b).unwrap(), 401, None);
    let (st, _) = http(&s.addr, "POST", "/v1/chat/completions", &[("Authorization", "Bearer sekret")], body.as_bytes());
    assert_eq!(st, 200);
    let (st, b) = http(&s.addr, "GET", "/health", &[], b"");
    assert_eq!(st, 200, "health needs no auth");
    // it names the SIMD level and the numeric mode in use (--exact here)
    let h: serde_json::Value = serde_json::from_str(&b).unwrap();
    assert_eq!(h["numeric_mode"], "exact", "{b}");
    assert!(h["simd"].is_string(), "{b}");
    let (st, b) = http(&s.addr, "GET", "/v1/models", &[], b"");
    assert_eq!(st, 401);
    // which it is: none sent, not a bearer key, or a wrong one
    let msg = |b: &str| {
        serde_json::from_str::<serde_json::Value>(b).unwrap()["error"]["message"].as_str().unwrap().to_string()
    };
    assert!(msg(&b).starts_with("missing API key") && msg(&b).contains("Bearer"), "{b}");
    let (_, b) = http(&s.addr, "GET", "/v1/models", &[("Authorization", "Basic abc")], b"");
    assert!(msg(&b).starts_with("missing API key"), "{b}");
    let (_, b) = http(&s.addr, "GET", "/v1/models", &[("Authorization", "Bearer wrong")], b"");
    assert_eq!(msg(&b), "invalid API key");
}

#[test]
fn concurrent_streaming_clients_each_get_their_own_answer() {
    let s = start(&[]);
    let prompts: Vec<String> = (0..16)
        .map(|i| format!("question number {i}: tell me about {}", ["Paris", "the weather", "json", "cities"][i % 4]))
        .collect();
    // references, one at a time, not streamed
    let want: Vec<String> = prompts.iter().map(|p| post(&s.addr, "/v1/chat/completions", &json!({"messages": [{"role": "user", "content": p}], "max_tokens": 12, "temperature": 0, "reasoning_effort": "none"}))).map(|(_, v)| v["choices"][0]["message"]["content"].as_str().unwrap().to_string()).collect();
    let got: Vec<String> = std::thread::scope(|sc| {
        let hs: Vec<_> = prompts
            .iter()
            .map(|p| {
                let addr = s.addr.clone();
                sc.spawn(move || {
                    let body = json!({"messages": [{"role": "user", "content": p}], "max_tokens": 12, "temperature": 0, "stream": true, "reasoning_effort": "none"}).to_string();
                    let (st, b) = http(&addr, "POST", "/v1/chat/completions", &[], body.as_bytes());
                    assert_eq!(st, 200);
                    let (text, last) = sse_content(&b);
                    assert_eq!(last["choices"][0]["finish_reason"], "length", "{b}");
                    text
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(want.iter().all(|w| !w.is_empty()));
    assert_eq!(got, want);
}

#[test]
fn a_disconnected_client_stops_its_generation() {
    let s = start(&[]);
    let body = json!({"messages": [{"role": "user", "content": "go on forever"}], "max_tokens": 3500, "temperature": 0, "stream": true}).to_string();
    {
        let mut c = TcpStream::connect(&s.addr).unwrap();
        write!(
            c,
            "POST /v1/chat/completions HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            s.addr,
            body.len()
        )
            .unwrap();
        let mut r = BufReader::new(c.try_clone().unwrap());
        let mut events = 0;
        let mut line = String::new();
        while events < 4 {
            line.clear();
            if r.read_line(&mut line).unwrap() == 0 {
                break;
            }
            if line.starts_with("data: ") {
                events += 1;
            }
        }
        c.shutdown(std::net::Shutdown::Both).unwrap();
    }
    let t0 = Instant::now();
    let health = |a: &str| serde_json::from_str::<Value>(&http(a, "GET", "/health", &[], b"").1).unwrap();
    while health(&s.addr)["busy"] == true && t0.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let h = health(&s.addr);
    assert_eq!(h["busy"], false);
    let n = h["generated_tokens"].as_u64().unwrap();
    assert!(n < 3000, "generation went on after the client left: {n} tokens");
    // the control: the same request with the client staying to the end runs
    // past that mark (so the check above can fail)
    let (st, _) = http(&s.addr, "POST", "/v1/chat/completions", &[], body.as_bytes());
    assert_eq!(st, 200);
    let full = health(&s.addr)["generated_tokens"].as_u64().unwrap() - n;
    assert!(full >= 3000, "the control generated only {full} tokens: the disconnect check proves nothing");
    // the engine is free for the next client
    let (st, _) = post(
        &s.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    );
    assert_eq!(st, 200);
}

#[test]
fn prefix_reuse_gives_the_same_tokens_as_a_fresh_prefill() {
    let s = start(&[]);
    let turn1 = json!([{"role": "user", "content": "hello there"}]);
    let (_, v1) = post(
        &s.addr,
        "/v1/chat/completions",
        &json!({"messages": turn1, "max_tokens": 8, "temperature": 0, "reasoning_effort": "none"}),
    );
    let answer = v1["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let turn2 = json!([{"role": "user", "content": "hello there"}, {"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]);
    let (_, v2) = post(
        &s.addr,
        "/v1/chat/completions",
        &json!({"messages": turn2, "max_tokens": 8, "temperature": 0, "reasoning_effort": "none"}),
    );
    let reused = v2["waste"]["reused_prompt_tokens"].as_u64().unwrap();
    // a fresh server computes the same answer from scratch
    let fresh = start(&[]);
    let (_, v3) = post(
        &fresh.addr,
        "/v1/chat/completions",
        &json!({"messages": turn2, "max_tokens": 8, "temperature": 0, "reasoning_effort": "none"}),
    );
    assert_eq!(v3["waste"]["reused_prompt_tokens"], 0);
    assert_eq!(v2["choices"][0]["message"]["content"], v3["choices"][0]["message"]["content"]);
    assert!(reused > 0, "turn 2 should continue from turn 1's state: {v2}");
}

/// `/v1/completions` takes a prompt as token ids too (OpenAI's forms: a
/// list of ids, or a one-list list), used as given: the text's own ids
/// (BOS included, from `waste tokenize`) give the text's completion. Several
/// prompts, ids outside the vocabulary and an empty list are 400s naming
/// `prompt` (token ids were refused: "prompt must be a string").
#[test]
fn completions_take_token_ids() {
    let s = start(&[]);
    let a = common::anchor();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_waste"))
        .args(["tokenize", a.to_str().unwrap(), "The city of", "--json"])
        .output()
        .unwrap();
    let mut ids: Vec<u64> = serde_json::from_slice::<Value>(&out.stdout).unwrap()["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    ids.insert(0, 305); // the anchor's BOS, which a text prompt gets
    let ask = |p: Value| post(&s.addr, "/v1/completions", &json!({"prompt": p, "max_tokens": 6, "temperature": 0}));
    let (st, text) = ask(json!("The city of"));
    assert_eq!(st, 200, "{text}");
    for p in [json!(ids), json!([ids])] {
        let (st, v) = ask(p);
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["usage"]["prompt_tokens"], ids.len(), "{v}");
        assert_eq!(v["choices"][0]["text"], text["choices"][0]["text"], "{v}");
    }
    for p in [json!(["a", "b"]), json!([[1], [2]]), json!([1, 316]), json!([1, -1]), json!([]), json!([[]])] {
        let (st, v) = ask(p.clone());
        assert_error(st, &v, 400, Some("prompt"));
    }
}

#[test]
fn completions_models_and_logprobs() {
    let s = start(&["--model-id", "tiny"]);
    let (st, v) = post(
        &s.addr,
        "/v1/completions",
        &json!({"prompt": "The city of", "max_tokens": 4, "temperature": 0, "logprobs": 2}),
    );
    assert_eq!(st, 200);
    assert_eq!(v["object"], "text_completion");
    assert!(v["choices"][0]["text"].is_string());
    // OpenAI's legacy completions shape (what completions clients read):
    // parallel lists, the top alternatives as a map of text to logprob
    let lp = &v["choices"][0]["logprobs"];
    assert!(lp.get("content").is_none(), "{lp}");
    let list = |k: &str| lp[k].as_array().unwrap_or_else(|| panic!("{k}: {lp}")).clone();
    let (tokens, lps, tops, offsets) =
        (list("tokens"), list("token_logprobs"), list("top_logprobs"), list("text_offset"));
    assert!(tokens.len() == 4 && lps.len() == 4 && tops.len() == 4 && offsets.len() == 4, "{lp}");
    let text = v["choices"][0]["text"].as_str().unwrap();
    for i in 0..4 {
        let (t, l) = (tokens[i].as_str().unwrap(), lps[i].as_f64().unwrap());
        assert!(l <= 0.0, "{lp}");
        // offsets from 0, in characters of the text, never back
        let o = offsets[i].as_u64().unwrap();
        assert!(if i == 0 { o == 0 } else { o >= offsets[i - 1].as_u64().unwrap() }, "{lp}");
        assert!(o as usize <= text.chars().count(), "{lp} for {text:?}");
        // after tokens that are text alone, the offset is their characters
        if tokens[..i].iter().all(|t| !t.as_str().unwrap().starts_with("bytes:")) {
            let before: usize = tokens[..i].iter().map(|t| t.as_str().unwrap().chars().count()).sum();
            assert_eq!(o as usize, before, "{lp}");
        }
        // greedy: the chosen token is the likeliest, among the 2 shown
        let top = tops[i].as_object().unwrap();
        assert_eq!(top.len(), 2, "{lp}");
        assert_eq!(top[t].as_f64(), Some(l), "{lp}");
        assert!(top.values().all(|x| x.as_f64().unwrap() <= l), "{lp}");
    }
    // streamed: each chunk its token's lists, the offsets going on
    let body = json!({"prompt": "The city of", "max_tokens": 4, "temperature": 0, "logprobs": 2, "stream": true});
    let (st, b) = http(&s.addr, "POST", "/v1/completions", &[], body.to_string().as_bytes());
    assert_eq!(st, 200);
    let (mut st_tokens, mut st_offsets) = (vec![], vec![]);
    for d in b.lines().filter_map(|l| l.strip_prefix("data: ")).filter(|d| *d != "[DONE]") {
        let c: Value = serde_json::from_str(d).unwrap();
        if let Some(l) = c["choices"][0]["logprobs"].as_object() {
            st_tokens.extend(l["tokens"].as_array().unwrap().clone());
            st_offsets.extend(l["text_offset"].as_array().unwrap().clone());
        }
    }
    assert_eq!((st_tokens, st_offsets), (tokens, offsets), "{b}");
    let (st, b) = http(&s.addr, "GET", "/v1/models", &[], b"");
    assert_eq!(st, 200);
    assert_eq!(serde_json::from_str::<Value>(&b).unwrap()["data"][0]["id"], "tiny");
    let (st, _) = http(&s.addr, "GET", "/v1/models/tiny", &[], b"");
    assert_eq!(st, 200);
    let (st, _) = http(&s.addr, "GET", "/v1/models/other", &[], b"");
    assert_eq!(st, 404);
    let (_, v) = post(
        &s.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": true, "top_logprobs": 3, "temperature": 0, "reasoning_effort": "none"}),
    );
    let c = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(c.len(), 3);
    for e in c {
        assert!(e["logprob"].as_f64().unwrap() <= 0.0);
        assert_eq!(e["top_logprobs"].as_array().unwrap().len(), 3);
    }
    // several stop strings are never emitted
    let (_, full) = post(
        &s.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "temperature": 0, "reasoning_effort": "none"}),
    );
    let text = full["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let stop: String = text.chars().skip(3).take(2).collect();
    let (_, v) = post(
        &s.addr,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "temperature": 0, "stop": ["zzzq", stop], "reasoning_effort": "none"}),
    );
    let got = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(got, &text[..text.find(&stop).unwrap()]);
}

/// A request the engine cannot finish (every record of layer 2 damaged,
/// read with `--verify`) answers 500 in OpenAI's error shape naming the
/// cause, and the server goes on: the next request gets the same answer
/// (not a hang, not text from a half-updated state) and the models list
/// still answers.
#[test]
fn an_engine_failure_is_a_500_and_the_server_goes_on() {
    let d = copy_anchor("servefail");
    damage_layer2(&d);
    let srv = start_with(&d, &["--verify"]);
    let a = srv.addr.as_str();
    for _ in 0..2 {
        let (st, v) = post(
            a,
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}),
        );
        assert_error(st, &v, 500, None);
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains("checksum mismatch") && msg.contains("layer 2"), "{v}");
    }
    // streamed: the error arrives as an event in OpenAI's shape, then the end
    let req = json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "stream": true});
    let (st, body) = http(a, "POST", "/v1/chat/completions", &[], req.to_string().as_bytes());
    assert_eq!(st, 200, "{body}");
    let ev = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .find(|d| d.contains("\"error\""))
        .expect("an error event");
    let ev: Value = serde_json::from_str(ev).unwrap();
    assert!(ev["error"]["message"].as_str().unwrap().contains("checksum mismatch"), "{ev}");
    assert!(body.contains("data: [DONE]"), "{body}");
    let (st, body) = http(a, "GET", "/v1/models", &[], b"");
    assert_eq!(st, 200, "{body}");
    drop(srv);
    std::fs::remove_dir_all(&d).ok();
}

/// One log line a request on stderr when its response is done: method,
/// path, status, the completion's id and tokens, the time; streamed or
/// not; successful health checks are not logged.
#[test]
fn each_request_is_logged_once_with_its_tokens() {
    let log = std::env::temp_dir().join(format!("waste-serve-log-{}", std::process::id()));
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_waste"))
        .args(["serve", common::anchor().to_str().unwrap(), "--port", "0", "--ctx", "512"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let addr = line.trim().rsplit("http://").next().unwrap().to_string();
    let body = |stream: bool| {
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": stream}).to_string()
    };
    assert_eq!(http(&addr, "GET", "/health", &[], b"").0, 200);
    assert_eq!(http(&addr, "POST", "/v1/chat/completions", &[], body(false).as_bytes()).0, 200);
    assert_eq!(http(&addr, "POST", "/v1/chat/completions", &[], body(true).as_bytes()).0, 200);
    assert_eq!(http(&addr, "GET", "/v1/nope", &[], b"").0, 404);
    let _ = child.kill();
    let _ = child.wait();
    let text = std::fs::read_to_string(&log).unwrap();
    std::fs::remove_file(&log).ok();
    // the budget it chose, once at the start
    assert!(text.lines().any(|l| l.starts_with("waste serve: budget ") && l.contains("expert cache of")), "{text}");
    // and how many requests it decodes together
    assert!(text.lines().any(|l| l.starts_with("waste serve: up to ") && l.ends_with("decoded together (--parallel)")));
    // the SIMD level and numeric mode it computes in
    assert!(text.lines().any(|l| l.starts_with("waste serve: simd ") && l.contains(", numeric mode ")), "{text}");
    // whether a step of several requests runs as two halves
    assert!(text.lines().any(|l| l.starts_with("waste serve: a step of several requests as two halves")), "{text}");
    let start = |l: &str| {
        ["budget ", "up to ", "simd ", "a step of several "].iter().any(|p| l.starts_with(&format!("waste serve: {p}")))
    };
    let lines: Vec<&str> = text.lines().filter(|l| l.starts_with("waste serve: ") && !start(l)).collect();
    assert_eq!(lines.len(), 3, "{text}");
    for l in &lines[..2] {
        assert!(l.contains("POST /v1/chat/completions 200, chatcmpl-") && l.contains(" + 3 completion tokens"), "{l}");
        assert!(l.ends_with(" ms"), "{l}");
    }
    assert!(lines[2].contains("GET /v1/nope 404"), "{text}");
    assert!(!text.contains("/health"), "{text}");
}
