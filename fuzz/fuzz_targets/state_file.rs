#![no_main]
//! State-file bytes → `Session::load_state_bytes` on the anchor model: a
//! precise error or a loaded state, never a panic; a failed load leaves the
//! session as it was.
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;
use waste_model::{Model, ModelOptions};

fn model() -> &'static Model {
    static M: OnceLock<Model> = OnceLock::new();
    M.get_or_init(|| {
        let base = String::from("../testdata");
        Model::open(
            format!("{base}/anchor-tiny/kimi-linear-tiny.waste"),
            ModelOptions { ctx: 64, threads: 1, ..Default::default() },
        )
        .expect("the anchor container")
    })
}

fuzz_target!(|data: &[u8]| {
    let mut s = model().session();
    if s.load_state_bytes(data, std::path::Path::new("fuzz.state")).is_err() {
        assert_eq!(s.position(), 0, "a failed load changed the session");
    }
});
