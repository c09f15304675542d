//! Slowness apart from liveness. A worker's heartbeats come from a thread that never
//! waits for compute, and say which unit of work its compute loop is in (a drafter's
//! training step, a target's batch, a checkpoint write) and for how long. Silence is a
//! hang (`--hang-timeout`); a unit of work is held to `--step-timeout` instead, which by
//! default follows the worker's measured steps ([`default_step_timeout`]). A unit over it
//! is a hang too, killed and restarted like one, with a message that says how long the
//! steps took and what to change; one that is merely slow is said once on the console.

use std::time::{Duration, Instant};

use dflash_shared::protocol::{Busy, Work};
use dflash_shared::Role;
use serde_json::json;

use super::{obj, Dispatcher};
use crate::run::worker_log::Tag;

/// The least default `--step-timeout`: generous, so that no real step is cut short before
/// anything was measured.
pub const STEP_TIMEOUT_FLOOR: Duration = Duration::from_secs(600);
/// The default `--step-timeout` is this many times the slowest of the first measured steps.
pub const STEP_TIMEOUT_FACTOR: u32 = 5;
/// How many of a worker's first steps the default is taken from (the first steps are the
/// slow ones, if any are: warm-up, first allocations).
pub const FIRST_STEPS: usize = 3;
/// The least time a drafter's write of its state (a checkpoint, a snapshot) gets before it
/// is taken for a hang, whatever `--step-timeout` says: it follows the disk, not the steps.
pub const SAVE_TIMEOUT_FLOOR: Duration = Duration::from_secs(600);
/// A unit of work is said to be slow once it has taken this many times the slowest
/// first step (and at least `--hang-timeout`, where it used to be killed).
const SLOW_FACTOR: u32 = 3;

/// What a hung target on the torch engine adds to its reason: its Python child (which
/// runs the batch) is where it is stuck, and that child's last lines from the worker's
/// log (`log`: its last lines; the child's carry the worker's `[torch]` prefix).
fn torch_child_tail(log: &[String]) -> String {
    // This child's lines only: those after the worker's last start (an earlier child's
    // last words are not this one's).
    let since = log
        .iter()
        .rposition(|l| l.contains("target loaded by the torch engine"))
        .unwrap_or(0);
    let lines: Vec<&str> = log[since..]
        .iter()
        .filter_map(|l| l.split_once("[torch] ").map(|(_, t)| t.trim()))
        .filter(|t| !t.is_empty())
        .collect();
    let last = &lines[lines.len().saturating_sub(3)..];
    if last.is_empty() {
        "; the target runs on the torch engine: its Python child (transformers) was running the batch and printed nothing".into()
    } else {
        format!(
            "; the target runs on the torch engine: its Python child (transformers) was running the batch; its last lines: {}",
            last.join(" | ")
        )
    }
}

/// The default `--step-timeout` of a worker whose slowest first step took `slowest`
/// (`None`: none measured yet): the larger of [`STEP_TIMEOUT_FLOOR`] and
/// [`STEP_TIMEOUT_FACTOR`] × `slowest`.
pub fn default_step_timeout(slowest: Option<Duration>) -> Duration {
    slowest.map_or(STEP_TIMEOUT_FLOOR, |s| {
        STEP_TIMEOUT_FLOOR.max(s.saturating_mul(STEP_TIMEOUT_FACTOR))
    })
}

/// When a unit of work is worth a line on the console: past `--hang-timeout` and past
/// [`SLOW_FACTOR`] × the slowest first step.
pub fn slow_after(hang_timeout: Duration, slowest: Option<Duration>) -> Duration {
    hang_timeout.max(slowest.map_or(Duration::ZERO, |s| s.saturating_mul(SLOW_FACTOR)))
}

/// What one worker's steps took (across its lives: the work does not change with a
/// restart).
#[derive(Debug, Default)]
pub(super) struct StepTimes {
    /// The first [`FIRST_STEPS`] measured.
    first: Vec<Duration>,
    last: Option<Duration>,
    count: u64,
}

