//! The CPU as a [`Device`]: memory is host memory, copies are `memcpy`s, streams run in
//! order as they are called, GEMMs go through the `gemm` crate (threaded), and each kernel
//! of `cuda/kernels.cu` has a Rust counterpart here with the same arguments and the same
//! result up to summation order. So the device models ([`DeviceDrafter`](crate::models::drafter::device::DeviceDrafter),
//! [`DeviceTarget`](crate::models::target::device::DeviceTarget)) are the models of every backend: a CPU worker runs the
//! same model code, buffers and optimizer as a GPU worker, and every CPU test runs it.
//!
//! The kernels here are checked against the CPU reference ops (`reference::cpu`, test-only) by
//! the same tests as the host device's (`DFLASH_TEST_DEVICE=cpu`), and the whole drafter
//! step against the reference drafter.
//!
//! Where the GPU accumulates with atomics (attention's key and value gradients), these
//! accumulate in a fixed order: a step gives the same bits every time, which is what the
//! recovery tests' bit-identical replay needs. (RMSNorm's weight gradient takes no atomics
//! on either: partial rows per block of rows, then their sum in a fixed order.)

#![allow(clippy::needless_range_loop)] // kernels index several buffers by one row/element index, as the CUDA source does

use super::ops::kernel::Kernel;
use super::ops::on_cpu::Widened;
use super::{Arg, DSlice, DevPtr, Device, Event, Gemm, GpuError, Result, Stream};

pub struct CpuDevice {
    allocations: Vec<(*mut u8, std::alloc::Layout)>,
    threads: usize,
    /// Seconds per kernel name since the last `take_kernel_seconds`.
    seconds: std::collections::BTreeMap<String, f64>,
}

// SAFETY: the allocations are owned by this value and only reached through &mut self.
unsafe impl Send for CpuDevice {}

impl Default for CpuDevice {
    fn default() -> Self {
        CpuDevice::new()
    }
}

impl CpuDevice {
    pub fn new() -> CpuDevice {
        CpuDevice {
            allocations: Vec::new(),
            threads: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            seconds: Default::default(),
        }
    }

    /// [`CpuDevice::new`] with its compute threads started now
    /// ([`super::compute_threads::start`]): a worker's device, whose threaded products
    /// must not find their threads refused in the middle of a step.
    pub fn open() -> std::result::Result<CpuDevice, super::compute_threads::ThreadsError> {
        super::compute_threads::start(dflash_shared::nproc::compute_threads())?;
        Ok(CpuDevice::new())
    }

    fn par(&self, work: usize) -> gemm::Parallelism {
        super::ops::on_cpu::par(self.threads, work)
    }
}

impl Drop for CpuDevice {
    fn drop(&mut self) {
        for (p, l) in self.allocations.drain(..) {
            // SAFETY: allocated in `alloc` with this layout.
            unsafe { std::alloc::dealloc(p, l) };
        }
    }
}

/// No buffer a kernel writes may overlap another of its buffers: the Rust kernels below
/// take them as separate slices.
fn check_aliasing(k: &Kernel) -> Result<()> {
    let (kernel, args) = (k.name(), k.args());
    let range = |b: &DSlice| b.ptr..b.ptr + b.bytes as u64;
    for (i, a) in args.iter().enumerate() {
        let (Arg::W(w) | Arg::RW(w)) = a else {
            continue;
        };
        for (j, b) in args.iter().enumerate() {
            let (Arg::R(o) | Arg::W(o) | Arg::RW(o)) = b else {
                continue;
            };
            let (x, y) = (range(w), range(o));
            // RMSNorm may run in place (y = x exactly), as the target's q/k norms do.
            let in_place = matches!(k, Kernel::Norm(n) if n.in_place(i, j)) && w == o;
            if i != j
                && !in_place
                && x.start < y.end
                && y.start < x.end
                && w.bytes > 0
                && o.bytes > 0
            {
                return Err(GpuError::Invalid(format!(
                    "{kernel}: argument {i} is written and overlaps argument {j}"
                )));
            }
        }
    }
    Ok(())
}

impl Device for CpuDevice {
    fn describe(&self) -> String {
        "the CPU".into()
    }

    fn alloc(&mut self, bytes: usize) -> Result<DevPtr> {
        let layout = std::alloc::Layout::from_size_align(bytes.max(1), 256)
            .map_err(|e| GpuError::Invalid(e.to_string()))?;
        // SAFETY: a non-zero size.
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        if p.is_null() {
            return Err(GpuError::OutOfMemory {
                what: "an allocation on the CPU device".into(),
                requested: bytes,
                free_of: None,
            });
        }
        self.allocations.push((p, layout));
        Ok(p as DevPtr)
    }

