//! The expiry sweep: codes carry `expires_at` from the partner's file. The
//! claim already refuses expired codes; this sweep makes them void (reason
//! `expired`) so stock and stats tell the truth, and takes them out of the
//! hot pool so claimers stop drawing dead candidates.

use codepool_store::{Store, StoreError};

use crate::ports::CandidatePool;
use tracing::{debug, info};

/// Voids expired unissued codes (of one pool, or all) and drops them from
/// the hot pool. Returns how many were voided. Redis being away only
/// leaves stale candidates, which the claim's condition refuses anyway.
pub async fn expire_codes(
    store: &Store,
    hot: &dyn CandidatePool,
    pool: Option<&str>,
) -> Result<u64, StoreError> {
    let expired = store.expire(pool, bson::DateTime::now()).await?;
    for (pool, ids) in &expired.by_pool {
        if let Err(e) = hot.remove(pool, ids).await {
            debug!(pool, error = %e, "expired codes stay hot-pool candidates until Redis is back; claims refuse them");
        }
        info!(pool, count = ids.len(), "expired codes voided");
        metrics::counter!("codepool_codes_expired_total", "pool" => pool.clone())
            .increment(ids.len() as u64);
    }
    Ok(expired.total() as u64)
}
