//! Synthetic containers of any shape: valid data (random VQ indices,
//! random scales and codebooks, quantized random trunk matrices) written at
//! disk speed, deterministic for a seed. Tests use the tiny shapes;
//! benchmarks use full-size shapes (`kimi-linear-48b`, K3 slices).
//!
//! ```no_run
//! # fn example() -> waste_format::Result<()> {
//! use waste_synth::{shape_config, synth, SynthOptions};
//! let config = shape_config("tiny").expect("a known shape");
//! let opts = SynthOptions {
//!     config,
//!     layers: None,
//!     experts: waste_format::ExpertFmt::Vq3r,
//!     seed: 1,
//!     manifest_only: false,
//!     skewed: false,
//!     jobs: 2,
//! };
//! let report = synth("/tmp/tiny.waste".as_ref(), &opts, &|_, _| {})?;
//! assert!(report.bytes > 0);
//! # Ok(()) }
//! ```
#![deny(missing_docs)]

use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::Path;
use waste_format::half::{f32_to_bf16, f32_to_f16};
use waste_format::{
    required_tensors, write_manifest, AttnKind, BankWriter, Codebooks, Error, ExpertFmt, Fmt, LayerEntry, Manifest,
    ModelConfig, RecordLayout, Result, TrunkWriter, FORMAT_VERSION,
};
pub use waste_quant::quantize_groups;
use waste_quant::SplitMix64 as Rng;

/// Names of the built-in shapes.
pub const SHAPES: &[&str] = &["tiny", "tiny-b", "tiny-c", "tiny-k3", "kimi-linear-48b", "k3"];

