//! What a placed batch owes, whichever door it came in by: the durable
//! half ([`Intake::place`]: decide, claim, backorders), then the
//! announcements (`pool.exhausted`, `purchase.refused`, `sms.pending`
//! through the outbox), one log line per order and the counters. The AMQP
//! door adds its dead letters and acks; the HTTP door answers as soon as
//! the durable half is done and leaves the announcements to [`announce`].

use std::collections::HashSet;
use std::time::Duration;

use codepool_broker::{BrokerError, PendingConfirm, Publisher};
use codepool_domain::{CodeId, Grant, PoolEvent, PoolEventKind};
use tracing::{debug, info, warn};

use crate::outbox::{Marking, Outbox};
use crate::plan::{BatchPlan, Step};
use crate::Door;

/// What [`announce`] published.
#[derive(Debug, Default)]
pub struct Announced {
    /// Positions whose `sms.pending` or `purchase.refused` event the
    /// broker did not confirm: the relay sends those again.
    pub unconfirmed: HashSet<usize>,
    /// Every `sms.pending` event asked for was confirmed: nothing of it is
    /// left for the relay.
    pub texted: bool,
}

/// Which grants of a step to text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Texting {
    /// Every grant of the step: a redelivered purchase's event is sent
    /// again with the same `event_id` (the AMQP door).
    Every,
    /// Only what this batch issued: a repeated request gets its codes in
    /// the answer, not a second SMS (the HTTP door; `resend` is for that).
    /// The batch's record owes their events ([`Resend::ByRecord`]); the
    /// caller takes it away once [`Announced::texted`] says all were
    /// confirmed.
    Fresh,
}

/// Publishes what a placed batch owes, for the positions in `only` (all
/// when `None`): `pool.exhausted` once per pool run dry (first round
/// only), `purchase.refused` per refusal and `sms.pending` per grant, the
/// confirms in flight together. One line per order whose `sms.pending`
/// the broker confirmed, in this step's `announce` span (the `door` the
/// batch came by, its size, and whether this is a publish again).
#[tracing::instrument(
    name = "announce",
    skip_all,
    fields(door = door.as_str(), size = plan.steps.len(), again = only.is_some())
)]
pub async fn announce(
    plan: &BatchPlan,
    outbox: &Outbox,
    publisher: &Publisher,
    texting: Texting,
    only: Option<&HashSet<usize>>,
    store: &codepool_store::Store,
    (door, resend): (Door, crate::Resend),
) -> Announced {
    if only.is_none() {
        announce_exhausted(plan, publisher, store).await;
    }
    let sms: Vec<(usize, &Grant)> = match texting {
        Texting::Every => plan.sms_events(),
        Texting::Fresh => (plan.steps.iter().enumerate())
            .flat_map(|(i, s)| fresh_grants(s).into_iter().map(move |g| (i, g)))
            .collect(),
    };
    let sms: Vec<_> = sms.into_iter().filter(|(i, _)| wanted(only, *i)).collect();
    let grants: Vec<&Grant> = sms.iter().map(|(_, g)| *g).collect();
    let (sent, mut unconfirmed) = tokio::join!(
        outbox.send(publisher, &grants, Marking::after(resend)),
        announce_refusals(plan, publisher, only),
    );
    let mut texted = false;
    match sent {
        Ok(sent) => {
            texted = sent.confirmed() == sent.results.len();
            crate::outbox::log_published(&grants, &sent);
            for ((i, _), r) in sms.iter().zip(&sent.results) {
                if r.is_err() {
                    unconfirmed.insert(*i);
                }
            }
        }
        // Not recorded (nothing is, for either door: the purchase or the
        // batch's record owes the event): the relay sends them again, with
        // the same event ids.
        Err(e) => {
            debug!(error = %e, "SMS events not recorded as sent");
            unconfirmed.extend(sms.iter().map(|(i, _)| *i));
        }
    }
    Announced {
        unconfirmed,
        texted,
    }
}

/// Whether a step answers codes issued before its request (a repeat of an
/// order, which shows its codes again).
pub fn is_repeat(step: &Step) -> bool {
    matches!(step, Step::Grant { grants, fresh, .. }
        if (*fresh as usize) < grants.len() && grants.iter().any(|g| !g.revoked))
}

