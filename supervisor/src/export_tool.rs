//! Writing a checkpoint's drafter as a Hugging Face directory, through the worker
//! program's `export` tool (the supervisor links no model code): used by a run's end and
//! by `dflash-supervise export`. A leaf module: it knows nothing of runs or commands.

use std::path::{Path, PathBuf};

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
}

/// Write the drafter of `checkpoint` to `out` with the worker's export tool; the frozen
/// embeddings come from `target`. Returns the step written.
pub fn export_checkpoint(
    worker_bin: &Path,
    checkpoint: &Path,
    target: &Path,
    out: &Path,
) -> Result<u64, ExportError> {
    let mut cmd = std::process::Command::new(worker_bin);
    cmd.arg("export")
        .arg("--checkpoint")
        .arg(checkpoint)
        .arg("--target")
        .arg(target)
        .arg("--out")
        .arg(out);
    // Loading a large target's embeddings takes seconds to minutes, never an hour.
    let output =
        output_within(&mut cmd, std::time::Duration::from_secs(3600)).map_err(|source| {
            ExportError::Spawn {
                program: format!("{} export", worker_bin.display()),
                source,
            }
        })?;
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
    let drain = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut buf);
            }
            buf
        })
    };
    let out = drain(
        child
            .stdout
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    );
    let err = drain(
        child
            .stderr
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    );
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
