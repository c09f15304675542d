//! The supervisor's own log: every record goes to stderr and, once the run dir exists, to
//! `supervisor.log` with a timestamp. On a terminal, a live status line (indicatif) sits
//! under the log: step N/M with a bar, elapsed time, ETA and the run's figures; log
//! records and `--tee`'s worker lines print above it. Elsewhere the run prints plain
//! periodic step lines.

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::run::rundir::now_rfc3339;

struct Logger {
    file: Mutex<Option<File>>,
    /// The live status line, when stderr is a terminal and a run is showing one.
    bar: Mutex<Option<ProgressBar>>,
    tty: bool,
}

/// Whether a live status line is shown (stderr is a terminal).
pub fn live() -> bool {
    LOGGER.get().is_some_and(|l| l.tty)
}

/// What the live status line shows: the optimizer step, out of how many when the schedule
/// knows, and the run's figures (loss, acceptance, tokens/s, ...).
#[derive(Debug, Clone, PartialEq)]
pub struct Status {
    pub step: u64,
    pub total: Option<u64>,
    pub figures: String,
}

/// The status line's look: with a known total, a bar, elapsed time and ETA; without one,
/// a spinner and the elapsed time.
fn style(total: Option<u64>) -> ProgressStyle {
    let t = match total {
        Some(_) => "step {pos}/{len} [{bar:20.cyan/blue}] {elapsed} ETA {eta} | {msg}",
        None => "{spinner} step {pos} | {elapsed} | {msg}",
    };
    ProgressStyle::with_template(t)
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ")
}

/// Show or update the live status line (`None` clears it). No-op when stderr is not a
/// terminal.
pub fn status(line: Option<Status>) {
    let Some(l) = LOGGER.get().filter(|l| l.tty) else {
        return;
    };
    let Ok(mut bar) = l.bar.lock() else {
        return;
    };
    let Some(st) = line else {
        if let Some(b) = bar.take() {
            b.finish_and_clear();
        }
        return;
    };
    let b = bar.get_or_insert_with(|| {
        let b = ProgressBar::with_draw_target(st.total, ProgressDrawTarget::stderr_with_hz(4))
            .with_style(style(st.total))
            .with_position(st.step);
        // The elapsed time and the spinner move between updates.
        b.enable_steady_tick(Duration::from_millis(500));
        b
    });
    if b.length() != st.total {
        b.set_style(style(st.total));
        match st.total {
            Some(n) => b.set_length(n),
            None => b.unset_length(),
        }
    }
    b.set_position(st.step);
    b.set_message(st.figures);
}

/// Run `print` with the status line lifted (it is drawn again after), so that what it
/// writes lands above the line instead of running into it.
fn above(print: impl FnOnce()) {
    let bar = LOGGER
        .get()
        .filter(|l| l.tty)
        .and_then(|l| l.bar.lock().ok().and_then(|b| b.clone()));
    match bar {
        Some(b) => b.suspend(print),
        None => print(),
    }
}

/// A line on stdout (a `--tee` worker line), above the status line on a terminal. Best
/// effort: a closed stdout must not stop the run.
pub fn out_line(text: &str) {
    above(|| {
        let _ = writeln!(std::io::stdout().lock(), "{text}");
    });
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
        bar: Mutex::new(None),
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
        above(|| {
            let _ = writeln!(std::io::stderr().lock(), "[supervisor] {level}{}", r.args());
        });
        if let Ok(mut g) = self.file.lock() {
            if let Some(f) = g.as_mut() {
                let _ = writeln!(f, "{} {:<5} {}", now_rfc3339(), r.level(), r.args());
            }
        }
    }

    fn flush(&self) {}
}
