//! The tower is bit-identical at every SIMD level and thread count.

mod common;
#[path = "../../waste-quant/tests/support/skip.rs"]
mod skip;

use common::cfg;
use waste_quant::{Level, Pool, SplitMix64};
use waste_vision::{from_rgb8, Grid, Tower};

#[test]
fn bit_identical_across_levels_and_threads() {
    let c = cfg();
    let t = Tower::random(&c, 3);
    let mut rng = SplitMix64::new(4);
    let rgb: Vec<u8> = (0..59 * 31 * 3).map(|_| (rng.next_u64() & 255) as u8).collect();
    let px = from_rgb8(&c, 59, 31, &rgb).unwrap();
    assert_eq!(px.grid, Grid { gw: 4, gh: 2 });
    let want = t.encode(&Pool::with_level(1, Level::Scalar), &px).unwrap();
    assert_eq!(want.len(), 2 * 40);
    assert!(want.iter().all(|v| v.is_finite()) && want.iter().any(|v| *v != 0.0));
    for lv in Level::ALL {
        if !lv.supported() {
            skip::report_skip(
                &format!("waste-vision tower bit-identity: SIMD level {} not supported here", lv.name()),
                lv.required(),
            );
            continue;
        }
        for th in [1, 2, 3] {
            let got = t.encode(&Pool::with_level(th, lv), &px).unwrap();
            assert!(
                got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{} with {th} threads differs",
                lv.name()
            );
        }
    }
}
