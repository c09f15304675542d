//! An emulated CUDA stack: one shared library that answers as `libcuda` (the driver subset
//! that cudarc and the worker call), `libcublas` ([`blas`]) and `libnccl` ([`nccl`]). The
//! tests put it on the loader's path under those names, so the worker's production GPU code
//! (`gpu/cuda.rs`, `collective/nccl.rs`) runs in CI exactly as it would on a GPU: loaded by
//! cudarc's dynamic loading and the NCCL loader, nothing of the worker changed.
//!
//! What it models, because that is what goes wrong on a first GPU run:
//! - **Streams are asynchronous.** Every stream has its own thread that runs its work in
//!   order; a call that queues work returns before it runs. Events complete when the stream
//!   reaches them; `cuStreamWaitEvent` makes a stream's thread wait. A missing wait is a
//!   real race here, as on a GPU.
//! - **Ordering is checked.** A vector clock per stream (and one for the host) follows
//!   stream order, event waits and host syncs, as the host device's race detector does.
//!   Memory from `cuMemAllocAsync` used on another stream before the allocation is ordered
//!   before that use, and one cuBLAS handle running GEMMs on two streams at once (they share
//!   its workspace), fail with an error naming both sides.
//! - **Memory is checked.** Device memory is host memory (a device address is a host
//!   address), filled with a NaN pattern when allocated, as fresh GPU memory is garbage.
//!   A kernel or cuBLAS pointer that is neither device memory nor registered host memory
//!   faults (`CUDA_ERROR_ILLEGAL_ADDRESS`, sticky, as on a GPU). Copies from pageable host
//!   memory are staged at the call; copies to or from registered memory happen when the
//!   stream gets there.
//! - **Bubbles are counted.** A host wait that leaves the stream it waits for with nothing
//!   queued behind it (a synchronous copy, a stream sync, an event with no later work on
//!   its stream) is a *dry wait*: on a GPU the stream idles while the host catches up.
//!   `dflash_emu_dry_waits()` says how many there were, for tests around a training step.
//! - **Images are checked.** `cuModuleLoadData` takes what NVRTC made: a CUBIN must be for
//!   this device's architecture (`CUDA_ERROR_NO_BINARY_FOR_GPU`), a PTX's ISA version must
//!   be one this driver version knows (`CUDA_ERROR_UNSUPPORTED_PTX_VERSION`). The kernels
//!   themselves are `worker/cuda/kernels.cu` compiled for the host (the host device's
//!   launcher), found by entry name; their parameters are copied at the launch by each
//!   kernel's signature.
//!
//! The emulated machine is set by the environment: `CUDA_VISIBLE_DEVICES` (how many
//! devices; empty means none), `DFLASH_EMU_ARCH` (compute capability, default 90),
//! `DFLASH_EMU_DRIVER_VERSION` (default 13090: CUDA 13.9, newer than any NVRTC of the tests), `DFLASH_EMU_MEMORY_MIB`
//! (default 16384), `DFLASH_EMU_REFUSE_CUBIN` (refuse every CUBIN, as a driver that does not
//! know the GPU's architecture would). Everything it refuses is also printed on stderr with
//! "emulated CUDA:" in front, so a test log says why.

#![allow(
    non_snake_case,
    clippy::missing_safety_doc,
    clippy::not_unsafe_ptr_arg_deref
)]

pub mod blas;
mod image;
pub mod nccl;
mod stream;

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::{Arc, Mutex, OnceLock};

pub use stream::{Clock, Stream};
use stream::{EventObj, Job};

pub type CUresult = c_int;
pub const SUCCESS: CUresult = 0;
pub const ERROR_INVALID_VALUE: CUresult = 1;
pub const ERROR_OUT_OF_MEMORY: CUresult = 2;
pub const ERROR_NOT_INITIALIZED: CUresult = 3;
pub const ERROR_NO_DEVICE: CUresult = 100;
pub const ERROR_INVALID_DEVICE: CUresult = 101;
pub const ERROR_INVALID_IMAGE: CUresult = 200;
pub const ERROR_INVALID_CONTEXT: CUresult = 201;
pub const ERROR_NO_BINARY_FOR_GPU: CUresult = 209;
pub const ERROR_INVALID_PTX: CUresult = 218;
pub const ERROR_UNSUPPORTED_PTX_VERSION: CUresult = 222;
pub const ERROR_INVALID_HANDLE: CUresult = 400;
pub const ERROR_NOT_FOUND: CUresult = 500;
pub const ERROR_NOT_READY: CUresult = 600;
pub const ERROR_ILLEGAL_ADDRESS: CUresult = 700;
pub const ERROR_HOST_MEMORY_ALREADY_REGISTERED: CUresult = 712;
pub const ERROR_HOST_MEMORY_NOT_REGISTERED: CUresult = 713;
pub const ERROR_NOT_SUPPORTED: CUresult = 801;

/// An error of work that ran on a stream: the code and what happened.
pub type Fault = (CUresult, String);

/// Say why a call is refused (the worker's log shows it), and return the code.
pub fn refuse(code: CUresult, msg: impl AsRef<str>) -> CUresult {
    eprintln!("emulated CUDA: {}", msg.as_ref());
    code
}

