//! # codepool-broker
//!
//! The RabbitMQ adapter (AMQP 0-9-1 over `lapin`): the names and shape of
//! codepool's topology, connecting, and publishing with publisher confirms.
//!
//! Every message codepool publishes is persistent and confirmed: a publish
//! is done only when the broker has taken responsibility for it. Callers
//! get the confirmation as a future, so many publishes can be in flight
//! together and awaited at once.

pub mod consume;
pub mod publisher;
pub mod topology;

use lapin::{Connection, ConnectionProperties};

pub use consume::{consume_purchases, subscribe, PurchaseConsumer};
pub use publisher::{confirmed, PendingConfirm, Publisher};
pub use topology::Topology;

/// Header that carries why a purchase was dead-lettered.
pub const REASON_HEADER: &str = "x-codepool-reason";

/// The `x-codepool-reason` of a dead-lettered message, if it has one.
pub fn dead_letter_reason(properties: &lapin::BasicProperties) -> Option<String> {
    let value = properties.headers().as_ref()?.inner().get(REASON_HEADER)?;
    Some(match value {
        lapin::types::AMQPValue::LongString(s) => s.to_string(),
        lapin::types::AMQPValue::ShortString(s) => s.to_string(),
        other => format!("{other:?}"),
    })
}

#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    #[error("RabbitMQ is unreachable ({0}); check that rabbitmq-server runs and CODEPOOL_AMQP_URL points at it (`make services` starts a local one)")]
    Unavailable(String),
    #[error("RabbitMQ refused the message (nack); it was not stored and will be retried")]
    Nacked,
    #[error("no queue is bound for {exchange:?} / {routing_key:?}; run `codepool dispatch` (or `codepool migrate`) once to declare the topology")]
    Unroutable {
        exchange: String,
        routing_key: String,
    },
    #[error("RabbitMQ topology: {0}")]
    Topology(String),
}

impl From<lapin::Error> for BrokerError {
    fn from(e: lapin::Error) -> Self {
        BrokerError::Unavailable(e.to_string())
    }
}

/// Ready messages in `queue` right now (a passive declare: unacked
/// messages are not counted, and a missing queue is an error).
pub async fn queue_depth(channel: &lapin::Channel, queue: &str) -> Result<u32, BrokerError> {
    let q = channel
        .queue_declare(
            queue,
            lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await?;
    Ok(q.message_count())
}

/// How long [`close`] waits for a connection's I/O thread to end.
const CLOSE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Closes a connection and waits for lapin's I/O thread to end, so that the
/// thread never outlives the tokio runtime (it would log `ERROR io_loop … A
/// Tokio 1.x context was found, but it is being shutdown` at exit). Best
/// effort and bounded: a connection that is already gone is fine.
pub async fn close(conn: Connection, reason: &str) {
    let _ = conn.close(200, reason).await;
    let (done, ended) = tokio::sync::oneshot::channel();
    // A plain thread, not spawn_blocking: the runtime must never wait on it.
    let joined = std::thread::Builder::new()
        .name("codepool-amqp-close".into())
        .spawn(move || {
            let _ = conn.run();
            let _ = done.send(());
        });
    if joined.is_ok() {
        let _ = tokio::time::timeout(CLOSE_WAIT, ended).await;
    }
}

/// Connects to RabbitMQ on the tokio runtime. The vhost comes from the URL
/// (`amqp://user:pass@host:5672/%2f` is the default vhost `/`).
pub async fn connect(url: &str, name: &str) -> Result<Connection, BrokerError> {
    let mut props = ConnectionProperties::default()
        .with_executor(tokio_executor_trait::Tokio::current())
        .with_reactor(tokio_reactor_trait::Tokio)
        .with_connection_name(name.into());
    props.client_properties.insert(
        "product".into(),
        lapin::types::AMQPValue::LongString("codepool".into()),
    );
    let connect = Connection::connect(url, props);
    match tokio::time::timeout(std::time::Duration::from_secs(10), connect).await {
        Ok(Ok(conn)) => Ok(conn),
        Ok(Err(e)) => Err(BrokerError::Unavailable(e.to_string())),
        Err(_) => Err(BrokerError::Unavailable(
            "connection timed out after 10s".into(),
        )),
    }
}
