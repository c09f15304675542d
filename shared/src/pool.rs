//! Slot pools in shared memory: one sealed memfd per size class, created and pre-faulted
//! by the supervisor, inherited by each worker at spawn and mapped once.
//!
//! ```text
//! memfd: [ SlotHeader × slots | pad to page ][ slot 0 payload | pad ][ slot 1 payload | pad ] ...
//! ```
//!
//! Only the supervisor writes a header (state, owner_pid, gen, len, batch_id); workers map
//! the header pages read-only and write payload bytes of the slots they were granted. The
//! memfd is sealed against shrinking and growing, so no worker can truncate it under the
//! supervisor (which would turn the supervisor's next access into SIGBUS). A memfd has no
//! name in /dev/shm: it vanishes with the last process that maps it.
//!
//! # Who sees which bytes, and why (sync points)
//!
//! Payload bytes are plain memory, written with no atomics. Another process sees them
//! only because a message ordered after the writes reaches it before it reads: a control
//! message (ipc-channel: a `sendmsg` by the writer after its last write, a `recvmsg` by the
//! reader before its first read; the kernel orders the two), or an in-process channel
//! between the supervisor's threads. Every such edge is marked `sync point` where it
//! happens:
//!
//! 1. loader thread writes a token slot → `LoaderEvent::Produced` (mpsc) → dispatcher
//!    (`supervisor/src/data/pipeline.rs`, `start_loader`);
//! 2. the supervisor writes a header ([`PoolMap::publish`]: fields Relaxed, state Release)
//!    → then sends `Deliver`/`Lease` → the worker receives it and loads the state with
//!    Acquire before it trusts gen/len/batch_id (`worker/src/plane.rs`, `check_header`);
//! 3. a target writes a hidden-state slot (on a GPU: after the event behind its last
//!    device-to-host copy) → `Commit` → the supervisor marks it READY and delivers it
//!    (`worker/src/plane.rs`, `run_target`; `supervisor/src/data/pipeline.rs`);
//! 4. a reader is done with a slot → `Ack`/`Grads`/`Evaluated` → only then may the
//!    supervisor lease it to a writer again (write-after-read; `worker/src/plane.rs`);
//! 5. a drafter writes its gradient slot of the shared-memory collective, then stores the
//!    slot's stamp (Release); the other ranks load every stamp (Acquire) before they read
//!    the slots (`worker/src/collective/shm.rs`: that edge is between workers, with no
//!    message); a drafter writes the state slot → `SnapshotDone` → the supervisor or a
//!    rejoining rank reads it (`worker/src/train.rs`, `snapshot`;
//!    `supervisor/src/training/trainer.rs`, `checkpoint_from_snapshot`).
//!
//! The header's Release/Acquire pair orders only the header's own fields (so a worker
//! that sees the state also sees the gen/len/batch_id stored before it); it does not
//! publish payload bytes, and no process spins on a header to learn that a payload is
//! ready.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use crate::slots::SlotState;

/// Which pool a slot belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum PoolId {
    /// Token batches: loader → targets.
    Tokens,
    /// Hidden-state batches: targets → drafters.
    Hidden,
}

/// In words, for logs: "token" or "hidden-state" (as in "the token pool").
impl std::fmt::Display for PoolId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PoolId::Tokens => "token",
            PoolId::Hidden => "hidden-state",
        })
    }
}

/// One slot under one generation, as granted by the supervisor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotRef {
    pub pool: PoolId,
    pub slot: u32,
    pub gen: u64,
}

/// A pool the worker inherited at spawn: map `fd` once with this geometry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolInfo {
    pub id: PoolId,
    pub fd: i32,
    pub geometry: PoolGeometry,
}

const PAGE: u64 = 4096;

fn round_up(n: u64, to: u64) -> u64 {
    n.div_ceil(to) * to
}

