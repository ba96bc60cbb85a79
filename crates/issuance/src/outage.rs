//! Logging an outage once, not once per message: the first failure warns,
//! the first success after it says the dependency is back.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tracing::{info, warn};

/// Tracks whether a dependency is currently failing.
#[derive(Debug)]
pub struct Outage {
    name: &'static str,
    down: AtomicBool,
}

impl Outage {
    pub const fn new(name: &'static str) -> Self {
        Self {
            name,
            down: AtomicBool::new(false),
        }
    }

    /// Records a failure; logs only if this starts an outage.
    pub fn failed(&self, error: &dyn std::fmt::Display) {
        if !self.down.swap(true, Ordering::Relaxed) {
            warn!(dependency = self.name, error = %error, "{} unavailable; waiting for it and retrying (unacked purchases stay unacked)", self.name);
        }
    }

    /// Records a success; logs only if this ends an outage.
    pub fn ok(&self) {
        if self.down.swap(false, Ordering::Relaxed) {
            info!(dependency = self.name, "{} is back", self.name);
        }
    }
}

/// Shortest and longest wait between two tries.
pub const RETRY_MIN: Duration = Duration::from_millis(100);
pub const RETRY_MAX: Duration = Duration::from_secs(5);

/// The one retry and reconnect policy of every loop that waits out an
/// outage (a batch's claim, its backorders and publishes, a session's
/// reconnect, an upkeep message, the API's broker): backon's exponential
/// backoff from [`RETRY_MIN`] doubling to [`RETRY_MAX`], with jitter so
/// that processes which lost the same server do not all come back at the
/// same instant, and no limit on the tries (an outage is waited out; the
/// loops stop on shutdown).
#[derive(Debug)]
pub struct Retry {
    policy: backon::ExponentialBackoff,
    tries: u32,
}

impl Default for Retry {
    fn default() -> Self {
        Self::new()
    }
}

impl Retry {
    pub fn new() -> Self {
        use backon::BackoffBuilder;
        Self {
            policy: backon::ExponentialBuilder::default()
                .with_min_delay(RETRY_MIN)
                .with_max_delay(RETRY_MAX)
                .with_jitter()
                .without_max_times()
                .build(),
            tries: 0,
        }
    }

    /// How long to wait before the next try.
    pub fn delay(&mut self) -> Duration {
        self.tries += 1;
        self.policy.next().unwrap_or(RETRY_MAX)
    }

    /// How many waits so far (0: the first try has not failed).
    pub fn tries(&self) -> u32 {
        self.tries
    }

    /// Starts over after a success.
    pub fn reset(&mut self) {
        *self = Self::new();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_grow_with_jitter_up_to_the_cap_and_start_over() {
        let mut r = Retry::new();
        let first = r.delay();
        assert!(first >= RETRY_MIN && first <= 2 * RETRY_MIN, "{first:?}");
        let later: Vec<Duration> = (0..20).map(|_| r.delay()).collect();
        assert!(later.iter().all(|d| *d <= 2 * RETRY_MAX), "{later:?}");
        assert!(later[19] >= RETRY_MAX, "{later:?}");
        assert_eq!(r.tries(), 21);
        r.reset();
        assert_eq!(r.tries(), 0);
        assert!(r.delay() <= 2 * RETRY_MIN);
    }
}
