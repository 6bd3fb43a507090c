//! `waste eval` and `waste run` (token-id interface).

use crate::print_json;
use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use waste_model::{Model, ModelOptions};

/// Engine options shared by commands that open a model.
#[derive(Args, Clone, Debug)]
pub struct EngineArgs {
    /// RAM budget, e.g. 8G, 1.5G, 512M (0 = pick automatically).
    #[arg(long, default_value = "0", value_parser = parse_budget)]
    pub budget: u64,
    /// Context bound in tokens (`-c`, `--ctx-size` as llama.cpp names it).
    #[arg(long, short = 'c', visible_alias = "ctx-size", default_value_t = 4096)]
    pub ctx: usize,
    /// Compute threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Reader threads for expert I/O (0 = 4).
    #[arg(long, default_value_t = 0)]
    pub io_threads: usize,
    /// Expert cache policy: eta (expected next use; default), lfru or lru.
    #[arg(long, default_value = "eta")]
    pub cache: String,
    /// Experts of the next layer to prefetch from a router lookahead (0 =
    /// off; default: 4 where the expert cache cannot hold every expert,
    /// else off).
    #[arg(long)]
    pub lookahead: Option<usize>,
    /// Run a batched step of several sequences (`serve --parallel`,
    /// `bench --parallel`) as two halves in turn, so one half's expert
    /// reads are in flight while the other computes: on or off (default:
    /// off where the expert cache holds every expert, else whichever form
    /// the step times measure faster). Never changes an answer.
    #[arg(long, value_parser = parse_on_off)]
    pub halves: Option<bool>,
    /// Read a layer's missing experts one at a time instead of all at once.
    #[arg(long)]
    pub no_readahead: bool,
    /// Read experts through the page cache.
    #[arg(long)]
    pub no_direct_io: bool,
    /// Do not ask for 2 MiB huge pages for the cache and the trunk.
    #[arg(long)]
    pub no_huge_pages: bool,
    /// Do not fault the cache's memory in ahead of use (pages then arrive
    /// with the first read into each slot, which pays the OS's zeroing).
    #[arg(long)]
    pub no_prefault: bool,
    /// Check every expert record's CRC when read.
    #[arg(long)]
    pub verify: bool,
    /// Usage hotlist to preload (default: the container's usage.waste).
    #[arg(long)]
    pub usage: Option<PathBuf>,
    /// Most tokens a prefill chunk evaluates together (1 = token by token;
    /// 0 is refused, not taken as 1); above 16 only where the expert cache
    /// leaves room for the larger buffers (`waste plan` shows the chunk a
    /// budget gets).
    #[arg(long, default_value_t = waste_model::MAX_CHUNK, value_parser = parse_chunk)]
    pub chunk: usize,
    /// Prefill chunk by chunk through every layer, not a span of chunks
    /// (up to 256 tokens) layer by layer: the span reads each expert once
    /// a span where the cache cannot hold every expert (the same logits;
    /// this is for comparisons).
    #[arg(long)]
    pub no_span: bool,
    /// KDA over a prefill chunk in the chunked (WY) form: fewer passes over
    /// the state, within 1e-5 of the token form but not bit-identical (the
    /// logits then depend on the chunking).
    #[arg(long)]
    pub kda_chunked: bool,
    /// The fast numeric mode: Q8G / Q4G products with 8-bit activations and
    /// integer dots, VQ experts with 8-bit lookup tables and integer row
    /// sums (issue 50; its measured quality against the references is in
    /// docs/FINDINGS.md). Not the references' bits. The default on AVX2 and
    /// on AVX-512 with VNNI and VBMI (`WASTE_NUMERIC` overrides the default).
    #[arg(long, conflicts_with = "exact")]
    pub fast: bool,
    /// The exact numeric mode: the references' arithmetic. The default on
    /// every other CPU (scalar, NEON, AVX-512 without VNNI).
    #[arg(long)]
    pub exact: bool,
    /// Write which experts this run used to the usage hotlist when done.
    #[arg(long)]
    pub learn: bool,
    /// Open even when the floor at this --ctx exceeds usable RAM.
    #[arg(long)]
    pub force: bool,
    /// Load the vision tower (set by commands given images).
    #[arg(skip)]
    pub vision: bool,
    /// A tower that cannot load leaves the model text-only (chat and serve
    /// without images given: images are an extra there).
    #[arg(skip)]
    pub vision_optional: bool,
}

