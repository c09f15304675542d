//! Starting worker processes and watching them die.
//!
//! Every worker is forked from one long-lived spawner thread: `PR_SET_PDEATHSIG` fires
//! when the *thread* that forked the child exits, not the process, so forking from
//! short-lived threads would kill workers at random. Each worker leads its own process
//! group (a terminal's Ctrl-C reaches only the supervisor, which then decides), and is
//! watched through a pidfd: race-free against pid reuse, and the same fd is used to kill.
//! Its group is signalled only through [`GroupLeader`], which never signals a group whose
//! leader it has reaped.

use std::ffi::OsString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{mpsc, Mutex};
use std::thread;

use nix::sys::signal::Signal;

pub struct SpawnSpec {
    pub program: PathBuf,
    /// Descriptors the worker inherits (the pool memfds); everything else is close-on-exec.
    pub inherit_fds: Vec<std::os::fd::RawFd>,
    pub args: Vec<OsString>,
    pub env: Vec<(String, String)>,
}

type Request = (SpawnSpec, mpsc::Sender<io::Result<Child>>);

/// Handle to the spawner thread.
pub struct Spawner {
    tx: mpsc::Sender<Request>,
}

impl Spawner {
    pub fn start() -> io::Result<Spawner> {
        let (tx, rx) = mpsc::channel::<Request>();
        // The thread must outlive every worker it forks; it ends only when the supervisor
        // drops the Spawner, after every worker is gone.
        thread::Builder::new()
            .name("spawner".into())
            .spawn(move || {
                for (spec, reply) in rx {
                    let _ = reply.send(spawn_now(spec));
                }
            })?;
        Ok(Spawner { tx })
    }

    pub fn spawn(&self, spec: SpawnSpec) -> io::Result<Child> {
        let (tx, rx) = mpsc::channel();
        self.tx
            .send((spec, tx))
            .map_err(|_| io::Error::other("spawner thread is gone"))?;
        rx.recv()
            .map_err(|_| io::Error::other("spawner thread is gone"))?
    }
}

fn spawn_now(spec: SpawnSpec) -> io::Result<Child> {
    let parent = std::process::id() as libc::pid_t;
    let mut cmd = Command::new(&spec.program);
    cmd.args(&spec.args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    cmd.envs(spec.env.iter().map(|(k, v)| (k, v)));
    let inherit = spec.inherit_fds.clone();
    // SAFETY: the closure runs between fork and exec and only makes async-signal-safe
    // calls (prctl, getppid, close_range, fcntl) and builds an io::Error from a raw errno (no allocation).
    unsafe {
        cmd.pre_exec(move || {
            dflash_shared::child::die_with(parent)?;
            // Nothing but stdio and the pools crosses exec: a descriptor inherited by
            // accident (ipc-channel accepts control connections without close-on-exec)
            // would keep another worker's channel open after that worker dies.
            libc::syscall(
                libc::SYS_close_range,
                3u32,
                u32::MAX,
                libc::CLOSE_RANGE_CLOEXEC,
            );
            for &fd in &inherit {
                dflash_shared::pool::inherit_fd(fd)?;
            }
            Ok(())
        });
    }
    cmd.spawn()
}

/// A pidfd: a handle on one process that can't be confused with a later process of the
/// same pid.
pub struct Pidfd(OwnedFd);

impl Pidfd {
    pub fn open(pid: u32) -> io::Result<Pidfd> {
        // SAFETY: plain syscall; on success the kernel hands us a new fd that we own.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a freshly opened descriptor owned by nobody else.
        Ok(Pidfd(unsafe { OwnedFd::from_raw_fd(fd as i32) }))
    }

    /// Send a signal to exactly this process (ESRCH once it has been reaped: ignored).
    pub fn signal(&self, sig: Signal) -> io::Result<()> {
        // SAFETY: plain syscall on an fd we own; no siginfo.
        let r = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.0.as_raw_fd(),
                sig as libc::c_int,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ESRCH) {
                return Err(e);
            }
        }
        Ok(())
    }

    /// Block until the process has exited (the pidfd turns readable).
    pub fn wait_exit(&self) -> io::Result<()> {
        loop {
            let mut p = libc::pollfd {
                fd: self.0.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd, no timeout.
            let r = unsafe { libc::poll(&mut p, 1, -1) };
            if r >= 0 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

/// Signal a whole process group by number. Missing groups are not an error.
///
/// Only for a group whose leader is not ours to reap (the `__reap` helper's groups); a
/// worker's group is signalled through its [`GroupLeader`], which knows whether the leader was
/// reaped and its pid (the group id) possibly reused.
pub fn signal_group(pgid: u32, sig: Signal) {
    let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pgid as i32), sig);
}

/// A worker process that leads its own process group, and the only way to signal that
/// group.
///
/// The group id is the leader's pid, and a pid can be reused once its process has been
/// reaped: a `killpg` after the reap could hit a stranger's group. So the reap and every
/// group signal take the same lock, and the reap marks the leader gone before it lets go:
/// a group signal either runs while the leader is still at least a zombie (its pid, hence
/// the group id, is then still taken) or sees that it was reaped and sends nothing.
pub struct GroupLeader {
    pid: u32,
    pidfd: Pidfd,
    /// The leader, until it is reaped (then `None`).
    leader: Mutex<Option<Child>>,
}

/// What a group signal did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupSignal {
    /// killpg was called while the leader was not yet reaped.
    Sent,
    /// The leader was already reaped: its group id may belong to someone else now.
    LeaderReaped,
}

