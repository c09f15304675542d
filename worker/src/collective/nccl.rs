//! The NCCL collective: GPU ranks all-reduce their gradients on the GPUs, device buffer to
//! device buffer, bucket by bucket on the copy stream, each bucket behind the event the
//! backward recorded once it had finished it (so the all-reduce of the last layers runs
//! while the backward of the first ones does, as DDP overlaps them), and the optimizer
//! behind the last bucket's reduction: ordered by events, with no host sync.
//!
//! NCCL is loaded at run time as every CUDA library is ([`crate::device::libs`]): from the
//! first of `DFLASH_NCCL_LIB`, the loader's path (`libnccl.so.2`, `libnccl.so`), and the
//! `nvidia/nccl/lib` directory of the Python installations on the machine (PyPI's
//! `nvidia-nccl-cu13`, which PyTorch installs too). cudarc's own NCCL loader only tries names like `libnccl.so` and
//! `libnccl.so.13`, never NCCL 2's soname `libnccl.so.2`, so a machine with NCCL from PyPI
//! or a runtime-only package would not be found by it; the few entry points this needs
//! are bound here instead.
//!
//! The unique id of each epoch is created by the epoch's first rank and relayed by the
//! supervisor (which loads no CUDA library). Communicators are created on a helper thread
//! (`ncclCommInitRank` blocks until every rank has joined), so the worker's loop keeps
//! beating and can move to a newer epoch while one is being built; a communicator of an
//! epoch that was superseded is aborted as soon as it exists. A new epoch aborts the old
//! communicator (`ncclCommAbort`), which also ends an all-reduce that waits for a rank
//! that died.

use std::ffi::{c_char, c_int, c_void};
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::OnceLock;
use std::time::Instant;

use dflash_shared::drafter::CollectiveKind;

use super::{Collective, Formed, Reduced, Sum};
use crate::device::grads::GradientBuckets;
use crate::device::libs::{self, CudaLib};
use crate::device::{DSlice, Event, Stream};
use crate::error::{Result, WorkerError};

type Comm = *mut c_void;
const ID_BYTES: usize = 128;
// From nccl.h: ncclResult_t, ncclDataType_t, ncclRedOp_t.
const SUCCESS: c_int = 0;
const IN_PROGRESS: c_int = 7;
const FLOAT32: c_int = 7;
const FLOAT64: c_int = 8;
const SUM: c_int = 0;

#[repr(C)]
#[derive(Clone, Copy)]
struct UniqueId {
    internal: [c_char; ID_BYTES],
}

/// `ncclConfig_t` as NCCL 2.18 laid it out. NCCL reads a config by the size and version it
/// carries and gives the fields after them their defaults, so a newer NCCL takes it too.
#[repr(C)]
struct Config {
    size: usize,
    magic: u32,
    version: u32,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
    split_share: c_int,
}

impl Config {
    /// NCCL_CONFIG_INITIALIZER of 2.18 with `blocking = 0`.
    fn non_blocking() -> Config {
        const UNDEF: c_int = c_int::MIN;
        Config {
            size: std::mem::size_of::<Config>(),
            magic: 0xcafe_beef,
            version: 21800,
            blocking: 0,
            cga_cluster_size: UNDEF,
            min_ctas: UNDEF,
            max_ctas: UNDEF,
            net_name: std::ptr::null(),
            split_share: UNDEF,
        }
    }
}

type InitConfig = unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int, *const Config) -> c_int;

const INVALID_ARGUMENT: c_int = 4;

