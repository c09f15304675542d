//! No module of the supervisor, the worker or the shared crate depends on itself through
//! others: each event source owns its event type, and the dispatcher wraps them (issue 11);
//! shared math sits in leaf modules (issue 22). One node per module file (the dispatcher's
//! child files too); an edge for every `crate::a::b` or `super::a` path outside
//! `#[cfg(test)]`, resolved to the longest module that exists. `scripts/module_cycles.py`
//! does the same from a shell.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

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

/// `crate::...`, `crate::{a, b::c}` and `super::...` paths in the source of module `m`
/// without comments and tests, as paths from the crate root.
fn crate_paths(m: &str, src: &str) -> Vec<String> {
    let src = src.split("#[cfg(test)]").next().unwrap();
    let code: String = src
        .lines()
        .map(|l| l.split("//").next().unwrap())
        .collect::<Vec<_>>()
        .join("\n");
    let mut out = Vec::new();
    // `super::` in a/b.rs or a/b/mod.rs names a module of `a`: the module's parent.
    let parent: Vec<&str> = m.split("::").filter(|p| !p.is_empty()).collect();
    let parent = parent[..parent.len().saturating_sub(1)].join("::");
    let mut rest = code.as_str();
    while let Some(i) = rest.find("super::") {
        let before = code.len() - rest.len() + i;
        rest = &rest[i + "super::".len()..];
        if code[..before].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':') {
            continue;
        }
        let end = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
            .unwrap_or(rest.len());
        let p = rest[..end].trim_end_matches(':');
        out.push(if parent.is_empty() {
            p.to_string()
        } else {
            format!("{parent}::{p}")
        });
    }
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

/// The module graph of the crate whose sources are in `src`.
fn graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut mods = BTreeMap::new();
    modules(src, &[], &mut mods);
    let resolve = |p: &str| {
        let parts: Vec<&str> = p.split("::").collect();
        (1..=parts.len())
            .rev()
            .map(|n| parts[..n].join("::"))
            .find(|m| mods.contains_key(m))
    };
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (m, text) in &mods {
        for p in crate_paths(m, text) {
            if let Some(t) = resolve(&p) {
                if *m != t {
                    edges.entry(m.clone()).or_default().insert(t);
                }
            }
        }
    }
    edges
}

#[test]
fn no_crate_has_module_cycles() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let supervisor = graph(&root.join("supervisor/src"));
    // The scan sees the dispatcher's imports, `crate::` and `super::` alike.
    assert!(
        supervisor["run::dispatcher"].contains("data::pipeline"),
        "{supervisor:?}"
    );
    assert!(
        supervisor["run::dispatcher::spawning"].contains("run::dispatcher::life"),
        "{supervisor:?}"
    );
    let worker = graph(&root.join("worker/src"));
    assert!(worker.contains_key("device::cpu"), "{worker:?}");
    let shared = graph(&root.join("shared/src"));
    assert!(shared.contains_key("protocol"), "{shared:?}");
    let found: Vec<(&str, Vec<BTreeSet<String>>)> = [
        ("supervisor", &supervisor),
        ("worker", &worker),
        ("shared", &shared),
    ]
    .into_iter()
    .map(|(name, g)| (name, cycles(g)))
    .filter(|(_, c)| !c.is_empty())
    .collect();
    assert!(found.is_empty(), "module cycles: {found:?}");
}

#[test]
fn a_super_path_is_an_edge_to_a_sibling() {
    let src = "use super::life::Life;\nfn f() { super::spawning::go(); crate::run::x(); }\n#[cfg(test)]\nuse super::tests;";
    let paths = crate_paths("run::dispatcher::launcher", src);
    assert_eq!(
        paths,
        [
            "run::dispatcher::life::Life",
            "run::dispatcher::spawning::go",
            "run::x"
        ]
    );
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
