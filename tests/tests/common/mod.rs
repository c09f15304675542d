//! Harness for the end-to-end tests: start the real `dflash-supervise` with a run dir in a
//! temporary directory, read its state.json and events.jsonl, and wait for conditions up to
//! a deadline (never a fixed sleep).
#![allow(dead_code)]

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// Binaries of the workspace, beside the test executable's `deps/` directory.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe.parent().and_then(Path::parent).expect("target dir");
    let p = dir.join(name);
    assert!(
        p.exists(),
        "{} is missing: build the workspace first (cargo build --workspace)",
        p.display()
    );
    p
}

/// A library the workspace builds (a cdylib), beside the test executable's `deps/`.
pub fn cdylib(file: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let p = exe
        .parent()
        .and_then(Path::parent)
        .expect("target dir")
        .join(file);
    assert!(
        p.exists(),
        "{} is missing: build the workspace first",
        p.display()
    );
    p
}

/// The fake NVML library (tests/fake-nvml), for GPU code paths without a GPU.
pub fn fake_nvml() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let p = exe
        .parent()
        .and_then(Path::parent)
        .expect("target dir")
        .join("libdflash_fake_nvml.so");
    assert!(
        p.exists(),
        "{} is missing: build the workspace first",
        p.display()
    );
    p
}

/// The fake CUDA library (tests/fake-cuda): `cuInit` and no other function.
pub fn fake_cuda() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let p = exe
        .parent()
        .and_then(Path::parent)
        .expect("target dir")
        .join("libdflash_fake_cuda.so");
    assert!(
        p.exists(),
        "{} is missing: build the workspace first",
        p.display()
    );
    p
}

pub fn test_worker() -> PathBuf {
    bin("dflash-test-worker")
}

/// Panic unless the test worker accepts `spec` (`DFLASH_TEST_BEHAVIOR`): a typo in a test
/// must fail it here, not give a worker that idles.
pub fn check_behavior(spec: &str) {
    let out = Command::new(test_worker())
        .args(["--check-behavior", spec])
        .output()
        .expect("run dflash-test-worker");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
}

/// Poll `f` every 20 ms until it returns Some or `timeout` passes; panic naming `what`.
pub fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        if Instant::now() > deadline {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Alive and not a zombie.
pub fn pid_alive(pid: u32) -> bool {
    let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.trim_start().chars().next());
    !matches!(state, Some('Z') | Some('X') | None)
}

pub fn signal(pid: u32, sig: nix::sys::signal::Signal) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), sig);
}

pub struct Sup {
    pub child: Child,
    /// Held open and empty for runs fed from stdin, so their pipeline idles.
    pub stdin: Option<std::process::ChildStdin>,
    pub tmp: tempfile::TempDir,
    pub run_dir: PathBuf,
    status: Option<ExitStatus>,
}

impl Sup {
    /// Start a run with the test worker (behaviour from `behavior`, see test_worker.rs).
    pub fn start(args: &[&str], behavior: &str) -> Sup {
        Sup::start_with(args, Some(behavior))
    }

    /// Start a run with the real dflash-worker. Unless `args` name a `--data`, the run is
    /// fed from an empty stdin held open: workers are up and idle until the test acts.
    pub fn start_real(args: &[&str]) -> Sup {
        Sup::start_with(args, None)
    }

    /// Start a run with the real dflash-worker and extra environment.
    pub fn start_real_env(args: &[&str], env: &[(&str, &str)]) -> Sup {
        Sup::start_full(args, None, env)
    }

    /// [`Sup::start_real_env`], the supervisor leading a process group of its own as a
    /// shell's foreground job does: [`Sup::ctrl_c`] signals that group, as a terminal's
    /// Ctrl-C does.
    pub fn start_real_env_as_job(args: &[&str], env: &[(&str, &str)]) -> Sup {
        Sup::start_group(args, None, env, true)
    }

