//! Every op's forward and backward against candle (an independent implementation with
//! autograd) and against finite differences.

use candle_core::{DType, Device, Tensor, Var, D};
use dflash_shared::rng::Rng;
use dflash_worker::math::rope_inv_freq;
use dflash_worker::reference::ops::Cpu;
use dflash_worker::reference::{Heads, KeySpan};

fn rand(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..n)
        .map(|_| (r.next_u64() % 20001) as f32 / 10000.0 - 1.0)
        .collect()
}

fn t(v: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_slice(v, shape, &Device::Cpu).unwrap()
}

fn var(v: &[f32], shape: &[usize]) -> Var {
    Var::from_tensor(&t(v, shape)).unwrap()
}

fn flat(x: &Tensor) -> Vec<f32> {
    x.flatten_all()
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn close(a: &[f32], b: &[f32], tol: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = b.iter().fold(1e-3f32, |m, x| m.max(x.abs()));
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= tol * scale,
            "{what}[{i}]: ours {x} vs reference {y} (scale {scale})"
        );
    }
}

/// Check `analytic` (the gradient of Σ f(x)·r) against central differences of f.
fn finite_diff(x: &[f32], analytic: &[f32], r: &[f32], f: impl Fn(&[f32]) -> Vec<f32>, what: &str) {
    let eps = 1e-2f32;
    let mut x = x.to_vec();
    let idx: Vec<usize> = (0..x.len()).step_by((x.len() / 24).max(1)).collect();
    for i in idx {
        let orig = x[i];
        x[i] = orig + eps;
        let up: f64 = f(&x)
            .iter()
            .zip(r)
            .map(|(a, b)| (*a as f64) * (*b as f64))
            .sum();
        x[i] = orig - eps;
        let down: f64 = f(&x)
            .iter()
            .zip(r)
            .map(|(a, b)| (*a as f64) * (*b as f64))
            .sum();
        x[i] = orig;
        let num = ((up - down) / (2.0 * eps as f64)) as f32;
        let tol = 2e-2 * (1.0 + num.abs().max(analytic[i].abs()));
        assert!(
            (num - analytic[i]).abs() <= tol,
            "{what}[{i}]: analytic {} vs numeric {num}",
            analytic[i]
        );
    }
}

#[test]
fn matmul_forward_and_backward() {
    let cpu = Cpu::with_threads(2);
    let (m, k, n) = (7, 13, 5);
    let (x, w, r) = (rand(m * k, 1), rand(n * k, 2), rand(m * n, 3));
    let mut y = vec![0.0; m * n];
    cpu.matmul(&x, &w, &mut y, m, k, n);
    let (xv, wv) = (var(&x, &[m, k]), var(&w, &[n, k]));
    let yr = xv.as_tensor().matmul(&wv.as_tensor().t().unwrap()).unwrap();
    close(&y, &flat(&yr), 1e-5, "matmul");
    let grads = (yr * t(&r, &[m, n]))
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let (mut dx, mut dw) = (vec![0.0; m * k], vec![0.0; n * k]);
    cpu.matmul_backward(&r, &x, &w, Some(&mut dx), Some(&mut dw), m, k, n);
    close(&dx, &flat(grads.get(&xv).unwrap()), 1e-5, "dx");
    close(&dw, &flat(grads.get(&wv).unwrap()), 1e-5, "dw");
    let fx = |x: &[f32]| {
        let mut y = vec![0.0; m * n];
        cpu.matmul(x, &w, &mut y, m, k, n);
        y
    };
    finite_diff(&x, &dx, &r, fx, "matmul dx");
    // Threaded and single-threaded paths agree on a large product.
    let (m, k, n) = (64, 96, 80);
    let (x, w) = (rand(m * k, 4), rand(n * k, 5));
    let (mut a, mut b) = (vec![0.0; m * n], vec![0.0; m * n]);
    Cpu::with_threads(1).matmul(&x, &w, &mut a, m, k, n);
    Cpu::with_threads(4).matmul(&x, &w, &mut b, m, k, n);
    assert_eq!(a, b);
}

fn rmsnorm_ref(x: &Tensor, w: &Tensor, eps: f64) -> Tensor {
    let ms = x.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
    let r = (ms + eps).unwrap().sqrt().unwrap().recip().unwrap();
    x.broadcast_mul(&r).unwrap().broadcast_mul(w).unwrap()
}

