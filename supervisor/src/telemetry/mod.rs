//! Telemetry, all in the supervisor: the NVML sampler ([`nvml`], [`gpus`]), metrics
//! windows ([`metrics`]), queue health ([`queue_health`]), and the sinks: `metrics.jsonl`,
//! Prometheus ([`prometheus`]), the console status line ([`console`]) and the report page
//! ([`report`]).

pub mod console;
pub mod gpus;
pub mod metrics;
pub mod nvml;
pub mod prometheus;
pub mod queue_health;
pub mod report;
pub mod wandb;
pub mod window;
