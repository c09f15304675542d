//! One drafter rank of the data-parallel group: computes the gradient of each batch,
//! all-reduces it with the other ranks of the current membership epoch through its
//! [`Collective`] (again in every new epoch until the step commits), and applies the
//! step when the supervisor commits it. Every rank sums the same gradients in the same
//! order, so the weights stay bit-identical across ranks.

use std::io::Write;
use std::path::Path;

use crate::collective::{
    local::LocalCollective, nccl::NcclCollective, shm::ShmCollective, Collective, Formed, Reduced,
    Sum,
};
use crate::error::{Result, WorkerError};
use dflash_shared::batch::HiddenView;
use dflash_shared::drafter::CollectiveKind;
use dflash_shared::drafter::{Init, StepStats, TrainSetup};
use dflash_shared::pool::PoolMap;

use crate::device::GpuError;
use crate::models::drafter::device::{DeviceDrafter, GradTo, Gradient, Rows, Step};
use crate::models::drafter::{batch_samples, AdamW, Drafter, Frozen};
use crate::models::weights::Weights;

pub struct Rank {
    pub setup: TrainSetup,
    drafter: Drafter,
    /// The gradient exchange with the other ranks. Declared (so dropped) before `model`:
    /// an NCCL communicator is aborted while its GPU context is still alive.
    coll: Box<dyn Collective>,
    /// The drafter's forward, backward and optimizer, on the worker's device: its GPU, or
    /// the CPU device (one model for every backend). The device holds the training state; `params`/`opt` are its host copy,
    /// brought up to date by [`Rank::sync_host`] for snapshots, checkpoints and the export.
    model: Box<DeviceDrafter>,
    params: Vec<f32>,
    opt: AdamW,
    /// The current membership epoch.
    epoch: Option<u64>,
    /// The slot a joiner's state is copied through (see [`Rank::snapshot`]).
    state_slot: PoolMap,
    /// Last step applied.
    pub step: u64,
    /// Where this rank is in step `step + 1`.
    next: StepState,
    pub skipped_steps: u64,
    /// Norm of the last averaged gradient, before clipping.
    pub last_grad_norm: f64,
    /// When the last step was applied (the wait for the next batch starts there), and how
    /// long applying it took.
    idle_since: std::time::Instant,
    last_optimizer_ms: f64,
}

/// A rank's place in the step after its last applied one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepState {
    /// It takes the next batch.
    Open,
    /// It holds a gradient for the step, which it all-reduces in every membership epoch
    /// until the supervisor commits the step.
    Holding {
        held: Held,
        /// The epoch in which its all-reduce completed (and was reported), if any: a new
        /// epoch reduces it again.
        reduced_in: Option<u64>,
    },
}

/// What a rank holds for the next step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Held {
    /// The gradient of a batch it computed.
    Batch,
    /// A zero gradient of weight 0: the data had no batch left for it.
    Abstention,
}

/// Why a transition of [`StepState`] was refused (a stale or out-of-order order).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StepRefused {
    #[error("a gradient for the next step is held already")]
    AlreadyHolding,
    #[error("step {committed} committed in epoch {epoch}, but this rank reported {reported}")]
    NotReduced {
        committed: u64,
        epoch: u64,
        reported: Reported,
    },
}

/// What a rank had reported of its all-reduce, when a commit does not match it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reported {
    Nothing,
    ReducedIn(u64),
}

impl std::fmt::Display for Reported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reported::Nothing => f.write_str("no reduced gradient"),
            Reported::ReducedIn(e) => write!(f, "its all-reduce in epoch {e}"),
        }
    }
}

impl StepState {
    /// Does it take a batch to train?
    pub fn open(&self) -> bool {
        matches!(self, StepState::Open)
    }

    /// It now holds `held` for the next step (not yet reduced).
    pub fn hold(&mut self, held: Held) -> std::result::Result<(), StepRefused> {
        match self {
            StepState::Open => {
                *self = StepState::Holding {
                    held,
                    reduced_in: None,
                };
                Ok(())
            }
            StepState::Holding { .. } => Err(StepRefused::AlreadyHolding),
        }
    }

    /// Is an all-reduce of what it holds due in `epoch` (the current one)?
    pub fn reducing(&self, epoch: Option<u64>) -> bool {
        match (self, epoch) {
            (StepState::Holding { reduced_in, .. }, Some(e)) => *reduced_in != Some(e),
            _ => false,
        }
    }

