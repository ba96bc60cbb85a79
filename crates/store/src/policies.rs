//! The per-user limit's database side: `user_quotas` (one document per
//! pool and buyer, listing the orders that hold the buyer's slots, and how
//! many codes they take together) and `refusals` (one document per refused
//! order).
//!
//! An order's slots (one per code it asks for) are taken by ONE
//! conditional update, exactly like a claim: "add this order if it is
//! already there, or if its codes still fit under the limit", so an order
//! is taken whole or refused whole, never cut down, and
//! MongoDB decides, across any number of dispatchers. Slots are never
//! given back (a voided grant still counts), so the decision is stable:
//! an order that was refused stays refused, and its `refusals` record makes
//! a redelivery refused again the same way even if the limit changes.

use std::collections::{HashMap, HashSet};

use bson::{doc, Bson, DateTime, Document};
use codepool_domain::RefusalReason;
use futures::TryStreamExt;
use serde::{Deserialize, Serialize};

use crate::error::{is_transient_code, DUPLICATE_KEY};
use crate::{durable_doc, Store, StoreError};

pub const USER_QUOTAS: &str = "user_quotas";
pub const REFUSALS: &str = "refusals";

/// One purchase asking for a slot of its buyer's quota in a pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuotaAsk<'a> {
    pub pool: &'a str,
    pub uid: &'a str,
    pub order_id: &'a str,
    /// How many codes the order asks for (its quantity).
    pub codes: u32,
    /// The pool's per-user limit, in codes (at least 1).
    pub limit: u32,
}

/// A refused order, as recorded (its `_id` is the order id, so an order is
/// refused at most once).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RefusalDoc {
    #[serde(rename = "_id")]
    pub order_id: String,
    pub pool: String,
    pub uid: String,
    pub reason: RefusalReason,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<i64>,
    pub refused_at: DateTime,
}

/// A buyer's quota in a pool, keyed by the buyer's key (NFKC, case
/// folded), so the case and width variants of a uid share one limit.
fn quota_id(pool: &str, uid: &str) -> Document {
    doc! {"pool": pool, "uid": codepool_domain::buyer_key(uid)}
}

