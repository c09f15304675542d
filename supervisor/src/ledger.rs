//! The batch ledger: `ledger.jsonl` in the run dir records, per batch id, every place the
//! batch went (loaded, to a target, hidden states made, to a drafter, requeued after a
//! death) and when the optimizer consumed it. `dflash-supervise ledger` audits it.
//!
//! One JSON object per line: `{"t": unix_ms, "ev": EVENT, "batch": ID, "worker": NAME, ...}`
//! with EVENT one of `load`, `to_target`, `hidden`, `to_drafter`, `consumed`, `requeue`,
//! `duplicate`; and a last line `{"ev": "end", "in_flight": [...], "loader_done": bool}`
//! when the supervisor ends.

use std::collections::{BTreeSet, HashMap};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;

use serde::Serialize;
use serde_json::{json, Value};

use crate::error::Error;
use crate::rundir::unix_ms;

pub const LEDGER_FILE: &str = "ledger.jsonl";

pub struct Ledger {
    file: File,
}

impl Ledger {
    pub fn create(run_dir: &Path) -> std::io::Result<Ledger> {
        let file = OpenOptions::new().create(true).append(true).open(run_dir.join(LEDGER_FILE))?;
        Ok(Ledger { file })
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
        let mut line = v.to_string();
        line.push('\n');
        if let Err(e) = self.file.write_all(line.as_bytes()) {
            log::warn!("cannot append to {LEDGER_FILE}: {e}");
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
    pub ended: bool,
}

pub fn audit(path: &Path) -> Result<Audit, Error> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::Usage(format!("{}: cannot read the ledger: {e}", path.display())))?;
    let mut produced = BTreeSet::new();
    let mut consumed: HashMap<u64, u64> = HashMap::new();
    let mut a = Audit::default();
    let mut end_in_flight: Option<BTreeSet<u64>> = None;
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(line)
            .map_err(|e| Error::Usage(format!("{}:{}: not a ledger record: {e}", path.display(), i + 1)))?;
        let batch = v["batch"].as_u64();
        match (v["ev"].as_str().unwrap_or(""), batch) {
            ("load", Some(b)) => {
                produced.insert(b);
            }
            ("consumed", Some(b)) => *consumed.entry(b).or_default() += 1,
            ("requeue", Some(_)) => a.requeued += 1,
            ("duplicate", Some(_)) => a.duplicates_dropped += 1,
            ("end", _) => {
                end_in_flight = Some(v["in_flight"].as_array().into_iter().flatten().filter_map(Value::as_u64).collect());
            }
            _ => {}
        }
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

/// `dflash-supervise ledger`.
pub fn run(args: crate::cli::LedgerArgs) -> Result<i32, Error> {
    let run = crate::rundir::ExistingRun::open(args.run_dir.as_deref())?;
    let a = audit(&run.path.join(LEDGER_FILE))?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&a).map_err(|e| Error::Internal(e.to_string()))?);
    } else {
        println!("ledger of {}", run.path.display());
        println!("  produced         {}", a.produced);
        println!("  consumed once    {}", a.consumed_once);
        println!("  in flight        {}{}", a.in_flight, if a.ended { "" } else { " (the run has not recorded its end)" });
        println!("  lost             {}", a.lost);
        println!("  duplicated       {}", a.duplicated);
        println!("  requeued         {} (given back when the worker holding them ended)", a.requeued);
        println!("  dropped copies   {}", a.duplicates_dropped);
    }
    Ok(if a.lost > 0 || a.duplicated > 0 { dflash_shared::exit_codes::RUN_FAILED } else { dflash_shared::exit_codes::SUCCESS })
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
        assert_eq!((a.produced, a.consumed_once, a.duplicated, a.in_flight, a.lost, a.requeued), (4, 1, 1, 1, 1, 1));
        let live = audit_of(&[r#"{"ev":"load","batch":0}"#]);
        assert_eq!((live.in_flight, live.lost, live.ended), (1, 0, false));
    }
}
