//! `/console/pools/{pool}`: a pool's stock (live), its chart, settings,
//! pause/resume, the import upload form, the form that generates codes,
//! and its imports (generation runs among them) with their
//! counts and a recall that asks for a reason and a confirmation. Every
//! change goes through the operation `codepool pool` and `codepool void
//! --import` use.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::Form;
use codepool_domain::pattern::DEFAULT_PATTERN;
use codepool_issuance::controls::{PauseError, RecallError};
use codepool_issuance::model::PoolStats;
use codepool_issuance::model::{PoolSettings, PoolSettingsError};
use maud::{html, Markup};
use serde::Deserialize;

use super::CsrfOnly;
use crate::chart;
use crate::failure::Failure;
use crate::layout::{self, count, csrf, url_part, when};
use crate::sessions::Session;
use crate::state::Console;
use codepool_issuance::operators::Role;

/// Imports listed on a pool's page (newest first).
const IMPORTS_SHOWN: i64 = 20;

/// The stock chart of `pool` ([`chart`]).
pub(crate) async fn stock_chart(console: &Console, pool: &str) -> Result<Markup, Failure> {
    let core = &console.core;
    let now = chrono::Utc::now();
    let since = now - chrono::Duration::hours(chart::HOURS + 1);
    let stock = core.unissued_stock(pool).await?;
    let grants: Vec<_> = core
        .grants_by_hour(pool, bson::DateTime::from_chrono(since))
        .await?
        .into_iter()
        .map(|(t, n)| (t.to_chrono(), n))
        .collect();
    let imports: Vec<_> = core
        .imports_of(pool, 200)
        .await?
        .into_iter()
        .filter_map(|r| Some((r.finished_at?.to_chrono(), r.inserted)))
        .filter(|(t, _)| *t > since)
        .collect();
    let points = chart::stock_points(now, stock, &grants, &imports);
    Ok(chart::svg(pool, &points))
}

async fn one_pool_stats(console: &Console, pool: &str) -> Result<PoolStats, Failure> {
    let mut stats = console.core.stats_of(&[pool]).await?;
    Ok(stats.pop().unwrap_or_default())
}

/// The live numbers of a pool; they poll for themselves again.
fn live_numbers(console: &Console, pool: &str, s: &PoolStats) -> Markup {
    let every = console.cfg.live_every.as_secs().max(1);
    html! {
        dl.stock #pool-live hx-get={"/console/pools/" (url_part(pool)) "/live"}
            hx-trigger={"every " (every) "s"} hx-swap="outerHTML" {
            dt { "Unissued" } dd.unissued { (count(s.unissued)) }
            dt { "Issued" } dd { (count(s.issued)) }
            dt { "Used" } dd { (count(s.used)) }
            dt { "Void" } dd { (count(s.void)) }
            dt { "Held for checkouts" } dd { (count(s.held)) }
            dt { "Expired, not yet voided" } dd { (count(s.expired)) }
            dt { "Issued, last hour / 24 h" } dd { (count(s.issued_last_hour)) " / " (count(s.issued_last_day)) }
            dt { "Backorders waiting" } dd { (count(s.backorders_waiting)) }
        }
    }
}

/// `GET /console/pools/{pool}/live`: the numbers alone.
pub async fn live(
    State(console): State<Arc<Console>>,
    s: Session,
    Path(pool): Path<String>,
) -> Result<Response, Failure> {
    s.need(Role::Viewer)?;
    let stats = one_pool_stats(&console, &pool).await?;
    Ok(Html(live_numbers(&console, &pool, &stats).into_string()).into_response())
}

fn admin_forms(s: &Session, pool: &str, doc: &codepool_issuance::model::PoolDoc) -> Markup {
    let base = format!("/console/pools/{}", url_part(pool));
    html! {
        section.admin {
            h2 { "Settings" }
            form.grid method="post" action={(base) "/settings"} {
                (csrf(s))
                label { "Low-stock threshold" input name="low_stock" inputmode="numeric" placeholder=[doc.low_stock.map(|v| v.to_string())]; }
                label { "Grant prefix" input name="grant_prefix" placeholder=[doc.grant_prefix.clone()]; }
                label { "Codes per user (0 = unlimited)" input name="per_user" inputmode="numeric" placeholder=[doc.per_user.map(|v| v.to_string())]; }
                button type="submit" { "Save settings" }
            }
            @if doc.paused {
                form.inline method="post" action={(base) "/resume"} { (csrf(s)) button type="submit" { "Resume issuing" } }
            } @else {
                form.inline method="post" action={(base) "/pause"} { (csrf(s)) button type="submit" { "Pause issuing" } }
            }
            h2 { "Import codes" }
            form.upload method="post" action={(base) "/imports"} enctype="multipart/form-data" {
                (csrf(s))
                label { "Code column " input name="column" value="code"; }
                label.check { input type="checkbox" name="no_header" value="true"; " The file has no header row" }
                label { "CSV file " input type="file" name="file" accept=".csv,.txt,text/csv,text/plain" required; }
                button type="submit" { "Upload and import" }
            }
            h2 { "Generate codes" }
            form.grid.generate method="post" action={(base) "/generations"} {
                (csrf(s))
                label { "Number of codes " input name="count" inputmode="numeric" required; }
                label { "Pattern " input name="pattern" value=(DEFAULT_PATTERN); }
                label.check { input type="checkbox" name="check_char" value="true"; " End each code with a check symbol" }
                p.hint { "Random symbols are Crockford base 32 (5 bits each): under 60 random bits codes can be guessed, under 40 the pattern is refused." }
                button type="submit" { "Generate" }
            }
        }
    }
}

