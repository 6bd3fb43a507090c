//! The fuzz targets' code paths as proptests: mutated copies of the C
//! WASTE's anchor manifest (byte flips, truncation, spliced numbers) must
//! open or fail with an error, never panic.

use proptest::prelude::*;
use std::path::{Path, PathBuf};

fn anchor() -> PathBuf {
    let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata");
    base.join("anchor-tiny/kimi-linear-tiny.waste")
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    #[test]
    fn mutated_manifest_never_panics(flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6), cut in any::<prop::sample::Index>(), truncate in any::<bool>()) {
        let mut b = std::fs::read(anchor().join("manifest.json")).unwrap();
        for (i, v) in flips {
            let i = i.index(b.len());
            b[i] = v;
        }
        if truncate {
            b.truncate(cut.index(b.len()));
        }
        if let Ok(m) = waste_format::Manifest::parse(&b) {
            let _ = waste_format::Container::from_manifest(anchor(), m);
        }
    }

    #[test]
    fn mutated_digits_never_panic(pos in any::<prop::sample::Index>(), digits in "[0-9]{1,25}") {
        // splice a long number into the manifest at a digit position: huge dims and offsets
        let s = std::fs::read_to_string(anchor().join("manifest.json")).unwrap();
        let idx: Vec<usize> = s.char_indices().filter(|(_, c)| c.is_ascii_digit()).map(|(i, _)| i).collect();
        let i = idx[pos.index(idx.len())];
        let m = format!("{}{}{}", &s[..i], digits, &s[i + 1..]);
        if let Ok(m) = waste_format::Manifest::parse(m.as_bytes()) {
            let _ = waste_format::Container::from_manifest(anchor(), m);
        }
    }
}
