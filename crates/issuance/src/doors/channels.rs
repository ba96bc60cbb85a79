//! The marketplaces' calls on a shop's channels, as the HTTP door makes
//! them: each one operation of [`crate::channels`], over the core's holds
//! and the door's own placement of orders.

use codepool_store::channels::{ChannelDoc, DealDoc, DealLine};

use crate::audit::Actor;
use crate::channels::outcomes::{self, ChannelView};
use crate::channels::{
    self, eneba, g2a, Call, CallError, Cancelled, ChannelError, Holder, Key, Kind, Placer,
};
use crate::{Core, StoreError};

impl Core {
    /// Every channel, by name.
    pub async fn channels(&self) -> Result<Vec<ChannelDoc>, StoreError> {
        self.store().channels().await
    }

    /// Every channel as the console shows it: its products' declared
    /// stock, its open reservations, its last hour
    /// ([`outcomes::views`]).
    pub async fn channel_views(&self) -> Result<Vec<ChannelView>, StoreError> {
        let all = self.store().channels().await?;
        outcomes::views(self.store(), &self.parts().outcomes, all).await
    }

    /// One channel as the console shows it; `None` when there is none.
    pub async fn channel_view(&self, name: &str) -> Result<Option<ChannelView>, StoreError> {
        let Some(c) = self.store().channel(name).await? else {
            return Ok(None);
        };
        let views = outcomes::views(self.store(), &self.parts().outcomes, vec![c]).await?;
        Ok(views.into_iter().next())
    }

    /// Pauses or resumes a channel, audited with `actor`
    /// ([`channels::set_paused`]).
    pub async fn set_channel_paused(
        &self,
        name: &str,
        paused: bool,
        actor: &Actor,
    ) -> Result<ChannelDoc, ChannelError> {
        channels::set_paused(self.store(), name, paused, actor).await
    }

    /// Counts one call of a channel by its outcome, as the door saw it
    /// ([`channels::counted`]).
    pub fn channel_counted(&self, c: &ChannelDoc, call: Call, ok: bool) {
        channels::counted(self, c, call, ok);
    }

    /// The channel `name` of marketplace `kind`, when `presented` is the
    /// secret its marketplace was given ([`channels::authorized`]).
    pub async fn channel_authorized(
        &self,
        name: &str,
        kind: Kind,
        presented: Option<&str>,
    ) -> Result<ChannelDoc, CallError> {
        channels::authorized(self.store(), name, kind, presented).await
    }

    /// Holds a marketplace order's keys, all or nothing
    /// ([`channels::reserve`]).
    pub async fn channel_reserve(
        &self,
        holder: &dyn Holder,
        c: &ChannelDoc,
        external_id: &str,
        lines: Vec<DealLine>,
    ) -> Result<DealDoc, CallError> {
        channels::reserve(self, holder, c, external_id, lines).await
    }

    /// Provides a marketplace order's keys: the same keys on every retry
    /// ([`channels::provide`]).
    pub async fn channel_provide(
        &self,
        placer: &dyn Placer,
        c: &ChannelDoc,
        external_id: &str,
        marketplace_order: Option<&str>,
        via: &str,
    ) -> Result<Vec<Key>, CallError> {
        channels::provide(self, placer, c, external_id, marketplace_order, via).await
    }

    /// Cancels a marketplace order ([`channels::cancel`]).
    pub async fn channel_cancel(
        &self,
        placer: &dyn Placer,
        c: &ChannelDoc,
        external_id: &str,
        via: &str,
    ) -> Result<Cancelled, CallError> {
        channels::cancel(self, placer, c, external_id, via).await
    }

    /// A marketplace order as recorded.
    pub async fn channel_deal(
        &self,
        c: &ChannelDoc,
        external_id: &str,
    ) -> Result<Option<DealDoc>, StoreError> {
        self.store().deal(&c.name, external_id).await
    }

    /// The keys of a provided marketplace order, again (the same ones).
    pub async fn channel_keys(
        &self,
        placer: &dyn Placer,
        c: &ChannelDoc,
        d: &DealDoc,
        via: &str,
    ) -> Result<Vec<Key>, CallError> {
        channels::keys_of(self, placer, c, d, via).await
    }

    /// Replaces a key of an Eneba order ([`eneba::reserve_replacement`]).
    pub async fn eneba_replace(
        &self,
        c: &ChannelDoc,
        order: &str,
        auction: &str,
        key_id: &str,
    ) -> Result<(), CallError> {
        eneba::reserve_replacement(self, c, order, auction, key_id).await
    }

    /// The new key of an Eneba order's replacement, if it had one
    /// ([`eneba::replacement_keys`]).
    pub async fn eneba_replacement_keys(
        &self,
        c: &ChannelDoc,
        order: &str,
        key_id: Option<&str>,
    ) -> Result<Option<Vec<Key>>, CallError> {
        eneba::replacement_keys(self, c, order, key_id).await
    }

    /// Issues a G2A access token ([`g2a::issue_token`]).
    pub async fn g2a_token(
        &self,
        name: &str,
        client_id: &str,
        client_secret: &str,
    ) -> Result<(String, u64), CallError> {
        g2a::issue_token(self.store(), name, client_id, client_secret).await
    }

    /// The G2A channel whose access token this is ([`g2a::verify_token`]).
    pub async fn g2a_verify(
        &self,
        name: &str,
        token: Option<&str>,
    ) -> Result<ChannelDoc, CallError> {
        g2a::verify_token(self.store(), name, token).await
    }

    /// Renews a G2A reservation ([`g2a::renew`]).
    pub async fn g2a_renew(
        &self,
        holder: &dyn Holder,
        c: &ChannelDoc,
        rid: &str,
    ) -> Result<DealDoc, CallError> {
        g2a::renew(self, holder, c, rid).await
    }

    /// Releases a G2A reservation ([`g2a::release_reservation`]).
    pub async fn g2a_release(&self, c: &ChannelDoc, rid: &str) -> Result<(), CallError> {
        g2a::release_reservation(self, c, rid).await
    }

    /// Takes back items of a G2A order ([`g2a::return_items`]).
    pub async fn g2a_return(
        &self,
        placer: &dyn Placer,
        c: &ChannelDoc,
        rid: &str,
        ids: &[String],
    ) -> Result<usize, CallError> {
        g2a::return_items(self, placer, c, rid, ids).await
    }

    /// What channel `c` may sell of `product` (of `pool`) now, as it
    /// declares it ([`channels::stock::declarable`]); recorded as the
    /// channel's last declaration when it changed.
    pub async fn channel_declare(
        &self,
        c: &ChannelDoc,
        product: &str,
        pool: &str,
    ) -> Result<u64, StoreError> {
        let n = channels::stock::declarable(self.store(), c, pool).await?;
        if c.declared.get(product) != Some(&(n as i64)) {
            self.store()
                .record_declared(&c.name, product, n as i64)
                .await?;
        }
        Ok(n)
    }
}
