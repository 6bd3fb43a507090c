//! The memory plan: what a model needs, from the manifest alone, counted
//! the way the engine allocates (and checked against the allocations by tests).

use crate::Result;
use std::path::Path;
use waste_format::{AttnKind, Container, Expect};

/// The memory plan of a container at a context size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Resident trunk (every tensor but the embedding table, codebooks, as loaded).
    pub trunk_bytes: u64,
    /// KDA states and conv rings, MLA latent caches for `ctx` tokens.
    pub state_bytes: u64,
    /// Every other buffer the engine allocates (one session).
    pub scratch_bytes: u64,
    /// Buffers one per model that its sessions take in turn: where VQ
    /// experts' tokens can pair (`waste_moe::ExpertKernel::pairable`), a
    /// chunk's tokens' gate and up tables and every use's output; with
    /// routed experts, the span stash (the rows a prefill span's chunks
    /// carry between layers: [`crate::SPAN_TOKENS`] tokens' worth); 0
    /// elsewhere. Counted once, whatever the sessions.
    pub shared_scratch_bytes: u64,
    /// Tokens a prefill chunk's buffers hold: [`CHUNK`] until
    /// [`Plan::with_chunk`].
    pub chunk: u64,
    /// What one more token of chunk adds to `scratch_bytes` (a session's).
    pub chunk_token_bytes: u64,
    /// What one more token of chunk adds to `shared_scratch_bytes`.
    pub chunk_shared_token_bytes: u64,
    /// The tokenizer's tables (rank and decoder maps, specials, the regex
    /// allowance); 0 until [`Plan::with_tokenizer`] counts them.
    pub tokenizer_bytes: u64,
    /// Tokenizing the longest text the context admits (`ctx` × the longest
    /// token's bytes; longer text is refused before tokenizing): the merge's
    /// and the regex's working memory and the ids
    /// (`Tokenizer::encode_working_bytes`); 0 until [`Plan::with_tokenizer`].
    pub tokenize_bytes: u64,
    /// Rendering the container's `chat_template.jinja`: the template held,
    /// a copy of it in a rendering helper's request (JSON-escaped: at most
    /// 6 bytes a byte) and the markup it writes (at most
    /// `TEMPLATE_OUTPUT_BYTES`); 0 for the other templates (their markup is
    /// tokenized as it is made) and until [`Plan::with_chat_template`].
    pub template_bytes: u64,
    /// The constrained-decoding tables (token trie and lexer) when reserved
    /// by [`Plan::with_grammar`]; 0 otherwise (they are built only by the
    /// first constrained generation).
    pub grammar_bytes: u64,
    /// Smallest expert cache: top_k × record × 2.
    pub min_expert_cache_bytes: u64,
    /// trunk + state + scratch + shared scratch + tokenizer (tables,
    /// tokenizing, the chat template's rendering) + min cache.
    pub floor_bytes: u64,
    /// One token's experts: top_k × record × MoE layers.
    pub working_set_bytes: u64,
    /// floor + 3 × working set.
    pub recommended_bytes: u64,
    /// One expert record.
    pub record_bytes: u64,
    /// Context the plan is for.
    pub ctx: u64,
    /// Experts chosen per token and MoE layer.
    pub top_k: u64,
    /// Experts a MoE layer has (0 without).
    pub layer_experts: u64,
    /// Expert records in the container (MoE layers × experts).
    pub expert_records: u64,
    /// Vocabulary entries (what the grammar tables scale with).
    pub vocab: u64,
    /// Decoder layers (what a split below the floor chooses among).
    pub layers: u64,
    /// The vision tower's weights as loaded (0 when the container has none).
    pub vision_weight_bytes: u64,
    /// One image's buffers: the larger of decoding the largest image the
    /// header check accepts (`waste_vision::max_preprocess_bytes`: 50 M
    /// pixels) and encoding one at the patch budget (the two never overlap:
    /// the decoded pixels are freed once cut into patches).
    pub vision_scratch_bytes: u64,
    /// Whether the vision bytes are counted in the floor (images enabled,
    /// [`Plan::with_vision`]): they come out of the expert cache's share.
    pub vision: bool,
    /// Routed experts computed at once, each whole on a thread (one set of
    /// activation and down-table buffers each, `waste_moe::lanes_for`);
    /// 1 until [`Plan::with_threads`] sets the thread count (0 without experts).
    pub expert_lanes: u64,
    /// Bytes of one such lane (counted in `scratch_bytes` per lane).
    pub expert_lane_bytes: u64,
    /// Sessions planned to decode together (`waste serve --parallel`,
    /// `Model::step_many`); 1 until [`Plan::with_parallel`].
    pub parallel: u64,
    /// What the sessions past the first add: each one's state and scratch,
    /// and a batched step's logits (`parallel × vocab` floats); in the floor.
    pub parallel_bytes: u64,
    /// In-memory session snapshots the caller keeps ([`crate::Snapshot`]:
    /// a server's prefix reuse keeps one per slot); 0 until
    /// [`Plan::with_snapshots`].
    pub snapshots: u64,
    /// Their bytes at most (each a state at full context and its logits);
    /// in the floor.
    pub snapshot_bytes: u64,
    /// Decoder layers streamed from disk a layer at a time (issue 48; 0
    /// until [`Plan::with_split`] applies a [`Split`]).
    pub streamed_layers: u64,
    /// Their bytes as loaded: out of the floor.
    pub streamed_bytes: u64,
    /// Their bytes on disk: read every token (and every prefill chunk).
    pub streamed_read_bytes: u64,
    /// What streaming them takes instead (two of the largest); in the floor.
    pub stream_buffer_bytes: u64,
}

