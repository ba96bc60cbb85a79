//! `/v1/orders`: place an order, read it, redeem, void and resend it. Placing
//! goes through the dispatcher's [`codepool_issuance::Intake`]; the rest
//! through the same operations as the CLI ([`codepool_issuance::ops`]).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use chrono::SecondsFormat;
use codepool_domain::{mask, Code, Grant, Purchase, PurchaseError, RejectReason};
use codepool_issuance::audit::Actor;
use codepool_issuance::model::CodeQuery;
use codepool_issuance::model::{CodeRef, LifecycleError, Redeemed, VoidOutcome};
use codepool_issuance::ops;
use codepool_issuance::plan::Step;
use serde::{Deserialize, Serialize};
use serde_json::json;
use utoipa::ToSchema;

use crate::items::Item;
use crate::problem::Problem;
use crate::request::RequestId;
use crate::request::{Caller, OrdersRead, OrdersWrite};
use crate::state::Api;
use codepool_issuance::api_keys::{KeyDoc, Scope};

/// The key must hold `scope`: the 403 to answer when it does not.
pub(crate) fn need(key: &KeyDoc, scope: Scope, rid: &RequestId) -> Option<Response> {
    (!key.allows(scope)).then(|| {
        Problem::forbidden(scope.as_str())
            .at(&rid.0)
            .into_response()
    })
}

/// A purchase the core refused to take: 409 for an order id of another
/// order, 422 for anything the request says wrong. A shop's key is told
/// the same of a pool that does not exist and of a pool that is not its
/// shop's ([`PurchaseError::as_told_to_shop`]): 403, with no operator's
/// command.
fn rejected(e: &PurchaseError, key: &KeyDoc, rid: &RequestId) -> Response {
    let told;
    let e = if key.shop.is_some() {
        told = e.clone().as_told_to_shop();
        &told
    } else {
        e
    };
    let status = match e.reason {
        RejectReason::ConflictingOrder => StatusCode::CONFLICT,
        RejectReason::PoolNotAllowed => StatusCode::FORBIDDEN,
        RejectReason::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
        _ => StatusCode::UNPROCESSABLE_ENTITY,
    };
    let slug = e.reason.as_str().replace('_', "-");
    let mut p = Problem::new(status, &slug, "the order was not taken", e.detail.clone()).at(&rid.0);
    if let Some(f) = e.field() {
        p = p.field(f.to_owned());
    }
    p.into_response()
}

pub(crate) fn failed(e: &dyn std::fmt::Display, unavailable: bool, rid: &RequestId) -> Response {
    if unavailable {
        return Problem::unavailable(e).at(&rid.0).into_response();
    }
    Problem::internal(e, "nothing was granted twice")
        .at(&rid.0)
        .into_response()
}

fn time(t: chrono::DateTime<chrono::Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// A code granted by `POST /v1/orders`, in plaintext (the shop shows it).
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct GrantedCode {
    line: u32,
    /// The pool of the code (a bundle's lines each keep their own).
    pool: String,
    code: String,
    grant_no: Option<String>,
    issued_at: String,
    #[schema(pattern = "^(issued|void)$")]
    status: &'static str,
}

impl GrantedCode {
    /// One code of an order as the API shows it: in plaintext when
    /// `reveal` and not void, masked otherwise.
    pub(crate) fn of(g: &Grant, reveal: bool) -> Self {
        GrantedCode {
            line: g.line,
            pool: g.pool.clone(),
            code: if reveal && !g.revoked {
                g.code.clone()
            } else {
                mask(&g.code)
            },
            grant_no: g.grant_no.clone(),
            issued_at: time(g.issued_at),
            status: if g.revoked { "void" } else { "issued" },
        }
    }
}

/// The answer to `POST /v1/orders`.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct Placed {
    order_id: String,
    pool: String,
    uid: String,
    quantity: u32,
    /// `granted`, `partly_granted` or `waiting`.
    #[schema(pattern = "^(granted|partly_granted|waiting)$")]
    state: &'static str,
    codes: Vec<GrantedCode>,
    /// Lines that wait for stock; their codes follow as SMS events.
    waiting_lines: Vec<u32>,
    /// A bundle's items (its `pool` is the first item's).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    items: Option<Vec<Item>>,
}

