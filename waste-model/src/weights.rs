//! Loading the resident trunk from a container, tensor by tensor.

use crate::{Error, Result};
use waste_attn::{KdaConfig, KdaGate, KdaWeights, MlaConfig, MlaQuery, MlaWeights};
use waste_format::{AttnKind, Container, ModelConfig, TensorInfo};
use waste_io::DirectFile;
use waste_moe::{DenseGlu, LayerBooks, RouterConfig};
use waste_quant::{Matrix, VqBook};

/// Read tensors from trunk.bin with positional reads (never the whole file).
pub struct TrunkReader<'c> {
    c: &'c Container,
    file: TrunkFile<'c>,
    /// Bytes of resident tensors loaded so far.
    pub loaded: u64,
    /// Back each tensor with 2 MiB pages where the OS allows it.
    huge_pages: bool,
    /// Drop each read range from the page cache ([`TrunkReader::for_stream`]).
    drop_behind: bool,
}

/// trunk.bin, opened by the reader or lent to it (a streamed layer's
/// reader, made every token, reads through the model's one handle).
enum TrunkFile<'c> {
    Owned(DirectFile),
    Lent(&'c DirectFile),
}

impl std::ops::Deref for TrunkFile<'_> {
    type Target = DirectFile;
    fn deref(&self) -> &DirectFile {
        match self {
            TrunkFile::Owned(f) => f,
            TrunkFile::Lent(f) => f,
        }
    }
}

impl<'c> TrunkReader<'c> {
    /// Open trunk.bin and ask the OS to read the resident part ahead (the
    /// whole file but the embedding table, which stays on disk and is read
    /// a row per token), so the disk streams while tensors are converted.
    ///
    /// # Errors
    /// When trunk.bin cannot be opened.
    pub fn new(c: &'c Container) -> Result<Self> {
        Self::skipping(c, &[], false)
    }

    /// [`TrunkReader::new`] with the tensors of the `streamed` layers (and
    /// the head when it streams) left out of the read-ahead advice too: they are read a layer at a time
    /// while tokens are computed ([`TrunkReader::for_stream`]), and
    /// advising them here would fill the page cache with what the budget
    /// kept out of memory.
    ///
    /// # Errors
    /// When trunk.bin cannot be opened.
    pub fn skipping(c: &'c Container, streamed: &[usize], head: bool) -> Result<Self> {
        let file = DirectFile::open(&c.trunk_path(), false)?;
        let mut skip: Vec<(u64, u64)> = vec![];
        let prefix = c.full_name("");
        for t in c.tensors.values() {
            let name = t.name.strip_prefix(prefix.as_str()).unwrap_or(&t.name);
            let streamed = crate::plan::layer_of(name).is_some_and(|l| streamed.contains(&l));
            let on_disk = name == "model.embed_tokens.weight" || (head && name == "lm_head.weight");
            if streamed || on_disk {
                skip.push((t.off, t.off.saturating_add(t.payload_len)));
                if t.scale_len > 0 {
                    skip.push((t.scale_off, t.scale_off.saturating_add(t.scale_len)));
                }
            }
        }
        skip.sort_unstable();
        let mut at = 0;
        for (a, b) in skip.into_iter().chain([(file.len(), file.len())]) {
            if a > at {
                file.will_need(at, a - at);
            }
            at = at.max(b);
        }
        Ok(TrunkReader { c, file: TrunkFile::Owned(file), loaded: 0, huge_pages: false, drop_behind: false })
    }

    /// A reader for streaming one layer through `file` (trunk.bin, opened
    /// once by the model; issue 48's budgets below the floor): no
    /// read-ahead advice, and each tensor's pages dropped from the page
    /// cache once read, so a layer read every token leaves no copy beside
    /// the budget.
    pub fn for_stream(c: &'c Container, file: &'c DirectFile) -> Self {
        TrunkReader { c, file: TrunkFile::Lent(file), loaded: 0, huge_pages: false, drop_behind: true }
    }

    /// Ask for 2 MiB pages behind the tensors read from here on (the
    /// engine's `huge_pages` option): a matvec streams each matrix once a
    /// token, and in 4 KiB pages that is a TLB walk every 4 KiB.
    pub fn with_huge_pages(self, on: bool) -> Self {
        TrunkReader { huge_pages: on, ..self }
    }

