//! `dflash-supervise bench ipc`: what moving a batch between processes costs, measured in
//! one run on this machine, against baselines measured in the same run.
//!
//! Three processes, as in a real run: this one plays the supervisor and relays every
//! commit and ack (so a hand-off is two control messages, producer → supervisor →
//! consumer), and two peers (`__bench-peer`) play a target writing batches and a drafter
//! reading them.
//!
//! - `memcpy`: one core copying a pre-faulted buffer (the ceiling for one copy per hop).
//! - `pool`: two sealed, pre-faulted memfd slots; the producer copies every byte into a
//!   slot and commits, the consumer reads every byte (checksum) and acks.
//! - `ipc_channel`: the same bytes through `IpcBytesSender`, consumer reads every byte.
//! - `handoff`: a 4 KiB batch, commit → delivery, half of the measured round trip.
//! - `futex`: a bare futex ping-pong between the two peers over shared memory.

use std::collections::BTreeMap;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use dflash_shared::pool::{PoolGeometry, PoolMap};
use ipc_channel::ipc::{
    self, IpcBytesReceiver, IpcBytesSender, IpcOneShotServer, IpcReceiver, IpcSender,
};
use serde::{Deserialize, Serialize};

use crate::error::Error;

const MB: u64 = 1 << 20;
const SIZES_MB: [u64; 3] = [4, 64, 256];
const SMALL: u64 = 4096;

#[derive(Debug, Serialize, Deserialize)]
enum Cmd {
    /// First command to each peer: what to map, and its end of the bytes channel.
    Setup(Setup),
    /// Producer: write `iters` batches of `size` bytes into pool `pool`.
    Produce {
        pool: usize,
        size: u64,
        iters: u32,
    },
    /// Producer: send `iters` messages of `size` bytes on the bytes channel.
    SendBytes {
        size: u64,
        iters: u32,
    },
    /// Producer: `iters` round trips of a small batch through the small pool.
    Handoff {
        iters: u32,
    },
    /// Both: `iters` futex round trips; the leader starts each and times it.
    Futex {
        iters: u32,
        leader: bool,
    },
    /// Producer: this slot (or, for bytes, this credit) is free again.
    Free {
        slot: u32,
    },
    /// Consumer: read this slot of pool `pool`.
    Deliver {
        pool: usize,
        slot: u32,
        len: u64,
    },
    /// Consumer: read `iters` messages from the bytes channel.
    RecvBytes {
        iters: u32,
    },
    Quit,
}

#[derive(Debug, Serialize, Deserialize)]
enum Report {
    Hello { to_peer: IpcSender<Cmd> },
    Committed { pool: usize, slot: u32, len: u64 },
    Acked { pool: usize, slot: u32, sum: u64 },
    Done { secs: f64, samples_ns: Vec<u64> },
}

#[derive(Debug, Serialize, Deserialize)]
struct Setup {
    pools: Vec<(RawFd, PoolGeometry)>,
    futex: (RawFd, PoolGeometry),
    bytes_tx: Option<IpcBytesSender>,
    bytes_rx: Option<IpcBytesReceiver>,
}

/// Index of the small pool (after the three big ones).
const SMALL_POOL: usize = 3;

pub fn run(json: bool, quick: bool) -> Result<i32, Error> {
    let reps = if quick { 1 } else { 3 };
    let mut out: BTreeMap<String, f64> = BTreeMap::new();
    out.insert("memcpy_64mb_gbps".into(), memcpy_gbps(64 * MB, reps * 3));
    let shm = Shm::create()?;
    let relay = shm.start_peers()?;
    measure(&relay, quick, reps, &mut out)?;
    let _ = relay.producer.send(Cmd::Quit);
    let _ = relay.consumer.send(Cmd::Quit);
    add_ratios(&mut out);
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&out).map_err(|e| fail("json", &e))?
        );
    } else {
        print_text(&out, quick);
    }
    Ok(0)
}

