//! `libcublas.so` of the emulated CUDA stack. cuBLAS is written in the emulated driver
//! (tests/emu-cuda, `blas.rs`), which owns the streams a GEMM is queued on; this library
//! only gives it the soname cudarc looks for, forwarding each entry point to the driver's
//! (found as the already loaded `libcuda.so.1`, as a real cuBLAS finds its driver).

#![allow(non_snake_case, clippy::missing_safety_doc)]

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

/// The emulated driver's handle (it must be loaded first, as cudarc loads libcuda first).
fn driver() -> *mut c_void {
    static H: OnceLock<usize> = OnceLock::new();
    *H.get_or_init(|| {
        // SAFETY: dlopen of a library already loaded (RTLD_NOLOAD: the driver's soname,
        // libcuda.so.1) or on the loader's path.
        let h =
            unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
        let h = if h.is_null() {
            unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW) }
        } else {
            h
        };
        assert!(
            !h.is_null(),
            "emulated cuBLAS: the emulated driver (libcuda.so.1) is not loaded"
        );
        h as usize
    }) as *mut c_void
}

fn entry(name: &CStr) -> *mut c_void {
    // SAFETY: looks a symbol up in the driver.
    let f = unsafe { libc::dlsym(driver(), name.as_ptr()) };
    assert!(
        !f.is_null(),
        "emulated cuBLAS: the emulated driver lacks {name:?}"
    );
    f
}

/// Forward `name(args) -> ret` to the driver's function of that name.
macro_rules! forward {
    ($($name:ident($($a:ident: $t:ty),*) -> $r:ty;)*) => {$(
        #[no_mangle]
        pub unsafe extern "C" fn $name($($a: $t),*) -> $r {
            static F: OnceLock<usize> = OnceLock::new();
            let f = *F.get_or_init(|| entry(&std::ffi::CString::new(stringify!($name)).unwrap()) as usize);
            // SAFETY: the driver defines it with this signature (tests/emu-cuda/src/blas.rs).
            let f: unsafe extern "C" fn($($t),*) -> $r = std::mem::transmute(f);
            f($($a),*)
        }
    )*};
}

forward! {
    cublasCreate_v2(h: *mut *mut c_void) -> c_int;
    cublasDestroy_v2(h: *mut c_void) -> c_int;
    cublasSetStream_v2(h: *mut c_void, s: u64) -> c_int;
    cublasGetStream_v2(h: *mut c_void, s: *mut u64) -> c_int;
    cublasSetMathMode(h: *mut c_void, m: c_int) -> c_int;
    cublasGetMathMode(h: *mut c_void, m: *mut c_int) -> c_int;
    cublasSetWorkspace_v2(h: *mut c_void, w: *mut c_void, n: usize) -> c_int;
    cublasSetPointerMode_v2(h: *mut c_void, m: c_int) -> c_int;
    cublasGetVersion_v2(h: *mut c_void, v: *mut c_int) -> c_int;
    cublasGetStatusString(s: c_int) -> *const c_char;
    cublasGetStatusName(s: c_int) -> *const c_char;
    cublasSgemm_v2(h: *mut c_void, ta: c_int, tb: c_int, m: c_int, n: c_int, k: c_int, alpha: *const f32, a: *const f32, lda: c_int, b: *const f32, ldb: c_int, beta: *const f32, c: *mut f32, ldc: c_int) -> c_int;
    cublasGemmEx(h: *mut c_void, ta: c_int, tb: c_int, m: c_int, n: c_int, k: c_int, alpha: *const c_void, a: *const c_void, at: c_int, lda: c_int, b: *const c_void, bt: c_int, ldb: c_int, beta: *const c_void, c: *mut c_void, ct: c_int, ldc: c_int, compute: c_int, algo: c_int) -> c_int;
}
