//! Types shared by `dflash-supervise` and `dflash-worker`: the control protocol, device
//! specs (`--gpus`), worker names, the environment contract and exit codes.
//!
//! This crate stays free of runtime machinery (no CUDA, no NVML, no async runtime) so that
//! both sides, and the test workers, can depend on it cheaply.

pub mod batch;
pub mod checkpoint;
pub mod child;
pub mod devices;
pub mod drafter;
pub mod env;
pub mod exit_codes;
pub mod export_dest;
pub mod layer_split;
pub mod mask_token;
pub mod model_config;
pub mod names;
pub mod nproc;
pub mod pool;
pub mod protocol;
pub mod rng;
pub mod scratch;
pub mod slots;
pub mod threads;

pub use devices::{Device, DeviceSpec, DeviceSpecError, ResolveError};
pub use names::{Role, WorkerName, WorkerNameError};
