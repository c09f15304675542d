//! The host device: the [`Device`] layer on the CPU, for CI and tests (see the module
//! docs of [`crate::device`]).
//!
//! - Memory is host memory; a device address is a host address.
//! - Kernels are `cuda/kernels.cu` compiled as C++ (build.rs) and launched through
//!   `dflash_hd_launch` with cuLaunchKernel-style packed arguments.
//! - Operations run when they are queued, in program order; what makes the two streams
//!   real is the stream-order checker ([`super::race`]): every access to a tracked buffer
//!   must be ordered after the last write to it (and a write after every read since) by
//!   stream order, an event wait, or a host sync. Otherwise the operation fails with
//!   [`GpuError::Race`] naming both sides, which is how a copy that is not ordered after
//!   the compute it reads fails a test.
//! - GEMMs follow cuBLAS's column-major contract, computed by the `gemm` crate.

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};

use super::race::{Clock, RaceDetector};
use super::{
    Arg, DSlice, DevPtr, Device, Event, EventTable, Gemm, GpuError, Kernel, Result, Stream,
};

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

/// The kernels the host device can launch: name → (index, parameter kinds, one letter
/// each: p pointer, i 4-byte integer, l 8-byte integer, f float, d double).
pub fn kernel_table() -> HashMap<String, (i32, String)> {
    // SAFETY: the table is static data of the C++ launcher.
    unsafe {
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
    }
}

/// The parameter kind an argument fills (see [`kernel_table`]).
fn arg_kind(a: &Arg) -> char {
    match a {
        Arg::R(_) | Arg::W(_) | Arg::RW(_) | Arg::Null => 'p',
        Arg::I32(_) | Arg::U32(_) => 'i',
        Arg::I64(_) => 'l',
        Arg::F32(_) => 'f',
    }
}

pub struct HostDevice {
    kernels: HashMap<String, (i32, String)>,
    allocations: Vec<(*mut u8, std::alloc::Layout)>,
    race: RaceDetector,
    pub events: EventTable<Clock>,
    /// Operations run, per kind (for tests).
    pub launches: u64,
    /// A device memory size to pretend (tests of what does not fit); None: unlimited.
    memory_limit: Option<usize>,
}

// SAFETY: the raw allocations are owned by the device and only touched through it.
unsafe impl Send for HostDevice {}

impl Default for HostDevice {
    fn default() -> Self {
        HostDevice::new()
    }
}

impl HostDevice {
    pub fn new() -> HostDevice {
        HostDevice {
            kernels: kernel_table(),
            allocations: Vec::new(),
            race: RaceDetector::default(),
            events: EventTable::default(),
            launches: 0,
            memory_limit: None,
        }
    }

    /// A host device that reports `bytes` of device memory and refuses to allocate more.
    pub fn with_memory(bytes: usize) -> HostDevice {
        let mut d = HostDevice::new();
        d.memory_limit = Some(bytes);
        d
    }
}

impl Drop for HostDevice {
    fn drop(&mut self) {
        for (p, layout) in self.allocations.drain(..) {
            // SAFETY: allocated in `alloc` with this layout.
            unsafe { std::alloc::dealloc(p, layout) };
        }
    }
}

impl Device for HostDevice {
    fn describe(&self) -> String {
        "host device (CUDA kernels compiled for the CPU)".into()
    }

