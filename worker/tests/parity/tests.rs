// The device parity tests: every kernel and the device models against the CPU reference.
// Included by host_device.rs (the host device, or a GPU) and cpu_device.rs (the CPU device),
// each of which defines `device()`.

use dflash_shared::rng::Rng;
use dflash_worker::reference::ops::Cpu;
use dflash_worker::reference::{Heads, KeySpan};
use dflash_worker::device::ops::kernel::DType;
use dflash_worker::device::ops::{Attention, AttentionGrad, Fa2Dim};
use dflash_worker::device::ops::CeState;
use dflash_worker::device::ops::Ops;
use dflash_worker::device::ops::{gemm::Dx, AdamBuffers, Mat};
use dflash_worker::models::drafter::device::{GradTo, Gradient, Rows, Step};
use dflash_worker::device::{f32_bytes, f32_bytes_mut, i32_bytes, u32_bytes, DSlice, Gemm, GpuError, Stream};

fn rand_vec(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| ((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale).collect()
}

#[allow(dead_code)]
fn on_gpu() -> bool {
    std::env::var("DFLASH_TEST_DEVICE").as_deref() == Ok("cuda")
}

fn ops() -> Ops {
    Ops::new(device())
}

fn put(o: &mut Ops, v: &[f32]) -> DSlice {
    let p = o.dev.alloc(v.len() * 4).unwrap();
    let s = DSlice { ptr: p, bytes: v.len() * 4 };
    o.dev.upload(Stream::Compute, s, f32_bytes(v)).unwrap();
    s
}

fn put_i32(o: &mut Ops, v: &[i32]) -> DSlice {
    let p = o.dev.alloc(v.len() * 4).unwrap();
    let s = DSlice { ptr: p, bytes: v.len() * 4 };
    o.dev.upload(Stream::Compute, s, i32_bytes(v)).unwrap();
    s
}

fn get(o: &mut Ops, s: DSlice) -> Vec<f32> {
    let mut v = vec![0f32; s.bytes / 4];
    o.dev.download(Stream::Compute, s, f32_bytes_mut(&mut v)).unwrap();
    v
}

/// Largest |a − b| relative to the largest |b| (or 1 for tiny references).
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths differ");
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max) / scale
}

thread_local! {
    /// Failed comparisons of the running test, while it collects them (see [`all_checks`]).
    static FAILED: std::cell::RefCell<Option<Vec<String>>> = const { std::cell::RefCell::new(None) };
}

/// Until the returned guard is dropped, a failed tolerance check is printed and kept rather
/// than ending the test, so one run (on a GPU: one row of scripts/gpu_check.sh per test)
/// shows every comparison that fails, not only the first; the guard fails the test at its
/// end with all of them.
#[must_use]
fn all_checks() -> AllChecks {
    FAILED.with(|f| *f.borrow_mut() = Some(Vec::new()));
    AllChecks
}

struct AllChecks;

impl Drop for AllChecks {
    fn drop(&mut self) {
        let failed = FAILED.with(|f| f.borrow_mut().take()).unwrap_or_default();
        if !failed.is_empty() && !std::thread::panicking() {
            panic!("{} comparison(s) failed:\n  {}", failed.len(), failed.join("\n  "));
        }
    }
}

/// A tolerance check: kept when the test collects its failures, else an assertion.
fn check(ok: bool, msg: impl FnOnce() -> String) {
    if ok {
        return;
    }
    let msg = msg();
    let kept = FAILED.with(|f| f.borrow_mut().as_mut().map(|v| v.push(msg.clone())).is_some());
    if kept {
        eprintln!("FAILED: {msg}");
    } else {
        panic!("{msg}");
    }
}

fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    check(got.iter().all(|x| x.is_finite()), || format!("{what}: non-finite output"));
    let e = rel_err(got, want);
    eprintln!("{what}: max relative error {e:.2e} (tolerance {tol:.0e})");
    check(e <= tol, || format!("{what}: max relative error {e:e} > {tol:e}"));
}

// f32 tolerances: the device sums in another order (warp trees, GEMM blocking) and uses
// f32 where the CPU uses f64 for a few reductions.
const TOL: f32 = 2e-5;

/// Two runs of one backward on a GPU agree to rounding, not to the bit: the attention
/// backward adds each key's (or query's) gradient by float
/// atomics from many blocks, in the order the blocks happen to run (the host device runs
/// them, and their threads, in another order every launch, to show it). Relative to the
/// largest gradient, orders differ by a few f32 roundings (at most 1.8e-7 seen over seeds
/// and orders); 1e-5 leaves room for that and is still far below what a wrong row or a
/// missed sample costs (1e-2 and more).
const ATOMIC_TOL: f32 = 1e-5;

/// `got` is the gradient `want` is, computed again: to the bit on the CPU device (no
/// atomics), within [`ATOMIC_TOL`] on a GPU or the host device.
fn assert_same_gradient(what: &str, got: &[f32], want: &[f32]) {
    if device().is_cpu() {
        check(got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()), || format!("{what}: not the same to the bit"));
    } else {
        assert_close(what, got, want, ATOMIC_TOL);
    }
}

/// One bf16 step (unit in the last place) at `v`: 2⁻⁷ of its power of two.
fn bf16_ulp(v: f32) -> f32 {
    let pow2 = f32::from_bits(v.abs().to_bits() & 0x7f80_0000);
    (pow2 * (1.0 / 128.0)).max(f32::MIN_POSITIVE)
}

/// A fused kernel's bf16 output `got` against the cast of the f32 kernel's output `want`:
/// the same bits off a GPU (the host device compiles both kernels' arithmetic alike). On a
/// GPU the two kernels' f32 arithmetic may be contracted differently (FMA), so the f32
/// values may differ in their last bits and round to neighbouring bf16 values: within one
/// bf16 step, never more.
fn assert_bf16_is_the_cast(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}");
    if !on_gpu() {
        assert_eq!(got, want, "{what}");
        return;
    }
    let bad = got.iter().zip(want).position(|(a, b)| (a - b).abs() > bf16_ulp(a.abs().max(b.abs())));
    assert!(bad.is_none(), "{what}: element {} is {} vs {} (more than one bf16 step)", bad.unwrap_or(0), got[bad.unwrap_or(0)], want[bad.unwrap_or(0)]);
}

/// A sum of `terms` non-negative f32 terms (a loss sum, a sum of squares) computed again:
/// to the bit off a GPU (every reduction there runs in a fixed order); on a GPU the order
/// may differ (atomics, another GEMM kernel), and reordering a sum of n non-negative terms
/// moves it by at most n·2⁻²⁴ of itself.
fn assert_same_sum(what: &str, got: f64, want: f64, terms: usize) {
    if !on_gpu() {
        assert_eq!(got.to_bits(), want.to_bits(), "{what}: {got} vs {want}, not the same to the bit");
        return;
    }
    let tol = terms.max(1) as f64 * (f32::EPSILON as f64 / 2.0) * want.abs();
    assert!((got - want).abs() <= tol, "{what}: {got} vs {want} (tolerance {tol:e}: {terms} terms reordered)");
}

/// Weights after one AdamW step from gradients that agree to [`ATOMIC_TOL`] (relative to
/// the largest): to the bit off a GPU. On a GPU each step lr·m̂/(√v̂+ε) is a ratio of the
/// gradient's moments, so it moves by at most lr·2·ATOMIC_TOL·(its size, at most about 1);
/// the weight plus its step is then rounded once more (one f32 ulp of the weight).
fn assert_same_step(what: &str, got: &[f32], want: &[f32], lr: f32) {
    if !on_gpu() {
        check(got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()), || format!("{what}: not the same to the bit"));
        return;
    }
    let bad = got.iter().zip(want).position(|(a, b)| {
        let ulp = f32::from_bits(a.abs().max(b.abs()).to_bits() & 0x7f80_0000) * f32::EPSILON;
        (a - b).abs() > lr * 2.0 * ATOMIC_TOL + 2.0 * ulp
    });
    check(bad.is_none(), || {
        let i = bad.unwrap_or(0);
        format!("{what}: weight {i} is {} vs {} after the step (lr {lr})", got[i], want[i])
    });
}

#[test]
fn host_device_matmul_and_its_backward_match_the_cpu_backend() {
    let _checks = all_checks();
    let mut rng = Rng::new(1);
    let (m, k, n) = (37, 53, 29);
    let (x, w, dy) = (rand_vec(&mut rng, m * k, 1.0), rand_vec(&mut rng, n * k, 1.0), rand_vec(&mut rng, m * n, 1.0));
    let cpu = Cpu::with_threads(1);
    let mut y = vec![0f32; m * n];
    cpu.matmul(&x, &w, &mut y, m, k, n);
    let (mut dx, mut dw) = (rand_vec(&mut rng, m * k, 1.0), rand_vec(&mut rng, n * k, 1.0));
    let (dx0, dw0) = (dx.clone(), dw.clone());
    cpu.matmul_backward(&dy, &x, &w, Some(&mut dx), Some(&mut dw), m, k, n);

    let mut o = ops();
    let (gx, gw, gdy) = (put(&mut o, &x), put(&mut o, &w), put(&mut o, &dy));
    let gy = put(&mut o, &vec![f32::NAN; m * n]);
    o.matmul(o.act_mat(gx, m, k), o.act_mat(gw, n, k), o.act_mat(gy, m, n)).unwrap();
    assert_close("matmul", &get(&mut o, gy), &y, TOL);
    let (gdx, gdw) = (put(&mut o, &dx0), put(&mut o, &dw0));
    o.matmul_backward(o.act_mat(gdy, m, n), o.act_mat(gx, m, k), o.act_mat(gw, n, k), Dx::Add(Mat::f32(gdx, m, k)), Some(Mat::f32(gdw, n, k))).unwrap();
    assert_close("matmul dx (accumulated)", &get(&mut o, gdx), &dx, TOL);
    assert_close("matmul dw (accumulated)", &get(&mut o, gdw), &dw, TOL);
}

type SgemmFn = unsafe extern "C" fn(i32, i32, i32, i32, i32, i32, f32, *const f32, i32, *const f32, i32, f32, *mut f32, i32);

/// cblas_sgemm from the system's OpenBLAS (Debian: libopenblas0), the reference for the
/// column-major convention.
fn openblas_sgemm() -> Option<SgemmFn> {
    for name in ["libopenblas.so.0", "libopenblas.so", "libblas.so.3"] {
        let c = std::ffi::CString::new(name).unwrap();
        // SAFETY: dlopen/dlsym of a BLAS library; the symbol has cblas_sgemm's C signature.
        unsafe {
            let h = libc::dlopen(c.as_ptr(), libc::RTLD_NOW);
            if h.is_null() {
                continue;
            }
            let f = libc::dlsym(h, c"cblas_sgemm".as_ptr());
            if !f.is_null() {
                return Some(std::mem::transmute::<*mut libc::c_void, SgemmFn>(f));
            }
        }
    }
    None
}

#[test]
fn host_device_gemm_honours_the_cublas_contract_like_openblas() {
    let _checks = all_checks();
    let Some(sgemm) = openblas_sgemm() else {
        assert!(std::env::var_os("CI").is_none(), "OpenBLAS (cblas_sgemm) not found; .ci/run installs libopenblas0");
        eprintln!("skipped: no OpenBLAS on this machine (apt install libopenblas0)");
        return;
    };
    let mut rng = Rng::new(2);
    let mut cases = 0;
    for &(ta, tb) in &[(false, false), (true, false), (false, true), (true, true)] {
        for &(m, n, k, pad, alpha, beta) in &[(7usize, 5usize, 3usize, 0usize, 1.0f32, 0.0f32), (33, 17, 65, 3, 0.5, 1.0), (1, 40, 9, 1, -2.0, 0.25), (16, 1, 1, 0, 1.0, -1.0)] {
            let (ar, ac) = if ta { (k, m) } else { (m, k) };
            let (br, bc) = if tb { (n, k) } else { (k, n) };
            let (lda, ldb, ldc) = (ar + pad, br + 2 * pad, m + pad);
            let a = rand_vec(&mut rng, lda * ac, 1.0);
            let b = rand_vec(&mut rng, ldb * bc, 1.0);
            let c0 = rand_vec(&mut rng, ldc * n, 1.0);
            let mut want = c0.clone();
            // CblasColMajor = 102, CblasNoTrans = 111, CblasTrans = 112.
            let t = |x: bool| if x { 112 } else { 111 };
            // SAFETY: buffers sized for their leading dimensions.
            unsafe { sgemm(102, t(ta), t(tb), m as i32, n as i32, k as i32, alpha, a.as_ptr(), lda as i32, b.as_ptr(), ldb as i32, beta, want.as_mut_ptr(), ldc as i32) };
            let mut o = ops();
            let (ga, gb, gc) = (put(&mut o, &a), put(&mut o, &b), put(&mut o, &c0));
            let g = Gemm { transa: ta, transb: tb, m, n, k, alpha, a: ga, lda, b: gb, ldb, beta, c: gc, ldc, bf16_inputs: false, bf16_output: false };
            o.dev.gemm(Stream::Compute, &g).unwrap();
            let got = get(&mut o, gc);
            assert_close(&format!("gemm ta={ta} tb={tb} {m}x{n}x{k} ld+{pad} α={alpha} β={beta}"), &got, &want, 1e-5);
            // Padding rows of C (beyond m in each column) are untouched.
            for j in 0..n {
                for i in m..ldc {
                    assert_eq!(got[i + j * ldc], c0[i + j * ldc], "row {i} of column {j} is padding");
                }
            }
            cases += 1;
        }
    }
    assert_eq!(cases, 16);
    // bf16 inputs (f32 output and accumulation, as cublasGemmEx with CUDA_R_16BF): the
    // product of the widened operands.
    for &(ta, tb) in &[(true, false), (false, true)] {
        let (m, n, k) = (19usize, 23usize, 37usize);
        let (lda, ldb, ldc) = (if ta { k } else { m }, if tb { n } else { k }, m);
        let a16: Vec<half::bf16> = rand_vec(&mut rng, lda * if ta { m } else { k }, 2.0).into_iter().map(half::bf16::from_f32).collect();
        let b16: Vec<half::bf16> = rand_vec(&mut rng, ldb * if tb { k } else { n }, 2.0).into_iter().map(half::bf16::from_f32).collect();
        let (a32, b32): (Vec<f32>, Vec<f32>) = (a16.iter().map(|x| x.to_f32()).collect(), b16.iter().map(|x| x.to_f32()).collect());
        let mut want = vec![0f32; ldc * n];
        let t = |x: bool| if x { 112 } else { 111 };
        // SAFETY: buffers sized for their leading dimensions.
        unsafe { sgemm(102, t(ta), t(tb), m as i32, n as i32, k as i32, 1.0, a32.as_ptr(), lda as i32, b32.as_ptr(), ldb as i32, 0.0, want.as_mut_ptr(), ldc as i32) };
        let mut o = ops();
        let up16 = |o: &mut Ops, v: &[half::bf16]| {
            let p = o.dev.alloc(v.len() * 2).unwrap();
            let s = DSlice { ptr: p, bytes: v.len() * 2 };
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            o.dev.upload(Stream::Compute, s, &bytes).unwrap();
            s
        };
        let (ga, gb) = (up16(&mut o, &a16), up16(&mut o, &b16));
        let gc = put(&mut o, &vec![f32::NAN; ldc * n]);
        let g = Gemm { transa: ta, transb: tb, m, n, k, alpha: 1.0, a: ga, lda, b: gb, ldb, beta: 0.0, c: gc, ldc, bf16_inputs: true, bf16_output: false };
        o.dev.gemm(Stream::Compute, &g).unwrap();
        assert_close(&format!("gemm bf16 inputs ta={ta} tb={tb}"), &get(&mut o, gc), &want, 1e-5);
        // A bf16 operand is half the bytes: a buffer sized for f32 of half the elements is too short.
        let short = Gemm { a: DSlice { ptr: ga.ptr, bytes: ga.bytes - 2 }, ..g };
        assert!(matches!(o.dev.gemm(Stream::Compute, &short), Err(GpuError::Invalid(_))));
    }
    // A leading dimension below the row count, or a buffer too short, is refused.
    let mut o = ops();
    let s = put(&mut o, &[0.0; 16]);
    let bad = Gemm { transa: false, transb: false, m: 4, n: 4, k: 4, alpha: 1.0, a: s, lda: 3, b: s, ldb: 4, beta: 0.0, c: s, ldc: 4, bf16_inputs: false, bf16_output: false };
    assert!(matches!(o.dev.gemm(Stream::Compute, &bad), Err(GpuError::Invalid(_))));
    let short = Gemm { lda: 4, m: 5, ldc: 5, ..bad };
    assert!(matches!(o.dev.gemm(Stream::Compute, &short), Err(GpuError::Invalid(_))));
}

