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
    /// Codes checked and redeemed by value for the platform's keys, each
    /// key held to its budget of misses (the core's rule).
    pub(crate) by_code: codepool_issuance::by_code::ByCode,
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
            by_code: codepool_issuance::by_code::ByCode::new(
                &core,
                config.redeem_misses_per_minute,
            ),
            core,
            keys: api_keys::Verifier::default(),
            limits: per_key_limiter(config.rate_per_key),
            config,
        })
    }

    /// Takes no more orders or holds, and waits, for up to `limit`, until
    /// those queued were placed and the orders answered so far have had
    /// their events published. Whether they all have.
    pub async fn settle(&self, limit: Duration) -> bool {
        let (orders, holds) = tokio::join!(self.orders.settle(limit), self.holds.stopped(limit));
        orders && holds
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

/// A limiter of `rate` requests per second per key, with a burst of
/// twice as many.
fn per_key_limiter(rate: u32) -> governor::DefaultKeyedRateLimiter<String> {
    let rate = std::num::NonZeroU32::new(rate.max(1)).unwrap_or(std::num::NonZeroU32::MIN);
    let burst = rate.saturating_mul(std::num::NonZeroU32::new(2).unwrap_or(rate));
    governor::RateLimiter::keyed(governor::Quota::per_second(rate).allow_burst(burst))
}
