//! `/v1/shops` (scope `admin`): create, list, show a shop and set its pools,
//! through the same operations as `codepool shops`.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use codepool_issuance::audit::Actor;
use codepool_issuance::model::ShopDoc;
use codepool_issuance::shops::ShopError;
use serde::{Deserialize, Serialize};

use crate::problem::Problem;
use crate::request::RequestId;
use crate::request::{Admin, Body, BodyDoc, Caller};
use crate::state::Api;
use utoipa::ToSchema;

/// A shop.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct Shop {
    name: String,
    pools: Vec<String>,
    /// RFC 3339.
    created_at: String,
}

impl From<&ShopDoc> for Shop {
    fn from(s: &ShopDoc) -> Self {
        Shop {
            name: s.name.clone(),
            pools: s.pools.clone(),
            created_at: s.created_at.try_to_rfc3339_string().unwrap_or_default(),
        }
    }
}

#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct ShopList {
    shops: Vec<Shop>,
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

const SEND_SHOP: &str = r#"{"name": "acme", "pools": ["game-x"]}, or ["*"] for every pool"#;

/// A new shop: its name and the pools it may order from (`["*"]`: every
/// pool).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(
    deny_unknown_fields,
    expecting = "an object with the shop's name and pools"
)]
pub(crate) struct NewShop {
    name: String,
    pools: Vec<String>,
}

impl BodyDoc for NewShop {
    const WHAT: &'static str = "a shop";
    const SEND: &'static str = SEND_SHOP;
}

/// A shop's new pool list (it replaces the old one).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields, expecting = "an object with the shop's pools")]
pub(crate) struct ShopPools {
    pools: Vec<String>,
}

impl BodyDoc for ShopPools {
    const WHAT: &'static str = "a shop";
    const SEND: &'static str = SEND_SHOP;
}

/// `GET /v1/shops`.
#[utoipa::path(
    get, path = "/v1/shops", tag = "shops",
    operation_id = "list_shops",
    responses((status = 200, description = "every shop, by name", body = ShopList)),
    security(("api_key" = ["admin"]))
)]
pub(crate) async fn list(
    State(api): State<Arc<Api>>,
    Caller { rid, .. }: Caller<Admin>,
) -> Response {
    match api.shops().await {
        Ok(all) => Json(ShopList {
            shops: all.iter().map(Shop::from).collect(),
        })
        .into_response(),
        Err(e) => shop_failed(e.into(), &rid),
    }
}

/// `POST /v1/shops` with `{"name": …, "pools": […]}`.
#[utoipa::path(
    post, path = "/v1/shops", tag = "shops",
    operation_id = "create_shop",
    request_body(content = NewShop, content_type = "application/json"),
    responses(
        (status = 201, description = "the shop was created", body = Shop),
        (status = 409, description = "a shop of that name exists", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
        (status = 422, description = "an unusable name or pool (`field`)", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
    ),
    security(("api_key" = ["admin"]))
)]
pub(crate) async fn create(
    State(api): State<Arc<Api>>,
    Caller { key, rid, .. }: Caller<Admin>,
    Body(new): Body<NewShop>,
) -> Response {
    let actor = Actor::api_key(&key.name, "POST /v1/shops");
    match api.create_shop(&new.name, &new.pools, &actor).await {
        Ok(s) => (StatusCode::CREATED, Json(Shop::from(&s))).into_response(),
        Err(e) => shop_failed(e, &rid),
    }
}

/// `GET /v1/shops/{name}`.
#[utoipa::path(
    get, path = "/v1/shops/{name}", tag = "shops",
    operation_id = "show_shop",
    params(("name" = String, Path, description = "the shop's name")),
    responses(
        (status = 200, description = "the shop", body = Shop),
        (status = 404, description = "no such shop", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
    ),
    security(("api_key" = ["admin"]))
)]
pub(crate) async fn show(
    State(api): State<Arc<Api>>,
    Caller { rid, .. }: Caller<Admin>,
    Path(name): Path<String>,
) -> Response {
    match api.shop(&name).await {
        Ok(Some(s)) => Json(Shop::from(&s)).into_response(),
        Ok(None) => shop_failed(ShopError::Unknown(name), &rid),
        Err(e) => shop_failed(e.into(), &rid),
    }
}

/// `PATCH /v1/shops/{name}` with `{"pools": […]}`.
#[utoipa::path(
    patch, path = "/v1/shops/{name}", tag = "shops",
    operation_id = "set_shop",
    params(("name" = String, Path, description = "the shop's name")),
    request_body(content = ShopPools, content_type = "application/json"),
    responses(
        (status = 200, description = "the shop, with its new pools", body = Shop),
        (status = 404, description = "no such shop", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
        (status = 422, description = "an unusable pool (`field`: pools)", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
    ),
    security(("api_key" = ["admin"]))
)]
pub(crate) async fn set(
    State(api): State<Arc<Api>>,
    Caller { key, rid, .. }: Caller<Admin>,
    Path(name): Path<String>,
    Body(change): Body<ShopPools>,
) -> Response {
    let actor = Actor::api_key(&key.name, "PATCH /v1/shops/{name}");
    match api.set_shop_pools(&name, &change.pools, &actor).await {
        Ok(s) => Json(Shop::from(&s)).into_response(),
        Err(e) => shop_failed(e, &rid),
    }
}
