//! The data preflight report (printed by `prepare` and at the start of a run, written to
//! `preflight.json`); `prepare` and `bench prepare` use it (in [`crate::commands::prepare`]).

use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Serialize;

use crate::data::chat::Chat;
use crate::data::loader::{self, DataSource, JsonlStream, LoaderConfig, Sample};
use crate::error::Error;

/// The tokenizer and chat template for chat data: `--tokenizer DIR` (an error there is
/// exit 2), else the target directory when it has a `tokenizer.json` (an error there is
/// reported with each chat line, since pre-tokenized data needs no template).
pub fn load_chat(
    explicit: Option<&Path>,
    target: Option<&Path>,
) -> Result<(Option<Arc<Chat>>, Option<String>), Error> {
    if let Some(dir) = explicit {
        return Chat::load(dir)
            .map(|c| (Some(Arc::new(c)), None))
            .map_err(|e| Error::input("--tokenizer", e));
    }
    match target {
        Some(dir) if dir.join("tokenizer.json").is_file() => match Chat::load(dir) {
            Ok(c) => Ok((Some(Arc::new(c)), None)),
            Err(e) => Ok((None, Some(e.to_string()))),
        },
        Some(dir) => Ok((
            None,
            Some(format!(
                "{} has no tokenizer.json; give --tokenizer DIR",
                dir.display()
            )),
        )),
        None => Ok((
            None,
            Some(
                "the built-in tiny target has no tokenizer; give --target DIR or --tokenizer DIR"
                    .into(),
            ),
        )),
    }
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Lengths {
    pub min: u64,
    pub p50: u64,
    pub p90: u64,
    pub p99: u64,
    pub max: u64,
}

/// What the data holds, before any worker starts.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub data: String,
    /// Whether every line was read (a run reads only the first --preflight-lines).
    pub complete: bool,
    /// Share of the input's bytes read (1 when complete; null for stdin).
    pub bytes_share: Option<f64>,
    pub lines: u64,
    pub kept: u64,
    /// Dropped lines by reason (bad lines and samples a drafter cannot train on).
    pub dropped: BTreeMap<String, u64>,
    /// Token lengths of the kept samples, after truncation.
    pub lengths: Option<Lengths>,
    pub max_seq_len: u32,
    /// Kept samples cut at --max-seq-len.
    pub truncated: u64,
    pub tokens: u64,
    pub supervised_tokens: u64,
    pub supervised_share: f64,
    /// Samples with no supervised token at all (dropped).
    pub no_supervised_token: u64,
    /// Kept samples equal to an earlier kept sample (tokens and mask).
    pub duplicates: u64,
    pub chat_samples: u64,
    /// Chat samples whose rendering never held the template's assistant header.
    pub marker_missing: u64,
    pub assistant_header: Option<String>,
    /// SHA-256 of the chat template the chat samples were rendered with (`None`: none
    /// loaded), and the chat samples by the thinking switch they were rendered with ("on",
    /// "off", "template default"): what the export records, so that τ and serving can be
    /// measured under the conditions of training.
    pub chat_template_sha256: Option<String>,
    pub thinking: BTreeMap<String, u64>,
    pub token_budget: u32,
    pub drafters: u32,
    /// Estimated batches and optimizer steps per epoch (extrapolated by bytes when only
    /// part of the data was read).
    pub batches_per_epoch: u64,
    pub steps_per_epoch: u64,
}

/// A sample was dropped because no two consecutive tokens are supervised.
pub const UNSUPERVISED: &str = "no two consecutive supervised tokens";

