//! Finding the CUDA libraries a GPU worker loads at run time, all four the same way:
//!
//! 1. an override, `DFLASH_CUDA_LIB`, `DFLASH_CUBLAS_LIB`, `DFLASH_NVRTC_LIB` or
//!    `DFLASH_NCCL_LIB` (a path; an override that cannot be loaded is an error, not skipped);
//! 2. the dynamic loader's path by soname (`LD_LIBRARY_PATH`, ldconfig);
//! 3. the NVIDIA wheels of the Python installations on the machine (PyPI's
//!    `nvidia-cublas`, `nvidia-cuda-nvrtc`, `nvidia-nccl-cu13`, which PyTorch installs too):
//!    `site-packages/nvidia/{cu13,cublas,cuda_nvrtc,nccl}/lib`.
//!
//! cudarc opens the driver, cuBLAS and NVRTC itself, by name, trying `libcuda.so` before
//! `libcuda.so.1` (and so on). A library found here is opened first with `RTLD_GLOBAL`, so
//! that cudarc's own `dlopen` finds this one where the name matches its soname; where the
//! loader would give cudarc a *different* file (a CUDA toolkit's `stubs/libcuda.so` on
//! `LD_LIBRARY_PATH`, whose every call answers `CUDA_ERROR_STUB_LIBRARY`; a CUDA 12
//! `libcublas.so` beside a CUDA 13 wheel), opening fails with one line naming both files
//! rather than letting cudarc run on the wrong one. The driver itself is tried as
//! `libcuda.so.1` first (the driver's own soname), and a stub found there is skipped.
//!
//! NVRTC compiles by loading its builtins (`libnvrtc-builtins.so.MAJOR.MINOR`) by name. The
//! `nvidia-cuda-nvrtc` 13.0 wheel's `libnvrtc.so.13` has no RPATH, so loaded by path its
//! own `dlopen` of the builtins fails at the first compile; the builtins beside the chosen
//! libnvrtc are therefore loaded first (`RTLD_GLOBAL`), whatever the wheel's layout.
//!
//! [`report`] says which file each library came from and its version, which the worker
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

    /// The base name cudarc builds its candidate file names from (`None`: cudarc does not
    /// open it; NCCL is bound here).
    fn cudarc_name(self) -> Option<&'static str> {
        match self {
            CudaLib::Driver => Some("cuda"),
            CudaLib::Cublas => Some("cublas"),
            CudaLib::Nvrtc => Some("nvrtc"),
            CudaLib::Nccl => None,
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
    /// Libraries loaded with it so that it works (NVRTC's builtins).
    pub companions: Vec<PathBuf>,
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
    let mut stubs: Vec<PathBuf> = Vec::new();
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
        if lib == CudaLib::Driver && is_stub(h) {
            let found = found_as(h).unwrap_or(path);
            // SAFETY: our own handle, not used again.
            unsafe { libc::dlclose(h) };
            if !stubs.contains(&found) {
                stubs.push(found);
            }
            continue;
        }
        let loaded = Loaded {
            handle: h as usize,
            path,
            companions: Vec::new(),
        };
        check_cudarc_binds(lib, &loaded)?;
        return if lib == CudaLib::Nvrtc {
            load_nvrtc_builtins(loaded)
        } else {
            Ok(loaded)
        };
    }
    if !stubs.is_empty() {
        let names: Vec<String> = stubs.iter().map(|p| p.display().to_string()).collect();
        return Err(NotFound(format!(
            "{}: found only the CUDA toolkit's stub library ({}: its cuInit answers CUDA_ERROR_STUB_LIBRARY), no driver: install the NVIDIA driver, or put the directory of its libcuda.so.1 on LD_LIBRARY_PATH (or set {})",
            lib.what(),
            names.join(", "),
            lib.env()
        )));
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

/// `CUDA_ERROR_STUB_LIBRARY`: what every call of the toolkit's `stubs/libcuda.so` answers.
const CUDA_ERROR_STUB_LIBRARY: i32 = 34;

/// Whether the libcuda behind `h` is the CUDA toolkit's link-time stub (its `cuInit` says
/// so). On the real driver this is the `cuInit` the worker calls next anyway.
fn is_stub(h: *mut c_void) -> bool {
    // SAFETY: a live handle; `cuInit` has this signature in every CUDA release.
    unsafe {
        let f = libc::dlsym(h, c"cuInit".as_ptr());
        if f.is_null() {
            return false;
        }
        let cu_init: extern "C" fn(u32) -> i32 = std::mem::transmute(f);
        cu_init(0) == CUDA_ERROR_STUB_LIBRARY
    }
}

/// The file that cudarc's own `dlopen` of `lib` binds to: the first of its candidate names
/// that the loader resolves (a name matching a loaded library's soname gives that library).
fn cudarc_binding(lib: CudaLib) -> Option<(String, PathBuf, *mut c_void)> {
    let base = lib.cudarc_name()?;
    for name in cudarc::get_lib_name_candidates(base) {
        let Ok(c) = CString::new(name.as_str()) else {
            continue;
        };
        // SAFETY: as in `load`; a file already loaded is only referenced again.
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
        if h.is_null() {
            continue;
        }
        let Some(path) = file_of(h, lib) else {
            // SAFETY: our own reference.
            unsafe { libc::dlclose(h) };
            continue;
        };
        return Some((name, found_as(h).unwrap_or(path), h));
    }
    None
}

/// Refuses a library that cudarc would not use: the loader resolves the name cudarc tries
/// first to another file (a toolkit stub, another CUDA release) than the one chosen here.
fn check_cudarc_binds(lib: CudaLib, ours: &Loaded) -> Result<(), NotFound> {
    let Some((name, theirs, h)) = cudarc_binding(lib) else {
        return Ok(());
    };
    // `theirs` as the loader found it (for the directory to name), `ours` canonical.
    if same_file(&theirs, &ours.path) {
        // SAFETY: the extra reference taken by `cudarc_binding`.
        unsafe { libc::dlclose(h) };
        return Ok(());
    }
    let what = if lib == CudaLib::Driver && is_stub(h) {
        " (the CUDA toolkit's stub: its cuInit answers CUDA_ERROR_STUB_LIBRARY)"
    } else {
        ""
    };
    // SAFETY: as above; the other library is not used.
    unsafe { libc::dlclose(h) };
    let dir = theirs
        .parent()
        .map(|d| d.display().to_string())
        .unwrap_or_default();
    Err(NotFound(format!(
        "{}: the loader resolves {name} to {}{what}, not to {} chosen here, and the CUDA bindings open {name} first: take {dir} off LD_LIBRARY_PATH (or out of the ld.so cache)",
        lib.what(),
        theirs.display(),
        ours.path.display()
    )))
}

fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => a == b,
    }
}

