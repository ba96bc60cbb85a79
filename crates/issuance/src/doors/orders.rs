//! Orders as the doors read and change them: who got which code, the
//! reveal records made before codes are shown, redemption by order, void,
//! resend, one code replaced, and holds.

use codepool_domain::{Code, SmsPending};

use crate::audit::{self, Actor};
use crate::holds::{self, HoldError};
use crate::model::{
    CodeQuery, CodeRef, HoldDoc, LifecycleError, Redeemed, RedemptionTag, VoidOutcome,
};
use crate::ops::{self, Lookup, ResendError, VoidError};
use crate::replace::{self, Ask, ReplaceError, Replaced};
use crate::{Core, StoreError};

impl Core {
    /// Who got which code, and for an order whether it waits
    /// ([`ops::lookup`]).
    pub async fn lookup(&self, query: CodeQuery<'_>, limit: i64) -> Result<Lookup, StoreError> {
        ops::lookup(self.store(), query, limit).await
    }

    /// Records that codes are shown to `actor` ([`audit::reveal`]): a door
    /// shows them only once this succeeded.
    pub async fn record_reveal(
        &self,
        actor: &Actor,
        what: String,
        code_ids: Vec<codepool_domain::CodeId>,
        count: u64,
    ) -> Result<(), StoreError> {
        audit::reveal(self.store(), actor, what, code_ids, count).await
    }

    /// The codes of an order to show in plaintext, the reveal recorded
    /// first ([`ops::reveal_order`]).
    pub async fn reveal_order(&self, order_id: &str, actor: &Actor) -> Result<Lookup, StoreError> {
        ops::reveal_order(self.store(), order_id, actor).await
    }

    /// Redeems a code or an order's codes ([`ops::redeem`]).
    pub async fn redeem(
        &self,
        target: CodeRef<'_>,
        tag: Option<&RedemptionTag>,
        actor: &Actor,
    ) -> Result<Redeemed, LifecycleError> {
        self.parts().redeem(target, tag, actor).await
    }

    /// Voids a code or an order (or cancels its backorder), the voided
    /// codes out of the hot pool ([`ops::void`]).
    pub async fn void(
        &self,
        target: CodeRef<'_>,
        reason: &str,
        actor: &Actor,
    ) -> Result<VoidOutcome, VoidError> {
        ops::void(self.store(), self.hot().as_ref(), target, reason, actor).await
    }

    /// Sends an order's SMS-pending events again, on the broker in use
    /// ([`ops::resend`]).
    pub async fn resend(
        &self,
        order: &str,
        actor: &Actor,
    ) -> Result<(Vec<SmsPending>, Vec<Code>), ResendError> {
        let broker = self.broker();
        ops::resend(self.store(), self.outbox(), &broker.publisher, order, actor).await
    }

    /// Replaces one code of an order ([`replace::replace`]); whose order it
    /// is, the door checks first.
    pub async fn replace(&self, ask: &Ask<'_>, actor: &Actor) -> Result<Replaced, ReplaceError> {
        let broker = self.broker();
        let services = replace::Services {
            store: self.store(),
            engine: self.intake().engine(),
            outbox: self.outbox(),
            sink: &broker.publisher,
        };
        replace::replace(&services, ask, actor).await
    }

    /// `owner`'s hold `hold_id` ([`holds::get`]).
    pub async fn hold(&self, hold_id: &str, owner: Option<&str>) -> Result<HoldDoc, HoldError> {
        holds::get(self.store(), hold_id, owner).await
    }
}
