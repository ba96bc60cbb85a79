//! The queues and exchanges codepool declares, in one place. Declaring is
//! idempotent, so every process declares what it uses at start and after
//! every reconnect, and nothing depends on start order.
//!
//! Queues are quorum queues by default (replicated over a RabbitMQ cluster;
//! the documented replacement for mirrored classic queues), classic queues
//! on request (`--queue-type classic`). The purchases queue and the queues
//! the dispatchers consume (`sms.receipts`, `code.redeemed`) carry a delivery
//! limit: a message delivered that often without being settled is a poison
//! message and goes to `purchases.dead` instead of looping forever.
//! `purchases.dead` and `sms.pending` are quorum queues without a limit:
//! `codepool dead-letters list` and `codepool sms-pending` peek at them, and
//! on a quorum queue every peek counts as a delivery, so a limit would move
//! messages away just because someone looked at them.

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, ExchangeKind};

use codepool_domain::PURCHASE_REFUSED_KEY;

use crate::BrokerError;

/// Deliveries of one message without an ack before it is dead-lettered
/// (RabbitMQ 4 uses the same default for quorum queues).
pub const DEFAULT_DELIVERY_LIMIT: u32 = 20;

/// The kind of queue codepool declares. A queue's type is fixed when it is
/// created; see [`BrokerError::QueueType`] for moving from one to the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QueueType {
    /// Replicated (Raft) queues with a delivery limit: the default.
    #[default]
    Quorum,
    /// Single-node queues, as codepool declared them before quorum queues.
    Classic,
}

impl QueueType {
    pub fn as_str(self) -> &'static str {
        match self {
            QueueType::Quorum => "quorum",
            QueueType::Classic => "classic",
        }
    }

    /// The declare arguments that make a queue of this type, and nothing
    /// else (no limit, no dead-lettering): an empty table is a classic queue.
    pub fn declare_args(self) -> FieldTable {
        let mut args = FieldTable::default();
        if self == QueueType::Quorum {
            args.insert(
                "x-queue-type".into(),
                AMQPValue::LongString(self.as_str().into()),
            );
        }
        args
    }
}

impl std::str::FromStr for QueueType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "quorum" => Ok(QueueType::Quorum),
            "classic" => Ok(QueueType::Classic),
            other => Err(format!(
                "unknown queue type {other:?}; use quorum or classic"
            )),
        }
    }
}

/// How codepool's durable queues are declared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueSettings {
    pub queue_type: QueueType,
    /// Quorum queues only: deliveries before a message is dead-lettered.
    pub delivery_limit: u32,
}

impl Default for QueueSettings {
    fn default() -> Self {
        Self {
            queue_type: QueueType::Quorum,
            delivery_limit: DEFAULT_DELIVERY_LIMIT,
        }
    }
}

/// Names of codepool's queues and exchanges. Production uses the plain
/// names; tests and benchmarks give a prefix so that runs never share
/// queues.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// Durable queue of purchase events; rejected messages dead-letter to
    /// [`Topology::purchases_dead`].
    pub purchases: String,
    /// Fanout exchange bound to [`Topology::purchases`] alone: where
    /// purchases are published. A shop's backend may write to it and to
    /// nothing else, so it can reach no other queue (not `sms.pending`, not
    /// `purchases.dead`), which writing to the default exchange would let it.
    pub purchases_exchange: String,
    /// Durable queue of invalid purchases, each with `x-codepool-reason`.
    pub purchases_dead: String,
    /// Topic exchange for SMS traffic (`sms.pending`, `sms.sent`, `sms.failed`).
    pub sms_exchange: String,
    /// Durable queue bound to `sms.pending`, so events wait for the SMS
    /// service even before it exists.
    pub sms_pending: String,
    /// Durable queue bound to `sms.sent` and `sms.failed`: receipts for us.
    pub sms_receipts: String,
    /// Topic exchange for pool events (`pool.low_stock`, …) and lifecycle
    /// events (`code.redeemed`).
    pub events_exchange: String,
    /// Durable queue bound to `code.redeemed` on the events exchange:
    /// redemptions reported by the platform, shared by all dispatchers.
    pub code_redeemed: String,
    /// Durable queue bound to `purchase.refused` on the events exchange:
    /// purchases refused by a pool policy wait here for the shop (a refund)
    /// even before anyone consumes them.
    pub purchases_refused: String,
    /// Type and delivery limit of every durable queue above.
    pub queues: QueueSettings,
    /// Queues purchases are spread over by pool (see
    /// [`crate::partitions`]): 1 is the queue [`Topology::purchases`]
    /// behind a fanout exchange, as before partitions; N > 1 the queues
    /// `purchases.0` … behind a direct exchange.
    pub partitions: u16,
}