#[test]
fn host_device_rmsnorm_forward_and_backward_match_the_cpu_backend() {
    let _checks = all_checks();
    let mut rng = Rng::new(3);
    // 300: more than one pass of a 256-thread block; 16: one partial warp-sized row;
    // 5000: 16 columns a thread for the backward (320 threads); 4096 rows of 128 (the
    // q/k norms' shape, whose weight gradient the rows once added into 128 addresses by
    // atomics): 4 rows a block of the backward's first stage, 1024 partial rows; 1031 rows:
    // the last block of 2 rows a block has 1; 300 rows of 16,384 (a Llama-405B-wide
    // drafter): wider than the backward's shared memory holds, its shares kept in the
    // partial rows themselves, 128 of them (the scratch's 2²¹ f32 / 16,384).
    for &(rows, d) in &[(5usize, 300usize), (9, 16), (3, 64), (3, 5000), (4096, 128), (1031, 24), (300, 16384)] {
        let x = rand_vec(&mut rng, rows * d, 2.0);
        let w = rand_vec(&mut rng, d, 1.0);
        let dy = rand_vec(&mut rng, rows * d, 1.0);
        let cpu = Cpu::with_threads(1);
        let mut y = vec![0f32; rows * d];
        let rstd = cpu.rmsnorm(&x, &w, &mut y, d, 1e-6);
        let dx0 = rand_vec(&mut rng, rows * d, 1.0);
        let (mut dx, mut dw) = (dx0.clone(), vec![0.5f32; d]);
        cpu.rmsnorm_backward(&dy, &x, &w, &rstd, &mut dx, Some(&mut dw), d);

        let mut o = ops();
        let (gx, gw, gdy) = (put(&mut o, &x), put(&mut o, &w), put(&mut o, &dy));
        let (gy, gr) = (put(&mut o, &vec![0.0; rows * d]), put(&mut o, &vec![0.0; rows]));
        o.rmsnorm(o.act_mat(gx, rows, d), gw, o.act_mat(gy, rows, d), gr, 1e-6).unwrap();
        assert_close(&format!("rmsnorm {rows}x{d}"), &get(&mut o, gy), &y, TOL);
        assert_close(&format!("rmsnorm rstd {rows}x{d}"), &get(&mut o, gr), &rstd, TOL);
        // Written in bf16 (a GEMM's input): the same bits as the f32 result cast after.
        let (gy16, gc16) = (put16(&mut o, &vec![0.0; rows * d]), put16(&mut o, &vec![0.0; rows * d]));
        o.rmsnorm(Mat::f32(gx, rows, d), gw, Mat::bf16(gy16, rows, d), gr, 1e-6).unwrap();
        o.f32_to_bf16(gc16, gy).unwrap();
        assert_bf16_is_the_cast(&format!("rmsnorm to bf16 {rows}x{d} is the cast of the f32 norm"), &get16(&mut o, gy16), &get16(&mut o, gc16));
        let (gdx, gdw) = (put(&mut o, &dx0), put(&mut o, &vec![0.5; d]));
        o.rmsnorm_backward(Mat::f32(gdy, rows, d), Mat::f32(gx, rows, d), gw, gr, Mat::f32(gdx, rows, d), Some(gdw)).unwrap();
        assert_close(&format!("rmsnorm dx {rows}x{d}"), &get(&mut o, gdx), &dx, 1e-4);
        assert_close(&format!("rmsnorm dw {rows}x{d}"), &get(&mut o, gdw), &dw, 1e-4);
        // In place (y = x), as the target's q/k norms run.
        o.rmsnorm(o.act_mat(gx, rows, d), gw, o.act_mat(gx, rows, d), gr, 1e-6).unwrap();
        assert_close(&format!("rmsnorm in place {rows}x{d}"), &get(&mut o, gx), &y, TOL);
    }
}

#[test]
fn host_device_rope_and_its_inverse_match_the_cpu_backend() {
    let _checks = all_checks();
    let mut rng = Rng::new(4);
    let (rows, heads, hd) = (11, 3, 32);
    let x = rand_vec(&mut rng, rows * heads * hd, 1.0);
    let positions: Vec<usize> = (0..rows).map(|i| i * 7 + 3).collect();
    let scaling = dflash_shared::model_config::RopeScaling::Llama3 { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings: 64.0 };
    let inv_freq = dflash_worker::math::rope_inv_freq(hd, 500000.0, Some(&scaling));
    let cpu = Cpu::with_threads(1);
    let mut o = ops();
    let (gx, gp, gf) = (put(&mut o, &x), put_i32(&mut o, &positions.iter().map(|&p| p as i32).collect::<Vec<_>>()), put(&mut o, &inv_freq));
    for inverse in [false, true] {
        let mut want = x.clone();
        // A YaRN-like cos/sin scale, which the kernel must apply as the CPU does.
        cpu.rope(&mut want, heads, hd, &positions, &inv_freq, 1.25, inverse);
        o.dev.upload(Stream::Compute, gx, f32_bytes(&x)).unwrap();
        o.rope(o.act_mat(gx, rows, heads * hd), gp, gf, hd, 1.25, inverse).unwrap();
        assert_close(&format!("rope inverse={inverse}"), &get(&mut o, gx), &want, 1e-5);
    }
    // Forward then inverse is the identity.
    o.dev.upload(Stream::Compute, gx, f32_bytes(&x)).unwrap();
    o.rope(o.act_mat(gx, rows, heads * hd), gp, gf, hd, 1.0, false).unwrap();
    o.rope(o.act_mat(gx, rows, heads * hd), gp, gf, hd, 1.0, true).unwrap();
    assert_close("rope round trip", &get(&mut o, gx), &x, 1e-5);
}

#[test]
fn host_device_swiglu_add_embed_copy_and_casts_match_the_cpu() {
    let _checks = all_checks();
    let mut rng = Rng::new(5);
    let n = 1000;
    let (g, u, dout) = (rand_vec(&mut rng, n, 4.0), rand_vec(&mut rng, n, 2.0), rand_vec(&mut rng, n, 1.0));
    let cpu = Cpu::with_threads(1);
    let mut out = vec![0f32; n];
    cpu.swiglu(&g, &u, &mut out);
    let (mut dg, mut du) = (vec![0f32; n], vec![0f32; n]);
    cpu.swiglu_backward(&dout, &g, &u, &mut dg, &mut du);
    let mut o = ops();
    let (gg, gu, gd) = (put(&mut o, &g), put(&mut o, &u), put(&mut o, &dout));
    let go = put(&mut o, &vec![0.0; n]);
    o.swiglu(gg, gu, go).unwrap();
    assert_close("swiglu", &get(&mut o, go), &out, 1e-6);
    // The fused gate/up form: rows of `[gate | up]` (25 rows of 40), as one GEMM over the
    // adjacent weights writes them; forward and backward against the CPU's separate ones.
    let width = 40;
    let rows_of = |a: &[f32], b: &[f32]| -> Vec<f32> {
        a.chunks(width).zip(b.chunks(width)).flat_map(|(x, y)| x.iter().chain(y).copied()).collect()
    };
    let ggu = put(&mut o, &rows_of(&g, &u));
    let gsw = put(&mut o, &vec![f32::NAN; n]);
    o.swiglu_gu(ggu, gsw, width).unwrap();
    assert_close("swiglu of fused gate|up", &get(&mut o, gsw), &out, 1e-6);
    // Written in bf16 (a GEMM's input): the same bits as the f32 result cast after.
    let (gsw16, gcast16) = (put16(&mut o, &vec![0.0; n]), put16(&mut o, &vec![0.0; n]));
    o.swiglu_gu_to_bf16(ggu, gsw16, width).unwrap();
    o.f32_to_bf16(gcast16, gsw).unwrap();
    assert_bf16_is_the_cast("swiglu to bf16 is the cast of the f32 swiglu", &get16(&mut o, gsw16), &get16(&mut o, gcast16));
    // The device's backward writes its gradients (NaN before: nothing of it is kept).
    let gdgu = put(&mut o, &vec![f32::NAN; 2 * n]);
    o.swiglu_gu_backward(gd, ggu, gdgu, width).unwrap();
    assert_close("swiglu dgate|dup", &get(&mut o, gdgu), &rows_of(&dg, &du), 1e-6);

    o.add(go, gu).unwrap();
    let sum: Vec<f32> = out.iter().zip(&u).map(|(a, b)| a + b).collect();
    assert_eq!(get(&mut o, go), sum, "add is exact");

    // Embedding gather, with an out-of-range id clamped to the last row.
    let (vocab, h) = (10, 40);
    let table = rand_vec(&mut rng, vocab * h, 1.0);
    let ids = [3u32, 0, 9, 25];
    let gt = put(&mut o, &table);
    let gi = {
        let p = o.dev.alloc(16).unwrap();
        let s = DSlice { ptr: p, bytes: 16 };
        o.dev.upload(Stream::Compute, s, u32_bytes(&ids)).unwrap();
        s
    };
    let ge = put(&mut o, &vec![0.0; ids.len() * h]);
    o.embed(ge, gt, gi, ids.len(), h, vocab).unwrap();
    let want: Vec<f32> = ids.iter().flat_map(|&i| table[(i as usize).min(vocab - 1) * h..][..h].to_vec()).collect();
    assert_eq!(get(&mut o, ge), want, "embedding gather is exact");

    // Columns 5..25 of a [4, 40] matrix into columns 10..30 of a [4, 50] one.
    let gdst = put(&mut o, &vec![0.0; 4 * 50]);
    o.copy_cols((o.act_mat(gdst, 4, 50), 10), (o.act_mat(ge, 4, 40), 5), 20).unwrap();
    let got = get(&mut o, gdst);
    for r in 0..4 {
        for c in 0..50 {
            let want = if (10..30).contains(&c) { want[r * 40 + c - 10 + 5] } else { 0.0 };
            assert_eq!(got[r * 50 + c], want, "copy_cols row {r} col {c}");
        }
    }

    // f32 → bf16 rounds to nearest even exactly as the `half` crate does; back is exact.
    let mut vals = rand_vec(&mut rng, 500, 100.0);
    vals.extend([0.0, -0.0, 1.0, f32::INFINITY, f32::NEG_INFINITY, 1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, f32::MAX, 1e-40]);
    let gv = put(&mut o, &vals);
    let gb = {
        let p = o.dev.alloc(vals.len() * 2).unwrap();
        DSlice { ptr: p, bytes: vals.len() * 2 }
    };
    o.f32_to_bf16(gb, gv).unwrap();
    let mut bits = vec![0u8; vals.len() * 2];
    o.dev.download(Stream::Compute, gb, &mut bits).unwrap();
    for (i, v) in vals.iter().enumerate() {
        let got = u16::from_le_bytes([bits[2 * i], bits[2 * i + 1]]);
        assert_eq!(got, half::bf16::from_f32(*v).to_bits(), "bf16 of {v}");
    }
    let gback = put(&mut o, &vec![0.0; vals.len()]);
    o.bf16_to_f32(gback, gb).unwrap();
    let back = get(&mut o, gback);
    for (b, v) in back.iter().zip(&vals) {
        assert_eq!(b.to_bits(), half::bf16::from_f32(*v).to_f32().to_bits());
    }
}

fn spans_i32(spans: &[KeySpan]) -> Vec<i32> {
    spans.iter().flat_map(|s| [s.a.start as i32, s.a.end as i32, s.b.start as i32, s.b.end as i32]).collect()
}

/// Attention forward and backward against the CPU backend. The CPU device computes in f32
/// as the reference does (1e-5, 1e-4). A GPU and the host device run them on tensor cores:
/// the inputs are bf16-exact here, so what is left is the kernels' own rounding of the
/// probabilities and of dS to bf16 (2⁻⁹ each): the output within 2⁻⁸ of max|v| (see
/// check_attention_bf16), the gradients within 1 % of their largest value.
fn check_attention(name: &str, tq: usize, tk: usize, spans: &[KeySpan], h: Heads, seed: u64) {
    let bf = |v: Vec<f32>| -> Vec<f32> { v.iter().map(|x| half::bf16::from_f32(*x).to_f32()).collect() };
    let mut rng = Rng::new(seed);
    let (qw, kw) = (h.q_heads * h.head_dim, h.kv_heads * h.head_dim);
    let (q, k, v, dout) = (bf(rand_vec(&mut rng, tq * qw, 1.5)), bf(rand_vec(&mut rng, tk * kw, 1.5)), bf(rand_vec(&mut rng, tk * kw, 1.0)), bf(rand_vec(&mut rng, tq * qw, 1.0)));
    let tensor_cores = !device().is_cpu();
    let vmax = v.iter().fold(0f32, |m, x| m.max(x.abs()));
    let cpu = Cpu::with_threads(1);
    let mut out = vec![0f32; tq * qw];
    let saved = cpu.attention(&q, &k, &v, &mut out, spans, h);
    let (mut dq, mut dk, mut dv) = (vec![0.1f32; tq * qw], vec![0.2f32; tk * kw], vec![0.3f32; tk * kw]);
    cpu.attention_backward(&dout, &q, &k, &v, &saved, spans, h, &mut dq, &mut dk, &mut dv);

    let mut o = ops();
    let (gq, gk, gv, gd) = (put(&mut o, &q), put(&mut o, &k), put(&mut o, &v), put(&mut o, &dout));
    let gs = put_i32(&mut o, &spans_i32(spans));
    let (go, gl) = (put(&mut o, &vec![f32::NAN; tq * qw]), put(&mut o, &vec![0.0; tq * h.q_heads]));
    o.attention(Attention { q: gq, k: gk, v: gv, out: go, lse: gl, spans: gs, tq, qh: h.q_heads, kvh: h.kv_heads, hd: h.head_dim }).unwrap();
    let got = get(&mut o, go);
    if tensor_cores {
        assert!(got.iter().all(|x| x.is_finite()), "{name}: non-finite output");
        let err = got.iter().zip(&out).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        eprintln!("{name} attention (tensor cores): max error {:.2e} of max|v| (bound 2^-8 = 3.9e-3)", err / vmax);
        assert!(err <= 2f32.powi(-8) * vmax, "{name} attention: {err} > 2^-8 of max|v| {vmax}");
    } else {
        assert_close(&format!("{name} attention"), &got, &out, 1e-5);
    }
    let (gdq, gdk, gdv) = (put(&mut o, &vec![0.1; tq * qw]), put(&mut o, &vec![0.2; tk * kw]), put(&mut o, &vec![0.3; tk * kw]));
    // The FlashAttention-2 backward's scratch starts as NaN: a row it did not write would show.
    let gdelta = put(&mut o, &vec![f32::NAN; Ops::attention_backward_scratch(tq, h.q_heads, h.head_dim)]);
    o.attention_backward(AttentionGrad { fwd: Attention { q: gq, k: gk, v: gv, out: go, lse: gl, spans: gs, tq, qh: h.q_heads, kvh: h.kv_heads, hd: h.head_dim }, dout: gd, dq: gdq, dk: gdk, dv: gdv }, gdelta).unwrap();
    let tol = if tensor_cores { 1e-2 } else { 1e-4 };
    // The gradients only (the buffers start at 0.1, 0.2, 0.3 to show that they accumulate).
    let less = |v: Vec<f32>, c: f32| -> Vec<f32> { v.into_iter().map(|x| x - c).collect() };
    assert_close(&format!("{name} attention dq"), &less(get(&mut o, gdq), 0.1), &less(dq, 0.1), tol);
    assert_close(&format!("{name} attention dk"), &less(get(&mut o, gdk), 0.2), &less(dk, 0.2), tol);
    assert_close(&format!("{name} attention dv"), &less(get(&mut o, gdv), 0.3), &less(dv, 0.3), tol);
}

