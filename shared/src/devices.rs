//! `--gpus` specs: `0-7`, `0,2,5-7`, `all`, `cpu:N`.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Upper bound on GPU indices and CPU worker counts: catches typos like `0-70000` before
/// they turn into thousands of processes.
pub const MAX_DEVICES: u32 = 1024;

/// What the user asked for, before it is checked against the machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceSpec {
    /// Every GPU NVML reports.
    All,
    /// N workers with no GPU.
    Cpu(u32),
    /// These GPU indices (NVML numbering), in the order given, no duplicates.
    Gpus(Vec<u32>),
}

/// The device one worker runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Device {
    Gpu(u32),
    Cpu,
}

impl Device {
    /// The value of `CUDA_VISIBLE_DEVICES` for a worker on this device (empty: no GPU).
    pub fn cuda_visible_devices(self) -> String {
        match self {
            Device::Gpu(i) => i.to_string(),
            Device::Cpu => String::new(),
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Gpu(i) => write!(f, "{i}"),
            Device::Cpu => f.write_str("cpu"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason} (expected a GPU list such as 0-7 or 0,2,5-7, 'all', or cpu:N)")]
pub struct DeviceSpecError {
    pub reason: String,
}

fn bad(reason: impl Into<String>) -> DeviceSpecError {
    DeviceSpecError {
        reason: reason.into(),
    }
}

fn parse_index(s: &str, what: &str) -> Result<u32, DeviceSpecError> {
    let s = s.trim();
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad(format!("'{s}' is not a GPU index ({what})")));
    }
    let v: u32 = s
        .parse()
        .map_err(|_| bad(format!("GPU index '{s}' is too large")))?;
    if v >= MAX_DEVICES {
        return Err(bad(format!(
            "GPU index {v} is too large (at most {})",
            MAX_DEVICES - 1
        )));
    }
    Ok(v)
}

impl FromStr for DeviceSpec {
    type Err = DeviceSpecError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if s.is_empty() {
            return Err(bad("empty device list"));
        }
        if s == "all" {
            return Ok(DeviceSpec::All);
        }
        if let Some(n) = s.strip_prefix("cpu:") {
            let n: u32 = n
                .trim()
                .parse()
                .map_err(|_| bad(format!("'{n}' is not a worker count in cpu:N")))?;
            if n == 0 {
                return Err(bad("cpu:0 asks for no workers; N must be at least 1"));
            }
            if n > MAX_DEVICES {
                return Err(bad(format!(
                    "cpu:{n} is too many workers (at most {MAX_DEVICES})"
                )));
            }
            return Ok(DeviceSpec::Cpu(n));
        }
        if s == "cpu" {
            return Err(bad("'cpu' needs a worker count, e.g. cpu:2"));
        }
        let mut out = Vec::new();
        for part in s.split(',') {
            let part = part.trim();
            if part.is_empty() {
                return Err(bad(format!("empty item in '{s}'")));
            }
            let (lo, hi) = match part.split_once('-') {
                Some((a, b)) => (parse_index(a, "range start")?, parse_index(b, "range end")?),
                None => {
                    let v = parse_index(part, "list item")?;
                    (v, v)
                }
            };
            if lo > hi {
                return Err(bad(format!("range {lo}-{hi} runs backwards (start > end)")));
            }
            for g in lo..=hi {
                if out.contains(&g) {
                    return Err(bad(format!("GPU {g} is listed twice")));
                }
                out.push(g);
            }
        }
        Ok(DeviceSpec::Gpus(out))
    }
}

impl DeviceSpec {
    /// Turn the spec into concrete devices. `gpus` is what NVML reports: the GPU count,
    /// or why it could not be asked (e.g. "no NVIDIA driver found"), kept in words.
    pub fn resolve<E: fmt::Display>(
        &self,
        gpus: Result<u32, E>,
        flag: &str,
    ) -> Result<Vec<Device>, ResolveError> {
        let no_gpu = |spec: &str, why: String| ResolveError::NoGpu {
            flag: flag.to_string(),
            spec: spec.to_string(),
            why,
        };
        match self {
            DeviceSpec::Cpu(n) => Ok(vec![Device::Cpu; *n as usize]),
            DeviceSpec::All => match gpus {
                Err(why) => Err(no_gpu("all", why.to_string())),
                Ok(0) => Err(no_gpu("all", "NVML reports no GPU".into())),
                Ok(n) => Ok((0..n).map(Device::Gpu).collect()),
            },
            DeviceSpec::Gpus(list) => {
                let shown = list
                    .iter()
                    .map(|g| g.to_string())
                    .collect::<Vec<_>>()
                    .join(",");
                let n = gpus.map_err(|why| no_gpu(&shown, why.to_string()))?;
                if let Some(&gpu) = list.iter().find(|&&g| g >= n) {
                    return Err(ResolveError::NoSuchGpu {
                        flag: flag.to_string(),
                        spec: shown,
                        gpu,
                        count: n,
                    });
                }
                Ok(list.iter().map(|&g| Device::Gpu(g)).collect())
            }
        }
    }
}

