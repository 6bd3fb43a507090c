//! The `tokenizer` fuzz target's twin in every CI run: arbitrary text
//! (mixed scripts, specials spelled out, invalid UTF-8 split anywhere)
//! through the anchor's tokenizer: plain encoding round-trips exactly,
//! markup encoding never panics, and the streaming decoder reassembles any
//! byte stream however it is cut.

use proptest::prelude::*;
use std::path::Path;
use std::sync::OnceLock;
use waste_tokenizer::{StreamDecoder, Tokenizer};

fn tok() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        Tokenizer::from_container_dir(
            &Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/anchor-tiny/kimi-linear-tiny.waste"),
        )
        .expect("the anchor's tokenizer")
    })
}

fn text() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        "[a-zA-Z0-9 ]{0,12}",
        "[\\p{Han}\\p{Cyrillic}\\p{Arabic}]{0,6}",
        "[ \\t\\n\\r]{0,4}",
        Just("<|im_end|>".to_string()),
        Just("<|open|>".to_string()),
        Just("'s'll 'VE".to_string()),
        "\\PC{0,4}",
    ];
    proptest::collection::vec(piece, 0..8).prop_map(|v| v.concat())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]
    #[test]
    fn text_round_trips_and_streams(s in text(), cuts in proptest::collection::vec(1usize..5, 1..8)) {
        let t = tok();
        let ids = t.encode_plain(&s);
        prop_assert_eq!(t.decode(&ids), s.clone());
        let _ = t.encode_markup(&s);
        let bytes = s.as_bytes();
        let mut d = StreamDecoder::new();
        let (mut out, mut at, mut k) = (String::new(), 0, 0);
        while at < bytes.len() {
            let n = cuts[k % cuts.len()].min(bytes.len() - at);
            out.push_str(&d.push(&bytes[at..at + n]));
            at += n;
            k += 1;
        }
        out.push_str(&d.finish());
        prop_assert_eq!(out, s);
    }

    #[test]
    fn arbitrary_bytes_stream_to_their_lossy_text(b in proptest::collection::vec(any::<u8>(), 0..64), cut in 1usize..7) {
        let mut d = StreamDecoder::new();
        let mut out = String::new();
        for c in b.chunks(cut) {
            out.push_str(&d.push(c));
        }
        out.push_str(&d.finish());
        prop_assert_eq!(out, String::from_utf8_lossy(&b).into_owned());
    }
}
