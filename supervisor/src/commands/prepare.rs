//! `dflash-supervise prepare` (tokenize chat data, with the preflight report) and
//! `bench prepare`.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use crate::cli::PrepareArgs;
use crate::data::chat::Chat;
use crate::data::loader::{self, DataSource, LoaderConfig};
use crate::data::preflight::{
    load_chat, scan, synthetic_conversations, tmp_path, write_atomic, Report,
};
use crate::error::Error;

/// `dflash-supervise prepare`.
pub fn prepare(a: PrepareArgs) -> Result<i32, Error> {
    let source = match a.data.as_str() {
        "demo" => return Err(Error::Flag("prepare --data demo: the demo data is generated; expected a JSONL file, a directory or -".into())),
        s => loader::parse_source(s, 0)?,
    };
    if !a.target.is_dir() {
        return Err(Error::Flag(format!(
            "--target {}: not a directory (expected the target model's Hugging Face directory)",
            a.target.display()
        )));
    }
    let vocab = match dflash_shared::model_config::TargetConfig::load(&a.target) {
        Ok(c) => Some(c.vocab_size as u32),
        Err(_) if !a.target.join("config.json").exists() => None,
        Err(e) => return Err(Error::input("--target", e)),
    };
    let (chat, chat_error) = load_chat(a.tokenizer.as_deref(), Some(&a.target))?;
    let cfg = LoaderConfig {
        source,
        vocab_size: vocab,
        token_budget: a.token_budget.max(1),
        max_seq_len: a.max_seq_len.max(1),
        seed: 0,
        epochs: 1,
        max_bad_lines: u64::MAX,
        shuffle_window: 1,
        max_line_bytes: 16 << 20,
        chat,
        chat_error,
    };
    cfg.check()?;
    if let Some(why) = &cfg.chat_error {
        // Chat data needs the tokenizer and template: say so at once, not with each line.
        if let Some((whence, line)) = loader::first_line(&cfg.source) {
            if loader::parse_line(&line, &cfg).is_err_and(|b| b.reason == loader::NO_TOKENIZER) {
                return Err(Error::input(
                    format!("--target {}", a.target.display()),
                    format!("{why} ({whence} is a chat conversation: rendering it needs the tokenizer.json and chat template)"),
                ));
            }
        }
    }
    let tmp = tmp_path(&a.out);
    let file = std::fs::File::create(&tmp)
        .map_err(|e| Error::input(format!("--out {}", a.out.display()), e))?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
    let started = Instant::now();
    let out_name = a.out.display().to_string();
    let result = scan(&cfg, None, a.drafters.max(1), |s| {
        serde_json::to_writer(
            &mut w,
            &serde_json::json!({"input_ids": s.ids, "loss_mask": s.mask}),
        )
        .map_err(std::io::Error::from)
        .and_then(|_| w.write_all(b"\n"))
        .map_err(|e| std::io::Error::new(e.kind(), format!("--out {out_name}: {e}")))
    });
    let finish = |r: Result<Report, Error>| -> Result<Report, Error> {
        let r = r?;
        r.check()?;
        let f = w
            .into_inner()
            .map_err(|e| Error::io("cannot write", &tmp, e.into_error()))?;
        f.sync_all()
            .map_err(|e| Error::io("cannot write", &tmp, e))?;
        std::fs::rename(&tmp, &a.out)
            .map_err(|e| Error::input(format!("--out {}", a.out.display()), e))?;
        Ok(r)
    };
    let report = match finish(result) {
        Ok(r) => r,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
    };
    print!("{}", report.text());
    let secs = started.elapsed().as_secs_f64();
    println!(
        "wrote {} samples to {} ({:.0} conversations/s, {:.0} tokens/s)",
        report.kept,
        a.out.display(),
        report.lines as f64 / secs,
        report.tokens as f64 / secs
    );
    if let Some(p) = &a.report {
        report.write_json(p)?;
    }
    Ok(0)
}

/// `dflash-supervise bench prepare`.
pub fn bench(json: bool, tokenizer: PathBuf, conversations: usize) -> Result<i32, Error> {
    let chat = Arc::new(
        Chat::load(&tokenizer)
            .map_err(|e| Error::input(format!("--tokenizer {}", tokenizer.display()), e))?,
    );
    let lines = synthetic_conversations(conversations.max(1), 7);
    let tmp =
        std::env::temp_dir().join(format!("dflash-bench-prepare-{}.jsonl", std::process::id()));
    write_atomic(&tmp, (lines.join("\n") + "\n").as_bytes())
        .map_err(|e| Error::io("cannot write", &tmp, e))?;
    let cfg = LoaderConfig {
        source: DataSource::Files(vec![tmp.clone()]),
        vocab_size: None,
        token_budget: 16384,
        max_seq_len: 1 << 20,
        seed: 0,
        epochs: 1,
        max_bad_lines: 0,
        shuffle_window: 1,
        max_line_bytes: 16 << 20,
        chat: Some(chat),
        chat_error: None,
    };
    // One thread: each line parsed as it is read.
    let t0 = Instant::now();
    let mut one_tokens = 0u64;
    for l in &lines {
        let p = loader::parse_line(l.as_bytes(), &cfg).map_err(|b| Error::Bench {
            bench: "prepare",
            what: "bench data".into(),
            source: b.reason.into(),
        })?;
        one_tokens += p.len as u64;
    }
    let one = t0.elapsed().as_secs_f64();
    // The loader's path: read ahead, parsed on every core.
    let t1 = Instant::now();
    let r = scan(&cfg, None, 1, |_| Ok(()));
    let all = t1.elapsed().as_secs_f64();
    let _ = std::fs::remove_file(&tmp);
    let r = r?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let goal = 145_000.0;
    let out = serde_json::json!({
        "conversations": lines.len(),
        "tokens": one_tokens,
        "cores": cores,
        "one_thread_conversations_per_s": lines.len() as f64 / one,
        "one_thread_tokens_per_s": one_tokens as f64 / one,
        "loader_conversations_per_s": r.lines as f64 / all,
        "loader_tokens_per_s": r.tokens as f64 / all,
        "loader_vs_one_thread": one / all,
        "goal_tokens_per_s": goal,
        "loader_vs_goal": r.tokens as f64 / all / goal,
    });
    if json {
        println!("{out}");
    } else {
        println!("chat preparation ({} conversations, {} tokens, Qwen3 tokenizer + chat template, {} cores)", lines.len(), one_tokens, cores);
        println!(
            "  one thread            {:>9.0} conversations/s {:>10.0} tokens/s",
            out["one_thread_conversations_per_s"]
                .as_f64()
                .unwrap_or(0.0),
            out["one_thread_tokens_per_s"].as_f64().unwrap_or(0.0)
        );
        println!(
            "  loader (all cores)    {:>9.0} conversations/s {:>10.0} tokens/s",
            out["loader_conversations_per_s"].as_f64().unwrap_or(0.0),
            out["loader_tokens_per_s"].as_f64().unwrap_or(0.0)
        );
        println!(
            "  loader / one thread   {:>9.2}",
            out["loader_vs_one_thread"].as_f64().unwrap_or(0.0)
        );
        println!(
            "  loader / goal         {:>9.2}   (goal: 145000 tokens/s, 10x an 8-GPU run's 14.5K)",
            out["loader_vs_goal"].as_f64().unwrap_or(0.0)
        );
    }
    Ok(0)
}
