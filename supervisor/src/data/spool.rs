//! Data that can be read only once (a FIFO, a pipe such as `<(zcat data.gz)`) is
//! copied to a file first: the preflight, every epoch and a later `--resume` then read the
//! same bytes. A run reads `--data` more than once (preflight, loader, epochs), and a
//! second open of a pipe would wait forever or find it drained.
//!
//! A named FIFO (mkfifo) is read by one run at a time: the copy holds an exclusive flock
//! on the FIFO while it reads, and a second run started on the same FIFO is refused at
//! once (exit 2) rather than silently getting part of the stream.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// Name of the copy inside the run directory.
pub const SPOOL_FILE: &str = "data.jsonl";

/// Why `--data` could not be copied.
#[derive(Debug, thiserror::Error)]
pub enum SpoolError {
    #[error("--data {source_name}: cannot read it: {error}")]
    Read {
        source_name: String,
        error: std::io::Error,
    },
    /// A stop signal came while the copy waited for data.
    #[error("--data {source_name}: interrupted by {signal} while reading it")]
    Interrupted {
        source_name: String,
        signal: &'static str,
    },
    /// Another process (another run) is reading the same named FIFO.
    #[error("--data {source_name}: this FIFO is being read by {holder}; two runs reading one FIFO would each get part of the stream (expected a FIFO of its own for each run)")]
    Busy { source_name: String, holder: String },
    #[error("--data {source_name}: cannot copy it to {}: {error}", path.display())]
    Write {
        source_name: String,
        path: PathBuf,
        error: std::io::Error,
    },
}

/// Whether `data` (as `--data` gives it) names a path that can only be read once: neither
/// a regular file nor a directory (a FIFO, `/dev/fd/N` of a pipe or of `<(...)`, a
/// character device). `-` (stdin) is not copied: the loader streams it, once (no
/// preflight, one epoch). Demo data and missing paths are not (the loader reports those).
pub fn reads_once(data: &str) -> bool {
    use std::os::unix::fs::FileTypeExt;
    if data == "-" || data == "demo" {
        return false;
    }
    match std::fs::metadata(data) {
        Ok(m) => {
            let t = m.file_type();
            t.is_fifo() || t.is_char_device() || t.is_socket() || (!t.is_file() && !t.is_dir())
        }
        Err(_) => false,
    }
}

/// Copy `data` to `to` (created new); returns the bytes copied. The copy runs on its own
/// thread (opening a FIFO and reading a pipe block until a writer comes); `interrupted` is
/// asked every 200 ms and a stop signal it names ends the wait.
pub fn spool_interruptible(
    data: &str,
    to: &Path,
    interrupted: &mut dyn FnMut() -> Option<&'static str>,
) -> Result<u64, SpoolError> {
    let (tx, rx) = std::sync::mpsc::channel();
    let (d, t) = (data.to_string(), to.to_path_buf());
    std::thread::Builder::new()
        .name("spool".into())
        .spawn(move || {
            let _ = tx.send(spool(&d, &t));
        })
        .map_err(|error| SpoolError::Read {
            source_name: data.to_string(),
            error,
        })?;
    loop {
        match rx.recv_timeout(std::time::Duration::from_millis(200)) {
            Ok(r) => return r,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                if let Some(signal) = interrupted() {
                    return Err(SpoolError::Interrupted {
                        source_name: data.to_string(),
                        signal,
                    });
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                return Err(SpoolError::Read {
                    source_name: data.to_string(),
                    error: std::io::Error::other("the copying thread ended"),
                })
            }
        }
    }
}

/// Copy `data` to `to` (created new); returns the bytes copied.
pub fn spool(data: &str, to: &Path) -> Result<u64, SpoolError> {
    let read_err = |error| SpoolError::Read {
        source_name: data.to_string(),
        error,
    };
    let write_err = |error| SpoolError::Write {
        source_name: data.to_string(),
        path: to.to_path_buf(),
        error,
    };
    let mut input: Box<dyn Read> = if data == "-" {
        Box::new(std::io::stdin().lock())
    } else if let Some(fifo) = named_fifo(data) {
        Box::new(open_fifo_alone(data, &fifo)?)
    } else {
        Box::new(File::open(data).map_err(read_err)?)
    };
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(to)
        .map_err(write_err)?;
    let mut out = BufWriter::with_capacity(1 << 20, file);
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = match input.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(read_err(e)),
        };
        out.write_all(&buf[..n]).map_err(write_err)?;
        total += n as u64;
    }
    out.flush().map_err(write_err)?;
    out.get_ref().sync_all().map_err(write_err)?;
    Ok(total)
}

/// The metadata of `data` when it is a FIFO node in the filesystem (mkfifo, or a link to
/// one), not a pipe that `/dev/fd/N` names.
fn named_fifo(data: &str) -> Option<std::fs::Metadata> {
    use std::os::unix::fs::FileTypeExt;
    let real = std::fs::canonicalize(data).ok()?;
    std::fs::metadata(real)
        .ok()
        .filter(|m| m.file_type().is_fifo())
}

/// A named FIFO this run reads alone (see [`open_fifo_alone`]). Opened without waiting for
/// a writer, it waits for one at its first read: poll tells a writer that came (and wrote,
/// or left) from none yet; from then on it reads as from a blocking open.
struct LockedFifo {
    f: File,
    waited: bool,
}

