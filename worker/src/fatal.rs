//! A worker's last word: before it exits on an error, it tells the supervisor what kind
//! of failure it was and why, as a typed [`FromWorker::Fatal`] on its control channel (the
//! supervisor decides on that whether to restart it, and prints the reason).
//!
//! The channel is registered once the worker is connected; the panic hook and the exit
//! path of `serve` report through it. Before that nothing can be sent: the supervisor
//! sees only the exit code.

use std::sync::{Mutex, OnceLock};

use dflash_shared::protocol::{FatalKind, FromWorker};
use ipc_channel::ipc::IpcSender;

static UP: OnceLock<Mutex<IpcSender<FromWorker>>> = OnceLock::new();

/// The channel to report on (the first registration wins: a worker connects once).
pub fn register(up: &IpcSender<FromWorker>) {
    let _ = UP.set(Mutex::new(up.clone()));
}

/// Send the fatal report. `false` when it could not be sent (not connected yet, or the
/// channel is closed): the exit code then says what it can.
pub fn report(kind: FatalKind, message: &str) -> bool {
    let Some(up) = UP.get() else {
        return false;
    };
    // A panic while another thread held the lock must not stop the report.
    let up = up.lock().unwrap_or_else(|e| e.into_inner());
    up.send(FromWorker::Fatal {
        kind,
        message: message.to_string(),
    })
    .is_ok()
}