/// The supervisor's mirror of one slot's state, readable by workers.
#[repr(C)]
pub struct SlotHeader {
    pub state: AtomicU32,
    pub owner_pid: AtomicU32,
    pub gen: AtomicU64,
    pub len: AtomicU64,
    pub batch_id: AtomicU64,
}

/// Bytes of one header in the memfd: the layout every process (of this version) assumes.
pub const SLOT_HEADER_BYTES: usize = 32;

// The layout, pinned: headers are packed at a 32-byte stride from offset 0 of a
// page-aligned mapping, so each is 8-byte aligned and none straddles a page; a change to
// `SlotHeader` must change this (and the protocol version) on purpose.
const _: () = {
    assert!(std::mem::size_of::<SlotHeader>() == SLOT_HEADER_BYTES);
    assert!(std::mem::align_of::<SlotHeader>() == 8);
    assert!(PAGE as usize % SLOT_HEADER_BYTES == 0);
    assert!(std::mem::offset_of!(SlotHeader, state) == 0);
    assert!(std::mem::offset_of!(SlotHeader, owner_pid) == 4);
    assert!(std::mem::offset_of!(SlotHeader, gen) == 8);
    assert!(std::mem::offset_of!(SlotHeader, len) == 16);
    assert!(std::mem::offset_of!(SlotHeader, batch_id) == 24);
};

/// Shape of one pool; travels to workers in the control protocol.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolGeometry {
    /// "tokens" or "hidden".
    pub name: String,
    pub slots: u32,
    /// Payload capacity of one slot, in bytes.
    pub slot_bytes: u64,
}

impl PoolGeometry {
    pub fn header_bytes(&self) -> u64 {
        round_up(self.slots as u64 * SLOT_HEADER_BYTES as u64, PAGE)
    }

    fn stride(&self) -> u64 {
        round_up(self.slot_bytes, PAGE)
    }

    pub fn slot_offset(&self, slot: u32) -> u64 {
        self.header_bytes() + slot as u64 * self.stride()
    }

    /// Bytes of the whole memfd.
    pub fn total_bytes(&self) -> u64 {
        self.header_bytes() + self.slots as u64 * self.stride()
    }
}

/// One mapping of a pool.
pub struct PoolMap {
    geometry: PoolGeometry,
    base: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; who may write which bytes is governed by the
// slot protocol (a payload only by the holder of its slot, a header only by the supervisor)
// and header fields are atomics.
unsafe impl Send for PoolMap {}
unsafe impl Sync for PoolMap {}

impl PoolMap {
    /// Supervisor: create the memfd, size and seal it, map it pre-faulted.
    pub fn create(geometry: PoolGeometry) -> io::Result<(OwnedFd, PoolMap)> {
        let total = geometry.total_bytes();
        let name = std::ffi::CString::new(format!("dflash-{}", geometry.name))
            .map_err(io::Error::other)?;
        // SAFETY: memfd_create with a valid C string; the fd we get is ours.
        let fd = unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fresh fd owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: ftruncate/fcntl on our fd.
        unsafe {
            if libc::ftruncate(fd.as_raw_fd(), total as libc::off_t) != 0 {
                return Err(io::Error::last_os_error());
            }
            let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
            if libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        let map = PoolMap::map_raw(fd.as_raw_fd(), geometry, true)?;
        Ok((fd, map))
    }

    /// Worker: map an inherited pool fd; header pages read-only.
    pub fn open(fd: RawFd, geometry: PoolGeometry) -> io::Result<PoolMap> {
        // SAFETY: fstat on an fd number we were told about; failure is reported.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(fd, &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        if st.st_size as u64 != geometry.total_bytes() {
            return Err(io::Error::other(format!(
                "pool {} fd {fd} has {} bytes, expected {}",
                geometry.name,
                st.st_size,
                geometry.total_bytes()
            )));
        }
        PoolMap::map_raw(fd, geometry, false)
    }

