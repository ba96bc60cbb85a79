//! The HTTP door's state: what every handler shares (the core, the keys'
//! cache and limits, the order batcher) and the server's settings. The
//! handlers take it from here, not from the file that mounts them.

use std::sync::Arc;
use std::time::Duration;

use codepool_issuance::api_keys;
use codepool_issuance::{Core, Door};

use crate::batcher;

/// How the API server runs.
#[derive(Debug, Clone)]
pub struct ApiConfig {
    /// Largest request body accepted (an order is a few hundred bytes).
    pub body_limit: usize,
    /// Longest a request may take, reading its body included.
    pub request_timeout: Duration,
    /// Requests per second each key may make (a burst of twice as many).
    pub rate_per_key: u32,
    /// Longest a client may take to send a request's head (and longest an
    /// idle keep-alive connection stays open).
    pub header_timeout: Duration,
    /// Connections served at once; further ones wait to be accepted.
    pub max_connections: usize,
    /// Serve HTTPS with these settings (`--tls-cert`, `--tls-key`).
    pub tls: Option<Arc<tokio_rustls::rustls::ServerConfig>>,
    /// Codes one key may name that match nothing (`/v1/codes/check` and
    /// `/v1/codes/redeem`), per minute; past it the key is slowed: 429
    /// with `Retry-After` on every code it names until a miss is allowed
    /// again.
    pub redeem_misses_per_minute: u32,
}

impl Default for ApiConfig {
    fn default() -> Self {
        Self {
            body_limit: 16 * 1024,
            request_timeout: Duration::from_secs(30),
            rate_per_key: 200,
            header_timeout: Duration::from_secs(10),
            max_connections: 1024,
            tls: None,
            redeem_misses_per_minute: 30,
        }
    }
}

/// What every handler shares: the core's services, and the HTTP door's
/// own keys, limits and order batcher.
pub struct Api {
    pub(crate) core: Arc<Core>,
    pub(crate) keys: api_keys::Verifier,
    pub(crate) config: ApiConfig,
    /// Each key's requests per second, a burst of twice as many.
    limits: governor::DefaultKeyedRateLimiter<String>,
    /// Concurrent orders, placed together.
    pub(crate) orders: batcher::Batcher,
    /// Concurrent holds, placed together.
    pub(crate) holds: codepool_issuance::holds::HoldBatcher,
    /// Codes found by value for the platform's keys.
    pub(crate) finder: codepool_issuance::redeem::Finder,
    /// Each key's lookups by value that matched nothing.
    pub(crate) misses: Misses,
}

impl std::ops::Deref for Api {
    type Target = Core;
    fn deref(&self) -> &Core {
        &self.core
    }
}

impl Api {
    pub fn new(core: Arc<Core>, config: ApiConfig) -> Arc<Self> {
        let holds = codepool_issuance::holds::HoldBatcher::start(core.clone(), Door::Http);
        Arc::new(Self {
            orders: batcher::Batcher::start(Arc::downgrade(&core)),
            holds,
            finder: codepool_issuance::redeem::Finder::new(core.store().clone()),
            misses: Misses::new(config.redeem_misses_per_minute),
            core,
            keys: api_keys::Verifier::default(),
            limits: per_key_limiter(config.rate_per_key),
            config,
        })
    }

    /// Waits, for up to `limit`, until the orders answered so far have had
    /// their events published. Whether they all have.
    pub async fn settle(&self, limit: Duration) -> bool {
        self.orders.settle(limit).await
    }

    /// The core this API serves (the console mounts on the same one).
    pub fn core(&self) -> &Arc<Core> {
        &self.core
    }

    /// Takes one request from `key`'s bucket; the seconds to wait when it
    /// is empty.
    pub(crate) fn take(&self, key: &str) -> Result<(), u64> {
        use governor::clock::Clock;
        self.limits.check_key(&key.to_owned()).map_err(|not_until| {
            let wait = not_until.wait_time_from(governor::clock::DefaultClock::default().now());
            wait.as_secs_f64().ceil().max(1.0) as u64
        })
    }
}

