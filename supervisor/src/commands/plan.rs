//! `dflash-supervise plan [RUN FLAGS]`: how to split the devices between target and
//! drafter workers, before a run. It starts no worker and touches no GPU beyond NVML.
//!
//! For each role it estimates the device memory one worker needs (the weights it loads,
//! its activations at the token budget, the drafter's training state, and a stated
//! allowance for the CUDA context, cuBLAS and the kernels) against each device, lists
//! every split of the devices (`--targets N`) with whether it fits and the tokens/s it
//! would train, and recommends the fastest that fits with its command line. The tokens/s
//! come from the roofline (each role's FLOPs per token against the GPU's bf16 peak: a
//! ceiling) or, with `--from RUN_DIR`, from the per-worker rates an earlier run measured
//! (each corrected by the share of the time its workers waited on the other role).
//! Whichever the source, a split's figure is the slower role's: targets × a target's rate
//! against drafters × a drafter's.

use std::path::Path;

use dflash_shared::drafter::ParamLayout;
use dflash_shared::layer_split::device_loads;
use dflash_shared::Device;
use serde::Serialize;

use crate::cli::{PlanArgs, RunArgs};
use crate::error::Error;
use crate::run::{gpu_fit, validate};
use crate::telemetry::gpus;
use crate::telemetry::window::Window;

/// What every GPU worker needs besides its buffers: the CUDA context, cuBLAS's workspace
/// and the kernels' module (stated in the plan's output).
pub const CUDA_ALLOWANCE: u64 = 1 << 30;

pub use crate::run::gpu_fit::DRAFTER_BYTES_PER_PARAM;

/// One device the plan places workers on.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PlanDevice {
    /// The NVML index; `None` for a CPU worker.
    pub gpu: Option<u32>,
    pub name: String,
    /// The memory a worker may use there: the GPU's free memory (total where NVML does
    /// not say), or the host's available memory shared by the CPU workers.
    pub memory_bytes: Option<u64>,
}

/// What one worker of a role needs, by part.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Need {
    /// The largest share of the target's weights on one of its GPUs (a target), or the
    /// drafter's training state (a drafter).
    pub weights_bytes: u64,
    /// The frozen embedding and lm_head (a drafter), 0 for a target (counted in weights).
    pub frozen_bytes: u64,
    pub activations_bytes: u64,
    pub allowance_bytes: u64,
    pub total_bytes: u64,
}

/// One split: `targets` target workers (each over `gpus_per_target` devices), the rest
/// drafters.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Split {
    pub targets: u32,
    pub drafters: u32,
    /// Why it does not fit (`None`: it fits).
    pub refused: Option<String>,
    pub tokens_per_s: Option<f64>,
    /// The role that limits it: `target` or `drafter`.
    pub bound_by: Option<&'static str>,
}

/// Each role's rate of one worker, in tokens/s, and where it comes from.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Rates {
    pub target_tokens_per_s: f64,
    pub drafter_tokens_per_s: f64,
    /// `roofline` (at the GPU's bf16 peak), `flops` (relative: no peak known for the
    /// device, the figures are tokens per TFLOP) or `measured` (`--from`).
    pub source: String,
}

/// The plan.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    pub devices: Vec<PlanDevice>,
    pub gpus_per_target: u32,
    pub target: Need,
    pub drafter: Need,
    pub target_flops_per_token: f64,
    pub drafter_flops_per_token: f64,
    pub rates: Rates,
    pub splits: Vec<Split>,
    /// The fastest split that fits.
    pub recommended: Option<u32>,
    pub command: Option<String>,
}

