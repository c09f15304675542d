//! A training run: from the command line to the workers and back.
//!
//! [`run`] checks every flag and input, lays out the run directory and the data plane, and
//! hands over to the [`dispatcher`], the one owner of the run's state. The dispatcher's
//! helpers live beside it: [`process`] (spawning into process groups, pidfds),
//! [`control`] (one control channel per worker life), [`restart`] (backoff),
//! [`reaper`] (no process outlives a killed supervisor), [`worker_log`], [`rundir`]
//! (state.json, events.jsonl) and [`root_cause`] (the report when the budget is spent).

pub mod balance;
pub mod config_file;
pub mod control;
pub mod dispatcher;
pub mod engine;
pub mod gpu_fit;
pub mod init_drafter;
pub mod node;
pub mod process;
pub mod reaper;
pub mod restart;
pub mod root_cause;
pub mod rundir;
pub mod target_check;
pub mod validate;
pub mod worker_log;

use std::path::{Path, PathBuf};

use dflash_shared::batch::{CaptureSpec, DTYPE_BF16};
use dflash_shared::drafter::{CollectiveKind, DrafterConfig};
use dflash_shared::model_config::{default_draft_layers, target_layer_ids, TargetConfig};
use dflash_shared::{Device, DeviceSpec, Role, WorkerName};

use crate::cli::{RunArgs, Targets};
use crate::data::{loader, pipeline, preflight};
use crate::error::Error;
use crate::telemetry::{console, gpus, prometheus};
use crate::training::{resume, schedule, trainer};

/// Which worker runs where: targets first, then drafters, ranks from 0 in device order
/// (a target worker holding several GPUs is placed on its first: [`placement`]).
pub fn plan(
    args: &RunArgs,
    gpu_count: &mut dyn FnMut() -> Result<u32, gpus::NvmlUnavailable>,
) -> Result<Vec<(WorkerName, Device)>, Error> {
    Ok(placement(args, gpu_count)?.workers)
}

/// What `plan` needs of a run's settings, resolved as the run resolves them.
pub struct PlanSettings {
    pub target: TargetConfig,
    pub drafter: DrafterConfig,
    pub taps: Vec<u32>,
    pub token_budget: u32,
}

/// The target, the drafter, the taps and the token budget of a run of `args` (with the
/// split its `--targets` asks for), without starting anything.
pub fn plan_settings(args: &RunArgs) -> Result<PlanSettings, Error> {
    let target = match target_config(&args.target) {
        Err(_) if args.target != "tiny" => TargetConfig::load_any(Path::new(&args.target))
            .map_err(|e| Error::input(format!("--target {}", args.target), e))?,
        r => r?,
    };
    let placed = placement(args, &mut gpus::gpu_count)?;
    let (_, pipeline) = data_config(args, &placed.workers, &target)?;
    let trainer = trainer_config(args, &placed.workers, &target, &pipeline.capture)?;
    Ok(PlanSettings {
        target,
        drafter: trainer.drafter,
        taps: pipeline.capture.tap_ids,
        token_budget: pipeline.token_budget,
    })
}

/// The split a run starts with: without `--targets`, its default ([`default_split`]);
/// for `--targets auto` without a start, the targets it starts with. A resumed run
/// (`resumed`, its directory) takes up the split it had when it stopped, where that fits
/// the devices; else the split at which the roles' FLOPs per token balance (`plan`'s
/// roofline split). Returns the line that says so, for the run's settled lines.
fn auto_start(
    args: &mut RunArgs,
    resumed: Option<&Path>,
    probe: &mut dyn FnMut() -> Result<u32, gpus::NvmlUnavailable>,
) -> Result<Option<String>, Error> {
    let devices = placement(args, probe)?.workers.len();
    let defaulted = args.targets.is_none();
    if defaulted {
        args.targets = Some(default_split(args, devices));
    }
    let Some(Targets::Auto { start: None }) = args.targets else {
        return Ok(None);
    };
    let flag = match defaulted {
        true => "--targets auto (the default on 3 or more devices; --targets N pins the split)",
        false => "--targets auto",
    };
    let before = resumed.and_then(|d| targets_when_stopped(&d.join(rundir::EVENTS_FILE)));
    let (n, line) = match before.filter(|&n| n >= 1 && n < devices) {
        Some(n) => (
            n,
            format!(
                "{flag}: starting with {n} target(s) and {} drafter(s), the split the run had when it stopped",
                devices - n
            ),
        ),
        None => {
            let s = plan_settings(args)?;
            let (tf, df) = balance::flops_per_token(
                &args.target,
                (&s.target, &s.drafter),
                &s.taps,
                args.max_seq_len,
            )?;
            let n = balance::start_targets(devices, tf, df);
            (
                n,
                format!(
                    "{flag}: starting with {n} target(s) and {} drafter(s), where the roles' FLOPs per token balance (as `plan` estimates them); devices move between the roles as the run measures them",
                    devices - n
                ),
            )
        }
    };
    args.targets = Some(Targets::Auto {
        start: Some(n as u32),
    });
    Ok(Some(line))
}

/// The split of a run without `--targets`: auto where there is a split to choose (3 or
/// more devices, each target on one GPU, the roles not given device by device), else 1.
fn default_split(args: &RunArgs, devices: usize) -> Targets {
    match args.gpus_per_target > 1 || args.target_gpus.is_some() || devices < 3 {
        true => Targets::Fixed(1),
        false => Targets::Auto { start: None },
    }
}

/// The target workers a run had when it stopped, from its events.jsonl: those its last
/// session started with, and each move since (`None`: no session recorded).
fn targets_when_stopped(events: &Path) -> Option<usize> {
    let (events, _) = rundir::read_jsonl(events);
    let start = events.iter().rposition(|e| e["event"] == "run_start")?;
    let workers = events[start]["workers"].as_array()?;
    // "target-0 on 3": the name first.
    let role = |w: &serde_json::Value| {
        let name = w.as_str()?.split_whitespace().next()?;
        Some(name.parse::<WorkerName>().ok()?.role)
    };
    let mut n = workers
        .iter()
        .filter(|w| role(w) == Some(Role::Target))
        .count();
    for e in events[start..].iter().filter(|e| e["event"] == "role_move") {
        match role(&e["to"]) {
            Some(Role::Target) => n += 1,
            Some(Role::Drafter) => n = n.saturating_sub(1),
            None => {}
        }
    }
    Some(n)
}

/// Where the workers run: each worker's device, and the GPUs of each target worker that
/// holds more than one (`--gpus-per-target`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub workers: Vec<(WorkerName, Device)>,
    /// Per target rank, its GPUs in order (its device first): empty for one device.
    pub target_spans: Vec<Vec<u32>>,
}

/// [`plan`], with the GPUs of each target worker.
pub fn placement(
    args: &RunArgs,
    gpu_count: &mut dyn FnMut() -> Result<u32, gpus::NvmlUnavailable>,
) -> Result<Placement, Error> {
    let per = args.gpus_per_target as usize;
    if per == 0 {
        return Err(Error::Flag(
            "--gpus-per-target 0: a target worker needs a device (expected 1 or more)".into(),
        ));
    }
    let (targets, drafters) = role_devices(args, per, gpu_count)?;
    if per > 1 && targets.iter().any(|d| matches!(d, Device::Cpu)) {
        return Err(Error::Flag(format!(
            "--gpus-per-target {per}: CPU workers have no GPUs to spread a target over (expected 1 with cpu:N)"
        )));
    }
    let spans: Vec<Vec<u32>> = targets
        .chunks(per)
        .map(|c| {
            c.iter()
                .filter_map(|d| match d {
                    Device::Gpu(g) if per > 1 => Some(*g),
                    _ => None,
                })
                .collect()
        })
        .collect();
    let targets: Vec<Device> = targets.chunks(per).map(|c| c[0]).collect();
    let named = |role, devs: Vec<Device>| {
        devs.into_iter().enumerate().map(move |(rank, d)| {
            (
                WorkerName {
                    role,
                    rank: rank as u32,
                },
                d,
            )
        })
    };
    Ok(Placement {
        workers: named(Role::Target, targets)
            .chain(named(Role::Drafter, drafters))
            .collect(),
        target_spans: spans,
    })
}

/// The devices of the target workers (`per` for each) and of the drafters, from
/// `--target-gpus`/`--drafter-gpus` or from `--gpus` and `--targets`.
fn role_devices(
    args: &RunArgs,
    per: usize,
    gpu_count: &mut dyn FnMut() -> Result<u32, gpus::NvmlUnavailable>,
) -> Result<(Vec<Device>, Vec<Device>), Error> {
    // Asked once, its answer shared by every flag that needs it.
    type Count = Result<u32, std::rc::Rc<gpus::NvmlUnavailable>>;
    let mut cached: Option<Count> = None;
    let mut probe = move || {
        cached
            .get_or_insert_with(|| gpu_count().map_err(std::rc::Rc::new))
            .clone()
    };
    let resolve = |spec: &DeviceSpec, flag: &str, gpus: &mut dyn FnMut() -> Count| {
        let n = match spec {
            DeviceSpec::Cpu(_) => Ok(0),
            _ => gpus(),
        };
        spec.resolve(n, flag).map_err(Error::from)
    };
    if let (Some(t), Some(d)) = (&args.target_gpus, &args.drafter_gpus) {
        let t = resolve(t, "--target-gpus", &mut probe)?;
        if t.len() % per != 0 {
            let expected = match t.len() / per {
                0 => format!("at least {per} GPUs"),
                k => format!("{} or {} GPUs", k * per, (k + 1) * per),
            };
            return Err(Error::Flag(format!(
                "--gpus-per-target {per}: --target-gpus gives {} device(s), not a multiple of {per} (expected {expected} for the targets)",
                t.len(),
            )));
        }
        return Ok((t, resolve(d, "--drafter-gpus", &mut probe)?));
    }
    let spec = match &args.gpus {
        Some(s) => s.clone(),
        None => match probe() {
            Ok(n) if n > 0 => DeviceSpec::All,
            _ => DeviceSpec::Cpu(2),
        },
    };
    let flag = if args.gpus.is_some() {
        "--gpus"
    } else {
        "default devices"
    };
    let devices = resolve(&spec, flag, &mut probe)?;
    let n = match args.split() {
        Targets::Fixed(n) => n as usize,
        Targets::Auto { .. } if per > 1 => {
            return Err(Error::Flag(format!(
                "--targets auto --gpus-per-target {per}: the split is only balanced for targets on one GPU each (expected --targets N with --gpus-per-target)"
            )))
        }
        // The balancer moves devices from there (see `balance`).
        Targets::Auto { start } => start.unwrap_or(1) as usize,
    };
    if n == 0 {
        return Err(Error::Flag(
            "--targets 0: at least one target worker is needed (expected 1 or more)".into(),
        ));
    }
    if per > 1 && n * per >= devices.len() {
        let most = match devices.len().saturating_sub(1) / n {
            0 | 1 => format!("more devices than --targets {n}, each target on one GPU"),
            m => format!("at most --gpus-per-target {m} with --targets {n}"),
        };
        return Err(Error::Flag(format!(
            "--targets {n} --gpus-per-target {per} takes {} of the {} device(s) and leaves no drafter (expected targets × GPUs per target below the device count: {most})",
            n * per,
            devices.len(),
        )));
    }
    if n >= devices.len() {
        return Err(Error::Flag(format!(
            "--targets {n} leaves no drafter among {} device(s) (expected fewer targets than devices; \
             to share one GPU give --target-gpus 0 --drafter-gpus 0)",
            devices.len()
        )));
    }
    Ok((devices[..n * per].to_vec(), devices[n * per..].to_vec()))
}

