//! The `kinguin_uploads` collection: one document per Kinguin reservation
//! of a channel, keyed like its deal ([`crate::channels::deal_id`]). It
//! records every status Kinguin's webhooks reported, and, once the
//! reservation is BOUGHT, the durable task of uploading its key to
//! Kinguin: written before the key is committed, leased by one process
//! at a time, retried until it succeeds or fails for good.
//!
//! Documents and queries only; the rules are
//! `codepool_issuance::channels::kinguin`.

use bson::{doc, Bson, DateTime};
use serde::{Deserialize, Serialize};

use crate::channels::deal_id;
use crate::{Store, StoreError};

pub const KINGUIN_UPLOADS: &str = "kinguin_uploads";

/// The most distinct statuses a reservation's document keeps (Kinguin
/// lists about ten).
pub const MAX_STATUSES: usize = 24;

/// Where a reservation's upload stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UploadState {
    /// To be sent (again) at `due_at`.
    Pending,
    /// Kinguin holds the key codepool sent.
    Uploaded,
    /// Given up: Kinguin refused the reservation, or holds another key.
    Failed,
    /// The reservation was cancelled before its key was sent.
    Cancelled,
}

impl UploadState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Uploaded => "uploaded",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
        }
    }
}

/// One Kinguin reservation as codepool knows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UploadDoc {
    #[serde(rename = "_id")]
    pub id: String,
    pub channel: String,
    pub reservation_id: String,
    pub offer_id: String,
    /// Kinguin's order id, once a webhook named it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kinguin_order: Option<String>,
    /// Every status a webhook reported, once each, in arrival order.
    #[serde(default)]
    pub statuses: Vec<String>,
    /// The upload, from BOUGHT on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upload: Option<UploadState>,
    /// codepool's order of the key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub order_id: Option<String>,
    /// The code committed to the order (its id; the key itself stays
    /// sealed in `codes`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code_id: Option<String>,
    /// A replacement's: the reservation whose key it replaces (Kinguin's
    /// `replacedFrom`). Its key is a replacement in `order_id`, the
    /// order of the first reservation of the chain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replaced_from: Option<String>,
    /// The upload's `requestId`: the same on every attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    #[serde(default)]
    pub attempts: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub due_at: Option<DateTime>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_until: Option<DateTime>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uploaded_at: Option<DateTime>,
    /// DELIVERED: Kinguin's id of the stock it released to the buyer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released_stock_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delivered_at: Option<DateTime>,
    pub created_at: DateTime,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_at: Option<DateTime>,
}

/// How an upload attempt ended.
#[derive(Debug, Clone)]
pub enum AttemptEnd {
    Uploaded,
    Failed(String),
    /// Try again at `due`.
    Retry {
        due: DateTime,
        error: String,
    },
}

