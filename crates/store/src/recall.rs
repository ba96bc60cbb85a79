//! Recalling an import: every still-unissued or held code of one import
//! run (`batch_id` = the run's `import_id`) becomes void. Each code moves by the
//! conditional update on its status (0 → 3, the unissued half of
//! [`Transition::Void`]), so against a concurrent claim exactly one of the
//! two wins: a code is issued before the recall or voided, never both.
//! Issued codes are left with their buyers and listed.

use bson::oid::ObjectId;
use bson::{doc, DateTime};
use codepool_domain::{Code, CodeId, CodeStatus, Transition};
use futures::TryStreamExt;
use mongodb::options::Hint;

use crate::codes::{code_id, object_id, CODES};
use crate::imports::{ImportRecord, IMPORTS};
use crate::moves::StatusWrite;
use crate::{CodeDoc, Store, StoreError};

/// The index a recall walks: an import's codes in `_id` order
/// (migration 0010).
const BATCH_INDEX: &str = "batch_id";

/// One round of a recall: the codes it looked at and how many it voided.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RecallRound {
    /// Unissued candidates found, by pool, in `_id` order; drop them from
    /// the hot pool (the ones a claim took meanwhile left it already).
    pub seen: Vec<(String, CodeId)>,
    pub voided: u64,
    /// Where the next round starts (`after`); `None` once the walk has
    /// passed the import's last code.
    pub next: Option<CodeId>,
}

impl Store {
    /// The audit record of an import run.
    pub async fn import_record(&self, id: ObjectId) -> Result<Option<ImportRecord>, StoreError> {
        Ok(self
            .typed::<ImportRecord>(IMPORTS)
            .find_one(doc! {"_id": id})
            .await?)
    }

    /// Voids up to `limit` still-unissued codes of import `batch`, the
    /// first ones after code `after` in `_id` order (from the start when
    /// `None`). Call it again after `next` until `next` is `None`: then the
    /// import's codes have been walked once, on the `(batch_id, _id)`
    /// index, and none was left unissued.
    ///
    /// The index holds no status on purpose: a claim then changes none of
    /// its keys. A round reads past the codes already handed out, and the
    /// walk reads each code of the import once.
    pub async fn recall_round(
        &self,
        batch: ObjectId,
        reason: &str,
        limit: i64,
        after: Option<CodeId>,
    ) -> Result<RecallRound, StoreError> {
        // Stock and live holds alike (the gate's Recall move): a held code
        // of a leaked file is never paid for. The hold's payment takes
        // another code from stock.
        let mut filter = doc! {"batch_id": batch};
        filter.extend(crate::moves::from_filter(Transition::Recall));
        if let Some(after) = after {
            filter.insert("_id", doc! {"$gt": object_id(after)});
        }
        let found: Vec<bson::Document> = self
            .collection(CODES)
            .find(filter)
            .sort(doc! {"batch_id": 1, "_id": 1})
            .hint(Hint::Name(BATCH_INDEX.into()))
            .projection(doc! {"_id": 1, "pool": 1, "status": 1, "order_id": 1})
            .limit(limit)
            .await?
            .try_collect()
            .await?;
        let full = found.len() as i64 >= limit;
        let mut round = RecallRound::default();
        let mut ids = Vec::with_capacity(found.len());
        let was_held = crate::holds::was_held(&found);
        for d in found {
            let (Ok(id), Ok(pool)) = (d.get_object_id("_id"), d.get_str("pool")) else {
                continue;
            };
            ids.push(id);
            round.seen.push((pool.to_owned(), code_id(id)));
        }
        if full {
            round.next = ids.last().copied().map(code_id);
        }
        // An import's codes sit in its pool: the write names it.
        let mut pools: Vec<&str> = round.seen.iter().map(|(p, _)| p.as_str()).collect();
        pools.sort_unstable();
        pools.dedup();
        if ids.is_empty() {
            return Ok(round);
        }
        let recall = StatusWrite::new(
            Transition::Recall,
            doc! {"pool": {"$in": pools}, "_id": {"$in": ids}},
            DateTime::now(),
        )
        .record(doc! {"voided_at": DateTime::now(), "void_reason": reason, "recalled_by": batch});
        let r = self.write_status(&recall).await?;
        round.voided = r.modified_count;
        self.note_voided_while_held(&was_held).await?;
        Ok(round)
    }

    /// Codes of import `batch` that buyers hold (issued or used), oldest
    /// grant first. Reads the import's codes on the `(batch_id, _id)` index:
    /// a recall's last step, never on the claim path.
    pub async fn held_codes_of_import(&self, batch: ObjectId) -> Result<Vec<Code>, StoreError> {
        let held = [CodeStatus::Issued.as_i32(), CodeStatus::Used.as_i32()];
        self.typed::<CodeDoc>(CODES)
            .find(doc! {"batch_id": batch, "status": {"$in": held.to_vec()}})
            .sort(doc! {"issued_at": 1})
            .await?
            .try_collect::<Vec<_>>()
            .await?
            .into_iter()
            .map(|d| d.into_code(&self.keys))
            .collect()
    }

    /// How many codes import run `batch` put in, whatever their status
    /// now (a count on the `(batch_id, _id)` index).
    pub async fn codes_of_import(&self, batch: ObjectId) -> Result<u64, StoreError> {
        Ok(self
            .collection(CODES)
            .count_documents(doc! {"batch_id": batch})
            .hint(Hint::Name(BATCH_INDEX.into()))
            .await?)
    }

    /// Notes the recall on the import's audit record.
    pub async fn mark_import_recalled(
        &self,
        id: ObjectId,
        reason: &str,
        voided: u64,
    ) -> Result<(), StoreError> {
        self.collection(IMPORTS)
            .update_one(
                doc! {"_id": id},
                doc! {"$set": {"recalled_at": DateTime::now(), "recall_reason": reason}, "$inc": {"recalled": voided as i64}},
            )
            .await?;
        Ok(())
    }

    /// The reason of the recall of run `id`, if one was made.
    pub async fn recall_reason(&self, id: ObjectId) -> Result<Option<String>, StoreError> {
        let d = self
            .collection(IMPORTS)
            .find_one(doc! {"_id": id, "recalled_at": {"$exists": true}})
            .projection(doc! {"recall_reason": 1})
            .await?;
        Ok(d.map(|d| d.get_str("recall_reason").unwrap_or("recalled").to_owned()))
    }

    /// After a run that was recalled while it still inserted (it stalled
    /// past its lease) has stopped: its codes that landed after the recall
    /// are voided like the recall's, with its reason. Returns how many.
    pub async fn recall_rest(&self, id: ObjectId) -> Result<u64, StoreError> {
        let Some(reason) = self.recall_reason(id).await? else {
            return Ok(0);
        };
        let (mut voided, mut after) = (0, None);
        loop {
            let round = self.recall_round(id, &reason, 1000, after).await?;
            voided += round.voided;
            after = round.next;
            if after.is_none() {
                break;
            }
        }
        self.mark_import_recalled(id, &reason, voided).await?;
        Ok(voided)
    }
}
