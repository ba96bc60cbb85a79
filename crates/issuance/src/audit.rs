//! Who changed what, from whichever door. Every change the core makes —
//! a void, a redemption, a resend, a recall, a pause or resume, a pool's
//! settings, an import, a replay of dead letters, an API key created or
//! revoked — is recorded here by the operation itself, so the CLI, the
//! HTTP API and the console leave the same trace, and a door cannot
//! forget it. (Operator accounts are recorded the same way by
//! `codepool_console::operators`, and the key file's `keys add` and
//! `keys rotate` by the CLI, their one door.)

use codepool_domain::CodeId;
use codepool_store::audit::{Action, Reveal};
pub use codepool_store::audit::{AuditKind, UnknownAuditKind};
use codepool_store::{Store, StoreError};
use tracing::error;

/// Who asks for a change, and through which door and command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Actor {
    /// `operator:NAME`, `api-key:NAME`, `os-user:NAME@HOST` or
    /// `amqp-user:NAME`.
    pub who: String,
    /// The door and command, e.g. `POST /v1/orders/{id}/void`.
    pub via: String,
}

impl Actor {
    /// An API key, through an HTTP route.
    pub fn api_key(name: &str, route: &str) -> Self {
        Self {
            who: format!("api-key:{name}"),
            via: route.to_owned(),
        }
    }

    /// A console operator, through a console route.
    pub fn operator(name: &str, route: &str) -> Self {
        Self {
            who: format!("operator:{name}"),
            via: format!("console {route}"),
        }
    }

    /// A broker user, through a message it published (RabbitMQ checked
    /// the user as the message's `user_id`).
    pub fn amqp_user(user: &str, message: &str) -> Self {
        Self {
            who: format!("amqp-user:{user}"),
            via: message.to_owned(),
        }
    }

    /// The operating-system user running a CLI command.
    pub fn os_user(user: &str, host: &str, command: &str) -> Self {
        Self {
            who: format!("os-user:{user}@{host}"),
            via: format!("codepool {command}"),
        }
    }
}

/// Records a change that was made. A change made but not recorded is
/// reported loudly (the caller answers an error), never hidden.
pub async fn record(
    store: &Store,
    actor: &Actor,
    kind: AuditKind,
    what: String,
) -> Result<(), StoreError> {
    let action = Action {
        who: actor.who.clone(),
        kind,
        command: actor.via.clone(),
        what,
    };
    store.record_action(&action).await.map(|_| ()).map_err(|e| {
        error!(error = %e, kind = kind.as_str(), who = %actor.who, "change made but not audited");
        e
    })
}

/// Records changes that were made, one record each, in one write (a batch
/// of redemptions by code), journaled with the next journaled write: each
/// code's own journaled change already names its redeemer and time
/// ([`Store::record_actions_after_change`]). Reported loudly when it
/// fails, as [`record`].
pub async fn record_all(
    store: &Store,
    kind: AuditKind,
    records: Vec<(&Actor, String)>,
) -> Result<(), StoreError> {
    let actions: Vec<Action> = records
        .into_iter()
        .map(|(actor, what)| Action {
            who: actor.who.clone(),
            kind,
            command: actor.via.clone(),
            what,
        })
        .collect();
    store.record_actions_after_change(&actions).await.map_err(|e| {
        error!(error = %e, kind = kind.as_str(), count = actions.len(), "changes made but not audited");
        e
    })
}

/// This machine's host name, recorded with every reveal.
pub fn host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown".into())
}

/// The record of codes shown in plaintext to `actor`: `what` was asked
/// for, in words (codes masked), `code_ids` were shown (none for an
/// export, which counts them).
pub fn reveal_of(actor: &Actor, what: String, code_ids: Vec<CodeId>, count: u64) -> Reveal {
    Reveal {
        os_user: actor.who.clone(),
        host: host(),
        command: actor.via.clone(),
        what,
        code_ids,
        count,
    }
}

/// Records that codes are shown to `actor`. No record, no reveal: a door
/// shows the codes only once this succeeded, whichever door it is.
pub async fn reveal(
    store: &Store,
    actor: &Actor,
    what: String,
    code_ids: Vec<CodeId>,
    count: u64,
) -> Result<(), StoreError> {
    store
        .record_reveal(&reveal_of(actor, what, code_ids, count))
        .await
        .map(|_| ())
}
