//! Checkpoint integrity: `meta.json` of a checkpoint records a checksum of each file it
//! covers, and a checkpoint is trusted only when every file still matches and every
//! stored value (parameters, Adam moments) is finite. Both the worker (before it loads one)
//! and the supervisor (before it picks one to resume or roll back to) check.
//!
//! The checksums are SHA-256 (`"checksum_algorithm": "sha256"` in meta.json), so that
//! `sha256sum state.safetensors` checks a file by hand. A checkpoint whose meta.json names
//! no algorithm was written before SHA-256 was used, with a 64-bit multiply-xor hash: it is
//! verified with that hash ([`ChecksumAlgorithm::Legacy`]).

use std::path::{Path, PathBuf};

/// The tensors of a checkpoint: parameters and Adam moments (f32).
pub const STATE_FILE: &str = "state.safetensors";
pub const META_FILE: &str = "meta.json";

/// Where an export's parity probe lies: beside the export directory, not in it
/// (`RUN_DIR/drafter` → `RUN_DIR/drafter.probe.safetensors`), so that the directory holds
/// only what a model hub should receive. `dflash-supervise export-check` reads it.
pub fn probe_path(export_dir: &Path) -> std::path::PathBuf {
    let name = export_dir
        .file_name()
        .map_or("drafter".into(), |n| n.to_string_lossy().into_owned());
    export_dir.with_file_name(format!("{name}.probe.safetensors"))
}

/// The step of a checkpoint directory named `step-N` (zero-padded); `None` for anything
/// else, such as the temporary `step-N.tmp-PID` of a checkpoint being written.
pub fn step_of_dir(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// meta.json's key naming the algorithm of its checksums.
pub const CHECKSUM_ALGORITHM: &str = "checksum_algorithm";

/// meta.json names a checksum algorithm this version does not know (a newer one's).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("checksum algorithm {0} is not one this dflash-supervise knows (\"sha256\")")]
pub struct UnknownChecksumAlgorithm(pub serde_json::Value);

/// How a checkpoint's checksums were computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChecksumAlgorithm {
    /// SHA-256, lowercase hex (what `sha256sum` prints): what this version writes.
    Sha256,
    /// The 64-bit multiply-xor hash of [`crate::batch::checksum`], 16 hex digits: what
    /// checkpoints without `"checksum_algorithm"` recorded. Only read, never written.
    Legacy,
}

impl ChecksumAlgorithm {
    /// The name meta.json records for it (`None`: the legacy hash records none).
    pub fn name(self) -> Option<&'static str> {
        match self {
            ChecksumAlgorithm::Sha256 => Some("sha256"),
            ChecksumAlgorithm::Legacy => None,
        }
    }

    /// The algorithm meta.json's `"checksum_algorithm"` names (absent: the legacy hash).
    pub fn of_meta(
        meta: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<Self, UnknownChecksumAlgorithm> {
        match meta.get(CHECKSUM_ALGORITHM) {
            None => Ok(ChecksumAlgorithm::Legacy),
            Some(v) if v.as_str() == ChecksumAlgorithm::Sha256.name() => {
                Ok(ChecksumAlgorithm::Sha256)
            }
            Some(v) => Err(UnknownChecksumAlgorithm(v.clone())),
        }
    }

    /// The checksum of `bytes`, as hex.
    pub fn hex(self, bytes: &[u8]) -> String {
        match self {
            ChecksumAlgorithm::Sha256 => {
                use sha2::Digest;
                sha2::Sha256::digest(bytes)
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect()
            }
            ChecksumAlgorithm::Legacy => format!("{:016x}", crate::batch::checksum(bytes)),
        }
    }
}

/// The checksum meta.json records for a file's bytes: SHA-256, as hex.
pub fn checksum_hex(bytes: &[u8]) -> String {
    ChecksumAlgorithm::Sha256.hex(bytes)
}

/// Bytes of a file that [`content_sha256`] hashes as one piece.
pub const CONTENT_PIECE: u64 = 64 << 20;

