//! Every CUDA kernel and the GPU path's host code, run on the host device (the kernels
//! compiled as C++, every block's threads at once) and compared with the CPU backend —
//! the reference — at the tolerances stated per test. Also: the host device's GEMM
//! against OpenBLAS (the same column-major contract cuBLAS has), its race detector, and a
//! whole target forward. `cargo test -p dflash-worker host_device` runs them all; none
//! skips.

use dflash_worker::device::host::HostDevice;

/// The device under test: the host device, or with `DFLASH_TEST_DEVICE=cuda` the GPU
/// (scripts/gpu_check.sh runs this same binary that way on a GPU machine).
fn device() -> Box<dyn dflash_worker::device::Device> {
    match std::env::var("DFLASH_TEST_DEVICE").as_deref() {
        Ok("cuda") => {
            Box::new(dflash_worker::device::cuda::CudaDevice::open().expect("opening the GPU"))
        }
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
    assert!(
        matches!(&err, GpuError::Race(m) if m.contains("copy stream") && m.contains("add_inplace")),
        "{err}"
    );
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
    unsafe {
        o.dev
            .download_async(Stream::Copy, b, pinned.as_mut_ptr())
            .unwrap()
    };
    let err = o.dev.memset_zero(Stream::Compute, b).unwrap_err();
    assert!(
        matches!(&err, GpuError::Race(m) if m.contains("read")),
        "{err}"
    );
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
    unsafe {
        o.dev
            .download_async(Stream::Copy, b, pinned.as_mut_ptr())
            .unwrap()
    };
    let err = o.dev.host_access(pinned.as_ptr(), 256, false).unwrap_err();
    assert!(
        matches!(&err, GpuError::Race(m) if m.contains("the host")),
        "{err}"
    );
    let done = o.dev.record(Stream::Copy).unwrap();
    o.dev.sync_event(done).unwrap();
    o.dev.host_access(pinned.as_ptr(), 256, false).unwrap();
    assert_eq!(f32::from_le_bytes(pinned[..4].try_into().unwrap()), 3.0);
}

#[test]
fn host_device_launch_checks_kernel_names_arity_and_block_shape() {
    use dflash_worker::device::{Arg, Device};
    // The C-parameter level under the typed kernels (`Kernel::args`): what a launch
    // that got them wrong would meet on the host device.
    let mut dev = HostDevice::new();
    let p = dev.alloc(32).unwrap();
    let a = DSlice { ptr: p, bytes: 32 };
    let c = Stream::Compute;
    let err = dev
        .launch_args(c, "no_such_kernel", 1, 32, &[])
        .unwrap_err();
    assert!(matches!(err, GpuError::Invalid(m) if m.contains("no_such_kernel")));
    let err = dev
        .launch_args(c, "add_inplace", 1, 32, &[Arg::RW(a)])
        .unwrap_err();
    assert!(matches!(err, GpuError::Invalid(m) if m.contains("takes 3 arguments")));
    let args = [Arg::RW(a), Arg::R(a), Arg::I64(8)];
    let err = dev.launch_args(c, "add_inplace", 1, 48, &args).unwrap_err();
    assert!(matches!(err, GpuError::Invalid(m) if m.contains("multiple of 32")));
    // `long n` given as a 4-byte integer: fine on the host by luck, garbage on a GPU.
    let narrow = [Arg::RW(a), Arg::R(a), Arg::I32(8)];
    let err = dev
        .launch_args(c, "add_inplace", 1, 32, &narrow)
        .unwrap_err();
    assert!(matches!(err, GpuError::Invalid(m) if m.contains("parameter 2 is of kind 'l'")));
    // Every kernel of kernels.cu is in the host device's table.
    let table = dflash_worker::device::host::kernel_table();
    for k in dflash_worker::device::nvrtc::kernel_names(dflash_worker::device::nvrtc::KERNELS_CU) {
        assert!(table.contains_key(&k), "{k} missing from the host device");
    }
    assert!(table.len() >= 16, "{table:?}");
}

#[test]
fn host_device_a_model_that_does_not_fit_is_a_permanent_failure_with_the_figures() {
    use dflash_worker::models::target::device::DeviceTarget;
    use dflash_worker::models::target::Target;
    let tmp = tempfile::tempdir().unwrap();
    dflash_worker::models::tiny::write_random(tmp.path(), QWEN3, 21).unwrap();
    let cpu = Target::load(tmp.path(), &[3]).unwrap();
    // 256 KiB of "device memory": the weights alone need more.
    let err = DeviceTarget::new(Box::new(HostDevice::with_memory(256 << 10)), &cpu, 64)
        .err()
        .expect("it cannot fit");
    assert!(
        matches!(&err, GpuError::Unavailable(m) if m.contains("the target") && m.contains("GiB of device memory") && m.contains("0.00 GiB of 0.00 GiB")),
        "{err}"
    );
    // With enough, the same target is placed, and the arena stays within the device.
    let mut g = DeviceTarget::new(Box::new(HostDevice::with_memory(16 << 20)), &cpu, 64).unwrap();
    let st = g.arena_stats();
    assert!(
        st.reserved <= 16 << 20
            && g.device_memory().unwrap().total == 16 << 20
            && g.device_memory().unwrap().free < 16 << 20
    );
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
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            2 * page,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(base, libc::MAP_FAILED);
    // SAFETY: the first page of our own mapping.
    assert_eq!(unsafe { libc::mprotect(base, page, libc::PROT_READ) }, 0);
    let p = base as *mut u8;
    let err = unsafe { o.dev.register_host(p, 2 * page) }.unwrap_err();
    assert!(
        matches!(&err, GpuError::Invalid(m) if m.contains("read-only")),
        "{err}"
    );
    // The writable page alone is fine.
    unsafe { o.dev.register_host(p.add(page), page) }.unwrap();
    // SAFETY: unmapping what we mapped.
    unsafe { libc::munmap(base, 2 * page) };
}

// The host device's schedule (cuda/host/runtime.cpp): how a launch orders its blocks and
// threads, drawn from a seed, and the poisoned shared memory each block starts with.
extern "C" {
    fn dflash_hd_set_schedule(order: *const std::ffi::c_char, seed: u64) -> std::ffi::c_int;
    fn dflash_hd_last_schedule(
        threads: *mut u32,
        nthreads: usize,
        blocks: *mut u64,
        nblocks: usize,
    ) -> std::ffi::c_int;
    fn dflash_hd_keep_shared(copy: *mut *const u8) -> usize;
}

/// This thread's launches under `order` (ascending, reverse, random, mixed) and `seed`,
/// numbered from 0 again, until dropped (then the environment's schedule again).
struct Schedule;

impl Schedule {
    fn set(order: &str, seed: u64) -> Schedule {
        let c = std::ffi::CString::new(order).unwrap();
        // SAFETY: a NUL-terminated string; the call only sets this thread's schedule.
        assert_eq!(
            unsafe { dflash_hd_set_schedule(c.as_ptr(), seed) },
            0,
            "order {order}"
        );
        Schedule
    }
}

impl Drop for Schedule {
    fn drop(&mut self) {
        // SAFETY: null: back to the environment's schedule.
        unsafe { dflash_hd_set_schedule(std::ptr::null(), 0) };
    }
}

/// How this thread's last launch ran: its threads' order (0 ascending, 1 reverse, 2
/// random), the first block's thread order, and its blocks' order.
fn last_schedule(threads: usize, blocks: usize) -> (i32, Vec<u32>, Vec<u64>) {
    let (mut t, mut b) = (vec![u32::MAX; threads], vec![u64::MAX; blocks]);
    // SAFETY: buffers of the lengths given.
    let order =
        unsafe { dflash_hd_last_schedule(t.as_mut_ptr(), t.len(), b.as_mut_ptr(), b.len()) };
    (order, t, b)
}

/// Every launch runs its blocks in a shuffled order and resumes its threads in ascending,
/// reversed or shuffled order (DFLASH_HD_ORDER; mixed: one of them per launch), all drawn
/// from the seed (DFLASH_HD_SEED), so that a kernel that depends on an order a GPU does
/// not keep fails here, and does so again on the same seed.
#[test]
fn host_device_runs_blocks_and_threads_in_orders_drawn_from_the_seed() {
    if on_gpu() {
        return;
    }
    let mut o = ops();
    // add_inplace over 8 blocks of 256 threads.
    let (a, b) = (put(&mut o, &[1.0; 2048]), put(&mut o, &[0.0; 2048]));
    let run = |o: &mut Ops| -> (i32, Vec<u32>, Vec<u64>) {
        o.add(b, a).unwrap();
        last_schedule(256, 8)
    };
    let ascending: Vec<u32> = (0..256).collect();
    let mut block_orders = std::collections::HashSet::new();
    for seed in 1..=4 {
        for (name, want) in [("ascending", 0), ("reverse", 1), ("random", 2)] {
            let _s = Schedule::set(name, seed);
            let (order, threads, blocks) = run(&mut o);
            assert_eq!(order, want, "{name}");
            let mut sorted = threads.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, ascending, "{name}: every thread once");
            match name {
                "ascending" => assert_eq!(threads, ascending),
                "reverse" => assert!(threads.iter().rev().eq(ascending.iter())),
                _ => assert!(
                    threads != ascending && !threads.iter().rev().eq(ascending.iter()),
                    "{name}: shuffled"
                ),
            }
            let mut sorted = blocks.clone();
            sorted.sort_unstable();
            assert_eq!(
                sorted,
                (0..8).collect::<Vec<u64>>(),
                "{name}: every block once"
            );
            block_orders.insert(blocks);
        }
    }
    assert!(
        block_orders.len() >= 4 && !block_orders.contains(&(0..8).collect::<Vec<u64>>()),
        "blocks shuffled, per seed: {block_orders:?}"
    );
    // Mixed: each of the three from launch to launch; the same seed, the same launches.
    let mixed = |o: &mut Ops, seed: u64| -> Vec<(i32, Vec<u32>, Vec<u64>)> {
        let _s = Schedule::set("mixed", seed);
        (0..12).map(|_| run(o)).collect()
    };
    let first = mixed(&mut o, 9);
    let orders: std::collections::HashSet<i32> = first.iter().map(|r| r.0).collect();
    assert_eq!(orders.len(), 3, "{orders:?}");
    assert_eq!(
        mixed(&mut o, 9),
        first,
        "the same seed runs the same schedule"
    );
    assert_ne!(mixed(&mut o, 10), first);
    // 4 seeds × 3 orders, then 3 × 12 mixed: every launch added once, whatever its order.
    assert!(
        get(&mut o, b).iter().all(|x| *x == 48.0),
        "every launch added once"
    );
    let bad = std::ffi::CString::new("backwards").unwrap();
    // SAFETY: a NUL-terminated string.
    assert_eq!(unsafe { dflash_hd_set_schedule(bad.as_ptr(), 1) }, 1);
}

