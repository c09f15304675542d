//! `dflash-supervise regenerate`: the target alone writes the assistant turns of a data
//! set again (DFlash's recipe trains the drafter on the target's own responses). Chat lines
//! are rendered with the target's chat template (with its thinking switch when
//! `--thinking` is given), pre-tokenized prompts are continued as they are; greedy, or
//! sampled with `--temperature`/`--top-p` from a generator seeded per line and turn.
//!
//! The work is spread over one `dflash-worker generate` process per device (`pool`),
//! one prompt at a time each, the next prompt going to whichever is free. The supervisor
//! renders and decodes text; the workers see token ids only, so any target engine that
//! answers `generate`'s request lines can serve. Each finished line goes to the journal
//! (`journal`) as it finishes; a stopped or killed regeneration is continued by the same
//! command, each line written exactly once, and `--out` appears, in input order, only when
//! all are done.
//!
//! Exit 0: written; 1: a worker kept failing; 2: an input that cannot be used; 75: stopped
//! by a signal (the same command continues it).

mod items;
mod journal;
mod pool;

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dflash_shared::checkpoint::ChecksumAlgorithm;
use dflash_shared::devices::{Device, DeviceSpec};
use dflash_shared::exit_codes;
use serde_json::{json, Value};

use crate::data::chat::Chat;
use crate::error::Error;
use crate::run::engine::TargetEngine;
use items::{Item, Kind};
use journal::{Journal, Record, Settings};
use pool::{Event, Pool, Spawn};

#[derive(Debug, clap::Args)]
pub struct RegenerateArgs {
    /// The target model directory (with its tokenizer and chat template for chat data),
    /// or tiny (the built-in demo target; token-id prompts only).
    #[arg(long, value_name = "DIR")]
    pub target: String,
    /// A JSONL file: chat lines ({"messages": [...]} or ShareGPT {"conversations": [...]}),
    /// whose assistant turns are written again, or token-id prompts ({"input_ids": [...]}
    /// or a JSON array), which are continued. Other fields of a line are kept.
    #[arg(long, value_name = "FILE")]
    pub data: PathBuf,
    /// Where the regenerated data goes (a new file; what `prepare` and a run take). A
    /// stopped regeneration keeps its progress in OUT.partial and the same command
    /// continues it.
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
    /// New tokens per reply at most (a reply also ends at the target's end of turn or EOS).
    #[arg(long, value_name = "N", default_value_t = 2048)]
    pub max_new_tokens: usize,
    /// 0: greedy decoding; else sample from the softmax of the logits ÷ T.
    #[arg(long, value_name = "T", default_value_t = 0.0)]
    pub temperature: f32,
    /// With --temperature: sample from the fewest most likely tokens whose probabilities
    /// reach P.
    #[arg(long, value_name = "P", default_value_t = 1.0)]
    pub top_p: f32,
    /// Seed of sampling (each line and turn draws from its own generator).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub seed: u64,
    /// The chat template's thinking switch (enable_thinking), recorded in every output
    /// line. Default: not passed (the template's own default).
    #[arg(long, value_name = "on|off", value_parser = parse_on_off)]
    pub thinking: Option<bool>,
    /// Prompt and reply together at most, in tokens (a longer prompt is skipped, a reply
    /// stops there). Default: the target's context (max_position_embeddings), else 4096.
    #[arg(long, value_name = "N")]
    pub max_seq_len: Option<usize>,
    /// Devices: 0-7, all, or cpu:N (N processes without a GPU). Default: every GPU, or
    /// cpu:2 when there is no NVIDIA driver.
    #[arg(long, value_name = "SPEC", value_parser = parse_spec)]
    pub gpus: Option<DeviceSpec>,
    /// What runs the target: native (this tool's forward: Qwen3, Qwen3-MoE, Llama), torch
    /// (transformers' implementation in a Python child per worker, over its own KV cache),
    /// or auto (native for the families it serves, torch for any other).
    #[arg(long, value_enum, value_name = "ENGINE", default_value = "auto")]
    pub target_engine: crate::run::engine::TargetEngine,
    /// The worker program (default: dflash-worker beside dflash-supervise).
    #[arg(long, value_name = "PATH")]
    pub worker_bin: Option<PathBuf>,
}