    fn read(&self, off: u64, len: u64) -> Result<Vec<u8>> {
        let len = usize::try_from(len).map_err(|_| waste_format::Error::tensor("trunk read", "exceeds memory"))?;
        let mut v = if self.huge_pages {
            // advised before the first write, so the pages arrive huge;
            // zeroed here, then read over (measured against letting a
            // zeroed allocation's pages arrive within the read: the first
            // prefill after the open ran faster this way — docs/lab/)
            let mut v = Vec::with_capacity(len);
            waste_io::advise_huge_pages(v.spare_capacity_mut());
            v.resize(len, 0);
            v
        } else {
            vec![0u8; len]
        };
        self.fill(&mut v, off)?;
        Ok(v)
    }

    /// `buf` from `off` of trunk.bin, its pages then dropped from the page
    /// cache where this reader drops behind.
    fn fill(&self, buf: &mut [u8], off: u64) -> Result<()> {
        self.file.read_exact_at(buf, off)?;
        if self.drop_behind {
            self.file.dont_need(off, buf.len() as u64);
        }
        Ok(())
    }

    /// [`TrunkReader::read`] for a matrix's payload: with huge pages asked
    /// for and at least one whole 2 MiB of it, a buffer of its own that
    /// starts on a 2 MiB boundary, so every whole 2 MiB is a huge page
    /// (advised inside an allocation that starts anywhere, a 4.9 MB matrix
    /// got one of its two; the 48B decode at AVX2 with all of its trunk in
    /// huge pages: attention 35.2 → 33.5 ms a token, docs/lab entry 78).
    fn read_payload(&self, off: u64, len: u64) -> Result<waste_quant::Payload> {
        let n = usize::try_from(len).map_err(|_| waste_format::Error::tensor("trunk read", "exceeds memory"))?;
        if !(self.huge_pages && n >= waste_io::HUGE_PAGE) {
            return Ok(self.read(off, len)?.into());
        }
        let mut b = waste_io::AlignedBuf::try_huge_blocks(n)?;
        self.fill(&mut b, off)?;
        Ok(b.into())
    }

    /// Load a tensor (name without prefix) as a matrix `[rows, cols]`.
    pub fn matrix(&mut self, name: &str) -> Result<Matrix> {
        self.matrix_full(&self.c.full_name(name))
    }

    /// Load a tensor by its full name (the vision tower's live outside the text prefix).
    pub fn matrix_full(&mut self, full: &str) -> Result<Matrix> {
        let t = self.c.tensors.get(full).ok_or_else(|| waste_format::Error::tensor(full, "missing"))?.clone();
        let data = self.read_payload(t.off, t.payload_len)?;
        let scales = if t.fmt.is_grouped() { self.read(t.scale_off, t.scale_len)? } else { vec![] };
        self.loaded += t.stored_bytes();
        Matrix::from_payload(t.fmt, t.rows, t.cols, t.group, data, &scales)
            .map_err(|e| Error::Format(waste_format::Error::tensor(&t.name, e.to_string())))
    }

    /// Load a tensor as a flat f32 vector.
    pub fn vector(&mut self, name: &str) -> Result<Vec<f32>> {
        Ok(self.matrix(name)?.to_f32())
    }
}

/// A matrix left on disk and read by rows: the embedding table (one row a
/// token) and, below the floor, a streamed head (issue 48: in pieces).
pub struct TensorRows {
    info: TensorInfo,
    file: DirectFile,
    /// Drop each read range from the page cache (a streamed head).
    drop_behind: bool,
}

/// The on-disk embedding table: one row read per token.
pub type Embedding = TensorRows;