/// Devices asked for that this machine does not have: the flag, its value as given, and
/// why (NVML's reason, or the GPU that is not there and how many there are).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    #[error("{flag} {spec}: {why}; use {flag} cpu:N to run on CPU workers")]
    NoGpu {
        flag: String,
        spec: String,
        why: String,
    },
    #[error("{flag} {spec}: GPU {gpu} does not exist (NVML reports {})", gpus_shown(*count))]
    NoSuchGpu {
        flag: String,
        spec: String,
        gpu: u32,
        count: u32,
    },
}

/// `count` GPUs in words: "no GPU" or "4 GPU(s), 0-3".
fn gpus_shown(count: u32) -> String {
    if count == 0 {
        "no GPU".to_string()
    } else {
        format!("{count} GPU(s), 0-{}", count - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpus(s: &str) -> Vec<u32> {
        match s.parse::<DeviceSpec>().unwrap() {
            DeviceSpec::Gpus(v) => v,
            other => panic!("{s} gave {other:?}"),
        }
    }

    #[test]
    fn lists_and_ranges() {
        assert_eq!(gpus("0-7"), (0..8).collect::<Vec<_>>());
        assert_eq!(gpus("0,2,5-7"), vec![0, 2, 5, 6, 7]);
        assert_eq!(gpus(" 3 "), vec![3]);
        assert_eq!(gpus("4-4"), vec![4]);
        assert_eq!("all".parse::<DeviceSpec>().unwrap(), DeviceSpec::All);
        assert_eq!("cpu:3".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cpu(3));
    }

    #[test]
    fn bad_specs_say_why() {
        for (s, needle) in [
            ("7-3", "backwards"),
            ("x", "'x' is not a GPU index"),
            ("cpu:0", "at least 1"),
            ("cpu:x", "worker count"),
            ("cpu", "needs a worker count"),
            ("", "empty"),
            ("0,,1", "empty item"),
            ("1,1", "listed twice"),
            ("0-2,2", "listed twice"),
            ("-1", "not a GPU index"),
            ("99999", "too large"),
            ("cpu:5000", "too many"),
        ] {
            let e = s.parse::<DeviceSpec>().unwrap_err().to_string();
            assert!(e.contains(needle), "{s}: {e}");
            assert!(e.contains("expected"), "{s}: {e}");
        }
    }

    #[test]
    fn resolve_checks_the_machine() {
        let spec: DeviceSpec = "0-7".parse().unwrap();
        let e = spec
            .resolve(Err("no NVIDIA driver found"), "--gpus")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("no NVIDIA driver") && e.contains("cpu:N") && e.contains("0,1,2"),
            "{e}"
        );
        let e = spec.resolve(Ok::<_, &str>(4), "--gpus").unwrap_err();
        assert_eq!(
            e,
            ResolveError::NoSuchGpu {
                flag: "--gpus".into(),
                spec: "0,1,2,3,4,5,6,7".into(),
                gpu: 4,
                count: 4
            }
        );
        let e = e.to_string();
        assert!(
            e.contains("GPU 4 does not exist") && e.contains("0-3"),
            "{e}"
        );
        assert_eq!(spec.resolve(Ok::<_, &str>(8), "--gpus").unwrap().len(), 8);
        assert_eq!(
            DeviceSpec::All.resolve(Ok::<_, &str>(2), "--gpus").unwrap(),
            vec![Device::Gpu(0), Device::Gpu(1)]
        );
        assert!(DeviceSpec::All.resolve(Ok::<_, &str>(0), "--gpus").is_err());
        assert!(DeviceSpec::All.resolve(Err("x"), "--gpus").is_err());
        assert_eq!(
            DeviceSpec::Cpu(2).resolve(Err("x"), "--gpus").unwrap(),
            vec![Device::Cpu, Device::Cpu]
        );
    }

    #[test]
    fn cuda_visible_devices() {
        assert_eq!(Device::Gpu(5).cuda_visible_devices(), "5");
        assert_eq!(Device::Cpu.cuda_visible_devices(), "");
    }
}
