//! Streams (a thread each, running its work in order), events, and the vector clocks that
//! say what is ordered before what.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::Instant;

use crate::{Driver, Fault};

/// `CUDA_ERROR_LAUNCH_FAILED`.
pub const LAUNCH_FAILED: crate::CUresult = 719;

/// Work queued on a stream; an error is the stream's fault (sticky for the context).
pub type Job = Box<dyn FnOnce() -> Result<(), Fault> + Send>;

/// A vector clock over streams: entry `s` is the last operation of stream `s` that is
/// ordered before whatever holds this clock.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Clock(Vec<u64>);

impl Clock {
    pub fn get(&self, s: u32) -> u64 {
        self.0.get(s as usize).copied().unwrap_or(0)
    }

    pub fn merge(&mut self, o: &Clock) {
        if self.0.len() < o.0.len() {
            self.0.resize(o.0.len(), 0);
        }
        for (a, b) in self.0.iter_mut().zip(&o.0) {
            *a = (*a).max(*b);
        }
    }

    fn bump(&mut self, s: u32) -> u64 {
        let i = s as usize;
        if self.0.len() <= i {
            self.0.resize(i + 1, 0);
        }
        self.0[i] += 1;
        self.0[i]
    }
}

/// Jobs queued and jobs done, with a condition variable for those who wait.
#[derive(Default)]
struct Progress {
    counts: Mutex<(u64, u64)>,
    cv: Condvar,
}

pub struct Stream {
    pub id: u32,
    tx: Mutex<Sender<Job>>,
    progress: Arc<Progress>,
    clock: Mutex<Clock>,
}

static STREAMS: Mutex<Vec<Weak<Stream>>> = Mutex::new(Vec::new());

/// Host waits that left the stream waited for with nothing queued behind the point waited
/// for: on a GPU the stream runs dry while the host catches up (a bubble). Read by
/// [`crate::dflash_emu_dry_waits`].
pub static DRY_WAITS: AtomicU64 = AtomicU64::new(0);

/// Count a host wait on stream `id` up to its operation `tick`, if nothing follows it.
pub fn note_wait(id: u32, tick: u64) {
    let stream = all_streams().into_iter().find(|s| s.id == id);
    if stream.is_none_or(|s| s.own_tick() <= tick) {
        DRY_WAITS.fetch_add(1, Ordering::SeqCst);
    }
}

/// Every stream alive (for `cuCtxSynchronize`).
pub fn all_streams() -> Vec<Arc<Stream>> {
    let mut v = STREAMS.lock().unwrap();
    v.retain(|w| w.strong_count() > 0);
    v.iter().filter_map(Weak::upgrade).collect()
}

impl Stream {
    pub fn spawn(id: u32) -> Arc<Stream> {
        let (tx, rx) = channel::<Job>();
        let progress = Arc::new(Progress::default());
        let p = progress.clone();
        std::thread::Builder::new()
            .name(format!("emu-stream-{id}"))
            .spawn(move || {
                for job in rx {
                    if let Err(f) = job() {
                        crate::driver().fault(f);
                    }
                    let mut c = p.counts.lock().unwrap();
                    c.1 += 1;
                    p.cv.notify_all();
                }
            })
            .expect("starting a stream thread");
        let s = Arc::new(Stream {
            id,
            tx: Mutex::new(tx),
            progress,
            clock: Mutex::new(Clock::default()),
        });
        STREAMS.lock().unwrap().push(Arc::downgrade(&s));
        s
    }

    pub fn into_handle(self: Arc<Self>) -> u64 {
        Arc::into_raw(self) as u64
    }

    /// # Safety
    /// `h` came from [`into_handle`](Self::into_handle) and was not released.
    pub unsafe fn from_handle(h: u64) -> Arc<Stream> {
        let p = h as *const Stream;
        Arc::increment_strong_count(p);
        Arc::from_raw(p)
    }

    /// # Safety
    /// As for [`from_handle`](Self::from_handle); the handle is not used after.
    pub unsafe fn release_handle(h: u64) {
        drop(Arc::from_raw(h as *const Stream));
    }

    /// What this stream's next operation is ordered after (its own past and the host's).
    pub fn clock(&self) -> Clock {
        let mut c = self.clock.lock().unwrap().clone();
        c.merge(&crate::driver().host_clock());
        c
    }

    /// This stream's last operation's number.
    pub fn own_tick(&self) -> u64 {
        self.clock.lock().unwrap().get(self.id)
    }

    pub fn merge_clock(&self, c: &Clock) {
        self.clock.lock().unwrap().merge(c);
    }

    /// A new operation on this stream: ordered after what the host did before queueing it.
    pub fn tick(&self, d: &Driver) -> Clock {
        let mut c = self.clock.lock().unwrap();
        c.merge(&d.host_clock());
        c.bump(self.id);
        c.clone()
    }

    /// Queue `job` as a new operation; returns its clock.
    pub fn submit(&self, d: &Driver, job: Job) -> Clock {
        let c = self.tick(d);
        self.submit_ordered(job);
        c
    }

