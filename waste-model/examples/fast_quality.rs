//! The `fast` numeric mode's quality contract on a container too large for
//! a committed fixture (issue 50: the 3-layer Kimi-Linear-48B slice):
//!
//!     cargo run --release -p waste-model --example fast_quality -- CONTAINER REFERENCE_DIR
//!
//! `REFERENCE_DIR` holds `ids.json` (the teacher-forced ids) and
//! `logits.f32` (the reference's logits, little-endian f32, one row of the
//! vocabulary per id), as tools/oracle/make_fast_quality_48b.py writes them
//! from transformers. Prints each mode's agreement as JSON and exits 1 when
//! `fast` misses the contract or the 4-bit control meets it (then the
//! configuration cannot tell).

use std::path::PathBuf;
use waste_model::quality::{agreement, kl, meets, read_reference};
use waste_model::{Model, ModelOptions, Numeric};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let (Some(container), Some(refdir)) = (args.get(1), args.get(2)) else {
        return Err("usage: fast_quality CONTAINER REFERENCE_DIR".into());
    };
    let (ids, want) = read_reference(&PathBuf::from(refdir))?;
    let vocab = want[0].len();
    let run = |numeric: Numeric| -> Result<Vec<Vec<f32>>, waste_model::Error> {
        let opts = ModelOptions {
            ctx: ids.len().next_power_of_two().max(64),
            numeric: Some(numeric),
            ..ModelOptions::exact()
        };
        let m = Model::open(std::path::Path::new(container), opts)?;
        let mut s = m.session();
        ids.iter().map(|&t| s.eval(&[t]).map(|l| l.to_vec())).collect()
    };
    let (exact, fast, control) = (run(Numeric::Exact)?, run(Numeric::Fast)?, run(Numeric::Control4)?);
    let (e, f, c) = (agreement(&want, &exact), agreement(&want, &fast), agreement(&want, &control));
    let between = exact.iter().zip(&fast).map(|(a, b)| kl(a, b)).sum::<f64>() / ids.len() as f64;
    let (ok, control_fails) = (meets(&f, &e), !meets(&c, &e));
    println!(
        "{}",
        serde_json::json!({
            "positions": ids.len(), "vocab": vocab,
            "exact": {"kl": e.kl, "top1_percent": e.top1},
            "fast": {"kl": f.kl, "kl_ratio": f.kl / e.kl, "top1_percent": f.top1},
            "control_4_bit": {"kl": c.kl, "kl_ratio": c.kl / e.kl, "top1_percent": c.top1},
            "kl_exact_fast": between,
            "fast_meets_contract": ok, "control_fails_contract": control_fails,
        })
    );
    if !(ok && control_fails) {
        std::process::exit(1);
    }
    Ok(())
}