fn parse_spec(s: &str) -> Result<DeviceSpec, dflash_shared::devices::DeviceSpecError> {
    s.parse()
}

pub fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" | "true" => Ok(true),
        "off" | "false" => Ok(false),
        _ => Err(format!("{s:?}: expected on or off")),
    }
}

/// Restarts of one worker in a row without a reply before the regeneration gives up.
const MAX_RESTARTS: u32 = 3;

/// What the target says about decoding: its context and its end-of-sequence tokens.
struct TargetInfo {
    context: Option<usize>,
    vocab: usize,
    eos: Vec<u32>,
    config_sha256: Option<String>,
    /// `native` or `torch`: what the workers run it with.
    engine: &'static str,
}

/// config.json's and generation_config.json's `eos_token_id` (a number or a list).
fn eos_ids(dir: &Path) -> Vec<u32> {
    let mut out = Vec::new();
    for f in ["config.json", "generation_config.json"] {
        let v: Value = std::fs::read_to_string(dir.join(f))
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or_default();
        let e = &v["eos_token_id"];
        let ids = e
            .as_u64()
            .into_iter()
            .chain(e.as_array().into_iter().flatten().filter_map(Value::as_u64));
        for id in ids {
            if !out.contains(&(id as u32)) {
                out.push(id as u32);
            }
        }
    }
    out
}

fn target_info(target: &str, requested: TargetEngine) -> Result<TargetInfo, Error> {
    if target == "tiny" {
        let engine = match requested {
            TargetEngine::Torch => {
                let t = dflash_shared::model_config::TargetConfig::read(
                    dflash_shared::model_config::TINY_CONFIG,
                )
                .map_err(|e| Error::input("--target tiny", e.to_string()))?;
                crate::run::engine::pick(requested, &t, None)?.0
            }
            _ => "native",
        };
        return Ok(TargetInfo {
            engine,
            context: None,
            vocab: serde_json::from_str::<Value>(dflash_shared::model_config::TINY_CONFIG)
                .ok()
                .and_then(|v| v["vocab_size"].as_u64())
                .unwrap_or(0) as usize,
            eos: Vec::new(),
            config_sha256: None,
        });
    }
    let dir = Path::new(target);
    let t = dflash_shared::model_config::TargetConfig::load_any(dir)
        .map_err(|e| Error::input(format!("--target {target}"), e.to_string()))?;
    let cfg = std::fs::read(dir.join("config.json"))
        .map_err(|e| Error::input(format!("--target {target}"), e))?;
    let (engine, line) = crate::run::engine::pick(requested, &t, Some(dir))?;
    if engine == "torch" {
        log::info!("regenerate: {line}");
    }
    Ok(TargetInfo {
        engine,
        context: t.max_position_embeddings,
        vocab: t.vocab_size,
        eos: eos_ids(dir),
        config_sha256: Some(ChecksumAlgorithm::Sha256.hex(&cfg)),
    })
}

/// The input lines as items (blank lines skipped), and the lines that are not, with why.
fn read_items(a: &RegenerateArgs) -> Result<(Vec<Item>, Vec<items::BadLine>, String), Error> {
    let input = || format!("--data {}", a.data.display());
    let bytes = std::fs::read(&a.data).map_err(|e| Error::input(input(), e))?;
    let text = String::from_utf8(bytes)
        .map_err(|_| Error::input(input(), "not UTF-8 text (expected JSONL)"))?;
    let sha = ChecksumAlgorithm::Sha256.hex(text.as_bytes());
    let (mut good, mut bad) = (Vec::new(), Vec::new());
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match items::parse(i + 1, line) {
            Ok(it) => good.push(it),
            Err(b) => bad.push(b),
        }
    }
    if good.is_empty() {
        let why = bad.first().map_or("no lines".to_string(), |b| {
            format!("no usable line (line {}: {})", b.line, b.why)
        });
        return Err(Error::input(
            input(),
            format!("{why}; expected chat conversations or token-id prompts, one per line"),
        ));
    }
    Ok((good, bad, sha))
}