/// The entry points of libnccl this uses.
pub struct Lib {
    pub path: PathBuf,
    get_version: unsafe extern "C" fn(*mut c_int) -> c_int,
    get_unique_id: unsafe extern "C" fn(*mut UniqueId) -> c_int,
    comm_init_rank: unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> c_int,
    /// `ncclCommInitRankConfig` (NCCL 2.14+): a non-blocking init that can be aborted.
    comm_init_rank_config: Option<InitConfig>,
    all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        Comm,
        *mut c_void,
    ) -> c_int,
    comm_abort: unsafe extern "C" fn(Comm) -> c_int,
    comm_get_async_error: unsafe extern "C" fn(Comm, *mut c_int) -> c_int,
    get_error_string: unsafe extern "C" fn(c_int) -> *const c_char,
}

/// Why NCCL cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NcclUnusable {
    /// Not found where CUDA libraries are looked for (the paths tried are in the message).
    #[error("{0} (--collective shm exchanges gradients through host memory instead)")]
    NotFound(libs::NotFound),
    #[error("{} is not a usable NCCL: it lacks {symbol}", path.display())]
    MissingSymbol { path: PathBuf, symbol: String },
}

/// Load NCCL (once per process), as every CUDA library is found ([`crate::device::libs`]),
/// or say which paths were tried.
pub fn load() -> std::result::Result<&'static Lib, NcclUnusable> {
    static LIB: OnceLock<std::result::Result<Lib, NcclUnusable>> = OnceLock::new();
    LIB.get_or_init(|| {
        let loaded = libs::open(CudaLib::Nccl).map_err(NcclUnusable::NotFound)?;
        let sym = |name: &str| {
            loaded
                .symbol(name)
                .ok_or_else(|| NcclUnusable::MissingSymbol {
                    path: loaded.path.clone(),
                    symbol: name.to_string(),
                })
        };
        // SAFETY: the symbols have these C signatures in every NCCL 2 (nccl.h).
        unsafe {
            Ok(Lib {
                path: loaded.path.clone(),
                get_version: std::mem::transmute::<
                    *mut c_void,
                    unsafe extern "C" fn(*mut c_int) -> c_int,
                >(sym("ncclGetVersion")?),
                get_unique_id: std::mem::transmute::<
                    *mut c_void,
                    unsafe extern "C" fn(*mut UniqueId) -> c_int,
                >(sym("ncclGetUniqueId")?),
                comm_init_rank: std::mem::transmute::<
                    *mut c_void,
                    unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> c_int,
                >(sym("ncclCommInitRank")?),
                comm_init_rank_config: loaded
                    .symbol("ncclCommInitRankConfig")
                    .map(|f| std::mem::transmute::<*mut c_void, InitConfig>(f)),
                all_reduce: std::mem::transmute::<
                    *mut c_void,
                    unsafe extern "C" fn(
                        *const c_void,
                        *mut c_void,
                        usize,
                        c_int,
                        c_int,
                        Comm,
                        *mut c_void,
                    ) -> c_int,
                >(sym("ncclAllReduce")?),
                comm_abort: std::mem::transmute::<*mut c_void, unsafe extern "C" fn(Comm) -> c_int>(
                    sym("ncclCommAbort")?,
                ),
                comm_get_async_error: std::mem::transmute::<
                    *mut c_void,
                    unsafe extern "C" fn(Comm, *mut c_int) -> c_int,
                >(sym("ncclCommGetAsyncError")?),
                get_error_string: std::mem::transmute::<
                    *mut c_void,
                    unsafe extern "C" fn(c_int) -> *const c_char,
                >(sym("ncclGetErrorString")?),
            })
        }
    })
    .as_ref()
    .map_err(Clone::clone)
}

impl Lib {
    fn check(&self, what: &str, r: c_int) -> Result<()> {
        if r == SUCCESS {
            return Ok(());
        }
        // SAFETY: NCCL returns a static string for every result code.
        let msg = unsafe { std::ffi::CStr::from_ptr((self.get_error_string)(r)) }
            .to_string_lossy()
            .into_owned();
        Err(WorkerError::Device {
            what: what.into(),
            source: crate::device::GpuError::Failed {
                call: "NCCL".into(),
                error: format!("error {r}: {msg}"),
            },
        })
    }