/// Float atomics add in the order the blocks run: the attention backward at a head dim the
/// FlashAttention-2 kernels do not take (20) adds each key's value gradient by atomics
/// from every block of 16 query rows that sees it; with block b's rows of dO about
/// 100^(b % 4), the small shares of a sum with the large ones depend on which come first,
/// so it comes out with other low bits from seed to seed (as on a GPU from run to run),
/// and with the same bits from the same seed. Each is the CPU backend's to the tensor
/// cores' rounding.
#[test]
fn host_device_float_atomics_add_in_the_order_the_blocks_run() {
    if on_gpu() {
        return;
    }
    let bf = |v: Vec<f32>| -> Vec<f32> {
        v.iter()
            .map(|x| half::bf16::from_f32(*x).to_f32())
            .collect()
    };
    let mut rng = Rng::new(41);
    let (t, hd) = (128usize, 20usize);
    let h = Heads {
        q_heads: 1,
        kv_heads: 1,
        head_dim: hd,
    };
    assert!(Fa2Dim::for_call(&Attention::shape_of(t, 1, 1, hd)).is_none());
    // Every row sees every key: each key's gradient sums 8 blocks' shares.
    let spans: Vec<KeySpan> = (0..t).map(|_| KeySpan { a: 0..t, b: 0..0 }).collect();
    let (q, k, v) = (
        bf(rand_vec(&mut rng, t * hd, 1.0)),
        bf(rand_vec(&mut rng, t * hd, 1.0)),
        bf(rand_vec(&mut rng, t * hd, 1.0)),
    );
    let dout = bf(rand_vec(&mut rng, t * hd, 1.0)
        .iter()
        .enumerate()
        .map(|(i, x)| x * 100f32.powi((i / hd / 16 % 4) as i32))
        .collect());
    let cpu = Cpu::with_threads(1);
    let mut out = vec![0f32; t * hd];
    let saved = cpu.attention(&q, &k, &v, &mut out, &spans, h);
    let (mut dq, mut dk, mut want) = (vec![0f32; t * hd], vec![0f32; t * hd], vec![0f32; t * hd]);
    cpu.attention_backward(
        &dout, &q, &k, &v, &saved, &spans, h, &mut dq, &mut dk, &mut want,
    );
    let mut o = ops();
    let (gq, gk, gv, gd) = (
        put(&mut o, &q),
        put(&mut o, &k),
        put(&mut o, &v),
        put(&mut o, &dout),
    );
    let gs = put_i32(&mut o, &spans_i32(&spans));
    let (go, gl) = (put(&mut o, &vec![0.0; t * hd]), put(&mut o, &vec![0.0; t]));
    o.attention(Attention {
        q: gq,
        k: gk,
        v: gv,
        out: go,
        lse: gl,
        spans: gs,
        tq: t,
        qh: 1,
        kvh: 1,
        hd,
    })
    .unwrap();
    let scratch = put(
        &mut o,
        &vec![0.0; Ops::attention_backward_scratch(t, 1, hd)],
    );
    let mut dv_of = |seed: u64| -> Vec<u32> {
        let _s = Schedule::set("mixed", seed);
        let zeros = vec![0.0; t * hd];
        let (gdq, gdk, gdv) = (
            put(&mut o, &zeros),
            put(&mut o, &zeros),
            put(&mut o, &zeros),
        );
        o.attention_backward(
            AttentionGrad {
                fwd: Attention {
                    q: gq,
                    k: gk,
                    v: gv,
                    out: go,
                    lse: gl,
                    spans: gs,
                    tq: t,
                    qh: 1,
                    kvh: 1,
                    hd,
                },
                dout: gd,
                dq: gdq,
                dk: gdk,
                dv: gdv,
            },
            scratch,
        )
        .unwrap();
        let dv = get(&mut o, gdv);
        assert_close(&format!("attention dv, seed {seed}"), &dv, &want, 1e-2);
        dv.iter().map(|v| v.to_bits()).collect()
    };
    let runs: Vec<Vec<u32>> = (1..=6).map(&mut dv_of).collect();
    let distinct: std::collections::HashSet<&Vec<u32>> = runs.iter().collect();
    eprintln!(
        "{} different value gradients (to the bit) from 6 seeds",
        distinct.len()
    );
    assert!(
        distinct.len() >= 2,
        "the order of the float atomics never changed"
    );
    assert_eq!(dv_of(3), runs[2], "the same seed, the same sum");
}