pub const SMS_PENDING_KEY: &str = "sms.pending";
pub const SMS_SENT_KEY: &str = "sms.sent";
pub const SMS_FAILED_KEY: &str = "sms.failed";
pub const CODE_REDEEMED_KEY: &str = "code.redeemed";

impl Default for Topology {
    fn default() -> Self {
        Self::with_prefix("")
    }
}

impl Topology {
    /// `prefix` is prepended to every name (`""` in production).
    pub fn with_prefix(prefix: &str) -> Self {
        let n = |name: &str| format!("{prefix}{name}");
        Self {
            purchases: n("purchases"),
            purchases_exchange: n("codepool.purchases"),
            purchases_dead: n("purchases.dead"),
            sms_exchange: n("sms"),
            sms_pending: n("sms.pending"),
            sms_receipts: n("sms.receipts"),
            events_exchange: n("codepool.events"),
            code_redeemed: n("code.redeemed"),
            purchases_refused: n("purchases.refused"),
            queues: QueueSettings::default(),
            partitions: 1,
        }
    }

    /// The same names with queues of `queue_type`.
    pub fn with_queue_type(mut self, queue_type: QueueType) -> Self {
        self.queues.queue_type = queue_type;
        self
    }

    /// Every durable queue, for cleanup and checks.
    pub fn queue_names(&self) -> Vec<String> {
        let mut names = self.purchase_queues();
        names.extend(
            [
                &self.purchases_dead,
                &self.sms_pending,
                &self.sms_receipts,
                &self.code_redeemed,
                &self.purchases_refused,
            ]
            .map(String::clone),
        );
        names
    }

    /// The `x-delivery-count` of a delivery from a quorum queue, if it has
    /// reached the delivery limit: the broker dead-letters the message if it
    /// comes back once more, so the dispatcher dead-letters it itself now,
    /// with its reason.
    pub fn over_delivery_limit(&self, properties: &lapin::BasicProperties) -> Option<u64> {
        if self.queues.queue_type != QueueType::Quorum {
            return None;
        }
        let count = match properties
            .headers()
            .as_ref()?
            .inner()
            .get("x-delivery-count")?
        {
            AMQPValue::LongLongInt(n) => u64::try_from(*n).ok()?,
            AMQPValue::LongInt(n) => u64::try_from(*n).ok()?,
            AMQPValue::LongUInt(n) => u64::from(*n),
            AMQPValue::ShortInt(n) => u64::try_from(*n).ok()?,
            AMQPValue::ShortUInt(n) => u64::from(*n),
            _ => return None,
        };
        (count >= u64::from(self.queues.delivery_limit)).then_some(count)
    }