fn devices(spec: &Option<DeviceSpec>) -> Result<Vec<Device>, Error> {
    let count = || crate::telemetry::gpus::gpu_count().map_err(|e| e.to_string());
    let (spec, flag) = match spec {
        Some(s) => (s.clone(), "--gpus"),
        None => match count() {
            Ok(n) if n > 0 => (DeviceSpec::All, "default devices"),
            _ => (DeviceSpec::Cpu(2), "default devices"),
        },
    };
    let n = match spec {
        DeviceSpec::Cpu(0) => {
            return Err(Error::Flag(
                "--gpus cpu:0: expected 1 or more processes".into(),
            ))
        }
        DeviceSpec::Cpu(_) => Ok(0),
        _ => count(),
    };
    Ok(spec.resolve(n, flag)?)
}

/// The checks that need no worker: the flags, the output path, the chat template.
fn check_flags(a: &RegenerateArgs) -> Result<(), Error> {
    if a.max_new_tokens == 0 {
        return Err(Error::Flag("--max-new-tokens 0: expected 1 or more".into()));
    }
    if !(a.temperature >= 0.0 && a.temperature.is_finite()) {
        return Err(Error::Flag(format!(
            "--temperature {}: expected 0 (greedy) or more",
            a.temperature
        )));
    }
    if !(a.top_p > 0.0 && a.top_p <= 1.0) {
        return Err(Error::Flag(format!(
            "--top-p {}: expected a value in (0, 1]",
            a.top_p
        )));
    }
    let same = a
        .out
        .canonicalize()
        .ok()
        .is_some_and(|o| a.data.canonicalize().ok() == Some(o));
    if same || a.out == a.data {
        return Err(Error::input(
            format!("--out {}", a.out.display()),
            "is --data itself (expected a new file: regenerate never overwrites its input)",
        ));
    }
    let parent = match a.out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if !parent.is_dir() {
        return Err(Error::input(
            format!("--out {}", a.out.display()),
            format!("its directory {} does not exist", parent.display()),
        ));
    }
    if a.target != "tiny" && !Path::new(&a.target).join("config.json").is_file() {
        return Err(Error::input(
            format!("--target {}", a.target),
            "no config.json there (expected a Hugging Face model directory, or tiny)",
        ));
    }
    Ok(())
}

/// The tokenizer and chat template, when the target has them (needed for chat lines).
fn load_chat(a: &RegenerateArgs, needed: bool) -> Result<Option<Chat>, Error> {
    if a.target == "tiny" {
        return match needed {
            true => Err(Error::input(
                format!("--data {}", a.data.display()),
                "chat conversations, but the built-in tiny target has no tokenizer (expected token-id prompts, or a --target with a tokenizer and chat template)",
            )),
            false => Ok(None),
        };
    }
    match Chat::load(Path::new(&a.target)) {
        Ok(mut c) => {
            c.thinking = a.thinking;
            Ok(Some(c))
        }
        Err(e) if needed => Err(Error::input(
            format!("--target {}", a.target),
            e.to_string(),
        )),
        Err(_) => Ok(None),
    }
}

