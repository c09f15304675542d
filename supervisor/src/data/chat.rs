//! Chat data: a conversation (`messages` or ShareGPT `conversations`) rendered with the
//! target's own chat template and tokenized with its own tokenizer, the way transformers'
//! `apply_chat_template(messages, tokenize=True)` does it, plus the loss mask.
//!
//! The mask rule: the template's assistant header (what it appends for
//! `add_generation_prompt=True`, e.g. `<|im_start|>assistant\n`) opens a supervised span and
//! the next end-of-turn marker (what the template writes right after an assistant reply, e.g.
//! `<|im_end|>`) closes it, marker included. A token is supervised when it starts inside a
//! span. So an assistant reply (with any `<think>` block the template keeps) and its
//! end-of-turn token are 1; system and user turns and the headers themselves are 0.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use minijinja::{Environment, ErrorKind, Value};

/// A tokenizer and chat template loaded from a model directory.
pub struct Chat {
    tokenizer: tokenizers::Tokenizer,
    env: Environment<'static>,
    /// Special-token strings the template can use (`bos_token`, `eos_token`, ...).
    special: BTreeMap<String, String>,
    /// Opens an assistant reply (the generation prompt).
    pub header: String,
    /// Closes it (the first token the template writes after the reply).
    pub end: String,
    pub dir: PathBuf,
    /// The template's thinking switch (`enable_thinking`), when one was chosen; `None`:
    /// not passed, so the template's own default holds.
    pub thinking: Option<bool>,
    /// SHA-256 of the chat template's text (what rendered the data, recorded so that
    /// training, τ and serving can be compared).
    pub template_sha256: String,
}

impl std::fmt::Debug for Chat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Chat")
            .field("dir", &self.dir)
            .field("header", &self.header)
            .field("end", &self.end)
            .finish()
    }
}

/// One tokenized conversation.
#[derive(Debug, Clone, PartialEq)]
pub struct Encoded {
    pub ids: Vec<u32>,
    pub mask: Vec<u8>,
    /// Whether the assistant header occurred in the rendering at all.
    pub marker_found: bool,
}

/// Why a chat line is not a sample: a short reason (counted) and the detail (logged).
#[derive(Debug, Clone, PartialEq)]
pub struct Bad {
    pub reason: &'static str,
    pub detail: Option<String>,
}

fn bad(reason: &'static str) -> Bad {
    Bad {
        reason,
        detail: None,
    }
}

/// The conversation in a JSONL object, as messages with a `role` and a string `content`;
/// `Ok(None)` when the object holds neither `messages` nor `conversations`.
pub fn conversation(
    obj: &serde_json::Map<String, serde_json::Value>,
) -> Result<Option<Vec<serde_json::Value>>, Bad> {
    let Some(msgs) = turns(obj)? else {
        return Ok(None);
    };
    if !msgs.iter().any(|m| m["role"] == "assistant") {
        return Err(bad("no assistant turn"));
    }
    Ok(Some(msgs))
}

/// A prompt's conversation: [`conversation`]'s turns without its trailing assistant
/// replies (the reply is what decoding writes); none need be there.
pub fn prompt_turns(
    obj: &serde_json::Map<String, serde_json::Value>,
) -> Result<Option<Vec<serde_json::Value>>, Bad> {
    let Some(mut msgs) = turns(obj)? else {
        return Ok(None);
    };
    while msgs.last().is_some_and(|m| m["role"] == "assistant") {
        msgs.pop();
    }
    if msgs.is_empty() {
        return Err(bad("no turn before the assistant's"));
    }
    Ok(Some(msgs))
}

