//! Helpers of the converter's integration tests.
#![allow(dead_code)] // each test crate including this module uses part of it

use crate::common::fixtures; // the including crate has the oracle tests' `common`
use std::path::PathBuf;
use waste_convert::{convert, ConvertOptions, TrunkMode};
use waste_format::ExpertFmt;

/// A fresh temporary folder name (and no staging folder beside it), under
/// the target directory's tmp: the containers shared by a test binary are
/// never deleted by it, and there they go with `target/`, not into /tmp.
pub fn tmp(tag: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("waste-convert-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    let _ = std::fs::remove_dir_all(waste_convert::staging_dir(&d));
    d
}

/// Convert a fixture with F16 experts and an F32 trunk, which must hold its
/// weights exactly (f16-exact or MXFP4 experts, bf16/f16/f32 trunk).
pub fn convert_exact(fixture: &str, tag: &str) -> PathBuf {
    let out = tmp(tag);
    let o = ConvertOptions { experts: ExpertFmt::F16, trunk: TrunkMode::F32, jobs: 2, ..Default::default() };
    let rep = convert(&fixtures().join(fixture), &out, &o, &|_| {}).unwrap();
    assert!(rep.complete);
    assert!(
        rep.rel_error.iter().all(|&e| e == 0.0),
        "{fixture}: the experts must convert losslessly: {:?}",
        rep.rel_error
    );
    out
}
