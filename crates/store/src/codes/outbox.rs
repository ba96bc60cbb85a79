//! The outbox state of issued codes: their `sms.pending` events marked published, handed to the relay, and those the relay still owes.

use super::*;

/// One record per HTTP batch whose events are not all confirmed yet
/// ([`Resend::ByRecord`]).
pub const SMS_OWED: &str = "sms_owed";

/// A batch's record of the events it owes ([`Store::owe_events`]); the
/// relay's marks (`next_at`, `relayed`) are not read back.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OwedRecord {
    #[serde(rename = "_id")]
    pub id: ObjectId,
    /// When it was written, before the batch's claim.
    pub at: DateTime,
    pub orders: Vec<String>,
}

impl Store {
    /// Records that the SMS-pending events of these codes were confirmed by
    /// the broker, which takes them off the relay's list.
    pub async fn mark_sms_published(&self, code_ids: &[(&str, CodeId)]) -> Result<(), StoreError> {
        if code_ids.is_empty() {
            return Ok(());
        }
        let mut filter = super::pooled_ids(code_ids);
        filter.insert("sms_pending", true);
        // Not a decision, only bookkeeping for the relay: a lost mark means
        // one duplicate event (with the same event_id), so w:1 is enough.
        self.collection(CODES)
            .update_many(
                filter,
                doc! {"$set": {"sms_published_at": DateTime::now()}, "$unset": {"sms_pending": ""}},
            )
            .write_concern(crate::bookkeeping())
            .await?;
        Ok(())
    }

    /// Hands the grants these orders hold to the relay (`sms_pending`), for
    /// purchases settled without publishing their event: a purchase
    /// dead-lettered at its delivery limit may hold a grant from a delivery
    /// that crashed before its confirm, and no redelivery follows. Journaled
    /// before the caller acks. Returns how many grants were handed over.
    pub async fn hand_to_relay(&self, order_ids: &[&str]) -> Result<u64, StoreError> {
        if order_ids.is_empty() {
            return Ok(0);
        }
        let handed = self
            .collection(CODES)
            .update_many(
                doc! {"order_id": {"$in": order_ids}, "status": CodeStatus::Issued.as_i32()},
                doc! {"$set": {"sms_pending": true}},
            )
            .write_concern(durable())
            .await?;
        Ok(handed.modified_count)
    }

    /// Records that the grants a batch of these orders is about to claim
    /// owe their SMS-pending events ([`Resend::ByRecord`]): one document
    /// for the batch, written durably (journaled, by a majority) before
    /// its claim, so no claim that survives a crash or a failover is
    /// without it. `at` is taken before the claim, on the same clock as the
    /// claim's `issued_at`: the record's grants are those its orders were
    /// issued from then on, not a repeat's older codes.
    pub async fn owe_events(&self, order_ids: &[&str]) -> Result<ObjectId, StoreError> {
        let record = OwedRecord {
            id: ObjectId::new(),
            at: DateTime::now(),
            orders: order_ids.iter().map(|o| (*o).to_owned()).collect(),
        };
        self.typed::<OwedRecord>(SMS_OWED)
            .insert_one(&record)
            .write_concern(durable())
            .await?;
        Ok(record.id)
    }

    /// Takes a batch's record away once every event it owed was confirmed.
    /// Bookkeeping: a record left behind costs one duplicate event per
    /// grant (with its `event_id`), so w:1 is enough.
    pub async fn settle_owed(&self, id: ObjectId) -> Result<(), StoreError> {
        self.collection(SMS_OWED)
            .delete_one(doc! {"_id": id})
            .write_concern(crate::bookkeeping())
            .await?;
        Ok(())
    }

    /// Leaves a record out of the relay's list until `until`; `relayed`
    /// when every event it owed was confirmed (it waits only to send them
    /// once more, for grants that landed late).
    pub async fn defer_owed(
        &self,
        id: ObjectId,
        until: DateTime,
        relayed: bool,
    ) -> Result<(), StoreError> {
        let mut set = doc! {"next_at": until};
        if relayed {
            set.insert("relayed", true);
        }
        self.collection(SMS_OWED)
            .update_one(doc! {"_id": id}, doc! {"$set": set})
            .write_concern(crate::bookkeeping())
            .await?;
        Ok(())
    }

