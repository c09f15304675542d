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
use std::process::{ChildStdin, Command, Stdio};
use std::sync::Mutex;

use nix::sys::signal::{signal, SigHandler, Signal};

pub struct Reaper {
    stdin: Mutex<ChildStdin>,
}

impl Reaper {
    pub fn start(supervisor_exe: &Path) -> std::io::Result<Reaper> {
        let mut child = Command::new(supervisor_exe)
            .arg("__reap")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            // Its own group: a terminal's Ctrl-C must not reach it.
            .process_group(0)
            .spawn()?;
        let stdin = child.stdin.take().expect("piped stdin");
        // The child is never waited for: it outlives us by design, or exits when we do.
        std::mem::forget(child);
        Ok(Reaper {
            stdin: Mutex::new(stdin),
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
