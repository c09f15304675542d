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
/// [`MAX_HEADER`]) and that many bytes, without parsing them. The error is one line naming
/// the file.
pub fn read_header_prefix(path: &Path) -> Result<HeaderPrefix, String> {
    let fail = |msg: String| format!("{}: {msg}", path.display());
    let mut f = File::open(path).map_err(|e| fail(format!("cannot open: {e}")))?;
    let size = f
        .metadata()
        .map_err(|e| fail(format!("cannot stat: {e}")))?
        .len();
    let mut bytes = vec![0u8; 8];
    if size < 8 || f.read_exact(&mut bytes).is_err() {
        return Err(fail(format!(
            "truncated safetensors file ({size} bytes; expected an 8-byte header length first)"
        )));
    }
    // The format's only fixed field: the header's length, a little-endian u64.
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
    if n > MAX_HEADER {
        return Err(fail(format!(
            "not a safetensors file (header length {n} bytes; expected at most {MAX_HEADER})"
        )));
    }
    if 8 + n > size {
        return Err(fail(format!(
            "truncated safetensors file: its header alone is {n} bytes but the file has {size}"
        )));
    }
    f.take(n)
        .read_to_end(&mut bytes)
        .map_err(|e| fail(format!("cannot read the header: {e}")))?;
    Ok(HeaderPrefix {
        bytes,
        file_size: size,
    })
}

/// The checkpoint files of a model directory: `model.safetensors`, else the shards named
/// by `model.safetensors.index.json` (each must exist).
pub fn checkpoint_files(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if !index.exists() {
        return Err(format!("{}: no model.safetensors or model.safetensors.index.json (expected a Hugging Face model directory)", dir.display()));
    }
    let text = std::fs::read_to_string(&index)
        .map_err(|e| format!("{}: cannot read: {e}", index.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| format!("{}: not valid JSON: {e}", index.display()))?;
    let map = v["weight_map"].as_object().ok_or_else(|| {
        format!(
            "{}: no weight_map object (expected {{\"weight_map\": {{tensor: shard file}}}})",
            index.display()
        )
    })?;
    let mut files: Vec<PathBuf> = Vec::new();
    for (name, f) in map {
        let f = f
            .as_str()
            .ok_or_else(|| format!("{}: weight_map[{name}] is not a file name", index.display()))?;
        files.push(dir.join(f));
    }
    files.sort();
    files.dedup();
    if files.is_empty() {
        return Err(format!("{}: weight_map lists no shard", index.display()));
    }
    if let Some(missing) = files.iter().find(|p| !p.is_file()) {
        return Err(format!(
            "{}: missing (listed in {})",
            missing.display(),
            index.display()
        ));
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
pub fn read_header(path: &Path) -> Result<HashMap<String, TensorInfo>, String> {
    let fail = |msg: String| format!("{}: {msg}", path.display());
    let prefix = read_header_prefix(path)?;
    let meta: Metadata = serde_json::from_slice(&prefix.bytes[8..])
        .map_err(|e| fail(format!("corrupt safetensors header: {e}")))?;
    let end = meta.data_len() as u64;
    let data = prefix.file_size - 8 - prefix.header_len();
    if data != end {
        let what = if data < end {
            "truncated safetensors file"
        } else {
            "corrupt safetensors file"
        };
        return Err(fail(format!(
            "{what}: the header describes {end} bytes of tensor data but the file holds {data}"
        )));
    }
    Ok(meta
        .tensors()
        .into_iter()
        .map(|(name, info)| (name, info.clone()))
        .collect())
}

/// Check the checkpoint in `dir` against `cfg`; the error is one line naming the file.
pub fn check(dir: &Path, cfg: &TargetConfig) -> Result<(), String> {
    let files = checkpoint_files(dir)?;
    let mut found: HashMap<String, (usize, TensorInfo)> = HashMap::new();
    for (i, path) in files.iter().enumerate() {
        for (name, info) in read_header(path)? {
            if let Some((j, _)) = found.insert(name.clone(), (i, info)) {
                return Err(format!(
                    "{}: tensor {name} also appears in {}",
                    path.display(),
                    files[j].display()
                ));
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
            return Err(format!(
                "{}: missing tensor {name} (shape {shape:?} from config.json)",
                dir.display()
            ));
        };
        let path = files[*i].display();
        if &t.shape != shape {
            return Err(format!(
                "{path}: tensor {name} has shape {:?}, expected {shape:?} from config.json",
                t.shape
            ));
        }
        if !matches!(t.dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32) {
            return Err(format!(
                "{path}: tensor {name} has dtype {}; expected bf16, f16 or f32",
                t.dtype
            ));
        }
    }
    let known: std::collections::HashSet<&str> = expected.iter().map(|(n, _)| n.as_str()).collect();
    let mut extra: Vec<&String> = found
        .keys()
        .filter(|n| !known.contains(n.as_str()) && !is_ignorable_tensor(n))
        .collect();
    extra.sort();
    if let Some(first) = extra.first() {
        return Err(format!(
            "{}: {} unexpected tensor(s), e.g. {first} (is this checkpoint the architecture config.json names?)",
            files[found[*first].0].display(),
            extra.len()
        ));
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

    fn tiny() -> (tempfile::TempDir, TargetConfig, Vec<(String, Vec<usize>)>) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), TINY_CONFIG).unwrap();
        let cfg = TargetConfig::parse(TINY_CONFIG).unwrap();
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
        let e = check(dir.path(), &cfg).unwrap_err();
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
        let e = check(dir.path(), &cfg).unwrap_err();
        assert!(
            e.starts_with(&file.display().to_string()) && e.contains("truncated safetensors file"),
            "{e}"
        );
        std::fs::write(&file, &bytes[..5]).unwrap();
        assert!(check(dir.path(), &cfg).unwrap_err().contains("truncated"));
        std::fs::write(&file, b"\xff\xff\xff\xff\xff\xff\xff\xffjunk").unwrap();
        assert!(check(dir.path(), &cfg)
            .unwrap_err()
            .contains("not a safetensors file"));

        let mut ts = with(&all, "BF16");
        ts[3].1 = "I8";
        write(&file, &ts);
        let e = check(dir.path(), &cfg).unwrap_err();
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
        let e = check(dir.path(), &cfg).unwrap_err();
        assert!(
            e.contains(&format!("tensor {} has shape [7, 7], expected", ts[4].0)),
            "{e}"
        );

        let ts = with(&all[1..], "BF16");
        write(&file, &ts);
        let e = check(dir.path(), &cfg).unwrap_err();
        assert!(e.contains(&format!("missing tensor {}", all[0].0)), "{e}");

        let mut ts = with(&all, "BF16");
        ts.push(("lm_head.weight", "BF16", vec![512, 63]));
        write(&file, &ts);
        assert!(
            check(dir.path(), &cfg)
                .unwrap_err()
                .contains("tensor lm_head.weight has shape [512, 63]"),
            "a tied model's spare lm_head is checked"
        );

        let mut ts = with(&all, "BF16");
        ts.push(("model.layers.99.mlp.up_proj.weight", "BF16", vec![2, 2]));
        write(&file, &ts);
        assert!(check(dir.path(), &cfg)
            .unwrap_err()
            .contains("1 unexpected tensor(s), e.g. model.layers.99"));
    }
}
