//! `scripts/gpu_check.sh --emulated`: the one-shot check of a GPU machine, run here over the
//! emulated CUDA stack (tests/emu-cuda as libcuda, cuBLAS and NCCL; the fake NVML with one
//! GPU) against target/debug's binaries, so that the script has run end to end before it
//! ever meets a GPU. The host CPU is the device, so the shapes are tiny; what is asserted
//! is that every step ran its code path and passed, and what results.json says (counts and
//! names, never timings: this runs on a loaded CI machine).
//!
//! NVRTC (PyPI's nvidia-cuda-nvrtc) compiles the kernels as on a GPU: without it the check
//! cannot run (exit 2 naming NVRTC), which skips the tests that run it on a laptop and fails
//! them under CI or with DFLASH_REQUIRE_NVRTC=1. The parity executable is cargo's build of
//! worker/tests/host_device.rs (built with the workspace's tests).
//!
//! The script's budget and per-step limits are read from the script itself (its
//! `GC_BUDGET_*`, `GC_LIMITS_*` and `GC_RESERVE_S` lines), never repeated here.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use serde_json::Value;

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/gpu_check.sh")
}

/// `NAME=VALUE` of a top-level assignment line of the script, quotes removed.
fn script_var(text: &str, name: &str) -> String {
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name}=")))
        .map(|v| v.trim().trim_matches('"').to_string())
        .unwrap_or_else(|| panic!("gpu_check.sh has no {name}= line"))
}

/// The budget of a mode (`GPU`, `EMULATED`) and its steps with their limits, in order.
fn budget_and_limits(mode: &str) -> (u64, Vec<(String, u64)>) {
    let text = fs::read_to_string(script()).unwrap();
    let budget = script_var(&text, &format!("GC_BUDGET_{mode}"))
        .parse()
        .unwrap();
    let limits = script_var(&text, &format!("GC_LIMITS_{mode}"))
        .split_whitespace()
        .map(|kv| {
            let (k, v) = kv.split_once('=').expect("NAME=SECONDS");
            (k.to_string(), v.parse().expect("seconds"))
        })
        .collect();
    (budget, limits)
}

/// The steps, in the order the emulated check runs them.
fn steps_in_order() -> Vec<String> {
    budget_and_limits("EMULATED")
        .1
        .into_iter()
        .map(|(k, _)| k)
        .collect()
}

fn required() -> bool {
    std::env::var_os("CI").is_some()
        || std::env::var("DFLASH_REQUIRE_NVRTC").is_ok_and(|v| v == "1")
}

fn str_list(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn every_step_limit_fits_its_modes_budget_and_the_gpus_is_at_most_six_minutes() {
    let text = fs::read_to_string(script()).unwrap();
    let reserve: u64 = script_var(&text, "GC_RESERVE_S").parse().unwrap();
    assert!(reserve > 0);
    let (gpu_budget, gpu) = budget_and_limits("GPU");
    let (emu_budget, emu) = budget_and_limits("EMULATED");
    assert!(gpu_budget <= 360, "GPU budget {gpu_budget} s");
    for (mode, budget, limits) in [("GPU", gpu_budget, &gpu), ("EMULATED", emu_budget, &emu)] {
        let sum: u64 = limits.iter().map(|(_, s)| s).sum();
        assert!(
            sum + reserve <= budget,
            "{mode}: the limits add up to {sum} s, + {reserve} s reserve, over the {budget} s budget: {limits:?}"
        );
        assert!(limits.iter().all(|(_, s)| *s >= 10), "{mode}: {limits:?}");
    }
    // The same steps in the same order in both modes; the first three answer "does it
    // run and agree with the CPU" within about three minutes on the GPU, then the
    // measured throughput.
    let names = |l: &[(String, u64)]| l.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>();
    assert_eq!(names(&gpu), names(&emu));
    assert_eq!(
        names(&gpu)[..4],
        ["preflight", "parity", "pipeline", "throughput"]
    );
    let first: u64 = gpu[..3].iter().map(|(_, s)| s).sum();
    assert!(
        first <= 180,
        "preflight, parity and pipeline take up to {first} s"
    );
    assert_eq!(
        names(&gpu).iter().collect::<BTreeSet<_>>().len(),
        gpu.len(),
        "a step named twice"
    );
}

/// Every process below `root` (by parent pid), found in /proc.
fn descendants(root: u32) -> BTreeSet<u32> {
    let mut children: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    for e in fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ppid ...
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if let Some(ppid) = ppid {
            children.entry(ppid).or_default().push(pid);
        }
    }
    let (mut out, mut todo) = (BTreeSet::new(), vec![root]);
    while let Some(p) = todo.pop() {
        for &c in children.get(&p).into_iter().flatten() {
            if out.insert(c) {
                todo.push(c);
            }
        }
    }
    out
}