impl GroupLeader {
    /// Take charge of a freshly spawned group leader (spawned with `process_group(0)`).
    pub fn new(child: Child) -> Result<GroupLeader, (Child, io::Error)> {
        let pid = child.id();
        match Pidfd::open(pid) {
            Ok(pidfd) => Ok(GroupLeader {
                pid,
                pidfd,
                leader: Mutex::new(Some(child)),
            }),
            Err(e) => Err((child, e)),
        }
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Signal the leader only, through its pidfd (never a stranger).
    pub fn signal(&self, sig: Signal) -> io::Result<()> {
        self.pidfd.signal(sig)
    }

    /// Signal the leader's whole group, unless the leader has been reaped.
    pub fn signal_group(&self, sig: Signal) -> GroupSignal {
        let leader = self.leader.lock().unwrap_or_else(|e| e.into_inner());
        if leader.is_none() {
            return GroupSignal::LeaderReaped;
        }
        // The lock is held: the leader cannot be reaped (and its pid reused) before
        // killpg returns.
        signal_group(self.pid, sig);
        GroupSignal::Sent
    }

    /// Block until the leader exits, SIGKILL what is left of its group (its children), run
    /// `before_reap`, then reap it. All of it under the lock that [`signal_group`] takes.
    ///
    /// [`signal_group`]: GroupLeader::signal_group
    pub fn wait_and_reap(&self, before_reap: impl FnOnce()) -> io::Result<ExitStatus> {
        if let Err(e) = self.pidfd.wait_exit() {
            log::error!(
                "waiting on the pidfd of pid {}: {e}; waiting with waitid",
                self.pid
            );
            wait_no_reap(self.pid)?;
        }
        let mut leader = self.leader.lock().unwrap_or_else(|e| e.into_inner());
        let Some(mut child) = leader.take() else {
            return Err(io::Error::other(format!(
                "pid {} was reaped already",
                self.pid
            )));
        };
        // The leader is a zombie until the wait below, so its pid (= the group id) cannot
        // be reused yet: killing the group here cannot hit a stranger.
        signal_group(self.pid, Signal::SIGKILL);
        before_reap();
        // It has exited: this returns at once, so the lock is not held for long.
        child.wait()
    }
}

/// Block until our child `pid` has exited, leaving it a zombie (not reaped).
fn wait_no_reap(pid: u32) -> io::Result<()> {
    loop {
        // SAFETY: zeroed siginfo is a valid out-parameter; plain syscall.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        let r = unsafe {
            libc::waitid(
                libc::P_PID,
                pid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOWAIT,
            )
        };
        if r == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// "exit code 3" / "killed by signal SIGKILL"
pub fn describe_status(status: &ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    if let Some(code) = status.code() {
        format!("exit code {code}")
    } else if let Some(sig) = status.signal() {
        let name = Signal::try_from(sig)
            .map(|s| s.as_str().to_string())
            .unwrap_or_else(|_| format!("signal {sig}"));
        format!(
            "killed by signal {name}{}",
            if status.core_dumped() {
                " (core dumped)"
            } else {
                ""
            }
        )
    } else {
        format!("{status}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;
    use std::sync::Arc;

    fn sleeper() -> GroupLeader {
        let child = Command::new("sleep")
            .arg("1000")
            .process_group(0)
            .spawn()
            .expect("spawn sleep");
        GroupLeader::new(child).map_err(|(_, e)| e).expect("pidfd")
    }

    #[test]
    fn a_group_is_never_signalled_once_its_leader_is_reaped() {
        let g = Arc::new(sleeper());
        // Alive: its group exists and is ours to signal.
        assert_eq!(g.signal_group(Signal::SIGCONT), GroupSignal::Sent);
        let waiter = {
            let g = g.clone();
            thread::spawn(move || {
                g.wait_and_reap(|| {
                    // Under the reap's lock, before the reap: the group still exists.
                    assert!(nix::sys::signal::killpg(
                        nix::unistd::Pid::from_raw(g.pid() as i32),
                        None
                    )
                    .is_ok());
                })
            })
        };
        g.signal(Signal::SIGKILL).unwrap();
        let status = waiter.join().expect("waiter thread").expect("reaped");
        assert_eq!(status.signal(), Some(libc::SIGKILL));
        // Reaped: its pid, and so its group id, may belong to a stranger by now.
        assert_eq!(g.signal_group(Signal::SIGKILL), GroupSignal::LeaderReaped);
        assert_eq!(g.signal_group(Signal::SIGTERM), GroupSignal::LeaderReaped);
        // A second reap is refused rather than waiting on someone else's process.
        assert!(g.wait_and_reap(|| panic!("no second reap")).is_err());
    }

    #[test]
    fn group_signals_racing_the_reap_stop_at_the_reap() {
        // Hammer the group from another thread while the leader dies and is reaped: once
        // the reap has returned, no call reports a signal sent.
        for _ in 0..20 {
            let g = Arc::new(sleeper());
            let reaped = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let hammer = {
                let (g, reaped) = (g.clone(), reaped.clone());
                thread::spawn(move || loop {
                    let was_reaped = reaped.load(std::sync::atomic::Ordering::SeqCst);
                    let r = g.signal_group(Signal::SIGCONT);
                    if was_reaped {
                        assert_eq!(
                            r,
                            GroupSignal::LeaderReaped,
                            "signalled a reaped leader's group"
                        );
                        return;
                    }
                })
            };
            g.signal(Signal::SIGKILL).unwrap();
            g.wait_and_reap(|| {}).unwrap();
            reaped.store(true, std::sync::atomic::Ordering::SeqCst);
            hammer.join().expect("no group signal after the reap");
        }
    }
}