impl Store {
    /// Records that a webhook reported `status` for `reservation` (once
    /// per status), creating the reservation's document if needed.
    pub async fn note_kinguin_status(
        &self,
        channel: &str,
        reservation: &str,
        offer: &str,
        kinguin_order: Option<&str>,
        status: &str,
    ) -> Result<(), StoreError> {
        let now = DateTime::now();
        let mut set = doc! {"updated_at": now};
        if let Some(o) = kinguin_order {
            set.insert("kinguin_order", o);
        }
        let update = doc! {
            "$setOnInsert": {"channel": channel, "reservation_id": reservation, "offer_id": offer, "attempts": 0, "created_at": now},
            "$addToSet": {"statuses": status},
            "$set": set,
        };
        // At most MAX_STATUSES kept: a document past it matches nothing,
        // and its upsert's duplicate key is the end.
        let last = format!("statuses.{}", MAX_STATUSES - 1);
        let filter = doc! {"_id": deal_id(channel, reservation), last: {"$exists": false}};
        // Two deliveries of one webhook may both insert: the loser's
        // update then finds the winner's document.
        for _ in 0..2 {
            match self
                .collection(KINGUIN_UPLOADS)
                .update_one(filter.clone(), update.clone())
                .upsert(true)
                .await
            {
                Ok(_) => return Ok(()),
                Err(e) if crate::error::is_duplicate_key(&e) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// One reservation's document.
    pub async fn kinguin_upload(
        &self,
        channel: &str,
        reservation: &str,
    ) -> Result<Option<UploadDoc>, StoreError> {
        Ok(self
            .typed::<UploadDoc>(KINGUIN_UPLOADS)
            .find_one(doc! {"_id": deal_id(channel, reservation)})
            .await?)
    }

    /// Stages the upload of a reservation's key, due at `due`, unless one
    /// is staged already; the document after.
    pub async fn stage_kinguin_upload(
        &self,
        channel: &str,
        reservation: &str,
        order_id: &str,
        request_id: &str,
        due: DateTime,
    ) -> Result<Option<UploadDoc>, StoreError> {
        let id = deal_id(channel, reservation);
        self.collection(KINGUIN_UPLOADS)
            .update_one(
                doc! {"_id": &id, "upload": {"$exists": false}},
                doc! {"$set": {
                    "upload": UploadState::Pending.as_str(),
                    "order_id": order_id,
                    "request_id": request_id,
                    "due_at": due,
                    "updated_at": DateTime::now(),
                }},
            )
            .await?;
        Ok(self
            .typed::<UploadDoc>(KINGUIN_UPLOADS)
            .find_one(doc! {"_id": id})
            .await?)
    }

    /// Withdraws an upload staged for a key that was then refused (no
    /// code recorded, not leased): the reservation is as if it had
    /// never been staged.
    pub async fn unstage_kinguin_upload(&self, id: &str) -> Result<(), StoreError> {
        self.collection(KINGUIN_UPLOADS)
            .update_one(
                doc! {"_id": id, "upload": UploadState::Pending.as_str(), "code_id": {"$exists": false}},
                doc! {"$unset": {"upload": "", "order_id": "", "request_id": "", "due_at": "", "lease_until": ""}},
            )
            .await?;
        Ok(())
    }

    /// Makes a pending upload due now; whether it is pending.
    pub async fn kinguin_upload_due_now(&self, id: &str) -> Result<bool, StoreError> {
        let r = self
            .collection(KINGUIN_UPLOADS)
            .update_one(
                doc! {"_id": id, "upload": UploadState::Pending.as_str()},
                doc! {"$set": {"due_at": DateTime::now()}},
            )
            .await?;
        Ok(r.matched_count == 1)
    }

    /// Links a reservation to the one it replaces (Kinguin's
    /// `replacedFrom`), unless it is linked already or its upload was
    /// staged; the link it has after (`None`: none, a sale's).
    pub async fn link_kinguin_replacement(
        &self,
        id: &str,
        replaced_from: &str,
    ) -> Result<Option<String>, StoreError> {
        self.collection(KINGUIN_UPLOADS)
            .update_one(
                doc! {"_id": id, "replaced_from": {"$exists": false}, "upload": {"$exists": false}},
                doc! {"$set": {"replaced_from": replaced_from, "updated_at": DateTime::now()}},
            )
            .await?;
        Ok(self
            .typed::<UploadDoc>(KINGUIN_UPLOADS)
            .find_one(doc! {"_id": id})
            .await?
            .and_then(|d| d.replaced_from))
    }

    /// Closes a reservation's upload, sent or not: a pending one, or one
    /// never staged, is cancelled (a later stage finds it so); whether it
    /// was still open.
    pub async fn close_kinguin_upload(&self, id: &str) -> Result<bool, StoreError> {
        let r = self
            .collection(KINGUIN_UPLOADS)
            .update_one(
                doc! {"_id": id, "upload": {"$in": [UploadState::Pending.as_str(), bson::Bson::Null]}},
                doc! {"$set": {"upload": UploadState::Cancelled.as_str(), "updated_at": DateTime::now()}, "$unset": {"lease_until": ""}},
            )
            .await?;
        Ok(r.modified_count == 1)
    }

    /// Records the code committed to a reservation (the first one only:
    /// the same key is sent on every attempt).
    pub async fn set_kinguin_code(&self, id: &str, code_id: &str) -> Result<(), StoreError> {
        self.collection(KINGUIN_UPLOADS)
            .update_one(
                doc! {"_id": id, "code_id": {"$exists": false}},
                doc! {"$set": {"code_id": code_id}},
            )
            .await?;
        Ok(())
    }

    /// Leases the pending upload due first (if any is due; with
    /// `committed_only`, of those whose code is recorded) for `lease`: no
    /// other process takes it until then, or until its attempt ends.
    pub async fn lease_kinguin_upload(
        &self,
        lease: std::time::Duration,
        committed_only: bool,
    ) -> Result<Option<UploadDoc>, StoreError> {
        let now = DateTime::now();
        let until = DateTime::from_millis(now.timestamp_millis() + lease.as_millis() as i64);
        let mut filter = doc! {
            "upload": UploadState::Pending.as_str(),
            "due_at": {"$lte": now},
            "$or": [{"lease_until": {"$exists": false}}, {"lease_until": {"$lte": now}}],
        };
        if committed_only {
            filter.insert("code_id", doc! {"$exists": true});
        }
        // The upload due first is found by a read (the one step that goes
        // to every shard), then leased by its `_id` (the shard key), on the
        // same conditions: a process that leased it in between wins, and
        // the next one due is tried.
        for _ in 0..3 {
            let Some(first) = (self.collection(KINGUIN_UPLOADS))
                .find_one(filter.clone())
                .sort(doc! {"due_at": 1})
                .projection(doc! {"_id": 1})
                .await?
            else {
                return Ok(None);
            };
            let mut mine = filter.clone();
            mine.insert("_id", first.get("_id").cloned().unwrap_or(Bson::Null));
            let leased = (self.typed::<UploadDoc>(KINGUIN_UPLOADS))
                .find_one_and_update(
                    mine,
                    doc! {"$set": {"lease_until": until}, "$inc": {"attempts": 1}},
                )
                .return_document(mongodb::options::ReturnDocument::After)
                .await?;
            if leased.is_some() {
                return Ok(leased);
            }
        }
        Ok(None)
    }

    /// Ends a leased attempt; whether the upload was still pending.
    pub async fn end_kinguin_attempt(
        &self,
        id: &str,
        end: &AttemptEnd,
    ) -> Result<bool, StoreError> {
        let now = DateTime::now();
        let set = match end {
            AttemptEnd::Uploaded => {
                doc! {"upload": UploadState::Uploaded.as_str(), "uploaded_at": now, "updated_at": now}
            }
            AttemptEnd::Failed(why) => {
                doc! {"upload": UploadState::Failed.as_str(), "last_error": why, "updated_at": now}
            }
            AttemptEnd::Retry { due, error } => {
                doc! {"due_at": *due, "last_error": error, "updated_at": now}
            }
        };
        let r = self
            .collection(KINGUIN_UPLOADS)
            .update_one(
                doc! {"_id": id, "upload": UploadState::Pending.as_str()},
                doc! {"$set": set, "$unset": {"lease_until": ""}},
            )
            .await?;
        Ok(r.modified_count == 1)
    }

    /// Cancels a reservation's upload not sent yet; whether it was
    /// pending.
    pub async fn cancel_kinguin_upload(&self, id: &str) -> Result<bool, StoreError> {
        let r = self
            .collection(KINGUIN_UPLOADS)
            .update_one(
                doc! {"_id": id, "upload": UploadState::Pending.as_str()},
                doc! {"$set": {"upload": UploadState::Cancelled.as_str(), "updated_at": DateTime::now()}},
            )
            .await?;
        Ok(r.modified_count == 1)
    }

    /// Records a reservation's delivery to its buyer (DELIVERED).
    pub async fn note_kinguin_delivered(
        &self,
        id: &str,
        released_stock_id: Option<&str>,
    ) -> Result<(), StoreError> {
        let mut set = doc! {"delivered_at": DateTime::now()};
        if let Some(s) = released_stock_id {
            set.insert("released_stock_id", s);
        }
        self.collection(KINGUIN_UPLOADS)
            .update_one(
                doc! {"_id": id, "delivered_at": {"$exists": false}},
                doc! {"$set": set},
            )
            .await?;
        Ok(())
    }

    /// How many of a channel's uploads are in `state`.
    pub async fn kinguin_uploads_in(
        &self,
        channel: &str,
        state: UploadState,
    ) -> Result<u64, StoreError> {
        Ok(self
            .collection(KINGUIN_UPLOADS)
            .count_documents(doc! {"channel": channel, "upload": state.as_str()})
            .await?)
    }
}
