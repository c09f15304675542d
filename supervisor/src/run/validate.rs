//! Checks of a run's settings before anything starts: every flag's range, and whether the
//! workers' memory fits the machine. Each failure is one line naming the flag and what
//! was expected (exit 2).

use std::path::Path;
use std::time::Duration;

use dflash_shared::drafter::{DrafterConfig, ParamLayout};
use dflash_shared::model_config::{expected_tensors, TargetConfig};
use dflash_shared::{Device, DeviceSpec, Role, WorkerName};

use crate::cli::{RunArgs, DEFAULT_MAX_SEQ_LEN};
use crate::data::pipeline::human;
use crate::error::Error;

/// The largest `--block-size`: DFlash uses 8 to 16; every block position is a row of
/// activations per anchor, so a block far past that only exhausts memory.
pub const MAX_BLOCK_SIZE: usize = 256;
/// The most drafter layers a run takes (DFlash drafters have 1 to 8; each layer taps one
/// target layer, so a larger number is a typo).
pub const MAX_DRAFT_LAYERS: usize = 64;
/// The shortest `--hang-timeout`: workers beat every tenth of it (at least every 20 ms), and
/// loading the target or a training step must fit in it.
pub const MIN_HANG_TIMEOUT: Duration = Duration::from_secs(1);
/// The largest `--lr`: AdamW's step is about `lr` per parameter, so anything above 1
/// destroys the weights in one step (and gives NaN losses).
pub const MAX_LR: f64 = 1.0;

/// The fewest CPU workers a run may always start, whatever the machine: the tests and
/// demos run three or four workers on two cores.
pub const MIN_CPU_WORKER_LIMIT: usize = 32;

/// The most CPU workers a run starts on a machine with `cores` cores: 4 per core, and at
/// least [`MIN_CPU_WORKER_LIMIT`]. Each is a process with its own threads and memory; past
/// this a typo (`cpu:1000`) would only fork the machine to a standstill.
pub fn max_cpu_workers(cores: usize) -> usize {
    cores.saturating_mul(4).max(MIN_CPU_WORKER_LIMIT)
}

/// The cores this process may run on.
fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Refuse more CPU workers than [`max_cpu_workers`], from the device flags themselves:
/// before the plan, which holds one entry per worker.
fn check_cpu_workers(a: &RunArgs, cores: usize) -> Result<(), Error> {
    let cpu = |s: &Option<DeviceSpec>| match s {
        Some(DeviceSpec::Cpu(n)) => *n as u64,
        _ => 0,
    };
    let (asked, shown) = match (&a.target_gpus, &a.drafter_gpus) {
        (Some(_), Some(_)) => {
            let (t, d) = (cpu(&a.target_gpus), cpu(&a.drafter_gpus));
            (
                t + d,
                format!(
                    "--target-gpus cpu:{t} --drafter-gpus cpu:{d}: {} CPU workers",
                    t + d
                ),
            )
        }
        _ => {
            let n = cpu(&a.gpus);
            (n, format!("--gpus cpu:{n}"))
        }
    };
    let max = max_cpu_workers(cores);
    if asked > max as u64 {
        return Err(Error::Flag(format!(
            "{shown}: expected at most {max} CPU workers on this machine \
             (4 per core for its {cores} core(s), at least {MIN_CPU_WORKER_LIMIT})"
        )));
    }
    Ok(())
}

/// The warning for `cpu_workers` CPU workers on `cores` cores, if they outnumber them.
pub fn oversubscription(cpu_workers: usize, cores: usize) -> Option<String> {
    (cpu_workers > cores).then(|| {
        format!(
            "{cpu_workers} CPU workers on {cores} core(s): they share the cores, so each \
             runs slower than alone (expected at most {cores} for full speed)"
        )
    })
}

/// The plan's CPU workers and the cores they share, when they outnumber them.
pub fn oversubscribed(plan: &[(WorkerName, Device)]) -> Option<(usize, usize)> {
    let cpu = plan
        .iter()
        .filter(|(_, d)| matches!(d, Device::Cpu))
        .count();
    let cores = cores();
    (cpu > cores).then_some((cpu, cores))
}

/// Warn (one line) when the plan's CPU workers outnumber the cores.
pub fn warn_if_oversubscribed(plan: &[(WorkerName, Device)]) {
    if let Some(w) = oversubscribed(plan).and_then(|(cpu, cores)| oversubscription(cpu, cores)) {
        log::warn!("{w}");
    }
}