/// The turns of `messages` or ShareGPT `conversations`, checked, not empty.
pub fn turns(
    obj: &serde_json::Map<String, serde_json::Value>,
) -> Result<Option<Vec<serde_json::Value>>, Bad> {
    let msgs = if let Some(m) = obj.get("messages") {
        let list = m.as_array().ok_or(bad("messages is not a list"))?;
        let mut out = Vec::with_capacity(list.len());
        for msg in list {
            let o = msg.as_object().ok_or(bad("a message is not an object"))?;
            let role = o
                .get("role")
                .and_then(|r| r.as_str())
                .ok_or(bad("a message has no string role"))?;
            if !matches!(role, "system" | "user" | "assistant") {
                return Err(Bad {
                    reason: "unknown role",
                    detail: Some(format!("role {role:?}; expected system, user or assistant")),
                });
            }
            if !o.get("content").is_some_and(|c| c.is_string()) {
                return Err(bad("message content is not a string"));
            }
            // Passed to the template as given (it may read e.g. reasoning_content).
            out.push(msg.clone());
        }
        out
    } else if let Some(c) = obj.get("conversations") {
        let list = c.as_array().ok_or(bad("conversations is not a list"))?;
        let mut out = Vec::with_capacity(list.len());
        for turn in list {
            let o = turn
                .as_object()
                .ok_or(bad("a conversation turn is not an object"))?;
            let from = o
                .get("from")
                .and_then(|r| r.as_str())
                .ok_or(bad("a conversation turn has no string from"))?;
            let role = match from {
                "human" | "user" => "user",
                "gpt" | "assistant" => "assistant",
                "system" => "system",
                other => {
                    return Err(Bad {
                        reason: "unknown role",
                        detail: Some(format!("from {other:?}; expected human, gpt or system")),
                    })
                }
            };
            let value = o
                .get("value")
                .and_then(|v| v.as_str())
                .ok_or(bad("conversation value is not a string"))?;
            out.push(serde_json::json!({"role": role, "content": value}));
        }
        out
    } else {
        return Ok(None);
    };
    if msgs.is_empty() {
        return Err(bad("empty conversation"));
    }
    Ok(Some(msgs))
}

/// A tokenizer or chat template that cannot render chat data: the file (or directory) and
/// what is wrong with it, as one line.
#[derive(Debug, thiserror::Error)]
#[error("{}: {problem}", path.display())]
pub struct ChatError {
    pub path: PathBuf,
    pub problem: ChatProblem,
}

/// What is wrong with a tokenizer directory for chat data.
#[derive(Debug, thiserror::Error)]
pub enum ChatProblem {
    #[error("missing (expected the target's Hugging Face tokenizer, or --tokenizer DIR)")]
    NoTokenizer,
    #[error("not a readable Hugging Face tokenizer: {}", one_line(&source.to_string()))]
    Tokenizer { source: tokenizers::Error },
    #[error("not valid JSON: {source}")]
    ConfigJson { source: serde_json::Error },
    #[error("{source}")]
    Read { source: std::io::Error },
    #[error("chat_template is a list without a \"default\" template")]
    NoDefaultTemplate,
    #[error("no chat_template, and no {} (expected the model's chat template to render chat data)", jinja.display())]
    NoTemplate { jinja: PathBuf },
    #[error("the chat template does not parse: {}", one_line(&source.to_string()))]
    TemplateSyntax { source: minijinja::Error },
    #[error("the chat template fails on a one-turn conversation: {}", one_line(&source.to_string()))]
    TemplateFails { source: minijinja::Error },
    #[error("the chat template adds no assistant header for add_generation_prompt (cannot tell assistant turns apart)")]
    NoHeader,
    #[error("the chat template drops the assistant's reply")]
    DropsReply,
    #[error("the assistant header {header:?} does not precede the assistant's reply")]
    HeaderAfterReply { header: String },
    #[error("tokenizing: {source}")]
    Tokenizing { source: tokenizers::Error },
    #[error("the chat template writes nothing after an assistant reply (no end-of-turn marker)")]
    NoEndMarker,
}

impl ChatProblem {
    /// This problem of the file or directory `path`.
    fn at(self, path: &Path) -> ChatError {
        ChatError {
            path: path.to_path_buf(),
            problem: self,
        }
    }
}

