//! `waste serve` with images (K3 with a vision tower, converted from the
//! oracle fixture `hf-k3-vision`): `image_url` parts as base64 `data:` URLs,
//! image positions counted in `usage.prompt_tokens`, remote URLs refused,
//! prefix reuse that tells two images apart, and the CLI's `--image`.

#[path = "../../tests-support/c_vision.rs"]
mod c_vision;
mod common;

use base64::Engine;
use common::{fixtures, post_chat as post, start_with, waste};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The vision fixture converted once (F16 experts, F32 trunk, Q8G tower).
fn container() -> &'static Path {
    static C: OnceLock<PathBuf> = OnceLock::new();
    C.get_or_init(|| {
        // under target/tmp: this shared container outlives every test of the binary
        let out = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("waste-serve-vision-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        let src = fixtures().join("hf-k3-vision");
        let (code, _, err) = waste(
            &[
                "convert",
                "--src",
                src.to_str().unwrap(),
                "--out",
                out.to_str().unwrap(),
                "--experts",
                "f16",
                "--trunk",
                "f32",
                "-q",
            ],
            "",
        );
        assert_eq!(code, 0, "{err}");
        out
    })
}

fn png(name: &str) -> Vec<u8> {
    std::fs::read(fixtures().join("k3-vision").join(name)).unwrap()
}

fn data_url(b: &[u8]) -> String {
    format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(b))
}

fn user_with_image(url: &str, text: &str) -> Value {
    json!({"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]})
}

fn ask(addr: &str, msgs: Value) -> (u16, Value) {
    post(addr, &json!({"messages": msgs, "max_tokens": 4, "temperature": 0, "reasoning_effort": "none"}))
}

/// Tokens of markup text, by the CLI's tokenizer.
fn tokens_of(text: &str) -> i64 {
    let (code, out, err) = waste(&["tokenize", container().to_str().unwrap(), "--markup", "--json", text], "");
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    v["ids"].as_array().map(|a| a.len() as i64).unwrap_or_else(|| v.as_array().unwrap().len() as i64)
}

#[test]
fn images_in_chat_requests() {
    let s = start_with(container(), &[]);
    let (a, b) = (png("a.png"), png("b.png")); // 84x56 → 6 positions; 75x45 → 2
    let (st, va) = ask(&s.addr, json!([user_with_image(&data_url(&a), "what is it?")]));
    assert_eq!(st, 200, "{va}");
    // prefix reuse: a follow-up to the conversation with image a reuses its state;
    // the same follow-up after image b (same text, another image) must not reuse a's
    let answer = va["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let turn2 = |img: &[u8]| json!([user_with_image(&data_url(img), "what is it?"), {"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]);
    let (_, r1) = ask(&s.addr, turn2(&a));
    let (_, r2) = ask(&s.addr, turn2(&b));
    let reused = |v: &Value| v["waste"]["reused_prompt_tokens"].as_i64().unwrap();
    assert!(reused(&r1) > 6, "{r1}");
    assert!(reused(&r2) < reused(&r1) - 6, "image b must not reuse image a's positions: {r2}");
    let (st, vb) = ask(&s.addr, json!([user_with_image(&data_url(&b), "what is it?")]));
    assert_eq!(st, 200, "{vb}");
    // the prompts differ only in the announcement's text and the image's positions
    let pa = va["usage"]["prompt_tokens"].as_i64().unwrap();
    let pb = vb["usage"]["prompt_tokens"].as_i64().unwrap();
    let marks = tokens_of("<|media_begin|>image 84x56<|media_content|><|media_pad|><|media_end|>")
        - tokens_of("<|media_begin|>image 75x45<|media_content|><|media_pad|><|media_end|>");
    assert_eq!(pa - pb, marks + (6 - 2), "{va} {vb}");

    // and the reused answer equals a fresh server's
    let fresh = start_with(container(), &[]);
    let (_, r3) = ask(&fresh.addr, turn2(&a));
    assert_eq!(r1["choices"][0]["message"]["content"], r3["choices"][0]["message"]["content"]);
    assert_eq!(r1["usage"]["prompt_tokens"], r3["usage"]["prompt_tokens"]);
}

#[test]
fn image_errors_are_400s() {
    let s = start_with(container(), &[]);
    let cases = [
        (json!([user_with_image("https://example.com/cat.png", "x")]), "--allow-image-urls"),
        (json!([user_with_image("ftp://example.com/cat.png", "x")]), "data:, http(s):// or file://"),
        (json!([user_with_image("file:///etc/hostname", "x")]), "--allow-image-urls"),
        (json!([user_with_image("data:image/png;base64,@@@", "x")]), "base64"),
        (json!([user_with_image(&data_url(b"GIF89a trailing junk"), "x")]), "image"),
        (json!([user_with_image(&data_url(&png("a.png")[..300]), "x")]), "decoding the png image"),
        (
            json!([{"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": data_url(&png("a.png"))}}]}]),
            "user messages",
        ),
    ];
    for (msgs, want) in cases {
        let (st, v) = ask(&s.addr, msgs);
        assert_eq!(st, 400, "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains(want), "{want}: {v}");
        assert!(v["error"]["param"].as_str().unwrap().starts_with("messages["), "{v}");
    }
    // --no-images: the tower is not loaded and images get a 400 saying so
    let off = start_with(container(), &["--no-images"]);
    let (st, v) = ask(&off.addr, json!([user_with_image(&data_url(&png("a.png")), "x")]));
    assert_eq!(st, 400);
    assert!(v["error"]["message"].as_str().unwrap().contains("--no-images"), "{v}");
}

