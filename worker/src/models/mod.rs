//! Models: loading Hugging Face checkpoints, the frozen target, the built-in tiny target.

pub mod drafter;
pub mod target;
pub mod tiny;
pub mod weights;

pub use weights::{ModelError, ModelProblem};
