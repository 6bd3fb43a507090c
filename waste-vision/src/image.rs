//! Images in: the header read first (format, size — a decompression bomb
//! is refused with its figures before a pixel is decoded), then decoding
//! (PNG, JPEG, WebP, GIF's first frame) with the `image` crate under an
//! allocation cap, the patch grid, bilinear resampling and normalisation
//! into the tower's patch rows (MODEL.md, "Vision: the details").

use crate::config::{VisionConfig, PATCH, PATCH_VALUES};
use crate::{Error, Result};
use image::{ImageFormat, ImageReader};
use std::io::Cursor;

/// The largest encoded image accepted (bytes).
pub const MAX_FILE_BYTES: usize = 64 << 20;
/// The most pixels an image may declare (50 megapixels: an 8660×5773
/// photo); checked from the header before decoding.
pub const MAX_PIXELS: u64 = 50_000_000;
/// The most the decoder may allocate.
pub const MAX_DECODE_ALLOC: u64 = 512 << 20;
/// The widest aspect ratio accepted (longer side : shorter side).
pub const MAX_ASPECT: u64 = 200;

/// What the header says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImageInfo {
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
    /// Container format name (`png`, `jpeg`, `webp`, `gif`).
    pub format: &'static str,
}

/// The patch grid an image is cut into: `gw × gh` patches of 14×14.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grid {
    /// Patches across.
    pub gw: usize,
    /// Patches down.
    pub gh: usize,
}

impl Grid {
    /// Patches in the grid.
    pub fn patches(&self) -> usize {
        self.gw * self.gh
    }
    /// Sequence positions after the 2×2 merge.
    pub fn positions(&self) -> usize {
        (self.gw / 2) * (self.gh / 2)
    }
}

/// An image ready for the tower: normalised patches, row-major, each laid
/// out `[channel][y][x]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Pixels {
    /// The image file's own size (before any resize).
    pub width: u32,
    /// Height of the file's image.
    pub height: u32,
    /// Its patch grid.
    pub grid: Grid,
    /// `grid.patches() × 588` values.
    pub patches: Vec<f32>,
}

fn format_name(f: ImageFormat) -> Option<&'static str> {
    match f {
        ImageFormat::Png => Some("png"),
        ImageFormat::Jpeg => Some("jpeg"),
        ImageFormat::WebP => Some("webp"),
        ImageFormat::Gif => Some("gif"),
        _ => None,
    }
}

fn guessed(bytes: &[u8]) -> Result<(ImageReader<Cursor<&[u8]>>, ImageFormat)> {
    if bytes.is_empty() {
        return Err(Error::Image("empty image data".into()));
    }
    if bytes.len() > MAX_FILE_BYTES {
        return Err(Error::Image(format!(
            "{} bytes of image data exceed the {MAX_FILE_BYTES}-byte limit",
            bytes.len()
        )));
    }
    let r = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| Error::Image(format!("reading the image header: {e}")))?;
    let head: Vec<String> = bytes.iter().take(8).map(|b| format!("{b:02x}")).collect();
    match r.format() {
        Some(f) if format_name(f).is_some() => Ok((r, f)),
        Some(f) => Err(Error::Image(format!("{f:?} images are not supported (PNG, JPEG, WebP or GIF)"))),
        None => {
            Err(Error::Image(format!("not a PNG, JPEG, WebP or GIF image (the data starts with {})", head.join(" "))))
        }
    }
}

/// Check a header's size against the limits (zero, pixel count, aspect).
fn check_size(w: u32, h: u32) -> Result<()> {
    if w == 0 || h == 0 {
        return Err(Error::Image(format!("the image is {w}x{h}: it has no pixels")));
    }
    let px = w as u64 * h as u64;
    if px > MAX_PIXELS {
        return Err(Error::Image(format!(
            "the image is {w}x{h} = {px} pixels, above the {MAX_PIXELS}-pixel limit (refused before decoding)"
        )));
    }
    let (lo, hi) = (w.min(h) as u64, w.max(h) as u64);
    if hi > lo * MAX_ASPECT {
        return Err(Error::Image(format!("the image is {w}x{h}: its aspect ratio is above {MAX_ASPECT}:1")));
    }
    Ok(())
}

