//! Publishing with publisher confirms. A [`Publisher`] owns one channel in
//! confirm mode; `publish_*` hands the message to the broker and returns a
//! [`PendingConfirm`], which resolves once the broker has stored it.

use codepool_domain::{PoolEvent, Purchase, PurchaseRefused, SmsPending, PURCHASE_REFUSED_KEY};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::publisher_confirm::{Confirmation, PublisherConfirm};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Connection};

use crate::topology::{Topology, SMS_PENDING_KEY};
use crate::{BrokerError, PUBLISHER_HEADER, REASON_HEADER, REPLAYS_HEADER};

/// The longest wait for one publisher confirm. A quorum queue that lost its
/// leader confirms within seconds once a new one is elected; far longer
/// means the confirm will not come.
pub const CONFIRM_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// A publish the broker has not confirmed yet.
pub struct PendingConfirm {
    inner: PublisherConfirm,
    exchange: String,
    routing_key: String,
}

impl PendingConfirm {
    /// Waits for the broker's verdict: stored (Ok), refused (nack), or not
    /// routable to any queue (the topology is missing). A verdict that does
    /// not come within [`CONFIRM_TIMEOUT`] counts as no confirm: the caller
    /// publishes again (same message id) or leaves the delivery unacked,
    /// rather than waiting forever on a channel that lost track of it.
    pub async fn wait(self) -> Result<(), BrokerError> {
        let verdict = tokio::time::timeout(CONFIRM_TIMEOUT, self.inner)
            .await
            .map_err(|_| {
                BrokerError::Unavailable(format!(
                    "no publisher confirm for {:?} / {:?} within {CONFIRM_TIMEOUT:?}",
                    self.exchange, self.routing_key
                ))
            })?;
        match verdict? {
            Confirmation::Ack(None) | Confirmation::NotRequested => Ok(()),
            Confirmation::Ack(Some(_)) => Err(BrokerError::Unroutable {
                exchange: self.exchange,
                routing_key: self.routing_key,
            }),
            Confirmation::Nack(_) => Err(BrokerError::Nacked),
        }
    }
}

/// The broker's verdict on a publish that may not have left: `Ok` only
/// when it was handed over and confirmed.
pub async fn confirmed(published: Result<PendingConfirm, BrokerError>) -> Result<(), BrokerError> {
    published?.wait().await
}

/// Publishes codepool's messages on one confirm-mode channel.
#[derive(Clone)]
pub struct Publisher {
    channel: Channel,
    topology: Topology,
    /// The broker user purchases are published as (their `user_id`, which
    /// RabbitMQ checks against the connection's user): what a shop's
    /// `broker_users` names.
    user_id: Option<String>,
}

/// AMQP's message id is a short string: at most 255 bytes, and RabbitMQ
/// closes the whole connection on a longer one. An id that fits is sent as
/// it is; a longer one (a 128-character order id of two-byte letters in
/// `sms:<order_id>:<lines>`) as `sha256:` and its digest in hex, which is
/// as stable as the id itself, so duplicates still share one message id.
/// The event's own `event_id`, in the body, is never shortened.
pub fn amqp_message_id(id: &str) -> ShortString {
    const MAX: usize = 255;
    if id.len() <= MAX {
        return id.into();
    }
    use sha2::{Digest, Sha256};
    format!("sha256:{}", hex::encode(Sha256::digest(id.as_bytes()))).into()
}

/// `%XX` escapes of a URL's user name, decoded.
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = || std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok();
        match (bytes[i], hex().and_then(|h| u8::from_str_radix(h, 16).ok())) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn persistent_json() -> BasicProperties {
    BasicProperties::default()
        .with_delivery_mode(2)
        .with_content_type("application/json".into())
}

impl Publisher {
    /// Opens a confirm-mode channel on `conn`.
    pub async fn new(conn: &Connection, topology: Topology) -> Result<Self, BrokerError> {
        let channel = conn.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Ok(Self {
            channel,
            topology,
            user_id: None,
        })
    }

