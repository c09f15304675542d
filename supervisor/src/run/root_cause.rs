//! The root-cause report printed when a worker spends its restart budget.

use std::fmt::Write;
use std::path::PathBuf;

pub struct Report {
    pub worker: String,
    pub device: String,
    pub last_exit: String,
    pub restarts: u32,
    pub max_restarts: u32,
    pub log_path: PathBuf,
    pub log_tail: Vec<String>,
}

impl Report {
    pub fn render(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "dflash-supervise: run failed: {} kept failing and spent its restart budget (--max-restarts {})",
            self.worker, self.max_restarts
        );
        let _ = writeln!(s, "  worker:    {} (device {})", self.worker, self.device);
        let _ = writeln!(s, "  last exit: {}", self.last_exit);
        let _ = writeln!(s, "  restarts:  {}", self.restarts);
        let _ = writeln!(s, "  log:       {}", self.log_path.display());
        let _ = writeln!(s, "  last {} lines of the log:", self.log_tail.len());
        for l in &self.log_tail {
            let _ = writeln!(s, "    {l}");
        }
        s
    }
}
