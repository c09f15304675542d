//! The shared-memory collective: every rank has two slots of the supervisor's gradient
//! pool (slot `2r + step % 2`), writes its gradient of a step into one, and stamps it with
//! the epoch it posts it in; a rank's all-reduce of step s in epoch e is complete when
//! every rank of e has stamped its slot of s with e, and is the sum of those slots in rank
//! order (so every rank computes the same bits, and the weights stay identical).
//!
//! Slot layout: `[stamp: u64 (epoch << 32 | step), atomic][loss weight: f64][pad to
//! GRAD_SLOT_HEADER][gradient: f32 × parameters]`.
//!
//! Why a slot is never overwritten while someone sums it: rank r writes its slot of step
//! s + 2 only after step s + 1 committed, which needs every rank of the epoch to have
//! reduced s + 1, so to have finished summing s. A reduction of an older epoch that is
//! still running when a new one starts is thrown away. A restarted rank writes its slot
//! anew, stamped with an epoch the old life never saw, so its predecessor's gradient
//! (whose batch went back to the queue) is never summed.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use dflash_shared::drafter::{CollectiveKind, GRAD_SLOT_HEADER};
use dflash_shared::pool::PoolMap;

use super::{pack, Collective, Formed, Reduced, Sum};
use crate::device::grads::GradientBuckets;
use crate::error::{Result, WorkerError};

pub struct ShmCollective {
    pool: PoolMap,
    rank: u32,
    /// Parameters (f32) per gradient.
    n: usize,
    epoch: Option<(u64, Vec<u32>)>,
    /// The step whose gradient this rank holds (in its slot), until it is applied.
    held: Option<u64>,
    /// The stamp it was posted with, and when.
    posted: Option<(u64, Instant)>,
    sum: Vec<f32>,
    done: Option<Reduced>,
}

impl ShmCollective {
    pub fn new(pool: PoolMap, rank: u32, n: usize) -> Result<ShmCollective> {
        let g = pool.geometry();
        if g.slot_bytes < GRAD_SLOT_HEADER + n as u64 * 4 {
            return Err(WorkerError::Protocol(format!(
                "gradient slots hold {} bytes, the drafter needs {}",
                g.slot_bytes,
                GRAD_SLOT_HEADER + n as u64 * 4
            )));
        }
        if 2 * rank + 1 >= g.slots {
            return Err(WorkerError::Protocol(format!(
                "rank {rank} has no gradient slots ({} slots)",
                g.slots
            )));
        }
        Ok(ShmCollective {
            pool,
            rank,
            n,
            epoch: None,
            held: None,
            posted: None,
            sum: vec![0.0; n],
            done: None,
        })
    }

    fn slot(&self, rank: u32, step: u64) -> Result<u32> {
        let s = rank * 2 + (step % 2) as u32;
        if s >= self.pool.geometry().slots {
            return Err(WorkerError::Protocol(format!(
                "rank {rank} has no gradient slot ({} slots)",
                self.pool.geometry().slots
            )));
        }
        Ok(s)
    }

    fn stamp(&self, slot: u32) -> &AtomicU64 {
        // SAFETY: slots start page-aligned in the mapping, which outlives `self`; the stamp
        // is only ever accessed atomically (by every rank).
        unsafe {
            let p = self.pool.payload(slot).as_ptr();
            debug_assert!(p as usize % 8 == 0);
            &*(p as *const AtomicU64)
        }
    }

    fn weight(&self, slot: u32) -> f64 {
        // SAFETY: read after the stamp (Acquire) that the writer stored after it (Release).
        let b = unsafe { &self.pool.payload(slot)[8..16] };
        f64::from_le_bytes(b.try_into().expect("8 bytes"))
    }