impl StepTimes {
    pub fn add(&mut self, took: Duration) {
        if self.first.len() < FIRST_STEPS {
            self.first.push(took);
        }
        self.last = Some(took);
        self.count += 1;
    }

    pub fn slowest_first(&self) -> Option<Duration> {
        self.first.iter().max().copied()
    }

    /// In words: "no step has finished yet", "the first steps took 41s, 39s, 40s (last
    /// of 12: 40s)".
    pub fn describe(&self, unit: &str) -> String {
        let shown = |d: &Duration| secs(*d);
        match (self.first.is_empty(), self.last) {
            (true, _) | (_, None) => format!("no {unit} has finished yet"),
            (false, Some(last)) => {
                let first: Vec<String> = self.first.iter().map(shown).collect();
                let mut s = format!(
                    "the first {} took {}",
                    if first.len() > 1 {
                        plural(unit)
                    } else {
                        unit.to_string()
                    },
                    first.join(", ")
                );
                if self.count > self.first.len() as u64 {
                    s.push_str(&format!(" (the last of {}: {})", self.count, shown(&last)));
                }
                s
            }
        }
    }

    fn first_s(&self) -> Vec<f64> {
        self.first.iter().map(Duration::as_secs_f64).collect()
    }
}

/// The unit of work a life's compute loop is in, as its heartbeats say.
#[derive(Debug, Clone)]
pub(super) struct InWork {
    pub work: Work,
    /// When it began (the worker's measure, on the supervisor's clock).
    pub since: Instant,
    /// Where `--step-timeout` counts from: `since`, or later after the supervisor itself
    /// did not run (see `resume_after_pause`).
    pub timer: Instant,
    /// Its slowness was said on the console.
    pub told: bool,
}

impl InWork {
    /// What a heartbeat says (`busy`) at `now`, given what the previous one said: the same
    /// unit keeps its clocks.
    pub fn update(old: Option<InWork>, busy: Option<Busy>, now: Instant) -> Option<InWork> {
        let b = busy?;
        match old {
            Some(o) if o.work == b.work => Some(o),
            _ => {
                let since = now
                    .checked_sub(Duration::from_millis(b.for_ms))
                    .unwrap_or(now);
                Some(InWork {
                    work: b.work,
                    since,
                    timer: since,
                    told: false,
                })
            }
        }
    }
}

/// A duration as people read it, to the second (to the millisecond under 1 s).
fn secs(d: Duration) -> String {
    let d = if d < Duration::from_secs(1) {
        Duration::from_millis(d.as_millis() as u64)
    } else {
        Duration::from_secs(d.as_secs())
    };
    humantime::format_duration(d).to_string()
}

/// `unit` of work in the plural ("steps", "batches").
fn plural(unit: &str) -> String {
    if unit.ends_with("ch") || unit.ends_with('s') {
        format!("{unit}es")
    } else {
        format!("{unit}s")
    }
}

/// The unit a role's work is counted in, for messages.
fn unit(role: Role) -> &'static str {
    match role {
        Role::Drafter => "step",
        Role::Target => "batch",
    }
}

impl Dispatcher {
    /// A unit of `worker`'s work ended, taking `ms` (its own measure).
    pub(super) fn step_took(&mut self, worker: usize, ms: f64) {
        if ms.is_finite() && ms >= 0.0 {
            self.workers[worker]
                .steps
                .add(Duration::from_secs_f64(ms / 1e3));
        }
        self.joined(worker);
    }

    /// The `--step-timeout` that holds for `worker` now.
    fn step_timeout(&self, worker: usize) -> Duration {
        self.cfg
            .step_timeout
            .unwrap_or_else(|| default_step_timeout(self.workers[worker].steps.slowest_first()))
    }

