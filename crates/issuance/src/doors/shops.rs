//! Shops and their webhook endpoints as the doors read and change them.

use crate::audit::Actor;
use crate::model::{AttemptDoc, EndpointDoc, ShopDoc};
use crate::shops::{self, ShopError};
use crate::webhooks::{self, Added, Replayed, WebhookError};
use crate::{Core, StoreError};

/// What a replay asks for: an event id or a time
/// ([`webhooks::replay_scope`]).
pub use codepool_store::webhooks::ReplayScope;

impl Core {
    /// Every shop, by name.
    pub async fn shops(&self) -> Result<Vec<ShopDoc>, StoreError> {
        self.store().shops().await
    }

    /// One shop.
    pub async fn shop(&self, name: &str) -> Result<Option<ShopDoc>, StoreError> {
        self.store().shop(name).await
    }

    /// Creates a shop ([`shops::create`]).
    pub async fn create_shop(
        &self,
        name: &str,
        pools: &[String],
        actor: &Actor,
    ) -> Result<ShopDoc, ShopError> {
        shops::create(self.store(), name, pools, actor).await
    }

    /// Replaces a shop's pools ([`shops::set_pools`]).
    pub async fn set_shop_pools(
        &self,
        name: &str,
        pools: &[String],
        actor: &Actor,
    ) -> Result<ShopDoc, ShopError> {
        shops::set_pools(self.store(), name, pools, actor).await
    }

    /// The webhook endpoints of a shop, or of every shop.
    pub async fn webhook_endpoints(
        &self,
        shop: Option<&str>,
    ) -> Result<Vec<EndpointDoc>, StoreError> {
        self.store().webhook_endpoints(shop).await
    }

    /// One endpoint, if it is the shop's ([`webhooks::endpoint`]).
    pub async fn webhook_endpoint(
        &self,
        id: &str,
        shop: Option<&str>,
    ) -> Result<EndpointDoc, WebhookError> {
        webhooks::endpoint(self.store(), id, shop).await
    }

    /// The latest delivery attempts of a shop or of one endpoint
    /// ([`webhooks::deliveries`]).
    pub async fn webhook_deliveries(
        &self,
        shop: Option<&str>,
        endpoint: Option<&str>,
        limit: i64,
    ) -> Result<Vec<AttemptDoc>, WebhookError> {
        webhooks::deliveries(self.store(), shop, endpoint, limit).await
    }

    /// Adds an endpoint to a shop, its address checked against the hosts
    /// this process lets through ([`webhooks::add`]).
    pub async fn add_webhook(
        &self,
        shop: &str,
        url: &str,
        events: &str,
        actor: &Actor,
    ) -> Result<Added, WebhookError> {
        webhooks::add(self.store(), shop, url, events, self.allow_hosts(), actor).await
    }

    /// Enables or disables an endpoint ([`webhooks::set_enabled`]).
    pub async fn set_webhook_enabled(
        &self,
        id: &str,
        enabled: bool,
        actor: &Actor,
    ) -> Result<EndpointDoc, WebhookError> {
        webhooks::set_enabled(self.store(), id, enabled, actor).await
    }

    /// Gives an endpoint a new secret ([`webhooks::rotate_secret`]).
    pub async fn rotate_webhook_secret(
        &self,
        id: &str,
        actor: &Actor,
    ) -> Result<String, WebhookError> {
        webhooks::rotate_secret(self.store(), id, actor).await
    }

    /// Makes a shop's events due again ([`webhooks::replay`]).
    pub async fn replay_webhooks(
        &self,
        shop: &str,
        scope: &ReplayScope,
        endpoint: Option<&str>,
        include_before_endpoint: bool,
        actor: &Actor,
    ) -> Result<Replayed, WebhookError> {
        webhooks::replay(
            self.store(),
            shop,
            scope,
            endpoint,
            include_before_endpoint,
            actor,
        )
        .await
    }
}