/// Resident bytes of the constrained-decoding tables per vocabulary entry:
/// measured +87 MiB for o200k's 200,000 entries (docs/lab/2026-11-29-15-constrained-decoding-cost-issue-7.md,
/// "Constrained decoding cost"), about 456 bytes; 480 with margin.
pub const GRAMMAR_BYTES_PER_TOKEN: u64 = 480;

/// The prefill chunk every floor holds: a session's buffers take at
/// least this many tokens (a batched step's [`MAX_PARALLEL`] sequences
/// too); more where the expert cache leaves room ([`Plan::chunk_for`]).
pub const CHUNK: usize = 16;

/// The most tokens a prefill chunk evaluates together: each layer's
/// weights are read once a chunk, and each expert once for all the chunk's
/// tokens routed to it — on a 101-token prompt of real text (the 48B's
/// routing trace, AVX2) 1.52 tokens an expert run in chunks of 16, 1.80 in
/// one of 128 (docs/lab entry 76).
pub const MAX_CHUNK: usize = 128;

/// The chunks [`Plan::chunk_for`] chooses among, largest first.
const CHUNK_LADDER: [usize; 4] = [MAX_CHUNK, 64, 32, CHUNK];

/// The share of the expert cache a chunk above [`CHUNK`] may take for its
/// larger buffers: a thirty-second (on the 48B at its recommended budget,
/// 53 MB of 1.7 GB: chunks of 64).
const CHUNK_CACHE_SHARE: u64 = 32;

/// Most sessions one batched step takes, and so most a plan counts as
/// decoded together ([`Plan::with_parallel`]) or snapshotted
/// ([`Plan::with_snapshots`]): a step's buffers hold [`CHUNK`] tokens.
pub const MAX_PARALLEL: usize = CHUNK;

/// The largest context the engine plans for (16 M tokens): every size
/// derived from `ctx` then fits in 64 bits with room to spare.
pub const MAX_CTX: usize = 1 << 24;

/// Bytes of the trunk's tensors as loaded: every required tensor but the
/// embedding table (read a row a token; resident only as a tied head),
/// vectors as f32, AttnRes norm ⊙ proj pairs as one product vector.
fn resident_tensor_bytes(ct: &Container) -> u64 {
    resident_tensors(ct).map(|(_, b)| b).sum()
}

/// Each resident tensor's name and bytes as loaded ([`resident_tensor_bytes`]).
fn resident_tensors(ct: &Container) -> impl Iterator<Item = (String, u64)> + '_ {
    let c = &ct.config;
    let embed_name = "model.embed_tokens.weight";
    waste_format::required_tensors(c).into_iter().filter_map(move |req| {
        let t = ct.tensor(&req.name).ok()?;
        if req.name == embed_name {
            return c.tie_embeddings.then(|| (req.name.clone(), t.payload_len + t.scale_len));
        }
        let is_res = req.name.contains("_res_");
        let bytes = match req.expect {
            Expect::Mat(..) => t.payload_len + t.scale_len,
            // norm ⊙ proj pairs are stored as one product vector
            Expect::Vec(n) if is_res => {
                if req.name.ends_with("_res_norm.weight") {
                    f(n)
                } else {
                    0
                }
            }
            Expect::Vec(n) => f(n),
            Expect::AtLeast(n) => f(n),
        };
        Some((req.name, bytes))
    })
}

/// Bytes of the VQ codebooks of one MoE layer as loaded (f32 tables and
/// their transposes); 0 without VQ experts.
fn books_bytes_per_layer(ct: &Container) -> u64 {
    match &ct.experts {
        Some((q, _)) if q.fmt.is_vq() => (q.books_per_layer() * q.entries * q.vec_dim * 2 * 4) as u64,
        _ => 0,
    }
}

