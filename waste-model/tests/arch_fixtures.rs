//! The oracle fixtures' logits are the same bits on every architecture:
//! every container the oracle tests use (three Kimi-Linear shapes, two K3
//! shapes), at every position of its prompt, as computed on x86_64 and
//! committed in `tools/oracle/fixtures/oracle-logits-x86_64.json` (a 64-bit
//! FNV-1a digest of each position's f32 bit patterns, plus every bit of the
//! last position so a difference can be located). On aarch64 (NEON or
//! scalar) and x86_64 (any level) the canonical order leaves no bit to
//! differ. Written on x86_64 only, when asked:
//! `WASTE_WRITE_ARCH_FIXTURE=1 cargo test -p waste-model --test arch_fixtures`;
//! rewrite it only when the canonical definition changes on purpose (the
//! oracle tests bound the values independently).

mod common;

use common::fixtures;
use serde_json::Value;

const CONTAINERS: [&str; 5] = ["tiny", "tiny-b", "tiny-c", "tiny-k3", "tiny-k3-4"];

fn fnv1a(bits: &[u32]) -> String {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in bits.iter().flat_map(|v| v.to_le_bytes()) {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// (digest per position, bits of the last position) for one container.
fn run(name: &str) -> (Vec<String>, Vec<u32>) {
    let ids = common::reference(name).ids;
    let m = common::open_fixture(name, 128);
    let mut s = m.session();
    let mut digests = vec![];
    let mut last = vec![];
    for &t in &ids {
        last = s.eval(&[t]).unwrap().iter().map(|v| v.to_bits()).collect();
        digests.push(fnv1a(&last));
    }
    (digests, last)
}

#[test]
fn oracle_fixture_logits_are_bit_identical_across_architectures() {
    let path = fixtures().join("oracle-logits-x86_64.json");
    let got: Vec<(&str, Vec<String>, Vec<u32>)> = CONTAINERS
        .iter()
        .map(|n| {
            let (d, l) = run(n);
            (*n, d, l)
        })
        .collect();
    #[cfg(target_arch = "x86_64")]
    if std::env::var("WASTE_WRITE_ARCH_FIXTURE").is_ok_and(|v| v == "1") {
        use serde_json::json;
        let map: serde_json::Map<String, Value> =
            got.iter().map(|(n, d, l)| (n.to_string(), json!({"digests": d, "last_bits": l}))).collect();
        std::fs::write(&path, serde_json::to_vec(&json!({"arch": "x86_64", "containers": map})).unwrap()).unwrap();
    }
    let want: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    for (name, digests, last) in &got {
        let w = &want["containers"][*name];
        let wd: Vec<String> = serde_json::from_value(w["digests"].clone()).unwrap();
        let wl: Vec<u32> = serde_json::from_value(w["last_bits"].clone()).unwrap();
        assert_eq!(wd.len(), digests.len(), "{name}: positions");
        let diff = wl.iter().zip(last).filter(|(a, b)| a != b).count();
        assert_eq!(diff, 0, "{name}: {diff} of {} last-position logits differ from x86_64", wl.len());
        for (p, (a, b)) in wd.iter().zip(digests).enumerate() {
            assert_eq!(a, b, "{name}: position {p}'s logits differ from x86_64");
        }
    }
}
