//! `/v1/webhooks` (scope `admin`): a shop's endpoints, their deliveries
//! and replays, through the same operations as `codepool webhooks`.

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use codepool_issuance::audit::Actor;
use codepool_issuance::model::{AttemptDoc, EndpointDoc};
use codepool_issuance::webhooks::{self, WebhookError};
use serde::{Deserialize, Serialize};

use crate::problem::Problem;
use crate::request::need_admin as admin;
use crate::request::RequestId;
use crate::request::{Admin, AnyKey, Body, BodyDoc, Caller};
use crate::state::Api;
use codepool_issuance::api_keys::KeyDoc;
use utoipa::ToSchema;

fn time(t: bson::DateTime) -> String {
    t.try_to_rfc3339_string().unwrap_or_default()
}

/// A webhook endpoint.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct Webhook {
    /// `ep_…`.
    id: String,
    shop: String,
    url: String,
    events: Vec<String>,
    enabled: bool,
    /// Why it is disabled (410 Gone, failing for 5 days, an operator).
    disabled_reason: Option<String>,
    /// The first failed attempt since the last delivery (RFC 3339).
    failing_since: Option<String>,
    /// RFC 3339.
    created_at: String,
}

impl From<&EndpointDoc> for Webhook {
    fn from(e: &EndpointDoc) -> Self {
        Webhook {
            id: e.id.clone(),
            shop: e.shop.clone(),
            url: e.url.clone(),
            events: e.events.clone(),
            enabled: e.enabled,
            disabled_reason: e.disabled_reason.clone(),
            failing_since: e.failing_since.map(time),
            created_at: time(e.created_at),
        }
    }
}

/// An endpoint just added, with its signing secret (`whsec_…`), shown
/// this once.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct AddedWebhook {
    id: String,
    shop: String,
    url: String,
    events: Vec<String>,
    enabled: bool,
    disabled_reason: Option<String>,
    failing_since: Option<String>,
    created_at: String,
    secret: String,
}

impl AddedWebhook {
    fn of(e: Webhook, secret: String) -> Self {
        AddedWebhook {
            id: e.id,
            shop: e.shop,
            url: e.url,
            events: e.events,
            enabled: e.enabled,
            disabled_reason: e.disabled_reason,
            failing_since: e.failing_since,
            created_at: e.created_at,
            secret,
        }
    }
}

#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct WebhookList {
    endpoints: Vec<Webhook>,
}

/// A new secret, shown this once; the old one signs too for 24 hours.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct RotatedSecret {
    id: String,
    secret: String,
}

/// One delivery attempt.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct Delivery {
    /// The event's `webhook-id`.
    event: String,
    endpoint: String,
    /// The event type.
    #[serde(rename = "type")]
    kind: String,
    /// 1 for the first attempt.
    attempt: u32,
    /// RFC 3339.
    at: String,
    /// delivered, failed, gone (410), refused (the address), held.
    #[schema(pattern = "^(delivered|failed|gone|refused|held)$")]
    outcome: String,
    /// The HTTP status, when the endpoint answered.
    status: Option<u32>,
    latency_ms: u64,
    /// The first 1 KiB of the answer, or the error.
    response: String,
}

impl From<&AttemptDoc> for Delivery {
    fn from(a: &AttemptDoc) -> Self {
        Delivery {
            event: a.event.clone(),
            endpoint: a.endpoint.clone(),
            kind: a.kind.clone(),
            attempt: a.attempt,
            at: time(a.at),
            outcome: a.outcome.as_str().to_owned(),
            status: a.status,
            latency_ms: a.latency_ms,
            response: a.response.clone(),
        }
    }
}

#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct DeliveryList {
    deliveries: Vec<Delivery>,
}

#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ReplayedWebhooks {
    /// Deliveries due again now.
    due: u64,
    /// Deliveries left out: events older than the endpoint they would go
    /// to (send them with `include_before_endpoint`).
    left_out_before_endpoint: u64,
}

fn failed(e: WebhookError, rid: &RequestId) -> Response {
    let (status, slug, field) = match &e {
        WebhookError::Store(s) if s.is_unavailable() => {
            return Problem::unavailable(&e).at(&rid.0).into_response()
        }
        WebhookError::Store(_) => {
            return Problem::internal(&e, "nothing was changed")
                .at(&rid.0)
                .into_response()
        }
        WebhookError::UnknownShop(_) => (StatusCode::NOT_FOUND, "unknown-shop", Some("shop")),
        WebhookError::UnknownEndpoint(_) => (StatusCode::NOT_FOUND, "unknown-webhook", None),
        WebhookError::UnknownEvent(_) | WebhookError::NoEvents => (
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid-webhook",
            Some("events"),
        ),
        WebhookError::Address(_) => (
            StatusCode::UNPROCESSABLE_ENTITY,
            "address-refused",
            Some("url"),
        ),
        WebhookError::Scope(_) => (StatusCode::UNPROCESSABLE_ENTITY, "invalid-replay", None),
    };
    let mut p = Problem::new(
        status,
        slug,
        "the webhook request was not carried out",
        e.to_string(),
    )
    .at(&rid.0);
    if let Some(f) = field {
        p = p.field(f);
    }
    p.into_response()
}

