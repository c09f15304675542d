//! `--targets auto`: a device moves between the roles while the run goes.
//!
//! At the end of each metrics window the balancer ([`crate::run::balance`]) reads the
//! window; when it asks for a move, the worker of the surplus role with the highest rank is
//! asked to stop (a target finishes its batch, a drafter leaves its group, whose next epoch
//! forms without it; what either held goes back to its queue, as when a worker dies). When
//! it has exited, a worker of the other role starts on its device: a target takes token
//! batches at once; a drafter joins the group with the current weights, as a restarted one
//! does. One move at a time, over once the new worker has done its first unit of work
//! (its start and warm-up are not measured as the new split's speed); each is an event in
//! events.jsonl (`role_move_started`, then `role_move`), a line in train.jsonl and in the
//! log.

use dflash_shared::{Device, Role, WorkerName};
use serde_json::json;

use super::life::Status;
use super::{obj, Dispatcher, Phase, Worker};
use crate::run::balance::{Move, Sample};
use crate::telemetry::window::Window;
use crate::training::train_log::LogLine;

/// A move under way.
#[derive(Debug, Clone, Copy)]
pub(super) enum Moving {
    /// `worker` was asked to stop; its device goes to the role `to`.
    Leaving { worker: usize, to: Role },
    /// `worker` started on the device: the move is over once it has done its first unit
    /// of work (until then its start and warm-up would read as a slow role).
    Joining { worker: usize },
}

