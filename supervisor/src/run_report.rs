//! `dflash-supervise report`: a run's story in one self-contained XHTML page with inline
//! SVG (no script, no network): a summary table, loss and acceptance per step with the
//! learning rate, and worker lifelines. It reads whatever the run wrote, so it works on a
//! finished, a crashed (last line cut off) or a live run.
//!
//! This is a first stage of the report: GPU, pool, phase-timing and batch-composition
//! plots are not drawn yet; the page says which series it leaves out.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::Error;

/// Every JSON line of a file that parses (a line a crash cut off is skipped), and whether
/// one did not.
fn read_jsonl(path: &Path) -> (Vec<Value>, bool) {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let mut torn = false;
    let lines = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .filter_map(|l| match serde_json::from_str(l) {
            Ok(v) => Some(v),
            Err(_) => {
                torn = true;
                None
            }
        })
        .collect();
    (lines, torn)
}

/// The committed steps of the final lineage: a rollback line drops the steps after its
/// target (they were trained again).
pub fn lineage_steps(train: &[Value]) -> Vec<Value> {
    let mut out: Vec<Value> = Vec::new();
    for l in train {
        if let Some(to) = l["rollback"]["to"].as_u64() {
            out.retain(|s| s["step"].as_u64().is_some_and(|n| n <= to));
        } else if l.get("step").is_some() {
            out.push(l.clone());
        }
    }
    out
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

fn ms_of(t: &Value) -> Option<f64> {
    humantime::parse_rfc3339(t.as_str()?).ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).map(|d| d.as_secs_f64() * 1e3)
}

const W: f64 = 900.0;
const H: f64 = 260.0;
const PAD: f64 = 50.0;

