//! Real τ during training (`--eval-prompts`): the measurement of a τ step's checkpoint in
//! a child process the dispatcher owns (what is measured and kept:
//! [`crate::training::tau`]).
//!
//! # Why a child beside training
//! A measurement decodes every prompt greedily and speculatively with the target on the
//! CPU (`dflash-worker export` of the checkpoint, then `dflash-worker eval` on the
//! export). Run inside a target worker between batches, a crash or a hang of the decoder
//! would take a training worker with it (a restart, a rollback), and training would wait
//! for it. Run as its own process on the step's checkpoint, it cannot touch training's
//! state: a failure, a crash or a kill after `--eval-timeout` is one warning and that
//! step goes unmeasured; training never waits, except at a finished run's end, where the
//! last step's τ is awaited (bounded by the timeout) so the run's record is complete.
//! The child runs at a lower priority (nice 10), is the OOM killer's first choice
//! (`oom_score_adj` 1000: it holds the target in host memory) and dies with the
//! supervisor (`PR_SET_PDEATHSIG`). One measurement at a time: a τ step whose checkpoint completes
//! while one runs is measured after it if it is still the newest checkpoint.
//!
//! # Cost
//! An eval step is passed over (logged) while the measurements so far took more than
//! [`TAU_SHARE`] of the run's time, so the child competes with training for at most that
//! share of it; the last step is always measured.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dflash_shared::exit_codes;
use serde_json::json;

use super::{obj, Dispatcher, Event, Phase, StopReason};
use crate::export_tool::output_until;
use crate::training::tau::TauResult;

/// Share of the run's time the τ measurements may take.
pub const TAU_SHARE: f64 = 0.10;

/// `--eval-prompts` as the dispatcher runs it.
pub struct TauConfig {
    /// The prompts as token-id lines (RUN_DIR/eval/prompts.jsonl).
    pub prompts: PathBuf,
    pub max_new_tokens: u64,
    pub timeout: Duration,
    /// `--eval-gpu`: decode on this GPU (bf16), else on the CPU.
    pub gpu: Option<u32>,
    /// Where exports and reports go (RUN_DIR/eval).
    pub dir: PathBuf,
}

/// A measurement's end, as its thread sends it.
pub struct TauOutcome {
    pub step: u64,
    pub result: Result<TauResult, String>,
    pub seconds: f64,
}

/// The measurement in flight, if any.
enum Job {
    Idle,
    Running { step: u64, cancel: Arc<AtomicBool> },
}

/// The dispatcher's τ state: its settings, the job, and the time spent measuring.
pub struct TauRunner {
    cfg: TauConfig,
    job: Job,
    busy: Duration,
}

impl TauRunner {
    pub fn new(cfg: TauConfig) -> TauRunner {
        TauRunner {
            cfg,
            job: Job::Idle,
            busy: Duration::ZERO,
        }
    }
}

/// One measurement: which weights, with what.
struct Spec {
    worker_bin: PathBuf,
    target: PathBuf,
    step: u64,
    checkpoint: PathBuf,
    /// An export of that checkpoint already written (the run's end): no export then.
    exported: Option<PathBuf>,
    prompts: PathBuf,
    max_new_tokens: u64,
    gpu: Option<u32>,
    /// The run's target engine (native or torch): the target decodes as it captured.
    engine: &'static str,
    dir: PathBuf,
    deadline: Instant,
}

impl Dispatcher {
    /// Start measuring the newest checkpoint when it is a τ step not measured yet (and
    /// the share allows it); called after every turn while the run runs.
    pub(super) fn maybe_start_tau(&mut self) {
        if !matches!(self.phase, Phase::Running) {
            return;
        }
        let Some(runner) = self.tau.as_ref() else {
            return;
        };
        if !matches!(runner.job, Job::Idle) {
            // A τ step whose checkpoint came while another is measured: said, not measured.
            if let Some((step, running)) = self.trainer.tau_busy() {
                log::info!(
                    "τ of step {step} passed over: the τ of step {running} is still being measured (on CPU workers a measurement takes long: fewer --eval-prompts, a smaller --eval-max-new-tokens or a larger --eval-every)"
                );
                self.run.event(
                    "tau_skipped",
                    obj(json!({"step": step, "measuring": running})),
                );
            }
            return;
        }
        let Some((step, checkpoint)) = self.trainer.tau_wanted(false, false) else {
            return;
        };
        let elapsed = self.now.saturating_duration_since(self.started);
        let last = self.trainer.steps_limit().is_some_and(|n| step >= n);
        if !last && runner.busy.as_secs_f64() > TAU_SHARE * elapsed.as_secs_f64() {
            log::info!(
                "τ of step {step} passed over: the τ evals so far took {:.1} s of the run's {:.1} s (more than {:.0}%)",
                runner.busy.as_secs_f64(),
                elapsed.as_secs_f64(),
                TAU_SHARE * 100.0
            );
            self.trainer.on_tau_failed(step, true);
            return;
        }
        let spec = spec_of(&self.cfg, &runner.cfg, step, checkpoint, None);
        self.trainer.tau_wanted(false, true);
        let cancel = Arc::new(AtomicBool::new(false));
        let (tx, flag) = (self.tx.clone(), cancel.clone());
        log::info!("τ of step {step}: measuring its checkpoint in a child process");
        let spawned = std::thread::Builder::new()
            .name(format!("tau-{step}"))
            .spawn(move || {
                let o = measure(&spec, &flag);
                let _ = tx.send(Event::Tau(o));
            });
        match spawned {
            Ok(_) => {
                if let Some(r) = self.tau.as_mut() {
                    r.job = Job::Running { step, cancel };
                }
            }
            Err(e) => {
                log::warn!(
                    "τ of step {step} not measured: cannot start its thread: {}",
                    crate::nproc::start_failure(&e)
                );
                self.trainer.on_tau_failed(step, false);
            }
        }
    }

