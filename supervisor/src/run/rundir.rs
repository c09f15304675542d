//! The run directory: its layout, the lock that says a supervisor owns it, `state.json`
//! (rewritten atomically on every change) and `events.jsonl` (append-only).
//!
//! ```text
//! RUN_DIR/
//!   .lock             flock held by the live supervisor (status/logs test it)
//!   state.json        live state: run phase and every worker's pid, state, restarts
//!   events.jsonl      one JSON object per spawn, exit, hang, restart, give-up, stop
//!   supervisor.log    the supervisor's own log
//!   logs/<worker>.log every worker's stdout/stderr, timestamped and tagged, rotated
//! ```

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use crate::error::Error;
use crate::state::RunState;

pub const STATE_FILE: &str = "state.json";
pub const EVENTS_FILE: &str = "events.jsonl";
pub const SUPERVISOR_LOG: &str = "supervisor.log";
pub const LOCK_FILE: &str = ".lock";
pub const LOGS_DIR: &str = "logs";
/// Where runs go when `--run-dir` is not given, relative to the working directory.
pub const DEFAULT_RUNS: &str = "runs";

/// Every JSON line of a file that parses (a line a crash cut off is skipped), and whether
/// one did not.
pub fn read_jsonl(path: &Path) -> (Vec<serde_json::Value>, bool) {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut torn = false;
    let lines = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .filter_map(|l| match serde_json::from_str(l) {
            Ok(v) => Some(v),
            Err(_) => {
                torn = true;
                None
            }
        })
        .collect();
    (lines, torn)
}

pub fn now_rfc3339() -> String {
    humantime::format_rfc3339_millis(SystemTime::now()).to_string()
}

pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A run directory owned by this supervisor for as long as the value lives.
pub struct RunDir {
    pub path: PathBuf,
    lock: File,
    events: File,
    /// (device, inode) of the directory when it was taken.
    identity: (u64, u64),
}

/// What happened to a taken run directory (see [`RunDir::still_there`]), worded to follow
/// "the run directory PATH".
#[derive(Debug, thiserror::Error)]
pub enum Gone {
    #[error("was removed")]
    Removed,
    #[error("cannot be looked at ({source})")]
    Unreadable { source: io::Error },
    #[error("was replaced by another directory")]
    Replaced,
    #[error("has a lock file that cannot be looked at ({source})")]
    LockUnreadable { source: io::Error },
    #[error("has another {LOCK_FILE} than the one this supervisor holds")]
    OtherLock,
    #[error("lost its {LOCK_FILE} (removed)")]
    LockRemoved,
}

impl RunDir {
    /// Create (or adopt an empty) run dir and take its lock.
    pub fn create(path: Option<&Path>) -> Result<RunDir, Error> {
        /// Why a run dir whose lock another supervisor holds is refused.
        const BUSY: &str = "another supervisor is using it (expected a new or empty directory)";
        let path = match path {
            Some(p) => p.to_path_buf(),
            None => default_run_dir(),
        };
        let usage = |what: String| Error::Flag(format!("--run-dir {}: {what}", path.display()));
        if path.exists() {
            if !path.is_dir() {
                return Err(usage(
                    "exists and is not a directory (expected a new or empty directory)".into(),
                ));
            }
            // A supervisor that took this directory a moment ago has filled it already
            // (its .lock, logs/, maybe state.json): say who holds it, not what it holds.
            let live = ExistingRun { path: path.clone() };
            if live.supervisor_alive() {
                return Err(usage(BUSY.into()));
            }
            if path.join(STATE_FILE).exists() {
                return Err(usage(
                    "already holds a run (state.json); choose a new --run-dir or remove the old one".into(),
                ));
            }
            let mut entries = fs::read_dir(&path).map_err(|e| {
                usage(format!(
                    "cannot read it: {e} (expected a new or empty directory)"
                ))
            })?;
            if let Some(first) = entries.next() {
                let first = first
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .unwrap_or_default();
                return Err(usage(format!(
                    "is not empty (it holds {first}, and no state.json of a run) and would be overwritten; \
                     expected a new or empty directory (--resume DIR continues a stopped run)"
                )));
            }
        }
        fs::create_dir_all(path.join(LOGS_DIR)).map_err(|e| {
            usage(format!(
                "cannot create it: {e} (expected a writable directory)"
            ))
        })?;
        let path = path
            .canonicalize()
            .map_err(|e| usage(format!("cannot resolve it: {e}")))?;
        RunDir::take(path, BUSY, &usage)
    }

