//! GPU telemetry: a sampler thread that reads every GPU in use through NVML (the only
//! process that loads NVML is the supervisor), and the windows the dispatcher aggregates
//! samples into for `metrics.jsonl`.
//!
//! Every metric degrades on its own: one that fails is `null` in that sample and asked
//! again at the next one. NVML missing or failing to start gives one warning naming what
//! is lost and why, and the run goes on.

use super::window::{Gpu, Gpus};
use std::collections::BTreeMap;
use std::sync::mpsc::Sender;
use std::time::{Duration, Instant};

use nvml_wrapper::enum_wrappers::device::{Clock, TemperatureSensor};

/// One reading of one GPU; `None` where that metric could not be read.
#[derive(Debug, Clone, Default)]
pub struct GpuSample {
    pub index: u32,
    pub util_gpu_pct: Option<f64>,
    pub util_mem_pct: Option<f64>,
    pub mem_used_bytes: Option<f64>,
    pub mem_total_bytes: Option<f64>,
    pub power_w: Option<f64>,
    pub power_limit_w: Option<f64>,
    pub energy_j: Option<f64>,
    pub temp_c: Option<f64>,
    pub sm_clock_mhz: Option<f64>,
    pub mem_clock_mhz: Option<f64>,
    pub pcie_tx_bytes_per_s: Option<f64>,
    pub pcie_rx_bytes_per_s: Option<f64>,
    pub ecc_corrected_volatile: Option<f64>,
    pub ecc_uncorrected_volatile: Option<f64>,
    /// Why the clocks are held down (NVML's throttle / clock-event reasons), by name.
    pub throttle_reasons: Option<Vec<String>>,
    /// Memory of each compute process on the GPU, by pid.
    pub processes: Option<Vec<(u32, u64)>>,
    /// Critical XID errors reported since the previous sample.
    pub xids: Vec<u64>,
}

/// One round of samples, one per GPU, as the sampler thread sends it.
#[derive(Debug)]
pub struct GpuSamples(pub Vec<GpuSample>);

/// Start the sampler for `gpus`; each round arrives as [`GpuSamples`] (which the receiver
/// wraps in its own event type).
pub fn start<E: From<GpuSamples> + Send + 'static>(
    gpus: Vec<u32>,
    interval: Duration,
    tx: Sender<E>,
) {
    if gpus.is_empty() {
        return;
    }
    let spawned = std::thread::Builder::new().name("nvml-sampler".into()).spawn(move || {
        let nvml = match crate::telemetry::gpus::init() {
            Ok(n) => n,
            Err(why) => {
                log::warn!(
                    "GPU metrics are off: {why}. Lost: utilisation, memory, power, energy, temperature, clocks and per-process memory \
                     of GPUs {gpus:?}; the run goes on (--no-gpu-metrics silences this)"
                );
                return;
            }
        };
        let xid_events = xid_event_set(&nvml, &gpus);
        loop {
            let t0 = Instant::now();
            let mut samples: Vec<GpuSample> = gpus.iter().map(|&i| sample(&nvml, i)).collect();
            if let Some(set) = &xid_events {
                // Non-blocking: whatever arrived since the last sample.
                while let Ok(ev) = set.wait(0) {
                    let gpu = ev.device.index().ok();
                    let code = match ev.event_data {
                        Some(nvml_wrapper::enums::event::XidError::Value(v)) => v,
                        _ => 0,
                    };
                    log::warn!("GPU {}: XID {code} (a critical GPU error)", gpu.map_or("?".into(), |g| g.to_string()));
                    if let Some(s) = samples.iter_mut().find(|s| Some(s.index) == gpu) {
                        s.xids.push(code);
                    }
                }
            }
            if tx.send(E::from(GpuSamples(samples))).is_err() {
                return;
            }
            std::thread::sleep(interval.saturating_sub(t0.elapsed()));
        }
    });
    if let Err(e) = spawned {
        log::warn!("GPU metrics are off: cannot start the sampler thread: {e}");
    }
}

/// One reading of GPU `index` (also what `bench telemetry` times).
pub fn sample_one(nvml: &nvml_wrapper::Nvml, index: u32) -> GpuSample {
    sample(nvml, index)
}

