//! Prompt files (`eval --prompts`, `--eval-prompts`) as the worker's `eval` reads them:
//! one JSON array of token ids per line, or `{"input_ids": [...]}` with the line's `id`,
//! `category` and `dataset` (strings or numbers, each optional) kept beside the ids.

use std::path::Path;

use crate::data::chat::{prompt_turns, Chat};
use crate::error::Error;

/// The fields of a prompt line that its τ figures keep (the worker groups τ by
/// category, else dataset).
const PROMPT_FIELDS: [&str; 3] = ["id", "category", "dataset"];

/// The [`PROMPT_FIELDS`] of a line's object: null is absent, a string or a number kept,
/// anything else refused (why, in words).
fn prompt_fields(
    o: &serde_json::Map<String, serde_json::Value>,
) -> Result<serde_json::Map<String, serde_json::Value>, String> {
    let mut out = serde_json::Map::new();
    for k in PROMPT_FIELDS {
        match o.get(k) {
            None | Some(serde_json::Value::Null) => {}
            Some(v) if v.is_string() || v.is_number() => {
                out.insert(k.to_string(), v.clone());
            }
            Some(v) => {
                return Err(format!(
                    "{k} {v} is neither a string nor a number (expected e.g. \"{k}\": \"math\")"
                ))
            }
        }
    }
    Ok(out)
}

/// The line of a rendered chat prompt: its ids as a JSON array, or with the line's
/// [`PROMPT_FIELDS`] `{"input_ids": [...], "id": ..., ...}`.
fn rendered(ids: Vec<u32>, fields: serde_json::Map<String, serde_json::Value>) -> String {
    if fields.is_empty() {
        return serde_json::to_string(&ids).unwrap_or_default();
    }
    let mut o = serde_json::Map::new();
    o.insert("input_ids".into(), ids.into());
    o.extend(fields);
    serde_json::Value::Object(o).to_string()
}

/// The prompts as token-id lines: chat lines rendered and tokenized with the target's
/// own template and tokenizer (their id, category and dataset kept beside the ids), the
/// others as they are (the worker checks their ids).
/// Prompts rendered as token-id lines, and how their chat lines were rendered.
#[derive(Debug, Default)]
pub struct Rendered {
    pub lines: Vec<String>,
    /// The thinking switch of each chat line's rendering (its own `thinking` field, else
    /// the one asked for); empty without chat lines.
    pub thinking: std::collections::BTreeSet<Option<bool>>,
    /// SHA-256 of the chat template, when chat lines were rendered.
    pub template_sha256: Option<String>,
}

/// [`Rendered::thinking`] in words, for the warnings that compare renderings.
pub fn thinking_words(t: &std::collections::BTreeSet<Option<bool>>) -> String {
    t.iter()
        .map(|t| crate::data::preflight::thinking_name(*t))
        .collect::<Vec<_>>()
        .join(" and ")
}

pub fn token_lines(
    flag: &str,
    path: &Path,
    target: Option<&Path>,
    thinking: Option<bool>,
) -> Result<Rendered, Error> {
    let input = || format!("{flag} {}", path.display());
    let text = std::fs::read_to_string(path).map_err(|e| Error::input(input(), e))?;
    let mut chat: Option<Chat> = None;
    let mut out = Vec::new();
    let mut modes = std::collections::BTreeSet::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let at = |why: String| Error::input(format!("{} line {}", input(), i + 1), why);
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| {
            at(format!(
                "{e} (expected a JSON array of token ids or a chat object)"
            ))
        })?;
        let (turns, fields) = match v.as_object() {
            Some(o) => (
                prompt_turns(o).map_err(|b| at(b.reason.to_string()))?,
                prompt_fields(o).map_err(&at)?,
            ),
            None => (None, serde_json::Map::new()),
        };
        let Some(turns) = turns else {
            out.push(line.to_string());
            continue;
        };
        let Some(dir) = target else {
            return Err(at("a chat conversation, but the built-in tiny target has no tokenizer (expected token ids)".into()));
        };
        if chat.is_none() {
            chat = Some(Chat::load(dir).map_err(|e| at(e.to_string()))?);
        }
        // A line may say how it is rendered (as regenerate's lines do).
        let own = v.get("thinking").and_then(|t| t.as_bool()).or(thinking);
        modes.insert(own);
        let ids = chat
            .as_ref()
            .map(|c| c.prompt_with(turns, own))
            .transpose()
            .map_err(|b| at(b.detail.unwrap_or_else(|| b.reason.to_string())))?
            .unwrap_or_default();
        out.push(rendered(ids, fields));
    }
    if out.is_empty() {
        return Err(Error::input(
            input(),
            "no prompts (expected one JSON array of token ids, or one chat conversation, per line)",
        ));
    }
    Ok(Rendered {
        lines: out,
        thinking: modes,
        template_sha256: chat.map(|c| c.template_sha256),
    })
}

