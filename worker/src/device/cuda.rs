//! The [`Device`] layer on a real GPU, through cudarc with every library loaded at run
//! time. [`CudaDevice::open`] checks each library before touching it (cudarc panics when
//! libcuda is missing) and turns an unusable GPU into [`GpuError::Unavailable`], which the
//! worker reports with the "permanent: do not restart" exit code.
//!
//! Kernels come from `cuda/kernels.cu` through NVRTC (cached, see [`super::nvrtc`]) for the
//! device's compute capability; GEMMs from cuBLAS (f32, column-major, the same contract the
//! host device implements). Raw device addresses ([`DevPtr`]) are used throughout: memory
//! is one arena per worker, so nothing here owns a `CudaSlice` but the arena's backing.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaStream, LaunchConfig, PushKernelArg,
};

use super::{
    Arg, DSlice, DevPtr, Device, Event, EventTable, Gemm, GpuError, Kernel, Result, Stream,
};

fn failed(what: &str, e: impl std::fmt::Debug) -> GpuError {
    GpuError::failed(what)(e)
}

/// Which CUDA library is missing, if any, with where it was looked for.
pub fn missing_library() -> Option<String> {
    use super::libs::{open, CudaLib};
    for lib in [CudaLib::Driver, CudaLib::Cublas] {
        if let Err(e) = open(lib) {
            return Some(e.to_string());
        }
    }
    // SAFETY: each call only tries to dlopen its library (found above by its soname).
    unsafe {
        if !cudarc::driver::sys::is_culib_present() {
            return Some(
                "libcuda was loaded, but not under a soname cudarc looks for (libcuda.so.1)".into(),
            );
        }
        if !cudarc::cublas::sys::is_culib_present() {
            return Some(
                "cuBLAS was loaded, but not under a soname cudarc looks for (libcublas.so.13)"
                    .into(),
            );
        }
    }
    // NVRTC only where the kernels are not in the cache (`load_kernels` says so then).
    None
}

/// `major.minor` of a CUDA version number (12080 → "12.8").
fn cuda_version(v: i32) -> String {
    format!("{}.{}", v / 1000, v % 1000 / 10)
}

pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    streams: [Arc<CudaStream>; 2],
    /// One cuBLAS handle per stream: a handle's workspace is shared by all its GEMMs, so
    /// one handle serving both streams could run two GEMMs at once on one workspace.
    blas: [cudarc::cublas::CudaBlas; 2],
    functions: HashMap<String, CudaFunction>,
    /// The backing of every `alloc` (the arena's): `cuMemAlloc`, not stream-ordered, so
    /// both streams may use it at once.
    memory: Vec<DevPtr>,
    registered: Vec<*mut u8>,
    events: EventTable<CudaEvent>,
    name: String,
    /// What was loaded from where, with versions (printed at start).
    pub libraries: Vec<String>,
}

// SAFETY: cudarc's handles are Send; the raw pointers are host ranges registered with the
// driver, only used as addresses.
unsafe impl Send for CudaDevice {}

/// How the kernels were loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelImage {
    Cubin,
    Ptx,
}

impl CudaDevice {
    /// The worker's GPU (ordinal 0: `CUDA_VISIBLE_DEVICES` names only it).
    pub fn open() -> Result<CudaDevice> {
        CudaDevice::open_ordinal(0)
    }