#[test]
fn host_device_causal_attention_with_gqa_matches_the_cpu_backend() {
    let _checks = all_checks();
    let t = 23;
    let spans: Vec<KeySpan> = (0..t).map(|i| KeySpan { a: 0..i + 1, b: 0..0 }).collect();
    check_attention("causal hd=40 (lanes partly idle)", t, t, &spans, Heads { q_heads: 4, kv_heads: 2, head_dim: 40 }, 6);
    check_attention("causal hd=96 (3 values per lane)", t, t, &spans, Heads { q_heads: 3, kv_heads: 1, head_dim: 96 }, 7);
    // The forward's tiles: 70 rows (9 blocks of 8, the last partly empty) over 5 tiles of
    // keys, at the largest head dim the kernels take.
    let t = 70;
    let spans: Vec<KeySpan> = (0..t).map(|i| KeySpan { a: 0..i + 1, b: 0..0 }).collect();
    check_attention("causal hd=256, 70 rows", t, t, &spans, Heads { q_heads: 2, kv_heads: 1, head_dim: 256 }, 11);
}

#[test]
fn host_device_dflash_block_attention_matches_the_cpu_backend() {
    let _checks = all_checks();
    // Context of 20 positions, then 3 blocks of 4: a block sees the context before its
    // anchor and itself; the block at anchor 0 sees no context; no block sees another.
    let (slen, bs, anchors) = (20usize, 4usize, [0usize, 7, 15]);
    let tq = anchors.len() * bs;
    let spans: Vec<KeySpan> = (0..tq).map(|i| KeySpan { a: 0..anchors[i / bs], b: slen + (i / bs) * bs..slen + (i / bs + 1) * bs }).collect();
    check_attention("dflash blocks", tq, slen + tq, &spans, Heads { q_heads: 4, kv_heads: 2, head_dim: 32 }, 8);
    // A row with no key at all outputs zeros (and its backward adds nothing).
    let empty = vec![KeySpan { a: 0..0, b: 0..0 }, KeySpan { a: 0..2, b: 0..0 }];
    check_attention("a row without keys", 2, 2, &empty, Heads { q_heads: 2, kv_heads: 2, head_dim: 32 }, 9);
}

/// The drafter's cross-entropy pass as `DeviceDrafter` runs it: per chunk of `chunk` ids
/// the logits GEMM (bf16 out at `act` bf16), `ce_fold`, the GEMM adding `exp(l − max)·W`
/// into the accumulator; then `ce_finish`. `x` `[n, h]` and `lm` `[vocab, h]` are bf16 at
/// `act` bf16. Returns each row's loss, `argmax == label` and dCE/dx (`scale`d).
fn device_ce(o: &mut Ops, act: DType, (x, lm): (DSlice, DSlice), labels: &[i32], scale: &[f32], (h, vocab, chunk): (usize, usize, usize)) -> (Vec<f32>, Vec<i32>, Vec<f32>) {
    let n = labels.len();
    let (labels, scale) = (put_i32(o, labels), put(o, scale));
    let st = CeState { run_max: put(o, &vec![f32::NEG_INFINITY; n]), run_sum: put(o, &vec![0.0; n]), best_i: put_i32(o, &vec![0; n]), label_logit: put(o, &vec![0.0; n]), acc: put(o, &vec![0.0; n * h]) };
    let bf16 = act == DType::Bf16;
    let logits = put(o, &vec![0.0; n * chunk]);
    let e = if bf16 { 2 } else { 4 };
    for start in (0..vocab).step_by(chunk) {
        let cw = chunk.min(vocab - start);
        let (l, w) = (logits.sub(e, 0..n * cw), lm.sub(e, start * h..(start + cw) * h));
        let (xm, wm, lm_) = (Mat::new(x, n, h, act), Mat::new(w, cw, h, act), Mat::new(l, n, cw, act));
        o.matmul(xm, wm, lm_).unwrap();
        o.ce_fold(st, Mat::new(l, n, cw, act), labels, (start, h)).unwrap();
        o.matmul_backward(lm_, xm, wm, Dx::Add(Mat::f32(st.acc, n, h)), None).unwrap();
    }
    let (dx, loss, correct) = (put(o, &vec![f32::NAN; n * h]), put(o, &vec![f32::NAN; n]), put_i32(o, &vec![-1; n]));
    o.ce_finish(st, (Mat::f32(dx, n, h), loss, correct), (labels, scale), Mat::new(lm, vocab, h, act)).unwrap();
    let mut ok = vec![0i32; n];
    o.dev.download(Stream::Compute, correct, bytemuck_i32(&mut ok)).unwrap();
    (get(o, loss), ok, get(o, dx))
}

/// The cross-entropy in one pass per vocabulary chunk (`ce_fold`, `ce_finish` and the two
/// GEMMs around the fold) against the reference's chunked cross-entropy, f32 and bf16
/// (the GPU drafter's: bf16 GEMM inputs and logits, the reference given the same
/// bf16-rounded inputs). Three chunks; row 0's largest logit, by far, and its label are in
/// the last chunk (the accumulator of the first two must be rescaled by e^-(rise)), row 1's
/// label is in the last chunk, the other rows' maxima rise as chunks come; each row has a
/// loss weight of its own.
#[test]
fn host_device_cross_entropy_in_one_pass_per_chunk_matches_the_cpu_backend() {
    let _checks = all_checks();
    let mut rng = Rng::new(10);
    let (n, h, vocab, chunk) = (6usize, 48usize, 700usize, 256usize);
    let hn = rand_vec(&mut rng, n * h, 1.0);
    let mut lm = rand_vec(&mut rng, vocab * h, 0.5);
    // Row 0's logit at id 600 is 2·|hn_0|² ≈ 32, far above the rest (about ±3).
    for d in 0..h {
        lm[600 * h + d] = 2.0 * hn[d];
    }
    let labels: Vec<i32> = (0..n).map(|i| match i { 0 => 600, 1 => 690, _ => ((i * 131 + 7) % vocab) as i32 }).collect();
    let rows: Vec<(usize, u32, f64)> = (0..n).map(|i| (i, labels[i] as u32, 0.5 + i as f64)).collect();
    let total: f64 = rows.iter().map(|r| r.2).sum::<f64>() * 1.5;
    let scale: Vec<f32> = rows.iter().map(|r| (r.2 / total) as f32).collect();
    let bf = |v: &[f32]| -> Vec<f32> { v.iter().map(|x| half::bf16::from_f32(*x).to_f32()).collect() };
    let cpu = Cpu::with_threads(1);
    for act in [DType::F32, DType::Bf16] {
        let (hn, lm) = if act == DType::Bf16 { (bf(&hn), bf(&lm)) } else { (hn.clone(), lm.clone()) };
        let mut dhn = vec![0f32; n * h];
        let want = dflash_worker::reference::drafter::lm_head_ce(&cpu, &hn, h, &lm, vocab, &rows, total, Some(&mut dhn));
        let mut o = ops();
        let inputs = if act == DType::Bf16 { (put16(&mut o, &hn), put16(&mut o, &lm)) } else { (put(&mut o, &hn), put(&mut o, &lm)) };
        let (loss, ok, dx) = device_ce(&mut o, act, inputs, &labels, &scale, (h, vocab, chunk));
        let want_ce: Vec<f32> = want.iter().map(|w| w.0 as f32).collect();
        assert!(want[0].1 && want_ce[0] < 1e-3, "row 0 is right, and sure of it: {:?}", want[0]);
        assert_eq!(ok.iter().map(|&c| c == 1).collect::<Vec<_>>(), want.iter().map(|w| w.1).collect::<Vec<_>>(), "argmax == label ({act:?})");
        if act == DType::F32 {
            assert_close("cross-entropy (f32)", &loss, &want_ce, 1e-5);
            assert_close("cross-entropy gradient (f32)", &dx, &dhn, 1e-4);
        } else {
            // The logits are rounded to bf16 (2⁻⁹ relative) and so is exp(l − max) before
            // its GEMM. The label's logit is the rounded one the log-sum-exp saw: row 0,
            // sure of its label, has a loss near 0, not its logit's rounding (1/8 at 32).
            let bound = 2f32.powi(-8) * want_ce.iter().fold(0f32, |m, x| m.max(x.abs()));
            let worst = loss.iter().zip(&want_ce).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            eprintln!("cross-entropy (bf16): max |error| {worst:.2e} (bound {bound:.2e})");
            check(worst <= bound, || format!("cross-entropy (bf16): max |error| {worst:e} > {bound:e}"));
            check(loss[0].abs() < 1e-3, || format!("row 0's loss {} (bf16)", loss[0]));
            assert_close("cross-entropy gradient (bf16)", &dx, &dhn, 1e-2);
        }
    }
}

fn bytemuck_i32(v: &mut [i32]) -> &mut [u8] {
    // SAFETY: i32 has no padding; any bytes are a valid i32.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), v.len() * 4) }
}

/// The `scale` kernel (a collective's gradient sum into the step's average): `alpha · x`
/// rounded once, bit for bit the host's scaling of the same sum, on the stream asked for.
#[test]
fn host_device_scale_is_the_hosts_scaling_bit_for_bit() {
    let _checks = all_checks();
    let mut rng = Rng::new(9);
    let n = 3000;
    let x = rand_vec(&mut rng, n, 3.0);
    let mut o = ops();
    let (gx, gy) = (put(&mut o, &x), put(&mut o, &vec![f32::NAN; n]));
    for weight in [7.0f64, 1.0, 0.3] {
        let mut want = x.clone();
        dflash_worker::collective::reduce_slots(&mut want, weight);
        o.scale(gy, gx, (1.0 / weight) as f32).unwrap();
        assert_eq!(get(&mut o, gy), want, "scale by 1/{weight}");
    }
    // On the copy stream (a one-rank group's "all-reduce"): a copy.
    dflash_worker::device::ops::adamw::scale_on(o.dev.as_mut(), Stream::Copy, gy, gx, 1.0).unwrap();
    o.dev.sync().unwrap();
    assert_eq!(get(&mut o, gy), x, "scale by 1 on the copy stream");
}

#[test]
fn host_device_adamw_clips_by_the_device_norm_and_skips_non_finite_steps() {
    let _checks = all_checks();
    use dflash_worker::models::drafter::{grad_norm, AdamW};
    let mut rng = Rng::new(11);
    let n = 3000;
    let p0 = rand_vec(&mut rng, n, 1.0);
    let mut o = ops();
    let (gp, gm, gv) = (put(&mut o, &p0), put(&mut o, &vec![0.0; n]), put(&mut o, &vec![0.0; n]));
    let acc = {
        let p = o.dev.alloc(8).unwrap();
        DSlice { ptr: p, bytes: 8 }
    };
    let flag = put_i32(&mut o, &[0]);
    let t = put_i32(&mut o, &[0]);
    let partials = put(&mut o, &vec![0.0; 2 * dflash_worker::device::ops::SUMSQ_BLOCKS]);
    let mut cpu_p = p0.clone();
    let mut opt = AdamW::new(n);
    let clip = 1.0f64;
    for step in 0..4 {
        // Step 2 carries a NaN: the device leaves weights and moments as they were.
        let mut g = rand_vec(&mut rng, n, if step == 1 { 0.01 } else { 0.2 });
        if step == 2 {
            g[1234] = f32::NAN;
        }
        let gg = put(&mut o, &g);
        o.dev.memset_zero(Stream::Compute, acc).unwrap();
        o.dev.memset_zero(Stream::Compute, flag).unwrap();
        o.sumsq(gg, partials, acc, flag).unwrap();
        if let Some(norm) = grad_norm(&g) {
            let mut a = [0u8; 8];
            o.dev.download(Stream::Compute, acc, &mut a).unwrap();
            let dn = f64::from_le_bytes(a).sqrt();
            assert!((dn - norm).abs() <= 1e-6 * norm, "device norm {dn} vs {norm}");
        }
        // The host's view: the CPU reference (clip when the norm exceeds 1, skip when not finite).
        let applied = match grad_norm(&g) {
            Some(norm) => {
                let mut g2 = g.clone();
                if norm > clip {
                    g2.iter_mut().for_each(|x| *x *= (clip / norm) as f32);
                }
                opt.update(&mut cpu_p, &g2, 1e-3);
                true
            }
            None => false,
        };
        assert_eq!(applied, step != 2);
        o.adam_count(t, flag).unwrap();
        o.adamw(AdamBuffers { p: gp, m: gm, v: gv, g: gg, acc, nonfinite: flag, t }, clip as f32, 1e-3, &opt.hyper()).unwrap();
        let mut nf = [0i32];
        o.dev.download(Stream::Compute, flag, bytemuck_i32(&mut nf)).unwrap();
        assert_eq!(nf[0] != 0, step == 2, "the non-finite flag at step {step}");
        let mut tt = [0i32];
        o.dev.download(Stream::Compute, t, bytemuck_i32(&mut tt)).unwrap();
        assert_eq!(tt[0] as u64, opt.step, "the device's Adam step count counts only applied steps");
        assert_close(&format!("adamw step {step}"), &get(&mut o, gp), &cpu_p, 1e-5);
        assert_close(&format!("adam m step {step}"), &get(&mut o, gm), &opt.m, 1e-5);
    }
}