/// Images are counted against the context as they are decoded: a request
/// with more than the context can hold stops at the first one too many
/// (decoded patches are ≈ 9.6 MB at the largest grid, which a 1 KB PNG can
/// reach: a body of thousands was thousands of such buffers).
#[test]
fn images_beyond_the_context_stop_at_the_first_one_too_many() {
    let s = start_with(container(), &["--ctx", "256"]);
    let url = data_url(&png("a.png")); // 6 positions
    let parts: Vec<Value> = (0..60).map(|_| json!({"type": "image_url", "image_url": {"url": url}})).collect();
    let (st, v) = ask(&s.addr, json!([{"role": "user", "content": parts}]));
    assert_eq!(st, 400, "{v}");
    assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
    let m = v["error"]["message"].as_str().unwrap();
    assert!(m.contains("the first 43 images take 258 positions; the context holds 256"), "{m}");
    // within the context, the same images are served
    let parts: Vec<Value> = (0..3).map(|_| json!({"type": "image_url", "image_url": {"url": url}})).collect();
    let (st, v) = ask(&s.addr, json!([{"role": "user", "content": parts}]));
    assert_eq!(st, 200, "{v}");
}

/// A request's memory is reserved as it is used: its body's size (kept for
/// the text copied out of it), the parse, the rendering (the text again and
/// a template's markup), then each image's file while it is decoded — a
/// `data:` URL's bytes too, which were decoded for every image at once when
/// the request was read, outside any reservation. With the request memory
/// one KiB short of all that, the image's decoding is refused — 413, since
/// waiting for other requests could never make room (before, the same
/// server answered 200); with room, the same request is served.
#[test]
fn a_data_url_is_decoded_inside_the_request_memory() {
    let url = data_url(&png("a.png"));
    let msgs = json!([user_with_image(&url, "what is it?")]);
    let body = json!({"messages": msgs, "max_tokens": 4, "temperature": 0, "reasoning_effort": "none"}).to_string();
    let kib = |b: usize| b.div_ceil(1024).max(1);
    let b64 = url.split_once(";base64,").unwrap().1;
    let before = kib(body.len())
        + kib(waste_serve::json_parse_bytes(body.as_bytes()) as usize)
        + kib(body.len() + waste_model::tokenizer::TEMPLATE_OUTPUT_BYTES);
    let short = (before + kib(b64.len().div_ceil(4) * 3) - 1) * 1024;
    let s = start_with(container(), &["--body-limit", "65536", "--request-memory", &short.to_string()]);
    let (st, v) = ask(&s.addr, msgs.clone());
    assert_eq!(st, 413, "{v}");
    assert_eq!(v["error"]["code"], "body_too_complex", "{v}");
    let m = v["error"]["message"].as_str().unwrap();
    assert!(m.contains("decoding an image would take about") && m.contains("beside the"), "{m}");
    let roomy =
        start_with(container(), &["--body-limit", "65536", "--request-memory", &(short + (16 << 20)).to_string()]);
    let (st, v) = ask(&roomy.addr, msgs);
    assert_eq!(st, 200, "{v}");
}

