#![no_main]
//! Record bytes → header decode + full validation + CRC, against a fixed
//! layout: VQ3R, or Q4G (per-group scales, padded rows) when bit 7 of the
//! header's flags byte (informational, never checked) is set.
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let fmt = if data.get(9).is_some_and(|b| b & 0x80 != 0) {
        waste_format::ExpertFmt::Q4g
    } else {
        waste_format::ExpertFmt::Vq3r
    };
    let q = waste_format::ExpertQuant::standard(fmt);
    let cfg = waste_format::ModelConfig::from_json(&serde_json::json!({"hidden_size": 128, "num_hidden_layers": 2, "vocab_size": 4, "num_experts": 8, "num_experts_per_token": 2, "moe_intermediate_size": 64, "num_attention_heads": 1, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4, "kv_lora_rank": 4})).unwrap();
    let lay = waste_format::RecordLayout::new(&cfg, q).unwrap();
    let _ = waste_format::check_record(data, 1, 3, &lay, 0, 18, true);
});
