//! `logs` and `status` against live and finished runs.

mod common;

use std::fs;
use std::io::Read;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use nix::sys::signal::Signal;

const T: Duration = Duration::from_secs(20);

/// A `dflash-supervise logs ...` process whose stdout is collected as it comes.
struct LogsF {
    child: Child,
    out: Arc<Mutex<String>>,
}

impl LogsF {
    fn start(args: &[&str]) -> LogsF {
        let mut child = Command::new(bin("dflash-supervise"))
            .arg("logs")
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdout = child.stdout.take().unwrap();
        let out = Arc::new(Mutex::new(String::new()));
        let sink = out.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = stdout.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        LogsF { child, out }
    }

    fn text(&self) -> String {
        self.out.lock().unwrap().clone()
    }

    fn wait_for(&self, what: &str, pred: impl Fn(&str) -> bool) {
        wait_for(what, T, || pred(&self.text()).then_some(()));
    }
}

impl Drop for LogsF {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn dir(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn logs_tail_and_follow_across_a_restart_then_stop_with_the_run() {
    let mut sup = Sup::start_real(&["--gpus", "cpu:2"]);
    let st = sup.wait_running(2);
    let first = pid_of(&st, "drafter-0");
    let rd = sup.run_dir.clone();

    let f = LogsF::start(&["--run-dir", dir(&rd), "drafter-0", "-f"]);
    f.wait_for("the first life's line", |t| {
        t.contains(&format!("drafter-0 (pid {first})"))
    });

    signal(first, Signal::SIGKILL);
    let st = sup.wait_state("drafter-0 restarted", T, |s| {
        worker(s, "drafter-0")["restarts"] == 1 && worker(s, "drafter-0")["state"] == "running"
    });
    let second = pid_of(&st, "drafter-0");
    f.wait_for("the exit and the second life, in order", |t| {
        let exit = t.find(&format!("pid {first} killed by signal SIGKILL"));
        let next = t.find(&format!("drafter-0 (pid {second})"));
        matches!((exit, next), (Some(a), Some(b)) if a < b)
    });
    assert!(!f.text().contains("target-0"), "only drafter-0's lines");

    // -n: exactly the last N lines, both lives visible with a large N.
    let out = supervise(
        &["logs", "--run-dir", dir(&rd), "drafter-0", "-n", "50"],
        None,
    );
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!("pid {first}")) && text.contains(&format!("pid {second}")),
        "{text}"
    );
    assert!(text
        .lines()
        .all(|l| l.contains(" stdout ") || l.contains(" stderr ") || l.contains(" supervisor ")));
    let out = supervise(
        &["logs", "--run-dir", dir(&rd), "drafter-0", "-n", "2"],
        None,
    );
    let tail: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(String::from)
        .collect();
    let log = sup.log("drafter-0");
    let last2: Vec<String> = log
        .lines()
        .rev()
        .take(2)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .map(String::from)
        .collect();
    assert_eq!(tail, last2);

    // --all prefixes each line with its worker.
    let out = supervise(&["logs", "--run-dir", dir(&rd), "--all", "-n", "1"], None);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.lines().any(|l| l.starts_with("[target-0] "))
            && text.lines().any(|l| l.starts_with("[drafter-0] ")),
        "{text}"
    );

    // When the run ends, -f prints the last lines and exits 0 by itself.
    sup.signal(Signal::SIGTERM);
    assert_eq!(sup.wait_exit(T).code(), Some(75));
    let mut child = f;
    let status = wait_for("logs -f to end with the run", T, || {
        child.child.try_wait().unwrap()
    });
    assert_eq!(status.code(), Some(0));
    child.wait_for("the final shutdown line", |t| {
        t.contains(&format!("pid {second} exit code 0"))
    });
}

#[test]
fn logs_follow_survives_rotation_without_losing_a_line() {
    let n = 400;
    let sup = Sup::start(
        &[
            "--gpus",
            "cpu:2",
            "--log-max-size",
            "2K",
            "--log-backups",
            "200",
        ],
        &format!("drafter-0=chatty:{n}"),
    );
    sup.wait_state("state.json", T, |_| true);
    let f = LogsF::start(&[
        "--run-dir",
        dir(&sup.run_dir),
        "drafter-0",
        "-f",
        "-n",
        "100000",
    ]);
    f.wait_for("every chatty line", |t| {
        t.contains(&format!("chatty {}", n - 1))
    });
    let nums: Vec<u32> = f
        .text()
        .lines()
        .filter_map(|l| {
            l.split_once("stdout chatty ")
                .map(|(_, n)| n.trim().parse().unwrap())
        })
        .collect();
    assert_eq!(
        nums,
        (0..n).collect::<Vec<_>>(),
        "lines lost, repeated or out of order"
    );
    assert!(
        sup.run_dir.join("logs/drafter-0.log.5").exists(),
        "the log should have rotated many times"
    );
    for entry in fs::read_dir(sup.run_dir.join("logs")).unwrap() {
        let len = entry.unwrap().metadata().unwrap().len();
        assert!(len <= 2048, "a log file grew past --log-max-size: {len}");
    }
}

