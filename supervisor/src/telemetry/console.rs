//! The supervisor's own log: every record goes to stderr and, once the run dir exists, to
//! `supervisor.log` with a timestamp. On a terminal, a live status line sits under the
//! log: step N/M with a bar, elapsed time, ETA and the run's figures, fitted to the
//! terminal's width (read at every redraw, and redrawn at once on SIGWINCH) by dropping
//! the least important parts rather than wrapping; log records and `--tee`'s worker lines
//! print above it, and the run's end clears it. Elsewhere the run prints plain step lines.

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::run::rundir::now_rfc3339;

struct Logger {
    file: Mutex<Option<File>>,
    /// The live status line, when stderr is a terminal and a run is showing one.
    live: Mutex<Live>,
    tty: bool,
}

/// Whether a live status line is shown (stderr is a terminal).
pub fn live() -> bool {
    LOGGER.get().is_some_and(|l| l.tty)
}

/// What the live status line shows: the optimizer step, out of how many when the schedule
/// knows, the step this session started from, and the run's figures.
#[derive(Debug, Clone, PartialEq)]
pub struct Status {
    pub step: u64,
    pub total: Option<u64>,
    /// The step this session started from (0, or the resumed checkpoint's): the ETA counts
    /// only the steps trained after it.
    pub base: u64,
    /// The figures (loss, acceptance, tokens/s, ...), most important first: a narrow
    /// terminal drops them from the last.
    pub figures: Vec<String>,
}

/// The live line's state: what it shows, what of it is on the screen, and this session's
/// clock and pace.
#[derive(Default)]
struct Live {
    status: Option<Status>,
    /// Columns of the line on the screen (0: none drawn).
    drawn: usize,
    /// When this session's line first showed (its elapsed time).
    since: Option<Instant>,
    pace: Pace,
}

/// Columns left free at the line's end: the terminal's echo of a Ctrl-C (`^C`) lands
/// there instead of wrapping the line onto a second row that would outlive it.
const ECHO_ROOM: usize = 3;

/// The bar's width, in cells.
const BAR: usize = 20;

/// This session's pace, for the ETA: the first step it saw trained in this session (after
/// the step it started from) and when.
#[derive(Debug, Default)]
struct Pace {
    first: Option<(u64, Instant)>,
}

impl Pace {
    /// The time left to step `total` at this session's pace: the steps trained since the
    /// first one seen after `base`, over the time since. Steps before `base` (a
    /// `--resume`'s) were not trained in this session and do not count. `None` until two
    /// steps of this session were seen.
    fn eta(&mut self, base: u64, step: u64, total: u64, now: Instant) -> Option<Duration> {
        if step >= total {
            return Some(Duration::ZERO);
        }
        if step <= base {
            return None;
        }
        // The first step seen; a rollback back past it measures again from here.
        if self.first.is_none_or(|(s0, _)| step < s0) {
            self.first = Some((step, now));
        }
        let (s0, t0) = self.first.unwrap_or((step, now));
        let secs = now.saturating_duration_since(t0).as_secs_f64();
        if step == s0 || secs <= 0.0 {
            return None;
        }
        let per_step = secs / (step - s0) as f64;
        Some(Duration::from_secs_f64(per_step * (total - step) as f64))
    }
}

/// A duration as the line shows it: `42s`, `3m05s`, `2h03m`.
fn short(d: Duration) -> String {
    let s = d.as_secs_f64().round() as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, s / 60 % 60),
    }
}

/// `[=====>     ]`: `step` of `total`.
fn bar(step: u64, total: u64) -> String {
    let done = if total == 0 {
        BAR
    } else {
        (step.min(total) as u128 * BAR as u128 / total as u128) as usize
    };
    let head = if done < BAR { ">" } else { "" };
    let rest = BAR - done - head.len();
    format!("[{}{head}{}]", "=".repeat(done), " ".repeat(rest))
}

