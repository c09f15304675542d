//! The worker's side of the shared-memory data plane: the pools it inherited, the
//! deliveries and leases granted to it, and one unit of work per role.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::Ordering;

use crate::error::{Result, WorkerError};
use dflash_shared::batch::{
    eval_batch_parts, is_eval_batch, seal_hidden, write_hidden_header, CaptureSpec, HiddenView,
    TokenBatch,
};
use dflash_shared::pool::PoolMap;
use dflash_shared::protocol::{FromWorker, PoolId, PoolInfo, SlotRef, Work};
use dflash_shared::slots::SlotState;
use dflash_shared::Role;

use crate::busy::Busy;
use crate::device::{self, GpuError};
use crate::models::target::device::DeviceTarget;
use crate::models::target::{Load, Target};
use crate::torch_engine::TorchChild;
use crate::train::Rank;

pub struct Pools {
    tokens: PoolMap,
    hidden: PoolMap,
    /// The hidden pool's memfd (the torch engine's child maps it too).
    hidden_fd: i32,
    capture: CaptureSpec,
}

impl Pools {
    pub fn open(infos: &[PoolInfo], capture: CaptureSpec) -> Result<Pools> {
        let find = |id: PoolId| {
            let i = infos.iter().find(|p| p.id == id).ok_or_else(|| {
                WorkerError::Protocol(format!("the supervisor sent no {id} pool"))
            })?;
            PoolMap::open(i.fd, i.geometry.clone()).map_err(WorkerError::io(format!(
                "mapping the {id} pool (fd {})",
                i.fd
            )))
        };
        Ok(Pools {
            tokens: find(PoolId::Tokens)?,
            hidden: find(PoolId::Hidden)?,
            hidden_fd: infos
                .iter()
                .find(|p| p.id == PoolId::Hidden)
                .map_or(-1, |p| p.fd),
            capture,
        })
    }

    /// The longest row (tokens) a hidden-state slot can hold: what a device must have
    /// room for.
    fn max_row_tokens(&self) -> usize {
        (self.hidden.geometry().slot_bytes / self.capture.bytes_per_token().max(1)) as usize
    }

    fn map(&self, id: PoolId) -> &PoolMap {
        match id {
            PoolId::Tokens => &self.tokens,
            PoolId::Hidden => &self.hidden,
        }
    }
}

/// A batch delivered to this worker.
#[derive(Debug, Clone, Copy)]
pub struct Delivery {
    pub slot: SlotRef,
    pub len: u64,
    pub batch_id: u64,
}

#[derive(Default)]
pub struct Stats {
    pub batches: u64,
    pub tokens: u64,
    pub duplicates: u64,
}

/// The target model, loaded on a thread of its own so the worker keeps heartbeating
/// while a large checkpoint is read.
enum TargetModel {
    Absent,
    Loading(std::sync::mpsc::Receiver<std::result::Result<Loaded, LoadError>>),
    Ready(Loaded),
}

/// The target on its engine: native, on its device (the GPU, or the CPU device when the
/// worker has none; the host copy of the weights is dropped once they are on the device),
/// or torch, a Python child ([`crate::torch_engine`]).
enum Loaded {
    Native(Box<DeviceTarget>),
    Torch(Box<TorchTarget>),
}

/// The torch engine's child and what the worker needs of the capture.
struct TorchTarget {
    child: TorchChild,
    taps: Vec<usize>,
    hidden: usize,
}

/// Why the target could not be loaded; `permanent`: restarting cannot help (no usable
/// GPU), so the worker exits with [`exit_codes::WORKER_PERMANENT`]; `model`: the model
/// directory itself is bad (also permanent).
#[derive(Debug)]
pub struct LoadError {
    pub msg: String,
    pub permanent: bool,
    pub model: bool,
}

