//! The loader: streams samples from JSONL files, stdin or the built-in demo generator, and
//! forms token batches by a token budget with length bucketing, shuffled by seed, over
//! epochs. It never holds more than one shuffle window of samples.
//!
//! Batch ids count batches in emission order from 0, and the emission order is a pure
//! function of (data, flags, seed): a loader told to skip the first N batches continues
//! exactly where a stopped run left off.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use dflash_shared::batch::TokenBatch;
use dflash_shared::rng::Rng;
use serde::Serialize;

/// Where samples come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DataSource {
    /// Deterministic synthetic sequences with learnable structure.
    Demo {
        samples: usize,
    },
    Stdin,
    Files(Vec<PathBuf>),
}

#[derive(Debug, Clone)]
pub struct LoaderConfig {
    pub source: DataSource,
    /// Token ids must be below this; `None`: no upper bound is checked.
    pub vocab_size: Option<u32>,
    /// Rows × padded length of a batch stays within this many tokens.
    pub token_budget: u32,
    pub max_seq_len: u32,
    pub seed: u64,
    pub epochs: u32,
    /// More bad lines than this stops the run.
    pub max_bad_lines: u64,
    /// Samples shuffled and bucketed together.
    pub shuffle_window: usize,
    /// Longest line accepted, in bytes.
    pub max_line_bytes: usize,
    /// Tokenizer and chat template for `messages` / `conversations` lines; without one such
    /// lines are bad lines.
    pub chat: Option<std::sync::Arc<crate::data::chat::Chat>>,
    /// Why there is no `chat` (reported with each chat line that cannot be read).
    pub chat_error: Option<String>,
}

/// Vocabulary of the built-in demo data (and of the tiny demo target).
pub const DEMO_VOCAB: u32 = 512;

#[derive(Debug, thiserror::Error)]
pub enum LoaderError {
    #[error("--data {path}: {source}")]
    Io { path: String, source: io::Error },
    #[error("--data {path}: {source} (expected a JSONL file, a directory of .jsonl files, '-' or 'demo')")]
    NotData { path: String, source: io::Error },
    #[error("--data {path}: no .jsonl files in this directory")]
    NoJsonl { path: String },
    #[error(
        "--data {what}: {count} bad lines, more than --max-bad-lines {max} (reasons: {reasons})"
    )]
    TooManyBad {
        what: String,
        count: u64,
        max: u64,
        reasons: String,
    },
    #[error("--data {what}: no usable sample ({stats}); expected JSONL lines like {{\"input_ids\": [1, 2, 3], \"loss_mask\": [0, 1, 1]}}")]
    Empty { what: String, stats: String },
    /// Read again from its start, the data no longer has a batch it had.
    #[error("--data {what}: batch {batch} was made from it earlier, but read again it ends after {batches} batches (the data changed during the run; expected it unchanged)")]
    Changed {
        what: String,
        batch: u64,
        batches: u64,
    },
}

impl From<LoaderError> for crate::error::Error {
    fn from(e: LoaderError) -> crate::error::Error {
        crate::error::Error::Data(Box::new(e))
    }
}

/// Where the loader is: enough to resume it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Position {
    pub epoch: u32,
    pub batches: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub ids: Vec<u32>,
    pub mask: Vec<u8>,
}

/// What one good line gave, before the usability check: the whole sample, the length a run
/// keeps of it (--max-seq-len), and whether a chat rendering held the assistant header.
pub(crate) struct Parsed {
    pub(crate) sample: Sample,
    pub(crate) len: usize,
    /// A chat conversation (rendered with the template), not pre-tokenized.
    pub(crate) chat: bool,
    pub(crate) marker_missing: bool,
    /// The thinking switch a chat line was rendered with (its own `thinking` field, else
    /// the run's); `None` for a pre-tokenized line or the template's default.
    pub(crate) thinking: Option<bool>,
}

impl Parsed {
    /// DFlash anchors need two consecutive supervised tokens.
    pub(crate) fn usable(&self) -> bool {
        self.sample.mask[..self.len]
            .windows(2)
            .any(|w| w[0] == 1 && w[1] == 1)
    }

    /// Unusable only because --max-seq-len cut it: the whole sample has two consecutive
    /// supervised tokens, the part a run keeps has none (a long prompt, the reply past it).
    pub(crate) fn cut_by_max_seq_len(&self) -> bool {
        self.len < self.sample.mask.len()
            && !self.usable()
            && self.sample.mask.windows(2).any(|w| w[0] == 1 && w[1] == 1)
    }

    /// The sample as a run trains on it: cut at --max-seq-len.
    pub(crate) fn truncated(mut self) -> Sample {
        self.sample.ids.truncate(self.len);
        self.sample.mask.truncate(self.len);
        self.sample
    }
}

/// Counts of skipped lines, by reason; the first few are reported with file:line.
///
/// Each distinct line (file:line) counts once, however many epochs read it again: the
/// budget (--max-bad-lines) is about the data, not about how often it is read. Good lines
/// that cannot be trained on and the lines read are counted in the first pass only.
#[derive(Debug, Default, Clone, Serialize)]
pub struct BadLines {
    /// Distinct bad lines, by reason.
    pub by_reason: BTreeMap<String, u64>,
    /// Distinct bad lines (what --max-bad-lines bounds).
    pub total: u64,
    /// Bad lines skipped again by a later epoch (already counted in `total`).
    pub skipped_again: u64,
    /// Which pass over the data this is (the epoch, from 0): counts of good lines are
    /// taken in pass 0 only.
    #[serde(skip)]
    pub pass: u32,
    /// The bad lines counted so far, as file:line (at most --max-bad-lines + 1 of them).
    #[serde(skip)]
    seen: std::collections::HashSet<String>,
    /// Samples dropped because no two consecutive tokens are supervised (not an error).
    pub unsupervised: u64,
    /// Samples dropped because their supervised tokens were past --max-seq-len (they had
    /// two consecutive ones before the cut): a longer --max-seq-len would keep them.
    pub cut_by_max_seq_len: u64,
    /// The --max-seq-len that cut them.
    pub max_seq_len: u32,
    pub lines: u64,
}

