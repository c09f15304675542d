//! The supervisor's errors, typed by what failed and keeping the error that caused them,
//! and the one place where they, and the way a run ended, become exit codes.
//!
//! Every error prints as one line: what was being done, to which input or path, and why
//! (its source's own text at the end). `main` prints it and exits with
//! [`Error::exit_code`]; a run that got going ends with [`RunEnd::exit_code`]. Both use the
//! codes of [`dflash_shared::exit_codes`], which docs/run-directory.md documents (a table generated from them).

use std::path::PathBuf;

use dflash_shared::exit_codes;

/// A source kept as it is: an I/O, JSON, NVML, tokenizer... error, or a reason in words.
pub type Source = Box<dyn std::error::Error + Send + Sync + 'static>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A flag out of range, or flags that contradict each other: one line naming the flag
    /// and what was expected (exit 2).
    #[error("{0}")]
    Flag(String),
    /// Devices asked for (`--gpus`, `--target-gpus`, `--drafter-gpus`) that this machine
    /// does not have (exit 2).
    #[error(transparent)]
    Devices(#[from] dflash_shared::ResolveError),
    /// An input named on the command line (a file, a directory, an address, a run) that
    /// cannot be used: which one, and why (exit 2).
    #[error("{input}: {source}")]
    Input { input: String, source: Source },
    /// The data cannot be read or has too many bad lines (exit 2). The source is the
    /// loader's own error (`data::loader::LoaderError`, which converts into this).
    #[error("{0}")]
    Data(Source),
    /// Something a command needs is not on this machine (NVML, a GPU, Python) (exit 2).
    #[error("{what}: {source}")]
    Unavailable { what: String, source: Source },
    /// The supervisor's own work failed: what it was doing, where, and the OS's reason
    /// (exit 4).
    #[error("{what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    /// A thread, the spawner or a signal handler could not be started (exit 4).
    /// EAGAIN is named as the limit on processes and threads (`ulimit -u`) it is.
    #[error("cannot start {what}: {}", crate::nproc::start_failure(.source))]
    Start {
        what: String,
        source: std::io::Error,
    },
    /// JSON the supervisor writes could not be encoded (exit 4).
    #[error("{what}: {source}")]
    Json {
        what: &'static str,
        source: serde_json::Error,
    },
    /// A shared-memory pool could not be created (exit 4).
    #[error("cannot create the {pool} pool in shared memory: {source}")]
    SharedMemory { pool: String, source: Source },
    /// A program the supervisor runs for itself failed (the worker's `tiny-target`, a
    /// benchmark's helper) (exit 4).
    #[error("{program} failed: {detail}")]
    Helper { program: String, detail: String },
    /// `export` could not write the drafter (a full disk, the worker's export tool failed)
    /// (exit 1).
    #[error("export: the drafter could not be written: {0}")]
    Export(#[from] crate::export_tool::ExportError),
    /// `export` was stopped by a signal; what it had written is removed (exit 130).
    #[error("export: interrupted: {} holds the previous export or none", out.display())]
    ExportInterrupted { out: PathBuf },
    /// A stop signal came while the run was starting: what the start had made is removed
    /// (exit 130).
    #[error("interrupted by {signal} while the run was starting: no worker was started{}", removed.as_ref().map(|p| format!("; removed the unfinished {}", p.display())).unwrap_or_default())]
    Interrupted {
        signal: &'static str,
        removed: Option<PathBuf>,
    },
    /// `--data` could not be copied (a pipe or FIFO is read once, into the run dir).
    #[error(transparent)]
    Spool(#[from] crate::data::spool::SpoolError),
    /// A check or link across nodes failed (`cluster::ClusterError` says which exit code).
    #[error(transparent)]
    Cluster(#[from] crate::cluster::ClusterError),
    /// A benchmark could not measure (exit 4).
    #[error("bench {bench}: {what}: {source}")]
    Bench {
        bench: &'static str,
        what: String,
        source: Source,
    },
}

impl Error {
    pub fn exit_code(&self) -> i32 {
        match self {
            Error::Flag(_)
            | Error::Devices(_)
            | Error::Input { .. }
            | Error::Data(_)
            | Error::Unavailable { .. } => exit_codes::USAGE,
            Error::Export(_) => exit_codes::RUN_FAILED,
            Error::Cluster(e) => e.exit_code(),
            Error::Interrupted { .. } | Error::ExportInterrupted { .. } => exit_codes::INTERRUPTED,
            Error::Spool(crate::data::spool::SpoolError::Interrupted { .. }) => {
                exit_codes::INTERRUPTED
            }
            Error::Spool(_) => exit_codes::USAGE,
            Error::Io { .. }
            | Error::Start { .. }
            | Error::SharedMemory { .. }
            | Error::Json { .. }
            | Error::Helper { .. }
            | Error::Bench { .. } => exit_codes::INTERNAL,
        }
    }

    /// An input that cannot be used, for a reason or an error.
    pub fn input(input: impl Into<String>, source: impl Into<Source>) -> Error {
        Error::Input {
            input: input.into(),
            source: source.into(),
        }
    }

    pub fn io(what: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Error {
        Error::Io {
            what,
            path: path.into(),
            source,
        }
    }

    pub fn start(what: impl Into<String>, source: std::io::Error) -> Error {
        Error::Start {
            what: what.into(),
            source,
        }
    }

    pub fn json(what: &'static str, source: serde_json::Error) -> Error {
        Error::Json { what, source }
    }
}

/// How a run that got going ended, as far as its exit code goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunEnd {
    /// Ended by its step limit or the end of the data; every worker stopped as asked.
    Clean,
    /// Stopped before its end (a stop signal, the time limit); every worker stopped as
    /// asked, so `--resume` continues it.
    StoppedEarly,
    /// As `Clean`, but some worker had to be killed or exited non-zero.
    UncleanStop,
    /// A worker spent its restart budget, could never run here, training failed, or
    /// committed steps were not saved.
    Failed,
    /// Bad input found while running (the data).
    BadInput,
    /// The supervisor could not go on (a worker that cannot start, another protocol).
    Internal,
    /// A second stop signal killed every worker.
    Interrupted,
}

impl RunEnd {
    pub fn exit_code(self) -> i32 {
        match self {
            RunEnd::Clean => exit_codes::SUCCESS,
            RunEnd::StoppedEarly => exit_codes::STOPPED_EARLY,
            RunEnd::UncleanStop => exit_codes::UNCLEAN_STOP,
            RunEnd::Failed => exit_codes::RUN_FAILED,
            RunEnd::BadInput => exit_codes::USAGE,
            RunEnd::Internal => exit_codes::INTERNAL,
            RunEnd::Interrupted => exit_codes::INTERRUPTED,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_keep_their_source_and_map_to_the_documented_codes() {
        let io = std::io::Error::new(std::io::ErrorKind::PermissionDenied, "denied");
        let e = Error::io("cannot write", "/r/state.json", io);
        assert_eq!(e.to_string(), "cannot write /r/state.json: denied");
        let src = std::error::Error::source(&e).expect("the io error is kept");
        assert_eq!(
            src.downcast_ref::<std::io::Error>().map(|e| e.kind()),
            Some(std::io::ErrorKind::PermissionDenied)
        );
        assert_eq!(e.exit_code(), 4);
        let e = Error::input(
            "--data x.jsonl",
            std::io::Error::from(std::io::ErrorKind::NotFound),
        );
        assert!(std::error::Error::source(&e).is_some());
        assert_eq!(e.exit_code(), 2);
        assert_eq!(
            Error::Flag("--steps 0: expected at least 1".into()).exit_code(),
            2
        );
        let codes: Vec<i32> = [
            RunEnd::Clean,
            RunEnd::Failed,
            RunEnd::BadInput,
            RunEnd::UncleanStop,
            RunEnd::Internal,
            RunEnd::StoppedEarly,
            RunEnd::Interrupted,
        ]
        .iter()
        .map(|r| r.exit_code())
        .collect();
        assert_eq!(codes, [0, 1, 2, 3, 4, 75, 130]);
    }
}
