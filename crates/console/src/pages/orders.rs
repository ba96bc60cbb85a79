//! `/console/orders` (support): find an order by its id, the buyer's uid
//! or phone; its page shows the codes masked, grant numbers, SMS state and
//! receipts, with resend, void and replace one line's code (support) and
//! reveal (admin: audited before it is shown, shown once in the answer to
//! a POST, never in a URL). Every action is `codepool
//! lookup|resend|void|replace`'s own operation.

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Redirect, Response};
use axum::Form;
use codepool_domain::{Code, CodeStatus};
use codepool_issuance::model::CodeQuery;
use codepool_issuance::model::{CodeRef, LifecycleError, VoidOutcome};
use codepool_issuance::ops::{self, ResendError};
use codepool_issuance::replace::{self, ReplaceError};
use maud::{html, Markup};
use serde::Deserialize;

use crate::failure::Failure;
use crate::layout::{self, csrf, url_part, when_chrono};
use crate::sessions::Session;
use crate::state::Console;
use codepool_issuance::operators::Role;

/// Codes a uid or phone search lists at most (newest grants first).
const SEARCH_LIMIT: i64 = 50;

#[derive(Debug, Default, Deserialize)]
pub struct SearchQuery {
    #[serde(default)]
    q: String,
    /// `order` (default), `uid` or `phone`.
    by: Option<String>,
}

fn search_form(q: &SearchQuery) -> Markup {
    let by = q.by.as_deref().unwrap_or("order");
    html! {
        form.search method="get" action="/console/orders" role="search" {
            label { "Find " select name="by" {
                option value="order" selected[by == "order"] { "order id" }
                option value="uid" selected[by == "uid"] { "uid" }
                option value="phone" selected[by == "phone"] { "phone" }
            } }
            input name="q" value=(q.q) maxlength="256" required autofocus;
            button type="submit" { "Search" }
        }
    }
}

/// The table of codes. On an order's page, a support operator gets a
/// Replace form on each line whose code is issued (`replace`: the session
/// and the order id).
fn code_rows(codes: &[Code], with_order: bool, replace: Option<(&Session, &str)>) -> Markup {
    html! {
        table.codes {
            thead { tr {
                @if with_order { th { "Order" } th { "Pool" } }
                th { "Line" } th { "Code" } th { "Status" } th { "Grant no." } th { "Issued" } th { "SMS" } th { "Receipts" }
                @if replace.is_some() { th { "Replace" } }
            } }
            tbody { @for c in codes {
                // A code a hold or bundle set aside names it, never its key.
                @let h = c.order_holder();
                tr {
                    @if with_order {
                        td { @if let Some(h) = h { a href={"/console/orders/" (url_part(&h.order_id))} { (h.order_id) } } @else if let Some(aside) = c.set_aside() { (aside.to_string()) } }
                        td { (c.pool) }
                    }
                    td.num { (h.map_or(0, |h| h.line)) }
                    td.code { (c.masked()) }
                    td.status { (c.status.name()) @if let Some(r) = &c.void_reason { " (" (r) ")" } }
                    td { (h.and_then(|h| h.grant_no.clone()).unwrap_or_default()) }
                    td { (h.map(|h| when_chrono(h.issued_at)).unwrap_or_default()) }
                    td.sms { (c.sms_state().name()) }
                    td.receipts { @for e in &c.sms.history {
                        span.receipt { (e.event) " " (when_chrono(e.at)) @if let Some(err) = &e.error { ": " (err) } } br;
                    } }
                    @if let Some((s, id)) = replace {
                        td.replace { @if let (Some(h), CodeStatus::Issued) = (h, c.status) { (replace_form(s, id, h.line)) } }
                    }
                }
            } }
        }
    }
}