/// Why a sample whose supervised tokens --max-seq-len cut off is dropped.
pub fn cut_reason(max_seq_len: u32) -> String {
    format!("supervised tokens cut off by --max-seq-len {max_seq_len}")
}

/// How many bad lines are reported one by one.
const REPORT_FIRST: u64 = 5;

impl BadLines {
    /// A bad line at `whence` (file:line): counted and reported the first time it is met;
    /// a later epoch meeting it again skips it without counting it again.
    fn bad(&mut self, whence: &str, reason: &str, detail: Option<&str>) {
        if !self.seen.insert(whence.to_string()) {
            self.skipped_again += 1;
            return;
        }
        self.total += 1;
        *self.by_reason.entry(reason.to_string()).or_default() += 1;
        if self.total <= REPORT_FIRST {
            match detail {
                Some(d) => log::warn!("skipping {whence}: {reason}: {d}"),
                None => log::warn!("skipping {whence}: {reason}"),
            }
        }
    }

    /// A non-blank line was read.
    fn line_read(&mut self) {
        if self.pass == 0 {
            self.lines += 1;
        }
    }

    /// Count a good line that cannot be trained on, by why.
    pub(crate) fn unusable(&mut self, p: &Parsed, max_seq_len: u32) {
        if self.pass > 0 {
            return;
        }
        if p.cut_by_max_seq_len() {
            self.cut_by_max_seq_len += 1;
            self.max_seq_len = max_seq_len;
        } else {
            self.unsupervised += 1;
        }
    }

    pub fn summary(&self) -> String {
        let mut parts: Vec<String> = self
            .by_reason
            .iter()
            .map(|(r, n)| format!("{r}: {n}"))
            .collect();
        if self.unsupervised > 0 {
            parts.push(format!(
                "no two consecutive supervised tokens: {}",
                self.unsupervised
            ));
        }
        if self.cut_by_max_seq_len > 0 {
            parts.push(format!(
                "{}: {}",
                cut_reason(self.max_seq_len),
                self.cut_by_max_seq_len
            ));
        }
        format!(
            "{} lines read, {} bad{}{}",
            self.lines,
            self.total,
            if parts.is_empty() {
                String::new()
            } else {
                format!("; {}", parts.join(", "))
            },
            if self.skipped_again > 0 {
                format!(
                    " (later epochs skipped the same bad lines again {} times; each counts once against --max-bad-lines)",
                    self.skipped_again
                )
            } else {
                String::new()
            }
        )
    }
}

impl LoaderConfig {
    /// Check the source exists before anything starts. Returns a display name.
    pub fn check(&self) -> Result<(), crate::error::Error> {
        use crate::error::Error;
        if self.max_seq_len > self.token_budget {
            return Err(Error::Flag(format!(
                "--max-seq-len {} exceeds --token-budget {} (expected a sequence to fit in one batch)",
                self.max_seq_len, self.token_budget
            )));
        }
        if self.epochs == 0 {
            return Err(Error::Flag("--epochs 0: expected at least 1".into()));
        }
        if self.source == DataSource::Stdin && self.epochs > 1 {
            return Err(Error::Flag(format!("--data - with --epochs {}: stdin can be read once (expected --epochs 1, or a file)", self.epochs)));
        }
        Ok(())
    }

    pub fn describe(&self) -> String {
        match &self.source {
            DataSource::Demo { .. } => "demo".into(),
            DataSource::Stdin => "-".into(),
            DataSource::Files(f) if f.len() == 1 => f[0].display().to_string(),
            DataSource::Files(f) => format!("{} files", f.len()),
        }
    }
}

/// Resolve `--data`: `demo`, `-`, a JSONL file, or a directory of `*.jsonl` files.
pub fn parse_source(s: &str, demo_samples: usize) -> Result<DataSource, LoaderError> {
    match s {
        "demo" => Ok(DataSource::Demo {
            samples: demo_samples,
        }),
        "-" => Ok(DataSource::Stdin),
        path => {
            let p = Path::new(path);
            let meta = std::fs::metadata(p).map_err(|source| LoaderError::NotData {
                path: path.into(),
                source,
            })?;
            if meta.is_dir() {
                let (files, skipped) = list_jsonl(p).map_err(|source| LoaderError::Io {
                    path: path.into(),
                    source,
                })?;
                warn_skipped(path, &skipped);
                if files.is_empty() {
                    return Err(LoaderError::NoJsonl { path: path.into() });
                }
                Ok(DataSource::Files(files))
            } else {
                Ok(DataSource::Files(vec![p.to_path_buf()]))
            }
        }
    }
}

/// One warning line per skipped entry, once per process (the run resolves `--data` more
/// than once: for the loader and for the settings `--resume` reuses).
fn warn_skipped(dir: &str, skipped: &[Skipped]) {
    static WARNED: std::sync::Mutex<BTreeSet<PathBuf>> = std::sync::Mutex::new(BTreeSet::new());
    let mut warned = WARNED.lock().unwrap_or_else(|p| p.into_inner());
    for s in skipped {
        if warned.insert(s.path.clone()) {
            log::warn!(
                "--data {dir}: skipping {}: {} (expected a regular .jsonl file)",
                s.path.display(),
                s.why
            );
        }
    }
}