    /// Its all-reduce completed in `epoch`; `false` (nothing changes) when it holds
    /// nothing.
    pub fn reduced(&mut self, epoch: u64) -> bool {
        match self {
            StepState::Holding { reduced_in, .. } => {
                *reduced_in = Some(epoch);
                true
            }
            StepState::Open => false,
        }
    }

    /// Withdraw an abstention: back to taking batches. `false` (nothing changes) when it
    /// holds a batch's gradient or nothing.
    pub fn withdraw(&mut self) -> bool {
        match self {
            StepState::Holding {
                held: Held::Abstention,
                ..
            } => {
                *self = StepState::Open;
                true
            }
            _ => false,
        }
    }

    /// May step `step` be committed as reduced in `epoch`? Only what it reported.
    pub fn check_commit(&self, step: u64, epoch: u64) -> std::result::Result<(), StepRefused> {
        match self {
            StepState::Holding {
                reduced_in: Some(e),
                ..
            } if *e == epoch => Ok(()),
            StepState::Holding {
                reduced_in: Some(e),
                ..
            } => Err(StepRefused::NotReduced {
                committed: step,
                epoch,
                reported: Reported::ReducedIn(*e),
            }),
            _ => Err(StepRefused::NotReduced {
                committed: step,
                epoch,
                reported: Reported::Nothing,
            }),
        }
    }
}

/// What applying a step found out.
pub struct Applied {
    /// A step whose gradient was not finite, so the weights were left as they were: the
    /// previous one, whose outcome the device sends back a step later.
    pub skipped: Option<u64>,
}

/// A refused transition is an order that does not fit this rank's state.
fn protocol(e: StepRefused) -> WorkerError {
    WorkerError::Protocol(e.to_string())
}

fn f32s(bytes: &[u8]) -> impl Iterator<Item = f32> + '_ {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

impl Rank {
    /// `gpu`: the worker's GPU, if any; `max_tokens`: the longest row a batch can hold;
    /// `rows`: the hidden-state pool's slots, which the batches are read from (pinned on
    /// the device, so each row's copy overlaps the compute of the one before).
    ///
    /// # Safety
    /// `rows` must stay mapped while the rank lives.
    pub unsafe fn new(
        setup: TrainSetup,
        target_dir: &Path,
        gpu: Option<u32>,
        max_tokens: usize,
        rows: (*mut u8, usize),
    ) -> Result<Rank> {
        let drafter = Drafter::new(setup.drafter.clone());
        let c = &setup.drafter;
        let w = Weights::open(target_dir)?;
        let frozen = Frozen::load(&w, c.vocab, c.hidden)?;
        let state_slot = PoolMap::open(setup.state.fd, setup.state.geometry.clone())
            .map_err(WorkerError::io("mapping the state slot"))?;
        let n = drafter.layout.total;
        let dev = match crate::device::open_device(gpu) {
            Ok(None) => Box::new(
                crate::device::cpu::CpuDevice::open()
                    .map_err(|e| WorkerError::Permanent(e.to_string()))?,
            ),
            Ok(Some(dev)) => dev,
            Err(e @ GpuError::Unavailable(_)) => return Err(WorkerError::Permanent(e.to_string())),
            Err(e) => return Err(WorkerError::device("opening the device")(e)),
        };
        let mut model = match DeviceDrafter::new(dev, &drafter, &frozen, max_tokens) {
            Ok(g) => Box::new(g),
            Err(e @ GpuError::Unavailable(_)) => return Err(WorkerError::Permanent(e.to_string())),
            Err(e) => {
                return Err(WorkerError::device(format!(
                    "putting the drafter on {}",
                    if gpu.is_some() {
                        "the device"
                    } else {
                        "the CPU"
                    }
                ))(e))
            }
        };
        // SAFETY: the caller keeps the mapping for the rank's life.
        unsafe { model.register_host(rows.0, rows.1) }
            .map_err(WorkerError::device("pinning the hidden-state pool"))?;
        let coll: Box<dyn Collective> = match setup.collective {
            CollectiveKind::Shm => {
                let grads = PoolMap::open(setup.grads.fd, setup.grads.geometry.clone())
                    .map_err(WorkerError::io("mapping the gradient pool"))?;
                Box::new(ShmCollective::new(grads, setup.rank, n)?)
            }
            CollectiveKind::Nccl => Box::new(NcclCollective::new(setup.rank, model.as_mut())?),
            CollectiveKind::Local => Box::new(LocalCollective::new(setup.rank)),
        };
        let mut r = Rank {
            model,
            params: drafter.init_params(setup.seed),
            opt: AdamW::new(n),
            drafter,
            coll,
            epoch: None,
            state_slot,
            step: 0,
            next: StepState::Open,
            skipped_steps: 0,
            last_grad_norm: 0.0,
            idle_since: std::time::Instant::now(),
            last_optimizer_ms: 0.0,
            setup,
        };
        match r.setup.init {
            Init::Fresh => {
                if let Some(dir) = &r.setup.init_drafter {
                    r.params = crate::init_weights::load_weights(&r.drafter, Path::new(dir))?;
                }
            }
            Init::FromState { step, slot } => r.load_state(step, slot)?,
            Init::FromCheckpoint { step } => {
                let dir = r.setup.checkpoint.clone().ok_or_else(|| {
                    WorkerError::Protocol("resume without a checkpoint directory".into())
                })?;
                r.load_checkpoint(Path::new(&dir), step)?;
            }
        }
        r.model
            .load(&r.params, &r.opt.m, &r.opt.v, r.opt.step)
            .map_err(WorkerError::device(
                "putting the training state on the device",
            ))?;
        Ok(r)
    }

