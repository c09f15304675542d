//! The supervisor's own log: every record goes to stderr and, once the run dir exists, to
//! `supervisor.log` with a timestamp. On a terminal, a live status line sits under the log
//! (cleared and redrawn around each record); elsewhere the run prints plain periodic lines.

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::sync::{Mutex, OnceLock};

use crate::run::rundir::now_rfc3339;

struct Logger {
    file: Mutex<Option<File>>,
    /// The live status line, when stderr is a terminal.
    status: Mutex<Option<String>>,
    tty: bool,
}

/// Whether a live status line is shown (stderr is a terminal).
pub fn live() -> bool {
    LOGGER.get().is_some_and(|l| l.tty)
}

/// Replace the live status line (`None` clears it). No-op when stderr is not a terminal.
pub fn status(line: Option<String>) {
    let Some(l) = LOGGER.get().filter(|l| l.tty) else {
        return;
    };
    if let Ok(mut s) = l.status.lock() {
        let mut err = std::io::stderr().lock();
        let _ = write!(err, "\r\x1b[K");
        if let Some(text) = &line {
            let _ = write!(err, "{text}");
        }
        let _ = err.flush();
        *s = line;
    }
}

static LOGGER: OnceLock<Logger> = OnceLock::new();

/// Write to stderr as `eprint!` does, except that a stderr gone away (a `| tee` that died
/// with the Ctrl-C that stops the run, an ssh session dropped) is not a panic: the run
/// still ends with its state, its report and its documented exit code.
pub fn say(args: std::fmt::Arguments) {
    let _ = std::io::stderr().lock().write_fmt(args);
}

/// `eprintln!` through [`say`].
#[macro_export]
macro_rules! say {
    ($($t:tt)*) => {
        $crate::telemetry::console::say(format_args!("{}\n", format_args!($($t)*)))
    };
}

pub fn init() {
    use std::io::IsTerminal;
    let logger = LOGGER.get_or_init(|| Logger {
        file: Mutex::new(None),
        status: Mutex::new(None),
        tty: std::io::stderr().is_terminal(),
    });
    if log::set_logger(logger).is_ok() {
        log::set_max_level(log::LevelFilter::Info);
    }
}

/// Also write to this file from now on.
pub fn to_file(path: &Path) -> std::io::Result<()> {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
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
        {
            let status = self.status.lock().ok().and_then(|s| s.clone());
            let mut err = std::io::stderr().lock();
            if status.is_some() {
                let _ = write!(err, "\r\x1b[K");
            }
            let _ = writeln!(err, "[supervisor] {level}{}", r.args());
            if let Some(line) = status {
                let _ = write!(err, "{line}");
                let _ = err.flush();
            }
        }
        if let Ok(mut g) = self.file.lock() {
            if let Some(f) = g.as_mut() {
                let _ = writeln!(f, "{} {:<5} {}", now_rfc3339(), r.level(), r.args());
            }
        }
    }

    fn flush(&self) {}
}
