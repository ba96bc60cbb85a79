//! `/v1/shops` (scope `admin`): create, list, show a shop and set its pools,
//! through the same operations as `codepool shops`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use codepool_issuance::audit::Actor;
use codepool_issuance::model::ShopDoc;
use codepool_issuance::shops::{self, ShopError};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::problem::Problem;
use crate::request::need_admin as admin;
use crate::request::RequestId;
use crate::state::Api;
use codepool_issuance::api_keys::KeyDoc;

type Ctx = (State<Arc<Api>>, Extension<KeyDoc>, Extension<RequestId>);

pub(crate) fn shop_json(s: &ShopDoc) -> Value {
    json!({
        "name": s.name,
        "pools": s.pools,
        "created_at": s.created_at.try_to_rfc3339_string().unwrap_or_default(),
    })
}

fn shop_failed(e: ShopError, rid: &RequestId) -> Response {
    let (status, slug) = match &e {
        ShopError::Store(s) if s.is_unavailable() => {
            return Problem::unavailable(&e).at(&rid.0).into_response()
        }
        ShopError::Store(_) => {
            return Problem::internal(&e, "the shop was not changed")
                .at(&rid.0)
                .into_response()
        }
        ShopError::Exists(_) => (StatusCode::CONFLICT, "shop-exists"),
        ShopError::Unknown(_) => (StatusCode::NOT_FOUND, "unknown-shop"),
        _ => (StatusCode::UNPROCESSABLE_ENTITY, "invalid-shop"),
    };
    let mut p = Problem::new(status, slug, "the shop was not changed", e.to_string()).at(&rid.0);
    if let Some(f) = e.field() {
        p = p.field(f);
    }
    p.into_response()
}

fn bad_body(e: &serde_json::Error, rid: &RequestId) -> Response {
    let send = r#"{"name": "acme", "pools": ["game-x"]}, or ["*"] for every pool"#;
    Problem::invalid_body("a shop", send, e)
        .at(&rid.0)
        .into_response()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NewShop {
    name: String,
    pools: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ShopPools {
    pools: Vec<String>,
}

/// `GET /v1/shops`.
#[utoipa::path(
    get, path = "/v1/shops", tag = "shops",
    operation_id = "list_shops",
    responses((status = 200, description = "every shop, by name", body = crate::openapi::ShopList)),
    security(("api_key" = ["admin"]))
)]
pub(crate) async fn list((State(api), Extension(key), Extension(rid)): Ctx) -> Response {
    if let Some(r) = admin(&key, &rid) {
        return r;
    }
    match api.store().shops().await {
        Ok(all) => {
            Json(json!({"shops": all.iter().map(shop_json).collect::<Vec<_>>()})).into_response()
        }
        Err(e) => shop_failed(e.into(), &rid),
    }
}

/// `POST /v1/shops` with `{"name": …, "pools": […]}`.
#[utoipa::path(
    post, path = "/v1/shops", tag = "shops",
    operation_id = "create_shop",
    request_body(content = crate::openapi::NewShop, content_type = "application/json"),
    responses(
        (status = 201, description = "the shop was created", body = crate::openapi::Shop),
        (status = 409, description = "a shop of that name exists", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
        (status = 422, description = "an unusable name or pool (`field`)", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
    ),
    security(("api_key" = ["admin"]))
)]
pub(crate) async fn create(
    (State(api), Extension(key), Extension(rid)): Ctx,
    body: Bytes,
) -> Response {
    if let Some(r) = admin(&key, &rid) {
        return r;
    }
    let new = match serde_json::from_slice::<NewShop>(&body) {
        Ok(b) => b,
        Err(e) => return bad_body(&e, &rid),
    };
    let actor = Actor::api_key(&key.name, "POST /v1/shops");
    match shops::create(api.store(), &new.name, &new.pools, &actor).await {
        Ok(s) => (StatusCode::CREATED, Json(shop_json(&s))).into_response(),
        Err(e) => shop_failed(e, &rid),
    }
}

/// `GET /v1/shops/{name}`.
#[utoipa::path(
    get, path = "/v1/shops/{name}", tag = "shops",
    operation_id = "show_shop",
    params(("name" = String, Path, description = "the shop's name")),
    responses(
        (status = 200, description = "the shop", body = crate::openapi::Shop),
        (status = 404, description = "no such shop", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
    ),
    security(("api_key" = ["admin"]))
)]
pub(crate) async fn show(
    (State(api), Extension(key), Extension(rid)): Ctx,
    Path(name): Path<String>,
) -> Response {
    if let Some(r) = admin(&key, &rid) {
        return r;
    }
    match api.store().shop(&name).await {
        Ok(Some(s)) => Json(shop_json(&s)).into_response(),
        Ok(None) => shop_failed(ShopError::Unknown(name), &rid),
        Err(e) => shop_failed(e.into(), &rid),
    }
}

/// `PATCH /v1/shops/{name}` with `{"pools": […]}`.
#[utoipa::path(
    patch, path = "/v1/shops/{name}", tag = "shops",
    operation_id = "set_shop",
    params(("name" = String, Path, description = "the shop's name")),
    request_body(content = crate::openapi::ShopPools, content_type = "application/json"),
    responses(
        (status = 200, description = "the shop, with its new pools", body = crate::openapi::Shop),
        (status = 404, description = "no such shop", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
        (status = 422, description = "an unusable pool (`field`: pools)", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
    ),
    security(("api_key" = ["admin"]))
)]
pub(crate) async fn set(
    (State(api), Extension(key), Extension(rid)): Ctx,
    Path(name): Path<String>,
    body: Bytes,
) -> Response {
    if let Some(r) = admin(&key, &rid) {
        return r;
    }
    let change = match serde_json::from_slice::<ShopPools>(&body) {
        Ok(b) => b,
        Err(e) => return bad_body(&e, &rid),
    };
    let actor = Actor::api_key(&key.name, "PATCH /v1/shops/{name}");
    match shops::set_pools(api.store(), &name, &change.pools, &actor).await {
        Ok(s) => Json(shop_json(&s)).into_response(),
        Err(e) => shop_failed(e, &rid),
    }
}