    /// Publishes purchases, dead letters and replays with `user_id` set to
    /// `user`: the broker user of the connection (RabbitMQ refuses any
    /// other), which a shop names among the broker users that may publish
    /// for it, and which vouches for a dead letter's record of its
    /// publisher ([`crate::publisher_of`]).
    pub fn as_user(mut self, user: &str) -> Self {
        self.user_id = Some(user.to_owned());
        self
    }

    /// The broker user this publisher publishes purchases as, if set.
    pub fn user(&self) -> Option<&str> {
        self.user_id.as_deref()
    }

    /// Persistent JSON properties with this publisher's `user_id`.
    fn own_json(&self) -> BasicProperties {
        match &self.user_id {
            Some(user) => persistent_json().with_user_id(user.as_str().into()),
            None => persistent_json(),
        }
    }

    /// The user of an AMQP URL (the first of a list), `guest` when it
    /// names none: what [`Publisher::as_user`] takes for a connection made
    /// from it.
    pub fn user_of(url: &str) -> String {
        let first = url.split(',').next().unwrap_or_default();
        first
            .split_once("://")
            .and_then(|(_, rest)| rest.split_once('@'))
            .map(|(auth, _)| auth.split(':').next().unwrap_or_default())
            .filter(|u| !u.is_empty())
            .map(percent_decode)
            .unwrap_or_else(|| "guest".to_owned())
    }

    pub fn channel(&self) -> &Channel {
        &self.channel
    }

    /// Waits until the broker has confirmed (or refused) every message
    /// published on this channel. Bounded and best effort: a broker that
    /// stopped answering must not hold a shutdown. Before closing the
    /// connection, settle and keep the publisher until the connection is
    /// closed (see [`crate::close`]).
    pub async fn settle(&self) {
        let _ = tokio::time::timeout(crate::CLOSE_WAIT, self.channel.wait_for_confirms()).await;
    }

    /// Settles, then closes the channel, for a connection that stays open.
    pub async fn close(&self, reason: &str) {
        self.settle().await;
        let _ = tokio::time::timeout(crate::CLOSE_WAIT, self.channel.close(200, reason)).await;
    }

    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// Publishes raw bytes, mandatory (an unroutable message is an error,
    /// never silently dropped).
    pub async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<PendingConfirm, BrokerError> {
        let inner = self
            .channel
            .basic_publish(
                exchange,
                routing_key,
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                body,
                properties,
            )
            .await?;
        Ok(PendingConfirm {
            inner,
            exchange: exchange.to_owned(),
            routing_key: routing_key.to_owned(),
        })
    }

    /// A purchase onto the purchases queue, `message_id` = `order_id`.
    pub async fn publish_purchase(
        &self,
        purchase: &Purchase,
    ) -> Result<PendingConfirm, BrokerError> {
        self.publish_purchase_bytes(&purchase.to_json(), Some(&purchase.order_id))
            .await
    }

    /// Raw purchase bytes (also used to send invalid messages in tests),
    /// to the purchases exchange, which routes them to the purchases queue
    /// alone: with partitions, to the partition of the purchase's pool
    /// ([`Topology::routing_key_of`]).
    pub async fn publish_purchase_bytes(
        &self,
        body: &[u8],
        message_id: Option<&str>,
    ) -> Result<PendingConfirm, BrokerError> {
        let mut props = self.own_json();
        if let Some(id) = message_id {
            props = props.with_message_id(amqp_message_id(id));
        }
        let exchange = self.topology.purchases_exchange.clone();
        let key = self.topology.routing_key_of(body);
        self.publish(&exchange, &key, body, props).await
    }

    /// A dead-lettered purchase sent back to the purchases queue (its
    /// pool's partition, like any purchase), marked
    /// with how often it has been replayed (`replays`, at least 1) and
    /// with the broker user that first published it (`publisher`, as the
    /// dead letter recorded it; none when it carried no `user_id`), under
    /// this publisher's own `user_id`, which the dispatcher trusts to carry
    /// that record when it is one of the operator's broker users.
    pub async fn replay_purchase(
        &self,
        body: &[u8],
        message_id: Option<&str>,
        replays: u32,
        publisher: Option<&str>,
    ) -> Result<PendingConfirm, BrokerError> {
        let mut headers = FieldTable::default();
        headers.insert(REPLAYS_HEADER.into(), AMQPValue::LongUInt(replays));
        let recorded = publisher.unwrap_or_default();
        headers.insert(
            PUBLISHER_HEADER.into(),
            AMQPValue::LongString(recorded.into()),
        );
        let mut props = self.own_json().with_headers(headers);
        if let Some(id) = message_id {
            props = props.with_message_id(amqp_message_id(id));
        }
        let exchange = self.topology.purchases_exchange.clone();
        let key = self.topology.routing_key_of(body);
        self.publish(&exchange, &key, body, props).await
    }

