//! Reading safetensors checkpoints (one file, or shards with `model.safetensors.index.json`),
//! bf16/f16/f32, into f32, with errors that name the file and the tensor.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

/// A checkpoint that cannot be used: the file (or directory) and what is wrong with it.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {problem}")]
pub struct ModelError {
    pub path: String,
    pub problem: ModelProblem,
}

/// What is wrong with a checkpoint's file, one line each.
#[derive(Debug, thiserror::Error)]
pub enum ModelProblem {
    #[error(transparent)]
    Config(#[from] dflash_shared::model_config::ConfigProblem),
    #[error("cannot read: {0}")]
    Unreadable(std::io::Error),
    #[error("not valid JSON: {0}")]
    Json(serde_json::Error),
    #[error("no weight_map object")]
    NoWeightMap,
    #[error("no model.safetensors or model.safetensors.index.json (expected a Hugging Face model directory)")]
    NoWeights,
    #[error("cannot open: {0}")]
    Unopenable(std::io::Error),
    #[error("cannot map: {0}")]
    Unmappable(std::io::Error),
    #[error("truncated or corrupt safetensors file: {0}")]
    Corrupt(safetensors::SafeTensorError),
    #[error("tensor {name} appears in two shards")]
    TwoShards { name: String },
    #[error("missing tensor {name} (shape {shape:?})")]
    MissingTensor { name: String, shape: Vec<usize> },
    #[error("tensor {name} has shape {found:?}, expected {expected:?} from config.json")]
    Shape {
        name: String,
        found: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error("tensor {name} has dtype {dtype:?}; expected bf16, f16 or f32")]
    Dtype {
        name: String,
        dtype: safetensors::Dtype,
    },
    #[error("{count} unexpected tensor(s), e.g. {first} (is this checkpoint the architecture config.json names?)")]
    Unexpected { count: usize, first: String },
    #[error("no input embedding of shape {shape:?}: none of {tried:?} is in the checkpoint (where does this architecture keep its embed_tokens?)")]
    NoEmbedding {
        tried: Vec<String>,
        shape: Vec<usize>,
    },
    #[error("tensor {found} is not an lm_head name this tool reads ({tried:?}): refusing to guess, or to use the embedding in its place")]
    UnknownLmHead { found: String, tried: Vec<String> },
    #[error("tap {tap} does not exist: the target has {layers} layers (0..{})", layers - 1)]
    NoSuchTap { tap: usize, layers: usize },
}

fn err(path: &Path, problem: ModelProblem) -> ModelError {
    ModelError {
        path: path.display().to_string(),
        problem,
    }
}

pub struct Weights {
    dir: PathBuf,
    shards: Vec<(PathBuf, Mmap)>,
    /// tensor name → where it is, read from its shard's header once (a Qwen3-MoE
    /// checkpoint holds tens of thousands of tensors: reparsing a header per tensor
    /// would be quadratic)
    index: HashMap<String, Entry>,
}

/// A tensor's shard, dtype, shape and bytes (offsets into the shard's mapping).
struct Entry {
    shard: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: std::ops::Range<usize>,
}

impl Weights {
    pub fn open(dir: &Path) -> Result<Weights, ModelError> {
        let single = dir.join("model.safetensors");
        let index_path = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if single.exists() {
            vec![single]
        } else if index_path.exists() {
            let text = std::fs::read_to_string(&index_path)
                .map_err(|e| err(&index_path, ModelProblem::Unreadable(e)))?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| err(&index_path, ModelProblem::Json(e)))?;
            let map = v["weight_map"]
                .as_object()
                .ok_or_else(|| err(&index_path, ModelProblem::NoWeightMap))?;
            let mut files: Vec<PathBuf> = map
                .values()
                .filter_map(|f| f.as_str())
                .map(|f| dir.join(f))
                .collect();
            files.sort();
            files.dedup();
            files
        } else {
            return Err(err(dir, ModelProblem::NoWeights));
        };
        let mut shards = Vec::new();
        let mut index = HashMap::new();
        for (i, path) in files.into_iter().enumerate() {
            let f = File::open(&path).map_err(|e| err(&path, ModelProblem::Unopenable(e)))?;
            // SAFETY: the checkpoint is read-only input; nobody is expected to rewrite it
            // while the run loads it.
            let mmap =
                unsafe { Mmap::map(&f) }.map_err(|e| err(&path, ModelProblem::Unmappable(e)))?;
            let st = SafeTensors::deserialize(&mmap)
                .map_err(|e| err(&path, ModelProblem::Corrupt(e)))?;
            for (name, view) in st.tensors() {
                let start = view.data().as_ptr() as usize - mmap.as_ptr() as usize;
                let entry = Entry {
                    shard: i,
                    dtype: view.dtype(),
                    shape: view.shape().to_vec(),
                    bytes: start..start + view.data().len(),
                };
                if index.insert(name.clone(), entry).is_some() {
                    return Err(err(&path, ModelProblem::TwoShards { name }));
                }
            }
            shards.push((path, mmap));
        }
        Ok(Weights {
            dir: dir.to_path_buf(),
            shards,
            index,
        })
    }

    /// The checkpoint's directory (its config.json lies there).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The dtype a tensor is stored in, if the checkpoint holds it.
    pub fn dtype(&self, name: &str) -> Option<Dtype> {
        self.index.get(name).map(|e| e.dtype)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// The tensor as f32, checked against `shape`.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        let (dtype, data) = self.raw(name, shape)?;
        Ok(match dtype {
            Dtype::BF16 => data
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::F16 => data
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            // raw() returns f32, bf16 or f16 only.
            _ => data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        })
    }

    /// The tensor's bytes as stored (little-endian, no copy) and its dtype, checked against
    /// `shape`: what a device reads straight from the checkpoint's mapping.
    pub fn raw(&self, name: &str, shape: &[usize]) -> Result<(Dtype, &[u8]), ModelError> {
        let e = self.index.get(name).ok_or_else(|| {
            err(
                &self.dir,
                ModelProblem::MissingTensor {
                    name: name.to_string(),
                    shape: shape.to_vec(),
                },
            )
        })?;
        let (path, mmap) = &self.shards[e.shard];
        if e.shape != shape {
            return Err(err(
                path,
                ModelProblem::Shape {
                    name: name.to_string(),
                    found: e.shape.clone(),
                    expected: shape.to_vec(),
                },
            ));
        }
        match e.dtype {
            d @ (Dtype::F32 | Dtype::BF16 | Dtype::F16) => Ok((d, &mmap[e.bytes.clone()])),
            other => Err(err(
                path,
                ModelProblem::Dtype {
                    name: name.to_string(),
                    dtype: other,
                },
            )),
        }
    }

    /// Refuse tensors the architecture does not know (a checkpoint of another model).
    pub fn check_no_extra(&self, known: &dyn Fn(&str) -> bool) -> Result<(), ModelError> {
        let mut extra: Vec<&str> = self.names().filter(|n| !known(n)).collect();
        extra.sort();
        if let Some(first) = extra.first() {
            let i = self.index[*first].shard;
            return Err(err(
                &self.shards[i].0,
                ModelProblem::Unexpected {
                    count: extra.len(),
                    first: first.to_string(),
                },
            ));
        }
        Ok(())
    }
}
