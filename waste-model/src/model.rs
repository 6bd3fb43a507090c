//! `Model`: an opened container with its trunk resident and its expert
//! cache sized from the RAM budget.

use crate::plan::Plan;
use crate::weights::{load_layers, load_output_res, Attn, Embedding, Ffn, Layer, TrunkReader};
use crate::{Error, Result};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use waste_cache::{ExpertCache, ExpertStore, Key, Policy, RecordSource};
use waste_format::{check_record, Bank, Container, RecordLayout, Usage, UsageEntry};
use waste_io::DirectFile;
use waste_moe::ExpertKernel;
use waste_quant::fast::Numeric;
use waste_quant::{Level, Matrix, Pool};

/// How to open a model.
#[derive(Clone, Debug)]
pub struct ModelOptions {
    /// RAM budget in bytes (0 = pick by the default rule).
    pub budget: u64,
    /// Context bound in tokens (MLA caches are sized for it).
    pub ctx: usize,
    /// Compute threads (0 = all cores).
    pub threads: usize,
    /// Reader threads (0 = 4).
    pub io_threads: usize,
    /// Bypass the page cache for expert reads.
    pub direct_io: bool,
    /// Check every expert record's CRC on read (a pass per read).
    pub verify_records: bool,
    /// Force a SIMD level (None = the process default, `WASTE_SIMD` aware).
    pub simd: Option<Level>,
    /// Cache eviction policy (`Eta` by default; LFRU or LRU).
    pub policy: Policy,
    /// Issue all of a layer's misses at once and compute resident experts while they arrive.
    pub readahead: bool,
    /// Experts of the next layer to prefetch from a router lookahead:
    /// layer L+1's router on layer L's output under layer L+1's FFN norm
    /// (K3: on layer L's FFN input), its best guesses read
    /// while layer L+1's attention runs. `Some(0)` is off; `None` (the
    /// default) lets the open decide ([`Model::lookahead`]):
    /// [`AUTO_LOOKAHEAD`] (at most `top_k`) where the expert cache cannot
    /// hold every routed expert but holds two layers' worth, else none.
    /// Never changes an answer, only when reads start. A session replaying
    /// a recorded routing ([`crate::Session::replay_routing`]) reads nothing
    /// ahead: the router's guesses are not the trace's choices.
    pub lookahead: Option<usize>,
    /// Run a batched step ([`Model::step_many`]) of two or more sequences
    /// as two halves in turn, layer by layer, so one half's expert reads
    /// are in flight while the other half computes (the disk is otherwise
    /// idle while attention runs; the trunk's weights are then streamed
    /// once per half). `None` (the default): off where the expert cache
    /// holds every routed expert, else chosen step by step by the measured
    /// step times of both forms ([`halves_for`], [`crate::halves`]). Only
    /// where every layer is resident. Never changes an answer, only the
    /// order of the work.
    pub halves: Option<bool>,
    /// Ask for 2 MiB huge pages for the cache arena and the trunk's
    /// matrices (each streamed once a token: 4 KiB pages cost a TLB walk
    /// every 4 KiB).
    pub huge_pages: bool,
    /// Fault the cache arena in ahead of use on an idle-priority thread
    /// (started once the trunk is loaded), so the OS's zeroing of fresh pages stays
    /// out of the expert reads (`waste_cache::ExpertCache::start_prefault`).
    /// Resident memory then grows toward the cache's size before the cache
    /// fills — still within the budget, which counts the whole cache. On
    /// by default; off, pages arrive only with the first read into a slot.
    pub prefault: bool,
    /// Most tokens a prefill chunk evaluates together (1 = token by token;
    /// capped by the buffers the budget leaves room for — [`Plan::chunk_for`],
    /// [`crate::MAX_CHUNK`] at most — and by what the cache holds).
    pub max_chunk: usize,
    /// Prefill a prompt of several chunks a span of chunks at a time,
    /// layer by layer, where the expert cache cannot hold every routed
    /// expert or layers stream ([`Model::spans`]): each routed expert is
    /// read once a span (up to [`crate::SPAN_TOKENS`] tokens) and layer
    /// rather than once a chunk, each streamed layer once a span. Never
    /// changes an answer. On by default.
    pub span: bool,
    /// Run KDA over a prefill chunk in its chunked (WY) form: the state read
    /// twice per chunk instead of twice per token, within
    /// `waste_attn::kda::CHUNKED_REL_TOL` of the token-by-token form but not
    /// bit-identical to it — so with this on, the logits depend on how the
    /// prompt was chunked (the cache size). Off by default.
    pub kda_chunked: bool,
    /// How the products compute: `Exact` (the references' arithmetic) or
    /// `Fast` (8-bit activations with integer dots for Q8G / Q4G matrices
    /// and 8-bit VQ tables: issue 50's numeric mode, held to its quality
    /// contract, not to the references' bits; bit-identical across levels,
    /// threads and placements within the mode). `None` (the default): the
    /// `WASTE_NUMERIC` environment variable (`exact` / `fast`) when set,
    /// else [`Numeric::preferred`] for the SIMD level in use — `fast` on
    /// AVX2 and on AVX-512 with VNNI and VBMI, `exact` elsewhere.
    /// [`ModelOptions::exact`] asks for the references' arithmetic.
    pub numeric: Option<Numeric>,
    /// Usage hotlist to preload from (None = the container's `usage.waste` if present).
    pub usage: Option<PathBuf>,
    /// Open even when the floor exceeds usable RAM (the default refuses with
    /// [`Error::FloorAboveRam`]).
    pub force: bool,
    /// The RAM to plan against (`None` = this machine's usable RAM,
    /// cgroup-aware): the automatic budget and the floor check use it.
    pub usable_ram: Option<u64>,
    /// Reserve the constrained-decoding tables (JSON schema, tool grammars)
    /// in the budget: servers and `--json-schema` runs, which may build them.
    pub grammar: bool,
    /// Load K3's vision tower (images in prompts); its bytes are counted in
    /// the plan and come out of the expert cache's share of the budget.
    pub vision: bool,
    /// With [`ModelOptions::vision`]: a tower that cannot load (a malformed
    /// `vision.json`, a tensor of a shape no reader takes) leaves the model
    /// text-only instead of failing the open; the reason is among
    /// [`Model::warnings`] and in the error an image then gets. For a chat
    /// or a server, where images are an extra.
    pub vision_optional: bool,
    /// Sessions the plan counts (their states and scratch, and a batched
    /// step's logits: [`Plan::with_parallel`]) — a server decoding several
    /// requests together ([`Model::step_many`]) plans for its slots. 0 is
    /// taken as 1.
    pub parallel: usize,
    /// Session snapshots ([`crate::Session::snapshot`]) the caller keeps in
    /// memory, counted in the plan ([`Plan::with_snapshots`]): a server's
    /// prefix reuse keeps one per slot.
    pub snapshots: usize,
}