/// Why an entry named `*.jsonl` of a data directory is not read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SkipReason {
    #[error("a symlink to nothing (its target is missing)")]
    DanglingSymlink,
    #[error("a FIFO (named pipe)")]
    Fifo,
    #[error("a directory")]
    Directory,
    #[error("a socket or device, not a file")]
    Special,
    #[error("cannot be looked at")]
    Unreadable,
}

/// A `*.jsonl` entry of a data directory that is not read, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    pub path: PathBuf,
    pub why: SkipReason,
}

/// The `*.jsonl` regular files of a data directory (symlinks to files count), sorted, and
/// the `*.jsonl` entries that are not read: dangling symlinks, FIFOs, directories, ...
/// (sorted too). The extension is matched in any case (`a.JSONL`, `b.Jsonl`): such a file
/// is as clearly JSONL as `c.jsonl`. Entries with other names are not data and are not
/// listed.
pub fn list_jsonl(dir: &Path) -> io::Result<(Vec<PathBuf>, Vec<Skipped>)> {
    let mut files = Vec::new();
    let mut skipped = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let Ok(entry) = entry else { continue };
        let path = entry.path();
        if path
            .extension()
            .is_none_or(|x| !x.eq_ignore_ascii_case("jsonl"))
        {
            continue;
        }
        // Through symlinks: a link to a file is read as that file.
        let why = match std::fs::metadata(&path) {
            Ok(m) if m.is_file() => {
                files.push(path);
                continue;
            }
            Ok(m) => {
                use std::os::unix::fs::FileTypeExt;
                let t = m.file_type();
                if t.is_fifo() {
                    SkipReason::Fifo
                } else if t.is_dir() {
                    SkipReason::Directory
                } else {
                    SkipReason::Special
                }
            }
            Err(_) if std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_symlink()) => {
                SkipReason::DanglingSymlink
            }
            Err(_) => SkipReason::Unreadable,
        };
        skipped.push(Skipped { path, why });
    }
    files.sort();
    skipped.sort_by(|a, b| a.path.cmp(&b.path));
    Ok((files, skipped))
}

/// The first non-blank line of `source`, as (file:line, bytes), read without taking
/// anything from a later read: a file's first line, or the first line stdin has already
/// buffered (`None` when its first line is not all there yet, or there is no line).
pub(crate) fn first_line(source: &DataSource) -> Option<(String, Vec<u8>)> {
    match source {
        DataSource::Demo { .. } => None,
        DataSource::Stdin => {
            // Peeked at, not consumed: the loader's reads of stdin get these bytes again.
            let mut lock = io::stdin().lock();
            let buf = lock.fill_buf().ok()?;
            let buf = buf.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(buf);
            buf.split_inclusive(|&b| b == b'\n')
                .take_while(|l| l.ends_with(b"\n"))
                .enumerate()
                .find(|(_, l)| !l.iter().all(u8::is_ascii_whitespace))
                .map(|(i, l)| (format!("<stdin>:{}", i + 1), l.to_vec()))
        }
        DataSource::Files(files) => {
            for f in files {
                let name = f.display().to_string();
                let mut r = BufReader::new(File::open(f).ok()?);
                let mut line_no = 0;
                loop {
                    let mut text = Vec::new();
                    // A line up to 16 MiB.
                    let n = (&mut r).take(16 << 20).read_until(b'\n', &mut text).ok()?;
                    if n == 0 {
                        break;
                    }
                    line_no += 1;
                    if line_no == 1 && text.starts_with(b"\xEF\xBB\xBF") {
                        text.drain(..3);
                    }
                    if !text.iter().all(u8::is_ascii_whitespace) {
                        return Some((format!("{name}:{line_no}"), text));
                    }
                }
            }
            None
        }
    }
}

/// One epoch's stream of samples.
trait SampleStream {
    /// The next usable sample; `Ok(None)` at the end of the epoch.
    fn next(
        &mut self,
        bad: &mut BadLines,
        cfg: &LoaderConfig,
    ) -> Result<Option<Sample>, LoaderError>;
}

struct DemoStream {
    rng: Rng,
    left: usize,
}

impl SampleStream for DemoStream {
    fn next(
        &mut self,
        _bad: &mut BadLines,
        cfg: &LoaderConfig,
    ) -> Result<Option<Sample>, LoaderError> {
        if self.left == 0 {
            return Ok(None);
        }
        self.left -= 1;
        Ok(Some(demo_sample(&mut self.rng, cfg.max_seq_len)))
    }
}

/// A prompt of random tokens (not supervised) and a response that walks a fixed cycle of
/// 16 "content" tokens from a random start, with a little noise: the next tokens follow
/// from the current one, which is exactly what a drafter can learn to predict.
fn demo_sample(rng: &mut Rng, max_len: u32) -> Sample {
    let vocab = DEMO_VOCAB as u64;
    let prompt = 8 + rng.below(25) as usize;
    let response = 24 + rng.below(200) as usize;
    let n = (prompt + response).min(max_len.max(2) as usize);
    let mut pos = rng.below(DEMO_CYCLE.len() as u64) as usize;
    let mut ids = Vec::with_capacity(n);
    let mut mask = Vec::with_capacity(n);
    for i in 0..n {
        if i < prompt {
            ids.push(rng.below(vocab) as u32);
            mask.push(0);
        } else {
            pos = (pos + 1) % DEMO_CYCLE.len();
            let noisy = rng.below(100) < 3;
            ids.push(if noisy {
                rng.below(vocab) as u32
            } else {
                DEMO_CYCLE[pos]
            });
            mask.push(1);
        }
    }
    Sample { ids, mask }
}

/// The demo data's cycle: 16 token ids spread over the vocabulary in a fixed order.
const DEMO_CYCLE: [u32; 16] = {
    let mut c = [0u32; 16];
    let mut i = 0;
    while i < 16 {
        // 197 is coprime with 512: a scrambled but fixed order.
        c[i] = (i as u32 * 197 + 31) % 512;
        i += 1;
    }
    c
};

