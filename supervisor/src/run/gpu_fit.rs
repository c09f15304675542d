//! Before any worker starts: does each target worker's share of the target's weights fit
//! its GPUs? A target that cannot fit one GPU is refused with how many it needs
//! (`--gpus-per-target`), instead of a worker running out of memory at load.

use std::path::Path;

use dflash_shared::drafter::{DrafterConfig, ParamLayout};
use dflash_shared::layer_split::device_loads;
use dflash_shared::model_config::{expected_tensors, Arch, TargetConfig};
use dflash_shared::{Device, Role, WorkerName};

use super::target_check;
use crate::error::Error;

/// Of a GPU's memory, what the target's weights may take: the rest is left for the
/// activations, the CUDA context and cuBLAS's workspace.
const WEIGHT_SHARE: f64 = 0.9;

/// The weight bytes (bf16) a target worker puts on its GPUs, per decoder layer up to the
/// last tap and for the rest (the embedding; for the torch engine's families also the
/// lm_head, norms and any vision tower, which its device map puts on the first GPU): the
/// native engine's tensors, or the checkpoint's.
pub fn weight_bytes(
    target: &str,
    cfg: &TargetConfig,
    last: usize,
) -> Result<(Vec<usize>, usize), Error> {
    let (layers, rest) = if cfg.arch == Arch::Transformers {
        target_check::loaded_by_layer(Path::new(target), last)
            .map_err(|e| Error::input(format!("--target {target}"), e))?
    } else {
        let mut layers = vec![0u64; last + 1];
        let mut rest = 0u64;
        for (name, shape) in expected_tensors(cfg, last + 1) {
            if name == "lm_head.weight" || name == "model.norm.weight" {
                continue;
            }
            let n = shape.iter().product::<usize>() as u64;
            match name
                .strip_prefix("model.layers.")
                .and_then(|r| r.split('.').next()?.parse::<usize>().ok())
            {
                Some(l) if l <= last => layers[l] += n,
                Some(_) => {}
                None => rest += n,
            }
        }
        (layers, rest)
    };
    Ok((
        layers.iter().map(|n| (n * 2) as usize).collect(),
        (rest * 2) as usize,
    ))
}

/// The most GPUs a suggestion counts up to.
const MOST_GPUS: usize = 64;

