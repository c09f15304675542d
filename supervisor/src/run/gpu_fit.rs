//! Before any worker starts: does each target worker's share of the target's weights fit
//! its GPUs? A target that cannot fit one GPU is refused with how many it needs
//! (`--gpus-per-target`), instead of a worker running out of memory at load.

use std::path::Path;

use dflash_shared::model_config::{expected_tensors, Arch, TargetConfig};
use dflash_shared::{Device, Role, WorkerName};

use super::target_check;
use crate::error::Error;

/// Of a GPU's memory, what the target's weights may take: the rest is left for the
/// activations, the CUDA context and cuBLAS's workspace.
const WEIGHT_SHARE: f64 = 0.9;

/// The weight bytes a target worker puts on its GPUs (bf16): the native engine's tensors
/// up to the last tap, or (the torch engine's families) the checkpoint's tensors but the
/// decoder layers above it.
pub fn weight_bytes(target: &str, cfg: &TargetConfig, last: usize) -> Result<u64, Error> {
    let elements = if cfg.arch == Arch::Transformers {
        target_check::loaded_elements(Path::new(target), last)
            .map_err(|e| Error::input(format!("--target {target}"), e))?
    } else {
        expected_tensors(cfg, last + 1)
            .iter()
            .filter(|(n, _)| n != "lm_head.weight" && n != "model.norm.weight")
            .map(|(_, s)| s.iter().product::<usize>() as u64)
            .sum()
    };
    Ok(elements * 2)
}

/// Refuse a placement whose target workers cannot hold `weights` bytes over their GPUs
/// (`per` each; `memory`: a GPU's total memory by NVML index, none where NVML cannot say),
/// saying how many GPUs per target would.
pub fn check(
    plan: &[(WorkerName, Device)],
    spans: &[Vec<u32>],
    per: u32,
    weights: u64,
    memory: &dyn Fn(u32) -> Option<u64>,
) -> Result<(), Error> {
    for (i, (name, dev)) in plan
        .iter()
        .filter(|(n, _)| n.role == Role::Target)
        .enumerate()
    {
        let Device::Gpu(first) = dev else { continue };
        let held: Vec<u32> = match spans.get(i) {
            Some(s) if !s.is_empty() => s.clone(),
            _ => vec![*first],
        };
        let Some(least) = held.iter().filter_map(|&g| memory(g)).min() else {
            continue;
        };
        let room = (least as f64 * WEIGHT_SHARE) as u64;
        let share = weights.div_ceil(held.len() as u64);
        if share <= room {
            continue;
        }
        let need = weights.div_ceil(room.max(1));
        let targets = plan.iter().filter(|(n, _)| n.role == Role::Target).count() as u64;
        // Every device of the run: each target worker stands for `per` GPUs in the plan.
        let devices = plan.len() as u64 + (per as u64 - 1) * targets;
        let would = if need * targets < devices {
            format!("--gpus-per-target {need} would fit it")
        } else {
            format!("it needs {need} GPUs per target, more than these devices leave a drafter")
        };
        return Err(Error::Flag(format!(
            "{name}: the target's weights it loads ({}) over its {} GPU(s) ({} on each of GPU {}) do not fit in {:.0}% of a GPU of {} (the rest is for activations and the CUDA context); {would}",
            human(weights),
            held.len(),
            human(share),
            held.iter().map(u32::to_string).collect::<Vec<_>>().join(","),
            WEIGHT_SHARE * 100.0,
            human(least),
        )));
    }
    Ok(())
}

fn human(b: u64) -> String {
    crate::data::pipeline::human(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(targets: u32, drafters: u32, first_drafter: u32) -> Vec<(WorkerName, Device)> {
        let w = |role, rank| WorkerName { role, rank };
        (0..targets)
            .map(|r| (w(Role::Target, r), Device::Gpu(r)))
            .chain((0..drafters).map(|r| (w(Role::Drafter, r), Device::Gpu(first_drafter + r))))
            .collect()
    }

    #[test]
    fn a_target_fits_its_gpus_or_is_refused_saying_how_many_would_hold_it() {
        let kb = |_: u32| Some(1000u64);
        // 1500 bytes on one GPU of 1000 (900 for weights): two would hold it.
        let e = check(&plan(1, 3, 1), &[vec![]], 1, 1500, &kb)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("target-0: the target's weights it loads (1.5 KiB)")
                && e.contains("over its 1 GPU(s) (1.5 KiB on each of GPU 0)")
                && e.contains("90% of a GPU of 1000 B")
                && e.ends_with("--gpus-per-target 2 would fit it"),
            "{e}"
        );
        // Over GPUs 0 and 1: 750 each, it fits.
        check(&plan(1, 2, 2), &[vec![0, 1]], 2, 1500, &kb).unwrap();
        // The smallest GPU of its span decides.
        let mixed = |g: u32| Some(if g == 1 { 700 } else { 1000 });
        assert!(check(&plan(1, 2, 2), &[vec![0, 1]], 2, 1500, &mixed).is_err());
        // More GPUs than the devices leave a drafter: said so.
        let e = check(&plan(1, 3, 1), &[vec![]], 1, 4000, &kb)
            .unwrap_err()
            .to_string();
        assert!(
            e.ends_with("it needs 5 GPUs per target, more than these devices leave a drafter"),
            "{e}"
        );
        // NVML cannot say: no check.
        check(&plan(1, 3, 1), &[vec![]], 1, 4000, &|_| None).unwrap();
        // CPU targets are not held to a GPU.
        let cpu = vec![(
            WorkerName {
                role: Role::Target,
                rank: 0,
            },
            Device::Cpu,
        )];
        check(&cpu, &[vec![]], 1, u64::MAX, &kb).unwrap();
    }
}
