//! G2A's Dropshipping API ("Merchant's API to manage stock" 1.0.0), hosted
//! by codepool for G2A under `/channels/NAME/g2a`: OAuth2 client
//! credentials (`GET /oauth/token`, tokens that expire), reservations
//! (create, renew, release: a hold each), orders (200 with the keys, the
//! same 200 for the same G2A order again, 409 for another order of the
//! same reservation, 410 once the reservation expired), the inventory with
//! stable item ids (each key's own id), returns by item id (the keys are
//! voided: they were shown, so they never return to stock), and the
//! health check.
//!
//! Errors are `{code, message}` with the status the contract names.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use codepool_issuance::channels::{self, g2a, CallError, Key};
use codepool_issuance::model::{ChannelDoc, DealDoc, DealLine};
use serde::Serialize;
use serde_json::{json, Value};
use utoipa::{IntoResponses, ToSchema};

use crate::state::Api;

/// G2A's error shape.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
pub(crate) struct G2aError {
    /// `bad_request`, `unsupported_grant_type`, `unauthorized`,
    /// `not_found`, `out_of_stock`, `order_exists`,
    /// `reservation_expired`, `unavailable` or `internal`.
    code: String,
    message: String,
}

/// What every G2A route may answer instead of its own answer:
/// `{code, message}` with the contract's status. Nothing changes.
#[derive(IntoResponses)]
#[allow(dead_code)]
pub(crate) enum G2aRefusals {
    #[response(
        status = 400,
        description = "a body or query outside the contract (`bad_request`, `unsupported_grant_type`), or stock the channel cannot hold: out of stock, a paused channel (`out_of_stock`)"
    )]
    BadRequest(#[to_schema] G2aError),
    #[response(
        status = 401,
        description = "no access token, or not one of this channel's live tokens (`unauthorized`); wrong client credentials"
    )]
    Unauthorized(#[to_schema] G2aError),
    #[response(
        status = 404,
        description = "no G2A channel of that name, a product it does not map, an unknown reservation or order (`not_found`)"
    )]
    NotFound(#[to_schema] G2aError),
    #[response(
        status = 408,
        description = "the request took longer than `--request-timeout`; the same call may be made again"
    )]
    Timeout,
    #[response(
        status = 409,
        description = "the reservation was ordered under another G2A order (`order_exists`)"
    )]
    Conflict(#[to_schema] G2aError),
    #[response(
        status = 410,
        description = "the reservation expired or was released (`reservation_expired`): its codes are back in stock"
    )]
    Gone(#[to_schema] G2aError),
    #[response(status = 413, description = "the body is over 64 KiB")]
    TooLarge,
    #[response(status = 500, description = "a fault (`internal`)")]
    Internal(#[to_schema] G2aError),
    #[response(
        status = 503,
        description = "MongoDB or the batch is away (`unavailable`); the same call may be made again"
    )]
    Unavailable(#[to_schema] G2aError),
}

/// An access token.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
pub(crate) struct G2aToken {
    access_token: String,
    /// `bearer`.
    token_type: String,
    /// Seconds it lives.
    expires_in: u64,
}

/// One item of a reservation's body.
#[derive(Serialize, ToSchema)]
#[allow(dead_code)]
pub(crate) struct G2aItemIn {
    /// G2A's product id (a number, or its digits).
    #[schema(schema_with = super::id_schema)]
    product_id: String,
    #[schema(minimum = 1, maximum = 100)]
    quantity: u32,
}

/// What the channel may sell of a product now.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
pub(crate) struct G2aStock {
    #[schema(schema_with = super::id_schema)]
    product_id: String,
    /// Its pool's free codes, capped by the channel (declared stock).
    inventory_size: u64,
}

/// A reservation: its id and the stock of its products.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
pub(crate) struct G2aReservation {
    reservation_id: String,
    stock: Vec<G2aStock>,
}

/// `POST /order`'s body.
#[derive(Serialize, ToSchema)]
#[allow(dead_code)]
pub(crate) struct G2aOrderIn {
    reservation_id: String,
    /// G2A's order id (a number, or its digits).
    #[schema(schema_with = super::id_schema)]
    g2a_order_id: String,
}

/// One key of an order, with its stable id.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
pub(crate) struct G2aItem {
    id: String,
    value: String,
    /// `text`.
    kind: String,
}

