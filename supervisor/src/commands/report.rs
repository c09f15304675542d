//! `dflash-supervise report`: write (and with `--watch`, keep rewriting) a run's report page.

use std::path::{Path, PathBuf};

use crate::error::Error;
use crate::telemetry::report::write;

/// What changes when the run writes something new.
fn files_signature(dir: &Path) -> Vec<Option<(u64, std::time::SystemTime)>> {
    ["metrics.jsonl", "events.jsonl"]
        .iter()
        .map(|f| {
            std::fs::metadata(dir.join(f))
                .ok()
                .map(|m| (m.len(), m.modified().unwrap_or(std::time::UNIX_EPOCH)))
        })
        .collect()
}

/// `dflash-supervise report [RUN_DIR] [--out FILE] [--watch]`.
pub fn run(dir: Option<PathBuf>, out: Option<PathBuf>, watch: bool) -> Result<i32, Error> {
    let run = crate::run::rundir::ExistingRun::open(dir.as_deref())?;
    let out = out.unwrap_or_else(|| run.path.join("report.html"));
    write(&run.path, &out)?;
    println!("{}", out.display());
    if !watch {
        return Ok(0);
    }
    if !run.supervisor_alive() {
        eprintln!("dflash-supervise: the run is not live (no supervisor holds its lock): the report is final");
        return Ok(0);
    }
    use std::sync::atomic::{AtomicBool, Ordering};
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone())
            .map_err(|e| Error::start("signal handlers", e))?;
    }
    eprintln!(
        "dflash-supervise: rewriting {} at every metrics window until the run ends (Ctrl-C stops)",
        out.display()
    );
    let mut seen = files_signature(&run.path);
    loop {
        std::thread::sleep(std::time::Duration::from_millis(200));
        if stop.load(Ordering::Relaxed) {
            eprintln!(
                "dflash-supervise: stopped watching; {} holds the last snapshot",
                out.display()
            );
            return Ok(0);
        }
        // Read liveness first: a run that ends between the two reads still gets its last write.
        let alive = run.supervisor_alive();
        let now = files_signature(&run.path);
        if now != seen || !alive {
            seen = now;
            write(&run.path, &out)?;
        }
        if !alive {
            eprintln!(
                "dflash-supervise: the run has ended; {} is final",
                out.display()
            );
            return Ok(0);
        }
    }
}
