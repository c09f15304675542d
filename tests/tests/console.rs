//! The console: the live status line on a terminal (run under script(1), which gives the
//! run a pseudo-terminal of the size `stty` sets) and the plain step lines off one.

mod common;

use std::io::{Read, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;

const T: Duration = Duration::from_secs(60);

/// The demo run's flags, after `--steps N`.
const DEMO: &str = "--gpus cpu:2 --data demo --max-seq-len 64 --token-budget 512";

/// A run under script(1) on a terminal of `cols` columns; its output collected as it comes.
struct Tty {
    child: Child,
    stdin: Option<ChildStdin>,
    out: Arc<Mutex<Vec<u8>>>,
    reader: Option<std::thread::JoinHandle<()>>,
    _tmp: tempfile::TempDir,
}

impl Tty {
    /// `None` (the test skips) where script(1) is not installed, outside CI.
    fn start(cols: u16, steps: u64) -> Option<Tty> {
        if Command::new("script").arg("--version").output().is_err() {
            assert!(
                std::env::var_os("CI").is_none(),
                "script(1) (util-linux) is missing: under CI this test may not skip"
            );
            eprintln!("SKIPPED: script(1) is not installed");
            return None;
        }
        let tmp = tempfile::tempdir().unwrap();
        let cmd = format!(
            "stty cols {cols} rows 20; exec {} --steps {steps} {DEMO} --run-dir {}",
            bin("dflash-supervise").display(),
            tmp.path().join("run").display()
        );
        let mut child = Command::new("script")
            .args(["-qfec", &cmd, "/dev/null"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let out = Arc::new(Mutex::new(Vec::new()));
        let (sink, mut pipe) = (out.clone(), child.stdout.take().unwrap());
        let reader = std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = pipe.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        });
        Some(Tty {
            stdin: child.stdin.take(),
            child,
            out,
            reader: Some(reader),
            _tmp: tmp,
        })
    }

    fn text(&self) -> String {
        self.text_from(0)
    }

    /// The output from byte `at` on.
    fn text_from(&self, at: usize) -> String {
        String::from_utf8_lossy(&self.out.lock().unwrap()[at..]).into_owned()
    }

    /// Bytes of output so far.
    fn len(&self) -> usize {
        self.out.lock().unwrap().len()
    }

    /// Wait for the run (script exits with its code) and for the last of its output.
    fn wait(&mut self) -> (Option<i32>, String) {
        let code = wait_for("the run's end", T, || self.child.try_wait().unwrap());
        drop(self.stdin.take());
        // script has exited: its output pipe is at its end, and the reader with it.
        if let Some(r) = self.reader.take() {
            r.join().unwrap();
        }
        (code.code(), self.text())
    }

    /// The supervisor (script's child, the shell that exec'd it).
    fn supervisor(&self) -> u32 {
        let pid = self.child.id();
        wait_for("the supervisor under script", T, || {
            let kids = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).ok()?;
            let kid: u32 = kids.split_whitespace().next()?.parse().ok()?;
            let exe = std::fs::read_link(format!("/proc/{kid}/exe")).ok()?;
            exe.ends_with("dflash-supervise").then_some(kid)
        })
    }
}

impl Drop for Tty {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The text without its escape sequences (CSI `ESC [ ... final`, and two-byte `ESC x`).
fn strip_escapes(text: &str) -> String {
    let mut out = String::new();
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '\x1b' {
            out.push(c);
            continue;
        }
        if chars.next() == Some('[') {
            for f in chars.by_ref() {
                if ('\x40'..='\x7e').contains(&f) {
                    break;
                }
            }
        }
    }
    out
}

/// Every rendering of the status line in `text`: what follows each `\r` or `\n`, up to the
/// next, that starts `step N`.
fn renderings(text: &str) -> Vec<String> {
    strip_escapes(text)
        .split(['\r', '\n'])
        .filter(|s| {
            s.strip_prefix("step ")
                .is_some_and(|r| r.starts_with(|c: char| c.is_ascii_digit()))
        })
        .map(str::to_string)
        .collect()
}

/// What a terminal of `cols` columns shows after `text`, every row it ever wrote (those
/// scrolled off too): printing wraps at the last column, `\r`, `\n`, erase line (`ESC[2K`,
/// `ESC[K`), erase below (`ESC[J`) and cursor up (`ESC[nA`); other sequences do nothing.
fn screen(text: &str, cols: usize) -> Vec<String> {
    let mut rows: Vec<Vec<char>> = vec![Vec::new()];
    let (mut r, mut c, mut pending) = (0usize, 0usize, false);
    let mut chars = text.chars();
    while let Some(ch) = chars.next() {
        match ch {
            '\r' => (c, pending) = (0, false),
            '\n' => (r, pending) = (r + 1, false),
            '\x1b' => {
                if chars.next() != Some('[') {
                    continue;
                }
                let mut arg = String::new();
                let f = chars.by_ref().find(|f| {
                    arg.push(*f);
                    ('\x40'..='\x7e').contains(f)
                });
                let n: usize = arg[..arg.len() - 1].parse().unwrap_or(0);
                pending = false;
                match f {
                    Some('A') => r = r.saturating_sub(n.max(1)),
                    Some('K') if n == 2 => rows[r].clear(),
                    Some('K') => rows[r].truncate(c),
                    Some('J') => {
                        rows[r].truncate(c);
                        rows.truncate(r + 1);
                    }
                    _ => {}
                }
            }
            ch if ch < ' ' => {}
            ch => {
                if pending {
                    (r, c, pending) = (r + 1, 0, false);
                }
                while rows.len() <= r {
                    rows.push(Vec::new());
                }
                let row = &mut rows[r];
                row.resize(row.len().max(c + 1), ' ');
                row[c] = ch;
                c += 1;
                if c == cols {
                    (c, pending) = (cols - 1, true);
                }
            }
        }
        while rows.len() <= r {
            rows.push(Vec::new());
        }
    }
    rows.into_iter()
        .map(|r| r.into_iter().collect::<String>().trim_end().to_string())
        .collect()
}