/// A product of an order: its keys (returned ones left out) and stock.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
pub(crate) struct G2aOrderStock {
    #[schema(schema_with = super::id_schema)]
    product_id: String,
    inventory_size: u64,
    inventory: Vec<G2aItem>,
}

/// An order: the reservation's id and its keys by product.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
pub(crate) struct G2aOrder {
    order_id: String,
    stock: Vec<G2aOrderStock>,
}

/// `{code, message}` with `status`.
fn error(status: StatusCode, code: &str, message: impl Into<String>) -> Response {
    (
        status,
        Json(json!({"code": code, "message": message.into()})),
    )
        .into_response()
}

/// A refusal of the core with G2A's status.
fn failed(e: CallError) -> Response {
    let (status, code) = match &e {
        CallError::UnknownChannel => (StatusCode::NOT_FOUND, "not_found"),
        CallError::Unauthorized => (StatusCode::UNAUTHORIZED, "unauthorized"),
        CallError::Malformed(_) => (StatusCode::BAD_REQUEST, "bad_request"),
        CallError::UnknownProduct(_) => (StatusCode::NOT_FOUND, "not_found"),
        CallError::UnknownDeal(_) => (StatusCode::NOT_FOUND, "not_found"),
        CallError::Paused | CallError::Unavailable(_) | CallError::NotReplaced(_) => {
            (StatusCode::BAD_REQUEST, "out_of_stock")
        }
        CallError::Cancelled | CallError::Expired => (StatusCode::GONE, "reservation_expired"),
        CallError::OrderExists => (StatusCode::CONFLICT, "order_exists"),
        CallError::Retry(_) => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
        CallError::Failed(_) => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
    };
    if status == StatusCode::INTERNAL_SERVER_ERROR {
        tracing::warn!(error = %e, "a G2A call failed");
    }
    error(status, code, e.to_string())
}

/// The channel whose bearer access token the request carries.
async fn channel(api: &Api, name: &str, headers: &HeaderMap) -> Result<ChannelDoc, Response> {
    api.g2a_verify(name, super::bearer(headers).as_deref())
        .await
        .map_err(failed)
}

/// `GET /oauth/token?grant_type=client_credentials&client_id=…&client_secret=…`.
#[utoipa::path(
    get, path = "/channels/{name}/g2a/oauth/token", tag = "channels",
    operation_id = "g2a_token",
    params(
        ("name" = String, Path, description = "the channel"),
        ("grant_type" = String, Query, description = "`client_credentials`"),
        ("client_id" = String, Query, description = "the client id given to G2A"),
        ("client_secret" = String, Query, description = "the client secret given to G2A"),
    ),
    responses((status = 200, description = "an access token for the other routes", body = G2aToken), G2aRefusals),
)]
pub(super) async fn token(
    State(api): State<Arc<Api>>,
    Path(name): Path<String>,
    RawQuery(query): RawQuery,
) -> Response {
    let mut grant = None;
    let mut id = None;
    let mut secret = None;
    for (k, v) in url::form_urlencoded::parse(query.unwrap_or_default().as_bytes()) {
        match k.as_ref() {
            "grant_type" => grant = Some(v.into_owned()),
            "client_id" => id = Some(v.into_owned()),
            "client_secret" => secret = Some(v.into_owned()),
            _ => {}
        }
    }
    if grant.as_deref() != Some("client_credentials") {
        return error(
            StatusCode::BAD_REQUEST,
            "unsupported_grant_type",
            "grant_type must be client_credentials",
        );
    }
    let (Some(id), Some(secret)) = (id, secret) else {
        return error(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "send client_id and client_secret",
        );
    };
    match api.g2a_token(&name, &id, &secret).await {
        Ok((token, ttl)) => Json(json!({
            "access_token": token,
            "token_type": "bearer",
            "expires_in": ttl,
        }))
        .into_response(),
        Err(e) => failed(e),
    }
}

/// `GET /healthcheck`: 204 while the API serves.
#[utoipa::path(
    get, path = "/channels/{name}/g2a/healthcheck", tag = "channels",
    operation_id = "g2a_healthcheck",
    params(("name" = String, Path, description = "the channel")),
    responses((status = 204, description = "the API serves")),
)]
pub(super) async fn healthcheck() -> StatusCode {
    StatusCode::NO_CONTENT
}

