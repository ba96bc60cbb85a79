//! Fulfilling backorders when codes arrive: oldest first, through the same
//! claim path as live purchases, each with its SMS-pending event sent
//! through the outbox. Several dispatchers may do this at once; the unique
//! `(order_id, line)` index still gives every line at most one code. An
//! order that gets part of its waiting lines keeps waiting for the rest,
//! and each part it gets travels in its own event. A paused
//! pool's backorders wait until it is resumed; a pool's per-user limit
//! applies to backorders too (those recorded before the limit was set
//! hold no slot yet).

use std::collections::HashSet;

use codepool_domain::{CodeId, Grant, Purchase};
use codepool_store::Store;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::claim::{ClaimAsk, ClaimEngine, ClaimError, ClaimOutcome};
use crate::guard::Guard;
use crate::outbox::{Marking, Outbox};
use crate::ports::EventSink;
use crate::replace::ReplaceError;
use crate::{ClaimWay, Resend};
use codepool_domain::gate::Move;

const BATCH: u64 = 100;

/// Fulfils waiting backorders of `pool` while it has stock and is not
/// paused, until `stop`, after the pool's replaced codes waiting for their
/// new one ([`crate::replace::serve_open`]). Returns how many backorders
/// were fulfilled. Runs in a `fulfil` span naming the pool; each code
/// granted and each event confirmed is one line naming its order.
#[tracing::instrument(name = "fulfil", skip_all, fields(pool = pool))]
pub async fn fulfil_backorders(
    engine: &ClaimEngine,
    store: &Store,
    outbox: &Outbox,
    sink: &dyn EventSink,
    pool: &str,
    stop: &CancellationToken,
) -> Result<u64, ClaimError> {
    let services = crate::replace::Services {
        store,
        engine,
        outbox,
        sink,
    };
    match crate::replace::serve_open(&services, pool).await {
        Ok(_) => {}
        Err(ReplaceError::Claim(e)) => return Err(e),
        Err(ReplaceError::Store(e)) => return Err(e.into()),
        Err(e) => warn!(pool, error = %e, "a waiting replacement was not served"),
    }
    let mut total = 0;
    while !stop.is_cancelled() {
        // A paused pool issues nothing; its backorders wait for `pool
        // resume` (checked every round, so a pause stops a fulfilment).
        if store.pool(pool).await?.is_none() {
            break;
        }
        let guard = Guard::of_pool(store, pool).await?;
        if guard.stopped(Move::Fulfil, [pool]).is_some() {
            break;
        }
        // Ask only for as many as there is stock, so the oldest are served
        // first even when stock is short.
        let stock = store.unissued_count_upto(pool, BATCH).await?;
        let limit = stock.min(BATCH);
        if limit == 0 {
            break;
        }
        let waiting = store.waiting_backorders(pool, limit as i64).await?;
        if waiting.is_empty() {
            break;
        }
        let purchases: Vec<(Purchase, Vec<u32>)> = waiting
            .iter()
            .map(|b| (b.purchase(), b.waiting_lines()))
            .collect();
        let (purchases, refusals_settled) = refuse(store, sink, &guard, purchases).await?;
        let (fulfilled, exhausted) = fulfil(engine, store, outbox, sink, pool, &purchases).await?;
        total += fulfilled;
        if exhausted || !refusals_settled || (fulfilled == 0 && !purchases.is_empty()) {
            break;
        }
    }
    if total > 0 {
        info!(pool, fulfilled = total, "backorders fulfilled");
    }
    Ok(total)
}

