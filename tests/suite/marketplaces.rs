//! The marketplaces as the suite plays them, shared by the channels'
//! tests (`channels.rs`) and the seeded checker (`checker.rs`): the
//! credentials and product ids of a shop's Eneba, G2A and Kinguin
//! channels, `codepool channels add` and `map`, each protocol's request
//! bodies and how to read its answers, a Kinguin webhook as Kinguin sends
//! it (also to a process that may be killed under it), and a simulated
//! Kinguin Sales Manager API that takes the keys codepool uploads, with
//! its faults (../shared/marketplaces.md has each contract).

#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

use crate::common::{codepool_ok, TestEnv};

/// The bearer Eneba presents on its callbacks to channel `en`.
pub(crate) const ENEBA_TOKEN: &str = "eneba-static-bearer-0123456789abcdef0123456789";
/// The OAuth2 client G2A presents to channel `g2`.
pub(crate) const G2A_ID: &str = "g2a-client";
pub(crate) const G2A_SECRET: &str = "g2a-client-secret-0123456789abcdef0123456789";
/// An Eneba auction and a G2A product, as each marketplace names them.
pub(crate) const AUCTION: &str = "8f2c1a52-6a1e-4b8e-9a55-0c9a3e1f0b7d";
pub(crate) const PRODUCT: &str = "10000045532001";
/// The secret header Kinguin sends on its webhooks to channel `kg`, and
/// the API client codepool uses to reach (simulated) Kinguin.
pub(crate) const KG_SECRET: &str = "kinguin-webhook-secret-0123456789abcdef0123";
pub(crate) const KG_CLIENT: &str = "kinguin-client";
pub(crate) const KG_CLIENT_SECRET: &str = "kinguin-client-secret-0123456789abcdef";
/// A Kinguin offer.
pub(crate) const OFFER: &str = "5f0c1e2d3b4a5968778695a4";

// ---------------------------------------------------------------- channels

/// `codepool channels add`, credentials written to a file; `extra` flags.
pub(crate) async fn add_channel(
    env: &TestEnv,
    name: &str,
    kind: &str,
    shop: &str,
    creds: Value,
    extra: &[&str],
) {
    let path =
        std::env::temp_dir().join(format!("cpt-{}-{}-{name}.json", std::process::id(), env.db));
    std::fs::write(&path, creds.to_string()).unwrap();
    let file = path.to_str().unwrap().to_owned();
    let mut args = vec![
        "channels",
        "add",
        "--name",
        name,
        "--kind",
        kind,
        "--shop",
        shop,
        "--credentials",
        &file,
    ];
    args.extend_from_slice(extra);
    codepool_ok(env, &args).await;
    let _ = std::fs::remove_file(path);
}

/// `codepool channels map`: the marketplace's `product` sells `pool`.
pub(crate) async fn map(env: &TestEnv, name: &str, product: &str, pool: &str) {
    codepool_ok(
        env,
        &[
            "channels",
            "map",
            "--name",
            name,
            "--product",
            product,
            "--pool",
            pool,
        ],
    )
    .await;
}

/// The credentials of channel `kg`, whose Kinguin API is `sim`.
pub(crate) fn kinguin_credentials(sim: &Kinguin) -> Value {
    json!({"webhook_secret": KG_SECRET, "client_id": KG_CLIENT,
           "client_secret": KG_CLIENT_SECRET, "base_url": sim.url})
}

// ---------------------------------------------------------------- Eneba

/// RESERVE `keys` keys of [`AUCTION`] for Eneba order `order`.
pub(crate) fn reserve(order: &str, keys: u32) -> Value {
    reserve_of(order, AUCTION, keys)
}

/// RESERVE `keys` keys of `auction` for Eneba order `order`.
pub(crate) fn reserve_of(order: &str, auction: &str, keys: u32) -> Value {
    json!({"action": "RESERVE", "orderId": order, "auctions": [
        {"auctionId": auction, "keyCount": keys, "price": {"amount": 1599, "currency": "EUR"}}
    ]})
}

pub(crate) fn provide(order: &str) -> Value {
    json!({"action": "PROVIDE", "orderId": order})
}

pub(crate) fn cancel(order: &str) -> Value {
    json!({"action": "CANCEL", "orderId": order})
}

