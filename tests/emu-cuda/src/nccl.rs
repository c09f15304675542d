//! The NCCL subset the worker calls, across processes, with NCCL's blocking behaviour:
//!
//! - a unique id names a shared-memory file (`/dev/shm/dflash-emu-nccl-<token>`) that every
//!   rank of the communicator maps;
//! - `ncclCommInitRank` returns once every rank has joined (blocking), or at once with
//!   `ncclInProgress` under `ncclCommInitRankConfig` with `blocking = 0`, the join then
//!   finishing in the background (`ncclCommGetAsyncError` says when);
//! - `ncclAllReduce` is queued on the caller's stream (an emulated stream, whose thread it
//!   holds, as an NCCL kernel holds its GPU stream): each rank posts its buffer and waits
//!   for every rank's, then sums in rank order (so every rank gets the same bits);
//! - a rank that is gone (its process died) is noticed by the others while they wait:
//!   their communicator's async error becomes `ncclRemoteError` and the wait ends, as
//!   NCCL's proxy thread reports a peer's closed connection;
//! - `ncclCommAbort` releases this rank's waiters at once.
//!
//! Only sums of f32, f64 and bf16 are emulated (what the worker reduces).

use std::ffi::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

type NcclResult = c_int;
const SUCCESS: NcclResult = 0;
const SYSTEM_ERROR: NcclResult = 2;
const INVALID_ARGUMENT: NcclResult = 4;
const INVALID_USAGE: NcclResult = 5;
const REMOTE_ERROR: NcclResult = 6;
const IN_PROGRESS: NcclResult = 7;

const ID_BYTES: usize = 128;
const ID_PREFIX: &[u8] = b"dflash-emu-nccl:";
const MAX_RANKS: usize = 64;
const API_MAGIC: u32 = 0xcafe_beef;

#[repr(C)]
pub struct UniqueId {
    internal: [c_char; ID_BYTES],
}

/// The shared-memory page of a communicator: who joined (their pids), and per rank how
/// many all-reduces it has posted and finished reading.
#[repr(C)]
struct Shared {
    pids: [AtomicU32; MAX_RANKS],
    posted: [AtomicU64; MAX_RANKS],
    read: [AtomicU64; MAX_RANKS],
    /// Ranks whose communicator is gone (aborted or destroyed): the last one removes the file.
    left: AtomicU32,
}

struct CommState {
    base: String,
    shared: *const Shared,
    nranks: usize,
    rank: usize,
    /// The async error (`ncclInProgress` while joining).
    error: AtomicI32,
    aborted: AtomicBool,
    /// All-reduces queued so far by this rank (their numbers, from 1).
    ops: AtomicU64,
    /// This rank's data files up to this op are removed.
    cleaned: AtomicU64,
}

// SAFETY: the shared page is only accessed through atomics.
unsafe impl Send for CommState {}
unsafe impl Sync for CommState {}

pub struct Comm {
    st: Arc<CommState>,
}

fn say(msg: impl AsRef<str>) {
    eprintln!("emulated NCCL: {}", msg.as_ref());
}

fn alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    pid == 0
        || unsafe { libc::kill(pid as i32, 0) } == 0
        || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

impl CommState {
    fn shared(&self) -> &Shared {
        // SAFETY: mapped for the state's life (unmapped in Drop).
        unsafe { &*self.shared }
    }

    /// Wait until `ready()` holds for every rank; false if aborted or a peer is gone (then
    /// the async error says which).
    fn wait_all(&self, what: &str, ready: impl Fn(usize) -> bool) -> bool {
        let mut spins = 0u32;
        loop {
            if self.aborted.load(Ordering::SeqCst) {
                return false;
            }
            if (0..self.nranks).all(&ready) {
                return true;
            }
            spins += 1;
            if spins % 64 == 0 {
                let sh = self.shared();
                if let Some(r) =
                    (0..self.nranks).find(|&r| !alive(sh.pids[r].load(Ordering::SeqCst)))
                {
                    say(format!(
                        "rank {} (pid {}) is gone while rank {} waits in {what}",
                        r,
                        sh.pids[r].load(Ordering::SeqCst),
                        self.rank
                    ));
                    self.error.store(REMOTE_ERROR, Ordering::SeqCst);
                    return false;
                }
            }
            std::thread::sleep(Duration::from_micros(if spins < 1000 { 20 } else { 500 }));
        }
    }

    fn join(&self) {
        let sh = self.shared();
        let joined = self.wait_all("ncclCommInitRank", |r| {
            sh.pids[r].load(Ordering::SeqCst) != 0
        });
        if joined {
            let _ = self.error.compare_exchange(
                IN_PROGRESS,
                SUCCESS,
                Ordering::SeqCst,
                Ordering::SeqCst,
            );
        }
    }

