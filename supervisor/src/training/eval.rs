//! Held-out evaluation (`--eval-data FILE`, `--eval-every N`): the eval loss and the
//! acceptance-length estimate over the whole eval set, at the weights of one committed
//! step, and the best checkpoint by eval acceptance (`checkpoints/best`).
//!
//! # How a round runs
//! The eval file is read once at the start, into token batches cut as the training data
//! is (same loader, tokenizer and chat template, token budget and `--max-seq-len`). When
//! step S commits and S is an eval step (a multiple of `--eval-every`, or the run's last
//! step), an *eval round* starts:
//! - The eval batches enter the pipeline with ids of their own (bit 62 set, the round and
//!   the batch's index in the eval set below it: [`dflash_shared::batch::eval_batch_id`]),
//!   so no ledger audit can take one for a training batch, and a drafter never trains on
//!   one: it scores it forward only ([`FromWorker::Evaluated`]), at its current weights,
//!   and the slot is freed.
//! - The group commits no step while the round runs (the trainer holds step S + 1's
//!   commit), so every eval batch is scored at exactly the weights of S; each report
//!   names the weights' step and a report of another step is refused. Ranks may still
//!   compute the next gradient meanwhile (scoring does not touch the gradient).
//! - The pipeline pauses training traffic: no new token slots for the loader, no training
//!   token batches to targets, no training hidden batches to drafters; eval batches get
//!   credits of their own. Where the pools are full of training batches that nobody can
//!   take until the round ends, READY training batches are withdrawn and sent through
//!   again after it (they are kept for rollbacks anyway), so a round cannot deadlock on
//!   pool space. This is simpler to reason about than interleaving, and costs at most a
//!   few batches' target forwards per round.
//! - Deaths need nothing special: a dead worker's slots go back to their queue, eval
//!   batches included, and a joining drafter joins at step S (nothing commits after it).
//!   A rollback to before S drops the round with a line (step S commits again later, and
//!   its round runs then); stale reports of a dropped round only free their slot.
//! - When every eval batch of the round is in, one record goes to `train.jsonl`
//!   (`{"t", "eval": {"step", "loss", "acceptance", ...}}`), the console, the metrics and
//!   the report, and the held commit goes ahead.
//!
//! # Best checkpoint
//! Every eval step is also a checkpoint step, so the best eval names a checkpoint:
//! `checkpoints/best` is a symbolic link to `step-NNNNNNNN` (relative), replaced
//! atomically, written once both the eval and that step's checkpoint are complete. Readers
//! that list `step-N` directories ignore it (its name is not one), and pruning by
//! `--keep-checkpoints` never removes the step it points at.
//!
//! [`FromWorker::Evaluated`]: dflash_shared::protocol::FromWorker::Evaluated

use crate::violation::Violation;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Instant;

use dflash_shared::batch::{eval_batch_id, eval_batch_parts, TokenBatch, MAX_EVAL_BATCHES};
use dflash_shared::drafter::StepStats;

use crate::data::loader::{DataSource, Loader, LoaderConfig};

/// Name of the best checkpoint's link in the checkpoints directory.
pub const BEST_LINK: &str = "best";

/// Why the eval set cannot be used: one line naming the file.
#[derive(Debug, thiserror::Error)]
pub enum EvalDataError {
    #[error("--eval-data {path}: cannot read it: {source} (expected a JSONL file of held-out lines, in the formats --data takes)")]
    Unreadable {
        path: String,
        source: std::io::Error,
    },
    #[error("--eval-data {path}: {words}")]
    Bad { path: String, words: String },
    #[error("--eval-data {path}: no usable sample (expected JSONL lines like {{\"input_ids\": [1, 2, 3], \"loss_mask\": [0, 1, 1]}}, or chat lines)")]
    Empty { path: String },
    #[error("--eval-data {path}: {batches} batches, more than the {max} an eval set may have")]
    TooBig {
        path: String,
        batches: u64,
        max: u64,
    },
}

impl From<EvalDataError> for crate::error::Error {
    fn from(e: EvalDataError) -> crate::error::Error {
        crate::error::Error::Flag(e.to_string())
    }
}

/// The held-out set, as token batches (their ids are their index).
#[derive(Debug, Clone)]
pub struct EvalSet {
    pub path: PathBuf,
    pub batches: Vec<TokenBatch>,
    /// Real tokens and rows over the whole set.
    pub tokens: u64,
    pub rows: u64,
}

