//! The control protocol between the supervisor and one worker, carried by ipc-channel.
//!
//! Bootstrap: the supervisor opens an `IpcOneShotServer<FromWorker>` and passes its name to
//! the worker (`--control NAME`). The worker connects, sends [`FromWorker::Hello`] carrying
//! the sender half of the downward channel, and from then on sends heartbeats on the same
//! connection. A worker exits when its control channel disconnects, so a supervisor that
//! vanishes takes its workers with it even if `PR_SET_PDEATHSIG` was somehow missed.

use ipc_channel::ipc::IpcSender;
use serde::{Deserialize, Serialize};

pub use crate::pool::{PoolId, PoolInfo, SlotRef};

/// Bumped on every incompatible change to the messages below. A worker speaking another
/// version is refused with a clear error instead of being restarted forever.
pub const PROTOCOL_VERSION: u32 = 10;

/// Worker → supervisor.
#[derive(Debug, Serialize, Deserialize)]
pub enum FromWorker {
    /// First message on a new connection, exactly once.
    Hello(Hello),
    /// "I am alive." Sent by a thread of its own that never waits for compute, so a
    /// worker is declared hung (`--hang-timeout`) only when its process is wedged; `busy`:
    /// the unit of work its compute loop is in, and for how long, which the supervisor
    /// holds to `--step-timeout`.
    Heartbeat { seq: u64, busy: Option<Busy> },
    /// Sent by the supervisor itself, never by a worker: wakes up the thread waiting for a
    /// worker that died before it connected.
    Abandon,
    /// A leased output slot now holds batch `batch_id` (`len` bytes). A target names the
    /// input slot it consumed to make it: both change together or not at all.
    /// `wait_ms` / `compute_ms`: host-side time waiting for this batch and computing it.
    Commit {
        output: SlotRef,
        len: u64,
        batch_id: u64,
        input: Option<SlotRef>,
        wait_ms: f64,
        compute_ms: f64,
    },
    /// A delivered batch was consumed (for a drafter: it reached the optimizer).
    Ack { input: SlotRef, batch_id: u64 },
    /// A drafter evaluated the held-out batch `batch_id` (an eval batch id, see
    /// [`crate::batch::is_eval_batch`]) forward only, at the weights of `step` (no
    /// gradient, no all-reduce), and is done with its slot.
    Evaluated {
        input: SlotRef,
        batch_id: u64,
        step: u64,
        stats: crate::drafter::StepStats,
    },
    /// A drafter rank computed the gradient of `batch_id` for `step` and holds it until
    /// the step commits; it contributes it to every epoch's all-reduce of `step` (see
    /// [`ToWorker::Group`]). `params` is a checksum of the weights the gradient was taken
    /// at: every rank of a step must report the same one, or the ranks have diverged.
    Grads {
        step: u64,
        input: SlotRef,
        batch_id: u64,
        stats: crate::drafter::StepStats,
        params: u64,
    },
    /// The all-reduce of `step` in group epoch `epoch` completed on this rank: it holds the
    /// sum of the epoch's gradients and of their loss weights (`weight_sum`). `ms`: from
    /// posting its own gradient to completion (waiting for the slowest rank included).
    Reduced {
        step: u64,
        epoch: u64,
        weight_sum: f64,
        ms: f64,
    },
    /// NCCL groups: the unique id that the first rank of `epoch` created, for the supervisor
    /// to relay to the other ranks (it loads no CUDA library itself).
    GroupId { epoch: u64, id: Vec<u8> },
    /// State slot `slot` now holds this rank's state at `step`; writing it took `ms`.
    SnapshotDone { step: u64, slot: u32, ms: f64 },
    /// A checkpoint of `step` is complete in `dir`.
    Checkpointed { dir: String, step: u64 },
    /// A checkpoint of `step` could not be written to `dir` (the disk is full, the
    /// directory was replaced or removed, ...): the worker goes on, and the supervisor
    /// decides (a write failure is not a crash to restart).
    CheckpointFailed {
        step: u64,
        dir: String,
        failure: WriteFailure,
    },
    /// The worker's device memory: its arena's counters and the driver's free/total
    /// (host-side figures: reading them adds no GPU sync). Sent with heartbeats by
    /// workers that compute on a device.
    DeviceMemory(DeviceMemory),
    /// The worker is about to exit on an error (its last message): what kind of failure,
    /// and the one line that says why. A permanent kind is not restarted.
    Fatal { kind: FatalKind, message: String },
}