const QWEN3: &str = r#"{"architectures":["Qwen3ForCausalLM"],"model_type":"qwen3","hidden_size":64,"num_hidden_layers":4,
  "num_attention_heads":4,"num_key_value_heads":2,"head_dim":32,"intermediate_size":96,"rms_norm_eps":1e-6,"rope_theta":1000000.0,
  "vocab_size":300,"tie_word_embeddings":true}"#;
const LLAMA: &str = r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":48,"num_hidden_layers":3,
  "num_attention_heads":6,"num_key_value_heads":2,"intermediate_size":96,"rms_norm_eps":1e-5,"rope_theta":500000.0,
  "rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":64},
  "vocab_size":500,"tie_word_embeddings":false}"#;

#[test]
fn host_device_target_forward_matches_the_cpu_target_for_qwen3_and_llama() {
    let _checks = all_checks();
    use dflash_worker::models::target::device::DeviceTarget;
    use dflash_worker::models::target::Target;
    for (name, cfg, taps) in [("qwen3", QWEN3, vec![0usize, 2, 3]), ("llama", LLAMA, vec![1usize, 2])] {
        let tmp = tempfile::tempdir().unwrap();
        dflash_worker::models::tiny::write_random(tmp.path(), cfg, 21).unwrap();
        let cpu = Target::load(tmp.path(), &taps).unwrap();
        let mut gpu = DeviceTarget::new(device(), &cpu, 40).unwrap();
        assert_eq!(gpu.describe(), device().describe());
        for len in [40usize, 17, 1] {
            let tokens: Vec<u32> = (0..len as u32).map(|i| (i * 37 + 5) % 300).collect();
            let want = cpu.forward_taps(&tokens);
            let got = gpu.forward_taps(&tokens).unwrap();
            if device().is_cpu() {
                // f32 throughout, as the reference.
                assert_close(&format!("{name} target forward (f32), {len} tokens, taps {taps:?}"), &got, &want, 1e-5);
            } else {
                // Every activation in bf16 on the device, the residual stream included (the
                // CPU target keeps f32): each op rounds to 2⁻⁹ relative, and those errors add
                // up through the layers (1.1e-2 seen, 0.6e-2 with f32 activations).
                assert_close(&format!("{name} target forward (bf16 activations), {len} tokens, taps {taps:?}"), &got, &want, 2e-2);
            }
        }
        let st = gpu.arena_stats();
        assert!(st.in_use > 0 && st.in_use <= st.reserved && st.peak == st.in_use && st.alloc_failures == 0, "{st:?}");
        let err = gpu.forward_taps(&[1; 41]).unwrap_err();
        assert!(matches!(err, GpuError::Invalid(m) if m.contains("room for 40")));
    }
}

/// The rows of one token batch (a full 40-token row, one of 1, an empty one) run packed
/// (varlen: each token at its position in its row, seeing its row's keys up to itself)
/// give each row the taps its own forward gives, and the CPU target's; a batch past the
/// room runs as several packed forwards with the same taps; the worker's path writes each
/// row's bf16 taps at its place and nothing else.
#[test]
fn host_device_target_packed_rows_match_a_forward_per_row() {
    let _checks = all_checks();
    use dflash_worker::models::target::device::{pack_rows, DeviceTarget};
    use dflash_worker::models::target::Target;
    let lens = [40usize, 1, 17, 0, 5, 23];
    let total: usize = lens.iter().sum();
    // Room 45: [40, 1] then [17, 0, 5, 23] (45 tokens) — two forwards.
    assert_eq!(pack_rows(&lens, 45).unwrap(), vec![0..2, 2..6]);
    assert_eq!(pack_rows(&lens, total).unwrap(), vec![0..6]);
    assert_eq!(pack_rows(&lens, 40).unwrap(), vec![0..1, 1..5, 5..6]);
    for (name, cfg, taps) in [("qwen3", QWEN3, vec![0usize, 2, 3]), ("llama", LLAMA, vec![1usize, 2])] {
        let tmp = tempfile::tempdir().unwrap();
        dflash_worker::models::tiny::write_random(tmp.path(), cfg, 21).unwrap();
        let cpu = Target::load(tmp.path(), &taps).unwrap();
        let vocab = cpu.cfg.vocab_size as u32;
        let ids: Vec<Vec<u32>> = lens
            .iter()
            .enumerate()
            .map(|(r, &n)| (0..n as u32).map(|i| (i * 37 + 11 * r as u32 + 5) % vocab).collect())
            .collect();
        let rows: Vec<&[u32]> = ids.iter().map(|r| r.as_slice()).collect();
        let width = taps.len() * cpu.cfg.hidden_size;
        // Registered before the targets that copy into it, so dropped after them.
        let mut slot = vec![0xabu8; lens.len() * 40 * width * 2];
        let mut one = DeviceTarget::new(device(), &cpu, 40).unwrap();
        let mut all = DeviceTarget::new(device(), &cpu, total).unwrap();
        let mut split = DeviceTarget::new(device(), &cpu, 45).unwrap();
        let per_row: Vec<Vec<f32>> = rows.iter().map(|r| one.forward_taps(r).unwrap()).collect();
        let packed = all.forward_rows(&rows).unwrap();
        let halves = split.forward_rows(&rows).unwrap();
        let tol = if device().is_cpu() { 1e-5 } else { 2e-2 };
        // The host device gives a row the same bits packed as alone here: the GEMMs and the
        // per-row kernels compute each element alike whatever rows surround it, and every
        // attention CTA (64 query rows) finds its keys in one 64-key tile either way, so
        // the online softmax takes the same steps (longer rows are tiled from the CTA's
        // first key, which packing moves: then only to rounding). The CPU device's
        // attention multiplies a tile of rows by the union of their keys (other GEMM shapes,
        // other summation orders), and a GPU's GEMMs may pick kernels by the row count:
        // there, the f32 or bf16 bound of the test above.
        let exact = !device().is_cpu() && !on_gpu();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (r, row) in rows.iter().enumerate() {
            let what = format!("{name} row {r} of {} tokens", row.len());
            assert_eq!((packed[r].len(), halves[r].len()), (row.len() * width, row.len() * width), "{what}");
            let want = cpu.forward_taps(row);
            assert_close(&format!("{what}: packed vs the CPU target"), &packed[r], &want, tol);
            assert_close(&format!("{what}: packed vs its own forward"), &packed[r], &per_row[r], tol);
            assert_close(&format!("{what}: two forwards vs its own"), &halves[r], &per_row[r], tol);
            if exact {
                assert!(bits(&packed[r]) == bits(&per_row[r]), "{what}: packed vs its own forward, bit for bit");
                assert!(bits(&halves[r]) == bits(&per_row[r]), "{what}: two forwards vs its own, bit for bit");
            }
        }
        // The worker's path: bf16 into registered memory, each row at its place in a slot
        // laid out [rows × 40, width].
        unsafe { split.register_host(slot.as_mut_ptr(), slot.len()).unwrap() };
        let base = slot.as_mut_ptr();
        let dst: Vec<(&[u32], *mut u8)> =
            rows.iter().enumerate().map(|(r, &row)| (row, unsafe { base.add(r * 40 * width * 2) })).collect();
        let e = unsafe { split.forward_rows_into(&dst).unwrap() }.expect("an event after the copies");
        split.finish(e, slot.as_ptr(), slot.len()).unwrap();
        for (r, row) in rows.iter().enumerate() {
            let part = &slot[r * 40 * width * 2..(r + 1) * 40 * width * 2];
            let (taps_part, pad) = part.split_at(row.len() * width * 2);
            let want: Vec<u8> =
                packed[r].iter().flat_map(|&v| half::bf16::from_f32(v).to_le_bytes()).collect();
            assert!(taps_part == want.as_slice(), "{name} row {r}: the slot's bf16 taps");
            assert!(pad.iter().all(|&b| b == 0xab), "{name} row {r}: a byte past the row's taps was written");
        }
        // A row past the room is refused as a forward of it is, before anything runs.
        let long = vec![1u32; 41];
        for err in [
            one.forward_rows(&[&long[..1], &long]).unwrap_err(),
            unsafe { one.forward_rows_into(&[(&long[..], base)]) }.unwrap_err(),
            one.forward_taps(&long).unwrap_err(),
        ] {
            assert!(matches!(&err, GpuError::Invalid(m) if m == "41 tokens, room for 40"), "{err}");
        }
    }
}

fn get_i32(o: &mut Ops, s: DSlice) -> Vec<i32> {
    let mut v = vec![0i32; s.bytes / 4];
    o.dev.download(Stream::Compute, s, dflash_worker::device::i32_bytes_mut(&mut v)).unwrap();
    v
}

/// Activations of `v` on the device: bf16 (its values must be bf16-exact) or f32.
fn put_act(o: &mut Ops, v: &[f32], bf16: bool) -> DSlice {
    if !bf16 {
        return put(o, v);
    }
    let bits: Vec<u8> = v.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect();
    let p = o.dev.alloc(bits.len().max(4)).unwrap();
    let s = DSlice { ptr: p, bytes: bits.len() };
    o.dev.upload(Stream::Compute, s, &bits).unwrap();
    s
}

fn get_act(o: &mut Ops, s: DSlice, bf16: bool) -> Vec<f32> {
    if !bf16 {
        return get(o, s);
    }
    let mut bits = vec![0u8; s.bytes];
    o.dev.download(Stream::Compute, s, &mut bits).unwrap();
    bits.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect()
}

/// The MoE kernels against a plain computation of the same: `moe_route` (softmax, the
/// top-k in rank order with the lower expert first among equals, renormalised or not),
/// `moe_permute` (each expert's rows in token order, offsets and slots exact) and
/// `moe_combine` (each token's weighted sum of its rows), f32 and bf16 activations. A tie
/// (two equal logits) and an expert no token chooses are among the cases.
#[test]
fn host_device_moe_routing_permutation_and_combine_match_the_cpu() {
    let _checks = all_checks();
    let mut rng = Rng::new(17);
    let (t, ne, k, h) = (37usize, 10usize, 3usize, 40usize);
    for bf16 in [false, true] {
        for norm in [false, true] {
            let round = |v: Vec<f32>| -> Vec<f32> { v.into_iter().map(|x| if bf16 { half::bf16::from_f32(x).to_f32() } else { x }).collect() };
            let mut logits = round(rand_vec(&mut rng, t * ne, 3.0));
            logits[0] = logits[1].max(logits[2]).max(10.0); // expert 0 and 1 tie at the top of token 0
            logits[1] = logits[0];
            for r in 0..t {
                logits[r * ne + 9] = -20.0; // expert 9: never chosen
            }
            // The routing, computed plainly.
            let (mut want_idx, mut want_w) = (Vec::new(), Vec::new());
            for l in logits.chunks_exact(ne) {
                let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f64> = l.iter().map(|v| ((v - m) as f64).exp()).collect();
                let sum: f64 = e.iter().sum();
                let mut order: Vec<usize> = (0..ne).collect();
                order.sort_by(|&a, &b| l[b].total_cmp(&l[a]).then(a.cmp(&b)));
                let top = &order[..k];
                let top_sum: f64 = top.iter().map(|&i| e[i] / sum).sum();
                for &i in top {
                    want_idx.push(i as i32);
                    want_w.push((e[i] / sum / if norm { top_sum } else { 1.0 }) as f32);
                }
            }
            let what = format!("{} activations, norm {norm}", if bf16 { "bf16" } else { "f32" });
            let mut o = ops();
            o.act16 = bf16;
            let gl = put_act(&mut o, &logits, bf16);
            let (gi, gw) = (put_i32(&mut o, &vec![-1; t * k]), put(&mut o, &vec![f32::NAN; t * k]));
            o.moe_route(o.act_mat(gl, t, ne), (gi, gw), k, norm).unwrap();
            let idx = get_i32(&mut o, gi);
            assert_eq!(idx, want_idx, "moe_route experts ({what})");
            assert_eq!((idx[0], idx[1]), (0, 1), "the tie: the lower expert first");
            assert_close(&format!("moe_route weights ({what})"), &get(&mut o, gw), &want_w, 1e-6);
            // The permutation, computed plainly.
            let pairs = t * k;
            let (offsets, rows, slots) = plain_permutation(&want_idx, k, ne);
            assert_eq!(offsets[10], offsets[9], "expert 9 has no row");
            let (go, gr, gs) = (put_i32(&mut o, &vec![-1; ne + 1]), put_i32(&mut o, &vec![-1; pairs]), put_i32(&mut o, &vec![-1; pairs]));
            let scratch = put_i32(&mut o, &vec![-1; dflash_worker::device::ops::moe_permute_scratch(pairs, ne)]);
            o.moe_permute(gi, (go, gr, gs), scratch, pairs, k, ne).unwrap();
            assert_eq!(get_i32(&mut o, go), offsets, "moe_permute offsets ({what})");
            assert_eq!(get_i32(&mut o, gr), rows, "moe_permute rows ({what})");
            assert_eq!(get_i32(&mut o, gs), slots, "moe_permute slots ({what})");
            // The weighted sum of each token's rows.
            let y = round(rand_vec(&mut rng, pairs * h, 2.0));
            let mut want = vec![0f32; t * h];
            for r in 0..t {
                for q in 0..k {
                    let (w, row) = (want_w[r * k + q], slots[r * k + q] as usize);
                    for j in 0..h {
                        want[r * h + j] += w * y[row * h + j];
                    }
                }
            }
            let gy = put_act(&mut o, &y, bf16);
            let gout = put_act(&mut o, &vec![f32::NAN; t * h], bf16);
            o.moe_combine(o.act_mat(gout, t, h), o.act_mat(gy, pairs, h), (gw, gs), k).unwrap();
            // bf16: the sum rounded once on store (half a bf16 ulp: at most 2⁻⁸ relative).
            let tol = if bf16 { 4e-3 } else { 1e-6 };
            assert_close(&format!("moe_combine ({what})"), &get_act(&mut o, gout, bf16), &want, tol);
        }
    }
}

/// The routing `idx` (top-k experts per token) stably sorted by expert, plainly: the
/// experts' offsets into the permuted rows, each permuted row's token, each pair's row.
fn plain_permutation(idx: &[i32], k: usize, ne: usize) -> (Vec<i32>, Vec<i32>, Vec<i32>) {
    let (mut offsets, mut rows, mut slots) = (vec![0i32], Vec::new(), vec![0i32; idx.len()]);
    for e in 0..ne as i32 {
        for (p, _) in idx.iter().enumerate().filter(|(_, &i)| i == e) {
            slots[p] = rows.len() as i32;
            rows.push((p / k) as i32);
        }
        offsets.push(rows.len() as i32);
    }
    (offsets, rows, slots)
}