/// The token ids of each line [`token_lines`] wrote are all below `vocab`: else the first
/// that is not, naming the prompt (counted from 1, blank lines not counted).
pub fn check_vocab(flag: &str, path: &Path, lines: &[String], vocab: usize) -> Result<(), Error> {
    for (i, line) in lines.iter().enumerate() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap_or_default();
        let ids = v.get("input_ids").unwrap_or(&v);
        let bad = ids
            .as_array()
            .into_iter()
            .flatten()
            .find(|t| t.as_u64().is_none_or(|t| t >= vocab as u64));
        if let Some(t) = bad {
            return Err(Error::input(
                format!("{flag} {} prompt {}", path.display(), i + 1),
                format!("token {t} is not a token id below the target's vocabulary size {vocab}"),
            ));
        }
        if ids.as_array().is_none_or(|a| a.is_empty()) {
            return Err(Error::input(
                format!("{flag} {} prompt {}", path.display(), i + 1),
                "expected a non-empty JSON array of token ids, or {\"input_ids\": [...]}",
            ));
        }
    }
    Ok(())
}

/// Each prompt of `lines`, with up to `new_tokens` decoded after it, fits the target's
/// context (`max_positions`, its config.json's max_position_embeddings, when it gives
/// one): positions past it were never trained, so τ measured there means nothing.
pub fn check_context(
    flag: &str,
    path: &Path,
    lines: &[String],
    max_positions: Option<usize>,
    new_tokens: u64,
) -> Result<(), Error> {
    let Some(max) = max_positions else {
        return Ok(());
    };
    for (i, line) in lines.iter().enumerate() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap_or_default();
        let n = v
            .get("input_ids")
            .unwrap_or(&v)
            .as_array()
            .map_or(0, Vec::len) as u64;
        if n + new_tokens > max as u64 {
            let room = (max as u64).saturating_sub(new_tokens);
            return Err(Error::input(
                format!("{flag} {} prompt {}", path.display(), i + 1),
                format!(
                    "{n} tokens and up to {new_tokens} new ones pass the target's context of {max} (max_position_embeddings); expected prompts of at most {room} tokens, or fewer new tokens"
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(line: &str) -> serde_json::Value {
        serde_json::from_str(line).unwrap()
    }

    #[test]
    fn token_lines_keep_each_prompts_id_category_and_dataset() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("p.jsonl");
        let lines = [
            "[1, 2, 3]",
            r#"{"input_ids": [4, 5], "id": "gsm8k-0", "category": "math", "dataset": "gsm8k"}"#,
            "",
            r#"{"input_ids": [6], "id": 12}"#,
        ];
        std::fs::write(&path, lines.join("\n")).unwrap();
        let out = token_lines("--prompts", &path, None, None).unwrap().lines;
        assert_eq!(out.len(), 3);
        assert_eq!(value(&out[0]), value("[1, 2, 3]"));
        let v = value(&out[1]);
        assert_eq!(
            (&v["id"], &v["category"], &v["dataset"]),
            (&"gsm8k-0".into(), &"math".into(), &"gsm8k".into())
        );
        assert_eq!(value(&out[2])["id"], 12);
        check_vocab("--prompts", &path, &out, 10).unwrap();
        check_context("--prompts", &path, &out, Some(5), 2).unwrap();
        // A field that is neither a string nor a number: refused, naming the line.
        std::fs::write(&path, "[1]\n{\"input_ids\": [2], \"category\": {\"a\": 1}}").unwrap();
        let e = token_lines("--prompts", &path, None, None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("line 2")
                && e.contains("category")
                && e.contains("neither a string nor a number"),
            "{e}"
        );
        assert_eq!(e.lines().count(), 1);
    }

    /// Chat lines with the test tokenizer (scripts/fetch_test_assets.sh): their fields
    /// go beside the rendered ids; a line without any stays a plain array.
    #[test]
    fn rendered_chat_prompts_keep_their_fields() {
        let tok = crate::data::preflight::test_tokenizer_dir();
        if !tok.join("tokenizer.json").is_file() {
            assert!(
                std::env::var_os("CI").is_none(),
                "{} is missing",
                tok.display()
            );
            eprintln!("skipping: no tokenizer at {}", tok.display());
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("chat.jsonl");
        let lines = [
            r#"{"id": "mt-bench-81", "category": "writing", "dataset": "mt-bench", "messages": [{"role": "user", "content": "Write a haiku."}]}"#,
            r#"{"messages": [{"role": "user", "content": "Write a haiku."}]}"#,
            r#"{"thinking": false, "messages": [{"role": "user", "content": "Write a haiku."}]}"#,
        ];
        std::fs::write(&path, lines.join("\n")).unwrap();
        let r = token_lines("--prompts", &path, Some(&tok), None).unwrap();
        let out = &r.lines;
        let (a, b) = (value(&out[0]), value(&out[1]));
        // A line's own thinking switch: Qwen3's empty think block after the header.
        let off = value(&out[2]);
        assert_eq!(
            off.as_array().unwrap().len(),
            b.as_array().unwrap().len() + 4,
            "{off}"
        );
        assert_eq!(r.thinking, [None, Some(false)].into_iter().collect());
        assert_eq!(thinking_words(&r.thinking), "template default and off");
        assert!(r.template_sha256.as_ref().is_some_and(|h| h.len() == 64));
        // Asked for off, every line without its own switch is rendered so.
        let all = token_lines("--prompts", &path, Some(&tok), Some(false)).unwrap();
        assert_eq!(value(&all.lines[1]), off);
        assert_eq!(all.thinking, [Some(false)].into_iter().collect());
        assert_eq!(
            a["input_ids"], b,
            "the same rendering, the fields beside it"
        );
        assert!(b.as_array().is_some_and(|ids| ids.len() > 3), "{b}");
        assert_eq!(
            (&a["id"], &a["category"], &a["dataset"]),
            (&"mt-bench-81".into(), &"writing".into(), &"mt-bench".into())
        );
        assert!(a.get("messages").is_none(), "{a}");
    }

    #[test]
    fn a_prompt_that_with_its_new_tokens_passes_the_context_is_refused_by_its_number() {
        let lines: Vec<String> = ["[1,2,3]", "[1,2,3,4,5,6]", r#"{"input_ids":[1]}"#]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let p = Path::new("p.jsonl");
        check_context("--eval-prompts", p, &lines, Some(10), 4).unwrap();
        check_context("--eval-prompts", p, &lines, None, 1000).unwrap();
        let e = check_context("--eval-prompts", p, &lines, Some(9), 4)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("prompt 2") && e.contains("6 tokens") && e.contains("context of 9"),
            "{e}"
        );
        assert_eq!(e.lines().count(), 1);
    }
}
