//! The `holds` collection and the held codes behind it. A checkout hold
//! (or a bundle being put together) claims its codes through the same
//! batched claim as an order, but `held` (status 4) and under a key of its
//! own in `order_id` ([`hold_key`]): the unique `(order_id, line)` index
//! keeps a retried hold from taking a line twice, exactly as it does for
//! orders. A held code then either becomes an order's
//! ([`Store::commit_held`], 4→1) or goes back to stock
//! ([`Store::release_held`], 4→0); both are conditional on the code still
//! being held under that key, so a commit and an expiry racing for one
//! code give it to exactly one of them.

use std::collections::HashMap;

use bson::oid::ObjectId;
use bson::{doc, DateTime};
use codepool_domain::{CodeId, CodeStatus, Item, Transition};
use futures::TryStreamExt;
use serde::{Deserialize, Serialize};

use crate::codes::{claim::merge_statement, code_id, object_id, CODES};
use crate::moves::StatusWrite;
use crate::{durable, ClaimAssignment, Store, StoreError};

pub const HOLDS: &str = "holds";
pub use codepool_domain::gate::{HoldEnd, HoldState};
/// The field of a hold that lists the codes a recall or their expiry
/// voided while it held them ([`Store::note_voided_while_held`]).
pub const VOIDED_CODES: &str = "voided_codes";
/// A hold whose codes are held, as stored.
const HELD: &str = "held";

/// One hold.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HoldDoc {
    /// The document's key: the hold id, unless another owner's hold took
    /// that first, then [`doc_id`] of the owner and the hold id. Holds are
    /// looked up by owner and hold id; this key only names the document
    /// found.
    #[serde(rename = "_id")]
    pub id: String,
    /// The id its owner gave it. Each owner's own: one owner's holds have
    /// distinct ids (the unique `hold_id_owner` index), two owners' holds
    /// may share one.
    pub hold_id: String,
    pub uid: String,
    /// The buyer's key ([`codepool_domain::buyer_key`] of `uid`): every
    /// per-buyer cap counts by it.
    #[serde(default)]
    pub buyer: String,
    pub items: Vec<Item>,
    /// The key (`api-key-id:ID`) or shop (`shop:NAME`) that placed it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    pub ttl_seconds: i64,
    pub created_at: DateTime,
    pub expires_at: DateTime,
    pub state: HoldState,
    /// The order that paid for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub order_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_at: Option<DateTime>,
    /// This attempt's own: its codes are held under keys that name it, so
    /// a process that loses the race to record the same hold id holds
    /// nothing under the winner's keys.
    #[serde(default)]
    pub nonce: String,
    /// Made by a bundle's own claim, not by a buyer: it counts against no
    /// buyer's holds and is never shown.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub bundle: bool,
}

impl HoldDoc {
    /// The keys its items' codes are held under, item by item.
    pub fn keys(&self) -> Vec<String> {
        (0..self.items.len())
            .map(|i| hold_key(&format!("{}:{}", self.nonce, self.hold_id), i))
            .collect()
    }

    /// How many codes it holds in all.
    pub fn quantity(&self) -> u32 {
        self.items.iter().map(|i| i.quantity).sum()
    }

    /// The codes it takes from `pool`.
    pub fn quantity_in(&self, pool: &str) -> u32 {
        self.items
            .iter()
            .filter(|i| i.pool == pool)
            .map(|i| i.quantity)
            .sum()
    }
}

/// The document key of `owner`'s hold `hold_id` when another owner's hold
/// has the plain id: the owner, a unit separator (which no hold id holds,
/// so no plain id is ever one) and the hold id.
pub fn doc_id(owner: Option<&str>, hold_id: &str) -> String {
    format!("{}\u{1f}{hold_id}", owner.unwrap_or_default())
}

/// The hold id a document key names ([`doc_id`]'s, or the plain id): a
/// write names it beside the key, as the shard key of `holds` starts with
/// it (docs/scaling.md).
pub fn hold_id_of(doc_key: &str) -> &str {
    doc_key.split_once('\u{1f}').map_or(doc_key, |(_, id)| id)
}

/// The `order_id` under which item `item` of hold `hold_id` holds its
/// codes. It starts with a control character, which no order id may
/// hold, so no order can ever be mistaken for a hold.
pub fn hold_key(hold_id: &str, item: usize) -> String {
    format!("{HOLD_PREFIX}{item}:{hold_id}")
}

