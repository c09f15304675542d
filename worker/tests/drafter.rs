//! The whole drafter — loss and the gradient of every parameter — against an independent
//! candle implementation with autograd on a tiny config; the block mask; training on a
//! fixed batch makes the loss fall.

use candle_core::{Device, Tensor, Var, D};
use dflash_shared::drafter::DrafterConfig;
use dflash_shared::rng::Rng;
use dflash_worker::math::rope_inv_freq;
use dflash_worker::models::drafter::{grad_norm, lr_at, AdamW, Drafter, Frozen, Sample};

fn cfg() -> DrafterConfig {
    DrafterConfig {
        hidden: 16,
        layers: 2,
        q_heads: 4,
        kv_heads: 2,
        head_dim: 8,
        intermediate: 24,
        vocab: 40,
        eps: 1e-6,
        rope_theta: 10000.0,
        rope_scaling: None,
        n_taps: 2,
        block_size: 4,
        max_anchors: 3,
        mask_token_id: 39,
        gamma: 2.0,
    }
}

fn rand(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..n)
        .map(|_| ((r.next_u64() % 20001) as f32 / 10000.0 - 1.0) * scale)
        .collect()
}

struct Fixture {
    d: Drafter,
    p: Vec<f32>,
    frozen: Frozen,
    taps: Vec<Vec<f32>>,
    ids: Vec<Vec<u32>>,
    masks: Vec<Vec<u8>>,
    anchors: Vec<Vec<usize>>,
}

fn fixture() -> Fixture {
    let c = cfg();
    let d = Drafter::new(c.clone());
    let mut p = d.init_params(5);
    // Perturb the norms so their gradients are not trivially symmetric.
    for (i, x) in p.iter_mut().enumerate() {
        *x += ((i * 7919) % 13) as f32 * 0.003;
    }
    let frozen = Frozen {
        embed: rand(c.vocab * c.hidden, 6, 1.0),
        lm_head: rand(c.vocab * c.hidden, 7, 0.5),
    };
    let lens = [9usize, 6];
    let taps = lens
        .iter()
        .enumerate()
        .map(|(i, &l)| rand(l * c.n_taps * c.hidden, 10 + i as u64, 1.0))
        .collect();
    let ids: Vec<Vec<u32>> = lens
        .iter()
        .enumerate()
        .map(|(i, &l)| (0..l).map(|t| ((t * 7 + i * 3) % 38) as u32).collect())
        .collect();
    let masks = vec![vec![0, 1, 1, 1, 1, 0, 1, 1, 1], vec![1, 1, 1, 0, 1, 1]];
    let mut rng = Rng::new(9);
    let anchors = masks
        .iter()
        .map(|m| d.sample_anchors(m, &mut rng))
        .collect();
    Fixture {
        d,
        p,
        frozen,
        taps,
        ids,
        masks,
        anchors,
    }
}

impl Fixture {
    fn samples(&self) -> Vec<Sample<'_>> {
        (0..self.ids.len())
            .map(|i| Sample {
                taps: &self.taps[i],
                ids: &self.ids[i],
                mask: &self.masks[i],
            })
            .collect()
    }
}

fn rms(x: &Tensor, w: &Tensor, eps: f64) -> Tensor {
    let ms = x.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
    x.broadcast_mul(&(ms + eps).unwrap().sqrt().unwrap().recip().unwrap())
        .unwrap()
        .broadcast_mul(w)
        .unwrap()
}

fn rope(x: &Tensor, pos: &[usize], inv: &[f32]) -> Tensor {
    let hd = x.dim(D::Minus1).unwrap();
    let (mut cos, mut sin) = (Vec::new(), Vec::new());
    for &p in pos {
        for _ in 0..2 {
            for f in inv {
                cos.push((p as f32 * f).cos());
                sin.push((p as f32 * f).sin());
            }
        }
    }
    let cos = Tensor::from_slice(&cos, (pos.len(), 1, hd), &Device::Cpu).unwrap();
    let sin = Tensor::from_slice(&sin, (pos.len(), 1, hd), &Device::Cpu).unwrap();
    let x1 = x.narrow(D::Minus1, 0, hd / 2).unwrap();
    let x2 = x.narrow(D::Minus1, hd / 2, hd / 2).unwrap();
    let rot = Tensor::cat(&[&x2.neg().unwrap(), &x1], D::Minus1).unwrap();
    (x.broadcast_mul(&cos).unwrap() + rot.broadcast_mul(&sin).unwrap()).unwrap()
}