#[test]
fn tee_prints_worker_lines_with_a_prefix() {
    let mut sup = Sup::start_real(&["--gpus", "cpu:2", "--tee"]);
    sup.wait_running(2);
    sup.signal(Signal::SIGTERM);
    assert_eq!(sup.wait_exit(T).code(), Some(75), "{}", sup.stderr());
    let out = sup.stdout();
    assert!(
        out.lines()
            .any(|l| l.starts_with("[drafter-0] dflash-worker drafter-0")),
        "{out}"
    );
    assert!(out.lines().any(|l| l.starts_with("[target-0] ")), "{out}");
}

#[test]
fn status_shows_workers_and_notices_a_dead_supervisor() {
    let sup = Sup::start_real(&["--gpus", "cpu:3", "--targets", "1"]);
    let st = sup.wait_running(3);
    let rd = sup.run_dir.clone();
    let out = supervise(&["status", "--run-dir", dir(&rd)], None);
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout);
    for name in ["target-0", "drafter-0", "drafter-1"] {
        let line = text
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("{name} missing:\n{text}"));
        assert!(
            line.contains("running") && line.contains(&pid_of(&st, name).to_string()),
            "{line}"
        );
    }
    assert!(
        text.contains(&format!("pid {}, running", sup.pid())),
        "{text}"
    );

    let out = supervise(&["status", "--run-dir", dir(&rd), "--json"], None);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["supervisor_alive"], true);
    assert_eq!(v["workers"].as_array().unwrap().len(), 3);

    sup.signal(Signal::SIGKILL);
    wait_for("the supervisor lock to be released", T, || {
        let out = supervise(&["status", "--run-dir", dir(&rd)], None);
        String::from_utf8_lossy(&out.stdout)
            .contains("gone without recording an exit")
            .then_some(())
    });
}

#[test]
fn logs_and_status_default_to_the_newest_run_under_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let worker = bin("dflash-worker");
    for _ in 0..2 {
        let out = supervise(
            &[
                "--gpus",
                "cpu:2",
                "--time-limit",
                "300ms",
                "--max-seq-len",
                "32",
                "--token-budget",
                "256",
                "--worker-bin",
                worker.to_str().unwrap(),
            ],
            Some(tmp.path()),
        );
        assert_eq!(
            out.status.code(),
            Some(75),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let mut runs: Vec<_> = fs::read_dir(tmp.path().join("runs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    runs.sort();
    assert_eq!(
        runs.len(),
        2,
        "two runs started in the same second get distinct dirs"
    );
    let newest = runs
        .iter()
        .max_by_key(|p| {
            let s: serde_json::Value =
                serde_json::from_str(&fs::read_to_string(p.join("state.json")).unwrap()).unwrap();
            s["started_at_unix_ms"].as_u64().unwrap()
        })
        .unwrap();
    let out = supervise(&["status", "--json"], Some(tmp.path()));
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        v["run_dir"].as_str().unwrap(),
        fs::canonicalize(newest).unwrap().to_str().unwrap()
    );
    assert_eq!(v["phase"], "stopped");
    let out = supervise(&["logs", "target-0"], Some(tmp.path()));
    assert_eq!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stdout).contains("dflash-worker target-0"));
}