/// The shared memory of the bench: the pools (three big ones, then the small one) and the
/// futex page, each with its fd.
struct Shm {
    pools: Vec<(std::os::fd::OwnedFd, PoolMap)>,
    futex: (std::os::fd::OwnedFd, PoolMap),
}

impl Shm {
    fn create() -> Result<Shm, Error> {
        let pools: Vec<(std::os::fd::OwnedFd, PoolMap)> = SIZES_MB
            .iter()
            .map(|&mb| PoolGeometry {
                name: format!("bench{mb}"),
                slots: 2,
                slot_bytes: mb * MB,
            })
            .chain(std::iter::once(PoolGeometry {
                name: "bench-small".into(),
                slots: 1,
                slot_bytes: SMALL,
            }))
            .map(PoolMap::create)
            .collect::<io::Result<_>>()
            .map_err(|e| fail("creating pools", &e))?;
        let futex = PoolMap::create(PoolGeometry {
            name: "bench-futex".into(),
            slots: 1,
            slot_bytes: 4096,
        })
        .map_err(|e| fail("creating the futex page", &e))?;
        Ok(Shm { pools, futex })
    }

    /// The two peers, started with these pools mapped and their ends of the bytes
    /// channel, behind the relay that plays the supervisor.
    fn start_peers(&self) -> Result<Relay, Error> {
        let fds: Vec<RawFd> = self
            .pools
            .iter()
            .map(|(fd, _)| fd.as_raw_fd())
            .chain([self.futex.0.as_raw_fd()])
            .collect();
        let geoms: Vec<(RawFd, PoolGeometry)> = self
            .pools
            .iter()
            .map(|(fd, m)| (fd.as_raw_fd(), m.geometry().clone()))
            .collect();
        let futex = (self.futex.0.as_raw_fd(), self.futex.1.geometry().clone());
        let (bytes_tx, bytes_rx) = ipc::bytes_channel().map_err(|e| fail("bytes channel", &e))?;

        let (tx, rx) = mpsc::channel::<(bool, Report)>();
        let producer =
            start_peer(&fds, true, tx.clone()).map_err(|e| fail("starting the producer", &e))?;
        let consumer =
            start_peer(&fds, false, tx).map_err(|e| fail("starting the consumer", &e))?;
        let setup = |bytes_tx, bytes_rx| {
            Cmd::Setup(Setup {
                pools: geoms.clone(),
                futex: futex.clone(),
                bytes_tx,
                bytes_rx,
            })
        };
        producer
            .send(setup(Some(bytes_tx), None))
            .map_err(|e| fail("setup", &e))?;
        consumer
            .send(setup(None, Some(bytes_rx)))
            .map_err(|e| fail("setup", &e))?;
        Ok(Relay {
            producer,
            consumer,
            rx,
        })
    }
}

/// The pool and ipc-channel throughput per batch size (the best of `reps`), then the
/// hand-off and bare futex latencies, into `out`.
fn measure(
    relay: &Relay,
    quick: bool,
    reps: u32,
    out: &mut BTreeMap<String, f64>,
) -> Result<(), Error> {
    for (i, &mb) in SIZES_MB.iter().enumerate() {
        let size = mb * MB;
        let iters = ((if quick { 64 } else { 2048 }) / mb).max(2) as u32;
        let gbps = |secs: f64| size as f64 * iters as f64 / secs / 1e9;
        let mut best = (0f64, 0f64);
        for _ in 0..reps {
            best.0 = best.0.max(gbps(relay.pool(i, size, iters)?));
            best.1 = best.1.max(gbps(relay.bytes(size, iters)?));
        }
        out.insert(format!("pool_{mb}mb_gbps"), best.0);
        out.insert(format!("ipc_channel_{mb}mb_gbps"), best.1);
    }
    let n = if quick { 200 } else { 3000 };
    let handoff = relay.handoff(n)?;
    let futex_rtt = relay.futex(n)?;
    out.insert("handoff_p50_us".into(), pct(&handoff, 50) / 2.0 / 1e3);
    out.insert("handoff_p99_us".into(), pct(&handoff, 99) / 2.0 / 1e3);
    out.insert("futex_rtt_p50_us".into(), pct(&futex_rtt, 50) / 1e3);
    out.insert("futex_rtt_p99_us".into(), pct(&futex_rtt, 99) / 1e3);
    Ok(())
}