/// The drafter loss written with candle ops, from DFLASH.md.
fn candle_loss(f: &Fixture, vars: &std::collections::HashMap<String, Var>) -> Tensor {
    let c = &f.d.cfg;
    let (h, hd, bs) = (c.hidden, c.head_dim, c.block_size);
    let g = |n: &str| vars[n].as_tensor().clone();
    let dev = &Device::Cpu;
    let embed = Tensor::from_slice(&f.frozen.embed, (c.vocab, h), dev).unwrap();
    let lm = Tensor::from_slice(&f.frozen.lm_head, (c.vocab, h), dev).unwrap();
    let inv = rope_inv_freq(hd, c.rope_theta, None);
    let total_w: f64 = f
        .anchors
        .iter()
        .zip(&f.masks)
        .map(|(an, m)| {
            an.iter()
                .map(|&a| (1..bs).map(|k| f.d.slot_weight(a, k, m)).sum::<f64>())
                .sum::<f64>()
        })
        .sum();
    let mut loss = Tensor::zeros((), candle_core::DType::F32, dev).unwrap();
    for i in 0..f.ids.len() {
        let (ids, mask, an) = (&f.ids[i], &f.masks[i], &f.anchors[i]);
        let s = ids.len();
        let taps = Tensor::from_slice(&f.taps[i], (s, c.n_taps * h), dev).unwrap();
        let ctx = rms(
            &taps.matmul(&g("fc.weight").t().unwrap()).unwrap(),
            &g("hidden_norm.weight"),
            c.eps,
        );
        let block_tokens: Vec<u32> = an
            .iter()
            .flat_map(|&a| (0..bs).map(move |k| if k == 0 { a } else { usize::MAX }))
            .map(|a| {
                if a == usize::MAX {
                    c.mask_token_id
                } else {
                    ids[a]
                }
            })
            .collect();
        let m = block_tokens.len();
        let mut hcur = embed
            .index_select(&Tensor::from_slice(&block_tokens, m, dev).unwrap(), 0)
            .unwrap();
        let block_pos: Vec<usize> = an
            .iter()
            .flat_map(|&a| (0..bs).map(move |k| a + k))
            .collect();
        let key_pos: Vec<usize> = (0..s).chain(block_pos.iter().copied()).collect();
        let tk = s + m;
        let mut maskv = vec![-1e9f32; m * tk];
        for q in 0..m {
            let n = q / bs;
            for j in 0..an[n] {
                maskv[q * tk + j] = 0.0;
            }
            for j in s + n * bs..s + (n + 1) * bs {
                maskv[q * tk + j] = 0.0;
            }
        }
        let amask = Tensor::from_slice(&maskv, (m, tk), dev).unwrap();
        for l in 0..c.layers {
            let p = |n: &str| g(&format!("layers.{l}.{n}"));
            let lin = |x: &Tensor, n: &str| x.matmul(&p(n).t().unwrap()).unwrap();
            let x = rms(&hcur, &p("input_layernorm.weight"), c.eps);
            let q = rms(
                &lin(&x, "self_attn.q_proj.weight")
                    .reshape((m, c.q_heads, hd))
                    .unwrap(),
                &p("self_attn.q_norm.weight"),
                c.eps,
            );
            let q = rope(&q, &block_pos, &inv);
            let k = Tensor::cat(
                &[
                    &lin(&ctx, "self_attn.k_proj.weight"),
                    &lin(&x, "self_attn.k_proj.weight"),
                ],
                0,
            )
            .unwrap();
            let k = rope(
                &rms(
                    &k.reshape((tk, c.kv_heads, hd)).unwrap(),
                    &p("self_attn.k_norm.weight"),
                    c.eps,
                ),
                &key_pos,
                &inv,
            );
            let v = Tensor::cat(
                &[
                    &lin(&ctx, "self_attn.v_proj.weight"),
                    &lin(&x, "self_attn.v_proj.weight"),
                ],
                0,
            )
            .unwrap()
            .reshape((tk, c.kv_heads, hd))
            .unwrap();
            let mut outs = Vec::new();
            for head in 0..c.q_heads {
                let kvh = head / (c.q_heads / c.kv_heads);
                let qh = q.narrow(1, head, 1).unwrap().squeeze(1).unwrap();
                let kh = k.narrow(1, kvh, 1).unwrap().squeeze(1).unwrap();
                let vh = v.narrow(1, kvh, 1).unwrap().squeeze(1).unwrap();
                let sc = ((qh.matmul(&kh.t().unwrap()).unwrap() / (hd as f64).sqrt()).unwrap()
                    + &amask)
                    .unwrap();
                let e = sc
                    .broadcast_sub(&sc.max_keepdim(D::Minus1).unwrap().detach())
                    .unwrap()
                    .exp()
                    .unwrap();
                let pr = e.broadcast_div(&e.sum_keepdim(D::Minus1).unwrap()).unwrap();
                outs.push(pr.matmul(&vh).unwrap());
            }
            let att = Tensor::cat(&outs, 1).unwrap();
            hcur = (hcur + lin(&att, "self_attn.o_proj.weight")).unwrap();
            let x2 = rms(&hcur, &p("post_attention_layernorm.weight"), c.eps);
            let gt = lin(&x2, "mlp.gate_proj.weight");
            let silu = (&gt / (gt.neg().unwrap().exp().unwrap() + 1.0).unwrap()).unwrap();
            let act = (silu * lin(&x2, "mlp.up_proj.weight")).unwrap();
            hcur = (hcur + lin(&act, "mlp.down_proj.weight")).unwrap();
        }
        let hn = rms(&hcur, &g("norm.weight"), c.eps);
        let logits = hn.matmul(&lm.t().unwrap()).unwrap();
        let lse = {
            let mx = logits.max_keepdim(D::Minus1).unwrap().detach();
            (logits
                .broadcast_sub(&mx)
                .unwrap()
                .exp()
                .unwrap()
                .sum_keepdim(D::Minus1)
                .unwrap()
                .log()
                .unwrap()
                + mx)
                .unwrap()
        };
        for (n, &a) in an.iter().enumerate() {
            for k in 1..bs {
                let w = f.d.slot_weight(a, k, mask);
                if w == 0.0 {
                    continue;
                }
                let row = n * bs + k;
                let label = ids[a + k] as usize;
                let ce = (lse.get(row).unwrap().squeeze(0).unwrap()
                    - logits.get(row).unwrap().get(label).unwrap())
                .unwrap();
                loss = (loss + (ce * (w / total_w)).unwrap()).unwrap();
            }
        }
    }
    loss
}

