//! `preprocess_bytes` bounds what `preprocess` allocates, measured with a
//! counting allocator (a test binary of its own: the counters are
//! process-wide), for small and large images in 8- and 16-bit colour —
//! and it is not a loose constant: a 16-bit image's bound exceeds its
//! measured peak by less than the size of one 8-bit copy of its pixels.

#[path = "../../tests-support/counting_alloc.rs"]
mod counting_alloc;

mod common;

use common::cfg;
use waste_vision::{preprocess, preprocess_bytes, probe};

fn png(w: u32, h: u32, sixteen: bool) -> Vec<u8> {
    let mut out = Vec::new();
    if sixteen {
        let img = image::ImageBuffer::<image::Rgba<u16>, _>::from_fn(w, h, |x, y| {
            image::Rgba([x as u16, y as u16, 7, 65535])
        });
        img.write_to(&mut std::io::Cursor::new(&mut out), image::ImageFormat::Png).unwrap();
    } else {
        let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([x as u8, y as u8, 7]));
        img.write_to(&mut std::io::Cursor::new(&mut out), image::ImageFormat::Png).unwrap();
    }
    out
}

#[test]
fn the_bound_holds_what_decoding_allocates() {
    let c = cfg();
    for (w, h, sixteen) in [(84, 56, false), (1500, 1000, false), (1500, 1000, true), (640, 2000, true)] {
        let bytes = png(w, h, sixteen);
        let bound = preprocess_bytes(&c, &probe(&bytes).unwrap()).unwrap();
        let (peak, px) = counting_alloc::peak_during(|| preprocess(&c, &bytes).unwrap());
        drop(px);
        assert!(peak as u64 <= bound, "{w}x{h} 16-bit {sixteen}: peak {peak} above the bound {bound}");
        if sixteen {
            let rgb8 = 3 * u64::from(w) * u64::from(h);
            assert!(bound - (peak as u64) < rgb8, "{w}x{h}: bound {bound} is loose against the peak {peak}");
        }
    }
}
