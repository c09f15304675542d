//! The production GPU path (`gpu/cuda.rs`: cudarc's context, streams, events, copies,
//! module load, launches, cuBLAS) over the emulated CUDA stack of tests/emu-cuda: every
//! device parity test (parity/tests.rs) with `CudaDevice` as the device, plus the GPU
//! risks the emulated driver can show without a GPU (old drivers and PTX, stream-ordered
//! memory, a cuBLAS handle shared by two streams, errors that must not read as "not done").
//!
//! The emulated libraries are found next to this test's executable (target/<profile>/,
//! built by `cargo build --workspace`, which scripts/test.sh runs first) and named to the
//! worker by the same overrides a user has: `DFLASH_CUDA_LIB`, `DFLASH_CUBLAS_LIB`,
//! `DFLASH_NCCL_LIB`. NVRTC (PyPI's nvidia-cuda-nvrtc) compiles the kernels, as on a GPU;
//! without it these tests fail under CI and fall back to the host device elsewhere.

use std::path::PathBuf;
use std::process::Command;
use std::sync::Once;

use dflash_worker::device::cuda::{cublas_dims, CudaDevice};
use dflash_worker::device::Device;

/// target/<profile>/ (this executable is target/<profile>/deps/emulated_cuda-HASH).
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent()
        .and_then(|d| d.parent())
        .expect("target/<profile>/deps")
        .to_path_buf()
}

fn emu_libs() -> (PathBuf, PathBuf) {
    let dir = target_dir();
    let (cuda, cublas) = (
        dir.join("libdflash_emu_cuda.so"),
        dir.join("libdflash_emu_cublas.so"),
    );
    assert!(cuda.is_file() && cublas.is_file(), "the emulated CUDA stack is not built ({} / {}): cargo build -p dflash-emu-cuda -p dflash-emu-cublas", cuda.display(), cublas.display());
    (cuda, cublas)
}

fn nvrtc_present() -> bool {
    dflash_worker::device::nvrtc::load().is_ok()
}

fn required() -> bool {
    std::env::var_os("CI").is_some()
        || std::env::var("DFLASH_REQUIRE_NVRTC").is_ok_and(|v| v == "1")
}

/// Point the worker's library search at the emulated stack (once, before any CUDA call).
fn use_emulated_stack() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let (cuda, cublas) = emu_libs();
        std::env::set_var("DFLASH_CUDA_LIB", &cuda);
        std::env::set_var("DFLASH_CUBLAS_LIB", &cublas);
        std::env::set_var("DFLASH_NCCL_LIB", &cuda);
        std::env::set_var("DFLASH_TEST_DEVICE", "cuda");
        std::env::set_var("DFLASH_KERNEL_CACHE", target_dir().join("emu-kernel-cache"));
    });
}

/// The device under test: `CudaDevice` over the emulated driver.
fn device() -> Box<dyn Device> {
    use_emulated_stack();
    if !nvrtc_present() {
        assert!(
            !required(),
            "NVRTC not found (pip install nvidia-cuda-nvrtc); .ci/run installs it"
        );
        eprintln!("NVRTC not found: this test runs on the host device instead of the emulated GPU");
        return Box::new(dflash_worker::device::host::HostDevice::new());
    }
    Box::new(CudaDevice::open().unwrap_or_else(|e| panic!("opening the emulated GPU: {e}")))
}

include!("parity/tests.rs");

/// Run this test again in a child process with `env` (the emulated machine is set per
/// process); the child runs `body`. Returns the child's success and its output.
fn in_child(test: &str, env: &[(&str, &str)], body: impl FnOnce()) -> Option<(bool, String)> {
    if std::env::var("DFLASH_EMU_CHILD").as_deref() == Ok(test) {
        body();
        return None;
    }
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", test, "--nocapture", "--test-threads", "1"])
        .env("DFLASH_EMU_CHILD", test);
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().expect("running the child test");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Some((out.status.success(), text))
}

