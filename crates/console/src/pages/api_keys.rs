//! `/console/api-keys` (admin): the HTTP API's keys, as `codepool
//! api-keys`: create (the secret is shown once, in the answer), revoke.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Form;
use codepool_issuance::api_keys::{KeyError, Scope};
use maud::{html, Markup};

use crate::failure::Failure;
use crate::layout::{self, csrf, when};
use crate::sessions::Session;
use crate::state::Console;
use codepool_issuance::operators::Role;

fn key_failure(e: KeyError) -> Failure {
    match e {
        KeyError::Store(e) => e.into(),
        KeyError::Unknown(_) => Failure::NotFound(e.to_string()),
        other => Failure::Invalid(other.to_string()),
    }
}

/// `GET /console/api-keys`.
pub async fn list(State(console): State<Arc<Console>>, s: Session) -> Result<Response, Failure> {
    s.need(Role::Admin)?;
    page(&console, &s, html! {}).await
}

async fn page(console: &Console, s: &Session, top: Markup) -> Result<Response, Failure> {
    let all = console.core.api_keys().await.map_err(key_failure)?;
    let body = html! {
        h1 { "API keys" }
        (top)
        table.keys { thead { tr { th { "Name" } th { "Id" } th { "Shop" } th { "Scopes" } th { "Created" } th { "Revoked" } th {} } }
            tbody { @for k in &all { tr {
                td { (k.name) } td { code { (k.id) } }
                td.shop { (k.shop.as_deref().unwrap_or("—")) }
                td { (k.scopes.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")) }
                td { (when(k.created_at)) }
                td { (k.revoked_at.map(when).unwrap_or_else(|| "—".into())) }
                td { @if k.revoked_at.is_none() {
                    form.inline method="post" action="/console/api-keys/revoke" {
                        (csrf(s)) input type="hidden" name="name" value=(k.name);
                        button.danger type="submit" { "Revoke" }
                    }
                } }
            } } } }
        h2 { "New key" }
        form.grid method="post" action="/console/api-keys" {
            (csrf(s))
            label { "Name " input name="name" required maxlength="64"; }
            label { "Shop " input name="shop" maxlength="64" placeholder="none: the operator's key"; }
            fieldset { legend { "Scopes" }
                @for sc in Scope::ALL { label.check { input type="checkbox" name="scopes" value=(sc.as_str()); " " (sc.as_str()) } }
            }
            button type="submit" { "Create key" }
        }
    };
    Ok(layout::page(s, "API keys", body).into_response())
}

/// The fields of the new-key form (`scopes` repeats): csrf, name, scopes,
/// shop.
fn parse_form(raw: &[(String, String)]) -> (String, String, Vec<Scope>, String) {
    let get = |k: &str| {
        raw.iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    let scopes = raw
        .iter()
        .filter(|(n, _)| n == "scopes")
        .filter_map(|(_, v)| Scope::parse(v))
        .collect();
    (get("csrf"), get("name"), scopes, get("shop"))
}

/// `POST /console/api-keys`: the secret appears in this answer only.
pub async fn create(
    State(console): State<Arc<Console>>,
    s: Session,
    Form(raw): Form<Vec<(String, String)>>,
) -> Result<Response, Failure> {
    let (token, name, scopes, shop) = parse_form(&raw);
    s.check_csrf(&token)?;
    s.need(Role::Admin)?;
    let shop = Some(shop.trim()).filter(|s| !s.is_empty());
    let actor = super::actor(&s, "POST /console/api-keys");
    let new = console
        .core
        .create_api_key(name.trim(), &scopes, shop, &actor)
        .await
        .map_err(key_failure)?;
    let top = html! {
        section.secret {
            (layout::notice(&format!("Key {:?} created. Its secret is shown once: copy it into the shop's secret store now.", new.key.name)))
            pre.secret #new-secret { (new.token) }
        }
    };
    page(&console, &s, top).await
}

/// `POST /console/api-keys/revoke`.
pub async fn revoke(
    State(console): State<Arc<Console>>,
    s: Session,
    Form(raw): Form<Vec<(String, String)>>,
) -> Result<Response, Failure> {
    let (token, name, _, _) = parse_form(&raw);
    s.check_csrf(&token)?;
    s.need(Role::Admin)?;
    let actor = super::actor(&s, "POST /console/api-keys/revoke");
    let k = console
        .core
        .revoke_api_key(&name, &actor)
        .await
        .map_err(key_failure)?;
    page(
        &console,
        &s,
        layout::notice(&format!(
            "Key {:?} revoked; it stops working within a second.",
            k.name
        )),
    )
    .await
}
