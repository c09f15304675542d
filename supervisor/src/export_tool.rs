//! Writing a checkpoint's drafter as a Hugging Face directory, through the worker
//! program's `export` tool (the supervisor links no model code): used by a run's end and
//! by `dflash-supervise export`. A leaf module: it knows nothing of runs or commands.

use std::path::{Path, PathBuf};
use std::time::Duration;

use dflash_shared::export_dest;

/// Why an export was not written.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error("cannot run {program}: {source}")]
    Spawn {
        program: String,
        source: std::io::Error,
    },
    /// The worker's export tool failed; its own line says why.
    #[error("{0}")]
    Failed(String),
    /// The export was killed before it finished (`why`: a stop, or its time limit); what
    /// it had written was removed, so `out` holds the previous export or none.
    #[error("{why}: {} holds the previous export or none", out.display())]
    Stopped { why: String, out: PathBuf },
}

/// How long the export of a run's drafter may take: loading a large target's embeddings
/// takes seconds to minutes, even from a slow shared filesystem.
pub const EXPORT_TIMEOUT: Duration = Duration::from_secs(15 * 60);

/// Write the drafter of `checkpoint` to `out` with the worker's export tool; the frozen
/// embeddings come from `target`. Returns the step written.
///
/// The tool runs in a process group of its own with the stop signals ignored, so a Ctrl-C
/// at the terminal (or Slurm's SIGTERM to every process of the job) is the caller's to
/// handle; it dies with the caller (`PR_SET_PDEATHSIG`). It is killed after `limit`, or
/// as soon as `cancel` says so, and what it left half-written is then put right
/// ([`export_dest::recover`]).
pub fn export_checkpoint(
    worker_bin: &Path,
    checkpoint: &Path,
    target: &Path,
    out: &Path,
    limit: Duration,
    cancel: &dyn Fn() -> bool,
) -> Result<u64, ExportError> {
    let mut cmd = std::process::Command::new(worker_bin);
    cmd.arg("export")
        .arg("--checkpoint")
        .arg(checkpoint)
        .arg("--target")
        .arg(target)
        .arg("--out")
        .arg(out);
    // A checkpoint of a run (RUN_DIR/checkpoints/step-N): how its data was rendered.
    let preflight = checkpoint
        .parent()
        .and_then(Path::parent)
        .map(|run| run.join("preflight.json"));
    let rendering = preflight
        .and_then(|p| std::fs::read_to_string(p).ok())
        .and_then(|t| serde_json::from_str(&t).ok())
        .and_then(|v| rendering(&v));
    if let Some(r) = rendering {
        cmd.arg("--rendering").arg(r.to_string());
    }
    shielded_from_stop_signals(&mut cmd);
    let output = match output_until(&mut cmd, limit, cancel) {
        Ok(o) => o,
        Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
            for line in export_dest::recover(out, export_dest::pid_gone) {
                log::info!("{line}");
            }
            return Err(ExportError::Stopped {
                why: format!("the export was stopped ({e})"),
                out: out.to_path_buf(),
            });
        }
        Err(source) => {
            return Err(ExportError::Spawn {
                program: format!("{} export", worker_bin.display()),
                source,
            })
        }
    };
    if !output.status.success() {
        let line = crate::worker_output::error_line(&output.stderr);
        return Err(ExportError::Failed(format!("{line} ({})", output.status)));
    }
    let text = String::from_utf8_lossy(&output.stdout);
    // "drafter of step N written to DIR"
    let step = text
        .split_whitespace()
        .skip_while(|w| *w != "step")
        .nth(1)
        .and_then(|w| w.parse().ok())
        .unwrap_or(0);
    Ok(step)
}