/// `dflash-supervise plan`. `argv`: the command line, for the recommended command.
pub fn run(a: PlanArgs, argv: &[std::ffi::OsString]) -> Result<i32, Error> {
    let args = match a.run.config {
        Some(_) => with_config(argv)?,
        None => a.run,
    };
    let devices = devices(&args)?;
    let per = args.gpus_per_target.max(1);
    let settings = crate::run::plan_settings(&args)?;
    let on_gpu = devices.iter().any(|d| d.gpu.is_some());
    let needs_of = |p: u32| needs(&args, &settings, p, on_gpu);
    let needs = needs_of(per)?;
    let (tf, df) = flops_per_token(&args, &settings)?;
    let rates = match &a.from {
        Some(dir) => measured(dir)?,
        None => roofline(&devices, tf, df),
    };
    let splits = splits(&devices, per, &needs, &rates);
    let recommended = best(&splits);
    // Nothing fits: would spreading each target over more GPUs?
    let wider = match recommended {
        Some(_) => None,
        None => (per + 1..devices.len() as u32)
            .map(|p| Ok((p, needs_of(p)?)))
            .collect::<Result<Vec<_>, Error>>()?
            .into_iter()
            .find(|(p, n)| best(&self::splits(&devices, *p, n, &rates)).is_some())
            .map(|(p, _)| p),
    };
    let plan = Plan {
        command: recommended.map(|t| command_line(argv, t)),
        devices,
        gpus_per_target: per,
        target: needs.0,
        drafter: needs.1,
        target_flops_per_token: tf,
        drafter_flops_per_token: df,
        rates,
        splits,
        recommended,
    };
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&plan).map_err(|e| Error::json("the plan", e))?
        );
    } else {
        print!("{}", text(&plan));
    }
    match plan.recommended {
        Some(_) => Ok(dflash_shared::exit_codes::SUCCESS),
        None => Err(Error::Flag(refusal(&plan, wider))),
    }
}

/// The run flags of `argv` with its `--config` recipe applied, as a run reads them: the
/// command line without `plan`, `--from` and `--json`, parsed as a run's.
fn with_config(argv: &[std::ffi::OsString]) -> Result<RunArgs, Error> {
    match crate::run::config_file::parse(&run_argv(argv, &["--from"])) {
        Ok(c) => Ok(c.cli.run),
        Err(crate::run::config_file::CommandLineError::Config(e)) => Err(e),
        Err(crate::run::config_file::CommandLineError::Clap(e)) => {
            Err(Error::Flag(crate::cli::error_line(&e)))
        }
    }
}

/// The devices of `--gpus` (every GPU NVML reports by default), each with its memory.
fn devices(args: &RunArgs) -> Result<Vec<PlanDevice>, Error> {
    if args.target_gpus.is_some() || args.drafter_gpus.is_some() {
        return Err(Error::Flag(
            "plan: --target-gpus and --drafter-gpus fix the split it would choose (expected --gpus SPEC: the devices to split)".into(),
        ));
    }
    let spec = args.gpus.clone().unwrap_or(dflash_shared::DeviceSpec::All);
    if let dflash_shared::DeviceSpec::Cpu(n) = spec {
        let each = crate::data::pipeline::mem_available().map(|m| m / u64::from(n.max(1)));
        return Ok((0..n)
            .map(|_| PlanDevice {
                gpu: None,
                name: "CPU worker".into(),
                memory_bytes: each,
            })
            .collect());
    }
    let (_, list) = gpus::list().map_err(|e| {
        Error::Flag(format!(
            "--gpus: {e}: plan needs NVML to see the GPUs (expected an NVIDIA driver, or --gpus cpu:N to plan CPU workers)"
        ))
    })?;
    let resolved = spec
        .resolve(Ok::<u32, String>(list.len() as u32), "--gpus")
        .map_err(Error::from)?;
    Ok(resolved
        .into_iter()
        .filter_map(|d| match d {
            Device::Gpu(g) => list.iter().find(|x| x.index == g).map(|x| PlanDevice {
                gpu: Some(g),
                name: x.name.clone(),
                memory_bytes: x.memory_free_bytes.or(x.memory_total_bytes),
            }),
            Device::Cpu => None,
        })
        .collect())
}

