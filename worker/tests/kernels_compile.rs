//! Every kernel of `cuda/kernels.cu` compiles with NVRTC for the GPUs the worker targets
//! (A100 sm_80, H100/H200 sm_90, B200 sm_100), and the on-disk cache returns what was
//! compiled. NVRTC comes from `DFLASH_NVRTC_LIB`, else from PyPI's `nvidia-cuda-nvrtc` in
//! python3's site-packages (what .ci/run installs). Without it the test says so and
//! passes on a laptop; it fails under CI (`CI` set) or with `DFLASH_REQUIRE_NVRTC=1`.

use std::path::PathBuf;
use std::process::Command;

use dflash_worker::device::nvrtc;

fn find_nvrtc() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("DFLASH_NVRTC_LIB") {
        return Some(PathBuf::from(p));
    }
    let out = Command::new("python3")
        .args([
            "-c",
            "import site; print('\\n'.join(site.getsitepackages() + [site.getusersitepackages()]))",
        ])
        .output()
        .ok()?;
    for dir in String::from_utf8_lossy(&out.stdout).lines() {
        for rel in [
            "nvidia/cu13/lib/libnvrtc.so.13",
            "nvidia/cuda_nvrtc/lib/libnvrtc.so.12",
        ] {
            let p = PathBuf::from(dir).join(rel);
            if p.exists() {
                return Some(p);
            }
        }
    }
    None
}

#[test]
fn kernels_compile_with_nvrtc_for_sm_80_sm_90_and_sm_100() {
    let required = std::env::var_os("CI").is_some()
        || std::env::var("DFLASH_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
    let Some(lib) = find_nvrtc() else {
        assert!(!required, "NVRTC not found (DFLASH_NVRTC_LIB, or pip install nvidia-cuda-nvrtc); .ci/run installs it");
        eprintln!(
            "skipped: NVRTC not found (pip install nvidia-cuda-nvrtc, or set DFLASH_NVRTC_LIB)"
        );
        return;
    };
    std::env::set_var("DFLASH_NVRTC_LIB", &lib);
    let (major, minor) = nvrtc::version().unwrap_or_else(|e| panic!("{}: {e}", lib.display()));
    eprintln!("NVRTC {major}.{minor} from {}", lib.display());
    let names = nvrtc::kernel_names(nvrtc::KERNELS_CU);
    assert!(names.len() >= 16, "{names:?}");
    let cache = tempfile::tempdir().unwrap();
    for arch in ["sm_80", "sm_90", "sm_100"] {
        let (out, cached) = nvrtc::compile_cached(nvrtc::KERNELS_CU, arch, cache.path())
            .unwrap_or_else(|e| panic!("{arch}: {e}"));
        assert!(
            !cached,
            "{arch}: first compile cannot come from an empty cache"
        );
        let ptx = &out.ptx;
        assert!(
            ptx.contains(&format!(".target {arch}")),
            "{arch}: PTX for another target"
        );
        for k in &names {
            assert!(
                ptx.contains(&format!(".entry {k}(")),
                "{arch}: kernel {k} missing from the PTX"
            );
        }
        // The CUBIN the worker loads: an ELF for the CUDA machine (EM_CUDA = 190) whose
        // e_flags name this architecture (bits 8..16 from ELF ABI 8), holding every kernel.
        let cubin = &out.cubin;
        assert!(
            cubin.starts_with(b"\x7fELF") && u16::from_le_bytes([cubin[18], cubin[19]]) == 190,
            "{arch}: not a CUBIN"
        );
        let flags = u32::from_le_bytes(cubin[48..52].try_into().unwrap());
        let sm = if cubin[8] >= 8 {
            (flags >> 8) & 0xff
        } else {
            flags & 0xff
        };
        assert_eq!(
            format!("sm_{sm}"),
            arch,
            "{arch}: the CUBIN's e_flags {flags:#x}"
        );
        for k in &names {
            assert!(
                cubin
                    .windows(k.len() + 2)
                    .any(|w| w[0] == 0 && &w[1..=k.len()] == k.as_bytes() && w[k.len() + 1] == 0),
                "{arch}: kernel {k} missing from the CUBIN"
            );
        }
        eprintln!(
            "{arch}: PTX ISA {:?}, CUBIN {} KB",
            out.ptx_isa(),
            cubin.len() / 1024
        );
        // Second time: from the cache, the same text.
        let (again, cached) = nvrtc::compile_cached(nvrtc::KERNELS_CU, arch, cache.path()).unwrap();
        assert!(cached && again == out, "{arch}: not served from the cache");
    }
    // Three architectures, three entries; a changed source is a new key.
    assert_eq!(
        std::fs::read_dir(cache.path())
            .unwrap()
            .filter(|e| e
                .as_ref()
                .unwrap()
                .path()
                .extension()
                .is_some_and(|x| x == "ptx"))
            .count(),
        3
    );
    let changed = format!("{}\n// changed\n", nvrtc::KERNELS_CU);
    let (_, cached) = nvrtc::compile_cached(&changed, "sm_90", cache.path()).unwrap();
    assert!(!cached, "a changed source must not hit the old entry");

    // A compile error comes back with NVRTC's log, naming the line.
    let err = nvrtc::compile(
        "extern \"C\" __global__ void broken(float* x) { x[0] = undefined_name; }",
        "sm_90",
    )
    .unwrap_err();
    assert!(err.to_string().contains("undefined_name"), "{err}");
}

/// Where `.ci/run` installs the `nvidia-cuda-nvrtc` 13.0 wheel beside the newest one
/// (`pip install --target target/nvrtc-13.0`), or `DFLASH_TEST_NVRTC_13_0` (its libnvrtc).
fn nvrtc_13_0() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("DFLASH_TEST_NVRTC_13_0") {
        return Some(PathBuf::from(p));
    }
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../target/nvrtc-13.0/nvidia/cu13/lib/libnvrtc.so.13");
    p.exists().then_some(p)
}