/// Decoding an image allocates far more than its file: a 3000x3000 PNG of
/// a few KB decodes to ≈ 99 MB of pixels and their RGB copy. That working
/// memory is reserved from the header before decoding: with 64 MiB of
/// request memory the request is refused (413; before, the server decoded
/// it outside any reservation and answered 200), with the default 256 MiB
/// it is served.
#[test]
fn an_images_decoded_pixels_are_reserved_before_decoding() {
    let mut big = Vec::new();
    image::RgbImage::from_pixel(3000, 3000, image::Rgb([40, 90, 200]))
        .write_to(&mut std::io::Cursor::new(&mut big), image::ImageFormat::Png)
        .unwrap();
    assert!(big.len() < 1 << 20, "a small file: {} bytes", big.len());
    let msgs = json!([user_with_image(&data_url(&big), "what is it?")]);
    let tight = start_with(container(), &["--body-limit", "4194304", "--request-memory", &(64u64 << 20).to_string()]);
    let (st, v) = ask(&tight.addr, msgs.clone());
    assert_eq!(st, 413, "{v}");
    let m = v["error"]["message"].as_str().unwrap();
    assert!(m.contains("decoding an image's pixels would take about"), "{m}");
    let roomy = start_with(container(), &["--body-limit", "4194304"]);
    let (st, v) = ask(&roomy.addr, msgs);
    assert_eq!(st, 200, "{v}");
}

/// A one-shot HTTP server on loopback answering every request with `body`
/// (status 200) or 404 for paths ending in `missing`.
#[cfg(feature = "remote-images")]
fn serve_bytes(body: Vec<u8>) -> String {
    use std::io::{Read, Write};
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for c in l.incoming().take(8) {
            let Ok(mut c) = c else { continue };
            let mut req = [0u8; 4096];
            let n = c.read(&mut req).unwrap_or(0);
            let line = String::from_utf8_lossy(&req[..n]).lines().next().unwrap_or_default().to_string();
            let (status, b) =
                if line.contains("missing") { ("404 Not Found", &b""[..]) } else { ("200 OK", &body[..]) };
            let _ = write!(c, "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", b.len());
            let _ = c.write_all(b);
        }
    });
    addr
}

#[cfg(feature = "remote-images")]
#[test]
fn remote_images_only_with_allow_image_urls() {
    let a = png("a.png");
    let host = serve_bytes(a.clone());
    let url = format!("http://{host}/a.png");
    let s = start_with(container(), &["--allow-image-urls"]);
    let (st, fetched) = ask(&s.addr, json!([user_with_image(&url, "what is it?")]));
    assert_eq!(st, 200, "{fetched}");
    // the same image inline gives the same answer and the same prompt length
    let (_, inline) = ask(&s.addr, json!([user_with_image(&data_url(&a), "what is it?")]));
    assert_eq!(fetched["choices"][0]["message"]["content"], inline["choices"][0]["message"]["content"]);
    assert_eq!(fetched["usage"]["prompt_tokens"], inline["usage"]["prompt_tokens"]);
    let (st, v) = ask(&s.addr, json!([user_with_image(&format!("http://{host}/missing"), "x")]));
    assert_eq!(st, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("404"), "{v}");
    // file:// with the flag
    let p = fixtures().join("k3-vision/a.png");
    let (st, v) = ask(&s.addr, json!([user_with_image(&format!("file://{}", p.display()), "what is it?")]));
    assert_eq!(st, 200, "{v}");
    // without the flag neither is touched
    let plain = start_with(container(), &[]);
    let (st, v) = ask(&plain.addr, json!([user_with_image(&url, "x")]));
    assert_eq!(st, 400, "{v}");
}