/// The config of a built-in shape.
pub fn shape_config(name: &str) -> Option<Value> {
    let kl = |h: usize, layers: usize, mla: &[usize]| {
        let kda: Vec<usize> = (1..=layers).filter(|l| !mla.contains(l)).collect();
        json!({"model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"], "hidden_size": h,
               "num_hidden_layers": layers, "rms_norm_eps": 1e-5, "moe_router_activation_func": "sigmoid",
               "mla_use_nope": true, "tie_word_embeddings": false, "q_lora_rank": null,
               "linear_attn_config": {"short_conv_kernel_size": 4, "kda_layers": kda, "full_attn_layers": mla}})
    };
    let merge = |mut base: Value, extra: Value| {
        if let (Some(b), Some(e)) = (base.as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                if k == "linear_attn_config" {
                    for (k2, v2) in v.as_object().into_iter().flatten() {
                        b["linear_attn_config"][k2] = v2.clone();
                    }
                } else {
                    b.insert(k.clone(), v.clone());
                }
            }
        }
        base
    };
    Some(match name {
        "tiny" => merge(
            kl(128, 4, &[3]),
            json!({"first_k_dense_replace": 1, "intermediate_size": 256, "moe_intermediate_size": 64,
            "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1, "moe_renormalize": true, "routed_scaling_factor": 2.446,
            "num_attention_heads": 4, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "kv_lora_rank": 32,
            "vocab_size": 320, "bos_token_id": 256, "eos_token_id": 257, "linear_attn_config": {"head_dim": 32, "num_heads": 4}}),
        ),
        "tiny-b" => merge(
            kl(96, 5, &[1, 4]),
            json!({"first_k_dense_replace": 2, "intermediate_size": 160, "moe_intermediate_size": 32,
            "num_experts": 16, "num_experts_per_token": 4, "num_shared_experts": 2, "moe_renormalize": false, "routed_scaling_factor": 1.5,
            "num_attention_heads": 3, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 24, "kv_lora_rank": 24,
            "q_lora_rank": 48, "vocab_size": 300, "bos_token_id": 256, "eos_token_id": 257,
            "linear_attn_config": {"head_dim": 16, "num_heads": 6}}),
        ),
        "tiny-c" => merge(
            kl(64, 3, &[2]),
            json!({"first_k_dense_replace": 0, "moe_intermediate_size": 48,
            "num_experts": 6, "num_experts_per_token": 3, "num_shared_experts": 0, "moe_renormalize": true, "routed_scaling_factor": 1.0,
            "num_attention_heads": 2, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "kv_lora_rank": 16,
            "vocab_size": 272, "bos_token_id": 256, "eos_token_id": 257, "linear_attn_config": {"head_dim": 16, "num_heads": 2}}),
        ),
        "tiny-k3" => merge(
            kl(128, 5, &[2, 5]),
            json!({"model_type": "kimi_k3", "first_k_dense_replace": 1, "intermediate_size": 192,
            "moe_intermediate_size": 64, "routed_expert_hidden_size": 96, "latent_moe_use_norm": true, "num_experts": 8,
            "num_experts_per_token": 3, "num_shared_experts": 2, "moe_renormalize": true, "routed_scaling_factor": 1.0,
            "num_attention_heads": 4, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "kv_lora_rank": 32,
            "q_lora_rank": 48, "mla_use_output_gate": true, "hidden_act": "situ", "activation_situ_beta": 4.0,
            "activation_situ_linear_beta": 25.0, "attn_res_block_size": 2, "vocab_size": 320, "bos_token_id": 256, "eos_token_id": 257,
            "linear_attn_config": {"head_dim": 32, "num_heads": 4, "use_full_rank_gate": true, "gate_lower_bound": -5.0}}),
        ),
        "kimi-linear-48b" => merge(
            kl(2304, 27, &[4, 8, 12, 16, 20, 24, 27]),
            json!({"first_k_dense_replace": 1, "intermediate_size": 9216,
            "moe_intermediate_size": 1024, "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1, "moe_renormalize": true,
            "routed_scaling_factor": 2.446, "num_attention_heads": 32, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
            "kv_lora_rank": 512, "vocab_size": 163840, "bos_token_id": 163584, "eos_token_id": 163586,
            "linear_attn_config": {"head_dim": 128, "num_heads": 32}}),
        ),
        "k3" => {
            let mla: Vec<usize> = (1..=93).filter(|l| l % 4 == 0 || *l == 93).collect();
            merge(
                kl(7168, 93, &mla),
                json!({"model_type": "kimi_k3", "tensor_prefix": "language_model.", "first_k_dense_replace": 1,
                "intermediate_size": 18432, "moe_intermediate_size": 3072, "routed_expert_hidden_size": 3584, "latent_moe_use_norm": true,
                "num_experts": 896, "num_experts_per_token": 16, "num_shared_experts": 2, "moe_renormalize": true, "routed_scaling_factor": 1.0,
                "num_attention_heads": 96, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "kv_lora_rank": 512,
                "q_lora_rank": 1536, "mla_use_output_gate": true, "hidden_act": "situ", "activation_situ_beta": 4.0,
                "activation_situ_linear_beta": 25.0, "attn_res_block_size": 12, "vocab_size": 163840, "bos_token_id": 163584,
                "eos_token_id": 163586, "linear_attn_config": {"head_dim": 128, "num_heads": 96, "use_full_rank_gate": true, "gate_lower_bound": -5.0}}),
            )
        }
        _ => return None,
    })
}

/// Options of [`synth`].
#[derive(Clone, Debug)]
pub struct SynthOptions {
    /// The model config (e.g. from [`shape_config`]).
    pub config: Value,
    /// Keep only the first N layers.
    pub layers: Option<usize>,
    /// Expert format.
    pub experts: ExpertFmt,
    /// Seed.
    pub seed: u64,
    /// Write a manifest and sparse data files only (enough for plan/info).
    pub manifest_only: bool,
    /// Bias the router so some experts are preferred, like a real router.
    pub skewed: bool,
    /// Writer threads for expert banks.
    pub jobs: usize,
}

/// What [`synth`] wrote.
#[derive(Clone, Copy, Debug)]
pub struct SynthReport {
    /// Bytes written (logical).
    pub bytes: u64,
    /// Seconds taken.
    pub seconds: f64,
}

