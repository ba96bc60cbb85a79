//! Fulfilling backorders when codes arrive: oldest first, through the same
//! claim path as live purchases, each with its SMS-pending event sent
//! through the outbox. Several dispatchers may do this at once; the unique
//! `order_id` index still gives every order at most one code. A paused
//! pool's backorders wait until it is resumed; a pool's per-user limit
//! applies to backorders too (those recorded before the limit was set
//! hold no slot yet).

use std::collections::HashSet;

use codepool_domain::{PoolPolicy, Purchase};
use codepool_store::Store;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::claim::{ClaimEngine, ClaimError, ClaimOutcome};
use crate::outbox::{Marking, Outbox};
use crate::ports::EventSink;
use crate::Resend;

const BATCH: u64 = 100;

/// Fulfils waiting backorders of `pool` while it has stock and is not
/// paused, until `stop`. Returns how many were fulfilled.
pub async fn fulfil_backorders(
    engine: &ClaimEngine,
    store: &Store,
    outbox: &Outbox,
    sink: &dyn EventSink,
    pool: &str,
    stop: &CancellationToken,
) -> Result<u64, ClaimError> {
    let mut total = 0;
    while !stop.is_cancelled() {
        // A paused pool issues nothing; its backorders wait for `pool
        // resume` (checked every round, so a pause stops a fulfilment).
        let Some(policy) = store.pool(pool).await?.map(|p| p.policy()) else {
            break;
        };
        if policy.paused {
            break;
        }
        // Ask only for as many as there is stock, so the oldest are served
        // first even when stock is short.
        let stock = store.unissued_count_upto(pool, BATCH).await?;
        let limit = stock.min(BATCH);
        if limit == 0 {
            break;
        }
        let waiting = store.waiting_backorders(pool, limit as i64).await?;
        if waiting.is_empty() {
            break;
        }
        let purchases: Vec<Purchase> = waiting.iter().map(|b| b.purchase()).collect();
        let (purchases, refusals_settled) = refuse(store, sink, policy, purchases).await?;
        let (fulfilled, exhausted) = fulfil(engine, store, outbox, sink, pool, &purchases).await?;
        total += fulfilled;
        if exhausted || !refusals_settled || (fulfilled == 0 && !purchases.is_empty()) {
            break;
        }
    }
    if total > 0 {
        info!(pool, fulfilled = total, "backorders fulfilled");
    }
    Ok(total)
}

/// Claims codes for `purchases` (waiting backorders) and sends their
/// events. Returns how many were fulfilled and whether the pool ran dry.
async fn fulfil(
    engine: &ClaimEngine,
    store: &Store,
    outbox: &Outbox,
    sink: &dyn EventSink,
    pool: &str,
    purchases: &[Purchase],
) -> Result<(u64, bool), ClaimError> {
    if purchases.is_empty() {
        return Ok((0, false));
    }
    let refs: Vec<&Purchase> = purchases.iter().collect();
    // No message of a backorder is redelivered: the relay owes its event.
    let outcomes = engine.claim_batch(&refs, Resend::ByRelay).await?;
    let exhausted = outcomes
        .iter()
        .any(|o| matches!(o, ClaimOutcome::Exhausted));
    let grants: Vec<_> = outcomes
        .into_iter()
        .filter_map(|o| match o {
            ClaimOutcome::Granted { grant, .. } => Some(grant),
            ClaimOutcome::Exhausted => None,
        })
        .collect();
    // Events that are not confirmed stay on the relay's list.
    let sent = outbox.send(sink, &grants, Marking::Now).await?;
    if sent.confirmed() < grants.len() {
        warn!(
            pool,
            unconfirmed = grants.len() - sent.confirmed(),
            "some fulfilled backorders' events were not confirmed; the relay re-sends them"
        );
    }
    let fulfilled: Vec<_> = grants
        .iter()
        .map(|g| (g.order_id.clone(), g.code_id))
        .collect();
    store.mark_backorders_fulfilled(&fulfilled).await?;
    metrics::counter!("codepool_backorders_fulfilled_total").increment(fulfilled.len() as u64);
    Ok((fulfilled.len() as u64, exhausted))
}

/// Applies the pool's per-user limit to waiting backorders: the refused
/// ones are announced (`purchase.refused`, confirmed) and marked refused.
/// Returns the purchases still to fulfil, and false when some refusal was
/// not confirmed (its backorder stays waiting; the next sweep retries).
async fn refuse(
    store: &Store,
    sink: &dyn EventSink,
    policy: PoolPolicy,
    purchases: Vec<Purchase>,
) -> Result<(Vec<Purchase>, bool), ClaimError> {
    if !policy.limits_users() {
        return Ok((purchases, true));
    }
    let refs: Vec<&Purchase> = purchases.iter().collect();
    let refused = crate::policy::over_limit(store, &refs, policy.per_user).await?;
    if refused.is_empty() {
        return Ok((purchases, true));
    }
    let events: Vec<_> = refused.values().map(|r| r.event()).collect();
    let results = sink.publish_refused(&events).await;
    let confirmed: Vec<&str> = events
        .iter()
        .zip(&results)
        .filter(|(_, r)| r.is_ok())
        .map(|(e, _)| e.order_id.as_str())
        .collect();
    store.mark_backorders_refused(&confirmed).await?;
    let settled = confirmed.len() == events.len();
    if !settled {
        warn!(
            unconfirmed = events.len() - confirmed.len(),
            "purchase.refused events of backorders not confirmed; retried at the next sweep"
        );
    }
    let skip: HashSet<&String> = refused.keys().collect();
    let rest = purchases
        .iter()
        .filter(|p| !skip.contains(&p.order_id))
        .cloned()
        .collect();
    Ok((rest, settled))
}
