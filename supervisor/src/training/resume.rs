//! Saving a run's settings (`run.json`) and continuing it from its newest checkpoint.
//!
//! run.json holds what decides what a run computes (target, data, batching, drafter,
//! schedule), its operational settings (checkpoints, limits, restarts, timeouts, pools,
//! `--tokenizer`), and a fingerprint of its inputs taken at the run's start (the data, the
//! tokenizer and chat template, the target's files). `--resume` restores the settings,
//! refuses inputs that changed since (unless `--allow-changed-data`), and continues from
//! the newest checkpoint that verifies and is of this run's drafter.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use dflash_shared::drafter::DrafterConfig;
use serde::{Deserialize, Serialize};

use crate::cli::{RunArgs, RunSettings};
use crate::error::Error;

pub const RUN_FILE: &str = "run.json";

/// Where a resume moves the newer checkpoints it refused (inside the run directory).
pub const REFUSED_DIR: &str = "refused-checkpoints";

/// run.json: the settings of a run (a resumed run uses the same, see [`merge`]) and the
/// records of its start.
///
/// The settings are [`RunSettings`] serialised by its own field names, held here as a map:
/// a run.json written by an older version may lack a newer setting (then this command
/// line's value holds).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SavedRun {
    #[serde(flatten)]
    pub settings: Settings,
    /// What the inputs were when the run started (absent from an older version's run.json:
    /// then nothing is checked on resume, and they are recorded then).
    #[serde(default)]
    pub inputs: Option<Inputs>,
    /// Every setting as the run used it, defaults resolved (the settings above hold the
    /// flags as given, `null` for a default): the learning rate and its schedule, the
    /// drafter's sizes, taps, batching, pools, the collective. Written at each start; a
    /// record, never read back as settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resolved: Option<serde_json::Value>,
    /// `--init-drafter`: the drafter directory the run started from (`path`) and the
    /// checksum of its weights (`model_sha256`). A record: a resume continues its own
    /// weights and keeps it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init_drafter: Option<serde_json::Value>,
    /// `--config`: the absolute path of the recipe file the settings above were read
    /// from (with the command line's flags over it). A record: a resume without
    /// `--config` keeps it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<String>,
}

/// Settings by their [`RunSettings`] field names (a relative target or data path is kept
/// as given: a resume runs from the same place).
pub type Settings = serde_json::Map<String, serde_json::Value>;

/// Why settings could not be carried between run.json and the command line.
#[derive(Debug, thiserror::Error)]
#[error("{RUN_FILE}'s settings: {0}")]
pub struct SettingsError(#[from] serde_json::Error);

fn settings_of(s: &RunSettings) -> Result<Settings, SettingsError> {
    match serde_json::to_value(s)? {
        serde_json::Value::Object(m) => Ok(m),
        other => Err(SettingsError(serde::ser::Error::custom(format!(
            "not an object: {other}"
        )))),
    }
}

impl SavedRun {
    /// The settings of a command line (without a fingerprint of the inputs: see [`save`]).
    pub fn of(a: &RunArgs) -> Result<SavedRun, SettingsError> {
        Ok(SavedRun {
            settings: settings_of(&a.settings)?,
            inputs: None,
            resolved: None,
            init_drafter: None,
            config: a.config.as_deref().map(absolute),
        })
    }

    /// Put the saved settings into `a`. A setting the file lacks (an older version's), or
    /// holds as `null` where `a` has a value that is never unset, keeps `a`'s.
    fn apply(self, a: &mut RunArgs) -> Result<(), SettingsError> {
        let mut now = settings_of(&a.settings)?;
        for (key, saved) in self.settings {
            match now.get(&key) {
                None => {} // a setting this version no longer has
                Some(v) if saved.is_null() && !v.is_null() => {}
                Some(_) => {
                    now.insert(key, saved);
                }
            }
        }
        a.settings = serde_json::from_value(serde_json::Value::Object(now))?;
        Ok(())
    }

    pub fn save(&self, run_dir: &Path) -> Result<(), Error> {
        let text =
            serde_json::to_string_pretty(self).map_err(|e| Error::json("the run settings", e))?;
        std::fs::write(run_dir.join(RUN_FILE), text)
            .map_err(|e| Error::io("cannot write", run_dir.join(RUN_FILE), e))
    }
}

/// Write `run_dir`'s run.json: the settings of `args` (as merged with the saved ones on
/// `--resume`) and the fingerprint of the inputs: of the run's start, taken now for a new
/// run; on `--resume`, the one [`prepare`] checked (or the inputs as they are now, where
/// `--allow-changed-data` accepted a change or an older run.json had none).
/// `resolved`: every setting as the run uses it (see [`SavedRun::resolved`]);
/// `init_drafter`: the record of `--init-drafter` (on `--resume`, the one run.json holds is
/// kept).
pub fn save(
    args: &RunArgs,
    resume: Option<&Resume>,
    run_dir: &Path,
    resolved: serde_json::Value,
    init_drafter: Option<serde_json::Value>,
) -> Result<(), Error> {
    // On --resume, the records of the run's start where this command has none.
    let before = resume.and_then(|_| {
        let text = std::fs::read_to_string(run_dir.join(RUN_FILE)).ok()?;
        serde_json::from_str::<SavedRun>(&text).ok()
    });
    let init_drafter = init_drafter.or_else(|| before.as_ref()?.init_drafter.clone());
    let now = SavedRun::of(args).map_err(|e| Error::json("the run settings", e.0))?;
    let config = now
        .config
        .clone()
        .or_else(|| before.as_ref()?.config.clone());
    let inputs = match resume {
        Some(r) => r.inputs.clone(),
        None => match Inputs::of(args) {
            Ok(i) => Some(i),
            Err(e) => {
                log::warn!("cannot fingerprint the run's inputs ({e}): a --resume of this run will not check that they are unchanged");
                None
            }
        },
    };
    SavedRun {
        inputs,
        resolved: Some(resolved),
        init_drafter,
        config,
        ..now
    }
    .save(run_dir)
}

/// Saved settings a resumed run may change: flags given with `--resume` win over them.
/// The step limit and the learning-rate schedule, the bad-line budget, where the tokenizer
/// is (its files are fingerprinted), and the operational settings: checkpoints, limits,
/// restarts, timeouts, the collective, the pools, logs and telemetry. The rest decide which
/// batches exist and what the drafter is, so changing them would not continue the same run.
pub const OVERRIDABLE: [&str; 36] = [
    "target_engine",
    "wandb_project",
    "wandb_name",
    "wandb_mode",
    "eval_data",
    "eval_every",
    "eval_prompts",
    "eval_gpu",
    "eval_max_new_tokens",
    "eval_timeout",
    "steps",
    "lr",
    "warmup_ratio",
    "max_bad_lines",
    "tokenizer",
    "preflight_lines",
    "checkpoint_every",
    "keep_checkpoints",
    "snapshot_every",
    "max_rollbacks",
    "max_skipped_steps",
    "collective",
    "collective_timeout",
    "time_limit",
    "hang_timeout",
    "step_timeout",
    "max_restarts",
    "stable_after",
    "stop_timeout",
    "token_slots",
    "hidden_slots",
    "prefetch",
    "log_max_size",
    "log_backups",
    "gpu_sample_interval",
    "metrics_interval",
];

/// A setting of this command line that cannot be merged into the saved ones.
#[derive(Debug, thiserror::Error)]
pub enum MergeError {
    /// A setting a resumed run keeps, given with another value: its flag and both values
    /// as shown to the user.
    #[error(
        "{flag} {given} differs from this run's {saved} ({RUN_FILE}); a resumed run keeps its model, data and batching \
         (expected no {flag}, or the same value; only --steps, --lr, --warmup-ratio, --max-bad-lines, \
         --tokenizer and the operational flags such as --time-limit or --checkpoint-every may change; \
         or start a new run)"
    )]
    Kept {
        flag: String,
        given: String,
        saved: String,
    },
}

/// Merge the settings given on this command line (`given`: the ids of the flags on it;
/// an optional setting that has a value also counts, from a flag or `--config`) into the
/// saved ones. A given overridable setting wins; another one that differs from the saved
/// value is refused. Returns the merged settings and one note per override.
pub fn merge(
    mut saved: SavedRun,
    now: &SavedRun,
    given: &[String],
) -> Result<(SavedRun, Vec<String>), MergeError> {
    let mut merged = std::mem::take(&mut saved.settings);
    let saved_records = saved;
    let optional = optional_settings();
    let mut notes = Vec::new();
    for (key, value) in &now.settings {
        let is_given = if optional.contains(key) {
            !value.is_null()
        } else {
            given.iter().any(|g| g == key)
        };
        let old = merged.get(key).cloned().unwrap_or(serde_json::Value::Null);
        if !is_given || *value == old {
            continue;
        }
        let flag = format!("--{}", key.replace('_', "-"));
        let shown = |v: &serde_json::Value| match v {
            serde_json::Value::Null => "the default".to_string(),
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Array(a) => a
                .iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(","),
            other => other.to_string(),
        };
        if OVERRIDABLE.contains(&key.as_str()) {
            notes.push(format!(
                "{flag} {} replaces this run's {}",
                shown(value),
                shown(&old)
            ));
            merged.insert(key.clone(), value.clone());
        } else {
            return Err(MergeError::Kept {
                flag,
                given: shown(value),
                saved: shown(&old),
            });
        }
    }
    let merged = SavedRun {
        settings: merged,
        ..saved_records
    };
    Ok((merged, notes))
}

