//! The outbox state of issued codes: their `sms.pending` events marked published, handed to the relay, and those the relay still owes.

use super::*;

impl Store {
    /// Records that the SMS-pending events of these codes were confirmed by
    /// the broker, which takes them off the relay's list.
    pub async fn mark_sms_published(&self, code_ids: &[CodeId]) -> Result<(), StoreError> {
        if code_ids.is_empty() {
            return Ok(());
        }
        let code_ids: Vec<ObjectId> = code_ids.iter().copied().map(object_id).collect();
        // Not a decision, only bookkeeping for the relay: a lost mark means
        // one duplicate event (with the same event_id), so w:1 is enough.
        self.collection(CODES)
            .update_many(
                doc! {"_id": {"$in": code_ids}, "sms_pending": true},
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
    pub async fn mark_hooks_recorded(&self, code_ids: &[CodeId]) -> Result<(), StoreError> {
        if code_ids.is_empty() {
            return Ok(());
        }
        let code_ids: Vec<ObjectId> = code_ids.iter().copied().map(object_id).collect();
        self.collection(CODES)
            .update_many(
                doc! {"_id": {"$in": code_ids}, "hook_pending": true},
                doc! {"$unset": {"hook_pending": ""}},
            )
            .await?;
        Ok(())
    }
}
