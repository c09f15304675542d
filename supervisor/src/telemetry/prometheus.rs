//! `--prometheus ADDR`: the latest metrics window in Prometheus text exposition format at
//! `http://ADDR/metrics`, with counters the dispatcher updates at every step (committed
//! steps, trained tokens) and `dflash_build_info`. A bare port binds loopback only; give an
//! address (0.0.0.0:21400) to listen elsewhere. A minimal HTTP/1.1 responder: one short
//! request (GET, or HEAD for the headers alone), one response, close.
//!
//! One thread serves every connection without blocking on any: it polls the listener and
//! the open connections together, so a client that connects and says nothing holds no
//! scrape up. A connection has [`HEAD_TIMEOUT`] to send its request (then it is answered
//! 408 and closed) and [`REPLY_TIMEOUT`] to take the response; at most
//! [`MAX_CONNECTIONS`] are open at once, and a new one beyond them closes the oldest.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::error::Error;
use crate::telemetry::window::{Eval, Pipeline, Pool, Window};

/// Connections open at once; a new one beyond them closes the oldest (it has had the
/// longest to send its request).
pub const MAX_CONNECTIONS: usize = 128;
/// A connection's time, from its accept, to send its whole request head.
pub const HEAD_TIMEOUT: Duration = Duration::from_secs(2);
/// A response's time to be taken by its client.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest request head read; what came by then is answered.
const MAX_HEAD: usize = 8192;

#[derive(Clone)]
pub struct Exporter {
    text: Arc<Mutex<String>>,
    counters: Arc<Counters>,
    /// The run's name, for `dflash_build_info`'s `run` label.
    run: Arc<Mutex<String>>,
    pub addr: SocketAddr,
}

/// What the dispatcher counts as the run goes, between metrics windows.
#[derive(Default)]
struct Counters {
    /// Optimizer steps committed, retrained ones after a rollback included (monotonic).
    steps: AtomicU64,
    /// The step last seen, to count the next ones.
    last_step: AtomicU64,
    /// Tokens the drafters trained on.
    tokens: AtomicU64,
    /// Tokens each worker processed (from each window's rate × its length: monotonic).
    by_worker: Mutex<std::collections::BTreeMap<String, f64>>,
    /// The learning rate of the last committed step.
    lr: Mutex<Option<f64>>,
}

/// `--prometheus` given neither a port nor an address with a port.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("'{given}' is not a port or an address with a port (expected e.g. 21400 or 0.0.0.0:21400)")]
pub struct AddrError {
    pub given: String,
}

/// `21400` or `:21400` → 127.0.0.1:21400; anything else must be an address with a port.
pub fn parse_addr(s: &str) -> Result<SocketAddr, AddrError> {
    let t = s.trim().trim_start_matches(':');
    if let Ok(port) = t.parse::<u16>() {
        return Ok(SocketAddr::from(([127, 0, 0, 1], port)));
    }
    s.trim().parse().map_err(|_| AddrError {
        given: s.to_string(),
    })
}

/// One open connection: its request head as far as it came, then its response.
struct Conn {
    s: TcpStream,
    opened: Instant,
    /// When the head (then the response) must be done by.
    deadline: Instant,
    head: Vec<u8>,
    /// The response and the bytes of it sent; `None` while the head is read.
    reply: Option<(Vec<u8>, usize)>,
}

impl Conn {
    /// Read what the client sent, then write what it can take, without blocking; false
    /// once the connection is done with (answered, gone, or out of time).
    fn step(&mut self, page: &Exporter, now: Instant) -> bool {
        if self.reply.is_none() {
            let ended = self.read_head();
            let complete = head_complete(&self.head);
            if ended || complete || self.head.len() >= MAX_HEAD {
                self.reply = Some((page.answer(&String::from_utf8_lossy(&self.head)), 0));
            } else if now >= self.deadline {
                self.reply = Some((
                    response(
                        "408 Request Timeout",
                        "the request head did not come in time\n",
                        false,
                    ),
                    0,
                ));
            } else {
                return true;
            }
            self.deadline = now + REPLY_TIMEOUT;
        }
        let Some((out, sent)) = &mut self.reply else {
            return true;
        };
        while *sent < out.len() {
            match self.s.write(&out[*sent..]) {
                Ok(0) => return false,
                Ok(n) => *sent += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return now < self.deadline,
                Err(_) => return false,
            }
        }
        false
    }