/// What a worker's plane holds for its role.
enum Side {
    /// A target: the model, and the hidden-state slots leased to it for its output.
    Target {
        model: TargetModel,
        leases: VecDeque<SlotRef>,
    },
    /// A drafter: its rank of the data-parallel group once the supervisor says train, and
    /// the batch ids this life has consumed (a second delivery of one is acknowledged
    /// without being used again).
    Drafter {
        rank: Option<Box<Rank>>,
        consumed: HashSet<u64>,
    },
}

pub struct Plane {
    gpu: Option<u32>,
    /// Declared (so dropped) before `pools`: a device target unpins the hidden pool's
    /// mapping when it is dropped, and a rank's device has it pinned too, which must end
    /// while the mapping exists.
    side: Side,
    pools: Option<Pools>,
    deliveries: VecDeque<Delivery>,
    /// When the last unit of work ended (the wait for the next one starts there).
    idle_since: std::time::Instant,
    pub stats: Stats,
    /// The unit of work being done, for the heartbeat thread.
    pub busy: Busy,
    /// Test-only: added to every drafter step or target batch (see
    /// [`crate::busy::TEST_STEP_DELAY_MS`] and [`crate::busy::TEST_BATCH_DELAY_MS`]).
    test_delay: Option<std::time::Duration>,
}

impl Plane {
    /// `gpu`: this worker's GPU index (None on CPU workers).
    pub fn new(role: Role, gpu: Option<u32>) -> Plane {
        let side = match role {
            Role::Target => Side::Target {
                model: TargetModel::Absent,
                leases: VecDeque::new(),
            },
            Role::Drafter => Side::Drafter {
                rank: None,
                consumed: HashSet::new(),
            },
        };
        Plane {
            gpu,
            side,
            pools: None,
            deliveries: VecDeque::new(),
            idle_since: std::time::Instant::now(),
            stats: Stats::default(),
            busy: Busy::default(),
            test_delay: match role {
                Role::Target => crate::busy::test_batch_delay(),
                Role::Drafter => crate::busy::test_step_delay(),
            },
        }
    }

    pub fn set_pools(&mut self, pools: Pools) -> Result<()> {
        if let Side::Target { model, .. } = &mut self.side {
            let dir = std::env::var_os(dflash_shared::env::TARGET_DIR)
                .map(std::path::PathBuf::from)
                .ok_or_else(|| {
                    WorkerError::Protocol(format!(
                        "{} is not set: which target model?",
                        dflash_shared::env::TARGET_DIR
                    ))
                })?;
            // Room on the device for as many tokens as a hidden-state slot holds (at least
            // the run's token budget): a whole batch's rows in one packed forward.
            let (capture, max_tokens, gpu) =
                (pools.capture.clone(), pools.max_row_tokens(), self.gpu);
            let pool = Some(std::path::PathBuf::from(format!(
                "/proc/{}/fd/{}",
                std::process::id(),
                pools.hidden_fd
            )));
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::Builder::new()
                .name("load-target".into())
                .spawn(move || {
                    let _ = tx.send(load_target(&dir, &capture, gpu, max_tokens, pool));
                })?;
            *model = TargetModel::Loading(rx);
        }
        self.pools = Some(pools);
        Ok(())
    }

