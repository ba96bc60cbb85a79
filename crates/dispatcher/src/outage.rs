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

/// Capped exponential backoff: 100 ms, 200 ms, … up to 5 s.
pub fn backoff(attempt: u32) -> Duration {
    let ms = 100u64.saturating_mul(1u64 << attempt.min(6));
    Duration::from_millis(ms.min(5000))
}
