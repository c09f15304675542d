//! What an export directory holds besides the weights: config.json as transformers reads
//! it (Qwen3 fields, rope as trained, `auto_map` to our model code), the model code
//! itself ([`DRAFTER_MODULE`], our own Python, written for this project), and the parity
//! probe: a small batch and the Rust drafter's final hidden states for it, computed with
//! the bf16 weights that were exported, which `dflash-supervise export-check` compares
//! with what transformers computes from the export.

use std::path::Path;

use dflash_shared::drafter::DrafterConfig;
use dflash_shared::model_config::RopeScaling;
use dflash_shared::rng::Rng;
use serde_json::{json, Value};

use crate::device::{cpu::CpuDevice, GpuError};
use crate::error::{Result, WorkerError};
use crate::models::drafter::device::DeviceDrafter;
use crate::models::drafter::{Drafter, Frozen, Sample};
use crate::train::{sync_dir, write_synced};

/// The model code, as transformers imports it from the export directory.
pub const MODULE_FILE: &str = "dflash_drafter.py";
/// The class `auto_map` names.
pub const MODEL_CLASS: &str = "DFlashDraftModel";
pub const DRAFTER_MODULE: &str = include_str!("../../python/dflash_drafter.py");
/// The parity probe.
pub use dflash_shared::checkpoint::probe_path;
/// Rows of the probe batch and blocks per row.
pub const PROBE_ROWS: usize = 2;
pub const PROBE_BLOCKS: usize = 3;

/// `rope_scaling` as transformers writes it (`null` when positions are not scaled).
pub fn rope_scaling_json(s: Option<&RopeScaling>) -> Value {
    // transformers validates original_max_position_embeddings as an integer.
    let int_if_whole = |x: f64| {
        if x.fract() == 0.0 && x.abs() < 1e15 {
            json!(x as i64)
        } else {
            json!(x)
        }
    };
    match s {
        None => Value::Null,
        Some(RopeScaling::Linear { factor }) => json!({"rope_type": "linear", "factor": factor}),
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        }) => json!({
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": low_freq_factor,
            "high_freq_factor": high_freq_factor,
            "original_max_position_embeddings": int_if_whole(*original_max_position_embeddings),
        }),
        // The attention factor as resolved, so a loader needs no mscale arithmetic.
        Some(RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            attention_factor,
            truncate,
        }) => json!({
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": int_if_whole(*original_max_position_embeddings),
            "beta_fast": beta_fast,
            "beta_slow": beta_slow,
            "attention_factor": attention_factor,
            "truncate": truncate,
        }),
    }
}

/// config.json of an export: every field transformers' Qwen3Config reads, as trained, plus
/// the DFlash fields and `auto_map`. `max_position_embeddings`: the target's, when its
/// config.json gives one (else Qwen3Config's default, 32768).
pub fn export_config(
    c: &DrafterConfig,
    step: u64,
    num_target_layers: usize,
    target_layer_ids: &[u32],
    max_position_embeddings: Option<u64>,
) -> Value {
    let module = MODULE_FILE.trim_end_matches(".py");
    json!({
        "architectures": [MODEL_CLASS],
        "auto_map": {"AutoModel": format!("{module}.{MODEL_CLASS}")},
        "model_type": "qwen3",
        "hidden_size": c.hidden,
        "num_hidden_layers": c.layers,
        "num_attention_heads": c.q_heads,
        "num_key_value_heads": c.kv_heads,
        "head_dim": c.head_dim,
        "intermediate_size": c.intermediate,
        "hidden_act": "silu",
        "rms_norm_eps": c.eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": rope_scaling_json(c.rope_scaling.as_ref()),
        "max_position_embeddings": max_position_embeddings.unwrap_or(32768),
        "attention_bias": false,
        "attention_dropout": 0.0,
        "use_sliding_window": false,
        "sliding_window": null,
        "max_window_layers": c.layers,
        "layer_types": vec!["full_attention"; c.layers],
        "initializer_range": 0.02,
        "vocab_size": c.vocab,
        "tie_word_embeddings": false,
        "use_cache": true,
        "torch_dtype": "bfloat16",
        "block_size": c.block_size,
        "num_target_layers": num_target_layers,
        "dflash_config": {"target_layer_ids": target_layer_ids, "mask_token_id": c.mask_token_id, "block_size": c.block_size},
        "dflash_training": {"step": step, "gamma": c.gamma, "max_anchors": c.max_anchors},
    })
}

