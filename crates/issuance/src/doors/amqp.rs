//! What the AMQP dispatcher asks of the core it holds (its
//! [`Parts`]): apply an SMS receipt ([`crate::receipts`]) or a
//! redemption, check the key registry, feel MongoDB's pulse. The
//! [`Core`](crate::Core) of the HTTP door asks the same of its parts.

use crate::audit::Actor;
use crate::background::Parts;
use crate::keywatch::KeysMissing;
use crate::model::{CodeRef, LifecycleError, Redeemed, RedemptionTag};
use crate::{ops, receipts, StoreError};

impl Parts {
    /// Applies one SMS receipt as it came ([`receipts::apply`]). `Err`
    /// only when MongoDB is unavailable.
    pub async fn apply_sms_receipt(
        &self,
        routing_key: &str,
        body: &[u8],
        receipt_id: Option<&str>,
    ) -> Result<(), StoreError> {
        receipts::apply(&self.store, routing_key, body, receipt_id).await
    }

    /// Redeems a code or an order's codes ([`ops::redeem`]).
    pub async fn redeem(
        &self,
        target: CodeRef<'_>,
        tag: Option<&RedemptionTag>,
        actor: &Actor,
    ) -> Result<Redeemed, LifecycleError> {
        ops::redeem(&self.store, target, tag, actor).await
    }

    /// Whether claims may go on: the key file holds every key codes are
    /// sealed with, read again at most every
    /// [`crate::keywatch::RECHECK`].
    pub async fn ensure_keys(&self) -> Result<Result<(), KeysMissing>, StoreError> {
        self.intake.keys().ensure(&self.store).await
    }

    /// Reads the key registry now.
    pub async fn refresh_keys(&self) -> Result<(), StoreError> {
        self.intake.keys().refresh(&self.store).await
    }

    /// Round trip to MongoDB; `Err` means it is unreachable now.
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.store.ping().await
    }
}