/// The Replace form of one line: the old code is void, the line gets a
/// fresh one. The replacement id is made when the page is drawn, so a
/// second click (or a form sent twice) is the same replacement.
fn replace_form(s: &Session, id: &str, line: u32) -> Markup {
    let action = format!("/console/orders/{}/lines/{line}/replace", url_part(id));
    let replacement_id = format!("console-{}", bson::oid::ObjectId::new().to_hex());
    html! {
        form.inline method="post" action=(action) {
            (csrf(s))
            input type="hidden" name="replacement_id" value=(replacement_id);
            input name="reason" placeholder="reason, e.g. code rejected" required maxlength="200";
            button.danger type="submit" .replace-line { "Replace" }
        }
    }
}

/// What the order's replacements did, oldest first.
fn replacement_rows(l: &ops::Lookup) -> Markup {
    html! {
        @if !l.replacements.is_empty() {
            h2 { "Replacements" }
            table.replacements {
                thead { tr { th { "Line" } th { "State" } th { "Reason" } th { "By" } th { "At" } th { "Old grant no." } th { "New grant no." } } }
                tbody { @for r in &l.replacements { tr {
                    td.num { (r.line()) }
                    td.state { (r.state.as_str()) }
                    td { (r.reason) }
                    td { (r.who) }
                    td { (when_chrono(r.created_at.to_chrono())) }
                    td { (r.old_grant_no.clone().unwrap_or_default()) }
                    td { (r.new_grant_no.clone().unwrap_or_default()) }
                } } }
            }
        }
        @if !l.replaced.is_empty() {
            h2 { "Replaced codes" }
            (code_rows(&l.replaced, false, None))
        }
    }
}

/// `GET /console/orders?by=order|uid|phone&q=…`.
pub async fn search(
    State(console): State<Arc<Console>>,
    s: Session,
    Query(q): Query<SearchQuery>,
) -> Result<Response, Failure> {
    s.need(Role::Support)?;
    let text = q.q.trim().to_owned();
    let core = &console.core;
    let found = match (q.by.as_deref().unwrap_or("order"), text.is_empty()) {
        (_, true) => None,
        ("uid", _) => Some(core.lookup(CodeQuery::Uid(&text), SEARCH_LIMIT).await?),
        ("phone", _) => Some(core.lookup(CodeQuery::Phone(&text), SEARCH_LIMIT).await?),
        _ => {
            let l = core.lookup(CodeQuery::Order(&text), SEARCH_LIMIT).await?;
            if !l.is_empty() {
                return Ok(
                    Redirect::to(&format!("/console/orders/{}", url_part(&text))).into_response(),
                );
            }
            Some(l)
        }
    };
    let body = html! {
        h1 { "Orders" }
        (search_form(&q))
        @match &found {
            None => p.hint { "An order id opens the order; a uid or a phone number lists the latest "
                (SEARCH_LIMIT) " codes granted to that buyer." },
            Some(l) if l.codes.is_empty() => p.problem role="status" { "Nothing found for " q { (text) } "." },
            Some(l) => (code_rows(&l.codes, true, None)),
        }
    };
    Ok(layout::page(&s, "Orders", body).into_response())
}

fn actions(s: &Session, id: &str) -> Markup {
    let base = format!("/console/orders/{}", url_part(id));
    html! {
        section.actions {
            @if s.operator.may(Role::Support) {
                form.inline method="post" action={(base) "/resend"} {
                    (csrf(s)) button type="submit" #resend { "Resend SMS" }
                }
                form.inline method="post" action={(base) "/void"} {
                    (csrf(s))
                    input name="reason" placeholder="reason, e.g. refund" required maxlength="200";
                    button.danger type="submit" #void { "Void the order" }
                }
            }
            @if s.operator.may(Role::Admin) {
                form.inline method="post" action={(base) "/reveal"} {
                    (csrf(s)) button type="submit" #reveal { "Reveal codes (audited)" }
                }
            }
        }
    }
}

