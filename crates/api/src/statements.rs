//! `GET /v1/statements?pool=…` (scope `admin`): the statement `codepool
//! statement` prints, as JSON or CSV; `GET /v1/statements/lines?pool=…`
//! every move in the period by the code's statement HMAC (`--lines`). Made by the core
//! ([`codepool_issuance::statements`]); a row that does not tie out is
//! named in the answer's `discrepancies` (and the CSV's `off_by`).

use std::ops::ControlFlow;
use std::sync::Arc;

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use codepool_issuance::statements::{self, Asked, Statement, StatementError, StatementLine};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use crate::problem::Problem;
use crate::request::{Admin, Caller, RequestId};
use crate::state::Api;

/// Moves `/v1/statements/lines` lists at most; past it, 422 `too-many-lines`.
pub const MAX_LINES: u64 = 100_000;

/// The query of `GET /v1/statements`.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub(crate) struct StatementQuery {
    /// The pool.
    pool: String,
    /// Only this import run (its id).
    import: Option<String>,
    /// The period's start (included): `2026-11-01` (UTC) or an RFC 3339
    /// time; the beginning when absent.
    from: Option<String>,
    /// The period's end (not included); now when absent.
    to: Option<String>,
    /// Only the codes this marketplace channel sold.
    channel: Option<String>,
    /// `json` (the default) or `csv`.
    format: Option<String>,
}

/// A statement with the rows that do not tie out.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct StatementOut {
    #[serde(flatten)]
    statement: Statement,
    /// One sentence per row that does not tie out (empty when all do): a
    /// bug, to report with this answer.
    discrepancies: Vec<String>,
}

/// `GET /v1/statements/lines`: every move in the period.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct LinesOut {
    pool: String,
    lines: Vec<StatementLine>,
}

fn unprocessable(rid: &RequestId, slug: &str, field: &str, detail: String) -> Response {
    Problem::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        slug,
        "the statement cannot be made",
        detail,
    )
    .field(field)
    .at(&rid.0)
    .into_response()
}

fn failed(e: StatementError, rid: &RequestId) -> Response {
    match e {
        StatementError::UnknownPool(_)
        | StatementError::UnknownImport { .. }
        | StatementError::UnknownChannel(_) => Problem::new(
            StatusCode::NOT_FOUND,
            "not-found",
            "no such pool or import run",
            e.to_string(),
        )
        .at(&rid.0)
        .into_response(),
        StatementError::BadImport(_) => {
            unprocessable(rid, "invalid-import", "import", e.to_string())
        }
        StatementError::EmptyPeriod { .. } => {
            unprocessable(rid, "empty-period", "from", e.to_string())
        }
        StatementError::Busy { wait } => {
            metrics::counter!("codepool_api_rate_limited_total").increment(1);
            Problem::new(
                StatusCode::TOO_MANY_REQUESTS,
                "statements-busy",
                "statements are being made already",
                format!("{e}; wait {wait} s (Retry-After), then send the request again"),
            )
            .retry_after(wait)
            .at(&rid.0)
            .into_response()
        }
        StatementError::Store(e) => Problem::unavailable(&e).at(&rid.0).into_response(),
    }
}

fn asked(q: &StatementQuery, rid: &RequestId) -> Result<Asked, Box<Response>> {
    let when = |v: &Option<String>, field: &str| {
        statements::parse_optional(v.as_deref())
            .map_err(|e| Box::new(unprocessable(rid, "invalid-date", field, e)))
    };
    Ok(Asked {
        pool: q.pool.clone(),
        import: q.import.clone(),
        from: when(&q.from, "from")?,
        to: when(&q.to, "to")?,
        channel: q.channel.clone(),
    })
}

type Parsed = Result<Query<StatementQuery>, QueryRejection>;

/// The query's period and format (`true` for CSV), or the problem.
fn read(q: Parsed, rid: &RequestId) -> Result<(Asked, bool), Box<Response>> {
    let q = match q {
        Ok(Query(q)) => q,
        Err(e) => {
            return Err(Box::new(unprocessable(
                rid,
                "invalid-query",
                "query",
                format!(
                    "{}; e.g. ?pool=game-x&from=2026-11-01&to=2026-12-01&format=csv",
                    e.body_text()
                ),
            )))
        }
    };
    let csv = match q.format.as_deref() {
        None | Some("json") => false,
        Some("csv") => true,
        Some(f) => {
            return Err(Box::new(unprocessable(
                rid,
                "invalid-format",
                "format",
                format!("{f:?} is not a format; use json or csv"),
            )))
        }
    };
    Ok((asked(&q, rid)?, csv))
}

fn csv_answer(text: String) -> Response {
    ([(header::CONTENT_TYPE, "text/csv; charset=utf-8")], text).into_response()
}

/// `GET /v1/statements`.
#[utoipa::path(
    get, path = "/v1/statements", tag = "statements",
    operation_id = "statement",
    params(StatementQuery),
    responses(
        (status = 200, description = "the statement: a row per import run and the total (CSV: the same, with `unaccounted` and `off_by` columns)",
            content((StatementOut = "application/json"), (String = "text/csv"))),
        (status = 404, description = "no such pool, or the import run is not of it", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
        (status = 422, description = "a bad date, import id or format, or an empty period", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
    ),
    security(("api_key" = ["admin"]))
)]
pub(crate) async fn statement(
    State(api): State<Arc<Api>>,
    Caller { rid, .. }: Caller<Admin>,
    q: Parsed,
) -> Response {
    let (a, csv) = match read(q, &rid) {
        Ok(r) => r,
        Err(r) => return *r,
    };
    let s = match api.statement(&a).await {
        Ok(s) => s,
        Err(e) => return failed(e, &rid),
    };
    if csv {
        return csv_answer(statements::csv(&s));
    }
    let discrepancies = s.discrepancies();
    Json(StatementOut {
        statement: s,
        discrepancies,
    })
    .into_response()
}

/// `GET /v1/statements/lines`.
#[utoipa::path(
    get, path = "/v1/statements/lines", tag = "statements",
    operation_id = "statement_lines",
    params(StatementQuery),
    responses(
        (status = 200, description = "every move in the period (received, issued, used, void) by the code's HMAC under the pool's statement key; never the code",
            content((LinesOut = "application/json"), (String = "text/csv"))),
        (status = 404, description = "no such pool, or the import run is not of it", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
        (status = 422, description = "a bad date, import id or format, an empty period, or more than 100,000 moves (`too-many-lines`)", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
        (status = 429, description = "two statements are being made by this process already (`statements-busy`); `Retry-After` says when to ask again", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
    ),
    security(("api_key" = ["admin"]))
)]
pub(crate) async fn lines(
    State(api): State<Arc<Api>>,
    Caller { rid, .. }: Caller<Admin>,
    q: Parsed,
) -> Response {
    let (a, csv) = match read(q, &rid) {
        Ok(r) => r,
        Err(r) => return *r,
    };
    let mut out = Vec::new();
    let mut each = |l: StatementLine| {
        out.push(l);
        if out.len() as u64 > MAX_LINES {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    };
    match api.statement_lines(&a, &mut each).await {
        Ok(n) if n > MAX_LINES => unprocessable(
            &rid,
            "too-many-lines",
            "to",
            format!("the period has more than {MAX_LINES} moves; ask for a shorter period, or run `codepool statement --pool {} --lines`", a.pool),
        ),
        Ok(_) if csv => csv_answer(statements::lines_csv(&out)),
        Ok(_) => Json(LinesOut { pool: a.pool.clone(), lines: out }).into_response(),
        Err(e) => failed(e, &rid),
    }
}
