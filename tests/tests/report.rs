//! `dflash-supervise report`: a self-contained page of a run, for a finished run (written
//! by the run itself at its end), for one with (fake) GPUs that throttle and report an XID,
//! for one whose supervisor was killed, and kept current by `--watch` on a live run; and,
//! on a run dir written by hand and the page's SVG read back as XML, the numbers that
//! matter shown (issue 40): a lone τ inside its plot with its value, axes that fit their
//! data, whole worker names, and a summary that leads with τ, the best checkpoint and the
//! held-out eval.

mod common;

use std::fs;
use std::path::Path;
use std::process::{Command, Stdio};
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

/// The machine-readable value of the summary cell of `class`.
fn cell(html: &str, class: &str) -> String {
    let tag = format!(r#"<td class="{class}" data-value=""#);
    let i = html
        .find(&tag)
        .unwrap_or_else(|| panic!("no summary cell {class}"));
    let rest = &html[i + tag.len()..];
    rest[..rest.find('"').unwrap()]
        .replace("&quot;", "\"")
        .replace("&amp;", "&")
}

/// The opening tags of elements whose class is `class`.
fn tags<'a>(html: &'a str, class: &str) -> Vec<&'a str> {
    let needle = format!(r#"class="{class}""#);
    html.match_indices(&needle)
        .map(|(i, _)| {
            let start = html[..i].rfind('<').unwrap();
            &html[start..i + html[i..].find('>').unwrap() + 1]
        })
        .collect()
}

fn attr<'a>(tag: &'a str, name: &str) -> &'a str {
    let k = format!(r#" {name}=""#);
    let rest = &tag[tag.find(&k).unwrap_or_else(|| panic!("no {name} in {tag}")) + k.len()..];
    &rest[..rest.find('"').unwrap()]
}

/// The page is well-formed XHTML (python's strict XML parser reads it).
fn assert_parses(path: &Path) {
    match Command::new("python3")
        .args([
            "-c",
            "import sys, xml.etree.ElementTree as E; E.parse(sys.argv[1])",
        ])
        .arg(path)
        .output()
    {
        Ok(o) => assert!(
            o.status.success(),
            "the report does not parse: {}",
            String::from_utf8_lossy(&o.stderr)
        ),
        Err(e) => {
            assert!(
                std::env::var_os("CI").is_none(),
                "python3 is missing ({e}): under CI the XML check may not skip"
            );
            eprintln!("SKIPPED the XML check of the report: python3 is missing ({e})");
        }
    }
}