impl Placed {
    /// The answer for `p`: its codes, and the lines that wait. A bundle's
    /// answer names its items.
    fn of(p: Purchase, state: &'static str, codes: Vec<GrantedCode>, waiting: Vec<u32>) -> Self {
        let items = p
            .is_bundle()
            .then(|| p.items.iter().map(Item::from).collect());
        Placed {
            order_id: p.order_id,
            pool: p.pool,
            uid: p.uid,
            quantity: p.quantity,
            state,
            codes,
            waiting_lines: waiting,
            items,
        }
    }
}

/// `POST /v1/orders`: the purchase fields as JSON, `quantity` optional.
#[utoipa::path(
    post, path = "/v1/orders", tag = "orders",
    operation_id = "place_order",
    request_body(content = crate::openapi::PurchaseIn, content_type = "application/json"),
    responses(
        (status = 201, description = "the codes were issued now, in plaintext", body = Placed),
        (status = 200, description = "the same order again: the same codes, no second SMS", body = Placed),
        (status = 202, description = "the pool is empty, short or paused: waiting or partly granted; the rest follows as SMS events", body = Placed),
        (status = 409, description = "the order id belongs to another order (pool, buyer or quantity) or to another key (or came over AMQP), or the order was voided (`order-cancelled`); nothing granted, no code shown", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
        (status = 403, description = "the key lacks `orders:write`, or a shop's key names a pool that is not its shop's or does not exist (`pool-not-allowed`, one answer for both); nothing granted", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
        (status = 422, description = "an invalid field or unknown pool (named in `field`), or the buyer over the pool's per-user limit", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
    ),
    security(("api_key" = ["orders:write"]))
)]
pub(crate) async fn place(
    State(api): State<Arc<Api>>,
    Caller { key, rid, .. }: Caller<OrdersWrite>,
    body: Bytes,
) -> Response {
    let mut purchase = match Purchase::parse(&body) {
        Ok(p) => p,
        Err(e) => return rejected(&e, &key, &rid),
    };
    if let Err(e) = codepool_issuance::api_keys::stamp(&key, &mut purchase) {
        return rejected(&e, &key, &rid);
    }
    // Every line logged for this order names it, its pool, its shop, the
    // hold it pays for and the door.
    let span = tracing::info_span!(
        "order",
        order_id = %purchase.order_id,
        pool = %purchase.pool,
        shop = purchase.shop.as_deref(),
        hold_id = purchase.hold_id.as_deref(),
        door = codepool_issuance::Door::Http.as_str()
    );
    tracing::Instrument::instrument(answer(&api, &key, &rid, purchase), span).await
}

/// Decides a placed order and translates its step into the answer.
async fn answer(api: &Api, key: &KeyDoc, rid: &RequestId, purchase: Purchase) -> Response {
    let rid = rid.clone();
    let who = format!("api-key:{}", key.name);
    let step = match api
        .orders
        .decide(purchase.clone(), who, rid.0.clone())
        .await
    {
        Ok(step) => step,
        Err(e) => return failed(&e, e.is_unavailable(), &rid),
    };
    tracing::info!(order_id = %purchase.order_id, pool = %purchase.pool, quantity = purchase.quantity, key = %key.name, "order placed");
    match step {
        Step::DeadLetter(e) => rejected(&e, key, &rid),
        Step::Cancelled(p) => cancelled(&p, &rid),
        Step::Refused(r) => refused_by_policy(&r, &rid),
        Step::Backorder { purchase, lines } => (
            StatusCode::ACCEPTED,
            Json(Placed::of(purchase, "waiting", Vec::new(), lines)),
        )
            .into_response(),
        Step::Grant {
            purchase,
            grants,
            fresh,
            missing,
        } => {
            let status = if !missing.is_empty() {
                StatusCode::ACCEPTED
            } else if fresh > 0 {
                StatusCode::CREATED
            } else {
                StatusCode::OK
            };
            let state = if missing.is_empty() {
                "granted"
            } else {
                "partly_granted"
            };
            // A repeat that shows codes issued before this request was
            // recorded by the batcher before it answered (batcher.rs).
            let codes = grants.iter().map(|g| GrantedCode::of(g, true)).collect();
            (status, Json(Placed::of(*purchase, state, codes, missing))).into_response()
        }
    }
}

/// 409 for an order voided while it waited: a void is final.
fn cancelled(p: &Purchase, rid: &RequestId) -> Response {
    Problem::new(
        StatusCode::CONFLICT,
        "order-cancelled",
        "the order was voided",
        format!("order {:?} was voided while it waited for codes, and a void is final: it gets nothing again. Place the purchase under a new order id", p.order_id),
    )
    .field("order_id")
    .at(&rid.0)
    .into_response()
}

/// 422 for an order a pool policy refused, with the limit.
fn refused_by_policy(r: &codepool_domain::Refusal, rid: &RequestId) -> Response {
    Problem::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        r.reason.as_str().replace('_', "-").as_str(),
        "the order was refused by the pool's policy",
        format!("the buyer {:?} would go over the pool's limit of {} codes; the order gets no code. A new order within the limit is taken", r.purchase.uid, r.limit.unwrap_or_default()),
    )
    .with("limit", json!(r.limit))
    .at(&rid.0)
    .into_response()
}

