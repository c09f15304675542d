//! What a run needs of the limit on processes and threads (`ulimit -u`), for the one line a
//! failed process or thread start prints ([`dflash_shared::nproc::start_failure`]): once a
//! run's workers are planned, every such line says how many the run needs.

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};

use dflash_shared::Device;

/// The planned run's estimate (0: no run planned in this process).
static RUN_NEEDS: AtomicUsize = AtomicUsize::new(0);

/// The supervisor's threads besides those per worker (main, signals, spawner, loader, the
/// reaper's watcher), the reaper process, and room for the checkpoint, τ and telemetry
/// threads that come and go.
const SUPERVISOR: usize = 10;
/// Per worker, in the supervisor: its control, exit-waiter and two log threads.
const PER_WORKER_HERE: usize = 4;
/// Per worker process besides its compute: main, heartbeat, control channel, loading.
const PER_WORKER: usize = 4;
/// A GPU worker's compute: the CUDA driver's and NCCL's threads.
const GPU_COMPUTE: usize = 4;

/// About how many processes and threads a run of workers on `devices` has at once, when a
/// CPU worker computes on `cpu_compute` threads.
pub fn run_needs(devices: impl IntoIterator<Item = Device>, cpu_compute: usize) -> usize {
    SUPERVISOR
        + devices
            .into_iter()
            .map(|d| {
                let compute = match d {
                    Device::Cpu => cpu_compute,
                    Device::Gpu(_) => GPU_COMPUTE,
                };
                PER_WORKER_HERE + PER_WORKER + compute
            })
            .sum::<usize>()
}

/// The run of this process will have workers on `devices`: failed starts say what it needs.
pub fn plan_run(devices: impl IntoIterator<Item = Device>) {
    let n = run_needs(devices, dflash_shared::nproc::compute_threads());
    RUN_NEEDS.store(n, Ordering::Relaxed);
}

/// A process or thread start that failed with `e`, in one line: for EAGAIN, the limit
/// reached (`ulimit -u` and its value) and what the planned run needs.
pub fn start_failure(e: &io::Error) -> String {
    let n = RUN_NEEDS.load(Ordering::Relaxed);
    let needs = (n > 0).then(|| format!("this run needs about {n} of them"));
    dflash_shared::nproc::start_failure(e, needs.as_deref())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_start_names_the_limit_and_what_the_run_needs() {
        // Two CPU workers on 2 cores: 10 + 2 × (4 + 4 + 2); a GPU worker's compute is
        // the driver's threads, whatever the cores.
        assert_eq!(run_needs([Device::Cpu, Device::Cpu], 2), 30);
        assert_eq!(run_needs([Device::Gpu(0)], 64), 22);
        plan_run([Device::Cpu, Device::Cpu]);
        let expected = run_needs(
            [Device::Cpu, Device::Cpu],
            dflash_shared::nproc::compute_threads(),
        );
        let e = io::Error::from_raw_os_error(libc::EAGAIN);
        let line = start_failure(&e);
        assert!(line.contains("ulimit -u"), "{line}");
        assert!(
            line.contains(&format!("this run needs about {expected} of them")),
            "{line}"
        );
        // As an error of the supervisor prints it: one line.
        let err = crate::error::Error::start("spawner thread", e);
        let text = err.to_string();
        assert!(
            text.starts_with("cannot start spawner thread: Resource temporarily unavailable")
                && text.contains("ulimit -u")
                && !text.contains('\n'),
            "{text}"
        );
        assert_eq!(err.exit_code(), dflash_shared::exit_codes::INTERNAL);
        let e = io::Error::from_raw_os_error(libc::EACCES);
        assert_eq!(start_failure(&e), e.to_string());
    }
}
