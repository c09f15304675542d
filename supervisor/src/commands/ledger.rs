//! `dflash-supervise ledger`: audit a run's batch ledger.

use crate::cluster::journal::{audit as job_audit, JobAudit, JOB_LEDGER_FILE};
use crate::data::ledger::{audit, LEDGER_FILE};
use crate::error::Error;

/// `dflash-supervise ledger`.
pub fn run(args: crate::cli::LedgerArgs) -> Result<i32, Error> {
    let run = crate::run::rundir::ExistingRun::open(args.run_dir.as_deref())?;
    let a = audit(&run.path.join(LEDGER_FILE))?;
    // A job across nodes: its leader's job.jsonl, over every node.
    let job_file = run.path.join(JOB_LEDGER_FILE);
    let job = match job_file.is_file() {
        true => Some(job_audit(&job_file)?),
        false => None,
    };
    let job_bad = job
        .as_ref()
        .is_some_and(|j| j.duplicated > 0 || j.missing > 0);
    if args.json {
        let mut v = serde_json::to_value(&a).map_err(|e| Error::json("the ledger audit", e))?;
        if let Some(j) = &job {
            v["job"] = serde_json::to_value(j).map_err(|e| Error::json("the job's audit", e))?;
        }
        println!(
            "{}",
            serde_json::to_string_pretty(&v).map_err(|e| Error::json("the ledger audit", e))?
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
    if let (Some(j), false) = (&job, args.json) {
        say_job(j);
    }
    Ok(if a.lost > 0 || a.duplicated > 0 || job_bad {
        dflash_shared::exit_codes::RUN_FAILED
    } else {
        dflash_shared::exit_codes::SUCCESS
    })
}

/// The job's audit (`job.jsonl`: every node's batches, as the leader committed them).
fn say_job(j: &JobAudit) {
    println!("job across nodes (job.jsonl; the lines above are this node's own)");
    println!("  nodes            {}", j.nodes);
    println!("  steps            {}", j.steps);
    println!("  consumed once    {}", j.consumed_once);
    println!("  duplicated       {}", j.duplicated);
    match (j.data_batches, j.done) {
        (Some(n), true) => println!(
            "  missing          {} (of the data's {n} batches)",
            j.missing
        ),
        (Some(n), false) => println!("  data             {n} batches (the job is not done)"),
        (None, _) => println!("  data             its length not reached yet"),
    }
    if j.losses > 0 || j.resumes > 0 {
        println!("  nodes lost       {}; resumed {}", j.losses, j.resumes);
    }
}
