//! No module of the supervisor depends on itself through others: each event source owns
//! its event type, and the dispatcher wraps them (issue 11). One node per module file (a
//! module whose impl is split over child files, `run::dispatcher`, is one node); an edge
//! for every `crate::a::b` path outside `#[cfg(test)]`, resolved to the longest module
//! that exists. `scripts/module_cycles.py` does the same from a shell.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

const COLLAPSED: &[&str] = &["run::dispatcher"];

fn modules(dir: &Path, prefix: &[String], out: &mut BTreeMap<String, String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let stem = path.file_stem().unwrap().to_string_lossy().to_string();
        if path.is_dir() {
            let mut p = prefix.to_vec();
            p.push(stem);
            modules(&path, &p, out);
        } else if path.extension().is_some_and(|e| e == "rs") && stem != "main" {
            let mut p = prefix.to_vec();
            if stem != "mod" && stem != "lib" {
                p.push(stem);
            }
            out.insert(p.join("::"), std::fs::read_to_string(&path).unwrap());
        }
    }
}

fn node(m: &str) -> String {
    COLLAPSED
        .iter()
        .find(|c| m == **c || m.starts_with(&format!("{c}::")))
        .map_or(m.to_string(), |c| c.to_string())
}

/// `crate::...` and `crate::{a, b::c}` paths in `src`, without comments and tests.
fn crate_paths(src: &str) -> Vec<String> {
    let src = src.split("#[cfg(test)]").next().unwrap();
    let code: String = src
        .lines()
        .map(|l| l.split("//").next().unwrap())
        .collect::<Vec<_>>()
        .join("\n");
    let mut out = Vec::new();
    let mut rest = code.as_str();
    while let Some(i) = rest.find("crate::") {
        rest = &rest[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            out.extend(
                group[..end]
                    .split(',')
                    .map(|p| p.split_whitespace().next().unwrap_or("").to_string()),
            );
        } else {
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
                .unwrap_or(rest.len());
            out.push(rest[..end].trim_end_matches(':').to_string());
        }
    }
    out
}

fn cycles(edges: &BTreeMap<String, BTreeSet<String>>) -> Vec<BTreeSet<String>> {
    // A node is in a cycle with every node it reaches that reaches it back.
    let reach = |from: &str| {
        let mut seen = BTreeSet::new();
        let mut stack = vec![from.to_string()];
        while let Some(n) = stack.pop() {
            for m in edges.get(&n).into_iter().flatten() {
                if seen.insert(m.clone()) {
                    stack.push(m.clone());
                }
            }
        }
        seen
    };
    let all: BTreeMap<String, BTreeSet<String>> =
        edges.keys().map(|n| (n.clone(), reach(n))).collect();
    let mut found: Vec<BTreeSet<String>> = Vec::new();
    for (n, r) in &all {
        if !r.contains(n) {
            continue;
        }
        let comp: BTreeSet<String> = r
            .iter()
            .filter(|m| all.get(*m).is_some_and(|mr| mr.contains(n)))
            .cloned()
            .collect();
        if !found.contains(&comp) {
            found.push(comp);
        }
    }
    found
}

#[test]
fn the_supervisor_has_no_module_cycles() {
    let mut mods = BTreeMap::new();
    modules(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        &[],
        &mut mods,
    );
    assert!(
        mods.contains_key("run::dispatcher") && mods.contains_key("data::pipeline"),
        "{:?}",
        mods.keys()
    );
    let resolve = |p: &str| {
        let parts: Vec<&str> = p.split("::").collect();
        (1..=parts.len())
            .rev()
            .map(|n| parts[..n].join("::"))
            .find(|m| mods.contains_key(m))
    };
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (m, src) in &mods {
        for p in crate_paths(src) {
            if let Some(t) = resolve(&p) {
                let (a, b) = (node(m), node(&t));
                if a != b {
                    edges.entry(a).or_default().insert(b);
                }
            }
        }
    }
    assert!(
        edges["run::dispatcher"].contains("data::pipeline"),
        "the scan sees the dispatcher's imports"
    );
    let found = cycles(&edges);
    assert!(found.is_empty(), "module cycles: {found:?}");
}

#[test]
fn a_cycle_is_found() {
    let edges: BTreeMap<String, BTreeSet<String>> =
        [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]
            .iter()
            .fold(BTreeMap::new(), |mut m, (x, y)| {
                m.entry(x.to_string()).or_default().insert(y.to_string());
                m
            });
    let found = cycles(&edges);
    assert_eq!(found.len(), 1);
    assert_eq!(
        found[0].iter().map(String::as_str).collect::<Vec<_>>(),
        ["a", "b", "c"]
    );
}
