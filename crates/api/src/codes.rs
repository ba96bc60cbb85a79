//! `POST /v1/codes/check` and `POST /v1/codes/redeem`: the platform that
//! honours the codes asks what became of one, and redeems it, exactly
//! once, through the core's [`ByCode`](codepool_issuance::by_code::ByCode).
//!
//! Not an oracle: every code the key may not learn about (unknown, another
//! shop's pool, never issued) gets one 404, from the same query of its batch, and
//! a key whose lookups keep missing is slowed by the core (429 with
//! `Retry-After` here).
//! The request and answer types here are the ones the OpenAPI document
//! shows.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use chrono::{DateTime, SecondsFormat, Utc};
use codepool_issuance::audit::Actor;
use codepool_issuance::redeem::{RedeemError, Seen, SeenState};
use serde::{Deserialize, Serialize};
use serde_json::json;
use utoipa::ToSchema;

use crate::orders::failed;
use crate::request::{Body, BodyDoc, Caller, CodesRedeem};
use crate::{Api, Problem, RequestId};

/// `POST /v1/codes/check`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, expecting = "an object with the code")]
pub(crate) struct CheckIn {
    /// The code as the buyer typed it. Look-alikes find it as the pool
    /// says (case, width, and `O`/`0`, `I`/`L`/`1` in a pool that folds
    /// confusables).
    #[schema(min_length = 1, max_length = 128)]
    code: String,
    /// Whom you ask for: your end user's account id or address, as you
    /// know it. Codes named that match nothing are then counted against
    /// that end user's budget (and a ceiling of the key's), so one
    /// stranger guessing codes slows himself, not your other users.
    #[schema(min_length = 1, max_length = 128)]
    #[serde(default)]
    end_user: Option<String>,
}

impl BodyDoc for CheckIn {
    const WHAT: &'static str = "a code";
    const SEND: &'static str = r#"{"code": "the code as the buyer typed it"}"#;
}

/// `POST /v1/codes/redeem`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(
    deny_unknown_fields,
    expecting = "an object with the code and a redemption id"
)]
pub(crate) struct RedeemIn {
    #[schema(min_length = 1, max_length = 128)]
    code: String,
    /// Your id for this redemption (a UUID): the same id again gets the
    /// same 200; on another code it is refused (409
    /// `conflicting-redemption`).
    #[schema(min_length = 1, max_length = 128)]
    redemption_id: String,
    /// Whom you redeem for, as in `check`.
    #[schema(min_length = 1, max_length = 128)]
    #[serde(default)]
    end_user: Option<String>,
}

impl BodyDoc for RedeemIn {
    const WHAT: &'static str = "a redemption";
    const SEND: &'static str =
        r#"{"code": "the code as the buyer typed it", "redemption_id": "a UUID of yours"}"#;
}

/// What became of a code: never the buyer, the phone or the order.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct CodeState {
    /// `issued` (sold, not used yet), `used` or `void`.
    #[schema(pattern = "^(issued|used|void)$")]
    state: &'static str,
    pool: String,
    /// The grant number on the buyer's receipt.
    grant_no: Option<String>,
    /// The code's line in its order (0 for an order of one code).
    line: u32,
    issued_at: Option<String>,
    /// When it was redeemed (state `used`).
    #[serde(skip_serializing_if = "Option::is_none")]
    redeemed_at: Option<String>,
    /// When and why it was voided (state `void`): `refund`, `replaced`,
    /// `recalled`, …
    #[serde(skip_serializing_if = "Option::is_none")]
    voided_at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    void_reason: Option<String>,
}

