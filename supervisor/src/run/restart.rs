//! When to restart a failed worker.

use std::time::Duration;

pub const BACKOFF_FIRST: Duration = Duration::from_secs(1);
pub const BACKOFF_CAP: Duration = Duration::from_secs(60);

/// Delay before the restart that follows the `consecutive`-th failure in a row (counting
/// from 0): the first restart is immediate, then 1 s, 2 s, 4 s, ... capped at 60 s.
pub fn backoff(consecutive: u32) -> Duration {
    if consecutive == 0 {
        return Duration::ZERO;
    }
    let shift = (consecutive - 1).min(16);
    (BACKOFF_FIRST * (1u32 << shift)).min(BACKOFF_CAP)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_restart_is_immediate_then_doubles_to_the_cap() {
        let secs: Vec<u64> = (0..10).map(|k| backoff(k).as_secs()).collect();
        assert_eq!(secs, vec![0, 1, 2, 4, 8, 16, 32, 60, 60, 60]);
        assert_eq!(backoff(u32::MAX), BACKOFF_CAP);
    }
}