#[test]
fn rmsnorm_forward_and_backward() {
    let cpu = Cpu::new();
    let (rows, d, eps) = (6, 16, 1e-6);
    let (x, w, r) = (rand(rows * d, 6), rand(d, 7), rand(rows * d, 8));
    let mut y = vec![0.0; rows * d];
    let rstd = cpu.rmsnorm(&x, &w, &mut y, d, eps as f32);
    let (xv, wv) = (var(&x, &[rows, d]), var(&w, &[d]));
    let yr = rmsnorm_ref(xv.as_tensor(), wv.as_tensor(), eps);
    close(&y, &flat(&yr), 1e-5, "rmsnorm");
    let grads = (yr * t(&r, &[rows, d]))
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let (mut dx, mut dw) = (vec![0.0; rows * d], vec![0.0; d]);
    cpu.rmsnorm_backward(&r, &x, &w, &rstd, &mut dx, Some(&mut dw), d);
    close(&dx, &flat(grads.get(&xv).unwrap()), 1e-4, "dx");
    close(&dw, &flat(grads.get(&wv).unwrap()), 1e-4, "dw");
    finite_diff(
        &x,
        &dx,
        &r,
        |x| {
            let mut y = vec![0.0; rows * d];
            cpu.rmsnorm(x, &w, &mut y, d, eps as f32);
            y
        },
        "rmsnorm dx",
    );
}

#[test]
fn rope_matches_rotate_half_and_its_inverse_is_the_backward() {
    let cpu = Cpu::new();
    let (tlen, heads, hd) = (5, 3, 8);
    let x = rand(tlen * heads * hd, 9);
    let positions: Vec<usize> = vec![0, 3, 4, 9, 100];
    let inv = rope_inv_freq(hd, 10000.0, None);
    let mut y = x.clone();
    cpu.rope(&mut y, heads, hd, &positions, &inv, 1.0, false);
    // Reference: x*cos + rotate_half(x)*sin with cos/sin of cat(freqs, freqs).
    let mut cos = Vec::new();
    let mut sin = Vec::new();
    for &p in &positions {
        for rep in 0..2 {
            let _ = rep;
            for f in &inv {
                cos.push((p as f32 * f).cos());
                sin.push((p as f32 * f).sin());
            }
        }
    }
    let (cos, sin) = (t(&cos, &[tlen, 1, hd]), t(&sin, &[tlen, 1, hd]));
    let xt = t(&x, &[tlen, heads, hd]);
    let x1 = xt.narrow(D::Minus1, 0, hd / 2).unwrap();
    let x2 = xt.narrow(D::Minus1, hd / 2, hd / 2).unwrap();
    let rot = Tensor::cat(&[&x2.neg().unwrap(), &x1], D::Minus1).unwrap();
    let yr = (xt.broadcast_mul(&cos).unwrap() + rot.broadcast_mul(&sin).unwrap()).unwrap();
    close(&y, &flat(&yr), 1e-5, "rope");
    cpu.rope(&mut y, heads, hd, &positions, &inv, 1.0, true);
    close(&y, &x, 1e-5, "rope inverse");
    // YaRN scales cos and sin: the output scales with them.
    let mut ys = x.clone();
    cpu.rope(&mut ys, heads, hd, &positions, &inv, 1.25, false);
    close(&ys, &flat(&(yr * 1.25).unwrap()), 1e-5, "scaled rope");
}

#[test]
fn swiglu_forward_and_backward() {
    let cpu = Cpu::new();
    let n = 40;
    let (g, u, r) = (rand(n, 10), rand(n, 11), rand(n, 12));
    let mut out = vec![0.0; n];
    cpu.swiglu(&g, &u, &mut out);
    let (gv, uv) = (var(&g, &[n]), var(&u, &[n]));
    let gt = gv.as_tensor();
    let silu = (gt / (gt.neg().unwrap().exp().unwrap() + 1.0).unwrap()).unwrap();
    let yr = (silu * uv.as_tensor()).unwrap();
    close(&out, &flat(&yr), 1e-5, "swiglu");
    let grads = (yr * t(&r, &[n]))
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let (mut dg, mut du) = (vec![0.0; n], vec![0.0; n]);
    cpu.swiglu_backward(&r, &g, &u, &mut dg, &mut du);
    close(&dg, &flat(grads.get(&gv).unwrap()), 1e-5, "dgate");
    close(&du, &flat(grads.get(&uv).unwrap()), 1e-5, "dup");
}

