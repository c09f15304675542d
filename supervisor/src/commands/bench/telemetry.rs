//! `dflash-supervise bench telemetry`: what GPU telemetry costs. The NVML sampler's time
//! per GPU per sample, and the CPU the whole supervisor uses while it samples every GPU
//! NVML reports once a second and one worker per GPU heartbeats (pipeline idle).

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::error::Error;

fn fail(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Bench {
        bench: "telemetry",
        what: what.to_string(),
        source: e.to_string().into(),
    }
}

/// CPU seconds (user + system) of a process so far.
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Some(ticks / hz)
}

/// CPU use (% of one core) of a supervisor run on every GPU, pipeline idle.
fn supervisor_cpu(seconds: u64, extra: &[&str]) -> Result<f64, Error> {
    let exe = std::env::current_exe().map_err(|e| fail("finding dflash-supervise", e))?;
    let tmp = std::env::temp_dir().join(format!(
        "dflash-bench-telemetry-{}-{}",
        std::process::id(),
        extra.len()
    ));
    let _ = std::fs::remove_dir_all(&tmp);
    let mut child = Command::new(exe)
        .args([
            "--gpus",
            "all",
            "--data",
            "-",
            "--gpu-sample-interval",
            "1s",
            "--metrics-interval",
            "1s",
        ])
        .args([
            "--time-limit",
            &format!("{seconds}s"),
            "--stop-timeout",
            "5s",
            "--run-dir",
        ])
        .arg(&tmp)
        .args(extra)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| fail("starting the supervisor", e))?;
    let pid = child.id();
    // Held open and empty: the pipeline idles (wait() would close it and end the data).
    let idle_data = child.stdin.take();
    // Measure after start-up (workers spawned and connected) until just before the stop.
    std::thread::sleep(Duration::from_secs(2));
    let (c0, t0) = (cpu_seconds(pid), Instant::now());
    std::thread::sleep(Duration::from_secs(seconds - 3));
    let (c1, wall) = (cpu_seconds(pid), t0.elapsed().as_secs_f64());
    let status = child
        .wait()
        .map_err(|e| fail("waiting for the supervisor", e))?;
    drop(idle_data);
    let _ = std::fs::remove_dir_all(&tmp);
    let (Some(c0), Some(c1)) = (c0, c1) else {
        return Err(fail("reading the supervisor's CPU time", "it ended early"));
    };
    // Its --time-limit ends it before its (endless) data: a stop before the end, exit 75.
    if status.code() != Some(dflash_shared::exit_codes::STOPPED_EARLY) {
        return Err(fail(
            "the measured run",
            format!("exited with {status} (expected exit 75, stopped by its --time-limit)"),
        ));
    }
    Ok((c1 - c0) / wall * 100.0)
}

pub fn run(json: bool, seconds: u64) -> Result<i32, Error> {
    let nvml = crate::telemetry::gpus::init().map_err(|e| Error::Unavailable {
        what: "bench telemetry needs NVML and a GPU".into(),
        source: e.into(),
    })?;
    let n = nvml.device_count().map_err(|e| fail("counting GPUs", e))?;
    if n == 0 {
        return Err(Error::Unavailable {
            what: "bench telemetry needs at least one GPU".into(),
            source: "NVML reports none".into(),
        });
    }
    let rounds = 200;
    let t = Instant::now();
    for _ in 0..rounds {
        for i in 0..n {
            std::hint::black_box(crate::telemetry::nvml::sample_one(&nvml, i));
        }
    }
    let per_sample_us = t.elapsed().as_secs_f64() * 1e6 / (rounds * n) as f64;
    drop(nvml);

    let seconds = seconds.max(4);
    let with = supervisor_cpu(seconds, &[])?;
    let without = supervisor_cpu(seconds, &["--no-gpu-metrics"])?;
    let cpu_pct = with;
    let mut out = BTreeMap::new();
    out.insert("gpus", n as f64);
    out.insert("sampler_us_per_gpu_sample", per_sample_us);
    out.insert("supervisor_cpu_pct_of_one_core", cpu_pct);
    out.insert("supervisor_cpu_pct_without_gpu_metrics", without);
    out.insert("gpu_metrics_cpu_pct", with - without);
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&out).map_err(|e| fail("json", e))?
        );
    } else {
        println!("bench telemetry ({n} GPU(s), one worker each, sampling every 1 s):");
        println!("  NVML sampler                {per_sample_us:>8.1} us per GPU per sample");
        println!("  supervisor CPU              {cpu_pct:>8.2} % of one core");
        println!("  ... without GPU metrics     {without:>8.2} % (baseline, same run)");
        println!(
            "  GPU metrics cost            {:>8.2} % of one core   (target < 1%)",
            with - without
        );
    }
    Ok(0)
}
