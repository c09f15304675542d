//! The device parity tests of host_device.rs (every kernel, the whole target forward and
//! drafter step, the device optimizer) run against the CPU device: the Rust counterparts of
//! the kernels that CPU workers compute with. `cargo test -p dflash-worker host_device`
//! runs these too.

/// The device under test: the CPU device.
fn device() -> Box<dyn dflash_worker::device::Device> {
    Box::new(dflash_worker::device::cpu::CpuDevice::new())
}

include!("parity/tests.rs");

/// Every kernel of kernels.cu runs on the CPU device (its match over [`Kernel`] is
/// exhaustive), and each checks its buffers against the launch: with empty buffers, every
/// kernel refuses, naming itself and the buffer, instead of reading past the end.
#[test]
fn cpu_device_checks_every_kernels_buffers_against_the_launch() {
    use dflash_worker::device::ops::attention::AttentionKernel;
    use dflash_worker::device::ops::kernel::Kernel;
    use dflash_worker::device::{DSlice, Device, GpuError, Stream};
    let mut d = dflash_worker::device::cpu::CpuDevice::new();
    let empty = DSlice { ptr: 0, bytes: 0 };
    let mut checked = 0;
    for k in Kernel::every(empty) {
        // One i32 on the device, read and written at element 0 only (as on a GPU).
        if matches!(
            k,
            Kernel::Optimizer(dflash_worker::device::ops::adamw::Optimizer::AdamCount { .. })
        ) {
            continue;
        }
        let err = d.launch(Stream::Compute, &k, 4, 32).unwrap_err();
        // A bf16 kernel (or one rounding its f32 result to bf16, `_to_bf16`) runs as its
        // f32 one over widened copies, the FlashAttention-2
        // forward and backward as the plain attention's: the refusal names that one.
        let f32_name = match k {
            Kernel::Attention(AttentionKernel::Fa2Fwd { .. }) => "attention_fwd",
            Kernel::Attention(AttentionKernel::Fa2Bwd { .. }) => "attention_bwd",
            _ => k.name().trim_end_matches("_bf16").trim_end_matches("_to"),
        };
        assert!(
            matches!(&err, GpuError::Invalid(m) if m.starts_with(f32_name) && m.contains("holds 0 elements, the launch needs")),
            "{}: {err}",
            k.name()
        );
        checked += 1;
    }
    assert_eq!(
        checked,
        dflash_worker::device::nvrtc::kernel_names(dflash_worker::device::nvrtc::KERNELS_CU).len()
            - 1
    );
}

/// A kernel that writes a buffer overlapping another of its arguments is refused (the
/// CPU kernels take them as separate slices).
#[test]
fn cpu_device_refuses_a_written_buffer_that_overlaps_another_argument() {
    use dflash_worker::device::ops::kernel::{DType, Kernel};
    use dflash_worker::device::{DSlice, Device, GpuError, Stream};
    let mut d = dflash_worker::device::cpu::CpuDevice::new();
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
    let add = |x, y| {
        Kernel::Convert(dflash_worker::device::ops::convert::Convert::AddInplace {
            act: DType::F32,
            x,
            y,
            n: 32,
        })
    };
    let err = d.launch(Stream::Compute, &add(x, y), 1, 32).unwrap_err();
    assert!(
        matches!(&err, GpuError::Invalid(m) if m.contains("overlaps")),
        "{err}"
    );
    let y = DSlice {
        ptr: p + 32 * 4,
        bytes: 32 * 4,
    };
    d.launch(Stream::Compute, &add(x, y), 1, 32).unwrap();
}

/// Held-out evaluation (`--eval-data`) is the training forward alone: on the same batch at
/// the same weights, `evaluate` gives exactly the statistics `forward_backward`
/// reports, and leaves the gradient that a rank holds for its next step as it was.
#[test]
fn eval_stats_are_the_training_forwards_on_the_same_batch_and_leave_the_gradient_alone() {
    use dflash_shared::drafter::DrafterConfig;
    use dflash_shared::rng::Rng;
    use dflash_worker::models::drafter::device::{DeviceDrafter, GradTo, Rows};
    use dflash_worker::models::drafter::{Drafter, Frozen, Sample};
    let c = DrafterConfig {
        hidden: 32,
        layers: 1,
        q_heads: 2,
        kv_heads: 1,
        head_dim: 16,
        intermediate: 48,
        vocab: 300,
        eps: 1e-6,
        rope_theta: 10000.0,
        rope_scaling: None,
        n_taps: 2,
        block_size: 4,
        max_anchors: 4,
        mask_token_id: 299,
        gamma: 4.0,
    };
    let d = Drafter::new(c.clone());
    let mut rng = Rng::new(5);
    let mut rv = |n: usize, s: f32| -> Vec<f32> {
        (0..n)
            .map(|_| (rng.next_u64() % 2001) as f32 / 1000.0 * s - s)
            .collect()
    };
    let frozen = Frozen {
        embed: rv(c.vocab * c.hidden, 1.0),
        lm_head: rv(c.vocab * c.hidden, 0.5),
    };
    let lens = [19usize, 9];
    let taps16: Vec<Vec<u8>> = lens
        .iter()
        .map(|&l| {
            rv(l * c.n_taps * c.hidden, 1.0)
                .iter()
                .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
                .collect()
        })
        .collect();
    let ids: Vec<Vec<u32>> = lens
        .iter()
        .map(|&l| (0..l).map(|t| ((t * 37 + l) % 290) as u32).collect())
        .collect();
    let masks: Vec<Vec<u8>> = lens.iter().map(|&l| vec![1u8; l]).collect();
    let mut arng = Rng::new(9);
    let anchors: Vec<Vec<usize>> = masks
        .iter()
        .map(|m| d.sample_anchors(m, &mut arng))
        .collect();
    let bare: Vec<Sample> = (0..2)
        .map(|i| Sample {
            taps: &[],
            ids: &ids[i],
            mask: &masks[i],
        })
        .collect();
    let raw: Vec<&[u8]> = taps16.iter().map(|t| t.as_slice()).collect();
    let mut gpu = DeviceDrafter::new(device(), &d, &frozen, 32).unwrap();
    let p = d.init_params(3);
    let zeros = vec![0f32; p.len()];
    gpu.load(&p, &zeros, &zeros, 0).unwrap();
    let train = gpu
        .forward_backward(&bare, Rows::Bf16(&raw), &anchors, 1.0, GradTo::Device)
        .unwrap();
    let mut held = vec![0u8; p.len() * 4];
    gpu.grads_to_host(&mut held).unwrap();
    let eval = gpu.evaluate(&bare, Rows::Bf16(&raw), &anchors).unwrap();
    assert!(train.blocks > 0 && train.tokens == 28, "{train:?}");
    assert_eq!(
        (
            eval.loss_sum,
            eval.weight_sum,
            eval.accept_sum,
            eval.blocks,
            eval.tokens,
            eval.anchors,
            &eval.slot_correct,
            &eval.slot_total
        ),
        (
            train.loss_sum,
            train.weight_sum,
            train.accept_sum,
            train.blocks,
            train.tokens,
            train.anchors,
            &train.slot_correct,
            &train.slot_total
        )
    );
    let mut after = vec![0u8; p.len() * 4];
    gpu.grads_to_host(&mut after).unwrap();
    assert!(held.iter().any(|&b| b != 0), "a gradient is held");
    assert_eq!(after, held, "the eval left the held gradient as it was");
    assert_eq!(
        gpu.params_hash().unwrap(),
        dflash_worker::device::ops::params_hash(&p)
    );
}
