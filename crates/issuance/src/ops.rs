//! Application services for operators: what `codepool lookup`, `void`,
//! `expire` and `resend` do. The CLI parses flags and prints; the rules
//! (which codes may be re-sent, that a voided unissued code leaves the hot
//! pool, that a reason is required) are here, once.

use codepool_broker::BrokerError;
use codepool_domain::{when, Code, NotSendable, SmsPending};
use codepool_store::backorders::BackorderDoc;
use codepool_store::lifecycle::{
    Applied, CodeRef, LifecycleError, Redeemed, RedemptionTag, VoidOutcome,
};
use codepool_store::policies::RefusalDoc;
use codepool_store::redemptions::UsedById;
use codepool_store::replacements::ReplacementDoc;
use codepool_store::{CodeQuery, Store, StoreError};
use tracing::{debug, warn};

use crate::audit::{self, Actor, AuditKind};
use crate::outbox::{Marking, Outbox};
use crate::ports::{CandidatePool, EventSink};

/// Longest void reason accepted.
pub const MAX_REASON_CHARS: usize = 200;

/// Codes and backorders matching an operator's question.
#[derive(Debug)]
pub struct Lookup {
    pub codes: Vec<Code>,
    /// Backorders of the order asked about (only for an order query).
    pub backorders: Vec<BackorderDoc>,
    /// Whether a pool policy refused the order (only for an order query).
    pub refusals: Vec<RefusalDoc>,
    /// The buyer's latest holds (only for a buyer query); their codes are
    /// never shown.
    pub holds: Vec<codepool_store::holds::HoldDoc>,
    /// The order's replacements, oldest first (only for an order query).
    pub replacements: Vec<ReplacementDoc>,
    /// The codes the order's replacements replaced, void (only for an
    /// order query); `codes` holds each line's code now.
    pub replaced: Vec<Code>,
    /// The hold that held each code a recall or its expiry voided while
    /// held (the code itself keeps nothing of its hold).
    pub lost_by_holds: std::collections::HashMap<codepool_domain::CodeId, String>,
}

impl Lookup {
    /// The hold or bundle that set `c` aside: the one it is held under,
    /// or the hold that held it when a recall or its expiry voided it.
    pub fn set_aside(&self, c: &Code) -> Option<codepool_domain::SetAside> {
        c.set_aside().or_else(|| {
            (self.lost_by_holds.get(&c.id)).map(|hold_id| codepool_domain::SetAside::Hold {
                hold_id: hold_id.clone(),
            })
        })
    }

    pub fn is_empty(&self) -> bool {
        self.codes.is_empty()
            && self.backorders.is_empty()
            && self.refusals.is_empty()
            && self.holds.is_empty()
    }

    /// Where an order stands, from what an order query found (`None`:
    /// nothing of it was found).
    pub fn state(&self) -> Option<OrderState> {
        let waiting = self
            .backorders
            .iter()
            .any(|b| b.status == codepool_store::backorders::BackorderState::Waiting);
        let replacing = self.replacements.iter().any(|r| r.state.is_open());
        let all_void = (self.codes.iter()).all(|c| c.status == codepool_domain::CodeStatus::Void);
        Some(if !self.refusals.is_empty() {
            OrderState::Refused
        } else if self.codes.is_empty() {
            match self.backorders.first() {
                None => return None,
                Some(_) if waiting => OrderState::Waiting,
                Some(_) => OrderState::Cancelled,
            }
        } else if replacing && all_void {
            // Its only codes were replaced, and the new ones wait.
            OrderState::Waiting
        } else if waiting || replacing {
            OrderState::PartlyGranted
        } else if all_void {
            OrderState::Void
        } else {
            OrderState::Granted
        })
    }

    /// Who placed the order an order query found: `api-key-id:ID` or
    /// `shop:NAME` (see [`crate::api_keys::KeyDoc::owner`]); `None` for an
    /// order that came over AMQP without a shop.
    pub fn owner(&self) -> Option<&str> {
        (self.codes.first())
            .and_then(|c| c.holder.as_ref())
            .and_then(|h| h.owner.as_deref())
            .or_else(|| self.backorders.first().and_then(|b| b.owner.as_deref()))
    }

    /// The lines of the order still waiting for a code: those its
    /// backorder waits for, and those whose replacement waits for stock.
    pub fn waiting_lines(&self) -> Vec<u32> {
        let mut lines: Vec<u32> = (self.backorders.iter())
            .filter(|b| b.status == codepool_store::backorders::BackorderState::Waiting)
            .flat_map(|b| b.waiting_lines())
            .chain(
                (self.replacements.iter())
                    .filter(|r| r.state.is_open())
                    .map(|r| r.line()),
            )
            .collect();
        lines.sort_unstable();
        lines.dedup();
        lines
    }

