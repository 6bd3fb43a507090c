//! The hook constrained decoding plugs into generation: which token may
//! come next. Here, beside the tokens it speaks of, so a grammar engine
//! (waste-grammar) depends on the tokenizer, not on the whole engine; the
//! engine (`waste_model`) re-exports both and drives the hook.

/// Restricts which token may come next (constrained decoding: a JSON schema,
/// a grammar). The engine's `Session::generate_constrained` asks before
/// every sample and reports every token it commits.
pub trait TokenConstraint {
    /// Write every entry of `mask` (one per vocabulary id: allowed next or
    /// not; it holds the previous step's values on entry); return `false`
    /// when this step is unconstrained (the mask is then ignored).
    ///
    /// # Errors
    /// The grammar engine's failure; generation stops with it.
    fn allowed(&mut self, mask: &mut [bool]) -> Result<bool, ConstraintError>;
    /// The token that was chosen.
    ///
    /// # Errors
    /// As [`TokenConstraint::allowed`].
    fn commit(&mut self, token: u32) -> Result<(), ConstraintError>;
}

/// A constrained-decoding hook's failure (the grammar engine's message).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConstraintError(pub String);
