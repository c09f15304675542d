//! A target over several devices (`--gpus-per-target`): its loaded layers in contiguous
//! ranges, one per device ([`split_layers`]: the largest device's weight bytes as small as
//! any contiguous split makes them, the embedding counted on the first), each range a
//! [`DeviceTarget`] of its own; a forward runs them in turn, the residual stream and the
//! taps so far handed from each device to the next through the host.

use super::DeviceTarget;
use crate::device::{Device, GpuError, Result};
use crate::models::target::Target;
use crate::models::weights::Weights;

/// The device (0..n) of each layer of weight `sizes`: contiguous ranges in layer order,
/// one per device (as many devices as layers at most), the largest device's bytes (the
/// first also holding `first`, the embedding) as small as any such split makes them.
pub fn split_layers(sizes: &[usize], n: usize, first: usize) -> Vec<usize> {
    let count = sizes.len();
    let k = n.min(count);
    if k == 0 {
        return vec![0; count];
    }
    let mut pre = vec![0usize; count + 1];
    for (i, s) in sizes.iter().enumerate() {
        pre[i + 1] = pre[i] + s;
    }
    let load = |a: usize, b: usize| pre[b] - pre[a] + if a == 0 { first } else { 0 };
    // best[j][i]: the least largest load of layers 0..i in j ranges; cut: where the last
    // of those ranges starts.
    let mut best = vec![vec![usize::MAX; count + 1]; k + 1];
    let mut cut = vec![vec![0usize; count + 1]; k + 1];
    best[0][0] = 0;
    for j in 1..=k {
        for i in j..=count {
            for a in j - 1..i {
                if best[j - 1][a] == usize::MAX {
                    continue;
                }
                let c = best[j - 1][a].max(load(a, i));
                if c < best[j][i] {
                    best[j][i] = c;
                    cut[j][i] = a;
                }
            }
        }
    }
    let mut out = vec![0; count];
    let mut i = count;
    for j in (1..=k).rev() {
        let a = cut[j][i];
        out[a..i].fill(j - 1);
        i = a;
    }
    out
}

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

#[cfg(test)]
mod tests {
    use super::split_layers;

    #[test]
    fn layers_split_in_contiguous_ranges_with_the_least_largest_share() {
        assert_eq!(split_layers(&[10; 8], 2, 0), [0, 0, 0, 0, 1, 1, 1, 1]);
        assert_eq!(split_layers(&[10; 8], 4, 0), [0, 0, 1, 1, 2, 2, 3, 3]);
        // The embedding counts on the first device: it takes fewer layers.
        assert_eq!(split_layers(&[10; 8], 2, 40), [0, 0, 1, 1, 1, 1, 1, 1]);
        assert_eq!(split_layers(&[1, 1, 100, 1], 2, 0), [0, 0, 1, 1]);
        // 2 + 3 | 9 + 1 + 1 + 1 | 9 + 3: at most 12 on one device.
        assert_eq!(
            split_layers(&[3, 9, 1, 1, 1, 9, 3], 3, 2),
            [0, 1, 1, 1, 1, 2, 2]
        );
        // More devices than layers: one layer each.
        assert_eq!(split_layers(&[5, 5], 4, 0), [0, 1]);
        assert_eq!(split_layers(&[7], 1, 0), [0]);
        assert!(split_layers(&[], 3, 0).is_empty());
    }
}
