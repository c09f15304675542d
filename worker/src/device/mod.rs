//! The GPU compute path, below the models: a device layer (memory, copies, two streams and
//! events, kernel launches, GEMM) with three implementations, and the typed ops on top of it.
//!
//! - [`cuda::CudaDevice`]: a real GPU through cudarc (driver, NVRTC, cuBLAS), every library
//!   loaded at run time, so the worker builds and runs where there is no CUDA at all.
//! - [`host::HostDevice`]: the same kernels (`cuda/kernels.cu`, compiled as C++) run on the
//!   CPU, every block's threads at once; streams are ordered queues with a race detector;
//!   GEMMs honour cuBLAS's column-major contract. It exists so that CI, which has no GPU,
//!   runs every kernel and all of this host code for real, in-process (the parity tests).
//!   A worker's GPU is always [`cuda::CudaDevice`]: the tests give workers the emulated CUDA
//!   stack (tests/emu-cuda) instead, so there is one GPU code path in the worker.
//!
//! - [`cpu::CpuDevice`]: the CPU itself, with a Rust counterpart of every kernel: what CPU
//!   drafter workers train with, so that one drafter model serves every backend.
//!
//! [`ops::Ops`] wraps a device with one typed method per kernel; [`DeviceTarget`](crate::models::target::device::DeviceTarget) is
//! the target forward on it, [`DeviceDrafter`](crate::models::drafter::device::DeviceDrafter) the drafter's step and optimizer. Device memory comes from one [`Arena`] per worker, allocated
//! once and sub-allocated, with its own counters.

pub use ops::kernel::Kernel;

pub mod compute_threads;
pub mod cpu;
pub mod cuda;
pub mod grads;
pub mod host;
pub mod libs;
pub mod nvrtc;
pub mod ops;
pub mod race;

use std::fmt;

/// A device address (a `CUdeviceptr` on a GPU, a host address on the host device).
pub type DevPtr = u64;

/// A range of device memory, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DSlice {
    pub ptr: DevPtr,
    pub bytes: usize,
}

impl DSlice {
    /// Elements `range` of this buffer, read as `elem`-byte values.
    pub fn sub(&self, elem: usize, range: std::ops::Range<usize>) -> DSlice {
        assert!(
            range.start <= range.end && range.end * elem <= self.bytes,
            "sub-slice {range:?} of {} bytes",
            self.bytes
        );
        DSlice {
            ptr: self.ptr + (range.start * elem) as u64,
            bytes: (range.end - range.start) * elem,
        }
    }

    /// f32 elements `range`.
    pub fn f32s(&self, range: std::ops::Range<usize>) -> DSlice {
        self.sub(4, range)
    }

    pub fn len_f32(&self) -> usize {
        self.bytes / 4
    }
}

/// One kernel argument. Buffers say whether the kernel reads or writes them, which the
/// host device's race detector checks against stream order (a GPU ignores it).
#[derive(Debug, Clone, Copy)]
pub enum Arg {
    R(DSlice),
    W(DSlice),
    RW(DSlice),
    /// A null pointer (an optional output the kernel skips).
    Null,
    I32(i32),
    I64(i64),
    U32(u32),
    F32(f32),
}

/// The two streams of a worker: compute, and host↔device copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stream {
    Compute,
    Copy,
}

impl Stream {
    pub fn index(self) -> usize {
        match self {
            Stream::Compute => 0,
            Stream::Copy => 1,
        }
    }
}

/// A recorded event (an index into the device's event table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event(pub usize);

/// A GEMM in cuBLAS's column-major convention: `C = alpha·op(A)·op(B) + beta·C`, `op(A)`
/// m×k, `op(B)` k×n, `C` m×n; element (i, j) of a matrix X lives at `X[i + j·ldx]`.
#[derive(Debug, Clone, Copy)]
pub struct Gemm {
    pub transa: bool,
    pub transb: bool,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub alpha: f32,
    pub a: DSlice,
    pub lda: usize,
    pub b: DSlice,
    pub ldb: usize,
    pub beta: f32,
    pub c: DSlice,
    pub ldc: usize,
    /// A and B hold bf16 (accumulation f32: tensor cores on a GPU).
    pub bf16_inputs: bool,
    /// C holds bf16 (read for `beta` and written, rounded to nearest even, from the f32
    /// result); only with bf16 inputs.
    pub bf16_output: bool,
}

