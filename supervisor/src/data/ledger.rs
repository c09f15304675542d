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

    /// The session is over: `in_flight`, what its pipeline still held; `finished`: the
    /// run reached its end (its `--steps` or its data), so nothing will train them.
    pub fn end(&mut self, in_flight: &[u64], loader_done: bool, finished: bool, extra: Value) {
        let mut v = json!({"t": unix_ms(), "ev": "end", "in_flight": in_flight,
            "loader_done": loader_done, "finished": finished});
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
    /// Produced, not consumed, and still to be trained: the run has not recorded its
    /// end, or it stopped before its end holding them and a `--resume` loads them again.
    pub in_flight: u64,
    /// Produced, not consumed, and held when the run finished (its `--steps` reached):
    /// loaded ahead of the optimizer and never needed.
    pub loaded_ahead: u64,
    /// Produced, not consumed, and neither held when its session ended nor still to be
    /// loaded again.
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

/// One supervisor's session of a run, as its ledger records show it: sessions are
/// delimited by their `end` record, and by the `rollback` a `--resume` records first (a
/// session killed before its end recorded none).
#[derive(Default)]
struct Session {
    /// The largest batch id it loaded.
    max_load: Option<u64>,
    /// Its `end`: what its pipeline held, and whether the run finished there.
    end: Option<(BTreeSet<u64>, bool)>,
    /// Records seen since it began.
    records: u64,
}

/// What became of a batch produced and not consumed in the final lineage.
enum Left {
    InFlight,
    LoadedAhead,
    Lost,
}

/// Where batch `b`, last loaded in `sessions[k]`, is; `abandoned`: the session whose
/// `--resume` abandoned its consumption, if one did. A resumed session loads every batch
/// not consumed in its lineage again, in id order, so a batch one session held at its end
/// (or one a killed session had loaded, or one a resume abandoned) is still to come until
/// a later session loads a larger id without it.
fn left_of(b: u64, k: usize, abandoned: Option<usize>, sessions: &[Session]) -> Left {
    let last = sessions.len() - 1;
    let pending_from = match (abandoned.filter(|&j| j > k), &sessions[k].end) {
        (Some(j), _) => j,
        (None, Some((held, _))) if held.contains(&b) => k + 1,
        // Killed before its end (a later session began), or still running.
        (None, None) => k + 1,
        (None, Some(_)) => return Left::Lost,
    };
    let passed = sessions
        .get(pending_from..)
        .unwrap_or_default()
        .iter()
        .any(|s| s.max_load.is_some_and(|m| m > b));
    if passed {
        return Left::Lost;
    }
    match &sessions[last].end {
        Some((_, true)) => Left::LoadedAhead,
        _ => Left::InFlight,
    }
}

pub fn audit(path: &Path) -> Result<Audit, Error> {
    // Bytes, not text: a line that is not UTF-8 (a torn multi-byte character, a disk
    // error) is named by its line like any other line that is not a record.
    let bytes = std::fs::read(path)
        .map_err(|e| Error::input(format!("{}: cannot read the ledger", path.display()), e))?;
    // Batch id -> the session that loaded it last.
    let mut produced: HashMap<u64, usize> = HashMap::new();
    // The lineage of the current weights: (step, batch) per consumption.
    let mut lineage: Vec<(Option<u64>, u64)> = Vec::new();
    let mut a = Audit::default();
    let mut sessions = vec![Session::default()];
    // Batch id -> the session whose resume abandoned its consumption.
    let mut abandoned_at: HashMap<u64, usize> = HashMap::new();
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
        let ev = v["ev"].as_str().unwrap_or("");
        // A resume begins a session; so does any record after an `end`.
        let resume = ev == "rollback" && v["from"].is_null();
        let cur = sessions.last().expect("a session");
        if cur.end.is_some() || (resume && cur.records > 0) {
            sessions.push(Session::default());
        }
        let k = sessions.len() - 1;
        let s = &mut sessions[k];
        s.records += 1;
        match (ev, batch) {
            ("load", Some(b)) => {
                produced.insert(b, k);
                s.max_load = Some(s.max_load.map_or(b, |m| m.max(b)));
            }
            ("consumed", Some(b)) => lineage.push((v["step"].as_u64(), b)),
            ("rollback", _) => {
                let to = v["to"].as_u64().unwrap_or(0);
                a.rollbacks += 1;
                let (kept, gone): (Vec<_>, Vec<_>) = lineage
                    .into_iter()
                    .partition(|(s, _)| s.is_none_or(|s| s <= to));
                lineage = kept;
                a.abandoned += gone.len() as u64;
                if resume {
                    abandoned_at.extend(gone.into_iter().map(|(_, b)| (b, k)));
                }
            }
            ("requeue", Some(_)) => a.requeued += 1,
            ("duplicate", Some(_)) => a.duplicates_dropped += 1,
            ("end", _) => {
                let held = v["in_flight"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_u64)
                    .collect();
                s.end = Some((held, v["finished"].as_bool().unwrap_or(false)));
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
    a.ended = sessions.last().is_some_and(|s| s.end.is_some());
    for (&b, &k) in &produced {
        if consumed.contains_key(&b) {
            continue;
        }
        match left_of(b, k, abandoned_at.get(&b).copied(), &sessions) {
            Left::InFlight => a.in_flight += 1,
            Left::LoadedAhead => a.loaded_ahead += 1,
            Left::Lost => a.lost += 1,
        }
    }
    // Consumed but never produced: counts as a duplicate of nothing, i.e. corruption.
    a.duplicated += consumed
        .keys()
        .filter(|b| !produced.contains_key(b))
        .count() as u64;
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

    /// The records of a session: `loads` loaded, `consumed` as (step, batch), then its
    /// end holding `held` (`None`: killed before its end).
    fn session(
        resume_to: Option<u64>,
        loads: &[u64],
        consumed: &[(u64, u64)],
        end: Option<(&[u64], bool)>,
    ) -> Vec<String> {
        let mut v = Vec::new();
        if let Some(to) = resume_to {
            v.push(format!(
                r#"{{"ev":"rollback","from":null,"to":{to},"batches":[]}}"#
            ));
        }
        v.extend(
            loads
                .iter()
                .map(|b| format!(r#"{{"ev":"load","batch":{b}}}"#)),
        );
        v.extend(
            consumed
                .iter()
                .map(|(s, b)| format!(r#"{{"ev":"consumed","batch":{b},"step":{s}}}"#)),
        );
        if let Some((held, finished)) = end {
            v.push(format!(
                r#"{{"ev":"end","in_flight":{held:?},"finished":{finished}}}"#
            ));
        }
        v
    }

    fn audit_sessions(sessions: &[Vec<String>]) -> Audit {
        let lines: Vec<String> = sessions.concat();
        audit_of(&lines.iter().map(String::as_str).collect::<Vec<_>>())
    }

    #[test]
    fn what_a_session_held_at_its_end_is_in_flight_until_a_later_session_passes_it() {
        let ids: Vec<u64> = (0..10).collect();
        let first = session(
            None,
            &ids,
            &[(1, 0), (2, 1), (3, 2), (4, 3)],
            Some((&ids[4..], false)),
        );
        // A short resumed session: it loads 4 and 5 again, trains 4, holds 5.
        let short = session(Some(4), &[4, 5], &[(5, 4)], Some((&[5], false)));
        let a = audit_sessions(&[first.clone(), short]);
        assert_eq!((a.consumed_once, a.in_flight, a.lost), (5, 5, 0), "{a:?}");
        // One that loads 7 without 5 and 6 has passed them: those two are lost.
        let skipping = session(Some(4), &[4, 7], &[(5, 4), (6, 7)], Some((&[], false)));
        let a = audit_sessions(&[first.clone(), skipping]);
        assert_eq!((a.in_flight, a.lost), (2, 2), "{a:?}");
        // A run that finished holding batches loaded them ahead; nothing is in flight.
        let finished = session(Some(4), &[4, 5], &[(5, 4)], Some((&[5], true)));
        let a = audit_sessions(&[first, finished]);
        assert_eq!((a.in_flight, a.loaded_ahead, a.lost), (0, 5, 0), "{a:?}");
    }

    #[test]
    fn a_killed_session_and_consumptions_a_resume_abandons_are_loaded_again_not_lost() {
        // Killed with no end record; the resume loads 4 again and ends holding nothing.
        let ids: Vec<u64> = (0..10).collect();
        let killed = session(None, &ids, &[(1, 0), (2, 1), (3, 2), (4, 3)], None);
        let next = session(Some(4), &[4], &[(5, 4)], Some((&[], false)));
        let a = audit_sessions(&[killed, next]);
        assert_eq!((a.in_flight, a.lost), (5, 0), "{a:?}");
        // Steps 5 and 6 abandoned by a resume to the checkpoint of step 4: batches 4 and
        // 5 come again in the next session, even one that loads nothing.
        let ids: Vec<u64> = (0..6).collect();
        let all: Vec<(u64, u64)> = (0..6).map(|b| (b + 1, b)).collect();
        let first = session(None, &ids, &all, Some((&[], false)));
        let empty = session(Some(4), &[], &[], Some((&[], false)));
        let a = audit_sessions(&[first, empty]);
        assert_eq!(
            (a.consumed_once, a.in_flight, a.lost, a.abandoned),
            (4, 2, 0, 2),
            "{a:?}"
        );
    }
}
