//! `/console/operators` (admin): accounts, as `codepool operators`: add
//! (with a password the admin hands over), disable (its sessions end).

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Form;
use maud::{html, Markup};
use serde::Deserialize;

use crate::failure::Failure;
use crate::layout::{self, csrf, when};
use crate::sessions::Session;
use crate::state::Console;
use codepool_issuance::operators::{self, OperatorError, Role};

fn op_failure(e: OperatorError) -> Failure {
    match e {
        OperatorError::Store(e) => e.into(),
        OperatorError::Unknown(_) => Failure::NotFound(e.to_string()),
        OperatorError::NameTaken(_) => Failure::Conflict(e.to_string()),
        other => Failure::Invalid(other.to_string()),
    }
}

/// `GET /console/operators`.
pub async fn list(State(console): State<Arc<Console>>, s: Session) -> Result<Response, Failure> {
    s.need(Role::Admin)?;
    page(&console, &s, html! {}).await
}

async fn page(console: &Console, s: &Session, top: Markup) -> Result<Response, Failure> {
    let all = console.core.operators().await.map_err(op_failure)?;
    let body = html! {
        h1 { "Operators" }
        (top)
        table.operators { thead { tr { th { "Name" } th { "Role" } th { "Created" } th { "State" } th {} } }
            tbody { @for o in &all { tr data-operator=(o.name) {
                td { (o.name) } td { (o.role.as_str()) } td { (when(o.created_at)) }
                td { @if let Some(t) = o.disabled_at { "disabled " (when(t)) } @else { "active" } }
                td { @if o.disabled_at.is_none() && o.name != s.operator.name {
                    form.inline method="post" action="/console/operators/disable" {
                        (csrf(s)) input type="hidden" name="name" value=(o.name);
                        button.danger type="submit" { "Disable" }
                    }
                } }
            } } } }
        h2 { "New operator" }
        form.grid method="post" action="/console/operators" {
            (csrf(s))
            label { "Name " input name="name" required maxlength="64"; }
            label { "Role " select name="role" { @for r in Role::ALL { option value=(r.as_str()) { (r.as_str()) } } } }
            label { "Password (" (operators::MIN_PASSWORD) "+ characters) " input name="password" type="password" autocomplete="new-password" required; }
            button type="submit" { "Add operator" }
        }
        p.hint { "Operators change their password with " code { "codepool operators passwd --name NAME" } "." }
    };
    Ok(layout::page(s, "Operators", body).into_response())
}

#[derive(Debug, Deserialize)]
pub struct NewOperator {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    name: String,
    #[serde(default)]
    role: String,
    #[serde(default)]
    password: String,
}

/// `POST /console/operators`.
pub async fn create(
    State(console): State<Arc<Console>>,
    s: Session,
    Form(f): Form<NewOperator>,
) -> Result<Response, Failure> {
    s.check_csrf(&f.csrf)?;
    s.need(Role::Admin)?;
    let role = Role::parse(&f.role)
        .ok_or_else(|| Failure::Invalid("pick a role: viewer, support or admin".into()))?;
    let actor = super::actor(&s, "POST /console/operators");
    let op = console
        .core
        .add_operator(f.name.trim(), role, &f.password, &actor)
        .await
        .map_err(op_failure)?;
    page(
        &console,
        &s,
        layout::notice(&format!(
            "Operator {:?} added as {}.",
            op.name,
            role.as_str()
        )),
    )
    .await
}

#[derive(Debug, Deserialize)]
pub struct Named {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    name: String,
}

/// `POST /console/operators/disable`: its sessions end at once.
pub async fn disable(
    State(console): State<Arc<Console>>,
    s: Session,
    Form(f): Form<Named>,
) -> Result<Response, Failure> {
    s.check_csrf(&f.csrf)?;
    s.need(Role::Admin)?;
    let actor = super::actor(&s, "POST /console/operators/disable");
    let op = console
        .core
        .disable_operator(&f.name, &actor)
        .await
        .map_err(op_failure)?;
    page(
        &console,
        &s,
        layout::notice(&format!(
            "Operator {:?} disabled; their sessions ended.",
            op.name
        )),
    )
    .await
}