/// Settings that are optional (`None`: the default, or not set): the flags without a
/// default value. The others always have a value, so only the command line tells whether
/// one was given.
fn optional_settings() -> HashSet<String> {
    use clap::Args;
    RunSettings::augment_args(clap::Command::new("settings"))
        .get_arguments()
        .filter(|a| a.get_default_values().is_empty())
        .map(|a| a.get_id().to_string())
        .collect()
}

// ---------------------------------------------------------------------------------------
// Fingerprints of the inputs.

/// How much of each end of a data file is hashed.
const END_BYTES: u64 = 1 << 20;

/// What a run's inputs were: compared on `--resume`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Inputs {
    pub data: DataPrint,
    /// The tokenizer and chat template chat data is rendered with (`None`: none loaded).
    #[serde(default)]
    pub tokenizer: Option<TokenizerPrint>,
    /// The target's files (`None`: the built-in tiny target).
    #[serde(default)]
    pub target: Option<TargetPrint>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum DataPrint {
    /// The built-in demo data: its parameters.
    Demo {
        samples: usize,
        seed: u64,
    },
    /// Standard input: nothing to compare.
    Stdin,
    /// A FIFO or device: read once, so only its path.
    Stream {
        path: String,
    },
    File {
        file: FilePrint,
    },
    /// A directory: its `*.jsonl` files, sorted, as the loader reads them.
    Directory {
        path: String,
        files: Vec<FilePrint>,
    },
}

/// A data file as a resume compares it: by its size and content, not its modification
/// time (a byte-identical copy staged anew at each requeue, `cp` without `-p`, is the same
/// data).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FilePrint {
    /// Absolute, symbolic links resolved.
    pub path: String,
    pub size: u64,
    /// Modification time, RFC 3339 (nanoseconds): recorded, and compared only with a
    /// fingerprint that has no `content` (see there).
    #[serde(default)]
    pub modified: String,
    /// Checksums of the first and of the last MiB (they say where a change is).
    pub first_mib: String,
    pub last_mib: String,
    /// Checksum of the whole file ([`dflash_shared::checkpoint::content_sha256`]: its
    /// SHA-256, or of its 64 MiB pieces' for a larger one). `None` in the run.json of a
    /// version before it, whose fingerprint is compared as that version did (size, time,
    /// first and last MiB).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenizerPrint {
    /// Where it was (it may move: only the checksums are compared).
    pub dir: String,
    /// Checksum of tokenizer.json.
    pub tokenizer_json: String,
    /// Checksum of the chat template's text (`None`: none found).
    pub chat_template: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TargetPrint {
    pub dir: String,
    /// Checksum of config.json.
    pub config_json: String,
    /// The file that describes the weights (model.safetensors.index.json, or the single
    /// shard model.safetensors, whose header is hashed) and its checksum.
    pub weights_file: Option<String>,
    pub weights: Option<String>,
}

/// What changed, for the "expected the same ..." of the refusal.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Input {
    Data,
    Tokenizer,
    Target,
}

impl Input {
    fn name(self) -> &'static str {
        match self {
            Input::Data => "data",
            Input::Tokenizer => "tokenizer and chat template",
            Input::Target => "target",
        }
    }
}

use dflash_shared::checkpoint::ChecksumAlgorithm;

/// A fingerprint's checksum: SHA-256, or for a fingerprint recorded by a version before
/// SHA-256 (16 hex digits), the legacy hash it was recorded with.
fn hash(alg: ChecksumAlgorithm, bytes: &[u8]) -> String {
    alg.hex(bytes)
}

fn absolute(p: &Path) -> String {
    p.canonicalize()
        .or_else(|_| std::path::absolute(p))
        .unwrap_or_else(|_| p.to_path_buf())
        .display()
        .to_string()
}

