//! The control link between the leader and each follower: one TCP connection per follower,
//! length-prefixed JSON messages of at most [`MAX_FRAME`] bytes, mutual authentication by
//! the job's secret, and a beat both ways so that each side knows when the other is gone.
//!
//! The leader only ever reads what a peer sends within bounds: a frame larger than
//! [`MAX_FRAME`], bytes that are not a message, a wrong MAC, a handshake not finished
//! within [`HANDSHAKE`] (a slow peer trickling bytes), a rank out of range or already
//! taken: each is one log line and the connection is closed; nothing else changes.

use std::collections::BTreeMap;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dflash_shared::drafter::StepStats;
use serde::{Deserialize, Serialize};

use super::secret::{hex, random, Secret, SecretError};
use super::topology::Leader;

/// The largest message either side accepts.
pub const MAX_FRAME: u32 = 64 * 1024;
/// How long a new connection has to authenticate.
pub const HANDSHAKE: Duration = Duration::from_secs(5);
/// Connections being authenticated at once; more are closed at once.
const MAX_PENDING: usize = 32;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
pub enum Msg {
    /// Leader → a new connection: what the follower's MAC must cover.
    Challenge { nonce: String, nodes: u32 },
    /// Follower → leader.
    Join {
        rank: u32,
        nonce: String,
        mac: String,
        info: NodeInfo,
    },
    /// Leader → follower: accepted; `mac` covers the follower's nonce, so the leader too
    /// has proved it holds the secret.
    Welcome { mac: String },
    /// Leader → follower: not accepted, and why (then the connection closes).
    Refused { why: String },
    /// Either way, every beat interval: still here.
    Beat,
    /// Leader → follower: the job is over for this node (`ok`: as planned).
    Done { ok: bool },
    /// Leader → node: a new epoch of the job's group (`super::steps`): the nodes that
    /// report its steps, the job's ranks, and the step in flight.
    Epoch {
        epoch: u64,
        members: Vec<u32>,
        ranks: Vec<u32>,
        step: u64,
    },
    /// Leader → node: batches lent to it (`super::leases`).
    Lease { batches: Vec<u64> },
    /// Node → leader: its ranks reduced `step` in node epoch `epoch`, consuming `batches`
    /// with loss weights summing to `weight` (`super::steps`), and what they measured.
    Reduced {
        epoch: u64,
        step: u64,
        batches: Vec<u64>,
        weight: f64,
        #[serde(default)]
        stats: StepStats,
    },
    /// Leader → node: `step` is committed: apply it. `stats`: the job's (every node's
    /// merged), over `contributors` batches.
    Commit {
        step: u64,
        #[serde(default)]
        stats: StepStats,
        #[serde(default)]
        contributors: usize,
    },
    /// Leader → follower, once every node joined: the job starts at `step` (0, or the
    /// step of the leader's `checkpoint` it resumes).
    Start {
        step: u64,
        checkpoint: Option<String>,
    },
    /// Node → leader: its drafters are now these ranks (the job needs a new epoch).
    Ranks { ranks: Vec<u32> },
    /// Either way: the NCCL id of `epoch`, created by the job's first rank (hex).
    GroupId { epoch: u64, id: String },
    /// Node → leader: the data has `batches` batches (its loader read all of it).
    DataEnd { batches: u64 },
    /// Leader → node: no batch is left to lend it (its ranks contribute nothing until
    /// the job is done).
    NoMore,
    /// Node → leader: its metrics window (`crate::telemetry::window::Window`), for the
    /// job's one metrics stream.
    Metrics { window: serde_json::Value },
}

/// What a follower says of itself when it joins.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeInfo {
    pub host: String,
    pub version: String,
    /// The GPUs NVML lists on the node ("NVIDIA H100 80GB HBM3, 81559 MiB").
    pub gpus: Vec<String>,
    /// Why there are none, where NVML said (no driver).
    pub gpu_note: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("a frame of {0} bytes (at most {MAX_FRAME})")]
    TooLarge(u32),
    #[error("not a message: {0}")]
    Malformed(#[from] serde_json::Error),
    #[error("the connection closed")]
    Closed,
    #[error("no message within {0:?}")]
    Silent(Duration),
}

