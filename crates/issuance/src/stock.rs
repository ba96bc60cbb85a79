//! Watching stock: the `codepool_pool_unissued{pool}` gauge, and the
//! `pool.low_stock` event, published once per crossing below a pool's
//! threshold (not once per claim), then re-armed when stock is back.
//!
//! Counting a pool's stock is a MongoDB query, so it is not done per
//! purchase: after a batch with fresh grants, each affected pool gets a
//! check at most once per [`StockConfig::min_interval`]. A batch that lands
//! inside the interval schedules one trailing check, so the last claims
//! before a quiet period are never left unjudged. Which dispatcher
//! publishes is decided by MongoDB ([`Store::claim_low_stock_alert`]), so
//! several dispatchers still publish once.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use codepool_broker::Publisher;
use codepool_domain::{PoolEvent, PoolEventKind};
use codepool_store::pools::PoolDoc;
use codepool_store::{Store, StoreError};
use tracing::{debug, info, warn};

/// Stock is counted up to this many codes (or the pool's low-stock
/// threshold + 1, if higher), so a check costs the same for a pool of ten
/// million codes as for one of a thousand. `codepool_pool_unissued` is
/// exact below the cap and reads the cap at or above it.
pub const STOCK_COUNT_CAP: u64 = 1000;

/// Pools counted together by the sweep, between looks at which of them a
/// check after grants has counted meanwhile.
const SWEEP_CHUNK: usize = 256;

/// Checks due within this many milliseconds of each other run together.
const GROUP_MS: u128 = 10;

/// How often stock may be counted and expired codes swept.
#[derive(Debug, Clone)]
pub struct StockConfig {
    /// At most one stock check per pool in this interval.
    pub min_interval: Duration,
    /// How often the expiry sweep runs (it also re-checks every pool).
    pub sweep_every: Duration,
}

impl StockConfig {
    /// A process that grants checks each pool's stock at most every 5 s:
    /// with a thousand busy pools, a check a second per pool (a pool read
    /// and a bounded count each) was thousands of queries a second.
    pub fn granting() -> Self {
        Self {
            min_interval: Duration::from_secs(5),
            ..Self::default()
        }
    }
}

impl Default for StockConfig {
    fn default() -> Self {
        Self {
            min_interval: Duration::from_secs(1),
            sweep_every: Duration::from_secs(60),
        }
    }
}

/// What a stock check found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StockLevel {
    /// The pool does not exist (any more).
    UnknownPool,
    /// At or above the threshold, or no threshold set. `unissued` is
    /// counted up to [`STOCK_COUNT_CAP`] (or the threshold + 1).
    Ok { unissued: u64 },
    /// Below the threshold. `alerted` is true for the one check that
    /// published `pool.low_stock` for this crossing.
    Low { unissued: u64, alerted: bool },
}

/// A pool's threshold and stock as its last check found them.
#[derive(Debug, Clone, Copy)]
struct Known {
    /// The low-stock threshold (0: none).
    threshold: i64,
    /// Unissued codes as counted (up to the count's cap).
    unissued: u64,
    /// When the count began: it saw every grant made before then.
    counted_at: Instant,
}

impl Known {
    /// A pool without a threshold whose stock was counted exactly (below
    /// [`STOCK_COUNT_CAP`], its cap when there is no threshold) needs no
    /// query after grants: its gauge goes down by what was granted. (The
    /// periodic sweep counts again, and picks up a threshold set since.)
    fn follows_grants(&self) -> bool {
        self.threshold <= 0 && self.unissued < STOCK_COUNT_CAP
    }
}

#[derive(Debug, Default)]
struct Schedule {
    last: Option<Instant>,
    queued: bool,
    /// When the latest grants that wait for the queued check were made.
    latest_grants: Option<Instant>,
}

/// Stock checks of all pools of one dispatcher. Shared by its sessions.
pub struct StockWatch {
    store: Store,
    config: StockConfig,
    schedule: Mutex<HashMap<String, Schedule>>,
    /// What the last check of each pool found.
    known: Mutex<HashMap<String, Known>>,
}

impl StockWatch {
    pub fn new(store: Store, config: StockConfig) -> Arc<Self> {
        Arc::new(Self {
            store,
            config,
            schedule: Mutex::new(HashMap::new()),
            known: Mutex::new(HashMap::new()),
        })
    }

    pub fn config(&self) -> &StockConfig {
        &self.config
    }