    /// `worker`'s unit of work against `--step-timeout` at `now`: killed as hung past it,
    /// said once on the console when it is slow. Returns whether it was killed.
    pub(super) fn watch_step(&mut self, worker: usize, now: Instant) -> bool {
        let saving = self.workers[worker]
            .status
            .life()
            .and_then(|l| l.in_work.as_ref())
            .is_some_and(|b| matches!(b.work, Work::Save { .. }));
        let step_limit = self.step_timeout(worker);
        // A write's time follows the disk, not the steps: it gets at least the floor.
        let limit = if saving {
            step_limit.max(SAVE_TIMEOUT_FLOOR)
        } else {
            step_limit
        };
        let limit_words = match (saving && limit > step_limit, self.cfg.step_timeout) {
            (true, _) => format!("the {} a write of the state gets at least", secs(limit)),
            (false, Some(_)) => format!("--step-timeout {}", secs(limit)),
            (false, None) => format!("--step-timeout {} by default", secs(limit)),
        };
        let disk = self.trainer.checkpoints_dir().display().to_string();
        let hang = self.cfg.hang_timeout;
        let w = &mut self.workers[worker];
        let (name, slowest) = (w.name, w.steps.slowest_first());
        let Some(l) = w.status.life_mut().filter(|l| l.watched()) else {
            return false;
        };
        let pid = l.pid;
        let Some(b) = l.in_work.as_mut() else {
            return false;
        };
        let counted = now.saturating_duration_since(b.timer);
        let taken = now.saturating_duration_since(b.since);
        let work = b.work;
        let killed = counted > limit;
        if !killed {
            if b.told || counted <= slow_after(hang, slowest) {
                return false;
            }
            b.told = true;
        }
        let what = unit(name.role);
        let w = &mut self.workers[worker];
        let took = w.steps.describe(what);
        if killed {
            let smaller = match name.role {
                Role::Drafter => "--token-budget or --max-anchors",
                Role::Target => "--token-budget or --max-seq-len",
            };
            let advice = if saving {
                format!("the filesystem of {disk} is slow or stuck (see dmesg, df -h): check it; if it is merely slow, raise --step-timeout")
            } else {
                format!(
                    "if it is merely slow, raise --step-timeout, or make {} smaller ({smaller})",
                    plural(what)
                )
            };
            let mut reason = format!(
                "hung: in {work} for {}, over {limit_words} ({took}); {advice}",
                secs(taken),
            );
            if name.role == Role::Target && self.cfg.target_engine == "torch" {
                reason.push_str(&torch_child_tail(&w.log.tail(400)));
            }
            log::warn!("{name} (pid {pid}) {reason}; killing it");
            w.log.line(Tag::Supervisor, &format!("{reason}; killing"));
            let event = obj(json!({
                "worker": name.to_string(), "pid": pid, "work": work.to_string(),
                "busy_s": taken.as_secs_f64(), "step_timeout_s": limit.as_secs_f64(),
                "first_steps_s": w.steps.first_s(), "reason": reason,
            }));
            self.run.event("hang", event);
            self.kill(worker, &reason);
            return true;
        }
        let line = if saving {
            format!(
                "{name}: {work} has taken {} so far (the filesystem of {disk} is slow?); not a hang ({limit_words})",
                secs(taken)
            )
        } else {
            let cost = match name.role {
                Role::Drafter => "--token-budget, --max-anchors and --block-size",
                Role::Target => "--token-budget and --max-seq-len",
            };
            format!(
                "{name}: {work} has taken {} so far ({took}); not a hang ({limit_words}); a {what}'s cost is set by {cost}",
                secs(taken)
            )
        };
        log::info!("{line}");
        w.log.line(Tag::Supervisor, &line);
        let event = obj(json!({
            "worker": name.to_string(), "pid": pid, "work": work.to_string(),
            "busy_s": taken.as_secs_f64(), "step_timeout_s": limit.as_secs_f64(),
        }));
        self.run.event("slow_step", event);
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: fn(u64) -> Duration = Duration::from_secs;

    #[test]
    fn a_hung_torch_target_names_its_child_and_the_childs_last_lines() {
        let log: Vec<String> = [
            "12:00:01 [stdout] target loaded by the torch engine",
            "12:00:02 [stderr] [torch] Loading weights: 100%",
            "12:00:03 [stderr] [torch] warning one",
            "12:00:04 [stdout] batch 3",
            "12:00:05 [stderr] [torch] warning two",
            "12:00:06 [stderr] [torch] last words",
        ]
        .map(String::from)
        .to_vec();
        let t = super::torch_child_tail(&log);
        assert!(
            t.contains("torch engine: its Python child")
                && t.ends_with("its last lines: warning one | warning two | last words"),
            "{t}"
        );
        assert!(super::torch_child_tail(&log[..1]).ends_with("printed nothing"));
        // An earlier child's lines, before the worker loaded again, are not quoted.
        let mut again = log.clone();
        again.push("12:01:00 [stdout] target loaded by the torch engine".into());
        again.push("12:01:01 [stderr] [torch] the new one".into());
        assert!(
            super::torch_child_tail(&again).ends_with("its last lines: the new one"),
            "{}",
            super::torch_child_tail(&again)
        );
    }

    #[test]
    fn the_default_step_timeout_is_the_floor_until_a_step_is_measured() {
        assert_eq!(default_step_timeout(None), S(600));
    }

    #[test]
    fn the_default_step_timeout_is_five_times_the_slowest_first_step_above_the_floor() {
        assert_eq!(default_step_timeout(Some(S(40))), S(600), "200s: the floor");
        assert_eq!(
            default_step_timeout(Some(S(120))),
            S(600),
            "exactly the floor"
        );
        assert_eq!(default_step_timeout(Some(S(121))), S(605));
        assert_eq!(default_step_timeout(Some(S(95))), S(600));
        assert_eq!(default_step_timeout(Some(S(3600))), S(5 * 3600));
        assert_eq!(default_step_timeout(Some(Duration::MAX)), Duration::MAX);
    }

    #[test]
    fn the_first_three_steps_decide_and_later_ones_do_not() {
        let mut t = StepTimes::default();
        assert_eq!(t.slowest_first(), None);
        assert_eq!(t.describe("step"), "no step has finished yet");
        for s in [200, 50, 40, 900, 1000] {
            t.add(S(s));
        }
        assert_eq!(t.slowest_first(), Some(S(200)));
        assert_eq!(default_step_timeout(t.slowest_first()), S(1000));
        assert_eq!(
            t.describe("step"),
            "the first steps took 3m 20s, 50s, 40s (the last of 5: 16m 40s)"
        );
    }

    #[test]
    fn a_step_is_slow_past_the_hang_timeout_and_three_times_the_slowest_first_step() {
        assert_eq!(slow_after(S(60), None), S(60));
        assert_eq!(slow_after(S(60), Some(S(10))), S(60));
        assert_eq!(slow_after(S(60), Some(S(40))), S(120));
    }

    #[test]
    fn a_heartbeat_about_the_same_unit_keeps_its_clocks_and_a_new_unit_starts_them() {
        let t0 = Instant::now() + S(100);
        let work = Work::Step {
            step: 2,
            batch_id: 5,
        };
        let busy = |work, for_ms| Some(Busy { work, for_ms });
        let a = InWork::update(None, busy(work, 3000), t0).unwrap();
        assert_eq!(a.since, t0 - S(3));
        let mut paused = a.clone();
        paused.timer = t0 + S(50);
        let b = InWork::update(Some(paused), busy(work, 60_000), t0 + S(57)).unwrap();
        assert_eq!(
            (b.since, b.timer),
            (t0 - S(3), t0 + S(50)),
            "the same unit: as it was"
        );
        let next = Work::Step {
            step: 3,
            batch_id: 6,
        };
        let c = InWork::update(Some(b), busy(next, 10), t0 + S(58)).unwrap();
        assert_eq!(
            (c.work, c.timer),
            (next, t0 + S(58) - Duration::from_millis(10))
        );
        assert!(InWork::update(Some(c), None, t0 + S(59)).is_none());
    }
}