    /// GPU `ordinal` of those `CUDA_VISIBLE_DEVICES` names (a target worker holding
    /// several: `--gpus-per-target`).
    pub fn open_ordinal(ordinal: usize) -> Result<CudaDevice> {
        if let Some(m) = missing_library() {
            return Err(GpuError::Unavailable(m));
        }
        let ctx = blocking_primary_context(ordinal).map_err(|e| {
            use cudarc::driver::sys::CUresult;
            let call = "cannot open the GPU (cuInit/cuDevicePrimaryCtxRetain)";
            // Out of memory or held by another process (exclusive mode): may pass later.
            if matches!(
                e.0,
                CUresult::CUDA_ERROR_OUT_OF_MEMORY | CUresult::CUDA_ERROR_DEVICE_UNAVAILABLE
            ) {
                GpuError::failed(call)(e)
            } else {
                GpuError::Unavailable(format!("{call}: {e:?}"))
            }
        })?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| failed("compute capability", e))?;
        let name = ctx.name().unwrap_or_else(|_| "GPU".into());
        if major < 8 {
            return Err(GpuError::Unavailable(format!(
                "{name} is sm_{major}{minor}: the kernels need sm_80 or newer (bf16, f64 atomics)"
            )));
        }
        let compute = ctx
            .new_stream()
            .map_err(|e| failed("creating the compute stream", e))?;
        let copy = ctx
            .new_stream()
            .map_err(|e| failed("creating the copy stream", e))?;
        let blas = [
            cudarc::cublas::CudaBlas::new(compute.clone())
                .map_err(|e| failed("creating the compute stream's cuBLAS handle", e))?,
            cudarc::cublas::CudaBlas::new(copy.clone())
                .map_err(|e| failed("creating the copy stream's cuBLAS handle", e))?,
        ];
        let arch = format!("sm_{major}{minor}");
        let mut driver = 0;
        // SAFETY: writes one int.
        unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver) }
            .result()
            .map_err(|e| failed("cuDriverGetVersion", e))?;
        let (module, image) = load_kernels(&ctx, &arch, driver)?;
        let functions = load_functions(&module)?;
        let mut blas_version = 0;
        // SAFETY: a live handle; writes one int.
        let blas_version = match unsafe {
            cudarc::cublas::sys::cublasGetVersion_v2(*blas[0].handle(), &mut blas_version)
        } {
            cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS => format!(
                "{}.{}.{}",
                blas_version / 10000,
                blas_version % 10000 / 100,
                blas_version % 100
            ),
            other => format!("version unknown: {other:?}"),
        };
        let nvrtc = super::nvrtc::version()
            .map(|(a, b)| format!("{a}.{b}"))
            .unwrap_or_else(|e| e.to_string());
        use super::libs::CudaLib;
        let mut libraries = super::libs::report(&[
            (
                CudaLib::Driver,
                format!("driver for CUDA {}", cuda_version(driver)),
            ),
            (CudaLib::Cublas, blas_version),
            (CudaLib::Nvrtc, nvrtc),
        ]);
        libraries.push(format!(
            "kernels: {} for {arch}",
            if image == KernelImage::Cubin {
                "CUBIN"
            } else {
                "PTX (JIT-compiled by the driver)"
            }
        ));
        Ok(CudaDevice {
            ctx,
            streams: [compute, copy],
            blas,
            functions,
            memory: Vec::new(),
            registered: Vec::new(),
            events: EventTable::default(),
            name: format!("{name} ({arch})"),
            libraries,
        })
    }

    /// The raw (`result`/`sys`) calls do not bind the context themselves; the worker may
    /// load on one thread and compute on another.
    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| failed("cuCtxSetCurrent", e))
    }

    fn stream(&self, s: Stream) -> &Arc<CudaStream> {
        &self.streams[s.index()]
    }
}

/// The GPU's primary context, made to block a host thread that waits for the GPU
/// (`CU_CTX_SCHED_BLOCKING_SYNC`). The driver's default spins: a worker waiting on its
/// GPU would hold a core at 100 %, and 16 workers on 8 GPUs would take every core the
/// supervisor's data path needs. Events are made blocking too ([`BLOCKING_EVENT`]).
fn blocking_primary_context(
    ordinal: usize,
) -> std::result::Result<Arc<CudaContext>, cudarc::driver::DriverError> {
    use cudarc::driver::sys;
    // SAFETY: plain driver calls before the context exists; each writes what it names.
    unsafe {
        sys::cuInit(0).result()?;
        let mut dev: sys::CUdevice = 0;
        sys::cuDeviceGet(&mut dev, ordinal as i32).result()?;
        sys::cuDevicePrimaryCtxSetFlags_v2(
            dev,
            sys::CUctx_flags::CU_CTX_SCHED_BLOCKING_SYNC as u32,
        )
        .result()?;
    }
    CudaContext::new(ordinal)
}

