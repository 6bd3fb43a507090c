//! `Model`: an opened container with its trunk resident.

use crate::weights::{load_layers, load_output_res, Embedding, Layer, TrunkReader};
use crate::{Error, Result};
use std::path::Path;
use std::sync::Arc;
use waste_format::Container;
use waste_io::DirectFile;
use waste_moe::ExpertKernel;
use waste_quant::{Level, Matrix, Pool};

/// How to open a model.
#[derive(Clone, Debug)]
pub struct ModelOptions {
    /// Context bound in tokens (MLA caches are sized for it).
    pub ctx: usize,
    /// Compute threads (0 = all cores).
    pub threads: usize,
    /// Bypass the page cache for expert reads.
    pub direct_io: bool,
    /// Check every expert record's CRC on read (a pass per read).
    pub verify_records: bool,
    /// Force a SIMD level (None = the process default, `WASTE_SIMD` aware).
    pub simd: Option<Level>,
}

impl Default for ModelOptions {
    fn default() -> Self {
        ModelOptions { ctx: 4096, threads: 0, direct_io: true, verify_records: std::env::var_os("WASTE_VERIFY").is_some_and(|v| v == "1"), simd: None }
    }
}

/// An opened model: trunk resident, experts on disk.
pub struct Model {
    /// The validated container.
    pub container: Container,
    pub(crate) layers: Vec<Layer>,
    pub(crate) embed: Embedding,
    pub(crate) final_norm: Vec<f32>,
    pub(crate) lm_head: Matrix,
    pub(crate) out_res: Option<Vec<f32>>,
    pub(crate) banks: Vec<Option<Arc<DirectFile>>>,
    pub(crate) kernel: Option<ExpertKernel>,
    pub(crate) pool: Pool,
    pub(crate) opts: ModelOptions,
    trunk_bytes: u64,
}

impl Model {
    /// Open a container: validate everything, load the resident trunk.
    pub fn open(path: impl AsRef<Path>, opts: ModelOptions) -> Result<Model> {
        Self::open_with_progress(path, opts, &|_, _| {})
    }

    /// [`Model::open`] with a progress callback `(layers loaded, layers)`.
    pub fn open_with_progress(path: impl AsRef<Path>, opts: ModelOptions, progress: &dyn Fn(usize, usize)) -> Result<Model> {
        let container = Container::open(path.as_ref())?;
        if opts.ctx == 0 {
            return Err(Error::Arg("ctx must be at least 1 token".into()));
        }
        let threads = if opts.threads == 0 { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) } else { opts.threads };
        let level = match opts.simd {
            Some(l) if !l.supported() => return Err(Error::Unsupported(format!("SIMD level {} on this CPU", l.name()))),
            Some(l) => l,
            None => waste_quant::level(),
        };
        let mut r = TrunkReader::new(&container)?;
        let layers = load_layers(&container, &mut r, progress)?;
        let out_res = load_output_res(&container, &mut r)?;
        let final_norm = r.vector("model.norm.weight")?;
        let lm_head = if container.config.tie_embeddings { r.matrix("model.embed_tokens.weight")? } else { r.matrix("lm_head.weight")? };
        let trunk_bytes = r.loaded;
        let embed = Embedding::new(&container)?;
        let mut banks = Vec::with_capacity(container.config.layers);
        for b in &container.banks {
            banks.push(match b {
                Some(b) => Some(Arc::new(DirectFile::open(&b.path, opts.direct_io)?)),
                None => None,
            });
        }
        let kernel = container.experts.as_ref().map(|(_, lay)| ExpertKernel { lay: *lay, act: container.config.activation });
        Ok(Model { container, layers, embed, final_norm, lm_head, out_res, banks, kernel, pool: Pool::with_level(threads, level), opts, trunk_bytes })
    }

    /// The config.
    pub fn config(&self) -> &waste_format::ModelConfig {
        &self.container.config
    }
    /// Options it was opened with.
    pub fn options(&self) -> &ModelOptions {
        &self.opts
    }
    /// Bytes of resident trunk weights loaded.
    pub fn trunk_bytes(&self) -> u64 {
        self.trunk_bytes
    }
    /// Whether every expert bank got direct I/O.
    pub fn direct_io(&self) -> bool {
        self.banks.iter().flatten().all(|b| b.is_direct())
    }
    /// Compute threads.
    pub fn threads(&self) -> usize {
        self.pool.threads()
    }
    /// SIMD level of the kernels.
    pub fn simd(&self) -> Level {
        self.pool.level()
    }
    /// A new session (its own state, position 0).
    pub fn session(&self) -> crate::Session<'_> {
        crate::Session::new(self)
    }
}