/// The FlashAttention-2 forward issues its row blocks longest first: the first `qh` CTAs
/// (one per head) take the last row block, which in a causal prefix sees the most keys.
/// A grid of only those CTAs writes the last rows, as the whole launch does, and no other.
#[test]
fn host_device_flash_attention_2_forward_issues_the_last_row_block_first() {
    use dflash_worker::device::ops::attention::AttentionKernel;
    use dflash_worker::device::ops::kernel::Kernel;
    let (t, qh, hd) = (150usize, 2usize, 32usize);
    let mut rng = Rng::new(43);
    let (q, kv) = (
        rand_vec(&mut rng, t * qh * hd, 1.0),
        rand_vec(&mut rng, t * hd, 1.0),
    );
    let spans: Vec<i32> = (0..t as i32).flat_map(|i| [0, i + 1, 0, 0]).collect();
    let mut o = ops();
    let (gq, gk, gs) = (put(&mut o, &q), put(&mut o, &kv), put_i32(&mut o, &spans));
    let nan = vec![f32::NAN; t * qh * hd];
    let (want, wl) = (put(&mut o, &nan), put(&mut o, &vec![0.0; t * qh]));
    o.attention(Attention {
        q: gq,
        k: gk,
        v: gk,
        out: want,
        lse: wl,
        spans: gs,
        tq: t,
        qh,
        kvh: 1,
        hd,
    })
    .unwrap();
    let (got, gl) = (put(&mut o, &nan), put(&mut o, &vec![0.0; t * qh]));
    let a = Attention {
        out: got,
        lse: gl,
        q: gq,
        k: gk,
        v: gk,
        spans: gs,
        ..Attention::shape_of(t, qh, 1, hd)
    };
    let dim = Fa2Dim::for_call(&a).expect("hd 32 takes the FlashAttention-2 forward");
    let k = Kernel::Attention(AttentionKernel::Fa2Fwd {
        act: DType::F32,
        dim,
        a,
    });
    o.dev.launch(Stream::Compute, &k, qh as u32, 128).unwrap();
    let (got, want) = (get(&mut o, got), get(&mut o, want));
    let last = 128 * qh * hd;
    assert!(
        got[..last].iter().all(|x| x.is_nan()),
        "the first CTAs wrote rows before the last row block"
    );
    assert!(
        got[last..]
            .iter()
            .zip(&want[last..])
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "the first CTAs' rows 128..150 are the whole launch's"
    );
}

