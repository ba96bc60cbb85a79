//! Recalling an import: every still-unissued code of one import run
//! (`batch_id` = the run's `import_id`) becomes void. Each code moves by the
//! conditional update on its status (0 → 3, the unissued half of
//! [`Transition::Void`]), so against a concurrent claim exactly one of the
//! two wins: a code is issued before the recall or voided, never both.
//! Issued codes are left with their buyers and listed.

use bson::oid::ObjectId;
use bson::{doc, DateTime};
use codepool_domain::{Code, CodeId, CodeStatus, Transition};
use futures::TryStreamExt;

use crate::codes::{code_id, CODES};
use crate::imports::{ImportRecord, IMPORTS};
use crate::{durable, CodeDoc, Store, StoreError};

/// One round of a recall: the codes it looked at and how many it voided.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RecallRound {
    /// Unissued candidates found, by pool; drop them from the hot pool (the
    /// ones a claim took meanwhile left it already).
    pub seen: Vec<(String, CodeId)>,
    pub voided: u64,
}

impl Store {
    /// The audit record of an import run.
    pub async fn import_record(&self, id: ObjectId) -> Result<Option<ImportRecord>, StoreError> {
        Ok(self
            .typed::<ImportRecord>(IMPORTS)
            .find_one(doc! {"_id": id})
            .await?)
    }

    /// Voids up to `limit` still-unissued codes of import `batch`. Call it
    /// until `seen` comes back empty: then no code of the import is unissued.
    pub async fn recall_round(
        &self,
        batch: ObjectId,
        reason: &str,
        limit: i64,
    ) -> Result<RecallRound, StoreError> {
        let unissued = CodeStatus::Unissued.as_i32();
        debug_assert!(Transition::Void.from().contains(&CodeStatus::Unissued));
        let found: Vec<bson::Document> = self
            .collection(CODES)
            .find(doc! {"batch_id": batch, "status": unissued})
            .projection(doc! {"_id": 1, "pool": 1})
            .limit(limit)
            .await?
            .try_collect()
            .await?;
        let mut round = RecallRound::default();
        let mut ids = Vec::with_capacity(found.len());
        for d in found {
            let (Ok(id), Ok(pool)) = (d.get_object_id("_id"), d.get_str("pool")) else {
                continue;
            };
            ids.push(id);
            round.seen.push((pool.to_owned(), code_id(id)));
        }
        if ids.is_empty() {
            return Ok(round);
        }
        let r = self
            .collection(CODES)
            .update_many(
                doc! {"_id": {"$in": ids}, "status": unissued},
                doc! {"$set": {
                    "status": Transition::Void.to().as_i32(),
                    "voided_at": DateTime::now(),
                    "void_reason": reason,
                    "recalled_by": batch,
                }},
            )
            .write_concern(durable())
            .await?;
        round.voided = r.modified_count;
        Ok(round)
    }

    /// Codes of import `batch` that buyers hold (issued or used), oldest
    /// grant first.
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
}
