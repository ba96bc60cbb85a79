//! `POST /v1/orders/{order_id}/lines/{line}/replace`: one code of an order
//! replaced by a fresh one, through the core's [`replace`] (the CLI's
//! `codepool replace` and the console's Replace button call the same).

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use codepool_issuance::audit::Actor;
use codepool_issuance::model::CodeQuery;
use codepool_issuance::replace::{self, ReplaceError, Replaced};
use serde::{Deserialize, Serialize};
use serde_json::json;
use utoipa::ToSchema;

use crate::keys::{KeyDoc, Scope};
use crate::orders::{failed, not_yours, GrantedCode};
use crate::request::{Body, BodyDoc, Caller, OrdersWrite};
use crate::{Api, Problem, RequestId};

const ROUTE: &str = "POST /v1/orders/{order_id}/lines/{line}/replace";

/// `POST /v1/orders/{order_id}/lines/{line}/replace`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(
    deny_unknown_fields,
    expecting = "an object with a replacement id and a reason"
)]
pub(crate) struct ReplaceIn {
    /// Your id for this replacement (a UUID): the same id again is the
    /// same replacement, answered with the same new code.
    #[schema(min_length = 1, max_length = 128)]
    replacement_id: String,
    /// Why (the platform rejects the code): 1 to 200 characters.
    #[schema(min_length = 1, max_length = 200)]
    reason: String,
}

impl BodyDoc for ReplaceIn {
    const WHAT: &'static str = "a replacement";
    const SEND: &'static str =
        r#"{"replacement_id": "a UUID of yours", "reason": "code rejected by the platform"}"#;
}

