//! The role loop. Until the data plane and the compute land it only heartbeats; it already
//! has the shape they plug into: wait for work or a control message up to one heartbeat
//! interval, do the work, beat.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Context;
use dflash_shared::exit_codes;
use dflash_shared::protocol::{connect, FromWorker, ToWorker};
use ipc_channel::{IpcError, TryRecvError};
use signal_hook::consts::{SIGINT, SIGTERM, SIGUSR1, SIGUSR2};

use crate::Identity;

struct Flags {
    stop: Arc<AtomicBool>,
    usr1: Arc<AtomicBool>,
    usr2: Arc<AtomicBool>,
}

fn install_signal_flags() -> anyhow::Result<Flags> {
    let f = Flags {
        stop: Arc::new(AtomicBool::new(false)),
        usr1: Arc::new(AtomicBool::new(false)),
        usr2: Arc::new(AtomicBool::new(false)),
    };
    signal_hook::flag::register(SIGTERM, f.stop.clone())?;
    signal_hook::flag::register(SIGINT, f.stop.clone())?;
    signal_hook::flag::register(SIGUSR1, f.usr1.clone())?;
    signal_hook::flag::register(SIGUSR2, f.usr2.clone())?;
    Ok(f)
}

pub fn run(control: &str, id: &Identity) -> anyhow::Result<i32> {
    let flags = install_signal_flags().context("installing signal handlers")?;
    let name = id.name.to_string();
    let (up, down) = connect(control, &name, id.restart_count).context("connecting to the supervisor")?;
    println!(
        "dflash-worker {name} (pid {}) on device {}, restart {}: connected; role loop heartbeats only (no data plane yet)",
        std::process::id(),
        id.gpu,
        id.restart_count
    );
    let mut seq = 0u64;
    loop {
        match down.try_recv_timeout(id.heartbeat) {
            Ok(ToWorker::Shutdown { reason }) => {
                println!("shutdown requested ({reason}): exiting");
                return Ok(exit_codes::SUCCESS);
            }
            Err(TryRecvError::Empty) => {}
            // A signal (SIGUSR1, SIGTERM) interrupted the wait: handled just below.
            Err(TryRecvError::IpcError(IpcError::Io(e))) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(TryRecvError::IpcError(IpcError::Disconnected)) => {
                eprintln!("control channel closed: the supervisor is gone; exiting");
                return Ok(exit_codes::WORKER_ORPHANED);
            }
            Err(e) => {
                eprintln!("control channel failed ({e}); exiting");
                return Ok(exit_codes::WORKER_ORPHANED);
            }
        }
        if flags.stop.load(Ordering::Relaxed) {
            println!("stop signal received: exiting");
            return Ok(exit_codes::SUCCESS);
        }
        for (flag, sig) in [(&flags.usr1, "SIGUSR1"), (&flags.usr2, "SIGUSR2")] {
            if flag.swap(false, Ordering::Relaxed) {
                println!("{sig} received (pre-emption notice); nothing to checkpoint yet");
            }
        }
        seq += 1;
        if up.send(FromWorker::Heartbeat { seq }).is_err() {
            eprintln!("control channel closed: the supervisor is gone; exiting");
            return Ok(exit_codes::WORKER_ORPHANED);
        }
    }
}
