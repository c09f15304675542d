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

/// Progress through an input of known size (or not: stdin): on a terminal a bar with the
/// bytes read, items per second and the ETA; elsewhere a plain line every
/// [`PLAIN_EVERY`], so a long `prepare` in a log is not silent either.
pub struct ByteProgress {
    bar: Option<ProgressBar>,
    what: &'static str,
    items: &'static str,
    total: Option<u64>,
    started: std::time::Instant,
    said: std::time::Instant,
}

/// How often a plain progress line is printed off a terminal.
pub const PLAIN_EVERY: Duration = Duration::from_secs(30);

impl ByteProgress {
    /// Progress of `what` (e.g. "prepare") through `total` bytes, counting `items`.
    pub fn new(what: &'static str, items: &'static str, total: Option<u64>) -> ByteProgress {
        use std::io::IsTerminal;
        let bar = std::io::stderr().is_terminal().then(|| {
            let (b, t) = match total {
                Some(n) => (
                    ProgressBar::new(n),
                    "{prefix} [{bar:30.cyan/blue}] {bytes}/{total_bytes} {bytes_per_sec} ETA {eta} | {msg}",
                ),
                None => (
                    ProgressBar::new_spinner(),
                    "{prefix} {spinner} {bytes} {bytes_per_sec} | {msg}",
                ),
            };
            b.set_draw_target(ProgressDrawTarget::stderr_with_hz(4));
            b.set_style(
                ProgressStyle::with_template(t)
                    .unwrap_or_else(|_| ProgressStyle::default_bar())
                    .progress_chars("=> "),
            );
            b.set_prefix(what);
            b
        });
        let now = std::time::Instant::now();
        ByteProgress {
            bar,
            what,
            items,
            total,
            started: now,
            said: now,
        }
    }

    /// `bytes` read so far and `n` items made of them.
    pub fn update(&mut self, bytes: u64, n: u64) {
        let secs = self.started.elapsed().as_secs_f64().max(1e-9);
        let rate = format!("{n} {} ({:.0}/s)", self.items, n as f64 / secs);
        if let Some(b) = &self.bar {
            b.set_position(bytes);
            b.set_message(rate);
            return;
        }
        if self.said.elapsed() < PLAIN_EVERY {
            return;
        }
        self.said = std::time::Instant::now();
        let line = plain_progress(self.what, self.items, bytes, self.total, n, secs);
        say(format_args!("{line}\n"));
    }
}

/// The plain progress line: bytes read (of how many, with the share and the ETA when the
/// size is known), items and their rate.
pub fn plain_progress(
    what: &str,
    items: &str,
    bytes: u64,
    total: Option<u64>,
    n: u64,
    secs: f64,
) -> String {
    let share = total
        .filter(|&t| t > 0)
        .map(|t| {
            let f = bytes as f64 / t as f64;
            let eta = if f > 0.0 { secs / f - secs } else { f64::NAN };
            format!(
                " of {:.1} MB ({:.0}%), ETA {}",
                t as f64 / 1e6,
                f * 100.0,
                if eta.is_finite() {
                    humantime::format_duration(Duration::from_secs(eta.round() as u64)).to_string()
                } else {
                    "—".into()
                }
            )
        })
        .unwrap_or_default();
    format!(
        "{what}: {:.1} MB read{share}, {n} {items} ({:.0}/s)",
        bytes as f64 / 1e6,
        n as f64 / secs.max(1e-9)
    )
}

impl Drop for ByteProgress {
    fn drop(&mut self) {
        if let Some(b) = self.bar.take() {
            b.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plain_progress_line_says_how_far_how_fast_and_how_long_to_go() {
        assert_eq!(
            plain_progress(
                "prepare",
                "samples",
                250_000_000,
                Some(1_000_000_000),
                5000,
                30.0
            ),
            "prepare: 250.0 MB read of 1000.0 MB (25%), ETA 1m 30s, 5000 samples (167/s)"
        );
        assert_eq!(
            plain_progress("prepare", "samples", 2_000_000, None, 10, 2.0),
            "prepare: 2.0 MB read, 10 samples (5/s)"
        );
    }
}
