//! Opening a container directory: read the manifest and validate it, in
//! total, against the files that hold its data.

use crate::codebook::Codebooks;
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::manifest::{Manifest, MAX_MANIFEST_BYTES};
use crate::record::{ExpertQuant, RecordLayout};
use crate::schema::{required_tensors, Required};
use crate::tensor::{Fmt, TensorInfo};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// A validated expert bank.
#[derive(Clone, Debug)]
pub struct Bank {
    /// Layer index.
    pub layer: usize,
    /// Path of the bank file.
    pub path: PathBuf,
    /// Number of records.
    pub experts: usize,
    /// Index of the layer's first codebook.
    pub codebook_base: usize,
}

impl Bank {
    /// Byte offset of expert `e`'s record.
    pub fn record_offset(&self, e: usize, lay: &RecordLayout) -> u64 {
        e as u64 * lay.rec_bytes as u64
    }
}

/// Whether a trunk tensor belongs to K3's vision tower or projector (their
/// release names, outside the text prefix).
pub fn is_vision_tensor(name: &str) -> bool {
    name.starts_with("vision_tower.") || name.starts_with("mm_projector.")
}

/// Parameter counts the way the C WASTE reports them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParamCounts {
    /// Every weight (trunk + all routed experts).
    pub total: u64,
    /// Per token: trunk without the embedding table + top-k routed experts per MoE layer.
    pub active: u64,
}

/// An opened, validated container (no weights loaded).
#[derive(Clone, Debug)]
pub struct Container {
    /// The container directory.
    pub dir: PathBuf,
    /// The raw manifest.
    pub manifest: Manifest,
    /// The parsed config.
    pub config: ModelConfig,
    /// Expert scheme and record layout (None when the model has no MoE layer).
    pub experts: Option<(ExpertQuant, RecordLayout)>,
    /// Banks by layer (None for dense layers).
    pub banks: Vec<Option<Bank>>,
    /// Validated trunk tensors by full name.
    pub tensors: HashMap<String, TensorInfo>,
    /// Trunk tensors in manifest order (names).
    pub tensor_order: Vec<String>,
    /// Codebooks (empty for F16/BF16 experts).
    pub codebooks: Codebooks,
    /// Size of trunk.bin.
    pub trunk_len: u64,
}

fn file_len(path: &Path) -> Result<u64> {
    std::fs::metadata(path).map(|m| m.len()).map_err(|e| Error::io(path, e))
}

fn plain_file_name(s: &str, key: &str) -> Result<()> {
    let ok = !s.is_empty() && s != "." && s != ".." && !s.contains(['/', '\\', '\0']) && !s.contains(':');
    if ok {
        Ok(())
    } else {
        Err(Error::manifest(key, format!("{s:?} is not a plain file name inside the container")))
    }
}

impl Container {
    /// Open and validate a container directory.
    ///
    /// # Errors
    /// [`Error::Io`] for an unreadable or non-regular `manifest.json`, and every validation error of [`Container::from_manifest`].
    pub fn open(dir: impl AsRef<Path>) -> Result<Container> {
        let dir = dir.as_ref().to_path_buf();
        if dir.is_file() {
            return Err(Error::io(&dir, std::io::Error::new(std::io::ErrorKind::InvalidInput, not_a_container(&dir))));
        }
        let mpath = dir.join("manifest.json");
        let mlen = file_len(&mpath).map_err(|e| match e {
            // a checkpoint given where a container belongs: say so
            Error::Io { source, .. }
                if source.kind() == std::io::ErrorKind::NotFound && dir.join("config.json").is_file() =>
            {
                let msg = "missing: the folder looks like a Hugging Face checkpoint (config.json); \
                           convert it into a container first (`waste convert --src DIR --out DIR.waste`)";
                Error::io(&mpath, std::io::Error::new(std::io::ErrorKind::NotFound, msg))
            }
            e => e,
        })?;
        if mlen > MAX_MANIFEST_BYTES {
            return Err(Error::manifest("manifest.json", format!("{mlen} bytes exceeds {MAX_MANIFEST_BYTES}")));
        }
        let bytes = crate::read_regular(&mpath, MAX_MANIFEST_BYTES).map_err(|e| Error::io(&mpath, e))?;
        let manifest = Manifest::parse(&bytes)?;
        Self::from_manifest(dir, manifest)
    }

