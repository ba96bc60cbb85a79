//! The `shops` collection: a shop is a name and the pools it may order
//! from (`*`: every pool). A shop's API keys and the purchases that name
//! it act on the shop's own pools and orders only.

use bson::{doc, DateTime};
use futures::TryStreamExt;
use serde::{Deserialize, Serialize};

use crate::{Store, StoreError};

pub const SHOPS: &str = "shops";

/// The pool list that means every pool.
pub const EVERY_POOL: &str = "*";

/// One shop.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShopDoc {
    #[serde(rename = "_id")]
    pub name: String,
    /// The pools the shop orders from, sorted; `["*"]` for every pool.
    pub pools: Vec<String>,
    pub created_at: DateTime,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_at: Option<DateTime>,
    /// The broker users that may publish purchases for the shop over AMQP
    /// (RabbitMQ checks a message's `user_id` against the user that
    /// published it); none: no AMQP purchase may name the shop.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub broker_users: Vec<String>,
}

impl ShopDoc {
    /// Whether the shop may order from `pool`.
    pub fn allows(&self, pool: &str) -> bool {
        self.pools.iter().any(|p| p == EVERY_POOL || p == pool)
    }

    /// Whether the shop orders from every pool.
    pub fn every_pool(&self) -> bool {
        self.pools.iter().any(|p| p == EVERY_POOL)
    }
}

/// `text` as a regular expression that matches it literally.
fn regex_literal(text: &str) -> String {
    text.chars()
        .flat_map(|c| {
            let escape = !c.is_ascii_alphanumeric();
            escape.then_some('\\').into_iter().chain(std::iter::once(c))
        })
        .collect()
}

impl Store {
    /// Creates a shop; `false` when one of that name exists already (it is
    /// left as it is).
    ///
    /// Names are unique without regard to case: `acme` and `ACME` are one
    /// shop (the unique `name_key` of migration 0018; shops made before it
    /// are looked up by a case-blind match).
    pub async fn create_shop(&self, name: &str, pools: &[String]) -> Result<bool, StoreError> {
        let key = name.to_ascii_lowercase();
        let older = doc! {"_id": {"$regex": format!("^{}$", regex_literal(name)), "$options": "i"}};
        if self.collection(SHOPS).find_one(older).await?.is_some() {
            return Ok(false);
        }
        let new =
            doc! {"_id": name, "name_key": key, "pools": pools, "created_at": DateTime::now()};
        match self.collection(SHOPS).insert_one(new).await {
            Ok(_) => Ok(true),
            Err(e) if crate::error::is_duplicate_key(&e) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Replaces the broker users that may publish for a shop; the shop
    /// after, `None` when there is no such shop.
    pub async fn set_shop_broker_users(
        &self,
        name: &str,
        users: &[String],
    ) -> Result<Option<ShopDoc>, StoreError> {
        Ok(self
            .typed::<ShopDoc>(SHOPS)
            .find_one_and_update(
                doc! {"_id": name},
                doc! {"$set": {"broker_users": users, "updated_at": DateTime::now()}},
            )
            .return_document(mongodb::options::ReturnDocument::After)
            .await?)
    }

    /// Replaces a shop's pools; the shop after, `None` when there is no
    /// such shop.
    pub async fn set_shop_pools(
        &self,
        name: &str,
        pools: &[String],
    ) -> Result<Option<ShopDoc>, StoreError> {
        Ok(self
            .typed::<ShopDoc>(SHOPS)
            .find_one_and_update(
                doc! {"_id": name},
                doc! {"$set": {"pools": pools, "updated_at": DateTime::now()}},
            )
            .return_document(mongodb::options::ReturnDocument::After)
            .await?)
    }

    /// One shop.
    pub async fn shop(&self, name: &str) -> Result<Option<ShopDoc>, StoreError> {
        Ok(self
            .typed::<ShopDoc>(SHOPS)
            .find_one(doc! {"_id": name})
            .await?)
    }

    /// The shops named in `names`, in one read.
    pub async fn shops_named(&self, names: &[&str]) -> Result<Vec<ShopDoc>, StoreError> {
        if names.is_empty() {
            return Ok(Vec::new());
        }
        Ok(self
            .typed::<ShopDoc>(SHOPS)
            .find(doc! {"_id": {"$in": names}})
            .await?
            .try_collect()
            .await?)
    }

    /// Every shop, by name.
    pub async fn shops(&self) -> Result<Vec<ShopDoc>, StoreError> {
        Ok(self
            .typed::<ShopDoc>(SHOPS)
            .find(doc! {})
            .sort(doc! {"_id": 1})
            .await?
            .try_collect()
            .await?)
    }
}
