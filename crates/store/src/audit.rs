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

fn reveal_doc(id: ObjectId, r: &Reveal) -> bson::Document {
    let ids: Vec<ObjectId> = r.code_ids.iter().copied().map(object_id).collect();
    doc! {
        "_id": id,
        "kind": "reveal",
        "at": DateTime::now(),
        "os_user": &r.os_user,
        "host": &r.host,
        "command": &r.command,
        "what": &r.what,
        "code_ids": ids,
        "count": r.count as i64,
    }
}

impl Store {
    /// Records a reveal before it happens; an error means: do not reveal.
    pub async fn record_reveal(&self, r: &Reveal) -> Result<ObjectId, StoreError> {
        let id = ObjectId::new();
        self.collection(AUDIT)
            .insert_one(reveal_doc(id, r))
            .write_concern(durable())
            .await?;
        Ok(id)
    }

    /// Records several reveals in one journaled write (the repeats of an
    /// HTTP batch); an error means: reveal none of them.
    pub async fn record_reveals(&self, reveals: &[Reveal]) -> Result<(), StoreError> {
        if reveals.is_empty() {
            return Ok(());
        }
        let docs: Vec<bson::Document> = reveals
            .iter()
            .map(|r| reveal_doc(ObjectId::new(), r))
            .collect();
        self.collection(AUDIT)
            .insert_many(docs)
            .write_concern(durable())
            .await?;
        Ok(())
    }
}

/// One change an operator made (a void, a resend, a recall, a setting):
/// who, what, and how it ended. Written after the change, with its
/// outcome; a reveal is written before, with [`Store::record_reveal`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Action {
    /// Who, e.g. `operator:alice`.
    pub who: String,
    /// What kind of change, e.g. `void`, `resend`, `recall`.
    pub kind: String,
    /// Where it came from, e.g. `console POST /console/orders/{id}/void`.
    pub command: String,
    /// What it was done to and how it ended, in words (codes masked).
    pub what: String,
}

/// One audit record as read back, a reveal or an action.
#[derive(Debug, Clone, PartialEq)]
pub struct AuditEntry {
    pub id: ObjectId,
    pub kind: String,
    pub at: DateTime,
    pub who: String,
    pub command: String,
    pub what: String,
    pub count: u64,
}

/// Which audit records to read: by who and kind, newest first, before an id.
#[derive(Debug, Clone, Default)]
pub struct AuditFilter<'a> {
    pub who: Option<&'a str>,
    pub kind: Option<&'a str>,
    pub before: Option<ObjectId>,
}

impl Store {
    /// Records an operator's change, durably.
    pub async fn record_action(&self, a: &Action) -> Result<ObjectId, StoreError> {
        let id = ObjectId::new();
        self.collection(AUDIT)
            .insert_one(doc! {
                "_id": id,
                "kind": &a.kind,
                "at": DateTime::now(),
                "os_user": &a.who,
                "command": &a.command,
                "what": &a.what,
            })
            .write_concern(durable())
            .await?;
        Ok(id)
    }

    /// A page of audit records, newest first; follow with `before` = the
    /// last id. Served by the `(os_user, _id)` and `(kind, _id)` indexes.
    pub async fn audit_page(
        &self,
        f: &AuditFilter<'_>,
        limit: i64,
    ) -> Result<Vec<AuditEntry>, StoreError> {
        use futures::TryStreamExt;
        let mut filter = doc! {};
        if let Some(w) = f.who {
            filter.insert("os_user", w);
        }
        if let Some(k) = f.kind {
            filter.insert("kind", k);
        }
        if let Some(b) = f.before {
            filter.insert("_id", doc! {"$lt": b});
        }
        let docs: Vec<bson::Document> = self
            .collection(AUDIT)
            .find(filter)
            .sort(doc! {"_id": -1})
            .limit(limit)
            .await?
            .try_collect()
            .await?;
        Ok(docs.iter().filter_map(entry_of).collect())
    }
}

fn entry_of(d: &bson::Document) -> Option<AuditEntry> {
    let text = |k: &str| d.get_str(k).unwrap_or_default().to_owned();
    Some(AuditEntry {
        id: d.get_object_id("_id").ok()?,
        kind: text("kind"),
        at: *d.get_datetime("at").ok()?,
        who: text("os_user"),
        command: text("command"),
        what: text("what"),
        count: crate::collections::as_u64(d.get("count")),
    })
}
