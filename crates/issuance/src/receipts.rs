//! SMS receipts: the SMS service reports each text as sent (`sms.sent`) or
//! failed (`sms.failed`) on the `sms` exchange, and the AMQP door hands
//! each receipt here ([`apply`]) as it came: its routing key, its body and
//! its message id. `sms.sent` sets `is_sms` to 1 and `sms_sent_at`;
//! `sms.failed` records the error, its time and a count.
//!
//! A redelivered receipt changes nothing (its message id is remembered in
//! the code's SMS history). A malformed receipt cannot become valid by
//! waiting: it is settled (logged and counted), never retried forever.

use codepool_broker::topology::{SMS_FAILED_KEY, SMS_SENT_KEY};
use codepool_domain::{SmsPending, SmsReceipt};
use codepool_store::lifecycle::{ReceiptKind, ReceiptOutcome};
use codepool_store::{Store, StoreError};
use tracing::{debug, info, warn};

/// Applies one receipt: `routing_key` says which (`sms.sent` or
/// `sms.failed`), `body` is its JSON, `receipt_id` its message id. `Err`
/// only when MongoDB is unavailable (the caller waits and tries again);
/// everything else is settled.
pub async fn apply(
    store: &Store,
    routing_key: &str,
    body: &[u8],
    receipt_id: Option<&str>,
) -> Result<(), StoreError> {
    let kind = match routing_key {
        SMS_SENT_KEY => ReceiptKind::Sent,
        SMS_FAILED_KEY => ReceiptKind::Failed,
        other => {
            warn!(routing_key = other, "SMS receipt with an unknown routing key dropped; the SMS service must publish sms.sent or sms.failed");
            metrics::counter!("codepool_sms_receipts_total", "result" => "malformed").increment(1);
            return Ok(());
        }
    };
    let receipt: SmsReceipt = match serde_json::from_slice(body) {
        Ok(r) => r,
        Err(e) => {
            warn!(error = %e, bytes = body.len(), "malformed SMS receipt dropped; expected {{\"event_id\":…,\"order_id\":…}}");
            metrics::counter!("codepool_sms_receipts_total", "result" => "malformed").increment(1);
            return Ok(());
        }
    };
    // The event id names the lines its event carried (an order of several
    // codes); the receipt applies to those codes only. An id codepool did
    // not give names the whole order, as receipts always have.
    let lines = SmsPending::lines_of(&receipt.event_id, &receipt.order_id).unwrap_or_else(|e| {
        debug!(order_id = %receipt.order_id, error = %e, "SMS receipt applies to every code of its order");
        None
    });
    // A replacement's code has an event of its own: its receipt is its.
    let replacement = SmsPending::replacement_of(&receipt.event_id, &receipt.order_id).unwrap_or(0);
    let outcome = match store
        .apply_sms_receipt(
            &receipt.order_id,
            lines.as_deref(),
            replacement,
            kind,
            receipt.error.as_deref(),
            receipt_id,
        )
        .await
    {
        Ok(o) => o,
        Err(e) if e.is_unavailable() => return Err(e),
        Err(e) => {
            warn!(order_id = %receipt.order_id, error = %e, "SMS receipt could not be applied; dropped");
            metrics::counter!("codepool_sms_receipts_total", "result" => "failed").increment(1);
            return Ok(());
        }
    };
    let result = match outcome {
        ReceiptOutcome::Applied => {
            match kind {
                ReceiptKind::Sent => debug!(order_id = %receipt.order_id, "SMS sent"),
                ReceiptKind::Failed => {
                    info!(order_id = %receipt.order_id, error = receipt.error.as_deref().unwrap_or(""), "SMS failed; `codepool resend --order` sends it again")
                }
            }
            kind.as_str()
        }
        ReceiptOutcome::Duplicate => "duplicate",
        ReceiptOutcome::UnknownOrder => {
            warn!(order_id = %receipt.order_id, event_id = %receipt.event_id, "SMS receipt for an order without a code; dropped");
            "unknown_order"
        }
    };
    metrics::counter!("codepool_sms_receipts_total", "result" => result).increment(1);
    Ok(())
}
