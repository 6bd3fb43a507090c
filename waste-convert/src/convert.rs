//! The conversion pipeline.

/// One expert's record body, then per matrix kind (gate, up, down) the squared
/// reconstruction error and the squared weight norm.
type EncodedExpert = (Vec<u8>, [f64; 3], [f64; 3]);
use crate::names::{read, read_expert};
use crate::source::Source;
use crate::vision::{tensors as vision_tensors, vision_json, VisionMode};
use crate::{Error, Result};
use std::path::{Path, PathBuf};
use std::time::Instant;
use waste_format::half::{f32_to_bf16, f32_to_f16};
use waste_format::{
    flatten_text_config, required_tensors, write_atomic, write_manifest, Codebooks, Expect, ExpertFmt, ExpertQuant,
    Fmt, LayerEntry, Manifest, ModelConfig, RecordLayout, TensorEntry, TrunkWriter, FORMAT_VERSION,
};
use waste_quant::vq::{VqBook, VqLayout};
use waste_quant::vq_encode::{encode_matrix, fit_books, sample_vectors};

/// How trunk tensors are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrunkMode {
    /// Q4G matrices, Q8G embedding/head, F32 small tensors (default).
    Q4,
    /// Q8G matrices.
    Q8,
    /// Every tensor F16 (exact comparisons when the source is f16-exact).
    F16,
    /// Every tensor F32.
    F32,
}

impl TrunkMode {
    /// Parse `q4 | q8 | f16 | f32`.
    pub fn parse(s: &str) -> Option<TrunkMode> {
        match s {
            "q4" => Some(TrunkMode::Q4),
            "q8" => Some(TrunkMode::Q8),
            "f16" => Some(TrunkMode::F16),
            "f32" => Some(TrunkMode::F32),
            _ => None,
        }
    }
}

/// How the output head (`lm_head`, or the embedding table when the head is
/// tied to it) is stored, when not as the trunk mode says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadMode {
    /// 8-bit groups (what the trunk modes Q4 and Q8 give the head).
    Q8,
    /// 4-bit groups: half the bytes of Q8G. The head is most of a token's
    /// reads on a model whose experts are few or cached, so this is the
    /// speed-for-accuracy trade llama.cpp's `--output-tensor-type` offers.
    Q4,
}

impl HeadMode {
    /// Parse `q8 | q4`.
    pub fn parse(s: &str) -> Option<HeadMode> {
        match s {
            "q8" => Some(HeadMode::Q8),
            "q4" => Some(HeadMode::Q4),
            _ => None,
        }
    }
}

/// Conversion options.
#[derive(Clone, Debug)]
pub struct ConvertOptions {
    /// Expert format.
    pub experts: ExpertFmt,
    /// Trunk format.
    pub trunk: TrunkMode,
    /// The head's format; `None` leaves it to the trunk mode (Q8G for Q4 and
    /// Q8, F16 or F32 for those modes).
    pub head: Option<HeadMode>,
    /// Convert only the MoE banks of layers `A..=B` in this run.
    pub layers: Option<(usize, usize)>,
    /// Encoder threads.
    pub jobs: usize,
    /// Seed (same seed and source → byte-identical container).
    pub seed: u64,
    /// Experts sampled per layer to fit the codebooks.
    pub cb_sample: usize,
    /// k-means iterations.
    pub kmeans_iters: usize,
    /// Stop after this many banks (to test resumption).
    pub stop_after_banks: Option<usize>,
    /// Discard an unfinished conversion made with other options (only a
    /// staging folder this converter made, recognised by its fingerprint).
    pub force: bool,
    /// How K3's vision tower is stored (when the source has one).
    pub vision: VisionMode,
}

/// Most encoder threads a conversion starts.
pub const MAX_JOBS: usize = 256;
/// Most k-means iterations per codebook.
pub const MAX_KMEANS_ITERS: usize = 1000;

impl ConvertOptions {
    /// Every option in its range.
    ///
    /// # Errors
    /// [`Error::Arg`] naming the option: `jobs` outside `1..=`[`MAX_JOBS`],
    /// `cb_sample` 0, `kmeans_iters` over [`MAX_KMEANS_ITERS`], a `layers`
    /// range whose start is past its end.
    pub fn check(&self) -> Result<()> {
        if !(1..=MAX_JOBS).contains(&self.jobs) {
            return Err(Error::Arg(format!("{} encoder threads (jobs): expected 1 to {MAX_JOBS}", self.jobs)));
        }
        if self.cb_sample == 0 {
            return Err(Error::Arg("cb_sample 0: the codebooks need at least one sampled expert".into()));
        }
        if self.kmeans_iters > MAX_KMEANS_ITERS {
            return Err(Error::Arg(format!("{} k-means iterations: at most {MAX_KMEANS_ITERS}", self.kmeans_iters)));
        }
        if let Some((a, b)) = self.layers.filter(|(a, b)| a > b) {
            return Err(Error::Arg(format!("layers {a}-{b}: the first layer is past the last")));
        }
        Ok(())
    }
}