impl Store {
    /// Takes a slot for every ask, in order, and returns the orders that
    /// hold one (now or from before). An order not returned is over its
    /// buyer's limit. Two journaled writes per batch, whatever its size.
    pub async fn take_quota_slots(
        &self,
        asks: &[QuotaAsk<'_>],
    ) -> Result<HashSet<String>, StoreError> {
        if asks.is_empty() {
            return Ok(HashSet::new());
        }
        let mut keys: Vec<Document> = Vec::new();
        for a in asks {
            let id = quota_id(a.pool, a.uid);
            if !keys.contains(&id) {
                keys.push(id);
            }
        }
        // 1. Every quota document exists (an upsert on `_id` alone, which
        //    the server retries itself when two dispatchers race on it).
        let now = DateTime::now();
        let ensure: Vec<Document> = keys
            .iter()
            .map(|id| doc! {"q": {"_id": id.clone()}, "u": {"$setOnInsert": {"orders": [], "created_at": now}}, "upsert": true})
            .collect();
        self.run_updates(USER_QUOTAS, ensure, false).await?;
        // 2. The slots, in delivery order (ordered: the N-th order of a
        //    buyer in this batch sees the N-1 before it). `codes` counts
        //    the codes the orders take; a quota written before quantities
        //    has none, and each of its orders took one.
        let take: Vec<Document> = asks
            .iter()
            .map(|a| {
                let taken = doc! {"$ifNull": ["$codes", {"$size": "$orders"}]};
                // An order id is the buyer's text: never read as a path.
                let held = doc! {"$in": [{"$literal": a.order_id}, "$orders"]};
                let fits = doc! {"$lte": [{"$add": [taken.clone(), i64::from(a.codes)]}, i64::from(a.limit)]};
                doc! {
                    "q": {"_id": quota_id(a.pool, a.uid), "$or": [
                        {"orders": a.order_id},
                        {"$expr": fits},
                    ]},
                    "u": [{"$set": {
                        "codes": {"$cond": [
                            held.clone(),
                            taken.clone(),
                            {"$add": [taken, i64::from(a.codes)]},
                        ]},
                        "orders": {"$cond": [
                            held,
                            "$orders",
                            {"$concatArrays": ["$orders", {"$literal": [a.order_id]}]},
                        ]},
                    }}],
                }
            })
            .collect();
        self.run_updates(USER_QUOTAS, take, true).await?;
        // 3. Who holds a slot, read back (slots are never given back).
        self.slot_holders(keys, asks).await
    }

    /// The codes each buyer took of each pool under its per-user limit
    /// (orders and paid holds), by `(pool, buyer key)`: what a new hold
    /// would be paid against. Reads only; slots are taken by the payment.
    pub async fn quota_taken(
        &self,
        asks: &[(&str, &str)],
    ) -> Result<HashMap<(String, String), u64>, StoreError> {
        let mut keys: Vec<Document> = Vec::new();
        for (pool, uid) in asks {
            let id = quota_id(pool, uid);
            if !keys.contains(&id) {
                keys.push(id);
            }
        }
        let mut out = HashMap::new();
        if keys.is_empty() {
            return Ok(out);
        }
        let batch = crate::one_batch_for(keys.len());
        let mut cursor = self
            .collection(USER_QUOTAS)
            .find(doc! {"_id": {"$in": keys}})
            .batch_size(batch)
            .await?;
        while let Some(d) = cursor.try_next().await? {
            let Ok(id) = d.get_document("_id") else {
                continue;
            };
            let (Ok(pool), Ok(buyer)) = (id.get_str("pool"), id.get_str("uid")) else {
                continue;
            };
            // A quota written before quantities counts one code an order.
            let codes = match d.get("codes") {
                Some(n) => crate::collections::as_u64(Some(n)),
                None => d.get_array("orders").map_or(0, |o| o.len() as u64),
            };
            out.insert((pool.to_owned(), buyer.to_owned()), codes);
        }
        Ok(out)
    }

    /// The orders among `asks` that hold their slot in every quota they
    /// asked (a bundle asks one per pool), read back by quota.
    async fn slot_holders(
        &self,
        keys: Vec<Document>,
        asks: &[QuotaAsk<'_>],
    ) -> Result<HashSet<String>, StoreError> {
        let mut holders: Vec<(Document, HashSet<String>)> = Vec::new();
        let batch = crate::one_batch_for(keys.len());
        let mut cursor = self
            .collection(USER_QUOTAS)
            .find(doc! {"_id": {"$in": keys}})
            .batch_size(batch)
            .await?;
        while let Some(d) = cursor.try_next().await? {
            let (Ok(id), Ok(orders)) = (d.get_document("_id"), d.get_array("orders")) else {
                continue;
            };
            let orders = orders.iter().filter_map(|o| o.as_str().map(str::to_owned));
            holders.push((id.clone(), orders.collect()));
        }
        let holds = |a: &QuotaAsk| {
            let id = quota_id(a.pool, a.uid);
            (holders.iter()).any(|(k, orders)| *k == id && orders.contains(a.order_id))
        };
        let short: HashSet<&str> = (asks.iter().filter(|a| !holds(a)))
            .map(|a| a.order_id)
            .collect();
        Ok(asks
            .iter()
            .filter(|a| !short.contains(a.order_id))
            .map(|a| a.order_id.to_owned())
            .collect())
    }

    /// Records refusals durably. Orders refused before are left as they
    /// were. Returns how many are new.
    pub async fn record_refusals(&self, refusals: &[RefusalDoc]) -> Result<u64, StoreError> {
        if refusals.is_empty() {
            return Ok(0);
        }
        let docs = refusals
            .iter()
            .map(bson::to_document)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| StoreError::Rejected(format!("refusal not serializable: {e}")))?;
        let reply = self
            .database()
            .run_command(doc! {"insert": REFUSALS, "documents": docs, "ordered": false, "writeConcern": durable_doc()})
            .await?;
        let duplicates = write_errors(&reply, true)?;
        Ok(refusals.len() as u64 - duplicates)
    }

    /// The recorded refusals of these orders.
    pub async fn refusals_for_orders(
        &self,
        orders: &[&str],
    ) -> Result<Vec<RefusalDoc>, StoreError> {
        self.find_in(REFUSALS, "_id", orders).await
    }

    /// Refused orders per pool (for `stats`).
    pub async fn refusal_count(&self, pool: &str) -> Result<u64, StoreError> {
        Ok(self
            .collection(REFUSALS)
            .count_documents(doc! {"pool": pool})
            .await?)
    }

    /// One raw `update` command with journaled majority write concern.
    /// Duplicate keys are tolerated only where an upsert raced (`!ordered`).
    async fn run_updates(
        &self,
        collection: &str,
        updates: Vec<Document>,
        ordered: bool,
    ) -> Result<(), StoreError> {
        let reply = self
            .database()
            .run_command(doc! {"update": collection, "updates": updates, "ordered": ordered, "writeConcern": durable_doc()})
            .await?;
        write_errors(&reply, !ordered).map(|_| ())
    }
}

/// Checks a write command's reply: a write-concern error or a transient
/// write error means "retry later"; duplicate keys are counted when
/// `allow_duplicates`, anything else is refused.
fn write_errors(reply: &Document, allow_duplicates: bool) -> Result<u64, StoreError> {
    if let Ok(wce) = reply.get_document("writeConcernError") {
        return Err(StoreError::Unavailable(format!(
            "write concern not satisfied: {}",
            wce.get_str("errmsg").unwrap_or("unknown")
        )));
    }
    let mut duplicates = 0;
    if let Ok(errors) = reply.get_array("writeErrors") {
        for e in errors.iter().filter_map(Bson::as_document) {
            let code = e.get_i32("code").unwrap_or(-1);
            let message = e.get_str("errmsg").unwrap_or("unknown");
            if code == DUPLICATE_KEY && allow_duplicates {
                duplicates += 1;
            } else if is_transient_code(code) {
                return Err(StoreError::Unavailable(message.to_owned()));
            } else {
                return Err(StoreError::Rejected(message.to_owned()));
            }
        }
    }
    Ok(duplicates)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duplicates_are_counted_only_where_allowed_and_other_errors_refuse() {
        let dup =
            doc! {"n": 1, "writeErrors": [{"index": 0, "code": DUPLICATE_KEY, "errmsg": "E11000"}]};
        assert_eq!(write_errors(&dup, true).unwrap(), 1);
        assert!(matches!(
            write_errors(&dup, false),
            Err(StoreError::Rejected(_))
        ));
        let wce = doc! {"n": 1, "writeConcernError": {"code": 64, "errmsg": "waiting"}};
        assert!(write_errors(&wce, true).unwrap_err().is_unavailable());
        assert_eq!(write_errors(&doc! {"n": 3}, false).unwrap(), 0);
    }
}