/// A product id as G2A sends it: a number (or its digits as a string).
fn product_of(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::Number(n) => n.as_u64().map(|n| n.to_string()),
        Value::String(s) if channels::valid_external_id(s) => Some(s.clone()),
        _ => None,
    }
}

/// A product id as G2A reads it back: a number when it is one.
fn product_value(p: &str) -> Value {
    p.parse::<u64>()
        .map(Value::from)
        .unwrap_or_else(|_| json!(p))
}

/// The lines of a reservation body: `[{product_id, quantity, …}]`.
fn lines_of(c: &ChannelDoc, body: &[u8]) -> Result<Vec<DealLine>, CallError> {
    let list: Vec<Value> = serde_json::from_slice(body).map_err(|e| {
        CallError::Malformed(format!(
            "the body must be an array of {{product_id, quantity}}: {e}"
        ))
    })?;
    if list.is_empty() || list.len() > codepool_domain::MAX_ITEMS {
        return Err(CallError::Malformed(format!(
            "reserve 1 to {} products at once",
            codepool_domain::MAX_ITEMS
        )));
    }
    let mut lines: Vec<DealLine> = Vec::with_capacity(list.len());
    for item in &list {
        let product = product_of(item.get("product_id"))
            .ok_or_else(|| CallError::Malformed("each item needs a product_id".into()))?;
        let quantity = item
            .get("quantity")
            .and_then(Value::as_u64)
            .filter(|q| (1..=codepool_domain::MAX_QUANTITY as u64).contains(q))
            .ok_or_else(|| {
                CallError::Malformed(format!(
                    "each item needs a quantity of 1 to {}",
                    codepool_domain::MAX_QUANTITY
                ))
            })?;
        if lines.iter().any(|l| l.product == product) {
            return Err(CallError::Malformed(format!(
                "product {product} is named twice"
            )));
        }
        lines.push(channels::line_of(c, &product, quantity as u32)?);
    }
    Ok(lines)
}

/// `stock: [{product_id, inventory_size}]` of a reservation's lines: what
/// the channel may sell of each now (its pool's free codes, capped by the
/// channel: the declared stock).
async fn stock_of(api: &Api, c: &ChannelDoc, lines: &[DealLine]) -> Result<Vec<Value>, Response> {
    let mut out = Vec::with_capacity(lines.len());
    for l in lines {
        let free = api
            .channel_declare(c, &l.product, &l.pool)
            .await
            .map_err(|e| failed(CallError::from(e)))?;
        out.push(json!({"product_id": product_value(&l.product), "inventory_size": free}));
    }
    Ok(out)
}

async fn reservation_answer(api: &Api, c: &ChannelDoc, d: &DealDoc) -> Response {
    match stock_of(api, c, &d.lines).await {
        Ok(stock) => Json(json!({"reservation_id": d.external_id, "stock": stock})).into_response(),
        Err(r) => r,
    }
}

#[utoipa::path(
    post, path = "/channels/{name}/g2a/reservation", tag = "channels",
    operation_id = "g2a_reserve",
    params(("name" = String, Path, description = "the channel")),
    request_body(content = Vec<G2aItemIn>, content_type = "application/json"),
    responses((status = 200, description = "every item held, all or nothing, until the channel's hold time", body = G2aReservation), G2aRefusals),
    security(("g2a_token" = []))
)]
/// `POST /reservation`: hold every item, all or nothing.
pub(super) async fn reserve(
    State(api): State<Arc<Api>>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let c = match channel(&api, &name, &headers).await {
        Ok(c) => c,
        Err(r) => return r,
    };
    let lines = match lines_of(&c, &body) {
        Ok(l) => l,
        Err(e) => return failed(e),
    };
    let rid = g2a::new_reservation_id();
    match api.channel_reserve(&api.holds, &c, &rid, lines).await {
        Ok(d) => reservation_answer(&api, &c, &d).await,
        Err(e) => failed(e),
    }
}