extern "C" {
    fn dflash_hd_kernel_count() -> c_int;
    fn dflash_hd_kernel_name(i: c_int) -> *const c_char;
    fn dflash_hd_kernel_sig(i: c_int) -> *const c_char;
    fn dflash_hd_launch(
        index: c_int,
        grid: *const u32,
        block: *const u32,
        args: *mut *mut c_void,
        err: *mut c_char,
        errlen: usize,
    ) -> c_int;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemKind {
    /// `cuMemAlloc`: usable on every stream at once.
    Device,
    /// `cuMemAllocAsync` on a stream: usable elsewhere once ordered after (stream, seq).
    DeviceAsync { stream: u32, seq: u64 },
    /// `cuMemHostRegister`ed host memory.
    Registered,
}

#[derive(Debug)]
struct Alloc {
    len: usize,
    kind: MemKind,
}

/// The machine and everything alive on it.
pub struct Driver {
    pub arch: (i32, i32),
    pub devices: i32,
    pub version: i32,
    total: usize,
    allocs: Mutex<BTreeMap<u64, Alloc>>,
    used: Mutex<usize>,
    /// The first fault of work on a stream: every later sync point returns it (a GPU's
    /// sticky errors).
    sticky: Mutex<Option<Fault>>,
    /// What the host has waited for.
    host_clock: Mutex<Clock>,
    next_stream: Mutex<u32>,
    /// The legacy default stream (handle 0).
    null_stream: OnceLock<Arc<Stream>>,
    kernels: HashMap<String, (c_int, String)>,
}

static DRIVER: OnceLock<Driver> = OnceLock::new();
static INIT: Mutex<Option<CUresult>> = Mutex::new(None);

thread_local! {
    pub(crate) static CURRENT: Cell<u64> = const { Cell::new(0) };
}

/// The primary context of device 0 (every device shares it: the tests see one device per
/// process, as CUDA_VISIBLE_DEVICES gives a worker).
const PRIMARY_CTX: u64 = 0xC0_0000;

fn env_num(name: &str, default: i64) -> i64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default)
}

pub fn driver() -> &'static Driver {
    DRIVER.get_or_init(|| {
        let arch = env_num("DFLASH_EMU_ARCH", 90) as i32;
        let devices = match std::env::var("CUDA_VISIBLE_DEVICES") {
            Ok(v) if v.trim().is_empty() => 0,
            Ok(v) => v.split(',').filter(|s| !s.trim().is_empty()).count() as i32,
            Err(_) => 1,
        };
        // SAFETY: the launcher's table is static data.
        let kernels = unsafe {
            (0..dflash_hd_kernel_count())
                .map(|i| {
                    let name = CStr::from_ptr(dflash_hd_kernel_name(i))
                        .to_string_lossy()
                        .into_owned();
                    (
                        name,
                        (
                            i,
                            CStr::from_ptr(dflash_hd_kernel_sig(i))
                                .to_string_lossy()
                                .into_owned(),
                        ),
                    )
                })
                .collect()
        };
        Driver {
            arch: (arch / 10, arch % 10),
            devices,
            version: env_num("DFLASH_EMU_DRIVER_VERSION", 13090) as i32,
            total: env_num("DFLASH_EMU_MEMORY_MIB", 16384) as usize * (1 << 20),
            allocs: Mutex::new(BTreeMap::new()),
            used: Mutex::new(0),
            sticky: Mutex::new(None),
            host_clock: Mutex::new(Clock::default()),
            next_stream: Mutex::new(1),
            null_stream: OnceLock::new(),
            kernels,
        }
    })
}

impl Driver {
    /// The sticky error, if work on some stream has faulted.
    pub fn sticky(&self) -> CUresult {
        self.sticky
            .lock()
            .unwrap()
            .as_ref()
            .map_or(SUCCESS, |(c, _)| *c)
    }

    pub fn fault(&self, f: Fault) {
        eprintln!("emulated CUDA: {}", f.1);
        let mut s = self.sticky.lock().unwrap();
        if s.is_none() {
            *s = Some(f);
        }
    }

    pub fn host_clock(&self) -> Clock {
        self.host_clock.lock().unwrap().clone()
    }

    /// The host has waited for everything `c` covers.
    pub fn host_saw(&self, c: &Clock) {
        self.host_clock.lock().unwrap().merge(c);
    }

    pub fn new_stream(&self) -> Arc<Stream> {
        let mut n = self.next_stream.lock().unwrap();
        let id = *n;
        *n += 1;
        Stream::spawn(id)
    }

    fn null_stream(&self) -> &Arc<Stream> {
        self.null_stream.get_or_init(|| Stream::spawn(0))
    }

    /// Where `ptr` lies: the allocation's start, kind and length, if it is device or
    /// registered memory (one past the end counts, for empty ranges).
    pub fn find(&self, ptr: u64) -> Option<(u64, usize, MemKind)> {
        let a = self.allocs.lock().unwrap();
        let (start, al) = a.range(..=ptr).next_back()?;
        (ptr <= start + al.len as u64).then_some((*start, al.len, al.kind))
    }

    /// Check that `ptr` (used by `what` on `stream` with clock `clock`) is memory a GPU
    /// could touch there: device memory ordered before this use, or registered memory.
    pub fn check_device_ptr(
        &self,
        ptr: u64,
        stream: u32,
        clock: &Clock,
        what: &str,
    ) -> Result<(), Fault> {
        if ptr == 0 {
            return Ok(());
        }
        match self.find(ptr) {
            None => Err((ERROR_ILLEGAL_ADDRESS, format!("{what}: {ptr:#x} is neither device memory nor registered host memory (an illegal address on a GPU)"))),
            Some((start, _, MemKind::DeviceAsync { stream: s, seq })) if s != stream && clock.get(s) < seq => Err((
                ERROR_ILLEGAL_ADDRESS,
                format!("{what} on stream {stream} uses memory at {start:#x} that cuMemAllocAsync allocated on stream {s}, with no event or sync ordering the allocation before this use"),
            )),
            Some(_) => Ok(()),
        }
    }

