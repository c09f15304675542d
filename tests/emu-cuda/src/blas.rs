//! The cuBLAS subset the worker calls, written from cuBLAS's documented contract (not from
//! the worker's own GEMM code), so that a test over it checks the worker's mapping of its
//! row-major products onto cuBLAS:
//!
//! `C = alpha·op(A)·op(B) + beta·C` with column-major matrices: element (i, j) of X is
//! `X[i + j·ldx]`; op(A) is m×k (A is m×k, or k×m when transposed), op(B) k×n, C m×n.
//! `lda ≥ max(1, rows of A as stored)`, likewise ldb, and `ldc ≥ max(1, m)`, else
//! `CUBLAS_STATUS_INVALID_VALUE`. When beta is 0, C is not read (it may hold NaN). alpha
//! and beta are read from host memory at the call (the default pointer mode). The product
//! runs on the handle's stream (`cublasSetStream`), f32 accumulation; a bf16 C is rounded
//! to nearest even once.
//!
//! A handle's workspace is shared by every GEMM it runs: GEMMs of one handle on two streams
//! with nothing ordering them could run at once on a GPU and use it together. That is
//! refused here (`CUBLAS_STATUS_EXECUTION_FAILED`, with a line saying why).

use std::ffi::{c_char, c_int, c_void};
use std::sync::Mutex;

use crate::{driver, Clock, ERROR_ILLEGAL_ADDRESS};

pub type Status = c_int;
const SUCCESS: Status = 0;
const NOT_INITIALIZED: Status = 1;
const INVALID_VALUE: Status = 7;
const EXECUTION_FAILED: Status = 13;
const NOT_SUPPORTED: Status = 15;

const R_32F: c_int = 0;
const R_16BF: c_int = 14;
const COMPUTE_32F: c_int = 68;

fn refuse(code: Status, msg: impl AsRef<str>) -> Status {
    eprintln!("emulated cuBLAS: {}", msg.as_ref());
    code
}

pub struct Handle {
    stream: Mutex<u64>,
    /// The last GEMM queued: on which stream, at which point of its clock.
    last: Mutex<Option<(u32, u64)>>,
    math_mode: Mutex<c_int>,
}