impl EvalSet {
    /// Read `path` with the training loader's settings (`train`), once, whole.
    pub fn load(path: &Path, train: &LoaderConfig) -> Result<EvalSet, EvalDataError> {
        let shown = path.display().to_string();
        let meta = std::fs::metadata(path).map_err(|e| EvalDataError::Unreadable {
            path: shown.clone(),
            source: e,
        })?;
        if meta.is_dir() {
            return Err(EvalDataError::Bad {
                path: shown,
                words: "is a directory; expected a JSONL file".into(),
            });
        }
        std::fs::File::open(path).map_err(|e| EvalDataError::Unreadable {
            path: shown.clone(),
            source: e,
        })?;
        if meta.len() == 0 {
            return Err(EvalDataError::Empty { path: shown });
        }
        let mut cfg = train.clone();
        cfg.source = DataSource::Files(vec![path.to_path_buf()]);
        cfg.epochs = 1;
        let mut loader = Loader::new(cfg);
        let mut batches = Vec::new();
        loop {
            match loader.next_batch() {
                Ok(Some(b)) => batches.push(b),
                Ok(None) => break,
                Err(crate::data::loader::LoaderError::Empty { .. }) => {
                    return Err(EvalDataError::Empty { path: shown })
                }
                Err(e) => {
                    // The loader's words name `--data PATH`: this is the eval file.
                    let words = e.to_string();
                    let words = words
                        .strip_prefix(&format!("--data {shown}: "))
                        .map(str::to_string)
                        .unwrap_or(words);
                    return Err(EvalDataError::Bad { path: shown, words });
                }
            }
        }
        if batches.is_empty() {
            return Err(EvalDataError::Empty { path: shown });
        }
        if batches.len() as u64 > MAX_EVAL_BATCHES {
            return Err(EvalDataError::TooBig {
                path: shown,
                batches: batches.len() as u64,
                max: MAX_EVAL_BATCHES,
            });
        }
        for (i, b) in batches.iter_mut().enumerate() {
            b.batch_id = i as u64;
        }
        Ok(EvalSet {
            path: path.to_path_buf(),
            tokens: batches.iter().map(|b| b.tokens()).sum(),
            rows: batches.iter().map(|b| b.rows() as u64).sum(),
            batches,
        })
    }

    /// The batches of round `round`, with their eval ids.
    pub fn round_batches(&self, round: u64) -> Vec<TokenBatch> {
        self.batches
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let mut b = b.clone();
                b.batch_id = eval_batch_id(round, i as u64);
                b
            })
            .collect()
    }
}

/// One round in progress.
#[derive(Debug)]
pub struct Round {
    pub round: u64,
    /// The weights it scores.
    pub step: u64,
    /// Indices (in the eval set) not reported yet.
    pub waiting: BTreeSet<u64>,
    pub stats: StepStats,
    pub started: Instant,
}

/// Where the evaluation is.
#[derive(Debug)]
pub enum State {
    Idle,
    Running(Round),
}

/// A report the evaluator takes, or why not.
#[derive(Debug, PartialEq, Eq)]
pub enum Report {
    /// Counted; `done`: it was the round's last.
    Counted { done: bool },
    /// Of a round that is over (dropped, or a copy): its slot is freed, nothing else.
    Stale,
    /// Of the running round but at the wrong weights, or an index it does not have: a
    /// protocol violation.
    Wrong(Violation),
}

/// A finished round, as recorded.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalResult {
    pub step: u64,
    pub loss: f64,
    pub acceptance: f64,
    pub slot_accuracy: Vec<f64>,
    pub tokens: u64,
    pub blocks: u64,
    pub anchors: u64,
    pub batches: u64,
    pub ms: f64,
}

impl EvalResult {
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "step": self.step, "loss": self.loss, "acceptance": self.acceptance,
            "slot_accuracy": self.slot_accuracy, "tokens": self.tokens, "blocks": self.blocks,
            "anchors": self.anchors, "batches": self.batches, "ms": self.ms,
        })
    }
}

pub struct Evaluator {
    pub set: EvalSet,
    pub every: u64,
    pub state: State,
    next_round: u64,
    /// Steps already evaluated in this lineage (a rollback forgets those after it).
    pub done: BTreeSet<u64>,
    /// The best eval so far: (step, acceptance).
    pub best: Option<(u64, f64)>,
    pub last: Option<EvalResult>,
}

impl Evaluator {
    pub fn new(set: EvalSet, every: u64) -> Evaluator {
        Evaluator {
            set,
            every: every.max(1),
            state: State::Idle,
            next_round: 0,
            done: BTreeSet::new(),
            best: None,
            last: None,
        }
    }

    /// Is `step` one of the periodic eval steps?
    pub fn is_eval_step(&self, step: u64) -> bool {
        step > 0 && step % self.every == 0
    }

    pub fn running(&self) -> Option<&Round> {
        match &self.state {
            State::Running(r) => Some(r),
            State::Idle => None,
        }
    }