impl ModelOptions {
    /// The defaults in the `exact` numeric mode (the references'
    /// arithmetic, what every oracle comparison uses), whatever the CPU.
    pub fn exact() -> Self {
        ModelOptions { numeric: Some(Numeric::Exact), ..Default::default() }
    }
}

/// The numeric mode `asked` for, else [`default_numeric`]'s.
fn numeric_mode(asked: Option<Numeric>, level: Level) -> Result<Numeric> {
    match asked {
        Some(n) => Ok(n),
        None => default_numeric(level),
    }
}

/// The numeric mode a model opened at SIMD `level` computes in when its
/// options name none: `WASTE_NUMERIC`'s (`exact` / `fast`; another value is
/// an error) when set, else [`Numeric::preferred`]`(level)`.
///
/// # Errors
/// [`Error::Unsupported`] when `WASTE_NUMERIC` holds another value.
pub fn default_numeric(level: Level) -> Result<Numeric> {
    match std::env::var_os("WASTE_NUMERIC") {
        Some(v) => v.to_str().and_then(Numeric::parse).ok_or_else(|| {
            Error::Unsupported(format!("WASTE_NUMERIC={}: expected exact or fast", v.to_string_lossy()))
        }),
        None => Ok(Numeric::preferred(level)),
    }
}

/// Experts of the next layer the router lookahead reads ahead when the
/// options leave it to the open ([`ModelOptions::lookahead`] `None`) and
/// the cache cannot hold every expert: on the 48B shape with a disk as the
/// bound (1.1 GB/s, 6 and 12 GB budgets, AVX2) decode 6.8 % and 11.5 %
/// faster than without (five alternated pairs each, each pair faster; 85–98 %
/// of the guesses read were used) — docs/lab entry 80.
pub const AUTO_LOOKAHEAD: usize = 4;

/// Whether a batched step runs as two halves in turn
/// ([`ModelOptions::halves`]): `Some` as `asked`, else off (`Some(false)`)
/// where the expert cache's `slots` hold all `experts` (no reads to hide),
/// else `None`: chosen step by step by the measured step times
/// ([`crate::halves`]).
pub fn halves_for(asked: Option<bool>, experts: u64, slots: usize) -> Option<bool> {
    asked.or((experts == 0 || slots as u64 >= experts).then_some(false))
}

/// The model's scratch for a chunk's tokens in pairs ([`Model`]'s
/// `pair_scratch`): their tables and the experts' outputs, and which
/// layer-step's tables it holds (a step whose experts come in waves lets
/// go of it between waves, so another session's step may take it: the
/// step builds its tables again only then).
pub(crate) struct PairScratch {
    /// Tables, then outputs.
    pub(crate) floats: Vec<f32>,
    /// The layer-step ([`crate::session`]'s stamps, never 0) whose tables
    /// `floats` holds; 0 for none.
    pub(crate) tables_of: u64,
    /// Which of that step's tokens have their tables built.
    pub(crate) built: Vec<bool>,
}

/// Experts of a layer a step computes at once ([`Model::expert_wave`]):
/// `None` where the expert cache's `slots` less the router `lookahead`
/// hold a layer's `layer_experts` (a prefill chunk pins every distinct
/// expert of its layer at once) or the model has none; else half those
/// free slots, at least one: a chunk whose layer routes to more runs them
/// in waves, each pinned and computed in ascending id while the next
/// one's reads are in flight in the other half, so a small cache no
/// longer shortens the chunk (each expert is still read once a chunk).
/// `waste plan` applies the same rule to the slots a budget buys.
pub fn expert_wave(slots: usize, lookahead: usize, layer_experts: usize) -> Option<usize> {
    let free = slots.saturating_sub(lookahead);
    (layer_experts > 0 && free < layer_experts).then_some(free.max(1).div_ceil(2))
}

/// Tokens a prefill span takes ([`Model::prefill_span`]) with buffers for
/// chunks of `buffers` tokens and chunks of `chunk` (at most `buffers`),
/// where a span can save `reads` (MoE layers whose experts the cache
/// cannot all hold, or streamed layers): whole chunks of `chunk`, as many
/// as the span stash's [`crate::SPAN_TOKENS`] hold of `buffers`' — where
/// that is at least [`MIN_SPAN_CHUNKS`]; `None` (chunk by chunk) elsewhere.
pub fn prefill_span(buffers: usize, chunk: usize, reads: bool) -> Option<usize> {
    let n = crate::session::span::span_chunks(buffers);
    (reads && n >= MIN_SPAN_CHUNKS).then_some(chunk.max(1) * n)
}

/// The fewest chunks a prefill span takes: a span of two (the 48B at a
/// 4G budget: chunks of 128) reads 29 % fewer experts than chunk by chunk
/// (16.7 against 23.5 GB for 280 tokens of the real trace) but measured
/// 0.8× as fast on the first prefill after the open (its early reads fault
/// fresh cache pages in while attention runs) and level on a repeat;
/// spans of four chunks and more measured 1.3–1.7× faster (docs/lab entry
/// 84).
pub const MIN_SPAN_CHUNKS: usize = 4;

/// The router lookahead in use: the number `asked` for, else
/// [`AUTO_LOOKAHEAD`] (at most `top_k`) where a cache of `slots` records
/// cannot hold a model's `experts` routed experts (every MoE layer's) but
/// holds two layers' worth (a layer's own experts beside the next one's
/// guesses), else none (a cache that holds everything misses only once; one
/// too small for two layers would evict what the layer still needs).
/// `waste plan` applies the same rule to the slots a budget buys.
pub fn lookahead_for(asked: Option<usize>, experts: u64, top_k: usize, slots: usize) -> usize {
    match asked {
        Some(n) => n,
        None => {
            let fits_all = slots as u64 >= experts;
            let two_layers = slots >= top_k.saturating_mul(2).saturating_add(AUTO_LOOKAHEAD);
            if experts == 0 || fits_all || !two_layers {
                0
            } else {
                AUTO_LOOKAHEAD.min(top_k)
            }
        }
    }
}

/// Compute threads at most this many per core (more only adds switching).
pub const MAX_THREADS_PER_CORE: usize = 4;
/// Reader threads at most (each holds one read in flight).
pub const MAX_IO_THREADS: usize = 64;

impl Default for ModelOptions {
    fn default() -> Self {
        ModelOptions {
            budget: 0,
            ctx: 4096,
            threads: 0,
            io_threads: 0,
            direct_io: true,
            verify_records: std::env::var_os("WASTE_VERIFY").is_some_and(|v| v == "1"),
            simd: None,
            policy: Policy::Eta,
            readahead: true,
            lookahead: None,
            halves: None,
            huge_pages: true,
            prefault: true,
            max_chunk: crate::plan::MAX_CHUNK,
            span: true,
            kda_chunked: false,
            numeric: None,
            usage: None,
            force: false,
            usable_ram: None,
            grammar: false,
            vision: false,
            vision_optional: false,
            parallel: 1,
            snapshots: 0,
        }
    }
}