/// One target worker's and one drafter worker's memory: on a GPU (bf16 weights and
/// activations, the drafter's mixed-precision state, the CUDA allowance), or on the host
/// for CPU workers (f32 throughout, no allowance).
fn needs(
    args: &RunArgs,
    s: &crate::run::PlanSettings,
    per: u32,
    on_gpu: bool,
) -> Result<(Need, Need), Error> {
    let (tcfg, d) = (&s.target, &s.drafter);
    let last = s.taps.iter().copied().max().unwrap_or(0) as usize;
    let (layers, rest) = gpu_fit::weight_bytes(&args.target, tcfg, last)?;
    // weight_bytes counts bf16; the CPU worker holds f32.
    let widen = if on_gpu { 1 } else { 2 };
    let weights = widen
        * device_loads(&layers, per as usize, rest)
            .into_iter()
            .max()
            .unwrap_or(0) as u64;
    let elem = if on_gpu { 2u64 } else { 4 };
    // As the host estimate counts them, and on a GPU the taps' two staging copies.
    let staging = if on_gpu {
        2 * (s.taps.len() * tcfg.hidden_size) as u64
    } else {
        0
    };
    let per_token = validate::target_activation_elements_per_token(tcfg, s.taps.len()) + staging;
    let target_act = s.token_budget as u64 * per_token * elem;
    let allowance = if on_gpu { CUDA_ALLOWANCE } else { 0 };
    let target = need(weights, 0, target_act, allowance);
    let params = ParamLayout::new(d).total as u64;
    let table = (d.vocab * d.hidden) as u64;
    // On a GPU the embedding in f32 and the lm_head in bf16; on the CPU both f32 (one
    // table where the target ties them).
    let (frozen, state) = if on_gpu {
        let (state, frozen) = gpu_fit::drafter_fixed_bytes(d);
        (frozen, state)
    } else {
        let tables = if tcfg.tie_word_embeddings { 1 } else { 2 };
        (table * 4 * tables, params * 4 * 4)
    };
    let drafter_act = validate::drafter_activation_elements(d, args.max_seq_len) * 4;
    let drafter = need(state, frozen, drafter_act, allowance);
    Ok((target, drafter))
}

fn need(weights: u64, frozen: u64, activations: u64, allowance: u64) -> Need {
    Need {
        weights_bytes: weights,
        frozen_bytes: frozen,
        activations_bytes: activations,
        allowance_bytes: allowance,
        total_bytes: weights + frozen + activations + allowance,
    }
}

/// Each role's FLOPs per token (see [`crate::run::balance::flops_per_token`]).
fn flops_per_token(args: &RunArgs, s: &crate::run::PlanSettings) -> Result<(f64, f64), Error> {
    crate::run::balance::flops_per_token(
        &args.target,
        (&s.target, &s.drafter),
        &s.taps,
        args.max_seq_len,
    )
}

/// bf16 dense tensor-core peak of a GPU, by NVML's name, in FLOP/s.
pub fn peak_bf16(name: &str) -> Option<f64> {
    let n = name.to_ascii_uppercase();
    let table: [(&str, f64); 8] = [
        ("B200", 2250e12),
        ("GH200", 989e12),
        ("H200", 989e12),
        ("H100 PCIE", 756e12),
        ("H100", 989e12),
        ("A100", 312e12),
        ("L40S", 362e12),
        ("A10G", 70e12),
    ];
    table.iter().find(|(k, _)| n.contains(k)).map(|(_, p)| *p)
}

/// One worker's rates at the devices' bf16 peak (the first device's), or per TFLOP where
/// no peak is known (CPU workers, a GPU not in the table).
fn roofline(devices: &[PlanDevice], target_flops: f64, drafter_flops: f64) -> Rates {
    let peak = devices.first().and_then(|d| peak_bf16(&d.name));
    let (scale, source) = match peak {
        Some(p) => (p, "roofline"),
        None => (1e12, "flops"),
    };
    Rates {
        target_tokens_per_s: scale / target_flops.max(1.0),
        drafter_tokens_per_s: scale / drafter_flops.max(1.0),
        source: source.into(),
    }
}

/// One worker's rates as `dir`'s run measured them: the mean tokens/s per worker of each
/// role over its metrics windows that trained, each role's divided by the share of the
/// time its workers were not waiting on the other (a target blocked on a full hidden-state
/// pool, a drafter starved by an empty one), which is what they would do unhindered.
pub fn measured(dir: &Path) -> Result<Rates, Error> {
    let path = dir.join(crate::telemetry::metrics::METRICS_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| {
        Error::Flag(format!(
            "--from {}: cannot read {} ({e}); expected the directory of an earlier run",
            dir.display(),
            path.display()
        ))
    })?;
    let windows: Vec<Window> = text.lines().filter_map(Window::parse).collect();
    measured_rates(&windows).ok_or_else(|| {
        Error::Flag(format!(
            "--from {}: its metrics windows hold no trained step with tokens/s of both roles (expected a run that trained for a while)",
            dir.display()
        ))
    })
}

