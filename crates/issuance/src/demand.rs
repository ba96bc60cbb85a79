//! Recent demand per pool, in purchases per second: what sizes each pool's
//! hot-set refills, so a pool that sells a few codes a minute keeps a few
//! dozen candidates in Redis and a busy pool a few seconds' worth.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Length of one counting window.
const WINDOW: Duration = Duration::from_secs(1);
/// The shortest time a fresh window's count is spread over, so the first
/// batch of a cold pool does not read as an enormous rate.
const MIN_SPAN: Duration = Duration::from_millis(250);

#[derive(Debug)]
struct Window {
    started: Instant,
    count: u64,
    /// Purchases per second of the last complete window.
    last_rate: f64,
}

/// Purchases per second per pool, over the last window or so.
#[derive(Debug, Default)]
pub struct Demand {
    pools: Mutex<HashMap<String, Window>>,
}

impl Demand {
    /// Counts `k` purchases for each `(pool, k)`.
    pub fn record(&self, wants: &[(&str, usize)]) {
        let Ok(mut pools) = self.pools.lock() else {
            return;
        };
        let now = Instant::now();
        for (pool, k) in wants {
            let w = pools.entry((*pool).to_owned()).or_insert(Window {
                started: now,
                count: 0,
                last_rate: 0.0,
            });
            let age = now.duration_since(w.started);
            if age >= WINDOW {
                w.last_rate = w.count as f64 / age.as_secs_f64();
                w.count = 0;
                w.started = now;
            }
            w.count += *k as u64;
        }
    }

    /// Recent purchases per second of `pool` (0 for a pool never seen).
    pub fn per_sec(&self, pool: &str) -> f64 {
        let Ok(pools) = self.pools.lock() else {
            return 0.0;
        };
        pools.get(pool).map_or(0.0, |w| {
            let span = w.started.elapsed().max(MIN_SPAN).as_secs_f64();
            w.last_rate.max(w.count as f64 / span)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_never_seen_has_no_demand() {
        assert_eq!(Demand::default().per_sec("x"), 0.0);
    }

    #[test]
    fn a_first_batch_counts_over_a_quarter_second_at_least() {
        let d = Demand::default();
        d.record(&[("x", 100), ("y", 1)]);
        let x = d.per_sec("x");
        assert!(x <= 400.0 + 1e-9 && x > 300.0, "{x}");
        assert!(d.per_sec("y") <= 4.0 + 1e-9);
    }
}
