//! Every CUDA kernel and the GPU path's host code, run on the host device (the kernels
//! compiled as C++, every block's threads at once) and compared with the CPU backend —
//! the reference — at the tolerances stated per test. Also: the host device's GEMM
//! against OpenBLAS (the same column-major contract cuBLAS has), its race detector, and a
//! whole target forward. `cargo test -p dflash-worker host_device` runs them all; none
//! skips.

use dflash_worker::gpu::host::HostDevice;

/// The device under test: the host device, or with `DFLASH_TEST_DEVICE=cuda` the GPU
/// (scripts/gpu_check.sh runs this same binary that way on a GPU machine).
fn device() -> Box<dyn dflash_worker::gpu::Device> {
    match std::env::var("DFLASH_TEST_DEVICE").as_deref() {
        Ok("cuda") => Box::new(dflash_worker::gpu::cuda::CudaDevice::open().expect("opening the GPU")),
        _ => Box::new(HostDevice::new()),
    }
}

include!("parity/tests.rs");

#[test]
fn host_device_race_detector_catches_copies_not_ordered_after_compute() {
    if on_gpu() {
        eprintln!("the race detector is the host device's; nothing to check on a GPU");
        return;
    }
    let mut o = ops();
    let a = put(&mut o, &[1.0; 64]);
    let b = put(&mut o, &[0.0; 64]);
    o.add(b, a).unwrap();
    // The copy stream reads b, written by the compute stream, without waiting for it.
    let mut host = vec![0u8; 256];
    let err = o.dev.download(Stream::Copy, b, &mut host).unwrap_err();
    assert!(matches!(&err, GpuError::Race(m) if m.contains("copy stream") && m.contains("add_inplace")), "{err}");
    // Ordered by an event, the same copy is fine and sees the sum.
    let e = o.dev.record(Stream::Compute).unwrap();
    o.dev.wait(Stream::Copy, e).unwrap();
    o.dev.download(Stream::Copy, b, &mut host).unwrap();
    assert_eq!(f32::from_le_bytes(host[..4].try_into().unwrap()), 1.0);

    // A synchronous download made the host wait, so what it queues next is ordered after.
    o.dev.memset_zero(Stream::Compute, b).unwrap();
    o.add(b, a).unwrap();

    // Compute overwriting b while an async copy may still read it is a race.
    let mut pinned = vec![0u8; 256];
    unsafe { o.dev.register_host(pinned.as_mut_ptr(), 256).unwrap() };
    let e = o.dev.record(Stream::Compute).unwrap();
    o.dev.wait(Stream::Copy, e).unwrap();
    unsafe { o.dev.download_async(Stream::Copy, b, pinned.as_mut_ptr()).unwrap() };
    let err = o.dev.memset_zero(Stream::Compute, b).unwrap_err();
    assert!(matches!(&err, GpuError::Race(m) if m.contains("read")), "{err}");
    let done = o.dev.record(Stream::Copy).unwrap();
    o.dev.sync_event(done).unwrap();
    o.dev.memset_zero(Stream::Compute, b).unwrap();
    o.add(b, a).unwrap();
    o.add(b, a).unwrap();

    // Pinned host memory: an async copy lands there; the host may read it only after
    // syncing an event recorded behind the copy (how a slot is committed).
    let e = o.dev.record(Stream::Copy).unwrap();
    o.dev.wait(Stream::Compute, e).unwrap();
    o.add(b, a).unwrap();
    let e = o.dev.record(Stream::Compute).unwrap();
    o.dev.wait(Stream::Copy, e).unwrap();
    unsafe { o.dev.download_async(Stream::Copy, b, pinned.as_mut_ptr()).unwrap() };
    let err = o.dev.host_access(pinned.as_ptr(), 256, false).unwrap_err();
    assert!(matches!(&err, GpuError::Race(m) if m.contains("the host")), "{err}");
    let done = o.dev.record(Stream::Copy).unwrap();
    o.dev.sync_event(done).unwrap();
    o.dev.host_access(pinned.as_ptr(), 256, false).unwrap();
    assert_eq!(f32::from_le_bytes(pinned[..4].try_into().unwrap()), 3.0);
}