/// `cmd` runs in a process group of its own, ignores SIGINT, SIGTERM and SIGHUP (an
/// ignored signal stays ignored across exec), and gets SIGKILL when this thread ends.
fn shielded_from_stop_signals(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    let parent = std::process::id() as libc::pid_t;
    cmd.process_group(0);
    // SAFETY: the closure runs between fork and exec and makes only async-signal-safe
    // calls (prctl, getppid, signal) and builds an io::Error from a raw errno.
    unsafe {
        cmd.pre_exec(move || {
            dflash_shared::child::die_with(parent)?;
            for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
                libc::signal(sig, libc::SIG_IGN);
            }
            Ok(())
        });
    }
}

/// The checkpoints of a run that verify, newest first, with the reason each one set
/// aside was refused.
pub fn verified_checkpoints(
    run_dir: &Path,
) -> (Vec<(u64, PathBuf)>, Vec<dflash_shared::checkpoint::Refused>) {
    let dir = run_dir.join("checkpoints");
    let mut all: Vec<(u64, PathBuf)> = std::fs::read_dir(&dir)
        .map(|d| {
            d.flatten()
                .filter_map(|e| {
                    let step =
                        dflash_shared::checkpoint::step_of_dir(&e.file_name().to_string_lossy())?;
                    Some((step, e.path()))
                })
                .collect()
        })
        .unwrap_or_default();
    all.sort();
    let (mut good, mut refused) = (Vec::new(), Vec::new());
    for (step, path) in all.into_iter().rev() {
        match dflash_shared::checkpoint::verify(&path, None) {
            Ok(_) => good.push((step, path)),
            Err(e) => refused.push(e),
        }
    }
    (good, refused)
}

/// Run `cmd` (stdin closed) to its end, or kill it after `limit` (an error saying so).
pub fn output_within(
    cmd: &mut std::process::Command,
    limit: std::time::Duration,
) -> std::io::Result<std::process::Output> {
    output_until(cmd, limit, &|| false)
}

/// [`output_within`], and killed too as soon as `cancel` says so (an error saying so).
pub fn output_until(
    cmd: &mut std::process::Command,
    limit: std::time::Duration,
    cancel: &dyn Fn() -> bool,
) -> std::io::Result<std::process::Output> {
    use std::io::Read;
    let mut child = cmd
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    // (A thread that cannot start, at a low `ulimit -u`: the child is killed, and the
    // error is returned, not a panic.)
    let drain = |r: Option<Box<dyn Read + Send>>| {
        std::thread::Builder::new().spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut buf);
            }
            buf
        })
    };
    let drains = drain(
        child
            .stdout
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    )
    .and_then(|out| {
        drain(
            child
                .stderr
                .take()
                .map(|r| Box::new(r) as Box<dyn Read + Send>),
        )
        .map(|err| (out, err))
    });
    let (out, err) = match drains {
        Ok(d) => d,
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            return Err(e);
        }
    };
    let deadline = std::time::Instant::now() + limit;
    let status = loop {
        if let Some(st) = child.try_wait()? {
            break st;
        }
        let late = std::time::Instant::now() >= deadline;
        if late || cancel() {
            let _ = child.kill();
            let _ = child.wait();
            let why = if late {
                format!(
                    "it did not finish within {} and was killed",
                    humantime::format_duration(limit)
                )
            } else {
                "it was cancelled and killed".to_string()
            };
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, why));
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    Ok(std::process::Output {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    })
}

/// How a run's data was rendered, from its preflight.json (`report`): the chat template's
/// SHA-256 and the thinking switch of its chat samples ("on", "off", "template default",
/// or "mixed"), what an export records as `dflash_rendering`. `None` without chat data.
fn rendering(report: &serde_json::Value) -> Option<serde_json::Value> {
    let n = report["chat_samples"].as_u64().unwrap_or(0);
    if n == 0 {
        return None;
    }
    let by = report["thinking"].as_object()?;
    let thinking = match by.keys().map(String::as_str).collect::<Vec<_>>()[..] {
        [one] => one.to_string(),
        _ => "mixed".to_string(),
    };
    Some(serde_json::json!({
        "chat_template_sha256": report["chat_template_sha256"],
        "thinking": thinking,
        "chat_samples": n,
    }))
}