/// `moe_permute` over many chunks of pairs (11, the last partial, several windows of a
/// warp each): offsets, rows and slots exactly those of a plain stable sort by expert,
/// with experts that many, few or no tokens choose.
#[test]
fn host_device_moe_permutation_over_many_chunks_is_a_stable_sort_by_expert() {
    let _checks = all_checks();
    let mut rng = Rng::new(31);
    let (t, k, ne) = (700usize, 4usize, 50usize);
    let mut idx = Vec::with_capacity(t * k);
    for _ in 0..t {
        let mut chosen: Vec<i32> = Vec::new();
        while chosen.len() < k {
            // Skewed: experts 0..4 are popular, 49 is never chosen.
            let r = (rng.next_u64() % 100) as i32;
            let e = if r < 40 { r % 5 } else { r % 49 };
            if !chosen.contains(&e) {
                chosen.push(e);
            }
        }
        idx.extend(chosen);
    }
    let pairs = t * k;
    let (offsets, rows, slots) = plain_permutation(&idx, k, ne);
    let mut o = ops();
    let gi = put_i32(&mut o, &idx);
    let (go, gr, gs) = (put_i32(&mut o, &vec![-1; ne + 1]), put_i32(&mut o, &vec![-1; pairs]), put_i32(&mut o, &vec![-1; pairs]));
    let scratch = put_i32(&mut o, &vec![-1; dflash_worker::device::ops::moe_permute_scratch(pairs, ne)]);
    o.moe_permute(gi, (go, gr, gs), scratch, pairs, k, ne).unwrap();
    assert_eq!(get_i32(&mut o, go), offsets, "moe_permute offsets");
    assert_eq!(get_i32(&mut o, gr), rows, "moe_permute rows");
    assert_eq!(get_i32(&mut o, gs), slots, "moe_permute slots");
}

/// The experts' grouped GEMM (`moe_gemm`) against a plain product per row: experts
/// with no rows, one with more rows than a tile (3 row tiles), columns past a tile (a
/// partial column tile), a k that is a multiple of 8 but not of a k-block (the last block
/// partial) and one that is not a multiple of 8 (every copy element by element), rows read
/// through a permutation (the gate+up projection's gather) or in place; f32 and bf16.
/// Rows outside the routing's are left as they were.
#[test]
fn host_device_moe_grouped_gemm_matches_a_product_per_expert() {
    let _checks = all_checks();
    let mut rng = Rng::new(29);
    // Rows per expert: none, 150 (3 tiles of 64), 1, none, 64 (one whole tile), 37.
    let counts = [0usize, 150, 1, 0, 64, 37];
    let ne = counts.len();
    let pairs: usize = counts.iter().sum();
    let mut offsets = vec![0i32];
    for c in counts {
        offsets.push(offsets.last().unwrap() + c as i32);
    }
    let tokens = 97usize;
    let perm: Vec<i32> = (0..pairs).map(|r| ((r * 53 + 7) % tokens) as i32).collect();
    for bf16 in [false, true] {
        for (n, k) in [(136usize, 72usize), (40, 36), (256, 64)] {
            for gather in [false, true] {
                let what = format!("{} n {n} k {k}{}", if bf16 { "bf16" } else { "f32" }, if gather { " gathered" } else { "" });
                let round = |v: Vec<f32>| -> Vec<f32> { v.into_iter().map(|x| if bf16 { half::bf16::from_f32(x).to_f32() } else { x }).collect() };
                let x_rows = if gather { tokens } else { pairs };
                let x = round(rand_vec(&mut rng, x_rows * k, 1.0));
                let w = round(rand_vec(&mut rng, ne * n * k, 1.0));
                let mut want = vec![7.0f32; (pairs + 3) * n];
                for e in 0..ne {
                    for r in offsets[e] as usize..offsets[e + 1] as usize {
                        let src = if gather { perm[r] as usize } else { r };
                        for c in 0..n {
                            let acc: f64 = (0..k).map(|i| x[src * k + i] as f64 * w[(e * n + c) * k + i] as f64).sum();
                            want[r * n + c] = acc as f32;
                        }
                    }
                }
                let mut o = ops();
                o.act16 = bf16;
                let (gx, gw) = (put_act(&mut o, &x, bf16), put_act(&mut o, &w, bf16));
                let gy = put_act(&mut o, &vec![7.0f32; (pairs + 3) * n], bf16);
                let (go, gp) = (put_i32(&mut o, &offsets), put_i32(&mut o, &perm));
                let g = gather.then_some((gp, tokens));
                o.moe_gemm(gy, gx, gw, go, g, (pairs, ne), n, k).unwrap();
                let got = get_act(&mut o, gy, bf16);
                check(got[pairs * n..].iter().all(|&v| v == 7.0), || format!("moe_gemm ({what}): wrote past the routed rows"));
                // bf16: f32 sums of exact products, rounded once on store.
                let tol = if bf16 { 4e-3 } else { TOL };
                assert_close(&format!("moe_gemm ({what})"), &got, &want, tol);
            }
        }
    }
}

/// A Qwen3-MoE target of 4 layers, layer 2 dense, 6 experts of width 40, `k` per token.
fn qwen3_moe(k: usize) -> String {
    format!(
        r#"{{"architectures":["Qwen3MoeForCausalLM"],"model_type":"qwen3_moe","hidden_size":64,"num_hidden_layers":4,
  "num_attention_heads":4,"num_key_value_heads":2,"head_dim":32,"intermediate_size":96,"moe_intermediate_size":40,
  "num_experts":6,"num_experts_per_tok":{k},"norm_topk_prob":true,"mlp_only_layers":[2],"rope_theta":1000000.0,
  "vocab_size":300,"tie_word_embeddings":true}}"#
    )
}

/// The sparse MLP's device route (router GEMM, routing, the permutation, the grouped
/// GEMMs over the experts, SwiGLU, the weighted sum) against the CPU target, rows packed. In f32
/// (the CPU device) top-2 of 6, routed as the reference routes; with bf16 activations
/// every expert for every token (k = 6), weighted by the softmax: bf16 rounding could
/// flip a near-tie top-k choice (transformers_parity.rs checks top-k under bf16 against
/// transformers), not this routing, so the rest of the route is checked at the bf16 bound.
#[test]
fn host_device_qwen3_moe_forward_matches_the_cpu_target() {
    let _checks = all_checks();
    use dflash_worker::models::target::device::DeviceTarget;
    use dflash_worker::models::target::Target;
    let ks: &[usize] = if device().is_cpu() { &[2, 6] } else { &[6] };
    let lens = [40usize, 1, 17];
    for &k in ks {
        let tmp = tempfile::tempdir().unwrap();
        dflash_worker::models::tiny::write_random(tmp.path(), &qwen3_moe(k), 23).unwrap();
        let taps = vec![0usize, 3];
        let cpu = Target::load(tmp.path(), &taps).unwrap();
        let ids: Vec<Vec<u32>> = lens
            .iter()
            .enumerate()
            .map(|(r, &n)| (0..n as u32).map(|i| (i * 37 + 11 * r as u32 + 5) % 300).collect())
            .collect();
        let rows: Vec<&[u32]> = ids.iter().map(|r| r.as_slice()).collect();
        let mut dev = DeviceTarget::new(device(), &cpu, 58).unwrap();
        let packed = dev.forward_rows(&rows).unwrap();
        let tol = if device().is_cpu() { 1e-5 } else { 2e-2 };
        for (r, row) in rows.iter().enumerate() {
            let want = cpu.forward_taps(row);
            assert_close(&format!("qwen3-moe top-{k} row {r} of {} tokens, packed", row.len()), &packed[r], &want, tol);
        }
        let st = dev.arena_stats();
        assert!(st.in_use <= st.reserved && st.alloc_failures == 0, "{st:?}");
    }
}

#[test]
fn host_device_drafter_forward_and_backward_match_the_cpu_drafter() {
    let _checks = all_checks();
    use dflash_shared::drafter::DrafterConfig;
    use dflash_worker::models::drafter::device::DeviceDrafter;
    use dflash_worker::models::drafter::{Drafter, Frozen, Sample};
    // Vocabulary over one 4096-column chunk, heads of 40 (lanes partly idle), GQA.
    let c = DrafterConfig {
        hidden: 48,
        layers: 2,
        q_heads: 4,
        kv_heads: 2,
        head_dim: 40,
        intermediate: 72,
        vocab: 4200,
        eps: 1e-6,
        rope_theta: 1000000.0,
        rope_scaling: None,
        n_taps: 2,
        block_size: 4,
        max_anchors: 5,
        mask_token_id: 4199,
        gamma: 4.0,
    };
    let d = Drafter::new(c.clone());
    let mut rng = Rng::new(12);
    let mut p = d.init_params(3);
    for (i, x) in p.iter_mut().enumerate() {
        *x += ((i * 7919) % 13) as f32 * 0.003;
    }
    let frozen = Frozen { embed: rand_vec(&mut rng, c.vocab * c.hidden, 1.0), lm_head: rand_vec(&mut rng, c.vocab * c.hidden, 0.5) };
    let lens = [23usize, 11];
    let taps: Vec<Vec<f32>> = lens.iter().map(|&l| rand_vec(&mut rng, l * c.n_taps * c.hidden, 1.0)).collect();
    let ids: Vec<Vec<u32>> = lens.iter().enumerate().map(|(i, &l)| (0..l).map(|t| ((t * 977 + i * 31) % 4190) as u32).collect()).collect();
    let masks: Vec<Vec<u8>> = lens.iter().map(|&l| (0..l).map(|t| (t % 7 != 3) as u8).collect()).collect();
    let anchors: Vec<Vec<usize>> = masks.iter().map(|m| d.sample_anchors(m, &mut rng)).collect();
    assert!(anchors.iter().all(|a| !a.is_empty()));
    let samples: Vec<Sample> = (0..2).map(|i| Sample { taps: &taps[i], ids: &ids[i], mask: &masks[i] }).collect();

    let mut want = vec![0f32; p.len()];
    let tw = d.total_weight(&samples, &anchors);
    let ws = d.train_batch(&p, &frozen, &samples, &anchors, tw, &mut want);
    let mut gpu = DeviceDrafter::new(device(), &d, &frozen, 32).unwrap();
    let zeros = vec![0f32; p.len()];
    gpu.load(&p, &zeros, &zeros, 0).unwrap();
    let mut got = vec![f32::NAN; p.len()];
    let gs = gpu.forward_backward(&samples, Rows::F32, &anchors, tw, GradTo::Host(&mut got)).unwrap();
    let (wl, gl) = (ws.loss_sum / ws.weight_sum, gs.loss_sum / gs.weight_sum);
    // The CPU device computes in f32 as the reference does; a GPU (and the host device
    // standing in for one) feeds its GEMMs bf16 (2⁻⁸ relative rounding of each input),
    // accumulating in f32.
    let bf16 = !device().is_cpu();
    let (loss_tol, grad_tol) = if bf16 { (2e-3, 5e-2) } else { (1e-5, 2e-4) };
    eprintln!("drafter loss: cpu {wl:.6}, device {gl:.6} ({})", if bf16 { "bf16 GEMMs" } else { "f32" });
    assert!((wl - gl).abs() < loss_tol * wl.abs(), "loss {gl} vs {wl}");
    assert_eq!((gs.slot_total.clone(), gs.blocks, gs.tokens, gs.anchors), (ws.slot_total.clone(), ws.blocks, ws.tokens, ws.anchors));
    if !bf16 {
        // (In bf16 a near tie between two logits may resolve the other way.)
        assert_eq!(gs.slot_correct, ws.slot_correct);
        assert!((gs.accept_sum - ws.accept_sum).abs() < 1e-9);
    }
    // Every parameter's gradient, tensor by tensor.
    for (name, _, off) in &d.layout.entries {
        let r = d.layout.range(name);
        assert_eq!(r.start, *off);
        assert_close(&format!("drafter gradient {name}"), &got[r.clone()], &want[r], grad_tol);
    }
    // The same batch as a drafter receives it, bf16 bytes from the slot, widened on the
    // device: exactly the f32 path on the widened values.
    let taps16: Vec<Vec<u8>> = taps.iter().map(|t| t.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect()).collect();
    let widened: Vec<Vec<f32>> = taps.iter().map(|t| t.iter().map(|x| half::bf16::from_f32(*x).to_f32()).collect()).collect();
    let wide: Vec<Sample> = (0..2).map(|i| Sample { taps: &widened[i], ids: &ids[i], mask: &masks[i] }).collect();
    let bare: Vec<Sample> = (0..2).map(|i| Sample { taps: &[], ids: &ids[i], mask: &masks[i] }).collect();
    let raw: Vec<&[u8]> = taps16.iter().map(|t| t.as_slice()).collect();
    let (mut g32, mut g16) = (vec![0f32; p.len()], vec![0f32; p.len()]);
    let s32 = gpu.forward_backward(&wide, Rows::F32, &anchors, tw, GradTo::Host(&mut g32)).unwrap();
    let s16 = gpu.forward_backward(&bare, Rows::Bf16(&raw), &anchors, tw, GradTo::Host(&mut g16)).unwrap();
    assert_same_sum("bf16 taps widened: the f32 path's loss sum", s16.loss_sum, s32.loss_sum, s32.slot_total.iter().sum::<u64>() as usize);
    assert_same_gradient("bf16 taps widened on the device: the f32 path's gradient", &g16, &g32);
    if bf16 {
        // The context GEMM rounds its input to bf16 anyway: the same as the unrounded taps.
        assert_same_gradient("bf16 taps: the unrounded taps' gradient", &g16, &got);
    } else {
        assert!(rel_err(&g16, &got) > 0.0, "and differ from the unrounded taps' (the rounding is real)");
    }
    let short: Vec<&[u8]> = vec![&taps16[0][..10], &taps16[1]];
    assert!(matches!(gpu.forward_backward(&bare, Rows::Bf16(&short), &anchors, tw, GradTo::Host(&mut g16)), Err(GpuError::Invalid(m)) if m.contains("bytes of bf16 taps")));

    // The optimizer on the device: three steps, the second with a NaN in its gradient,
    // against the CPU's clip and AdamW on the same gradients. The device reports each
    // step's outcome a step later (the last one when drained).
    use dflash_worker::device::ops::params_hash;
    use dflash_worker::models::drafter::{grad_norm, AdamW};
    assert_eq!(gpu.params_hash().unwrap(), params_hash(&p), "the device's checksum of the weights is the host's");
    let (mut cpu_p, mut opt) = (p.clone(), AdamW::new(p.len()));
    let (clip, lr) = (1.0f32, 1e-2f32);
    let mut outcomes = Vec::new();
    let mut norms = Vec::new();
    for step in 1..=3u64 {
        let mut g = vec![0f32; p.len()];
        gpu.forward_backward(&samples, Rows::F32, &anchors, tw, GradTo::Host(&mut g)).unwrap();
        if step == 2 {
            g[17] = f32::NAN;
        }
        let before = gpu.update(&Step::new(step, clip, lr, &opt.hyper()), Gradient::Host(&g)).unwrap();
        assert_eq!(before.map(|o| o.step), (step > 1).then_some(step - 1), "the outcome of the step before arrives with this one");
        outcomes.extend(before);
        if let Some(norm) = grad_norm(&g) {
            if norm > clip as f64 {
                g.iter_mut().for_each(|x| *x *= (clip as f64 / norm) as f32);
            }
            opt.update(&mut cpu_p, &g, lr);
            norms.push(norm);
        }
    }
    outcomes.extend(gpu.drain().unwrap());
    assert_eq!(outcomes.iter().map(|o| (o.step, o.skipped)).collect::<Vec<_>>(), [(1, false), (2, true), (3, false)]);
    for (o, want) in outcomes.iter().filter(|o| !o.skipped).zip(&norms) {
        assert!((o.grad_norm - want).abs() <= 1e-5 * want, "step {}: device norm {} vs {want}", o.step, o.grad_norm);
    }
    let n = p.len();
    let (mut dp, mut dm, mut dv) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
    let t = gpu.fetch(&mut dp, &mut dm, &mut dv).unwrap();
    assert_eq!(t, opt.step, "the skipped step is not counted");
    assert_eq!(t, 2);
    assert_close("device AdamW weights after 3 steps", &dp, &cpu_p, 1e-5);
    assert_close("device Adam m", &dm, &opt.m, 1e-5);
    assert_close("device Adam v", &dv, &opt.v, 1e-5);
    assert!(rel_err(&dp, &p) > 1e-4, "the weights moved");
    let h = gpu.params_hash().unwrap();
    assert_eq!(h, params_hash(&dp));
    assert_ne!(h, params_hash(&p));
    let mut flipped = dp.clone();
    flipped[n / 2] = f32::from_bits(flipped[n / 2].to_bits() ^ 1);
    assert_ne!(params_hash(&flipped), h, "one flipped bit changes the checksum");
    // A sample larger than the room asked for is refused, not overrun.
    let long_taps = rand_vec(&mut rng, 40 * c.n_taps * c.hidden, 1.0);
    let long_ids: Vec<u32> = (0..40).collect();
    let long_mask = vec![1u8; 40];
    let s = Sample { taps: &long_taps, ids: &long_ids, mask: &long_mask };
    let err = gpu.forward_backward(&[s], Rows::F32, &[vec![0, 5]], 1.0, GradTo::Host(&mut got)).unwrap_err();
    assert!(matches!(err, GpuError::Invalid(m) if m.contains("room for 32")));
}