impl TensorRows {
    /// Open the embedding table.
    pub fn new(c: &Container) -> Result<Self> {
        Self::of(c, "model.embed_tokens.weight", false)
    }
    /// Open tensor `name` (without prefix); `drop_behind` drops each read
    /// from the page cache.
    pub fn of(c: &Container, name: &str, drop_behind: bool) -> Result<Self> {
        let info = c.tensor(name)?.clone();
        let file = DirectFile::open(&c.trunk_path(), false)?;
        Ok(TensorRows { info, file, drop_behind })
    }
    /// Rows (vocabulary).
    pub fn rows(&self) -> usize {
        self.info.rows
    }
    /// Bytes of one stored row (payload and scales).
    pub fn row_bytes(&self) -> u64 {
        self.info.stored_bytes() / self.info.rows.max(1) as u64
    }
    /// Rows `r0..r0 + n` as a matrix (`r0 + n` within [`TensorRows::rows`]).
    pub fn read(&self, r0: usize, n: usize) -> Result<Matrix> {
        let t = &self.info;
        let rb = t.payload_len as usize / t.rows;
        let data = self.file.read_vec_at(t.off + (r0 * rb) as u64, n * rb)?;
        let mut sc = vec![];
        if t.fmt.is_grouped() {
            let sb = t.scale_len as usize / t.rows;
            sc = self.file.read_vec_at(t.scale_off + (r0 * sb) as u64, n * sb)?;
            if self.drop_behind {
                self.file.dont_need(t.scale_off + (r0 * sb) as u64, (n * sb) as u64);
            }
        }
        if self.drop_behind {
            self.file.dont_need(t.off + (r0 * rb) as u64, (n * rb) as u64);
        }
        Matrix::from_stored(t.fmt, n, t.cols, t.group, data, &sc)
            .map_err(|e| Error::Format(waste_format::Error::tensor(&t.name, e.to_string())))
    }
    /// Dequantize row `tok` into `out`.
    pub fn row(&self, tok: u32, out: &mut [f32]) -> Result<()> {
        let r = tok as usize;
        if r >= self.info.rows {
            return Err(Error::Arg(format!("token id {tok} is outside the vocabulary (0..{})", self.info.rows)));
        }
        self.read(r, 1)?.view().row(0, out);
        Ok(())
    }
}

/// Attention weights of one layer.
pub enum Attn {
    /// KDA.
    Kda(KdaWeights),
    /// MLA.
    Mla(MlaWeights),
}

/// FFN weights of one layer.
pub enum Ffn {
    /// Dense GLU.
    Dense(DenseGlu),
    /// MoE.
    Moe(MoeWeights),
}

/// The resident part of a MoE layer.
pub struct MoeWeights {
    /// Router `[E, hidden]`.
    pub gate: Matrix,
    /// Correction bias `[E]`.
    pub bias: Vec<f32>,
    /// Shared experts.
    pub shared: Option<DenseGlu>,
    /// K3 latent projections around the routed experts.
    pub latent: Option<Latent>,
    /// Codebooks.
    pub books: LayerBooks,
}

/// K3's latent MoE: experts work in a narrower space than the hidden state.
pub struct Latent {
    /// Down-projection into the latent space, `[lat, hidden]`.
    pub down: Matrix,
    /// Up-projection of the routed sum back, `[hidden, lat]`.
    pub up: Matrix,
    /// RMSNorm weight of the routed sum (`routed_expert_norm`), if the config has it.
    pub norm: Option<Vec<f32>>,
}

/// K3 Attention Residuals weights of one layer.
pub struct AttnResWeights {
    /// `self_attention_res_norm ⊙ self_attention_res_proj`.
    pub attn: Vec<f32>,
    /// `mlp_res_norm ⊙ mlp_res_proj`.
    pub mlp: Vec<f32>,
}

/// One decoder layer.
pub struct Layer {
    /// Input norm.
    pub in_norm: Vec<f32>,
    /// Post-attention norm.
    pub post_norm: Vec<f32>,
    /// Attention.
    pub attn: Attn,
    /// FFN.
    pub ffn: Ffn,
    /// Attention Residuals (K3).
    pub res: Option<AttnResWeights>,
}

/// Per-kind constants derived from the config.
pub fn kda_config(c: &ModelConfig) -> KdaConfig {
    KdaConfig {
        heads: c.kda_heads,
        dim: c.kda_head_dim,
        kernel: c.conv_kernel,
        eps: c.rms_eps,
        lower_bound: c.gate_lower_bound,
        chunked: false,
    }
}

/// MLA constants for a context bound.
pub fn mla_config(c: &ModelConfig, ctx: usize) -> MlaConfig {
    MlaConfig {
        heads: c.mla_heads,
        nope: c.qk_nope,
        rope: c.qk_rope,
        v: c.v_head,
        kv_lora: c.kv_lora,
        latent_eps: 1e-6,
        max_ctx: ctx,
    }
}