#[derive(Debug, Deserialize)]
pub(crate) struct ReadQuery {
    #[serde(default)]
    reveal: bool,
}

/// `GET /v1/orders/{order_id}`: state, codes (masked unless `?reveal=true`
/// with `codes:reveal`, audited), grant numbers, SMS state.
#[utoipa::path(
    get, path = "/v1/orders/{order_id}", tag = "orders",
    operation_id = "read_order",
    params(("order_id" = String, Path, description = "the shop's order id"),
           ("reveal" = Option<bool>, Query, description = "show codes in plaintext (needs codes:reveal; audited)")),
    responses(
        (status = 200, description = "the order: state, codes (masked unless revealed), grant numbers, SMS state", body = Order),
        (status = 404, description = "codepool knows nothing of the order", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
    ),
    security(("api_key" = ["orders:read"]))
)]
pub(crate) async fn read(
    State(api): State<Arc<Api>>,
    Caller { key, rid, .. }: Caller<OrdersRead>,
    Path(order_id): Path<String>,
    Query(q): Query<ReadQuery>,
) -> Response {
    // Compared as stored: NFC.
    let order_id = codepool_domain::text::nfc(&order_id);
    if q.reveal {
        if let Some(r) = need(&key, Scope::CodesReveal, &rid) {
            return r;
        }
    }
    let found = match api.lookup(CodeQuery::Order(&order_id), 100).await {
        Ok(f) => f,
        Err(e) => return failed(&e, e.is_retryable(), &rid),
    };
    // A shop's key reads only its shop's orders.
    if found.is_empty() || (key.shop.is_some() && !found.is_owned_by(&key.owner())) {
        return Problem::new(
            StatusCode::NOT_FOUND,
            "unknown-order",
            "no such order",
            format!("codepool has no order {order_id:?}: no code, no backorder, no refusal. Check the id, or place it with POST /v1/orders"),
        )
        .at(&rid.0)
        .into_response();
    }
    if q.reveal && !found.codes.is_empty() {
        let route = format!(
            "GET /v1/orders/{{order_id}}?reveal=true (request {})",
            rid.0
        );
        let actor = Actor::api_key(&key.name, &route);
        let ids = found.codes.iter().map(|c| c.id).collect();
        let what = format!("order {order_id:?}");
        let count = found.codes.len() as u64;
        // No record, no reveal.
        if let Err(e) = api.record_reveal(&actor, what, ids, count).await {
            return failed(&e, e.is_retryable(), &rid);
        }
    }
    Json(Order::of(&order_id, &found, q.reveal)).into_response()
}

