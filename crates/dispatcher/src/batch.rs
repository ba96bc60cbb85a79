//! Carrying out one batch: decide ([`crate::plan`]) with the claim engine,
//! make backorders durable, publish events and dead letters with confirms,
//! then ack or requeue exactly as [`settle`] says. Read `process` top to
//! bottom: nothing is acked before its outcome is durable.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use codepool_broker::{BrokerError, PendingConfirm, Publisher};
use codepool_domain::{Grant, PoolEvent, PoolEventKind};
use lapin::message::Delivery;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::acks::AckWindow;
use crate::claim::ClaimError;
use crate::daemon::Dispatcher;
use crate::outage::backoff;
use crate::outbox::Marking;
use crate::plan::{settle, BatchPlan, Parsed, Step};
use crate::Resend;
use codepool_domain::{Purchase, PurchaseError};

impl Dispatcher {
    /// Handles one batch of deliveries end to end. Returning early leaves
    /// the batch unacked: the broker redelivers it.
    pub(crate) async fn process(
        &self,
        deliveries: Vec<Delivery>,
        publisher: &Publisher,
        acks: &AckWindow,
        stop: &CancellationToken,
    ) {
        let received = Instant::now();
        metrics::counter!("codepool_purchases_consumed_total").increment(deliveries.len() as u64);
        let Some(mut plan) = self.decide(&deliveries, stop).await else {
            // Handed back at once when this process cannot open codes:
            // another dispatcher takes them (this one stops consuming).
            if !self.intake.keys().missing().is_empty() {
                let back = vec![crate::plan::Settlement::Requeue; deliveries.len()];
                acks.settle(&deliveries, &back).await;
            }
            return;
        };
        if !self.record_backorders(&mut plan, stop).await {
            return;
        }
        announce_exhausted(&plan, publisher).await;
        plan.steps.iter().for_each(log_step);
        let unconfirmed = self
            .publish_until_confirmed(&plan, &deliveries, publisher, stop)
            .await;
        let settlements = settle(&plan, &unconfirmed);
        acks.settle(&deliveries, &settlements).await;

        metrics::counter!("codepool_grants_total").increment(plan.fresh_grants);
        metrics::counter!("codepool_duplicate_deliveries_total").increment(plan.repeats);
        metrics::counter!("codepool_held_purchases_total").increment(plan.held);
        let elapsed = received.elapsed().as_secs_f64();
        metrics::histogram!("codepool_batch_seconds").record(elapsed);
        let settled = deliveries.len() - unconfirmed.len();
        metrics::histogram!("codepool_end_to_end_seconds").record_many(elapsed, settled);
        crate::telemetry::record_settled(settled as u64);
        // Pools that just lost stock get a (throttled) stock check (stock.rs).
        self.stock.after_grants(
            plan.granted_pools.iter().map(|(p, n)| (p.as_str(), *n)),
            publisher,
        );
    }

    /// The plan for the batch, retried while MongoDB is away. `None` when
    /// stopped first.
    async fn decide(&self, deliveries: &[Delivery], stop: &CancellationToken) -> Option<BatchPlan> {
        let mut attempt = 0;
        loop {
            match self.try_decide(deliveries).await {
                Ok(plan) => {
                    self.mongo.ok();
                    self.health.set_mongo(true);
                    self.health.set_redis_degraded(self.engine.is_degraded());
                    return Some(plan);
                }
                Err(e) if e.is_unavailable() => {
                    self.health.set_mongo(false);
                    self.mongo.failed(&e);
                }
                // Logged by the key watch, once; nothing was claimed.
                Err(ClaimError::KeysMissing(_)) => {
                    self.health.set_keys_missing(true);
                    return None;
                }
                Err(e) => {
                    error!(error = ?e, "claim failed; the batch stays unacked and is retried")
                }
            }
            attempt += 1;
            tokio::select! {
                _ = stop.cancelled() => return None,
                _ = tokio::time::sleep(backoff(attempt)) => {}
            }
        }
    }

