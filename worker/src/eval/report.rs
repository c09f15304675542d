//! The figures of `dflash-supervise eval`: τ (tokens committed per target verify step)
//! both ways users meet it, a seeded bootstrap interval over prompts, the histogram of
//! accepted lengths, and the speed of speculative against plain greedy decoding.

use dflash_shared::rng::Rng;
use serde::Serialize;

/// Resamples of the bootstrap.
pub const BOOTSTRAP: usize = 2000;

/// τ of a set of prompts: each prompt's accepted lengths per verify step.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Tau {
    /// Mean over prompts of each prompt's mean accepted length (z-lab's benchmark).
    pub mean_of_means: f64,
    /// Total committed tokens ÷ total verify steps (what serving engines' counters give).
    pub pooled: f64,
    /// 95% bootstrap intervals over prompts of the two.
    pub mean_of_means_ci95: [f64; 2],
    pub pooled_ci95: [f64; 2],
    /// `histogram[k]`: verify steps that committed `k + 1` tokens.
    pub histogram: Vec<u64>,
    pub verify_steps: u64,
    pub tokens: u64,
}

fn mean_of_means(runs: &[&[usize]]) -> f64 {
    let per: Vec<f64> = runs
        .iter()
        .filter(|r| !r.is_empty())
        .map(|r| r.iter().sum::<usize>() as f64 / r.len() as f64)
        .collect();
    per.iter().sum::<f64>() / per.len().max(1) as f64
}

fn pooled(runs: &[&[usize]]) -> f64 {
    let steps: usize = runs.iter().map(|r| r.len()).sum();
    runs.iter().flat_map(|r| r.iter()).sum::<usize>() as f64 / steps.max(1) as f64
}

/// The 2.5th and 97.5th percentiles of `v` (sorted here).
fn interval(mut v: Vec<f64>) -> [f64; 2] {
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
    [at(0.025), at(0.975)]
}

impl Tau {
    /// From each prompt's accepted lengths, for blocks of `block` tokens; the bootstrap
    /// draws prompts with replacement from `seed`.
    pub fn new(runs: &[Vec<usize>], block: usize, seed: u64) -> Tau {
        let all: Vec<&[usize]> = runs.iter().map(Vec::as_slice).collect();
        let mut histogram = vec![0u64; block];
        for &a in all.iter().flat_map(|r| r.iter()) {
            histogram[a.clamp(1, block) - 1] += 1;
        }
        let mut rng = Rng::new(seed);
        let (mut mm, mut po) = (Vec::new(), Vec::new());
        for _ in 0..BOOTSTRAP {
            let pick: Vec<&[usize]> = (0..all.len())
                .map(|_| all[rng.below(all.len().max(1) as u64) as usize])
                .collect();
            mm.push(mean_of_means(&pick));
            po.push(pooled(&pick));
        }
        Tau {
            mean_of_means: mean_of_means(&all),
            pooled: pooled(&all),
            mean_of_means_ci95: interval(mm),
            pooled_ci95: interval(po),
            histogram,
            verify_steps: all.iter().map(|r| r.len() as u64).sum(),
            tokens: all.iter().flat_map(|r| r.iter()).map(|&a| a as u64).sum(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_two_taus_differ_as_defined_and_the_interval_holds_them() {
        // Prompt A: 4 steps of 1; prompt B: 1 step of 5.
        let runs = vec![vec![1, 1, 1, 1], vec![5]];
        let t = Tau::new(&runs, 8, 1);
        assert_eq!(t.mean_of_means, 3.0);
        assert_eq!(t.pooled, 9.0 / 5.0);
        assert_eq!(t.histogram, [4, 0, 0, 0, 1, 0, 0, 0]);
        assert_eq!((t.verify_steps, t.tokens), (5, 9));
        assert_eq!(t.mean_of_means_ci95, [1.0, 5.0]);
        assert!(t.pooled_ci95[0] <= t.pooled && t.pooled <= t.pooled_ci95[1]);
        // Seeded: the same interval again; identical prompts: no spread.
        assert_eq!(Tau::new(&runs, 8, 1), t);
        let same = Tau::new(&[vec![2, 3], vec![2, 3], vec![2, 3]], 4, 9);
        assert_eq!(same.pooled_ci95, [2.5, 2.5]);
    }
}