/// `--max-seq-len` against the target's context length (`max_position_embeddings`, when
/// its config.json gives one): positions past it were never trained.
pub fn check_context(max_seq_len: u32, target: &TargetConfig, dir: &str) -> Result<(), Error> {
    match target.max_position_embeddings {
        Some(m) if max_seq_len as u64 > m as u64 => Err(Error::Flag(format!(
            "--max-seq-len {max_seq_len} exceeds the target's max_position_embeddings {m} \
             ({dir}/config.json); expected at most {m}"
        ))),
        _ => Ok(()),
    }
}

/// The default `--max-seq-len` (1024) adapts to a target whose context is shorter
/// (`max_position_embeddings`): the line that says so is returned (said once the run
/// starts); a value given (`given`: the flags typed) is kept, and refused by
/// [`check_context`] if it is past the target.
pub fn adapt_max_seq_len(a: &mut RunArgs, given: &[String]) -> Option<String> {
    if given.iter().any(|g| g == "max_seq_len")
        || a.max_seq_len != DEFAULT_MAX_SEQ_LEN
        || a.target == "tiny"
    {
        return None;
    }
    let t = TargetConfig::load(Path::new(&a.target)).ok()?;
    let m = t
        .max_position_embeddings
        .filter(|&m| m < a.max_seq_len as usize)?;
    a.max_seq_len = m as u32;
    Some(format!(
        "--max-seq-len {m}: the target's max_position_embeddings ({}/config.json), below the default {DEFAULT_MAX_SEQ_LEN}",
        a.target
    ))
}

/// Every flag's range, before the run starts. (Flags whose checks need the target or the
/// devices — `--taps`, `--mask-token-id`, `--targets` — are checked where those are known.)
pub fn check_flags(a: &RunArgs) -> Result<(), Error> {
    check_eval(a)?;
    check_durations(a)?;
    check_lengths(a)?;
    check_blocks(a)?;
    check_optimizer(a)?;
    check_pipeline(a)?;
    check_cpu_workers(a, cores())?;
    if a.target != "tiny" {
        // A config.json that cannot be read is refused where the target is loaded, with
        // its own reason; here only its context length is of interest.
        if let Ok(t) = TargetConfig::load(Path::new(&a.target)) {
            check_context(a.max_seq_len, &t, &a.target)?;
        }
    }
    Ok(())
}

/// `FLAG VALUE: expected EXPECTED`, the refusal of a flag out of range.
fn bad(flag: &str, value: String, expected: &str) -> Result<(), Error> {
    Err(Error::Flag(format!("{flag} {value}: expected {expected}")))
}

/// A duration as a flag takes it (`1m 30s`).
fn dur(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

/// `--eval-every`: with `--eval-data` or `--eval-prompts`, above 0; `--eval-gpu` with
/// `--eval-prompts`.
fn check_eval(a: &RunArgs) -> Result<(), Error> {
    if let (Some(g), None) = (a.eval_gpu, &a.eval_prompts) {
        return Err(Error::Flag(format!(
            "--eval-gpu {g}: there is nothing to measure on it; expected --eval-prompts FILE with it"
        )));
    }
    if a.allow_changed_data && a.resume.is_none() && !a.resume_if_exists {
        return Err(Error::Flag(
            "--allow-changed-data: there is no run to resume, so no change to allow; expected it with --resume RUN_DIR or --resume-if-exists".into(),
        ));
    }
    if let Some(e) = &a.eval_data {
        // The file itself, or a file of the training directory (read with it).
        let data = Path::new(&a.data);
        let within = data.is_dir()
            && e.parent()
                .map(|p| {
                    if p.as_os_str().is_empty() {
                        Path::new(".")
                    } else {
                        p
                    }
                })
                .is_some_and(|p| same_file(p, data));
        if same_file(e, data) || within {
            return Err(Error::Flag(format!(
                "--eval-data {}: is {} the training data (--data {}), so its acceptance says nothing about data the drafter has not seen; expected held-out data",
                e.display(),
                if within { "in" } else { "" },
                a.data
            ).replace("is  the", "is the")));
        }
    }
    if let Some(n) = a.eval_every {
        if a.eval_data.is_none() && a.eval_prompts.is_none() {
            return Err(Error::Flag(format!(
                "--eval-every {n}: there is nothing to evaluate; expected --eval-data FILE or --eval-prompts FILE with it"
            )));
        }
        if n == 0 {
            return bad(
                "--eval-every",
                n.to_string(),
                "a number of steps above 0 (leave it out to evaluate at every checkpoint)",
            );
        }
    }
    Ok(())
}

/// Whether `a` and `b` are one file or directory (the same device and inode, whatever
/// the paths that name them).
fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => false,
    }
}

