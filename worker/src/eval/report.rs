//! The figures of `dflash-supervise eval`: τ (tokens committed per target verify step)
//! both ways users meet it, a seeded bootstrap interval over prompts, the histogram of
//! accepted lengths, the per-position acceptance curve, τ per prompt category, and the
//! speed of speculative against plain greedy decoding.

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

/// The acceptance curve DFlash's papers plot: for each drafted block position `k` in
/// `1..block` (position 0 is the last committed token), the fraction of verify steps of
/// `runs` whose drafted token at `k` was accepted, i.e. that committed at least `k + 1`
/// tokens. Empty when `runs` has no verify step.
pub fn acceptance_by_position(runs: &[Vec<usize>], block: usize) -> Vec<f64> {
    let steps: usize = runs.iter().map(Vec::len).sum();
    if steps == 0 {
        return Vec::new();
    }
    (1..block)
        .map(|k| {
            let accepted = runs.iter().flatten().filter(|&&a| a > k).count();
            accepted as f64 / steps as f64
        })
        .collect()
}

/// The category of a prompt without one when others have one.
pub const NO_CATEGORY: &str = "(none)";

/// The figures of one category of prompts.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct CategoryTau {
    pub prompts: usize,
    pub tau: Tau,
    pub acceptance_by_position: Vec<f64>,
}

/// τ per category: the prompts of `runs` grouped by `keys` (each prompt's category,
/// else its dataset), in the order each first appears; a prompt without one is
/// [`NO_CATEGORY`]. Empty when no prompt has a category.
pub fn per_category(
    runs: &[Vec<usize>],
    keys: &[Option<String>],
    block: usize,
    seed: u64,
) -> Vec<(String, CategoryTau)> {
    if keys.iter().all(Option::is_none) {
        return Vec::new();
    }
    let mut groups: Vec<(String, Vec<Vec<usize>>)> = Vec::new();
    for (run, key) in runs.iter().zip(keys) {
        let key = key.as_deref().unwrap_or(NO_CATEGORY);
        match groups.iter_mut().find(|(k, _)| k == key) {
            Some((_, g)) => g.push(run.clone()),
            None => groups.push((key.to_string(), vec![run.clone()])),
        }
    }
    groups
        .into_iter()
        .map(|(key, g)| {
            let c = CategoryTau {
                prompts: g.len(),
                tau: Tau::new(&g, block, seed),
                acceptance_by_position: acceptance_by_position(&g, block),
            };
            (key, c)
        })
        .collect()
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

    #[test]
    fn the_acceptance_curve_counts_the_steps_that_accepted_each_drafted_position() {
        // Block 4: drafted positions 1, 2, 3. Steps committing 1, 2, 4, 3, 1 tokens:
        // position 1 accepted by the steps of 2, 4, 3 (3 of 5), position 2 by 4 and 3
        // (2 of 5), position 3 by the step of 4 (1 of 5).
        let runs = vec![vec![1, 2, 4], vec![3], vec![1]];
        assert_eq!(acceptance_by_position(&runs, 4), [0.6, 0.4, 0.2]);
        // Every guess accepted: all 1; none: all 0; non-increasing either way.
        assert_eq!(acceptance_by_position(&[vec![8, 8]], 8), [1.0; 7]);
        assert_eq!(acceptance_by_position(&[vec![1], vec![1, 1]], 3), [0.0; 2]);
        let c = acceptance_by_position(&[vec![1, 5, 2, 3, 5, 1, 4]], 5);
        assert_eq!(c, [5.0 / 7.0, 4.0 / 7.0, 3.0 / 7.0, 2.0 / 7.0]);
        assert!(c.windows(2).all(|w| w[0] >= w[1]));
        // It agrees with the histogram: position k is accepted by the steps of k + 1 or more.
        let t = Tau::new(&runs, 4, 0);
        for (k, f) in acceptance_by_position(&runs, 4).iter().enumerate() {
            let from: u64 = t.histogram[k + 1..].iter().sum();
            assert_eq!(*f, from as f64 / t.verify_steps as f64);
        }
        // Each step commits 1 + its accepted positions: 1 + the curve's sum is pooled τ.
        let t = Tau::new(&[vec![1, 5, 2, 3, 5, 1, 4]], 5, 0);
        assert!((1.0 + c.iter().sum::<f64>() - t.pooled).abs() < 1e-12);
        // No verify step (one new token: the prefill's): no curve.
        assert!(acceptance_by_position(&[vec![], vec![]], 4).is_empty());
    }

    #[test]
    fn per_category_pooled_tau_and_counts_combine_to_the_totals() {
        let runs = vec![
            vec![1, 1, 3],
            vec![5],
            vec![2, 2, 2, 2],
            vec![8, 1],
            vec![1],
            vec![4, 4, 1],
        ];
        let key = |s: &str| Some(s.to_string());
        let keys = vec![
            key("math"),
            key("coding"),
            key("math"),
            None,
            key("coding"),
            key("math"),
        ];
        let total = Tau::new(&runs, 8, 3);
        let cats = per_category(&runs, &keys, 8, 3);
        let names: Vec<&str> = cats.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(
            names,
            ["math", "coding", NO_CATEGORY],
            "in order of appearance"
        );
        let count: usize = cats.iter().map(|(_, c)| c.prompts).sum();
        assert_eq!(count, runs.len());
        assert_eq!(
            cats.iter().map(|(_, c)| c.prompts).collect::<Vec<_>>(),
            [3, 2, 1]
        );
        let tokens: u64 = cats.iter().map(|(_, c)| c.tau.tokens).sum();
        let steps: u64 = cats.iter().map(|(_, c)| c.tau.verify_steps).sum();
        assert_eq!((tokens, steps), (total.tokens, total.verify_steps));
        assert_eq!(tokens as f64 / steps as f64, total.pooled);
        // Each category's own figures: math is prompts 0, 2, 5 (steps 10, tokens 22).
        let math = &cats[0].1;
        assert_eq!((math.tau.verify_steps, math.tau.tokens), (10, 22));
        assert_eq!(math.tau.pooled, 2.2);
        assert_eq!(math.tau.mean_of_means, (5.0 / 3.0 + 2.0 + 3.0) / 3.0);
        assert_eq!(
            math.acceptance_by_position,
            acceptance_by_position(&[runs[0].clone(), runs[2].clone(), runs[5].clone()], 8)
        );
        let lone = &cats[2].1;
        assert_eq!(lone.tau.pooled_ci95, [4.5, 4.5], "one prompt: no spread");
        // The histograms add up too.
        let mut hist = vec![0; 8];
        for (_, c) in &cats {
            for (h, x) in hist.iter_mut().zip(&c.tau.histogram) {
                *h += x;
            }
        }
        assert_eq!(hist, total.histogram);
        // No prompt with a category: no per-category figures.
        assert!(per_category(&runs, &vec![None; runs.len()], 8, 3).is_empty());
    }
}