fn imports_table(s: &Session, imports: &[codepool_issuance::model::ImportRecord]) -> Markup {
    html! {
        h2 { "Imports" }
        @if imports.is_empty() { p { "No import into this pool yet." } }
        @else {
            table.imports {
                thead { tr { th { "Started" } th { "File" } th { "Status" } th { "Rows" } th { "Inserted" }
                    th { "Duplicates" } th { "Invalid" } @if s.operator.may(Role::Admin) { th { "Recall" } } } }
                tbody { @for r in imports { tr {
                    td { (when(r.started_at)) }
                    td { (r.file) }
                    td { (r.status) }
                    td.num { (count(r.rows)) } td.num { (count(r.inserted)) }
                    td.num { (count(r.duplicates)) } td.num { (count(r.invalid)) }
                    @if s.operator.may(Role::Admin) { td {
                        form.recall method="post" action={"/console/imports/" (r.id.to_hex()) "/recall"} {
                            (csrf(s))
                            input name="reason" placeholder="reason, e.g. partner leak" required maxlength="200";
                            label.check { input type="checkbox" name="confirm" value="yes" required;
                                " void every unissued code of this import" }
                            button.danger type="submit" { "Recall" }
                        }
                    } }
                } } }
            }
        }
    }
}

/// `GET /console/pools/{pool}`.
pub async fn show(
    State(console): State<Arc<Console>>,
    s: Session,
    Path(pool): Path<String>,
) -> Result<Response, Failure> {
    s.need(Role::Viewer)?;
    let doc =
        console.core.pool(&pool).await?.ok_or_else(|| {
            Failure::NotFound(format!("no pool {pool:?}; the pools page lists them"))
        })?;
    let stats = one_pool_stats(&console, &pool).await?;
    let chart = stock_chart(&console, &pool).await?;
    let imports = console.core.imports_of(&pool, IMPORTS_SHOWN).await?;
    let body = html! {
        h1 { "Pool " (pool) @if doc.paused { " " span.badge { "paused" } } }
        p { a href={"/console/pools/" (url_part(&pool)) "/statement"} { "Statement: what became of every import's codes" } }
        (live_numbers(&console, &pool, &stats))
        figure.stock { (chart) figcaption { "Unissued stock over the last 24 hours." } }
        h2 { "Settings" }
        dl.settings {
            dt { "Low-stock threshold" } dd { (doc.low_stock.map_or("none".into(), |v| count(v as u64))) }
            dt { "Grant prefix" } dd { (doc.grant_prefix.clone().unwrap_or_else(|| "G".into())) }
            dt { "Codes per user" } dd { (doc.per_user.filter(|v| *v > 0).map_or("unlimited".into(), |v| v.to_string())) }
            dt { "Codes differ by case" } dd { (if doc.case_sensitive_codes { "yes" } else { "no" }) }
            dt { "O reads as 0, I and L as 1" } dd { (if doc.fold_confusables { "yes" } else { "no" }) }
            dt { "Created" } dd { (when(doc.created_at)) }
        }
        @if s.operator.may(Role::Admin) { (admin_forms(&s, &pool, &doc)) }
        (imports_table(&s, &imports))
    };
    Ok(layout::page(&s, &format!("Pool {pool}"), body).into_response())
}

#[derive(Debug, Deserialize)]
pub struct SettingsForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    low_stock: String,
    #[serde(default)]
    grant_prefix: String,
    #[serde(default)]
    per_user: String,
}

fn number(field: &str, v: &str) -> Result<Option<i64>, Failure> {
    let v = v.trim();
    if v.is_empty() {
        return Ok(None);
    }
    v.parse()
        .map(Some)
        .map_err(|_| Failure::Invalid(format!("{field} must be a whole number, not {v:?}")))
}

fn settings_failure(e: PoolSettingsError) -> Failure {
    match e {
        PoolSettingsError::Store(e) => e.into(),
        PoolSettingsError::UnknownPool(p) => Failure::NotFound(format!("no pool {p:?}")),
        PoolSettingsError::CaseRuleFixed { .. } => Failure::Conflict(e.to_string()),
        other => Failure::Invalid(other.to_string()),
    }
}