/// The 404 to answer when `key` may not change `order_id`: a key acts on
/// the orders it placed (a shop's key on its shop's), a key with the
/// `admin` scope on any. Another's order (or one that came over AMQP
/// without the shop) is not shown to exist.
async fn not_owner(api: &Api, key: &KeyDoc, order_id: &str, rid: &RequestId) -> Option<Response> {
    if key.allows(Scope::Admin) {
        return None;
    }
    let found = match api.lookup(CodeQuery::Order(order_id), 1).await {
        Ok(f) => f,
        Err(e) => return Some(failed(&e, e.is_retryable(), rid)),
    };
    (!found.is_owned_by(&key.owner())).then(|| not_yours(order_id, rid))
}

pub(crate) fn not_yours(order_id: &str, rid: &RequestId) -> Response {
    Problem::new(
        StatusCode::NOT_FOUND,
        "unknown-order",
        "no such order",
        format!("this key placed no order {order_id:?}. A key acts only on the orders it (or its shop) placed; a key with the admin scope on any"),
    )
    .at(&rid.0)
    .into_response()
}

/// One code of an order as `GET /v1/orders/{order_id}` shows it.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct OrderCode {
    line: Option<u32>,
    /// Masked unless revealed.
    code: String,
    status: &'static str,
    grant_no: Option<String>,
    issued_at: Option<String>,
    /// `pending`, `queued`, `sent` or `failed`.
    sms: &'static str,
}

impl OrderCode {
    fn of(c: &Code, reveal: bool) -> Self {
        let h = c.holder.as_ref();
        OrderCode {
            line: h.map(|h| h.line),
            code: if reveal { c.code.clone() } else { c.masked() },
            status: c.status.name(),
            grant_no: h.and_then(|h| h.grant_no.clone()),
            issued_at: h.map(|h| time(h.issued_at)),
            sms: c.sms_state().name(),
        }
    }
}

/// Why a pool policy refused the order.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct Refusal {
    reason: &'static str,
    limit: Option<i64>,
}

/// One replacement of a code of an order.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct OrderReplacement {
    replacement_id: String,
    line: u32,
    /// `voiding` (under way), `waiting` (the line waits for stock), `done`
    /// or `cancelled` (the order was voided first).
    #[schema(pattern = "^(voiding|waiting|done|cancelled)$")]
    state: &'static str,
    reason: String,
    old_grant_no: Option<String>,
    new_grant_no: Option<String>,
    created_at: String,
}

impl From<&codepool_issuance::model::ReplacementDoc> for OrderReplacement {
    fn from(r: &codepool_issuance::model::ReplacementDoc) -> Self {
        OrderReplacement {
            replacement_id: r.id.clone(),
            line: r.line(),
            state: r.state.as_str(),
            reason: r.reason.clone(),
            old_grant_no: r.old_grant_no.clone(),
            new_grant_no: r.new_grant_no.clone(),
            created_at: time(r.created_at.to_chrono()),
        }
    }
}

/// An order as codepool knows it.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct Order {
    order_id: String,
    pool: Option<String>,
    uid: Option<String>,
    quantity: Option<u32>,
    /// `granted`, `partly_granted`, `waiting`, `refused`, `void`, `cancelled`.
    state: &'static str,
    /// Each line's code now (a replaced line's new one).
    codes: Vec<OrderCode>,
    /// Lines waiting for a code: stock ran short, or a replacement waits.
    waiting_lines: Vec<u32>,
    refusal: Option<Refusal>,
    /// The codes replaced on this order, oldest first.
    replacements: Vec<OrderReplacement>,
}

