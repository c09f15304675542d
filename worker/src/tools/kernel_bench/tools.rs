//! cuobjdump and the nvdisasm it runs for `-sass`, found as the CUDA libraries are: an
//! environment variable (`DFLASH_CUOBJDUMP`, `DFLASH_NVDISASM`: the program's path), the
//! `PATH`, then PyPI's wheels (`nvidia-cuda-cuobjdump`, `nvidia-cuda-nvdisasm`:
//! `site-packages/nvidia/cu13/bin/`).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::device::GpuError;

/// Why `bench kernels` could not read the machine code.
#[derive(Debug, thiserror::Error)]
pub enum KernelBenchError {
    /// A CUDA tool is not installed: the one line says which and how to get it.
    #[error(
        "{tool} not found (tried {tried}): pip install {package}, or set {env}=/path/to/{tool}"
    )]
    ToolMissing {
        tool: &'static str,
        env: &'static str,
        package: &'static str,
        tried: String,
    },
    #[error("running {program}: {source}")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{program} {args} failed ({status}): {stderr}")]
    ToolFailed {
        program: String,
        args: String,
        status: String,
        stderr: String,
    },
    #[error("writing the CUBIN for {arch}: {source}")]
    Cubin {
        arch: String,
        #[source]
        source: std::io::Error,
    },
    #[error("compiling the kernels for {arch}: {source}")]
    Nvrtc {
        arch: String,
        #[source]
        source: GpuError,
    },
    /// cuobjdump's output lacks a kernel the source declares.
    #[error("{arch}: cuobjdump's {what} has no kernel {kernel}")]
    Missing {
        arch: String,
        what: &'static str,
        kernel: String,
    },
    #[error("--arch {0}: expected sm_80, sm_90 or sm_100")]
    Arch(String),
    #[error("writing the report as JSON: {0}")]
    Json(#[source] serde_json::Error),
}

/// A CUDA command-line tool.
#[derive(Debug, Clone, Copy)]
pub struct Tool {
    pub name: &'static str,
    pub env: &'static str,
    pub package: &'static str,
}

pub const CUOBJDUMP: Tool = Tool {
    name: "cuobjdump",
    env: "DFLASH_CUOBJDUMP",
    package: "nvidia-cuda-cuobjdump",
};
pub const NVDISASM: Tool = Tool {
    name: "nvdisasm",
    env: "DFLASH_NVDISASM",
    package: "nvidia-cuda-nvdisasm",
};

impl Tool {
    pub fn missing(self, tried: String) -> KernelBenchError {
        KernelBenchError::ToolMissing {
            tool: self.name,
            env: self.env,
            package: self.package,
            tried,
        }
    }

    /// The program's path, or why there is none.
    pub fn find(self) -> Result<PathBuf, KernelBenchError> {
        if let Some(p) = std::env::var_os(self.env) {
            let p = PathBuf::from(p);
            return if p.is_file() {
                Ok(p)
            } else {
                Err(self.missing(format!("{}={}, not a file", self.env, p.display())))
            };
        }
        let on_path = std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
            .unwrap_or_default();
        let wheels = crate::device::libs::python_site_dirs()
            .iter()
            .flat_map(|s| {
                [
                    "nvidia/cu13/bin",
                    "nvidia/cuda_cuobjdump/bin",
                    "nvidia/cuda_nvdisasm/bin",
                ]
                .map(|d| s.join(d))
            });
        on_path
            .into_iter()
            .chain(wheels)
            .map(|d| d.join(self.name))
            .find(|p| p.is_file())
            .ok_or_else(|| self.missing("the PATH and Python's site-packages".into()))
    }
}

/// Runs cuobjdump with `args` on `cubin`, nvdisasm's directory first on its PATH (what
/// `-sass` runs); returns its standard output.
pub fn cuobjdump(
    cuobjdump: &Path,
    nvdisasm: Option<&Path>,
    args: &[&str],
    cubin: &Path,
) -> Result<String, KernelBenchError> {
    let mut cmd = Command::new(cuobjdump);
    cmd.args(args).arg(cubin);
    if let Some(dir) = nvdisasm.and_then(Path::parent) {
        let path = std::env::var_os("PATH").unwrap_or_default();
        let joined = std::env::join_paths(
            std::iter::once(dir.to_path_buf()).chain(std::env::split_paths(&path)),
        )
        .unwrap_or(path);
        cmd.env("PATH", joined);
    }
    let program = cuobjdump.display().to_string();
    let out = cmd.output().map_err(|source| KernelBenchError::Spawn {
        program: program.clone(),
        source,
    })?;
    if !out.status.success() {
        return Err(KernelBenchError::ToolFailed {
            program,
            args: args.join(" "),
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
