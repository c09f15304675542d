//! A sample's inputs on the device: its taps (f32 from the host, or the hidden-state
//! slot's bf16 rows staged by the copy stream while the previous sample computes and
//! widened on the device), the block token ids and positions, every key's position and
//! each block row's key spans.

use super::layers::Locals;
use super::layout::Work;
use crate::device::ops::Ops;
use crate::device::{f32_bytes, i32_bytes, u32_bytes, Event, GpuError, Result, Stream};
use crate::models::drafter::Sample;

/// Where a sample's taps come from.
pub(super) enum Taps {
    /// The sample's own f32 taps, uploaded on the compute stream.
    F32,
    /// Staging buffer b, filled by the copy stream behind the event.
    Staged(usize, Event),
}

/// Copy one row of bf16 taps into staging buffer `b` on the copy stream, after `free`
/// (the compute stream done with what the buffer held); an event behind the copy.
pub(super) fn stage(
    ops: &mut Ops,
    w: &Work,
    b: usize,
    raw: &[u8],
    free: Option<Event>,
) -> Result<Event> {
    let dev = &mut ops.dev;
    if let Some(e) = free {
        let r = dev.wait(Stream::Copy, e);
        dev.release_event(e);
        r?;
    }
    // SAFETY: `raw` is borrowed for the whole batch, which waits for this copy (and every
    // other) before it returns.
    unsafe { dev.upload_async(Stream::Copy, w.taps16[b].sub(1, 0..raw.len()), raw.as_ptr())? };
    dev.record(Stream::Copy)
}

/// The sample's inputs on the device (`mask` is the drafter's mask token). Returns an
/// event behind the last read of its staging buffer, if it had one.
pub(super) fn upload(
    ops: &mut Ops,
    lc: &Locals,
    w: &Work,
    s: &Sample,
    taps: Taps,
    anchors: &[usize],
    mask: u32,
) -> Result<Option<Event>> {
    let Locals {
        h,
        bs,
        slen,
        m,
        n_taps,
        ..
    } = *lc;
    let width = slen * n_taps * h;
    let freed = match taps {
        Taps::Staged(b, loaded) => {
            let r = ops.dev.wait(Stream::Compute, loaded);
            ops.dev.release_event(loaded);
            r?;
            ops.bf16_to_f32(w.taps.f32s(0..width), w.taps16[b].sub(2, 0..width))?;
            Some(ops.dev.record(Stream::Compute)?)
        }
        Taps::F32 => {
            if s.taps.len() != width {
                return Err(GpuError::Invalid(format!(
                    "{} tap values for {slen} positions × {n_taps} taps × {h}",
                    s.taps.len(),
                )));
            }
            ops.dev.upload(Stream::Compute, w.taps, f32_bytes(s.taps))?;
            None
        }
    };
    let mut block_ids = Vec::with_capacity(m);
    let mut block_pos = Vec::with_capacity(m);
    for &a in anchors {
        for k in 0..bs {
            block_ids.push(if k == 0 { s.ids[a] } else { mask });
            block_pos.push((a + k) as i32);
        }
    }
    let key_pos: Vec<i32> = (0..slen as i32).chain(block_pos.iter().copied()).collect();
    let spans: Vec<i32> = (0..m)
        .flat_map(|i| {
            let n = i / bs;
            [
                0,
                anchors[n] as i32,
                (slen + n * bs) as i32,
                (slen + (n + 1) * bs) as i32,
            ]
        })
        .collect();
    let dev = &mut ops.dev;
    dev.upload(Stream::Compute, w.block_ids, u32_bytes(&block_ids))?;
    dev.upload(Stream::Compute, w.block_pos, i32_bytes(&block_pos))?;
    dev.upload(Stream::Compute, w.key_pos, i32_bytes(&key_pos))?;
    dev.upload(Stream::Compute, w.spans, i32_bytes(&spans))?;
    Ok(freed)
}