    /// The result of a call on a non-blocking communicator: `ncclInProgress` means "still
    /// being queued", and no other call may come before it settles (NCCL's rule), so wait
    /// for the communicator's state to leave it (bounded: a queueing that takes a minute
    /// is an error, never a hang).
    ///
    /// # Safety
    /// `comm` is a live communicator of ours.
    unsafe fn settled(&self, comm: Comm, rc: c_int) -> c_int {
        if rc != IN_PROGRESS {
            return rc;
        }
        let deadline = Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let mut err: c_int = SUCCESS;
            let r = (self.comm_get_async_error)(comm, &mut err);
            if r != SUCCESS {
                return r;
            }
            if err != IN_PROGRESS {
                return err;
            }
            if Instant::now() > deadline {
                return IN_PROGRESS;
            }
            std::thread::yield_now();
        }
    }

    /// NCCL's version as (major, minor, patch).
    pub fn version(&self) -> Result<(u32, u32, u32)> {
        let mut v: c_int = 0;
        // SAFETY: writes one int.
        self.check("ncclGetVersion", unsafe { (self.get_version)(&mut v) })?;
        let v = v as u32;
        // NCCL_VERSION(X,Y,Z): X*10000 + Y*100 + Z since 2.9, X*1000 + Y*100 + Z before.
        Ok(if v >= 10000 {
            (v / 10000, v % 10000 / 100, v % 100)
        } else {
            (v / 1000, v % 1000 / 100, v % 100)
        })
    }

    /// A new unique id for a communicator (the first rank of an epoch makes it). Needs no
    /// GPU: it names the first rank's bootstrap socket.
    pub fn unique_id(&self) -> Result<Vec<u8>> {
        let mut id = UniqueId {
            internal: [0; ID_BYTES],
        };
        // SAFETY: writes the 128-byte id.
        self.check("ncclGetUniqueId", unsafe { (self.get_unique_id)(&mut id) })?;
        Ok(id.internal.iter().map(|&c| c as u8).collect())
    }
}

/// The communicator of one epoch, as far as it got.
enum CommState {
    None,
    /// Waiting for the first rank's id.
    AwaitingId,
    /// `ncclCommInitRankConfig` (non-blocking) returned: the ranks join in the background
    /// (`ncclCommGetAsyncError` says when), and an abort ends it at any time.
    Joining(Comm),
    /// The fallback where NCCL has no non-blocking init: `ncclCommInitRank` on a helper
    /// thread (it blocks until every rank has joined, and cannot be aborted before).
    Building(Receiver<std::result::Result<usize, c_int>>),
    Ready(Comm),
}

pub struct NcclCollective {
    lib: &'static Lib,
    rank: u32,
    epoch: Option<(u64, Vec<u32>)>,
    comm: CommState,
    /// The epoch's id, to build its communicator with at the next poll.
    pending_id: Option<Vec<u8>>,
    /// Communicators of superseded epochs still being built: aborted once they exist.
    abandoned: Vec<Receiver<std::result::Result<usize, c_int>>>,
    /// The held gradient's step and loss weight.
    held: Option<(u64, f64)>,
    /// The all-reduce in flight: started when, and the event behind it on the copy stream
    /// (the optimizer waits for it; an epoch's abort forgets it).
    launched: Option<(Instant, Event)>,
    /// Two f64 on the device: the loss weight, all-reduced in place.
    weight: DSlice,
    done: Option<Reduced>,
    /// Events of all-reduces an abort or a new contribution left behind: released at the
    /// next poll (which has the device).
    stale: Vec<Event>,
    /// The communicator failed (a peer died, or the network): it was aborted here, and the
    /// rank waits for the supervisor's next epoch (a death's, or the watchdog's).
    failed: bool,
}

// SAFETY: the communicator handles are only used from the worker's thread.
unsafe impl Send for NcclCollective {}