/// RMSNorm's weight gradient takes no atomics: blocks of rows write partial rows, summed
/// in a fixed order by a second launch. Over rows of very different magnitudes (row r's
/// terms about 100^(r % 4)), where adding in the order the blocks run gave other low bits
/// from seed to seed, every seed gives the same bits, the CPU backend's sum to rounding.
#[test]
fn host_device_rmsnorm_weight_gradient_has_the_same_bits_in_every_block_order() {
    if on_gpu() {
        return;
    }
    let mut rng = Rng::new(41);
    let (rows, d) = (3000usize, 32usize);
    let x = rand_vec(&mut rng, rows * d, 1.0);
    let w = rand_vec(&mut rng, d, 1.0);
    let dy: Vec<f32> = rand_vec(&mut rng, rows * d, 1.0)
        .iter()
        .enumerate()
        .map(|(i, v)| v * 100f32.powi((i / d % 4) as i32))
        .collect();
    let cpu = Cpu::with_threads(1);
    let mut y = vec![0f32; rows * d];
    let rstd = cpu.rmsnorm(&x, &w, &mut y, d, 1e-6);
    let (mut dx, mut want) = (vec![0f32; rows * d], vec![0f32; d]);
    cpu.rmsnorm_backward(&dy, &x, &w, &rstd, &mut dx, Some(&mut want), d);
    let mut o = ops();
    let (gx, gw, gdy, gr) = (
        put(&mut o, &x),
        put(&mut o, &w),
        put(&mut o, &dy),
        put(&mut o, &rstd),
    );
    let mut dw_of = |order: &str, seed: u64| -> Vec<u32> {
        let _s = Schedule::set(order, seed);
        let (gdx, gdw) = (
            put(&mut o, &vec![0.0; rows * d]),
            put(&mut o, &vec![0.0; d]),
        );
        o.rmsnorm_backward(
            Mat::f32(gdy, rows, d),
            Mat::f32(gx, rows, d),
            gw,
            gr,
            Mat::f32(gdx, rows, d),
            Some(gdw),
        )
        .unwrap();
        let dw = get(&mut o, gdw);
        assert_close(&format!("rmsnorm dw, {order} {seed}"), &dw, &want, 1e-5);
        dw.iter().map(|v| v.to_bits()).collect()
    };
    let first = dw_of("ascending", 1);
    for (order, seed) in [("reverse", 1), ("random", 2), ("mixed", 3), ("mixed", 4)] {
        assert_eq!(dw_of(order, seed), first, "{order} order, seed {seed}");
    }
}

