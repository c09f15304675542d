//! Pinned host pages that the device's results are copied into behind events, so that
//! the host never waits for the GPU to drain: the optimizer's outcome and the weights'
//! checksum ([`super::update`]), the cross-entropy rows' losses and hits
//! ([`super::loss`]). Each owner registers its pages with the device, and is declared
//! after the device in `DeviceDrafter`, so that the device unregisters them before they
//! are freed.

use crate::device::{Device, Result};

/// Bytes in a page.
const PAGE: usize = 4096;

/// Whole pages of zeroed host memory, registered with a device.
pub(super) struct Pinned {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl Pinned {
    /// At least `bytes` (whole pages), registered with `dev`.
    pub(super) fn new(dev: &mut dyn Device, bytes: usize) -> Result<Pinned> {
        let size = bytes.max(1).next_multiple_of(PAGE);
        let layout = std::alloc::Layout::from_size_align(size, PAGE).expect("whole pages");
        // SAFETY: a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        let p = Pinned { ptr, layout };
        // SAFETY: the pages live until `drop`, after the device that registers them (the
        // owner is declared after the device).
        unsafe { dev.register_host(p.ptr, p.layout.size())? };
        Ok(p)
    }

    /// The address `at` bytes in, for a copy from the device.
    pub(super) fn at(&self, at: usize) -> *mut u8 {
        assert!(at < self.layout.size(), "{at} is past the pinned pages");
        self.ptr.wrapping_add(at)
    }

    /// `out.len()` bytes from `at` on, once the copies into them have completed (the
    /// caller waited for their event): the host device checks that no copy is pending.
    pub(super) fn read(&self, dev: &mut dyn Device, at: usize, out: &mut [u8]) -> Result<()> {
        assert!(
            at + out.len() <= self.layout.size(),
            "{} bytes at {at} are past the pinned pages",
            out.len()
        );
        let p = self.at(at);
        dev.host_access(p, out.len(), false)?;
        // SAFETY: inside the pages (checked above); the caller waited for the copies.
        unsafe { std::ptr::copy_nonoverlapping(p, out.as_mut_ptr(), out.len()) };
        Ok(())
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout; the device that registered it was
        // dropped first (its owner is declared after the device) and unregistered it.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

// SAFETY: the pages are only touched through their owner's `&mut`.
unsafe impl Send for Pinned {}