/// NVRTC's `(major, minor)`, straight from the loaded library.
fn nvrtc_version_of(l: &Loaded) -> Option<(i32, i32)> {
    let f = l.symbol("nvrtcVersion")?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: `nvrtcVersion(int*, int*)` in every release; writes two ints.
    let rc = unsafe {
        let f: extern "C" fn(*mut i32, *mut i32) -> i32 = std::mem::transmute(f);
        f(&mut major, &mut minor)
    };
    (rc == 0).then_some((major, minor))
}

/// Loads `libnvrtc-builtins.so.MAJOR.MINOR` from beside the chosen libnvrtc (else by name,
/// from the loader's path) before anything compiles: a libnvrtc without an RPATH (the
/// 13.0 wheel's) cannot find it by itself, and its first compile would fail.
fn load_nvrtc_builtins(mut l: Loaded) -> Result<Loaded, NotFound> {
    let Some((major, minor)) = nvrtc_version_of(&l) else {
        return Ok(l);
    };
    let name = format!("libnvrtc-builtins.so.{major}.{minor}");
    let beside = l.path.parent().map(|d| d.join(&name));
    let mut tried = Vec::new();
    for cand in beside
        .iter()
        .filter(|p| p.is_file())
        .cloned()
        .chain([PathBuf::from(&name)])
    {
        let Ok(c) = CString::new(cand.as_os_str().as_encoded_bytes()) else {
            continue;
        };
        // SAFETY: as in `load`.
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if h.is_null() {
            tried.push(format!("{} ({})", cand.display(), dl_error()));
            continue;
        }
        l.companions
            .push(file_of_any(h, &cand).unwrap_or(cand.clone()));
        return Ok(l);
    }
    Err(NotFound(format!(
        "NVRTC {major}.{minor} at {}: its builtins {name} cannot be loaded (tried {}); NVRTC compiles nothing without them: reinstall the wheel (pip install --force-reinstall nvidia-cuda-nvrtc) or put the builtins beside {}",
        l.path.display(),
        tried.join(", "),
        l.path.display()
    )))
}

/// The file a handle came from, through the loader's own record of it, canonical.
fn file_of_any(h: *mut c_void, fallback: &Path) -> Option<PathBuf> {
    let p = found_as(h).unwrap_or_else(|| fallback.to_path_buf());
    Some(std::fs::canonicalize(&p).unwrap_or(p))
}

/// The path under which the loader found a handle's library (its link map's `l_name`: the
/// directory searched and the name asked for, links not followed).
fn found_as(h: *mut c_void) -> Option<PathBuf> {
    let mut map: *mut libc::c_void = std::ptr::null_mut();
    // SAFETY: RTLD_DI_LINKMAP writes a `struct link_map *` for a live handle.
    let rc = unsafe {
        libc::dlinfo(
            h,
            libc::RTLD_DI_LINKMAP,
            (&mut map as *mut *mut libc::c_void).cast(),
        )
    };
    if rc != 0 || map.is_null() {
        return None;
    }
    // `struct link_map { ElfW(Addr) l_addr; char *l_name; ... }`.
    // SAFETY: the loader's own link map for a loaded library.
    let name = unsafe { *(map as *const *const libc::c_char).add(1) };
    if name.is_null() {
        return None;
    }
    // SAFETY: NUL-terminated, owned by the loader.
    let p = PathBuf::from(
        unsafe { std::ffi::CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned(),
    );
    (!p.as_os_str().is_empty()).then_some(p)
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
    let mut out = Vec::new();
    for (l, v) in versions {
        match open(*l) {
            Ok(x) => {
                out.push(format!("{}: {} ({v})", l.what(), x.path.display()));
                out.extend(
                    x.companions
                        .iter()
                        .map(|c| format!("{} needs: {}", l.what(), c.display())),
                );
            }
            Err(e) => out.push(format!("{}: not loaded: {e}", l.what())),
        }
    }
    out
}
