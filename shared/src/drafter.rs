//! The drafter's shape, its parameter layout and its training statistics: shared so the
//! supervisor can size the reducer and read the statistics without linking any compute.

use serde::{Deserialize, Serialize};

/// Sizes of the drafter (copied from the target where DFLASH.md says so).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DrafterConfig {
    pub hidden: usize,
    pub layers: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub vocab: usize,
    pub eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<crate::model_config::RopeScaling>,
    pub n_taps: usize,
    pub block_size: usize,
    pub max_anchors: usize,
    pub mask_token_id: u32,
    /// Loss decay γ: slot k weighs exp(-(k-1)/γ).
    pub gamma: f64,
}

/// Where each named tensor lives in the flat parameter buffer.
#[derive(Debug, Clone)]
pub struct ParamLayout {
    pub entries: Vec<(String, Vec<usize>, usize)>,
    pub total: usize,
}

impl ParamLayout {
    /// Tensor names as in z-lab's DFlash draft model.
    pub fn new(c: &DrafterConfig) -> ParamLayout {
        let (h, hd, i) = (c.hidden, c.head_dim, c.intermediate);
        let (qd, kd) = (c.q_heads * hd, c.kv_heads * hd);
        let mut e: Vec<(String, Vec<usize>)> = vec![
            ("fc.weight".into(), vec![h, c.n_taps * h]),
            ("hidden_norm.weight".into(), vec![h]),
        ];
        for l in 0..c.layers {
            let p = format!("layers.{l}");
            e.push((format!("{p}.input_layernorm.weight"), vec![h]));
            e.push((format!("{p}.self_attn.q_proj.weight"), vec![qd, h]));
            e.push((format!("{p}.self_attn.k_proj.weight"), vec![kd, h]));
            e.push((format!("{p}.self_attn.v_proj.weight"), vec![kd, h]));
            e.push((format!("{p}.self_attn.o_proj.weight"), vec![h, qd]));
            e.push((format!("{p}.self_attn.q_norm.weight"), vec![hd]));
            e.push((format!("{p}.self_attn.k_norm.weight"), vec![hd]));
            e.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
            e.push((format!("{p}.mlp.gate_proj.weight"), vec![i, h]));
            e.push((format!("{p}.mlp.up_proj.weight"), vec![i, h]));
            e.push((format!("{p}.mlp.down_proj.weight"), vec![h, i]));
        }
        e.push(("norm.weight".into(), vec![h]));
        let mut off = 0;
        let entries = e
            .into_iter()
            .map(|(n, s)| {
                let len: usize = s.iter().product();
                let r = (n, s, off);
                off += len;
                r
            })
            .collect();
        ParamLayout {
            entries,
            total: off,
        }
    }

    pub fn range(&self, name: &str) -> std::ops::Range<usize> {
        let (_, s, off) = self
            .entries
            .iter()
            .find(|(n, _, _)| n == name)
            .unwrap_or_else(|| panic!("no parameter {name}"));
        *off..*off + s.iter().product::<usize>()
    }
}

impl DrafterConfig {
    /// The drafter for a target, with DFLASH.md's defaults for what is not given.
    pub fn for_target(
        t: &crate::model_config::TargetConfig,
        layers: usize,
        n_taps: usize,
        block_size: usize,
        max_anchors: usize,
    ) -> DrafterConfig {
        DrafterConfig {
            hidden: t.hidden_size,
            layers,
            q_heads: t.num_attention_heads,
            kv_heads: t.num_key_value_heads,
            head_dim: t.head_dim,
            intermediate: t.intermediate_size,
            vocab: t.vocab_size,
            eps: t.rms_norm_eps,
            rope_theta: t.rope_theta,
            rope_scaling: t.rope_scaling.clone(),
            n_taps,
            block_size,
            max_anchors,
            // Qwen3 reserves 151669; a small vocabulary uses its last id.
            mask_token_id: if t.vocab_size > 151669 {
                151669
            } else {
                (t.vocab_size - 1) as u32
            },
            gamma: default_gamma(block_size),
        }
    }
}

