//! The worker's failures, typed and keeping their sources. [`WorkerError::exit_code`] is
//! the one place they become exit codes: a failure that restarting cannot fix (no usable
//! GPU, a bad target model) is [`exit_codes::WORKER_PERMANENT`], which the supervisor
//! reads as "stop the run with this line"; anything else is 1, a crash it restarts.

use dflash_shared::exit_codes;

use crate::device::GpuError;
use crate::models::ModelError;

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// Restarting cannot help: the worker's GPU is unusable (a library missing, too old, a
    /// model larger than the device).
    #[error("{0}")]
    Permanent(String),
    /// The target model cannot be loaded: a missing, truncated or corrupt checkpoint file,
    /// an unsupported dtype, a shape that disagrees with config.json, or a model other than
    /// the one the supervisor described.
    #[error("{0}")]
    BadModel(String),
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The supervisor asked for something this worker cannot do in its state (a step out of
    /// order, an order before the training setup, a slot that does not match its header).
    #[error("{0}")]
    Protocol(String),
    /// The training state or a batch is not what it must be (a checkpoint of another
    /// drafter, weights that are not finite, a batch captured from other layers).
    #[error("{0}")]
    Invalid(String),
    #[error("{what}: {source}")]
    Device {
        what: String,
        #[source]
        source: GpuError,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// Bytes that do not parse: JSON, safetensors, a batch in a slot.
    #[error("{what}: {source}")]
    Format {
        what: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The torch engine's Python child died or answered otherwise than the protocol says
    /// (a crash: the worker is restarted and the batch delivered again).
    #[error(transparent)]
    Engine(#[from] crate::torch_engine::TorchError),
    /// Another failure, with what the worker was doing when it happened.
    #[error("{what}: {source}")]
    While {
        what: String,
        #[source]
        source: Box<WorkerError>,
    },
}

pub type Result<T> = std::result::Result<T, WorkerError>;

// Bare `?` on these names the kind of operation; the caller adds what it was doing with
// [`While::during`].
impl From<std::io::Error> for WorkerError {
    fn from(source: std::io::Error) -> Self {
        WorkerError::Io {
            what: "file I/O".into(),
            source,
        }
    }
}

impl From<safetensors::SafeTensorError> for WorkerError {
    fn from(source: safetensors::SafeTensorError) -> Self {
        WorkerError::Format {
            what: "safetensors".into(),
            source: Box::new(source),
        }
    }
}

impl From<serde_json::Error> for WorkerError {
    fn from(source: serde_json::Error) -> Self {
        WorkerError::Format {
            what: "JSON".into(),
            source: Box::new(source),
        }
    }
}

impl WorkerError {
    /// The innermost failure, under the `While` contexts.
    pub fn root(&self) -> &WorkerError {
        match self {
            WorkerError::While { source, .. } => source.root(),
            e => e,
        }
    }

    pub fn exit_code(&self) -> i32 {
        match self.root() {
            WorkerError::Permanent(_) | WorkerError::BadModel(_) | WorkerError::Model(_) => {
                exit_codes::WORKER_PERMANENT
            }
            WorkerError::Engine(e) if e.permanent() => exit_codes::WORKER_PERMANENT,
            _ => 1,
        }
    }

    /// What the supervisor is told this failure is ([`dflash_shared::protocol::FromWorker::Fatal`]).
    pub fn fatal_kind(&self) -> dflash_shared::protocol::FatalKind {
        use dflash_shared::protocol::FatalKind;
        match self.root() {
            WorkerError::Permanent(_) => FatalKind::Device,
            WorkerError::Engine(e) if e.permanent() => FatalKind::Device,
            WorkerError::BadModel(_) | WorkerError::Model(_) => FatalKind::Model,
            _ => FatalKind::Crash,
        }
    }

    /// The line a worker prints before it exits with [`exit_code`](Self::exit_code); a
    /// permanent one is marked so.
    pub fn line(&self, name: &str, gpu: &str) -> String {
        format!("dflash-worker {name}: error: {}", self.reason(gpu))
    }

    /// What the line says after "error: ", and the supervisor is told
    /// ([`FromWorker::Fatal`](dflash_shared::protocol::FromWorker::Fatal)).
    pub fn reason(&self, gpu: &str) -> String {
        match self.root() {
            WorkerError::Permanent(why) => {
                format!("cannot compute on device {gpu} (permanent, do not restart): {why}")
            }
            WorkerError::BadModel(why) => {
                format!("cannot load the target model (permanent, do not restart): {why}")
            }
            WorkerError::Model(e) => {
                format!("cannot load the target model (permanent, do not restart): {e}")
            }
            _ => self.to_string(),
        }
    }

    /// A file that could not be written, as the supervisor is told: the innermost I/O
    /// failure with what was being done. `None` for any other failure.
    pub fn write_failure(&self) -> Option<dflash_shared::protocol::WriteFailure> {
        match self.root() {
            WorkerError::Io { what, source } => Some(dflash_shared::protocol::WriteFailure {
                doing: what.clone(),
                os_error: source.raw_os_error(),
                words: source.to_string(),
            }),
            WorkerError::Format { what, source } => {
                // safetensors and JSON wrap the I/O error that stopped them.
                let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(source.as_ref());
                while let Some(c) = cause {
                    if let Some(io) = c.downcast_ref::<std::io::Error>() {
                        return Some(dflash_shared::protocol::WriteFailure {
                            doing: what.clone(),
                            os_error: io.raw_os_error(),
                            words: io.to_string(),
                        });
                    }
                    cause = c.source();
                }
                None
            }
            _ => None,
        }
    }

    pub fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> WorkerError {
        let what = what.into();
        move |source| WorkerError::Io { what, source }
    }

    pub fn device(what: impl Into<String>) -> impl FnOnce(GpuError) -> WorkerError {
        let what = what.into();
        move |source| WorkerError::Device { what, source }
    }

    pub fn format<E: std::error::Error + Send + Sync + 'static>(
        what: impl Into<String>,
    ) -> impl FnOnce(E) -> WorkerError {
        let what = what.into();
        move |source| WorkerError::Format {
            what,
            source: Box::new(source),
        }
    }
}

/// Say what the worker was doing when a failure happened, keeping the failure as the source.
pub trait While<T> {
    fn during(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T, E: Into<WorkerError>> While<T> for std::result::Result<T, E> {
    fn during(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| WorkerError::While {
            what: what(),
            source: Box::new(e.into()),
        })
    }
}

/// Why a tool of `dflash-worker` (bench, bench-ops, inspect, make-target) could not run:
/// printed as its one error line, with exit code [`exit_codes::USAGE`].
#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    #[error(transparent)]
    Device(#[from] GpuError),
    #[error(transparent)]
    Worker(#[from] WorkerError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Config(#[from] dflash_shared::model_config::ConfigError),
    /// `eval`'s inputs.
    #[error(transparent)]
    Eval(#[from] crate::eval::EvalError),
    /// The torch engine's Python child (`eval --engine torch`).
    #[error(transparent)]
    Torch(#[from] crate::torch_engine::TorchError),
    /// `bench-kernels`: a CUDA tool missing or failing, or machine code it cannot read.
    #[error(transparent)]
    KernelBench(#[from] crate::tools::kernel_bench::KernelBenchError),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{what}: {source}")]
    Json {
        what: String,
        #[source]
        source: serde_json::Error,
    },
    /// A flag's value that is not what the tool takes.
    #[error("{flag} {value}: {expected}")]
    Usage {
        flag: &'static str,
        value: String,
        expected: String,
    },
    #[error("--tokens: id {id} is not below the vocab size {vocab}")]
    TokenOutOfVocab { id: u32, vocab: usize },
    /// The host could not give the memory a measurement needs.
    #[error("out of host memory ({bytes} bytes)")]
    HostMemory { bytes: usize },
    /// Some of `bench compute ops:`'s measurements failed (each row says why).
    #[error("{failed} of {of} ops failed")]
    OpsFailed { failed: usize, of: usize },
    #[error("{what}: {source}")]
    Safetensors {
        what: String,
        #[source]
        source: safetensors::SafeTensorError,
    },
    /// A measurement not taken: the one it needs failed, or it cannot be taken here.
    #[error("not measured: {because}")]
    Skipped { because: String },
    /// What the measurement was doing when it failed.
    #[error("{what}: {source}")]
    During {
        what: String,
        #[source]
        source: Box<ToolError>,
    },
}

impl ToolError {
    /// `map_err(ToolError::io("writing x"))`
    pub fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ToolError {
        let what = what.into();
        move |source| ToolError::Io { what, source }
    }

    pub fn json(what: impl Into<String>) -> impl FnOnce(serde_json::Error) -> ToolError {
        let what = what.into();
        move |source| ToolError::Json { what, source }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permanent_failures_keep_their_code_and_mark_under_any_context() {
        let e: Result<()> = Err(WorkerError::Permanent("libcuda.so.1 not found".into()));
        let e = e.during(|| "setting up training".into()).unwrap_err();
        assert_eq!(e.exit_code(), exit_codes::WORKER_PERMANENT);
        assert!(e
            .line("drafter-0", "1")
            .contains("(permanent, do not restart): libcuda.so.1 not found"));
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "gone");
        let e = WorkerError::io("reading meta.json")(io);
        assert_eq!(e.exit_code(), 1);
        assert_eq!(e.to_string(), "reading meta.json: gone");
        // The source stays reachable.
        let src = std::error::Error::source(&e).unwrap();
        assert_eq!(
            src.downcast_ref::<std::io::Error>().unwrap().kind(),
            std::io::ErrorKind::NotFound
        );
        let e: Result<()> = Err(WorkerError::Protocol("step 3 before step 2".into()));
        let e = e.during(|| "applying".into()).unwrap_err();
        assert_eq!(
            (e.exit_code(), e.to_string()),
            (1, "applying: step 3 before step 2".to_string())
        );
    }
}
