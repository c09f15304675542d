//! The subcommands other than a run: each reads a run directory or the machine and prints.

pub mod bench;
pub mod cluster_check;
pub mod eval;
pub mod export;
pub mod export_check;
pub mod gpus;
pub mod ledger;
pub mod logs;
pub mod plan;
pub mod prepare;
pub mod regenerate;
pub mod report;
pub mod status;