#[test]
fn loss_and_every_parameter_gradient_match_candle_autograd() {
    let f = fixture();
    assert!(f.anchors.iter().all(|a| !a.is_empty()), "{:?}", f.anchors);
    let mut grads = vec![0f32; f.p.len()];
    let stats = f.d.train_batch(
        &f.p,
        &f.frozen,
        &f.samples(),
        &f.anchors,
        f.d.total_weight(&f.samples(), &f.anchors),
        &mut grads,
    );
    let vars: std::collections::HashMap<String, Var> = f
        .d
        .layout
        .entries
        .iter()
        .map(|(n, s, off)| {
            let len: usize = s.iter().product();
            (
                n.clone(),
                Var::from_tensor(
                    &Tensor::from_slice(&f.p[*off..off + len], s.as_slice(), &Device::Cpu).unwrap(),
                )
                .unwrap(),
            )
        })
        .collect();
    let loss = candle_loss(&f, &vars);
    let ref_loss = loss.to_scalar::<f32>().unwrap() as f64;
    assert!(
        (stats.loss() - ref_loss).abs() < 1e-4 * ref_loss.abs().max(1.0),
        "loss {} vs candle {ref_loss}",
        stats.loss()
    );
    let g = loss.backward().unwrap();
    for (name, shape, off) in &f.d.layout.entries {
        let len: usize = shape.iter().product();
        let want: Vec<f32> = g
            .get(vars[name].as_tensor())
            .unwrap_or_else(|| panic!("no candle grad for {name}"))
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let got = &grads[*off..off + len];
        let scale = want.iter().fold(1e-4f32, |m, x| m.max(x.abs()));
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!(
                (a - b).abs() <= 2e-3 * scale,
                "{name}[{i}]: ours {a} vs candle {b} (scale {scale})"
            );
        }
    }
}