    /// Where the forward and backward run.
    pub fn compute_device(&self) -> String {
        self.model.describe()
    }

    pub fn param_count(&self) -> usize {
        self.params.len()
    }

    /// Checksum of the current weights (ranks compare it at every step), computed where
    /// the weights are, right after they changed; read without a wait for the device once
    /// the batch's work is queued (see [`DeviceDrafter::weights_checksum`]).
    pub fn params_checksum(&mut self) -> Result<u64> {
        self.model
            .weights_checksum()
            .map_err(WorkerError::device("the weights' checksum on the device"))
    }

    /// Bring the host copy of the training state up to date with the device's.
    fn sync_host(&mut self) -> Result<()> {
        let last = self
            .model
            .drain()
            .map_err(WorkerError::device("reading the last step's outcome"))?;
        if let Some(skipped) = last.and_then(|o| self.note_outcome(o)) {
            println!(
                "step {skipped}: non-finite gradient, step skipped ({} so far)",
                self.skipped_steps
            );
        }
        self.opt.step = self
            .model
            .fetch(&mut self.params, &mut self.opt.m, &mut self.opt.v)
            .map_err(WorkerError::device(
                "copying the training state from the device",
            ))?;
        Ok(())
    }

    fn note_outcome(&mut self, o: crate::models::drafter::device::StepOutcome) -> Option<u64> {
        if o.skipped {
            self.skipped_steps += 1;
            Some(o.step)
        } else {
            self.last_grad_norm = o.grad_norm;
            None
        }
    }

