//! Inventory per pool, computed from MongoDB with index count scans of
//! the codes handed out, the pool's total from [`crate::ledger`] (so the
//! cost does not grow with a pool's unissued stock), and one aggregation
//! of waiting backorders.

use std::collections::BTreeMap;

use bson::{doc, DateTime, Document};
use futures::{StreamExt, TryStreamExt};
use serde::Serialize;

use crate::backorders::{BackorderState, BACKORDERS};
use crate::collections::{as_u64, CODES};
use crate::{Store, StoreError};

/// Pools whose counts are in flight at once in [`Store::stats_of`].
const STATS_CONCURRENCY: usize = 16;

/// Counts of one pool's codes and backorders.
#[derive(Debug, Default, Clone, PartialEq, Serialize)]
pub struct PoolStats {
    pub pool: String,
    pub unissued: u64,
    pub issued: u64,
    pub used: u64,
    pub void: u64,
    /// Codes held for checkouts (or bundles being put together): no one's
    /// yet, and no one else's.
    pub held: u64,
    /// Unissued codes whose `expires_at` has passed (not yet voided).
    pub expired: u64,
    pub backorders_waiting: u64,
    pub issued_last_hour: u64,
    pub issued_last_day: u64,
}

/// The codes handed out and still the buyer's or used: issued (1) and used
/// (2). A held code (4) has `issued_at` too, from its hold, but is no one's
/// yet; it counts once its order is placed.
const GRANTED: [i32; 2] = [1, 2];

/// The index [`grants_since`] and [`Store::grants_by_hour`] read.
const GRANTS_INDEX: &str = "pool_status_issued_at";

/// The filter of `pool`'s codes handed out at `since` or later and issued
/// or used now. Only codes handed out (or held) have `issued_at`, and none
/// loses it, so this reads two short ranges of the partial
/// `(pool, status, issued_at)` index, keys only: its cost follows the
/// grants of the period, not every grant the pool ever made, nor its
/// stock.
fn grants_since(pool: &str, since: DateTime) -> Document {
    doc! {"pool": pool, "status": {"$in": GRANTED.to_vec()}, "issued_at": {"$gte": since}}
}

impl Store {
    /// The `count` command: a count scan of an index, without fetching a
    /// document (tens of millions of keys a second), unlike
    /// `count_documents`, which is an aggregation.
    pub(crate) async fn count_scan(&self, query: Document) -> Result<u64, StoreError> {
        let reply = self
            .database()
            .run_command(doc! {"count": CODES, "query": query})
            .await?;
        Ok(as_u64(reply.get("n")))
    }

    /// [`Store::count_scan`] on the named index.
    async fn count_on(&self, query: Document, index: &str) -> Result<u64, StoreError> {
        let reply = self
            .database()
            .run_command(doc! {"count": CODES, "query": query, "hint": index})
            .await?;
        Ok(as_u64(reply.get("n")))
    }

    /// One pool's codes by status, each answered from an index:
    /// `(pool, status, seq)` for the codes handed out, the partial expiry
    /// index for expired codes, and the [`crate::ledger`] for the pool's
    /// total. The unissued stock is what remains, so no query reads or
    /// counts the pool's unissued codes: the cost follows the codes
    /// handed out, not the stock.
    async fn count_statuses(&self, s: &mut PoolStats, now: DateTime) -> Result<(), StoreError> {
        let pool = s.pool.clone();
        let status = |st: i32| doc! {"pool": &pool, "status": st};
        s.expired = self
            .count_scan(doc! {"pool": &pool, "status": 0, "expires_at": {"$lte": now}})
            .await?;
        s.issued = self.count_scan(status(1)).await?;
        s.used = self.count_scan(status(2)).await?;
        s.void = self.count_scan(status(3)).await?;
        s.held = self.count_scan(status(4)).await?;
        // Counted last: a code inserted meanwhile shows as unissued, and a
        // code claimed meanwhile was unissued when `issued` was counted.
        let total = self.codes_in_pool(&pool).await?;
        s.unissued = total.saturating_sub(s.issued + s.used + s.void + s.held + s.expired);
        Ok(())
    }

    /// Unissued, unexpired codes in `pool`, from the same counts as
    /// `codepool stats` (cheap on a pool of any size); see
    /// [`Store::unissued_count`] for a count of the documents themselves.
    pub async fn unissued_stock(&self, pool: &str) -> Result<u64, StoreError> {
        let mut s = PoolStats {
            pool: pool.to_owned(),
            ..PoolStats::default()
        };
        self.count_statuses(&mut s, DateTime::now()).await?;
        Ok(s.unissued)
    }

