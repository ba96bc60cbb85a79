//! Kinguin's reservation webhooks: `POST /channels/NAME/kinguin`, the
//! webhook secret in `X-Auth-Token` (set in Kinguin's merchant panel),
//! one reservation status change per call. The core holds, commits,
//! releases or voids (`codepool_issuance::channels::kinguin`); the key
//! goes to Kinguin by upload, from the uploader, not in this answer.
//!
//! Answers: 200 `{reservationId, status, result}` when the webhook was
//! taken (an unknown status too: recorded); otherwise `{reservationId?,
//! status?, error, message}` with 401 (wrong secret), 400 (a body outside
//! the contract), 413 (a body over [`super::BODY_LIMIT`]), 404 (unknown
//! channel, offer or reservation), 409 (a reservation codepool cannot
//! honour: out of stock, paused, cancelled, past its time, a replacement
//! over the order's cap), 503 (try again). None of them changes anything.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use codepool_issuance::channels::kinguin::{self, Hook};
use codepool_issuance::channels::CallError;
use serde::Serialize;
use serde_json::json;
use utoipa::ToSchema;

use crate::state::Api;

/// The header Kinguin's webhooks carry the secret in.
const SECRET_HEADER: &str = "x-auth-token";

fn refused(status: StatusCode, hook: Option<&Hook>, error: &str, message: String) -> Response {
    let body = json!({
        "reservationId": hook.map(|h| h.reservation.as_str()),
        "status": hook.map(|h| h.status.as_str()),
        "error": error,
        "message": message,
    });
    (status, Json(body)).into_response()
}

fn failed(hook: Option<&Hook>, e: CallError) -> Response {
    let (status, error) = match &e {
        CallError::UnknownChannel => (StatusCode::NOT_FOUND, "unknown-channel"),
        CallError::Unauthorized => (StatusCode::UNAUTHORIZED, "unauthorized"),
        CallError::Malformed(_) => (StatusCode::BAD_REQUEST, "bad-request"),
        CallError::UnknownProduct(_) => (StatusCode::NOT_FOUND, "unknown-offer"),
        CallError::UnknownDeal(_) => (StatusCode::NOT_FOUND, "unknown-reservation"),
        CallError::Paused => (StatusCode::CONFLICT, "paused"),
        CallError::Cancelled => (StatusCode::CONFLICT, "cancelled"),
        CallError::Expired => (StatusCode::CONFLICT, "expired"),
        CallError::OrderExists => (StatusCode::CONFLICT, "conflict"),
        CallError::Unavailable(_) => (StatusCode::CONFLICT, "out-of-stock"),
        CallError::NotReplaced(_) => (StatusCode::CONFLICT, "not-replaced"),
        CallError::Retry(_) => (StatusCode::SERVICE_UNAVAILABLE, "try-again"),
        CallError::Failed(_) => (StatusCode::INTERNAL_SERVER_ERROR, "failed"),
    };
    if status == StatusCode::INTERNAL_SERVER_ERROR {
        tracing::warn!(reservation = hook.map(|h| h.reservation.as_str()), error = %e, "a Kinguin webhook failed");
    }
    refused(status, hook, error, e.to_string())
}

/// A Kinguin reservation webhook's body (other members are not read).
#[derive(Serialize, ToSchema)]
#[allow(dead_code)]
pub(crate) struct KinguinHook {
    /// Kinguin's reservation (a string or a number).
    #[serde(rename = "reservationId")]
    #[schema(schema_with = super::id_schema)]
    reservation_id: String,
    /// The offer: a product the channel maps.
    #[serde(rename = "offerId")]
    #[schema(schema_with = super::id_schema)]
    offer_id: String,
    /// BUYING, BOUGHT, CANCELED, REVERSED, REFUNDED, OUT_OF_STOCK,
    /// DELIVERED, … (an unknown one is recorded, nothing else).
    #[schema(pattern = "^[A-Za-z0-9_]{1,40}$")]
    status: String,
    #[serde(rename = "orderId")]
    #[schema(schema_with = super::id_schema)]
    order_id: Option<String>,
    /// A returned key's stock id (a return or a replacement).
    #[serde(rename = "releasedStockId")]
    #[schema(nullable = false)]
    released_stock_id: Option<String>,
}