impl Chat {
    /// Load `tokenizer.json` and the chat template (`chat_template.jinja`, else
    /// `tokenizer_config.json`'s `chat_template`) from `dir`. Errors are one line naming the
    /// file and what was expected.
    pub fn load(dir: &Path) -> Result<Chat, ChatError> {
        let tok_path = dir.join("tokenizer.json");
        if !tok_path.is_file() {
            return Err(ChatProblem::NoTokenizer.at(&tok_path));
        }
        let tokenizer = tokenizers::Tokenizer::from_file(&tok_path)
            .map_err(|source| ChatProblem::Tokenizer { source }.at(&tok_path))?;
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: serde_json::Value = match std::fs::read_to_string(&cfg_path) {
            Ok(text) => serde_json::from_str(&text)
                .map_err(|source| ChatProblem::ConfigJson { source }.at(&cfg_path))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => serde_json::Value::Null,
            Err(source) => return Err(ChatProblem::Read { source }.at(&cfg_path)),
        };
        let jinja = dir.join("chat_template.jinja");
        let template = if jinja.is_file() {
            std::fs::read_to_string(&jinja)
                .map_err(|source| ChatProblem::Read { source }.at(&jinja))?
        } else {
            match &cfg["chat_template"] {
                serde_json::Value::String(s) => s.clone(),
                // A list of named templates: the one named "default".
                serde_json::Value::Array(list) => list
                    .iter()
                    .find(|t| t["name"] == "default")
                    .and_then(|t| t["template"].as_str())
                    .ok_or_else(|| ChatProblem::NoDefaultTemplate.at(&cfg_path))?
                    .to_string(),
                _ => return Err(ChatProblem::NoTemplate { jinja }.at(&cfg_path)),
            }
        };
        let mut special = BTreeMap::new();
        for k in [
            "bos_token",
            "eos_token",
            "unk_token",
            "pad_token",
            "sep_token",
            "cls_token",
            "mask_token",
        ] {
            let v = &cfg[k];
            if let Some(s) = v.as_str().or(v["content"].as_str()) {
                special.insert(k.to_string(), s.to_string());
            }
        }
        let mut env = Environment::new();
        // What transformers' sandboxed Jinja environment sets.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<Value, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.add_filter("tojson", tojson);
        let template_sha256 =
            dflash_shared::checkpoint::ChecksumAlgorithm::Sha256.hex(template.as_bytes());
        env.add_template_owned("chat", template)
            .map_err(|source| ChatProblem::TemplateSyntax { source }.at(dir))?;
        let mut chat = Chat {
            tokenizer,
            env,
            special,
            header: String::new(),
            end: String::new(),
            dir: dir.to_path_buf(),
            thinking: None,
            template_sha256,
        };
        chat.find_markers()?;
        Ok(chat)
    }

    /// The assistant header is what `add_generation_prompt=True` appends; the end-of-turn
    /// marker is the first token the template writes after an assistant reply.
    fn find_markers(&mut self) -> Result<(), ChatError> {
        let dir = &self.dir;
        let user = serde_json::json!([{"role": "user", "content": "Hello"}]);
        let what = |source| ChatProblem::TemplateFails { source }.at(dir);
        let base = self.render(&user, false, None).map_err(what)?;
        let gen = self.render(&user, true, None).map_err(what)?;
        let header = gen
            .strip_prefix(&base)
            .filter(|h| !h.is_empty())
            .ok_or_else(|| ChatProblem::NoHeader.at(dir))?;
        const SENTINEL: &str = "DFlashSentinelReply";
        let probe = serde_json::json!([{"role": "user", "content": "Hello"}, {"role": "assistant", "content": SENTINEL}]);
        let text = self.render(&probe, false, None).map_err(what)?;
        let at = text
            .find(SENTINEL)
            .ok_or_else(|| ChatProblem::DropsReply.at(dir))?;
        if !text[..at].contains(header) {
            return Err(ChatProblem::HeaderAfterReply {
                header: header.to_string(),
            }
            .at(dir));
        }
        let rest = &text[at + SENTINEL.len()..];
        let enc = self
            .tokenizer
            .encode(rest, false)
            .map_err(|source| ChatProblem::Tokenizing { source }.at(dir))?;
        let end = match enc.get_offsets().first().and_then(|&(s, e)| rest.get(s..e)) {
            Some(t) if !t.is_empty() => t.to_string(),
            _ => return Err(ChatProblem::NoEndMarker.at(dir)),
        };
        self.header = header.to_string();
        self.end = end;
        Ok(())
    }

    fn render(
        &self,
        messages: &serde_json::Value,
        add_generation_prompt: bool,
        thinking: Option<bool>,
    ) -> Result<String, minijinja::Error> {
        let tmpl = self.env.get_template("chat")?;
        let mut ctx: BTreeMap<&str, Value> = self
            .special
            .iter()
            .map(|(k, v)| (k.as_str(), Value::from(v.as_str())))
            .collect();
        ctx.insert("messages", Value::from_serialize(messages));
        ctx.insert("tools", Value::from(()));
        ctx.insert("documents", Value::from(()));
        ctx.insert("add_generation_prompt", Value::from(add_generation_prompt));
        if let Some(t) = thinking {
            ctx.insert("enable_thinking", Value::from(t));
        }
        tmpl.render(ctx)
    }