/// Claims codes for the waiting lines of `purchases` (waiting backorders)
/// and sends their events. Returns how many orders got every line they
/// waited for, and whether the pool ran dry.
async fn fulfil(
    engine: &ClaimEngine,
    store: &Store,
    outbox: &Outbox,
    sink: &dyn EventSink,
    pool: &str,
    purchases: &[(Purchase, Vec<u32>)],
) -> Result<(u64, bool), ClaimError> {
    if purchases.is_empty() {
        return Ok((0, false));
    }
    let outcomes = claim_waiting(engine, store, purchases).await?;
    let exhausted = outcomes.iter().any(|o| !o.missing().is_empty());
    let grants: Vec<&Grant> = outcomes.iter().flat_map(|o| o.grants()).collect();
    // An order voided while this claim ran keeps none of these codes, and
    // no event is sent for them: a cancelled backorder is final.
    let issued: Vec<(CodeId, &str)> = (grants.iter())
        .filter(|g| !g.revoked)
        .map(|g| (g.code_id, g.order_id.as_str()))
        .collect();
    let withdrawn: HashSet<CodeId> = store
        .withdraw_cancelled(&issued)
        .await?
        .into_iter()
        .collect();
    if !withdrawn.is_empty() {
        info!(
            pool,
            withdrawn = withdrawn.len(),
            "codes claimed for orders voided meanwhile were voided; nothing sent for them"
        );
    }
    let grants: Vec<&Grant> = (grants.into_iter())
        .filter(|g| !withdrawn.contains(&g.code_id))
        .collect();
    for g in grants.iter().filter(|g| !g.revoked) {
        info!(order_id = %g.order_id, pool = %g.pool, line = g.line, code = %g.masked_code(), grant_no = g.grant_no.as_deref().unwrap_or(""), "backorder granted");
    }
    // Events that are not confirmed stay on the relay's list.
    let sent = outbox.send(sink, &grants, Marking::Now).await?;
    crate::outbox::log_published(&grants, &sent);
    if sent.confirmed() < grants.len() {
        warn!(
            pool,
            unconfirmed = grants.len() - sent.confirmed(),
            "some fulfilled backorders' events were not confirmed; the relay re-sends them"
        );
    }
    // An order that got codes records the lines it still waits for; one
    // whose id turned out to be another order's is settled as fulfilled
    // by none (the first order stands and holds the codes).
    let settled: Vec<(&str, Vec<u32>)> = purchases
        .iter()
        .zip(&outcomes)
        .filter(|(_, o)| !o.grants().is_empty() || matches!(o, ClaimOutcome::Conflict { .. }))
        .map(|((p, _), o)| (p.order_id.as_str(), o.missing().to_vec()))
        .collect();
    store.settle_backorders(&settled).await?;
    let fulfilled = settled.iter().filter(|(_, m)| m.is_empty()).count() as u64;
    metrics::counter!("codepool_backorders_fulfilled_total").increment(fulfilled);
    Ok((fulfilled, exhausted))
}

/// Claims the waiting lines of backorders, outcomes aligned with the
/// input: orders of one pool in one batched claim, bundles whole or not
/// at all (they wait whole, so they ask every line).
async fn claim_waiting(
    engine: &ClaimEngine,
    store: &Store,
    purchases: &[(Purchase, Vec<u32>)],
) -> Result<Vec<ClaimOutcome>, ClaimError> {
    let mut outcomes: Vec<Option<ClaimOutcome>> = vec![None; purchases.len()];
    let (bundles, plain): (Vec<usize>, Vec<usize>) =
        (0..purchases.len()).partition(|&i| purchases[i].0.is_bundle());
    if !plain.is_empty() {
        let asks: Vec<ClaimAsk> = (plain.iter())
            .map(|&i| ClaimAsk {
                purchase: &purchases[i].0,
                lines: &purchases[i].1,
            })
            .collect();
        // No message of a backorder is redelivered: the relay owes its event.
        let got = engine.claim_asks(&asks, ClaimWay::fulfil()).await?;
        for (&i, o) in plain.iter().zip(got) {
            outcomes[i] = Some(o);
        }
    }
    if !bundles.is_empty() {
        let bs: Vec<&Purchase> = bundles.iter().map(|&i| &purchases[i].0).collect();
        let orders: Vec<&str> = bs.iter().map(|p| p.order_id.as_str()).collect();
        let held = store.grants_for_orders(&orders).await?;
        let got =
            crate::bundles::claim_bundles(engine, store, &bs, Resend::Backorder, &held).await?;
        for (&i, o) in bundles.iter().zip(got.outcomes) {
            outcomes[i] = Some(o);
        }
    }
    Ok(outcomes.into_iter().flatten().collect())
}

/// Applies the pool's per-user limit to waiting backorders: the refused
/// ones are announced (`purchase.refused`, confirmed) and marked refused.
/// Returns the purchases still to fulfil, and false when some refusal was
/// not confirmed (its backorder stays waiting; the next sweep retries).
async fn refuse(
    store: &Store,
    sink: &dyn EventSink,
    guard: &Guard,
    purchases: Vec<(Purchase, Vec<u32>)>,
) -> Result<(Vec<(Purchase, Vec<u32>)>, bool), ClaimError> {
    let refs: Vec<&Purchase> = purchases.iter().map(|(p, _)| p).collect();
    let refused = crate::policy::over_limit(store, &refs, guard, Move::Fulfil).await?;
    if refused.is_empty() {
        return Ok((purchases, true));
    }
    let events: Vec<_> = refused.values().map(|r| r.event()).collect();
    let results = sink.publish_refused(&events).await;
    let confirmed: Vec<&str> = events
        .iter()
        .zip(&results)
        .filter(|(_, r)| r.is_ok())
        .map(|(e, _)| e.order_id.as_str())
        .collect();
    store.mark_backorders_refused(&confirmed).await?;
    let settled = confirmed.len() == events.len();
    if !settled {
        warn!(
            unconfirmed = events.len() - confirmed.len(),
            "purchase.refused events of backorders not confirmed; retried at the next sweep"
        );
    }
    let skip: HashSet<&String> = refused.keys().collect();
    let rest = purchases
        .into_iter()
        .filter(|(p, _)| !skip.contains(&p.order_id))
        .collect();
    Ok((rest, settled))
}