    /// Start a round at the weights of `step`; returns its number and its batches (for
    /// the pipeline). `None` when this step was evaluated already or a round runs.
    pub fn start(&mut self, step: u64) -> Option<(u64, Vec<TokenBatch>)> {
        if self.running().is_some() || self.done.contains(&step) {
            return None;
        }
        let round = self.next_round;
        self.next_round += 1;
        self.state = State::Running(Round {
            round,
            step,
            waiting: (0..self.set.batches.len() as u64).collect(),
            stats: StepStats::default(),
            started: Instant::now(),
        });
        Some((round, self.set.round_batches(round)))
    }

    /// A drafter scored eval batch `batch_id` at the weights of `step`.
    pub fn report(&mut self, batch_id: u64, step: u64, stats: &StepStats) -> Report {
        let (round, index) = eval_batch_parts(batch_id);
        let State::Running(r) = &mut self.state else {
            return Report::Stale;
        };
        if round != r.round {
            return Report::Stale;
        }
        if step != r.step {
            return Report::Wrong(Violation::EvalAtOtherWeights {
                index,
                round,
                step,
                evaluates: r.step,
            });
        }
        if !r.waiting.remove(&index) {
            if index < self.set.batches.len() as u64 {
                // A second copy (redelivered after a death that raced the report).
                return Report::Stale;
            }
            return Report::Wrong(Violation::NotInEvalSet {
                index,
                batches: self.set.batches.len(),
            });
        }
        r.stats.merge(stats);
        Report::Counted {
            done: r.waiting.is_empty(),
        }
    }

    /// The running round is complete: its result; `best` says it is the best so far.
    pub fn finish(&mut self) -> Option<(EvalResult, bool)> {
        let State::Running(r) = std::mem::replace(&mut self.state, State::Idle) else {
            return None;
        };
        let s = &r.stats;
        let result = EvalResult {
            step: r.step,
            loss: s.loss(),
            acceptance: s.acceptance(),
            slot_accuracy: s
                .slot_correct
                .iter()
                .zip(&s.slot_total)
                .skip(1)
                .map(|(c, t)| if *t > 0 { *c as f64 / *t as f64 } else { 0.0 })
                .collect(),
            tokens: s.tokens,
            blocks: s.blocks,
            anchors: s.anchors,
            batches: self.set.batches.len() as u64,
            ms: r.started.elapsed().as_secs_f64() * 1e3,
        };
        self.done.insert(r.step);
        let best =
            result.acceptance.is_finite() && self.best.is_none_or(|(_, a)| result.acceptance > a);
        if best {
            self.best = Some((r.step, result.acceptance));
        }
        self.last = Some(result.clone());
        Some((result, best))
    }

    /// The group rolled back to `to`: a round of a later step is dropped (returns its
    /// step), and later steps are to be evaluated again. A best eval of a later step is
    /// forgotten (its checkpoint is set aside with the abandoned lineage).
    pub fn rolled_back(&mut self, to: u64) -> Option<u64> {
        self.done.retain(|&s| s <= to);
        if self.best.is_some_and(|(s, _)| s > to) {
            self.best = None;
        }
        match &self.state {
            State::Running(r) if r.step > to => {
                let step = r.step;
                self.state = State::Idle;
                Some(step)
            }
            _ => None,
        }
    }
}

