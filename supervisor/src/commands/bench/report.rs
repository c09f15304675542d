//! `dflash-supervise bench report`: the report page of a long run — its size, how long it
//! takes to write, and (with Chromium on the machine) to open headless — against a short
//! run of the same shape measured in the same invocation. The runs are synthetic: every
//! file a run writes (state.json, train.jsonl, metrics.jsonl with one window per 10 steps
//! and every NVML field per GPU, events.jsonl) for `steps` steps on `gpus` GPUs.

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use serde_json::json;

use crate::error::Error;

/// Unix ms of the synthetic runs' start.
const T0: u64 = 1_767_225_600_000;

/// One step a second, a metrics window every 10 steps.
fn write_run(dir: &Path, steps: u64, gpus: u64) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let workers: Vec<String> = (0..gpus)
        .map(|g| {
            if g < gpus / 4 {
                format!("target-{g}")
            } else {
                format!("drafter-{}", g - gpus / 4)
            }
        })
        .collect();
    let ws: Vec<_> = workers
        .iter()
        .enumerate()
        .map(|(g, w)| json!({"name": w, "gpu": g.to_string(), "restarts": 0}))
        .collect();
    std::fs::write(
        dir.join("state.json"),
        json!({"started_at_unix_ms": T0, "phase": "stopped", "workers": ws}).to_string(),
    )?;
    let time = |s: u64| {
        humantime::format_rfc3339_millis(
            std::time::UNIX_EPOCH + std::time::Duration::from_millis(T0 + s * 1000),
        )
        .to_string()
    };
    let mut train = std::io::BufWriter::new(std::fs::File::create(dir.join("train.jsonl"))?);
    for s in 1..=steps {
        let x = s as f64;
        let loss = 2.0 + 6.0 / (1.0 + x / 500.0) + 0.3 * ((x * 0.37).sin());
        let acc = 1.0 + 3.0 * (1.0 - 1.0 / (1.0 + x / 2000.0));
        let slots: Vec<f64> = (0..15)
            .map(|k| (0.9 - 0.05 * k as f64) * acc / 4.0)
            .collect();
        writeln!(
            train,
            "{}",
            json!({"step": s, "loss": loss, "acceptance": acc, "lr": 6e-4, "slot_accuracy": slots,
                   "t": T0 + s * 1000, "tokens": 65536, "members": gpus - gpus / 4})
        )?;
    }
    train.flush()?;
    let mut metrics = std::io::BufWriter::new(std::fs::File::create(dir.join("metrics.jsonl"))?);
    let stat = |v: f64| json!({"mean": v, "max": v * 1.02, "samples": 10});
    for s in (10..=steps).step_by(10) {
        let x = s as f64;
        let g: Vec<_> = (0..gpus)
            .map(|i| {
                let u = 80.0 + 10.0 * ((x / 97.0 + i as f64).sin());
                json!({"index": i, "util_gpu_pct": stat(u), "util_mem_pct": stat(u / 2.0),
                       "mem_used_bytes": stat(1.1e11), "mem_total_bytes": stat(1.5e11),
                       "power_w": stat(5.5 * u), "power_limit_w": stat(700.0), "energy_j": stat(x * 500.0),
                       "temp_c": stat(60.0 + u / 10.0), "sm_clock_mhz": stat(1980.0), "mem_clock_mhz": stat(3201.0),
                       "pcie_tx_bytes_per_s": stat(1e8), "pcie_rx_bytes_per_s": stat(2e8),
                       "ecc_corrected_volatile": stat(0.0), "ecc_uncorrected_volatile": stat(0.0),
                       "throttle_reasons": [], "xid_errors": []})
            })
            .collect();
        let tps: serde_json::Map<String, serde_json::Value> = workers
            .iter()
            .map(|w| (w.clone(), json!(65536.0 + 100.0 * (x / 50.0).sin())))
            .collect();
        let pool = json!({"fill_ratio": 0.5, "producers_blocked_share": 0.1, "consumers_starved_share": 0.05});
        writeln!(
            metrics,
            "{}",
            json!({"time": time(s), "window_s": 10.0, "gpu": {"samples": 10, "gpus": g},
                   "pipeline": {"tokens_pool": pool, "hidden_pool": pool, "tokens_per_s_by_worker": tps,
                                "tokens_per_s_trained": 65536.0 * 6.0, "padding_efficiency": 0.93,
                                "length_buckets": {"<=1024": 40, "<=2048": 20, "<=4096": 4},
                                "phase_ms_by_worker": {}, "bottleneck_hint": null},
                   "batches": {"produced": s + 8, "consumed": s}, "restarts": 0,
                   "train": {"step": s, "loss": 3.0, "acceptance": 2.0}})
        )?;
    }
    metrics.flush()?;
    let mut ev = String::new();
    let _ = writeln!(ev, "{}", json!({"event": "run_start", "time": time(0)}));
    for (i, w) in workers.iter().enumerate() {
        let _ = writeln!(
            ev,
            "{}",
            json!({"event": "spawn", "worker": w, "pid": 1000 + i, "restart": 0, "time": time(0)})
        );
    }
    let _ = writeln!(
        ev,
        "{}",
        json!({"event": "run_end", "exit_code": 0, "reason": "step limit reached", "time": time(steps)})
    );
    std::fs::write(dir.join("events.jsonl"), ev)
}

