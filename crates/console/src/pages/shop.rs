//! `/console/shops/{name}` (admin): one shop, its webhook endpoints, their
//! recent deliveries, and the forms of `codepool webhooks`: add an
//! endpoint (its secret shown once), disable or enable one, and replay one
//! event or every event since a time.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::Form;
use codepool_issuance::webhooks::{self, events::EVENT_TYPES, WebhookError};
use maud::{html, Markup};
use serde::Deserialize;

use crate::failure::Failure;
use crate::layout::{self, csrf, when};
use crate::sessions::Session;
use crate::state::Console;
use codepool_issuance::operators::Role;

fn hook_failure(e: WebhookError) -> Failure {
    match e {
        WebhookError::Store(e) => e.into(),
        WebhookError::UnknownShop(_) | WebhookError::UnknownEndpoint(_) => {
            Failure::NotFound(e.to_string())
        }
        other => Failure::Invalid(other.to_string()),
    }
}

/// The forms of this page; each uses the fields it needs.
#[derive(Debug, Deserialize)]
pub struct HookForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    url: String,
    /// Comma-separated event types, or `*`.
    #[serde(default)]
    events: String,
    #[serde(default)]
    id: String,
    /// `enable` or `disable`.
    #[serde(default)]
    action: String,
    /// An event id (`msg_…`) or a time (RFC 3339).
    #[serde(default)]
    what: String,
    /// Replay events older than the endpoint too (a ticked box).
    #[serde(default)]
    include_before_endpoint: Option<String>,
}

/// `GET /console/shops/{name}`.
pub async fn show(
    State(console): State<Arc<Console>>,
    s: Session,
    Path(name): Path<String>,
) -> Result<Response, Failure> {
    s.need(Role::Admin)?;
    page(&console, &s, &name, html! {}).await
}

async fn page(
    console: &Console,
    s: &Session,
    name: &str,
    top: Markup,
) -> Result<Response, Failure> {
    let core = &console.core;
    let shop = core
        .shop(name)
        .await?
        .ok_or_else(|| Failure::NotFound(format!("no shop is named {name:?}")))?;
    let endpoints = core.webhook_endpoints(Some(name)).await?;
    let recent = core
        .webhook_deliveries(Some(name), None, 30)
        .await
        .map_err(hook_failure)?;
    let action = |what: &str| {
        format!(
            "/console/shops/{}/webhooks/{what}",
            crate::frame::url_part(name)
        )
    };
    let body = html! {
        h1 { "Shop " (shop.name) }
        (top)
        p { "Orders from: " (shop.pools.join(", ")) }
        h2 { "Webhook endpoints" }
        @if endpoints.is_empty() { p.hint { "No endpoint yet: add one below to be told of grants, voids, refusals and stock." } }
        @else { table.endpoints { thead { tr { th { "Id" } th { "URL" } th { "Events" } th { "State" } th { "" } } }
            tbody { @for e in &endpoints { tr data-endpoint=(e.id) {
                td.id { code { (e.id) } }
                td.url { (e.url) }
                td { (e.events.join(", ")) }
                td.state {
                    @if e.enabled { "enabled" } @else { "disabled" }
                    @if let Some(why) = &e.disabled_reason { br; small { (why) } }
                    @if let Some(t) = e.failing_since { br; small { "failing since " (when(t)) } }
                }
                td { form.inline method="post" action=(action("toggle")) {
                    (csrf(s)) input type="hidden" name="id" value=(e.id);
                    @if e.enabled { input type="hidden" name="action" value="disable"; button type="submit" { "Disable" } }
                    @else { input type="hidden" name="action" value="enable"; button type="submit" { "Enable" } }
                } }
            } } } }
        }
        h2 { "Recent deliveries" }
        table.deliveries { thead { tr { th { "At" } th { "Event" } th { "Type" } th { "Try" } th { "Outcome" } th { "Status" } th { "ms" } } }
            tbody { @for a in &recent { tr {
                td { (when(a.at)) } td { code { (a.event) } } td { (a.kind) } td { (a.attempt) }
                td.outcome { (a.outcome) } td { (a.status.map_or_else(|| "-".to_owned(), |s| s.to_string())) } td { (a.latency_ms) }
            } } } }
        h2 { "Replay" }
        form.grid.replay method="post" action=(action("replay")) {
            (csrf(s))
            label { "Event id or since " input name="what" required placeholder="msg_… or 2026-11-25T10:00:00Z"; }
            label { input type="checkbox" name="include_before_endpoint" value="yes";
                " also events older than the endpoint (their codes are audited as revealed to you)" }
            button type="submit" { "Replay" }
        }
        h2 { "Add an endpoint" }
        p.hint { "Event types: " (EVENT_TYPES.join(", ")) ", or * for all. Only https to public addresses." }
        form.grid.new-endpoint method="post" action=(action("add")) {
            (csrf(s))
            label { "URL " input name="url" required type="url" placeholder="https://shop.example/hooks"; }
            label { "Events " input name="events" required value="*"; }
            button type="submit" { "Add endpoint" }
        }
    };
    Ok(layout::page(s, &format!("Shop {name}"), body).into_response())
}