impl NcclCollective {
    /// For a GPU drafter (`model` on a CUDA device).
    pub fn new(rank: u32, model: &mut dyn GradientBuckets) -> Result<NcclCollective> {
        let lib = load().map_err(|e| WorkerError::Permanent(e.to_string()))?;
        let (major, minor, _) = lib.version()?;
        if (major, minor) < (2, 18) {
            return Err(WorkerError::Permanent(format!(
                "{} is NCCL {major}.{minor}: 2.18 or newer is needed",
                lib.path.display()
            )));
        }
        // Loaded only by drafters that use it: where it came from, beside the GPU's libraries
        // (on stderr: `bench compute --json` owns stdout).
        eprintln!(
            "  NCCL: {} ({major}.{minor}.{})",
            lib.path.display(),
            lib.version()?.2
        );
        let dev = model.device();
        if dev.cuda_handles().is_none() {
            return Err(WorkerError::Permanent(format!(
                "the NCCL collective needs a GPU; this drafter computes on {}",
                dev.describe()
            )));
        }
        let ptr = dev
            .alloc(16)
            .map_err(WorkerError::device("the loss weight's buffer"))?;
        Ok(NcclCollective {
            lib,
            rank,
            epoch: None,
            comm: CommState::None,
            pending_id: None,
            abandoned: Vec::new(),
            held: None,
            launched: None,
            weight: DSlice { ptr, bytes: 16 },
            done: None,
            stale: Vec::new(),
            failed: false,
        })
    }

    fn abort(&mut self) {
        match std::mem::replace(&mut self.comm, CommState::None) {
            // SAFETY: a communicator of ours; abort also ends its collectives in flight.
            CommState::Ready(c) => unsafe {
                (self.lib.comm_abort)(c);
            },
            // SAFETY: a communicator of ours; aborting a non-blocking init is allowed.
            CommState::Joining(c) => unsafe {
                (self.lib.comm_abort)(c);
            },
            CommState::Building(rx) => self.abandoned.push(rx),
            _ => {}
        }
        self.pending_id = None;
        self.stale.extend(self.launched.take().map(|(_, e)| e));
        self.done = None;
    }

    /// The communicator failed with NCCL result `err` (`when`: where, for the log): it is
    /// aborted, and this rank waits for the supervisor's next epoch (a death's, or the
    /// watchdog's) rather than dying too. Returns what `poll` returns then.
    fn fail(&mut self, err: c_int, when: &str) -> Option<Reduced> {
        let why = self
            .lib
            .check("an NCCL collective", err)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        let epoch = self.epoch.as_ref().map_or(0, |e| e.0);
        let when = if when.is_empty() {
            String::new()
        } else {
            format!(" {when}")
        };
        println!("NCCL communicator of epoch {epoch} failed{when} ({why}): aborted; waiting for the next epoch");
        self.abort();
        self.failed = true;
        None
    }

    fn reap_abandoned(&mut self) {
        let lib = self.lib;
        self.abandoned.retain(|rx| match rx.try_recv() {
            Ok(Ok(c)) => {
                // SAFETY: built for an epoch that is over: nobody uses it.
                unsafe { (lib.comm_abort)(c as Comm) };
                false
            }
            Ok(Err(_)) | Err(TryRecvError::Disconnected) => false,
            Err(TryRecvError::Empty) => true,
        });
    }

