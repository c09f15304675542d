//! The host device's kernels and launcher, as the worker builds them (shared code), linked
//! into the emulated driver: a module loaded from an NVRTC image launches these.

include!("../../worker/cuda/host/build_host_device.rs");

fn main() {
    build_host_device(
        std::path::Path::new("../../worker/cuda"),
        "dflash_emu_host_device",
    );
    // The real driver's soname. cudarc tries "libcuda.so" first and "libcuda.so.1" last: on a
    // machine with no other libcuda (CI) the driver loaded by path (DFLASH_CUDA_LIB) is the one
    // it binds; where another file answers to "libcuda.so" (a toolkit's stub), the worker
    // refuses with both named, as it does with a real driver.
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so.1");
}