/// `POST /console/shops/{name}/webhooks/add`: shows the secret once.
pub async fn add(
    State(console): State<Arc<Console>>,
    s: Session,
    Path(name): Path<String>,
    Form(f): Form<HookForm>,
) -> Result<Response, Failure> {
    s.check_csrf(&f.csrf)?;
    s.need(Role::Admin)?;
    let actor = super::actor(&s, "POST /console/shops/{name}/webhooks/add");
    let added = console
        .core
        .add_webhook(&name, &f.url, &f.events, &actor)
        .await
        .map_err(hook_failure)?;
    let top = html! {
        (layout::notice(&format!("Endpoint {} added.", added.endpoint.id)))
        p.secret { "Its signing secret, shown this once: " code.secret { (added.secret) } }
    };
    page(&console, &s, &name, top).await
}

/// `POST /console/shops/{name}/webhooks/toggle`.
pub async fn toggle(
    State(console): State<Arc<Console>>,
    s: Session,
    Path(name): Path<String>,
    Form(f): Form<HookForm>,
) -> Result<Response, Failure> {
    s.check_csrf(&f.csrf)?;
    s.need(Role::Admin)?;
    let core = &console.core;
    core.webhook_endpoint(&f.id, Some(&name))
        .await
        .map_err(hook_failure)?;
    let on = f.action == "enable";
    let actor = super::actor(&s, "POST /console/shops/{name}/webhooks/toggle");
    let e = core
        .set_webhook_enabled(&f.id, on, &actor)
        .await
        .map_err(hook_failure)?;
    let state = if e.enabled { "enabled" } else { "disabled" };
    page(
        &console,
        &s,
        &name,
        layout::notice(&format!("Endpoint {} {state}.", e.id)),
    )
    .await
}

/// `POST /console/shops/{name}/webhooks/replay`.
pub async fn replay(
    State(console): State<Arc<Console>>,
    s: Session,
    Path(name): Path<String>,
    Form(f): Form<HookForm>,
) -> Result<Response, Failure> {
    s.check_csrf(&f.csrf)?;
    s.need(Role::Admin)?;
    let scope = webhooks::replay_scope(&f.what).map_err(hook_failure)?;
    let actor = super::actor(&s, "POST /console/shops/{name}/webhooks/replay");
    let include = f.include_before_endpoint.is_some();
    let r = console
        .core
        .replay_webhooks(&name, &scope, None, include, &actor)
        .await
        .map_err(hook_failure)?;
    let left_out = if r.left_out > 0 {
        format!(
            " {} left out: events older than the endpoint they would go to (tick the box to send them).",
            r.left_out
        )
    } else {
        String::new()
    };
    page(
        &console,
        &s,
        &name,
        layout::notice(&format!("{} deliveries due again.{left_out}", r.due)),
    )
    .await
}
