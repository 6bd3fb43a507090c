//! Reading source tensors by their container names: the spellings come from
//! the config's architecture family (`waste_format::arch`); the fused
//! forms (one `conv1d` over q|k|v, `experts.gate_up_proj`) are split here.

use crate::source::Source;
use crate::{Error, Result};
use waste_format::ModelConfig;

/// Read the container tensor `name` (without prefix) from the source,
/// trying each of the config's family's spellings
/// ([`waste_format::Architecture::source_names`]); returns `(shape, values)`.
pub fn read(src: &Source, prefix: &str, name: &str, cfg: &ModelConfig) -> Result<(Vec<usize>, Vec<f32>)> {
    let conv_kernel = cfg.conv_kernel;
    for cand in (cfg.family.def().source_names)(name) {
        for p in [prefix, ""] {
            let full = format!("{p}{cand}");
            if src.has(&full) || src.has(&full.replace(".weight", ".weight_packed")) {
                return src.read_f32(&full);
            }
        }
    }
    // one conv1d over q|k|v (transformers' in-memory form)
    for (part, x) in [("q_conv1d", 0), ("k_conv1d", 1), ("v_conv1d", 2)] {
        if let Some(base) = name.strip_suffix(&format!("{part}.weight")) {
            for p in [prefix, ""] {
                let fused = format!("{p}{base}conv1d.weight");
                if src.has(&fused) {
                    let (shape, v) = src.read_f32(&fused)?;
                    let c3 = shape.first().copied().unwrap_or(0);
                    if c3 == 0 || c3 % 3 != 0 || v.len() % c3 != 0 {
                        return Err(Error::Source(format!("{fused}: shape {shape:?} is not [3·channels, 1, kernel]")));
                    }
                    let c = c3 / 3;
                    let per = v.len() / c3;
                    if per != conv_kernel {
                        return Err(Error::Source(format!("{fused}: kernel {per}, config says {conv_kernel}")));
                    }
                    return Ok((vec![c, 1, per], v[x * c * per..(x + 1) * c * per].to_vec()));
                }
            }
        }
    }
    Err(Error::Source(format!("tensor {prefix}{name} not found (tried the release's and transformers' names)")))
}

/// Read routed expert `e` of layer `l`: `(w1 gate, w3 up, w2 down)`, each `(rows, cols, values)`.
#[allow(clippy::type_complexity)]
pub fn read_expert(src: &Source, prefix: &str, l: usize, e: usize) -> Result<[(usize, usize, Vec<f32>); 3]> {
    let mut out: Vec<(usize, usize, Vec<f32>)> = Vec::with_capacity(3);
    for (w, alias) in [("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")] {
        let mut found = None;
        'outer: for p in [prefix, ""] {
            for moe in ["block_sparse_moe", "mlp"] {
                for n in [w, alias] {
                    let full = format!("{p}model.layers.{l}.{moe}.experts.{e}.{n}.weight");
                    if src.has(&full) || src.has(&full.replace(".weight", ".weight_packed")) {
                        let (shape, v) = src.read_f32(&full)?;
                        let [r, c] = shape[..] else {
                            return Err(Error::Source(format!("{full}: shape {shape:?}, an expert matrix is 2-D")));
                        };
                        found = Some((r, c, v));
                        break 'outer;
                    }
                }
            }
        }
        if found.is_none() {
            // transformers' fused in-memory form: gate_up_proj [E, 2I, H], down_proj [E, H, I]
            for p in [prefix, ""] {
                for moe in ["mlp", "block_sparse_moe"] {
                    let fused = if w == "w2" {
                        format!("{p}model.layers.{l}.{moe}.experts.down_proj")
                    } else {
                        format!("{p}model.layers.{l}.{moe}.experts.gate_up_proj")
                    };
                    if let Some(loc) = src.loc(&fused) {
                        let (ne, rows, cols) = (loc.shape[0], loc.shape[1], loc.shape[2]);
                        if e >= ne {
                            return Err(Error::Source(format!("{fused}: expert {e} of {ne}")));
                        }
                        // only this expert's (half) slice is read
                        let base = e * rows * cols;
                        found = Some(match w {
                            "w1" => (rows / 2, cols, src.read_f32_range(&fused, base, rows / 2 * cols)?),
                            "w3" => {
                                (rows / 2, cols, src.read_f32_range(&fused, base + rows / 2 * cols, rows / 2 * cols)?)
                            }
                            _ => (rows, cols, src.read_f32_range(&fused, base, rows * cols)?),
                        });
                    }
                }
            }
        }
        out.push(found.ok_or_else(|| Error::Source(format!("expert {e} of layer {l}: no {w}/{alias} weights")))?);
    }
    let mut it = out.into_iter();
    Ok([it.next().expect("w1"), it.next().expect("w3"), it.next().expect("w2")])
}
