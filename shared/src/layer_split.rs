//! Where a target's layers go over several devices (`--gpus-per-target`): the same split
//! for the supervisor, which checks that it fits, and the worker, which places it.

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

/// The bytes each device holds under [`split_layers`] (`first` on device 0).
pub fn device_loads(sizes: &[usize], n: usize, first: usize) -> Vec<usize> {
    let split = split_layers(sizes, n, first);
    let mut loads = vec![0usize; n.max(1)];
    loads[0] = first;
    for (s, d) in sizes.iter().zip(split) {
        loads[d] += s;
    }
    loads
}

#[cfg(test)]
mod tests {
    use super::{device_loads, split_layers};

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
        assert_eq!(device_loads(&[3, 9, 1, 1, 1, 9, 3], 3, 2), [5, 12, 12]);
        assert_eq!(device_loads(&[5, 5], 4, 1), [6, 5, 0, 0]);
    }
}