    fn data_file(&self, rank: usize, op: u64) -> String {
        format!("{}-r{rank}-op{op}", self.base)
    }
}

fn token_of(id: &UniqueId) -> Option<String> {
    let bytes: Vec<u8> = id
        .internal
        .iter()
        .map(|&c| c as u8)
        .take_while(|&b| b != 0)
        .collect();
    let rest = bytes.strip_prefix(ID_PREFIX)?;
    let t = String::from_utf8(rest.to_vec()).ok()?;
    t.chars().all(|c| c.is_ascii_alphanumeric()).then_some(t)
}

#[no_mangle]
pub unsafe extern "C" fn ncclGetVersion(v: *mut c_int) -> NcclResult {
    *v = 23007; // 2.30.7
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn ncclGetUniqueId(id: *mut UniqueId) -> NcclResult {
    let mut seed = [0u8; 8];
    if libc::getrandom(seed.as_mut_ptr().cast(), 8, 0) != 8 {
        return SYSTEM_ERROR;
    }
    let token = format!(
        "{:016x}{:08x}",
        u64::from_le_bytes(seed),
        std::process::id()
    );
    let text = [ID_PREFIX, token.as_bytes()].concat();
    let id = &mut *id;
    id.internal = [0; ID_BYTES];
    for (d, &b) in id.internal.iter_mut().zip(&text) {
        *d = b as c_char;
    }
    SUCCESS
}

unsafe fn init(
    comm: *mut *mut Comm,
    nranks: c_int,
    id: &UniqueId,
    rank: c_int,
    blocking: bool,
) -> NcclResult {
    let Some(token) = token_of(id) else {
        say("ncclCommInitRank with an id that ncclGetUniqueId did not make");
        return INVALID_ARGUMENT;
    };
    if nranks < 1 || nranks as usize > MAX_RANKS || rank < 0 || rank >= nranks {
        say(format!("ncclCommInitRank: rank {rank} of {nranks}"));
        return INVALID_ARGUMENT;
    }
    if crate::CURRENT.with(|c| c.get()) == 0 {
        say("ncclCommInitRank on a thread with no current CUDA context");
        return INVALID_USAGE;
    }
    let base = format!("/dev/shm/dflash-emu-nccl-{token}");
    let path = std::ffi::CString::new(base.clone()).unwrap();
    let fd = libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CREAT, 0o600);
    if fd < 0 {
        say(format!("{base}: {}", std::io::Error::last_os_error()));
        return SYSTEM_ERROR;
    }
    let size = std::mem::size_of::<Shared>();
    // Every rank sets the same size; the first one's zeroes are what all see.
    if libc::ftruncate(fd, size as libc::off_t) != 0 {
        libc::close(fd);
        return SYSTEM_ERROR;
    }
    let p = libc::mmap(
        std::ptr::null_mut(),
        size,
        libc::PROT_READ | libc::PROT_WRITE,
        libc::MAP_SHARED,
        fd,
        0,
    );
    libc::close(fd);
    if p == libc::MAP_FAILED {
        return SYSTEM_ERROR;
    }
    let st = Arc::new(CommState {
        base,
        shared: p as *const Shared,
        nranks: nranks as usize,
        rank: rank as usize,
        error: AtomicI32::new(IN_PROGRESS),
        aborted: AtomicBool::new(false),
        ops: AtomicU64::new(0),
        cleaned: AtomicU64::new(0),
    });
    let sh = st.shared();
    if sh.pids[rank as usize].swap(std::process::id(), Ordering::SeqCst) != 0 {
        say(format!("rank {rank} joined the communicator twice"));
        return INVALID_USAGE;
    }
    *comm = Box::into_raw(Box::new(Comm { st: st.clone() }));
    if blocking {
        st.join();
        return st.error.load(Ordering::SeqCst);
    }
    std::thread::Builder::new()
        .name("emu-nccl-join".into())
        .spawn(move || st.join())
        .map(|_| IN_PROGRESS)
        .unwrap_or(SYSTEM_ERROR)
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRank(
    comm: *mut *mut Comm,
    nranks: c_int,
    id: UniqueId,
    rank: c_int,
) -> NcclResult {
    init(comm, nranks, &id, rank, true)
}

/// The head of `ncclConfig_t` (every version starts so): size, magic, version, blocking.
#[repr(C)]
pub struct ConfigHead {
    size: usize,
    magic: u32,
    version: u32,
    blocking: c_int,
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRankConfig(
    comm: *mut *mut Comm,
    nranks: c_int,
    id: UniqueId,
    rank: c_int,
    config: *const ConfigHead,
) -> NcclResult {
    let blocking = match config.as_ref() {
        None => true,
        Some(c) if c.magic != API_MAGIC || c.size < std::mem::size_of::<ConfigHead>() => {
            say("ncclCommInitRankConfig: a config not made by NCCL_CONFIG_INITIALIZER (magic or size)");
            return INVALID_ARGUMENT;
        }
        // NCCL_CONFIG_UNDEF_INT (INT_MIN) is the default: blocking.
        Some(c) => c.blocking != 0,
    };
    init(comm, nranks, &id, rank, blocking)
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommGetAsyncError(
    comm: *mut Comm,
    err: *mut NcclResult,
) -> NcclResult {
    let Some(c) = comm.as_ref() else {
        return INVALID_ARGUMENT;
    };
    *err = c.st.error.load(Ordering::SeqCst);
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommAbort(comm: *mut Comm) -> NcclResult {
    if comm.is_null() {
        return SUCCESS;
    }
    let c = Box::from_raw(comm);
    c.st.aborted.store(true, Ordering::SeqCst);
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommDestroy(comm: *mut Comm) -> NcclResult {
    ncclCommAbort(comm)
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommFinalize(comm: *mut Comm) -> NcclResult {
    if comm.is_null() {
        INVALID_ARGUMENT
    } else {
        SUCCESS
    }
}

#[no_mangle]
pub extern "C" fn ncclGetErrorString(r: NcclResult) -> *const c_char {
    match r {
        SUCCESS => c"no error",
        SYSTEM_ERROR => c"unhandled system error",
        INVALID_ARGUMENT => c"invalid argument",
        INVALID_USAGE => c"invalid usage",
        REMOTE_ERROR => c"remote process exited or there was a network error",
        IN_PROGRESS => c"NCCL operation in progress",
        _ => c"unknown result code",
    }
    .as_ptr()
}

#[no_mangle]
pub unsafe extern "C" fn ncclGetLastError(_comm: *mut Comm) -> *const c_char {
    c"".as_ptr()
}

#[derive(Clone, Copy)]
enum Ty {
    F32,
    F64,
    Bf16,
}

impl Ty {
    fn bytes(self) -> usize {
        match self {
            Ty::F32 => 4,
            Ty::F64 => 8,
            Ty::Bf16 => 2,
        }
    }
}

/// `acc[i] += x[i]` for `n` elements of `ty` (bf16 through f32, rounded to nearest even).
fn add_into(acc: &mut [u8], x: &[u8], ty: Ty) {
    match ty {
        Ty::F32 => {
            for (a, b) in acc.chunks_exact_mut(4).zip(x.chunks_exact(4)) {
                let v = f32::from_le_bytes(a.try_into().unwrap())
                    + f32::from_le_bytes(b.try_into().unwrap());
                a.copy_from_slice(&v.to_le_bytes());
            }
        }
        Ty::F64 => {
            for (a, b) in acc.chunks_exact_mut(8).zip(x.chunks_exact(8)) {
                let v = f64::from_le_bytes(a.try_into().unwrap())
                    + f64::from_le_bytes(b.try_into().unwrap());
                a.copy_from_slice(&v.to_le_bytes());
            }
        }
        Ty::Bf16 => {
            let w = |c: &[u8]| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
            for (a, b) in acc.chunks_exact_mut(2).zip(x.chunks_exact(2)) {
                let v = w(a) + w(b);
                let u = v.to_bits();
                let r = if v.is_nan() {
                    (u >> 16) | 0x40
                } else {
                    (u + 0x7fff + ((u >> 16) & 1)) >> 16
                };
                a.copy_from_slice(&(r as u16).to_le_bytes());
            }
        }
    }
}

/// The all-reduce number `op` of `st`, run on the stream's thread.
fn all_reduce(st: &CommState, op: u64, send: u64, recv: u64, bytes: usize, ty: Ty) {
    let sh = st.shared();
    // SAFETY: device (= host) memory of `bytes`, checked when queued.
    let mine = unsafe { std::slice::from_raw_parts(send as *const u8, bytes) }.to_vec();
    if std::fs::write(st.data_file(st.rank, op), &mine).is_err() {
        st.error.store(SYSTEM_ERROR, Ordering::SeqCst);
        return;
    }
    sh.posted[st.rank].store(op, Ordering::SeqCst);
    if !st.wait_all("ncclAllReduce", |r| {
        sh.posted[r].load(Ordering::SeqCst) >= op
    }) {
        return;
    }
    // In rank order: every rank sums the same values in the same order.
    let mut acc: Option<Vec<u8>> = None;
    for r in 0..st.nranks {
        let data = if r == st.rank {
            mine.clone()
        } else {
            match std::fs::read(st.data_file(r, op)) {
                Ok(d) => d,
                Err(_) => {
                    // It posted, then left (its communicator was destroyed): a peer gone.
                    say(format!(
                        "rank {r} left while rank {} reads all-reduce {op}",
                        st.rank
                    ));
                    st.error.store(REMOTE_ERROR, Ordering::SeqCst);
                    return;
                }
            }
        };
        if data.len() != bytes {
            say(format!("rank {} all-reduce {op}: rank {r} posted {} bytes, this rank {bytes} (a count that differs between ranks)", st.rank, data.len()));
            st.error.store(INVALID_USAGE, Ordering::SeqCst);
            return;
        }
        match &mut acc {
            None => acc = Some(data),
            Some(a) => add_into(a, &data, ty),
        }
    }
    let acc = acc.expect("at least one rank");
    // SAFETY: as above.
    unsafe { std::ptr::copy_nonoverlapping(acc.as_ptr(), recv as *mut u8, bytes) };
    sh.read[st.rank].store(op, Ordering::SeqCst);
    // Every rank has read every file of this op: this rank's may go.
    if st.wait_all("ncclAllReduce", |r| sh.read[r].load(Ordering::SeqCst) >= op) {
        let _ = std::fs::remove_file(st.data_file(st.rank, op));
        st.cleaned.fetch_max(op, Ordering::SeqCst);
    }
}

#[no_mangle]
pub unsafe extern "C" fn ncclAllReduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    comm: *mut Comm,
    stream: u64,
) -> NcclResult {
    let Some(c) = comm.as_ref() else {
        return INVALID_ARGUMENT;
    };
    let ty = match dtype {
        7 => Ty::F32,
        8 => Ty::F64,
        9 => Ty::Bf16,
        _ => {
            say(format!(
                "ncclAllReduce of data type {dtype} is not emulated (f32, f64, bf16)"
            ));
            return INVALID_ARGUMENT;
        }
    };
    if op != 0 {
        say(format!(
            "ncclAllReduce with op {op}: only ncclSum is emulated"
        ));
        return INVALID_ARGUMENT;
    }
    match c.st.error.load(Ordering::SeqCst) {
        SUCCESS => {}
        IN_PROGRESS => {
            say("ncclAllReduce on a communicator still joining (poll ncclCommGetAsyncError first)");
            return INVALID_USAGE;
        }
        e => return e,
    }
    let bytes = count * ty.bytes();
    let (sid, clock) = match crate::stream_clock(stream) {
        Ok(v) => v,
        Err(_) => return INVALID_USAGE,
    };
    let d = crate::driver();
    for (p, what) in [(send as u64, "sendbuff"), (recv as u64, "recvbuff")] {
        if let Err(f) = d.check_device_ptr(p, sid, &clock, &format!("ncclAllReduce {what}")) {
            say(&f.1);
            return INVALID_ARGUMENT;
        }
        if !matches!(d.find(p), Some((start, len, _)) if p + bytes as u64 <= start + len as u64) {
            say(format!(
                "ncclAllReduce {what}: {bytes} bytes at {p:#x} run past the end of the allocation"
            ));
            return INVALID_ARGUMENT;
        }
    }
    let n = c.st.ops.fetch_add(1, Ordering::SeqCst) + 1;
    let st = c.st.clone();
    let (send, recv) = (send as u64, recv as u64);
    match crate::submit(
        stream,
        Box::new(move || {
            // An aborted or failed communicator's kernels end without reducing (the data is
            // whatever it was); the error is the communicator's, not the CUDA context's.
            if !st.aborted.load(Ordering::SeqCst) && st.error.load(Ordering::SeqCst) == SUCCESS {
                all_reduce(&st, n, send, recv, bytes, ty);
            }
            Ok(())
        }),
    ) {
        Ok(_) => SUCCESS,
        Err(_) => INVALID_USAGE,
    }
}

impl Drop for CommState {
    fn drop(&mut self) {
        // This rank's files that no wait got to remove (an aborted all-reduce's).
        for op in self.cleaned.load(Ordering::SeqCst) + 1..=self.ops.load(Ordering::SeqCst) {
            let _ = std::fs::remove_file(self.data_file(self.rank, op));
        }
        // The last rank to leave removes the name (a rank that died never leaves: its
        // communicator's file stays in /dev/shm, a few KB).
        if self.shared().left.fetch_add(1, Ordering::SeqCst) + 1 == self.nranks as u32 {
            let _ = std::fs::remove_file(&self.base);
        }
        // SAFETY: this rank's mapping, used by nobody now (the last Arc is gone).
        unsafe { libc::munmap(self.shared as *mut c_void, std::mem::size_of::<Shared>()) };
    }
}