/// The status line, fitted into `width` columns (`None`: no limit): `step N/M [bar]
/// elapsed ETA t | figures` (`step N elapsed | figures` without a total). What does not
/// fit goes, least important first: the bar, the figures from the last, the elapsed time,
/// the ETA; a width too narrow even for the step cuts the line.
fn render(st: &Status, elapsed: Duration, eta: Option<Duration>, width: Option<usize>) -> String {
    let step = match st.total {
        Some(t) => format!("step {}/{t}", st.step),
        None => format!("step {}", st.step),
    };
    let eta = st.total.map(|_| match eta {
        Some(d) => format!("ETA {}", short(d)),
        None => "ETA —".to_string(),
    });
    let line = |bar_shown: bool, figures: usize, elapsed_shown: bool, eta_shown: bool| {
        let mut head = vec![step.clone()];
        head.extend(st.total.filter(|_| bar_shown).map(|t| bar(st.step, t)));
        head.extend(elapsed_shown.then(|| short(elapsed)));
        head.extend(eta.clone().filter(|_| eta_shown));
        let mut parts = vec![head.join(" ")];
        parts.extend(st.figures[..figures].iter().cloned());
        parts.join(" | ")
    };
    let n = st.figures.len();
    let layouts = std::iter::once((true, n, true, true))
        .chain((0..=n).rev().map(|k| (false, k, true, true)))
        .chain([(false, 0, false, true), (false, 0, false, false)]);
    let mut last = String::new();
    for (b, k, e, t) in layouts {
        last = line(b, k, e, t);
        if width.is_none_or(|w| last.chars().count() <= w) {
            return last;
        }
    }
    last.chars().take(width.unwrap_or(0)).collect()
}

