//! The role loop: wait for work or a control message up to one heartbeat interval, do one
//! unit of work when one is ready, report it. Heartbeats come from a thread of their own
//! (crate::busy), which puts in each the unit of work this loop is in: a slow step is not
//! a hang, and the supervisor holds the step itself to `--step-timeout`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::error::{Result, While, WorkerError};
use dflash_shared::exit_codes;
use dflash_shared::protocol::{connect, FromWorker, ToWorker, Work};
use ipc_channel::ipc::IpcSender;
use ipc_channel::{IpcError, TryRecvError};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM, SIGUSR1, SIGUSR2};

use crate::plane::{Delivery, Plane, Pools};
use crate::train::Rank;
use crate::Identity;

struct Flags {
    stop: Arc<AtomicBool>,
    usr1: Arc<AtomicBool>,
    usr2: Arc<AtomicBool>,
}

fn install_signal_flags() -> Result<Flags> {
    let f = Flags {
        stop: Arc::new(AtomicBool::new(false)),
        usr1: Arc::new(AtomicBool::new(false)),
        usr2: Arc::new(AtomicBool::new(false)),
    };
    // Caught, never acted on by themselves (see `run`): a SIGTERM sent to the whole process
    // group or cgroup (Slurm, systemd) also reaches the supervisor, which stops the run
    // with its final checkpoint and then orders every worker to stop.
    for (sig, flag) in [
        (SIGTERM, &f.stop),
        (SIGINT, &f.stop),
        (SIGHUP, &f.stop),
        (SIGUSR1, &f.usr1),
        (SIGUSR2, &f.usr2),
    ] {
        signal_hook::flag::register(sig, flag.clone()).map_err(WorkerError::io(format!(
            "installing the handler of signal {sig}"
        )))?;
    }
    Ok(f)
}

/// How often a progress line is printed.
const PROGRESS_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

pub fn run(control: &str, id: &Identity) -> Result<i32> {
    let flags = install_signal_flags()?;
    let name = id.name.to_string();
    let (up, down) = connect(control, &name, id.restart_count)
        .map_err(WorkerError::format("connecting to the supervisor"))?;
    // From here a failure that ends the worker reaches the supervisor as a typed message.
    crate::fatal::register(&up);
    println!(
        "dflash-worker {name} (pid {}) on device {}, restart {}: connected",
        std::process::id(),
        id.gpu,
        id.restart_count
    );
    if flags.stop.swap(false, Ordering::Relaxed) {
        // The supervisor signals a worker that is not connected yet when it stops; now
        // that this one is, it gets (or already has) the stop order on the channel.
        println!("stop signal received while connecting: waiting for the supervisor's stop order");
    }
    let mut plane = Plane::new(id.name.role, id.gpu.parse().ok());
    crate::busy::start_heartbeats(up.clone(), plane.busy.clone(), id.heartbeat)?;
    let mut clock = Beats {
        last_memory: Instant::now(),
        last_progress: Instant::now(),
    };
    loop {
        // While the model loads, look for it often, and for the others' gradients while an
        // all-reduce is in flight; otherwise wait for work up to a beat.
        let wait = if plane.loading() {
            id.heartbeat.min(std::time::Duration::from_millis(5))
        } else if plane.reducing() {
            id.heartbeat.min(std::time::Duration::from_millis(1))
        } else {
            id.heartbeat
        };
        let msg = if plane.ready() {
            down.try_recv()
        } else {
            down.try_recv_timeout(wait)
        };
        let flow = match msg {
            Ok(order) => obey(order, &mut plane, &up, id)?,
            Err(TryRecvError::Empty) => Flow::Go,
            // A signal (SIGUSR1, SIGTERM) interrupted the wait: handled just below.
            Err(TryRecvError::IpcError(IpcError::Io(e)))
                if e.kind() == std::io::ErrorKind::Interrupted =>
            {
                Flow::Go
            }
            Err(TryRecvError::IpcError(IpcError::Disconnected)) => Flow::Orphaned,
            Err(e) => {
                eprintln!("control channel failed ({e}); exiting");
                Flow::Exit(exit_codes::WORKER_ORPHANED)
            }
        };
        let flow = match flow {
            Flow::Go => {
                report_signals(&flags, &plane);
                work(&mut plane, &up, &mut clock, id)?
            }
            other => other,
        };
        match flow {
            Flow::Go => {}
            Flow::Exit(code) => return Ok(code),
            Flow::Orphaned => {
                eprintln!("control channel closed: the supervisor is gone; exiting");
                return Ok(exit_codes::WORKER_ORPHANED);
            }
        }
    }
}

