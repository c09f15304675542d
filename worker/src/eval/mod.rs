//! Real acceptance length: greedy DFlash speculative decoding with an exported drafter
//! against plain greedy decoding of its target, on prompts (`dflash-worker eval`, what
//! `dflash-supervise eval` runs). The target decodes over a KV cache
//! (the native engine's [`crate::models::target::device::decode::Decoder`], or the torch
//! engine's child: [`verifier`]); the drafter proposes blocks
//! without gradients ([`draft::Draft`]); [`spec`] is the loop and [`report`] the figures.

pub mod draft;
pub mod report;
pub mod spec;
pub mod tool;
pub mod verifier;

use std::path::PathBuf;

/// Inputs `eval` refuses (exit 2, one line).
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    #[error("--drafter {}: not an exported drafter directory: {why}", dir.display())]
    NotADrafter { dir: PathBuf, why: String },
    #[error("--drafter {}: trained for a target of another {what} ({drafter}; --target has {target})", dir.display())]
    OtherTarget {
        dir: PathBuf,
        what: &'static str,
        drafter: usize,
        target: usize,
    },
    #[error("--prompts {}: line {line}: {why} (expected a JSON array of token ids, or {{\"input_ids\": [...]}})", path.display())]
    BadPrompt {
        path: PathBuf,
        line: usize,
        why: String,
    },
    #[error("--prompts {}: no prompts (expected one JSON array of token ids per line)", path.display())]
    NoPrompts { path: PathBuf },
    #[error("--prompts {}: {source}", path.display())]
    Unreadable {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("--max-new-tokens 0: expected 1 or more")]
    NoNewTokens,
}