pub(crate) fn resolve_worker_bin(given: Option<&Path>) -> Result<PathBuf, Error> {
    use std::os::unix::fs::PermissionsExt;
    let (path, what) = match given {
        Some(p) => (p.to_path_buf(), format!("--worker-bin {}", p.display())),
        None => {
            let exe = std::env::current_exe().map_err(|e| {
                Error::io(
                    "cannot find where dflash-supervise runs from:",
                    "/proc/self/exe",
                    e,
                )
            })?;
            let p = exe.with_file_name("dflash-worker");
            let what = format!("dflash-worker beside dflash-supervise ({})", p.display());
            (p, what)
        }
    };
    let meta = std::fs::metadata(&path).map_err(|e| {
        Error::input(format!("{what} (expected the dflash-worker program; install both binaries or pass --worker-bin PATH)"), e)
    })?;
    if !meta.is_file() || meta.permissions().mode() & 0o111 == 0 {
        return Err(Error::Flag(format!(
            "{what}: not an executable file (expected the dflash-worker program)"
        )));
    }
    path.canonicalize().map_err(|e| Error::input(what, e))
}

/// What a start has made so far, undone when it fails or a stop signal comes first: a
/// failed or interrupted start leaves no half-made run directory behind.
struct Setup {
    /// Installed first thing, so that a Ctrl-C during the start is seen (and handed to
    /// the dispatcher's signal thread once the run is going).
    signals: signal_hook::iterator::Signals,
    /// A run directory this start created (or found empty), and a copy of `--data`.
    created: Option<(PathBuf, bool)>,
    spool: Option<PathBuf>,
    /// A SIGUSR1 came during the start: handed to the run once it is going.
    usr1: bool,
    /// `--resume-if-exists` found a run that never wrote a checkpoint in the run directory:
    /// moved aside only once the new run's start is checked, and back if it then fails.
    set_aside: Option<SetAside>,
}

/// A run directory with nothing to resume, in the way of a new run at its path.
enum SetAside {
    /// To be moved aside when the new run's directory is made.
    Pending(PathBuf),
    /// Moved: where from, and where to.
    Moved { from: PathBuf, to: PathBuf },
}

impl Setup {
    /// A stop signal that came during the start, if one did.
    fn interrupted(&mut self) -> Option<&'static str> {
        use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM, SIGUSR1};
        let mut stop = None;
        for sig in self.signals.pending() {
            match sig {
                SIGINT => stop = Some("SIGINT"),
                SIGTERM => stop = Some("SIGTERM"),
                SIGHUP => stop = Some("SIGHUP"),
                // A pre-emption notice: honoured once the run is going (a checkpoint at
                // its first committed step).
                SIGUSR1 => {
                    if !self.usr1 {
                        log::info!("SIGUSR1 received while starting: a checkpoint will be written at the first committed step");
                    }
                    self.usr1 = true;
                }
                // SIGUSR2: no worker to forward it to yet.
                _ => log::info!("signal {sig} received while starting: no worker to forward it to"),
            }
        }
        stop
    }

    fn check(&mut self) -> Result<(), Error> {
        match self.interrupted() {
            Some(signal) => Err(Error::Interrupted {
                signal,
                removed: self.created.as_ref().map(|(p, _)| p.clone()),
            }),
            None => Ok(()),
        }
    }

    /// Remove what this start made.
    fn undo(&mut self) {
        if let Some(p) = self.spool.take() {
            let _ = std::fs::remove_file(p);
        }
        if let Some((dir, existed)) = self.created.take() {
            if existed {
                // An empty directory the user made: emptied again, kept.
                if let Ok(entries) = std::fs::read_dir(&dir) {
                    for e in entries.flatten() {
                        let p = e.path();
                        let _ = if p.is_dir() {
                            std::fs::remove_dir_all(&p)
                        } else {
                            std::fs::remove_file(&p)
                        };
                    }
                }
            } else {
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
        // The run that was moved aside for this start goes back where it was.
        if let Some(SetAside::Moved { from, to }) = self.set_aside.take() {
            if !from.exists() && std::fs::rename(&to, &from).is_ok() {
                log::info!("moved {} back to {}", to.display(), from.display());
            }
        }
    }
}

pub fn run(args: RunArgs, given: &[String]) -> Result<i32, Error> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM, SIGUSR1, SIGUSR2};
    let signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2])
        .map_err(|e| Error::start("signal handlers", e))?;
    let mut setup = Setup {
        signals,
        created: None,
        spool: None,
        usr1: false,
        set_aside: None,
    };
    match start(args, given, &mut setup) {
        Ok(Started::Run(d)) => {
            // The pre-emption notice of the start (the signal thread takes the rest).
            if setup.usr1 {
                let _ = d.events().send(dispatcher::Event::Signal(SIGUSR1));
            }
            start_signal_thread(d.events(), setup.signals)?;
            Ok(d.run())
        }
        Ok(Started::Finished(msg)) => {
            crate::say!("dflash-supervise: {msg}");
            Ok(dflash_shared::exit_codes::SUCCESS)
        }
        Err(e) => {
            setup.undo();
            Err(e)
        }
    }
}

/// `--init-drafter DIR`: its config read and the settings it fixes taken where no flag
/// gives them (with the flags it was given, for [`check_init_drafter`]). A resumed run (of
/// `--resume-if-exists`; `--resume` refuses the flag) continues its own weights.
fn read_init_drafter(
    args: &mut RunArgs,
    resumed: bool,
) -> Result<Option<(init_drafter::InitDrafter, init_drafter::Given)>, Error> {
    let Some(dir) = args.init_drafter.clone() else {
        return Ok(None);
    };
    if resumed {
        log::info!(
            "--init-drafter {}: not used, the resumed run continues its own weights",
            dir.display()
        );
        args.init_drafter = None;
        return Ok(None);
    }
    let init = init_drafter::InitDrafter::read(&dir)
        .map_err(|e| Error::input(format!("--init-drafter {}", dir.display()), e))?;
    let given = init.adopt(args);
    Ok(Some((init, given)))
}

/// The drafter this run trains against the init drafter's config (every difference named
/// in one line, exit 2); the workers are told to load its weights. Returns run.json's
/// record of it (`None` without `--init-drafter`).
fn check_init_drafter(
    init: Option<&(init_drafter::InitDrafter, init_drafter::Given)>,
    trainer_cfg: &mut trainer::TrainerConfig,
    capture: &CaptureSpec,
) -> Result<Option<serde_json::Value>, Error> {
    let Some((init, given)) = init else {
        return Ok(None);
    };
    let input = || format!("--init-drafter {}", init.dir.display());
    init.check(&trainer_cfg.drafter, &capture.tap_ids, *given)
        .map_err(|e| Error::input(input(), e))?;
    let record = init.record().map_err(|e| Error::input(input(), e))?;
    // Absolute: the workers run elsewhere.
    trainer_cfg.init_drafter = Some(std::fs::canonicalize(&init.dir).unwrap_or(init.dir.clone()));
    Ok(Some(record))
}

/// The target's config.json, its checkpoint checked, and the engine that runs it (with the
/// start's line saying which; `auto` resolved in `args`). An architecture the native
/// engine does not serve is read for the torch engine ([`TargetConfig::read_any`]).
fn target_and_engine(
    args: &mut RunArgs,
    plan: &[(WorkerName, Device)],
    resumed: bool,
) -> Result<(TargetConfig, String), Error> {
    use dflash_shared::model_config::{ConfigError, ConfigProblem};
    let input = |e: ConfigError| Error::input(format!("--target {}", args.target), e);
    let target_cfg = match target_config(&args.target) {
        Err(_) if args.target != "tiny" => {
            let dir = Path::new(&args.target);
            match TargetConfig::load(dir) {
                Err(ConfigError {
                    problem: ConfigProblem::Architecture { .. },
                    ..
                }) => TargetConfig::load_any(dir).map_err(input)?,
                r => r.map_err(input)?,
            }
        }
        r => r?,
    };
    if args.target != "tiny" && target_cfg.arch != dflash_shared::model_config::Arch::Transformers {
        target_check::check(Path::new(&args.target), &target_cfg)
            .map_err(|e| Error::input(format!("--target {}", args.target), e))?;
    }
    let (engine, mut line) = engine::choose(
        args.target_engine,
        args.gpus_per_target,
        (
            &target_cfg,
            (args.target != "tiny").then(|| Path::new(&args.target)),
        ),
    )?;
    if engine == "torch" {
        args.target_engine = crate::cli::TargetEngine::Torch;
    }
    if plan.iter().any(|(_, d)| matches!(d, Device::Gpu(_))) {
        line.push_str("; workers on GPUs compute on their GPU (CUDA): the target forward, the drafter's forward, backward and optimizer step");
    }
    if args.gpus_per_target > 1 && args.eval_prompts.is_some() {
        line.push_str("; τ during the run (--eval-prompts) decodes the whole target in one process, on one GPU (--eval-gpu) or the CPU: a target that needs several GPUs will not fit there; measure it after the run with eval --gpus over several GPUs");
    }
    // The MASK token's default by the target's tokenizer, for a new run: recorded in
    // run.json as if given, so a resume keeps it (a run of an older version, resumed,
    // keeps the first rule, DrafterConfig::for_target's).
    if args.mask_token_id.is_none() && args.target != "tiny" && !resumed {
        let dir = args.tokenizer.as_deref().unwrap_or(Path::new(&args.target));
        let m = dflash_shared::mask_token::default_mask_token(Some(dir), target_cfg.vocab_size);
        args.mask_token_id = Some(m.id);
    }
    Ok((target_cfg, line))
}

/// The start's lines about settings it chose, said once the run directory is the run's.
fn say_settled(lines: &[Option<String>], schedule_line: &str, target: &TargetConfig) {
    for line in lines.iter().flatten() {
        log::info!("{line}");
    }
    log::info!("{schedule_line}");
    log::info!("target: {}", target.describe());
}

/// `--init-drafter`'s line, when the drafter starts from one.
fn init_line(trainer_cfg: &trainer::TrainerConfig) -> Option<String> {
    trainer_cfg.init_drafter.as_ref().map(|d| {
        format!(
            "--init-drafter {}: the drafter starts from its weights (fresh optimizer, step 0)",
            d.display()
        )
    })
}