/// Read only the header: format and size, checked against the limits.
///
/// # Errors
/// [`Error::Image`] for empty or oversized data, an unknown or unsupported
/// format (naming the first bytes), an unreadable header, a zero side, more
/// than [`MAX_PIXELS`] pixels or an aspect ratio above [`MAX_ASPECT`]:1.
pub fn probe(bytes: &[u8]) -> Result<ImageInfo> {
    let (r, f) = guessed(bytes)?;
    let (width, height) = r.into_dimensions().map_err(|e| Error::Image(format!("reading the image header: {e}")))?;
    check_size(width, height)?;
    Ok(ImageInfo { width, height, format: format_name(f).unwrap_or("?") })
}

/// The patch grid for a `w × h` image (MODEL.md): scale so at most
/// `max_patches` 14-pixel patches fit (never up), round each side to whole
/// patches, at least 2, even; then take 2 from the longer side while the
/// grid is over budget (and over `side_limit` on one side).
///
/// # Errors
/// [`Error::Image`] for a zero side.
pub fn grid(cfg: &VisionConfig, w: u32, h: u32) -> Result<Grid> {
    if w == 0 || h == 0 {
        return Err(Error::Image(format!("the image is {w}x{h}: it has no pixels")));
    }
    let (wf, hf) = (w as f64, h as f64);
    let p = PATCH as f64;
    let s = (cfg.max_patches as f64 / (wf * hf / (p * p))).sqrt().min(1.0);
    let side = |x: f64| -> usize {
        let n = ((x * s / p + 0.5).floor() as usize).max(2);
        n & !1
    };
    let (mut gw, mut gh) = (side(wf), side(hf));
    if let Some(l) = cfg.side_limit {
        let l = (l & !1).max(2);
        gw = gw.min(l);
        gh = gh.min(l);
    }
    // bounded: each turn takes 2 from a side that is above 2
    while gw * gh > cfg.max_patches && (gw > 2 || gh > 2) {
        if gw >= gh {
            gw -= 2;
        } else {
            gh -= 2;
        }
    }
    Ok(Grid { gw, gh })
}

/// Most bytes [`preprocess`] holds at once for an image with this header
/// (a bound, summed rather than peaked): the decoder's buffer (at most 8
/// bytes a pixel — 16-bit RGBA — and at most [`MAX_DECODE_ALLOC`]), its
/// 8-bit RGB copy, the resampled f32 image and the patches. A 1 KB PNG can
/// declare 50 M pixels, so a server reserves this before decoding.
///
/// # Errors
/// As [`grid`].
pub fn preprocess_bytes(cfg: &VisionConfig, info: &ImageInfo) -> Result<u64> {
    // probe bounds the pixels (MAX_PIXELS), so none of this overflows
    let px = u64::from(info.width) * u64::from(info.height);
    Ok(held_bytes(px, grid(cfg, info.width, info.height)?.patches() as u64))
}

/// The most [`preprocess_bytes`] gives for any image [`probe`] accepts
/// ([`MAX_PIXELS`] pixels, a grid of at most `max(max_patches, 4)` patches):
/// what a plan reserves so that decoding the largest accepted image stays
/// inside the budget.
pub fn max_preprocess_bytes(cfg: &VisionConfig) -> u64 {
    held_bytes(MAX_PIXELS, cfg.max_patches.max(4) as u64)
}

/// What [`preprocess`] holds for `px` pixels cut into `patches` patches:
/// the decoder's buffer (at most 8 bytes a pixel, at most
/// [`MAX_DECODE_ALLOC`]), its RGB copy, the resampled f32 image (one
/// `PATCH × PATCH` RGB square a patch) and the patches.
fn held_bytes(px: u64, patches: u64) -> u64 {
    let resampled = patches * (PATCH * PATCH) as u64 * 3 * 4;
    (8 * px).min(MAX_DECODE_ALLOC) + 3 * px + resampled + patches * PATCH_VALUES as u64 * 4
}