/// The timeouts and intervals: above zero (the hang timeout at least 1s).
fn check_durations(a: &RunArgs) -> Result<(), Error> {
    if a.hang_timeout < MIN_HANG_TIMEOUT {
        return bad(
            "--hang-timeout",
            dur(a.hang_timeout),
            "at least 1s (workers beat every tenth of it; a shorter one kills healthy workers)",
        );
    }
    if let Some(d) = a.step_timeout.filter(|d| d.is_zero()) {
        return bad(
            "--step-timeout",
            dur(d),
            "a duration above zero, such as 30m (a unit of work that takes longer is killed as hung)",
        );
    }
    for (flag, d) in [
        ("--stop-timeout", a.stop_timeout),
        ("--stable-after", a.stable_after),
        ("--gpu-sample-interval", a.gpu_sample_interval),
        ("--metrics-interval", a.metrics_interval),
        ("--collective-timeout", a.collective_timeout),
    ] {
        if d.is_zero() {
            return bad(flag, dur(d), "a duration above zero, such as 500ms or 30s");
        }
    }
    if a.time_limit.is_some_and(|d| d.is_zero()) {
        return bad(
            "--time-limit",
            "0s".into(),
            "a duration above zero (or no --time-limit to run until stopped)",
        );
    }
    Ok(())
}

/// How much is kept and trained: checkpoints, steps, sequence length, epochs, drafter
/// layers.
fn check_lengths(a: &RunArgs) -> Result<(), Error> {
    if a.keep_checkpoints == 0 {
        return bad(
            "--keep-checkpoints",
            "0".into(),
            "at least 1 (the newest checkpoint is what --resume continues from)",
        );
    }
    if a.steps == Some(0) {
        return bad("--steps", "0".into(), "at least 1");
    }
    if a.max_seq_len < 2 {
        return bad(
            "--max-seq-len",
            a.max_seq_len.to_string(),
            "at least 2 (a sample needs a context and a token to predict)",
        );
    }
    if a.epochs == Some(0) {
        return bad("--epochs", "0".into(), "at least 1");
    }
    if let Some(n) = a.draft_layers {
        if n == 0 {
            return bad("--draft-layers", "0".into(), "at least 1");
        }
        if n > MAX_DRAFT_LAYERS {
            return bad(
                "--draft-layers",
                n.to_string(),
                &format!("at most {MAX_DRAFT_LAYERS} (DFlash drafters have 1 to 8)"),
            );
        }
    }
    Ok(())
}

/// The block size and the anchors per sample: within the drafter's limits and a sample.
fn check_blocks(a: &RunArgs) -> Result<(), Error> {
    let tiny = a.target == "tiny";
    let (block, block_given) = match a.block_size {
        Some(b) => (b, true),
        None => (if tiny { 8 } else { 16 }, false),
    };
    let shown = if block_given {
        block.to_string()
    } else {
        format!("{block} (the default)")
    };
    if block < 2 {
        return bad(
            "--block-size",
            shown,
            "at least 2 (a block is the anchor token and the tokens drafted after it)",
        );
    }
    if block > MAX_BLOCK_SIZE {
        return bad(
            "--block-size",
            shown,
            &format!("at most {MAX_BLOCK_SIZE} (DFlash uses 8 to 16)"),
        );
    }
    if block as u64 > a.max_seq_len as u64 {
        return bad(
            "--block-size",
            shown,
            &format!(
                "at most --max-seq-len {} (a block must fit in a sample)",
                a.max_seq_len
            ),
        );
    }
    if a.max_anchors == Some(0) {
        return bad("--max-anchors", "0".into(), "at least 1");
    }
    if let Some(n) = a.max_anchors.filter(|&n| n as u64 > a.max_seq_len as u64) {
        return bad(
            "--max-anchors",
            n.to_string(),
            &format!(
                "at most --max-seq-len {} (an anchor is a position of a sample)",
                a.max_seq_len
            ),
        );
    }
    Ok(())
}

/// The learning rate, its warmup and the loss's decay: in range.
fn check_optimizer(a: &RunArgs) -> Result<(), Error> {
    if let Some(lr) = a.lr {
        if !(lr > 0.0 && lr.is_finite() && lr <= MAX_LR) {
            return bad(
                "--lr",
                format!("{lr:?}"),
                "a learning rate above 0 and at most 1 (the public recipe uses 6e-4)",
            );
        }
    }
    if let Some(w) = a.warmup_ratio {
        if !(0.0..1.0).contains(&w) {
            return bad("--warmup-ratio", w.to_string(), "a fraction in [0, 1)");
        }
    }
    if let Some(g) = a.gamma {
        if !(g > 0.0 && g.is_finite()) {
            return bad(
                "--gamma",
                g.to_string(),
                "a positive number (7 for blocks of 16)",
            );
        }
    }
    Ok(())
}

