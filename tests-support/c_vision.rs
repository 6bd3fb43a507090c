//! The C converter's K3 vision container (`testdata/c-k3-vision/`) for the
//! tests of several crates (included with `#[path]`).

use std::path::{Path, PathBuf};

/// `testdata/c-k3-vision/`, from a crate's manifest directory.
pub fn c_vision_dir(manifest_dir: &str) -> PathBuf {
    let p = Path::new(manifest_dir).join("../testdata/c-k3-vision");
    assert!(p.join("k3-vision-tiny.waste/manifest.json").exists(), "test data missing at {}", p.display());
    p
}

/// A copy of the container at `dst` whose `vision.json` names a tower width
/// its tensors do not have: a tower that cannot load, a text model that can.
pub fn broken_tower_copy(manifest_dir: &str, dst: &Path) -> PathBuf {
    let _ = std::fs::remove_dir_all(dst);
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(c_vision_dir(manifest_dir).join("k3-vision-tiny.waste")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
    let p = dst.join("vision.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    v["vt_hidden_size"] = 32.into();
    v["qkv_hidden_size"] = 128.into();
    std::fs::write(&p, serde_json::to_vec(&v).unwrap()).unwrap();
    dst.to_path_buf()
}
