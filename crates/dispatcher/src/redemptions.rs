//! `code.redeemed` events: the platform reports that a buyer used a code,
//! by pool and code or by order. Each moves an issued code to used, exactly
//! like `codepool redeem`. Redelivered or repeated events change nothing;
//! events that cannot apply (unknown, unissued or void code) are logged and
//! dropped, since waiting will not make them valid.

use codepool_domain::{mask, Redemption};
use codepool_store::lifecycle::{CodeRef, LifecycleError};
use codepool_store::{Store, StoreError};
use lapin::message::Delivery;
use tracing::{debug, info, warn};

/// Applies one redemption delivery. `Err` only when MongoDB is unavailable.
pub async fn apply_redemption(store: &Store, delivery: &Delivery) -> Result<(), StoreError> {
    let redemption = match Redemption::parse(&delivery.data) {
        Ok(r) => r,
        Err(e) => {
            warn!(error = %e, "malformed code.redeemed event dropped");
            metrics::counter!("codepool_redemptions_total", "result" => "malformed").increment(1);
            return Ok(());
        }
    };
    let target = match &redemption {
        Redemption::Code { pool, code } => CodeRef::Code { pool, code },
        Redemption::Order { order_id } => CodeRef::Order(order_id),
    };
    let result = match store.redeem(target).await {
        Ok(done) => {
            for t in done {
                info!(pool = %t.before.pool, code = %mask(&t.before.code), order_id = t.before.holder.as_ref().map_or("", |h| h.order_id.as_str()), "code redeemed");
            }
            "redeemed"
        }
        Err(LifecycleError::AlreadyUsed { .. }) => {
            debug!(what = %target.describe(), "code.redeemed repeated; already used");
            "duplicate"
        }
        Err(LifecycleError::Store(e)) if e.is_unavailable() => return Err(e),
        Err(e) => {
            warn!(error = %e, "code.redeemed event refused; dropped");
            "refused"
        }
    };
    metrics::counter!("codepool_redemptions_total", "result" => result).increment(1);
    Ok(())
}