/// A checksum of a whole file's content, as hex, fast for a large file: the SHA-256 of
/// its bytes (what `sha256sum` prints) when it is at most [`CONTENT_PIECE`] long, else the
/// SHA-256 of the SHA-256s of its pieces of [`CONTENT_PIECE`] bytes, in order, the pieces
/// hashed on up to 8 threads at once. Read in blocks of 1 MiB: bounded memory.
pub fn content_sha256(file: &std::fs::File) -> std::io::Result<String> {
    content_sha256_in(file, CONTENT_PIECE)
}

fn content_sha256_in(file: &std::fs::File, piece: u64) -> std::io::Result<String> {
    use sha2::Digest;
    use std::sync::atomic::{AtomicU64, Ordering};
    let size = file.metadata()?.len();
    let hex = |d: &[u8]| d.iter().map(|b| format!("{b:02x}")).collect::<String>();
    if size <= piece {
        return Ok(hex(&sha256_range(file, 0, size)?));
    }
    let pieces = size.div_ceil(piece);
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get() as u64)
        .clamp(1, 8)
        .min(pieces);
    let next = AtomicU64::new(0);
    let mut digests = vec![[0u8; 32]; pieces as usize];
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= pieces {
                            return Ok::<_, std::io::Error>(done);
                        }
                        let end = ((i + 1) * piece).min(size);
                        done.push((i, sha256_range(file, i * piece, end)?));
                    }
                })
            })
            .collect();
        for w in workers {
            for (i, d) in w.join().expect("a hashing thread panicked")? {
                digests[i as usize] = d;
            }
        }
        Ok::<_, std::io::Error>(())
    })?;
    let mut all = sha2::Sha256::new();
    for d in &digests {
        all.update(d);
    }
    Ok(hex(&all.finalize()))
}