impl Default for ConvertOptions {
    fn default() -> Self {
        ConvertOptions {
            experts: ExpertFmt::Vq3r,
            trunk: TrunkMode::Q4,
            head: None,
            layers: None,
            jobs: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            seed: 0,
            cb_sample: 8,
            kmeans_iters: 10,
            stop_after_banks: None,
            force: false,
            vision: VisionMode::Q8,
        }
    }
}

/// Progress events.
#[derive(Clone, Copy, Debug)]
pub enum Progress {
    /// Trunk tensors written.
    Trunk {
        /// Done.
        done: usize,
        /// Total.
        total: usize,
    },
    /// Experts encoded, over all banks of this run.
    Experts {
        /// Done.
        done: usize,
        /// Total.
        total: usize,
    },
}

/// What a conversion (or a verification) measured.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// Relative Frobenius error per matrix kind (gate, up, down) over all converted experts.
    pub rel_error: [f64; 3],
    /// Per layer `(layer, [gate, up, down])`.
    pub per_layer: Vec<(usize, [f64; 3])>,
    /// Experts encoded in this run.
    pub experts: usize,
    /// Banks skipped because a previous run finished them.
    pub resumed_layers: Vec<usize>,
    /// Seconds.
    pub seconds: f64,
    /// Whether the manifest was written (all layers done) and the container
    /// moved to `--out`.
    pub complete: bool,
    /// Where the unfinished conversion waits when not complete.
    pub staging: Option<std::path::PathBuf>,
    /// Checkpoint tensors the container left out, when this run read the
    /// whole source itself (not a resumed or `--layers` run): weights a
    /// model variant has and the engine does not use (biases, say) would
    /// otherwise vanish without a word. The vision tower under
    /// `--no-vision`, a tied `lm_head` and multi-token-prediction layers
    /// past `num_hidden_layers` are left out knowingly and not listed.
    pub unused_tensors: Option<Vec<String>>,
}

fn kind_names() -> [&'static str; 3] {
    ["gate", "up", "down"]
}

/// The fingerprint of a conversion: what must match for a resume.
fn fingerprint(src_dir: &Path, src: &Source, o: &ConvertOptions) -> serde_json::Value {
    let canon = src_dir.canonicalize().unwrap_or_else(|_| src_dir.to_path_buf());
    let config_crc = crc32fast::hash(serde_json::to_string(&src.config).unwrap_or_default().as_bytes());
    let mut fp = serde_json::json!({
        "source": canon.to_string_lossy(),
        "source_config_crc32": config_crc,
        "source_tensors": src.names().count(),
        "experts": o.experts.name(),
        "trunk": format!("{:?}", o.trunk).to_lowercase(),
        "seed": o.seed,
        "cb_sample": o.cb_sample,
        "kmeans_iters": o.kmeans_iters,
        "vision": format!("{:?}", o.vision).to_lowercase(),
    });
    // only when set: a staging folder from before `--head` existed resumes
    if let Some(h) = o.head {
        fp["head"] = format!("{h:?}").to_lowercase().into();
    }
    fp
}

/// `a` as an absolute, symlink-free path even when it does not exist yet
/// (its nearest existing ancestor is resolved).
fn resolved(a: &Path) -> PathBuf {
    let abs = if a.is_absolute() {
        a.to_path_buf()
    } else {
        std::env::current_dir().map(|d| d.join(a)).unwrap_or_else(|_| a.to_path_buf())
    };
    let mut tail = Vec::new();
    let mut cur = abs.as_path();
    loop {
        if let Ok(c) = cur.canonicalize() {
            let mut p = c;
            for t in tail.iter().rev() {
                p.push(t);
            }
            return p;
        }
        match (cur.parent(), cur.file_name()) {
            (Some(parent), Some(name)) => {
                tail.push(name.to_os_string());
                cur = parent;
            }
            _ => return abs,
        }
    }
}

fn is_empty_dir(p: &Path) -> bool {
    std::fs::read_dir(p).is_ok_and(|mut d| d.next().is_none())
}