/// An input of the run that cannot be read to fingerprint it: which one, and why.
#[derive(Debug, thiserror::Error)]
pub enum FingerprintError {
    #[error("the data file {} cannot be read: {source}", path.display())]
    DataFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the data {path} cannot be read: {source}")]
    Data {
        path: String,
        source: std::io::Error,
    },
    #[error("the data directory {path}: {source}")]
    DataDirectory {
        path: String,
        source: crate::data::loader::LoaderError,
    },
    #[error("{} cannot be read: {source}", path.display())]
    Tokenizer {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the target's {} cannot be read: {source}", path.display())]
    TargetFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the target's {0}")]
    TargetHeader(#[source] crate::run::target_check::CheckpointError),
}

fn file_print(p: &Path, alg: ChecksumAlgorithm) -> Result<FilePrint, FingerprintError> {
    use std::io::{Read, Seek, SeekFrom};
    let why = |source| FingerprintError::DataFile {
        path: p.to_path_buf(),
        source,
    };
    let mut f = std::fs::File::open(p).map_err(why)?;
    let meta = f.metadata().map_err(why)?;
    let size = meta.len();
    let modified = meta
        .modified()
        .map(|t| humantime::format_rfc3339_nanos(t).to_string())
        .unwrap_or_default();
    let mut first = Vec::new();
    (&mut f)
        .take(END_BYTES)
        .read_to_end(&mut first)
        .map_err(why)?;
    let mut last = Vec::new();
    f.seek(SeekFrom::Start(size.saturating_sub(END_BYTES)))
        .map_err(why)?;
    (&mut f)
        .take(END_BYTES)
        .read_to_end(&mut last)
        .map_err(why)?;
    let content = dflash_shared::checkpoint::content_sha256(&f).map_err(why)?;
    Ok(FilePrint {
        path: absolute(p),
        size,
        modified,
        first_mib: hash(alg, &first),
        last_mib: hash(alg, &last),
        content: Some(content),
    })
}

fn data_print(a: &RunArgs, alg: ChecksumAlgorithm) -> Result<DataPrint, FingerprintError> {
    match a.data.as_str() {
        "demo" => Ok(DataPrint::Demo {
            samples: a.demo_samples,
            seed: a.seed,
        }),
        "-" => Ok(DataPrint::Stdin),
        path => {
            let p = Path::new(path);
            let meta = std::fs::metadata(p).map_err(|source| FingerprintError::Data {
                path: path.to_string(),
                source,
            })?;
            if meta.is_dir() {
                let files = match crate::data::loader::parse_source(path, a.demo_samples) {
                    Ok(crate::data::loader::DataSource::Files(f)) => f,
                    Ok(_) => Vec::new(),
                    Err(source) => {
                        return Err(FingerprintError::DataDirectory {
                            path: path.to_string(),
                            source,
                        })
                    }
                };
                Ok(DataPrint::Directory {
                    path: absolute(p),
                    files: files
                        .iter()
                        .map(|f| file_print(f, alg))
                        .collect::<Result<_, _>>()?,
                })
            } else if meta.is_file() {
                Ok(DataPrint::File {
                    file: file_print(p, alg)?,
                })
            } else {
                Ok(DataPrint::Stream { path: absolute(p) })
            }
        }
    }
}

/// The directory chat data would be rendered with, as the run's data set-up loads it: the
/// `--tokenizer`, else the target's directory when it has a tokenizer.json, for file or
/// stdin data (`None`: none is loaded).
fn tokenizer_dir(a: &RunArgs) -> Option<PathBuf> {
    if let Some(t) = &a.tokenizer {
        return Some(t.clone());
    }
    if a.data == "demo" || a.target == "tiny" {
        return None;
    }
    let t = PathBuf::from(&a.target);
    t.join("tokenizer.json").is_file().then_some(t)
}

/// The chat template's text as the chat loader finds it: chat_template.jinja, else
/// tokenizer_config.json's `chat_template` (a string, or the list's "default").
fn chat_template(dir: &Path) -> Option<String> {
    if let Ok(t) = std::fs::read_to_string(dir.join("chat_template.jinja")) {
        return Some(t);
    }
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer_config.json")).ok()?)
            .ok()?;
    match &cfg["chat_template"] {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(list) => list
            .iter()
            .find(|t| t["name"] == "default")
            .and_then(|t| t["template"].as_str())
            .map(str::to_string),
        _ => None,
    }
}

fn tokenizer_print(
    a: &RunArgs,
    alg: ChecksumAlgorithm,
) -> Result<Option<TokenizerPrint>, FingerprintError> {
    let Some(dir) = tokenizer_dir(a) else {
        return Ok(None);
    };
    let tok = dir.join("tokenizer.json");
    let bytes = std::fs::read(&tok).map_err(|source| FingerprintError::Tokenizer {
        path: tok.clone(),
        source,
    })?;
    Ok(Some(TokenizerPrint {
        dir: absolute(&dir),
        tokenizer_json: hash(alg, &bytes),
        chat_template: chat_template(&dir).map(|t| hash(alg, t.as_bytes())),
    }))
}

fn target_print(
    a: &RunArgs,
    alg: ChecksumAlgorithm,
) -> Result<Option<TargetPrint>, FingerprintError> {
    if a.target == "tiny" {
        return Ok(None);
    }
    let dir = Path::new(&a.target);
    let read = |name: &str| {
        let p = dir.join(name);
        std::fs::read(&p).map_err(|source| FingerprintError::TargetFile { path: p, source })
    };
    let config_json = hash(alg, &read("config.json")?);
    let index = "model.safetensors.index.json";
    let (weights_file, weights) = if dir.join(index).is_file() {
        (Some(index.to_string()), Some(hash(alg, &read(index)?)))
    } else {
        let single = dir.join("model.safetensors");
        if single.exists() {
            // Its length prefix and JSON header: what names, shapes and places the tensors.
            let h = crate::run::target_check::read_header_prefix(&single)
                .map_err(FingerprintError::TargetHeader)?;
            (
                Some("model.safetensors".to_string()),
                Some(hash(alg, &h.bytes)),
            )
        } else {
            (None, None)
        }
    };
    Ok(Some(TargetPrint {
        dir: absolute(dir),
        config_json,
        weights_file,
        weights,
    }))
}

impl Inputs {
    /// The inputs `a` names, as they are now.
    pub fn of(a: &RunArgs) -> Result<Inputs, FingerprintError> {
        Self::of_with(a, ChecksumAlgorithm::Sha256)
    }

    /// The inputs `a` names, their checksums by `alg`.
    fn of_with(a: &RunArgs, alg: ChecksumAlgorithm) -> Result<Inputs, FingerprintError> {
        Ok(Inputs {
            data: data_print(a, alg)?,
            tokenizer: tokenizer_print(a, alg)?,
            target: target_print(a, alg)?,
        })
    }

    /// Whether every data file of this fingerprint has its content's checksum (not so in
    /// the run.json of an older version).
    fn by_content(&self) -> bool {
        match &self.data {
            DataPrint::File { file } => file.content.is_some(),
            DataPrint::Directory { files, .. } => files.iter().all(|f| f.content.is_some()),
            _ => true,
        }
    }

    /// The algorithm of these fingerprints' checksums: the legacy hash's 16 hex digits in
    /// a run.json of a version before SHA-256, else SHA-256.
    fn algorithm(&self) -> ChecksumAlgorithm {
        let first = match &self.data {
            DataPrint::File { file } => Some(&file.first_mib),
            DataPrint::Directory { files, .. } => files.first().map(|f| &f.first_mib),
            _ => None,
        };
        let any = first
            .or(self.tokenizer.as_ref().map(|t| &t.tokenizer_json))
            .or(self.target.as_ref().map(|t| &t.config_json));
        match any {
            Some(h) if h.len() == 16 => ChecksumAlgorithm::Legacy,
            _ => ChecksumAlgorithm::Sha256,
        }
    }

    /// What differs between these inputs (of the run's start) and those `a` names now, in
    /// words, each with the input it concerns.
    fn changes(&self, a: &RunArgs) -> Vec<(Input, String)> {
        let mut out = Vec::new();
        let alg = self.algorithm();
        match data_print(a, alg) {
            Ok(now) => out.extend(data_change(&self.data, &now).map(|c| (Input::Data, c))),
            Err(e) => out.push((Input::Data, e.to_string())),
        }
        match tokenizer_print(a, alg) {
            Ok(now) => out.extend(
                tokenizer_change(self.tokenizer.as_ref(), now.as_ref())
                    .map(|c| (Input::Tokenizer, c)),
            ),
            Err(e) => out.push((Input::Tokenizer, e.to_string())),
        }
        match target_print(a, alg) {
            Ok(now) => out.extend(
                target_change(self.target.as_ref(), now.as_ref()).map(|c| (Input::Target, c)),
            ),
            Err(e) => out.push((Input::Target, e.to_string())),
        }
        out
    }
}

fn describe(d: &DataPrint) -> String {
    match d {
        DataPrint::Demo { .. } => "the demo data".into(),
        DataPrint::Stdin => "standard input".into(),
        DataPrint::Stream { path } => format!("the stream {path}"),
        DataPrint::File { file } => format!("the file {}", file.path),
        DataPrint::Directory { path, .. } => format!("the directory {path}"),
    }
}

/// How a file differs (same path), empty when it does not: its size, its first or last
/// MiB, or the bytes between them. The modification time counts only against a
/// fingerprint of an older version, which has no checksum of the whole content.
fn file_details(old: &FilePrint, new: &FilePrint) -> Vec<String> {
    let mut d = Vec::new();
    if old.size != new.size {
        d.push(format!("size {} → {}", old.size, new.size));
    }
    let by_content = old.content.is_some() && new.content.is_some();
    if !by_content && old.modified != new.modified {
        d.push(format!("modified {} → {}", old.modified, new.modified));
    }
    if old.first_mib != new.first_mib {
        d.push("its first MiB differs".into());
    }
    if old.last_mib != new.last_mib && old.size > END_BYTES {
        d.push("its last MiB differs".into());
    }
    if by_content && d.is_empty() && old.content != new.content {
        d.push("its bytes between its first and last MiB differ".into());
    }
    d
}

fn data_change(old: &DataPrint, new: &DataPrint) -> Option<String> {
    match (old, new) {
        _ if old == new => None,
        (DataPrint::Stdin, DataPrint::Stdin) => None,
        (DataPrint::File { file: o }, DataPrint::File { file: n }) if o.path == n.path => {
            let details = file_details(o, n);
            (!details.is_empty()).then(|| {
                format!(
                    "the data file {} changed since the run started ({})",
                    n.path,
                    details.join(", ")
                )
            })
        }
        (
            DataPrint::Directory { path: p, files: fo },
            DataPrint::Directory {
                path: q,
                files: fn_,
            },
        ) if p == q => {
            let name = |f: &FilePrint| {
                Path::new(&f.path)
                    .file_name()
                    .map_or(f.path.clone(), |n| n.to_string_lossy().into_owned())
            };
            let mut what = Vec::new();
            for f in fn_only(fn_, fo) {
                what.push(format!("{} added", name(f)));
            }
            for f in fn_only(fo, fn_) {
                what.push(format!("{} removed", name(f)));
            }
            for o in fo {
                if let Some(n) = fn_.iter().find(|n| n.path == o.path) {
                    let details = file_details(o, n);
                    if !details.is_empty() {
                        what.push(format!("{}: {}", name(n), details.join(", ")));
                    }
                }
            }
            if what.is_empty() {
                return None;
            }
            let n = what.len();
            let mut s = what.into_iter().take(3).collect::<Vec<_>>().join("; ");
            if n > 3 {
                s.push_str(&format!("; {} more", n - 3));
            }
            Some(format!(
                "the data directory {q} changed since the run started ({s})"
            ))
        }
        (DataPrint::Demo { .. }, DataPrint::Demo { .. }) => Some(format!(
            "the demo data changed since the run started ({} → {})",
            serde_json::to_string(old).unwrap_or_default(),
            serde_json::to_string(new).unwrap_or_default()
        )),
        _ => Some(format!(
            "the data is now {}, and was {} when the run started",
            describe(new),
            describe(old)
        )),
    }
}

/// The files of `a` whose path is not among `b`'s.
fn fn_only<'a>(a: &'a [FilePrint], b: &[FilePrint]) -> impl Iterator<Item = &'a FilePrint> {
    let b: HashSet<String> = b.iter().map(|f| f.path.clone()).collect();
    a.iter().filter(move |f| !b.contains(&f.path))
}

fn tokenizer_change(old: Option<&TokenizerPrint>, new: Option<&TokenizerPrint>) -> Option<String> {
    match (old, new) {
        // No tokenizer at the start (pre-tokenized data, the tiny target): one that
        // appeared since changes nothing that was computed.
        (None, _) => None,
        (Some(o), None) => Some(format!(
            "the run started with the tokenizer of {}, and none is found now (expected --tokenizer DIR or a --target with tokenizer.json)",
            o.dir
        )),
        (Some(o), Some(n)) => {
            let mut what = Vec::new();
            if o.tokenizer_json != n.tokenizer_json {
                what.push(format!("{}/tokenizer.json", n.dir));
            }
            if o.chat_template != n.chat_template {
                what.push(format!("the chat template of {}", n.dir));
            }
            if what.is_empty() {
                return None;
            }
            let moved = if o.dir != n.dir {
                format!("; the run started with {}", o.dir)
            } else {
                String::new()
            };
            Some(format!(
                "{} changed since the run started{moved}",
                what.join(" and ")
            ))
        }
    }
}

fn target_change(old: Option<&TargetPrint>, new: Option<&TargetPrint>) -> Option<String> {
    match (old, new) {
        (None, None) => None,
        (Some(o), Some(n)) => {
            let mut what = Vec::new();
            if o.config_json != n.config_json {
                what.push("config.json".to_string());
            }
            if (&o.weights_file, &o.weights) != (&n.weights_file, &n.weights) {
                what.push(n.weights_file.clone().or(o.weights_file.clone()).map_or(
                    "its weights".into(),
                    |f| {
                        if f.ends_with("index.json") {
                            f
                        } else {
                            format!("{f}'s header")
                        }
                    },
                ));
            }
            (!what.is_empty()).then(|| {
                format!(
                    "the target {} changed since the run started ({} differ{})",
                    n.dir,
                    what.join(" and "),
                    if what.len() == 1 { "s" } else { "" }
                )
            })
        }
        (o, n) => Some(format!(
            "the target is now {}, and was {} when the run started",
            n.map_or("the built-in tiny one".into(), |t| t.dir.clone()),
            o.map_or("the built-in tiny one".into(), |t| t.dir.clone())
        )),
    }
}

/// Compare the inputs `a` names with those of the run's start (`saved`); returns the
/// fingerprint to record from now on. A change is refused (one line naming it) unless
/// `--allow-changed-data`, which continues with a warning per change.
/// Inputs that changed since the run started: each change in words, with the input it
/// concerns.
#[derive(Debug, PartialEq, thiserror::Error)]
#[error("{}; expected the same {}, or --allow-changed-data to continue knowingly", self.described(), self.inputs())]
pub struct InputsChanged {
    changes: Vec<(Input, String)>,
}

