//! `--targets auto`: when to move one device between the target and the drafter role.
//!
//! A pure decision over the run's metrics windows. Each steady window gives each role's
//! tokens/s per worker, corrected for the time each worker waited between its units of
//! work (a target blocked on a full hidden-state pool or starved of token batches, a
//! drafter starved of hidden states): what a worker of that role does unhindered. The
//! throughput with `t` targets and `d` drafters is then predicted as `min(t × target rate,
//! d × drafter rate)`, with each rate the mean over the windows since the last move (noise
//! averages out as they accumulate). A move to the neighbouring split is made when that
//! split would be faster by more than a margin, after enough windows of the current split;
//! moves are apart by a dwell, a few per hour at most, and never take the last worker of a
//! role.
//!
//! Two things keep the split from oscillating. The margin: a move back would have to be
//! faster by the margin too. And memory: the tokens/s trained that each split visited
//! actually reached replaces the prediction for it, so a split that did worse than
//! predicted is not tried again (at most one move back, to the better of the two).

use std::collections::{BTreeMap, VecDeque};
use std::path::Path;
use std::time::{Duration, Instant};

use dflash_shared::drafter::DrafterConfig;
use dflash_shared::model_config::{Arch, TargetConfig};
use dflash_shared::{Role, WorkerName};