async fn order_page(
    console: &Console,
    s: &Session,
    id: &str,
    notice: Option<String>,
) -> Result<Response, Failure> {
    let l = console.core.lookup(CodeQuery::Order(id), 100).await?;
    if l.is_empty() {
        return Err(Failure::NotFound(format!("codepool knows no order {id:?}: no code, no backorder, no refusal. Check the id, or whether the purchase was dead-lettered")));
    }
    let first = l.codes.first().and_then(|c| c.holder.as_ref());
    let waiting = l.waiting_lines();
    let replace = s.operator.may(Role::Support).then_some((s, id));
    let body = html! {
        h1 { "Order " q.order-id { (id) } }
        @if let Some(n) = &notice { (layout::notice(n)) }
        dl.order {
            dt { "State" } dd.state { (l.state().map_or("unknown", |s| s.label())) }
            dt { "Pool" } dd { (l.codes.first().map(|c| c.pool.clone()).or_else(|| l.backorders.first().map(|b| b.pool.clone())).unwrap_or_default()) }
            dt { "Buyer (uid)" } dd.uid { (first.map(|h| h.uid.clone()).or_else(|| l.backorders.first().map(|b| b.uid.clone())).unwrap_or_default()) }
            dt { "Phone" } dd.phone { (first.map(|h| h.phone.clone()).or_else(|| l.backorders.first().map(|b| b.phone.clone())).unwrap_or_default()) }
            @if !waiting.is_empty() { dt { "Lines waiting for stock" } dd.waiting { (format!("{waiting:?}")) } }
            @for r in &l.refusals { dt { "Refused" } dd { (r.reason.as_str()) @if let Some(n) = r.limit { " (limit " (n) ")" } } }
        }
        @if !l.codes.is_empty() { (code_rows(&l.codes, false, replace)) }
        (replacement_rows(&l))
        (actions(s, id))
    };
    Ok(layout::page(s, &format!("Order {id}"), body).into_response())
}

/// `GET /console/orders/{id}`.
pub async fn show(
    State(console): State<Arc<Console>>,
    s: Session,
    Path(id): Path<String>,
) -> Result<Response, Failure> {
    s.need(Role::Support)?;
    order_page(&console, &s, &id, None).await
}

#[derive(Debug, Deserialize)]
pub struct ActionForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    reason: String,
}

/// `POST /console/orders/{id}/resend` (support): the order's SMS-pending
/// events again, confirmed, as `codepool resend`.
pub async fn resend(
    State(console): State<Arc<Console>>,
    s: Session,
    Path(id): Path<String>,
    Form(f): Form<ActionForm>,
) -> Result<Response, Failure> {
    s.check_csrf(&f.csrf)?;
    s.need(Role::Support)?;
    let core = &console.core;
    let actor = super::actor(&s, "POST /console/orders/{id}/resend");
    let events = match core.resend(&id, &actor).await {
        Ok((events, _)) => events,
        Err(ResendError::Store(e)) => return Err(e.into()),
        Err(e @ ResendError::Unconfirmed(_)) => return Err(Failure::Unavailable(e.to_string())),
        Err(e) => return Err(Failure::Conflict(e.to_string())),
    };
    order_page(
        &console,
        &s,
        &id,
        Some(format!(
            "SMS sent again: {} event(s) published.",
            events.len()
        )),
    )
    .await
}

/// `POST /console/orders/{id}/void` (support): every code of the order,
/// and what it still waits for, with a reason, as `codepool void --order`.
pub async fn void(
    State(console): State<Arc<Console>>,
    s: Session,
    Path(id): Path<String>,
    Form(f): Form<ActionForm>,
) -> Result<Response, Failure> {
    s.check_csrf(&f.csrf)?;
    s.need(Role::Support)?;
    let reason = ops::checked_reason(&f.reason).ok_or_else(|| {
        Failure::Invalid(format!(
            "a void needs a reason: 1 to {} characters saying why",
            ops::MAX_REASON_CHARS
        ))
    })?;
    let actor = super::actor(&s, "POST /console/orders/{id}/void");
    let core = &console.core;
    let voided = core.void(CodeRef::Order(&id), reason, &actor).await;
    let done = match voided {
        Ok(VoidOutcome::Voided {
            applied,
            backorder_cancelled,
        }) => format!(
            "{} code(s) voided{}",
            applied.len(),
            if backorder_cancelled {
                ", the backorder cancelled"
            } else {
                ""
            }
        ),
        Ok(VoidOutcome::BackorderCancelled { .. }) => "the backorder cancelled".to_owned(),
        Err(e @ ops::VoidError::Reserved(_)) => return Err(Failure::Invalid(e.to_string())),
        Err(ops::VoidError::Lifecycle(LifecycleError::Store(e))) => return Err(e.into()),
        Err(ops::VoidError::Lifecycle(e @ LifecycleError::NotFound { .. })) => {
            return Err(Failure::NotFound(e.to_string()))
        }
        Err(e) => return Err(Failure::Conflict(e.to_string())),
    };
    order_page(&console, &s, &id, Some(format!("Voided: {done}."))).await
}

