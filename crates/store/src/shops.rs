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

impl Store {
    /// Creates a shop; `false` when one of that name exists already (it is
    /// left as it is).
    pub async fn create_shop(&self, name: &str, pools: &[String]) -> Result<bool, StoreError> {
        let r = self
            .collection(SHOPS)
            .update_one(
                doc! {"_id": name},
                doc! {"$setOnInsert": {"pools": pools, "created_at": DateTime::now()}},
            )
            .upsert(true)
            .await?;
        Ok(r.upserted_id.is_some())
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
