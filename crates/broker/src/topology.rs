//! The queues and exchanges codepool declares, in one place. Declaring is
//! idempotent, so every process declares what it uses at start and after
//! every reconnect, and nothing depends on start order.

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, ExchangeKind};

use codepool_domain::PURCHASE_REFUSED_KEY;

use crate::BrokerError;

/// Names of codepool's queues and exchanges. Production uses the plain
/// names; tests and benchmarks give a prefix so that runs never share
/// queues.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// Durable queue of purchase events; rejected messages dead-letter to
    /// [`Topology::purchases_dead`].
    pub purchases: String,
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
            purchases_dead: n("purchases.dead"),
            sms_exchange: n("sms"),
            sms_pending: n("sms.pending"),
            sms_receipts: n("sms.receipts"),
            events_exchange: n("codepool.events"),
            code_redeemed: n("code.redeemed"),
            purchases_refused: n("purchases.refused"),
        }
    }

    /// Declares everything (idempotent).
    pub async fn declare(&self, channel: &Channel) -> Result<(), BrokerError> {
        let durable = QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        };
        let topic = ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        let fail = |what: &str, e: lapin::Error| {
            BrokerError::Topology(format!(
                "declaring {what}: {e}; if it exists with other arguments, delete it (rabbitmqctl delete_queue NAME) and start again"
            ))
        };

        channel
            .queue_declare(&self.purchases_dead, durable, FieldTable::default())
            .await
            .map_err(|e| fail(&self.purchases_dead, e))?;
        let mut args = FieldTable::default();
        args.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString("".into()),
        );
        args.insert(
            "x-dead-letter-routing-key".into(),
            AMQPValue::LongString(self.purchases_dead.as_str().into()),
        );
        channel
            .queue_declare(&self.purchases, durable, args)
            .await
            .map_err(|e| fail(&self.purchases, e))?;

        for exchange in [&self.sms_exchange, &self.events_exchange] {
            channel
                .exchange_declare(exchange, ExchangeKind::Topic, topic, FieldTable::default())
                .await
                .map_err(|e| fail(exchange, e))?;
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
            channel
                .queue_declare(queue, durable, FieldTable::default())
                .await
                .map_err(|e| fail(queue, e))?;
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
                    .map_err(|e| fail(queue, e))?;
            }
        }
        Ok(())
    }
}