/// An opened model: trunk resident, experts on disk, a bounded expert cache.
pub struct Model {
    /// The validated container.
    pub container: Container,
    /// Each decoder layer: resident, or `None` when it streams from disk
    /// every token ([`Model::streamed_layers`]).
    pub(crate) layers: Vec<Option<Layer>>,
    /// The layers that stream (issue 48's budgets below the floor).
    pub(crate) split: crate::plan::Split,
    /// trunk.bin, opened once for the streamed layers' reads.
    pub(crate) trunk_file: waste_io::DirectFile,
    pub(crate) embed: Embedding,
    pub(crate) final_norm: Vec<f32>,
    pub(crate) head: Head,
    pub(crate) out_res: Option<Vec<f32>>,
    pub(crate) kernel: Option<ExpertKernel>,
    /// The shared scratch ([`crate::Plan::shared_scratch_bytes`]): a paired
    /// chunk's tokens' tables and outputs, taken by one session's step at a
    /// time, sized at its first use.
    pub(crate) pair_scratch: std::sync::Mutex<PairScratch>,
    /// The span stash ([`crate::Plan::shared_scratch_bytes`] counts it): the
    /// rows a span's chunks carry between layers, taken by one session's
    /// prefill at a time (another prefills chunk by chunk meanwhile),
    /// allocated at its first use.
    pub(crate) span_stash: std::sync::Mutex<Vec<crate::session::span::Carried>>,
    pub(crate) pool: Pool,
    /// The expert store: cache, readers, record checks.
    pub(crate) store: ExpertStore<Records>,
    pub(crate) opts: ModelOptions,
    /// The router lookahead in use ([`lookahead_for`]).
    pub(crate) lookahead: usize,
    /// Batched steps as two halves in turn: fixed, or `None` measured
    /// ([`halves_for`]).
    pub(crate) halves: Option<bool>,
    /// The measured choice between one batch and halves (where `halves` is `None`).
    pub(crate) halves_choice: std::sync::Mutex<crate::halves::Choice>,
    plan: Plan,
    tokenizer: Option<waste_tokenizer::Tokenizer>,
    template: Option<waste_tokenizer::ChatTemplate>,
    fingerprint: u64,
    budget: u64,
    budget_warning: Option<String>,
    warnings: Vec<String>,
    preloaded: usize,
    pub(crate) vision: Option<crate::vision::Vision>,
    /// Why the tower asked for did not load ([`ModelOptions::vision_optional`]).
    pub(crate) vision_error: Option<String>,
}

impl Model {
    /// Open a container: validate everything, plan memory against the
    /// budget, load the resident trunk, size the expert cache.
    ///
    /// # Errors
    /// As [`Model::open_with_progress`].
    pub fn open(path: impl AsRef<Path>, opts: ModelOptions) -> Result<Model> {
        Self::open_with_progress(path, opts, &|_, _| {})
    }

    /// [`Model::open`] with a progress callback `(layers loaded, layers)`.
    ///
    /// # Errors
    /// [`Error::Format`] for a damaged container, [`Error::Arg`] for a bad `ctx` or lookahead, [`Error::FloorAboveRam`] / [`Error::Budget`] when memory cannot hold the model, [`Error::Tokenizer`], [`Error::Unsupported`] for a SIMD level this CPU lacks, and I/O errors.
    pub fn open_with_progress(
        path: impl AsRef<Path>,
        opts: ModelOptions,
        progress: &dyn Fn(usize, usize),
    ) -> Result<Model> {
        let container = Container::open(path.as_ref())?;
        check_options(&opts, &container)?;
        // the tokenizer first: its tables are part of the plan
        let tokenizer = crate::plan::load_tokenizer(&container)?;
        let template = crate::plan::load_chat_template(&container, tokenizer.as_ref())?;
        let (opts, threads, mut warnings) = capped(opts);
        // what the options ask of this CPU, before anything loads
        let level = simd_level(opts.simd)?;
        let numeric = numeric_mode(opts.numeric, level)?;
        let Memory { plan, vcfg, mut vision_error, split, resolved } =
            memory_of(&container, &opts, threads, (&tokenizer, &template), &mut warnings)?;
        let trunk = load_trunk(&container, &opts, &split, vcfg.as_ref(), progress)?;
        let vision = match trunk.vision {
            Some(Ok(t)) => Some(t),
            Some(Err(e)) if opts.vision_optional => {
                vision_error = Some(e.to_string());
                None
            }
            Some(Err(e)) => return Err(e),
            None => None,
        };
        if let Some(e) = &vision_error {
            warnings.push(format!("images are off: the vision tower could not load ({e}); text works"));
        }
        let store = expert_store(&container, &opts, &plan, resolved.cache_bytes)?;
        let lookahead = lookahead_for(opts.lookahead, plan.expert_records, container.config.top_k, store.slots());
        let halves = halves_for(opts.halves, plan.expert_records, store.slots());
        let kernel = container.experts.as_ref().map(|(_, lay)| ExpertKernel {
            lay: *lay,
            act: container.config.activation,
            batch: plan.chunk as usize,
        });
        // the shared scratch, written once now where this level and mode
        // may pair tokens (so a first prefill does not fault it in)
        let mut pair_scratch = Vec::new();
        if let Some(k) = kernel.as_ref().filter(|k| k.may_pair(level, numeric)) {
            pair_scratch.resize(crate::plan::shared_scratch_floats(k, container.config.top_k), 0.0);
        }
        let fingerprint = fingerprint(&container)?;
        let mut pool = Pool::try_with_level(threads, level)
            .map_err(|source| waste_io::Error::Thread { what: "compute", source })?;
        pool.set_numeric(numeric);
        let trunk_file = waste_io::DirectFile::open(&container.trunk_path(), false)?;
        let mut m = Model {
            embed: Embedding::new(&container)?,
            container,
            layers: trunk.layers,
            split,
            trunk_file,
            final_norm: trunk.final_norm,
            head: trunk.head,
            out_res: trunk.out_res,
            store,
            kernel,
            pair_scratch: std::sync::Mutex::new(PairScratch { floats: pair_scratch, tables_of: 0, built: Vec::new() }),
            span_stash: std::sync::Mutex::new(Vec::new()),
            pool,
            opts,
            lookahead,
            halves,
            halves_choice: Default::default(),
            plan,
            tokenizer,
            template,
            fingerprint,
            budget: resolved.budget,
            budget_warning: resolved.warning.clone(),
            warnings: resolved.warning.into_iter().chain(warnings).collect(),
            preloaded: 0,
            vision,
            vision_error,
        };
        m.preload_usage()?;
        Ok(m)
    }

