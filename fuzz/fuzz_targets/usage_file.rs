#![no_main]
//! usage.waste bytes → parse + filter.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(u) = waste_format::Usage::parse(data) {
        let _ = u.filtered(|l, e| l < 4 && e < 8);
    }
});
