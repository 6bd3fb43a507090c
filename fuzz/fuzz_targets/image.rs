#![no_main]
//! Image bytes → header probe + decode + patches (PNG, JPEG, WebP, GIF):
//! an error or pixels, never a panic or an allocation beyond the caps.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let cfg = waste_vision::VisionConfig::from_json(
        &serde_json::json!({"vt_hidden_size": 32, "vt_num_attention_heads": 2, "qkv_hidden_size": 32,
                            "text_hidden_size": 16, "media_placeholder_token_id": 1, "max_patches": 256}),
        16,
        4,
    )
    .expect("a valid config");
    let _ = waste_vision::probe(data);
    if let Ok(p) = waste_vision::preprocess(&cfg, data) {
        assert_eq!(p.patches.len(), p.grid.patches() * waste_vision::PATCH_VALUES);
    }
});
