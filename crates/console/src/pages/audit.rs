//! `/console/audit` (admin): every reveal and every change, newest first,
//! filtered by who and kind, by pages of [`PAGE`] (`before` an id).

use std::sync::Arc;

use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use codepool_issuance::model::ObjectId;
use codepool_issuance::model::{AuditFilter, AuditKind};
use maud::html;
use serde::Deserialize;

use crate::failure::Failure;
use crate::layout::{self, url_part, when};
use crate::sessions::Session;
use crate::state::Console;
use codepool_issuance::operators::Role;

/// Records per page.
const PAGE: i64 = 100;

#[derive(Debug, Default, Deserialize)]
pub struct AuditQuery {
    who: Option<String>,
    kind: Option<String>,
    before: Option<String>,
}

fn nonempty(v: &Option<String>) -> Option<&str> {
    v.as_deref().map(str::trim).filter(|v| !v.is_empty())
}

/// `GET /console/audit?who=operator:alice&kind=void&before=ID`.
pub async fn list(
    State(console): State<Arc<Console>>,
    s: Session,
    Query(q): Query<AuditQuery>,
) -> Result<Response, Failure> {
    s.need(Role::Admin)?;
    let (who, kind) = (nonempty(&q.who), nonempty(&q.kind));
    let kind = kind.map(str::parse::<AuditKind>).transpose();
    let kind = kind.map_err(|e| Failure::Invalid(e.to_string()))?;
    let before = nonempty(&q.before).and_then(|b| ObjectId::parse_str(b).ok());
    let filter = AuditFilter { who, kind, before };
    let kind = kind.map(AuditKind::as_str);
    let entries = console.core.audit_page(&filter, PAGE).await?;
    let more = (entries.len() as i64 == PAGE)
        .then(|| entries.last().map(|e| e.id.to_hex()))
        .flatten();
    let body = html! {
        h1 { "Audit log" }
        form.search method="get" action="/console/audit" {
            label { "Who " input name="who" value=(who.unwrap_or_default()) placeholder="operator:alice or api-key:shop"; }
            label { "Kind " input name="kind" list="audit-kinds" value=(kind.unwrap_or_default()) placeholder="void, resend, reveal, …"; }
            datalist #audit-kinds { @for k in AuditKind::ALL { option value=(k.as_str()) {} } }
            button type="submit" { "Filter" }
        }
        table.audit { thead { tr { th { "When" } th { "Who" } th { "Kind" } th { "What" } th { "Where" } } }
            tbody { @for e in &entries { tr {
                td { (when(e.at)) } td.who { (e.who) } td.kind { (e.kind) }
                td.what { (e.what) @if e.kind.is(AuditKind::Reveal) { " (" (e.count) " codes)" } }
                td { (e.command) }
            } } } }
        @if let Some(b) = more {
            nav.pager { a.next href={"/console/audit?who=" (url_part(who.unwrap_or_default())) "&kind=" (url_part(kind.unwrap_or_default())) "&before=" (b)} { "Older" } }
        }
    };
    Ok(layout::page(&s, "Audit", body).into_response())
}