/// Each decoder layer's bytes as loaded (its tensors and, for a MoE layer
/// of a VQ container, its codebooks): what streaming it saves in memory
/// and costs in reads a token (issue 48).
pub fn layer_bytes(ct: &Container) -> Vec<u64> {
    let c = &ct.config;
    let mut v: Vec<u64> = (0..c.layers).map(|l| if c.is_moe(l) { books_bytes_per_layer(ct) } else { 0 }).collect();
    for (name, b) in resident_tensors(ct) {
        if let Some(x) = layer_of(&name).and_then(|l| v.get_mut(l)) {
            *x += b;
        }
    }
    v
}

/// Each decoder layer's bytes on disk (its tensors as stored): what
/// streaming it reads a token.
pub fn layer_read_bytes(ct: &Container) -> Vec<u64> {
    let mut v = vec![0u64; ct.config.layers];
    let prefix = ct.full_name("");
    for t in ct.tensors.values() {
        let l = t.name.strip_prefix(prefix.as_str()).and_then(layer_of);
        if let Some(x) = l.and_then(|l| v.get_mut(l)) {
            *x += t.stored_bytes();
        }
    }
    v
}

/// The decoder layer a tensor name (without the container's prefix)
/// belongs to: `N` of `model.layers.N.…`.
pub(crate) fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("model.layers.")?.split_once('.')?.0.parse().ok()
}

/// The output head's bytes (stored as loaded: a matrix): what streaming
/// it saves in memory and reads a token.
pub fn head_bytes(ct: &Container) -> u64 {
    let name = if ct.config.tie_embeddings { "model.embed_tokens.weight" } else { "lm_head.weight" };
    ct.tensor(name).map_or(0, |t| t.stored_bytes())
}

/// Most bytes of a piece a streamed head is read in (as many whole rows as
/// fit; two in memory at a time, in the layers' buffers when they are larger).
pub const HEAD_PIECE_BYTES: u64 = 16 << 20;

/// The piece a head of `head` bytes streams in: [`HEAD_PIECE_BYTES`], or a
/// quarter of a smaller head (so its reads overlap its products too).
pub fn head_piece_bytes(head: u64) -> u64 {
    HEAD_PIECE_BYTES.min(head.div_ceil(4))
}

/// Which decoder layers stream from disk, a layer at a time, when the
/// budget is below the resident floor (issue 48): the rest of the trunk,
/// the state and the scratch stay resident.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Split {
    /// Layers read from disk every token (ascending; empty above the floor).
    pub streamed: Vec<usize>,
    /// Whether the output head streams too (in pieces of
    /// [`head_piece_bytes`], once a step that wants logits).
    pub head: bool,
    /// Their bytes as loaded: what streaming them saves in memory.
    pub streamed_bytes: u64,
    /// Their bytes on disk: what a token reads beside its experts
    /// (filled by [`Split::with_reads`]).
    pub read_bytes: u64,
    /// Memory streaming takes: two of the largest streamed layer (the one
    /// computed and the one read ahead).
    pub buffer_bytes: u64,
}

impl Split {
    /// Whether any layer or the head streams.
    pub fn streams(&self) -> bool {
        !self.streamed.is_empty() || self.head
    }
    /// The same split with its bytes read a token from `reads` (each
    /// layer's, [`layer_read_bytes`]) and `head` ([`head_bytes`]).
    pub fn with_reads(mut self, reads: &[u64], head: u64) -> Split {
        self.read_bytes =
            self.streamed.iter().filter_map(|&l| reads.get(l)).sum::<u64>() + if self.head { head } else { 0 };
        self
    }
    /// Resident bytes the split saves against the floor (negative never:
    /// a split that saves nothing is not chosen).
    pub fn saved_bytes(&self) -> u64 {
        self.streamed_bytes.saturating_sub(self.buffer_bytes)
    }
}

/// Bytes of an `AlignedBuf` of `len` (huge-page aligned from 2 MiB).
pub(crate) fn aligned_alloc_bytes(len: usize, huge: bool) -> u64 {
    let align = if huge && len >= waste_io::HUGE_PAGE { waste_io::HUGE_PAGE } else { waste_io::ALIGN };
    (len.max(1).div_ceil(align) * align) as u64
}

fn f(n: usize) -> u64 {
    4 * n as u64
}