pub fn run(a: RegenerateArgs) -> Result<i32, Error> {
    check_flags(&a)?;
    let journal_path = journal::path_of(&a.out);
    if a.out.exists() && !journal_path.exists() {
        return Err(Error::input(
            format!("--out {}", a.out.display()),
            "already exists (expected a new file: regenerate never overwrites one)",
        ));
    }
    let info = target_info(&a.target, a.target_engine)?;
    let (items, bad, data_sha) = read_items(&a)?;
    let has_chat = items.iter().any(|i| matches!(i.kind, Kind::Chat { .. }));
    let chat = load_chat(&a, has_chat)?;
    let max_seq_len = a.max_seq_len.unwrap_or(info.context.unwrap_or(4096));
    let mut stop = info.eos.clone();
    if let Some(id) = chat.as_ref().and_then(|c| c.token_id(&c.end)) {
        if !stop.contains(&id) {
            stop.push(id);
        }
    }
    let settings = Settings {
        target: absolute(&a.target),
        target_config: info.config_sha256.clone(),
        data: absolute(&a.data.display().to_string()),
        data_sha256: data_sha,
        max_new_tokens: a.max_new_tokens,
        temperature: a.temperature,
        top_p: a.top_p,
        seed: a.seed,
        thinking: a.thinking,
        max_seq_len,
        chat_template: chat.as_ref().map(|c| c.template_sha256.clone()),
    };
    let mut journal = Journal::open(&a.out, &settings)
        .map_err(|e| Error::input(format!("--out {}", a.out.display()), e.to_string()))?;
    if a.out.exists() {
        // A regeneration that wrote --out and was stopped before removing its journal.
        let _ = std::fs::remove_file(&journal.path);
        crate::say!("regenerate: {} is complete already", a.out.display());
        return Ok(exit_codes::SUCCESS);
    }
    for b in &bad {
        if !journal.done.contains_key(&b.line) {
            journal
                .append(Record {
                    line: b.line,
                    out: None,
                    skipped: Some(b.why.clone()),
                })
                .map_err(|e| Error::input(format!("--out {}", a.out.display()), e.to_string()))?;
        }
    }
    let total = items.len() + bad.len();
    let todo: Vec<Item> = items
        .into_iter()
        .filter(|i| !journal.done.contains_key(&i.line))
        .collect();
    if journal.done.len() > bad.len() {
        crate::say!(
            "regenerate: continuing {}: {} of {total} lines done before",
            journal.path.display(),
            journal.done.len()
        );
    }
    let devices = devices(&a.gpus)?;
    let job = Job {
        stop,
        max_seq_len,
        engine: info.engine,
        vocab: info.vocab,
        chat,
        total,
    };
    let outcome = drive(&a, &job, &devices, todo, &mut journal)?;
    match outcome {
        Outcome::Done(stats) => finish(&a, journal, stats),
        Outcome::Stopped(sig) => {
            crate::say!(
                "regenerate: stopped by {sig}: {} of {total} lines done, kept in {}; the same command continues",
                journal.done.len(),
                journal.path.display()
            );
            Ok(exit_codes::STOPPED_EARLY)
        }
        Outcome::Failed(why) => {
            crate::say!(
                "dflash-supervise: regenerate: {why}; the {} lines done are kept in {} and the same command continues",
                journal.done.len(),
                journal.path.display()
            );
            Ok(exit_codes::RUN_FAILED)
        }
    }
}

fn absolute(p: &str) -> String {
    if p == "tiny" {
        return p.to_string();
    }
    Path::new(p)
        .canonicalize()
        .map(|c| c.display().to_string())
        .unwrap_or_else(|_| p.to_string())
}

/// What every request of a regeneration shares.
struct Job {
    stop: Vec<u32>,
    max_seq_len: usize,
    /// `native` or `torch` (the workers' `--engine`).
    engine: &'static str,
    vocab: usize,
    chat: Option<Chat>,
    total: usize,
}

/// Figures of a regeneration (this session's).
#[derive(Default)]
struct Stats {
    replies: u64,
    new_tokens: u64,
    secs: f64,
}