/// What the worker loop does next.
enum Flow {
    Go,
    Exit(i32),
    /// The supervisor is gone (its channel closed).
    Orphaned,
}

/// When the device memory was last reported and the last progress line printed.
struct Beats {
    last_memory: Instant,
    last_progress: Instant,
}

/// Carry out one order of the supervisor.
fn obey(
    order: ToWorker,
    plane: &mut Plane,
    up: &IpcSender<FromWorker>,
    id: &Identity,
) -> Result<Flow> {
    let tell = |m: FromWorker| {
        if up.send(m).is_err() {
            Flow::Orphaned
        } else {
            Flow::Go
        }
    };
    // Units of work are marked on a handle of their own (the plane is borrowed for them).
    let busy = plane.busy.clone();
    Ok(match order {
        ToWorker::Shutdown { reason } => {
            println!(
                "shutdown requested ({reason}): exiting after {} batches",
                plane.stats.batches
            );
            Flow::Exit(exit_codes::SUCCESS)
        }
        ToWorker::Pools { pools, capture } => {
            plane.set_pools(Pools::open(&pools, capture)?)?;
            Flow::Go
        }
        ToWorker::Deliver {
            slot,
            len,
            batch_id,
        } => {
            plane.deliver(Delivery {
                slot,
                len,
                batch_id,
            });
            Flow::Go
        }
        ToWorker::Lease { slot } => {
            plane.lease(slot)?;
            Flow::Go
        }
        ToWorker::Train(setup) => {
            let _busy = busy.enter(Work::Join { epoch: None });
            join_training(*setup, plane, id)?;
            Flow::Go
        }
        ToWorker::Group { epoch, ranks, id } => {
            let _busy = busy.enter(Work::Join { epoch: Some(epoch) });
            let rank = plane.rank("a group epoch")?;
            match rank.group(epoch, &ranks, id.as_deref())? {
                crate::collective::Formed::Created(id) => tell(FromWorker::GroupId { epoch, id }),
                _ => Flow::Go,
            }
        }
        ToWorker::Abstain { step } => {
            let rank = plane.rank("an abstention")?;
            if rank.abstain(step)? {
                println!("step {step}: no batch left for this rank: contributing nothing");
            }
            Flow::Go
        }
        ToWorker::Withdraw { step } => {
            let rank = plane.rank("a withdrawal")?;
            if rank.withdraw(step) {
                println!("step {step}: abstention withdrawn: taking batches again");
            }
            Flow::Go
        }
        ToWorker::Apply {
            step,
            epoch,
            lr,
            weight_sum,
        } => {
            let rank = plane.rank("a step to apply")?;
            let applied = {
                let _busy = busy.enter(Work::Update { step });
                rank.reduce(step, epoch, lr, weight_sum)?
            };
            if let Some(skipped) = applied.skipped {
                println!(
                    "step {skipped}: non-finite gradient, step skipped ({} so far)",
                    rank.skipped_steps
                );
            }
            Flow::Go
        }
        ToWorker::Snapshot { slot, .. } => {
            let rank = plane.rank("a snapshot request")?;
            tell(snapshot(rank, &busy, slot)?)
        }
        ToWorker::Checkpoint { dir, step, meta } => {
            let rank = plane.rank("a checkpoint request")?;
            tell(checkpoint(rank, &busy, dir, step, &meta)?)
        }
    })
}

/// Write this rank's state into state slot `slot`; what to tell the supervisor.
fn snapshot(rank: &mut Rank, busy: &crate::busy::Busy, slot: u32) -> Result<FromWorker> {
    let t = std::time::Instant::now();
    let saving = busy.enter(Work::Save { step: rank.step });
    rank.snapshot(slot)?;
    drop(saving);
    Ok(FromWorker::SnapshotDone {
        step: rank.step,
        slot,
        ms: t.elapsed().as_secs_f64() * 1e3,
    })
}