/// What a start comes to.
enum Started {
    Run(Box<dispatcher::Dispatcher>),
    /// `--resume` of a run that already ended by itself: nothing to do, said in words.
    Finished(String),
}

/// The run directory of `--run-dir D --resume-if-exists`: `D` when it holds a run to
/// resume (`Some`), else `None` (a new run is started there). A run that never wrote a
/// checkpoint has nothing to resume: it is to be moved aside (`D.attempt-MS`, noted in
/// `setup`) so that the new run can have `D`, once everything that can refuse the new
/// run's start was checked (see [`open_run_dir`]): a start refused leaves it where it is.
fn existing_run(dir: &Path, setup: &mut Setup) -> Result<Option<PathBuf>, Error> {
    if !dir.join(resume::RUN_FILE).is_file() {
        log::info!(
            "--resume-if-exists: no run in {} yet: starting one",
            dir.display()
        );
        return Ok(None);
    }
    let has_checkpoint = std::fs::read_dir(dir.join("checkpoints"))
        .into_iter()
        .flatten()
        .flatten()
        .any(|e| {
            dflash_shared::checkpoint::step_of_dir(&e.file_name().to_string_lossy()).is_some()
                && e.path()
                    .join(dflash_shared::checkpoint::META_FILE)
                    .is_file()
        });
    if has_checkpoint {
        log::info!(
            "--resume-if-exists: {} holds a run: resuming it",
            dir.display()
        );
        return Ok(Some(dir.to_path_buf()));
    }
    let existing = rundir::ExistingRun {
        path: dir.to_path_buf(),
    };
    if existing.supervisor_alive() {
        return Err(Error::Flag(format!(
            "--run-dir {}: another supervisor is using it (expected a stopped run or a new directory)",
            dir.display()
        )));
    }
    setup.set_aside = Some(SetAside::Pending(dir.to_path_buf()));
    Ok(None)
}

/// Move aside the run directory [`existing_run`] found with nothing to resume (if any):
/// the new run takes its path now.
fn set_aside_unresumable(setup: &mut Setup) -> Result<(), Error> {
    let Some(SetAside::Pending(dir)) = setup.set_aside.take() else {
        return Ok(());
    };
    let aside = PathBuf::from(format!("{}.attempt-{}", dir.display(), rundir::unix_ms()));
    std::fs::rename(&dir, &aside).map_err(|e| Error::io("cannot move aside", &dir, e))?;
    log::warn!(
        "--resume-if-exists: {} holds a run that never wrote a checkpoint (stopped before its first step): moved to {} and starting anew",
        dir.display(),
        aside.display()
    );
    setup.set_aside = Some(SetAside::Moved {
        from: dir,
        to: aside,
    });
    Ok(())
}

/// NVML's GPU count, asked once (the split's default and the placement both need it).
fn counted_gpus() -> impl FnMut() -> Result<u32, gpus::NvmlUnavailable> {
    let mut counted = None;
    move || match counted {
        Some(n) => Ok(n),
        None => Ok(*counted.insert(gpus::gpu_count()?)),
    }
}

/// Everything before the dispatcher runs: flags, inputs, the run dir, the data plane.
fn start(mut args: RunArgs, given: &[String], setup: &mut Setup) -> Result<Started, Error> {
    let node = node::place(&mut args)?;
    let resume = settle_flags(&mut args, given, setup)?;
    let init = read_init_drafter(&mut args, resume.is_some())?;
    setup.check()?;
    let adapted = validate::adapt_max_seq_len(&mut args, given);
    validate::check_flags(&args)?;
    let worker_bin = resolve_worker_bin(args.worker_bin.as_deref())?;
    let mut probe = counted_gpus();
    let split_line = auto_start(&mut args, resume.as_ref().map(|r| &*r.dir), &mut probe)?;
    let placed = placement(&args, &mut probe)?;
    let plan = placed.workers.clone();
    check_telemetry_flags(&args, &plan)?;
    let (target_cfg, engine_line) = target_and_engine(&mut args, &plan, resume.is_some())?;
    let cpu_defaults = cpu_defaults(&args, &plan);
    let (mut loader_cfg, pipeline_cfg) = data_config(&args, &plan, &target_cfg)?;
    let mut trainer_cfg = trainer_config(&args, &plan, &target_cfg, &pipeline_cfg.capture)?;
    let init_record = check_init_drafter(init.as_ref(), &mut trainer_cfg, &pipeline_cfg.capture)?;
    node::check_plan(node.as_ref(), &args, &plan, &mut trainer_cfg)?;
    settle_eval(
        &mut args,
        given,
        (&loader_cfg, &pipeline_cfg),
        &plan,
        &mut trainer_cfg,
    )?;
    let resume = match checkpoint_to_resume(resume, &args, &trainer_cfg, &worker_bin, setup)? {
        Continue::Done(msg) => return Ok(Started::Finished(msg)),
        Continue::From(r) => Some(*r),
        Continue::New => None,
    };
    check_memory(&args, &placed, &target_cfg, &pipeline_cfg, &trainer_cfg)?;
    let drafters = plan.iter().filter(|(n, _)| n.role == Role::Drafter).count() as u32;
    let preflight = preflight::at_start(&loader_cfg, args.preflight_lines, drafters)?;
    let tau_prompts = tau_prompts(&args, &target_cfg, &mut trainer_cfg, preflight.as_ref())?;
    setup.check()?;
    let schedule_line = plan_schedule(
        &args,
        given,
        resume.as_ref(),
        preflight.as_ref(),
        // A step of a job trains a batch on every node's drafters.
        drafters * node.as_ref().map_or(1, |n| n.t.nodes),
        &mut loader_cfg,
        &mut trainer_cfg,
    )?;
    // A follower meets the leader before it makes its own directory under the job's.
    let follower = node.as_ref().filter(|n| !n.t.is_leader());
    let met = node::meet_if(follower, &args, None, drafters, &mut trainer_cfg)?;
    let run_dir = open_run_dir(&mut args, &mut loader_cfg, resume.as_ref(), setup)?;
    // On --resume too: the settings as merged with this command line's are the run's now.
    // Said once the run directory is this run's: a start refused before then says only why.
    say_settled(
        &[
            adapted,
            cpu_defaults,
            init_line(&trainer_cfg),
            Some(engine_line),
            split_line,
        ],
        &schedule_line,
        &target_cfg,
    );
    trainer_cfg.settings =
        resolved_settings(&args, &plan, &loader_cfg, &pipeline_cfg, &trainer_cfg);
    save_settings(
        &args,
        &run_dir,
        (resume.as_ref(), preflight.as_ref()),
        &trainer_cfg,
        init_record,
    )?;
    setup.check()?;
    let target_dir = prepare_target(&args.target, &worker_bin, &run_dir.path)?;
    setup.check()?;
    // The job's run directory is the leader's: it meets the others once it holds it.
    let leader = node.as_ref().filter(|n| n.t.is_leader());
    let met = match met {
        Some(m) => Some(m),
        None => node::meet_if(leader, &args, resume.as_ref(), drafters, &mut trainer_cfg)?,
    };
    let (data, link) = run_data(
        &run_dir,
        (loader_cfg, &pipeline_cfg),
        trainer_cfg,
        resume.as_ref(),
        met,
    )?;
    let sup_log = run_dir.path.join(rundir::SUPERVISOR_LOG);
    console::to_file(&sup_log).map_err(|e| Error::io("cannot write", &sup_log, e))?;
    let reaper = start_reaper();
    let mut cfg = dispatcher_config(&args, (plan, placed.target_spans), worker_bin, target_dir)?;
    cfg.tau = tau_config(&args, tau_prompts, &run_dir.path)?;
    let launcher = dispatcher::launcher::Processes::new(&cfg, run_dir.path.clone(), reaper, &data)?;
    let d = dispatcher::Dispatcher::new(cfg, run_dir, data, Box::new(launcher))?;
    link.map(|l| l.forward(d.events())).transpose()?;
    setup.check()?;
    Ok(Started::Run(Box::new(d)))
}

/// `--eval-data`'s held-out set for the trainer; τ's decode length on the CPU.
fn settle_eval(
    args: &mut RunArgs,
    given: &[String],
    (loader_cfg, pipeline_cfg): (&loader::LoaderConfig, &pipeline::PipelineConfig),
    plan: &[(WorkerName, Device)],
    trainer_cfg: &mut trainer::TrainerConfig,
) -> Result<(), Error> {
    if let Some(path) = &args.eval_data {
        let eval = eval_settings(path, args, loader_cfg, pipeline_cfg, plan)?;
        trainer_cfg.eval = Some(eval);
    }
    if args.eval_gpu.is_none() && !given.iter().any(|g| g == "eval_max_new_tokens") {
        // Decoded on the CPU: shorter decodes keep τ affordable (said with the prompts).
        args.eval_max_new_tokens = args.eval_max_new_tokens.min(CPU_TAU_NEW_TOKENS);
    }
    Ok(())
}

/// run.json (the run's settings, to resume it with) and preflight.json.
fn save_settings(
    args: &RunArgs,
    run_dir: &rundir::RunDir,
    (resume, preflight): (Option<&resume::Resume>, Option<&preflight::Report>),
    trainer_cfg: &trainer::TrainerConfig,
    init_record: Option<serde_json::Value>,
) -> Result<(), Error> {
    resume::save(
        args,
        resume,
        &run_dir.path,
        trainer_cfg.settings.clone(),
        init_record,
    )?;
    if let Some(p) = preflight {
        p.write_json(&run_dir.path.join("preflight.json"))?;
    }
    Ok(())
}

/// What the run feeds its workers: the loader (or, in a job across nodes, the node's
/// share of the data), the pipeline and the trainer, continued from `resume`; and the
/// link's events of a job across nodes, for the dispatcher.
fn run_data(
    run_dir: &rundir::RunDir,
    (loader_cfg, pipeline_cfg): (loader::LoaderConfig, &pipeline::PipelineConfig),
    mut trainer_cfg: trainer::TrainerConfig,
    resume: Option<&resume::Resume>,
    met: Option<node::Met>,
) -> Result<(dispatcher::Data, Option<node::Link>), Error> {
    trainer_cfg.checkpoints_dir = run_dir.path.join("checkpoints");
    std::fs::create_dir_all(&trainer_cfg.checkpoints_dir)
        .map_err(|e| Error::io("cannot create", &trainer_cfg.checkpoints_dir, e))?;
    let share_cfg = met.is_some().then(|| loader_cfg.clone());
    let mut loader = loader::Loader::new(loader_cfg);
    let mut pipeline = pipeline::Pipeline::new(pipeline_cfg, &run_dir.path)?;
    if let Some(r) = resume {
        continue_from(r, &mut loader, &mut pipeline, &mut trainer_cfg);
    }
    let mut trainer = trainer::Trainer::new(trainer_cfg, &run_dir.path)?;
    let (Some(met), Some(share_cfg)) = (met, share_cfg) else {
        let data = dispatcher::Data {
            pipeline,
            loader: loader.into(),
            trainer,
            job: None,
        };
        return Ok((data, None));
    };
    trainer.join_job(met.rank);
    let (source, feed, end) = node::share(share_cfg)?;
    let job = dispatcher::job::Job {
        node: met.node,
        feed,
        end,
        end_told: false,
        rank: met.rank,
        windows: Default::default(),
    };
    let data = dispatcher::Data {
        pipeline,
        loader: source,
        trainer,
        job: Some(job),
    };
    Ok((data, Some(met.link)))
}