/// No row of the final screen is (a piece of) a status line: it was cleared, every row of it.
fn assert_cleared(text: &str, cols: usize) {
    for row in screen(text, cols) {
        assert!(
            !row.starts_with("step ") && !row.contains(" ETA "),
            "a status row outlived the run: {row:?} in {text:?}"
        );
    }
}

#[test]
fn the_status_line_fits_a_60_column_terminal_and_is_cleared_at_the_end() {
    let Some(mut tty) = Tty::start(60, 30) else {
        return;
    };
    let (code, text) = tty.wait();
    assert_eq!(code, Some(0), "{text:?}");
    let lines = renderings(&text);
    assert!(!lines.is_empty(), "no status line drawn: {text:?}");
    for l in &lines {
        assert!(l.chars().count() <= 60, "wider than 60 columns: {l:?}");
        assert!(l.contains("/30 ") && l.contains(" ETA "), "{l:?}");
    }
    // Narrow, the line keeps the step, its ETA and the first figure: it drops the least
    // important parts (the bar first) rather than wrapping.
    assert!(lines.iter().any(|l| l.contains(" | loss ")), "{lines:?}");
    assert!(lines.iter().all(|l| !l.contains('[')), "{lines:?}");
    assert_cleared(&text, 60);
}

#[test]
fn a_ctrl_c_on_a_60_column_terminal_leaves_no_status_row_behind() {
    let Some(mut tty) = Tty::start(60, 100_000) else {
        return;
    };
    wait_for("a status line with a step", T, || {
        renderings(&tty.text())
            .iter()
            .any(|l| l.contains(" | loss "))
            .then_some(())
    });
    // Ctrl-C typed on the terminal: it signals the run and echoes `^C` after the line.
    let stdin = tty.stdin.as_mut().unwrap();
    stdin.write_all(b"\x03").unwrap();
    stdin.flush().unwrap();
    let (code, text) = tty.wait();
    assert_eq!(code, Some(75), "{text:?}");
    assert!(text.contains("^C"), "{text:?}");
    for l in renderings(&text) {
        assert!(l.trim_end_matches("^C").chars().count() <= 57, "{l:?}");
    }
    assert_cleared(&text, 60);
}

#[test]
fn a_narrower_terminal_gets_the_line_fitted_anew_and_its_wrapped_rows_erased() {
    let Some(mut tty) = Tty::start(60, 100_000) else {
        return;
    };
    wait_for("a status line with a step", T, || {
        renderings(&tty.text())
            .iter()
            .any(|l| l.chars().count() > 40)
            .then_some(())
    });
    // Resize the terminal to 40 columns: the kernel signals SIGWINCH to the run.
    let pid = tty.supervisor();
    let mark = tty.len();
    let term = std::fs::File::open(format!("/proc/{pid}/fd/2")).unwrap();
    let ws = libc::winsize {
        ws_row: 20,
        ws_col: 40,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    use std::os::fd::AsRawFd;
    // SAFETY: TIOCSWINSZ reads the winsize it is given and nothing else.
    let rc = unsafe { libc::ioctl(term.as_raw_fd(), libc::TIOCSWINSZ, &ws) };
    assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
    // The line drawn at 60 columns wraps onto two rows at 40: both are erased, and the
    // line is drawn again within 40 columns.
    const ERASE_TWO_ROWS: &str = "\r\x1b[2K\x1b[1A\x1b[2K";
    wait_for("the line redrawn within 40 columns", T, || {
        let after = tty.text_from(mark);
        let erased = after.find(ERASE_TWO_ROWS)?;
        (!renderings(&after[erased..]).is_empty()).then_some(())
    });
    signal(pid, nix::sys::signal::Signal::SIGINT);
    let (code, text) = tty.wait();
    assert_eq!(code, Some(75), "{text:?}");
    let after = tty.text_from(mark);
    let erased = after.find(ERASE_TWO_ROWS).unwrap();
    for l in renderings(&after[erased..]) {
        assert!(l.chars().count() <= 40, "wider than 40 columns: {l:?}");
    }
}

#[test]
fn off_a_terminal_step_lines_have_one_format_and_each_brings_a_new_step() {
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:2",
        "--data",
        "demo",
        "--steps",
        "30",
        "--metrics-interval",
        "200ms",
        "--max-seq-len",
        "64",
        "--token-budget",
        "512",
    ]);
    assert_eq!(sup.wait_exit(T).code(), Some(0));
    let err = sup.stderr();
    let steps: Vec<u64> = err
        .lines()
        .filter_map(|l| l.strip_prefix("[supervisor] step "))
        .filter(|r| r.starts_with(|c: char| c.is_ascii_digit()))
        .map(|r| {
            // `step N/M | loss … | accept … | … tok/s | … | restarts K`, nothing else.
            let f: Vec<&str> = r.split(" | ").collect();
            assert!(
                f[0].ends_with("/30")
                    && f[1].starts_with("loss ")
                    && f[2].starts_with("accept ")
                    && f[3].ends_with(" tok/s")
                    && f.last().unwrap().starts_with("restarts "),
                "not the step-line format: {r}"
            );
            f[0].split('/').next().unwrap().parse().unwrap()
        })
        .collect();
    assert!(!steps.is_empty(), "{err}");
    assert!(
        steps.windows(2).all(|w| w[0] < w[1]),
        "a step line without a new step: {steps:?}\n{err}"
    );
    assert_eq!(steps.last(), Some(&30), "{err}");
}