    /// Pick up the target model once its loading thread is done.
    pub fn poll_model(&mut self) -> Result<Option<String>> {
        let Side::Target { model, .. } = &mut self.side else {
            return Ok(None);
        };
        if let TargetModel::Loading(rx) = model {
            match rx.try_recv() {
                Ok(Ok(loaded)) => {
                    let pools = self.pools.as_ref().ok_or_else(|| {
                        WorkerError::Protocol("the target loaded before the pools".into())
                    })?;
                    let msg = match loaded {
                        Loaded::Native(mut g) => {
                            let msg = native_loaded(&mut g, pools)?;
                            *model = TargetModel::Ready(Loaded::Native(g));
                            msg
                        }
                        Loaded::Torch(t) => {
                            let r = &t.child.ready;
                            let msg = format!(
                                "target loaded by the torch engine (transformers {}, torch {}, on {}, python pid {}): {} layers (running {}), hidden {}, taps {:?}",
                                r["transformers"].as_str().unwrap_or("?"),
                                r["torch"].as_str().unwrap_or("?"),
                                r["device"].as_str().unwrap_or("?"),
                                t.child.pid(),
                                r["num_hidden_layers"],
                                r["loaded_layers"],
                                t.hidden,
                                t.taps
                            );
                            *model = TargetModel::Ready(Loaded::Torch(t));
                            msg
                        }
                    };
                    return Ok(Some(msg));
                }
                Ok(Err(e)) if e.model => return Err(WorkerError::BadModel(e.msg)),
                Ok(Err(e)) if e.permanent => return Err(WorkerError::Permanent(e.msg)),
                Ok(Err(e)) => {
                    return Err(WorkerError::Invalid(format!(
                        "loading the target: {}",
                        e.msg
                    )))
                }
                Err(std::sync::mpsc::TryRecvError::Empty) => {}
                Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                    return Err(WorkerError::Invalid(
                        "the target loading thread died".into(),
                    ))
                }
            }
        }
        Ok(None)
    }

    pub fn deliver(&mut self, d: Delivery) {
        self.deliveries.push_back(d);
    }

    /// A hidden-state slot leased to a target for its output.
    pub fn lease(&mut self, slot: SlotRef) -> Result<()> {
        match &mut self.side {
            Side::Target { leases, .. } => {
                leases.push_back(slot);
                Ok(())
            }
            Side::Drafter { .. } => Err(WorkerError::Protocol(
                "an output slot leased to a drafter".into(),
            )),
        }
    }

    /// This drafter's rank, for an order that needs one (`what` names it in the error).
    pub fn rank(&mut self, what: &str) -> Result<&mut Rank> {
        match &mut self.side {
            Side::Drafter {
                rank: Some(rank), ..
            } => Ok(rank),
            Side::Drafter { rank: None, .. } => Err(WorkerError::Protocol(format!(
                "{what} before the training setup"
            ))),
            Side::Target { .. } => Err(WorkerError::Protocol(format!("{what} to a target"))),
        }
    }

    /// The rank, once this drafter trains.
    pub fn rank_if_training(&mut self) -> Option<&mut Rank> {
        match &mut self.side {
            Side::Drafter { rank, .. } => rank.as_deref_mut(),
            Side::Target { .. } => None,
        }
    }

    /// This drafter becomes `rank` of the group.
    pub fn join(&mut self, new: Rank) -> Result<()> {
        match &mut self.side {
            Side::Drafter { rank, .. } => {
                *rank = Some(Box::new(new));
                Ok(())
            }
            Side::Target { .. } => Err(WorkerError::Protocol(
                "a training setup sent to a target".into(),
            )),
        }
    }

    /// Is an all-reduce of this drafter's gradient in flight?
    pub fn reducing(&self) -> bool {
        matches!(&self.side, Side::Drafter { rank: Some(r), .. } if r.reducing())
    }

    /// [`Pools::max_row_tokens`], once the pools are known.
    /// The hidden-state pool's slots (where a drafter's batches are), once the pools are
    /// known.
    pub fn hidden_rows(&self) -> Result<(*mut u8, usize)> {
        Ok(self
            .pools
            .as_ref()
            .ok_or_else(|| WorkerError::Protocol("the training setup before the pools".into()))?
            .hidden
            .slots_mapping())
    }

    pub fn max_row_tokens(&self) -> Result<usize> {
        Ok(self
            .pools
            .as_ref()
            .ok_or_else(|| {
                WorkerError::Protocol("the training setup arrived before the pools".into())
            })?
            .max_row_tokens())
    }

    /// Device memory of a target computing on a device.
    pub fn device_memory(&self) -> Option<dflash_shared::protocol::DeviceMemory> {
        match &self.side {
            Side::Target {
                model: TargetModel::Ready(Loaded::Native(g)),
                ..
            } => g.device_memory(),
            _ => None,
        }
    }

    /// Is the target model still being loaded?
    pub fn loading(&self) -> bool {
        matches!(
            self.side,
            Side::Target {
                model: TargetModel::Loading(_),
                ..
            }
        )
    }

    /// Is there a unit of work that can be done without waiting?
    pub fn ready(&self) -> bool {
        self.pools.is_some()
            && !self.deliveries.is_empty()
            && match &self.side {
                // A held-out eval batch is scored forward only, even while the rank holds
                // the next step's gradient (the supervisor commits no step before an eval
                // round is complete, so it is scored at the eval step's weights).
                Side::Drafter { rank, .. } => rank.as_ref().is_some_and(|r| {
                    r.takes_batches() || self.deliveries.iter().any(|d| is_eval_batch(d.batch_id))
                }),
                Side::Target { model, leases } => {
                    !leases.is_empty() && matches!(model, TargetModel::Ready(_))
                }
            }
    }

    /// Do one unit of work; returns the message that reports it.
    pub fn step(&mut self) -> Result<FromWorker> {
        let started = std::time::Instant::now();
        let wait_ms = started.duration_since(self.idle_since).as_secs_f64() * 1e3;
        let r = self.work();
        self.idle_since = std::time::Instant::now();
        match r? {
            FromWorker::Commit {
                output,
                len,
                batch_id,
                input,
                ..
            } => Ok(FromWorker::Commit {
                output,
                len,
                batch_id,
                input,
                wait_ms,
                compute_ms: started.elapsed().as_secs_f64() * 1e3,
            }),
            other => Ok(other),
        }
    }

    fn work(&mut self) -> Result<FromWorker> {
        // A drafter's eval batches go first: they do not wait for the next commit.
        let eval = match self.side {
            Side::Drafter { .. } => self
                .deliveries
                .iter()
                .position(|d| is_eval_batch(d.batch_id)),
            Side::Target { .. } => None,
        };
        let d = match eval {
            Some(i) => self.deliveries.remove(i),
            None => self.deliveries.pop_front(),
        }
        .ok_or_else(|| WorkerError::Protocol("no delivery".into()))?;
        let pools = self
            .pools
            .as_ref()
            .ok_or_else(|| WorkerError::Protocol("a batch arrived before the pools".into()))?;
        let map = pools.map(d.slot.pool);
        check_header(map, &d)?;
        // sync point (pool edge 2/3): the Deliver that queued `d` was received after the
        // writer's Commit reached the supervisor, which came after the writer's last write.
        // SAFETY: the supervisor delivered this slot to us (READING, checked above) and
        // writes it again only after our ack or our death.
        let payload = unsafe { &map.payload(d.slot.slot)[..d.len as usize] };
        let at = At {
            pools,
            busy: &self.busy,
            stats: &mut self.stats,
        };
        match &mut self.side {
            Side::Target { model, leases } => {
                let out = leases
                    .pop_front()
                    .ok_or_else(|| WorkerError::Protocol("no output lease".into()))?;
                let TargetModel::Ready(g) = model else {
                    return Err(WorkerError::Protocol(
                        "a batch to run before the target is loaded".into(),
                    ));
                };
                run_target(at, g, (&d, payload, out), self.test_delay)
            }
            Side::Drafter { rank, consumed } => {
                let view = HiddenView::parse(payload).map_err(WorkerError::format(format!(
                    "hidden-state batch {}",
                    d.batch_id
                )))?;
                check_view(&view, pools, &d)?;
                let rank = rank.as_deref_mut().ok_or_else(|| {
                    WorkerError::Protocol("a batch before the training setup".into())
                })?;
                if is_eval_batch(d.batch_id) {
                    return eval_drafter(at, rank, &view, &d);
                }
                if !consumed.insert(d.batch_id) {
                    at.stats.duplicates += 1;
                    println!("batch {} delivered twice: dropped the copy", d.batch_id);
                    // sync point (pool edge 4): sent after our last read of the slot.
                    return Ok(FromWorker::Ack {
                        input: d.slot,
                        batch_id: d.batch_id,
                    });
                }
                train_drafter(at, rank, &view, &d, self.test_delay)
            }
        }
    }
}

