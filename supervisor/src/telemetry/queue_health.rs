//! Pipeline health over a metrics window, measured where the supervisor already decides
//! (each grant pass): pool fill, how long producers waited for a free slot and consumers
//! for a ready batch, batches per worker, the length mix of batches, and a plain-language
//! hint when one side starves the other.

use std::collections::BTreeMap;
use std::time::Instant;

use super::window::{Pipeline, Pool};

/// Time-weighted shares of one pool.
#[derive(Default)]
struct PoolAcc {
    time: f64,
    fill: f64,
    producers_blocked: f64,
    consumers_starved: f64,
}

/// What one grant pass saw of one pool.
pub struct PoolView {
    pub ready: usize,
    pub slots: usize,
    /// Some producer wanted a free slot and none was free.
    pub producer_blocked: bool,
    /// Some consumer had credit and no batch was ready.
    pub consumer_starved: bool,
}

pub struct QueueHealth {
    last: Instant,
    pools: [PoolAcc; 2],
    served: BTreeMap<String, u64>,
    tokens_by_worker: BTreeMap<String, u64>,
    lengths: BTreeMap<u32, u64>,
    real_tokens: u64,
    padded_tokens: u64,
    /// Per worker, per phase: (sum of milliseconds, count).
    phases: BTreeMap<String, BTreeMap<&'static str, (f64, u64)>>,
    /// The latest device memory report of each device worker (kept across windows).
    device_memory: BTreeMap<String, dflash_shared::protocol::DeviceMemory>,
    /// Tokens the drafters trained on since the run started (kept across windows).
    drafter_tokens_total: u64,
    /// The run's CPU workers and the cores they share, when they outnumber them (the run
    /// warned so): hints then name the CPU as the limit instead of advising more workers.
    cpu_limit: Option<(usize, usize)>,
    /// `--targets auto` moves devices itself: hints say what starves what, and the
    /// balancer says what it does about it, instead of advising more workers.
    balanced: bool,
}

impl Default for QueueHealth {
    fn default() -> Self {
        QueueHealth {
            last: Instant::now(),
            pools: Default::default(),
            served: BTreeMap::new(),
            tokens_by_worker: BTreeMap::new(),
            lengths: BTreeMap::new(),
            real_tokens: 0,
            padded_tokens: 0,
            phases: BTreeMap::new(),
            device_memory: BTreeMap::new(),
            drafter_tokens_total: 0,
            cpu_limit: None,
            balanced: false,
        }
    }
}

/// Length bucket of a row: the next power of two (16, 32, 64, ...).
fn bucket(len: u32) -> u32 {
    len.max(16).next_power_of_two()
}

impl QueueHealth {
    /// One grant pass: weight what it saw by the time since the previous one.
    pub fn observe(&mut self, tokens: PoolView, hidden: PoolView) {
        let now = Instant::now();
        let dt = now.duration_since(self.last).as_secs_f64();
        self.last = now;
        for (acc, v) in self.pools.iter_mut().zip([tokens, hidden]) {
            acc.time += dt;
            acc.fill += dt * v.ready as f64 / v.slots.max(1) as f64;
            acc.producers_blocked += dt * v.producer_blocked as u8 as f64;
            acc.consumers_starved += dt * v.consumer_starved as u8 as f64;
        }
    }

    /// The run's CPU workers outnumber its cores (`(workers, cores)`), or not (`None`).
    pub fn cpu_limited(&mut self, limit: Option<(usize, usize)>) {
        self.cpu_limit = limit;
    }

    /// `--targets auto` balances the roles: hints advise no more workers.
    pub fn balanced(&mut self) {
        self.balanced = true;
    }

    pub fn served(&mut self, worker: &str) {
        *self.served.entry(worker.to_string()).or_default() += 1;
    }

    pub fn tokens(&mut self, worker: &str, n: u64) {
        if worker.starts_with("drafter") {
            self.drafter_tokens_total += n;
        }
        *self.tokens_by_worker.entry(worker.to_string()).or_default() += n;
    }

    /// A worker's host-side time in `phase` for one unit of work.
    pub fn device_memory(&mut self, worker: &str, m: dflash_shared::protocol::DeviceMemory) {
        self.device_memory.insert(worker.to_string(), m);
    }

