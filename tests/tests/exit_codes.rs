//! Every exit code the documentation's table lists (docs/run-directory.md, generated from
//! shared/src/exit_codes.rs), produced by the program: the table, the `--help` text and
//! the codes a run really ends with agree.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::*;
use nix::sys::signal::Signal;

const T: Duration = Duration::from_secs(120);

/// The codes of dflash-supervise in the documentation's exit-code table (the worker's
/// codes follow them, after "A worker process").
fn documented_codes() -> BTreeSet<i32> {
    let doc = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/run-directory.md"
    ))
    .expect("docs/run-directory.md");
    let table = doc
        .split("<!-- BEGIN exit-codes")
        .nth(1)
        .expect("docs/run-directory.md has the generated exit-code table");
    let table = table.split("A worker process").next().unwrap();
    table
        .lines()
        .filter_map(|l| l.strip_prefix("| "))
        .filter_map(|l| l.split(' ').next()?.parse().ok())
        .collect()
}

/// One scenario per documented code: what the run does, and the code it must end with.
fn produce(code: i32) -> (i32, String) {
    match code {
        0 => {
            let mut sup = Sup::start_real(&[
                "--gpus",
                "cpu:2",
                "--data",
                "demo",
                "--demo-samples",
                "64",
                "--steps",
                "2",
            ]);
            (sup.wait_exit(T).code().unwrap_or(-1), sup.stderr())
        }
        1 => {
            let mut sup = Sup::start(
                &["--gpus", "cpu:2", "--max-restarts", "0"],
                "drafter-0=crash:3",
            );
            (sup.wait_exit(T).code().unwrap_or(-1), sup.stderr())
        }
        2 => {
            let out = supervise(&["--steps", "0"], None);
            (
                out.status.code().unwrap_or(-1),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            )
        }
        3 => {
            let mut sup = Sup::start(
                &["--gpus", "cpu:2", "--stop-timeout", "1s"],
                "drafter-0=ignore-stop",
            );
            sup.wait_running(2);
            sup.signal(Signal::SIGTERM);
            (sup.wait_exit(T).code().unwrap_or(-1), sup.stderr())
        }
        4 => {
            let tmp = tempfile::tempdir().unwrap();
            let run = tmp.path().join("run");
            let out = supervise(
                &[
                    "--gpus",
                    "cpu:2",
                    "--worker-bin",
                    "/bin/true",
                    "--run-dir",
                    run.to_str().unwrap(),
                ],
                None,
            );
            (
                out.status.code().unwrap_or(-1),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            )
        }
        75 => {
            let mut sup = Sup::start_real(&["--gpus", "cpu:2"]);
            sup.wait_running(2);
            sup.signal(Signal::SIGTERM);
            (sup.wait_exit(T).code().unwrap_or(-1), sup.stderr())
        }
        130 => {
            let mut sup = Sup::start(
                &["--gpus", "cpu:2", "--stop-timeout", "10m"],
                "drafter-0=ignore-stop",
            );
            sup.wait_running(2);
            sup.signal(Signal::SIGINT);
            sup.wait_state("the run to be stopping", T, |s| s["phase"] == "stopping");
            sup.signal(Signal::SIGINT);
            (sup.wait_exit(T).code().unwrap_or(-1), sup.stderr())
        }
        other => panic!("the documentation lists exit code {other}, which this test cannot produce: add a scenario"),
    }
}

#[test]
fn every_documented_exit_code_is_the_one_the_program_ends_with() {
    let codes = documented_codes();
    let expected: BTreeSet<i32> = [0, 1, 2, 3, 4, 75, 130].into();
    assert_eq!(
        codes, expected,
        "the documented exit-code table lists these codes"
    );
    // --help names each of them too.
    let help = supervise(&["--help"], None);
    let help = String::from_utf8_lossy(&help.stdout).into_owned();
    for c in &codes {
        assert!(
            help.contains(&format!(" {c} ")),
            "--help does not explain exit code {c}:\n{help}"
        );
    }
    for c in codes {
        let (got, stderr) = produce(c);
        assert_eq!(got, c, "scenario for exit code {c}; stderr:\n{stderr}");
    }
}

#[test]
fn a_run_stopped_before_its_end_says_how_to_continue_it() {
    let mut sup = Sup::start_real(&["--gpus", "cpu:2"]);
    sup.wait_running(2);
    sup.signal(Signal::SIGINT);
    let code = sup.wait_exit(T).code();
    let err = sup.stderr();
    assert_eq!(code, Some(75), "{err}");
    assert!(
        err.contains("before the run's end") && err.contains("--resume"),
        "{err}"
    );
    // A resumable stop is not a failure: state.json says stopped, with the code.
    let st = sup.state().unwrap();
    assert_eq!(st["phase"], "stopped");
    assert_eq!(st["exit_code"], 75);
}

#[test]
fn the_readme_cites_documents_and_licenses_the_repository_has() {
    let root = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    // Every relative Markdown link of the README names a file of the repository.
    let mut links = 0;
    for part in readme.split("](").skip(1) {
        let target = part.split(')').next().unwrap();
        if target.starts_with("http") || target.starts_with('#') {
            continue;
        }
        links += 1;
        assert!(
            root.join(target).is_file(),
            "README links {target}, which does not exist"
        );
    }
    assert!(
        links >= 4,
        "the README links its docs and licenses ({links} links)"
    );
    // And every relative link of the pages under docs/ (relative to docs/).
    for page in std::fs::read_dir(root.join("docs")).unwrap().flatten() {
        let path = page.path();
        if path.extension().is_none_or(|x| x != "md") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        for part in text.split("](").skip(1) {
            let target = part.split(')').next().unwrap();
            let file = target.split('#').next().unwrap();
            if target.starts_with("http") || file.is_empty() || target.contains(' ') {
                continue;
            }
            assert!(
                root.join("docs").join(file).exists(),
                "{} links {target}, which does not exist",
                path.display()
            );
        }
    }
    for doc in [
        "docs/DESIGN.md",
        "docs/DFLASH.md",
        "LICENSE-MIT",
        "LICENSE-APACHE",
    ] {
        assert!(readme.contains(doc), "the README cites {doc}");
    }
    // The licenses are the ones Cargo.toml declares.
    let cargo = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    assert!(cargo.contains(r#"license = "MIT OR Apache-2.0""#));
    let apache = std::fs::read_to_string(root.join("LICENSE-APACHE")).unwrap();
    assert!(apache.contains("Apache License") && apache.contains("Version 2.0"));
    let mit = std::fs::read_to_string(root.join("LICENSE-MIT")).unwrap();
    assert!(mit.starts_with("MIT License"));
}
