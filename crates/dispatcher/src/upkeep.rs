//! Upkeep: what a dispatcher session does besides purchases. It applies
//! SMS receipts (decoded and applied by the core:
//! [`codepool_issuance::receipts`]) and `code.redeemed` events
//! ([`crate::redemptions`]) from their durable queues. Receipts are acked
//! only after they are applied; a malformed one is acked and logged,
//! never retried forever. All of it stops
//! with the session. The sweeps every granting process runs (relay,
//! holds, backorders, expiry, stock, webhooks) are the core's
//! ([`codepool_issuance::background`]).

use std::future::Future;
use std::sync::Arc;

use codepool_broker::{BrokerError, ConsumerHandle, Topology};
use codepool_issuance::background::Parts;
use codepool_issuance::StoreError;
use futures::StreamExt;
use lapin::message::Delivery;
use lapin::options::BasicAckOptions;
use lapin::{Connection, Consumer};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::redemptions::apply_redemption;
use codepool_issuance::outage::Retry;

/// Unacked receipts or redemptions one session holds at once.
const PREFETCH: u16 = 64;

/// The upkeep tasks of a session, and the consumers they read.
pub struct Upkeep {
    pub tasks: JoinSet<()>,
    /// Cancel these before stopping the tasks; keep them until the
    /// connection is closed (they hold the consumers' channels).
    pub consumers: Vec<ConsumerHandle>,
}

/// Opens the consumers (which may fail: nothing is spawned then) and
/// spawns the upkeep tasks (the queues are those of `publisher`'s
/// topology). Await the tasks after cancelling `stop`.
pub async fn spawn(
    conn: &Connection,
    parts: Arc<Parts>,
    topology: &Topology,
    redeemers: Arc<Vec<String>>,
    stop: CancellationToken,
) -> Result<Upkeep, BrokerError> {
    let receipts = codepool_broker::consume(conn, &topology.sms_receipts, PREFETCH).await?;
    let redemptions = codepool_broker::consume(conn, &topology.code_redeemed, PREFETCH).await?;
    let consumers = vec![receipts.handle, redemptions.handle];
    let mut tasks = JoinSet::new();
    tasks.spawn(consume(
        receipts.consumer,
        parts.clone(),
        stop.clone(),
        |p, d| async move {
            let id = d.properties.message_id().as_ref().map(|m| m.as_str());
            let r = p
                .apply_sms_receipt(d.routing_key.as_str(), &d.data, id)
                .await;
            (d, r)
        },
    ));
    tasks.spawn(consume(
        redemptions.consumer,
        parts,
        stop.clone(),
        move |p, d| {
            let redeemers = redeemers.clone();
            async move {
                let r = apply_redemption(&p, &d, &redeemers).await;
                (d, r)
            }
        },
    ));
    Ok(Upkeep { tasks, consumers })
}

/// Applies deliveries one by one, acking each once it is applied. While
/// MongoDB is away the delivery is retried with backoff; on stop it stays
/// unacked and is redelivered to the next consumer.
async fn consume<F, Fut>(
    mut consumer: Consumer,
    parts: Arc<Parts>,
    stop: CancellationToken,
    apply: F,
) where
    F: Fn(Arc<Parts>, Delivery) -> Fut,
    Fut: Future<Output = (Delivery, Result<(), StoreError>)>,
{
    let queue = consumer.queue().to_string();
    loop {
        let delivery = tokio::select! {
            _ = stop.cancelled() => return,
            next = consumer.next() => match next {
                Some(Ok(d)) => d,
                // Cancelled (the session is stopping), or the connection is
                // gone (the session notices and reconnects).
                _ => return,
            },
        };
        let mut delivery = delivery;
        let mut retry = Retry::new();
        loop {
            let (d, result) = apply(parts.clone(), delivery).await;
            delivery = d;
            match result {
                Ok(()) => break,
                Err(e) => {
                    if retry.tries() == 0 {
                        warn!(queue, error = %e, "MongoDB unavailable; holding the message until it returns");
                    }
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(retry.delay()) => {}
                    }
                }
            }
        }
        if let Err(e) = delivery.acker.ack(BasicAckOptions::default()).await {
            debug!(queue, error = %e, "ack failed; the message will be redelivered and applied again harmlessly");
        }
    }
}
