//! Training: the [`trainer`] decides steps, rollbacks, snapshots and checkpoints from what
//! the drafters report, and returns actions for the dispatcher to carry out (no I/O of its
//! own); [`resume`] continues a stopped run from its checkpoint; [`schedule`] decides the
//! learning-rate schedule's length; [`eval`] scores the held-out set (`--eval-data`).

pub mod eval;
pub mod resume;
pub mod schedule;
pub mod trainer;