/// The flag of every event the device records: a host thread that waits for one sleeps
/// instead of spinning (without it `cuEventSynchronize` busy-waits whatever the context's
/// flags). cudarc takes one flag, so these events keep timing enabled (cudarc's default
/// would have disabled it), a small cost on a record.
const BLOCKING_EVENT: cudarc::driver::sys::CUevent_flags =
    cudarc::driver::sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC;

/// The kernels for `arch`: the CUBIN, which any driver that knows the GPU runs; the PTX
/// only when the CUBIN is refused, and then with both versions named when the driver is
/// older than the PTX. A compile or load failure repeats on every restart: permanent.
fn load_kernels(
    ctx: &Arc<CudaContext>,
    arch: &str,
    driver: i32,
) -> Result<(Arc<cudarc::driver::CudaModule>, KernelImage)> {
    let permanent = |e: GpuError| match e {
        e @ GpuError::Failed { .. } => GpuError::Unavailable(e.to_string()),
        other => other,
    };
    let (kernels, _) = super::nvrtc::compile_cached_reusing(
        super::nvrtc::KERNELS_CU,
        arch,
        &super::nvrtc::cache_dir(),
        super::nvrtc::Reuse::AnyNvrtc,
    )
    .map_err(permanent)?;
    let mut kernels = kernels;
    let mut cubin_err = if kernels.cubin.is_empty() {
        "NVRTC made no CUBIN".to_string()
    } else {
        match ctx.load_module(cudarc::nvrtc::Ptx::from_binary(kernels.cubin.clone())) {
            Ok(m) => return Ok((m, KernelImage::Cubin)),
            Err(e) => format!("{e:?}"),
        }
    };
    // A cached CUBIN that another NVRTC made (the bundle's, say) and this driver refuses:
    // this machine's NVRTC, where there is one, makes its own before the PTX is tried.
    if let Ok((local, _)) =
        super::nvrtc::compile_cached(super::nvrtc::KERNELS_CU, arch, &super::nvrtc::cache_dir())
    {
        if !local.cubin.is_empty() && local.cubin != kernels.cubin {
            match ctx.load_module(cudarc::nvrtc::Ptx::from_binary(local.cubin.clone())) {
                Ok(m) => return Ok((m, KernelImage::Cubin)),
                Err(e) => cubin_err = format!("{cubin_err}; this NVRTC's CUBIN too: {e:?}"),
            }
        }
        kernels = local;
    }
    let isa = kernels
        .ptx_isa()
        .map(|(a, b)| format!("{a}.{b}"))
        .unwrap_or_else(|| "?".into());
    let nvrtc = super::nvrtc::version()
        .map(|(a, b)| format!("{a}.{b}"))
        .unwrap_or_else(|_| "?".into());
    match ctx.load_module(cudarc::nvrtc::Ptx::from_src(kernels.ptx)) {
        Ok(m) => {
            println!("the kernels' CUBIN for {arch} was refused ({cubin_err}); loaded their PTX (ISA {isa}) instead");
            Ok((m, KernelImage::Ptx))
        }
        Err(e) => {
            Err(GpuError::Unavailable(format!(
                "cannot load the kernels for {arch}: the CUBIN was refused ({cubin_err}), and the PTX (ISA {isa}, from NVRTC {nvrtc}) too ({e:?}); this driver is for CUDA {}: update the driver, or use an NVRTC no newer than CUDA {} (DFLASH_NVRTC_LIB)",
                cuda_version(driver),
                cuda_version(driver)
            )))
        }
    }
}

/// A GEMM's sizes as cuBLAS takes them (`int`): a size that does not fit is refused, never
/// truncated (a parameter count as the `n` of an n×1×1 GEMM can pass 2^31).
pub fn cublas_dims(g: &Gemm) -> Result<[i32; 6]> {
    let c = |v: usize, what: &str| {
        i32::try_from(v).map_err(|_| {
            GpuError::Invalid(format!(
                "gemm: {what} = {v} exceeds cuBLAS's int range ({g:?})"
            ))
        })
    };
    Ok([
        c(g.m, "m")?,
        c(g.n, "n")?,
        c(g.k, "k")?,
        c(g.lda, "lda")?,
        c(g.ldb, "ldb")?,
        c(g.ldc, "ldc")?,
    ])
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        let _ = self.ctx.synchronize();
        for p in self.memory.drain(..) {
            // SAFETY: allocated in `alloc`; both streams are idle.
            let _ = unsafe { cudarc::driver::result::free_sync(p) };
        }
        for p in self.registered.drain(..) {
            // SAFETY: registered in `register_host`.
            unsafe { cudarc::driver::sys::cuMemHostUnregister(p.cast()) };
        }
    }
}