/// Convert `src` into a container at `out`.
///
/// Nothing at `out` is touched until the conversion is complete: the work
/// happens in [`staging_dir`](waste_format::staging_dir)`(out)`, which starts with a fingerprint of the
/// source and the options; a later run with the same ones resumes it, one
/// with other ones is refused (or, with `force`, starts over). When every
/// bank is written the container is validated and renamed to `out`.
///
/// # Errors
/// [`Error::Arg`] for an option out of range ([`ConvertOptions::check`],
/// before anything is read or written), [`Error::Overlap`] when `out` and `src` overlap, [`Error::OutputExists`]
/// for a non-empty `out`, [`Error::ResumeMismatch`] / [`Error::ForeignStaging`]
/// for a staging folder that is not this conversion's; source errors name
/// the tensor and the file.
pub fn convert(src_dir: &Path, out: &Path, o: &ConvertOptions, progress: &(dyn Fn(Progress) + Sync)) -> Result<Report> {
    o.check()?;
    let t0 = Instant::now();
    let (rs, ro) = (resolved(src_dir), resolved(out));
    let stage = waste_format::staging_dir(&ro);
    if rs == ro || ro.starts_with(&rs) || rs.starts_with(&ro) || rs.starts_with(&stage) {
        return Err(Error::Overlap { src: src_dir.into(), out: out.into() });
    }
    if ro.exists() && !is_empty_dir(&ro) {
        return Err(Error::OutputExists(out.into()));
    }
    let src = Source::open(src_dir)?;
    let config = flatten_text_config(&src.config);
    let prefix = if src.names().any(|n| n.starts_with("language_model.")) { "language_model." } else { "" }.to_string();
    let cfg = ModelConfig::from_json(&config)?;
    let vision = match o.vision {
        VisionMode::Off => None,
        _ => vision_json(src_dir, &src, cfg.hidden, cfg.vocab)?,
    };
    let q = ExpertQuant::standard(o.experts);
    let lay = RecordLayout::new(&cfg, q)?;
    let fp = fingerprint(src_dir, &src, o);
    let fp_path = stage.join("convert.fingerprint.json");
    if stage.exists() {
        let old: Option<serde_json::Value> = std::fs::read(&fp_path).ok().and_then(|b| serde_json::from_slice(&b).ok());
        match old {
            None => return Err(Error::ForeignStaging(stage)),
            Some(old) if old != fp => {
                if o.force {
                    std::fs::remove_dir_all(&stage).map_err(|e| Error::io(&stage, e))?;
                } else {
                    let differs = fp
                        .as_object()
                        .into_iter()
                        .flatten()
                        .filter(|(k, v)| old.get(k.as_str()) != Some(v))
                        .map(|(k, v)| {
                            format!("{k} {} (now {v})", old.get(k.as_str()).unwrap_or(&serde_json::Value::Null))
                        })
                        .collect::<Vec<_>>()
                        .join(", ");
                    return Err(Error::ResumeMismatch { dir: stage, differs });
                }
            }
            Some(_) => {}
        }
    }
    if !stage.exists() {
        std::fs::create_dir_all(&stage).map_err(|e| Error::io(&stage, e))?;
        write_atomic(&fp_path, &serde_json::to_vec_pretty(&fp).map_err(|e| Error::Source(e.to_string()))?)?;
    }
    let out_final = ro;
    let out = stage.as_path();
    let mut rep = Report { staging: Some(stage.clone()), ..Report::default() };

    // --- trunk (once; the sidecar marks it finished)
    let side = out.join("trunk.entries.json");
    // whether this run reads the trunk itself (not a resumed one's sidecar)
    let mut trunk_read_here = false;
    let trunk: Vec<TensorEntry> = match std::fs::read(&side).ok().and_then(|b| serde_json::from_slice(&b).ok()) {
        Some(t) => t,
        None => {
            trunk_read_here = true;
            let reqs: Vec<_> = required_tensors(&cfg);
            let nvis = vision.as_ref().map_or(0, |(_, vc)| vc.tensors().len());
            let mut tw = TrunkWriter::create(out)?;
            for (i, req) in reqs.iter().enumerate() {
                let (shape, v) = read(&src, &prefix, &req.name, &cfg)?;
                if !req.expect.accepts_shape(&shape) {
                    return Err(Error::Source(format!(
                        "{}: shape {shape:?}, the config needs {:?}",
                        req.name, req.expect
                    )));
                }
                let n: usize = shape.iter().product();
                let name = format!("{prefix}{}", req.name);
                let (rows, cols) = match req.expect {
                    Expect::Mat(r, c) => (r, c),
                    _ => (1, n),
                };
                let small = rows == 1
                    || n < 65_536
                    || ["norm", "bias", "A_log", "dt_bias", "conv1d", "_res_proj"].iter().any(|k| req.name.contains(k));
                let ends = req.name.contains("embed_tokens") || req.name == "lm_head.weight";
                // the head: lm_head, or the embedding table it is tied to
                let head = req.name == "lm_head.weight" || (cfg.tie_embeddings && req.name.contains("embed_tokens"));
                let fmt = match o.trunk {
                    _ if head && o.head == Some(HeadMode::Q4) => Fmt::Q4G,
                    _ if head && o.head == Some(HeadMode::Q8) => Fmt::Q8G,
                    TrunkMode::F32 => Fmt::F32,
                    TrunkMode::F16 => Fmt::F16,
                    _ if small && !ends => Fmt::F32,
                    _ if ends || o.trunk == TrunkMode::Q8 => Fmt::Q8G,
                    _ => Fmt::Q4G,
                };
                let stored_shape: Vec<usize> = if rows == 1 { shape.clone() } else { vec![rows, cols] };
                add_tensor(&mut tw, &name, fmt, &stored_shape, rows, cols, &v)?;
                progress(Progress::Trunk { done: i + 1, total: reqs.len() + nvis });
            }
            // K3's vision tower, outside the text prefix under its release names
            if let Some((_, vc)) = &vision {
                for (k, (name, fmt, rows, cols, v)) in vision_tensors(&src, vc, o.vision)?.into_iter().enumerate() {
                    let shape: Vec<usize> = if rows == 1 { vec![cols] } else { vec![rows, cols] };
                    add_tensor(&mut tw, &name, fmt, &shape, rows, cols, &v)?;
                    progress(Progress::Trunk { done: reqs.len() + k + 1, total: reqs.len() + nvis });
                }
            }
            let entries = tw.finish()?;
            write_atomic(&side, &serde_json::to_vec(&entries).map_err(|e| Error::Source(e.to_string()))?)?;
            entries
        }
    };

    // --- expert banks, one layer at a time (resumable)
    let moe: Vec<usize> = cfg.moe_layers().collect();
    let bpl = q.books_per_layer();
    let todo: Vec<(usize, usize)> =
        moe.iter().copied().enumerate().filter(|(_, l)| o.layers.is_none_or(|(a, b)| (a..=b).contains(l))).collect();
    let total = todo.len() * cfg.experts;
    let mut done_experts = 0usize;
    let mut banks_this_run = 0usize;
    let mut err = [0f64; 3];
    let mut tot = [0f64; 3];
    for &(mi, l) in &todo {
        let bank = out.join(format!("experts-L{l}.bin"));
        let cbp = out.join(format!("codebooks-L{l}.part"));
        let want = (cfg.experts * lay.rec_bytes) as u64;
        if std::fs::metadata(&bank).is_ok_and(|m| m.len() == want) && (!q.fmt.is_vq() || cbp.exists()) {
            rep.resumed_layers.push(l);
            done_experts += cfg.experts;
            continue;
        }
        if o.stop_after_banks.is_some_and(|k| banks_this_run >= k) {
            return Err(Error::Interrupted(banks_this_run));
        }
        let base = mi * bpl;
        let books = if q.fmt.is_vq() { fit_layer_books(&src, &prefix, l, &cfg, &q, o)? } else { vec![] };
        if q.fmt.is_vq() {
            let mut cb = Vec::new();
            for (k, b) in books.iter().enumerate() {
                Codebooks::encode_record(base + k, &q, b, &mut cb);
            }
            write_atomic(&cbp, &cb)?;
        }
        let vbooks: Vec<VqBook> = books.iter().map(|b| VqBook::from_f16(b, q.entries, q.vec_dim)).collect();
        let part = out.join(format!("experts-L{l}.bin.part"));
        let mut bw = waste_format::BankWriter::create(&part, l, lay, base as u16)?;
        let mut lerr = [0f64; 3];
        let mut ltot = [0f64; 3];
        let batch = o.jobs.max(1) * 2;
        let mut e0 = 0;
        while e0 < cfg.experts {
            let n = batch.min(cfg.experts - e0);
            let results = in_parallel(e0..e0 + n, o.jobs, |e| encode_expert(&src, &prefix, l, e, &lay, &vbooks))?;
            for r in results {
                let (mut rec, e2, t2) = r?;
                for k in 0..3 {
                    lerr[k] += e2[k];
                    ltot[k] += t2[k];
                }
                bw.write(&mut rec)?;
                done_experts += 1;
                rep.experts += 1;
                progress(Progress::Experts { done: done_experts, total });
            }
            e0 += n;
        }
        // every expert, in order, before the bank takes its name
        let written = bw.finish()?;
        if written != cfg.experts {
            return Err(Error::Encoder(format!("layer {l}: {written} of {} experts encoded", cfg.experts)));
        }
        std::fs::rename(&part, &bank).map_err(|e| Error::io(&bank, e))?;
        for k in 0..3 {
            err[k] += lerr[k];
            tot[k] += ltot[k];
        }
        rep.per_layer.push((l, std::array::from_fn(|k| (lerr[k] / ltot[k].max(1e-300)).sqrt())));
        banks_this_run += 1;
    }
    rep.rel_error = std::array::from_fn(|k| (err[k] / tot[k].max(1e-300)).sqrt());

    // --- finish when every bank exists
    let all_done = moe.iter().all(|l| {
        std::fs::metadata(out.join(format!("experts-L{l}.bin")))
            .is_ok_and(|m| m.len() == (cfg.experts * lay.rec_bytes) as u64)
    });
    if all_done {
        if q.fmt.is_vq() {
            let mut cb = Vec::new();
            for l in &moe {
                let p = out.join(format!("codebooks-L{l}.part"));
                cb.extend(std::fs::read(&p).map_err(|e| Error::io(&p, e))?);
            }
            write_atomic(&out.join("codebooks.bin"), &cb)?;
        }
        copy_tokenizer(src_dir, out)?;
        if let Some((vj, _)) = &vision {
            let b = serde_json::to_vec_pretty(vj).map_err(|e| Error::Source(e.to_string()))?;
            write_atomic(&out.join("vision.json"), &b)?;
        }
        let layers = moe
            .iter()
            .enumerate()
            .map(|(i, &l)| {
                (
                    l.to_string(),
                    LayerEntry {
                        file: format!("experts-L{l}.bin"),
                        experts: cfg.experts as u64,
                        bytes: (cfg.experts * lay.rec_bytes) as u64,
                        codebook_base: (i * bpl) as u64,
                    },
                )
            })
            .collect();
        let arch = config.get("model_type").and_then(|v| v.as_str()).unwrap_or("").to_string();
        let m = Manifest {
            format_version: FORMAT_VERSION,
            arch,
            tensor_prefix: prefix,
            config,
            expert_quant: (!moe.is_empty()).then(|| q.to_entry()),
            layers,
            trunk,
        };
        write_manifest(out, &m)?;
        for l in &moe {
            let _ = std::fs::remove_file(out.join(format!("codebooks-L{l}.part")));
            // a half-written bank of a killed run whose layer a later run finished
            let _ = std::fs::remove_file(out.join(format!("experts-L{l}.bin.part")));
        }
        let _ = std::fs::remove_file(&side);
        // the whole container must validate before it takes the name
        waste_format::Container::open(out)?;
        let _ = std::fs::remove_file(&fp_path);
        if out_final.exists() {
            // an empty folder (checked at the start) gives way to the container
            std::fs::remove_dir(&out_final).map_err(|e| Error::io(&out_final, e))?;
        }
        std::fs::rename(out, &out_final).map_err(|e| Error::io(&out_final, e))?;
        rep.complete = true;
        rep.staging = None;
        if trunk_read_here && rep.resumed_layers.is_empty() && o.layers.is_none() {
            rep.unused_tensors = Some(unused_tensors(&src, &cfg, vision.is_some()));
        }
    }
    rep.seconds = t0.elapsed().as_secs_f64();
    let _ = kind_names();
    Ok(rep)
}

