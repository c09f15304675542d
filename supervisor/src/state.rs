//! What a run's `state.json` holds: the run's phase and counters, the drafter's training
//! progress, every worker's process. A leaf: the supervisor's loop writes it (through
//! `run::rundir`), `status`, the report and the trainer read or fill it, and it depends on
//! nothing of theirs.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The live state of a run (`RUN_DIR/state.json`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RunState {
    pub run_dir: PathBuf,
    pub supervisor_pid: u32,
    pub started_at: String,
    pub started_at_unix_ms: u64,
    /// running | stopping | stopped | failed
    pub phase: String,
    /// Set once the supervisor has decided how it exits.
    pub exit_code: Option<i32>,
    /// Batches the loader has put in the pipeline so far.
    #[serde(default)]
    pub batches_produced: u64,
    /// Batches consumed by drafters so far.
    #[serde(default)]
    pub batches_consumed: u64,
    /// Bad dataset lines the loader skipped so far (absent in runs of older versions).
    #[serde(default)]
    pub bad_lines: Option<u64>,
    /// The drafter's training: last committed step and its figures.
    #[serde(default)]
    pub train: Option<TrainProgress>,
    /// The latest metrics window (the last line of metrics.jsonl).
    #[serde(default)]
    pub metrics: Option<crate::telemetry::window::Window>,
    pub workers: Vec<WorkerState>,
}

/// The latest committed step, for status and the run's end.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct TrainProgress {
    pub step: u64,
    /// The last eval (`--eval-data`): its step, loss and acceptance; the best eval's step.
    #[serde(default)]
    pub eval_step: Option<u64>,
    #[serde(default)]
    pub eval_loss: Option<f64>,
    #[serde(default)]
    pub eval_acceptance: Option<f64>,
    #[serde(default)]
    pub best_step: Option<u64>,
    /// The last real τ measurement (`--eval-prompts`), as train.jsonl records it.
    #[serde(default)]
    pub tau: Option<serde_json::Value>,
    pub loss: f64,
    pub acceptance: f64,
    pub slot_accuracy: Vec<f64>,
    /// The learning rate of the last committed step.
    #[serde(default)]
    pub lr: Option<f64>,
    pub members: usize,
    pub exported: Option<String>,
    /// The step the exported drafter holds.
    #[serde(default)]
    pub exported_step: Option<u64>,
    /// The step of the current rollback snapshot and what one costs (ms).
    #[serde(default)]
    pub snapshot_step: Option<u64>,
    #[serde(default)]
    pub snapshot_ms: Option<f64>,
    /// Steps between snapshots (--snapshot-every, or the measured interval).
    #[serde(default)]
    pub snapshot_every: u64,
    /// Rollbacks so far (every drafter died and the group went back to a saved state).
    #[serde(default)]
    pub rollbacks: u32,
    /// Steps whose update was skipped (non-finite loss or gradient).
    #[serde(default)]
    pub skipped_steps: u64,
    /// The drafter group's membership epoch (it changes with every death, join and
    /// rollback).
    #[serde(default)]
    pub epoch: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct WorkerState {
    pub name: String,
    pub role: String,
    pub rank: u32,
    /// GPU index, or "cpu".
    pub gpu: String,
    /// The live process, if any.
    pub pid: Option<u32>,
    /// starting | running | stopping | backoff | exited | failed
    pub state: String,
    pub restarts: u32,
    pub started_at: Option<String>,
    pub last_exit: Option<String>,
    pub log: PathBuf,
}