/// γ of the loss decay: 7 for blocks of 16, 5 for 10, 4 for 8 (DFLASH.md), in between
/// by the nearest published value.
pub fn default_gamma(block_size: usize) -> f64 {
    match block_size {
        0..=8 => 4.0,
        9..=12 => 5.0,
        _ => 7.0,
    }
}

/// What one forward/backward over a batch measured (host-side counters only).
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepStats {
    /// Σ w·CE and Σ w over the batch.
    pub loss_sum: f64,
    pub weight_sum: f64,
    /// Per block slot k: correct and counted predictions (unweighted).
    pub slot_correct: Vec<u64>,
    pub slot_total: Vec<u64>,
    /// Σ over blocks of (1 + leading run of correct slots), and the number of blocks.
    pub accept_sum: f64,
    pub blocks: u64,
    pub tokens: u64,
    pub anchors: u64,
    /// Host-side phase timings of the rank(s), milliseconds (no device sync): waiting
    /// for a batch, forward + backward, applying the previous step.
    #[serde(default)]
    pub wait_ms: f64,
    #[serde(default)]
    pub compute_ms: f64,
    #[serde(default)]
    pub optimizer_ms: f64,
    /// The rank's loss or gradient is not finite: the step's average is not either, and
    /// every rank skips the update.
    #[serde(default)]
    pub nonfinite: bool,
}

impl StepStats {
    pub fn loss(&self) -> f64 {
        if self.weight_sum > 0.0 {
            self.loss_sum / self.weight_sum
        } else {
            0.0
        }
    }

    pub fn acceptance(&self) -> f64 {
        if self.blocks > 0 {
            self.accept_sum / self.blocks as f64
        } else {
            0.0
        }
    }

    pub fn merge(&mut self, o: &StepStats) {
        self.loss_sum += o.loss_sum;
        self.weight_sum += o.weight_sum;
        if self.slot_correct.len() < o.slot_correct.len() {
            self.slot_correct.resize(o.slot_correct.len(), 0);
            self.slot_total.resize(o.slot_total.len(), 0);
        }
        for k in 0..o.slot_correct.len() {
            self.slot_correct[k] += o.slot_correct[k];
            self.slot_total[k] += o.slot_total[k];
        }
        self.accept_sum += o.accept_sum;
        self.blocks += o.blocks;
        self.tokens += o.tokens;
        self.anchors += o.anchors;
        self.nonfinite |= o.nonfinite;
        // Ranks run in parallel: a step takes as long as its slowest rank.
        self.wait_ms = self.wait_ms.max(o.wait_ms);
        self.compute_ms = self.compute_ms.max(o.compute_ms);
        self.optimizer_ms = self.optimizer_ms.max(o.optimizer_ms);
    }
}

/// Everything a drafter rank needs to train, sent by the supervisor once it is a member
/// of the data-parallel group.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainSetup {
    pub drafter: DrafterConfig,
    pub lr: f64,
    pub warmup_steps: u64,
    /// Steps of the cosine schedule (constant after warmup when unknown).
    pub total_steps: Option<u64>,
    pub clip: f64,
    pub seed: u64,
    /// Gradient buffers of the shared-memory collective: pool fd and geometry (slot
    /// `2r + step % 2` belongs to rank r; see [`GRAD_SLOT_HEADER`]).
    pub grads: crate::pool::PoolInfo,
    /// How the ranks exchange gradients.
    pub collective: CollectiveKind,
    /// One slot holding a rank's full state (parameters, Adam moments, step) for a joiner.
    pub state: crate::pool::PoolInfo,
    /// This rank's index (its two gradient slots are `2·rank` and `2·rank + 1`).
    pub rank: u32,
    /// With `Init::FromCheckpoint`: the checkpoint directory.
    pub checkpoint: Option<String>,
    /// For the export: which target layers the drafter reads, out of how many.
    pub target_layer_ids: Vec<u32>,
    pub num_target_layers: usize,
    pub init: Init,
    /// With `Init::Fresh`: a drafter directory in the export layout (`--init-drafter`)
    /// whose model.safetensors gives the initial weights instead of the seed.
    #[serde(default)]
    pub init_drafter: Option<String>,
}

