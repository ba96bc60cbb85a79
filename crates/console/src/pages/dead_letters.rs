//! `/console/dead-letters` (admin): invalid purchases and why, grouped by
//! reason, and a replay once the cause is fixed, as `codepool
//! dead-letters list|replay` (they stay queued while listed).

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use axum::Form;
use codepool_broker::dead_letters;
use maud::html;
use serde::Deserialize;

use crate::failure::Failure;
use crate::layout::{self, count, csrf};
use crate::sessions::Session;
use crate::state::Console;
use codepool_issuance::operators::Role;

/// Dead letters listed or replayed at most at once.
const MOST: usize = 200;

#[derive(Debug, Default, Deserialize)]
pub struct Filter {
    reason: Option<String>,
}

fn reason_filter(r: &Option<String>) -> Option<&str> {
    r.as_deref().map(str::trim).filter(|r| !r.is_empty())
}

/// `GET /console/dead-letters?reason=…`.
pub async fn list(
    State(console): State<Arc<Console>>,
    s: Session,
    Query(f): Query<Filter>,
) -> Result<Response, Failure> {
    s.need(Role::Admin)?;
    list_page(&console, &s, reason_filter(&f.reason), None).await
}

async fn list_page(
    console: &Console,
    s: &Session,
    reason: Option<&str>,
    notice: Option<String>,
) -> Result<Response, Failure> {
    let broker = console.core.broker();
    let peeked = dead_letters::peek(&broker.conn, broker.publisher.topology(), reason, MOST)
        .await
        .map_err(|e| Failure::Unavailable(e.to_string()))?;
    let found = &peeked.letters;
    let mut by_reason: BTreeMap<&str, usize> = BTreeMap::new();
    for d in found {
        *by_reason.entry(d.reason.as_str()).or_default() += 1;
    }
    let body = html! {
        h1 { "Dead letters" }
        @if let Some(n) = &notice { (layout::notice(n)) }
        form.search method="get" action="/console/dead-letters" {
            label { "Reason starts with " input name="reason" value=(reason.unwrap_or_default()); }
            button type="submit" { "Filter" }
        }
        @if peeked.stopped_early {
            p.hint { "Only the oldest " (count(peeked.scanned as u64)) " letters were examined; replay or narrow them to see further." }
        }
        @if found.is_empty() { p { "No dead letter" @if let Some(r) = reason { " with reason " q { (r) } } "." } }
        @else {
            h2 { "By reason" }
            table.reasons { thead { tr { th { "Reason" } th { "Count" } th {} } }
                tbody { @for (r, n) in &by_reason { tr {
                    td { (r) } td.num { (n) }
                    td { a href={"/console/dead-letters?reason=" (layout::url_part(r))} { "only these" } }
                } } } }
            h2 { "Oldest first (up to " (MOST) ")" }
            table.dead { thead { tr { th { "Message id" } th { "Reason" } th { "Replays" } th { "Body (start)" } } }
                tbody { @for d in found { tr {
                    td { (d.message_id.clone().unwrap_or_default()) } td { (d.reason) }
                    td.num { (d.replays) } td { code { (d.body) } }
                } } } }
            form.inline method="post" action="/console/dead-letters/replay" {
                (csrf(s))
                input type="hidden" name="reason" value=(reason.unwrap_or_default());
                button type="submit" { "Replay " @if let Some(r) = reason { "those with reason " (r) } @else { "all" } }
            }
        }
    };
    Ok(layout::page(s, "Dead letters", body).into_response())
}

#[derive(Debug, Deserialize)]
pub struct ReplayForm {
    #[serde(default)]
    csrf: String,
    reason: Option<String>,
}

/// `POST /console/dead-letters/replay` (admin): back to the purchases
/// queue; those still invalid come back dead with their reason.
pub async fn replay(
    State(console): State<Arc<Console>>,
    s: Session,
    Form(f): Form<ReplayForm>,
) -> Result<Response, Failure> {
    s.check_csrf(&f.csrf)?;
    s.need(Role::Admin)?;
    let reason = reason_filter(&f.reason);
    let actor = super::actor(&s, "POST /console/dead-letters/replay");
    let sent = console
        .core
        .replay_dead_letters(reason, MOST, &actor)
        .await
        .map_err(|e| Failure::Unavailable(e.to_string()))?;
    list_page(
        &console,
        &s,
        reason,
        Some(format!(
            "{} dead letter(s) sent back to the purchases queue.",
            sent.len()
        )),
    )
    .await
}