/// A step's losses and `argmax == label` flags stay on the device and are read once, or
/// whenever the room for them (16 samples' rows) is full: a batch of 40 samples gives the
/// statistics of its samples trained one at a time, and the counts the reference's.
#[test]
fn host_device_drafter_reads_a_steps_loss_statistics_once_and_when_their_room_is_full() {
    use dflash_shared::drafter::DrafterConfig;
    use dflash_worker::models::drafter::device::DeviceDrafter;
    use dflash_worker::models::drafter::{Drafter, Frozen, Sample};
    let c = DrafterConfig { hidden: 32, layers: 1, q_heads: 2, kv_heads: 1, head_dim: 16, intermediate: 48, vocab: 300, eps: 1e-6, rope_theta: 10000.0, rope_scaling: None, n_taps: 1, block_size: 4, max_anchors: 4, mask_token_id: 299, gamma: 4.0 };
    let d = Drafter::new(c.clone());
    let mut rng = Rng::new(31);
    let p = d.init_params(5);
    // A zero lm_head: every logit ties, the argmax is token 0, so the slots whose label is
    // 0 are right and the others wrong.
    let frozen = Frozen { embed: rand_vec(&mut rng, c.vocab * c.hidden, 1.0), lm_head: vec![0.0; c.vocab * c.hidden] };
    let len = 24usize;
    let taps: Vec<Vec<f32>> = (0..40).map(|_| rand_vec(&mut rng, len * c.n_taps * c.hidden, 1.0)).collect();
    let ids: Vec<Vec<u32>> = (0..40).map(|i| (0..len).map(|t| if (t + i) % 3 == 0 { 0 } else { 1 + (t % 7) as u32 }).collect()).collect();
    let mask = vec![1u8; len];
    let anchors: Vec<Vec<usize>> = (0..40).map(|_| d.sample_anchors(&mask, &mut rng)).collect();
    let samples: Vec<Sample> = (0..40).map(|i| Sample { taps: &taps[i], ids: &ids[i], mask: &mask }).collect();
    let rows: usize = anchors.iter().map(|a| a.len() * (c.block_size - 1)).sum();
    assert!(rows > 16 * c.max_anchors * c.block_size, "more rows than the room for them ({rows})");
    let tw = d.total_weight(&samples, &anchors);
    let mut gpu = DeviceDrafter::new(device(), &d, &frozen, len).unwrap();
    let zeros = vec![0f32; p.len()];
    gpu.load(&p, &zeros, &zeros, 0).unwrap();
    let mut g = vec![0f32; p.len()];
    let all = gpu.forward_backward(&samples, Rows::F32, &anchors, tw, GradTo::Host(&mut g)).unwrap();
    let mut one = dflash_shared::drafter::StepStats::default();
    for i in 0..40 {
        one.merge(&gpu.forward_backward(&samples[i..i + 1], Rows::F32, &anchors[i..i + 1], tw, GradTo::Host(&mut g)).unwrap());
    }
    assert_eq!((&all.slot_correct, &all.slot_total, all.accept_sum, all.blocks), (&one.slot_correct, &one.slot_total, one.accept_sum, one.blocks));
    let right: u64 = all.slot_correct.iter().sum();
    assert!(right > 0 && right < all.slot_total.iter().sum(), "some slots are right, not all: {:?}", all.slot_correct);
    assert!((all.loss_sum - one.loss_sum).abs() <= 1e-9 * one.loss_sum.abs(), "{} vs {}", all.loss_sum, one.loss_sum);
    let want = d.train_batch(&p, &frozen, &samples, &anchors, tw, &mut g);
    assert_eq!((&all.slot_total, all.blocks), (&want.slot_total, want.blocks));
    if device().is_cpu() {
        assert_eq!(all.slot_correct, want.slot_correct);
        assert!((all.accept_sum - want.accept_sum).abs() < 1e-9);
        assert!((all.loss_sum - want.loss_sum).abs() < 1e-5 * want.loss_sum.abs(), "{} vs {}", all.loss_sum, want.loss_sum);
    }
}

/// What a device collective relies on: the gradient left on the device is the one the host
/// path downloads, and a sum all-reduced into the device's reduce buffer, scaled there by
/// 1/Σw, steps the weights exactly as the host's scaled sum does.
#[test]
fn host_device_drafter_applies_a_sum_reduced_on_the_device_like_the_host_sum() {
    let _checks = all_checks();
    use dflash_shared::drafter::DrafterConfig;
    use dflash_worker::models::drafter::device::DeviceDrafter;
    use dflash_worker::device::{f32_bytes, Stream};
    use dflash_worker::models::drafter::{reduce_slots, AdamW, Drafter, Frozen, Sample};
    let c = DrafterConfig {
        hidden: 32,
        layers: 1,
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
        max_anchors: 3,
        mask_token_id: 299,
        gamma: 4.0,
    };
    let d = Drafter::new(c.clone());
    let mut rng = Rng::new(5);
    let p = d.init_params(9);
    let frozen = Frozen { embed: rand_vec(&mut rng, c.vocab * c.hidden, 1.0), lm_head: rand_vec(&mut rng, c.vocab * c.hidden, 0.5) };
    let len = 19;
    let taps16: Vec<u8> = rand_vec(&mut rng, len * c.n_taps * c.hidden, 1.0).iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect();
    let ids: Vec<u32> = (0..len).map(|t| (t * 37 % 290) as u32).collect();
    let mask: Vec<u8> = (0..len).map(|t| (t % 5 != 2) as u8).collect();
    let anchors = vec![d.sample_anchors(&mask, &mut rng)];
    let samples = [Sample { taps: &[], ids: &ids, mask: &mask }];
    let raw = [taps16.as_slice()];
    let n = p.len();
    let zeros = vec![0f32; n];
    let mut host = DeviceDrafter::new(device(), &d, &frozen, 32).unwrap();
    let mut dev = DeviceDrafter::new(device(), &d, &frozen, 32).unwrap();
    host.load(&p, &zeros, &zeros, 0).unwrap();
    dev.load(&p, &zeros, &zeros, 0).unwrap();
    let mut g = vec![0f32; n];
    let s1 = host.forward_backward(&samples, Rows::Bf16(&raw), &anchors, 1.0, GradTo::Host(&mut g)).unwrap();
    let s2 = dev.forward_backward(&samples, Rows::Bf16(&raw), &anchors, 1.0, GradTo::Device).unwrap();
    assert_same_sum("the loss sum kept on the device", s2.loss_sum, s1.loss_sum, s1.slot_total.iter().sum::<u64>() as usize);
    let mut kept = vec![0u8; n * 4];
    dev.grads_to_host(&mut kept).unwrap();
    let f32s = |b: &[u8]| -> Vec<f32> { b.chunks_exact(4).map(|x| f32::from_le_bytes(x.try_into().unwrap())).collect() };
    assert_same_gradient("the gradient left on the device: the downloaded one", &f32s(&kept), &g);
    // Two ranks' worth: this gradient and a scaled copy, with their loss weights.
    let other: Vec<f32> = g.iter().map(|x| x * -0.5).collect();
    let sum: Vec<f32> = g.iter().zip(&other).map(|(a, b)| a + b).collect();
    let weight = s1.weight_sum + 3.0;
    let (_, gred) = dev.reduce_buffers();
    dev.device().upload(Stream::Compute, gred, f32_bytes(&sum)).unwrap();
    let opt = AdamW::new(n);
    let mut scaled = sum.clone();
    reduce_slots(&mut scaled, weight);
    host.update(&Step::new(1, 1.0, 1e-2, &opt.hyper()), Gradient::Host(&scaled)).unwrap();
    dev.update(&Step::new(1, 1.0, 1e-2, &opt.hyper()), Gradient::Reduced { weight_sum: weight, after: None }).unwrap();
    let (a, b) = (host.drain().unwrap().unwrap(), dev.drain().unwrap().unwrap());
    assert_eq!(a.skipped, b.skipped, "the same clipping: {a:?} {b:?}");
    // The norm is the root of a sum of n squares: half the sum's relative bound.
    assert_same_sum("the gradient norm", b.grad_norm * b.grad_norm, a.grad_norm * a.grad_norm, n);
    let (mut pa, mut pb, mut m, mut v) = (vec![0f32; n], vec![0f32; n], vec![0f32; n], vec![0f32; n]);
    host.fetch(&mut pa, &mut m, &mut v).unwrap();
    dev.fetch(&mut pb, &mut m, &mut v).unwrap();
    assert_same_step("the weights after the step", &pb, &pa, 1e-2);
    assert!(rel_err(&pa, &p) > 1e-5, "and they moved");

    // Buckets: two samples, events recorded in the last one's backward only. They follow
    // the plan (final norm, layers from the last, the context projection), cover every
    // parameter once, and a one-rank reduction through them on the copy stream, ordered
    // only by those events (the host device's race detector checks it), steps the weights
    // like the host path.
    let ids2: Vec<u32> = (0..len).map(|t| (t * 13 % 290) as u32).collect();
    let two = [Sample { taps: &[], ids: &ids, mask: &mask }, Sample { taps: &[], ids: &ids2, mask: &mask }];
    let raw2 = [taps16.as_slice(), taps16.as_slice()];
    let anchors2 = vec![anchors[0].clone(), anchors[0].clone()];
    host.load(&p, &zeros, &zeros, 0).unwrap();
    dev.load(&p, &zeros, &zeros, 0).unwrap();
    let s1 = host.forward_backward(&two, Rows::Bf16(&raw2), &anchors2, 1.0, GradTo::Host(&mut g)).unwrap();
    dev.forward_backward(&two, Rows::Bf16(&raw2), &anchors2, 1.0, GradTo::Device).unwrap();
    let plan = dev.bucket_plan();
    assert_eq!(dev.bucket_ranges(), plan, "one event per bucket of the plan, in its order");
    assert_eq!(plan.len(), c.layers + 2);
    let mut covered: Vec<std::ops::Range<usize>> = plan.clone();
    covered.sort_by_key(|r| r.start);
    assert_eq!(covered.first().unwrap().start, 0);
    assert!(covered.windows(2).all(|w| w[0].end == w[1].start) && covered.last().unwrap().end == n, "every parameter once: {covered:?}");
    assert_eq!(plan[0], d.layout.range("norm.weight"), "the final norm's gradient is finished first");
    let e = dev.reduce_alone().unwrap();
    dev.update(&Step::new(1, 1.0, 1e-2, &opt.hyper()), Gradient::Reduced { weight_sum: s1.weight_sum, after: Some(e) }).unwrap();
    dev.drain().unwrap();
    // The host path steps by the device's own gradient (its backward and the host's differ
    // in the order of their atomics, see ATOMIC_TOL), taken once the step is done, so that
    // nothing but the events ordered the reduction.
    dev.grads_to_host(&mut kept).unwrap();
    let gd = f32s(&kept);
    assert_same_gradient("bucketed: the device's gradient, the host path's", &gd, &g);
    let mut scaled = gd;
    reduce_slots(&mut scaled, s1.weight_sum);
    host.update(&Step::new(1, 1.0, 1e-2, &opt.hyper()), Gradient::Host(&scaled)).unwrap();
    host.drain().unwrap();
    host.fetch(&mut pa, &mut m, &mut v).unwrap();
    dev.fetch(&mut pb, &mut m, &mut v).unwrap();
    assert_same_step("bucketed: the weights after the step", &pb, &pa, 1e-2);
    // Three rows, so the staging buffers are each used again: the rows copied on the copy
    // stream while the sample before computes give the f32 path's gradient.
    let taps16b: Vec<u8> = rand_vec(&mut rng, len * c.n_taps * c.hidden, 1.0).iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect();
    let widen = |b: &[u8]| -> Vec<f32> { b.chunks_exact(2).map(|p| half::bf16::from_le_bytes([p[0], p[1]]).to_f32()).collect() };
    let (wa, wb) = (widen(&taps16), widen(&taps16b));
    let three16 = [taps16.as_slice(), taps16b.as_slice(), taps16.as_slice()];
    let three_bare = [Sample { taps: &[], ids: &ids, mask: &mask }, Sample { taps: &[], ids: &ids2, mask: &mask }, Sample { taps: &[], ids: &ids2, mask: &mask }];
    let three_wide = [Sample { taps: &wa, ids: &ids, mask: &mask }, Sample { taps: &wb, ids: &ids2, mask: &mask }, Sample { taps: &wa, ids: &ids2, mask: &mask }];
    let anchors3 = vec![anchors[0].clone(); 3];
    let (mut g16, mut g32) = (vec![0f32; n], vec![0f32; n]);
    let a16 = dev.forward_backward(&three_bare, Rows::Bf16(&three16), &anchors3, 1.0, GradTo::Host(&mut g16)).unwrap();
    let a32 = dev.forward_backward(&three_wide, Rows::F32, &anchors3, 1.0, GradTo::Host(&mut g32)).unwrap();
    assert_same_sum("staged rows: the f32 path's loss sum", a16.loss_sum, a32.loss_sum, a32.slot_total.iter().sum::<u64>() as usize);
    assert_same_gradient("staged rows: the f32 path's gradient", &g16, &g32);
    // Without the events, a copy of the gradient on the copy stream races the backward
    // that writes it: the host device (which runs streams concurrently) refuses it.
    // (The race detector is the host device's: a GPU, or the emulated one, runs the race.)
    if !device().is_cpu() && !on_gpu() {
        dev.forward_backward(&two, Rows::Bf16(&raw2), &anchors2, 1.0, GradTo::Device).unwrap();
        let (gr, red) = dev.reduce_buffers();
        let copy = dflash_worker::device::Gemm { transa: false, transb: false, m: n, n: 1, k: 1, alpha: 1.0, a: gr, lda: n, b: gr.f32s(0..1), ldb: 1, beta: 0.0, c: red, ldc: n, bf16_inputs: false, bf16_output: false };
        let err = dev.device().gemm(Stream::Copy, &copy).and_then(|_| dev.device().sync()).unwrap_err().to_string();
        assert!(err.contains("race") || err.contains("not ordered") || err.contains("written"), "{err}");
    }
}