fn time(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

impl From<Seen> for CodeState {
    fn from(s: Seen) -> Self {
        let (redeemed_at, voided_at, void_reason) = match &s.state {
            SeenState::Issued => (None, None, None),
            SeenState::Used { at } => (at.map(time), None, None),
            SeenState::Void { at, reason } => (None, at.map(time), Some(reason.clone())),
        };
        CodeState {
            state: s.state.as_str(),
            pool: s.pool,
            grant_no: s.grant_no,
            line: s.line,
            issued_at: s.issued_at.map(time),
            redeemed_at,
            voided_at,
            void_reason,
        }
    }
}

/// `POST /v1/codes/check` with `{"code": …}`: changes nothing.
#[utoipa::path(
    post, path = "/v1/codes/check", tag = "codes",
    operation_id = "check_code",
    request_body(content = CheckIn, content_type = "application/json"),
    responses(
        (status = 200, description = "the code was issued to an order: its state now", body = CodeState),
        (status = 404, description = "no code issued to an order matches among the pools this key may see: one answer for an unknown code, another shop's, and one never sold (`unknown-code`)", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
        (status = 422, description = "no code, or one no pool could hold", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
        (status = 429, description = "this key named too many codes that matched nothing (`redeem-misses`) or sent too many requests; `Retry-After` says when to come back", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
    ),
    security(("api_key" = ["codes:redeem"]))
)]
pub(crate) async fn check(
    State(api): State<Arc<Api>>,
    Caller { key, rid, .. }: Caller<CodesRedeem>,
    Body(b): Body<CheckIn>,
) -> Response {
    // Spaces and line ends around a code are not part of it, as in a CSV.
    let code = b.code.trim();
    if let Some(r) = bad_code(code, &rid) {
        return r;
    }
    let end_user = match checked_end_user(b.end_user.as_deref(), &rid) {
        Ok(u) => u,
        Err(r) => return r,
    };
    let found = api.by_code.check(&key, end_user.as_deref(), code).await;
    answer(found, &rid)
}

/// `POST /v1/codes/redeem` with `{"code": …, "redemption_id": …}`.
#[utoipa::path(
    post, path = "/v1/codes/redeem", tag = "codes",
    operation_id = "redeem_code",
    request_body(content = RedeemIn, content_type = "application/json"),
    responses(
        (status = 200, description = "the code is used now, or was by this same redemption id (answered alike)", body = CodeState),
        (status = 404, description = "no code issued to an order matches among the pools this key may see (`unknown-code`, the same answer as `check`'s)", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
        (status = 409, description = "`already-redeemed` (with the first `redeemed_at`), `void` (with its `reason`), or `conflicting-redemption` (the id redeemed another code); nothing changed", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
        (status = 422, description = "no code or redemption id, or an invalid one (named in `field`)", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
        (status = 429, description = "this key named too many codes that matched nothing (`redeem-misses`) or sent too many requests; `Retry-After` says when to come back", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
    ),
    security(("api_key" = ["codes:redeem"]))
)]
pub(crate) async fn redeem(
    State(api): State<Arc<Api>>,
    Caller { key, rid, .. }: Caller<CodesRedeem>,
    Body(b): Body<RedeemIn>,
) -> Response {
    // Spaces and line ends around a code are not part of it, as in a CSV.
    let code = b.code.trim();
    if let Some(r) = bad_code(code, &rid) {
        return r;
    }
    let end_user = match checked_end_user(b.end_user.as_deref(), &rid) {
        Ok(u) => u,
        Err(r) => return r,
    };
    let actor = Actor::api_key(&key.name, "POST /v1/codes/redeem");
    let found = api
        .by_code
        .redeem(&key, end_user.as_deref(), code, &b.redemption_id, &actor)
        .await;
    answer(found, &rid)
}

/// The answer to a lookup by value.
fn answer(found: Result<Seen, RedeemError>, rid: &RequestId) -> Response {
    match found {
        Ok(seen) => Json(CodeState::from(seen)).into_response(),
        Err(e) => refused(e, rid),
    }
}

/// 429 for a key (or end user) whose miss budget is spent: nothing was
/// looked up.
fn slowed(wait: u64, rid: &RequestId) -> Response {
    metrics::counter!("codepool_api_rate_limited_total").increment(1);
    Problem::new(
        StatusCode::TOO_MANY_REQUESTS,
        "redeem-misses",
        "too many codes that match nothing",
        format!("this key (or the end user it named) named too many codes that match nothing; wait {wait} s (Retry-After), then send the request again. Name each request's end user (`end_user`) so that one user's misses slow only that user"),
    )
    .retry_after(wait)
    .at(&rid.0)
    .into_response()
}

/// The end user a request names, if any; 422 for one that is empty, too
/// long or unreadable.
#[allow(clippy::result_large_err)]
fn checked_end_user(name: Option<&str>, rid: &RequestId) -> Result<Option<String>, Response> {
    let Some(name) = name else {
        return Ok(None);
    };
    match codepool_issuance::by_code::end_user(name) {
        Some(u) => Ok(Some(u)),
        None => Err(Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid-end-user",
            "that is not an end user",
            format!(
                "end_user is 1 to {} characters of plain visible text (your end user's account id or address); send it so, or leave it out",
                codepool_issuance::by_code::MAX_END_USER_CHARS
            ),
        )
        .field("end_user")
        .at(&rid.0)
        .into_response()),
    }
}

/// 422 for a code no pool could hold (empty, too long, unreadable).
fn bad_code(code: &str, rid: &RequestId) -> Option<Response> {
    let e = codepool_domain::validate_code(code).err()?;
    Some(
        Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid-code",
            "that is not a code",
            format!("{e}; send the code as the buyer typed it"),
        )
        .field("code")
        .at(&rid.0)
        .into_response(),
    )
}

/// A refusal as a problem.
fn refused(e: RedeemError, rid: &RequestId) -> Response {
    let detail = e.to_string();
    let p = match e {
        RedeemError::Store(s) => return failed(&s, s.is_retryable(), rid),
        RedeemError::Batch(b) => return failed(&b, true, rid),
        RedeemError::Slowed { wait } => return slowed(wait, rid),
        RedeemError::Unknown => Problem::new(
            StatusCode::NOT_FOUND,
            "unknown-code",
            "no such code",
            detail,
        ),
        RedeemError::AlreadyRedeemed { at } => Problem::new(
            StatusCode::CONFLICT,
            "already-redeemed",
            "the code was already redeemed",
            detail,
        )
        .with("redeemed_at", json!(at.map(time))),
        RedeemError::Void { at, reason } => {
            Problem::new(StatusCode::CONFLICT, "void", "the code is void", detail)
                .with("reason", json!(reason))
                .with("voided_at", json!(at.map(time)))
        }
        RedeemError::ConflictingId(_) => Problem::new(
            StatusCode::CONFLICT,
            "conflicting-redemption",
            "the redemption id redeemed another code",
            detail,
        )
        .field("redemption_id"),
        RedeemError::BadId => Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid-redemption-id",
            "that is not a redemption id",
            detail,
        )
        .field("redemption_id"),
    };
    p.at(&rid.0).into_response()
}
