//! Pool policies at dispatch time: which pools exist and what their
//! operators decided (per-user limit, paused), cached for at most
//! [`POLICY_TTL`] so a pause is seen within a second; and the database
//! half of the per-user limit — slots taken by conditional updates, every
//! refusal recorded durably before anything is acked. The decision itself
//! is the pure [`apply_policies`].

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use chrono::Utc;
use codepool_domain::{Code, PoolPolicy, Purchase, Refusal, RefusalReason};
use codepool_store::policies::RefusalDoc;
use codepool_store::pools::PoolDoc;
use codepool_store::{Store, StoreError};
use tokio::sync::RwLock;

use crate::guard::{Guard, Slots};
use crate::plan::{apply_policies, Admission, Verdicts};
use codepool_domain::gate::Move;

/// How long a pool's policy is trusted before it is read again: the delay
/// between `codepool pool pause` and the last grant of the pool.
pub const POLICY_TTL: Duration = Duration::from_secs(1);

/// A read of policies also refreshes, ahead of their time, the pools in
/// use that are this old, at most once in this long; so the pools in use
/// are read together, about twice a [`POLICY_TTL`], rather than a few in
/// every batch.
pub(crate) const REFRESH_AHEAD: Duration = Duration::from_millis(500);
/// Only pools a batch asked for this recently are refreshed ahead; the
/// others are read again on their next use.
const REFRESH_IF_USED_WITHIN: Duration = Duration::from_secs(10);
/// Most pools one read refreshes ahead, so that read stays small.
const REFRESH_AHEAD_MOST: usize = 5000;
/// A catalogue of at most this many pools is read whole when pools are
/// refreshed ahead: a pool a batch meets for the first time is then
/// usually cached already (many pools with long-tail demand meet new ones
/// in every batch), for one reply of about 100 bytes per pool about once
/// a second while purchases flow (10,000 pools: about 1 MB, a few ms of
/// mongod's time).
pub const CATALOGUE_MOST: usize = 10_000;
/// After a whole read found more pools than [`CATALOGUE_MOST`], reads name
/// their pools for this long before the catalogue's size is tried again.
const CATALOGUE_RECHECK: Duration = Duration::from_secs(60);

/// When a reader of the `pools` catalogue (the policy cache, the grant
/// prefixes) last read it whole, and last found it too large or
/// unreadable to read whole.
#[derive(Debug, Default)]
pub(crate) struct CatalogueGate {
    whole_at: Option<Instant>,
    large_at: Option<Instant>,
}

impl CatalogueGate {
    /// Whether a read at `now` may take the whole catalogue: it was not
    /// found large lately, and no whole read began in the last `every`.
    /// If so, that read is counted as begun.
    pub(crate) fn take(&mut self, now: Instant, every: Duration) -> bool {
        let due = |at: Option<Instant>, after| at.is_none_or(|t| now.duration_since(t) >= after);
        let ok = due(self.large_at, CATALOGUE_RECHECK) && due(self.whole_at, every);
        if ok {
            self.whole_at = Some(now);
        }
        ok
    }

    /// The whole read could not be used: read by name for a while.
    pub(crate) fn refused(&mut self) {
        self.large_at = Some(Instant::now());
    }
}

/// A pool's policy as last read, and when it was read and last asked for.
#[derive(Debug, Clone, Copy)]
struct Cached {
    policy: PoolPolicy,
    read_at: Instant,
    used_at: Instant,
}

/// Pools known to exist, with their policy as last read.
#[derive(Debug)]
pub struct PolicyCache {
    state: RwLock<Known>,
    /// Where the ages of the policies are read.
    clock: std::sync::Arc<dyn crate::clock::Clock>,
}

impl Default for PolicyCache {
    fn default() -> Self {
        Self::with_clock(crate::clock::system())
    }
}

/// What [`PolicyCache`] holds.
#[derive(Debug, Default)]
struct Known {
    pools: HashMap<String, Cached>,
    /// When a read last refreshed pools ahead of their time.
    ahead_at: Option<Instant>,
    /// Whole reads of the catalogue (paced by `ahead_at` already).
    catalogue: CatalogueGate,
}

