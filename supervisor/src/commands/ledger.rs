//! `dflash-supervise ledger`: audit a run's batch ledger.

use crate::data::ledger::{audit, LEDGER_FILE};
use crate::error::Error;

/// `dflash-supervise ledger`.
pub fn run(args: crate::cli::LedgerArgs) -> Result<i32, Error> {
    let run = crate::run::rundir::ExistingRun::open(args.run_dir.as_deref())?;
    let a = audit(&run.path.join(LEDGER_FILE))?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&a).map_err(|e| Error::json("the ledger audit", e))?
        );
    } else {
        println!("ledger of {}", run.path.display());
        println!("  produced         {}", a.produced);
        println!("  consumed once    {}", a.consumed_once);
        println!(
            "  in flight        {}{}",
            a.in_flight,
            if a.ended {
                ""
            } else {
                " (the run has not recorded its end)"
            }
        );
        if a.loaded_ahead > 0 {
            println!(
                "  loaded ahead     {} (held when the run finished: never needed)",
                a.loaded_ahead
            );
        }
        println!("  lost             {}", a.lost);
        println!("  duplicated       {}", a.duplicated);
        println!(
            "  requeued         {} (given back when the worker holding them ended)",
            a.requeued
        );
        println!("  dropped copies   {}", a.duplicates_dropped);
        if a.rollbacks > 0 {
            println!("  rollbacks        {} ({} consumptions abandoned with their lineage, then consumed again)", a.rollbacks, a.abandoned);
        }
        if a.torn_lines > 0 {
            println!(
                "  torn lines       {} (cut short by a crash, set aside)",
                a.torn_lines
            );
        }
    }
    Ok(if a.lost > 0 || a.duplicated > 0 {
        dflash_shared::exit_codes::RUN_FAILED
    } else {
        dflash_shared::exit_codes::SUCCESS
    })
}
