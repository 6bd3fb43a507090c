//! The C WASTE's K3 vision containers: `testdata/c-k3-vision/`, a tiny K3
//! with a 2-layer tower converted by the C converter (the patch embedding
//! stored as the release's conv `[64, 3, 14, 14]`, the position grid as
//! `[5, 7, 64]`), against the C engine's own logits for `waste eval MODEL
//! "Describe: " --image …` (its README). The prompt is built as the C CLI
//! builds it: one media block per image, in order, as markup, then the text
//! as plain text, no template.

#[path = "../../tests-support/c_vision.rs"]
mod c_vision;

use serde_json::Value;
use std::path::PathBuf;
use waste_model::{Model, ModelOptions};

/// The C engine printed its logits with 4 decimals; the two engines agree
/// on the anchor within 1.2e-4 (testdata/README.md).
const BOUND: f32 = 2e-3;

fn dir() -> PathBuf {
    c_vision::c_vision_dir(env!("CARGO_MANIFEST_DIR"))
}

/// The C engine's logits by token id, and its prompt length.
fn c_eval(case: &str) -> (Vec<f32>, usize) {
    let v: Value = serde_json::from_slice(&std::fs::read(dir().join(format!("c-eval-{case}.json"))).unwrap()).unwrap();
    let top = v["top"].as_array().unwrap();
    let mut l = vec![f32::NAN; v["vocab"].as_u64().unwrap() as usize];
    for e in top {
        l[e["id"].as_u64().unwrap() as usize] = e["logit"].as_f64().unwrap() as f32;
    }
    assert!(l.iter().all(|x| x.is_finite()), "{case}: every id once");
    (l, v["prompt_tokens"].as_u64().unwrap() as usize)
}

fn argmax(l: &[f32]) -> usize {
    waste_model::argmax(l) as usize
}

/// Our logits for the C CLI's prompt with these images, and the positions
/// the prompt took (images expanded).
fn ours(m: &Model, images: &[&str]) -> (Vec<f32>, usize) {
    let tok = m.tokenizer().unwrap();
    let mut s = m.session();
    let mut ids = Vec::new();
    for name in images {
        let png = std::fs::read(dir().join(name)).unwrap();
        let info = m.image_info(&png).unwrap();
        ids.extend(tok.encode_markup(&waste_tokenizer::image_markup(info.width, info.height)));
        s.add_image(m.encode_image(&png).unwrap()).unwrap();
    }
    ids.extend(tok.encode_plain("Describe: "));
    let l = s.eval(&ids).unwrap().to_vec();
    (l, s.position())
}

#[test]
fn the_c_converters_vision_container_matches_the_c_engine() {
    let m = Model::open(
        dir().join("k3-vision-tiny.waste"),
        ModelOptions { ctx: 256, vision: true, ..ModelOptions::exact() },
    )
    .unwrap();
    for (case, images) in [
        ("noimage", &[][..]),
        ("w84_h56", &["img_w84_h56.png"][..]),
        ("w50_h33", &["img_w50_h33.png"][..]),
        ("both", &["img_w84_h56.png", "img_w50_h33.png"][..]),
    ] {
        let (want, positions) = c_eval(case);
        let (got, pos) = ours(&m, images);
        assert_eq!(pos, positions, "{case}: prompt positions");
        let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        eprintln!("{case}: max abs difference from the C engine {worst:.2e}");
        assert!(worst <= BOUND, "{case}: max abs {worst:.2e} > {BOUND:e}");
        assert_eq!(argmax(&got), argmax(&want), "{case}: argmax");
    }
}

/// Asked for strictly (`--image`), a tower that cannot load fails the open
/// naming the tensor; with `vision_optional` (chat, serve) the text model
/// opens and runs as without images, the reason is a warning, and an image
/// is refused with it.
#[test]
fn a_tower_that_cannot_load_takes_only_the_images_down() {
    let path = std::env::temp_dir().join(format!("waste-c-vision-broken-{}", std::process::id()));
    c_vision::broken_tower_copy(env!("CARGO_MANIFEST_DIR"), &path);
    let strict = ModelOptions { ctx: 256, vision: true, ..ModelOptions::exact() };
    let e = Model::open(&path, strict.clone()).err().expect("a tower of the wrong width must not load").to_string();
    assert!(e.contains("vision_tower.") && e.contains("the tower needs"), "{e}");
    let m = Model::open(&path, ModelOptions { vision_optional: true, ..strict }).unwrap();
    assert!(m.vision().is_none());
    let w = m.warnings().join("\n");
    assert!(w.contains("images are off") && w.contains("the tower needs"), "{w}");
    // text: the same logits as the intact container opened without images
    let text =
        Model::open(dir().join("k3-vision-tiny.waste"), ModelOptions { ctx: 256, ..ModelOptions::exact() }).unwrap();
    let ids = text.tokenizer().unwrap().encode_plain("Describe: ");
    let (a, b) = (m.session().eval(&ids).unwrap().to_vec(), text.session().eval(&ids).unwrap().to_vec());
    assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
    let png = std::fs::read(dir().join("img_w84_h56.png")).unwrap();
    let Err(e) = m.encode_image(&png) else { panic!("no tower, no image") };
    let e = e.to_string();
    assert!(e.contains("could not load") && e.contains("text only"), "{e}");
    std::fs::remove_dir_all(&path).ok();
}

/// Images through a small cache's prefill: at the floor budget, in chunks
/// of 4 (the two images' 36 positions cut mid-image), the prompt goes a
/// span of chunks at a time layer by layer with its experts in waves
/// (`Model::spans`); its logits are the whole cache's chunk by chunk, bit
/// for bit, so the C engine's too.
#[test]
fn images_in_a_span_of_chunks_give_the_whole_cache_s_logits() {
    let path = dir().join("k3-vision-tiny.waste");
    let ctx = 256;
    let o = ModelOptions { ctx, vision: true, max_chunk: 4, threads: 2, ..ModelOptions::exact() };
    let whole = Model::open(&path, ModelOptions { span: false, ..o.clone() }).unwrap();
    assert!(!whole.spans());
    // the floor with the tower's memory (the open's own plan counts it)
    let floor = whole.plan().floor_bytes;
    let small = Model::open(&path, ModelOptions { budget: floor, ..o }).unwrap();
    assert!(small.spans(), "the floor's cache cannot hold every expert: {} slots", small.cache_slots());
    assert!(small.expert_wave().is_some(), "the floor's cache cannot pin a layer's experts: waves");
    let images = ["img_w84_h56.png", "img_w50_h33.png"];
    let (want, pos) = ours(&whole, &images);
    let (got, pos_small) = ours(&small, &images);
    assert_eq!((pos, pos_small), (40, 40), "the prompt's positions (images expanded)");
    assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "a span's logits differ");
    let (c, _) = c_eval("both");
    let worst = got.iter().zip(&c).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(worst <= BOUND, "max abs {worst:.2e} from the C engine");
}