/// The SHA-256 of bytes `start..end` of `file` (an error if it ends before `end`).
fn sha256_range(file: &std::fs::File, start: u64, end: u64) -> std::io::Result<[u8; 32]> {
    use sha2::Digest;
    use std::os::unix::fs::FileExt;
    let mut hasher = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut at = start;
    while at < end {
        let want = (end - at).min(buf.len() as u64) as usize;
        match file.read_at(&mut buf[..want], at) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => {
                hasher.update(&buf[..n]);
                at += n as u64;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(hasher.finalize().into())
}

/// The layout of a checkpoint this version writes (`"format"` in meta.json). A checkpoint
/// without one was written before formats were recorded, and is read as format 1; one of a
/// newer format is refused rather than misread.
pub const FORMAT_VERSION: u32 = 1;

/// meta.json's checksum of itself: over the canonical serialisation (compact, keys sorted)
/// of every other field.
pub const META_CHECKSUM: &str = "meta_checksum";

/// The checksum [`finish_meta`] records: of `meta` without its `meta_checksum`, serialised
/// compactly. serde_json's `Map` is a `BTreeMap` here (no `preserve_order` feature in the
/// workspace), so the keys come out sorted: the same text for the same fields, whatever
/// order they were written in.
fn meta_checksum(
    meta: &serde_json::Map<String, serde_json::Value>,
    algorithm: ChecksumAlgorithm,
) -> String {
    let mut rest = meta.clone();
    rest.remove(META_CHECKSUM);
    let text = serde_json::Value::Object(rest).to_string();
    algorithm.hex(text.as_bytes())
}

/// Finish a checkpoint's metadata (a JSON object): add `"format"` ([`FORMAT_VERSION`]),
/// `"checksum_algorithm"` (`"sha256"`: the writer's `"checksums"` must come from
/// [`checksum_hex`]) and `"meta_checksum"`, and return the text to write as meta.json.
///
/// The checksum is over the fields as a reader parses them back from that text (serde_json
/// parses some floats a unit in the last place away from the value that was printed, so
/// the value in memory is not what [`verify`] sees); the text itself prints the original
/// values, whose digits are the ones that were parsed.
pub fn finish_meta(meta: &serde_json::Value) -> serde_json::Result<String> {
    let serde_json::Value::Object(mut m) = meta.clone() else {
        return Err(<serde_json::Error as serde::ser::Error>::custom(
            "checkpoint metadata is not a JSON object",
        ));
    };
    m.remove(META_CHECKSUM);
    m.insert("format".into(), FORMAT_VERSION.into());
    let algorithm = ChecksumAlgorithm::Sha256;
    m.insert(CHECKSUM_ALGORITHM.into(), algorithm.name().into());
    let m = serde_json::Value::Object(m);
    let read_back: serde_json::Value = serde_json::from_str(&serde_json::to_string(&m)?)?;
    let sum = meta_checksum(
        read_back.as_object().expect("an object reads back as one"),
        algorithm,
    );
    let serde_json::Value::Object(mut m) = m else {
        unreachable!("built as an object")
    };
    m.insert(META_CHECKSUM.into(), sum.into());
    serde_json::to_string_pretty(&serde_json::Value::Object(m))
}

/// Why a checkpoint was refused: the file, and what is wrong with it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{}: {problem}", file.display())]
pub struct Refused {
    pub file: PathBuf,
    pub problem: Problem,
}

/// What is wrong with a checkpoint's file.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Problem {
    /// It cannot be read (the system's words).
    #[error("{0}")]
    Unreadable(String),
    #[error("not valid JSON: {0}")]
    NotJson(String),
    #[error("not a JSON object")]
    NotAnObject,
    #[error(
        "written by a newer dflash-supervise (format {format}, this one reads {FORMAT_VERSION})"
    )]
    NewerFormat { format: u64 },
    #[error("format {0} is not a format number (expected {FORMAT_VERSION})")]
    BadFormat(serde_json::Value),
    #[error(transparent)]
    UnknownAlgorithm(#[from] UnknownChecksumAlgorithm),
    #[error("checksum {got}, it says {want} (meta.json changed after it was written)")]
    MetaChanged {
        got: String,
        want: serde_json::Value,
    },
    #[error("no step")]
    NoStep,
    #[error("a checkpoint of step {step} in a directory named for step {named} (moved or copied over another one)")]
    Moved { step: u64, named: u64 },
    /// `difference`: the first fields that differ, in words.
    #[error("a checkpoint of another drafter ({difference}): not one of this run")]
    OtherDrafter { difference: String },
    #[error("checksum {got}, meta.json says {want} (the file changed after it was written)")]
    StateChanged { got: String, want: String },
    #[error("truncated (no header)")]
    NoHeader,
    #[error("header length out of range (over the safetensors limit)")]
    HeaderTooLarge,
    #[error("truncated (header)")]
    TruncatedHeader,
    #[error("truncated or padded (the tensors' data does not end where the file does)")]
    DataLength,
    #[error("not a valid safetensors file: {0}")]
    NotSafetensors(String),
    #[error("tensor {tensor} is {dtype}, expected F32")]
    NotF32 { tensor: String, dtype: String },
    #[error("tensor {tensor} holds a non-finite value (element {element})")]
    NonFinite { tensor: String, element: usize },
}

/// Verify the checkpoint in `dir`; returns its step. A refusal names the file.
///
/// Checked: meta.json's format (absent: an older checkpoint, accepted; newer than
/// [`FORMAT_VERSION`]: refused), its checksum algorithm (absent: the legacy hash; unknown:
/// refused) and its own checksum (absent in older checkpoints), that the
/// directory's name `step-N` agrees with its step, that it is a checkpoint of
/// `expected_drafter` (meta.json's `drafter`, when one is given), and that
/// state.safetensors matches its checksum and holds only finite values.
pub fn verify(dir: &Path, expected_drafter: Option<&serde_json::Value>) -> Result<u64, Refused> {
    let meta_path = dir.join(META_FILE);
    let (meta, algorithm) = read_meta(&meta_path).map_err(|problem| Refused {
        file: meta_path.clone(),
        problem,
    })?;
    let step = check_meta(dir, &meta, expected_drafter).map_err(|problem| Refused {
        file: meta_path,
        problem,
    })?;
    let path = dir.join(STATE_FILE);
    check_state(&path, &meta, algorithm).map_err(|problem| Refused {
        file: path,
        problem,
    })?;
    Ok(step)
}

