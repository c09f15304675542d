//! The batch ledger: `ledger.jsonl` in the run dir records, per batch id, every place the
//! batch went (loaded, to a target, hidden states made, to a drafter, requeued after a
//! death) and when the optimizer consumed it. `dflash-supervise ledger` audits it.
//!
//! One JSON object per line: `{"t": unix_ms, "ev": EVENT, "batch": ID, "worker": NAME, ...}`
//! with EVENT one of `load`, `to_target`, `hidden`, `to_drafter`, `consumed` (with the
//! committed `step`), `requeue`, `duplicate`, `replay` (a rolled-back batch sent through
//! again), `withdrawn` (a READY training batch taken out of a full pool to make room for
//! an eval round: it goes through again after it), and for held-out eval batches (ids from
//! 2^62, never training batches) `eval_load` and `evaluated`; `{"ev": "rollback", "from": STEP, "to": STEP, "batches": [...]}` when the drafter
//! group went back to a saved state (every drafter died, or `--resume`); `{"ev": "torn"}`
//! after a line a crash cut short; and a last line `{"ev": "end", "in_flight": [...],
//! "loader_done": bool}` when the supervisor ends.
//!
//! The audit follows the lineage of the final weights: a rollback to step s abandons what
//! was consumed in steps after s, and those batches must then be consumed again, once.

use std::collections::{BTreeSet, HashMap};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;

use serde::Serialize;
use serde_json::{json, Value};

use crate::error::{Error, Source};
use crate::run::rundir::unix_ms;

pub const LEDGER_FILE: &str = "ledger.jsonl";

pub struct Ledger {
    file: File,
    /// The first append that failed: the run must stop taking batches.
    failed: Option<String>,
    /// The last append failed part-way, maybe: start the next record on a new line.
    torn: bool,
}

impl Ledger {
    pub fn create(run_dir: &Path) -> std::io::Result<Ledger> {
        let path = run_dir.join(LEDGER_FILE);
        // A previous supervisor killed mid-write (or a full disk) may have left a last line
        // without its newline: end it, and mark it so the audit sets it aside.
        let torn = last_byte(&path).is_some_and(|b| b != b'\n');
        let file = OpenOptions::new().create(true).append(true).open(&path)?;
        let mut l = Ledger {
            file,
            failed: None,
            torn,
        };
        if torn {
            l.write(&json!({"t": unix_ms(), "ev": "torn"}));
        }
        Ok(l)
    }

    /// Why the ledger cannot be appended to, once an append failed.
    pub fn failed(&self) -> Option<&str> {
        self.failed.as_deref()
    }

    pub fn rollback(&mut self, from: Option<u64>, to: u64, batches: &[u64]) {
        self.write(
            &json!({"t": unix_ms(), "ev": "rollback", "from": from, "to": to, "batches": batches}),
        );
    }

    pub fn record(&mut self, ev: &str, batch: u64, worker: &str, extra: Value) {
        let mut v = json!({"t": unix_ms(), "ev": ev, "batch": batch, "worker": worker});
        if let (Some(o), Value::Object(e)) = (v.as_object_mut(), extra) {
            o.extend(e);
        }
        self.write(&v);
    }

    pub fn end(&mut self, in_flight: &[u64], loader_done: bool, extra: Value) {
        let mut v = json!({"t": unix_ms(), "ev": "end", "in_flight": in_flight, "loader_done": loader_done});
        if let (Some(o), Value::Object(e)) = (v.as_object_mut(), extra) {
            o.extend(e);
        }
        self.write(&v);
    }

    fn write(&mut self, v: &Value) {
        // One write per record, unbuffered: a supervisor killed with SIGKILL loses nothing
        // it had already recorded.
        let mut line = if self.torn {
            "\n".to_string()
        } else {
            String::new()
        };
        line.push_str(&v.to_string());
        line.push('\n');
        match self.file.write_all(line.as_bytes()) {
            Ok(()) => self.torn = false,
            Err(e) => {
                self.torn = true;
                if self.failed.is_none() {
                    log::error!("cannot append to {LEDGER_FILE}: {e}");
                    self.failed = Some(format!("cannot append to {LEDGER_FILE}: {e}"));
                }
            }
        }
    }
}

