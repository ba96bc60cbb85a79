//! Fulfilling backorders when codes arrive: oldest first, through the same
//! claim path as live purchases, each with its SMS-pending event. Several
//! dispatchers may do this at once; the unique `order_id` index still
//! gives every order at most one code.

use codepool_broker::Publisher;
use codepool_domain::Purchase;
use codepool_store::Store;
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::claim::{ClaimEngine, ClaimError, ClaimOutcome};

const BATCH: u64 = 100;

/// Fulfils waiting backorders of `pool` while it has stock, until `stop`.
/// Returns how many were fulfilled.
pub async fn fulfil_backorders(
    engine: &ClaimEngine,
    store: &Store,
    publisher: &Publisher,
    pool: &str,
    stop: &CancellationToken,
) -> Result<u64, ClaimError> {
    let mut total = 0;
    while !stop.is_cancelled() {
        // Ask only for as many as there is stock, so the oldest are served
        // first even when stock is short.
        let stock = store.unissued_count(pool).await?;
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
        let mut fulfilled = Vec::new();
        let mut confirms = Vec::new();
        let mut exhausted = false;
        for (p, outcome) in purchases.iter().zip(outcomes) {
            match outcome {
                ClaimOutcome::Granted { grant, .. } => {
                    if let Ok(id) = codepool_store::ObjectId::parse_str(&grant.code_id) {
                        fulfilled.push((p.order_id.clone(), id));
                        let Some(event) = grant.sms_pending() else {
                            continue;
                        };
                        if let Ok(c) = publisher.publish_sms_pending(&event).await {
                            confirms.push((id, c));
                        }
                    }
                }
                ClaimOutcome::Exhausted => exhausted = true,
            }
        }
        let mut published = Vec::new();
        for (id, c) in confirms {
            if c.wait().await.is_ok() {
                published.push(id);
            }
        }
        // Events that were not confirmed stay on the relay's list.
        store.mark_sms_published(&published).await?;
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