/// SIGKILL the check's process group mid-step, as an OOM killer or a lease that ends
/// would, and every process it started (the steps run under `timeout`, in process groups
/// of their own): stopped first, so that none escapes by forking or by being re-parented.
fn kill_check(child: &mut Child) {
    let pid = child.id();
    let group = nix::unistd::Pid::from_raw(-(pid as i32));
    let _ = nix::sys::signal::kill(group, Signal::SIGSTOP);
    let mut seen = BTreeSet::new();
    loop {
        let now = descendants(pid);
        for &p in &now {
            common::signal(p, Signal::SIGSTOP);
        }
        if now.is_subset(&seen) {
            break;
        }
        seen.extend(now);
    }
    let _ = nix::sys::signal::kill(group, Signal::SIGKILL);
    for &p in &seen {
        common::signal(p, Signal::SIGKILL);
    }
    child.wait().unwrap();
}

/// `gpu_check.sh --emulated` started in a process group of its own, its runs under `tmp`.
fn start_check(script: &Path, out: &Path, tmp: &Path, env: &[(&str, &Path)]) -> Child {
    let mut cmd = Command::new("bash");
    cmd.arg(script)
        .args(["--emulated", "--out"])
        .arg(out)
        .arg(common::bin("dflash-supervise"))
        .env("TMPDIR", tmp)
        .stdin(Stdio::null())
        .stdout(fs::File::create(tmp.join("console.txt")).unwrap())
        .stderr(fs::File::create(tmp.join("stderr.txt")).unwrap())
        .process_group(0);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().expect("running scripts/gpu_check.sh")
}

/// results.json once it holds a finished step (each step's end rewrites it); None when
/// the check ended first (then the caller looks at why).
fn wait_for_a_finished_step(child: &mut Child, out: &Path, deadline: Duration) -> Option<Value> {
    common::wait_for("a step of gpu_check.sh to finish", deadline, || {
        if child.try_wait().unwrap().is_some() {
            return Some(None);
        }
        let r: Value =
            serde_json::from_str(&fs::read_to_string(out.join("results.json")).ok()?).ok()?;
        let done = r["steps"]
            .as_array()?
            .iter()
            .any(|s| s["status"] == "pass" || s["status"] == "fail");
        done.then_some(Some(r))
    })
}

