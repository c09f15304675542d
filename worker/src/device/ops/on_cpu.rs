//! What the CPU bodies of the op families share (the CPU device runs each kernel as the
//! Rust function its family's room holds): buffers as slices, the launch's length checks,
//! bf16 buffers widened to f32 and rounded back, work split over threads.

use crate::device::{DSlice, GpuError, Result};

/// # Safety
/// `b` must be memory of this device holding `T`s, not written through another slice
/// while this one lives (see the CPU device's aliasing check).
pub(crate) unsafe fn rd<'a, T>(b: DSlice) -> &'a [T] {
    if b.bytes == 0 {
        return &[];
    }
    std::slice::from_raw_parts(b.ptr as *const T, b.bytes / std::mem::size_of::<T>())
}

/// # Safety
/// As for [`rd`], and no other slice of `b` may live at the same time.
pub(crate) unsafe fn wr<'a, T>(b: DSlice) -> &'a mut [T] {
    if b.bytes == 0 {
        return &mut [];
    }
    std::slice::from_raw_parts_mut(b.ptr as *mut T, b.bytes / std::mem::size_of::<T>())
}

pub(crate) fn need(kernel: &str, what: &str, have: usize, want: usize) -> Result<()> {
    if have < want {
        return Err(GpuError::Invalid(format!(
            "{kernel}: {what} holds {have} elements, the launch needs {want}"
        )));
    }
    Ok(())
}

/// Run `f(range)` over `0..n` split into one contiguous range per thread.
pub(crate) fn par_ranges(threads: usize, n: usize, f: impl Fn(std::ops::Range<usize>) + Sync) {
    let t = threads.min(n).max(1);
    if t == 1 {
        f(0..n);
        return;
    }
    let per = n.div_ceil(t);
    let f = &f;
    // A range whose thread cannot be started (a thread limit) runs on the calling thread.
    dflash_shared::threads::scoped((0..t).map(|i| {
        let r = (i * per).min(n)..((i + 1) * per).min(n);
        move || f(r)
    }));
}

/// A pointer that threads writing disjoint parts of one buffer share.
#[derive(Clone, Copy)]
pub(crate) struct Shared(pub(crate) *mut f32);
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

/// bf16 buffers of a kernel run as its f32 one on the CPU device: each widened into a
/// temporary of its own (even where two arguments name one buffer, in place), and the
/// written ones rounded back once at the end (nearest even), as the CUDA kernels compute
/// in f32 and round on store.
#[derive(Default)]
pub(crate) struct Widened {
    temps: Vec<(DSlice, Vec<f32>, bool)>,
}

impl Widened {
    /// # Safety
    /// `b` must be this device's memory of `b.bytes` bytes of bf16.
    unsafe fn add(&mut self, b: DSlice, written: bool) -> DSlice {
        let bits = rd::<u16>(b);
        let mut v: Vec<f32> = bits
            .iter()
            .map(|b| f32::from_bits((*b as u32) << 16))
            .collect();
        let d = DSlice {
            ptr: v.as_mut_ptr() as u64,
            bytes: v.len() * 4,
        };
        self.temps.push((b, v, written));
        d
    }

    /// # Safety
    /// As for [`add`](Self::add).
    pub(crate) unsafe fn input(&mut self, b: DSlice) -> DSlice {
        self.add(b, false)
    }

    /// # Safety
    /// As for [`add`](Self::add).
    pub(crate) unsafe fn output(&mut self, b: DSlice) -> DSlice {
        self.add(b, true)
    }

    /// Round the written temporaries into their bf16 buffers.
    ///
    /// # Safety
    /// As for [`add`](Self::add); the kernel that wrote them has returned.
    pub(crate) unsafe fn store(self) {
        for (b, v, written) in &self.temps {
            if *written {
                for (o, x) in wr::<u16>(*b).iter_mut().zip(v) {
                    *o = half::bf16::from_f32(*x).to_bits();
                }
            }
        }
    }
}

/// How a CPU GEMM of `work` multiply-adds runs: over `threads` threads, or (below about a
/// millisecond of one core's work, where handing it to threads costs more while the other
/// workers on the machine want the cores too) on the calling thread.
pub(crate) fn par(threads: usize, work: usize) -> gemm::Parallelism {
    if threads > 1 && work >= (1 << 22) {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    }
}