/// The pools' slots and the loader's budget, prefetch and shuffle window: at least 1.
fn check_pipeline(a: &RunArgs) -> Result<(), Error> {
    for (flag, v) in [
        ("--token-slots", a.token_slots),
        ("--hidden-slots", a.hidden_slots),
    ] {
        if v == Some(0) {
            return bad(flag, "0".into(), "at least 1");
        }
    }
    for (flag, v) in [
        ("--token-budget", a.token_budget.map(u64::from)),
        ("--prefetch", Some(a.prefetch as u64)),
        ("--shuffle-window", Some(a.shuffle_window as u64)),
    ] {
        if v == Some(0) {
            return bad(flag, "0".into(), "at least 1");
        }
    }
    Ok(())
}

/// Host memory of the workers, estimated from the configs and flags.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryEstimate {
    /// Parameters of the drafter.
    pub params: u64,
    /// One drafter rank: weights, gradients and two Adam moments (f32 each).
    pub drafter_state: u64,
    /// One drafter rank: the frozen target embeddings and lm_head it reads (f32).
    pub drafter_frozen: u64,
    /// One CPU drafter rank: activations of one sample's blocks, kept for the backward.
    pub drafter_activations: u64,
    /// One CPU target worker: the layers it runs (f32) and the activations of one packed
    /// forward (a whole batch: `target_tokens`, the token budget).
    pub target: u64,
    /// The target in words, for the report ("Qwen3-MoE: all 128 experts of its 47 sparse
    /// layers run", "Qwen3").
    pub target_what: String,
    /// Everything: every worker, plus `shared` (pools, gradient and state slots).
    pub total: u64,
}

/// Estimate the workers' host memory. It counts the big buffers only, so it is a floor:
/// a run it refuses cannot fit. `target_tokens`: the tokens of a target's forward (its
/// batch's rows run packed in one: the token budget). `loaded`: the weight elements a
/// CPU target loads as its checkpoint holds them (the torch engine's families, whose
/// shapes config.json does not describe: [`super::target_check::loaded_elements`]);
/// `None`: the native engine's tensors of `target`'s shapes.
#[allow(clippy::too_many_arguments)]
pub fn estimate_memory(
    drafter: &DrafterConfig,
    target: &TargetConfig,
    taps: &[u32],
    plan: &[(WorkerName, Device)],
    max_seq_len: u32,
    target_tokens: u32,
    shared: u64,
    loaded: Option<u64>,
) -> MemoryEstimate {
    let f = 4u64; // f32
    let params = ParamLayout::new(drafter).total as u64;
    let drafter_state = params * 4 * f;
    let table = (drafter.vocab * drafter.hidden) as u64 * f;
    let drafter_frozen = if target.tie_word_embeddings {
        table
    } else {
        2 * table
    };
    let drafter_activations = drafter_activation_elements(drafter, max_seq_len) * f;
    let last = taps.iter().copied().max().unwrap_or(0) as usize;
    let target_weights: u64 = loaded.unwrap_or_else(|| {
        expected_tensors(target, last + 1)
            .iter()
            .filter(|(n, _)| n != "lm_head.weight" && n != "model.norm.weight")
            .map(|(_, s)| s.iter().product::<usize>() as u64)
            .sum::<u64>()
    }) * f;
    let target_act =
        target_tokens as u64 * target_activation_elements_per_token(target, taps.len()) * f;
    let target_bytes = target_weights + target_act;
    let mut total = shared;
    for (name, dev) in plan {
        let cpu = matches!(dev, Device::Cpu);
        total += match name.role {
            Role::Drafter => {
                drafter_state
                    + if cpu {
                        drafter_frozen + drafter_activations
                    } else {
                        0
                    }
            }
            Role::Target => {
                if cpu {
                    target_bytes
                } else {
                    0
                }
            }
        };
    }
    MemoryEstimate {
        params,
        drafter_state,
        drafter_frozen,
        drafter_activations,
        target: target_bytes,
        target_what: match loaded {
            Some(_) => format!(
                "{}: its checkpoint's tensors but the layers above {last}, in f32",
                target.model_type
            ),
            None => target_what(target, last),
        },
        total,
    }
}

/// Activation elements of one drafter sample of up to `max_seq_len` positions: its
/// anchors' blocks through every layer, kept for the backward (hidden-sized: x, q,
/// attention, o, residual, norms; intermediate-sized: gate, up, act), one vocabulary chunk
/// of logits per row, and the context (taps, projection). A floor: the big buffers only.
pub fn drafter_activation_elements(drafter: &DrafterConfig, max_seq_len: u32) -> u64 {
    let (h, inter, qd) = (
        drafter.hidden as u64,
        drafter.intermediate as u64,
        (drafter.q_heads * drafter.head_dim) as u64,
    );
    let anchors = (drafter.max_anchors as u64).min(max_seq_len as u64);
    let m = anchors * drafter.block_size as u64;
    let per_row =
        drafter.layers as u64 * (4 * h + 3 * qd + 3 * inter) + (drafter.vocab as u64).min(4096);
    let context = max_seq_len as u64 * (drafter.n_taps as u64 + 2) * h;
    m * per_row + context
}

