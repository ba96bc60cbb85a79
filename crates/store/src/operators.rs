//! The console's operators and their sessions: `console_operators` (a
//! name, a role and an argon2id hash of a password) and
//! `console_sessions` (the SHA-256 of a cookie's token, its operator, a
//! CSRF token and an expiry that a TTL index enforces). The rules (who may
//! sign in, how passwords are hashed, what is audited) are the core's
//! (`codepool_issuance::operators` and `::sessions`); this module only
//! reads and writes the documents.

use bson::{doc, DateTime};
use futures::TryStreamExt;
use serde::{Deserialize, Serialize};

use crate::{Store, StoreError};

pub const OPERATORS: &str = "console_operators";
/// The collection of console sessions. Each session is an operator's, and
/// ends with that operator's account or password
/// ([`Store::end_operator_sessions`]).
pub const SESSIONS: &str = "console_sessions";

/// What an operator may do. Each role holds everything of the roles
/// before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Stock and stats.
    Viewer,
    /// And order lookup (codes masked), resend, void with a reason.
    Support,
    /// And imports, recall, pause/resume, settings, reveal, dead letters,
    /// API keys, operators, the audit log.
    Admin,
}

impl Role {
    pub const ALL: [Role; 3] = [Role::Viewer, Role::Support, Role::Admin];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Viewer => "viewer",
            Role::Support => "support",
            Role::Admin => "admin",
        }
    }

    pub fn parse(s: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|r| r.as_str() == s.trim())
    }
}

/// An operator as stored (the name is the `_id`: unique).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OperatorDoc {
    #[serde(rename = "_id")]
    pub name: String,
    pub role: Role,
    /// The argon2id PHC string (salt and parameters included).
    pub hash: String,
    pub created_at: DateTime,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_changed_at: Option<DateTime>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disabled_at: Option<DateTime>,
}

impl OperatorDoc {
    pub fn may(&self, role: Role) -> bool {
        self.disabled_at.is_none() && self.role >= role
    }
}

/// A console session as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionDoc {
    /// Hex SHA-256 of the cookie's token.
    #[serde(rename = "_id")]
    pub id: String,
    pub operator: String,
    /// The token every state-changing form of this session carries.
    pub csrf: String,
    pub created_at: DateTime,
    pub expires_at: DateTime,
}

impl Store {
    /// Adds an operator; `false` when one of that name exists already (it
    /// is left as it is).
    pub async fn insert_operator(&self, op: &OperatorDoc) -> Result<bool, StoreError> {
        match self.typed::<OperatorDoc>(OPERATORS).insert_one(op).await {
            Ok(_) => Ok(true),
            Err(e) if crate::error::is_duplicate_key(&e) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// Every operator, by name.
    pub async fn operators(&self) -> Result<Vec<OperatorDoc>, StoreError> {
        Ok(self
            .typed::<OperatorDoc>(OPERATORS)
            .find(doc! {})
            .sort(doc! {"_id": 1})
            .await?
            .try_collect()
            .await?)
    }

    /// The operator named `name`, enabled or not.
    pub async fn operator(&self, name: &str) -> Result<Option<OperatorDoc>, StoreError> {
        Ok(self
            .typed::<OperatorDoc>(OPERATORS)
            .find_one(doc! {"_id": name})
            .await?)
    }

    /// Marks an operator disabled now; the operator after, `None` when
    /// there is no such operator.
    pub async fn disable_operator(&self, name: &str) -> Result<Option<OperatorDoc>, StoreError> {
        Ok(self
            .typed::<OperatorDoc>(OPERATORS)
            .find_one_and_update(
                doc! {"_id": name},
                doc! {"$set": {"disabled_at": DateTime::now()}},
            )
            .return_document(mongodb::options::ReturnDocument::After)
            .await?)
    }

    /// Sets an operator's password hash (and enables the account again);
    /// the operator BEFORE, `None` when there is no such operator.
    pub async fn set_operator_password(
        &self,
        name: &str,
        hash: &str,
    ) -> Result<Option<OperatorDoc>, StoreError> {
        Ok(self
            .typed::<OperatorDoc>(OPERATORS)
            .find_one_and_update(
                doc! {"_id": name},
                doc! {"$set": {"hash": hash, "password_changed_at": DateTime::now()},
                "$unset": {"disabled_at": ""}},
            )
            .return_document(mongodb::options::ReturnDocument::Before)
            .await?)
    }

    /// Ends every console session of `operator`; how many ended.
    pub async fn end_operator_sessions(&self, operator: &str) -> Result<u64, StoreError> {
        let done = self
            .collection(SESSIONS)
            .delete_many(doc! {"operator": operator})
            .await?;
        Ok(done.deleted_count)
    }

    /// Stores a new session.
    pub async fn insert_session(&self, session: &SessionDoc) -> Result<(), StoreError> {
        self.typed::<SessionDoc>(SESSIONS)
            .insert_one(session)
            .await?;
        Ok(())
    }

    /// The session of id `id` (the hash of its token), if it has not
    /// expired.
    pub async fn live_session(&self, id: &str) -> Result<Option<SessionDoc>, StoreError> {
        Ok(self
            .typed::<SessionDoc>(SESSIONS)
            .find_one(doc! {"_id": id, "expires_at": {"$gt": DateTime::now()}})
            .await?)
    }

    /// Ends one session.
    pub async fn delete_session(&self, id: &str) -> Result<(), StoreError> {
        self.typed::<SessionDoc>(SESSIONS)
            .delete_one(doc! {"_id": id})
            .await?;
        Ok(())
    }
}
