//! Failed sign-ins slow down: after [`FREE_FAILURES`] failures for a name
//! (or from one client address, when the server knows it), each further
//! attempt must wait twice as long as the one before, up to
//! [`MAX_WAIT`]; an attempt during the wait is refused without checking
//! the password. A success clears the name. Kept per process: several API
//! processes each slow an attacker down on their own.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Failures allowed before the waits begin.
pub const FREE_FAILURES: u32 = 3;
/// Longest wait between two attempts.
pub const MAX_WAIT: Duration = Duration::from_secs(300);
/// Keys kept at most (the oldest are dropped past it).
const MOST_KEYS: usize = 100_000;

#[derive(Debug, Clone, Copy)]
struct Failures {
    count: u32,
    last: Instant,
}

/// Failed sign-ins by key (`name:alice`, `ip:10.0.0.1`).
#[derive(Debug, Default)]
pub struct Throttle {
    failures: Mutex<HashMap<String, Failures>>,
}

/// How long after the last failure the next attempt may come.
pub fn wait_after(count: u32) -> Duration {
    if count < FREE_FAILURES {
        return Duration::ZERO;
    }
    let doublings = (count - FREE_FAILURES).min(16);
    Duration::from_secs(1u64 << doublings).min(MAX_WAIT)
}

impl Throttle {
    /// The time left to wait before `keys` may try again (zero: go on).
    pub fn wait(&self, keys: &[String]) -> Duration {
        let map = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        keys.iter()
            .filter_map(|k| map.get(k))
            .map(|f| wait_after(f.count).saturating_sub(f.last.elapsed()))
            .max()
            .unwrap_or(Duration::ZERO)
    }

    /// Counts a failure against every key.
    pub fn failed(&self, keys: &[String]) {
        let mut map = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        if map.len() > MOST_KEYS {
            let cutoff = MAX_WAIT * 2;
            map.retain(|_, f| f.last.elapsed() < cutoff);
        }
        for k in keys {
            let f = map.entry(k.clone()).or_insert(Failures {
                count: 0,
                last: Instant::now(),
            });
            f.count += 1;
            f.last = Instant::now();
        }
    }

    /// Clears a key after a success.
    pub fn succeeded(&self, key: &str) {
        let mut map = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        map.remove(key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_double_after_the_free_failures_and_stop_at_the_cap() {
        assert_eq!(wait_after(0), Duration::ZERO);
        assert_eq!(wait_after(FREE_FAILURES - 1), Duration::ZERO);
        assert_eq!(wait_after(FREE_FAILURES), Duration::from_secs(1));
        assert_eq!(wait_after(FREE_FAILURES + 3), Duration::from_secs(8));
        assert_eq!(wait_after(1000), MAX_WAIT);
    }

    #[test]
    fn a_name_waits_once_it_failed_too_often_and_is_free_after_a_success() {
        let t = Throttle::default();
        let keys = vec!["name:alice".to_owned()];
        for _ in 0..FREE_FAILURES {
            assert_eq!(t.wait(&keys), Duration::ZERO);
            t.failed(&keys);
        }
        assert!(t.wait(&keys) > Duration::from_millis(500));
        assert_eq!(t.wait(&["name:bob".to_owned()]), Duration::ZERO);
        t.succeeded("name:alice");
        assert_eq!(t.wait(&keys), Duration::ZERO);
    }
}