    /// Read what has come of the head; true when the client closed its side or failed.
    fn read_head(&mut self) -> bool {
        let mut chunk = [0u8; 1024];
        while self.head.len() < MAX_HEAD && !head_complete(&self.head) {
            match self.s.read(&mut chunk) {
                Ok(0) => return true,
                Ok(n) => self.head.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
                Err(_) => return true,
            }
        }
        false
    }
}

/// A head ends at an empty line (CRLF, or a bare LF from a lenient client).
fn head_complete(head: &[u8]) -> bool {
    head.windows(4).any(|w| w == b"\r\n\r\n") || head.windows(2).any(|w| w == b"\n\n")
}

/// The connections' and the listener's poll entries: the listener first.
fn poll_set(listener: &TcpListener, conns: &[Conn]) -> Vec<libc::pollfd> {
    let entry = |fd, events| libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    let mut fds = Vec::with_capacity(conns.len() + 1);
    fds.push(entry(listener.as_raw_fd(), libc::POLLIN));
    for c in conns {
        let events = if c.reply.is_some() {
            libc::POLLOUT
        } else {
            libc::POLLIN
        };
        fds.push(entry(c.s.as_raw_fd(), events));
    }
    fds
}

/// Wait until a connection or the listener is ready, or the nearest deadline; the entries
/// with their `revents`.
fn wait(listener: &TcpListener, conns: &[Conn]) -> Vec<libc::pollfd> {
    let mut fds = poll_set(listener, conns);
    let now = Instant::now();
    let timeout = conns
        .iter()
        .map(|c| c.deadline.saturating_duration_since(now))
        .min()
        .map_or(-1, |d| d.as_millis().min(i32::MAX as u128 - 1) as i32 + 1);
    // SAFETY: `fds` is a live array of `fds.len()` pollfd entries.
    let r = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
    if r < 0 {
        fds.iter_mut().for_each(|f| f.revents = 0);
    }
    fds
}