    pub fn phase(&mut self, worker: &str, phase: &'static str, ms: f64) {
        let e = self
            .phases
            .entry(worker.to_string())
            .or_default()
            .entry(phase)
            .or_default();
        e.0 += ms;
        e.1 += 1;
    }

    pub fn batch(&mut self, lengths: &[u32], seq_len: u32) {
        for &l in lengths {
            *self.lengths.entry(bucket(l)).or_default() += 1;
        }
        self.real_tokens += lengths.iter().map(|&l| l as u64).sum::<u64>();
        self.padded_tokens += lengths.len() as u64 * seq_len as u64;
    }

    /// The window; resets it.
    pub fn take(&mut self, window_s: f64) -> Pipeline {
        let pool = |a: &PoolAcc| {
            let t = a.time.max(1e-9);
            Pool {
                fill_ratio: a.fill / t,
                producers_blocked_share: a.producers_blocked / t,
                consumers_starved_share: a.consumers_starved / t,
            }
        };
        let total: u64 = self.lengths.values().sum();
        let entropy = if total == 0 {
            0.0
        } else {
            -self
                .lengths
                .values()
                .map(|&c| c as f64 / total as f64)
                .map(|p| p * p.log2())
                .sum::<f64>()
        };
        // Max over min of batches per worker, within each role.
        let mut by_role: BTreeMap<String, Vec<u64>> = BTreeMap::new();
        for (w, n) in &self.served {
            by_role
                .entry(w.split('-').next().unwrap_or("").to_string())
                .or_default()
                .push(*n);
        }
        let balance = by_role
            .into_iter()
            .map(|(role, v)| {
                let (hi, lo) = (
                    v.iter().max().copied().unwrap_or(0),
                    v.iter().min().copied().unwrap_or(0),
                );
                (role, (lo > 0).then(|| hi as f64 / lo as f64))
            })
            .collect();
        let per_s = |n: u64| n as f64 / window_s.max(1e-9);
        let v = Pipeline {
            tokens_pool: pool(&self.pools[0]),
            hidden_pool: pool(&self.pools[1]),
            batches_per_worker: self.served.clone(),
            balance_max_over_min: balance,
            tokens_per_s_trained: per_s(self.drafter_tokens()),
            tokens_per_s_by_worker: self
                .tokens_by_worker
                .iter()
                .map(|(w, n)| (w.clone(), per_s(*n)))
                .collect(),
            length_buckets: self
                .lengths
                .iter()
                .map(|(b, c)| (format!("<={b}"), *c))
                .collect(),
            length_entropy_bits: entropy,
            padding_efficiency: (self.padded_tokens > 0)
                .then(|| self.real_tokens as f64 / self.padded_tokens as f64),
            bottleneck_hint: self.hint(),
            phase_ms_by_worker: self
                .phases
                .iter()
                .map(|(w, m)| {
                    let mean = |(sum, n): &(f64, u64)| sum / (*n).max(1) as f64;
                    (
                        w.clone(),
                        m.iter().map(|(k, v)| (k.to_string(), mean(v))).collect(),
                    )
                })
                .collect(),
            cuda_memory_by_worker: self.device_memory.clone(),
        };
        *self = QueueHealth {
            last: self.last,
            device_memory: std::mem::take(&mut self.device_memory),
            drafter_tokens_total: self.drafter_tokens_total,
            cpu_limit: self.cpu_limit,
            balanced: self.balanced,
            ..QueueHealth::default()
        };
        v
    }

    /// Tokens the drafters trained on since the run started.
    pub fn drafter_tokens_total(&self) -> u64 {
        self.drafter_tokens_total
    }

    /// Tokens the drafters trained so far in the open window.
    pub fn drafter_tokens(&self) -> u64 {
        self.tokens_by_worker
            .iter()
            .filter(|(w, _)| w.starts_with("drafter"))
            .map(|(_, n)| *n)
            .sum()
    }