fn skip_without_nvrtc() -> bool {
    use_emulated_stack();
    if nvrtc_present() {
        return false;
    }
    assert!(
        !required(),
        "NVRTC not found (pip install nvidia-cuda-nvrtc); .ci/run installs it"
    );
    eprintln!("skipped: NVRTC not found");
    true
}

#[test]
fn emulated_a_driver_older_than_nvrtc_runs_the_cubin() {
    if skip_without_nvrtc() {
        return;
    }
    // CUDA 12.8 takes PTX up to ISA 8.7; NVRTC 13.x writes 9.x. The CUBIN loads anyway.
    let child = in_child(
        "emulated_a_driver_older_than_nvrtc_runs_the_cubin",
        &[("DFLASH_EMU_DRIVER_VERSION", "12080")],
        || {
            let dev = CudaDevice::open().unwrap_or_else(|e| panic!("a 12.8 driver: {e}"));
            for l in &dev.libraries {
                println!("library: {l}");
            }
            let mut o = dflash_worker::device::ops::Ops::new(Box::new(dev));
            let a = put(&mut o, &[1.0, 2.0, 3.0]);
            let b = put(&mut o, &[10.0, 20.0, 30.0]);
            o.add(b, a).unwrap();
            assert_eq!(get(&mut o, b), vec![11.0, 22.0, 33.0]);
        },
    );
    if let Some((ok, out)) = child {
        assert!(ok, "{out}");
        assert!(
            out.contains("kernels: CUBIN for sm_90"),
            "the kernels were loaded as CUBIN: {out}"
        );
        assert!(
            out.contains("driver for CUDA 12.8"),
            "the driver's version is reported: {out}"
        );
        for lib in ["libdflash_emu_cuda.so", "libdflash_emu_cublas.so"] {
            assert!(
                out.contains(lib),
                "where each library came from is reported ({lib}): {out}"
            );
        }
    }
}

#[test]
fn emulated_an_old_driver_that_refuses_the_cubin_names_both_versions() {
    if skip_without_nvrtc() {
        return;
    }
    let child = in_child(
        "emulated_an_old_driver_that_refuses_the_cubin_names_both_versions",
        &[
            ("DFLASH_EMU_DRIVER_VERSION", "12040"),
            ("DFLASH_EMU_REFUSE_CUBIN", "1"),
        ],
        || {
            let err = CudaDevice::open()
                .err()
                .expect("a 12.4 driver that takes neither image");
            println!("error: {err}");
        },
    );
    if let Some((ok, out)) = child {
        assert!(ok, "{out}");
        let line = out
            .lines()
            .find_map(|l| l.find("error: GPU").map(|i| &l[i..]))
            .unwrap_or_else(|| panic!("no error line: {out}"));
        assert!(
            line.contains("GPU unavailable"),
            "a permanent failure: {line}"
        );
        assert!(
            line.contains("this driver is for CUDA 12.4")
                && line.contains("no newer than CUDA 12.4"),
            "the driver's version: {line}"
        );
        assert!(
            line.contains("PTX (ISA 9.") && line.contains("from NVRTC 13."),
            "the PTX's and NVRTC's versions: {line}"
        );
        assert!(
            line.contains("CUDA_ERROR_UNSUPPORTED_PTX_VERSION")
                && line.contains("CUDA_ERROR_NO_BINARY_FOR_GPU"),
            "both refusals: {line}"
        );
    }
}

#[test]
fn emulated_a_refused_cubin_falls_back_to_ptx_on_a_new_driver() {
    if skip_without_nvrtc() {
        return;
    }
    let child = in_child(
        "emulated_a_refused_cubin_falls_back_to_ptx_on_a_new_driver",
        &[("DFLASH_EMU_REFUSE_CUBIN", "1")],
        || {
            let dev = CudaDevice::open().unwrap_or_else(|e| panic!("PTX on a current driver: {e}"));
            println!("{}", dev.libraries.join("\n"));
        },
    );
    if let Some((ok, out)) = child {
        assert!(ok, "{out}");
        assert!(
            out.contains("was refused") && out.contains("loaded their PTX"),
            "the fallback is said: {out}"
        );
        assert!(out.contains("kernels: PTX"), "{out}");
    }
}