    /// Whether `owner` placed the order found (a key acts on its own
    /// orders, a shop's key on its shop's).
    pub fn is_owned_by(&self, owner: &str) -> bool {
        self.owner() == Some(owner)
    }
}

/// Where an order stands, as every door shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OrderState {
    /// A pool policy refused it.
    Refused,
    /// No code yet: it waits for stock (a backorder).
    Waiting,
    /// Voided while it waited: it gets nothing.
    Cancelled,
    /// Some lines have codes, the rest wait.
    PartlyGranted,
    /// Every code of it was voided.
    Void,
    Granted,
}

impl OrderState {
    /// The name the HTTP API and the JSON outputs use.
    pub fn name(self) -> &'static str {
        match self {
            Self::Refused => "refused",
            Self::Waiting => "waiting",
            Self::Cancelled => "cancelled",
            Self::PartlyGranted => "partly_granted",
            Self::Void => "void",
            Self::Granted => "granted",
        }
    }

    /// The words a page shows.
    pub fn label(self) -> &'static str {
        match self {
            Self::PartlyGranted => "partly granted",
            other => other.name(),
        }
    }
}

/// Who got which code, and for an order, whether it waits as a backorder.
pub async fn lookup(store: &Store, query: CodeQuery<'_>, limit: i64) -> Result<Lookup, StoreError> {
    let (codes, replaced) = match query {
        // Every code of an order, by line, whatever the limit: each line's
        // code now, and the codes replaced since (at most as many again).
        CodeQuery::Order(_) => {
            let most = limit.max(2 * i64::from(codepool_domain::MAX_QUANTITY));
            codepool_store::codes::current_by_line(store.find_codes(&query, most).await?)
        }
        _ => (store.find_codes(&query, limit).await?, Vec::new()),
    };
    // A held code is shown to no one (its hold is, see `holds`).
    let codes: Vec<Code> = codes
        .into_iter()
        .filter(|c| c.status != codepool_domain::CodeStatus::Held)
        .collect();
    let holds = match query {
        CodeQuery::Uid(uid) => store.holds_of_uid(uid, 20).await?,
        _ => Vec::new(),
    };
    let (backorders, refusals, replacements) = match query {
        CodeQuery::Order(o) => (
            store.backorders_for_orders(&[o]).await?,
            store.refusals_for_orders(&[o]).await?,
            store.replacements_for_orders(&[o]).await?,
        ),
        _ => (Vec::new(), Vec::new(), Vec::new()),
    };
    // A code voided while held keeps nothing of its hold; the hold lists it.
    let unsold_voids: Vec<codepool_domain::CodeId> = (codes.iter())
        .filter(|c| c.status == codepool_domain::CodeStatus::Void && c.holder.is_none())
        .map(|c| c.id)
        .collect();
    let lost_by_holds = (store.holds_that_lost(&unsold_voids).await?.into_iter())
        .map(|(id, h)| (id, h.hold_id))
        .collect();
    Ok(Lookup {
        codes,
        backorders,
        refusals,
        holds,
        replacements,
        replaced,
        lost_by_holds,
    })
}

