//! Checks of a `--target` directory before any worker starts, from the safetensors headers
//! only (no tensor data is read): every shard that `model.safetensors.index.json` lists
//! exists, each file's header parses and its size is the header's plus the tensors' data,
//! and every tensor the workers load is there with the shape config.json gives and a dtype
//! they read (bf16, f16, f32). A bad checkpoint is a permanent failure: restarting a
//! worker on it cannot help, so it is refused up front with one line naming the file.

use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use dflash_shared::model_config::{expected_tensors, is_ignorable_tensor, TargetConfig};
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::Dtype;

/// Larger headers are refused (the safetensors crate's own limit is 100 MB).
const MAX_HEADER: u64 = 100 << 20;

/// A checkpoint that cannot be used: the file (or directory) and what is wrong with it,
/// printed as one line.
#[derive(Debug, thiserror::Error)]
#[error("{}: {problem}", path.display())]
pub struct CheckpointError {
    pub path: PathBuf,
    pub problem: Problem,
}

/// What is wrong with a checkpoint file or directory.
#[derive(Debug, thiserror::Error)]
pub enum Problem {
    #[error("cannot open: {source}")]
    Open { source: std::io::Error },
    #[error("cannot stat: {source}")]
    Stat { source: std::io::Error },
    #[error("truncated safetensors file ({size} bytes; expected an 8-byte header length first)")]
    NoHeaderLength { size: u64 },
    #[error(
        "not a safetensors file (header length {header} bytes; expected at most {MAX_HEADER})"
    )]
    HeaderTooLong { header: u64 },
    #[error(
        "truncated safetensors file: its header alone is {header} bytes but the file has {size}"
    )]
    HeaderPastEnd { header: u64, size: u64 },
    #[error("cannot read the header: {source}")]
    ReadHeader { source: std::io::Error },
    #[error("corrupt safetensors header: {source}")]
    CorruptHeader { source: serde_json::Error },
    /// The header's tensor data is not the rest of the file: fewer bytes (truncated) or
    /// more (corrupt).
    #[error("{} safetensors file: the header describes {described} bytes of tensor data but the file holds {held}", if held < described { "truncated" } else { "corrupt" })]
    DataLength { described: u64, held: u64 },
    #[error("no model.safetensors or model.safetensors.index.json (expected a Hugging Face model directory)")]
    NotAModel,
    #[error("cannot read: {source}")]
    ReadIndex { source: std::io::Error },
    #[error("not valid JSON: {source}")]
    IndexJson { source: serde_json::Error },
    #[error("no weight_map object (expected {{\"weight_map\": {{tensor: shard file}}}})")]
    NoWeightMap,
    #[error("weight_map[{tensor}] is not a file name")]
    ShardName { tensor: String },
    #[error("weight_map lists no shard")]
    NoShard,
    #[error("missing (listed in {})", index.display())]
    MissingShard { index: PathBuf },
    #[error("tensor {tensor} also appears in {}", other.display())]
    Duplicate { tensor: String, other: PathBuf },
    #[error("missing tensor {tensor} (shape {shape:?} from config.json)")]
    MissingTensor { tensor: String, shape: Vec<usize> },
    #[error("tensor {tensor} has shape {shape:?}, expected {expected:?} from config.json")]
    Shape {
        tensor: String,
        shape: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error("tensor {tensor} has dtype {dtype}; expected bf16, f16 or f32")]
    Dtype { tensor: String, dtype: Dtype },
    #[error("{count} unexpected tensor(s), e.g. {first} (is this checkpoint the architecture config.json names?)")]
    Unexpected { count: usize, first: String },
}

impl Problem {
    /// This problem of the file or directory `path`.
    fn at(self, path: &Path) -> CheckpointError {
        CheckpointError {
            path: path.to_path_buf(),
            problem: self,
        }
    }
}

/// A safetensors file's header as read from its start: the 8-byte length prefix and the
/// JSON header after it (`bytes`), and the file's size. No tensor data is read.
pub struct HeaderPrefix {
    pub bytes: Vec<u8>,
    pub file_size: u64,
}

impl HeaderPrefix {
    /// The JSON header's length in bytes.
    fn header_len(&self) -> u64 {
        self.bytes.len() as u64 - 8
    }
}

