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

use cudarc::driver::{CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};

use super::{Arg, DSlice, DevPtr, Device, Event, EventTable, Gemm, GpuError, Result, Stream};

fn failed(what: &str, e: impl std::fmt::Debug) -> GpuError {
    GpuError::Failed(format!("{what}: {e:?}"))
}

/// Which CUDA library is missing, if any, with where it was looked for.
pub fn missing_library() -> Option<String> {
    let look = "on the loader's path (LD_LIBRARY_PATH, ldconfig)";
    // SAFETY: each call only tries to dlopen its library.
    unsafe {
        if !cudarc::driver::sys::is_culib_present() {
            return Some(format!("libcuda.so.1 (the NVIDIA driver) not found {look}"));
        }
        if !cudarc::cublas::sys::is_culib_present() {
            return Some(format!("libcublas.so (cuBLAS) not found {look}"));
        }
    }
    super::nvrtc::load().err().map(|e| e.to_string())
}

pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    streams: [Arc<CudaStream>; 2],
    blas: cudarc::cublas::CudaBlas,
    functions: HashMap<String, CudaFunction>,
    /// The backing of every `alloc` (the arena's), kept alive here.
    memory: Vec<CudaSlice<u8>>,
    registered: Vec<*mut u8>,
    events: EventTable<CudaEvent>,
    name: String,
}

// SAFETY: cudarc's handles are Send; the raw pointers are host ranges registered with the
// driver, only used as addresses.
unsafe impl Send for CudaDevice {}

