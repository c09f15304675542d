//! What a collective reduces, as the device layer holds it: a gradient on a device in
//! buckets that the backward finishes in turn (each with its event), the buffer the group's
//! sum goes into, and the gradient's bytes for a host-side sum. A model hands this handle
//! to the collective; the collective never sees the model.

use super::{DSlice, Device, Event, Result, Stream};

/// A gradient on its device, bucket by bucket.
pub trait GradientBuckets {
    /// The device that holds the gradient, for a collective that works on its buffers and
    /// streams.
    fn device(&mut self) -> &mut dyn Device;

    /// Reduce the gradient bucket by bucket on `stream`, each as soon as the backward has
    /// finished it: `reduce(device, bucket of the gradient, the same range of the reduce
    /// buffer)`, queued behind the bucket's event. Buckets cover every element exactly once,
    /// in the same order on every rank. Returns an event on `stream` behind the last.
    fn reduce_buckets(
        &mut self,
        stream: Stream,
        reduce: &mut dyn FnMut(&mut dyn Device, DSlice, DSlice) -> Result<()>,
    ) -> Result<Event>;

    /// A one-rank group's reduction: the gradient copied into the reduce buffer on the copy
    /// stream, bucket by bucket. Returns the event behind the last copy.
    fn reduce_alone(&mut self) -> Result<Event>;

    /// The gradient into `dst` (its element count of f32, little-endian): a shared-memory
    /// gradient slot.
    fn grads_to_host(&mut self, dst: &mut [u8]) -> Result<()>;
}