/// Read the data as the run would (same parsing, truncation and drop rules), up to `limit`
/// lines, calling `keep` for each sample a run would train on, in input order.
pub fn scan(
    cfg: &LoaderConfig,
    limit: Option<u64>,
    drafters: u32,
    mut keep: impl FnMut(&Sample) -> std::io::Result<()>,
) -> Result<Report, Error> {
    let data = cfg.describe();
    let mut stream = JsonlStream::new(&cfg.source)?;
    stream.line_limit = limit;
    let mut bad = loader::BadLines::default();
    let mut lengths = Vec::new();
    let (
        mut truncated,
        mut tokens,
        mut supervised,
        mut no_supervised,
        mut dup,
        mut chat,
        mut missing,
    ) = (0, 0, 0, 0, 0, 0, 0);
    let (mut seen, mut thinking) = (HashSet::new(), BTreeMap::<&str, u64>::new());
    let mut progress = crate::telemetry::console::ByteProgress::new(
        "reading the data",
        "samples",
        stream.total_bytes,
    );
    while let Some(p) = stream.next_parsed(&mut bad, cfg)? {
        if bad.lines % 256 == 0 {
            progress.update(stream.bytes_read, lengths.len() as u64);
        }
        if p.chat {
            chat += 1;
            missing += u64::from(p.marker_missing);
            *thinking.entry(thinking_name(p.thinking)).or_default() += 1;
        }
        if !p.usable() {
            bad.unusable(&p, cfg.max_seq_len);
            no_supervised += u64::from(!p.sample.mask[..p.len].contains(&1));
            continue;
        }
        // What a run trains on is cut at --max-seq-len; `keep` gets the whole sample.
        truncated += u64::from(p.sample.ids.len() > p.len);
        keep(&p.sample)
            .map_err(|e| Error::io("cannot write the prepared samples to", "--out", e))?;
        let s = &p.truncated();
        tokens += s.ids.len() as u64;
        supervised += s.mask.iter().map(|&m| m as u64).sum::<u64>();
        lengths.push(s.ids.len() as u64);
        let mut h = Vec::with_capacity(s.ids.len() * 5);
        h.extend(s.ids.iter().flat_map(|t| t.to_le_bytes()));
        h.extend(&s.mask);
        if !seen.insert(dflash_shared::batch::checksum(&h)) {
            dup += 1;
        }
    }
    // Stopped by the line limit with bytes left: a sample of the data.
    let complete = !(limit.is_some_and(|l| stream.lines_read >= l)
        && stream.total_bytes.is_none_or(|t| stream.bytes_read < t));
    let bytes_share = stream.total_bytes.map(|t| {
        if complete || t == 0 {
            1.0
        } else {
            stream.bytes_read as f64 / t as f64
        }
    });
    let batches = estimate_batches(&lengths, cfg.token_budget);
    let batches = match bytes_share {
        Some(s) if s > 0.0 && !complete => (batches as f64 / s).round() as u64,
        _ => batches,
    };
    Ok(Report {
        data,
        complete,
        bytes_share,
        lines: bad.lines,
        kept: lengths.len() as u64,
        dropped: dropped(&bad, cfg.max_seq_len),
        lengths: Lengths::of(&mut lengths),
        max_seq_len: cfg.max_seq_len,
        truncated,
        tokens,
        supervised_tokens: supervised,
        supervised_share: if tokens > 0 {
            supervised as f64 / tokens as f64
        } else {
            0.0
        },
        no_supervised_token: no_supervised,
        duplicates: dup,
        chat_samples: chat,
        marker_missing: missing,
        assistant_header: cfg.chat.as_ref().map(|c| c.header.clone()),
        chat_template_sha256: cfg.chat.as_ref().map(|c| c.template_sha256.clone()),
        thinking: thinking.into_iter().map(|(k, n)| (k.into(), n)).collect(),
        token_budget: cfg.token_budget,
        drafters,
        batches_per_epoch: batches,
        steps_per_epoch: batches.div_ceil(drafters.max(1) as u64),
    })
}

/// A thinking switch in words: "on", "off", or "template default" (not passed).
pub fn thinking_name(t: Option<bool>) -> &'static str {
    match t {
        Some(true) => "on",
        Some(false) => "off",
        None => "template default",
    }
}

impl Report {
    /// The one thinking switch every chat sample was rendered with: `None` when there is
    /// no chat sample or they differ.
    pub fn thinking_mode(&self) -> Option<Option<bool>> {
        match self.thinking.keys().map(String::as_str).collect::<Vec<_>>()[..] {
            ["on"] => Some(Some(true)),
            ["off"] => Some(Some(false)),
            ["template default"] => Some(None),
            _ => None,
        }
    }
}

