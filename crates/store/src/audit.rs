//! The `audit` collection: every time a person revealed codes (`lookup
//! --reveal`, `export --reveal`), who, where, what and when. The record is
//! written, durably, before anything is shown: no record, no reveal.

use bson::oid::ObjectId;
use bson::{doc, DateTime};
use codepool_domain::CodeId;
use serde::{Deserialize, Serialize};

use crate::codes::object_id;
use crate::{durable, Store, StoreError};

pub const AUDIT: &str = "audit";

/// What kind of record: a reveal, or the change an operator made. Stored
/// (`kind`) by these names, which filters take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AuditKind {
    /// Codes shown in plaintext ([`Store::record_reveal`]).
    Reveal,
    Void,
    Redeem,
    Resend,
    Recall,
    Replace,
    Import,
    Generate,
    Pause,
    Resume,
    PoolCreate,
    PoolSettings,
    DeadLetterReplay,
    ShopCreate,
    ShopSet,
    WebhookAdd,
    WebhookEnable,
    WebhookDisable,
    WebhookRotate,
    WebhookReplay,
    ApiKeyCreate,
    ApiKeyRevoke,
    /// `codepool keys add` (the key file).
    KeyAdd,
    /// `codepool keys rotate` (the key file).
    KeyRotate,
    OperatorAdd,
    OperatorDisable,
    OperatorPasswd,
    /// A console sign-in.
    SignIn,
    /// A console sign-out.
    SignOut,
    /// A pool's statement key shown (`codepool statement --key`).
    StatementKey,
    /// `codepool channels add`.
    ChannelAdd,
    /// `codepool channels map|pause|resume`.
    ChannelSet,
    /// `codepool channels remove`.
    ChannelRemove,
}

impl AuditKind {
    pub const ALL: [AuditKind; 33] = [
        Self::Reveal,
        Self::Void,
        Self::Redeem,
        Self::Resend,
        Self::Recall,
        Self::Replace,
        Self::Import,
        Self::Generate,
        Self::Pause,
        Self::Resume,
        Self::PoolCreate,
        Self::PoolSettings,
        Self::DeadLetterReplay,
        Self::ShopCreate,
        Self::ShopSet,
        Self::WebhookAdd,
        Self::WebhookEnable,
        Self::WebhookDisable,
        Self::WebhookRotate,
        Self::WebhookReplay,
        Self::ApiKeyCreate,
        Self::ApiKeyRevoke,
        Self::KeyAdd,
        Self::KeyRotate,
        Self::OperatorAdd,
        Self::OperatorDisable,
        Self::OperatorPasswd,
        Self::SignIn,
        Self::SignOut,
        Self::StatementKey,
        Self::ChannelAdd,
        Self::ChannelSet,
        Self::ChannelRemove,
    ];

    /// The name stored and shown.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Reveal => "reveal",
            Self::Void => "void",
            Self::Redeem => "redeem",
            Self::Resend => "resend",
            Self::Recall => "recall",
            Self::Replace => "replace",
            Self::Import => "import",
            Self::Generate => "generate",
            Self::Pause => "pause",
            Self::Resume => "resume",
            Self::PoolCreate => "pool-create",
            Self::PoolSettings => "pool-settings",
            Self::DeadLetterReplay => "dead-letter-replay",
            Self::ShopCreate => "shop-create",
            Self::ShopSet => "shop-set",
            Self::WebhookAdd => "webhook-add",
            Self::WebhookEnable => "webhook-enable",
            Self::WebhookDisable => "webhook-disable",
            Self::WebhookRotate => "webhook-rotate",
            Self::WebhookReplay => "webhook-replay",
            Self::ApiKeyCreate => "api-key-create",
            Self::ApiKeyRevoke => "api-key-revoke",
            Self::KeyAdd => "key-add",
            Self::KeyRotate => "key-rotate",
            Self::OperatorAdd => "operator-add",
            Self::OperatorDisable => "operator-disable",
            Self::OperatorPasswd => "operator-passwd",
            Self::SignIn => "sign-in",
            Self::SignOut => "sign-out",
            Self::StatementKey => "statement-key",
            Self::ChannelAdd => "channel-add",
            Self::ChannelSet => "channel-set",
            Self::ChannelRemove => "channel-remove",
        }
    }

    /// The kinds, by their names, comma-separated: what a filter takes.
    pub fn names() -> String {
        let names: Vec<&str> = Self::ALL.iter().map(|k| k.as_str()).collect();
        names.join(", ")
    }
}

impl std::fmt::Display for AuditKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A filter named a kind that no record has.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no audit kind {0:?}; the kinds are: {kinds}", kinds = AuditKind::names())]
pub struct UnknownAuditKind(pub String);

impl std::str::FromStr for AuditKind {
    type Err = UnknownAuditKind;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| UnknownAuditKind(s.to_owned()))
    }
}

/// A record's kind as read back: one this build writes, or, for a record
/// written by another version, the name as stored (a listing shows it and
/// does not fail).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordedKind {
    Known(AuditKind),
    Other(String),
}

