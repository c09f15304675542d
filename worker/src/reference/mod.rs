//! The reference: what the parity tests compare the product against, compiled only for
//! tests (the `reference` feature, which the worker's own dev-dependency turns on).
//!
//! - [`ops`]: the reference op set, in the style of llm.c — every op has an explicit
//!   forward and, where training needs it, an explicit backward: plain Rust with threads
//!   ([`ops::Cpu`]). Every kernel of the devices (the GPU's CUDA kernels, the CPU
//!   device's) is tested against it.
//! - [`target`] and [`drafter`]: the reference models over those ops, the forward of the
//!   target and the forward and backward of the drafter, checked against transformers,
//!   candle autograd and finite differences. The models the workers run are the device
//!   models of `crate::models` (over the `Device` seam), tested against these.
//!
//! Layouts: activations are row-major `[rows, dim]` f32; a linear layer's weight is
//! `[out, in]` as in Hugging Face checkpoints, so `y = x · Wᵀ`.

pub mod drafter;
pub mod ops;
pub mod target;

use std::ops::Range;

/// Which keys one query row may attend to: the union of two key ranges (the causal
/// prefix of a sequence; or, for a DFlash block, the context before its anchor and the
/// block itself). Empty ranges are allowed; a row with no key outputs zeros.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeySpan {
    pub a: Range<usize>,
    pub b: Range<usize>,
}

impl KeySpan {
    pub fn keys(&self) -> impl Iterator<Item = usize> + '_ {
        self.a.clone().chain(self.b.clone())
    }

    pub fn len(&self) -> usize {
        self.a.len() + self.b.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Shape of a multi-head attention call.
#[derive(Debug, Clone, Copy)]
pub struct Heads {
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// What attention's forward keeps for its backward: the softmax probabilities of every
/// (head, query) over its allowed keys, in `KeySpan::keys` order.
pub struct AttnSaved {
    pub probs: Vec<f32>,
    /// Start of each (query, head) row in `probs`.
    pub offsets: Vec<usize>,
}