/// Write checkpoint `dir` of `step` (this rank's step); what to tell the supervisor.
fn checkpoint(
    rank: &mut Rank,
    busy: &crate::busy::Busy,
    dir: String,
    step: u64,
    meta: &str,
) -> Result<FromWorker> {
    if rank.step != step {
        return Err(WorkerError::Protocol(format!(
            "asked to checkpoint step {step}, but this rank is at step {}",
            rank.step
        )));
    }
    let saving = busy.enter(Work::Save { step });
    let written = rank.checkpoint(std::path::Path::new(&dir), meta);
    drop(saving);
    match written {
        Ok(()) => Ok(FromWorker::Checkpointed { dir, step }),
        // A write that failed (a full disk, a directory replaced or removed) is the
        // supervisor's to decide on: it is not a crash, and restarting would not help.
        Err(e) => match e.write_failure() {
            Some(failure) => {
                eprintln!("checkpoint of step {step} not written: {failure}");
                Ok(FromWorker::CheckpointFailed { step, dir, failure })
            }
            None => Err(e).during(|| format!("writing checkpoint {dir}")),
        },
    }
}

/// Become a rank of the drafter group with `setup`.
fn join_training(
    setup: dflash_shared::drafter::TrainSetup,
    plane: &mut Plane,
    id: &Identity,
) -> Result<()> {
    let dir = std::env::var_os(dflash_shared::env::TARGET_DIR)
        .map(std::path::PathBuf::from)
        .ok_or_else(|| {
            WorkerError::Protocol(format!(
                "{} is not set: where are the frozen embeddings?",
                dflash_shared::env::TARGET_DIR
            ))
        })?;
    // SAFETY: the hidden pool stays mapped as long as `plane.pools`, which is dropped after
    // the rank (field order in Plane).
    let rank = unsafe {
        Rank::new(
            setup,
            &dir,
            id.gpu.parse().ok(),
            plane.max_row_tokens()?,
            plane.hidden_rows()?,
        )
    }
    .during(|| "setting up training".into())?;
    println!(
        "training: rank {} joined at step {} ({} parameters, {}), computing on {}, gradients exchanged through {}",
        rank.setup.rank,
        rank.step,
        rank.param_count(),
        rank.setup.init,
        rank.compute_device(),
        rank.collective().name()
    );
    plane.join(rank)
}

/// Say what the signals that arrived mean for a connected worker (it stops only when
/// the supervisor says so).
fn report_signals(flags: &Flags, plane: &Plane) {
    if flags.stop.swap(false, Ordering::Relaxed) {
        // While the supervisor is alive, it decides when the run stops: it got the same
        // signal (or will forward its stop), checkpoints, then sends Shutdown. If it is
        // gone, the closed channel ends this worker (WORKER_ORPHANED).
        println!("stop signal received: the supervisor is alive, so working on until its stop order (after {} batches)", plane.stats.batches);
    }
    for (flag, sig) in [(&flags.usr1, "SIGUSR1"), (&flags.usr2, "SIGUSR2")] {
        if flag.swap(false, Ordering::Relaxed) {
            // The supervisor got the same signal: on SIGUSR1 it checkpoints at the next
            // step; the worker itself has nothing to do.
            println!("{sig} received: the supervisor decides what it means (SIGUSR1: a checkpoint at the next step)");
        }
    }
}

/// Load the model, do a batch's work when there is one, and keep the supervisor told
/// (device memory, a progress line; the heartbeats have a thread of their own).
fn work(
    plane: &mut Plane,
    up: &IpcSender<FromWorker>,
    clock: &mut Beats,
    id: &Identity,
) -> Result<Flow> {
    if let Some(msg) = plane.poll_model()? {
        println!("{msg}");
    }
    if plane.ready() {
        let report = plane.step()?;
        if up.send(report).is_err() {
            return Ok(Flow::Orphaned);
        }
    }
    if let Some(rank) = plane.rank_if_training() {
        if let Some(d) = rank.poll_reduce()? {
            if up
                .send(FromWorker::Reduced {
                    step: d.step,
                    epoch: d.epoch,
                    weight_sum: d.weight_sum,
                    ms: d.ms,
                })
                .is_err()
            {
                return Ok(Flow::Orphaned);
            }
        }
    }
    if clock.last_progress.elapsed() >= PROGRESS_EVERY {
        clock.last_progress = Instant::now();
        let s = &plane.stats;
        println!("{} batches, {} tokens so far", s.batches, s.tokens);
    }
    if clock.last_memory.elapsed() >= id.heartbeat {
        clock.last_memory = Instant::now();
        if let Some(m) = plane.device_memory() {
            if up.send(FromWorker::DeviceMemory(m)).is_err() {
                return Ok(Flow::Orphaned);
            }
        }
    }
    Ok(Flow::Go)
}