/// Floats of a model's shared scratch ([`Plan::shared_scratch_bytes`]) for
/// its expert kernel and `top_k`: where tokens pair, the batch's tokens'
/// tables and `batch × top_k` expert outputs.
pub(crate) fn shared_scratch_floats(kernel: &waste_moe::ExpertKernel, top_k: usize) -> usize {
    if !kernel.pairable() {
        return 0;
    }
    kernel.token_tables_floats() + kernel.batch * top_k * kernel.lay.lat
}

/// One session's scratch, the shared scratch and one expert lane's bytes
/// with buffers for prefill chunks of `chunk` tokens.
fn chunk_bytes(ct: &Container, ctx: usize, chunk: usize) -> (u64, u64, u64) {
    let c = &ct.config;
    let (vq_scratch, lane_bytes, shared) = match &ct.experts {
        Some((_, lay)) => {
            let kernel = waste_moe::ExpertKernel { lay: *lay, act: c.activation, batch: chunk };
            let one = kernel.scratch_bytes(1) as u64;
            // the pair tables and the span stash, once for all sessions
            let stash = crate::session::span::stash_floats(c, chunk);
            let shared = 4 * (shared_scratch_floats(&kernel, c.top_k) + stash) as u64;
            (one, kernel.scratch_bytes(2) as u64 - one, shared)
        }
        None => (0, 0, 0),
    };
    (crate::session::scratch_bytes(c, ctx, chunk) + vq_scratch, shared, lane_bytes)
}

impl Plan {
    /// Plan for an opened (validated) container.
    ///
    /// # Errors
    /// [`crate::Error::Arg`] when `ctx` is 0 or above [`MAX_CTX`].
    pub fn for_container(ct: &Container, ctx: usize) -> Result<Plan> {
        if ctx == 0 || ctx > MAX_CTX {
            return Err(crate::Error::Arg(format!("ctx {ctx}: must be between 1 and {MAX_CTX} tokens")));
        }
        let c = &ct.config;
        let mut trunk = resident_tensor_bytes(ct);
        if ct.experts.is_some() {
            trunk += c.n_moe_layers() as u64 * books_bytes_per_layer(ct);
        }
        let rec = ct.experts.as_ref().map_or(0, |(_, lay)| lay.rec_bytes as u64);
        let (scratch, shared, lane_bytes) = chunk_bytes(ct, ctx, CHUNK);
        // every chunk-sized buffer is a fixed number of rows a token: the
        // bytes a token of chunk adds, from the floor's chunk and twice it
        // (tests/streaming.rs `plan_equals_what_the_engine_allocates`
        // checks the largest chunk's allocation against it)
        let (scratch2, shared2, _) = chunk_bytes(ct, ctx, 2 * CHUNK);
        let per = |a: u64, b: u64| (b - a) / CHUNK as u64;
        let mut state = 0u64;
        for k in &c.attn_kinds {
            state += match k {
                AttnKind::Kda => {
                    f((c.conv_kernel - 1) * 3 * c.kda_channels() + c.kda_heads * c.kda_head_dim * c.kda_head_dim)
                }
                AttnKind::Mla => f(ctx * (c.kv_lora + c.qk_rope)),
            };
        }
        let moe = c.n_moe_layers() as u64;
        let k = c.top_k as u64;
        let min_cache = if moe > 0 { aligned_alloc_bytes((2 * k * rec) as usize, true) } else { 0 };
        let floor = trunk + state + scratch + shared + min_cache;
        let ws = k * rec * moe;
        // a malformed vision.json matters only when images are enabled (Model::open reports it)
        let vcfg = crate::vision::config(ct).ok().flatten();
        Ok(Plan {
            trunk_bytes: trunk,
            state_bytes: state,
            scratch_bytes: scratch,
            shared_scratch_bytes: shared,
            chunk: CHUNK as u64,
            chunk_token_bytes: per(scratch, scratch2),
            chunk_shared_token_bytes: per(shared, shared2),
            tokenizer_bytes: 0,
            tokenize_bytes: 0,
            template_bytes: 0,
            grammar_bytes: 0,
            min_expert_cache_bytes: min_cache,
            floor_bytes: floor,
            working_set_bytes: ws,
            recommended_bytes: floor + 3 * ws,
            record_bytes: rec,
            ctx: ctx as u64,
            top_k: k,
            layer_experts: if moe > 0 { c.experts as u64 } else { 0 },
            expert_records: moe * c.experts as u64,
            vocab: c.vocab as u64,
            layers: c.layers as u64,
            vision_weight_bytes: vcfg.as_ref().map_or(0, |v| crate::vision::weight_bytes(ct, v)),
            vision_scratch_bytes: vcfg
                .as_ref()
                .map_or(0, |v| v.scratch_bytes().max(waste_vision::max_preprocess_bytes(v))),
            vision: false,
            expert_lanes: u64::from(lane_bytes > 0),
            expert_lane_bytes: lane_bytes,
            parallel: 1,
            parallel_bytes: 0,
            snapshots: 0,
            snapshot_bytes: 0,
            streamed_layers: 0,
            streamed_bytes: 0,
            streamed_read_bytes: 0,
            stream_buffer_bytes: 0,
        })
    }

