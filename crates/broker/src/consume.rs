//! Consuming: the purchases queue with manual acks and a prefetch window,
//! any other durable queue the same way, and private subscriptions to
//! events (an exclusive, auto-deleted queue per process, bound to one
//! routing key).
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

/// Declares the topology and starts consuming `purchases` with manual acks,
/// at most `prefetch` unacked deliveries at once.
pub async fn consume_purchases(
    conn: &Connection,
    topology: &Topology,
    prefetch: u16,
    tag: &str,
) -> Result<OpenConsumer, BrokerError> {
    let channel = conn.create_channel().await?;
    topology.declare(&channel).await?;
    consume_on(channel, &topology.purchases, prefetch, tag).await
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
