//! The `backorders` collection: purchases that arrived while their pool had
//! no code left. A backorder is fulfilled, oldest first, through the normal
//! claim path when codes arrive; the unique `order_id` index keeps one
//! backorder per order however often the purchase is delivered. An order of
//! several codes that got some of them waits for the rest: its backorder
//! lists the lines still without a code.

use bson::oid::ObjectId;
use bson::{doc, DateTime};
use codepool_domain::Purchase;
use futures::TryStreamExt;
use mongodb::error::ErrorKind;
use serde::{Deserialize, Serialize};

use crate::error::DUPLICATE_KEY;
use crate::{durable, Store, StoreError};

pub const BACKORDERS: &str = "backorders";

/// A backorder's state, stored by name: it waits, then ends once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackorderState {
    /// Waiting for stock.
    Waiting,
    /// Every line it waited for has its code.
    Fulfilled,
    /// A pool policy refused its order (the per-user limit was set while
    /// it waited); see the `refusals` collection.
    Refused,
    /// Withdrawn before it was fulfilled (the order was voided: a refund).
    Cancelled,
}

impl BackorderState {
    /// The name stored and shown.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Waiting => "waiting",
            Self::Fulfilled => "fulfilled",
            Self::Refused => "refused",
            Self::Cancelled => "cancelled",
        }
    }
}

impl std::fmt::Display for BackorderState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

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
    pub status: BackorderState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fulfilled_at: Option<DateTime>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code_id: Option<ObjectId>,
    /// The order's quantity; absent for 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantity: Option<i64>,
    /// The lines still waiting for a code, ascending; absent for every line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lines: Option<Vec<i64>>,
    /// Who placed the order (`api-key-id:ID`); absent for one over AMQP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// A bundle's items (`pool` is its first item's): it waits whole.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub items: Vec<codepool_domain::Item>,
}

impl BackorderDoc {
    pub fn purchase(&self) -> Purchase {
        Purchase {
            order_id: self.order_id.clone(),
            uid: self.uid.clone(),
            phone: self.phone.clone(),
            pool: self.pool.clone(),
            purchased_at: self.purchased_at.clone(),
            quantity: self.quantity(),
            owner: self.owner.clone(),
            // A shop's order is owned by the shop (`shop:NAME`).
            shop: (self.owner.as_deref())
                .and_then(|o| o.strip_prefix(crate::codes::SHOP_OWNER_PREFIX))
                .map(str::to_owned),
            hold_id: None,
            items: self.items.clone(),
        }
    }

    pub fn quantity(&self) -> u32 {
        self.quantity
            .and_then(|q| u32::try_from(q).ok())
            .unwrap_or(1)
            .clamp(1, codepool_domain::MAX_QUANTITY)
    }

    /// The lines of the order still waiting for a code.
    pub fn waiting_lines(&self) -> Vec<u32> {
        let q = self.quantity();
        match &self.lines {
            Some(lines) => lines
                .iter()
                .filter_map(|&l| u32::try_from(l).ok())
                .filter(|&l| l < q)
                .collect(),
            None => (0..q).collect(),
        }
    }
}

/// A purchase to record as a backorder, and the lines it still needs.
#[derive(Debug, Clone, Copy)]
pub struct Waiting<'a> {
    pub purchase: &'a Purchase,
    pub lines: &'a [u32],
}

/// What [`Store::record_backorders`] did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Recorded {
    /// New backorders written.
    pub new: u64,
    /// Orders whose id already had a backorder of a different order (pool,
    /// buyer or quantity), with what differs: the first order stands.
    pub conflicts: Vec<(String, &'static str)>,
}

/// Lines as stored: absent when they are every line of the order.
fn stored_lines(lines: &[u32], quantity: u32) -> Option<Vec<i64>> {
    let every = lines.len() == quantity as usize && lines.iter().copied().eq(0..quantity);
    (!every).then(|| lines.iter().map(|&l| i64::from(l)).collect())
}