/// What a unit of work reads and counts beside its role's own state.
struct At<'a> {
    pools: &'a Pools,
    busy: &'a Busy,
    stats: &'a mut Stats,
}

/// The native target is on its device: pin the hidden pool for its copies, and say so.
fn native_loaded(g: &mut DeviceTarget, pools: &Pools) -> Result<String> {
    let (cfg, taps) = (&g.cfg, &g.taps);
    let mut msg = format!(
        "target loaded: {}, {} layers (running {}), hidden {}, taps {:?}",
        cfg.arch,
        cfg.num_hidden_layers,
        taps.iter().max().map_or(0, |m| m + 1),
        cfg.hidden_size,
        taps
    );
    let (ptr, len) = pools.hidden.slots_mapping();
    // SAFETY: the hidden pool stays mapped as long as the plane's pools, which are dropped
    // after the target (field order in Plane).
    unsafe { g.register_host(ptr, len) }
        .map_err(WorkerError::device("pinning the hidden-state pool"))?;
    let st = g.arena_stats();
    let mem = if g.device_memory().is_some() {
        "device memory"
    } else {
        "host memory"
    };
    msg.push_str(&format!(
        "; computing on {} ({:.1} MiB of {mem}, room for {} tokens a forward)",
        g.describe(),
        st.reserved as f64 / (1 << 20) as f64,
        g.max_tokens
    ));
    Ok(msg)
}

