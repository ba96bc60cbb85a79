//! Reading a pool's codes out for reconciliation, one document at a time:
//! the cursor streams, so memory stays flat however large the pool.

use bson::{doc, DateTime, Document};
use codepool_domain::{Code, CodeStatus};
use futures::{Stream, StreamExt};

use crate::codes::{CodeDoc, CODES};
use crate::{Store, StoreError};

/// Which codes to export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportFilter {
    pub pool: String,
    pub statuses: Vec<CodeStatus>,
    /// Only codes created, issued, used or voided at or after this time.
    pub since: Option<chrono::DateTime<chrono::Utc>>,
    /// Only the codes of this import run (a file or a generation run).
    pub import: Option<bson::oid::ObjectId>,
}

impl ExportFilter {
    fn to_document(&self) -> Document {
        // A held code is no one's yet: no export of a pool shows it. A
        // run's export is the file the platform that honours the run's
        // codes is sent, so it lists every code a buyer may get, held
        // ones too (a hold is paid within minutes).
        let statuses: Vec<i32> = (self.statuses.iter())
            .filter(|s| self.import.is_some() || **s != CodeStatus::Held)
            .map(|s| s.as_i32())
            .collect();
        let mut filter = doc! {"pool": &self.pool, "status": {"$in": statuses}};
        if let Some(id) = self.import {
            filter.insert("batch_id", id);
        }
        if let Some(t) = self.since {
            let t = DateTime::from_chrono(t);
            filter.insert(
                "$or",
                ["created_at", "issued_at", "used_at", "voided_at"]
                    .iter()
                    .map(|f| doc! {*f: {"$gte": t}})
                    .collect::<Vec<_>>(),
            );
        }
        filter
    }
}

impl Store {
    /// How many codes [`Store::export_codes`] will stream.
    pub async fn count_export(&self, filter: &ExportFilter) -> Result<u64, StoreError> {
        Ok(self
            .collection(CODES)
            .count_documents(filter.to_document())
            .await?)
    }

    /// The codes matching `filter` in `seq` order, opened with the store's
    /// keys, as a stream.
    pub async fn export_codes(
        &self,
        filter: &ExportFilter,
    ) -> Result<impl Stream<Item = Result<Code, StoreError>> + '_, StoreError> {
        let cursor = self
            .typed::<CodeDoc>(CODES)
            .find(filter.to_document())
            .sort(doc! {"seq": 1})
            .batch_size(1000)
            .await?;
        Ok(cursor.map(move |d| d?.into_code(&self.keys)))
    }
}
