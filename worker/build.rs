//! Builds the host device: worker/cuda/kernels.cu compiled as C++ with the CUDA built-ins
//! of cuda/host/cuda_host.h, plus its launcher (cuda/host/runtime.cpp). The launcher's
//! kernel table is generated from the kernels' `extern "C" __global__` declarations, so
//! a kernel added to kernels.cu is launchable on the host device with no other change.

use std::path::PathBuf;

fn main() {
    let src = std::fs::read_to_string("cuda/kernels.cu").expect("reading cuda/kernels.cu");
    let mut table = String::new();
    for line in src.lines() {
        if let Some(rest) = line.trim_start().strip_prefix("extern \"C\" __global__ void ") {
            let name: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            table.push_str(&format!("HD_KERNEL({name})\n"));
        }
    }
    assert!(!table.is_empty(), "no extern \"C\" __global__ kernel found in cuda/kernels.cu");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    std::fs::write(out.join("kernel_table.inc"), table).expect("writing kernel_table.inc");
    cc::Build::new()
        .cpp(true)
        .std("c++20")
        .file("cuda/host/runtime.cpp")
        .include(&out)
        .include("cuda/host")
        .flag_if_supported("-pthread")
        .flag_if_supported("-Wno-unused-parameter")
        .opt_level(2)
        .compile("dflash_host_device");
    println!("cargo:rustc-link-lib=pthread");
    for f in ["cuda/kernels.cu", "cuda/host/cuda_host.h", "cuda/host/runtime.cpp"] {
        println!("cargo:rerun-if-changed={f}");
    }
}
