//! Consuming: the purchase queues (the one queue, or every partition) with
//! manual acks and a prefetch window, any other durable queue the same
//! way, and private subscriptions to events (an exclusive, auto-deleted
//! queue per process, bound to one routing key).
//!
//! Every consumer comes with a [`ConsumerHandle`]: cancel the consumer
//! with it before dropping the consumer, and keep it (it holds the channel)
//! until the connection is closed (see [`crate::close`]). Left to lapin, a
//! consumer or channel dropped while open is cancelled or closed by a task
//! of its own that races the connection's close, and lapin logs the loser
//! as `ERROR Connection error` although nothing went wrong.

use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, QueueBindOptions, QueueDeclareOptions,
};
use std::sync::{Arc, Mutex};

use futures::stream::{BoxStream, StreamExt};
use lapin::message::Delivery;
use lapin::types::FieldTable;
use lapin::{Channel, Connection, Consumer};

use crate::{BrokerError, Topology};

/// A consumer's deliveries, and the handle that ends it.
pub struct OpenConsumer {
    pub consumer: Consumer,
    pub handle: ConsumerHandle,
}

/// What it takes to end a consumer: its channel and its tag. Keep it
/// until the connection is closed.
#[derive(Clone)]
pub struct ConsumerHandle {
    channel: Channel,
    tag: String,
}

impl ConsumerHandle {
    /// Stops deliveries: the consumer's stream ends once the deliveries
    /// already received are read. Unacked ones stay unacked until the
    /// channel closes, and the broker requeues them. Bounded and best
    /// effort, like every step of a stop.
    pub async fn cancel(&self) {
        let _ = tokio::time::timeout(
            crate::CLOSE_WAIT,
            self.channel
                .basic_cancel(&self.tag, BasicCancelOptions::default()),
        )
        .await;
    }
}

/// Every purchase queue's deliveries, merged into one stream, and what
/// it takes to end them. All consumers share one channel, so delivery
/// tags (and `multiple` acks) span them all.
pub struct PurchaseConsumers {
    pub deliveries: BoxStream<'static, lapin::Result<Delivery>>,
    /// Keep them until the connection is closed.
    pub handles: ConsumerHandles,
}

/// The handles of consumers opened one after the other (the partitions a
/// dispatcher stands by for are subscribed later).
#[derive(Clone, Default)]
pub struct ConsumerHandles(Arc<Mutex<Vec<ConsumerHandle>>>);

impl ConsumerHandles {
    /// Cancels every consumer opened so far ([`ConsumerHandle::cancel`]).
    pub async fn cancel(&self) {
        let handles = self.0.lock().map(|h| h.clone()).unwrap_or_default();
        futures::future::join_all(handles.iter().map(ConsumerHandle::cancel)).await;
    }

    fn push(&self, handle: ConsumerHandle) {
        if let Ok(mut handles) = self.0.lock() {
            handles.push(handle);
        }
    }
}

/// When a dispatcher subscribes to the partitions. Each partition has one
/// active consumer, the first in line: a dispatcher subscribes to its
/// `prefer`red partitions at once and to the others `standby` later, so
/// that dispatchers started together each take their own and stand by
/// for the rest. Empty: every partition at once.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Standby {
    pub prefer: Vec<u16>,
    pub after: std::time::Duration,
}

