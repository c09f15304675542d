//! The CPU as a [`Device`]: memory is host memory, copies are `memcpy`s, streams run in
//! order as they are called, GEMMs go through the `gemm` crate (threaded), and each kernel
//! of `cuda/kernels.cu` has a Rust counterpart here with the same arguments and the same
//! result up to summation order. So the device models ([`super::drafter::GpuDrafter`],
//! [`super::target::GpuTarget`]) are the models of every backend: a CPU worker runs the
//! same model code, buffers and optimizer as a GPU worker, and every CPU test runs it.
//!
//! The kernels here are checked against the CPU reference ops ([`crate::compute::cpu`]) by
//! the same tests as the host device's (`DFLASH_TEST_DEVICE=cpu`), and the whole drafter
//! step against the reference drafter.
//!
//! Where the GPU accumulates with atomics (RMSNorm's weight gradient, attention's key and
//! value gradients), these accumulate in a fixed order: a step gives the same bits every
//! time, which is what the recovery tests' bit-identical replay needs.

#![allow(clippy::needless_range_loop)] // kernels index several buffers by one row/element index, as the CUDA source does

use super::{Arg, DSlice, DevPtr, Device, Event, Gemm, GpuError, Result, Stream};
use crate::math::exp_neg;

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

    fn par(&self, work: usize) -> gemm::Parallelism {
        // Below this a product takes about a millisecond on one core, and handing it to
        // threads (while the other workers on the machine want the cores too) costs more.
        if self.threads > 1 && work >= (1 << 22) {
            gemm::Parallelism::Rayon(self.threads)
        } else {
            gemm::Parallelism::None
        }
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

/// The kernel's arguments, decoded by position.
struct Args<'a> {
    kernel: &'a str,
    args: &'a [Arg],
}

impl Args<'_> {
    fn bad(&self, i: usize, want: &str) -> GpuError {
        GpuError::Invalid(format!(
            "{}: argument {i} should be {want}, is {:?}",
            self.kernel,
            self.args.get(i)
        ))
    }

    fn buf(&self, i: usize) -> Result<DSlice> {
        match self.args.get(i) {
            Some(Arg::R(b) | Arg::W(b) | Arg::RW(b)) => Ok(*b),
            _ => Err(self.bad(i, "a buffer")),
        }
    }

    fn opt_buf(&self, i: usize) -> Result<Option<DSlice>> {
        match self.args.get(i) {
            Some(Arg::Null) => Ok(None),
            _ => self.buf(i).map(Some),
        }
    }

    fn int(&self, i: usize) -> Result<i64> {
        match self.args.get(i) {
            Some(Arg::I32(v)) => Ok(*v as i64),
            Some(Arg::I64(v)) => Ok(*v),
            Some(Arg::U32(v)) => Ok(*v as i64),
            _ => Err(self.bad(i, "an integer")),
        }
    }

    fn usize(&self, i: usize) -> Result<usize> {
        usize::try_from(self.int(i)?).map_err(|_| self.bad(i, "a non-negative integer"))
    }

    fn f32(&self, i: usize) -> Result<f32> {
        match self.args.get(i) {
            Some(Arg::F32(v)) => Ok(*v),
            _ => Err(self.bad(i, "a float")),
        }
    }

    /// No buffer a kernel writes may overlap another of its buffers: the Rust kernels
    /// below take them as separate slices.
    fn check_aliasing(&self) -> Result<()> {
        let range = |b: &DSlice| b.ptr..b.ptr + b.bytes as u64;
        for (i, a) in self.args.iter().enumerate() {
            let (Arg::W(w) | Arg::RW(w)) = a else {
                continue;
            };
            for (j, b) in self.args.iter().enumerate() {
                let (Arg::R(o) | Arg::W(o) | Arg::RW(o)) = b else {
                    continue;
                };
                let (x, y) = (range(w), range(o));
                // RMSNorm may run in place (y = x exactly), as the target's q/k norms do.
                let in_place = self.kernel == "rmsnorm_fwd" && (i, j) == (0, 2) && w == o;
                if i != j
                    && !in_place
                    && x.start < y.end
                    && y.start < x.end
                    && w.bytes > 0
                    && o.bytes > 0
                {
                    return Err(GpuError::Invalid(format!(
                        "{}: argument {i} is written and overlaps argument {j}",
                        self.kernel
                    )));
                }
            }
        }
        Ok(())
    }
}

/// # Safety
/// `b` must be memory of this device holding `T`s, not written through another slice
/// while this one lives (see [`Args::check_aliasing`]).
unsafe fn rd<'a, T>(b: DSlice) -> &'a [T] {
    if b.bytes == 0 {
        return &[];
    }
    std::slice::from_raw_parts(b.ptr as *const T, b.bytes / std::mem::size_of::<T>())
}

/// # Safety
/// As for [`rd`], and no other slice of `b` may live at the same time.
unsafe fn wr<'a, T>(b: DSlice) -> &'a mut [T] {
    if b.bytes == 0 {
        return &mut [];
    }
    std::slice::from_raw_parts_mut(b.ptr as *mut T, b.bytes / std::mem::size_of::<T>())
}