/// The keys of a PROVIDE answer.
pub(crate) fn keys_of(body: &[u8]) -> Vec<String> {
    let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    (v["auctions"].as_array().into_iter().flatten())
        .flat_map(|a| a["keys"].as_array().cloned().unwrap_or_default())
        .filter_map(|k| k["value"].as_str().map(str::to_owned))
        .collect()
}

/// An Eneba answer's `success` (`null` when the body is not JSON).
pub(crate) fn success(body: &[u8]) -> Value {
    serde_json::from_slice::<Value>(body).unwrap_or(Value::Null)["success"].clone()
}

// ---------------------------------------------------------------- G2A

/// A G2A reservation of `quantity` keys of [`PRODUCT`].
pub(crate) fn reservation(quantity: u32) -> Value {
    json!([{"product_id": PRODUCT.parse::<u64>().unwrap(), "quantity": quantity,
            "additional_data": {"unit_price": "5.98", "auction_base_price": "15.98"}}])
}

/// The inventory ids and values of an order answer's (or inventory's) stock.
pub(crate) fn inventory_of(stock: &Value) -> Vec<(String, String)> {
    (stock.as_array().into_iter().flatten())
        .flat_map(|s| s["inventory"].as_array().cloned().unwrap_or_default())
        .map(|i| {
            assert_eq!(i["kind"], "text");
            (
                i["id"].as_str().unwrap().to_owned(),
                i["value"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

// ---------------------------------------------------------------- Kinguin

/// One Kinguin webhook, as Kinguin sends it: `X-Auth-Token: secret`.
pub(crate) async fn kinguin_post(addr: &str, secret: Option<&str>, body: &[u8]) -> (u16, Value) {
    kinguin_post_at(addr, "kg", secret, body).await
}

/// One Kinguin webhook to channel `channel`.
pub(crate) async fn kinguin_post_at(
    addr: &str,
    channel: &str,
    secret: Option<&str>,
    body: &[u8],
) -> (u16, Value) {
    kinguin_try(addr, channel, secret, body, Duration::from_secs(30))
        .await
        .expect("an answer within 30 s")
}

/// One Kinguin webhook to channel `channel`, its answer if one comes
/// `within`.
pub(crate) async fn kinguin_try(
    addr: &str,
    channel: &str,
    secret: Option<&str>,
    body: &[u8],
    within: Duration,
) -> Option<(u16, Value)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    let mut req = format!(
        "POST /channels/{channel}/kinguin HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    if let Some(t) = secret {
        req.push_str(&format!("X-Auth-Token: {t}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    // A body codepool refuses unread may be cut short: its answer counts.
    let _ = s.write_all(body).await;
    let mut raw = Vec::new();
    let _ = tokio::time::timeout(within, s.read_to_end(&mut raw))
        .await
        .ok()?;
    // A connection closed (or reset) before any answer: none.
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = serde_json::from_slice(&raw[split + 4..]).unwrap_or(Value::Null);
    Some((status, body))
}

/// A webhook of reservation `reservation` of [`OFFER`] in `status`.
pub(crate) fn kg_hook(reservation: &str, status: &str) -> Value {
    json!({"reservationId": reservation, "offerId": OFFER, "productId": "5c9b5b4b2539a4e8f17ae1a5",
           "orderId": format!("KO-{reservation}"), "status": status, "updatedAt": "2026-12-07T20:00:00+00:00"})
}

/// The faults the simulated Kinguin injects.
#[derive(Default, Clone)]
pub(crate) struct KgFaults {
    /// The first N uploads are answered 409 "being proceeded".
    pub(crate) busy: u32,
    /// The first N uploads are stored, then answered only after this long
    /// (after codepool's timeout): its retry meets "Stock already uploaded".
    pub(crate) slow: u32,
    pub(crate) slow_for: Duration,
    /// Tokens stop working this long after they are issued, though
    /// `expires_in` says an hour.
    pub(crate) token_life: Option<Duration>,
    /// The upload endpoint answers 503 while down.
    pub(crate) down: bool,
    /// Reservations Kinguin does not know: 400 "Invalid reservation ID".
    pub(crate) invalid: Vec<String>,
    /// Reservations whose stock Kinguin holds already, with another key.
    pub(crate) foreign: Vec<(String, String)>,
    /// The most stock an offer may declare: more is a 400 "Max declared
    /// stock has been exceeded".
    pub(crate) max_declared: Option<u64>,
    /// Tokens are issued here only (a `token_url`), not at `/oauth/token`.
    pub(crate) token_path: Option<&'static str>,
}

#[derive(Default)]
struct KgState {
    faults: KgFaults,
    /// Access tokens issued, with the end of their life.
    tokens: HashMap<String, std::time::Instant>,
    /// Every upload that reached the stock endpoint: (reservation, key).
    attempts: Vec<(String, String)>,
    /// The stock Kinguin holds, by reservation.
    stock: HashMap<String, String>,
    /// Every declaration that reached the offer: (declaredStock,
    /// declaredTextStock, taken).
    declarations: Vec<(u64, u64, bool)>,
}

/// A Kinguin Sales Manager API on 127.0.0.1, as `marketplaces.md` has
/// its contract: OAuth2 client-credentials tokens, `POST` and `GET
/// /api/v1/offers/{offerId}/stock`, `PATCH /api/v1/offers/{offerId}`
/// (declared stock), with its faults.
pub(crate) struct Kinguin {
    pub(crate) url: String,
    st: Arc<std::sync::Mutex<KgState>>,
}

type KgAnswer = (u16, String);

fn kg_reply((status, body): KgAnswer) -> axum::response::Response {
    axum::response::Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(axum::body::Body::from(body))
        .unwrap()
}

async fn kg_serve(
    st: Arc<std::sync::Mutex<KgState>>,
    method: axum::http::Method,
    uri: axum::http::Uri,
    headers: axum::http::HeaderMap,
    body: String,
) -> KgAnswer {
    let path = uri.path().to_owned();
    let token_path = st
        .lock()
        .unwrap()
        .faults
        .token_path
        .unwrap_or("/oauth/token");
    if method == "POST" && path == token_path {
        let form: HashMap<&str, &str> = body.split('&').filter_map(|p| p.split_once('=')).collect();
        if form.get("grant_type") != Some(&"client_credentials")
            || form.get("client_id") != Some(&KG_CLIENT)
            || form.get("client_secret") != Some(&KG_CLIENT_SECRET)
        {
            return (401, json!({"error": "invalid_client"}).to_string());
        }
        let mut s = st.lock().unwrap();
        let token = format!("jwt-{}", s.tokens.len());
        let life = s.faults.token_life.unwrap_or(Duration::from_secs(3600));
        s.tokens
            .insert(token.clone(), std::time::Instant::now() + life);
        return (
            200,
            json!({"access_token": token, "token_type": "bearer", "expires_in": 3600}).to_string(),
        );
    }
    let bearer = (headers.get("authorization").and_then(|v| v.to_str().ok()))
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or_default()
        .to_owned();
    let stock_path = format!("/api/v1/offers/{OFFER}/stock");
    let offer_path = format!("/api/v1/offers/{OFFER}");
    if path != stock_path && !(path == offer_path && method == "PATCH") {
        return (404, json!({"message": "Not found"}).to_string());
    }
    {
        let s = st.lock().unwrap();
        match s.tokens.get(&bearer) {
            Some(until) if *until > std::time::Instant::now() => {}
            _ => return (401, json!({"message": "Unauthorized"}).to_string()),
        }
    }
    if path == offer_path {
        return kg_declare(&st, &body);
    }
    if method == "GET" {
        let rid = uri
            .query()
            .unwrap_or_default()
            .split('&')
            .find_map(|p| p.strip_prefix("reservationId="))
            .unwrap_or_default()
            .to_owned();
        let s = st.lock().unwrap();
        let list: Vec<Value> = (s.stock.iter())
            .filter(|(r, _)| rid.is_empty() || **r == rid)
            .map(|(r, k)| json!({"reservationId": r, "body": k, "status": "ACTIVE"}))
            .collect();
        return (200, Value::Array(list).to_string());
    }
    let v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
    let (Some(rid), Some(key)) = (v["reservationId"].as_str(), v["body"].as_str()) else {
        return (400, json!({"message": "Bad request"}).to_string());
    };
    assert_eq!(v["mimeType"], "text/plain");
    assert!(v["requestId"]
        .as_str()
        .is_some_and(|r| !r.is_empty() && r.len() <= 36));
    let slow = {
        let mut s = st.lock().unwrap();
        if s.faults.down {
            return (503, json!({"message": "Service Unavailable"}).to_string());
        }
        s.attempts.push((rid.to_owned(), key.to_owned()));
        if s.faults.busy > 0 {
            s.faults.busy -= 1;
            return (409, json!({"message": "Reservation is being proceeded by another action now. Please try again in few seconds"}).to_string());
        }
        if s.faults.invalid.iter().any(|r| r == rid) {
            return (400, json!({"message": "Invalid reservation ID (does not exist or has already been processed)"}).to_string());
        }
        if s.stock.contains_key(rid) {
            return (
                409,
                json!({"message": "Stock already uploaded"}).to_string(),
            );
        }
        s.stock.insert(rid.to_owned(), key.to_owned());
        if s.faults.slow > 0 {
            s.faults.slow -= 1;
            Some(s.faults.slow_for)
        } else {
            None
        }
    };
    if let Some(d) = slow {
        tokio::time::sleep(d).await;
    }
    (
        201,
        json!({"id": format!("stock-{rid}"), "reservationId": rid, "status": "ACTIVE"}).to_string(),
    )
}

/// `PATCH /api/v1/offers/{offerId}` `{declaredStock, declaredTextStock}`.
fn kg_declare(st: &std::sync::Mutex<KgState>, body: &str) -> KgAnswer {
    let v: Value = serde_json::from_str(body).unwrap_or(Value::Null);
    let (Some(n), Some(text)) = (v["declaredStock"].as_u64(), v["declaredTextStock"].as_u64())
    else {
        return (400, json!({"message": "Bad request"}).to_string());
    };
    let mut s = st.lock().unwrap();
    if text > n || s.faults.max_declared.is_some_and(|m| n > m) {
        s.declarations.push((n, text, false));
        let why = if text > n {
            "declaredTextStock must not exceed declaredStock"
        } else {
            "Max declared stock has been exceeded"
        };
        return (400, json!({"message": why}).to_string());
    }
    s.declarations.push((n, text, true));
    let offer = json!({"id": OFFER, "declaredStock": n, "declaredTextStock": text});
    (200, offer.to_string())
}

impl Kinguin {
    pub(crate) async fn start(faults: KgFaults) -> Self {
        let mut state = KgState {
            faults: faults.clone(),
            ..KgState::default()
        };
        for (r, k) in &faults.foreign {
            state.stock.insert(r.clone(), k.clone());
        }
        let st = Arc::new(std::sync::Mutex::new(state));
        let s = st.clone();
        let app = axum::Router::new().fallback(
            move |method: axum::http::Method,
                  uri: axum::http::Uri,
                  headers: axum::http::HeaderMap,
                  body: String| {
                let st = s.clone();
                async move { kg_reply(kg_serve(st, method, uri, headers, body).await) }
            },
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        Self {
            url: format!("http://{addr}"),
            st,
        }
    }

    pub(crate) fn stock(&self) -> HashMap<String, String> {
        self.st.lock().unwrap().stock.clone()
    }

    pub(crate) fn attempts(&self) -> Vec<(String, String)> {
        self.st.lock().unwrap().attempts.clone()
    }

    pub(crate) fn tokens_issued(&self) -> usize {
        self.st.lock().unwrap().tokens.len()
    }

    pub(crate) fn set_down(&self, down: bool) {
        self.st.lock().unwrap().faults.down = down;
    }

    pub(crate) fn declarations(&self) -> Vec<(u64, u64, bool)> {
        self.st.lock().unwrap().declarations.clone()
    }

    /// The declared stock Kinguin took last.
    pub(crate) fn declared(&self) -> Option<u64> {
        (self.declarations().iter().rev())
            .find(|d| d.2)
            .map(|d| d.0)
    }

    /// Waits up to `within` for the declared stock Kinguin took last to
    /// be `n`.
    pub(crate) async fn declares(&self, n: u64, within: Duration) -> bool {
        let until = std::time::Instant::now() + within;
        while std::time::Instant::now() < until && self.declared() != Some(n) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.declared() == Some(n)
    }
}