    /// A measurement ended: recorded, or one warning; training goes on either way.
    pub(super) fn on_tau(&mut self, o: TauOutcome) {
        if let Some(r) = self.tau.as_mut() {
            if matches!(r.job, Job::Running { step, .. } if step == o.step) {
                r.job = Job::Idle;
            }
            r.busy += Duration::from_secs_f64(o.seconds);
        }
        match o.result {
            Ok(r) => {
                if !self.trainer.on_tau(&r) {
                    return;
                }
                if r.identical_to_greedy < r.prompts {
                    log::warn!(
                        "τ of step {}: speculative decoding wrote other tokens than greedy decoding on {} of {} prompts (a bug; see RUN_DIR/eval)",
                        o.step,
                        r.prompts - r.identical_to_greedy,
                        r.prompts
                    );
                }
                self.run
                    .event("tau", obj(json!({"step": o.step, "tau": r.json()})));
            }
            Err(why) => {
                let on = if matches!(self.phase, Phase::Running) {
                    "; training goes on"
                } else {
                    ""
                };
                log::warn!("τ of step {} not measured: {why}{on}", o.step);
                self.run
                    .event("tau_failed", obj(json!({"step": o.step, "error": why})));
                self.trainer.on_tau_failed(o.step, false);
            }
        }
        self.dirty = true;
    }

    /// The run is over: a measurement in flight is awaited (cancelled first unless the
    /// run finished and it measures the last checkpoint), and a finished run's last
    /// checkpoint, if not measured yet, is measured on the drafter just exported. True
    /// when a τ came in.
    pub(super) fn final_tau(&mut self, reason: &StopReason) -> bool {
        let Some(runner) = self.tau.as_ref() else {
            return false;
        };
        let finished = matches!(reason, StopReason::StepsDone | StopReason::DataDone);
        let mut came = false;
        if let Job::Running { step, cancel } = &runner.job {
            // Only the last checkpoint's measurement of a finished run is worth a wait.
            let newest = self.trainer.last_checkpoint().map(|(s, _)| *s);
            if !finished || newest != Some(*step) {
                cancel.store(true, Ordering::Relaxed);
            }
            let step = *step;
            log::info!("waiting for the τ of step {step}");
            let limit = runner.cfg.timeout + Duration::from_secs(30);
            let since = Instant::now();
            let until = since + limit;
            while let Some(left) = until.checked_duration_since(Instant::now()) {
                self.show_tau_wait(step, since, limit);
                match self.rx.recv_timeout(left.min(Duration::from_secs(1))) {
                    Ok(Event::Tau(o)) => {
                        came |= o.result.is_ok();
                        self.on_tau(o);
                        break;
                    }
                    Ok(_) | Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                    Err(_) => break,
                }
            }
            crate::telemetry::console::status(None);
        }
        if !finished || self.run_dir_gone.is_some() {
            return came;
        }
        let Some((step, checkpoint)) = self.trainer.tau_wanted(true, true) else {
            return came;
        };
        let t = self.trainer.progress();
        let exported = t
            .exported
            .as_ref()
            .filter(|_| t.exported_step == Some(step))
            .map(PathBuf::from);
        let Some(runner) = self.tau.as_ref() else {
            return came;
        };
        log::info!("τ of the last step {step}: measuring it before the run ends");
        let spec = spec_of(&self.cfg, &runner.cfg, step, checkpoint, exported);
        let o = measure(&spec, &AtomicBool::new(false));
        came |= o.result.is_ok();
        self.on_tau(o);
        came
    }
}

impl Dispatcher {
    /// While the run's end waits for the τ of `step` (measured since `since`, for up to
    /// `limit`): the status line says so, and how long it has taken.
    fn show_tau_wait(&self, step: u64, since: Instant, limit: Duration) {
        let t = self.trainer.progress();
        let secs = |d: Duration| humantime::format_duration(Duration::from_secs(d.as_secs()));
        crate::telemetry::console::status(Some(crate::telemetry::console::Status {
            step: t.step,
            total: self.trainer.total_steps(),
            base: self.trainer.base_step(),
            figures: vec![format!(
                "waiting for the τ of step {step}: {} so far (up to {})",
                secs(since.elapsed()),
                secs(limit)
            )],
        }));
    }
}