impl Gemm {
    /// Elements each operand must hold: (A, B, C).
    pub fn extents(&self) -> (usize, usize, usize) {
        let ext = |rows: usize, cols: usize, ld: usize| {
            if rows == 0 || cols == 0 {
                0
            } else {
                (rows - 1) + (cols - 1) * ld + 1
            }
        };
        let (ar, ac) = if self.transa {
            (self.k, self.m)
        } else {
            (self.m, self.k)
        };
        let (br, bc) = if self.transb {
            (self.n, self.k)
        } else {
            (self.k, self.n)
        };
        (
            ext(ar, ac, self.lda),
            ext(br, bc, self.ldb),
            ext(self.m, self.n, self.ldc),
        )
    }

    /// Bytes per element of A and B.
    pub fn input_bytes(&self) -> usize {
        if self.bf16_inputs {
            2
        } else {
            4
        }
    }

    /// Check shapes and leading dimensions against the buffers, as cuBLAS would reject them
    /// (and more: a GPU does not check that a buffer is long enough).
    pub fn validate(&self) -> Result<()> {
        let (ar, br) = (
            if self.transa { self.k } else { self.m },
            if self.transb { self.n } else { self.k },
        );
        if self.lda < ar.max(1) || self.ldb < br.max(1) || self.ldc < self.m.max(1) {
            return Err(GpuError::Invalid(format!(
                "gemm: leading dimension below the row count ({self:?})"
            )));
        }
        if self.bf16_output && !self.bf16_inputs {
            return Err(GpuError::Invalid(format!(
                "gemm: a bf16 output needs bf16 inputs ({self:?})"
            )));
        }
        let (ea, eb, ec) = self.extents();
        let e = self.input_bytes();
        if ea * e > self.a.bytes || eb * e > self.b.bytes || ec * self.output_bytes() > self.c.bytes
        {
            return Err(GpuError::Invalid(format!("gemm: an operand is shorter than its shape (needs {ea}, {eb}, {ec} elements) ({self:?})")));
        }
        Ok(())
    }

    /// Bytes per element of C.
    pub fn output_bytes(&self) -> usize {
        if self.bf16_output {
            2
        } else {
            4
        }
    }

    /// Run a host f32 GEMM routine on this GEMM: directly, or with bf16 A and B widened
    /// first (exact, so the product is the f32 GEMM of the widened operands).
    ///
    /// # Safety
    /// The operands cover their extents (`validate`).
    pub unsafe fn with_f32_inputs(&self, run: impl FnOnce(&Gemm)) {
        if !self.bf16_inputs {
            return run(self);
        }
        let (ea, eb, _) = self.extents();
        let widen = |s: DSlice, n: usize| -> Vec<f32> {
            std::slice::from_raw_parts(s.ptr as *const u16, n)
                .iter()
                .map(|&b| f32::from_bits((b as u32) << 16))
                .collect()
        };
        let (a, b) = (widen(self.a, ea), widen(self.b, eb));
        run(&Gemm {
            a: DSlice {
                ptr: a.as_ptr() as u64,
                bytes: ea * 4,
            },
            b: DSlice {
                ptr: b.as_ptr() as u64,
                bytes: eb * 4,
            },
            bf16_inputs: false,
            ..*self
        });
    }