    /// Queue `job` without a new clock entry (a wait, or the completion of an event whose
    /// clock was taken).
    pub fn submit_ordered(&self, job: Job) {
        self.progress.counts.lock().unwrap().0 += 1;
        // The thread lives as long as a sender does: this one.
        self.tx
            .lock()
            .unwrap()
            .send(job)
            .expect("a stream thread is gone");
    }

    /// Block until everything queued so far has run (a dry wait: nothing is left behind
    /// it); returns the clock it covers. Spins, as the driver does, unless the context
    /// blocks (`BLOCKING_CONTEXT`).
    pub fn drain(&self) -> Clock {
        DRY_WAITS.fetch_add(1, Ordering::SeqCst);
        let c = self.clock.lock().unwrap().clone();
        let target = self.progress.counts.lock().unwrap().0;
        if !BLOCKING_CONTEXT.load(Ordering::SeqCst) {
            spin_until(|| self.progress.counts.lock().unwrap().1 >= target);
            return c;
        }
        let mut n = self.progress.counts.lock().unwrap();
        while n.1 < target {
            n = self.progress.cv.wait(n).unwrap();
        }
        c
    }

    pub fn idle(&self) -> bool {
        let n = self.progress.counts.lock().unwrap();
        n.1 == n.0
    }
}

/// Whether the primary context was given `CU_CTX_SCHED_BLOCKING_SYNC` before it was made:
/// a host thread waiting in a stream or context sync then sleeps. Otherwise it spins, as
/// the driver's default (`CU_CTX_SCHED_AUTO` with fewer contexts than cores) does: a
/// core at 100 % for the whole wait.
pub static BLOCKING_CONTEXT: AtomicBool = AtomicBool::new(false);

/// A host wait as the driver spins it: polling, never sleeping.
fn spin_until(mut done: impl FnMut() -> bool) {
    while !done() {
        for _ in 0..64 {
            std::hint::spin_loop();
        }
    }
}

#[derive(Default)]
struct EventState {
    /// Records made (each one's number), and the last one completed.
    recorded: u64,
    completed: u64,
    clock: Clock,
    time: Option<Instant>,
    /// The stream of the last record, and that record's operation number on it.
    origin: (u32, u64),
}

#[derive(Default)]
pub struct EventObj {
    st: Mutex<EventState>,
    cv: Condvar,
    /// Made with `CU_EVENT_BLOCKING_SYNC`: `cuEventSynchronize` sleeps; otherwise the
    /// calling thread busy-waits (the driver's documented behaviour).
    blocking: bool,
}

impl EventObj {
    pub fn create(blocking: bool) -> u64 {
        Arc::into_raw(Arc::new(EventObj {
            blocking,
            ..EventObj::default()
        })) as u64
    }

    /// # Safety
    /// `h` came from [`create`](Self::create) and was not destroyed.
    pub unsafe fn get(h: u64) -> Arc<EventObj> {
        let p = h as *const EventObj;
        Arc::increment_strong_count(p);
        Arc::from_raw(p)
    }

    /// # Safety
    /// As for [`get`](Self::get); not used after. A record still queued keeps it alive.
    pub unsafe fn destroy(h: u64) {
        drop(Arc::from_raw(h as *const EventObj));
    }

    /// A new record on stream `stream` with the clock of the stream at that point;
    /// returns its number.
    pub fn begin_record(&self, clock: Clock, stream: u32) -> u64 {
        let mut s = self.st.lock().unwrap();
        s.recorded += 1;
        s.origin = (stream, clock.get(stream));
        s.clock = clock;
        s.recorded
    }

    /// The stream of the last record and the record's operation number on it.
    pub fn origin(&self) -> (u32, u64) {
        self.st.lock().unwrap().origin
    }

    pub fn complete(&self, n: u64) {
        let mut s = self.st.lock().unwrap();
        if n > s.completed {
            s.completed = n;
            s.time = Some(Instant::now());
        }
        self.cv.notify_all();
    }

    /// The last record and its clock (what a wait on the event is ordered after).
    pub fn snapshot(&self) -> (u64, Clock) {
        let s = self.st.lock().unwrap();
        (s.recorded, s.clock.clone())
    }

    pub fn clock(&self) -> Clock {
        self.st.lock().unwrap().clock.clone()
    }

    pub fn is_done(&self) -> bool {
        let s = self.st.lock().unwrap();
        s.completed >= s.recorded
    }

    pub fn wait_for(&self, n: u64) {
        let mut s = self.st.lock().unwrap();
        while s.completed < n {
            s = self.cv.wait(s).unwrap();
        }
    }

    /// The host's `cuEventSynchronize`: spins unless the event blocks.
    pub fn wait_done(&self) {
        let n = self.st.lock().unwrap().recorded;
        if self.blocking {
            self.wait_for(n);
        } else {
            spin_until(|| self.st.lock().unwrap().completed >= n);
        }
    }

    pub fn time(&self) -> Option<Instant> {
        self.st.lock().unwrap().time
    }
}