#[derive(Debug, thiserror::Error)]
pub enum VoidError {
    #[error("the reason must say why in 1 to {MAX_REASON_CHARS} characters of plain visible text (no control or bidi characters), e.g. --reason refund")]
    Reason,
    #[error("{0:?} is the reason codepool records for its own voids (the expiry sweep, a replacement, a recall), which statements count apart; say why in other words, e.g. \"expired on the platform\", or use `codepool replace` or `codepool void --import`")]
    Reserved(String),
    #[error(transparent)]
    Lifecycle(#[from] LifecycleError),
}

/// Void reasons only codepool itself writes (compared trimmed, in any
/// case): a statement tells its own voids apart by them.
pub const RESERVED_REASONS: [&str; 3] = ["expired", "replaced", "recalled"];

/// Voids a code (or cancels the order's backorder), audited with `actor`.
/// An unissued code also leaves the hot pool, best effort: the claim's
/// condition refuses a void code anyway.
pub async fn void(
    store: &Store,
    hot: &dyn CandidatePool,
    target: CodeRef<'_>,
    reason: &str,
    actor: &Actor,
) -> Result<VoidOutcome, VoidError> {
    let reason = checked_reason(reason).ok_or(VoidError::Reason)?;
    if RESERVED_REASONS.contains(&reason.to_lowercase().as_str()) {
        return Err(VoidError::Reserved(reason.to_owned()));
    }
    let outcome = store.void(target, reason).await?;
    if let VoidOutcome::Voided { applied, .. } = &outcome {
        let before: Vec<_> = applied.iter().map(|a| a.before.clone()).collect();
        // The codes are void either way; the shop's event is owed, and a
        // failure to record it is said, not hidden.
        if let Err(e) = crate::webhooks::record_voided(store, &before, reason).await {
            warn!(error = %e, "codes voided, but their order.voided webhook was not recorded");
        }
    }
    let what = match &outcome {
        VoidOutcome::Voided {
            applied,
            backorder_cancelled,
        } => format!(
            "{}: {} code(s) voided{}; reason {reason:?}",
            target.describe(),
            applied.len(),
            if *backorder_cancelled {
                ", backorder cancelled"
            } else {
                ""
            }
        ),
        VoidOutcome::BackorderCancelled { order_id } => {
            format!("order {order_id:?}: no issued code left; what it waited for (backorder, replacement) cancelled; reason {reason:?}")
        }
    };
    audit::record(store, actor, AuditKind::Void, what)
        .await
        .map_err(LifecycleError::Store)?;
    if let VoidOutcome::Voided { applied, .. } = &outcome {
        for code in applied.iter().map(|a| &a.before) {
            if code.holder.is_none() {
                if let Err(e) = hot.remove(&code.pool, &[code.id]).await {
                    debug!(error = %e, "voided code stays a hot-pool candidate until Redis is back; claims refuse it");
                }
            }
        }
    }
    Ok(outcome)
}

/// A void or recall reason, trimmed; `None` when empty, too long, or
/// holding a character nobody can see (a control, a bidi control, an
/// invisible format character): reasons are shown to operators and
/// written to exports, so they are checked like ids.
pub fn checked_reason(reason: &str) -> Option<&str> {
    let reason = reason.trim();
    let readable = codepool_domain::first_unreadable(reason).is_none();
    (readable && !reason.is_empty() && reason.chars().count() <= MAX_REASON_CHARS).then_some(reason)
}

/// Redeems an issued code, or every issued code of an order: every door's
/// redemption (the platform's by code over HTTP, by order over HTTP, the
/// AMQP `code.redeemed` event, `codepool redeem`). A redemption made now is
/// audited with `actor` and told to the shop (`code.redeemed`); one made
/// before under the same `tag` ([`Redeemed::Before`]) changes nothing and
/// records nothing.
pub async fn redeem(
    store: &Store,
    target: CodeRef<'_>,
    tag: Option<&RedemptionTag>,
    actor: &Actor,
) -> Result<Redeemed, LifecycleError> {
    let done = store.redeem_tagged(target, tag).await?;
    let Redeemed::Now(applied) = &done else {
        return Ok(done);
    };
    let named = match (target, applied.as_slice()) {
        (CodeRef::Id(_), [a]) => code_named(a),
        _ => target.describe(),
    };
    let what = redeemed_words(&named, applied.len(), tag);
    record_redeemed(store, applied, vec![(actor, what)]).await?;
    Ok(done)
}

/// A code named in an audit record: masked, with its pool.
fn code_named(a: &Applied) -> String {
    format!(
        "code {} in pool {:?}",
        codepool_domain::mask(&a.before.code),
        a.before.pool
    )
}

fn redeemed_words(named: &str, count: usize, tag: Option<&RedemptionTag>) -> String {
    let tagged = tag.map_or(String::new(), |t| format!(", redemption id {:?}", t.id));
    format!("{named}: {count} code(s) used{tagged}")
}

/// The audit records of redemptions made now, and the shop's events,
/// written at once: the codes are used either way, so the events are
/// owed, and a failure to record them is said, not hidden.
async fn record_redeemed(
    store: &Store,
    applied: &[Applied],
    records: Vec<(&Actor, String)>,
) -> Result<(), StoreError> {
    let (audited, told) = tokio::join!(
        audit::record_all(store, AuditKind::Redeem, records),
        crate::webhooks::record_redeemed(store, applied)
    );
    if let Err(e) = told {
        warn!(error = %e, "codes redeemed, but their code.redeemed webhook was not recorded");
    }
    audited
}

/// Redeems codes found by value, many at once, each under its own
/// redemption tag and actor: the batched form of [`redeem`] for the
/// platform's redemptions by code ([`crate::redeem::Finder`]), with the
/// same transition (issued → used), one audit record per redemption made
/// now, and one `code.redeemed` for each. What each redemption did comes
/// back in the order asked ([`UsedById`]); a redemption made before under
/// the same tag records nothing. When the audit records cannot be written,
/// the error is the batch's: the codes are used, and the same tags again
/// are answered as made before.
pub async fn redeem_ids(
    store: &Store,
    asks: &[(&Code, RedemptionTag, &Actor)],
) -> Result<Vec<UsedById>, StoreError> {
    let ids: Vec<(&Code, RedemptionTag)> = asks.iter().map(|(c, t, _)| (*c, t.clone())).collect();
    let done = store.redeem_ids(&ids).await?;
    let mut applied = Vec::new();
    let mut records = Vec::new();
    for ((_, tag, actor), d) in asks.iter().zip(&done) {
        if let UsedById::Now(a) = d {
            records.push((*actor, redeemed_words(&code_named(a), 1, Some(tag))));
            applied.push(Applied::clone(a));
        }
    }
    if !applied.is_empty() {
        record_redeemed(store, &applied, records).await?;
    }
    Ok(done)
}

#[derive(Debug, thiserror::Error)]
pub enum ExpireError {
    #[error("pool {0:?} does not exist; `codepool pool show` lists the pools")]
    UnknownPool(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Voids expired unissued codes now (of one pool, or all).
pub async fn expire(
    store: &Store,
    hot: &dyn CandidatePool,
    pool: Option<&str>,
) -> Result<u64, ExpireError> {
    if let Some(pool) = pool {
        if store.pool(pool).await?.is_none() {
            return Err(ExpireError::UnknownPool(pool.to_owned()));
        }
    }
    Ok(crate::expiry::expire_codes(store, hot, pool).await?)
}

#[derive(Debug, thiserror::Error)]
pub enum ResendError {
    #[error("order {order} has no code yet (backorder {status} since {since}); it gets one, with its SMS, when codes are imported into pool {pool}")]
    Backordered {
        order: String,
        status: codepool_store::backorders::BackorderState,
        since: String,
        pool: String,
    },
    #[error("no code was granted to order {0}; check the id with `codepool lookup --order {0}`, or whether the purchase was dead-lettered (`codepool dead-letters list`)")]
    NotGranted(String),
    #[error("order {order}: {reason}")]
    NotSendable { order: String, reason: NotSendable },
    #[error("RabbitMQ did not confirm the event; run the command again")]
    Unconfirmed(#[source] BrokerError),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Publishes an order's SMS-pending events again (one per part of an
/// order of several codes; its revoked and redeemed codes are not sent),
/// through the outbox, and records the re-send. Returns the events that
/// went out and the codes they carry.
pub async fn resend(
    store: &Store,
    outbox: &Outbox,
    sink: &dyn EventSink,
    order: &str,
    actor: &Actor,
) -> Result<(Vec<SmsPending>, Vec<Code>), ResendError> {
    let Some(codes) = store.grants_for_orders(&[order]).await?.remove(order) else {
        return Err(
            match store
                .backorders_for_orders(&[order])
                .await?
                .into_iter()
                .next()
            {
                Some(b) => ResendError::Backordered {
                    order: order.to_owned(),
                    status: b.status,
                    since: when(Some(b.created_at.to_chrono())),
                    pool: b.pool,
                },
                None => ResendError::NotGranted(order.to_owned()),
            },
        );
    };
    let not_sendable = |reason| ResendError::NotSendable {
        order: order.to_owned(),
        reason,
    };
    let mut grants = Vec::new();
    let mut sendable = Vec::new();
    let mut first_refusal = None;
    for code in codes {
        match code.resendable() {
            Ok(g) => {
                grants.push(g);
                sendable.push(code);
            }
            Err(e) => {
                first_refusal.get_or_insert(e);
            }
        }
    }
    if grants.is_empty() {
        return Err(not_sendable(first_refusal.unwrap_or(NotSendable::Unissued)));
    }
    let events: Vec<SmsPending> = codepool_domain::sms_events(&grants)
        .into_iter()
        .map(|(e, _)| e)
        .collect();
    let sent = outbox.send(sink, &grants, Marking::Resent).await?;
    match sent.results.into_iter().find(|r| r.is_err()) {
        None => {
            let what = format!("order {order:?}: {} event(s) sent again", events.len());
            audit::record(store, actor, AuditKind::Resend, what).await?;
            Ok((events, sendable))
        }
        Some(Err(e)) => Err(ResendError::Unconfirmed(e)),
        Some(Ok(())) => Err(ResendError::Unconfirmed(BrokerError::Nacked)),
    }
}

/// The codes of order `order_id`, to show in plaintext to `actor`: the
/// reveal is recorded first (no record, no reveal).
pub async fn reveal_order(
    store: &Store,
    order_id: &str,
    actor: &crate::audit::Actor,
) -> Result<Lookup, StoreError> {
    let found = lookup(store, CodeQuery::Order(order_id), 100).await?;
    if !found.codes.is_empty() {
        let ids = found.codes.iter().map(|c| c.id).collect();
        let what = format!("order {order_id:?}");
        crate::audit::reveal(store, actor, what, ids, found.codes.len() as u64).await?;
    }
    Ok(found)
}
