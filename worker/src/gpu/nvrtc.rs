//! Compiling `cuda/kernels.cu` with NVRTC for one GPU architecture, cached on disk.
//!
//! The cache key is the source's hash, the architecture and NVRTC's version, so a new
//! source, GPU or CUDA release compiles afresh and nothing else does. The cache lives in
//! `$DFLASH_KERNEL_CACHE`, else `$XDG_CACHE_HOME/dflash-supervise/kernels`, else
//! `~/.cache/dflash-supervise/kernels`; entries are written whole (temporary file, rename).
//!
//! NVRTC is found by the dynamic loader (`libnvrtc.so*`); `DFLASH_NVRTC_LIB=PATH` loads
//! that file first (tests use the library from PyPI's `nvidia-cuda-nvrtc` wheel).

use std::path::{Path, PathBuf};

use super::GpuError;

/// The kernels, as compiled for both the GPU and the host device.
pub const KERNELS_CU: &str = include_str!("../../cuda/kernels.cu");

/// FNV-1a, 64 bits: a hash that is the same in every build (unlike std's).
pub fn source_hash(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

/// Load NVRTC: `DFLASH_NVRTC_LIB` first if set, then whatever the loader finds. Returns
/// where it looked, for the error when it finds nothing.
pub fn load() -> Result<(), GpuError> {
    if let Some(path) = std::env::var_os("DFLASH_NVRTC_LIB") {
        let c = std::ffi::CString::new(path.as_encoded_bytes()).map_err(|_| GpuError::Invalid("DFLASH_NVRTC_LIB holds a NUL".into()))?;
        // SAFETY: dlopen of a library by path; it stays loaded for the process's life, so
        // cudarc's own dlopen of its soname finds this one.
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if h.is_null() {
            return Err(GpuError::Unavailable(format!("libnvrtc: DFLASH_NVRTC_LIB={} cannot be loaded", path.to_string_lossy())));
        }
    }
    // SAFETY: only tries to dlopen the library.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(GpuError::Unavailable(
            "libnvrtc (CUDA's run-time compiler) not found: looked for libnvrtc.so, libnvrtc.so.13, libnvrtc.so.12 on the loader's path (LD_LIBRARY_PATH, ldconfig); set DFLASH_NVRTC_LIB=PATH to name it".into(),
        ))
    }
}

pub fn version() -> Result<(i32, i32), GpuError> {
    load()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: NVRTC is loaded; the call writes two ints.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) }.result().map_err(|e| GpuError::Failed(format!("nvrtcVersion: {e:?}")))?;
    Ok((major, minor))
}

/// Compile the kernels for `arch` (e.g. `sm_90`) to PTX.
pub fn compile(src: &str, arch: &str) -> Result<String, GpuError> {
    load()?;
    let opts = cudarc::nvrtc::CompileOptions {
        options: vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()],
        name: Some("kernels.cu".into()),
        ..Default::default()
    };
    match cudarc::nvrtc::compile_ptx_with_opts(src, opts) {
        Ok(ptx) => Ok(ptx.to_src()),
        Err(cudarc::nvrtc::CompileError::CompileError { log, .. }) => Err(GpuError::Failed(format!("NVRTC failed for {arch}:\n{}", log.to_string_lossy()))),
        Err(e) => Err(GpuError::Failed(format!("NVRTC failed for {arch}: {e:?}"))),
    }
}

pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("DFLASH_KERNEL_CACHE") {
        return PathBuf::from(d);
    }
    let base = std::env::var_os("XDG_CACHE_HOME").map(PathBuf::from).or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")));
    base.unwrap_or_else(std::env::temp_dir).join("dflash-supervise").join("kernels")
}

/// PTX of `src` for `arch`, from the cache in `dir` or compiled and stored there. Returns
/// the PTX and whether it came from the cache. A cache that cannot be written is not an
/// error (the PTX is still returned).
pub fn compile_cached(src: &str, arch: &str, dir: &Path) -> Result<(String, bool), GpuError> {
    let (major, minor) = version()?;
    let file = dir.join(format!("kernels-{:016x}-{arch}-nvrtc{major}.{minor}.ptx", source_hash(src)));
    if let Ok(ptx) = std::fs::read_to_string(&file) {
        if ptx.contains(".entry") {
            return Ok((ptx, true));
        }
    }
    let ptx = compile(src, arch)?;
    if std::fs::create_dir_all(dir).is_ok() {
        let tmp = dir.join(format!(".{}.{}.tmp", file.file_name().and_then(|n| n.to_str()).unwrap_or("kernels"), std::process::id()));
        if std::fs::write(&tmp, &ptx).is_ok() && std::fs::rename(&tmp, &file).is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
    }
    Ok((ptx, false))
}

/// Names of the kernels in the source (its `extern "C" __global__` functions).
pub fn kernel_names(src: &str) -> Vec<String> {
    src.lines()
        .filter_map(|l| l.trim_start().strip_prefix("extern \"C\" __global__ void "))
        .map(|rest| rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect())
        .collect()
}