#[test]
fn host_device_launch_checks_kernel_names_arity_and_block_shape() {
    if on_gpu() {
        return;
    }
    let mut o = ops();
    let a = put(&mut o, &[0.0; 8]);
    let err = o.dev.launch(Stream::Compute, "no_such_kernel", 1, 32, &[]).unwrap_err();
    assert!(matches!(err, GpuError::Invalid(m) if m.contains("no_such_kernel")));
    let err = o.dev.launch(Stream::Compute, "add_inplace", 1, 32, &[dflash_worker::gpu::Arg::RW(a)]).unwrap_err();
    assert!(matches!(err, GpuError::Invalid(m) if m.contains("takes 3 arguments")));
    let args = [dflash_worker::gpu::Arg::RW(a), dflash_worker::gpu::Arg::R(a), dflash_worker::gpu::Arg::I64(8)];
    let err = o.dev.launch(Stream::Compute, "add_inplace", 1, 48, &args).unwrap_err();
    assert!(matches!(err, GpuError::Invalid(m) if m.contains("multiple of 32")));
    // `long n` given as a 4-byte integer: fine on the host by luck, garbage on a GPU.
    let narrow = [dflash_worker::gpu::Arg::RW(a), dflash_worker::gpu::Arg::R(a), dflash_worker::gpu::Arg::I32(8)];
    let err = o.dev.launch(Stream::Compute, "add_inplace", 1, 32, &narrow).unwrap_err();
    assert!(matches!(err, GpuError::Invalid(m) if m.contains("parameter 2 is of kind 'l'")));
    // Every kernel of kernels.cu is in the host device's table.
    let table = dflash_worker::gpu::host::kernel_table();
    for k in dflash_worker::gpu::nvrtc::kernel_names(dflash_worker::gpu::nvrtc::KERNELS_CU) {
        assert!(table.contains_key(&k), "{k} missing from the host device");
    }
    assert!(table.len() >= 16, "{table:?}");
}


#[test]
fn host_device_a_model_that_does_not_fit_is_a_permanent_failure_with_the_figures() {
    use dflash_worker::gpu::target::GpuTarget;
    use dflash_worker::model::target::Target;
    let tmp = tempfile::tempdir().unwrap();
    dflash_worker::model::tiny::write_random(tmp.path(), QWEN3, 21).unwrap();
    let cpu = Target::load(tmp.path(), &[3]).unwrap();
    // 256 KiB of "device memory": the weights alone need more.
    let err = GpuTarget::new(Box::new(HostDevice::with_memory(256 << 10)), &cpu, 64).err().expect("it cannot fit");
    assert!(matches!(&err, GpuError::Unavailable(m) if m.contains("the target") && m.contains("GiB of device memory") && m.contains("0.00 GiB of 0.00 GiB")), "{err}");
    // With enough, the same target is placed, and the arena stays within the device.
    let mut g = GpuTarget::new(Box::new(HostDevice::with_memory(16 << 20)), &cpu, 64).unwrap();
    let st = g.arena_stats();
    assert!(st.reserved <= 16 << 20 && g.device_memory().unwrap().total == 16 << 20 && g.device_memory().unwrap().free < 16 << 20);
    assert_eq!(g.forward_taps(&[1, 2, 3]).unwrap().len(), 3 * 64);
}

/// cuMemHostRegister (without its READ_ONLY flag) fails on pages the process maps
/// read-only, such as a worker's view of a pool's slot headers: the host device refuses
/// them too, so pinning the wrong range fails here and not first on a GPU.
#[test]
fn host_device_refuses_to_pin_read_only_pages() {
    if on_gpu() {
        return;
    }
    let mut o = ops();
    let page = 4096;
    // SAFETY: an anonymous private mapping of two pages, unmapped at the end.
    let base = unsafe { libc::mmap(std::ptr::null_mut(), 2 * page, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0) };
    assert_ne!(base, libc::MAP_FAILED);
    // SAFETY: the first page of our own mapping.
    assert_eq!(unsafe { libc::mprotect(base, page, libc::PROT_READ) }, 0);
    let p = base as *mut u8;
    let err = unsafe { o.dev.register_host(p, 2 * page) }.unwrap_err();
    assert!(matches!(&err, GpuError::Invalid(m) if m.contains("read-only")), "{err}");
    // The writable page alone is fine.
    unsafe { o.dev.register_host(p.add(page), page) }.unwrap();
    // SAFETY: unmapping what we mapped.
    unsafe { libc::munmap(base, 2 * page) };
}
