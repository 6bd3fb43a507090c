//! Tidy checks: one-way crate dependencies, a README per crate, and a tree
//! that stands alone (no source reads data from outside the repository).

use anyhow::{bail, Result};
use std::path::Path;

/// Layer of each crate: a crate may depend only on crates of a lower layer.
pub const LAYERS: &[(&str, u8)] = &[
    ("waste-format", 0),
    ("waste-io", 0),
    ("waste-rng", 0),
    ("waste-quant", 1),
    ("waste-attn", 2),
    ("waste-moe", 2),
    ("waste-cache", 1),
    ("waste-synth", 2),
    ("waste-tokenizer", 2),
    ("waste-vision", 2),
    ("waste-sandbox", 3),
    ("waste-model", 3),
    ("waste-convert", 4),
    ("waste-grammar", 3),
    ("waste-serve", 5),
    ("waste-capi", 5),
    ("waste-cli", 6),
    ("xtask", 7),
];

fn layer(name: &str) -> Option<u8> {
    LAYERS.iter().find(|(n, _)| *n == name).map(|(_, l)| *l)
}

/// Problems found in the tree (empty = tidy).
pub fn problems(root: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for (krate, lv) in LAYERS {
        let dir = root.join(krate);
        if !dir.join("README.md").exists() {
            out.push(format!("{krate}: missing README.md"));
        }
        let Ok(toml) = std::fs::read_to_string(dir.join("Cargo.toml")) else {
            out.push(format!("{krate}: missing Cargo.toml"));
            continue;
        };
        for line in toml.lines() {
            let dep = line.split(['.', ' ', '=']).next().unwrap_or("").trim();
            if let Some(dl) = layer(dep) {
                if dep != *krate && dl >= *lv {
                    out.push(format!(
                        "{krate} (layer {lv}) depends on {dep} (layer {dl}): dependencies must point down"
                    ));
                }
            }
        }
    }
    out.extend(outside_reads(root));
    out
}

/// Source files that name a path outside the repository (`../shared`, the
/// workplace's data folder): a clone must test itself with `testdata/` alone.
fn outside_reads(root: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&dir) else { continue };
        for e in rd.flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if p.is_dir() {
                if !matches!(name.as_str(), "target" | ".git" | "docs" | "testdata" | "corpus" | "artifacts") {
                    stack.push(p);
                }
            } else if [".rs", ".py", ".sh", ".toml"].iter().any(|x| name.ends_with(x)) || name == "run" {
                let text = std::fs::read_to_string(&p).unwrap_or_default();
                // the needle is split so this file does not find itself
                let needle = format!("{}/{}", "shared", "data");
                if text.contains(&needle) {
                    out.push(format!("{}: reads {needle} outside the repository (use testdata/)", p.display()));
                }
            }
        }
    }
    out
}

/// Fail if the tree is not tidy.
pub fn run(root: &Path) -> Result<()> {
    let p = problems(root);
    if !p.is_empty() {
        bail!("tidy:\n  {}", p.join("\n  "));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn tree_is_tidy() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        assert_eq!(super::problems(root), Vec::<String>::new());
    }
}