    fn build(&mut self, id: &[u8], model: &mut dyn GradientBuckets) -> Result<()> {
        let Some((epoch, ranks)) = &self.epoch else {
            return Ok(());
        };
        if id.len() != ID_BYTES {
            return Err(WorkerError::Protocol(format!(
                "epoch {epoch}: an NCCL id of {} bytes, expected {ID_BYTES}",
                id.len()
            )));
        }
        let mut uid = UniqueId {
            internal: [0; ID_BYTES],
        };
        for (d, &b) in uid.internal.iter_mut().zip(id) {
            *d = b as c_char;
        }
        let nranks = ranks.len() as c_int;
        let me = ranks
            .iter()
            .position(|&r| r == self.rank)
            .expect("checked in form") as c_int;
        let (ctx, _) = model.device().cuda_handles().expect("checked in new");
        if let Some(init) = self.lib.comm_init_rank_config {
            ctx.bind_to_thread().map_err(|e| WorkerError::Device {
                what: "binding the CUDA context for ncclCommInitRankConfig".into(),
                source: crate::device::GpuError::failed("cuCtxSetCurrent")(e),
            })?;
            let mut comm: Comm = std::ptr::null_mut();
            let config = Config::non_blocking();
            // SAFETY: returns at once (blocking = 0); the communicator joins in the background.
            match unsafe { init(&mut comm, nranks, uid, me, &config) } {
                SUCCESS | IN_PROGRESS => {
                    self.comm = CommState::Joining(comm);
                    return Ok(());
                }
                // An NCCL that does not take this config: the blocking init below.
                INVALID_ARGUMENT => println!("ncclCommInitRankConfig refused a non-blocking config (NCCL error 4); joining with the blocking ncclCommInitRank instead"),
                r => return self.lib.check("ncclCommInitRankConfig", r),
            }
        }
        let init = self.lib.comm_init_rank;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name(format!("nccl-init-{epoch}"))
            .spawn(move || {
                let r = match ctx.bind_to_thread() {
                    Ok(()) => {
                        let mut comm: Comm = std::ptr::null_mut();
                        // SAFETY: blocks until every rank of the epoch has called it.
                        let r = unsafe { init(&mut comm, nranks, uid, me) };
                        if r == SUCCESS {
                            Ok(comm as usize)
                        } else {
                            Err(r)
                        }
                    }
                    Err(_) => Err(-1),
                };
                let _ = tx.send(r);
            })
            .map_err(WorkerError::io("starting the NCCL init thread"))?;
        self.comm = CommState::Building(rx);
        Ok(())
    }

    /// Release the events of all-reduces an abort or a new contribution left behind.
    fn release_stale(&mut self, model: &mut dyn GradientBuckets) -> Result<()> {
        for e in self.stale.drain(..) {
            // An all-reduce an abort left behind: the compute stream waits for it (aborted
            // kernels end) before it writes what that all-reduce read.
            let dev = model.device();
            let r = dev.wait(Stream::Compute, e);
            dev.release_event(e);
            r.map_err(WorkerError::device("waiting for an aborted all-reduce"))?;
        }
        Ok(())
    }

    /// Move a joining or building communicator on: `Break` with what `poll` returns while
    /// it is not ready (or has failed), else `Continue`.
    fn settle_comm(&mut self) -> Result<ControlFlow<Option<Reduced>>> {
        if let CommState::Joining(c) = self.comm {
            let mut err: c_int = SUCCESS;
            // SAFETY: a communicator of ours, joining.
            self.lib.check("ncclCommGetAsyncError", unsafe {
                (self.lib.comm_get_async_error)(c, &mut err)
            })?;
            match err {
                SUCCESS => self.comm = CommState::Ready(c),
                IN_PROGRESS => return Ok(ControlFlow::Break(None)),
                _ => {
                    return Ok(ControlFlow::Break(self.fail(err, "while its ranks joined")));
                }
            }
        }
        if let CommState::Building(rx) = &self.comm {
            match rx.try_recv() {
                Ok(Ok(c)) => self.comm = CommState::Ready(c as Comm),
                Ok(Err(r)) => {
                    self.comm = CommState::None;
                    return self
                        .lib
                        .check("ncclCommInitRank", r)
                        .map(|_| ControlFlow::Break(None));
                }
                Err(TryRecvError::Empty) => return Ok(ControlFlow::Break(None)),
                Err(TryRecvError::Disconnected) => {
                    return Err(WorkerError::Protocol("the NCCL init thread died".into()))
                }
            }
        }
        Ok(ControlFlow::Continue(()))
    }

