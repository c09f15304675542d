//! No function of the supervisor, the worker or the shared crate is longer than 100 lines
//! (from its `fn` line to its closing brace), except the few listed in [`LONGER`] with the
//! length each had when the rule came in (issue 22): those may only shrink, and one that
//! drops under the limit must leave the list, so the list only ever gets shorter.

use std::collections::BTreeMap;
use std::path::Path;

const LIMIT: usize = 100;

/// `(file, function, lines)`: functions still over the limit, at most this long.
const LONGER: &[(&str, &str, usize)] = &[];

/// Every function's length in `src`: `(file:function, lines)`; a function that appears
/// twice in one file (in two impls) is named with its line.
fn lengths(root: &Path, dir: &Path, out: &mut BTreeMap<String, usize>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            lengths(root, &path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&path).unwrap();
            let file = path.strip_prefix(root).unwrap().display().to_string();
            for (name, line, n) in functions(&text) {
                let key = format!("{file}:{name}");
                let key = if out.contains_key(&key) {
                    format!("{key}@{line}")
                } else {
                    key
                };
                out.insert(key, n);
            }
        }
    }
}

/// A line without its `//` comment, string and char literals (so braces in them do not
/// count).
fn code_of(line: &str) -> String {
    let mut out = String::new();
    let mut chars = line.chars().peekable();
    let mut in_str = false;
    while let Some(c) = chars.next() {
        match c {
            '\\' if in_str => {
                chars.next();
            }
            '"' => in_str = !in_str,
            '/' if !in_str && chars.peek() == Some(&'/') => break,
            '\'' if !in_str => {
                // A char literal ('{', '\'', '\u{..}') or a lifetime ('a): skip a literal.
                let rest: String = chars.clone().take(12).collect();
                if let Some(end) = rest.find('\'') {
                    if end <= 10 && !rest[..end].contains(' ') && end > 0 {
                        for _ in 0..=end {
                            chars.next();
                        }
                        continue;
                    }
                }
            }
            _ if in_str => {}
            _ => out.push(c),
        }
    }
    out
}

/// `(name, first line, lines)` of every function with a body in `text`.
fn functions(text: &str) -> Vec<(String, usize, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut found = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        let code = code_of(l);
        let Some(at) = code.find("fn ") else {
            continue;
        };
        let before = code[..at].trim();
        let qualifiers = [
            "pub",
            "pub(crate)",
            "pub(super)",
            "const",
            "unsafe",
            "async",
        ];
        if !before
            .split_whitespace()
            .all(|w| qualifiers.contains(&w) || w.starts_with("extern") || w == "\"C\"")
        {
            continue;
        }
        let name: String = code[at + 3..]
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let (mut depth, mut started) = (0i64, false);
        for (j, m) in lines.iter().enumerate().skip(i) {
            let c = code_of(m);
            for ch in c.chars() {
                match ch {
                    '{' => {
                        depth += 1;
                        started = true;
                    }
                    '}' => depth -= 1,
                    _ => {}
                }
            }
            if started && depth <= 0 {
                found.push((name.clone(), i + 1, j - i + 1));
                break;
            }
            if !started && c.trim_end().ends_with(';') {
                break;
            }
        }
    }
    found
}

#[test]
fn no_function_is_longer_than_the_limit_or_its_listed_length() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut all = BTreeMap::new();
    for krate in ["supervisor/src", "worker/src", "shared/src"] {
        lengths(&root, &root.join(krate), &mut all);
    }
    assert!(all.len() > 500, "the scan sees the crates: {}", all.len());
    let listed: BTreeMap<String, usize> = LONGER
        .iter()
        .map(|(f, n, l)| (format!("{f}:{n}"), *l))
        .collect();
    let mut problems = Vec::new();
    for (f, &n) in &all {
        match listed.get(f) {
            Some(&max) if n > max => problems.push(format!("{f}: {n} lines, listed at {max}")),
            Some(_) if n <= LIMIT => {
                problems.push(format!("{f}: {n} lines now: take it off the list"))
            }
            None if n > LIMIT => problems.push(format!("{f}: {n} lines (limit {LIMIT})")),
            _ => {}
        }
    }
    for f in listed.keys() {
        if !all.contains_key(f) {
            problems.push(format!("{f}: listed, but no such function"));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_scan_measures_a_function_from_its_fn_line_to_its_closing_brace() {
    let text = "fn a() {\n    let s = \"}\";\n    if x { '{'; }\n}\n\nfn b();\npub(crate) fn c<'a>(x: &'a str) -> &'a str {\n    x // }\n}\n";
    assert_eq!(
        functions(text),
        [("a".to_string(), 1, 4), ("c".to_string(), 7, 3)]
    );
}
