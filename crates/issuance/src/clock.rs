//! The time the core's TTL caches read (pool policies, shops, API keys):
//! the system's monotonic clock in production, a clock a test moves by
//! hand so that a TTL is passed without waiting it out.

use std::fmt::Debug;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Where a cache reads the time.
pub trait Clock: Send + Sync + Debug {
    fn now(&self) -> Instant;
}

/// The system's monotonic clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// The system clock, shared.
pub fn system() -> Arc<dyn Clock> {
    Arc::new(SystemClock)
}

/// A clock that stands still until a test moves it.
#[derive(Debug)]
pub struct ManualClock(Mutex<Instant>);

impl ManualClock {
    /// Starting at the system's now.
    pub fn new() -> Arc<Self> {
        Arc::new(Self(Mutex::new(Instant::now())))
    }

    /// Moves the clock on by `by`.
    pub fn advance(&self, by: Duration) {
        if let Ok(mut t) = self.0.lock() {
            *t += by;
        }
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        self.0
            .lock()
            .map(|t| *t)
            .unwrap_or_else(|e| *e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_moves_only_when_told() {
        let c = ManualClock::new();
        let t = c.now();
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(c.now(), t);
        c.advance(Duration::from_secs(2));
        assert_eq!(c.now(), t + Duration::from_secs(2));
    }
}