    fn preload_usage(&mut self) -> Result<()> {
        let (path, asked) = match &self.opts.usage {
            Some(p) => (p.clone(), true),
            None => (self.container.dir.join("usage.waste"), false),
        };
        // untrusted: a corrupt or foreign file is skipped, never trusted —
        // with a warning, unless it is the container's own file and absent
        let bytes = match waste_format::read_regular(&path, 256 << 20) {
            Ok(b) => b,
            Err(e) => {
                if asked || path.exists() {
                    self.warnings.push(format!("usage file {}: not read ({e}); nothing preloaded", path.display()));
                }
                return Ok(());
            }
        };
        let u = match Usage::parse(&bytes) {
            Ok(u) => u,
            Err(e) => {
                self.warnings.push(format!("usage file {}: skipped ({e}); nothing preloaded", path.display()));
                return Ok(());
            }
        };
        let cfg = &self.container.config;
        let mut entries = u.filtered(|l, e| l < cfg.layers && cfg.is_moe(l) && e < cfg.experts);
        if entries.len() < u.entries.len() {
            self.warnings.push(format!(
                "usage file {}: {} of {} entries name experts this model does not have (another model's file?); skipped",
                path.display(),
                u.entries.len() - entries.len(),
                u.entries.len()
            ));
        }
        entries.sort_by(|a, b| b.hits.cmp(&a.hits).then((a.layer, a.expert).cmp(&(b.layer, b.expert))));
        if self.kernel.is_none() {
            return Ok(());
        }
        let list: Vec<(Key, u32)> = entries.iter().map(|e| ((e.layer as u32, e.expert as u32), e.hits)).collect();
        self.preloaded = self.store.preload(&list)?;
        Ok(())
    }

    /// Write the usage hotlist (which experts this process used) atomically.
    ///
    /// # Errors
    /// [`Error::Format`] when the file cannot be written (it is replaced
    /// atomically), or when something other than a usage hotlist (or an
    /// empty file) is already at `path`: that is left as it was.
    pub fn save_usage(&self, path: impl AsRef<Path>, tokens: u64) -> Result<()> {
        let mut entries: Vec<UsageEntry> = self
            .store
            .history()
            .into_iter()
            .map(|((l, e), hits)| UsageEntry { layer: l as u16, expert: e as u16, hits, last_seen: 0 })
            .collect();
        entries.sort_by(|a, b| b.hits.cmp(&a.hits).then((a.layer, a.expert).cmp(&(b.layer, b.expert))));
        let u = Usage { total_tokens: tokens, entries };
        let magic = waste_format::USAGE_MAGIC.to_le_bytes();
        waste_format::replace_own(path.as_ref(), &u.encode(), &magic, "WASTE usage hotlist")?;
        Ok(())
    }

    /// The container's tokenizer (None when it ships none).
    pub fn tokenizer(&self) -> Option<&waste_tokenizer::Tokenizer> {
        self.tokenizer.as_ref()
    }
    /// The chat template (`chat_template.jinja`, `chat.json` or a default).
    pub fn chat_template(&self) -> Option<&waste_tokenizer::ChatTemplate> {
        self.template.as_ref()
    }
    /// A fingerprint of the model (manifest bytes, trunk size), recorded in state files.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }
    /// Encode a conversation with the chat template (BOS first when the
    /// config has one); template text is markup, content plain.
    ///
    /// # Errors
    /// [`Error::Unsupported`] without a tokenizer; [`Error::Tokenizer`] when the template fails.
    pub fn encode_chat(&self, messages: &[waste_tokenizer::Message], open: bool) -> Result<Vec<u32>> {
        let (t, tpl) = match (&self.tokenizer, &self.template) {
            (Some(t), Some(p)) => (t, p),
            _ => return Err(Error::Unsupported("this container has no tokenizer".into())),
        };
        self.check_fits(t, messages.iter().map(|m| m.content.len()).sum())?;
        let mut ids = self.bos().into_iter().collect::<Vec<_>>();
        ids.extend(tpl.encode(t, messages, open).map_err(|e| Error::Arg(e.to_string()))?);
        Ok(ids)
    }

