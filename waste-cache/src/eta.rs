//! The `eta` eviction policy: evict the expert whose next use is expected
//! last — Belady's rule with the future replaced by an estimate.
//!
//! A decode step visits the MoE layers in order and uses `top_k` experts in
//! each, so from the layer being filled now, an expert of layer `l` can next
//! be used at layer `l` later in this token (if `l` is still ahead) or in
//! the next token — `first(l)` accesses away — and, if it is not used then,
//! one token (`span · top_k` accesses) later for every token it is skipped.
//! With `p` its estimated chance of being used in a token, the expected
//! distance to its next use is `first(l) + (1/p − 1) · span · top_k`. `p`
//! is an exponentially decayed count of the tokens that used the expert
//! (half-life [`HALF_LIFE_TOKENS`]) plus a small prior, times `(1 − γ)` —
//! for an expert used at a steady rate `r` this converges to `r`.
//!
//! Frequency alone (LFRU) ignores where in the layer cycle an expert sits:
//! with a cache smaller than a token's experts it keeps evicting the
//! experts of the early layers, exactly the ones needed first (LRU does the
//! same and hits nothing). Recency alone ignores popularity.
//!
//! The token clock is inferred from the layer order (a use of an earlier
//! layer than the last starts a token), so a prefill chunk counts as one
//! step and several sessions interleaving their layers age the counts
//! faster; both only shift the estimate, never what is computed. The two
//! parameters are fixed for every trace and every model (docs/lab/
//! has the measurements that chose them and what lost).

use crate::cache::Key;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Tokens after which a count is taken as fully decayed: γ^128 < 2⁻²⁵.
const DECAY_TABLE: usize = 128;