/// [`measured`] over parsed windows (the balancer's reading of them, see
/// [`crate::run::balance::Rates::of`]).
pub fn measured_rates(windows: &[Window]) -> Option<Rates> {
    let r = crate::run::balance::Rates::of(windows)?;
    Some(Rates {
        target_tokens_per_s: r.target,
        drafter_tokens_per_s: r.drafter,
        source: "measured".into(),
    })
}

/// Every split of `devices` into target workers of `per` devices each and drafters (at
/// least one of each): whether each worker's need fits its device, and the tokens/s.
pub fn splits(devices: &[PlanDevice], per: u32, needs: &(Need, Need), rates: &Rates) -> Vec<Split> {
    let n = devices.len() as u32;
    let per_n = per.max(1);
    (1..=n / per_n)
        .filter(|t| t * per_n < n)
        .map(|t| {
            let drafters = n - t * per_n;
            let (on_targets, on_drafters) = devices.split_at((t * per_n) as usize);
            let short = |role: &str, need: &Need, on: &[PlanDevice]| {
                on.iter().find_map(|dv| {
                    let have = dv.memory_bytes?;
                    (need.total_bytes > have).then(|| {
                        format!(
                            "a {role} worker needs {} and {} has {}",
                            human(need.total_bytes),
                            where_(dv),
                            human(have)
                        )
                    })
                })
            };
            let refused = short("target", &needs.0, on_targets)
                .or_else(|| short("drafter", &needs.1, on_drafters));
            let (tt, dd) = (
                t as f64 * rates.target_tokens_per_s,
                drafters as f64 * rates.drafter_tokens_per_s,
            );
            Split {
                targets: t,
                drafters,
                tokens_per_s: refused.is_none().then_some(tt.min(dd)),
                bound_by: refused
                    .is_none()
                    .then_some(if tt < dd { "target" } else { "drafter" }),
                refused,
            }
        })
        .collect()
}

fn where_(d: &PlanDevice) -> String {
    match d.gpu {
        Some(g) => format!("GPU {g} ({})", d.name),
        None => "a CPU worker's share of the host".into(),
    }
}

/// The fastest split that fits (the fewest targets among equals).
pub fn best(splits: &[Split]) -> Option<u32> {
    splits
        .iter()
        .filter_map(|s| Some((s.targets, s.tokens_per_s?)))
        .fold(None, |b: Option<(u32, f64)>, (t, r)| match b {
            Some((_, br)) if br >= r => b,
            _ => Some((t, r)),
        })
        .map(|(t, _)| t)
}

/// The command line of the plan (`plan`, `--from`, `--json` and any `--targets` left out)
/// as a run with `--targets N`.
fn command_line(argv: &[std::ffi::OsString], targets: u32) -> String {
    let mut out = vec!["dflash-supervise".to_string()];
    let words = run_argv(argv, &["--from", "--targets"]);
    out.extend(
        words
            .iter()
            .skip(1)
            .map(|a| shell_word(&a.to_string_lossy())),
    );
    out.push(format!("--targets {targets}"));
    out.join(" ")
}

/// `argv` as a run's command line: without the `plan` subcommand, `--json`, and the
/// options of `drop` (each with its value, given apart or after `=`).
fn run_argv(argv: &[std::ffi::OsString], drop: &[&str]) -> Vec<std::ffi::OsString> {
    let mut run = Vec::new();
    let mut it = argv.iter();
    let mut seen_plan = false;
    while let Some(a) = it.next() {
        let s = a.to_string_lossy();
        let flag = s.split('=').next().unwrap_or_default();
        match s.as_ref() {
            "plan" if !seen_plan && !run.is_empty() => seen_plan = true,
            "--json" => {}
            _ if drop.contains(&flag) => {
                if !s.contains('=') {
                    it.next();
                }
            }
            _ => run.push(a.clone()),
        }
    }
    run
}