/// Why a worker ends on an error (see [`FromWorker::Fatal`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FatalKind {
    /// It cannot compute on its device (no usable GPU, a CUDA library missing or too old,
    /// a model that does not fit): permanent, every restart would fail the same way.
    Device,
    /// The target model directory is unusable: permanent.
    Model,
    /// What the worker was started with (its environment or flags) is unusable:
    /// permanent, the next life gets the same.
    Config,
    /// Any other error (a crash to restart, within the restart budget).
    Crash,
}

impl FatalKind {
    /// Restarting cannot help.
    pub fn permanent(self) -> bool {
        matches!(
            self,
            FatalKind::Device | FatalKind::Model | FatalKind::Config
        )
    }

    pub fn as_str(self) -> &'static str {
        match self {
            FatalKind::Device => "device",
            FatalKind::Model => "model",
            FatalKind::Config => "config",
            FatalKind::Crash => "crash",
        }
    }
}

impl FromWorker {
    /// The message's name, for logs (a protocol violation names the message, not its
    /// contents).
    pub fn kind(&self) -> &'static str {
        match self {
            FromWorker::Hello(_) => "Hello",
            FromWorker::Heartbeat { .. } => "Heartbeat",
            FromWorker::Abandon => "Abandon",
            FromWorker::Commit { .. } => "Commit",
            FromWorker::Ack { .. } => "Ack",
            FromWorker::Evaluated { .. } => "Evaluated",
            FromWorker::Grads { .. } => "Grads",
            FromWorker::Reduced { .. } => "Reduced",
            FromWorker::GroupId { .. } => "GroupId",
            FromWorker::SnapshotDone { .. } => "SnapshotDone",
            FromWorker::Checkpointed { .. } => "Checkpointed",
            FromWorker::CheckpointFailed { .. } => "CheckpointFailed",
            FromWorker::DeviceMemory(_) => "DeviceMemory",
            FromWorker::Fatal { .. } => "Fatal",
        }
    }
}

/// A unit of work a worker's compute loop is in (see [`FromWorker::Heartbeat`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Work {
    /// A drafter computing the gradient of training step `step` on batch `batch_id`.
    Step { step: u64, batch_id: u64 },
    /// A drafter applying the update of step `step`.
    Update { step: u64 },
    /// A target computing the hidden states of batch `batch_id`.
    Batch { batch_id: u64 },
    /// A drafter writing its state at `step` (a checkpoint or a snapshot).
    Save { step: u64 },
    /// A drafter scoring held-out batch `batch_id` with the weights of `step`.
    Eval { step: u64, batch_id: u64 },
    /// A drafter joining the group (its setup), or forming group epoch `epoch` (NCCL
    /// communicators): both wait on the other ranks.
    Join { epoch: Option<u64> },
}

impl std::fmt::Display for Work {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Work::Step { step, batch_id } => write!(f, "step {step} (batch {batch_id})"),
            Work::Update { step } => write!(f, "the update of step {step}"),
            Work::Batch { batch_id } => write!(f, "batch {batch_id}"),
            Work::Save { step } => write!(f, "saving the state of step {step}"),
            Work::Eval { step, batch_id } => {
                write!(f, "the eval of held-out batch {batch_id} at step {step}")
            }
            Work::Join { epoch: None } => write!(f, "joining the drafter group"),
            Work::Join { epoch: Some(e) } => write!(f, "forming group epoch {e}"),
        }
    }
}

/// What the compute loop is in and for how long (the worker's clock), as of a heartbeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Busy {
    pub work: Work,
    pub for_ms: u64,
}

/// Why a file could not be written: what was being done (with its path), the OS error's
/// number when there is one, and its words.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteFailure {
    /// What was being done, e.g. "creating /r/checkpoints/step-00000020.tmp-77".
    pub doing: String,
    /// `errno`, when the failure was the OS's.
    pub os_error: Option<i32>,
    /// The error's own words ("No space left on device (os error 28)").
    pub words: String,
}

impl std::fmt::Display for WriteFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.doing, self.words)
    }
}