/// How a hold's keys begin.
const HOLD_PREFIX: &str = codepool_domain::HOLD_KEY_PREFIX;

/// How a bundle's keys begin.
const BUNDLE_PREFIX: &str = codepool_domain::BUNDLE_KEY_PREFIX;

/// The key under which item `item` of bundle order `order_id` holds its
/// codes until the bundle is whole.
pub fn bundle_key(order_id: &str, item: usize) -> String {
    format!("{BUNDLE_PREFIX}{item}:{order_id}")
}

/// Of the codes a sweep read (`_id`, `status`, `order_id`), those held,
/// with the key they are held under.
pub(crate) fn was_held(found: &[bson::Document]) -> Vec<(ObjectId, String)> {
    (found.iter())
        .filter(|d| d.get_i32("status") == Ok(CodeStatus::Held.as_i32()))
        .filter_map(|d| {
            Some((
                d.get_object_id("_id").ok()?,
                d.get_str("order_id").ok()?.to_owned(),
            ))
        })
        .collect()
}

/// A held code, to go back to stock or to an order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldCode {
    pub id: CodeId,
    pub pool: String,
    pub seq: i64,
    /// Its line within its item.
    pub line: u32,
    /// The key it is held under.
    pub key: String,
}

#[derive(Deserialize)]
struct HeldDoc {
    #[serde(rename = "_id")]
    id: ObjectId,
    pool: String,
    seq: i64,
    order_id: String,
    #[serde(default)]
    order_line: Option<i64>,
}

impl Store {
    /// Records new holds (durably), one journaled write (two when hold ids
    /// are shared), before anything is claimed for them, so a process that
    /// dies mid-claim leaves codes that expire with them. Each is recorded
    /// under its plain hold id, or, when another owner's hold has that
    /// key, under [`doc_id`]. Returns, aligned with `holds`, the key each
    /// was recorded under, or `None` when its owner already has a hold of
    /// that id (another process recorded it first).
    pub async fn insert_holds(&self, holds: &[HoldDoc]) -> Result<Vec<Option<String>>, StoreError> {
        let mut keys: Vec<Option<String>> = holds.iter().map(|h| Some(h.id.clone())).collect();
        let taken = self.insert_holds_once(holds).await?;
        if taken.is_empty() {
            return Ok(keys);
        }
        // The plain id was taken: by another owner's hold (then this one
        // goes under its compound key), or by the owner's own hold of that
        // id (then the compound key is refused too, by the owner index).
        let again: Vec<HoldDoc> = (taken.iter())
            .map(|&k| HoldDoc {
                id: doc_id(holds[k].owner.as_deref(), &holds[k].hold_id),
                ..holds[k].clone()
            })
            .collect();
        let lost = self.insert_holds_once(&again).await?;
        for (n, &k) in taken.iter().enumerate() {
            keys[k] = (!lost.contains(&n)).then(|| again[n].id.clone());
        }
        Ok(keys)
    }

    /// Inserts `holds` unordered; returns the positions refused as
    /// duplicates.
    async fn insert_holds_once(&self, holds: &[HoldDoc]) -> Result<Vec<usize>, StoreError> {
        if holds.is_empty() {
            return Ok(Vec::new());
        }
        match self
            .typed::<HoldDoc>(HOLDS)
            .insert_many(holds)
            .ordered(false)
            .write_concern(durable())
            .await
        {
            Ok(_) => Ok(Vec::new()),
            Err(e) => Ok(crate::error::duplicates_only(e)?
                .iter()
                .map(|w| w.index)
                .collect()),
        }
    }

    /// `owner`'s hold `hold_id` (`None`: a hold of no owner).
    pub async fn hold(
        &self,
        owner: Option<&str>,
        hold_id: &str,
    ) -> Result<Option<HoldDoc>, StoreError> {
        Ok(self
            .typed::<HoldDoc>(HOLDS)
            .find_one(doc! {"hold_id": hold_id, "owner": owner})
            .await?)
    }

