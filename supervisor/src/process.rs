//! Starting worker processes and watching them die.
//!
//! Every worker is forked from one long-lived spawner thread: `PR_SET_PDEATHSIG` fires
//! when the *thread* that forked the child exits, not the process, so forking from
//! short-lived threads would kill workers at random. Each worker leads its own process
//! group (a terminal's Ctrl-C reaches only the supervisor, which then decides), and is
//! watched through a pidfd: race-free against pid reuse, and the same fd is used to kill.

use std::ffi::OsString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
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
        thread::Builder::new().name("spawner".into()).spawn(move || {
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
        rx.recv().map_err(|_| io::Error::other("spawner thread is gone"))?
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
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            // The supervisor may have died between fork and prctl: then nobody would send
            // the death signal, so leave now.
            if libc::getppid() != parent {
                return Err(io::Error::from_raw_os_error(libc::ESRCH));
            }
            // Nothing but stdio and the pools crosses exec: a descriptor inherited by
            // accident (ipc-channel accepts control connections without close-on-exec)
            // would keep another worker's channel open after that worker dies.
            libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, libc::CLOSE_RANGE_CLOEXEC);
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
            let mut p = libc::pollfd { fd: self.0.as_raw_fd(), events: libc::POLLIN, revents: 0 };
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

/// Signal a whole process group. Missing groups are not an error.
pub fn signal_group(pgid: u32, sig: Signal) {
    let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pgid as i32), sig);
}

/// "exit code 3" / "killed by signal SIGKILL"
pub fn describe_status(status: &ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    if let Some(code) = status.code() {
        format!("exit code {code}")
    } else if let Some(sig) = status.signal() {
        let name = Signal::try_from(sig).map(|s| s.as_str().to_string()).unwrap_or_else(|_| format!("signal {sig}"));
        format!("killed by signal {name}{}", if status.core_dumped() { " (core dumped)" } else { "" })
    } else {
        format!("{status}")
    }
}
