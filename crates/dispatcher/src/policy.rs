//! Pool policies at dispatch time: which pools exist and what their
//! operators decided (per-user limit, paused), cached for at most
//! [`POLICY_TTL`] so a pause is seen within a second; and the database
//! half of the per-user limit — slots taken by conditional updates, every
//! refusal recorded durably before anything is acked. The decision itself
//! is the pure [`apply_policies`].

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use chrono::Utc;
use codepool_domain::{PoolPolicy, Purchase, Refusal, RefusalReason};
use codepool_store::policies::{QuotaAsk, RefusalDoc};
use codepool_store::{Store, StoreError};
use tokio::sync::RwLock;

use crate::plan::{apply_policies, Intake, Verdicts};

/// How long a pool's policy is trusted before it is read again: the delay
/// between `codepool pool pause` and the last grant of the pool.
pub const POLICY_TTL: Duration = Duration::from_secs(1);

/// Pools known to exist, with their policy as last read.
#[derive(Debug, Default)]
pub struct PolicyCache {
    pools: RwLock<HashMap<String, (PoolPolicy, Instant)>>,
}

impl PolicyCache {
    /// The policies of `pools` that exist: fresh ones from the cache, the
    /// others in one query (a batch over a thousand cold pools costs one
    /// round trip, not a thousand).
    pub async fn get_many(
        &self,
        store: &Store,
        pools: &[&str],
    ) -> Result<HashMap<String, PoolPolicy>, StoreError> {
        let mut found = HashMap::new();
        let mut stale = Vec::new();
        {
            let cache = self.pools.read().await;
            for pool in pools {
                match cache.get(*pool) {
                    Some((policy, at)) if at.elapsed() < POLICY_TTL => {
                        found.insert((*pool).to_owned(), *policy);
                    }
                    _ => stale.push(*pool),
                }
            }
        }
        if stale.is_empty() {
            return Ok(found);
        }
        let docs = store.pools_named(&stale).await?;
        let mut cache = self.pools.write().await;
        for pool in &stale {
            cache.remove(*pool);
        }
        let now = Instant::now();
        for doc in docs {
            let policy = doc.policy();
            cache.insert(doc.name.clone(), (policy, now));
            found.insert(doc.name, policy);
        }
        Ok(found)
    }

    /// The pool's policy, `None` when the pool does not exist (never
    /// cached: a pool may be created any moment).
    pub async fn get(&self, store: &Store, pool: &str) -> Result<Option<PoolPolicy>, StoreError> {
        if let Some((policy, at)) = self.pools.read().await.get(pool) {
            if at.elapsed() < POLICY_TTL {
                return Ok(Some(*policy));
            }
        }
        let Some(doc) = store.pool(pool).await? else {
            self.pools.write().await.remove(pool);
            return Ok(None);
        };
        let policy = doc.policy();
        self.pools
            .write()
            .await
            .insert(pool.to_owned(), (policy, Instant::now()));
        Ok(Some(policy))
    }
}

/// Applies the pools' policies to a batch's intake: asks MongoDB which
/// orders already hold a code, which were refused before, and takes quota
/// slots for the rest; new refusals are recorded (durably) here.
pub async fn enforce(
    store: &Store,
    intake: Vec<Intake>,
    policies: &HashMap<String, PoolPolicy>,
) -> Result<Vec<Intake>, StoreError> {
    let policy = |pool: &str| policies.get(pool).copied().unwrap_or_default();
    let gated: Vec<&Purchase> = intake
        .iter()
        .filter_map(|i| match i {
            Intake::Claim(p) if policy(&p.pool).is_active() => Some(p),
            _ => None,
        })
        .collect();
    if gated.is_empty() {
        return Ok(intake);
    }
    let orders: Vec<&str> = gated.iter().map(|p| p.order_id.as_str()).collect();
    let holders: HashSet<String> = store
        .grants_for_orders(&orders)
        .await?
        .into_keys()
        .collect();
    let limited: Vec<&Purchase> = gated
        .into_iter()
        .filter(|p| policy(&p.pool).limits_users() && !holders.contains(&p.order_id))
        .collect();
    let refused = refuse_over_limit(store, &limited, &policy).await?;
    let verdicts = Verdicts {
        holders,
        refused,
        paused: policies
            .iter()
            .filter(|(_, p)| p.paused)
            .map(|(pool, _)| pool.clone())
            .collect(),
    };
    Ok(apply_policies(intake, &verdicts))
}

