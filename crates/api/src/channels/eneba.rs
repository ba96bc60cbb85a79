//! Eneba's "Declared Stock" callbacks: one URL for RESERVE, PROVIDE and
//! CANCEL, dispatched on `action`, authenticated by the static bearer the
//! seller registered with Eneba (a RESERVE naming a `keyId` is a key
//! replacement: [`codepool_issuance::channels::eneba`]). RESERVE holds
//! `keyCount` codes of each auction, all or nothing; PROVIDE commits that
//! hold into the order derived from the channel and Eneba's `orderId`
//! (or answers a replacement's new key), and a PROVIDE retried
//! after a timeout answers the same keys byte for byte; CANCEL releases
//! the hold, or, after provision, answers as the channel's policy says.
//!
//! Every answer has Eneba's shape: `{action, orderId, success, …}`, and
//! the HTTP status the contract implies for a failed request (401 wrong
//! token, 400 a body outside the contract, 503 try again).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use codepool_issuance::channels::{self, AfterProvide, Call, CallError, Cancelled, Key, Kind};
use codepool_issuance::model::ChannelDoc;
use serde::Serialize;
use serde_json::{json, Map, Value};
use utoipa::ToSchema;

use crate::state::Api;

/// One Eneba callback as read from its body.
enum Callback {
    Reserve {
        order: String,
        /// `(auctionId, keyCount)`, in the body's order.
        auctions: Vec<(String, u32)>,
    },
    /// A key replacement: `{orderId, auctionId, keyId}`.
    Replace {
        order: String,
        auction: String,
        key: String,
    },
    Provide {
        order: String,
        /// The replaced key whose new one is asked (a replacement's).
        key: Option<String>,
    },
    Cancel {
        order: String,
    },
}

/// What a body that breaks the contract still says: its action and order.
struct Malformed {
    action: Option<String>,
    order: Option<String>,
    why: String,
}

fn read(body: &[u8]) -> Result<Callback, Malformed> {
    let fail = |map: Option<&Map<String, Value>>, why: String| Malformed {
        action: map
            .and_then(|m| m.get("action"))
            .and_then(Value::as_str)
            .map(|a| a.chars().take(40).collect()),
        order: map
            .and_then(|m| m.get("orderId"))
            .and_then(Value::as_str)
            .filter(|o| channels::valid_external_id(o))
            .map(str::to_owned),
        why,
    };
    let map: Map<String, Value> = serde_json::from_slice(body)
        .map_err(|e| fail(None, format!("the body is not a JSON object: {e}")))?;
    let order = match map.get("orderId").and_then(Value::as_str) {
        Some(o) if channels::valid_external_id(o) => o.to_owned(),
        _ => {
            return Err(fail(
                Some(&map),
                "\"orderId\" must be Eneba's order id (a UUID)".into(),
            ))
        }
    };
    match map.get("action").and_then(Value::as_str) {
        Some("RESERVE") => {
            if map.contains_key("keyId") {
                let id = |f: &str| {
                    map.get(f)
                        .and_then(Value::as_str)
                        .filter(|v| channels::valid_external_id(v))
                        .map(str::to_owned)
                };
                return match (id("auctionId"), id("keyId")) {
                    (Some(auction), Some(key)) => Ok(Callback::Replace {
                        order,
                        auction,
                        key,
                    }),
                    _ => Err(fail(
                        Some(&map),
                        "a replacement names its \"auctionId\" and \"keyId\"".into(),
                    )),
                };
            }
            let auctions = reserved_auctions(&map).map_err(|why| fail(Some(&map), why))?;
            Ok(Callback::Reserve { order, auctions })
        }
        Some("PROVIDE") => match map.get("keyId") {
            None | Some(Value::Null) => Ok(Callback::Provide { order, key: None }),
            Some(Value::String(k)) if channels::valid_external_id(k) => Ok(Callback::Provide {
                order,
                key: Some(k.clone()),
            }),
            Some(_) => Err(fail(Some(&map), "\"keyId\" must be Eneba's key id".into())),
        },
        Some("CANCEL") => Ok(Callback::Cancel { order }),
        _ => Err(fail(
            Some(&map),
            "\"action\" must be RESERVE, PROVIDE or CANCEL".into(),
        )),
    }
}

