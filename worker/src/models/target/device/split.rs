//! A target over several devices (`--gpus-per-target`): its loaded layers in contiguous
//! ranges, one per device ([`split_layers`]: the largest device's weight bytes as small as
//! any contiguous split makes them, the embedding counted on the first), each range a
//! [`DeviceTarget`] of its own; a forward runs them in turn, the residual stream and the
//! taps so far handed from each device to the next through the host.

pub use dflash_shared::layer_split::split_layers;

use super::DeviceTarget;
use crate::device::{Device, GpuError, Result};
use crate::models::target::Target;
use crate::models::weights::Weights;

/// The weight elements of each of `target`'s loaded layers, and of its embedding, as the
/// checkpoint's shapes give them (a mapped target holds none on the host).
fn layer_sizes(target: &Target) -> (Vec<usize>, usize) {
    let c = &target.cfg;
    let tensors = dflash_shared::model_config::expected_tensors(c, target.layers.len());
    let mut sizes = vec![0usize; target.layers.len()];
    let mut embed = 0;
    for (name, shape) in &tensors {
        let n: usize = shape.iter().product();
        match name
            .strip_prefix("model.layers.")
            .and_then(|r| r.split('.').next()?.parse::<usize>().ok())
        {
            Some(l) if l < sizes.len() => sizes[l] += n,
            Some(_) => {}
            None if name == crate::models::target::EMBED => embed = n,
            None => {}
        }
    }
    (sizes, embed)
}

impl DeviceTarget {
    /// `target`'s layers over `devs` in contiguous ranges ([`split_layers`]), with room
    /// for sequences of up to `max_tokens`; on one device, [`DeviceTarget::new`]. Devices
    /// beyond the layers' count are not used.
    pub fn new_split(
        devs: Vec<Box<dyn Device>>,
        mut target: Target,
        max_tokens: usize,
    ) -> Result<DeviceTarget> {
        let (sizes, embed) = layer_sizes(&target);
        let where_ = split_layers(&sizes, devs.len(), embed);
        let mut layers = std::mem::take(&mut target.layers);
        let mut parts: Vec<DeviceTarget> = Vec::new();
        let mut first = 0;
        for (d, dev) in devs.into_iter().enumerate() {
            let n = where_.iter().filter(|&&w| w == d).count();
            if n == 0 {
                continue;
            }
            let mapped = match &target.mapped {
                Some(w) => {
                    Some(Weights::open(w.dir()).map_err(|e| GpuError::Invalid(e.to_string()))?)
                }
                None => None,
            };
            let part = Target {
                cfg: target.cfg.clone(),
                taps: target.taps.clone(),
                embed: if d == 0 {
                    std::mem::take(&mut target.embed)
                } else {
                    Vec::new()
                },
                layers: layers.drain(..n).collect(),
                inv_freq: target.inv_freq.clone(),
                rope_scale: target.rope_scale,
                mapped,
            };
            parts.push(DeviceTarget::part(dev, &part, max_tokens, first, d == 0)?);
            first += n;
        }
        if parts.is_empty() {
            return Err(GpuError::Invalid("a target split over no device".into()));
        }
        let mut head = parts.remove(0);
        head.rest = parts;
        Ok(head)
    }

    /// How many devices hold this target's layers, and the model's first layer on each.
    pub fn layer_ranges(&self) -> Vec<std::ops::Range<usize>> {
        self.parts()
            .map(|p| p.first..p.first + p.layers.len())
            .collect()
    }
}
