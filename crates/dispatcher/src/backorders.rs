//! Fulfilling backorders when codes arrive: oldest first, through the same
//! claim path as live purchases, each with its SMS-pending event sent
//! through the outbox. Several dispatchers may do this at once; the unique
//! `order_id` index still gives every order at most one code.

use codepool_domain::Purchase;
use codepool_store::Store;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::claim::{ClaimEngine, ClaimError, ClaimOutcome};
use crate::outbox::{Marking, Outbox};
use crate::ports::EventSink;

const BATCH: u64 = 100;

/// Fulfils waiting backorders of `pool` while it has stock, until `stop`.
/// Returns how many were fulfilled.
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
        let refs: Vec<&Purchase> = purchases.iter().collect();
        let outcomes = engine.claim_batch(&refs).await?;
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
        total += fulfilled.len() as u64;
        metrics::counter!("codepool_backorders_fulfilled_total").increment(fulfilled.len() as u64);
        if exhausted || fulfilled.is_empty() {
            break;
        }
    }
    if total > 0 {
        info!(pool, fulfilled = total, "backorders fulfilled");
    }
    Ok(total)
}