/// Refuse a placement whose target workers cannot hold their weights (`layers`, per
/// decoder layer, and `rest`, on the first GPU: [`weight_bytes`]) over their GPUs, split
/// as the workers split them ([`device_loads`]); `per` GPUs each; `memory`: a GPU's total
/// memory by NVML index, none where NVML cannot say. The refusal says how many GPUs per
/// target would hold them.
pub fn check(
    plan: &[(WorkerName, Device)],
    spans: &[Vec<u32>],
    per: u32,
    (layers, rest): (&[usize], usize),
    memory: &dyn Fn(u32) -> Option<u64>,
) -> Result<(), Error> {
    let most = |n: usize| device_loads(layers, n, rest).into_iter().max().unwrap_or(0) as u64;
    let weights = (layers.iter().sum::<usize>() + rest) as u64;
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
        let share = most(held.len());
        if share <= room {
            continue;
        }
        let targets = plan.iter().filter(|(n, _)| n.role == Role::Target).count();
        // Every device of the run: each target worker stands for `per` GPUs in the plan.
        let devices = plan.len() + (per as usize - 1) * targets;
        let would = match (held.len() + 1..=MOST_GPUS).find(|&n| most(n) <= room) {
            Some(n) if n * targets < devices => format!("--gpus-per-target {n} would fit it"),
            Some(n) => format!(
                "it needs {n} GPUs per target, more than these devices leave a drafter"
            ),
            None => format!(
                "no split of its layers fits a GPU of this size (its largest layer is {}, and the first GPU holds {} besides its layers)",
                human(layers.iter().copied().max().unwrap_or(0) as u64),
                human(rest as u64)
            ),
        };
        return Err(Error::Flag(format!(
            "{name}: the target's weights it loads ({}) over its {} GPU(s) (at most {} on one of GPU {}) do not fit in {:.0}% of a GPU of {} (the rest is for activations and the CUDA context); {would}",
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

/// Bytes per drafter parameter on a GPU: the f32 master weights, their bf16 copy, the
/// gradient, Adam's two moments, the averaged gradient and the collective's reduce buffer
/// (the drafter worker's layout, `models/drafter/device/layout.rs`).
pub const DRAFTER_BYTES_PER_PARAM: u64 = 4 + 2 + 4 + 4 + 4 + 4 + 4;

/// What a drafter worker places on its GPU whatever its batches: its training state
/// ([`DRAFTER_BYTES_PER_PARAM`] per parameter), and the frozen embedding (f32) and
/// lm_head (bf16).
pub fn drafter_fixed_bytes(d: &DrafterConfig) -> (u64, u64) {
    let state = ParamLayout::new(d).total as u64 * DRAFTER_BYTES_PER_PARAM;
    (state, (d.vocab * d.hidden) as u64 * (4 + 2))
}

/// Refuse a drafter worker whose GPU (`memory`: its total by NVML index) cannot hold
/// [`drafter_fixed_bytes`] in the share weights may take: what it places whatever its
/// batches, which no smaller batch helps. The refusal says which `--draft-layers` fits.
pub fn check_drafters(
    plan: &[(WorkerName, Device)],
    d: &DrafterConfig,
    memory: &dyn Fn(u32) -> Option<u64>,
) -> Result<(), Error> {
    let fixed = |d: &DrafterConfig| {
        let (state, frozen) = drafter_fixed_bytes(d);
        state + frozen
    };
    for (name, dev) in plan.iter().filter(|(n, _)| n.role == Role::Drafter) {
        let Device::Gpu(g) = dev else { continue };
        let Some(total) = memory(*g) else { continue };
        let room = (total as f64 * WEIGHT_SHARE) as u64;
        if fixed(d) <= room {
            continue;
        }
        let (state, frozen) = drafter_fixed_bytes(d);
        let fewer = (1..d.layers).rev().find(|&layers| {
            let smaller = DrafterConfig {
                layers,
                ..d.clone()
            };
            fixed(&smaller) <= room
        });
        let would = match fewer {
            Some(l) => format!("--draft-layers {l} would fit"),
            None => "no drafter of this target's width and vocabulary fits a GPU of this size"
                .to_string(),
        };
        return Err(Error::Flag(format!(
            "{name}: the drafter's training state ({}: {DRAFTER_BYTES_PER_PARAM} bytes for each of its {} parameters) and its frozen embedding and lm_head ({}) do not fit in {:.0}% of GPU {g} ({}; the rest is for activations and the CUDA context); {would}",
            human(state),
            state / DRAFTER_BYTES_PER_PARAM,
            human(frozen),
            WEIGHT_SHARE * 100.0,
            human(total),
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
    fn a_target_fits_its_gpus_as_its_layers_split_or_is_refused_saying_how_many_would() {
        let kb = |_: u32| Some(1000u64);
        // Six layers of 200 and 300 on the first GPU: 1500 on one GPU of 1000 (900 for
        // weights); over two, 300 + 400 | 800 fits.
        let layers = [200usize; 6];
        let e = check(&plan(1, 3, 1), &[vec![]], 1, (&layers, 300), &kb)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("target-0: the target's weights it loads (1.5 KiB)")
                && e.contains("over its 1 GPU(s) (at most 1.5 KiB on one of GPU 0)")
                && e.contains("90% of a GPU of 1000 B")
                && e.ends_with("--gpus-per-target 2 would fit it"),
            "{e}"
        );
        check(&plan(1, 2, 2), &[vec![0, 1]], 2, (&layers, 300), &kb).unwrap();
        // An even split would fit (750 each in 855) but layers split whole: 900 on one of
        // two GPUs; three hold it.
        let e = check(&plan(1, 3, 2), &[vec![0, 1]], 2, (&[300; 4], 300), &|_| {
            Some(950)
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("(at most 900 B on one of GPU 0,1)"), "{e}");
        assert!(e.ends_with("--gpus-per-target 3 would fit it"), "{e}");
        // Three GPUs are more than these devices leave a drafter.
        let e = check(&plan(1, 1, 2), &[vec![0, 1]], 2, (&[300; 4], 300), &|_| {
            Some(950)
        })
        .unwrap_err()
        .to_string();
        assert!(
            e.ends_with("it needs 3 GPUs per target, more than these devices leave a drafter"),
            "{e}"
        );
        // The smallest GPU of its span decides.
        let mixed = |g: u32| Some(if g == 1 { 700 } else { 1000 });
        assert!(check(&plan(1, 2, 2), &[vec![0, 1]], 2, (&layers, 300), &mixed).is_err());
        // What the first GPU holds besides its layers alone does not fit: no split helps.
        let e = check(&plan(1, 3, 1), &[vec![]], 1, (&layers, 950), &kb)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("no split of its layers fits a GPU of this size"),
            "{e}"
        );
        // NVML cannot say: no check.
        check(&plan(1, 3, 1), &[vec![]], 1, (&layers, 4000), &|_| None).unwrap();
        // CPU targets are not held to a GPU.
        let cpu = vec![(
            WorkerName {
                role: Role::Target,
                rank: 0,
            },
            Device::Cpu,
        )];
        check(&cpu, &[vec![]], 1, (&layers, usize::MAX / 2), &kb).unwrap();
    }

    #[test]
    fn a_drafter_whose_fixed_buffers_do_not_fit_its_gpu_is_refused_saying_which_depth_fits() {
        let target = dflash_shared::model_config::TargetConfig::read(
            dflash_shared::model_config::TINY_CONFIG,
        )
        .unwrap();
        let d = DrafterConfig::for_target(&target, 3, 2, 4, 8);
        let two = DrafterConfig {
            layers: 2,
            ..d.clone()
        };
        let bytes = |d: &DrafterConfig| {
            let (s, f) = drafter_fixed_bytes(d);
            s + f
        };
        let (state, frozen) = drafter_fixed_bytes(&d);
        assert_eq!(state, ParamLayout::new(&d).total as u64 * 26);
        assert_eq!(frozen, (d.vocab * d.hidden) as u64 * 6);
        // A GPU whose 90% holds two layers' drafter and not three.
        let total = ((bytes(&two) as f64 / WEIGHT_SHARE) as u64 + bytes(&d)) / 2 + 1;
        assert!(bytes(&two) <= (total as f64 * WEIGHT_SHARE) as u64);
        assert!(bytes(&d) > (total as f64 * WEIGHT_SHARE) as u64);
        let gpu = |_: u32| Some(total);
        let e = check_drafters(&plan(1, 2, 1), &d, &gpu)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("drafter-0: the drafter's training state (")
                && e.contains("26 bytes for each of its")
                && e.contains("do not fit in 90% of GPU 1")
                && e.ends_with("--draft-layers 2 would fit"),
            "{e}"
        );
        check_drafters(&plan(1, 2, 1), &two, &gpu).unwrap();
        // Too small for any depth; NVML silent or a CPU drafter: no check.
        let e = check_drafters(&plan(1, 1, 1), &d, &|_| Some(frozen))
            .unwrap_err()
            .to_string();
        assert!(e.ends_with("fits a GPU of this size"), "{e}");
        check_drafters(&plan(1, 1, 1), &d, &|_| None).unwrap();
    }
}