impl RecordedKind {
    /// The kind of a stored name.
    pub fn of(stored: &str) -> Self {
        stored
            .parse()
            .map_or_else(|_| Self::Other(stored.to_owned()), Self::Known)
    }

    /// Whether this is `kind`.
    pub fn is(&self, kind: AuditKind) -> bool {
        *self == Self::Known(kind)
    }

    /// The name as stored.
    pub fn as_str(&self) -> &str {
        match self {
            Self::Known(k) => k.as_str(),
            Self::Other(s) => s,
        }
    }
}

impl std::fmt::Display for RecordedKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

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
        "kind": AuditKind::Reveal.as_str(),
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
    pub kind: AuditKind,
    /// Where it came from, e.g. `console POST /console/orders/{id}/void`.
    pub command: String,
    /// What it was done to and how it ended, in words (codes masked).
    pub what: String,
}

/// One audit record as read back, a reveal or an action.
#[derive(Debug, Clone, PartialEq)]
pub struct AuditEntry {
    pub id: ObjectId,
    pub kind: RecordedKind,
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
    pub kind: Option<AuditKind>,
    pub before: Option<ObjectId>,
}

impl Store {
    /// Records an operator's change, durably.
    pub async fn record_action(&self, a: &Action) -> Result<ObjectId, StoreError> {
        let id = ObjectId::new();
        self.collection(AUDIT)
            .insert_one(action_doc(id, a, DateTime::now()))
            .write_concern(durable())
            .await?;
        Ok(id)
    }

    /// Records changes, one record each, in one durable write.
    pub async fn record_actions(&self, actions: &[Action]) -> Result<(), StoreError> {
        self.insert_actions(actions, durable()).await
    }

    /// [`Self::record_actions`] for changes whose own journaled write
    /// already names who made them and when (a redemption by code: the
    /// code keeps its redemption id, the redeeming key's owner and
    /// `used_at`). Acknowledged in memory (w:1), journaled with the next
    /// journaled write or group commit (100 ms at most): one journal flush
    /// per batch of redemptions instead of two. A crash in between, or a
    /// failover before a replica set's secondaries copied it, loses only
    /// the audit copy; the code (written w:majority, journaled) still
    /// tells who redeemed it.
    pub async fn record_actions_after_change(&self, actions: &[Action]) -> Result<(), StoreError> {
        self.insert_actions(actions, crate::bookkeeping()).await
    }

    async fn insert_actions(
        &self,
        actions: &[Action],
        concern: mongodb::options::WriteConcern,
    ) -> Result<(), StoreError> {
        if actions.is_empty() {
            return Ok(());
        }
        let at = DateTime::now();
        let docs = actions.iter().map(|a| action_doc(ObjectId::new(), a, at));
        self.collection(AUDIT)
            .insert_many(docs)
            .write_concern(concern)
            .await?;
        Ok(())
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
            filter.insert("kind", k.as_str());
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

fn action_doc(id: ObjectId, a: &Action, at: DateTime) -> bson::Document {
    doc! {
        "_id": id, "kind": a.kind.as_str(), "at": at,
        "os_user": &a.who, "command": &a.command, "what": &a.what,
    }
}

fn entry_of(d: &bson::Document) -> Option<AuditEntry> {
    let text = |k: &str| d.get_str(k).unwrap_or_default().to_owned();
    Some(AuditEntry {
        id: d.get_object_id("_id").ok()?,
        kind: RecordedKind::of(d.get_str("kind").unwrap_or_default()),
        at: *d.get_datetime("at").ok()?,
        who: text("os_user"),
        command: text("command"),
        what: text("what"),
        count: crate::collections::as_u64(d.get("count")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_are_stored_and_parsed_by_their_names() {
        for k in AuditKind::ALL {
            let json = serde_json::to_string(&k).unwrap();
            assert_eq!(json, format!("\"{}\"", k.as_str()));
            assert_eq!(serde_json::from_str::<AuditKind>(&json).unwrap(), k);
            assert_eq!(k.as_str().parse::<AuditKind>(), Ok(k));
            assert_eq!(RecordedKind::of(k.as_str()), RecordedKind::Known(k));
        }
        let names: std::collections::HashSet<&str> =
            AuditKind::ALL.iter().map(|k| k.as_str()).collect();
        assert_eq!(names.len(), AuditKind::ALL.len(), "no name twice");
    }

    #[test]
    fn an_unknown_kind_is_refused_by_a_filter_and_kept_by_a_listing() {
        let e = "voids".parse::<AuditKind>().unwrap_err();
        let said = e.to_string();
        assert!(
            said.contains("\"voids\"") && said.contains("void, redeem"),
            "{said}"
        );
        assert!(said.contains("sign-out"), "{said}");
        let read = RecordedKind::of("retired-kind");
        assert_eq!(read, RecordedKind::Other("retired-kind".into()));
        assert_eq!(read.to_string(), "retired-kind");
        assert!(!read.is(AuditKind::Void));
    }
}