    fn mem_info(&self) -> Result<(usize, usize)> {
        // Host memory: the arena's check does not apply (0 total means unknown).
        Ok((0, 0))
    }

    fn upload(&mut self, _s: Stream, dst: DSlice, src: &[u8]) -> Result<()> {
        if src.len() > dst.bytes {
            return Err(GpuError::Invalid(format!(
                "upload of {} bytes into {}",
                src.len(),
                dst.bytes
            )));
        }
        // SAFETY: dst is this device's memory of at least src.len() bytes.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.ptr as *mut u8, src.len()) };
        Ok(())
    }

    fn download(&mut self, _s: Stream, src: DSlice, dst: &mut [u8]) -> Result<()> {
        if dst.len() > src.bytes {
            return Err(GpuError::Invalid(format!(
                "download of {} bytes from {}",
                dst.len(),
                src.bytes
            )));
        }
        // SAFETY: as in upload.
        unsafe { std::ptr::copy_nonoverlapping(src.ptr as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    unsafe fn download_async(&mut self, _s: Stream, src: DSlice, dst: *mut u8) -> Result<()> {
        std::ptr::copy_nonoverlapping(src.ptr as *const u8, dst, src.bytes);
        Ok(())
    }

    unsafe fn upload_async(&mut self, _s: Stream, dst: DSlice, src: *const u8) -> Result<()> {
        std::ptr::copy_nonoverlapping(src, dst.ptr as *mut u8, dst.bytes);
        Ok(())
    }

    unsafe fn register_host(&mut self, _ptr: *mut u8, _bytes: usize) -> Result<()> {
        Ok(())
    }

    fn memset_zero(&mut self, _s: Stream, dst: DSlice) -> Result<()> {
        // SAFETY: this device's memory.
        unsafe { std::ptr::write_bytes(dst.ptr as *mut u8, 0, dst.bytes) };
        Ok(())
    }

    fn launch(&mut self, _s: Stream, k: &Kernel, grid: u32, _block: u32) -> Result<()> {
        let t0 = std::time::Instant::now();
        let r = self.run_kernel(k, grid as usize);
        if r.is_ok() {
            let kernel = k.name();
            match self.seconds.get_mut(kernel) {
                Some(v) => *v += t0.elapsed().as_secs_f64(),
                None => {
                    self.seconds
                        .insert(kernel.to_string(), t0.elapsed().as_secs_f64());
                }
            }
        }
        r
    }

    fn gemm(&mut self, _s: Stream, g: &Gemm) -> Result<()> {
        let t0 = std::time::Instant::now();
        let r = self.run_gemm(g);
        *self.seconds.entry("gemm".to_string()).or_default() += t0.elapsed().as_secs_f64();
        r
    }

    fn take_kernel_seconds(&mut self) -> Vec<(String, f64)> {
        std::mem::take(&mut self.seconds).into_iter().collect()
    }

    fn record(&mut self, _s: Stream) -> Result<Event> {
        // Everything already happened in call order.
        Ok(Event(0))
    }

    fn wait(&mut self, _s: Stream, _e: Event) -> Result<()> {
        Ok(())
    }

    fn sync_event(&mut self, _e: Event) -> Result<()> {
        Ok(())
    }

    fn sync(&mut self) -> Result<()> {
        Ok(())
    }

    fn release_event(&mut self, _e: Event) {}

    fn is_cpu(&self) -> bool {
        true
    }
}

impl CpuDevice {
    /// Run `k` over `rows` (the launch's grid).
    fn run_kernel(&mut self, k: &Kernel, rows: usize) -> Result<()> {
        let mut wide = Widened::default();
        // SAFETY: the kernel's buffers are this device's memory (the models allocate them
        // from its arena).
        if let Some(k32) = unsafe { k.as_f32(&mut wide) } {
            self.run_kernel(&k32, rows)?;
            // SAFETY: as above; the kernel has returned.
            unsafe { wide.store() };
            return Ok(());
        }
        check_aliasing(k)?;
        // SAFETY: as above, and the buffers are not aliased (check_aliasing), so the
        // slices each kernel makes of them are disjoint; each checks their lengths.
        unsafe { k.run_cpu(rows, self.threads) }
    }

    fn run_gemm(&mut self, g: &Gemm) -> Result<()> {
        g.validate()?;
        let par = self.par(g.m * g.n * g.k);
        // SAFETY: validated above; the widened copies cover the same extents in f32.
        unsafe {
            g.with_f32_output(|g| g.with_f32_inputs(|g| super::host::sgemm_colmajor(g, par)))
        };
        Ok(())
    }
}

// The kernels of kernels.cu that are not attention, each over slices the caller made
// from the launch's buffers (see `run_kernel`); `rows` is the launch's grid.
