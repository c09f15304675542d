//! The supervisor's own log: every record goes to stderr and, once the run dir exists, to
//! `supervisor.log` with a timestamp.

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::sync::{Mutex, OnceLock};

use crate::rundir::now_rfc3339;

struct Logger {
    file: Mutex<Option<File>>,
}

static LOGGER: OnceLock<Logger> = OnceLock::new();

pub fn init() {
    let logger = LOGGER.get_or_init(|| Logger { file: Mutex::new(None) });
    if log::set_logger(logger).is_ok() {
        log::set_max_level(log::LevelFilter::Info);
    }
}

/// Also write to this file from now on.
pub fn to_file(path: &Path) -> std::io::Result<()> {
    let f = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
    if let Some(l) = LOGGER.get() {
        if let Ok(mut g) = l.file.lock() {
            *g = Some(f);
        }
    }
    Ok(())
}

impl log::Log for Logger {
    fn enabled(&self, m: &log::Metadata) -> bool {
        m.level() <= log::Level::Info
    }

    fn log(&self, r: &log::Record) {
        if !self.enabled(r.metadata()) {
            return;
        }
        let level = match r.level() {
            log::Level::Error => "error: ",
            log::Level::Warn => "warning: ",
            _ => "",
        };
        let _ = writeln!(std::io::stderr().lock(), "[supervisor] {level}{}", r.args());
        if let Ok(mut g) = self.file.lock() {
            if let Some(f) = g.as_mut() {
                let _ = writeln!(f, "{} {:<5} {}", now_rfc3339(), r.level(), r.args());
            }
        }
    }

    fn flush(&self) {}
}