/// `POST /v1/orders/{order_id}/lines/{line}/replace` with
/// `{"replacement_id": …, "reason": …}`.
#[utoipa::path(
    post, path = "/v1/orders/{order_id}/lines/{line}/replace", tag = "orders",
    operation_id = "replace_code",
    params(("order_id" = String, Path, description = "the shop's order id"),
           ("line" = u32, Path, description = "the order's line whose code is replaced: 0 to quantity - 1")),
    request_body(content = ReplaceIn, content_type = "application/json"),
    responses(
        (status = 201, description = "the old code is void (`replaced`) and the line holds a new code, sent to the buyer by SMS", body = Replacement),
        (status = 200, description = "the same replacement id again: the same new code; nothing else was done", body = Replacement),
        (status = 202, description = "the old code is void and the line waits for stock (the pool is empty or paused): its new code comes by SMS after the next import or resume, before the pool's backorders", body = Replacement),
        (status = 404, description = "this key placed no such order (a key acts on its own orders, a shop's key on its shop's, a key with the admin scope on any), or the order has no code on that line", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
        (status = 409, description = "the replacement id names another replacement (`conflicting-replacement`), the line's code cannot be replaced (`not-replaceable`: used, void, or waiting for an earlier replacement), or the order was voided (`order-cancelled`); nothing changed", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
        (status = 403, description = "the key lacks `orders:write`, or the order's shop may no longer order from the pool (`pool-not-allowed`); nothing changed", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
        (status = 422, description = "no reason or replacement id, or an invalid one (named in `field`)", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
        (status = 429, description = "the order has had its pool's replacements (`replacement-limit`, with the `limit`); nothing changed", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
    ),
    security(("api_key" = ["orders:write"]))
)]
pub(crate) async fn replace(
    State(api): State<Arc<Api>>,
    Caller { key, rid, .. }: Caller<OrdersWrite>,
    Path((order_id, line)): Path<(String, u32)>,
    Body(b): Body<ReplaceIn>,
) -> Response {
    // Compared as stored: NFC.
    let order_id = codepool_domain::text::nfc(&order_id);
    // Only the key (or shop) that placed the order replaces its codes; an
    // admin key any. Another's order is not shown to exist.
    let found = match api.lookup(CodeQuery::Order(&order_id), 1).await {
        Ok(f) => f,
        Err(e) => return failed(&e, e.is_retryable(), &rid),
    };
    let owns = found.is_owned_by(&key.owner());
    if !owns && !key.allows(Scope::Admin) {
        return not_yours(&order_id, &rid);
    }
    let ask = replace::Ask {
        order_id: &order_id,
        line,
        replacement_id: &b.replacement_id,
        reason: &b.reason,
    };
    let actor = Actor::api_key(&key.name, ROUTE);
    match api.replace(&ask, &actor).await {
        Ok(done) => answer(&api, &key, owns, &rid, &actor, done).await,
        Err(e) => refused(e, &rid),
    }
}

/// A replacement: the line's new code, or that it waits for stock.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct Replacement {
    replacement_id: String,
    order_id: String,
    line: u32,
    pool: String,
    /// `replaced` (the line holds its new code) or `waiting` (the pool is
    /// empty or paused; the new code comes by SMS).
    #[schema(pattern = "^(replaced|waiting)$")]
    state: &'static str,
    reason: String,
    /// The grant number of the code replaced (now void, reason `replaced`).
    old_grant_no: Option<String>,
    /// The line's new code: in plaintext to the key that placed the order
    /// (or one with `codes:reveal`), masked to another admin key; null
    /// while the line waits.
    code: Option<GrantedCode>,
}

/// The replacement as the API shows it: its new code in plaintext to the
/// key that placed the order (or one with `codes:reveal`), audited as a
/// reveal first; masked to any other admin key.
async fn answer(
    api: &Api,
    key: &KeyDoc,
    owns: bool,
    rid: &RequestId,
    actor: &Actor,
    done: Replaced,
) -> Response {
    let plain = owns || key.allows(Scope::CodesReveal);
    let grant = done.code.as_ref().and_then(|c| c.grant());
    if let (true, Some(c)) = (plain, &done.code) {
        let what = format!(
            "replacement {:?} of order {:?}",
            done.doc.id, done.doc.order_id
        );
        if let Err(e) = api.record_reveal(actor, what, vec![c.id], 1).await {
            return failed(&e, e.is_retryable(), rid);
        }
    }
    let status = match (&grant, done.began) {
        (None, _) => StatusCode::ACCEPTED,
        (Some(_), true) => StatusCode::CREATED,
        (Some(_), false) => StatusCode::OK,
    };
    let d = &done.doc;
    let body = Replacement {
        replacement_id: d.id.clone(),
        order_id: d.order_id.clone(),
        line: d.line(),
        pool: d.pool.clone(),
        state: if grant.is_some() {
            "replaced"
        } else {
            "waiting"
        },
        reason: d.reason.clone(),
        old_grant_no: d.old_grant_no.clone(),
        code: grant.as_ref().map(|g| GrantedCode::of(g, plain)),
    };
    (status, Json(body)).into_response()
}

/// A replacement the core refused, as a problem; nothing changed.
fn refused(e: ReplaceError, rid: &RequestId) -> Response {
    let detail = e.to_string();
    let p = match &e {
        ReplaceError::Store(s) => return failed(s, s.is_retryable(), rid),
        ReplaceError::Claim(c) => return failed(c, c.is_retryable(), rid),
        ReplaceError::Reason => problem(StatusCode::UNPROCESSABLE_ENTITY, "invalid-reason", detail)
            .field("reason"),
        ReplaceError::Id => problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid-replacement-id",
            detail,
        )
        .field("replacement_id"),
        ReplaceError::NoLine { .. } => problem(StatusCode::NOT_FOUND, "unknown-line", detail),
        ReplaceError::NotReplaceable { status, .. } => {
            problem(StatusCode::CONFLICT, "not-replaceable", detail)
                .with("code_status", json!(status.name()))
        }
        ReplaceError::Conflict { .. } => {
            problem(StatusCode::CONFLICT, "conflicting-replacement", detail)
                .field("replacement_id")
        }
        ReplaceError::Cancelled { .. } => problem(StatusCode::CONFLICT, "order-cancelled", detail),
        ReplaceError::Limit { order_id, limit } => problem(
            StatusCode::TOO_MANY_REQUESTS,
            "replacement-limit",
            format!("order {order_id:?} has had {limit} replacement(s), the most its pool allows; nothing was replaced. The pool's operator may raise its replacements_per_order"),
        )
        .with("limit", json!(limit)),
        ReplaceError::PoolNotAllowed { .. } => {
            problem(StatusCode::FORBIDDEN, "pool-not-allowed", detail)
        }
    };
    p.at(&rid.0).into_response()
}

fn problem(status: StatusCode, slug: &str, detail: String) -> Problem {
    Problem::new(status, slug, "the code was not replaced", detail)
}
