//! Purchases partitioned by pool (`--partitions N`, `CODEPOOL_PARTITIONS`).
//!
//! One queue has one leader, which serializes every delivery and ack. With
//! N > 1 partitions the purchases exchange is a direct exchange over N
//! queues, `purchases.0` … `purchases.{N-1}`, and the publisher picks the
//! partition of a purchase from its pool by a stable hash
//! ([`partition_of`]): the first four bytes of the pool's SHA-256, big
//! endian, modulo N. A pool's purchases always land in one queue, so they
//! keep their order; every process (and a shop's backend, in any
//! language) computes the same partition without asking anyone.
//!
//! Each partition queue has one active consumer (`x-single-active-consumer`):
//! every dispatcher consumes every partition, the broker delivers each
//! partition to one of them, and a dead dispatcher's partitions move to
//! the next one in line. A purchase whose routing key names no partition
//! (a backend that predates partitions) goes through the alternate
//! exchange to partition 0: never lost, only not spread.
//!
//! The purchases exchange tells the count a deployment runs with: fanout
//! for one queue, direct with the alternate exchange
//! `codepool.purchases.unrouted.N` for N. A process set to another count
//! cannot declare it ([`Topology::declare_checked`]) and stops with what to
//! do ([`BrokerError::Partitions`]) before it makes any queue.
//!
//! With N = 1 (the default) the topology is the one before partitions: a
//! fanout exchange over the queue `purchases`, competing consumers.

use lapin::Connection;
use sha2::{Digest, Sha256};

use crate::{BrokerError, Topology};

/// Most partitions a deployment may have.
pub const MAX_PARTITIONS: u16 = 256;

/// The partition of `pool` among `partitions`: the first four bytes of
/// the SHA-256 of its UTF-8 name, as a big-endian unsigned integer,
/// modulo `partitions`. Documented in docs/messages.md for shop backends.
pub fn partition_of(pool: &str, partitions: u16) -> u16 {
    let digest = Sha256::digest(pool.as_bytes());
    let head = u32::from_be_bytes([digest[0], digest[1], digest[2], digest[3]]);
    (head % u32::from(partitions.max(1))) as u16
}

/// The pool a purchase body is routed by: its `pool`, or for a bundle
/// (which names `items` instead) its first item's pool. `None` when the
/// body is not JSON or names no pool: such a message is invalid and is
/// dead-lettered wherever it lands.
pub fn routing_pool(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Item {
        pool: Option<serde_json::Value>,
    }
    #[derive(serde::Deserialize)]
    struct Routed {
        pool: Option<serde_json::Value>,
        #[serde(default)]
        items: Option<Vec<Item>>,
    }
    let routed: Routed = serde_json::from_slice(body).ok()?;
    let text = |v: Option<serde_json::Value>| match v {
        Some(serde_json::Value::String(s)) if !s.is_empty() => Some(s),
        _ => None,
    };
    text(routed.pool).or_else(|| {
        let first = routed.items?.into_iter().next()?;
        text(first.pool)
    })
}

impl Topology {
    /// The same names with `partitions` purchase queues (at least 1).
    pub fn with_partitions(mut self, partitions: u16) -> Self {
        self.partitions = partitions.clamp(1, MAX_PARTITIONS);
        self
    }

    /// True when purchases are spread over several queues.
    pub fn is_partitioned(&self) -> bool {
        self.partitions > 1
    }

    /// The queue of partition `i` (N > 1).
    pub fn partition_queue(&self, i: u16) -> String {
        format!("{}.{i}", self.purchases)
    }

    /// Every queue purchases wait in: `purchases`, or its N partitions.
    pub fn purchase_queues(&self) -> Vec<String> {
        if !self.is_partitioned() {
            return vec![self.purchases.clone()];
        }
        (0..self.partitions)
            .map(|i| self.partition_queue(i))
            .collect()
    }

    /// True for a queue purchases wait in (with their delivery limit and
    /// dead-lettering).
    pub fn is_purchase_queue(&self, queue: &str) -> bool {
        queue == self.purchases
            || (self.is_partitioned()
                && queue
                    .strip_prefix(self.purchases.as_str())
                    .and_then(|rest| rest.strip_prefix('.'))
                    .and_then(|i| i.parse::<u16>().ok())
                    .is_some_and(|i| i < self.partitions))
    }