/// Declares the topology (after checking that the broker's purchase
/// queues are of this process's partition count) and starts consuming
/// every purchase queue with manual acks, at most `prefetch` unacked
/// deliveries per queue.
pub async fn consume_purchases(
    conn: &Connection,
    topology: &Topology,
    prefetch: u16,
    tag: &str,
    standby: &Standby,
) -> Result<PurchaseConsumers, BrokerError> {
    let channel = conn.create_channel().await?;
    topology.declare_checked(conn, &channel).await?;
    channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await?;
    let queues = topology.purchase_queues();
    let tag_of = |q: &str| match (tag.is_empty(), topology.is_partitioned()) {
        (true, _) => String::new(),
        (false, false) => tag.to_owned(),
        (false, true) => format!("{tag}.{}", q.rsplit('.').next().unwrap_or_default()),
    };
    let preferred = |q: &&String| {
        standby.prefer.is_empty()
            || !topology.is_partitioned()
            || standby
                .prefer
                .iter()
                .any(|&i| topology.partition_queue(i) == **q)
    };
    let (now, later): (Vec<&String>, Vec<&String>) = queues.iter().partition(preferred);
    let handles = ConsumerHandles::default();
    let mut first = Vec::new();
    for q in now {
        first.push(subscribe_on(&channel, q, &tag_of(q), &handles).await?);
    }
    let later: Vec<(String, String)> = later.into_iter().map(|q| (q.clone(), tag_of(q))).collect();
    let delayed = match later.is_empty() {
        true => futures::stream::empty().boxed(),
        false => {
            let (channel, kept, after) = (channel.clone(), handles.clone(), standby.after);
            futures::stream::once(async move {
                tokio::time::sleep(after).await;
                let mut consumers = Vec::new();
                for (q, tag) in &later {
                    match subscribe_on(&channel, q, tag, &kept).await {
                        Ok(c) => consumers.push(c),
                        Err(e) => return futures::stream::once(async { Err(e) }).boxed(),
                    }
                }
                futures::stream::select_all(consumers).boxed()
            })
            .flatten()
            .boxed()
        }
    };
    let deliveries = futures::stream::select(futures::stream::select_all(first), delayed).boxed();
    Ok(PurchaseConsumers {
        deliveries,
        handles,
    })
}

/// Consumes `queue` on `channel` with manual acks, its handle kept in `handles`.
async fn subscribe_on(
    channel: &Channel,
    queue: &str,
    tag: &str,
    handles: &ConsumerHandles,
) -> lapin::Result<Consumer> {
    let consumer = channel
        .basic_consume(
            queue,
            tag,
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    handles.push(ConsumerHandle {
        channel: channel.clone(),
        tag: consumer.tag().to_string(),
    });
    Ok(consumer)
}

/// Starts consuming a declared durable `queue` with manual acks, at most
/// `prefetch` unacked deliveries at once, on a channel of its own.
pub async fn consume(
    conn: &Connection,
    queue: &str,
    prefetch: u16,
) -> Result<OpenConsumer, BrokerError> {
    consume_on(conn.create_channel().await?, queue, prefetch, "").await
}

async fn consume_on(
    channel: Channel,
    queue: &str,
    prefetch: u16,
    tag: &str,
) -> Result<OpenConsumer, BrokerError> {
    channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await?;
    let consumer = channel
        .basic_consume(
            queue,
            tag,
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    Ok(opened(channel, consumer))
}

/// Hears `routing_key` on `exchange` through a queue of this process only
/// (exclusive, deleted with its consumer; deliveries need no ack).
pub async fn subscribe(
    conn: &Connection,
    exchange: &str,
    routing_key: &str,
) -> Result<OpenConsumer, BrokerError> {
    let channel = conn.create_channel().await?;
    let queue = channel
        .queue_declare(
            "",
            QueueDeclareOptions {
                exclusive: true,
                auto_delete: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    channel
        .queue_bind(
            queue.name().as_str(),
            exchange,
            routing_key,
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let consumer = channel
        .basic_consume(
            queue.name().as_str(),
            "",
            BasicConsumeOptions {
                no_ack: true,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    Ok(opened(channel, consumer))
}

/// The tag is the broker's: the one asked for, or the one it generated.
fn opened(channel: Channel, consumer: Consumer) -> OpenConsumer {
    let tag = consumer.tag().to_string();
    OpenConsumer {
        consumer,
        handle: ConsumerHandle { channel, tag },
    }
}