    /// Refuse text of `bytes` bytes that cannot fit the context, before
    /// tokenizing it: a token stands for at most the tokenizer's longest
    /// token, so more than `ctx ×` that many bytes is more than `ctx`
    /// tokens. (Tokenizing first cost time and memory for nothing: a 300 MB
    /// prompt took 27 s and 9.7 GB before the context check refused it.)
    fn check_fits(&self, t: &waste_tokenizer::Tokenizer, bytes: usize) -> Result<()> {
        let (ctx, max_token_bytes) = (self.opts.ctx, t.max_token_bytes().max(1));
        if bytes > ctx.saturating_mul(max_token_bytes) {
            return Err(Error::TextTooLong { bytes, ctx, max_token_bytes });
        }
        Ok(())
    }
    /// The token that ends a constrained output: `<|end_of_msg|>` when it
    /// answers in K3's tagged chat format (`end_of_message`), else the
    /// config's first end token. None when the model has neither.
    pub fn constraint_end(&self, end_of_message: bool) -> Option<u32> {
        if end_of_message {
            self.tokenizer.as_ref().and_then(|t| t.special_id(waste_tokenizer::xtml::END_OF_MSG))
        } else {
            self.config().eos.first().copied()
        }
    }
    /// Whether the chat template is K3's tagged format (tools, thinking).
    pub fn is_xtml(&self) -> bool {
        matches!(self.template, Some(waste_tokenizer::ChatTemplate::Xtml))
    }
    /// Encode a conversation in K3's tagged format with tools, thinking and
    /// response-format notices (BOS first when the config has one), with the
    /// token counts of its parts (BOS included).
    ///
    /// # Errors
    /// [`Error::Unsupported`] unless the model uses K3's tagged format; [`Error::Arg`] for a conversation the format cannot render.
    pub fn encode_xtml(
        &self,
        messages: &[waste_tokenizer::xtml::ChatMessage],
        opts: &waste_tokenizer::xtml::XtmlOptions,
        open: bool,
    ) -> Result<waste_tokenizer::xtml::Encoded> {
        self.encode_tagged(self.is_xtml(), "K3's tagged format", messages, |t| {
            waste_tokenizer::xtml::encode(t, messages, opts, open)
        })
    }
    /// Whether the chat template is the Kimi K2 family's format (Kimi-Linear's: tools).
    pub fn is_k2(&self) -> bool {
        matches!(self.template, Some(waste_tokenizer::ChatTemplate::K2))
    }
    /// Encode a conversation in the K2 family's format with `tools` declared
    /// (BOS first when the config has one), with the token counts of its
    /// parts (BOS included).
    ///
    /// # Errors
    /// [`Error::Unsupported`] unless the model uses the K2 format; [`Error::Arg`] for a conversation the format cannot render.
    pub fn encode_k2(
        &self,
        messages: &[waste_tokenizer::xtml::ChatMessage],
        tools: &[serde_json::Value],
        open: bool,
    ) -> Result<waste_tokenizer::xtml::Encoded> {
        self.encode_tagged(self.is_k2(), "the K2 format", messages, |t| {
            waste_tokenizer::k2::encode(t, messages, tools, open)
        })
    }
    /// A tagged format's encoding: refused unless the model uses it (`uses`,
    /// named `format`), the messages checked against the context, BOS put first.
    fn encode_tagged(
        &self,
        uses: bool,
        format: &str,
        messages: &[waste_tokenizer::xtml::ChatMessage],
        encode: impl FnOnce(&waste_tokenizer::Tokenizer) -> waste_tokenizer::Result<waste_tokenizer::xtml::Encoded>,
    ) -> Result<waste_tokenizer::xtml::Encoded> {
        let t = match (&self.tokenizer, uses) {
            (Some(t), true) => t,
            _ => return Err(Error::Unsupported(format!("this model's chat template is not {format}"))),
        };
        self.check_fits(t, messages.iter().map(|m| m.content.len()).sum())?;
        let e = encode(t).map_err(|e| Error::Arg(e.to_string()))?;
        Ok(self.with_bos(e))
    }
    /// BOS put first, the part counts moved past it.
    fn with_bos(&self, mut e: waste_tokenizer::xtml::Encoded) -> waste_tokenizer::xtml::Encoded {
        if let Some(b) = self.bos() {
            e.ids.insert(0, b);
            e.head += 1;
            e.messages_end += 1;
        }
        e
    }
    /// Encode raw text as plain tokens (BOS first when the config has one).
    ///
    /// # Errors
    /// [`Error::Unsupported`] without a tokenizer; [`Error::TextTooLong`]
    /// for text too long for the context whatever its tokens.
    pub fn encode_raw(&self, text: &str) -> Result<Vec<u32>> {
        let t = self.tokenizer.as_ref().ok_or_else(|| Error::Unsupported("this container has no tokenizer".into()))?;
        self.check_fits(t, text.len())?;
        let mut ids = self.bos().into_iter().collect::<Vec<_>>();
        ids.extend(t.encode_plain(text));
        Ok(ids)
    }
    /// The BOS id, if the config names one inside the vocabulary.
    pub fn bos(&self) -> Option<u32> {
        self.container.config.bos.filter(|&b| (b as usize) < self.container.config.vocab)
    }
    /// The config.
    pub fn config(&self) -> &waste_format::ModelConfig {
        &self.container.config
    }
    /// Options it was opened with.
    pub fn options(&self) -> &ModelOptions {
        &self.opts
    }
    /// The memory plan it was opened with.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }
    /// The resolved RAM budget.
    pub fn budget(&self) -> u64 {
        self.budget
    }
    /// Set when the budget fell back to the floor.
    pub fn budget_warning(&self) -> Option<&str> {
        self.budget_warning.as_deref()
    }
    /// Everything `open` adjusted and the caller should hear about: the
    /// budget warning, thread counts capped.
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }
    /// Expert cache slots.
    pub fn cache_slots(&self) -> usize {
        self.store.slots()
    }
    /// Experts of the next layer the router lookahead reads ahead (0 =
    /// off): the options' number, or the open's choice where they left it
    /// open ([`lookahead_for`]).
    pub fn lookahead(&self) -> usize {
        self.lookahead
    }
    /// Whether a batched step of two or more sequences runs as two halves
    /// in turn ([`ModelOptions::halves`], [`halves_for`]): `Some` fixed
    /// (never while layers stream from disk), `None` chosen step by step by
    /// the measured step times ([`crate::halves`]).
    pub fn halves(&self) -> Option<bool> {
        if self.split.streamed.is_empty() {
            self.halves
        } else {
            Some(false)
        }
    }
    /// Whether the cache arena got huge pages.
    pub fn huge_pages(&self) -> bool {
        self.store.huge_pages()
    }
    /// Bytes of the cache arena faulted in ahead of use so far (by the
    /// store's idle-priority thread; 0 where the OS cannot).
    pub fn prefaulted_bytes(&self) -> usize {
        self.store.prefaulted_bytes()
    }
    /// Records preloaded from the usage hotlist at open.
    pub fn preloaded(&self) -> usize {
        self.preloaded
    }
    /// The decoder layers read from disk every token (the budget is below
    /// the resident floor; empty otherwise).
    pub fn streamed_layers(&self) -> &[usize] {
        &self.split.streamed
    }

    /// Whether the output head streams from disk too.
    pub fn streams_head(&self) -> bool {
        self.split.head
    }

    /// Cache counters (all sessions).
    pub fn cache_stats(&self) -> waste_cache::CacheStats {
        self.store.stats()
    }
    /// Every resident trunk matrix (not the vectors, codebooks or embedding).
    pub(crate) fn trunk_matrices(&self) -> Vec<&Matrix> {
        let mut m: Vec<&Matrix> = (0..self.layers.len()).flat_map(|l| self.layer_matrices(l)).collect();
        if let Head::Resident(h) = &self.head {
            m.push(h);
        }
        m
    }

    /// Layer `l`'s resident matrices: its attention projections, then its
    /// dense FFN, or its router, shared expert and latent projections.
    pub(crate) fn layer_matrices(&self, l: usize) -> Vec<&Matrix> {
        let mut m: Vec<&Matrix> = Vec::new();
        let Some(l) = &self.layers[l] else { return m };
        match &l.attn {
            Attn::Kda(w) => {
                m.extend([&w.q, &w.k, &w.v, &w.f_a, &w.f_b, &w.b, &w.o]);
                match &w.gate {
                    waste_attn::KdaGate::LowRank { a, b } => m.extend([a, b]),
                    waste_attn::KdaGate::Full(g) => m.push(g),
                }
            }
            Attn::Mla(w) => {
                match &w.q {
                    waste_attn::MlaQuery::Plain(q) => m.push(q),
                    waste_attn::MlaQuery::Lora { a, b, .. } => m.extend([a, b]),
                }
                m.extend([&w.kv_a, &w.kv_b, &w.o]);
                m.extend(w.g.as_ref());
            }
        }
        match &l.ffn {
            Ffn::Dense(d) => m.extend([&d.gate, &d.up, &d.down]),
            Ffn::Moe(w) => {
                m.push(&w.gate);
                if let Some(s) = &w.shared {
                    m.extend([&s.gate, &s.up, &s.down]);
                }
                if let Some(lt) = &w.latent {
                    m.extend([&lt.down, &lt.up]);
                }
            }
        }
        m
    }

    /// Bytes the model itself holds: trunk weights, codebooks and the cache arena.
    pub fn allocated_bytes(&self) -> (u64, u64) {
        let v = |x: &Vec<f32>| 4 * x.capacity() as u64;
        let mut t: u64 =
            self.trunk_matrices().iter().map(|m| (m.data.capacity() + 2 * m.scales.capacity()) as u64).sum();
        for l in self.layers.iter().flatten() {
            t += v(&l.in_norm) + v(&l.post_norm);
            match &l.attn {
                Attn::Kda(w) => {
                    t += w.conv.iter().map(v).sum::<u64>() + v(&w.a_log) + v(&w.dt_bias) + v(&w.o_norm);
                }
                Attn::Mla(w) => {
                    if let waste_attn::MlaQuery::Lora { norm, .. } = &w.q {
                        t += v(norm);
                    }
                    t += v(&w.kv_a_norm);
                }
            }
            if let Ffn::Moe(w) = &l.ffn {
                t += v(&w.bias) + w.latent.as_ref().and_then(|lt| lt.norm.as_ref()).map_or(0, v);
                t += w
                    .books
                    .books
                    .iter()
                    .flatten()
                    .map(|b| 4 * (b.cb.capacity() + b.cbt.capacity()) as u64)
                    .sum::<u64>();
            }
            if let Some(r) = &l.res {
                t += v(&r.attn) + v(&r.mlp);
            }
        }
        t += v(&self.final_norm) + self.out_res.as_ref().map_or(0, v);
        (t, self.store.arena_bytes() as u64)
    }

    /// Memory read bandwidth in GB/s over the model's own resident trunk
    /// (the bytes every token reads, so no memory outside the budget is
    /// touched), with 1 thread and with `threads` threads: the best of
    /// `passes` passes each. A trunk that fits in the CPU's caches measures
    /// cache speed — which is then the true limit for that model. The
    /// cache's prefault, if still running, is held during the probe (its
    /// page zeroing measured as a third of the bandwidth gone on a VM).
    pub fn memory_bandwidth(&self, threads: usize, passes: usize) -> (f64, f64) {
        let slices: Vec<&[u8]> = self.trunk_matrices().iter().map(|m| &m.data[..]).collect();
        let total: usize = slices.iter().map(|s| s.len()).sum();
        // the cache's prefault (page zeroing) would take a third to two
        // thirds of the bandwidth away from the probe on a VM: held meanwhile
        self.store.pause_prefault(true);
        std::thread::sleep(std::time::Duration::from_millis(20));
        let one = waste_io::read_bandwidth(&slices, 1, passes);
        let many = if threads > 1 { waste_io::read_bandwidth(&slices, threads, passes) } else { one };
        self.store.pause_prefault(false);
        let gb = |s: f64| if s > 0.0 { total as f64 / s / 1e9 } else { 0.0 };
        (gb(one), gb(many))
    }

    /// Whether every expert bank got direct I/O.
    pub fn direct_io(&self) -> bool {
        self.store.source().banks.iter().flatten().all(|b| b.0.is_direct())
    }
    /// Compute threads.
    pub fn threads(&self) -> usize {
        self.pool.threads()
    }
    /// Tokens a prefill chunk's buffers hold ([`Plan::chunk`]: [`crate::CHUNK`],
    /// more where the expert cache leaves room).
    pub fn chunk(&self) -> usize {
        self.plan.chunk as usize
    }
    /// Experts of a layer a step computes at once where the expert cache
    /// cannot pin a whole layer's beside the lookahead (half the free
    /// slots: [`crate::expert_wave`]); `None` where it can.
    pub fn expert_wave(&self) -> Option<usize> {
        let c = self.config();
        let layer_experts = if c.n_moe_layers() == 0 { 0 } else { c.experts };
        crate::expert_wave(self.cache_slots(), self.lookahead, layer_experts)
    }
    /// Whether a prompt of several chunks prefills a span of chunks at a
    /// time, layer by layer (each routed expert read once a span and
    /// layer, each streamed layer once a span; the same logits): where the
    /// options allow it ([`ModelOptions::span`]), the model has MoE layers
    /// and the expert cache cannot hold every routed expert or layers
    /// stream.
    pub fn spans(&self) -> bool {
        self.prefill_span().is_some()
    }
    /// Tokens a prefill span takes where prompts prefill a span of chunks
    /// at a time ([`Model::spans`]): whole chunks of
    /// [`Model::chunk_limit`], up to [`crate::SPAN_TOKENS`] of the buffers'
    /// chunk; `None` where they prefill chunk by chunk.
    pub fn prefill_span(&self) -> Option<usize> {
        let short = (self.cache_slots() as u64) < self.plan.expert_records;
        let reads = self.config().n_moe_layers() > 0 && (short || !self.split.streamed.is_empty());
        prefill_span(self.chunk(), self.chunk_limit(), reads).filter(|_| self.opts.span)
    }
    /// The most tokens a prefill chunk may take: what the buffers hold
    /// ([`Model::chunk`]), at most the options' `max_chunk`, at least 1.
    pub fn chunk_limit(&self) -> usize {
        self.opts.max_chunk.clamp(1, self.chunk())
    }
    /// SIMD level of the kernels.
    pub fn simd(&self) -> Level {
        self.pool.level()
    }
    /// Whether the fast mode's matmats take AVX-VNNI here (the AVX2 kernels
    /// on an Intel core with it; `WASTE_AVX_VNNI=0` turns it off).
    pub fn avx_vnni(&self) -> bool {
        self.numeric().qmax().is_some() && waste_quant::fast::matmat_uses_avx_vnni(self.simd())
    }
    /// The numeric mode the products compute in.
    pub fn numeric(&self) -> Numeric {
        self.pool.numeric()
    }
    /// What computes the routed experts on this CPU (format and kernel,
    /// [`ExpertKernel::kernel_name`]; the AVX2 VQ row form is chosen by
    /// timing both on the first expert matvecs; the fast mode names its
    /// own VQ kernel); `None` without routed experts.
    pub fn expert_kernel(&self) -> Option<String> {
        self.kernel.as_ref().map(|k| k.kernel_name(self.simd(), self.numeric()))
    }
    /// The probes that chose the fast mode's AVX2 VQ lookup form in this
    /// process so far (`waste_quant::vq_fast::avx2_lookup`): each probe's
    /// best time in seconds for the blends, the chains and the gathers, in
    /// that order, then two inputs' rows by the pair kernel (whether a
    /// chunk's tokens share the gathers: `vq_fast::pairs_pay`) and four
    /// inputs' by the quad kernel (`vq_fast::quads_pay`). Empty where none
    /// ran (another level, the exact mode, a form fixed by
    /// `WASTE_VQ_LOOKUP`).
    pub fn vq_lookup_probes(&self) -> Vec<waste_quant::vq_fast::ProbeTimes> {
        waste_quant::vq_fast::avx2_lookup_probes()
    }
    /// A new session (its own state, position 0).
    pub fn session(&self) -> crate::Session<'_> {
        crate::Session::new(self)
    }

    /// Advance several sessions by one token each, together: every layer's
    /// trunk weights and the LM head are read once for all of them, and
    /// each MoE layer acquires the union of their experts once (reads
    /// started together, each expert computed for every token routed to
    /// it). Each session's logits ([`crate::Session::logits`]) are
    /// bit-identical to evaluating its token alone. The step's shared work
    /// is counted in the first session's [`crate::Session::stats`]; each
    /// session counts its own token.
    ///
    /// # Errors
    /// [`Error::Arg`] when the counts differ, a session belongs to another
    /// model, a token is outside the vocabulary, or there are more sessions
    /// than [`Model::max_batch`]; [`Error::ContextFull`] for a full
    /// session; [`Error::Incomplete`] for a session an earlier error left
    /// part-way (all checked before any state changes). After an error
    /// from the computation itself every session of the step is
    /// incomplete, as [`crate::Session::eval`] leaves one.
    pub fn step_many(&self, sessions: &mut [&mut crate::Session<'_>], tokens: &[u32]) -> Result<()> {
        crate::session::step_many(self, sessions, tokens)
    }

    /// The most sessions one [`Model::step_many`] takes: every token's
    /// experts pinned in the cache at once (`top_k` slots each, beside the
    /// lookahead's), at most 16.
    pub fn max_batch(&self) -> usize {
        crate::session::max_batch(self)
    }
}

