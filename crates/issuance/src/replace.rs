//! Replacing one code of an order: the buyer says it does not work, and
//! support voids that one code and gives its line a fresh one, without a
//! new order, a second payment, or a second code for a second click. What
//! `codepool replace`, `POST /v1/orders/{id}/lines/{line}/replace` and the
//! console's Replace button do, once.
//!
//! - The caller names the replacement (`replacement_id`): the same id
//!   again answers the same new code and does nothing else; the id with
//!   another order, line or reason is refused ([`ReplaceError::Conflict`]).
//! - The old code is void at once (reason `replaced`). The line's new code
//!   comes from the same pool through the gate's [`Move::Reissue`]: an
//!   expired or recalled code is never claimed, a paused or empty pool
//!   makes the line wait (served before the pool's backorders, see
//!   [`serve_open`]), and no per-user slot is taken: a replacement is not
//!   a second purchase. A shop's order is replaced only from the shop's
//!   pools.
//! - The new code gets a new grant number and its own `sms.pending` event
//!   (owed by the relay until confirmed); the shop hears `code.replaced`.
//! - A pool caps the replacements of one order
//!   (`replacements_per_order`, 3 by default).
//! - Every step is recorded in the store first and written conditionally
//!   ([`codepool_store::replacements`]): two requests with one id give one
//!   code, and a retry after a crash finishes the replacement.

use std::time::Duration;

use codepool_domain::gate::Move;
use codepool_domain::{mask, when, Code, CodeStatus, Purchase};
use codepool_store::pools::DEFAULT_REPLACEMENTS_PER_ORDER;
use codepool_store::replacements::{
    Begun, NewReplacement, OldCode, ReplacementDoc, ReplacementState, REPLACED_REASON,
};
use codepool_store::{Store, StoreError};
use tracing::{info, warn};

use crate::audit::{self, Actor, AuditKind};
use crate::claim::{ClaimEngine, ClaimError};
use crate::outbox::{Marking, Outbox};
use crate::ports::EventSink;

/// Longest replacement id accepted (the order ids' bound).
pub const MAX_ID_CHARS: usize = 128;

/// A replacement begun this long ago and never finished (its process
/// stopped between the void and the claim) is finished by the backorder
/// sweep of any process.
pub const FINISH_STALE_AFTER: Duration = Duration::from_secs(30);

/// Open replacements one sweep of a pool serves at most.
const SWEEP_BATCH: i64 = 100;

/// What support asks: replace the code of `line` of `order_id`.
#[derive(Debug, Clone, Copy)]
pub struct Ask<'a> {
    pub order_id: &'a str,
    pub line: u32,
    /// The caller's id for this replacement (idempotency).
    pub replacement_id: &'a str,
    pub reason: &'a str,
}

/// The services a replacement uses: the store, grant numbers (the claim
/// engine's), and the outbox with the sink its events go to.
#[derive(Clone, Copy)]
pub struct Services<'a> {
    pub store: &'a Store,
    pub engine: &'a ClaimEngine,
    pub outbox: &'a Outbox,
    pub sink: &'a dyn EventSink,
}

/// A replacement as it stands.
#[derive(Debug, Clone)]
pub struct Replaced {
    pub doc: ReplacementDoc,
    /// The line's new code; `None` while the line waits for stock.
    pub code: Option<Code>,
    /// Whether this call began the replacement (else: its id again).
    pub began: bool,
    /// Whether this call changed anything: voided the old code, or gave
    /// the line its new code (a twin request that found both done did not).
    pub acted: bool,
}