    /// Accounts for `(pool, fresh grants)` of a batch: a pool known to have
    /// no low-stock threshold and fewer codes than the count's cap has its
    /// gauge lowered by its grants; every other pool gets a check. Returns
    /// at once; the checks run in the background, throttled.
    pub fn after_grants<'a>(
        self: &Arc<Self>,
        grants: impl IntoIterator<Item = (&'a str, u64)>,
        publisher: &Publisher,
    ) {
        let mut to_check = Vec::new();
        if let Ok(mut known) = self.known.lock() {
            for (pool, n) in grants {
                match known.get_mut(pool).filter(|k| k.follows_grants()) {
                    Some(k) => {
                        k.unissued = k.unissued.saturating_sub(n);
                        metrics::gauge!("codepool_pool_unissued", "pool" => pool.to_owned())
                            .set(k.unissued as f64);
                    }
                    None => to_check.push(pool),
                }
            }
        }
        self.schedule_checks(to_check, publisher);
    }

    /// Forgets what was known of `pool` (codes were imported, or its
    /// settings changed): its next grants bring a check.
    pub fn forget(&self, pool: &str) {
        if let Ok(mut known) = self.known.lock() {
            known.remove(pool);
        }
    }

    /// A check of each pool, at most one per pool per `min_interval`.
    /// Pools due at the same moment are checked together
    /// ([`Self::check_many`]): a batch over many cold pools costs a few
    /// queries, not two per pool.
    fn schedule_checks(self: &Arc<Self>, pools: Vec<&str>, publisher: &Publisher) {
        let Ok(mut schedule) = self.schedule.lock() else {
            return;
        };
        let mut due: HashMap<Duration, Vec<String>> = HashMap::new();
        let now = Instant::now();
        for pool in pools {
            let s = schedule.entry(pool.to_owned()).or_default();
            s.latest_grants = Some(now);
            if s.queued {
                // A check is coming and will see this batch's grants.
                continue;
            }
            s.queued = true;
            let delay = s.last.map_or(Duration::ZERO, |t| {
                (t + self.config.min_interval).saturating_duration_since(now)
            });
            // Pools due within the same few milliseconds go together.
            let delay = Duration::from_millis(
                delay.as_millis().div_ceil(GROUP_MS) as u64 * GROUP_MS as u64,
            );
            due.entry(delay).or_default().push(pool.to_owned());
        }
        drop(schedule);
        for (delay, pools) in due {
            let this = self.clone();
            let publisher = publisher.clone();
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                let pools = this.still_unjudged(pools);
                let names: Vec<&str> = pools.iter().map(String::as_str).collect();
                let failed = match this.check_many(&names, &publisher).await {
                    Ok(levels) => levels.into_iter().filter_map(Result::err).collect(),
                    Err(e) => vec![e],
                };
                for e in failed {
                    debug!(pools = names.len(), error = %e, "stock check skipped");
                }
            });
        }
    }

    /// Of `pools` whose scheduled check is starting, those a count has not
    /// judged since their latest grants. From here on a new batch schedules
    /// a new check: this one may count before that batch's grants.
    fn still_unjudged(&self, pools: Vec<String>) -> Vec<String> {
        let mut waiting = Vec::with_capacity(pools.len());
        let now = Instant::now();
        if let Ok(mut schedule) = self.schedule.lock() {
            for pool in pools {
                let s = schedule.entry(pool.clone()).or_default();
                s.queued = false;
                s.last = Some(now);
                waiting.push((pool, s.latest_grants.take()));
            }
        }
        // A count that began after every grant waiting for this check (the
        // sweep's, say) has already judged them.
        waiting
            .into_iter()
            .filter(|(pool, latest)| !latest.is_some_and(|t| self.counted_since(pool, t)))
            .map(|(pool, _)| pool)
            .collect()
    }

    /// True when a count of `pool` began at or after `t`.
    fn counted_since(&self, pool: &str, t: Instant) -> bool {
        self.known
            .lock()
            .is_ok_and(|k| k.get(pool).is_some_and(|k| k.counted_at >= t))
    }

    /// Counts the pool's unissued stock now, updates the gauge, and
    /// publishes `pool.low_stock` if this check is the first to see stock
    /// below the threshold since it was last above (or re-arms the alert if
    /// stock is back).
    pub async fn check(&self, pool: &str, publisher: &Publisher) -> Result<StockLevel, StoreError> {
        let mut levels = self.check_many(&[pool], publisher).await?;
        levels.pop().unwrap_or(Ok(StockLevel::UnknownPool))
    }

    /// [`Self::check`] of several pools: their documents in one query, their
    /// counts in a few. Aligned with `pools`; one pool's failure (to publish
    /// its alert, say) does not keep the others from being judged.
    async fn check_many(
        &self,
        pools: &[&str],
        publisher: &Publisher,
    ) -> Result<Vec<Result<StockLevel, StoreError>>, StoreError> {
        if pools.is_empty() {
            return Ok(Vec::new());
        }
        let docs = self.store.pools_named(pools).await?;
        let mut judged: HashMap<String, Result<StockLevel, StoreError>> = docs
            .iter()
            .map(|d| d.name.clone())
            .zip(self.judge_many(&docs, publisher).await?)
            .collect();
        Ok(pools
            .iter()
            .map(|p| judged.remove(*p).unwrap_or(Ok(StockLevel::UnknownPool)))
            .collect())
    }

    /// Counts the stock of pools whose documents were just read, then
    /// judges each ([`Self::judge`]). Aligned with `docs`.
    async fn judge_many(
        &self,
        docs: &[PoolDoc],
        publisher: &Publisher,
    ) -> Result<Vec<Result<StockLevel, StoreError>>, StoreError> {
        let counted_at = Instant::now();
        let asks: Vec<(&str, u64)> = docs
            .iter()
            .map(|d| {
                let threshold = d.low_stock.unwrap_or(0).max(0) as u64;
                (d.name.as_str(), STOCK_COUNT_CAP.max(threshold + 1))
            })
            .collect();
        let counts = self.store.unissued_counts_upto(&asks).await?;
        let mut levels = Vec::with_capacity(docs.len());
        for (doc, unissued) in docs.iter().zip(counts) {
            levels.push(self.judge(doc, unissued, counted_at, publisher).await);
        }
        Ok(levels)
    }

    /// Records a pool's count (begun at `counted_at`) and acts on it.
    async fn judge(
        &self,
        doc: &PoolDoc,
        unissued: u64,
        counted_at: Instant,
        publisher: &Publisher,
    ) -> Result<StockLevel, StoreError> {
        let pool = doc.name.as_str();
        let threshold = doc.low_stock.unwrap_or(0);
        metrics::gauge!("codepool_pool_unissued", "pool" => pool.to_owned()).set(unissued as f64);
        metrics::gauge!("codepool_pool_low_stock_threshold", "pool" => pool.to_owned())
            .set(threshold.max(0) as f64);
        if let Ok(mut known) = self.known.lock() {
            known.insert(
                pool.to_owned(),
                Known {
                    threshold,
                    unissued,
                    counted_at,
                },
            );
        }
        if threshold <= 0 || unissued >= threshold as u64 {
            if doc.low_stock_alerted && self.store.rearm_low_stock_alert(pool).await? {
                info!(
                    pool,
                    unissued,
                    threshold,
                    "stock is back above the low-stock threshold; alert re-armed"
                );
            }
            return Ok(StockLevel::Ok { unissued });
        }
        let crossing = match doc.low_stock_alerted {
            true => None,
            false => self.store.claim_low_stock_alert(pool).await?,
        };
        let alerted = crossing.is_some();
        if let Some(crossing) = crossing {
            warn!(
                pool,
                unissued,
                threshold,
                "low stock: import more codes (`codepool import FILE --pool {pool}`)"
            );
            let mut event = PoolEvent::new(PoolEventKind::LowStock, pool);
            event.unissued = Some(unissued);
            // Named by the crossing: told again after a failed publish,
            // the shops' events are the same ones.
            crate::webhooks::record_pool_event(
                &self.store,
                &event,
                &format!("crossing {crossing}"),
            )
            .await;
            let published = match publisher.publish_pool_event(&event).await {
                Ok(c) => c.wait().await,
                Err(e) => Err(e),
            };
            match published {
                Ok(()) => {
                    metrics::counter!("codepool_low_stock_alerts_total", "pool" => pool.to_owned())
                        .increment(1);
                }
                Err(e) => {
                    // Give the crossing back so the next check publishes it.
                    warn!(pool, error = %e, "could not publish pool.low_stock; retrying at the next check");
                    self.store.give_back_low_stock_alert(pool, crossing).await?;
                    return Ok(StockLevel::Low {
                        unissued,
                        alerted: false,
                    });
                }
            }
        }
        Ok(StockLevel::Low { unissued, alerted })
    }

    /// Checks every pool (the periodic sweep; also refreshes every gauge).
    /// A pool counted since the sweep began (after its grants) is not
    /// counted again.
    pub async fn check_all(&self, publisher: &Publisher) -> Result<(), StoreError> {
        let started = Instant::now();
        let pools = self.store.pools().await?;
        for chunk in pools.chunks(SWEEP_CHUNK) {
            let due: Vec<PoolDoc> = chunk
                .iter()
                .filter(|p| !self.counted_since(&p.name, started))
                .cloned()
                .collect();
            let judged = self.judge_many(&due, publisher).await?;
            for (pool, e) in due
                .iter()
                .zip(judged)
                .filter_map(|(p, r)| Some((p, r.err()?)))
            {
                warn!(pool = %pool.name, error = %e, "stock check failed; the next sweep tries again");
            }
        }
        Ok(())
    }
}
