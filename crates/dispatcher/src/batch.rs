//! Carrying out one batch: the core's one placement
//! ([`placement::place`]: decide, claim, backorders, announce), with this
//! door's ending: its dead letters published beside the core's events,
//! then each delivery acked or requeued exactly as [`settle`] says.
//! Nothing is acked before its outcome is durable.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use codepool_broker::Publisher;
use codepool_domain::{Purchase, PurchaseError};
use codepool_issuance::claim::ClaimError;
use codepool_issuance::intake::PlaceError;
use codepool_issuance::placement::{self, Batch, Ending, Patience, Seen, Unplaced};
use codepool_issuance::placing::{unconfirmed, wanted, Texting};
use codepool_issuance::plan::{settle, BatchPlan, Settlement};
use codepool_issuance::{Door, Resend};
use lapin::message::Delivery;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::acks::AckWindow;
use crate::daemon::Dispatcher;

impl Dispatcher {
    /// Handles one batch of deliveries end to end, through the core's one
    /// placement ([`placement::place`]): this door reads its deliveries,
    /// waits out outages, publishes its dead letters beside the core's
    /// events, and acks or requeues each delivery as [`settle`] says.
    /// Returning without settling leaves the batch unacked: the broker
    /// redelivers it.
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
        let batch = self.read(&deliveries);
        let ending = Deliveries {
            dispatcher: self,
            deliveries: &deliveries,
            acks,
            received,
        };
        match placement::place(&self.parts, publisher, batch, &ending, stop).await {
            Ok(()) => {}
            // Handed back at once when this process cannot open codes:
            // another dispatcher takes them (this one stops consuming).
            Err(Unplaced::Failed(e)) => {
                if matches!(&*e, PlaceError::Claim(ClaimError::KeysMissing(_))) {
                    self.health.set_keys_missing(true);
                    let back = vec![Settlement::Requeue; deliveries.len()];
                    acks.settle(&deliveries, &back).await;
                }
            }
            Err(Unplaced::Stopped) => {}
        }
    }

    /// The batch as this door reads it: each delivery's purchase, unless it
    /// is invalid or has reached the queue's delivery limit (a poison
    /// message: dead-lettered with reason `delivery_limit` before the
    /// broker would drop it without one); also the orders those poison
    /// messages name: an earlier delivery may have granted them a code
    /// (the core hands it to the relay). Nobody sees codes in an ack.
    fn read(&self, deliveries: &[Delivery]) -> Batch {
        let topology = &self.config.topology;
        let operators = &self.parts.operator_broker_users;
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
                None => Purchase::parse(&d.data).and_then(|mut p| {
                    // Who may publish what is the core's rule: a shop's
                    // broker users its purchases, the operator's those of
                    // no shop. The publisher is the broker user RabbitMQ
                    // validated as the message's user_id (or the one a
                    // replay of the operator's recorded).
                    let user = codepool_broker::publisher_of(&d.properties, operators);
                    codepool_issuance::shops::admit_publisher(&mut p, user.as_deref(), operators)?;
                    received(d, &p);
                    Ok(p)
                }),
            })
            .collect();
        Batch {
            parsed,
            actors: vec![None; deliveries.len()],
            at_limit,
        }
    }
}

/// The AMQP door's ending of a batch: its dead letters published beside
/// the core's events, then each delivery acked or requeued.
struct Deliveries<'a> {
    dispatcher: &'a Dispatcher,
    deliveries: &'a [Delivery],
    acks: &'a AckWindow,
    received: Instant,
}

impl Ending for Deliveries<'_> {
    fn door(&self) -> Door {
        Door::Amqp
    }

    /// The purchase itself: acked only once its event is confirmed.
    fn resend(&self) -> Resend {
        Resend::ByRedelivery
    }

    /// A redelivered purchase's event is sent again, same `event_id`.
    fn texting(&self) -> Texting {
        Texting::Every
    }

    /// A delivery waits, unacked, for MongoDB; what the broker did not
    /// confirm is published again for [`REPUBLISH_FOR`] (a quorum queue
    /// that lost its leader refuses publishes for some seconds; requeueing
    /// at once would redeliver the purchase in a tight loop and push a
    /// valid purchase to the delivery limit).
    fn patience(&self) -> Patience {
        Patience {
            waits_for_mongo: true,
            announce_for: None,
            republish_for: REPUBLISH_FOR,
        }
    }

    fn saw(&self, seen: Seen<'_>) {
        let d = self.dispatcher;
        match seen {
            Seen::Mongo { redis_degraded } => {
                d.mongo.ok();
                d.health.set_mongo(true);
                d.health.set_redis_degraded(redis_degraded);
            }
            Seen::MongoFailed(e) => {
                if e.is_retryable() {
                    d.health.set_mongo(false);
                }
                d.mongo.failed(e);
            }
            Seen::Unconfirmed(n) => d.amqp.failed(&format_args!(
                "the broker did not confirm {n} publishes of a batch"
            )),
            Seen::BrokerBack => d.amqp.ok(),
        }
    }

    async fn publish(
        &self,
        plan: &BatchPlan,
        publisher: &Publisher,
        only: Option<&HashSet<usize>>,
    ) -> HashSet<usize> {
        let operators = &self.dispatcher.parts.operator_broker_users;
        dead_letter(plan, self.deliveries, publisher, operators, only).await
    }

    async fn settle(&self, plan: &BatchPlan, unconfirmed: &HashSet<usize>) {
        let settlements = settle(plan, unconfirmed);
        self.acks.settle(self.deliveries, &settlements).await;
        let elapsed = self.received.elapsed().as_secs_f64();
        metrics::histogram!("codepool_batch_seconds").record(elapsed);
        let settled = self.deliveries.len() - unconfirmed.len();
        metrics::histogram!("codepool_end_to_end_seconds").record_many(elapsed, settled);
        codepool_issuance::telemetry::record_settled(settled as u64);
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

/// Publishes the plan's dead letters, each with its reason and the broker
/// user that published it (see [`codepool_broker::publisher_of`]), so that
/// a replay sends it back as that user's; returns the positions the broker
/// did not confirm.
async fn dead_letter(
    plan: &BatchPlan,
    deliveries: &[Delivery],
    publisher: &Publisher,
    operators: &[String],
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
                    codepool_broker::publisher_of(&d.properties, operators).as_deref(),
                )
                .await,
        ));
    }
    unconfirmed(pending, "dead letter").await
}
