/// Errors of the engine. Nothing is printed, nothing exits: every failure
/// comes back as one of these, with the precise detail in its message.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An I/O failure (file, offset, OS error).
    #[error(transparent)]
    Io(#[from] waste_io::Error),
    /// The container (or a state/usage file) is malformed or damaged.
    #[error(transparent)]
    Format(#[from] waste_format::Error),
    /// The RAM budget cannot hold the model.
    #[error("budget {budget} bytes is below the model's floor of {floor} bytes ({detail})")]
    Budget {
        /// Budget asked for.
        budget: u64,
        /// The smallest budget that works.
        floor: u64,
        /// Breakdown.
        detail: String,
    },
    /// The expert cache's invariants broke (a pin leaked, every slot pinned):
    /// an engine bug, reported loudly rather than risking wrong text.
    #[error(transparent)]
    Cache(#[from] waste_cache::CacheError),
    /// The model's floor (trunk, state for the context, scratch, smallest
    /// cache) is more than this machine's usable RAM: opening would end in
    /// an allocation failure or swapping.
    #[error("the floor of {floor} bytes at ctx {ctx} exceeds usable RAM of {usable} bytes; {}", match max_ctx { Some(c) => format!("the largest ctx that fits is {c}"), None => "no context fits".into() })]
    FloorAboveRam {
        /// Floor at this context.
        floor: u64,
        /// Context asked for.
        ctx: usize,
        /// Usable RAM (cgroup-aware).
        usable: u64,
        /// Largest context whose floor fits, if any.
        max_ctx: Option<usize>,
    },
    /// The tokenizer files of the container could not be loaded.
    #[error(transparent)]
    Tokenizer(#[from] waste_tokenizer::Error),
    /// The session's context cannot take these tokens (checked before any
    /// state changes).
    #[error("context full: {pos} + {n} tokens exceed ctx {ctx}")]
    ContextFull {
        /// Tokens already in the session.
        pos: usize,
        /// Tokens asked for.
        n: usize,
        /// The context bound.
        ctx: usize,
    },
    /// Text too long for the context whatever its tokens (more bytes than
    /// `ctx` times the tokenizer's longest token), refused before it is
    /// tokenized.
    #[error("the text is {bytes} bytes: more than a context of {ctx} tokens can hold (a token is at most {max_token_bytes} bytes)")]
    TextTooLong {
        /// The text's bytes.
        bytes: usize,
        /// The context bound.
        ctx: usize,
        /// The tokenizer's longest token, in bytes.
        max_token_bytes: usize,
    },
    /// A [`crate::TokenConstraint`] failed (a grammar error).
    #[error("constraint: {0}")]
    Constraint(#[from] ConstraintError),
    /// An image cannot be used, or the vision tower's config or weights are
    /// malformed (the message names which).
    #[error(transparent)]
    Vision(#[from] waste_vision::Error),
    /// The model computed a non-finite value (infinite or NaN): weights
    /// that load as finite but overflow, or damage no load-time check sees.
    /// `at` names where it first appeared — a layer's attention or
    /// feed-forward output (each checked as the step runs), or a logit —
    /// and the step stops there instead of sampling from garbage; the
    /// session must then be reset ([`Error::Incomplete`] until then).
    #[error("the model computed a non-finite value ({value}) in {at} at position {pos}: the container's weights are damaged (`waste verify` names damaged values) or overflow")]
    NonFinite {
        /// Position of the first token whose values are not finite.
        pos: usize,
        /// Where the value first appeared.
        at: NonFiniteAt,
        /// The first non-finite value there.
        value: f32,
    },
    /// An earlier step failed part-way (an I/O error, a damaged record, a
    /// non-finite value) after some layers had updated the session's state:
    /// the session refuses to evaluate or save until it is reset or loaded
    /// from a state, instead of going on from a state no sequence of tokens
    /// produced (a snapshot taken meanwhile carries the refusal with it).
    /// Holds the first failure's message.
    #[error("the session's state is incomplete: an earlier step failed part-way ({0}); reset the session or load a saved state")]
    Incomplete(String),
    /// An allocation failed.
    #[error("out of memory: {0}")]
    Oom(String),
    /// A bad argument from the caller.
    #[error("invalid argument: {0}")]
    Arg(String),
    /// A feature the engine does not implement.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The caller cancelled.
    #[error("cancelled")]
    Cancelled,
}

/// Where [`Error::NonFinite`] found its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum NonFiniteAt {
    /// The attention (mixer) output of this layer.
    Attention {
        /// Layer index.
        layer: usize,
    },
    /// The feed-forward (dense or MoE) output of this layer.
    Ffn {
        /// Layer index.
        layer: usize,
    },
    /// The logit of this token id (the LM head or the final norm).
    Logit {
        /// Token id.
        token: usize,
    },
}

impl std::fmt::Display for NonFiniteAt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NonFiniteAt::Attention { layer } => write!(f, "layer {layer}'s attention output"),
            NonFiniteAt::Ffn { layer } => write!(f, "layer {layer}'s feed-forward output"),
            NonFiniteAt::Logit { token } => write!(f, "the logit of token {token}"),
        }
    }
}

pub use waste_tokenizer::ConstraintError;

/// Result alias.
pub type Result<T, E = Error> = std::result::Result<T, E>;
