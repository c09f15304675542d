//! Where a worker is: between lives ([`Status`]) and within one ([`LifeState`]). Each
//! variant carries the data that exists in that state and nothing else, so a state that
//! cannot happen (a channel to a worker that never said hello, a drained life that still
//! takes work) cannot be written.

use std::process::ExitStatus;
use std::sync::Arc;
use std::time::Instant;

use dflash_shared::protocol::{FatalKind, ToWorker};
use ipc_channel::ipc::IpcSender;

use super::launcher::Process;
use super::LifeId;

/// A worker between and within its lives.
pub(super) enum Status {
    /// Not started yet.
    NotStarted,
    /// A process of this worker exists (or has just ended and is being drained).
    Live(Life),
    /// Waiting to be restarted at `until`.
    Backoff { until: Instant },
    /// Stopped with the run.
    Exited,
    /// Will not run again: its restart budget is spent, it can never run here, or it
    /// could not be started.
    Failed,
    /// Its device went to the other role (`--targets auto`); it runs again only if a
    /// device comes back to its role.
    Moved,
}

/// One start of a worker.
pub(super) struct Life {
    pub id: LifeId,
    pub pid: u32,
    /// The process and its group; signal the group only through it.
    pub process: Arc<dyn Process>,
    pub started: Instant,
    pub started_wall: String,
    /// Its control channel's one-shot server, woken by `control::abandon` if the worker
    /// dies before connecting.
    pub server_name: String,
    pub last_beat: Instant,
    /// The unit of work its compute loop is in, as its last heartbeat said (boxed: most
    /// lives are between units most of the time).
    pub in_work: Option<Box<super::steps::InWork>>,
    /// What the worker said, in its last message, when it ends on an error.
    pub fatal: Option<(FatalKind, String)>,
    /// Its control thread ended before a hello: no hello can come any more.
    pub control_ended: bool,
    pub state: LifeState,
}

pub(super) enum LifeState {
    /// Spawned; no hello yet.
    Starting,
    /// Said hello and takes work. `to_worker` is `None` once its control channel closed.
    Ready {
        to_worker: Option<IpcSender<ToWorker>>,
    },
    /// Asked to stop: by a Shutdown message when `connected`, else by SIGTERM.
    Stopping {
        to_worker: Option<IpcSender<ToWorker>>,
        connected: bool,
    },
    /// Killed by the supervisor for `reason`; its pidfd says when it is gone.
    Killed {
        reason: String,
        to_worker: Option<IpcSender<ToWorker>>,
        connected: bool,
        asked_to_stop: bool,
    },
    /// The process is gone (`status`) before its hello was taken: the control thread,
    /// woken, says whether a hello came first (the life then drains) or none did.
    Unanswered {
        status: ExitStatus,
        killed_for: Option<String>,
        asked_to_stop: bool,
    },
    /// The process is gone (`status`, seen at `since`); its control channel, still open, is
    /// read to its end before the death is handled. Only a connected life drains.
    Draining {
        status: ExitStatus,
        since: Instant,
        killed_for: Option<String>,
        asked_to_stop: bool,
    },
}

impl Status {
    pub fn life(&self) -> Option<&Life> {
        match self {
            Status::Live(l) => Some(l),
            _ => None,
        }
    }

    pub fn life_mut(&mut self) -> Option<&mut Life> {
        match self {
            Status::Live(l) => Some(l),
            _ => None,
        }
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            Status::NotStarted => "starting",
            Status::Live(l) => l.state.as_str(),
            Status::Backoff { .. } => "backoff",
            Status::Exited => "exited",
            Status::Failed => "failed",
            Status::Moved => "moved",
        }
    }
}

impl Life {
    /// The channel to send orders on, while the worker can read them.
    pub fn to_worker(&self) -> Option<&IpcSender<ToWorker>> {
        match &self.state {
            LifeState::Ready { to_worker }
            | LifeState::Stopping { to_worker, .. }
            | LifeState::Killed { to_worker, .. } => to_worker.as_ref(),
            LifeState::Starting | LifeState::Unanswered { .. } | LifeState::Draining { .. } => None,
        }
    }

    /// The channel, only while the worker takes new work.
    pub fn takes_work(&self) -> Option<&IpcSender<ToWorker>> {
        match &self.state {
            LifeState::Ready { to_worker } => to_worker.as_ref(),
            _ => None,
        }
    }

    /// Whether it said hello.
    pub fn connected(&self) -> bool {
        match &self.state {
            LifeState::Starting | LifeState::Unanswered { .. } => false,
            LifeState::Ready { .. } | LifeState::Draining { .. } => true,
            LifeState::Stopping { connected, .. } | LifeState::Killed { connected, .. } => {
                *connected
            }
        }
    }

    pub fn killed_for(&self) -> Option<&str> {
        match &self.state {
            LifeState::Killed { reason, .. } => Some(reason),
            LifeState::Draining { killed_for, .. } | LifeState::Unanswered { killed_for, .. } => {
                killed_for.as_deref()
            }
            _ => None,
        }
    }

    pub fn asked_to_stop(&self) -> bool {
        match &self.state {
            LifeState::Stopping { .. } => true,
            LifeState::Killed { asked_to_stop, .. }
            | LifeState::Draining { asked_to_stop, .. }
            | LifeState::Unanswered { asked_to_stop, .. } => *asked_to_stop,
            LifeState::Starting | LifeState::Ready { .. } => false,
        }
    }