    /// Write this rank's gradient of `step` (taken from `grads`) and its loss weight into
    /// its slot, unstamped. Returns whether the gradient is finite.
    fn write(
        &mut self,
        step: u64,
        weight: f64,
        grads: impl FnOnce(&mut [u8]) -> Result<()>,
    ) -> Result<bool> {
        let slot = self.slot(self.rank, step)?;
        self.stamp(slot).store(0, Ordering::Release);
        // SAFETY: the slot is this rank's; no rank reads it before the stamp below (the
        // ones still summing an older step's slot wrote theirs of the next step since, see
        // the module docs).
        let dst = unsafe { self.pool.payload_mut(slot) };
        dst[8..16].copy_from_slice(&weight.to_le_bytes());
        let body = &mut dst[GRAD_SLOT_HEADER as usize..][..self.n * 4];
        grads(body)?;
        let finite = body
            .chunks_exact(4)
            .all(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]).is_finite());
        self.held = Some(step);
        self.posted = None;
        self.done = None;
        Ok(finite)
    }

    /// The gradient of `step` given as host values (tests, and the benchmark's ranks).
    pub fn contribute_host(&mut self, step: u64, weight: f64, g: &[f32]) -> Result<bool> {
        if g.len() != self.n {
            return Err(WorkerError::Invalid(format!(
                "a gradient of {} values, the group reduces {}",
                g.len(),
                self.n
            )));
        }
        self.write(step, weight, |body| {
            for (d, v) in body.chunks_exact_mut(4).zip(g) {
                d.copy_from_slice(&v.to_le_bytes());
            }
            Ok(())
        })
    }

    /// Stamp the held gradient for the current epoch and sum the epoch's slots once every
    /// rank has stamped its own.
    pub fn progress(&mut self) -> Result<Option<Reduced>> {
        if let Some(d) = self.done {
            return Ok(Some(d));
        }
        let (Some(step), Some((epoch, ranks))) = (self.held, self.epoch.as_ref()) else {
            return Ok(None);
        };
        let (epoch, want) = (*epoch, pack(*epoch, step)?);
        let started = match self.posted {
            Some((stamp, t)) if stamp == want => t,
            _ => {
                let t = Instant::now();
                self.stamp(self.slot(self.rank, step)?)
                    .store(want, Ordering::Release);
                self.posted = Some((want, t));
                t
            }
        };
        let slots: Vec<u32> = ranks
            .iter()
            .map(|&r| self.slot(r, step))
            .collect::<Result<_>>()?;
        if !slots
            .iter()
            .all(|&s| self.stamp(s).load(Ordering::Acquire) == want)
        {
            return Ok(None);
        }
        let mut weight_sum = 0.0;
        for (i, &s) in slots.iter().enumerate() {
            // SAFETY: stamped for this epoch and step (Acquire above): complete, and not
            // rewritten before this rank reduced the next step (module docs).
            let src = unsafe { &self.pool.payload(s)[GRAD_SLOT_HEADER as usize..][..self.n * 4] };
            let vals = src
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
            if i == 0 {
                self.sum.iter_mut().zip(vals).for_each(|(a, v)| *a = v);
            } else {
                self.sum.iter_mut().zip(vals).for_each(|(a, v)| *a += v);
            }
            weight_sum += self.weight(s);
        }
        let d = Reduced {
            step,
            epoch,
            weight_sum,
            ms: started.elapsed().as_secs_f64() * 1e3,
        };
        self.done = Some(d);
        Ok(Some(d))
    }

    /// The last completed sum, divided by `weight_sum` (after checking it against the
    /// all-reduced one); the held gradient is released.
    pub fn take_sum(&mut self, step: u64, weight_sum: f64) -> Result<&[f32]> {
        let d = super::check_commit(self.done, step, weight_sum)?;
        super::reduce_slots(&mut self.sum, d.weight_sum);
        self.held = None;
        self.posted = None;
        self.done = None;
        Ok(&self.sum)
    }
}

impl Collective for ShmCollective {
    fn kind(&self) -> CollectiveKind {
        CollectiveKind::Shm
    }

    fn form(&mut self, epoch: u64, ranks: &[u32], _id: Option<&[u8]>) -> Result<Formed> {
        super::check_ranks(epoch, ranks, self.rank)?;
        for &r in ranks {
            self.slot(r, 1)?;
        }
        pack(epoch, 0)?;
        self.epoch = Some((epoch, ranks.to_vec()));
        // Whatever the last epoch reduced is void: reduce the held gradient again.
        self.posted = None;
        self.done = None;
        Ok(Formed::Ready)
    }

    fn contribute(
        &mut self,
        step: u64,
        weight: f64,
        model: &mut dyn GradientBuckets,
    ) -> Result<Option<bool>> {
        let finite = self.write(step, weight, |body| {
            model
                .grads_to_host(body)
                .map_err(WorkerError::device("copying the gradient into its slot"))
        })?;
        Ok(Some(finite))
    }

    fn peers_waiting(&self) -> bool {
        let (Some(step), Some((epoch, ranks))) = (self.held, self.epoch.as_ref()) else {
            return false;
        };
        let Ok(want) = pack(*epoch, step) else {
            return false;
        };
        ranks.iter().filter(|&&r| r != self.rank).all(|&r| {
            self.slot(r, step)
                .is_ok_and(|s| self.stamp(s).load(Ordering::Acquire) == want)
        })
    }

    fn poll(&mut self, _model: &mut dyn GradientBuckets) -> Result<Option<Reduced>> {
        self.progress()
    }

    fn take(&mut self, step: u64, weight_sum: f64) -> Result<Sum<'_>> {
        Ok(Sum::Host(self.take_sum(step, weight_sum)?))
    }
}