    /// Take over the run dir of a stopped run (`--resume`): its logs, events and ledger
    /// are appended to.
    pub fn reopen(path: &Path) -> Result<RunDir, Error> {
        let usage = |what: String| Error::Flag(format!("--resume {}: {what}", path.display()));
        if !path.join(STATE_FILE).is_file() {
            return Err(usage(
                "not a dflash-supervise run directory (no state.json in it)".into(),
            ));
        }
        let path = path
            .canonicalize()
            .map_err(|e| usage(format!("cannot resolve it: {e}")))?;
        fs::create_dir_all(path.join(LOGS_DIR))
            .map_err(|e| usage(format!("cannot write in it: {e}")))?;
        RunDir::take(
            path,
            "its supervisor is still running (expected a stopped run)",
            &usage,
        )
    }

    /// Lock the run dir for this supervisor and open its event log.
    fn take(path: PathBuf, busy: &str, usage: &dyn Fn(String) -> Error) -> Result<RunDir, Error> {
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path.join(LOCK_FILE))
            .map_err(|e| {
                usage(format!(
                    "cannot write in it: {e} (expected a writable directory)"
                ))
            })?;
        // SAFETY: flock on a file descriptor we own.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            return Err(usage(busy.to_string()));
        }
        let events = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path.join(EVENTS_FILE))
            .map_err(|e| usage(format!("cannot write in it: {e}")))?;
        let identity = fs::metadata(&path)
            .map(|m| {
                use std::os::unix::fs::MetadataExt;
                (m.dev(), m.ino())
            })
            .map_err(|e| usage(format!("cannot stat it: {e}")))?;
        Ok(RunDir {
            path,
            lock,
            events,
            identity,
        })
    }

    /// Whether the directory at `path` is still the one taken, with the lock file this
    /// supervisor holds in it. What happened to it when not.
    pub fn still_there(&self) -> Result<(), Gone> {
        use std::os::unix::fs::MetadataExt;
        let dir = match fs::metadata(&self.path) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(Gone::Removed),
            Err(source) => return Err(Gone::Unreadable { source }),
        };
        if (dir.dev(), dir.ino()) != self.identity {
            return Err(Gone::Replaced);
        }
        let held = self
            .lock
            .metadata()
            .map_err(|source| Gone::LockUnreadable { source })?;
        match fs::metadata(self.path.join(LOCK_FILE)) {
            Ok(m) if (m.dev(), m.ino()) == (held.dev(), held.ino()) => Ok(()),
            Ok(_) => Err(Gone::OtherLock),
            Err(_) => Err(Gone::LockRemoved),
        }
    }

    pub fn worker_log(&self, name: &str) -> PathBuf {
        worker_log_path(&self.path, name)
    }

    /// Append one event. The caller's fields come first; `time` is added.
    /// Restarts each worker (by name) has had in this run so far, its earlier sessions
    /// included: the `restart` events of `events.jsonl` (appended to by every session), so
    /// that `--max-restarts` counts over the whole run, a `--resume` included.
    pub fn restarts_so_far(&self) -> std::collections::HashMap<String, u32> {
        let mut n = std::collections::HashMap::new();
        let Ok(text) = fs::read_to_string(self.path.join(EVENTS_FILE)) else {
            return n;
        };
        for line in text.lines() {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
                continue; // a line cut off by a kill
            };
            if v["event"] == "restart" {
                if let Some(w) = v["worker"].as_str() {
                    *n.entry(w.to_string()).or_insert(0) += 1;
                }
            }
        }
        n
    }

    pub fn event(&mut self, event: &str, mut fields: serde_json::Map<String, serde_json::Value>) {
        let mut obj = serde_json::Map::new();
        obj.insert("time".into(), now_rfc3339().into());
        obj.insert("event".into(), event.into());
        obj.append(&mut fields);
        let mut line = serde_json::Value::Object(obj).to_string();
        line.push('\n');
        if let Err(e) = self.events.write_all(line.as_bytes()) {
            log::warn!(
                "cannot append to {}: {e}",
                self.path.join(EVENTS_FILE).display()
            );
        }
    }

    /// Replace state.json atomically: write a temporary file, then rename over.
    pub fn write_state(&self, state: &RunState) -> io::Result<()> {
        let tmp = self.path.join(".state.json.tmp");
        let mut f = File::create(&tmp)?;
        serde_json::to_writer_pretty(&mut f, state)?;
        f.write_all(b"\n")?;
        // No fsync: state.json describes live processes; after a machine crash it is stale
        // anyway, and fsync on every change would put disk latency on the restart path.
        drop(f);
        fs::rename(&tmp, self.path.join(STATE_FILE))
    }
}

