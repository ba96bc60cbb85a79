//! The relay: re-publishes the SMS-pending events of grants that no message
//! will bring back, flagged `sms_pending` ([`codepool_store::Resend::ByRelay`]):
//! backorders fulfilled after an import, and grants of purchases
//! dead-lettered at their delivery limit; and the grants of HTTP batches
//! whose record of owed events ([`codepool_store::Resend::ByRecord`])
//! outlived their confirms. A purchase's own grant needs no
//! relay: the purchase stays unacked, and is redelivered, until its event
//! is confirmed. The event id is stable, so the SMS service drops any
//! duplicate this creates.

use std::time::Duration;

use codepool_domain::{Code, Grant};
use codepool_store::codes::OwedRecord;
use codepool_store::{Store, StoreError};
use tracing::{info, warn};

use crate::outbox::{Marking, Outbox, Sent};
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
    // The records first, each on its own: one that cannot be read is
    // left for later and holds back nothing else.
    let (mut confirmed, owed) = relay_records(store, outbox, sink, cutoff).await;
    let codes = store.unconfirmed_grants(cutoff, limit).await?;
    metrics::gauge!("codepool_sms_relay_backlog").set((codes.len() + owed) as f64);
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
    log_relayed(&grants, &sent);
    confirmed += sent.confirmed() as u64;
    if confirmed > 0 {
        info!(
            count = confirmed,
            "relayed SMS-pending events that were never confirmed"
        );
        metrics::counter!("codepool_sms_relayed_total").increment(confirmed);
    }
    Ok(confirmed)
}

/// Records of owed events the relay takes up in one round, one at a time
/// (a record names at most 256 orders).
const RECORDS_PER_ROUND: i64 = 8;

/// How long a record stays once the relay has sent its events: a batch
/// still being placed when its record came of age (its claim stalled, or
/// its process died in the middle of it) may land more grants until
/// then, and the relay sends them all once more before it takes the
/// record away. Well past any claim's life, and any clocks' skew.
pub const RECORD_KEPT_FOR: Duration = Duration::from_secs(600);

/// How long a record that could not be read or sent waits before the
/// relay tries it again (newer records go first meanwhile).
const RECORD_RETRY_AFTER: Duration = Duration::from_secs(60);

/// Sends the events of the grants each record written before `cutoff`
/// owes ([`Store::owed_grants`]). A record whose events were all
/// confirmed waits, out of the list and marked `relayed`, until it is
/// [`RECORD_KEPT_FOR`] old (one that owed none yet, a minute); then its
/// events are sent once more and it goes. A record whose events were not
/// all confirmed, or that cannot be read or sent, waits
/// [`RECORD_RETRY_AFTER`]. Returns how many events' grants were
/// confirmed, and how many grants the records read owed.
async fn relay_records(
    store: &Store,
    outbox: &Outbox,
    sink: &dyn EventSink,
    cutoff: chrono::DateTime<chrono::Utc>,
) -> (u64, usize) {
    let now = chrono::Utc::now();
    let records = match store.owed_records(cutoff, now, RECORDS_PER_ROUND).await {
        Ok(r) => r,
        Err(e) => {
            warn!(error = %e, "the records of owed SMS events were not read; retried at the next sweep");
            return (0, 0);
        }
    };
    let (mut confirmed, mut owed) = (0, 0);
    for record in records {
        match relay_record(store, outbox, sink, &record, now).await {
            Ok((c, o)) => {
                confirmed += c;
                owed += o;
            }
            Err(e) => {
                warn!(record = %record.id, error = %e, "a record of owed SMS events was not relayed; tried again in a minute");
                metrics::counter!("codepool_internal_errors_total", "kind" => "relay_record")
                    .increment(1);
                let later = after(now, RECORD_RETRY_AFTER);
                let _ = store.defer_owed(record.id, later, false).await;
            }
        }
    }
    (confirmed, owed)
}

/// [`relay_records`] for one record: (confirmed, owed).
async fn relay_record(
    store: &Store,
    outbox: &Outbox,
    sink: &dyn EventSink,
    record: &OwedRecord,
    now: chrono::DateTime<chrono::Utc>,
) -> Result<(u64, usize), StoreError> {
    let codes = store.owed_grants(record).await?;
    let grants: Vec<_> = codes.iter().filter_map(Code::grant).collect();
    let sent = outbox.send(sink, &grants, Marking::Unneeded).await?;
    log_relayed(&grants, &sent);
    let last = after(record.at.to_chrono(), RECORD_KEPT_FOR);
    let all = sent.confirmed() == grants.len();
    if all && last.to_chrono() <= now {
        store.settle_owed(record.id).await?;
    } else {
        // Sent: back for the last pass once the record is ten minutes
        // old, or in a minute when it owed nothing yet (its batch may
        // still land its grants). Not all confirmed: tried again in a
        // minute, newer records first meanwhile.
        let next = if all && !grants.is_empty() {
            last
        } else {
            after(now, RECORD_RETRY_AFTER)
        };
        store.defer_owed(record.id, next, all).await?;
    }
    Ok((sent.confirmed() as u64, grants.len()))
}

/// `wait` after `t`, as stored.
fn after(t: chrono::DateTime<chrono::Utc>, wait: Duration) -> bson::DateTime {
    bson::DateTime::from_chrono(t + chrono::Duration::from_std(wait).unwrap_or_default())
}

/// One line per order relayed, with the fields its other lines carry:
/// grepping an order id shows its event's way out too.
fn log_relayed(grants: &[Grant], sent: &Sent) {
    let mut logged = std::collections::HashSet::new();
    for (g, r) in grants.iter().zip(&sent.results) {
        if r.is_ok() && logged.insert(g.order_id.as_str()) {
            info!(order_id = %g.order_id, pool = %g.pool, door = "relay", "sms.pending relayed");
        }
    }
}
