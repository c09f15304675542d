//! The target's tapped hidden states against an independent reference (the same
//! checkpoint loaded by candle and run through candle ops), for Qwen3 and Llama, and the
//! errors a bad checkpoint gives.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor, D};
use dflash_worker::models::target::Target;
use dflash_worker::models::tiny;

fn rms(x: &Tensor, w: &Tensor, eps: f64) -> Tensor {
    let ms = x.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
    x.broadcast_mul(&(ms + eps).unwrap().sqrt().unwrap().recip().unwrap())
        .unwrap()
        .broadcast_mul(w)
        .unwrap()
}

fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let hd = x.dim(D::Minus1).unwrap();
    let x1 = x.narrow(D::Minus1, 0, hd / 2).unwrap();
    let x2 = x.narrow(D::Minus1, hd / 2, hd / 2).unwrap();
    let rot = Tensor::cat(&[&x2.neg().unwrap(), &x1], D::Minus1).unwrap();
    (x.broadcast_mul(cos).unwrap() + rot.broadcast_mul(sin).unwrap()).unwrap()
}

/// Independent forward with candle: returns hidden_states[id + 1] for every layer id.
fn reference(dir: &Path, tokens: &[u32], inv_freq: &[f32]) -> Vec<Tensor> {
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let n = |k: &str| cfg[k].as_u64().unwrap() as usize;
    let (h, nh, nkv, layers) = (
        n("hidden_size"),
        n("num_attention_heads"),
        n("num_key_value_heads"),
        n("num_hidden_layers"),
    );
    let hd = cfg["head_dim"]
        .as_u64()
        .map(|x| x as usize)
        .unwrap_or(h / nh);
    let eps = cfg["rms_norm_eps"].as_f64().unwrap();
    let qwen = cfg["model_type"] == "qwen3";
    let w: HashMap<String, Tensor> =
        candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let g = |name: &str| w[name].to_dtype(DType::F32).unwrap();
    let t = tokens.len();
    let ids = Tensor::from_slice(tokens, t, &Device::Cpu).unwrap();
    let mut x = g("model.embed_tokens.weight")
        .index_select(&ids, 0)
        .unwrap();
    let mut cos = Vec::new();
    let mut sin = Vec::new();
    for p in 0..t {
        for _ in 0..2 {
            for f in inv_freq {
                cos.push((p as f32 * f).cos());
                sin.push((p as f32 * f).sin());
            }
        }
    }
    let cos = Tensor::from_slice(&cos, (t, 1, hd), &Device::Cpu).unwrap();
    let sin = Tensor::from_slice(&sin, (t, 1, hd), &Device::Cpu).unwrap();
    let mut mask = vec![0f32; t * t];
    for i in 0..t {
        for j in i + 1..t {
            mask[i * t + j] = f32::NEG_INFINITY;
        }
    }
    let mask = Tensor::from_slice(&mask, (t, t), &Device::Cpu).unwrap();
    let mut outs = Vec::new();
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        let lin =
            |x: &Tensor, name: &str| x.matmul(&g(&format!("{p}.{name}")).t().unwrap()).unwrap();
        let n1 = rms(&x, &g(&format!("{p}.input_layernorm.weight")), eps);
        let mut q = lin(&n1, "self_attn.q_proj.weight")
            .reshape((t, nh, hd))
            .unwrap();
        let mut k = lin(&n1, "self_attn.k_proj.weight")
            .reshape((t, nkv, hd))
            .unwrap();
        let v = lin(&n1, "self_attn.v_proj.weight")
            .reshape((t, nkv, hd))
            .unwrap();
        if qwen {
            q = rms(&q, &g(&format!("{p}.self_attn.q_norm.weight")), eps);
            k = rms(&k, &g(&format!("{p}.self_attn.k_norm.weight")), eps);
        }
        let (q, k) = (rope(&q, &cos, &sin), rope(&k, &cos, &sin));
        let mut heads = Vec::new();
        for head in 0..nh {
            let kvh = head / (nh / nkv);
            let qh = q.narrow(1, head, 1).unwrap().squeeze(1).unwrap();
            let kh = k.narrow(1, kvh, 1).unwrap().squeeze(1).unwrap();
            let vh = v.narrow(1, kvh, 1).unwrap().squeeze(1).unwrap();
            let s = (qh.matmul(&kh.t().unwrap()).unwrap() / (hd as f64).sqrt()).unwrap();
            let s = (s + &mask).unwrap();
            let p = candle_nn::ops::softmax_last_dim(&s).unwrap();
            heads.push(p.matmul(&vh).unwrap());
        }
        let att = Tensor::cat(&heads, 1).unwrap();
        x = (x + lin(&att, "self_attn.o_proj.weight")).unwrap();
        let n2 = rms(&x, &g(&format!("{p}.post_attention_layernorm.weight")), eps);
        let gate = lin(&n2, "mlp.gate_proj.weight");
        let act = (candle_nn::ops::silu(&gate).unwrap() * lin(&n2, "mlp.up_proj.weight")).unwrap();
        x = (x + lin(&act, "mlp.down_proj.weight")).unwrap();
        outs.push(x.clone());
    }
    outs
}

