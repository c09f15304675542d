//! `--wandb-project`: the supervisor runs the W&B bridge (`scripts/wandb_bridge.py`, built
//! into the binary and written to RUN_DIR/wandb_bridge.py) as a child it owns. The bridge
//! follows train.jsonl and metrics.jsonl and logs them to one W&B run whose id it keeps in
//! RUN_DIR/wandb.json, so a `--resume` continues that run. A bridge that dies is started
//! again (it continues from RUN_DIR/wandb.json) after [`RESTART_AFTER`], up to
//! [`MAX_RESTARTS`] times; training never waits for it. At the run's end the bridge logs
//! the files' tail by itself (it sees the run's lock released) and exits.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::error::Error;

/// The bridge, as the binary carries it.
const SCRIPT: &str = include_str!("../../../scripts/wandb_bridge.py");

/// Wait before starting a bridge that died again.
pub const RESTART_AFTER: Duration = Duration::from_secs(5);
/// Restarts of the bridge before the run goes on without W&B.
pub const MAX_RESTARTS: u32 = 10;

/// `--wandb-project`, `--wandb-name`, `--wandb-mode`.
#[derive(Debug, Clone)]
pub struct WandbArgs {
    pub project: String,
    pub name: Option<String>,
    pub mode: Option<String>,
}

/// Where the bridge is in its life.
enum State {
    Running(Child),
    /// Died; started again at `at`.
    Waiting {
        at: Instant,
    },
    /// Died too often: the run goes on without it.
    GivenUp,
}

pub struct Bridge {
    args: WandbArgs,
    run_dir: PathBuf,
    script: PathBuf,
    state: State,
    restarts: u32,
}

/// Why the bridge cannot run on this machine.
#[derive(Debug, thiserror::Error)]
pub enum WandbUnavailable {
    #[error("python3 cannot be run ({0}); the W&B bridge needs python3 with the wandb package (pip install wandb)")]
    NoPython(std::io::Error),
    #[error("python3 cannot import the wandb package ({reason}); the W&B bridge needs it (pip install wandb)")]
    NoPackage { reason: String },
}

/// Imports wandb as the bridge will: the current directory, which `python3 -c` puts first
/// on `sys.path` and the bridge (a script in RUN_DIR) does not, is left out, so a `./wandb`
/// there (the directory W&B's offline mode writes, or a stray `wandb.py`) neither passes
/// for the package nor hides it. A namespace package (a bare directory named wandb
/// elsewhere on the path) is not the package either.
const PROBE: &str = r#"import sys
if sys.path and sys.path[0] == "":
    del sys.path[0]
try:
    import wandb
except Exception as e:
    sys.exit(f"{type(e).__name__}: {e}".replace("\n", " "))
if getattr(wandb, "__file__", None) is None or not hasattr(wandb, "init"):
    sys.exit("the wandb found at " + ", ".join(getattr(wandb, "__path__", [])) + " is a directory, not the package")
"#;

/// Refuse `--wandb-project` where the bridge cannot run (no python3 with wandb), before
/// the run starts.
pub fn check(a: &WandbArgs) -> Result<(), Error> {
    probe(Command::new("python3"), None).map_err(|e| Error::Unavailable {
        what: format!("--wandb-project {}", a.project),
        source: Box::new(e),
    })
}

/// Whether the python3 `cmd` runs, in `cwd` (else this process's), has the wandb package.
fn probe(mut cmd: Command, cwd: Option<&Path>) -> Result<(), WandbUnavailable> {
    cmd.args(["-c", PROBE])
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    if let Some(d) = cwd {
        cmd.current_dir(d);
    }
    let out = cmd.output().map_err(WandbUnavailable::NoPython)?;
    if out.status.success() {
        return Ok(());
    }
    let err = String::from_utf8_lossy(&out.stderr);
    let reason = err
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .map(|l| l.chars().take(300).collect())
        .unwrap_or_else(|| format!("python3 exited with {}", out.status));
    Err(WandbUnavailable::NoPackage { reason })
}

impl Bridge {
    /// Write the bridge into `run_dir` and start it.
    pub fn start(args: WandbArgs, run_dir: &Path) -> Result<Bridge, Error> {
        let script = run_dir.join("wandb_bridge.py");
        std::fs::write(&script, SCRIPT).map_err(|e| Error::io("cannot write", &script, e))?;
        let mut b = Bridge {
            args,
            run_dir: run_dir.to_path_buf(),
            script,
            state: State::GivenUp,
            restarts: 0,
        };
        b.state = State::Running(b.spawn()?);
        log::info!(
            "W&B: project {}, logged by {} (its log: logs/wandb.log)",
            b.args.project,
            b.script.display()
        );
        Ok(b)
    }

