//! What a child the supervisor or a worker starts does between fork and exec to die with
//! it. A leaf module: called from `pre_exec` closures, so it makes only async-signal-safe calls.

use std::io;

/// Ask for SIGKILL when the forking thread of `parent` ends (`PR_SET_PDEATHSIG`), and
/// refuse to go on (ESRCH) when `parent` already died between fork and prctl: nobody would
/// send the signal then. Call only between fork and exec.
///
/// # Safety
/// Async-signal-safe (prctl, getppid; an io::Error from a raw errno allocates nothing).
pub unsafe fn die_with(parent: libc::pid_t) -> io::Result<()> {
    if libc::prctl(
        libc::PR_SET_PDEATHSIG,
        libc::SIGKILL as libc::c_ulong,
        0,
        0,
        0,
    ) != 0
    {
        return Err(io::Error::last_os_error());
    }
    if libc::getppid() != parent {
        return Err(io::Error::from_raw_os_error(libc::ESRCH));
    }
    Ok(())
}
