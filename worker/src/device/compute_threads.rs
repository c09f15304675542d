//! The CPU device's compute threads: rayon's global pool, which gemm's threaded products
//! run on. Left to itself, rayon starts the pool at the first threaded product and panics
//! when a thread cannot be started (the user's process limit, `ulimit -u`, reached); a
//! worker starts it when it opens its CPU device instead, so a refused start is a typed,
//! one-line error it exits with.

use std::io;
use std::sync::OnceLock;

/// The compute threads could not be started: `source` is the failed thread start.
#[derive(Debug, thiserror::Error)]
#[error("cannot start {threads} compute threads: {}", dflash_shared::nproc::start_failure(.source, Some(&needs(*.threads))))]
pub struct ThreadsError {
    pub threads: usize,
    pub source: io::Error,
}

impl Clone for ThreadsError {
    fn clone(&self) -> Self {
        ThreadsError {
            threads: self.threads,
            source: clone_io(&self.source),
        }
    }
}

/// The threads a worker has besides its compute: main, heartbeat, control channel, loading.
const OTHER_THREADS: usize = 4;

fn needs(threads: usize) -> String {
    format!(
        "this worker needs {} of them ({threads} to compute on: {} or one per core)",
        threads + OTHER_THREADS,
        dflash_shared::nproc::RAYON_NUM_THREADS
    )
}

fn clone_io(e: &io::Error) -> io::Error {
    match e.raw_os_error() {
        Some(n) => io::Error::from_raw_os_error(n),
        None => io::Error::new(e.kind(), e.to_string()),
    }
}

/// Start the process's compute threads, `threads` of them; once per process: a later call
/// gives the first one's outcome. A pool rayon already started by itself counts as started.
pub fn start(threads: usize) -> Result<(), ThreadsError> {
    static STARTED: OnceLock<Result<(), ThreadsError>> = OnceLock::new();
    STARTED
        .get_or_init(|| {
            match rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(|i| format!("compute-{i}"))
                .build_global()
            {
                Ok(()) => Ok(()),
                Err(e) => {
                    refused(&e).map_or(Ok(()), |source| Err(ThreadsError { threads, source }))
                }
            }
        })
        .clone()
}

/// The thread start a pool's build failed on; `None` when the global pool was started
/// before (its build is refused then, with no I/O error).
fn refused(e: &rayon::ThreadPoolBuildError) -> Option<io::Error> {
    std::error::Error::source(e)?
        .downcast_ref::<io::Error>()
        .map(clone_io)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_thread_start_is_an_error_naming_the_limit_not_a_panic() {
        // A pool whose third thread is refused as `ulimit -u` refuses it (EAGAIN).
        let e = rayon::ThreadPoolBuilder::new()
            .num_threads(4)
            .spawn_handler(|t| {
                if t.index() < 2 {
                    std::thread::Builder::new().spawn(|| t.run())?;
                    Ok(())
                } else {
                    Err(io::Error::from_raw_os_error(libc::EAGAIN))
                }
            })
            .build()
            .unwrap_err();
        let source = refused(&e).expect("the refused start");
        assert_eq!(source.raw_os_error(), Some(libc::EAGAIN));
        let line = ThreadsError { threads: 4, source }.to_string();
        assert!(
            line.starts_with("cannot start 4 compute threads: Resource temporarily unavailable"),
            "{line}"
        );
        assert!(line.contains("ulimit -u"), "{line}");
        assert!(
            line.contains(
                "this worker needs 8 of them (4 to compute on: RAYON_NUM_THREADS or one per core)"
            ),
            "{line}"
        );
        assert!(!line.contains('\n'), "{line}");
        // Started once per process: the second call gives the first's outcome, and a pool
        // that rayon started before is no error.
        assert!(start(2).is_ok());
        assert!(start(3).is_ok());
        let again = rayon::ThreadPoolBuilder::new().build_global().unwrap_err();
        assert!(refused(&again).is_none());
    }
}
