//! `/console/pools`: one row per pool (unissued, issued in the last day,
//! the rate of the last hour, low stock, paused), by pages of
//! [`PAGE`] ordered by name, each page costing the same few bounded counts
//! per row whatever the number of pools (the queries of `GET /v1/pools`).
//! The rows refresh themselves every few seconds with htmx; without
//! JavaScript the page shows the numbers of its load.

use std::sync::Arc;

use axum::extract::{Query, State};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::Form;
use codepool_domain::Pool;
use codepool_issuance::model::PoolDoc;
use codepool_issuance::model::PoolStats;
use maud::{html, Markup};
use serde::Deserialize;

use crate::failure::Failure;
use crate::layout::{self, count, csrf, url_part};
use crate::sessions::Session;
use crate::state::Console;
use codepool_issuance::operators::Role;

/// Pools per page.
pub const PAGE: i64 = 50;

#[derive(Debug, Default, Deserialize)]
pub struct ListQuery {
    after: Option<String>,
    /// The pool whose stock the chart shows (default: the first listed).
    chart: Option<String>,
    /// `rows`: only the table's body (the live refresh).
    part: Option<String>,
}

/// Whether a pool is below its low-stock threshold.
pub(crate) fn is_low(d: &PoolDoc, s: &PoolStats) -> bool {
    d.low_stock.is_some_and(|t| (s.unissued as i64) < t)
}

fn row(d: &PoolDoc, s: &PoolStats) -> Markup {
    let low = is_low(d, s);
    html! {
        tr data-pool=(d.name) class=[low.then_some("low")] {
            td { a href={"/console/pools/" (url_part(&d.name))} { (d.name) } }
            td.num.unissued { (count(s.unissued)) }
            td.num.held { (count(s.held)) }
            td.num.issued-day { (count(s.issued_last_day)) }
            td.num.rate { (count(s.issued_last_hour)) " /h" }
            td.low-stock {
                @match d.low_stock {
                    Some(t) if low => { strong { "low" } " (< " (count(t as u64)) ")" }
                    Some(t) => { "ok (≥ " (count(t as u64)) ")" }
                    None => { "—" }
                }
            }
            td.paused { @if d.paused { strong { "paused" } } @else { "issuing" } }
            td.num { (count(s.backorders_waiting)) }
        }
    }
}

/// The table's body; it polls for itself again.
fn rows(console: &Console, q: &ListQuery, docs: &[PoolDoc], stats: &[PoolStats]) -> Markup {
    let every = console.cfg.live_every.as_secs().max(1);
    let after = q.after.as_deref().map(url_part).unwrap_or_default();
    html! {
        tbody #pool-rows hx-get={"/console/pools?part=rows&after=" (after)}
            hx-trigger={"every " (every) "s"} hx-swap="outerHTML" {
            @for d in docs {
                @let empty = PoolStats { pool: d.name.clone(), ..PoolStats::default() };
                (row(d, stats.iter().find(|s| s.pool == d.name).unwrap_or(&empty)))
            }
        }
    }
}

/// `GET /console/pools?after=NAME`.
pub async fn list(
    State(console): State<Arc<Console>>,
    s: Session,
    Query(q): Query<ListQuery>,
) -> Result<Response, Failure> {
    s.need(Role::Viewer)?;
    let core = &console.core;
    let docs = core.pools_page(q.after.as_deref(), PAGE).await?;
    let names: Vec<&str> = docs.iter().map(|d| d.name.as_str()).collect();
    let stats = core.stats_of(&names).await?;
    if q.part.as_deref() == Some("rows") {
        return Ok(Html(rows(&console, &q, &docs, &stats).into_string()).into_response());
    }
    let chart_pool = q
        .chart
        .clone()
        .or_else(|| docs.first().map(|d| d.name.clone()));
    let chart = match &chart_pool {
        Some(p) => Some(super::pool::stock_chart(&console, p).await?),
        None => None,
    };
    let next = (docs.len() as i64 == PAGE)
        .then(|| docs.last().map(|d| d.name.clone()))
        .flatten();
    let body = html! {
        h1 { "Pools" }
        @if let (Some(p), Some(c)) = (&chart_pool, chart) {
            figure.stock {
                (c)
                figcaption { "Unissued stock of " strong { (p) } " over the last 24 hours. "
                    "Pick another pool's chart from its page." }
            }
        }
        table.pools {
            thead { tr {
                th { "Pool" } th { "Unissued" } th { "Held" } th { "Issued, 24 h" } th { "Rate, last hour" }
                th { "Low stock" } th { "State" } th { "Backorders" }
            } }
            (rows(&console, &q, &docs, &stats))
        }
        nav.pager {
            @if q.after.is_some() { a href="/console/pools" { "First page" } }
            @if let Some(n) = &next { a.next href={"/console/pools?after=" (url_part(n))} { "Next page" } }
        }
        p.hint { "The numbers refresh every " (console.cfg.live_every.as_secs().max(1))
            " s while this page is open (reload the page without JavaScript)." }
        @if s.operator.may(Role::Admin) {
            form.inline method="post" action="/console/pools" {
                (csrf(&s))
                label { "New pool " input name="name" required maxlength="64"; }
                button type="submit" { "Create pool" }
            }
        }
    };
    Ok(layout::page(&s, "Pools", body).into_response())
}

#[derive(Debug, Deserialize)]
pub struct NewPool {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    name: String,
}

/// `POST /console/pools`: an empty pool (admin), as `codepool pool create`.
pub async fn create(
    State(console): State<Arc<Console>>,
    s: Session,
    Form(f): Form<NewPool>,
) -> Result<Response, Failure> {
    s.check_csrf(&f.csrf)?;
    s.need(Role::Admin)?;
    let name = f.name.trim();
    Pool::new(name).map_err(|e| Failure::Invalid(e.to_string()))?;
    let actor = super::actor(&s, "POST /console/pools");
    console.core.create_pool(name, &actor).await?;
    Ok(Redirect::to(&format!("/console/pools/{}", url_part(name))).into_response())
}
