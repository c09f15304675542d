//! The stream-order checker: a vector clock per stream (and one for the host) and, per
//! tracked range of memory, its last write and the reads since. Every access of an
//! operation must be ordered after the last write to its range (and a write after every
//! read since) by stream order, an event wait, or a host sync; otherwise it fails with
//! [`GpuError::Race`] naming both sides. The host device checks every operation with it
//! ([`super::host::HostDevice`]); [`Checked`] puts it in front of any device — the CUDA
//! device over the emulated driver in the tests (`DFLASH_CHECK_STREAMS=1`), or a real GPU,
//! where it only costs host-side bookkeeping.
//!
//! It relies on what the ops layer declares of each kernel argument ([`Arg::R`],
//! [`Arg::W`], [`Arg::RW`]): what a driver never sees.

use std::collections::BTreeMap;

use super::{
    Arg, DSlice, DevPtr, Device, Event, EventTable, Gemm, GpuError, Kernel, Result, Stream,
};

/// Clock slots: the two streams, then the host.
const HOST: usize = 2;
pub type Clock = [u64; 3];

#[derive(Debug, Clone)]
struct Access {
    clock_slot: usize,
    seq: u64,
    what: String,
}

#[derive(Debug)]
struct Region {
    end: u64,
    name: String,
    last_write: Option<Access>,
    reads: Vec<Access>,
}

#[derive(Debug, Default)]
pub struct RaceDetector {
    /// Tracked ranges by start address (non-overlapping).
    regions: BTreeMap<u64, Region>,
    clocks: [Clock; 3],
}

fn stream_name(slot: usize) -> &'static str {
    ["the compute stream", "the copy stream", "the host"][slot]
}

fn race(me: &Access, write: bool, region: &str, other: &Access, how: &str) -> GpuError {
    GpuError::Race(format!(
        "{} on {} {} {region}, {how} by {} on {} with no event or sync ordering them",
        me.what,
        stream_name(me.clock_slot),
        if write { "writes" } else { "reads" },
        other.what,
        stream_name(other.clock_slot)
    ))
}

impl RaceDetector {
    /// Check and record one access by `slot` (a stream or the host) at sequence `seq`.
    fn access(
        &mut self,
        slot: usize,
        seq: u64,
        buf: DSlice,
        write: bool,
        what: &str,
    ) -> Result<()> {
        if buf.bytes == 0 {
            return Ok(());
        }
        let clock = self.clocks[slot];
        let (lo, hi) = (buf.ptr, buf.ptr + buf.bytes as u64);
        let first = self
            .regions
            .range(..=lo)
            .next_back()
            .map(|(k, _)| *k)
            .unwrap_or(lo);
        let me = Access {
            clock_slot: slot,
            seq,
            what: what.to_string(),
        };
        for (_, r) in self.regions.range_mut(first..hi) {
            if r.end <= lo {
                continue;
            }
            let ordered = |a: &Access| a.clock_slot == slot || clock[a.clock_slot] >= a.seq;
            if let Some(w) = &r.last_write {
                if !ordered(w) {
                    return Err(race(&me, write, &r.name, w, "written"));
                }
            }
            if write {
                if let Some(rd) = r.reads.iter().find(|a| !ordered(a)) {
                    return Err(race(&me, write, &r.name, rd, "read"));
                }
                r.last_write = Some(me.clone());
                r.reads.clear();
            } else {
                r.reads.retain(|a| a.clock_slot != slot);
                r.reads.push(me.clone());
            }
        }
        Ok(())
    }

    fn merge_into(&mut self, slot: usize, c: Clock) {
        for (a, b) in self.clocks[slot].iter_mut().zip(c) {
            *a = (*a).max(b);
        }
    }

    /// A new operation on `s`: its sequence number. Whatever the host did before queueing
    /// it (including the syncs it waited for) is ordered before it.
    pub fn op(&mut self, s: Stream) -> u64 {
        let i = s.index();
        let host = self.clocks[HOST];
        self.merge_into(i, host);
        self.clocks[i][i] += 1;
        self.clocks[i][i]
    }

    /// Operation `seq` on `s` reads (`write` false) or writes `buf`.
    pub fn on_stream(
        &mut self,
        s: Stream,
        seq: u64,
        buf: DSlice,
        write: bool,
        what: &str,
    ) -> Result<()> {
        self.access(s.index(), seq, buf, write, what)
    }

    /// The host reads or writes `buf` now (pinned memory that a stream may use).
    pub fn host_access(&mut self, buf: DSlice, write: bool) -> Result<()> {
        self.clocks[HOST][HOST] += 1;
        let seq = self.clocks[HOST][HOST];
        self.access(HOST, seq, buf, write, "the host")
    }

