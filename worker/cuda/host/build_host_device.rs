// Shared by the build scripts that compile the host device (worker/build.rs, and
// tests/emu-cuda/build.rs, the emulated CUDA driver): kernels.cu compiled as C++ with the
// CUDA built-ins of cuda_host.h, plus its launcher runtime.cpp. The launcher's kernel
// table is generated from the kernels' `extern "C" __global__` declarations, so a kernel
// added to kernels.cu is launchable on the host device with no other change. The test
// kernels of cuda/test_kernels.cu (names hdtest_*) come along, launchable by name only.

/// Compile the host device from `cuda` (the worker's cuda/ directory) into the static
/// library `lib_name`, linked into the crate being built.
pub fn build_host_device(cuda: &std::path::Path, lib_name: &str) {
    // kernels.cu with its families expanded (what NVRTC compiles: OUT_DIR/kernels.cu), then
    // the test kernels of its primitives (runtime.cpp includes both).
    let (kernels, families) = expand_kernels(cuda);
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    std::fs::write(out.join("kernels.cu"), &kernels).expect("writing OUT_DIR/kernels.cu");
    let mut src = kernels;
    src += &std::fs::read_to_string(cuda.join("test_kernels.cu")).unwrap_or_else(|e| panic!("reading cuda/test_kernels.cu: {e}"));
    let mut table = String::new();
    for line in src.lines() {
        if let Some(rest) = line.trim_start().strip_prefix("extern \"C\" __global__ void ") {
            let name: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            table.push_str(&format!("HD_KERNEL({name})\n"));
        }
    }
    assert!(!table.is_empty(), "no extern \"C\" __global__ kernel found in cuda/kernels.cu");
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
    for f in &families {
        println!("cargo:rerun-if-changed={}", cuda.join(f).display());
    }
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

/// cuda/kernels.cu with each `#include "<family>.cuh"` line replaced by that file (one
/// level: a family includes nothing), between `#line` directives so that a compiler's
/// messages name the family's file and line; and the families' file names, in order.
pub fn expand_kernels(cuda: &std::path::Path) -> (String, Vec<String>) {
    let read = |f: &str| std::fs::read_to_string(cuda.join(f)).unwrap_or_else(|e| panic!("reading cuda/{f}: {e}"));
    let mut out = String::new();
    let mut families = Vec::new();
    for (i, line) in read("kernels.cu").lines().enumerate() {
        let family = line.trim().strip_prefix("#include \"").and_then(|r| r.strip_suffix('"'));
        match family {
            Some(f) => {
                out += &format!("#line 1 \"{f}\"\n{}", read(f));
                if !out.ends_with('\n') {
                    out.push('\n');
                }
                out += &format!("#line {} \"kernels.cu\"\n", i + 2);
                families.push(f.to_string());
            }
            None => {
                out += line;
                out.push('\n');
            }
        }
    }
    (out, families)
}
