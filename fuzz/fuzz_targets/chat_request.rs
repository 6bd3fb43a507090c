#![no_main]
//! HTTP body bytes → JSON → the server's chat-request validation: a value
//! or a 400 (message + param), never a panic.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) {
        let _ = waste_serve::check_chat_request(&v);
    }
});
