//! One module per console page: its GET and the POSTs of its forms.

pub mod api_keys;
pub mod assets;
pub mod audit;
pub mod channels;
pub mod dead_letters;
pub mod generations;
pub mod imports;
pub mod operators;
pub mod orders;
pub mod pool;
pub mod pools;
pub mod shop;
pub mod shops;
pub mod signin;
pub mod statement;

use crate::failure::Failure;
use crate::sessions::Session;
use crate::state::Console;

/// The body of a form that carries nothing but its CSRF token (pause,
/// resume, sign out).
#[derive(Debug, serde::Deserialize)]
pub struct CsrfOnly {
    #[serde(default)]
    pub csrf: String,
}

/// The operator of `s`, acting through `route`: the core audits the
/// change it makes with this.
pub(crate) fn actor(s: &Session, route: &str) -> codepool_issuance::audit::Actor {
    codepool_issuance::audit::Actor::operator(&s.operator.name, route)
}

/// Writes an operator's change to the audit log; a change that was made
/// but could not be recorded is reported, loudly, not hidden.
pub(crate) async fn audit(
    console: &Console,
    s: &Session,
    kind: codepool_issuance::model::AuditKind,
    command: &str,
    what: String,
) -> Result<(), Failure> {
    let action = codepool_issuance::model::Action {
        who: s.who(),
        kind,
        command: format!("console {command}"),
        what,
    };
    tracing::info!(operator = %s.operator.name, kind = kind.as_str(), command, "console action");
    console.core.record_action(&action).await.map_err(|e| {
        tracing::error!(error = %e, kind = kind.as_str(), "console action done but not audited");
        Failure::from(e)
    })
}
