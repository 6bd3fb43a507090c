//! K3 with images against the PyTorch oracle (`tools/oracle/k3_oracle.py
//! vision`, written from MODEL.md): a tiny K3 in the release's Hugging Face
//! form with a vision tower (`fixtures/hf-k3-vision`, made by
//! `make_hf_k3.py --vision`) is converted (F16 experts, F32 text trunk, the
//! tower at the default Q8G — the oracle decodes the same Q8G values), two
//! PNGs (one whose sides are whole patches, one RGBA that is resampled) are
//! encoded, and a prompt holding both is evaluated.

#[path = "../../waste-model/tests/common/mod.rs"]
mod common;
#[path = "../../waste-quant/tests/support/skip.rs"]
mod skip;
#[path = "support/mod.rs"]
mod support;

use common::{fixtures, rel_err};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use waste_model::{Error, Model, ModelOptions};
use waste_quant::Level;

/// The image embeddings' bound (the issue's); measured 2.4e-7 for the image
/// used as is and 3.6e-6 for the resampled one (f32 resampling against f64).
const EMBED_BOUND: f32 = 1e-5;
/// The logits' bound (the issue's); measured worst 5.9e-5 over the prompt.
const LOGIT_BOUND: f32 = 1e-4;

/// A test image: PNG bytes, width, height, patch grid, the oracle's embedding.
type OracleImage = (Vec<u8>, u32, u32, [usize; 2], Vec<f32>);

struct Oracle {
    images: Vec<OracleImage>,
    ids: Vec<u32>,
    logits: Vec<Vec<f32>>,
    greedy: Vec<u32>,
}

fn dir() -> PathBuf {
    fixtures().join("k3-vision")
}

fn oracle() -> &'static Oracle {
    static O: OnceLock<Oracle> = OnceLock::new();
    O.get_or_init(|| {
        let f: Value = serde_json::from_slice(&std::fs::read(dir().join("oracle.json")).unwrap()).unwrap();
        let flat = |v: &Value| -> Vec<f32> {
            v.as_array()
                .unwrap()
                .iter()
                .flat_map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32))
                .collect()
        };
        let ids =
            |k: &str| -> Vec<u32> { f[k].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect() };
        Oracle {
            images: f["images"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| {
                    let g = i["grid"].as_array().unwrap();
                    (
                        std::fs::read(dir().join(i["file"].as_str().unwrap())).unwrap(),
                        i["width"].as_u64().unwrap() as u32,
                        i["height"].as_u64().unwrap() as u32,
                        [g[0].as_u64().unwrap() as usize, g[1].as_u64().unwrap() as usize],
                        flat(&i["embedding"]),
                    )
                })
                .collect(),
            ids: ids("ids"),
            logits: f["logits"].as_array().unwrap().iter().map(|r| flat(&Value::Array(vec![r.clone()]))).collect(),
            greedy: ids("greedy"),
        }
    })
}

/// The fixture converted once per test process.
fn container() -> &'static Path {
    static C: OnceLock<PathBuf> = OnceLock::new();
    C.get_or_init(|| support::convert_exact("hf-k3-vision", "k3-vision"))
}

fn open(threads: usize, simd: Option<Level>) -> Model {
    Model::open(container(), ModelOptions { ctx: 256, threads, simd, vision: true, ..ModelOptions::exact() }).unwrap()
}

/// Queue both images and evaluate the prompt token by token; the logits
/// after each token (an image placeholder: after its last position).
fn run(m: &Model) -> Vec<(usize, Vec<f32>)> {
    let o = oracle();
    let mut s = m.session();
    for (png, ..) in &o.images {
        s.add_image(m.encode_image(png).unwrap()).unwrap();
    }
    o.ids.iter().map(|&t| (s.eval(&[t]).unwrap().to_vec(), s.position())).map(|(l, p)| (p, l)).collect()
}

