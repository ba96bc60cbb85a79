//! `POST /v1/pools/{pool}/generations` and `GET /v1/generations/{id}`
//! (scope `admin`): codes made in a pool by the same run as `codepool
//! generate`. The POST answers as soon as the run's record is written,
//! with its id; the codes are made in the background and the GET shows
//! how far the run got.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use codepool_domain::CodePattern;
use codepool_issuance::api_keys::KeyDoc;
use codepool_issuance::generations::{GenerateError, Generation};
use serde::Deserialize;
use serde_json::json;

use crate::problem::Problem;
use crate::request::need_admin as admin;
use crate::request::RequestId;
use crate::state::Api;

type Ctx = (State<Arc<Api>>, Extension<KeyDoc>, Extension<RequestId>);

/// The body of a POST.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GenerationIn {
    count: u64,
    pattern: Option<String>,
    #[serde(default)]
    check_char: bool,
    expires_at: Option<chrono::DateTime<chrono::Utc>>,
    run_id: Option<String>,
    #[serde(default)]
    new_run: bool,
}

fn unprocessable(rid: &RequestId, slug: &str, field: &str, detail: String) -> Response {
    Problem::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        slug,
        "the generation cannot run",
        detail,
    )
    .field(field)
    .at(&rid.0)
    .into_response()
}

/// `POST /v1/pools/{pool}/generations`: starts a run; 202 with its id.
#[utoipa::path(
    post, path = "/v1/pools/{pool}/generations", tag = "generations",
    operation_id = "start_generation",
    params(("pool" = String, Path, description = "the pool the codes go to")),
    request_body(content = crate::openapi::GenerationIn, content_type = "application/json"),
    responses(
        (status = 202, description = "the run is started, or an unfinished run of the same pool, pattern, count, check symbol and expiry is taken up (`resumed`: true; `new_run` asks for a second run instead); read it at /v1/generations/{run_id}", body = crate::openapi::GenerationStarted),
        (status = 409, description = "the run id belongs to another run (another pool, count or pattern: `other-run`), or to a run that was recalled (`recalled-run`)", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
        (status = 422, description = "a pattern under 40 random bits or malformed, a count out of range, a bad pool name or run id", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
    ),
    security(("api_key" = ["admin"]))
)]
pub(crate) async fn start(
    (State(api), Extension(key), Extension(rid)): Ctx,
    Path(pool): Path<String>,
    body: axum::body::Bytes,
) -> Response {
    if let Some(r) = admin(&key, &rid) {
        return r;
    }
    let input: GenerationIn = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => return unprocessable(&rid, "invalid-body", "body", format!("{e}; send {{\"count\": 1000, \"pattern\": \"GX-{{random:12}}\", \"check_char\": true}}")),
    };
    let text = (input.pattern.as_deref()).unwrap_or(codepool_domain::pattern::DEFAULT_PATTERN);
    let pattern = match CodePattern::parse(text, input.check_char) {
        Ok(p) => p,
        Err(e) => return unprocessable(&rid, "invalid-pattern", "pattern", e.to_string()),
    };
    let run_id = match input.run_id.as_deref().map(bson::oid::ObjectId::parse_str) {
        None => None,
        Some(Ok(id)) => Some(id),
        Some(Err(_)) => {
            return unprocessable(
                &rid,
                "invalid-run-id",
                "run_id",
                "a run id is 24 hexadecimal digits; leave it out for a new run".into(),
            )
        }
    };
    if input.new_run && run_id.is_some() {
        return unprocessable(
            &rid,
            "invalid-run-id",
            "run_id",
            "send either a run_id (finish that run) or \"new_run\": true (a second run), not both"
                .into(),
        );
    }
    // A second run beside an unfinished one of the same kind is asked for
    // by name: a new id. Without one, that run is taken up.
    let run_id = run_id.or(input.new_run.then(bson::oid::ObjectId::new));
    let g = Generation {
        pool: pool.clone(),
        count: input.count,
        pattern,
        expires_at: input.expires_at,
        run_id,
    };
    let actor =
        codepool_issuance::audit::Actor::api_key(&key.name, "POST /v1/pools/{name}/generations");
    match api.start_generation(g.clone(), actor).await {
        Ok((id, resumed)) => (
            StatusCode::ACCEPTED,
            Json(json!({
                "run_id": id.to_hex(), "pool": pool, "count": g.count,
                "pattern": g.pattern.to_string(), "status": "running", "resumed": resumed,
            })),
        )
            .into_response(),
        Err(e) => start_failed(e, &rid),
    }
}

fn start_failed(e: GenerateError, rid: &RequestId) -> Response {
    match &e {
        GenerateError::Pool(_) => unprocessable(rid, "invalid-pool", "pool", e.to_string()),
        GenerateError::Count(_) => unprocessable(rid, "invalid-count", "count", e.to_string()),
        GenerateError::ExpiredAtBirth(_) => {
            unprocessable(rid, "invalid-expiry", "expires_at", e.to_string())
        }
        GenerateError::OtherRun { .. } => Problem::new(
            StatusCode::CONFLICT,
            "other-run",
            "the run id belongs to another run",
            e.to_string(),
        )
        .field("run_id")
        .at(&rid.0)
        .into_response(),
        GenerateError::Recalled { .. } => Problem::new(
            StatusCode::CONFLICT,
            "recalled-run",
            "the run was recalled",
            e.to_string(),
        )
        .field("run_id")
        .at(&rid.0)
        .into_response(),
        _ => Problem::unavailable(&e).at(&rid.0).into_response(),
    }
}

fn unknown_run(id: &str, rid: &RequestId) -> Response {
    Problem::new(
        StatusCode::NOT_FOUND,
        "unknown-generation",
        "no such generation run",
        format!(
            "no generation run {:?}; use the run_id a POST answered (24 hexadecimal digits)",
            id.chars().take(40).collect::<String>()
        ),
    )
    .at(&rid.0)
    .into_response()
}

/// `GET /v1/generations/{run_id}`: the run's record.
#[utoipa::path(
    get, path = "/v1/generations/{run_id}", tag = "generations",
    operation_id = "show_generation",
    params(("run_id" = String, Path, description = "the id the POST answered")),
    responses(
        (status = 200, description = "the run: what it makes, and how far it got", body = crate::openapi::GenerationOut),
        (status = 404, description = "no such generation run", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
    ),
    security(("api_key" = ["admin"]))
)]
pub(crate) async fn show(
    (State(api), Extension(key), Extension(rid)): Ctx,
    Path(id): Path<String>,
) -> Response {
    if let Some(r) = admin(&key, &rid) {
        return r;
    }
    let Ok(oid) = bson::oid::ObjectId::parse_str(&id) else {
        return unknown_run(&id, &rid);
    };
    let record = match api.import_record(oid).await {
        Ok(r) => r,
        Err(e) => return Problem::unavailable(&e).at(&rid.0).into_response(),
    };
    let Some((r, spec)) = record.and_then(|r| {
        let spec = r.generation.clone()?;
        Some((r, spec))
    }) else {
        return unknown_run(&id, &rid);
    };
    let time = |t: bson::DateTime| t.to_chrono().to_rfc3339();
    Json(json!({
        "run_id": r.id.to_hex(), "pool": r.pool, "pattern": spec.pattern, "count": spec.count,
        "check_char": spec.check_char, "expires_at": spec.expires_at.map(time),
        "status": r.status, "inserted": r.inserted, "redrawn": r.duplicates, "error": r.error,
        "started_at": time(r.started_at), "finished_at": r.finished_at.map(time),
    }))
    .into_response()
}