enum Outcome {
    Done(Stats),
    Stopped(&'static str),
    /// A worker kept failing: why.
    Failed(String),
}

fn finish(a: &RegenerateArgs, journal: Journal, s: Stats) -> Result<i32, Error> {
    let skipped: Vec<(usize, String)> = journal
        .done
        .values()
        .filter_map(|r| r.skipped.clone().map(|w| (r.line, w)))
        .collect();
    let n = journal
        .finish(&a.out)
        .map_err(|e| Error::input(format!("--out {}", a.out.display()), e.to_string()))?;
    if !skipped.is_empty() {
        let first: Vec<String> = skipped
            .iter()
            .take(5)
            .map(|(l, w)| format!("line {l}: {w}"))
            .collect();
        crate::say!(
            "regenerate: skipped {} line(s) of {} ({}{})",
            skipped.len(),
            a.data.display(),
            first.join("; "),
            if skipped.len() > 5 { "; ..." } else { "" }
        );
    }
    crate::say!(
        "regenerate: {n} lines written to {} ({} replies, {} new tokens in {:.1} s, {:.0} tokens/s)",
        a.out.display(),
        s.replies,
        s.new_tokens,
        s.secs,
        s.new_tokens as f64 / s.secs.max(1e-9)
    );
    Ok(exit_codes::SUCCESS)
}

/// The seed of one reply: the same for a line and turn in any session, on any worker.
fn seed_of(seed: u64, line: usize, turn: u64) -> u64 {
    let mix = seed ^ (line as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ turn.rotate_left(32);
    dflash_shared::rng::Rng::new(mix).next_u64()
}

/// `generate`'s arguments for this job.
fn spawn(a: &RegenerateArgs, job: &Job) -> Result<Spawn, Error> {
    let bin = match &a.worker_bin {
        Some(w) => w.clone(),
        None => std::env::current_exe()
            .map_err(|e| Error::start("finding dflash-supervise", e))?
            .with_file_name("dflash-worker"),
    };
    if !bin.is_file() {
        return Err(Error::input(
            format!("worker program {}", bin.display()),
            "not found (expected dflash-worker beside dflash-supervise, or --worker-bin PATH)",
        ));
    }
    let stop: Vec<String> = job.stop.iter().map(u32::to_string).collect();
    let mut args = vec![
        "--target".to_string(),
        a.target.clone(),
        "--max-len".into(),
        job.max_seq_len.to_string(),
        "--temperature".into(),
        a.temperature.to_string(),
        "--top-p".into(),
        a.top_p.to_string(),
        "--engine".into(),
        job.engine.into(),
    ];
    if !stop.is_empty() {
        args.push(format!("--stop={}", stop.join(",")));
    }
    Ok(Spawn { bin, args })
}

/// What an item needs next: a request line to send, or its journal record (complete, or
/// skipped: a prompt the target cannot take).
enum Next {
    Send(String),
    Done(Record),
}

fn request(item: &mut Item, job: &Job, a: &RegenerateArgs, turn: u64, id: usize) -> Next {
    let line = item.line;
    let skip = |why: String| {
        Next::Done(Record {
            line,
            out: None,
            skipped: Some(why),
        })
    };
    let ids = match items::next_prompt(item, job.chat.as_ref()) {
        Err(why) => return skip(why),
        Ok(None) => {
            return Next::Done(Record {
                line: item.line,
                out: Some(items::output(item, a.thinking)),
                skipped: None,
            })
        }
        Ok(Some(ids)) => ids,
    };
    if let Some(t) = ids.iter().find(|&&t| t as usize >= job.vocab) {
        return skip(format!(
            "token {t} is not below the target's vocabulary size {}",
            job.vocab
        ));
    }
    if ids.len() >= job.max_seq_len {
        return skip(format!(
            "a prompt of {} tokens leaves no room for a reply under --max-seq-len {}",
            ids.len(),
            job.max_seq_len
        ));
    }
    let max_new = a.max_new_tokens.min(job.max_seq_len - ids.len());
    let seed = seed_of(a.seed, item.line, turn);
    Next::Send(json!({"id": id, "ids": ids, "max_new": max_new, "seed": seed}).to_string())
}

/// The state of the loop: the items left, which worker holds which, the journal.
struct Driver<'a> {
    a: &'a RegenerateArgs,
    job: &'a Job,
    todo: Vec<Item>,
    turns: Vec<u64>,
    ready: VecDeque<usize>,
    /// Worker → the item whose prompt it holds.
    busy: HashMap<usize, usize>,
    restarts: Vec<u32>,
    left: usize,
    journal: &'a mut Journal,
    stats: Stats,
    progress: Progress,
}

impl Driver<'_> {
    fn journal(&mut self, r: Record) -> Result<(), Error> {
        self.journal
            .append(r)
            .map_err(|e| Error::input(format!("--out {}", self.a.out.display()), e.to_string()))?;
        self.left -= 1;
        self.progress.line_done(self.stats.new_tokens);
        Ok(())
    }