/// `POST /console/orders/{id}/reveal` (admin): written to the audit log
/// first (no record, no reveal), then the codes in this answer only.
pub async fn reveal(
    State(console): State<Arc<Console>>,
    s: Session,
    Path(id): Path<String>,
    Form(f): Form<ActionForm>,
) -> Result<Response, Failure> {
    s.check_csrf(&f.csrf)?;
    s.need(Role::Admin)?;
    let actor = super::actor(&s, "POST /console/orders/{id}/reveal");
    // Recorded before anything is shown (no record, no reveal).
    let l = console.core.reveal_order(&id, &actor).await?;
    if l.codes.is_empty() {
        return Err(Failure::NotFound(format!(
            "order {id:?} holds no code to reveal"
        )));
    }
    tracing::info!(operator = %s.operator.name, order_id = %id, count = l.codes.len(), "codes revealed in the console");
    let body = html! {
        h1 { "Codes of order " q { (id) } }
        p.problem role="alert" { "Shown once, and recorded in the audit log with your name. Leaving or reloading this page hides them." }
        table.revealed { thead { tr { th { "Line" } th { "Code" } th { "Status" } } }
            tbody { @for c in &l.codes { tr {
                td.num { (c.holder.as_ref().map_or(0, |h| h.line)) }
                td.code.plain { (c.code) }
                td { (c.status.name()) }
            } } } }
        p { a href={"/console/orders/" (url_part(&id))} { "Back to the order (codes masked)" } }
    };
    Ok(layout::page(&s, "Revealed codes", body).into_response())
}

#[derive(Debug, Deserialize)]
pub struct ReplaceForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    reason: String,
    #[serde(default)]
    replacement_id: String,
}

/// `POST /console/orders/{id}/lines/{line}/replace` (support): the line's
/// code void, a fresh one texted, as `codepool replace`. The form carries
/// its replacement id: sent twice, it replaces once.
pub async fn replace(
    State(console): State<Arc<Console>>,
    s: Session,
    Path((id, line)): Path<(String, u32)>,
    Form(f): Form<ReplaceForm>,
) -> Result<Response, Failure> {
    s.check_csrf(&f.csrf)?;
    s.need(Role::Support)?;
    let core = &console.core;
    let ask = replace::Ask {
        order_id: &id,
        line,
        replacement_id: &f.replacement_id,
        reason: &f.reason,
    };
    let actor = super::actor(&s, "POST /console/orders/{id}/lines/{line}/replace");
    let done = match core.replace(&ask, &actor).await {
        Ok(done) => done,
        Err(ReplaceError::Store(e)) => return Err(e.into()),
        Err(e) if e.is_unavailable() => return Err(Failure::Unavailable(e.to_string())),
        Err(e @ ReplaceError::NoLine { .. }) => return Err(Failure::NotFound(e.to_string())),
        Err(e @ (ReplaceError::Reason | ReplaceError::Id)) => {
            return Err(Failure::Invalid(e.to_string()))
        }
        Err(e) => return Err(Failure::Conflict(e.to_string())),
    };
    let notice = match (&done.code, done.began) {
        (Some(c), true) => format!("Line {line} replaced: the new code {} goes to the buyer by SMS.", c.masked()),
        (Some(c), false) => format!("Line {line} was replaced already (the same form): its new code is {}.", c.masked()),
        (None, _) => format!("Line {line}: the code is void, and the line waits for stock; its new code goes by SMS after the next import."),
    };
    order_page(&console, &s, &id, Some(notice)).await
}
