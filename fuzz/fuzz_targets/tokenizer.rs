#![no_main]
//! Any text through the anchor's tokenizer: plain encoding round-trips,
//! markup encoding and streaming decoding never panic.
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;
use waste_model::tokenizer::{StreamDecoder, Tokenizer};

fn tok() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let base = String::from("../testdata");
        Tokenizer::from_container_dir(std::path::Path::new(&format!("{base}/anchor-tiny/kimi-linear-tiny.waste")))
            .expect("the anchor's tokenizer")
    })
}

fuzz_target!(|data: &[u8]| {
    let t = tok();
    let s = String::from_utf8_lossy(data);
    let ids = t.encode_plain(&s);
    assert_eq!(t.decode(&ids), s, "plain encoding must round-trip");
    let _ = t.encode_markup(&s);
    // the bytes as a stream of arbitrary pieces
    let mut d = StreamDecoder::new();
    let mut out = String::new();
    for c in data.chunks(3) {
        out.push_str(&d.push(c));
    }
    out.push_str(&d.finish());
    assert_eq!(out, String::from_utf8_lossy(data));
});
