//! The training log `RUN_DIR/train.jsonl`: one JSON line per committed step, eval and
//! rollback, each stamped with the wall-clock time `"t"` (ms since the epoch) as it is
//! written.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;

use crate::error::Error;

/// The log's file name in the run directory.
pub const TRAIN_LOG: &str = "train.jsonl";

/// One line of the training log, without its time.
#[derive(Debug, Clone, PartialEq)]
pub enum LogLine {
    /// A committed step: its fields (step, loss, lr, ...), an object.
    Step(serde_json::Value),
    /// An eval round's result.
    Eval(serde_json::Value),
    /// A real τ measurement (`--eval-prompts`).
    Tau(serde_json::Value),
    /// Every drafter died: the group went back from step `from` to `to` (`source`: the
    /// state it went back to, in words); `batches` go back to the queue.
    Rollback {
        from: u64,
        to: u64,
        batches: usize,
        source: String,
    },
    /// A resumed run goes back to its checkpoint's step: the steps after it in the log
    /// belong to an abandoned lineage.
    Resumed { to: u64 },
    /// `--targets auto` moved a device between the roles (from, to, gpu, step).
    RoleMove(serde_json::Value),
}

impl LogLine {
    /// The line as written at `t` (ms since the epoch).
    pub fn json(&self, t: u64) -> serde_json::Value {
        match self {
            LogLine::Step(fields) => {
                let mut v = fields.clone();
                if let serde_json::Value::Object(m) = &mut v {
                    m.insert("t".into(), t.into());
                }
                v
            }
            LogLine::Eval(r) => serde_json::json!({"t": t, "eval": r}),
            LogLine::Tau(r) => serde_json::json!({"t": t, "tau": r}),
            LogLine::Rollback {
                from,
                to,
                batches,
                source,
            } => {
                serde_json::json!({"t": t, "rollback": {"from": from, "to": to, "batches": batches, "source": source}})
            }
            LogLine::Resumed { to } => {
                serde_json::json!({"t": t, "rollback": {"to": to, "resume": true}})
            }
            LogLine::RoleMove(m) => serde_json::json!({"t": t, "role_move": m}),
        }
    }
}

/// train.jsonl, open for appending.
pub struct TrainLog {
    file: File,
}

impl TrainLog {
    /// Open (or create) `run_dir/train.jsonl` for appending.
    pub fn open(run_dir: &Path) -> Result<TrainLog, Error> {
        let path = run_dir.join(TRAIN_LOG);
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| Error::io("cannot create", path, e))?;
        Ok(TrainLog { file })
    }

    /// Append `line`, stamped with the time now. A line that cannot be written is lost
    /// (the log is a record, not the run's state).
    pub fn write(&mut self, line: &LogLine) {
        let _ = writeln!(self.file, "{}", line.json(crate::run::rundir::unix_ms()));
    }

    /// The evals `run_dir/train.jsonl` records: step → acceptance (the last line of a
    /// step wins). An absent or unreadable log has none.
    pub fn evals(run_dir: &Path) -> BTreeMap<u64, f64> {
        Self::scores(run_dir, "eval", "acceptance")
    }

    /// The τ measurements `run_dir/train.jsonl` records: step → pooled τ.
    pub fn taus(run_dir: &Path) -> BTreeMap<u64, f64> {
        Self::scores(run_dir, "tau", "pooled")
    }

    /// The last line of `run_dir/train.jsonl` that committed `step` (its loss,
    /// acceptance, slot accuracy), if one does.
    pub fn step_line(run_dir: &Path, step: u64) -> Option<serde_json::Value> {
        let text = std::fs::read_to_string(run_dir.join(TRAIN_LOG)).ok()?;
        text.lines()
            .rev()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find(|v| v["step"].as_u64() == Some(step) && v["loss"].is_number())
    }

    /// `{kind: {"step", key}}` lines: step → the value of `key` (the last line wins).
    fn scores(run_dir: &Path, kind: &str, key: &str) -> BTreeMap<u64, f64> {
        let text = std::fs::read_to_string(run_dir.join(TRAIN_LOG)).unwrap_or_default();
        text.lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|v| Some((v[kind]["step"].as_u64()?, v[kind][key].as_f64()?)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_appended_with_their_time_and_evals_read_back() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join(TRAIN_LOG), "{\"step\": 1}\nnot json\n").unwrap();
        let mut log = TrainLog::open(d.path()).unwrap();
        log.write(&LogLine::Step(serde_json::json!({"step": 2, "loss": 1.5})));
        log.write(&LogLine::Eval(
            serde_json::json!({"step": 2, "acceptance": 1.25}),
        ));
        log.write(&LogLine::Eval(
            serde_json::json!({"step": 4, "acceptance": 2.0}),
        ));
        log.write(&LogLine::Eval(
            serde_json::json!({"step": 2, "acceptance": 1.5}),
        ));
        log.write(&LogLine::Resumed { to: 2 });
        log.write(&LogLine::Tau(
            serde_json::json!({"step": 4, "pooled": 2.5, "mean_of_means": 3.0}),
        ));
        let text = std::fs::read_to_string(d.path().join(TRAIN_LOG)).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .skip(2)
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 6);
        assert!(
            lines.iter().all(|l| l["t"].as_u64().is_some_and(|t| t > 0)),
            "{text}"
        );
        assert_eq!(
            (lines[0]["step"].as_u64(), lines[0]["loss"].as_f64()),
            (Some(2), Some(1.5))
        );
        assert_eq!(
            lines[4]["rollback"],
            serde_json::json!({"to": 2, "resume": true})
        );
        assert_eq!(
            TrainLog::evals(d.path()),
            BTreeMap::from([(2, 1.5), (4, 2.0)])
        );
        assert!(TrainLog::evals(&d.path().join("none")).is_empty());
        assert_eq!(TrainLog::taus(d.path()), BTreeMap::from([(4, 2.5)]));
    }

    #[test]
    fn a_rollback_line_names_both_steps_and_its_source() {
        let l = LogLine::Rollback {
            from: 9,
            to: 4,
            batches: 5,
            source: "the snapshot".into(),
        };
        assert_eq!(
            l.json(77),
            serde_json::json!({"t": 77, "rollback": {"from": 9, "to": 4, "batches": 5, "source": "the snapshot"}})
        );
    }
}
