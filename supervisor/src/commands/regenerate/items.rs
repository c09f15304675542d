//! The lines of `regenerate --data` and what each becomes: a chat conversation whose
//! assistant turns the target writes again, one after the other (each reply is written
//! with the conversation so far, earlier replies already regenerated, as its prompt; a
//! conversation that ends with a user turn gets a reply), or a token-id prompt that the
//! target continues once. Pure: the requests an item needs next, and its output line.

use serde_json::{json, Map, Value};

use crate::data::chat::{turns, Chat};

/// One input line.
#[derive(Debug, Clone)]
pub struct Item {
    /// The line's number in the file (from 1).
    pub line: usize,
    /// The line's other fields (id, category, ...), kept in its output.
    pub fields: Map<String, Value>,
    pub kind: Kind,
}

#[derive(Debug, Clone)]
pub enum Kind {
    /// `{"input_ids": [...]}` (or a bare array): continued once.
    Tokens { prompt: Vec<u32>, continued: bool },
    /// A conversation: `done` holds the turns settled so far (the replies regenerated),
    /// `rest` the turns still to walk (the original replies in it are dropped).
    Chat {
        done: Vec<Value>,
        rest: Vec<Value>,
        finish: Vec<String>,
        new_tokens: Vec<usize>,
    },
}

/// Why a line is not an item.
#[derive(Debug, Clone, PartialEq)]
pub struct BadLine {
    pub line: usize,
    pub why: String,
}

/// Parse one non-blank line (number `line`).
pub fn parse(line: usize, text: &str) -> Result<Item, BadLine> {
    let bad = |why: String| BadLine { line, why };
    let v: Value = serde_json::from_str(text).map_err(|e| bad(format!("not JSON ({e})")))?;
    let ids = |v: &Value| -> Result<Vec<u32>, BadLine> {
        let ids: Vec<u32> = serde_json::from_value(v.clone())
            .map_err(|_| bad("input_ids is not a list of token ids".into()))?;
        if ids.is_empty() {
            return Err(bad("an empty prompt".into()));
        }
        Ok(ids)
    };
    let mut fields = match v {
        Value::Array(_) => {
            return Ok(Item {
                line,
                fields: Map::new(),
                kind: Kind::Tokens {
                    prompt: ids(&v)?,
                    continued: false,
                },
            })
        }
        Value::Object(o) => o,
        _ => return Err(bad("expected a JSON object or an array of token ids".into())),
    };
    if let Some(v) = fields.remove("input_ids") {
        fields.remove("loss_mask");
        let prompt = ids(&v)?;
        return Ok(Item {
            line,
            fields,
            kind: Kind::Tokens {
                prompt,
                continued: false,
            },
        });
    }
    let all = turns(&fields)
        .map_err(|b| bad(b.detail.unwrap_or_else(|| b.reason.to_string())))?
        .ok_or_else(|| {
            bad("none of input_ids, messages, conversations (expected a chat conversation or token ids)".into())
        })?;
    if all
        .iter()
        .all(|t| t["role"] == "assistant" || t["role"] == "system")
    {
        return Err(bad("no user turn".into()));
    }
    fields.remove("messages");
    fields.remove("conversations");
    Ok(Item {
        line,
        fields,
        kind: Kind::Chat {
            done: Vec::new(),
            rest: all,
            finish: Vec::new(),
            new_tokens: Vec::new(),
        },
    })
}

/// What an item needs written next.
#[derive(Debug, Clone, PartialEq)]
pub enum Want {
    /// A continuation of these token ids.
    Tokens(Vec<u32>),
    /// A reply to this conversation (rendered with the generation prompt).
    Reply(Vec<Value>),
}

/// The next prompt an item needs written; `None` when it is complete.
pub fn advance(item: &mut Item) -> Option<Want> {
    match &mut item.kind {
        Kind::Tokens { prompt, continued } => (!*continued).then(|| Want::Tokens(prompt.clone())),
        Kind::Chat { done, rest, .. } => {
            // Settle the turns up to the next reply; replies in a row collapse into one.
            while let Some(t) = rest.first() {
                if t["role"] == "assistant" && done.last().is_some_and(|d| d["role"] != "assistant")
                {
                    break;
                }
                let t = rest.remove(0);
                if t["role"] != "assistant" {
                    done.push(t);
                }
            }
            done.last()
                .is_some_and(|t| t["role"] != "assistant")
                .then(|| Want::Reply(done.clone()))
        }
    }
}

/// [`advance`], rendered as token ids with `chat` (conversations need it).
pub fn next_prompt(item: &mut Item, chat: Option<&Chat>) -> Result<Option<Vec<u32>>, String> {
    match advance(item) {
        None => Ok(None),
        Some(Want::Tokens(ids)) => Ok(Some(ids)),
        Some(Want::Reply(turns)) => {
            let chat = chat.ok_or("a chat conversation, but the target has no tokenizer")?;
            chat.prompt(turns)
                .map(Some)
                .map_err(|b| b.detail.unwrap_or_else(|| b.reason.to_string()))
        }
    }
}