impl InputsChanged {
    fn described(&self) -> String {
        self.changes
            .iter()
            .map(|(_, c)| c.as_str())
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// The inputs that changed, each named once: "data and target".
    fn inputs(&self) -> String {
        let mut whats: Vec<&str> = Vec::new();
        for (w, _) in &self.changes {
            if !whats.contains(&w.name()) {
                whats.push(w.name());
            }
        }
        whats.join(" and ")
    }
}

fn check_inputs(saved: Option<&Inputs>, a: &RunArgs) -> Result<Option<Inputs>, InputsChanged> {
    let Some(saved) = saved else {
        log::info!("{RUN_FILE} holds no fingerprint of the inputs (a run started by an older dflash-supervise): they are not checked, and are recorded now");
        return Ok(Inputs::of(a).ok());
    };
    let changes = saved.changes(a);
    if changes.is_empty() {
        // An older version's fingerprint (no checksum of the whole content, so it compared
        // the modification time): the one taken now, by content, from now on.
        if !saved.by_content() {
            if let Ok(now) = Inputs::of(a) {
                return Ok(Some(now));
            }
        }
        return Ok(Some(saved.clone()));
    }
    if a.allow_changed_data {
        for (what, c) in &changes {
            log::warn!(
                "--allow-changed-data: {c}; continuing with the {} as it is now",
                what.name()
            );
        }
        // From now on the inputs are those accepted here.
        return Ok(Some(Inputs::of(a).unwrap_or_else(|_| saved.clone())));
    }
    Err(InputsChanged { changes })
}

// ---------------------------------------------------------------------------------------
// The checkpoint to continue from.

/// A stopped run to continue: its settings are loaded and its inputs checked; which
/// checkpoint it continues from is chosen by [`Prepared::select`] once the drafter is known.
pub struct Prepared {
    pub dir: PathBuf,
    /// Its complete checkpoints (`step-N` with a meta.json), oldest first.
    candidates: Vec<(u64, PathBuf)>,
    inputs: Option<Inputs>,
}

/// What the checkpoints of a stopped run come to (see [`Prepared::select`]).
pub enum Selected {
    /// A checkpoint to continue from.
    Train(Box<Resume>),
    /// Its newest checkpoint that verifies is at its `--steps`: nothing to train, but its
    /// end may be unfinished (see [`Reached::finish`]).
    Reached(Reached),
}

/// Why a resume is refused, beyond a flag or an input that changed (exit 2).
#[derive(Debug, thiserror::Error)]
pub enum ResumeError {
    /// A checkpoint of a newer format: a newer dflash-supervise trained this run, and
    /// passing over its checkpoint would throw its steps away.
    #[error(
        "{} was written by a newer dflash-supervise (checkpoint format {format}; this one, {}, reads format {}): \
         nothing was set aside; use the newer dflash-supervise to resume this run",
        checkpoint.display(),
        env!("CARGO_PKG_VERSION"),
        dflash_shared::checkpoint::FORMAT_VERSION
    )]
    NewerCheckpoint { checkpoint: PathBuf, format: u64 },
}

/// A checkpoint to continue from.
pub struct Resume {
    pub dir: PathBuf,
    pub step: u64,
    pub checkpoint: PathBuf,
    pub consumed: HashSet<u64>,
    /// The fingerprint of the inputs to record in run.json.
    pub inputs: Option<Inputs>,
    /// Newer checkpoints that were refused, set aside by [`Resume::set_aside_refused`].
    pub refused: Vec<PathBuf>,
    /// The learning-rate schedule the checkpoint was trained under (its meta.json's
    /// `supervisor.settings.schedule`; `None` from an older version).
    pub schedule: Option<serde_json::Value>,
}

/// Load `dir`'s saved settings into `args` (flags given on this command line, `given`,
/// win where they may, see [`merge`]), check that its inputs did not change since it
/// started, and list its complete checkpoints.
pub fn prepare(dir: &Path, args: &mut RunArgs, given: &[String]) -> Result<Prepared, Error> {
    let usage = |msg: String| Error::Flag(format!("--resume {}: {msg}", dir.display()));
    let text = std::fs::read_to_string(dir.join(RUN_FILE)).map_err(|e| {
        usage(format!(
            "cannot read {RUN_FILE}: {e} (expected the run directory of a dflash-supervise run)"
        ))
    })?;
    let saved: SavedRun =
        serde_json::from_str(&text).map_err(|e| usage(format!("{RUN_FILE} is not valid: {e}")))?;
    let (mut merged, notes) = merge(
        saved,
        &SavedRun::of(args).map_err(|e| usage(e.to_string()))?,
        given,
    )
    .map_err(|e| usage(e.to_string()))?;
    for n in notes {
        log::info!("resuming with {n}");
    }
    let saved_inputs = merged.inputs.take();
    merged.apply(args).map_err(|e| usage(e.to_string()))?;
    let ckpts = dir.join("checkpoints");
    // Complete checkpoints only: `step-N`, not a `step-N.tmp-PID` a crash left behind.
    let mut candidates: Vec<(u64, PathBuf)> = std::fs::read_dir(&ckpts)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let step = dflash_shared::checkpoint::step_of_dir(&e.file_name().to_string_lossy())?;
            e.path()
                .join("meta.json")
                .is_file()
                .then(|| (step, e.path()))
        })
        .collect();
    candidates.sort();
    if candidates.is_empty() {
        return Err(usage(
            "no checkpoint in it yet (expected checkpoints/step-N/ with meta.json)".into(),
        ));
    }
    let inputs = check_inputs(saved_inputs.as_ref(), args).map_err(|e| usage(e.to_string()))?;
    Ok(Prepared {
        dir: dir.to_path_buf(),
        candidates,
        inputs,
    })
}

impl Prepared {
    /// The step of the newest complete checkpoint (verified or not).
    pub fn newest_step(&self) -> Option<u64> {
        self.candidates.last().map(|(s, _)| *s)
    }

    /// The newest checkpoint that verifies (checksums, finite values, format, its step)
    /// and is one of `drafter`: a changed, damaged or foreign one is passed over with a
    /// warning rather than loaded, or looped on; one written by a newer dflash-supervise
    /// (a newer format) is refused, nothing set aside. `steps`: the run's `--steps`, which
    /// must lie beyond it, or be its step ([`Selected::Reached`]).
    pub fn select(self, drafter: &DrafterConfig, steps: Option<u64>) -> Result<Selected, Error> {
        let dir = self.dir;
        let usage = |msg: String| Error::Flag(format!("--resume {}: {msg}", dir.display()));
        let expected = serde_json::to_value(drafter).ok();
        let mut candidates = self.candidates;
        let mut refused = Vec::new();
        let mut reasons = Vec::new();
        let (step, checkpoint) = loop {
            let Some((_, c)) = candidates.pop() else {
                return Err(usage(format!(
                    "no checkpoint verifies: {}",
                    reasons.join("; ")
                )));
            };
            match dflash_shared::checkpoint::verify(&c, expected.as_ref()) {
                Ok(step) => break (step, c),
                Err(dflash_shared::checkpoint::Refused {
                    problem: dflash_shared::checkpoint::Problem::NewerFormat { format },
                    ..
                }) => {
                    return Err(Error::input(
                        format!("--resume {}", dir.display()),
                        ResumeError::NewerCheckpoint {
                            checkpoint: c,
                            format,
                        },
                    ))
                }
                Err(e) => {
                    log::warn!(
                        "not resuming from {}: {e}; trying the one before it",
                        c.display()
                    );
                    reasons.push(e.to_string());
                    refused.push(c);
                }
            }
        };
        if steps == Some(step) {
            return Ok(Selected::Reached(Reached {
                dir,
                step,
                checkpoint,
            }));
        }
        if let Some(n) = steps {
            if n < step {
                return Err(usage(format!(
                    "its checkpoint is at step {step}, and --steps is {n}: nothing to train (expected a larger --steps; to write the drafter of that checkpoint: dflash-supervise export {})",
                    crate::shell::quote(&dir)
                )));
            }
        }
        let meta: serde_json::Value = std::fs::read_to_string(checkpoint.join("meta.json"))
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .ok_or_else(|| usage(format!("{}/meta.json is not valid", checkpoint.display())))?;
        let sup = &meta["supervisor"];
        let below = sup["consumed_below"].as_u64().unwrap_or(0);
        let mut consumed: HashSet<u64> = (0..below).collect();
        consumed.extend(
            sup["consumed_extra"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|v| v.as_u64()),
        );
        let schedule = Some(sup["settings"]["schedule"].clone()).filter(|s| s.is_object());
        Ok(Selected::Train(Box::new(Resume {
            dir,
            step,
            checkpoint,
            consumed,
            inputs: self.inputs,
            refused,
            schedule,
        })))
    }
}

/// Written into the run directory when a run ends by itself (its steps or its data
/// done, exit 0): a `--resume` of it then says so instead of starting workers again.
pub const FINISHED_FILE: &str = "finished.json";

/// What a run's end records in [`FINISHED_FILE`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Finished {
    /// The step of its last checkpoint (the one exported).
    pub step: u64,
    /// Why it ended, in words ("data done", "step limit reached").
    pub reason: String,
    /// Where its drafter was written.
    pub drafter: Option<String>,
}

impl Finished {
    pub fn write(&self, run_dir: &Path) -> std::io::Result<()> {
        let text = serde_json::to_string_pretty(self).map_err(std::io::Error::other)?;
        std::fs::write(run_dir.join(FINISHED_FILE), text)
    }
}