impl Known {
    /// Records what a read begun at `started` found of pool `name` (`None`:
    /// no such pool) and returns the policy to use: a newer read's if one
    /// landed meanwhile. A policy is as old as the read that began before
    /// it, so a pause landing during the read is seen within POLICY_TTL of
    /// it. `asked`: the reading batch uses the pool now.
    fn record(
        &mut self,
        name: &str,
        read: Option<PoolPolicy>,
        started: Instant,
        asked: bool,
    ) -> Option<PoolPolicy> {
        if let Some(newer) = self.pools.get(name).filter(|c| c.read_at > started) {
            return Some(newer.policy);
        }
        let previous = self.pools.remove(name);
        let policy = read?;
        let used_at = match previous {
            _ if asked => started,
            Some(c) => c.used_at,
            // Read with the whole catalogue, never used: not in use.
            None => started
                .checked_sub(REFRESH_IF_USED_WITHIN)
                .unwrap_or(started),
        };
        let cached = Cached {
            policy,
            read_at: started,
            used_at,
        };
        self.pools.insert(name.to_owned(), cached);
        Some(policy)
    }
}

/// What a batch's lookup found in the cache: the fresh policies, and the
/// pools to read (its own stale or unknown ones first, then any in use
/// that are due soon).
#[derive(Debug, Default, PartialEq)]
struct Lookup {
    found: HashMap<String, PoolPolicy>,
    read: Vec<String>,
    /// Read the whole catalogue if it is small (pools are refreshed ahead
    /// and it was not found large lately).
    whole: bool,
}

/// Looks `pools` up in `known` at `now`, marking them used.
fn look_up(known: &mut Known, pools: &[&str], now: Instant) -> Lookup {
    let mut out = Lookup::default();
    for pool in pools {
        match known.pools.get_mut(*pool) {
            Some(c) if now.duration_since(c.read_at) < POLICY_TTL => {
                c.used_at = now;
                out.found.insert((*pool).to_owned(), c.policy);
            }
            _ => out.read.push((*pool).to_owned()),
        }
    }
    if out.read.is_empty() {
        return out;
    }
    // The batch uses its fresh policies after the read: any over
    // REFRESH_AHEAD old come along, so none is used past POLICY_TTL.
    let own_due: Vec<String> = pools
        .iter()
        .filter(|p| {
            known
                .pools
                .get(**p)
                .is_some_and(|c| now.duration_since(c.read_at) >= REFRESH_AHEAD)
                && out.found.contains_key(**p)
        })
        .map(|p| (*p).to_owned())
        .collect();
    out.read.extend(own_due);
    let ahead_due = known
        .ahead_at
        .is_none_or(|t| now.duration_since(t) >= REFRESH_AHEAD);
    if !ahead_due {
        return out;
    }
    known.ahead_at = Some(now);
    out.whole = known.catalogue.take(now, Duration::ZERO);
    let reading: HashSet<&str> = out.read.iter().map(String::as_str).collect();
    let due: Vec<String> = known
        .pools
        .iter()
        .filter(|(name, c)| {
            now.duration_since(c.read_at) >= REFRESH_AHEAD
                && now.duration_since(c.used_at) < REFRESH_IF_USED_WITHIN
                && !reading.contains(name.as_str())
        })
        .map(|(name, _)| name.clone())
        .take(REFRESH_AHEAD_MOST)
        .collect();
    out.read.extend(due);
    out
}

impl PolicyCache {
    /// A cache whose policies age by `clock`.
    pub fn with_clock(clock: std::sync::Arc<dyn crate::clock::Clock>) -> Self {
        Self {
            state: RwLock::default(),
            clock,
        }
    }

