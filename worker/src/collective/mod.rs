//! The drafter group's gradient exchange, behind one interface with two implementations:
//! [`shm::ShmCollective`] (the supervisor's shared gradient pool, summed on the host: CPU
//! workers, and GPU groups without NCCL) and [`nccl::NcclCollective`] (NCCL all-reduce
//! of device buffers, the library loaded at run time); and a third for a group of one
//! rank, [`local::LocalCollective`], which needs no exchange at all.
//!
//! The protocol around it is the same for both, and the supervisor drives it:
//! - Membership comes in epochs ([`ToWorker::Group`]): every change of the group's ranks
//!   (a death, a join, a rollback) starts a new epoch, which aborts whatever reduction of
//!   an older epoch is in flight (`ncclCommAbort` on NCCL; on shared memory the sum simply
//!   stops waiting for the old epoch's ranks).
//! - A rank computes the gradient of its batch for the next step and holds it until the
//!   step commits ([`Collective::contribute`]); it all-reduces it in the current epoch
//!   ([`Collective::poll`], driven from the worker's loop, which keeps beating and
//!   reading orders meanwhile) and reports [`FromWorker::Reduced`].
//! - The supervisor commits the step once every rank of the epoch has reduced it
//!   ([`ToWorker::Apply`]); a rank that dies before that leaves the step uncommitted, its
//!   batch goes back to the queue, and the survivors reduce the gradients they still hold
//!   again in the next epoch.
//!
//! [`ToWorker::Group`]: dflash_shared::protocol::ToWorker::Group
//! [`ToWorker::Apply`]: dflash_shared::protocol::ToWorker::Apply
//! [`FromWorker::Reduced`]: dflash_shared::protocol::FromWorker::Reduced

pub mod local;
pub mod nccl;
pub mod shm;

use dflash_shared::drafter::CollectiveKind;

use crate::device::grads::GradientBuckets;
use crate::device::Event;
use crate::error::Result;

/// The step's gradient from the committed slots' sum: divided by the loss weights of all
/// their batches, so that a rank with few supervised tokens weighs each of them as much as
/// a busy rank does (the gradient of Σ_r num_r / Σ_r den_r, which is what one process
/// training on the union of the batches gets). No weight at all: the sum is zero anyway.
pub fn reduce_slots(sum: &mut [f32], weight_sum: f64) {
    if weight_sum > 0.0 {
        let inv = (1.0 / weight_sum) as f32;
        sum.iter_mut().for_each(|x| *x *= inv);
    }
}

/// What forming an epoch asks of the supervisor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Formed {
    /// Nothing: the epoch is usable (shared memory, or a one-rank NCCL group).
    Ready,
    /// This rank is the epoch's first: relay this NCCL unique id to the others.
    Created(Vec<u8>),
    /// Waiting for the id the first rank created (relayed by the supervisor).
    AwaitingId,
}

/// Where a committed step's summed gradient is, for the rank's optimizer step.
pub enum Sum<'a> {
    /// Summed on the host and divided by the loss weights: to be uploaded.
    Host(&'a [f32]),
    /// Summed in the model's gradient buffer on the device (once `after`, when given, has
    /// passed on the device): to be divided by `weight_sum` there.
    Device {
        weight_sum: f64,
        after: Option<Event>,
    },
}

/// A completed all-reduce: the sum of the epoch's gradients is what [`Collective::take`]
/// hands over.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reduced {
    pub step: u64,
    pub epoch: u64,
    /// Σ of the epoch's loss weights.
    pub weight_sum: f64,
    /// From posting this rank's gradient to completion.
    pub ms: f64,
}

pub trait Collective {
    fn kind(&self) -> CollectiveKind;

    /// Start membership epoch `epoch` of `ranks` (ascending; this rank among them): abort
    /// what is in flight in an older epoch. `id`: the NCCL unique id, once relayed.
    fn form(&mut self, epoch: u64, ranks: &[u32], id: Option<&[u8]>) -> Result<Formed>;

    /// This rank's gradient for `step` is in the model's gradient buffer, with its loss
    /// weight: hold it (it is reduced in every epoch until the step commits). Returns
    /// whether every element is finite, where that costs nothing (the shared-memory
    /// collective reads it anyway); `None` where it would cost a device sync.
    fn contribute(
        &mut self,
        step: u64,
        weight: f64,
        model: &mut dyn GradientBuckets,
    ) -> Result<Option<bool>>;

    /// Drive the all-reduce of the held gradient in the current epoch; `Some` once it is
    /// complete (again after every new epoch).
    fn poll(&mut self, model: &mut dyn GradientBuckets) -> Result<Option<Reduced>>;

    /// Committed step `step`: hand over the sum of the last completed all-reduce, which
    /// must be of `step` with these loss weights (`weight_sum`), and let go of the held
    /// gradient. The rank applies it (`train::Rank::reduce`).
    fn take(&mut self, step: u64, weight_sum: f64) -> Result<Sum<'_>>;

    /// Have all the other ranks of the epoch posted the held step (so they wait for this
    /// one)? For tests that kill a rank in the middle of an all-reduce; a collective that
    /// cannot tell says yes.
    fn peers_waiting(&self) -> bool {
        true
    }
}

/// An epoch's membership as every collective needs it: ascending ranks, this one among them.
pub(crate) fn check_ranks(epoch: u64, ranks: &[u32], me: u32) -> Result<()> {
    if !ranks.contains(&me) {
        return Err(crate::error::WorkerError::Protocol(format!(
            "epoch {epoch} of ranks {ranks:?} does not include this rank ({me})"
        )));
    }
    if !ranks.windows(2).all(|w| w[0] < w[1]) {
        return Err(crate::error::WorkerError::Protocol(format!(
            "epoch {epoch}: ranks {ranks:?} are not ascending"
        )));
    }
    Ok(())
}

/// The step a collective reduced must be the one committed, with the same loss weights.
pub(crate) fn check_commit(
    reduced: Option<Reduced>,
    step: u64,
    weight_sum: f64,
) -> Result<Reduced> {
    let d = reduced.ok_or_else(|| {
        crate::error::WorkerError::Protocol(format!(
            "step {step} committed before this rank's all-reduce completed"
        ))
    })?;
    if d.step != step {
        return Err(crate::error::WorkerError::Protocol(format!(
            "step {step} committed, but this rank reduced step {}",
            d.step
        )));
    }
    // The supervisor's Σ of the step's loss weights must be the one the ranks all-reduced:
    // anything else means they reduced another membership than the one committed.
    if (d.weight_sum - weight_sum).abs() > 1e-9 * weight_sum.abs().max(1.0) {
        return Err(crate::error::WorkerError::Protocol(format!(
            "the committed step's loss weights sum to {weight_sum}, the all-reduce to {}: another membership was reduced",
            d.weight_sum
        )));
    }
    Ok(d)
}

/// `(epoch, step)` as one word, for the shared-memory stamps (32 bits each).
pub(crate) fn pack(epoch: u64, step: u64) -> Result<u64> {
    if epoch >= 1 << 32 || step >= 1 << 32 {
        return Err(crate::error::WorkerError::Protocol(format!(
            "epoch {epoch} or step {step} past 2^32"
        )));
    }
    Ok(epoch << 32 | step)
}