/// Bytes this process has sent and received on control links (frames, headers included).
pub static SENT: AtomicU64 = AtomicU64::new(0);
pub static RECEIVED: AtomicU64 = AtomicU64::new(0);

pub fn send(w: &mut impl Write, msg: &Msg) -> io::Result<()> {
    let body = serde_json::to_vec(msg).map_err(io::Error::other)?;
    let mut frame = (body.len() as u32).to_be_bytes().to_vec();
    frame.extend_from_slice(&body);
    w.write_all(&frame)?;
    SENT.fetch_add(frame.len() as u64, Ordering::Relaxed);
    w.flush()
}

/// The next message, all of it read by `deadline` (a per-read timeout alone would let a
/// peer trickle one byte at a time forever).
pub fn recv(s: &mut TcpStream, deadline: Instant) -> Result<Msg, LinkError> {
    let mut len = [0u8; 4];
    read_by(s, &mut len, deadline)?;
    let n = u32::from_be_bytes(len);
    if n > MAX_FRAME {
        return Err(LinkError::TooLarge(n));
    }
    let mut body = vec![0u8; n as usize];
    read_by(s, &mut body, deadline)?;
    RECEIVED.fetch_add(4 + u64::from(n), Ordering::Relaxed);
    Ok(serde_json::from_slice(&body)?)
}

