#![no_main]
//! Model output (marked text) → K3's output parser, in two pieces split
//! anywhere: the same parts as in one piece, never a panic.
use libfuzzer_sys::fuzz_target;
use waste_model::tokenizer::xtml::{merge_parts, OutputParser};

fuzz_target!(|data: &[u8]| {
    let s = String::from_utf8_lossy(data).replace('\u{1}', "\u{F8F2}").replace('\u{2}', "\u{F8F3}");
    let cut = s.char_indices().map(|(i, _)| i).nth(data.first().copied().unwrap_or(0) as usize % 16).unwrap_or(s.len());
    let mut a = OutputParser::new(data.len() % 2 == 0);
    let whole = merge_parts(a.push(&s));
    let mut b = OutputParser::new(data.len() % 2 == 0);
    let mut parts = b.push(&s[..cut]);
    parts.extend(b.push(&s[cut..]));
    assert_eq!(whole, merge_parts(parts));
});
