//! The device parity tests of host_device.rs (every kernel, the whole target forward and
//! drafter step, the device optimizer) run against the CPU device: the Rust counterparts of
//! the kernels that CPU workers compute with. `cargo test -p dflash-worker host_device`
//! runs these too.

/// The device under test: the CPU device.
fn device() -> Box<dyn dflash_worker::gpu::Device> {
    Box::new(dflash_worker::gpu::cpu::CpuDevice::new())
}

include!("parity/tests.rs");

/// Every kernel of kernels.cu has a Rust counterpart on the CPU device (a launch with no
/// arguments fails on its first argument, not on the kernel's name).
#[test]
fn cpu_device_has_every_kernel() {
    use dflash_worker::gpu::{Device, GpuError, Stream};
    let mut d = dflash_worker::gpu::cpu::CpuDevice::new();
    let names = dflash_worker::gpu::nvrtc::kernel_names(dflash_worker::gpu::nvrtc::KERNELS_CU);
    assert!(names.len() >= 20, "{names:?}");
    for k in names {
        let err = d.launch(Stream::Compute, &k, 1, 32, &[]).unwrap_err();
        assert!(
            matches!(&err, GpuError::Invalid(m) if m.contains(": argument ") && !m.contains("no kernel")),
            "{k}: {err}"
        );
    }
    let err = d
        .launch(Stream::Compute, "no_such_kernel", 1, 32, &[])
        .unwrap_err();
    assert!(
        matches!(&err, GpuError::Invalid(m) if m.contains("no kernel named")),
        "{err}"
    );
}

/// A kernel that writes a buffer overlapping another of its arguments is refused (the
/// CPU kernels take them as separate slices).
#[test]
fn cpu_device_refuses_a_written_buffer_that_overlaps_another_argument() {
    use dflash_worker::gpu::{Arg, DSlice, Device, GpuError, Stream};
    let mut d = dflash_worker::gpu::cpu::CpuDevice::new();
    let p = d.alloc(64 * 4).unwrap();
    let (x, y) = (
        DSlice {
            ptr: p,
            bytes: 32 * 4,
        },
        DSlice {
            ptr: p + 16 * 4,
            bytes: 32 * 4,
        },
    );
    let err = d
        .launch(
            Stream::Compute,
            "add_inplace",
            1,
            32,
            &[Arg::RW(x), Arg::R(y), Arg::I64(32)],
        )
        .unwrap_err();
    assert!(
        matches!(&err, GpuError::Invalid(m) if m.contains("overlaps")),
        "{err}"
    );
    let y = DSlice {
        ptr: p + 32 * 4,
        bytes: 32 * 4,
    };
    d.launch(
        Stream::Compute,
        "add_inplace",
        1,
        32,
        &[Arg::RW(x), Arg::R(y), Arg::I64(32)],
    )
    .unwrap();
}