impl Device for CudaDevice {
    fn describe(&self) -> String {
        self.name.clone()
    }

    fn event_done(&mut self, e: Event) -> Result<bool> {
        // Not ready is "not yet"; any other error (a failed kernel or all-reduce, sticky) is
        // an error, not a wait that never ends.
        self.events
            .get(e)?
            .try_is_complete()
            .map_err(|e| failed("cuEventQuery", e))
    }

    fn cuda_handles(&self) -> Option<(Arc<CudaContext>, [cudarc::driver::sys::CUstream; 2])> {
        Some((
            self.ctx.clone(),
            [self.streams[0].cu_stream(), self.streams[1].cu_stream()],
        ))
    }

    fn alloc(&mut self, bytes: usize) -> Result<DevPtr> {
        self.bind()?;
        // cuMemAlloc, not cuMemAllocAsync: memory from a stream-ordered allocation may only
        // be used on another stream once ordered after it, and the arena serves both.
        // SAFETY: a plain allocation, freed in Drop.
        let ptr = unsafe { cudarc::driver::result::malloc_sync(bytes.max(1)) }.map_err(|e| {
            GpuError::OutOfMemory {
                what: format!("cuMemAlloc ({e:?})"),
                requested: bytes,
                free_of: None,
            }
        })?;
        self.memory.push(ptr);
        // Zeroed before anything may use it (fresh device memory is garbage).
        let st = self.streams[0].cu_stream();
        // SAFETY: the allocation just made.
        unsafe { cudarc::driver::result::memset_d8_async(ptr, 0, bytes, st) }
            .map_err(|e| failed("cuMemsetD8Async", e))?;
        self.streams[0]
            .synchronize()
            .map_err(|e| failed("cuStreamSynchronize", e))?;
        Ok(ptr)
    }

    fn mem_info(&self) -> Result<(usize, usize)> {
        self.ctx
            .mem_get_info()
            .map_err(|e| failed("cuMemGetInfo", e))
    }

    fn upload(&mut self, s: Stream, dst: DSlice, src: &[u8]) -> Result<()> {
        self.bind()?;
        if src.len() > dst.bytes {
            return Err(GpuError::Invalid(format!(
                "upload of {} bytes into {}",
                src.len(),
                dst.bytes
            )));
        }
        let st = self.stream(s).cu_stream();
        // SAFETY: dst is device memory of at least src.len() bytes; a pageable source is
        // staged by the driver before the call returns.
        unsafe { cudarc::driver::result::memcpy_htod_async(dst.ptr, src, st) }
            .map_err(|e| failed("cuMemcpyHtoDAsync", e))
    }

    fn download(&mut self, s: Stream, src: DSlice, dst: &mut [u8]) -> Result<()> {
        self.bind()?;
        if dst.len() > src.bytes {
            return Err(GpuError::Invalid(format!(
                "download of {} bytes from {}",
                dst.len(),
                src.bytes
            )));
        }
        let st = self.stream(s).clone();
        // SAFETY: src is device memory of at least dst.len() bytes.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(dst, src.ptr, st.cu_stream()) }
            .map_err(|e| failed("cuMemcpyDtoHAsync", e))?;
        st.synchronize()
            .map_err(|e| failed("cuStreamSynchronize", e))
    }

    unsafe fn download_async(&mut self, s: Stream, src: DSlice, dst: *mut u8) -> Result<()> {
        self.bind()?;
        let st = self.stream(s).cu_stream();
        let dst = std::slice::from_raw_parts_mut(dst, src.bytes);
        cudarc::driver::result::memcpy_dtoh_async(dst, src.ptr, st)
            .map_err(|e| failed("cuMemcpyDtoHAsync", e))
    }

