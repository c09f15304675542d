//! How long the learning-rate schedule is, decided before the run starts.
//!
//! The schedule is linear warmup over `--warmup-ratio` of its steps, then cosine to 0 at
//! its last step ([`dflash_shared::drafter::lr_at`]). Its length comes from `--steps`
//! when given; otherwise from the data: `--epochs` × the steps of one epoch, estimated by
//! the preflight (or counted, for the demo data) and refined to the exact count once the
//! loader has cut the first epoch ([`Schedule::refine`]). Only standard input, read once
//! and never ahead, has no known length: then the rate stays at its peak, and the start
//! says so. `--steps` beyond what the given `--epochs` yield (by more than the estimate's
//! margin, when the preflight read every line) is refused; with `--epochs` not given, the
//! data is cycled up to `--steps`.

use crate::error::Error;

/// Loader epochs that stand for "cycle the data until --steps".
pub const CYCLE: u32 = u32::MAX;

/// An estimate of the steps of one epoch, before the run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EpochLength {
    pub steps: u64,
    /// Every line was read (the estimate is then off only by how the shuffle windows cut
    /// batches, a few percent); otherwise it was extrapolated from the first lines.
    pub complete: bool,
    /// Counted by cutting the epoch as the loader does (the demo data): exact.
    pub counted: bool,
}

/// Where the schedule's length comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum Basis {
    /// `--steps`; `cycled` when the data is read as often as it takes.
    Steps { cycled: bool },
    /// `epochs` × the steps of one epoch (estimated, then counted once an epoch is read).
    Data {
        epochs: u32,
        per_epoch: u64,
        counted: bool,
    },
    /// Standard input: no length is known.
    Unknown,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    pub lr: f64,
    pub warmup_ratio: f64,
    pub warmup_steps: u64,
    /// The step at which the cosine reaches 0 (`None`: constant after warmup).
    pub total_steps: Option<u64>,
    /// How many passes the loader makes ([`CYCLE`]: until the run stops).
    pub loader_epochs: u32,
    pub basis: Basis,
    /// Drafter ranks: one step takes one batch per rank.
    pub drafters: u32,
}

/// Margin over the preflight's estimate before `--steps` is refused: the estimate packs
/// the whole data at once, the loader one shuffle window at a time.
const ESTIMATE_MARGIN: f64 = 1.25;

impl Schedule {
    /// The schedule of a run, from its flags and the length of one epoch (`None` for
    /// standard input).
    pub fn plan(
        lr: f64,
        warmup_ratio: f64,
        steps: Option<u64>,
        epochs: Option<u32>,
        epoch: Option<EpochLength>,
        drafters: u32,
    ) -> Result<Schedule, Error> {
        let warmup = |total: u64| (total as f64 * warmup_ratio).ceil() as u64;
        let (total, loader_epochs, basis) = match (steps, epoch) {
            (Some(n), Some(e)) => {
                let per_epoch = e.steps.max(1);
                match epochs {
                    Some(k) => {
                        let gives = per_epoch.saturating_mul(k as u64);
                        if n as f64 > gives as f64 * ESTIMATE_MARGIN && e.complete {
                            return Err(Error::Flag(format!(
                                "--steps {n}: --epochs {k} over this data gives about {gives} steps \
                                 ({k} × ~{per_epoch} per epoch, from the preflight) (expected at most that; \
                                 drop --epochs to cycle the data up to --steps, or give fewer --steps)"
                            )));
                        }
                        if n > gives {
                            log::warn!(
                                "--steps {n} with --epochs {k}: the preflight estimates ~{gives} steps from the first lines; \
                                 if the data runs out first, the run ends before the schedule does"
                            );
                        }
                        (Some(n), k, Basis::Steps { cycled: false })
                    }
                    // Cycled even when one pass looks enough: the estimate may be a
                    // little long, and the run stops at --steps anyway.
                    None => (
                        Some(n),
                        CYCLE,
                        Basis::Steps {
                            cycled: n > per_epoch,
                        },
                    ),
                }
            }
            // Standard input: read once, so one pass.
            (Some(n), None) => (Some(n), 1, Basis::Steps { cycled: false }),
            (None, Some(e)) => {
                let k = epochs.unwrap_or(1);
                let per_epoch = e.steps.max(1);
                (
                    Some(per_epoch.saturating_mul(k as u64)),
                    k,
                    Basis::Data {
                        epochs: k,
                        per_epoch,
                        counted: e.counted,
                    },
                )
            }
            (None, None) => (None, epochs.unwrap_or(1), Basis::Unknown),
        };
        Ok(Schedule {
            lr,
            warmup_ratio,
            warmup_steps: total.map_or(0, warmup),
            total_steps: total,
            loader_epochs,
            basis,
            drafters: drafters.max(1),
        })
    }