    /// Run a host GEMM routine that writes f32 C on this GEMM: directly, or for a bf16 C
    /// through an f32 copy of it, rounded back once at the end (as cuBLAS rounds its f32
    /// result).
    ///
    /// # Safety
    /// The operands cover their extents (`validate`).
    pub unsafe fn with_f32_output(&self, run: impl FnOnce(&Gemm)) {
        if !self.bf16_output {
            return run(self);
        }
        let (_, _, ec) = self.extents();
        let bits = std::slice::from_raw_parts_mut(self.c.ptr as *mut u16, ec);
        let mut c: Vec<f32> = bits
            .iter()
            .map(|&b| f32::from_bits((b as u32) << 16))
            .collect();
        run(&Gemm {
            c: DSlice {
                ptr: c.as_mut_ptr() as u64,
                bytes: ec * 4,
            },
            bf16_output: false,
            ..*self
        });
        for (o, x) in bits.iter_mut().zip(&c) {
            *o = half::bf16::from_f32(*x).to_bits();
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum GpuError {
    /// A CUDA library is missing or the GPU cannot be used: permanent, do not restart.
    Unavailable(String),
    /// A call into a CUDA library (driver, NVRTC, cuBLAS, NCCL) failed: which call, and
    /// the library's error.
    Failed { call: String, error: String },
    /// `what` asked for `requested` bytes of a memory that had `free` of `total` left
    /// (when known): a device's, a worker's arena, or the host's.
    OutOfMemory {
        what: String,
        requested: usize,
        free_of: Option<(usize, usize)>,
    },
    /// A wrong call: bad shape, unknown kernel, bad arguments.
    Invalid(String),
    /// The host device saw two streams touch the same memory without an event between.
    Race(String),
}

impl fmt::Display for GpuError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GpuError::Unavailable(s) => write!(f, "GPU unavailable: {s}"),
            GpuError::Failed { call, error } => write!(f, "{call}: {error}"),
            GpuError::OutOfMemory {
                what,
                requested,
                free_of,
            } => {
                write!(f, "out of memory: {what}: {} asked", bytes(*requested))?;
                match free_of {
                    Some((free, total)) => {
                        write!(f, ", {} of {} free", bytes(*free), bytes(*total))
                    }
                    None => Ok(()),
                }
            }
            GpuError::Invalid(s) => write!(f, "invalid device call: {s}"),
            GpuError::Race(s) => write!(f, "stream race: {s}"),
        }
    }
}

impl std::error::Error for GpuError {}

impl GpuError {
    /// `map_err(GpuError::failed("cuMemAlloc"))`: the library's error in its own words.
    pub fn failed<E: fmt::Debug>(call: impl Into<String>) -> impl FnOnce(E) -> GpuError {
        let call = call.into();
        move |e| GpuError::Failed {
            call,
            error: format!("{e:?}"),
        }
    }
}

/// A size for a person: bytes, MiB or GiB.
fn bytes(n: usize) -> String {
    const MIB: f64 = (1u64 << 20) as f64;
    match n as f64 {
        b if b >= 1024.0 * MIB => format!("{:.2} GiB", b / 1024.0 / MIB),
        b if b >= MIB => format!("{:.1} MiB", b / MIB),
        _ => format!("{n} bytes"),
    }
}

pub type Result<T> = std::result::Result<T, GpuError>;