/// Point `checkpoints/best` at `step-NNNNNNNN` (relative), atomically: a new link beside
/// it, renamed over it.
pub fn link_best(checkpoints: &Path, step: u64) -> std::io::Result<()> {
    let target = format!("step-{step:08}");
    let tmp = checkpoints.join(format!(".{BEST_LINK}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(&target, &tmp)?;
    std::fs::rename(&tmp, checkpoints.join(BEST_LINK))
}

/// The step `checkpoints/best` points at, if it is a link to a step directory.
pub fn best_step(checkpoints: &Path) -> Option<u64> {
    let t = std::fs::read_link(checkpoints.join(BEST_LINK)).ok()?;
    dflash_shared::checkpoint::step_of_dir(&t.to_string_lossy())
}

/// The step `checkpoints/best` points at when that checkpoint is not there (set aside or
/// removed since): the link dangles. `None` when it is there, or there is no such link.
pub fn dangling_best(checkpoints: &Path) -> Option<u64> {
    let step = best_step(checkpoints)?;
    let meta = checkpoints
        .join(format!("step-{step:08}"))
        .join(dflash_shared::checkpoint::META_FILE);
    (!meta.is_file()).then_some(step)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(loss: f64, accept: f64) -> StepStats {
        StepStats {
            loss_sum: loss,
            weight_sum: 1.0,
            accept_sum: accept,
            blocks: 1,
            tokens: 10,
            slot_correct: vec![1, 1],
            slot_total: vec![1, 1],
            ..Default::default()
        }
    }

    fn set(n: usize) -> EvalSet {
        let b = TokenBatch {
            batch_id: 0,
            seq_len: 2,
            lengths: vec![2],
            input_ids: vec![1, 2],
            loss_mask: vec![1, 1],
        };
        EvalSet {
            path: "eval.jsonl".into(),
            batches: vec![b; n],
            tokens: 2 * n as u64,
            rows: n as u64,
        }
    }

    #[test]
    fn a_round_completes_once_every_batch_is_in_at_the_rounds_step_and_the_best_is_the_highest_acceptance(
    ) {
        let mut e = Evaluator::new(set(2), 2);
        let (round, batches) = e.start(2).unwrap();
        assert_eq!(batches.len(), 2);
        assert!(e.start(2).is_none(), "one round at a time");
        let ids: Vec<u64> = batches.iter().map(|b| b.batch_id).collect();
        assert!(matches!(
            e.report(ids[0], 3, &stats(1.0, 2.0)),
            Report::Wrong(_)
        ));
        assert_eq!(
            e.report(ids[0], 2, &stats(1.0, 2.0)),
            Report::Counted { done: false }
        );
        assert_eq!(e.report(ids[0], 2, &stats(1.0, 2.0)), Report::Stale);
        assert_eq!(
            e.report(ids[1], 2, &stats(3.0, 4.0)),
            Report::Counted { done: true }
        );
        let (r, best) = e.finish().unwrap();
        assert!(best);
        assert_eq!((r.step, r.loss, r.acceptance, r.tokens), (2, 2.0, 3.0, 20));
        assert!(e.start(2).is_none(), "step 2 is evaluated");
        let (round2, b2) = e.start(4).unwrap();
        assert_ne!(round, round2);
        // A report of the first round is stale now.
        assert_eq!(e.report(ids[1], 4, &stats(1.0, 1.0)), Report::Stale);
        for b in &b2 {
            e.report(b.batch_id, 4, &stats(1.0, 1.0));
        }
        let (_, best) = e.finish().unwrap();
        assert!(!best, "a lower acceptance is not the best");
        assert_eq!(e.best, Some((2, 3.0)));
    }

    #[test]
    fn a_rollback_before_the_rounds_step_drops_it() {
        let mut e = Evaluator::new(set(1), 2);
        e.start(4).unwrap();
        assert_eq!(e.rolled_back(3), Some(4));
        assert!(e.running().is_none());
        assert!(e.start(4).is_some(), "step 4 is evaluated again");
    }

    #[test]
    fn the_best_link_names_its_step_and_is_replaced() {
        let d = tempfile::tempdir().unwrap();
        link_best(d.path(), 4).unwrap();
        assert_eq!(best_step(d.path()), Some(4));
        assert_eq!(dangling_best(d.path()), Some(4), "no step-00000004 yet");
        let step = d.path().join("step-00000004");
        std::fs::create_dir(&step).unwrap();
        std::fs::write(step.join(dflash_shared::checkpoint::META_FILE), "{}").unwrap();
        assert_eq!(dangling_best(d.path()), None);
        link_best(d.path(), 8).unwrap();
        assert_eq!(best_step(d.path()), Some(8));
        assert_eq!(
            std::fs::read_link(d.path().join(BEST_LINK)).unwrap(),
            Path::new("step-00000008")
        );
    }

    #[test]
    fn a_missing_or_empty_eval_file_is_refused_naming_it() {
        let d = tempfile::tempdir().unwrap();
        let cfg = LoaderConfig {
            source: DataSource::Demo { samples: 1 },
            vocab_size: Some(512),
            token_budget: 4096,
            max_seq_len: 256,
            seed: 0,
            epochs: 1,
            max_bad_lines: 10,
            shuffle_window: 64,
            max_line_bytes: 1 << 20,
            chat: None,
            chat_error: None,
        };
        let missing = d.path().join("nope.jsonl");
        let e = EvalSet::load(&missing, &cfg).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!(
                "--eval-data {}: cannot read it",
                missing.display()
            )),
            "{e}"
        );
        let empty = d.path().join("empty.jsonl");
        std::fs::write(&empty, "").unwrap();
        let e = EvalSet::load(&empty, &cfg).unwrap_err().to_string();
        assert!(
            e.contains("no usable sample") && e.contains("empty.jsonl"),
            "{e}"
        );
        let lines = d.path().join("eval.jsonl");
        std::fs::write(
            &lines,
            "{\"input_ids\": [1, 2, 3, 4], \"loss_mask\": [0, 1, 1, 1]}\n{\"input_ids\": [5, 6, 7], \"loss_mask\": [1, 1, 1]}\n",
        )
        .unwrap();
        let s = EvalSet::load(&lines, &cfg).unwrap();
        assert_eq!((s.tokens, s.rows), (7, 2));
    }
}