#[test]
fn gradients_match_finite_differences() {
    let f = fixture();
    let mut grads = vec![0f32; f.p.len()];
    f.d.train_batch(
        &f.p,
        &f.frozen,
        &f.samples(),
        &f.anchors,
        f.d.total_weight(&f.samples(), &f.anchors),
        &mut grads,
    );
    let mut p = f.p.clone();
    let eps = 2e-3f32;
    for name in [
        "fc.weight",
        "layers.0.self_attn.k_proj.weight",
        "layers.1.mlp.up_proj.weight",
        "layers.1.self_attn.q_norm.weight",
        "norm.weight",
    ] {
        let r = f.d.layout.range(name);
        for i in (r.start..r.end).step_by(((r.end - r.start) / 5).max(1)) {
            let orig = p[i];
            p[i] = orig + eps;
            let up = f.d.loss(&p, &f.frozen, &f.samples(), &f.anchors);
            p[i] = orig - eps;
            let down = f.d.loss(&p, &f.frozen, &f.samples(), &f.anchors);
            p[i] = orig;
            let num = ((up - down) / (2.0 * eps as f64)) as f32;
            assert!(
                (num - grads[i]).abs() <= 3e-2 * (1e-2 + num.abs().max(grads[i].abs())),
                "{name}[{}]: analytic {} vs numeric {num}",
                i - r.start,
                grads[i]
            );
        }
    }
}

#[test]
fn anchors_are_valid_sorted_distinct_and_capped() {
    let f = fixture();
    let mask = [0u8, 1, 1, 1, 0, 1, 1, 1, 1, 1];
    let mut rng = Rng::new(1);
    for _ in 0..50 {
        let a = f.d.sample_anchors(&mask, &mut rng);
        assert_eq!(a.len(), 3);
        assert!(a.windows(2).all(|w| w[0] < w[1]));
        assert!(a.iter().all(|&x| mask[x] == 1 && mask[x + 1] == 1));
    }
    assert!(f.d.sample_anchors(&[1, 0, 1, 0], &mut rng).is_empty());
}