    /// Name `buf`, carving it out of whatever range it overlapped (keeping their rest).
    pub fn track(&mut self, buf: DSlice, name: &str) {
        if buf.bytes == 0 {
            return;
        }
        let (lo, hi) = (buf.ptr, buf.ptr + buf.bytes as u64);
        let overlapping: Vec<u64> = self
            .regions
            .range(..hi)
            .filter(|(k, r)| r.end > lo && **k < hi)
            .map(|(k, _)| *k)
            .collect();
        for k in overlapping {
            let r = self.regions.remove(&k).expect("listed");
            if k < lo {
                self.regions.insert(
                    k,
                    Region {
                        end: lo,
                        name: r.name.clone(),
                        last_write: r.last_write.clone(),
                        reads: r.reads.clone(),
                    },
                );
            }
            if r.end > hi {
                self.regions.insert(
                    hi,
                    Region {
                        end: r.end,
                        name: r.name.clone(),
                        last_write: r.last_write.clone(),
                        reads: r.reads.clone(),
                    },
                );
            }
        }
        self.regions.insert(
            lo,
            Region {
                end: hi,
                name: name.to_string(),
                last_write: None,
                reads: Vec::new(),
            },
        );
    }

    /// A launch on `s`: the buffers it reads, then those it writes (an argument both read
    /// and written counts as a write).
    pub fn launch(&mut self, s: Stream, kernel: &str, args: &[Arg]) -> Result<()> {
        let seq = self.op(s);
        let what = format!("kernel {kernel}");
        for a in args {
            if let Arg::R(b) = a {
                self.on_stream(s, seq, *b, false, &what)?;
            }
        }
        for a in args {
            if let Arg::W(b) | Arg::RW(b) = a {
                self.on_stream(s, seq, *b, true, &what)?;
            }
        }
        Ok(())
    }

    /// A GEMM on `s`: reads A and B, writes C, each over its extent.
    pub fn gemm(&mut self, s: Stream, g: &Gemm) -> Result<()> {
        let seq = self.op(s);
        let (ea, eb, ec) = g.extents();
        let e = g.input_bytes();
        self.on_stream(
            s,
            seq,
            DSlice {
                ptr: g.a.ptr,
                bytes: ea * e,
            },
            false,
            "a GEMM",
        )?;
        self.on_stream(
            s,
            seq,
            DSlice {
                ptr: g.b.ptr,
                bytes: eb * e,
            },
            false,
            "a GEMM",
        )?;
        self.on_stream(
            s,
            seq,
            DSlice {
                ptr: g.c.ptr,
                bytes: ec * g.output_bytes(),
            },
            true,
            "a GEMM",
        )
    }

    /// What an event recorded on `s` now stands for.
    pub fn record(&self, s: Stream) -> Clock {
        self.clocks[s.index()]
    }

    /// `s` waits for an event of clock `c`.
    pub fn wait(&mut self, s: Stream, c: Clock) {
        self.merge_into(s.index(), c);
    }

    /// The host has seen an event of clock `c` complete.
    pub fn host_waited(&mut self, c: Clock) {
        self.merge_into(HOST, c);
    }

    /// The host has waited for everything queued on `s`.
    pub fn host_waited_for(&mut self, s: Stream) {
        let c = self.clocks[s.index()];
        self.merge_into(HOST, c);
    }
}

/// Any device behind the stream-order checker (see the module docs): every operation is
/// checked, then done by the device.
pub struct Checked {
    inner: Box<dyn Device>,
    race: RaceDetector,
    /// Our events: the clock each stands for and the device's own event.
    events: EventTable<(Clock, Event)>,
}

impl Checked {
    pub fn new(inner: Box<dyn Device>) -> Checked {
        Checked {
            inner,
            race: RaceDetector::default(),
            events: EventTable::default(),
        }
    }
}

impl Device for Checked {
    fn describe(&self) -> String {
        format!("{} (stream-checked)", self.inner.describe())
    }

    fn alloc(&mut self, bytes: usize) -> Result<DevPtr> {
        let p = self.inner.alloc(bytes)?;
        self.race.track(DSlice { ptr: p, bytes }, "allocation");
        Ok(p)
    }

    fn mem_info(&self) -> Result<(usize, usize)> {
        self.inner.mem_info()
    }

    fn track(&mut self, buf: DSlice, name: &str) {
        self.race.track(buf, name);
        self.inner.track(buf, name);
    }