impl Dispatcher {
    /// The workers of `role` that count: those not moved away and not failed.
    fn active(&self, role: Role) -> impl Iterator<Item = usize> + '_ {
        self.workers
            .iter()
            .enumerate()
            .filter(move |(_, w)| {
                w.name.role == role && !matches!(w.status, Status::Moved | Status::Failed)
            })
            .map(|(i, _)| i)
    }

    /// Workers per role, those whose device moved away (or that failed) not counted.
    pub(super) fn roles(&self) -> std::collections::BTreeMap<String, u64> {
        [Role::Target, Role::Drafter]
            .into_iter()
            .map(|r| (r.as_str().to_string(), self.active(r).count() as u64))
            .collect()
    }

    /// The balancer's turn at the end of the metrics window `w` (`steady`: one whose
    /// figures describe the split, see `write_metrics`): what it did, in words (`None`
    /// without `--targets auto`, or once the run is stopping).
    pub(super) fn balance(&mut self, w: &Window, steady: bool) -> Option<String> {
        if !matches!(self.phase, Phase::Running) || self.balancer.is_none() {
            return None;
        }
        match self.moving {
            Some(Moving::Leaving { worker, to }) => {
                let name = self.workers[worker].name;
                return Some(format!("moving {name} to the {} role", to.as_str()));
            }
            Some(Moving::Joining { worker }) => {
                let name = self.workers[worker].name;
                return Some(format!("{name} is starting on the moved device"));
            }
            None => {}
        }
        let (targets, drafters) = (
            self.active(Role::Target).count(),
            self.active(Role::Drafter).count(),
        );
        let sample = Sample::of(w, steady);
        let now = self.now;
        let b = self.balancer.as_mut()?;
        let split = format!("{targets} target(s) + {drafters} drafter(s)");
        let Some(m) = b.observe(Some(sample), (targets, drafters), now) else {
            return Some(if b.ready(now) {
                format!("holding {split}: no neighbouring split would train enough more")
            } else {
                format!("measuring {split} before any move")
            });
        };
        let mean = b.rates();
        let (from, to) = match m {
            Move::ToTarget => (Role::Drafter, Role::Target),
            Move::ToDrafter => (Role::Target, Role::Drafter),
        };
        // The surplus role's running worker with the highest rank.
        let Some(worker) = self
            .active(from)
            .filter(|&i| {
                self.workers[i]
                    .status
                    .life()
                    .is_some_and(|l| l.to_worker().is_some())
            })
            .max_by_key(|&i| self.workers[i].name.rank)
        else {
            return Some(format!(
                "holding {split}: no worker of the surplus role is running"
            ));
        };
        if let Some(b) = self.balancer.as_mut() {
            b.moved(now);
        }
        let (after_t, after_d) = match m {
            Move::ToTarget => (targets + 1, drafters - 1),
            Move::ToDrafter => (targets - 1, drafters + 1),
        };
        let (expect_now, expect_after) = mean.map_or((0.0, 0.0), |r| {
            (
                r.throughput(targets, drafters),
                r.throughput(after_t, after_d),
            )
        });
        let w = &self.workers[worker];
        log::info!(
            "--targets auto: moving {} ({}) to the {} role: {targets} target(s) + {drafters} drafter(s) → {after_t} + {after_d}, \
             measured {:.0} tok/s per target and {:.0} per drafter, so about {expect_now:.0} → {expect_after:.0} tok/s",
            w.name,
            w.device,
            to.as_str(),
            mean.map_or(0.0, |r| r.target),
            mean.map_or(0.0, |r| r.drafter),
        );
        self.run.event(
            "role_move_started",
            obj(json!({
                "worker": w.name.to_string(), "gpu": w.device.to_string(), "to": to.as_str(),
                "split_before": [targets, drafters], "split_after": [after_t, after_d],
                "target_tokens_per_s": mean.map(|r| r.target),
                "drafter_tokens_per_s": mean.map(|r| r.drafter),
                "expected_tokens_per_s": [expect_now, expect_after],
            })),
        );
        self.moving = Some(Moving::Leaving { worker, to });
        let name = self.workers[worker].name;
        let role = to.as_str();
        self.ask_to_stop(worker, &format!("its device moves to the {role} role"));
        Some(format!("moving {name} to the {role} role"))
    }

    /// Called when `worker`'s life is over (its slots released, its group left): when it is
    /// the one moving, its device starts in the other role, and `true` is returned (the
    /// exit is no failure to restart).
    pub(super) fn finish_move(&mut self, worker: usize) -> bool {
        let to = match self.moving {
            Some(Moving::Leaving { worker: w, to }) if w == worker => to,
            Some(Moving::Joining { worker: w }) if w == worker => {
                // The new worker died before its first unit of work: it is restarted as
                // any worker is, and the balancer measures again from now.
                self.joined(worker);
                return false;
            }
            _ => return false,
        };
        self.moving = None;
        if !matches!(self.phase, Phase::Running) {
            return false;
        }
        let w = &mut self.workers[worker];
        w.status = Status::Moved;
        let (from, device) = (w.name, w.device);
        match self.worker_for(to, device) {
            Ok(next) => {
                let to = self.workers[next].name;
                log::info!("--targets auto: the device of {from} ({device}) now runs {to}");
                let record = json!({"from": from.to_string(), "to": to.to_string(),
                                    "gpu": device.to_string(),
                                    "step": self.trainer.progress().step});
                self.trainer.log(&LogLine::RoleMove(record.clone()));
                self.run.event("role_move", obj(record));
                self.role_moves += 1;
                self.moving = Some(Moving::Joining { worker: next });
                self.spawn(next);
            }
            Err(e) => {
                // Its old role goes on there instead.
                log::warn!("--targets auto: {device} stays with {from}: {e}");
                self.workers[worker].status = Status::NotStarted;
                self.spawn(worker);
            }
        }
        true
    }

    /// `worker` did a unit of work: when it is the one joining on a moved device, the move
    /// is over, and the balancer's dwell and windows start from now.
    pub(super) fn joined(&mut self, worker: usize) {
        if !matches!(self.moving, Some(Moving::Joining { worker: w }) if w == worker) {
            return;
        }
        self.moving = None;
        let now = self.now;
        if let Some(b) = self.balancer.as_mut() {
            b.settled(now);
        }
    }

    /// The worker of `role` to start on `device`: the lowest rank of that role no worker
    /// holds now (an earlier worker of that name that moved away starts again, its log and
    /// restarts its own), else a new one.
    fn worker_for(&mut self, role: Role, device: Device) -> Result<usize, crate::error::Error> {
        let held: Vec<u32> = self
            .active(role)
            .map(|i| self.workers[i].name.rank)
            .collect();
        let rank = (0..).find(|r| !held.contains(r)).unwrap_or(0);
        let name = WorkerName { role, rank };
        if let Some(i) = self.workers.iter().position(|w| w.name == name) {
            let w = &mut self.workers[i];
            w.device = device;
            w.status = Status::NotStarted;
            return Ok(i);
        }
        let w = Worker::open(&self.cfg, &self.run, (name, device), 0)?;
        self.workers.push(w);
        Ok(self.workers.len() - 1)
    }
}