#[test]
fn the_anchor_itself_and_other_blocks_are_never_visible() {
    // A change to the context AT or after an anchor, or to another block's input, must
    // not change that block's loss; a change before it must.
    let c = cfg();
    let mut c1 = c.clone();
    c1.max_anchors = 1;
    let d = Drafter::new(c1);
    let p = d.init_params(3);
    let frozen = Frozen {
        embed: rand(c.vocab * c.hidden, 6, 1.0),
        lm_head: rand(c.vocab * c.hidden, 7, 0.5),
    };
    let s = 10;
    let ids: Vec<u32> = (0..s as u32).collect();
    let mask = vec![1u8; s];
    let taps = rand(s * c.n_taps * c.hidden, 4, 1.0);
    let anchor = vec![vec![5usize]];
    let loss_with = |taps: &[f32]| {
        d.loss(
            &p,
            &frozen,
            &[Sample {
                taps,
                ids: &ids,
                mask: &mask,
            }],
            &anchor,
        )
    };
    let base = loss_with(&taps);
    let width = c.n_taps * c.hidden;
    for (pos, visible) in [
        (4usize, true),
        (5, false),
        (6, false),
        (9, false),
        (0, true),
    ] {
        let mut t = taps.clone();
        for x in &mut t[pos * width..(pos + 1) * width] {
            *x += 1.0;
        }
        let changed = (loss_with(&t) - base).abs() > 1e-7;
        assert_eq!(
            changed, visible,
            "context position {pos} relative to anchor 5"
        );
    }
    // Blocks never see each other: block 1's loss terms are unchanged when the input
    // token of another block (at anchor 6) changes.
    let d2 = Drafter::new(c.clone());
    let mut ids2 = ids.clone();
    ids2[6] = 30;
    let pp = d2.init_params(3);
    let first_block_loss = |ids: &[u32]| {
        d2.loss(
            &pp,
            &frozen,
            &[Sample {
                taps: &taps,
                ids,
                mask: &mask,
            }],
            &[vec![1usize]],
        )
    };
    let both = |ids: &[u32]| {
        let mut g = vec![0f32; d2.layout.total];
        let batch = [Sample {
            taps: &taps,
            ids,
            mask: &mask,
        }];
        let st = d2.train_batch(
            &pp,
            &frozen,
            &batch,
            &[vec![1usize, 6]],
            d2.total_weight(&batch, &[vec![1usize, 6]]),
            &mut g,
        );
        (st.slot_correct, st.loss_sum)
    };
    assert_ne!(both(&ids).1, both(&ids2).1, "block 2's own terms do change");
    // Labels of block 1 are ids[2..5]; they and its inputs are unchanged.
    assert_eq!(first_block_loss(&ids), first_block_loss(&ids2));
}

#[test]
fn training_on_a_fixed_batch_drives_the_loss_down() {
    let f = fixture();
    let mut p = f.p.clone();
    let mut opt = AdamW::new(p.len());
    let first = f.d.loss(&p, &f.frozen, &f.samples(), &f.anchors);
    for step in 0..60 {
        let mut g = vec![0f32; p.len()];
        f.d.train_batch(
            &p,
            &f.frozen,
            &f.samples(),
            &f.anchors,
            f.d.total_weight(&f.samples(), &f.anchors),
            &mut g,
        );
        let norm = grad_norm(&g).expect("finite gradient");
        if norm > 1.0 {
            g.iter_mut().for_each(|x| *x /= norm as f32);
        }
        opt.update(&mut p, &g, lr_at(step, 1e-2, 3, Some(60)) as f32);
    }
    let last = f.d.loss(&p, &f.frozen, &f.samples(), &f.anchors);
    assert!(last < first * 0.5, "loss {first} -> {last}");
    assert!(lr_at(0, 1.0, 4, Some(100)) < lr_at(3, 1.0, 4, Some(100)));
    assert!(lr_at(99, 1.0, 4, Some(100)) < 0.01);
}

