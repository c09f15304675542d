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
use crate::device::{self, target::GpuTarget, GpuError};
use crate::model::target::{Load, Target};
use crate::train::Rank;

pub struct Pools {
    tokens: PoolMap,
    hidden: PoolMap,
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

/// The target, computing on the CPU backend or on a device.
/// The target on its device: the GPU, or the CPU device when the worker has none (the
/// host copy of the weights is dropped once they are on the device).
type Loaded = Box<GpuTarget>;

/// Why the target could not be loaded; `permanent`: restarting cannot help (no usable
/// GPU), so the worker exits with [`exit_codes::WORKER_PERMANENT`]; `model`: the model
/// directory itself is bad (also permanent).
#[derive(Debug)]
pub struct LoadError {
    pub msg: String,
    pub permanent: bool,
    pub model: bool,
}

pub struct Plane {
    role: Role,
    gpu: Option<u32>,
    /// Declared (so dropped) before `pools`: a device target unpins the hidden pool's
    /// mapping when it is dropped, which must happen while the mapping exists.
    target: TargetModel,
    /// Drafters: this rank of the data-parallel group, once the supervisor says train.
    /// Declared before `pools` too: its device has the hidden pool's mapping pinned.
    pub rank: Option<Rank>,
    pools: Option<Pools>,
    deliveries: VecDeque<Delivery>,
    leases: VecDeque<SlotRef>,
    /// Batch ids this life has consumed: a second delivery of one is acknowledged
    /// without being used again.
    consumed: HashSet<u64>,
    /// When the last unit of work ended (the wait for the next one starts there).
    idle_since: std::time::Instant,
    pub stats: Stats,
    /// The unit of work being done, for the heartbeat thread.
    pub busy: Busy,
    /// Test-only: added to every drafter step (see [`crate::busy::TEST_STEP_DELAY_MS`]).
    test_step_delay: Option<std::time::Duration>,
}

impl Plane {
    /// `gpu`: this worker's GPU index (None on CPU workers).
    pub fn new(role: Role, gpu: Option<u32>) -> Plane {
        Plane {
            role,
            gpu,
            pools: None,
            target: TargetModel::Absent,
            rank: None,
            deliveries: VecDeque::new(),
            leases: VecDeque::new(),
            consumed: HashSet::new(),
            idle_since: std::time::Instant::now(),
            stats: Stats::default(),
            busy: Busy::default(),
            test_step_delay: crate::busy::test_step_delay(),
        }
    }

    pub fn set_pools(&mut self, pools: Pools) -> Result<()> {
        if self.role == Role::Target {
            let dir = std::env::var_os(dflash_shared::env::TARGET_DIR)
                .map(std::path::PathBuf::from)
                .ok_or_else(|| {
                    WorkerError::Protocol(format!(
                        "{} is not set: which target model?",
                        dflash_shared::env::TARGET_DIR
                    ))
                })?;
            let capture = pools.capture.clone();
            // Room on the device for the longest row a hidden-state slot can hold.
            let max_tokens = pools.max_row_tokens();
            let gpu = self.gpu;
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::Builder::new().name("load-target".into()).spawn(move || {
                let taps: Vec<usize> = capture.tap_ids.iter().map(|&t| t as usize).collect();
                let fail = |msg: String| LoadError { msg, permanent: false, model: false };
                let bad_model = |msg: String| LoadError { msg, permanent: true, model: true };
                // The device first: a GPU reads the weights as bf16 straight from the
                // checkpoint's mapping, the CPU device computes with an f32 copy.
                let dev = match device::open_device(gpu) {
                    Ok(d) => d,
                    Err(e @ GpuError::Unavailable(_)) => {
                        let _ = tx.send(Err(LoadError { msg: e.to_string(), permanent: true, model: false }));
                        return;
                    }
                    Err(e) => {
                        let _ = tx.send(Err(fail(e.to_string())));
                        return;
                    }
                };
                let how = if dev.is_some() { Load::Mapped } else { Load::F32 };
                let r = Target::load_as(&dir, &taps, how).map_err(|e| bad_model(e.to_string())).and_then(|t| {
                    if t.cfg.fingerprint() != capture.target || t.cfg.hidden_size != capture.hidden as usize {
                        return Err(bad_model(format!("the target at {} is not the model the supervisor described (was config.json changed?)", dir.display())));
                    }
                    match dev {
                        // No GPU: the same device target, on the CPU device (f32).
                        None => match GpuTarget::new(Box::new(device::cpu::CpuDevice::new()), &t, max_tokens) {
                            Ok(g) => Ok(Box::new(g)),
                            Err(e) => Err(fail(format!("putting the target on the CPU device: {e}"))),
                        },
                        Some(dev) => match GpuTarget::new(dev, &t, max_tokens) {
                            Ok(g) => Ok(Box::new(g)),
                            Err(e @ GpuError::Unavailable(_)) => Err(LoadError { msg: e.to_string(), permanent: true, model: false }),
                            Err(e) => Err(fail(format!("putting the target on the device: {e}"))),
                        },
                    }
                });
                let _ = tx.send(r);
            })?;
            self.target = TargetModel::Loading(rx);
        }
        self.pools = Some(pools);
        Ok(())
    }

