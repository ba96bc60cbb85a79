//! The `backorders` collection: purchases that arrived while their pool had
//! no code left. A backorder is fulfilled, oldest first, through the normal
//! claim path when codes arrive; the unique `order_id` index keeps one
//! backorder per order however often the purchase is delivered.

use bson::oid::ObjectId;
use bson::{doc, DateTime};
use codepool_domain::Purchase;
use futures::TryStreamExt;
use mongodb::error::ErrorKind;
use serde::{Deserialize, Serialize};

use crate::error::DUPLICATE_KEY;
use crate::{durable, Store, StoreError};

pub const BACKORDERS: &str = "backorders";
pub const WAITING: &str = "waiting";
pub const FULFILLED: &str = "fulfilled";
/// A backorder whose order a pool policy refused (the per-user limit was
/// set while it waited); see the `refusals` collection.
pub const REFUSED: &str = "refused";

/// A purchase waiting for stock.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BackorderDoc {
    #[serde(rename = "_id")]
    pub id: ObjectId,
    pub order_id: String,
    pub pool: String,
    pub uid: String,
    pub phone: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub purchased_at: Option<String>,
    pub created_at: DateTime,
    pub status: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fulfilled_at: Option<DateTime>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code_id: Option<ObjectId>,
}

impl BackorderDoc {
    pub fn purchase(&self) -> Purchase {
        Purchase {
            order_id: self.order_id.clone(),
            uid: self.uid.clone(),
            phone: self.phone.clone(),
            pool: self.pool.clone(),
            purchased_at: self.purchased_at.clone(),
        }
    }
}

impl Store {
    /// Records purchases as backorders (durably). Orders already backordered
    /// are left as they are. Returns how many new backorders were written.
    pub async fn record_backorders(&self, purchases: &[&Purchase]) -> Result<u64, StoreError> {
        if purchases.is_empty() {
            return Ok(0);
        }
        let now = DateTime::now();
        let docs: Vec<BackorderDoc> = purchases
            .iter()
            .map(|p| BackorderDoc {
                id: ObjectId::new(),
                order_id: p.order_id.clone(),
                pool: p.pool.clone(),
                uid: p.uid.clone(),
                phone: p.phone.clone(),
                purchased_at: p.purchased_at.clone(),
                created_at: now,
                status: WAITING.into(),
                fulfilled_at: None,
                code_id: None,
            })
            .collect();
        let total = docs.len() as u64;
        match self
            .typed::<BackorderDoc>(BACKORDERS)
            .insert_many(docs)
            .ordered(false)
            .write_concern(durable())
            .await
        {
            Ok(r) => Ok(r.inserted_ids.len() as u64),
            Err(e) => {
                let ErrorKind::InsertMany(failure) = e.kind.as_ref() else {
                    return Err(e.into());
                };
                if failure.write_concern_error.is_some() {
                    return Err(StoreError::Unavailable(
                        "backorder write concern not satisfied".into(),
                    ));
                }
                let errors = failure.write_errors.as_deref().unwrap_or_default();
                if let Some(other) = errors.iter().find(|w| w.code != DUPLICATE_KEY) {
                    return Err(StoreError::Rejected(other.message.clone()));
                }
                Ok(total - errors.len() as u64)
            }
        }
    }

    /// Waiting backorders of `pool`, oldest first.
    pub async fn waiting_backorders(
        &self,
        pool: &str,
        limit: i64,
    ) -> Result<Vec<BackorderDoc>, StoreError> {
        Ok(self
            .typed::<BackorderDoc>(BACKORDERS)
            .find(doc! {"status": WAITING, "pool": pool})
            .sort(doc! {"created_at": 1, "_id": 1})
            .limit(limit)
            .await?
            .try_collect()
            .await?)
    }

    /// Pools that have waiting backorders.
    pub async fn pools_with_backorders(&self) -> Result<Vec<String>, StoreError> {
        let values = self
            .collection(BACKORDERS)
            .distinct("pool", doc! {"status": WAITING})
            .await?;
        Ok(values
            .into_iter()
            .filter_map(|v| v.as_str().map(str::to_owned))
            .collect())
    }

    /// Marks backorders fulfilled by the given codes.
    pub async fn mark_backorders_fulfilled(
        &self,
        fulfilled: &[(String, codepool_domain::CodeId)],
    ) -> Result<(), StoreError> {
        let now = DateTime::now();
        for (order_id, code_id) in fulfilled {
            let code_id = crate::codes::object_id(*code_id);
            self.collection(BACKORDERS)
                .update_one(
                    doc! {"order_id": order_id, "status": WAITING},
                    doc! {"$set": {"status": FULFILLED, "fulfilled_at": now, "code_id": code_id}},
                )
                .await?;
        }
        Ok(())
    }

    /// Marks waiting backorders refused by a pool policy.
    pub async fn mark_backorders_refused(&self, order_ids: &[&str]) -> Result<(), StoreError> {
        if order_ids.is_empty() {
            return Ok(());
        }
        self.collection(BACKORDERS)
            .update_many(
                doc! {"order_id": {"$in": order_ids}, "status": WAITING},
                doc! {"$set": {"status": REFUSED, "refused_at": DateTime::now()}},
            )
            .write_concern(durable())
            .await?;
        Ok(())
    }

    /// Backorders by order id (any status).
    pub async fn backorders_for_orders(
        &self,
        order_ids: &[&str],
    ) -> Result<Vec<BackorderDoc>, StoreError> {
        self.find_in(BACKORDERS, "order_id", order_ids).await
    }
}