    /// Queue step `step`'s all-reduces on the copy stream: the loss weight `w`, then the
    /// gradient's buckets; an event behind them.
    fn launch(
        &mut self,
        model: &mut dyn GradientBuckets,
        comm: Comm,
        step: u64,
        w: f64,
    ) -> Result<Option<Reduced>> {
        let dev_err = |what: &'static str| WorkerError::device(what);
        let lib = self.lib;
        let dev = model.device();
        let (_, streams) = dev.cuda_handles().expect("checked in new");
        let copy = streams[Stream::Copy.index()];
        dev.upload(Stream::Copy, self.weight, &w.to_le_bytes())
            .map_err(dev_err("the loss weight to the device"))?;
        // SAFETY: one f64 on the device that lives as long as this collective.
        let rc = unsafe {
            lib.settled(
                comm,
                (lib.all_reduce)(
                    self.weight.ptr as *const c_void,
                    self.weight.ptr as *mut c_void,
                    1,
                    FLOAT64,
                    SUM,
                    comm,
                    copy.cast(),
                ),
            )
        };
        if rc != SUCCESS {
            // A communicator that failed (a peer gone) refuses the next call too.
            return Ok(self.fail(rc, &format!("queueing step {step}'s all-reduce")));
        }
        // Every rank issues the same buckets in the same order (the layout's).
        let refused = std::cell::Cell::new(SUCCESS);
        let e = model.reduce_buckets(Stream::Copy, &mut |_, g, r| {
            // SAFETY: a range of the gradient and the same range of the reduce
            // buffer, both alive as long as the drafter; queued on the copy
            // stream behind the event of the backward that finished it.
            let rc = unsafe {
                lib.settled(
                    comm,
                    (lib.all_reduce)(
                        g.ptr as *const c_void,
                        r.ptr as *mut c_void,
                        g.bytes / 4,
                        FLOAT32,
                        SUM,
                        comm,
                        copy.cast(),
                    ),
                )
            };
            if rc == SUCCESS {
                Ok(())
            } else {
                refused.set(rc);
                let call = "ncclAllReduce of a gradient bucket, NCCL error";
                Err(crate::device::GpuError::failed(call)(rc))
            }
        });
        let e = match e {
            Err(_) if refused.get() != SUCCESS => {
                return Ok(self.fail(refused.get(), &format!("queueing step {step}'s all-reduce")));
            }
            r => r.map_err(dev_err("the gradient's all-reduce"))?,
        };
        self.launched = Some((Instant::now(), e));
        Ok(None)
    }

    /// The all-reduce launched at `t` behind event `e`, once it is over: the summed loss
    /// weight of step `step` (of epoch `epoch`), kept as the result.
    fn collect(
        &mut self,
        model: &mut dyn GradientBuckets,
        comm: Comm,
        (t, e): (Instant, Event),
        (step, epoch): (u64, u64),
    ) -> Result<Option<Reduced>> {
        let dev_err = |what: &'static str| WorkerError::device(what);
        let dev = model.device();
        if !dev
            .event_done(e)
            .map_err(dev_err("the all-reduce's event"))?
        {
            return Ok(None);
        }
        // An all-reduce that ended because the communicator failed (a peer gone)
        // completes its event too: its sums are not sums.
        let mut err: c_int = SUCCESS;
        // SAFETY: a live communicator of ours.
        self.lib.check("ncclCommGetAsyncError", unsafe {
            (self.lib.comm_get_async_error)(comm, &mut err)
        })?;
        if err != SUCCESS && err != IN_PROGRESS {
            return Ok(self.fail(err, &format!("during step {step}'s all-reduce")));
        }
        let dev = model.device();
        let mut b = [0u8; 8];
        dev.download(Stream::Copy, self.weight.sub(1, 0..8), &mut b)
            .map_err(dev_err("the all-reduced loss weight"))?;
        let d = Reduced {
            step,
            epoch,
            weight_sum: f64::from_le_bytes(b),
            ms: t.elapsed().as_secs_f64() * 1e3,
        };
        self.done = Some(d);
        Ok(Some(d))
    }
}

