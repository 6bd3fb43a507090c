//! `plan` on a manifest with Kimi K3's real shape (93 layers, hidden 7168,
//! 896 experts top-16, latent 3584, moe_intermediate 3072, 2 shared experts,
//! KDA 96×128, 24 MLA layers with q_lora 1536 / kv_lora 512, VQ3R experts, Q4G
//! trunk, Q8G embedding/head): the C WASTE's record size, its trunk within 2%,
//! and a floor that grows with the context by exactly the MLA latent cache.

use waste_format::ExpertFmt;
use waste_synth::{shape_config, synth, SynthOptions};

/// The C WASTE's measured resident trunk for K3 (it prints GiB as "GB").
const C_TRUNK_GIB: f64 = 27.28;

#[test]
fn k3_shaped_plan() {
    let dir = std::env::temp_dir().join(format!("waste-k3-plan-{}", std::process::id()));
    let o = SynthOptions {
        config: shape_config("k3").unwrap(),
        layers: None,
        experts: ExpertFmt::Vq3r,
        seed: 0,
        manifest_only: true,
        skewed: false,
        jobs: 2,
    };
    synth(&dir, &o, &|_, _| {}).unwrap();
    let p4 = waste_model::plan(&dir, 4096).unwrap();
    assert_eq!(p4.record_bytes, 12_406_784);
    let trunk_gib = p4.trunk_bytes as f64 / (1u64 << 30) as f64;
    assert!((trunk_gib / C_TRUNK_GIB - 1.0).abs() < 0.02, "trunk {trunk_gib:.3} GiB vs the C engine's {C_TRUNK_GIB}");
    // min cache: top_k × record × 2, rounded up to the arena's 2 MiB huge pages
    let min = 2 * 16 * 12_406_784u64;
    assert!(p4.min_expert_cache_bytes >= min && p4.min_expert_cache_bytes < min + (2 << 20));
    // 24 MLA layers × (512 + 64) f32 per position
    let per_token = 24 * (512 + 64) * 4;
    for ctx in [32 << 10, 128 << 10, 1 << 20] {
        let p = waste_model::plan(&dir, ctx).unwrap();
        assert_eq!(p.state_bytes - p4.state_bytes, (ctx as u64 - 4096) * per_token);
        assert_eq!(p.trunk_bytes, p4.trunk_bytes);
        assert!(p.floor_bytes > p4.floor_bytes);
        assert_eq!(p.working_set_bytes, 16 * 12_406_784 * 92);
    }
    // below the 4K floor (issue 48): 16 and 28 GiB give a split whose floor
    // fits, reading a token's streamed bytes; lower budgets stream more
    let mut reads = vec![];
    for gib in [28u64, 16, 8] {
        let budget = gib << 30;
        assert!(budget < p4.floor_bytes);
        let s = waste_model::split(&dir, &p4, budget, 1 << 40).unwrap();
        let q = p4.with_split(&s);
        assert!(s.streams() && q.floor_bytes <= budget, "{gib} GiB: {s:?}");
        assert!(s.read_bytes > 0 && s.buffer_bytes < 1 << 30, "{gib} GiB: {s:?}");
        reads.push(s.read_bytes);
    }
    assert!(reads.windows(2).all(|w| w[0] < w[1]), "{reads:?}");
    // the lowest split keeps the state, the scratch, the tokenizer and the smallest cache
    let e = waste_model::split(&dir, &p4, 1 << 30, 1 << 40).unwrap_err();
    assert!(matches!(e, waste_model::Error::Budget { floor, .. } if floor > 1 << 30 && floor < 4 << 30), "{e}");
    // the automatic budget on a 24 GiB machine streams within 7/8 of it;
    // on machines that hold the floor (even above 7/8 of them), nothing streams
    let s = waste_model::split(&dir, &p4, 0, 24 << 30).unwrap();
    assert!(s.streams() && p4.with_split(&s).floor_bytes <= (24u64 << 30) / 8 * 7, "{s:?}");
    for ram in [p4.floor_bytes, 64 << 30] {
        assert!(!waste_model::split(&dir, &p4, 0, ram).unwrap().streams());
    }
    std::fs::remove_dir_all(&dir).ok();
}