    fn hint(&self) -> Option<String> {
        let share = |a: &PoolAcc, x: f64| if a.time > 0.0 { x / a.time } else { 0.0 };
        let (tok, hid) = (&self.pools[0], &self.pools[1]);
        let drafters_idle = share(hid, hid.consumers_starved);
        let targets_blocked = share(hid, hid.producers_blocked);
        let targets_idle = share(tok, tok.consumers_starved);
        if drafters_idle > 0.5 && targets_idle > 0.5 {
            Some(format!(
                "targets idle {:.0}% waiting for token batches: the data loader is the bottleneck",
                targets_idle * 100.0
            ))
        } else if drafters_idle > 0.5 {
            Some(self.advise(
                format!(
                    "drafters idle {:.0}% waiting for hidden states",
                    drafters_idle * 100.0
                ),
                "add targets",
            ))
        } else if targets_blocked > 0.5 {
            Some(self.advise(
                format!(
                    "targets blocked {:.0}% on a full hidden-state pool",
                    targets_blocked * 100.0
                ),
                "add drafters",
            ))
        } else {
            None
        }
    }

    /// `what`, then `fix`; or, when the CPU workers outnumber the cores, that the CPU is
    /// the limit: more workers would only share it too.
    fn advise(&self, what: String, fix: &str) -> String {
        match self.cpu_limit {
            Some((workers, cores)) => format!(
                "{what}: the CPU is the limit ({workers} CPU workers on {cores} core(s)), not the number of workers"
            ),
            None if self.balanced => what,
            None => format!("{what}: {fix}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn composition_balance_and_hints() {
        let mut q = QueueHealth::default();
        q.batch(&[10, 20, 30], 30);
        q.batch(&[100], 100);
        for _ in 0..3 {
            q.served("drafter-0");
        }
        q.served("drafter-1");
        std::thread::sleep(std::time::Duration::from_millis(5));
        q.observe(
            PoolView {
                ready: 2,
                slots: 4,
                producer_blocked: false,
                consumer_starved: false,
            },
            PoolView {
                ready: 0,
                slots: 4,
                producer_blocked: false,
                consumer_starved: true,
            },
        );
        let v = q.take(1.0);
        assert_eq!(v.length_buckets["<=16"], 1);
        assert_eq!(v.length_buckets["<=32"], 2);
        assert_eq!(v.length_buckets["<=128"], 1);
        assert!((v.padding_efficiency.unwrap() - 160.0 / 190.0).abs() < 1e-9);
        assert!((v.length_entropy_bits - 1.5).abs() < 1e-9);
        assert_eq!(v.balance_max_over_min["drafter"], Some(3.0));
        assert!((v.tokens_pool.fill_ratio - 0.5).abs() < 1e-9);
        assert_eq!(v.hidden_pool.consumers_starved_share, 1.0);
        assert!(v
            .bottleneck_hint
            .as_deref()
            .unwrap()
            .contains("drafters idle 100%"));
        // The window resets.
        assert!(q.take(1.0).batches_per_worker.is_empty());
    }

    /// A window in which one pool's side waited on the other all along.
    fn starved(q: &mut QueueHealth, targets_blocked: bool) {
        q.last = Instant::now() - std::time::Duration::from_secs(1);
        q.observe(
            PoolView {
                ready: 2,
                slots: 4,
                producer_blocked: false,
                consumer_starved: false,
            },
            PoolView {
                ready: if targets_blocked { 4 } else { 0 },
                slots: 4,
                producer_blocked: targets_blocked,
                consumer_starved: !targets_blocked,
            },
        );
    }

    #[test]
    fn hints_never_advise_more_workers_when_cpu_workers_outnumber_the_cores() {
        let mut q = QueueHealth::default();
        starved(&mut q, true);
        let hint = q.take(1.0).bottleneck_hint.unwrap();
        assert!(hint.ends_with(": add drafters"), "{hint}");
        // --targets auto moves the devices itself: the hint says only what starves what.
        let mut auto = QueueHealth::default();
        auto.balanced();
        starved(&mut auto, true);
        let hint = auto.take(1.0).bottleneck_hint.unwrap();
        assert!(
            hint.starts_with("targets blocked") && !hint.contains("add "),
            "{hint}"
        );
        // The run warned "3 CPU workers on 2 core(s)": the hint agrees with it.
        q.cpu_limited(Some((3, 2)));
        for targets_blocked in [true, false] {
            starved(&mut q, targets_blocked);
            let hint = q.take(1.0).bottleneck_hint.unwrap();
            assert!(!hint.contains("add "), "{hint}");
            assert!(
                hint.contains("the CPU is the limit (3 CPU workers on 2 core(s))"),
                "{hint}"
            );
        }
    }
}