/// The measurement of `step` from its `checkpoint` (or its `exported` drafter), due
/// `--eval-timeout` from now.
fn spec_of(
    run: &super::Config,
    cfg: &TauConfig,
    step: u64,
    checkpoint: PathBuf,
    exported: Option<PathBuf>,
) -> Spec {
    Spec {
        worker_bin: run.worker_bin.clone(),
        target: run.target_dir.clone(),
        step,
        checkpoint,
        exported,
        prompts: cfg.prompts.clone(),
        max_new_tokens: cfg.max_new_tokens,
        gpu: cfg.gpu,
        engine: run.target_engine,
        dir: cfg.dir.clone(),
        deadline: Instant::now() + cfg.timeout,
    }
}

/// Export the checkpoint (unless exported) and decode the prompts with it: the figures,
/// or why not in one line. The worker's whole report goes to DIR/tau-step-N.json.
fn measure(s: &Spec, cancel: &AtomicBool) -> TauOutcome {
    let t0 = Instant::now();
    let result = export_and_decode(s, cancel);
    let seconds = t0.elapsed().as_secs_f64();
    TauOutcome {
        step: s.step,
        result: result.map(|mut r| {
            r.seconds = seconds;
            r
        }),
        seconds,
    }
}

fn export_and_decode(s: &Spec, cancel: &AtomicBool) -> Result<TauResult, String> {
    let drafter = match &s.exported {
        Some(d) => d.clone(),
        None => {
            let out = s.dir.join("drafter");
            let mut cmd = child(&s.worker_bin);
            cmd.arg("export")
                .arg("--checkpoint")
                .arg(&s.checkpoint)
                .arg("--target")
                .arg(&s.target)
                .arg("--out")
                .arg(&out);
            run(
                &mut cmd,
                "export",
                s.deadline,
                cancel,
                &[exit_codes::SUCCESS],
            )?;
            out
        }
    };
    let mut cmd = child(&s.worker_bin);
    cmd.arg("eval")
        .arg("--target")
        .arg(&s.target)
        .arg("--drafter")
        .arg(&drafter)
        .arg("--prompts")
        .arg(&s.prompts)
        .arg("--max-new-tokens")
        .arg(s.max_new_tokens.to_string())
        .args(["--engine", s.engine])
        .arg("--json");
    if let Some(g) = s.gpu {
        // The child's GPU is its ordinal 0; CUDA numbers GPUs as NVML does.
        cmd.arg("--gpu")
            .env("CUDA_VISIBLE_DEVICES", g.to_string())
            .env("CUDA_DEVICE_ORDER", "PCI_BUS_ID");
    }
    // Exit 1: decoded, but not as greedy decoding did on some prompt (said by the caller).
    let ok = [exit_codes::SUCCESS, exit_codes::RUN_FAILED];
    let stdout = run(&mut cmd, "eval", s.deadline, cancel, &ok)?;
    let report = s.dir.join(format!("tau-step-{:08}.json", s.step));
    if let Err(e) = std::fs::write(&report, &stdout) {
        log::warn!("cannot write {}: {e}", report.display());
    }
    TauResult::parse(s.step, &stdout, 0.0).map_err(|e| e.to_string())
}

/// The worker program as a τ child: at nice 10, the kernel's first choice when memory
/// runs out (it holds a copy of the target in host memory: the OOM killer must take it,
/// never a training worker), killed when the supervisor dies.
fn child(worker_bin: &Path) -> std::process::Command {
    let mut cmd = std::process::Command::new(worker_bin);
    // SAFETY: the closure runs between fork and exec and makes only async-signal-safe
    // calls (prctl, nice, open, write, close) on a static path and bytes; their failures
    // are ignored (a τ child that outlives a killed supervisor ends by itself, at its
    // timeout at most; one the OOM killer does not prefer is still a separate process).
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            );
            libc::nice(10);
            let fd = libc::open(c"/proc/self/oom_score_adj".as_ptr(), libc::O_WRONLY);
            if fd >= 0 {
                libc::write(fd, b"1000".as_ptr().cast(), 4);
                libc::close(fd);
            }
            Ok(())
        });
    }
    cmd
}

/// Run a τ child to its end (by `deadline`, unless cancelled): its stdout when it exits
/// with one of `ok`, else its error line.
fn run(
    cmd: &mut std::process::Command,
    what: &str,
    deadline: Instant,
    cancel: &AtomicBool,
    ok: &[i32],
) -> Result<String, String> {
    let limit = deadline.saturating_duration_since(Instant::now());
    let out = output_until(cmd, limit, &|| cancel.load(Ordering::Relaxed))
        .map_err(|e| format!("dflash-worker {what}: {e}"))?;
    match out.status.code() {
        Some(c) if ok.contains(&c) => Ok(String::from_utf8_lossy(&out.stdout).into_owned()),
        _ => Err(format!(
            "dflash-worker {what}: {} ({})",
            crate::worker_output::error_line(&out.stderr),
            crate::run::process::describe_status(&out.status)
        )),
    }
}
