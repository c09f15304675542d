// Shared by the build scripts that compile the host device (worker/build.rs, and
// tests/emu-cuda/build.rs, the emulated CUDA driver): kernels.cu compiled as C++ with the
// CUDA built-ins of cuda_host.h, plus its launcher runtime.cpp. The launcher's kernel
// table is generated from the kernels' `extern "C" __global__` declarations, so a kernel
// added to kernels.cu is launchable on the host device with no other change. The test
// kernels of cuda/test_kernels.cu (names hdtest_*) come along, launchable by name only.

/// Compile the host device from `cuda` (the worker's cuda/ directory) into the static
/// library `lib_name`, linked into the crate being built.
pub fn build_host_device(cuda: &std::path::Path, lib_name: &str) {
    // kernels.cu, then the test kernels of its primitives (runtime.cpp includes both).
    let mut src = String::new();
    for f in ["kernels.cu", "test_kernels.cu"] {
        src += &std::fs::read_to_string(cuda.join(f)).unwrap_or_else(|e| panic!("reading cuda/{f}: {e}"));
    }
    let mut table = String::new();
    for line in src.lines() {
        if let Some(rest) = line.trim_start().strip_prefix("extern \"C\" __global__ void ") {
            let name: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            table.push_str(&format!("HD_KERNEL({name})\n"));
        }
    }
    assert!(!table.is_empty(), "no extern \"C\" __global__ kernel found in cuda/kernels.cu");
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    std::fs::write(out.join("kernel_table.inc"), table).expect("writing kernel_table.inc");
    cc::Build::new()
        .cpp(true)
        .std("c++20")
        .file(cuda.join("host/runtime.cpp"))
        .include(&out)
        .include(cuda.join("host"))
        .flag_if_supported("-pthread")
        .flag_if_supported("-Wno-unused-parameter")
        .opt_level(2)
        .compile(lib_name);
    println!("cargo:rustc-link-lib=pthread");
    for f in [
        "kernels.cu",
        "test_kernels.cu",
        "host/cuda_host.h",
        "host/runtime.cpp",
        "host/build_host_device.rs",
    ] {
        println!("cargo:rerun-if-changed={}", cuda.join(f).display());
    }
}
