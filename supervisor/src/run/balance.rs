//! `--targets auto`: when to move one device between the target and the drafter role.
//!
//! A pure decision over the run's metrics windows. Each steady window gives each role's
//! tokens/s per worker, corrected for the time its workers waited on the other role (a
//! target blocked on a full hidden-state pool, a drafter starved by an empty one): what a
//! worker of that role does unhindered. The run's throughput with `t` targets and `d`
//! drafters is then `min(t × target rate, d × drafter rate)`, with each rate the mean over
//! the windows since the last move (noise averages out as they accumulate). A move to the
//! neighbouring split is made when that split would be faster by more than a margin, after
//! enough windows of the current split; moves are apart by a dwell, a few per hour at
//! most, and never take the last worker of a role. The margin is what keeps the split
//! from oscillating: a move back would have to be faster by the margin too, which the
//! move just made rules out unless the rates themselves changed.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::telemetry::window::Window;

/// One device changes role.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Move {
    /// A drafter's device runs a target instead.
    ToTarget,
    /// A target's device trains a drafter instead.
    ToDrafter,
}

/// How eagerly the balancer moves.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BalanceConfig {
    /// Steady windows of the current split needed before a move.
    pub sustain: usize,
    /// Least time after the start, and after a move, before the next.
    pub dwell: Duration,
    /// Moves in any hour at most.
    pub per_hour: usize,
    /// How much faster the other split must be (0.1: 10%).
    pub margin: f64,
}

impl BalanceConfig {
    /// The run's balancer for metrics windows of `window`: five windows of a split before
    /// it moves, ten windows (at least a minute) between moves, six moves an hour at most,
    /// a 15% margin.
    pub fn for_window(window: Duration) -> BalanceConfig {
        BalanceConfig {
            sustain: 5,
            dwell: (window * 10).max(Duration::from_secs(60)),
            per_hour: 6,
            margin: 0.15,
        }
    }
}

/// What one window says of the roles.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rates {
    /// Tokens/s one target worker captures, unhindered.
    pub target: f64,
    /// Tokens/s one drafter worker trains on, unhindered.
    pub drafter: f64,
}

/// The share of a window the workers of a role waited on the other is at most this
/// (a window all waiting says little of how fast the role is).
const MAX_WAIT: f64 = 0.95;

impl Rates {
    /// The mean unhindered rate of each role over `windows` (the trained ones), or `None`
    /// when a role has no figure.
    pub fn of(windows: &[Window]) -> Option<Rates> {
        let (mut t, mut d) = (Vec::new(), Vec::new());
        for w in windows.iter().filter(|w| w.train.is_some_and(|t| t.step > 0)) {
            let pool = &w.pipeline.hidden_pool;
            let blocked = pool.producers_blocked_share.clamp(0.0, MAX_WAIT);
            let starved = pool.consumers_starved_share.clamp(0.0, MAX_WAIT);
            for (name, &v) in &w.pipeline.tokens_per_s_by_worker {
                if v <= 0.0 || !v.is_finite() {
                    continue;
                }
                match name.split('-').next() {
                    Some("target") => t.push(v / (1.0 - blocked)),
                    Some("drafter") => d.push(v / (1.0 - starved)),
                    _ => {}
                }
            }
        }
        let mean = |v: &[f64]| (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64);
        Some(Rates {
            target: mean(&t)?,
            drafter: mean(&d)?,
        })
    }

    /// Tokens/s trained with `targets` target and `drafters` drafter workers.
    pub fn throughput(&self, targets: usize, drafters: usize) -> f64 {
        (targets as f64 * self.target).min(drafters as f64 * self.drafter)
    }
}

/// The windows of one split the mean rates are taken over, at most.
const MAX_SAMPLES: usize = 30;

/// The decision's state across windows.
#[derive(Debug)]
pub struct Balancer {
    cfg: BalanceConfig,
    /// The rates of the steady windows since the last move (the newest last).
    samples: VecDeque<Rates>,
    /// No move before this (the start's dwell, then each move's).
    quiet_until: Instant,
    /// When the moves of the last hour were made.
    recent: VecDeque<Instant>,
}

impl Balancer {
    pub fn new(cfg: BalanceConfig, start: Instant) -> Balancer {
        Balancer {
            cfg,
            samples: VecDeque::new(),
            quiet_until: start + cfg.dwell,
            recent: VecDeque::new(),
        }
    }

