//! Real acceptance length during training (`--eval-prompts FILE`): which steps are
//! measured, what a measurement is, and which one is the best.
//!
//! At every `--eval-every` step (each also a checkpoint step) and at the run's last step,
//! the dispatcher runs `dflash-worker export` on that step's checkpoint and
//! `dflash-worker eval` on the export, in a child process beside training
//! (`run::dispatcher::tau_job`); what it prints comes back here as a [`TauResult`]. This
//! module holds no process: the [`TauTrack`] says which step is wanted, which one is
//! measured now (its checkpoint is never pruned meanwhile), which ones are done, and the
//! best by pooled τ (what serving engines print), which `checkpoints/best` then names.
//! A rollback past the step being measured drops its result when it comes.

use std::collections::BTreeSet;

use serde_json::{json, Value};

/// One measurement of the drafter at the weights of `step`.
#[derive(Debug, Clone, PartialEq)]
pub struct TauResult {
    pub step: u64,
    pub prompts: u64,
    pub block_size: u64,
    pub max_new_tokens: u64,
    /// Mean over prompts of each prompt's τ, and its 95% bootstrap interval.
    pub mean_of_means: f64,
    pub mean_of_means_ci95: [f64; 2],
    /// All committed tokens ÷ all verify steps, and its interval.
    pub pooled: f64,
    pub pooled_ci95: [f64; 2],
    /// Verify steps that committed 1, 2, … block tokens.
    pub histogram: Vec<u64>,
    /// Prompts on which speculative decoding wrote what greedy decoding wrote.
    pub identical_to_greedy: u64,
    /// Wall time of the export and the decoding.
    pub seconds: f64,
}

/// Why the worker's report could not be read.
#[derive(Debug, thiserror::Error)]
#[error("the eval printed no report it could be read from ({0})")]
pub struct BadReport(String);

impl TauResult {
    /// The JSON `dflash-worker eval --json` printed (its last line), for `step`.
    pub fn parse(step: u64, stdout: &str, seconds: f64) -> Result<TauResult, BadReport> {
        let line = stdout
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .ok_or_else(|| BadReport("nothing on its stdout".into()))?;
        let v: Value = serde_json::from_str(line).map_err(|e| BadReport(e.to_string()))?;
        let t = &v["tau"];
        let num = |x: &Value, what: &str| {
            x.as_f64()
                .filter(|f| f.is_finite())
                .ok_or_else(|| BadReport(format!("no {what}")))
        };
        let ci = |x: &Value, what: &str| -> Result<[f64; 2], BadReport> {
            Ok([num(&x[0], what)?, num(&x[1], what)?])
        };
        let int = |x: &Value, what: &str| x.as_u64().ok_or_else(|| BadReport(format!("no {what}")));
        Ok(TauResult {
            step,
            prompts: int(&v["prompts"], "prompts")?,
            block_size: int(&v["block_size"], "block_size")?,
            max_new_tokens: int(&v["max_new_tokens"], "max_new_tokens")?,
            mean_of_means: num(&t["mean_of_means"], "tau.mean_of_means")?,
            mean_of_means_ci95: ci(&t["mean_of_means_ci95"], "tau.mean_of_means_ci95")?,
            pooled: num(&t["pooled"], "tau.pooled")?,
            pooled_ci95: ci(&t["pooled_ci95"], "tau.pooled_ci95")?,
            histogram: serde_json::from_value(t["histogram"].clone())
                .map_err(|e| BadReport(format!("tau.histogram: {e}")))?,
            identical_to_greedy: int(&v["identical_to_greedy"], "identical_to_greedy")?,
            seconds,
        })
    }

    /// The `tau` object of train.jsonl and of the metrics windows.
    pub fn json(&self) -> Value {
        json!({
            "step": self.step, "prompts": self.prompts, "block_size": self.block_size,
            "max_new_tokens": self.max_new_tokens,
            "mean_of_means": self.mean_of_means, "mean_of_means_ci95": self.mean_of_means_ci95,
            "pooled": self.pooled, "pooled_ci95": self.pooled_ci95,
            "histogram": self.histogram, "identical_to_greedy": self.identical_to_greedy,
            "seconds": self.seconds,
        })
    }
}

/// Where the τ evaluation of a run is.
#[derive(Debug, Default)]
pub struct TauTrack {
    /// Every how many steps (the last step is measured too).
    pub every: u64,
    /// The step measured now.
    pub running: Option<u64>,
    /// Steps measured, or passed over, in this lineage.
    pub done: BTreeSet<u64>,
    /// The best so far: (step, pooled τ).
    pub best: Option<(u64, f64)>,
    pub last: Option<TauResult>,
}

impl TauTrack {
    pub fn new(every: u64) -> TauTrack {
        TauTrack {
            every: every.max(1),
            ..TauTrack::default()
        }
    }

    /// Is `step` measured (a multiple of `every`, or `last`, the run's last step)?
    pub fn is_tau_step(&self, step: u64, last: bool) -> bool {
        step > 0 && (step % self.every == 0 || last)
    }

    /// The complete checkpoint of `step` (a τ step or not) is the newest: measure it?
    pub fn wants(&self, step: u64, last: bool) -> bool {
        self.running.is_none() && self.is_tau_step(step, last) && !self.done.contains(&step)
    }