/// An event set that reports critical XID errors of `gpus` (None if NVML cannot).
fn xid_event_set<'a>(
    nvml: &'a nvml_wrapper::Nvml,
    gpus: &[u32],
) -> Option<nvml_wrapper::EventSet<'a>> {
    use nvml_wrapper::bitmasks::event::EventTypes;
    let mut set = nvml.create_event_set().ok()?;
    for &i in gpus {
        let d = nvml.device_by_index(i).ok()?;
        set = match d.register_events(EventTypes::CRITICAL_XID_ERROR, set) {
            Ok(s) => s,
            Err(e) => {
                log::warn!(
                    "GPU {i}: XID events unavailable ({}); the other metrics go on",
                    e.error
                );
                return None;
            }
        };
    }
    Some(set)
}

fn sample(nvml: &nvml_wrapper::Nvml, index: u32) -> GpuSample {
    let mut s = GpuSample {
        index,
        ..Default::default()
    };
    let Ok(d) = nvml.device_by_index(index) else {
        return s;
    };
    if let Ok(u) = d.utilization_rates() {
        s.util_gpu_pct = Some(u.gpu as f64);
        s.util_mem_pct = Some(u.memory as f64);
    }
    if let Ok(m) = d.memory_info() {
        s.mem_used_bytes = Some(m.used as f64);
        s.mem_total_bytes = Some(m.total as f64);
    }
    s.power_w = d.power_usage().ok().map(|mw| mw as f64 / 1000.0);
    s.power_limit_w = d.enforced_power_limit().ok().map(|mw| mw as f64 / 1000.0);
    s.energy_j = d
        .total_energy_consumption()
        .ok()
        .map(|mj| mj as f64 / 1000.0);
    s.temp_c = d.temperature(TemperatureSensor::Gpu).ok().map(|c| c as f64);
    s.sm_clock_mhz = d.clock_info(Clock::SM).ok().map(|c| c as f64);
    s.mem_clock_mhz = d.clock_info(Clock::Memory).ok().map(|c| c as f64);
    use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError, PcieUtilCounter};
    s.pcie_tx_bytes_per_s = d
        .pcie_throughput(PcieUtilCounter::Send)
        .ok()
        .map(|kb| kb as f64 * 1024.0);
    s.pcie_rx_bytes_per_s = d
        .pcie_throughput(PcieUtilCounter::Receive)
        .ok()
        .map(|kb| kb as f64 * 1024.0);
    s.ecc_corrected_volatile = d
        .total_ecc_errors(MemoryError::Corrected, EccCounter::Volatile)
        .ok()
        .map(|n| n as f64);
    s.ecc_uncorrected_volatile = d
        .total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile)
        .ok()
        .map(|n| n as f64);
    s.throttle_reasons = d.current_throttle_reasons().ok().map(|r| {
        r.iter_names()
            .map(|(n, _)| n.to_ascii_lowercase())
            .collect()
    });
    s.processes = d.running_compute_processes().ok().map(|ps| {
        ps.iter()
            .map(|p| {
                let used = match p.used_gpu_memory {
                    nvml_wrapper::enums::device::UsedGpuMemory::Used(b) => b,
                    nvml_wrapper::enums::device::UsedGpuMemory::Unavailable => 0,
                };
                (p.pid, used)
            })
            .collect()
    });
    s
}

pub use super::window::{Agg, Stat};

#[derive(Default)]
struct Acc {
    sum: f64,
    max: f64,
    n: u32,
}

impl Acc {
    fn add(&mut self, v: Option<f64>) {
        if let Some(v) = v {
            self.max = if self.n == 0 { v } else { self.max.max(v) };
            self.sum += v;
            self.n += 1;
        }
    }
    fn stat(&self) -> Option<Stat> {
        (self.n > 0).then(|| Stat {
            mean: self.sum / self.n as f64,
            max: self.max,
            samples: self.n,
        })
    }
}

/// How a GPU metric is exported to Prometheus: the family's name, type and help, and the
/// scale from the window's unit to the family's.
#[derive(Debug, Clone, Copy)]
pub struct Prom {
    pub name: &'static str,
    pub kind: &'static str,
    pub help: &'static str,
    pub scale: f64,
}

/// One GPU metric: its key in a sample and in metrics.jsonl's windows, its unit, how a
/// sample reads it, which statistic of a window reports it, and its Prometheus family.
#[derive(Clone, Copy)]
pub struct GpuMetric {
    pub key: &'static str,
    pub unit: &'static str,
    pub read: fn(&GpuSample) -> Option<f64>,
    pub agg: Agg,
    pub prom: Option<Prom>,
}