    /// The first epoch was cut into `batches` batches: a schedule taken from the data's
    /// estimated length takes the exact one. Returns what changed, in words.
    pub fn refine(&mut self, batches: u64) -> Option<String> {
        let Basis::Data {
            epochs,
            per_epoch,
            counted: false,
        } = self.basis
        else {
            return None;
        };
        let exact = batches.div_ceil(self.drafters as u64).max(1);
        self.basis = Basis::Data {
            epochs,
            per_epoch: exact,
            counted: true,
        };
        if exact == per_epoch {
            return None;
        }
        let before = self.total_steps;
        let total = exact.saturating_mul(epochs as u64);
        self.total_steps = Some(total);
        self.warmup_steps = (total as f64 * self.warmup_ratio).ceil() as u64;
        Some(format!(
            "schedule refined: the first epoch is {batches} batches, {exact} steps (the preflight estimated {per_epoch}); \
             cosine to 0 at step {total} (was {}), warmup {} steps",
            before.map_or("-".into(), |b| b.to_string()),
            self.warmup_steps
        ))
    }

    /// A resumed run keeps the schedule its checkpoint was trained under (`saved`: the
    /// checkpoint's `settings.schedule`): the same warmup and length, not a new estimate
    /// (nor a constant rate turned into a cosine when stdin's copy became a file). Returns
    /// whether it was restored.
    pub fn restore(&mut self, saved: &serde_json::Value) -> bool {
        let (Some(warmup), Some(total)) = (
            saved["warmup_steps"].as_u64(),
            saved.get("total_steps").map(|t| t.as_u64()),
        ) else {
            return false;
        };
        self.warmup_steps = warmup;
        self.total_steps = total;
        self.basis = match (
            &self.basis,
            saved["steps_per_epoch"].as_u64(),
            saved["epochs"].as_u64(),
        ) {
            (Basis::Data { .. }, Some(per_epoch), Some(epochs)) => Basis::Data {
                epochs: epochs as u32,
                per_epoch,
                counted: true,
            },
            (_, _, _) if total.is_none() => Basis::Unknown,
            (b, _, _) => b.clone(),
        };
        true
    }

    /// The schedule in one line, as the start prints it.
    pub fn describe(&self) -> String {
        let shape = match self.total_steps {
            Some(t) => format!(
                "peak lr {:.2e}, linear warmup over {} steps, then cosine to 0 at step {t}",
                self.lr, self.warmup_steps
            ),
            None => format!("constant lr {:.2e} (no warmup, no decay)", self.lr),
        };
        let why = match &self.basis {
            Basis::Steps { cycled: false } => "from --steps".to_string(),
            Basis::Steps { cycled: true } => {
                "from --steps, which is more than one pass over the data: the data is cycled until then (give --epochs to bound it)".to_string()
            }
            Basis::Data {
                epochs,
                per_epoch,
                counted,
            } => format!(
                "{epochs} epoch(s) × {}{per_epoch} steps{}",
                if *counted { "" } else { "~" },
                if *counted {
                    ""
                } else {
                    " (the preflight's estimate; refined when the first epoch has been read)"
                }
            ),
            Basis::Unknown => {
                "the length of standard input is not known: give --steps for warmup and cosine decay".to_string()
            }
        };
        format!("schedule: {shape}; {why}")
    }