/// Router constants.
pub fn router_config(c: &ModelConfig) -> RouterConfig {
    RouterConfig {
        experts: c.experts,
        top_k: c.top_k,
        n_group: c.n_group,
        topk_group: c.topk_group,
        renormalize: c.renormalize,
        scaling: c.routed_scaling,
    }
}

fn product(a: &[f32], b: &[f32]) -> Vec<f32> {
    a.iter().zip(b).map(|(x, y)| x * y).collect()
}

/// Load every layer's resident weights.
pub fn load_layers(
    c: &Container,
    r: &mut TrunkReader<'_>,
    streamed: &[usize],
    progress: &dyn Fn(usize, usize),
) -> Result<Vec<Option<Layer>>> {
    let cfg = &c.config;
    if cfg.kda_head_dim > 512 {
        return Err(Error::Unsupported(format!("KDA head dim {} (at most 512)", cfg.kda_head_dim)));
    }
    let mut layers = Vec::with_capacity(cfg.layers);
    for l in 0..cfg.layers {
        layers.push(if streamed.contains(&l) { None } else { Some(load_layer(c, r, l)?) });
        progress(l + 1, cfg.layers);
    }
    Ok(layers)
}

/// Layer `l`'s weights as the engine computes with them (the one load
/// path of resident and streamed layers alike, so both compute the same).
pub fn load_layer(c: &Container, r: &mut TrunkReader<'_>, l: usize) -> Result<Layer> {
    let cfg = &c.config;
    let p = format!("model.layers.{l}.");
    let a = format!("{p}self_attn.");
    let attn = match cfg.attn_kinds[l] {
        AttnKind::Kda => load_kda(cfg, r, &a)?,
        AttnKind::Mla => load_mla(cfg, r, &a)?,
    };
    let ffn = load_ffn(c, r, l, &p)?;
    let res = load_res(cfg, r, &p)?;
    Ok(Layer {
        in_norm: r.vector(&format!("{p}input_layernorm.weight"))?,
        post_norm: r.vector(&format!("{p}post_attention_layernorm.weight"))?,
        attn,
        ffn,
        res,
    })
}

/// Layer `l` read for one use (a streamed layer, [`TrunkReader::for_stream`])
/// and the bytes it took.
///
/// # Errors
/// As [`load_layer`].
pub fn stream_layer(c: &Container, file: &DirectFile, l: usize) -> Result<(Layer, u64)> {
    let mut r = TrunkReader::for_stream(c, file);
    let layer = load_layer(c, &mut r, l)?;
    Ok((layer, r.loaded))
}

/// A KDA layer's weights (names under `a`, the layer's `self_attn.`).
fn load_kda(cfg: &waste_format::ModelConfig, r: &mut TrunkReader<'_>, a: &str) -> Result<Attn> {
    let kc = kda_config(cfg);
    let ch = kc.channels();
    let conv = |r: &mut TrunkReader<'_>, n: &str| -> Result<Vec<f32>> {
        let v = r.vector(&format!("{a}{n}.weight"))?;
        debug_assert_eq!(v.len(), ch * kc.kernel);
        Ok(v)
    };
    let mut a_log = r.vector(&format!("{a}A_log"))?;
    a_log.truncate(kc.heads);
    a_log.shrink_to_fit();
    Ok(Attn::Kda(KdaWeights {
        q: r.matrix(&format!("{a}q_proj.weight"))?,
        k: r.matrix(&format!("{a}k_proj.weight"))?,
        v: r.matrix(&format!("{a}v_proj.weight"))?,
        conv: [conv(r, "q_conv1d")?, conv(r, "k_conv1d")?, conv(r, "v_conv1d")?],
        f_a: r.matrix(&format!("{a}f_a_proj.weight"))?,
        f_b: r.matrix(&format!("{a}f_b_proj.weight"))?,
        b: r.matrix(&format!("{a}b_proj.weight"))?,
        a_log,
        dt_bias: r.vector(&format!("{a}dt_bias"))?,
        gate: if cfg.kda_full_rank_gate {
            KdaGate::Full(r.matrix(&format!("{a}g_proj.weight"))?)
        } else {
            KdaGate::LowRank {
                a: r.matrix(&format!("{a}g_a_proj.weight"))?,
                b: r.matrix(&format!("{a}g_b_proj.weight"))?,
            }
        },
        o_norm: r.vector(&format!("{a}o_norm.weight"))?,
        o: r.matrix(&format!("{a}o_proj.weight"))?,
    }))
}