#[test]
fn vision_json_has_the_format_keys_and_the_release_keys() {
    let v: Value = serde_json::from_slice(&std::fs::read(container().join("vision.json")).unwrap()).unwrap();
    let mut keys: Vec<&str> = v.as_object().unwrap().keys().map(|k| k.as_str()).collect();
    keys.sort_unstable();
    // FORMAT.md's table, then the release's vision_config keys not starting with `_`
    let mut want = vec![
        "vt_hidden_size",
        "vt_num_attention_heads",
        "qkv_hidden_size",
        "vt_intermediate_size",
        "vt_num_hidden_layers",
        "init_pos_emb_height",
        "init_pos_emb_width",
        "text_hidden_size",
        "patch_size",
        "vt_rms_eps",
        "media_placeholder_token_id",
        "max_patches",
        "image_mean",
        "image_std",
        "in_patch_limit",
        "patch_limit_on_one_side",
        "merge_kernel_size",
        "model_type",
    ];
    want.sort_unstable();
    assert_eq!(keys, want);
    assert_eq!(v["vt_rms_eps"].as_f64(), Some(f32::EPSILON as f64));
    assert_eq!(v["image_mean"], serde_json::json!([0.48, 0.46, 0.41]));
    // the tower's matrices are Q8G, its norms F32 (what the C WASTE reads)
    let m: Value = serde_json::from_slice(&std::fs::read(container().join("manifest.json")).unwrap()).unwrap();
    let vis: Vec<&Value> = m["trunk"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| {
            t["name"].as_str().unwrap().starts_with("vision_tower.")
                || t["name"].as_str().unwrap().starts_with("mm_projector.")
        })
        .collect();
    assert_eq!(vis.len(), 2 + 6 * 2 + 4);
    for t in vis {
        let name = t["name"].as_str().unwrap();
        let want = if name.contains("norm") { 0 } else { 2 };
        assert_eq!(t["fmt"].as_u64(), Some(want), "{name}");
    }
}

#[test]
fn no_vision_leaves_the_tower_out() {
    let out = support::tmp("k3-novision");
    let o = waste_convert::ConvertOptions {
        experts: waste_format::ExpertFmt::F16,
        trunk: waste_convert::TrunkMode::F32,
        jobs: 2,
        vision: waste_convert::VisionMode::Off,
        ..Default::default()
    };
    waste_convert::convert(&fixtures().join("hf-k3-vision"), &out, &o, &|_| {}).unwrap();
    assert!(!out.join("vision.json").exists());
    let m = std::fs::read_to_string(out.join("manifest.json")).unwrap();
    assert!(!m.contains("vision_tower") && !m.contains("mm_projector"));
    // images asked of a container without a tower: a precise refusal
    let e = Model::open(&out, ModelOptions { ctx: 64, vision: true, ..ModelOptions::exact() }).err().unwrap();
    assert!(matches!(e, Error::Unsupported(_)) && e.to_string().contains("no vision tower"), "{e}");
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn image_embeddings_match_the_oracle() {
    let m = open(2, None);
    let mut worst = 0f32;
    for (png, w, h, grid, want) in &oracle().images {
        let info = m.image_info(png).unwrap();
        assert_eq!((info.width, info.height, info.format), (*w, *h, "png"));
        assert_eq!(m.image_positions(png).unwrap(), grid[0] / 2 * (grid[1] / 2));
        let img = m.encode_image(png).unwrap();
        assert_eq!([img.grid.gw, img.grid.gh], *grid);
        let e = rel_err(img.rows(), want);
        eprintln!("image {w}x{h} (grid {grid:?}): relative error {e:.2e}");
        worst = worst.max(e);
    }
    assert!(worst <= EMBED_BOUND, "worst {worst:.2e}");
}

#[test]
fn a_prompt_with_two_images_matches_the_oracle_and_its_greedy_continuation() {
    let o = oracle();
    let m = open(2, None);
    let run = run(&m);
    let mut worst = 0f32;
    for (pos, l) in &run {
        worst = worst.max(rel_err(l, &o.logits[pos - 1]));
    }
    eprintln!("logits with two images: worst relative error {worst:.2e} over {} token boundaries", run.len());
    assert!(worst <= LOGIT_BOUND, "worst {worst:.2e}");
    assert_eq!(run.last().unwrap().0, o.logits.len(), "positions: images expanded to their merged rows");
    // greedy continuation, and the whole prompt in one prefill gives the same bits
    let mut s = m.session();
    for (png, ..) in &o.images {
        s.add_image(m.encode_image(png).unwrap()).unwrap();
    }
    let l = s.eval(&o.ids).unwrap().to_vec();
    assert_eq!(s.queued_images(), 0);
    assert!(l.iter().zip(&run.last().unwrap().1).all(|(a, b)| a.to_bits() == b.to_bits()), "prefill ≠ token by token");
    let mut got = vec![];
    let mut next = waste_model::argmax(&l);
    for _ in 0..o.greedy.len() {
        got.push(next);
        next = waste_model::argmax(s.eval(&[next]).unwrap());
    }
    assert_eq!(got, o.greedy);
}

#[test]
fn images_are_bit_identical_across_levels_and_threads() {
    let want = run(&open(1, Some(Level::Scalar)));
    for lv in Level::ALL {
        if !lv.supported() {
            skip::report_skip(
                &format!("K3 vision bit-identity: SIMD level {} not supported here", lv.name()),
                lv.required(),
            );
            continue;
        }
        for th in [1, 2] {
            let got = run(&open(th, Some(lv)));
            for ((p, a), (_, b)) in got.iter().zip(&want) {
                assert!(a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()), "{} x{th} differs at {p}", lv.name());
            }
        }
    }
}

