//! The small tower configuration the integration tests share.

use serde_json::json;
use waste_vision::VisionConfig;

/// A 2-layer tower, 64 patches at most.
pub fn cfg() -> VisionConfig {
    VisionConfig::from_json(
        &json!({"vt_hidden_size": 64, "vt_num_attention_heads": 2, "qkv_hidden_size": 64, "vt_intermediate_size": 96,
                "vt_num_hidden_layers": 2, "init_pos_emb_height": 4, "init_pos_emb_width": 4, "text_hidden_size": 40,
                "media_placeholder_token_id": 1, "max_patches": 64}),
        40,
        4,
    )
    .unwrap()
}
