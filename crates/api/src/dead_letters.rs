//! `/v1/dead-letters` (scope `admin`): what was dead-lettered and why, and
//! a replay once the cause is fixed, as `codepool dead-letters`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use codepool_broker::dead_letters;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::problem::Problem;
use crate::request::RequestId;
use crate::request::{Admin, Caller};
use crate::state::Api;

/// Most dead letters one call lists or replays.
const MOST: usize = 1000;

fn bad_limit(rid: &RequestId) -> Response {
    Problem::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        "invalid-limit",
        "the limit is out of range",
        format!("limit must be 1 to {MOST}"),
    )
    .field("limit")
    .at(&rid.0)
    .into_response()
}

/// Which dead letters: of one reason, at most `limit`.
#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = ReplayIn)]
pub(crate) struct Filter {
    #[schema(nullable = false)]
    reason: Option<String>,
    #[schema(nullable = false)]
    limit: Option<usize>,
}

#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct DeadLetter {
    message_id: Option<String>,
    reason: String,
    replays: u64,
    /// The purchase as it came (text).
    body: String,
}

#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct DeadLetters {
    dead_letters: Vec<DeadLetter>,
    /// Letters examined, matching or not (at most 1,000, or `limit`).
    scanned: u64,
    /// The walk stopped at its bound with letters left unexamined: older
    /// matches may lie beyond.
    stopped_early: bool,
}

#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct Replayed {
    replayed: u64,
}

/// `GET /v1/dead-letters?reason=unknown_pool&limit=N`: they stay queued.
/// At most [`dead_letters::MOST_SCANNED`] letters are examined; the answer
/// says how many (`scanned`) and whether more were left (`stopped_early`).
#[utoipa::path(
    get, path = "/v1/dead-letters", tag = "dead-letters",
    operation_id = "list_dead_letters",
    params(("reason" = Option<String>, Query, description = "only letters of this reason (e.g. unknown_pool)"),
           ("limit" = Option<usize>, Query, description = "at most this many (default 100)")),
    responses(
        (status = 200, description = "dead letters, oldest first; they stay queued", body = DeadLetters),
        (status = 422, description = "an invalid `limit`", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
    ),
    security(("api_key" = ["admin"]))
)]
pub(crate) async fn list(
    State(api): State<Arc<Api>>,
    Caller { rid, .. }: Caller<Admin>,
    Query(f): Query<Filter>,
) -> Response {
    let limit = f.limit.unwrap_or(100);
    if !(1..=MOST).contains(&limit) {
        return bad_limit(&rid);
    }
    let broker = api.broker();
    let topology = broker.publisher.topology();
    match dead_letters::peek(&broker.conn, topology, f.reason.as_deref(), limit).await {
        Ok(found) => Json(DeadLetters {
            dead_letters: (found.letters.iter())
                .map(|d| DeadLetter {
                    message_id: d.message_id.clone(),
                    reason: d.reason.clone(),
                    replays: u64::from(d.replays),
                    body: d.body.clone(),
                })
                .collect(),
            scanned: found.scanned as u64,
            stopped_early: found.stopped_early,
        })
        .into_response(),
        Err(e) => Problem::unavailable(&e).at(&rid.0).into_response(),
    }
}

/// `POST /v1/dead-letters/replay` with optional `{"reason": …, "limit": N}`:
/// back to the purchases queue; those still invalid come back dead.
#[utoipa::path(
    post, path = "/v1/dead-letters/replay", tag = "dead-letters",
    operation_id = "replay_dead_letters",
    request_body(content = Option<Filter>, content_type = "application/json"),
    responses(
        (status = 200, description = "letters sent back to the purchases queue; those still invalid come back dead", body = Replayed),
        (status = 422, description = "the body is not a replay", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
    ),
    security(("api_key" = ["admin"]))
)]
pub(crate) async fn replay(
    State(api): State<Arc<Api>>,
    Caller { key, rid, .. }: Caller<Admin>,
    body: Bytes,
) -> Response {
    let f: Filter = if body.is_empty() {
        Filter::default()
    } else {
        match serde_json::from_slice(&body) {
            Ok(f) => f,
            Err(e) => {
                let send = r#"nothing, or {"reason": "unknown_pool", "limit": 100}"#;
                return Problem::invalid_body("a replay", send, &e)
                    .at(&rid.0)
                    .into_response();
            }
        }
    };
    let limit = f.limit.unwrap_or(MOST);
    if !(1..=MOST).contains(&limit) {
        return bad_limit(&rid);
    }
    let actor = codepool_issuance::audit::Actor::api_key(&key.name, "POST /v1/dead-letters/replay");
    match api
        .replay_dead_letters(f.reason.as_deref(), limit, &actor)
        .await
    {
        Ok(sent) => {
            tracing::info!(replayed = sent.len(), key = %key.name, "dead letters replayed");
            Json(Replayed {
                replayed: sent.len() as u64,
            })
            .into_response()
        }
        Err(e) => Problem::unavailable(&e).at(&rid.0).into_response(),
    }
}
