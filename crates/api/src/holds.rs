//! `/v1/holds`: checkout holds. A hold sets codes aside for a buyer while
//! they pay; `POST /v1/orders` with its `hold_id` turns them into the
//! order's codes. Everything is decided by [`codepool_issuance::holds`];
//! this door only translates.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use codepool_domain::gate::HoldState;
use codepool_issuance::holds::{self, HoldError, HoldRequest};
use codepool_issuance::model::HoldDoc;
use serde::Serialize;
use serde_json::json;
use utoipa::ToSchema;

use crate::items::Item;
use crate::problem::Problem;
use crate::request::RequestId;
use crate::request::{Caller, OrdersRead, OrdersWrite};
use crate::state::Api;
use codepool_issuance::api_keys::KeyDoc;

fn time(t: bson::DateTime) -> String {
    t.try_to_rfc3339_string().unwrap_or_default()
}

/// A hold. Its codes are never shown: they are no one's until the order
/// that pays for it is placed.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct Hold {
    hold_id: String,
    uid: String,
    /// `held`, `committed` (an order paid for it), `released` or `expired`.
    #[schema(value_type = String, pattern = "^(held|committed|released|expired)$")]
    state: HoldState,
    items: Vec<Item>,
    ttl_seconds: u64,
    created_at: String,
    expires_at: String,
    /// The order that paid for it.
    order_id: Option<String>,
}

impl From<&HoldDoc> for Hold {
    fn from(h: &HoldDoc) -> Self {
        Hold {
            hold_id: h.hold_id.clone(),
            uid: h.uid.clone(),
            state: holds::state_now(h),
            items: h.items.iter().map(Item::from).collect(),
            ttl_seconds: u64::try_from(h.ttl_seconds).unwrap_or_default(),
            created_at: time(h.created_at),
            expires_at: time(h.expires_at),
            order_id: h.order_id.clone(),
        }
    }
}

/// A hold error as its problem. A shop's key is told the same of a pool
/// that does not exist and of a pool that is not its shop's, as for an
/// order.
fn failed(e: HoldError, key: &KeyDoc, rid: &RequestId) -> Response {
    let title = "nothing was held";
    let e = match e {
        HoldError::Invalid(pe) if key.shop.is_some() => HoldError::Invalid(pe.as_told_to_shop()),
        e => e,
    };
    let p = match &e {
        HoldError::Invalid(pe) => {
            let status = match pe.reason {
                codepool_domain::RejectReason::PoolNotAllowed => StatusCode::FORBIDDEN,
                _ => StatusCode::UNPROCESSABLE_ENTITY,
            };
            let slug = pe.reason.as_str().replace('_', "-");
            let mut p = Problem::new(status, &slug, title, pe.detail.clone());
            if let Some(f) = pe.field() {
                p = p.field(f.to_owned());
            }
            p
        }
        HoldError::Conflict(_) => {
            Problem::new(StatusCode::CONFLICT, "conflicting-hold", title, e.to_string())
                .field("hold_id")
        }
        HoldError::InsufficientStock { free } => Problem::new(
            StatusCode::CONFLICT,
            "insufficient-stock",
            title,
            format!("{e}; ask for fewer codes, or try again after the next import"),
        )
        .with(
            "free",
            free.iter()
                .map(|(pool, n)| json!({"pool": pool, "free": n}))
                .collect(),
        ),
        HoldError::Paused(_) => {
            Problem::new(StatusCode::CONFLICT, "pool-paused", title, e.to_string())
        }
        HoldError::PerUserLimit { pool, limit, .. } => Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "per-user-limit",
            title,
            e.to_string(),
        )
        .with("pool", json!(pool))
        .with("limit", json!(limit)),
        HoldError::OverShare { limit, .. } => hold_limit(
            title,
            format!("{e}. Hold fewer codes, or pay for the codes held first"),
            *limit,
            "buyer-share",
        ),
        HoldError::TooManyHolds { limit, .. } => {
            hold_limit(title, e.to_string(), *limit, "holds-per-buyer")
        }
        HoldError::OwnerOverShare { limit, .. } => hold_limit(
            title,
            format!("{e}. Pay for or release this key's holds first"),
            *limit,
            "owner-share",
        ),
        HoldError::NotFound(id) => Problem::new(
            StatusCode::NOT_FOUND,
            "unknown-hold",
            "no such hold",
            format!("codepool has no hold {id:?} of this key; check the id, or place one with POST /v1/holds"),
        ),
        _ if e.is_retryable() => Problem::unavailable(&e),
        _ => Problem::internal(&e, "nothing was held twice"),
    };
    p.at(&rid.0).into_response()
}