/// An image file read for the prompt: its bytes and header size.
pub struct ImageFile {
    pub path: PathBuf,
    pub bytes: Vec<u8>,
    pub width: u32,
    pub height: u32,
}

/// Read `--image` files (bounded) and check their headers.
pub fn read_images(model: &Model, paths: &[PathBuf]) -> Result<Vec<ImageFile>> {
    paths
        .iter()
        .map(|p| {
            let bytes = waste_model::format::read_regular(p, waste_model::MAX_IMAGE_FILE_BYTES as u64)
                .with_context(|| format!("reading image {}", p.display()))?;
            let i = model.image_info(&bytes).with_context(|| format!("image {}", p.display()))?;
            Ok(ImageFile { path: p.clone(), bytes, width: i.width, height: i.height })
        })
        .collect()
}

/// Encode the images and queue them on the session, checking that the
/// prompt has one `<|media_pad|>` per image.
pub fn queue_images(s: &mut waste_model::Session<'_>, ids: &[u32], images: &[ImageFile]) -> Result<()> {
    let m = s.model();
    let Some(v) = m.vision() else { return Ok(()) };
    let pads = ids.iter().filter(|&&t| t == v.placeholder).count();
    if pads != images.len() {
        bail!(
            "the prompt has {pads} image placeholder(s) (<|media_pad|>, id {}) for {} --image file(s)",
            v.placeholder,
            images.len()
        );
    }
    for f in images {
        let img = m.encode_image(&f.bytes).with_context(|| format!("image {}", f.path.display()))?;
        s.add_image(img)?;
    }
    Ok(())
}

/// A size in bytes as every size flag takes it: `4M`, `1.5G`, `512K`, or a
/// plain number of bytes.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    waste_model::parse_size(s)
        .ok_or_else(|| format!("{s:?} is not a size (examples: 4M, 1.5G, 512K; a plain number counts whole bytes)"))
}

/// [`parse_bytes`] for a size held in memory (`usize`).
pub fn parse_bytes_usize(s: &str) -> Result<usize, String> {
    let b = parse_bytes(s)?;
    usize::try_from(b).map_err(|_| format!("{s:?}: more bytes than this machine can address"))
}

/// `--chunk`: a whole number of tokens, at least 1.
fn parse_chunk(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("0 tokens: a chunk takes at least 1 (1 = token by token)".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("{s:?} is not a number of tokens")),
    }
}

pub fn parse_budget(s: &str) -> Result<u64, String> {
    waste_model::parse_size(s).ok_or_else(|| {
        format!("{s:?} is not a size (examples: 8G, 1.5G, 512M; a plain number counts whole bytes; 0 = automatic)")
    })
}

/// The budget a model runs with and what it buys, for the user: `budget
/// 2.34 GiB (automatic): an expert cache of 640 of 6,656 experts (10 %);
/// every expert would fit at --budget 18.2G`. Where all cannot fit in usable
/// RAM, it says so instead of naming a budget the machine lacks.
pub fn budget_line(model: &Model) -> String {
    let p = model.plan();
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let how = if model.options().budget == 0 { "automatic" } else { "given" };
    let (slots, all) = (model.cache_slots() as u64, p.expert_records);
    let mut line = format!("budget {:.2} GiB ({how})", gib(model.budget()));
    if all == 0 {
        return line;
    }
    let held = slots.min(all);
    line += &format!(": an expert cache of {held} of {all} experts ({:.0} %)", 100.0 * held as f64 / all as f64);
    if held < all {
        let fixed = p.floor_bytes.saturating_sub(p.min_expert_cache_bytes);
        let every =
            fixed.saturating_add(p.cache_arena_bytes(usize::try_from(all).unwrap_or(usize::MAX), model.huge_pages()));
        let usable = waste_model::usable_ram();
        if every <= usable {
            // rounded up, in the unit --budget takes
            let size = if every < 1 << 30 {
                format!("{}M", every.div_ceil(1 << 20))
            } else {
                format!("{:.1}G", (gib(every) * 10.0).ceil() / 10.0)
            };
            line += &format!("; every expert would fit at --budget {size} (fewer reads from disk)");
        } else {
            line += &format!(
                "; a larger --budget (up to this machine's {:.1} GiB of usable RAM) caches more experts",
                gib(usable)
            );
        }
    }
    // a cache too small to pin a layer's experts at once takes a prefill
    // chunk's in waves, each read once a chunk
    if let Some(n) = model.expert_wave() {
        line += &format!("; a prefill chunk's experts in waves of {n}: the cache cannot pin a layer's at once (a larger --budget reads fewer a prompt)");
    }
    line
}

