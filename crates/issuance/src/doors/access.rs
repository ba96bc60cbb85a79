//! Who may reach the doors, and the record of what they did: API keys,
//! console operators and their sessions, the audit log.

use std::time::Duration;

use crate::api_keys::{self, KeyDoc, KeyError, NewKey, Scope, Verifier};
use crate::audit::Actor;
use crate::keywatch::KeysMissing;
use crate::model::{Action, AuditEntry, AuditFilter, AuditKind};
use crate::operators::{self, OperatorDoc, OperatorError, Role};
use crate::sessions::{self, SessionDoc};
use crate::{Core, StoreError};

impl Core {
    /// The key a token proves, read through `verifier`'s cache (`None`: no
    /// such key, a wrong secret, or a revoked key).
    pub async fn verify_key(
        &self,
        verifier: &Verifier,
        token: &str,
    ) -> Result<Option<KeyDoc>, StoreError> {
        verifier.verify(self.store(), token).await
    }

    /// Every API key, newest first.
    pub async fn api_keys(&self) -> Result<Vec<KeyDoc>, KeyError> {
        api_keys::list(self.store()).await
    }

    /// Creates a key, of `shop` when given ([`api_keys::create_for`]).
    pub async fn create_api_key(
        &self,
        name: &str,
        scopes: &[Scope],
        shop: Option<&str>,
        actor: &Actor,
    ) -> Result<NewKey, KeyError> {
        api_keys::create_for(self.store(), name, scopes, shop, actor).await
    }

    /// Revokes the live key named `name` ([`api_keys::revoke`]).
    pub async fn revoke_api_key(&self, name: &str, actor: &Actor) -> Result<KeyDoc, KeyError> {
        api_keys::revoke(self.store(), name, actor).await
    }

    /// Every operator, by name.
    pub async fn operators(&self) -> Result<Vec<OperatorDoc>, OperatorError> {
        operators::list(self.store()).await
    }

    /// Creates an operator ([`operators::add`]).
    pub async fn add_operator(
        &self,
        name: &str,
        role: Role,
        password: &str,
        actor: &Actor,
    ) -> Result<OperatorDoc, OperatorError> {
        operators::add(self.store(), name, role, password, actor).await
    }

    /// Disables an operator and ends its sessions
    /// ([`operators::disable`]).
    pub async fn disable_operator(
        &self,
        name: &str,
        actor: &Actor,
    ) -> Result<OperatorDoc, OperatorError> {
        operators::disable(self.store(), name, actor).await
    }

    /// The enabled operator `name` if `password` is its password
    /// ([`operators::authenticate`]).
    pub async fn authenticate(
        &self,
        name: &str,
        password: &str,
    ) -> Result<Option<OperatorDoc>, StoreError> {
        operators::authenticate(self.store(), name, password).await
    }

    /// Signs `op` in: a new console session of `ttl`, and its sign-in in
    /// the audit log (`command` names the door's route). The session's
    /// token, for the cookie.
    pub async fn sign_in(
        &self,
        op: &OperatorDoc,
        ttl: Duration,
        command: &str,
    ) -> Result<String, StoreError> {
        let token = sessions::start(self.store(), &op.name, ttl).await?;
        let action = Action {
            who: format!("operator:{}", op.name),
            kind: AuditKind::SignIn,
            command: command.to_owned(),
            what: format!("signed in as {}", op.role.as_str()),
        };
        self.store().record_action(&action).await?;
        Ok(token)
    }

    /// The live session of a cookie token and its operator, while the
    /// operator is enabled; `None` for anyone else.
    pub async fn signed_in(
        &self,
        token: &str,
    ) -> Result<Option<(SessionDoc, OperatorDoc)>, StoreError> {
        let Some(session) = sessions::find(self.store(), token).await? else {
            return Ok(None);
        };
        let operator = operators::find(self.store(), &session.operator).await?;
        Ok(operator
            .filter(|o| o.disabled_at.is_none())
            .map(|o| (session, o)))
    }

    /// Ends one console session.
    pub async fn end_session(&self, id: &str) -> Result<(), StoreError> {
        sessions::end(self.store(), id).await
    }

    /// Records a change a door made, durably.
    pub async fn record_action(&self, action: &Action) -> Result<(), StoreError> {
        self.store().record_action(action).await.map(|_| ())
    }

    /// Up to `limit` audit records, newest first, as `filter` asks.
    pub async fn audit_page(
        &self,
        filter: &AuditFilter<'_>,
        limit: i64,
    ) -> Result<Vec<AuditEntry>, StoreError> {
        self.store().audit_page(filter, limit).await
    }

    /// Whether the key file holds every key codes are sealed with, read
    /// again at most every [`crate::keywatch::RECHECK`] (the order path's
    /// own check).
    pub async fn ensure_keys(&self) -> Result<Result<(), KeysMissing>, StoreError> {
        self.parts().ensure_keys().await
    }
}