    /// The split of `layers` (each decoder layer's bytes, [`layer_bytes`])
    /// that brings this plan's floor within `budget` while streaming the
    /// fewest bytes a token: for each bound on the largest streamed layer
    /// (which sets the two buffers), the largest layers under it first,
    /// until the floor fits. Above the floor, no split. Applied to a plan
    /// with no split yet.
    ///
    /// # Errors
    /// The lowest budget any split reaches (every layer under the best
    /// bound streamed) when `budget` is below it.
    pub fn split(&self, layers: &[u64], head: u64, budget: u64) -> std::result::Result<Split, u64> {
        let floor = self.floor_bytes;
        if budget >= floor {
            return Ok(Split::default());
        }
        let need = floor - budget;
        let mut caps: Vec<u64> = layers.iter().copied().filter(|&b| b > 0).chain([0]).collect();
        caps.sort_unstable();
        caps.dedup();
        let mut best: Option<Split> = None;
        let mut most_saved = 0u64;
        let heads: &[bool] = if head > 0 { &[false, true] } else { &[false] };
        for (&with_head, &cap) in heads.iter().flat_map(|h| caps.iter().map(move |c| (h, c))) {
            let mut order: Vec<usize> = (0..layers.len()).filter(|&l| layers[l] > 0 && layers[l] <= cap).collect();
            order.sort_by_key(|&l| (std::cmp::Reverse(layers[l]), l));
            let piece = if with_head { head_piece_bytes(head) } else { 0 };
            let mut s = Split {
                streamed: Vec::new(),
                head: with_head,
                streamed_bytes: if with_head { head } else { 0 },
                read_bytes: 0,
                buffer_bytes: cap.max(piece).saturating_mul(2),
            };
            let mut order = order.into_iter();
            while s.saved_bytes() < need {
                let Some(l) = order.next() else { break };
                s.streamed.push(l);
                s.streamed_bytes = s.streamed_bytes.saturating_add(layers[l]);
            }
            most_saved = most_saved.max(s.saved_bytes());
            let better = |b: &Split| (s.streamed_bytes, s.streamed.len()) < (b.streamed_bytes, b.streamed.len());
            if s.streams() && s.saved_bytes() >= need && best.as_ref().is_none_or(better) {
                s.streamed.sort_unstable();
                best = Some(s);
            }
        }
        best.ok_or(floor - most_saved)
    }

    /// The same plan with `s`'s layers streamed: their bytes out of the
    /// floor and the recommendation, its buffers in.
    pub fn with_split(mut self, s: &Split) -> Plan {
        let (old, new) = (
            self.streamed_bytes.saturating_sub(self.stream_buffer_bytes),
            s.streamed_bytes.saturating_sub(s.buffer_bytes),
        );
        self.floor_bytes = (self.floor_bytes + old).saturating_sub(new);
        self.recommended_bytes = (self.recommended_bytes + old).saturating_sub(new);
        self.streamed_layers = s.streamed.len() as u64;
        self.streamed_bytes = s.streamed_bytes;
        self.streamed_read_bytes = s.read_bytes;
        self.stream_buffer_bytes = s.buffer_bytes;
        self
    }

    /// The most sequences one batched step takes with `slots` cache slots
    /// and a router lookahead of `lookahead` experts: each token's `top_k`
    /// experts are pinned at once, and a step's buffers hold [`CHUNK`]
    /// tokens.
    pub fn max_batch(&self, slots: usize, lookahead: usize) -> usize {
        if self.expert_records == 0 || self.top_k == 0 {
            return CHUNK;
        }
        (slots.saturating_sub(lookahead) / self.top_k as usize).clamp(1, CHUNK)
    }

    /// The same plan with `n` session snapshots kept in memory (each at
    /// most the state at full context and the logits), in the floor and
    /// the recommendation.
    pub fn with_snapshots(mut self, n: usize) -> Plan {
        let bytes = (n as u64).saturating_mul(self.state_bytes.saturating_add(self.vocab.saturating_mul(4)));
        self.floor_bytes = (self.floor_bytes - self.snapshot_bytes).saturating_add(bytes);
        self.recommended_bytes = (self.recommended_bytes - self.snapshot_bytes).saturating_add(bytes);
        self.snapshots = n as u64;
        self.snapshot_bytes = bytes;
        self
    }

