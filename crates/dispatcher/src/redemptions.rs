//! `code.redeemed` events: the platform reports that a buyer used a code,
//! by pool and code or by order. Each moves an issued code to used, exactly
//! like `codepool redeem`. Redelivered or repeated events change nothing;
//! events that cannot apply (unknown, unissued or void code) are logged and
//! dropped, since waiting will not make them valid.
//!
//! Only the platform may report a redemption: an event is applied only
//! when its `user_id` property (which RabbitMQ checks against the user that
//! published it) names one of the configured redeemers
//! (`--redeemers` / `CODEPOOL_REDEEMERS`). A shop's purchase producer
//! cannot mark an order used, and so cannot block its refund. Every
//! applied redemption is audited with the broker user that sent it.

use codepool_domain::{mask, Redemption};
use codepool_issuance::audit::Actor;
use codepool_issuance::background::Parts;
use codepool_issuance::model::{CodeRef, LifecycleError, Redeemed};
use codepool_issuance::StoreError;
use lapin::message::Delivery;
use tracing::{debug, info, warn};

/// The broker user a redemption may be applied for, or the reason it may
/// not: no `user_id`, or one that is not among `redeemers`.
fn redeemer<'a>(delivery: &'a Delivery, redeemers: &[String]) -> Result<&'a str, String> {
    let Some(user) = delivery.properties.user_id().as_ref().map(|u| u.as_str()) else {
        return Err("it carries no user_id property; the platform must publish it with user_id set to its broker user".into());
    };
    if redeemers.iter().any(|r| r == user) {
        Ok(user)
    } else if redeemers.is_empty() {
        Err("no broker user may redeem: start the dispatcher with --redeemers (CODEPOOL_REDEEMERS) naming the platform's broker user".into())
    } else {
        Err(format!(
            "broker user {user:?} is not among --redeemers (CODEPOOL_REDEEMERS)"
        ))
    }
}

/// Applies one redemption delivery from an allowed broker user (see the
/// module doc). `Err` only when MongoDB is unavailable.
pub async fn apply_redemption(
    parts: &Parts,
    delivery: &Delivery,
    redeemers: &[String],
) -> Result<(), StoreError> {
    let user = match redeemer(delivery, redeemers) {
        Ok(user) => user,
        Err(why) => {
            warn!(reason = %why, "code.redeemed event refused; dropped");
            metrics::counter!("codepool_redemptions_total", "result" => "unauthorized")
                .increment(1);
            return Ok(());
        }
    };
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
    let actor = Actor::amqp_user(user, "code.redeemed event");
    let result = match parts.redeem(target, None, &actor).await {
        Ok(Redeemed::Before(_)) => "duplicate",
        Ok(Redeemed::Now(done)) => {
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