/// `f(i)` for every `i` of `items` on `jobs` threads (item `j`, `j + jobs`,
/// … on thread `j`), the results in item order. A thread the OS refuses or
/// a job that panics is an error ([`Error::Encoder`]): a result is never
/// silently missing, so a bank never gets fewer records than it names.
fn in_parallel<T: Send>(items: std::ops::Range<usize>, jobs: usize, f: impl Fn(usize) -> T + Sync) -> Result<Vec<T>> {
    let jobs = jobs.max(1);
    let f = &f;
    std::thread::scope(|s| {
        let mut hs = Vec::with_capacity(jobs);
        for j in 0..jobs {
            let part = (items.start + j..items.end).step_by(jobs);
            let h = std::thread::Builder::new()
                .spawn_scoped(s, move || part.map(|i| (i, f(i))).collect::<Vec<_>>())
                .map_err(|e| Error::Encoder(format!("cannot start an encoder thread: {e}")))?;
            hs.push(h);
        }
        let mut all = Vec::with_capacity(items.len());
        for h in hs {
            all.extend(h.join().map_err(|_| Error::Encoder("an encoder thread panicked".into()))?);
        }
        all.sort_by_key(|x| x.0);
        Ok(all.into_iter().map(|x| x.1).collect())
    })
}

/// The source's tensors no read touched, less those left out knowingly:
/// the vision tower when it is not converted, `lm_head` when the embedding
/// is tied, and layers past `num_hidden_layers` (multi-token prediction).
fn unused_tensors(src: &Source, cfg: &waste_format::ModelConfig, with_vision: bool) -> Vec<String> {
    let beyond_layers = |n: &str| {
        n.split("layers.")
            .nth(1)
            .and_then(|rest| rest.split('.').next())
            .and_then(|i| i.parse::<usize>().ok())
            .is_some_and(|i| i >= cfg.layers)
    };
    src.unused()
        .into_iter()
        .filter(|n| with_vision || !waste_format::is_vision_tensor(n))
        .filter(|n| !(cfg.tie_embeddings && n.ends_with("lm_head.weight")))
        .filter(|n| !beyond_layers(n))
        .collect()
}