/// Loss (and acceptance) per step, with the learning rate on a second axis.
fn training_chart(steps: &[Value]) -> String {
    let mut s = String::new();
    if steps.is_empty() {
        return "<p>No training step was committed.</p>".into();
    }
    let xs: Vec<f64> = steps.iter().map(|l| l["step"].as_f64().unwrap_or(0.0)).collect();
    let (x0, x1) = (xs.iter().cloned().fold(f64::INFINITY, f64::min), xs.iter().cloned().fold(f64::NEG_INFINITY, f64::max).max(xs[0] + 1.0));
    let series = |k: &str| -> Vec<f64> { steps.iter().map(|l| l[k].as_f64().unwrap_or(f64::NAN)).collect() };
    let (loss, acc, lr) = (series("loss"), series("acceptance"), series("lr"));
    let finite_max = |v: &[f64]| v.iter().cloned().filter(|x| x.is_finite()).fold(0.0f64, f64::max).max(1e-12);
    let (lmax, amax, rmax) = (finite_max(&loss), finite_max(&acc), finite_max(&lr));
    let px = |x: f64| PAD + (x - x0) / (x1 - x0) * (W - 2.0 * PAD);
    let py = |y: f64, max: f64| H - PAD + -(y / max) * (H - 2.0 * PAD);
    let _ = write!(s, r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}">"#);
    let _ = write!(s, r##"<rect x="{PAD}" y="{PAD}" width="{}" height="{}" fill="none" stroke="#999"/>"##, W - 2.0 * PAD, H - 2.0 * PAD);
    for (name, vals, max, color) in [("loss", &loss, lmax, "#c0392b"), ("acceptance", &acc, amax, "#2471a3"), ("lr", &lr, rmax, "#7d7d7d")] {
        let pts: Vec<String> = xs.iter().zip(vals.iter()).filter(|(_, y)| y.is_finite()).map(|(x, y)| format!("{:.1},{:.1}", px(*x), py(*y, max))).collect();
        let dash = if name == "lr" { r#" stroke-dasharray="4 3""# } else { "" };
        let _ = write!(s, r#"<polyline class="{name}-line" fill="none" stroke="{color}" stroke-width="1.5"{dash} points="{}"/>"#, pts.join(" "));
        if name != "lr" {
            // One point per step, carrying its value (what the tests compare with train.jsonl).
            for (x, y) in xs.iter().zip(vals.iter()).filter(|(_, y)| y.is_finite()) {
                let _ = write!(s, r#"<circle class="{name}" data-step="{x}" data-value="{y:.6e}" cx="{:.1}" cy="{:.1}" r="1.6" fill="{color}"/>"#, px(*x), py(*y, max));
            }
        }
    }
    let _ = write!(
        s,
        r##"<text x="{PAD}" y="20" font-size="13">loss (red, max {lmax:.3}) · acceptance (blue, max {amax:.2}) · learning rate (grey dashed, right axis, max {rmax:.2e}) · steps {x0}–{x1}</text></svg>"##
    );
    s
}

/// One row per worker: spawns, exits (code or signal), hangs, restarts, rollbacks and the
/// stop on the shared time axis.
fn lifelines(events: &[Value]) -> String {
    let times: Vec<f64> = events.iter().filter_map(|e| ms_of(&e["time"])).collect();
    if times.is_empty() {
        return "<p>No events recorded.</p>".into();
    }
    let (t0, t1) = (times.iter().cloned().fold(f64::INFINITY, f64::min), times.iter().cloned().fold(f64::NEG_INFINITY, f64::max).max(times[0] + 1.0));
    let mut workers: Vec<String> = events.iter().filter_map(|e| e["worker"].as_str().map(String::from)).collect();
    workers.sort();
    workers.dedup();
    let row_h = 26.0;
    let height = PAD + row_h * (workers.len() as f64 + 1.0);
    let px = |t: f64| 140.0 + (t - t0) / (t1 - t0) * (W - 160.0);
    let mut s = format!(r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" viewBox="0 0 {W} {height}">"#);
    for (i, w) in workers.iter().enumerate() {
        let y = PAD + row_h * i as f64;
        let _ = write!(s, r##"<text x="4" y="{:.1}" font-size="12">{}</text><line x1="140" y1="{y:.1}" x2="{}" y2="{y:.1}" stroke="#ccc"/>"##, y + 4.0, esc(w), W - 20.0);
        for e in events.iter().filter(|e| e["worker"].as_str() == Some(w.as_str())) {
            let Some(t) = ms_of(&e["time"]) else { continue };
            let ev = e["event"].as_str().unwrap_or("");
            let (color, shape) = match ev {
                "spawn" => ("#27ae60", "circle"),
                "exit" => ("#c0392b", "rect"),
                "hang" => ("#e67e22", "rect"),
                "restart" => ("#8e44ad", "circle"),
                _ => ("#555", "circle"),
            };
            let what = match (e["code"].as_i64(), e["signal"].as_str()) {
                (Some(c), _) => format!("{ev} (exit code {c})"),
                (_, Some(sig)) => format!("{ev} ({sig})"),
                _ => ev.to_string(),
            };
            let title = format!("<title>{} at {}</title>", esc(&what), esc(e["time"].as_str().unwrap_or("")));
            if shape == "rect" {
                let _ = write!(s, r#"<rect class="ev-{ev}" x="{:.1}" y="{:.1}" width="6" height="12" fill="{color}">{title}</rect>"#, px(t) - 3.0, y - 6.0);
            } else {
                let _ = write!(s, r#"<circle class="ev-{ev}" cx="{:.1}" cy="{y:.1}" r="4" fill="{color}">{title}</circle>"#, px(t));
            }
        }
    }
    // Run-wide events (rollbacks, the stop) as vertical marks.
    for e in events.iter().filter(|e| matches!(e["event"].as_str(), Some("rollback" | "stop" | "run_end"))) {
        if let Some(t) = ms_of(&e["time"]) {
            let ev = e["event"].as_str().unwrap_or("");
            let _ = write!(
                s,
                r##"<line class="ev-{ev}" x1="{x:.1}" y1="{top}" x2="{x:.1}" y2="{bottom:.1}" stroke="#34495e" stroke-dasharray="2 2"><title>{ev}</title></line>"##,
                x = px(t),
                top = PAD - 14.0,
                bottom = height - 10.0
            );
        }
    }
    let _ = write!(s, r#"<text x="140" y="{:.1}" font-size="11">{:.1} s of run</text></svg>"#, height - 2.0, (t1 - t0) / 1e3);
    s
}

/// Write the report of the run in `run` to `out`.
pub fn write(run: &Path, out: &Path) -> Result<(), Error> {
    let state: Value = std::fs::read_to_string(run.join("state.json")).ok().and_then(|t| serde_json::from_str(&t).ok()).unwrap_or_default();
    let (train, train_torn) = read_jsonl(&run.join("train.jsonl"));
    let (events, events_torn) = read_jsonl(&run.join("events.jsonl"));
    let (metrics, _) = read_jsonl(&run.join("metrics.jsonl"));
    let steps = lineage_steps(&train);
    let audit = crate::ledger::audit(&run.join(crate::ledger::LEDGER_FILE)).ok();
    let end = events.iter().rev().find(|e| e["event"] == "run_end");
    let ended = match end {
        Some(e) => format!("ended: {} (exit code {})", e["reason"].as_str().unwrap_or("?"), e["exit_code"]),
        None => "did not end cleanly (no run_end event: still running, or the supervisor was killed)".into(),
    };
    let tokens: u64 = steps.iter().filter_map(|s| s["tokens"].as_u64()).sum();
    let last = steps.last();
    let rows: Vec<(String, String)> = vec![
        ("run".into(), run.display().to_string()),
        ("started".into(), state["started_at"].as_str().unwrap_or("?").to_string()),
        ("state".into(), format!("{}; {ended}", state["phase"].as_str().unwrap_or("?"))),
        ("steps".into(), last.map_or("0".into(), |l| l["step"].to_string())),
        ("tokens trained".into(), tokens.to_string()),
        ("final loss / acceptance".into(), last.map_or("–".into(), |l| format!("{:.4} / {:.3}", l["loss"].as_f64().unwrap_or(f64::NAN), l["acceptance"].as_f64().unwrap_or(f64::NAN)))),
        ("rollbacks".into(), train.iter().filter(|l| l["rollback"]["from"].is_u64()).count().to_string()),
        ("checkpoints written".into(), events.iter().filter(|e| e["event"] == "checkpoint").count().to_string()),
        (
            "restarts".into(),
            state["workers"].as_array().into_iter().flatten().map(|w| format!("{} {}", w["name"].as_str().unwrap_or("?"), w["restarts"])).collect::<Vec<_>>().join(", "),
        ),
        (
            "ledger".into(),
            audit.as_ref().map_or("unreadable".into(), |a| format!("{} produced, {} consumed once, {} lost, {} duplicated, {} in flight", a.produced, a.consumed_once, a.lost, a.duplicated, a.in_flight)),
        ),
    ];
    let mut absent = vec!["pool fill, phase timings and batch composition: not drawn by this version of the report".to_string()];
    let gpu_samples = metrics.iter().filter_map(|m| m["gpu"]["samples"].as_u64()).sum::<u64>();
    if gpu_samples == 0 {
        absent.push("GPU utilisation, memory, power, temperature: no GPU samples in metrics.jsonl (no NVIDIA GPU, or --no-gpu-metrics)".into());
    } else {
        absent.push("GPU utilisation, memory, power, temperature: not drawn by this version of the report".into());
    }
    if train_torn || events_torn {
        absent.push("a line cut off by a crash was skipped".into());
    }
    let mut h = String::new();
    let _ = write!(
        h,
        "<!DOCTYPE html>\n<html xmlns=\"http://www.w3.org/1999/xhtml\"><head><meta charset=\"utf-8\"/><title>dflash-supervise report: {}</title>\
         <style>body{{font-family:sans-serif;margin:20px}}td{{padding:2px 10px;border-bottom:1px solid #eee}}</style></head><body>\
         <h1>dflash-supervise run report</h1><table class=\"summary\">",
        esc(&run.display().to_string())
    );
    for (k, v) in &rows {
        let _ = write!(h, "<tr><td>{}</td><td class=\"{}\">{}</td></tr>", esc(k), esc(&k.replace(' ', "-")), esc(v));
    }
    let _ = write!(h, "</table><h2>Training</h2>{}<h2>Worker lifelines</h2>{}<h2>Not shown</h2><ul>", training_chart(&steps), lifelines(&events));
    for a in &absent {
        let _ = write!(h, "<li>{}</li>", esc(a));
    }
    h.push_str("</ul></body></html>\n");
    let tmp = out.with_extension("html.tmp");
    std::fs::write(&tmp, h).and_then(|_| std::fs::rename(&tmp, out)).map_err(|e| Error::Usage(format!("--out {}: {e}", out.display())))
}

/// `dflash-supervise report [RUN_DIR] [--out FILE]`.
pub fn run(dir: Option<PathBuf>, out: Option<PathBuf>) -> Result<i32, Error> {
    let run = crate::rundir::ExistingRun::open(dir.as_deref())?;
    let out = out.unwrap_or_else(|| run.path.join("report.html"));
    write(&run.path, &out)?;
    println!("{}", out.display());
    Ok(0)
}