const fn metric(
    key: &'static str,
    unit: &'static str,
    read: fn(&GpuSample) -> Option<f64>,
    agg: Agg,
    prom: Option<Prom>,
) -> GpuMetric {
    GpuMetric {
        key,
        unit,
        read,
        agg,
        prom,
    }
}

const fn prom(
    name: &'static str,
    kind: &'static str,
    help: &'static str,
    scale: f64,
) -> Option<Prom> {
    Some(Prom {
        name,
        kind,
        help,
        scale,
    })
}

/// Every GPU metric, in the order of metrics.jsonl's entries: the one table the windows,
/// Prometheus and the docs' list of families read.
pub const GPU_METRICS: [GpuMetric; 14] = [
    metric(
        "util_gpu_pct",
        "%",
        |s| s.util_gpu_pct,
        Agg::Mean,
        prom(
            "dflash_gpu_utilization_ratio",
            "gauge",
            "GPU busy share over the window (mean).",
            0.01,
        ),
    ),
    metric(
        "util_mem_pct",
        "%",
        |s| s.util_mem_pct,
        Agg::Mean,
        prom(
            "dflash_gpu_memory_bandwidth_utilization_ratio",
            "gauge",
            "GPU memory-controller busy share (mean).",
            0.01,
        ),
    ),
    metric(
        "mem_used_bytes",
        "bytes",
        |s| s.mem_used_bytes,
        Agg::Max,
        prom(
            "dflash_gpu_memory_used_bytes",
            "gauge",
            "GPU memory in use (max over the window).",
            1.0,
        ),
    ),
    metric(
        "mem_total_bytes",
        "bytes",
        |s| s.mem_total_bytes,
        Agg::Mean,
        prom(
            "dflash_gpu_memory_total_bytes",
            "gauge",
            "GPU memory size.",
            1.0,
        ),
    ),
    metric(
        "power_w",
        "W",
        |s| s.power_w,
        Agg::Mean,
        prom(
            "dflash_gpu_power_watts",
            "gauge",
            "GPU power draw (mean).",
            1.0,
        ),
    ),
    metric(
        "power_limit_w",
        "W",
        |s| s.power_limit_w,
        Agg::Mean,
        prom(
            "dflash_gpu_power_limit_watts",
            "gauge",
            "Enforced GPU power limit.",
            1.0,
        ),
    ),
    metric(
        "energy_j",
        "J",
        |s| s.energy_j,
        Agg::Max,
        prom(
            "dflash_gpu_energy_joules_total",
            "counter",
            "GPU energy since the driver loaded.",
            1.0,
        ),
    ),
    metric(
        "temp_c",
        "°C",
        |s| s.temp_c,
        Agg::Max,
        prom(
            "dflash_gpu_temperature_celsius",
            "gauge",
            "GPU temperature (max over the window).",
            1.0,
        ),
    ),
    metric(
        "sm_clock_mhz",
        "MHz",
        |s| s.sm_clock_mhz,
        Agg::Mean,
        prom(
            "dflash_gpu_sm_clock_hertz",
            "gauge",
            "SM clock (mean).",
            1e6,
        ),
    ),
    metric(
        "mem_clock_mhz",
        "MHz",
        |s| s.mem_clock_mhz,
        Agg::Mean,
        prom(
            "dflash_gpu_memory_clock_hertz",
            "gauge",
            "Memory clock (mean).",
            1e6,
        ),
    ),
    metric(
        "pcie_tx_bytes_per_s",
        "bytes/s",
        |s| s.pcie_tx_bytes_per_s,
        Agg::Mean,
        None,
    ),
    metric(
        "pcie_rx_bytes_per_s",
        "bytes/s",
        |s| s.pcie_rx_bytes_per_s,
        Agg::Mean,
        None,
    ),
    metric(
        "ecc_corrected_volatile",
        "errors",
        |s| s.ecc_corrected_volatile,
        Agg::Max,
        None,
    ),
    metric(
        "ecc_uncorrected_volatile",
        "errors",
        |s| s.ecc_uncorrected_volatile,
        Agg::Max,
        None,
    ),
];