    /// Give every free worker the next prompt.
    fn feed(&mut self, pool: &mut Pool) -> Result<(), Error> {
        for w in 0..pool.count() {
            if self.busy.contains_key(&w) {
                continue;
            }
            while let Some(i) = self.ready.pop_front() {
                match request(&mut self.todo[i], self.job, self.a, self.turns[i], i) {
                    Next::Done(r) => self.journal(r)?,
                    Next::Send(line) => {
                        if pool.send(w, &line) {
                            self.busy.insert(w, i);
                        } else {
                            // It died: its end event restarts it.
                            self.ready.push_front(i);
                        }
                        break;
                    }
                }
            }
        }
        Ok(())
    }

    /// One worker's reply or end. `Err(why)` when a worker keeps failing.
    fn on_event(&mut self, pool: &mut Pool, ev: Event) -> Result<Option<String>, Error> {
        match ev {
            Event::Reply { worker, life, line } if life == pool.life(worker) => {
                let Some(i) = self.busy.remove(&worker) else {
                    return Ok(None);
                };
                let r: Value = serde_json::from_str(&line).unwrap_or_default();
                let tokens: Vec<u32> =
                    serde_json::from_value(r["tokens"].clone()).unwrap_or_default();
                if r["id"].as_u64() != Some(i as u64) || tokens.is_empty() {
                    // Not the answer to what it was sent: a new process, the prompt again.
                    self.ready.push_front(i);
                    let why = pool.restart(worker)?;
                    crate::say!("regenerate: worker {worker} answered {line:?} to another request; started again ({why})");
                    return Ok(None);
                }
                let finish = r["finish"].as_str().unwrap_or("length");
                self.restarts[worker] = 0;
                self.stats.replies += 1;
                self.stats.new_tokens += tokens.len() as u64;
                items::take_reply(
                    &mut self.todo[i],
                    &tokens,
                    finish,
                    &self.job.stop,
                    self.job.chat.as_ref(),
                );
                self.turns[i] += 1;
                // Its next reply (or its end) first, so that lines finish in order.
                self.ready.push_front(i);
            }
            Event::Ended { worker, life } if life == pool.life(worker) => {
                if let Some(i) = self.busy.remove(&worker) {
                    self.ready.push_front(i);
                }
                self.restarts[worker] += 1;
                let why = pool.restart(worker)?;
                if self.restarts[worker] > MAX_RESTARTS {
                    return Ok(Some(format!(
                        "worker {worker} ended {MAX_RESTARTS} times in a row without a reply (last: {why})"
                    )));
                }
                crate::say!(
                    "regenerate: worker {worker} ended ({why}); started again, its prompt is sent again"
                );
            }
            _ => {}
        }
        Ok(None)
    }
}

