//! A worker's message that does not fit the run's state (a protocol violation): the
//! dispatcher restarts the offender, and the one line it logs is this error's. A leaf
//! module: the pipeline, the drafter group and the dispatcher all report through it.

use dflash_shared::protocol::PoolId;
use dflash_shared::slots::Reject;
use dflash_shared::Role;

/// Which slot of a commit a refusal is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Input,
    Output,
}

impl std::fmt::Display for Side {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Side::Input => "input",
            Side::Output => "output",
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Violation {
    #[error("a drafter committed an output slot")]
    DrafterCommitted,
    #[error("commit names no input slot")]
    NoInputSlot,
    #[error(
        "commit of a {output} slot from a {input} slot: expected hidden-state output from a token input"
    )]
    WrongPools { output: PoolId, input: PoolId },
    /// The slot table refused the request (the slot of a commit's `side`, when it has two).
    #[error("{}{reject}", side.map(|s| format!("{s}: ")).unwrap_or_default())]
    Slot { side: Option<Side>, reject: Reject },
    #[error(
        "a {pool} slot reported consumed by a {role}: only drafters consume, hidden-state slots"
    )]
    NotAConsumer { pool: PoolId, role: Role },
    #[error("batch {batch_id} reported evaluated, but it is a training batch")]
    NotAnEvalBatch { batch_id: u64 },
    #[error("an eval report, but this run has no --eval-data")]
    NoEvalData,
    #[error("eval batch {index} of round {round} scored at the weights of step {step}, but the round evaluates step {evaluates}")]
    EvalAtOtherWeights {
        index: u64,
        round: u64,
        step: u64,
        evaluates: u64,
    },
    #[error("eval batch index {index} is not in the eval set ({batches} batches)")]
    NotInEvalSet { index: u64, batches: usize },
    #[error("an invalid eval report: {0}")]
    InvalidEvalReport(Box<Violation>),
    #[error("gradients of an invalid batch: {0}")]
    InvalidGradients(Box<Violation>),
    #[error("an NCCL id for epoch {epoch} from a drafter that is not its first rank")]
    NcclIdNotFromFirstRank { epoch: u64 },
    /// `what` ("an all-reduce", "gradients") from a drafter outside the group.
    #[error("{what} from a drafter that is not in the training group")]
    NotAMember { what: &'static str },
    #[error("reduced step {step} in epoch {epoch}, expected step {expected_step} in epoch {expected_epoch}")]
    ReducedOutOfOrder {
        step: u64,
        epoch: u64,
        expected_step: u64,
        expected_epoch: u64,
    },
    #[error("reduced step {step} without a gradient for it")]
    ReducedWithoutGradient { step: u64 },
    #[error("SnapshotDone from a drafter that was not asked for one")]
    SnapshotNotAsked,
    #[error("snapshot at step {step}, expected {expected}")]
    SnapshotAtOtherStep { step: u64, expected: u64 },
    #[error("gradients for step {step}, expected step {expected} once")]
    GradientsOutOfOrder { step: u64, expected: u64 },
    /// The control channel carried bytes that are no message (as the control thread
    /// words it, with the decoder's error).
    #[error("{0}")]
    Malformed(String),
    #[error("said hello as '{said}'")]
    WrongHello { said: String },
    /// A message a worker may send only before its hello, or never.
    #[error("sent {message} after its hello")]
    Unexpected { message: &'static str },
}

impl Violation {
    /// `map_err(Violation::slot(Some(Side::Input)))`
    pub fn slot(side: Option<Side>) -> impl FnOnce(Reject) -> Violation {
        move |reject| Violation::Slot { side, reject }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_refusal_names_the_side_of_the_commit_it_is_about() {
        let reject = Reject::WrongOwner { slot: 3 };
        assert_eq!(
            Violation::slot(Some(Side::Output))(reject.clone()).to_string(),
            "output: slot 3 is not held by this worker"
        );
        assert_eq!(
            Violation::slot(None)(reject).to_string(),
            "slot 3 is not held by this worker"
        );
    }
}