/// The target's unit of work: batch `d` (its token `payload`) through the model, its taps
/// into the leased hidden-state slot `out`.
fn run_target(
    at: At<'_>,
    g: &mut Loaded,
    (d, payload, out): (&Delivery, &[u8], SlotRef),
    test_delay: Option<std::time::Duration>,
) -> Result<FromWorker> {
    let _busy = at.busy.enter(Work::Batch {
        batch_id: d.batch_id,
    });
    if let Some(delay) = test_delay {
        std::thread::sleep(delay);
    }
    let tokens = TokenBatch::decode(payload)
        .map_err(WorkerError::format(format!("token batch {}", d.batch_id)))?;
    if tokens.batch_id != d.batch_id {
        return Err(WorkerError::Protocol(format!(
            "slot {} holds batch {}, expected {}",
            d.slot.slot, tokens.batch_id, d.batch_id
        )));
    }
    let hidden_pool = &at.pools.hidden;
    check_header(
        hidden_pool,
        &Delivery {
            slot: out,
            len: 0,
            batch_id: 0,
        },
    )?;
    // SAFETY: the supervisor leased this slot to us (WRITING, checked above); nobody
    // reads it before our commit.
    let buf = unsafe { hidden_pool.payload_mut(out.slot) };
    let layout = write_hidden_header(buf, &at.pools.capture, &tokens).map_err(
        WorkerError::format(format!("hidden-state batch {} header", d.batch_id)),
    )?;
    let hidden = &mut buf[layout.hidden_offset..][..layout.hidden_len];
    match g {
        Loaded::Native(g) => {
            if let Err(e) = write_hidden_states_gpu(g, &tokens, hidden) {
                // No copy may still be landing in the slot when we give it up.
                let _ = g.sync();
                return Err(WorkerError::device(format!(
                    "target forward on {}",
                    g.describe()
                ))(e));
            }
        }
        Loaded::Torch(t) => {
            let at_slot =
                hidden_pool.geometry().slot_offset(out.slot) + layout.hidden_offset as u64;
            write_hidden_states_torch(t, &tokens, hidden, at_slot, d.batch_id)?;
        }
    }
    let len = seal_hidden(buf, &layout) as u64;
    at.stats.batches += 1;
    at.stats.tokens += tokens.tokens();
    // sync point (pool edges 3 and 4): the caller sends this Commit after every write to
    // the output slot (on a GPU, after the event behind the last copy) and after the last
    // read of the input slot, which it releases.
    Ok(FromWorker::Commit {
        output: out,
        len,
        batch_id: d.batch_id,
        input: Some(d.slot),
        wait_ms: 0.0,
        compute_ms: 0.0,
    })
}