fn read_by(s: &mut TcpStream, mut buf: &mut [u8], deadline: Instant) -> Result<(), LinkError> {
    while !buf.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(LinkError::Silent(Duration::ZERO));
        }
        s.set_read_timeout(Some(left))?;
        match s.read(buf) {
            Ok(0) => return Err(LinkError::Closed),
            Ok(k) => buf = &mut buf[k..],
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Err(LinkError::Silent(left))
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// What the leader's link reports.
#[derive(Debug)]
pub enum Event {
    Joined {
        rank: u32,
        info: NodeInfo,
        peer: Peer,
    },
    /// A joined follower's message (beats are not reported).
    Message { rank: u32, msg: Msg },
    /// A joined follower closed its link, or was silent for the node timeout.
    Lost { rank: u32, why: String },
}

/// The leader's end of one follower's link.
#[derive(Debug)]
pub struct Peer {
    pub addr: SocketAddr,
    stream: TcpStream,
}

impl Peer {
    pub fn send(&self, msg: &Msg) -> io::Result<()> {
        send(&mut &self.stream, msg)
    }

    /// Close the link (the reader reports it lost).
    pub fn close(&self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BindError {
    #[error("--leader {leader}: cannot resolve the host: {source}")]
    Resolve { leader: String, source: io::Error },
    #[error("cannot listen on {leader}: the port is taken (another leader, or another job's? expected a free port: --leader HOST:PORT)")]
    InUse { leader: String },
    #[error("cannot listen on {leader} ({addr}): {source} (expected an address of this host)")]
    Bind {
        leader: String,
        addr: SocketAddr,
        source: io::Error,
    },
}

/// The leader's listening socket, on the address its host name resolves to (never every
/// interface).
pub struct Listener {
    inner: TcpListener,
    pub addr: SocketAddr,
}

impl Listener {
    pub fn bind(leader: &Leader) -> Result<Listener, BindError> {
        let name = leader.to_string();
        let addrs: Vec<SocketAddr> = (leader.host.as_str(), leader.port)
            .to_socket_addrs()
            .map_err(|source| BindError::Resolve {
                leader: name.clone(),
                source,
            })?
            .collect();
        let mut last = None;
        for addr in addrs {
            match TcpListener::bind(addr) {
                Ok(inner) => return Ok(Listener { inner, addr }),
                Err(e) if e.kind() == io::ErrorKind::AddrInUse => {
                    return Err(BindError::InUse { leader: name })
                }
                Err(source) => {
                    last = Some(BindError::Bind {
                        leader: name.clone(),
                        addr,
                        source,
                    })
                }
            }
        }
        Err(last.unwrap_or(BindError::Resolve {
            leader: name,
            source: io::Error::new(io::ErrorKind::NotFound, "no address"),
        }))
    }

    /// Accept followers on a thread of its own until the receiver of `tx` goes: each is
    /// authenticated on a thread of its own, then reported as [`Event::Joined`], and its
    /// messages and its loss follow.
    pub fn serve(self, auth: Auth, tx: Sender<Event>) -> io::Result<()> {
        let auth = Arc::new(auth);
        let pending = Arc::new(AtomicUsize::new(0));
        std::thread::Builder::new()
            .name("cluster-accept".into())
            .spawn(move || {
                for conn in self.inner.incoming() {
                    let Ok(stream) = conn else {
                        // Out of file descriptors, say: wait rather than spin.
                        std::thread::sleep(Duration::from_millis(100));
                        continue;
                    };
                    let addr = stream
                        .peer_addr()
                        .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
                    if pending.fetch_add(1, Ordering::SeqCst) >= MAX_PENDING {
                        pending.fetch_sub(1, Ordering::SeqCst);
                        log::warn!("cluster: refused a connection from {addr}: {MAX_PENDING} others are still authenticating");
                        continue;
                    }
                    let (auth, tx, pending) = (auth.clone(), tx.clone(), pending.clone());
                    let spawned = std::thread::Builder::new()
                        .name("cluster-peer".into())
                        .spawn(move || {
                            let joined = auth.handshake(stream, addr);
                            pending.fetch_sub(1, Ordering::SeqCst);
                            match joined {
                                Ok((rank, info, peer, reader)) => {
                                    follow(rank, info, peer, reader, &auth, &tx)
                                }
                                Err(why) => log::warn!(
                                    "cluster: refused a connection from {addr}: {why}"
                                ),
                            }
                        });
                    if spawned.is_err() {
                        log::warn!("cluster: no thread for a connection from {addr}");
                    }
                }
            })
            .map(|_| ())
    }
}

/// What the leader checks a joining follower against, and which ranks are taken.
pub struct Auth {
    pub secret: Secret,
    pub nodes: u32,
    /// Silence after which a joined follower is lost.
    pub timeout: Duration,
    live: Mutex<BTreeMap<u32, SocketAddr>>,
}

impl Auth {
    pub fn new(secret: Secret, nodes: u32, timeout: Duration) -> Auth {
        Auth {
            secret,
            nodes,
            timeout,
            live: Mutex::new(BTreeMap::new()),
        }
    }

    fn handshake(
        &self,
        mut s: TcpStream,
        addr: SocketAddr,
    ) -> Result<(u32, NodeInfo, Peer, TcpStream), String> {
        let deadline = Instant::now() + HANDSHAKE;
        // Small frames, each awaited: Nagle's delay would add ~40 ms to every exchange.
        let _ = s.set_nodelay(true);
        // A frozen follower's full socket must not block the leader's sends for longer
        // than it takes to count it lost.
        let _ = s.set_write_timeout(Some(self.timeout));
        let nonce = hex(&random::<16>().map_err(|e| e.to_string())?);
        let refuse = |s: &mut TcpStream, why: String| {
            let _ = send(s, &Msg::Refused { why: why.clone() });
            why
        };
        send(
            &mut s,
            &Msg::Challenge {
                nonce: nonce.clone(),
                nodes: self.nodes,
            },
        )
        .map_err(|e| e.to_string())?;
        let (rank, theirs, mac, info) = match recv(&mut s, deadline) {
            Ok(Msg::Join {
                rank,
                nonce,
                mac,
                info,
            }) => (rank, nonce, mac, info),
            Ok(other) => return Err(format!("expected a join, got {}", kind(&other))),
            Err(LinkError::Silent(_)) => {
                return Err(format!("no join within {}s", HANDSHAKE.as_secs()))
            }
            Err(e) => return Err(e.to_string()),
        };
        let r = rank.to_le_bytes();
        if !self
            .secret
            .verify(&[b"join", nonce.as_bytes(), &r, theirs.as_bytes()], &mac)
        {
            return Err(refuse(
                &mut s,
                format!(
                    "node {rank}: wrong secret (not this job's {})",
                    super::secret::FILE
                ),
            ));
        }
        if rank == 0 || rank >= self.nodes {
            return Err(refuse(
                &mut s,
                format!(
                    "node {rank}: out of range (this job has nodes 1 to {} besides the leader)",
                    self.nodes - 1
                ),
            ));
        }
        {
            let mut live = self.live.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(other) = live.get(&rank) {
                return Err(refuse(
                    &mut s,
                    format!("node {rank}: already joined from {other}"),
                ));
            }
            live.insert(rank, addr);
        }
        let mac = self
            .secret
            .sign(&[b"welcome", theirs.as_bytes(), &r, nonce.as_bytes()]);
        let reader = s.try_clone().map_err(|e| e.to_string())?;
        if let Err(e) = send(&mut s, &Msg::Welcome { mac }) {
            self.left(rank);
            return Err(e.to_string());
        }
        Ok((rank, info, Peer { addr, stream: s }, reader))
    }

    fn left(&self, rank: u32) {
        let mut live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        live.remove(&rank);
    }
}

/// Report a joined follower, then its messages until it is gone.
fn follow(
    rank: u32,
    info: NodeInfo,
    peer: Peer,
    mut s: TcpStream,
    auth: &Auth,
    tx: &Sender<Event>,
) {
    let addr = peer.addr;
    if tx.send(Event::Joined { rank, info, peer }).is_err() {
        auth.left(rank);
        return;
    }
    let why = loop {
        match recv(&mut s, Instant::now() + auth.timeout) {
            Ok(Msg::Beat) => {}
            Ok(msg) => {
                if tx.send(Event::Message { rank, msg }).is_err() {
                    break "the leader is done".to_string();
                }
            }
            Err(LinkError::Silent(_)) => {
                break format!("silent for {}s", auth.timeout.as_secs_f64())
            }
            Err(LinkError::Closed) => break "its link closed".into(),
            Err(e) => break format!("{e}"),
        }
    };
    let _ = s.shutdown(Shutdown::Both);
    auth.left(rank);
    let _ = tx.send(Event::Lost {
        rank,
        why: format!("{why} ({addr})"),
    });
}

pub(crate) fn kind(m: &Msg) -> &'static str {
    match m {
        Msg::Challenge { .. } => "a challenge",
        Msg::Join { .. } => "a join",
        Msg::Welcome { .. } => "a welcome",
        Msg::Refused { .. } => "a refusal",
        Msg::Beat => "a beat",
        Msg::Done { .. } => "done",
        Msg::Epoch { .. } => "an epoch",
        Msg::Lease { .. } => "a lease",
        Msg::Reduced { .. } => "a report",
        Msg::Commit { .. } => "a commit",
        Msg::Start { .. } => "a start",
        Msg::Ranks { .. } => "ranks",
        Msg::GroupId { .. } => "an NCCL id",
        Msg::DataEnd { .. } => "the data's end",
        Msg::NoMore => "no more batches",
        Msg::Metrics { .. } => "a metrics window",
    }
}

#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    #[error("the leader at {leader} refused node {rank}: {why}")]
    Refused {
        leader: String,
        rank: u32,
        why: String,
    },
    #[error("could not join the leader at {leader} within {}s: {last}", waited.as_secs())]
    Timeout {
        leader: String,
        waited: Duration,
        last: String,
    },
}

/// The follower's end of its link, once joined.
pub struct Session {
    pub stream: TcpStream,
}

/// Join the leader as node `rank`, trying again until `deadline` while the leader is not
/// up yet or the secret in `dir` is not (yet) this session's.
pub fn join(
    leader: &Leader,
    dir: &Path,
    rank: u32,
    info: &NodeInfo,
    deadline: Instant,
) -> Result<Session, JoinError> {
    let started = Instant::now();
    loop {
        let last = match attempt(leader, dir, rank, info) {
            Ok(s) => return Ok(s),
            Err(Attempt::Final(why)) => {
                return Err(JoinError::Refused {
                    leader: leader.to_string(),
                    rank,
                    why,
                })
            }
            Err(Attempt::Again(why)) => why,
        };
        if Instant::now() >= deadline {
            return Err(JoinError::Timeout {
                leader: leader.to_string(),
                waited: started.elapsed(),
                last,
            });
        }
        std::thread::sleep(Duration::from_millis(300));
    }
}

enum Attempt {
    Again(String),
    Final(String),
}

fn attempt(leader: &Leader, dir: &Path, rank: u32, info: &NodeInfo) -> Result<Session, Attempt> {
    let again = |e: &dyn std::fmt::Display| Attempt::Again(e.to_string());
    let secret = Secret::read(dir).map_err(|e| match e {
        SecretError::Io { .. } => Attempt::Again(format!(
            "{e} (is the run directory on a filesystem every node shares?)"
        )),
        other => Attempt::Final(other.to_string()),
    })?;
    let addr = (leader.host.as_str(), leader.port)
        .to_socket_addrs()
        .map_err(|e| again(&e))?
        .next()
        .ok_or_else(|| Attempt::Again("the host resolves to no address".into()))?;
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).map_err(|e| again(&e))?;
    let _ = s.set_nodelay(true);
    let deadline = Instant::now() + HANDSHAKE;
    let Msg::Challenge { nonce, .. } = recv(&mut s, deadline).map_err(|e| again(&e))? else {
        return Err(Attempt::Final("it did not send a challenge".into()));
    };
    let mine = hex(&random::<16>().map_err(|e| again(&e))?);
    let r = rank.to_le_bytes();
    let mac = secret.sign(&[b"join", nonce.as_bytes(), &r, mine.as_bytes()]);
    send(
        &mut s,
        &Msg::Join {
            rank,
            nonce: mine.clone(),
            mac,
            info: info.clone(),
        },
    )
    .map_err(|e| again(&e))?;
    match recv(&mut s, deadline).map_err(|e| again(&e))? {
        Msg::Welcome { mac } => {
            if !secret.verify(&[b"welcome", mine.as_bytes(), &r, nonce.as_bytes()], &mac) {
                return Err(Attempt::Final(
                    "its welcome is not signed with this job's secret (another job's leader on this address?)".into(),
                ));
            }
            Ok(Session { stream: s })
        }
        // The secret in the run dir may be a session older than the leader's: read again.
        Msg::Refused { why } if why.contains("wrong secret") => Err(Attempt::Again(why)),
        Msg::Refused { why } => Err(Attempt::Final(why)),
        other => Err(Attempt::Final(format!("it answered with {}", kind(&other)))),
    }
}