/// `Some(words)` when the run in `dir` already ended by itself at its newest checkpoint
/// (of step `newest`) and `steps` asks for nothing beyond it: there is nothing to resume.
/// A resume that does train (a larger `--steps`) removes the stale record once it
/// starts ([`Resume::forget_finished`]); one refused leaves it. A record that cannot be
/// read or parsed is said so (a warning naming the file) and taken as none: the run is
/// not finished.
pub fn finished(dir: &Path, newest: u64, steps: Option<u64>) -> Option<String> {
    let path = dir.join(FINISHED_FILE);
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => {
            log::warn!(
                "{} cannot be read ({e}): the run is taken as not finished",
                path.display()
            );
            return None;
        }
    };
    let f: Finished = match serde_json::from_str(&text) {
        Ok(f) => f,
        Err(e) => {
            log::warn!(
                "{} is not a record of a run's end ({e}): the run is taken as not finished",
                path.display()
            );
            return None;
        }
    };
    if f.step != newest || steps.is_some_and(|n| n > f.step) {
        return None;
    }
    let drafter = match &f.drafter {
        Some(d) if Path::new(d).join("config.json").is_file() => {
            format!("its drafter (step {}) is in {d}", f.step)
        }
        _ => format!(
            "write its drafter with: dflash-supervise export {}",
            crate::shell::quote(dir)
        ),
    };
    Some(format!(
        "{} already finished at step {} ({}): nothing to resume; {drafter} (to train on, give a larger --steps)",
        dir.display(),
        f.step,
        f.reason
    ))
}

/// Where a run writes its drafter, in its run directory.
pub const DRAFTER_DIR: &str = "drafter";

/// A stopped run whose newest checkpoint that verifies is at its `--steps`: its last
/// session trained every step but did not finish (its export failed, a worker was killed
/// at the stop: exit 1 or 3), so it has no [`FINISHED_FILE`].
pub struct Reached {
    pub dir: PathBuf,
    pub step: u64,
    pub checkpoint: PathBuf,
}

/// The step of the drafter exported in `out` (its config.json's `dflash_training.step`),
/// when it was written after `checkpoint` (an export of an earlier lineage's checkpoint of
/// the same step is older than it).
fn exported_step(out: &Path, checkpoint: &Path) -> Option<u64> {
    let config = out.join("config.json");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config).ok()?).ok()?;
    let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let meta = checkpoint.join(dflash_shared::checkpoint::META_FILE);
    (modified(&config)? >= modified(&meta)?).then_some(())?;
    v["dflash_training"]["step"].as_u64()
}

impl Reached {
    /// Finish what the last session left undone, as its end would have: export the
    /// drafter of the checkpoint (through the export tool a run's end uses; `target`: the
    /// run's target directory) unless `RUN_DIR/drafter` already holds it, and write
    /// [`FINISHED_FILE`]. Returns the line that says so. The caller holds the run
    /// directory's lock. `cancel`: a stop signal came (the export stops; exit 130).
    pub fn finish(
        &self,
        worker_bin: &Path,
        target: &Path,
        cancel: &dyn Fn() -> bool,
    ) -> Result<String, Error> {
        let dir = self.dir.canonicalize().unwrap_or_else(|_| self.dir.clone());
        let out = dir.join(DRAFTER_DIR);
        let drafter = if exported_step(&out, &self.checkpoint) == Some(self.step) {
            format!("its drafter (step {}) is in {}", self.step, out.display())
        } else {
            log::info!(
                "{} trained its --steps {} but its last session did not finish: exporting the drafter of {}",
                dir.display(),
                self.step,
                self.checkpoint.display()
            );
            let stopped = std::cell::Cell::new(false);
            let stop = || {
                let s = cancel();
                stopped.set(stopped.get() || s);
                s
            };
            let limit = crate::export_tool::EXPORT_TIMEOUT;
            let step = crate::export_tool::export_checkpoint(
                worker_bin,
                &self.checkpoint,
                target,
                &out,
                limit,
                &stop,
            )
            .map_err(|e| match e {
                crate::export_tool::ExportError::Stopped { out, .. } if stopped.get() => {
                    Error::ExportInterrupted { out }
                }
                e => Error::Export(e),
            })?;
            format!("drafter (step {step}) written to {}", out.display())
        };
        let record = Finished {
            step: self.step,
            reason: "step limit reached".into(),
            drafter: Some(out.display().to_string()),
        };
        if let Err(e) = record.write(&dir) {
            log::warn!("cannot write {}: {e}", dir.join(FINISHED_FILE).display());
        }
        Ok(format!(
            "{} had trained its --steps {} but its last session ended before finishing (no {FINISHED_FILE}): {drafter}; finished now, nothing to resume (to train on, give a larger --steps)",
            dir.display(),
            self.step
        ))
    }
}