/// Records, in one durable write, every repeat among `steps` that shows
/// codes again, each with its actor (`actors` is aligned with `steps`).
/// No record, no reveal: a door shows a repeat's codes only once this
/// returned `Ok`.
pub async fn audit_repeats(
    store: &codepool_store::Store,
    steps: &[Step],
    actors: &[crate::audit::Actor],
) -> Result<(), codepool_store::StoreError> {
    let reveals: Vec<codepool_store::audit::Reveal> = (steps.iter().zip(actors))
        .filter_map(|(s, actor)| {
            let Step::Grant {
                purchase, grants, ..
            } = s
            else {
                return None;
            };
            if !is_repeat(s) {
                return None;
            }
            let shown: Vec<CodeId> = (grants.iter())
                .filter(|g| !g.revoked)
                .map(|g| g.code_id)
                .collect();
            let what = format!("order {:?}", purchase.order_id);
            let count = shown.len() as u64;
            Some(crate::audit::reveal_of(actor, what, shown, count))
        })
        .collect();
    if reveals.is_empty() {
        return Ok(());
    }
    store.record_reveals(&reveals).await
}

/// What follows a placed batch in every door: its counters, and a stock
/// check of the pools it granted from (throttled, in the background: a
/// pool that crossed its threshold raises `pool.low_stock`).
pub fn account(plan: &BatchPlan, stock: &std::sync::Arc<crate::StockWatch>, publisher: &Publisher) {
    count(plan);
    crate::channels::stock::changed(plan.granted_pools.keys().map(String::as_str));
    for pool in &plan.exhausted_pools {
        crate::channels::stock::ran_out(pool);
    }
    stock.after_grants(
        plan.granted_pools.iter().map(|(p, n)| (p.as_str(), *n)),
        publisher,
    );
}

/// `pool.exhausted` for each pool that ran dry in `plan`, once per time it
/// runs out: told by the one batch, of any process and either door, that
/// raises the pool's latch in MongoDB
/// ([`codepool_store::Store::claim_exhausted_alert`]; codes coming in
/// re-arm it). A notification, not a state: a failure is logged and
/// counted, gives the latch back for the next shortage to tell, and does
/// not hold the acks or the answer.
pub async fn announce_exhausted(
    plan: &BatchPlan,
    publisher: &Publisher,
    store: &codepool_store::Store,
) {
    let short_since = plan.claims_began.unwrap_or_else(bson::DateTime::now);
    for pool in &plan.exhausted_pools {
        let n = match store.claim_exhausted_alert(pool, short_since).await {
            Ok(Some(n)) => n,
            Ok(None) => {
                debug!(pool, "pool.exhausted told already for this exhaustion");
                continue;
            }
            Err(e) => {
                warn!(pool, error = %e, "pool.exhausted not told: its latch was not read");
                metrics::counter!("codepool_event_publish_failures_total", "event" => "pool.exhausted")
                    .increment(1);
                continue;
            }
        };
        warn!(
            pool,
            "pool exhausted; purchases are backordered until codes are imported"
        );
        let event = PoolEvent::new(PoolEventKind::Exhausted, pool);
        let recorded =
            crate::webhooks::record_pool_event(store, &event, &format!("exhaustion {n}")).await;
        // Bounded: a notification never holds a batch long.
        let published = match publisher.publish_pool_event(&event).await {
            Ok(confirm) => tokio::time::timeout(NOTICE_CONFIRM_WAIT, confirm.wait())
                .await
                .unwrap_or_else(|_| {
                    Err(BrokerError::Unavailable(format!(
                        "no confirm within {NOTICE_CONFIRM_WAIT:?}"
                    )))
                }),
            Err(e) => Err(e),
        };
        if let Err(e) = &published {
            warn!(pool, error = %e, "pool.exhausted event not published");
            metrics::counter!("codepool_event_publish_failures_total", "event" => "pool.exhausted")
                .increment(1);
        }
        if published.is_err() || !recorded {
            // The next shortage tells it again: the same webhook ids.
            if let Err(e) = store.give_back_exhausted_alert(pool, n).await {
                debug!(pool, error = %e, "pool.exhausted latch not given back");
            }
        }
    }
}