/// Append one tensor of `rows × cols` values in `fmt` (grouped formats by 128).
fn add_tensor(
    tw: &mut TrunkWriter,
    name: &str,
    fmt: Fmt,
    shape: &[usize],
    rows: usize,
    cols: usize,
    v: &[f32],
) -> Result<()> {
    use waste_quant::formats::{tensor_format, EncodeError};
    let group = if fmt.is_grouped() { 128 } else { 0 };
    let (d, s) = (tensor_format(fmt).encode)(v, rows, cols, group).map_err(|e| match e {
        EncodeError::Value(i) => beyond_f16(format!("tensor {name}: element {i} ({})", v[i])),
        EncodeError::Scale { row, group } => {
            beyond_f16(format!("tensor {name}: the scale of row {row}, group {group}"))
        }
    })?;
    let shape = if fmt.is_grouped() { vec![rows, cols] } else { shape.to_vec() };
    tw.add(name, fmt, &shape, group, &d, &s)?;
    Ok(())
}

/// [`Error::Source`] for a value beyond f16's range (it became an infinity:
/// the source's values are finite, checked when read), `what` naming it.
fn beyond_f16(what: String) -> Error {
    Error::Source(format!("{what} exceeds f16's range (±65504); choose a wider format (f32 trunk, bf16 experts)"))
}