/// Read the header prefix of the safetensors file `path`: its length (at most
/// `MAX_HEADER`) and that many bytes, without parsing them. The error is one line naming
/// the file.
pub fn read_header_prefix(path: &Path) -> Result<HeaderPrefix, CheckpointError> {
    let mut f = File::open(path).map_err(|source| Problem::Open { source }.at(path))?;
    let size = f
        .metadata()
        .map_err(|source| Problem::Stat { source }.at(path))?
        .len();
    let mut bytes = vec![0u8; 8];
    if size < 8 || f.read_exact(&mut bytes).is_err() {
        return Err(Problem::NoHeaderLength { size }.at(path));
    }
    // The format's only fixed field: the header's length, a little-endian u64.
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
    if n > MAX_HEADER {
        return Err(Problem::HeaderTooLong { header: n }.at(path));
    }
    if 8 + n > size {
        return Err(Problem::HeaderPastEnd { header: n, size }.at(path));
    }
    f.take(n)
        .read_to_end(&mut bytes)
        .map_err(|source| Problem::ReadHeader { source }.at(path))?;
    Ok(HeaderPrefix {
        bytes,
        file_size: size,
    })
}

/// The checkpoint files of a model directory: `model.safetensors`, else the shards named
/// by `model.safetensors.index.json` (each must exist).
pub fn checkpoint_files(dir: &Path) -> Result<Vec<PathBuf>, CheckpointError> {
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if !index.exists() {
        return Err(Problem::NotAModel.at(dir));
    }
    let text = std::fs::read_to_string(&index)
        .map_err(|source| Problem::ReadIndex { source }.at(&index))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|source| Problem::IndexJson { source }.at(&index))?;
    let map = v["weight_map"]
        .as_object()
        .ok_or_else(|| Problem::NoWeightMap.at(&index))?;
    let mut files: Vec<PathBuf> = Vec::new();
    for (name, f) in map {
        let f = f.as_str().ok_or_else(|| {
            Problem::ShardName {
                tensor: name.clone(),
            }
            .at(&index)
        })?;
        files.push(dir.join(f));
    }
    files.sort();
    files.dedup();
    if files.is_empty() {
        return Err(Problem::NoShard.at(&index));
    }
    if let Some(missing) = files.iter().find(|p| !p.is_file()) {
        return Err(Problem::MissingShard { index }.at(missing));
    }
    Ok(files)
}

/// Read and check one file's header: it parses (by the safetensors crate, which also
/// checks that each tensor's data size fits its dtype and shape and that the tensors' data
/// is contiguous) and the file is exactly the header plus that data (a truncated download
/// fails here).
///
/// `SafeTensors::read_metadata` wants the whole file in memory (it compares the header
/// with the buffer's length), so the header alone is parsed as the crate's [`Metadata`]
/// and its data length compared with the file's size here.
pub fn read_header(path: &Path) -> Result<HashMap<String, TensorInfo>, CheckpointError> {
    let prefix = read_header_prefix(path)?;
    let meta: Metadata = serde_json::from_slice(&prefix.bytes[8..])
        .map_err(|source| Problem::CorruptHeader { source }.at(path))?;
    let end = meta.data_len() as u64;
    let data = prefix.file_size - 8 - prefix.header_len();
    if data != end {
        return Err(Problem::DataLength {
            described: end,
            held: data,
        }
        .at(path));
    }
    Ok(meta
        .tensors()
        .into_iter()
        .map(|(name, info)| (name, info.clone()))
        .collect())
}

/// The decoder layer a tensor of the language model belongs to (`...layers.N.` outside a
/// vision or audio tower), if any.
fn decoder_layer(name: &str) -> Option<usize> {
    let (before, after) = name.split_once("layers.")?;
    if ["vision", "visual", "audio"]
        .iter()
        .any(|t| before.contains(t))
    {
        return None;
    }
    after.split('.').next()?.parse().ok()
}

/// The weight elements the torch engine loads from the checkpoint in `dir` to tap up to
/// layer `last`: every tensor but those of the decoder layers above it (which it neither
/// loads nor runs), as the safetensors headers give their shapes.
pub fn loaded_elements(dir: &Path, last: usize) -> Result<u64, CheckpointError> {
    let (layers, rest) = loaded_by_layer(dir, last)?;
    Ok(layers.iter().sum::<u64>() + rest)
}