    fn map_raw(fd: RawFd, geometry: PoolGeometry, supervisor: bool) -> io::Result<PoolMap> {
        let len = geometry.total_bytes() as usize;
        // The supervisor pre-faults every page once (MAP_POPULATE) so that no batch pays
        // for page faults; workers then find the pages resident.
        let flags = libc::MAP_SHARED | libc::MAP_POPULATE;
        // SAFETY: mapping a file we hold, of exactly its size; checked for MAP_FAILED.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                fd,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        if !supervisor {
            // SAFETY: the header pages are the start of our own mapping.
            let r =
                unsafe { libc::mprotect(base, geometry.header_bytes() as usize, libc::PROT_READ) };
            if r != 0 {
                let e = io::Error::last_os_error();
                // SAFETY: unmapping what we just mapped.
                unsafe { libc::munmap(base, len) };
                return Err(e);
            }
        }
        Ok(PoolMap {
            geometry,
            base: base as *mut u8,
            len,
        })
    }

    pub fn geometry(&self) -> &PoolGeometry {
        &self.geometry
    }

    /// The slots' part of the mapping (page-aligned, writable in every process; the
    /// header pages before it are read-only in workers), e.g. to pin it for a GPU's copies.
    pub fn slots_mapping(&self) -> (*mut u8, usize) {
        let h = self.geometry.header_bytes() as usize;
        // SAFETY: the headers are the first `h` bytes of the mapping.
        (unsafe { self.base.add(h) }, self.len - h)
    }

    pub fn header(&self, slot: u32) -> &SlotHeader {
        assert!(slot < self.geometry.slots, "slot {slot} out of range");
        // SAFETY: in range, properly aligned (headers start at offset 0, 32-byte stride),
        // and SlotHeader is all atomics, valid for any bit pattern.
        unsafe { &*(self.base as *const SlotHeader).add(slot as usize) }
    }

    /// Supervisor only: mirror a slot's state into its header. The payload length and
    /// batch id are stored first and the state last with Release, so a reader that sees
    /// the state with Acquire also sees the rest.
    pub fn publish(
        &self,
        slot: u32,
        state: SlotState,
        owner_pid: u32,
        gen: u64,
        len: u64,
        batch_id: u64,
    ) {
        let h = self.header(slot);
        h.owner_pid.store(owner_pid, Ordering::Relaxed);
        h.gen.store(gen, Ordering::Relaxed);
        h.len.store(len, Ordering::Relaxed);
        h.batch_id.store(batch_id, Ordering::Relaxed);
        // sync point (header): Release pairs with the Acquire load of `state` in a worker's
        // header check (worker/src/plane.rs, check_header): the fields above are visible
        // to whoever sees this state. The payload is not published by this store but by
        // the Deliver/Lease message the supervisor sends after it (module docs, edge 2).
        h.state.store(state as u32, Ordering::Release);
    }

    /// The payload of `slot`. Panics if `slot` is out of range.
    ///
    /// # Safety
    /// The caller holds `slot` for reading (a delivery it has not acknowledged), so no
    /// one writes these bytes while the slice lives, and it received the message that
    /// handed it the slot after the writer's last write (a sync point: module docs).
    pub unsafe fn payload(&self, slot: u32) -> &[u8] {
        assert!(slot < self.geometry.slots, "slot {slot} out of range");
        let off = self.geometry.slot_offset(slot) as usize;
        // SAFETY: in range (checked above), so in bounds of our mapping by construction of
        // the geometry.
        unsafe { std::slice::from_raw_parts(self.base.add(off), self.geometry.slot_bytes as usize) }
    }

    /// The payload of `slot`, to write.
    ///
    /// # Safety
    /// The caller holds `slot` for writing (a lease it has not committed), so no one else
    /// reads or writes these bytes while the slice lives. Its writes reach a reader only
    /// through the message it sends after them (a sync point: module docs).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn payload_mut(&self, slot: u32) -> &mut [u8] {
        assert!(slot < self.geometry.slots, "slot {slot} out of range");
        let off = self.geometry.slot_offset(slot) as usize;
        // SAFETY: in bounds; exclusivity is the caller's promise above.
        unsafe {
            std::slice::from_raw_parts_mut(self.base.add(off), self.geometry.slot_bytes as usize)
        }
    }
}