    /// Each delivery's purchase, unless it is invalid or has reached the
    /// queue's delivery limit (a poison message: dead-lettered with reason
    /// `delivery_limit` before the broker would drop it without one). Also
    /// the orders those poison messages name: an earlier delivery may have
    /// granted them a code.
    fn parse(&self, deliveries: &[Delivery]) -> (Vec<Parsed>, Vec<String>) {
        let topology = &self.config.topology;
        let mut at_limit = Vec::new();
        let parsed = deliveries
            .iter()
            .map(|d| match topology.over_delivery_limit(&d.properties) {
                Some(count) => {
                    at_limit.extend(Purchase::parse(&d.data).ok().map(|p| p.order_id));
                    Err(PurchaseError::delivery_limit(
                        count,
                        topology.queues.delivery_limit,
                    ))
                }
                None => Purchase::parse(&d.data),
            })
            .collect();
        (parsed, at_limit)
    }

    async fn try_decide(&self, deliveries: &[Delivery]) -> Result<BatchPlan, ClaimError> {
        let (parsed, at_limit) = self.parse(deliveries);
        // A purchase dead-lettered at its delivery limit is not redelivered
        // again: a grant an earlier delivery made for it (and crashed before
        // its confirm) is handed to the relay, which sends its event.
        let at_limit: Vec<&str> = at_limit.iter().map(String::as_str).collect();
        self.intake
            .decide(parsed, &at_limit, Resend::ByRedelivery)
            .await
    }

    /// Records the plan's backorders, retrying while MongoDB is away. A
    /// backorder that finds another order's under its id turns its step
    /// into a `conflicting_order` dead letter. False when stopped first
    /// (nothing may be acked then).
    async fn record_backorders(&self, plan: &mut BatchPlan, stop: &CancellationToken) -> bool {
        let mut attempt = 0;
        loop {
            match self.intake.record_backorders(plan).await {
                Ok(_) => return true,
                Err(e) => self.mongo.failed(&e),
            }
            attempt += 1;
            tokio::select! {
                _ = stop.cancelled() => return false,
                _ = tokio::time::sleep(backoff(attempt)) => {}
            }
        }
    }

    /// Publishes the plan's events and dead letters, and publishes again,
    /// with backoff, what the broker did not confirm, for up to
    /// [`REPUBLISH_FOR`] while the channel stays open. A quorum queue that
    /// lost its leader with a node refuses publishes for some seconds;
    /// requeueing at once would redeliver the purchase in a tight loop and
    /// push a valid purchase to the delivery limit. Returns the positions
    /// still unconfirmed (requeued by [`settle`]).
    async fn publish_until_confirmed(
        &self,
        plan: &BatchPlan,
        deliveries: &[Delivery],
        publisher: &Publisher,
        stop: &CancellationToken,
    ) -> HashSet<usize> {
        let mut unconfirmed = self.publish(plan, deliveries, publisher, None).await;
        let started = Instant::now();
        let mut attempt = 0;
        while !unconfirmed.is_empty() {
            self.amqp.failed(&format_args!(
                "the broker did not confirm {} publishes of a batch",
                unconfirmed.len()
            ));
            if started.elapsed() >= REPUBLISH_FOR || !publisher.channel().status().connected() {
                break;
            }
            attempt += 1;
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(backoff(attempt)) => {}
            }
            unconfirmed = self
                .publish(plan, deliveries, publisher, Some(&unconfirmed))
                .await;
        }
        if attempt > 0 && unconfirmed.is_empty() {
            self.amqp.ok();
        }
        unconfirmed
    }

    /// Publishes the SMS-pending events (through the outbox) and the dead
    /// letters of the positions in `only` (all when `None`), confirms in
    /// flight together. Returns the positions whose publish was not
    /// confirmed.
    async fn publish(
        &self,
        plan: &BatchPlan,
        deliveries: &[Delivery],
        publisher: &Publisher,
        only: Option<&HashSet<usize>>,
    ) -> HashSet<usize> {
        let sms: Vec<_> = plan
            .sms_events()
            .into_iter()
            .filter(|(i, _)| wanted(only, *i))
            .collect();
        let grants: Vec<&Grant> = sms.iter().map(|(_, g)| *g).collect();
        let (sent, mut unconfirmed, refused) = tokio::join!(
            self.outbox.send(publisher, &grants, Marking::Unneeded),
            dead_letter(plan, deliveries, publisher, only),
            announce_refusals(plan, publisher, only),
        );
        unconfirmed.extend(refused);
        match sent {
            Ok(sent) => unconfirmed.extend(
                sms.iter()
                    .zip(sent.results)
                    .filter(|(_, r)| r.is_err())
                    .map(|((i, _), _)| *i),
            ),
            Err(e) => {
                debug!(error = %e, "SMS marks not recorded; the batch is requeued");
                unconfirmed.extend(sms.iter().map(|(i, _)| *i));
            }
        }
        unconfirmed
    }
}