fn status_json(run_dir: &Path) -> Value {
    let out = supervise(
        &["status", "--run-dir", run_dir.to_str().unwrap(), "--json"],
        None,
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn a_finished_run_writes_its_report_with_one_loss_point_per_step_and_the_figures_of_ledger_and_status(
) {
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:2",
        "--data",
        "demo",
        "--steps",
        "12",
        "--max-seq-len",
        "64",
        "--token-budget",
        "512",
        "--metrics-interval",
        "300ms",
    ]);
    assert_eq!(sup.wait_exit(T).code(), Some(0), "{}", sup.stderr());
    let page = sup.run_dir.join("report.html");
    // Named beside the exported drafter's path, in the run's last console lines.
    let err = sup.stderr();
    let tail: Vec<&str> = err.lines().rev().take(2).collect();
    assert!(
        tail.iter()
            .any(|l| l.contains(&format!("report written to {}", page.display()))),
        "{err}"
    );
    assert!(
        tail.iter()
            .any(|l| l.contains("drafter (step 12) written to")),
        "{err}"
    );
    assert_parses(&page);
    let html = fs::read_to_string(&page).unwrap();
    let train: Vec<Value> = read_jsonl(&sup.run_dir.join("train.jsonl"))
        .into_iter()
        .filter(|l| l.get("step").is_some())
        .collect();
    let loss = points(&html, "loss");
    assert_eq!(loss.len(), train.len(), "one loss point per step");
    for ((step, v), l) in loss.iter().zip(&train) {
        assert_eq!(*step, l["step"].as_u64().unwrap());
        let want = l["loss"].as_f64().unwrap();
        assert!(
            (v - want).abs() <= 1e-5 * want.abs(),
            "step {step}: {v} vs train.jsonl {want}"
        );
    }
    let acc = points(&html, "acceptance");
    assert_eq!(acc.len(), train.len());
    for ((_, v), l) in acc.iter().zip(&train) {
        assert!((v - l["acceptance"].as_f64().unwrap()).abs() <= 1e-5 * v.abs());
    }
    // Per-slot accuracy: one line per slot that train.jsonl records.
    let slots = train[0]["slot_accuracy"]
        .as_array()
        .expect("train.jsonl has slot_accuracy")
        .len();
    let slot_lines: std::collections::BTreeSet<&str> = tags(&html, "slot-accuracy")
        .into_iter()
        .map(|t| attr(t, "data-slot"))
        .collect();
    assert_eq!(slot_lines.len(), slots, "{slot_lines:?}");

    // The summary says what `ledger` and `status --json` say.
    let (code, a) = sup.ledger();
    assert_eq!(code, 0);
    assert_eq!(
        cell(&html, "ledger"),
        format!(
            "{} {} {} {} {}",
            a["produced"], a["consumed_once"], a["lost"], a["duplicated"], a["in_flight"]
        )
    );
    let st = status_json(&sup.run_dir);
    assert_eq!(cell(&html, "steps"), st["train"]["step"].to_string());
    assert_eq!(cell(&html, "steps"), "12");
    assert_eq!(cell(&html, "batches"), st["batches_consumed"].to_string());
    assert_eq!(
        cell(&html, "rollbacks"),
        st["train"]["rollbacks"].to_string()
    );
    assert_eq!(
        cell(&html, "skipped-steps"),
        st["train"]["skipped_steps"].to_string()
    );
    assert_eq!(cell(&html, "bad-lines"), st["bad_lines"].to_string());
    assert_eq!(cell(&html, "ended"), st["exit_code"].to_string());
    assert_eq!(cell(&html, "started"), st["started_at"].as_str().unwrap());
    let restarts: Vec<String> = st["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| format!("{}={}", w["name"].as_str().unwrap(), w["restarts"]))
        .collect();
    assert_eq!(cell(&html, "restarts"), restarts.join(","));
    let close = |cell: &str, want: f64| {
        let got: f64 = cell.parse().unwrap();
        assert!((got - want).abs() <= 1e-9 * want.abs(), "{got} vs {want}");
    };
    close(
        &cell(&html, "final-loss"),
        st["train"]["loss"].as_f64().unwrap(),
    );
    close(
        &cell(&html, "final-acceptance"),
        st["train"]["acceptance"].as_f64().unwrap(),
    );
    assert_eq!(
        cell(&html, "exported"),
        st["train"]["exported"].as_str().unwrap()
    );
    let tokens: u64 = train.iter().map(|l| l["tokens"].as_u64().unwrap()).sum();
    assert_eq!(cell(&html, "tokens"), tokens.to_string());
    let ckpts = sup
        .events()
        .iter()
        .filter(|e| e["event"] == "checkpoint")
        .count();
    assert_eq!(cell(&html, "checkpoints"), ckpts.to_string());
    // Tokens/s over the metrics windows, weighted by their length.
    let windows: Vec<(f64, f64)> = read_jsonl(&sup.run_dir.join("metrics.jsonl"))
        .iter()
        .map(|m| {
            (
                m["pipeline"]["tokens_per_s_trained"].as_f64().unwrap(),
                m["window_s"].as_f64().unwrap(),
            )
        })
        .collect();
    let mean =
        windows.iter().map(|(x, w)| x * w).sum::<f64>() / windows.iter().map(|p| p.1).sum::<f64>();
    let tps: Vec<f64> = cell(&html, "tokens-per-s")
        .split(' ')
        .map(|x| x.parse().unwrap())
        .collect();
    assert!(
        (tps[0] - mean).abs() <= 1e-3 * mean.max(1.0),
        "{tps:?} vs mean {mean}"
    );
    // (A mean need not lie between p10 and p90 of a few uneven windows: only the
    // percentiles' order and range are certain.)
    let (lo, hi) = windows
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), (x, _)| {
            (a.min(*x), b.max(*x))
        });
    assert!(
        lo - 1e-3 <= tps[1] && tps[1] <= tps[2] && tps[2] <= hi + 1e-3,
        "min {lo} <= p10 <= p90 <= max {hi}: {tps:?}"
    );
    assert!(
        html.contains("ended: step limit reached (exit code 0)"),
        "{html}"
    );

    // Series from metrics.jsonl; GPU ones are absent and say why.
    assert!(!tags(&html, "tps-total").is_empty() && !tags(&html, "tps-worker").is_empty());
    assert!(tags(&html, "pool-fill").len() >= 2 && !tags(&html, "hint").is_empty());
    let phases: Vec<&str> = tags(&html, "phase")
        .into_iter()
        .map(|t| attr(t, "data-phase"))
        .collect();
    assert!(
        phases.contains(&"wait") && phases.contains(&"optimizer"),
        "{phases:?}"
    );
    assert!(!tags(&html, "bucket").is_empty() && !tags(&html, "padding-efficiency").is_empty());
    assert!(tags(&html, "gpu-util").is_empty());
    assert!(
        html.contains("no GPU samples: every worker ran on CPU"),
        "absent series are named with the reason"
    );
    // Lifelines: a spawn marker per worker.
    assert!(html.matches(r#"class="ev-spawn""#).count() >= 2);
}

/// Fake GPUs: GPU 0 throttles (software power cap and thermal slowdown), GPU 1 reports XID 79.
const NVML: &str = r#"{"driver": "550", "xid": [[1, 79]], "devices": [
    {"name": "Fake H200", "uuid": "GPU-a", "memory_total": 150000000000, "memory_used": 60000000000, "util_gpu": 93, "util_mem": 30,
     "power_mw": 690000, "power_limit_mw": 700000, "energy_mj": 5000, "temp_c": 86, "sm_clock_mhz": 1600, "mem_clock_mhz": 2619, "throttle_mask": 36},
    {"name": "Fake H200", "uuid": "GPU-b", "memory_total": 150000000000, "memory_used": 40000000000, "util_gpu": 71, "util_mem": 20,
     "power_mw": 430000, "power_limit_mw": 700000, "energy_mj": 5000, "temp_c": 58, "sm_clock_mhz": 1980, "mem_clock_mhz": 2619, "throttle_mask": 0}]}"#;