    /// The SMS-pending event of a grant, with its stable `event_id` as the
    /// message id so the SMS service can drop duplicates.
    pub async fn publish_sms_pending(
        &self,
        event: &SmsPending,
    ) -> Result<PendingConfirm, BrokerError> {
        let props = persistent_json().with_message_id(amqp_message_id(&event.event_id));
        let exchange = self.topology.sms_exchange.clone();
        self.publish(&exchange, SMS_PENDING_KEY, &event.to_json(), props)
            .await
    }

    /// A pool event on the events exchange. Not mandatory: nobody may be
    /// listening for pool events, and that is fine.
    pub async fn publish_pool_event(
        &self,
        event: &PoolEvent,
    ) -> Result<PendingConfirm, BrokerError> {
        let inner = self
            .channel
            .basic_publish(
                &self.topology.events_exchange,
                &event.event,
                BasicPublishOptions::default(),
                &event.to_json(),
                persistent_json(),
            )
            .await?;
        Ok(PendingConfirm {
            inner,
            exchange: self.topology.events_exchange.clone(),
            routing_key: event.event.clone(),
        })
    }

    /// A purchase refused by a pool policy, on the events exchange with
    /// routing key `purchase.refused`, mandatory (the `purchases.refused`
    /// queue is bound to it) and with its stable `event_id` as message id.
    pub async fn publish_refused(
        &self,
        event: &PurchaseRefused,
    ) -> Result<PendingConfirm, BrokerError> {
        let props = persistent_json().with_message_id(amqp_message_id(&event.event_id));
        let exchange = self.topology.events_exchange.clone();
        self.publish(&exchange, PURCHASE_REFUSED_KEY, &event.to_json(), props)
            .await
    }

    /// Puts an invalid purchase on the dead-letter queue with the reason in
    /// the `x-codepool-reason` header, keeping its body and message id, and
    /// recording the broker user that published it (`publisher`; none when
    /// it carried no `user_id`) in `x-codepool-publisher`, under this
    /// publisher's own `user_id`, so that a replay sends it back as that
    /// user's ([`crate::publisher_of`]).
    pub async fn dead_letter(
        &self,
        body: &[u8],
        message_id: Option<&ShortString>,
        reason: &str,
        replays: u32,
        publisher: Option<&str>,
    ) -> Result<PendingConfirm, BrokerError> {
        let mut headers = FieldTable::default();
        headers.insert(REASON_HEADER.into(), AMQPValue::LongString(reason.into()));
        if replays > 0 {
            headers.insert(REPLAYS_HEADER.into(), AMQPValue::LongUInt(replays));
        }
        let recorded = publisher.unwrap_or_default();
        headers.insert(
            PUBLISHER_HEADER.into(),
            AMQPValue::LongString(recorded.into()),
        );
        let mut props = self.own_json().with_headers(headers);
        if let Some(id) = message_id {
            props = props.with_message_id(id.clone());
        }
        let queue = self.topology.purchases_dead.clone();
        self.publish("", &queue, body, props).await
    }
}

#[cfg(test)]
mod user_tests {
    use super::Publisher;

    #[test]
    fn the_user_of_an_amqp_url_is_its_first_servers_user_decoded() {
        assert_eq!(
            Publisher::user_of("amqp://shop%2Da:pw@h:5672/%2f"),
            "shop-a"
        );
        assert_eq!(Publisher::user_of("amqp://acme:pw@a,amqp://x:y@b"), "acme");
        assert_eq!(Publisher::user_of("amqp://127.0.0.1:5672/%2f"), "guest");
    }
}