/// A hidden-state batch must be of this run's capture and the batch the slot was
/// delivered as.
fn check_view(view: &HiddenView, pools: &Pools, d: &Delivery) -> Result<()> {
    if view.spec != pools.capture {
        return Err(WorkerError::Invalid(format!(
            "hidden-state batch {} was captured as {}, but this run trains on {}: refusing to train on the wrong layers",
            d.batch_id, view.spec, pools.capture
        )));
    }
    if view.tokens.batch_id != d.batch_id {
        return Err(WorkerError::Protocol(format!(
            "slot {} holds batch {}, expected {}",
            d.slot.slot, view.tokens.batch_id, d.batch_id
        )));
    }
    Ok(())
}

/// A drafter scores held-out batch `d` at its current weights.
fn eval_drafter(
    at: At<'_>,
    rank: &mut Rank,
    view: &HiddenView,
    d: &Delivery,
) -> Result<FromWorker> {
    let (_, index) = eval_batch_parts(d.batch_id);
    let _busy = at.busy.enter(Work::Eval {
        step: rank.step,
        batch_id: d.batch_id,
    });
    let stats = rank.evaluate(view, index)?;
    // sync point (pool edge 4): sent after our last read of the slot.
    Ok(FromWorker::Evaluated {
        input: d.slot,
        batch_id: d.batch_id,
        step: rank.step,
        stats,
    })
}

/// A drafter computes the gradient of batch `d` for its next step.
fn train_drafter(
    at: At<'_>,
    rank: &mut Rank,
    view: &HiddenView,
    d: &Delivery,
    test_step_delay: Option<std::time::Duration>,
) -> Result<FromWorker> {
    let _busy = at.busy.enter(Work::Step {
        step: rank.step + 1,
        batch_id: d.batch_id,
    });
    if let Some(delay) = test_step_delay {
        std::thread::sleep(delay);
    }
    let stats = rank.compute(view)?;
    // The weights the batch was computed with: their checksum was queued when they last
    // changed, ahead of this batch's work, so reading it now waits for nothing.
    let params = rank.params_checksum()?;
    at.stats.batches += 1;
    at.stats.tokens += view.tokens.tokens();
    // sync point (pool edges 4 and 5): the caller sends this after our last read of the
    // hidden-state slot and our last write to our gradient slot.
    Ok(FromWorker::Grads {
        step: rank.step + 1,
        input: d.slot,
        batch_id: d.batch_id,
        stats,
        params,
    })
}

/// Load the target on `gpu` (the CPU device without one), checked against the capture
/// the supervisor described, with room for `max_tokens` tokens a forward.
/// Which engine runs the target (`DFLASH_TARGET_ENGINE`, set by the supervisor).
fn torch_engine() -> bool {
    std::env::var(dflash_shared::env::TARGET_ENGINE).is_ok_and(|e| e == "torch")
}

/// The target on its engine; the torch engine's child writes into the hidden pool, `pool`
/// (its memfd as a path).
fn load_target(
    dir: &std::path::Path,
    capture: &CaptureSpec,
    gpu: Option<u32>,
    max_tokens: usize,
    pool: Option<std::path::PathBuf>,
) -> std::result::Result<Loaded, LoadError> {
    let Some(pool) = pool.filter(|_| torch_engine()) else {
        return load_native(dir, capture, gpu, max_tokens).map(Loaded::Native);
    };
    let taps: Vec<usize> = capture.tap_ids.iter().map(|&t| t as usize).collect();
    let bad = |msg: String| LoadError {
        msg,
        permanent: true,
        model: false,
    };
    let child = TorchChild::start(
        dir,
        &taps,
        crate::torch_engine::Mode::Taps { pool: &pool },
        // Every GPU the supervisor gave this worker (--gpus-per-target).
        if gpu.is_some() {
            crate::torch_engine::visible_gpus().max(1)
        } else {
            0
        },
    )
    .map_err(|e| bad(e.to_string()))?;
    let hidden = child.ready["hidden_size"].as_u64().unwrap_or(0) as usize;
    if hidden != capture.hidden as usize {
        return Err(bad(format!(
            "torch engine: the target at {} has hidden size {hidden}, but the supervisor described {} (was config.json changed?)",
            dir.display(),
            capture.hidden
        )));
    }
    Ok(Loaded::Torch(Box::new(TorchTarget {
        child,
        taps,
        hidden,
    })))
}