/// The lines dropped, by reason: those the loader gives, the samples with nothing to
/// train on, and those cut by `--max-seq-len`.
fn dropped(bad: &loader::BadLines, max_seq_len: u32) -> BTreeMap<String, u64> {
    let mut dropped = bad.by_reason.clone();
    if bad.unsupervised > 0 {
        dropped.insert(UNSUPERVISED.into(), bad.unsupervised);
    }
    if bad.cut_by_max_seq_len > 0 {
        dropped.insert(loader::cut_reason(max_seq_len), bad.cut_by_max_seq_len);
    }
    dropped
}

impl Lengths {
    /// The quantiles of the samples' `lengths` (sorted here); `None` for no sample.
    fn of(lengths: &mut [u64]) -> Option<Lengths> {
        lengths.sort_unstable();
        let pct = |p: f64| lengths[((lengths.len() - 1) as f64 * p).round() as usize];
        (!lengths.is_empty()).then(|| Lengths {
            min: lengths[0],
            p50: pct(0.5),
            p90: pct(0.9),
            p99: pct(0.99),
            max: *lengths.last().expect("non-empty"),
        })
    }
}

/// Batches of one epoch as the loader cuts them (length-sorted, rows × longest row within
/// the budget), over the whole set at once instead of shuffle windows.
fn estimate_batches(lengths: &[u64], budget: u32) -> u64 {
    let mut sorted = lengths.to_vec();
    sorted.sort_unstable();
    let (mut batches, mut rows) = (0u64, 0u64);
    for &len in &sorted {
        if rows > 0 && (rows + 1) * len > budget as u64 {
            batches += 1;
            rows = 0;
        }
        rows += 1;
    }
    batches + u64::from(rows > 0)
}

impl Report {
    /// Exit 2 with one line when a run would have nothing to train on.
    pub fn check(&self) -> Result<(), Error> {
        if self.kept == 0 {
            let reasons: Vec<String> = self
                .dropped
                .iter()
                .map(|(r, n)| format!("{r}: {n}"))
                .collect();
            return Err(Error::Flag(format!(
                "--data {}: no usable sample, nothing would be supervised ({} lines read{}{}); expected lines with input_ids and loss_mask, or chat with assistant replies",
                self.data,
                self.lines,
                if reasons.is_empty() { String::new() } else { format!("; dropped: {}", reasons.join(", ")) },
                if self.complete { "" } else { ", in the lines the preflight read" },
            )));
        }
        Ok(())
    }

    /// Warnings a person should see (also printed in `text`).
    pub fn warnings(&self) -> Vec<String> {
        let mut w = Vec::new();
        if self.chat_samples > 0 && self.marker_missing > 0 {
            w.push(format!(
                "the chat template's assistant marker {:?} was not found in {} of {} conversations: the data and the template may not match (nothing of those is trained)",
                self.assistant_header.as_deref().unwrap_or(""),
                self.marker_missing,
                self.chat_samples
            ));
        }
        if self.kept > 0 && self.duplicates * 10 > self.kept {
            w.push(format!(
                "{} of {} kept samples repeat an earlier one",
                self.duplicates, self.kept
            ));
        }
        w
    }