/// What a start continues: nothing (a new run), a checkpoint, or a run with nothing left
/// to train (said in words).
enum Continue {
    New,
    From(Box<resume::Resume>),
    Done(String),
}

/// The checkpoint a `--resume` continues from: the newest that verifies and is of this
/// drafter, beyond which `--steps` lies. A run that already finished is said so (before
/// `--steps` is compared with its step). One whose checkpoint is at its `--steps` but
/// whose last session did not record its end (its export failed, a worker was killed at
/// the stop) is finished now, under the run directory's lock: its drafter exported unless
/// it is there, finished.json written (a requeue of it then exits 0).
fn checkpoint_to_resume(
    prepared: Option<resume::Prepared>,
    args: &RunArgs,
    trainer_cfg: &trainer::TrainerConfig,
    worker_bin: &Path,
    setup: &mut Setup,
) -> Result<Continue, Error> {
    let Some(p) = prepared else {
        return Ok(Continue::New);
    };
    if let Some(msg) = p
        .newest_step()
        .and_then(|step| resume::finished(&p.dir, step, args.steps))
    {
        return Ok(Continue::Done(msg));
    }
    match p.select(&trainer_cfg.drafter, args.steps)? {
        resume::Selected::Train(r) => Ok(Continue::From(r)),
        resume::Selected::Reached(r) => {
            let run_dir = rundir::RunDir::reopen(&r.dir)?;
            let target = prepare_target(&args.target, worker_bin, &run_dir.path)?;
            let setup = std::cell::RefCell::new(setup);
            let stop = || setup.borrow_mut().interrupted().is_some();
            r.finish(worker_bin, &target, &stop).map(Continue::Done)
        }
    }
}

/// The flags as the run will use them (`--config` is applied as the command line is
/// parsed, [`config_file::parse`]): `--resume-if-exists` turned into a `--resume` of the
/// run there (if any), a resumed run's saved settings merged in
/// (its checkpoints listed, returned), the default run dir, data that can be read once
/// copied.
fn settle_flags(
    args: &mut RunArgs,
    given: &[String],
    setup: &mut Setup,
) -> Result<Option<resume::Prepared>, Error> {
    if args.resume_if_exists {
        let dir = args.run_dir.clone().unwrap_or_default();
        if let Some(d) = existing_run(&dir, setup)? {
            args.resume = Some(d);
            args.run_dir = None;
        }
    }
    if std::env::var_os("SLURM_JOB_ID").is_some() && args.stop_timeout > SLURM_KILL_WAIT {
        log::warn!(
            "--stop-timeout {} is longer than Slurm's default KillWait ({}s): Slurm may kill the run before its final checkpoint is written \
             (use --stop-timeout 25s, or sbatch --signal=B:USR1@SECS so that a checkpoint is written before the stop)",
            humantime::format_duration(args.stop_timeout),
            SLURM_KILL_WAIT.as_secs()
        );
    }
    let resume = match args.resume.clone() {
        Some(dir) => Some(resume::prepare(&dir, args, given)?),
        None => None,
    };
    if resume.is_none() && args.run_dir.is_none() {
        args.run_dir = Some(rundir::default_run_dir());
    }
    if crate::data::spool::reads_once(&args.data) {
        spool_data(args, setup)?;
    }
    Ok(resume)
}

/// Data that can be read only once (stdin, a FIFO, a pipe) is copied first, beside the run
/// dir, and moved into it once it exists: the preflight, every epoch and a --resume read
/// the same bytes. `--data` names the copy from now on.
fn spool_data(args: &mut RunArgs, setup: &mut Setup) -> Result<(), Error> {
    let run_path = args.run_dir.clone().unwrap_or_default();
    let parent = run_path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
        .to_path_buf();
    std::fs::create_dir_all(&parent).map_err(|e| Error::io("cannot create", &parent, e))?;
    let name = run_path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "run".into());
    let tmp = parent.join(format!(".{name}.data-{}.jsonl", std::process::id()));
    log::info!(
        "--data {} can be read only once: copying it to {} (then RUN_DIR/{})",
        args.data,
        tmp.display(),
        crate::data::spool::SPOOL_FILE
    );
    setup.spool = Some(tmp.clone());
    let bytes =
        crate::data::spool::spool_interruptible(&args.data, &tmp, &mut || setup.interrupted())?;
    log::info!("--data {}: {} copied", args.data, pipeline::human(bytes));
    args.data = tmp.display().to_string();
    Ok(())
}

/// The pools and the shared training buffers fit in shared memory, and each worker's
/// share of the model, activations and pools fits its device. The processes and threads
/// the run needs are noted too: a start refused by `ulimit -u` says how many.
fn check_memory(
    args: &RunArgs,
    placed: &Placement,
    target_cfg: &TargetConfig,
    pipeline_cfg: &pipeline::PipelineConfig,
    trainer_cfg: &trainer::TrainerConfig,
) -> Result<(), Error> {
    let (plan, spans) = (&placed.workers[..], &placed.target_spans[..]);
    crate::nproc::plan_run(plan.iter().map(|(_, d)| *d));
    let last = pipeline_cfg
        .capture
        .tap_ids
        .iter()
        .max()
        .copied()
        .unwrap_or(0) as usize;
    // The target's weights and the drafter's fixed buffers against their GPUs' memory,
    // where NVML says how much they have (DFLASH_DEVICE=cpu: the workers compute on the
    // CPU whatever their device).
    // --targets auto: any device may come to run either role, so each is checked as both.
    let auto = args.auto_split();
    let as_role = |role: Role| -> Vec<(WorkerName, Device)> {
        match auto {
            true => (0..)
                .zip(plan)
                .map(|(rank, (_, d))| (WorkerName { role, rank }, *d))
                .collect(),
            false => plan.to_vec(),
        }
    };
    let (targets, drafters) = (as_role(Role::Target), as_role(Role::Drafter));
    let on_gpu = |plan: &[(WorkerName, Device)], role| {
        plan.iter()
            .any(|(n, d)| n.role == role && matches!(d, Device::Gpu(_)))
            && std::env::var("DFLASH_DEVICE").map_or(true, |d| d != "cpu")
    };
    let any_gpu = on_gpu(&targets, Role::Target) || on_gpu(&drafters, Role::Drafter);
    if let (true, Ok((_, gpus))) = (any_gpu, crate::telemetry::gpus::list()) {
        let memory = |g: u32| {
            gpus.iter()
                .find(|x| x.index == g)
                .and_then(|x| x.memory_total_bytes)
        };
        let either = |e: Error| {
            match e {
            Error::Flag(m) if auto => Error::Flag(format!(
                "--targets auto (the default on 3 or more devices: any device may come to run either role): {m}; or fix the split with --targets N"
            )),
            other => other,
        }
        };
        if on_gpu(&targets, Role::Target) {
            let (layers, rest) = gpu_fit::weight_bytes(&args.target, target_cfg, last)?;
            gpu_fit::check(
                &targets,
                spans,
                args.gpus_per_target,
                (&layers, rest),
                &memory,
            )
            .map_err(either)?;
        }
        if on_gpu(&drafters, Role::Drafter) {
            gpu_fit::check_drafters(&drafters, &trainer_cfg.drafter, &memory).map_err(either)?;
        }
    }
    let shared_bytes = trainer::Trainer::shared_bytes(
        &trainer_cfg.drafter,
        trainer_cfg.max_ranks,
        trainer_cfg.collective,
    );
    pipeline_cfg.check_memory(shared_bytes)?;
    // The torch engine's families: what their checkpoint holds, not a dense guess.
    let loaded = (target_cfg.arch == dflash_shared::model_config::Arch::Transformers)
        .then(|| target_check::loaded_elements(Path::new(&args.target), last))
        .transpose()
        .map_err(|e| Error::input(format!("--target {}", args.target), e))?;
    let estimate = validate::estimate_memory(
        &trainer_cfg.drafter,
        target_cfg,
        &pipeline_cfg.capture.tap_ids,
        plan,
        args.max_seq_len,
        pipeline_cfg.token_budget,
        pipeline_cfg.total_bytes() + shared_bytes,
        loaded,
    );
    validate::check_memory(&estimate, plan, &trainer_cfg.drafter)
}

/// The learning-rate schedule and the run's length in steps and epochs, from the flags and
/// the epoch's length (the preflight's count of the data, or the demo data's); a resume
/// keeps its checkpoint's schedule unless this command changes it. Sets the loader's
/// epochs and the trainer's schedule; returns the schedule in words.
fn plan_schedule(
    args: &RunArgs,
    given: &[String],
    resume: Option<&resume::Resume>,
    preflight: Option<&preflight::Report>,
    drafters: u32,
    loader_cfg: &mut loader::LoaderConfig,
    trainer_cfg: &mut trainer::TrainerConfig,
) -> Result<String, Error> {
    let epoch = match (preflight, &loader_cfg.source) {
        (Some(p), _) => Some(schedule::EpochLength {
            steps: p.steps_per_epoch,
            complete: p.complete,
            counted: false,
        }),
        (None, loader::DataSource::Demo { .. }) => Some(demo_epoch(loader_cfg, drafters)?),
        (None, _) => None,
    };
    let mut sched = schedule::Schedule::plan(
        trainer_cfg.lr,
        args.warmup_ratio.unwrap_or(DEFAULT_WARMUP_RATIO),
        args.steps,
        args.epochs,
        epoch,
        drafters,
    )?;
    let changes_schedule = ["steps", "lr", "warmup_ratio"]
        .iter()
        .any(|f| given.iter().any(|g| g == f));
    if let Some(saved) = resume.and_then(|r| r.schedule.as_ref()) {
        if !changes_schedule && sched.restore(saved) {
            log::info!("resuming with the schedule of its checkpoint");
        }
    }
    let line = sched.describe();
    loader_cfg.epochs = sched.loader_epochs;
    trainer_cfg.warmup_steps = sched.warmup_steps;
    trainer_cfg.total_steps = sched.total_steps;
    trainer_cfg.schedule = Some(sched);
    Ok(line)
}