/// Codebooks of one layer: for each kind and stage, k-means on a sample.
fn fit_layer_books(
    src: &Source,
    prefix: &str,
    l: usize,
    cfg: &ModelConfig,
    q: &ExpertQuant,
    o: &ConvertOptions,
) -> Result<Vec<Vec<u16>>> {
    let ns = o.cb_sample.clamp(1, cfg.experts);
    // a deterministic spread of experts
    let chosen: Vec<usize> = (0..ns)
        .map(|i| (i * cfg.experts / ns + (o.seed as usize + l) % (cfg.experts / ns).max(1)) % cfg.experts)
        .collect();
    let mut samples: [Vec<f32>; 3] = Default::default();
    // at most 2^15 vectors per kind in total, spread over the sampled experts
    for &e in &chosen {
        let m = read_expert(src, prefix, l, e)?;
        for (k, (rows, cols, w)) in m.iter().enumerate() {
            let max_rows = ((1usize << 15) * q.vec_dim / cols / ns).max(1);
            sample_vectors(
                w,
                *rows,
                *cols,
                q.vec_dim,
                max_rows,
                o.seed ^ ((l * 1000 + e * 3 + k) as u64),
                &mut samples[k],
            );
        }
    }
    let mut books = Vec::with_capacity(3 * q.stages);
    for (k, s) in samples.iter().enumerate() {
        books.extend(fit_books(s, q.vec_dim, q.stages, q.entries, o.kmeans_iters, o.seed ^ ((l * 31 + k) as u64)));
    }
    Ok(books)
}

/// Read expert `e` of layer `l` (gate, up, down), each matrix checked to
/// have the shape the record layout holds.
#[allow(clippy::type_complexity)]
fn read_expert_shaped(
    src: &Source,
    prefix: &str,
    l: usize,
    e: usize,
    lay: &RecordLayout,
) -> Result<[(usize, usize, Vec<f32>); 3]> {
    let m = read_expert(src, prefix, l, e)?;
    let shapes = [(lay.m, lay.lat), (lay.m, lay.lat), (lay.lat, lay.m)];
    for (k, (rows, cols, _)) in m.iter().enumerate() {
        if (*rows, *cols) != shapes[k] {
            return Err(Error::Source(format!(
                "expert {e} of layer {l}: {} is {rows}x{cols}, the config needs {}x{}",
                kind_names()[k],
                shapes[k].0,
                shapes[k].1
            )));
        }
    }
    Ok(m)
}