    /// Render and tokenize one conversation; mask per the module's rule.
    pub fn encode(&self, messages: Vec<serde_json::Value>) -> Result<Encoded, Bad> {
        self.encode_with(messages, self.thinking)
    }

    /// [`encode`](Self::encode) with this thinking switch (a line that records its own).
    pub fn encode_with(
        &self,
        messages: Vec<serde_json::Value>,
        thinking: Option<bool>,
    ) -> Result<Encoded, Bad> {
        let (text, enc) = self.tokenize(messages, false, thinking)?;
        let spans = self.spans(&text);
        let ids = enc.get_ids().to_vec();
        let mut mask = Vec::with_capacity(ids.len());
        let mut si = 0;
        for &(start, _) in enc.get_offsets() {
            while si < spans.len() && spans[si].1 <= start {
                si += 1;
            }
            mask.push(u8::from(si < spans.len() && spans[si].0 <= start));
        }
        Ok(Encoded {
            ids,
            mask,
            marker_found: !spans.is_empty(),
        })
    }

    /// Byte ranges of the supervised spans of a rendering, in order.
    fn spans(&self, text: &str) -> Vec<(usize, usize)> {
        let mut spans = Vec::new();
        let mut from = 0;
        while let Some(at) = text[from..].find(&self.header) {
            let start = from + at + self.header.len();
            let end = text[start..]
                .find(&self.end)
                .map_or(text.len(), |e| start + e + self.end.len());
            spans.push((start, end));
            from = end;
        }
        spans
    }

    /// A prompt's token ids: `messages` rendered with the generation prompt (the assistant
    /// header, where decoding starts), tokenized.
    pub fn prompt(&self, messages: Vec<serde_json::Value>) -> Result<Vec<u32>, Bad> {
        self.prompt_with(messages, self.thinking)
    }

    /// [`prompt`](Self::prompt) with this thinking switch.
    pub fn prompt_with(
        &self,
        messages: Vec<serde_json::Value>,
        thinking: Option<bool>,
    ) -> Result<Vec<u32>, Bad> {
        Ok(self
            .tokenize(messages, true, thinking)?
            .1
            .get_ids()
            .to_vec())
    }

    /// `messages` rendered (with the generation prompt or not) and tokenized: the text
    /// and its encoding.
    fn tokenize(
        &self,
        messages: Vec<serde_json::Value>,
        add_generation_prompt: bool,
        thinking: Option<bool>,
    ) -> Result<(String, tokenizers::Encoding), Bad> {
        let text = self
            .render(
                &serde_json::Value::Array(messages),
                add_generation_prompt,
                thinking,
            )
            .map_err(|e| Bad {
                reason: "chat template failed to render",
                detail: Some(one_line(&e.to_string())),
            })?;
        let enc = self
            .tokenizer
            .encode(text.as_str(), false)
            .map_err(|e| Bad {
                reason: "tokenizer failed",
                detail: Some(one_line(&e.to_string())),
            })?;
        Ok((text, enc))
    }

    /// One past the largest token id the tokenizer can produce (added tokens included).
    pub fn id_count(&self) -> usize {
        self.tokenizer
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&m| m as usize + 1)
    }

    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// Token ids → text (special tokens kept), for tests and reports.
    pub fn decode(&self, ids: &[u32]) -> String {
        self.tokenizer.decode(ids, false).unwrap_or_default()
    }

    /// A reply's token ids → its text, special tokens (end-of-turn, EOS) left out.
    pub fn decode_reply(&self, ids: &[u32]) -> String {
        self.tokenizer.decode(ids, true).unwrap_or_default()
    }

    /// The id of a token given as text (`<|im_end|>`), when it is one token.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Python's `json.dumps(x, ensure_ascii=False, indent=indent)` as transformers' `tojson`