#[derive(Debug, Default, Serialize, PartialEq, Eq)]
pub struct Audit {
    pub produced: u64,
    pub consumed_once: u64,
    /// Batches that reached an optimizer more than once.
    pub duplicated: u64,
    /// Produced, not consumed, and still in the pipeline (or the run has not ended).
    pub in_flight: u64,
    /// Produced, not consumed, and nowhere when the run ended.
    pub lost: u64,
    /// Batches put back in their queue when the worker holding them ended (died or stopped).
    pub requeued: u64,
    /// Second copies caught and dropped before reaching an optimizer.
    pub duplicates_dropped: u64,
    /// Rollbacks (every drafter died, or --resume), and the consumptions they abandoned
    /// (batches consumed in steps after the rollback's target, which are then consumed
    /// again in the final lineage).
    pub rollbacks: u64,
    pub abandoned: u64,
    /// Lines a crash cut short, set aside.
    pub torn_lines: u64,
    pub ended: bool,
}

pub fn audit(path: &Path) -> Result<Audit, Error> {
    // Bytes, not text: a line that is not UTF-8 (a torn multi-byte character, a disk
    // error) is named by its line like any other line that is not a record.
    let bytes = std::fs::read(path)
        .map_err(|e| Error::input(format!("{}: cannot read the ledger", path.display()), e))?;
    let mut produced = BTreeSet::new();
    // The lineage of the current weights: (step, batch) per consumption.
    let mut lineage: Vec<(Option<u64>, u64)> = Vec::new();
    let mut a = Audit::default();
    let mut end_in_flight: Option<BTreeSet<u64>> = None;
    let body = bytes.strip_suffix(b"\n").unwrap_or(&bytes);
    let lines: Vec<&[u8]> = if bytes.is_empty() {
        Vec::new()
    } else {
        body.split(|&b| b == b'\n')
            .map(|l| l.strip_suffix(b"\r").unwrap_or(l))
            .collect()
    };
    for i in 0..lines.len() {
        let Some(v) = read_record(path, &bytes, &lines, i, &mut a.torn_lines)? else {
            continue;
        };
        let batch = v["batch"].as_u64();
        match (v["ev"].as_str().unwrap_or(""), batch) {
            ("load", Some(b)) => {
                produced.insert(b);
            }
            ("consumed", Some(b)) => lineage.push((v["step"].as_u64(), b)),
            ("rollback", _) => {
                let to = v["to"].as_u64().unwrap_or(0);
                a.rollbacks += 1;
                let before = lineage.len();
                lineage.retain(|(s, _)| s.is_none_or(|s| s <= to));
                a.abandoned += (before - lineage.len()) as u64;
            }
            ("requeue", Some(_)) => a.requeued += 1,
            ("duplicate", Some(_)) => a.duplicates_dropped += 1,
            ("end", _) => {
                end_in_flight = Some(
                    v["in_flight"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(Value::as_u64)
                        .collect(),
                );
            }
            _ => {}
        }
    }
    let mut consumed: HashMap<u64, u64> = HashMap::new();
    for (_, b) in lineage {
        *consumed.entry(b).or_default() += 1;
    }
    a.produced = produced.len() as u64;
    a.consumed_once = consumed.values().filter(|&&n| n == 1).count() as u64;
    a.duplicated = consumed.values().filter(|&&n| n > 1).count() as u64;
    a.ended = end_in_flight.is_some();
    for b in &produced {
        if consumed.contains_key(b) {
            continue;
        }
        match &end_in_flight {
            Some(held) if !held.contains(b) => a.lost += 1,
            _ => a.in_flight += 1,
        }
    }
    // Consumed but never produced: counts as a duplicate of nothing, i.e. corruption.
    a.duplicated += consumed.keys().filter(|b| !produced.contains(b)).count() as u64;
    Ok(a)
}

/// Line `i` of the ledger's `lines` (split from the file's `bytes`): its record; `None`
/// for a blank line or one a crash cut short (counted in `torn`: the file's unfinished
/// last line, or one the next supervisor marked as torn); else which line is not a record.
fn read_record(
    path: &Path,
    bytes: &[u8],
    lines: &[&[u8]],
    i: usize,
    torn: &mut u64,
) -> Result<Option<Value>, Error> {
    let raw = lines[i];
    let parsed = std::str::from_utf8(raw)
        .map_err(Source::from)
        .and_then(|line| {
            if line.trim().is_empty() {
                return Ok(None);
            }
            serde_json::from_str::<Value>(line)
                .map(Some)
                .map_err(Source::from)
        });
    match parsed {
        Ok(v) => Ok(v),
        Err(e) => {
            let marked = lines
                .get(i + 1)
                .is_some_and(|n| n.windows(11).any(|w| w == br#""ev":"torn""#));
            if (i + 1 == lines.len() && !bytes.ends_with(b"\n")) || marked {
                *torn += 1;
                return Ok(None);
            }
            let what = if std::str::from_utf8(raw).is_err() {
                "not UTF-8, so not a ledger record"
            } else {
                "not a ledger record"
            };
            Err(Error::input(
                format!("{}:{}: {what}", path.display(), i + 1),
                e,
            ))
        }
    }
}

/// The last byte of a regular file (`None` for an empty or missing one, or a device).
fn last_byte(path: &Path) -> Option<u8> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = File::open(path).ok()?;
    let len = f.metadata().ok().filter(|m| m.is_file())?.len();
    if len == 0 {
        return None;
    }
    f.seek(SeekFrom::Start(len - 1)).ok()?;
    let mut b = [0u8; 1];
    f.read_exact(&mut b).ok()?;
    Some(b[0])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn audit_of(lines: &[&str]) -> Audit {
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), lines.join("\n")).unwrap();
        audit(f.path()).unwrap()
    }

    #[test]
    fn a_batch_consumed_again_after_a_rollback_is_once_in_the_lineage_but_twice_in_one_is_not() {
        let load: Vec<String> = (0..4)
            .map(|b| format!(r#"{{"ev":"load","batch":{b}}}"#))
            .collect();
        let c = |b: u64, s: u64| format!(r#"{{"ev":"consumed","batch":{b},"step":{s}}}"#);
        let mut ok: Vec<String> = load.clone();
        // Steps 1-3 consume 0, 1, 2; every drafter dies; rollback to step 1: 1 and 2 again.
        ok.extend([c(0, 1), c(1, 2), c(2, 3)]);
        ok.push(r#"{"ev":"rollback","from":3,"to":1,"batches":[1,2]}"#.into());
        ok.extend([c(1, 2), c(2, 3), c(3, 4)]);
        ok.push(r#"{"ev":"end","in_flight":[]}"#.into());
        let a = audit_of(&ok.iter().map(String::as_str).collect::<Vec<_>>());
        assert_eq!(
            (
                a.consumed_once,
                a.duplicated,
                a.lost,
                a.rollbacks,
                a.abandoned
            ),
            (4, 0, 0, 1, 2),
            "{a:?}"
        );
        // Without the rollback record the same consumptions are duplicates.
        let no_rollback: Vec<&str> = ok
            .iter()
            .map(String::as_str)
            .filter(|l| !l.contains("rollback"))
            .collect();
        assert_eq!(audit_of(&no_rollback).duplicated, 2);
        // Twice in one lineage (after the rollback) is a duplicate.
        let mut twice = ok.clone();
        twice.insert(twice.len() - 1, c(3, 5));
        assert_eq!(
            audit_of(&twice.iter().map(String::as_str).collect::<Vec<_>>()).duplicated,
            1
        );
        // Abandoned and never consumed again: lost.
        let mut lost: Vec<String> = load.clone();
        lost.extend([c(0, 1), c(1, 2), c(2, 3), c(3, 4)]);
        lost.push(r#"{"ev":"rollback","from":4,"to":2,"batches":[2,3]}"#.into());
        lost.push(c(2, 3));
        lost.push(r#"{"ev":"end","in_flight":[]}"#.into());
        let a = audit_of(&lost.iter().map(String::as_str).collect::<Vec<_>>());
        assert_eq!((a.consumed_once, a.lost), (3, 1), "{a:?}");
    }

    #[test]
    fn a_torn_last_line_is_set_aside_and_a_reopened_ledger_marks_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(LEDGER_FILE);
        std::fs::write(
            &path,
            "{\"ev\":\"load\",\"batch\":0}\n{\"ev\":\"consumed\",\"batch\":0,\"st",
        )
        .unwrap();
        let a = audit(&path).unwrap();
        assert_eq!((a.produced, a.torn_lines, a.consumed_once), (1, 1, 0));
        // A supervisor that opens it again ends the torn line and marks it; later records
        // are read, and the torn line stays set aside.
        let mut l = Ledger::create(dir.path()).unwrap();
        l.record("consumed", 0, "drafter-0", json!({"step": 1}));
        let a = audit(&path).unwrap();
        assert_eq!((a.torn_lines, a.consumed_once), (1, 1), "{a:?}");
        // Garbage elsewhere is still an error.
        std::fs::write(
            &path,
            "{\"ev\":\"load\",\"batch\":0}\nnot json\n{\"ev\":\"load\",\"batch\":1}\n",
        )
        .unwrap();
        assert!(audit(&path)
            .unwrap_err()
            .to_string()
            .contains(":2: not a ledger record"));
    }

    #[test]
    fn a_line_that_is_not_utf8_is_named_by_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(LEDGER_FILE);
        let mut bytes = b"{\"ev\":\"load\",\"batch\":0}\n{\"ev\":\"load\",\"batch\":1}\n".to_vec();
        bytes.extend_from_slice(b"{\"ev\":\"consumed\",\"worker\":\"\xff\xfe\"}\n");
        bytes.extend_from_slice(b"{\"ev\":\"load\",\"batch\":2}\n");
        std::fs::write(&path, &bytes).unwrap();
        let e = audit(&path).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        let msg = e.to_string();
        assert!(
            msg.starts_with(&format!("{}:3: not UTF-8", path.display())) && !msg.contains('\n'),
            "{msg}"
        );
        // A last line cut inside a multi-byte character is torn, as any cut line is.
        let mut torn =
            b"{\"ev\":\"load\",\"batch\":0}\n{\"ev\":\"consumed\",\"worker\":\"\xc3".to_vec();
        std::fs::write(&path, &torn).unwrap();
        let a = audit(&path).unwrap();
        assert_eq!((a.produced, a.torn_lines), (1, 1), "{a:?}");
        // ... and once a reopened ledger marked it, it stays set aside.
        torn.extend_from_slice(b"\n{\"t\":1,\"ev\":\"torn\"}\n");
        std::fs::write(&path, &torn).unwrap();
        assert_eq!(audit(&path).unwrap().torn_lines, 1);
    }

    #[test]
    fn a_failed_append_is_remembered_so_the_run_stops_taking_batches() {
        let dir = tempfile::tempdir().unwrap();
        // Every write to /dev/full fails with ENOSPC, as on a full disk.
        std::os::unix::fs::symlink("/dev/full", dir.path().join(LEDGER_FILE)).unwrap();
        let mut l = Ledger::create(dir.path()).unwrap();
        assert!(l.failed().is_none());
        l.record("load", 0, "loader", json!({}));
        let e = l.failed().expect("the append failed").to_string();
        assert!(e.contains("cannot append to ledger.jsonl"), "{e}");
    }

    #[test]
    fn counts_loss_duplicates_and_in_flight() {
        let a = audit_of(&[
            r#"{"ev":"load","batch":0}"#,
            r#"{"ev":"load","batch":1}"#,
            r#"{"ev":"load","batch":2}"#,
            r#"{"ev":"load","batch":3}"#,
            r#"{"ev":"consumed","batch":0}"#,
            r#"{"ev":"requeue","batch":1}"#,
            r#"{"ev":"consumed","batch":1}"#,
            r#"{"ev":"consumed","batch":1}"#,
            r#"{"ev":"end","in_flight":[2]}"#,
        ]);
        assert_eq!(
            (
                a.produced,
                a.consumed_once,
                a.duplicated,
                a.in_flight,
                a.lost,
                a.requeued
            ),
            (4, 1, 1, 1, 1, 1)
        );
        let live = audit_of(&[r#"{"ev":"load","batch":0}"#]);
        assert_eq!((live.in_flight, live.lost, live.ended), (1, 0, false));
    }
}
