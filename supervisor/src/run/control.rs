//! The supervisor's end of one worker life's control channel: a thread that waits for the
//! worker to connect, then forwards every message to the dispatcher as an [`Event`].

use std::sync::mpsc::Sender;
use std::thread;

use dflash_shared::protocol::FromWorker;
use ipc_channel::ipc::{IpcOneShotServer, IpcSender};
use ipc_channel::IpcError;

use crate::run::dispatcher::{Event, LifeId};

/// Start the thread. It ends when the worker's connection closes, when the first message
/// is not a hello, or when [`abandon`] wakes it because the worker died before connecting.
pub fn serve(server: IpcOneShotServer<FromWorker>, worker: usize, life: LifeId, tx: Sender<Event>) {
    let spawned = thread::Builder::new().name(format!("control-{worker}")).spawn(move || {
        let lost = |reason: String, malformed: bool| Event::ChannelLost { worker, life, reason, malformed };
        let (rx, first) = match server.accept() {
            Ok(v) => v,
            Err(e) => {
                let malformed = matches!(e, IpcError::SerializationError(_));
                let _ = tx.send(lost(format!("control connection failed: {e}"), malformed));
                return;
            }
        };
        match first {
            FromWorker::Hello(hello) => {
                if tx.send(Event::Connected { worker, life, hello }).is_err() {
                    return;
                }
            }
            FromWorker::Abandon => return,
            other => {
                let _ = tx.send(lost(format!("first control message was {other:?}, expected Hello"), true));
                return;
            }
        }
        loop {
            let event = match rx.recv() {
                Ok(msg) => Event::Message { worker, life, msg },
                Err(IpcError::Disconnected) => lost("control channel closed".into(), false),
                Err(IpcError::SerializationError(e)) => lost(format!("malformed control message: {e}"), true),
                Err(IpcError::Io(e)) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(IpcError::Io(e)) => lost(format!("control channel error: {e}"), false),
            };
            let last = !matches!(event, Event::Message { .. });
            if tx.send(event).is_err() || last {
                return;
            }
        }
    });
    if let Err(e) = spawned {
        log::error!("cannot start control thread: {e}");
    }
}

/// Wake a control thread still waiting in `accept` for a worker that will never connect.
pub fn abandon(server_name: &str) {
    if let Ok(tx) = IpcSender::<FromWorker>::connect(server_name.to_string()) {
        let _ = tx.send(FromWorker::Abandon);
    }
}
