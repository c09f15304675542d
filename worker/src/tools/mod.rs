//! The tools `dflash-worker` runs besides its process loop: the benchmarks (`bench`,
//! `bench ops`, the throughput and kernel benches) and the export of a trained drafter.
//! They use the devices and the models; nothing in the worker's loop uses them.

pub mod bench;
pub mod bench_ops;
pub mod bench_throughput;
pub mod export;
pub mod kernel_bench;
