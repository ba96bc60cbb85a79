//! The `replacements` collection: support replaced one code of an order
//! that does not work, and the line got (or waits for) a fresh one.
//!
//! A replacement is recorded first, keyed by the id its caller chose
//! (`replacement_id`), with everything needed to finish it: the order's
//! line, buyer and pool, and the code it replaces. Every step after that
//! is one conditional update that a retry (or another process) may run
//! again and get the same result:
//!
//! 1. [`Store::begin_replacement`] records it as `voiding`, numbered `n`
//!    within its order; the unique `(order_id, n)` index holds the
//!    order's cap under concurrency. The caller's id is each order
//!    owner's own, as hold ids are: its guard in `replacement_ids` (one
//!    document per owner and id, written first and journaled) binds it to
//!    one order, so the rule holds with `replacements` sharded by order.
//! 2. [`Store::void_replaced`] voids the old code (issued → void, reason
//!    `replaced`, `replaced_by` the replacement) where it stands: it keeps
//!    its order and line.
//! 3. [`Store::claim_replacement`] claims the oldest claimable code of the
//!    pool for the line with `order_repl: n`. The unique
//!    `(order_id, order_line, order_repl)` index gives the line one code
//!    per replacement, however many processes finish it at once; a
//!    purchase of the order again (which claims with no `order_repl`)
//!    finds the old code on the line and claims nothing.
//! 4. [`Store::settle_replacement`] records the new code (`done`), or
//!    that the line waits for stock (`waiting`, served before the pool's
//!    backorders by the backorder sweep).
//!
//! Voiding the order cancels a replacement that has not got its code
//! ([`Store::cancel_replacements`]); a code claimed for it meanwhile is
//! withdrawn ([`Store::withdraw_replacement_code`]).

use bson::oid::ObjectId;
use bson::{doc, Bson, DateTime, Document};
use codepool_domain::{Code, Transition};
use futures::TryStreamExt;
use mongodb::options::ReturnDocument;
use serde::{Deserialize, Serialize};

use crate::codes::{object_id, CODES};
use crate::error::is_duplicate_key;
use crate::moves::StatusWrite;
use crate::{durable, ClaimAssignment, CodeDoc, Resend, Store, StoreError};

pub const REPLACEMENTS: &str = "replacements";

/// The replacement-id guard: `_id` the document key of an owner's id
/// ([`doc_key`]), `order_id` the order it replaces a code of, `doc` the
/// replacement's own `_id`.
pub const REPLACEMENT_IDS: &str = "replacement_ids";

/// The reason recorded on a code that was replaced.
pub const REPLACED_REASON: &str = "replaced";

/// Where a replacement stands. Stored by these names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReplacementState {
    /// Recorded; its old code may not be void yet.
    Voiding,
    /// The old code is void; the line waits for stock (or for its pool to
    /// resume).
    Waiting,
    /// The line holds its new code.
    Done,
    /// The order was voided before the line got its new code.
    Cancelled,
}

impl ReplacementState {
    /// The name stored and shown.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Voiding => "voiding",
            Self::Waiting => "waiting",
            Self::Done => "done",
            Self::Cancelled => "cancelled",
        }
    }

    /// Whether the line still lacks its new code (and may get it).
    pub fn is_open(self) -> bool {
        matches!(self, Self::Voiding | Self::Waiting)
    }
}

/// The open states as stored, for filters.
fn open_states() -> Bson {
    Bson::Array(vec![
        ReplacementState::Voiding.as_str().into(),
        ReplacementState::Waiting.as_str().into(),
    ])
}

/// One replacement as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplacementDoc {
    /// The document's key ([`doc_key`]): the order's owner and the
    /// replacement id. Replacements are found by owner and id; this key
    /// only names the document found (and the code it voided).
    #[serde(rename = "_id")]
    pub key: String,
    /// The caller's `replacement_id`. Each order owner's own (a shop's, a
    /// key's, or the operator's for orders of neither): one owner's
    /// replacements have distinct ids (the unique `replacement_id_owner`
    /// index), two owners' may share one.
    #[serde(rename = "replacement_id")]
    pub id: String,
    pub order_id: String,
    pub line: i64,
    /// Its number within its order: 1, 2, … (the new code's `order_repl`).
    pub n: i64,
    pub reason: String,
    /// Who asked for it (the actor).
    pub who: String,
    pub pool: String,
    pub uid: String,
    pub phone: String,
    pub quantity: i64,
    /// The order's owner (`shop:NAME`, `api-key-id:ID`), whose namespace of
    /// replacement ids this one is in.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    /// The code it replaces.
    pub old_code: ObjectId,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub old_grant_no: Option<String>,
    pub state: ReplacementState,
    pub created_at: DateTime,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub new_code: Option<ObjectId>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub new_grant_no: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served_at: Option<DateTime>,
}