/// Record the target's reply to the prompt [`advance`] gave (its text decoded by `chat`
/// for a conversation, without the stop token that ended it).
pub fn take_reply(
    item: &mut Item,
    tokens: &[u32],
    finish: &str,
    stop: &[u32],
    chat: Option<&Chat>,
) {
    match &mut item.kind {
        Kind::Tokens { prompt, continued } => {
            let n = prompt.len();
            prompt.extend_from_slice(tokens);
            *continued = true;
            item.fields.insert(
                "loss_mask".into(),
                json!((0..prompt.len())
                    .map(|i| u8::from(i >= n))
                    .collect::<Vec<_>>()),
            );
            item.fields.insert(
                "regenerated".into(),
                json!({"finish": [finish], "new_tokens": [tokens.len()]}),
            );
        }
        Kind::Chat {
            done,
            rest,
            finish: fin,
            new_tokens,
        } => {
            let body = match tokens.last() {
                Some(t) if finish == "stop" && stop.contains(t) => &tokens[..tokens.len() - 1],
                _ => tokens,
            };
            let text = chat.map(|c| c.decode_reply(body)).unwrap_or_default();
            done.push(json!({"role": "assistant", "content": text}));
            // The original reply this one replaces.
            if rest.first().is_some_and(|t| t["role"] == "assistant") {
                rest.remove(0);
            }
            fin.push(finish.to_string());
            new_tokens.push(tokens.len());
        }
    }
}

/// The output line of a complete item: token ids as `{"input_ids", "loss_mask", ...}`,
/// a conversation as `{"messages", "thinking", ...}`, each with its other fields and
/// `regenerated` (how each reply ended, and its length in tokens).
pub fn output(item: &Item, thinking: Option<bool>) -> Value {
    let mut o = item.fields.clone();
    match &item.kind {
        Kind::Tokens { prompt, .. } => {
            o.insert("input_ids".into(), json!(prompt));
        }
        Kind::Chat {
            done,
            finish,
            new_tokens,
            ..
        } => {
            o.insert("messages".into(), json!(done));
            o.insert("thinking".into(), json!(thinking));
            o.insert(
                "regenerated".into(),
                json!({"finish": finish, "new_tokens": new_tokens}),
            );
        }
    }
    Value::Object(o)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_prompts_are_continued_once_with_the_new_tokens_supervised() {
        for text in [
            r#"[5, 6, 7]"#,
            r#"{"input_ids": [5, 6, 7], "loss_mask": [1, 1, 1], "id": "a"}"#,
        ] {
            let mut it = parse(3, text).unwrap();
            assert_eq!(next_prompt(&mut it, None).unwrap(), Some(vec![5, 6, 7]));
            take_reply(&mut it, &[9, 2], "stop", &[2], None);
            assert_eq!(advance(&mut it), None, "continued once");
            let o = output(&it, None);
            assert_eq!(o["input_ids"], json!([5, 6, 7, 9, 2]));
            assert_eq!(o["loss_mask"], json!([0, 0, 0, 1, 1]));
            assert_eq!(o["regenerated"]["finish"], json!(["stop"]));
        }
        let o = output(&parse(1, r#"{"input_ids": [1], "id": "x"}"#).unwrap(), None);
        assert_eq!(o["id"], "x");
    }

    #[test]
    fn bad_lines_say_why() {
        for (text, why) in [
            ("{", "not JSON"),
            ("[]", "empty prompt"),
            (r#"{"input_ids": [-1]}"#, "token ids"),
            (r#"{"text": "hi"}"#, "none of input_ids"),
            (
                r#"{"messages": [{"role": "assistant", "content": "x"}]}"#,
                "no user turn",
            ),
            (
                r#"{"messages": [{"role": "tool", "content": "x"}]}"#,
                "role",
            ),
            ("3", "expected a JSON object"),
        ] {
            let e = parse(7, text).unwrap_err();
            assert_eq!(e.line, 7);
            assert!(e.why.contains(why), "{text}: {}", e.why);
        }
    }

    fn roles(v: &[Value]) -> Vec<&str> {
        v.iter().map(|m| m["role"].as_str().unwrap()).collect()
    }

    #[test]
    fn every_reply_of_a_conversation_is_written_again_in_order() {
        let mut it = parse(
            1,
            r#"{"id": 4, "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
               {"role": "assistant", "content": "old1"}, {"role": "assistant", "content": "old1b"},
               {"role": "user", "content": "u2"}, {"role": "assistant", "content": "old2"},
               {"role": "user", "content": "u3"}]}"#,
        )
        .unwrap();
        // Without a tokenizer a conversation cannot be rendered: said, not a panic.
        assert!(next_prompt(&mut it.clone(), None)
            .unwrap_err()
            .contains("tokenizer"));
        let mut prompts = Vec::new();
        while let Some(w) = advance(&mut it) {
            let Want::Reply(turns) = w else {
                panic!("{w:?}")
            };
            prompts.push(roles(&turns).join(","));
            let n = prompts.len();
            take_reply(
                &mut it,
                &[],
                if n == 2 { "stop" } else { "length" },
                &[],
                None,
            );
        }
        // Each reply's prompt holds the replies regenerated before it; the ending user
        // turn gets one; two replies in a row are one.
        assert_eq!(
            prompts,
            [
                "system,user",
                "system,user,assistant,user",
                "system,user,assistant,user,assistant,user"
            ]
        );
        let o = output(&it, Some(false));
        assert_eq!(
            roles(o["messages"].as_array().unwrap()),
            [
                "system",
                "user",
                "assistant",
                "user",
                "assistant",
                "user",
                "assistant"
            ]
        );
        assert!(!o.to_string().contains("old"), "{o}");
        assert_eq!(
            (o["id"].clone(), o["thinking"].clone()),
            (json!(4), json!(false))
        );
        assert_eq!(
            o["regenerated"]["finish"],
            json!(["length", "stop", "length"])
        );
    }
}