/// Decode an image and cut it into the tower's normalised patches.
///
/// # Errors
/// Every [`probe`] error, then [`Error::Image`] when decoding fails
/// (truncated or damaged data — the decoder's message) or would allocate
/// more than [`MAX_DECODE_ALLOC`].
pub fn preprocess(cfg: &VisionConfig, bytes: &[u8]) -> Result<Pixels> {
    let info = probe(bytes)?;
    let (mut r, _) = guessed(bytes)?;
    let mut lim = image::Limits::default();
    lim.max_image_width = Some(info.width);
    lim.max_image_height = Some(info.height);
    lim.max_alloc = Some(MAX_DECODE_ALLOC);
    r.limits(lim);
    let img = r.decode().map_err(|e| Error::Image(format!("decoding the {} image: {e}", info.format)))?;
    if (img.width(), img.height()) != (info.width, info.height) {
        return Err(Error::Image(format!(
            "the {} header says {}x{} but the decoded image is {}x{}",
            info.format,
            info.width,
            info.height,
            img.width(),
            img.height()
        )));
    }
    // 3 channels: alpha dropped (not composited), grey replicated
    let rgb = img.to_rgb8();
    drop(img);
    from_rgb8(cfg, info.width, info.height, rgb.as_raw())
}

/// Cut decoded 8-bit RGB pixels (`w × h × 3`, row-major) into normalised
/// patches: bilinear resampling with half-pixel centres to 14·gw × 14·gh
/// (none when the image already has that size), then `(v/255 − mean)/std`.
///
/// # Errors
/// [`Error::Image`] when `rgb` is not `w·h·3` bytes or a side is zero.
pub fn from_rgb8(cfg: &VisionConfig, w: u32, h: u32, rgb: &[u8]) -> Result<Pixels> {
    let (wu, hu) = (w as usize, h as usize);
    if wu.checked_mul(hu).and_then(|n| n.checked_mul(3)) != Some(rgb.len()) {
        return Err(Error::Image(format!("{} bytes are not {w}x{h} RGB pixels", rgb.len())));
    }
    let g = grid(cfg, w, h)?;
    let (ow, oh) = (g.gw * PATCH, g.gh * PATCH);
    let src = |c: usize, y: usize, x: usize| rgb[(y * wu + x) * 3 + c] as f32;
    // resampled image, [channel][y][x]
    let mut img = vec![0f32; 3 * ow * oh];
    if (ow, oh) == (wu, hu) {
        for c in 0..3 {
            for y in 0..oh {
                for x in 0..ow {
                    img[(c * oh + y) * ow + x] = src(c, y, x);
                }
            }
        }
    } else {
        let xs = taps(wu, ow);
        let ys = taps(hu, oh);
        for c in 0..3 {
            for (y, &(y0, y1, wy)) in ys.iter().enumerate() {
                for (x, &(x0, x1, wx)) in xs.iter().enumerate() {
                    let top = (1.0 - wx) * src(c, y0, x0) + wx * src(c, y0, x1);
                    let bot = (1.0 - wx) * src(c, y1, x0) + wx * src(c, y1, x1);
                    img[(c * oh + y) * ow + x] = (1.0 - wy) * top + wy * bot;
                }
            }
        }
    }
    let mut patches = vec![0f32; g.patches() * PATCH_VALUES];
    for py in 0..g.gh {
        for px in 0..g.gw {
            let p = &mut patches[(py * g.gw + px) * PATCH_VALUES..][..PATCH_VALUES];
            for c in 0..3 {
                for y in 0..PATCH {
                    for x in 0..PATCH {
                        let v = img[(c * oh + py * PATCH + y) * ow + px * PATCH + x];
                        p[(c * PATCH + y) * PATCH + x] = (v / 255.0 - cfg.mean[c]) / cfg.std[c];
                    }
                }
            }
        }
    }
    Ok(Pixels { width: w, height: h, grid: g, patches })
}