/// What a worker's compute needs of a device.
pub trait Device: Send {
    /// e.g. "NVIDIA H200 (sm_90)" or "host device".
    fn describe(&self) -> String;
    /// Raw allocation (the arena takes one at start).
    fn alloc(&mut self, bytes: usize) -> Result<DevPtr>;
    /// Free and total device memory (`cuMemGetInfo`).
    fn mem_info(&self) -> Result<(usize, usize)>;
    /// Name a sub-range of an allocation (the host device tracks accesses per range).
    fn track(&mut self, _buf: DSlice, _name: &str) {}
    /// Host → device on `s`; `src` may be reused when this returns.
    fn upload(&mut self, s: Stream, dst: DSlice, src: &[u8]) -> Result<()>;
    /// Device → host, waiting for `s` up to this copy.
    fn download(&mut self, s: Stream, src: DSlice, dst: &mut [u8]) -> Result<()>;
    /// Device → registered (pinned) host memory, asynchronously on `s`: the bytes are
    /// there once an event recorded after it has completed.
    ///
    /// # Safety
    /// `dst` must point to `src.bytes` bytes registered with `register_host` that nobody
    /// touches until that event has completed.
    unsafe fn download_async(&mut self, s: Stream, src: DSlice, dst: *mut u8) -> Result<()>;
    /// Registered (pinned) host memory → device, asynchronously on `s` (from pageable
    /// memory a GPU's driver stages it first, still correct): the bytes are read by the
    /// time an event recorded after it has completed.
    ///
    /// # Safety
    /// `src` must point to `dst.bytes` readable bytes that nobody changes until that event
    /// has completed.
    unsafe fn upload_async(&mut self, s: Stream, dst: DSlice, src: *const u8) -> Result<()>;
    /// Pin host memory for async copies (`cuMemHostRegister`).
    ///
    /// # Safety
    /// The range must stay mapped while the device is alive.
    unsafe fn register_host(&mut self, ptr: *mut u8, bytes: usize) -> Result<()>;
    /// The host is about to read (`write` false) or write registered host memory: the
    /// host device checks that every device access to it is ordered before by a sync.
    fn host_access(&mut self, _ptr: *const u8, _bytes: usize, _write: bool) -> Result<()> {
        Ok(())
    }
    fn memset_zero(&mut self, s: Stream, dst: DSlice) -> Result<()>;
    /// Launch `kernel` with `grid` blocks of `block` threads (x only).
    fn launch(&mut self, s: Stream, kernel: &Kernel, grid: u32, block: u32) -> Result<()>;
    fn gemm(&mut self, s: Stream, g: &Gemm) -> Result<()>;
    /// Record an event on `s` behind everything queued on it so far.
    fn record(&mut self, s: Stream) -> Result<Event>;
    /// Make `s` wait for `e`.
    fn wait(&mut self, s: Stream, e: Event) -> Result<()>;
    /// Block the host until `e` has completed.
    fn sync_event(&mut self, e: Event) -> Result<()>;
    /// Block the host until both streams are idle.
    fn sync(&mut self) -> Result<()>;
    /// The CPU device: host memory, f32 GEMMs (a GPU's models keep bf16 weights for its
    /// tensor cores; the CPU's keep f32, as the reference models do), and no device memory
    /// worth reporting.
    fn is_cpu(&self) -> bool {
        false
    }
    /// Seconds spent in each kernel (and "gemm") since the last call, where the device
    /// measures them (the CPU device, for `bench compute`); empty elsewhere.
    fn take_kernel_seconds(&mut self) -> Vec<(String, f64)> {
        Vec::new()
    }
    /// The event is not needed any more (its slot is reused; a GPU event is destroyed
    /// once it has completed).
    fn release_event(&mut self, e: Event);
    /// Has `e` completed? Never blocks on a GPU; devices that run their queues at once
    /// wait for it.
    fn event_done(&mut self, e: Event) -> Result<bool> {
        self.sync_event(e)?;
        Ok(true)
    }
    /// A real GPU's context and raw streams (indexed by [`Stream::index`]), for a library
    /// that works on them directly (NCCL); `None` on the host and CPU devices.
    fn cuda_handles(
        &self,
    ) -> Option<(
        std::sync::Arc<cudarc::driver::CudaContext>,
        [cudarc::driver::sys::CUstream; 2],
    )> {
        None
    }
}

/// Event slots reused once released, so a long run does not accumulate events.
pub struct EventTable<T> {
    slots: Vec<Option<T>>,
    free: Vec<usize>,
}

impl<T> Default for EventTable<T> {
    fn default() -> Self {
        EventTable {
            slots: Vec::new(),
            free: Vec::new(),
        }
    }
}

impl<T> EventTable<T> {
    pub fn insert(&mut self, v: T) -> Event {
        match self.free.pop() {
            Some(i) => {
                self.slots[i] = Some(v);
                Event(i)
            }
            None => {
                self.slots.push(Some(v));
                Event(self.slots.len() - 1)
            }
        }
    }

    pub fn get(&self, e: Event) -> Result<&T> {
        self.slots
            .get(e.0)
            .and_then(|s| s.as_ref())
            .ok_or_else(|| GpuError::Invalid(format!("no event {} (released?)", e.0)))
    }

    pub fn release(&mut self, e: Event) {
        if let Some(s) = self.slots.get_mut(e.0) {
            if s.take().is_some() {
                self.free.push(e.0);
            }
        }
    }

    /// Events alive now.
    pub fn live(&self) -> usize {
        self.slots.len() - self.free.len()
    }
}

/// Counters of an arena, reported with the worker's host-side figures (no device sync).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ArenaStats {
    pub reserved: u64,
    pub in_use: u64,
    pub peak: u64,
    pub alloc_failures: u64,
}