impl ReplacementDoc {
    /// The order's line it replaces the code of.
    pub fn line(&self) -> u32 {
        u32::try_from(self.line).unwrap_or(0)
    }

    /// Its number within its order (1 or more).
    pub fn number(&self) -> u32 {
        u32::try_from(self.n).unwrap_or(0)
    }

    /// The order's quantity.
    pub fn quantity(&self) -> u32 {
        u32::try_from(self.quantity).unwrap_or(1).max(1)
    }

    /// What the claim of the new code writes of its holder (the code id is
    /// the scan's to choose). Its event is owed by the relay, and the shop
    /// hears of it as `code.replaced`, not as a grant of plaintext codes.
    pub fn assignment(&self, grant_no: Option<String>) -> ClaimAssignment {
        ClaimAssignment {
            code_id: codepool_domain::CodeId::from_bytes([0; 12]),
            pool: self.pool.clone(),
            order_id: self.order_id.clone(),
            uid: self.uid.clone(),
            phone: self.phone.clone(),
            grant_no,
            mv: Transition::Reissue,
            resend: Resend::ByRelay,
            line: self.line(),
            quantity: self.quantity(),
            part: self.line(),
            owner: self.owner.clone(),
        }
    }
}

/// A replacement to record: its id, reason and actor, and the code on the
/// line now (issued to the order).
#[derive(Debug, Clone, Copy)]
pub struct NewReplacement<'a> {
    pub id: &'a str,
    pub reason: &'a str,
    pub who: &'a str,
    pub old: &'a Code,
}

impl NewReplacement<'_> {
    fn doc(&self, n: i64) -> Result<ReplacementDoc, StoreError> {
        let h = self.old.holder.as_ref().ok_or_else(|| {
            StoreError::Rejected(format!(
                "code {} has no order to replace it in",
                self.old.id
            ))
        })?;
        Ok(ReplacementDoc {
            key: doc_key(h.owner.as_deref(), self.id),
            id: self.id.to_owned(),
            order_id: h.order_id.clone(),
            line: i64::from(h.line),
            n,
            reason: self.reason.to_owned(),
            who: self.who.to_owned(),
            pool: self.old.pool.clone(),
            uid: h.uid.clone(),
            phone: h.phone.clone(),
            quantity: i64::from(h.quantity),
            owner: h.owner.clone(),
            old_code: object_id(self.old.id),
            old_grant_no: h.grant_no.clone(),
            state: ReplacementState::Voiding,
            created_at: DateTime::now(),
            new_code: None,
            new_grant_no: None,
            served_at: None,
        })
    }
}

/// A replacement id's guard, as stored in [`REPLACEMENT_IDS`].
#[derive(Debug, Clone, Serialize, Deserialize)]
struct IdGuard {
    #[serde(rename = "_id")]
    key: String,
    order_id: String,
    doc: String,
    at: DateTime,
}

/// What [`Store::begin_replacement`] found.
#[derive(Debug, Clone, PartialEq)]
pub enum Begun {
    /// Recorded now, as `voiding`.
    New(ReplacementDoc),
    /// A replacement of this id was recorded before (by this request
    /// earlier, or another one).
    Existing(ReplacementDoc),
    /// The order has had `limit` replacements: nothing was recorded.
    Limit { limit: u32 },
}

/// What [`Store::void_replaced`] did to the old code.
#[derive(Debug, Clone, PartialEq)]
pub enum OldCode {
    /// It is void, replaced by this replacement: `now` by this call, or
    /// before (a retry, a twin request).
    Voided { now: bool },
    /// It was no longer issued (used, voided otherwise): nothing changed.
    Refused(Box<Code>),
}

/// The document key of `owner`'s replacement `id`: the owner, a unit
/// separator (which no replacement id holds) and the id. (A replacement
/// recorded before ids were each owner's is keyed by its id alone.)
pub fn doc_key(owner: Option<&str>, id: &str) -> String {
    format!("{}\u{1f}{id}", owner.unwrap_or_default())
}