/// The ratios the targets are about: pool against memcpy and ipc-channel, hand-off
/// against a bare futex round trip.
fn add_ratios(out: &mut BTreeMap<String, f64>) {
    let r = |a: &str, b: &str| out[a] / out[b];
    let ratios = [
        (
            "pool_vs_memcpy_64mb",
            r("pool_64mb_gbps", "memcpy_64mb_gbps"),
        ),
        (
            "pool_vs_ipc_channel_64mb",
            r("pool_64mb_gbps", "ipc_channel_64mb_gbps"),
        ),
        (
            "handoff_p50_vs_futex_rtt_p50",
            r("handoff_p50_us", "futex_rtt_p50_us"),
        ),
    ];
    for (k, v) in ratios {
        out.insert(k.into(), v);
    }
}

/// The results as text, each ratio with its target.
fn print_text(out: &BTreeMap<String, f64>, quick: bool) {
    println!(
        "bench ipc ({} CPUs{}):",
        thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        if quick { ", quick" } else { "" }
    );
    println!(
        "  memcpy 64 MiB, one core       {:>8.2} GB/s",
        out["memcpy_64mb_gbps"]
    );
    for mb in SIZES_MB {
        println!(
            "  {mb:>3} MiB batches: pool {:>7.2} GB/s   ipc-channel bytes {:>7.2} GB/s",
            out[&format!("pool_{mb}mb_gbps")],
            out[&format!("ipc_channel_{mb}mb_gbps")]
        );
    }
    println!(
        "  hand-off of a 4 KiB batch      p50 {:>7.1} us   p99 {:>7.1} us",
        out["handoff_p50_us"], out["handoff_p99_us"]
    );
    println!(
        "  bare futex round trip          p50 {:>7.1} us   p99 {:>7.1} us",
        out["futex_rtt_p50_us"], out["futex_rtt_p99_us"]
    );
    println!(
        "  pool / memcpy (64 MiB)         {:>7.2}   (target >= 0.8)",
        out["pool_vs_memcpy_64mb"]
    );
    println!(
        "  pool / ipc-channel (64 MiB)    {:>7.2}   (target >= 5)",
        out["pool_vs_ipc_channel_64mb"]
    );
    println!(
        "  hand-off p50 / futex RTT p50   {:>7.2}   (target <= 2)",
        out["handoff_p50_vs_futex_rtt_p50"]
    );
}

fn fail(what: &str, e: &dyn std::fmt::Display) -> Error {
    Error::Bench {
        bench: "ipc",
        what: what.to_string(),
        source: e.to_string().into(),
    }
}

fn pct(v: &[u64], p: usize) -> f64 {
    let mut v = v.to_vec();
    v.sort_unstable();
    if v.is_empty() {
        return 0.0;
    }
    v[(v.len() - 1) * p / 100] as f64
}

fn memcpy_gbps(size: u64, reps: u32) -> f64 {
    let src = vec![0x5Au8; size as usize];
    let mut dst = vec![0u8; size as usize];
    dst.copy_from_slice(&src);
    let mut best = f64::MAX;
    for _ in 0..reps {
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&dst);
        best = best.min(t.elapsed().as_secs_f64());
    }
    size as f64 / best / 1e9
}

/// Touch every byte at memory speed (four independent sums).
fn read_every_byte(data: &[u8]) -> u64 {
    let mut acc = [0u64; 4];
    let mut chunks = data.chunks_exact(32);
    for c in &mut chunks {
        for (k, a) in acc.iter_mut().enumerate() {
            *a = a.wrapping_add(u64::from_le_bytes(
                c[k * 8..k * 8 + 8].try_into().expect("8 bytes"),
            ));
        }
    }
    acc.iter().fold(
        chunks.remainder().iter().map(|&b| b as u64).sum(),
        |x, &a| x.wrapping_add(a),
    )
}