impl Resume {
    /// Remove the record of an earlier end ([`FINISHED_FILE`]): this resume trains on, so
    /// the run is not finished until it ends again. Call once the run directory is this
    /// supervisor's.
    pub fn forget_finished(&self) {
        let path = self.dir.join(FINISHED_FILE);
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                log::warn!("cannot remove {}: {e}", path.display())
            }
            _ => {}
        }
    }

    /// `checkpoints/best` when the checkpoint it names is gone (a newer one this resume
    /// set aside as refused, or one removed by hand): pointed at the best-scored
    /// checkpoint left of the lineage resumed (`scores`: step → eval acceptance or τ, as
    /// train.jsonl records them; ties: the earliest, as the run chooses), or removed when
    /// none is left; one line says which. Call once the run directory is this
    /// supervisor's, after [`Resume::set_aside_refused`].
    pub fn repair_best_link(&self, scores: &std::collections::BTreeMap<u64, f64>) {
        use crate::training::eval;
        let checkpoints = self.dir.join("checkpoints");
        let Some(gone) = eval::dangling_best(&checkpoints) else {
            return;
        };
        let link = checkpoints.join(eval::BEST_LINK);
        let complete = |s: u64| {
            checkpoints
                .join(format!("step-{s:08}"))
                .join(dflash_shared::checkpoint::META_FILE)
                .is_file()
        };
        let best = scores
            .iter()
            .filter(|&(&s, _)| s <= self.step && complete(s))
            .fold(None, |b: Option<(u64, f64)>, (&s, &a)| match b {
                Some((_, ba)) if ba >= a => b,
                _ => Some((s, a)),
            });
        let was = format!(
            "{} pointed at step-{gone:08}, which is no longer there",
            link.display()
        );
        if let Some((step, _)) = best {
            match eval::link_best(&checkpoints, step) {
                Ok(()) => {
                    log::warn!("{was}: now at step-{step:08}, the best checkpoint left");
                    return;
                }
                Err(e) => log::warn!("cannot point {} at step-{step:08}: {e}", link.display()),
            }
        }
        match std::fs::remove_file(&link) {
            Ok(()) => log::warn!("{was}: removed (the next best eval sets it again)"),
            Err(e) => log::warn!("{was}, and it cannot be removed: {e}"),
        }
    }

    /// Move the newer checkpoints that were refused out of `checkpoints/` (into
    /// `RUN_DIR/refused-checkpoints/`): otherwise they would count among the newest
    /// `--keep-checkpoints` and have the one this run continues from pruned, and every
    /// later resume would meet them again. Call once the run directory is this
    /// supervisor's (locked).
    pub fn set_aside_refused(&self) {
        if self.refused.is_empty() {
            return;
        }
        let aside = self.dir.join(REFUSED_DIR);
        let _ = std::fs::create_dir_all(&aside);
        let ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        for c in &self.refused {
            let name = c
                .file_name()
                .map_or("checkpoint".into(), |n| n.to_string_lossy().into_owned());
            let dst = aside.join(format!("{name}-{ms}"));
            match std::fs::rename(c, &dst) {
                Ok(()) => log::warn!("{} set aside: moved to {}", c.display(), dst.display()),
                Err(e) => log::warn!("cannot move {} aside: {e}", c.display()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn args(extra: &[&str]) -> RunArgs {
        crate::cli::run_args(extra)
    }

    fn of(a: &RunArgs) -> SavedRun {
        SavedRun::of(a).unwrap()
    }

    /// The settings of `m` as a run would use them (over the defaults).
    fn s(m: &SavedRun) -> RunArgs {
        let mut a = args(&[]);
        m.clone().apply(&mut a).unwrap();
        a
    }

    fn given(ids: &[&str]) -> Vec<String> {
        ids.iter().map(|s| s.to_string()).collect()
    }

    fn saved() -> SavedRun {
        of(&args(&[
            "--data",
            "demo",
            "--steps",
            "3",
            "--max-seq-len",
            "64",
            "--block-size",
            "8",
        ]))
    }

    #[test]
    fn without_flags_the_saved_settings_are_used() {
        let (m, notes) = merge(saved(), &of(&args(&[])), &[]).unwrap();
        assert_eq!(s(&m).steps, Some(3));
        assert_eq!(
            s(&m).max_seq_len,
            64,
            "a default value not given on the command line does not count"
        );
        assert_eq!(s(&m).block_size, Some(8));
        assert!(notes.is_empty());
    }

    #[test]
    fn the_target_engine_is_kept_by_a_resume_and_replaced_by_one_that_gives_it() {
        let saved = of(&args(&["--data", "demo", "--target-engine", "torch"]));
        let mut a = args(&[]);
        let (m, notes) = merge(saved.clone(), &of(&a), &[]).unwrap();
        assert!(notes.is_empty(), "{notes:?}");
        m.apply(&mut a).unwrap();
        assert_eq!(a.target_engine, crate::cli::TargetEngine::Torch);
        let now = of(&args(&["--target-engine", "native"]));
        let (m, notes) = merge(saved, &now, &given(&["target_engine"])).unwrap();
        assert_eq!(s(&m).target_engine, crate::cli::TargetEngine::Native);
        assert_eq!(notes, ["--target-engine native replaces this run's torch"]);
        // A run.json of a version without the field: this command line's engine holds.
        let mut old = serde_json::to_value(of(&args(&["--data", "demo"]))).unwrap();
        old.as_object_mut().unwrap().remove("target_engine");
        let old: SavedRun = serde_json::from_value(old).unwrap();
        let mut a = args(&["--target-engine", "torch"]);
        old.apply(&mut a).unwrap();
        assert_eq!(a.target_engine, crate::cli::TargetEngine::Torch);
    }

    #[test]
    fn given_steps_and_lr_win_over_the_saved_ones() {
        let now = of(&args(&[
            "--steps",
            "6",
            "--lr",
            "1e-3",
            "--max-bad-lines",
            "50",
        ]));
        let (m, notes) = merge(saved(), &now, &given(&["steps", "lr", "max_bad_lines"])).unwrap();
        let a = s(&m);
        assert_eq!((a.steps, a.lr, a.max_bad_lines), (Some(6), Some(1e-3), 50));
        assert_eq!(notes.len(), 3, "{notes:?}");
        assert!(
            notes.iter().any(|n| n == "--steps 6 replaces this run's 3"),
            "{notes:?}"
        );
    }

    #[test]
    fn a_given_setting_that_would_change_the_run_is_refused_unless_it_is_the_same() {
        let now = of(&args(&["--block-size", "4"]));
        let e = merge(saved(), &now, &given(&["block_size"]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--block-size 4 differs from this run's 8") && e.contains("--steps"),
            "{e}"
        );
        let now = of(&args(&["--max-seq-len", "32"]));
        let e = merge(saved(), &now, &given(&["max_seq_len"]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--max-seq-len 32 differs from this run's 64"),
            "{e}"
        );
        let now = of(&args(&["--data", "/other.jsonl"]));
        assert!(merge(saved(), &now, &given(&["data"]))
            .unwrap_err()
            .to_string()
            .contains("--data /other.jsonl differs from this run's demo"));
        // The same value again is fine.
        let now = of(&args(&["--block-size", "8", "--max-seq-len", "64"]));
        merge(saved(), &now, &given(&["block_size", "max_seq_len"])).unwrap();
    }

    #[test]
    fn operational_settings_are_kept_on_resume_and_win_when_given_again() {
        let saved = of(&args(&[
            "--checkpoint-every",
            "5",
            "--keep-checkpoints",
            "2",
            "--time-limit",
            "30s",
            "--hang-timeout",
            "10s",
            "--step-timeout",
            "20m",
            "--max-restarts",
            "3",
            "--snapshot-every",
            "4",
            "--tokenizer",
            "/tok",
            "--prefetch",
            "3",
            "--collective",
            "shm",
            "--preflight-lines",
            "0",
        ]));
        // Not given again: the saved ones hold.
        let (m, notes) = merge(saved.clone(), &of(&args(&[])), &[]).unwrap();
        assert!(notes.is_empty(), "{notes:?}");
        let mut a = args(&[]);
        m.apply(&mut a).unwrap();
        assert_eq!(a.checkpoint_every, 5);
        assert_eq!(a.keep_checkpoints, 2);
        assert_eq!(a.time_limit, Some(Duration::from_secs(30)));
        assert_eq!(a.hang_timeout, Duration::from_secs(10));
        assert_eq!(a.step_timeout, Some(Duration::from_secs(1200)));
        assert_eq!(a.max_restarts, 3);
        assert_eq!(a.snapshot_every, Some(4));
        assert_eq!(a.tokenizer, Some(PathBuf::from("/tok")));
        assert_eq!((a.prefetch, a.collective.as_str()), (3, "shm"));
        assert_eq!(a.preflight_lines, 0);
        // Given again: they win, each with a note.
        let now = of(&args(&[
            "--time-limit",
            "2h",
            "--checkpoint-every",
            "7",
            "--hang-timeout",
            "90s",
            "--step-timeout",
            "1h",
            "--tokenizer",
            "/moved/tok",
        ]));
        let (m, notes) = merge(
            saved,
            &now,
            &given(&[
                "time_limit",
                "checkpoint_every",
                "hang_timeout",
                "tokenizer",
            ]),
        )
        .unwrap();
        for n in [
            "--time-limit 2h replaces this run's 30s",
            "--checkpoint-every 7 replaces this run's 5",
            "--hang-timeout 1m 30s replaces this run's 10s",
            "--step-timeout 1h replaces this run's 20m",
            "--tokenizer /moved/tok replaces this run's /tok",
        ] {
            assert!(notes.iter().any(|x| x == n), "{n}: {notes:?}");
        }
        let mut a = args(&[]);
        m.apply(&mut a).unwrap();
        assert_eq!(
            (a.checkpoint_every, a.time_limit, a.keep_checkpoints),
            (7, Some(Duration::from_secs(7200)), 2)
        );
    }

    #[test]
    fn a_run_json_of_an_older_version_still_loads_and_this_command_line_fills_the_rest() {
        let old = r#"{"target": "tiny", "taps": null, "draft_layers": null, "data": "demo",
            "token_budget": 512, "max_seq_len": 64, "seed": 0, "epochs": 20, "max_bad_lines": 10,
            "shuffle_window": 4096, "demo_samples": 1024, "steps": 3, "lr": null,
            "warmup_ratio": null, "block_size": null, "max_anchors": null}"#;
        let saved: SavedRun = serde_json::from_str(old).unwrap();
        assert!(saved.inputs.is_none() && !saved.settings.contains_key("checkpoint_every"));
        let (m, _) = merge(saved.clone(), &of(&args(&[])), &[]).unwrap();
        let mut a = args(&["--checkpoint-every", "9", "--time-limit", "1m"]);
        m.apply(&mut a).unwrap();
        assert_eq!(a.steps, Some(3));
        assert_eq!(a.checkpoint_every, 9, "nothing saved: this command line's");
        assert_eq!(a.hang_timeout, Duration::from_secs(60), "the default");
        let now = of(&args(&["--checkpoint-every", "9", "--time-limit", "1m"]));
        let (m, notes) = merge(saved, &now, &given(&["checkpoint_every", "time_limit"])).unwrap();
        assert_eq!(notes.len(), 2, "{notes:?}");
        assert_eq!(
            (s(&m).checkpoint_every, s(&m).time_limit),
            (9, Some(Duration::from_secs(60)))
        );
    }

    #[test]
    fn every_setting_goes_through_run_json_and_back_and_no_session_flag_is_saved() {
        let a = args(&[
            "--gpus",
            "cpu:3",
            "--run-dir",
            "/r",
            "--tee",
            "--steps",
            "4",
            "--lr",
            "1e-3",
            "--taps",
            "1,2",
            "--time-limit",
            "2h",
            "--target-engine",
            "native",
            "--wandb-project",
            "p",
            "--log-max-size",
            "1MiB",
            "--eval-timeout",
            "90s",
        ]);
        let text = serde_json::to_string(&of(&a)).unwrap();
        let back: SavedRun = serde_json::from_str(&text).unwrap();
        let mut b = args(&[]);
        back.clone().apply(&mut b).unwrap();
        assert_eq!(settings_of(&b.settings).unwrap(), of(&a).settings);
        assert_eq!(back.settings.len(), 50, "{:?}", back.settings.keys());
        for session in ["gpus", "run_dir", "tee", "resume", "targets", "prometheus"] {
            assert!(!back.settings.contains_key(session), "{session} is saved");
        }
        assert_eq!(b.steps, Some(4));
        assert_eq!(b.taps, Some(vec![1, 2]));
        assert_eq!(b.log_max_size, 1 << 20);
    }

    #[test]
    fn the_optional_settings_are_the_flags_without_a_default_and_none_until_given() {
        let defaults = of(&args(&[])).settings;
        let null: HashSet<String> = defaults
            .iter()
            .filter(|(_, v)| v.is_null())
            .map(|(k, _)| k.clone())
            .collect();
        let optional = optional_settings();
        assert_eq!(null, optional);
        assert!(optional.contains("steps") && optional.contains("taps"));
        assert!(!optional.contains("max_seq_len") && !optional.contains("hang_timeout"));
    }

    #[test]
    fn run_json_keeps_durations_readable_and_reads_them_back() {
        let d = tempfile::tempdir().unwrap();
        let a = args(&["--time-limit", "90m", "--stop-timeout", "2s"]);
        save(&a, None, d.path(), serde_json::Value::Null, None).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(d.path().join(RUN_FILE)).unwrap())
                .unwrap();
        assert_eq!(v["time_limit"], "1h 30m");
        assert_eq!(v["stop_timeout"], "2s");
        assert_eq!(v["inputs"]["data"]["kind"], "demo", "{v}");
        let back: SavedRun = serde_json::from_value(v).unwrap();
        assert_eq!(s(&back).time_limit, Some(Duration::from_secs(5400)));
        assert_eq!(s(&back).collective_timeout, Duration::from_secs(300));
    }

    fn data_args(data: &Path, extra: &[&str]) -> RunArgs {
        let mut v = vec!["--data", data.to_str().unwrap()];
        v.extend(extra);
        args(&v)
    }

    fn lines(n: usize) -> String {
        (0..n)
            .map(|i| format!("{{\"input_ids\": [1, 2, 3, {}]}}\n", i % 500))
            .collect()
    }

    #[test]
    fn a_data_file_changed_in_place_is_refused_naming_it_unless_allowed() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("a.jsonl");
        std::fs::write(&f, lines(20)).unwrap();
        let mut a = data_args(&f, &[]);
        let start = Inputs::of(&a).unwrap();
        assert_eq!(check_inputs(Some(&start), &a), Ok(Some(start.clone())));
        std::fs::write(&f, lines(25)).unwrap();
        let e = check_inputs(Some(&start), &a).unwrap_err().to_string();
        let abs = f.canonicalize().unwrap();
        assert!(
            e.contains(&format!(
                "the data file {} changed since the run started (size {} → {}",
                abs.display(),
                lines(20).len(),
                lines(25).len()
            )) && e
                .ends_with("expected the same data, or --allow-changed-data to continue knowingly"),
            "{e}"
        );
        a.allow_changed_data = true;
        let now = check_inputs(Some(&start), &a).unwrap().unwrap();
        assert_ne!(now, start, "what was accepted is recorded");
        assert_eq!(now, Inputs::of(&a).unwrap());
    }

    #[test]
    fn a_fingerprint_by_the_legacy_hash_is_compared_with_that_hash() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("a.jsonl");
        std::fs::write(&f, lines(20)).unwrap();
        let a = data_args(&f, &[]);
        let old = Inputs::of_with(&a, ChecksumAlgorithm::Legacy).unwrap();
        let new = Inputs::of(&a).unwrap();
        assert_ne!(old, new, "the checksums differ by algorithm");
        let DataPrint::File { file } = &new.data else {
            panic!("{new:?}")
        };
        assert_eq!(file.first_mib.len(), 64, "SHA-256 from now on");
        // The run.json of an older version: the same inputs are not a change.
        assert_eq!(check_inputs(Some(&old), &a), Ok(Some(old.clone())));
        // Other bytes of the same size are one, with that hash too.
        let modified = std::fs::metadata(&f).unwrap().modified().unwrap();
        std::fs::write(&f, lines(20).replace("[1, 2, 3,", "[1, 2, 4,")).unwrap();
        std::fs::File::options()
            .write(true)
            .open(&f)
            .unwrap()
            .set_modified(modified)
            .unwrap();
        let e = check_inputs(Some(&old), &a).unwrap_err().to_string();
        assert!(e.contains("(its first MiB differs)"), "{e}");
    }

    #[test]
    fn a_data_file_of_the_same_size_and_time_with_other_bytes_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("a.jsonl");
        std::fs::write(&f, lines(20)).unwrap();
        let t = std::time::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let set_time = || {
            std::fs::File::options()
                .write(true)
                .open(&f)
                .unwrap()
                .set_modified(t)
                .unwrap()
        };
        set_time();
        let a = data_args(&f, &[]);
        let start = Inputs::of(&a).unwrap();
        std::fs::write(&f, lines(20).replace("[1, 2, 3,", "[1, 2, 4,")).unwrap();
        set_time();
        let e = check_inputs(Some(&start), &a).unwrap_err().to_string();
        assert!(e.contains("(its first MiB differs)"), "{e}");
        // The same bytes again, at a new time (a copy staged anew): the same data.
        std::fs::write(&f, lines(20)).unwrap();
        assert_ne!(Inputs::of(&a).unwrap(), start, "another time is recorded");
        assert_eq!(check_inputs(Some(&start), &a), Ok(Some(start.clone())));
        // The fingerprint of an older version (no checksum of the whole content) compares
        // the time, as that version did; once it passes, the one by content is recorded.
        let mut old = start.clone();
        let DataPrint::File { file } = &mut old.data else {
            panic!("{old:?}")
        };
        file.content = None;
        let e = check_inputs(Some(&old), &a).unwrap_err().to_string();
        assert!(e.contains("(modified 2023-11-14T22:13:20"), "{e}");
        set_time();
        assert_eq!(check_inputs(Some(&old), &a), Ok(Some(start.clone())));
    }

    #[test]
    fn a_change_between_the_first_and_last_mib_of_a_data_file_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("big.jsonl");
        let mut bytes = vec![b'x'; 3 << 20];
        std::fs::write(&f, &bytes).unwrap();
        let a = data_args(&f, &[]);
        let start = Inputs::of(&a).unwrap();
        bytes[3 << 19] = b'y';
        std::fs::write(&f, &bytes).unwrap();
        let e = check_inputs(Some(&start), &a).unwrap_err().to_string();
        assert!(
            e.contains("(its bytes between its first and last MiB differ)"),
            "{e}"
        );
        // In a directory, likewise; touched only, it is the same.
        let dir_args = data_args(d.path(), &[]);
        let start = Inputs::of(&dir_args).unwrap();
        bytes[3 << 19] = b'x';
        std::fs::write(&f, &bytes).unwrap();
        let e = check_inputs(Some(&start), &dir_args)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("big.jsonl: its bytes between its first and last MiB differ"),
            "{e}"
        );
        let start = Inputs::of(&dir_args).unwrap();
        std::fs::write(&f, &bytes).unwrap();
        assert_eq!(
            check_inputs(Some(&start), &dir_args),
            Ok(Some(start.clone()))
        );
    }

    #[test]
    fn a_data_directory_with_a_file_added_is_refused_and_another_data_kind_named() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("a.jsonl"), lines(5)).unwrap();
        std::fs::write(d.path().join("notes.txt"), "not data").unwrap();
        let a = data_args(d.path(), &[]);
        let start = Inputs::of(&a).unwrap();
        std::fs::write(d.path().join("notes.txt"), "still not data").unwrap();
        assert_eq!(check_inputs(Some(&start), &a), Ok(Some(start.clone())));
        std::fs::write(d.path().join("b.jsonl"), lines(5)).unwrap();
        let e = check_inputs(Some(&start), &a).unwrap_err().to_string();
        assert!(
            e.contains("changed since the run started (b.jsonl added)"),
            "{e}"
        );
        let e = check_inputs(Some(&start), &args(&["--data", "demo"]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("the data is now the demo data, and was the directory"),
            "{e}"
        );
        // A data file that is gone.
        let f = d.path().join("a.jsonl");
        let a = data_args(&f, &[]);
        let start = Inputs::of(&a).unwrap();
        std::fs::remove_file(&f).unwrap();
        let e = check_inputs(Some(&start), &a).unwrap_err().to_string();
        assert!(e.contains("cannot be read"), "{e}");
    }

    #[test]
    fn a_changed_tokenizer_chat_template_or_target_is_refused_but_a_moved_one_is_not() {
        let d = tempfile::tempdir().unwrap();
        let data = d.path().join("chat.jsonl");
        std::fs::write(&data, lines(3)).unwrap();
        let tok = d.path().join("tok");
        std::fs::create_dir_all(&tok).unwrap();
        std::fs::write(tok.join("tokenizer.json"), "{\"model\": {}}").unwrap();
        std::fs::write(
            tok.join("tokenizer_config.json"),
            "{\"chat_template\": \"{{ messages }}\"}",
        )
        .unwrap();
        let a = data_args(&data, &["--tokenizer", tok.to_str().unwrap()]);
        let start = Inputs::of(&a).unwrap();
        assert!(start.tokenizer.as_ref().unwrap().chat_template.is_some());
        // Moved elsewhere, the same files: accepted.
        let moved = d.path().join("tok2");
        std::fs::rename(&tok, &moved).unwrap();
        let b = data_args(&data, &["--tokenizer", moved.to_str().unwrap()]);
        assert!(check_inputs(Some(&start), &b).is_ok());
        std::fs::write(
            moved.join("tokenizer_config.json"),
            "{\"chat_template\": \"{{ messages }}!\"}",
        )
        .unwrap();
        let e = check_inputs(Some(&start), &b).unwrap_err().to_string();
        assert!(
            e.contains("the chat template of")
                && e.contains("changed since the run started")
                && e.contains("expected the same tokenizer and chat template"),
            "{e}"
        );
        // No tokenizer now where the run had one.
        let e = check_inputs(Some(&start), &data_args(&data, &[]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("none is found now"), "{e}");

        // The target: config.json and the single shard's header.
        let target = d.path().join("model");
        std::fs::create_dir_all(&target).unwrap();
        std::fs::write(target.join("config.json"), "{\"hidden_size\": 64}").unwrap();
        let one = 1f32.to_le_bytes();
        let w = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1], &one);
        let st = safetensors::serialize([("w", w.unwrap())], None).unwrap();
        std::fs::write(target.join("model.safetensors"), &st).unwrap();
        let a = args(&["--data", "demo", "--target", target.to_str().unwrap()]);
        let start = Inputs::of(&a).unwrap();
        assert_eq!(
            start.target.as_ref().unwrap().weights_file.as_deref(),
            Some("model.safetensors")
        );
        assert!(start.tokenizer.is_none(), "demo data: no chat");
        // The tensor data is not hashed, only the header.
        let mut same_header = st.clone();
        *same_header.last_mut().unwrap() ^= 1;
        std::fs::write(target.join("model.safetensors"), &same_header).unwrap();
        assert!(check_inputs(Some(&start), &a).is_ok());
        std::fs::write(target.join("config.json"), "{\"hidden_size\": 32}").unwrap();
        let e = check_inputs(Some(&start), &a).unwrap_err().to_string();
        assert!(
            e.contains("changed since the run started (config.json differs)")
                && e.ends_with(
                    "expected the same target, or --allow-changed-data to continue knowingly"
                ),
            "{e}"
        );
        // Without a fingerprint (an older run.json): nothing checked, the inputs recorded.
        assert_eq!(check_inputs(None, &a), Ok(Some(Inputs::of(&a).unwrap())));
    }

    fn tiny_drafter(layers: usize) -> DrafterConfig {
        let t = dflash_shared::model_config::TargetConfig::read(
            dflash_shared::model_config::TINY_CONFIG,
        )
        .unwrap();
        DrafterConfig::for_target(&t, layers, 2, 8, 32)
    }

    /// A checkpoint as the writers leave it, with `below` batches consumed.
    fn checkpoint(run: &Path, step: u64, drafter: &DrafterConfig, below: u64) -> PathBuf {
        let dir = run.join("checkpoints").join(format!("step-{step:08}"));
        std::fs::create_dir_all(&dir).unwrap();
        let data: Vec<u8> = [0.5f32, -1.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let params = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2], &data);
        let bytes = safetensors::serialize([("params", params.unwrap())], None).unwrap();
        std::fs::write(dir.join("state.safetensors"), &bytes).unwrap();
        let meta = serde_json::json!({
            "step": step,
            "drafter": drafter,
            "supervisor": {"consumed_below": below, "consumed_extra": []},
            "checksums": {"state.safetensors": dflash_shared::checkpoint::checksum_hex(&bytes)},
        });
        std::fs::write(
            dir.join("meta.json"),
            dflash_shared::checkpoint::finish_meta(&meta).unwrap(),
        )
        .unwrap();
        dir
    }

    fn resumable(run: &Path) {
        save(
            &args(&["--data", "demo", "--steps", "20"]),
            None,
            run,
            serde_json::Value::Null,
            None,
        )
        .unwrap();
    }

    fn edit_meta(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
        let p = dir.join("meta.json");
        let mut m: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        f(&mut m);
        std::fs::write(&p, serde_json::to_string_pretty(&m).unwrap()).unwrap();
    }

    #[test]
    fn resume_passes_over_foreign_damaged_edited_and_misnamed_checkpoints_for_the_one_before() {
        let d = tempfile::tempdir().unwrap();
        let run = d.path();
        resumable(run);
        let ours = tiny_drafter(2);
        checkpoint(run, 4, &ours, 8);
        // Newest first: another drafter's, a damaged state, an edited consumed count, one
        // in a directory named for another step.
        let foreign = checkpoint(run, 16, &tiny_drafter(3), 32);
        let damaged = checkpoint(run, 12, &ours, 24);
        let state = damaged.join("state.safetensors");
        let mut bytes = std::fs::read(&state).unwrap();
        *bytes.last_mut().unwrap() ^= 1;
        std::fs::write(&state, bytes).unwrap();
        let edited = checkpoint(run, 10, &ours, 20);
        edit_meta(&edited, |m| m["supervisor"]["consumed_below"] = 2.into());
        let misnamed = checkpoint(run, 6, &ours, 12);
        std::fs::rename(&misnamed, run.join("checkpoints").join("step-00000008")).unwrap();

        let mut a = args(&[]);
        let p = prepare(run, &mut a, &[]).unwrap();
        assert_eq!(a.steps, Some(20));
        let Selected::Train(r) = p.select(&ours, a.steps).unwrap() else {
            panic!("a checkpoint to train from")
        };
        assert_eq!(r.step, 4);
        assert_eq!(r.consumed, (0..8).collect());
        assert_eq!(r.refused.len(), 4, "{:?}", r.refused);
        r.set_aside_refused();
        let left: Vec<String> = std::fs::read_dir(run.join("checkpoints"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(left, ["step-00000004"], "the refused ones are set aside");
        assert_eq!(std::fs::read_dir(run.join(REFUSED_DIR)).unwrap().count(), 4);
        assert!(!foreign.exists());

        // Each reason on its own, with no older checkpoint to fall back on: one line each.
        for (make, want) in [
            (
                Box::new(|run: &Path| {
                    checkpoint(run, 4, &tiny_drafter(3), 8);
                }) as Box<dyn Fn(&Path)>,
                "a checkpoint of another drafter (layers 3, this run's 2)",
            ),
            (
                Box::new(|run: &Path| {
                    let c = checkpoint(run, 4, &tiny_drafter(2), 8);
                    edit_meta(&c, |m| m["supervisor"]["consumed_below"] = 9.into());
                }),
                "meta.json changed after it was written",
            ),
            (
                Box::new(|run: &Path| {
                    let c = checkpoint(run, 4, &tiny_drafter(2), 8);
                    std::fs::rename(&c, run.join("checkpoints").join("step-00000005")).unwrap();
                }),
                "a checkpoint of step 4 in a directory named for step 5",
            ),
        ] {
            let d = tempfile::tempdir().unwrap();
            resumable(d.path());
            make(d.path());
            let p = prepare(d.path(), &mut args(&[]), &[]).unwrap();
            let e = p
                .select(&ours, Some(20))
                .err()
                .expect("refused")
                .to_string();
            assert!(
                e.starts_with(&format!(
                    "--resume {}: no checkpoint verifies:",
                    d.path().display()
                )) && e.contains(want),
                "{want}: {e}"
            );
        }
    }

    #[test]
    fn a_checkpoint_at_the_step_limit_has_reached_it_and_one_beyond_it_is_refused() {
        let d = tempfile::tempdir().unwrap();
        resumable(d.path());
        let c = checkpoint(d.path(), 20, &tiny_drafter(2), 40);
        let mut a = args(&[]);
        let p = prepare(d.path(), &mut a, &[]).unwrap();
        let Selected::Reached(r) = p.select(&tiny_drafter(2), a.steps).unwrap() else {
            panic!("reached")
        };
        assert_eq!((r.step, &r.checkpoint), (20, &c));
        let p = prepare(d.path(), &mut args(&[]), &[]).unwrap();
        let e = p
            .select(&tiny_drafter(2), Some(12))
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("its checkpoint is at step 20, and --steps is 12: nothing to train"),
            "{e}"
        );
    }

    #[test]
    fn prepare_refuses_changed_data_before_any_checkpoint_is_chosen() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("a.jsonl");
        std::fs::write(&f, lines(10)).unwrap();
        let run = d.path().join("run");
        std::fs::create_dir_all(&run).unwrap();
        save(
            &data_args(&f, &["--steps", "20"]),
            None,
            &run,
            serde_json::Value::Null,
            None,
        )
        .unwrap();
        checkpoint(&run, 4, &tiny_drafter(2), 8);
        std::fs::write(&f, lines(11)).unwrap();
        let e = prepare(&run, &mut args(&[]), &[]).err().unwrap();
        assert_eq!(e.exit_code(), 2);
        let e = e.to_string();
        assert!(
            e.starts_with(&format!("--resume {}: the data file", run.display()))
                && e.contains("--allow-changed-data"),
            "{e}"
        );
        let mut a = args(&["--resume", run.to_str().unwrap(), "--allow-changed-data"]);
        let Selected::Train(r) = prepare(&run, &mut a, &[])
            .unwrap()
            .select(&tiny_drafter(2), a.steps)
            .unwrap()
        else {
            panic!("a checkpoint to train from")
        };
        assert_eq!(r.inputs, Some(Inputs::of(&a).unwrap()));
    }

    #[test]
    fn a_checkpoint_of_a_newer_format_refuses_the_resume_and_nothing_is_set_aside() {
        let d = tempfile::tempdir().unwrap();
        resumable(d.path());
        let ours = tiny_drafter(2);
        checkpoint(d.path(), 4, &ours, 8);
        let newer = checkpoint(d.path(), 8, &ours, 16);
        edit_meta(&newer, |m| m["format"] = 99.into());
        // Behind a damaged one, too: a newer dflash-supervise worked on this run.
        let damaged = checkpoint(d.path(), 12, &ours, 24);
        std::fs::write(damaged.join("state.safetensors"), b"nothing").unwrap();
        let p = prepare(d.path(), &mut args(&[]), &[]).unwrap();
        let e = p.select(&ours, Some(20)).err().expect("refused");
        assert_eq!(e.exit_code(), 2);
        let e = e.to_string();
        assert!(
            e.starts_with(&format!("--resume {}: {}", d.path().display(), newer.display()))
                && e.contains(&format!(
                    "was written by a newer dflash-supervise (checkpoint format 99; this one, {}, reads format 1)",
                    env!("CARGO_PKG_VERSION")
                ))
                && e.ends_with("use the newer dflash-supervise to resume this run"),
            "{e}"
        );
        assert!(newer.is_dir() && damaged.is_dir());
        assert!(!d.path().join(REFUSED_DIR).exists(), "nothing set aside");
    }

    #[test]
    fn a_corrupt_finished_record_is_taken_as_none_and_left_as_it_is() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join(FINISHED_FILE);
        std::fs::write(&path, "{\"step\": 2").unwrap();
        assert_eq!(finished(d.path(), 2, Some(2)), None);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "{\"step\": 2");
        Finished {
            step: 2,
            reason: "step limit reached".into(),
            drafter: None,
        }
        .write(d.path())
        .unwrap();
        let msg = finished(d.path(), 2, Some(2)).unwrap();
        assert!(msg.contains("already finished at step 2"), "{msg}");
    }

    #[test]
    fn a_dangling_best_link_is_pointed_at_the_best_checkpoint_left_or_removed() {
        let d = tempfile::tempdir().unwrap();
        resumable(d.path());
        let ours = tiny_drafter(2);
        for step in [4, 8] {
            checkpoint(d.path(), step, &ours, 2 * step);
        }
        let checkpoints = d.path().join("checkpoints");
        crate::training::eval::link_best(&checkpoints, 12).unwrap();
        let resume = |step: u64| Resume {
            dir: d.path().to_path_buf(),
            step,
            checkpoint: checkpoints.join(format!("step-{step:08}")),
            consumed: HashSet::new(),
            inputs: None,
            refused: Vec::new(),
            schedule: None,
        };
        let best = || crate::training::eval::best_step(&checkpoints);
        // Evals at 4 and 8 (equal: the earliest), 12 gone, 16 beyond the resumed step.
        let scores = [(4, 2.5), (8, 2.5), (12, 3.0), (16, 4.0)]
            .into_iter()
            .collect();
        resume(8).repair_best_link(&scores);
        assert_eq!(best(), Some(4));
        // A link to a checkpoint that is there is left alone.
        resume(8).repair_best_link(&Default::default());
        assert_eq!(best(), Some(4));
        // No eval of a checkpoint left: removed.
        crate::training::eval::link_best(&checkpoints, 12).unwrap();
        resume(8).repair_best_link(&[(12, 3.0)].into_iter().collect());
        assert_eq!(best(), None);
        assert!(std::fs::symlink_metadata(checkpoints.join("best")).is_err());
    }
}