/// The auctions a RESERVE names: 1 to `MAX_ITEMS`, each a distinct
/// auction id with a `keyCount` of 1 to `MAX_QUANTITY`; or what is wrong.
fn reserved_auctions(map: &Map<String, Value>) -> Result<Vec<(String, u32)>, String> {
    let list = match map.get("auctions").and_then(Value::as_array) {
        Some(l) if !l.is_empty() && l.len() <= codepool_domain::MAX_ITEMS => l,
        _ => {
            return Err(format!(
                "\"auctions\" must list 1 to {} auctions",
                codepool_domain::MAX_ITEMS
            ))
        }
    };
    let mut auctions: Vec<(String, u32)> = Vec::with_capacity(list.len());
    for a in list {
        let id = a.get("auctionId").and_then(Value::as_str);
        let count = a.get("keyCount").and_then(Value::as_u64);
        match (id, count) {
            (Some(id), Some(n))
                if channels::valid_external_id(id)
                    && (1..=codepool_domain::MAX_QUANTITY as u64).contains(&n)
                    && !auctions.iter().any(|(x, _)| x == id) =>
            {
                auctions.push((id.to_owned(), n as u32))
            }
            _ => {
                return Err(format!(
                    "each auction needs a distinct \"auctionId\" and a \"keyCount\" of 1 to {}",
                    codepool_domain::MAX_QUANTITY
                ))
            }
        }
    }
    Ok(auctions)
}

/// `{action, orderId, success:false, message}` with `status`.
fn refused(status: StatusCode, action: Value, order: Value, message: String) -> Response {
    let body = json!({"action": action, "orderId": order, "success": false, "message": message});
    (status, Json(body)).into_response()
}

/// A refusal of the core, in Eneba's shape: the failures Eneba counts
/// (a non-2xx answer) for what it must retry or fix, `success:false` for
/// a reservation or provision codepool cannot honour.
fn failed(action: &str, order: &str, e: CallError) -> Response {
    let status = match &e {
        CallError::UnknownChannel => StatusCode::NOT_FOUND,
        CallError::Unauthorized => StatusCode::UNAUTHORIZED,
        CallError::Malformed(_) => StatusCode::BAD_REQUEST,
        CallError::Retry(_) => StatusCode::SERVICE_UNAVAILABLE,
        CallError::Failed(_) => StatusCode::INTERNAL_SERVER_ERROR,
        _ => StatusCode::OK,
    };
    if status == StatusCode::INTERNAL_SERVER_ERROR {
        tracing::warn!(action, order_id = order, error = %e, "an Eneba callback failed");
    }
    refused(status, json!(action), json!(order), e.to_string())
}

/// An Eneba callback's body: RESERVE (`auctions`; a replacement names
/// `auctionId` and `keyId` instead), PROVIDE (a replacement's names
/// `keyId`), CANCEL. Eneba may send more members (a price): they are
/// not read.
#[derive(Serialize, ToSchema)]
#[allow(dead_code)]
pub(crate) struct EnebaCallback {
    #[schema(pattern = "^(RESERVE|PROVIDE|CANCEL)$")]
    action: String,
    /// Eneba's order id: 1 to 60 of A-Z a-z 0-9 `_` `-`.
    #[serde(rename = "orderId")]
    #[schema(max_length = 60)]
    order_id: String,
    /// RESERVE: 1 to 10 distinct auctions.
    #[schema(nullable = false, min_items = 1, max_items = 10)]
    auctions: Option<Vec<EnebaReserved>>,
    /// A replacement's RESERVE: the auction of the key replaced.
    #[serde(rename = "auctionId")]
    #[schema(nullable = false)]
    auction_id: Option<String>,
    /// A replacement's RESERVE or PROVIDE: the key replaced.
    #[serde(rename = "keyId")]
    #[schema(nullable = false)]
    key_id: Option<String>,
}

/// One auction of a RESERVE.
#[derive(Serialize, ToSchema)]
#[allow(dead_code)]
pub(crate) struct EnebaReserved {
    #[serde(rename = "auctionId")]
    auction_id: String,
    #[serde(rename = "keyCount")]
    #[schema(minimum = 1, maximum = 100)]
    key_count: u32,
}

