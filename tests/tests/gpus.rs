//! GPU code paths on a machine without a GPU, through a fake NVML library: `gpus`, device
//! selection, and each worker's CUDA_VISIBLE_DEVICES.

mod common;

use std::fs;
use std::process::Command;
use std::time::Duration;

use common::*;
use nix::sys::signal::Signal;

fn script(dir: &std::path::Path, extra: &str) -> std::path::PathBuf {
    let p = dir.join("nvml.json");
    fs::write(
        &p,
        format!(
            r#"{{"driver": "550.54.15", "devices": [
                {{"name": "Fake H200", "uuid": "GPU-aaaa", "memory_total": 150323855360, "memory_used": 4096}},
                {{"name": "Fake H200", "uuid": "GPU-bbbb", "memory_total": 150323855360}}] {extra}}}"#
        ),
    )
    .unwrap();
    p
}

fn supervise_env(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let mut c = Command::new(bin("dflash-supervise"));
    c.args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

#[test]
fn gpus_lists_what_nvml_reports_and_survives_a_failing_call() {
    let tmp = tempfile::tempdir().unwrap();
    let lib = fake_nvml();
    let s = script(tmp.path(), "");
    let env = [
        ("DFLASH_NVML_LIBRARY", lib.to_str().unwrap()),
        ("DFLASH_FAKE_NVML", s.to_str().unwrap()),
    ];
    let out = supervise_env(&["gpus"], &env);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0));
    assert!(
        text.contains("NVIDIA driver 550.54.15, 2 GPU(s)")
            && text.contains("1  Fake H200  GPU-bbbb  140.0 GiB"),
        "{text}"
    );
    let out = supervise_env(&["gpus", "--json"], &env);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["gpus"][0]["uuid"], "GPU-aaaa");
    assert_eq!(v["gpus"][1]["memory_total_bytes"], 150323855360u64);

    let s = script(
        tmp.path(),
        r#", "fail": {"nvmlDeviceGetMemoryInfo_v2": 999}"#,
    );
    let env = [
        ("DFLASH_NVML_LIBRARY", lib.to_str().unwrap()),
        ("DFLASH_FAKE_NVML", s.to_str().unwrap()),
    ];
    let text = String::from_utf8_lossy(&supervise_env(&["gpus"], &env).stdout).into_owned();
    assert!(text.contains("GPU-aaaa  memory unknown"), "{text}");

    let out = supervise_env(
        &["gpus"],
        &[("DFLASH_NVML_LIBRARY", "/nonexistent/libnvidia-ml.so.1")],
    );
    assert_eq!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stdout).contains("no NVIDIA driver found"));
}

#[test]
fn gpu_workers_get_their_gpu_and_bad_indices_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let lib = fake_nvml();
    let s = script(tmp.path(), "");
    let env = [
        ("DFLASH_NVML_LIBRARY", lib.to_str().unwrap()),
        ("DFLASH_FAKE_NVML", s.to_str().unwrap()),
        ("DFLASH_DEVICE", "cpu"),
    ];
    let out = supervise_env(&["--gpus", "0-7"], &env);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("GPU 2 does not exist (NVML reports 2 GPU(s), 0-1)"));

    // Default devices with GPUs present: all of them. A target and a drafter sharing GPU 1.
    for args in [vec![], vec!["--target-gpus", "1", "--drafter-gpus", "1"]] {
        let mut sup = Sup::start_real_env(&args, &env);
        let st = sup.wait_running(2);
        let expect = if args.is_empty() {
            ["0", "1"]
        } else {
            ["1", "1"]
        };
        for (name, gpu) in ["target-0", "drafter-0"].iter().zip(expect) {
            let pid = pid_of(&st, name);
            let environ = fs::read(format!("/proc/{pid}/environ")).unwrap();
            let vars: Vec<String> = environ
                .split(|&b| b == 0)
                .map(|v| String::from_utf8_lossy(v).into_owned())
                .collect();
            assert!(
                vars.contains(&format!("CUDA_VISIBLE_DEVICES={gpu}")),
                "{name}: {vars:?}"
            );
            assert!(
                vars.contains(&format!("DFLASH_GPU={gpu}"))
                    && vars.contains(&"CUDA_DEVICE_ORDER=PCI_BUS_ID".to_string())
            );
        }
        assert!(
            sup.stderr()
                .contains("workers on GPUs compute on their GPU"),
            "{}",
            sup.stderr()
        );
        sup.signal(Signal::SIGTERM);
        assert_eq!(sup.wait_exit(Duration::from_secs(20)).code(), Some(75));
    }
}

