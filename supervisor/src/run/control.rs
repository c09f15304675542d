//! The supervisor's end of one worker life's control channel: a thread that waits for the
//! worker to connect, then forwards every message as a [`ControlEvent`] (the dispatcher
//! wraps it in its own event type, so this module does not know the dispatcher).

use std::sync::mpsc::Sender;
use std::thread;

use dflash_shared::protocol::{FromWorker, Hello};
use ipc_channel::ipc::{IpcOneShotServer, IpcSender};
use ipc_channel::IpcError;

/// One start of a worker; unique over the run, so a late event from a previous life is
/// recognised.
pub type LifeId = u64;

/// What a worker life's control channel says.
#[derive(Debug)]
pub enum ControlEvent {
    Connected {
        worker: usize,
        life: LifeId,
        hello: Hello,
    },
    Message {
        worker: usize,
        life: LifeId,
        msg: FromWorker,
    },
    /// The worker died before its hello was taken, and [`abandon`] found the server
    /// still waiting: no hello ever came.
    Abandoned { worker: usize, life: LifeId },
    /// The control channel ended. `malformed`: the worker broke the protocol.
    ChannelLost {
        worker: usize,
        life: LifeId,
        reason: String,
        malformed: bool,
    },
}

/// Start the thread. It ends when the worker's connection closes, when the first message
/// is not a hello, or when [`abandon`] wakes it because the worker died before connecting.
pub fn serve<E: From<ControlEvent> + Send + 'static>(
    server: IpcOneShotServer<FromWorker>,
    worker: usize,
    life: LifeId,
    tx: Sender<E>,
) {
    let fallback = tx.clone();
    let spawned = thread::Builder::new()
        .name(format!("control-{worker}"))
        .spawn(move || {
            let lost = |reason: String, malformed: bool| ControlEvent::ChannelLost {
                worker,
                life,
                reason,
                malformed,
            };
            let (rx, first) = match server.accept() {
                Ok(v) => v,
                Err(e) => {
                    let malformed = matches!(e, IpcError::SerializationError(_));
                    let _ = tx.send(E::from(lost(
                        format!("control connection failed: {e}"),
                        malformed,
                    )));
                    return;
                }
            };
            match first {
                FromWorker::Hello(hello) => {
                    if tx
                        .send(E::from(ControlEvent::Connected {
                            worker,
                            life,
                            hello,
                        }))
                        .is_err()
                    {
                        return;
                    }
                }
                FromWorker::Abandon => {
                    let _ = tx.send(E::from(ControlEvent::Abandoned { worker, life }));
                    return;
                }
                other => {
                    let _ = tx.send(E::from(lost(
                        format!("first control message was {}, expected Hello", other.kind()),
                        true,
                    )));
                    return;
                }
            }
            loop {
                let event = match rx.recv() {
                    Ok(msg) => ControlEvent::Message { worker, life, msg },
                    Err(IpcError::Disconnected) => lost("control channel closed".into(), false),
                    Err(IpcError::SerializationError(e)) => {
                        lost(format!("malformed control message: {e}"), true)
                    }
                    Err(IpcError::Io(e)) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(IpcError::Io(e)) => lost(format!("control channel error: {e}"), false),
                };
                let last = !matches!(event, ControlEvent::Message { .. });
                if tx.send(E::from(event)).is_err() || last {
                    return;
                }
            }
        });
    if let Err(e) = spawned {
        let e = crate::nproc::start_failure(&e);
        log::error!("cannot start control thread: {e}");
        // No hello can be taken: said, so that the worker's death is not waited on.
        let _ = fallback.send(E::from(ControlEvent::ChannelLost {
            worker,
            life,
            reason: format!("cannot start its control thread: {e}"),
            malformed: false,
        }));
    }
}

/// Wake a control thread still waiting in `accept` for a worker that will never connect.
pub fn abandon(server_name: &str) {
    if let Ok(tx) = IpcSender::<FromWorker>::connect(server_name.to_string()) {
        let _ = tx.send(FromWorker::Abandon);
    }
}
