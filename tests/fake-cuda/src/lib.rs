//! A CUDA "driver" that has `cuInit` and no other function: what a worker meets when the
//! installed driver or CUDA libraries are older than the ones its build binds (cudarc
//! resolves each function on first use and panics on one that is missing). The tests link
//! it under the names of libcuda, libcublas and libnvrtc.

/// `CUresult cuInit(unsigned int flags)`: success.
#[no_mangle]
pub extern "C" fn cuInit(_flags: u32) -> i32 {
    0
}