    /// The hold whose code is held (or was, if voided while held) under
    /// `key` (a code's `order_id`, one of [`HoldDoc::keys`]); `None` for
    /// an order's id, a bundle's key, or a hold forgotten since.
    pub async fn hold_of_key(&self, key: &str) -> Result<Option<HoldDoc>, StoreError> {
        let Some(codepool_domain::SetAside::Hold { hold_id }) =
            codepool_domain::SetAside::of_key(key)
        else {
            return Ok(None);
        };
        Ok((self.holds_named(&[hold_id.as_str()]).await?.into_iter())
            .find(|h| h.keys().iter().any(|k| k == key)))
    }

    /// The hold recorded under document key `id` ([`HoldDoc::id`]).
    pub async fn hold_by_key(&self, id: &str) -> Result<Option<HoldDoc>, StoreError> {
        Ok(self
            .typed::<HoldDoc>(HOLDS)
            .find_one(doc! {"_id": id})
            .await?)
    }

    /// Forgets holds that held nothing (short stock, or a failed batch):
    /// the same requests may be made again later. Each attempt's own
    /// (its nonce), whatever key it was recorded under.
    pub async fn forget_holds(&self, holds: &[&HoldDoc]) -> Result<(), StoreError> {
        if holds.is_empty() {
            return Ok(());
        }
        let ids: Vec<&str> = holds.iter().map(|h| h.hold_id.as_str()).collect();
        let nonces: Vec<&str> = holds.iter().map(|h| h.nonce.as_str()).collect();
        self.collection(HOLDS)
            .delete_many(doc! {"hold_id": {"$in": ids}, "nonce": {"$in": nonces}, "state": HELD})
            .write_concern(durable())
            .await?;
        Ok(())
    }

    /// These buyers' open holds (not bundles'), by buyer key: the holds of
    /// every case and width variant of each uid.
    pub async fn open_holds_of_many(&self, uids: &[&str]) -> Result<Vec<HoldDoc>, StoreError> {
        let buyers: Vec<String> = uids.iter().map(|u| codepool_domain::buyer_key(u)).collect();
        Ok(self
            .typed::<HoldDoc>(HOLDS)
            .find(doc! {"buyer": {"$in": buyers}, "state": HELD, "bundle": {"$ne": true}})
            .await?
            .try_collect()
            .await?)
    }

    /// The codes these owners (keys and shops) hold in open holds (not
    /// bundles'), per `(owner, pool)`, for these pools: summed by the
    /// server, so a shop with thousands of open holds costs a batch one
    /// reply of a few sums, not all of its holds.
    pub async fn held_by_owners(
        &self,
        owners: &[&str],
        pools: &[&str],
    ) -> Result<HashMap<(String, String), u64>, StoreError> {
        if owners.is_empty() || pools.is_empty() {
            return Ok(HashMap::new());
        }
        let pipeline = vec![
            doc! {"$match": {
                "owner": {"$in": owners}, "state": HELD, "bundle": {"$ne": true},
                "items.pool": {"$in": pools},
            }},
            doc! {"$unwind": "$items"},
            doc! {"$match": {"items.pool": {"$in": pools}}},
            doc! {"$group": {
                "_id": {"owner": "$owner", "pool": "$items.pool"},
                "n": {"$sum": "$items.quantity"},
            }},
        ];
        let mut held = HashMap::new();
        let mut cursor = self.collection(HOLDS).aggregate(pipeline).await?;
        while let Some(d) = cursor.try_next().await? {
            let id = d.get_document("_id").ok();
            let field = |f: &str| id.and_then(|i| i.get_str(f).ok()).map(str::to_owned);
            if let (Some(owner), Some(pool)) = (field("owner"), field("pool")) {
                held.insert((owner, pool), crate::collections::as_u64(d.get("n")));
            }
        }
        Ok(held)
    }

    /// A buyer's latest holds, any state, newest first (not bundles').
    pub async fn holds_of_uid(&self, uid: &str, most: i64) -> Result<Vec<HoldDoc>, StoreError> {
        Ok(self
            .typed::<HoldDoc>(HOLDS)
            .find(doc! {"uid": uid, "bundle": {"$ne": true}})
            .sort(doc! {"created_at": -1})
            .limit(most)
            .await?
            .try_collect()
            .await?)
    }