/// An MLA layer's weights (names under `a`, the layer's `self_attn.`).
fn load_mla(cfg: &waste_format::ModelConfig, r: &mut TrunkReader<'_>, a: &str) -> Result<Attn> {
    Ok(Attn::Mla(MlaWeights {
        q: match cfg.q_lora {
            None => MlaQuery::Plain(r.matrix(&format!("{a}q_proj.weight"))?),
            Some(_) => MlaQuery::Lora {
                a: r.matrix(&format!("{a}q_a_proj.weight"))?,
                norm: r.vector(&format!("{a}q_a_layernorm.weight"))?,
                b: r.matrix(&format!("{a}q_b_proj.weight"))?,
            },
        },
        kv_a: r.matrix(&format!("{a}kv_a_proj_with_mqa.weight"))?,
        kv_a_norm: r.vector(&format!("{a}kv_a_layernorm.weight"))?,
        kv_b: r.matrix(&format!("{a}kv_b_proj.weight"))?,
        g: if cfg.mla_output_gate { Some(r.matrix(&format!("{a}g_proj.weight"))?) } else { None },
        o: r.matrix(&format!("{a}o_proj.weight"))?,
    }))
}

/// Layer `l`'s FFN: the MoE (router, shared experts, latent projections,
/// VQ codebooks) or the dense GLU (names under `p`, the layer's prefix).
fn load_ffn(c: &Container, r: &mut TrunkReader<'_>, l: usize, p: &str) -> Result<Ffn> {
    let cfg = &c.config;
    Ok(if cfg.is_moe(l) {
        let m = format!("{p}block_sparse_moe.");
        let books = match &c.experts {
            Some((q, _)) if q.fmt.is_vq() => {
                let base = c.banks[l].as_ref().map(|b| b.codebook_base).unwrap_or(0);
                let mut lb = LayerBooks::default();
                for (kind, slot) in lb.books.iter_mut().enumerate() {
                    for s in 0..q.stages {
                        let id = base + kind * q.stages + s;
                        let bits = c
                            .codebooks
                            .book(id)
                            .ok_or_else(|| waste_format::Error::Codebook { id, msg: "out of range".into() })?;
                        slot.push(VqBook::from_f16(bits, q.entries, q.vec_dim));
                    }
                }
                lb
            }
            _ => LayerBooks::default(),
        };
        Ffn::Moe(MoeWeights {
            gate: r.matrix(&format!("{m}gate.weight"))?,
            bias: r.vector(&format!("{m}gate.e_score_correction_bias"))?,
            shared: if cfg.shared_experts > 0 {
                Some(DenseGlu {
                    gate: r.matrix(&format!("{m}shared_experts.gate_proj.weight"))?,
                    up: r.matrix(&format!("{m}shared_experts.up_proj.weight"))?,
                    down: r.matrix(&format!("{m}shared_experts.down_proj.weight"))?,
                })
            } else {
                None
            },
            latent: match cfg.latent {
                Some(_) => Some(Latent {
                    down: r.matrix(&format!("{m}routed_expert_down_proj.weight"))?,
                    up: r.matrix(&format!("{m}routed_expert_up_proj.weight"))?,
                    norm: if cfg.latent_norm {
                        Some(r.vector(&format!("{m}routed_expert_norm.weight"))?)
                    } else {
                        None
                    },
                }),
                None => None,
            },
            books,
        })
    } else {
        Ffn::Dense(DenseGlu {
            gate: r.matrix(&format!("{p}mlp.gate_proj.weight"))?,
            up: r.matrix(&format!("{p}mlp.up_proj.weight"))?,
            down: r.matrix(&format!("{p}mlp.down_proj.weight"))?,
        })
    })
}