/// One allocation per worker, sub-allocated by bumping, freed all at once (`reset`) or to
/// a mark. Every buffer is 256-byte aligned (what cuBLAS and vector loads want).
///
/// A model lays out its buffers twice with the same code: once in a [`dry`](Arena::dry)
/// arena, which only measures (no device memory, nothing uploaded), then in the real one
/// of exactly that size — so the size is never a second, hand-kept sum that can drift.
pub struct Arena {
    base: DevPtr,
    size: usize,
    top: usize,
    dry: bool,
    pub stats: ArenaStats,
}

impl Arena {
    /// The arena for `what`, after checking that the device has `size` bytes free: a
    /// model that does not fit is a permanent failure ([`GpuError::Unavailable`]) with the
    /// figures, not an allocation error that a restart would repeat.
    pub fn for_model(dev: &mut dyn Device, size: usize, what: &str) -> Result<Arena> {
        let (free, total) = dev.mem_info()?;
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        let say = || {
            format!(
                "{what} needs {:.2} GiB of device memory, {:.2} GiB of {:.2} GiB are free on {}",
                gib(size),
                gib(free),
                gib(total),
                dev.describe()
            )
        };
        // More than the whole device: it can never fit. More than is free now (another
        // worker on the GPU, a predecessor still tearing down): a restart may find room.
        if total > 0 && size > total {
            return Err(GpuError::Unavailable(say()));
        }
        if total > 0 && size > free {
            return Err(GpuError::OutOfMemory {
                what: format!("{what} on {}", dev.describe()),
                requested: size,
                free_of: Some((free, total)),
            });
        }
        Arena::new(dev, size)
    }

    pub fn new(dev: &mut dyn Device, size: usize) -> Result<Arena> {
        let base = dev.alloc(size)?;
        Ok(Arena {
            base,
            size,
            top: 0,
            dry: false,
            stats: ArenaStats {
                reserved: size as u64,
                ..Default::default()
            },
        })
    }

    /// Does this arena only measure?
    pub fn is_dry(&self) -> bool {
        self.dry
    }

    /// An arena that only measures: allocations bump its size and nothing else.
    pub fn dry() -> Arena {
        Arena {
            base: 0,
            size: usize::MAX,
            top: 0,
            dry: true,
            stats: ArenaStats::default(),
        }
    }

    /// Copy `bytes` into `dst` (on the compute stream), unless this arena only measures.
    pub fn fill(&self, dev: &mut dyn Device, dst: DSlice, bytes: &[u8]) -> Result<()> {
        if self.dry {
            return Ok(());
        }
        dev.upload(Stream::Compute, dst, bytes)
    }

    /// [`fill`](Self::fill) with f32s widened from the source or narrowed to bf16
    /// (`bf16`), the conversion itself skipped when measuring.
    pub fn fill_f32(&self, dev: &mut dyn Device, dst: DSlice, v: &[f32], bf16: bool) -> Result<()> {
        if self.dry {
            return Ok(());
        }
        if bf16 {
            let bits: Vec<u8> = v
                .iter()
                .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
                .collect();
            dev.upload(Stream::Compute, dst, &bits)
        } else {
            dev.upload(Stream::Compute, dst, f32_bytes(v))
        }
    }

    pub fn alloc(&mut self, dev: &mut dyn Device, bytes: usize, name: &str) -> Result<DSlice> {
        let start = self.top.div_ceil(256) * 256;
        if start + bytes > self.size {
            self.stats.alloc_failures += 1;
            return Err(GpuError::OutOfMemory {
                what: format!("{name} from the arena"),
                requested: bytes,
                free_of: Some((self.size - self.top, self.size)),
            });
        }
        self.top = start + bytes;
        self.stats.in_use = self.top as u64;
        self.stats.peak = self.stats.peak.max(self.stats.in_use);
        let s = DSlice {
            ptr: self.base + start as u64,
            bytes,
        };
        if !self.dry {
            dev.track(s, name);
        }
        Ok(s)
    }

    pub fn alloc_f32(&mut self, dev: &mut dyn Device, n: usize, name: &str) -> Result<DSlice> {
        self.alloc(dev, n * 4, name)
    }

    /// Where the next allocation would start; `release_to` frees everything after it.
    pub fn mark(&self) -> usize {
        self.top
    }