    /// The queue a purchase of `pool` waits in.
    pub fn queue_of(&self, pool: &str) -> String {
        match self.is_partitioned() {
            true => self.partition_queue(partition_of(pool, self.partitions)),
            false => self.purchases.clone(),
        }
    }

    /// The routing key a purchase body is published with: its partition's
    /// number (partition 0 when it names no pool); with one partition the
    /// queue's name, as before (the fanout exchange ignores it).
    pub fn routing_key_of(&self, body: &[u8]) -> String {
        if !self.is_partitioned() {
            return self.purchases.clone();
        }
        routing_pool(body)
            .map_or(0, |pool| partition_of(&pool, self.partitions))
            .to_string()
    }

    /// The alternate exchange of the partitioned purchases exchange: a
    /// fanout exchange bound to partition 0, where a purchase whose routing
    /// key names no partition goes. Its name carries N, and RabbitMQ
    /// refuses to redeclare an exchange with another alternate exchange:
    /// that refusal is how a process set to another count finds out,
    /// without looking for queues that may not exist (each miss would close
    /// a channel, and lapin logs that as an error).
    pub fn unrouted_exchange(&self) -> String {
        format!("{}.unrouted.{}", self.purchases_exchange, self.partitions)
    }

    /// [`Topology::declare`], and when the broker's purchases exchange
    /// belongs to another partition count ([`BrokerError::Partitions`]),
    /// counts the broker's partition queues for the message. Nothing is
    /// declared then: the exchange is declared before any purchase queue.
    pub async fn declare_checked(
        &self,
        conn: &Connection,
        channel: &lapin::Channel,
    ) -> Result<(), BrokerError> {
        match self.declare(channel).await {
            Err(BrokerError::Partitions {
                configured,
                found: None,
                exchange,
            }) => {
                let mut found = 0u16;
                while found < MAX_PARTITIONS
                    && queue_exists(conn, &self.partition_queue(found)).await?
                {
                    found += 1;
                }
                Err(BrokerError::Partitions {
                    configured,
                    found: (found > 0).then_some(found),
                    exchange,
                })
            }
            other => other,
        }
    }
}

/// The partition count of the broker's purchases exchange, read from its
/// refusal to be declared for another count: `Some(Some(1))` when it is
/// the fanout exchange of one queue, `Some(Some(k))` when it names the
/// alternate exchange of k partitions, `Some(None)` when it is partitioned
/// but the count is not told; `None` for any other error.
pub(crate) fn found_partitions(error: &str) -> Option<Option<u16>> {
    if let Some((_, rest)) = error.split_once("inequivalent arg 'type'") {
        let current = rest.split_once("but current is ")?.1;
        return Some(current.starts_with("'fanout'").then_some(1));
    }
    let (_, rest) = error.split_once("inequivalent arg 'alternate-exchange'")?;
    let current = rest.split_once("but current is ").map_or("", |(_, c)| c);
    let count = current
        .split(".unrouted.")
        .nth(1)
        .map(|tail| {
            tail.chars()
                .take_while(char::is_ascii_digit)
                .collect::<String>()
        })
        .and_then(|n| n.parse().ok());
    Some(count)
}

