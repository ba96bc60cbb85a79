//! Carrying out one batch: decide ([`crate::plan`]) with the claim engine,
//! make backorders durable, publish events and dead letters with confirms,
//! then ack or requeue exactly as [`settle`] says. Read `process` top to
//! bottom: nothing is acked before its outcome is durable.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use codepool_broker::Publisher;
use codepool_domain::{Purchase, PurchaseError};
use codepool_issuance::claim::ClaimError;
use codepool_issuance::outage::Retry;
use codepool_issuance::placing::{self, unconfirmed, wanted, Texting};
use codepool_issuance::plan::{settle, BatchPlan, Parsed};
use codepool_issuance::{Door, Resend};
use lapin::message::Delivery;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::acks::AckWindow;
use crate::daemon::Dispatcher;

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
        // Upkeep waits while a batch is underway, whichever way it ends.
        let _underway = self.parts.activity.batch();
        metrics::counter!("codepool_purchases_consumed_total").increment(deliveries.len() as u64);
        let Some(mut plan) = self.decide(&deliveries, stop).await else {
            // Handed back at once when this process cannot open codes:
            // another dispatcher takes them (this one stops consuming).
            if !self.parts.intake.keys().missing().is_empty() {
                let back = vec![codepool_issuance::plan::Settlement::Requeue; deliveries.len()];
                acks.settle(&deliveries, &back).await;
            }
            return;
        };
        if !self.record_backorders(&mut plan, stop).await {
            return;
        }
        let unconfirmed = self
            .publish_until_confirmed(&plan, &deliveries, publisher, stop)
            .await;
        let settlements = settle(&plan, &unconfirmed);
        acks.settle(&deliveries, &settlements).await;

        // Counted, and pools that just lost stock get a (throttled) check.
        placing::account(&plan, &self.parts.stock, publisher);
        let elapsed = received.elapsed().as_secs_f64();
        metrics::histogram!("codepool_batch_seconds").record(elapsed);
        let settled = deliveries.len() - unconfirmed.len();
        metrics::histogram!("codepool_end_to_end_seconds").record_many(elapsed, settled);
        codepool_issuance::telemetry::record_settled(settled as u64);
    }

    /// The plan for the batch, retried while MongoDB is away. `None` when
    /// stopped first.
    async fn decide(&self, deliveries: &[Delivery], stop: &CancellationToken) -> Option<BatchPlan> {
        let mut retry = Retry::new();
        loop {
            match self.try_decide(deliveries, retry.tries() == 0).await {
                Ok(plan) => {
                    self.mongo.ok();
                    self.health.set_mongo(true);
                    self.health
                        .set_redis_degraded(self.parts.intake.engine().is_degraded());
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
            tokio::select! {
                _ = stop.cancelled() => return None,
                _ = tokio::time::sleep(retry.delay()) => {}
            }
        }
    }

    /// Each delivery's purchase, unless it is invalid or has reached the
    /// queue's delivery limit (a poison message: dead-lettered with reason
    /// `delivery_limit` before the broker would drop it without one). Also
    /// the orders those poison messages name: an earlier delivery may have
    /// granted them a code. `first`: the batch's first try, which tells
    /// each purchase's arrival ([`received`]).
    fn parse(&self, deliveries: &[Delivery], first: bool) -> (Vec<Parsed>, Vec<String>) {
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
                None => Purchase::parse(&d.data).map(|mut p| {
                    // The shop admission checks the publisher: the broker
                    // user RabbitMQ validated as the message's user_id.
                    if p.shop.is_some() {
                        let user = d.properties.user_id().as_ref().map(|u| u.as_str());
                        p.owner = codepool_issuance::shops::published_by(user);
                    }
                    if first {
                        received(d, &p);
                    }
                    p
                }),
            })
            .collect();
        (parsed, at_limit)
    }

    async fn try_decide(
        &self,
        deliveries: &[Delivery],
        first: bool,
    ) -> Result<BatchPlan, ClaimError> {
        let (parsed, at_limit) = self.parse(deliveries, first);
        // A purchase dead-lettered at its delivery limit is not redelivered
        // again: a grant an earlier delivery made for it (and crashed before
        // its confirm) is handed to the relay, which sends its event.
        let at_limit: Vec<&str> = at_limit.iter().map(String::as_str).collect();
        self.parts
            .intake
            .decide(parsed, &at_limit, Resend::ByRedelivery, Door::Amqp)
            .await
    }

    /// Records the plan's backorders, retrying while MongoDB is away. A
    /// backorder that finds another order's under its id turns its step
    /// into a `conflicting_order` dead letter. False when stopped first
    /// (nothing may be acked then).
    async fn record_backorders(&self, plan: &mut BatchPlan, stop: &CancellationToken) -> bool {
        let mut retry = Retry::new();
        loop {
            match self.parts.intake.record_backorders(plan).await {
                Ok(_) => return true,
                Err(e) => self.mongo.failed(&e),
            }
            tokio::select! {
                _ = stop.cancelled() => return false,
                _ = tokio::time::sleep(retry.delay()) => {}
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
        let mut retry = Retry::new();
        while !unconfirmed.is_empty() {
            self.amqp.failed(&format_args!(
                "the broker did not confirm {} publishes of a batch",
                unconfirmed.len()
            ));
            if started.elapsed() >= REPUBLISH_FOR || !publisher.channel().status().connected() {
                break;
            }
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(retry.delay()) => {}
            }
            unconfirmed = self
                .publish(plan, deliveries, publisher, Some(&unconfirmed))
                .await;
        }
        if retry.tries() > 0 && unconfirmed.is_empty() {
            self.amqp.ok();
        }
        unconfirmed
    }

    /// Publishes what the plan owes ([`placing::announce`]) and its dead
    /// letters, for the positions in `only` (all when `None`), confirms in
    /// flight together. Returns the positions whose publish was not
    /// confirmed.
    async fn publish(
        &self,
        plan: &BatchPlan,
        deliveries: &[Delivery],
        publisher: &Publisher,
        only: Option<&HashSet<usize>>,
    ) -> HashSet<usize> {
        let (announced, dead) = tokio::join!(
            placing::announce(
                plan,
                &self.parts.outbox,
                publisher,
                Texting::Every,
                only,
                self.parts.intake.store(),
                Door::Amqp,
            ),
            dead_letter(plan, deliveries, publisher, only),
        );
        let mut unconfirmed = announced.unconfirmed;
        unconfirmed.extend(dead);
        unconfirmed
    }
}

/// The door's line for a purchase taken off the queue, in a `purchase`
/// span of its own naming the door, the order, its pool, its shop, the
/// hold it pays for and the producer's message id. The core's lines for
/// the order (decided, granted, published) name it too, inside the
/// batch's span: one grep follows it.
fn received(d: &Delivery, p: &Purchase) {
    let message_id = d.properties.message_id().as_ref();
    let span = tracing::info_span!(
        "purchase",
        door = Door::Amqp.as_str(),
        order_id = %p.order_id,
        pool = %p.pool,
        shop = p.shop.as_deref(),
        hold_id = p.hold_id.as_deref(),
        message_id = message_id.map(|id| id.as_str()),
    );
    span.in_scope(|| info!(quantity = p.quantity, "purchase received"));
}

/// How long a batch keeps publishing what the broker did not confirm
/// before it requeues those purchases.
const REPUBLISH_FOR: Duration = Duration::from_secs(30);

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
