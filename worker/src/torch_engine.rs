//! The torch target engine (`--target-engine torch`): the target worker stays the Rust
//! process the supervisor knows (its protocol, heartbeats, restarts, capture spec) and owns
//! one Python child, `python/dflash_target_engine.py`, which loads the target with
//! transformers and writes each batch's taps straight into the hidden-state pool (it maps
//! the pool's memfd through `/proc/<this process>/fd/<fd>`: no copy through a pipe). The
//! worker writes the slot's header, asks the child for the rows, and seals the slot: the
//! supervisor and the drafters cannot tell the engines apart.
//!
//! The child dies with this process (`PR_SET_PDEATHSIG`); if it dies first, the batch in
//! hand fails with the child's last stderr lines, the worker exits and is restarted like any
//! other, and the batch is delivered again.

use dflash_shared::env::python;
use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};

/// The child's program, embedded: run with `python3 -c`.
pub const ENGINE_MODULE: &str = include_str!("../python/dflash_target_engine.py");

/// How many GPUs `CUDA_VISIBLE_DEVICES` gives this process (a target worker holding
/// several: `--gpus-per-target`); 0 when it names none.
pub fn visible_gpus() -> usize {
    std::env::var("CUDA_VISIBLE_DEVICES")
        .map_or(0, |v| v.split(',').filter(|d| !d.trim().is_empty()).count())
}

/// Lines of the child's stderr kept to say why it died.
const TAIL: usize = 12;

/// What went wrong with the child, naming the engine.
#[derive(Debug, thiserror::Error)]
pub enum TorchError {
    #[error("torch engine: cannot start {python}: {source} (the torch engine needs python3 with torch and transformers: pip install torch transformers; or DFLASH_PYTHON=/path/to/python)")]
    Spawn {
        python: String,
        source: std::io::Error,
    },
    #[error("torch engine: the Python child ended ({status}){tail}")]
    Ended { status: String, tail: String },
    #[error("torch engine: {0}")]
    Protocol(String),
    /// The child has NVML in its address space: GPU telemetry is the supervisor's alone,
    /// and no process with a CUDA context may load it (the same rule as for the workers).
    #[error("torch engine: the Python child loaded NVML ({lib}); GPU telemetry belongs to the supervisor alone (remove what preloads it, e.g. LD_PRELOAD or a package importing pynvml)")]
    Nvml { lib: String },
}

impl TorchError {
    /// Restarting cannot help: Python is missing, or the child refused the target.
    pub fn permanent(&self) -> bool {
        matches!(self, TorchError::Spawn { .. } | TorchError::Nvml { .. })
    }
}

/// The running child.
pub struct TorchChild {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    stderr: Arc<Mutex<VecDeque<String>>>,
    stderr_reader: Option<std::thread::JoinHandle<()>>,
    /// Its ready line: hidden size, layers, versions, device.
    pub ready: Value,
    /// Whether its address space was checked for NVML after its first batch too (a library
    /// may be loaded lazily, at the first use of a device).
    checked_after_work: bool,
}

/// The NVML library mapped into process `pid`, if one is (its path as /proc/PID/maps
/// names it).
fn nvml_mapped(pid: u32) -> Option<String> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| {
            std::path::Path::new(p)
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("libnvidia-ml"))
        })
        .map(str::to_string)
}

/// `cmd` spawned from a thread that lives as long as this process: `PR_SET_PDEATHSIG`
/// fires when the thread that forked ends, and the caller may be a short-lived one (the
/// target's loading thread).
fn spawn_kept(mut cmd: Command) -> std::io::Result<Child> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("torch-parent".into())
        .spawn(move || {
            let _ = tx.send(cmd.spawn());
            loop {
                std::thread::park();
            }
        })?;
    rx.recv()
        .unwrap_or_else(|_| Err(std::io::Error::other("the spawning thread died")))
}