/// `pool.exhausted` for each pool that ran dry in `plan`, whichever door
/// the purchases came in by. A notification, not a state: a failure is
/// logged and counted, and does not hold the acks or the answer.
pub async fn announce_exhausted(plan: &BatchPlan, publisher: &Publisher) {
    for pool in &plan.exhausted_pools {
        warn!(
            pool,
            "pool exhausted; purchases are backordered until codes are imported"
        );
        let event = PoolEvent::new(PoolEventKind::Exhausted, pool);
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
        if let Err(e) = published {
            warn!(pool, error = %e, "pool.exhausted event not published");
            metrics::counter!("codepool_event_publish_failures_total", "event" => "pool.exhausted")
                .increment(1);
        }
    }
}

/// How long a batch waits for the broker to confirm a notification (a
/// `pool.exhausted` event) before it goes on without it.
const NOTICE_CONFIRM_WAIT: Duration = Duration::from_secs(5);

/// How long a batch keeps publishing what the broker did not confirm
/// before it requeues those purchases.
const REPUBLISH_FOR: Duration = Duration::from_secs(30);

/// Whether position `i` is among those to publish.
fn wanted(only: Option<&HashSet<usize>>, i: usize) -> bool {
    only.is_none_or(|set| set.contains(&i))
}

/// One line per delivery at info (grants, revoked orders, refusals).
/// Dead letters are logged where they are published, with their message
/// id. Codes are masked.
fn log_step(step: &Step) {
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

/// Publishes the plan's `purchase.refused` events; returns the positions
/// the broker did not confirm.
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
async fn unconfirmed(
    pending: Vec<(usize, Result<PendingConfirm, BrokerError>)>,
    what: &str,
) -> HashSet<usize> {
    let mut failed = HashSet::new();
    for (i, p) in pending {
        if let Err(e) = codepool_broker::confirmed(p).await {
            debug!(error = %e, what, "not confirmed; the purchase will be redelivered");
            failed.insert(i);
        }
    }
    failed
}

/// Publishes the plan's dead letters, each with its reason; returns the
/// positions the broker did not confirm.
async fn dead_letter(
    plan: &BatchPlan,
    deliveries: &[Delivery],
    publisher: &Publisher,
    only: Option<&HashSet<usize>>,
) -> HashSet<usize> {
    let mut pending = Vec::new();
    for (i, e) in plan
        .dead_letters()
        .into_iter()
        .filter(|(i, _)| wanted(only, *i))
    {
        let d = &deliveries[i];
        let message_id = d.properties.message_id().as_ref();
        if only.is_none() {
            // Counted and logged once, not again when published again.
            metrics::counter!("codepool_dead_letters_total", "reason" => e.reason.as_str())
                .increment(1);
            warn!(reason = e.reason.as_str(), detail = %e.detail, message_id = message_id.map_or("", |id| id.as_str()), "purchase dead-lettered");
        }
        pending.push((
            i,
            publisher
                .dead_letter(
                    &d.data,
                    message_id,
                    &e.to_string(),
                    codepool_broker::replay_count(&d.properties),
                )
                .await,
        ));
    }
    unconfirmed(pending, "dead letter").await
}