/// meta.json, of a format this version reads, with its own checksum right.
fn read_meta(path: &Path) -> Result<(serde_json::Value, ChecksumAlgorithm), Problem> {
    let text = std::fs::read_to_string(path).map_err(|e| Problem::Unreadable(e.to_string()))?;
    let meta: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| Problem::NotJson(e.to_string()))?;
    let fields = meta.as_object().ok_or(Problem::NotAnObject)?;
    match fields.get("format") {
        None => {} // Written before formats were recorded: format 1.
        Some(f) => match f.as_u64() {
            Some(n) if n <= FORMAT_VERSION as u64 => {}
            Some(format) => return Err(Problem::NewerFormat { format }),
            None => return Err(Problem::BadFormat(f.clone())),
        },
    }
    let algorithm = ChecksumAlgorithm::of_meta(fields)?;
    // A checkpoint written before meta.json was checksummed has none.
    if let Some(want) = fields.get(META_CHECKSUM) {
        let got = meta_checksum(fields, algorithm);
        if want.as_str() != Some(got.as_str()) {
            let want = want.clone();
            return Err(Problem::MetaChanged { got, want });
        }
    }
    Ok((meta, algorithm))
}

/// The step meta.json records, agreeing with its directory's name, of the drafter
/// expected.
fn check_meta(
    dir: &Path,
    meta: &serde_json::Value,
    expected_drafter: Option<&serde_json::Value>,
) -> Result<u64, Problem> {
    let step = meta["step"].as_u64().ok_or(Problem::NoStep)?;
    if let Some(named) = dir
        .file_name()
        .and_then(|n| step_of_dir(&n.to_string_lossy()))
    {
        if named != step {
            return Err(Problem::Moved { step, named });
        }
    }
    if let Some(want) = expected_drafter {
        // As meta.json's copy went: printed and parsed (see `finish_meta`); a value that
        // does not parse back compares unequal.
        let want: serde_json::Value =
            serde_json::from_str(&want.to_string()).unwrap_or(serde_json::Value::Null);
        if meta["drafter"] != want {
            let difference = drafter_difference(&meta["drafter"], &want);
            return Err(Problem::OtherDrafter { difference });
        }
    }
    Ok(step)
}

/// state.safetensors as meta.json's checksum says, finite.
fn check_state(
    path: &Path,
    meta: &serde_json::Value,
    algorithm: ChecksumAlgorithm,
) -> Result<(), Problem> {
    let bytes = std::fs::read(path).map_err(|e| Problem::Unreadable(e.to_string()))?;
    // A checkpoint written before checksums were recorded has none: the finiteness check
    // still applies.
    if let Some(want) = meta["checksums"][STATE_FILE].as_str() {
        let got = algorithm.hex(&bytes);
        if got != want {
            let want = want.to_string();
            return Err(Problem::StateChanged { got, want });
        }
    }
    check_finite_f32(&bytes)
}

/// How a checkpoint's drafter config differs from the expected one, in words: the first
/// few fields that differ (`layers 3, this run's 2`).
fn drafter_difference(got: &serde_json::Value, want: &serde_json::Value) -> String {
    let (Some(g), Some(w)) = (got.as_object(), want.as_object()) else {
        return if got.is_null() {
            "it records no drafter config".into()
        } else {
            format!("drafter {got}")
        };
    };
    let mut keys: Vec<&String> = g.keys().chain(w.keys()).collect();
    keys.sort();
    keys.dedup();
    let shown = |v: Option<&serde_json::Value>| v.map_or("none".to_string(), |v| v.to_string());
    let diffs: Vec<String> = keys
        .into_iter()
        .filter(|k| g.get(*k) != w.get(*k))
        .map(|k| format!("{k} {}, this run's {}", shown(g.get(k)), shown(w.get(k))))
        .collect();
    let n = diffs.len();
    let mut s = diffs.into_iter().take(3).collect::<Vec<_>>().join("; ");
    if n > 3 {
        s.push_str(&format!("; {} more", n - 3));
    }
    s
}

