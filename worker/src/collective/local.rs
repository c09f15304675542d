//! A group of one rank (a run with one drafter): the sum is its own gradient, copied into
//! the device's reduce buffer bucket by bucket behind the backward, as a device collective
//! would all-reduce it, with no trip through host memory. The epochs, the commit and the
//! rollback around it are the same as for the others.

use dflash_shared::drafter::CollectiveKind;

use super::{Collective, Formed, Reduced, Sum};
use crate::device::grads::GradientBuckets;
use crate::device::Event;
use crate::error::{Result, WorkerError};

pub struct LocalCollective {
    rank: u32,
    epoch: Option<u64>,
    /// The held gradient's step and loss weight.
    held: Option<(u64, f64)>,
    /// The completed copy, and the event behind it (the optimizer waits for it).
    done: Option<(Reduced, Event)>,
    /// An event a new contribution left behind, released at the next poll.
    stale: Option<Event>,
}

impl LocalCollective {
    pub fn new(rank: u32) -> LocalCollective {
        LocalCollective {
            rank,
            epoch: None,
            held: None,
            done: None,
            stale: None,
        }
    }
}

impl Collective for LocalCollective {
    fn kind(&self) -> CollectiveKind {
        CollectiveKind::Local
    }

    fn form(&mut self, epoch: u64, ranks: &[u32], _id: Option<&[u8]>) -> Result<Formed> {
        if ranks != [self.rank] {
            return Err(WorkerError::Protocol(format!(
                "epoch {epoch} of ranks {ranks:?} for a group of one rank ({})",
                self.rank
            )));
        }
        self.epoch = Some(epoch);
        // The copy of an older epoch is still good (it is this rank's gradient), but it is
        // reported again for the new one.
        if let Some((d, _)) = self.done.as_mut() {
            d.epoch = epoch;
        }
        Ok(Formed::Ready)
    }

    fn contribute(
        &mut self,
        step: u64,
        weight: f64,
        _model: &mut dyn GradientBuckets,
    ) -> Result<Option<bool>> {
        self.held = Some((step, weight));
        if let Some((_, e)) = self.done.take() {
            self.stale = Some(e);
        }
        Ok(None)
    }

    fn poll(&mut self, model: &mut dyn GradientBuckets) -> Result<Option<Reduced>> {
        if let Some(e) = self.stale.take() {
            model.device().release_event(e);
        }
        if let Some((d, _)) = self.done {
            return Ok(Some(d));
        }
        let (Some((step, weight)), Some(epoch)) = (self.held, self.epoch) else {
            return Ok(None);
        };
        let t = std::time::Instant::now();
        let e = model.reduce_alone().map_err(WorkerError::device(
            "copying the gradient into the reduce buffer",
        ))?;
        let d = Reduced {
            step,
            epoch,
            weight_sum: weight,
            ms: t.elapsed().as_secs_f64() * 1e3,
        };
        self.done = Some((d, e));
        Ok(Some(d))
    }

    fn take(&mut self, step: u64, weight_sum: f64) -> Result<Sum<'_>> {
        let d = super::check_commit(self.done.map(|(d, _)| d), step, weight_sum)?;
        let (_, e) = self.done.take().expect("checked just above");
        self.held = None;
        Ok(Sum::Device {
            weight_sum: d.weight_sum,
            after: Some(e),
        })
    }
}
