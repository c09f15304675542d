//! Finding the CUDA libraries a GPU worker loads at run time, all four the same way:
//!
//! 1. an override, `DFLASH_CUDA_LIB`, `DFLASH_CUBLAS_LIB`, `DFLASH_NVRTC_LIB` or
//!    `DFLASH_NCCL_LIB` (a path; an override that cannot be loaded is an error, not skipped);
//! 2. the dynamic loader's path by soname (`LD_LIBRARY_PATH`, ldconfig);
//! 3. the NVIDIA wheels of the Python installations on the machine (PyPI's
//!    `nvidia-cublas`, `nvidia-cuda-nvrtc`, `nvidia-nccl-cu13`, which PyTorch installs too):
//!    `site-packages/nvidia/{cu13,cublas,cuda_nvrtc,nccl}/lib`.
//!
//! cudarc opens the driver, cuBLAS and NVRTC itself, by soname. A library found here by path
//! is opened first with `RTLD_GLOBAL`, so cudarc's own `dlopen` of the soname finds this
//! one. [`report`] says which file each library came from and its version, which the worker
//! prints when it opens a GPU.

use std::ffi::{c_void, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// One of the CUDA libraries a GPU worker needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CudaLib {
    Driver,
    Cublas,
    Nvrtc,
    Nccl,
}

impl CudaLib {
    pub const ALL: [CudaLib; 4] = [
        CudaLib::Driver,
        CudaLib::Cublas,
        CudaLib::Nvrtc,
        CudaLib::Nccl,
    ];

    pub fn env(self) -> &'static str {
        match self {
            CudaLib::Driver => "DFLASH_CUDA_LIB",
            CudaLib::Cublas => "DFLASH_CUBLAS_LIB",
            CudaLib::Nvrtc => "DFLASH_NVRTC_LIB",
            CudaLib::Nccl => "DFLASH_NCCL_LIB",
        }
    }

    pub fn what(self) -> &'static str {
        match self {
            CudaLib::Driver => "the NVIDIA driver (libcuda)",
            CudaLib::Cublas => "cuBLAS",
            CudaLib::Nvrtc => "NVRTC (CUDA's run-time compiler)",
            CudaLib::Nccl => "NCCL",
        }
    }

    /// Sonames, in the order tried (cudarc binds the CUDA 13 API).
    pub fn sonames(self) -> &'static [&'static str] {
        match self {
            CudaLib::Driver => &["libcuda.so.1", "libcuda.so"],
            CudaLib::Cublas => &["libcublas.so.13", "libcublas.so"],
            CudaLib::Nvrtc => &["libnvrtc.so.13", "libnvrtc.so"],
            CudaLib::Nccl => &["libnccl.so.2", "libnccl.so"],
        }
    }

    /// Where PyPI's wheels put it, under a site-packages directory.
    fn in_wheels(self) -> &'static [&'static str] {
        match self {
            // The driver comes with the kernel module, never from a wheel.
            CudaLib::Driver => &[],
            CudaLib::Cublas => &[
                "nvidia/cu13/lib/libcublas.so.13",
                "nvidia/cublas/lib/libcublas.so.13",
            ],
            CudaLib::Nvrtc => &[
                "nvidia/cu13/lib/libnvrtc.so.13",
                "nvidia/cuda_nvrtc/lib/libnvrtc.so.13",
            ],
            CudaLib::Nccl => &["nvidia/nccl/lib/libnccl.so.2"],
        }
    }

    /// How to install it, for the error when it is missing.
    pub fn install_hint(self) -> &'static str {
        match self {
            CudaLib::Driver => "install the NVIDIA driver",
            CudaLib::Cublas => "pip install nvidia-cublas",
            CudaLib::Nvrtc => "pip install nvidia-cuda-nvrtc",
            CudaLib::Nccl => "pip install nvidia-nccl-cu13",
        }
    }

    /// A function every version exports (to find the file it was loaded from).
    fn probe_symbol(self) -> &'static str {
        match self {
            CudaLib::Driver => "cuInit",
            CudaLib::Cublas => "cublasCreate_v2",
            CudaLib::Nvrtc => "nvrtcVersion",
            CudaLib::Nccl => "ncclGetVersion",
        }
    }
}

/// site-packages (and dist-packages) directories of the Python installations here: the
/// usual prefixes, an active venv or conda env, and whatever `python3 -c site` says.
pub fn python_site_dirs() -> &'static [PathBuf] {
    static DIRS: OnceLock<Vec<PathBuf>> = OnceLock::new();
    DIRS.get_or_init(|| {
        let mut roots: Vec<PathBuf> = ["/usr/lib", "/usr/local/lib", "/opt/conda/lib"].iter().map(PathBuf::from).collect();
        for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
            if let Some(v) = std::env::var_os(var) {
                roots.push(Path::new(&v).join("lib"));
            }
        }
        if let Some(h) = std::env::var_os("HOME") {
            roots.push(Path::new(&h).join(".local/lib"));
        }
        let mut sites = Vec::new();
        for root in roots {
            let Ok(entries) = std::fs::read_dir(&root) else { continue };
            let mut pythons: Vec<PathBuf> = entries.flatten().map(|e| e.path()).filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("python3"))).collect();
            pythons.sort();
            for py in pythons {
                sites.push(py.join("site-packages"));
                sites.push(py.join("dist-packages"));
            }
        }
        // The python3 on the PATH knows its own (pyenv, conda, a venv not activated here).
        if let Ok(o) = std::process::Command::new("python3")
            .args(["-c", "import site; print('\\n'.join(site.getsitepackages() + [site.getusersitepackages()]))"])
            .stderr(std::process::Stdio::null())
            .output()
        {
            sites.extend(String::from_utf8_lossy(&o.stdout).lines().map(PathBuf::from));
        }
        let mut out: Vec<PathBuf> = Vec::new();
        for s in sites {
            if s.is_dir() && !out.contains(&s) {
                out.push(s);
            }
        }
        out
    })
}