fn start_peer(
    fds: &[RawFd],
    producer: bool,
    events: mpsc::Sender<(bool, Report)>,
) -> io::Result<IpcSender<Cmd>> {
    let (server, name) = IpcOneShotServer::<Report>::new()?;
    let fds = fds.to_vec();
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.arg("__bench-peer").arg(&name).stdin(Stdio::null());
    // SAFETY: only fcntl between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            for &fd in &fds {
                dflash_shared::pool::inherit_fd(fd)?;
            }
            // Do not outlive the bench.
            libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            );
            Ok(())
        });
    }
    let mut child = cmd.spawn()?;
    let (rx, hello) = server.accept().map_err(io::Error::other)?;
    let Report::Hello { to_peer } = hello else {
        return Err(io::Error::other("the peer did not say hello"));
    };
    thread::spawn(move || {
        while let Ok(r) = rx.recv() {
            if events.send((producer, r)).is_err() {
                break;
            }
        }
        let _ = child.wait();
    });
    Ok(to_peer)
}

/// The bench's "supervisor": relays commits and acks between the two peers.
struct Relay {
    producer: IpcSender<Cmd>,
    consumer: IpcSender<Cmd>,
    rx: mpsc::Receiver<(bool, Report)>,
}

impl Relay {
    fn send(&self, to_producer: bool, cmd: Cmd) -> Result<(), Error> {
        let to = if to_producer {
            &self.producer
        } else {
            &self.consumer
        };
        to.send(cmd).map_err(|e| fail("sending to a peer", &e))
    }

    /// Relay until the producer reports done; returns its report.
    fn until_done(&self, consumer_done: bool) -> Result<(f64, Vec<u64>), Error> {
        let mut result = None;
        let mut consumer_left = consumer_done;
        loop {
            let (from_producer, r) = self
                .rx
                .recv_timeout(Duration::from_secs(120))
                .map_err(|e| fail("waiting for a peer", &e))?;
            match (from_producer, r) {
                (true, Report::Committed { pool, slot, len }) => {
                    self.send(false, Cmd::Deliver { pool, slot, len })?
                }
                (false, Report::Acked { slot, .. }) => self.send(true, Cmd::Free { slot })?,
                (true, Report::Done { secs, samples_ns }) => result = Some((secs, samples_ns)),
                (false, Report::Done { .. }) => consumer_left = false,
                (producer, other) => {
                    let kind = match other {
                        Report::Hello { .. } => "Hello",
                        Report::Committed { .. } => "Committed",
                        Report::Acked { .. } => "Acked",
                        Report::Done { .. } => "Done",
                    };
                    let from = if producer {
                        "the producer"
                    } else {
                        "the consumer"
                    };
                    return Err(fail("unexpected report", &format!("{kind} from {from}")));
                }
            }
            if !consumer_left {
                if let Some(r) = result.take() {
                    return Ok(r);
                }
            }
        }
    }

    fn pool(&self, pool: usize, size: u64, iters: u32) -> Result<f64, Error> {
        self.send(true, Cmd::Produce { pool, size, iters })?;
        Ok(self.until_done(false)?.0)
    }

    fn bytes(&self, size: u64, iters: u32) -> Result<f64, Error> {
        self.send(false, Cmd::RecvBytes { iters })?;
        self.send(true, Cmd::SendBytes { size, iters })?;
        Ok(self.until_done(true)?.0)
    }

    fn handoff(&self, iters: u32) -> Result<Vec<u64>, Error> {
        self.send(true, Cmd::Handoff { iters })?;
        Ok(self.until_done(false)?.1)
    }

    fn futex(&self, iters: u32) -> Result<Vec<u64>, Error> {
        self.send(
            false,
            Cmd::Futex {
                iters,
                leader: false,
            },
        )?;
        self.send(
            true,
            Cmd::Futex {
                iters,
                leader: true,
            },
        )?;
        Ok(self.until_done(true)?.1)
    }
}