    /// Arguments of a durable queue of `queue_type`: quorum queues that can
    /// poison a consumer get the delivery limit and dead-letter to
    /// `purchases.dead`; classic ones keep what older versions declared.
    fn queue_args(&self, queue: &str, queue_type: QueueType) -> FieldTable {
        let mut args = queue_type.declare_args();
        let str_arg = |s: &str| AMQPValue::LongString(s.into());
        let purchases = self.is_purchase_queue(queue);
        let limited = purchases || queue == self.sms_receipts || queue == self.code_redeemed;
        let dead_letters = purchases || (limited && queue_type == QueueType::Quorum);
        if dead_letters {
            args.insert("x-dead-letter-exchange".into(), str_arg(""));
            args.insert(
                "x-dead-letter-routing-key".into(),
                str_arg(&self.purchases_dead),
            );
        }
        if queue_type == QueueType::Quorum && limited {
            let limit = i64::from(self.queues.delivery_limit);
            args.insert("x-delivery-limit".into(), AMQPValue::LongLongInt(limit));
        }
        if purchases && self.is_partitioned() {
            // One dispatcher at a time takes a partition, in order.
            args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
        }
        args
    }

    /// Declares one durable queue; a queue that exists with another type
    /// is reported as [`BrokerError::QueueType`], with how to migrate.
    async fn declare_queue(&self, channel: &Channel, queue: &str) -> Result<(), BrokerError> {
        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        let wanted = self.queues.queue_type;
        let args = self.queue_args(queue, wanted);
        match channel.queue_declare(queue, durable, args).await {
            Ok(_) => Ok(()),
            Err(e) => Err(match existing_queue_type(&e.to_string()) {
                Some(existing) => BrokerError::QueueType {
                    queue: queue.to_owned(),
                    existing,
                    wanted: wanted.as_str(),
                },
                None => declare_failed(queue, e),
            }),
        }
    }

    /// The purchases exchange and its queues. One partition: a fanout
    /// exchange over `purchases`, whatever the routing key. N partitions:
    /// a direct exchange, partition `i` bound with routing key `i`, and an
    /// alternate exchange that takes any other key to partition 0. The
    /// exchange comes first: one of the other kind (another partition
    /// count) stops the declare before any queue is made.
    async fn declare_purchases(&self, channel: &Channel) -> Result<(), BrokerError> {
        let durable = ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        let unrouted = &self.unrouted_exchange();
        let mut args = FieldTable::default();
        let kind = if self.is_partitioned() {
            let ae = AMQPValue::LongString(unrouted.as_str().into());
            args.insert("alternate-exchange".into(), ae);
            ExchangeKind::Direct
        } else {
            ExchangeKind::Fanout
        };
        // Every purchase published to the purchases exchange goes to a
        // purchases queue, and only there.
        let exchange = &self.purchases_exchange;
        (channel.exchange_declare(exchange, kind, durable, args))
            .await
            .map_err(|e| self.exchange_failed(exchange, e))?;
        if !self.is_partitioned() {
            self.declare_queue(channel, &self.purchases).await?;
            return self.bind(channel, &self.purchases, exchange, "").await;
        }
        for i in (0..self.partitions).rev() {
            let queue = self.partition_queue(i);
            self.declare_queue(channel, &queue).await?;
            self.bind(channel, &queue, exchange, &i.to_string()).await?;
        }
        (channel.exchange_declare(
            unrouted,
            ExchangeKind::Fanout,
            durable,
            FieldTable::default(),
        ))
        .await
        .map_err(|e| self.exchange_failed(unrouted, e))?;
        self.bind(channel, &self.partition_queue(0), unrouted, "")
            .await
    }

    async fn bind(
        &self,
        channel: &Channel,
        queue: &str,
        exchange: &str,
        key: &str,
    ) -> Result<(), BrokerError> {
        (channel.queue_bind(
            queue,
            exchange,
            key,
            QueueBindOptions::default(),
            FieldTable::default(),
        ))
        .await
        .map_err(|e| declare_failed(queue, e))
    }

    /// A purchases exchange that exists with another type or alternate
    /// exchange is that of another partition count
    /// ([`BrokerError::Partitions`]).
    fn exchange_failed(&self, exchange: &str, e: lapin::Error) -> BrokerError {
        match crate::partitions::found_partitions(&e.to_string()) {
            Some(found) => BrokerError::Partitions {
                configured: self.partitions,
                found,
                exchange: self.purchases_exchange.clone(),
            },
            None => declare_failed(exchange, e),
        }
    }