fn need(kernel: &str, what: &str, have: usize, want: usize) -> Result<()> {
    if have < want {
        return Err(GpuError::Invalid(format!(
            "{kernel}: {what} holds {have} elements, the launch needs {want}"
        )));
    }
    Ok(())
}

/// Multiply-adds of an attention call below which it runs on one thread (starting threads
/// costs more than they save).
const PAR_WORK: usize = 1 << 22;

/// Multiply-adds of an attention over `tq` rows of width `qw` (the two products with each
/// key a row sees).
fn attention_work(
    tq: usize,
    qw: usize,
    span: &impl Fn(usize, usize) -> std::ops::Range<usize>,
) -> usize {
    (0..tq)
        .map(|r| span(r, 0).len() + span(r, 1).len())
        .sum::<usize>()
        * qw
        * 2
}

/// Run `f(range)` over `0..n` split into one contiguous range per thread.
fn par_ranges(threads: usize, n: usize, f: impl Fn(std::ops::Range<usize>) + Sync) {
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
struct Shared(*mut f32);
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

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
            return Err(GpuError::OutOfMemory(format!(
                "{bytes} bytes of host memory"
            )));
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

    fn launch(
        &mut self,
        s: Stream,
        kernel: &str,
        grid: u32,
        block: u32,
        args: &[Arg],
    ) -> Result<()> {
        let t0 = std::time::Instant::now();
        let r = self.run_kernel(s, kernel, grid, block, args);
        if r.is_ok() {
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

/// The bf16 kernels (a GPU target's activations) and which of their arguments are bf16:
/// on the CPU device each runs as its f32 kernel on widened copies, its bf16 outputs
/// rounded once at the end (nearest even), as the CUDA kernels compute in f32 and round
/// on store.
const BF16_KERNELS: [(&str, &str, &[usize]); 7] = [
    ("embed_gather_bf16", "embed_gather", &[0, 1]),
    ("add_inplace_bf16", "add_inplace", &[0, 1]),
    ("copy_cols_bf16", "copy_cols", &[0, 1]),
    ("swiglu_fwd_bf16", "swiglu_fwd", &[0, 1, 2]),
    ("rmsnorm_fwd_bf16", "rmsnorm_fwd", &[0, 2]),
    ("rope_bf16", "rope", &[0]),
    ("attention_fwd_bf16", "attention_fwd", &[0, 2, 3, 4]),
];

impl CpuDevice {
    /// Run a bf16 kernel as its f32 one (see [`BF16_KERNELS`]).
    fn via_f32(
        &mut self,
        s: Stream,
        (kernel, f32_kernel, bf16): (&str, &str, &[usize]),
        grid: u32,
        block: u32,
        args: &[Arg],
    ) -> Result<()> {
        let mut wide: Vec<(usize, Vec<f32>)> = Vec::new();
        let mut args2 = args.to_vec();
        for &i in bf16 {
            let buf = match args.get(i) {
                Some(Arg::R(b) | Arg::W(b) | Arg::RW(b)) => *b,
                other => {
                    return Err(GpuError::Invalid(format!(
                        "{kernel}: argument {i} should be a bf16 buffer, is {other:?}"
                    )))
                }
            };
            // SAFETY: the argument is this device's memory of `buf.bytes` bytes.
            let bits = unsafe { std::slice::from_raw_parts(buf.ptr as *const u16, buf.bytes / 2) };
            wide.push((
                i,
                bits.iter()
                    .map(|b| f32::from_bits((*b as u32) << 16))
                    .collect(),
            ));
        }
        // One temporary per buffer, even where two arguments name one buffer (in place).
        for (i, v) in wide.iter_mut() {
            let d = DSlice {
                ptr: v.as_mut_ptr() as u64,
                bytes: v.len() * 4,
            };
            args2[*i] = match args[*i] {
                Arg::R(_) => Arg::R(d),
                Arg::W(_) => Arg::W(d),
                _ => Arg::RW(d),
            };
        }
        self.run_kernel(s, f32_kernel, grid, block, &args2)?;
        for (i, v) in &wide {
            if let Arg::W(b) | Arg::RW(b) = args[*i] {
                // SAFETY: as above; written by this kernel only.
                let bits =
                    unsafe { std::slice::from_raw_parts_mut(b.ptr as *mut u16, b.bytes / 2) };
                for (o, x) in bits.iter_mut().zip(v) {
                    *o = half::bf16::from_f32(*x).to_bits();
                }
            }
        }
        Ok(())
    }

    fn run_kernel(
        &mut self,
        s: Stream,
        kernel: &str,
        grid: u32,
        block: u32,
        args: &[Arg],
    ) -> Result<()> {
        if let Some(&entry) = BF16_KERNELS.iter().find(|(k, ..)| *k == kernel) {
            return self.via_f32(s, entry, grid, block, args);
        }
        let a = Args { kernel, args };
        a.check_aliasing()?;
        let rows = grid as usize;
        // SAFETY (every arm): the buffers are this device's memory (the models allocate them
        // from its arena), checked for length against the launch below, and not aliased
        // (check_aliasing), so the slices are disjoint.
        unsafe {
            match kernel {
                "embed_gather" => {
                    let (h, vocab) = (a.usize(3)?, a.usize(4)?);
                    let (out, table, ids) = (
                        wr::<f32>(a.buf(0)?),
                        rd::<f32>(a.buf(1)?),
                        rd::<u32>(a.buf(2)?),
                    );
                    need(kernel, "out", out.len(), rows * h)?;
                    need(kernel, "ids", ids.len(), rows)?;
                    need(kernel, "table", table.len(), vocab * h)?;
                    for (r, o) in out.chunks_exact_mut(h).take(rows).enumerate() {
                        let id = (ids[r] as usize).min(vocab - 1);
                        o.copy_from_slice(&table[id * h..(id + 1) * h]);
                    }
                }
                "scatter_add_rows" => {
                    let h = a.usize(3)?;
                    let (dst, src, idx) = (
                        wr::<f32>(a.buf(0)?),
                        rd::<f32>(a.buf(1)?),
                        rd::<u32>(a.buf(2)?),
                    );
                    need(kernel, "src", src.len(), rows * h)?;
                    need(kernel, "idx", idx.len(), rows)?;
                    for r in 0..rows {
                        let to = idx[r] as usize;
                        need(kernel, "dst", dst.len(), (to + 1) * h)?;
                        for (d, s) in dst[to * h..(to + 1) * h]
                            .iter_mut()
                            .zip(&src[r * h..(r + 1) * h])
                        {
                            *d += s;
                        }
                    }
                }
                "bf16_to_f32" => {
                    let n = a.usize(2)?;
                    let (out, input) = (wr::<f32>(a.buf(0)?), rd::<u16>(a.buf(1)?));
                    need(kernel, "out", out.len(), n)?;
                    need(kernel, "in", input.len(), n)?;
                    for (o, b) in out[..n].iter_mut().zip(input) {
                        *o = f32::from_bits((*b as u32) << 16);
                    }
                }
                "f32_to_bf16" => {
                    let n = a.usize(2)?;
                    let (out, input) = (wr::<u16>(a.buf(0)?), rd::<f32>(a.buf(1)?));
                    need(kernel, "out", out.len(), n)?;
                    need(kernel, "in", input.len(), n)?;
                    for (o, x) in out[..n].iter_mut().zip(input) {
                        *o = half::bf16::from_f32(*x).to_bits();
                    }
                }
                "add_inplace" => {
                    let n = a.usize(2)?;
                    let (x, y) = (wr::<f32>(a.buf(0)?), rd::<f32>(a.buf(1)?));
                    need(kernel, "x", x.len(), n)?;
                    need(kernel, "y", y.len(), n)?;
                    x[..n].iter_mut().zip(y).for_each(|(x, y)| *x += y);
                }
                "copy_cols" => {
                    let (width, ds, doff, ss, soff) = (
                        a.usize(2)?,
                        a.usize(3)?,
                        a.usize(4)?,
                        a.usize(5)?,
                        a.usize(6)?,
                    );
                    let (dst, src) = (wr::<f32>(a.buf(0)?), rd::<f32>(a.buf(1)?));
                    if rows > 0 {
                        need(kernel, "dst", dst.len(), (rows - 1) * ds + doff + width)?;
                        need(kernel, "src", src.len(), (rows - 1) * ss + soff + width)?;
                    }
                    for r in 0..rows {
                        dst[r * ds + doff..r * ds + doff + width]
                            .copy_from_slice(&src[r * ss + soff..r * ss + soff + width]);
                    }
                }
                "swiglu_fwd" => {
                    let n = a.usize(3)?;
                    let (out, gate, up) = (
                        wr::<f32>(a.buf(0)?),
                        rd::<f32>(a.buf(1)?),
                        rd::<f32>(a.buf(2)?),
                    );
                    need(
                        kernel,
                        "buffers",
                        out.len().min(gate.len()).min(up.len()),
                        n,
                    )?;
                    for i in 0..n {
                        let g = gate[i];
                        let s = 1.0 / (1.0 + (-g).exp());
                        out[i] = g * s * up[i];
                    }
                }
                "swiglu_bwd" => {
                    let n = a.usize(5)?;
                    let (dgate, dup) = (wr::<f32>(a.buf(0)?), wr::<f32>(a.buf(1)?));
                    let (dout, gate, up) = (
                        rd::<f32>(a.buf(2)?),
                        rd::<f32>(a.buf(3)?),
                        rd::<f32>(a.buf(4)?),
                    );
                    need(
                        kernel,
                        "buffers",
                        dgate
                            .len()
                            .min(dup.len())
                            .min(dout.len())
                            .min(gate.len())
                            .min(up.len()),
                        n,
                    )?;
                    for i in 0..n {
                        let (g, u, d) = (gate[i], up[i], dout[i]);
                        let s = 1.0 / (1.0 + (-g).exp());
                        dup[i] += d * g * s;
                        dgate[i] += d * u * s * (1.0 + g * (1.0 - s));
                    }
                }
                "rmsnorm_fwd" => {
                    let (d, eps) = (a.usize(4)?, a.f32(5)?);
                    let (yb, xb) = (a.buf(0)?, a.buf(2)?);
                    let (rstd, w) = (wr::<f32>(a.buf(1)?), rd::<f32>(a.buf(3)?));
                    need(kernel, "x/y", xb.len_f32().min(yb.len_f32()), rows * d)?;
                    need(kernel, "rstd", rstd.len(), rows)?;
                    need(kernel, "w", w.len(), d)?;
                    // x and y are one buffer or disjoint (check_aliasing): raw pointers, each
                    // row read whole before it is written.
                    let (y, x) = (yb.ptr as *mut f32, xb.ptr as *const f32);
                    for r in 0..rows {
                        let mut ss = 0f32;
                        for i in 0..d {
                            let v = *x.add(r * d + i);
                            ss += v * v;
                        }
                        let rs = 1.0 / (ss / d as f32 + eps).sqrt();
                        for i in 0..d {
                            *y.add(r * d + i) = *x.add(r * d + i) * rs * w[i];
                        }
                        rstd[r] = rs;
                    }
                }
                "rmsnorm_bwd" => {
                    let d = a.usize(6)?;
                    let dx = wr::<f32>(a.buf(0)?);
                    let dw = a.opt_buf(1)?.map(|b| wr::<f32>(b));
                    let (dy, x, w, rstd) = (
                        rd::<f32>(a.buf(2)?),
                        rd::<f32>(a.buf(3)?),
                        rd::<f32>(a.buf(4)?),
                        rd::<f32>(a.buf(5)?),
                    );
                    need(
                        kernel,
                        "dx/dy/x",
                        dx.len().min(dy.len()).min(x.len()),
                        rows * d,
                    )?;
                    need(kernel, "rstd", rstd.len(), rows)?;
                    need(kernel, "w", w.len(), d)?;
                    let mut dw = dw;
                    if let Some(dw) = dw.as_deref() {
                        need(kernel, "dw", dw.len(), d)?;
                    }
                    for r in 0..rows {
                        let (xr, gr, rs) =
                            (&x[r * d..(r + 1) * d], &dy[r * d..(r + 1) * d], rstd[r]);
                        let gx: f32 = gr
                            .iter()
                            .zip(w)
                            .zip(xr)
                            .map(|((g, w), x)| g * w * x)
                            .sum::<f32>()
                            / d as f32;
                        for i in 0..d {
                            dx[r * d + i] += rs * gr[i] * w[i] - xr[i] * rs * rs * rs * gx;
                        }
                        if let Some(dw) = dw.as_deref_mut() {
                            for i in 0..d {
                                dw[i] += gr[i] * xr[i] * rs;
                            }
                        }
                    }
                }
                "rope" => {
                    let (heads, hd, scale, inverse) =
                        (a.usize(3)?, a.usize(4)?, a.f32(5)?, a.int(6)? != 0);
                    let (x, pos, inv_freq) = (
                        wr::<f32>(a.buf(0)?),
                        rd::<i32>(a.buf(1)?),
                        rd::<f32>(a.buf(2)?),
                    );
                    let half = hd / 2;
                    need(kernel, "x", x.len(), rows * heads * hd)?;
                    need(kernel, "pos", pos.len(), rows)?;
                    need(kernel, "inv_freq", inv_freq.len(), half)?;
                    for r in 0..rows {
                        let p = pos[r] as f32;
                        for i in 0..half {
                            let (mut s, c) = (p * inv_freq[i]).sin_cos();
                            s *= scale;
                            let c = c * scale;
                            if inverse {
                                s = -s;
                            }
                            for h in 0..heads {
                                let base = r * heads * hd + h * hd;
                                let (x1, x2) = (x[base + i], x[base + i + half]);
                                x[base + i] = x1 * c - x2 * s;
                                x[base + i + half] = x2 * c + x1 * s;
                            }
                        }
                    }
                }
                "attention_fwd" => self.attention_fwd(&a)?,
                "attention_bwd" => self.attention_bwd(&a)?,
                "ce_chunk_stats" => {
                    let (cw, start) = (a.usize(7)?, a.usize(8)?);
                    let (run_max, run_sum, best_v) = (
                        wr::<f32>(a.buf(0)?),
                        wr::<f32>(a.buf(1)?),
                        wr::<f32>(a.buf(2)?),
                    );
                    let (best_i, label_logit) = (wr::<i32>(a.buf(3)?), wr::<f32>(a.buf(4)?));
                    let (logits, labels) = (rd::<f32>(a.buf(5)?), rd::<i32>(a.buf(6)?));
                    need(
                        kernel,
                        "row stats",
                        run_max
                            .len()
                            .min(run_sum.len())
                            .min(best_v.len())
                            .min(best_i.len())
                            .min(label_logit.len())
                            .min(labels.len()),
                        rows,
                    )?;
                    need(kernel, "logits", logits.len(), rows * cw)?;
                    for r in 0..rows {
                        let lr = &logits[r * cw..(r + 1) * cw];
                        let (mut cmax, mut cidx) = (f32::NEG_INFINITY, 0usize);
                        for (j, &v) in lr.iter().enumerate() {
                            if v > cmax {
                                (cmax, cidx) = (v, j);
                            }
                        }
                        let m_old = run_max[r];
                        let m_new = m_old.max(cmax);
                        let s: f32 = lr.iter().map(|&v| exp_neg(v - m_new)).sum();
                        run_sum[r] = run_sum[r] * exp_neg(m_old - m_new) + s;
                        run_max[r] = m_new;
                        if cmax > best_v[r] {
                            best_v[r] = cmax;
                            best_i[r] = (start + cidx) as i32;
                        }
                        let lab = labels[r];
                        if lab >= start as i32 && (lab as usize) < start + cw {
                            label_logit[r] = lr[lab as usize - start];
                        }
                    }
                }
                "ce_chunk_grad" => {
                    let (cw, start) = (a.usize(5)?, a.usize(6)?);
                    let logits = wr::<f32>(a.buf(0)?);
                    let (run_max, run_sum, labels, scale) = (
                        rd::<f32>(a.buf(1)?),
                        rd::<f32>(a.buf(2)?),
                        rd::<i32>(a.buf(3)?),
                        rd::<f32>(a.buf(4)?),
                    );
                    need(
                        kernel,
                        "row stats",
                        run_max
                            .len()
                            .min(run_sum.len())
                            .min(labels.len())
                            .min(scale.len()),
                        rows,
                    )?;
                    need(kernel, "logits", logits.len(), rows * cw)?;
                    for r in 0..rows {
                        let (m, inv, sc, lab) = (run_max[r], 1.0 / run_sum[r], scale[r], labels[r]);
                        for (j, l) in logits[r * cw..(r + 1) * cw].iter_mut().enumerate() {
                            let p = exp_neg(*l - m) * inv;
                            let g = (p - if (start + j) as i32 == lab { 1.0 } else { 0.0 }) * sc;
                            *l = if g.abs() < 1e-30 { 0.0 } else { g };
                        }
                    }
                }
                "sumsq" => {
                    let n = a.usize(3)?;
                    let (partials, nonfinite, g) = (
                        wr::<f64>(a.buf(0)?),
                        wr::<i32>(a.buf(1)?),
                        rd::<f32>(a.buf(2)?),
                    );
                    need(kernel, "partials", partials.len(), rows)?;
                    need(kernel, "g", g.len(), n)?;
                    // One share (the whole sum, in order), the others zero: sumsq_finish adds
                    // them all as on a GPU.
                    let mut s = 0f64;
                    let mut bad = false;
                    for &x in &g[..n] {
                        if x.is_finite() {
                            s += (x as f64) * (x as f64);
                        } else {
                            bad = true;
                        }
                    }
                    partials[..rows].iter_mut().for_each(|p| *p = 0.0);
                    if rows > 0 {
                        partials[0] = s;
                    }
                    if bad {
                        nonfinite[0] = 1;
                    }
                }
                "sumsq_finish" => {
                    let blocks = a.usize(2)?;
                    let (acc, partials) = (wr::<f64>(a.buf(0)?), rd::<f64>(a.buf(1)?));
                    need(kernel, "partials", partials.len(), blocks)?;
                    acc[0] = partials[..blocks].iter().sum();
                }
                "adam_count" => {
                    let (t, nonfinite) = (wr::<i32>(a.buf(0)?), rd::<i32>(a.buf(1)?));
                    if nonfinite[0] == 0 {
                        t[0] += 1;
                    }
                }
                "adamw" => {
                    let n = a.usize(4)?;
                    let (p, m, v) = (
                        wr::<f32>(a.buf(0)?),
                        wr::<f32>(a.buf(1)?),
                        wr::<f32>(a.buf(2)?),
                    );
                    let (g, acc, nonfinite, t) = (
                        rd::<f32>(a.buf(3)?),
                        rd::<f64>(a.buf(5)?),
                        rd::<i32>(a.buf(6)?),
                        rd::<i32>(a.buf(7)?),
                    );
                    let (max_norm, lr, b1, b2, eps, wd) = (
                        a.f32(8)?,
                        a.f32(9)?,
                        a.f32(10)?,
                        a.f32(11)?,
                        a.f32(12)?,
                        a.f32(13)?,
                    );
                    need(
                        kernel,
                        "buffers",
                        p.len().min(m.len()).min(v.len()).min(g.len()),
                        n,
                    )?;
                    if nonfinite[0] != 0 {
                        return Ok(());
                    }
                    let norm = acc[0].sqrt() as f32;
                    let clip = if max_norm > 0.0 && norm > max_norm {
                        max_norm / norm
                    } else {
                        1.0
                    };
                    let c1 = (1.0 - (b1 as f64).powf(t[0] as f64)) as f32;
                    let c2 = (1.0 - (b2 as f64).powf(t[0] as f64)) as f32;
                    for i in 0..n {
                        let gi = g[i] * clip;
                        m[i] = b1 * m[i] + (1.0 - b1) * gi;
                        v[i] = b2 * v[i] + (1.0 - b2) * gi * gi;
                        let (mh, vh) = (m[i] / c1, v[i] / c2);
                        p[i] -= lr * (mh / (vh.sqrt() + eps) + wd * p[i]);
                    }
                }
                "params_hash" => {
                    let n = a.usize(2)?;
                    let (acc, p) = (wr::<u64>(a.buf(0)?), rd::<f32>(a.buf(1)?));
                    need(kernel, "p", p.len(), n)?;
                    acc[0] = acc[0].wrapping_add(super::ops::params_hash(&p[..n]));
                }
                other => {
                    return Err(GpuError::Invalid(format!(
                        "no kernel named {other} on the CPU device"
                    )))
                }
            }
        }
        Ok(())
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

    /// `attention_fwd` as GEMMs: consecutive query rows that share their second key span
    /// (any 64 rows of a causal sequence; the rows of one DFlash block) form a tile, and
    /// each (tile, head) is `S = Q·Kᵀ` over the union of the tile's keys, the keys a row may
    /// not see masked, a softmax that keeps each row's log-sum-exp, and `O = P·V`. Tiles
    /// are handed to the threads from a shared counter.
    ///
    /// # Safety
    /// As for [`Device::launch`]'s arms.
    unsafe fn attention_fwd(&self, a: &Args) -> Result<()> {
        use crate::compute::cpu::sgemm;
        let (tq, qh, kvh, hd) = (a.usize(6)?, a.usize(7)?, a.usize(8)?, a.usize(9)?);
        let (out, lse) = (wr::<f32>(a.buf(0)?), wr::<f32>(a.buf(1)?));
        let (q, k, v, spans) = (
            rd::<f32>(a.buf(2)?),
            rd::<f32>(a.buf(3)?),
            rd::<f32>(a.buf(4)?),
            rd::<i32>(a.buf(5)?),
        );
        let (qw, kw) = (qh * hd, kvh * hd);
        need(a.kernel, "q/out", q.len().min(out.len()), tq * qw)?;
        need(a.kernel, "lse", lse.len(), tq * qh)?;
        need(a.kernel, "spans", spans.len(), 4 * tq)?;
        let keys = k.len().min(v.len()) / kw.max(1);
        if spans[..4 * tq]
            .chunks_exact(2)
            .any(|r| r[0] < 0 || r[1] < r[0] || r[1] as usize > keys)
        {
            return Err(GpuError::Invalid(format!(
                "{}: a key span is empty-reversed or reaches past the {keys} keys",
                a.kernel
            )));
        }
        let span = |row: usize, r: usize| {
            spans[4 * row + 2 * r] as usize..spans[4 * row + 2 * r + 1] as usize
        };
        let mut tiles = Vec::new();
        let mut lo = 0;
        while lo < tq {
            let mut hi = lo + 1;
            while hi < tq && hi - lo < 64 && span(hi, 1) == span(lo, 1) {
                hi += 1;
            }
            tiles.push(lo..hi);
            lo = hi;
        }
        let jobs: Vec<(std::ops::Range<usize>, usize)> = tiles
            .iter()
            .flat_map(|t| (0..qh).map(move |h| (t.clone(), h)))
            .collect();
        let scale = 1.0 / (hd as f32).sqrt();
        let group = qh / kvh;
        let (outp, lsep) = (Shared(out.as_mut_ptr()), Shared(lse.as_mut_ptr()));
        let next = std::sync::atomic::AtomicUsize::new(0);
        let run = || {
            let (outp, lsep) = (outp, lsep);
            let mut sc: Vec<f32> = Vec::new();
            while let Some((tile, head)) =
                jobs.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
            {
                let kh = head / group;
                let rows = tile.len();
                let a_lo = tile.clone().map(|r| span(r, 0).start).min().unwrap_or(0);
                let a_hi = tile
                    .clone()
                    .map(|r| span(r, 0).end)
                    .max()
                    .unwrap_or(0)
                    .max(a_lo);
                let b = span(tile.start, 1);
                let (ka, nk) = (a_hi - a_lo, a_hi - a_lo + b.len());
                sc.clear();
                sc.resize(rows * nk, 0.0);
                let qp = q[tile.start * qw + head * hd..].as_ptr();
                // SAFETY (the GEMMs): every operand lies inside the buffers checked above;
                // this job alone writes rows `tile` of head `head` in out and lse.
                if ka > 0 {
                    sgemm(
                        gemm::Parallelism::None,
                        rows,
                        ka,
                        hd,
                        sc.as_mut_ptr(),
                        nk,
                        1,
                        false,
                        qp,
                        qw,
                        1,
                        k[a_lo * kw + kh * hd..].as_ptr(),
                        1,
                        kw as isize,
                    );
                }
                if !b.is_empty() {
                    sgemm(
                        gemm::Parallelism::None,
                        rows,
                        b.len(),
                        hd,
                        sc.as_mut_ptr().add(ka),
                        nk,
                        1,
                        false,
                        qp,
                        qw,
                        1,
                        k[b.start * kw + kh * hd..].as_ptr(),
                        1,
                        kw as isize,
                    );
                }
                for (r, srow) in sc.chunks_exact_mut(nk).enumerate() {
                    let own = span(tile.start + r, 0);
                    let mut max = f32::NEG_INFINITY;
                    for (c, sv) in srow.iter_mut().enumerate() {
                        if c >= ka || own.contains(&(a_lo + c)) {
                            *sv *= scale;
                            max = max.max(*sv);
                        } else {
                            *sv = f32::NEG_INFINITY;
                        }
                    }
                    let at = (tile.start + r) * qh + head;
                    if max == f32::NEG_INFINITY {
                        // No key: output 0, log-sum-exp −∞.
                        srow.fill(0.0);
                        *lsep.0.add(at) = f32::NEG_INFINITY;
                        continue;
                    }
                    srow.iter_mut().for_each(|sv| *sv = exp_neg(*sv - max));
                    let sum: f32 = srow.iter().sum();
                    let inv = 1.0 / sum;
                    srow.iter_mut().for_each(|sv| *sv *= inv);
                    *lsep.0.add(at) = max + sum.ln();
                }
                let op = outp.0.add(tile.start * qw + head * hd);
                if ka > 0 {
                    sgemm(
                        gemm::Parallelism::None,
                        rows,
                        hd,
                        ka,
                        op,
                        qw,
                        1,
                        false,
                        sc.as_ptr(),
                        nk,
                        1,
                        v[a_lo * kw + kh * hd..].as_ptr(),
                        kw as isize,
                        1,
                    );
                }
                if !b.is_empty() {
                    sgemm(
                        gemm::Parallelism::None,
                        rows,
                        hd,
                        b.len(),
                        op,
                        qw,
                        1,
                        ka > 0,
                        sc.as_ptr().add(ka),
                        nk,
                        1,
                        v[b.start * kw + kh * hd..].as_ptr(),
                        kw as isize,
                        1,
                    );
                }
                if nk == 0 {
                    for r in tile.clone() {
                        std::slice::from_raw_parts_mut(outp.0.add(r * qw + head * hd), hd)
                            .fill(0.0);
                        *lsep.0.add(r * qh + head) = f32::NEG_INFINITY;
                    }
                }
            }
        };
        let threads = self.threads.min(jobs.len()).max(1);
        if threads == 1 || attention_work(tq, qw, &span) < PAR_WORK {
            run();
        } else {
            // Each thread pulls jobs until none is left; where a thread cannot be started
            // (a thread limit), the calling thread pulls them instead.
            dflash_shared::threads::scoped((0..threads).map(|_| run));
        }
        Ok(())
    }

    /// `attention_bwd` from the saved log-sum-exp, as GEMMs over the forward's tiles: per
    /// (tile, head) the probabilities are recomputed (`P = exp(S − lse)`), `dP = dO·Vᵀ`,
    /// `dS = P∘(dP − rowsum(dO∘O))·scale`, then `dQ += dS·K`, `dK += dSᵀ·Q`, `dV += Pᵀ·dO`.
    /// Work is split by KV head: each thread owns its KV heads' rows of dk and dv and the
    /// dq of the query heads that read them, and adds into them tile after tile in order —
    /// the same bits on every run.
    ///
    /// # Safety
    /// As for [`Device::launch`]'s arms.
    unsafe fn attention_bwd(&self, a: &Args) -> Result<()> {
        use crate::compute::cpu::{dot, sgemm};
        let (tq, qh, kvh, hd) = (a.usize(10)?, a.usize(11)?, a.usize(12)?, a.usize(13)?);
        let (dq, dk, dv) = (
            wr::<f32>(a.buf(0)?),
            wr::<f32>(a.buf(1)?),
            wr::<f32>(a.buf(2)?),
        );
        let (dout, out, lse) = (
            rd::<f32>(a.buf(3)?),
            rd::<f32>(a.buf(4)?),
            rd::<f32>(a.buf(5)?),
        );
        let (q, k, v, spans) = (
            rd::<f32>(a.buf(6)?),
            rd::<f32>(a.buf(7)?),
            rd::<f32>(a.buf(8)?),
            rd::<i32>(a.buf(9)?),
        );
        let (qw, kw) = (qh * hd, kvh * hd);
        need(
            a.kernel,
            "q/dq/dout/out",
            q.len().min(dq.len()).min(dout.len()).min(out.len()),
            tq * qw,
        )?;
        need(a.kernel, "lse", lse.len(), tq * qh)?;
        need(a.kernel, "spans", spans.len(), 4 * tq)?;
        let keys = k.len().min(v.len()).min(dk.len()).min(dv.len()) / kw.max(1);
        if spans[..4 * tq]
            .chunks_exact(2)
            .any(|r| r[0] < 0 || r[1] < r[0] || r[1] as usize > keys)
        {
            return Err(GpuError::Invalid(format!(
                "{}: a key span is reversed or reaches past the {keys} keys",
                a.kernel
            )));
        }
        let span = |row: usize, r: usize| {
            spans[4 * row + 2 * r] as usize..spans[4 * row + 2 * r + 1] as usize
        };
        let mut tiles = Vec::new();
        let mut lo = 0;
        while lo < tq {
            let mut hi = lo + 1;
            while hi < tq && hi - lo < 64 && span(hi, 1) == span(lo, 1) {
                hi += 1;
            }
            tiles.push(lo..hi);
            lo = hi;
        }
        let scale = 1.0 / (hd as f32).sqrt();
        let group = qh / kvh;
        let (dqp, dkp, dvp) = (
            Shared(dq.as_mut_ptr()),
            Shared(dk.as_mut_ptr()),
            Shared(dv.as_mut_ptr()),
        );
        let none = gemm::Parallelism::None;
        let threads = if attention_work(tq, qw, &span) < PAR_WORK {
            1
        } else {
            self.threads
        };
        par_ranges(threads, kvh, |khs| {
            let (dqp, dkp, dvp) = (dqp, dkp, dvp);
            let (mut p, mut ds) = (Vec::<f32>::new(), Vec::<f32>::new());
            for kh in khs {
                for tile in &tiles {
                    let rows = tile.len();
                    let a_lo = tile.clone().map(|r| span(r, 0).start).min().unwrap_or(0);
                    let a_hi = tile
                        .clone()
                        .map(|r| span(r, 0).end)
                        .max()
                        .unwrap_or(0)
                        .max(a_lo);
                    let b = span(tile.start, 1);
                    let (ka, nk) = (a_hi - a_lo, a_hi - a_lo + b.len());
                    if nk == 0 {
                        continue;
                    }
                    for head in kh * group..(kh + 1) * group {
                        p.clear();
                        p.resize(rows * nk, 0.0);
                        ds.clear();
                        ds.resize(rows * nk, 0.0);
                        let qp = q[tile.start * qw + head * hd..].as_ptr();
                        let gp = dout[tile.start * qw + head * hd..].as_ptr();
                        // S into p, dP into ds: the key ranges side by side.
                        for (ko, kn, col) in [(a_lo, ka, 0usize), (b.start, b.len(), ka)] {
                            if kn == 0 {
                                continue;
                            }
                            sgemm(
                                none,
                                rows,
                                kn,
                                hd,
                                p.as_mut_ptr().add(col),
                                nk,
                                1,
                                false,
                                qp,
                                qw,
                                1,
                                k[ko * kw + kh * hd..].as_ptr(),
                                1,
                                kw as isize,
                            );
                            sgemm(
                                none,
                                rows,
                                kn,
                                hd,
                                ds.as_mut_ptr().add(col),
                                nk,
                                1,
                                false,
                                gp,
                                qw,
                                1,
                                v[ko * kw + kh * hd..].as_ptr(),
                                1,
                                kw as isize,
                            );
                        }
                        for r in 0..rows {
                            let row = tile.start + r;
                            let l = lse[row * qh + head];
                            let (prow, drow) =
                                (&mut p[r * nk..(r + 1) * nk], &mut ds[r * nk..(r + 1) * nk]);
                            if l == f32::NEG_INFINITY {
                                prow.fill(0.0);
                                drow.fill(0.0);
                                continue;
                            }
                            let at = row * qw + head * hd;
                            let dd = dot(&dout[at..at + hd], &out[at..at + hd]);
                            let own = span(row, 0);
                            for c in 0..nk {
                                if c < ka && !own.contains(&(a_lo + c)) {
                                    prow[c] = 0.0;
                                    drow[c] = 0.0;
                                } else {
                                    let pc = exp_neg(prow[c] * scale - l);
                                    prow[c] = pc;
                                    drow[c] = pc * (drow[c] - dd) * scale;
                                }
                            }
                        }
                        // SAFETY: dq rows `tile` of head `head`, and dk/dv of KV head kh, are
                        // this thread's alone.
                        let dqo = dqp.0.add(tile.start * qw + head * hd);
                        for (ko, kn, col) in [(a_lo, ka, 0usize), (b.start, b.len(), ka)] {
                            if kn == 0 {
                                continue;
                            }
                            sgemm(
                                none,
                                rows,
                                hd,
                                kn,
                                dqo,
                                qw,
                                1,
                                true,
                                ds.as_ptr().add(col),
                                nk,
                                1,
                                k[ko * kw + kh * hd..].as_ptr(),
                                kw as isize,
                                1,
                            );
                            sgemm(
                                none,
                                kn,
                                hd,
                                rows,
                                dkp.0.add(ko * kw + kh * hd),
                                kw,
                                1,
                                true,
                                ds.as_ptr().add(col),
                                1,
                                nk as isize,
                                qp,
                                qw as isize,
                                1,
                            );
                            sgemm(
                                none,
                                kn,
                                hd,
                                rows,
                                dvp.0.add(ko * kw + kh * hd),
                                kw,
                                1,
                                true,
                                p.as_ptr().add(col),
                                1,
                                nk as isize,
                                gp,
                                qw as isize,
                                1,
                            );
                        }
                    }
                }
            }
        });
        Ok(())
    }
}
