//! The environment contract between the supervisor and each worker process.

/// `target` or `drafter`.
pub const ROLE: &str = "DFLASH_ROLE";
/// Rank within the role, from 0.
pub const RANK: &str = "DFLASH_RANK";
/// The device: a GPU index as NVML numbers it, or `cpu`.
pub const GPU: &str = "DFLASH_GPU";
/// How many times this worker has been restarted in this run (0 for the first start).
pub const RESTART_COUNT: &str = "DFLASH_RESTART_COUNT";
/// The run directory (absolute).
pub const RUN_DIR: &str = "DFLASH_RUN_DIR";
/// How often the worker must send a heartbeat, in milliseconds.
pub const HEARTBEAT_MS: &str = "DFLASH_HEARTBEAT_MS";
/// The ipc-channel one-shot server name the worker connects to (also passed as `--control`).
pub const CONTROL: &str = "DFLASH_CONTROL";
/// The target model directory (config.json + safetensors), absolute.
pub const TARGET_DIR: &str = "DFLASH_TARGET_DIR";
/// The target workers' engine: `native` (this tool's own forward) or `torch` (a Python
/// child running transformers).
pub const TARGET_ENGINE: &str = "DFLASH_TARGET_ENGINE";
/// The Python interpreter for the tools that run one (the torch target engine,
/// `export-check`): its path, else `python3` on the PATH.
pub const PYTHON: &str = "DFLASH_PYTHON";

/// [`PYTHON`]'s value, or `python3` when it is unset or blank.
pub fn python() -> String {
    std::env::var(PYTHON)
        .ok()
        .filter(|p| !p.trim().is_empty())
        .unwrap_or_else(|| "python3".into())
}