/// A new webhook endpoint: its shop, where to post (https, a public
/// address) and the event types it receives.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(
    deny_unknown_fields,
    expecting = "an object with the shop, url and events"
)]
pub(crate) struct NewWebhook {
    shop: String,
    url: String,
    /// order.granted, order.partly_granted, order.voided, order.refused,
    /// pool.low_stock, pool.exhausted, pool.replenished, code.replaced,
    /// code.redeemed, or "*".
    events: Vec<String>,
}

impl BodyDoc for NewWebhook {
    const WHAT: &'static str = "a webhook endpoint";
    const SEND: &'static str =
        r#"{"shop": "acme", "url": "https://shop.example/hooks", "events": ["order.granted"]}"#;
}

#[derive(Debug, Deserialize)]
pub(crate) struct ShopFilter {
    shop: Option<String>,
    limit: Option<i64>,
}

/// Events to send again: one (`event`, a `msg_…` id) or every event of the
/// shop since a time (`since`, RFC 3339); to one endpoint or to all. An
/// endpoint gets only the events recorded since it was added, unless
/// `include_before_endpoint` is true: then it gets the older ones too, and
/// the codes they carry are audited as a reveal.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(
    deny_unknown_fields,
    expecting = "an object with the shop and an event id or a time"
)]
pub(crate) struct WebhookReplay {
    shop: String,
    event: Option<String>,
    since: Option<String>,
    endpoint: Option<String>,
    /// Send events older than the endpoint too (audited as a reveal).
    #[serde(default)]
    include_before_endpoint: bool,
}

impl BodyDoc for WebhookReplay {
    const WHAT: &'static str = "a replay";
    const SEND: &'static str = r#"{"shop": "acme", "event": "msg_…"} or {"shop": "acme", "since": "2026-11-25T10:00:00Z"}"#;
}

/// `GET /v1/webhooks?shop=…`.
#[utoipa::path(
    get, path = "/v1/webhooks", tag = "webhooks",
    operation_id = "list_webhooks",
    params(("shop" = Option<String>, Query, description = "only this shop's endpoints")),
    responses((status = 200, description = "the endpoints, oldest first", body = WebhookList)),
    security(("api_key" = ["admin"]))
)]
pub(crate) async fn list(
    State(api): State<Arc<Api>>,
    Caller { rid, .. }: Caller<Admin>,
    Query(q): Query<ShopFilter>,
) -> Response {
    match api.webhook_endpoints(q.shop.as_deref()).await {
        Ok(all) => Json(WebhookList {
            endpoints: all.iter().map(Webhook::from).collect(),
        })
        .into_response(),
        Err(e) => failed(e.into(), &rid),
    }
}

/// `POST /v1/webhooks` with `{"shop", "url", "events"}`.
#[utoipa::path(
    post, path = "/v1/webhooks", tag = "webhooks",
    operation_id = "add_webhook",
    request_body(content = NewWebhook, content_type = "application/json"),
    responses(
        (status = 201, description = "the endpoint, with its secret (shown once)", body = AddedWebhook),
        (status = 404, description = "no such shop", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
        (status = 422, description = "an unknown event type, or an address refused (`field`: url)", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
    ),
    security(("api_key" = ["admin"]))
)]
pub(crate) async fn add(
    State(api): State<Arc<Api>>,
    Caller { key, rid, .. }: Caller<Admin>,
    Body(new): Body<NewWebhook>,
) -> Response {
    let actor = Actor::api_key(&key.name, "POST /v1/webhooks");
    match api
        .add_webhook(&new.shop, &new.url, &new.events.join(","), &actor)
        .await
    {
        Ok(added) => {
            let v = AddedWebhook::of(Webhook::from(&added.endpoint), added.secret);
            (StatusCode::CREATED, Json(v)).into_response()
        }
        Err(e) => failed(e, &rid),
    }
}

async fn set_enabled(api: &Api, key: &KeyDoc, rid: &RequestId, id: &str, on: bool) -> Response {
    if let Some(r) = admin(key, rid) {
        return r;
    }
    let route = if on {
        "POST /v1/webhooks/{id}/enable"
    } else {
        "POST /v1/webhooks/{id}/disable"
    };
    match api
        .set_webhook_enabled(id, on, &Actor::api_key(&key.name, route))
        .await
    {
        Ok(e) => Json(Webhook::from(&e)).into_response(),
        Err(e) => failed(e, rid),
    }
}

/// `POST /v1/webhooks/{id}/disable`.
#[utoipa::path(
    post, path = "/v1/webhooks/{id}/disable", tag = "webhooks",
    operation_id = "disable_webhook",
    params(("id" = String, Path, description = "the endpoint's id (ep_…)")),
    responses(
        (status = 200, description = "the endpoint, disabled; its events are held", body = Webhook),
        (status = 404, description = "no such endpoint", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
    ),
    security(("api_key" = ["admin"]))
)]
pub(crate) async fn disable(
    State(api): State<Arc<Api>>,
    Caller { key, rid, .. }: Caller<AnyKey>,
    Path(id): Path<String>,
) -> Response {
    set_enabled(&api, &key, &rid, &id, false).await
}