    /// Fills in one pool's code counts and its grants of the last hour
    /// and day (issued or used now; not held).
    async fn count_codes(
        &self,
        s: &mut PoolStats,
        now: DateTime,
        hour_ago: DateTime,
        day_ago: DateTime,
    ) -> Result<(), StoreError> {
        self.count_statuses(s, now).await?;
        s.issued_last_hour = (self.count_on(grants_since(&s.pool, hour_ago), GRANTS_INDEX)).await?;
        s.issued_last_day = (self.count_on(grants_since(&s.pool, day_ago), GRANTS_INDEX)).await?;
        Ok(())
    }

    /// One pool's counts ([`Store::count_codes`]).
    async fn counted(
        &self,
        pool: String,
        now: DateTime,
        hour_ago: DateTime,
        day_ago: DateTime,
    ) -> Result<PoolStats, StoreError> {
        let mut s = PoolStats {
            pool,
            ..PoolStats::default()
        };
        self.count_codes(&mut s, now, hour_ago, day_ago).await?;
        Ok(s)
    }

    /// Inventory of every pool (or one), sorted by name.
    pub async fn pool_stats(&self, pool: Option<&str>) -> Result<Vec<PoolStats>, StoreError> {
        let pools: Vec<String> = match pool {
            Some(p) => self.pool(p).await?.into_iter().map(|d| d.name).collect(),
            None => self.pools().await?.into_iter().map(|d| d.name).collect(),
        };
        let names: Vec<&str> = pools.iter().map(String::as_str).collect();
        self.stats_of(&names).await
    }

    /// Inventory of these pools, sorted by name: a few bounded counts per
    /// pool and one query for their backorders, whatever the number of
    /// other pools (a page of the API's pool list costs the same with
    /// 10,000 pools as with ten).
    pub async fn stats_of(&self, pools: &[&str]) -> Result<Vec<PoolStats>, StoreError> {
        let now = DateTime::now();
        let hour_ago = DateTime::from_millis(now.timestamp_millis() - 3_600_000);
        let day_ago = DateTime::from_millis(now.timestamp_millis() - 86_400_000);
        // A page's pools are counted a few at a time: each count is a
        // round trip, and a page of 50 pools is 350 of them.
        let counts: Vec<_> = pools
            .iter()
            .map(|p| self.counted((*p).to_owned(), now, hour_ago, day_ago))
            .collect();
        let counted: Vec<PoolStats> = futures::stream::iter(counts)
            .buffered(STATS_CONCURRENCY)
            .try_collect()
            .await?;
        let mut stats: BTreeMap<String, PoolStats> =
            counted.into_iter().map(|s| (s.pool.clone(), s)).collect();
        let rows: Vec<Document> = self
            .collection(BACKORDERS)
            .aggregate(vec![
                doc! {"$match": {"pool": {"$in": pools}, "status": BackorderState::Waiting.as_str()}},
                doc! {"$group": {"_id": "$pool", "n": {"$sum": 1}}},
            ])
            .await?
            .try_collect()
            .await?;
        for r in rows {
            if let Some(s) = r.get_str("_id").ok().and_then(|n| stats.get_mut(n)) {
                s.backorders_waiting = as_u64(r.get("n"));
            }
        }
        Ok(stats.into_values().collect())
    }
}

impl Store {
    /// `pool`'s grants per hour since `since` (hours without a grant left
    /// out; held codes are not grants), oldest first: one covered scan of
    /// the `(pool, status, issued_at)` index over the period's grants,
    /// whatever the pool's stock.
    pub async fn grants_by_hour(
        &self,
        pool: &str,
        since: DateTime,
    ) -> Result<Vec<(DateTime, u64)>, StoreError> {
        let pipeline = vec![
            doc! {"$match": grants_since(pool, since)},
            doc! {"$project": {"_id": 0, "issued_at": 1}},
            doc! {"$group": {
                "_id": {"$dateTrunc": {"date": "$issued_at", "unit": "hour"}},
                "n": {"$sum": 1},
            }},
            doc! {"$sort": {"_id": 1}},
        ];
        let rows: Vec<Document> = self
            .collection(CODES)
            .aggregate(pipeline)
            .hint(mongodb::options::Hint::Name(GRANTS_INDEX.into()))
            .await?
            .try_collect()
            .await?;
        Ok(rows
            .iter()
            .filter_map(|r| Some((*r.get_datetime("_id").ok()?, as_u64(r.get("n")))))
            .collect())
    }
}