    unsafe fn upload_async(&mut self, s: Stream, dst: DSlice, src: *const u8) -> Result<()> {
        self.bind()?;
        let st = self.stream(s).cu_stream();
        let src = std::slice::from_raw_parts(src, dst.bytes);
        cudarc::driver::result::memcpy_htod_async(dst.ptr, src, st)
            .map_err(|e| failed("cuMemcpyHtoDAsync", e))
    }

    unsafe fn register_host(&mut self, ptr: *mut u8, bytes: usize) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| failed("binding the context", e))?;
        cudarc::driver::sys::cuMemHostRegister_v2(
            ptr.cast(),
            bytes,
            cudarc::driver::sys::CU_MEMHOSTREGISTER_PORTABLE,
        )
        .result()
        .map_err(|e| failed("cuMemHostRegister", e))?;
        self.registered.push(ptr);
        Ok(())
    }

    fn memset_zero(&mut self, s: Stream, dst: DSlice) -> Result<()> {
        self.bind()?;
        let st = self.stream(s).cu_stream();
        // SAFETY: dst is device memory.
        unsafe { cudarc::driver::result::memset_d8_async(dst.ptr, 0, dst.bytes, st) }
            .map_err(|e| failed("cuMemsetD8Async", e))
    }

    fn launch(&mut self, s: Stream, k: &Kernel, grid: u32, block: u32) -> Result<()> {
        self.launch_shared(
            s,
            k.name(),
            grid,
            block,
            k.dynamic_shared_bytes(),
            &k.args(),
        )
    }

    fn gemm(&mut self, s: Stream, g: &Gemm) -> Result<()> {
        self.bind()?;
        g.validate()?;
        let [m, n, k, lda, ldb, ldc] = cublas_dims(g)?;
        use cudarc::cublas::sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        // The stream's own handle, bound to it once at creation.
        let handle = *self.blas[s.index()].handle();
        let op = |t: bool| if t { CUBLAS_OP_T } else { CUBLAS_OP_N };
        if g.bf16_inputs {
            use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cudaDataType_t};
            // SAFETY: as below; bf16 A and B, f32 or bf16 C, f32 accumulation (tensor cores).
            return unsafe {
                cudarc::cublas::result::gemm_ex(
                    handle,
                    op(g.transa),
                    op(g.transb),
                    m,
                    n,
                    k,
                    (&g.alpha as *const f32).cast(),
                    g.a.ptr as *const std::ffi::c_void,
                    cudaDataType_t::CUDA_R_16BF,
                    lda,
                    g.b.ptr as *const std::ffi::c_void,
                    cudaDataType_t::CUDA_R_16BF,
                    ldb,
                    (&g.beta as *const f32).cast(),
                    g.c.ptr as *mut std::ffi::c_void,
                    if g.bf16_output {
                        cudaDataType_t::CUDA_R_16BF
                    } else {
                        cudaDataType_t::CUDA_R_32F
                    },
                    ldc,
                    cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .map_err(|e| failed("cublasGemmEx (bf16)", e));
        }
        // SAFETY: operands validated against their shapes; the handle is bound to `s`.
        unsafe {
            cudarc::cublas::result::sgemm(
                handle,
                op(g.transa),
                op(g.transb),
                m,
                n,
                k,
                &g.alpha,
                g.a.ptr as *const f32,
                lda,
                g.b.ptr as *const f32,
                ldb,
                &g.beta,
                g.c.ptr as *mut f32,
                ldc,
            )
        }
        .map_err(|e| failed("cublasSgemm", e))
    }

    fn record(&mut self, s: Stream) -> Result<Event> {
        let e = self
            .stream(s)
            .record_event(Some(BLOCKING_EVENT))
            .map_err(|e| failed("cuEventRecord", e))?;
        Ok(self.events.insert(e))
    }

    fn wait(&mut self, s: Stream, e: Event) -> Result<()> {
        let ev = self.events.get(e)?;
        self.stream(s)
            .wait(ev)
            .map_err(|e| failed("cuStreamWaitEvent", e))
    }

    fn sync_event(&mut self, e: Event) -> Result<()> {
        let ev = self.events.get(e)?;
        ev.synchronize()
            .map_err(|e| failed("cuEventSynchronize", e))
    }

    fn sync(&mut self) -> Result<()> {
        for s in &self.streams {
            s.synchronize()
                .map_err(|e| failed("cuStreamSynchronize", e))?;
        }
        Ok(())
    }

    fn release_event(&mut self, e: Event) {
        // cuEventDestroy of an event not yet complete frees it once it completes.
        self.events.release(e);
    }
}