#[test]
fn the_normalisation_comes_from_vision_json() {
    // negative control: the same tower with the default mean/std (0.5) is far outside the bound
    let d = common::copy_container(container(), "k3-vision-mean");
    let p = d.join("vision.json");
    let mut v: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    v["image_mean"] = serde_json::json!([0.5, 0.5, 0.5]);
    v["image_std"] = serde_json::json!([0.5, 0.5, 0.5]);
    std::fs::write(&p, serde_json::to_vec(&v).unwrap()).unwrap();
    let m = Model::open(&d, ModelOptions { ctx: 64, threads: 2, vision: true, ..ModelOptions::exact() }).unwrap();
    let (png, .., want) = &oracle().images[0];
    let e = rel_err(m.encode_image(png).unwrap().rows(), want);
    assert!(e > 100.0 * EMBED_BOUND, "{e:.2e}");
}

#[test]
fn placeholders_and_images_must_match() {
    let m = open(2, None);
    let o = oracle();
    let pad = m.vision().unwrap().placeholder;
    let mut s = m.session();
    // a placeholder with no queued image is refused before any state changes
    let e = s.eval(&[1, pad, 2]).unwrap_err();
    assert!(matches!(e, Error::Arg(_)) && e.to_string().contains("placeholder"), "{e}");
    assert_eq!(s.position(), 0);
    // the context bound counts the image's positions
    let img = m.encode_image(&o.images[0].0).unwrap();
    let n = img.positions();
    let small =
        Model::open(container(), ModelOptions { ctx: n + 1, threads: 2, vision: true, ..ModelOptions::exact() })
            .unwrap();
    let mut s = small.session();
    s.add_image(img.clone()).unwrap();
    assert!(matches!(s.eval(&[1, 2, pad]), Err(Error::ContextFull { n: got, .. }) if got == n + 2));
    assert_eq!(s.queued_images(), 1, "a refused eval keeps the queue");
    s.eval(&[1, pad]).unwrap();
    assert_eq!(s.position(), n + 1);
    // without images enabled the placeholder is an ordinary token and images are refused
    let plain = Model::open(container(), ModelOptions { ctx: 64, threads: 2, ..ModelOptions::exact() }).unwrap();
    assert!(matches!(plain.encode_image(&o.images[0].0), Err(Error::Unsupported(_))));
    let mut s = plain.session();
    assert!(matches!(s.add_image(img), Err(Error::Unsupported(_))));
    s.eval(&[1, pad]).unwrap();
    assert_eq!(s.position(), 2);
}

#[test]
fn the_tower_is_planned_and_taken_from_the_expert_budget() {
    let plan = waste_model::plan(container(), 256).unwrap();
    assert!(plan.vision_weight_bytes > 0 && plan.vision_scratch_bytes > 0 && !plan.vision);
    let budget = plan.with_vision().floor_bytes + 4 * plan.record_bytes;
    // chunks of 16 both ways: without images the larger cache could take a
    // larger prefill chunk's buffers (`Plan::chunk_for`), which is not what
    // this compares
    let o = |vision| ModelOptions {
        ctx: 256,
        threads: 2,
        budget,
        vision,
        huge_pages: false,
        max_chunk: 16,
        ..ModelOptions::exact()
    };
    let with = Model::open(container(), o(true)).unwrap();
    let without = Model::open(container(), o(false)).unwrap();
    // one image's buffers cover decoding the largest image the header check
    // accepts (a few-KB PNG may declare 50 M pixels), not only the tower's
    let cfg = with.vision().unwrap();
    assert!(plan.vision_scratch_bytes >= waste_vision::max_preprocess_bytes(cfg).max(cfg.scratch_bytes()));
    assert!(waste_vision::max_preprocess_bytes(cfg) > 3 * waste_vision::MAX_PIXELS);
    assert_eq!(with.plan().floor_bytes, without.plan().floor_bytes + plan.vision_bytes());
    // the vision bytes come out of the cache: without images it holds that many more records (up to all of them)
    let fewer = (plan.vision_bytes() / plan.record_bytes) as usize;
    let all = plan.expert_records as usize;
    assert!(fewer > 0 && with.cache_slots() < all);
    let want = (with.cache_slots() + fewer).min(all);
    assert!(without.cache_slots().abs_diff(want) <= 1, "{} vs {want}", without.cache_slots());
}