/// Encode one expert into a record body (header sealed by the bank writer).
fn encode_expert(
    src: &Source,
    prefix: &str,
    l: usize,
    e: usize,
    lay: &RecordLayout,
    books: &[VqBook],
) -> Result<EncodedExpert> {
    let m = read_expert_shaped(src, prefix, l, e, lay)?;
    let q = lay.quant;
    let mut rec = vec![0u8; lay.rec_bytes];
    let offs = [lay.gate_off, lay.up_off, lay.down_off];
    let mut e2 = [0f64; 3];
    let mut t2 = [0f64; 3];
    for k in 0..3 {
        let (rows, cols, w) = &m[k];
        if q.fmt.is_vq() {
            let vl = VqLayout::for_expert(&q, *rows, *cols);
            let br: Vec<&VqBook> = books[k * q.stages..(k + 1) * q.stages].iter().collect();
            let (idx, rest) = rec.split_at_mut(lay.scales_off);
            let sc = &mut rest[lay.scale_bytes(k)];
            let (a, b) = encode_matrix(w, *cols, &br, &vl, &mut idx[offs[k]..offs[k] + vl.index_bytes()], sc);
            e2[k] = a;
            t2[k] = b;
            if let Some(r) = waste_format::half::first_non_finite_f16(sc) {
                return Err(beyond_f16(format!("expert {e} of layer {l}, {}: the scale of row {r}", kind_names()[k])));
            }
        } else if q.fmt == ExpertFmt::Q4g {
            let g = q.fmt.group();
            let (data, scales) = waste_quant::quantize_groups(waste_format::Fmt::Q4G, *rows, *cols, g, w);
            if let Some(i) = waste_format::half::first_non_finite_f16(&scales) {
                let sr = cols.div_ceil(g);
                let at = format!("row {}, columns from {}", i / sr, i % sr * g);
                return Err(beyond_f16(format!("expert {e} of layer {l}, {}: the scale of {at}", kind_names()[k])));
            }
            rec[offs[k]..offs[k] + data.len()].copy_from_slice(&data);
            rec[lay.scales_off..][lay.scale_bytes(k)].copy_from_slice(&scales);
            let back = q4g_rows(&data, &scales, *rows, *cols);
            for (b, v) in back.iter().zip(w.iter()) {
                e2[k] += ((b - v) as f64).powi(2);
                t2[k] += (*v as f64).powi(2);
            }
        } else {
            for (i, v) in w.iter().enumerate() {
                let h = if q.fmt == ExpertFmt::Bf16 { f32_to_bf16(*v) } else { f32_to_f16(*v) };
                if q.fmt != ExpertFmt::Bf16 && !waste_format::half::f16_is_finite(h) {
                    return Err(beyond_f16(format!("expert {e} of layer {l}, {}: element {i} ({v})", kind_names()[k])));
                }
                rec[offs[k] + 2 * i..offs[k] + 2 * i + 2].copy_from_slice(&h.to_le_bytes());
                let back = if q.fmt == ExpertFmt::Bf16 {
                    waste_format::half::bf16_to_f32(h)
                } else {
                    waste_format::half::f16_to_f32(h)
                };
                e2[k] += ((back - v) as f64).powi(2);
                t2[k] += (*v as f64).powi(2);
            }
        }
    }
    Ok((rec, e2, t2))
}

/// Record `e` of a bank (records of `rec.len()` bytes) into `rec`.
fn read_record(file: &mut std::fs::File, path: &Path, e: usize, rec: &mut [u8]) -> Result<()> {
    use std::io::{Read, Seek, SeekFrom};
    let at = (e as u64)
        .checked_mul(rec.len() as u64)
        .ok_or_else(|| Error::Source(format!("record {e} offset overflows")))?;
    file.seek(SeekFrom::Start(at)).and_then(|_| file.read_exact(rec)).map_err(|err| Error::io(path, err))
}

/// The values of `rows` Q4G rows of `cols` columns (group
/// [`waste_format::Q4G_GROUP`]), as the engine dequantizes them.
fn q4g_rows(data: &[u8], scales: &[u8], rows: usize, cols: usize) -> Vec<f32> {
    let s: Vec<u16> = scales.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
    let m = waste_quant::MatRef {
        fmt: waste_format::Fmt::Q4G,
        rows,
        cols,
        group: waste_format::Q4G_GROUP,
        data,
        scales: &s,
    };
    let mut out = vec![0f32; rows * cols];
    for (r, o) in out.chunks_exact_mut(cols).enumerate() {
        m.row(r, o);
    }
    out
}

/// Copy the tokenizer: `tiktoken.model` (or `tokenizer.model`) → `tokenizer.model`,
/// specials from `tokenizer_config.json`'s `added_tokens_decoder` → `specials.json`,
/// and `chat_template.jinja` when present.
fn copy_tokenizer(src: &Path, out: &Path) -> Result<()> {
    use crate::source::{read_bounded, read_json, MAX_TEMPLATE_BYTES, MAX_TOKENIZER_BYTES};
    // bounded reads of untrusted files, at the engine's own limits
    for name in ["tiktoken.model", "tokenizer.model"] {
        if let Some(b) = read_bounded(&src.join(name), MAX_TOKENIZER_BYTES)? {
            write_atomic(&out.join("tokenizer.model"), &b)?;
            break;
        }
    }
    if let Some(v) = read_json(&src.join("tokenizer_config.json"))? {
        if let Some(m) = v.get("added_tokens_decoder").and_then(|m| m.as_object()) {
            let mut sp: Vec<(u64, String)> = m
                .iter()
                .filter_map(|(id, e)| Some((id.parse().ok()?, e.get("content")?.as_str()?.to_string())))
                .collect();
            sp.sort();
            let j: Vec<serde_json::Value> =
                sp.into_iter().map(|(id, text)| serde_json::json!({"id": id, "text": text})).collect();
            write_atomic(&out.join("specials.json"), serde_json::to_string_pretty(&j).unwrap_or_default().as_bytes())?;
        }
    }
    for name in ["chat_template.jinja", "chat.json"] {
        if let Some(b) = read_bounded(&src.join(name), MAX_TEMPLATE_BYTES)? {
            write_atomic(&out.join(name), &b)?;
        }
    }
    Ok(())
}