    pub fn release_to(&mut self, mark: usize) {
        self.top = mark.min(self.top);
        self.stats.in_use = self.top as u64;
    }
}

/// `f32`s as bytes (little-endian, as the devices hold them).
pub fn f32_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and any byte pattern is a valid u8.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
}

pub fn f32_bytes_mut(v: &mut [f32]) -> &mut [u8] {
    // SAFETY: as above, and every byte pattern is a valid f32.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), std::mem::size_of_val(v)) }
}

pub fn i32_bytes(v: &[i32]) -> &[u8] {
    // SAFETY: as for f32.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
}

pub fn i32_bytes_mut(v: &mut [i32]) -> &mut [u8] {
    // SAFETY: as for f32_bytes_mut, and every byte pattern is a valid i32.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), std::mem::size_of_val(v)) }
}

pub fn u32_bytes(v: &[u32]) -> &[u8] {
    // SAFETY: as for f32.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), std::mem::size_of_val(v)) }
}

/// Which device a worker computes on: its GPU (`CudaDevice`, over whichever CUDA driver
/// the library search finds: a real one, or the tests' emulated one), or none (the CPU
/// device). `DFLASH_DEVICE=cpu` forces the CPU; `DFLASH_CHECK_STREAMS=1` puts the GPU
/// behind the stream-order checker ([`race::Checked`]: the tests run every e2e GPU run so).
pub fn open_device(gpu: Option<u32>) -> Result<Option<Box<dyn Device>>> {
    match std::env::var("DFLASH_DEVICE").ok().as_deref() {
        Some("cpu") => Ok(None),
        Some(other) if !other.is_empty() => Err(GpuError::Invalid(format!(
            "DFLASH_DEVICE={other}: expected cpu (a worker's GPU is CUDA's; the tests' emulated one is chosen by DFLASH_CUDA_LIB and DFLASH_CUBLAS_LIB)"
        ))),
        _ => match gpu {
            None => Ok(None),
            Some(_) => open_gpu(0).map(Some),
        },
    }
}

/// GPU `ordinal` of those `CUDA_VISIBLE_DEVICES` names (stream-checked with
/// `DFLASH_CHECK_STREAMS=1`), said in the worker's log.
pub fn open_gpu(ordinal: usize) -> Result<Box<dyn Device>> {
    let dev = cuda::CudaDevice::open_ordinal(ordinal)?;
    // Which files and versions this worker runs on: the first thing to check when a GPU
    // run fails (into the worker's log).
    println!("GPU: {}", dev.describe());
    for l in &dev.libraries {
        println!("  {l}");
    }
    if std::env::var("DFLASH_CHECK_STREAMS").is_ok_and(|v| v == "1") {
        println!("  streams: every operation checked for stream order (DFLASH_CHECK_STREAMS=1)");
        return Ok(Box::new(race::Checked::new(Box::new(dev))));
    }
    Ok(Box::new(dev))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_arena_that_is_full_says_who_asked_how_much_and_what_was_left() {
        let mut dev = cpu::CpuDevice::new();
        let mut arena = Arena::new(&mut dev, 4096).unwrap();
        arena.alloc(&mut dev, 3072, "weights").unwrap();
        let err = arena.alloc(&mut dev, 2 << 20, "activations").unwrap_err();
        let GpuError::OutOfMemory {
            what,
            requested,
            free_of: Some((free, total)),
        } = &err
        else {
            panic!("{err:?}")
        };
        assert!(what.starts_with("activations"), "{what}");
        assert_eq!((*requested, *free, *total), (2 << 20, 1024, 4096));
        assert_eq!(
            err.to_string(),
            "out of memory: activations from the arena: 2.0 MiB asked, 1024 bytes of 4096 bytes free"
        );
        assert_eq!(arena.stats.alloc_failures, 1);
    }

    #[test]
    fn a_failed_call_keeps_the_call_apart_from_the_librarys_words() {
        let e = GpuError::failed("cuMemcpyHtoDAsync")(7);
        assert_eq!(
            e,
            GpuError::Failed {
                call: "cuMemcpyHtoDAsync".into(),
                error: "7".into()
            }
        );
        assert_eq!(e.to_string(), "cuMemcpyHtoDAsync: 7");
    }
}