impl Store {
    /// Records purchases as backorders (durably). Orders already backordered
    /// are left as they are; those whose backorder is of another order are
    /// reported as conflicts.
    pub async fn record_backorders(&self, waiting: &[Waiting<'_>]) -> Result<Recorded, StoreError> {
        let new = self.insert_backorders(waiting).await?;
        let mut out = Recorded {
            new,
            conflicts: Vec::new(),
        };
        if new == waiting.len() as u64 {
            return Ok(out);
        }
        let orders: Vec<&str> = waiting
            .iter()
            .map(|w| w.purchase.order_id.as_str())
            .collect();
        for existing in self.backorders_for_orders(&orders).await? {
            for w in waiting
                .iter()
                .filter(|w| w.purchase.order_id == existing.order_id)
            {
                if let Some(what) =
                    w.purchase
                        .differs_from(&existing.pool, &existing.uid, existing.quantity())
                {
                    out.conflicts.push((existing.order_id.clone(), what));
                }
            }
        }
        Ok(out)
    }

    /// Inserts the backorders; returns how many were new.
    async fn insert_backorders(&self, waiting: &[Waiting<'_>]) -> Result<u64, StoreError> {
        if waiting.is_empty() {
            return Ok(0);
        }
        let now = DateTime::now();
        let docs: Vec<BackorderDoc> = waiting
            .iter()
            .map(|&Waiting { purchase: p, lines }| BackorderDoc {
                id: ObjectId::new(),
                order_id: p.order_id.clone(),
                pool: p.pool.clone(),
                uid: p.uid.clone(),
                phone: p.phone.clone(),
                purchased_at: p.purchased_at.clone(),
                created_at: now,
                status: BackorderState::Waiting,
                fulfilled_at: None,
                code_id: None,
                quantity: (p.quantity > 1).then_some(i64::from(p.quantity)),
                lines: stored_lines(lines, p.quantity),
                owner: p.owner.clone(),
                items: p.items.clone(),
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
            .find(doc! {"status": BackorderState::Waiting.as_str(), "pool": pool})
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
            .distinct("pool", doc! {"status": BackorderState::Waiting.as_str()})
            .await?;
        Ok(values
            .into_iter()
            .filter_map(|v| v.as_str().map(str::to_owned))
            .collect())
    }

    /// Records what a fulfilment got for waiting backorders: per order,
    /// the lines still without a code. None left: fulfilled. Some: it keeps
    /// waiting for those.
    pub async fn settle_backorders(&self, settled: &[(&str, Vec<u32>)]) -> Result<(), StoreError> {
        let now = DateTime::now();
        for (order_id, missing) in settled {
            let update = if missing.is_empty() {
                doc! {"$set": {"status": BackorderState::Fulfilled.as_str(), "fulfilled_at": now}}
            } else {
                let lines: Vec<i64> = missing.iter().map(|&l| i64::from(l)).collect();
                doc! {"$set": {"lines": lines}}
            };
            self.collection(BACKORDERS)
                .update_one(
                    doc! {"order_id": *order_id, "status": BackorderState::Waiting.as_str()},
                    update,
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
                doc! {"order_id": {"$in": order_ids}, "status": BackorderState::Waiting.as_str()},
                doc! {"$set": {"status": BackorderState::Refused.as_str(), "refused_at": DateTime::now()}},
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

    /// Withdraws a waiting backorder so it is never fulfilled. Returns
    /// false when the order has no waiting backorder.
    pub async fn cancel_backorder(&self, order_id: &str, reason: &str) -> Result<bool, StoreError> {
        let r = self
            .collection(BACKORDERS)
            .update_one(
                doc! {"order_id": order_id, "status": BackorderState::Waiting.as_str()},
                doc! {"$set": {"status": BackorderState::Cancelled.as_str(), "cancelled_at": DateTime::now(), "cancel_reason": reason}},
            )
            .write_concern(durable())
            .await?;
        Ok(r.modified_count == 1)
    }
}