    fn queue_on(&self, stream: u64) -> Result<Arc<Stream>, CUresult> {
        if stream == 0 {
            // The legacy default stream: behind everything queued anywhere.
            return Ok(self.null_stream().clone());
        }
        // SAFETY: a handle this library returned from cuStreamCreate.
        Ok(unsafe { Stream::from_handle(stream) })
    }
}

fn initialised() -> Result<&'static Driver, CUresult> {
    match *INIT.lock().unwrap() {
        Some(SUCCESS) => Ok(driver()),
        Some(e) => Err(e),
        None => Err(ERROR_NOT_INITIALIZED),
    }
}

fn with_ctx() -> Result<&'static Driver, CUresult> {
    let d = initialised()?;
    if CURRENT.with(|c| c.get()) == 0 {
        return Err(refuse(
            ERROR_INVALID_CONTEXT,
            "a call that needs a context on a thread with none current (cuCtxSetCurrent first)",
        ));
    }
    Ok(d)
}

/// The driver, if `dev` is one of its devices.
fn device_of(dev: c_int) -> Result<&'static Driver, CUresult> {
    let d = initialised()?;
    if dev < 0 || dev >= d.devices {
        return Err(ERROR_INVALID_DEVICE);
    }
    Ok(d)
}

macro_rules! tri {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(code) => return code,
        }
    };
}

// ---------------------------------------------------------------------------------------
// Initialisation, devices, contexts.

#[no_mangle]
pub extern "C" fn cuInit(_flags: c_uint) -> CUresult {
    let mut init = INIT.lock().unwrap();
    if let Some(r) = *init {
        return r;
    }
    let r = if driver().devices == 0 {
        ERROR_NO_DEVICE
    } else {
        SUCCESS
    };
    *init = Some(r);
    r
}

/// The driver's private tables: NVRTC 13.x opens `libcuda.so.1` (this library, under the
/// driver's soname) while compiling and asks for one; a driver may have none to give, and
/// NVRTC then goes on without it.
#[no_mangle]
pub unsafe extern "C" fn cuGetExportTable(
    table: *mut *const c_void,
    _id: *const c_void,
) -> CUresult {
    if !table.is_null() {
        *table = std::ptr::null();
    }
    ERROR_NOT_SUPPORTED
}