/// The bf16-activation variants of the target's forward ops (`act16`) against the f32 ops
/// on the same, bf16-exact inputs: each computes in f32 and rounds its output once, so it
/// is the f32 result rounded to bf16: exactly off a GPU; within one bf16 step on one (two
/// for attention and the GEMM, whose sums may run in another order there).
#[test]
fn host_device_bf16_activation_ops_round_the_f32_ops_once() {
    let _checks = all_checks();
    let bf = |v: &[f32]| -> Vec<f32> { v.iter().map(|x| half::bf16::from_f32(*x).to_f32()).collect() };
    let mut rng = Rng::new(31);
    let (t, h, nh, nkv, hd, inter) = (9usize, 64usize, 4usize, 2usize, 16usize, 48usize);
    let mut o32 = ops();
    let mut o16 = ops();
    o16.act16 = true;
    // One bf16 step of the largest value: the rounding of a single store.
    let check = |what: &str, got: &[f32], want: &[f32], steps: f32| {
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
        let err = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max) / scale;
        eprintln!("{what} (bf16 activations): max error {err:.2e} of the largest value");
        if on_gpu() {
            assert!(err <= steps * 2f32.powi(-8), "{what}: {err} > {steps} bf16 steps");
        } else {
            // The host device runs the same kernels in the same order (the CPU device
            // widens and rounds around its f32 kernels): exactly the f32 result rounded to
            // nearest even, which a truncating or double rounding would miss.
            assert_eq!(err, 0.0, "{what}: not the f32 result rounded once");
        }
    };
    let x = bf(&rand_vec(&mut rng, t * h, 1.0));
    let w = rand_vec(&mut rng, h, 1.0);
    // RMSNorm (weights stay f32), in place too.
    let (x32, w32, y32, r32) = (put(&mut o32, &x), put(&mut o32, &w), put(&mut o32, &vec![0.0; t * h]), put(&mut o32, &vec![0.0; t]));
    o32.rmsnorm(o32.act_mat(x32, t, h), w32, o32.act_mat(y32, t, h), r32, 1e-6).unwrap();
    let want = bf(&get(&mut o32, y32));
    let (x16, w16, r16) = (put16(&mut o16, &x), put(&mut o16, &w), put(&mut o16, &vec![0.0; t]));
    o16.rmsnorm(o16.act_mat(x16, t, h), w16, o16.act_mat(x16, t, h), r16, 1e-6).unwrap();
    check("rmsnorm", &get16(&mut o16, x16), &want, 1.0);
    // RoPE in place.
    let q = bf(&rand_vec(&mut rng, t * nh * hd, 1.0));
    let pos: Vec<i32> = (0..t as i32).map(|i| i * 3).collect();
    let inv: Vec<f32> = (0..hd / 2).map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / hd as f32)).collect();
    let (q32, p32, i32_) = (put(&mut o32, &q), put_i32(&mut o32, &pos), put(&mut o32, &inv));
    o32.rope(o32.act_mat(q32, t, nh * hd), p32, i32_, hd, 1.0, false).unwrap();
    let want = bf(&get(&mut o32, q32));
    let (q16, p16, i16_) = (put16(&mut o16, &q), put_i32(&mut o16, &pos), put(&mut o16, &inv));
    o16.rope(o16.act_mat(q16, t, nh * hd), p16, i16_, hd, 1.0, false).unwrap();
    check("rope", &get16(&mut o16, q16), &want, 1.0);
    // Causal attention with GQA.
    let (k, v) = (bf(&rand_vec(&mut rng, t * nkv * hd, 1.0)), bf(&rand_vec(&mut rng, t * nkv * hd, 1.0)));
    let spans: Vec<i32> = (0..t as i32).flat_map(|i| [0, i + 1, 0, 0]).collect();
    let (qa, ka, va, sa, oa, la) = (put(&mut o32, &q), put(&mut o32, &k), put(&mut o32, &v), put_i32(&mut o32, &spans), put(&mut o32, &vec![0.0; t * nh * hd]), put(&mut o32, &vec![0.0; t * nh]));
    o32.attention(Attention { q: qa, k: ka, v: va, out: oa, lse: la, spans: sa, tq: t, qh: nh, kvh: nkv, hd }).unwrap();
    let want = bf(&get(&mut o32, oa));
    let (qb, kb, vb, sb, ob, lb) = (put16(&mut o16, &q), put16(&mut o16, &k), put16(&mut o16, &v), put_i32(&mut o16, &spans), put16(&mut o16, &vec![0.0; t * nh * hd]), put(&mut o16, &vec![0.0; t * nh]));
    o16.attention(Attention { q: qb, k: kb, v: vb, out: ob, lse: lb, spans: sb, tq: t, qh: nh, kvh: nkv, hd }).unwrap();
    check("attention", &get16(&mut o16, ob), &want, 2.0);
    // SwiGLU, the residual add, the tap copy.
    let (g, u) = (bf(&rand_vec(&mut rng, t * inter, 2.0)), bf(&rand_vec(&mut rng, t * inter, 1.0)));
    let (g32, u32_, s32) = (put(&mut o32, &g), put(&mut o32, &u), put(&mut o32, &vec![0.0; t * inter]));
    o32.swiglu(g32, u32_, s32).unwrap();
    let want = bf(&get(&mut o32, s32));
    let (g16, u16_, s16) = (put16(&mut o16, &g), put16(&mut o16, &u), put16(&mut o16, &vec![0.0; t * inter]));
    o16.swiglu(g16, u16_, s16).unwrap();
    check("swiglu", &get16(&mut o16, s16), &want, 1.0);
    // The same from a fused [gate | up] buffer (rows of 2 × inter).
    let gu: Vec<f32> = g.chunks(inter).zip(u.chunks(inter)).flat_map(|(a, b)| a.iter().chain(b).copied()).collect();
    let (gu16, s16) = (put16(&mut o16, &gu), put16(&mut o16, &vec![0.0; t * inter]));
    o16.swiglu_gu(gu16, s16, inter).unwrap();
    check("swiglu of fused gate|up", &get16(&mut o16, s16), &want, 1.0);
    let y = bf(&rand_vec(&mut rng, t * h, 1.0));
    let (a32, b32) = (put(&mut o32, &x), put(&mut o32, &y));
    o32.add(a32, b32).unwrap();
    let want = bf(&get(&mut o32, a32));
    let (a16, b16) = (put16(&mut o16, &x), put16(&mut o16, &y));
    o16.add(a16, b16).unwrap();
    check("add", &get16(&mut o16, a16), &want, 1.0);
    let out16 = put16(&mut o16, &vec![0.0; t * 2 * h]);
    o16.copy_cols((o16.act_mat(out16, t, 2 * h), h), (o16.act_mat(a16, t, h), 0), h).unwrap();
    let got = get16(&mut o16, out16);
    assert!((0..t).all(|r| got[r * 2 * h + h..(r + 1) * 2 * h] == want[r * h..(r + 1) * h] && got[r * 2 * h..r * 2 * h + h].iter().all(|x| *x == 0.0)), "copy_cols_bf16 moves the bits");
    // The embedding gather of a bf16 table is exact.
    let vocab = 50;
    let table = bf(&rand_vec(&mut rng, vocab * h, 1.0));
    let ids: Vec<i32> = (0..t as i32).map(|i| (i * 7) % 60).collect();
    let (tb, ib, eb) = (put16(&mut o16, &table), put_i32(&mut o16, &ids), put16(&mut o16, &vec![0.0; t * h]));
    o16.embed(eb, tb, ib, t, h, vocab).unwrap();
    let got = get16(&mut o16, eb);
    assert!((0..t).all(|r| got[r * h..(r + 1) * h] == table[(ids[r] as usize).min(vocab - 1) * h..((ids[r] as usize).min(vocab - 1) + 1) * h]));
    // A GEMM bf16 in and out: the f32 GEMM of the same inputs, rounded once.
    let (m, kk, n) = (t, h, 24usize);
    let wm = bf(&rand_vec(&mut rng, n * kk, 0.5));
    let (xg, wg, yg) = (put(&mut o32, &x), put(&mut o32, &wm), put(&mut o32, &vec![0.0; m * n]));
    o32.matmul(o32.act_mat(xg, m, kk), o32.act_mat(wg, n, kk), o32.act_mat(yg, m, n)).unwrap();
    let want = bf(&get(&mut o32, yg));
    let (xh, wh, yh) = (put16(&mut o16, &x), put16(&mut o16, &wm), put16(&mut o16, &vec![0.0; m * n]));
    o16.matmul(o16.act_mat(xh, m, kk), o16.act_mat(wh, n, kk), o16.act_mat(yh, m, n)).unwrap();
    check("matmul", &get16(&mut o16, yh), &want, 2.0);
}

/// A NaN in a query row: every backend treats the row as the CPU backend's softmax does
/// (all its scores NaN: no key kept, output 0), and the other rows are not touched. The
/// per-key GPU loop before the tiled forward made the row NaN instead; the NaN is still in
/// the activations the query came from, so the step is still caught as non-finite.
#[test]
fn host_device_attention_treats_a_nan_query_row_as_the_cpu_backend_does() {
    let _checks = all_checks();
    let mut rng = Rng::new(13);
    let (t, h) = (20usize, Heads { q_heads: 2, kv_heads: 1, head_dim: 32 });
    let (qw, kw) = (h.q_heads * h.head_dim, h.kv_heads * h.head_dim);
    let bf = |v: Vec<f32>| -> Vec<f32> { v.iter().map(|x| half::bf16::from_f32(*x).to_f32()).collect() };
    let mut q = bf(rand_vec(&mut rng, t * qw, 1.0));
    q[3 * qw + 5] = f32::NAN;
    let (k, v) = (bf(rand_vec(&mut rng, t * kw, 1.0)), bf(rand_vec(&mut rng, t * kw, 1.0)));
    let spans: Vec<KeySpan> = (0..t).map(|i| KeySpan { a: 0..i + 1, b: 0..0 }).collect();
    let mut want = vec![0f32; t * qw];
    Cpu::with_threads(1).attention(&q, &k, &v, &mut want, &spans, h);
    let mut o = ops();
    let (gq, gk, gv, gs) = (put(&mut o, &q), put(&mut o, &k), put(&mut o, &v), put_i32(&mut o, &spans_i32(&spans)));
    let (go, gl) = (put(&mut o, &vec![f32::NAN; t * qw]), put(&mut o, &vec![0.0; t * h.q_heads]));
    o.attention(Attention { q: gq, k: gk, v: gv, out: go, lse: gl, spans: gs, tq: t, qh: h.q_heads, kvh: h.kv_heads, hd: h.head_dim }).unwrap();
    let got = get(&mut o, go);
    let head0 = |v: &[f32], r: usize| v[r * qw..r * qw + h.head_dim].to_vec();
    assert!(head0(&want, 3).iter().all(|x| *x == 0.0), "the CPU backend's row: {:?}", head0(&want, 3));
    assert_eq!(head0(&got, 3), head0(&want, 3), "the device's row 3, head 0");
    assert!(got.iter().all(|x| x.is_finite()), "every other value written and finite");
    // On tensor cores the probabilities are rounded to bf16 (see check_attention).
    let tol = if device().is_cpu() { 1e-5 } else { 2f32.powi(-8) * v.iter().fold(0f32, |m, x| m.max(x.abs())) / want.iter().fold(0f32, |m, x| m.max(x.abs())) };
    assert_close("attention with a NaN query row", &got, &want, tol);
    // The kernels' backward: the row takes no part, so its NaN reaches no key's gradient.
    // The reference is the CPU backend's backward with that row's query and incoming
    // gradient set to zero (which makes its contributions zero). (The CPU device's
    // backward, GEMMs over tiles of rows, lets the NaN into dk; either way the step is
    // skipped as non-finite, the NaN being in the activations the query came from.)
    if device().is_cpu() {
        return;
    }
    let dout = bf(rand_vec(&mut rng, t * qw, 1.0));
    let (mut q0, mut dout0) = (q.clone(), dout.clone());
    q0[3 * qw..3 * qw + h.head_dim].fill(0.0);
    dout0[3 * qw..3 * qw + h.head_dim].fill(0.0);
    let cpu = Cpu::with_threads(1);
    let mut out0 = vec![0f32; t * qw];
    let saved = cpu.attention(&q0, &k, &v, &mut out0, &spans, h);
    let (mut dq, mut dk, mut dv) = (vec![0f32; t * qw], vec![0f32; t * kw], vec![0f32; t * kw]);
    cpu.attention_backward(&dout0, &q0, &k, &v, &saved, &spans, h, &mut dq, &mut dk, &mut dv);
    let (gd, gdq, gdk, gdv) = (put(&mut o, &dout), put(&mut o, &vec![0.0; t * qw]), put(&mut o, &vec![0.0; t * kw]), put(&mut o, &vec![0.0; t * kw]));
    let gdelta = put(&mut o, &vec![f32::NAN; Ops::attention_backward_scratch(t, h.q_heads, h.head_dim)]);
    o.attention_backward(AttentionGrad { fwd: Attention { q: gq, k: gk, v: gv, out: go, lse: gl, spans: gs, tq: t, qh: h.q_heads, kvh: h.kv_heads, hd: h.head_dim }, dout: gd, dq: gdq, dk: gdk, dv: gdv }, gdelta).unwrap();
    let tol = if device().is_cpu() { 1e-4 } else { 1e-2 };
    let gdq = get(&mut o, gdq);
    assert!(head0(&gdq, 3).iter().all(|x| *x == 0.0), "no gradient for the NaN row's query: {:?}", head0(&gdq, 3));
    assert_close("dq with a NaN query row", &gdq, &dq, tol);
    assert_close("dk with a NaN query row", &get(&mut o, gdk), &dk, tol);
    assert_close("dv with a NaN query row", &get(&mut o, gdv), &dv, tol);
}

fn put16(o: &mut Ops, v: &[f32]) -> DSlice {
    let bits: Vec<u8> = v.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect();
    let s = o.dev.alloc(v.len() * 2 + 4).map(|p| DSlice { ptr: p, bytes: v.len() * 2 }).unwrap();
    o.dev.upload(Stream::Compute, s, &bits).unwrap();
    s
}

fn get16(o: &mut Ops, s: DSlice) -> Vec<f32> {
    let mut b = vec![0u8; s.bytes];
    o.dev.download(Stream::Compute, s, &mut b).unwrap();
    b.chunks_exact(2).map(|p| half::bf16::from_le_bytes([p[0], p[1]]).to_f32()).collect()
}