    /// Ends a held hold (`committed`, `released` or `expired`), named by
    /// its document key ([`HoldDoc::id`]); false when it was not held any
    /// more.
    pub async fn end_hold(
        &self,
        id: &str,
        end: HoldEnd,
        order_id: Option<&str>,
    ) -> Result<bool, StoreError> {
        let mut set = doc! {"state": end.state().as_str(), "ended_at": DateTime::now()};
        if let Some(o) = order_id {
            set.insert("order_id", o);
        }
        let r = self
            .collection(HOLDS)
            .update_one(
                doc! {"hold_id": hold_id_of(id), "_id": id, "state": HELD},
                doc! {"$set": set},
            )
            .write_concern(durable())
            .await?;
        Ok(r.modified_count == 1)
    }

    /// Binds a held hold, named by its document key ([`HoldDoc::id`]), to
    /// the order that pays it, before its codes move: false when it is not
    /// held any more, or bound to another order.
    pub async fn bind_hold(&self, id: &str, order_id: &str) -> Result<bool, StoreError> {
        let r = self
            .collection(HOLDS)
            .update_one(
                doc! {"hold_id": hold_id_of(id), "_id": id, "state": HELD, "$or": [
                    {"order_id": {"$exists": false}},
                    {"order_id": null},
                    {"order_id": order_id},
                ]},
                doc! {"$set": {"order_id": order_id}},
            )
            .write_concern(durable())
            .await?;
        Ok(r.matched_count == 1)
    }

    /// Ends as committed a hold still held but bound to `order_id`, which
    /// holds its codes already (a process died between the commit of the
    /// codes and the end of the hold). False when there was none. The hold
    /// is named by the id its owner gave it (whatever its document key):
    /// only the hold bound to `order_id`, of `owner` when the payer has
    /// one (a payer of no owner may pay any key's hold of no shop), matches.
    pub async fn finish_bound_hold(
        &self,
        hold_id: &str,
        owner: Option<&str>,
        order_id: &str,
    ) -> Result<bool, StoreError> {
        let mut filter = doc! {"hold_id": hold_id, "state": HELD, "order_id": order_id};
        if let Some(owner) = owner {
            filter.insert("owner", owner);
        }
        let r = self
            .collection(HOLDS)
            .update_one(
                filter,
                doc! {"$set": {"state": HoldState::Committed.as_str(), "ended_at": DateTime::now()}},
            )
            .write_concern(durable())
            .await?;
        Ok(r.modified_count == 1)
    }

    /// How many codes are held under `keys` that have not expired.
    pub async fn live_held_count(&self, keys: &[String]) -> Result<u64, StoreError> {
        let mut q = doc! {"order_id": {"$in": keys}, "status": CodeStatus::Held.as_i32()};
        q.extend(crate::codes::not_expired(DateTime::now()));
        Ok(self.collection(CODES).count_documents(q).await?)
    }

    /// Held holds whose time is up, oldest first.
    pub async fn due_holds(&self, now: DateTime, most: i64) -> Result<Vec<HoldDoc>, StoreError> {
        Ok(self
            .typed::<HoldDoc>(HOLDS)
            .find(doc! {"state": HELD, "expires_at": {"$lte": now}})
            .sort(doc! {"expires_at": 1})
            .limit(most)
            .await?
            .try_collect()
            .await?)
    }