    /// The schedule as recorded (run.json, events).
    pub fn to_json(&self) -> serde_json::Value {
        let (basis, epochs, per_epoch) = match &self.basis {
            Basis::Steps { cycled } => (
                if *cycled {
                    "steps, data cycled"
                } else {
                    "steps"
                },
                None,
                None,
            ),
            Basis::Data {
                epochs,
                per_epoch,
                counted,
            } => (
                if *counted {
                    "epochs x counted steps per epoch"
                } else {
                    "epochs x estimated steps per epoch"
                },
                Some(*epochs),
                Some(*per_epoch),
            ),
            Basis::Unknown => ("unknown length: constant", None, None),
        };
        serde_json::json!({
            "lr": self.lr,
            "warmup_ratio": self.warmup_ratio,
            "warmup_steps": self.warmup_steps,
            "total_steps": self.total_steps,
            "basis": basis,
            "epochs": epochs,
            "steps_per_epoch": per_epoch,
            "data_cycled": self.loader_epochs == CYCLE,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflash_shared::drafter::lr_at;

    fn est(steps: u64, complete: bool) -> Option<EpochLength> {
        Some(EpochLength {
            steps,
            complete,
            counted: false,
        })
    }

    #[test]
    fn without_steps_the_schedule_spans_the_epochs_and_decays_to_zero() {
        let s = Schedule::plan(1e-3, 0.04, None, Some(5), est(20, true), 1).unwrap();
        assert_eq!(s.total_steps, Some(100));
        assert_eq!(s.warmup_steps, 4);
        assert_eq!(s.loader_epochs, 5);
        // Warmup rises, the last step is near 0: not a constant rate.
        assert!(lr_at(0, s.lr, s.warmup_steps, s.total_steps) < 1e-3 * 0.5);
        assert!(lr_at(99, s.lr, s.warmup_steps, s.total_steps) < 1e-5);
        assert!(
            s.describe().contains("5 epoch(s) × ~20 steps"),
            "{}",
            s.describe()
        );
    }

    #[test]
    fn refined_to_the_counted_first_epoch() {
        let mut s = Schedule::plan(1e-3, 0.1, None, Some(2), est(10, false), 2).unwrap();
        assert_eq!(s.total_steps, Some(20));
        // 25 batches over 2 ranks: 13 steps an epoch.
        let msg = s.refine(25).expect("changed");
        assert_eq!(s.total_steps, Some(26));
        assert_eq!(s.warmup_steps, 3);
        assert!(msg.contains("13 steps"), "{msg}");
        // Once only.
        assert_eq!(s.refine(99), None);
        assert_eq!(s.total_steps, Some(26));
    }

    #[test]
    fn steps_beyond_the_given_epochs_are_refused_and_cycle_without_them() {
        let e = Schedule::plan(1e-3, 0.04, Some(100), Some(1), est(3, true), 1).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        let m = e.to_string();
        assert!(
            m.contains("--steps 100") && m.contains("about 3 steps"),
            "{m}"
        );
        let s = Schedule::plan(1e-3, 0.04, Some(100), None, est(3, true), 1).unwrap();
        assert_eq!(s.loader_epochs, CYCLE);
        assert_eq!(s.total_steps, Some(100));
        assert!(s.describe().contains("cycled"), "{}", s.describe());
        // Within one pass by the estimate: still cycled (an estimate a little long must
        // not end the run before --steps), and not said to be.
        let s = Schedule::plan(1e-3, 0.04, Some(3), None, est(3, true), 1).unwrap();
        assert_eq!(s.loader_epochs, CYCLE);
        assert!(!s.describe().contains("cycled"), "{}", s.describe());
        // An extrapolated estimate is not grounds to refuse.
        assert!(Schedule::plan(1e-3, 0.04, Some(100), Some(1), est(3, false), 1).is_ok());
        // A --steps within the margin of a complete estimate is kept.
        assert!(Schedule::plan(1e-3, 0.04, Some(12), Some(4), est(3, true), 1).is_ok());
    }

    #[test]
    fn a_resume_keeps_the_schedule_of_its_checkpoint() {
        let mut first = Schedule::plan(1e-3, 0.1, None, Some(2), est(10, false), 1).unwrap();
        first.refine(13);
        let saved = first.to_json();
        // The resume estimates again (10 steps an epoch) but keeps the counted 13.
        let mut again = Schedule::plan(1e-3, 0.1, None, Some(2), est(10, false), 1).unwrap();
        assert!(again.restore(&saved));
        assert_eq!((again.total_steps, again.warmup_steps), (Some(26), 3));
        assert_eq!(again.refine(99), None, "already counted");
        // A constant rate (stdin) stays constant, though the resume reads a file now.
        let constant = Schedule::plan(1e-3, 0.1, None, None, None, 1)
            .unwrap()
            .to_json();
        let mut file = Schedule::plan(1e-3, 0.1, None, None, est(10, true), 1).unwrap();
        assert!(file.restore(&constant));
        assert_eq!((file.total_steps, file.warmup_steps), (None, 0));
    }

    #[test]
    fn standard_input_says_its_rate_is_constant() {
        let s = Schedule::plan(1e-3, 0.04, None, None, None, 1).unwrap();
        assert_eq!(s.total_steps, None);
        assert!(s.describe().contains("constant"), "{}", s.describe());
        assert!(s.describe().contains("--steps"), "{}", s.describe());
    }
}
