//! The `api_keys` collection: a key's name, scopes, shop and the SHA-256
//! of its secret (never the secret). Making, checking and revoking keys,
//! and what is audited, are the core's (`codepool_issuance::api_keys`);
//! this module only reads and writes the documents.

use bson::{doc, DateTime};
use futures::TryStreamExt;
use serde::{Deserialize, Serialize};

use crate::{Store, StoreError};

pub const API_KEYS: &str = "api_keys";

/// What a key may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Scope {
    /// Place orders (`POST /v1/orders`); the answer carries their codes.
    #[serde(rename = "orders:write")]
    OrdersWrite,
    /// Read orders, codes masked; redeem, void and resend them.
    #[serde(rename = "orders:read")]
    OrdersRead,
    /// See codes in plaintext when reading an order (every reveal is
    /// audited with the key's name).
    #[serde(rename = "codes:reveal")]
    CodesReveal,
    /// Administer pools, imports and dead letters.
    #[serde(rename = "admin")]
    Admin,
    /// Check and redeem codes by value (`/v1/codes/check`,
    /// `/v1/codes/redeem`): the key of the platform that honours the
    /// codes, for every pool or for its shop's.
    #[serde(rename = "codes:redeem")]
    CodesRedeem,
}

impl Scope {
    pub const ALL: [Scope; 5] = [
        Scope::OrdersWrite,
        Scope::OrdersRead,
        Scope::CodesReveal,
        Scope::Admin,
        Scope::CodesRedeem,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Scope::OrdersWrite => "orders:write",
            Scope::OrdersRead => "orders:read",
            Scope::CodesReveal => "codes:reveal",
            Scope::Admin => "admin",
            Scope::CodesRedeem => "codes:redeem",
        }
    }

    pub fn parse(s: &str) -> Option<Scope> {
        Scope::ALL.into_iter().find(|x| x.as_str() == s.trim())
    }
}

/// A key as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KeyDoc {
    #[serde(rename = "_id")]
    pub id: String,
    pub name: String,
    /// Hex SHA-256 of the secret.
    pub hash: String,
    pub scopes: Vec<Scope>,
    pub created_at: DateTime,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revoked_at: Option<DateTime>,
    /// The shop the key belongs to: it acts on the shop's pools and orders
    /// only. `None`: the operator's key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shop: Option<String>,
}

impl KeyDoc {
    pub fn allows(&self, scope: Scope) -> bool {
        self.revoked_at.is_none() && self.scopes.contains(&scope)
    }

    /// The owner recorded with the orders this key places: its shop's
    /// (`shop:NAME`, as every door records a shop's orders), or the key's
    /// own id (not its name, which a new key may take once the old one is
    /// revoked).
    pub fn owner(&self) -> String {
        match &self.shop {
            Some(shop) => format!("{}{shop}", crate::codes::SHOP_OWNER_PREFIX),
            None => format!("api-key-id:{}", self.id),
        }
    }
}

impl Store {
    /// The key named `name` that is not revoked, if any.
    pub async fn live_api_key(&self, name: &str) -> Result<Option<KeyDoc>, StoreError> {
        let live = doc! {"name": name, "revoked_at": {"$exists": false}};
        Ok(self.typed::<KeyDoc>(API_KEYS).find_one(live).await?)
    }

    /// The key of id `id`, revoked or not.
    pub async fn api_key(&self, id: &str) -> Result<Option<KeyDoc>, StoreError> {
        Ok(self
            .typed::<KeyDoc>(API_KEYS)
            .find_one(doc! {"_id": id})
            .await?)
    }

    /// Stores a new key.
    pub async fn insert_api_key(&self, key: &KeyDoc) -> Result<(), StoreError> {
        self.typed::<KeyDoc>(API_KEYS).insert_one(key).await?;
        Ok(())
    }

    /// Every key, newest first.
    pub async fn api_keys(&self) -> Result<Vec<KeyDoc>, StoreError> {
        Ok(self
            .typed::<KeyDoc>(API_KEYS)
            .find(doc! {})
            .sort(doc! {"created_at": -1})
            .await?
            .try_collect()
            .await?)
    }

    /// Revokes the live key named `name` now; the key after, `None` when
    /// no live key has that name.
    pub async fn revoke_api_key(&self, name: &str) -> Result<Option<KeyDoc>, StoreError> {
        let live = doc! {"name": name, "revoked_at": {"$exists": false}};
        Ok(self
            .typed::<KeyDoc>(API_KEYS)
            .find_one_and_update(live, doc! {"$set": {"revoked_at": DateTime::now()}})
            .return_document(mongodb::options::ReturnDocument::After)
            .await?)
    }
}