    pub fn text(&self) -> String {
        let mut t = String::new();
        let scope = match (self.complete, self.bytes_share) {
            (true, _) => "all lines".to_string(),
            (false, Some(s)) => format!(
                "the first {} lines, {:.1}% of the bytes",
                self.lines,
                s * 100.0
            ),
            (false, None) => format!("the first {} lines", self.lines),
        };
        t += &format!("data preflight: {} ({scope})\n", self.data);
        let dropped: u64 = self.dropped.values().sum();
        t += &format!(
            "  samples        {} read, {} kept, {} dropped",
            self.lines, self.kept, dropped
        );
        if !self.dropped.is_empty() {
            t += &format!(
                " ({})",
                self.dropped
                    .iter()
                    .map(|(r, n)| format!("{r}: {n}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        t += "\n";
        if let Some(l) = &self.lengths {
            t += &format!("  tokens/sample  min {}, p50 {}, p90 {}, p99 {}, max {}; {} truncated at --max-seq-len {}\n", l.min, l.p50, l.p90, l.p99, l.max, self.truncated, self.max_seq_len);
        }
        t += &format!(
            "  supervised     {:.1}% of {} tokens; {} samples with no supervised token\n",
            self.supervised_share * 100.0,
            self.tokens,
            self.no_supervised_token
        );
        t += &format!("  duplicates     {}\n", self.duplicates);
        if self.chat_samples > 0 {
            let by: Vec<String> = self
                .thinking
                .iter()
                .map(|(k, n)| match k.as_str() {
                    "template default" => format!("{n} thinking as the template defaults"),
                    k => format!("{n} thinking {k}"),
                })
                .collect();
            t += &format!(
                "  chat           {} conversations rendered with the chat template (sha256 {}): {}\n",
                self.chat_samples,
                self.chat_template_sha256
                    .as_deref()
                    .map_or("-", |h| &h[..h.len().min(12)]),
                by.join(", ")
            );
        }
        t += &format!(
            "  per epoch      ~{} batches at --token-budget {}, ~{} steps with {} drafter{}\n",
            self.batches_per_epoch,
            self.token_budget,
            self.steps_per_epoch,
            self.drafters,
            if self.drafters == 1 { "" } else { "s" }
        );
        for w in self.warnings() {
            t += &format!("  warning: {w}\n");
        }
        t
    }

    pub fn write_json(&self, path: &Path) -> Result<(), Error> {
        let text = serde_json::to_string_pretty(self)
            .map_err(|e| Error::json("the preflight report", e))?;
        write_atomic(path, text.as_bytes()).map_err(|e| Error::io("cannot write", path, e))
    }
}

pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = tmp_path(path);
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

pub(crate) fn tmp_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map_or_else(|| "out".into(), |n| n.to_string_lossy().into_owned());
    path.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

/// The report a run prints at start and keeps as `preflight.json`; `None` for demo data
/// and stdin (read once, so it cannot be read ahead).
pub fn at_start(cfg: &LoaderConfig, lines: u64, drafters: u32) -> Result<Option<Report>, Error> {
    if !matches!(cfg.source, DataSource::Files(_)) {
        return Ok(None);
    }
    let r = scan(cfg, (lines > 0).then_some(lines), drafters, |_| Ok(()))?;
    for line in r.text().lines() {
        log::info!("{line}");
    }
    r.check()?;
    Ok(Some(r))
}

/// Synthetic chat lines for `bench prepare`: multi-turn, system prompts, code, non-ASCII,
/// `<think>` blocks; about 700 tokens each, a little above the public DFlash training data.
pub fn synthetic_conversations(n: usize, seed: u64) -> Vec<String> {
    let mut rng = dflash_shared::rng::Rng::new(seed);
    (0..n)
        .map(|i| {
            let mut msgs = Vec::new();
            if i % 3 == 0 {
                msgs.push(serde_json::json!({"role": "system", "content": synthetic_text(12, &mut rng)}));
            }
            let turns = 1 + rng.below(3) as usize;
            for t in 0..turns {
                msgs.push(serde_json::json!({"role": "user", "content": synthetic_text(20 + rng.below(60) as usize, &mut rng)}));
                let mut reply = synthetic_text(80 + rng.below(200) as usize, &mut rng);
                if t + 1 == turns && i % 4 == 0 {
                    reply = format!("<think>\n{}\n</think>\n\n{reply}", synthetic_text(40, &mut rng));
                }
                if i % 5 == 0 {
                    reply.push_str("\n```rust\nfn add(a: i32, b: i32) -> i32 {\n    a + b\n}\n```\n");
                }
                msgs.push(serde_json::json!({"role": "assistant", "content": reply}));
            }
            if i % 2 == 0 {
                serde_json::json!({"messages": msgs}).to_string()
            } else {
                sharegpt(&msgs)
            }
        })
        .collect()
}

/// The words of [`synthetic_conversations`]: prose, code, non-ASCII.
const SYNTHETIC_WORDS: &[&str] = &[
    "the",
    "model",
    "drafter",
    "token",
    "block",
    "attention",
    "because",
    "answer",
    "prime",
    "number",
    "function",
    "returns",
    "value",
    "first",
    "second",
    "then",
    "so",
    "we",
    "compute",
    "sum",
    "of",
    "each",
    "step",
    "gradient",
    "learning",
    "rate",
    "is",
    "a",
    "in",
    "écoute",
    "größer",
    "数据",
    "训练",
    "模型",
    "🙂",
    "x",
    "=",
    "+",
    "(",
    ")",
    "42",
    "3.14",
    "let",
    "fn",
    "return",
    "if",
    "else",
];

/// `words` random words of [`SYNTHETIC_WORDS`], with some line breaks and punctuation.
fn synthetic_text(words: usize, rng: &mut dflash_shared::rng::Rng) -> String {
    let mut s = String::new();
    for i in 0..words {
        if i > 0 {
            s.push(if rng.below(12) == 0 { '\n' } else { ' ' });
        }
        s.push_str(SYNTHETIC_WORDS[rng.below(SYNTHETIC_WORDS.len() as u64) as usize]);
        if rng.below(10) == 0 {
            s.push_str(if rng.below(2) == 0 { "." } else { "," });
        }
    }
    s
}

/// Chat messages as a ShareGPT line (`conversations` of `from`/`value`).
fn sharegpt(msgs: &[serde_json::Value]) -> String {
    let conv: Vec<_> = msgs
        .iter()
        .map(|m| {
            let from = match m["role"].as_str() {
                Some("user") => "human",
                Some("assistant") => "gpt",
                _ => "system",
            };
            serde_json::json!({"from": from, "value": m["content"]})
        })
        .collect();
    serde_json::json!({"conversations": conv}).to_string()
}

/// The tokenizer the tests use (`bench prepare` is given one with --tokenizer).
pub fn test_tokenizer_dir() -> PathBuf {
    match std::env::var_os("DFLASH_QWEN3_TOKENIZER") {
        Some(d) => PathBuf::from(d),
        None => {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/test-assets/qwen3-tokenizer")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_whose_reply_max_seq_len_cut_off_are_reported_as_such() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.jsonl");
        // --max-seq-len 8: the reply of the first sample starts at token 10.
        let cut = format!(
            r#"{{"input_ids": [{}], "loss_mask": [{}, 1, 1, 1]}}"#,
            vec!["5"; 13].join(", "),
            ["0"; 10].join(", ")
        );
        let lines = [
            cut.as_str(),
            r#"{"input_ids": [1, 2, 3], "loss_mask": [0, 0, 0]}"#,
            r#"{"input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1]}"#,
        ];
        std::fs::write(&path, lines.join("\n")).unwrap();
        let cfg = LoaderConfig {
            source: DataSource::Files(vec![path]),
            vocab_size: Some(100),
            token_budget: 64,
            max_seq_len: 8,
            seed: 0,
            epochs: 1,
            max_bad_lines: 100,
            shuffle_window: 8,
            max_line_bytes: 1000,
            chat: None,
            chat_error: None,
        };
        let r = scan(&cfg, None, 1, |_| Ok(())).unwrap();
        assert_eq!(r.kept, 1);
        assert_eq!(
            r.dropped
                .iter()
                .map(|(k, n)| (k.as_str(), *n))
                .collect::<Vec<_>>(),
            [
                (UNSUPERVISED, 1),
                ("supervised tokens cut off by --max-seq-len 8", 1)
            ],
            "{r:?}"
        );
        assert!(
            r.text()
                .contains("supervised tokens cut off by --max-seq-len 8: 1"),
            "{}",
            r.text()
        );
    }
}