/// The run directory: the resumed run's, or a new one (noted in `setup`, to be removed if
/// the start is interrupted; a run with nothing to resume at its path, found by
/// [`existing_run`], is moved aside first). A copy of the data made by [`spool_data`]
/// moves into it.
fn open_run_dir(
    args: &mut RunArgs,
    loader_cfg: &mut loader::LoaderConfig,
    resume: Option<&resume::Resume>,
    setup: &mut Setup,
) -> Result<rundir::RunDir, Error> {
    let run_dir = match resume {
        Some(r) => rundir::RunDir::reopen(&r.dir)?,
        None => {
            let path = args.run_dir.clone().unwrap_or_default();
            set_aside_unresumable(setup)?;
            let existed = path.is_dir();
            let d = rundir::RunDir::create(Some(&path))?;
            setup.created = Some((d.path.clone(), existed));
            d
        }
    };
    if let Some(tmp) = setup.spool.clone() {
        let to = run_dir.path.join(crate::data::spool::SPOOL_FILE);
        std::fs::rename(&tmp, &to)
            .map_err(|e| Error::io("cannot move the copy of --data to", &to, e))?;
        setup.spool = None;
        args.data = to.display().to_string();
        loader_cfg.source = loader::DataSource::Files(vec![to]);
    }
    Ok(run_dir)
}

/// A resumed run goes on from its checkpoint `r`: the loader skips the batches it
/// consumed, the ledger's lineage starts there, the trainer loads it.
fn continue_from(
    r: &resume::Resume,
    loader: &mut loader::Loader,
    pipeline: &mut pipeline::Pipeline,
    trainer_cfg: &mut trainer::TrainerConfig,
) {
    log::info!(
        "resuming {} from the checkpoint of step {} ({} batches already consumed)",
        r.dir.display(),
        r.step,
        r.consumed.len()
    );
    loader.skip_consumed(r.consumed.clone());
    pipeline.set_consumed_before(r.consumed.clone());
    // The ledger's lineage goes back to the checkpoint too.
    pipeline.record_resume(r.step);
    trainer_cfg.resume = Some((r.step, r.checkpoint.clone()));
    r.forget_finished();
    r.set_aside_refused();
    // What names the best checkpoint: τ with --eval-prompts, else the eval acceptance.
    let scores = if trainer_cfg.tau_every.is_some() {
        crate::training::train_log::TrainLog::taus(&r.dir)
    } else if trainer_cfg.eval.is_some() {
        crate::training::train_log::TrainLog::evals(&r.dir)
    } else {
        Default::default()
    };
    r.repair_best_link(&scores);
}

/// The reaper, which kills what the workers forked if the supervisor is killed; a run
/// goes on without it (with a warning) when it cannot start.
fn start_reaper() -> Option<reaper::Reaper> {
    let reaper = std::env::current_exe().and_then(|exe| reaper::Reaper::start(&exe));
    match reaper {
        Ok(r) => Some(r),
        Err(e) => {
            log::warn!(
                "cannot start the reaper ({}): if the supervisor is killed, processes forked by workers may outlive it",
                crate::nproc::start_failure(&e)
            );
            None
        }
    }
}

/// The dispatcher's settings from the flags; the Prometheus exporter is started here.
fn dispatcher_config(
    args: &RunArgs,
    (plan, target_spans): (Vec<(WorkerName, Device)>, Vec<Vec<u32>>),
    worker_bin: PathBuf,
    target_dir: PathBuf,
) -> Result<dispatcher::Config, Error> {
    Ok(dispatcher::Config {
        plan,
        target_spans,
        worker_bin,
        target_dir,
        target_engine: match args.target_engine {
            crate::cli::TargetEngine::Torch => "torch",
            _ => "native",
        },
        hang_timeout: args.hang_timeout,
        step_timeout: args.step_timeout,
        max_restarts: args.max_restarts,
        stable_after: args.stable_after,
        stop_timeout: args.stop_timeout,
        time_limit: args.time_limit,
        tee: args.tee,
        log_max_size: args.log_max_size,
        log_backups: args.log_backups,
        gpu_metrics: !args.no_gpu_metrics,
        prometheus: match &args.prometheus {
            Some(a) => {
                let e = prometheus::Exporter::start(*a)?;
                log::info!("Prometheus metrics at http://{}/metrics", e.addr);
                Some(e)
            }
            None => None,
        },
        gpu_sample_interval: args.gpu_sample_interval,
        metrics_interval: args.metrics_interval,
        tau: None,
        balance: args
            .auto_split()
            .then(|| crate::run::balance::BalanceConfig::for_window(args.metrics_interval)),
        wandb: args
            .wandb_project
            .as_ref()
            .map(|p| crate::telemetry::wandb::WandbArgs {
                project: p.clone(),
                name: args.wandb_name.clone(),
                mode: args.wandb_mode.clone(),
            }),
    })
}

/// `--eval-data`: the held-out set, read whole now (a bad file is refused before anything
/// starts), and its interval: `--eval-every`, else `--checkpoint-every` (else only the
/// last step). An eval round pauses training traffic, so the pools must hold more than
/// what the consumers can keep while it runs (see [`crate::training::eval`]).
fn eval_settings(
    path: &Path,
    args: &RunArgs,
    loader_cfg: &loader::LoaderConfig,
    pipeline_cfg: &pipeline::PipelineConfig,
    plan: &[(dflash_shared::WorkerName, Device)],
) -> Result<trainer::EvalSettings, Error> {
    let count = |r: Role| plan.iter().filter(|(n, _)| n.role == r).count() as u64;
    let (targets, drafters) = (count(Role::Target), count(Role::Drafter));
    let k = pipeline_cfg.prefetch.max(1) as u64;
    if (pipeline_cfg.hidden_slots as u64) <= drafters * k {
        return Err(Error::Flag(format!(
            "--eval-data with --hidden-slots {}: expected more than {} ({drafters} drafters × --prefetch {k}), or an eval round could find no slot to run in",
            pipeline_cfg.hidden_slots,
            drafters * k
        )));
    }
    if (pipeline_cfg.token_slots as u64) <= targets * k {
        return Err(Error::Flag(format!(
            "--eval-data with --token-slots {}: expected more than {} ({targets} targets × --prefetch {k}), or an eval round could find no slot to run in",
            pipeline_cfg.token_slots,
            targets * k
        )));
    }
    let set = crate::training::eval::EvalSet::load(path, loader_cfg)?;
    let every = args
        .eval_every
        .or((args.checkpoint_every > 0).then_some(args.checkpoint_every))
        .unwrap_or(u64::MAX);
    log::info!(
        "eval set {}: {} samples, {} tokens in {} batches, evaluated {} and at the last step",
        path.display(),
        set.rows,
        set.tokens,
        set.batches.len(),
        if every == u64::MAX {
            "only".to_string()
        } else {
            format!("every {every} steps")
        }
    );
    Ok(trainer::EvalSettings { set, every })
}

/// `--eval-prompts`: the prompts as token-id lines, read and checked now (a bad file is
/// refused before anything starts), and the τ steps: every `--eval-every`, else
/// `--checkpoint-every`, else only the last step. Chat prompts are rendered with the
/// thinking switch the data was rendered with (`data_thinking`, when all of it was
/// rendered alike, says `preflight`); prompts rendered otherwise (their own `thinking`)
/// are warned about.
fn tau_prompts(
    args: &RunArgs,
    target: &TargetConfig,
    trainer_cfg: &mut trainer::TrainerConfig,
    preflight: Option<&preflight::Report>,
) -> Result<Option<Vec<String>>, Error> {
    let Some(path) = &args.eval_prompts else {
        return Ok(None);
    };
    let data_thinking = preflight.and_then(|p| p.thinking_mode());
    let dir = (args.target != "tiny").then(|| Path::new(&args.target));
    let rendered =
        crate::data::prompts::token_lines("--eval-prompts", path, dir, data_thinking.flatten())?;
    if let Some(w) = rendering_mismatch(&rendered.thinking, data_thinking) {
        log::warn!("--eval-prompts {}: {w}", path.display());
    }
    let lines = rendered.lines;
    crate::data::prompts::check_vocab("--eval-prompts", path, &lines, target.vocab_size)?;
    crate::data::prompts::check_context(
        "--eval-prompts",
        path,
        &lines,
        target.max_position_embeddings,
        args.eval_max_new_tokens,
    )?;
    let every = args
        .eval_every
        .or((args.checkpoint_every > 0).then_some(args.checkpoint_every))
        .unwrap_or(u64::MAX);
    let mut lines = lines;
    let all = lines.len();
    let on_cpu = args.eval_gpu.is_none();
    if on_cpu {
        lines.truncate(CPU_TAU_PROMPTS);
    }
    let which = if lines.len() < all {
        format!(
            "the first {} of the {all} prompts of {} (τ decodes on the CPU: --eval-gpu N decodes all of them on a GPU; dflash-supervise eval measures them all afterwards)",
            lines.len(),
            path.display()
        )
    } else {
        format!("{all} prompts of {}", path.display())
    };
    log::info!(
        "τ eval: {which}, up to {} new tokens each{}, measured {} and at the last step (in a child process beside training)",
        args.eval_max_new_tokens,
        if on_cpu { " (on the CPU)" } else { "" },
        if every == u64::MAX {
            "only".to_string()
        } else {
            format!("every {every} steps")
        }
    );
    trainer_cfg.tau_every = Some(every);
    Ok(Some(lines))
}

/// The warning when chat prompts are rendered with another thinking switch than the data
/// (`data`: the one switch all of it was rendered with).
fn rendering_mismatch(
    prompts: &std::collections::BTreeSet<Option<bool>>,
    data: Option<Option<bool>>,
) -> Option<String> {
    let data = data?;
    if prompts.iter().all(|&t| t == data) {
        return None;
    }
    Some(format!(
        "chat prompts rendered with thinking {}, but the training data with thinking {}: τ measured so is not what serving with the data's rendering gives",
        crate::data::prompts::thinking_words(prompts),
        preflight::thinking_name(data)
    ))
}

/// What the τ eval and W&B flags need before the run starts: `--eval-gpu` one of the
/// run's GPUs, python3 with wandb for `--wandb-project`.
fn check_telemetry_flags(args: &RunArgs, plan: &[(WorkerName, Device)]) -> Result<(), Error> {
    check_eval_gpu(args, plan)?;
    if let Some(p) = &args.wandb_project {
        crate::telemetry::wandb::check(&crate::telemetry::wandb::WandbArgs {
            project: p.clone(),
            name: None,
            mode: None,
        })?;
    }
    Ok(())
}

/// `--eval-gpu N`: one of the run's GPUs.
fn check_eval_gpu(args: &RunArgs, plan: &[(WorkerName, Device)]) -> Result<(), Error> {
    if let Some(g) = args.eval_gpu {
        if !plan.iter().any(|(_, d)| *d == Device::Gpu(g)) {
            let used: Vec<String> = plan
                .iter()
                .filter_map(|(_, d)| match d {
                    Device::Gpu(i) => Some(*i),
                    Device::Cpu => None,
                })
                .collect::<std::collections::BTreeSet<u32>>()
                .iter()
                .map(u32::to_string)
                .collect();
            return Err(Error::Flag(format!(
                "--eval-gpu {g}: expected one of the run's GPUs ({})",
                if used.is_empty() {
                    "it has none: its workers run on the CPU".to_string()
                } else {
                    used.join(", ")
                }
            )));
        }
    }
    Ok(())
}