/// Take the connections waiting on `listener` (non-blocking), closing the oldest open one
/// for each beyond [`MAX_CONNECTIONS`].
fn accept(listener: &TcpListener, conns: &mut Vec<Conn>) {
    loop {
        match listener.accept() {
            Ok((s, _)) => {
                if s.set_nonblocking(true).is_err() {
                    continue;
                }
                if conns.len() >= MAX_CONNECTIONS {
                    let oldest = (0..conns.len()).min_by_key(|&i| conns[i].opened);
                    if let Some(i) = oldest {
                        conns.swap_remove(i);
                    }
                }
                let now = Instant::now();
                conns.push(Conn {
                    s,
                    opened: now,
                    deadline: now + HEAD_TIMEOUT,
                    head: Vec::new(),
                    reply: None,
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
            Err(e) => {
                // Out of file descriptors, say: free one, or wait a moment rather than
                // spin on a listener that stays ready.
                log::debug!("Prometheus endpoint: accept failed: {e}");
                let oldest = (0..conns.len()).min_by_key(|&i| conns[i].opened);
                match oldest {
                    Some(i) => drop(conns.swap_remove(i)),
                    None => std::thread::sleep(Duration::from_millis(50)),
                }
                return;
            }
        }
    }
}

/// The endpoint's one thread: every connection, none blocking another.
fn serve(listener: TcpListener, page: Exporter) {
    let mut conns: Vec<Conn> = Vec::new();
    loop {
        let fds = wait(&listener, &conns);
        let now = Instant::now();
        let mut i = 0;
        conns.retain_mut(|c| {
            let ready = fds[i + 1].revents != 0;
            i += 1;
            !(ready || now >= c.deadline) || c.step(&page, now)
        });
        if fds[0].revents != 0 {
            accept(&listener, &mut conns);
        }
    }
}

impl Exporter {
    pub fn start(addr: SocketAddr) -> Result<Exporter, Error> {
        let listener = TcpListener::bind(addr)
            .map_err(|e| Error::input(format!("--prometheus {addr}: cannot listen"), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::start("the Prometheus listener", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::start("the Prometheus listener", e))?;
        let e = Exporter {
            text: Arc::new(Mutex::new(String::new())),
            counters: Arc::default(),
            run: Arc::default(),
            addr,
        };
        let page = e.clone();
        std::thread::Builder::new()
            .name("prometheus".into())
            .spawn(move || serve(listener, page))
            .map_err(|e| Error::start("Prometheus thread", e))?;
        Ok(e)
    }

    /// The run's name, for the `run` label of `dflash_build_info`.
    pub fn set_run(&self, name: &str) {
        if let Ok(mut r) = self.run.lock() {
            *r = name.to_string();
        }
    }

    pub fn update(&self, window: &Window) {
        if let Ok(mut t) = self.text.lock() {
            *t = render(window);
        }
        if let Ok(mut by) = self.counters.by_worker.lock() {
            for (w, rate) in &window.pipeline.tokens_per_s_by_worker {
                *by.entry(w.clone()).or_default() += rate * window.window_s;
            }
        }
    }

    /// The learning rate of the last committed step.
    pub fn set_lr(&self, lr: f64) {
        if let Ok(mut l) = self.counters.lr.lock() {
            *l = Some(lr);
        }
    }

    /// The run at `step` with `tokens` trained so far: counts the steps committed since
    /// the last call (none when a rollback took the step back: the steps trained again
    /// count as they are committed again).
    pub fn progress(&self, step: u64, tokens: u64) {
        let c = &self.counters;
        let last = c.last_step.swap(step, Ordering::SeqCst);
        c.steps
            .fetch_add(step.saturating_sub(last), Ordering::SeqCst);
        c.tokens.fetch_max(tokens, Ordering::SeqCst);
    }

    /// The page: the latest window's families, the counters and the build info.
    fn page(&self) -> String {
        let mut o = Out(self.text.lock().map(|t| t.clone()).unwrap_or_default());
        if o.0.is_empty() {
            o.family("dflash_up", "gauge", "1 while the supervisor runs.");
            o.sample("dflash_up", &[], Some(1.0));
        }
        let run = self.run.lock().map(|r| r.clone()).unwrap_or_default();
        o.family(
            "dflash_build_info",
            "gauge",
            "1, labelled with this dflash-supervise's version and the run's name.",
        );
        o.sample(
            "dflash_build_info",
            &[("version", env!("CARGO_PKG_VERSION")), ("run", &run)],
            Some(1.0),
        );
        o.family(
            "dflash_train_steps_total",
            "counter",
            "Optimizer steps committed, steps trained again after a rollback included.",
        );
        let steps = self.counters.steps.load(Ordering::SeqCst);
        o.sample("dflash_train_steps_total", &[], Some(steps as f64));
        o.family(
            "dflash_tokens_trained_total",
            "counter",
            "Tokens the drafters trained on.",
        );
        let tokens = self.counters.tokens.load(Ordering::SeqCst);
        o.sample("dflash_tokens_trained_total", &[], Some(tokens as f64));
        o.family(
            "dflash_worker_tokens_total",
            "counter",
            "Tokens each worker processed (a target captured, a drafter trained on): rate() of it is the worker's throughput.",
        );
        if let Ok(by) = self.counters.by_worker.lock() {
            for (w, n) in by.iter() {
                o.sample(
                    "dflash_worker_tokens_total",
                    &[("worker", w)],
                    Some(n.round()),
                );
            }
        }
        o.family(
            "dflash_learning_rate",
            "gauge",
            "The learning rate of the last committed step.",
        );
        o.sample(
            "dflash_learning_rate",
            &[],
            self.counters.lr.lock().ok().and_then(|l| *l),
        );
        with_run_label(&o.0, &run)
    }

    /// The response to a request head: GET (or HEAD) /metrics, else 404 or 405.
    fn answer(&self, req: &str) -> Vec<u8> {
        let mut words = req.split_whitespace();
        let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
        let head = method == "HEAD";
        if method != "GET" && !head {
            return response("405 Method Not Allowed", "only GET and HEAD\n", false);
        }
        if path == "/metrics" || path.starts_with("/metrics?") {
            response("200 OK", &self.page(), head)
        } else {
            response(
                "404 Not Found",
                "not found: the metrics are at /metrics\n",
                head,
            )
        }
    }
}

/// One response, the connection closed after it; a HEAD's has the headers alone.
fn response(status: &str, body: &str, head: bool) -> Vec<u8> {
    format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}",
        body.len(),
        if head { "" } else { body }
    )
    .into_bytes()
}

/// Every sample of `text` labelled `run="RUN"` (the run's name), so that several runs
/// scraped into one Prometheus stay apart without relabelling.
fn with_run_label(text: &str, run: &str) -> String {
    if run.is_empty() {
        return text.to_string();
    }
    let label = format!("run=\"{}\"", run.replace('\\', "\\\\").replace('"', "\\\""));
    let mut out = String::with_capacity(text.len() + text.len() / 4);
    for line in text.lines() {
        if line.starts_with('#') || line.is_empty() {
            out.push_str(line);
        } else if let Some((name, rest)) = line.split_once('{') {
            if rest.contains("run=\"") {
                out.push_str(line);
            } else {
                out.push_str(&format!("{name}{{{label},{rest}"));
            }
        } else if let Some((name, value)) = line.split_once(' ') {
            out.push_str(&format!("{name}{{{label}}} {value}"));
        } else {
            out.push_str(line);
        }
        out.push('\n');
    }
    out
}

struct Out(String);

impl Out {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        self.0
            .push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
    }
    fn sample(&mut self, name: &str, labels: &[(&str, &str)], v: Option<f64>) {
        let Some(v) = v.filter(|v| v.is_finite()) else {
            return;
        };
        let l = labels
            .iter()
            .map(|(k, v)| format!("{k}=\"{}\"", v.replace('\\', "\\\\").replace('"', "\\\"")))
            .collect::<Vec<_>>()
            .join(",");
        if l.is_empty() {
            self.0.push_str(&format!("{name} {v}\n"));
        } else {
            self.0.push_str(&format!("{name}{{{l}}} {v}\n"));
        }
    }
}

/// A metrics window as Prometheus text.
pub fn render(w: &Window) -> String {
    let mut o = Out(String::new());
    o.family("dflash_up", "gauge", "1 while the supervisor runs.");
    o.sample("dflash_up", &[], Some(1.0));
    gpu_families(&mut o, w);
    pipeline_families(&mut o, &w.pipeline);
    progress_families(&mut o, w);
    if let Some(e) = &w.eval {
        eval_families(&mut o, e);
    }
    if let Some(t) = &w.tau {
        tau_families(&mut o, t);
    }
    o.0
}

/// Each GPU's utilisation, memory, power, energy, temperature and clocks; in a job across
/// nodes, every node's (the leader's window holds the others'), labelled with its node.
fn gpu_families(o: &mut Out, w: &Window) {
    let windows: Vec<(Option<u32>, &Window)> = std::iter::once((w.node, w))
        .chain(w.nodes.iter().map(|(n, x)| (Some(*n), x)))
        .collect();
    for m in &crate::telemetry::nvml::GPU_METRICS {
        let Some(p) = m.prom else { continue };
        o.family(p.name, p.kind, p.help);
        for (node, x) in &windows {
            let node = node.map(|n| n.to_string());
            for g in &x.gpu.gpus {
                let idx = g.index.to_string();
                let v = g.stat(m.key, m.agg).map(|v| v * p.scale);
                match &node {
                    Some(n) => o.sample(p.name, &[("node", n), ("gpu", &idx)], v),
                    None => o.sample(p.name, &[("gpu", &idx)], v),
                }
            }
        }
    }
}

/// The pipeline (the window's `pipeline`): the pools, each worker's throughput and device
/// memory, the padding efficiency.
fn pipeline_families(o: &mut Out, p: &Pipeline) {
    type Share = fn(&Pool) -> f64;
    let shares: [(Share, &str, &str); 3] = [
        (
            |p| p.fill_ratio,
            "dflash_pool_fill_ratio",
            "Share of slots holding a ready batch (time-weighted).",
        ),
        (
            |p| p.producers_blocked_share,
            "dflash_pool_producers_blocked_ratio",
            "Share of time a producer waited for a free slot.",
        ),
        (
            |p| p.consumers_starved_share,
            "dflash_pool_consumers_starved_ratio",
            "Share of time a consumer waited for a batch.",
        ),
    ];
    for (share, name, help) in shares {
        o.family(name, "gauge", help);
        for (pool, v) in [("tokens", &p.tokens_pool), ("hidden", &p.hidden_pool)] {
            o.sample(name, &[("pool", pool)], Some(share(v)));
        }
    }
    o.family(
        "dflash_worker_tokens_per_second",
        "gauge",
        "Tokens each worker processed per second over the window.",
    );
    for (wk, v) in &p.tokens_per_s_by_worker {
        o.sample(
            "dflash_worker_tokens_per_second",
            &[("worker", wk)],
            Some(*v),
        );
    }
    o.family("dflash_cuda_memory_bytes", "gauge", "Device memory of each GPU worker: its arena (reserved, in_use, peak) and the device's free and total.");
    for (wk, m) in &p.cuda_memory_by_worker {
        for (kind, v) in [
            ("reserved", m.reserved),
            ("in_use", m.in_use),
            ("peak", m.peak),
            ("free", m.free),
            ("total", m.total),
        ] {
            o.sample(
                "dflash_cuda_memory_bytes",
                &[("worker", wk), ("kind", kind)],
                Some(v as f64),
            );
        }
    }
    o.family(
        "dflash_cuda_alloc_failures_total",
        "counter",
        "Arena requests of each GPU worker that could not be served.",
    );
    for (wk, m) in &p.cuda_memory_by_worker {
        o.sample(
            "dflash_cuda_alloc_failures_total",
            &[("worker", wk)],
            Some(m.alloc_failures as f64),
        );
    }
    o.family(
        "dflash_padding_efficiency_ratio",
        "gauge",
        "Real tokens over padded tokens of the window's batches.",
    );
    o.sample("dflash_padding_efficiency_ratio", &[], p.padding_efficiency);
}

/// The run's progress: worker restarts, batches, steps, the last step's loss and
/// acceptance.
fn progress_families(o: &mut Out, w: &Window) {
    o.family(
        "dflash_worker_restarts_total",
        "counter",
        "Restarts of each worker in this run.",
    );
    for (wk, v) in &w.workers {
        o.sample(
            "dflash_worker_restarts_total",
            &[("worker", wk)],
            Some(v.restarts as f64),
        );
    }
    o.family(
        "dflash_workers",
        "gauge",
        "Workers of each role (with --targets auto, those the balancer has there now).",
    );
    for (role, n) in &w.roles {
        o.sample("dflash_workers", &[("role", role)], Some(*n as f64));
    }
    o.family(
        "dflash_role_moves_total",
        "counter",
        "Devices moved between the target and drafter roles (--targets auto) in this session.",
    );
    o.sample("dflash_role_moves_total", &[], Some(w.role_moves as f64));
    o.family(
        "dflash_batches_produced_total",
        "counter",
        "Batches the loader put in the pipeline.",
    );
    let batches = &w.batches;
    o.sample(
        "dflash_batches_produced_total",
        &[],
        Some(batches.produced as f64),
    );
    o.family(
        "dflash_batches_consumed_total",
        "counter",
        "Batches that reached the optimizer.",
    );
    o.sample(
        "dflash_batches_consumed_total",
        &[],
        Some(batches.consumed as f64),
    );
    o.family(
        "dflash_train_step",
        "gauge",
        "The run's current optimizer step (a rollback takes it back).",
    );
    o.sample("dflash_train_step", &[], w.train.map(|t| t.step as f64));
    o.family(
        "dflash_train_loss",
        "gauge",
        "Loss of the last committed step.",
    );
    o.sample("dflash_train_loss", &[], w.train.and_then(|t| t.loss));
    o.family(
        "dflash_train_acceptance_length",
        "gauge",
        "Acceptance-length proxy of the last committed step.",
    );
    let acceptance = w.train.and_then(|t| t.acceptance);
    o.sample("dflash_train_acceptance_length", &[], acceptance);
}

/// The last held-out eval (the window's `eval`).
fn eval_families(o: &mut Out, e: &Eval) {
    o.family(
        "dflash_eval_step",
        "gauge",
        "Step whose weights the last held-out eval (--eval-data) scored.",
    );
    o.sample("dflash_eval_step", &[], Some(e.step as f64));
    o.family(
        "dflash_eval_loss",
        "gauge",
        "Loss over the whole held-out eval set, at the last eval.",
    );
    o.sample("dflash_eval_loss", &[], e.loss);
    o.family(
        "dflash_eval_acceptance_length",
        "gauge",
        "Acceptance-length estimate over the whole held-out eval set, at the last eval.",
    );
    o.sample("dflash_eval_acceptance_length", &[], e.acceptance);
    o.family(
        "dflash_eval_best_step",
        "gauge",
        "Step checkpoints/best names (the best tau with --eval-prompts, else the best eval acceptance).",
    );
    o.sample("dflash_eval_best_step", &[], e.best_step.map(|s| s as f64));
}

/// The last real τ measurement (`--eval-prompts`): both definitions with their 95%
/// intervals, labelled by definition.
fn tau_families(o: &mut Out, t: &Value) {
    o.family(
        "dflash_tau_step",
        "gauge",
        "Step whose checkpoint the last tau measurement (--eval-prompts) decoded with.",
    );
    o.sample("dflash_tau_step", &[], t["step"].as_f64());
    o.family(
        "dflash_tau",
        "gauge",
        "Real acceptance length tau (tokens per target verify step) at the last measurement: pooled (all tokens / all steps, what serving engines print) or mean_of_means (mean over prompts).",
    );
    for def in ["pooled", "mean_of_means"] {
        o.sample("dflash_tau", &[("definition", def)], t[def].as_f64());
    }
    o.family(
        "dflash_tau_ci95",
        "gauge",
        "Bounds of the 95% bootstrap interval over prompts of tau, by definition.",
    );
    for def in ["pooled", "mean_of_means"] {
        let ci = &t[format!("{def}_ci95")];
        for (bound, i) in [("low", 0), ("high", 1)] {
            o.sample(
                "dflash_tau_ci95",
                &[("definition", def), ("bound", bound)],
                ci[i].as_f64(),
            );
        }
    }
    o.family(
        "dflash_tau_best_step",
        "gauge",
        "Step of the best pooled tau so far (checkpoints/best).",
    );
    o.sample("dflash_tau_best_step", &[], t["best_step"].as_f64());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn window(v: Value) -> Window {
        serde_json::from_value(v).unwrap()
    }

    /// A GET of /metrics on a new connection: the response and how long it took.
    fn scrape(addr: SocketAddr) -> (String, Duration) {
        let t0 = Instant::now();
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        (out, t0.elapsed())
    }

    /// What a connection got until the server closed it (within `within`).
    fn until_closed(mut s: TcpStream, within: Duration) -> String {
        s.set_read_timeout(Some(within)).unwrap();
        let mut out = Vec::new();
        match s.read_to_end(&mut out) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
            Err(e) => panic!("not closed within {within:?}: {e}"),
        }
        String::from_utf8_lossy(&out).into_owned()
    }

    /// A job's leader: its own GPUs and each other node's, labelled with the node; a run of
    /// one node keeps its labels as they were.
    #[test]
    fn a_jobs_leader_shows_every_nodes_gpus_labelled_with_the_node() {
        use serde_json::json;
        let gpus = |util: f64| json!({"samples": 1, "gpus": [{"index": 0, "util_gpu_pct": {"mean": util, "max": util, "samples": 1}}]});
        let one = render(&window(json!({ "gpu": gpus(10.0) })));
        assert!(
            one.contains("dflash_gpu_utilization_ratio{gpu=\"0\"} 0.1"),
            "{one}"
        );
        let job = window(json!({
            "node": 0,
            "gpu": gpus(10.0),
            "nodes": {"1": {"node": 1, "gpu": gpus(30.0)}},
        }));
        let page = render(&job);
        assert!(
            page.contains("dflash_gpu_utilization_ratio{node=\"0\",gpu=\"0\"} 0.1"),
            "{page}"
        );
        assert!(
            page.contains("dflash_gpu_utilization_ratio{node=\"1\",gpu=\"0\"} 0.3"),
            "{page}"
        );
        // As metrics.jsonl holds it: the nodes' windows read back alike.
        let line = serde_json::to_string(&job).unwrap();
        assert_eq!(window(serde_json::from_str(&line).unwrap()), job);
    }

    /// A hundred clients that connect and say nothing hold no scrape up (served one after
    /// another, each would for a while); each is answered 408 and closed once its time to
    /// send a request is over.
    #[test]
    fn idle_connections_hold_no_scrape_up_and_are_closed_in_time() {
        let e = Exporter::start(parse_addr("127.0.0.1:0").unwrap()).unwrap();
        let idle: Vec<TcpStream> = (0..100)
            .map(|_| TcpStream::connect(e.addr).unwrap())
            .collect();
        let (page, took) = scrape(e.addr);
        assert!(page.starts_with("HTTP/1.1 200 OK"), "{page}");
        assert!(page.contains("dflash_build_info"), "{page}");
        assert!(
            took < Duration::from_secs(3),
            "a scrape behind 100 idle connections took {took:?}"
        );
        for s in idle {
            let got = until_closed(s, HEAD_TIMEOUT + Duration::from_secs(20));
            assert!(got.starts_with("HTTP/1.1 408"), "{got}");
        }
    }

    /// Beyond [`MAX_CONNECTIONS`] open at once, a new connection closes the oldest: a
    /// scrape is still served, and the first idle client is closed before its time is up.
    #[test]
    fn a_connection_beyond_the_cap_closes_the_oldest() {
        let e = Exporter::start(parse_addr("127.0.0.1:0").unwrap()).unwrap();
        let mut idle: Vec<TcpStream> = (0..MAX_CONNECTIONS)
            .map(|_| TcpStream::connect(e.addr).unwrap())
            .collect();
        let (page, took) = scrape(e.addr);
        assert!(page.starts_with("HTTP/1.1 200 OK"), "{page}");
        assert!(took < Duration::from_secs(3), "{took:?}");
        let got = until_closed(idle.remove(0), Duration::from_secs(20));
        assert_eq!(got, "", "the oldest is closed without an answer");
    }

    /// A client that dribbles its request a byte at a time is answered 408 and closed at
    /// the time given for the whole head, not kept while each byte comes within it.
    #[test]
    fn a_request_head_dribbled_byte_by_byte_is_cut_off_at_the_timeout() {
        let e = Exporter::start(parse_addr("127.0.0.1:0").unwrap()).unwrap();
        let mut c = TcpStream::connect(e.addr).unwrap();
        let t0 = Instant::now();
        let reader = {
            let c = c.try_clone().unwrap();
            std::thread::spawn(move || until_closed(c, Duration::from_secs(30)))
        };
        // At most 400 bytes, one per 50 ms (20 s in all), until the server closes.
        for _ in 0..400 {
            if c.write_all(b"G").is_err() || reader.is_finished() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let got = reader.join().unwrap();
        assert!(got.starts_with("HTTP/1.1 408"), "{got}");
        // A deadline renewed at every byte would have taken all 400 (20 s).
        assert!(t0.elapsed() < Duration::from_secs(12), "{:?}", t0.elapsed());
    }

    #[test]
    fn the_last_tau_is_exported_with_its_intervals_when_there_is_one() {
        let w = serde_json::json!({"tau": {"step": 6, "pooled": 2.5, "pooled_ci95": [2.0, 3.25],
            "mean_of_means": 3.5, "mean_of_means_ci95": [2.5, 4.5], "best_step": 6}});
        let text = render(&window(w));
        for line in [
            "dflash_tau_step 6",
            "dflash_tau{definition=\"pooled\"} 2.5",
            "dflash_tau{definition=\"mean_of_means\"} 3.5",
            "dflash_tau_ci95{definition=\"pooled\",bound=\"low\"} 2",
            "dflash_tau_ci95{definition=\"mean_of_means\",bound=\"high\"} 4.5",
            "dflash_tau_best_step 6",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} in:\n{text}");
        }
        assert!(!render(&Window::default()).contains("dflash_tau"));
    }

    #[test]
    fn the_last_eval_is_exported_when_there_is_one() {
        let w = serde_json::json!({"eval": {"step": 4, "loss": 2.5, "acceptance": 1.75, "best_step": 2}});
        let t = render(&window(w));
        for line in [
            "dflash_eval_step 4",
            "dflash_eval_loss 2.5",
            "dflash_eval_acceptance_length 1.75",
            "dflash_eval_best_step 2",
        ] {
            assert!(t.lines().any(|l| l == line), "{line} in:\n{t}");
        }
        assert!(!render(&Window::default()).contains("dflash_eval"));
    }

    /// Every metric the Grafana dashboard in docs/grafana queries is one the exporter
    /// serves (with a window that holds every kind of figure).
    #[test]
    fn the_grafana_dashboard_queries_only_metrics_the_exporter_serves() {
        let e = Exporter::start(parse_addr("127.0.0.1:0").unwrap()).unwrap();
        e.update(&window(serde_json::json!({
            "gpu": {"gpus": [{"index": 0, "util_gpu_pct": {"mean": 40.0, "max": 50.0}}]},
            "pipeline": {"hidden_pool": {"fill_ratio": 0.5}, "tokens_per_s_by_worker": {"drafter-0": 1.0},
                         "cuda_memory_by_worker": {"drafter-0": {"reserved": 1, "in_use": 1, "peak": 1, "alloc_failures": 0}}},
            "workers": {"drafter-0": {"restarts": 0}}, "batches": {"produced": 1, "consumed": 1},
            "train": {"step": 1, "loss": 2.0, "acceptance": 1.5},
            "eval": {"step": 1, "loss": 2.0, "acceptance": 1.5, "best_step": 1},
            "tau": {"step": 1, "pooled": 1.5, "pooled_ci95": [1.0, 2.0], "mean_of_means": 1.5,
                    "mean_of_means_ci95": [1.0, 2.0], "best_step": 1}
        })));
        let page = e.page();
        let dash: Value =
            serde_json::from_str(include_str!("../../../docs/grafana/dflash-supervise.json"))
                .unwrap();
        let mut queried = 0;
        for p in dash["panels"].as_array().unwrap() {
            for t in p["targets"].as_array().unwrap() {
                let expr = t["expr"].as_str().unwrap();
                // One run (and instance) at a time, as the dashboard's variables choose.
                assert_eq!(
                    expr.matches("dflash_").count(),
                    expr.matches("run=~\"$run\",instance=~\"$instance\"")
                        .count(),
                    "{expr}"
                );
                for (i, _) in expr.match_indices("dflash_") {
                    let name: String = expr[i..]
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    assert!(
                        page.contains(&format!("# TYPE {name} ")),
                        "{name} (panel {}) is not served:\n{page}",
                        p["title"]
                    );
                    queried += 1;
                }
            }
        }
        assert!(queried >= 20, "{queried}");
        let vars: Vec<&str> = dash["templating"]["list"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|v| v["name"].as_str())
            .collect();
        assert_eq!(vars, ["datasource", "run", "instance"]);
        // Every sample of the page carries the run's label once the run is named.
        e.set_run("r1");
        let page = e.page();
        for line in page
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
        {
            assert!(line.contains("run=\""), "{line}");
        }
        assert!(page.contains("dflash_up{run=\"r1\"} 1\n"), "{page}");
        assert!(page.contains("# TYPE dflash_worker_tokens_total counter"));
    }

    #[test]
    fn addresses() {
        assert_eq!(parse_addr("21400").unwrap().to_string(), "127.0.0.1:21400");
        assert_eq!(parse_addr(":21400").unwrap().to_string(), "127.0.0.1:21400");
        assert_eq!(
            parse_addr("0.0.0.0:21400").unwrap().to_string(),
            "0.0.0.0:21400"
        );
        assert!(parse_addr("localhost")
            .unwrap_err()
            .to_string()
            .contains("expected"));
    }

    #[test]
    fn renders_units_and_labels() {
        let w = serde_json::json!({"gpu": {"gpus": [{"index": 1, "util_gpu_pct": {"mean": 40.0, "max": 50.0}, "temp_c": null,
                   "sm_clock_mhz": {"mean": 1980.0, "max": 1980.0}}]},
                   "pipeline": {"hidden_pool": {"fill_ratio": 0.5}}, "workers": {"drafter-0": {"restarts": 2}},
                   "roles": {"target": 1, "drafter": 3}, "role_moves": 2});
        let t = render(&window(w));
        assert!(
            t.contains("dflash_gpu_utilization_ratio{gpu=\"1\"} 0.4\n"),
            "{t}"
        );
        assert!(
            t.contains("dflash_gpu_sm_clock_hertz{gpu=\"1\"} 1980000000\n"),
            "{t}"
        );
        assert!(
            !t.contains("dflash_gpu_temperature_celsius{"),
            "unavailable metrics are left out: {t}"
        );
        assert!(t.contains("dflash_pool_fill_ratio{pool=\"hidden\"} 0.5\n"));
        assert!(t.contains("dflash_worker_restarts_total{worker=\"drafter-0\"} 2\n"));
        assert!(t.contains("# TYPE dflash_gpu_energy_joules_total counter\n"));
        assert!(t.contains("dflash_workers{role=\"drafter\"} 3\n"), "{t}");
        assert!(t.contains("dflash_role_moves_total 2\n"), "{t}");
    }
}