impl Drop for NcclCollective {
    fn drop(&mut self) {
        self.abort();
    }
}

impl Collective for NcclCollective {
    fn kind(&self) -> CollectiveKind {
        CollectiveKind::Nccl
    }

    fn form(&mut self, epoch: u64, ranks: &[u32], id: Option<&[u8]>) -> Result<Formed> {
        super::check_ranks(epoch, ranks, self.rank)?;
        let same = self.epoch.as_ref().is_some_and(|(e, _)| *e == epoch);
        if !same {
            self.abort();
            self.failed = false;
            self.epoch = Some((epoch, ranks.to_vec()));
            self.comm = CommState::AwaitingId;
        }
        if !matches!(self.comm, CommState::AwaitingId) {
            return Ok(Formed::Ready);
        }
        match id {
            Some(id) => {
                self.pending_id = Some(id.to_vec());
                Ok(Formed::Ready)
            }
            None if ranks[0] == self.rank => {
                let id = self.lib.unique_id()?;
                self.pending_id = Some(id.clone());
                Ok(Formed::Created(id))
            }
            None => Ok(Formed::AwaitingId),
        }
    }

    fn contribute(
        &mut self,
        step: u64,
        weight: f64,
        model: &mut dyn GradientBuckets,
    ) -> Result<Option<bool>> {
        self.held = Some((step, weight));
        if let Some((_, e)) = self.launched.take() {
            // The all-reduce left behind may still read the gradient and write the reduce
            // buffer on the copy stream: what the compute stream does next waits for it.
            model
                .device()
                .wait(Stream::Compute, e)
                .map_err(WorkerError::device("waiting for an abandoned all-reduce"))?;
            self.stale.push(e);
        }
        self.done = None;
        Ok(None)
    }

    fn poll(&mut self, model: &mut dyn GradientBuckets) -> Result<Option<Reduced>> {
        self.reap_abandoned();
        self.release_stale(model)?;
        if let Some(d) = self.done {
            return Ok(Some(d));
        }
        if self.failed {
            return Ok(None);
        }
        if let Some(id) = self.pending_id.take() {
            self.build(&id, model)?;
        }
        if let ControlFlow::Break(r) = self.settle_comm()? {
            return Ok(r);
        }
        let CommState::Ready(comm) = self.comm else {
            return Ok(None);
        };
        let (Some((step, w)), Some((epoch, _))) = (self.held, self.epoch.as_ref()) else {
            return Ok(None);
        };
        let epoch = *epoch;
        let mut err: c_int = SUCCESS;
        // SAFETY: a live communicator of ours.
        self.lib.check("ncclCommGetAsyncError", unsafe {
            (self.lib.comm_get_async_error)(comm, &mut err)
        })?;
        if err != SUCCESS && err != IN_PROGRESS {
            // Most often a peer died: the supervisor's next epoch (or its watchdog's) forms
            // the group again, so this rank waits for it rather than dying too.
            return Ok(self.fail(err, ""));
        }
        match self.launched {
            None => self.launch(model, comm, step, w),
            Some((t, e)) => self.collect(model, comm, (t, e), (step, epoch)),
        }
    }

    fn take(&mut self, step: u64, weight_sum: f64) -> Result<Sum<'_>> {
        let d = super::check_commit(self.done, step, weight_sum)?;
        self.held = None;
        let after = self.launched.take().map(|(_, e)| e);
        self.done = None;
        Ok(Sum::Device {
            weight_sum: d.weight_sum,
            after,
        })
    }
}
