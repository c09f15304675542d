//! A CUDA "driver" that has `cuInit` and no other function: what a worker meets when the
//! installed driver or CUDA libraries are older than the ones its build binds (cudarc
//! resolves each function on first use and panics on one that is missing). The tests link
//! it under the names of libcuda, libcublas and libnvrtc.
//!
//! With `DFLASH_FAKE_CUDA_STUB=1` in the environment it is the CUDA toolkit's link-time stub
//! (`stubs/libcuda.so`) instead: `cuInit` answers `CUDA_ERROR_STUB_LIBRARY` (34).

/// `CUresult cuInit(unsigned int flags)`: success, or `CUDA_ERROR_STUB_LIBRARY` as a stub.
#[no_mangle]
pub extern "C" fn cuInit(_flags: u32) -> i32 {
    if std::env::var_os("DFLASH_FAKE_CUDA_STUB").is_some_and(|v| v == "1") {
        34
    } else {
        0
    }
}
