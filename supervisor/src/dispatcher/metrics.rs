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
//! restarts: total over the run
//! workers: {name: {state, pid, restarts, batches_served_share}}
//! ```

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::json;

use super::Dispatcher;
use crate::rundir::now_rfc3339;
use crate::telemetry::GpuWindow;

pub const METRICS_FILE: &str = "metrics.jsonl";

pub struct Metrics {
    pub gpu: GpuWindow,
    file: Option<File>,
    started: Instant,
    last_consumed: u64,
    last_step: u64,
    pub latest: Option<serde_json::Value>,
    status_at: Instant,
}

impl Metrics {
    pub fn new(run_dir: &Path) -> Metrics {
        let file = OpenOptions::new().create(true).append(true).open(run_dir.join(METRICS_FILE));
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

    pub fn due(&self, now: Instant, every: Duration) -> bool {
        now.duration_since(self.started) >= every
    }
}

impl Dispatcher {
    /// On a terminal, redraw the live status line once a second: the latest window's
    /// rates with the training figures of this moment.
    pub(super) fn refresh_status(&mut self) {
        if !crate::console::live() || self.metrics.status_at.elapsed() < Duration::from_secs(1) {
            return;
        }
        self.metrics.status_at = Instant::now();
        let mut w = self.metrics.latest.clone().unwrap_or_else(|| json!({}));
        let t = &self.trainer.progress;
        if t.step > 0 {
            w["train"] = json!({"step": t.step, "loss": t.loss, "acceptance": t.acceptance});
        }
        w["restarts"] = self.workers.iter().map(|w| w.restarts as u64).sum::<u64>().into();
        crate::console::status(Some(status_line(&w)));
    }

    /// Close the current window: write it and start the next.
    pub(super) fn write_metrics(&mut self) {
        let secs = self.metrics.started.elapsed().as_secs_f64().max(1e-9);
        let names = |pid: u32| self.workers.iter().find(|w| w.life.as_ref().is_some_and(|l| l.pid == pid)).map(|w| w.name.to_string());
        let gpu = self.metrics.gpu.take(&names);
        let (consumed, produced) = self.pipeline.progress();
        let t = &self.trainer.progress;
        let train = (t.step > 0).then(|| {
            json!({"step": t.step, "steps_per_s": (t.step.saturating_sub(self.metrics.last_step)) as f64 / secs,
                   "loss": t.loss, "acceptance": t.acceptance})
        });
        let workers: serde_json::Map<String, serde_json::Value> = self
            .workers
            .iter()
            .map(|w| (w.name.to_string(), json!({"state": w.state.as_str(), "pid": w.life.as_ref().map(|l| l.pid), "restarts": w.restarts})))
            .collect();
        let pipeline = self.pipeline.health.take(secs);
        if let Some(hint) = pipeline["bottleneck_hint"].as_str() {
            log::info!("bottleneck: {hint}");
        }
        let record = json!({
            "time": now_rfc3339(),
            "window_s": secs,
            "gpu": gpu,
            "pipeline": pipeline,
            "batches": {"produced": produced, "consumed": consumed,
                        "consumed_per_s": consumed.saturating_sub(self.metrics.last_consumed) as f64 / secs},
            "train": train,
            "restarts": self.workers.iter().map(|w| w.restarts as u64).sum::<u64>(),
            "workers": workers,
        });
        if let Some(f) = self.metrics.file.as_mut() {
            let _ = writeln!(f, "{record}");
        }
        if let Some(p) = &self.cfg.prometheus {
            p.update(&record);
        }
        crate::console::status(Some(status_line(&record)));
        if !crate::console::live() {
            // Not a terminal: one plain line per window instead of the live status line.
            log::info!("{}", status_line(&record));
        }
        self.metrics.last_consumed = consumed;
        self.metrics.last_step = t.step;
        self.metrics.started = Instant::now();
        self.metrics.latest = Some(record);
        self.dirty = true;
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
        .map(|m| m.iter().filter(|(k, _)| k.starts_with("drafter")).filter_map(|(_, v)| v.as_f64()).sum())
        .unwrap_or(0.0);
    parts.push(format!("{tps:.0} tok/s"));
    let utils: Vec<f64> = w["gpu"]["gpus"].as_array().into_iter().flatten().filter_map(|g| g["util_gpu_pct"]["mean"].as_f64()).collect();
    if !utils.is_empty() {
        parts.push(format!("GPU {:.0}%", utils.iter().sum::<f64>() / utils.len() as f64));
    }
    if let Some(f) = w["pipeline"]["hidden_pool"]["fill_ratio"].as_f64() {
        parts.push(format!("hidden pool {:.0}% full", f * 100.0));
    }
    parts.push(format!("restarts {}", w["restarts"]));
    parts.join(" | ")
}