impl Order {
    /// An order as the API shows it.
    fn of(order_id: &str, found: &ops::Lookup, reveal: bool) -> Self {
        let first = found.codes.first().and_then(|c| c.holder.as_ref());
        let backorder = found.backorders.first();
        Order {
            order_id: order_id.to_owned(),
            pool: (found.codes.first().map(|c| c.pool.clone()))
                .or_else(|| backorder.map(|b| b.pool.clone())),
            uid: first.map(|h| h.uid.clone()),
            quantity: first
                .map(|h| h.quantity)
                .or_else(|| backorder.map(|b| b.quantity())),
            state: found.state().map_or("unknown", |s| s.name()),
            codes: found
                .codes
                .iter()
                .map(|c| OrderCode::of(c, reveal))
                .collect(),
            waiting_lines: found.waiting_lines(),
            refusal: found.refusals.first().map(|r| Refusal {
                reason: r.reason.as_str(),
                limit: r.limit,
            }),
            replacements: found
                .replacements
                .iter()
                .map(OrderReplacement::from)
                .collect(),
        }
    }
}

/// A lifecycle refusal: 404 for an order without codes, 409 otherwise.
fn refused(e: LifecycleError, rid: &RequestId) -> Response {
    let (status, slug) = match &e {
        LifecycleError::NotFound { .. } => (StatusCode::NOT_FOUND, "unknown-order"),
        LifecycleError::Store(s) => return failed(s, s.is_retryable(), rid),
        _ => (StatusCode::CONFLICT, "invalid-transition"),
    };
    Problem::new(
        status,
        slug,
        "the order's codes cannot take this change",
        e.to_string(),
    )
    .at(&rid.0)
    .into_response()
}

#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = Redeemed)]
pub(crate) struct RedeemedOut {
    order_id: String,
    redeemed: u64,
}

#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct Voided {
    order_id: String,
    voided: u64,
    backorder_cancelled: bool,
}

#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct Resent {
    order_id: String,
    /// The `event_id`s sent again (the same ids as the first time).
    events: Vec<String>,
}

/// `POST /v1/orders/{order_id}/redeem`: every issued code of the order.
#[utoipa::path(
    post, path = "/v1/orders/{order_id}/redeem", tag = "orders",
    operation_id = "redeem_order",
    params(("order_id" = String, Path, description = "the shop's order id")),
    responses(
        (status = 200, description = "every issued code of the order is now used", body = RedeemedOut),
        (status = 404, description = "the order has no code", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
        (status = 409, description = "a code of the order cannot be redeemed (void, already used)", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
    ),
    security(("api_key" = ["orders:write"]))
)]
pub(crate) async fn redeem(
    State(api): State<Arc<Api>>,
    Caller { key, rid, .. }: Caller<OrdersWrite>,
    Path(order_id): Path<String>,
) -> Response {
    // Compared as stored: NFC.
    let order_id = codepool_domain::text::nfc(&order_id);
    if let Some(r) = not_owner(&api, &key, &order_id, &rid).await {
        return r;
    }
    let actor = Actor::api_key(&key.name, "POST /v1/orders/{order_id}/redeem");
    match api.redeem(CodeRef::Order(&order_id), None, &actor).await {
        Ok(Redeemed::Now(done)) => Json(RedeemedOut {
            order_id,
            redeemed: done.len() as u64,
        })
        .into_response(),
        // Only a redemption by code, with its redemption id, is "before".
        Ok(Redeemed::Before(_)) => Json(RedeemedOut {
            order_id,
            redeemed: 0,
        })
        .into_response(),
        Err(e) => refused(e, &rid),
    }
}

/// The body of a void.
#[derive(Debug, Deserialize, ToSchema)]
#[schema(as = VoidIn)]
pub(crate) struct VoidBody {
    /// Why (a refund, a chargeback): 1 to 200 characters.
    reason: String,
}

