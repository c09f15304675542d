//! `dflash-supervise report`: a self-contained page of a run, for a finished run (written
//! by the run itself at its end) and for one whose supervisor was killed.

mod common;

use std::time::Duration;

use common::*;
use nix::sys::signal::Signal;
use serde_json::Value;

const T: Duration = Duration::from_secs(120);

/// (step, value) of every SVG point of `class` in the page.
fn points(html: &str, class: &str) -> Vec<(u64, f64)> {
    let tag = format!(r#"<circle class="{class}" data-step=""#);
    html.match_indices(&tag)
        .map(|(i, _)| {
            let rest = &html[i + tag.len()..];
            let step: u64 = rest[..rest.find('"').unwrap()].parse().unwrap();
            let v = &rest[rest.find("data-value=\"").unwrap() + 12..];
            (step, v[..v.find('"').unwrap()].parse().unwrap())
        })
        .collect()
}

/// The page is well-formed XHTML (python's strict XML parser reads it).
fn assert_parses(path: &std::path::Path) {
    let o = std::process::Command::new("python3").args(["-c", "import sys, xml.etree.ElementTree as E; E.parse(sys.argv[1])"]).arg(path).output().unwrap();
    assert!(o.status.success(), "the report does not parse: {}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn a_finished_run_writes_its_report_with_one_loss_point_per_step() {
    let mut sup = Sup::start_real(&["--gpus", "cpu:2", "--data", "demo", "--steps", "12", "--max-seq-len", "64", "--token-budget", "512"]);
    assert_eq!(sup.wait_exit(T).code(), Some(0), "{}", sup.stderr());
    let page = sup.run_dir.join("report.html");
    assert!(sup.stderr().contains(&format!("report written to {}", page.display())), "{}", sup.stderr());
    assert_parses(&page);
    let html = std::fs::read_to_string(&page).unwrap();
    let steps: Vec<Value> = read_jsonl(&sup.run_dir.join("train.jsonl")).into_iter().filter(|l| l.get("step").is_some()).collect();
    let loss = points(&html, "loss");
    assert_eq!(loss.len(), steps.len(), "one loss point per step");
    for ((step, v), l) in loss.iter().zip(&steps) {
        assert_eq!(*step, l["step"].as_u64().unwrap());
        let want = l["loss"].as_f64().unwrap();
        assert!((v - want).abs() <= 1e-5 * want.abs(), "step {step}: {v} vs train.jsonl {want}");
    }
    assert_eq!(points(&html, "acceptance").len(), steps.len());
    // The summary says what `ledger` says.
    let (_, a) = sup.ledger();
    assert!(html.contains(&format!("{} consumed once", a["consumed_once"])), "{a}");
    assert!(html.contains("ended: step limit reached (exit code 0)"), "{html}");
    assert!(html.contains("no GPU samples"), "absent series are named");
    // Lifelines: a spawn marker per worker.
    assert!(html.matches(r#"class="ev-spawn""#).count() >= 2);
}

#[test]
fn a_killed_run_with_a_cut_off_line_still_reports_and_says_so() {
    let mut sup = Sup::start_real(&["--gpus", "cpu:2", "--data", "demo", "--epochs", "50", "--max-seq-len", "64", "--token-budget", "512"]);
    sup.wait_state("step 3", T, |s| s["train"]["step"].as_u64().unwrap_or(0) >= 3);
    sup.signal(Signal::SIGKILL);
    sup.wait_exit(T);
    // What a crash mid-write leaves.
    use std::io::Write;
    std::fs::OpenOptions::new().append(true).open(sup.run_dir.join("train.jsonl")).unwrap().write_all(br#"{"t":1,"step":99,"lo"#).unwrap();
    let out = supervise(&["report", sup.run_dir.to_str().unwrap()], None);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let page = sup.run_dir.join("report.html");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), page.display().to_string());
    assert_parses(&page);
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(html.contains("did not end cleanly"), "{html}");
    assert!(html.contains("a line cut off by a crash was skipped"));
    assert!(points(&html, "loss").len() >= 3);
}