/// Every kernel of kernels.cu from the loaded module, each allowed the dynamic shared
/// memory it is launched with (past 48 KB only when told).
fn load_functions(
    module: &Arc<cudarc::driver::CudaModule>,
) -> Result<HashMap<String, CudaFunction>> {
    use cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES as MAX_DYNAMIC;
    let mut functions = HashMap::new();
    for k in super::nvrtc::kernel_names(super::nvrtc::KERNELS_CU) {
        let f = module
            .load_function(&k)
            .map_err(|e| failed(&format!("kernel {k}"), e))?;
        let dynamic = Kernel::dynamic_shared_bytes_of(&k);
        if dynamic > 48 * 1024 {
            f.set_attribute(MAX_DYNAMIC, dynamic as i32).map_err(|e| {
                failed(
                    &format!("letting kernel {k} have {dynamic} bytes of dynamic shared memory"),
                    e,
                )
            })?;
        }
        functions.insert(k, f);
    }
    Ok(functions)
}

impl CudaDevice {
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
        self.launch_shared(s, kernel, grid, block, 0, args)
    }

    /// [`launch_args`](Self::launch_args) with `shared` bytes of dynamic shared memory.
    pub fn launch_shared(
        &mut self,
        s: Stream,
        kernel: &str,
        grid: u32,
        block: u32,
        shared: u32,
        args: &[Arg],
    ) -> Result<()> {
        if grid == 0 {
            // Nothing to do (cuLaunchKernel would reject a zero grid); as the host device.
            return Ok(());
        }
        let f = self
            .functions
            .get(kernel)
            .ok_or_else(|| GpuError::Invalid(format!("no kernel named {kernel}")))?
            .clone();
        let stream = self.stream(s).clone();
        // Every argument's value lives in one of these until the launch is queued.
        let mut ptrs: Vec<u64> = Vec::new();
        let mut ints: Vec<i32> = Vec::new();
        let mut longs: Vec<i64> = Vec::new();
        let mut uints: Vec<u32> = Vec::new();
        let mut floats: Vec<f32> = Vec::new();
        for a in args {
            match *a {
                Arg::R(b) | Arg::W(b) | Arg::RW(b) => ptrs.push(b.ptr),
                Arg::Null => ptrs.push(0),
                Arg::I32(v) => ints.push(v),
                Arg::I64(v) => longs.push(v),
                Arg::U32(v) => uints.push(v),
                Arg::F32(v) => floats.push(v),
            }
        }
        let mut b = stream.launch_builder(&f);
        let (mut ip, mut ii, mut il, mut iu, mut ifl) = (0, 0, 0, 0, 0);
        for a in args {
            match a {
                Arg::R(_) | Arg::W(_) | Arg::RW(_) | Arg::Null => {
                    b.arg(&ptrs[ip]);
                    ip += 1;
                }
                Arg::I32(_) => {
                    b.arg(&ints[ii]);
                    ii += 1;
                }
                Arg::I64(_) => {
                    b.arg(&longs[il]);
                    il += 1;
                }
                Arg::U32(_) => {
                    b.arg(&uints[iu]);
                    iu += 1;
                }
                Arg::F32(_) => {
                    b.arg(&floats[ifl]);
                    ifl += 1;
                }
            }
        }
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (block, 1, 1),
            shared_mem_bytes: shared,
        };
        // SAFETY: the arguments match the kernel's parameters (the ops layer's contract,
        // checked against the CPU backend on the host device).
        unsafe { b.launch(cfg) }.map_err(|e| failed(&format!("launching {kernel}"), e))?;
        Ok(())
    }
}