/// Options no container can satisfy, or this one cannot: too many
/// parallel sessions or snapshots, a lookahead past `top_k`.
fn check_options(opts: &ModelOptions, container: &Container) -> Result<()> {
    if opts.parallel > crate::plan::MAX_PARALLEL || opts.snapshots > crate::plan::MAX_PARALLEL {
        return Err(Error::Arg(format!(
            "{} parallel sessions and {} snapshots planned: at most {} each",
            opts.parallel,
            opts.snapshots,
            crate::plan::MAX_PARALLEL
        )));
    }
    if let Some(n) = opts.lookahead.filter(|&n| n > container.config.top_k) {
        return Err(Error::Arg(format!("lookahead {n} exceeds top_k {}", container.config.top_k)));
    }
    Ok(())
}

/// The memory side of an open: the plan, the vision config (and why
/// images are off although asked for), the split between resident and
/// streamed layers, and the budget resolved against usable RAM.
struct Memory {
    plan: Plan,
    vcfg: Option<crate::vision::VisionConfig>,
    vision_error: Option<String>,
    split: crate::plan::Split,
    resolved: waste_cache::Budget,
}

/// [`Memory`] for these options, refusing a floor above usable RAM (unless
/// forced) and a budget below the floor; a warning when layers stream
/// because the floor is above usable RAM.
fn memory_of(
    container: &Container,
    opts: &ModelOptions,
    threads: usize,
    (tokenizer, template): (&Option<waste_tokenizer::Tokenizer>, &Option<waste_tokenizer::ChatTemplate>),
    warnings: &mut Vec<String>,
) -> Result<Memory> {
    let (plan, vcfg, vision_error) = plan_of(container, opts, threads, tokenizer, template)?;
    let usable = opts.usable_ram.unwrap_or_else(waste_cache::usable_ram);
    let split = crate::plan::split_of(container, &plan, opts.budget, usable)?;
    let plan = plan.with_split(&split);
    if opts.budget == 0 && split.streams() {
        warnings.push(format!(
            "the resident floor is above usable RAM ({usable} bytes): {} decoder layers{} stream from disk every token (slower; docs/ENGINE.md \"Below the floor\")",
            split.streamed.len(),
            if split.head { " and the head" } else { "" }
        ));
    }
    if plan.floor_bytes > usable && !opts.force {
        return Err(Error::FloorAboveRam {
            floor: plan.floor_bytes,
            ctx: opts.ctx,
            usable,
            max_ctx: Plan::largest_ctx_within(container, usable, tokenizer.as_ref(), threads),
        });
    }
    let mut resolved = budget_of(&plan, opts.budget, usable)?;
    // chunks above the floor's where the cache leaves room: their buffers
    // come out of the cache's share (none when layers stream: the cache is
    // then the least it can be)
    let plan = match split.streams() {
        true => plan,
        false => {
            let wide = plan.with_chunk(plan.chunk_for(resolved.cache_bytes, opts.max_chunk));
            resolved.cache_bytes -= wide.floor_bytes - plan.floor_bytes;
            wide
        }
    };
    Ok(Memory { plan, vcfg, vision_error, split, resolved })
}