/// The filter of a line of an order: line 0 is stored as no line.
fn line_filter(line: i64) -> Bson {
    if line == 0 {
        Bson::Null
    } else {
        Bson::Int64(line)
    }
}

impl Store {
    /// Records a replacement of `new.old` unless its order's owner has one
    /// of this id (then that one), or the order has had `cap` replacements
    /// already.
    pub async fn begin_replacement(
        &self,
        new: &NewReplacement<'_>,
        cap: u32,
    ) -> Result<Begun, StoreError> {
        let owner = new.old.holder.as_ref().and_then(|h| h.owner.as_deref());
        let order = new.old.holder.as_ref().map(|h| h.order_id.as_str());
        // The id first: bound to this order, or to the one it names.
        let bound =
            (self.guard_replacement_id(&doc_key(owner, new.id), order.unwrap_or_default())).await?;
        if order != Some(bound.as_str()) {
            return match self.replacement(owner, new.id).await? {
                Some(d) => Ok(Begun::Existing(d)),
                None => Err(StoreError::Rejected(format!(
                    "replacement id {:?} is being used for another order; give this replacement another id",
                    new.id
                ))),
            };
        }
        // A lost race for a number tries the next one; a handful of rounds
        // is plenty, since each loss means another replacement landed.
        for _ in 0..16 {
            if let Some(d) = self.replacement(owner, new.id).await? {
                return Ok(Begun::Existing(d));
            }
            let had = self
                .collection(REPLACEMENTS)
                .count_documents(doc! {"order_id": order})
                .await?;
            if had >= u64::from(cap) {
                return Ok(Begun::Limit { limit: cap });
            }
            let d = new.doc(had as i64 + 1)?;
            match self
                .typed::<ReplacementDoc>(REPLACEMENTS)
                .insert_one(&d)
                .write_concern(durable())
                .await
            {
                Ok(_) => return Ok(Begun::New(d)),
                Err(e) if is_duplicate_key(&e) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(StoreError::Unavailable(
            "the order's replacements kept changing while this one was recorded".into(),
        ))
    }

    /// `owner`'s replacement of this id, if any (`owner`: the owner of
    /// the orders it replaces codes of; `None` for orders of no owner).
    pub async fn replacement(
        &self,
        owner: Option<&str>,
        id: &str,
    ) -> Result<Option<ReplacementDoc>, StoreError> {
        let Some(g) = self.replacement_guard(&doc_key(owner, id)).await? else {
            return Ok(None);
        };
        Ok(self
            .typed::<ReplacementDoc>(REPLACEMENTS)
            .find_one(doc! {"order_id": &g.order_id, "_id": &g.doc})
            .await?)
    }

    /// The guard of the replacement id keyed `key`, if any.
    async fn replacement_guard(&self, key: &str) -> Result<Option<IdGuard>, StoreError> {
        Ok(self
            .typed::<IdGuard>(REPLACEMENT_IDS)
            .find_one(doc! {"_id": key})
            .await?)
    }

    /// Binds the replacement id keyed `key` to `order_id` unless it is
    /// bound already; the order it is bound to now. Journaled before the
    /// replacement is recorded.
    async fn guard_replacement_id(&self, key: &str, order_id: &str) -> Result<String, StoreError> {
        let g = IdGuard {
            key: key.to_owned(),
            order_id: order_id.to_owned(),
            doc: key.to_owned(),
            at: DateTime::now(),
        };
        match (self.typed::<IdGuard>(REPLACEMENT_IDS).insert_one(&g))
            .write_concern(durable())
            .await
        {
            Ok(_) => Ok(g.order_id),
            Err(e) if is_duplicate_key(&e) => match self.replacement_guard(key).await? {
                Some(g) => Ok(g.order_id),
                None => Err(StoreError::Unavailable(
                    "a replacement id's guard was taken and then gone; try again".into(),
                )),
            },
            Err(e) => Err(e.into()),
        }
    }

    /// The replacement recorded under document key `key`
    /// ([`ReplacementDoc::key`]).
    async fn replacement_by_key(
        &self,
        order_id: &str,
        key: &str,
    ) -> Result<Option<ReplacementDoc>, StoreError> {
        Ok(self
            .typed::<ReplacementDoc>(REPLACEMENTS)
            .find_one(doc! {"order_id": order_id, "_id": key})
            .await?)
    }

    /// The replacements of these orders, oldest first.
    pub async fn replacements_for_orders(
        &self,
        order_ids: &[&str],
    ) -> Result<Vec<ReplacementDoc>, StoreError> {
        if order_ids.is_empty() {
            return Ok(Vec::new());
        }
        Ok(self
            .typed::<ReplacementDoc>(REPLACEMENTS)
            .find(doc! {"order_id": {"$in": order_ids}})
            .sort(doc! {"created_at": 1, "_id": 1})
            .await?
            .try_collect()
            .await?)
    }

    /// Forgets a replacement that changed nothing (its old code could not
    /// be voided), so it does not count against the order's cap.
    /// Named by its order too: the collection's shard key.
    /// Its id is set free too, as if it had never been used.
    pub async fn drop_replacement(&self, r: &ReplacementDoc) -> Result<(), StoreError> {
        let (order_id, key) = (&r.order_id, &r.key);
        let dropped = self
            .collection(REPLACEMENTS)
            .delete_one(
                doc! {"order_id": order_id, "_id": key, "state": ReplacementState::Voiding.as_str()},
            )
            .write_concern(durable())
            .await?;
        if dropped.deleted_count > 0 {
            self.collection(REPLACEMENT_IDS)
                .delete_one(doc! {"_id": doc_key(r.owner.as_deref(), &r.id), "order_id": order_id})
                .write_concern(durable())
                .await?;
        }
        Ok(())
    }

    /// Voids the code `r` replaces (issued → void, reason `replaced`); it
    /// keeps its order and line, and its event is no longer owed.
    pub async fn void_replaced(&self, r: &ReplacementDoc) -> Result<OldCode, StoreError> {
        let now = DateTime::now();
        let replace = StatusWrite::new(
            Transition::Replace,
            doc! {"pool": &r.pool, "_id": r.old_code, "order_id": &r.order_id},
            now,
        )
        .record(doc! {"voided_at": now, "void_reason": REPLACED_REASON, "replaced_by": &r.id})
        .clear(&["sms_pending", "hook_pending"]);
        let done = self.write_status(&replace).await?;
        if done.matched_count == 1 {
            return Ok(OldCode::Voided { now: true });
        }
        let mine = doc! {"_id": r.old_code, "replaced_by": &r.id};
        if self.collection(CODES).count_documents(mine).await? > 0 {
            return Ok(OldCode::Voided { now: false });
        }
        let code = self
            .typed::<CodeDoc>(CODES)
            .find_one(doc! {"_id": r.old_code})
            .await?
            .ok_or_else(|| StoreError::Corrupt {
                collection: REPLACEMENTS.into(),
                message: format!("replacement {:?} names a code that does not exist", r.id),
            })?
            .into_code(&self.keys)?;
        Ok(OldCode::Refused(Box::new(code)))
    }

    /// Claims the oldest claimable (unissued, unexpired) code of `r`'s
    /// pool for its line, numbered `grant_no`. `Some((code, true))` when
    /// this call claimed it, `Some((code, false))` when the line already
    /// had its code of this replacement, `None` when the pool has none.
    pub async fn claim_replacement(
        &self,
        r: &ReplacementDoc,
        grant_no: Option<String>,
    ) -> Result<Option<(Code, bool)>, StoreError> {
        let mut holder = crate::codes::claim::holder_doc(&r.assignment(grant_no));
        holder.insert("order_repl", r.n);
        let claimed = self
            .write_status_oldest::<CodeDoc>(Transition::Reissue, &r.pool, holder)
            .await;
        match claimed {
            Ok(Some(d)) => Ok(Some((d.into_code(&self.keys)?, true))),
            Ok(None) => Ok(None),
            Err(e) if is_duplicate_key(&e) => match self.replacement_code(r).await? {
                Some(code) => Ok(Some((code, false))),
                None => Err(StoreError::Rejected(format!(
                    "line {} of order {:?} is taken, but not by replacement {:?}",
                    r.line, r.order_id, r.id
                ))),
            },
            Err(e) => Err(e.into()),
        }
    }

    /// The code replacement `r` gave its line, if it has one.
    pub async fn replacement_code(&self, r: &ReplacementDoc) -> Result<Option<Code>, StoreError> {
        let slot =
            doc! {"order_id": &r.order_id, "order_line": line_filter(r.line), "order_repl": r.n};
        self.typed::<CodeDoc>(CODES)
            .find_one(slot)
            .await?
            .map(|d| d.into_code(&self.keys))
            .transpose()
    }

    /// Records where an open replacement ended up: its new code (`done`),
    /// or that its line waits (`None`). Returns the replacement as it is
    /// now, which may differ: finished by another process, or cancelled.
    pub async fn settle_replacement(
        &self,
        order_id: &str,
        key: &str,
        new: Option<&Code>,
    ) -> Result<ReplacementDoc, StoreError> {
        let set: Document = match new {
            Some(c) => doc! {
                "state": ReplacementState::Done.as_str(), "new_code": object_id(c.id),
                "new_grant_no": c.holder.as_ref().and_then(|h| h.grant_no.clone()),
                "served_at": DateTime::now(),
            },
            None => doc! {"state": ReplacementState::Waiting.as_str()},
        };
        let settled = self
            .typed::<ReplacementDoc>(REPLACEMENTS)
            .find_one_and_update(
                doc! {"order_id": order_id, "_id": key, "state": {"$in": open_states()}},
                doc! {"$set": set},
            )
            .return_document(ReturnDocument::After)
            .write_concern(durable())
            .await?;
        match settled {
            Some(d) => Ok(d),
            None => self
                .replacement_by_key(order_id, key)
                .await?
                .ok_or_else(|| {
                    StoreError::Rejected(format!("replacement {key:?} is no longer recorded"))
                }),
        }
    }

    /// Open replacements of `pool`, oldest first: those waiting, and those
    /// begun before `stale` and never finished (their process stopped).
    pub async fn open_replacements(
        &self,
        pool: &str,
        stale: DateTime,
        limit: i64,
    ) -> Result<Vec<ReplacementDoc>, StoreError> {
        let filter = doc! {"pool": pool, "$or": [
            {"state": ReplacementState::Waiting.as_str()},
            {"state": ReplacementState::Voiding.as_str(), "created_at": {"$lt": stale}},
        ]};
        Ok(self
            .typed::<ReplacementDoc>(REPLACEMENTS)
            .find(filter)
            .sort(doc! {"created_at": 1, "_id": 1})
            .limit(limit)
            .await?
            .try_collect()
            .await?)
    }

    /// Pools with replacements still open.
    pub async fn pools_with_replacements(&self) -> Result<Vec<String>, StoreError> {
        let values = self
            .collection(REPLACEMENTS)
            .distinct("pool", doc! {"state": {"$in": open_states()}})
            .await?;
        Ok(values
            .into_iter()
            .filter_map(|v| v.as_str().map(str::to_owned))
            .collect())
    }

    /// Cancels the open replacements of an order (it is being voided): its
    /// lines get no new code. Returns how many were open.
    pub async fn cancel_replacements(
        &self,
        order_id: &str,
        reason: &str,
    ) -> Result<u64, StoreError> {
        let r = self
            .collection(REPLACEMENTS)
            .update_many(
                doc! {"order_id": order_id, "state": {"$in": open_states()}},
                doc! {"$set": {
                    "state": ReplacementState::Cancelled.as_str(),
                    "cancelled_at": DateTime::now(), "cancel_reason": reason,
                }},
            )
            .write_concern(durable())
            .await?;
        Ok(r.modified_count)
    }

    /// Voids a code claimed for a replacement that was cancelled meanwhile
    /// (its order voided), before any event is sent for it.
    pub async fn withdraw_replacement_code(&self, code: &Code) -> Result<(), StoreError> {
        self.write_status(&StatusWrite::withdrawn(
            doc! {"pool": &code.pool, "_id": object_id(code.id)},
        ))
        .await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_keep_their_stored_names_and_only_two_are_open() {
        for s in [
            ReplacementState::Voiding,
            ReplacementState::Waiting,
            ReplacementState::Done,
            ReplacementState::Cancelled,
        ] {
            let json = serde_json::to_string(&s).unwrap();
            assert_eq!(json, format!("\"{}\"", s.as_str()));
            assert_eq!(
                s.is_open(),
                matches!(s, ReplacementState::Voiding | ReplacementState::Waiting)
            );
        }
        assert_eq!(line_filter(0), Bson::Null);
        assert_eq!(line_filter(3), Bson::Int64(3));
    }
}