type Input = Box<dyn Read + Send>;

pub(crate) struct JsonlStream {
    readers: VecDeque<(String, Input)>,
    /// The file being read: its name, reader, and the number of its last line read.
    current: Option<(String, BufReader<Input>, u64)>,
    buf: Vec<u8>,
    /// Lines read ahead and parsed (in parallel for chat data), in input order.
    ahead: VecDeque<(String, Result<Parsed, Bad>)>,
    /// Bytes read so far, of `total_bytes` (`None` for stdin).
    pub(crate) bytes_read: u64,
    pub(crate) total_bytes: Option<u64>,
    /// Read no line past this many (the preflight's --preflight-lines).
    pub(crate) line_limit: Option<u64>,
    /// Non-blank lines read so far.
    pub(crate) lines_read: u64,
}

/// One raw line: where it is (file:line) and its bytes, or why it was refused unread.
type RawLine = (String, Result<Vec<u8>, Bad>);

/// Lines read ahead and parsed together when chat data is tokenized in parallel.
const AHEAD_LINES: usize = 256;

impl JsonlStream {
    pub(crate) fn new(source: &DataSource) -> Result<JsonlStream, LoaderError> {
        let mut readers: VecDeque<(String, Input)> = VecDeque::new();
        let mut total_bytes = Some(0);
        match source {
            DataSource::Stdin => {
                readers.push_back(("<stdin>".into(), Box::new(io::stdin())));
                total_bytes = None;
            }
            DataSource::Files(files) => {
                for f in files {
                    let name = f.display().to_string();
                    let file = File::open(f).map_err(|e| LoaderError::Io {
                        path: name.clone(),
                        source: e,
                    })?;
                    total_bytes = total_bytes.map(|t| t + file.metadata().map_or(0, |m| m.len()));
                    readers.push_back((name, Box::new(file)));
                }
            }
            DataSource::Demo { .. } => unreachable!("demo data is generated"),
        }
        Ok(JsonlStream {
            readers,
            current: None,
            buf: Vec::new(),
            ahead: VecDeque::new(),
            bytes_read: 0,
            total_bytes,
            line_limit: None,
            lines_read: 0,
        })
    }

    /// The next non-blank raw line as (file:line, bytes), or a bad over-long line.
    fn next_raw(
        &mut self,
        bad: &mut BadLines,
        cfg: &LoaderConfig,
    ) -> Result<Option<RawLine>, LoaderError> {
        loop {
            if self.line_limit.is_some_and(|l| self.lines_read >= l) {
                return Ok(None);
            }
            if self.current.is_none() {
                let Some((name, r)) = self.readers.pop_front() else {
                    return Ok(None);
                };
                self.current = Some((name, BufReader::with_capacity(1 << 16, r), 0));
            }
            let (name, reader, line_no) = self.current.as_mut().expect("current reader");
            self.buf.clear();
            let cap = cfg.max_line_bytes as u64 + 1;
            let n = reader
                .by_ref()
                .take(cap)
                .read_until(b'\n', &mut self.buf)
                .map_err(|e| LoaderError::Io {
                    path: name.clone(),
                    source: e,
                })?;
            if n == 0 {
                self.current = None;
                continue;
            }
            self.bytes_read += n as u64;
            *line_no += 1;
            let whence = format!("{name}:{line_no}");
            if self.buf.last() != Some(&b'\n') && self.buf.len() as u64 >= cap {
                // Skip the rest of an over-long line without holding it.
                let mut sink = Vec::new();
                loop {
                    sink.clear();
                    let m = reader
                        .by_ref()
                        .take(1 << 20)
                        .read_until(b'\n', &mut sink)
                        .unwrap_or(0);
                    self.bytes_read += m as u64;
                    if m == 0 || sink.last() == Some(&b'\n') {
                        break;
                    }
                }
                self.lines_read += 1;
                bad.line_read();
                return Ok(Some((
                    whence,
                    Err(Bad {
                        reason: "line too long",
                        detail: Some(format!("longer than {} bytes", cfg.max_line_bytes)),
                    }),
                )));
            }
            if *line_no == 1 && self.buf.starts_with(b"\xEF\xBB\xBF") {
                // A UTF-8 byte-order mark (written by some Windows editors) opens the file.
                self.buf.drain(..3);
            }
            if self.buf.iter().all(|b| b.is_ascii_whitespace()) {
                continue;
            }
            self.lines_read += 1;
            bad.line_read();
            return Ok(Some((whence, Ok(std::mem::take(&mut self.buf)))));
        }
    }

    /// Read ahead and parse: chat data in parallel (tokenizing is the costly part), in
    /// input order either way.
    fn fill(&mut self, bad: &mut BadLines, cfg: &LoaderConfig) -> Result<(), LoaderError> {
        let want = if cfg.chat.is_some() { AHEAD_LINES } else { 1 };
        let mut raw = Vec::with_capacity(want);
        while raw.len() < want {
            match self.next_raw(bad, cfg)? {
                Some(r) => raw.push(r),
                None => break,
            }
        }
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(8);
        let parse = |r: &RawLine| match &r.1 {
            Ok(text) => parse_line(text, cfg),
            Err(b) => Err(b.clone()),
        };
        let parsed: Vec<Result<Parsed, Bad>> = if raw.len() < 8 || threads == 1 {
            raw.iter().map(parse).collect()
        } else {
            let per = raw.len().div_ceil(threads);
            let parse = &parse;
            // A chunk whose thread cannot be started (a thread limit) is parsed here.
            dflash_shared::threads::scoped(
                raw.chunks(per)
                    .map(|c| move || c.iter().map(parse).collect::<Vec<_>>()),
            )
            .into_iter()
            .flatten()
            .collect()
        };
        self.ahead.extend(raw.into_iter().map(|r| r.0).zip(parsed));
        Ok(())
    }