/// [`loaded_elements`] per decoder layer `0..=last`, and of everything else (embedding,
/// lm_head, norms, a vision tower).
pub fn loaded_by_layer(dir: &Path, last: usize) -> Result<(Vec<u64>, u64), CheckpointError> {
    let (mut layers, mut rest) = (vec![0u64; last + 1], 0u64);
    for f in checkpoint_files(dir)? {
        for (name, info) in read_header(&f)? {
            let n = info.shape.iter().product::<usize>() as u64;
            match decoder_layer(&name) {
                Some(l) if l > last => {}
                Some(l) => layers[l] += n,
                None => rest += n,
            }
        }
    }
    Ok((layers, rest))
}

/// Check the checkpoint in `dir` against `cfg`; the error is one line naming the file.
pub fn check(dir: &Path, cfg: &TargetConfig) -> Result<(), CheckpointError> {
    let files = checkpoint_files(dir)?;
    let mut found: HashMap<String, (usize, TensorInfo)> = HashMap::new();
    for (i, path) in files.iter().enumerate() {
        for (name, info) in read_header(path)? {
            if let Some((j, _)) = found.insert(name.clone(), (i, info)) {
                return Err(Problem::Duplicate {
                    tensor: name,
                    other: files[j].clone(),
                }
                .at(path));
            }
        }
    }
    let expected = expected_tensors(cfg, cfg.num_hidden_layers);
    // A tied model's spare lm_head is read by the drafters when it is there.
    let lm_head = (
        "lm_head.weight".to_string(),
        vec![cfg.vocab_size, cfg.hidden_size],
    );
    let spare = (cfg.tie_word_embeddings && found.contains_key(&lm_head.0)).then_some(&lm_head);
    for (name, shape) in expected.iter().chain(spare) {
        let Some((i, t)) = found.get(name) else {
            return Err(Problem::MissingTensor {
                tensor: name.clone(),
                shape: shape.clone(),
            }
            .at(dir));
        };
        let path = &files[*i];
        if &t.shape != shape {
            return Err(Problem::Shape {
                tensor: name.clone(),
                shape: t.shape.clone(),
                expected: shape.clone(),
            }
            .at(path));
        }
        if !matches!(t.dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32) {
            return Err(Problem::Dtype {
                tensor: name.clone(),
                dtype: t.dtype,
            }
            .at(path));
        }
    }
    let known: std::collections::HashSet<&str> = expected.iter().map(|(n, _)| n.as_str()).collect();
    let mut extra: Vec<&String> = found
        .keys()
        .filter(|n| !known.contains(n.as_str()) && !is_ignorable_tensor(n))
        .collect();
    extra.sort();
    if let Some(first) = extra.first() {
        return Err(Problem::Unexpected {
            count: extra.len(),
            first: first.to_string(),
        }
        .at(&files[found[*first].0]));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflash_shared::model_config::TINY_CONFIG;

    /// A safetensors file of `tensors` (name, dtype, shape), zero data.
    fn write(path: &Path, tensors: &[(&str, &str, Vec<usize>)]) {
        let data: Vec<(&str, Dtype, Vec<usize>, Vec<u8>)> = tensors
            .iter()
            .map(|(name, dtype, shape)| {
                let dtype: Dtype = serde_json::from_value(serde_json::json!(dtype)).unwrap();
                let n = shape.iter().product::<usize>() * dtype.bitsize() / 8;
                (*name, dtype, shape.clone(), vec![0u8; n])
            })
            .collect();
        let views = data.iter().map(|(name, dtype, shape, bytes)| {
            let view = safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes);
            (*name, view.unwrap())
        });
        safetensors::serialize_to_file(views, None, path).unwrap();
    }

    #[test]
    fn the_torch_engine_loads_every_tensor_but_the_decoder_layers_above_the_last_tap() {
        let dir = tempfile::tempdir().unwrap();
        // Two shards, as a sharded checkpoint: the index names them.
        write(
            &dir.path().join("a.safetensors"),
            &[
                (
                    "model.language_model.embed_tokens.weight",
                    "BF16",
                    vec![10, 4],
                ),
                ("model.language_model.layers.0.mlp.w", "BF16", vec![4, 4]),
                ("model.language_model.layers.1.mlp.w", "F32", vec![4, 8]),
                ("model.visual.blocks.layers.7.w", "BF16", vec![3]),
            ],
        );
        write(
            &dir.path().join("b.safetensors"),
            &[
                ("model.language_model.layers.2.mlp.w", "BF16", vec![4, 4]),
                ("model.layers.61.mtp.w", "BF16", vec![5]),
                ("lm_head.weight", "BF16", vec![10, 4]),
            ],
        );
        let map: serde_json::Map<String, serde_json::Value> = [
            ("model.language_model.embed_tokens.weight", "a"),
            ("model.language_model.layers.0.mlp.w", "a"),
            ("model.language_model.layers.1.mlp.w", "a"),
            ("model.visual.blocks.layers.7.w", "a"),
            ("model.language_model.layers.2.mlp.w", "b"),
            ("model.layers.61.mtp.w", "b"),
            ("lm_head.weight", "b"),
        ]
        .into_iter()
        .map(|(k, f)| (k.to_string(), format!("{f}.safetensors").into()))
        .collect();
        std::fs::write(
            dir.path().join("model.safetensors.index.json"),
            serde_json::json!({ "weight_map": map }).to_string(),
        )
        .unwrap();
        // Up to layer 1: the embedding, layers 0 and 1, the vision tower (its own
        // "layers" are not the decoder's), the lm_head; not layer 2 nor the MTP layer.
        assert_eq!(
            loaded_elements(dir.path(), 1).unwrap(),
            40 + 16 + 32 + 3 + 40
        );
        assert_eq!(loaded_elements(dir.path(), 0).unwrap(), 40 + 16 + 3 + 40);
        assert_eq!(
            loaded_elements(dir.path(), 61).unwrap(),
            40 + 16 + 32 + 3 + 16 + 5 + 40
        );
        let e = loaded_elements(&dir.path().join("none"), 1).unwrap_err();
        assert!(e.to_string().contains("none"), "{e}");
    }

    fn tiny() -> (tempfile::TempDir, TargetConfig, Vec<(String, Vec<usize>)>) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), TINY_CONFIG).unwrap();
        let cfg = TargetConfig::read(TINY_CONFIG).unwrap();
        let all = expected_tensors(&cfg, cfg.num_hidden_layers);
        (dir, cfg, all)
    }

    fn with<'a>(
        all: &'a [(String, Vec<usize>)],
        dtype: &'static str,
    ) -> Vec<(&'a str, &'static str, Vec<usize>)> {
        all.iter()
            .map(|(n, s)| (n.as_str(), dtype, s.clone()))
            .collect()
    }

    /// A Qwen3-MoE checkpoint: every expert's tensors are checked; one missing (or of
    /// the dense layout) is refused naming it.
    #[test]
    fn a_mixture_of_experts_checkpoint_needs_every_experts_tensors() {
        let mut v: serde_json::Value = serde_json::from_str(TINY_CONFIG).unwrap();
        let o = v.as_object_mut().unwrap();
        o.insert(
            "architectures".into(),
            serde_json::json!(["Qwen3MoeForCausalLM"]),
        );
        o.insert("model_type".into(), "qwen3_moe".into());
        o.insert("num_experts".into(), 3.into());
        o.insert("num_experts_per_tok".into(), 2.into());
        o.insert("moe_intermediate_size".into(), 32.into());
        let cfg = TargetConfig::read(&v.to_string()).unwrap();
        let all = expected_tensors(&cfg, cfg.num_hidden_layers);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        write(&path, &with(&all, "BF16"));
        check(dir.path(), &cfg).unwrap();
        let gone = "model.layers.4.mlp.experts.2.up_proj.weight";
        let fewer: Vec<_> = all.iter().filter(|(n, _)| n != gone).cloned().collect();
        write(&path, &with(&fewer, "BF16"));
        let e = check(dir.path(), &cfg).unwrap_err().to_string();
        assert!(
            e.contains(gone) && e.contains("[32, 64]") && !e.contains('\n'),
            "{e}"
        );
        // A dense checkpoint given a MoE config: the router is missing.
        let (_, dense_cfg, dense) = tiny();
        assert_eq!(dense_cfg.moe, None);
        write(&path, &with(&dense, "BF16"));
        let e = check(dir.path(), &cfg).unwrap_err().to_string();
        assert!(e.contains("model.layers.0.mlp.gate.weight"), "{e}");
    }

    #[test]
    fn a_good_single_file_and_good_shards_pass() {
        let (dir, cfg, all) = tiny();
        write(&dir.path().join("model.safetensors"), &with(&all, "BF16"));
        check(dir.path(), &cfg).unwrap();

        let (dir, cfg, all) = tiny();
        let (a, b) = all.split_at(all.len() / 2);
        write(&dir.path().join("s1.safetensors"), &with(a, "F32"));
        write(&dir.path().join("s2.safetensors"), &with(b, "F16"));
        let map: serde_json::Map<String, serde_json::Value> = a
            .iter()
            .map(|(n, _)| (n.clone(), "s1.safetensors".into()))
            .chain(b.iter().map(|(n, _)| (n.clone(), "s2.safetensors".into())))
            .collect();
        std::fs::write(
            dir.path().join("model.safetensors.index.json"),
            serde_json::json!({"weight_map": map}).to_string(),
        )
        .unwrap();
        check(dir.path(), &cfg).unwrap();
        // A missing shard is named.
        std::fs::remove_file(dir.path().join("s2.safetensors")).unwrap();
        let e = check(dir.path(), &cfg).unwrap_err().to_string();
        assert!(
            e.contains("s2.safetensors: missing (listed in") && e.contains("index.json"),
            "{e}"
        );
    }

    #[test]
    fn truncation_dtype_and_shape_are_named_with_the_file() {
        let (dir, cfg, all) = tiny();
        let file = dir.path().join("model.safetensors");
        write(&file, &with(&all, "BF16"));
        let bytes = std::fs::read(&file).unwrap();
        std::fs::write(&file, &bytes[..bytes.len() - 100]).unwrap();
        let e = check(dir.path(), &cfg).unwrap_err().to_string();
        assert!(
            e.starts_with(&file.display().to_string()) && e.contains("truncated safetensors file"),
            "{e}"
        );
        std::fs::write(&file, &bytes[..5]).unwrap();
        assert!(check(dir.path(), &cfg)
            .unwrap_err()
            .to_string()
            .contains("truncated"));
        std::fs::write(&file, b"\xff\xff\xff\xff\xff\xff\xff\xffjunk").unwrap();
        assert!(check(dir.path(), &cfg)
            .unwrap_err()
            .to_string()
            .contains("not a safetensors file"));

        let mut ts = with(&all, "BF16");
        ts[3].1 = "I8";
        write(&file, &ts);
        let e = check(dir.path(), &cfg).unwrap_err();
        assert!(
            matches!(&e.problem, Problem::Dtype { tensor, dtype: Dtype::I8 } if tensor == ts[3].0)
                && e.path == file,
            "{e}"
        );
        let e = e.to_string();
        assert!(
            e.contains(&format!(
                "tensor {} has dtype I8; expected bf16, f16 or f32",
                ts[3].0
            )),
            "{e}"
        );

        let mut ts = with(&all, "BF16");
        ts[4].2 = vec![7, 7];
        write(&file, &ts);
        let e = check(dir.path(), &cfg).unwrap_err().to_string();
        assert!(
            e.contains(&format!("tensor {} has shape [7, 7], expected", ts[4].0)),
            "{e}"
        );

        let ts = with(&all[1..], "BF16");
        write(&file, &ts);
        let e = check(dir.path(), &cfg).unwrap_err().to_string();
        assert!(e.contains(&format!("missing tensor {}", all[0].0)), "{e}");

        let mut ts = with(&all, "BF16");
        ts.push(("lm_head.weight", "BF16", vec![512, 63]));
        write(&file, &ts);
        assert!(
            check(dir.path(), &cfg)
                .unwrap_err()
                .to_string()
                .contains("tensor lm_head.weight has shape [512, 63]"),
            "a tied model's spare lm_head is checked"
        );

        let mut ts = with(&all, "BF16");
        ts.push(("model.layers.99.mlp.up_proj.weight", "BF16", vec![2, 2]));
        write(&file, &ts);
        assert!(check(dir.path(), &cfg)
            .unwrap_err()
            .to_string()
            .contains("1 unexpected tensor(s), e.g. model.layers.99"));
    }
}
