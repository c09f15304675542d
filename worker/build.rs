//! Builds the host device: worker/cuda/kernels.cu compiled as C++ with the CUDA built-ins
//! of cuda/host/cuda_host.h, plus its launcher (cuda/host/runtime.cpp). The emulated CUDA
//! driver of the tests (tests/emu-cuda) builds the same with the same code.

include!("cuda/host/build_host_device.rs");

fn main() {
    build_host_device(std::path::Path::new("cuda"), "dflash_host_device");
}
