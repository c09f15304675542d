//! The reaper: a tiny helper process that outlives a supervisor killed with SIGKILL just
//! long enough to SIGKILL every worker process group it was told about.
//!
//! `PR_SET_PDEATHSIG` kills each worker when the supervisor dies, but not what a worker
//! started itself (a data-loader, a compiler): those stay in the worker's process group.
//! The supervisor tells the reaper `+PGID` on spawn and `-PGID` once a group is gone, over
//! the reaper's stdin; when stdin hits EOF (the supervisor exited, however it exited) the
//! reaper kills the groups still listed and exits.

use std::collections::BTreeSet;
use std::io::{BufRead, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use nix::sys::signal::{signal, SigHandler, Signal};

pub struct Reaper {
    /// The reaper process.
    pub pid: u32,
    stdin: Mutex<ChildStdin>,
    /// Set when this supervisor closes the reaper's stdin itself: its exit is then the
    /// expected one, not a death to warn about.
    closing: Arc<AtomicBool>,
}

impl Reaper {
    pub fn start(supervisor_exe: &Path) -> std::io::Result<Reaper> {
        let mut cmd = Command::new(supervisor_exe);
        cmd.arg("__reap")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            // Its own group: a terminal's Ctrl-C must not reach it.
            .process_group(0);
        Reaper::spawn(cmd, |why| log::warn!("{why}"))
    }

    /// Start `cmd` as the reaper, with a thread that waits for it: should it die while
    /// this supervisor still needs it, `on_death` gets the one line that says so.
    fn spawn(
        mut cmd: Command,
        on_death: impl FnOnce(String) + Send + 'static,
    ) -> std::io::Result<Reaper> {
        let mut child = cmd.stdin(Stdio::piped()).spawn()?;
        let stdin = child.stdin.take().expect("piped stdin");
        let pid = child.id();
        let closing = Arc::new(AtomicBool::new(false));
        let watch = closing.clone();
        // It outlives us by design when we are killed; while we run, this thread waits for
        // it (and so reaps it).
        std::thread::Builder::new()
            .name("reaper-watch".into())
            .spawn(move || watch_reaper(child, &watch, on_death))?;
        Ok(Reaper {
            pid,
            stdin: Mutex::new(stdin),
            closing,
        })
    }

    pub fn watch(&self, pgid: u32) {
        self.send(&format!("+{pgid}\n"));
    }

    pub fn unwatch(&self, pgid: u32) {
        self.send(&format!("-{pgid}\n"));
    }

    fn send(&self, line: &str) {
        if let Ok(mut s) = self.stdin.lock() {
            let _ = s.write_all(line.as_bytes());
        }
    }
}

impl Drop for Reaper {
    fn drop(&mut self) {
        // Closing stdin (the field, dropped after this) makes the reaper exit: expected.
        self.closing.store(true, Ordering::SeqCst);
    }
}

/// Wait for the reaper; if it ends while the supervisor still holds its stdin open, say
/// what is lost.
fn watch_reaper(mut child: Child, closing: &AtomicBool, on_death: impl FnOnce(String)) {
    let pid = child.id();
    let status = child.wait();
    if closing.load(Ordering::SeqCst) {
        return;
    }
    let how = match status {
        Ok(s) => describe(s),
        Err(e) => format!("cannot be waited for ({e})"),
    };
    on_death(format!(
        "the reaper (pid {pid}) {how}: if the supervisor is killed now, processes forked by \
         workers are no longer killed with it (the workers themselves still are)"
    ));
}

fn describe(s: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (s.code(), s.signal()) {
        (_, Some(sig)) => match Signal::try_from(sig) {
            Ok(name) => format!("was killed by {name}"),
            Err(_) => format!("was killed by signal {sig}"),
        },
        (Some(code), None) => format!("exited with code {code}"),
        (None, None) => "ended".into(),
    }
}

use std::os::unix::process::CommandExt;

/// Body of `dflash-supervise __reap`.
pub fn run() -> i32 {
    for sig in [
        Signal::SIGINT,
        Signal::SIGTERM,
        Signal::SIGHUP,
        Signal::SIGUSR1,
        Signal::SIGUSR2,
    ] {
        // SAFETY: installing SIG_IGN has no handler code to be unsafe in.
        unsafe {
            let _ = signal(sig, SigHandler::SigIgn);
        }
    }
    let mut groups = BTreeSet::new();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let (op, num) = line.split_at(line.len().min(1));
        let Ok(pgid) = num.trim().parse::<u32>() else {
            continue;
        };
        match op {
            "+" => {
                groups.insert(pgid);
            }
            "-" => {
                groups.remove(&pgid);
            }
            _ => {}
        }
    }
    for pgid in groups {
        if pgid > 1 {
            crate::run::process::signal_group(pgid, Signal::SIGKILL);
        }
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    /// A stand-in reaper that lives until its stdin closes, as `__reap` does.
    fn stand_in() -> Command {
        let mut c = Command::new("sh");
        c.args(["-c", "cat >/dev/null"]).stdout(Stdio::null());
        c
    }

    #[test]
    fn a_killed_reaper_is_noticed_and_its_lost_guarantee_named() {
        let (tx, rx) = mpsc::channel();
        let r = Reaper::spawn(stand_in(), move |why| tx.send(why).unwrap()).unwrap();
        r.watch(4242);
        // Killed as the OOM killer or a stray `kill -9` would.
        let pid = nix::unistd::Pid::from_raw(r.pid as i32);
        nix::sys::signal::kill(pid, Signal::SIGKILL).unwrap();
        let why = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the reaper's death is noticed");
        assert!(
            why.starts_with(&format!("the reaper (pid {}) was killed by SIGKILL", r.pid))
                && why.contains("processes forked by workers are no longer killed")
                && !why.contains('\n'),
            "{why}"
        );
        // Writing to a dead reaper is no error either (SIGPIPE is ignored in a run).
        r.watch(4243);
    }

    #[test]
    fn a_reaper_that_exits_because_the_supervisor_closed_it_is_not_a_death() {
        let (tx, rx) = mpsc::channel::<String>();
        let r = Reaper::spawn(stand_in(), move |why| tx.send(why).unwrap()).unwrap();
        drop(r);
        // The thread ends without a word: the sender is dropped unsent.
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(10)),
            Err(mpsc::RecvTimeoutError::Disconnected)
        );
    }
}