/// A byte map making uniformly random Q4G/Q8G codes zero-mean: the code of
/// value −8 (each Q4G nibble 0) or −128 (Q8G byte 0x80) becomes value 0.
fn zero_mean_codes(fmt: Fmt) -> [u8; 256] {
    core::array::from_fn(|b| {
        let b = b as u8;
        if fmt == Fmt::Q8G {
            if b == 0x80 {
                0
            } else {
                b
            }
        } else {
            let (lo, hi) = (b & 15, b >> 4);
            let fix = |n: u8| if n == 0 { 8 } else { n };
            fix(lo) | fix(hi) << 4
        }
    })
}

/// f32 values of a 1-D/small tensor by role.
fn vector_values(name: &str, n: usize, rng: &mut Rng, skewed: bool) -> Vec<f32> {
    (0..n)
        .map(|i| {
            if name.ends_with("A_log") {
                (1.0 + 3.0 * rng.unif()).ln()
            } else if name.ends_with("dt_bias") || name.contains("conv1d") {
                0.5 * rng.gauss()
            } else if name.ends_with("e_score_correction_bias") {
                if skewed {
                    2.0 / (1.0 + i as f32).sqrt()
                } else {
                    0.02 * rng.gauss()
                }
            } else if name.ends_with("_res_proj.weight") {
                0.5 * rng.gauss()
            } else {
                1.0 + 0.1 * rng.gauss() // norms
            }
        })
        .collect()
}

fn is_vector(name: &str) -> bool {
    ["norm", "A_log", "dt_bias", "conv1d", "bias", "_res_proj"].iter().any(|k| name.contains(k))
}

/// Write a byte-level tokenizer (256 byte tokens) and the K3-style specials
/// up to the vocabulary size.
///
/// # Errors
/// [`Error::Io`] when the files cannot be written.
pub fn write_byte_tokenizer(dir: &Path, vocab: usize) -> Result<()> {
    let b64 = |bytes: &[u8]| {
        const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut s = String::new();
        for ch in bytes.chunks(3) {
            let n = ch.iter().enumerate().fold(0u32, |n, (i, &b)| n | (b as u32) << (16 - 8 * i));
            for i in 0..4 {
                if i <= ch.len() {
                    s.push(T[(n >> (18 - 6 * i)) as usize & 63] as char);
                } else {
                    s.push('=');
                }
            }
        }
        s
    };
    let base = 256.min(vocab);
    let mut ranks = String::new();
    for b in 0..base {
        ranks.push_str(&format!("{} {b}\n", b64(&[b as u8])));
    }
    let names = [
        "[BOS]",
        "[EOS]",
        "<|end_of_msg|>",
        "<|open|>",
        "<|close|>",
        "<|sep|>",
        "<|media_begin|>",
        "<|media_content|>",
        "<|media_pad|>",
        "<|media_end|>",
        "<|kimi_image_placeholder|>",
    ];
    let specials: Vec<Value> = (base..vocab)
        .map(|id| {
            let k = id - base;
            let text = names.get(k).map(|s| s.to_string()).unwrap_or_else(|| format!("<|reserved_{k}|>"));
            json!({"id": id, "text": text})
        })
        .collect();
    let w = |name: &str, s: &[u8]| std::fs::write(dir.join(name), s).map_err(|e| Error::io(dir.join(name), e));
    w("tokenizer.model", ranks.as_bytes())?;
    w("specials.json", serde_json::to_string_pretty(&specials).unwrap_or_default().as_bytes())
}

/// The file that marks a folder as a synthetic container this crate
/// wrote: only such a folder (or an empty one, or none) is replaced.
pub const SYNTH_MARKER: &str = ".waste-synth";