/// filter does it (minijinja's own escapes HTML characters, which transformers does not).
fn tojson(
    v: Value,
    indent: Option<usize>,
    kwargs: minijinja::value::Kwargs,
) -> Result<Value, minijinja::Error> {
    // `tojson(indent=2)` as Jinja templates write it, or `tojson(2)`.
    let indent = match kwargs.get::<Option<usize>>("indent")? {
        Some(i) => Some(i),
        None => indent,
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    py_json(&v, indent, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

fn py_json(
    v: &Value,
    indent: Option<usize>,
    depth: usize,
    out: &mut String,
) -> Result<(), minijinja::Error> {
    use minijinja::value::ValueKind as K;
    let (sep, open_pad, close_pad) = match indent {
        None => (", ".to_string(), String::new(), String::new()),
        Some(n) => (
            format!(",\n{}", " ".repeat(n * (depth + 1))),
            format!("\n{}", " ".repeat(n * (depth + 1))),
            format!("\n{}", " ".repeat(n * depth)),
        ),
    };
    match v.kind() {
        K::Undefined | K::None => out.push_str("null"),
        K::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        K::Number if v.is_integer() => out.push_str(&v.to_string()),
        K::Number => {
            let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
            // Python writes 2.0, not 2.
            if f.is_finite() && f.fract() == 0.0 && f.abs() < 1e16 {
                out.push_str(&format!("{f:.1}"))
            } else {
                out.push_str(&f.to_string())
            }
        }
        K::String => {
            out.push_str(&serde_json::to_string(v.as_str().unwrap_or_default()).unwrap_or_default())
        }
        K::Map => {
            let keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            out.push_str(&open_pad);
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&sep);
                }
                out.push_str(&serde_json::to_string(&k.to_string()).unwrap_or_default());
                out.push_str(": ");
                py_json(&v.get_item(k)?, indent, depth + 1, out)?;
            }
            out.push_str(&close_pad);
            out.push('}');
        }
        K::Seq | K::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            out.push_str(&open_pad);
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&sep);
                }
                py_json(x, indent, depth + 1, out)?;
            }
            out.push_str(&close_pad);
            out.push(']');
        }
        _ => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: cannot write a {} as JSON", v.kind()),
            ))
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_and_shapes_are_checked_with_reasons() {
        let obj = |s: &str| {
            serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(s).unwrap()
        };
        let reason = |s: &str| conversation(&obj(s)).unwrap_err().reason;
        assert_eq!(
            reason(r#"{"messages": {"role": "user"}}"#),
            "messages is not a list"
        );
        assert_eq!(
            reason(r#"{"messages": [{"role": "tool", "content": "x"}]}"#),
            "unknown role"
        );
        assert_eq!(
            reason(r#"{"messages": [{"role": "user", "content": 3}]}"#),
            "message content is not a string"
        );
        assert_eq!(reason(r#"{"messages": []}"#), "empty conversation");
        assert_eq!(
            reason(r#"{"messages": [{"role": "user", "content": "hi"}]}"#),
            "no assistant turn"
        );
        assert_eq!(
            reason(r#"{"conversations": [{"from": "bot", "value": "x"}]}"#),
            "unknown role"
        );
        assert_eq!(
            reason(r#"{"conversations": [{"from": "gpt", "value": null}]}"#),
            "conversation value is not a string"
        );
        assert!(conversation(&obj(r#"{"input_ids": [1]}"#))
            .unwrap()
            .is_none());
        let c = conversation(&obj(r#"{"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}"#))
            .unwrap()
            .unwrap();
        let roles: Vec<&str> = c.iter().map(|m| m["role"].as_str().unwrap()).collect();
        assert_eq!(roles, ["system", "user", "assistant"]);
    }

    #[test]
    fn tojson_writes_what_python_json_dumps_writes() {
        // Insertion order, as Python dicts keep it.
        let v = minijinja::Environment::new()
            .compile_expression(r#"{"name": "f", "args": [1, 2.0, "<é>", none, true], "e": {}}"#)
            .unwrap()
            .eval(())
            .unwrap();
        assert_eq!(
            tojson(
                v.clone(),
                None,
                minijinja::value::Kwargs::from_iter(std::iter::empty::<(&str, Value)>())
            )
            .unwrap()
            .to_string(),
            r#"{"name": "f", "args": [1, 2.0, "<é>", null, true], "e": {}}"#
        );
        let env = minijinja::Environment::new();
        let mut env = env;
        env.add_filter("tojson", tojson);
        let indented = env
            .render_str(
                "{{ x|tojson(indent=2) }}",
                minijinja::context! { x => Value::from_serialize(serde_json::json!({"a": [1]})) },
            )
            .unwrap();
        assert_eq!(indented, "{\n  \"a\": [\n    1\n  ]\n}");
    }
}