/// Every answer of the callback that has a body: `success` true (a
/// PROVIDE's `auctions` with their keys), or false with a `message`.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
pub(crate) struct EnebaAnswer {
    /// The request's action (null, or "", when it could not be read).
    action: Option<String>,
    /// The request's order id (null, or "", when it could not be read).
    #[serde(rename = "orderId")]
    order_id: Option<String>,
    success: bool,
    /// Why not, when `success` is false.
    #[schema(nullable = false)]
    message: Option<String>,
    /// A PROVIDE's keys by auction, in the order's line order: the same
    /// bytes on every retry.
    #[schema(nullable = false)]
    auctions: Option<Vec<EnebaAuctionKeys>>,
}

/// The keys of one auction of a PROVIDE.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
pub(crate) struct EnebaAuctionKeys {
    #[serde(rename = "auctionId")]
    auction_id: String,
    keys: Vec<EnebaKey>,
}

/// One key: `{type: "TEXT", value}`.
#[derive(Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[allow(dead_code)]
pub(crate) struct EnebaKey {
    #[serde(rename = "type")]
    #[schema(pattern = "^TEXT$")]
    kind: String,
    value: String,
}

/// `POST /channels/NAME/eneba`: RESERVE, PROVIDE or CANCEL.
#[utoipa::path(
    post, path = "/channels/{name}/eneba", tag = "channels",
    operation_id = "eneba_callback",
    params(("name" = String, Path, description = "the channel")),
    request_body(content = EnebaCallback, content_type = "application/json"),
    responses(
        (status = 200, description = "RESERVE held every key (`success: true`) or held none (`success: false`: out of stock, an unknown auction, a paused channel, a cancelled order); PROVIDE answered the keys (the same bytes again on a retry) or none; CANCEL done (no body; after provision under the `burn` policy the keys are voided)", body = EnebaAnswer),
        (status = 400, description = "a body outside Eneba's contract; nothing done", body = EnebaAnswer),
        (status = 401, description = "not the channel's token; nothing read is acted on", body = EnebaAnswer),
        (status = 404, description = "no Eneba channel of that name", body = EnebaAnswer),
        (status = 408, description = "the request took longer than `--request-timeout`; the same call may be made again"),
        (status = 413, description = "the body is over 64 KiB"),
        (status = 500, description = "a CANCEL after provision under the `resell` policy (the keys stay sold: Eneba returns them to its own stock), or a fault", body = EnebaAnswer),
        (status = 503, description = "MongoDB or the batch is away; Eneba retries the same call", body = EnebaAnswer),
    ),
    security(("eneba_token" = []))
)]
pub(super) async fn callback(
    State(api): State<Arc<Api>>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let token = super::bearer(&headers);
    let call = read(&body);
    let c = match api
        .channel_authorized(&name, Kind::Eneba, token.as_deref())
        .await
    {
        Ok(c) => c,
        Err(e) => {
            // Nothing read from an unauthenticated body is acted on.
            let (action, order) = match &call {
                Ok(Callback::Reserve { order, .. }) | Ok(Callback::Replace { order, .. }) => {
                    ("RESERVE", order.as_str())
                }
                Ok(Callback::Provide { order, .. }) => ("PROVIDE", order.as_str()),
                Ok(Callback::Cancel { order }) => ("CANCEL", order.as_str()),
                Err(_) => ("", ""),
            };
            return failed(action, order, e);
        }
    };
    match call {
        Err(m) => refused(
            StatusCode::BAD_REQUEST,
            json!(m.action),
            json!(m.order),
            m.why,
        ),
        Ok(Callback::Reserve { order, auctions }) => reserve(&api, &c, &order, auctions).await,
        Ok(Callback::Replace {
            order,
            auction,
            key,
        }) => replace(&api, &c, &order, &auction, &key).await,
        Ok(Callback::Provide { order, key }) => provide(&api, &c, &order, key.as_deref()).await,
        Ok(Callback::Cancel { order }) => cancel(&api, &c, &order).await,
    }
}

async fn reserve(api: &Api, c: &ChannelDoc, order: &str, auctions: Vec<(String, u32)>) -> Response {
    let mut lines = Vec::with_capacity(auctions.len());
    for (auction, count) in &auctions {
        match channels::line_of(c, auction, *count) {
            Ok(l) => lines.push(l),
            Err(e) => {
                api.channel_counted(c, Call::Reservation, false);
                return failed("RESERVE", order, e);
            }
        }
    }
    match api.channel_reserve(&api.holds, c, order, lines).await {
        Ok(_) => {
            Json(json!({"action": "RESERVE", "orderId": order, "success": true})).into_response()
        }
        Err(e) => failed("RESERVE", order, e),
    }
}

