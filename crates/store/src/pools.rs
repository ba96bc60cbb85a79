//! The `pools` collection: which pools exist and their settings. A pool
//! exists once it has held a code (an import creates it when its first code
//! lands) or once it was created on purpose (`codepool pool create`); a
//! purchase for any other pool is dead-lettered as `unknown_pool`, never
//! backordered forever.

use bson::{doc, DateTime};
use futures::TryStreamExt;
use serde::{Deserialize, Serialize};

use crate::{Store, StoreError};

pub const POOLS: &str = "pools";

/// A pool and its settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoolDoc {
    #[serde(rename = "_id")]
    pub name: String,
    pub created_at: DateTime,
    /// Publish `pool.low_stock` when unissued stock falls below this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub low_stock: Option<i64>,
    /// Prefix of grant numbers for this pool (default `G`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grant_prefix: Option<String>,
    /// Set while stock is below `low_stock` and the alert has been sent.
    #[serde(default)]
    pub low_stock_alerted: bool,
}

impl Store {
    /// Creates the pool if it does not exist yet.
    pub async fn ensure_pool(&self, name: &str) -> Result<(), StoreError> {
        self.create_pool(name).await.map(|_| ())
    }

    /// Creates the pool if it does not exist yet; true when this call
    /// created it.
    pub async fn create_pool(&self, name: &str) -> Result<bool, StoreError> {
        let r = self
            .collection(POOLS)
            .update_one(
                doc! {"_id": name},
                doc! {"$setOnInsert": {"created_at": DateTime::now(), "low_stock_alerted": false}},
            )
            .upsert(true)
            .await?;
        Ok(r.upserted_id.is_some())
    }

    pub async fn pool(&self, name: &str) -> Result<Option<PoolDoc>, StoreError> {
        Ok(self
            .typed::<PoolDoc>(POOLS)
            .find_one(doc! {"_id": name})
            .await?)
    }

    /// The pools of `names` that exist, in one query (a batch's pools).
    pub async fn pools_named(&self, names: &[&str]) -> Result<Vec<PoolDoc>, StoreError> {
        if names.is_empty() {
            return Ok(Vec::new());
        }
        Ok(self
            .typed::<PoolDoc>(POOLS)
            .find(doc! {"_id": {"$in": names}})
            .await?
            .try_collect()
            .await?)
    }

    pub async fn pools(&self) -> Result<Vec<PoolDoc>, StoreError> {
        Ok(self
            .typed::<PoolDoc>(POOLS)
            .find(doc! {})
            .sort(doc! {"_id": 1})
            .await?
            .try_collect()
            .await?)
    }
}