fn check_against_reference(dir: &Path, taps: &[usize]) {
    let target = Target::load(dir, taps).unwrap();
    let tokens: Vec<u32> = (0..17).map(|i| (i * 37 + 5) % 500).collect();
    let ours = target.forward_taps(&tokens);
    let inv = dflash_worker::math::rope_inv_freq(
        target.cfg.head_dim,
        target.cfg.rope_theta,
        target.cfg.rope_scaling.as_ref(),
    );
    let refs = reference(dir, &tokens, &inv);
    let h = target.cfg.hidden_size;
    let width = taps.len() * h;
    for (ti, &tap) in taps.iter().enumerate() {
        let r: Vec<f32> = refs[tap].flatten_all().unwrap().to_vec1().unwrap();
        let scale = r.iter().fold(1e-3f32, |m, x| m.max(x.abs()));
        for row in 0..tokens.len() {
            for c in 0..h {
                let (a, b) = (ours[row * width + ti * h + c], r[row * h + c]);
                assert!(
                    (a - b).abs() <= 2e-4 * scale,
                    "tap {tap} token {row} channel {c}: ours {a} vs candle {b}"
                );
            }
        }
    }
}

#[test]
fn qwen3_tiny_target_taps_match_candle() {
    let tmp = tempfile::tempdir().unwrap();
    tiny::write(tmp.path()).unwrap();
    check_against_reference(tmp.path(), &[1, 3]);
    check_against_reference(tmp.path(), &[0, 5]);
}

const LLAMA: &str = r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":48,"num_hidden_layers":3,
  "num_attention_heads":6,"num_key_value_heads":2,"intermediate_size":96,"rms_norm_eps":1e-5,"rope_theta":500000.0,
  "rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":64},
  "vocab_size":500,"tie_word_embeddings":false}"#;

#[test]
fn llama_target_with_rope_scaling_and_untied_head_matches_candle() {
    let tmp = tempfile::tempdir().unwrap();
    tiny::write_random(tmp.path(), LLAMA, 3).unwrap();
    check_against_reference(tmp.path(), &[0, 2]);
}

#[test]
fn the_target_is_deterministic_and_taps_are_prefixes_of_the_residual_stream() {
    let tmp = tempfile::tempdir().unwrap();
    tiny::write(tmp.path()).unwrap();
    let a = Target::load(tmp.path(), &[1, 3])
        .unwrap()
        .forward_taps(&[1, 2, 3, 4]);
    let b = Target::load(tmp.path(), &[1, 3])
        .unwrap()
        .forward_taps(&[1, 2, 3, 4]);
    assert_eq!(a, b);
    // Causal: the states of a prefix do not depend on what follows (up to the GEMM's
    // summation order, which may change with the number of rows).
    let c = Target::load(tmp.path(), &[1, 3])
        .unwrap()
        .forward_taps(&[1, 2, 3, 4, 9, 9]);
    let scale = a.iter().fold(0f32, |m, v| m.max(v.abs()));
    let worst = c[..a.len()]
        .iter()
        .zip(&a)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(
        worst <= 1e-5 * scale,
        "prefix states changed by {worst} (scale {scale})"
    );
}

