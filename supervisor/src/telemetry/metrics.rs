//! `metrics.jsonl`: one JSON object per `--metrics-interval` window. Schema (stable; new
//! keys may be added):
//!
//! ```text
//! time, window_s
//! gpu: {samples, gpus: [{index, util_gpu_pct, util_mem_pct, mem_used_bytes,
//!       mem_total_bytes, power_w, power_limit_w, energy_j, temp_c, sm_clock_mhz,
//!       mem_clock_mhz, pcie_tx_bytes_per_s, pcie_rx_bytes_per_s, ecc_corrected_volatile,
//!       ecc_uncorrected_volatile: {mean, max, samples} | null, throttle_reasons: [name],
//!       xid_errors: [code],
//!       process_mem_bytes: {worker: bytes}}]}
//! pipeline: {tokens_pool, hidden_pool: {fill_ratio, producers_blocked_share,
//!       consumers_starved_share}, batches_per_worker, balance_max_over_min: {role: x},
//!       tokens_per_s_by_worker, length_buckets, length_entropy_bits, padding_efficiency,
//!       bottleneck_hint, phase_ms_by_worker: {worker: {phase: ms}}}
//! batches: {produced, consumed, consumed_per_s}
//! train: {step, steps_per_s, loss, acceptance} | null
//! eval: {step, loss, acceptance, best_step} | null (the last held-out eval, --eval-data)
//! restarts: total over the run
//! workers: {name: {state, pid, restarts, batches_served_share}}
//! ```

use std::fs::{File, OpenOptions};
use std::path::Path;
use std::time::{Duration, Instant};

use super::nvml::GpuWindow;

pub const METRICS_FILE: &str = "metrics.jsonl";

pub struct Metrics {
    pub gpu: GpuWindow,
    pub file: Option<File>,
    pub started: Instant,
    pub last_consumed: u64,
    pub last_step: u64,
    pub latest: Option<serde_json::Value>,
    pub status_at: Instant,
}

impl Metrics {
    pub fn new(run_dir: &Path) -> Metrics {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(run_dir.join(METRICS_FILE));
        if let Err(e) = &file {
            log::warn!("cannot write {METRICS_FILE}: {e}; metrics go only to state.json");
        }
        Metrics {
            gpu: GpuWindow::default(),
            file: file.ok(),
            started: Instant::now(),
            last_consumed: 0,
            last_step: 0,
            latest: None,
            status_at: Instant::now(),
        }
    }

    /// Start the first window at `now`.
    pub fn restart(&mut self, now: Instant) {
        self.started = now;
        self.status_at = now;
    }

    pub fn due(&self, now: Instant, every: Duration) -> bool {
        now.duration_since(self.started) >= every
    }
}

/// One line: what a person glances at while the run goes.
pub fn status_line(w: &serde_json::Value) -> String {
    let mut parts = Vec::new();
    if let Some(t) = w["train"].as_object() {
        parts.push(format!("step {}", t["step"]));
        if let Some(l) = t["loss"].as_f64() {
            parts.push(format!("loss {l:.3}"));
        }
        if let Some(a) = t["acceptance"].as_f64() {
            parts.push(format!("accept {a:.2}"));
        }
    }
    let tps: f64 = w["pipeline"]["tokens_per_s_by_worker"]
        .as_object()
        .map(|m| {
            m.iter()
                .filter(|(k, _)| k.starts_with("drafter"))
                .filter_map(|(_, v)| v.as_f64())
                .sum()
        })
        .unwrap_or(0.0);
    parts.push(format!("{tps:.0} tok/s"));
    let utils: Vec<f64> = w["gpu"]["gpus"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|g| g["util_gpu_pct"]["mean"].as_f64())
        .collect();
    if !utils.is_empty() {
        parts.push(format!(
            "GPU {:.0}%",
            utils.iter().sum::<f64>() / utils.len() as f64
        ));
    }
    if let Some(f) = w["pipeline"]["hidden_pool"]["fill_ratio"].as_f64() {
        parts.push(format!("hidden pool {:.0}% full", f * 100.0));
    }
    parts.push(format!("restarts {}", w["restarts"]));
    parts.join(" | ")
}
