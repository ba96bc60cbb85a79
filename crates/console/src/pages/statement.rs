//! `GET /console/pools/{pool}/statement?from=…&to=…`: the pool's
//! statement (`codepool statement`), one row per import run with where its
//! codes stand at the period's end and what moved within it, each row
//! checked to tie out; `format=csv` downloads it.

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use codepool_issuance::operators::Role;
use codepool_issuance::statements::{self, Asked, StatementError, StatementRow, Voids};
use maud::{html, Markup};
use serde::Deserialize;

use crate::failure::Failure;
use crate::layout::{self, count, url_part, when_chrono};
use crate::sessions::Session;
use crate::state::Console;

#[derive(Debug, Default, Deserialize)]
pub struct StatementQuery {
    #[serde(default)]
    from: String,
    #[serde(default)]
    to: String,
    #[serde(default)]
    format: String,
}

fn instant(v: &str, field: &str) -> Result<Option<chrono::DateTime<chrono::Utc>>, Failure> {
    statements::parse_optional(Some(v)).map_err(|e| Failure::Invalid(format!("{field}: {e}")))
}

/// A void count with its non-zero reasons beneath.
fn voids(v: &Voids) -> Markup {
    let reasons: Vec<String> = [
        ("refund", v.refund),
        ("replaced", v.replaced),
        ("recalled", v.recalled),
        ("expired", v.expired),
        ("other", v.other),
    ]
    .iter()
    .filter(|(_, n)| *n > 0)
    .map(|(r, n)| format!("{r} {}", count(*n)))
    .collect();
    html! {
        td.num { (count(v.total())) @if !reasons.is_empty() { br; small { (reasons.join(", ")) } } }
    }
}

fn row(r: &StatementRow) -> Markup {
    let (b, m) = (&r.balance, &r.moves);
    let off = r.off_by;
    html! {
        tr class=[(off > 0).then_some("off")] {
            td { @if r.source == "total" { strong { "Total" } } @else {
                (r.file.as_deref().unwrap_or("(no run recorded)")) br;
                small { code { (r.import.as_deref().unwrap_or("-")) } " · " (r.source)
                    @if let Some(state) = r.run.as_deref() { " · " (state) } } } }
            td.num { (count(r.received)) } td.num { (count(r.duplicates)) }
            td.num { (count(b.in_stock)) } td.num { (count(b.held)) } td.num { (count(b.issued)) } td.num { (count(b.used)) }
            (voids(&b.void))
            td.num.moved { (count(m.received)) } td.num.moved { (count(m.issued)) } td.num.moved { (count(m.used)) }
            (voids(&m.void))
            td { @if off == 0 { (statements::check_words(r)) } @else { strong { (statements::check_words(r)) } } }
        }
    }
}

/// `GET /console/pools/{pool}/statement`.
pub async fn show(
    State(console): State<Arc<Console>>,
    s: Session,
    Path(pool): Path<String>,
    Query(q): Query<StatementQuery>,
) -> Result<Response, Failure> {
    s.need(Role::Viewer)?;
    let asked = Asked {
        pool: pool.clone(),
        import: None,
        from: instant(&q.from, "from")?,
        to: instant(&q.to, "to")?,
        channel: None,
    };
    let st = match console.core.statement(&asked).await {
        Ok(st) => st,
        Err(StatementError::Store(e)) => return Err(e.into()),
        Err(e @ StatementError::Busy { wait }) => {
            return Err(Failure::Busy {
                detail: e.to_string(),
                wait,
            })
        }
        Err(e @ StatementError::UnknownPool(_)) => return Err(Failure::NotFound(e.to_string())),
        Err(e) => return Err(Failure::Invalid(e.to_string())),
    };
    if q.format == "csv" {
        let name = format!("attachment; filename=\"statement-{}.csv\"", url_part(&pool));
        return Ok((
            [
                (header::CONTENT_TYPE, "text/csv; charset=utf-8".to_owned()),
                (header::CONTENT_DISPOSITION, name),
            ],
            statements::csv(&st),
        )
            .into_response());
    }
    let off = st.discrepancies();
    let unfinished = statements::unfinished(&st);
    let base = format!("/console/pools/{}/statement", url_part(&pool));
    let day =
        |t: Option<chrono::DateTime<chrono::Utc>>| t.map(|t| t.format("%Y-%m-%d").to_string());
    let body = html! {
        h1 { "Statement of pool " a href={"/console/pools/" (url_part(&pool))} { (pool) } }
        form.grid method="get" action=(base) {
            label { "From (UTC day, included) " input type="date" name="from" value=[day(asked.from)]; }
            label { "To (UTC day, not included) " input type="date" name="to" value=[day(asked.to)]; }
            button type="submit" { "Show" }
        }
        p { "Balances at " (when_chrono(st.to)) "; moves from " (when_chrono(st.from)) " until then. "
            a href={(base) "?format=csv&from=" (url_part(&q.from)) "&to=" (url_part(&q.to))} { "Download CSV" } }
        @if st.provisional {
            p.hint { "Provisional: the period ends less than 10 seconds ago, and a move made just before its end may still be committing. Show it again later for final figures." }
        }
        @if !off.is_empty() {
            div.alert role="alert" {
                p { strong { (off.len()) " row(s) do not tie out." } " This is a bug: keep this page and report it." }
                ul { @for d in &off { li { (d) } } }
            }
        }
        @if !unfinished.is_empty() {
            div.unfinished role="status" {
                p { span.badge { "not finished" } " " strong { (unfinished.len()) " run(s) did not finish." } " Their rows count the codes they put in, not their whole delivery." }
                ul { @for u in &unfinished { li { (u) } } }
            }
        }
        div.table-wrap { table.statement {
            thead {
                tr { th colspan="3" {} th colspan="5" { "At the end" } th colspan="4" { "Moved in the period" } th {} }
                tr { th { "Import run" } th { "Received" } th { "Duplicates" }
                    th { "In stock" } th { "Held" } th { "Issued" } th { "Used" } th { "Void" }
                    th { "Received" } th { "Issued" } th { "Used" } th { "Void" }
                    th { "Check" } }
            }
            tbody { @for r in st.rows.iter().chain([&st.total]) { (row(r)) } }
        } }
        p.hint { "Each code of a run is in stock, held, issued, used or void at the end; a row ties out when they add up to what the run received. Moves are counted by when they happened, so two back-to-back periods add up to the one spanning both. `codepool statement --lines` lists every move by the code's HMAC, never the code." }
    };
    Ok(layout::page(&s, &format!("Statement of {pool}"), body).into_response())
}
