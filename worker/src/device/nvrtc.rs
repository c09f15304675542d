//! Compiling `cuda/kernels.cu` with NVRTC for one GPU architecture, cached on disk.
//!
//! The cache key is the source's hash, the architecture and NVRTC's version, so a new
//! source, GPU or CUDA release compiles afresh and nothing else does. The cache lives in
//! `$DFLASH_KERNEL_CACHE`, else `$XDG_CACHE_HOME/dflash-supervise/kernels`, else
//! `~/.cache/dflash-supervise/kernels`; entries are written whole (temporary file, rename).
//!
//! NVRTC is found as every CUDA library is ([`super::libs`]): `DFLASH_NVRTC_LIB`, the
//! loader's path, PyPI's `nvidia-cuda-nvrtc` wheel.
//!
//! Each compile makes both a CUBIN for the device's own architecture (what the worker
//! loads: a driver runs a CUBIN of its GPU's architecture whatever CUDA release made it)
//! and the PTX (the fallback: a driver only takes PTX of an ISA no newer than its own CUDA
//! release, so NVRTC 13.2's PTX fails on a 12.x driver).

use std::path::{Path, PathBuf};

use super::libs::{self, CudaLib};
use super::GpuError;

/// The kernels, as compiled for both the GPU and the host device: `cuda/kernels.cu` with
/// its op families (`cuda/<family>.cuh`) expanded in place by the build.
pub const KERNELS_CU: &str = include_str!(concat!(env!("OUT_DIR"), "/kernels.cu"));

/// FNV-1a, 64 bits: a hash that is the same in every build (unlike std's).
pub fn source_hash(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// Load NVRTC (see the module docs), where cudarc then finds it.
pub fn load() -> Result<(), GpuError> {
    libs::open(CudaLib::Nvrtc)
        .map(|_| ())
        .map_err(|e| GpuError::Unavailable(e.to_string()))?;
    // SAFETY: only tries to dlopen the library (the one opened above, by its soname).
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(GpuError::Unavailable(
            "NVRTC was loaded, but not under a soname cudarc looks for (libnvrtc.so.13)".into(),
        ))
    }
}

pub fn version() -> Result<(i32, i32), GpuError> {
    load()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: NVRTC is loaded; the call writes two ints.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(GpuError::failed("nvrtcVersion"))?;
    Ok((major, minor))
}

/// What NVRTC made of the kernels for one architecture.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Compiled {
    pub ptx: String,
    /// The CUBIN (an ELF for `arch`), when `arch` is a real architecture (`sm_XY`).
    pub cubin: Vec<u8>,
}

impl Compiled {
    /// The PTX ISA version it was written in (`.version 9.2` → (9, 2)).
    pub fn ptx_isa(&self) -> Option<(u32, u32)> {
        let v = self
            .ptx
            .lines()
            .find_map(|l| l.trim().strip_prefix(".version"))?
            .trim();
        let (a, b) = v.split_once('.')?;
        Some((a.parse().ok()?, b.parse().ok()?))
    }
}

fn nvrtc_failed(what: &str, arch: &str, e: impl std::fmt::Debug) -> GpuError {
    GpuError::failed(format!("NVRTC {what} for {arch}"))(e)
}

/// Compile the kernels for `arch` (e.g. `sm_90`): PTX and CUBIN.
pub fn compile(src: &str, arch: &str) -> Result<Compiled, GpuError> {
    use cudarc::nvrtc::{result, sys};
    load()?;
    let c_src = std::ffi::CString::new(src)
        .map_err(|_| GpuError::Invalid("the kernel source holds a NUL".into()))?;
    let prog = result::create_program(&c_src, Some(c"kernels.cu"))
        .map_err(|e| nvrtc_failed("nvrtcCreateProgram", arch, e))?;
    let opts = [format!("--gpu-architecture={arch}"), "--std=c++17".into()];
    // SAFETY: a program just created; destroyed below on every path.
    let out = unsafe {
        let r = (|| {
            if result::compile_program(prog, &opts).is_err() {
                let log =
                    result::get_program_log(prog).map_err(|e| nvrtc_failed("log", arch, e))?;
                let log: Vec<u8> = log
                    .iter()
                    .take_while(|&&c| c != 0)
                    .map(|&c| c as u8)
                    .collect();
                return Err(GpuError::Failed {
                    call: format!("NVRTC compiling for {arch}"),
                    error: String::from_utf8_lossy(&log).into_owned(),
                });
            }
            let ptx = result::get_ptx(prog).map_err(|e| nvrtc_failed("nvrtcGetPTX", arch, e))?;
            let ptx: Vec<u8> = ptx
                .iter()
                .take_while(|&&c| c != 0)
                .map(|&c| c as u8)
                .collect();
            let mut n = 0usize;
            let mut cubin = Vec::new();
            // A virtual architecture (compute_XY) has no CUBIN: NVRTC says so by size 0.
            if sys::nvrtcGetCUBINSize(prog, &mut n).result().is_ok() && n > 0 {
                cubin = vec![0u8; n];
                sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast())
                    .result()
                    .map_err(|e| nvrtc_failed("nvrtcGetCUBIN", arch, e))?;
            }
            Ok(Compiled {
                ptx: String::from_utf8_lossy(&ptx).into_owned(),
                cubin,
            })
        })();
        let _ = result::destroy_program(prog);
        r
    }?;
    Ok(out)
}

