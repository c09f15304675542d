//! `dflash-supervise bench ...`: measurements on this machine (`bench prepare` is in
//! [`super::prepare`]).

pub mod cluster;
pub mod compute;
pub mod ipc;
pub mod kernels;
pub mod report;
pub mod splits;
pub mod telemetry;
pub mod train;
mod worker_tool;