/// Bytes at the start of each gradient slot before the gradient: the stamp that says
/// which (epoch, step) the slot holds, and the rank's loss-weight sum.
pub const GRAD_SLOT_HEADER: u64 = 64;

/// The drafter group's gradient exchange (both behind the worker's `Collective`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum CollectiveKind {
    /// Through the supervisor's shared gradient pool, summed on the host: CPU workers,
    /// and GPU groups without NCCL.
    Shm,
    /// NCCL on the GPUs (all-reduce of device buffers).
    Nccl,
    /// A group of one rank: its own gradient is the sum, taken on its device.
    Local,
}

impl CollectiveKind {
    pub fn name(self) -> &'static str {
        match self {
            CollectiveKind::Shm => "shared memory",
            CollectiveKind::Nccl => "NCCL",
            CollectiveKind::Local => "nothing (one rank)",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Init {
    /// Fresh parameters from the run's seed (every rank gets the same ones).
    Fresh,
    /// Load state slot `slot`, written by a rank at `step` (a surviving rank for a join,
    /// or the supervisor's snapshot for a rollback).
    FromState { step: u64, slot: u32 },
    /// Load the checkpoint directory `TrainSetup::checkpoint` (`--resume`, or a rollback to
    /// a checkpoint).
    FromCheckpoint { step: u64 },
}

/// In words, for logs: "fresh", "from the state of step 12", "from checkpoint step 20".
impl std::fmt::Display for Init {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Init::Fresh => write!(f, "fresh"),
            Init::FromState { step, .. } => write!(f, "from the state of step {step}"),
            Init::FromCheckpoint { step } => write!(f, "from checkpoint step {step}"),
        }
    }
}

/// Bytes of a state slot for `params` parameters: parameters, two Adam moments, step.
pub fn state_bytes(params: usize) -> u64 {
    (params as u64) * 12 + 64
}

/// Linear warmup over `warmup` steps, then cosine to 0 at `total` (constant after warmup
/// when the total is unknown).
pub fn lr_at(step: u64, base: f64, warmup: u64, total: Option<u64>) -> f64 {
    if step < warmup {
        return base * (step + 1) as f64 / warmup as f64;
    }
    match total {
        Some(t) if t > warmup => {
            let progress = ((step - warmup) as f64 / (t - warmup) as f64).min(1.0);
            base * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
        }
        _ => base,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inits_and_pools_and_slot_states_read_as_words_in_logs() {
        assert_eq!(Init::Fresh.to_string(), "fresh");
        assert_eq!(
            Init::FromState { step: 12, slot: 0 }.to_string(),
            "from the state of step 12"
        );
        assert_eq!(
            Init::FromCheckpoint { step: 20 }.to_string(),
            "from checkpoint step 20"
        );
        use crate::protocol::PoolId;
        assert_eq!(
            format!("the {} pool, a {} slot", PoolId::Tokens, PoolId::Hidden),
            "the token pool, a hidden-state slot"
        );
        assert_eq!(crate::slots::SlotState::Reading.to_string(), "reading");
        let spec = crate::batch::CaptureSpec {
            tap_ids: vec![1, 2],
            hidden: 64,
            dtype: crate::batch::DTYPE_BF16,
            target: 0xab,
        };
        assert_eq!(
            spec.to_string(),
            "taps [1, 2], hidden 64, bf16, target 00000000000000ab"
        );
        assert_eq!(crate::model_config::Arch::Qwen3.to_string(), "Qwen3");
    }
}
