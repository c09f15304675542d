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

pub mod child;
pub mod cli;
pub mod commands;
pub mod data;
pub mod error;
pub mod export_tool;
pub mod nproc;
pub mod run;
pub mod shell;
pub mod telemetry;
pub mod training;
pub mod violation;
pub mod worker_output;

use clap::{CommandFactory, FromArgMatches};
use dflash_shared::exit_codes;

use crate::cli::{BenchCommand, Cli, Command};
use crate::commands::bench;
use crate::run::reaper;
use crate::telemetry::console;

pub fn main() -> i32 {
    let matches = match Cli::command().try_get_matches() {
        Ok(m) => m,
        Err(e) => return clap_exit(e),
    };
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(c) => c,
        Err(e) => return clap_exit(e),
    };
    // Which run flags were typed (not defaults): a resumed run lets those win or refuses them.
    let given: Vec<String> = matches
        .ids()
        .filter(|id| {
            matches.value_source(id.as_str()) == Some(clap::parser::ValueSource::CommandLine)
        })
        .map(|id| id.as_str().to_string())
        .collect();
    console::init();
    // The commands that print a listing or a table (`status | head`) end quietly when the
    // reader goes, as Unix tools do, instead of panicking on the write. A run, `logs -f`
    // (which handles it) and the helper processes keep SIGPIPE ignored.
    if !matches!(
        cli.command,
        None | Some(Command::Logs(_)) | Some(Command::BenchPeer { .. }) | Some(Command::Reap)
    ) {
        // SAFETY: restoring the default disposition of one signal, before any thread starts.
        let _ = unsafe {
            nix::sys::signal::signal(
                nix::sys::signal::Signal::SIGPIPE,
                nix::sys::signal::SigHandler::SigDfl,
            )
        };
    }
    let result = match cli.command {
        None => run::run(cli.run, &given),
        Some(Command::Logs(a)) => commands::logs::run(a),
        Some(Command::Status(a)) => commands::status::run(a),
        Some(Command::Report {
            run_dir,
            out,
            watch,
        }) => commands::report::run(run_dir, out, watch),
        Some(Command::Ledger(a)) => commands::ledger::run(a),
        Some(Command::Gpus { json }) => commands::gpus::run(json),
        Some(Command::Prepare(a)) => commands::prepare::prepare(a),
        Some(Command::Export(a)) => commands::export::run(a),
        Some(Command::ExportCheck(a)) => commands::export_check::run(a),
        Some(Command::Eval(a)) => commands::eval::run(a),
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
        Some(Command::Bench(BenchCommand::Train { json, steps })) => bench::train::run(json, steps),
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
        Some(Command::Reap) => Ok(reaper::run()),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            crate::say!("dflash-supervise: error: {e}");
            e.exit_code()
        }
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
            let text = e.render().to_string();
            let mut lines = text.lines().skip_while(|l| l.trim().is_empty());
            let mut first = lines.next().unwrap_or("invalid command line").to_string();
            if first.ends_with(':') {
                // "the following required arguments were not provided:" and the indented
                // lines naming them: one line.
                let named: Vec<&str> = lines
                    .take_while(|l| l.starts_with(' ') && !l.trim().is_empty())
                    .map(str::trim)
                    .collect();
                first = format!("{first} {}", named.join(", "));
            }
            crate::say!("dflash-supervise: {first} (see --help)");
            exit_codes::USAGE
        }
    }
}
