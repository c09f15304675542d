//! A low limit on processes and threads (`ulimit -u`, RLIMIT_NPROC) is named in one line,
//! with its value and what is needed, wherever it refuses a start: the supervisor's own
//! threads and workers (exit 4), or a worker's compute threads (the worker exits as a
//! permanent failure and the run stops with its line, exit 1). Never a panic.
//!
//! RLIMIT_NPROC counts every process and thread of the user, so each limit here is the
//! user's count when the test starts plus a margin; root is not bound by it, so under root
//! the supervisor runs as `nobody`. This binary runs alone (.config/nextest.toml): other
//! tests' processes would move the count.

mod common;

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;

const T: Duration = Duration::from_secs(60);

/// `nobody`, whom the supervisor runs as when the tests run as root.
const NOBODY: u32 = 65534;

/// The user and group the supervisor runs as: this process's, or [`NOBODY`] under root.
fn user() -> (u32, u32) {
    // SAFETY: getuid and getgid have no preconditions.
    match unsafe { (libc::getuid(), libc::getgid()) } {
        (0, _) => (NOBODY, NOBODY),
        ids => ids,
    }
}

/// The processes and threads whose real user is `uid`, as RLIMIT_NPROC counts them.
fn tasks_of(uid: u32) -> u64 {
    let mut n = 0;
    for p in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(tasks) = std::fs::read_dir(p.path().join("task")) else {
            continue;
        };
        for t in tasks.flatten() {
            let status = std::fs::read_to_string(t.path().join("status")).unwrap_or_default();
            let real = status
                .lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|l| l.split_whitespace().next()?.parse::<u32>().ok());
            n += u64::from(real == Some(uid));
        }
    }
    n
}

/// Run a 1-step demo run of two CPU workers on the tiny target in `dir` with RLIMIT_NPROC
/// at `limit`, as [`user`]: its exit code and stderr.
fn run_limited(dir: &Path, limit: u64, env: &[(&str, &str)]) -> (i32, String) {
    let (uid, gid) = user();
    let mut cmd = Command::new(bin("dflash-supervise"));
    cmd.args(["--gpus", "cpu:2", "--data", "demo", "--demo-samples", "32"])
        .args(["--steps", "1", "--target"])
        .arg(dir.join("target"))
        .arg("--run-dir")
        .arg(dir.join(format!("run-{limit}")))
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join(format!("stderr-{limit}"))).unwrap());
    let switch = uid != unsafe { libc::getuid() };
    // SAFETY: only async-signal-safe system calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            let lim = libc::rlimit {
                rlim_cur: limit,
                rlim_max: limit,
            };
            if libc::setrlimit(libc::RLIMIT_NPROC, &lim) != 0
                || (switch
                    && (libc::setgroups(0, std::ptr::null()) != 0
                        || libc::setgid(gid) != 0
                        || libc::setuid(uid) != 0))
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    /// Killed if the test ends before it does.
    struct Run(std::process::Child);
    impl Drop for Run {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut run = Run(cmd.spawn().expect("start dflash-supervise under the limit"));
    let status = wait_for("the supervisor to exit", T, || run.0.try_wait().unwrap());
    let err = std::fs::read_to_string(dir.join(format!("stderr-{limit}"))).unwrap();
    (status.code().unwrap_or(-1), err)
}

/// The line of `err` that says `what`, naming the limit with what is needed; no panic
/// anywhere.
fn limit_line<'a>(err: &'a str, what: &str, limit: u64, needs: &str) -> &'a str {
    assert!(
        !err.contains("panicked") && !err.contains("stack backtrace"),
        "{err}"
    );
    err.lines()
        .find(|l| {
            l.contains(what)
                && l.contains(&format!("ulimit -u is {limit} for this user"))
                && l.contains(needs)
        })
        .unwrap_or_else(|| {
            panic!("no line says '{what}', names ulimit -u {limit} and '{needs}':\n{err}")
        })
}

#[test]
fn a_low_process_limit_is_named_in_one_line_with_what_is_needed() {
    let tmp = tempfile::tempdir().unwrap();
    let out = Command::new(bin("dflash-worker"))
        .arg("tiny-target")
        .arg("--out")
        .arg(tmp.path().join("target"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let (uid, gid) = user();
    if uid != unsafe { libc::getuid() } {
        std::os::unix::fs::chown(tmp.path(), Some(uid), Some(gid)).unwrap();
    }

    // Room for the supervisor alone: its first thread or worker is refused.
    let limit = tasks_of(uid) + 1;
    let (code, err) = run_limited(tmp.path(), limit, &[]);
    assert_eq!(code, 4, "{err}");
    let line = limit_line(&err, "error: cannot start", limit, "this run needs about");
    assert!(
        line.starts_with("dflash-supervise: error: ") || line.starts_with("[supervisor] error: "),
        "{line}"
    );

    // Room for the supervisor and its workers, not for 200 compute threads a worker.
    let limit = tasks_of(uid) + 40;
    let (code, err) = run_limited(tmp.path(), limit, &[("RAYON_NUM_THREADS", "200")]);
    assert_eq!(code, 1, "{err}");
    limit_line(
        &err,
        "cannot run on its CPU and was not restarted: cannot compute on device cpu (permanent, do not restart): cannot start 200 compute threads",
        limit,
        "this worker needs 204 of them",
    );
}