/// Write a synthetic container to `dir`. `progress(done, total)` is called
/// as expert bytes are written. The container is written beside `dir`
/// (`dir.partial`) and renamed into place when complete, so an interrupted
/// run leaves no half container at `dir`. `dir` may be absent, an empty
/// folder, or a synthetic container written here before (it carries
/// [`SYNTH_MARKER`]), which is removed first; anything else is refused and
/// left as it was.
///
/// # Errors
/// [`Error::Manifest`] for a config the container format cannot hold;
/// [`Error::Io`] when a file cannot be written, or (`AlreadyExists`) when
/// `dir` or its staging folder holds something this crate did not write.
pub fn synth(dir: &Path, opts: &SynthOptions, progress: &(dyn Fn(u64, u64) + Sync)) -> Result<SynthReport> {
    if dir.file_name().is_none() {
        let e = std::io::Error::new(std::io::ErrorKind::InvalidInput, "the output needs a folder name");
        return Err(Error::io(dir, e));
    }
    let stage = waste_format::staging_dir(dir);
    clear_own(&stage)?;
    clear_own(dir)?;
    // marked first, so an interrupted run's staging folder is known as ours
    std::fs::create_dir_all(&stage).map_err(|e| Error::io(&stage, e))?;
    let marker = json!({"seed": opts.seed, "layers": opts.layers, "experts": format!("{:?}", opts.experts)});
    std::fs::write(stage.join(SYNTH_MARKER), marker.to_string()).map_err(|e| Error::io(&stage, e))?;
    let rep = synth_into(&stage, opts, progress)?;
    if dir.exists() {
        // the empty folder clear_own left
        std::fs::remove_dir(dir).map_err(|e| Error::io(dir, e))?;
    }
    std::fs::rename(&stage, dir).map_err(|e| Error::io(dir, e))?;
    Ok(rep)
}

/// Make `dir` absent or empty: remove it when it is synthetic output
/// written here before (it carries [`SYNTH_MARKER`]); refuse anything else
/// that is not empty, leaving it as it was. Writers of other synthetic
/// output (`xtask synth-source`) call it, then mark their folder.
///
/// # Errors
/// [`Error::Io`]: `AlreadyExists` for a file or a folder with other content.
pub fn clear_own(dir: &Path) -> Result<()> {
    let refuse = |why: &str| {
        let msg = format!("{why}; choose another output (nothing was changed)");
        Err(Error::io(dir, std::io::Error::new(std::io::ErrorKind::AlreadyExists, msg)))
    };
    match std::fs::symlink_metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io(dir, e)),
        Ok(m) if !m.is_dir() => refuse("exists and is not a folder"),
        Ok(_) => {
            let mut entries = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
            if entries.next().is_none() {
                Ok(())
            } else if dir.join(SYNTH_MARKER).is_file() {
                std::fs::remove_dir_all(dir).map_err(|e| Error::io(dir, e))
            } else {
                refuse("exists, is not empty and is not synthetic output written by this tool")
            }
        }
    }
}