#[test]
fn the_cli_takes_images() {
    let c = container().to_str().unwrap();
    let a = fixtures().join("k3-vision/a.png");
    let a = a.to_str().unwrap();
    // eval counts the image's positions; a placeholder needs its image
    let (code, out, err) = waste(&["eval", c, "--ids", "256,17,264,5", "--image", a, "--json", "--ctx", "64"], "");
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["positions"], 3 + 6);
    let (code, _, err) = waste(&["eval", c, "--ids", "256,17,5", "--image", a, "--ctx", "64"], "");
    assert_ne!(code, 0);
    assert!(err.contains("0 image placeholder(s)"), "{err}");
    // run announces the image in the user turn
    let (code, out, err) =
        waste(&["run", c, "describe", "--image", a, "--max-tokens", "2", "--json", "--ctx", "128"], "");
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["prompt_ids"].as_array().unwrap().iter().filter(|i| *i == 264).count(), 1, "{v}");
    // info and plan report what images add, the same figure; plan's text says it
    let (_, info, _) = waste(&["info", c, "--json"], "");
    let (_, plan, _) = waste(&["plan", c, "--json"], "");
    let (info, plan): (Value, Value) = (serde_json::from_str(&info).unwrap(), serde_json::from_str(&plan).unwrap());
    assert!(info["vision_bytes"].as_u64().unwrap() > 0);
    assert_eq!(info["vision_bytes"], plan["vision_bytes"]);
    let (_, text, _) = waste(&["plan", c], "");
    assert!(text.contains(&format!("with images: +{} bytes", plan["vision_bytes"])), "{text}");
    // a hostile file is refused precisely
    let bad = std::env::temp_dir().join(format!("waste-bad-{}.png", std::process::id()));
    std::fs::write(&bad, b"\x89PNG\r\n\x1a\n truncated").unwrap();
    let (code, _, err) = waste(&["run", c, "x", "--image", bad.to_str().unwrap(), "--ctx", "64"], "");
    assert_ne!(code, 0);
    assert!(err.contains("image") && !err.contains("panicked"), "{err}");
    let _ = std::fs::remove_file(bad);
}

/// `serve` on a K3 container written by the C converter whose tower cannot
/// load (its vision.json names a width the tensors do not have): the server
/// starts, text requests are answered, and an image is a 400 that says why.
#[test]
fn a_tower_that_cannot_load_leaves_the_server_text_only() {
    let src = c_vision::c_vision_dir(env!("CARGO_MANIFEST_DIR"));
    let tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("waste-broken-tower-{}", std::process::id()));
    let m = c_vision::broken_tower_copy(env!("CARGO_MANIFEST_DIR"), &tmp);
    let s = start_with(&m, &["--ctx", "512"]);
    let (code, r) = ask(&s.addr, json!([{"role": "user", "content": "hello"}]));
    assert_eq!(code, 200, "{r}");
    assert!(r["usage"]["completion_tokens"].as_i64().unwrap() > 0, "{r}");
    let img = std::fs::read(src.join("img_w84_h56.png")).unwrap();
    let (code, r) = ask(&s.addr, json!([user_with_image(&data_url(&img), "what is this?")]));
    assert_eq!(code, 400, "{r}");
    let msg = r["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("could not load") && msg.contains("the tower needs"), "{r}");
    drop(s);
    std::fs::remove_dir_all(&m).ok();
}
