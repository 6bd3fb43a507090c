#![no_main]
//! Chat-template loading on arbitrary input: a `chat_template.jinja` (run
//! with fuel and a recursion limit) or a `chat.json`, rendering a short
//! conversation through the anchor's tokenizer: tokens or a precise error,
//! never a panic or a hang. With `WASTE_RENDER_HELPER` set (`cargo xtask
//! fuzz` builds `waste-render-template` and sets it), Jinja renders in the
//! limited child as in the `waste` binary; in process, a template that
//! grows a value without writing it exhausts the fuzzer's memory — the
//! reason the child exists (waste-sandbox).
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;
use waste_model::tokenizer::{ChatTemplate, Message, Tokenizer};

fn tok() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| {
        Tokenizer::from_container_dir(std::path::Path::new("../testdata/anchor-tiny/kimi-linear-tiny.waste"))
            .expect("the anchor's tokenizer")
    })
}

fn sandboxed() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        if let Some(h) = std::env::var_os("WASTE_RENDER_HELPER") {
            waste_sandbox::install(h.into());
        }
    });
}

fuzz_target!(|data: &[u8]| {
    sandboxed();
    let Some((&kind, rest)) = data.split_first() else { return };
    let src = String::from_utf8_lossy(rest).into_owned();
    let template = if kind % 2 == 0 {
        ChatTemplate::Jinja(src)
    } else {
        match ChatTemplate::parse_json(&src) {
            Ok(t) => t,
            Err(_) => return,
        }
    };
    let msgs = [Message::new("system", "be brief"), Message::new("user", "hi {{ 7*7 }}")];
    let _ = template.encode(tok(), &msgs, true);
});