    /// The next good line (usable for training or not); bad lines are counted on the way.
    pub(crate) fn next_parsed(
        &mut self,
        bad: &mut BadLines,
        cfg: &LoaderConfig,
    ) -> Result<Option<Parsed>, LoaderError> {
        loop {
            if self.ahead.is_empty() {
                self.fill(bad, cfg)?;
            }
            let Some((whence, r)) = self.ahead.pop_front() else {
                return Ok(None);
            };
            match r {
                Ok(p) => return Ok(Some(p)),
                Err(b) => bad.bad(&whence, b.reason, b.detail.as_deref()),
            }
            if bad.total > cfg.max_bad_lines {
                return Err(LoaderError::TooManyBad {
                    what: cfg.describe(),
                    count: bad.total,
                    max: cfg.max_bad_lines,
                    reasons: bad
                        .by_reason
                        .iter()
                        .map(|(r, n)| format!("{r}: {n}"))
                        .collect::<Vec<_>>()
                        .join(", "),
                });
            }
        }
    }
}

impl SampleStream for JsonlStream {
    fn next(
        &mut self,
        bad: &mut BadLines,
        cfg: &LoaderConfig,
    ) -> Result<Option<Sample>, LoaderError> {
        while let Some(p) = self.next_parsed(bad, cfg)? {
            if p.usable() {
                return Ok(Some(p.truncated()));
            }
            bad.unusable(&p, cfg.max_seq_len);
        }
        Ok(None)
    }
}

/// One JSONL line → a sample: pre-tokenized `input_ids` (+ `loss_mask`), or a chat
/// conversation rendered and tokenized with the target's template and tokenizer.
pub(crate) fn parse_line(text: &[u8], cfg: &LoaderConfig) -> Result<Parsed, Bad> {
    let v: serde_json::Value = serde_json::from_slice(text).map_err(|_| bad("not JSON"))?;
    let obj = v.as_object().ok_or(bad("not a JSON object"))?;
    let chat = obj.get("input_ids").is_none();
    let mut thinking = None;
    let (ids, mask, marker_missing) = match obj.get("input_ids") {
        Some(ids) => {
            let (ids, mask) = parse_tokens(ids, obj.get("loss_mask"), cfg)?;
            (ids, mask, false)
        }
        None => {
            let Some(messages) = crate::data::chat::conversation(obj)? else {
                return Err(bad("no input_ids, messages or conversations"));
            };
            let chat = cfg.chat.as_ref().ok_or_else(|| Bad {
                reason: NO_TOKENIZER,
                detail: Some(
                    cfg.chat_error
                        .clone()
                        .unwrap_or_else(|| "give --tokenizer DIR".into()),
                ),
            })?;
            // A line says how it is rendered (regenerate records it), else the run does.
            thinking = obj
                .get("thinking")
                .and_then(|t| t.as_bool())
                .or(chat.thinking);
            let enc = chat.encode_with(messages, thinking)?;
            if let Some(v) = cfg.vocab_size {
                if let Some(t) = enc.ids.iter().find(|&&t| t >= v) {
                    return Err(past_vocab(*t as i64, v));
                }
            }
            (enc.ids, enc.mask, !enc.marker_found)
        }
    };
    let len = ids.len().min(cfg.max_seq_len as usize);
    Ok(Parsed {
        sample: Sample { ids, mask },
        len,
        chat,
        marker_missing,
        thinking,
    })
}

pub(crate) use crate::data::chat::Bad;

/// Why a chat line is bad when there is no usable tokenizer and chat template.
pub(crate) const NO_TOKENIZER: &str = "chat sample but no usable tokenizer";

/// A token id `t` at or past the target's vocabulary size `v`, both said.
fn past_vocab(t: i64, v: u32) -> Bad {
    Bad {
        reason: "token id >= vocab size",
        detail: Some(format!(
            "token id {t} is not below the target's vocabulary size {v}"
        )),
    }
}

fn bad(reason: &'static str) -> Bad {
    Bad {
        reason,
        detail: None,
    }
}

fn parse_tokens(
    ids: &serde_json::Value,
    mask: Option<&serde_json::Value>,
    cfg: &LoaderConfig,
) -> Result<(Vec<u32>, Vec<u8>), Bad> {
    let ids = ids.as_array().ok_or(bad("input_ids is not a list"))?;
    if ids.is_empty() {
        return Err(bad("empty input_ids"));
    }
    let mut out = Vec::with_capacity(ids.len());
    for t in ids {
        let t = t.as_i64().ok_or(bad("input_ids holds a non-integer"))?;
        if t < 0 {
            return Err(bad("negative token id"));
        }
        if let Some(v) = cfg.vocab_size.filter(|&v| t >= v as i64) {
            return Err(past_vocab(t, v));
        }
        if t > u32::MAX as i64 {
            return Err(bad("token id >= vocab size"));
        }
        out.push(t as u32);
    }
    let mask = match mask {
        None | Some(serde_json::Value::Null) => vec![1u8; out.len()],
        Some(m) => {
            let m = m.as_array().ok_or(bad("loss_mask is not a list"))?;
            if m.len() != out.len() {
                return Err(bad("loss_mask length differs from input_ids"));
            }
            m.iter()
                .map(|x| match x.as_i64() {
                    Some(0) => Ok(0u8),
                    Some(1) => Ok(1u8),
                    _ => Err(bad("loss_mask holds a value other than 0 or 1")),
                })
                .collect::<Result<Vec<u8>, _>>()?
        }
    };
    Ok((out, mask))
}