/// `PUT /reservation/{id}`: renew a reservation (a new hold when the old
/// one ran out).
#[utoipa::path(
    put, path = "/channels/{name}/g2a/reservation/{rid}", tag = "channels",
    operation_id = "g2a_renew",
    params(("name" = String, Path, description = "the channel"), ("rid" = String, Path, description = "the reservation")),
    responses((status = 200, description = "held again (a new hold when the old one ran out)", body = G2aReservation), G2aRefusals),
    security(("g2a_token" = []))
)]
pub(super) async fn renew(
    State(api): State<Arc<Api>>,
    Path((name, rid)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    let c = match channel(&api, &name, &headers).await {
        Ok(c) => c,
        Err(r) => return r,
    };
    if !channels::valid_external_id(&rid) {
        return failed(CallError::UnknownDeal(rid));
    }
    match api.g2a_renew(&api.holds, &c, &rid).await {
        Ok(d) => reservation_answer(&api, &c, &d).await,
        Err(e) => failed(e),
    }
}

/// `DELETE /reservation/{id}`: release; 204.
#[utoipa::path(
    delete, path = "/channels/{name}/g2a/reservation/{rid}", tag = "channels",
    operation_id = "g2a_release",
    params(("name" = String, Path, description = "the channel"), ("rid" = String, Path, description = "the reservation")),
    responses((status = 204, description = "released: its codes are back in stock"), G2aRefusals),
    security(("g2a_token" = []))
)]
pub(super) async fn release(
    State(api): State<Arc<Api>>,
    Path((name, rid)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    let c = match channel(&api, &name, &headers).await {
        Ok(c) => c,
        Err(r) => return r,
    };
    if !channels::valid_external_id(&rid) {
        return failed(CallError::UnknownDeal(rid));
    }
    match api.g2a_release(&c, &rid).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => failed(e),
    }
}

/// `stock: [{product_id, inventory_size, inventory: [{id, value, kind}]}]`
/// of an order: its keys by product (voided ones left out), each with its
/// stable id.
async fn order_stock(
    api: &Api,
    c: &ChannelDoc,
    d: &DealDoc,
    keys: &[Key],
) -> Result<Vec<Value>, Response> {
    let sizes = stock_of(api, c, &d.lines).await?;
    Ok(d.lines
        .iter()
        .zip(sizes)
        .map(|(l, size)| {
            let inventory: Vec<Value> = keys
                .iter()
                .filter(|k| k.product == l.product && !k.revoked)
                .map(|k| json!({"id": k.id, "value": k.value, "kind": "text"}))
                .collect();
            json!({
                "product_id": product_value(&l.product),
                "inventory_size": size["inventory_size"],
                "inventory": inventory,
            })
        })
        .collect())
}

/// `POST /order {reservation_id, g2a_order_id}`.
#[utoipa::path(
    post, path = "/channels/{name}/g2a/order", tag = "channels",
    operation_id = "g2a_order",
    params(("name" = String, Path, description = "the channel")),
    request_body(content = G2aOrderIn, content_type = "application/json"),
    responses((status = 200, description = "the order's keys (the same keys and ids for the same G2A order again)", body = G2aOrder), G2aRefusals),
    security(("g2a_token" = []))
)]
pub(super) async fn order(
    State(api): State<Arc<Api>>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let c = match channel(&api, &name, &headers).await {
        Ok(c) => c,
        Err(r) => return r,
    };
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let rid = v.get("reservation_id").and_then(Value::as_str);
    let g2a_order = product_of(v.get("g2a_order_id"));
    let (Some(rid), Some(g2a_order)) = (rid.filter(|r| channels::valid_external_id(r)), g2a_order)
    else {
        return failed(CallError::Malformed(
            "send {\"reservation_id\": \"…\", \"g2a_order_id\": 123}".into(),
        ));
    };
    let via = format!("G2A POST /order {g2a_order}");
    let keys = match api
        .channel_provide(&*api, &c, rid, Some(&g2a_order), &via)
        .await
    {
        Ok(keys) => keys,
        Err(e) => return failed(e),
    };
    let d = match api.channel_deal(&c, rid).await {
        Ok(Some(d)) => d,
        Ok(None) => return failed(CallError::UnknownDeal(rid.to_owned())),
        Err(e) => return failed(e.into()),
    };
    match order_stock(&api, &c, &d, &keys).await {
        Ok(stock) => Json(json!({"order_id": d.external_id, "stock": stock})).into_response(),
        Err(r) => r,
    }
}

