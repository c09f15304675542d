//! `--gpus-per-target N` on the torch engine: the child's placement of a target's loaded
//! layers over N devices (`split_layers`, `device_map` in worker/python/
//! dflash_target_engine.py). Contiguous ranges in layer order, the largest device's bytes
//! as small as any contiguous split makes them, every device used; the device map
//! transformers loads with covers every weight of each family (dense, MoE with sliding
//! windows, MLA), and the taps of a target loaded through it equal those of a plain load.
//! No GPU here: the map's devices are all the CPU, which is what a real run's CUDA devices
//! replace. Needs python3 with torch, transformers and accelerate: skips on a laptop
//! without, fails under CI.

mod common;

use std::process::Command;

use serde_json::Value;

const ENGINE: &str = "../worker/python/dflash_target_engine.py";

/// Imports the engine module from its file, checks `split_layers` on given sizes, then per
/// family: a tiny random checkpoint, loaded plainly and through `device_map` over two
/// (CPU) devices, the taps of both on one sequence.
const SCRIPT: &str = r#"
import argparse, importlib.util, json, sys, tempfile, torch
from transformers import AutoConfig, AutoModelForCausalLM
spec = importlib.util.spec_from_file_location("engine", sys.argv[1])
eng = importlib.util.module_from_spec(spec)
spec.loader.exec_module(eng)
cases = [([10] * 8, 2, 0), ([10] * 8, 4, 0), ([10] * 8, 2, 40), ([1, 1, 100, 1], 2, 0),
         ([5, 5], 4, 0), ([3, 9, 1, 1, 1, 9, 3], 3, 2), ([7], 1, 0)]
out = {"splits": [eng.split_layers(s, n, f) for s, n, f in cases], "families": {}}
base = dict(vocab_size=256, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
            tie_word_embeddings=False)
families = {
    "qwen3": dict(intermediate_size=96),
    "gpt_oss": dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 3),
    "deepseek_v3": dict(intermediate_size=96, num_key_value_heads=4, kv_lora_rank=16,
                        q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                        n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1),
}
ids = [5, 17, 42, 99, 7, 8, 9, 10, 11, 12, 200, 3]
for name, extra in families.items():
    torch.manual_seed(0)
    kw = dict(base, **extra)
    if name == "deepseek_v3":
        kw.pop("head_dim")
    d = tempfile.mkdtemp()
    AutoModelForCausalLM.from_config(AutoConfig.for_model(name, **kw)).save_pretrained(d)
    taps = {}
    for devices in (None, "cpu,cpu"):
        a = argparse.Namespace(target=d, taps="1,3,4", mode="taps", device="cpu", devices=devices)
        model, tap_ids, captured, hidden, total = eng.load(a)
        with torch.no_grad():
            getattr(model, "model", model)(input_ids=torch.tensor([ids]), use_cache=False)
        taps[devices] = torch.cat([captured[k][0] for k in tap_ids], -1)
    cfg = AutoConfig.from_pretrained(d)
    dmap = eng.device_map(cfg, ["dev0", "dev1"])
    out["families"][name] = {
        "map": dmap,
        "max_diff": float((taps[None] - taps["cpu,cpu"]).abs().max()),
        "scale": float(taps[None].abs().max()),
        "rows": taps[None].shape[0],
    }
print(json.dumps(out))
"#;

#[test]
fn the_torch_engine_splits_a_targets_layers_over_devices_in_contiguous_even_ranges() {
    if !common::have_python("torch, transformers, accelerate") {
        return;
    }
    let engine = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(ENGINE);
    let o = Command::new("python3")
        .args(["-c", SCRIPT])
        .arg(&engine)
        .env("TRANSFORMERS_VERBOSITY", "error")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let stdout = String::from_utf8_lossy(&o.stdout);
    let r: Value = serde_json::from_str(stdout.trim().lines().last().unwrap()).unwrap();
    let splits: Vec<Vec<usize>> = serde_json::from_value(r["splits"].clone()).unwrap();
    assert_eq!(
        splits,
        [
            vec![0, 0, 0, 0, 1, 1, 1, 1],
            vec![0, 0, 1, 1, 2, 2, 3, 3],
            // The embedding (40) counts for the first device: it takes fewer layers.
            vec![0, 0, 1, 1, 1, 1, 1, 1],
            // The best a contiguous split of [1, 1, 100, 1] can do.
            vec![0, 0, 1, 1],
            // Fewer layers than devices: one each, the rest unused.
            vec![0, 1],
            // 2 + 3 | 9 + 1 + 1 + 1 | 9 + 3: at most 12 on one device.
            vec![0, 1, 1, 1, 1, 2, 2],
            vec![0],
        ]
    );
    for s in &splits {
        assert!(
            s.windows(2).all(|w| w[1] == w[0] || w[1] == w[0] + 1),
            "{s:?}"
        );
    }
    let fams = r["families"].as_object().unwrap();
    assert_eq!(fams.len(), 3);
    for (name, f) in fams {
        // Taps through the device map equal a plain load's.
        let (diff, scale) = (
            f["max_diff"].as_f64().unwrap(),
            f["scale"].as_f64().unwrap(),
        );
        assert!(scale > 0.0 && diff <= 1e-6 * scale, "{name}: {f}");
        assert_eq!(f["rows"], 12, "{name}");
        // The decoder layers (of the whole config: 6) over both devices, in order; the
        // rest of the model on the first.
        let map = f["map"].as_object().unwrap();
        let layer_dev: Vec<&str> = (0..6)
            .filter_map(|i| map.get(&format!("model.layers.{i}")))
            .map(|d| d.as_str().unwrap())
            .collect();
        assert_eq!(layer_dev.len(), 6, "{name}: {map:?}");
        let first_dev1 = layer_dev.iter().position(|d| *d == "dev1").unwrap();
        assert!(
            (1..6).contains(&first_dev1) && layer_dev[first_dev1..].iter().all(|d| *d == "dev1"),
            "{name}: {layer_dev:?}"
        );
        assert_eq!(map["model.embed_tokens"], "dev0", "{name}: {map:?}");
        assert!(
            map.iter()
                .filter(|(k, _)| !k.starts_with("model.layers."))
                .all(|(_, v)| v == "dev0"),
            "{name}: {map:?}"
        );
    }
}
