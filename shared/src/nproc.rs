//! The limit on a user's processes and threads (`ulimit -u`, RLIMIT_NPROC) in the words of
//! a start that failed. fork/clone and pthread_create fail with EAGAIN once the user has as
//! many processes and threads as the limit allows (all of its processes count, not only
//! this run's), and "Resource temporarily unavailable (os error 11)" names no limit: the
//! one-line errors of both programs say which it was, its value here and what they need.

use std::io;

/// The environment variable rayon reads for the size of its pool (the worker's CPU compute
/// threads, which gemm uses).
pub const RAYON_NUM_THREADS: &str = "RAYON_NUM_THREADS";

/// This process's RLIMIT_NPROC (`ulimit -u`): `None` when unlimited.
pub fn process_limit() -> Option<u64> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given and nothing else.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_NPROC, &mut r) } == 0;
    (ok && r.rlim_cur != libc::RLIM_INFINITY).then_some(r.rlim_cur)
}

/// Whether `e` is a process or thread start refused for want of a process slot (EAGAIN).
pub fn is_limit(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::EAGAIN)
}

/// The threads a worker's CPU compute starts (rayon's pool): `RAYON_NUM_THREADS` when it
/// is a positive number, else one per core, as rayon itself decides.
pub fn compute_threads() -> usize {
    std::env::var(RAYON_NUM_THREADS)
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// A process or thread start that failed with `e`, in one line: `e`'s own words and, when
/// it is EAGAIN, the limit reached, with `ulimit -u`'s value here and `needs` (what the
/// caller needs, e.g. "this run needs about 28 processes and threads").
pub fn start_failure(e: &io::Error, needs: Option<&str>) -> String {
    if !is_limit(e) {
        return e.to_string();
    }
    // SAFETY: getuid has no preconditions.
    let root = unsafe { libc::getuid() } == 0;
    format!("{e}: {}", limit_reached(process_limit(), root, needs))
}

/// What EAGAIN from a start means, given `ulimit -u` (`limit`) and whether the user is
/// root (whom RLIMIT_NPROC does not bind).
fn limit_reached(limit: Option<u64>, root: bool, needs: Option<&str>) -> String {
    let needs = needs.map(|n| format!("; {n}")).unwrap_or_default();
    match limit {
        Some(n) if !root => format!(
            "the limit on processes and threads was reached: ulimit -u is {n} for this user, \
             counting every process and thread it runs{needs}; raise ulimit -u or end some of the user's other processes"
        ),
        _ => {
            let why = match limit {
                Some(n) => format!("ulimit -u is {n}, which does not bind root"),
                None => "ulimit -u is unlimited".to_string(),
            };
            format!(
                "a limit on processes and threads was reached: {why}, so a cgroup's pids.max, \
                 the kernel's threads-max or the memory for a thread's stack{needs}"
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eagain_names_ulimit_u_its_value_and_the_need_in_one_line() {
        let w = limit_reached(Some(24), false, Some("this run needs about 28"));
        assert_eq!(
            w,
            "the limit on processes and threads was reached: ulimit -u is 24 for this user, \
             counting every process and thread it runs; this run needs about 28; raise ulimit -u or end some of the user's other processes"
        );
        let w = limit_reached(None, false, None);
        assert!(
            w.contains("ulimit -u is unlimited") && w.contains("pids.max"),
            "{w}"
        );
        let w = limit_reached(Some(24), true, Some("needs 3"));
        assert!(
            w.contains("does not bind root") && w.ends_with("; needs 3"),
            "{w}"
        );
        for w in [w, limit_reached(Some(1), false, None)] {
            assert!(!w.contains('\n'), "{w}");
        }
        // EAGAIN gets the words; any other error is only itself.
        let e = io::Error::from_raw_os_error(libc::EAGAIN);
        let line = start_failure(&e, Some("this run needs about 28"));
        assert!(
            line.starts_with(&e.to_string()) && line.contains("ulimit -u"),
            "{line}"
        );
        assert!(
            line.ends_with("other processes") || line.contains("pids.max"),
            "{line}"
        );
        let e = io::Error::from_raw_os_error(libc::ENOENT);
        assert_eq!(start_failure(&e, Some("x")), e.to_string());
    }

    #[test]
    fn the_process_limit_is_getrlimits() {
        let mut r = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NPROC, &mut r) }, 0);
        let expected = (r.rlim_cur != libc::RLIM_INFINITY).then_some(r.rlim_cur);
        assert_eq!(process_limit(), expected);
        assert!(compute_threads() >= 1);
    }
}