impl EngineArgs {
    pub fn open(&self, model: &PathBuf) -> Result<Model> {
        self.open_for(model, false)
    }

    /// [`EngineArgs::open`], reserving the constrained-decoding tables in
    /// the budget when `grammar` (servers, `--json-schema`).
    pub fn open_for(&self, model: &PathBuf, grammar: bool) -> Result<Model> {
        self.open_parallel(model, grammar, 1)
    }

    /// [`EngineArgs::open_for`], planning for `parallel` sessions decoded
    /// together (`serve --parallel`, `bench --parallel`).
    pub fn open_parallel(&self, model: &PathBuf, grammar: bool, parallel: usize) -> Result<Model> {
        self.open_with(model, grammar, parallel, 0)
    }

    /// [`EngineArgs::open_parallel`], with `snapshots` session snapshots
    /// kept in memory counted in the budget (a server's prefix reuse).
    pub fn open_with(&self, model: &PathBuf, grammar: bool, parallel: usize, snapshots: usize) -> Result<Model> {
        let policy = match self.cache.as_str() {
            "eta" => waste_model::Policy::Eta,
            "lfru" => waste_model::Policy::Lfru,
            "lru" => waste_model::Policy::Lru,
            o => bail!("--cache {o:?}: expected eta, lfru or lru"),
        };
        let opts = ModelOptions {
            budget: self.budget,
            ctx: self.ctx,
            threads: self.threads,
            io_threads: self.io_threads,
            direct_io: !self.no_direct_io,
            verify_records: self.verify || ModelOptions::default().verify_records,
            simd: None,
            policy,
            readahead: !self.no_readahead,
            lookahead: self.lookahead,
            halves: self.halves,
            huge_pages: !self.no_huge_pages,
            prefault: !self.no_prefault,
            max_chunk: self.chunk,
            span: !self.no_span,
            kda_chunked: self.kda_chunked,
            numeric: match (self.fast, self.exact) {
                (true, _) => Some(waste_model::Numeric::Fast),
                (_, true) => Some(waste_model::Numeric::Exact),
                _ => None,
            },
            usage: self.usage.clone(),
            force: self.force,
            usable_ram: None,
            grammar,
            vision: self.vision,
            vision_optional: self.vision_optional,
            parallel,
            snapshots,
        };
        let bar = crate::progress::count_bar("loading", false);
        let m = Model::open_with_progress(model, opts, &|done, total| {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
        })
        .with_context(|| format!("opening {}", model.display()))?;
        bar.finish_and_clear();
        for w in m.warnings() {
            eprintln!("warning: {w}");
        }
        Ok(m)
    }

    /// Save the usage hotlist if --learn.
    pub fn finish(&self, model: &Model, model_path: &std::path::Path, tokens: u64) -> Result<()> {
        if self.learn {
            let p = self.usage.clone().unwrap_or_else(|| model_path.join("usage.waste"));
            model.save_usage(&p, tokens).with_context(|| format!("writing {}", p.display()))?;
        }
        Ok(())
    }
}

/// Token ids as every command takes them: separated by commas, whitespace
/// or both (`1,2,3`, `1 2 3` as `tokenize` prints them, `1, 2, 3`). An
/// empty item between two commas (`1,,2`) is refused, not skipped.
pub fn parse_ids(s: &str) -> Result<Vec<u32>> {
    let what = || format!("--ids {s:?}: expected token ids separated by commas or spaces");
    let mut ids = Vec::new();
    for item in s.split(',') {
        let words: Vec<&str> = item.split_whitespace().collect();
        if words.is_empty() && s.contains(',') {
            bail!("{}: an empty item between commas", what());
        }
        for w in words {
            ids.push(w.parse::<u32>().with_context(|| format!("{}: {w:?} is not a token id", what()))?);
        }
    }
    if ids.is_empty() {
        bail!("--ids is empty");
    }
    Ok(ids)
}