/// After a SIGKILL of the whole check mid-step, results.json is still one JSON object
/// with every step that had finished, their results as they were, and the rest pending.
/// Then the same check from a bundle whose kernel cache holds the CUBIN for the GPU's
/// architecture (the emulated GPU's sm_90) compiles nothing.
#[test]
fn a_check_killed_midway_leaves_valid_results_and_a_bundles_cubins_are_used() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let mut child = start_check(&script(), &out, tmp.path(), &[]);
    let seen = wait_for_a_finished_step(&mut child, &out, Duration::from_secs(300));
    let Some(seen) = seen else {
        let r: Value =
            serde_json::from_str(&fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
        let nvrtc = r["reason"].as_str().is_some_and(|r| r.contains("NVRTC"));
        assert!(
            nvrtc && !required(),
            "the check ended before a step did: {r}"
        );
        eprintln!("skipped: NVRTC not found: {}", r["reason"]);
        return;
    };
    kill_check(&mut child);
    let text = fs::read_to_string(out.join("results.json")).unwrap();
    let r: Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("results.json after the kill is not JSON ({e}): {text}"));
    assert_eq!(r["complete"], false, "{r}");
    assert_eq!(r["verdict"], "incomplete", "{r}");
    let names: Vec<&str> = r["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, steps_in_order(), "every step, in order");
    let finished: Vec<&Value> = r["steps"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["status"] != "pending")
        .collect();
    // What was seen finished before the kill is there, as it was.
    for s in seen["steps"].as_array().unwrap() {
        if s["status"] == "pending" {
            continue;
        }
        let now = finished.iter().find(|f| f["name"] == s["name"]);
        assert_eq!(now.copied(), Some(s), "{} after the kill: {r}", s["name"]);
    }
    assert_eq!(finished[0]["name"], "preflight", "{r}");
    assert_eq!(finished[0]["status"], "pass", "{r}");
    for s in &finished {
        assert!(
            s["seconds"].as_f64().is_some() && s["summary"].is_string(),
            "{s}"
        );
    }
    let after = r["steps"].as_array().unwrap().len() - finished.len();
    assert!(after >= 1, "the kill came before the last step: {r}");
    assert_eq!(
        r["preflight"]["worker"]["kernels"], "CUBIN for sm_90",
        "the emulated GPU loaded its CUBIN: {r}"
    );

    // A bundle: the script beside a kernel cache holding what that check's NVRTC made.
    let bundle = tmp.path().join("bundle");
    fs::create_dir_all(bundle.join("kernel-cache")).unwrap();
    fs::copy(script(), bundle.join("gpu_check.sh")).unwrap();
    let mut cached = Vec::new();
    for e in fs::read_dir(out.join("kernel-cache")).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with("kernels-") && name.contains("-sm_90-") {
            fs::copy(e.path(), bundle.join("kernel-cache").join(&name)).unwrap();
            cached.push(name);
        }
    }
    cached.sort();
    assert_eq!(cached.len(), 2, "the sm_90 CUBIN and PTX: {cached:?}");
    let out2 = tmp.path().join("out2");
    let mut child = start_check(&bundle.join("gpu_check.sh"), &out2, tmp.path(), &[]);
    let seen = wait_for_a_finished_step(&mut child, &out2, Duration::from_secs(300))
        .expect("the check from the bundle ended before its first step did");
    kill_check(&mut child);
    let pre = &seen["preflight"];
    assert_eq!(seen["steps"][0]["status"], "pass", "{seen}");
    assert_eq!(pre["worker"]["kernels"], "CUBIN for sm_90", "{pre}");
    let kc = &pre["kernel_cache"];
    assert_eq!(str_list(&kc["from_bundle"]), cached, "{kc}");
    assert_eq!(str_list(&kc["compiled_here"]), Vec::<String>::new(), "{kc}");
}