    /// The policies of `pools` that exist: fresh ones from the cache, the
    /// others in one query (a batch over a thousand cold pools costs one
    /// round trip, not a thousand). That query also reads the pools in use
    /// whose policies are due soon, or the whole catalogue when it is
    /// small, so a busy catalogue is read about once a second, not a
    /// little in every batch.
    pub async fn get_many(
        &self,
        store: &Store,
        pools: &[&str],
    ) -> Result<HashMap<String, PoolPolicy>, StoreError> {
        let started = self.clock.now();
        let Lookup {
            mut found,
            read,
            whole,
        } = look_up(&mut *self.state.write().await, pools, started);
        if read.is_empty() {
            return Ok(found);
        }
        let mut names: Vec<String> = Vec::with_capacity(read.len());
        let mut seen = HashSet::new();
        for name in read {
            if seen.insert(name.clone()) {
                names.push(name);
            }
        }
        let (docs, complete) = self.read(store, &names, whole).await?;
        let mut read_docs: HashMap<String, PoolPolicy> = docs
            .into_iter()
            .map(|d| (d.name.clone(), d.policy()))
            .collect();
        let asked: HashSet<&str> = pools.iter().copied().collect();
        let known = &mut *self.state.write().await;
        if complete {
            // Every pool there is came back: cache them all, and forget
            // the cached ones that are gone.
            let more: Vec<String> = (read_docs.keys())
                .chain(known.pools.keys())
                .filter(|n| seen.insert((*n).clone()))
                .cloned()
                .collect();
            names.extend(more);
        }
        for name in &names {
            let asked = asked.contains(name.as_str());
            let policy = known.record(name, read_docs.remove(name), started, asked);
            if asked {
                // A pool read and not found is gone, even if it was cached.
                match policy {
                    Some(p) => found.insert(name.clone(), p),
                    None => found.remove(name),
                };
            }
        }
        Ok(found)
    }

    /// The pools of `names`, or, when `whole`, every pool if there are at
    /// most [`CATALOGUE_MOST`]. Also says whether the pools returned are
    /// every pool there is.
    async fn read(
        &self,
        store: &Store,
        names: &[String],
        whole: bool,
    ) -> Result<(Vec<PoolDoc>, bool), StoreError> {
        if whole {
            if let Some(docs) = whole_catalogue(store).await {
                return Ok((docs, true));
            }
            self.state.write().await.catalogue.refused();
        }
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        Ok((store.pools_named(&names).await?, false))
    }
}

/// Every pool in one reply, if there are at most [`CATALOGUE_MOST`].
/// `None` when there are more, or when the read failed: the caller then
/// reads its pools by name, so a pool document that does not decode holds
/// up the batches of that pool only, not every batch.
pub(crate) async fn whole_catalogue(store: &Store) -> Option<Vec<PoolDoc>> {
    match store.pools_up_to(CATALOGUE_MOST + 1).await {
        Ok(docs) if docs.len() <= CATALOGUE_MOST => Some(docs),
        Ok(_) => None,
        Err(e) => {
            tracing::warn!(error = %e, "could not read the whole pool catalogue; reading pools by name");
            None
        }
    }
}

