//! Look-alike codes in a pool: codes that read the same to a person
//! (equal under Unicode NFKC and, unless the pool is case-sensitive, case
//! folding). Every code imported since migration 0011 carries
//! `code_fold_hmac`, the HMAC of its look-alike key, under a unique index
//! per pool, so a look-alike is refused at insert even when two imports
//! race. Codes from before carry none: [`Store::fold_backfill_batch`]
//! (run by `codepool migrate`) keys them, and reports the look-alike pairs
//! a pool already holds instead of voiding either code: which one the
//! partner meant is an operator's call.

use std::collections::HashMap;

use bson::oid::ObjectId;
use bson::{doc, Bson, Document};
use codepool_domain::CodeId;
use futures::TryStreamExt;

use crate::codes::{code_id, CodeDoc, CODES};
use crate::crypto::binary;
use crate::{Store, StoreError};

/// Two codes of one pool that read the same, found by the backfill. The
/// second keeps no `code_fold_hmac` (the index holds the first) and is
/// marked `lookalike_of` the first; neither is voided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LookAlikePair {
    pub pool: String,
    /// The code that holds the look-alike key.
    pub kept: CodeId,
    /// The code that reads the same.
    pub lookalike: CodeId,
    /// Both codes, masked.
    pub kept_masked: String,
    pub lookalike_masked: String,
}

/// One batch of [`Store::fold_backfill_batch`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FoldBackfill {
    /// Codes read in this batch (0: none is left to key).
    pub read: u64,
    /// Codes that got their look-alike key.
    pub keyed: u64,
    pub pairs: Vec<LookAlikePair>,
    /// Where the next batch starts.
    pub next_after: Option<ObjectId>,
}

fn unkeyed() -> Document {
    doc! {
        "code_fold_hmac": {"$exists": false},
        "lookalike_of": {"$exists": false},
        "code_enc": {"$exists": true},
    }
}

/// The `_migrations` record of a finished backfill: every code imported
/// since carries its key, so later runs skip the scan.
pub(crate) const BACKFILL_DONE: &str = "0011_codes_lookalike_backfill";

impl Store {
    /// True when some sealed code has no look-alike key yet (and no
    /// finished backfill says otherwise).
    pub async fn has_unkeyed_folds(&self) -> Result<bool, StoreError> {
        let log = self.collection("_migrations");
        if log.find_one(doc! {"_id": BACKFILL_DONE}).await?.is_some() {
            return Ok(false);
        }
        Ok(self
            .collection(CODES)
            .find_one(unkeyed())
            .projection(doc! {"_id": 1})
            .await?
            .is_some())
    }

    /// Records that the backfill found no code left to key.
    pub async fn finish_fold_backfill(&self) -> Result<(), StoreError> {
        self.collection("_migrations")
            .update_one(
                doc! {"_id": BACKFILL_DONE},
                doc! {"$setOnInsert": {"applied_at": bson::DateTime::now()}},
            )
            .upsert(true)
            .await?;
        Ok(())
    }

    /// Keys up to `limit` codes after `after` (in `_id` order, so a whole
    /// run reads the collection once) with their look-alike HMAC. A code
    /// the unique index refuses is a look-alike of one keyed before: it
    /// is marked `lookalike_of` that code and reported.
    pub async fn fold_backfill_batch(
        &self,
        after: Option<ObjectId>,
        limit: i64,
    ) -> Result<FoldBackfill, StoreError> {
        let ring = self.keys.ring()?;
        let mut filter = unkeyed();
        if let Some(after) = after {
            filter.insert("_id", doc! {"$gt": after});
        }
        let docs: Vec<CodeDoc> = self
            .typed::<CodeDoc>(CODES)
            .find(filter)
            .sort(doc! {"_id": 1})
            .limit(limit)
            .await?
            .try_collect()
            .await?;
        if docs.is_empty() {
            return Ok(FoldBackfill::default());
        }
        let mut out = FoldBackfill {
            read: docs.len() as u64,
            next_after: docs.last().map(|d| d.id),
            ..FoldBackfill::default()
        };
        let mut rules: HashMap<String, codepool_domain::LookAlikeRule> = HashMap::new();
        let mut keyed = Vec::with_capacity(docs.len());
        for d in docs {
            let (pool, id) = (d.pool.clone(), d.id);
            let rule = match rules.get(&pool) {
                Some(&c) => c,
                None => {
                    let c = self.lookalike_rule(&pool).await?;
                    *rules.entry(pool.clone()).or_insert(c)
                }
            };
            let code = d.into_code(&self.keys)?;
            let fold = ring.fold_hmac(&pool, &codepool_domain::fold_by(&code.code, rule));
            keyed.push((id, pool, fold.to_vec(), code.masked()));
        }
        let updates = keyed
            .iter()
            .map(|(id, pool, fold, _)| {
                doc! {
                    "q": {"pool": pool, "_id": id, "code_fold_hmac": {"$exists": false}},
                    "u": {"$set": {"code_fold_hmac": binary(fold.clone())}},
                }
            })
            .collect();
        let reply = self.update_codes(updates).await?;
        let refused = crate::codes::duplicate_positions(&reply)?;
        out.keyed = keyed.len() as u64 - refused.len() as u64;
        for k in refused {
            let Some((id, pool, fold, masked)) = keyed.get(k) else {
                continue;
            };
            out.pairs
                .push(self.mark_lookalike(*id, pool, fold, masked).await?);
        }
        Ok(out)
    }

    /// Marks code `id` a look-alike of the code of `pool` holding `fold`.
    async fn mark_lookalike(
        &self,
        id: ObjectId,
        pool: &str,
        fold: &[u8],
        masked: &str,
    ) -> Result<LookAlikePair, StoreError> {
        let kept = self
            .typed::<CodeDoc>(CODES)
            .find_one(doc! {"pool": pool, "code_fold_hmac": binary(fold.to_vec())})
            .await?
            .ok_or_else(|| StoreError::Corrupt {
                collection: CODES.into(),
                message: format!("code {id} was refused as a look-alike, but no code of pool {pool:?} holds its key"),
            })?;
        let kept_id = kept.id;
        let kept_code = kept.into_code(&self.keys)?;
        self.collection(CODES)
            .update_one(
                doc! {"_id": id},
                doc! {"$set": {"lookalike_of": Bson::ObjectId(kept_id)}},
            )
            .await?;
        Ok(LookAlikePair {
            pool: pool.to_owned(),
            kept: code_id(kept_id),
            lookalike: code_id(id),
            kept_masked: kept_code.masked(),
            lookalike_masked: masked.to_owned(),
        })
    }
}
