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
use serde_json::json;

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

/// `POST /channels/NAME/kinguin`: one reservation status change.
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