/// Applies the pools' policies to a batch's intake: given which orders
/// already hold a code (`held`, read by the caller), asks MongoDB which
/// were refused before, and takes quota slots for the rest; new refusals
/// are recorded (durably) here.
pub async fn enforce(
    store: &Store,
    intake: Vec<Admission>,
    policies: &HashMap<String, PoolPolicy>,
    held: &HashMap<String, Vec<Code>>,
) -> Result<Vec<Admission>, StoreError> {
    let guard = Guard::new(policies.clone());
    let policy = |pool: &str| guard.policy(pool);
    let gated: Vec<&Purchase> = intake
        .iter()
        .filter_map(|i| match i {
            Admission::Claim(p) if p.pools().iter().any(|x| policy(x).is_active()) => Some(p),
            _ => None,
        })
        .collect();
    if gated.is_empty() {
        return Ok(intake);
    }
    let holders: HashSet<String> = (gated.iter())
        .filter(|p| held.contains_key(&p.order_id))
        .map(|p| p.order_id.clone())
        .collect();
    let limited: Vec<&Purchase> = gated
        .into_iter()
        .filter(|p| {
            p.pools().iter().any(|x| policy(x).limits_users()) && !holders.contains(&p.order_id)
        })
        .collect();
    let refused = refuse_over_limit(store, &limited, &guard, Move::Claim).await?;
    let verdicts = Verdicts {
        holders,
        refused,
        paused: guard.stopping(Move::Claim),
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
    guard: &Guard,
    mv: Move,
) -> Result<HashMap<String, Refusal>, StoreError> {
    let limits = |p: &&Purchase| p.pools().iter().any(|x| guard.policy(x).limits_users());
    if !purchases.iter().any(limits) {
        return Ok(HashMap::new());
    }
    let orders: Vec<&str> = purchases.iter().map(|p| p.order_id.as_str()).collect();
    let holders = store.grants_for_orders(&orders).await?;
    let limited: Vec<&Purchase> = purchases
        .iter()
        .copied()
        .filter(|p| !holders.contains_key(&p.order_id))
        .collect();
    refuse_over_limit(store, &limited, guard, mv).await
}

/// The orders among `limited` that are over their buyer's limit: refused
/// before (the same refusal again), or refused now (recorded durably).
async fn refuse_over_limit(
    store: &Store,
    limited: &[&Purchase],
    guard: &Guard,
    mv: Move,
) -> Result<HashMap<String, Refusal>, StoreError> {
    if limited.is_empty() {
        return Ok(HashMap::new());
    }
    let orders: Vec<&str> = limited.iter().map(|p| p.order_id.as_str()).collect();
    let mut refused = recorded_refusals(store, limited, &orders).await?;
    // Codes are counted per pool: a bundle asks a slot of each pool with
    // a limit, for its codes of that pool.
    let items: Vec<(&Purchase, Vec<codepool_domain::Item>)> = (limited.iter())
        .filter(|p| !refused.contains_key(&p.order_id))
        .map(|p| (*p, p.items()))
        .collect();
    let Slots {
        asks,
        allowed: slots,
    } = guard.take_slots(store, mv, &items).await?;
    // Millisecond precision, as stored: a redelivery's event is identical.
    let now = bson::DateTime::now().to_chrono();
    let mut fresh = Vec::new();
    for a in asks.iter().filter(|a| !slots.contains(a.order_id)) {
        if refused.contains_key(a.order_id) {
            continue;
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn cached(read_ago: Duration, used_ago: Duration, now: Instant) -> Cached {
        Cached {
            policy: PoolPolicy::default(),
            read_at: now - read_ago,
            used_at: now - used_ago,
        }
    }

    fn sorted(mut v: Vec<String>) -> Vec<String> {
        v.sort();
        v
    }

    fn known(pools: Vec<(&str, Cached)>) -> Known {
        Known {
            pools: pools.into_iter().map(|(k, c)| (k.to_owned(), c)).collect(),
            ahead_at: None,
            catalogue: CatalogueGate::default(),
        }
    }

    #[test]
    fn a_read_keeps_a_newer_answer_and_forgets_a_pool_gone() {
        let now = Instant::now() + Duration::from_secs(60);
        let ms = Duration::from_millis;
        let mut known = known(vec![
            ("newer", cached(ms(0), ms(0), now + ms(5))),
            ("gone", cached(ms(700), ms(0), now)),
            ("idle", cached(ms(700), ms(3000), now)),
        ]);
        let paused = PoolPolicy {
            paused: true,
            ..PoolPolicy::default()
        };
        let started = now;
        let kept = known.record("newer", Some(paused), started, true);
        assert_eq!(kept, Some(PoolPolicy::default()), "the newer read's answer");
        assert_eq!(known.record("gone", None, started, true), None);
        assert!(!known.pools.contains_key("gone"));
        assert_eq!(
            known.record("idle", Some(paused), started, false),
            Some(paused)
        );
        let idle = known.pools["idle"];
        assert_eq!((idle.read_at, idle.used_at), (started, now - ms(3000)));
    }

    #[test]
    fn fresh_policies_come_from_the_cache_and_nothing_is_read() {
        let now = Instant::now() + Duration::from_secs(60);
        let ms = Duration::from_millis;
        let mut known = known(vec![
            ("a", cached(ms(100), ms(100), now)),
            ("b", cached(ms(900), ms(0), now)),
        ]);
        let got = look_up(&mut known, &["a"], now);
        assert_eq!(got.found.keys().collect::<Vec<_>>(), vec!["a"]);
        assert!(
            got.read.is_empty(),
            "b is due soon, but nothing needs a read"
        );
        assert_eq!(known.pools["a"].used_at, now, "a was asked for");
    }

    #[test]
    fn a_read_also_refreshes_the_pools_in_use_that_are_due_soon() {
        let now = Instant::now() + Duration::from_secs(60);
        let ms = Duration::from_millis;
        let mut known = known(vec![
            ("stale", cached(ms(1500), ms(1500), now)),
            ("due", cached(ms(700), ms(300), now)),
            ("young", cached(ms(200), ms(200), now)),
            ("idle", cached(ms(700), ms(20_000), now)),
        ]);
        let got = look_up(&mut known, &["stale", "unknown", "young"], now);
        assert_eq!(got.found.keys().collect::<Vec<_>>(), vec!["young"]);
        assert_eq!(
            &got.read[..2],
            ["stale", "unknown"],
            "the batch's own first"
        );
        assert_eq!(sorted(got.read), ["due", "stale", "unknown"]);
        // Another batch meets a new pool soon after: it reads that one
        // alone, since pools were refreshed ahead less than 0.5 s ago.
        let got = look_up(&mut known, &["new"], now + ms(100));
        assert_eq!(got.read, ["new"]);
        // The gate is closed, but a batch's own policies over 0.5 s old
        // are read with its new pool: it uses them after that read.
        let got = look_up(&mut known, &["new", "due"], now + ms(200));
        assert_eq!(got.read, ["new", "due"]);
        // Past the gate, every pool in use over 0.5 s old comes along (no
        // read landed in between here), never the idle one.
        let got = look_up(&mut known, &["new"], now + ms(600));
        assert_eq!(sorted(got.read), ["due", "new", "stale", "young"]);
    }

    #[test]
    fn the_whole_catalogue_is_read_ahead_unless_it_was_found_large_lately() {
        let now = Instant::now() + Duration::from_secs(600);
        let ms = Duration::from_millis;
        let mut known = known(vec![]);
        let got = look_up(&mut known, &["a"], now);
        assert!(got.whole, "the first read takes the whole catalogue");
        let got = look_up(&mut known, &["b"], now + ms(100));
        assert!(!got.whole, "within the refresh gate: the pool alone");
        known.catalogue.large_at = Some(now + ms(500));
        let got = look_up(&mut known, &["c"], now + ms(600));
        assert!(!got.whole, "found large a moment ago");
        let got = look_up(&mut known, &["d"], now + ms(500) + CATALOGUE_RECHECK);
        assert!(got.whole, "found large long ago: tried again");
    }

    #[test]
    fn a_pool_read_with_the_catalogue_and_never_asked_for_is_not_in_use() {
        let now = Instant::now() + Duration::from_secs(600);
        let mut known = known(vec![]);
        known.record("quiet", Some(PoolPolicy::default()), now, false);
        known.record("asked", Some(PoolPolicy::default()), now, true);
        assert!(now.duration_since(known.pools["quiet"].used_at) >= REFRESH_IF_USED_WITHIN);
        assert_eq!(known.pools["asked"].used_at, now);
        // Not refreshed ahead with the pools in use when the catalogue is large.
        known.catalogue.large_at = Some(now);
        let got = look_up(&mut known, &["new"], now + Duration::from_millis(600));
        assert_eq!(sorted(got.read), ["asked", "new"]);
    }
}