#[test]
fn emulated_arena_memory_is_usable_on_both_streams_at_once() {
    if skip_without_nvrtc() {
        return;
    }
    // Stream-ordered memory (cuMemAllocAsync on the compute stream) used on the copy stream
    // with nothing between would be refused by the driver (and is undefined on a GPU).
    let mut dev = device();
    let p = dev.alloc(4096).unwrap();
    let buf = DSlice {
        ptr: p,
        bytes: 4096,
    };
    let bytes: Vec<u8> = (0..4096u32).map(|i| (i % 251) as u8).collect();
    dev.upload(dflash_worker::device::Stream::Copy, buf, &bytes)
        .unwrap();
    let mut back = vec![0u8; 4096];
    dev.download(dflash_worker::device::Stream::Copy, buf, &mut back)
        .unwrap();
    assert_eq!(back, bytes);
    // Fresh memory is zeroed by alloc before anyone uses it (the driver's is NaN garbage).
    let q = dev.alloc(256).unwrap();
    let mut z = vec![1u8; 256];
    dev.download(
        dflash_worker::device::Stream::Copy,
        DSlice { ptr: q, bytes: 256 },
        &mut z,
    )
    .unwrap();
    assert!(z.iter().all(|&b| b == 0));
}

#[test]
fn emulated_gemms_on_both_streams_use_a_handle_each() {
    if skip_without_nvrtc() {
        return;
    }
    // The copy stream's reduction GEMM beside the compute stream's: one handle for both
    // would share its workspace between two GEMMs that may run at once (refused by the
    // emulated cuBLAS).
    let mut dev = device();
    let mk = |dev: &mut Box<dyn Device>, v: &[f32]| {
        let p = dev.alloc(v.len() * 4).unwrap();
        let s = DSlice {
            ptr: p,
            bytes: v.len() * 4,
        };
        dev.upload(
            dflash_worker::device::Stream::Compute,
            s,
            dflash_worker::device::f32_bytes(v),
        )
        .unwrap();
        s
    };
    let (a, b) = (
        mk(&mut dev, &[1.0, 2.0, 3.0, 4.0]),
        mk(&mut dev, &[1.0, 0.0, 0.0, 1.0]),
    );
    let (c1, c2) = (mk(&mut dev, &[0.0; 4]), mk(&mut dev, &[0.0; 4]));
    let g = |c: DSlice| Gemm {
        transa: false,
        transb: false,
        m: 2,
        n: 2,
        k: 2,
        alpha: 1.0,
        a,
        lda: 2,
        b,
        ldb: 2,
        beta: 0.0,
        c,
        ldc: 2,
        bf16_inputs: false,
        bf16_output: false,
    };
    dev.sync().unwrap();
    dev.gemm(dflash_worker::device::Stream::Compute, &g(c1))
        .unwrap();
    dev.gemm(dflash_worker::device::Stream::Copy, &g(c2))
        .unwrap();
    dev.gemm(dflash_worker::device::Stream::Compute, &g(c1))
        .unwrap();
    dev.sync().unwrap();
    for c in [c1, c2] {
        let mut v = vec![0f32; 4];
        dev.download(
            dflash_worker::device::Stream::Compute,
            c,
            dflash_worker::device::f32_bytes_mut(&mut v),
        )
        .unwrap();
        assert_eq!(v, vec![1.0, 2.0, 3.0, 4.0], "A·I = A");
    }
}