impl Drop for PoolMap {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly our own mapping.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.len) };
    }
}

/// Clear close-on-exec on `fd` so a child started with exec inherits it.
///
/// # Safety
/// Meant for the child between fork and exec: fcntl is async-signal-safe.
pub unsafe fn inherit_fd(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on an fd number; failure is reported.
    if unsafe { libc::fcntl(fd, libc::F_SETFD, 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_is_page_aligned() {
        let g = PoolGeometry {
            name: "t".into(),
            slots: 3,
            slot_bytes: 5000,
        };
        assert_eq!(g.header_bytes(), 4096);
        assert_eq!(g.slot_offset(0), 4096);
        assert_eq!(g.slot_offset(1), 4096 + 8192);
        assert_eq!(g.total_bytes(), 4096 + 3 * 8192);
    }

    #[test]
    fn header_layout_is_what_the_geometry_assumes() {
        assert_eq!(std::mem::size_of::<SlotHeader>(), SLOT_HEADER_BYTES);
        let g = PoolGeometry {
            name: "t".into(),
            slots: 128,
            slot_bytes: 1,
        };
        assert_eq!(
            g.header_bytes(),
            4096,
            "128 headers of 32 bytes fill one page"
        );
        let g = PoolGeometry {
            name: "t".into(),
            slots: 129,
            slot_bytes: 1,
        };
        assert_eq!(g.header_bytes(), 8192);
    }

    #[test]
    #[should_panic(expected = "slot 2 out of range")]
    fn payload_of_a_slot_out_of_range_panics() {
        let g = PoolGeometry {
            name: "t".into(),
            slots: 2,
            slot_bytes: 100,
        };
        let (_fd, map) = PoolMap::create(g).unwrap();
        // SAFETY: single-threaded test; it must panic before touching memory.
        let _ = unsafe { map.payload(2) };
    }

    #[test]
    #[should_panic(expected = "slot 5 out of range")]
    fn payload_mut_of_a_slot_out_of_range_panics() {
        let g = PoolGeometry {
            name: "t".into(),
            slots: 2,
            slot_bytes: 100,
        };
        let (_fd, map) = PoolMap::create(g).unwrap();
        // SAFETY: single-threaded test; it must panic before touching memory.
        let _ = unsafe { map.payload_mut(5) };
    }

    #[test]
    fn sealed_memfd_is_shared_and_cannot_be_resized() {
        let g = PoolGeometry {
            name: "t".into(),
            slots: 2,
            slot_bytes: 100,
        };
        let (fd, sup) = PoolMap::create(g.clone()).unwrap();
        let worker = PoolMap::open(fd.as_raw_fd(), g).unwrap();
        // SAFETY: single-threaded test; nobody else touches slot 1.
        unsafe { worker.payload_mut(1)[..5].copy_from_slice(b"hello") };
        assert_eq!(unsafe { &sup.payload(1)[..5] }, b"hello");
        sup.publish(1, SlotState::Ready, 42, 7, 5, 99);
        let h = worker.header(1);
        assert_eq!(h.state.load(Ordering::Acquire), SlotState::Ready as u32);
        assert_eq!(
            (
                h.gen.load(Ordering::Relaxed),
                h.batch_id.load(Ordering::Relaxed)
            ),
            (7, 99)
        );
        // SAFETY: ftruncate on our fd; it must be refused by the seals.
        assert_ne!(unsafe { libc::ftruncate(fd.as_raw_fd(), 0) }, 0);
        assert_ne!(unsafe { libc::ftruncate(fd.as_raw_fd(), 1 << 30) }, 0);
    }
}
