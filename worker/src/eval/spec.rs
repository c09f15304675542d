//! Greedy decoding, plain and speculative (DFlash's release): the target prefills the
//! prompt; then, step by step, the drafter proposes a block `[last committed token,
//! its guesses for the block's other slots]` from the context's taps, the target verifies
//! the whole block in one forward over its KV cache, the longest prefix of guesses that
//! equal the target's own argmax is accepted plus the target's next token (1 to block
//! size tokens per step), and the cache is cropped back to the committed positions, whose
//! taps join the context. Stops at EOS or the token limit. Lossless: the tokens are
//! plain greedy decoding's.

use super::draft::Draft;
use super::verifier::Verifier;
use crate::error::ToolError;

type Result<T> = std::result::Result<T, ToolError>;

/// One prompt's decoding.
#[derive(Debug, Clone, PartialEq)]
pub struct Decoded {
    /// The new tokens (at most the limit; the EOS included when it came).
    pub tokens: Vec<u32>,
    /// Per verify step: the tokens it committed (accepted guesses + 1).
    pub accepted: Vec<usize>,
}

/// Where decoding stops: the limit of new tokens and the end-of-sequence token.
#[derive(Debug, Clone, Copy)]
pub struct Stop {
    pub max_new: usize,
    pub eos: Option<u32>,
}

impl Stop {
    /// `tokens` cut after the EOS or at the limit; whether decoding is done.
    fn cut(&self, tokens: &mut Vec<u32>) -> bool {
        if let Some(i) = self.eos.and_then(|e| tokens.iter().position(|&t| t == e)) {
            tokens.truncate(i + 1);
            return true;
        }
        if tokens.len() >= self.max_new {
            tokens.truncate(self.max_new);
            return true;
        }
        false
    }
}

/// Plain greedy decoding over the cache: one target forward per token.
pub fn greedy(dec: &mut dyn Verifier, prompt: &[u32], stop: Stop) -> Result<Vec<u32>> {
    nonempty(prompt)?;
    dec.keep(0)?;
    let f = dec.verify(prompt)?;
    let mut out = vec![f.argmax[f.argmax.len() - 1]];
    while !stop.cut(&mut out) {
        let f = dec.verify(&out[out.len() - 1..])?;
        out.push(f.argmax[0]);
    }
    Ok(out)
}

/// Speculative greedy decoding with `draft`.
pub fn speculative(
    dec: &mut dyn Verifier,
    draft: &mut Draft,
    prompt: &[u32],
    stop: Stop,
) -> Result<Decoded> {
    nonempty(prompt)?;
    let width = dec.taps_width();
    dec.keep(0)?;
    let f = dec.verify(prompt)?;
    let mut ctx = f.taps;
    let mut seq = prompt.to_vec();
    seq.push(f.argmax[f.argmax.len() - 1]);
    let mut accepted = Vec::new();
    let mut out = seq[prompt.len()..].to_vec();
    while !stop.cut(&mut out) {
        let guesses = draft.propose(&seq, &ctx, dec)?;
        let start = dec.cached();
        let mut block = vec![seq[seq.len() - 1]];
        block.extend_from_slice(&guesses);
        let f = dec.verify(&block)?;
        let target = f.argmax;
        let n = guesses
            .iter()
            .zip(&target)
            .take_while(|(g, t)| g == t)
            .count();
        // The accepted guesses, then the target's own token after them.
        seq.extend_from_slice(&guesses[..n]);
        seq.push(target[n]);
        dec.keep(start + n + 1)?;
        ctx.extend_from_slice(&f.taps[..(n + 1) * width]);
        accepted.push(n + 1);
        out = seq[prompt.len()..].to_vec();
    }
    Ok(Decoded {
        tokens: out,
        accepted,
    })
}

fn nonempty(prompt: &[u32]) -> Result<()> {
    if prompt.is_empty() {
        return Err(crate::device::GpuError::Invalid("an empty prompt".into()).into());
    }
    Ok(())
}