    /// The codes held under `keys`, by key and line.
    pub async fn held_codes(&self, keys: &[String]) -> Result<Vec<HeldCode>, StoreError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let docs: Vec<HeldDoc> = self
            .typed::<HeldDoc>(CODES)
            .find(doc! {"order_id": {"$in": keys}, "status": CodeStatus::Held.as_i32()})
            .projection(doc! {"pool": 1, "seq": 1, "order_id": 1, "order_line": 1})
            .await?
            .try_collect()
            .await?;
        let mut out: Vec<HeldCode> = docs
            .into_iter()
            .map(|d| HeldCode {
                id: code_id(d.id),
                pool: d.pool,
                seq: d.seq,
                line: d.order_line.unwrap_or(0).clamp(0, i64::from(u32::MAX)) as u32,
                key: d.order_id,
            })
            .collect();
        out.sort_by(|a, b| (&a.key, a.line).cmp(&(&b.key, b.line)));
        Ok(out)
    }

    /// Puts the codes held under `keys` back in stock (4→0), taking off
    /// everything the hold wrote: they are unissued again, as if never
    /// held, for nobody has seen them. Returns the codes it found held; a
    /// code committed in between stays committed (the write is
    /// conditional), and offering it again as a candidate is harmless.
    pub async fn release_held(&self, keys: &[String]) -> Result<Vec<HeldCode>, StoreError> {
        let held = self.held_codes(keys).await?;
        if held.is_empty() {
            return Ok(held);
        }
        let mut pools: Vec<&str> = held.iter().map(|h| h.pool.as_str()).collect();
        pools.sort_unstable();
        pools.dedup();
        let release = StatusWrite::new(
            Transition::Release,
            doc! {"pool": {"$in": pools}, "order_id": {"$in": keys}},
            DateTime::now(),
        );
        self.write_status(&release).await?;
        Ok(held)
    }

    /// [`Self::release_held`] for codes that come back to stock for good
    /// (a hold expired, released or ended unpaid, a bundle's stray): the
    /// pools' next shortage is a new exhaustion, so their latch is
    /// re-armed. A claim that gives back what it took a moment ago (a
    /// bundle or a hold that fell short, a lost race) uses
    /// [`Self::release_held`]: its pool ran short, and that shortage must
    /// still be told once.
    pub async fn return_held(&self, keys: &[String]) -> Result<Vec<HeldCode>, StoreError> {
        let held = self.release_held(keys).await?;
        // The codes are back either way; a latch left raised only keeps
        // the next `pool.exhausted` for the next import.
        let mut pools: Vec<&str> = held.iter().map(|h| h.pool.as_str()).collect();
        pools.sort_unstable();
        pools.dedup();
        if let Err(e) = self.rearm_exhausted_alerts(&pools).await {
            tracing::warn!(error = %e, "pool.exhausted not re-armed for codes back in stock");
        }
        Ok(held)
    }

    /// Gives held codes to their orders (4→1): each `(code, key, claim)`
    /// moves code `code`, still held under `key`, to the line `claim`
    /// names, with everything a claim of that line writes, in ONE
    /// journaled multi-document statement (as a batch of claims is
    /// written). The hold's grant number stays the line's. A line its
    /// order already holds (a retry of a commit that landed) stops the
    /// statement at the unique index; the commits are then written one by
    /// one, and those lines are left as they are. Returns how many moved.
    pub async fn commit_held(
        &self,
        commits: &[(CodeId, &str, ClaimAssignment)],
    ) -> Result<u64, StoreError> {
        if commits.is_empty() {
            return Ok(0);
        }
        let now = DateTime::now();
        let ids: Vec<ObjectId> = commits.iter().map(|(id, _, _)| object_id(*id)).collect();
        let keys: Vec<&str> = commits.iter().map(|(_, k, _)| *k).collect();
        let assignments: Vec<ClaimAssignment> = commits.iter().map(|(_, _, a)| a.clone()).collect();
        // The code's own guard, in the same write that moves it: a held
        // code whose time ran out while it was held is not committed (the
        // order's line is claimed from stock instead).
        let q = doc! {"_id": {"$in": ids.clone()}, "order_id": {"$in": keys}};
        let one = merge_statement(&assignments, &ids, now, q, true);
        let reply = self.update_codes(vec![one]).await?;
        if crate::codes::claim::duplicate_positions(&reply)?.is_empty() {
            return Ok(crate::collections::as_u64(reply.get("nModified")));
        }
        let mut moved = 0;
        for (k, (id, key, _)) in commits.iter().enumerate() {
            let q = doc! {"_id": object_id(*id), "order_id": *key};
            let each = merge_statement(&assignments[k..=k], &ids[k..=k], now, q, true);
            let reply = self.update_codes(vec![each]).await?;
            crate::codes::claim::duplicate_positions(&reply)?;
            moved += crate::collections::as_u64(reply.get("nModified"));
        }
        Ok(moved)
    }

    /// Notes on their holds the held codes a recall or the expiry sweep
    /// just voided: `was_held` names each candidate that was held when the
    /// sweep read it, with the key it was held under. The void cleared
    /// every field the hold wrote on the code (it looks like a code voided
    /// in stock) and kept only [`crate::moves::HELD_AT`]; the hold keeps
    /// which codes it lost (`voided_codes`), for the operator's lookup.
    /// Only the codes this void took out of their hold are noted (void now,
    /// with a `held_at`). Best effort: a hold that misses a note only
    /// loses that line of the lookup.
    pub(crate) async fn note_voided_while_held(
        &self,
        was_held: &[(ObjectId, String)],
    ) -> Result<(), StoreError> {
        if was_held.is_empty() {
            return Ok(());
        }
        let ids: Vec<ObjectId> = was_held.iter().map(|(id, _)| *id).collect();
        let voided: Vec<bson::Document> = self
            .collection(CODES)
            .find(doc! {
                "_id": {"$in": &ids},
                "status": CodeStatus::Void.as_i32(),
                crate::moves::HELD_AT: {"$exists": true},
            })
            .projection(doc! {"_id": 1})
            .await?
            .try_collect()
            .await?;
        let voided: std::collections::HashSet<ObjectId> = (voided.iter())
            .filter_map(|d| d.get_object_id("_id").ok())
            .collect();
        let mut by_key: HashMap<&str, Vec<ObjectId>> = HashMap::new();
        for (id, key) in was_held.iter().filter(|(id, _)| voided.contains(id)) {
            by_key.entry(key.as_str()).or_default().push(*id);
        }
        for (key, codes) in by_key {
            if let Some(h) = self.hold_of_key(key).await? {
                self.collection(HOLDS)
                    .update_one(
                        doc! {"hold_id": &h.hold_id, "_id": &h.id},
                        doc! {"$addToSet": {VOIDED_CODES: {"$each": codes}}},
                    )
                    .await?;
            }
        }
        Ok(())
    }

    /// The holds that lost these codes to a recall or their expiry while
    /// they held them, by code (the `voided_codes` index).
    pub async fn holds_that_lost(
        &self,
        codes: &[CodeId],
    ) -> Result<HashMap<CodeId, HoldDoc>, StoreError> {
        if codes.is_empty() {
            return Ok(HashMap::new());
        }
        let ids: Vec<ObjectId> = codes.iter().copied().map(object_id).collect();
        let holds: Vec<bson::Document> = self
            .collection(HOLDS)
            .find(doc! {VOIDED_CODES: {"$in": &ids}})
            .await?
            .try_collect()
            .await?;
        let mut out = HashMap::new();
        for d in holds {
            let lost: Vec<ObjectId> = (d.get_array(VOIDED_CODES).into_iter().flatten())
                .filter_map(|b| b.as_object_id())
                .collect();
            let Ok(h) = bson::from_document::<HoldDoc>(d) else {
                continue;
            };
            for id in lost.into_iter().filter(|id| ids.contains(id)) {
                out.insert(code_id(id), h.clone());
            }
        }
        Ok(out)
    }

    /// The holds of these hold ids, of every owner, any state (the
    /// `hold_id_owner` index): the caller picks each owner's.
    pub async fn holds_named(&self, ids: &[&str]) -> Result<Vec<HoldDoc>, StoreError> {
        self.find_in(HOLDS, "hold_id", ids).await
    }

    /// Puts back in stock held codes no live hold or bundle owns any more:
    /// a bundle's held longer than `bundle_after` ago (left by a process
    /// that died between a bundle's two claims; a live bundle commits
    /// within milliseconds), and a hold's held longer than `hold_after`
    /// ago (longer than any hold lives: left by a process that died before
    /// it recorded the hold).
    pub async fn release_stray_held(
        &self,
        bundle_after: std::time::Duration,
        hold_after: std::time::Duration,
    ) -> Result<Vec<HeldCode>, StoreError> {
        let ago = |d: std::time::Duration| {
            DateTime::from_millis(DateTime::now().timestamp_millis() - d.as_millis() as i64)
        };
        // By key prefix (a range of the `(order_id, line)` index): each
        // query reads only the held codes of its kind that are that old.
        let mut keys: Vec<String> = Vec::new();
        for (prefix, after) in [(BUNDLE_PREFIX, bundle_after), (HOLD_PREFIX, hold_after)] {
            let docs: Vec<HeldDoc> = self
                .typed::<HeldDoc>(CODES)
                .find(doc! {
                    "order_id": {"$gte": prefix, "$lt": format!("{prefix}\u{10FFFF}")},
                    "status": CodeStatus::Held.as_i32(),
                    "issued_at": {"$lte": ago(after)},
                })
                .projection(doc! {"pool": 1, "seq": 1, "order_id": 1, "order_line": 1})
                .limit(1000)
                .await?
                .try_collect()
                .await?;
            let found = docs.into_iter().map(|d| d.order_id);
            if prefix == HOLD_PREFIX {
                keys.extend(self.without_live_holds(found.collect()).await?);
            } else {
                keys.extend(found);
            }
        }
        keys.sort();
        keys.dedup();
        self.return_held(&keys).await
    }

    /// `keys` less those of holds still open: a hold may last longer than
    /// a stray's age (a marketplace's reservation holds up to 48 hours).
    async fn without_live_holds(&self, keys: Vec<String>) -> Result<Vec<String>, StoreError> {
        let mut ids: Vec<String> = (keys.iter())
            .filter_map(|k| match codepool_domain::SetAside::of_key(k) {
                Some(codepool_domain::SetAside::Hold { hold_id }) => Some(hold_id),
                _ => None,
            })
            .collect();
        ids.sort();
        ids.dedup();
        if ids.is_empty() {
            return Ok(keys);
        }
        let names: Vec<&str> = ids.iter().map(String::as_str).collect();
        let now = DateTime::now();
        let live: std::collections::HashSet<String> = (self.holds_named(&names).await?.iter())
            .filter(|h| h.state == HoldState::Held && h.expires_at > now)
            .flat_map(|h| h.keys())
            .collect();
        Ok(keys.into_iter().filter(|k| !live.contains(k)).collect())
    }

    /// Held codes per pool, read from the held codes alone (the partial
    /// `held_since` index): the cost follows what is held, not the stock.
    pub async fn held_by_pool(&self) -> Result<Vec<(String, u64)>, StoreError> {
        let mut cursor = self
            .collection(CODES)
            .aggregate(vec![
                doc! {"$match": {"status": CodeStatus::Held.as_i32(), "issued_at": {"$exists": true}}},
                doc! {"$group": {"_id": "$pool", "n": {"$sum": 1}}},
            ])
            .hint(mongodb::options::Hint::Name("held_since".into()))
            .await?;
        let mut out = Vec::new();
        while let Some(d) = cursor.try_next().await? {
            if let Ok(pool) = d.get_str("_id") {
                out.push((pool.to_owned(), crate::collections::as_u64(d.get("n"))));
            }
        }
        Ok(out)
    }

    /// The open holds whose ids start with `prefix` (a channel's: its
    /// kind and name), and the codes they hold: holds past their expiry
    /// that the sweep has not ended yet are not counted. Read from the
    /// open holds alone (the partial `held_expiry` index), not from every
    /// hold the channel ever had.
    pub async fn held_under(&self, prefix: &str) -> Result<(u64, u64), StoreError> {
        let escaped: String = prefix
            .chars()
            .flat_map(|c| {
                let meta = !(c.is_ascii_alphanumeric() || c == '_' || c == ':');
                meta.then_some('\\').into_iter().chain([c])
            })
            .collect();
        let pipeline = vec![
            doc! {"$match": {
                "hold_id": {"$regex": format!("^{escaped}")},
                "state": HELD,
                "expires_at": {"$gt": DateTime::now()},
            }},
            doc! {"$group": {
                "_id": null,
                "holds": {"$sum": 1},
                "codes": {"$sum": {"$sum": "$items.quantity"}},
            }},
        ];
        let mut cursor = self
            .collection(HOLDS)
            .aggregate(pipeline)
            .hint(mongodb::options::Hint::Name("held_expiry".into()))
            .await?;
        Ok(match cursor.try_next().await? {
            Some(d) => (
                crate::collections::as_u64(d.get("holds")),
                crate::collections::as_u64(d.get("codes")),
            ),
            None => (0, 0),
        })
    }

    /// How many codes of `pool` are held, counted no further than `cap`.
    pub async fn held_count_upto(&self, pool: &str, cap: u64) -> Result<u64, StoreError> {
        let reply = self
            .database()
            .run_command(doc! {
                "count": CODES,
                "query": {"pool": pool, "status": CodeStatus::Held.as_i32()},
                "limit": cap.clamp(1, i64::MAX as u64) as i64,
            })
            .await?;
        Ok(crate::collections::as_u64(reply.get("n")))
    }
}