/// The options with the thread counts capped (compute at
/// [`MAX_THREADS_PER_CORE`] per core, readers at [`MAX_IO_THREADS`]), the
/// compute threads to start, and a warning per cap applied.
fn capped(mut opts: ModelOptions) -> (ModelOptions, usize, Vec<String>) {
    let mut warnings = Vec::new();
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    if opts.threads > MAX_THREADS_PER_CORE * cores {
        warnings.push(format!(
            "{} compute threads capped at {} ({MAX_THREADS_PER_CORE} per core)",
            opts.threads,
            MAX_THREADS_PER_CORE * cores
        ));
        opts.threads = MAX_THREADS_PER_CORE * cores;
    }
    if opts.io_threads > MAX_IO_THREADS {
        warnings.push(format!("{} I/O threads capped at {MAX_IO_THREADS}", opts.io_threads));
        opts.io_threads = MAX_IO_THREADS;
    }
    let threads = if opts.threads == 0 { crate::plan::default_threads() } else { opts.threads };
    (opts, threads, warnings)
}

/// The budget rule applied to `plan`: the budget and the expert cache's
/// share, or [`Error::Budget`] naming the floor's parts.
fn budget_of(plan: &Plan, budget: u64, usable: u64) -> Result<waste_cache::Budget> {
    waste_cache::resolve(&plan.floor(), budget, usable).map_err(|e| Error::Budget {
        budget: e.budget,
        floor: e.floor,
        detail: format!(
            "trunk {} + state {} + scratch {} + tokenizer {} + minimum expert cache {}",
            plan.trunk_bytes,
            plan.state_bytes,
            plan.scratch_bytes + plan.shared_scratch_bytes,
            plan.tokenizer_bytes + plan.tokenize_bytes + plan.template_bytes,
            plan.min_expert_cache_bytes
        ),
    })
}

/// The SIMD level asked for (refused when this CPU lacks it), or the best
/// this CPU has.
fn simd_level(asked: Option<Level>) -> Result<Level> {
    match asked {
        Some(l) if !l.supported() => Err(Error::Unsupported(format!("SIMD level {} on this CPU", l.name()))),
        Some(l) => Ok(l),
        None => Ok(waste_quant::level()),
    }
}

/// The memory plan for these options (the tokenizer, the template, the
/// threads' expert lanes, parallel sessions, snapshots, grammar tables and
/// the vision tower when asked for), the vision config, and why images are
/// off although asked for (`ModelOptions::vision_optional`).
fn plan_of(
    container: &Container,
    opts: &ModelOptions,
    threads: usize,
    tokenizer: &Option<waste_tokenizer::Tokenizer>,
    template: &Option<waste_tokenizer::ChatTemplate>,
) -> Result<(Plan, Option<crate::vision::VisionConfig>, Option<String>)> {
    let plan = Plan::for_container(container, opts.ctx)?
        .with_tokenizer(tokenizer.as_ref())
        .with_chat_template(template.as_ref())
        .with_threads(threads)
        .with_parallel(opts.parallel)
        .with_snapshots(opts.snapshots);
    let plan = if opts.grammar { plan.with_grammar(container.config.vocab) } else { plan };
    let mut vision_error = None;
    let vcfg = match opts.vision {
        false => None,
        true => match crate::vision::config(container) {
            Ok(Some(v)) => Some(v),
            Ok(None) => {
                return Err(Error::Unsupported("images: this container has no vision tower (no vision.json)".into()))
            }
            Err(e) if opts.vision_optional => {
                vision_error = Some(e.to_string());
                None
            }
            Err(e) => return Err(e),
        },
    };
    let plan = if vcfg.is_some() { plan.with_vision() } else { plan };
    Ok((plan, vcfg, vision_error))
}