/// The signal that asked to stop, if one came.
struct Stops(Vec<(Arc<AtomicBool>, &'static str)>);

impl Stops {
    fn register() -> Result<Stops, Error> {
        let mut v = Vec::new();
        for (s, name) in [
            (libc::SIGINT, "SIGINT"),
            (libc::SIGTERM, "SIGTERM"),
            (libc::SIGHUP, "SIGHUP"),
        ] {
            let f = Arc::new(AtomicBool::new(false));
            signal_hook::flag::register(s, f.clone())
                .map_err(|e| Error::start("the signal handlers", e))?;
            v.push((f, name));
        }
        Ok(Stops(v))
    }

    fn came(&self) -> Option<&'static str> {
        self.0
            .iter()
            .find(|(f, _)| f.load(Ordering::Relaxed))
            .map(|(_, n)| *n)
    }
}

/// The regeneration's loop: feed free workers, take replies, journal finished lines,
/// restart dead workers, stop on a signal.
fn drive(
    a: &RegenerateArgs,
    job: &Job,
    devices: &[Device],
    todo: Vec<Item>,
    journal: &mut Journal,
) -> Result<Outcome, Error> {
    let stops = Stops::register()?;
    let mut pool = Pool::start(spawn(a, job)?, devices)?;
    let done_before = journal.done.len();
    let mut d = Driver {
        a,
        job,
        ready: (0..todo.len()).collect(),
        turns: vec![0; todo.len()],
        left: todo.len(),
        todo,
        busy: HashMap::new(),
        restarts: vec![0; pool.count()],
        journal,
        stats: Stats::default(),
        progress: Progress::new(job.total, done_before),
    };
    let start = Instant::now();
    while d.left > 0 {
        if let Some(sig) = stops.came() {
            pool.kill();
            return Ok(Outcome::Stopped(sig));
        }
        d.feed(&mut pool)?;
        if d.left == 0 {
            break;
        }
        if let Ok(ev) = pool.rx.recv_timeout(Duration::from_millis(200)) {
            if let Some(why) = d.on_event(&mut pool, ev)? {
                pool.kill();
                return Ok(Outcome::Failed(why));
            }
        }
        d.progress.tick(d.stats.new_tokens);
    }
    d.stats.secs = start.elapsed().as_secs_f64();
    pool.close();
    Ok(Outcome::Done(d.stats))
}

/// The progress of a regeneration: a bar on a terminal, else a line every
/// [`console::PLAIN_EVERY`](crate::telemetry::console::PLAIN_EVERY).
struct Progress {
    bar: Option<indicatif::ProgressBar>,
    total: usize,
    done: usize,
    started: Instant,
    said: Instant,
}

impl Progress {
    fn new(total: usize, done: usize) -> Progress {
        use std::io::IsTerminal;
        let bar = std::io::stderr().is_terminal().then(|| {
            let b = indicatif::ProgressBar::new(total as u64);
            b.set_draw_target(indicatif::ProgressDrawTarget::stderr_with_hz(4));
            b.set_style(
                indicatif::ProgressStyle::with_template(
                    "regenerate [{bar:30.cyan/blue}] {pos}/{len} lines, {msg}, ETA {eta}",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
                .progress_chars("=> "),
            );
            b.set_position(done as u64);
            b.reset_eta();
            b
        });
        let now = Instant::now();
        Progress {
            bar,
            total,
            done,
            started: now,
            said: now,
        }
    }

    fn line_done(&mut self, tokens: u64) {
        self.done += 1;
        if let Some(b) = &self.bar {
            b.set_position(self.done as u64);
        }
        self.tick(tokens);
    }

    fn tick(&mut self, tokens: u64) {
        let rate = tokens as f64 / self.started.elapsed().as_secs_f64().max(1e-9);
        if let Some(b) = &self.bar {
            b.set_message(format!("{rate:.0} new tokens/s"));
            return;
        }
        if self.said.elapsed() >= crate::telemetry::console::PLAIN_EVERY {
            self.said = Instant::now();
            crate::say!(
                "regenerate: {}/{} lines ({:.0}%), {rate:.0} new tokens/s",
                self.done,
                self.total,
                100.0 * self.done as f64 / self.total.max(1) as f64
            );
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if let Some(b) = self.bar.take() {
            b.finish_and_clear();
        }
    }
}