/// The τ eval's settings, its prompts written to RUN_DIR/eval/prompts.jsonl.
fn tau_config(
    args: &RunArgs,
    lines: Option<Vec<String>>,
    run_dir: &Path,
) -> Result<Option<dispatcher::tau_job::TauConfig>, Error> {
    let Some(lines) = lines else {
        return Ok(None);
    };
    let dir = run_dir.join("eval");
    std::fs::create_dir_all(&dir).map_err(|e| Error::io("cannot create", &dir, e))?;
    let prompts = dir.join("prompts.jsonl");
    std::fs::write(&prompts, lines.join("\n") + "\n")
        .map_err(|e| Error::io("cannot write", &prompts, e))?;
    Ok(Some(dispatcher::tau_job::TauConfig {
        prompts,
        max_new_tokens: args.eval_max_new_tokens,
        timeout: args.eval_timeout,
        gpu: args.eval_gpu,
        dir,
    }))
}

/// The target's config: the built-in tiny one, or DIR/config.json.
pub(crate) fn target_config(target: &str) -> Result<TargetConfig, Error> {
    if target == "tiny" {
        return Ok(TargetConfig::read(dflash_shared::model_config::TINY_CONFIG)
            .expect("the built-in tiny config parses"));
    }
    TargetConfig::load(std::path::Path::new(target))
        .map_err(|e| Error::input(format!("--target {target}"), e))
}

