//! The `audit` collection: every time a person revealed codes (`lookup
//! --reveal`, `export --reveal`), who, where, what and when. The record is
//! written, durably, before anything is shown: no record, no reveal.

use bson::oid::ObjectId;
use bson::{doc, DateTime};
use codepool_domain::CodeId;

use crate::codes::object_id;
use crate::{durable, Store, StoreError};

pub const AUDIT: &str = "audit";

/// One reveal, as the command line knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reveal {
    /// The operating-system user who ran the command.
    pub os_user: String,
    pub host: String,
    /// The command, e.g. `lookup --reveal`.
    pub command: String,
    /// What was asked for, in words (codes masked), e.g. `order "O-1"`.
    pub what: String,
    /// The codes shown (ids only, never values); empty for an export,
    /// which records its filter and count instead.
    pub code_ids: Vec<CodeId>,
    pub count: u64,
}

impl Store {
    /// Records a reveal before it happens; an error means: do not reveal.
    pub async fn record_reveal(&self, r: &Reveal) -> Result<ObjectId, StoreError> {
        let id = ObjectId::new();
        let ids: Vec<ObjectId> = r.code_ids.iter().copied().map(object_id).collect();
        self.collection(AUDIT)
            .insert_one(doc! {
                "_id": id,
                "kind": "reveal",
                "at": DateTime::now(),
                "os_user": &r.os_user,
                "host": &r.host,
                "command": &r.command,
                "what": &r.what,
                "code_ids": ids,
                "count": r.count as i64,
            })
            .write_concern(durable())
            .await?;
        Ok(id)
    }
}