fn shell_word(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:=,@+%".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

fn human(b: u64) -> String {
    crate::data::pipeline::human(b)
}

fn text(p: &Plan) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let dev = p
        .devices
        .first()
        .map(|d| d.name.clone())
        .unwrap_or_default();
    let mem = |d: &PlanDevice| d.memory_bytes.map_or("memory unknown".into(), human);
    let _ = writeln!(
        s,
        "devices: {} × {dev} ({} each)",
        p.devices.len(),
        p.devices.first().map(mem).unwrap_or_default()
    );
    let part = |n: &Need, what: &str| {
        let allowance = match n.allowance_bytes {
            0 => String::new(),
            a => format!(" + CUDA allowance {}", human(a)),
        };
        format!(
            "{} = {what} {} + activations {}{allowance}",
            human(n.total_bytes),
            human(n.weights_bytes + n.frozen_bytes),
            human(n.activations_bytes),
        )
    };
    let spread = match p.gpus_per_target {
        1 => String::new(),
        n => format!(" on the most loaded of its {n} GPUs"),
    };
    let _ = writeln!(
        s,
        "a target worker needs {}{spread}",
        part(&p.target, "weights")
    );
    let _ = writeln!(
        s,
        "a drafter worker needs {}",
        part(&p.drafter, "training state, frozen embedding and lm_head")
    );
    let unit = match p.rates.source.as_str() {
        "roofline" => "tokens/s at the GPU's bf16 peak (a ceiling)",
        "measured" => "tokens/s as the run of --from measured them",
        _ => "tokens per TFLOP (no peak known for this device: compare, do not read as tokens/s)",
    };
    let _ = writeln!(
        s,
        "one worker: target {:.0}, drafter {:.0} {unit}",
        p.rates.target_tokens_per_s, p.rates.drafter_tokens_per_s
    );
    let _ = writeln!(
        s,
        "{:>8} {:>9}  {:>12}  bound by",
        "targets", "drafters", "tokens"
    );
    for sp in &p.splits {
        match (&sp.refused, sp.tokens_per_s) {
            (Some(why), _) => {
                let _ = writeln!(
                    s,
                    "{:>8} {:>9}  does not fit: {why}",
                    sp.targets, sp.drafters
                );
            }
            (None, r) => {
                let _ = writeln!(
                    s,
                    "{:>8} {:>9}  {:>12.0}  {}{}",
                    sp.targets,
                    sp.drafters,
                    r.unwrap_or(0.0),
                    sp.bound_by.unwrap_or(""),
                    if Some(sp.targets) == p.recommended {
                        "  <- recommended"
                    } else {
                        ""
                    }
                );
            }
        }
    }
    if let Some(c) = &p.command {
        let _ = writeln!(s, "recommended: {c}");
    }
    s
}