pub struct Loader {
    cfg: LoaderConfig,
    epoch: u32,
    stream: Option<Box<dyn SampleStream + Send>>,
    window: Vec<Sample>,
    pending: VecDeque<TokenBatch>,
    next_id: u64,
    pub bad: BadLines,
    samples_this_epoch: u64,
    /// `bad.skipped_again` when this epoch began.
    skipped_again_before: u64,
    /// Batch ids consumed by the run being resumed: generated again, not emitted.
    skip: std::collections::HashSet<u64>,
    /// How many batches the first epoch was cut into, once it has been read (the exact
    /// length of an epoch, which the LR schedule is refined to).
    pub first_epoch_batches: Option<u64>,
}

impl Loader {
    pub fn new(cfg: LoaderConfig) -> Loader {
        Loader {
            cfg,
            epoch: 0,
            stream: None,
            window: Vec::new(),
            pending: VecDeque::new(),
            next_id: 0,
            bad: BadLines::default(),
            samples_this_epoch: 0,
            skipped_again_before: 0,
            skip: std::collections::HashSet::new(),
            first_epoch_batches: None,
        }
    }

    pub fn position(&self) -> Position {
        Position {
            epoch: self.epoch,
            batches: self.next_id,
        }
    }

    /// Resume: never emit these batch ids again (they reached the optimizer already).
    pub fn skip_consumed(&mut self, ids: std::collections::HashSet<u64>) {
        self.skip = ids;
    }

    /// Continue after `batches` batches (the position of a stopped run).
    pub fn skip(&mut self, batches: u64) -> Result<(), LoaderError> {
        while self.next_id < batches {
            if self.next_batch()?.is_none() {
                break;
            }
        }
        Ok(())
    }

    fn open_epoch(&self) -> Result<Box<dyn SampleStream + Send>, LoaderError> {
        Ok(match &self.cfg.source {
            DataSource::Demo { samples } => Box::new(DemoStream {
                // The same samples every epoch; only their order changes.
                rng: Rng::new(self.cfg.seed ^ 0xD3_40),
                left: *samples,
            }),
            other => Box::new(JsonlStream::new(other)?),
        })
    }

    /// The next batch, or `None` when every epoch is done.
    pub fn next_batch(&mut self) -> Result<Option<TokenBatch>, LoaderError> {
        loop {
            if let Some(mut b) = self.pending.pop_front() {
                b.batch_id = self.next_id;
                self.next_id += 1;
                if self.skip.contains(&b.batch_id) {
                    continue;
                }
                return Ok(Some(b));
            }
            if self.epoch >= self.cfg.epochs {
                return Ok(None);
            }
            if self.stream.is_none() {
                self.stream = Some(self.open_epoch()?);
                self.samples_this_epoch = 0;
                self.bad.pass = self.epoch;
                self.skipped_again_before = self.bad.skipped_again;
            }
            let stream = self.stream.as_mut().expect("stream");
            while self.window.len() < self.cfg.shuffle_window {
                match stream.next(&mut self.bad, &self.cfg)? {
                    Some(s) => self.window.push(s),
                    None => break,
                }
            }
            let end_of_epoch = self.window.len() < self.cfg.shuffle_window;
            self.samples_this_epoch += self.window.len() as u64;
            let window = std::mem::take(&mut self.window);
            let mut rng = Rng::new(
                self.cfg.seed.wrapping_mul(1_000_003) ^ ((self.epoch as u64) << 32) ^ self.next_id,
            );
            self.pending
                .extend(make_batches(window, self.cfg.token_budget, &mut rng));
            if end_of_epoch {
                if self.samples_this_epoch == 0 {
                    return Err(LoaderError::Empty {
                        what: self.cfg.describe(),
                        stats: self.bad.summary(),
                    });
                }
                let again = self.bad.skipped_again - self.skipped_again_before;
                if again > 0 {
                    log::warn!(
                        "epoch {}: skipped the same {again} bad line(s) again (each counts once against --max-bad-lines {}; {} so far)",
                        self.epoch + 1,
                        self.cfg.max_bad_lines,
                        self.bad.total
                    );
                }
                self.stream = None;
                if self.epoch == 0 {
                    // Ids are handed out in order: epoch 0 is ids 0..this.
                    self.first_epoch_batches = Some(self.next_id + self.pending.len() as u64);
                }
                self.epoch += 1;
                if self.cfg.source == DataSource::Stdin {
                    self.epoch = self.cfg.epochs;
                }
            }
        }
    }
}

/// Shuffle, bucket by length, cut into batches within the token budget, shuffle batches.
fn make_batches(mut window: Vec<Sample>, budget: u32, rng: &mut Rng) -> Vec<TokenBatch> {
    rng.shuffle(&mut window);
    // Stable sort: equal lengths keep their shuffled order.
    window.sort_by_key(|s| s.ids.len());
    let mut batches = Vec::new();
    let mut rows: Vec<Sample> = Vec::new();
    for s in window {
        // Sorted ascending: the newest sample is the longest of its batch.
        let width = s.ids.len().max(rows.last().map_or(0, |r| r.ids.len()));
        if !rows.is_empty() && (rows.len() + 1) * width > budget as usize {
            batches.push(pack(std::mem::take(&mut rows)));
        }
        rows.push(s);
    }
    if !rows.is_empty() {
        batches.push(pack(rows));
    }
    rng.shuffle(&mut batches);
    batches
}