/// Bilinear taps with half-pixel centres (`align_corners=False`, as
/// PyTorch's `interpolate`): for each output index, the two source indices
/// and the weight of the second, the source coordinate
/// `(i + 0.5)·(n_in/n_out) − 0.5` clamped at the edges.
pub(crate) fn taps(n_in: usize, n_out: usize) -> Vec<(usize, usize, f32)> {
    let scale = n_in as f32 / n_out as f32;
    (0..n_out)
        .map(|i| {
            let f = ((i as f32 + 0.5) * scale - 0.5).max(0.0);
            let i0 = (f.floor() as usize).min(n_in - 1);
            let i1 = (i0 + 1).min(n_in - 1);
            (i0, i1, f - i0 as f32)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cfg(max: usize) -> VisionConfig {
        VisionConfig::from_json(
            &json!({"vt_hidden_size": 32, "vt_num_attention_heads": 2, "qkv_hidden_size": 32, "text_hidden_size": 16,
                    "media_placeholder_token_id": 1, "max_patches": max}),
            16,
            4,
        )
        .unwrap()
    }

    #[test]
    fn no_accepted_header_bounds_more_than_the_largest_bound() {
        // the largest pixel counts at the aspect extremes and square, at
        // small and large patch budgets
        for max in [4, 64, 1024, 4096] {
            let c = cfg(max);
            let top = max_preprocess_bytes(&c);
            let side = (MAX_PIXELS as f64).sqrt() as u32;
            let long = ((MAX_PIXELS * MAX_ASPECT) as f64).sqrt() as u32;
            let short = (MAX_PIXELS / u64::from(long)) as u32;
            for (w, h) in [(side, side), (long, short), (short, long), (1, 1), (2, 1)] {
                let info = ImageInfo { format: "png", width: w, height: h };
                if let Ok(b) = preprocess_bytes(&c, &info) {
                    assert!(b <= top, "{w}x{h} at {max} patches: {b} > {top}");
                }
            }
            // and it is reached: the square at the pixel limit fills the
            // patch budget (an even square side), short only by its pixels
            let px = u64::from(side) * u64::from(side);
            let info = ImageInfo { format: "png", width: side, height: side };
            let short_by =
                (8 * MAX_PIXELS).min(MAX_DECODE_ALLOC) - (8 * px).min(MAX_DECODE_ALLOC) + 3 * (MAX_PIXELS - px);
            assert_eq!(top - preprocess_bytes(&c, &info).unwrap(), short_by, "{max} patches");
        }
    }

    fn png(w: u32, h: u32) -> Vec<u8> {
        let mut out = Vec::new();
        let img =
            image::RgbImage::from_fn(w, h, |x, y| image::Rgb([(x * 7) as u8, (y * 5) as u8, ((x + y) * 3) as u8]));
        img.write_to(&mut Cursor::new(&mut out), ImageFormat::Png).unwrap();
        out
    }

    #[test]
    fn grid_follows_the_rule() {
        let c = cfg(1024);
        // already whole patches within budget
        assert_eq!(grid(&c, 56, 28).unwrap(), Grid { gw: 4, gh: 2 });
        // small images grow to 2 patches a side, odd counts round down to even
        assert_eq!(grid(&c, 5, 5).unwrap(), Grid { gw: 2, gh: 2 });
        assert_eq!(grid(&c, 14 * 7, 14 * 3).unwrap(), Grid { gw: 6, gh: 2 });
        // large: the budget binds, aspect kept
        let g = grid(&c, 4000, 3000).unwrap();
        assert!(g.patches() <= 1024 && g.gw.is_multiple_of(2) && g.gh.is_multiple_of(2), "{g:?}");
        assert!((g.gw as f64 / g.gh as f64 - 4.0 / 3.0).abs() < 0.1, "{g:?}");
        // a very long strip ends within budget (the loop takes from the long side)
        let g = grid(&cfg(64), 10, 1990).unwrap();
        assert!(g.patches() <= 64 && g.gw == 2, "{g:?}");
    }

    #[test]
    fn taps_match_half_pixel_bilinear() {
        // same size: identity
        assert!(taps(5, 5).iter().enumerate().all(|(i, &(a, _, w))| a == i && w == 0.0));
        // 2 → 4: source (i+0.5)/2 − 0.5 = −0.25 (clamped 0), 0.25, 0.75, 1.25 (edge)
        let t = taps(2, 4);
        assert_eq!(t[0], (0, 1, 0.0));
        assert_eq!(t[1], (0, 1, 0.25));
        assert_eq!(t[2], (0, 1, 0.75));
        assert_eq!(t[3], (1, 1, 0.25));
    }

    #[test]
    fn exact_size_is_not_resampled_and_is_normalised() {
        let c = cfg(1024);
        let p = preprocess(&c, &png(28, 28)).unwrap();
        assert_eq!(p.grid, Grid { gw: 2, gh: 2 });
        // patch (0,1), channel 0, y 3, x 5 is source pixel x = 19, y = 3: red = 19·7
        let v = p.patches[PATCH_VALUES + 3 * PATCH + 5];
        assert_eq!(v, ((19 * 7) as f32 / 255.0 - 0.5) / 0.5);
        // channel 2 of patch (1,0) at y 0, x 0: pixel (0, 14): (0+14)·3
        let v = p.patches[2 * PATCH_VALUES + 2 * PATCH * PATCH];
        assert_eq!(v, ((14 * 3) as f32 / 255.0 - 0.5) / 0.5);
    }

    /// A 1x1 PNG whose header claims `w × h` (IHDR CRC recomputed, so only the size lies).
    fn png_claiming(w: u32, h: u32) -> Vec<u8> {
        let mut b = png(1, 1);
        b[16..20].copy_from_slice(&w.to_be_bytes());
        b[20..24].copy_from_slice(&h.to_be_bytes());
        let crc = crc32fast::hash(&b[12..29]);
        b[29..33].copy_from_slice(&crc.to_be_bytes());
        b
    }

    #[test]
    fn hostile_images_get_precise_errors() {
        let c = cfg(1024);
        let good = png(30, 20);
        let e = |b: &[u8]| preprocess(&c, b).unwrap_err().to_string();
        assert!(e(&good[..good.len() / 2]).contains("decoding the png image"), "{}", e(&good[..good.len() / 2]));
        assert!(e(b"GIF89a").contains("header") || e(b"GIF89a").contains("decoding"), "{}", e(b"GIF89a"));
        assert!(e(b"hello world, not an image").contains("not a PNG, JPEG, WebP or GIF"));
        assert!(e(b"").contains("empty"));
        // a header claiming 60000x60000 (the IHDR is all a header read needs)
        let m = e(&png_claiming(60000, 60000));
        assert!(m.contains("60000x60000 = 3600000000 pixels"), "{m}");
        let m = e(&png_claiming(0, 1));
        assert!(m.contains("0x1") || m.contains("header"), "{m}");
        let m = e(&png_claiming(1, 100000));
        assert!(m.contains("1x100000") && m.contains("aspect ratio"), "{m}");
    }

    #[test]
    fn from_rgb8_checks_its_length() {
        assert!(from_rgb8(&cfg(64), 2, 2, &[0; 11]).is_err());
    }
}

#[cfg(test)]
mod fuzz_twin {
    //! The `image` fuzz target's twin: mutated PNG/GIF/JPEG/WebP bytes give
    //! an error or well-formed pixels, never a panic.
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn seeds() -> Vec<Vec<u8>> {
        let img = image::RgbaImage::from_fn(19, 11, |x, y| image::Rgba([x as u8 * 9, y as u8 * 20, 7, 200]));
        [ImageFormat::Png, ImageFormat::Gif, ImageFormat::Jpeg, ImageFormat::WebP]
            .into_iter()
            .filter_map(|f| {
                let mut out = Vec::new();
                let dynimg = if f == ImageFormat::Jpeg {
                    image::DynamicImage::ImageRgb8(image::DynamicImage::ImageRgba8(img.clone()).to_rgb8())
                } else {
                    image::DynamicImage::ImageRgba8(img.clone())
                };
                dynimg.write_to(&mut Cursor::new(&mut out), f).ok().map(|_| out)
            })
            .collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn mutated_images_never_panic(which in 0usize..4, flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..8), cut in any::<usize>()) {
            let cfg = VisionConfig::from_json(&json!({"vt_hidden_size": 32, "vt_num_attention_heads": 2, "qkv_hidden_size": 32,
                "text_hidden_size": 16, "media_placeholder_token_id": 1, "max_patches": 256}), 16, 4).unwrap();
            let s = seeds();
            let mut b = s[which % s.len()].clone();
            for (at, v) in flips {
                let n = b.len();
                b[at % n] ^= v;
            }
            b.truncate(cut % (b.len() + 1));
            if let Ok(p) = preprocess(&cfg, &b) {
                prop_assert_eq!(p.patches.len(), p.grid.patches() * PATCH_VALUES);
                prop_assert!(p.patches.iter().all(|v| v.is_finite()));
            }
        }
    }

    #[test]
    fn every_format_decodes() {
        let cfg = VisionConfig::from_json(
            &json!({"vt_hidden_size": 32, "vt_num_attention_heads": 2, "qkv_hidden_size": 32,
            "text_hidden_size": 16, "media_placeholder_token_id": 1}),
            16,
            4,
        )
        .unwrap();
        let s = seeds();
        assert_eq!(s.len(), 4, "png, gif, jpeg and webp seeds");
        for b in &s {
            let p = preprocess(&cfg, b).unwrap();
            assert_eq!((p.width, p.height), (19, 11));
        }
    }
}
