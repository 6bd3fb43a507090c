//! The memory plan reserves `Tokenizer::encode_working_bytes` for the
//! longest text a context admits; this checks, with a counting allocator,
//! that encoding never holds more — on the texts that push each part of it
//! hardest (one long piece merged byte by byte, long runs of spaces and of
//! random letters, ordinary text, markup with specials) — and that the
//! bound is not so loose that the plan would reserve memory for nothing.
//!
//! One test in this binary: the allocator's counters are process-wide.

#[path = "../../tests-support/counting_alloc.rs"]
mod counting;
use counting::{peak_during, LIVE};
use std::path::Path;
use std::sync::atomic::Ordering::Relaxed;
use waste_tokenizer::{Pattern, Tokenizer};

/// A small xorshift, so the random texts need no dependency.
fn letters(n: usize, alphabet: &[u8], mut s: u64) -> String {
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            alphabet[(s % alphabet.len() as u64) as usize] as char
        })
        .collect()
}

#[test]
fn encoding_stays_within_its_planned_working_memory() {
    let ranks = Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/tokenizers/o200k_base.tiktoken");
    let plain = Tokenizer::from_files(&ranks, None, Pattern::O200k).unwrap();
    // the same ranks with specials, for the markup scan
    let text = std::fs::read_to_string(&ranks).unwrap();
    let parsed = Tokenizer::parse_ranks(&text, "o200k_base.tiktoken").unwrap();
    let base = parsed.len() as u32;
    let specials: Vec<(u32, String)> = (0..1000).map(|i| (base + i, format!("<|sp{i}|>"))).collect();
    let marked = Tokenizer::new(parsed, specials, Pattern::O200k).unwrap();
    drop(text);

    // ctx 4096 × o200k's longest token (128 bytes): the longest text the
    // engine's default context admits
    let n = 4096 * plain.max_token_bytes();
    assert_eq!(n, 524_288, "o200k's longest token is 128 bytes");
    let cases: Vec<(&str, String)> = vec![
        ("one piece of a", "a".repeat(n)),
        ("a shorter run of spaces", " ".repeat(40_000)),
        ("spaces", " ".repeat(n)),
        ("random letters", letters(n, b"abcdefghijklmnopqrstuvwxyz", 7)),
        ("two letters", letters(n, b"xq", 9)),
        ("ordinary text", "The quick brown fox jumps over the lazy dog. ".repeat(n / 45)),
        ("digits and punctuation", letters(n, b"0123456789.,;:!?-", 3)),
    ];
    let mut worst = 0f64;
    for (what, t) in &cases {
        for (tok, markup) in [(&plain, false), (&marked, true)] {
            let bound = tok.encode_working_bytes(t.len());
            let (peak, ids) = peak_during(|| if markup { tok.encode_markup(t) } else { tok.encode_plain(t) });
            assert!(!ids.is_empty());
            assert!(
                peak as u64 <= bound,
                "{what} (markup {markup}, {} bytes): encoding held {peak} bytes, the plan's bound is {bound}",
                t.len()
            );
            worst = worst.max(peak as f64 / bound as f64);
            println!(
                "{what:>24} markup {markup:>5}: peak {peak:>9} of {bound:>9} bytes ({:.2})",
                peak as f64 / bound as f64
            );
        }
    }
    // the pathological one-piece merge uses most of what is reserved
    assert!(worst > 0.5, "the bound is over twice the worst case measured ({worst:.2})");

    // markup with many specials between short runs of text
    let t: String = (0..20_000).map(|i| format!("hello <|sp{}|> world", i % 1000)).collect();
    let bound = marked.encode_working_bytes(t.len());
    let (peak, ids) = peak_during(|| marked.encode_markup(&t));
    assert_eq!(ids.iter().filter(|&&i| i >= base).count(), 20_000);
    assert!(peak as u64 <= bound, "markup: {peak} bytes held, bound {bound}");

    // what stays resident after encoding: a long whitespace run grows the
    // regex's backtracking stack (≈ 25 MB here), which its pool would keep;
    // a text of that length is matched by a regex of its own, dropped after
    let t = " ".repeat(n);
    let before = LIVE.load(Relaxed);
    drop(plain.encode_plain(&t));
    let kept = LIVE.load(Relaxed).saturating_sub(before);
    assert!(kept < 1 << 20, "{kept} bytes stayed resident after encoding {} spaces", t.len());
    // texts at the threshold, from many threads at once, use the shared
    // regex: what its pool keeps stays within the tables' allowance
    let t = " ".repeat(waste_tokenizer::PRIVATE_REGEX_ABOVE);
    let before = LIVE.load(Relaxed);
    std::thread::scope(|s| {
        for _ in 0..16 {
            s.spawn(|| drop(plain.encode_plain(&t)));
        }
    });
    let kept = LIVE.load(Relaxed).saturating_sub(before);
    assert!(
        kept as u64 <= waste_tokenizer::REGEX_ALLOWANCE,
        "{kept} bytes stayed resident after 16 threads encoded {} spaces",
        t.len()
    );
    println!("resident after 16 threads: {kept} bytes");
}
