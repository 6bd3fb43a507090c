//! The safetensors header reader of `waste convert` on arbitrary bytes as a
//! whole file: a parse or a precise error, never a panic, and every range
//! it accepts lies inside the file.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(ts) = waste_convert::parse_header(std::path::Path::new("fuzz.safetensors"), data, data.len() as u64) {
        for (_, t) in ts {
            assert!(t.start <= t.end && t.end <= data.len() as u64);
        }
    }
});