/// Data-parallel ranks with very different numbers of supervised tokens: each rank's
/// unnormalised gradient, summed and divided once by the ranks' total loss weight (what
/// the group's step does), is the gradient one process gets from the union of the
/// batches. The per-rank normalisation it replaces (each rank divides by its own weight,
/// then the ranks are averaged) is not, by a wide margin.
#[test]
fn ranks_with_very_different_supervised_counts_step_like_one_process_on_the_union() {
    use dflash_worker::models::drafter::reduce_slots;
    let f = fixture();
    let c = f.d.cfg.clone();
    // Rank A: three long rows, nearly all supervised. Rank B: one row with a single
    // supervised position.
    let lens_a = [30usize, 28, 25];
    let taps_a: Vec<Vec<f32>> = lens_a
        .iter()
        .enumerate()
        .map(|(i, &l)| rand(l * c.n_taps * c.hidden, 40 + i as u64, 1.0))
        .collect();
    let ids_a: Vec<Vec<u32>> = lens_a
        .iter()
        .enumerate()
        .map(|(i, &l)| (0..l).map(|t| ((t * 11 + i * 5) % 38) as u32).collect())
        .collect();
    let masks_a: Vec<Vec<u8>> = lens_a
        .iter()
        .map(|&l| (0..l).map(|t| (t > 0) as u8).collect())
        .collect();
    let taps_b = vec![rand(12 * c.n_taps * c.hidden, 50, 1.0)];
    let ids_b = vec![(0..12)
        .map(|t| ((t * 13 + 1) % 38) as u32)
        .collect::<Vec<u32>>()];
    let masks_b = vec![(0..12).map(|t| (t == 6) as u8).collect::<Vec<u8>>()];
    let samples = |taps: &[Vec<f32>],
                   ids: &[Vec<u32>],
                   masks: &[Vec<u8>]|
     -> Vec<(Vec<f32>, Vec<u32>, Vec<u8>)> {
        (0..taps.len())
            .map(|i| (taps[i].clone(), ids[i].clone(), masks[i].clone()))
            .collect()
    };
    let (a, b) = (
        samples(&taps_a, &ids_a, &masks_a),
        samples(&taps_b, &ids_b, &masks_b),
    );
    let mut rng = Rng::new(77);
    let anchors_a: Vec<Vec<usize>> = masks_a
        .iter()
        .map(|m| f.d.sample_anchors(m, &mut rng))
        .collect();
    let anchors_b: Vec<Vec<usize>> = vec![vec![5]];
    let n = f.p.len();
    let (mut ga, mut gb) = (vec![0f32; n], vec![0f32; n]);
    let sa =
        f.d.train_batch(&f.p, &f.frozen, &as_samples(&a), &anchors_a, 1.0, &mut ga);
    let sb =
        f.d.train_batch(&f.p, &f.frozen, &as_samples(&b), &anchors_b, 1.0, &mut gb);
    assert!(
        sa.weight_sum > 10.0 * sb.weight_sum && sb.weight_sum > 0.0,
        "rank weights {} and {}",
        sa.weight_sum,
        sb.weight_sum
    );

    // The group's step: the slots summed, divided once by Σ weights.
    let mut step: Vec<f32> = ga.iter().zip(&gb).map(|(x, y)| x + y).collect();
    reduce_slots(&mut step, sa.weight_sum + sb.weight_sum);
    // One process on the union.
    let union: Vec<_> = a.iter().chain(&b).cloned().collect();
    let anchors_u: Vec<Vec<usize>> = anchors_a.iter().chain(&anchors_b).cloned().collect();
    let mut gu = vec![0f32; n];
    let su = f.d.train_batch(
        &f.p,
        &f.frozen,
        &as_samples(&union),
        &anchors_u,
        f.d.total_weight(&as_samples(&union), &anchors_u),
        &mut gu,
    );
    let scale = gu.iter().fold(0f32, |m, x| m.max(x.abs()));
    let err = step
        .iter()
        .zip(&gu)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
        / scale;
    eprintln!("group step vs union: max relative error {err:.2e}");
    assert!(err < 1e-5, "group step vs one process on the union: {err}");
    let loss_group = (sa.loss_sum + sb.loss_sum) / (sa.weight_sum + sb.weight_sum);
    assert!((loss_group - su.loss_sum / su.weight_sum).abs() < 1e-9 * loss_group.abs());
    // The old per-rank normalisation weighs rank B's one token as much as all of A's.
    let old: Vec<f32> = ga
        .iter()
        .zip(&gb)
        .map(|(x, y)| 0.5 * (x / sa.weight_sum as f32 + y / sb.weight_sum as f32))
        .collect();
    let old_err = old
        .iter()
        .zip(&gu)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
        / scale;
    eprintln!("per-rank normalisation vs union: {old_err:.2e}");
    assert!(
        old_err > 0.1,
        "the test tells the two normalisations apart: {old_err}"
    );
}

fn as_samples(v: &[(Vec<f32>, Vec<u32>, Vec<u8>)]) -> Vec<Sample<'_>> {
    v.iter()
        .map(|(t, i, m)| Sample {
            taps: t,
            ids: i,
            mask: m,
        })
        .collect()
}
