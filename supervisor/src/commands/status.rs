//! `dflash-supervise status`: the workers of a run, from its state.json.

use std::time::SystemTime;

use dflash_shared::exit_codes;

use crate::cli::StatusArgs;
use crate::error::Error;
use crate::run::rundir::ExistingRun;

pub fn run(args: StatusArgs) -> Result<i32, Error> {
    let run = ExistingRun::open(args.run_dir.as_deref())?;
    let state = run.state()?;
    let alive = run.supervisor_alive();
    if args.json {
        let mut v = serde_json::to_value(&state).map_err(|e| Error::json("the run state", e))?;
        v["supervisor_alive"] = alive.into();
        println!(
            "{}",
            serde_json::to_string_pretty(&v).map_err(|e| Error::json("the run state", e))?
        );
        return Ok(exit_codes::SUCCESS);
    }
    println!("run:        {}", state.run_dir.display());
    let sup = match (alive, state.exit_code) {
        (true, _) => format!(
            "pid {}, {} (up {})",
            state.supervisor_pid,
            state.phase,
            since(&state.started_at)
        ),
        (false, Some(code)) => format!("ended: {} with exit code {code}", state.phase),
        (false, None) => format!(
            "pid {} is gone without recording an exit (killed?); the pids below are stale",
            state.supervisor_pid
        ),
    };
    println!("supervisor: {sup}");
    println!(
        "batches:    {} consumed of {} loaded",
        state.batches_consumed, state.batches_produced
    );
    if let Some(t) = state.train.as_ref().filter(|t| t.step > 0) {
        let exported = t
            .exported
            .as_deref()
            .map(|d| format!("; drafter written to {d}"))
            .unwrap_or_default();
        println!(
            "training:   step {}, loss {:.4}, acceptance {:.2}, {} drafter rank(s){exported}",
            t.step, t.loss, t.acceptance, t.members
        );
    }
    println!();
    println!(
        "{:<12} {:<8} {:<4} {:>8}  {:<9} {:>8}  {:<8} LAST EXIT",
        "WORKER", "ROLE", "GPU", "PID", "STATE", "RESTARTS", "UP"
    );
    for w in &state.workers {
        let pid = w.pid.map(|p| p.to_string()).unwrap_or_else(|| "-".into());
        let up = if alive {
            w.started_at
                .as_deref()
                .map(since)
                .unwrap_or_else(|| "-".into())
        } else {
            "-".into()
        };
        println!(
            "{:<12} {:<8} {:<4} {:>8}  {:<9} {:>8}  {:<8} {}",
            w.name,
            w.role,
            w.gpu,
            pid,
            w.state,
            w.restarts,
            up,
            w.last_exit.as_deref().unwrap_or("-")
        );
    }
    Ok(exit_codes::SUCCESS)
}

/// "5m 12s" since an RFC 3339 time.
fn since(t: &str) -> String {
    let Ok(then) = humantime::parse_rfc3339(t) else {
        return "-".into();
    };
    let secs = SystemTime::now()
        .duration_since(then)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    humantime::format_duration(std::time::Duration::from_secs(secs)).to_string()
}