#[test]
fn gpu_check_emulated_runs_every_step_and_writes_its_verdict() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let console = tmp.path().join("console.txt");
    // A roofline model of throughput:tiny's shapes (as scripts/gpu_bundle.sh writes one
    // of Qwen3-8B's from `bench kernels`), so the throughput rows carry its MFU.
    let roofline = tmp.path().join("roofline.json");
    fs::write(
        &roofline,
        r#"{"nvrtc": "13.0", "model": {"hardware": {"name": "a test's"},
            "shapes": {"hidden": 128.0, "q_heads": 1.0, "kv_heads": 1.0, "head_dim": 128.0, "layers": 2.0,
                       "intermediate": 256.0, "vocab": 256.0, "drafter_layers": 1.0, "anchors": 2, "block": 4, "drafter_context": 16},
            "target_forward": [{"name": "target forward, 8 tokens", "mfu": 0.9}, {"name": "target forward, 16 tokens", "mfu": 0.25}],
            "drafter_step": {"name": "drafter step", "mfu": 0.125}}}"#,
    )
    .unwrap();
    let started = Instant::now();
    // The script bounds itself (each step under timeout, the whole within the emulated
    // budget); this deadline is the backstop.
    let (budget, _) = budget_and_limits("EMULATED");
    let mut child = start_check(
        &script(),
        &out,
        tmp.path(),
        &[("GPU_CHECK_ROOFLINE", &roofline)],
    );
    let deadline = Duration::from_secs(budget + 120);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if started.elapsed() > deadline {
            // As on Ctrl-C: the script stops its step and writes what it has.
            common::signal(child.id(), Signal::SIGTERM);
            std::thread::sleep(Duration::from_secs(30));
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "gpu_check.sh --emulated ran past {deadline:?}:\n{}",
                fs::read_to_string(&console).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let text = fs::read_to_string(&console).unwrap_or_default();
    let stderr = fs::read_to_string(tmp.path().join("stderr.txt")).unwrap_or_default();
    let results: Value = serde_json::from_str(
        &fs::read_to_string(out.join("results.json"))
            .unwrap_or_else(|e| panic!("no results.json ({e}); exit {status}\n{text}\n{stderr}")),
    )
    .unwrap_or_else(|e| panic!("results.json is not JSON: {e}\n{text}"));
    eprintln!(
        "gpu_check.sh --emulated took {:.0} s:\n{text}",
        started.elapsed().as_secs_f64()
    );

    if status.code() == Some(2)
        && results["reason"]
            .as_str()
            .is_some_and(|r| r.contains("NVRTC"))
    {
        assert!(
            !required(),
            "NVRTC not found (pip install nvidia-cuda-nvrtc); .ci/run installs it: {}",
            results["reason"]
        );
        eprintln!("skipped: NVRTC not found: {}", results["reason"]);
        return;
    }
    let steps = results["steps"].as_array().expect("steps");
    let failed: Vec<String> = steps
        .iter()
        .filter(|s| s["status"] != "pass")
        .map(|s| format!("{}: {} ({})", s["name"], s["status"], s["summary"]))
        .collect();
    assert!(
        failed.is_empty() && status.code() == Some(0),
        "exit {status}; steps not passed:\n{}\n\n{text}\n{stderr}",
        failed.join("\n")
    );
    assert_eq!(results["exit_code"], 0);
    assert_eq!(results["verdict"], "pass");
    assert_eq!(results["complete"], true);
    assert_eq!(results["mode"], "emulated");
    let names: Vec<&str> = steps.iter().map(|s| s["name"].as_str().unwrap()).collect();
    assert_eq!(names, steps_in_order(), "every step, in order");
    assert!(
        steps
            .iter()
            .all(|s| s["seconds"].as_f64().is_some_and(|t| t >= 0.0) && s["summary"].is_string()),
        "{steps:?}"
    );

    // Preflight: what the workers loaded from where, and what NVRTC made.
    let pre = &results["preflight"];
    let libs = &pre["worker"]["libraries"];
    assert!(
        libs["driver"]["path"]
            .as_str()
            .is_some_and(|p| p.ends_with("libdflash_emu_cuda.so")),
        "{libs}"
    );
    assert!(
        libs["cublas"]["path"]
            .as_str()
            .is_some_and(|p| p.ends_with("libdflash_emu_cublas.so")),
        "{libs}"
    );
    assert!(
        libs["nvrtc"]["path"]
            .as_str()
            .is_some_and(|p| p.contains("libnvrtc")),
        "{libs}"
    );
    assert!(
        libs["driver"]["version"]
            .as_str()
            .is_some_and(|v| v.starts_with("driver for CUDA ")),
        "{libs}"
    );
    assert_eq!(pre["worker"]["kernels"], "CUBIN for sm_90");
    assert_eq!(
        str_list(&pre["workers_reporting"]),
        ["drafter-0", "target-0"]
    );
    assert!(
        pre["nvrtc_version"].is_string() && pre["ptx_isa"].is_string(),
        "{pre}"
    );
    assert_eq!(pre["gpu"]["name"], "Emulated GPU (fake NVML)");
    assert!(
        pre["gpu"]["nvml_clocks_mhz"]["sm"]
            .as_f64()
            .is_some_and(|c| c > 0.0),
        "clocks: {}",
        pre["gpu"]
    );

    // Parity: one row per test of the host_device executable, every one passed on the
    // emulated GPU.
    let parity = results["parity"].as_array().expect("parity rows");
    assert!(parity.len() >= 10, "{} parity rows", parity.len());
    for r in parity {
        assert!(
            r["name"]
                .as_str()
                .is_some_and(|n| n.starts_with("host_device_")),
            "{r}"
        );
        assert_eq!(r["status"], "pass", "{r}");
        assert!(r["seconds"].as_f64().is_some(), "{r}");
    }

    // The pipelines: NVML's fields there with telemetry, none without, NCCL's group formed.
    let details = |name: &str| {
        steps
            .iter()
            .find(|s| s["name"] == name)
            .map(|s| s["details"].clone())
            .unwrap()
    };
    let on = details("pipeline");
    for f in [
        "util_gpu_pct",
        "mem_used_bytes",
        "power_w",
        "temp_c",
        "sm_clock_mhz",
        "mem_clock_mhz",
    ] {
        assert_eq!(on["nvml_fields"][f], true, "{f}: {on}");
    }
    assert!(
        on["gpu_samples"].as_u64().is_some_and(|n| n > 0) && on["steps"] == 6,
        "{on}"
    );
    assert_eq!(details("pipeline-nccl")["collective"], "NCCL");
    // τ of the trained drafter decoded on the (emulated) GPU, its first tokens the CPU's
    // on every prompt whose CPU top-2 margin exceeds the bf16 bound; the others are ties.
    let ev = details("eval");
    assert_eq!(ev["gpu"]["device"], "gpu", "{ev}");
    assert_eq!(ev["same_first_tokens"], true, "{ev}");
    let first = &ev["first_tokens"];
    let prompts = ev["gpu"]["prompts"].as_u64().unwrap();
    let ties = first["ties"].as_array().unwrap();
    assert_eq!(
        first["compared"].as_u64().unwrap() + ties.len() as u64,
        prompts,
        "{first}"
    );
    assert_eq!(first["same"], first["compared"], "{first}");
    assert!(first["differ"].as_array().unwrap().is_empty(), "{first}");
    for t in ties {
        assert!(
            t["margin"].as_f64().unwrap() <= t["bound"].as_f64().unwrap(),
            "{t}"
        );
    }

    // Throughput: a measured row per role, 20 steps or more after a warm-up, computed the
    // way a GPU's is; the roofline's MFU beside it where the model has the same shapes.
    let rows = results["throughput"].as_array().expect("throughput rows");
    let roles: Vec<&str> = rows.iter().map(|r| r["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["target", "drafter"], "{rows:?}");
    for r in rows {
        assert!(r["error"].is_null(), "{r}");
        let (secs, tokens) = (
            r["seconds_per_step"].as_f64().unwrap(),
            r["tokens_per_step"].as_f64().unwrap(),
        );
        assert!(secs > 0.0 && tokens > 0.0, "{r}");
        let tps = r["tokens_per_s"].as_f64().unwrap();
        assert!((tps - tokens / secs).abs() <= 1e-9 * tps, "{r}");
        assert!(
            r["steps"].as_u64().unwrap() >= 20 && r["warmup_steps"].as_u64().unwrap() >= 1,
            "{r}"
        );
        let scaled = tps * r["layers"].as_f64().unwrap() / r["model_layers"].as_f64().unwrap();
        assert!(
            (r["tokens_per_s_model"].as_f64().unwrap() - scaled).abs() <= 1e-9 * tps,
            "{r}"
        );
        assert!(
            r["model_flops_per_step"].as_f64().is_some_and(|f| f > 0.0),
            "{r}"
        );
        // The emulated GPU has no known peak: no MFU, never a made-up one.
        assert!(r["mfu"].is_null(), "{r}");
    }
    assert_eq!(rows[0]["modelled_mfu"], 0.25, "{}", rows[0]);
    assert_eq!(rows[1]["modelled_mfu"], 0.125, "{}", rows[1]);
    assert!(
        ev["gpu_tau"]["pooled"]
            .as_f64()
            .is_some_and(|t| (1.0..=ev["gpu"]["block_size"].as_f64().unwrap()).contains(&t)),
        "{ev}"
    );
    for name in ["pipeline", "pipeline-nccl"] {
        let d = details(name);
        assert_eq!(d["ledger_exit_code"], 0, "{name}: {d}");
        for w in ["target-0", "drafter-0"] {
            assert!(
                d["workers_on_gpu"][w]
                    .as_str()
                    .is_some_and(|g| g.contains("Emulated GPU")),
                "{name} {w}: {d}"
            );
        }
    }

    // Isolation: the supervisor maps the (fake) NVML and no CUDA library; each worker maps
    // the emulated driver and cuBLAS and NVRTC, and no NVML.
    let iso = &results["isolation"];
    assert!(
        str_list(&iso["supervisor"]["nvml"])
            .iter()
            .any(|l| l.ends_with("libdflash_fake_nvml.so")),
        "{iso}"
    );
    assert!(str_list(&iso["supervisor"]["cuda"]).is_empty(), "{iso}");
    let workers = iso["workers"].as_array().unwrap();
    assert_eq!(workers.len(), 2, "{iso}");
    for w in workers {
        let cuda = str_list(&w["cuda"]);
        for lib in [
            "libdflash_emu_cuda.so",
            "libdflash_emu_cublas.so",
            "libnvrtc",
        ] {
            assert!(
                cuda.iter().any(|l| l.contains(lib)),
                "{} maps no {lib}: {w}",
                w["name"]
            );
        }
        assert!(str_list(&w["nvml"]).is_empty(), "{w}");
    }

    // Benchmarks: every op of the preset measured, none failed.
    let bench = results["bench"].as_array().expect("bench rows");
    let ops: Vec<&str> = bench.iter().map(|r| r["op"].as_str().unwrap()).collect();
    for op in [
        "attention causal forward",
        "attention causal backward",
        "attention dflash forward",
        "attention dflash backward",
        "gemm q_proj",
        "gemm down_proj",
        "cross_entropy forward and backward",
        "target forward",
        "target forward, rows packed",
        "target forward, row by row",
        "drafter step",
    ] {
        assert!(ops.contains(&op), "{op} missing: {ops:?}");
    }
    assert!(bench.len() >= 20, "{} bench rows", bench.len());
    for r in bench {
        assert!(
            r["error"].is_null()
                && r["seconds"].as_f64().is_some_and(|s| s > 0.0)
                && r["flops"].as_f64().is_some_and(|f| f > 0.0),
            "{r}"
        );
    }

    // The table, and what came back besides.
    let md = fs::read_to_string(out.join("results.md")).unwrap();
    assert!(md.contains("| worker | tokens/s |"), "{md}");
    for s in steps_in_order() {
        assert!(md.contains(&format!("| {s} | pass |")), "{s} row: {md}");
    }
    assert!(
        text.contains("| parity | pass |"),
        "the table is printed: {text}"
    );
    assert!(fs::read_dir(out.join("kernel-cache"))
        .unwrap()
        .flatten()
        .any(|e| e.path().extension().is_some_and(|x| x == "cubin")));
    for s in steps_in_order() {
        assert!(
            out.join("logs").join(format!("{s}.log")).is_file(),
            "{s}.log"
        );
    }
    assert!(out.join("runs/pipeline/logs/drafter-0.log").is_file());

    // Nothing of the check is left running (its runs were under TMPDIR).
    let tmp_s = tmp.path().to_string_lossy().into_owned();
    common::wait_for(
        "the check's processes to be gone",
        Duration::from_secs(20),
        || {
            let left: Vec<String> = fs::read_dir("/proc")
                .unwrap()
                .flatten()
                .filter(|e| {
                    e.file_name()
                        .to_string_lossy()
                        .chars()
                        .all(|c| c.is_ascii_digit())
                })
                .filter_map(|e| fs::read(e.path().join("cmdline")).ok())
                .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
                .filter(|c| c.contains(&tmp_s))
                .collect();
            left.is_empty().then_some(())
        },
    );
}