/// Activation elements per token of a target forward with `taps` taps: residual, norm,
/// q/k/v, attention and projection outputs, the MLP's three, the taps; a mixture of
/// experts adds the router's logits and, for each of its top-k rows, the routed input and
/// output, gate, up and SwiGLU, and the copy of the output for the weighted sum.
pub fn target_activation_elements_per_token(target: &TargetConfig, taps: usize) -> u64 {
    let h = target.hidden_size as u64;
    let moe = target.moe.as_ref().map_or(0, |m| {
        let (k, mi) = (m.num_experts_per_tok as u64, m.moe_intermediate_size as u64);
        m.num_experts as u64 + k * (3 * h + 3 * mi) + h
    });
    6 * h + 3 * target.intermediate_size as u64 + taps as u64 * h + moe
}

/// `target` in words for the memory report: its architecture, and for a mixture of
/// experts how many experts' weights the layers up to `last` hold.
fn target_what(target: &TargetConfig, last: usize) -> String {
    match &target.moe {
        None => target.arch.to_string(),
        Some(m) => {
            let sparse = (0..=last).filter(|&l| target.sparse(l).is_some()).count();
            format!(
                "{}: all {} experts of its {sparse} sparse layer(s) run",
                target.arch, m.num_experts
            )
        }
    }
}

/// Refuse a run whose workers cannot fit in the memory available now (the same 80 % rule
/// as the shared-memory pools). Also warns, once every flag is known to be good, when the
/// CPU workers outnumber the cores ([`warn_if_oversubscribed`]).
pub fn check_memory(
    e: &MemoryEstimate,
    plan: &[(WorkerName, Device)],
    drafter: &DrafterConfig,
) -> Result<(), Error> {
    warn_if_oversubscribed(plan);
    let Some(avail) = crate::data::pipeline::mem_available() else {
        return Ok(());
    };
    check_memory_against(e, plan, drafter, avail)
}