    fn spawn(&self) -> Result<Child, Error> {
        let logs = self.run_dir.join("logs");
        let _ = std::fs::create_dir_all(&logs);
        let path = logs.join("wandb.log");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| Error::io("cannot write", &path, e))?;
        let err = log
            .try_clone()
            .map_err(|e| Error::io("cannot write", &path, e))?;
        let mut cmd = Command::new("python3");
        // Its own process group: a Ctrl-C at the terminal stops the run, and the bridge
        // still logs the run's last records (it sees the run end) before it exits.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        cmd.arg(&self.script)
            .arg(&self.run_dir)
            .args(["--project", &self.args.project])
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err);
        if let Some(n) = &self.args.name {
            cmd.args(["--name", n]);
        }
        if let Some(m) = &self.args.mode {
            cmd.env("WANDB_MODE", m);
        }
        cmd.spawn()
            .map_err(|e| Error::start("the W&B bridge (python3)", e))
    }

    /// Look after the bridge (from the dispatcher's timers): a bridge that exited is
    /// started again after a while, unless the run is `ending` (a bridge that ends with
    /// the run has done its work).
    pub fn tend(&mut self, ending: bool) {
        match &mut self.state {
            State::Running(c) => match c.try_wait() {
                Ok(Some(status)) if !ending => {
                    self.restarts += 1;
                    if self.restarts > MAX_RESTARTS {
                        log::warn!("the W&B bridge exited ({status}) {MAX_RESTARTS} times; the run goes on without W&B (see logs/wandb.log)");
                        self.state = State::GivenUp;
                    } else {
                        log::warn!(
                            "the W&B bridge exited ({status}); starting it again in {} s (restart {} of {MAX_RESTARTS}; see logs/wandb.log)",
                            RESTART_AFTER.as_secs(),
                            self.restarts
                        );
                        self.state = State::Waiting {
                            at: Instant::now() + RESTART_AFTER,
                        };
                    }
                }
                _ => {}
            },
            State::Waiting { at } if !ending && Instant::now() >= *at => match self.spawn() {
                Ok(c) => self.state = State::Running(c),
                Err(e) => {
                    log::warn!("{e}; the run goes on without W&B");
                    self.state = State::GivenUp;
                }
            },
            _ => {}
        }
    }

    /// The bridge's pid while it runs.
    pub fn pid(&self) -> Option<u32> {
        match &self.state {
            State::Running(c) => Some(c.id()),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `python` has the real wandb package: imported from an empty directory.
    fn wandb_installed(python: &[&str]) -> bool {
        let empty = tempfile::tempdir().unwrap();
        let check = "import wandb, sys; sys.exit(0 if getattr(wandb, '__file__', None) and hasattr(wandb, 'init') else 1)";
        Command::new(python[0])
            .args(&python[1..])
            .args(["-c", check])
            .current_dir(empty.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// What is in the current directory does not decide the check: an empty `wandb/`
    /// (what W&B's offline mode leaves there) does not pass for a missing package, and a
    /// `wandb.py` that fails does not hide an installed one. Both with python3 as it is
    /// and without its site-packages (`-S`: no wandb there, whatever this machine has).
    #[test]
    fn a_wandb_directory_or_file_in_the_current_directory_does_not_decide_the_check() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("wandb")).unwrap();
        let file = tempfile::tempdir().unwrap();
        std::fs::write(
            file.path().join("wandb.py"),
            "raise ImportError('a stray wandb.py')\n",
        )
        .unwrap();
        let mut missing_seen = false;
        for python in [&["python3"][..], &["python3", "-S"]] {
            let installed = wandb_installed(python);
            missing_seen |= !installed;
            for cwd in [dir.path(), file.path()] {
                let mut cmd = Command::new(python[0]);
                cmd.args(&python[1..]);
                let r = probe(cmd, Some(cwd));
                assert_eq!(
                    r.is_ok(),
                    installed,
                    "{python:?} in {} (wandb installed: {installed}): {r:?}",
                    cwd.display()
                );
                if let Err(e) = r {
                    let e = e.to_string();
                    assert!(!e.contains('\n') && e.contains("pip install wandb"), "{e}");
                }
            }
        }
        assert!(missing_seen, "python3 -S found a wandb package");
    }
}