    /// Validate an already-parsed manifest against the files in `dir`.
    ///
    /// # Errors
    /// The first validation failure, naming the key, tensor, layer or expert: config, tensor ranges against `trunk.bin`, bank sizes, codebooks.
    pub fn from_manifest(dir: PathBuf, manifest: Manifest) -> Result<Container> {
        let config = ModelConfig::from_json(&manifest.config)?;
        let n_moe = config.n_moe_layers();
        let experts = match (&manifest.expert_quant, n_moe) {
            (_, 0) => None,
            (None, _) => return Err(Error::manifest("expert_quant", "missing (the model has MoE layers)")),
            (Some(q), _) => {
                let q = q.validate()?;
                Some((q, RecordLayout::new(&config, q)?))
            }
        };

        // Codebooks.
        let codebooks = match &experts {
            Some((q, _)) if q.fmt.is_vq() => {
                let p = dir.join("codebooks.bin");
                let len = file_len(&p)?;
                let want_max = (config.layers * q.books_per_layer() + 1) as u64 * Codebooks::record_len(q) as u64;
                if len > want_max {
                    return Err(Error::Codebook {
                        id: 0,
                        msg: format!("codebooks.bin is {len} bytes, more than {want_max} for {} layers", config.layers),
                    });
                }
                let b = crate::read_regular(&p, want_max).map_err(|e| Error::io(&p, e))?;
                Codebooks::parse(&b, q)?
            }
            _ => Codebooks::default(),
        };

        // Banks.
        let mut banks: Vec<Option<Bank>> = vec![None; config.layers];
        for (key, le) in &manifest.layers {
            let k = format!("layers.{key}");
            let l: usize = key
                .parse()
                .ok()
                .filter(|s: &usize| s.to_string() == *key)
                .ok_or_else(|| Error::manifest(&k, "layer key is not a decimal index"))?;
            if l >= config.layers || !config.is_moe(l) {
                return Err(Error::manifest(
                    &k,
                    format!(
                        "layer {l} is not a MoE layer of this model ({} layers, first_k_dense_replace {})",
                        config.layers, config.first_k_dense
                    ),
                ));
            }
            let (q, lay) = experts.as_ref().ok_or_else(|| Error::manifest(&k, "bank without expert_quant"))?;
            plain_file_name(&le.file, &format!("{k}.file"))?;
            if le.experts != config.experts as u64 {
                return Err(Error::Bank {
                    layer: l,
                    msg: format!("{} experts but the config has {}", le.experts, config.experts),
                });
            }
            let want = le
                .experts
                .checked_mul(lay.rec_bytes as u64)
                .ok_or_else(|| Error::Bank { layer: l, msg: "size overflows".into() })?;
            if le.bytes != want {
                return Err(Error::Bank {
                    layer: l,
                    msg: format!(
                        "manifest says {} bytes, {} records of {} need {want}",
                        le.bytes, le.experts, lay.rec_bytes
                    ),
                });
            }
            let path = dir.join(&le.file);
            let flen = file_len(&path)?;
            if flen < want {
                return Err(Error::Bank { layer: l, msg: format!("{} is {flen} bytes, shorter than the {want} the manifest promises (truncated: {} of {} records whole)", le.file, flen / lay.rec_bytes as u64, le.experts) });
            }
            let cb = le.codebook_base;
            if q.fmt.is_vq() && cb.checked_add(q.books_per_layer() as u64).is_none_or(|e| e > codebooks.count as u64) {
                return Err(Error::manifest(
                    format!("{k}.codebook_base"),
                    format!("{cb} + {} books out of range ({} codebooks)", q.books_per_layer(), codebooks.count),
                ));
            }
            banks[l] = Some(Bank { layer: l, path, experts: le.experts as usize, codebook_base: cb as usize });
        }
        for l in config.moe_layers() {
            if banks[l].is_none() {
                return Err(Error::manifest(format!("layers.{l}"), "missing bank for a MoE layer"));
            }
        }

        // Trunk.
        let tpath = dir.join("trunk.bin");
        let trunk_len = file_len(&tpath)?;
        let mut tensors = HashMap::with_capacity(manifest.trunk.len());
        let mut tensor_order = Vec::with_capacity(manifest.trunk.len());
        for t in &manifest.trunk {
            let info = t.validate(trunk_len)?;
            if tensors.insert(t.name.clone(), info).is_some() {
                return Err(Error::tensor(&t.name, "listed twice"));
            }
            tensor_order.push(t.name.clone());
        }
        let c = Container { dir, manifest, config, experts, banks, tensors, tensor_order, codebooks, trunk_len };
        for req in required_tensors(&c.config) {
            c.check_required(&req)?;
        }
        Ok(c)
    }

    fn check_required(&self, req: &Required) -> Result<()> {
        let name = self.full_name(&req.name);
        let t = self.tensors.get(&name).ok_or_else(|| Error::tensor(&name, "missing (the forward pass needs it)"))?;
        if !req.expect.accepts(t.rows, t.cols) {
            return Err(Error::tensor(&name, format!("shape {:?} but the config needs {:?}", t.shape, req.expect)));
        }
        Ok(())
    }