/// A layer's AttnRes weights (norm ⊙ proj), when the model has them.
fn load_res(cfg: &waste_format::ModelConfig, r: &mut TrunkReader<'_>, p: &str) -> Result<Option<AttnResWeights>> {
    Ok(if cfg.attn_res_block.is_some() {
        Some(AttnResWeights {
            attn: product(
                &r.vector(&format!("{p}self_attention_res_norm.weight"))?,
                &r.vector(&format!("{p}self_attention_res_proj.weight"))?,
            ),
            mlp: product(
                &r.vector(&format!("{p}mlp_res_norm.weight"))?,
                &r.vector(&format!("{p}mlp_res_proj.weight"))?,
            ),
        })
    } else {
        None
    })
}

/// Load the model-level AttnRes weights (norm ⊙ proj).
pub fn load_output_res(c: &Container, r: &mut TrunkReader<'_>) -> Result<Option<Vec<f32>>> {
    if c.config.attn_res_block.is_none() {
        return Ok(None);
    }
    Ok(Some(product(&r.vector("model.output_attn_res_norm.weight")?, &r.vector("model.output_attn_res_proj.weight")?)))
}

#[cfg(all(test, target_os = "linux"))]
#[path = "../../waste-quant/tests/support/skip.rs"]
mod skip;

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use crate::{Model, ModelOptions};

    /// The flags of the mapping holding `addr` (`VmFlags` in /proc/self/smaps).
    fn vm_flags(addr: usize) -> String {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ').filter(|(r, _)| r.contains('-') && !r.ends_with(':')) {
                let (a, b) = range.split_once('-').unwrap();
                let (a, b) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16));
                inside = matches!((a, b), (Ok(a), Ok(b)) if (a..b).contains(&addr));
            } else if inside && line.starts_with("VmFlags:") {
                return line.to_string();
            }
        }
        panic!("no mapping holds {addr:#x}")
    }

    /// With `huge_pages` the trunk's matrices sit in memory advised for 2
    /// MiB pages (the mapping's `hg` flag: the advice itself, whether or
    /// not the OS found huge pages free). The synthetic model's head is
    /// 65 536 × 128 Q8G, 8 MiB. (Without the option nothing is asked, but
    /// the allocator may hand out a range another open advised earlier in
    /// this process, so that case is not asserted.)
    #[test]
    fn the_trunk_is_advised_for_huge_pages_when_asked() {
        let hg = |addr: usize| vm_flags(addr).split_whitespace().any(|f| f == "hg");
        // whether this system records the advice at all (a kernel without
        // transparent huge pages, or qemu-user, which takes it and drops it)
        let mut probe: Vec<u8> = Vec::with_capacity(8 << 20);
        waste_io::advise_huge_pages(probe.spare_capacity_mut());
        if !hg(probe.as_ptr() as usize + (4 << 20)) {
            super::skip::report_skip(
                "the trunk in huge pages (this system does not record MADV_HUGEPAGE: no THP, or an emulator)",
                false,
            );
            return;
        }
        let dir = std::env::temp_dir().join(format!("waste-trunk-huge-{}", std::process::id()));
        let mut config = waste_synth::shape_config("tiny").unwrap();
        config["vocab_size"] = 65_536.into();
        let o = waste_synth::SynthOptions {
            config,
            layers: None,
            experts: waste_format::ExpertFmt::Vq3r,
            seed: 3,
            manifest_only: false,
            skewed: false,
            jobs: 2,
        };
        waste_synth::synth(&dir, &o, &|_, _| {}).unwrap();
        let m = Model::open(&dir, ModelOptions { huge_pages: true, ctx: 16, ..ModelOptions::exact() }).unwrap();
        let crate::model::Head::Resident(head) = &m.head else { panic!("a resident head") };
        assert_eq!(head.data.len(), 8 << 20);
        let mid = head.data.as_ptr() as usize + (4 << 20);
        assert!(hg(mid), "{}", vm_flags(mid));
        // its own buffer from a 2 MiB boundary: the first and last bytes'
        // blocks are advised too (an allocator's Vec starts past a boundary,
        // its first and last partial blocks in 4 KiB pages)
        let (first, last) = (head.data.as_ptr() as usize, head.data.as_ptr() as usize + (8 << 20) - 1);
        assert_eq!(first % waste_io::HUGE_PAGE, 0, "the head's payload on a 2 MiB boundary");
        assert!(hg(first) && hg(last), "{} / {}", vm_flags(first), vm_flags(last));
        std::fs::remove_dir_all(&dir).ok();
    }
}