fn futex_wait(word: &AtomicU32, expected: u32) {
    // SAFETY: FUTEX_WAIT on a valid, aligned u32 in shared memory (not PRIVATE: the other
    // side is another process).
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            std::ptr::null::<libc::timespec>(),
        );
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a valid, aligned u32 in shared memory.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, 1);
    }
}

/// Body of `dflash-supervise __bench-peer NAME`.
pub fn peer(server: &str) -> i32 {
    match peer_loop(server) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("bench peer: {e}");
            1
        }
    }
}

fn peer_loop(server: &str) -> io::Result<()> {
    let peer = BenchPeer::connect(server)?;
    loop {
        match peer.recv()? {
            Cmd::Quit => return Ok(()),
            Cmd::Produce { pool, size, iters } => peer.produce(pool, size, iters)?,
            Cmd::Deliver { pool, slot, len } => peer.consume(pool, slot, len)?,
            Cmd::SendBytes { size, iters } => peer.send_bytes(size, iters)?,
            Cmd::RecvBytes { iters } => peer.recv_bytes(iters)?,
            Cmd::Handoff { iters } => peer.handoff(iters)?,
            Cmd::Futex { iters, leader } => peer.futex(iters, leader)?,
            Cmd::Setup(_) | Cmd::Free { .. } => {}
        }
    }
}

/// The measuring process's end: the pools it maps and its channels to the relay.
struct BenchPeer {
    up: IpcSender<Report>,
    cmds: IpcReceiver<Cmd>,
    pools: Vec<PoolMap>,
    futex_map: PoolMap,
    bytes_tx: Option<IpcBytesSender>,
    bytes_rx: Option<IpcBytesReceiver>,
}

impl BenchPeer {
    /// Say hello to the relay and map what its setup names.
    fn connect(server: &str) -> io::Result<BenchPeer> {
        let up = IpcSender::<Report>::connect(server.to_string())?;
        let (to_peer, cmds): (IpcSender<Cmd>, IpcReceiver<Cmd>) = ipc::channel()?;
        up.send(Report::Hello { to_peer })
            .map_err(io::Error::other)?;
        let Cmd::Setup(setup) = cmds.recv().map_err(io::Error::other)? else {
            return Err(io::Error::other("expected setup first"));
        };
        let pools: Vec<PoolMap> = setup
            .pools
            .into_iter()
            .map(|(fd, g)| PoolMap::open(fd, g))
            .collect::<io::Result<_>>()?;
        let futex_map = PoolMap::open(setup.futex.0, setup.futex.1)?;
        Ok(BenchPeer {
            up,
            cmds,
            pools,
            futex_map,
            bytes_tx: setup.bytes_tx,
            bytes_rx: setup.bytes_rx,
        })
    }

    fn recv(&self) -> io::Result<Cmd> {
        self.cmds.recv().map_err(io::Error::other)
    }

    fn send(&self, r: Report) -> io::Result<()> {
        self.up.send(r).map_err(io::Error::other)
    }

    /// Wait for the relay to hand back one credit (a slot, or room for a message).
    fn freed(&self) -> io::Result<u32> {
        loop {
            if let Cmd::Free { slot } = self.recv()? {
                return Ok(slot);
            }
        }
    }

    /// Write `iters` batches of `size` bytes into two slots of `pool` in turn.
    fn produce(&self, pool: usize, size: u64, iters: u32) -> io::Result<()> {
        let src = vec![0xA5u8; size as usize];
        let mut free: Vec<u32> = vec![1, 0];
        let t = Instant::now();
        for _ in 0..iters {
            if free.is_empty() {
                free.push(self.freed()?);
            }
            let slot = free.pop().expect("a free slot");
            // SAFETY: the relay handed this slot back to us; the consumer is done with it.
            unsafe { self.pools[pool].payload_mut(slot)[..size as usize].copy_from_slice(&src) };
            self.send(Report::Committed {
                pool,
                slot,
                len: size,
            })?;
        }
        while free.len() < 2 {
            free.push(self.freed()?);
        }
        self.send(Report::Done {
            secs: t.elapsed().as_secs_f64(),
            samples_ns: vec![],
        })
    }