#[test]
fn emulated_a_failed_kernel_is_an_error_of_its_event_not_a_wait() {
    if skip_without_nvrtc() {
        return;
    }
    let child = in_child(
        "emulated_a_failed_kernel_is_an_error_of_its_event_not_a_wait",
        &[],
        || {
            let mut dev = device();
            let p = dev.alloc(256).unwrap();
            let ok = DSlice { ptr: p, bytes: 256 };
            // An address that is no device memory: the kernel faults (asynchronously, sticky).
            let bad = DSlice {
                ptr: 0x10,
                bytes: 256,
            };
            let add = dflash_worker::device::ops::kernel::Kernel::Convert(
                dflash_worker::device::ops::convert::Convert::AddInplace {
                    act: dflash_worker::device::ops::kernel::DType::F32,
                    x: ok,
                    y: bad,
                    n: 64,
                },
            );
            dev.launch(dflash_worker::device::Stream::Compute, &add, 1, 64)
                .unwrap();
            let e = dev.record(dflash_worker::device::Stream::Compute).unwrap();
            // Polled as a worker's loop polls an all-reduce: an error within a bounded number of
            // polls, never "not done yet" forever.
            let mut outcome = None;
            for _ in 0..10_000 {
                match dev.event_done(e) {
                    Ok(true) => panic!("a faulted stream's event reads as complete"),
                    Ok(false) => std::thread::yield_now(),
                    Err(err) => {
                        outcome = Some(err);
                        break;
                    }
                }
            }
            let err = outcome.expect("the event of a faulted stream stayed 'not done'");
            println!("event error: {err}");
        },
    );
    if let Some((ok, out)) = child {
        assert!(ok, "{out}");
        assert!(
            out.contains("event error:") && out.contains("CUDA_ERROR_ILLEGAL_ADDRESS"),
            "{out}"
        );
        assert!(
            out.contains("kernel add_inplace parameter 1"),
            "the driver names the faulting parameter: {out}"
        );
    }
}

#[test]
fn gemm_sizes_beyond_cublas_int_are_refused_not_truncated() {
    let s = DSlice {
        ptr: 0,
        bytes: usize::MAX,
    };
    let big = Gemm {
        transa: false,
        transb: false,
        m: 1 << 31,
        n: 1,
        k: 1,
        alpha: 1.0,
        a: s,
        lda: 1 << 31,
        b: s,
        ldb: 1,
        beta: 0.0,
        c: s,
        ldc: 1 << 31,
        bf16_inputs: false,
        bf16_output: false,
    };
    let err = cublas_dims(&big).unwrap_err();
    assert!(
        err.to_string()
            .contains("m = 2147483648 exceeds cuBLAS's int range"),
        "{err}"
    );
    let fits = Gemm {
        m: (1 << 31) - 1,
        lda: (1 << 31) - 1,
        ldc: (1 << 31) - 1,
        ..big
    };
    assert_eq!(
        cublas_dims(&fits).unwrap(),
        [i32::MAX, 1, 1, i32::MAX, 1, i32::MAX]
    );
}