/// Reference attention with an explicit mask, per head, GQA by repeating kv heads.
fn attention_ref(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor, h: Heads) -> Tensor {
    let group = h.q_heads / h.kv_heads;
    let mut outs = Vec::new();
    for head in 0..h.q_heads {
        let kvh = head / group;
        let qh = q.narrow(1, head * h.head_dim, h.head_dim).unwrap();
        let kh = k.narrow(1, kvh * h.head_dim, h.head_dim).unwrap();
        let vh = v.narrow(1, kvh * h.head_dim, h.head_dim).unwrap();
        let s = (qh.matmul(&kh.t().unwrap()).unwrap() / (h.head_dim as f64).sqrt()).unwrap();
        let s = (s + mask).unwrap();
        let p = softmax_ref(&s);
        outs.push(p.matmul(&vh).unwrap());
    }
    Tensor::cat(&outs, 1).unwrap()
}

fn softmax_ref(s: &Tensor) -> Tensor {
    // The max is a constant shift (detached): softmax is unchanged by it.
    let e = s
        .broadcast_sub(&s.max_keepdim(D::Minus1).unwrap().detach())
        .unwrap()
        .exp()
        .unwrap();
    e.broadcast_div(&e.sum_keepdim(D::Minus1).unwrap()).unwrap()
}

#[test]
fn masked_gqa_attention_forward_and_backward() {
    let cpu = Cpu::with_threads(2);
    let h = Heads {
        q_heads: 4,
        kv_heads: 2,
        head_dim: 8,
    };
    let (tq, tk) = (6, 10);
    // DFlash-like spans: a context prefix and a block of its own per query.
    let spans: Vec<KeySpan> = (0..tq)
        .map(|i| KeySpan {
            a: 0..(i + 1).min(4),
            b: 4 + (i / 3) * 3..4 + (i / 3) * 3 + 3,
        })
        .collect();
    let (q, k, v) = (rand(tq * 32, 13), rand(tk * 16, 14), rand(tk * 16, 15));
    let r = rand(tq * 32, 16);
    let mut out = vec![0.0; tq * 32];
    let saved = cpu.attention(&q, &k, &v, &mut out, &spans, h);
    let mut mask = vec![-1e9f32; tq * tk];
    for (i, s) in spans.iter().enumerate() {
        for j in s.keys() {
            mask[i * tk + j] = 0.0;
        }
    }
    let (qv, kv, vv) = (var(&q, &[tq, 32]), var(&k, &[tk, 16]), var(&v, &[tk, 16]));
    let yr = attention_ref(
        qv.as_tensor(),
        kv.as_tensor(),
        vv.as_tensor(),
        &t(&mask, &[tq, tk]),
        h,
    );
    close(&out, &flat(&yr), 1e-4, "attention");
    let grads = (yr * t(&r, &[tq, 32]))
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
    cpu.attention_backward(&r, &q, &k, &v, &saved, &spans, h, &mut dq, &mut dk, &mut dv);
    close(&dq, &flat(grads.get(&qv).unwrap()), 1e-4, "dq");
    close(&dk, &flat(grads.get(&kv).unwrap()), 1e-4, "dk");
    close(&dv, &flat(grads.get(&vv).unwrap()), 1e-4, "dv");
    finite_diff(
        &k,
        &dk,
        &r,
        |k| {
            let mut o = vec![0.0; tq * 32];
            cpu.attention(&q, k, &v, &mut o, &spans, h);
            o
        },
        "attention dk",
    );
}

#[test]
fn fully_masked_rows_output_zero_and_pass_no_gradient() {
    let cpu = Cpu::new();
    let h = Heads {
        q_heads: 2,
        kv_heads: 1,
        head_dim: 4,
    };
    let spans = vec![KeySpan { a: 0..0, b: 0..0 }, KeySpan { a: 0..2, b: 0..0 }];
    let (q, k, v) = (rand(16, 17), rand(8, 18), rand(8, 19));
    let mut out = vec![1.0; 16];
    let saved = cpu.attention(&q, &k, &v, &mut out, &spans, h);
    assert!(out[..8].iter().all(|&x| x == 0.0));
    let (mut dq, mut dk, mut dv) = (vec![0.0; 16], vec![0.0; 8], vec![0.0; 8]);
    let dout: Vec<f32> = (0..16).map(|i| if i < 8 { 1.0 } else { 0.0 }).collect();
    cpu.attention_backward(
        &dout, &q, &k, &v, &saved, &spans, h, &mut dq, &mut dk, &mut dv,
    );
    assert!(dq.iter().chain(&dk).chain(&dv).all(|&x| x == 0.0));
}