pub fn worker_log_path(run_dir: &Path, name: &str) -> PathBuf {
    run_dir.join(LOGS_DIR).join(format!("{name}.log"))
}

pub fn default_run_dir() -> PathBuf {
    // 2026-11-30T10:17:05Z -> 20261130-101705
    let ts = humantime::format_rfc3339_seconds(SystemTime::now()).to_string();
    let compact: String = ts.chars().filter(|c| c.is_ascii_digit()).collect();
    let base = Path::new(DEFAULT_RUNS).join(format!("{}-{}", &compact[..8], &compact[8..14]));
    if !base.exists() {
        return base;
    }
    (1..)
        .map(|i| PathBuf::from(format!("{}-{i}", base.display())))
        .find(|p| !p.exists())
        .expect("an unused run dir name")
}

/// A run dir opened by `logs` or `status`.
pub struct ExistingRun {
    pub path: PathBuf,
}

impl ExistingRun {
    /// `dir` if given, else the newest run under ./runs.
    pub fn open(dir: Option<&Path>) -> Result<ExistingRun, Error> {
        match dir {
            Some(d) => {
                if !d.is_dir() {
                    return Err(Error::Flag(format!(
                        "--run-dir {}: no such directory (expected a run directory made by dflash-supervise)",
                        d.display()
                    )));
                }
                if !d.join(STATE_FILE).is_file() {
                    return Err(Error::Flag(format!(
                        "--run-dir {}: not a dflash-supervise run directory (no state.json in it)",
                        d.display()
                    )));
                }
                Ok(ExistingRun {
                    path: d.to_path_buf(),
                })
            }
            None => newest_run(Path::new(DEFAULT_RUNS)).map(|path| ExistingRun { path }),
        }
    }

    pub fn state(&self) -> Result<RunState, Error> {
        let p = self.path.join(STATE_FILE);
        let text = fs::read_to_string(&p)
            .map_err(|e| Error::input(format!("{}: cannot read", p.display()), e))?;
        serde_json::from_str(&text).map_err(|e| {
            Error::input(
                format!("{}: not a dflash-supervise state file", p.display()),
                e,
            )
        })
    }

    /// Whether a supervisor still holds the run's lock.
    pub fn supervisor_alive(&self) -> bool {
        let Ok(f) = File::open(self.path.join(LOCK_FILE)) else {
            return false;
        };
        // SAFETY: flock on a file descriptor we own; a shared lock we get is dropped with `f`.
        let got = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) } == 0;
        !got
    }
}

fn newest_run(runs: &Path) -> Result<PathBuf, Error> {
    let none = || {
        Error::Flag(format!(
            "no run found under {}/ (expected --run-dir DIR, or a run started from this directory)",
            runs.display()
        ))
    };
    let entries = fs::read_dir(runs).map_err(|_| none())?;
    let mut best: Option<(u64, PathBuf)> = None;
    for e in entries.flatten() {
        let p = e.path();
        let Ok(text) = fs::read_to_string(p.join(STATE_FILE)) else {
            continue;
        };
        let Ok(st) = serde_json::from_str::<RunState>(&text) else {
            continue;
        };
        if best
            .as_ref()
            .is_none_or(|(t, _)| st.started_at_unix_ms > *t)
        {
            best = Some((st.started_at_unix_ms, p));
        }
    }
    best.map(|(_, p)| p).ok_or_else(none)
}