#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(v: *mut c_int) -> CUresult {
    *v = driver().version;
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(n: *mut c_int) -> CUresult {
    *n = tri!(initialised()).devices;
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(dev: *mut c_int, ordinal: c_int) -> CUresult {
    tri!(device_of(ordinal));
    *dev = ordinal;
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, _dev: c_int) -> CUresult {
    tri!(initialised());
    let s = "Emulated GPU (host device)".to_string();
    let n = (s.len()).min(len.max(1) as usize - 1);
    std::ptr::copy_nonoverlapping(s.as_ptr(), name.cast(), n);
    *name.add(n) = 0;
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid(uuid: *mut u8, _dev: c_int) -> CUresult {
    for i in 0..16 {
        *uuid.add(i) = 0xE0 | i as u8;
    }
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid: *mut u8, dev: c_int) -> CUresult {
    cuDeviceGetUuid(uuid, dev)
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, _dev: c_int) -> CUresult {
    *bytes = tri!(initialised()).total;
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetAttribute(v: *mut c_int, attr: c_int, _dev: c_int) -> CUresult {
    let d = tri!(initialised());
    *v = match attr {
        75 => d.arch.0,  // COMPUTE_CAPABILITY_MAJOR
        76 => d.arch.1,  // COMPUTE_CAPABILITY_MINOR
        16 => 132,       // MULTIPROCESSOR_COUNT (an H100/H200)
        1 => 1024,       // MAX_THREADS_PER_BLOCK
        8 => 48 * 1024,  // MAX_SHARED_MEMORY_PER_BLOCK
        10 => 32,        // WARP_SIZE
        13 => 1_980_000, // CLOCK_RATE (kHz)
        115 => 1,        // MEMORY_POOLS_SUPPORTED
        _ => 0,
    };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut u64, dev: c_int) -> CUresult {
    tri!(device_of(dev));
    *ctx = PRIMARY_CTX;
    SUCCESS
}

/// `CU_CTX_SCHED_MASK` and `CU_CTX_SCHED_BLOCKING_SYNC`.
const SCHED_MASK: c_uint = 0x07;
const SCHED_BLOCKING_SYNC: c_uint = 0x04;

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxSetFlags_v2(dev: c_int, flags: c_uint) -> CUresult {
    tri!(device_of(dev));
    if flags & !0x1f != 0 {
        return ERROR_INVALID_VALUE;
    }
    stream::BLOCKING_CONTEXT.store(
        flags & SCHED_MASK == SCHED_BLOCKING_SYNC,
        std::sync::atomic::Ordering::SeqCst,
    );
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxGetState(
    dev: c_int,
    flags: *mut c_uint,
    active: *mut c_int,
) -> CUresult {
    tri!(device_of(dev));
    *flags = if stream::BLOCKING_CONTEXT.load(std::sync::atomic::Ordering::SeqCst) {
        SCHED_BLOCKING_SYNC
    } else {
        0
    };
    *active = 1;
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(_dev: c_int) -> CUresult {
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxRelease(_dev: c_int) -> CUresult {
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuCtxSetCurrent(ctx: u64) -> CUresult {
    if ctx != 0 && ctx != PRIMARY_CTX {
        return ERROR_INVALID_CONTEXT;
    }
    CURRENT.with(|c| c.set(ctx));
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(ctx: *mut u64) -> CUresult {
    *ctx = CURRENT.with(|c| c.get());
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetDevice(dev: *mut c_int) -> CUresult {
    tri!(with_ctx());
    *dev = 0;
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuCtxSynchronize() -> CUresult {
    let d = tri!(with_ctx());
    for s in stream::all_streams() {
        let c = s.drain();
        d.host_saw(&c);
    }
    d.sticky()
}

#[no_mangle]
pub extern "C" fn cuCtxSetFlags(_flags: c_uint) -> CUresult {
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorName(code: CUresult, out: *mut *const c_char) -> CUresult {
    *out = error_name(code).as_ptr();
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorString(code: CUresult, out: *mut *const c_char) -> CUresult {
    *out = error_name(code).as_ptr();
    SUCCESS
}

fn error_name(code: CUresult) -> &'static CStr {
    match code {
        SUCCESS => c"CUDA_SUCCESS",
        ERROR_INVALID_VALUE => c"CUDA_ERROR_INVALID_VALUE",
        ERROR_OUT_OF_MEMORY => c"CUDA_ERROR_OUT_OF_MEMORY",
        ERROR_NOT_INITIALIZED => c"CUDA_ERROR_NOT_INITIALIZED",
        ERROR_NO_DEVICE => c"CUDA_ERROR_NO_DEVICE",
        ERROR_INVALID_DEVICE => c"CUDA_ERROR_INVALID_DEVICE",
        ERROR_INVALID_IMAGE => c"CUDA_ERROR_INVALID_IMAGE",
        ERROR_INVALID_CONTEXT => c"CUDA_ERROR_INVALID_CONTEXT",
        ERROR_NO_BINARY_FOR_GPU => c"CUDA_ERROR_NO_BINARY_FOR_GPU",
        ERROR_INVALID_PTX => c"CUDA_ERROR_INVALID_PTX",
        ERROR_UNSUPPORTED_PTX_VERSION => c"CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
        ERROR_INVALID_HANDLE => c"CUDA_ERROR_INVALID_HANDLE",
        ERROR_NOT_FOUND => c"CUDA_ERROR_NOT_FOUND",
        ERROR_NOT_READY => c"CUDA_ERROR_NOT_READY",
        ERROR_ILLEGAL_ADDRESS => c"CUDA_ERROR_ILLEGAL_ADDRESS",
        ERROR_HOST_MEMORY_ALREADY_REGISTERED => c"CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
        ERROR_HOST_MEMORY_NOT_REGISTERED => c"CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
        ERROR_NOT_SUPPORTED => c"CUDA_ERROR_NOT_SUPPORTED",
        _ => c"CUDA_ERROR_UNKNOWN",
    }
}

// ---------------------------------------------------------------------------------------
// Memory.

const POISON: u8 = 0xFF; // every f32 and bf16 made of it is a NaN

fn allocate(bytes: usize, kind: MemKind) -> Result<u64, CUresult> {
    let d = driver();
    let size = bytes.max(1).div_ceil(256) * 256;
    {
        let mut used = d.used.lock().unwrap();
        if *used + size > d.total {
            return Err(refuse(
                ERROR_OUT_OF_MEMORY,
                format!("{bytes} bytes asked, {} of {} in use", *used, d.total),
            ));
        }
        *used += size;
    }
    let layout = std::alloc::Layout::from_size_align(size, 256).map_err(|_| ERROR_INVALID_VALUE)?;
    // SAFETY: non-zero size.
    let p = unsafe { std::alloc::alloc(layout) };
    if p.is_null() {
        *d.used.lock().unwrap() -= size;
        return Err(ERROR_OUT_OF_MEMORY);
    }
    // SAFETY: just allocated, `size` bytes.
    unsafe { std::ptr::write_bytes(p, POISON, size) };
    d.allocs
        .lock()
        .unwrap()
        .insert(p as u64, Alloc { len: size, kind });
    Ok(p as u64)
}

fn release(ptr: u64) -> CUresult {
    let d = driver();
    let Some(a) = d.allocs.lock().unwrap().remove(&ptr) else {
        return refuse(
            ERROR_INVALID_VALUE,
            format!("cuMemFree of {ptr:#x}, which is not the start of an allocation"),
        );
    };
    if a.kind == MemKind::Registered {
        d.allocs.lock().unwrap().insert(ptr, a);
        return refuse(ERROR_INVALID_VALUE, "cuMemFree of registered host memory");
    }
    *d.used.lock().unwrap() -= a.len;
    // SAFETY: allocated in `allocate` with this layout.
    unsafe {
        std::alloc::dealloc(
            ptr as *mut u8,
            std::alloc::Layout::from_size_align_unchecked(a.len, 256),
        )
    };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut u64, bytes: usize) -> CUresult {
    tri!(with_ctx());
    *dptr = tri!(allocate(bytes, MemKind::Device));
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync(dptr: *mut u64, bytes: usize, stream: u64) -> CUresult {
    let d = tri!(initialised());
    let s = tri!(d.queue_on(stream));
    // The allocation is usable on `stream` from here, elsewhere once ordered after this.
    let seq = s.tick(d);
    *dptr = tri!(allocate(
        bytes,
        MemKind::DeviceAsync {
            stream: s.id,
            seq: seq.get(s.id)
        }
    ));
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuMemFree_v2(dptr: u64) -> CUresult {
    tri!(initialised());
    release(dptr)
}

#[no_mangle]
pub unsafe extern "C" fn cuMemFreeAsync(dptr: u64, stream: u64) -> CUresult {
    let d = tri!(initialised());
    let s = tri!(d.queue_on(stream));
    s.submit(
        d,
        Box::new(move || {
            if release(dptr) == SUCCESS {
                Ok(())
            } else {
                Err((ERROR_INVALID_VALUE, format!("cuMemFreeAsync of {dptr:#x}")))
            }
        }),
    );
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    let d = tri!(with_ctx());
    let used = *d.used.lock().unwrap();
    *free = d.total.saturating_sub(used);
    *total = d.total;
    SUCCESS
}

/// The first part of `[lo, lo + len)` this process maps without write permission.
fn read_only_range(lo: u64, len: u64) -> Option<String> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    let hi = lo + len;
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (range, perms) = (f.next()?, f.next()?);
        let (a, b) = range.split_once('-')?;
        let (a, b) = (
            u64::from_str_radix(a, 16).ok()?,
            u64::from_str_radix(b, 16).ok()?,
        );
        if a < hi && b > lo && !perms.contains('w') {
            return Some(format!("{:#x}..{:#x} ({perms})", a.max(lo), b.min(hi)));
        }
    }
    None
}

#[no_mangle]
pub extern "C" fn cuMemHostRegister_v2(p: *mut c_void, bytes: usize, flags: c_uint) -> CUresult {
    let d = tri!(with_ctx());
    const READ_ONLY: c_uint = 0x08;
    if bytes == 0 || p.is_null() {
        return refuse(ERROR_INVALID_VALUE, "cuMemHostRegister of an empty range");
    }
    if flags & READ_ONLY == 0 {
        if let Some(bad) = read_only_range(p as u64, bytes as u64) {
            return refuse(ERROR_INVALID_VALUE, format!("cuMemHostRegister: {bad} is mapped read-only and CU_MEMHOSTREGISTER_READ_ONLY was not given"));
        }
    }
    let (lo, hi) = (p as u64, p as u64 + bytes as u64);
    let mut a = d.allocs.lock().unwrap();
    if a.range(..hi)
        .next_back()
        .is_some_and(|(s, al)| s + al.len as u64 > lo)
    {
        return refuse(ERROR_HOST_MEMORY_ALREADY_REGISTERED, format!("cuMemHostRegister: {lo:#x}..{hi:#x} overlaps memory already registered or allocated"));
    }
    a.insert(
        lo,
        Alloc {
            len: bytes,
            kind: MemKind::Registered,
        },
    );
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuMemHostUnregister(p: *mut c_void) -> CUresult {
    let d = tri!(initialised());
    let mut a = d.allocs.lock().unwrap();
    match a.get(&(p as u64)) {
        Some(al) if al.kind == MemKind::Registered => {
            a.remove(&(p as u64));
            SUCCESS
        }
        _ => refuse(
            ERROR_HOST_MEMORY_NOT_REGISTERED,
            format!("cuMemHostUnregister of {p:p}, which is not registered"),
        ),
    }
}

/// A copy's ends, checked when it is queued: device memory (ordered before the copy on
/// `stream`) or registered host memory read/written when the stream gets there; other host
/// memory is staged at the call.
/// Which ends of a copy are host memory.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Dir {
    HtoD,
    DtoH,
    DtoD,
}

fn copy_job(
    d: &'static Driver,
    s: &Arc<Stream>,
    dst: u64,
    src: u64,
    n: usize,
    what: &'static str,
    dir: Dir,
) -> Result<(), CUresult> {
    let (host_src, host_dst) = (dir == Dir::HtoD, dir == Dir::DtoH);
    let clock = s.clock();
    let device_end = |p: u64| {
        d.check_device_ptr(p, s.id, &clock, what)
            .and_then(|_| match d.find(p) {
                Some((start, len, _)) if p + n as u64 <= start + len as u64 => Ok(()),
                _ => Err((
                    ERROR_INVALID_VALUE,
                    format!("{what}: {n} bytes at {p:#x} run past the end of the allocation"),
                )),
            })
    };
    for (p, host) in [(dst, host_dst), (src, host_src)] {
        if !host {
            if let Err(f) = device_end(p) {
                return Err(refuse(f.0, f.1));
            }
        }
    }
    let pinned = |p: u64| matches!(d.find(p), Some((start, len, MemKind::Registered)) if p + n as u64 <= start + len as u64);
    if host_src && !pinned(src) {
        // Pageable source: the driver stages it before the call returns.
        // SAFETY: the caller's n readable bytes.
        let staged = unsafe { std::slice::from_raw_parts(src as *const u8, n) }.to_vec();
        s.submit(
            d,
            Box::new(move || {
                // SAFETY: device memory checked above.
                unsafe { std::ptr::copy_nonoverlapping(staged.as_ptr(), dst as *mut u8, n) };
                Ok(())
            }),
        );
        return Ok(());
    }
    s.submit(
        d,
        Box::new(move || {
            // SAFETY: both ends checked above (pinned host memory stays registered while in use).
            unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, n) };
            Ok(())
        }),
    );
    if host_dst && !pinned(dst) {
        // Into pageable memory the call returns once the bytes are there.
        let c = s.drain();
        d.host_saw(&c);
    }
    Ok(())
}

#[no_mangle]
pub extern "C" fn cuMemcpyHtoDAsync_v2(
    dst: u64,
    src: *const c_void,
    n: usize,
    stream: u64,
) -> CUresult {
    let d = tri!(initialised());
    let s = tri!(d.queue_on(stream));
    tri!(copy_job(
        d,
        &s,
        dst,
        src as u64,
        n,
        "cuMemcpyHtoDAsync",
        Dir::HtoD
    ));
    d.sticky()
}

#[no_mangle]
pub extern "C" fn cuMemcpyDtoHAsync_v2(
    dst: *mut c_void,
    src: u64,
    n: usize,
    stream: u64,
) -> CUresult {
    let d = tri!(initialised());
    let s = tri!(d.queue_on(stream));
    tri!(copy_job(
        d,
        &s,
        dst as u64,
        src,
        n,
        "cuMemcpyDtoHAsync",
        Dir::DtoH
    ));
    d.sticky()
}

#[no_mangle]
pub extern "C" fn cuMemcpyDtoDAsync_v2(dst: u64, src: u64, n: usize, stream: u64) -> CUresult {
    let d = tri!(initialised());
    let s = tri!(d.queue_on(stream));
    tri!(copy_job(d, &s, dst, src, n, "cuMemcpyDtoDAsync", Dir::DtoD));
    d.sticky()
}

#[no_mangle]
pub extern "C" fn cuMemcpyHtoD_v2(dst: u64, src: *const c_void, n: usize) -> CUresult {
    let r = cuMemcpyHtoDAsync_v2(dst, src, n, 0);
    if r != SUCCESS {
        return r;
    }
    stream_sync(0)
}

#[no_mangle]
pub extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: u64, n: usize) -> CUresult {
    let r = cuMemcpyDtoHAsync_v2(dst, src, n, 0);
    if r != SUCCESS {
        return r;
    }
    stream_sync(0)
}

fn memset_job(
    dst: u64,
    value: u32,
    width: usize,
    count: usize,
    stream: u64,
    what: &'static str,
) -> CUresult {
    let d = tri!(initialised());
    let s = tri!(d.queue_on(stream));
    let clock = s.clock();
    let bytes = count * width;
    if let Err(f) = d
        .check_device_ptr(dst, s.id, &clock, what)
        .and_then(|_| match d.find(dst) {
            Some((start, len, _)) if dst + bytes as u64 <= start + len as u64 => Ok(()),
            _ => Err((
                ERROR_INVALID_VALUE,
                format!("{what}: {bytes} bytes at {dst:#x} run past the end of the allocation"),
            )),
        })
    {
        return refuse(f.0, f.1);
    }
    s.submit(
        d,
        Box::new(move || {
            // SAFETY: checked above.
            unsafe {
                match width {
                    1 => std::ptr::write_bytes(dst as *mut u8, value as u8, count),
                    2 => std::slice::from_raw_parts_mut(dst as *mut u16, count).fill(value as u16),
                    _ => std::slice::from_raw_parts_mut(dst as *mut u32, count).fill(value),
                }
            }
            Ok(())
        }),
    );
    d.sticky()
}

#[no_mangle]
pub extern "C" fn cuMemsetD8Async(dst: u64, value: u8, count: usize, stream: u64) -> CUresult {
    memset_job(dst, value as u32, 1, count, stream, "cuMemsetD8Async")
}

#[no_mangle]
pub extern "C" fn cuMemsetD16Async(dst: u64, value: u16, count: usize, stream: u64) -> CUresult {
    memset_job(dst, value as u32, 2, count, stream, "cuMemsetD16Async")
}

#[no_mangle]
pub extern "C" fn cuMemsetD32Async(dst: u64, value: u32, count: usize, stream: u64) -> CUresult {
    memset_job(dst, value, 4, count, stream, "cuMemsetD32Async")
}

#[no_mangle]
pub extern "C" fn cuMemsetD8_v2(dst: u64, value: u8, count: usize) -> CUresult {
    memset_job(dst, value as u32, 1, count, 0, "cuMemsetD8")
}

#[no_mangle]
pub extern "C" fn cuMemsetD32_v2(dst: u64, value: u32, count: usize) -> CUresult {
    memset_job(dst, value, 4, count, 0, "cuMemsetD32")
}

// ---------------------------------------------------------------------------------------
// Streams and events.

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(out: *mut u64, _flags: c_uint) -> CUresult {
    let d = tri!(with_ctx());
    *out = d.new_stream().into_handle();
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreateWithPriority(
    out: *mut u64,
    flags: c_uint,
    _priority: c_int,
) -> CUresult {
    cuStreamCreate(out, flags)
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamDestroy_v2(s: u64) -> CUresult {
    tri!(initialised());
    if s == 0 {
        return ERROR_INVALID_HANDLE;
    }
    // Work already queued still runs (as cuStreamDestroy promises).
    Stream::release_handle(s);
    SUCCESS
}

fn stream_sync(stream: u64) -> CUresult {
    let d = tri!(initialised());
    let s = tri!(d.queue_on(stream));
    let c = s.drain();
    d.host_saw(&c);
    d.sticky()
}

#[no_mangle]
pub extern "C" fn cuStreamSynchronize(stream: u64) -> CUresult {
    stream_sync(stream)
}

#[no_mangle]
pub extern "C" fn cuStreamQuery(stream: u64) -> CUresult {
    let d = tri!(initialised());
    let s = tri!(d.queue_on(stream));
    match d.sticky() {
        SUCCESS if s.idle() => SUCCESS,
        SUCCESS => ERROR_NOT_READY,
        e => e,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(out: *mut u64, flags: c_uint) -> CUresult {
    tri!(initialised());
    // CU_EVENT_BLOCKING_SYNC = 1.
    *out = EventObj::create(flags & 1 != 0);
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuEventDestroy_v2(e: u64) -> CUresult {
    tri!(initialised());
    if e == 0 {
        return ERROR_INVALID_HANDLE;
    }
    EventObj::destroy(e);
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuEventRecord(e: u64, stream: u64) -> CUresult {
    let d = tri!(initialised());
    let s = tri!(d.queue_on(stream));
    let ev = EventObj::get(e);
    let clock = s.tick(d);
    let target = ev.begin_record(clock, s.id);
    let done = ev.clone();
    s.submit_ordered(Box::new(move || {
        done.complete(target);
        Ok(())
    }));
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuEventRecordWithFlags(e: u64, stream: u64, _flags: c_uint) -> CUresult {
    cuEventRecord(e, stream)
}

#[no_mangle]
pub unsafe extern "C" fn cuEventQuery(e: u64) -> CUresult {
    let d = tri!(initialised());
    let ev = EventObj::get(e);
    match d.sticky() {
        SUCCESS if ev.is_done() => {
            d.host_saw(&ev.clock());
            SUCCESS
        }
        SUCCESS => ERROR_NOT_READY,
        err => err,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuEventSynchronize(e: u64) -> CUresult {
    let d = tri!(initialised());
    let ev = EventObj::get(e);
    ev.wait_done();
    d.host_saw(&ev.clock());
    let (stream, tick) = ev.origin();
    stream::note_wait(stream, tick);
    d.sticky()
}

/// How many host waits so far left the stream they waited for with nothing queued behind
/// them (a synchronous copy to pageable memory, a stream or context sync, an event sync
/// with no later work on its stream): each one a bubble on a GPU, where the stream runs
/// dry while the host catches up. Tests read it (by `dlsym`) around a training step.
#[no_mangle]
pub extern "C" fn dflash_emu_dry_waits() -> u64 {
    stream::DRY_WAITS.load(std::sync::atomic::Ordering::SeqCst)
}

#[no_mangle]
pub unsafe extern "C" fn cuEventElapsedTime(ms: *mut f32, start: u64, end: u64) -> CUresult {
    tri!(initialised());
    match (EventObj::get(start).time(), EventObj::get(end).time()) {
        (Some(a), Some(b)) => {
            *ms = b.saturating_duration_since(a).as_secs_f32() * 1e3;
            SUCCESS
        }
        _ => ERROR_NOT_READY,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuEventElapsedTime_v2(ms: *mut f32, start: u64, end: u64) -> CUresult {
    cuEventElapsedTime(ms, start, end)
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamWaitEvent(stream: u64, e: u64, _flags: c_uint) -> CUresult {
    let d = tri!(initialised());
    let s = tri!(d.queue_on(stream));
    let ev = EventObj::get(e);
    let (target, clock) = ev.snapshot();
    s.merge_clock(&clock);
    s.submit_ordered(Box::new(move || {
        ev.wait_for(target);
        Ok(())
    }));
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuLaunchHostFunc(
    stream: u64,
    f: Option<unsafe extern "C" fn(*mut c_void)>,
    data: *mut c_void,
) -> CUresult {
    let d = tri!(initialised());
    let s = tri!(d.queue_on(stream));
    let Some(f) = f else {
        return ERROR_INVALID_VALUE;
    };
    let data = data as usize;
    s.submit(
        d,
        Box::new(move || {
            f(data as *mut c_void);
            Ok(())
        }),
    );
    SUCCESS
}

// ---------------------------------------------------------------------------------------
// Modules and launches.

pub struct Module {
    functions: HashMap<String, Box<Function>>,
}

pub struct Function {
    name: String,
    index: c_int,
    sig: String,
    /// The dynamic shared memory a launch may give it (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES).
    max_dynamic_shared: std::cell::Cell<c_int>,
}

/// Dynamic shared memory a kernel may have without opting in, as on every GPU since sm_70.
const DEFAULT_DYNAMIC_SHARED: c_int = 48 * 1024;

/// The most shared memory a block may opt into on compute capability `arch`.
fn max_block_shared(arch: (i32, i32)) -> c_int {
    match arch {
        (8, 0) | (8, 7) => 163 * 1024,
        (8, _) => 99 * 1024,
        _ => 227 * 1024,
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadData(out: *mut u64, data: *const c_void) -> CUresult {
    let d = tri!(with_ctx());
    let entries = match image::entries(data.cast(), d) {
        Ok(e) => e,
        Err((code, msg)) => return refuse(code, msg),
    };
    let mut functions = HashMap::new();
    for name in entries {
        let Some((index, sig)) = d.kernels.get(&name) else {
            return refuse(ERROR_INVALID_IMAGE, format!("the image has a kernel {name} that the host device was not built with (kernels.cu differs from the worker's build)"));
        };
        functions.insert(
            name.clone(),
            Box::new(Function {
                name,
                index: *index,
                sig: sig.clone(),
                max_dynamic_shared: std::cell::Cell::new(DEFAULT_DYNAMIC_SHARED),
            }),
        );
    }
    *out = Box::into_raw(Box::new(Module { functions })) as u64;
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadDataEx(
    out: *mut u64,
    data: *const c_void,
    _n: c_uint,
    _opts: *mut c_int,
    _vals: *mut *mut c_void,
) -> CUresult {
    cuModuleLoadData(out, data)
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleUnload(m: u64) -> CUresult {
    if m == 0 {
        return ERROR_INVALID_HANDLE;
    }
    // Functions may still be queued on a stream: keep the module (a few bytes per load).
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleGetFunction(
    out: *mut u64,
    m: u64,
    name: *const c_char,
) -> CUresult {
    tri!(initialised());
    if m == 0 {
        return ERROR_INVALID_HANDLE;
    }
    let module = &*(m as *const Module);
    let name = CStr::from_ptr(name).to_string_lossy();
    match module.functions.get(name.as_ref()) {
        Some(f) => {
            *out = &**f as *const Function as u64;
            SUCCESS
        }
        None => refuse(
            ERROR_NOT_FOUND,
            format!("cuModuleGetFunction: no kernel {name} in the module"),
        ),
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuFuncGetAttribute(v: *mut c_int, attr: c_int, _f: u64) -> CUresult {
    *v = match attr {
        0 => 1024, // MAX_THREADS_PER_BLOCK
        _ => 0,
    };
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuFuncSetAttribute(f: u64, attr: c_int, v: c_int) -> CUresult {
    let d = tri!(initialised());
    if f == 0 {
        return ERROR_INVALID_HANDLE;
    }
    let func = &*(f as *const Function);
    // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: up to what a block may have.
    if attr == 8 {
        let most = max_block_shared(d.arch);
        if !(0..=most).contains(&v) {
            return refuse(
                ERROR_INVALID_VALUE,
                format!("cuFuncSetAttribute: {v} bytes of dynamic shared memory for {} (at most {most} on sm_{}{})", func.name, d.arch.0, d.arch.1),
            );
        }
        func.max_dynamic_shared.set(v);
    }
    SUCCESS
}

#[allow(clippy::too_many_arguments)]
#[no_mangle]
pub unsafe extern "C" fn cuLaunchKernel(
    f: u64,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    stream: u64,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    let d = tri!(initialised());
    if f == 0 {
        return ERROR_INVALID_HANDLE;
    }
    let func = &*(f as *const Function);
    if gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0 {
        return refuse(
            ERROR_INVALID_VALUE,
            format!("launching {}: a zero grid or block dimension", func.name),
        );
    }
    if bx as u64 * by as u64 * bz as u64 > 1024 {
        return refuse(
            ERROR_INVALID_VALUE,
            format!(
                "launching {}: {} threads per block (at most 1024)",
                func.name,
                bx * by * bz
            ),
        );
    }
    if shared as c_int > func.max_dynamic_shared.get() || shared > c_int::MAX as c_uint {
        return refuse(ERROR_INVALID_VALUE, format!("launching {}: {shared} bytes of dynamic shared memory, more than the {} it may have (cuFuncSetAttribute MAX_DYNAMIC_SHARED_SIZE_BYTES raises it)", func.name, func.max_dynamic_shared.get()));
    }
    if !extra.is_null() || (params.is_null() && !func.sig.is_empty()) {
        return refuse(
            ERROR_INVALID_VALUE,
            format!(
                "launching {}: parameters must come as kernelParams",
                func.name
            ),
        );
    }
    let s = tri!(d.queue_on(stream));
    let clock = s.clock();
    // Copy each parameter by its size now, as cuLaunchKernel does.
    let mut cells = Vec::with_capacity(func.sig.len());
    for (i, kind) in func.sig.chars().enumerate() {
        let p = *params.add(i);
        if p.is_null() {
            return refuse(
                ERROR_INVALID_VALUE,
                format!("launching {}: kernelParams[{i}] is null", func.name),
            );
        }
        let v: u64 = match kind {
            'i' | 'f' => (p as *const u32).read_unaligned() as u64,
            _ => (p as *const u64).read_unaligned(),
        };
        if kind == 'p' {
            if let Err(fault) = d.check_device_ptr(
                v,
                s.id,
                &clock,
                &format!("kernel {} parameter {i}", func.name),
            ) {
                // A GPU faults when the kernel dereferences it: asynchronously, sticky.
                s.submit(d, Box::new(move || Err(fault)));
                return SUCCESS;
            }
        }
        cells.push(v);
    }
    let (index, name) = (func.index, func.name.clone());
    let (grid, block) = ([gx, gy, gz], [bx, by, bz]);
    s.submit(
        d,
        Box::new(move || {
            let mut cells = cells;
            let mut ptrs: Vec<*mut c_void> =
                cells.iter_mut().map(|c| (c as *mut u64).cast()).collect();
            let mut err = [0 as c_char; 256];
            // SAFETY: the parameters were copied by the kernel's own signature.
            let rc = unsafe {
                dflash_hd_launch(
                    index,
                    grid.as_ptr(),
                    block.as_ptr(),
                    ptrs.as_mut_ptr(),
                    err.as_mut_ptr(),
                    err.len(),
                )
            };
            if rc != 0 {
                // SAFETY: the launcher wrote a NUL-terminated message.
                let msg = unsafe { CStr::from_ptr(err.as_ptr()) }
                    .to_string_lossy()
                    .into_owned();
                return Err((stream::LAUNCH_FAILED, format!("kernel {name}: {msg}")));
            }
            Ok(())
        }),
    );
    d.sticky()
}

/// Work for a stream's thread (re-exported for the libraries built on the driver).
pub fn submit(stream: u64, job: Job) -> Result<(u32, Clock), CUresult> {
    let d = initialised()?;
    let s = d.queue_on(stream)?;
    let c = s.submit(d, job);
    Ok((s.id, c))
}

/// The clock a stream's next operation will be ordered after.
pub fn stream_clock(stream: u64) -> Result<(u32, Clock), CUresult> {
    let d = initialised()?;
    let s = d.queue_on(stream)?;
    Ok((s.id, s.clock()))
}