    /// Read every byte of a delivered slot, then ack it.
    fn consume(&self, pool: usize, slot: u32, len: u64) -> io::Result<()> {
        // SAFETY: delivered to us; the producer does not touch it until our ack.
        let sum = read_every_byte(unsafe { &self.pools[pool].payload(slot)[..len as usize] });
        self.send(Report::Acked { pool, slot, sum })
    }

    /// Send `iters` messages of `size` bytes through the ipc byte channel, two in flight.
    fn send_bytes(&self, size: u64, iters: u32) -> io::Result<()> {
        let tx = self
            .bytes_tx
            .as_ref()
            .ok_or_else(|| io::Error::other("no bytes sender"))?;
        let src = vec![0xA5u8; size as usize];
        let mut credits = 2;
        let t = Instant::now();
        for _ in 0..iters {
            if credits == 0 {
                self.freed()?;
                credits += 1;
            }
            tx.send(&src)?;
            credits -= 1;
        }
        while credits < 2 {
            self.freed()?;
            credits += 1;
        }
        self.send(Report::Done {
            secs: t.elapsed().as_secs_f64(),
            samples_ns: vec![],
        })
    }

    fn recv_bytes(&self, iters: u32) -> io::Result<()> {
        let rx = self
            .bytes_rx
            .as_ref()
            .ok_or_else(|| io::Error::other("no bytes receiver"))?;
        for _ in 0..iters {
            let v = rx.recv().map_err(io::Error::other)?;
            self.send(Report::Acked {
                pool: usize::MAX,
                slot: 0,
                sum: read_every_byte(&v),
            })?;
        }
        self.send(Report::Done {
            secs: 0.0,
            samples_ns: vec![],
        })
    }

    /// Round trips of one small slot: write, commit, wait for it back.
    fn handoff(&self, iters: u32) -> io::Result<()> {
        let mut samples = Vec::with_capacity(iters as usize);
        for i in 0..iters {
            let t = Instant::now();
            // SAFETY: slot 0 of the small pool is ours between Free and Committed.
            unsafe { self.pools[SMALL_POOL].payload_mut(0).fill(i as u8) };
            self.send(Report::Committed {
                pool: SMALL_POOL,
                slot: 0,
                len: SMALL,
            })?;
            self.freed()?;
            samples.push(t.elapsed().as_nanos() as u64);
        }
        self.send(Report::Done {
            secs: 0.0,
            samples_ns: samples,
        })
    }

    /// Futex ping-pong on a shared word: the floor of any cross-process hand-off.
    fn futex(&self, iters: u32, leader: bool) -> io::Result<()> {
        // SAFETY: the futex page's payload is shared by the two peers, accessed only
        // through this atomic.
        let word: &AtomicU32 =
            unsafe { &*(self.futex_map.payload_mut(0).as_mut_ptr() as *const AtomicU32) };
        let mut samples = Vec::with_capacity(iters as usize);
        for _ in 0..iters {
            if leader {
                let t = Instant::now();
                word.store(1, Ordering::Release);
                futex_wake(word);
                while word.load(Ordering::Acquire) != 2 {
                    futex_wait(word, 1);
                }
                samples.push(t.elapsed().as_nanos() as u64);
            } else {
                loop {
                    let v = word.load(Ordering::Acquire);
                    if v == 1 {
                        break;
                    }
                    futex_wait(word, v);
                }
                word.store(2, Ordering::Release);
                futex_wake(word);
            }
        }
        // The word is left at 2: resetting it here could race the leader's last look at
        // it and leave the leader waiting for a 2 that never comes back.
        self.send(Report::Done {
            secs: 0.0,
            samples_ns: samples,
        })
    }
}