fn synth_into(dir: &Path, opts: &SynthOptions, progress: &(dyn Fn(u64, u64) + Sync)) -> Result<SynthReport> {
    let t0 = std::time::Instant::now();
    let mut config = opts.config.clone();
    let prefix = config.get("tensor_prefix").and_then(|v| v.as_str()).unwrap_or("").to_string();
    if let Some(o) = config.as_object_mut() {
        o.remove("tensor_prefix");
    }
    if let Some(n) = opts.layers {
        let full = ModelConfig::from_json(&config)?;
        let n = n.clamp(1, full.layers);
        config["num_hidden_layers"] = json!(n);
        if let Some(lin) = config.get_mut("linear_attn_config") {
            let kinds: Vec<AttnKind> = full.attn_kinds[..n].to_vec();
            let kda: Vec<usize> = (0..n).filter(|&l| kinds[l] == AttnKind::Kda).map(|l| l + 1).collect();
            let mla: Vec<usize> = (0..n).filter(|&l| kinds[l] == AttnKind::Mla).map(|l| l + 1).collect();
            lin["kda_layers"] = json!(kda);
            lin["full_attn_layers"] = json!(mla);
        }
        if full.first_k_dense > n {
            config["first_k_dense_replace"] = json!(n);
        }
    }
    let cfg = ModelConfig::from_json(&config)?;
    let q = waste_format::ExpertQuant::standard(opts.experts);
    let lay = RecordLayout::new(&cfg, q)?;
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;

    // Trunk.
    let mut tw = TrunkWriter::create(dir)?;
    let mut written = 0u64;
    let sparse = opts.manifest_only;
    for req in required_tensors(&cfg) {
        let name = format!("{prefix}{}", req.name);
        let mut rng = Rng::for_name(opts.seed, &name);
        let n = req.expect.numel();
        let (rows, cols) = match req.expect {
            waste_format::Expect::Mat(r, c) => (r, c),
            _ => (1, n),
        };
        if sparse {
            let vector = is_vector(&req.name) || rows == 1;
            let fmt = if vector {
                Fmt::F32
            } else if req.name.contains("embed_tokens") || req.name == "lm_head.weight" {
                Fmt::Q8G
            } else {
                Fmt::Q4G
            };
            let shape: Vec<usize> = if vector { vec![n] } else { vec![rows, cols] };
            tw.add_sparse(&name, fmt, &shape, 128)?;
            continue;
        }
        if is_vector(&req.name) || rows == 1 {
            let v = if sparse { vec![0f32; n] } else { vector_values(&req.name, n, &mut rng, opts.skewed) };
            let shape: Vec<usize> =
                if req.name.contains("conv1d") { vec![n / cfg.conv_kernel, 1, cfg.conv_kernel] } else { vec![n] };
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            tw.add(&name, Fmt::F32, &shape, 0, &bytes, &[])?;
        } else {
            let fmt =
                if req.name.contains("embed_tokens") || req.name == "lm_head.weight" { Fmt::Q8G } else { Fmt::Q4G };
            let gain = if req.name.ends_with("gate.weight") { 3.0 } else { 1.0 };
            let (data, scales) = if rows * cols > 1 << 20 {
                // big matrices (benchmark shapes): random codes with one fitting
                // scale are valid data and cost nothing to make, so writing
                // stays disk-bound; small (test) matrices keep the quantized
                // Gaussians below
                //
                // The codes must be zero-mean: raw random nibbles are q − 8 ∈
                // [−8, 7] (mean −0.5), and that shared offset, summed over
                // thousands of columns, outweighs the random part — every
                // matvec adds the same vector, the residual stream collapses
                // onto one direction and every token routes to the same
                // experts (bench then saw 100 % hits at any budget). So the
                // one code without a mirror (−8, or −128 for Q8G) becomes 0.
                let np = cols.div_ceil(128) * 128;
                let (rb, code_std) = if fmt == Fmt::Q8G { (np, 73.47f32) } else { (np / 2, 4.18f32) };
                let mut d = vec![0u8; rows * rb];
                rng.fill(&mut d);
                let lut = zero_mean_codes(fmt);
                for b in d.iter_mut() {
                    *b = lut[*b as usize];
                }
                let sc = f32_to_f16(gain / (code_std * (cols as f32).sqrt())).to_le_bytes();
                (d, sc.iter().copied().cycle().take(rows * np / 128 * 2).collect())
            } else {
                let std = gain / (cols as f32).sqrt();
                let w: Vec<f32> = (0..rows * cols).map(|_| std * rng.gauss()).collect();
                quantize_groups(fmt, rows, cols, 128, &w)
            };
            tw.add(&name, fmt, &[rows, cols], 128, &data, &scales)?;
        }
    }
    let trunk = tw.finish()?;
    written += trunk.iter().map(|t| t.bytes).sum::<u64>();

    // Codebooks.
    let moe: Vec<usize> = cfg.moe_layers().collect();
    let bpl = q.books_per_layer();
    if q.fmt.is_vq() {
        let mut cb = Vec::new();
        for (i, &l) in moe.iter().enumerate() {
            for kind in 0..3 {
                for s in 0..q.stages {
                    let mut rng = Rng::for_name(opts.seed, &format!("codebook.{l}.{kind}.{s}"));
                    let amp = 0.5f32.powi(s as i32);
                    let e: Vec<u16> = (0..q.entries * q.vec_dim).map(|_| f32_to_f16(amp * rng.gauss())).collect();
                    Codebooks::encode_record(i * bpl + kind * q.stages + s, &q, &e, &mut cb);
                }
            }
        }
        let p = dir.join("codebooks.bin");
        std::fs::write(&p, &cb).map_err(|e| Error::io(&p, e))?;
        written += cb.len() as u64;
    }

    // Expert banks.
    let total = moe.len() as u64 * cfg.experts as u64 * lay.rec_bytes as u64;
    let done = std::sync::atomic::AtomicU64::new(0);
    let next = std::sync::atomic::AtomicUsize::new(0);
    let first_err = parking_free_slot();
    std::thread::scope(|sc| {
        for _ in 0..opts.jobs.max(1) {
            sc.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(&l) = moe.get(i) else { break };
                if let Err(e) = write_bank(dir, l, i * bpl, &cfg, &lay, opts, &done, total, progress) {
                    if let Ok(mut g) = first_err.lock() {
                        g.get_or_insert(e);
                    }
                    break;
                }
            });
        }
    });
    if let Some(e) = first_err.into_inner().ok().flatten() {
        return Err(e);
    }
    written += total;
    let layers: BTreeMap<String, LayerEntry> = moe
        .iter()
        .enumerate()
        .map(|(i, &l)| {
            (
                l.to_string(),
                LayerEntry {
                    file: format!("experts-L{l}.bin"),
                    experts: cfg.experts as u64,
                    bytes: cfg.experts as u64 * lay.rec_bytes as u64,
                    codebook_base: (i * bpl) as u64,
                },
            )
        })
        .collect();
    write_byte_tokenizer(dir, cfg.vocab)?;
    let arch = config.get("model_type").and_then(|v| v.as_str()).unwrap_or("kimi_linear").to_string();
    let m = Manifest {
        format_version: FORMAT_VERSION,
        arch,
        tensor_prefix: prefix,
        config,
        expert_quant: (!moe.is_empty()).then(|| q.to_entry()),
        layers,
        trunk,
    };
    write_manifest(dir, &m)?;
    Ok(SynthReport { bytes: written, seconds: t0.elapsed().as_secs_f64() })
}

