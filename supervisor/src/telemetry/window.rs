//! One metrics window as a type: what the dispatcher builds at the end of each
//! `--metrics-interval` and every sink consumes (metrics.jsonl, Prometheus, the console's
//! status and step lines, state.json, `plan --from` and the report). Its serialisation is
//! the schema of metrics.jsonl (written out in the `metrics` module's documentation).
//!
//! Every field reads as its default where a line lacks it (a line of an older version, or
//! one cut short by a crash), so a reader never fails on what an older run wrote.

use std::collections::{BTreeMap, BTreeSet};

use dflash_shared::protocol::DeviceMemory;
use serde::{Deserialize, Serialize};

/// One line of metrics.jsonl.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Window {
    /// When the window closed (RFC 3339).
    pub time: String,
    /// Its length in seconds.
    pub window_s: f64,
    pub gpu: Gpus,
    pub pipeline: Pipeline,
    pub batches: Batches,
    /// The newest committed step (`None` before the first).
    pub train: Option<Train>,
    /// The last held-out eval (`--eval-data`).
    pub eval: Option<Eval>,
    /// The last real τ measurement (`--eval-prompts`), as the τ worker reported it, with
    /// `best_step` added.
    pub tau: Option<serde_json::Value>,
    /// Worker restarts over the run.
    pub restarts: u64,
    pub workers: BTreeMap<String, WorkerEntry>,
    /// Workers per role (`target`, `drafter`), those whose device moved away not counted.
    pub roles: BTreeMap<String, u64>,
    /// Devices moved between the roles over the run (`--targets auto`).
    pub role_moves: u64,
    /// In a job across nodes: this window's node (0: the leader).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node: Option<u32>,
    /// On a job's leader: each other node's latest window (its GPUs as its supervisor's
    /// NVML sampled them, its pipeline and workers), by node.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub nodes: BTreeMap<u32, Window>,
}

/// The GPU samples of a window.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Gpus {
    /// Sampling rounds in the window.
    pub samples: u32,
    pub gpus: Vec<Gpu>,
}

/// Mean and max of the readings of one metric in a window; `null` when none succeeded.
#[derive(Debug, Default, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Stat {
    pub mean: f64,
    pub max: f64,
    pub samples: u32,
}

/// One GPU over a window.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Gpu {
    /// NVML's index.
    pub index: u32,
    /// Resident memory of each process on it, by worker name (`pid N` for another).
    pub process_mem_bytes: BTreeMap<String, u64>,
    /// Clock throttle reasons seen in the window (`None`: NVML could not say).
    pub throttle_reasons: Option<BTreeSet<String>>,
    pub xid_errors: Vec<u64>,
    /// Each metric of the GPU metrics table (`nvml::GPU_METRICS`), by its key.
    #[serde(flatten)]
    pub metrics: BTreeMap<String, Option<Stat>>,
}

impl Gpu {
    /// The metric `key`'s statistic `agg` (`None`: no reading succeeded).
    pub fn stat(&self, key: &str, agg: Agg) -> Option<f64> {
        let s = self.metrics.get(key).copied().flatten()?;
        Some(match agg {
            Agg::Mean => s.mean,
            Agg::Max => s.max,
        })
    }
}

/// Which of a window's statistics a GPU metric is reported by: its mean over the window,
/// or its maximum (a level that matters at its peak, or a counter's latest value).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Agg {
    Mean,
    Max,
}

impl Agg {
    /// The statistic's key in a window's entry (`{"mean": .., "max": ..}`).
    pub fn key(self) -> &'static str {
        match self {
            Agg::Mean => "mean",
            Agg::Max => "max",
        }
    }
}

/// Time-weighted shares of one shared-memory pool over a window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Pool {
    /// Share of slots holding a ready batch.
    pub fill_ratio: f64,
    /// Share of time a producer waited for a free slot.
    pub producers_blocked_share: f64,
    /// Share of time a consumer waited for a batch.
    pub consumers_starved_share: f64,
}