use crate::error::Error;

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
    /// it moves, ten windows between moves (the new worker's start and warm-up among
    /// them), six moves an hour at most, a 15% margin.
    pub fn for_window(window: Duration) -> BalanceConfig {
        BalanceConfig {
            sustain: 5,
            dwell: window * 10,
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
    /// when a role has no figure. A worker's rate is divided by the share of its time it
    /// worked: its own phase timings (the mean wait before a unit of work against the
    /// rest); a window without them falls back to the hidden-state pool's shares (its
    /// producers blocked, its consumers starved).
    pub fn of(windows: &[Window]) -> Option<Rates> {
        let (mut t, mut d) = (Vec::new(), Vec::new());
        for w in windows
            .iter()
            .filter(|w| w.train.is_some_and(|t| t.step > 0))
        {
            let pool = &w.pipeline.hidden_pool;
            for (name, &v) in &w.pipeline.tokens_per_s_by_worker {
                if v <= 0.0 || !v.is_finite() {
                    continue;
                }
                let Ok(WorkerName { role, .. }) = name.parse::<WorkerName>() else {
                    continue;
                };
                let pool_wait = match role {
                    Role::Target => pool.producers_blocked_share,
                    Role::Drafter => pool.consumers_starved_share,
                };
                let waited = w
                    .pipeline
                    .phase_ms_by_worker
                    .get(name)
                    .and_then(wait_share)
                    .unwrap_or(pool_wait)
                    .clamp(0.0, MAX_WAIT);
                match role {
                    Role::Target => t.push(v / (1.0 - waited)),
                    Role::Drafter => d.push(v / (1.0 - waited)),
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

/// The share of a unit of work's time a worker spent waiting for it, from its mean phase
/// timings (`None`: no wait measured, or no work).
fn wait_share(phases: &BTreeMap<String, f64>) -> Option<f64> {
    let wait = *phases.get("wait")?;
    let work: f64 = phases
        .iter()
        .filter(|(k, _)| k.as_str() != "wait" && k.as_str() != "eval")
        .map(|(_, v)| v)
        .sum();
    (work > 0.0 && wait >= 0.0).then(|| wait / (wait + work))
}

/// What one metrics window says: the roles' unhindered rates (from a steady window only:
/// one in which training moved), the tokens/s the run trained in it, and its length. The
/// tokens/s a split reaches is taken over every window, steady or not: where steps are
/// slower than windows, the steady ones alone would hold the bursts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    pub rates: Option<Rates>,
    pub trained: f64,
    pub seconds: f64,
}

impl Sample {
    /// The sample of the metrics window `w` (`steady`: its rates count).
    pub fn of(w: &Window, steady: bool) -> Sample {
        Sample {
            rates: steady.then(|| Rates::of(std::slice::from_ref(w))).flatten(),
            trained: w.pipeline.tokens_per_s_trained,
            seconds: w.window_s,
        }
    }
}

/// The decision's state across windows.
#[derive(Debug)]
pub struct Balancer {
    cfg: BalanceConfig,
    /// The rates of the steady windows since the last move (the newest last).
    samples: VecDeque<Rates>,
    /// Tokens trained and seconds at the current split, from its first steady window on
    /// (what came before was its start).
    split_tokens: f64,
    split_seconds: f64,
    /// The tokens/s trained each split visited reached (the mean of its windows).
    visited: BTreeMap<(usize, usize), f64>,
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
            split_tokens: 0.0,
            split_seconds: 0.0,
            visited: BTreeMap::new(),
            quiet_until: start + cfg.dwell,
            recent: VecDeque::new(),
        }
    }

    /// The better neighbouring split of `targets` and `drafters` under `rates`, when it is
    /// faster by the margin and takes no role's last worker. A split already visited is
    /// judged by what it reached (against what this one reached, `trained`), another by
    /// the rates' prediction.
    pub fn better(
        &self,
        rates: Rates,
        (targets, drafters): (usize, usize),
        trained: Option<f64>,
    ) -> Option<Move> {
        let predicted = rates.throughput(targets, drafters).max(1e-9);
        let gain = |t: usize, d: usize| match (self.visited.get(&(t, d)), trained) {
            (Some(then), Some(now)) if now > 0.0 => then / now - 1.0,
            _ => rates.throughput(t, d) / predicted - 1.0,
        };
        let to_target = (drafters > 1).then(|| gain(targets + 1, drafters - 1));
        let to_drafter = (targets > 1).then(|| gain(targets - 1, drafters + 1));
        [(Move::ToTarget, to_target), (Move::ToDrafter, to_drafter)]
            .into_iter()
            .filter_map(|(m, g)| Some((m, g?)))
            .filter(|(_, g)| *g > self.cfg.margin)
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(m, _)| m)
    }

    /// The mean rates of the current split's steady windows.
    pub fn rates(&self) -> Option<Rates> {
        let n = self.samples.len() as f64;
        (n > 0.0).then(|| Rates {
            target: self.samples.iter().map(|r| r.target).sum::<f64>() / n,
            drafter: self.samples.iter().map(|r| r.drafter).sum::<f64>() / n,
        })
    }

    /// The tokens/s trained at the current split so far.
    pub fn trained(&self) -> Option<f64> {
        (self.split_seconds > 0.0).then(|| self.split_tokens / self.split_seconds)
    }

    /// One window's sample (`None`: a window that says nothing, such as the start's or a
    /// stop's, which is passed over) with `targets` and `drafters` workers running: the
    /// move to make now, if any. The caller makes it and says so with [`Balancer::moved`].
    pub fn observe(
        &mut self,
        sample: Option<Sample>,
        (targets, drafters): (usize, usize),
        now: Instant,
    ) -> Option<Move> {
        let finite = |r: &Rates| r.target.is_finite() && r.drafter.is_finite();
        if let Some(r) = sample.and_then(|s| s.rates).filter(finite) {
            self.samples.push_back(r);
            if self.samples.len() > MAX_SAMPLES {
                self.samples.pop_front();
            }
        }
        let counted = sample.filter(|s| s.trained.is_finite() && s.seconds > 0.0);
        if let (Some(s), false) = (counted, self.samples.is_empty()) {
            self.split_tokens += s.trained * s.seconds;
            self.split_seconds += s.seconds;
        }
        if let Some(t) = self.trained() {
            self.visited.insert((targets, drafters), t);
        }
        while self
            .recent
            .front()
            .is_some_and(|t| now.saturating_duration_since(*t) >= Duration::from_secs(3600))
        {
            self.recent.pop_front();
        }
        if !self.ready(now) {
            return None;
        }
        self.better(self.rates()?, (targets, drafters), self.trained())
    }

    /// Whether a move may be made at `now`: enough windows of the current split, the dwell
    /// over, room in the hour.
    pub fn ready(&self, now: Instant) -> bool {
        self.samples.len() >= self.cfg.sustain
            && now >= self.quiet_until
            && self.recent.len() < self.cfg.per_hour
    }

    /// A move was made at `now`: the windows of the old split no longer count (what it
    /// reached is remembered), and the dwell starts again.
    pub fn moved(&mut self, now: Instant) {
        self.settled(now);
        self.recent.push_back(now);
    }

    /// The worker a move started has done its first unit of work, at `now`: the windows
    /// until then (its start and warm-up) do not count, and the dwell starts from here.
    pub fn settled(&mut self, now: Instant) {
        self.samples.clear();
        (self.split_tokens, self.split_seconds) = (0.0, 0.0);
        self.quiet_until = now + self.cfg.dwell;
    }
}

// ---------------------------------------------------------------------------------------
// The prior: where a run of --targets auto starts, before anything is measured.

/// Each role's FLOPs per token: a target's forward up to its last tap (2 per weight a
/// token meets, and the attention over half the longest row), a drafter's training step
/// per context token (3 × the forward of the context projection and of every block row
/// through its layers; the frozen lm_head's loss twice: logits and their gradient).
/// `target_dir`: `--target` (a transformers target's loaded weights are counted from its
/// files).
pub fn flops_per_token(
    target_dir: &str,
    (c, d): (&TargetConfig, &DrafterConfig),
    taps: &[u32],
    max_seq_len: u32,
) -> Result<(f64, f64), Error> {
    let last = taps.iter().copied().max().unwrap_or(0) as usize;
    let ctx = max_seq_len as f64 / 2.0;
    let target = if c.arch == Arch::Transformers {
        let loaded = crate::run::target_check::loaded_elements(Path::new(target_dir), last)
            .map_err(|e| Error::input(format!("--target {target_dir}"), e))?;
        2.0 * loaded as f64
    } else {
        let (h, hd) = (c.hidden_size as f64, c.head_dim as f64);
        let (qd, kd) = (
            c.num_attention_heads as f64 * hd,
            c.num_key_value_heads as f64 * hd,
        );
        (0..=last)
            .map(|l| {
                let attn = 2.0 * h * (2.0 * qd + 2.0 * kd) + 4.0 * ctx * qd;
                let mlp = match c.sparse(l) {
                    Some(m) => {
                        let k = m.num_experts_per_tok as f64;
                        2.0 * h * (m.num_experts as f64 + 3.0 * k * m.moe_intermediate_size as f64)
                    }
                    None => 6.0 * h * c.intermediate_size as f64,
                };
                attn + mlp
            })
            .sum()
    };
    let drafter = drafter_flops_per_token(d, max_seq_len as f64);
    Ok((target, drafter))
}

/// A drafter's training FLOPs per context token for rows of `seq` tokens (see
/// [`flops_per_token`]).
pub fn drafter_flops_per_token(d: &DrafterConfig, seq: f64) -> f64 {
    let (h, hd, inter) = (d.hidden as f64, d.head_dim as f64, d.intermediate as f64);
    let (qd, kd) = (d.q_heads as f64 * hd, d.kv_heads as f64 * hd);
    let rows = (d.max_anchors as f64).min(seq) * d.block_size as f64;
    let context = 2.0 * seq * d.n_taps as f64 * h * h + 4.0 * seq * h * kd * d.layers as f64;
    let per_row = d.layers as f64
        * (2.0 * h * (2.0 * qd + 2.0 * kd) + 6.0 * h * inter + 4.0 * (seq / 2.0) * qd);
    let forward = context + rows * per_row;
    let loss = 2.0 * 2.0 * rows * d.vocab as f64 * h;
    (3.0 * forward + loss) / seq.max(1.0)
}

/// The targets among `devices` alike devices that train the most tokens/s when each role
/// runs at its FLOPs (`plan`'s roofline split; the fewer targets on a tie), at least one
/// of each role.
pub fn start_targets(devices: usize, target_flops: f64, drafter_flops: f64) -> usize {
    let prior = Rates {
        target: 1.0 / target_flops.max(1.0),
        drafter: 1.0 / drafter_flops.max(1.0),
    };
    (1..devices.max(2))
        .fold((1, f64::MIN), |(best, tps), t| {
            let x = prior.throughput(t, devices.saturating_sub(t));
            if x > tps * (1.0 + 1e-9) {
                (t, x)
            } else {
                (best, tps)
            }
        })
        .0
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

    /// What a window of `t` targets and `d` drafters measures when the workers do `truth`
    /// unhindered, with `noise` (a factor on each role's figure).
    fn measured(truth: Rates, (t, d): (usize, usize), noise: (f64, f64)) -> Sample {
        let rates = Rates {
            target: truth.target * noise.0,
            drafter: truth.drafter * noise.1,
        };
        Sample {
            rates: Some(rates),
            trained: rates.throughput(t, d),
            seconds: 1.0,
        }
    }

    /// Runs the balancer over `windows` one-second windows of `world` (what a window of a
    /// split measures, given its index) from the split `start`: the split it ends at and
    /// the moves it made.
    fn run(
        world: impl Fn((usize, usize), u32) -> Sample,
        start: (usize, usize),
        windows: u32,
    ) -> ((usize, usize), usize) {
        let t0 = Instant::now();
        let mut b = Balancer::new(cfg(), t0);
        let (mut t, mut d) = start;
        let mut moves = 0;
        for i in 0..windows {
            let now = t0 + Duration::from_secs(i as u64);
            match b.observe(Some(world((t, d), i)), (t, d), now) {
                Some(Move::ToTarget) => (t, d) = (t + 1, d - 1),
                Some(Move::ToDrafter) => (t, d) = (t - 1, d + 1),
                None => continue,
            }
            b.moved(now);
            moves += 1;
        }
        ((t, d), moves)
    }

    /// [`run`] in a world where the workers do `truth` unhindered, measured with ±10%
    /// noise alternating between the roles.
    fn simulate(truth: Rates, start: (usize, usize), windows: u32) -> ((usize, usize), usize) {
        let world = |split, i: u32| {
            let wobble = if i % 2 == 0 { (1.1, 0.9) } else { (0.9, 1.1) };
            measured(truth, split, wobble)
        };
        run(world, start, windows)
    }

    /// The split of `n` devices with the highest throughput.
    fn best(truth: Rates, n: usize) -> (usize, usize) {
        (1..n)
            .map(|t| (t, n - t))
            .max_by(|a, b| {
                truth
                    .throughput(a.0, a.1)
                    .total_cmp(&truth.throughput(b.0, b.1))
            })
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
            assert_eq!(
                b.observe(
                    Some(measured(slow_targets, (1, 7), (1.0, 1.0))),
                    (1, 7),
                    at(s)
                ),
                None,
                "{s}"
            );
        }
        assert_eq!(
            b.observe(
                Some(measured(slow_targets, (1, 7), (1.0, 1.0))),
                (1, 7),
                at(10)
            ),
            Some(Move::ToTarget)
        );
        b.moved(at(10));
        // After the dwell, windows that say nothing do not count: three that do are needed.
        assert_eq!(b.observe(None, (2, 6), at(20)), None);
        assert_eq!(
            b.observe(
                Some(measured(slow_targets, (2, 6), (1.0, 1.0))),
                (2, 6),
                at(21)
            ),
            None
        );
        assert_eq!(b.observe(None, (2, 6), at(22)), None);
        assert_eq!(
            b.observe(
                Some(measured(slow_targets, (2, 6), (1.0, 1.0))),
                (2, 6),
                at(23)
            ),
            None
        );
        assert_eq!(
            b.observe(
                Some(measured(slow_targets, (2, 6), (1.0, 1.0))),
                (2, 6),
                at(24)
            ),
            Some(Move::ToTarget)
        );
        // Six moves in an hour, then none until the first is an hour old.
        let mut b = Balancer::new(cfg(), t0);
        for i in 0..6 {
            b.moved(at(i * 11));
        }
        for s in 70..3600 {
            assert_eq!(
                b.observe(
                    Some(measured(slow_targets, (1, 7), (1.0, 1.0))),
                    (1, 7),
                    at(s)
                ),
                None,
                "{s}"
            );
        }
        assert_eq!(
            b.observe(
                Some(measured(slow_targets, (1, 7), (1.0, 1.0))),
                (1, 7),
                at(3600)
            ),
            Some(Move::ToTarget)
        );
    }

    #[test]
    fn a_split_that_did_worse_than_predicted_is_left_once_and_not_tried_again() {
        // The rates measured at (2, 2) promise (3, 1) half as much again, but there the
        // drafter slows down (it shares its CPU with three targets): (3, 1) trains 150
        // tokens/s against (2, 2)'s 200.
        let world = |split: (usize, usize), _| match split {
            (2, 2) => Sample {
                rates: Some(Rates {
                    target: 100.0,
                    drafter: 300.0,
                }),
                trained: 200.0,
                seconds: 1.0,
            },
            (3, 1) => Sample {
                rates: Some(Rates {
                    target: 100.0,
                    drafter: 150.0,
                }),
                trained: 150.0,
                seconds: 1.0,
            },
            (t, d) => measured(
                Rates {
                    target: 100.0,
                    drafter: 300.0,
                },
                (t, d),
                (1.0, 1.0),
            ),
        };
        // To (3, 1) as predicted, back to (2, 2) as measured, and there for good.
        assert_eq!(run(world, (2, 2), 7200), ((2, 2), 2));
        // From (1, 3) the same: up to (2, 2), the detour to (3, 1), back.
        assert_eq!(run(world, (1, 3), 7200), ((2, 2), 3));
    }

    #[test]
    fn the_start_is_the_split_whose_slower_role_is_fastest_at_the_roles_flops() {
        // A target token costs half a drafter's: two of three devices... one target
        // feeds two drafters at equal speed: (1, 2) → min(2, 2·1) vs (2, 1) → min(4, 1).
        assert_eq!(start_targets(3, 1.0, 2.0), 1);
        assert_eq!(start_targets(4, 1.0, 1.0), 2);
        // Targets 3× dearer: 6 of 8.
        assert_eq!(start_targets(8, 3.0, 1.0), 6);
        // Never no drafter, never no target.
        assert_eq!(start_targets(8, 1e9, 1.0), 7);
        assert_eq!(start_targets(8, 1.0, 1e9), 1);
        assert_eq!(start_targets(2, 5.0, 1.0), 1);
    }

    #[test]
    fn a_split_is_judged_by_what_it_trained_over_all_its_windows_not_its_steady_bursts() {
        // Steps slower than windows: at (1, 3) one window in three holds a step (a burst
        // of 192 tokens/s, 64 on average); at (2, 2) every window holds one, at 128.
        let world = |split: (usize, usize), i: u32| {
            let rates = Rates {
                target: 64.0,
                drafter: 1280.0,
            };
            let (rates, trained) = match split {
                (1, 3) if i % 3 != 0 => (None, 0.0),
                (1, 3) => (Some(rates), 192.0),
                (t, d) => (Some(rates), rates.throughput(t, d)),
            };
            Sample {
                rates,
                trained,
                seconds: 1.0,
            }
        };
        // Up to (3, 1), where the drafter is not yet the limit: min(192, 1280).
        assert_eq!(run(world, (1, 3), 7200), ((3, 1), 2));
    }

    #[test]
    fn the_last_worker_of_a_role_never_moves() {
        let b = Balancer::new(cfg(), Instant::now());
        let better = |r, t, d| b.better(r, (t, d), None);
        let targets_only = Rates {
            target: 1.0,
            drafter: 1e6,
        };
        assert_eq!(better(targets_only, 1, 1), None);
        assert_eq!(better(targets_only, 3, 1), None);
        let drafters_only = Rates {
            target: 1e6,
            drafter: 1.0,
        };
        assert_eq!(better(drafters_only, 1, 3), None);
        assert_eq!(better(drafters_only, 2, 2), Some(Move::ToDrafter));
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