fn pack(rows: Vec<Sample>) -> TokenBatch {
    let seq_len = rows.iter().map(|r| r.ids.len()).max().unwrap_or(0);
    let mut input_ids = vec![0u32; rows.len() * seq_len];
    let mut loss_mask = vec![0u8; rows.len() * seq_len];
    let mut lengths = Vec::with_capacity(rows.len());
    for (i, r) in rows.iter().enumerate() {
        input_ids[i * seq_len..i * seq_len + r.ids.len()].copy_from_slice(&r.ids);
        loss_mask[i * seq_len..i * seq_len + r.mask.len()].copy_from_slice(&r.mask);
        lengths.push(r.ids.len() as u32);
    }
    TokenBatch {
        batch_id: 0,
        seq_len: seq_len as u32,
        lengths,
        input_ids,
        loss_mask,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn cfg(source: DataSource) -> LoaderConfig {
        LoaderConfig {
            source,
            vocab_size: Some(100),
            token_budget: 64,
            max_seq_len: 16,
            seed: 1,
            epochs: 1,
            max_bad_lines: 100,
            shuffle_window: 8,
            max_line_bytes: 200,
            chat: None,
            chat_error: None,
        }
    }

    fn file(lines: &[&str]) -> (tempfile::NamedTempFile, DataSource) {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        for l in lines {
            writeln!(f, "{l}").unwrap();
        }
        let p = f.path().to_path_buf();
        (f, DataSource::Files(vec![p]))
    }

    fn all(l: &mut Loader) -> Vec<TokenBatch> {
        let mut v = Vec::new();
        while let Some(b) = l.next_batch().unwrap() {
            v.push(b);
        }
        v
    }

    #[test]
    fn every_bad_line_is_counted_by_reason() {
        let long = format!("{{\"input_ids\": [{}]}}", vec!["1"; 100].join(","));
        let (_f, src) = file(&[
            r#"{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}"#,
            "not json",
            r#"{"loss_mask": [1]}"#,
            r#"{"input_ids": [1, -2, 3]}"#,
            r#"{"input_ids": [1, 200, 3]}"#,
            r#"{"input_ids": [1, 2, 3], "loss_mask": [1, 1]}"#,
            &long,
            r#"{"input_ids": [1, 2, 3], "loss_mask": [1, 0, 1]}"#,
            "",
            r#"{"input_ids": [4, 5]}"#,
        ]);
        let mut l = Loader::new(cfg(src));
        let batches = all(&mut l);
        let reasons: Vec<(&str, u64)> = l
            .bad
            .by_reason
            .iter()
            .map(|(k, v)| (k.as_str(), *v))
            .collect();
        assert_eq!(
            reasons,
            [
                ("line too long", 1),
                ("loss_mask length differs from input_ids", 1),
                ("negative token id", 1),
                ("no input_ids, messages or conversations", 1),
                ("not JSON", 1),
                ("token id >= vocab size", 1),
            ]
        );
        assert_eq!(l.bad.unsupervised, 1);
        assert_eq!(l.bad.lines, 9, "the blank line is not counted");
        let rows: usize = batches.iter().map(|b| b.rows()).sum();
        assert_eq!(rows, 2);
        // Missing loss_mask means all ones.
        let b = batches.iter().find(|b| b.lengths.contains(&2)).unwrap();
        let r = b.lengths.iter().position(|&l| l == 2).unwrap();
        assert_eq!(&b.loss_mask[r * b.seq_len as usize..][..2], &[1, 1]);
    }

    #[test]
    fn too_many_bad_lines_is_an_error() {
        let (_f, src) = file(&["x", "y", "z", r#"{"input_ids": [1, 2]}"#]);
        let mut c = cfg(src);
        c.max_bad_lines = 2;
        let e = Loader::new(c).next_batch().unwrap_err().to_string();
        assert!(
            e.contains("3 bad lines, more than --max-bad-lines 2") && e.contains("not JSON: 3"),
            "{e}"
        );
    }

    #[test]
    fn a_bad_line_counts_once_however_many_epochs_read_it() {
        // 3 bad lines, a budget of 4: 5 epochs read them 15 times, and the run goes on.
        let (_f, src) = file(&[
            "x",
            r#"{"input_ids": [1, 2, 3]}"#,
            "y",
            r#"{"input_ids": [1, 2], "loss_mask": [1, 0]}"#,
            r#"{"input_ids": [4, 5, 6]}"#,
            "z",
        ]);
        let mut c = cfg(src);
        c.max_bad_lines = 4;
        c.epochs = 5;
        let mut l = Loader::new(c);
        let rows: usize = all(&mut l).iter().map(|b| b.rows()).sum();
        assert_eq!(rows, 2 * 5, "every good line in every epoch");
        assert_eq!(l.bad.total, 3, "distinct bad lines");
        assert_eq!(l.bad.by_reason["not JSON"], 3);
        assert_eq!(l.bad.skipped_again, 3 * 4, "epochs 2 to 5 skip them again");
        assert_eq!(
            (l.bad.lines, l.bad.unsupervised),
            (6, 1),
            "the data's lines, not lines × epochs"
        );
        let s = l.bad.summary();
        assert!(
            s.starts_with("6 lines read, 3 bad; not JSON: 3")
                && s.contains("skipped the same bad lines again 12 times"),
            "{s}"
        );
        // A fourth distinct bad line is still one too many for a budget of 3.
        let (_f, src) = file(&["x", r#"{"input_ids": [1, 2]}"#, "y", "z", "w"]);
        let mut c = cfg(src);
        c.max_bad_lines = 3;
        c.epochs = 5;
        let e = Loader::new(c).next_batch().unwrap_err().to_string();
        assert!(
            e.contains("4 bad lines, more than --max-bad-lines 3"),
            "{e}"
        );
    }

    #[test]
    fn empty_dataset_is_an_error_not_a_hang() {
        let (_f, src) = file(&[]);
        let e = Loader::new(cfg(src)).next_batch().unwrap_err().to_string();
        assert!(e.contains("no usable sample"), "{e}");
        let (_f, src) = file(&[r#"{"input_ids": [1, 2], "loss_mask": [0, 0]}"#]);
        let e = Loader::new(cfg(src)).next_batch().unwrap_err().to_string();
        assert!(e.contains("no two consecutive supervised tokens: 1"), "{e}");
    }

    #[test]
    fn replies_cut_off_by_max_seq_len_say_so() {
        // max_seq_len 16: a 20-token prompt puts the whole reply past the cut.
        let prompt = vec!["0"; 20].join(", ");
        let ids = vec!["7"; 24].join(", ");
        let cut = format!(r#"{{"input_ids": [{ids}], "loss_mask": [{prompt}, 1, 1, 1, 1]}}"#);
        let (_f, src) = file(&[&cut, r#"{"input_ids": [1, 2, 3], "loss_mask": [1, 0, 1]}"#]);
        let mut l = Loader::new(cfg(src));
        let e = l.next_batch().unwrap_err().to_string();
        assert_eq!((l.bad.cut_by_max_seq_len, l.bad.unsupervised), (1, 1));
        assert!(
            e.contains("supervised tokens cut off by --max-seq-len 16: 1")
                && e.contains("no two consecutive supervised tokens: 1"),
            "{e}"
        );
        // With room for the reply it trains.
        let (_f, src) = file(&[&cut]);
        let mut c = cfg(src);
        c.max_seq_len = 24;
        assert_eq!(all(&mut Loader::new(c)).len(), 1);
    }

    #[test]
    fn a_data_directory_names_the_jsonl_entries_it_cannot_read() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::write(d.join("a.jsonl"), "{}\n").unwrap();
        std::fs::write(d.join("notes.txt"), "not data").unwrap();
        std::os::unix::fs::symlink(d.join("a.jsonl"), d.join("b.jsonl")).unwrap();
        std::os::unix::fs::symlink(d.join("gone.jsonl"), d.join("c.jsonl")).unwrap();
        nix::unistd::mkfifo(&d.join("d.jsonl"), nix::sys::stat::Mode::S_IRWXU).unwrap();
        std::fs::create_dir(d.join("e.jsonl")).unwrap();
        // The extension in any case is JSONL too, read or named like the others.
        std::fs::write(d.join("F.JSONL"), "{}\n").unwrap();
        std::fs::write(d.join("g.Jsonl"), "{}\n").unwrap();
        std::fs::create_dir(d.join("h.JSONL")).unwrap();
        std::fs::write(d.join("i.jsonl.txt"), "not data").unwrap();
        let (files, skipped) = list_jsonl(d).unwrap();
        assert_eq!(
            files,
            [
                d.join("F.JSONL"),
                d.join("a.jsonl"),
                d.join("b.jsonl"),
                d.join("g.Jsonl")
            ]
        );
        assert_eq!(
            skipped,
            [
                Skipped {
                    path: d.join("c.jsonl"),
                    why: SkipReason::DanglingSymlink
                },
                Skipped {
                    path: d.join("d.jsonl"),
                    why: SkipReason::Fifo
                },
                Skipped {
                    path: d.join("e.jsonl"),
                    why: SkipReason::Directory
                },
                Skipped {
                    path: d.join("h.JSONL"),
                    why: SkipReason::Directory
                },
            ]
        );
        assert_eq!(
            SkipReason::DanglingSymlink.to_string(),
            "a symlink to nothing (its target is missing)"
        );
        // The data source is what is left (never blocking on the FIFO).
        match parse_source(d.to_str().unwrap(), 0).unwrap() {
            DataSource::Files(f) => assert_eq!(f, files),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn missing_dataset_names_the_path() {
        let e = parse_source("/nonexistent/data.jsonl", 10)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("/nonexistent/data.jsonl") && e.contains("expected"),
            "{e}"
        );
    }

    #[test]
    fn batches_respect_the_budget_cover_every_sample_once_per_epoch_and_truncate() {
        let mut c = cfg(DataSource::Demo { samples: 50 });
        c.vocab_size = Some(DEMO_VOCAB);
        c.epochs = 3;
        c.token_budget = 300;
        c.max_seq_len = 40;
        let mut l = Loader::new(c);
        let batches = all(&mut l);
        let mut rows = 0;
        for (i, b) in batches.iter().enumerate() {
            assert_eq!(b.batch_id, i as u64);
            assert!(b.rows() * b.seq_len as usize <= 300);
            assert!(b.seq_len <= 40);
            assert!(b.input_ids.iter().all(|&t| t < DEMO_VOCAB));
            rows += b.rows();
        }
        assert_eq!(rows, 150, "50 samples × 3 epochs");
        assert_eq!(
            l.position(),
            Position {
                epoch: 3,
                batches: batches.len() as u64
            }
        );
    }

    #[test]
    fn same_seed_same_batches_and_resume_continues_exactly() {
        let mk = |seed| {
            let mut c = cfg(DataSource::Demo { samples: 40 });
            c.vocab_size = None;
            c.seed = seed;
            c.epochs = 2;
            c.token_budget = 200;
            c.max_seq_len = 50;
            Loader::new(c)
        };
        let a = all(&mut mk(7));
        assert_eq!(a, all(&mut mk(7)));
        assert_ne!(a, all(&mut mk(8)));
        let mut resumed = mk(7);
        resumed.skip(5).unwrap();
        assert_eq!(all(&mut resumed), a[5..].to_vec());
    }

    #[test]
    fn length_bucketing_reduces_padding() {
        let mut c = cfg(DataSource::Demo { samples: 200 });
        c.vocab_size = None;
        c.token_budget = 1024;
        c.max_seq_len = 256;
        c.shuffle_window = 200;
        let batches = all(&mut Loader::new(c));
        let real: u64 = batches.iter().map(|b| b.tokens()).sum();
        let padded: u64 = batches
            .iter()
            .map(|b| b.rows() as u64 * b.seq_len as u64)
            .sum();
        let eff = real as f64 / padded as f64;
        assert!(eff > 0.9, "padding efficiency {eff:.2}");
    }
}