#[derive(Args)]
pub struct EvalArgs {
    /// Container directory.
    model: PathBuf,
    /// Prompt text, encoded raw as the C WASTE's `eval` does (no chat
    /// template; each --image's media block before it); `-` reads stdin.
    prompt: Option<String>,
    /// Prompt as token ids, separated by commas or spaces (as `tokenize` prints them).
    #[arg(long)]
    ids: Option<String>,
    /// How many top tokens to show.
    #[arg(long, default_value_t = 10)]
    top: usize,
    /// Include the full logit vector (with --json).
    #[arg(long)]
    logits: bool,
    /// An image (repeatable, in order; K3 containers with a vision tower):
    /// with a text prompt its media block goes before the text; with --ids,
    /// it fills the next `<|media_pad|>` id.
    #[arg(long = "image", value_name = "FILE")]
    images: Vec<PathBuf>,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    engine: EngineArgs,
}

/// The prompt `eval` takes, as the C WASTE's `eval` does: token ids, or
/// text (the argument, `-` for stdin) encoded raw — no chat template, no
/// BOS — with one media block per `--image` before it, in order
/// (`<|media_begin|>image WxH<|media_content|><|media_pad|><|media_end|>`
/// as markup, W×H of the file), the text as plain text.
enum EvalPrompt {
    Ids(Vec<u32>),
    Text(String),
}

fn eval_prompt(ids: &Option<String>, prompt: &Option<String>) -> Result<EvalPrompt> {
    match (ids, prompt) {
        (Some(i), None) => Ok(EvalPrompt::Ids(parse_ids(i)?)),
        (Some(_), Some(_)) => bail!("give either --ids or a prompt, not both"),
        (None, _) => match read_prompt(prompt, &None)? {
            Some(t) => Ok(EvalPrompt::Text(t)),
            None => bail!("no prompt: give it as an argument, on stdin (-), or as --ids 1,2,3"),
        },
    }
}