/// `(major, minor)` of an entry's NVRTC (`13.0` → (13, 0)); unreadable sorts first.
fn nvrtc_of_stem(v: &str) -> (u32, u32) {
    let (a, b) = v.split_once('.').unwrap_or((v, "0"));
    (a.parse().unwrap_or(0), b.parse().unwrap_or(0))
}

/// One whole cache entry (`STEM.ptx` and `STEM.cubin`), if it is there and sound.
fn read_entry(dir: &Path, stem: &str, arch: &str) -> Option<Compiled> {
    let ptx = std::fs::read_to_string(dir.join(format!("{stem}.ptx"))).ok()?;
    let cubin = std::fs::read(dir.join(format!("{stem}.cubin"))).ok()?;
    // A real architecture always has its CUBIN (an ELF), a virtual one an empty file.
    let cubin_ok = cubin.is_empty() == arch.starts_with("compute_")
        && (cubin.is_empty() || cubin.starts_with(b"\x7fELF"));
    (ptx.contains(".entry") && cubin_ok).then_some(Compiled { ptx, cubin })
}

pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("DFLASH_KERNEL_CACHE") {
        return PathBuf::from(d);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")));
    base.unwrap_or_else(std::env::temp_dir)
        .join("dflash-supervise")
        .join("kernels")
}

/// Which cache entries a lookup takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reuse {
    /// Only what this NVRTC made (`bench kernels` reads the code this NVRTC generates).
    SameNvrtc,
    /// This NVRTC's entry first, else one another NVRTC made of the same source for the
    /// same architecture, newest first: a CUBIN runs on every driver of its CUDA major, and
    /// the GPU bundle carries entries compiled where it was built. A hit needs no NVRTC.
    AnyNvrtc,
}

/// The kernels for `arch`, from the cache in `dir` or compiled and stored there (PTX and
/// CUBIN side by side). Returns them and whether they came from the cache. A cache that
/// cannot be written is not an error (the result is still returned).
pub fn compile_cached(src: &str, arch: &str, dir: &Path) -> Result<(Compiled, bool), GpuError> {
    compile_cached_reusing(src, arch, dir, Reuse::SameNvrtc)
}

/// [`compile_cached`], taking the entries `reuse` allows.
pub fn compile_cached_reusing(
    src: &str,
    arch: &str,
    dir: &Path,
    reuse: Reuse,
) -> Result<(Compiled, bool), GpuError> {
    let prefix = format!("kernels-{:016x}-{arch}-nvrtc", source_hash(src));
    let version = version();
    let mut stems: Vec<String> = Vec::new();
    if let Ok((major, minor)) = version {
        stems.push(format!("{prefix}{major}.{minor}"));
    }
    if reuse == Reuse::AnyNvrtc {
        if let Ok(entries) = std::fs::read_dir(dir) {
            let mut others: Vec<String> = entries
                .flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .filter_map(|n| n.strip_suffix(".ptx").map(str::to_string))
                .filter(|n| n.starts_with(&prefix) && !stems.contains(n))
                .collect();
            others.sort_by_key(|n| std::cmp::Reverse(nvrtc_of_stem(&n[prefix.len()..])));
            stems.extend(others);
        }
    }
    for stem in &stems {
        if let Some(hit) = read_entry(dir, stem, arch) {
            return Ok((hit, true));
        }
    }
    let (major, minor) = version?;
    let stem = format!("{prefix}{major}.{minor}");
    let (ptx_file, cubin_file) = (
        dir.join(format!("{stem}.ptx")),
        dir.join(format!("{stem}.cubin")),
    );
    let out = compile(src, arch)?;
    if std::fs::create_dir_all(dir).is_ok() {
        // The CUBIN first: an entry counts once its PTX is there.
        for (file, bytes) in [
            (&cubin_file, out.cubin.as_slice()),
            (&ptx_file, out.ptx.as_bytes()),
        ] {
            let tmp = dir.join(format!(
                ".{}.{}.tmp",
                file.file_name()
                    .and_then(|n| n.to_str())
                    .unwrap_or("kernels"),
                std::process::id()
            ));
            if std::fs::write(&tmp, bytes).is_ok() && std::fs::rename(&tmp, file).is_err() {
                let _ = std::fs::remove_file(&tmp);
            }
        }
    }
    Ok((out, false))
}

/// Names of the kernels in the source (its `extern "C" __global__` functions).
pub fn kernel_names(src: &str) -> Vec<String> {
    src.lines()
        .filter_map(|l| l.trim_start().strip_prefix("extern \"C\" __global__ void "))
        .map(|rest| {
            rest.chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect()
        })
        .collect()
}