/// Every block starts with its shared memory poisoned (0xFF bytes: NaN as f32 and bf16),
/// not with what the last block left there, so a kernel that reads shared memory it did
/// not write in this block reads NaN. block_sum's shared memory: RMSNorm over 256 threads
/// writes 8 of its 32 floats (one per warp), over 32 threads one, and after a launch only
/// what its last block wrote is not the poison. The templates' shared memory (the f32
/// and bf16 attention forward) is in the poisoned section too.
#[test]
fn host_device_poisons_shared_memory_before_every_block() {
    if on_gpu() {
        return;
    }
    // The words of the shared memory that are not the poison, as this thread's last launch
    // left it (a copy: other tests' launches write the same shared memory).
    let unpoisoned = || -> usize {
        let mut copy = std::ptr::null();
        // SAFETY: this thread's copy, valid until its next launch.
        let shared = unsafe {
            let len = dflash_hd_keep_shared(&mut copy);
            assert!(len >= 80 << 10, "every kernel's shared memory: {len} bytes");
            std::slice::from_raw_parts(copy, len)
        };
        shared.chunks_exact(4).filter(|w| *w != [0xFF; 4]).count()
    };
    let mut copy = std::ptr::null();
    // SAFETY: writes a pointer; from here this thread's launches keep a copy.
    unsafe { dflash_hd_keep_shared(&mut copy) };
    assert!(f32::from_bits(u32::MAX).is_nan() && half::bf16::from_bits(u16::MAX).is_nan());
    let mut o = ops();
    let mut rng = Rng::new(42);
    for (d, warps) in [(256usize, 8usize), (32, 1), (256, 8)] {
        let rows = 3;
        let x = rand_vec(&mut rng, rows * d, 1.0);
        let w = rand_vec(&mut rng, d, 1.0);
        let mut want = vec![0f32; rows * d];
        Cpu::with_threads(1).rmsnorm(&x, &w, &mut want, d, 1e-6);
        let (gx, gw, gy, gr) = (
            put(&mut o, &x),
            put(&mut o, &w),
            put(&mut o, &vec![0.0; rows * d]),
            put(&mut o, &vec![0.0; rows]),
        );
        o.rmsnorm(o.act_mat(gx, rows, d), gw, o.act_mat(gy, rows, d), gr, 1e-6)
            .unwrap();
        assert_eq!(
            unpoisoned(),
            warps,
            "rmsnorm over {d} threads: only what the last block wrote"
        );
        assert_close(
            &format!("rmsnorm over {d} threads, from poisoned shared memory"),
            &get(&mut o, gy),
            &want,
            TOL,
        );
    }
    // The attention forward, f32 and bf16: a template, whose shared memory is declared at
    // namespace scope to be in the poisoned section (cuda_host.h refuses it in a template).
    for act16 in [false, true] {
        let mut o = ops();
        o.act16 = act16;
        let (t, hd) = (5usize, 32usize);
        let q = rand_vec(&mut rng, t * hd, 1.0);
        let spans: Vec<i32> = (0..t as i32).flat_map(|i| [0, i + 1, 0, 0]).collect();
        let act = |o: &mut Ops, v: &[f32]| if act16 { put16(o, v) } else { put(o, v) };
        let (gq, go) = (act(&mut o, &q), act(&mut o, &vec![0.0; t * hd]));
        let (gs, gl) = (put_i32(&mut o, &spans), put(&mut o, &vec![0.0; t]));
        o.attention(Attention {
            q: gq,
            k: gq,
            v: gq,
            out: go,
            lse: gl,
            spans: gs,
            tq: t,
            qh: 1,
            kvh: 1,
            hd,
        })
        .unwrap();
        let n = unpoisoned();
        // The staged Q, K and V (16 rows of 32 bf16 each), O (16 × 32 f32) and more.
        assert!(
            n >= 3 * 16 * 32 / 2 + 16 * 32,
            "attention (bf16 activations: {act16}): {n} words written"
        );
    }
}