fn load_native(
    dir: &std::path::Path,
    capture: &CaptureSpec,
    gpu: Option<u32>,
    max_tokens: usize,
) -> std::result::Result<Box<DeviceTarget>, LoadError> {
    let taps: Vec<usize> = capture.tap_ids.iter().map(|&t| t as usize).collect();
    let fail = |msg: String| LoadError {
        msg,
        permanent: false,
        model: false,
    };
    let bad_model = |msg: String| LoadError {
        msg,
        permanent: true,
        model: true,
    };
    let unavailable = |e: GpuError| LoadError {
        msg: e.to_string(),
        permanent: true,
        model: false,
    };
    // The device first: a GPU reads the weights as bf16 straight from the checkpoint's
    // mapping, the CPU device computes with an f32 copy.
    let dev = match device::open_device(gpu) {
        Ok(d) => d,
        Err(e @ GpuError::Unavailable(_)) => return Err(unavailable(e)),
        Err(e) => return Err(fail(e.to_string())),
    };
    let how = if dev.is_some() {
        Load::Mapped
    } else {
        Load::F32
    };
    let t = Target::load_as(dir, &taps, how).map_err(|e| bad_model(e.to_string()))?;
    if t.cfg.fingerprint() != capture.target || t.cfg.hidden_size != capture.hidden as usize {
        return Err(bad_model(format!(
            "the target at {} is not the model the supervisor described (was config.json changed?)",
            dir.display()
        )));
    }
    match dev {
        // No GPU: the same device target, on the CPU device (f32).
        None => {
            let cpu = device::cpu::CpuDevice::open().map_err(|e| LoadError {
                msg: e.to_string(),
                permanent: true,
                model: false,
            })?;
            DeviceTarget::new(Box::new(cpu), &t, max_tokens)
                .map(Box::new)
                .map_err(|e| fail(format!("putting the target on the CPU device: {e}")))
        }
        Some(dev) => match split_over_gpus(dev, t, max_tokens) {
            Ok(g) => Ok(Box::new(g)),
            Err(e @ GpuError::Unavailable(_)) => Err(unavailable(e)),
            Err(e) => Err(fail(format!("putting the target on the device: {e}"))),
        },
    }
}

/// `t` on `dev` and, for a target worker that holds several GPUs (`--gpus-per-target`:
/// `CUDA_VISIBLE_DEVICES` names them all), on the others too, its layers in contiguous
/// ranges over them.
fn split_over_gpus(
    dev: Box<dyn device::Device>,
    t: Target,
    max_tokens: usize,
) -> std::result::Result<DeviceTarget, GpuError> {
    let n = crate::torch_engine::visible_gpus();
    if n <= 1 {
        return DeviceTarget::new(dev, &t, max_tokens);
    }
    let mut devs = vec![dev];
    for g in 1..n {
        devs.push(device::open_gpu(g)?);
    }
    let g = DeviceTarget::new_split(devs, t, max_tokens)?;
    let ranges: Vec<String> = g
        .layer_ranges()
        .iter()
        .enumerate()
        .map(|(d, r)| format!("GPU {d}: layers {}-{}", r.start, r.end - 1))
        .collect();
    println!(
        "target split over {} GPUs: {}",
        ranges.len(),
        ranges.join(", ")
    );
    Ok(g)
}