/// `POST /v1/holds`: hold codes for a buyer's checkout, all or nothing.
/// 429 `hold-limit`, naming the cap and its limit.
fn hold_limit(title: &str, detail: String, limit: u64, cap: &str) -> Problem {
    Problem::new(StatusCode::TOO_MANY_REQUESTS, "hold-limit", title, detail)
        .with("limit", json!(limit))
        .with("cap", json!(cap))
}

#[utoipa::path(
    post, path = "/v1/holds", tag = "holds",
    operation_id = "place_hold",
    request_body(content = crate::openapi::HoldIn, content_type = "application/json"),
    responses(
        (status = 201, description = "every item is held until `expires_at`; no code is shown", body = Hold),
        (status = 200, description = "the same hold again, as it stands now", body = Hold),
        (status = 409, description = "out of stock (`insufficient-stock`, with what each pool has free; it comes before any limit: an empty pool is 409, never 429), a paused pool, or the hold id taken by another hold; nothing held", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
        (status = 403, description = "the key lacks `orders:write`, or a shop's key names a pool that is not its shop's or does not exist (`pool-not-allowed`, one answer for both); nothing held", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
        (status = 422, description = "an invalid field or unknown pool (named in `field`), or the buyer at its per-user limit of a pool (`per-user-limit`, with the `pool` and `limit`: its payment would be refused)", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
        (status = 429, description = "over the pool's share one buyer (or key or shop) may hold, or the buyer's open holds (`hold-limit`, naming its `cap` and `limit`), for a hold the stock could cover; nothing held", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
    ),
    security(("api_key" = ["orders:write"]))
)]
pub(crate) async fn place(
    State(api): State<Arc<Api>>,
    Caller { key, rid, .. }: Caller<OrdersWrite>,
    body: Bytes,
) -> Response {
    let req = match HoldRequest::parse(&body) {
        Ok(r) => r,
        Err(e) => return failed(HoldError::Invalid(e), &key, &rid),
    };
    let ask = holds::HoldAsk {
        req,
        owner: Some(key.owner()),
        shop: key.shop.clone(),
    };
    match api.holds.place(ask).await {
        Ok((h, true)) => (StatusCode::CREATED, Json(Hold::from(&h))).into_response(),
        Ok((h, false)) => (StatusCode::OK, Json(Hold::from(&h))).into_response(),
        Err(e) => failed(e, &key, &rid),
    }
}

/// `GET /v1/holds/{hold_id}`: a hold of this key (or its shop).
#[utoipa::path(
    get, path = "/v1/holds/{hold_id}", tag = "holds",
    operation_id = "read_hold",
    params(("hold_id" = String, Path, description = "the hold's id")),
    responses(
        (status = 200, description = "the hold: state (held, committed, released or expired), items, expiry", body = Hold),
        (status = 404, description = "no such hold of this key", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
    ),
    security(("api_key" = ["orders:read"]))
)]
pub(crate) async fn read(
    State(api): State<Arc<Api>>,
    Caller { key, rid, .. }: Caller<OrdersRead>,
    Path(hold_id): Path<String>,
) -> Response {
    let hold_id = codepool_domain::text::nfc(&hold_id);
    match api.hold(&hold_id, Some(&key.owner())).await {
        Ok(h) => Json(Hold::from(&h)).into_response(),
        Err(e) => failed(e, &key, &rid),
    }
}

/// `DELETE /v1/holds/{hold_id}`: releases the hold; its codes go back to
/// stock, waiting backorders first.
#[utoipa::path(
    delete, path = "/v1/holds/{hold_id}", tag = "holds",
    operation_id = "release_hold",
    params(("hold_id" = String, Path, description = "the hold's id")),
    responses(
        (status = 200, description = "released (or already ended: its state says how)", body = Hold),
        (status = 404, description = "no such hold of this key", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
    ),
    security(("api_key" = ["orders:write"]))
)]
pub(crate) async fn release(
    State(api): State<Arc<Api>>,
    Caller { key, rid, .. }: Caller<OrdersWrite>,
    Path(hold_id): Path<String>,
) -> Response {
    let hold_id = codepool_domain::text::nfc(&hold_id);
    match holds::release(api.intake(), &hold_id, Some(&key.owner())).await {
        Ok((h, returned)) => {
            if !returned.is_empty() {
                let pools = returned.iter().map(|c| c.pool.clone()).collect();
                holds::serve_returned(api.core(), &pools).await;
            }
            Json(Hold::from(&h)).into_response()
        }
        Err(e) => failed(e, &key, &rid),
    }
}