/// The provided deal `rid` of channel `c`.
async fn ordered(api: &Api, c: &ChannelDoc, rid: &str) -> Result<DealDoc, Response> {
    match api.channel_deal(c, rid).await {
        Ok(Some(d)) if d.state != codepool_issuance::model::DealState::Reserved => Ok(d),
        Ok(_) => Err(failed(CallError::UnknownDeal(rid.to_owned()))),
        Err(e) => Err(failed(e.into())),
    }
}

/// `GET /order/{id}/inventory`: the order's keys, the same ids every time.
#[utoipa::path(
    get, path = "/channels/{name}/g2a/order/{rid}/inventory", tag = "channels",
    operation_id = "g2a_inventory",
    params(("name" = String, Path, description = "the channel"), ("rid" = String, Path, description = "the order's reservation")),
    responses((status = 200, description = "the order's keys by product, the same ids every time", body = Vec<G2aOrderStock>), G2aRefusals),
    security(("g2a_token" = []))
)]
pub(super) async fn inventory(
    State(api): State<Arc<Api>>,
    Path((name, rid)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    let c = match channel(&api, &name, &headers).await {
        Ok(c) => c,
        Err(r) => return r,
    };
    let d = match ordered(&api, &c, &rid).await {
        Ok(d) => d,
        Err(r) => return r,
    };
    let via = format!("G2A GET /order/{rid}/inventory");
    let keys = match api.channel_keys(&*api, &c, &d, &via).await {
        Ok(k) => k,
        Err(e) => return failed(e),
    };
    match order_stock(&api, &c, &d, &keys).await {
        Ok(stock) => Json(Value::Array(stock)).into_response(),
        Err(r) => r,
    }
}

/// `DELETE /order/{id}/inventory?id[]=…&id[]=…`: returns. Every id must be
/// one of the order's items, or nothing changes (404).
#[utoipa::path(
    delete, path = "/channels/{name}/g2a/order/{rid}/inventory", tag = "channels",
    operation_id = "g2a_returns",
    params(
        ("name" = String, Path, description = "the channel"),
        ("rid" = String, Path, description = "the order's reservation"),
        ("id[]" = Vec<String>, Query, description = "the items returned: each one of the order's, or nothing changes"),
    ),
    responses((status = 204, description = "returned: the keys are voided (they were shown, so they never return to stock)"), G2aRefusals),
    security(("g2a_token" = []))
)]
pub(super) async fn returns(
    State(api): State<Arc<Api>>,
    Path((name, rid)): Path<(String, String)>,
    headers: HeaderMap,
    RawQuery(query): RawQuery,
) -> Response {
    let ids: Vec<String> = url::form_urlencoded::parse(query.unwrap_or_default().as_bytes())
        .filter(|(k, _)| k == "id[]" || k == "id")
        .map(|(_, v)| v.into_owned())
        .take(1000)
        .collect();
    take_back(&api, &name, &rid, &headers, ids).await
}

/// `DELETE /order/{id}/inventory/{item}`: one return.
#[utoipa::path(
    delete, path = "/channels/{name}/g2a/order/{rid}/inventory/{id}", tag = "channels",
    operation_id = "g2a_return_one",
    params(
        ("name" = String, Path, description = "the channel"),
        ("rid" = String, Path, description = "the order's reservation"),
        ("id" = String, Path, description = "the item returned"),
    ),
    responses((status = 204, description = "returned: the key is voided"), G2aRefusals),
    security(("g2a_token" = []))
)]
pub(super) async fn returns_one(
    State(api): State<Arc<Api>>,
    Path((name, rid, id)): Path<(String, String, String)>,
    headers: HeaderMap,
) -> Response {
    take_back(&api, &name, &rid, &headers, vec![id]).await
}

async fn take_back(
    api: &Api,
    name: &str,
    rid: &str,
    headers: &HeaderMap,
    ids: Vec<String>,
) -> Response {
    let c = match channel(api, name, headers).await {
        Ok(c) => c,
        Err(r) => return r,
    };
    if ids.is_empty() {
        return failed(CallError::Malformed("name the items: ?id[]=…".into()));
    }
    match api.g2a_return(api, &c, rid, &ids).await {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => failed(e),
    }
}