    /// The process is still there and the supervisor has not killed it: the hang watch
    /// applies.
    pub fn watched(&self) -> bool {
        !matches!(
            self.state,
            LifeState::Killed { .. } | LifeState::Draining { .. } | LifeState::Unanswered { .. }
        )
    }

    /// When it died, if it is draining.
    pub fn died(&self) -> Option<(ExitStatus, Instant)> {
        match &self.state {
            LifeState::Draining { status, since, .. } => Some((*status, *since)),
            _ => None,
        }
    }

    /// It said hello with this channel. Returns `false` when it had died already (its
    /// hello was taken after its death): the life drains its channel, then ends.
    pub fn connect(&mut self, to_worker: IpcSender<ToWorker>, now: Instant) -> bool {
        let state = std::mem::replace(&mut self.state, LifeState::Starting);
        let (alive, state) = match state {
            LifeState::Unanswered {
                status,
                killed_for,
                asked_to_stop,
            } => (
                false,
                LifeState::Draining {
                    status,
                    since: now,
                    killed_for,
                    asked_to_stop,
                },
            ),
            _ => (
                true,
                LifeState::Ready {
                    to_worker: Some(to_worker),
                },
            ),
        };
        self.state = state;
        alive
    }

    /// The control thread found no hello: the exit it waited for, to be handled now.
    pub fn abandoned(&self) -> Option<ExitStatus> {
        match &self.state {
            LifeState::Unanswered { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// The supervisor killed it (the first reason is kept). Nothing changes for a life
    /// that is already dead.
    pub fn mark_killed(&mut self, why: &str) {
        let state = std::mem::replace(&mut self.state, LifeState::Starting);
        self.state = match state {
            LifeState::Starting => LifeState::Killed {
                reason: why.into(),
                to_worker: None,
                connected: false,
                asked_to_stop: false,
            },
            LifeState::Ready { to_worker } => LifeState::Killed {
                reason: why.into(),
                to_worker,
                connected: true,
                asked_to_stop: false,
            },
            LifeState::Stopping {
                to_worker,
                connected,
            } => LifeState::Killed {
                reason: why.into(),
                to_worker,
                connected,
                asked_to_stop: true,
            },
            s @ (LifeState::Killed { .. }
            | LifeState::Draining { .. }
            | LifeState::Unanswered { .. }) => s,
        };
    }

    /// It was asked to stop.
    pub fn mark_asked_to_stop(&mut self) {
        match &mut self.state {
            LifeState::Starting => {
                self.state = LifeState::Stopping {
                    to_worker: None,
                    connected: false,
                }
            }
            LifeState::Ready { to_worker } => {
                self.state = LifeState::Stopping {
                    to_worker: to_worker.take(),
                    connected: true,
                }
            }
            LifeState::Killed { asked_to_stop, .. }
            | LifeState::Draining { asked_to_stop, .. }
            | LifeState::Unanswered { asked_to_stop, .. } => *asked_to_stop = true,
            LifeState::Stopping { .. } => {}
        }
    }

    /// Its control channel ended. Returns the exit status if it had already died (the
    /// drain is over).
    pub fn channel_lost(&mut self) -> Option<ExitStatus> {
        if !self.connected() {
            self.control_ended = true;
        }
        match &mut self.state {
            LifeState::Ready { to_worker }
            | LifeState::Stopping { to_worker, .. }
            | LifeState::Killed { to_worker, .. } => {
                *to_worker = None;
                None
            }
            LifeState::Draining { status, .. } | LifeState::Unanswered { status, .. } => {
                Some(*status)
            }
            LifeState::Starting => None,
        }
    }

    /// The process is gone. Returns `true` when the death can be handled now, `false` when
    /// its open channel is drained first.
    ///
    /// A life that had not said hello waits for its control thread (woken by the caller's
    /// abandon): a hello may have been sent before the death and not yet taken, and must
    /// not be lost (it decides whether the worker program ever connects).
    pub fn exited(&mut self, status: ExitStatus, now: Instant) -> bool {
        let (killed_for, asked_to_stop) =
            (self.killed_for().map(String::from), self.asked_to_stop());
        if !self.connected() {
            if self.control_ended {
                return true;
            }
            self.state = LifeState::Unanswered {
                status,
                killed_for,
                asked_to_stop,
            };
            return false;
        }
        if self.to_worker().is_none() {
            return true;
        }
        self.state = LifeState::Draining {
            status,
            since: now,
            killed_for,
            asked_to_stop,
        };
        false
    }
}

impl LifeState {
    fn as_str(&self) -> &'static str {
        match self {
            LifeState::Starting | LifeState::Unanswered { .. } => "starting",
            LifeState::Ready { .. } => "running",
            LifeState::Stopping { .. } => "stopping",
            LifeState::Killed {
                asked_to_stop: true,
                ..
            }
            | LifeState::Draining {
                asked_to_stop: true,
                ..
            } => "stopping",
            LifeState::Killed {
                connected: false, ..
            } => "starting",
            LifeState::Killed { .. } | LifeState::Draining { .. } => "running",
        }
    }
}
