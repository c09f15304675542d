//! Training: the [`group`] state machine decides steps, rollbacks, snapshots and
//! checkpoints from what the drafters report (no I/O, no clock of its own); the
//! [`trainer`] drives it for the dispatcher, carrying out its effects through the
//! [`checkpoint_store`] (the checkpoints directory) and the [`train_log`] (train.jsonl);
//! [`resume`] continues a stopped run from its checkpoint; [`schedule`] decides the
//! learning-rate schedule's length; [`eval`] scores the held-out set (`--eval-data`);
//! [`tau`] tracks the real acceptance length measured during training (`--eval-prompts`).

pub mod checkpoint_store;
pub mod eval;
pub mod group;
pub mod resume;
pub mod schedule;
pub mod tau;
pub mod train_log;
pub mod trainer;