    /// The records written before `before` that are still there (their
    /// batch's confirms never came: its process died, its claim failed or
    /// the broker was away) and not deferred past `now`, oldest first:
    /// the relay's second work list. A document that is not a record is
    /// left out (no batch writes one), and holds back none of the others.
    pub async fn owed_records(
        &self,
        before: chrono::DateTime<chrono::Utc>,
        now: chrono::DateTime<chrono::Utc>,
        limit: i64,
    ) -> Result<Vec<OwedRecord>, StoreError> {
        let now = DateTime::from_chrono(now);
        let docs: Vec<Document> = self
            .collection(SMS_OWED)
            .find(doc! {
                "at": {"$lt": DateTime::from_chrono(before)},
                "$or": [{"next_at": {"$exists": false}}, {"next_at": {"$lte": now}}],
            })
            .sort(doc! {"at": 1})
            .limit(limit)
            .await?
            .try_collect()
            .await?;
        Ok(docs
            .into_iter()
            .filter_map(|d| bson::from_document(d).ok())
            .collect())
    }

    /// The grants a record owes events for: the codes its orders were
    /// issued from its time on, issued or used now (a code voided since is
    /// not texted; a repeat's codes, issued before, were texted by their
    /// own batch). A record whose claim never landed owes none.
    pub async fn owed_grants(&self, record: &OwedRecord) -> Result<Vec<Code>, StoreError> {
        if record.orders.is_empty() {
            return Ok(Vec::new());
        }
        let granted = [CodeStatus::Issued.as_i32(), CodeStatus::Used.as_i32()];
        let docs: Vec<CodeDoc> = self
            .typed::<CodeDoc>(CODES)
            .find(doc! {
                "order_id": {"$in": &record.orders},
                "status": {"$in": granted.to_vec()},
                // A second's margin for the clock stepping back between
                // the record and its claim; a repeat granted within it is
                // sent again under its own event id, which the SMS service
                // drops.
                "issued_at": {"$gte": DateTime::from_millis(record.at.timestamp_millis() - 1000)},
            })
            .await?
            .try_collect()
            .await?;
        docs.into_iter().map(|d| d.into_code(&self.keys)).collect()
    }

    /// Grants issued before `before` that the relay owes their SMS-pending
    /// event (`sms_pending`, see [`Resend::ByRelay`]): its work list.
    pub async fn unconfirmed_grants(
        &self,
        before: chrono::DateTime<chrono::Utc>,
        limit: i64,
    ) -> Result<Vec<Code>, StoreError> {
        let docs: Vec<CodeDoc> = self
            .typed::<CodeDoc>(CODES)
            .find(doc! {"sms_pending": true, "issued_at": {"$lt": DateTime::from_chrono(before)}})
            .sort(doc! {"issued_at": 1})
            .limit(limit)
            .await?
            .try_collect()
            .await?;
        docs.into_iter().map(|d| d.into_code(&self.keys)).collect()
    }

    /// Grants whose shop is owed a webhook (`hook_pending`, written by the
    /// claim itself): the webhook stager's work list, the oldest orders
    /// first (at most `limit` of them) and every flagged code of each, so
    /// one claim's codes always travel together.
    pub async fn grants_owing_hooks(&self, limit: i64) -> Result<Vec<Code>, StoreError> {
        let firsts: Vec<Document> = self
            .collection(CODES)
            .find(doc! {"hook_pending": true})
            .sort(doc! {"issued_at": 1})
            .projection(doc! {"order_id": 1})
            .limit(limit)
            .await?
            .try_collect()
            .await?;
        let mut orders: Vec<&str> = firsts
            .iter()
            .filter_map(|d| d.get_str("order_id").ok())
            .collect();
        orders.sort_unstable();
        orders.dedup();
        if orders.is_empty() {
            return Ok(Vec::new());
        }
        let docs: Vec<CodeDoc> = self
            .typed::<CodeDoc>(CODES)
            .find(doc! {"order_id": {"$in": orders}, "hook_pending": true})
            .await?
            .try_collect()
            .await?;
        docs.into_iter().map(|d| d.into_code(&self.keys)).collect()
    }

    /// Takes grants off the webhook stager's list once their events are
    /// recorded.
    pub async fn mark_hooks_recorded(&self, code_ids: &[(&str, CodeId)]) -> Result<(), StoreError> {
        if code_ids.is_empty() {
            return Ok(());
        }
        let mut filter = super::pooled_ids(code_ids);
        filter.insert("hook_pending", true);
        self.collection(CODES)
            .update_many(filter, doc! {"$unset": {"hook_pending": ""}})
            .await?;
        Ok(())
    }
}
