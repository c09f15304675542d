//! The journal that makes a regeneration resumable: `OUT.partial` beside `--out`, a
//! header naming the settings, then one record per finished input line (its output line,
//! or why it was skipped), appended as each finishes. A killed regeneration leaves it; the
//! same command reads it back, skips what it holds (a torn last record, from a kill in
//! the middle of a write, is cut off and done again) and appends the rest. When every line
//! is done, `--out` is written from it in input order (a temporary file renamed into
//! place) and the journal removed. So each line is written exactly once, in its place,
//! however often the command is stopped.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// What decides a regeneration's output: a journal written under other settings is not
/// continued.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Settings {
    pub target: String,
    /// SHA-256 of the target's config.json (none for tiny).
    pub target_config: Option<String>,
    pub data: String,
    /// SHA-256 of the data file.
    pub data_sha256: String,
    pub max_new_tokens: usize,
    pub temperature: f32,
    pub top_p: f32,
    pub seed: u64,
    pub thinking: Option<bool>,
    pub max_seq_len: usize,
    /// SHA-256 of the chat template (none without a tokenizer).
    pub chat_template: Option<String>,
}

#[derive(Debug, Serialize, Deserialize)]
struct Header {
    regenerate: u32,
    settings: Settings,
}

/// One finished input line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    pub line: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub out: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skipped: Option<String>,
}

/// Why a journal cannot be continued.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: not a regeneration journal (its first line is no header); expected the journal a stopped `regenerate --out {}` left", path.display(), out.display())]
    NotAJournal { path: PathBuf, out: PathBuf },
    #[error("{}: a regeneration with other settings was stopped here ({what}: {then}, now {now}); give the same flags to continue it, or another --out", path.display())]
    OtherSettings {
        path: PathBuf,
        what: String,
        then: String,
        now: String,
    },
}

/// The journal of `out`.
pub fn path_of(out: &Path) -> PathBuf {
    let mut name = out.file_name().unwrap_or_default().to_os_string();
    name.push(".partial");
    out.with_file_name(name)
}

/// An open journal: what it held, and the file appended to.
pub struct Journal {
    pub path: PathBuf,
    pub done: BTreeMap<usize, Record>,
    file: std::fs::File,
}

/// The first setting that differs, named as its flag.
fn differs(a: &Settings, b: &Settings) -> Option<(String, String, String)> {
    let (va, vb) = (
        serde_json::to_value(a).unwrap_or_default(),
        serde_json::to_value(b).unwrap_or_default(),
    );
    let (oa, ob) = (va.as_object()?, vb.as_object()?);
    // Paths may move: their contents are compared.
    oa.iter()
        .filter(|(k, _)| !matches!(k.as_str(), "target" | "data"))
        .find_map(|(k, x)| {
            let y = ob.get(k).cloned().unwrap_or_default();
            (*x != y).then(|| {
                let name = match k.as_str() {
                    "target_config" => "the target's config.json".to_string(),
                    "data_sha256" => "the data's content".to_string(),
                    "chat_template" => "the chat template".to_string(),
                    k => format!("--{}", k.replace('_', "-")),
                };
                (name, x.to_string(), y.to_string())
            })
        })
}

impl Journal {
    /// Open the journal of `out` under `settings`: continued when one is there, else a new
    /// one.
    pub fn open(out: &Path, settings: &Settings) -> Result<Journal, JournalError> {
        let path = path_of(out);
        let io = |source| JournalError::Io {
            path: path.clone(),
            source,
        };
        let mut done = BTreeMap::new();
        match std::fs::read(&path) {
            Ok(bytes) => {
                // Whole lines only: a torn last record is cut off.
                let whole = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
                let text = String::from_utf8_lossy(&bytes[..whole]);
                let mut lines = text.lines();
                let header: Header = lines
                    .next()
                    .and_then(|l| serde_json::from_str(l).ok())
                    .ok_or_else(|| JournalError::NotAJournal {
                        path: path.clone(),
                        out: out.to_path_buf(),
                    })?;
                if let Some((what, then, now)) = differs(&header.settings, settings) {
                    return Err(JournalError::OtherSettings {
                        path,
                        what,
                        then,
                        now,
                    });
                }
                for l in lines {
                    if let Ok(r) = serde_json::from_str::<Record>(l) {
                        done.insert(r.line, r);
                    }
                }
                let file = std::fs::OpenOptions::new()
                    .write(true)
                    .open(&path)
                    .map_err(io)?;
                file.set_len(whole as u64).map_err(io)?;
                use std::io::Seek;
                let mut file = file;
                file.seek(std::io::SeekFrom::End(0)).map_err(io)?;
                Ok(Journal { path, done, file })
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let mut file = std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(&path)
                    .map_err(io)?;
                let h = serde_json::to_string(&Header {
                    regenerate: 1,
                    settings: settings.clone(),
                })
                .unwrap_or_default();
                writeln!(file, "{h}").map_err(io)?;
                Ok(Journal { path, done, file })
            }
            Err(e) => Err(io(e)),
        }
    }

