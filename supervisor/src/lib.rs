//! `dflash-supervise`: the CPU-only supervisor of a DFlash training run.
//!
//! The tree follows the design (DESIGN.md):
//! - [`run`]: a training run — its start, the dispatcher that owns its state, worker
//!   lives (spawning, control channels, restarts, the reaper) and the run directory;
//! - [`data`]: the data plane — the loader, chat data, the slot pools' pipeline and the
//!   batch ledger;
//! - [`training`]: the trainer (steps, rollbacks, checkpoints) and `--resume`;
//! - [`telemetry`]: the NVML sampler, metrics windows, queue health, Prometheus, the
//!   console and the report page;
//! - [`commands`]: every subcommand other than a run.
//!
//! `main` parses the command line and hands over to one of them. Errors end here as one
//! line on stderr and a documented exit code ([`dflash_shared::exit_codes`]).

pub mod cli;
pub mod cluster;
pub mod commands;
pub mod data;
pub mod error;
pub mod export_tool;
pub mod nproc;
pub mod run;
pub mod shell;
pub mod state;
pub mod telemetry;
pub mod training;
pub mod violation;
pub mod worker_output;

use dflash_shared::exit_codes;

use crate::cli::{BenchCommand, Cli, Command};
use crate::commands::bench;
use crate::error::Error;
use crate::run::reaper;
use crate::telemetry::console;

pub fn main() -> i32 {
    // The command line with its --config recipe applied, and which run flags were given
    // (typed, or set by the recipe; not defaults): a resumed run lets those win or refuses
    // them.
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let (cli, given) = match run::config_file::parse(&argv) {
        Ok(c) => (c.cli, c.given),
        Err(run::config_file::CommandLineError::Clap(e)) => return clap_exit(e),
        Err(run::config_file::CommandLineError::Config(e)) => {
            crate::say!("dflash-supervise: error: {e}");
            return e.exit_code();
        }
    };
    console::init();
    // The commands that print a listing or a table (`status | head`) end quietly when the
    // reader goes, as Unix tools do, instead of panicking on the write. A run, `logs -f`
    // (which handles it) and the helper processes keep SIGPIPE ignored.
    if !matches!(
        cli.command,
        None | Some(Command::Logs(_))
            | Some(Command::ClusterCheck(_))
            | Some(Command::ClusterPeer { .. })
            | Some(Command::Bench(BenchCommand::Cluster { .. }))
            | Some(Command::BenchPeer { .. })
            | Some(Command::Reap)
    ) {
        // SAFETY: restoring the default disposition of one signal, before any thread starts.
        let _ = unsafe {
            nix::sys::signal::signal(
                nix::sys::signal::Signal::SIGPIPE,
                nix::sys::signal::SigHandler::SigDfl,
            )
        };
    }
    let result = dispatch(cli, &given, &argv);
    match result {
        Ok(code) => code,
        Err(e) => {
            crate::say!("dflash-supervise: error: {e}");
            e.exit_code()
        }
    }
}

/// The command line's command, run.
fn dispatch(cli: Cli, given: &[String], argv: &[std::ffi::OsString]) -> Result<i32, Error> {
    match cli.command {
        None => run::run(cli.run, given),
        Some(Command::Logs(a)) => commands::logs::run(a),
        Some(Command::Status(a)) => commands::status::run(a),
        Some(Command::Report {
            run_dir,
            out,
            watch,
        }) => commands::report::run(run_dir, out, watch),
        Some(Command::Ledger(a)) => commands::ledger::run(a),
        Some(Command::ClusterCheck(a)) => commands::cluster_check::run(a),
        Some(Command::Gpus { json }) => commands::gpus::run(json),
        Some(Command::Plan(a)) => commands::plan::run(*a, argv),
        Some(Command::Prepare(a)) => commands::prepare::prepare(a),
        Some(Command::Export(a)) => commands::export::run(a),
        Some(Command::ExportCheck(a)) => commands::export_check::run(a),
        Some(Command::Eval(a)) => commands::eval::run(a),
        Some(Command::Regenerate(a)) => commands::regenerate::run(a),
        Some(Command::Bench(BenchCommand::Prepare {
            json,
            tokenizer,
            conversations,
        })) => commands::prepare::bench(json, tokenizer, conversations),
        Some(Command::Bench(BenchCommand::Ipc { json, quick })) => bench::ipc::run(json, quick),
        Some(Command::Bench(BenchCommand::Compute {
            json,
            target,
            tokens,
        })) => bench::compute::run(json, &target, tokens),
        Some(Command::Bench(BenchCommand::Train {
            json,
            splits: true,
            split_seconds,
            ..
        })) => bench::splits::run(json, split_seconds),
        Some(Command::Bench(BenchCommand::Train {
            json,
            steps,
            target_engine,
            ..
        })) => bench::train::run(json, steps, target_engine),
        Some(Command::Bench(BenchCommand::Report {
            json,
            steps,
            gpus,
            no_chromium,
        })) => commands::bench::report::run(json, steps, gpus, !no_chromium),
        Some(Command::Bench(BenchCommand::Kernels { json, arch })) => {
            bench::kernels::run(json, &arch)
        }
        Some(Command::Bench(BenchCommand::Telemetry { json, seconds })) => {
            bench::telemetry::run(json, seconds)
        }
        Some(Command::BenchPeer { server }) => Ok(bench::ipc::peer(&server)),
        Some(Command::ClusterPeer {
            leader,
            node_rank,
            ranks,
            run_dir,
        }) => bench::cluster::peer(&leader, &run_dir, node_rank, ranks),
        Some(Command::Bench(BenchCommand::Cluster {
            json,
            followers,
            steps,
            ranks,
        })) => bench::cluster::run(json, followers, steps, ranks),
        Some(Command::Reap) => Ok(reaper::run()),
    }
}

/// Help and version go to stdout with exit 0; usage errors become one line and exit 2.
fn clap_exit(e: clap::Error) -> i32 {
    use clap::error::ErrorKind;
    match e.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
            let _ = e.print();
            exit_codes::SUCCESS
        }
        _ => {
            crate::say!(
                "dflash-supervise: error: {} (see --help)",
                cli::error_line(&e)
            );
            exit_codes::USAGE
        }
    }
}