/// Whether `queue` exists (a passive declare on a throwaway channel).
async fn queue_exists(conn: &Connection, queue: &str) -> Result<bool, BrokerError> {
    let channel = conn.create_channel().await?;
    let passive = lapin::options::QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let found = channel
        .queue_declare(queue, passive, lapin::types::FieldTable::default())
        .await;
    match found {
        Ok(_) => {
            let _ = channel.close(200, "looked").await;
            Ok(true)
        }
        Err(e) if is_not_found(&e) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// True for the broker's answer to a passive declare of a missing queue.
fn is_not_found(e: &lapin::Error) -> bool {
    use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
    matches!(e, lapin::Error::ProtocolError(p)
        if matches!(p.kind(), AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND)))
}

/// What an operator reads when the partition count of this process and
/// the broker's queues differ.
pub(crate) fn mismatch_message(configured: u16, found: Option<u16>, exchange: &str) -> String {
    let found = match found {
        Some(1) => "1 partition (the queue `purchases`)".to_owned(),
        Some(n) => format!(
            "{n} partitions (queues `purchases.0` … `purchases.{}`)",
            n - 1
        ),
        None => "purchase queues of another partition count".to_owned(),
    };
    format!(
        "RabbitMQ holds {found}, but this process is set to {configured} partition(s) \
(--partitions / CODEPOOL_PARTITIONS). Either set the deployment's count on this process too; \
or change the count: stop the publishers of purchases, let the dispatchers empty every purchases queue \
(rabbitmqctl list_queues name messages), stop them, delete the exchange {exchange:?} and the old purchases queues \
(rabbitmqctl delete_exchange / delete_queue), and start every codepool process with the new count. See docs/scaling.md (Partitions)"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pools_partition_is_the_head_of_its_sha256() {
        // sha256("game-x") starts with these four bytes in any language.
        let head = {
            let d = Sha256::digest(b"game-x");
            u32::from_be_bytes([d[0], d[1], d[2], d[3]])
        };
        for n in [1u16, 2, 3, 8] {
            assert_eq!(u32::from(partition_of("game-x", n)), head % u32::from(n));
        }
        assert_eq!(partition_of("anything", 1), 0);
        // The example of docs/messages.md: sha256 begins c4 d6 35 4e.
        assert_eq!(partition_of("game-x", 4), 2);
    }

    #[test]
    fn a_bundle_routes_by_its_first_item_and_garbage_by_nothing() {
        assert_eq!(
            routing_pool(br#"{"pool":"a","order_id":"x"}"#).as_deref(),
            Some("a")
        );
        let bundle = br#"{"items":[{"pool":"b","quantity":1},{"pool":"c"}]}"#;
        assert_eq!(routing_pool(bundle).as_deref(), Some("b"));
        assert_eq!(routing_pool(b"{not json"), None);
        assert_eq!(routing_pool(br#"{"pool":7}"#), None);
        let t = Topology::with_prefix("p.").with_partitions(4);
        assert_eq!(t.routing_key_of(b"{not json"), "0");
        let key = partition_of("a", 4).to_string();
        assert_eq!(t.routing_key_of(br#"{"pool":"a"}"#), key);
        assert_eq!(t.queue_of("a"), format!("p.purchases.{key}"));
    }

    #[test]
    fn the_brokers_count_is_read_from_its_refusal() {
        let fanout = "PRECONDITION_FAILED - inequivalent arg 'type' for exchange 'codepool.purchases' in vhost '/': received 'direct' but current is 'fanout'";
        assert_eq!(found_partitions(fanout), Some(Some(1)));
        let direct = "PRECONDITION_FAILED - inequivalent arg 'type' for exchange 'codepool.purchases' in vhost '/': received 'fanout' but current is 'direct'";
        assert_eq!(found_partitions(direct), Some(None));
        let ae = "PRECONDITION_FAILED - inequivalent arg 'alternate-exchange' for exchange 'p.codepool.purchases' in vhost '/': received the value 'p.codepool.purchases.unrouted.3' of type 'longstr' but current is the value 'p.codepool.purchases.unrouted.12' of type 'longstr'";
        assert_eq!(found_partitions(ae), Some(Some(12)));
        assert_eq!(found_partitions("NOT_FOUND - no queue"), None);
    }

    #[test]
    fn purchase_queues_are_the_partitions_or_the_one_queue() {
        let one = Topology::with_prefix("p.");
        assert_eq!(one.purchase_queues(), vec!["p.purchases".to_owned()]);
        assert_eq!(one.routing_key_of(br#"{"pool":"a"}"#), "p.purchases");
        let two = one.clone().with_partitions(2);
        assert_eq!(two.purchase_queues(), ["p.purchases.0", "p.purchases.1"]);
        assert!(two.is_purchase_queue("p.purchases.1"));
        assert!(!two.is_purchase_queue("p.purchases.2"));
        assert!(!two.is_purchase_queue("p.purchases.dead"));
        assert!(!one.is_purchase_queue("p.purchases.0"));
    }
}
