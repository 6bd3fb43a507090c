#![no_main]
//! Manifest bytes → parse + config parse + validation against a fixed tiny file set.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = waste_format::Manifest::parse(data) {
        let _ = waste_format::ModelConfig::from_json(&m.config);
        let dir = std::env::temp_dir().join("waste-fuzz-manifest");
        let _ = std::fs::create_dir_all(&dir);
        let _ = waste_format::Container::from_manifest(dir, m);
    }
});