/// A kernel may have more than 48 KB of dynamic shared memory only once the module load has
/// raised its limit (the FlashAttention-2 forward at head dim 128 takes 68 KB; the parity
/// tests run it here): a launch past a kernel's limit is refused by the driver, with the
/// kernel and the sizes named.
#[test]
fn emulated_dynamic_shared_memory_past_a_kernels_limit_is_refused() {
    if skip_without_nvrtc() {
        return;
    }
    let child = in_child(
        "emulated_dynamic_shared_memory_past_a_kernels_limit_is_refused",
        &[],
        || {
            use dflash_worker::device::ops::attention::AttentionKernel;
            use dflash_worker::device::ops::{Attention, Fa2Dim};
            let mut dev = CudaDevice::open().expect("the emulated device");
            let fa2 = AttentionKernel::Fa2Fwd {
                act: dflash_worker::device::ops::kernel::DType::Bf16,
                dim: Fa2Dim::D128,
                a: Attention::shape_of(1, 1, 1, 128),
            };
            assert!(fa2.dynamic_shared_bytes() > 48 * 1024);
            let p = dev.alloc(256).unwrap();
            let x = DSlice { ptr: p, bytes: 256 };
            let args = [
                dflash_worker::device::Arg::RW(x),
                dflash_worker::device::Arg::R(x),
                dflash_worker::device::Arg::I64(0),
            ];
            // add_inplace keeps the default limit: 48 KB pass, 48 KB + 1 do not.
            dev.launch_shared(
                dflash_worker::device::Stream::Compute,
                "add_inplace",
                1,
                32,
                48 * 1024,
                &args,
            )
            .expect("48 KB of dynamic shared memory need no opt-in");
            let err = dev
                .launch_shared(
                    dflash_worker::device::Stream::Compute,
                    "add_inplace",
                    1,
                    32,
                    48 * 1024 + 1,
                    &args,
                )
                .unwrap_err();
            println!("refused: {err}");
        },
    );
    if let Some((ok, out)) = child {
        assert!(ok, "{out}");
        assert!(
            out.contains("refused:")
                && out.contains("add_inplace")
                && out.contains("49153 bytes of dynamic shared memory"),
            "{out}"
        );
    }
}

/// The emulated driver's count of dry host waits (`dflash_emu_dry_waits`): waits after
/// which the stream waited for had nothing queued, so that a GPU would idle.
fn dry_waits() -> u64 {
    let (cuda, _) = emu_libs();
    let path = std::ffi::CString::new(cuda.to_str().expect("a UTF-8 path")).unwrap();
    // SAFETY: the library is loaded already (the device opened it); NOLOAD only finds it.
    unsafe {
        let h = libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        assert!(!h.is_null(), "the emulated driver is loaded");
        let f = libc::dlsym(h, c"dflash_emu_dry_waits".as_ptr());
        assert!(!f.is_null(), "the emulated driver counts dry waits");
        let f: extern "C" fn() -> u64 = std::mem::transmute(f);
        f()
    }
}

