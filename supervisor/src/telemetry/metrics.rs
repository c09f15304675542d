//! `metrics.jsonl`: one JSON object per `--metrics-interval` window, a
//! [`Window`] serialised. Schema (stable; new keys may be added):
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
//! node: this window's node (a job across nodes)
//! nodes: {node: window} (a job's leader: every other node's latest window)
//! ```

use std::fs::{File, OpenOptions};
use std::path::Path;
use std::time::{Duration, Instant};

use super::nvml::GpuWindow;
use super::window::Window;

pub const METRICS_FILE: &str = "metrics.jsonl";

pub struct Metrics {
    pub gpu: GpuWindow,
    pub file: Option<File>,
    pub started: Instant,
    pub last_consumed: u64,
    pub last_step: u64,
    pub latest: Option<super::window::Window>,
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

/// Tokens per second as the status shows it: `—` before there is a figure (no window yet),
/// never `-0`. The run's one definition of tokens/s: tokens the drafters trained on (the
/// batches' real tokens, not their padding) per second of wall time, over the window the
/// figure covers (a step line's: its metrics window; the live status line's: the open
/// window, from its start to now).
pub fn tokens_per_s(tps: Option<f64>) -> String {
    match tps.filter(|t| t.is_finite()) {
        Some(t) => format!("{:.0} tok/s", t.max(0.0) + 0.0),
        None => "— tok/s".to_string(),
    }
}

/// The figures a person glances at while the run goes (all but the step), most important
/// first: loss, acceptance, tokens/s (`tps` when given, else the window's), GPU use, the
/// hidden-state pool's fill and restarts.
pub fn status_fields(w: &Window, tps: Option<f64>) -> Vec<String> {
    let mut parts = Vec::new();
    if let Some(t) = &w.train {
        if let Some(l) = t.loss {
            parts.push(format!("loss {l:.3}"));
        }
        if let Some(a) = t.acceptance {
            parts.push(format!("accept {a:.2}"));
        }
    }
    // No window yet (an empty one): no figure of its own.
    let window = (!w.time.is_empty()).then_some(w.pipeline.tokens_per_s_trained);
    parts.push(tokens_per_s(tps.or(window)));
    if let Some(u) = w.mean_gpu_util_pct() {
        parts.push(format!("GPU {u:.0}%"));
    }
    if !w.time.is_empty() {
        parts.push(format!(
            "hidden pool {:.0}% full",
            w.pipeline.hidden_pool.fill_ratio * 100.0
        ));
    }
    parts.push(format!("restarts {}", w.restarts));
    parts
}

/// [`status_fields`] as one string, ` | ` between them.
pub fn status_figures(w: &Window, tps: Option<f64>) -> String {
    status_fields(w, tps).join(" | ")
}

/// `step N/M` (`step N` when the schedule does not know its length).
pub fn step_of(step: u64, total: Option<u64>) -> String {
    match total {
        Some(t) => format!("step {step}/{t}"),
        None => format!("step {step}"),
    }
}

/// The one step-line format of a run's plain output (off a terminal): `step N/M | figures`.
pub fn status_line(w: &Window, total: Option<u64>, tps: Option<f64>) -> String {
    let step = w.train.map_or(0, |t| t.step);
    format!("{} | {}", step_of(step, total), status_figures(w, tps))
}

/// The plain step line of the metrics window `w`, when it has news: a step trained in it
/// (past `before`, the step of the window before, or the step a resumed session started
/// from). A window in which no step was trained (a slow step, the idle end) prints none.
pub fn step_line(w: &Window, total: Option<u64>, before: u64) -> Option<String> {
    let step = w.train?.step;
    (step > before).then(|| status_line(w, total, None))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn window(v: serde_json::Value) -> Window {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn tokens_per_s_is_a_dash_before_a_figure_and_never_minus_zero() {
        assert_eq!(tokens_per_s(None), "— tok/s");
        assert_eq!(tokens_per_s(Some(f64::NAN)), "— tok/s");
        assert_eq!(tokens_per_s(Some(-0.0)), "0 tok/s");
        assert_eq!(tokens_per_s(Some(-0.3)), "0 tok/s");
        assert_eq!(tokens_per_s(Some(1234.4)), "1234 tok/s");
    }

    #[test]
    fn the_step_line_names_the_step_out_of_the_total_then_the_figures() {
        let w = window(json!({
            "time": "t",
            "train": {"step": 12, "loss": 3.12345, "acceptance": 1.5},
            "pipeline": {"tokens_per_s_trained": 150.0,
                         "tokens_per_s_by_worker": {"drafter-0": 100.0, "drafter-1": 50.0, "target-0": 999.0},
                         "hidden_pool": {"fill_ratio": 0.25}},
            "restarts": 2,
        }));
        assert_eq!(
            status_line(&w, Some(100), None),
            "step 12/100 | loss 3.123 | accept 1.50 | 150 tok/s | hidden pool 25% full | restarts 2"
        );
        // A live figure replaces the window's; no schedule length, no total.
        assert_eq!(
            status_line(&w, None, Some(7.0)),
            "step 12 | loss 3.123 | accept 1.50 | 7 tok/s | hidden pool 25% full | restarts 2"
        );
        // No window yet: no tokens/s figure to show.
        assert_eq!(
            status_figures(&Window::default(), None),
            "— tok/s | restarts 0"
        );
    }

    #[test]
    fn a_window_prints_a_step_line_only_when_a_step_was_trained_in_it() {
        let w = |step: u64| {
            window(
                json!({"time": "t", "train": {"step": step, "loss": 1.0, "acceptance": 2.0},
                   "pipeline": {"tokens_per_s_trained": 0.0}, "restarts": 0}),
            )
        };
        // A slow step: the windows it spans have nothing new to say.
        assert_eq!(
            step_line(&w(5), Some(10), 4).as_deref(),
            Some(
                "step 5/10 | loss 1.000 | accept 2.00 | 0 tok/s | hidden pool 0% full | restarts 0"
            )
        );
        assert_eq!(step_line(&w(5), Some(10), 5), None);
        // A resumed session's first window, before its first step.
        assert_eq!(step_line(&w(900), Some(1000), 900), None);
        // No training yet.
        assert_eq!(
            step_line(&window(json!({"train": null})), Some(10), 0),
            None
        );
    }
}