fn parking_free_slot() -> std::sync::Mutex<Option<Error>> {
    std::sync::Mutex::new(None)
}

#[allow(clippy::too_many_arguments)]
fn write_bank(
    dir: &Path,
    l: usize,
    cb_base: usize,
    cfg: &ModelConfig,
    lay: &RecordLayout,
    opts: &SynthOptions,
    done: &std::sync::atomic::AtomicU64,
    total: u64,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<()> {
    let path = dir.join(format!("experts-L{l}.bin"));
    if opts.manifest_only {
        let f = std::fs::File::create(&path).map_err(|e| Error::io(&path, e))?;
        f.set_len(cfg.experts as u64 * lay.rec_bytes as u64).map_err(|e| Error::io(&path, e))?;
        return Ok(());
    }
    let mut bw = BankWriter::create(&path, l, *lay, cb_base as u16)?;
    let mut rec = vec![0u8; lay.rec_bytes];
    let mut rng = Rng::for_name(opts.seed, &format!("experts.{l}"));
    let q = lay.quant;
    for _e in 0..cfg.experts {
        let body = &mut rec[lay.gate_off..lay.scales_off];
        match q.fmt {
            ExpertFmt::F16 | ExpertFmt::Bf16 => {
                let mut put = |rows: usize, cols: usize, off: usize, rec: &mut [u8]| {
                    let std = 1.0 / (cols as f32).sqrt();
                    for i in 0..rows * cols {
                        let v = std * rng.gauss();
                        let h = if q.fmt == ExpertFmt::F16 { f32_to_f16(v) } else { f32_to_bf16(v) };
                        rec[off + 2 * i..off + 2 * i + 2].copy_from_slice(&h.to_le_bytes());
                    }
                };
                put(lay.m, lay.lat, lay.gate_off, &mut rec);
                put(lay.m, lay.lat, lay.up_off, &mut rec);
                put(lay.lat, lay.m, lay.down_off, &mut rec);
            }
            _ => {
                rng.fill(body);
                // zero the index padding rows so the record equals what an encoder writes
                let rows_per =
                    [(lay.gate_off, lay.m, lay.lat), (lay.up_off, lay.m, lay.lat), (lay.down_off, lay.lat, lay.m)];
                for (off, rows, cols) in rows_per {
                    if q.index_block > 0 && rows % q.index_block != 0 {
                        let nvec = cols / q.vec_dim;
                        let bpv = q.index_bytes_per_vec();
                        let rb = rows / q.index_block;
                        for v in 0..nvec {
                            for rib in rows % q.index_block..q.index_block {
                                let o = off + ((rb * nvec + v) * q.index_block + rib) * bpv;
                                rec[o..o + bpv].fill(0);
                            }
                        }
                    }
                }
                // VQ: a scale per row; Q4G: per group of a row, over uniform
                // nibbles (−8..7, standard deviation ≈ 4.6)
                let (gs, _) = lay.scale_counts();
                let spread = if q.fmt == ExpertFmt::Q4g { 4.6 } else { 1.0 };
                for (r, c) in rec[lay.scales_off..lay.scales_off + lay.scales_len].chunks_exact_mut(2).enumerate() {
                    let cols = if r < 2 * gs { lay.lat } else { lay.m };
                    let s = (0.6 + 0.4 * rng.unif()) / (cols as f32).sqrt() / spread;
                    c.copy_from_slice(&f32_to_f16(s).to_le_bytes());
                }
            }
        }
        bw.write(&mut rec)?;
        let d = done.fetch_add(lay.rec_bytes as u64, std::sync::atomic::Ordering::Relaxed) + lay.rec_bytes as u64;
        progress(d, total);
    }
    bw.finish()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use waste_format::Container;

    /// Only an absent or empty folder, or a synthetic container written
    /// here before, is (re)written; a folder with anything else in it (a
    /// converted model), a file, or a foreign staging folder is refused and
    /// left as it was. An interrupted run's staging folder is cleared.
    #[test]
    fn the_output_replaces_only_what_synth_wrote() {
        let base = std::env::temp_dir().join(format!("waste-synth-out-{}", std::process::id()));
        std::fs::create_dir_all(&base).unwrap();
        let opts = SynthOptions {
            config: shape_config("tiny").unwrap(),
            layers: None,
            experts: ExpertFmt::Vq3r,
            seed: 1,
            manifest_only: true,
            skewed: false,
            jobs: 1,
        };
        let out = base.join("c.waste");
        // a user's folder with a file in it
        std::fs::create_dir_all(&out).unwrap();
        std::fs::write(out.join("trunk.bin"), b"my model").unwrap();
        let e = synth(&out, &opts, &|_, _| {}).unwrap_err().to_string();
        assert!(e.contains("is not synthetic output") && e.contains("nothing was changed"), "{e}");
        assert_eq!(std::fs::read(out.join("trunk.bin")).unwrap(), b"my model");
        assert_eq!(std::fs::read_dir(&base).unwrap().count(), 1, "no staging folder left");
        // a file
        let f = base.join("f.waste");
        std::fs::write(&f, b"x").unwrap();
        assert!(synth(&f, &opts, &|_, _| {}).unwrap_err().to_string().contains("not a folder"));
        // empty, then again (its own), with a leftover staging folder of its own
        std::fs::remove_dir_all(&out).unwrap();
        std::fs::create_dir_all(&out).unwrap();
        synth(&out, &opts, &|_, _| {}).unwrap();
        let stage = base.join("c.waste.partial");
        std::fs::create_dir_all(&stage).unwrap();
        std::fs::write(stage.join(SYNTH_MARKER), "{}").unwrap();
        std::fs::write(stage.join("trunk.bin"), b"half").unwrap();
        synth(&out, &opts, &|_, _| {}).unwrap();
        assert!(!stage.exists() && out.join(SYNTH_MARKER).is_file());
        Container::open(&out).unwrap();
        // a staging folder that is someone else's
        std::fs::create_dir_all(&stage).unwrap();
        std::fs::write(stage.join("notes"), b"mine").unwrap();
        assert!(synth(&out, &opts, &|_, _| {}).is_err());
        assert_eq!(std::fs::read(stage.join("notes")).unwrap(), b"mine");
        std::fs::remove_dir_all(&base).ok();
    }

    #[test]
    fn every_tiny_shape_roundtrips_through_the_reader() {
        for shape in ["tiny", "tiny-b", "tiny-c", "tiny-k3"] {
            for ex in [ExpertFmt::Vq3r, ExpertFmt::Vq4p, ExpertFmt::F16, ExpertFmt::Q4g] {
                let dir =
                    std::env::temp_dir().join(format!("waste-synth-{}-{shape}-{}", std::process::id(), ex.name()));
                let opts = SynthOptions {
                    config: shape_config(shape).unwrap(),
                    layers: None,
                    experts: ex,
                    seed: 7,
                    manifest_only: false,
                    skewed: false,
                    jobs: 2,
                };
                synth(&dir, &opts, &|_, _| {}).unwrap();
                let c = Container::open(&dir).unwrap_or_else(|e| panic!("{shape} {ex:?}: {e}"));
                assert_eq!(c.config.attn_kinds.len(), c.config.layers);
                // what was asked for is what the reader sees
                let want = &opts.config;
                let n = |k: &str| want[k].as_u64().map(|v| v as usize);
                assert_eq!(Some(c.config.hidden), n("hidden_size"), "{shape}");
                assert_eq!(Some(c.config.layers), n("num_hidden_layers"), "{shape}");
                assert_eq!(Some(c.config.vocab), n("vocab_size"), "{shape}");
                if let Some(e) = n("num_experts").or(n("n_routed_experts")) {
                    assert_eq!(c.config.experts, e, "{shape}");
                }
                let (q, lay) = c.experts.as_ref().expect("an MoE shape");
                assert_eq!(q.fmt, ex);
                // every tensor the forward pass needs, and every expert record
                // valid with its CRC, naming its own layer and expert
                for r in waste_format::required_tensors(&c.config) {
                    c.tensor(&r.name).unwrap_or_else(|e| panic!("{shape}: {e}"));
                }
                let mut records = 0;
                for b in c.banks.iter().flatten() {
                    let bytes = std::fs::read(&b.path).unwrap();
                    for e in 0..b.experts {
                        let off = b.record_offset(e, lay) as usize;
                        let rec = &bytes[off..off + lay.rec_bytes];
                        waste_format::check_record(rec, b.layer, e, lay, b.codebook_base, c.codebooks.count, true)
                            .unwrap_or_else(|err| panic!("{shape} {ex:?}: {err}"));
                        records += 1;
                    }
                }
                assert_eq!(records, c.config.n_moe_layers() * c.config.experts);
                // deterministic per seed
                let a = std::fs::read(dir.join("trunk.bin")).unwrap();
                synth(&dir, &opts, &|_, _| {}).unwrap();
                assert_eq!(a, std::fs::read(dir.join("trunk.bin")).unwrap());
                std::fs::remove_dir_all(&dir).ok();
            }
        }
    }

    #[test]
    fn random_codes_are_zero_mean() {
        for (fmt, want_std) in [(Fmt::Q4G, 4.18f64), (Fmt::Q8G, 73.47)] {
            let lut = zero_mean_codes(fmt);
            let vals: Vec<f64> = (0..=255u8)
                .flat_map(|b| {
                    let c = lut[b as usize];
                    if fmt == Fmt::Q8G {
                        vec![c as i8 as f64]
                    } else {
                        vec![(c & 15) as f64 - 8.0, (c >> 4) as f64 - 8.0]
                    }
                })
                .collect();
            let mean = vals.iter().sum::<f64>() / vals.len() as f64;
            let std = (vals.iter().map(|v| v * v).sum::<f64>() / vals.len() as f64).sqrt();
            assert_eq!(mean, 0.0, "{fmt:?}");
            assert!((std - want_std).abs() < 0.01, "{fmt:?}: std {std}");
        }
    }
}