/// The directory workers load the target from; the tiny target is written into the run
/// dir first (by the worker binary: the supervisor links no model code).
fn prepare_target(target: &str, worker_bin: &Path, run_dir: &Path) -> Result<PathBuf, Error> {
    if target != "tiny" {
        return std::fs::canonicalize(target)
            .map_err(|e| Error::input(format!("--target {target}"), e));
    }
    let dir = run_dir.join("target");
    let mut cmd = std::process::Command::new(worker_bin);
    cmd.arg("tiny-target").arg("--out").arg(&dir);
    let out = crate::export_tool::output_within(&mut cmd, TINY_TARGET_TIMEOUT).map_err(|e| {
        if dflash_shared::nproc::is_limit(&e) {
            Error::start(format!("tiny-target of {}", worker_bin.display()), e)
        } else {
            Error::io("cannot run tiny-target of", worker_bin, e)
        }
    })?;
    if !out.status.success() {
        return Err(Error::Helper {
            program: format!("{} tiny-target", worker_bin.display()),
            detail: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(dir)
}

/// Writing the tiny target takes well under a second; a worker program that blocks (not a
/// dflash-worker, or a wrapper waiting on something) must not hang the start.
const TINY_TARGET_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);

/// Whether every drafter of the plan trains on a CPU worker.
fn drafters_on_cpu(plan: &[(WorkerName, Device)]) -> bool {
    plan.iter()
        .filter(|(n, _)| n.role == Role::Drafter)
        .all(|(_, d)| matches!(d, Device::Cpu))
}

/// `--token-budget`'s default: 2048 for the tiny target; for a real one 4096 on GPUs, and
/// [`CPU_TOKEN_BUDGET`] when the drafters train on CPU workers (a step in seconds, not
/// minutes, with a real vocabulary).
pub(crate) fn default_token_budget(target: &str, plan: &[(WorkerName, Device)]) -> u32 {
    match (target == "tiny", drafters_on_cpu(plan)) {
        (true, _) => 2048,
        (false, true) => CPU_TOKEN_BUDGET,
        (false, false) => 4096,
    }
}

/// `--max-anchors`' default: 32 for the tiny target and for drafters on CPU workers
/// (the loss through a real vocabulary costs per anchor), 512 on GPUs.
pub(crate) fn default_max_anchors(target: &str, plan: &[(WorkerName, Device)]) -> usize {
    if target == "tiny" || drafters_on_cpu(plan) {
        32
    } else {
        512
    }
}

/// τ during training decoded on the CPU: at most this many prompts, and new tokens unless
/// `--eval-max-new-tokens` is given.
pub(crate) const CPU_TAU_PROMPTS: usize = 16;
pub(crate) const CPU_TAU_NEW_TOKENS: u64 = 32;

/// `--token-budget` by default for a real target trained on CPU workers.
pub(crate) const CPU_TOKEN_BUDGET: u32 = 1024;

/// On CPU workers with a real target, the defaults that keep a step in seconds, in words.
fn cpu_defaults(args: &RunArgs, plan: &[(WorkerName, Device)]) -> Option<String> {
    if args.target == "tiny" || !drafters_on_cpu(plan) {
        return None;
    }
    let mut chosen = Vec::new();
    if args.token_budget.is_none() {
        chosen.push(format!("--token-budget {CPU_TOKEN_BUDGET}"));
    }
    if args.max_anchors.is_none() {
        chosen.push("--max-anchors 32".to_string());
    }
    (!chosen.is_empty()).then(|| {
        format!(
            "drafters on CPU workers: {} by default (on GPUs 4096 and 512), so that a step through a real vocabulary takes seconds; give them to choose",
            chosen.join(" and ")
        )
    })
}

/// The loader and pool settings, checked before anything starts.
pub(crate) fn data_config(
    args: &RunArgs,
    plan: &[(WorkerName, Device)],
    target: &TargetConfig,
) -> Result<(loader::LoaderConfig, pipeline::PipelineConfig), Error> {
    let source = loader::parse_source(&args.data, args.demo_samples)?;
    if matches!(source, loader::DataSource::Demo { .. }) && args.demo_samples == 0 {
        return Err(Error::Flag("--demo-samples 0: expected at least 1".into()));
    }
    let token_budget = args
        .token_budget
        .unwrap_or(default_token_budget(&args.target, plan));
    for (flag, v) in [
        ("--token-budget", token_budget as u64),
        ("--max-seq-len", args.max_seq_len as u64),
        ("--prefetch", args.prefetch as u64),
        ("--shuffle-window", args.shuffle_window as u64),
    ] {
        if v == 0 {
            return Err(Error::Flag(format!("{flag} 0: expected at least 1")));
        }
    }
    let mut loader_cfg = loader::LoaderConfig {
        source,
        vocab_size: Some(target.vocab_size as u32),
        token_budget,
        max_seq_len: args.max_seq_len,
        seed: args.seed,
        // The schedule sets it (cycling the data up to --steps): see `schedule::Schedule`.
        epochs: args.epochs.unwrap_or(1),
        max_bad_lines: args.max_bad_lines,
        shuffle_window: args.shuffle_window,
        max_line_bytes: 16 << 20,
        chat: None,
        chat_error: None,
    };
    let target_dir = (args.target != "tiny").then(|| std::path::Path::new(&args.target));
    if args.tokenizer.is_some()
        || matches!(
            loader_cfg.source,
            loader::DataSource::Files(_) | loader::DataSource::Stdin
        )
    {
        (loader_cfg.chat, loader_cfg.chat_error) =
            preflight::load_chat(args.tokenizer.as_deref(), target_dir)?;
    }
    if let Some(chat) = &loader_cfg.chat {
        check_tokenizer_vocab(chat, target, &args.target)?;
    }
    loader_cfg.check()?;
    let targets = plan.iter().filter(|(n, _)| n.role == Role::Target).count() as u32;
    let workers = plan.len() as u32;
    let pipeline_cfg = pipeline::PipelineConfig {
        token_slots: args.token_slots.unwrap_or(2 * targets + 4),
        hidden_slots: args.hidden_slots.unwrap_or(2 * workers + 2),
        prefetch: args.prefetch,
        token_budget,
        capture: capture_spec(args, target)?,
    };
    for (flag, v) in [
        ("--token-slots", pipeline_cfg.token_slots),
        ("--hidden-slots", pipeline_cfg.hidden_slots),
    ] {
        if v == 0 {
            return Err(Error::Flag(format!("{flag} 0: expected at least 1")));
        }
    }
    Ok((loader_cfg, pipeline_cfg))
}

/// A tokenizer whose ids reach past the target's vocabulary belongs to another model:
/// refused at the start with both sizes and both paths (else every chat line would be
/// dropped, one "token id >= vocab size" each).
fn check_tokenizer_vocab(
    chat: &crate::data::chat::Chat,
    target: &TargetConfig,
    target_dir: &str,
) -> Result<(), Error> {
    let ids = chat.id_count();
    if ids <= target.vocab_size {
        return Ok(());
    }
    Err(Error::Flag(format!(
        "the tokenizer {} has token ids up to {} but the target {target_dir} has a vocabulary of {} (its config.json's vocab_size): they belong to different models (expected the target's own tokenizer; see --tokenizer)",
        chat.dir.join("tokenizer.json").display(),
        ids - 1,
        target.vocab_size
    )))
}

/// The drafter and its optimisation, from the target and the flags.
pub(crate) fn trainer_config(
    args: &RunArgs,
    plan: &[(WorkerName, Device)],
    target: &TargetConfig,
    capture: &CaptureSpec,
) -> Result<trainer::TrainerConfig, Error> {
    let tiny = args.target == "tiny";
    let layers = args
        .draft_layers
        .unwrap_or_else(|| default_draft_layers(target.num_hidden_layers));
    let block = args.block_size.unwrap_or(if tiny { 8 } else { 16 });
    let anchors = args
        .max_anchors
        .unwrap_or(default_max_anchors(&args.target, plan));
    for (flag, v) in [
        ("--draft-layers", layers),
        ("--block-size", block.saturating_sub(1)),
        ("--max-anchors", anchors),
    ] {
        if v == 0 {
            return Err(Error::Flag(format!(
                "{flag}: expected at least {}",
                if flag == "--block-size" { 2 } else { 1 }
            )));
        }
    }
    let lr = args.lr.unwrap_or(if tiny { 3e-3 } else { 6e-4 });
    if !(lr > 0.0 && lr.is_finite()) {
        return Err(Error::Flag(format!(
            "--lr {lr}: expected a positive learning rate"
        )));
    }
    let warmup_ratio = args.warmup_ratio.unwrap_or(DEFAULT_WARMUP_RATIO);
    if !(0.0..1.0).contains(&warmup_ratio) {
        return Err(Error::Flag(format!(
            "--warmup-ratio {warmup_ratio}: expected a fraction in [0, 1)"
        )));
    }
    if args.steps == Some(0) {
        return Err(Error::Flag("--steps 0: expected at least 1".into()));
    }
    let mut drafter =
        DrafterConfig::for_target(target, layers, capture.tap_ids.len(), block, anchors);
    if let Some(g) = args.gamma {
        if !(g > 0.0 && g.is_finite()) {
            return Err(Error::Flag(format!(
                "--gamma {g}: expected a positive number"
            )));
        }
        drafter.gamma = g;
    }
    if let Some(id) = args.mask_token_id {
        if id as usize >= target.vocab_size {
            return Err(Error::Flag(format!(
                "--mask-token-id {id}: expected an id below the target's vocabulary size {}",
                target.vocab_size
            )));
        }
        drafter.mask_token_id = id;
    }
    let collective = collective(args, plan)?;
    Ok(trainer::TrainerConfig {
        eval: None,
        tau_every: None,
        collective,
        collective_timeout: args.collective_timeout,
        drafter,
        lr,
        warmup_steps: args
            .steps
            .map_or(0, |n| (n as f64 * warmup_ratio).ceil() as u64),
        total_steps: args.steps,
        // Set once the data's length is known (`start`).
        schedule: None,
        settings: serde_json::Value::Null,
        steps_limit: args.steps,
        clip: 1.0,
        seed: args.seed,
        // With --targets auto every device but one may come to train.
        max_ranks: match args.split() {
            Targets::Auto { .. } => plan.len().saturating_sub(1).max(1) as u32,
            Targets::Fixed(_) => {
                plan.iter().filter(|(n, _)| n.role == Role::Drafter).count() as u32
            }
        },
        target_layer_ids: capture.tap_ids.clone(),
        num_target_layers: target.num_hidden_layers,
        checkpoint_every: (args.checkpoint_every > 0).then_some(args.checkpoint_every),
        keep_checkpoints: args.keep_checkpoints,
        checkpoints_dir: PathBuf::new(),
        resume: None,
        init_drafter: None,
        snapshot_every: args.snapshot_every,
        max_rollbacks: args.max_rollbacks,
        max_skipped_steps: args.max_skipped_steps,
    })
}

/// How the drafters exchange gradients: `--collective`, or for `auto` none with one
/// drafter, NCCL between GPU drafters, else shared memory. NCCL asked for CPU drafters is
/// refused.
fn collective(args: &RunArgs, plan: &[(WorkerName, Device)]) -> Result<CollectiveKind, Error> {
    let gpu_drafters = plan
        .iter()
        .filter(|(n, d)| n.role == Role::Drafter && matches!(d, Device::Gpu(_)))
        .count();
    let mut drafters = plan.iter().filter(|(n, _)| n.role == Role::Drafter).count();
    let mut gpu_drafters = gpu_drafters;
    if args.auto_split() {
        // As many drafters as the balancer may come to: every device but one.
        drafters = plan.len().saturating_sub(1);
        let gpus = plan
            .iter()
            .filter(|(_, d)| matches!(d, Device::Gpu(_)))
            .count();
        gpu_drafters = gpus.min(drafters);
    }
    // DFLASH_DEVICE=cpu (tests) makes GPU workers compute on the CPU: no NCCL there.
    let cpu_forced = std::env::var_os("DFLASH_DEVICE").is_some_and(|v| !v.is_empty());
    Ok(match args.collective.as_str() {
        "shm" => CollectiveKind::Shm,
        "nccl" if gpu_drafters < drafters || cpu_forced => {
            let why = if cpu_forced {
                "the drafters compute on the CPU (DFLASH_DEVICE)".to_string()
            } else {
                format!(
                    "{} of the {drafters} drafters are CPU workers",
                    drafters - gpu_drafters
                )
            };
            return Err(Error::Flag(format!("--collective nccl: NCCL all-reduces GPU buffers, but {why}; use --collective shm (or auto)")));
        }
        "nccl" => CollectiveKind::Nccl,
        _ if drafters == 1 => CollectiveKind::Local,
        _ if gpu_drafters >= 2 && !cpu_forced => CollectiveKind::Nccl,
        _ => CollectiveKind::Shm,
    })
}

/// Every setting as this run uses it, defaults resolved: what run.json's `resolved`, each
/// checkpoint's meta.json and the report show.
fn resolved_settings(
    args: &RunArgs,
    plan: &[(WorkerName, Device)],
    loader: &loader::LoaderConfig,
    pipeline: &pipeline::PipelineConfig,
    t: &trainer::TrainerConfig,
) -> serde_json::Value {
    let d = |x: std::time::Duration| humantime::format_duration(x).to_string();
    serde_json::json!({
        "workers": plan.iter().map(|(n, dev)| format!("{n}@{dev}")).collect::<Vec<_>>(),
        "target": args.target,
        "taps": pipeline.capture.tap_ids,
        "num_target_layers": t.num_target_layers,
        "drafter": t.drafter,
        "lr": t.lr,
        "schedule": t.schedule.as_ref().map(|s| s.to_json()),
        "steps": t.steps_limit,
        "clip": t.clip,
        "seed": t.seed,
        "data": args.data,
        "epochs": if loader.epochs == schedule::CYCLE { serde_json::json!("cycled up to --steps") } else { serde_json::json!(loader.epochs) },
        "token_budget": pipeline.token_budget,
        "max_seq_len": loader.max_seq_len,
        "shuffle_window": loader.shuffle_window,
        "max_bad_lines": loader.max_bad_lines,
        "collective": t.collective.name(),
        "collective_timeout": d(t.collective_timeout),
        "checkpoint_every": t.checkpoint_every,
        "keep_checkpoints": t.keep_checkpoints,
        "snapshot_every": t.snapshot_every.map_or(serde_json::json!("auto (under 2% of the step time)"), |n| serde_json::json!(n)),
        "max_rollbacks": t.max_rollbacks,
        "max_skipped_steps": t.max_skipped_steps,
        "token_slots": pipeline.token_slots,
        "hidden_slots": pipeline.hidden_slots,
        "prefetch": pipeline.prefetch,
        "eval_data": args.eval_data,
        "eval_every": t.eval.as_ref().map(|e| e.every),
        "eval_prompts": args.eval_prompts,
        "tau_every": t.tau_every,
        "eval_max_new_tokens": args.eval_prompts.as_ref().map(|_| args.eval_max_new_tokens),
        "eval_gpu": args.eval_prompts.as_ref().and(args.eval_gpu),
        "eval_timeout": args.eval_prompts.as_ref().map(|_| d(args.eval_timeout)),
        "hang_timeout": d(args.hang_timeout),
        "step_timeout": args.step_timeout.map_or("10m, or 5 × the slowest of the first 3 steps".to_string(), d),
        "max_restarts": args.max_restarts,
        "stable_after": d(args.stable_after),
        "stop_timeout": d(args.stop_timeout),
        "time_limit": args.time_limit.map(d),
    })
}

/// Slurm's default KillWait: the time between its SIGTERM and its SIGKILL.
const SLURM_KILL_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Share of the schedule spent warming up when --warmup-ratio is not given.
pub const DEFAULT_WARMUP_RATIO: f64 = 0.04;

/// The steps of one epoch of the demo data, counted by cutting it as the loader will.
fn demo_epoch(cfg: &loader::LoaderConfig, drafters: u32) -> Result<schedule::EpochLength, Error> {
    let mut one = loader::Loader::new(loader::LoaderConfig {
        epochs: 1,
        ..cfg.clone()
    });
    let mut batches = 0u64;
    while one.next_batch()?.is_some() {
        batches += 1;
    }
    Ok(schedule::EpochLength {
        steps: batches.div_ceil(drafters.max(1) as u64),
        complete: true,
        counted: true,
    })
}

/// Which layers are tapped, of which target, in what shape: stamped on every batch.
fn capture_spec(args: &RunArgs, target: &TargetConfig) -> Result<CaptureSpec, Error> {
    let n = target.num_hidden_layers;
    let taps = match &args.taps {
        Some(t) => t.clone(),
        None => {
            let layers = args.draft_layers.unwrap_or_else(|| default_draft_layers(n));
            if layers == 0 {
                return Err(Error::Flag("--draft-layers 0: expected at least 1".into()));
            }
            let ids = target_layer_ids(n, layers);
            if ids.len() < layers {
                let asked = match args.draft_layers {
                    Some(l) => format!("--draft-layers {l}"),
                    None => format!("the default {layers} taps"),
                };
                let distinct = match ids.len() {
                    1 => "1 distinct layer".to_string(),
                    k => format!("{k} distinct layers"),
                };
                log::warn!(
                    "{asked}: DFlash spreads taps over layers {}..{} of this {n}-layer target, which gives {distinct}: tapping {ids:?} (the drafter keeps {layers} layers; --taps chooses others)",
                    ids.first().copied().unwrap_or(0),
                    ids.last().copied().unwrap_or(0),
                );
            }
            ids
        }
    };
    let mut seen = std::collections::BTreeSet::new();
    if let Some(dup) = taps.iter().find(|&&t| !seen.insert(t)) {
        return Err(Error::Flag(format!(
            "--taps {}: layer {dup} is given twice (expected distinct layer ids)",
            taps.iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(",")
        )));
    }
    // SGLang and vLLM concatenate the taps they capture in ascending layer order: a drafter
    // trained on another order would be served its features shuffled.
    if taps.windows(2).any(|w| w[0] > w[1]) {
        return Err(Error::Flag(format!(
            "--taps {}: expected ascending layer ids (the serving engines feed the drafter its taps in layer order)",
            taps.iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(",")
        )));
    }
    if let Some(bad) = taps.iter().find(|&&t| t as usize >= n) {
        return Err(Error::Flag(format!(
            "--taps: layer {bad} does not exist (the target has {n} layers, ids 0..{})",
            n - 1
        )));
    }
    if taps.is_empty() {
        return Err(Error::Flag("--taps: expected at least one layer id".into()));
    }
    // A tap is a layer's output before the final norm; of the last layer, serving engines
    // pass HF's hidden_states[n], which is after it: the drafter would be served another
    // feature than it was trained on.
    if let (Some(_), Some(last)) = (&args.taps, taps.iter().find(|&&t| t as usize + 1 == n)) {
        return Err(Error::Flag(format!(
            "--taps: layer {last} is the target's last; its output is fed to the drafter before the final norm in training but after it by the serving engines (HF hidden_states[{n}]), so the drafter would be served another feature (expected layers below {last})"
        )));
    }
    Ok(CaptureSpec {
        tap_ids: taps,
        hidden: target.hidden_size as u32,
        dtype: DTYPE_BF16,
        target: target.fingerprint(),
    })
}

fn start_signal_thread(
    tx: std::sync::mpsc::Sender<dispatcher::Event>,
    mut signals: signal_hook::iterator::Signals,
) -> Result<(), Error> {
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            for sig in signals.forever() {
                if tx.send(dispatcher::Event::Signal(sig)).is_err() {
                    break;
                }
            }
        })
        .map_err(|e| Error::start("signal thread", e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resumed_auto_run_takes_up_the_split_its_last_session_ended_with() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("events.jsonl");
        let lines = [
            r#"{"event": "run_start", "workers": ["target-0 on cpu", "drafter-0 on cpu", "drafter-1 on cpu", "drafter-2 on cpu"]}"#,
            r#"{"event": "role_move", "from": "drafter-2", "to": "target-1"}"#,
            r#"{"event": "run_end"}"#,
            r#"{"event": "run_start", "workers": ["target-0 on cpu", "target-1 on cpu", "drafter-0 on cpu", "drafter-1 on cpu"]}"#,
            r#"{"event": "role_move", "from": "drafter-1", "to": "target-2"}"#,
            r#"{"event": "role_move", "from": "target-2", "to": "drafter-1"}"#,
            r#"{"event": "role_move", "from": "drafter-1", "to": "target-2"}"#,
        ];
        std::fs::write(&f, lines.join("\n")).unwrap();
        assert_eq!(targets_when_stopped(&f), Some(3));
        std::fs::write(&f, lines[..2].join("\n")).unwrap();
        assert_eq!(targets_when_stopped(&f), Some(2));
        std::fs::write(&f, "").unwrap();
        assert_eq!(targets_when_stopped(&f), None);
        assert_eq!(targets_when_stopped(&d.path().join("none")), None);
    }

    fn args(extra: &[&str]) -> RunArgs {
        crate::cli::run_args(extra)
    }

    #[test]
    fn without_targets_a_run_balances_where_there_is_a_split_to_choose() {
        let settled = |flags: &[&str]| {
            let mut a = args(flags);
            let line = auto_start(&mut a, None, &mut || Ok(0)).unwrap();
            let t = a.targets.unwrap();
            let auto = matches!(t, Targets::Auto { .. });
            assert_eq!(line.is_some(), auto, "{flags:?}: {line:?}");
            if auto && !flags.contains(&"--targets") {
                assert!(line.unwrap().contains("the default on 3 or more devices"));
            }
            t
        };
        for (flags, auto) in [
            (&["--gpus", "cpu:2"][..], false),
            (&["--gpus", "cpu:3"], true),
            (&["--gpus", "cpu:8"], true),
            (&["--gpus", "cpu:4", "--targets", "2"], false),
            (
                &["--target-gpus", "cpu:1", "--drafter-gpus", "cpu:3"],
                false,
            ),
        ] {
            let t = settled(flags);
            assert_eq!(
                matches!(t, Targets::Auto { start: Some(_) }),
                auto,
                "{flags:?}: {t:?}"
            );
        }
        assert_eq!(settled(&["--gpus", "cpu:2"]), Targets::Fixed(1));
        assert_eq!(
            settled(&["--gpus", "cpu:4", "--targets", "2"]),
            Targets::Fixed(2)
        );
    }

    fn names(p: &[(WorkerName, Device)]) -> Vec<String> {
        p.iter().map(|(n, d)| format!("{n}@{d}")).collect()
    }

    #[test]
    fn cpu_split_by_targets() {
        let p = plan(&args(&["--gpus", "cpu:3", "--targets", "1"]), &mut || {
            panic!("NVML asked for cpu")
        })
        .unwrap();
        assert_eq!(
            names(&p),
            ["target-0@cpu", "drafter-0@cpu", "drafter-1@cpu"]
        );
    }

    #[test]
    fn gpus_split_first_n_are_targets() {
        let p = plan(&args(&["--gpus", "0-7", "--targets", "2"]), &mut || Ok(8)).unwrap();
        assert_eq!(names(&p)[..3], ["target-0@0", "target-1@1", "drafter-0@2"]);
        assert_eq!(p.len(), 8);
    }

    #[test]
    fn a_target_over_several_gpus_holds_consecutive_ones_and_the_rest_train() {
        let p = placement(
            &args(&["--gpus", "0-7", "--targets", "1", "--gpus-per-target", "4"]),
            &mut || Ok(8),
        )
        .unwrap();
        assert_eq!(
            names(&p.workers),
            [
                "target-0@0",
                "drafter-0@4",
                "drafter-1@5",
                "drafter-2@6",
                "drafter-3@7"
            ]
        );
        assert_eq!(p.target_spans, [vec![0, 1, 2, 3]]);
        let p = placement(
            &args(&[
                "--gpus",
                "1,3,5,7,0",
                "--targets",
                "2",
                "--gpus-per-target",
                "2",
            ]),
            &mut || Ok(8),
        )
        .unwrap();
        assert_eq!(
            names(&p.workers),
            ["target-0@1", "target-1@5", "drafter-0@0"]
        );
        assert_eq!(p.target_spans, [vec![1, 3], vec![5, 7]]);
        let p = placement(
            &args(&[
                "--target-gpus",
                "4-7",
                "--drafter-gpus",
                "0-3",
                "--gpus-per-target",
                "2",
            ]),
            &mut || Ok(8),
        )
        .unwrap();
        assert_eq!(names(&p.workers)[..2], ["target-0@4", "target-1@6"]);
        assert_eq!(p.target_spans, [vec![4, 5], vec![6, 7]]);
        // One GPU per target: no spans to give.
        let p = placement(&args(&["--gpus", "0-3"]), &mut || Ok(4)).unwrap();
        assert_eq!(p.target_spans, [Vec::<u32>::new()]);
    }

    #[test]
    fn targets_over_gpus_that_do_not_divide_or_fit_are_refused_saying_what_would() {
        let refused = |a: &[&str], needles: &[&str]| {
            let e = placement(&args(a), &mut || Ok(8)).unwrap_err();
            assert_eq!(e.exit_code(), 2, "{e}");
            let m = e.to_string();
            assert!(!m.contains('\n'), "{m}");
            for n in needles {
                assert!(m.contains(n), "{a:?}: {m}");
            }
        };
        refused(
            &["--gpus", "0-3", "--gpus-per-target", "4"],
            &["takes 4 of the 4 device(s)", "at most --gpus-per-target 3"],
        );
        refused(
            &["--gpus", "0-7", "--targets", "3", "--gpus-per-target", "3"],
            &[
                "takes 9 of the 8",
                "at most --gpus-per-target 2 with --targets 3",
            ],
        );
        refused(
            &[
                "--target-gpus",
                "0-5",
                "--drafter-gpus",
                "6,7",
                "--gpus-per-target",
                "4",
            ],
            &["--target-gpus gives 6 device(s)", "expected 4 or 8"],
        );
        refused(
            &["--gpus", "cpu:4", "--gpus-per-target", "2"],
            &["CPU workers have no GPUs"],
        );
        refused(&["--gpus-per-target", "0"], &["expected 1 or more"]);
    }

    #[test]
    fn explicit_roles_may_share_a_gpu() {
        let p = plan(
            &args(&["--target-gpus", "0", "--drafter-gpus", "0,1"]),
            &mut || Ok(2),
        )
        .unwrap();
        assert_eq!(names(&p), ["target-0@0", "drafter-0@0", "drafter-1@1"]);
    }

    #[test]
    fn default_is_all_gpus_or_two_cpu_workers() {
        assert_eq!(plan(&args(&[]), &mut || Ok(4)).unwrap().len(), 4);
        let p = plan(&args(&[]), &mut || Err(gpus::NvmlUnavailable::NotLoaded)).unwrap();
        assert_eq!(names(&p), ["target-0@cpu", "drafter-0@cpu"]);
    }

    #[test]
    fn too_many_targets_and_missing_driver_are_usage_errors() {
        let e = plan(&args(&["--gpus", "cpu:3", "--targets", "3"]), &mut || Ok(0)).unwrap_err();
        assert!(
            e.to_string().contains("--targets 3 leaves no drafter"),
            "{e}"
        );
        assert_eq!(e.exit_code(), 2);
        let e = plan(&args(&["--gpus", "0-7"]), &mut || {
            Err(gpus::NvmlUnavailable::NotLoaded)
        })
        .unwrap_err();
        assert!(e.to_string().contains("cpu:N"), "{e}");
    }

    fn target_of(layers: usize) -> TargetConfig {
        let text = dflash_shared::model_config::TINY_CONFIG.replace(
            "\"num_hidden_layers\": 6",
            &format!("\"num_hidden_layers\": {layers}"),
        );
        let t = TargetConfig::read(&text).unwrap();
        assert_eq!(t.num_hidden_layers, layers);
        t
    }

    #[test]
    fn drafters_on_cpu_workers_with_a_real_target_default_to_a_step_of_seconds() {
        let cpu = plan(&args(&["--gpus", "cpu:2"]), &mut || Ok(0)).unwrap();
        assert_eq!(
            default_token_budget("/models/qwen3", &cpu),
            CPU_TOKEN_BUDGET
        );
        assert_eq!(default_max_anchors("/models/qwen3", &cpu), 32);
        assert_eq!(default_token_budget("tiny", &cpu), 2048);
        let gpus = plan(&args(&["--gpus", "0-1"]), &mut || Ok(2)).unwrap();
        assert_eq!(default_token_budget("/models/qwen3", &gpus), 4096);
        assert_eq!(default_max_anchors("/models/qwen3", &gpus), 512);
        // trainer_config takes it.
        let a = args(&["--gpus", "cpu:2", "--target", "/models/qwen3"]);
        let t6 = target_of(6);
        let c = capture_spec(&a, &t6).unwrap();
        let t = trainer_config(&a, &cpu, &t6, &c).unwrap();
        assert_eq!(t.drafter.max_anchors, 32);
    }

    #[test]
    fn a_shallow_targets_default_taps_are_distinct_and_the_drafter_reads_that_many() {
        let a = args(&["--gpus", "cpu:2"]);
        let four = target_of(4);
        let c = capture_spec(&a, &four).unwrap();
        assert_eq!(c.tap_ids, [1], "a 4-layer target: not [1, 1]");
        let p = plan(&a, &mut || Ok(0)).unwrap();
        let t = trainer_config(&a, &p, &four, &c).unwrap();
        assert_eq!((t.drafter.n_taps, t.drafter.layers), (1, 2));
        assert_eq!(t.target_layer_ids, [1]);
        // The tiny target keeps its two.
        let tiny = capture_spec(&a, &target_of(6)).unwrap();
        assert_eq!(tiny.tap_ids, [1, 3]);
        // --draft-layers 5 on 6 layers: three distinct taps.
        let c = capture_spec(&args(&["--draft-layers", "5"]), &target_of(6)).unwrap();
        assert_eq!(c.tap_ids, [1, 2, 3]);
    }

    #[test]
    fn a_tap_of_the_last_layer_is_refused_as_serving_would_feed_another_feature() {
        let e = capture_spec(&args(&["--taps", "1,5"]), &target_of(6)).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        let m = e.to_string();
        assert!(
            m.contains("layer 5 is the target's last") && m.contains("hidden_states[6]"),
            "{m}"
        );
        assert!(capture_spec(&args(&["--taps", "1,4"]), &target_of(6)).is_ok());
    }

    #[test]
    fn taps_out_of_layer_order_are_refused() {
        let e = capture_spec(&args(&["--taps", "3,1"]), &target_of(6)).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert_eq!(
            e.to_string(),
            "--taps 3,1: expected ascending layer ids (the serving engines feed the drafter its taps in layer order)"
        );
    }

    #[test]
    fn duplicate_taps_are_refused_naming_the_layer() {
        let e = capture_spec(&args(&["--taps", "1,1"]), &target_of(6)).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert_eq!(
            e.to_string(),
            "--taps 1,1: layer 1 is given twice (expected distinct layer ids)"
        );
    }
}
