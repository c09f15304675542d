//! The host device's kernels and launcher, as the worker builds them (shared code), linked
//! into the emulated driver: a module loaded from an NVRTC image launches these.

include!("../../worker/cuda/host/build_host_device.rs");

fn main() {
    build_host_device(
        std::path::Path::new("../../worker/cuda"),
        "dflash_emu_host_device",
    );
    // cudarc opens "libcuda.so" first: a library loaded by path under that soname is the one
    // it then finds (DFLASH_CUDA_LIB), whatever else the machine has.
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so");
}