/// The pipeline over a window (measured by the `queue_health` module).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Pipeline {
    pub tokens_pool: Pool,
    pub hidden_pool: Pool,
    /// Batches each worker was handed in the window.
    pub batches_per_worker: BTreeMap<String, u64>,
    /// Per role, the most batches a worker was handed over the fewest (`None`: one had 0).
    pub balance_max_over_min: BTreeMap<String, Option<f64>>,
    /// Real tokens the drafters trained on per second: the run's tokens/s.
    pub tokens_per_s_trained: f64,
    pub tokens_per_s_by_worker: BTreeMap<String, f64>,
    /// Rows per length bucket (`<=16`, `<=32`, ...).
    pub length_buckets: BTreeMap<String, u64>,
    pub length_entropy_bits: f64,
    /// Real over padded tokens of the window's batches (`None`: no batch).
    pub padding_efficiency: Option<f64>,
    /// What starves what, in plain words (`None`: nothing, or not a steady window).
    pub bottleneck_hint: Option<String>,
    /// Per worker, per phase, the mean milliseconds of one unit of work.
    pub phase_ms_by_worker: BTreeMap<String, BTreeMap<String, f64>>,
    /// The latest device memory report of each GPU worker.
    pub cuda_memory_by_worker: BTreeMap<String, DeviceMemory>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Batches {
    pub produced: u64,
    pub consumed: u64,
    pub consumed_per_s: f64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Train {
    pub step: u64,
    pub steps_per_s: f64,
    pub loss: Option<f64>,
    pub acceptance: Option<f64>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Eval {
    pub step: u64,
    pub loss: Option<f64>,
    pub acceptance: Option<f64>,
    pub best_step: Option<u64>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct WorkerEntry {
    /// Its life's state (`running`, `backoff`, ...).
    pub state: String,
    pub pid: Option<u32>,
    pub restarts: u32,
}

impl Window {
    /// A line of metrics.jsonl (`None`: not a JSON object).
    pub fn parse(line: &str) -> Option<Window> {
        serde_json::from_str(line).ok()
    }

    /// Mean GPU busy share over the GPUs of the window, in percent (`None`: no GPU).
    pub fn mean_gpu_util_pct(&self) -> Option<f64> {
        let utils: Vec<f64> = self
            .gpu
            .gpus
            .iter()
            .filter_map(|g| g.stat("util_gpu_pct", Agg::Mean))
            .collect();
        (!utils.is_empty()).then(|| utils.iter().sum::<f64>() / utils.len() as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_window_reads_back_what_it_wrote_and_an_older_or_torn_line_reads_as_defaults() {
        let w: Window = serde_json::from_value(json!({
            "time": "t", "window_s": 10.0,
            "gpu": {"samples": 3, "gpus": [{"index": 1, "util_gpu_pct": {"mean": 50.0, "max": 90.0, "samples": 3},
                    "power_w": null, "process_mem_bytes": {"target-0": 5}, "throttle_reasons": ["sw_power_cap"],
                    "xid_errors": [79]}]},
            "pipeline": {"hidden_pool": {"fill_ratio": 0.5}, "bottleneck_hint": "h",
                         "cuda_memory_by_worker": {"drafter-0": {"reserved": 1, "in_use": 2, "peak": 3,
                          "alloc_failures": 0, "free": 4, "total": 5}}},
            "train": {"step": 4, "steps_per_s": 0.5, "loss": 2.0, "acceptance": 1.5},
            "eval": null, "restarts": 2,
            "workers": {"target-0": {"state": "running", "pid": 7, "restarts": 2}}
        }))
        .unwrap();
        let g = &w.gpu.gpus[0];
        assert_eq!(g.stat("util_gpu_pct", Agg::Max), Some(90.0));
        assert_eq!(g.stat("power_w", Agg::Mean), None);
        assert_eq!(g.xid_errors, [79]);
        assert_eq!(w.mean_gpu_util_pct(), Some(50.0));
        assert_eq!(w.pipeline.hidden_pool.fill_ratio, 0.5);
        assert_eq!(w.pipeline.cuda_memory_by_worker["drafter-0"].total, 5);
        assert_eq!(w.train.map(|t| t.step), Some(4));
        let back: Window = serde_json::from_str(&serde_json::to_string(&w).unwrap()).unwrap();
        assert_eq!(back, w);
        // A line of an older version, or a crash's half line that still parses.
        let old = Window::parse(r#"{"time": "t", "train": {"step": 2}}"#).unwrap();
        assert_eq!((old.train.unwrap().step, old.restarts), (2, 0));
        assert!(old.gpu.gpus.is_empty() && old.pipeline.bottleneck_hint.is_none());
        assert_eq!(Window::parse(r#"{"time": "t", "tr"#), None);
    }
}