/// Every value of a safetensors file whose tensors are all f32 is finite.
fn check_finite_f32(bytes: &[u8]) -> Result<(), Problem> {
    use safetensors::SafeTensorError as E;
    let st = safetensors::SafeTensors::deserialize(bytes).map_err(|e| match e {
        E::HeaderTooSmall => Problem::NoHeader,
        E::HeaderTooLarge => Problem::HeaderTooLarge,
        E::InvalidHeaderLength => Problem::TruncatedHeader,
        E::MetadataIncompleteBuffer => Problem::DataLength,
        e => Problem::NotSafetensors(e.to_string()),
    })?;
    for (name, t) in st.iter() {
        if t.dtype() != safetensors::Dtype::F32 {
            return Err(Problem::NotF32 {
                tensor: name.to_string(),
                dtype: t.dtype().to_string(),
            });
        }
        if let Some(element) = t
            .data()
            .chunks_exact(4)
            .position(|c| !f32::from_le_bytes(c.try_into().expect("4 bytes")).is_finite())
        {
            return Err(Problem::NonFinite {
                tensor: name.to_string(),
                element,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, values: &[f32], meta_checksum: bool) {
        let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let view = safetensors::tensor::TensorView::new(
            safetensors::Dtype::F32,
            vec![values.len()],
            &data,
        )
        .unwrap();
        let bytes = safetensors::serialize([("params", view)], None).unwrap();
        std::fs::write(dir.join(STATE_FILE), &bytes).unwrap();
        let meta = if meta_checksum {
            serde_json::json!({"step": 7, "checksums": {STATE_FILE: checksum_hex(&bytes)},
                CHECKSUM_ALGORITHM: "sha256"})
        } else {
            serde_json::json!({"step": 7, "checksums": null})
        };
        std::fs::write(dir.join(META_FILE), meta.to_string()).unwrap();
    }

    #[test]
    fn a_files_content_checksum_is_its_sha256_or_that_of_its_pieces() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("data");
        // Over two read blocks, so that they are chained.
        let bytes: Vec<u8> = (0..(1u32 << 20) + 77).map(|i| (i % 251) as u8).collect();
        std::fs::write(&p, &bytes).unwrap();
        let f = std::fs::File::open(&p).unwrap();
        assert_eq!(content_sha256(&f).unwrap(), checksum_hex(&bytes));
        // In pieces: the SHA-256 of the pieces' SHA-256s, in order.
        let piece = 100_000;
        let mut digests = Vec::new();
        for c in bytes.chunks(piece) {
            use sha2::Digest;
            digests.extend_from_slice(&sha2::Sha256::digest(c));
        }
        assert_eq!(
            content_sha256_in(&f, piece as u64).unwrap(),
            checksum_hex(&digests)
        );
        std::fs::write(&p, b"").unwrap();
        assert_eq!(
            content_sha256(&std::fs::File::open(&p).unwrap()).unwrap(),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }

    #[test]
    fn only_complete_checkpoint_directory_names_have_a_step() {
        assert_eq!(step_of_dir("step-00000012"), Some(12));
        for n in [
            "step-00000012.tmp-77",
            "step-00000012.replaced-9",
            "step-",
            "steps-1",
            "step-1a",
        ] {
            assert_eq!(step_of_dir(n), None, "{n}");
        }
    }

    #[test]
    fn a_changed_truncated_or_non_finite_checkpoint_is_refused() {
        let d = tempfile::tempdir().unwrap();
        write(d.path(), &[1.0, -2.0, 3.5], true);
        assert_eq!(verify(d.path(), None), Ok(7));
        // One flipped bit.
        let p = d.path().join(STATE_FILE);
        let mut b = std::fs::read(&p).unwrap();
        *b.last_mut().unwrap() ^= 1;
        std::fs::write(&p, &b).unwrap();
        assert!(matches!(
            verify(d.path(), None).unwrap_err().problem,
            Problem::StateChanged { .. }
        ));
        // Truncated, without a checksum to catch it.
        write(d.path(), &[1.0, 2.0], false);
        let b = std::fs::read(&p).unwrap();
        std::fs::write(&p, &b[..b.len() - 3]).unwrap();
        assert_eq!(
            verify(d.path(), None).unwrap_err().problem,
            Problem::DataLength
        );
        // NaN, with a valid checksum.
        write(d.path(), &[1.0, f32::NAN], true);
        assert_eq!(
            verify(d.path(), None).unwrap_err().problem,
            Problem::NonFinite {
                tensor: "params".into(),
                element: 1
            }
        );
        // A header length that overflows (no checksum to catch it): refused, not a panic.
        write(d.path(), &[1.0, 2.0], false);
        let mut b = std::fs::read(&p).unwrap();
        b[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        std::fs::write(&p, &b).unwrap();
        assert_eq!(
            verify(d.path(), None).unwrap_err().problem,
            Problem::HeaderTooLarge
        );
        // Missing.
        std::fs::remove_file(&p).unwrap();
        let missing = verify(d.path(), None).unwrap_err();
        assert_eq!(missing.file, p);
        assert!(matches!(missing.problem, Problem::Unreadable(_)));
    }

    /// A checkpoint as the writers leave it: `step-N` with finished metadata.
    fn finished(root: &Path, step: u64, drafter: serde_json::Value) -> std::path::PathBuf {
        let dir = root.join(format!("step-{step:08}"));
        std::fs::create_dir_all(&dir).unwrap();
        write(&dir, &[1.0, -2.0, 3.5], true);
        let mut meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join(META_FILE)).unwrap()).unwrap();
        meta["step"] = step.into();
        meta["drafter"] = drafter;
        meta["supervisor"] = serde_json::json!({"consumed_below": 12, "consumed_extra": [14]});
        std::fs::write(dir.join(META_FILE), finish_meta(&meta).unwrap()).unwrap();
        dir
    }

    fn drafter(layers: u64) -> serde_json::Value {
        serde_json::json!({"hidden": 64, "layers": layers, "eps": 1e-6, "rope_theta": 10000.0, "gamma": 4.0})
    }

    fn edit_meta(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
        let p = dir.join(META_FILE);
        let mut meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        f(&mut meta);
        std::fs::write(&p, serde_json::to_string_pretty(&meta).unwrap()).unwrap();
    }

    #[test]
    fn finished_metadata_records_its_format_and_checksum_and_verifies() {
        let d = tempfile::tempdir().unwrap();
        let dir = finished(d.path(), 7, drafter(2));
        let meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join(META_FILE)).unwrap()).unwrap();
        assert_eq!(meta["format"], FORMAT_VERSION);
        assert!(meta[META_CHECKSUM].is_string(), "{meta}");
        assert_eq!(verify(&dir, Some(&drafter(2))), Ok(7));
        assert_eq!(verify(&dir, None), Ok(7));
        // Finishing again (a writer handed finished metadata) gives the same text.
        let again = finish_meta(&meta).unwrap();
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&again).unwrap(),
            meta
        );
        assert!(finish_meta(&serde_json::json!([1, 2])).is_err());
    }

    #[test]
    fn the_meta_checksum_holds_for_floats_that_do_not_parse_back_exactly() {
        // serde_json's default float parser may land a unit in the last place away from
        // the printed value: the checksum must be over what a reader parses.
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("step-00000003");
        std::fs::create_dir_all(&dir).unwrap();
        write(&dir, &[1.0], true);
        let mut x: u64 = 0x1234_5678_9abc_def1;
        let floats: Vec<f64> = (0..4000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let v = f64::from_bits(x);
                if v.is_finite() {
                    v
                } else {
                    (x >> 11) as f64 / 9007199254740992.0
                }
            })
            .collect();
        let meta = serde_json::json!({"step": 3, "floats": floats, "drafter": {"eps": 1e-6, "gamma": 0.1 + 0.2},
            "checksums": {STATE_FILE: checksum_hex(&std::fs::read(dir.join(STATE_FILE)).unwrap())}});
        std::fs::write(dir.join(META_FILE), finish_meta(&meta).unwrap()).unwrap();
        assert_eq!(
            verify(
                &dir,
                Some(&serde_json::json!({"eps": 1e-6, "gamma": 0.1 + 0.2}))
            ),
            Ok(3)
        );
    }

    #[test]
    fn a_checkpoint_of_a_newer_format_is_refused_and_an_older_one_accepted() {
        let d = tempfile::tempdir().unwrap();
        let dir = finished(d.path(), 7, drafter(2));
        // Format 99, its checksum made right again: refused for the format, not the checksum.
        let mut meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join(META_FILE)).unwrap()).unwrap();
        meta.as_object_mut().unwrap().remove(META_CHECKSUM);
        let mut text = finish_meta(&meta).unwrap();
        text = text.replace(&format!("\"format\": {FORMAT_VERSION}"), "\"format\": 99");
        let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let sum = meta_checksum(v.as_object().unwrap(), ChecksumAlgorithm::Sha256);
        v[META_CHECKSUM] = sum.into();
        std::fs::write(dir.join(META_FILE), v.to_string()).unwrap();
        let e = verify(&dir, None).unwrap_err().to_string();
        assert!(
            e.contains("written by a newer dflash-supervise (format 99, this one reads 1)"),
            "{e}"
        );
        // Without a format or a checksum (written before they were recorded): accepted.
        edit_meta(&dir, |m| {
            let o = m.as_object_mut().unwrap();
            o.remove("format");
            o.remove(META_CHECKSUM);
        });
        assert_eq!(verify(&dir, Some(&drafter(2))), Ok(7));
        edit_meta(&dir, |m| m["format"] = "one".into());
        assert!(verify(&dir, None)
            .unwrap_err()
            .to_string()
            .contains("not a format number"));
    }

    #[test]
    fn an_edited_consumed_count_is_refused_by_the_meta_checksum() {
        let d = tempfile::tempdir().unwrap();
        let dir = finished(d.path(), 7, drafter(2));
        edit_meta(&dir, |m| m["supervisor"]["consumed_below"] = 11.into());
        let e = verify(&dir, None).unwrap_err().to_string();
        assert!(
            e.contains("meta.json changed after it was written") && e.contains(META_FILE),
            "{e}"
        );
        // Only rewritten (another key order, pretty or not), it still verifies.
        let dir = finished(d.path(), 8, drafter(2));
        edit_meta(&dir, |_| {});
        assert_eq!(verify(&dir, None), Ok(8));
    }

    #[test]
    fn a_directory_named_for_another_step_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let dir = finished(d.path(), 7, drafter(2));
        let moved = d.path().join("step-00000009");
        std::fs::rename(&dir, &moved).unwrap();
        let e = verify(&moved, None).unwrap_err().to_string();
        assert!(
            e.contains("a checkpoint of step 7 in a directory named for step 9"),
            "{e}"
        );
        // A directory not named as a checkpoint (a copy elsewhere) is not held to a name.
        let elsewhere = d.path().join("copy");
        std::fs::rename(&moved, &elsewhere).unwrap();
        assert_eq!(verify(&elsewhere, None), Ok(7));
    }

    #[test]
    fn a_checkpoint_of_another_drafter_is_refused_when_one_is_expected() {
        let d = tempfile::tempdir().unwrap();
        let dir = finished(d.path(), 7, drafter(3));
        let e = verify(&dir, Some(&drafter(2))).unwrap_err().to_string();
        assert!(
            e.contains("a checkpoint of another drafter (layers 3, this run's 2)"),
            "{e}"
        );
        assert_eq!(
            verify(&dir, None),
            Ok(7),
            "no drafter expected: not checked"
        );
        let old = d.path().join("old");
        std::fs::create_dir_all(&old).unwrap();
        write(&old, &[1.0], true);
        assert!(verify(&old, Some(&drafter(2)))
            .unwrap_err()
            .to_string()
            .contains("it records no drafter config"));
    }

    #[test]
    fn checksums_are_sha256_as_sha256sum_prints_them_and_meta_json_names_it() {
        // FIPS 180-2's test vector for "abc".
        assert_eq!(
            checksum_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        let d = tempfile::tempdir().unwrap();
        let dir = finished(d.path(), 7, drafter(2));
        let meta: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join(META_FILE)).unwrap()).unwrap();
        assert_eq!(meta[CHECKSUM_ALGORITHM], "sha256");
        let want = meta["checksums"][STATE_FILE].as_str().unwrap();
        assert_eq!(want.len(), 64, "{want}");
        assert_eq!(
            want,
            checksum_hex(&std::fs::read(dir.join(STATE_FILE)).unwrap())
        );
    }

    /// A checkpoint as a version before SHA-256 wrote it: no `checksum_algorithm`, the
    /// file's and meta.json's checksums by the legacy hash.
    fn legacy(root: &Path, step: u64) -> std::path::PathBuf {
        let dir = root.join(format!("step-{step:08}"));
        std::fs::create_dir_all(&dir).unwrap();
        write(&dir, &[1.0, -2.0, 3.5], false);
        let state = std::fs::read(dir.join(STATE_FILE)).unwrap();
        let mut meta = serde_json::json!({"step": step, "format": 1, "drafter": drafter(2),
            "checksums": {STATE_FILE: ChecksumAlgorithm::Legacy.hex(&state)}});
        let sum = meta_checksum(meta.as_object().unwrap(), ChecksumAlgorithm::Legacy);
        meta[META_CHECKSUM] = sum.into();
        std::fs::write(dir.join(META_FILE), meta.to_string()).unwrap();
        dir
    }

    #[test]
    fn a_checkpoint_checksummed_by_the_legacy_hash_verifies_with_it() {
        let d = tempfile::tempdir().unwrap();
        let dir = legacy(d.path(), 5);
        assert_eq!(verify(&dir, Some(&drafter(2))), Ok(5));
        // Its checksums still catch a change: of the state...
        let p = dir.join(STATE_FILE);
        let mut b = std::fs::read(&p).unwrap();
        *b.last_mut().unwrap() ^= 1;
        std::fs::write(&p, &b).unwrap();
        let e = verify(&dir, None).unwrap_err().to_string();
        assert!(e.contains(STATE_FILE) && e.contains("checksum"), "{e}");
        // ...and of meta.json.
        let dir = legacy(d.path(), 6);
        edit_meta(&dir, |m| m["seed"] = 3.into());
        let e = verify(&dir, None).unwrap_err().to_string();
        assert!(e.contains("meta.json changed after it was written"), "{e}");
        // Legacy sums claimed to be SHA-256 do not pass as either.
        let dir = legacy(d.path(), 8);
        edit_meta(&dir, |m| m[CHECKSUM_ALGORITHM] = "sha256".into());
        assert!(verify(&dir, None)
            .unwrap_err()
            .to_string()
            .contains("checksum"));
    }

    #[test]
    fn an_unknown_checksum_algorithm_is_refused_in_one_line() {
        let d = tempfile::tempdir().unwrap();
        let dir = finished(d.path(), 7, drafter(2));
        edit_meta(&dir, |m| m[CHECKSUM_ALGORITHM] = "blake3".into());
        let e = verify(&dir, None).unwrap_err().to_string();
        assert!(
            e.contains("checksum algorithm \"blake3\" is not one this dflash-supervise knows")
                && !e.contains('\n'),
            "{e}"
        );
    }
}
