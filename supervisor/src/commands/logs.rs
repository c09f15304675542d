//! `dflash-supervise logs`: print the end of a worker's log, and follow it live across the
//! worker's restarts (one file per worker for the whole run) and across log rotation.

use std::fs::{self, File};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::time::Duration;

use dflash_shared::{exit_codes, WorkerName};

use crate::cli::LogsArgs;
use crate::error::Error;
use crate::run::rundir::{worker_log_path, ExistingRun};
use crate::run::worker_log::backup_path;

/// How often a follower looks for new lines.
const POLL: Duration = Duration::from_millis(100);

pub fn run(args: LogsArgs) -> Result<i32, Error> {
    let run = ExistingRun::open(args.run_dir.as_deref())?;
    let state = run.state()?;
    let known: Vec<String> = state.workers.iter().map(|w| w.name.clone()).collect();
    let names = if args.all {
        known.clone()
    } else {
        let w = args.worker.clone().unwrap_or_default();
        w.parse::<WorkerName>()
            .map_err(|e| Error::input(w.to_string(), e))?;
        if !known.contains(&w) {
            return Err(Error::Flag(format!(
                "no worker '{w}' in run {} (expected one of: {})",
                run.path.display(),
                known.join(", ")
            )));
        }
        vec![w]
    };
    let logs_dir = run.path.join(crate::run::rundir::LOGS_DIR);
    if !logs_dir.is_dir() {
        return Err(Error::Flag(format!(
            "{}: no such directory, so no worker log to show (expected the logs/ of run {}; was it moved or deleted?)",
            logs_dir.display(),
            run.path.display()
        )));
    }
    let mut followers: Vec<Follower> = names
        .iter()
        .map(|n| {
            Follower::new(
                worker_log_path(&run.path, n),
                args.all.then(|| format!("[{n}] ")),
            )
        })
        .collect();
    let stdout = io::stdout();
    let mut out = stdout.lock();
    for f in &mut followers {
        for line in f.start(args.lines) {
            write_line(&mut out, f.prefix.as_deref(), &line)?;
        }
    }
    out.flush().map_err(broken)?;
    if !args.follow {
        return Ok(exit_codes::SUCCESS);
    }
    loop {
        // Read the lock before the files: once it is free no line can follow the last read.
        let ended = !run.supervisor_alive();
        for f in &mut followers {
            f.poll(&mut out)?;
        }
        out.flush().map_err(broken)?;
        if ended {
            return Ok(exit_codes::SUCCESS);
        }
        std::thread::sleep(POLL);
    }
}

fn broken(e: io::Error) -> Error {
    Error::io("cannot write to", "stdout", e)
}

fn write_line(out: &mut impl Write, prefix: Option<&str>, line: &str) -> Result<(), Error> {
    writeln!(out, "{}{line}", prefix.unwrap_or("")).map_err(broken)
}

fn lines_of(bytes: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(bytes)
        .lines()
        .map(str::to_string)
        .collect()
}

struct Follower {
    path: PathBuf,
    prefix: Option<String>,
    file: Option<File>,
    ino: u64,
    partial: Vec<u8>,
    /// Inodes of the files already printed whole (the newest few): a rotation racing the
    /// reads renames files under us, and none may be printed twice.
    done: std::collections::VecDeque<u64>,
}

impl Follower {
    fn new(path: PathBuf, prefix: Option<String>) -> Follower {
        Follower {
            path,
            prefix,
            file: None,
            ino: 0,
            partial: Vec::new(),
            done: std::collections::VecDeque::new(),
        }
    }