    /// Each row's taps of a hidden-state batch, as the slot holds them (bf16), once its
    /// capture is checked to be the drafter's (`what` names the batch in the error).
    fn row_taps<'v>(&self, view: &'v HiddenView, what: &str) -> Result<Vec<&'v [u8]>> {
        let c = &self.drafter.cfg;
        let width = view.spec.tap_ids.len() * view.spec.hidden as usize;
        if view.spec.tap_ids.len() != c.n_taps || view.spec.hidden as usize != c.hidden {
            return Err(WorkerError::Invalid(format!(
                "{what} has {} taps × {}, the drafter expects {} × {}",
                view.spec.tap_ids.len(),
                view.spec.hidden,
                c.n_taps,
                c.hidden
            )));
        }
        let seq = view.tokens.seq_len as usize;
        Ok(view
            .tokens
            .lengths
            .iter()
            .enumerate()
            .map(|(r, &len)| {
                &view.hidden[r * seq * width * 2..(r * seq + len as usize) * width * 2]
            })
            .collect())
    }

    /// Gradient of one hidden-state batch for step `self.step + 1`, into this rank's slot.
    pub fn compute(&mut self, view: &HiddenView) -> Result<StepStats> {
        if !self.next.open() {
            return Err(protocol(StepRefused::AlreadyHolding));
        }
        let started = std::time::Instant::now();
        let wait_ms = started.duration_since(self.idle_since).as_secs_f64() * 1e3;
        let raw = self.row_taps(view, "batch")?;
        let tb = &view.tokens;
        // Unnormalised gradients (denominator 1): the step divides by every rank's weight sum.
        // The device widens the bf16 taps itself, and keeps the gradient for the collective.
        let none = vec![Vec::new(); raw.len()];
        let (samples, anchors) = batch_samples(&self.drafter, tb, &none, self.setup.seed);
        let mut stats = self
            .model
            .forward_backward(&samples, Rows::Bf16(&raw), &anchors, 1.0, GradTo::Device)
            .map_err(WorkerError::device(format!(
                "drafter step on {}",
                self.model.describe()
            )))?;
        stats.wait_ms = wait_ms;
        self.next.hold(Held::Batch).map_err(protocol)?;
        let finite = self
            .coll
            .contribute(self.step + 1, stats.weight_sum, self.model.as_mut())?;
        // What every rank's update check will find in the sum (told to the supervisor,
        // which stops a run whose steps are all skipped). A device collective does not
        // look at the gradient on the host: the device's check counts it a step later.
        stats.nonfinite = !stats.loss_sum.is_finite() || finite == Some(false);
        stats.compute_ms = started.elapsed().as_secs_f64() * 1e3;
        stats.optimizer_ms = self.last_optimizer_ms;
        Ok(stats)
    }

    /// Held-out evaluation of one hidden-state batch at the current weights (those of
    /// `self.step`): the forward and loss of [`compute`](Self::compute) alone, with the
    /// anchors drawn from `index` (the batch's place in the eval set, so every eval round
    /// scores the same blocks). No gradient is written and nothing is contributed, so it
    /// may run while this rank holds the gradient of the next step.
    pub fn evaluate(&mut self, view: &HiddenView, index: u64) -> Result<StepStats> {
        let started = std::time::Instant::now();
        let raw = self.row_taps(view, "eval batch")?;
        let mut tb = view.tokens.clone();
        tb.batch_id = index;
        let none = vec![Vec::new(); raw.len()];
        let (samples, anchors) = batch_samples(&self.drafter, &tb, &none, self.setup.seed);
        let mut stats = self
            .model
            .evaluate(&samples, Rows::Bf16(&raw), &anchors)
            .map_err(WorkerError::device(format!(
                "drafter evaluation on {}",
                self.model.describe()
            )))?;
        stats.nonfinite = !stats.loss_sum.is_finite();
        stats.compute_ms = started.elapsed().as_secs_f64() * 1e3;
        Ok(stats)
    }

    /// The data is at its end and no batch comes for `step`: contribute a zero gradient
    /// of weight 0, so the ranks that have one can commit it. Ignored when this rank has a
    /// gradient already, or the order is stale.
    pub fn abstain(&mut self, step: u64) -> Result<bool> {
        if !self.next.open() || step != self.step + 1 {
            return Ok(false);
        }
        self.model
            .zero_grads()
            .map_err(WorkerError::device("a zero gradient"))?;
        self.next.hold(Held::Abstention).map_err(protocol)?;
        self.coll.contribute(step, 0.0, self.model.as_mut())?;
        Ok(true)
    }

    /// The abstention from `step` is withdrawn: drop the zero contribution (the
    /// supervisor has started a new epoch, so no sum of it is ever used) and take batches.
    pub fn withdraw(&mut self, step: u64) -> bool {
        step == self.step + 1 && self.next.withdraw()
    }

    /// Membership epoch `epoch` of `ranks`: what is in flight in an older one is void, and
    /// the held gradient is reduced again in this one.
    pub fn group(&mut self, epoch: u64, ranks: &[u32], id: Option<&[u8]>) -> Result<Formed> {
        if self.epoch.is_some_and(|e| e > epoch) {
            return Err(WorkerError::Protocol(format!(
                "group epoch {epoch} after epoch {}",
                self.epoch.unwrap_or(0)
            )));
        }
        self.epoch = Some(epoch);
        self.coll.form(epoch, ranks, id)
    }

    /// Is an all-reduce of this rank's gradient in flight (not yet reported)?
    pub fn reducing(&self) -> bool {
        self.next.reducing(self.epoch)
    }

    /// Does it take a batch to train (it holds no gradient for the next step)?
    pub fn takes_batches(&self) -> bool {
        self.next.open()
    }

    /// Where it is in the next step.
    #[cfg(test)]
    pub fn next_step(&self) -> StepState {
        self.next
    }

    /// Drive the all-reduce; `Some` once, when it completes in the current epoch.
    pub fn poll_reduce(&mut self) -> Result<Option<Reduced>> {
        if !self.reducing() {
            return Ok(None);
        }
        if test_death_due(self.setup.rank, self.step + 1) {
            // A test's kill in the middle of the all-reduce: once every other rank waits
            // for this one, which dies with its gradient written and not posted.
            if !self.coll.peers_waiting() {
                return Ok(None);
            }
            println!(
                "test fault: dying in the all-reduce of step {}",
                self.step + 1
            );
            // SAFETY: signalling ourselves.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        }
        let r = self.coll.poll(self.model.as_mut())?;
        match r {
            Some(d) if Some(d.epoch) == self.epoch && d.step == self.step + 1 => {
                self.next.reduced(d.epoch);
                Ok(Some(d))
            }
            _ => Ok(None),
        }
    }

    /// Apply committed step `step` (reduced in epoch `epoch`): the all-reduced gradient
    /// divided by `weight_sum` (the loss weights of all its batches), clipped, AdamW.
    pub fn reduce(&mut self, step: u64, epoch: u64, lr: f64, weight_sum: f64) -> Result<Applied> {
        if step != self.step + 1 {
            return Err(WorkerError::Protocol(format!(
                "asked to apply step {step}, but this rank is at step {}",
                self.step
            )));
        }
        self.next.check_commit(step, epoch).map_err(protocol)?;
        let started = std::time::Instant::now();
        // The rank's optimizer step over the collective's sum: norm, clip, skip of a
        // non-finite gradient, and AdamW, on the device with no wait for any of them.
        let (clip, lr, hyper) = (self.setup.clip as f32, lr as f32, self.opt.hyper());
        let what = || WorkerError::device(format!("applying step {step} on the device"));
        let before = match self.coll.take(step, weight_sum)? {
            Sum::Host(g) => self
                .model
                .update(&Step::new(step, clip, lr, &hyper), Gradient::Host(g))
                .map_err(what())?,
            Sum::Device { weight_sum, after } => self
                .model
                .update(
                    &Step::new(step, clip, lr, &hyper),
                    Gradient::Reduced { weight_sum, after },
                )
                .map_err(what())?,
        };
        self.step = step;
        self.next = StepState::Open;
        self.last_optimizer_ms = started.elapsed().as_secs_f64() * 1e3;
        self.idle_since = std::time::Instant::now();
        Ok(Applied {
            skipped: before.and_then(|o| self.note_outcome(o)),
        })
    }

    /// How this rank exchanges gradients.
    pub fn collective(&self) -> CollectiveKind {
        self.coll.kind()
    }

    /// Write parameters, Adam moments and step into state slot `slot`.
    pub fn snapshot(&mut self, slot: u32) -> Result<()> {
        if slot >= self.state_slot.geometry().slots {
            return Err(WorkerError::Protocol(format!(
                "state slot {slot} does not exist ({} slots)",
                self.state_slot.geometry().slots
            )));
        }
        self.sync_host()?;
        // SAFETY: the supervisor asks one rank at a time per slot, and nobody reads the slot
        // until our SnapshotDone (a rollback reads only the slot of the last one).
        let dst = unsafe { self.state_slot.payload_mut(slot) };
        let n = self.params.len();
        if (dst.len() as u64) < dflash_shared::drafter::state_bytes(n) {
            return Err(WorkerError::Protocol("state slot too small".into()));
        }
        dst[..8].copy_from_slice(&self.step.to_le_bytes());
        dst[8..16].copy_from_slice(&self.opt.step.to_le_bytes());
        let body = &mut dst[64..];
        for (i, v) in self
            .params
            .iter()
            .chain(&self.opt.m)
            .chain(&self.opt.v)
            .enumerate()
        {
            body[i * 4..i * 4 + 4].copy_from_slice(&v.to_le_bytes());
        }
        Ok(())
    }

    fn load_state(&mut self, step: u64, slot: u32) -> Result<()> {
        if slot >= self.state_slot.geometry().slots {
            return Err(WorkerError::Protocol(format!(
                "state slot {slot} does not exist ({} slots)",
                self.state_slot.geometry().slots
            )));
        }
        // SAFETY: written by the donor before the supervisor sent us Init::FromState.
        let src = unsafe { self.state_slot.payload(slot) };
        let at = u64::from_le_bytes(src[..8].try_into().expect("8 bytes"));
        if at != step {
            return Err(WorkerError::Protocol(format!(
                "the state slot holds step {at}, expected {step}"
            )));
        }
        self.opt.step = u64::from_le_bytes(src[8..16].try_into().expect("8 bytes"));
        let n = self.params.len();
        let vals: Vec<f32> = f32s(&src[64..64 + 3 * n * 4]).collect();
        self.params.copy_from_slice(&vals[..n]);
        self.opt.m.copy_from_slice(&vals[n..2 * n]);
        self.opt.v.copy_from_slice(&vals[2 * n..]);
        self.step = step;
        Ok(())
    }
}