    /// The same plan for `n` sessions decoded together (at least 1): the
    /// others' state and scratch, and a batched step's logits, in the floor
    /// and the recommendation. Applied after [`Plan::with_threads`] (each
    /// session's scratch holds its expert lanes).
    pub fn with_parallel(mut self, n: usize) -> Plan {
        let n = n.max(1) as u64;
        let logits = if n > 1 { n.saturating_mul(self.vocab).saturating_mul(4) } else { 0 };
        let bytes = (n - 1).saturating_mul(self.state_bytes + self.scratch_bytes).saturating_add(logits);
        self.floor_bytes = (self.floor_bytes - self.parallel_bytes).saturating_add(bytes);
        self.recommended_bytes = (self.recommended_bytes - self.parallel_bytes).saturating_add(bytes);
        self.parallel = n;
        self.parallel_bytes = bytes;
        self
    }

    /// The same plan with buffers for prefill chunks of `chunk` tokens
    /// (clamped to [`CHUNK`]..=[`MAX_CHUNK`]): each session's scratch and
    /// the shared scratch, in the floor and the recommendation (the
    /// parallel sessions' scratch too).
    pub fn with_chunk(mut self, chunk: usize) -> Plan {
        let (old, new) = (self.chunk - CHUNK as u64, chunk.clamp(CHUNK, MAX_CHUNK) as u64 - CHUNK as u64);
        let (ts, tsh) = (self.chunk_token_bytes, self.chunk_shared_token_bytes);
        let (was, now) = (old * (ts + tsh), new * (ts + tsh));
        self.scratch_bytes = self.scratch_bytes - old * ts + new * ts;
        self.shared_scratch_bytes = self.shared_scratch_bytes - old * tsh + new * tsh;
        self.floor_bytes = self.floor_bytes - was + now;
        self.recommended_bytes = self.recommended_bytes - was + now;
        self.chunk = CHUNK as u64 + new;
        self.with_parallel(self.parallel as usize)
    }

    /// The largest prefill chunk ([`MAX_CHUNK`], 64, 32 or [`CHUNK`], at
    /// most `most`) whose buffers beyond the floor's take at most a
    /// thirty-second of an expert cache of `cache_bytes`, and which such a
    /// cache can feed (every distinct expert of a chunk's layer is held at
    /// once: `top_k` slots a token, or a whole layer's); [`CHUNK`] at least.
    pub fn chunk_for(&self, cache_bytes: u64, most: usize) -> usize {
        let fed = match self.record_bytes * self.top_k {
            0 => MAX_CHUNK as u64,
            _ if cache_bytes / self.record_bytes >= self.layer_experts => MAX_CHUNK as u64,
            per_token => cache_bytes / per_token,
        };
        let base = self.with_chunk(CHUNK).floor_bytes;
        CHUNK_LADDER
            .into_iter()
            .find(|&c| {
                c <= most.max(CHUNK)
                    && c as u64 <= fed.max(CHUNK as u64)
                    && self.with_chunk(c).floor_bytes - base <= cache_bytes / CHUNK_CACHE_SHARE
            })
            .unwrap_or(CHUNK)
    }

    /// The same plan for a pool of `threads` compute threads: as many
    /// expert lanes as `waste_moe::lanes_for` gives (each lane's buffers in
    /// the scratch, the floor and the recommendation).
    pub fn with_threads(mut self, threads: usize) -> Plan {
        if self.expert_lanes == 0 {
            return self;
        }
        let lanes = waste_moe::lanes_for(threads, self.top_k as usize) as u64;
        let (old, new) = (self.expert_lanes * self.expert_lane_bytes, lanes * self.expert_lane_bytes);
        self.scratch_bytes = self.scratch_bytes - old + new;
        self.floor_bytes = self.floor_bytes - old + new;
        self.recommended_bytes = self.recommended_bytes - old + new;
        self.expert_lanes = lanes;
        self
    }