    /// Open the log and return its last `n` lines; following continues from exactly there.
    fn start(&mut self, n: usize) -> Vec<String> {
        let mut lines = Vec::new();
        if let Ok(mut f) = File::open(&self.path) {
            let mut buf = Vec::new();
            if f.read_to_end(&mut buf).is_ok() {
                let complete = buf.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
                self.partial = buf[complete..].to_vec();
                lines = lines_of(&buf[..complete]);
            }
            self.ino = f.metadata().map(|m| m.ino()).unwrap_or(0);
            self.file = Some(f);
        }
        // A rotation while we read renames the files under us (each keeps its inode): read
        // every file once by inode, or the log just read would come again as `.1`.
        let mut seen = std::collections::HashSet::from([self.ino]);
        let mut k = 1;
        while lines.len() < n {
            let Ok(mut f) = File::open(backup_path(&self.path, k)) else {
                break;
            };
            k += 1;
            let ino = f.metadata().map(|m| m.ino()).unwrap_or(0);
            if !seen.insert(ino) {
                continue;
            }
            let mut bytes = Vec::new();
            if f.read_to_end(&mut bytes).is_err() {
                break;
            }
            let mut older = lines_of(&bytes);
            older.append(&mut lines);
            lines = older;
        }
        let skip = lines.len().saturating_sub(n);
        lines.split_off(skip)
    }

    fn emit(&mut self, bytes: &[u8], out: &mut impl Write) -> Result<(), Error> {
        self.partial.extend_from_slice(bytes);
        if let Some(end) = self.partial.iter().rposition(|&b| b == b'\n') {
            let rest = self.partial.split_off(end + 1);
            for line in lines_of(&self.partial) {
                write_line(out, self.prefix.as_deref(), &line)?;
            }
            self.partial = rest;
        }
        Ok(())
    }

    fn mark_done(&mut self, ino: u64) {
        self.done.push_back(ino);
        if self.done.len() > 64 {
            self.done.pop_front();
        }
    }

    fn flush_partial(&mut self, out: &mut impl Write) -> Result<(), Error> {
        if !self.partial.is_empty() {
            let p = std::mem::take(&mut self.partial);
            write_line(out, self.prefix.as_deref(), &String::from_utf8_lossy(&p))?;
        }
        Ok(())
    }

    fn drain(&mut self, out: &mut impl Write) -> Result<(), Error> {
        let mut buf = Vec::new();
        if let Some(f) = self.file.as_mut() {
            let _ = f.read_to_end(&mut buf);
        }
        self.emit(&buf, out)
    }

    /// Print what was appended since the last call, following a rotation if one happened.
    fn poll(&mut self, out: &mut impl Write) -> Result<(), Error> {
        self.drain(out)?;
        let Ok(meta) = fs::metadata(&self.path) else {
            return Ok(());
        };
        if self.file.is_some() && meta.ino() == self.ino {
            let pos = self
                .file
                .as_mut()
                .and_then(|f| f.stream_position().ok())
                .unwrap_or(0);
            if meta.len() < pos {
                // Truncated in place: start again from the top.
                if let Some(f) = self.file.as_mut() {
                    let _ = f.seek(SeekFrom::Start(0));
                }
            }
            return Ok(());
        }
        if self.file.is_some() {
            // Rotated. Our fd still reads the old file, now drained. If it rotated more than
            // once since the last poll, the files between it and the new log are backups
            // newer than it: print them oldest first.
            self.flush_partial(out)?;
            self.mark_done(self.ino);
            let old = (1..)
                .take_while(|&k| backup_path(&self.path, k).exists())
                .find(|&k| {
                    fs::metadata(backup_path(&self.path, k))
                        .map(|m| m.ino() == self.ino)
                        .unwrap_or(false)
                });
            match old {
                Some(k) => {
                    for j in (1..k).rev() {
                        let Ok(mut f) = File::open(backup_path(&self.path, j)) else {
                            continue;
                        };
                        let ino = f.metadata().map(|m| m.ino()).unwrap_or(0);
                        if self.done.contains(&ino) {
                            continue;
                        }
                        let mut bytes = Vec::new();
                        if f.read_to_end(&mut bytes).is_ok() {
                            self.emit(&bytes, out)?;
                            self.flush_partial(out)?;
                            self.mark_done(ino);
                        }
                    }
                }
                None => {
                    let note = "[dflash-supervise logs: the log rotated past its backups faster than it was read; some lines were skipped]";
                    write_line(out, self.prefix.as_deref(), note)?;
                }
            }
        }
        match File::open(&self.path) {
            Ok(f) => {
                self.ino = f.metadata().map(|m| m.ino()).unwrap_or(0);
                self.file = Some(f);
                self.drain(out)
            }
            Err(_) => Ok(()),
        }
    }
}
