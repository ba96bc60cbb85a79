//! The relay: re-publishes SMS-pending events of grants whose publish was
//! never confirmed (a crash or a broker outage between the grant's write
//! and its confirm). The event id is stable, so the SMS service drops any
//! duplicate this creates.

use std::time::Duration;

use codepool_broker::Publisher;
use codepool_store::{Store, StoreError};
use tracing::info;

/// Re-publishes unconfirmed events of grants older than `older_than`.
/// Returns how many were confirmed now.
pub async fn relay_unconfirmed(
    store: &Store,
    publisher: &Publisher,
    older_than: Duration,
    limit: i64,
) -> Result<u64, StoreError> {
    let cutoff = chrono::Utc::now()
        - chrono::Duration::from_std(older_than).unwrap_or_else(|_| chrono::Duration::seconds(30));
    let grants = store.unconfirmed_grants(cutoff, limit).await?;
    let mut confirms = Vec::new();
    for doc in &grants {
        if let Some(event) = doc.grant().and_then(|g| g.sms_pending()) {
            if let Ok(c) = publisher.publish_sms_pending(&event).await {
                confirms.push((doc.id, c));
            }
        }
    }
    let mut published = Vec::new();
    for (id, c) in confirms {
        if c.wait().await.is_ok() {
            published.push(id);
        }
    }
    store.mark_sms_published(&published).await?;
    if !published.is_empty() {
        info!(
            count = published.len(),
            "relayed SMS-pending events that were never confirmed"
        );
        metrics::counter!("codepool_sms_relayed_total").increment(published.len() as u64);
    }
    Ok(published.len() as u64)
}