impl LockedFifo {
    fn wait_for_writer(&mut self) -> std::io::Result<()> {
        let fd = self.f.as_raw_fd();
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd.
        while unsafe { libc::poll(&mut p, 1, -1) } <= 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
        // SAFETY: fcntl on a file descriptor we own.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        self.waited = true;
        Ok(())
    }
}

impl Read for LockedFifo {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if !self.waited {
            self.wait_for_writer()?;
        }
        self.f.read(buf)
    }
}

/// Open the named FIFO `data` (whose metadata is `fifo`) for reading by this run alone:
/// opened without waiting for a writer, an exclusive flock on it is taken at once (a
/// second run is refused with [`SpoolError::Busy`]) and held until the copy is done.
fn open_fifo_alone(data: &str, fifo: &std::fs::Metadata) -> Result<LockedFifo, SpoolError> {
    use std::os::unix::fs::OpenOptionsExt;
    let read_err = |error| SpoolError::Read {
        source_name: data.to_string(),
        error,
    };
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(data)
        .map_err(read_err)?;
    // SAFETY: flock on a file descriptor we own; the lock goes with `f`.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::WouldBlock {
            return Err(read_err(e));
        }
        return Err(SpoolError::Busy {
            source_name: data.to_string(),
            holder: lock_holder(fifo),
        });
    }
    Ok(LockedFifo { f, waited: false })
}

/// Who holds the flock on the file `meta` describes, as /proc/locks tells: "pid N
/// (its program)", or "another process" where it does not.
fn lock_holder(meta: &std::fs::Metadata) -> String {
    use std::os::unix::fs::MetadataExt;
    let dev = meta.dev();
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    let id = format!("{major:02x}:{minor:02x}:{}", meta.ino());
    let locks = std::fs::read_to_string("/proc/locks").unwrap_or_default();
    let pid = locks.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.get(1) == Some(&"FLOCK") && f.get(5) == Some(&id.as_str()))
            .then(|| f.get(4)?.parse::<u32>().ok())
            .flatten()
    });
    let Some(pid) = pid else {
        return "another process".into();
    };
    let program = std::fs::read(format!("/proc/{pid}/cmdline"))
        .ok()
        .and_then(|c| {
            let argv0 = c.split(|b| *b == 0).next()?.to_vec();
            let argv0 = String::from_utf8_lossy(&argv0).into_owned();
            Some(argv0.rsplit('/').next()?.to_string())
        })
        .filter(|p| !p.is_empty());
    match program {
        Some(p) => format!("pid {pid} ({p})"),
        None => format!("pid {pid}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fifo_is_read_once_into_a_file_and_regular_files_are_left_alone() {
        let d = tempfile::tempdir().unwrap();
        let file = d.path().join("a.jsonl");
        std::fs::write(&file, "{}\n").unwrap();
        assert!(!reads_once(file.to_str().unwrap()));
        assert!(!reads_once(d.path().to_str().unwrap()));
        assert!(!reads_once("demo"));
        assert!(!reads_once("-"), "stdin is streamed, not copied");
        let fifo = d.path().join("f");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        assert!(reads_once(fifo.to_str().unwrap()));
        let writer = {
            let fifo = fifo.clone();
            std::thread::spawn(move || {
                let mut f = std::fs::OpenOptions::new().write(true).open(fifo).unwrap();
                for i in 0..1000 {
                    writeln!(f, "{{\"input_ids\": [{i}, 2, 3]}}").unwrap();
                }
            })
        };
        let to = d.path().join(SPOOL_FILE);
        let n = spool(fifo.to_str().unwrap(), &to).unwrap();
        writer.join().unwrap();
        let text = std::fs::read_to_string(&to).unwrap();
        assert_eq!(n as usize, text.len());
        assert_eq!(text.lines().count(), 1000);
        assert!(text.lines().last().unwrap().contains("[999, 2, 3]"));
        // Never over an existing file.
        assert!(matches!(
            spool(file.to_str().unwrap(), &to),
            Err(SpoolError::Write { .. })
        ));
    }

    /// A FIFO one copy is reading is refused to a second at once (before any writer came),
    /// naming the FIFO and the reader; the first still gets every byte.
    #[test]
    fn a_second_reader_of_a_fifo_is_refused_and_the_first_gets_every_byte() {
        let d = tempfile::tempdir().unwrap();
        let fifo = d.path().join("f");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).unwrap();
        let name = fifo.to_str().unwrap().to_string();
        let first = {
            let (name, to) = (name.clone(), d.path().join("first.jsonl"));
            std::thread::spawn(move || spool(&name, &to).map(|n| (n, to)))
        };
        // Wait (up to a deadline) for the first to hold its lock.
        let meta = std::fs::metadata(&fifo).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while lock_holder(&meta) == "another process" {
            assert!(
                std::time::Instant::now() < deadline,
                "the first never locked"
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let second = match spool(&name, &d.path().join("second.jsonl")) {
            Err(e @ SpoolError::Busy { .. }) => e.to_string(),
            other => panic!("the second reader got {other:?}"),
        };
        assert!(!d.path().join("second.jsonl").exists());
        assert!(
            second.contains(&name)
                && second.contains(&format!("pid {}", std::process::id()))
                && !second.contains('\n'),
            "{second}"
        );
        std::fs::write(&fifo, "{\"input_ids\": [1, 2]}\n".repeat(1000)).unwrap();
        let (n, to) = first.join().unwrap().unwrap();
        assert_eq!(n, 1000 * 22);
        assert_eq!(std::fs::read_to_string(to).unwrap().lines().count(), 1000);
    }
}
