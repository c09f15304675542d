//! Exit codes of both binaries, in one place: docs/run-directory.md's table is generated
//! from the doc comments below (supervisor/tests/docs.rs), so they are written for users.

/// The run ended by itself (its `--steps` or its data done), every worker stopped cleanly
/// and the drafter was exported; also a `--resume` of a run that already finished (nothing
/// is started), or whose checkpoint reached its `--steps` (its drafter exported if it was
/// not, nothing trained).
pub const SUCCESS: i32 = 0;
/// The run failed: a worker spent its restart budget (a root-cause report on stderr), a
/// checkpoint could not be written, committed steps were not saved, the drafter could not
/// be exported, or the run directory was removed.
pub const RUN_FAILED: i32 = 1;
/// Bad command line or input (a flag out of range, a bad `--target` checkpoint, a missing
/// `--worker-bin` or `dflash-worker`, a run that cannot fit in memory, a used `--run-dir`,
/// `--steps` beyond what `--epochs` give, a `--resume` of a run whose checkpoint a newer
/// dflash-supervise wrote, ...): one line on stderr names the input and what was expected.
pub const USAGE: i32 = 2;
/// A stop was requested but some worker did not stop cleanly: it had to be killed after
/// `--stop-timeout`, or it exited with a non-zero status (a worker still starting that the
/// stop's own SIGTERM ends is a clean stop: it had nothing in flight).
pub const UNCLEAN_STOP: i32 = 3;
/// The supervisor itself could not go on: the worker program starts but never connects
/// (3 lives in a row), its control-protocol version differs, shared memory the start needs
/// cannot be had, a process or thread cannot be started (refused by the user's process
/// limit, the line says so: `ulimit -u is 24 for this user ...; this run needs about 30
/// of them`), an I/O failure in the run dir.
pub const INTERNAL: i32 = 4;
/// Stopped before its end (SIGINT/SIGTERM/SIGHUP, or `--time-limit`) with every worker
/// stopped cleanly and every trained step in a checkpoint (a stop before the first step
/// has none, and says so): `--resume` (or the same command with `--resume-if-exists`)
/// continues it. A requeue loop (Slurm) resubmits on this code and stops on 0; 75 is
/// sysexits' EX_TEMPFAIL ("try again later"). Also `cluster-check` on a follower node
/// whose leader is lost, or never came within `--timeout`.
pub const STOPPED_EARLY: i32 = 75;
/// A second SIGINT/SIGTERM killed every worker at once (or aborted the final export), or
/// a stop signal came while the run was starting (what the start made is removed).
pub const INTERRUPTED: i32 = 130;

/// Worker: its control channel to the supervisor closed (the supervisor is gone).
pub const WORKER_ORPHANED: i32 = 10;
/// Worker: it cannot use its device (a CUDA library missing, no usable GPU): restarting
/// cannot help, so the supervisor stops the run with the worker's one-line reason instead
/// of spending the restart budget.
pub const WORKER_PERMANENT: i32 = 11;

/// The supervisor's exit codes in a few words each: `dflash-supervise --help`'s last
/// paragraph (supervisor/tests/docs.rs checks that it names every code above).
pub fn help() -> String {
    let words = [
        (SUCCESS, "finished (steps or data done)"),
        (RUN_FAILED, "run failed"),
        (USAGE, "bad input"),
        (UNCLEAN_STOP, "unclean stop (a worker had to be killed)"),
        (INTERNAL, "internal error"),
        (
            STOPPED_EARLY,
            "stopped before the end (signal or --time-limit; --resume continues it)",
        ),
        (
            INTERRUPTED,
            "killed by a second Ctrl-C or interrupted while starting",
        ),
    ];
    let codes: Vec<String> = words.iter().map(|(c, w)| format!("{c} {w}")).collect();
    format!("Exit codes: {}.", codes.join(", "))
}