    /// A result came: `Some(best)` when it is of the step measured (`best`: the best so
    /// far), `None` when that measurement was dropped meanwhile (a rollback).
    pub fn finish(&mut self, r: &TauResult) -> Option<bool> {
        if self.running != Some(r.step) {
            return None;
        }
        self.running = None;
        self.done.insert(r.step);
        let best = self.best.is_none_or(|(_, t)| r.pooled > t);
        if best {
            self.best = Some((r.step, r.pooled));
        }
        self.last = Some(r.clone());
        Some(best)
    }

    /// The measurement of `step` failed: it is not tried again (unless it was dropped
    /// meanwhile: then its step is measured when it commits again).
    pub fn failed(&mut self, step: u64) {
        if self.running == Some(step) {
            self.running = None;
            self.done.insert(step);
        }
    }

    /// The complete checkpoint of `step` is the newest while the measurement of another
    /// step runs: it is passed over (said once), and that step is returned.
    pub fn busy_with(&mut self, step: u64, last: bool) -> Option<u64> {
        let running = self.running.filter(|&r| r != step)?;
        if !self.is_tau_step(step, last) || self.done.contains(&step) {
            return None;
        }
        self.done.insert(step);
        Some(running)
    }

    /// `step` is passed over (the cost share): not measured.
    pub fn pass_over(&mut self, step: u64) {
        self.done.insert(step);
    }

    /// The group went back to step `to`: later steps are measured again when they commit
    /// again, a measurement of one of them is dropped, and a best after `to` forgotten.
    pub fn rolled_back(&mut self, to: u64) {
        self.done.retain(|&s| s <= to);
        if self.running.is_some_and(|s| s > to) {
            self.running = None;
        }
        if self.best.is_some_and(|(s, _)| s > to) {
            self.best = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tau_step_that_comes_while_another_is_measured_is_passed_over_once() {
        let mut t = TauTrack::new(10);
        t.running = Some(10);
        assert_eq!(t.busy_with(20, false), Some(10));
        assert_eq!(t.busy_with(20, false), None, "said once");
        assert_eq!(t.busy_with(25, false), None, "not a τ step");
        assert_eq!(t.busy_with(10, false), None, "the one measured");
        assert!(!t.wants(20, false));
    }

    fn report(pooled: f64) -> String {
        json!({"prompts": 3, "block_size": 8, "max_new_tokens": 16, "identical_to_greedy": 3,
               "tau": {"mean_of_means": pooled + 0.5, "mean_of_means_ci95": [1.0, 4.0],
                       "pooled": pooled, "pooled_ci95": [1.0, 3.0],
                       "histogram": [1, 2, 0, 0, 0, 0, 0, 1]}})
        .to_string()
    }

    #[test]
    fn a_worker_report_is_read_and_written_back_with_its_step() {
        let r = TauResult::parse(40, &format!("loading\n{}\n\n", report(2.0)), 1.5).unwrap();
        assert_eq!((r.step, r.prompts, r.block_size), (40, 3, 8));
        assert_eq!((r.pooled, r.pooled_ci95), (2.0, [1.0, 3.0]));
        assert_eq!(r.histogram, vec![1, 2, 0, 0, 0, 0, 0, 1]);
        let j = r.json();
        assert_eq!(
            (j["step"].as_u64(), j["mean_of_means"].as_f64()),
            (Some(40), Some(2.5))
        );
        let e = TauResult::parse(1, "{\"prompts\": 3}", 0.0).unwrap_err();
        assert!(e.to_string().contains("no block_size"), "{e}");
        assert!(TauResult::parse(1, "", 0.0).is_err());
    }

    #[test]
    fn steps_are_measured_once_and_the_best_is_the_highest_pooled_tau_of_the_lineage() {
        let mut t = TauTrack::new(10);
        assert!(!t.wants(5, false) && t.wants(5, true) && t.wants(10, false));
        assert!(!t.wants(0, true));
        t.running = Some(10);
        assert!(!t.wants(20, false), "one at a time");
        let r = |step, pooled| TauResult::parse(step, &report(pooled), 0.0).unwrap();
        assert_eq!(t.finish(&r(20, 3.0)), None, "not the step measured");
        assert_eq!(t.finish(&r(10, 2.0)), Some(true));
        assert!(!t.wants(10, false), "measured already");
        t.running = Some(20);
        assert_eq!(t.finish(&r(20, 1.5)), Some(false));
        assert_eq!(t.best, Some((10, 2.0)));
        t.running = Some(30);
        assert_eq!(t.finish(&r(30, 4.0)), Some(true));
        t.running = Some(40);
        t.rolled_back(25);
        assert_eq!(t.best, None, "the best of step 30 is gone with its lineage");
        assert_eq!(t.running, None);
        assert!(t.wants(30, false), "measured again when it commits again");
        assert_eq!(
            t.finish(&r(40, 9.0)),
            None,
            "a dropped measurement's result"
        );
        t.failed(30);
        assert!(
            t.wants(30, false),
            "a failure of a dropped measurement counts for nothing"
        );
        t.running = Some(30);
        t.failed(30);
        assert!(!t.wants(30, false) && t.running.is_none());
        t.pass_over(32);
        assert!(!t.wants(32, true));
    }
}
