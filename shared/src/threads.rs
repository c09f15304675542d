//! Scoped threads that degrade instead of panicking: where the process may not start
//! another thread (`ulimit -u`, a cgroup's `pids.max`, no memory for a stack),
//! [`std::thread::scope`]'s `spawn` panics. [`scoped`] starts each share of the work on a
//! thread of its own when it can and runs the shares it could not start on the calling
//! thread: the same results, with fewer threads.

use std::io;
use std::sync::Mutex;
use std::thread::{Builder, ScopedJoinHandle};

/// Run every job, each on a scoped thread where one can be started, and return their
/// results in the order of `jobs`. Once a thread cannot be started, the jobs left are not
/// offered to new threads: they run on the calling thread, while the threads already
/// started run theirs. A job that panics makes this panic with its payload, as
/// [`std::thread::scope`] does.
pub fn scoped<F, R>(jobs: impl IntoIterator<Item = F>) -> Vec<R>
where
    F: FnOnce() -> R + Send,
    R: Send,
{
    scoped_with(jobs, || Ok(()))
}

/// [`scoped`], asking `may_start` before each thread start: an error from it is handled
/// as one from [`Builder::spawn_scoped`] (the tests inject thread limits with it).
pub fn scoped_with<F, R>(
    jobs: impl IntoIterator<Item = F>,
    mut may_start: impl FnMut() -> io::Result<()>,
) -> Vec<R>
where
    F: FnOnce() -> R + Send,
    R: Send,
{
    // Each job waits in its slot: the thread started for it takes it out, and when no
    // thread could be started the calling thread does (a failed start drops only the
    // closure that would have taken it).
    let slots: Vec<Mutex<Option<F>>> = jobs.into_iter().map(|j| Mutex::new(Some(j))).collect();
    let take = |slot: &Mutex<Option<F>>| -> F {
        slot.lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take()
            .expect("each job is taken once")
    };
    std::thread::scope(|scope| {
        let mut started: Vec<Option<ScopedJoinHandle<'_, R>>> = Vec::with_capacity(slots.len());
        let mut can_start = true;
        for slot in &slots {
            let handle = if can_start {
                may_start()
                    .and_then(|()| Builder::new().spawn_scoped(scope, move || take(slot)()))
                    .ok()
            } else {
                None
            };
            can_start &= handle.is_some();
            started.push(handle);
        }
        // The shares no thread took, here, while the started threads run theirs.
        let mut here: Vec<Option<R>> = slots
            .iter()
            .zip(&started)
            .map(|(slot, h)| h.is_none().then(|| take(slot)()))
            .collect();
        started
            .into_iter()
            .zip(here.iter_mut())
            .map(|(h, r)| match h {
                Some(h) => h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)),
                None => r.take().expect("run on the calling thread"),
            })
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn job_ids(n: usize) -> Vec<impl FnOnce() -> (usize, std::thread::ThreadId) + Send> {
        (0..n)
            .map(|i| move || (i * 10, std::thread::current().id()))
            .collect()
    }

    #[test]
    fn every_job_runs_once_in_order_on_its_own_thread() {
        let out = scoped(job_ids(4));
        assert_eq!(out.iter().map(|r| r.0).collect::<Vec<_>>(), [0, 10, 20, 30]);
        let me = std::thread::current().id();
        assert!(out.iter().all(|r| r.1 != me), "each on a thread of its own");
    }

    #[test]
    fn shares_whose_thread_cannot_start_run_on_the_calling_thread() {
        // Thread starts fail from the third on, as under `ulimit -u`: no panic, every
        // share done, the first two on threads and the rest here.
        let tries = AtomicUsize::new(0);
        let out = scoped_with(job_ids(5), || {
            if tries.fetch_add(1, Ordering::SeqCst) >= 2 {
                return Err(io::Error::new(
                    io::ErrorKind::WouldBlock,
                    "Resource temporarily unavailable",
                ));
            }
            Ok(())
        });
        assert_eq!(
            out.iter().map(|r| r.0).collect::<Vec<_>>(),
            [0, 10, 20, 30, 40]
        );
        let me = std::thread::current().id();
        let here: Vec<bool> = out.iter().map(|r| r.1 == me).collect();
        assert_eq!(here, [false, false, true, true, true]);
        assert_eq!(
            tries.load(Ordering::SeqCst),
            3,
            "no thread is tried after the first that could not start"
        );
        // Not a single thread: everything on the calling thread.
        let out = scoped_with(job_ids(3), || {
            Err(io::Error::from(io::ErrorKind::OutOfMemory))
        });
        assert!(out.iter().all(|r| r.1 == me));
        assert_eq!(out.len(), 3);
    }

    #[test]
    fn jobs_borrow_from_the_caller_and_a_panic_is_passed_on() {
        let data = [1u64, 2, 3, 4, 5, 6];
        let sums = scoped(data.chunks(2).map(|c| move || c.iter().sum::<u64>()));
        assert_eq!(sums, [3, 7, 11]);
        let r = std::panic::catch_unwind(|| {
            scoped([|| panic!("a share failed")]);
        });
        assert!(r.is_err());
    }
}
