//! `install` routes the tokenizer's chat-template rendering through the
//! helper (a test process of its own: the renderer is process-wide, once).
//! A hostile template is then an error; rendered in this process it would
//! end the test run on a failed allocation.

use std::path::PathBuf;
use waste_tokenizer::{ChatTemplate, Message, Pattern, Tokenizer};

#[test]
fn install_routes_renderings_through_the_helper_once() {
    assert!(waste_sandbox::installed().is_none());
    let helper = PathBuf::from(env!("CARGO_BIN_EXE_waste-render-template"));
    assert!(waste_sandbox::install(helper.clone()));
    assert_eq!(waste_sandbox::installed(), Some(helper.as_path()));
    // once per process
    assert!(!waste_sandbox::install(PathBuf::from("/nonexistent")));
    assert_eq!(waste_sandbox::installed(), Some(helper.as_path()));

    // bytes as tokens: the ids are the rendered text's bytes
    let tok = Tokenizer::new((0..256u32).map(|b| (vec![b as u8], b)).collect(), vec![], Pattern::O200k).unwrap();
    let msgs = [Message::new("user", "hi"), Message::new("assistant", "yo")];
    let real = ChatTemplate::Jinja("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}".into());
    let ids = real.encode(&tok, &msgs, false).unwrap();
    assert_eq!(ids, b"[user]hi[assistant]yo".iter().map(|&b| b as u32).collect::<Vec<_>>());
    let hostile = ChatTemplate::Jinja(
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}"
            .into(),
    );
    let e = hostile.encode(&tok, &msgs, true).unwrap_err().to_string();
    assert!(e.contains("chat_template.jinja") && e.contains("limits"), "{e}");
}