#[no_mangle]
pub unsafe extern "C" fn cublasCreate_v2(out: *mut *mut Handle) -> Status {
    if crate::cuInit(0) != crate::SUCCESS {
        return NOT_INITIALIZED;
    }
    *out = Box::into_raw(Box::new(Handle {
        stream: Mutex::new(0),
        last: Mutex::new(None),
        math_mode: Mutex::new(0),
    }));
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cublasDestroy_v2(h: *mut Handle) -> Status {
    if h.is_null() {
        return NOT_INITIALIZED;
    }
    drop(Box::from_raw(h));
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cublasSetStream_v2(h: *mut Handle, stream: u64) -> Status {
    let Some(h) = h.as_ref() else {
        return NOT_INITIALIZED;
    };
    *h.stream.lock().unwrap() = stream;
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cublasGetStream_v2(h: *mut Handle, stream: *mut u64) -> Status {
    let Some(h) = h.as_ref() else {
        return NOT_INITIALIZED;
    };
    *stream = *h.stream.lock().unwrap();
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cublasSetMathMode(h: *mut Handle, mode: c_int) -> Status {
    let Some(h) = h.as_ref() else {
        return NOT_INITIALIZED;
    };
    *h.math_mode.lock().unwrap() = mode;
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cublasGetMathMode(h: *mut Handle, mode: *mut c_int) -> Status {
    let Some(h) = h.as_ref() else {
        return NOT_INITIALIZED;
    };
    *mode = *h.math_mode.lock().unwrap();
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cublasSetWorkspace_v2(
    h: *mut Handle,
    _ws: *mut c_void,
    _bytes: usize,
) -> Status {
    if h.is_null() {
        return NOT_INITIALIZED;
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cublasSetPointerMode_v2(h: *mut Handle, mode: c_int) -> Status {
    if h.is_null() {
        return NOT_INITIALIZED;
    }
    if mode != 0 {
        return refuse(NOT_SUPPORTED, "device pointer mode is not emulated");
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cublasGetVersion_v2(_h: *mut Handle, v: *mut c_int) -> Status {
    *v = 130200;
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cublasGetStatusString(s: Status) -> *const c_char {
    status_name(s).as_ptr()
}

#[no_mangle]
pub extern "C" fn cublasGetStatusName(s: Status) -> *const c_char {
    status_name(s).as_ptr()
}

fn status_name(s: Status) -> &'static std::ffi::CStr {
    match s {
        SUCCESS => c"CUBLAS_STATUS_SUCCESS",
        NOT_INITIALIZED => c"CUBLAS_STATUS_NOT_INITIALIZED",
        INVALID_VALUE => c"CUBLAS_STATUS_INVALID_VALUE",
        EXECUTION_FAILED => c"CUBLAS_STATUS_EXECUTION_FAILED",
        NOT_SUPPORTED => c"CUBLAS_STATUS_NOT_SUPPORTED",
        _ => c"CUBLAS_STATUS_INTERNAL_ERROR",
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Elem {
    F32,
    Bf16,
}

impl Elem {
    fn of(t: c_int) -> Option<Elem> {
        match t {
            R_32F => Some(Elem::F32),
            R_16BF => Some(Elem::Bf16),
            _ => None,
        }
    }
    fn bytes(self) -> usize {
        match self {
            Elem::F32 => 4,
            Elem::Bf16 => 2,
        }
    }
    /// # Safety
    /// `p` holds element `i` of this type.
    unsafe fn load(self, p: u64, i: usize) -> f32 {
        match self {
            Elem::F32 => *(p as *const f32).add(i),
            Elem::Bf16 => f32::from_bits((*(p as *const u16).add(i) as u32) << 16),
        }
    }
    /// # Safety
    /// `p` holds element `i` of this type.
    unsafe fn store(self, p: u64, i: usize, v: f32) {
        match self {
            Elem::F32 => *(p as *mut f32).add(i) = v,
            Elem::Bf16 => *(p as *mut u16).add(i) = bf16_rne(v),
        }
    }
}

/// f32 → bf16, round to nearest even (NaN stays NaN).
fn bf16_rne(v: f32) -> u16 {
    let u = v.to_bits();
    if v.is_nan() {
        return ((u >> 16) | 0x40) as u16;
    }
    ((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

struct Product {
    transa: bool,
    transb: bool,
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: (u64, usize, Elem),
    b: (u64, usize, Elem),
    beta: f32,
    c: (u64, usize, Elem),
}

impl Product {
    /// # Safety
    /// The operands cover their shapes (checked when queued).
    unsafe fn run(&self) {
        let (m, n, k) = (self.m, self.n, self.k);
        let (a, lda, ta) = self.a;
        let (b, ldb, tb) = self.b;
        let (c, ldc, tc) = self.c;
        // op(A)(i, p) and op(B)(p, j), by the column-major definition.
        let at = |i: usize, p: usize| {
            if self.transa {
                ta.load(a, p + i * lda)
            } else {
                ta.load(a, i + p * lda)
            }
        };
        let bt = |p: usize, j: usize| {
            if self.transb {
                tb.load(b, j + p * ldb)
            } else {
                tb.load(b, p + j * ldb)
            }
        };
        let mut col = vec![0f32; m];
        for j in 0..n {
            col.iter_mut().for_each(|x| *x = 0.0);
            if self.alpha != 0.0 {
                for p in 0..k {
                    let bv = bt(p, j);
                    for (i, acc) in col.iter_mut().enumerate() {
                        *acc += at(i, p) * bv;
                    }
                }
            }
            for (i, acc) in col.iter().enumerate() {
                let prior = if self.beta == 0.0 {
                    0.0
                } else {
                    self.beta * tc.load(c, i + j * ldc)
                };
                tc.store(c, i + j * ldc, self.alpha * acc + prior);
            }
        }
    }
}

/// Elements a column-major `rows`×`cols` matrix with leading dimension `ld` spans.
fn extent(rows: usize, cols: usize, ld: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) + (cols - 1) * ld + 1
    }
}

#[allow(clippy::too_many_arguments)]
unsafe fn gemm(
    h: *mut Handle,
    transa: c_int,
    transb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: f32,
    a: (u64, c_int, Elem),
    b: (u64, c_int, Elem),
    beta: f32,
    c: (u64, c_int, Elem),
    what: &str,
) -> Status {
    let Some(handle) = h.as_ref() else {
        return NOT_INITIALIZED;
    };
    let op = |t: c_int| match t {
        0 => Some(false),
        1 | 2 => Some(true), // C (conjugate transpose) is T for real types
        _ => None,
    };
    let (Some(ta), Some(tb)) = (op(transa), op(transb)) else {
        return refuse(
            INVALID_VALUE,
            format!("{what}: transa {transa} / transb {transb} (expected 0, 1 or 2)"),
        );
    };
    if m < 0 || n < 0 || k < 0 {
        return refuse(
            INVALID_VALUE,
            format!("{what}: m {m}, n {n}, k {k} (negative)"),
        );
    }
    let (mu, nu, ku) = (m as usize, n as usize, k as usize);
    let (a_rows, a_cols) = if ta { (ku, mu) } else { (mu, ku) };
    let (b_rows, b_cols) = if tb { (nu, ku) } else { (ku, nu) };
    if (a.1 as i64) < a_rows.max(1) as i64
        || (b.1 as i64) < b_rows.max(1) as i64
        || (c.1 as i64) < mu.max(1) as i64
    {
        return refuse(INVALID_VALUE, format!("{what}: lda {} / ldb {} / ldc {} below the rows of A ({a_rows}), B ({b_rows}), C ({mu})", a.1, b.1, c.1));
    }
    if mu == 0 || nu == 0 {
        return SUCCESS;
    }
    let stream = *handle.stream.lock().unwrap();
    let (sid, clock) = match crate::stream_clock(stream) {
        Ok(v) => v,
        Err(_) => return NOT_INITIALIZED,
    };
    {
        let last = handle.last.lock().unwrap();
        if let Some((s, seq)) = *last {
            if s != sid && clock.get(s) < seq {
                return refuse(
                    EXECUTION_FAILED,
                    format!("{what} on stream {sid}: this handle's previous GEMM was queued on stream {s} with nothing ordering the two; they may run at once and share the handle's workspace (use a handle per stream)"),
                );
            }
        }
    }
    let d = driver();
    let used = |p: u64,
                rows: usize,
                cols: usize,
                ld: c_int,
                e: Elem,
                name: &str,
                clock: &Clock|
     -> Result<(), crate::Fault> {
        let n = extent(rows, cols, ld as usize);
        if n == 0 {
            return Ok(());
        }
        d.check_device_ptr(p, sid, clock, &format!("{what}: {name}"))?;
        match d.find(p) {
            Some((start, len, _)) if p + (n * e.bytes()) as u64 <= start + len as u64 => Ok(()),
            _ => Err((
                ERROR_ILLEGAL_ADDRESS,
                format!(
                    "{what}: {name} ({rows}×{cols}, ld {ld}) runs past the end of its allocation"
                ),
            )),
        }
    };
    let checks = used(a.0, a_rows, a_cols, a.1, a.2, "A", &clock)
        .and(used(b.0, b_rows, b_cols, b.1, b.2, "B", &clock))
        .and(used(c.0, mu, nu, c.1, c.2, "C", &clock));
    let product = Product {
        transa: ta,
        transb: tb,
        m: mu,
        n: nu,
        k: ku,
        alpha,
        a: (a.0, a.1 as usize, a.2),
        b: (b.0, b.1 as usize, b.2),
        beta,
        c: (c.0, c.1 as usize, c.2),
    };
    let job: crate::Job = match checks {
        // A GPU faults when the kernel touches it: asynchronously, sticky.
        Err(f) => Box::new(move || Err(f)),
        Ok(()) => Box::new(move || {
            // SAFETY: every operand covers its shape (checked above).
            unsafe { product.run() };
            Ok(())
        }),
    };
    match crate::submit(stream, job) {
        Ok((s, c)) => {
            *handle.last.lock().unwrap() = Some((s, c.get(s)));
            SUCCESS
        }
        Err(_) => NOT_INITIALIZED,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cublasSgemm_v2(
    h: *mut Handle,
    transa: c_int,
    transb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const f32,
    a: *const f32,
    lda: c_int,
    b: *const f32,
    ldb: c_int,
    beta: *const f32,
    c: *mut f32,
    ldc: c_int,
) -> Status {
    if alpha.is_null() || beta.is_null() {
        return refuse(INVALID_VALUE, "cublasSgemm: a null alpha or beta");
    }
    gemm(
        h,
        transa,
        transb,
        m,
        n,
        k,
        *alpha,
        (a as u64, lda, Elem::F32),
        (b as u64, ldb, Elem::F32),
        *beta,
        (c as u64, ldc, Elem::F32),
        "cublasSgemm",
    )
}

#[no_mangle]
pub unsafe extern "C" fn cublasGemmEx(
    h: *mut Handle,
    transa: c_int,
    transb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: *const c_void,
    a: *const c_void,
    atype: c_int,
    lda: c_int,
    b: *const c_void,
    btype: c_int,
    ldb: c_int,
    beta: *const c_void,
    c: *mut c_void,
    ctype: c_int,
    ldc: c_int,
    compute: c_int,
    _algo: c_int,
) -> Status {
    let (Some(ea), Some(eb), Some(ec)) = (Elem::of(atype), Elem::of(btype), Elem::of(ctype)) else {
        return refuse(NOT_SUPPORTED, format!("cublasGemmEx: data types A {atype}, B {btype}, C {ctype} are not emulated (f32 or bf16)"));
    };
    // The documented combinations for CUBLAS_COMPUTE_32F: A and B of one type; an f32 C
    // with bf16 inputs, or C of the inputs' type.
    if compute != COMPUTE_32F || ea != eb || (ea == Elem::F32 && ec != Elem::F32) {
        return refuse(NOT_SUPPORTED, format!("cublasGemmEx: compute type {compute} with A {atype}, B {btype}, C {ctype} is not a supported combination"));
    }
    if alpha.is_null() || beta.is_null() {
        return refuse(INVALID_VALUE, "cublasGemmEx: a null alpha or beta");
    }
    // With CUBLAS_COMPUTE_32F, alpha and beta are f32.
    let (alpha, beta) = (*(alpha as *const f32), *(beta as *const f32));
    gemm(
        h,
        transa,
        transb,
        m,
        n,
        k,
        alpha,
        (a as u64, lda, ea),
        (b as u64, ldb, eb),
        beta,
        (c as u64, ldc, ec),
        "cublasGemmEx",
    )
}