impl CudaDevice {
    /// The worker's GPU (ordinal 0: `CUDA_VISIBLE_DEVICES` names only it).
    pub fn open() -> Result<CudaDevice> {
        if let Some(m) = missing_library() {
            return Err(GpuError::Unavailable(m));
        }
        let ctx = CudaContext::new(0).map_err(|e| {
            use cudarc::driver::sys::CUresult;
            let msg = format!("cannot open the GPU (cuInit/cuDevicePrimaryCtxRetain): {e:?}");
            // Out of memory or held by another process (exclusive mode): may pass later.
            if matches!(e.0, CUresult::CUDA_ERROR_OUT_OF_MEMORY | CUresult::CUDA_ERROR_DEVICE_UNAVAILABLE) {
                GpuError::Failed(msg)
            } else {
                GpuError::Unavailable(msg)
            }
        })?;
        let (major, minor) = ctx.compute_capability().map_err(|e| failed("compute capability", e))?;
        let name = ctx.name().unwrap_or_else(|_| "GPU".into());
        if major < 8 {
            return Err(GpuError::Unavailable(format!("{name} is sm_{major}{minor}: the kernels need sm_80 or newer (bf16, f64 atomics)")));
        }
        let compute = ctx.new_stream().map_err(|e| failed("creating the compute stream", e))?;
        let copy = ctx.new_stream().map_err(|e| failed("creating the copy stream", e))?;
        let blas = cudarc::cublas::CudaBlas::new(compute.clone()).map_err(|e| failed("creating the cuBLAS handle", e))?;
        let arch = format!("sm_{major}{minor}");
        // A compile or load failure repeats on every restart (e.g. an NVRTC newer than the
        // driver: CUDA_ERROR_UNSUPPORTED_PTX_VERSION): permanent.
        let permanent = |e: GpuError| match e {
            GpuError::Failed(m) => GpuError::Unavailable(m),
            other => other,
        };
        let (ptx, _) = super::nvrtc::compile_cached(super::nvrtc::KERNELS_CU, &arch, &super::nvrtc::cache_dir()).map_err(permanent)?;
        let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx)).map_err(|e| GpuError::Unavailable(format!("loading the kernels for {arch} (driver older than NVRTC?): {e:?}")))?;
        let mut functions = HashMap::new();
        for k in super::nvrtc::kernel_names(super::nvrtc::KERNELS_CU) {
            let f = module.load_function(&k).map_err(|e| failed(&format!("kernel {k}"), e))?;
            functions.insert(k, f);
        }
        Ok(CudaDevice { ctx, streams: [compute, copy], blas, functions, memory: Vec::new(), registered: Vec::new(), events: EventTable::default(), name: format!("{name} ({arch})") })
    }

    /// The raw (`result`/`sys`) calls do not bind the context themselves; the worker may
    /// load on one thread and compute on another.
    fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| failed("cuCtxSetCurrent", e))
    }

    fn stream(&self, s: Stream) -> &Arc<CudaStream> {
        &self.streams[s.index()]
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        let _ = self.ctx.synchronize();
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
        Ok(self.events.get(e)?.is_complete())
    }

    fn cuda_handles(&self) -> Option<(Arc<CudaContext>, [cudarc::driver::sys::CUstream; 2])> {
        Some((self.ctx.clone(), [self.streams[0].cu_stream(), self.streams[1].cu_stream()]))
    }

    fn alloc(&mut self, bytes: usize) -> Result<DevPtr> {
        let s = self.streams[0].clone();
        let buf = s.alloc_zeros::<u8>(bytes).map_err(|e| GpuError::OutOfMemory(format!("{bytes} bytes: {e:?}")))?;
        let ptr = {
            let (p, _guard) = cudarc::driver::DevicePtr::device_ptr(&buf, &s);
            p
        };
        self.memory.push(buf);
        Ok(ptr)
    }

    fn mem_info(&self) -> Result<(usize, usize)> {
        self.ctx.mem_get_info().map_err(|e| failed("cuMemGetInfo", e))
    }

    fn upload(&mut self, s: Stream, dst: DSlice, src: &[u8]) -> Result<()> {
        self.bind()?;
        if src.len() > dst.bytes {
            return Err(GpuError::Invalid(format!("upload of {} bytes into {}", src.len(), dst.bytes)));
        }
        let st = self.stream(s).cu_stream();
        // SAFETY: dst is device memory of at least src.len() bytes; a pageable source is
        // staged by the driver before the call returns.
        unsafe { cudarc::driver::result::memcpy_htod_async(dst.ptr, src, st) }.map_err(|e| failed("cuMemcpyHtoDAsync", e))
    }

    fn download(&mut self, s: Stream, src: DSlice, dst: &mut [u8]) -> Result<()> {
        self.bind()?;
        if dst.len() > src.bytes {
            return Err(GpuError::Invalid(format!("download of {} bytes from {}", dst.len(), src.bytes)));
        }
        let st = self.stream(s).clone();
        // SAFETY: src is device memory of at least dst.len() bytes.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(dst, src.ptr, st.cu_stream()) }.map_err(|e| failed("cuMemcpyDtoHAsync", e))?;
        st.synchronize().map_err(|e| failed("cuStreamSynchronize", e))
    }

    unsafe fn download_async(&mut self, s: Stream, src: DSlice, dst: *mut u8) -> Result<()> {
        self.bind()?;
        let st = self.stream(s).cu_stream();
        let dst = std::slice::from_raw_parts_mut(dst, src.bytes);
        cudarc::driver::result::memcpy_dtoh_async(dst, src.ptr, st).map_err(|e| failed("cuMemcpyDtoHAsync", e))
    }

    unsafe fn upload_async(&mut self, s: Stream, dst: DSlice, src: *const u8) -> Result<()> {
        self.bind()?;
        let st = self.stream(s).cu_stream();
        let src = std::slice::from_raw_parts(src, dst.bytes);
        cudarc::driver::result::memcpy_htod_async(dst.ptr, src, st).map_err(|e| failed("cuMemcpyHtoDAsync", e))
    }

    unsafe fn register_host(&mut self, ptr: *mut u8, bytes: usize) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| failed("binding the context", e))?;
        cudarc::driver::sys::cuMemHostRegister_v2(ptr.cast(), bytes, cudarc::driver::sys::CU_MEMHOSTREGISTER_PORTABLE)
            .result()
            .map_err(|e| failed("cuMemHostRegister", e))?;
        self.registered.push(ptr);
        Ok(())
    }

    fn memset_zero(&mut self, s: Stream, dst: DSlice) -> Result<()> {
        self.bind()?;
        let st = self.stream(s).cu_stream();
        // SAFETY: dst is device memory.
        unsafe { cudarc::driver::result::memset_d8_async(dst.ptr, 0, dst.bytes, st) }.map_err(|e| failed("cuMemsetD8Async", e))
    }

    fn launch(&mut self, s: Stream, kernel: &str, grid: u32, block: u32, args: &[Arg]) -> Result<()> {
        if grid == 0 {
            // Nothing to do (cuLaunchKernel would reject a zero grid); as the host device.
            return Ok(());
        }
        let f = self.functions.get(kernel).ok_or_else(|| GpuError::Invalid(format!("no kernel named {kernel}")))?.clone();
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
        let cfg = LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (block, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: the arguments match the kernel's parameters (the ops layer's contract,
        // checked against the CPU backend on the host device).
        unsafe { b.launch(cfg) }.map_err(|e| failed(&format!("launching {kernel}"), e))?;
        Ok(())
    }

    fn gemm(&mut self, s: Stream, g: &Gemm) -> Result<()> {
        self.bind()?;
        g.validate()?;
        use cudarc::cublas::sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        let st = self.stream(s).cu_stream();
        let op = |t: bool| if t { CUBLAS_OP_T } else { CUBLAS_OP_N };
        if g.bf16_inputs {
            use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cudaDataType_t};
            // SAFETY: as below; bf16 A and B, f32 or bf16 C, f32 accumulation (tensor cores).
            return unsafe {
                cudarc::cublas::result::set_stream(*self.blas.handle(), st as _).map_err(|e| failed("cublasSetStream", e))?;
                cudarc::cublas::result::gemm_ex(
                    *self.blas.handle(),
                    op(g.transa),
                    op(g.transb),
                    g.m as i32,
                    g.n as i32,
                    g.k as i32,
                    (&g.alpha as *const f32).cast(),
                    g.a.ptr as *const std::ffi::c_void,
                    cudaDataType_t::CUDA_R_16BF,
                    g.lda as i32,
                    g.b.ptr as *const std::ffi::c_void,
                    cudaDataType_t::CUDA_R_16BF,
                    g.ldb as i32,
                    (&g.beta as *const f32).cast(),
                    g.c.ptr as *mut std::ffi::c_void,
                    if g.bf16_output { cudaDataType_t::CUDA_R_16BF } else { cudaDataType_t::CUDA_R_32F },
                    g.ldc as i32,
                    cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .map_err(|e| failed("cublasGemmEx (bf16)", e));
        }
        // SAFETY: operands validated against their shapes; the handle is bound to `s`.
        unsafe {
            cudarc::cublas::result::set_stream(*self.blas.handle(), st as _).map_err(|e| failed("cublasSetStream", e))?;
            cudarc::cublas::result::sgemm(
                *self.blas.handle(),
                op(g.transa),
                op(g.transb),
                g.m as i32,
                g.n as i32,
                g.k as i32,
                &g.alpha,
                g.a.ptr as *const f32,
                g.lda as i32,
                g.b.ptr as *const f32,
                g.ldb as i32,
                &g.beta,
                g.c.ptr as *mut f32,
                g.ldc as i32,
            )
        }
        .map_err(|e| failed("cublasSgemm", e))
    }

    fn record(&mut self, s: Stream) -> Result<Event> {
        let e = self.stream(s).record_event(None).map_err(|e| failed("cuEventRecord", e))?;
        Ok(self.events.insert(e))
    }

    fn wait(&mut self, s: Stream, e: Event) -> Result<()> {
        let ev = self.events.get(e)?;
        self.stream(s).wait(ev).map_err(|e| failed("cuStreamWaitEvent", e))
    }

    fn sync_event(&mut self, e: Event) -> Result<()> {
        let ev = self.events.get(e)?;
        ev.synchronize().map_err(|e| failed("cuEventSynchronize", e))
    }

    fn sync(&mut self) -> Result<()> {
        for s in &self.streams {
            s.synchronize().map_err(|e| failed("cuStreamSynchronize", e))?;
        }
        Ok(())
    }

    fn release_event(&mut self, e: Event) {
        // cuEventDestroy of an event not yet complete frees it once it completes.
        self.events.release(e);
    }
}