/// What the child is started for.
pub enum Mode<'a> {
    /// Capture: the layers up to the last tap, each batch's taps written at the offsets
    /// asked into the file at this path (the hidden-state pool's memfd, or a plain file).
    Taps { pool: &'a Path },
    /// Decoding (`eval`): the whole model over a KV cache, floats through the file at this
    /// path ([`TorchChild::call`]).
    Decode { exchange: &'a Path },
}

impl TorchChild {
    /// Start the child on `target` with these taps for `mode`, on `gpus` GPUs (the first
    /// ones `CUDA_VISIBLE_DEVICES` names; several: its layers split over them) or, with 0,
    /// the CPU. Returns once it has loaded the model.
    pub fn start(
        target: &Path,
        taps: &[usize],
        mode: Mode<'_>,
        gpus: usize,
    ) -> Result<Self, TorchError> {
        let py = python();
        let taps: Vec<String> = taps.iter().map(usize::to_string).collect();
        let mut cmd = Command::new(&py);
        cmd.arg("-c")
            .arg(ENGINE_MODULE)
            .arg("--target")
            .arg(target)
            .arg("--taps")
            .arg(taps.join(","));
        match mode {
            Mode::Taps { pool } => cmd.arg("--pool").arg(pool),
            Mode::Decode { exchange } => cmd.args(["--mode", "decode", "--exchange"]).arg(exchange),
        };
        if gpus > 1 {
            let devices: Vec<String> = (0..gpus).map(|g| format!("cuda:{g}")).collect();
            cmd.arg("--devices").arg(devices.join(","));
        }
        if gpus == 0 {
            // As many threads as this worker's own CPU compute gets (the supervisor shares
            // the cores out between the workers): torch alone would take every core.
            cmd.arg("--threads")
                .arg(dflash_shared::nproc::compute_threads().to_string());
            // OpenMP's threads spin while they wait by default: beside a drafter on the
            // same cores they would take its time. Sleeping, unless the user chose.
            if std::env::var_os("OMP_WAIT_POLICY").is_none() {
                cmd.env("OMP_WAIT_POLICY", "PASSIVE");
            }
        }
        cmd.arg("--device")
            .arg(if gpus > 0 { "cuda" } else { "cpu" })
            .env("PYTHONUNBUFFERED", "1")
            .env("TRANSFORMERS_VERBOSITY", "error")
            .env("HF_HUB_OFFLINE", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: between fork and exec: prctl and getppid only (async-signal-safe).
        unsafe {
            cmd.pre_exec(move || dflash_shared::child::die_with(parent));
        }
        let mut child = spawn_kept(cmd).map_err(|source| TorchError::Spawn {
            python: py.clone(),
            source,
        })?;
        let stderr = Arc::new(Mutex::new(VecDeque::new()));
        let mut stderr_reader = None;
        if let Some(err) = child.stderr.take() {
            let keep = stderr.clone();
            // Its lines go to this worker's log too.
            stderr_reader = std::thread::Builder::new()
                .name("torch-stderr".into())
                .spawn(move || {
                    for line in BufReader::new(err).lines() {
                        let Ok(line) = line else { break };
                        eprintln!("[torch] {line}");
                        if let Ok(mut t) = keep.lock() {
                            if t.len() == TAIL {
                                t.pop_front();
                            }
                            t.push_back(line);
                        }
                    }
                })
                .ok();
        }
        let (stdin, stdout) = match (child.stdin.take(), child.stdout.take()) {
            (Some(i), Some(o)) => (i, BufReader::new(o)),
            _ => return Err(TorchError::Protocol("no pipes to the child".into())),
        };
        let mut me = TorchChild {
            child,
            stdin,
            stdout,
            stderr,
            stderr_reader,
            ready: Value::Null,
            checked_after_work: false,
        };
        let line = me.read_line()?;
        let ready: Value = serde_json::from_str(&line).map_err(|_| {
            TorchError::Protocol(format!("the child said {line:?}, expected its ready line"))
        })?;
        if ready["ready"] != true {
            return Err(TorchError::Protocol(format!(
                "the child said {line:?}, expected its ready line"
            )));
        }
        me.ready = ready;
        if let Some(lib) = nvml_mapped(me.pid()) {
            return Err(TorchError::Nvml { lib });
        }
        Ok(me)
    }

    /// The child's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// One line from the child; its end as [`TorchError::Ended`] with its last stderr lines.
    fn read_line(&mut self) -> Result<String, TorchError> {
        let mut line = String::new();
        match self.stdout.read_line(&mut line) {
            Ok(n) if n > 0 => Ok(line.trim_end().to_string()),
            _ => Err(self.ended()),
        }
    }

    fn ended(&mut self) -> TorchError {
        let status = match self.child.wait() {
            Ok(s) => s.to_string(),
            Err(e) => e.to_string(),
        };
        // The stderr thread reads until the pipe closes, with the exit.
        if let Some(r) = self.stderr_reader.take() {
            let _ = r.join();
        }
        let tail: Vec<String> = self
            .stderr
            .lock()
            .map(|t| t.iter().cloned().collect())
            .unwrap_or_default();
        let tail = if tail.is_empty() {
            String::new()
        } else {
            format!("; its last stderr lines: {}", tail.join(" | "))
        };
        TorchError::Ended { status, tail }
    }

    /// Send `req` (one line) and read the child's answer, which must say `"ok": true`.
    pub fn call(&mut self, req: &Value) -> Result<Value, TorchError> {
        if writeln!(self.stdin, "{req}")
            .and_then(|_| self.stdin.flush())
            .is_err()
        {
            return Err(self.ended());
        }
        let line = self.read_line()?;
        let r: Value = serde_json::from_str(&line).unwrap_or_default();
        if r["ok"] != true {
            return Err(TorchError::Protocol(format!(
                "the child answered {line:?} to {req}"
            )));
        }
        self.check_after_work()?;
        Ok(r)
    }

    /// Run `rows` (token ids, and the byte offset in the pool where each row's taps go) as
    /// batch `id`; `f32` writes f32 instead of bf16. The child's milliseconds.
    pub fn run(&mut self, id: u64, rows: &[(&[u32], u64)], f32: bool) -> Result<f64, TorchError> {
        let req = json!({
            "id": id,
            "rows": rows.iter().map(|r| r.0).collect::<Vec<_>>(),
            "offsets": rows.iter().map(|r| r.1).collect::<Vec<_>>(),
            "dtype": if f32 { "f32" } else { "bf16" },
        });
        let r = self.call(&req)?;
        if r["id"].as_u64() != Some(id) {
            return Err(TorchError::Protocol(format!(
                "the child answered {r} to batch {id}"
            )));
        }
        Ok(r["ms"].as_f64().unwrap_or(0.0))
    }

    /// After the first answer, the address space checked again for NVML (a library may
    /// be loaded lazily, at the first use of a device).
    fn check_after_work(&mut self) -> Result<(), TorchError> {
        if !self.checked_after_work {
            self.checked_after_work = true;
            if let Some(lib) = nvml_mapped(self.pid()) {
                return Err(TorchError::Nvml { lib });
            }
        }
        Ok(())
    }
}

impl Drop for TorchChild {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // Its last stderr lines are in the log before whatever this process says next
        // (a tool's error line is its last).
        if let Some(r) = self.stderr_reader.take() {
            let _ = r.join();
        }
    }
}
