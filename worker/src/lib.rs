//! `dflash-worker`: one worker process of a dflash-supervise run, on one device.
//!
//! The supervisor starts it with `--control NAME` and its identity in the environment
//! (`DFLASH_ROLE`, `DFLASH_RANK`, `DFLASH_GPU`, ...). It connects back over ipc-channel,
//! says hello, and runs its role loop, heartbeating as it makes progress. It exits 0 when
//! asked to shut down (control message or SIGTERM), and exits when the control channel
//! closes: a worker never outlives its supervisor.

pub mod compute;
mod identity;
pub mod model;
mod plane;
mod role;

use clap::Parser;
use dflash_shared::exit_codes;

pub use identity::Identity;

/// A DFlash worker process. It is started by dflash-supervise, not by hand.
#[derive(Debug, Parser)]
#[command(name = "dflash-worker", version)]
struct Cli {
    /// Name of the supervisor's control server to connect to (given by dflash-supervise).
    #[arg(long, value_name = "NAME")]
    control: String,
}

pub fn main() -> i32 {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                let _ = e.print();
                return exit_codes::SUCCESS;
            }
            let text = e.render().to_string();
            let first = text.lines().next().unwrap_or("invalid command line");
            eprintln!("dflash-worker: {first} (dflash-worker is started by dflash-supervise)");
            return exit_codes::USAGE;
        }
    };
    let id = match Identity::from_env() {
        Ok(id) => id,
        Err(e) => {
            eprintln!("dflash-worker: error: {e}");
            return exit_codes::USAGE;
        }
    };
    match role::run(&cli.control, &id) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("dflash-worker {}: error: {e:#}", id.name);
            1
        }
    }
}