/// What a follower's link reports.
#[derive(Debug)]
pub enum FromLeader {
    Msg(Msg),
    /// The leader closed the link or was silent for the node timeout.
    Lost(String),
}

/// A follower's way to send on its link: shared with its beat thread, so that frames
/// never interleave.
#[derive(Clone)]
pub struct Writer(Arc<Mutex<TcpStream>>);

impl Writer {
    pub fn send(&self, msg: &Msg) -> io::Result<()> {
        let mut s = self.0.lock().unwrap_or_else(|p| p.into_inner());
        send(&mut *s, msg)
    }
}

impl Session {
    /// Beat every `beat` on one thread; on another report the leader's messages, and its
    /// loss after `timeout` of silence (or a closed link), into `tx`. Returns the writer.
    pub fn serve(
        self,
        beat: Duration,
        timeout: Duration,
        tx: Sender<FromLeader>,
    ) -> io::Result<Writer> {
        let writer = Writer(Arc::new(Mutex::new(self.stream.try_clone()?)));
        let beats = writer.clone();
        std::thread::Builder::new()
            .name("cluster-beat".into())
            .spawn(move || {
                while beats.send(&Msg::Beat).is_ok() {
                    std::thread::sleep(beat);
                }
            })?;
        let mut s = self.stream;
        std::thread::Builder::new()
            .name("cluster-leader".into())
            .spawn(move || loop {
                let lost = |why: String| FromLeader::Lost(why);
                let event = match recv(&mut s, Instant::now() + timeout) {
                    Ok(Msg::Beat) => continue,
                    Ok(msg) => FromLeader::Msg(msg),
                    Err(LinkError::Silent(_)) => {
                        lost(format!("silent for {}s", timeout.as_secs_f64()))
                    }
                    Err(LinkError::Closed) => lost("its link closed".into()),
                    Err(e) => lost(e.to_string()),
                };
                let end = matches!(event, FromLeader::Lost(_));
                if tx.send(event).is_err() || end {
                    let _ = s.shutdown(Shutdown::Both);
                    return;
                }
            })?;
        Ok(writer)
    }
}