    /// SIGINT to the supervisor's process group (started with [`Sup::start_real_env_as_job`]).
    pub fn ctrl_c(&self) {
        nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(self.pid() as i32),
            nix::sys::signal::Signal::SIGINT,
        )
        .expect("killpg");
    }

    fn start_with(args: &[&str], behavior: Option<&str>) -> Sup {
        Sup::start_full(args, behavior, &[])
    }

    fn start_full(args: &[&str], behavior: Option<&str>, env: &[(&str, &str)]) -> Sup {
        Sup::start_group(args, behavior, env, false)
    }

    fn start_group(
        args: &[&str],
        behavior: Option<&str>,
        env: &[(&str, &str)],
        own_group: bool,
    ) -> Sup {
        let tmp = tempfile::tempdir().expect("tempdir");
        let run_dir = tmp.path().join("run");
        let mut cmd = Command::new(bin("dflash-supervise"));
        cmd.args(args).arg("--run-dir").arg(&run_dir);
        if let Some(b) = behavior {
            check_behavior(b);
            cmd.arg("--worker-bin")
                .arg(test_worker())
                .env("DFLASH_TEST_BEHAVIOR", b);
            if args.contains(&"--data") {
                // Workers without a rule do real work, so data flows around the offenders.
                cmd.env("DFLASH_TEST_REAL_WORKER", bin("dflash-worker"));
            }
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        let idle = !args.contains(&"--data");
        if idle {
            cmd.args(["--data", "-"]).stdin(Stdio::piped());
        } else {
            cmd.stdin(Stdio::null());
        }
        cmd.stdout(fs::File::create(tmp.path().join("stdout")).unwrap())
            .stderr(fs::File::create(tmp.path().join("stderr")).unwrap());
        if own_group {
            std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        }
        let mut child = cmd.spawn().expect("start dflash-supervise");
        let stdin = child.stdin.take();
        Sup {
            child,
            stdin,
            tmp,
            run_dir,
            status: None,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn stderr(&self) -> String {
        fs::read_to_string(self.tmp.path().join("stderr")).unwrap_or_default()
    }

    pub fn stdout(&self) -> String {
        fs::read_to_string(self.tmp.path().join("stdout")).unwrap_or_default()
    }

    pub fn state(&self) -> Option<Value> {
        serde_json::from_str(&fs::read_to_string(self.run_dir.join("state.json")).ok()?).ok()
    }

    pub fn events(&self) -> Vec<Value> {
        read_jsonl(&self.run_dir.join("events.jsonl"))
    }

    /// `dflash-supervise ledger --json` of this run: (exit code, audit).
    pub fn ledger(&self) -> (i32, Value) {
        let out = supervise(
            &[
                "ledger",
                "--run-dir",
                self.run_dir.to_str().unwrap(),
                "--json",
            ],
            None,
        );
        let v = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        (out.status.code().unwrap_or(-1), v)
    }

    /// The ledger's records.
    pub fn ledger_records(&self) -> Vec<Value> {
        read_jsonl(&self.run_dir.join("ledger.jsonl"))
    }

    pub fn log(&self, worker: &str) -> String {
        fs::read_to_string(self.run_dir.join("logs").join(format!("{worker}.log")))
            .unwrap_or_default()
    }

    /// Wait until state.json satisfies `pred`; returns that state.
    pub fn wait_state(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.state() {
                if pred(&s) {
                    return s;
                }
            }
            if Instant::now() > deadline {
                panic!(
                    "timed out after {timeout:?} waiting for {what}\nstate: {}\nstderr:\n{}",
                    self.state().map(|s| s.to_string()).unwrap_or_default(),
                    self.stderr()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Wait until every worker is running (connected and heartbeating).
    pub fn wait_running(&self, n: usize) -> Value {
        self.wait_state(
            &format!("{n} workers running"),
            Duration::from_secs(20),
            |s| {
                let ws = s["workers"].as_array().unwrap();
                ws.len() == n && ws.iter().all(|w| w["state"] == "running")
            },
        )
    }

    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        if let Some(s) = self.status {
            return s;
        }
        let s = wait_for("the supervisor to exit", timeout, || {
            self.child.try_wait().unwrap()
        });
        self.status = Some(s);
        s
    }

    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        signal(self.pid(), sig);
    }
}

/// Every JSON line of a file (none if it does not exist yet).
pub fn read_jsonl(path: &Path) -> Vec<Value> {
    fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

pub fn worker<'a>(state: &'a Value, name: &str) -> &'a Value {
    state["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["name"] == name)
        .unwrap_or_else(|| panic!("no {name} in {state}"))
}

pub fn pid_of(state: &Value, name: &str) -> u32 {
    worker(state, name)["pid"]
        .as_u64()
        .unwrap_or_else(|| panic!("{name} has no pid in {state}")) as u32
}

impl Drop for Sup {
    fn drop(&mut self) {
        if self.status.is_none() && self.child.try_wait().ok().flatten().is_none() {
            // SIGKILL: the reaper and PDEATHSIG take the workers with it.
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Run `dflash-supervise ARGS` to completion.
pub fn supervise(args: &[&str], cwd: Option<&Path>) -> Output {
    let mut cmd = Command::new(bin("dflash-supervise"));
    cmd.args(args).stdin(Stdio::null());
    if let Some(d) = cwd {
        cmd.current_dir(d);
    }
    cmd.output().expect("run dflash-supervise")
}

/// The documented sbatch script: the first `sh` block of README.md or docs/*.md that
/// requeues with `scontrol requeue`.
pub fn documented_sbatch_script() -> (PathBuf, String) {
    documented_script(|body| !body.contains("srun "))
}

/// The multi-node sbatch script of the docs (the one that starts the supervisors with
/// srun), as written there.
pub fn documented_multi_node_sbatch_script() -> (PathBuf, String) {
    documented_script(|body| body.contains("srun "))
}

/// The first sbatch script with `scontrol requeue` in README.md or docs/*.md that `pick`
/// takes, and the file it is in.
fn documented_script(pick: impl Fn(&str) -> bool) -> (PathBuf, String) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = vec![root.join("README.md")];
    if let Ok(d) = fs::read_dir(root.join("docs")) {
        let mut docs: Vec<PathBuf> = d
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "md"))
            .collect();
        docs.sort();
        files.extend(docs);
    }
    for f in files {
        let text = fs::read_to_string(&f).unwrap_or_default();
        for block in text.split("```sh\n").skip(1) {
            let body = block.split("```").next().unwrap_or("");
            if body.contains("#SBATCH") && body.contains("scontrol requeue") && pick(body) {
                return (f, body.to_string());
            }
        }
    }
    panic!("no sbatch script with `scontrol requeue` in README.md or docs/*.md");
}

/// The pids of `pid`'s children, over all its threads (a child started by any thread).
pub fn children(pid: u32) -> Vec<u32> {
    fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.flatten()
                .flat_map(|t| {
                    fs::read_to_string(t.path().join("children"))
                        .unwrap_or_default()
                        .split_whitespace()
                        .filter_map(|p| p.parse().ok())
                        .collect::<Vec<u32>>()
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Whether python3 imports torch and transformers: false (a skip) on a laptop without
/// them, a failure under CI (.ci/run installs them).
pub fn have_torch() -> bool {
    have_python("torch, transformers")
}

/// Whether python3 imports `modules` (comma-separated); a skip on a laptop without, a
/// failure under CI (`.ci/run` installs them).
pub fn have_python(modules: &str) -> bool {
    let ok = Command::new("python3")
        .args(["-c", &format!("import {modules}")])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        assert!(
            std::env::var_os("CI").is_none(),
            "python3 with {modules} is missing: under CI this test may not skip"
        );
        eprintln!("skipping: python3 with {modules} is not installed");
    }
    ok
}

/// Qwen3's real tokenizer and chat template (scripts/fetch_test_assets.sh, or
/// `DFLASH_QWEN3_TOKENIZER`): `None` (a skip) without it on a laptop, a failure under CI.
pub fn qwen3_tokenizer() -> Option<PathBuf> {
    let d = match std::env::var_os("DFLASH_QWEN3_TOKENIZER") {
        Some(d) => PathBuf::from(d),
        None => {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/test-assets/qwen3-tokenizer")
        }
    };
    if d.join("tokenizer.json").is_file() {
        return Some(d);
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "{} is missing: under CI this test may not skip (.ci/run fetches it)",
        d.display()
    );
    eprintln!("skipping: no Qwen3 tokenizer at {}", d.display());
    None
}

/// A target of random weights for `config` (a config.json's text) in `dir`, with the
/// tokenizer and chat template of `tokenizer` beside them.
pub fn target_with_tokenizer(dir: &Path, config: &str, tokenizer: &Path) {
    fs::create_dir_all(dir).unwrap();
    let cfg = dir.with_extension("config.json");
    fs::write(&cfg, config).unwrap();
    let st = Command::new(bin("dflash-worker"))
        .args(["tiny-target", "--out"])
        .arg(dir)
        .arg("--config")
        .arg(&cfg)
        .status()
        .unwrap();
    assert!(st.success(), "dflash-worker tiny-target");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        fs::copy(tokenizer.join(f), dir.join(f)).unwrap();
    }
}

/// The directory of the workspace's binaries.
pub fn target_dir() -> PathBuf {
    bin("dflash-supervise").parent().unwrap().to_path_buf()
}

/// NVRTC where the worker looks for it (its override, or a PyPI wheel).
pub fn nvrtc_present() -> bool {
    if std::env::var_os("DFLASH_NVRTC_LIB").is_some() {
        return true;
    }
    let out = std::process::Command::new("python3")
        .args([
            "-c",
            "import site; print('\\n'.join(site.getsitepackages() + [site.getusersitepackages()]))",
        ])
        .output();
    out.map(|o| {
        String::from_utf8_lossy(&o.stdout).lines().any(|d| {
            PathBuf::from(d)
                .join("nvidia/cu13/lib/libnvrtc.so.13")
                .exists()
        })
    })
    .unwrap_or(false)
}

pub fn skip_without_nvrtc() -> bool {
    if nvrtc_present() {
        return false;
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "NVRTC not found (pip install nvidia-cuda-nvrtc); .ci/run installs it"
    );
    eprintln!("skipped: NVRTC not found (pip install nvidia-cuda-nvrtc)");
    true
}

/// The environment of a run on `n` emulated GPUs (tests/emu-cuda: driver, cuBLAS, NCCL
/// across processes; NVML faked): (key, value) pairs, the NVML script
/// written into `dir`.
pub fn emulated(dir: &std::path::Path, n: usize) -> Vec<(String, String)> {
    let t = target_dir();
    let (cuda, cublas) = (
        t.join("libdflash_emu_cuda.so"),
        t.join("libdflash_emu_cublas.so"),
    );
    assert!(
        cuda.exists() && cublas.exists(),
        "the emulated CUDA stack is not built: cargo build --workspace"
    );
    let devs: Vec<String> = (0..n)
        .map(|i| {
            format!(
                r#"{{"name": "Fake H200", "uuid": "GPU-{i:04}", "memory_total": 150323855360}}"#
            )
        })
        .collect();
    let script = dir.join("nvml.json");
    fs::write(
        &script,
        format!(
            r#"{{"driver": "580.65.06", "devices": [{}]}}"#,
            devs.join(", ")
        ),
    )
    .unwrap();
    let s = |p: &std::path::Path| p.to_str().unwrap().to_string();
    vec![
        ("DFLASH_NVML_LIBRARY".into(), s(&fake_nvml())),
        ("DFLASH_FAKE_NVML".into(), s(&script)),
        ("DFLASH_CUDA_LIB".into(), s(&cuda)),
        ("DFLASH_CUBLAS_LIB".into(), s(&cublas)),
        ("DFLASH_NCCL_LIB".into(), s(&cuda)),
        ("DFLASH_KERNEL_CACHE".into(), s(&t.join("emu-kernel-cache"))),
    ]
}

/// A free port on 127.0.0.2 (bound and let go: a job's leader binds it next).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.2:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Small batches of the built-in data, one target: runs on emulated GPUs that end quickly.
pub const SMALL_GPU_RUN: [&str; 10] = [
    "--targets",
    "1",
    "--data",
    "demo",
    "--max-seq-len",
    "16",
    "--token-budget",
    "128",
    "--stable-after",
    "200ms",
];
