//! Data that can be read only once (a FIFO, a pipe such as `<(zcat data.gz)`) is
//! copied to a file first: the preflight, every epoch and a later `--resume` then read the
//! same bytes. A run reads `--data` more than once (preflight, loader, epochs), and a
//! second open of a pipe would wait forever or find it drained.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
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
}