fn check_memory_against(
    e: &MemoryEstimate,
    plan: &[(WorkerName, Device)],
    drafter: &DrafterConfig,
    avail: u64,
) -> Result<(), Error> {
    if e.total <= avail / 10 * 8 {
        return Ok(());
    }
    let drafters = plan.iter().filter(|(n, _)| n.role == Role::Drafter).count();
    let cpu_targets = plan
        .iter()
        .filter(|(n, d)| n.role == Role::Target && matches!(d, Device::Cpu))
        .count();
    let mut parts = vec![format!(
        "{drafters} drafter(s) of {} parameters ({} each in weights, gradients and Adam moments",
        e.params,
        human(e.drafter_state)
    )];
    if plan
        .iter()
        .any(|(n, d)| n.role == Role::Drafter && matches!(d, Device::Cpu))
    {
        parts[0].push_str(&format!(
            ", {} of frozen embeddings, {} of activations for --max-anchors {} × --block-size {}",
            human(e.drafter_frozen),
            human(e.drafter_activations),
            drafter.max_anchors,
            drafter.block_size
        ));
    }
    parts[0].push(')');
    if cpu_targets > 0 {
        parts.push(format!(
            "{cpu_targets} CPU target(s) of {} each ({})",
            human(e.target),
            e.target_what
        ));
    }
    Err(Error::Flag(format!(
        "the workers need about {} ({}) but only {} is available; expected at most 80% of it: \
         lower --max-anchors, --block-size, --draft-layers, --max-seq-len or --token-budget, or use fewer workers",
        human(e.total),
        parts.join(", "),
        human(avail)
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use dflash_shared::model_config::TINY_CONFIG;

    fn args(extra: &[&str]) -> RunArgs {
        crate::cli::run_args(extra)
    }

    fn refused(extra: &[&str], needles: &[&str]) {
        let e = check_flags(&args(extra)).expect_err(&format!("{extra:?} accepted"));
        assert_eq!(e.exit_code(), 2);
        let msg = e.to_string();
        assert!(!msg.contains('\n'), "{msg}");
        for n in needles {
            assert!(msg.contains(n), "{extra:?}: {msg:?} does not mention {n:?}");
        }
    }

    #[test]
    fn eval_data_that_is_the_training_data_and_a_lone_allow_changed_data_are_refused() {
        let t = tempfile::tempdir().unwrap();
        let data = t.path().join("train.jsonl");
        std::fs::write(&data, "{}\n").unwrap();
        let link = t.path().join("same.jsonl");
        std::fs::hard_link(&data, &link).unwrap();
        let (d, l) = (data.to_str().unwrap(), link.to_str().unwrap());
        refused(
            &["--data", d, "--eval-data", l],
            &["--eval-data", "is the training data", "held-out"],
        );
        // A file of the training directory is trained on too.
        let dir = t.path().to_str().unwrap();
        refused(
            &["--data", dir, "--eval-data", d],
            &["is in the training data"],
        );
        let other = t.path().join("held-out");
        std::fs::create_dir(&other).unwrap();
        std::fs::write(other.join("eval.jsonl"), "{}\n").unwrap();
        let e = other.join("eval.jsonl");
        check_flags(&args(&["--data", dir, "--eval-data", e.to_str().unwrap()])).unwrap();
        refused(
            // (clap drops the "requires --resume" once --run-dir, which conflicts with
            // --resume, is given.)
            &["--allow-changed-data", "--run-dir", "runs/a"],
            &["--allow-changed-data", "--resume"],
        );
    }

    #[test]
    fn defaults_and_test_settings_pass() {
        check_flags(&args(&[])).unwrap();
        check_flags(&args(&["--target", "/some/model"])).unwrap();
        check_flags(&args(&[
            "--hang-timeout",
            "1s",
            "--step-timeout",
            "1s",
            "--stable-after",
            "50ms",
            "--time-limit",
            "200ms",
            "--max-seq-len",
            "16",
        ]))
        .unwrap();
        check_flags(&args(&[
            "--checkpoint-every",
            "0",
            "--block-size",
            "256",
            "--lr",
            "1",
            "--warmup-ratio",
            "0",
        ]))
        .unwrap();
    }

    #[test]
    fn absurd_flags_are_refused_with_the_flag_and_the_range() {
        refused(
            &["--hang-timeout", "0s"],
            &["--hang-timeout 0s", "at least 1s"],
        );
        refused(&["--hang-timeout", "500ms"], &["--hang-timeout 500ms"]);
        refused(
            &["--step-timeout", "0s"],
            &["--step-timeout 0s", "above zero"],
        );
        refused(
            &["--block-size", "100000"],
            &["--block-size 100000", "at most 256"],
        );
        refused(&["--block-size", "1"], &["--block-size 1", "at least 2"]);
        refused(
            &["--block-size", "64", "--max-seq-len", "32"],
            &["--block-size 64", "--max-seq-len 32"],
        );
        refused(
            &["--max-seq-len", "4"],
            &["--block-size 8 (the default)", "--max-seq-len 4"],
        );
        refused(&["--max-anchors", "0"], &["--max-anchors 0", "at least 1"]);
        refused(&["--lr", "1e20"], &["--lr 1e20", "at most 1"]);
        refused(&["--lr", "0"], &["--lr 0"]);
        refused(&["--lr", "NaN"], &["--lr NaN"]);
        refused(&["--lr=-1"], &["--lr -1"]);
        refused(&["--warmup-ratio", "1"], &["--warmup-ratio 1", "[0, 1)"]);
        refused(&["--warmup-ratio=-0.5"], &["--warmup-ratio -0.5"]);
        refused(&["--gamma", "0"], &["--gamma 0", "positive"]);
        refused(&["--gamma", "inf"], &["--gamma inf"]);
        refused(&["--steps", "0"], &["--steps 0"]);
        refused(
            &["--keep-checkpoints", "0"],
            &["--keep-checkpoints 0", "at least 1"],
        );
        refused(
            &["--stop-timeout", "0s"],
            &["--stop-timeout 0s", "above zero"],
        );
        refused(&["--stable-after", "0s"], &["--stable-after 0s"]);
        refused(
            &["--gpu-sample-interval", "0s"],
            &["--gpu-sample-interval 0s"],
        );
        refused(&["--metrics-interval", "0ms"], &["--metrics-interval 0s"]);
        refused(
            &["--collective-timeout", "0s"],
            &["--collective-timeout 0s", "above zero"],
        );
        refused(&["--gamma", "-1"], &["--gamma -1", "positive"]);
        refused(&["--lr", "-1"], &["--lr -1", "above 0"]);
        refused(
            &["--warmup-ratio", "-0.5"],
            &["--warmup-ratio -0.5", "[0, 1)"],
        );
        refused(&["--time-limit", "0s"], &["--time-limit 0s"]);
        refused(&["--epochs", "0"], &["--epochs 0"]);
        refused(&["--draft-layers", "0"], &["--draft-layers 0"]);
        refused(
            &["--draft-layers", "18446744073709551615"],
            &["--draft-layers 18446744073709551615", "at most 64"],
        );
        refused(
            &["--max-anchors", "100000000", "--max-seq-len", "512"],
            &["--max-anchors 100000000", "at most --max-seq-len 512"],
        );
        refused(&["--token-budget", "0"], &["--token-budget 0"]);
        refused(&["--token-slots", "0"], &["--token-slots 0"]);
        refused(&["--prefetch", "0"], &["--prefetch 0"]);
    }

    #[test]
    fn cpu_workers_are_bounded_by_the_cores_and_warned_about_past_them() {
        assert_eq!(max_cpu_workers(2), 32);
        assert_eq!(max_cpu_workers(16), 64);
        // The tests' cpu:3 and cpu:4 on two cores, and the limit itself, start.
        for spec in ["cpu:3", "cpu:4", "cpu:32"] {
            check_cpu_workers(&args(&["--gpus", spec]), 2).unwrap();
        }
        check_cpu_workers(&args(&["--gpus", "cpu:64"]), 16).unwrap();
        let e = check_cpu_workers(&args(&["--gpus", "cpu:1000"]), 2).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        let msg = e.to_string();
        assert!(
            msg.starts_with("--gpus cpu:1000: expected at most 32 CPU workers")
                && msg.contains("2 core(s)")
                && !msg.contains('\n'),
            "{msg}"
        );
        let e = check_cpu_workers(
            &args(&["--target-gpus", "cpu:20", "--drafter-gpus", "cpu:20"]),
            2,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("--target-gpus cpu:20 --drafter-gpus cpu:20: 40 CPU workers")
                && e.contains("at most 32"),
            "{e}"
        );
        // GPUs are not CPU workers.
        check_cpu_workers(&args(&["--gpus", "0-7"]), 2).unwrap();
        // check_flags asks the machine's own cores.
        refused(&["--gpus", "cpu:1000"], &["--gpus cpu:1000", "at most"]);

        assert_eq!(oversubscription(2, 2), None);
        let w = oversubscription(3, 2).expect("3 workers on 2 cores");
        assert!(
            w.starts_with("3 CPU workers on 2 core(s)") && !w.contains('\n'),
            "{w}"
        );
    }

    #[test]
    fn max_seq_len_beyond_the_target_context_is_refused() {
        let mut t = TargetConfig::read(TINY_CONFIG).unwrap();
        check_context(100_000, &t, "/m").unwrap();
        t.max_position_embeddings = Some(512);
        check_context(512, &t, "/m").unwrap();
        let e = check_context(1024, &t, "/m").unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert_eq!(
            e.to_string(),
            "--max-seq-len 1024 exceeds the target's max_position_embeddings 512 \
             (/m/config.json); expected at most 512"
        );
        // From check_flags, through the --target directory's config.json.
        let dir = tempfile::tempdir().unwrap();
        let mut v: serde_json::Value = serde_json::from_str(TINY_CONFIG).unwrap();
        v["max_position_embeddings"] = 256.into();
        std::fs::write(dir.path().join("config.json"), v.to_string()).unwrap();
        let d = dir.path().to_str().unwrap();
        check_flags(&args(&["--target", d, "--max-seq-len", "256"])).unwrap();
        refused(
            &["--target", d, "--max-seq-len", "1024"],
            &["--max-seq-len 1024", "max_position_embeddings 256"],
        );
    }

    fn tiny_plan(drafters: u32) -> Vec<(WorkerName, Device)> {
        let mut p = vec![(
            WorkerName {
                role: Role::Target,
                rank: 0,
            },
            Device::Cpu,
        )];
        p.extend((0..drafters).map(|rank| {
            (
                WorkerName {
                    role: Role::Drafter,
                    rank,
                },
                Device::Cpu,
            )
        }));
        p
    }

    #[test]
    fn memory_estimate_counts_parameters_state_and_activations() {
        let t = TargetConfig::read(TINY_CONFIG).unwrap();
        let d = DrafterConfig::for_target(&t, 2, 2, 8, 32);
        let e = estimate_memory(&d, &t, &[1, 4], &tiny_plan(1), 64, 256, 1000, None);
        let params = ParamLayout::new(&d).total as u64;
        assert_eq!(e.params, params);
        assert_eq!(
            e.drafter_state,
            params * 16,
            "weights, grads and two moments, f32"
        );
        assert_eq!(e.drafter_frozen, 512 * 64 * 4, "tied: one table");
        assert!(e.drafter_activations >= 32 * 8 * (64 + 512) * 4, "{e:?}");
        assert_eq!(
            e.total,
            1000 + e.drafter_state + e.drafter_frozen + e.drafter_activations + e.target
        );
        // The tiny run fits in a few MiB; two drafters cost two ranks.
        assert!(e.total < 64 << 20, "{e:?}");
        let two = estimate_memory(&d, &t, &[1, 4], &tiny_plan(2), 64, 256, 1000, None);
        assert_eq!(
            two.total - e.total,
            e.drafter_state + e.drafter_frozen + e.drafter_activations
        );
        check_memory_against(&e, &tiny_plan(1), &d, 1 << 30).unwrap();
        // The torch engine's families: the checkpoint's count replaces the shapes' guess.
        let mut g = t.clone();
        g.model_type = "gpt_oss".into();
        let big = estimate_memory(&d, &g, &[1, 4], &tiny_plan(1), 64, 256, 1000, Some(1 << 28));
        let acts =
            256 * ((6 * t.hidden_size + 3 * t.intermediate_size + 2 * t.hidden_size) * 4) as u64;
        assert_eq!(big.target, (1u64 << 28) * 4 + acts, "{big:?}");
        assert!(big
            .target_what
            .starts_with("gpt_oss: its checkpoint's tensors but the layers above 4"));
        let refused = check_memory_against(&big, &tiny_plan(1), &d, 1 << 30)
            .unwrap_err()
            .to_string();
        assert!(refused.contains("CPU target(s) of 1.0 GiB"), "{refused}");
        // The target's activations are one packed forward's: the token budget's tokens.
        let half = estimate_memory(&d, &t, &[1, 4], &tiny_plan(1), 64, 128, 1000, None);
        let per_token = (6 * t.hidden_size + 3 * t.intermediate_size + 2 * t.hidden_size) * 4;
        assert_eq!(
            e.target - half.target,
            128 * per_token as u64,
            "{e:?} {half:?}"
        );
    }

    #[test]
    fn a_mixture_of_experts_target_counts_every_experts_weights_and_is_named() {
        let dense = TargetConfig::read(TINY_CONFIG).unwrap();
        let moe = |experts: usize| {
            let mut v: serde_json::Value = serde_json::from_str(TINY_CONFIG).unwrap();
            let o = v.as_object_mut().unwrap();
            o.insert("model_type".into(), "qwen3_moe".into());
            o.insert(
                "architectures".into(),
                serde_json::json!(["Qwen3MoeForCausalLM"]),
            );
            o.insert("num_experts".into(), experts.into());
            o.insert("num_experts_per_tok".into(), 2.into());
            o.insert("moe_intermediate_size".into(), 32.into());
            o.insert("mlp_only_layers".into(), serde_json::json!([0]));
            TargetConfig::read(&v.to_string()).unwrap()
        };
        let (m8, m64) = (moe(8), moe(64));
        let d = DrafterConfig::for_target(&dense, 2, 2, 8, 32);
        let est =
            |t: &TargetConfig| estimate_memory(&d, t, &[1, 4], &tiny_plan(1), 64, 256, 0, None);
        // Layers 0..=4 run: layer 0 dense, 1..=4 sparse, each expert 3 × 32 × 64 weights.
        let per_expert = 3 * 32 * 64 * 4;
        assert_eq!(
            est(&m64).target - est(&m8).target,
            4 * 56 * per_expert + 4 * 56 * 64 * 4 + 256 * 56 * 4,
            "56 more experts in 4 layers: their weights, router rows and logits"
        );
        assert!(est(&m8).target > est(&dense).target);
        assert_eq!(est(&dense).target_what, "Qwen3");
        let e = est(&m64);
        assert_eq!(
            e.target_what,
            "Qwen3-MoE: all 64 experts of its 4 sparse layer(s) run"
        );
        let msg = check_memory_against(&e, &tiny_plan(1), &d, 1 << 20)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("CPU target(s) of") && msg.contains("(Qwen3-MoE: all 64 experts"),
            "{msg}"
        );
    }

    #[test]
    fn a_drafter_larger_than_memory_is_refused() {
        let t = TargetConfig::read(TINY_CONFIG).unwrap();
        // 256-token blocks, 4096 anchors, 40 layers: gigabytes of activations.
        let d = DrafterConfig::for_target(&t, 40, 2, 256, 4096);
        let plan = tiny_plan(1);
        let e = estimate_memory(&d, &t, &[1, 4], &plan, 4096, 4096, 0, None);
        assert!(e.drafter_activations > 8 << 30, "{e:?}");
        let err = check_memory_against(&e, &plan, &d, 4 << 30).unwrap_err();
        let msg = err.to_string();
        assert_eq!(err.exit_code(), 2);
        assert!(
            msg.contains("--max-anchors 4096 × --block-size 256")
                && msg.contains("available")
                && !msg.contains('\n'),
            "{msg}"
        );
    }
}