/// A webhook taken.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
pub(crate) struct KinguinTaken {
    #[serde(rename = "reservationId")]
    reservation_id: String,
    status: String,
    /// `held`, `bought` (the key is uploaded by the uploader, with
    /// retries), `released`, `voided`, `delivered` or `recorded`.
    #[schema(pattern = "^(held|bought|released|voided|delivered|recorded)$")]
    result: String,
}

/// A webhook refused: nothing changed.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
pub(crate) struct KinguinRefusal {
    /// The webhook's reservation, when it was read (never from an
    /// unauthenticated body).
    #[serde(rename = "reservationId")]
    reservation_id: Option<String>,
    status: Option<String>,
    /// `unauthorized`, `bad-request`, `unknown-channel`, `unknown-offer`,
    /// `unknown-reservation`, `paused`, `cancelled`, `expired`,
    /// `conflict`, `out-of-stock`, `try-again` or `failed`.
    error: String,
    message: String,
}

/// `POST /channels/NAME/kinguin`: one reservation status change.
#[utoipa::path(
    post, path = "/channels/{name}/kinguin", tag = "channels",
    operation_id = "kinguin_webhook",
    params(("name" = String, Path, description = "the channel")),
    request_body(content = KinguinHook, content_type = "application/json"),
    responses(
        (status = 200, description = "taken (an unknown status too: recorded)", body = KinguinTaken),
        (status = 400, description = "a body outside Kinguin's contract", body = KinguinRefusal),
        (status = 401, description = "not the channel's webhook secret (`X-Auth-Token`); nothing read is acted on or echoed", body = KinguinRefusal),
        (status = 404, description = "no Kinguin channel of that name, an offer it does not map, or an unknown reservation", body = KinguinRefusal),
        (status = 408, description = "the request took longer than `--request-timeout`; Kinguin sends the webhook again"),
        (status = 409, description = "a reservation codepool cannot honour: out of stock, a paused channel, cancelled, past its time", body = KinguinRefusal),
        (status = 413, description = "the body is over 64 KiB"),
        (status = 500, description = "a fault; Kinguin sends the webhook again", body = KinguinRefusal),
        (status = 503, description = "MongoDB or the batch is away; Kinguin sends the webhook again", body = KinguinRefusal),
    ),
    security(("kinguin_secret" = []))
)]
pub(super) async fn webhook(
    State(api): State<Arc<Api>>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let secret = headers.get(SECRET_HEADER).and_then(|v| v.to_str().ok());
    // Nothing read from an unauthenticated body is acted on or echoed.
    let c = match api.kinguin_authorized(&name, secret).await {
        Ok(c) => c,
        Err(e) => return failed(None, e),
    };
    // A body too large (or cut short) gets Kinguin's shape too.
    let body = match body {
        Ok(b) => b,
        Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            let why = format!(
                "the body is over {} bytes; a webhook is well under a kilobyte",
                super::BODY_LIMIT
            );
            return refused(e.status(), None, "too-large", why);
        }
        Err(e) => return refused(e.status(), None, "bad-request", e.body_text()),
    };
    let hook = match kinguin::read(&body) {
        Ok(h) => h,
        Err(why) => return refused(StatusCode::BAD_REQUEST, None, "bad-request", why),
    };
    match api
        .kinguin_webhook(&api.holds, api.as_ref(), &c, &hook)
        .await
    {
        Ok(done) => Json(json!({
            "reservationId": hook.reservation,
            "status": hook.status,
            "result": done.as_str(),
        }))
        .into_response(),
        Err(e) => failed(Some(&hook), e),
    }
}