/// The child of the test below: NVRTC from `DFLASH_NVRTC_LIB` (a libnvrtc loaded by path,
/// its directory on no search path) compiles a kernel; prints what was loaded.
#[test]
fn child_compiles_with_the_nvrtc_of_dflash_nvrtc_lib() {
    if std::env::var_os("DFLASH_TEST_CHILD").is_none() {
        return;
    }
    use dflash_worker::device::libs::{self, CudaLib};
    let (major, minor) = nvrtc::version().unwrap_or_else(|e| panic!("{e}"));
    let out = nvrtc::compile(
        "extern \"C\" __global__ void twice(float* x) { x[threadIdx.x] *= 2.0f; }",
        "sm_90",
    )
    .unwrap_or_else(|e| panic!("NVRTC {major}.{minor}: {e}"));
    assert!(out.ptx.contains(".entry twice(") && out.cubin.starts_with(b"\x7fELF"));
    let l = libs::open(CudaLib::Nvrtc).unwrap();
    println!("NVRTC-VERSION {major}.{minor}");
    println!("NVRTC-PATH {}", l.path.display());
    for c in &l.companions {
        println!("NVRTC-COMPANION {}", c.display());
    }
}

/// The `nvidia-cuda-nvrtc` 13.0 wheel's libnvrtc has no RPATH: loaded by path, as the
/// worker loads a wheel's, its own `dlopen` of `libnvrtc-builtins.so.13.0` finds nothing
/// and every compile fails ("failed to open libnvrtc-builtins.so.13.0"). The worker loads
/// the builtins beside it first. A child process, so that nothing this process already
/// loaded answers for it, and with no search path naming the wheel's directory.
#[test]
fn the_nvrtc_13_0_wheel_compiles_when_loaded_by_path() {
    let required = std::env::var_os("CI").is_some()
        || std::env::var("DFLASH_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
    let Some(lib) = nvrtc_13_0() else {
        assert!(!required, "the NVRTC 13.0 wheel is not installed: .ci/run installs it into target/nvrtc-13.0 (or set DFLASH_TEST_NVRTC_13_0)");
        eprintln!(
            "skipped: pip install --no-deps --target target/nvrtc-13.0 'nvidia-cuda-nvrtc==13.0.*'"
        );
        return;
    };
    let lib = std::fs::canonicalize(&lib).unwrap();
    let dir = lib.parent().unwrap().to_path_buf();
    // The wheel as the review found it: no RPATH, so nothing but our loading finds its builtins.
    let dynamic = Command::new("readelf").arg("-d").arg(&lib).output();
    if let Ok(o) = dynamic {
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(
            !text.contains("RPATH") && !text.contains("RUNPATH"),
            "{} has a search path of its own; this is not the wheel the test is about:\n{text}",
            lib.display()
        );
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_compiles_with_the_nvrtc_of_dflash_nvrtc_lib",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("DFLASH_TEST_CHILD", "1")
        .env("DFLASH_NVRTC_LIB", &lib)
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    assert!(text.contains("NVRTC-VERSION 13.0"), "{text}");
    let companion = text
        .lines()
        .find_map(|l| l.strip_prefix("NVRTC-COMPANION "))
        .unwrap_or_else(|| panic!("no builtins loaded with NVRTC:\n{text}"));
    assert_eq!(
        PathBuf::from(companion),
        dir.join("libnvrtc-builtins.so.13.0"),
        "{text}"
    );
}
