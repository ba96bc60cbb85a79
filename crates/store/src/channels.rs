//! The `channels` collection: a channel is one marketplace account of a
//! shop (Eneba, G2A, Kinguin), with the marketplace products it maps to
//! the shop's pools. Beside it, `channel_deals` holds one document per
//! marketplace order (Eneba's `orderId`, G2A's reservation), whose state
//! moves only by conditional writes, and `channel_tokens` the G2A access
//! tokens codepool issued (hashed, gone at their expiry).
//!
//! Documents and queries only; the rules are `codepool_issuance::channels`.

use std::collections::BTreeMap;

use bson::{doc, Binary, DateTime};
use futures::TryStreamExt;
use serde::{Deserialize, Serialize};

use crate::{Store, StoreError};

pub const CHANNELS: &str = "channels";
pub const CHANNEL_DEALS: &str = "channel_deals";
pub const CHANNEL_TOKENS: &str = "channel_tokens";

/// A secret codepool must send out (to the marketplace's API), sealed by
/// the vault under `key_id`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SealedSecret {
    pub key_id: String,
    pub bytes: Binary,
}

/// One channel.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChannelDoc {
    #[serde(rename = "_id")]
    pub name: String,
    /// `eneba`, `g2a` or `kinguin`.
    pub kind: String,
    pub shop: String,
    #[serde(default)]
    pub paused: bool,
    /// SHA-256 (hex) of the secret the marketplace presents to codepool:
    /// Eneba's static bearer, G2A's client secret, Kinguin's webhook
    /// secret. Never the secret.
    pub inbound_hash: String,
    /// G2A's client id (not a secret).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_id: Option<String>,
    /// The secrets codepool sends out, by name, sealed.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub sealed: BTreeMap<String, SealedSecret>,
    /// The marketplace's API base URL, where codepool calls it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_url: Option<String>,
    /// Marketplace product id (auction, product, offer) → pool.
    #[serde(default)]
    pub products: BTreeMap<String, String>,
    /// How long a reservation holds its codes.
    pub hold_ttl_seconds: i64,
    /// What a cancellation after the keys were provided does: `burn`
    /// (void them, answer 200) or `resell` (keep them sold, answer 500: the
    /// marketplace puts the key back in its own stock).
    pub after_provide: String,
    /// How long a G2A access token lives.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_ttl_seconds: Option<i64>,
    /// The channel's cap on each product's declared stock, as a percent
    /// of what its pool has free (`--share`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share_percent: Option<i32>,
    /// The channel's cap on each product's declared stock, in codes
    /// (`--max`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_stock: Option<i64>,
    /// The marketplace's API where codepool declares stock (Eneba's
    /// GraphQL endpoint).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_url: Option<String>,
    /// The marketplace's token endpoint for its API: Eneba's OAuth
    /// (`auth_url`), Kinguin's (`token_url`; `{base_url}/oauth/token`
    /// when none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth_url: Option<String>,
    /// What the channel last declared of each product (told Eneba, or
    /// answered G2A as `inventory_size`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub declared: BTreeMap<String, i64>,
    pub created_at: DateTime,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_at: Option<DateTime>,
}

/// The state of one marketplace order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DealState {
    /// Its hold holds its codes.
    Reserved,
    /// Its order is placed (or being placed): it has its keys.
    Provided,
    /// Cancelled by the marketplace (or its reservation released): it
    /// gets nothing again.
    Cancelled,
}

impl DealState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Reserved => "reserved",
            Self::Provided => "provided",
            Self::Cancelled => "cancelled",
        }
    }
}

/// One line of a deal: a marketplace product, its pool and how many keys.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DealLine {
    pub product: String,
    pub pool: String,
    pub quantity: u32,
}

/// One marketplace order (Eneba) or reservation (G2A).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DealDoc {
    /// [`deal_id`] of the channel and the marketplace's id.
    #[serde(rename = "_id")]
    pub id: String,
    pub channel: String,
    /// The marketplace's id (Eneba `orderId`) or codepool's (G2A
    /// `reservation_id`).
    pub external_id: String,
    pub state: DealState,
    pub lines: Vec<DealLine>,
    /// The hold that holds its codes now (a renewal makes a new one).
    pub hold_id: String,
    /// How many holds it had (renewals).
    #[serde(default)]
    pub holds: u32,
    /// The order its keys went to.
    pub order_id: String,
    /// G2A's order id, once it ordered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub marketplace_order: Option<String>,
    /// Cancelled after its keys were provided.
    #[serde(default)]
    pub cancelled_after_provide: bool,
    /// Keys replaced at the marketplace's request (Eneba's replacement
    /// flow), in the order asked.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replaced: Vec<ReplacedKey>,
    pub created_at: DateTime,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_at: Option<DateTime>,
}