/// A drafter step on a GPU queues its update, its whole forward, loss and backward and the
/// weights' checksum without letting the compute stream run dry: the step's losses come
/// back behind an event the host waits for only once the last backward is queued, and the
/// checksum (computed right after the update) is read after that. A step that downloads
/// its gradient (the host collective's path) waits dry once, which shows the count sees
/// such waits.
#[test]
fn emulated_a_drafter_step_never_lets_the_compute_stream_run_dry() {
    if skip_without_nvrtc() {
        return;
    }
    let test = "emulated_a_drafter_step_never_lets_the_compute_stream_run_dry";
    let child = in_child(test, &[], || {
        use dflash_shared::drafter::DrafterConfig;
        use dflash_worker::models::drafter::device::{DeviceDrafter, GradTo, Gradient, Rows, Step};
        use dflash_worker::models::drafter::{Drafter, Frozen, Sample};
        let c = DrafterConfig {
            hidden: 32,
            layers: 2,
            q_heads: 2,
            kv_heads: 1,
            head_dim: 16,
            intermediate: 40,
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
        let mut rng = Rng::new(7);
        let p = d.init_params(3);
        let frozen = Frozen {
            embed: rand_vec(&mut rng, c.vocab * c.hidden, 1.0),
            lm_head: rand_vec(&mut rng, c.vocab * c.hidden, 0.1),
        };
        let len = 20usize;
        let taps: Vec<Vec<f32>> = (0..3)
            .map(|_| rand_vec(&mut rng, len * c.n_taps * c.hidden, 1.0))
            .collect();
        let ids: Vec<Vec<u32>> = (0..3)
            .map(|i| (0..len).map(|t| ((t * 7 + i) % 290) as u32).collect())
            .collect();
        let mask = vec![1u8; len];
        let anchors: Vec<Vec<usize>> = (0..3).map(|_| d.sample_anchors(&mask, &mut rng)).collect();
        let samples: Vec<Sample> = (0..3)
            .map(|i| Sample {
                taps: &taps[i],
                ids: &ids[i],
                mask: &mask,
            })
            .collect();
        let tw = d.total_weight(&samples, &anchors);
        let dev = CudaDevice::open().unwrap_or_else(|e| panic!("opening the emulated GPU: {e}"));
        let mut gpu = DeviceDrafter::new(Box::new(dev), &d, &frozen, len).unwrap();
        let zeros = vec![0f32; p.len()];
        gpu.load(&p, &zeros, &zeros, 0).unwrap();
        // The first step settles what is loaded once.
        let first = gpu
            .forward_backward(&samples, Rows::F32, &anchors, tw, GradTo::Device)
            .unwrap();
        let hyper = dflash_worker::models::drafter::AdamW::new(p.len()).hyper();
        // A rank's whole step as a worker runs it: the group's reduction (one rank) and
        // the update queued, the next batch's forward and backward, then the checksum
        // of the weights that batch was computed with.
        let before = dry_waits();
        let e = gpu.reduce_alone().unwrap();
        gpu.update(
            &Step::new(1, 1.0, 1e-2, &hyper),
            Gradient::Reduced {
                weight_sum: first.weight_sum,
                after: Some(e),
            },
        )
        .unwrap();
        let st = gpu
            .forward_backward(&samples, Rows::F32, &anchors, tw, GradTo::Device)
            .unwrap();
        let checksum = gpu.weights_checksum().unwrap();
        let step = dry_waits() - before;
        assert_eq!(
            checksum,
            gpu.params_hash().unwrap(),
            "the checksum read behind the step is the updated weights'"
        );
        let mut g = vec![0f32; p.len()];
        let before = dry_waits();
        gpu.forward_backward(&samples, Rows::F32, &anchors, tw, GradTo::Host(&mut g))
            .unwrap();
        let with_download = dry_waits() - before;
        assert!(
            st.loss_sum.is_finite() && st.loss_sum > 0.0,
            "the step's loss came back: {}",
            st.loss_sum
        );
        assert!(g.iter().any(|&x| x != 0.0), "the gradient came back");
        println!("dry waits: step {step}, step with its gradient downloaded {with_download}");
    });
    if let Some((ok, out)) = child {
        assert!(ok, "{out}");
        let (line, n) = dry_wait_counts(&out);
        assert_eq!(
            n[0], 0,
            "a step leaves the compute stream queued at every wait: {line}"
        );
        assert!(
            n[1] >= 1,
            "the gradient's download is a dry wait, and is counted: {line}"
        );
    }
}

/// A Qwen3-MoE target's forward on a GPU waits on the host no more than a dense Qwen3's of
/// the same shape: the routing, the permutation and the grouped GEMMs keep the per-expert
/// row counts on the device (an offsets download per sparse layer would add a dry wait for
/// each of the 3 sparse layers). The taps equal the CPU target's.
#[test]
fn emulated_a_moe_forward_waits_on_the_host_no_more_than_a_dense_one() {
    if skip_without_nvrtc() {
        return;
    }
    let test = "emulated_a_moe_forward_waits_on_the_host_no_more_than_a_dense_one";
    let child = in_child(test, &[], || {
        use dflash_worker::models::target::device::DeviceTarget;
        use dflash_worker::models::target::Target;
        let moe = qwen3_moe(2);
        // The same model without experts: every layer dense.
        let dense = moe
            .replace("Qwen3MoeForCausalLM", "Qwen3ForCausalLM")
            .replace("\"qwen3_moe\"", "\"qwen3\"");
        let ids: Vec<u32> = (0..33u32).map(|i| (i * 37 + 5) % 300).collect();
        let mut waits = Vec::new();
        for (name, config) in [("moe", &moe), ("dense", &dense)] {
            let tmp = tempfile::tempdir().unwrap();
            dflash_worker::models::tiny::write_random(tmp.path(), config, 23).unwrap();
            let cpu = Target::load(tmp.path(), &[0, 3]).unwrap();
            assert_eq!(cpu.cfg.moe.is_some(), name == "moe", "{name}");
            let dev =
                CudaDevice::open().unwrap_or_else(|e| panic!("opening the emulated GPU: {e}"));
            let mut gpu = DeviceTarget::new(Box::new(dev), &cpu, 40).unwrap();
            // The first forward settles what is loaded once.
            gpu.forward_rows(&[&ids]).unwrap();
            let before = dry_waits();
            let taps = gpu.forward_rows(&[&ids]).unwrap();
            waits.push(dry_waits() - before);
            assert_close(
                &format!("{name} taps"),
                &taps[0],
                &cpu.forward_taps(&ids),
                2e-2,
            );
        }
        println!("dry waits: moe {} dense {}", waits[0], waits[1]);
    });
    if let Some((ok, out)) = child {
        assert!(ok, "{out}");
        let (line, n) = dry_wait_counts(&out);
        assert!(
            n[1] >= 1,
            "the taps' download is a dry wait, and is counted: {line}"
        );
        assert_eq!(n[0], n[1], "the MoE forward adds no host wait: {line}");
    }
}

/// The child's "dry waits: ..." line and the numbers on it, in order.
fn dry_wait_counts(out: &str) -> (&str, Vec<u64>) {
    let line = out
        .lines()
        .find_map(|l| l.find("dry waits:").map(|i| &l[i..]))
        .unwrap_or_else(|| panic!("no count: {out}"));
    let n = line
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|w| w.parse().ok())
        .collect();
    (line, n)
}