/// The width of the terminal on stderr, in columns (`None`: not a terminal, or one that
/// does not say).
fn terminal_width() -> Option<usize> {
    let mut ws = libc::winsize {
        ws_row: 0,
        ws_col: 0,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCGWINSZ writes the winsize it is given and nothing else.
    let ok = unsafe { libc::ioctl(libc::STDERR_FILENO, libc::TIOCGWINSZ, &mut ws) } == 0;
    (ok && ws.ws_col > 0).then_some(ws.ws_col as usize)
}

impl Live {
    /// Erase the line on the screen, on every row it takes at the terminal's width now: a
    /// terminal made narrower since it was drawn wraps it onto more rows.
    fn erase(&mut self, out: &mut String, cols: Option<usize>) {
        if self.drawn == 0 {
            return;
        }
        let rows = cols.map_or(1, |c| self.drawn.div_ceil(c).max(1));
        out.push_str("\r\x1b[2K");
        for _ in 1..rows {
            out.push_str("\x1b[1A\x1b[2K");
        }
        self.drawn = 0;
    }

    /// Draw the line (after erasing what is on the screen) at the terminal's width now.
    fn draw(&mut self, out: &mut String) {
        let cols = terminal_width();
        self.erase(out, cols);
        let Some(st) = &self.status else {
            return;
        };
        let now = Instant::now();
        let since = *self.since.get_or_insert(now);
        let eta = st
            .total
            .and_then(|t| self.pace.eta(st.base, st.step, t, now));
        let width = cols.map(|c| c.saturating_sub(ECHO_ROOM).max(1));
        let line = render(st, now.saturating_duration_since(since), eta, width);
        self.drawn = line.chars().count();
        out.push_str(&line);
    }
}

/// Write `s` to stderr (best effort: a stderr gone away must not stop the run).
fn write_err(s: &str) {
    if !s.is_empty() {
        let mut e = std::io::stderr().lock();
        let _ = e.write_all(s.as_bytes());
        let _ = e.flush();
    }
}

/// Show or update the live status line (`None` clears it, for good until the next one).
/// No-op when stderr is not a terminal.
pub fn status(line: Option<Status>) {
    let Some(l) = LOGGER.get().filter(|l| l.tty) else {
        return;
    };
    let Ok(mut live) = l.live.lock() else {
        return;
    };
    let mut out = String::new();
    match line {
        Some(st) => {
            live.status = Some(st);
            live.draw(&mut out);
            redraw_on_resize();
        }
        None => {
            live.erase(&mut out, terminal_width());
            *live = Live::default();
        }
    }
    write_err(&out);
}

/// Redraw the line, fitted anew, whenever the terminal is resized (SIGWINCH), from a
/// thread of its own started with the first line.
fn redraw_on_resize() {
    static STARTED: std::sync::Once = std::sync::Once::new();
    STARTED.call_once(|| {
        let Ok(mut signals) = signal_hook::iterator::Signals::new([libc::SIGWINCH]) else {
            return;
        };
        let _ = std::thread::Builder::new()
            .name("resize".into())
            .spawn(move || {
                for _ in signals.forever() {
                    let Some(l) = LOGGER.get() else { continue };
                    let Ok(mut live) = l.live.lock() else {
                        continue;
                    };
                    if live.status.is_some() {
                        let mut out = String::new();
                        live.draw(&mut out);
                        write_err(&out);
                    }
                }
            });
    });
}

/// Run `print` with the status line lifted (it is drawn again after), so that what it
/// writes lands above the line instead of running into it.
fn above(print: impl FnOnce()) {
    let live = LOGGER
        .get()
        .filter(|l| l.tty)
        .and_then(|l| l.live.lock().ok());
    let Some(mut live) = live.filter(|l| l.drawn > 0) else {
        return print();
    };
    let mut out = String::new();
    live.erase(&mut out, terminal_width());
    write_err(&out);
    print();
    out.clear();
    live.draw(&mut out);
    write_err(&out);
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
    above(|| {
        let _ = std::io::stderr().lock().write_fmt(args);
    });
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
        live: Mutex::new(Live::default()),
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

    fn status(step: u64, total: Option<u64>) -> Status {
        Status {
            step,
            total,
            base: 0,
            figures: [
                "loss 3.123",
                "accept 1.50",
                "150 tok/s",
                "GPU 80%",
                "hidden pool 25% full",
                "restarts 0",
            ]
            .map(String::from)
            .to_vec(),
        }
    }

    #[test]
    fn the_status_line_fits_the_width_dropping_the_least_important_parts_first() {
        let st = status(12, Some(100));
        let (el, eta) = (Duration::from_secs(65), Some(Duration::from_secs(200)));
        let full = "step 12/100 [==>                 ] 1m05s ETA 3m20s | loss 3.123 | accept 1.50 | 150 tok/s | GPU 80% | hidden pool 25% full | restarts 0";
        assert_eq!(render(&st, el, eta, None), full);
        assert_eq!(render(&st, el, eta, Some(200)), full);
        // The bar goes first, then the figures from the last.
        assert_eq!(
            render(&st, el, eta, Some(112)),
            "step 12/100 1m05s ETA 3m20s | loss 3.123 | accept 1.50 | 150 tok/s | GPU 80% | hidden pool 25% full | restarts 0"
        );
        assert_eq!(
            render(&st, el, eta, Some(57)),
            "step 12/100 1m05s ETA 3m20s | loss 3.123 | accept 1.50"
        );
        // Then the elapsed time, the ETA, and at last the step itself is cut.
        assert_eq!(render(&st, el, eta, Some(24)), "step 12/100 ETA 3m20s");
        assert_eq!(render(&st, el, eta, Some(12)), "step 12/100");
        assert_eq!(render(&st, el, eta, Some(6)), "step 1");
        for w in 1..=full.len() + 1 {
            let line = render(&st, el, eta, Some(w));
            assert!(line.chars().count() <= w, "{w}: {line}");
        }
        // No schedule length: no bar, no ETA.
        assert_eq!(
            render(&status(7, None), el, None, Some(40)),
            "step 7 1m05s | loss 3.123 | accept 1.50"
        );
        // An ETA not measured yet.
        assert_eq!(
            render(&status(1, Some(100)), el, None, Some(40)),
            "step 1/100 1m05s ETA — | loss 3.123"
        );
    }

    #[test]
    fn the_eta_counts_only_the_steps_of_this_session() {
        // Resumed at step 900 of 1000; this session trains a step a second.
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut pace = Pace::default();
        assert_eq!(pace.eta(900, 900, 1000, at(0)), None);
        assert_eq!(pace.eta(900, 905, 1000, at(5)), None);
        // 75 steps left at a step a second: 75 s (not the 3 s that counting the 905
        // steps before it over this session's 5 s would give).
        assert_eq!(
            pace.eta(900, 925, 1000, at(25)),
            Some(Duration::from_secs(75))
        );
        // A rollback past the first step seen measures again from there.
        assert_eq!(pace.eta(900, 902, 1000, at(30)), None);
        assert_eq!(
            pace.eta(900, 904, 1000, at(32)),
            Some(Duration::from_secs(96))
        );
        assert_eq!(pace.eta(900, 1000, 1000, at(40)), Some(Duration::ZERO));
    }

    #[test]
    fn a_duration_is_short() {
        assert_eq!(short(Duration::from_secs(42)), "42s");
        assert_eq!(short(Duration::from_secs(185)), "3m05s");
        assert_eq!(short(Duration::from_secs(7380)), "2h03m");
    }

    #[test]
    fn the_line_is_erased_on_every_row_a_narrower_terminal_wraps_it_onto() {
        let mut live = Live {
            drawn: 57,
            ..Live::default()
        };
        let mut out = String::new();
        live.erase(&mut out, Some(60));
        assert_eq!(out, "\r\x1b[2K");
        live.drawn = 57;
        out.clear();
        live.erase(&mut out, Some(25));
        assert_eq!(out, "\r\x1b[2K\x1b[1A\x1b[2K\x1b[1A\x1b[2K");
        // Nothing drawn, nothing erased.
        out.clear();
        live.erase(&mut out, Some(25));
        assert_eq!(out, "");
    }
}