/// Why no split fits, and what would (`wider`: a `--gpus-per-target` with which one does).
fn refusal(p: &Plan, wider: Option<u32>) -> String {
    let first = p
        .splits
        .iter()
        .find_map(|s| s.refused.clone())
        .unwrap_or_else(|| "there are too few devices for a target and a drafter".into());
    let most = p.devices.iter().filter_map(|d| d.memory_bytes).max();
    let drafter_fits = most.is_none_or(|m| p.drafter.total_bytes <= m);
    let smaller = "a smaller drafter (--draft-layers) or shorter rows (--max-seq-len) need less";
    let hint = match (wider, p.splits.first().and_then(|s| s.refused.as_deref())) {
        (Some(n), _) => format!("; --gpus-per-target {n} would fit"),
        (None, Some(_)) if !drafter_fits => format!(
            "; a drafter worker needs {}, more than any of these devices has: {smaller}",
            human(p.drafter.total_bytes)
        ),
        (None, Some(r)) if r.starts_with("a target") => {
            "; no --gpus-per-target fits these devices".to_string()
        }
        (None, Some(_)) => format!("; {smaller}"),
        (None, None) => String::new(),
    };
    format!(
        "plan: no split of the {} device(s) fits: {first}{hint}",
        p.devices.len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(mem: u64) -> PlanDevice {
        PlanDevice {
            gpu: Some(0),
            name: "NVIDIA H100 80GB HBM3".into(),
            memory_bytes: Some(mem),
        }
    }

    fn rates(t: f64, d: f64) -> Rates {
        Rates {
            target_tokens_per_s: t,
            drafter_tokens_per_s: d,
            source: "measured".into(),
        }
    }

    #[test]
    fn the_recommended_split_is_the_one_whose_slower_role_is_fastest() {
        let n = need(10, 0, 0, 0);
        let devices = vec![dev(100); 8];
        // A target does 100 tokens/s, a drafter 30: 2 targets and 6 drafters give
        // min(200, 180) = 180; 1 + 7: 100; 3 + 5: 150.
        let s = splits(&devices, 1, &(n.clone(), n.clone()), &rates(100.0, 30.0));
        assert_eq!(s.len(), 7);
        let at = |t: u32| s.iter().find(|x| x.targets == t).unwrap();
        assert_eq!(at(1).tokens_per_s, Some(100.0));
        assert_eq!(at(1).bound_by, Some("target"));
        assert_eq!(at(2).tokens_per_s, Some(180.0));
        assert_eq!(at(2).bound_by, Some("drafter"));
        assert_eq!(best(&s), Some(2));
        // Two GPUs per target: targets take 2, 4 or 6 of the 8.
        let s = splits(&devices, 2, &(n.clone(), n), &rates(100.0, 30.0));
        assert_eq!(
            s.iter()
                .map(|x| (x.targets, x.drafters))
                .collect::<Vec<_>>(),
            vec![(1, 6), (2, 4), (3, 2)]
        );
    }

    #[test]
    fn a_split_whose_worker_does_not_fit_is_refused_with_the_device_and_the_need() {
        let devices = vec![dev(1000), dev(1000), dev(100)];
        let small = need(10, 0, 0, 0);
        let big = need(0, 0, 0, 0);
        let big = Need {
            total_bytes: 500,
            ..big
        };
        // Drafters need 500: one on GPU index 2 (100) cannot be.
        let s = splits(&devices, 1, &(small, big), &rates(1.0, 1.0));
        assert!(s.iter().all(|x| x.refused.is_some()), "{s:?}");
        assert!(s[0]
            .refused
            .as_deref()
            .unwrap()
            .contains("a drafter worker needs 500 B"));
        assert_eq!(best(&s), None);
    }

    #[test]
    fn measured_rates_divide_each_worker_by_the_share_of_its_own_time_it_worked() {
        let w: Window = serde_json::from_value(serde_json::json!({
            "train": {"step": 5},
            "pipeline": {
                "tokens_per_s_by_worker": {"target-0": 50.0, "drafter-0": 40.0, "drafter-1": 60.0},
                "hidden_pool": {"producers_blocked_share": 0.0, "consumers_starved_share": 0.5},
                "phase_ms_by_worker": {
                    "target-0": {"wait": 300.0, "forward": 100.0},
                    "drafter-0": {"wait": 0.0, "forward_backward": 90.0, "optimizer": 10.0},
                },
            },
        }))
        .unwrap();
        let r = measured_rates(&[w]).unwrap();
        // The target waited three quarters of its time: alone it would do 200.
        assert_eq!(r.target_tokens_per_s, 200.0);
        // drafter-0 never waited (40); drafter-1 has no timings: the pool's starved share
        // stands in (60 / 0.5 = 120).
        assert_eq!(r.drafter_tokens_per_s, 80.0);
        assert_eq!(r.source, "measured");
    }

    #[test]
    fn the_command_line_is_the_plans_as_a_run_with_the_recommended_targets() {
        let argv: Vec<std::ffi::OsString> = [
            "dflash-supervise",
            "plan",
            "--gpus",
            "0-7",
            "--targets",
            "1",
            "--from",
            "runs/a",
            "--json",
            "--data",
            "my data.jsonl",
        ]
        .iter()
        .map(Into::into)
        .collect();
        assert_eq!(
            command_line(&argv, 3),
            "dflash-supervise --gpus 0-7 --data 'my data.jsonl' --targets 3"
        );
    }

    #[test]
    fn peaks_are_known_by_nvml_name() {
        assert_eq!(peak_bf16("NVIDIA H100 80GB HBM3"), Some(989e12));
        assert_eq!(peak_bf16("NVIDIA H100 PCIe"), Some(756e12));
        assert_eq!(peak_bf16("NVIDIA H200"), Some(989e12));
        assert_eq!(peak_bf16("NVIDIA A100-SXM4-80GB"), Some(312e12));
        assert_eq!(peak_bf16("Fake GPU"), None);
    }
}