    /// `tensor_prefix + name`.
    pub fn full_name(&self, name: &str) -> String {
        format!("{}{name}", self.manifest.tensor_prefix)
    }

    /// A trunk tensor by name *without* the prefix.
    ///
    /// # Errors
    /// [`Error::Tensor`] when the manifest has no such tensor.
    pub fn tensor(&self, name: &str) -> Result<&TensorInfo> {
        let full = self.full_name(name);
        self.tensors.get(&full).ok_or_else(|| Error::tensor(full, "missing"))
    }

    /// Path of trunk.bin.
    pub fn trunk_path(&self) -> PathBuf {
        self.dir.join("trunk.bin")
    }

    /// Expert layout (errors if the model has no MoE layers).
    pub fn layout(&self) -> Option<&RecordLayout> {
        self.experts.as_ref().map(|(_, l)| l)
    }

    /// Parameter counts (C WASTE convention: routed experts count
    /// 3·moe_intermediate·width each; active = trunk without the embedding
    /// table + top_k experts per MoE layer).
    pub fn param_counts(&self) -> ParamCounts {
        let trunk: u64 = self.tensors.values().map(|t| t.numel() as u64).sum();
        let embed = self.tensor("model.embed_tokens.weight").map(|t| t.numel() as u64).unwrap_or(0);
        let per = self.config.expert_params();
        let n_moe = self.config.n_moe_layers() as u64;
        ParamCounts {
            total: trunk + n_moe * self.config.experts as u64 * per,
            active: trunk - embed + n_moe * self.config.top_k as u64 * per,
        }
    }

    /// Bytes of resident trunk tensors (everything but the embedding table
    /// and the vision tower, which is loaded only with images).
    pub fn resident_trunk_bytes(&self) -> u64 {
        let embed = self.full_name("model.embed_tokens.weight");
        self.tensors.values().filter(|t| t.name != embed && !is_vision_tensor(&t.name)).map(|t| t.stored_bytes()).sum()
    }

    /// A one-line quantization summary, e.g. `experts VQ3R (3.00 bpw); trunk Q4G×60 Q8G×2 F32×40`.
    pub fn quant_summary(&self) -> String {
        let mut counts: Vec<(Fmt, usize)> = Vec::new();
        for n in &self.tensor_order {
            let f = self.tensors[n].fmt;
            match counts.iter_mut().find(|(g, _)| *g == f) {
                Some((_, c)) => *c += 1,
                None => counts.push((f, 1)),
            }
        }
        let trunk: Vec<String> = counts.iter().map(|(f, c)| format!("{}x{c}", f.name())).collect();
        let ex = match &self.experts {
            Some((q, _)) => format!("experts {} ({:.2} bpw)", q.fmt.name(), q.bits_per_weight()),
            None => "no experts".into(),
        };
        format!("{ex}; trunk {}", trunk.join(" "))
    }
}

/// What a file given where a container (a folder) belongs is, and what to
/// do instead: GGUF (llama.cpp's format) and safetensors files are named by
/// their first bytes.
fn not_a_container(path: &Path) -> String {
    let mut head = [0u8; 8];
    let n = std::fs::File::open(path).and_then(|mut f| std::io::Read::read(&mut f, &mut head)).unwrap_or(0);
    let convert = "convert the model's Hugging Face folder (config.json, *.safetensors) with \
                   `waste convert --src HF_DIR --out MODEL.waste`";
    if n >= 4 && &head[..4] == b"GGUF" {
        format!("a GGUF file (llama.cpp's format), not a WASTE container (a folder with manifest.json): {convert}")
    } else if n == 8 && u64::from_le_bytes(head) < 100 << 20 && path.extension().is_some_and(|e| e == "safetensors") {
        format!("a safetensors file, not a WASTE container (a folder with manifest.json): {convert}")
    } else {
        format!("a file, not a WASTE container (a folder with manifest.json); to use a model from elsewhere, {convert}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A folder without `manifest.json` is an I/O error naming it; when it
    /// holds a `config.json` (a checkpoint given where a container
    /// belongs) the error says so and how to convert it.
    #[test]
    fn a_checkpoint_folder_is_named_as_one() {
        let d = std::env::temp_dir().join(format!("waste-not-a-container-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let e = Container::open(&d).err().unwrap().to_string();
        assert!(e.contains("manifest.json") && !e.contains("Hugging Face"), "{e}");
        std::fs::write(d.join("config.json"), "{}").unwrap();
        let e = Container::open(&d).err().unwrap().to_string();
        assert!(e.contains("looks like a Hugging Face checkpoint") && e.contains("waste convert"), "{e}");
        std::fs::remove_dir_all(&d).ok();
    }
}