/// Checkpoint files: the flat parameter buffer and Adam moments (f32), and meta.json.
impl Rank {
    /// Write `dir` atomically (temporary directory, fsync, rename). A failed write leaves
    /// nothing behind (a half-written file would hold the space a full disk lacks).
    pub fn checkpoint(&mut self, dir: &Path, meta: &str) -> Result<()> {
        let r = self.write_checkpoint(dir, meta);
        if r.is_err() {
            let _ =
                std::fs::remove_dir_all(dir.with_extension(format!("tmp-{}", std::process::id())));
        }
        r
    }

    fn write_checkpoint(&mut self, dir: &Path, meta: &str) -> Result<()> {
        self.sync_host()?;
        if !self
            .params
            .iter()
            .chain(&self.opt.m)
            .chain(&self.opt.v)
            .all(|x| x.is_finite())
        {
            return Err(WorkerError::Invalid(format!("the training state at step {} is not finite: no checkpoint written (the newest finite one stays the newest)", self.step)));
        }
        let tmp = dir.with_extension(format!("tmp-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir(&tmp)
            .map_err(WorkerError::io(format!("creating {}", tmp.display())))?;
        let n = self.params.len();
        let bufs: Vec<(&str, Vec<u8>)> = [
            ("params", &self.params),
            ("adam_m", &self.opt.m),
            ("adam_v", &self.opt.v),
        ]
        .into_iter()
        .map(|(k, v)| (k, v.iter().flat_map(|x| x.to_le_bytes()).collect()))
        .collect();
        let views: Vec<(&str, safetensors::tensor::TensorView)> = bufs
            .iter()
            .map(|(k, b)| {
                Ok((
                    *k,
                    safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![n], b)?,
                ))
            })
            .collect::<std::result::Result<_, safetensors::SafeTensorError>>()?;
        let state = safetensors::serialize(views, None)?;
        drop(bufs);
        let state_path = tmp.join(dflash_shared::checkpoint::STATE_FILE);
        write_synced(&state_path, &state)?;
        let state_sum = dflash_shared::checkpoint::checksum_hex(&state);
        drop(state);
        let supervisor: serde_json::Value =
            serde_json::from_str(meta).map_err(WorkerError::format("checkpoint metadata"))?;
        let meta = serde_json::json!({
            "step": self.step,
            "adam_step": self.opt.step,
            "drafter": self.drafter.cfg,
            "seed": self.setup.seed,
            "supervisor": supervisor,
            "checksums": {dflash_shared::checkpoint::STATE_FILE: state_sum},
        });
        write_synced(
            &tmp.join(dflash_shared::checkpoint::META_FILE),
            dflash_shared::checkpoint::finish_meta(&meta)?.as_bytes(),
        )?;
        sync_dir(&tmp)?;
        // A checkpoint of the same step number from before a rollback: replaced.
        put_in_place(
            &tmp,
            dir,
            &dir.with_extension(format!("replaced-{}", std::process::id())),
        )
    }

    fn load_checkpoint(&mut self, dir: &Path, step: u64) -> Result<()> {
        // Checksums and finiteness first: a checkpoint that changed on disk is refused.
        dflash_shared::checkpoint::verify(dir, None)
            .map_err(|e| WorkerError::Invalid(format!("checkpoint refused: {e}")))?;
        let text = std::fs::read_to_string(dir.join("meta.json"))
            .map_err(WorkerError::io(format!("{}/meta.json", dir.display())))?;
        let meta: serde_json::Value = serde_json::from_str(&text)
            .map_err(WorkerError::format(format!("{}/meta.json", dir.display())))?;
        if meta["step"].as_u64() != Some(step) {
            return Err(WorkerError::Invalid(format!(
                "{}: checkpoint of step {}, expected {step}",
                dir.display(),
                meta["step"]
            )));
        }
        let saved: dflash_shared::drafter::DrafterConfig =
            serde_json::from_value(meta["drafter"].clone())?;
        if saved != self.drafter.cfg {
            return Err(WorkerError::Invalid(format!(
                "{}: the checkpoint's drafter ({}) is not the one this run trains ({})",
                dir.display(),
                serde_json::to_string(&saved).unwrap_or_default(),
                serde_json::to_string(&self.drafter.cfg).unwrap_or_default()
            )));
        }
        let bytes = std::fs::read(dir.join("state.safetensors")).map_err(WorkerError::io(
            format!("{}/state.safetensors", dir.display()),
        ))?;
        let st = safetensors::SafeTensors::deserialize(&bytes).map_err(WorkerError::format(
            format!("{}/state.safetensors", dir.display()),
        ))?;
        let n = self.params.len();
        for (name, dst) in [
            ("params", &mut self.params),
            ("adam_m", &mut self.opt.m),
            ("adam_v", &mut self.opt.v),
        ] {
            let t = st.tensor(name).map_err(WorkerError::format(format!(
                "{}/state.safetensors: {name}",
                dir.display()
            )))?;
            if t.shape() != [n] {
                return Err(WorkerError::Invalid(format!(
                    "{}: {name} has shape {:?}, expected [{n}]",
                    dir.display(),
                    t.shape()
                )));
            }
            for (d, v) in dst.iter_mut().zip(f32s(t.data())) {
                *d = v;
            }
        }
        self.opt.step = meta["adam_step"].as_u64().unwrap_or(step);
        self.step = step;
        Ok(())
    }
}

/// Write `data` to `path` and fsync it; a failure names the path.
pub(crate) fn write_synced(path: &Path, data: &[u8]) -> Result<()> {
    let mut f = std::fs::File::create(path)
        .map_err(WorkerError::io(format!("creating {}", path.display())))?;
    f.write_all(data)
        .and_then(|()| f.sync_all())
        .map_err(WorkerError::io(format!("writing {}", path.display())))
}

/// Rename the finished `tmp` to `dir`, moving a previous `dir` aside to `old` first (and
/// removing it after), then sync the parent so the rename is on disk.
pub(crate) fn put_in_place(tmp: &Path, dir: &Path, old: &Path) -> Result<()> {
    let _ = std::fs::remove_dir_all(old);
    if dir.exists() {
        std::fs::rename(dir, old).map_err(WorkerError::io(format!(
            "moving the previous {} aside",
            dir.display()
        )))?;
    }
    std::fs::rename(tmp, dir).map_err(WorkerError::io(format!(
        "renaming {} to {}",
        tmp.display(),
        dir.display()
    )))?;
    let _ = std::fs::remove_dir_all(old);
    if let Some(parent) = dir.parent() {
        sync_dir(parent)?;
    }
    Ok(())
}

/// fsync a directory (its entries are then on disk); a failure names it.
pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    std::fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(WorkerError::io(format!("syncing {}", dir.display())))
}