    /// Declares everything (idempotent).
    pub async fn declare(&self, channel: &Channel) -> Result<(), BrokerError> {
        let topic = ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        self.declare_queue(channel, &self.purchases_dead).await?;
        self.declare_purchases(channel).await?;
        for exchange in [&self.sms_exchange, &self.events_exchange] {
            channel
                .exchange_declare(exchange, ExchangeKind::Topic, topic, FieldTable::default())
                .await
                .map_err(|e| declare_failed(exchange, e))?;
        }
        for (queue, exchange, keys) in [
            (
                &self.sms_pending,
                &self.sms_exchange,
                &[SMS_PENDING_KEY][..],
            ),
            (
                &self.sms_receipts,
                &self.sms_exchange,
                &[SMS_SENT_KEY, SMS_FAILED_KEY][..],
            ),
            (
                &self.code_redeemed,
                &self.events_exchange,
                &[CODE_REDEEMED_KEY][..],
            ),
            (
                &self.purchases_refused,
                &self.events_exchange,
                &[PURCHASE_REFUSED_KEY][..],
            ),
        ] {
            self.declare_queue(channel, queue).await?;
            for key in keys {
                channel
                    .queue_bind(
                        queue,
                        exchange,
                        key,
                        QueueBindOptions::default(),
                        FieldTable::default(),
                    )
                    .await
                    .map_err(|e| declare_failed(queue, e))?;
            }
        }
        Ok(())
    }
}

fn declare_failed(what: &str, e: lapin::Error) -> BrokerError {
    BrokerError::Topology(format!(
        "declaring {what}: {e}; if it exists with other arguments, delete it (rabbitmqctl delete_queue NAME) and start again"
    ))
}

/// The type of an existing queue, read from the broker's refusal to
/// redeclare it with another `x-queue-type` ("… received the value 'quorum'
/// of type 'longstr' but current is none"); `None` for any other error.
fn existing_queue_type(error: &str) -> Option<&'static str> {
    let (_, current) = error
        .split_once("inequivalent arg 'x-queue-type'")?
        .1
        .split_once("but current is ")?;
    Some(
        if current.starts_with("none") || current.starts_with("the value 'classic'") {
            "classic"
        } else if current.starts_with("the value 'quorum'") {
            "quorum"
        } else if current.starts_with("the value 'stream'") {
            "stream"
        } else {
            "another type"
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_existing_queue_type_is_read_from_the_refusal() {
        let classic = "PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue 'purchases' in vhost '/': received the value 'quorum' of type 'longstr' but current is none";
        let quorum = "PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue 'q' in vhost '/': received none but current is the value 'quorum' of type 'longstr'";
        assert_eq!(existing_queue_type(classic), Some("classic"));
        assert_eq!(existing_queue_type(quorum), Some("quorum"));
        assert_eq!(
            existing_queue_type("PRECONDITION_FAILED - inequivalent arg 'x-max-length'"),
            None
        );
    }

    #[test]
    fn only_quorum_queues_that_feed_consumers_get_a_delivery_limit() {
        let t = Topology::with_prefix("p.");
        let limit = |q: &str, ty| t.queue_args(q, ty).inner().contains_key("x-delivery-limit");
        assert!(limit(&t.purchases, QueueType::Quorum));
        assert!(limit(&t.sms_receipts, QueueType::Quorum));
        assert!(!limit(&t.sms_pending, QueueType::Quorum));
        assert!(!limit(&t.purchases_dead, QueueType::Quorum));
        assert!(!limit(&t.purchases, QueueType::Classic));
        // classic queues keep exactly what older versions declared
        assert_eq!(
            t.queue_args(&t.sms_pending, QueueType::Classic),
            FieldTable::default()
        );
        assert!(t
            .queue_args(&t.purchases, QueueType::Classic)
            .inner()
            .contains_key("x-dead-letter-exchange"));
    }
}