    /// The better neighbouring split of `targets` and `drafters` under `rates`, when it is
    /// faster by the margin and takes no role's last worker.
    pub fn better(&self, rates: Rates, targets: usize, drafters: usize) -> Option<Move> {
        let now = rates.throughput(targets, drafters);
        let gain = |t: usize, d: usize| rates.throughput(t, d) / now.max(1e-9) - 1.0;
        let to_target = (drafters > 1).then(|| gain(targets + 1, drafters - 1));
        let to_drafter = (targets > 1).then(|| gain(targets - 1, drafters + 1));
        [(Move::ToTarget, to_target), (Move::ToDrafter, to_drafter)]
            .into_iter()
            .filter_map(|(m, g)| Some((m, g?)))
            .filter(|(_, g)| *g > self.cfg.margin)
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(m, _)| m)
    }

    /// The mean rates of the current split's windows.
    pub fn rates(&self) -> Option<Rates> {
        let n = self.samples.len();
        (n > 0).then(|| Rates {
            target: self.samples.iter().map(|r| r.target).sum::<f64>() / n as f64,
            drafter: self.samples.iter().map(|r| r.drafter).sum::<f64>() / n as f64,
        })
    }

    /// One window's `rates` (`None`: a window that says nothing, such as the start's or a
    /// stop's, which is passed over) with `targets` and `drafters` workers running: the
    /// move to make now, if any. The caller makes it and says so with [`Balancer::moved`].
    pub fn observe(
        &mut self,
        rates: Option<Rates>,
        targets: usize,
        drafters: usize,
        now: Instant,
    ) -> Option<Move> {
        if let Some(r) = rates.filter(|r| r.target.is_finite() && r.drafter.is_finite()) {
            self.samples.push_back(r);
            if self.samples.len() > MAX_SAMPLES {
                self.samples.pop_front();
            }
        }
        while self
            .recent
            .front()
            .is_some_and(|t| now.saturating_duration_since(*t) >= Duration::from_secs(3600))
        {
            self.recent.pop_front();
        }
        let ready = self.samples.len() >= self.cfg.sustain
            && now >= self.quiet_until
            && self.recent.len() < self.cfg.per_hour;
        if !ready {
            return None;
        }
        self.better(self.rates()?, targets, drafters)
    }

    /// A move was made at `now`: the windows of the old split no longer count, and the
    /// dwell starts again.
    pub fn moved(&mut self, now: Instant) {
        self.samples.clear();
        self.quiet_until = now + self.cfg.dwell;
        self.recent.push_back(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> BalanceConfig {
        BalanceConfig {
            sustain: 3,
            dwell: Duration::from_secs(10),
            per_hour: 6,
            margin: 0.15,
        }
    }

    /// A pipeline whose workers do `truth` unhindered: what a window of `t` targets and
    /// `d` drafters measures, with `noise` (a factor on each role's figure).
    fn measured(truth: Rates, noise: (f64, f64)) -> Rates {
        Rates {
            target: truth.target * noise.0,
            drafter: truth.drafter * noise.1,
        }
    }

    /// Runs the balancer over `windows` one-second windows from `start`: the split it
    /// ends at and the moves it made.
    fn simulate(truth: Rates, start: (usize, usize), windows: u32) -> ((usize, usize), usize) {
        let t0 = Instant::now();
        let mut b = Balancer::new(cfg(), t0);
        let (mut t, mut d) = start;
        let mut moves = 0;
        for i in 0..windows {
            let now = t0 + Duration::from_secs(i as u64);
            // ±10% noise, alternating between the roles.
            let wobble = if i % 2 == 0 { (1.1, 0.9) } else { (0.9, 1.1) };
            match b.observe(Some(measured(truth, wobble)), t, d, now) {
                Some(Move::ToTarget) => (t, d) = (t + 1, d - 1),
                Some(Move::ToDrafter) => (t, d) = (t - 1, d + 1),
                None => continue,
            }
            b.moved(now);
            moves += 1;
        }
        ((t, d), moves)
    }

    /// The split of `n` devices with the highest throughput.
    fn best(truth: Rates, n: usize) -> (usize, usize) {
        (1..n)
            .map(|t| (t, n - t))
            .max_by(|a, b| truth.throughput(a.0, a.1).total_cmp(&truth.throughput(b.0, b.1)))
            .unwrap()
    }

    #[test]
    fn from_a_bad_split_it_reaches_the_fastest_in_as_many_moves_as_devices_apart_and_stays() {
        // Targets 3x slower than drafters: 8 devices want 6 targets, 2 drafters.
        let slow_targets = Rates {
            target: 100.0,
            drafter: 300.0,
        };
        assert_eq!(best(slow_targets, 8), (6, 2));
        // Two hours of windows: far more than the moves need, so staying is tested too.
        let (end, moves) = simulate(slow_targets, (1, 7), 7200);
        assert_eq!(end, (6, 2));
        assert_eq!(moves, 5, "one move per device, none back");
        // And the other way: drafters the slow role.
        let slow_drafters = Rates {
            target: 400.0,
            drafter: 100.0,
        };
        assert_eq!(best(slow_drafters, 5), (1, 4));
        assert_eq!(simulate(slow_drafters, (4, 1), 7200), ((1, 4), 3));
        // Already at the best: nothing moves.
        assert_eq!(simulate(slow_targets, (6, 2), 7200), ((6, 2), 0));
    }

    #[test]
    fn a_gain_within_the_margin_or_the_noise_moves_nothing() {
        // 3 targets and 3 drafters at 100 each: 300 either way; a move would lose.
        let even = Rates {
            target: 100.0,
            drafter: 100.0,
        };
        assert_eq!(simulate(even, (3, 3), 3600), ((3, 3), 0));
        // 5% apart: (3, 3) does 300; (4, 2) would do min(420, 200): no better.
        let close = Rates {
            target: 105.0,
            drafter: 100.0,
        };
        assert_eq!(simulate(close, (3, 3), 3600).1, 0);
    }

    #[test]
    fn a_move_needs_enough_windows_of_the_split_the_dwell_and_room_in_the_hour() {
        let slow_targets = Rates {
            target: 100.0,
            drafter: 1000.0,
        };
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut b = Balancer::new(cfg(), t0);
        // In the start's dwell: windows that all want a move, no move yet.
        for s in 0..10 {
            assert_eq!(b.observe(Some(slow_targets), 1, 7, at(s)), None, "{s}");
        }
        assert_eq!(
            b.observe(Some(slow_targets), 1, 7, at(10)),
            Some(Move::ToTarget)
        );
        b.moved(at(10));
        // After the dwell, windows that say nothing do not count: three that do are needed.
        assert_eq!(b.observe(None, 2, 6, at(20)), None);
        assert_eq!(b.observe(Some(slow_targets), 2, 6, at(21)), None);
        assert_eq!(b.observe(None, 2, 6, at(22)), None);
        assert_eq!(b.observe(Some(slow_targets), 2, 6, at(23)), None);
        assert_eq!(
            b.observe(Some(slow_targets), 2, 6, at(24)),
            Some(Move::ToTarget)
        );
        // Six moves in an hour, then none until the first is an hour old.
        let mut b = Balancer::new(cfg(), t0);
        for i in 0..6 {
            b.moved(at(i * 11));
        }
        for s in 70..3600 {
            assert_eq!(b.observe(Some(slow_targets), 1, 7, at(s)), None, "{s}");
        }
        assert_eq!(
            b.observe(Some(slow_targets), 1, 7, at(3600)),
            Some(Move::ToTarget)
        );
    }

    #[test]
    fn the_last_worker_of_a_role_never_moves() {
        let b = Balancer::new(cfg(), Instant::now());
        let targets_only = Rates {
            target: 1.0,
            drafter: 1e6,
        };
        assert_eq!(b.better(targets_only, 1, 1), None);
        assert_eq!(b.better(targets_only, 3, 1), None);
        let drafters_only = Rates {
            target: 1e6,
            drafter: 1.0,
        };
        assert_eq!(b.better(drafters_only, 1, 3), None);
        assert_eq!(b.better(drafters_only, 2, 2), Some(Move::ToDrafter));
    }

    #[test]
    fn the_rates_are_each_roles_mean_corrected_for_its_waiting() {
        let window = |v: serde_json::Value| serde_json::from_value::<Window>(v).unwrap();
        let w = window(serde_json::json!({
            "train": {"step": 5},
            "pipeline": {
                "tokens_per_s_by_worker": {"target-0": 50.0, "drafter-0": 40.0, "drafter-1": 60.0},
                "hidden_pool": {"producers_blocked_share": 0.5, "consumers_starved_share": 0.0},
            },
        }));
        let idle = window(
            serde_json::json!({"train": null, "pipeline": {"tokens_per_s_by_worker": {"target-0": 1.0}}}),
        );
        let r = Rates::of(&[idle.clone(), w]).unwrap();
        // The target was blocked half the time: alone it would do 100.
        assert_eq!((r.target, r.drafter), (100.0, 50.0));
        assert_eq!(Rates::of(&[idle]), None);
        assert_eq!(Rates::of(&[]), None);
    }
}