/// Each key's budget of codes named that matched nothing: `per_minute`,
/// all of it at once, refilled evenly. A lookup reserves one miss of the
/// budget BEFORE it runs and gives it back when it found the code, so
/// however many requests a key sends at once, no more lookups than the
/// budget can still miss are in flight: the others wait their turn. A key
/// whose budget is spent by misses is slowed: every code it names is
/// answered 429 until the budget holds one again. Guessing codes costs a
/// key time, not just requests; an honest platform's lookups only queue.
pub(crate) struct Misses {
    per_minute: f64,
    buckets: std::sync::Mutex<std::collections::HashMap<String, Bucket>>,
    /// Woken when a reservation ends.
    freed: tokio::sync::Notify,
}

struct Bucket {
    /// Misses left (reserved ones included).
    left: f64,
    /// Lookups in flight, each holding one of `left`.
    reserved: u32,
    at: std::time::Instant,
}

/// Whether a lookup may start now.
enum Turn {
    Go,
    /// Every miss left is held by a lookup in flight: wait for one.
    Wait,
    /// The budget is spent: the seconds until it holds a miss again.
    Spent(u64),
}

/// A miss reserved for one lookup: given back when dropped, unless the
/// lookup found nothing ([`Reserved::missed`]).
pub(crate) struct Reserved<'a> {
    misses: &'a Misses,
    key: String,
    missed: bool,
}

impl Reserved<'_> {
    /// The lookup found nothing: the miss is spent.
    pub(crate) fn missed(mut self) {
        self.missed = true;
    }
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        self.misses.release(&self.key, self.missed);
    }
}

/// Longest a lookup waits for its turn before it is answered 429.
const TURN_WAIT: Duration = Duration::from_secs(5);

impl Misses {
    fn new(per_minute: u32) -> Self {
        Misses {
            per_minute: f64::from(per_minute.max(1)),
            buckets: Default::default(),
            freed: tokio::sync::Notify::new(),
        }
    }

    fn turn(&self, key: &str) -> Turn {
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        let now = std::time::Instant::now();
        let b = buckets.entry(key.to_owned()).or_insert(Bucket {
            left: self.per_minute,
            reserved: 0,
            at: now,
        });
        let refill = now.duration_since(b.at).as_secs_f64() * self.per_minute / 60.0;
        b.left = (b.left + refill).min(self.per_minute);
        b.at = now;
        if b.left - f64::from(b.reserved) >= 1.0 {
            b.reserved += 1;
            return Turn::Go;
        }
        if b.left >= 1.0 {
            return Turn::Wait;
        }
        let wait = (1.0 - b.left) * 60.0 / self.per_minute;
        Turn::Spent(wait.ceil().max(1.0) as u64)
    }

    /// Reserves one miss of `key`'s budget for a lookup about to run,
    /// waiting while the misses left are all held by lookups in flight;
    /// the seconds to wait when the budget is spent.
    pub(crate) async fn reserve(&self, key: &str) -> Result<Reserved<'_>, u64> {
        let deadline = tokio::time::Instant::now() + TURN_WAIT;
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            match self.turn(key) {
                Turn::Go => {
                    return Ok(Reserved {
                        misses: self,
                        key: key.to_owned(),
                        missed: false,
                    })
                }
                Turn::Spent(wait) => return Err(wait),
                Turn::Wait => {
                    if tokio::time::timeout_at(deadline, freed).await.is_err() {
                        return Err(TURN_WAIT.as_secs());
                    }
                }
            }
        }
    }

    fn release(&self, key: &str, missed: bool) {
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = buckets.get_mut(key) {
            b.reserved = b.reserved.saturating_sub(1);
            if missed {
                b.left = (b.left - 1.0).max(0.0);
            }
        }
        drop(buckets);
        self.freed.notify_waiters();
    }
}

/// A limiter of `rate` requests per second per key, with a burst of
/// twice as many.
fn per_key_limiter(rate: u32) -> governor::DefaultKeyedRateLimiter<String> {
    let rate = std::num::NonZeroU32::new(rate.max(1)).unwrap_or(std::num::NonZeroU32::MIN);
    let burst = rate.saturating_mul(std::num::NonZeroU32::new(2).unwrap_or(rate));
    governor::RateLimiter::keyed(governor::Quota::per_second(rate).allow_burst(burst))
}
