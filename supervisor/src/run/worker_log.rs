//! Per-worker log files: every line of a worker's stdout and stderr, timestamped and
//! tagged, appended to `logs/<worker>.log`, which rotates by size (`.1` is the newest
//! backup). One [`WorkerLog`] lives as long as the run, across the worker's restarts, so a
//! reader following the file sees one continuous story.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread;

use crate::run::rundir::now_rfc3339;

/// Lines longer than this are split, so one runaway line cannot hold the whole buffer.
const MAX_LINE: usize = 64 * 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tag {
    Stdout,
    Stderr,
    /// Lines the supervisor writes about the worker (spawn, exit), so the log tells the
    /// whole story of each life.
    Supervisor,
}

impl Tag {
    fn as_str(self) -> &'static str {
        match self {
            Tag::Stdout => "stdout",
            Tag::Stderr => "stderr",
            Tag::Supervisor => "supervisor",
        }
    }
}

pub struct Rotation {
    pub max_size: u64,
    pub backups: u32,
}

struct Inner {
    path: PathBuf,
    file: File,
    size: u64,
    rotation: Rotation,
    tee_prefix: Option<String>,
}

#[derive(Clone)]
pub struct WorkerLog {
    inner: Arc<Mutex<Inner>>,
}

impl WorkerLog {
    pub fn open(
        path: &Path,
        rotation: Rotation,
        tee_prefix: Option<String>,
    ) -> io::Result<WorkerLog> {
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        let size = file.metadata()?.len();
        Ok(WorkerLog {
            inner: Arc::new(Mutex::new(Inner {
                path: path.to_path_buf(),
                file,
                size,
                rotation,
                tee_prefix,
            })),
        })
    }

    pub fn line(&self, tag: Tag, text: &str) {
        let text = text.trim_end_matches(['\n', '\r']);
        let record = format!("{} {} {}\n", now_rfc3339(), tag.as_str(), text);
        let mut g = match self.inner.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        if let Some(prefix) = &g.tee_prefix {
            // Console copy: best effort, a closed stdout must not stop the log.
            crate::telemetry::console::out_line(&format!("{prefix} {text}"));
        }
        if g.size > 0 && g.size + record.len() as u64 > g.rotation.max_size {
            if let Err(e) = g.rotate() {
                log::warn!("cannot rotate {}: {e}", g.path.display());
            }
        }
        match g.file.write_all(record.as_bytes()) {
            Ok(()) => g.size += record.len() as u64,
            Err(e) => log::warn!("cannot write {}: {e}", g.path.display()),
        }
    }

    /// The last `n` lines (from the current file and, if needed, the newest backups).
    pub fn tail(&self, n: usize) -> Vec<String> {
        let path = match self.inner.lock() {
            Ok(g) => g.path.clone(),
            Err(p) => p.into_inner().path.clone(),
        };
        tail_lines(&path, n, u32::MAX)
    }

    /// Copy `stream` into the log line by line on a thread of its own, until EOF.
    pub fn pump(
        &self,
        stream: impl Read + Send + 'static,
        tag: Tag,
    ) -> io::Result<thread::JoinHandle<()>> {
        let log = self.clone();
        thread::Builder::new()
            .name(format!("log-{}", tag.as_str()))
            .spawn(move || {
                let mut r = BufReader::with_capacity(MAX_LINE, stream);
                let mut buf = Vec::with_capacity(1024);
                loop {
                    buf.clear();
                    match (&mut r).take(MAX_LINE as u64).read_until(b'\n', &mut buf) {
                        Ok(0) => break,
                        Ok(_) => log.line(tag, &String::from_utf8_lossy(&buf)),
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                        Err(_) => break,
                    }
                }
            })
    }
}

impl Inner {
    fn rotate(&mut self) -> io::Result<()> {
        let backups = self.rotation.backups;
        if backups == 0 {
            self.file.set_len(0)?;
            self.size = 0;
            return Ok(());
        }
        let _ = fs::remove_file(backup_path(&self.path, backups));
        for i in (1..backups).rev() {
            let from = backup_path(&self.path, i);
            if from.exists() {
                fs::rename(&from, backup_path(&self.path, i + 1))?;
            }
        }
        fs::rename(&self.path, backup_path(&self.path, 1))?;
        self.file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)?;
        self.size = 0;
        Ok(())
    }
}

/// `worker.log.N`
pub fn backup_path(path: &Path, n: u32) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(format!(".{n}"));
    PathBuf::from(s)
}

/// The last `n` lines of a log, reaching into backups (newest first) when the current
/// file has fewer.
pub fn tail_lines(path: &Path, n: usize, max_backups: u32) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut idx = 0u32;
    loop {
        let p = if idx == 0 {
            path.to_path_buf()
        } else {
            backup_path(path, idx)
        };
        let Ok(text) = fs::read(&p) else { break };
        let text = String::from_utf8_lossy(&text);
        let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
        let need = n - out.len();
        if lines.len() > need {
            lines.drain(..lines.len() - need);
        }
        lines.append(&mut out);
        out = lines;
        if out.len() >= n || idx >= max_backups {
            break;
        }
        idx += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("dflash-log-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn lines_are_tagged_and_rotation_keeps_every_line_in_order() {
        let d = tmpdir("rot");
        let path = d.join("w.log");
        let log = WorkerLog::open(
            &path,
            Rotation {
                max_size: 400,
                backups: 3,
            },
            None,
        )
        .unwrap();
        for i in 0..60 {
            log.line(Tag::Stdout, &format!("line {i}"));
        }
        assert!(backup_path(&path, 1).exists() && backup_path(&path, 2).exists());
        assert!(!backup_path(&path, 4).exists());
        for f in [path.clone(), backup_path(&path, 1)] {
            assert!(fs::metadata(&f).unwrap().len() <= 400);
        }
        let all = tail_lines(&path, 1000, 3);
        let nums: Vec<u32> = all
            .iter()
            .map(|l| {
                assert!(l.contains(" stdout line "), "{l}");
                l.rsplit(' ').next().unwrap().parse().unwrap()
            })
            .collect();
        // Consecutive, ending at 59: nothing lost or reordered within the kept backups.
        assert_eq!(*nums.last().unwrap(), 59);
        assert!(
            nums[0] > 0,
            "the oldest lines fell off with the oldest backup"
        );
        assert!(nums.windows(2).all(|w| w[1] == w[0] + 1), "{nums:?}");
        assert_eq!(tail_lines(&path, 3, 3).len(), 3);
        assert!(tail_lines(&path, 3, 3)[2].ends_with("line 59"));
    }

    #[test]
    fn pump_splits_lines_and_marks_stderr() {
        let d = tmpdir("pump");
        let path = d.join("w.log");
        let log = WorkerLog::open(
            &path,
            Rotation {
                max_size: 1 << 20,
                backups: 1,
            },
            None,
        )
        .unwrap();
        log.pump(
            io::Cursor::new(b"a\nb\r\nno newline at end".to_vec()),
            Tag::Stderr,
        )
        .unwrap()
        .join()
        .unwrap();
        let lines = tail_lines(&path, 10, 0);
        assert_eq!(lines.len(), 3);
        assert!(lines[0].ends_with(" stderr a"));
        assert!(lines[1].ends_with(" stderr b"));
        assert!(lines[2].ends_with(" stderr no newline at end"));
        // RFC 3339 UTC timestamp with milliseconds in front.
        assert_eq!(&lines[0][23..25], "Z ", "{}", lines[0]);
    }
}