#[test]
fn a_run_on_gpus_that_throttle_and_report_an_xid_has_its_gpu_plots_and_markers() {
    let tmp = tempfile::tempdir().unwrap();
    let lib = fake_nvml();
    let s = tmp.path().join("nvml.json");
    fs::write(&s, NVML).unwrap();
    let env = [
        ("DFLASH_NVML_LIBRARY", lib.to_str().unwrap()),
        ("DFLASH_FAKE_NVML", s.to_str().unwrap()),
        ("DFLASH_DEVICE", "cpu"),
    ];
    let args = [
        "--gpus",
        "0-1",
        "--data",
        "demo",
        "--epochs",
        "50",
        "--max-seq-len",
        "64",
        "--token-budget",
        "512",
        "--metrics-interval",
        "300ms",
        "--gpu-sample-interval",
        "50ms",
    ];
    let mut sup = Sup::start_real_env(&args, &env);
    let metrics = |sup: &Sup| read_jsonl(&sup.run_dir.join("metrics.jsonl"));
    wait_for(
        "a window with the XID and one with a throttle reason",
        T,
        || {
            let m = metrics(&sup);
            let xid = m
                .iter()
                .any(|w| w["gpu"]["gpus"][1]["xid_errors"] == serde_json::json!([79]));
            let throttle = m.iter().any(|w| {
                w["gpu"]["gpus"][0]["throttle_reasons"]
                    .as_array()
                    .is_some_and(|r| !r.is_empty())
            });
            (xid && throttle).then_some(())
        },
    );
    sup.signal(Signal::SIGTERM);
    assert_eq!(sup.wait_exit(T).code(), Some(75), "{}", sup.stderr());
    let page = sup.run_dir.join("report.html");
    assert_parses(&page);
    let html = fs::read_to_string(&page).unwrap();
    // A line per GPU in every GPU plot.
    for class in [
        "gpu-util",
        "gpu-mem-used",
        "gpu-mem-total",
        "gpu-power",
        "gpu-power-limit",
        "gpu-temp",
        "gpu-sm-clock",
    ] {
        let gpus: std::collections::BTreeSet<&str> = tags(&html, class)
            .into_iter()
            .map(|t| attr(t, "data-gpu"))
            .collect();
        assert_eq!(gpus.into_iter().collect::<Vec<_>>(), ["0", "1"], "{class}");
    }
    // Throttle reasons on GPU 0 only, where they happened.
    let throttles = tags(&html, "throttle");
    assert!(!throttles.is_empty());
    let end: f64 = cell(&html, "duration").parse().unwrap();
    for t in &throttles {
        assert_eq!(attr(t, "data-gpu"), "0", "{t}");
        assert_eq!(
            attr(t, "data-reasons"),
            "sw_power_cap, sw_thermal_slowdown",
            "{t}"
        );
        let at: f64 = attr(t, "data-t").parse().unwrap();
        assert!(
            (0.0..=end + 0.01).contains(&at),
            "{t} outside the run's {end} s"
        );
    }
    // The XID once, on GPU 1, at the window it arrived in.
    let xids = tags(&html, "xid");
    assert_eq!(xids.len(), 1, "{xids:?}");
    assert_eq!(
        (attr(xids[0], "data-gpu"), attr(xids[0], "data-code")),
        ("1", "79")
    );
    let xid_t: f64 = attr(xids[0], "data-t").parse().unwrap();
    assert!(
        (0.0..=end + 0.01).contains(&xid_t),
        "{xid_t} outside the run's {end} s"
    );
    assert!(html.contains("GPU 1 XID 79 at"));
    assert!(!html.contains("GPU utilisation, memory, power, temperature, SM clock: not shown"));
}