    /// The largest context (≤ [`MAX_CTX`]) whose floor, with the tokenizer
    /// counted and `threads` compute threads, fits in `bytes`, if any.
    pub fn largest_ctx_within(
        ct: &Container,
        bytes: u64,
        tok: Option<&waste_tokenizer::Tokenizer>,
        threads: usize,
    ) -> Option<usize> {
        let fits = |ctx: usize| {
            Plan::for_container(ct, ctx).is_ok_and(|p| p.with_tokenizer(tok).with_threads(threads).floor_bytes <= bytes)
        };
        if !fits(1) {
            return None;
        }
        let (mut lo, mut hi) = (1usize, MAX_CTX);
        if fits(hi) {
            return Some(hi);
        }
        while hi - lo > 1 {
            let mid = lo + (hi - lo) / 2;
            if fits(mid) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        Some(lo)
    }

    /// Expert-cache slots a cache of `cache_bytes` holds: as many records as
    /// fit with the arena's rounding (2 MiB with huge pages) included, at
    /// least 2 × top_k (the floor), never more than the container's records.
    /// `Model::open` allocates exactly this many; `waste plan` reports it.
    pub fn cache_slots(&self, cache_bytes: u64, huge_pages: bool) -> usize {
        let rec = self.record_bytes;
        if rec == 0 {
            return 0;
        }
        let min = 2 * self.top_k;
        let mut n = (cache_bytes / rec).max(min).min(self.expert_records.max(min));
        while n > min && n.checked_mul(rec).is_none_or(|b| aligned_alloc_bytes(b as usize, huge_pages) > cache_bytes) {
            n -= 1;
        }
        n.min(self.expert_records) as usize
    }

    /// Bytes the cache's arena of `slots` records takes (what `Model::open`
    /// allocates for them, the 2 MiB rounding of huge pages included): at
    /// most the budget's share, less when the slots hold every record.
    pub fn cache_arena_bytes(&self, slots: usize, huge_pages: bool) -> u64 {
        if slots == 0 {
            return 0;
        }
        aligned_alloc_bytes((slots as u64).saturating_mul(self.record_bytes) as usize, huge_pages)
    }

    /// The same plan with the tokenizer counted (in the floor, and so
    /// outside the expert cache's share of the budget): its tables, and
    /// tokenizing the longest text this plan's context admits.
    pub fn with_tokenizer(mut self, tok: Option<&waste_tokenizer::Tokenizer>) -> Plan {
        let tables = tok.map_or(0, |t| t.heap_bytes());
        let text = tok.map_or(0, |t| (self.ctx as usize).saturating_mul(t.max_token_bytes().max(1)));
        let working = tok.map_or(0, |t| t.encode_working_bytes(text));
        let (old, new) = (self.tokenizer_bytes + self.tokenize_bytes, tables.saturating_add(working));
        self.floor_bytes = self.floor_bytes - old + new;
        self.recommended_bytes = self.recommended_bytes - old + new;
        (self.tokenizer_bytes, self.tokenize_bytes) = (tables, working);
        self
    }

    /// The same plan with rendering the chat template counted (in the
    /// floor): [`Plan::template_bytes`].
    pub fn with_chat_template(mut self, t: Option<&waste_tokenizer::ChatTemplate>) -> Plan {
        let bytes = match t {
            Some(waste_tokenizer::ChatTemplate::Jinja(src)) => {
                (src.len() as u64).saturating_mul(7).saturating_add(waste_tokenizer::TEMPLATE_OUTPUT_BYTES as u64)
            }
            _ => 0,
        };
        self.floor_bytes = self.floor_bytes - self.template_bytes + bytes;
        self.recommended_bytes = self.recommended_bytes - self.template_bytes + bytes;
        self.template_bytes = bytes;
        self
    }

    /// The same plan with the constrained-decoding tables reserved:
    /// [`GRAMMAR_BYTES_PER_TOKEN`] per vocabulary entry.
    pub fn with_grammar(mut self, vocab: usize) -> Plan {
        let bytes = GRAMMAR_BYTES_PER_TOKEN * vocab as u64;
        self.floor_bytes = self.floor_bytes - self.grammar_bytes + bytes;
        self.recommended_bytes = self.recommended_bytes - self.grammar_bytes + bytes;
        self.grammar_bytes = bytes;
        self
    }

    /// What enabling images adds: the tower's weights and one image's buffers.
    pub fn vision_bytes(&self) -> u64 {
        self.vision_weight_bytes + self.vision_scratch_bytes
    }

    /// The same plan with images enabled: the vision bytes counted in the
    /// floor (and so taken from the expert cache's share of the budget).
    pub fn with_vision(mut self) -> Plan {
        if !self.vision {
            self.floor_bytes += self.vision_bytes();
            self.recommended_bytes += self.vision_bytes();
            self.vision = true;
        }
        self
    }

    /// The budget rule's inputs.
    pub fn floor(&self) -> waste_cache::Floor {
        let vision = if self.vision { self.vision_bytes() } else { 0 };
        waste_cache::Floor {
            fixed: self.trunk_bytes.saturating_sub(self.streamed_bytes)
                + self.stream_buffer_bytes
                + self.state_bytes
                + self.scratch_bytes
                + self.shared_scratch_bytes
                + self.tokenizer_bytes
                + self.tokenize_bytes
                + self.template_bytes
                + self.grammar_bytes
                + self.parallel_bytes
                + self.snapshot_bytes
                + vision,
            min_cache: self.min_expert_cache_bytes,
            working_set: self.working_set_bytes,
        }
    }
}

/// The container's tokenizer, if it has one, checked against its model:
/// every id the tokenizer can produce must be a row of the embedding (an
/// id past the vocabulary would fail only when some prompt produced it).
pub(crate) fn load_tokenizer(ct: &Container) -> Result<Option<waste_tokenizer::Tokenizer>> {
    if !ct.dir.join("tokenizer.model").exists() {
        return Ok(None);
    }
    let tok = waste_tokenizer::Tokenizer::from_container_dir(&ct.dir)?;
    let vocab = ct.config.vocab;
    if let Some(id) = tok.max_id().filter(|&id| id as usize >= vocab) {
        return Err(waste_tokenizer::Error::Vocabulary(format!(
            "id {id} ({:?}) is outside the model's vocabulary of {vocab}",
            tok.decode(&[id])
        ))
        .into());
    }
    Ok(Some(tok))
}

/// Plan a container at `ctx` tokens without loading any weight (the
/// tokenizer is loaded, to count its tables), for the default compute
/// threads (every core, as [`crate::ModelOptions`]' `threads: 0`).
///
/// # Errors
/// The container's or the tokenizer's validation errors; a `ctx` outside
/// `1..=MAX_CTX`.
pub fn plan(path: impl AsRef<Path>, ctx: usize) -> Result<Plan> {
    let ct = Container::open(path.as_ref())?;
    let tok = load_tokenizer(&ct)?;
    let template = load_chat_template(&ct, tok.as_ref())?;
    Ok(Plan::for_container(&ct, ctx)?
        .with_tokenizer(tok.as_ref())
        .with_chat_template(template.as_ref())
        .with_threads(default_threads()))
}

/// The layers to stream for an explicit `budget` below the plan's floor
/// (none at or above it, or for the automatic budget), or
/// [`crate::Error::Budget`] naming the lowest budget any split reaches.
pub(crate) fn split_of(container: &Container, plan: &Plan, budget: u64, usable: u64) -> Result<Split> {
    // the automatic budget streams only where the resident floor is above
    // usable RAM (a floor that fits runs resident, as before)
    let target = if budget == 0 { usable } else { budget };
    if plan.floor_bytes <= target {
        return Ok(Split::default());
    }
    let (layers, head) = (layer_bytes(container), head_bytes(container));
    let split = if budget == 0 {
        // within the rule's 7/8 of usable RAM if a split fits there, else
        // within all of it, else none (the caller's floor check then names
        // the context that fits)
        [usable / 8 * 7, usable].iter().find_map(|&cap| plan.split(&layers, head, cap).ok()).unwrap_or_default()
    } else {
        plan.split(&layers, head, budget).map_err(|lowest| crate::Error::Budget {
            budget,
            floor: lowest,
            detail: format!(
                "every decoder layer and the head streamed from disk; still resident: the rest of the trunk {} + state {} + scratch {} + tokenizer {} + two layers being streamed + minimum expert cache {}",
                plan.trunk_bytes.saturating_sub(layers.iter().sum::<u64>() + head),
                plan.state_bytes,
                plan.scratch_bytes + plan.shared_scratch_bytes,
                plan.tokenizer_bytes + plan.tokenize_bytes + plan.template_bytes,
                plan.min_expert_cache_bytes
            ),
        })?
    };
    Ok(split.with_reads(&layer_read_bytes(container), head))
}

/// What a container streams at `budget` with `plan` (made for it by
/// [`plan`], no split applied): nothing at or above the floor; for the
/// automatic budget (0), when the resident floor is above `usable`, a
/// split within 7/8 of it (or all of it) if one fits, else nothing.
///
/// # Errors
/// [`crate::Error::Budget`] naming the lowest budget any split reaches;
/// the container's validation errors.
pub fn split(path: impl AsRef<Path>, plan: &Plan, budget: u64, usable: u64) -> Result<Split> {
    split_of(&Container::open(path.as_ref())?, plan, budget, usable)
}

/// The container's chat template when it has a tokenizer
/// (`chat_template.jinja`, `chat.json` or a default).
pub(crate) fn load_chat_template(
    ct: &Container,
    tok: Option<&waste_tokenizer::Tokenizer>,
) -> Result<Option<waste_tokenizer::ChatTemplate>> {
    tok.map(|t| waste_tokenizer::ChatTemplate::from_container_dir(&ct.dir, t))
        .transpose()
        .map_err(|e| crate::Error::Arg(format!("chat template: {e}")))
}

/// Compute threads when none are asked for: every core.
pub(crate) fn default_threads() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}
