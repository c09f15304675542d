//! The built-in demo target: a small Qwen3-architecture model with deterministic random
//! weights, written in Hugging Face format (config.json + model.safetensors, bf16) so it
//! loads through exactly the code path of a real checkpoint.

use std::collections::HashMap;
use std::path::Path;

use dflash_shared::rng::Rng;
use safetensors::tensor::TensorView;
use safetensors::Dtype;

use super::target::expected_tensors;
use dflash_shared::model_config::TargetConfig;

pub use dflash_shared::model_config::TINY_CONFIG as CONFIG;

/// Write the tiny target into `dir` (created if needed). Deterministic: the same bytes
/// on every machine.
pub fn write(dir: &Path) -> std::io::Result<()> {
    write_random(dir, CONFIG, 0x7469_6e79)
}

/// Write a checkpoint of random weights for any supported `config.json` text.
pub fn write_random(dir: &Path, config: &str, seed: u64) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let cfg = TargetConfig::read(config).map_err(std::io::Error::other)?;
    let mut rng = Rng::new(seed);
    let mut bufs: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, shape) in expected_tensors(&cfg, cfg.num_hidden_layers) {
        let n: usize = shape.iter().product();
        let is_norm = name.ends_with("norm.weight");
        let fan_in = *shape.last().unwrap_or(&1) as f32;
        // Embeddings small, as in trained models, so the first logits are near uniform.
        let scale = if name.contains("embed_tokens") || name.contains("lm_head") {
            0.2
        } else {
            1.0 / fan_in.sqrt()
        };
        let mut bytes = Vec::with_capacity(n * 2);
        for _ in 0..n {
            let u = (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            let v = if is_norm {
                1.0 + 0.1 * u
            } else {
                u * scale * 1.7
            };
            bytes.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes());
        }
        bufs.push((name, shape, bytes));
    }
    let views: HashMap<String, TensorView> = bufs
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                TensorView::new(Dtype::BF16, s.clone(), b).expect("consistent tensor"),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors"))
        .map_err(std::io::Error::other)?;
    std::fs::write(dir.join("config.json"), config)
}