/// The output head: resident, or read in pieces every step that wants
/// logits (a budget below the floor, issue 48).
pub(crate) enum Head {
    /// In memory.
    Resident(Matrix),
    /// On disk.
    Streamed(crate::weights::TensorRows),
}

/// The resident trunk as loaded.
struct Trunk {
    layers: Vec<Option<Layer>>,
    out_res: Option<Vec<f32>>,
    final_norm: Vec<f32>,
    head: Head,
    /// The vision tower, when its config was given (its load may fail:
    /// the caller decides whether that fails the open).
    vision: Option<Result<crate::vision::Vision>>,
}

/// Read the trunk: every resident layer (reporting progress), the output
/// aggregation, the final norm, the head and the vision tower.
fn load_trunk(
    container: &Container,
    opts: &ModelOptions,
    split: &crate::plan::Split,
    vcfg: Option<&crate::vision::VisionConfig>,
    progress: &dyn Fn(usize, usize),
) -> Result<Trunk> {
    let mut r = TrunkReader::skipping(container, &split.streamed, split.head)?.with_huge_pages(opts.huge_pages);
    let layers = load_layers(container, &mut r, &split.streamed, progress)?;
    let out_res = load_output_res(container, &mut r)?;
    let final_norm = r.vector("model.norm.weight")?;
    let name = if container.config.tie_embeddings { "model.embed_tokens.weight" } else { "lm_head.weight" };
    let head = match split.head {
        true => Head::Streamed(crate::weights::TensorRows::of(container, name, true)?),
        false => Head::Resident(r.matrix(name)?),
    };
    let vision = vcfg.map(|v| crate::vision::load(v, &mut r));
    Ok(Trunk { layers, out_res, final_norm, head, vision })
}

/// The expert banks opened, the cache sized from its share of the budget
/// (prefaulted at idle priority once the trunk is in: on the measuring VM,
/// faulting pages in while the trunk loaded slowed the load itself — both
/// wait for the host to back fresh pages; open 0.9–1.3 → 6.2–10.9 s at 12G)
/// and the readers started.
fn expert_store(
    container: &Container,
    opts: &ModelOptions,
    plan: &Plan,
    cache_bytes: u64,
) -> Result<ExpertStore<Records>> {
    let mut files = Vec::with_capacity(container.config.layers);
    for b in &container.banks {
        files.push(match b {
            Some(b) => Some((Arc::new(DirectFile::open(&b.path, opts.direct_io)?), b.clone())),
            None => None,
        });
    }
    let slots = plan.cache_slots(cache_bytes, opts.huge_pages);
    let mut cache = ExpertCache::new(slots, plan.record_bytes as usize, opts.policy, opts.huge_pages);
    let cfg = &container.config;
    cache.set_layers(&(0..cfg.layers).filter(|&l| cfg.is_moe(l)).map(|l| l as u32).collect::<Vec<_>>(), cfg.top_k);
    if opts.prefault {
        cache.start_prefault();
    }
    let records = Records {
        banks: files,
        lay: container.experts.as_ref().map(|(_, lay)| *lay),
        codebooks: container.codebooks.count,
        verify: opts.verify_records,
    };
    let rec_bytes = container.experts.as_ref().map_or(0, |(_, lay)| lay.rec_bytes);
    let io_threads = if opts.io_threads == 0 { 4 } else { opts.io_threads };
    Ok(ExpertStore::new(cache, io_threads, records, rec_bytes, opts.readahead)?)
}

/// The container's fingerprint: FNV-1a of the manifest bytes and the trunk
/// file's size.
fn fingerprint(container: &Container) -> Result<u64> {
    let dir = &container.dir;
    let mut fp = 0xcbf2_9ce4_8422_2325u64;
    let mut fnv = |b: &[u8]| {
        for &x in b {
            fp = (fp ^ x as u64).wrapping_mul(0x100_0000_01b3);
        }
    };
    fnv(&waste_format::read_regular(&dir.join("manifest.json"), waste_format::MAX_MANIFEST_BYTES)
        .map_err(|e| waste_format::Error::io(dir.join("manifest.json"), e))?);
    fnv(&container.trunk_len.to_le_bytes());
    Ok(fp)
}

/// The container's expert banks as the store sees them: where each record
/// is and how to check it.
pub(crate) struct Records {
    /// Per layer: the opened bank and its description (None: no experts).
    pub(crate) banks: Vec<Option<(Arc<DirectFile>, Bank)>>,
    lay: Option<RecordLayout>,
    codebooks: usize,
    verify: bool,
}

impl RecordSource for Records {
    type Error = Error;

    fn locate(&self, (layer, expert): Key) -> Option<(Arc<DirectFile>, u64)> {
        let (file, bank) = self.banks.get(layer as usize)?.as_ref()?;
        let lay = self.lay.as_ref()?;
        ((expert as usize) < bank.experts).then(|| (file.clone(), bank.record_offset(expert as usize, lay)))
    }

    fn check(&self, (layer, expert): Key, record: &[u8]) -> Result<()> {
        let (Some((_, bank)), Some(lay)) = (self.banks.get(layer as usize).and_then(|b| b.as_ref()), &self.lay) else {
            return Err(Error::Cache(waste_cache::CacheError::NoRecord { layer, expert }));
        };
        check_record(record, layer as usize, expert as usize, lay, bank.codebook_base, self.codebooks, self.verify)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::expert_wave;

    /// No waves where the free slots (less the lookahead) hold a layer's
    /// experts or the model has none; else waves of half the free slots
    /// (the other half reads the next wave), at least one expert.
    #[test]
    fn a_layer_s_experts_come_in_waves_of_the_free_slots() {
        // (slots, lookahead, layer experts) -> wave
        let cases = [
            ((22, 4, 256), Some(9)),    // the 48B at 1G: 18 free
            ((337, 4, 256), None),      // at 2G: a layer's experts fit
            ((260, 4, 256), None),      // exactly a layer's beside the lookahead
            ((259, 4, 256), Some(128)), // one short: 255 free
            ((5, 8, 256), Some(1)),     // fewer slots than the lookahead
            ((9, 0, 256), Some(5)),
            ((0, 0, 0), None), // no MoE layers
        ];
        for ((s, l, e), want) in cases {
            assert_eq!(expert_wave(s, l, e), want, "slots {s}, lookahead {l}, experts {e}");
        }
    }
}