    fn alloc(&mut self, bytes: usize) -> Result<DevPtr> {
        let used: usize = self.allocations.iter().map(|(_, l)| l.size()).sum();
        if self.memory_limit.is_some_and(|limit| used + bytes > limit) {
            let limit = self.memory_limit.unwrap_or(0);
            return Err(GpuError::OutOfMemory {
                what: "an allocation on the host device".into(),
                requested: bytes,
                free_of: Some((limit.saturating_sub(used), limit)),
            });
        }
        let layout = std::alloc::Layout::from_size_align(bytes.max(1), 256)
            .map_err(|e| GpuError::Invalid(e.to_string()))?;
        // SAFETY: non-zero size. Zeroed: a fresh GPU allocation is not, but a test should
        // not depend on garbage either way.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        if p.is_null() {
            return Err(GpuError::OutOfMemory {
                what: "an allocation on the host device".into(),
                requested: bytes,
                free_of: None,
            });
        }
        self.allocations.push((p, layout));
        self.track(
            DSlice {
                ptr: p as u64,
                bytes,
            },
            "allocation",
        );
        Ok(p as u64)
    }

    fn mem_info(&self) -> Result<(usize, usize)> {
        // Without a limit the host device's "device" is what it has allocated: all in use.
        let used: usize = self.allocations.iter().map(|(_, l)| l.size()).sum();
        Ok(match self.memory_limit {
            Some(limit) => (limit.saturating_sub(used), limit),
            None => (0, used),
        })
    }

    fn track(&mut self, buf: DSlice, name: &str) {
        self.race.track(buf, name);
    }

    fn upload(&mut self, s: Stream, dst: DSlice, src: &[u8]) -> Result<()> {
        if src.len() > dst.bytes {
            return Err(GpuError::Invalid(format!(
                "upload of {} bytes into {}",
                src.len(),
                dst.bytes
            )));
        }
        let seq = self.race.op(s);
        self.race.on_stream(
            s,
            seq,
            DSlice {
                ptr: dst.ptr,
                bytes: src.len(),
            },
            true,
            "an upload",
        )?;
        // SAFETY: dst is device (= host) memory of at least src.len() bytes.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.ptr as *mut u8, src.len()) };
        Ok(())
    }

    fn download(&mut self, s: Stream, src: DSlice, dst: &mut [u8]) -> Result<()> {
        if dst.len() > src.bytes {
            return Err(GpuError::Invalid(format!(
                "download of {} bytes from {}",
                dst.len(),
                src.bytes
            )));
        }
        let seq = self.race.op(s);
        self.race.on_stream(
            s,
            seq,
            DSlice {
                ptr: src.ptr,
                bytes: dst.len(),
            },
            false,
            "a download",
        )?;
        // SAFETY: as in upload.
        unsafe { std::ptr::copy_nonoverlapping(src.ptr as *const u8, dst.as_mut_ptr(), dst.len()) };
        self.race.host_waited_for(s);
        Ok(())
    }

    unsafe fn download_async(&mut self, s: Stream, src: DSlice, dst: *mut u8) -> Result<()> {
        let seq = self.race.op(s);
        self.race
            .on_stream(s, seq, src, false, "an async download")?;
        self.race.on_stream(
            s,
            seq,
            DSlice {
                ptr: dst as u64,
                bytes: src.bytes,
            },
            true,
            "an async download",
        )?;
        std::ptr::copy_nonoverlapping(src.ptr as *const u8, dst, src.bytes);
        Ok(())
    }

    unsafe fn upload_async(&mut self, s: Stream, dst: DSlice, src: *const u8) -> Result<()> {
        let seq = self.race.op(s);
        self.race.on_stream(
            s,
            seq,
            DSlice {
                ptr: src as u64,
                bytes: dst.bytes,
            },
            false,
            "an async upload",
        )?;
        self.race.on_stream(s, seq, dst, true, "an async upload")?;
        std::ptr::copy_nonoverlapping(src, dst.ptr as *mut u8, dst.bytes);
        Ok(())
    }

    unsafe fn register_host(&mut self, ptr: *mut u8, bytes: usize) -> Result<()> {
        // cuMemHostRegister without CU_MEMHOSTREGISTER_READ_ONLY fails on pages the process
        // maps read-only: refuse them here too, so the mistake shows without a GPU.
        if let Some(bad) = read_only_range(ptr as u64, bytes as u64) {
            return Err(GpuError::Invalid(format!("register_host: {bad} inside the range is mapped read-only (cuMemHostRegister would fail)")));
        }
        self.track(
            DSlice {
                ptr: ptr as u64,
                bytes,
            },
            "pinned host memory",
        );
        Ok(())
    }

    fn host_access(&mut self, ptr: *const u8, bytes: usize, write: bool) -> Result<()> {
        self.race.host_access(
            DSlice {
                ptr: ptr as u64,
                bytes,
            },
            write,
        )
    }

    fn memset_zero(&mut self, s: Stream, dst: DSlice) -> Result<()> {
        let seq = self.race.op(s);
        self.race.on_stream(s, seq, dst, true, "a memset")?;
        // SAFETY: dst is device (= host) memory.
        unsafe { std::ptr::write_bytes(dst.ptr as *mut u8, 0, dst.bytes) };
        Ok(())
    }

    fn launch(&mut self, s: Stream, k: &Kernel, grid: u32, block: u32) -> Result<()> {
        self.launch_args(s, k.name(), grid, block, &k.args())
    }

    fn gemm(&mut self, s: Stream, g: &Gemm) -> Result<()> {
        g.validate()?;
        self.race.gemm(s, g)?;
        // SAFETY: every operand covers its extent (validated above).
        unsafe { g.with_f32_output(|g| g.with_f32_inputs(|g| host_sgemm(g))) };
        Ok(())
    }

    fn record(&mut self, s: Stream) -> Result<Event> {
        Ok(self.events.insert(self.race.record(s)))
    }

    fn wait(&mut self, s: Stream, e: Event) -> Result<()> {
        let c = *self.events.get(e)?;
        self.race.wait(s, c);
        Ok(())
    }

    fn sync_event(&mut self, e: Event) -> Result<()> {
        let c = *self.events.get(e)?;
        self.race.host_waited(c);
        Ok(())
    }

    fn sync(&mut self) -> Result<()> {
        self.race.host_waited_for(Stream::Compute);
        self.race.host_waited_for(Stream::Copy);
        Ok(())
    }

    fn release_event(&mut self, e: Event) {
        self.events.release(e);
    }
}