/// Where `lib` is looked for, in order: the override, the sonames, the wheels.
pub fn candidates(lib: CudaLib) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Some(p) = std::env::var_os(lib.env()) {
        out.push(PathBuf::from(p));
    }
    out.extend(lib.sonames().iter().map(PathBuf::from));
    for site in python_site_dirs() {
        for rel in lib.in_wheels() {
            let p = site.join(rel);
            if p.is_file() && !out.contains(&p) {
                out.push(p);
            }
        }
    }
    out
}

/// A library that could not be loaded, with everything that was tried.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotFound(pub String);

impl std::fmt::Display for NotFound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// `dlopen` with `RTLD_GLOBAL`, once per process and library; the handle stays open for the
/// process's life (cudarc and the NCCL binding resolve their functions from it).
pub fn open(lib: CudaLib) -> Result<&'static Loaded, NotFound> {
    static OPENED: [OnceLock<Result<Loaded, NotFound>>; 4] = [
        OnceLock::new(),
        OnceLock::new(),
        OnceLock::new(),
        OnceLock::new(),
    ];
    let i = CudaLib::ALL.iter().position(|l| *l == lib).expect("listed");
    OPENED[i]
        .get_or_init(|| load(lib))
        .as_ref()
        .map_err(Clone::clone)
}

/// An opened library: its handle and the file it came from.
#[derive(Debug)]
pub struct Loaded {
    handle: usize,
    pub path: PathBuf,
}

impl Loaded {
    /// The address of `name` in this library, if it has it.
    pub fn symbol(&self, name: &str) -> Option<*mut c_void> {
        let c = CString::new(name).ok()?;
        // SAFETY: a handle from dlopen, never closed.
        let p = unsafe { libc::dlsym(self.handle as *mut c_void, c.as_ptr()) };
        (!p.is_null()).then_some(p)
    }
}

fn dl_error() -> String {
    // SAFETY: dlerror returns a thread-local string or null.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown error".into()
    } else {
        // SAFETY: NUL-terminated, valid until the next dl call on this thread.
        unsafe { std::ffi::CStr::from_ptr(e) }
            .to_string_lossy()
            .into_owned()
    }
}

fn load(lib: CudaLib) -> Result<Loaded, NotFound> {
    let tried = candidates(lib);
    let overridden = std::env::var_os(lib.env()).is_some();
    for (i, cand) in tried.iter().enumerate() {
        let Ok(c) = CString::new(cand.as_os_str().as_encoded_bytes()) else {
            continue;
        };
        // SAFETY: loading the library runs its initialisers, which set up its own state.
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if h.is_null() {
            if i == 0 && overridden {
                return Err(NotFound(format!(
                    "{}: {}={} cannot be loaded ({})",
                    lib.what(),
                    lib.env(),
                    cand.display(),
                    dl_error()
                )));
            }
            continue;
        }
        let path = file_of(h, lib).unwrap_or_else(|| cand.clone());
        return Ok(Loaded {
            handle: h as usize,
            path,
        });
    }
    let names: Vec<String> = tried.iter().map(|p| p.display().to_string()).collect();
    Err(NotFound(format!(
        "{} not found: tried {} (on the loader's path, then under the Python installations' site-packages); {} or set {}=/path/to/{}",
        lib.what(),
        names.join(", "),
        lib.install_hint(),
        lib.env(),
        lib.sonames()[0]
    )))
}

/// The file a handle's library was loaded from.
fn file_of(h: *mut c_void, lib: CudaLib) -> Option<PathBuf> {
    let sym = CString::new(lib.probe_symbol()).ok()?;
    // SAFETY: a live handle; dladdr only reads the loader's tables.
    unsafe {
        let f = libc::dlsym(h, sym.as_ptr());
        if f.is_null() {
            return None;
        }
        let mut info: libc::Dl_info = std::mem::zeroed();
        if libc::dladdr(f, &mut info) == 0 || info.dli_fname.is_null() {
            return None;
        }
        let p = PathBuf::from(
            std::ffi::CStr::from_ptr(info.dli_fname)
                .to_string_lossy()
                .into_owned(),
        );
        Some(std::fs::canonicalize(&p).unwrap_or(p))
    }
}

/// One line per library of `versions` (each with its version): where it was loaded from,
/// or why it was not.
pub fn report(versions: &[(CudaLib, String)]) -> Vec<String> {
    versions
        .iter()
        .map(|&(l, _)| {
            let v = versions
                .iter()
                .find(|(k, _)| *k == l)
                .map(|(_, v)| format!(" ({v})"))
                .unwrap_or_default();
            match open(l) {
                Ok(x) => format!("{}: {}{v}", l.what(), x.path.display()),
                Err(e) => format!("{}: not loaded: {e}", l.what()),
            }
        })
        .collect()
}
