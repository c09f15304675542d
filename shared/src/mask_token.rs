//! The drafter's MASK token by default, for any vocabulary: an id whose embedding row no
//! text ever uses, so the block's masked slots are told apart from every real token.
//!
//! 1. The first embedding row past the tokenizer's tokens, when the embedding has rows
//!    beyond them (Qwen3: 151669 of 151936 rows; gpt-oss, Gemma pad their embeddings too).
//! 2. Else the tokenizer's first reserved special token (an added special token whose
//!    text says `reserved` or `unused`: Llama 3's `<|reserved_special_token_0|>`, 128002).
//! 3. Else the vocabulary's last id.
//!
//! Without a tokenizer (the built-in tiny target) the rule of the first release holds:
//! 151669 for vocabularies larger than that, else the last id. The export records which
//! rule chose the id (`dflash_training.mask_token`).

use std::path::Path;

use serde_json::Value;

/// The chosen id and, in words, why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MaskToken {
    pub id: u32,
    pub rule: String,
}

/// The default MASK token of a target of `vocab` embedding rows whose tokenizer (a
/// `tokenizer.json`) is in `dir`, if there is one.
pub fn default_mask_token(dir: Option<&Path>, vocab: usize) -> MaskToken {
    let tokenizer = dir
        .and_then(|d| std::fs::read_to_string(d.join("tokenizer.json")).ok())
        .and_then(|t| serde_json::from_str::<Value>(&t).ok());
    match tokenizer {
        Some(t) => from_tokenizer(&t, vocab),
        None if vocab > 151669 => MaskToken {
            id: 151669,
            rule: "151669, Qwen3's first unused embedding row (no tokenizer.json to read)".into(),
        },
        None => last(vocab, "no tokenizer.json to read"),
    }
}

fn last(vocab: usize, why: &str) -> MaskToken {
    MaskToken {
        id: vocab.saturating_sub(1) as u32,
        rule: format!("the vocabulary's last id ({why})"),
    }
}

/// [`default_mask_token`] of a parsed `tokenizer.json`.
pub fn from_tokenizer(t: &Value, vocab: usize) -> MaskToken {
    let added = t["added_tokens"].as_array();
    // BPE and WordPiece map each token to its id; Unigram lists `[piece, score]` pairs,
    // a piece's id its place in the list.
    let model = match &t["model"]["vocab"] {
        Value::Object(m) => m.values().filter_map(Value::as_u64).max(),
        Value::Array(a) => (a.len() as u64).checked_sub(1),
        _ => None,
    };
    let ids = model
        .into_iter()
        .chain(added.into_iter().flatten().filter_map(|a| a["id"].as_u64()));
    let count = ids.max().map_or(0, |m| m + 1) as usize;
    if count > 0 && count < vocab {
        return MaskToken {
            id: count as u32,
            rule: format!(
                "the first embedding row past the tokenizer's {count} tokens (no text uses it)"
            ),
        };
    }
    let reserved = added
        .into_iter()
        .flatten()
        .filter(|a| a["special"] == true)
        .filter_map(|a| Some((a["id"].as_u64()?, a["content"].as_str()?)))
        .filter(|(id, c)| {
            let c = c.to_lowercase();
            (*id as usize) < vocab && (c.contains("reserved") || c.contains("unused"))
        })
        .min_by_key(|(id, _)| *id);
    match reserved {
        Some((id, content)) => MaskToken {
            id: id as u32,
            rule: format!("the tokenizer's first reserved special token, {content}"),
        },
        None => last(
            vocab,
            "the tokenizer fills the embedding and reserves no special token",
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tokenizer(vocab: &[(&str, u64)], added: &[(u64, &str, bool)]) -> Value {
        json!({
            "model": {"vocab": vocab.iter().map(|(t, i)| (t.to_string(), json!(i))).collect::<serde_json::Map<_, _>>()},
            "added_tokens": added.iter().map(|(id, c, s)| json!({"id": id, "content": c, "special": s})).collect::<Vec<_>>(),
        })
    }

    #[test]
    fn an_embedding_row_past_the_tokenizer_comes_first() {
        // Qwen3's shape: 151643 tokens, specials to 151668, 151936 rows.
        let t = tokenizer(
            &[("a", 0), ("b", 151642)],
            &[(151643, "<|endoftext|>", true), (151668, "</think>", false)],
        );
        let m = from_tokenizer(&t, 151936);
        assert_eq!(m.id, 151669);
        assert!(
            m.rule.contains("past the tokenizer's 151669 tokens"),
            "{m:?}"
        );
    }

    #[test]
    fn a_full_embedding_takes_the_first_reserved_special_token() {
        // Llama 3's shape: 128256 ids, every one a token.
        let t = tokenizer(
            &[("a", 0), ("b", 127999)],
            &[
                (128000, "<|begin_of_text|>", true),
                (128003, "<|reserved_special_token_1|>", true),
                (128002, "<|reserved_special_token_0|>", true),
                (128255, "<|reserved_special_token_247|>", true),
            ],
        );
        let m = from_tokenizer(&t, 128256);
        assert_eq!(m.id, 128002);
        assert!(m.rule.contains("<|reserved_special_token_0|>"), "{m:?}");
        // A reserved token that is not special, or past the embedding, is not taken.
        let t = tokenizer(
            &[("a", 0), ("b", 99)],
            &[(50, "<unused1>", false), (100, "<unused2>", true)],
        );
        let m = from_tokenizer(&t, 100);
        assert_eq!(m.id, 99);
        assert!(m.rule.contains("last id"), "{m:?}");
    }

    #[test]
    fn a_unigram_vocabulary_counts_its_pieces() {
        let t = json!({
            "model": {"type": "Unigram", "vocab": [["<pad>", 0.0], ["a", -1.0], ["b", -2.0], ["c", -3.0]]},
            "added_tokens": [{"id": 0, "content": "<pad>", "special": true}],
        });
        let m = from_tokenizer(&t, 10);
        assert_eq!(m.id, 4, "{m:?}");
        assert!(m.rule.contains("past the tokenizer's 4 tokens"), "{m:?}");
    }

    #[test]
    fn without_a_tokenizer_the_first_releases_rule_holds() {
        let dir = std::env::temp_dir().join("dflash-no-such-dir-for-mask-token");
        assert_eq!(default_mask_token(Some(&dir), 151936).id, 151669);
        assert_eq!(default_mask_token(None, 512).id, 511);
    }
}