pub fn eval(mut a: EvalArgs) -> Result<ExitCode> {
    if a.top == 0 && !a.json {
        bail!("--top 0 would print nothing: at least 1 (with --json, 0 keeps the argmax and --logits)");
    }
    let prompt = eval_prompt(&a.ids, &a.prompt)?;
    a.engine.vision = !a.images.is_empty();
    let model = a.engine.open(&a.model)?;
    let images = read_images(&model, &a.images)?;
    let ids = match prompt {
        EvalPrompt::Ids(ids) => ids,
        EvalPrompt::Text(t) => {
            let tok =
                model.tokenizer().context("a text prompt needs the container's tokenizer (it has none): pass --ids")?;
            let mut ids = Vec::new();
            for i in &images {
                ids.extend(tok.encode_markup(&waste_model::tokenizer::image_markup(i.width, i.height)));
            }
            ids.extend(tok.encode_plain(&t));
            ids
        }
    };
    let mut s = model.session();
    queue_images(&mut s, &ids, &images)?;
    let logits = s.eval(&ids)?.to_vec();
    let mut probs = logits.clone();
    waste_model::softmax_in_place(&mut probs);
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&x, &y| logits[y].total_cmp(&logits[x]).then(x.cmp(&y)));
    let top: Vec<_> =
        order.iter().take(a.top).map(|&i| json!({"id": i, "logit": logits[i], "prob": probs[i]})).collect();
    if a.json {
        let mut v = json!({"ids": ids, "positions": s.position(), "argmax": order[0], "top": top});
        if a.logits {
            v["logits"] = json!(logits);
        }
        print_json(&v)?;
    } else {
        for &i in order.iter().take(a.top) {
            outln!("{i:>8}  logit {:>10.5}  p {:.5}", logits[i], probs[i]);
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Sampling and stopping options.
#[derive(Args, Clone, Debug)]
pub struct SampleArgs {
    /// Tokens to generate (`--n-predict` as llama.cpp names it).
    #[arg(short = 'n', long = "max-tokens", visible_alias = "n-predict", default_value_t = 128)]
    pub n: usize,
    /// Temperature (0 = greedy).
    #[arg(long, visible_alias = "temperature", default_value_t = 0.0)]
    pub temp: f32,
    /// Nucleus sampling mass.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Keep the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Drop tokens below min-p × p(best).
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Seed (same seed, same output); unset, a fresh one each run (sampled
    /// runs differ; `--json` prints the one used, to repeat a run).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop string (repeatable); never printed.
    #[arg(long = "stop")]
    pub stop: Vec<String>,
}

impl SampleArgs {
    /// The seed given, or one drawn once for this process (std's randomly
    /// keyed hasher, the process's own randomness) and kept, so every use
    /// agrees.
    pub fn seed(&self) -> u64 {
        use std::hash::{BuildHasher, Hasher};
        static FRESH: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
        self.seed.unwrap_or_else(|| {
            *FRESH.get_or_init(|| std::collections::hash_map::RandomState::new().build_hasher().finish())
        })
    }

    /// The sampling flags' ranges and the stop strings, checked before a
    /// model is opened (they were checked when generation began: after the
    /// open and the prompt's whole prefill).
    pub fn check(&self) -> Result<()> {
        self.params().sampling.validate().map_err(|e| anyhow::anyhow!("invalid argument: {e}"))?;
        if self.stop.iter().any(String::is_empty) {
            bail!("--stop \"\": a stop string is empty (it would match before any text)");
        }
        Ok(())
    }

    pub fn params(&self) -> waste_model::GenerateParams {
        waste_model::GenerateParams {
            sampling: waste_model::SamplingParams {
                temperature: self.temp,
                top_k: self.top_k,
                top_p: self.top_p,
                min_p: self.min_p,
                seed: self.seed(),
            },
            max_tokens: self.n,
            stop_tokens: vec![],
            stop_strings: self.stop.clone(),
            top_logprobs: 0,
            mark_specials: false,
        }
    }
}

#[derive(Args)]
pub struct RunArgs {
    /// Container directory.
    model: PathBuf,
    /// Prompt text; `-` reads stdin (also read when stdin is piped and no prompt is given).
    prompt: Option<String>,
    /// Read the prompt from a file.
    #[arg(long)]
    file: Option<PathBuf>,
    /// Prompt as token ids, separated by commas or spaces (no template).
    #[arg(long)]
    ids: Option<String>,
    /// System message (chat template only: not with --raw or --ids).
    #[arg(long, conflicts_with_all = ["raw", "ids"])]
    system: Option<String>,
    /// No chat template: the prompt is plain text.
    #[arg(long)]
    raw: bool,
    /// Think first (K3's tagged format): `--think` for max, `--think=LEVEL`
    /// for none, low, medium, high or max (the server's reasoning_effort
    /// levels; only with `=`, so a prompt after it is never read as the
    /// level); the reasoning goes to stderr. Not with --raw or --ids.
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "max", value_name = "LEVEL", value_parser = crate::answer::LEVELS, conflicts_with_all = ["raw", "ids"])]
    think: Option<String>,
    /// Answer in JSON matching this JSON schema file (constrained decoding).
    #[arg(long, value_name = "FILE")]
    json_schema: Option<PathBuf>,
    /// An image to show the model (repeatable; K3 containers with a vision
    /// tower): announced before the prompt text, or at the `<|media_pad|>`
    /// placeholders of `--ids`.
    #[arg(long = "image", value_name = "FILE")]
    images: Vec<PathBuf>,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
    /// No status line.
    #[arg(short, long)]
    quiet: bool,
    #[command(flatten)]
    sample: SampleArgs,
    #[command(flatten)]
    engine: EngineArgs,
}

/// Evaluate a prompt, with a progress bar on a terminal for long prompts.
/// A prompt the context cannot hold is refused before any of it is
/// evaluated (evaluating it in steps found out only when the context was
/// full: 4 096 tokens of work for nothing).
pub fn prefill_with_bar(s: &mut waste_model::Session<'_>, ids: &[u32]) -> Result<()> {
    let (pos, ctx) = (s.position(), s.model().options().ctx);
    if pos.saturating_add(ids.len()) > ctx {
        return Err(waste_model::Error::ContextFull { pos, n: ids.len(), ctx }.into());
    }
    let bar = crate::progress::count_bar("prefill", ids.len() < 64);
    bar.set_length(ids.len() as u64);
    let step = waste_model::CHUNK * 4;
    for (i, c) in ids.chunks(step).enumerate() {
        s.eval(c)?;
        bar.set_position(((i + 1) * step).min(ids.len()) as u64);
    }
    bar.finish_and_clear();
    Ok(())
}

/// Most bytes of text read from a file or stdin (a prompt, a JSON schema,
/// text to tokenize). A prompt a context can hold is far smaller; the
/// engine refuses one that cannot fit before tokenizing it.
pub const MAX_TEXT_BYTES: u64 = 256 << 20;

/// A regular UTF-8 file of at most [`MAX_TEXT_BYTES`] (a device such as
/// `/dev/zero` used to be read until memory ran out).
pub fn read_text_file(f: &Path) -> Result<String> {
    let b = waste_model::format::read_regular(f, MAX_TEXT_BYTES).with_context(|| format!("reading {}", f.display()))?;
    String::from_utf8(b).map_err(|_| anyhow::anyhow!("reading {}: not UTF-8 text", f.display()))
}

/// Stdin as UTF-8 text, at most [`MAX_TEXT_BYTES`].
fn read_stdin_text() -> Result<String> {
    use std::io::Read;
    let mut b = Vec::new();
    std::io::stdin().take(MAX_TEXT_BYTES + 1).read_to_end(&mut b).context("reading stdin")?;
    if b.len() as u64 > MAX_TEXT_BYTES {
        bail!("stdin: more than {} MiB of text", MAX_TEXT_BYTES >> 20);
    }
    String::from_utf8(b).map_err(|_| anyhow::anyhow!("stdin: not UTF-8 text"))
}

/// The prompt text from the argument, `--file`, or stdin.
pub fn read_prompt(arg: &Option<String>, file: &Option<PathBuf>) -> Result<Option<String>> {
    use std::io::IsTerminal;
    match (arg.as_deref(), file) {
        (Some(_), Some(_)) => bail!("give the prompt as an argument or with --file, not both"),
        (Some("-"), None) => Ok(Some(read_stdin_text()?)),
        (Some(p), None) => Ok(Some(p.to_string())),
        (None, Some(f)) => Ok(Some(read_text_file(f)?)),
        (None, None) if !std::io::stdin().is_terminal() => {
            let s = read_stdin_text()?;
            Ok(if s.is_empty() { None } else { Some(s) })
        }
        (None, None) => Ok(None),
    }
}

/// Print the status line with the prompt's and the generation's rates
/// apart (as llama.cpp does: prompt processing is many times faster per
/// token, and one rate for both hides both): `[prompt N tokens, s, tok/s |
/// generated M tokens, s, tok/s | experts H hit / M miss = P%]`.
pub fn status_line((p_tokens, p_secs): (usize, f64), (g_tokens, g_secs): (usize, f64), st: &waste_model::Stats) {
    let total = st.experts_hit + st.experts_missed;
    let pct = if total > 0 { 100.0 * st.experts_hit as f64 / total as f64 } else { 0.0 };
    let rate = |n: usize, s: f64| if s > 0.0 { format!("{:.2} tok/s", n as f64 / s) } else { "-".into() };
    eprintln!(
        "[prompt {p_tokens} tokens, {p_secs:.2} s, {} | generated {g_tokens} tokens, {g_secs:.2} s, {} | experts {} hit / {} miss = {pct:.0}%]",
        rate(p_tokens, p_secs),
        rate(g_tokens, g_secs),
        st.experts_hit,
        st.experts_missed
    );
}

pub fn run(mut a: RunArgs) -> Result<ExitCode> {
    use std::io::Write;
    if a.ids.is_some() && (a.prompt.is_some() || a.file.is_some()) {
        bail!("give either --ids or a prompt, not both");
    }
    a.sample.check()?;
    let text = if a.ids.is_none() { read_prompt(&a.prompt, &a.file)? } else { None };
    let schema = match &a.json_schema {
        Some(f) => Some(
            serde_json::from_str::<serde_json::Value>(&read_text_file(f)?)
                .with_context(|| format!("{}: not JSON", f.display()))?,
        ),
        None => None,
    };
    a.engine.vision = !a.images.is_empty();
    let model = a.engine.open_for(&a.model, schema.is_some())?;
    let images = read_images(&model, &a.images)?;
    let dims: Vec<(u32, u32)> = images.iter().map(|i| (i.width, i.height)).collect();
    let chat = crate::answer::Chat::new(&model, crate::answer::effort(a.think.as_deref())?, schema);
    let templated = a.ids.is_none() && !a.raw;
    let ids = match (&a.ids, &text) {
        (Some(i), None) => parse_ids(i)?,
        (None, Some(t)) if a.raw => {
            let tok = model.tokenizer().context("--raw needs the container's tokenizer")?;
            let mut ids: Vec<u32> = model.bos().into_iter().collect();
            for &(w, h) in &dims {
                ids.extend(tok.encode_markup(&waste_model::tokenizer::image_markup(w, h)));
            }
            ids.extend(&model.encode_raw(t)?[model.bos().map_or(0, |_| 1)..]);
            ids
        }
        (None, Some(t)) => {
            let mut msgs = vec![];
            if let Some(s) = &a.system {
                msgs.push(waste_model::tokenizer::Message::new("system", s));
            }
            msgs.push(waste_model::tokenizer::Message::new("user", t).with_images(&dims));
            chat.encode(&msgs, false)?
        }
        (Some(_), Some(_)) => bail!("give either --ids or a prompt, not both"),
        (None, None) => bail!("no prompt: give it as an argument, with --file, on stdin, or as --ids"),
    };
    let mut constraint = chat.constraint(templated)?;
    let params = if templated { chat.params(a.sample.params()) } else { a.sample.params() };
    let mut printer = chat.printer(templated);
    let mut s = model.session();
    if !a.quiet {
        // once the prompt is encoded: a failed template is the only line
        eprintln!("[{}]", budget_line(&model));
    }
    let t0 = std::time::Instant::now();
    queue_images(&mut s, &ids, &images)?;
    prefill_with_bar(&mut s, &ids)?;
    let prompt_secs = t0.elapsed().as_secs_f64();
    let stream = !a.json;
    let mut out = std::io::stdout().lock();
    let mut io_err = None;
    let c = constraint.as_mut().map(|c| c as &mut dyn waste_model::TokenConstraint);
    let g = s.generate_constrained(&[], &params, c, |ev| {
        if let Err(e) = printer.push(&ev.piece, &mut out, stream) {
            io_err = Some(e);
            return waste_model::Control::Cancel;
        }
        waste_model::Control::Continue
    })?;
    if let Some(e) = io_err {
        return Err(e.into());
    }
    let secs = t0.elapsed().as_secs_f64();
    let st = s.stats();
    a.engine.finish(&model, &a.model, st.tokens)?;
    if a.json {
        print_json(
            &json!({"prompt_ids": ids, "tokens": g.tokens, "text": printer.answer, "reasoning": printer.reasoning, "finish_reason": g.finish.reason(), "seed": a.sample.seed(),
            "context_full": g.finish == waste_model::Finish::ContextFull, "seconds": secs,
            "experts_hit": st.experts_hit, "experts_missed": st.experts_missed, "bytes_read": st.bytes_read,
            "direct_io": model.direct_io(), "threads": model.threads(), "simd": model.simd().name(),
            "ms_per_token": {"total": 1e3 * secs / st.tokens.max(1) as f64, "trunk": 1e3 * st.trunk_seconds / st.tokens.max(1) as f64,
                "attention": 1e3 * st.attn_seconds / st.tokens.max(1) as f64, "expert_compute": 1e3 * st.expert_seconds / st.tokens.max(1) as f64,
                "expert_io": 1e3 * st.io_seconds / st.tokens.max(1) as f64}}),
        )?;
    } else {
        writeln!(out)?;
        if g.finish == waste_model::Finish::ContextFull {
            eprintln!("[stopped: the context of {} tokens is full]", model.options().ctx);
        }
        if !a.quiet {
            status_line((ids.len(), prompt_secs), (g.tokens.len(), secs - prompt_secs), &st);
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `on` or `off` (a switch whose absence means "the engine decides").
fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("expected on or off, got {s:?}")),
    }
}