/// A multiplicative hash of a `(layer, expert)` key: the victim scan looks
/// up every resident expert, and SipHash was most of its cost.
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u32(&mut self, v: u32) {
        self.0 = (self.0.rotate_left(32) ^ u64::from(v)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// Half-life of an expert's use count, in tokens.
pub const HALF_LIFE_TOKENS: f64 = 5.0;
/// Prior count added to every expert (so an expert never seen is not
/// "never used again", only unlikely).
pub const PRIOR: f64 = 0.02;

/// The estimator's state: the layer order, a token clock and one decayed
/// count per expert ever used.
#[derive(Clone, Debug)]
pub struct Eta {
    /// Position of each layer in the MoE cycle (`u32::MAX`: no experts).
    pos: Vec<u32>,
    /// MoE layers per token.
    span: u32,
    /// Experts per layer and token.
    top_k: u32,
    /// Tokens seen (a step that goes back to an earlier layer starts one).
    token: u64,
    /// Position of the last layer used.
    last_pos: u32,
    /// Per expert: decayed count and the token it was last updated.
    counts: HashMap<Key, (f64, u64), BuildHasherDefault<KeyHasher>>,
    /// γ per token.
    gamma: f64,
    /// γ^k for k < [`DECAY_TABLE`].
    decay: Vec<f64>,
}

impl Eta {
    /// For MoE layers `layers` (in the order a token visits them) using
    /// `top_k` experts each.
    pub fn new(layers: &[u32], top_k: usize) -> Eta {
        let n = layers.iter().map(|&l| l as usize + 1).max().unwrap_or(0);
        let mut pos = vec![u32::MAX; n];
        for (i, &l) in layers.iter().enumerate() {
            pos[l as usize] = i as u32;
        }
        Eta {
            pos,
            span: layers.len().max(1) as u32,
            top_k: top_k.max(1) as u32,
            token: 0,
            last_pos: 0,
            counts: HashMap::default(),
            gamma: 0.5f64.powf(1.0 / HALF_LIFE_TOKENS),
            decay: (0..DECAY_TABLE).map(|k| 0.5f64.powf(k as f64 / HALF_LIFE_TOKENS)).collect(),
        }
    }

    fn pos_of(&self, layer: u32) -> u32 {
        self.pos.get(layer as usize).copied().filter(|&p| p != u32::MAX).unwrap_or(0)
    }

    fn decayed(&self, key: Key) -> f64 {
        self.counts
            .get(&key)
            .map_or(0.0, |&(c, t)| c * self.decay.get((self.token - t) as usize).copied().unwrap_or(0.0))
    }

    /// Record a use of `key` (the first use of an expert in a token counts
    /// once: a chunk's tokens sharing an expert are one layer-step).
    pub fn used(&mut self, key: Key) {
        let p = self.pos_of(key.0);
        if p < self.last_pos {
            self.token += 1;
        }
        self.last_pos = p;
        let t = self.token;
        let c = self.decayed(key);
        match self.counts.get(&key) {
            Some(&(_, last)) if last == t => {}
            _ => {
                self.counts.insert(key, (c + 1.0, t));
            }
        }
    }

    /// Seed an expert as used `count` times (a usage hotlist): its estimated
    /// rate starts at half the steady-state rate of an expert used every
    /// token, scaled by `count / max_count`.
    pub fn seed(&mut self, key: Key, count: u32, max_count: u32) {
        if max_count == 0 {
            return;
        }
        let steady = 1.0 / (1.0 - self.gamma);
        self.counts.insert(key, (0.5 * steady * count as f64 / max_count as f64, self.token));
    }

    /// Estimated chance that `key` is used in a token.
    pub fn rate(&self, key: Key) -> f64 {
        ((self.decayed(key) + PRIOR) * (1.0 - self.gamma)).clamp(1e-6, 1.0)
    }

    /// Expected accesses until `key`'s next use, seen from layer `now`.
    pub fn distance(&self, key: Key, now: u32) -> f64 {
        let (pk, pn) = (self.pos_of(key.0), self.pos_of(now));
        let k = self.top_k as f64;
        let first = if pk > pn { (pk - pn) as f64 * k } else { (self.span - pn + pk) as f64 * k };
        first + (1.0 / self.rate(key) - 1.0) * self.span as f64 * k
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn popular_experts_and_early_layers_are_kept() {
        let mut e = Eta::new(&[1, 2, 3], 2);
        // token after token, expert 5 of layer 1 is used; expert 6 once
        for t in 0..10 {
            e.used((1, 5));
            if t == 0 {
                e.used((1, 6));
            }
            e.used((2, 0));
            e.used((3, 0));
        }
        assert!(e.rate((1, 5)) > 0.7 && e.rate((1, 6)) < 0.1, "{} {}", e.rate((1, 5)), e.rate((1, 6)));
        // seen from layer 3, the popular one is expected sooner
        assert!(e.distance((1, 5), 3) < e.distance((1, 6), 3));
        // equal rates: the layer needed first (layer 1, next token) before
        // the one just passed (layer 3: a whole token away)
        e.used((1, 7));
        e.used((3, 7));
        assert!(e.distance((1, 7), 3) < e.distance((3, 7), 3));
        // a layer still ahead in this token comes before both
        assert!(e.distance((3, 0), 2) < e.distance((1, 5), 2) + 1e9);
        assert_eq!(e.distance((3, 0), 2) - (1.0 / e.rate((3, 0)) - 1.0) * 6.0, 2.0);
    }

    #[test]
    fn a_chunk_counts_an_expert_once_per_token_and_seeds_scale() {
        let mut e = Eta::new(&[0, 1], 1);
        e.used((0, 1));
        e.used((0, 1));
        e.used((0, 1));
        let once = e.rate((0, 1));
        let mut f = Eta::new(&[0, 1], 1);
        f.used((0, 1));
        assert_eq!(once, f.rate((0, 1)));
        f.seed((1, 9), 10, 10);
        f.seed((1, 8), 1, 10);
        assert!(f.rate((1, 9)) > 4.0 * f.rate((1, 8)));
        assert!(f.rate((1, 9)) < 0.51, "{}", f.rate((1, 9))); // half the steady rate, plus the prior
    }
}