/// The orders among `purchases` (all of one pool with a per-user limit)
/// that are over their buyer's limit, recorded durably. Orders that hold a
/// code are never refused. Used by backorder fulfilment, for backorders
/// recorded before the limit was set.
pub async fn over_limit(
    store: &Store,
    purchases: &[&Purchase],
    per_user: u32,
) -> Result<HashMap<String, Refusal>, StoreError> {
    let orders: Vec<&str> = purchases.iter().map(|p| p.order_id.as_str()).collect();
    let holders = store.grants_for_orders(&orders).await?;
    let limited: Vec<&Purchase> = purchases
        .iter()
        .copied()
        .filter(|p| !holders.contains_key(&p.order_id))
        .collect();
    let policy = |_: &str| PoolPolicy {
        per_user,
        paused: false,
    };
    refuse_over_limit(store, &limited, &policy).await
}

/// The orders among `limited` that are over their buyer's limit: refused
/// before (the same refusal again), or refused now (recorded durably).
async fn refuse_over_limit(
    store: &Store,
    limited: &[&Purchase],
    policy: &impl Fn(&str) -> PoolPolicy,
) -> Result<HashMap<String, Refusal>, StoreError> {
    if limited.is_empty() {
        return Ok(HashMap::new());
    }
    let orders: Vec<&str> = limited.iter().map(|p| p.order_id.as_str()).collect();
    let mut refused = recorded_refusals(store, limited, &orders).await?;
    let asks: Vec<QuotaAsk> = limited
        .iter()
        .filter(|p| !refused.contains_key(&p.order_id))
        .map(|p| QuotaAsk {
            pool: &p.pool,
            uid: &p.uid,
            order_id: &p.order_id,
            limit: policy(&p.pool).per_user,
        })
        .collect();
    let slots = store.take_quota_slots(&asks).await?;
    // Millisecond precision, as stored: a redelivery's event is identical.
    let now = bson::DateTime::now().to_chrono();
    let mut fresh = Vec::new();
    for a in asks.iter().filter(|a| !slots.contains(a.order_id)) {
        if let Some(p) = limited.iter().find(|p| p.order_id == a.order_id) {
            let r = refusal(p, RefusalReason::PerUserLimit, Some(a.limit), now);
            fresh.push(record_of(&r));
            refused.insert(p.order_id.clone(), r);
        }
    }
    let new = store.record_refusals(&fresh).await?;
    metrics::counter!("codepool_refusals_total", "reason" => RefusalReason::PerUserLimit.as_str())
        .increment(new);
    if new < fresh.len() as u64 {
        // Another dispatcher (or a duplicate in this batch) recorded some
        // first: announce the refusal as recorded, the same event.
        let raced: Vec<&str> = fresh.iter().map(|r| r.order_id.as_str()).collect();
        refused.extend(recorded_refusals(store, limited, &raced).await?);
    }
    Ok(refused)
}

/// The recorded refusals of `orders`, as refusals of the purchases.
async fn recorded_refusals(
    store: &Store,
    limited: &[&Purchase],
    orders: &[&str],
) -> Result<HashMap<String, Refusal>, StoreError> {
    let mut refused = HashMap::new();
    for r in store.refusals_for_orders(orders).await? {
        if let Some(p) = limited.iter().find(|p| p.order_id == r.order_id) {
            let limit = r.limit.and_then(|n| u32::try_from(n).ok());
            let at = r.refused_at.to_chrono();
            refused.insert(r.order_id, refusal(p, r.reason, limit, at));
        }
    }
    Ok(refused)
}

fn refusal(
    p: &Purchase,
    reason: RefusalReason,
    limit: Option<u32>,
    at: chrono::DateTime<Utc>,
) -> Refusal {
    Refusal {
        purchase: p.clone(),
        reason,
        limit,
        at,
    }
}

fn record_of(r: &Refusal) -> RefusalDoc {
    RefusalDoc {
        order_id: r.purchase.order_id.clone(),
        pool: r.purchase.pool.clone(),
        uid: r.purchase.uid.clone(),
        reason: r.reason,
        limit: r.limit.map(i64::from),
        refused_at: bson::DateTime::from_chrono(r.at),
    }
}