/// One tensor of a safetensors file.
pub struct Tensor {
    pub name: &'static str,
    pub dtype: safetensors::Dtype,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

fn f32_tensor(name: &'static str, shape: Vec<usize>, v: &[f32]) -> Tensor {
    Tensor {
        name,
        dtype: safetensors::Dtype::F32,
        shape,
        bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

fn i64_tensor(name: &'static str, shape: Vec<usize>, v: &[usize]) -> Tensor {
    Tensor {
        name,
        dtype: safetensors::Dtype::I64,
        shape,
        bytes: v.iter().flat_map(|x| (*x as i64).to_le_bytes()).collect(),
    }
}

/// The parity probe: [`PROBE_ROWS`] rows of `S` context tokens with pseudo-random taps,
/// [`PROBE_BLOCKS`] blocks each (one at anchor 0, which sees no context, one at the last
/// token, whose block runs past the context), their inputs embedded with the frozen
/// embedding, and the drafter's final-normed hidden states for them under `params`.
/// Tensors: `target_hidden` `[B,S,L·H]` f32, `noise_embedding` `[B,M,H]` f32,
/// `block_input_ids` `[B,M]` i64, `position_ids` `[B,S+M]` i64, `anchors` `[B,N]` i64,
/// `attention_mask` `[B,1,M,S+M]` bool, `hidden_states` `[B,M,H]` f32 (the reference).
///
/// The hidden states come from the drafter the workers train ([`DeviceDrafter`]) on the CPU
/// device.
pub fn probe_batch(
    d: &Drafter,
    frozen: &Frozen,
    params: &[f32],
    seed: u64,
) -> std::result::Result<Vec<Tensor>, GpuError> {
    let c = &d.cfg;
    let (h, bs, width) = (c.hidden, c.block_size, c.n_taps * c.hidden);
    let s = 2 * bs + 5;
    let m = PROBE_BLOCKS * bs;
    let mut probe_cfg = c.clone();
    probe_cfg.max_anchors = probe_cfg.max_anchors.max(PROBE_BLOCKS);
    let mut model = DeviceDrafter::new(
        Box::new(CpuDevice::new()),
        &Drafter::new(probe_cfg),
        frozen,
        s,
    )?;
    let zeros = vec![0f32; params.len()];
    model.load(params, &zeros, &zeros, 0)?;
    let mut rng = Rng::new(seed ^ 0x7072_6f62_6521);
    let mut uniform =
        |scale: f32| ((rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale;
    let mut taps = Vec::with_capacity(PROBE_ROWS * s * width);
    let mut noise = Vec::with_capacity(PROBE_ROWS * m * h);
    let mut ids = Vec::with_capacity(PROBE_ROWS * m);
    let mut positions = Vec::with_capacity(PROBE_ROWS * (s + m));
    let mut anchors_all = Vec::with_capacity(PROBE_ROWS * PROBE_BLOCKS);
    let mut mask = Vec::with_capacity(PROBE_ROWS * m * (s + m));
    let mut out = Vec::with_capacity(PROBE_ROWS * m * h);
    for row in 0..PROBE_ROWS {
        let anchors = if row == 0 {
            [0, bs / 2 + 1, s - 1]
        } else {
            [1, s / 2, s - 2]
        };
        let row_taps: Vec<f32> = (0..s * width).map(|_| uniform(2.0)).collect();
        let mut row_noise = Vec::with_capacity(m * h);
        // The context's tokens: only those at the anchors are read (each block's first).
        let mut context = vec![0u32; s];
        for &a in &anchors {
            let anchor_token = (uniform(1.0).abs() * c.vocab as f32) as usize % c.vocab;
            context[a] = anchor_token as u32;
            for k in 0..bs {
                let tok = if k == 0 {
                    anchor_token
                } else {
                    c.mask_token_id as usize
                };
                let e = frozen.embed.get(tok * h..(tok + 1) * h).ok_or_else(|| {
                    GpuError::Invalid(format!("token {tok} is outside the embedding"))
                })?;
                row_noise.extend_from_slice(e);
                ids.push(tok);
            }
        }
        let sample = Sample {
            taps: &row_taps,
            ids: &context,
            mask: &[],
        };
        let hidden = model.final_hidden(&sample, &anchors)?;
        positions.extend(0..s);
        positions.extend(anchors.iter().flat_map(|&a| (0..bs).map(move |k| a + k)));
        for q in 0..m {
            let n = q / bs;
            mask.extend((0..s + m).map(|kv| {
                u8::from(if kv < s {
                    kv < anchors[n]
                } else {
                    (kv - s) / bs == n
                })
            }));
        }
        anchors_all.extend_from_slice(&anchors);
        taps.extend(row_taps);
        noise.extend(row_noise);
        out.extend(hidden);
    }
    let b = PROBE_ROWS;
    Ok(vec![
        f32_tensor("target_hidden", vec![b, s, width], &taps),
        f32_tensor("noise_embedding", vec![b, m, h], &noise),
        i64_tensor("block_input_ids", vec![b, m], &ids),
        i64_tensor("position_ids", vec![b, s + m], &positions),
        i64_tensor("anchors", vec![b, PROBE_BLOCKS], &anchors_all),
        Tensor {
            name: "attention_mask",
            dtype: safetensors::Dtype::BOOL,
            shape: vec![b, 1, m, s + m],
            bytes: mask,
        },
        f32_tensor("hidden_states", vec![b, m, h], &out),
    ])
}

pub fn write_safetensors(tensors: &[Tensor], path: &Path) -> Result<()> {
    write_synced(path, &serialize(tensors)?)
}

/// What config.json of an export records beside the drafter's own config.
pub struct ExportInfo<'a> {
    pub step: u64,
    /// The run's seed (the probe's inputs come from it).
    pub seed: u64,
    pub num_target_layers: usize,
    pub target_layer_ids: &'a [u32],
    /// The target's `max_position_embeddings`, when its config.json gives one.
    pub max_position_embeddings: Option<u64>,
    /// The target the drafter was trained for ([`target_record`]), written as
    /// `dflash_target`, when known.
    pub target: Option<Value>,
    /// How the training data was rendered (the chat template's SHA-256, the thinking
    /// switch), written as `dflash_rendering`, when the run recorded it: `eval` compares
    /// its own rendering with it.
    pub rendering: Option<Value>,
    /// Why the MASK token is the id it is, written as `dflash_training.mask_token`
    /// ([`dflash_shared::mask_token`]'s rule, or a given id).
    pub mask_token_rule: Option<String>,
}

/// What an export records of its target: the architecture, depth, width, the capture
/// fingerprint its hidden states carried, and a mixture of experts' routing (null for a
/// dense target).
pub fn target_record(c: &dflash_shared::model_config::TargetConfig) -> Value {
    json!({
        "architecture": c.arch.to_string(),
        "model_type": c.model_type,
        "num_hidden_layers": c.num_hidden_layers,
        "hidden_size": c.hidden_size,
        "fingerprint": format!("{:016x}", c.fingerprint()),
        "moe": c.moe,
    })
}

/// The export's files into `tmp` (a directory of its own), and its probe into `probe_tmp`.
fn write_files(
    d: &Drafter,
    frozen: &Frozen,
    params: &[f32],
    info: &ExportInfo,
    tmp: &Path,
    probe_tmp: &Path,
) -> Result<()> {
    let mut config = export_config(
        &d.cfg,
        info.step,
        info.num_target_layers,
        info.target_layer_ids,
        info.max_position_embeddings,
    );
    if let Some(t) = &info.target {
        config["dflash_target"] = t.clone();
    }
    if let Some(r) = &info.rendering {
        config["dflash_rendering"] = r.clone();
    }
    if let Some(m) = &info.mask_token_rule {
        config["dflash_training"]["mask_token"] = m.as_str().into();
    }
    // The weights as exported (bf16), back in f32: the probe runs on exactly these.
    let rounded: Vec<f32> = params
        .iter()
        .map(|v| half::bf16::from_f32(*v).to_f32())
        .collect();
    let probe = probe_batch(d, frozen, &rounded, info.seed)
        .map_err(|e| WorkerError::Invalid(format!("computing the export's parity probe: {e}")))?;
    drop(rounded);
    write_synced(probe_tmp, &serialize(&probe)?)?;
    write_synced(&tmp.join(MODULE_FILE), DRAFTER_MODULE.as_bytes())?;
    let bufs: Vec<(String, Vec<usize>, Vec<u8>)> = d
        .layout
        .entries
        .iter()
        .map(|(n, s, off)| {
            let len: usize = s.iter().product();
            let bytes = params[*off..off + len]
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                .collect();
            (n.clone(), s.clone(), bytes)
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = bufs
        .iter()
        .map(|(n, s, b)| {
            Ok((
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, s.clone(), b)?,
            ))
        })
        .collect::<std::result::Result<_, safetensors::SafeTensorError>>()?;
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    let weights = safetensors::serialize(views, Some(meta))?;
    drop(bufs);
    write_synced(&tmp.join("model.safetensors"), &weights)?;
    drop(weights);
    write_synced(
        &tmp.join("config.json"),
        serde_json::to_string_pretty(&config)?.as_bytes(),
    )?;
    sync_dir(tmp)
}

/// Write the drafter as a Hugging Face directory: config.json (Qwen3 fields, the DFlash
/// fields and `auto_map`), model.safetensors (bf16, tensor names as in z-lab's DFlash
/// draft model), the model code transformers loads with `trust_remote_code`
/// ([`MODULE_FILE`]); and, beside the directory ([`probe_path`]), the parity probe that
/// `dflash-supervise export-check` runs it on. Atomic: written beside `dir`, synced, then
/// renamed into place (the directory first, then its probe); every failure names its
/// path.
pub fn write_hf_dir(
    d: &Drafter,
    frozen: &Frozen,
    params: &[f32],
    info: &ExportInfo,
    dir: &Path,
) -> Result<()> {
    if !params.iter().all(|x| x.is_finite()) {
        return Err(WorkerError::Invalid(format!(
            "the drafter's weights at step {} are not finite: not exported",
            info.step
        )));
    }
    use dflash_shared::export_dest;
    // What an earlier export killed mid-way left here is put right first (its directory
    // and probe removed, an export it had set aside put back).
    for line in export_dest::recover(dir, export_dest::pid_gone) {
        eprintln!("dflash-worker: {line}");
    }
    // Only a new path, an empty directory or an earlier export is replaced; the export is
    // written into a directory of its own that this process created.
    let dest = export_dest::check(dir).map_err(|e| WorkerError::Invalid(e.to_string()))?;
    let tmp = export_dest::fresh_dir_beside(dir, "export").map_err(WorkerError::io(format!(
        "creating a directory beside {}",
        dir.display()
    )))?;
    let probe_file = probe_path(dir);
    let probe_tmp = tmp.join("probe.tmp");
    let written = write_files(d, frozen, params, info, &tmp, &probe_tmp);
    // The probe leaves the new directory before it is renamed into place (it lives beside
    // it); into a file of its own beside the destination, created here.
    let probe_beside = written.and_then(|()| {
        let p = export_dest::free_name_beside(&probe_file, "tmp").map_err(WorkerError::io(
            format!("naming a file beside {}", probe_file.display()),
        ))?;
        std::fs::rename(&probe_tmp, &p).map_err(WorkerError::io(format!(
            "renaming {} to {}",
            probe_tmp.display(),
            p.display()
        )))?;
        Ok(p)
    });
    let probe_tmp = match probe_beside {
        Ok(p) => p,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
    };
    if let Err(e) = replace_export(&tmp, dir, &dest) {
        // The probe first: a probe file left without its directory means "in place" to
        // export_dest::recover.
        let _ = std::fs::remove_file(&probe_tmp);
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    std::fs::rename(&probe_tmp, &probe_file).map_err(WorkerError::io(format!(
        "renaming {} to {}",
        probe_tmp.display(),
        probe_file.display()
    )))?;
    if let Some(parent) = probe_file.parent().filter(|p| !p.as_os_str().is_empty()) {
        sync_dir(parent)?;
    }
    Ok(())
}

/// Put the finished export `tmp` (a directory this process created) at `dir`, as checked
/// before it was written: renamed to a new path or over an empty directory; an earlier
/// export is renamed aside under a free name first and removed once the new one is in
/// place (put back if the new one cannot be). Nothing else is ever removed.
fn replace_export(
    tmp: &Path,
    dir: &Path,
    dest: &dflash_shared::export_dest::Destination,
) -> Result<()> {
    use dflash_shared::export_dest::{self, Destination};
    let rename = |from: &Path, to: &Path| {
        std::fs::rename(from, to).map_err(WorkerError::io(format!(
            "renaming {} to {}",
            from.display(),
            to.display()
        )))
    };
    match dest {
        // (A rename onto a directory replaces it only while it is empty: one that filled
        // meanwhile makes this fail, untouched.)
        Destination::Fresh | Destination::Empty => rename(tmp, dir)?,
        Destination::Export => {
            if !export_dest::is_export(dir) {
                return Err(WorkerError::Invalid(format!(
                    "--out {}: changed while the export was written, and is no longer an export of dflash-supervise: not replaced",
                    dir.display()
                )));
            }
            let aside = export_dest::free_name_beside(dir, "replaced").map_err(WorkerError::io(
                format!("naming a directory beside {}", dir.display()),
            ))?;
            rename(dir, &aside)?;
            if let Err(e) = rename(tmp, dir) {
                let _ = std::fs::rename(&aside, dir);
                return Err(e);
            }
            let _ = std::fs::remove_dir_all(&aside);
        }
    }
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        sync_dir(parent)?;
    }
    Ok(())
}

/// `dflash-worker export`: the drafter of checkpoint `checkpoint` (verified first) as the
/// Hugging Face directory `out`, with the frozen embeddings of the target in `target`.
/// Which target layers the drafter reads comes from the checkpoint (older checkpoints:
/// `taps` and `num_target_layers` as given). Returns the checkpoint's step.
pub fn from_checkpoint(
    checkpoint: &Path,
    target: &Path,
    out: &Path,
    taps: Option<&[u32]>,
    num_target_layers: Option<usize>,
    rendering: Option<Value>,
) -> Result<u64> {
    use dflash_shared::checkpoint::{META_FILE, STATE_FILE};
    dflash_shared::checkpoint::verify(checkpoint, None)
        .map_err(|e| WorkerError::Invalid(format!("checkpoint refused: {e}")))?;
    let meta_path = checkpoint.join(META_FILE);
    let text = std::fs::read_to_string(&meta_path)
        .map_err(WorkerError::io(format!("reading {}", meta_path.display())))?;
    let meta: Value = serde_json::from_str(&text)
        .map_err(WorkerError::format(meta_path.display().to_string()))?;
    let cfg: DrafterConfig = serde_json::from_value(meta["drafter"].clone()).map_err(
        WorkerError::format(format!("{}: drafter", meta_path.display())),
    )?;
    let step = meta["step"].as_u64().unwrap_or(0);
    let seed = meta["seed"].as_u64().unwrap_or(0);
    let recorded = &meta["supervisor"]["export"];
    let ids: Vec<u32> = match recorded["target_layer_ids"].as_array() {
        Some(a) => a.iter().filter_map(|v| v.as_u64().map(|x| x as u32)).collect(),
        None => taps.map(<[u32]>::to_vec).ok_or_else(|| {
            WorkerError::Invalid(format!(
                "{} does not record the target layers the drafter reads (a checkpoint of an older version): give --taps and --num-target-layers",
                meta_path.display()
            ))
        })?,
    };
    let layers = recorded["num_target_layers"]
        .as_u64()
        .map(|n| n as usize)
        .or(num_target_layers)
        .ok_or_else(|| {
            WorkerError::Invalid(format!(
                "{} does not record the target's depth: give --num-target-layers",
                meta_path.display()
            ))
        })?;
    let d = Drafter::new(cfg);
    let state_path = checkpoint.join(STATE_FILE);
    let bytes = std::fs::read(&state_path)
        .map_err(WorkerError::io(format!("reading {}", state_path.display())))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(WorkerError::format(state_path.display().to_string()))?;
    let t = st.tensor("params").map_err(WorkerError::format(format!(
        "{}: params",
        state_path.display()
    )))?;
    let n = d.layout.total;
    if t.shape() != [n] || t.data().len() != 4 * n {
        return Err(WorkerError::Invalid(format!(
            "{}: params has shape {:?}, expected [{n}] for the drafter meta.json describes",
            state_path.display(),
            t.shape()
        )));
    }
    let params: Vec<f32> = t
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect();
    drop(bytes);
    let c = &d.cfg;
    let w = crate::models::weights::Weights::open(target)?;
    let frozen = Frozen::load(&w, c.vocab, c.hidden)?;
    drop(w);
    let max_position_embeddings = std::fs::read_to_string(target.join("config.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .and_then(|v| v["max_position_embeddings"].as_u64());
    let info = ExportInfo {
        step,
        seed,
        num_target_layers: layers,
        target_layer_ids: &ids,
        max_position_embeddings,
        target: dflash_shared::model_config::TargetConfig::load_any(target)
            .ok()
            .map(|c| {
                let mut r = target_record(&c);
                // Where it was: `eval` of this export defaults to it.
                if let Ok(p) = std::fs::canonicalize(target) {
                    r["path"] = p.to_string_lossy().into_owned().into();
                }
                r
            }),
        rendering,
        mask_token_rule: Some(mask_token_rule(
            checkpoint,
            target,
            c.vocab,
            c.mask_token_id,
        )),
    };
    write_hf_dir(&d, &frozen, &params, &info, out)?;
    Ok(step)
}

/// Why a drafter of `target` (`vocab` rows) trained from `checkpoint` has MASK token `id`:
/// the default's rule when it is the default (by the run's `--tokenizer` when its run.json
/// names one, else the target's tokenizer), else that it was given.
fn mask_token_rule(checkpoint: &Path, target: &Path, vocab: usize, id: u32) -> String {
    let tokenizer = checkpoint
        .parent()
        .and_then(Path::parent)
        .and_then(|run| std::fs::read_to_string(run.join("run.json")).ok())
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .and_then(|v| v["tokenizer"].as_str().map(std::path::PathBuf::from));
    let dir = tokenizer.as_deref().unwrap_or(target);
    let default = dflash_shared::mask_token::default_mask_token(Some(dir), vocab);
    if default.id == id {
        format!("{id}: {}", default.rule)
    } else {
        format!(
            "{id}: given (--mask-token-id, or the --init-drafter's); the default would be {}: {}",
            default.id, default.rule
        )
    }
}

fn serialize(tensors: &[Tensor]) -> Result<Vec<u8>> {
    let views: Vec<(&str, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|t| {
            Ok((
                t.name,
                safetensors::tensor::TensorView::new(t.dtype, t.shape.clone(), &t.bytes)?,
            ))
        })
        .collect::<std::result::Result<_, safetensors::SafeTensorError>>()?;
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    Ok(safetensors::serialize(views, Some(meta))?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflash_shared::model_config::{TargetConfig, TINY_CONFIG};

    #[test]
    fn the_config_carries_auto_map_and_rope_as_trained() {
        let t = TargetConfig::read(TINY_CONFIG).unwrap();
        let mut c = DrafterConfig::for_target(&t, 2, 2, 8, 4);
        let v = export_config(&c, 3, 6, &[1, 4], None);
        assert_eq!(
            v["auto_map"]["AutoModel"],
            "dflash_drafter.DFlashDraftModel"
        );
        assert_eq!(v["rope_scaling"], Value::Null);
        assert_eq!(
            v["layer_types"],
            json!(["full_attention", "full_attention"])
        );
        assert_eq!(v["max_position_embeddings"], 32768);
        c.rope_scaling = Some(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        });
        let v = export_config(&c, 3, 6, &[1, 4], Some(131072));
        assert_eq!(v["rope_scaling"]["rope_type"], "llama3");
        assert_eq!(
            v["rope_scaling"]["original_max_position_embeddings"],
            json!(8192)
        );
        assert_eq!(v["max_position_embeddings"], 131072);
        // What the trainer reads back is what was trained.
        let back = TargetConfig::read(&v.to_string()).unwrap();
        assert_eq!(back.rope_scaling, c.rope_scaling);
        assert_eq!(back.rope_theta, c.rope_theta);
        assert!(DRAFTER_MODULE.contains(&format!("class {MODEL_CLASS}(")));
    }

    #[test]
    fn exported_weights_load_back_as_their_bf16_rounding() {
        let t = TargetConfig::read(TINY_CONFIG).unwrap();
        let c = DrafterConfig::for_target(&t, 2, 2, 4, 4);
        let d = Drafter::new(c.clone());
        let p = d.init_params(11);
        let embed: Vec<f32> = (0..c.vocab * c.hidden)
            .map(|i| ((i % 89) as f32 - 44.0) / 100.0)
            .collect();
        let frozen = Frozen {
            lm_head: embed.clone(),
            embed,
        };
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("drafter");
        let info = ExportInfo {
            step: 3,
            seed: 1,
            num_target_layers: t.num_hidden_layers,
            target_layer_ids: &[0, 1],
            max_position_embeddings: None,
            target: None,
            rendering: None,
            mask_token_rule: None,
        };
        write_hf_dir(&d, &frozen, &p, &info, &dir).unwrap();
        let back = crate::init_weights::load_weights(&d, &dir).unwrap();
        let rounded: Vec<f32> = p
            .iter()
            .map(|v| half::bf16::from_f32(*v).to_f32())
            .collect();
        assert_eq!(back.len(), p.len());
        // Bit for bit the bf16-rounded originals, tensor by tensor (no transpose, no shift).
        assert!(back
            .iter()
            .zip(&rounded)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
        assert!(
            back.iter().zip(&p).any(|(a, b)| a != b),
            "bf16 rounds some weights"
        );
        // A drafter of another shape is refused naming the tensor.
        let other = Drafter::new(DrafterConfig::for_target(&t, 3, 2, 4, 4));
        let e = crate::init_weights::load_weights(&other, &dir)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("model.safetensors") && e.contains("layers.2"),
            "{e}"
        );
        let e = crate::init_weights::load_weights(&d, tmp.path())
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot read"), "{e}");
    }

    #[test]
    fn the_probe_is_the_drafters_output_on_its_inputs() {
        let t = TargetConfig::read(TINY_CONFIG).unwrap();
        let c = DrafterConfig::for_target(&t, 1, 2, 4, 4);
        let d = Drafter::new(c.clone());
        let p = d.init_params(5);
        let embed: Vec<f32> = (0..c.vocab * c.hidden)
            .map(|i| ((i % 97) as f32 - 48.0) / 100.0)
            .collect();
        let frozen = Frozen {
            lm_head: embed.clone(),
            embed,
        };
        let probe = probe_batch(&d, &frozen, &p, 9).unwrap();
        let get = |n: &str| probe.iter().find(|t| t.name == n).unwrap();
        let (s, m) = (2 * 4 + 5, PROBE_BLOCKS * 4);
        assert_eq!(get("target_hidden").shape, vec![2, s, 2 * c.hidden]);
        assert_eq!(get("attention_mask").shape, vec![2, 1, m, s + m]);
        let f32s = |b: &[u8]| -> Vec<f32> {
            b.chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect()
        };
        let out = f32s(&get("hidden_states").bytes);
        assert_eq!(out.len(), 2 * m * c.hidden);
        assert!(out.iter().all(|x| x.is_finite()) && out.iter().any(|x| x.abs() > 0.1));
        // The block at anchor 0 sees no context key: its first query row's mask is its block only.
        let mask = &get("attention_mask").bytes;
        assert_eq!(mask[..s].iter().filter(|&&x| x == 1).count(), 0);
        assert_eq!(mask[s..s + m].iter().filter(|&&x| x == 1).count(), 4);
        // The drafter the workers train computed them: the reference drafter's forward on
        // the probe's own inputs gives the same values.
        let taps = f32s(&get("target_hidden").bytes);
        let noise = f32s(&get("noise_embedding").bytes);
        let anchors: Vec<usize> = get("anchors")
            .bytes
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as usize)
            .collect();
        let (tw, nw) = (s * 2 * c.hidden, m * c.hidden);
        for row in 0..2 {
            let want = d
                .final_hidden(
                    &p,
                    &taps[row * tw..(row + 1) * tw],
                    &noise[row * nw..(row + 1) * nw],
                    &anchors[row * PROBE_BLOCKS..(row + 1) * PROBE_BLOCKS],
                )
                .unwrap();
            let got = &out[row * nw..(row + 1) * nw];
            let worst = want
                .iter()
                .zip(got)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(
                worst < 1e-3,
                "row {row}: the probe is {worst} off the reference"
            );
        }
        // Bad inputs are errors, not panics.
        assert!(d.final_hidden(&p, &[0.0; 3], &[], &[]).is_err());
        assert!(d
            .final_hidden(
                &p,
                &vec![0.0; 2 * c.hidden * 2],
                &vec![0.0; 4 * c.hidden],
                &[5]
            )
            .is_err());
        let mut model = DeviceDrafter::new(Box::new(CpuDevice::new()), &d, &frozen, 4).unwrap();
        let taps = vec![0.0; 2 * c.hidden * 2];
        let sample = Sample {
            taps: &taps,
            ids: &[1, 2],
            mask: &[],
        };
        assert!(model.final_hidden(&sample, &[5]).is_err());
    }
}
