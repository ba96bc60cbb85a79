//! The relay: re-publishes the SMS-pending events of grants that no message
//! will bring back, flagged `sms_pending` ([`codepool_store::Resend::ByRelay`]):
//! backorders fulfilled after an import, and grants of purchases
//! dead-lettered at their delivery limit. A purchase's own grant needs no
//! relay: the purchase stays unacked, and is redelivered, until its event
//! is confirmed. The event id is stable, so the SMS service drops any
//! duplicate this creates.

use std::time::Duration;

use codepool_domain::Code;
use codepool_store::{Store, StoreError};
use tracing::{info, warn};

use crate::outbox::{Marking, Outbox};
use crate::ports::EventSink;

/// Re-publishes unconfirmed events of grants older than `older_than`,
/// through the outbox. Returns how many were confirmed now. Its lines
/// are in a `relay` span (with `limit`), each relayed order's naming it.
#[tracing::instrument(name = "relay", skip_all, fields(limit = limit))]
pub async fn relay_unconfirmed(
    store: &Store,
    outbox: &Outbox,
    sink: &dyn EventSink,
    older_than: Duration,
    limit: i64,
) -> Result<u64, StoreError> {
    let cutoff = chrono::Utc::now()
        - chrono::Duration::from_std(older_than).unwrap_or_else(|_| chrono::Duration::seconds(30));
    let codes = store.unconfirmed_grants(cutoff, limit).await?;
    metrics::gauge!("codepool_sms_relay_backlog").set(codes.len() as f64);
    let grants: Vec<_> = codes.iter().filter_map(Code::grant).collect();
    if grants.len() < codes.len() {
        // `sms_pending` is only ever set on an issued code, which has a holder.
        warn!(
            without_holder = codes.len() - grants.len(),
            "codes awaiting an SMS relay have no order; they are skipped"
        );
        metrics::counter!("codepool_internal_errors_total", "kind" => "relay_without_holder")
            .increment((codes.len() - grants.len()) as u64);
    }
    let sent = outbox.send(sink, &grants, Marking::Now).await?;
    // One line per order relayed, with the fields its other lines carry:
    // grepping an order id shows its event's way out too.
    let mut logged = std::collections::HashSet::new();
    for (g, r) in grants.iter().zip(&sent.results) {
        if r.is_ok() && logged.insert(g.order_id.as_str()) {
            info!(order_id = %g.order_id, pool = %g.pool, door = "relay", "sms.pending relayed");
        }
    }
    let confirmed = sent.confirmed() as u64;
    if confirmed > 0 {
        info!(
            count = confirmed,
            "relayed SMS-pending events that were never confirmed"
        );
        metrics::counter!("codepool_sms_relayed_total").increment(confirmed);
    }
    Ok(confirmed)
}