const DEVICES: &str = r#""devices": [
    {"name": "Fake H200", "uuid": "GPU-aaaa", "memory_total": 1000, "memory_used": 100, "util_gpu": 40, "util_mem": 10,
     "power_mw": 300000, "power_limit_mw": 700000, "energy_mj": 5000, "temp_c": 55, "sm_clock_mhz": 1980, "mem_clock_mhz": 2619,
     "pcie_tx_kbps": 2, "pcie_rx_kbps": 3, "ecc_corrected": 4, "ecc_uncorrected": 0, "throttle_mask": 5},
    {"name": "Fake H200", "uuid": "GPU-bbbb", "memory_total": 1000, "util_gpu": 80, "util_mem": 20}]"#;

fn metrics(sup: &Sup) -> Vec<serde_json::Value> {
    read_jsonl(&sup.run_dir.join("metrics.jsonl"))
}

#[test]
fn gpu_samples_land_in_metrics_and_a_failing_metric_is_asked_again() {
    let tmp = tempfile::tempdir().unwrap();
    let lib = fake_nvml();
    let s = tmp.path().join("nvml.json");
    fs::write(
        &s,
        format!(r#"{{"driver": "550", {DEVICES}, "fail": {{"nvmlDeviceGetTemperature": 999}}}}"#),
    )
    .unwrap();
    let env = [
        ("DFLASH_NVML_LIBRARY", lib.to_str().unwrap()),
        ("DFLASH_FAKE_NVML", s.to_str().unwrap()),
        ("DFLASH_DEVICE", "cpu"),
    ];
    let mut sup = Sup::start_real_env(
        &[
            "--gpus",
            "0-1",
            "--metrics-interval",
            "300ms",
            "--gpu-sample-interval",
            "50ms",
        ],
        &env,
    );
    let gpu0 = |m: &serde_json::Value| m["gpu"]["gpus"][0].clone();
    let w = wait_for("a window with GPU samples", Duration::from_secs(20), || {
        metrics(&sup)
            .into_iter()
            .find(|m| m["gpu"]["samples"].as_u64().unwrap_or(0) >= 2)
    });
    let g = gpu0(&w);
    assert_eq!(g["util_gpu_pct"]["mean"], 40.0);
    assert_eq!(g["power_w"]["max"], 300.0);
    assert_eq!(g["mem_clock_mhz"]["mean"], 2619.0);
    assert!(
        g["temp_c"].is_null(),
        "a failing metric is unavailable in its window: {g}"
    );
    assert!(
        w["gpu"]["gpus"][1]["power_w"].is_null(),
        "a metric the GPU lacks is unavailable: {w}"
    );
    assert_eq!(w["gpu"]["gpus"][1]["util_gpu_pct"]["max"], 80.0);
    assert_eq!(g["pcie_rx_bytes_per_s"]["mean"], 3072.0);
    assert_eq!(g["ecc_corrected_volatile"]["max"], 4.0);
    // 5 = GPU idle (0x1) | software power cap (0x4)
    assert_eq!(
        g["throttle_reasons"],
        serde_json::json!(["gpu_idle", "sw_power_cap"])
    );
    assert!(w["workers"]["target-0"]["pid"].is_u64());
    // Per-process GPU memory is reported under the worker's name.
    let target_pid = w["workers"]["target-0"]["pid"].as_u64().unwrap();
    let with_procs = DEVICES.replacen(
        r#""throttle_mask": 5"#,
        &format!(r#""throttle_mask": 5, "processes": [[{target_pid}, 777]]"#),
        1,
    );
    fs::write(
        &s,
        format!(
            r#"{{"driver": "550", {with_procs}, "fail": {{"nvmlDeviceGetTemperature": 999}}}}"#
        ),
    )
    .unwrap();
    wait_for(
        "the target's GPU memory under its name",
        Duration::from_secs(20),
        || {
            metrics(&sup)
                .iter()
                .any(|m| gpu0(m)["process_mem_bytes"]["target-0"] == 777)
                .then_some(())
        },
    );
    // The call recovers: the next windows have it again. And GPU 1 reports an XID error.
    fs::write(
        &s,
        format!(r#"{{"driver": "550", {DEVICES}, "xid": [[1, 79]]}}"#),
    )
    .unwrap();
    wait_for(
        "the temperature to come back",
        Duration::from_secs(20),
        || {
            metrics(&sup)
                .iter()
                .any(|m| gpu0(m)["temp_c"]["mean"] == 55.0)
                .then_some(())
        },
    );
    wait_for("the XID in a window", Duration::from_secs(20), || {
        metrics(&sup)
            .iter()
            .any(|m| m["gpu"]["gpus"][1]["xid_errors"] == serde_json::json!([79]))
            .then_some(())
    });
    assert!(sup.stderr().contains("GPU 1: XID 79"), "{}", sup.stderr());
    let st = sup.state().unwrap();
    assert!(
        st["metrics"]["gpu"].is_object(),
        "status --json carries the latest window"
    );
    sup.signal(Signal::SIGTERM);
    assert_eq!(sup.wait_exit(Duration::from_secs(20)).code(), Some(75));
    assert!(!sup.stderr().contains("GPU metrics are off"));
}

#[test]
fn nvml_failing_after_start_gives_one_warning_and_the_run_goes_on() {
    let tmp = tempfile::tempdir().unwrap();
    let lib = fake_nvml();
    let s = tmp.path().join("nvml.json");
    // The first initialisation (device selection) works; the sampler's does not.
    fs::write(
        &s,
        format!(r#"{{"driver": "550", {DEVICES}, "init_ok_times": 1}}"#),
    )
    .unwrap();
    let env = [
        ("DFLASH_NVML_LIBRARY", lib.to_str().unwrap()),
        ("DFLASH_FAKE_NVML", s.to_str().unwrap()),
        ("DFLASH_DEVICE", "cpu"),
    ];
    let mut sup = Sup::start_real_env(
        &[
            "--gpus",
            "0-1",
            "--metrics-interval",
            "200ms",
            "--gpu-sample-interval",
            "50ms",
        ],
        &env,
    );
    sup.wait_running(2);
    wait_for("two metrics windows", Duration::from_secs(20), || {
        (metrics(&sup).len() >= 2).then_some(())
    });
    let err = sup.stderr();
    let warnings: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("GPU metrics are off"))
        .collect();
    assert_eq!(warnings.len(), 1, "{err}");
    assert!(
        warnings[0].contains("driver is not loaded") && warnings[0].contains("utilisation"),
        "{}",
        warnings[0]
    );
    assert_eq!(metrics(&sup)[0]["gpu"]["samples"], 0);
    sup.signal(Signal::SIGTERM);
    assert_eq!(sup.wait_exit(Duration::from_secs(20)).code(), Some(75));
}

/// The address the run's Prometheus endpoint says it listens on.
fn prometheus_addr(sup: &Sup) -> String {
    wait_for("the Prometheus address", Duration::from_secs(20), || {
        let err = sup.stderr();
        let line = err
            .lines()
            .find(|l| l.contains("Prometheus metrics at http://"))?;
        Some(
            line.split("http://")
                .nth(1)?
                .trim_end_matches("/metrics")
                .to_string(),
        )
    })
}

fn http_get(addr: &str, path: &str) -> String {
    http(addr, "GET", path)
}

fn http(addr: &str, method: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s =
        std::net::TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    s.write_all(format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n").as_bytes())
        .unwrap_or_else(|e| panic!("write to {addr}: {e}"));
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

#[test]
fn prometheus_serves_the_latest_window_in_valid_exposition_format() {
    let tmp = tempfile::tempdir().unwrap();
    let lib = fake_nvml();
    let s = tmp.path().join("nvml.json");
    fs::write(&s, format!(r#"{{"driver": "550", {DEVICES}}}"#)).unwrap();
    let env = [
        ("DFLASH_NVML_LIBRARY", lib.to_str().unwrap()),
        ("DFLASH_FAKE_NVML", s.to_str().unwrap()),
        ("DFLASH_DEVICE", "cpu"),
    ];
    let mut sup = Sup::start_real_env(
        &[
            "--gpus",
            "0-1",
            "--prometheus",
            "0",
            "--metrics-interval",
            "200ms",
            "--gpu-sample-interval",
            "50ms",
        ],
        &env,
    );
    let addr = prometheus_addr(&sup);
    assert!(
        addr.starts_with("127.0.0.1:"),
        "a bare port listens on loopback: {addr}"
    );
    let body = wait_for("GPU figures on /metrics", Duration::from_secs(20), || {
        let r = http_get(&addr, "/metrics");
        r.contains("dflash_gpu_utilization_ratio{run=\"run\",gpu=\"0\"} 0.4")
            .then_some(r)
    });
    assert!(
        body.starts_with("HTTP/1.1 200 OK")
            && body.contains("Content-Type: text/plain; version=0.0.4"),
        "{body}"
    );
    assert!(
        body.contains("dflash_gpu_power_watts{run=\"run\",gpu=\"0\"} 300")
            && body.contains("dflash_worker_restarts_total{run=\"run\",worker=\"drafter-0\"} 0"),
        "{body}"
    );
    assert!(http_get(&addr, "/other").starts_with("HTTP/1.1 404"));
    // HEAD: the headers alone.
    let head = http(&addr, "HEAD", "/metrics");
    assert!(
        head.starts_with("HTTP/1.1 200 OK") && head.ends_with("\r\n\r\n"),
        "{head}"
    );
    // The build and the run, and the counters the dispatcher keeps at every step.
    let run = sup
        .run_dir
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    assert!(
        body.contains(&format!(
            "dflash_build_info{{version=\"{}\",run=\"{run}\"}} 1",
            env!("CARGO_PKG_VERSION")
        )) && body.contains("# TYPE dflash_train_steps_total counter")
            && body.contains("# TYPE dflash_tokens_trained_total counter"),
        "{body}"
    );
    // Clients that connect and say nothing hold no scrape up: with many of them open, a
    // scrape is served at once (the endpoint serves every connection without blocking).
    let held: Vec<std::net::TcpStream> = (0..20)
        .map(|_| std::net::TcpStream::connect(&addr).unwrap())
        .collect();
    let t0 = std::time::Instant::now();
    let r = http_get(&addr, "/metrics");
    assert!(r.starts_with("HTTP/1.1 200"), "{r}");
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "a scrape behind 20 silent clients took {:?}",
        t0.elapsed()
    );
    drop(held);
    let text = body.split("\r\n\r\n").nth(1).unwrap().to_string();
    let file = tmp.path().join("metrics.txt");
    fs::write(&file, &text).unwrap();
    match Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(fs::File::open(&file).unwrap())
        .output()
    {
        Ok(out) => assert!(
            out.status.success(),
            "promtool check metrics: {}{}\n{text}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(_) => {
            assert!(
                std::env::var_os("CI").is_none(),
                "promtool is missing: under CI this check may not skip (.ci/run installs it)"
            );
            eprintln!("SKIPPED promtool check: promtool is not installed (Debian package prometheus; .ci/run installs it)")
        }
    }
    sup.signal(Signal::SIGTERM);
    assert_eq!(sup.wait_exit(Duration::from_secs(20)).code(), Some(75));
}

/// The counters a scrape returns only increase while the run trains (steps committed and
/// tokens trained, counted by the dispatcher at every step).
#[test]
fn prometheus_counters_only_increase_while_the_run_trains() {
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:2",
        "--data",
        "demo",
        "--steps",
        "100000",
        "--time-limit",
        "100s",
        "--max-seq-len",
        "64",
        "--token-budget",
        "512",
        "--prometheus",
        "0",
    ]);
    let addr = prometheus_addr(&sup);
    // Every sample carries the run's name (issue 40): several runs scraped into one
    // Prometheus stay apart.
    let run = sup
        .run_dir
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    let counter = |page: &str, name: &str| -> f64 {
        page.lines()
            .find_map(|l| l.strip_prefix(&format!("{name}{{run=\"{run}\"}} ")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {name}{{run=\"{run}\"}}: {page}"))
    };
    let worker_tokens = |page: &str| -> f64 {
        page.lines()
            .filter(|l| l.starts_with("dflash_worker_tokens_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let mut last_worker_tokens = 0.0;
    let mut last = (0.0, 0.0);
    for _ in 0..3 {
        let page = wait_for("more steps counted", Duration::from_secs(30), || {
            let p = http_get(&addr, "/metrics");
            (counter(&p, "dflash_train_steps_total") > last.0).then_some(p)
        });
        let now = (
            counter(&page, "dflash_train_steps_total"),
            counter(&page, "dflash_tokens_trained_total"),
        );
        assert!(now.0 > last.0 && now.1 > last.1, "{last:?} then {now:?}");
        last = now;
        // The per-worker counter only grows; the learning rate is there.
        let w = worker_tokens(&page);
        assert!(w >= last_worker_tokens, "{w} after {last_worker_tokens}");
        last_worker_tokens = w;
        assert!(counter(&page, "dflash_learning_rate") > 0.0, "{page}");
    }
    sup.signal(Signal::SIGTERM);
    assert_eq!(sup.wait_exit(Duration::from_secs(30)).code(), Some(75));
}

#[test]
fn bench_telemetry_prints_the_sampler_cost_and_the_supervisor_cpu_with_8_gpus() {
    let tmp = tempfile::tempdir().unwrap();
    let lib = fake_nvml();
    let s = tmp.path().join("nvml.json");
    let one = r#"{"name": "Fake H200", "uuid": "GPU-x", "memory_total": 1000, "memory_used": 10, "util_gpu": 40, "util_mem": 10, "power_mw": 300000}"#;
    fs::write(
        &s,
        format!(
            r#"{{"driver": "550", "devices": [{}]}}"#,
            [one; 8].join(",")
        ),
    )
    .unwrap();
    let env = [
        ("DFLASH_NVML_LIBRARY", lib.to_str().unwrap()),
        ("DFLASH_FAKE_NVML", s.to_str().unwrap()),
        ("DFLASH_DEVICE", "cpu"),
    ];
    let out = supervise_env(&["bench", "telemetry", "--json", "--seconds", "4"], &env);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["gpus"], 8.0);
    for k in [
        "supervisor_cpu_pct_of_one_core",
        "supervisor_cpu_pct_without_gpu_metrics",
    ] {
        let x = v[k].as_f64().unwrap_or_else(|| panic!("{k} missing: {v}"));
        assert!(x.is_finite() && (0.0..100.0).contains(&x), "{k} = {x}");
    }
    assert!(v["sampler_us_per_gpu_sample"].as_f64().unwrap() > 0.0);
    // Without NVML it says so.
    let out = supervise_env(
        &["bench", "telemetry"],
        &[("DFLASH_NVML_LIBRARY", "/nonexistent/libnvidia-ml.so.1")],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("bench telemetry needs NVML and a GPU"));
}

/// A target on a GPU that cannot use it (here: no libcuda at all) exits with the
/// "permanent" code and one line naming the library; the supervisor stops the run with
/// that line at once instead of restarting it up to --max-restarts times.
#[test]
fn a_gpu_worker_without_cuda_stops_the_run_with_the_missing_library_named() {
    let tmp = tempfile::tempdir().unwrap();
    let lib = fake_nvml();
    let s = script(tmp.path(), "");
    let env = [
        ("DFLASH_NVML_LIBRARY", lib.to_str().unwrap()),
        ("DFLASH_FAKE_NVML", s.to_str().unwrap()),
    ];
    let mut sup = Sup::start_real_env(
        &["--gpus", "0-1", "--max-restarts", "50", "--no-gpu-metrics"],
        &env,
    );
    let status = sup.wait_exit(Duration::from_secs(60));
    let err = sup.stderr();
    assert_eq!(status.code(), Some(1), "{err}");
    let line = err
        .lines()
        .find(|l| l.starts_with("dflash-supervise: run failed:"))
        .unwrap_or_default();
    // Whichever worker touches its GPU first (the drafter setting up, the target loading).
    assert!(
        (line.contains("target-0 cannot run on GPU 0")
            || line.contains("drafter-0 cannot run on GPU 1"))
            && line.contains("was not restarted")
            && line.contains("libcuda.so.1"),
        "{err}"
    );
    let events = sup.events();
    let restarts = events.iter().filter(|e| e["event"] == "restart").count();
    assert_eq!(
        restarts, 0,
        "a permanent failure spends no restart: {events:?}"
    );
    assert!(
        events
            .iter()
            .any(|e| e["event"] == "give_up" && e["permanent"] == true),
        "{events:?}"
    );
    assert!(
        sup.log("target-0").contains("permanent, do not restart")
            || sup.log("drafter-0").contains("permanent, do not restart")
    );
}

/// A driver older than the build's CUDA: cudarc finds a function missing on first use and
/// panics. The worker turns that into a permanent failure naming the function, and the
/// run stops with it instead of spending its restarts on a crash that repeats.
#[test]
fn a_gpu_worker_on_a_too_old_cuda_stops_the_run_with_the_missing_function_named() {
    let tmp = tempfile::tempdir().unwrap();
    let libs = tmp.path().join("libs");
    fs::create_dir(&libs).unwrap();
    for name in ["libcuda.so", "libcuda.so.1", "libcublas.so", "libnvrtc.so"] {
        std::os::unix::fs::symlink(fake_cuda(), libs.join(name)).unwrap();
    }
    let lib = fake_nvml();
    let s = script(tmp.path(), "");
    let path = match std::env::var("LD_LIBRARY_PATH") {
        Ok(p) if !p.is_empty() => format!("{}:{p}", libs.display()),
        _ => libs.display().to_string(),
    };
    let env = [
        ("DFLASH_NVML_LIBRARY", lib.to_str().unwrap()),
        ("DFLASH_FAKE_NVML", s.to_str().unwrap()),
        ("LD_LIBRARY_PATH", path.as_str()),
    ];
    let mut sup = Sup::start_real_env(
        &["--gpus", "0-1", "--max-restarts", "50", "--no-gpu-metrics"],
        &env,
    );
    let status = sup.wait_exit(Duration::from_secs(60));
    let err = sup.stderr();
    assert_eq!(status.code(), Some(1), "{err}");
    let line = err
        .lines()
        .find(|l| l.starts_with("dflash-supervise: run failed:"))
        .unwrap_or_default();
    assert!(
        line.contains("was not restarted")
            && line.contains("lacks a function this build calls")
            && line.contains("CUDA 13.0"),
        "{err}"
    );
    let events = sup.events();
    assert_eq!(
        events.iter().filter(|e| e["event"] == "restart").count(),
        0,
        "a permanent failure spends no restart: {events:?}"
    );
    let logs = sup.log("target-0") + &sup.log("drafter-0");
    assert!(
        logs.contains("permanent, do not restart")
            && !logs.contains("Missing symbol")
            && logs.contains("(cu"),
        "{logs}"
    );
    assert!(!logs.contains("panicked"), "no backtrace: {logs}");
}