/// Why a code was not replaced. Nothing changed, unless said otherwise.
#[derive(Debug, thiserror::Error)]
pub enum ReplaceError {
    #[error("the reason must say why in 1 to {} characters of plain visible text (no control or bidi characters), e.g. \"code rejected by the platform\"", crate::ops::MAX_REASON_CHARS)]
    Reason,
    #[error("the replacement id must be 1 to {MAX_ID_CHARS} characters of plain visible text, e.g. a UUID; the same id again is the same replacement")]
    Id,
    #[error("order {order_id:?} has no code on line {line}: check the order id (`codepool lookup --order {order_id}`) and the line (0 to quantity - 1)")]
    NoLine { order_id: String, line: u32 },
    #[error("{detail}")]
    NotReplaceable {
        order_id: String,
        line: u32,
        /// The status of the line's code now.
        status: CodeStatus,
        detail: String,
    },
    /// The other replacement's order, line and reason are data, never in
    /// the words: they may be another shop's.
    #[error("replacement id {id:?} was used for another replacement (another order, line or reason); the same id is the same replacement. Choose a new id for a new one")]
    Conflict {
        id: String,
        order_id: String,
        line: u32,
        reason: String,
    },
    #[error("order {order_id:?} has had {limit} replacement(s), its pool's limit; nothing was replaced. The pool's setting replacements_per_order raises it (`codepool pool set --replacements-per-order N`)")]
    Limit { order_id: String, limit: u32 },
    #[error("the order's shop may no longer order from pool {pool:?}, so its code is not replaced from it")]
    PoolNotAllowed { pool: String },
    #[error("order {order_id:?} was voided before the line got its new code; a void is final, so it gets none")]
    Cancelled { order_id: String },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Claim(#[from] ClaimError),
}

impl ReplaceError {
    /// True when a server was away: the same request later may succeed.
    pub fn is_unavailable(&self) -> bool {
        match self {
            Self::Store(e) => e.is_unavailable(),
            Self::Claim(e) => e.is_unavailable(),
            _ => false,
        }
    }
}

/// A replacement id, trimmed and compared as NFC; `None` when empty, too
/// long or holding a character nobody can see.
pub fn checked_id(id: &str) -> Option<String> {
    codepool_domain::text::client_id(id, MAX_ID_CHARS)
}

/// Replaces the code of `ask.line` of `ask.order_id` (see the module
/// doc), audited with `actor`. Whose order it is, the door checks first.
pub async fn replace(
    s: &Services<'_>,
    ask: &Ask<'_>,
    actor: &Actor,
) -> Result<Replaced, ReplaceError> {
    let reason = crate::ops::checked_reason(ask.reason).ok_or(ReplaceError::Reason)?;
    let id = checked_id(ask.replacement_id).ok_or(ReplaceError::Id)?;
    // Replacement ids are each order owner's own: another shop's ids
    // neither collide with these nor say anything of them.
    let owner = order_owner(s.store, ask.order_id).await?;
    if let Some(doc) = s.store.replacement(owner.as_deref(), &id).await? {
        return again(s, doc, ask, reason, actor).await;
    }
    let old = match line_code(s.store, ask.order_id, ask.line).await {
        Ok(old) => old,
        // A request with the same id may have begun it since, and voided
        // the code: then this is that replacement again.
        Err(e) => match s.store.replacement(owner.as_deref(), &id).await? {
            Some(doc) => return again(s, doc, ask, reason, actor).await,
            None => return Err(e),
        },
    };
    let cap = admit(s.store, &old).await?;
    let new = NewReplacement {
        id: &id,
        reason,
        who: &actor.who,
        old: &old,
    };
    match s.store.begin_replacement(&new, cap).await? {
        Begun::Limit { limit } => Err(ReplaceError::Limit {
            order_id: ask.order_id.to_owned(),
            limit,
        }),
        Begun::Existing(doc) => again(s, doc, ask, reason, actor).await,
        Begun::New(doc) => {
            let done = finish(s, doc).await?;
            record(s.store, actor, &old, &done).await?;
            Ok(Replaced {
                began: true,
                ..done
            })
        }
    }
}

/// The same id again: the same replacement as it stands (one begun and
/// never finished is finished now), or a conflict for another body.
async fn again(
    s: &Services<'_>,
    doc: ReplacementDoc,
    ask: &Ask<'_>,
    reason: &str,
    actor: &Actor,
) -> Result<Replaced, ReplaceError> {
    if doc.order_id != ask.order_id || doc.line() != ask.line || doc.reason != reason {
        return Err(ReplaceError::Conflict {
            line: doc.line(),
            id: doc.id,
            order_id: doc.order_id,
            reason: doc.reason,
        });
    }
    match doc.state {
        ReplacementState::Voiding => {
            let done = finish(s, doc).await?;
            if done.acted {
                let what = format!(
                    "order {:?} line {}: replacement {:?} finished after an interruption",
                    done.doc.order_id,
                    done.doc.line(),
                    done.doc.id
                );
                audit::record(s.store, actor, AuditKind::Replace, what).await?;
            }
            Ok(done)
        }
        ReplacementState::Waiting => Ok(Replaced {
            doc,
            code: None,
            began: false,
            acted: false,
        }),
        ReplacementState::Done => {
            let code = s.store.replacement_code(&doc).await?;
            // The event is recorded once; again, in case a crash cut the
            // first run short after the code.
            if let Some(c) = &code {
                tell_shop(s.store, &doc, c).await;
            }
            Ok(Replaced {
                doc,
                code,
                began: false,
                acted: false,
            })
        }
        ReplacementState::Cancelled => Err(ReplaceError::Cancelled {
            order_id: doc.order_id,
        }),
    }
}

/// Who owns order `order_id` (the key or shop that placed it; `None` for
/// the operator's orders, and an order with no code).
async fn order_owner(store: &Store, order_id: &str) -> Result<Option<String>, ReplaceError> {
    let codes = store.grants_for_orders(&[order_id]).await?;
    Ok((codes.get(order_id).into_iter().flatten())
        .find_map(|c| c.order_holder())
        .and_then(|h| h.owner.clone()))
}

/// The code on `line` of `order_id` now, if it may be replaced: issued.
async fn line_code(store: &Store, order_id: &str, line: u32) -> Result<Code, ReplaceError> {
    let codes = store
        .grants_for_orders(&[order_id])
        .await?
        .remove(order_id)
        .unwrap_or_default();
    let no_line = || ReplaceError::NoLine {
        order_id: order_id.to_owned(),
        line,
    };
    let code = (codes.into_iter())
        .find(|c| c.order_holder().is_some_and(|h| h.line == line))
        .ok_or_else(no_line)?;
    if code.status == CodeStatus::Issued {
        return Ok(code);
    }
    Err(not_replaceable(order_id, line, &code))
}

/// Why the code of a line cannot be replaced, in words that say what is
/// true instead.
fn not_replaceable(order_id: &str, line: u32, code: &Code) -> ReplaceError {
    let what = format!("the code of line {line} of order {order_id:?}");
    let detail = match code.status {
        CodeStatus::Used => format!(
            "{what} was redeemed at {}: the buyer used it, so it is not replaced",
            when(code.used_at)
        ),
        CodeStatus::Void if code.void_reason.as_deref() == Some(REPLACED_REASON) => format!(
            "{what} was replaced at {}, and the line waits for its new code (it comes when the pool has stock); a line waiting is not replaced again",
            when(code.voided_at)
        ),
        CodeStatus::Void => format!(
            "{what} was voided at {} ({}); a void code is not replaced",
            when(code.voided_at),
            code.void_reason.as_deref().unwrap_or("no reason given")
        ),
        other => format!("{what} is {other}, not issued; only an issued code is replaced"),
    };
    ReplaceError::NotReplaceable {
        order_id: order_id.to_owned(),
        line,
        status: code.status,
        detail,
    }
}

/// The guards a replacement must pass before anything changes: a shop's
/// order is replaced only from the shop's pools. Returns the pool's cap
/// on replacements per order.
async fn admit(store: &Store, old: &Code) -> Result<u32, ReplaceError> {
    let owner = old.holder.as_ref().and_then(|h| h.owner.as_deref());
    if let Some(shop) = crate::shops::shop_of(owner) {
        let shops = store.shops_named(&[shop]).await?;
        if !shops.iter().any(|s| s.allows(&old.pool)) {
            return Err(ReplaceError::PoolNotAllowed {
                pool: old.pool.clone(),
            });
        }
    }
    Ok(store
        .pool(&old.pool)
        .await?
        .map_or(DEFAULT_REPLACEMENTS_PER_ORDER, |p| {
            p.replacements_per_order()
        }))
}

/// Voids the old code of a recorded replacement, then serves its line.
async fn finish(s: &Services<'_>, doc: ReplacementDoc) -> Result<Replaced, ReplaceError> {
    let voided_now = match s.store.void_replaced(&doc).await? {
        OldCode::Voided { now } => now,
        OldCode::Refused(code) => {
            // Nothing changed: forget it, so it does not count.
            s.store.drop_replacement(&doc).await?;
            return Err(not_replaceable(&doc.order_id, doc.line(), &code));
        }
    };
    if let Some(pause) = crate::failpoint::pause("replace-pause") {
        tokio::time::sleep(pause).await;
    }
    let done = serve(s, doc).await?;
    Ok(Replaced {
        acted: done.acted || voided_now,
        ..done
    })
}

/// Gives a replacement's line its new code, through the gate, or records
/// that it waits (a paused or empty pool).
async fn serve(s: &Services<'_>, doc: ReplacementDoc) -> Result<Replaced, ReplaceError> {
    let waits = |doc: ReplacementDoc| Replaced {
        doc,
        code: None,
        began: false,
        acted: false,
    };
    let guard = crate::guard::Guard::of_pool(s.store, &doc.pool).await?;
    if guard.stopped(Move::Reissue, [doc.pool.as_str()]).is_some() {
        return Ok(waits(
            s.store
                .settle_replacement(&doc.order_id, &doc.key, None)
                .await?,
        ));
    }
    let number = s.engine.grant_number(&purchase_of(&doc)).await?;
    let Some((code, fresh)) = s.store.claim_replacement(&doc, number).await? else {
        return Ok(waits(
            s.store
                .settle_replacement(&doc.order_id, &doc.key, None)
                .await?,
        ));
    };
    let settled = s
        .store
        .settle_replacement(&doc.order_id, &doc.key, Some(&code))
        .await?;
    if settled.state == ReplacementState::Cancelled {
        // The order was voided meanwhile: nothing is sent for this code.
        s.store.withdraw_replacement_code(&code).await?;
        return Err(ReplaceError::Cancelled {
            order_id: settled.order_id,
        });
    }
    tell_shop(s.store, &settled, &code).await;
    if fresh {
        send(s, &code).await;
    }
    Ok(Replaced {
        doc: settled,
        code: Some(code),
        began: false,
        acted: fresh,
    })
}

/// The order a replacement serves, as a purchase (for its grant number).
fn purchase_of(doc: &ReplacementDoc) -> Purchase {
    Purchase {
        order_id: doc.order_id.clone(),
        uid: doc.uid.clone(),
        phone: doc.phone.clone(),
        pool: doc.pool.clone(),
        purchased_at: None,
        quantity: doc.quantity(),
        owner: doc.owner.clone(),
        shop: crate::shops::shop_of(doc.owner.as_deref()).map(str::to_owned),
        hold_id: None,
        items: Vec::new(),
    }
}

/// The new code's `sms.pending` event, through the outbox. Not confirmed:
/// the relay sends it (the claim flagged it), with the same id.
async fn send(s: &Services<'_>, code: &Code) {
    let Some(grant) = code.grant() else {
        return;
    };
    match s.outbox.send(s.sink, &[grant], Marking::Now).await {
        Ok(sent) if sent.confirmed() == 1 => {}
        Ok(_) => {
            warn!(pool = %code.pool, "a replacement's sms.pending was not confirmed; the relay sends it")
        }
        Err(e) => {
            warn!(error = %e, "a replacement's sms.pending went out but was not marked; the relay sends it again")
        }
    }
}

/// Records `code.replaced` for a shop's order (idempotent). A failure is
/// said, not hidden; the same id again records it.
async fn tell_shop(store: &Store, doc: &ReplacementDoc, code: &Code) {
    let Some(event) = crate::webhooks::events::code_replaced(doc, code) else {
        return;
    };
    if let Err(e) = store.record_webhook_events(&[event]).await {
        warn!(error = %e, order_id = %doc.order_id, "code replaced, but its code.replaced webhook was not recorded; the same replacement id again records it");
        metrics::counter!("codepool_webhook_record_failures_total", "event" => "code.replaced")
            .increment(1);
    }
}

/// The audit record of a replacement begun by `actor`.
async fn record(
    store: &Store,
    actor: &Actor,
    old: &Code,
    done: &Replaced,
) -> Result<(), StoreError> {
    let d = &done.doc;
    let outcome = match &done.code {
        Some(c) => format!(
            "new code {} ({})",
            c.masked(),
            (c.holder.as_ref().and_then(|h| h.grant_no.as_deref())).unwrap_or("no grant number")
        ),
        None => "the line waits for stock".to_owned(),
    };
    let what = format!(
        "order {:?} line {}: code {} replaced ({:?}), replacement {:?} ({} of the order); {outcome}",
        d.order_id,
        d.line(),
        mask(&old.code),
        d.reason,
        d.id,
        d.number(),
    );
    info!(order_id = %d.order_id, line = d.line(), replacement = %d.id, waiting = done.code.is_none(), "code replaced");
    audit::record(store, actor, AuditKind::Replace, what).await
}

/// Serves the open replacements of `pool`, oldest first, before its
/// backorders: those waiting for stock, and those a stopped process left
/// between the void and the claim. Stops at the first that has to wait.
/// Returns how many got their code.
pub async fn serve_open(s: &Services<'_>, pool: &str) -> Result<u64, ReplaceError> {
    let stale =
        chrono::Utc::now() - chrono::Duration::from_std(FINISH_STALE_AFTER).unwrap_or_default();
    let open = s
        .store
        .open_replacements(pool, bson::DateTime::from_chrono(stale), SWEEP_BATCH)
        .await?;
    let mut served = 0;
    for doc in open {
        let done = match doc.state {
            ReplacementState::Voiding => finish(s, doc).await,
            _ => serve(s, doc).await,
        };
        match done {
            Ok(r) if r.code.is_some() => served += 1,
            Ok(_) => break,
            // Voided meanwhile, or its code used before the void: settled.
            Err(ReplaceError::Cancelled { .. } | ReplaceError::NotReplaceable { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    if served > 0 {
        info!(pool, served, "waiting replacements served");
    }
    Ok(served)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replacement_ids_are_visible_text_of_bounded_length() {
        assert_eq!(checked_id("  r-1 ").as_deref(), Some("r-1"));
        assert_eq!(checked_id("cafe\u{301}").as_deref(), Some("caf\u{e9}"));
        assert_eq!(checked_id(""), None);
        assert_eq!(checked_id("a\u{202e}b"), None);
        assert!(checked_id(&"x".repeat(MAX_ID_CHARS)).is_some());
        assert_eq!(checked_id(&"x".repeat(MAX_ID_CHARS + 1)), None);
    }
}