/// Re-check a finished container against its source: the relative
/// reconstruction error of every expert, per kind.
///
/// # Errors
/// [`Error::Source`] for a source tensor that is missing or malformed, and the container's own validation errors.
pub fn verify_against_source(container: &Path, src_dir: &Path) -> Result<Report> {
    let t0 = Instant::now();
    let c = waste_format::Container::open(container)?;
    let src = Source::open(src_dir)?;
    let Some((q, lay)) = c.experts else { return Ok(Report { complete: true, ..Default::default() }) };
    let prefix = c.manifest.tensor_prefix.clone();
    let mut rep = Report::default();
    let (mut err, mut tot) = ([0f64; 3], [0f64; 3]);
    for bank in c.banks.iter().flatten() {
        // one record at a time: a whole bank is ~11 GB on K3
        let mut file = std::fs::File::open(&bank.path).map_err(|e| Error::io(&bank.path, e))?;
        let mut rec = vec![0u8; lay.rec_bytes];
        let books: Vec<VqBook> = if q.fmt.is_vq() {
            (0..3 * q.stages)
                .map(|k| {
                    VqBook::from_f16(c.codebooks.book(bank.codebook_base + k).unwrap_or(&[]), q.entries, q.vec_dim)
                })
                .collect()
        } else {
            vec![]
        };
        let (mut le, mut lt) = ([0f64; 3], [0f64; 3]);
        for e in 0..bank.experts {
            read_record(&mut file, &bank.path, e, &mut rec)?;
            let rec = &rec[..];
            let hdr =
                waste_format::check_record(rec, bank.layer, e, &lay, bank.codebook_base, c.codebooks.count, true)?;
            // a source of another shape is named, not compared row by row
            let m = read_expert_shaped(&src, &prefix, bank.layer, e, &lay)?;
            let secs = hdr.sections();
            for k in 0..3 {
                let (rows, cols, w) = &m[k];
                let mut row = vec![0f32; *cols];
                let scales = &rec[secs[3]..][lay.scale_bytes(k)];
                let vl = VqLayout::for_expert(&q, *rows, *cols);
                let br: Vec<&VqBook> = books.get(k * q.stages..(k + 1) * q.stages).unwrap_or(&[]).iter().collect();
                // Q4G: the whole matrix at once, as the converter measured it
                let q4 = (q.fmt == ExpertFmt::Q4g).then(|| {
                    q4g_rows(
                        &rec[secs[k]..secs[k] + [lay.gate_len(), lay.gate_len(), lay.down_len()][k]],
                        scales,
                        *rows,
                        *cols,
                    )
                });
                for r in 0..*rows {
                    if q.fmt.is_vq() {
                        waste_quant::vq::dequant_row(&br, &vl, &rec[secs[k]..], scales, r, &mut row);
                    } else if let Some(back) = &q4 {
                        row.copy_from_slice(&back[r * cols..(r + 1) * cols]);
                    } else {
                        for (c2, x) in row.iter_mut().enumerate() {
                            let o = secs[k] + 2 * (r * cols + c2);
                            let h = u16::from_le_bytes([rec[o], rec[o + 1]]);
                            *x = if q.fmt == ExpertFmt::Bf16 {
                                waste_format::half::bf16_to_f32(h)
                            } else {
                                waste_format::half::f16_to_f32(h)
                            };
                        }
                    }
                    for (a, b) in row.iter().zip(&w[r * cols..(r + 1) * cols]) {
                        le[k] += ((a - b) as f64).powi(2);
                        lt[k] += (*b as f64).powi(2);
                    }
                }
            }
            rep.experts += 1;
        }
        for k in 0..3 {
            err[k] += le[k];
            tot[k] += lt[k];
        }
        rep.per_layer.push((bank.layer, std::array::from_fn(|k| (le[k] / lt[k].max(1e-300)).sqrt())));
    }
    rep.rel_error = std::array::from_fn(|k| (err[k] / tot[k].max(1e-300)).sqrt());
    rep.seconds = t0.elapsed().as_secs_f64();
    rep.complete = true;
    Ok(rep)
}

#[cfg(test)]
mod tests {
    use super::{in_parallel, Error};

    /// Every item once, in order, whatever the thread count.
    #[test]
    fn parallel_results_come_back_in_order() {
        for jobs in [0, 1, 2, 3, 7, 40] {
            let got = in_parallel(3..20, jobs, |i| i * i).unwrap();
            assert_eq!(got, (3..20).map(|i| i * i).collect::<Vec<_>>(), "jobs {jobs}");
        }
    }

    /// A job that panics is an error, not a missing result (a bank short of
    /// a record would label every later expert with the wrong id).
    #[test]
    fn a_panicking_job_is_an_error_not_a_gap() {
        let r = in_parallel(0..8, 3, |i| {
            assert!(i != 5, "expert 5 cannot be encoded");
            i
        });
        assert!(matches!(r, Err(Error::Encoder(_))), "{r:?}");
    }
}