/// Tests only: `DFLASH_TEST_DIE_IN_ALLREDUCE=RANK:STEP` kills rank RANK (in its first life)
/// in the middle of step STEP's all-reduce. Not a user feature.
fn test_death_due(rank: u32, step: u64) -> bool {
    let Ok(v) = std::env::var("DFLASH_TEST_DIE_IN_ALLREDUCE") else {
        return false;
    };
    let first_life = std::env::var(dflash_shared::env::RESTART_COUNT).is_ok_and(|c| c == "0");
    first_life
        && v.split_once(':')
            .is_some_and(|(r, s)| r.parse() == Ok(rank) && s.parse() == Ok(step))
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflash_shared::drafter::DrafterConfig;
    use dflash_shared::model_config::TargetConfig;
    use dflash_shared::pool::{PoolGeometry, PoolId, PoolInfo};
    use std::os::fd::{AsRawFd, OwnedFd};

    #[test]
    fn a_step_state_holds_once_reduces_per_epoch_and_commits_only_what_it_reported() {
        let mut s = StepState::Open;
        assert!(s.open() && !s.reducing(Some(1)));
        assert!(!s.reduced(1), "nothing held, nothing reduced");
        assert!(!s.withdraw(), "nothing to withdraw");
        s.hold(Held::Batch).unwrap();
        assert_eq!(s.hold(Held::Batch), Err(StepRefused::AlreadyHolding));
        assert!(!s.reducing(None), "no epoch yet: nothing to reduce in");
        assert!(s.reducing(Some(1)));
        assert!(s.reduced(1));
        assert!(!s.reducing(Some(1)), "reported once per epoch");
        assert!(s.reducing(Some(2)), "a new epoch reduces it again");
        assert_eq!(
            s.check_commit(1, 2),
            Err(StepRefused::NotReduced {
                committed: 1,
                epoch: 2,
                reported: Reported::ReducedIn(1)
            })
        );
        assert!(!s.withdraw(), "a batch's gradient is not withdrawn");
        assert_eq!(s.check_commit(1, 1), Ok(()));
    }

    #[test]
    fn an_abstention_is_withdrawn_and_an_unreduced_step_is_not_committed() {
        let mut s = StepState::Open;
        s.hold(Held::Abstention).unwrap();
        assert_eq!(
            s.check_commit(4, 1).unwrap_err().to_string(),
            "step 4 committed in epoch 1, but this rank reported no reduced gradient"
        );
        assert!(s.withdraw());
        assert_eq!(s, StepState::Open);
    }

    /// A rank of a one-rank group on the CPU device, over the built-in tiny target.
    fn cpu_rank(dir: &Path) -> (Rank, Vec<OwnedFd>, Vec<u8>) {
        crate::models::tiny::write(dir).unwrap();
        let t = TargetConfig::load(dir).unwrap();
        let drafter = DrafterConfig::for_target(&t, 1, 2, 4, 4);
        let n = crate::models::drafter::Drafter::new(drafter.clone())
            .layout
            .total;
        let pool = |name: &str, slot_bytes: u64| {
            PoolMap::create(PoolGeometry {
                name: name.into(),
                slots: 2,
                slot_bytes,
            })
            .unwrap()
            .0
        };
        let state = pool("state", dflash_shared::drafter::state_bytes(n));
        let grads = pool("grads", 4096);
        let info = |fd: &OwnedFd, slot_bytes: u64| PoolInfo {
            id: PoolId::Hidden,
            fd: fd.as_raw_fd(),
            geometry: PoolGeometry {
                name: "x".into(),
                slots: 2,
                slot_bytes,
            },
        };
        let setup = TrainSetup {
            drafter,
            lr: 1e-3,
            warmup_steps: 0,
            total_steps: None,
            clip: 1.0,
            seed: 7,
            grads: info(&grads, 4096),
            collective: CollectiveKind::Local,
            state: info(&state, dflash_shared::drafter::state_bytes(n)),
            rank: 0,
            checkpoint: None,
            target_layer_ids: vec![0, 1],
            num_target_layers: t.num_hidden_layers,
            init: Init::Fresh,
            init_drafter: None,
        };
        let mut rows = vec![0u8; 1 << 16];
        // SAFETY: `rows` is returned with the rank and outlives it in every test.
        let rank =
            unsafe { Rank::new(setup, dir, None, 64, (rows.as_mut_ptr(), rows.len())) }.unwrap();
        (rank, vec![state, grads], rows)
    }

    #[test]
    fn a_rank_abstains_reduces_in_its_epoch_and_applies_only_the_committed_step() {
        let dir = tempfile::tempdir().unwrap();
        let (mut rank, _pools, _rows) = cpu_rank(dir.path());
        assert!(rank.takes_batches() && !rank.reducing());
        assert!(!rank.abstain(2).unwrap(), "a stale abstention is ignored");
        assert!(rank.abstain(1).unwrap());
        assert!(!rank.takes_batches());
        assert!(!rank.abstain(1).unwrap(), "it holds a contribution already");
        assert!(!rank.reducing(), "no epoch formed yet");
        assert_eq!(rank.group(1, &[0], None).unwrap(), Formed::Ready);
        assert!(rank.reducing());
        let reduced = rank
            .poll_reduce()
            .unwrap()
            .expect("a one-rank group reduces at once");
        assert_eq!((reduced.step, reduced.epoch), (1, 1));
        assert!(!rank.reducing() && rank.poll_reduce().unwrap().is_none());
        // A commit of another epoch than the one reduced in is a protocol error.
        let err = rank.reduce(1, 2, 1e-3, 0.0).err().expect("refused");
        assert!(
            err.to_string()
                .contains("but this rank reported its all-reduce in epoch 1"),
            "{err}"
        );
        let err = rank.reduce(2, 1, 1e-3, 0.0).err().expect("refused");
        assert!(err.to_string().contains("this rank is at step 0"), "{err}");
        rank.reduce(1, 1, 1e-3, 0.0).unwrap();
        assert_eq!(rank.step, 1);
        assert_eq!(rank.next_step(), StepState::Open);
        assert!(rank.takes_batches());
    }

    #[test]
    fn a_withdrawn_abstention_takes_batches_again_and_a_new_epoch_reduces_again() {
        let dir = tempfile::tempdir().unwrap();
        let (mut rank, _pools, _rows) = cpu_rank(dir.path());
        rank.group(1, &[0], None).unwrap();
        assert!(rank.abstain(1).unwrap());
        assert!(!rank.withdraw(2), "a stale withdrawal is ignored");
        assert!(rank.withdraw(1));
        assert!(rank.takes_batches() && !rank.reducing());
        assert!(rank.abstain(1).unwrap());
        assert!(rank.poll_reduce().unwrap().is_some());
        rank.group(2, &[0], None).unwrap();
        assert!(rank.reducing(), "epoch 2 reduces the held gradient again");
        let again = rank.poll_reduce().unwrap().expect("reduced in epoch 2");
        assert_eq!(again.epoch, 2);
        assert!(rank.group(1, &[0], None).is_err(), "epochs only go forward");
    }
}