#[test]
fn a_killed_run_with_a_cut_off_line_still_reports_and_says_so() {
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:2",
        "--data",
        "demo",
        "--epochs",
        "50",
        "--max-seq-len",
        "64",
        "--token-budget",
        "512",
    ]);
    sup.wait_state("step 3", T, |s| {
        s["train"]["step"].as_u64().unwrap_or(0) >= 3
    });
    sup.signal(Signal::SIGKILL);
    sup.wait_exit(T);
    // What a crash mid-write leaves.
    use std::io::Write;
    fs::OpenOptions::new()
        .append(true)
        .open(sup.run_dir.join("train.jsonl"))
        .unwrap()
        .write_all(br#"{"t":1,"step":99,"lo"#)
        .unwrap();
    let out = supervise(&["report", sup.run_dir.to_str().unwrap()], None);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let page = sup.run_dir.join("report.html");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        page.display().to_string()
    );
    assert_parses(&page);
    let html = fs::read_to_string(&page).unwrap();
    assert!(html.contains("did not end cleanly"), "{html}");
    assert_eq!(cell(&html, "ended"), "null");
    assert!(html.contains("train.jsonl: a line cut off by a crash was skipped"));
    assert!(points(&html, "loss").len() >= 3);
}

/// The steps the page's summary shows, once it exists.
fn page_steps(page: &Path) -> Option<u64> {
    let html = fs::read_to_string(page).ok()?;
    html.contains(r#"class="steps""#)
        .then(|| cell(&html, "steps").parse().ok())?
}

#[test]
fn watch_rewrites_the_page_while_the_run_goes_on_and_stops_when_it_ends_or_on_ctrl_c() {
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:2",
        "--data",
        "demo",
        "--epochs",
        "50",
        "--max-seq-len",
        "64",
        "--token-budget",
        "512",
        "--metrics-interval",
        "300ms",
    ]);
    sup.wait_state("step 1", T, |s| {
        s["train"]["step"].as_u64().unwrap_or(0) >= 1
    });
    let watch = |out: &Path| {
        Command::new(bin("dflash-supervise"))
            .args([
                "report",
                sup.run_dir.to_str().unwrap(),
                "--watch",
                "--out",
                out.to_str().unwrap(),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let (page, page2) = (
        sup.tmp.path().join("watched.html"),
        sup.tmp.path().join("interrupted.html"),
    );
    let mut w = watch(&page);
    let mut w2 = watch(&page2);
    let first = wait_for("the first page", T, || page_steps(&page));
    wait_for("the page rewritten with more steps", T, || {
        page_steps(&page).filter(|s| *s > first)
    });
    assert!(fs::read_to_string(&page).unwrap().contains("still running"));
    // Ctrl-C stops a watcher, leaving its last page whole.
    wait_for("the second watcher's page", T, || page_steps(&page2));
    signal(w2.id(), Signal::SIGINT);
    let st = wait_for("the interrupted watcher to exit", T, || {
        w2.try_wait().unwrap()
    });
    assert_eq!(st.code(), Some(0));
    assert_parses(&page2);
    // The run ends: the watcher writes the final page and exits by itself.
    sup.signal(Signal::SIGTERM);
    assert_eq!(sup.wait_exit(T).code(), Some(75), "{}", sup.stderr());
    let st = wait_for("the watcher to exit after the run", T, || {
        w.try_wait().unwrap()
    });
    let mut err = String::new();
    std::io::Read::read_to_string(w.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert_eq!(st.code(), Some(0), "{err}");
    assert!(err.contains("the run has ended"), "{err}");
    assert_parses(&page);
    let html = fs::read_to_string(&page).unwrap();
    assert_eq!(cell(&html, "ended"), "75", "stopped cleanly before its end");
    assert_eq!(
        cell(&html, "steps"),
        status_json(&sup.run_dir)["train"]["step"].to_string()
    );
    // A run that has ended: --watch writes once and exits.
    let out = supervise(&["report", sup.run_dir.to_str().unwrap(), "--watch"], None);
    assert_eq!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not live"));
}

/// A long run's page stays small: `bench report` writes the page of a synthetic
/// 20,000-step run on 2 GPUs (every file a run writes) beside a 200-step one's. Every series
/// is thinned to the plots' pixel columns, so the page grows far slower than the run
/// (100x the steps; a page drawing every point would be about 100x too). Headless Chromium
/// (Debian's chromium; .ci/run installs it) opens both pages: the benchmark's open times
/// are there (the figures are the benchmark's to print, not this test's to judge).
#[test]
fn a_long_runs_page_stays_small_and_opens_in_chromium_as_the_benchmark_measures_it() {
    let chromium = Command::new("chromium").arg("--version").output().is_ok();
    if !chromium {
        assert!(
            std::env::var_os("CI").is_none(),
            "chromium is missing: under CI the open time may not go unmeasured (.ci/run installs it)"
        );
        eprintln!("chromium not installed: the page's open time is not measured");
    }
    let mut args = vec![
        "bench", "report", "--steps", "20000", "--gpus", "2", "--json",
    ];
    if !chromium {
        args.push("--no-chromium");
    }
    let out = supervise(&args, None);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let (bytes, ratio) = (
        v["page_bytes"].as_u64().unwrap(),
        v["size_ratio"].as_f64().unwrap(),
    );
    assert!(bytes < 3_000_000 && ratio < 20.0, "{v}");
    if chromium {
        assert!(
            v["open_s"].as_f64().is_some_and(|s| s > 0.0)
                && v["baseline_open_s"].as_f64().is_some_and(|s| s > 0.0),
            "both pages opened: {v}"
        );
    }
}

/// An element of the page as a small XML parser reads it: its name, attributes, text, and
/// children.
#[derive(Debug, Default)]
struct El {
    name: String,
    attrs: Vec<(String, String)>,
    text: String,
    kids: Vec<El>,
}

impl El {
    fn attr(&self, k: &str) -> Option<&str> {
        self.attrs
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.as_str())
    }

    fn num(&self, k: &str) -> f64 {
        self.attr(k)
            .unwrap_or_else(|| panic!("no {k} in {self:?}"))
            .parse()
            .unwrap_or_else(|e| panic!("{k} of {self:?}: {e}"))
    }

    fn is(&self, name: &str, class: &str) -> bool {
        self.name == name && self.attr("class") == Some(class)
    }

    /// Every element under this one (itself first), with whether a clip path is on the
    /// way down to it.
    fn all(&self) -> Vec<(&El, bool)> {
        fn walk<'a>(e: &'a El, clipped: bool, out: &mut Vec<(&'a El, bool)>) {
            let clipped = clipped || e.attr("clip-path").is_some();
            out.push((e, clipped));
            for k in &e.kids {
                walk(k, clipped, out);
            }
        }
        let mut out = Vec::new();
        walk(self, false, &mut out);
        out
    }

    fn find(&self, name: &str, class: &str) -> Vec<&El> {
        self.all()
            .into_iter()
            .map(|(e, _)| e)
            .filter(|e| e.is(name, class))
            .collect()
    }

    /// The chart `<svg data-chart=id>`.
    fn chart(&self, id: &str) -> &El {
        self.all()
            .into_iter()
            .map(|(e, _)| e)
            .find(|e| e.name == "svg" && e.attr("data-chart") == Some(id))
            .unwrap_or_else(|| panic!("no chart {id}"))
    }

    /// The plot rectangle of a chart: (left, top, right, bottom): the clip path's
    /// rectangle, which the plot's background fills.
    fn plot_rect(&self) -> (f64, f64, f64, f64) {
        let r = self
            .all()
            .into_iter()
            .find(|(e, _)| e.name == "clipPath")
            .and_then(|(c, _)| c.kids.iter().find(|k| k.name == "rect"))
            .expect("a clipPath rect");
        let (x, y) = (r.num("x"), r.num("y"));
        (x, y, x + r.num("width"), y + r.num("height"))
    }
}

fn unescape(s: &str) -> String {
    s.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&#39;", "'")
        .replace("&amp;", "&")
}

/// The page as XML: every tag closed by its own name, attributes quoted (it panics on
/// anything else, so a page that is not well-formed fails the test).
fn parse_xml(page: &str) -> El {
    let mut stack = vec![El::default()];
    let mut rest = page;
    while let Some(lt) = rest.find('<') {
        let text = unescape(&rest[..lt]);
        stack.last_mut().unwrap().text.push_str(&text);
        rest = &rest[lt..];
        if let Some(r) = rest.strip_prefix("<!--") {
            rest = &r[r.find("-->").expect("comment end") + 3..];
            continue;
        }
        let gt = rest.find('>').expect("tag end");
        let tag = &rest[1..gt];
        rest = &rest[gt + 1..];
        if tag.starts_with('!') || tag.starts_with('?') {
            continue;
        }
        if let Some(name) = tag.strip_prefix('/') {
            let el = stack.pop().unwrap();
            assert_eq!(el.name, name.trim(), "mismatched closing tag");
            stack.last_mut().unwrap().kids.push(el);
            continue;
        }
        let closed = tag.ends_with('/');
        let tag = tag.trim_end_matches('/');
        let name_end = tag.find(char::is_whitespace).unwrap_or(tag.len());
        let mut el = El {
            name: tag[..name_end].to_string(),
            ..El::default()
        };
        let mut a = tag[name_end..].trim();
        while !a.is_empty() {
            let eq = a
                .find("=\"")
                .unwrap_or_else(|| panic!("attribute in <{tag}>"));
            let end = a[eq + 2..].find('"').expect("attribute end") + eq + 2;
            el.attrs
                .push((a[..eq].trim().to_string(), unescape(&a[eq + 2..end])));
            a = a[end + 1..].trim();
        }
        if closed {
            stack.last_mut().unwrap().kids.push(el);
        } else {
            stack.push(el);
        }
    }
    assert_eq!(stack.len(), 1, "unclosed elements");
    stack.pop().unwrap()
}

/// A lower estimate of the width of `s` in a sans-serif font of `font` px (0.6 em a
/// character: DejaVu Sans's lowercase letters average about 0.55 em, its digits 0.64).
fn text_width(s: &str, font: f64) -> f64 {
    s.chars().count() as f64 * font * 0.6
}

/// A run dir written by hand: 6 steps whose loss goes from 11.9 down to 11.6, a held-out
/// eval at step 4, one τ measurement (at the last step, τ 1 with a [1, 1] interval, as an
/// untrained drafter's is) that `checkpoints/best` names, and two workers with long names.
fn run_with_one_tau(dir: &Path, workers: &[&str], tau: bool) {
    let t0: u64 = 1_767_225_600_000;
    let ws: Vec<String> = workers
        .iter()
        .map(|w| format!(r#"{{"name": "{w}", "gpu": "cpu", "restarts": 0}}"#))
        .collect();
    fs::write(
        dir.join("state.json"),
        format!(
            r#"{{"started_at": "2026-01-01T00:00:00.000Z", "started_at_unix_ms": {t0}, "phase": "stopped",
                "workers": [{}], "train": {{"step": 6, "best_step": 6}}}}"#,
            ws.join(", ")
        ),
    )
    .unwrap();
    let mut train: Vec<String> = (1..=6u64)
        .map(|s| {
            format!(
                r#"{{"t": {}, "step": {s}, "loss": {}, "acceptance": {}, "lr": 0.001, "tokens": 100}}"#,
                t0 + s * 1000,
                11.9 - 0.06 * (s - 1) as f64,
                1.0 + 0.01 * s as f64
            )
        })
        .collect();
    train.insert(
        4,
        format!(
            r#"{{"t": {}, "eval": {{"step": 4, "loss": 11.75, "acceptance": 1.03}}}}"#,
            t0 + 4500
        ),
    );
    if tau {
        train.push(format!(
            r#"{{"t": {}, "tau": {{"step": 6, "prompts": 6, "block_size": 8, "pooled": 1.0, "pooled_ci95": [1.0, 1.0], "mean_of_means": 1.0, "mean_of_means_ci95": [1.0, 1.0]}}}}"#,
            t0 + 7000
        ));
        let ck = dir.join("checkpoints");
        fs::create_dir_all(ck.join("step-00000006")).unwrap();
        fs::write(ck.join("step-00000006/meta.json"), "{}").unwrap();
        std::os::unix::fs::symlink("step-00000006", ck.join("best")).unwrap();
    }
    fs::write(dir.join("train.jsonl"), train.join("\n") + "\n").unwrap();
    let mut events =
        vec![r#"{"time": "2026-01-01T00:00:00.000Z", "event": "run_start"}"#.to_string()];
    for w in workers {
        events.push(format!(
            r#"{{"time": "2026-01-01T00:00:00.500Z", "event": "spawn", "worker": "{w}"}}"#
        ));
    }
    events.push(
        r#"{"time": "2026-01-01T00:00:08.000Z", "event": "run_end", "reason": "step limit reached", "exit_code": 0}"#
            .into(),
    );
    fs::write(dir.join("events.jsonl"), events.join("\n") + "\n").unwrap();
}

fn report_of(dir: &Path) -> El {
    let out = supervise(&["report", dir.to_str().unwrap()], None);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let page = dir.join("report.html");
    assert_parses(&page);
    parse_xml(&fs::read_to_string(&page).unwrap())
}

/// Issue 40: the numbers that matter are shown. A lone τ point is drawn inside its plot
/// (not on its border or in its corner) with its value beside it; the loss axis fits a
/// loss from 11.9 to 11.6 (it does not start at 0); the workers' names on their lifelines
/// fit left of the plot and are not clipped; the summary leads with τ, the best checkpoint
/// and the held-out eval, and says how to measure τ when it was not.
#[test]
fn the_page_shows_a_lone_tau_inside_its_plot_labelled_axes_that_fit_whole_names_and_tau_first() {
    let tmp = tempfile::tempdir().unwrap();
    let workers = ["target-eu-west-node-17", "drafter-eu-west-node-17-b"];
    run_with_one_tau(tmp.path(), &workers, true);
    let page = report_of(tmp.path());

    // The lone τ point, strictly inside its plot, its value written near it.
    let tau = page.chart("tau");
    let (l, t, r, b) = tau.plot_rect();
    let dots = tau.find("circle", "tau-pooled");
    assert_eq!(dots.len(), 1, "one τ point");
    let (cx, cy, rad) = (dots[0].num("cx"), dots[0].num("cy"), dots[0].num("r"));
    assert!(
        l < cx - rad && cx + rad < r && t < cy - rad && cy + rad < b,
        "the τ point ({cx}, {cy}) r {rad} is not inside the plot [{l}, {r}] × [{t}, {b}]"
    );
    let label = tau.all().into_iter().map(|(e, _)| e).find(|e| {
        e.name == "text"
            && e.text
                .trim()
                .parse::<f64>()
                .is_ok_and(|v| (v - 1.0).abs() < 5e-4)
            && (e.num("x") - cx).abs() < 40.0
            && (e.num("y") - cy).abs() < 20.0
    });
    let label = label.unwrap_or_else(|| panic!("no label of τ 1 near ({cx}, {cy})"));
    let (lx, ly) = (label.num("x"), label.num("y"));
    assert!(
        l < lx && lx < r && t < ly && ly < b,
        "the label at ({lx}, {ly}) is outside the plot"
    );

    // The loss axis fits 11.9 → 11.6: its lowest tick is near the data, not 0, and every
    // loss point is inside the plot.
    let loss = page.chart("loss");
    let (l, t, r, b) = loss.plot_rect();
    let ticks: Vec<f64> = loss
        .all()
        .into_iter()
        .map(|(e, _)| e)
        .filter(|e| e.name == "text" && e.attr("text-anchor") == Some("end") && e.num("x") < l)
        .filter_map(|e| e.text.trim().parse().ok())
        .collect();
    let lowest = ticks.iter().copied().fold(f64::INFINITY, f64::min);
    assert!(
        (11.0..=11.6).contains(&lowest),
        "the loss axis's lowest tick is {lowest}: {ticks:?}"
    );
    for c in loss.find("circle", "loss") {
        let (x, y) = (c.num("cx"), c.num("cy"));
        assert!(l < x && x < r && t < y && y < b, "loss point ({x}, {y})");
    }

    // Every worker's name, whole, left of the lifelines' plot, and not clipped.
    let lanes = page.chart("lifelines");
    let (l, ..) = lanes.plot_rect();
    for w in workers {
        let (name, clipped) = lanes
            .all()
            .into_iter()
            .find(|(e, _)| e.name == "text" && e.text == w)
            .unwrap_or_else(|| panic!("no name {w} on the lifelines"));
        let (x, font) = (name.num("x"), name.num("font-size"));
        assert!(!clipped, "{w} is drawn inside the plot's clip path");
        assert!(
            x >= 0.0 && x + text_width(w, font) <= l,
            "{w} at x {x} ({font} px) does not fit left of the plot at {l}"
        );
    }

    // The summary leads with τ, the best checkpoint and the held-out eval.
    let summary = page
        .all()
        .into_iter()
        .map(|(e, _)| e)
        .find(|e| e.is("table", "summary"))
        .expect("the summary");
    let cells: Vec<&El> = summary
        .kids
        .iter()
        .filter_map(|tr| tr.kids.iter().find(|k| k.name == "td"))
        .collect();
    let classes: Vec<&str> = cells.iter().filter_map(|c| c.attr("class")).collect();
    assert_eq!(
        classes[..3],
        ["tau", "best-checkpoint", "eval"],
        "{classes:?}"
    );
    let tau_value: Vec<f64> = cells[0]
        .attr("data-value")
        .unwrap()
        .split(' ')
        .map(|v| v.parse().unwrap())
        .collect();
    assert_eq!(
        tau_value,
        [1.0, 1.0, 1.0, 6.0],
        "pooled, its interval, the step"
    );
    assert!(cells[0].text.contains("at step 6"), "{}", cells[0].text);
    assert_eq!(cells[1].attr("data-value"), Some("6"));
    assert!(
        cells[1].text.contains("checkpoints/best"),
        "{}",
        cells[1].text
    );
    assert!(
        cells[2].text.contains("11.75") && cells[2].text.contains("step 4"),
        "{}",
        cells[2].text
    );

    // Without τ, the row says how to measure it.
    let tmp = tempfile::tempdir().unwrap();
    run_with_one_tau(tmp.path(), &workers, false);
    let page = report_of(tmp.path());
    let cell = page.find("td", "tau");
    assert_eq!(
        cell[0].text,
        "not measured (use --eval-prompts or dflash-supervise eval)"
    );
}

/// The worker's report of a τ measurement (what `dflash-worker eval --json` prints), for
/// RUN_DIR/eval/tau-step-N.json: 6 prompts in two categories, block 4.
fn tau_report_with_categories() -> Value {
    let tau = |mm: f64, pooled: f64, tokens: u64, steps: u64| {
        serde_json::json!({"mean_of_means": mm, "mean_of_means_ci95": [1.0, mm + 0.25],
            "pooled": pooled, "pooled_ci95": [1.0, pooled + 0.25],
            "tokens": tokens, "verify_steps": steps, "histogram": [1, 1, 1, 1]})
    };
    serde_json::json!({
        "prompts": 6, "block_size": 4, "max_new_tokens": 16, "identical_to_greedy": 6,
        "tau": tau(1.5, 1.4, 14, 10),
        "acceptance_by_position": [0.3, 0.1, 0.0],
        "per_category": {
            "math": {"prompts": 4, "tau": tau(1.625, 1.5, 9, 6),
                     "acceptance_by_position": [0.5, 0.25, 0.0]},
            "coding": {"prompts": 2, "tau": tau(1.25, 1.25, 5, 4),
                       "acceptance_by_position": [0.25, 0.0, 0.0]}
        }
    })
}

/// Issue 43: the page shows the last τ measurement's τ per prompt category (a table whose
/// rows add up to all prompts) and its acceptance curve per drafted position (overall and
/// per category), from the worker's report of it in RUN_DIR/eval; an older measurement's
/// report is not used, and without categories the curve alone is shown.
#[test]
fn the_page_shows_the_last_taus_figures_per_category_and_its_acceptance_curve() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    run_with_one_tau(dir, &["target-0", "drafter-0"], true);
    fs::create_dir_all(dir.join("eval")).unwrap();
    let r = tau_report_with_categories();
    fs::write(dir.join("eval/tau-step-00000006.json"), format!("{r}\n\n")).unwrap();
    let mut stale = r.clone();
    stale["per_category"] = serde_json::json!({"stale": stale["per_category"]["math"]});
    fs::write(dir.join("eval/tau-step-00000005.json"), stale.to_string()).unwrap();
    let page = report_of(dir);

    let table = page.find("table", "tau-categories");
    assert_eq!(table.len(), 1, "one per-category table");
    assert_eq!(table[0].attr("data-step"), Some("6"));
    let rows = page.find("tr", "tau-category");
    let mut names: Vec<&str> = rows
        .iter()
        .map(|r| r.attr("data-category").unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["coding", "math"],
        "the last measurement's categories"
    );
    let all = &page.find("tr", "tau-category-all")[0];
    let sum = |k: &str| rows.iter().map(|r| r.num(k)).sum::<f64>();
    assert_eq!(sum("data-prompts"), all.num("data-prompts"));
    assert_eq!(all.num("data-prompts"), 6.0);
    assert_eq!(
        sum("data-tokens") / sum("data-verify-steps"),
        all.num("data-pooled"),
        "the categories' tokens over their steps are the pooled τ of all prompts"
    );
    let math = rows
        .iter()
        .find(|r| r.attr("data-category") == Some("math"))
        .unwrap();
    let cells: Vec<&str> = math.kids.iter().map(|k| k.text.as_str()).collect();
    assert_eq!(
        cells,
        ["math", "4", "1.625 [1.00, 1.88]", "1.500 [1.00, 1.75]"]
    );

    // The acceptance curve: one point per drafted position 1..3, overall and per category.
    let curve = page.chart("tau-acceptance");
    let points = |class: &str, category: Option<&str>| -> Vec<(f64, f64)> {
        curve
            .find("circle", class)
            .into_iter()
            .filter(|c| c.attr("data-category") == category)
            .map(|c| (c.num("data-step"), c.num("data-value")))
            .collect()
    };
    assert_eq!(
        points("tau-acceptance", None),
        [(1.0, 0.3), (2.0, 0.1), (3.0, 0.0)]
    );
    assert_eq!(
        points("tau-acceptance-category", Some("math")),
        [(1.0, 0.5), (2.0, 0.25), (3.0, 0.0)]
    );
    assert_eq!(points("tau-acceptance-category", Some("coding")).len(), 3);
    let (l, t, rr, b) = curve.plot_rect();
    for c in curve.find("circle", "tau-acceptance") {
        let (x, y) = (c.num("cx"), c.num("cy"));
        assert!(
            l < x && x < rr && t < y && y < b,
            "({x}, {y}) outside the plot"
        );
    }

    // Prompts without categories: the curve, no table.
    let mut plain = r.clone();
    plain["per_category"] = serde_json::json!({});
    fs::write(dir.join("eval/tau-step-00000006.json"), plain.to_string()).unwrap();
    let page = report_of(dir);
    assert!(page.find("table", "tau-categories").is_empty());
    assert_eq!(
        page.chart("tau-acceptance")
            .find("circle", "tau-acceptance")
            .len(),
        3
    );
    assert!(page
        .chart("tau-acceptance")
        .find("circle", "tau-acceptance-category")
        .is_empty());
    // No report of the measurement (a run of an older version): neither.
    fs::remove_file(dir.join("eval/tau-step-00000006.json")).unwrap();
    let page = report_of(dir);
    assert!(page.find("table", "tau-categories").is_empty());
    assert!(!page
        .all()
        .iter()
        .any(|(e, _)| e.attr("data-chart") == Some("tau-acceptance")));
}
