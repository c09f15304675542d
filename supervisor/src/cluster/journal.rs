//! The job's ledger, across nodes: `job.jsonl` in the job's run directory, written by the
//! leader. Each node's own `ledger.jsonl` follows its batches through its pipeline; this one
//! records what the job as a whole consumed, so that `dflash-supervise ledger` can say that
//! every batch of the data was trained exactly once over all the nodes.
//!
//! One JSON object per line, `{"t": unix_ms, "ev": EVENT, ...}`: `start` (the step the
//! session starts from: 0, or its resumed checkpoint's, whose later steps are abandoned),
//! `commit` (`step`, and `batches`: each node's consumed ids), `lost` (`node`, and the ids
//! it held, lent again), `end_of_data` (`batches`: the data's length) and `done` (every
//! batch consumed).

use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;

use serde::Serialize;
use serde_json::{json, Value};

use super::leases::Node;
use crate::error::Error;
use crate::run::rundir::unix_ms;

pub const JOB_LEDGER_FILE: &str = "job.jsonl";

/// The leader's writer of `job.jsonl`.
pub struct Journal {
    file: Option<File>,
}

impl Journal {
    /// A journal that writes nothing (tests of the leader's state).
    #[cfg(test)]
    pub fn none() -> Journal {
        Journal { file: None }
    }

    /// Append to `run_dir/job.jsonl` (a session that cannot write it says so once and
    /// goes on: the nodes' own ledgers still record every batch).
    pub fn open(run_dir: &Path) -> Journal {
        let path = run_dir.join(JOB_LEDGER_FILE);
        let file = OpenOptions::new().create(true).append(true).open(&path);
        if let Err(e) = &file {
            log::warn!("cannot write {}: {e}", path.display());
        }
        Journal { file: file.ok() }
    }

    fn write(&mut self, mut v: Value) {
        let Some(f) = self.file.as_mut() else {
            return;
        };
        v["t"] = json!(unix_ms());
        if let Err(e) = writeln!(f, "{v}") {
            log::warn!("cannot append to {JOB_LEDGER_FILE}: {e}");
            self.file = None;
        }
    }

    pub fn start(&mut self, step: u64) {
        self.write(json!({"ev": "start", "step": step}));
    }

    pub fn commit(&mut self, step: u64, batches: &BTreeMap<Node, Vec<u64>>) {
        self.write(json!({"ev": "commit", "step": step, "batches": batches}));
    }

    pub fn lost(&mut self, node: Node, held: &[u64]) {
        self.write(json!({"ev": "lost", "node": node, "held": held}));
    }

    pub fn end_of_data(&mut self, batches: u64) {
        self.write(json!({"ev": "end_of_data", "batches": batches}));
    }

    pub fn done(&mut self) {
        self.write(json!({"ev": "done"}));
    }
}

/// What `job.jsonl` says of the job's batches, along the lineage of its final weights.
#[derive(Debug, Default, Serialize, PartialEq, Eq)]
pub struct JobAudit {
    /// Nodes that consumed batches.
    pub nodes: u64,
    pub steps: u64,
    pub consumed_once: u64,
    /// Batches consumed more than once (by one node or by two).
    pub duplicated: u64,
    /// Once the data's length is known and the job is done: batches never consumed.
    pub missing: u64,
    /// The data's length, once a node read all of it.
    pub data_batches: Option<u64>,
    /// Every batch of the data consumed (the leader said so).
    pub done: bool,
    /// Nodes lost, and sessions resumed.
    pub losses: u64,
    pub resumes: u64,
}

/// Audit `path` (a job's `job.jsonl`).
pub fn audit(path: &Path) -> Result<JobAudit, Error> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        Error::input(
            format!("{}: cannot read the job's ledger", path.display()),
            e,
        )
    })?;
    let mut a = JobAudit::default();
    // The lineage: step → each node's batches.
    let mut lineage: BTreeMap<u64, BTreeMap<String, Vec<u64>>> = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            // The last line of a leader killed while writing it.
            if i + 1 == text.lines().count() {
                continue;
            }
            return Err(Error::Flag(format!(
                "{}:{}: not a record of the job's ledger",
                path.display(),
                i + 1
            )));
        };
        match v["ev"].as_str() {
            Some("start") => {
                let to = v["step"].as_u64().unwrap_or(0);
                if !lineage.is_empty() {
                    a.resumes += 1;
                }
                lineage.retain(|&s, _| s <= to);
                a.done = false;
            }
            Some("commit") => {
                let step = v["step"].as_u64().unwrap_or(0);
                let batches = serde_json::from_value(v["batches"].clone()).unwrap_or_default();
                lineage.insert(step, batches);
            }
            Some("lost") => a.losses += 1,
            Some("end_of_data") => a.data_batches = v["batches"].as_u64(),
            Some("done") => a.done = true,
            _ => {}
        }
    }
    let mut count: HashMap<u64, u64> = HashMap::new();
    let mut nodes = std::collections::BTreeSet::new();
    for by_node in lineage.values() {
        for (node, ids) in by_node {
            if !ids.is_empty() {
                nodes.insert(node.clone());
            }
            for &b in ids {
                *count.entry(b).or_default() += 1;
            }
        }
    }
    a.nodes = nodes.len() as u64;
    a.steps = lineage.len() as u64;
    a.consumed_once = count.values().filter(|&&n| n == 1).count() as u64;
    a.duplicated = count.values().filter(|&&n| n > 1).count() as u64;
    if let (Some(n), true) = (a.data_batches, a.done) {
        a.missing = (0..n).filter(|b| !count.contains_key(b)).count() as u64;
    }
    Ok(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn journal(dir: &Path) -> Journal {
        Journal::open(dir)
    }

    #[test]
    fn the_audit_follows_the_lineage_over_a_loss_and_a_resume() {
        let tmp = tempfile::tempdir().unwrap();
        let mut j = journal(tmp.path());
        j.start(0);
        let by = |a: &[u64], b: &[u64]| BTreeMap::from([(0, a.to_vec()), (1, b.to_vec())]);
        j.commit(1, &by(&[0], &[1]));
        j.commit(2, &by(&[2], &[3]));
        j.lost(1, &[5]);
        j.commit(3, &by(&[4, 5], &[]));
        // The leader is lost; the job resumes from step 2's checkpoint: step 3 again.
        j.start(2);
        j.commit(3, &by(&[4], &[5]));
        j.end_of_data(6);
        j.commit(4, &by(&[], &[]));
        let a = audit(&tmp.path().join(JOB_LEDGER_FILE)).unwrap();
        assert_eq!(
            (a.steps, a.consumed_once, a.duplicated, a.losses, a.resumes),
            (4, 6, 0, 1, 1)
        );
        assert_eq!((a.data_batches, a.done, a.missing), (Some(6), false, 0));
        // Done without batch 6 of 7: one missing; a batch consumed twice: duplicated.
        j.end_of_data(7);
        j.commit(5, &by(&[0], &[]));
        j.done();
        let a = audit(&tmp.path().join(JOB_LEDGER_FILE)).unwrap();
        assert_eq!((a.missing, a.duplicated, a.done), (1, 1, true));
        // A torn last line is the end of a killed leader's file, not an error.
        std::fs::OpenOptions::new()
            .append(true)
            .open(tmp.path().join(JOB_LEDGER_FILE))
            .unwrap()
            .write_all(b"{\"ev\": \"comm")
            .unwrap();
        assert!(audit(&tmp.path().join(JOB_LEDGER_FILE)).is_ok());
    }
}