/// Chromium's binary, if the machine has one.
fn chromium() -> Option<PathBuf> {
    ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .find_map(|b| {
            std::env::var_os("PATH").and_then(|p| {
                std::env::split_paths(&p)
                    .map(|d| d.join(b))
                    .find(|f| f.is_file())
            })
        })
}

/// Seconds headless Chromium takes to load `page` and print its DOM (best of 3).
fn open_seconds(chrome: &Path, page: &Path) -> Option<f64> {
    (0..3)
        .filter_map(|_| {
            let t = Instant::now();
            let mut child = Command::new(chrome)
                .args([
                    "--headless",
                    "--disable-gpu",
                    "--no-sandbox",
                    "--disable-dev-shm-usage",
                    "--dump-dom",
                ])
                .arg(format!("file://{}", page.display()))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .ok()?;
            // A browser that does not finish is no figure (and is not waited for).
            while t.elapsed() < OPEN_LIMIT {
                match child.try_wait() {
                    Ok(Some(status)) => return status.success().then(|| t.elapsed().as_secs_f64()),
                    Ok(None) => std::thread::sleep(std::time::Duration::from_millis(10)),
                    Err(_) => break,
                }
            }
            let _ = child.kill();
            let _ = child.wait();
            None
        })
        .reduce(f64::min)
}

/// How long Chromium may take to open a page before the try counts as failed.
const OPEN_LIMIT: std::time::Duration = std::time::Duration::from_secs(60);

/// Size (bytes), write time (s) and Chromium's open time (s) of the page of a synthetic
/// run of `steps` steps on `gpus` GPUs.
fn measure(
    tmp: &Path,
    steps: u64,
    gpus: u64,
    chrome: Option<&Path>,
) -> Result<(u64, f64, Option<f64>), Error> {
    let dir = tmp.join(format!("run-{steps}"));
    write_run(&dir, steps, gpus).map_err(|e| Error::io("cannot write", &dir, e))?;
    let page = dir.join("report.html");
    let t = Instant::now();
    crate::telemetry::report::write(&dir, &page)?;
    let secs = t.elapsed().as_secs_f64();
    let bytes = std::fs::metadata(&page)
        .map_err(|e| Error::io("cannot read", &page, e))?
        .len();
    Ok((bytes, secs, chrome.and_then(|c| open_seconds(c, &page))))
}

/// `dflash-supervise bench report`.
pub fn run(json_out: bool, steps: u64, gpus: u64, open: bool) -> Result<i32, Error> {
    let tmp = std::env::temp_dir().join(format!("dflash-bench-report-{}", std::process::id()));
    let chrome = chromium().filter(|_| open);
    let base_steps = 200.min(steps);
    let r = (|| {
        let base = measure(&tmp, base_steps, gpus, chrome.as_deref())?;
        let long = measure(&tmp, steps, gpus, chrome.as_deref())?;
        Ok::<_, Error>((base, long))
    })();
    if std::env::var_os("DFLASH_BENCH_KEEP").is_none() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    let ((b_bytes, b_secs, b_open), (l_bytes, l_secs, l_open)) = r?;
    let out = json!({
        "steps": steps, "gpus": gpus, "baseline_steps": base_steps,
        "page_bytes": l_bytes, "baseline_page_bytes": b_bytes,
        "size_ratio": l_bytes as f64 / b_bytes.max(1) as f64,
        "write_s": l_secs, "baseline_write_s": b_secs,
        "chromium": chrome.as_ref().map(|c| c.display().to_string()),
        "open_s": l_open, "baseline_open_s": b_open,
        "open_ratio": l_open.zip(b_open).map(|(l, b)| l / b.max(1e-9)),
    });
    if json_out {
        println!("{out}");
        return Ok(0);
    }
    println!(
        "report of a {steps}-step run on {gpus} GPUs: {:.2} MB ({:.2}x the {base_steps}-step page's {:.2} MB), written in {:.2} s ({:.2} s)",
        l_bytes as f64 / 1e6,
        l_bytes as f64 / b_bytes.max(1) as f64,
        b_bytes as f64 / 1e6,
        l_secs,
        b_secs
    );
    match (l_open, b_open) {
        (Some(l), Some(b)) => println!(
            "opened by headless Chromium in {l:.2} s ({:.2}x the {base_steps}-step page's {b:.2} s, which is mostly Chromium's start)",
            l / b.max(1e-9)
        ),
        _ if !open => println!("open time not measured (--no-chromium)"),
        _ => println!("open time not measured: no Chromium on this machine (Debian: apt install chromium)"),
    }
    Ok(0)
}