    /// Pick up the target model once its loading thread is done.
    pub fn poll_model(&mut self) -> Result<Option<String>> {
        if let TargetModel::Loading(rx) = &self.target {
            match rx.try_recv() {
                Ok(Ok(mut g)) => {
                    let (cfg, taps) = (&g.cfg, &g.taps);
                    let mut msg = format!(
                        "target loaded: {}, {} layers (running {}), hidden {}, taps {:?}",
                        cfg.arch,
                        cfg.num_hidden_layers,
                        taps.iter().max().map_or(0, |m| m + 1),
                        cfg.hidden_size,
                        taps
                    );
                    let pools = self.pools.as_ref().ok_or_else(|| {
                        WorkerError::Protocol("the target loaded before the pools".into())
                    })?;
                    let (ptr, len) = pools.hidden.slots_mapping();
                    // SAFETY: the hidden pool stays mapped as long as `self.pools`, which is
                    // dropped after the target (field order in Plane).
                    unsafe { g.register_host(ptr, len) }
                        .map_err(WorkerError::device("pinning the hidden-state pool"))?;
                    let st = g.arena_stats();
                    let mem = if g.device_memory().is_some() {
                        "device memory"
                    } else {
                        "host memory"
                    };
                    msg.push_str(&format!(
                        "; computing on {} ({:.1} MiB of {mem}, room for {} tokens a row)",
                        g.describe(),
                        st.reserved as f64 / (1 << 20) as f64,
                        g.max_tokens
                    ));
                    self.target = TargetModel::Ready(g);
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

    pub fn lease(&mut self, slot: SlotRef) {
        self.leases.push_back(slot);
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
        match &self.target {
            TargetModel::Ready(g) => g.device_memory(),
            _ => None,
        }
    }

    /// Is the target model still being loaded?
    pub fn loading(&self) -> bool {
        matches!(self.target, TargetModel::Loading(_))
    }

    /// Is there a unit of work that can be done without waiting?
    pub fn ready(&self) -> bool {
        self.pools.is_some()
            && !self.deliveries.is_empty()
            && match self.role {
                // A held-out eval batch is scored forward only, even while the rank holds
                // the next step's gradient (the supervisor commits no step before an eval
                // round is complete, so it is scored at the eval step's weights).
                Role::Drafter => self.rank.as_ref().is_some_and(|r| {
                    !r.awaiting || self.deliveries.iter().any(|d| is_eval_batch(d.batch_id))
                }),
                Role::Target => {
                    !self.leases.is_empty() && matches!(self.target, TargetModel::Ready(_))
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
        let eval = match self.role {
            Role::Drafter => self
                .deliveries
                .iter()
                .position(|d| is_eval_batch(d.batch_id)),
            Role::Target => None,
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
        match self.role {
            Role::Target => {
                let _busy = self.busy.enter(Work::Batch {
                    batch_id: d.batch_id,
                });
                let out = self
                    .leases
                    .pop_front()
                    .ok_or_else(|| WorkerError::Protocol("no output lease".into()))?;
                let tokens = TokenBatch::decode(payload)
                    .map_err(WorkerError::format(format!("token batch {}", d.batch_id)))?;
                if tokens.batch_id != d.batch_id {
                    return Err(WorkerError::Protocol(format!(
                        "slot {} holds batch {}, expected {}",
                        d.slot.slot, tokens.batch_id, d.batch_id
                    )));
                }
                check_header(
                    &pools.hidden,
                    &Delivery {
                        slot: out,
                        len: 0,
                        batch_id: 0,
                    },
                )?;
                // SAFETY: the supervisor leased this slot to us (WRITING, checked above);
                // nobody reads it before our commit.
                let buf = unsafe { pools.hidden.payload_mut(out.slot) };
                let layout = write_hidden_header(buf, &pools.capture, &tokens).map_err(
                    WorkerError::format(format!("hidden-state batch {} header", d.batch_id)),
                )?;
                let TargetModel::Ready(g) = &mut self.target else {
                    return Err(WorkerError::Protocol(
                        "a batch to run before the target is loaded".into(),
                    ));
                };
                let hidden = &mut buf[layout.hidden_offset..][..layout.hidden_len];
                if let Err(e) = write_hidden_states_gpu(g, &tokens, hidden) {
                    // No copy may still be landing in the slot when we give it up.
                    let _ = g.sync();
                    return Err(WorkerError::device(format!(
                        "target forward on {}",
                        g.describe()
                    ))(e));
                }
                let len = seal_hidden(buf, &layout) as u64;
                self.stats.batches += 1;
                self.stats.tokens += tokens.tokens();
                // sync point (pool edges 3 and 4): the caller sends this Commit after every
                // write to the output slot (on a GPU, after the event behind the last copy)
                // and after the last read of the input slot, which it releases.
                Ok(FromWorker::Commit {
                    output: out,
                    len,
                    batch_id: d.batch_id,
                    input: Some(d.slot),
                    wait_ms: 0.0,
                    compute_ms: 0.0,
                })
            }
            Role::Drafter => {
                let view = HiddenView::parse(payload).map_err(WorkerError::format(format!(
                    "hidden-state batch {}",
                    d.batch_id
                )))?;
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
                if is_eval_batch(d.batch_id) {
                    let rank = self.rank.as_mut().ok_or_else(|| {
                        WorkerError::Protocol("an eval batch before the training setup".into())
                    })?;
                    let (_, index) = eval_batch_parts(d.batch_id);
                    let _busy = self.busy.enter(Work::Eval {
                        step: rank.step,
                        batch_id: d.batch_id,
                    });
                    let stats = rank.evaluate(&view, index)?;
                    // sync point (pool edge 4): sent after our last read of the slot.
                    return Ok(FromWorker::Evaluated {
                        input: d.slot,
                        batch_id: d.batch_id,
                        step: rank.step,
                        stats,
                    });
                }
                if !self.consumed.insert(d.batch_id) {
                    self.stats.duplicates += 1;
                    println!("batch {} delivered twice: dropped the copy", d.batch_id);
                    // sync point (pool edge 4): sent after our last read of the slot.
                    return Ok(FromWorker::Ack {
                        input: d.slot,
                        batch_id: d.batch_id,
                    });
                }
                let rank = self.rank.as_mut().ok_or_else(|| {
                    WorkerError::Protocol("a batch to train before the training setup".into())
                })?;
                let _busy = self.busy.enter(Work::Step {
                    step: rank.step + 1,
                    batch_id: d.batch_id,
                });
                if let Some(delay) = self.test_step_delay {
                    std::thread::sleep(delay);
                }
                let params = rank.params_checksum()?;
                let stats = rank.compute(&view)?;
                self.stats.batches += 1;
                self.stats.tokens += view.tokens.tokens();
                // sync point (pool edges 4 and 5): the caller sends this after our last read
                // of the hidden-state slot and our last write to our gradient slot.
                Ok(FromWorker::Grads {
                    step: rank.step + 1,
                    input: d.slot,
                    batch_id: d.batch_id,
                    stats,
                    params,
                })
            }
        }
    }
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

/// Run the target over each row and store its tapped hidden states as bf16, row-major
/// `[rows × seq_len, taps × hidden]` (padding positions zero): each row's taps are cast to bf16 on
/// the device and copied straight into the (pinned) slot on the copy stream while the
/// next row computes; the slot is sealed only after the event behind the last copy.
fn write_hidden_states_gpu(
    g: &mut GpuTarget,
    tokens: &TokenBatch,
    out: &mut [u8],
) -> device::Result<()> {
    let width = g.taps.len() * g.cfg.hidden_size;
    let seq = tokens.seq_len as usize;
    g.host_write(out.as_ptr(), out.len())?;
    out.fill(0);
    let mut last = None;
    for (r, &len) in tokens.lengths.iter().enumerate() {
        let ids = &tokens.input_ids[r * seq..r * seq + len as usize];
        let dst = out[r * seq * width * 2..(r * seq + len as usize) * width * 2].as_mut_ptr();
        // SAFETY: `out` is inside the registered hidden pool, and nothing reads it before
        // `finish` below.
        if let Some(e) = unsafe { g.forward_taps_into(ids, dst)? } {
            last = Some(e);
        }
    }
    if let Some(e) = last {
        g.finish(e, out.as_ptr(), out.len())?;
    }
    Ok(())
}
