//! What NVML says about the machine's GPUs. The supervisor is the only process that loads
//! NVML; it is loaded at run time, so a machine without the NVIDIA driver runs fine.

use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;

/// Overrides the NVML library path (e.g. a fake NVML for tests, or an unusual install).
pub const NVML_LIBRARY_ENV: &str = "DFLASH_NVML_LIBRARY";

/// Why NVML cannot be used here; NVML's own error is kept where it gave one.
#[derive(Debug, thiserror::Error)]
pub enum NvmlUnavailable {
    #[error("no NVIDIA driver found (libnvidia-ml.so.1 could not be loaded)")]
    NoDriver(#[source] NvmlError),
    #[error("the NVIDIA driver is not loaded")]
    NotLoaded,
    #[error("no permission to query the NVIDIA driver")]
    NoPermission,
    #[error("NVML failed to initialise: {0}")]
    Init(#[source] NvmlError),
    #[error("NVML could not count GPUs: {0}")]
    Count(#[source] NvmlError),
    #[error("NVML could not open GPU {index}: {source}")]
    Open { index: u32, source: NvmlError },
}

pub fn init() -> Result<Nvml, NvmlUnavailable> {
    let r = match std::env::var_os(NVML_LIBRARY_ENV) {
        Some(p) => Nvml::builder().lib_path(&p).init(),
        None => Nvml::init(),
    };
    r.map_err(|e| match e {
        e @ NvmlError::LibloadingError(_) => NvmlUnavailable::NoDriver(e),
        NvmlError::DriverNotLoaded => NvmlUnavailable::NotLoaded,
        NvmlError::NoPermission => NvmlUnavailable::NoPermission,
        other => NvmlUnavailable::Init(other),
    })
}

/// How many GPUs NVML reports, or why it cannot say.
pub fn gpu_count() -> Result<u32, NvmlUnavailable> {
    init()?.device_count().map_err(NvmlUnavailable::Count)
}

/// One GPU as NVML describes it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct GpuInfo {
    pub index: u32,
    pub name: String,
    pub uuid: String,
    pub memory_total_bytes: Option<u64>,
    /// Free now (what a worker started now could have).
    pub memory_free_bytes: Option<u64>,
}

/// Every GPU NVML reports, with the driver version.
pub fn list() -> Result<(String, Vec<GpuInfo>), NvmlUnavailable> {
    let nvml = init()?;
    let driver = nvml
        .sys_driver_version()
        .unwrap_or_else(|e| format!("unknown ({e})"));
    let n = nvml.device_count().map_err(NvmlUnavailable::Count)?;
    let mut out = Vec::new();
    for index in 0..n {
        let d = nvml
            .device_by_index(index)
            .map_err(|source| NvmlUnavailable::Open { index, source })?;
        out.push(GpuInfo {
            index,
            name: d.name().unwrap_or_else(|e| format!("unknown ({e})")),
            uuid: d.uuid().unwrap_or_else(|e| format!("unknown ({e})")),
            memory_total_bytes: d.memory_info().ok().map(|m| m.total),
            memory_free_bytes: d.memory_info().ok().map(|m| m.free),
        });
    }
    Ok((driver, out))
}
