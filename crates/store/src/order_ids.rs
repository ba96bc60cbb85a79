//! The order-id guard: which order an order id names.
//!
//! An order's codes live in its pools' chunks of `codes`, so once `codes`
//! is sharded by pool, the unique `(pool, order_id, order_line,
//! order_repl)` index keeps one code per line only within a pool. One
//! order's lines each draw from one pool, so for the order itself that is
//! the whole rule; but two *different* orders sent under one id (a shop's
//! bug, or a hostile client), naming different pools, would each win their
//! lines in their own pool. The guard closes that: before any write gives
//! codes to an order id, the order's identity (pool, buyer, quantity,
//! owner: what [`codepool_domain::Purchase::conflicts_with`] compares) is
//! written under `_id: order_id`, journaled. The first identity written
//! stays; every later copy of the order reads it back, and a different
//! order is refused as a conflict before it touches a code. A retry of the
//! same order reads its own identity and goes on.
//!
//! An id is bound by the first order that reached the claim, even if that
//! order got nothing (its pool was empty): like an idempotency key, an
//! order id names one order for good.

use std::collections::HashMap;

use bson::{doc, DateTime, Document};
use futures::TryStreamExt;
use serde::{Deserialize, Serialize};

use crate::redemptions::refused_statements;
use crate::{Store, StoreError};

/// The collection: one document per order id that ever reached a claim.
pub const ORDER_IDS: &str = "order_ids";

/// What an order id is bound to: the order's identity.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bound {
    #[serde(rename = "_id")]
    pub order_id: String,
    pub pool: String,
    pub uid: String,
    pub quantity: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// The order's items (pool and count each, in order; one for an
    /// order of one pool). Empty for an id bound from the codes of an
    /// order placed before the guard, whose items were not kept.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub items: Vec<codepool_domain::Item>,
}

/// True for an order id a claim writes under that names no order: a
/// hold's or a bundle's key (they start with a control character no order
/// id holds), bound by construction.
pub fn is_internal_key(order_id: &str) -> bool {
    order_id.starts_with('\u{1}')
}

impl Store {
    /// Binds each order id of `orders` to its identity unless it is bound
    /// already, and returns, aligned with `orders`, the identity each id
    /// is bound to now: the one given, or the one written first.
    /// Journaled before any code moves. Internal keys
    /// ([`is_internal_key`]) are answered as given and not written.
    pub async fn bind_orders(&self, orders: &[Bound]) -> Result<Vec<Bound>, StoreError> {
        let mut out: Vec<Bound> = orders.to_vec();
        let at: Vec<usize> = (0..orders.len())
            .filter(|&i| !is_internal_key(&orders[i].order_id))
            .collect();
        if at.is_empty() {
            return Ok(out);
        }
        let now = DateTime::now();
        let docs: Vec<Document> = (at.iter())
            .map(|&i| {
                let mut d = bson::to_document(&orders[i]).unwrap_or_default();
                d.insert("at", now);
                d
            })
            .collect();
        let reply = self
            .database()
            .run_command(doc! {
                "insert": ORDER_IDS,
                "documents": docs,
                "ordered": false,
                "writeConcern": crate::durable_doc(),
            })
            .await?;
        let taken: Vec<usize> = (refused_statements(&reply)?.into_iter())
            .filter_map(|s| at.get(s).copied())
            .collect();
        if taken.is_empty() {
            return Ok(out);
        }
        let ids: Vec<&str> = taken.iter().map(|&i| orders[i].order_id.as_str()).collect();
        let found: HashMap<String, Bound> = self
            .typed::<Bound>(ORDER_IDS)
            .find(doc! {"_id": {"$in": ids}})
            .await?
            .try_collect::<Vec<Bound>>()
            .await?
            .into_iter()
            .map(|b| (b.order_id.clone(), b))
            .collect();
        for i in taken {
            let id = &orders[i].order_id;
            out[i] = found.get(id).cloned().ok_or_else(|| {
                StoreError::Unavailable(format!(
                    "order id {id} was bound and then not found; try again"
                ))
            })?;
        }
        Ok(out)
    }
}
