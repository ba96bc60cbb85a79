//! Consuming: the purchases queue with manual acks and a prefetch window,
//! and private subscriptions to events (an exclusive, auto-deleted queue
//! per process, bound to one routing key).

use lapin::options::{BasicConsumeOptions, BasicQosOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, Consumer};

use crate::{BrokerError, Topology};

/// A consumer of the purchases queue and the channel its acks go through.
pub struct PurchaseConsumer {
    pub channel: Channel,
    pub consumer: Consumer,
    pub tag: String,
}

/// Declares the topology and starts consuming `purchases` with manual acks,
/// at most `prefetch` unacked deliveries at once.
pub async fn consume_purchases(
    conn: &Connection,
    topology: &Topology,
    prefetch: u16,
    tag: &str,
) -> Result<PurchaseConsumer, BrokerError> {
    let channel = conn.create_channel().await?;
    topology.declare(&channel).await?;
    channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await?;
    let consumer = channel
        .basic_consume(
            &topology.purchases,
            tag,
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    Ok(PurchaseConsumer {
        channel,
        consumer,
        tag: tag.to_owned(),
    })
}

/// Hears `routing_key` on `exchange` through a queue of this process only
/// (exclusive, deleted with the connection; deliveries need no ack).
pub async fn subscribe(
    conn: &Connection,
    exchange: &str,
    routing_key: &str,
) -> Result<Consumer, BrokerError> {
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
    Ok(channel
        .basic_consume(
            queue.name().as_str(),
            "",
            BasicConsumeOptions {
                no_ack: true,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        )
        .await?)
}