/// GPU readings of one metrics window.
#[derive(Default)]
pub struct GpuWindow {
    acc: BTreeMap<u32, BTreeMap<&'static str, Acc>>,
    processes: BTreeMap<u32, BTreeMap<u32, u64>>,
    throttle: BTreeMap<u32, std::collections::BTreeSet<String>>,
    xids: BTreeMap<u32, Vec<u64>>,
    samples: u32,
}

impl GpuWindow {
    pub fn add(&mut self, samples: &[GpuSample]) {
        self.samples += 1;
        for s in samples {
            let a = self.acc.entry(s.index).or_default();
            self.xids
                .entry(s.index)
                .or_default()
                .extend(s.xids.iter().copied());
            if let Some(r) = &s.throttle_reasons {
                self.throttle
                    .entry(s.index)
                    .or_default()
                    .extend(r.iter().cloned());
            }
            for m in &GPU_METRICS {
                a.entry(m.key).or_default().add((m.read)(s));
            }
            if let Some(ps) = &s.processes {
                let m = self.processes.entry(s.index).or_default();
                for &(pid, used) in ps {
                    let e = m.entry(pid).or_default();
                    *e = (*e).max(used);
                }
            }
        }
    }

    /// The window, worker names for pids from `names`; resets the window.
    pub fn take(&mut self, names: &dyn Fn(u32) -> Option<String>) -> Gpus {
        let gpus = self
            .acc
            .iter()
            .map(|(index, a)| Gpu {
                index: *index,
                metrics: GPU_METRICS
                    .iter()
                    .map(|m| (m.key.to_string(), a.get(m.key).and_then(Acc::stat)))
                    .collect(),
                process_mem_bytes: self
                    .processes
                    .get(index)
                    .into_iter()
                    .flatten()
                    .map(|(pid, used)| (names(*pid).unwrap_or_else(|| format!("pid {pid}")), *used))
                    .collect(),
                throttle_reasons: self.throttle.get(index).cloned(),
                xid_errors: self.xids.get(index).cloned().unwrap_or_default(),
            })
            .collect();
        let v = Gpus {
            samples: self.samples,
            gpus,
        };
        *self = GpuWindow::default();
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each metric of the table reads its own field of a sample, under its own key, and a
    /// window reports each by the statistic the table names.
    #[test]
    fn every_gpu_metric_reads_its_own_field_and_a_window_reports_it() {
        let s = GpuSample {
            index: 3,
            util_gpu_pct: Some(1.0),
            util_mem_pct: Some(2.0),
            mem_used_bytes: Some(3.0),
            mem_total_bytes: Some(4.0),
            power_w: Some(5.0),
            power_limit_w: Some(6.0),
            energy_j: Some(7.0),
            temp_c: Some(8.0),
            sm_clock_mhz: Some(9.0),
            mem_clock_mhz: Some(10.0),
            pcie_tx_bytes_per_s: Some(11.0),
            pcie_rx_bytes_per_s: Some(12.0),
            ecc_corrected_volatile: Some(13.0),
            ecc_uncorrected_volatile: Some(14.0),
            ..GpuSample::default()
        };
        let read: Vec<f64> = GPU_METRICS.iter().map(|m| (m.read)(&s).unwrap()).collect();
        assert_eq!(read, (1..=14).map(f64::from).collect::<Vec<_>>());
        let keys: std::collections::BTreeSet<&str> = GPU_METRICS.iter().map(|m| m.key).collect();
        assert_eq!(keys.len(), GPU_METRICS.len(), "keys are distinct");
        let mut w = GpuWindow::default();
        let mut later = s.clone();
        later.temp_c = Some(20.0);
        w.add(&[s]);
        w.add(&[later]);
        let v = w.take(&|_| None);
        let g = &v.gpus[0];
        assert_eq!(g.index, 3);
        for m in &GPU_METRICS {
            assert!(g.stat(m.key, m.agg).is_some(), "{}: {g:?}", m.key);
        }
        assert_eq!(g.stat("temp_c", Agg::Max), Some(20.0));
        assert_eq!(g.stat("temp_c", Agg::Mean), Some(14.0));
        // As metrics.jsonl writes it: each metric under its key, the statistic inside.
        let j = serde_json::to_value(g).unwrap();
        assert_eq!(j["temp_c"]["mean"], 14.0);
        assert_eq!(j["index"], 3);
    }
}