/// How long a batch waits for the broker to confirm a notification (a
/// `pool.exhausted` event) before it goes on without it.
const NOTICE_CONFIRM_WAIT: Duration = Duration::from_secs(5);

/// Whether position `i` is among those to publish.
pub fn wanted(only: Option<&HashSet<usize>>, i: usize) -> bool {
    only.is_none_or(|set| set.contains(&i))
}

/// Publishes the plan's `purchase.refused` events; returns the positions
/// the broker did not confirm. A refusal stands either way: it is
/// recorded by the policy before it is announced.
async fn announce_refusals(
    plan: &BatchPlan,
    publisher: &Publisher,
    only: Option<&HashSet<usize>>,
) -> HashSet<usize> {
    let mut pending = Vec::new();
    for (i, r) in plan
        .refusals()
        .into_iter()
        .filter(|(i, _)| wanted(only, *i))
    {
        pending.push((i, publisher.publish_refused(&r.event()).await));
    }
    unconfirmed(pending, "purchase.refused event").await
}

/// Waits for every publish; returns the positions that were not confirmed.
pub async fn unconfirmed(
    pending: Vec<(usize, Result<PendingConfirm, BrokerError>)>,
    what: &str,
) -> HashSet<usize> {
    let mut failed = HashSet::new();
    for (i, p) in pending {
        if let Err(e) = codepool_broker::confirmed(p).await {
            debug!(error = %e, what, "not confirmed");
            failed.insert(i);
        }
    }
    failed
}

/// Counts a placed batch: fresh grants, repeats and held purchases.
pub fn count(plan: &BatchPlan) {
    metrics::counter!("codepool_grants_total").increment(plan.fresh_grants);
    metrics::counter!("codepool_duplicate_deliveries_total").increment(plan.repeats);
    metrics::counter!("codepool_held_purchases_total").increment(plan.held);
}

/// The grants a step issued in this batch: the codes of one claim share a
/// part (the first line it claimed), the newest part of the order.
pub fn fresh_grants(step: &Step) -> Vec<&Grant> {
    let Step::Grant { grants, fresh, .. } = step else {
        return Vec::new();
    };
    if *fresh == 0 {
        return Vec::new();
    }
    let newest = grants.iter().map(|g| g.part).max();
    let issued: Vec<&Grant> = grants.iter().filter(|g| Some(g.part) == newest).collect();
    if issued.len() == *fresh as usize {
        issued
    } else {
        // Not one part (never expected): send them all; the same event
        // ids make a second send harmless.
        grants.iter().collect()
    }
}

/// One line per order at info (grants, revoked orders, refusals,
/// cancelled orders), logged by [`Intake::decide`] in its `decide` span
/// once the batch is decided. Dead letters are logged where they are
/// published. Codes are masked.
pub fn log_step(step: &Step) {
    match step {
        Step::Grant {
            purchase,
            grants,
            fresh,
            missing,
        } => {
            for grant in grants {
                if grant.revoked {
                    info!(order_id = %grant.order_id, line = grant.line, "order's code was revoked; not texted again")
                } else {
                    info!(order_id = %grant.order_id, pool = %grant.pool, line = grant.line, code = %grant.masked_code(), grant_no = grant.grant_no.as_deref().unwrap_or(""), fresh = *fresh > 0, "granted")
                }
            }
            if !missing.is_empty() {
                info!(order_id = %purchase.order_id, pool = %purchase.pool, waiting = missing.len(), quantity = purchase.quantity, "order partly granted; the rest is backordered");
            }
        }
        Step::Refused(r) => {
            info!(order_id = %r.purchase.order_id, pool = %r.purchase.pool, uid = %r.purchase.uid, reason = r.reason.as_str(), "purchase refused by the pool's policy")
        }
        Step::Cancelled(p) => {
            info!(order_id = %p.order_id, pool = %p.pool, "order was voided while it waited; a cancelled order gets nothing again")
        }
        Step::Backorder { .. } | Step::DeadLetter(_) => {}
    }
}
