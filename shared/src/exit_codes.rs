//! Exit codes of both binaries, in one place. The README documents the same table.

/// Success: the run ended by itself or was stopped and every worker stopped cleanly.
pub const SUCCESS: i32 = 0;
/// The run failed: a worker spent its restart budget (a root-cause report was printed).
pub const RUN_FAILED: i32 = 1;
/// Bad command line or input: a one-line error names the input and what was expected.
pub const USAGE: i32 = 2;
/// A stop was requested but some worker did not stop cleanly: it had to be killed after
/// `--stop-timeout`, or it exited with a non-zero status (a worker still starting that the
/// stop's own SIGTERM ends is a clean stop: it had nothing in flight).
pub const UNCLEAN_STOP: i32 = 3;
/// The supervisor itself could not go on: a worker binary that cannot be started, a
/// control-protocol version mismatch, an I/O failure in the run dir.
pub const INTERNAL: i32 = 4;
/// Stopped before its end (SIGINT/SIGTERM/SIGHUP or `--time-limit`) with every worker
/// stopped cleanly and the trained steps checkpointed: `--resume` continues it. A requeue
/// loop (Slurm) resubmits on this code and stops on 0. 75 is sysexits' EX_TEMPFAIL ("try
/// again later").
pub const STOPPED_EARLY: i32 = 75;
/// A second Ctrl-C (or SIGINT/SIGTERM during a stop): every worker was killed at once.
pub const INTERRUPTED: i32 = 130;

/// Worker: its control channel to the supervisor closed (the supervisor is gone).
pub const WORKER_ORPHANED: i32 = 10;
/// Worker: it cannot use its device (a CUDA library missing, no usable GPU): restarting
/// cannot help, so the supervisor stops the run with the worker's one-line reason instead
/// of spending the restart budget.
pub const WORKER_PERMANENT: i32 = 11;