/// `POST /v1/orders/{order_id}/void` with `{"reason": …}`: every code of
/// the order, and what it still waits for.
#[utoipa::path(
    post, path = "/v1/orders/{order_id}/void", tag = "orders",
    operation_id = "void_order",
    params(("order_id" = String, Path, description = "the shop's order id")),
    request_body(content = VoidBody, content_type = "application/json"),
    responses(
        (status = 200, description = "the order's codes are void and what it waited for is cancelled", body = Voided),
        (status = 404, description = "the order has no code and no backorder", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
        (status = 409, description = "a code of the order cannot be voided", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
        (status = 422, description = "no reason, one too long, or one of codepool's own (`expired`, `replaced`, `recalled`: `reserved-reason`) (`field`: reason)", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
    ),
    security(("api_key" = ["orders:write"]))
)]
pub(crate) async fn void(
    State(api): State<Arc<Api>>,
    Caller { key, rid, .. }: Caller<OrdersWrite>,
    Path(order_id): Path<String>,
    body: Bytes,
) -> Response {
    // Compared as stored: NFC.
    let order_id = codepool_domain::text::nfc(&order_id);
    let bad_reason = || {
        Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid-reason",
            "a void needs a reason",
            format!(
                "send {{\"reason\": \"refund\"}}: 1 to {} characters of plain visible text saying why",
                ops::MAX_REASON_CHARS
            ),
        )
        .field("reason")
        .at(&rid.0)
        .into_response()
    };
    let Ok(VoidBody { reason }) = serde_json::from_slice::<VoidBody>(&body) else {
        return bad_reason();
    };
    if let Some(r) = not_owner(&api, &key, &order_id, &rid).await {
        return r;
    }
    let actor = Actor::api_key(&key.name, "POST /v1/orders/{order_id}/void");
    let voided = api.void(CodeRef::Order(&order_id), &reason, &actor).await;
    let voided = match voided {
        Err(ops::VoidError::Reason) => return bad_reason(),
        Err(e @ ops::VoidError::Reserved(_)) => {
            return Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "reserved-reason",
                "that reason is codepool's own",
                e.to_string(),
            )
            .field("reason")
            .at(&rid.0)
            .into_response()
        }
        Err(ops::VoidError::Lifecycle(e)) => Err(e),
        Ok(v) => Ok(v),
    };
    match voided {
        Ok(VoidOutcome::Voided {
            applied,
            backorder_cancelled,
        }) => Json(Voided {
            order_id,
            voided: applied.len() as u64,
            backorder_cancelled,
        })
        .into_response(),
        Ok(VoidOutcome::BackorderCancelled { order_id }) => Json(Voided {
            order_id,
            voided: 0,
            backorder_cancelled: true,
        })
        .into_response(),
        Err(e) => refused(e, &rid),
    }
}

/// `POST /v1/orders/{order_id}/resend`: the order's SMS-pending events
/// again, confirmed.
#[utoipa::path(
    post, path = "/v1/orders/{order_id}/resend", tag = "orders",
    operation_id = "resend_order",
    params(("order_id" = String, Path, description = "the shop's order id")),
    responses(
        (status = 200, description = "the order's SMS-pending events were sent again and confirmed", body = Resent),
        (status = 404, description = "this key placed no such order (a key changes only its own orders, or any with the admin scope)", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
        (status = 409, description = "nothing to send (no code, or every code void)", body = crate::openapi::ProblemDoc, content_type = "application/problem+json"),
    ),
    security(("api_key" = ["orders:write"]))
)]
pub(crate) async fn resend(
    State(api): State<Arc<Api>>,
    Caller { key, rid, .. }: Caller<OrdersWrite>,
    Path(order_id): Path<String>,
) -> Response {
    // Compared as stored: NFC.
    let order_id = codepool_domain::text::nfc(&order_id);
    if let Some(r) = not_owner(&api, &key, &order_id, &rid).await {
        return r;
    }
    let actor = Actor::api_key(&key.name, "POST /v1/orders/{order_id}/resend");
    match api.resend(&order_id, &actor).await {
        Ok((events, _)) => Json(Resent {
            order_id,
            events: events.iter().map(|e| e.event_id.clone()).collect(),
        })
        .into_response(),
        Err(ops::ResendError::Store(e)) => failed(&e, e.is_retryable(), &rid),
        Err(ops::ResendError::Unconfirmed(e)) => failed(&e, true, &rid),
        Err(e) => Problem::new(
            StatusCode::CONFLICT,
            "not-sendable",
            "nothing to send",
            e.to_string(),
        )
        .at(&rid.0)
        .into_response(),
    }
}