#[test]
fn a_terminal_gets_a_live_status_line_and_a_pipe_gets_plain_lines() {
    // Not a terminal: one plain line per metrics window.
    let mut sup = Sup::start_real(&[
        "--gpus",
        "cpu:2",
        "--data",
        "demo",
        "--steps",
        "8",
        "--metrics-interval",
        "300ms",
        "--max-seq-len",
        "64",
        "--token-budget",
        "512",
    ]);
    assert_eq!(sup.wait_exit(T).code(), Some(0));
    let err = sup.stderr();
    assert!(
        err.lines().any(|l| l.starts_with("[supervisor] step ")
            && l.contains("/8 | loss ")
            && l.ends_with("| restarts 0")),
        "{err}"
    );
    // Checkpoint and export writes say how much they wrote.
    for what in [
        "checkpoint of step 8 written to ",
        "drafter at step 8 written to ",
    ] {
        assert!(
            err.lines()
                .any(|l| l.contains(what) && (l.ends_with(" KiB)") || l.ends_with(" MiB)"))),
            "{what}…(size): {err}"
        );
    }
    // One step-line format: every step line is `step N/M | loss … | accept … | …`.
    let steps: Vec<&str> = err
        .lines()
        .filter(|l| {
            l.strip_prefix("[supervisor] step ")
                .is_some_and(|r| r.starts_with(|c: char| c.is_ascii_digit()))
        })
        .collect();
    assert!(steps.len() >= 2, "{err}");
    for l in &steps {
        let fields: Vec<&str> = l.split(" | ").collect();
        assert!(
            fields[0].contains("/8")
                && fields[1].starts_with("loss ")
                && fields[2].starts_with("accept ")
                && fields.iter().any(|f| f.ends_with(" tok/s")),
            "not the step-line format: {l}"
        );
        assert!(!l.contains("-0 tok/s"), "{l}");
    }
    // No bottleneck hint from the start or the end: only from windows before the stop.
    let stop = err
        .find("step limit reached")
        .expect("the run stops at its step limit");
    assert!(
        !err[stop..].contains("bottleneck"),
        "no bottleneck hint from a clean end: {err}"
    );
    assert!(
        !err.contains("\x1b[K"),
        "no terminal control codes in a pipe"
    );

    // A terminal (through script(1), which gives the run a pseudo-terminal).
    if Command::new("script").arg("--version").output().is_err() {
        assert!(
            std::env::var_os("CI").is_none(),
            "script(1) (util-linux) is missing: under CI this test may not skip"
        );
        eprintln!("SKIPPED terminal status line: script(1) is not installed");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("tty.out");
    let cmd = format!(
        "{} --gpus cpu:2 --data demo --steps 8 --max-seq-len 64 --token-budget 512 --tee --run-dir {}",
        bin("dflash-supervise").display(),
        tmp.path().join("run").display()
    );
    let st = Command::new("script")
        .args(["-qfec", &cmd])
        .arg(&out)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(st.success());
    let text = String::from_utf8_lossy(&fs::read(&out).unwrap()).into_owned();
    assert!(
        text.contains("\r\x1b[2K"),
        "the status line is redrawn in place: {text:?}"
    );
    assert!(text.contains("| restarts 0"), "{text:?}");
    assert!(
        text.contains("/8 [") && text.contains(" ETA "),
        "step N/M with a bar and an ETA: {text:?}"
    );
    // --tee's worker lines print above the status line, never into it. What a line shows
    // is what was written after its last erase (`ESC[2K`): a status line wider than the
    // terminal wraps onto two rows, and lifting it erases both before the worker line is
    // written, all before the next newline.
    let worker_lines: Vec<&str> = text
        .split('\n')
        .map(|l| l.rsplit("\x1b[2K").next().unwrap_or(l))
        .filter(|l| l.contains("[drafter-0] ") || l.contains("[target-0] "))
        .collect();
    assert!(!worker_lines.is_empty(), "{text:?}");
    for l in &worker_lines {
        assert!(
            !l.contains(" ETA ") && !l.contains("/8 ["),
            "a worker line in the status line: {l:?}"
        );
    }
    // Log records print above the line: each starts on a line of its own.
    assert!(
        text.lines().any(|l| l
            .trim_start_matches(|c: char| c != '[')
            .starts_with("[supervisor] ")),
        "{text:?}"
    );
}

/// A pipe whose reader is already gone: every write to it fails (EPIPE).
fn closed_pipe() -> Stdio {
    let (reader, writer) = nix::unistd::pipe().unwrap();
    drop(reader);
    Stdio::from(writer)
}

#[test]
fn a_run_whose_stderr_reader_is_gone_still_ends_with_its_state_report_and_exit_code() {
    // `dflash-supervise ... 2>&1 | tee run.log`, and tee dies with the Ctrl-C that stops
    // the run: the run's last lines meet a closed pipe. (Rust's eprintln! panics there.)
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    let mut child = Command::new(bin("dflash-supervise"))
        .args([
            "--gpus",
            "cpu:2",
            "--data",
            "demo",
            "--steps",
            "3",
            "--run-dir",
        ])
        .arg(&run)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(closed_pipe())
        .spawn()
        .unwrap();
    let status = wait_for("the run to end", Duration::from_secs(60), || {
        child.try_wait().unwrap()
    });
    assert_eq!(status.code(), Some(0), "{status:?}");
    let state: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(run.join("state.json")).unwrap()).unwrap();
    assert_eq!(
        (state["phase"].as_str(), state["exit_code"].as_i64()),
        (Some("stopped"), Some(0)),
        "{state}"
    );
    assert!(run.join("report.html").exists(), "the report is written");
    assert!(!fs::read_to_string(run.join("supervisor.log"))
        .unwrap()
        .contains("panicked"));

    // A listing into a reader that is gone (`status | head -1` once head has quit) ends
    // quietly by SIGPIPE, as Unix tools do, not with a panic and a backtrace.
    for args in [&["status", "--run-dir"][..], &["ledger", "--run-dir"][..]] {
        let out = Command::new(bin("dflash-supervise"))
            .args(args)
            .arg(&run)
            .stdin(Stdio::null())
            .stdout(closed_pipe())
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        use std::os::unix::process::ExitStatusExt;
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.signal(),
            Some(Signal::SIGPIPE as i32),
            "{args:?}: {:?} {err}",
            out.status
        );
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}
