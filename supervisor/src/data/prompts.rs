//! Prompt files (`eval --prompts`, `--eval-prompts`) as the worker's `eval` reads them:
//! one JSON array of token ids per line.

use std::path::Path;

use crate::data::chat::{prompt_turns, Chat};
use crate::error::Error;

/// The prompts as token-id lines: chat lines rendered and tokenized with the target's
/// own template and tokenizer, the others as they are (the worker checks their ids).
pub fn token_lines(flag: &str, path: &Path, target: Option<&Path>) -> Result<Vec<String>, Error> {
    let input = || format!("{flag} {}", path.display());
    let text = std::fs::read_to_string(path).map_err(|e| Error::input(input(), e))?;
    let mut chat: Option<Chat> = None;
    let mut out = Vec::new();
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
        let turns = match v.as_object() {
            Some(o) => prompt_turns(o).map_err(|b| at(b.reason.to_string()))?,
            None => None,
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
        let ids = chat
            .as_ref()
            .map(|c| c.prompt(turns))
            .transpose()
            .map_err(|b| at(b.detail.unwrap_or_else(|| b.reason.to_string())))?
            .unwrap_or_default();
        out.push(serde_json::to_string(&ids).unwrap_or_default());
    }
    if out.is_empty() {
        return Err(Error::input(
            input(),
            "no prompts (expected one JSON array of token ids, or one chat conversation, per line)",
        ));
    }
    Ok(out)
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