/// The keys grouped by auction, in the order's line order: the same
/// order gives the same bytes.
fn auctions_of(keys: &[Key]) -> Vec<Value> {
    let mut out: Vec<(String, Vec<Value>)> = Vec::new();
    for k in keys {
        let key = json!({"type": "TEXT", "value": k.value});
        match out.iter_mut().find(|(a, _)| *a == k.product) {
            Some((_, ks)) => ks.push(key),
            None => out.push((k.product.clone(), vec![key])),
        }
    }
    out.into_iter()
        .map(|(a, ks)| json!({"auctionId": a, "keys": ks}))
        .collect()
}

/// A replacement's RESERVE: a key of the order replaced, or refused
/// (Eneba refunds the buyer).
async fn replace(api: &Api, c: &ChannelDoc, order: &str, auction: &str, key: &str) -> Response {
    match api.eneba_replace(c, order, auction, key).await {
        Ok(()) => {
            api.channel_counted(c, Call::Reservation, true);
            Json(json!({"action": "RESERVE", "orderId": order, "success": true})).into_response()
        }
        Err(e) => {
            api.channel_counted(c, Call::Reservation, false);
            failed("RESERVE", order, e)
        }
    }
}

async fn provide(api: &Api, c: &ChannelDoc, order: &str, key: Option<&str>) -> Response {
    // A replaced key's PROVIDE answers its new key (the same every time).
    match api.eneba_replacement_keys(c, order, key).await {
        Ok(Some(keys)) => {
            return Json(json!({
                "action": "PROVIDE",
                "orderId": order,
                "success": true,
                "auctions": auctions_of(&keys),
            }))
            .into_response()
        }
        Ok(None) => {}
        Err(e) => return failed("PROVIDE", order, e),
    }
    let via = format!("Eneba PROVIDE {order}");
    match api.channel_provide(api, c, order, None, &via).await {
        Ok(keys) => Json(json!({
            "action": "PROVIDE",
            "orderId": order,
            "success": true,
            "auctions": auctions_of(&keys),
        }))
        .into_response(),
        Err(e) => failed("PROVIDE", order, e),
    }
}

async fn cancel(api: &Api, c: &ChannelDoc, order: &str) -> Response {
    let via = format!("Eneba CANCEL {order}");
    match api.channel_cancel(api, c, order, &via).await {
        Ok(Cancelled::Released) | Ok(Cancelled::AfterProvide(AfterProvide::Burn)) => {
            StatusCode::OK.into_response()
        }
        // The key stays sold: Eneba puts it back in its own stock.
        Ok(Cancelled::AfterProvide(AfterProvide::Resell)) => refused(
            StatusCode::INTERNAL_SERVER_ERROR,
            json!("CANCEL"),
            json!(order),
            "the keys stay sold: return them to Eneba's stock".into(),
        ),
        Err(e) => failed("CANCEL", order, e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_outside_the_contract_is_named_and_keeps_its_action_and_order() {
        for (body, action) in [
            (
                r#"{"action":"RESERVE","orderId":"o-1","auctions":[]}"#,
                "RESERVE",
            ),
            (
                r#"{"action":"RESERVE","orderId":"o-1","auctions":[{"auctionId":"a","keyCount":0}]}"#,
                "RESERVE",
            ),
            (
                r#"{"action":"RESERVE","orderId":"o-1","auctions":[{"auctionId":"a","keyCount":1},{"auctionId":"a","keyCount":1}]}"#,
                "RESERVE",
            ),
            (r#"{"action":"EXPLODE","orderId":"o-1"}"#, "EXPLODE"),
        ] {
            let Err(m) = read(body.as_bytes()) else {
                panic!("{body} was taken")
            };
            assert_eq!(m.action.as_deref(), Some(action), "{body}");
            assert_eq!(m.order.as_deref(), Some("o-1"), "{body}");
        }
        assert!(read(b"[1,2]").is_err());
        assert!(read(br#"{"action":"PROVIDE","orderId":"o/1"}"#).is_err());
        assert!(matches!(
            read(br#"{"action":"RESERVE","orderId":"o-1","auctions":[{"auctionId":"a","keyCount":2,"price":{"amount":100,"currency":"EUR"}}]}"#),
            Ok(Callback::Reserve { .. })
        ));
    }
}