fn rewrite_without(dir: &Path, drop: &str, reshape: Option<(&str, Vec<usize>)>) {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut keep: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in st.tensors() {
        if name == drop {
            continue;
        }
        let mut shape = view.shape().to_vec();
        let mut data = view.data().to_vec();
        if let Some((n, s)) = &reshape {
            if *n == name {
                shape = s.clone();
                data.truncate(s.iter().product::<usize>() * 2);
            }
        }
        keep.push((name, view.dtype(), shape, data));
    }
    let views: HashMap<String, safetensors::tensor::TensorView> = keep
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

#[test]
fn bad_checkpoints_name_the_file_and_the_problem() {
    let err = |dir: &Path| {
        Target::load(dir, &[1])
            .err()
            .expect("load must fail")
            .to_string()
    };
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();

    tiny::write(d).unwrap();
    rewrite_without(d, "model.layers.4.mlp.up_proj.weight", None);
    assert!(
        err(d).contains("missing tensor model.layers.4.mlp.up_proj.weight"),
        "{}",
        err(d)
    );

    tiny::write(d).unwrap();
    rewrite_without(
        d,
        "",
        Some(("model.layers.0.mlp.up_proj.weight", vec![64, 64])),
    );
    let e = err(d);
    assert!(
        e.contains("model.layers.0.mlp.up_proj.weight has shape [64, 64], expected [128, 64]")
            && e.contains("model.safetensors"),
        "{e}"
    );

    tiny::write(d).unwrap();
    let len = std::fs::metadata(d.join("model.safetensors"))
        .unwrap()
        .len();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(d.join("model.safetensors"))
        .unwrap();
    f.set_len(len / 2).unwrap();
    assert!(
        err(d).contains("truncated or corrupt safetensors"),
        "{}",
        err(d)
    );

    tiny::write(d).unwrap();
    std::fs::write(
        d.join("config.json"),
        r#"{"architectures":["MistralForCausalLM"]}"#,
    )
    .unwrap();
    let e = err(d);
    assert!(
        e.contains("config.json") && e.contains("unsupported architecture"),
        "{e}"
    );
    std::fs::write(d.join("config.json"), "{not json").unwrap();
    assert!(err(d).contains("not valid JSON"));

    tiny::write(d).unwrap();
    assert!(Target::load(d, &[6])
        .err()
        .unwrap()
        .to_string()
        .contains("tap 6 does not exist"));

    let empty = tempfile::tempdir().unwrap();
    std::fs::write(empty.path().join("config.json"), tiny::CONFIG).unwrap();
    assert!(err(empty.path()).contains("no model.safetensors"));
}

#[test]
fn inspect_writes_the_tapped_hidden_states_of_a_sequence() {
    let tmp = tempfile::tempdir().unwrap();
    tiny::write(&tmp.path().join("m")).unwrap();
    let out = tmp.path().join("hidden.safetensors");
    let run = std::process::Command::new(env!("CARGO_BIN_EXE_dflash-worker"))
        .args(["inspect", "--target"])
        .arg(tmp.path().join("m"))
        .args(["--tokens", "5,6,7,8", "--taps", "0,4", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let bytes = std::fs::read(&out).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let h = st.tensor("hidden").unwrap();
    assert_eq!(h.shape(), &[4, 2 * 64]);
    let got: Vec<f32> = h
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let want = Target::load(&tmp.path().join("m"), &[0, 4])
        .unwrap()
        .forward_taps(&[5, 6, 7, 8]);
    // Written by the model a CPU target worker runs (the device target on the CPU device):
    // the reference's values up to f32 rounding of a different summation order.
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let worst = got
        .iter()
        .zip(&want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        worst <= 1e-5 * scale,
        "{worst} off the reference (scale {scale})"
    );
    // A token id outside the vocabulary is a clear error, exit 2.
    let bad = std::process::Command::new(env!("CARGO_BIN_EXE_dflash-worker"))
        .args([
            "inspect", "--target", "tiny", "--tokens", "1,99999", "--out",
        ])
        .arg(&out)
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("id 99999 is not below the vocab size 512")
    );
}

/// transformers 5 saves the rotary settings under `rope_parameters`; the taps of such a
/// checkpoint equal those of the transformers-4 layout of the same weights, and differ
/// from what the old fallback (theta 10000, no scaling) computed.
#[test]
fn a_transformers_5_config_taps_the_same_states_as_its_transformers_4_layout() {
    let v4 = tempfile::tempdir().unwrap();
    tiny::write_random(v4.path(), LLAMA, 3).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(LLAMA).unwrap();
    let mut rp = cfg["rope_scaling"].clone();
    rp["rope_theta"] = cfg["rope_theta"].clone();
    let o = cfg.as_object_mut().unwrap();
    o.remove("rope_theta");
    o.remove("rope_scaling");
    o.insert("rope_parameters".into(), rp);
    let v5 = tempfile::tempdir().unwrap();
    std::fs::copy(
        v4.path().join("model.safetensors"),
        v5.path().join("model.safetensors"),
    )
    .unwrap();
    std::fs::write(v5.path().join("config.json"), cfg.to_string()).unwrap();
    let tokens: Vec<u32> = (0..24).map(|i| (i * 13 + 1) % 500).collect();
    let a = Target::load(v4.path(), &[0, 2])
        .unwrap()
        .forward_taps(&tokens);
    let b = Target::load(v5.path(), &[0, 2])
        .unwrap()
        .forward_taps(&tokens);
    assert_eq!(a, b);
    // The fallback the old reader used: different states after the first position.
    let o = cfg.as_object_mut().unwrap();
    o.remove("rope_parameters");
    std::fs::write(v5.path().join("config.json"), cfg.to_string()).unwrap();
    let c = Target::load(v5.path(), &[0, 2])
        .unwrap()
        .forward_taps(&tokens);
    let width = 2 * 48;
    assert_eq!(&c[..width], &a[..width], "position 0 has no rotation");
    let diff = c
        .iter()
        .zip(&a)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(
        diff > 1e-3,
        "theta 10000 vs 500000 with llama3 scaling must differ ({diff})"
    );
}

/// Every tensor of the checkpoint widened to f32 (exact), written back in place.
fn rewrite_as_f32(dir: &Path) {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let wide: Vec<(String, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(name, v)| {
            assert_eq!(v.dtype(), safetensors::Dtype::BF16);
            let data = v
                .data()
                .chunks_exact(2)
                .flat_map(|b| {
                    half::bf16::from_le_bytes([b[0], b[1]])
                        .to_f32()
                        .to_le_bytes()
                })
                .collect();
            (name, v.shape().to_vec(), data)
        })
        .collect();
    let views: HashMap<String, safetensors::tensor::TensorView> = wide
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                    .unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

/// A device target reads the projections and the embedding as bf16 straight from the
/// checkpoint's mapping through a pinned staging buffer (an 8B model would otherwise be
/// 32 GB of f32 on the host, then narrowed again): the host keeps only the norms, and the
/// taps are bit for bit those of the target placed from the f32 copy, for a bf16 and an f32
/// checkpoint. On the host device, whose ordering checks cover the staging buffer's reuse.
#[test]
fn a_device_target_reads_its_weights_from_the_checkpoint_mapping_without_an_f32_copy() {
    use dflash_worker::device::host::HostDevice;
    use dflash_worker::models::target::device::DeviceTarget;
    use dflash_worker::models::target::Load;
    for f32_checkpoint in [false, true] {
        let tmp = tempfile::tempdir().unwrap();
        tiny::write_random(tmp.path(), LLAMA, 9).unwrap();
        if f32_checkpoint {
            rewrite_as_f32(tmp.path());
        }
        let full = Target::load_as(tmp.path(), &[0, 2], Load::F32).unwrap();
        let mapped = Target::load_as(tmp.path(), &[0, 2], Load::Mapped).unwrap();
        assert!(
            mapped.host_weight_bytes() * 50 < full.host_weight_bytes(),
            "the mapped target keeps the norms only: {} of {} bytes",
            mapped.host_weight_bytes(),
            full.host_weight_bytes()
        );
        let tokens: Vec<u32> = (0..24u32).map(|i| (i * 31 + 7) % 500).collect();
        let mut a = DeviceTarget::new(Box::new(HostDevice::new()), &full, 24).unwrap();
        let mut b = DeviceTarget::new(Box::new(HostDevice::new()), &mapped, 24).unwrap();
        let (ta, tb) = (
            a.forward_taps(&tokens).unwrap(),
            b.forward_taps(&tokens).unwrap(),
        );
        assert!(ta.iter().all(|x| x.is_finite()));
        assert!(
            ta.iter().zip(&tb).all(|(x, y)| x.to_bits() == y.to_bits()),
            "f32 checkpoint {f32_checkpoint}: the same weights on the device"
        );
    }
}

/// A target split over several devices (`--gpus-per-target`): its layers in contiguous
/// ranges, the residual stream and the taps so far handed from device to device. Its taps
/// are bit for bit those of the same target on one device, on the CPU device (f32) and on
/// host devices (bf16 activations, weights read from the checkpoint's mapping, ordering
/// checked), for single and packed rows.
#[test]
fn a_target_split_over_devices_taps_what_it_taps_on_one() {
    use dflash_worker::device::cpu::CpuDevice;
    use dflash_worker::device::host::HostDevice;
    use dflash_worker::device::Device;
    use dflash_worker::models::target::device::DeviceTarget;
    use dflash_worker::models::target::Load;
    let tmp = tempfile::tempdir().unwrap();
    tiny::write(tmp.path()).unwrap();
    let taps = [0, 2, 4];
    let rows: Vec<Vec<u32>> = (0..3u32)
        .map(|r| {
            (0..7 + 5 * r)
                .map(|i| (i * 37 + r * 11 + 3) % 500)
                .collect()
        })
        .collect();
    let rows: Vec<&[u32]> = rows.iter().map(Vec::as_slice).collect();
    for host in [false, true] {
        let dev = |_: usize| -> Box<dyn Device> {
            if host {
                Box::new(HostDevice::new())
            } else {
                Box::new(CpuDevice::new())
            }
        };
        let how = if host { Load::Mapped } else { Load::F32 };
        let load = || Target::load_as(tmp.path(), &taps, how).unwrap();
        let mut one = DeviceTarget::new(dev(0), &load(), 32).unwrap();
        let want = one.forward_rows(&rows).unwrap();
        assert!(want.iter().flatten().all(|x| x.is_finite()));
        for n in [2, 3, 6] {
            let mut split = DeviceTarget::new_split((0..n).map(dev).collect(), load(), 32).unwrap();
            let ranges = split.layer_ranges();
            // Layers 0..=4 (the last tap) over min(n, 5) devices, contiguous, in order.
            assert_eq!(ranges.len(), n.min(5), "{ranges:?}");
            assert_eq!((ranges[0].start, ranges[ranges.len() - 1].end), (0, 5));
            assert!(ranges
                .windows(2)
                .all(|w| w[0].end == w[1].start && !w[1].is_empty()));
            // The worker's path: bf16 taps copied from the last device into host memory.
            let width = taps.len() * 64;
            let total: usize = rows.iter().map(|r| r.len()).sum::<usize>() * width * 2;
            let mut pool = vec![0u8; total];
            let mut at = 0;
            let dsts: Vec<(&[u32], *mut u8)> = rows
                .iter()
                .map(|r| {
                    // SAFETY: within `pool`.
                    let p = unsafe { pool.as_mut_ptr().add(at) };
                    at += r.len() * width * 2;
                    (*r, p)
                })
                .collect();
            // SAFETY: `split` is dropped before `pool` (below), and `pool` is read only
            // after `finish`.
            unsafe {
                split.register_host(pool.as_mut_ptr(), total).unwrap();
                let e = split.forward_rows_into(&dsts).unwrap().unwrap();
                split.finish(e, pool.as_ptr(), total).unwrap();
            }
            let bf16: Vec<u8> = want
                .iter()
                .flatten()
                .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
                .collect();
            assert!(
                pool == bf16,
                "host {host}, {n} devices: the pool's taps differ"
            );
            let got = split.forward_rows(&rows).unwrap();
            assert_eq!(got.len(), want.len());
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    g.len() == w.len() && g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "host {host}, {n} devices: taps differ"
                );
            }
            drop(split);
        }
    }
}