/// `POST /v1/webhooks/{id}/enable`.
#[utoipa::path(
    post, path = "/v1/webhooks/{id}/enable", tag = "webhooks",
    operation_id = "enable_webhook",
    params(("id" = String, Path, description = "the endpoint's id (ep_…)")),
    responses(
        (status = 200, description = "the endpoint, enabled; what was held is due now", body = Webhook),
        (status = 404, description = "no such endpoint", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
    ),
    security(("api_key" = ["admin"]))
)]
pub(crate) async fn enable(
    State(api): State<Arc<Api>>,
    Caller { key, rid, .. }: Caller<AnyKey>,
    Path(id): Path<String>,
) -> Response {
    set_enabled(&api, &key, &rid, &id, true).await
}

/// `POST /v1/webhooks/{id}/rotate-secret`.
#[utoipa::path(
    post, path = "/v1/webhooks/{id}/rotate-secret", tag = "webhooks",
    operation_id = "rotate_webhook_secret",
    params(("id" = String, Path, description = "the endpoint's id (ep_…)")),
    responses(
        (status = 200, description = "the new secret (shown once); the old one signs too for 24 hours", body = RotatedSecret),
        (status = 404, description = "no such endpoint", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
    ),
    security(("api_key" = ["admin"]))
)]
pub(crate) async fn rotate(
    State(api): State<Arc<Api>>,
    Caller { key, rid, .. }: Caller<Admin>,
    Path(id): Path<String>,
) -> Response {
    let actor = Actor::api_key(&key.name, "POST /v1/webhooks/{id}/rotate-secret");
    match api.rotate_webhook_secret(&id, &actor).await {
        Ok(secret) => Json(RotatedSecret { id, secret }).into_response(),
        Err(e) => failed(e, &rid),
    }
}

/// `GET /v1/webhooks/{id}/deliveries`.
#[utoipa::path(
    get, path = "/v1/webhooks/{id}/deliveries", tag = "webhooks",
    operation_id = "webhook_deliveries",
    params(
        ("id" = String, Path, description = "the endpoint's id (ep_…)"),
        ("limit" = Option<i64>, Query, description = "at most this many, newest first (default 50, at most 1000)"),
    ),
    responses(
        (status = 200, description = "one record per attempt, newest first", body = DeliveryList),
        (status = 404, description = "no such endpoint", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
    ),
    security(("api_key" = ["admin"]))
)]
pub(crate) async fn deliveries(
    State(api): State<Arc<Api>>,
    Caller { rid, .. }: Caller<Admin>,
    Path(id): Path<String>,
    Query(q): Query<ShopFilter>,
) -> Response {
    let found = async {
        api.webhook_endpoint(&id, q.shop.as_deref()).await?;
        api.webhook_deliveries(None, Some(&id), q.limit.unwrap_or(50).clamp(1, 1000))
            .await
    };
    match found.await {
        Ok(list) => Json(DeliveryList {
            deliveries: list.iter().map(Delivery::from).collect(),
        })
        .into_response(),
        Err(e) => failed(e, &rid),
    }
}

/// `POST /v1/webhooks/replay` with `{"shop", "event"}` or `{"shop", "since"}`.
/// An endpoint gets only events recorded since it was added, unless
/// `include_before_endpoint` is true; then the codes it gets that way are
/// audited as a reveal by the key.
#[utoipa::path(
    post, path = "/v1/webhooks/replay", tag = "webhooks",
    operation_id = "replay_webhooks",
    request_body(content = WebhookReplay, content_type = "application/json"),
    responses(
        (status = 200, description = "how many deliveries are due again, and how many were left out (events older than their endpoint, without `include_before_endpoint`)", body = ReplayedWebhooks),
        (status = 404, description = "no such shop or endpoint", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
        (status = 422, description = "neither an event id nor a time", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
    ),
    security(("api_key" = ["admin"]))
)]
pub(crate) async fn replay(
    State(api): State<Arc<Api>>,
    Caller { key, rid, .. }: Caller<Admin>,
    Body(r): Body<WebhookReplay>,
) -> Response {
    let scope = match r.event.or(r.since).as_deref().map(webhooks::replay_scope) {
        Some(Ok(s)) => s,
        Some(Err(e)) => return failed(e, &rid),
        None => return failed(WebhookError::Scope(String::new()), &rid),
    };
    let actor = Actor::api_key(&key.name, "POST /v1/webhooks/replay");
    let replayed = api.replay_webhooks(
        &r.shop,
        &scope,
        r.endpoint.as_deref(),
        r.include_before_endpoint,
        &actor,
    );
    match replayed.await {
        Ok(r) => Json(ReplayedWebhooks {
            due: r.due,
            left_out_before_endpoint: r.left_out,
        })
        .into_response(),
        Err(e) => failed(e, &rid),
    }
}
