//! Liveness apart from progress: heartbeats come from a thread of their own, which never
//! waits for compute, and the compute loop says what it is in ([`Busy::enter`]). So a
//! step that is merely slow keeps the worker alive (`--hang-timeout` catches a process
//! that is wedged), and the supervisor holds the unit of work itself to `--step-timeout`.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use dflash_shared::exit_codes;
use dflash_shared::protocol::{self, FromWorker, Work};
use ipc_channel::ipc::IpcSender;

use crate::error::{Result, WorkerError};

/// Test-only: milliseconds every drafter training step (the gradient of one batch) is
/// made longer by, so that the end-to-end tests have a step slower than `--hang-timeout`
/// on any machine. Never set in a real run.
pub const TEST_STEP_DELAY_MS: &str = "DFLASH_TEST_STEP_DELAY_MS";

/// Test-only: milliseconds every target batch (a token batch through the target) is made
/// longer by, so that the end-to-end tests can make the targets the slow role
/// (`--targets auto`). Never set in a real run.
pub const TEST_BATCH_DELAY_MS: &str = "DFLASH_TEST_BATCH_DELAY_MS";

/// The unit of work the compute loop is in, and since when; shared with the heartbeat
/// thread.
#[derive(Clone, Default)]
pub struct Busy(Arc<Mutex<Option<(Work, Instant)>>>);

/// In a unit of work until dropped.
pub struct InWork(Arc<Mutex<Option<(Work, Instant)>>>);

impl Busy {
    /// The compute loop starts `work`; it ends when the guard is dropped.
    pub fn enter(&self, work: Work) -> InWork {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Some((work, Instant::now()));
        InWork(self.0.clone())
    }

    /// Send one heartbeat saying what the loop is in. Sent under the lock: a unit that
    /// ends ([`InWork`] dropped) cannot be reported after the message that reports its
    /// result, which the compute loop sends once the guard is gone.
    fn beat(&self, up: &IpcSender<FromWorker>, seq: u64) -> bool {
        let now = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let busy = now.map(|(work, since)| protocol::Busy {
            work,
            for_ms: since.elapsed().as_millis() as u64,
        });
        up.send(FromWorker::Heartbeat { seq, busy }).is_ok()
    }
}

impl Drop for InWork {
    fn drop(&mut self) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = None;
    }
}

/// Beat every `every` on a thread of its own until the supervisor is gone; then the
/// worker exits (WORKER_ORPHANED), even in the middle of a step: a worker never outlives
/// its supervisor.
pub fn start_heartbeats(up: IpcSender<FromWorker>, busy: Busy, every: Duration) -> Result<()> {
    std::thread::Builder::new()
        .name("heartbeat".into())
        .spawn(move || {
            let mut seq = 0;
            loop {
                seq += 1;
                if !busy.beat(&up, seq) {
                    eprintln!("control channel closed: the supervisor is gone; exiting");
                    std::process::exit(exit_codes::WORKER_ORPHANED);
                }
                std::thread::sleep(every);
            }
        })
        .map(|_| ())
        .map_err(WorkerError::io("starting the heartbeat thread".to_string()))
}

/// The test-only step delay ([`TEST_STEP_DELAY_MS`]), if set.
pub fn test_step_delay() -> Option<Duration> {
    delay_ms(TEST_STEP_DELAY_MS)
}

/// The test-only target batch delay ([`TEST_BATCH_DELAY_MS`]), if set.
pub fn test_batch_delay() -> Option<Duration> {
    delay_ms(TEST_BATCH_DELAY_MS)
}

fn delay_ms(var: &str) -> Option<Duration> {
    std::env::var(var)
        .ok()?
        .trim()
        .parse()
        .ok()
        .map(Duration::from_millis)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ipc_channel::ipc;

    fn beat(busy: &Busy) -> Option<protocol::Busy> {
        let (tx, rx) = ipc::channel().unwrap();
        assert!(busy.beat(&tx, 1));
        match rx.recv().unwrap() {
            FromWorker::Heartbeat { seq: 1, busy } => busy,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_heartbeat_names_the_unit_of_work_only_while_the_loop_is_in_it() {
        let busy = Busy::default();
        assert_eq!(beat(&busy), None);
        let work = Work::Step {
            step: 3,
            batch_id: 7,
        };
        let guard = busy.enter(work);
        assert_eq!(beat(&busy).map(|b| b.work), Some(work));
        drop(guard);
        assert_eq!(beat(&busy), None, "the unit ended with its guard");
    }
}
