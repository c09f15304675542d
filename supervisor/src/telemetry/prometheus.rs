//! `--prometheus ADDR`: the latest metrics window in Prometheus text exposition format at
//! `http://ADDR/metrics`, with counters the dispatcher updates at every step (committed
//! steps, trained tokens) and `dflash_build_info`. A bare port binds loopback only; give an
//! address (0.0.0.0:21400) to listen elsewhere. A minimal HTTP/1.1 responder: each
//! connection served on its own thread (up to [`MAX_CLIENTS`] at once, beyond that 503),
//! one short request (GET, or HEAD for the headers alone), one response, close.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;

use crate::error::Error;

/// Scrapes served at once; a connection beyond them gets 503.
pub const MAX_CLIENTS: usize = 8;

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

impl Exporter {
    pub fn start(addr: SocketAddr) -> Result<Exporter, Error> {
        let listener = TcpListener::bind(addr)
            .map_err(|e| Error::input(format!("--prometheus {addr}: cannot listen"), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::start("the Prometheus listener", e))?;
        let e = Exporter {
            text: Arc::new(Mutex::new(String::new())),
            counters: Arc::default(),
            run: Arc::default(),
            addr,
        };
        let shared = e.clone();
        let clients = Arc::new(AtomicUsize::new(0));
        std::thread::Builder::new()
            .name("prometheus".into())
            .spawn(move || {
                for stream in listener.incoming() {
                    let Ok(s) = stream else { continue };
                    if clients.fetch_add(1, Ordering::SeqCst) >= MAX_CLIENTS {
                        clients.fetch_sub(1, Ordering::SeqCst);
                        // Read what the request sent (briefly: this is the accept loop), so
                        // that closing does not reset the connection under the reply.
                        let mut s = s;
                        let _ = request_head(&mut s, Duration::from_millis(200));
                        respond(
                            s,
                            "503 Service Unavailable",
                            "busy: too many scrapes at once\n",
                            false,
                        );
                        continue;
                    }
                    let (page, done) = (shared.clone(), clients.clone());
                    let served = std::thread::Builder::new()
                        .name("prometheus-scrape".into())
                        .spawn(move || {
                            page.serve(s);
                            done.fetch_sub(1, Ordering::SeqCst);
                        });
                    if served.is_err() {
                        clients.fetch_sub(1, Ordering::SeqCst);
                    }
                }
            })
            .map_err(|e| Error::start("Prometheus thread", e))?;
        Ok(e)
    }

    /// The run's name, for the `run` label of `dflash_build_info`.
    pub fn set_run(&self, name: &str) {
        if let Ok(mut r) = self.run.lock() {
            *r = name.to_string();
        }
    }

    pub fn update(&self, window: &Value) {
        if let Ok(mut t) = self.text.lock() {
            *t = render(window);
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
        o.0
    }

    /// One request on `s`: GET (or HEAD) /metrics, else 404.
    fn serve(&self, mut s: TcpStream) {
        let req = request_head(&mut s, Duration::from_secs(2));
        let mut words = req.split_whitespace();
        let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
        let head = method == "HEAD";
        if method != "GET" && !head {
            return respond(s, "405 Method Not Allowed", "only GET and HEAD\n", false);
        }
        if path == "/metrics" || path.starts_with("/metrics?") {
            respond(s, "200 OK", &self.page(), head);
        } else {
            respond(
                s,
                "404 Not Found",
                "not found: the metrics are at /metrics\n",
                head,
            );
        }
    }
}

/// The request head (it may come in several segments), as far as it came within
/// `timeout` of the connection: a client that sends a byte now and then holds a handler
/// no longer than one that sends nothing.
fn request_head(s: &mut TcpStream, timeout: Duration) -> String {
    let deadline = std::time::Instant::now() + timeout;
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    while buf.len() < 8192 && !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() || s.set_read_timeout(Some(left)).is_err() {
            break;
        }
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    String::from_utf8_lossy(&buf).into_owned()
}

/// Write one response and close; a HEAD's has the headers alone.
fn respond(mut s: TcpStream, status: &str, body: &str, head: bool) {
    let _ = write!(
        s,
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}",
        body.len(),
        if head { "" } else { body }
    );
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

/// A metrics window (see `dispatcher/metrics.rs`) as Prometheus text.
pub fn render(w: &Value) -> String {
    let mut o = Out(String::new());
    o.family("dflash_up", "gauge", "1 while the supervisor runs.");
    o.sample("dflash_up", &[], Some(1.0));
    gpu_families(&mut o, w);
    pipeline_families(&mut o, &w["pipeline"]);
    progress_families(&mut o, w);
    if !w["eval"].is_null() {
        eval_families(&mut o, &w["eval"]);
    }
    if !w["tau"].is_null() {
        tau_families(&mut o, &w["tau"]);
    }
    o.0
}

/// The GPU families: (the metrics window's key, the family, its type, its help, the scale
/// from the window's unit to the family's).
const GPU_METRICS: [(&str, &str, &str, &str, f64); 10] = [
    (
        "util_gpu_pct",
        "dflash_gpu_utilization_ratio",
        "gauge",
        "GPU busy share over the window (mean).",
        0.01,
    ),
    (
        "util_mem_pct",
        "dflash_gpu_memory_bandwidth_utilization_ratio",
        "gauge",
        "GPU memory-controller busy share (mean).",
        0.01,
    ),
    (
        "mem_used_bytes",
        "dflash_gpu_memory_used_bytes",
        "gauge",
        "GPU memory in use (max over the window).",
        1.0,
    ),
    (
        "mem_total_bytes",
        "dflash_gpu_memory_total_bytes",
        "gauge",
        "GPU memory size.",
        1.0,
    ),
    (
        "power_w",
        "dflash_gpu_power_watts",
        "gauge",
        "GPU power draw (mean).",
        1.0,
    ),
    (
        "power_limit_w",
        "dflash_gpu_power_limit_watts",
        "gauge",
        "Enforced GPU power limit.",
        1.0,
    ),
    (
        "energy_j",
        "dflash_gpu_energy_joules_total",
        "counter",
        "GPU energy since the driver loaded.",
        1.0,
    ),
    (
        "temp_c",
        "dflash_gpu_temperature_celsius",
        "gauge",
        "GPU temperature (max over the window).",
        1.0,
    ),
    (
        "sm_clock_mhz",
        "dflash_gpu_sm_clock_hertz",
        "gauge",
        "SM clock (mean).",
        1e6,
    ),
    (
        "mem_clock_mhz",
        "dflash_gpu_memory_clock_hertz",
        "gauge",
        "Memory clock (mean).",
        1e6,
    ),
];

/// Each GPU's utilisation, memory, power, energy, temperature and clocks.
fn gpu_families(o: &mut Out, w: &Value) {
    let gpus = w["gpu"]["gpus"].as_array().cloned().unwrap_or_default();
    for (key, name, kind, help, scale) in GPU_METRICS {
        o.family(name, kind, help);
        let pick = if key == "mem_used_bytes" || key == "temp_c" || kind == "counter" {
            "max"
        } else {
            "mean"
        };
        for g in &gpus {
            let idx = g["index"].as_u64().unwrap_or(0).to_string();
            o.sample(
                name,
                &[("gpu", &idx)],
                g[key][pick].as_f64().map(|v| v * scale),
            );
        }
    }
}

/// The pipeline (`p`, the window's `pipeline`): the pools, each worker's throughput and
/// device memory, the padding efficiency.
fn pipeline_families(o: &mut Out, p: &Value) {
    for (key, name, help) in [
        (
            "fill_ratio",
            "dflash_pool_fill_ratio",
            "Share of slots holding a ready batch (time-weighted).",
        ),
        (
            "producers_blocked_share",
            "dflash_pool_producers_blocked_ratio",
            "Share of time a producer waited for a free slot.",
        ),
        (
            "consumers_starved_share",
            "dflash_pool_consumers_starved_ratio",
            "Share of time a consumer waited for a batch.",
        ),
    ] {
        o.family(name, "gauge", help);
        for pool in ["tokens", "hidden"] {
            o.sample(
                name,
                &[("pool", pool)],
                p[format!("{pool}_pool")][key].as_f64(),
            );
        }
    }
    o.family(
        "dflash_worker_tokens_per_second",
        "gauge",
        "Tokens each worker processed per second over the window.",
    );
    if let Some(m) = p["tokens_per_s_by_worker"].as_object() {
        for (wk, v) in m {
            o.sample(
                "dflash_worker_tokens_per_second",
                &[("worker", wk)],
                v.as_f64(),
            );
        }
    }
    o.family("dflash_cuda_memory_bytes", "gauge", "Device memory of each GPU worker: its arena (reserved, in_use, peak) and the device's free and total.");
    if let Some(m) = p["cuda_memory_by_worker"].as_object() {
        for (wk, v) in m {
            for kind in ["reserved", "in_use", "peak", "free", "total"] {
                o.sample(
                    "dflash_cuda_memory_bytes",
                    &[("worker", wk), ("kind", kind)],
                    v[kind].as_f64(),
                );
            }
        }
    }
    o.family(
        "dflash_cuda_alloc_failures_total",
        "counter",
        "Arena requests of each GPU worker that could not be served.",
    );
    if let Some(m) = p["cuda_memory_by_worker"].as_object() {
        for (wk, v) in m {
            o.sample(
                "dflash_cuda_alloc_failures_total",
                &[("worker", wk)],
                v["alloc_failures"].as_f64(),
            );
        }
    }
    o.family(
        "dflash_padding_efficiency_ratio",
        "gauge",
        "Real tokens over padded tokens of the window's batches.",
    );
    o.sample(
        "dflash_padding_efficiency_ratio",
        &[],
        p["padding_efficiency"].as_f64(),
    );
}

/// The run's progress: worker restarts, batches, steps, the last step's loss and
/// acceptance.
fn progress_families(o: &mut Out, w: &Value) {
    o.family(
        "dflash_worker_restarts_total",
        "counter",
        "Restarts of each worker in this run.",
    );
    if let Some(m) = w["workers"].as_object() {
        for (wk, v) in m {
            o.sample(
                "dflash_worker_restarts_total",
                &[("worker", wk)],
                v["restarts"].as_f64(),
            );
        }
    }
    o.family(
        "dflash_batches_produced_total",
        "counter",
        "Batches the loader put in the pipeline.",
    );
    o.sample(
        "dflash_batches_produced_total",
        &[],
        w["batches"]["produced"].as_f64(),
    );
    o.family(
        "dflash_batches_consumed_total",
        "counter",
        "Batches that reached the optimizer.",
    );
    o.sample(
        "dflash_batches_consumed_total",
        &[],
        w["batches"]["consumed"].as_f64(),
    );
    o.family(
        "dflash_train_step",
        "gauge",
        "The run's current optimizer step (a rollback takes it back).",
    );
    o.sample("dflash_train_step", &[], w["train"]["step"].as_f64());
    o.family(
        "dflash_train_loss",
        "gauge",
        "Loss of the last committed step.",
    );
    o.sample("dflash_train_loss", &[], w["train"]["loss"].as_f64());
    o.family(
        "dflash_train_acceptance_length",
        "gauge",
        "Acceptance-length proxy of the last committed step.",
    );
    o.sample(
        "dflash_train_acceptance_length",
        &[],
        w["train"]["acceptance"].as_f64(),
    );
}

/// The last held-out eval (the window's `eval`).
fn eval_families(o: &mut Out, e: &Value) {
    o.family(
        "dflash_eval_step",
        "gauge",
        "Step whose weights the last held-out eval (--eval-data) scored.",
    );
    o.sample("dflash_eval_step", &[], e["step"].as_f64());
    o.family(
        "dflash_eval_loss",
        "gauge",
        "Loss over the whole held-out eval set, at the last eval.",
    );
    o.sample("dflash_eval_loss", &[], e["loss"].as_f64());
    o.family(
        "dflash_eval_acceptance_length",
        "gauge",
        "Acceptance-length estimate over the whole held-out eval set, at the last eval.",
    );
    o.sample(
        "dflash_eval_acceptance_length",
        &[],
        e["acceptance"].as_f64(),
    );
    o.family(
        "dflash_eval_best_step",
        "gauge",
        "Step checkpoints/best names (the best tau with --eval-prompts, else the best eval acceptance).",
    );
    o.sample("dflash_eval_best_step", &[], e["best_step"].as_f64());
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

    /// A client that dribbles its request a byte at a time is cut off at the timeout of
    /// the whole head, not kept while each byte comes within it.
    #[test]
    fn a_request_head_dribbled_byte_by_byte_is_cut_off_at_the_timeout() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        let client = std::thread::spawn(move || {
            let mut c = TcpStream::connect(addr).unwrap();
            // At most 400 bytes, one per 50 ms (20 s in all), until the server is done.
            for _ in 0..400 {
                if c.write_all(b"G").is_err() || stop_rx.try_recv().is_ok() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let (mut s, _) = listener.accept().unwrap();
        let head = request_head(&mut s, Duration::from_millis(500));
        stop_tx.send(()).unwrap();
        client.join().unwrap();
        // Half a second of a byte per 50 ms is about ten bytes; a read timeout renewed at
        // every byte would have taken all 400 (20 s).
        assert!(head.len() < 200, "{} bytes read", head.len());
    }

    #[test]
    fn the_last_tau_is_exported_with_its_intervals_when_there_is_one() {
        let w = serde_json::json!({"tau": {"step": 6, "pooled": 2.5, "pooled_ci95": [2.0, 3.25],
            "mean_of_means": 3.5, "mean_of_means_ci95": [2.5, 4.5], "best_step": 6}});
        let text = render(&w);
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
        assert!(!render(&serde_json::json!({})).contains("dflash_tau"));
    }

    #[test]
    fn the_last_eval_is_exported_when_there_is_one() {
        let w = serde_json::json!({"eval": {"step": 4, "loss": 2.5, "acceptance": 1.75, "best_step": 2}});
        let t = render(&w);
        for line in [
            "dflash_eval_step 4",
            "dflash_eval_loss 2.5",
            "dflash_eval_acceptance_length 1.75",
            "dflash_eval_best_step 2",
        ] {
            assert!(t.lines().any(|l| l == line), "{line} in:\n{t}");
        }
        assert!(!render(&serde_json::json!({})).contains("dflash_eval"));
    }

    /// Every metric the Grafana dashboard in docs/grafana queries is one the exporter
    /// serves (with a window that holds every kind of figure).
    #[test]
    fn the_grafana_dashboard_queries_only_metrics_the_exporter_serves() {
        let e = Exporter::start(parse_addr("127.0.0.1:0").unwrap()).unwrap();
        e.update(&serde_json::json!({
            "gpu": {"gpus": [{"index": 0, "util_gpu_pct": {"mean": 40.0, "max": 50.0}}]},
            "pipeline": {"hidden_pool": {"fill_ratio": 0.5}, "tokens_per_s_by_worker": {"drafter-0": 1.0},
                         "cuda_memory_by_worker": {"drafter-0": {"reserved": 1, "in_use": 1, "peak": 1, "alloc_failures": 0}}},
            "workers": {"drafter-0": {"restarts": 0}}, "batches": {"produced": 1, "consumed": 1},
            "train": {"step": 1, "loss": 2.0, "acceptance": 1.5},
            "eval": {"step": 1, "loss": 2.0, "acceptance": 1.5, "best_step": 1},
            "tau": {"step": 1, "pooled": 1.5, "pooled_ci95": [1.0, 2.0], "mean_of_means": 1.5,
                    "mean_of_means_ci95": [1.0, 2.0], "best_step": 1}
        }));
        let page = e.page();
        let dash: Value =
            serde_json::from_str(include_str!("../../../docs/grafana/dflash-supervise.json"))
                .unwrap();
        let mut queried = 0;
        for p in dash["panels"].as_array().unwrap() {
            for t in p["targets"].as_array().unwrap() {
                let expr = t["expr"].as_str().unwrap();
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
                   "pipeline": {"hidden_pool": {"fill_ratio": 0.5}}, "workers": {"drafter-0": {"restarts": 2}}});
        let t = render(&w);
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
    }
}