/// `POST /console/pools/{pool}/settings` (admin): the fields left empty
/// are not changed.
pub async fn settings(
    State(console): State<Arc<Console>>,
    s: Session,
    Path(pool): Path<String>,
    Form(f): Form<SettingsForm>,
) -> Result<Response, Failure> {
    s.check_csrf(&f.csrf)?;
    s.need(Role::Admin)?;
    let settings = PoolSettings {
        low_stock: number("the low-stock threshold", &f.low_stock)?,
        grant_prefix: Some(f.grant_prefix.trim().to_owned()).filter(|p| !p.is_empty()),
        per_user: number("codes per user", &f.per_user)?,
        case_sensitive_codes: None,
        fold_confusables: None,
        hold_share: None,
        holds_per_uid: None,
        hold_share_per_owner: None,
        replacements_per_order: None,
    };
    let what = format!("{settings:?}");
    let actor = super::actor(&s, "POST /console/pools/{pool}/settings");
    match console
        .core
        .set_pool_settings(&pool, &settings, &what, &actor)
        .await
    {
        Ok(()) => {}
        Err(PauseError::Pool(e)) => return Err(settings_failure(e)),
        Err(e) => return Err(Failure::Unavailable(e.to_string())),
    }
    Ok(Redirect::to(&format!("/console/pools/{}", url_part(&pool))).into_response())
}

/// `POST /console/pools/{pool}/pause` (admin).
pub async fn pause(
    state: State<Arc<Console>>,
    s: Session,
    pool: Path<String>,
    Form(f): Form<CsrfOnly>,
) -> Result<Response, Failure> {
    set_paused(state, s, pool, f, true).await
}

/// `POST /console/pools/{pool}/resume` (admin).
pub async fn resume(
    state: State<Arc<Console>>,
    s: Session,
    pool: Path<String>,
    Form(f): Form<CsrfOnly>,
) -> Result<Response, Failure> {
    set_paused(state, s, pool, f, false).await
}

async fn set_paused(
    State(console): State<Arc<Console>>,
    s: Session,
    Path(pool): Path<String>,
    f: CsrfOnly,
    paused: bool,
) -> Result<Response, Failure> {
    s.check_csrf(&f.csrf)?;
    s.need(Role::Admin)?;
    let kind = if paused { "pause" } else { "resume" };
    let actor = super::actor(&s, &format!("POST /console/pools/{{pool}}/{kind}"));
    let set = console.core.set_paused(&pool, paused, &actor);
    match set.await {
        Ok(_) => {}
        Err(PauseError::Pool(e)) => return Err(settings_failure(e)),
        Err(e) => return Err(Failure::Unavailable(e.to_string())),
    };
    Ok(Redirect::to(&format!("/console/pools/{}", url_part(&pool))).into_response())
}

#[derive(Debug, Deserialize)]
pub struct RecallForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    reason: String,
    #[serde(default)]
    confirm: String,
}

/// `POST /console/imports/{id}/recall` (admin): a reason, and the box
/// that confirms it, or nothing is voided.
pub async fn recall(
    State(console): State<Arc<Console>>,
    s: Session,
    Path(id): Path<String>,
    Form(f): Form<RecallForm>,
) -> Result<Response, Failure> {
    s.check_csrf(&f.csrf)?;
    s.need(Role::Admin)?;
    if f.confirm != "yes" {
        return Err(Failure::Invalid("tick the box that confirms the recall: it voids every unissued code of the import, for good".into()));
    }
    let core = &console.core;
    let actor = super::actor(&s, "POST /console/imports/{id}/recall");
    let recalled = core.recall_import(&id, &f.reason, &actor);
    let r = match recalled.await {
        Ok(r) => r,
        Err(
            e @ (RecallError::Reason
            | RecallError::NothingRecalled { .. }
            | RecallError::Running(_)
            | RecallError::Empty { .. }),
        ) => return Err(Failure::Invalid(e.to_string())),
        Err(e @ (RecallError::BadId(_) | RecallError::UnknownImport(_))) => {
            return Err(Failure::NotFound(e.to_string()))
        }
        Err(RecallError::Store(e)) => return Err(e.into()),
    };
    let body = html! {
        h1 { "Import recalled" }
        (layout::notice(&format!("{} unissued codes of {} voided; they are never issued.", count(r.voided), r.import.file)))
        @if !r.held.is_empty() {
            h2 { "Codes buyers already hold (" (r.held.len()) ")" }
            table { thead { tr { th { "Code" } th { "Status" } th { "Order" } } }
                tbody { @for c in &r.held { tr {
                    td.code { (c.masked()) } td { (c.status.name()) }
                    td { @if let Some(h) = &c.holder { a href={"/console/orders/" (url_part(&h.order_id))} { (h.order_id) } } }
                } } } }
        }
        p { a href={"/console/pools/" (url_part(&r.import.pool))} { "Back to pool " (r.import.pool) } }
    };
    Ok(layout::page(&s, "Import recalled", body).into_response())
}