    /// Append one finished line (one write of one whole line).
    pub fn append(&mut self, r: Record) -> Result<(), JournalError> {
        let mut s = serde_json::to_string(&r).unwrap_or_default();
        s.push('\n');
        self.file
            .write_all(s.as_bytes())
            .map_err(|source| JournalError::Io {
                path: self.path.clone(),
                source,
            })?;
        self.done.insert(r.line, r);
        Ok(())
    }

    /// Write `out` from the records, in line order (through a temporary file beside it,
    /// synced, then renamed), then remove the journal. The lines written.
    pub fn finish(self, out: &Path) -> Result<usize, JournalError> {
        let name = out.file_name().unwrap_or_default().to_string_lossy();
        let tmp = out.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
        let io = |p: &Path| {
            let p = p.to_path_buf();
            move |source| JournalError::Io { path: p, source }
        };
        let mut text = String::new();
        let mut n = 0;
        for r in self.done.values() {
            if let Some(o) = &r.out {
                text.push_str(&o.to_string());
                text.push('\n');
                n += 1;
            }
        }
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::File::create_new(&tmp)?;
            f.write_all(text.as_bytes())?;
            f.sync_all()
        };
        if let Err(e) = write() {
            let _ = std::fs::remove_file(&tmp);
            return Err(io(&tmp)(e));
        }
        std::fs::rename(&tmp, out).map_err(io(out))?;
        std::fs::remove_file(&self.path).map_err(io(&self.path))?;
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn settings() -> Settings {
        Settings {
            target: "t".into(),
            target_config: None,
            data: "d".into(),
            data_sha256: "ab".into(),
            max_new_tokens: 8,
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
            thinking: None,
            max_seq_len: 64,
            chat_template: None,
        }
    }

    #[test]
    fn a_torn_record_is_done_again_and_the_output_is_in_line_order() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out.jsonl");
        let mut j = Journal::open(&out, &settings()).unwrap();
        for line in [5, 2] {
            j.append(Record {
                line,
                out: Some(json!({"n": line})),
                skipped: None,
            })
            .unwrap();
        }
        drop(j);
        // A kill in the middle of the next record's write.
        let p = path_of(&out);
        let mut f = std::fs::OpenOptions::new().append(true).open(&p).unwrap();
        f.write_all(br#"{"line": 3, "out": {"n""#).unwrap();
        drop(f);
        let mut j = Journal::open(&out, &settings()).unwrap();
        assert_eq!(j.done.keys().copied().collect::<Vec<_>>(), [2, 5]);
        j.append(Record {
            line: 3,
            out: Some(json!({"n": 3})),
            skipped: None,
        })
        .unwrap();
        j.append(Record {
            line: 9,
            out: None,
            skipped: Some("too long".into()),
        })
        .unwrap();
        drop(j);
        let j = Journal::open(&out, &settings()).unwrap();
        assert_eq!(j.done.len(), 4);
        assert_eq!(j.finish(&out).unwrap(), 3);
        assert_eq!(
            std::fs::read_to_string(&out).unwrap(),
            "{\"n\":2}\n{\"n\":3}\n{\"n\":5}\n"
        );
        assert!(!p.exists(), "the journal is removed");
        // Nothing else was left beside the output.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn a_journal_of_other_settings_is_refused_naming_the_flag() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("o.jsonl");
        drop(Journal::open(&out, &settings()).unwrap());
        let mut other = settings();
        other.temperature = 0.5;
        let e = Journal::open(&out, &other).err().unwrap().to_string();
        assert!(e.contains("--temperature: 0.0, now 0.5"), "{e}");
        let mut other = settings();
        other.data_sha256 = "cd".into();
        let e = Journal::open(&out, &other).err().unwrap().to_string();
        assert!(e.contains("the data's content"), "{e}");
        std::fs::write(path_of(&out), "garbage\n").unwrap();
        let e = Journal::open(&out, &settings()).err().unwrap().to_string();
        assert!(e.contains("not a regeneration journal"), "{e}");
        // Not ours: left as it was, and nothing made beside it.
        assert_eq!(std::fs::read_to_string(path_of(&out)).unwrap(), "garbage\n");
        assert!(!out.exists());
    }
}