/// A key of a deal replaced at the marketplace's request: the
/// marketplace's id of the key, its product and the order's line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplacedKey {
    pub key_id: String,
    pub product: String,
    pub line: u32,
}

/// The document key of `channel`'s deal `external_id`: a unit separator
/// between them, which neither holds.
pub fn deal_id(channel: &str, external_id: &str) -> String {
    format!("{channel}\u{1f}{external_id}")
}

/// A G2A access token codepool issued, by the SHA-256 of the token.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenDoc {
    #[serde(rename = "_id")]
    pub hash: String,
    pub channel: String,
    pub expires_at: DateTime,
}

impl Store {
    /// Records a new channel; `false` when one of that name exists.
    pub async fn insert_channel(&self, c: &ChannelDoc) -> Result<bool, StoreError> {
        match self.typed::<ChannelDoc>(CHANNELS).insert_one(c).await {
            Ok(_) => Ok(true),
            Err(e) if crate::error::is_duplicate_key(&e) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// One channel.
    pub async fn channel(&self, name: &str) -> Result<Option<ChannelDoc>, StoreError> {
        Ok(self
            .typed::<ChannelDoc>(CHANNELS)
            .find_one(doc! {"_id": name})
            .await?)
    }

    /// Every channel, by name.
    pub async fn channels(&self) -> Result<Vec<ChannelDoc>, StoreError> {
        Ok(self
            .typed::<ChannelDoc>(CHANNELS)
            .find(doc! {})
            .sort(doc! {"_id": 1})
            .await?
            .try_collect()
            .await?)
    }

    /// Maps `product` to `pool` on a channel (in one write); the channel
    /// after, `None` when there is none.
    pub async fn map_channel_product(
        &self,
        name: &str,
        product: &str,
        pool: &str,
    ) -> Result<Option<ChannelDoc>, StoreError> {
        let field = format!("products.{product}");
        Ok(self
            .typed::<ChannelDoc>(CHANNELS)
            .find_one_and_update(
                doc! {"_id": name},
                doc! {"$set": {field: pool, "updated_at": DateTime::now()}},
            )
            .return_document(mongodb::options::ReturnDocument::After)
            .await?)
    }

    /// Pauses or resumes a channel; the channel after.
    pub async fn set_channel_paused(
        &self,
        name: &str,
        paused: bool,
    ) -> Result<Option<ChannelDoc>, StoreError> {
        Ok(self
            .typed::<ChannelDoc>(CHANNELS)
            .find_one_and_update(
                doc! {"_id": name},
                doc! {"$set": {"paused": paused, "updated_at": DateTime::now()}},
            )
            .return_document(mongodb::options::ReturnDocument::After)
            .await?)
    }

    /// Sets a channel's caps on its declared stock (`None`: no cap); the
    /// channel after.
    pub async fn set_channel_caps(
        &self,
        name: &str,
        share_percent: Option<i32>,
        max_stock: Option<i64>,
    ) -> Result<Option<ChannelDoc>, StoreError> {
        let mut set = doc! {"updated_at": DateTime::now()};
        let mut unset = doc! {};
        match share_percent {
            Some(p) => set.insert("share_percent", p),
            None => unset.insert("share_percent", ""),
        };
        match max_stock {
            Some(m) => set.insert("max_stock", m),
            None => unset.insert("max_stock", ""),
        };
        let mut update = doc! {"$set": set};
        if !unset.is_empty() {
            update.insert("$unset", unset);
        }
        Ok(self
            .typed::<ChannelDoc>(CHANNELS)
            .find_one_and_update(doc! {"_id": name}, update)
            .return_document(mongodb::options::ReturnDocument::After)
            .await?)
    }

    /// Records what a channel declared of `product`.
    pub async fn record_declared(
        &self,
        name: &str,
        product: &str,
        declared: i64,
    ) -> Result<(), StoreError> {
        self.collection(CHANNELS)
            .update_one(
                doc! {"_id": name},
                doc! {"$set": {format!("declared.{product}"): declared}},
            )
            .await?;
        Ok(())
    }

    /// Removes a channel and its tokens; whether there was one.
    pub async fn remove_channel(&self, name: &str) -> Result<bool, StoreError> {
        let gone = self
            .collection(CHANNELS)
            .delete_one(doc! {"_id": name})
            .await?;
        self.collection(CHANNEL_TOKENS)
            .delete_many(doc! {"channel": name})
            .await?;
        Ok(gone.deleted_count == 1)
    }

    /// Records a new deal; `false` when the channel has one of that id.
    pub async fn insert_deal(&self, d: &DealDoc) -> Result<bool, StoreError> {
        match self.typed::<DealDoc>(CHANNEL_DEALS).insert_one(d).await {
            Ok(_) => Ok(true),
            Err(e) if crate::error::is_duplicate_key(&e) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// One deal.
    pub async fn deal(
        &self,
        channel: &str,
        external_id: &str,
    ) -> Result<Option<DealDoc>, StoreError> {
        Ok(self
            .typed::<DealDoc>(CHANNEL_DEALS)
            .find_one(doc! {"_id": deal_id(channel, external_id)})
            .await?)
    }

    /// Moves a deal to `to` when it is in one of `from` (and, when given,
    /// its marketplace order is `order` or none yet); the deal as it was
    /// before, `None` when no deal matched.
    pub async fn move_deal(
        &self,
        channel: &str,
        external_id: &str,
        from: &[DealState],
        to: DealState,
        order: Option<&str>,
    ) -> Result<Option<DealDoc>, StoreError> {
        let from: Vec<&str> = from.iter().map(|s| s.as_str()).collect();
        let mut filter = doc! {"_id": deal_id(channel, external_id), "state": {"$in": from}};
        let mut set = doc! {"state": to.as_str(), "updated_at": DateTime::now()};
        if let Some(o) = order {
            filter.insert(
                "$or",
                vec![
                    doc! {"marketplace_order": o},
                    doc! {"marketplace_order": {"$exists": false}},
                ],
            );
            set.insert("marketplace_order", o);
        }
        Ok(self
            .typed::<DealDoc>(CHANNEL_DEALS)
            .find_one_and_update(filter, doc! {"$set": set})
            .await?)
    }

    /// Cancels a deal, whatever its state; the deal as it was before.
    /// `after_provide` is recorded when it had its keys.
    pub async fn cancel_deal(
        &self,
        channel: &str,
        external_id: &str,
    ) -> Result<Option<DealDoc>, StoreError> {
        let before = self
            .typed::<DealDoc>(CHANNEL_DEALS)
            .find_one_and_update(
                doc! {"_id": deal_id(channel, external_id)},
                doc! {"$set": {"state": DealState::Cancelled.as_str(), "updated_at": DateTime::now()}},
            )
            .await?;
        if before
            .as_ref()
            .is_some_and(|d| d.state == DealState::Provided)
        {
            self.collection(CHANNEL_DEALS)
                .update_one(
                    doc! {"_id": deal_id(channel, external_id)},
                    doc! {"$set": {"cancelled_after_provide": true}},
                )
                .await?;
        }
        Ok(before)
    }

    /// Points a reserved deal at a new hold (a renewal); whether it was
    /// still reserved under `old_hold`.
    pub async fn renew_deal(
        &self,
        channel: &str,
        external_id: &str,
        old_hold: &str,
        new_hold: &str,
    ) -> Result<bool, StoreError> {
        let r = self
            .collection(CHANNEL_DEALS)
            .update_one(
                doc! {"_id": deal_id(channel, external_id), "state": DealState::Reserved.as_str(), "hold_id": old_hold},
                doc! {"$set": {"hold_id": new_hold, "updated_at": DateTime::now()}, "$inc": {"holds": 1}},
            )
            .await?;
        Ok(r.modified_count == 1)
    }

    /// Records a replaced key of a deal (once per key id); the deal after.
    pub async fn add_deal_replacement(
        &self,
        channel: &str,
        external_id: &str,
        r: &ReplacedKey,
    ) -> Result<Option<DealDoc>, StoreError> {
        let entry = doc! {"key_id": &r.key_id, "product": &r.product, "line": r.line as i64};
        self.collection(CHANNEL_DEALS)
            .update_one(
                doc! {"_id": deal_id(channel, external_id), "replaced.key_id": {"$ne": &r.key_id}},
                doc! {"$push": {"replaced": entry}, "$set": {"updated_at": DateTime::now()}},
            )
            .await?;
        self.deal(channel, external_id).await
    }

    /// Deals of a channel in `state`, how many.
    pub async fn deals_in(&self, channel: &str, state: DealState) -> Result<u64, StoreError> {
        Ok(self
            .collection(CHANNEL_DEALS)
            .count_documents(doc! {"channel": channel, "state": state.as_str()})
            .await?)
    }

    /// Records an access token (by its hash) of `channel` until `expires_at`.
    pub async fn insert_channel_token(&self, t: &TokenDoc) -> Result<(), StoreError> {
        self.typed::<TokenDoc>(CHANNEL_TOKENS).insert_one(t).await?;
        Ok(())
    }

    /// The access token whose hash is `hash`, if codepool issued it (expired
    /// or not: the caller compares the time).
    pub async fn channel_token(&self, hash: &str) -> Result<Option<TokenDoc>, StoreError> {
        Ok(self
            .typed::<TokenDoc>(CHANNEL_TOKENS)
            .find_one(doc! {"_id": hash})
            .await?)
    }
}