    fn upload(&mut self, s: Stream, dst: DSlice, src: &[u8]) -> Result<()> {
        let seq = self.race.op(s);
        self.race.on_stream(
            s,
            seq,
            DSlice {
                ptr: dst.ptr,
                bytes: src.len().min(dst.bytes),
            },
            true,
            "an upload",
        )?;
        self.inner.upload(s, dst, src)
    }

    fn download(&mut self, s: Stream, src: DSlice, dst: &mut [u8]) -> Result<()> {
        let seq = self.race.op(s);
        self.race.on_stream(
            s,
            seq,
            DSlice {
                ptr: src.ptr,
                bytes: dst.len().min(src.bytes),
            },
            false,
            "a download",
        )?;
        self.inner.download(s, src, dst)?;
        self.race.host_waited_for(s);
        Ok(())
    }

    unsafe fn download_async(&mut self, s: Stream, src: DSlice, dst: *mut u8) -> Result<()> {
        let seq = self.race.op(s);
        self.race
            .on_stream(s, seq, src, false, "an async download")?;
        self.race.on_stream(
            s,
            seq,
            DSlice {
                ptr: dst as u64,
                bytes: src.bytes,
            },
            true,
            "an async download",
        )?;
        self.inner.download_async(s, src, dst)
    }

    unsafe fn upload_async(&mut self, s: Stream, dst: DSlice, src: *const u8) -> Result<()> {
        let seq = self.race.op(s);
        self.race.on_stream(
            s,
            seq,
            DSlice {
                ptr: src as u64,
                bytes: dst.bytes,
            },
            false,
            "an async upload",
        )?;
        self.race.on_stream(s, seq, dst, true, "an async upload")?;
        self.inner.upload_async(s, dst, src)
    }

    unsafe fn register_host(&mut self, ptr: *mut u8, bytes: usize) -> Result<()> {
        self.inner.register_host(ptr, bytes)?;
        self.race.track(
            DSlice {
                ptr: ptr as u64,
                bytes,
            },
            "pinned host memory",
        );
        Ok(())
    }

    fn host_access(&mut self, ptr: *const u8, bytes: usize, write: bool) -> Result<()> {
        self.race.host_access(
            DSlice {
                ptr: ptr as u64,
                bytes,
            },
            write,
        )?;
        self.inner.host_access(ptr, bytes, write)
    }

    fn memset_zero(&mut self, s: Stream, dst: DSlice) -> Result<()> {
        let seq = self.race.op(s);
        self.race.on_stream(s, seq, dst, true, "a memset")?;
        self.inner.memset_zero(s, dst)
    }

    fn launch(&mut self, s: Stream, k: &Kernel, grid: u32, block: u32) -> Result<()> {
        self.race.launch(s, k.name(), &k.args())?;
        self.inner.launch(s, k, grid, block)
    }

    fn gemm(&mut self, s: Stream, g: &Gemm) -> Result<()> {
        g.validate()?;
        self.race.gemm(s, g)?;
        self.inner.gemm(s, g)
    }

    fn record(&mut self, s: Stream) -> Result<Event> {
        let e = self.inner.record(s)?;
        Ok(self.events.insert((self.race.record(s), e)))
    }

    fn wait(&mut self, s: Stream, e: Event) -> Result<()> {
        let (c, inner) = *self.events.get(e)?;
        self.race.wait(s, c);
        self.inner.wait(s, inner)
    }

    fn sync_event(&mut self, e: Event) -> Result<()> {
        let (c, inner) = *self.events.get(e)?;
        self.inner.sync_event(inner)?;
        self.race.host_waited(c);
        Ok(())
    }

    fn sync(&mut self) -> Result<()> {
        self.inner.sync()?;
        self.race.host_waited_for(Stream::Compute);
        self.race.host_waited_for(Stream::Copy);
        Ok(())
    }

    fn take_kernel_seconds(&mut self) -> Vec<(String, f64)> {
        self.inner.take_kernel_seconds()
    }

    fn release_event(&mut self, e: Event) {
        if let Ok(&(_, inner)) = self.events.get(e) {
            self.inner.release_event(inner);
        }
        self.events.release(e);
    }

    fn event_done(&mut self, e: Event) -> Result<bool> {
        let (c, inner) = *self.events.get(e)?;
        let done = self.inner.event_done(inner)?;
        if done {
            self.race.host_waited(c);
        }
        Ok(done)
    }

    fn cuda_handles(
        &self,
    ) -> Option<(
        std::sync::Arc<cudarc::driver::CudaContext>,
        [cudarc::driver::sys::CUstream; 2],
    )> {
        self.inner.cuda_handles()
    }
}