/// The bf16 attention forward (the GPU target's; WMMA tensor cores on a GPU and on the host
/// device) against the CPU backend's f32 attention of the same bf16-exact inputs. The
/// kernel rounds each probability to bf16 before P·V (flash-attention's choice) but sums
/// them in f32, so an output is off by at most 2^-9 of max|v| from the weights and 2^-9
/// of itself from its store: within 2^-8 of max|v|. Its log-sum-exp is the f32 kernel's.
fn check_attention_bf16(name: &str, tq: usize, tk: usize, spans: &[KeySpan], h: Heads, seed: u64, nan_at: Option<usize>) {
    let bf = |v: Vec<f32>| -> Vec<f32> { v.iter().map(|x| half::bf16::from_f32(*x).to_f32()).collect() };
    let mut rng = Rng::new(seed);
    let (qw, kw) = (h.q_heads * h.head_dim, h.kv_heads * h.head_dim);
    let mut q = bf(rand_vec(&mut rng, tq * qw, 1.5));
    let (k, v) = (bf(rand_vec(&mut rng, tk * kw, 1.5)), bf(rand_vec(&mut rng, tk * kw, 1.0)));
    if let Some(i) = nan_at {
        q[i] = f32::NAN;
    }
    let mut want = vec![0f32; tq * qw];
    Cpu::with_threads(1).attention(&q, &k, &v, &mut want, spans, h);
    let sp = spans_i32(spans);
    let mut o32 = ops();
    let (qa, ka, va, sa, oa, la) = (put(&mut o32, &q), put(&mut o32, &k), put(&mut o32, &v), put_i32(&mut o32, &sp), put(&mut o32, &vec![0.0; tq * qw]), put(&mut o32, &vec![0.0; tq * h.q_heads]));
    o32.attention(Attention { q: qa, k: ka, v: va, out: oa, lse: la, spans: sa, tq, qh: h.q_heads, kvh: h.kv_heads, hd: h.head_dim }).unwrap();
    let lse32 = get(&mut o32, la);
    let mut o16 = ops();
    o16.act16 = true;
    let (qb, kb, vb, sb) = (put16(&mut o16, &q), put16(&mut o16, &k), put16(&mut o16, &v), put_i32(&mut o16, &sp));
    let (ob, lb) = (put16(&mut o16, &vec![f32::NAN; tq * qw]), put(&mut o16, &vec![f32::NAN; tq * h.q_heads]));
    o16.attention(Attention { q: qb, k: kb, v: vb, out: ob, lse: lb, spans: sb, tq, qh: h.q_heads, kvh: h.kv_heads, hd: h.head_dim }).unwrap();
    let (got, lse) = (get16(&mut o16, ob), get(&mut o16, lb));
    assert!(got.iter().all(|x| x.is_finite()), "{name}: every output written and finite");
    let vmax = v.iter().fold(0f32, |m, x| m.max(x.abs()));
    let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    eprintln!("{name} (bf16, tensor cores): max error {:.2e} of max|v| (bound 2^-8 = 3.9e-3)", err / vmax);
    assert!(err <= 2f32.powi(-8) * vmax, "{name}: {err} > 2^-8 of max|v| {vmax}");
    for (i, (a, b)) in lse.iter().zip(&lse32).enumerate() {
        let ok = if b.is_finite() { (a - b).abs() <= 1e-5 * b.abs().max(1.0) } else { a == b };
        assert!(ok, "{name}: lse of (row, head) {i}: {a} against the f32 kernel's {b}");
    }
}

#[test]
fn host_device_bf16_attention_on_tensor_cores_matches_the_cpu_backend() {
    let _checks = all_checks();
    // 70 causal rows: 5 blocks of 16 rows (the last partly empty) over up to 5 tiles of
    // 16 keys, at the largest head dim; then head dims that are no multiple of 16 (zero
    // padding), with GQA.
    let causal = |t: usize| -> Vec<KeySpan> { (0..t).map(|i| KeySpan { a: 0..i + 1, b: 0..0 }).collect() };
    check_attention_bf16("causal hd=256, 70 rows", 70, 70, &causal(70), Heads { q_heads: 2, kv_heads: 1, head_dim: 256 }, 21, None);
    check_attention_bf16("causal hd=40, GQA", 37, 37, &causal(37), Heads { q_heads: 4, kv_heads: 2, head_dim: 40 }, 22, None);
    check_attention_bf16("causal hd=8", 19, 19, &causal(19), Heads { q_heads: 2, kv_heads: 2, head_dim: 8 }, 23, None);
    // DFlash blocks: two spans per row (context before the anchor, then the block itself),
    // a block at anchor 0 with no context, and rows of one block across a 16-row block edge.
    let (slen, bs, anchors) = (40usize, 6usize, [0usize, 9, 23, 31]);
    let tq = anchors.len() * bs;
    let spans: Vec<KeySpan> = (0..tq).map(|i| KeySpan { a: 0..anchors[i / bs], b: slen + (i / bs) * bs..slen + (i / bs + 1) * bs }).collect();
    check_attention_bf16("dflash blocks", tq, slen + tq, &spans, Heads { q_heads: 4, kv_heads: 1, head_dim: 64 }, 24, None);
    // A row without keys outputs zeros; a NaN in a query row leaves that row with no key
    // kept (0, lse −inf) as the CPU backend's softmax does, and no other row touched.
    let empty = vec![KeySpan { a: 0..0, b: 0..0 }, KeySpan { a: 0..2, b: 0..0 }, KeySpan { a: 0..3, b: 0..0 }];
    check_attention_bf16("a row without keys", 3, 3, &empty, Heads { q_heads: 2, kv_heads: 2, head_dim: 32 }, 25, None);
    check_attention_bf16("a NaN query row", 20, 20, &causal(20), Heads { q_heads: 2, kv_heads: 1, head_dim: 32 }, 26, Some(3 * 64 + 5));
}

/// The FlashAttention-2 forward (head dims that are a multiple of 8 up to 128): CTAs
/// of 64 rows over double-buffered tiles of 32 (hd 128) or 64 keys, at the shapes that
/// exercise its edges: several CTAs and tiles with the last of each partly empty, GQA,
/// every head-dim bucket with and without zero padding, DFlash blocks of 16 with four
/// blocks a CTA whose anchors differ (tiles masked, skipped or whole for a warp).
#[test]
fn host_device_flash_attention_2_forward_matches_the_cpu_backend() {
    let _checks = all_checks();
    let causal = |t: usize| -> Vec<KeySpan> { (0..t).map(|i| KeySpan { a: 0..i + 1, b: 0..0 }).collect() };
    for (hd, t, seed) in [(128usize, 150usize, 31u64), (64, 131, 32), (16, 70, 33), (120, 45, 34)] {
        let a = Attention::shape_of(t, 4, 2, hd);
        assert!(Fa2Dim::for_call(&a).is_some(), "hd {hd} takes the FlashAttention-2 forward");
        check_attention_bf16(&format!("FA2 causal hd={hd}, {t} rows, GQA 4/2"), t, t, &causal(t), Heads { q_heads: 4, kv_heads: 2, head_dim: hd }, seed, None);
    }
    let (slen, bs) = (120usize, 16usize);
    let anchors = [0usize, 3, 17, 40, 41, 77, 100, 118, 119];
    let tq = anchors.len() * bs;
    let spans: Vec<KeySpan> = (0..tq).map(|i| KeySpan { a: 0..anchors[i / bs], b: slen + (i / bs) * bs..slen + (i / bs + 1) * bs }).collect();
    check_attention_bf16("FA2 dflash blocks of 16", tq, slen + tq, &spans, Heads { q_heads: 2, kv_heads: 1, head_dim: 128 }, 35, None);
    // A context shorter than a tile (64 keys at hd 64): the context's last tile reaches into
    // the blocks' keys, which it must not count (they are their own tiles').
    let (slen, anchors) = (40usize, [0usize, 9, 23, 31]);
    let tq = anchors.len() * bs;
    let spans: Vec<KeySpan> = (0..tq).map(|i| KeySpan { a: 0..anchors[i / bs], b: slen + (i / bs) * bs..slen + (i / bs + 1) * bs }).collect();
    check_attention_bf16("FA2 dflash blocks, a context shorter than a tile", tq, slen + tq, &spans, Heads { q_heads: 2, kv_heads: 1, head_dim: 64 }, 37, None);
    check_attention_bf16("FA2 a NaN query row, hd 64", 70, 70, &causal(70), Heads { q_heads: 2, kv_heads: 2, head_dim: 64 }, 36, Some(65 * 128 + 7));
    // With f32 activations (the drafter's: Q, K and V rounded to bf16 as they are staged),
    // forward and backward (whose log-sum-exp the forward wrote).
    check_attention("FA2 f32 causal hd=128, 150 rows, GQA 4/2", 150, 150, &causal(150), Heads { q_heads: 4, kv_heads: 2, head_dim: 128 }, 38);
    check_attention("FA2 f32 dflash blocks of 16, a context shorter than a tile", tq, slen + tq, &spans, Heads { q_heads: 2, kv_heads: 1, head_dim: 64 }, 39);
}

/// The backward in FlashAttention-2's structure (a CTA per 64 keys of a KV head, dK and dV
/// in registers, dQ by atomics) against the CPU backend, at every head-dim bucket: tiles of
/// keys cut by the key count, query tiles cut by the row count, GQA groups of 1, 2 and 4,
/// DFlash blocks whose context tiles are seen by some query tiles and not others, rows
/// without keys, and a head dim that fills its bucket only partly.
#[test]
fn host_device_flash_attention_2_backward_matches_the_cpu_backend() {
    let _checks = all_checks();
    let causal = |t: usize| -> Vec<KeySpan> { (0..t).map(|i| KeySpan { a: 0..i + 1, b: 0..0 }).collect() };
    let blocks = |slen: usize, bs: usize, anchors: &[usize]| -> Vec<KeySpan> {
        (0..anchors.len() * bs).map(|i| KeySpan { a: 0..anchors[i / bs], b: slen + (i / bs) * bs..slen + (i / bs + 1) * bs }).collect()
    };
    let heads = |q_heads, kv_heads, head_dim| Heads { q_heads, kv_heads, head_dim };
    let cases: Vec<(&str, usize, usize, Vec<KeySpan>, Heads)> = vec![
        ("causal hd=32, 131 rows, GQA 8/2", 131, 131, causal(131), heads(8, 2, 32)),
        ("causal hd=64, 64 rows (one whole tile), MHA 2/2", 64, 64, causal(64), heads(2, 2, 64)),
        ("causal hd=120 (bucket 128), 97 rows, GQA 3/1", 97, 97, causal(97), heads(3, 1, 120)),
        ("causal hd=16 (bucket 32), 70 rows", 70, 70, causal(70), heads(2, 1, 16)),
        ("dflash hd=128, blocks of 16 over 150 tokens", 7 * 16, 150 + 7 * 16, blocks(150, 16, &[0, 5, 63, 64, 100, 129, 149]), heads(4, 2, 128)),
        ("dflash hd=64, blocks of 8 over 200 tokens", 5 * 8, 200 + 5 * 8, blocks(200, 8, &[1, 70, 128, 130, 199]), heads(2, 1, 64)),
    ];
    for (i, (name, tq, tk, spans, h)) in cases.into_iter().enumerate() {
        let a = Attention::shape_of(tq, h.q_heads, h.kv_heads, h.head_dim);
        assert!(Fa2Dim::for_call(&a).is_some(), "{name} takes the FlashAttention-2 kernels");
        check_attention(&format!("FA2 backward, {name}"), tq, tk, &spans, h, 50 + i as u64);
    }
    // Rows without keys between rows with keys: they take no part.
    let mut spans = causal(90);
    for r in [0usize, 40, 41, 89] {
        spans[r] = KeySpan { a: 0..0, b: 0..0 };
    }
    check_attention("FA2 backward, rows without keys", 90, 90, &spans, heads(2, 1, 64), 60);
}


/// `eval`'s decoding on the device: the target over its KV cache (prefill in blocks, one
/// token, a block cropped away) gives the CPU decoder's logits and taps, and speculative
/// decoding with a drafter on the device writes the device's greedy tokens. (On a GPU the
/// last is reported, not asserted: bf16 GEMMs of 1 and of 8 rows may round a near tie
/// apart, which the host device, summing each element in one order, does not.)
#[test]
fn host_device_decoding_over_the_kv_cache_matches_the_cpu_decoder() {
    let _checks = all_checks();
    use dflash_worker::device::cpu::CpuDevice;
    use dflash_worker::eval::draft::Draft;
    use dflash_worker::eval::spec::{greedy, speculative, Stop};
    use dflash_worker::models::drafter::{Drafter, Frozen};
    use dflash_worker::models::target::device::decode::Decoder;
    use dflash_worker::models::target::Target;
    let tmp = tempfile::tempdir().unwrap();
    dflash_worker::models::tiny::write_random(tmp.path(), QWEN3, 23).unwrap();
    let (t, head) = Target::load_decoder(tmp.path(), &[0, 2]).unwrap();
    let mut cpu = Decoder::new(Box::new(CpuDevice::new()), &t, &head, 64, 8).unwrap();
    let mut dev = Decoder::new(device(), &t, &head, 64, 8).unwrap();
    let tol = if device().is_cpu() { 1e-5 } else { 3e-2 };
    let prompt: Vec<u32> = (0..13).map(|i| (i * 37 + 5) % 300).collect();
    let steps: [&[u32]; 4] = [&prompt, &[17], &[3, 99, 250, 7, 1], &[42]];
    for (i, s) in steps.iter().enumerate() {
        if i == 3 {
            // The block of 5 is rejected but its first token.
            cpu.crop(15).unwrap();
            dev.crop(15).unwrap();
        }
        let (want, got) = (cpu.prefill(s).unwrap(), dev.prefill(s).unwrap());
        assert_close(&format!("decoder logits, step {i}"), &got.logits, &want.logits, tol);
        assert_close(&format!("decoder taps, step {i}"), &got.taps, &want.taps, tol);
    }
    let c = &t.cfg;
    let dc = dflash_shared::drafter::DrafterConfig {
        hidden: c.hidden_size,
        layers: 1,
        q_heads: c.num_attention_heads,
        kv_heads: c.num_key_value_heads,
        head_dim: c.head_dim,
        intermediate: c.intermediate_size,
        vocab: c.vocab_size,
        eps: c.rms_norm_eps,
        rope_theta: c.rope_theta,
        rope_scaling: None,
        n_taps: 2,
        block_size: 4,
        max_anchors: 1,
        mask_token_id: 299,
        gamma: 4.0,
    };
    let embed = dflash_worker::models::weights::Weights::open(tmp.path())
        .unwrap()
        .get("model.embed_tokens.weight", &[c.vocab_size, c.hidden_size])
        .unwrap();
    let frozen = Frozen { embed, lm_head: head.lm_head.clone() };
    let p = Drafter::new(dc.clone()).init_params(4);
    let mut draft = Draft::new(device(), &dc, &p, &frozen, 64).unwrap();
    let stop = Stop { max_new: 20, eos: None };
    let g = greedy(&mut dev, &prompt, stop).unwrap();
    let s = speculative(&mut dev, &mut draft, &prompt, stop).unwrap();
    eprintln!("device speculative = greedy: {}; accepted {:?}", s.tokens == g, s.accepted);
    if !on_gpu() {
        check(s.tokens == g, || format!("speculative {:?} ≠ greedy {g:?} on the device", s.tokens));
    }
}