/// The slot header, written by the supervisor before it told us, must agree with the
/// message: anything else is a supervisor bug or a stale message, and using the slot
/// would read someone else's batch.
fn check_header(map: &PoolMap, d: &Delivery) -> Result<()> {
    if d.slot.slot >= map.geometry().slots {
        return Err(WorkerError::Protocol(format!(
            "slot {} out of range",
            d.slot.slot
        )));
    }
    let h = map.header(d.slot.slot);
    // sync point (header): pairs with the Release store in PoolMap::publish, so gen, len
    // and batch_id below are the ones stored with this state.
    let state = h.state.load(Ordering::Acquire);
    let gen = h.gen.load(Ordering::Relaxed);
    let expected = if d.len == 0 {
        SlotState::Writing
    } else {
        SlotState::Reading
    };
    if state != expected as u32 || gen != d.slot.gen {
        return Err(WorkerError::Protocol(format!(
            "slot {} header says state {state} gen {gen}, expected state {} ({expected}) gen {}",
            d.slot.slot, expected as u32, d.slot.gen
        )));
    }
    if d.len > 0 {
        let (len, batch) = (
            h.len.load(Ordering::Relaxed),
            h.batch_id.load(Ordering::Relaxed),
        );
        if len != d.len || batch != d.batch_id || len > map.geometry().slot_bytes {
            return Err(WorkerError::Protocol(format!(
                "slot {} header says batch {batch} of {len} bytes, expected batch {} of {}",
                d.slot.slot, d.batch_id, d.len
            )));
        }
    }
    Ok(())
}

/// The torch engine's child writes each row's taps (bf16) at its place in the slot's hidden
/// states, `at` bytes into the pool's memfd (padding positions are zeroed here first).
fn write_hidden_states_torch(
    t: &mut TorchTarget,
    tokens: &TokenBatch,
    out: &mut [u8],
    at: u64,
    batch_id: u64,
) -> Result<()> {
    let width = (t.taps.len() * t.hidden) as u64;
    let seq = tokens.seq_len as usize;
    out.fill(0);
    let rows: Vec<(&[u32], u64)> = tokens
        .lengths
        .iter()
        .enumerate()
        .map(|(r, &len)| {
            let start = r * seq;
            (
                &tokens.input_ids[start..start + len as usize],
                at + start as u64 * width * 2,
            )
        })
        .collect();
    t.child.run(batch_id, &rows, false)?;
    Ok(())
}

/// Run the target over the batch's rows and store their tapped hidden states as bf16,
/// row-major `[rows × seq_len, taps × hidden]` (padding positions zero): the rows packed
/// into as few forwards as the target's `max_tokens` allows (one for a batch of the run's
/// token budget), each forward's taps cast to bf16 on the device and each row's copied
/// straight into its place in the (pinned) slot on the copy stream while the next forward
/// computes; the slot is sealed only after the event behind the last copy.
fn write_hidden_states_gpu(
    g: &mut DeviceTarget,
    tokens: &TokenBatch,
    out: &mut [u8],
) -> device::Result<()> {
    let width = g.taps.len() * g.cfg.hidden_size;
    let seq = tokens.seq_len as usize;
    g.host_write(out.as_ptr(), out.len())?;
    out.fill(0);
    let mut rows: Vec<(&[u32], *mut u8)> = Vec::with_capacity(tokens.lengths.len());
    for (r, &len) in tokens.lengths.iter().enumerate() {
        let (at, len) = (r * seq, len as usize);
        let dst = out[at * width * 2..(at + len) * width * 2].as_mut_ptr();
        rows.push((&tokens.input_ids[at..at + len], dst));
    }
    // SAFETY: `out` is inside the registered hidden pool, each row's taps
    // (`len × width × 2` bytes) land in its own part of it, and nothing reads it before
    // `finish` below.
    if let Some(e) = unsafe { g.forward_rows_into(&rows)? } {
        g.finish(e, out.as_ptr(), out.len())?;
    }
    Ok(())
}
