//! Training: the [`trainer`] decides steps, rollbacks, snapshots and checkpoints from what
//! the drafters report, and returns actions for the dispatcher to carry out (no I/O of its
//! own); [`resume`] continues a stopped run from its checkpoint.

pub mod resume;
pub mod trainer;