/// The first part of `[lo, lo + len)` that this process maps without write permission,
/// from /proc/self/maps.
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

/// cuBLAS `sgemm` semantics on host memory: `C = alpha·op(A)·op(B) + beta·C`, column-major.
///
/// # Safety
/// The operands must cover [`Gemm::extents`].
pub unsafe fn host_sgemm(g: &Gemm) {
    sgemm_colmajor(g, gemm::Parallelism::None)
}

/// [`Gemm`] (cuBLAS's column-major contract, f32 operands) through the `gemm` crate.
///
/// # Safety
/// As for [`host_sgemm`].
pub unsafe fn sgemm_colmajor(g: &Gemm, par: gemm::Parallelism) {
    let (m, n, k) = (g.m, g.n, g.k);
    if m == 0 || n == 0 {
        return;
    }
    let c = g.c.ptr as *mut f32;
    // op(A) element (i, p): A[i + p·lda], or A[p + i·lda] transposed.
    let (a_rs, a_cs) = if g.transa {
        (g.lda as isize, 1)
    } else {
        (1, g.lda as isize)
    };
    let (b_rs, b_cs) = if g.transb {
        (g.ldb as isize, 1)
    } else {
        (1, g.ldb as isize)
    };
    if k == 0 || g.alpha == 0.0 {
        for j in 0..n {
            for i in 0..m {
                let p = c.add(i + j * g.ldc);
                *p = if g.beta == 0.0 { 0.0 } else { g.beta * *p };
            }
        }
        return;
    }
    // The gemm crate: dst := alpha·dst + beta·lhs·rhs (dst read only when read_dst).
    gemm::gemm(
        m,
        n,
        k,
        c,
        g.ldc as isize,
        1,
        g.beta != 0.0,
        g.a.ptr as *const f32,
        a_cs,
        a_rs,
        g.b.ptr as *const f32,
        b_cs,
        b_rs,
        g.beta,
        g.alpha,
        false,
        false,
        false,
        par,
    );
}

impl HostDevice {
    /// Launch kernel `kernel` with its C parameters `args`, as a GPU launch takes them
    /// (what [`Kernel::args`] lays out; the tests of the launch checks call it directly).
    pub fn launch_args(
        &mut self,
        s: Stream,
        kernel: &str,
        grid: u32,
        block: u32,
        args: &[Arg],
    ) -> Result<()> {
        let (index, sig) = self
            .kernels
            .get(kernel)
            .ok_or_else(|| GpuError::Invalid(format!("no kernel named {kernel}")))?;
        let index = *index;
        if sig.len() != args.len() {
            return Err(GpuError::Invalid(format!(
                "{kernel} takes {} arguments, {} given",
                sig.len(),
                args.len()
            )));
        }
        // A GPU launch copies each parameter's own size from the argument: a 4-byte value
        // for an 8-byte parameter would be read with garbage. Refuse it here.
        if let Some((i, (want, a))) = sig
            .chars()
            .zip(args)
            .enumerate()
            .find(|(_, (want, a))| arg_kind(a) != *want)
        {
            return Err(GpuError::Invalid(format!(
                "{kernel}: parameter {i} is of kind '{want}', given {a:?}"
            )));
        }
        self.race.launch(s, kernel, args)?;
        // Each argument in its own 8-byte cell; scalars narrower than 8 bytes sit in the
        // low bytes (little-endian), which is where the kernel's parameter reads them.
        let mut cells: Vec<u64> = args
            .iter()
            .map(|a| match *a {
                Arg::R(b) | Arg::W(b) | Arg::RW(b) => b.ptr,
                Arg::Null => 0,
                Arg::I32(v) => v as u32 as u64,
                Arg::I64(v) => v as u64,
                Arg::U32(v) => v as u64,
                Arg::F32(v) => v.to_bits() as u64,
            })
            .collect();
        let mut ptrs: Vec<*mut c_void> = cells.iter_mut().map(|c| (c as *mut u64).cast()).collect();
        let (g, b) = ([grid, 1, 1], [block, 1, 1]);
        let mut err = [0 as c_char; 256];
        // SAFETY: the kernel's parameters match `args` in count (checked) and in type (the
        // ops layer's contract); every buffer is host memory of the stated size.
        let rc = unsafe {
            dflash_hd_launch(
                index,
                g.as_ptr(),
                b.as_ptr(),
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
            return Err(GpuError::Invalid(msg));
        }
        self.launches += 1;
        Ok(())
    }
}