/// CPU time of the calling thread.
fn thread_cpu() -> std::time::Duration {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: writes one timespec.
    assert_eq!(
        unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) },
        0
    );
    std::time::Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// Work on the GPU that takes `GPU_WORK` without using a host core (a host function that
/// sleeps, queued on the stream).
const GPU_WORK: std::time::Duration = std::time::Duration::from_millis(400);

unsafe extern "C" fn gpu_busy(_: *mut std::ffi::c_void) {
    std::thread::sleep(GPU_WORK);
}

/// A worker that waits for its GPU sleeps: the emulated driver, like the real one, spins a
/// host thread in a stream or context sync unless the context was made with
/// `CU_CTX_SCHED_BLOCKING_SYNC`, and in an event sync unless the event was made with
/// `CU_EVENT_BLOCKING_SYNC`. Measured: the waiting thread's CPU time against the wait's
/// wall time, for a stream sync, an event sync and a download (a sync copy).
#[test]
fn emulated_a_thread_waiting_for_the_gpu_sleeps_instead_of_spinning() {
    if skip_without_nvrtc() {
        return;
    }
    use dflash_worker::device::{DSlice, Stream};
    let mut dev = device();
    let (ctx, streams) = dev.cuda_handles().expect("the CUDA device");
    let buf = dev.alloc(4096).unwrap();
    let slice = DSlice {
        ptr: buf,
        bytes: 4096,
    };
    let mut host = vec![0u8; 4096];
    type Wait<'a> = Box<dyn Fn(&mut dyn Device, &mut Vec<u8>) + 'a>;
    let waits: [(&str, Wait); 3] = [
        ("a stream sync", Box::new(|d, _| d.sync().unwrap())),
        (
            "an event sync",
            Box::new(|d, _| {
                let e = d.record(Stream::Compute).unwrap();
                d.sync_event(e).unwrap();
                d.release_event(e);
            }),
        ),
        (
            "a download",
            Box::new(|d, h| d.download(Stream::Compute, slice, h).unwrap()),
        ),
    ];
    for (what, wait) in &waits {
        ctx.bind_to_thread().unwrap();
        // SAFETY: a live stream of the device; the function takes no data.
        unsafe {
            cudarc::driver::sys::cuLaunchHostFunc(streams[0], Some(gpu_busy), std::ptr::null_mut())
        }
        .result()
        .unwrap();
        let (cpu0, t0) = (thread_cpu(), std::time::Instant::now());
        wait(dev.as_mut(), &mut host);
        let (cpu, wall) = (thread_cpu() - cpu0, t0.elapsed());
        eprintln!(
            "{what}: waited {:.0} ms, {:.1} ms of CPU ({:.1} %)",
            wall.as_secs_f64() * 1e3,
            cpu.as_secs_f64() * 1e3,
            100.0 * cpu.as_secs_f64() / wall.as_secs_f64()
        );
        assert!(
            wall >= GPU_WORK.mul_f64(0.9),
            "{what} returned after {wall:?}, before the GPU's {GPU_WORK:?} of work"
        );
        assert!(
            cpu < wall / 5,
            "{what} spun: {cpu:?} of CPU in a {wall:?} wait"
        );
    }
}