/// A device worker's memory, in bytes (see [`FromWorker::DeviceMemory`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct DeviceMemory {
    /// The arena: allocated from the device at start.
    pub reserved: u64,
    /// Of it, handed out now, and at most so far.
    pub in_use: u64,
    pub peak: u64,
    /// Requests the arena could not serve.
    pub alloc_failures: u64,
    /// The device's free and total memory (`cuMemGetInfo`).
    pub free: u64,
    pub total: u64,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct Hello {
    pub protocol: u32,
    pub pid: u32,
    /// `<role>-<rank>` as the worker understood its environment.
    pub worker: String,
    pub restart_count: u32,
    /// Where the supervisor sends [`ToWorker`] messages.
    pub to_worker: IpcSender<ToWorker>,
}

/// Supervisor → worker.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum ToWorker {
    /// Sent once, right after the hello: the shared-memory pools and the capture spec of
    /// the hidden states.
    Pools {
        pools: Vec<PoolInfo>,
        capture: crate::batch::CaptureSpec,
    },
    /// Read this batch (READING slot held by you), then [`FromWorker::Ack`] or, for a
    /// target, [`FromWorker::Commit`] it.
    Deliver {
        slot: SlotRef,
        len: u64,
        batch_id: u64,
    },
    /// Write your next output here (WRITING slot held by you).
    Lease { slot: SlotRef },
    /// Drafters: join the data-parallel group and train.
    Train(Box<crate::drafter::TrainSetup>),
    /// Drafters: membership epoch `epoch` of the group has these ranks (ascending; a rank's
    /// index in the list is its place in the collective). Abort any reduction of an older
    /// epoch (`ncclCommAbort` on NCCL) and all-reduce the gradient held for the next step
    /// again, in this epoch. `id`: the NCCL unique id, relayed (see [`FromWorker::GroupId`]).
    Group {
        epoch: u64,
        ranks: Vec<u32>,
        id: Option<Vec<u8>>,
    },
    /// Drafters: step `step` is committed. Apply the sum that the all-reduce of epoch
    /// `epoch` produced (each rank's unnormalised gradient of Σ w·CE), divided by
    /// `weight_sum` (Σ w over the epoch's batches, so the step is the gradient of
    /// Σ_r num_r / Σ_r den_r: one normalisation across ranks; the rank checks it against
    /// its own all-reduced sum), clipped, with learning rate `lr`.
    Apply {
        step: u64,
        epoch: u64,
        lr: f64,
        weight_sum: f64,
    },
    /// Drafters: the data is at its end and no batch will come for `step`: contribute
    /// nothing (a zero gradient of weight 0) so the ranks that have one can commit it.
    Abstain { step: u64 },
    /// Drafters: the order to abstain from `step` is withdrawn (a rank holding the step's
    /// batches died, so they come back): drop the zero contribution and take batches.
    Withdraw { step: u64 },
    /// Drafters: write your state (at `step`) into state slot `slot`: slot 0 for a joining
    /// rank, 1 and 2 for the supervisor's double-buffered snapshot that a rollback restores.
    Snapshot { step: u64, slot: u32 },
    /// Drafters: write a checkpoint of your state at `step` to `dir` (atomically), with
    /// the supervisor's part (`meta`, JSON: what was consumed), then report Checkpointed
    /// (or CheckpointFailed).
    Checkpoint {
        dir: String,
        step: u64,
        meta: String,
    },
    /// Finish the current unit of work (write a checkpoint if there is one to write) and
    /// exit 0.
    Shutdown { reason: String },
}

/// Worker side of the bootstrap: connect to the supervisor's one-shot server `server`,
/// open the downward channel and say hello. Returns the upward sender (for heartbeats)
/// and the downward receiver.
pub fn connect(
    server: &str,
    worker: &str,
    restart_count: u32,
) -> std::io::Result<(
    IpcSender<FromWorker>,
    ipc_channel::ipc::IpcReceiver<ToWorker>,
)> {
    let up = IpcSender::<FromWorker>::connect(server.to_string())?;
    let (to_worker, down) = ipc_channel::ipc::channel::<ToWorker>()?;
    up.send(FromWorker::Hello(Hello {
        protocol: PROTOCOL_VERSION,
        pid: std::process::id(),
        worker: worker.to_string(),
        restart_count,
        to_worker,
    }))
    .map_err(|e| std::io::Error::other(format!("sending hello: {e}")))?;
    Ok((up, down))
}