/// The kernel cache holds, for this source and sm_90, only an entry that another NVRTC
/// made (as the GPU bundle carries them), and the driver refuses its CUBIN (here: one for
/// another architecture under that name). The worker then compiles with this machine's
/// NVRTC and loads that CUBIN, rather than falling back to the other entry's PTX. With no
/// refusal, another NVRTC's entry is used as it is, and nothing compiles.
#[test]
fn emulated_a_refused_cubin_from_another_nvrtc_is_compiled_again_here() {
    if skip_without_nvrtc() {
        return;
    }
    use dflash_worker::device::nvrtc;
    let test = "emulated_a_refused_cubin_from_another_nvrtc_is_compiled_again_here";
    let cache = tempfile::tempdir().unwrap();
    let stem = |arch: &str, v: &str| {
        format!(
            "kernels-{:016x}-{arch}-nvrtc{v}",
            nvrtc::source_hash(nvrtc::KERNELS_CU)
        )
    };
    if std::env::var("DFLASH_EMU_CHILD").as_deref() != Ok(test) {
        // The foreign entry: sm_80's image filed under sm_90, as "NVRTC 99.0" made it.
        let sm80 = nvrtc::compile(nvrtc::KERNELS_CU, "sm_80").unwrap();
        let s = stem("sm_90", "99.0");
        std::fs::write(cache.path().join(format!("{s}.cubin")), &sm80.cubin).unwrap();
        std::fs::write(cache.path().join(format!("{s}.ptx")), &sm80.ptx).unwrap();
    }
    let dir = cache.path().to_str().unwrap().to_string();
    let child = in_child(test, &[("DFLASH_TEST_KERNEL_CACHE", &dir)], || {
        // (use_emulated_stack points the cache at the shared one: this test's instead.)
        std::env::set_var(
            "DFLASH_KERNEL_CACHE",
            std::env::var_os("DFLASH_TEST_KERNEL_CACHE").unwrap(),
        );
        let dev = CudaDevice::open().unwrap_or_else(|e| panic!("{e}"));
        for l in &dev.libraries {
            println!("library: {l}");
        }
    });
    if let Some((ok, out)) = child {
        assert!(ok, "{out}");
        assert!(
            out.contains("kernels: CUBIN for sm_90"),
            "this NVRTC's CUBIN was loaded, not the PTX: {out}"
        );
        let (major, minor) = nvrtc::version().unwrap();
        let own = cache.path().join(format!(
            "{}.cubin",
            stem("sm_90", &format!("{major}.{minor}"))
        ));
        assert!(own.is_file(), "compiled here and cached: {out}");
        // A later start takes this NVRTC's entry first: nothing refused, nothing compiled.
        let (again, cached) = nvrtc::compile_cached_reusing(
            nvrtc::KERNELS_CU,
            "sm_90",
            cache.path(),
            nvrtc::Reuse::AnyNvrtc,
        )
        .unwrap();
        assert!(cached && again.cubin == std::fs::read(&own).unwrap());
    }
}
