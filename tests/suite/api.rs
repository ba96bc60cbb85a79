//! The HTTP API against the real servers, through a real `codepool api`
//! process: keys and scopes, idempotent orders that share the dispatcher's
//! core and events, problems that name the field, limits. Bad input at the
//! HTTP door: slow clients cut at the request timeout, connections beyond
//! the cap kept waiting, curl's bodiless POSTs, the bearer scheme in any
//! case, a dead-letter walk that stops at its bound, and no answer that
//! carries a code stored by a cache. Hostile requests each get their 4xx
//! with a problem body that says what to do, never a 500, and the process
//! keeps serving; an upload is imported while it is still arriving, and a
//! gzip one with its content encoding. An order's codes go back only to the
//! key that placed it, and an order id sent composed or decomposed is one
//! order.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use codepool_domain::SmsPending;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::*;
use crate::fixtures::*;

/// What one HTTP exchange got: status, headers (lower-case names), body.
pub(crate) type Exchange = (u16, HashMap<String, String>, Vec<u8>);

/// A `codepool api` child process with its address.
pub(crate) struct ApiServer {
    pub(crate) child: tokio::process::Child,
    pub(crate) addr: String,
    log: Arc<std::sync::Mutex<Vec<String>>>,
}

impl ApiServer {
    pub(crate) async fn start(env: &TestEnv, extra: &[&str]) -> Self {
        Self::start_with(env, extra, &[]).await
    }

    /// [`Self::start`] with environment variables `vars` set (the
    /// failpoints of a crash test: `CODEPOOL_FAILPOINTS`).
    pub(crate) async fn start_with(env: &TestEnv, extra: &[&str], vars: &[(&str, &str)]) -> Self {
        let mut args = vec!["api", "--listen", "127.0.0.1:0"];
        args.extend_from_slice(extra);
        let mut child = env
            .command(&args)
            .envs(vars.iter().copied())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn codepool api");
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let log = Arc::new(std::sync::Mutex::new(Vec::new()));
        let kept = log.clone();
        tokio::spawn(async move {
            let mut lines = tokio::io::BufReader::new(stderr).lines();
            let mut tx = Some(tx);
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(addr) =
                    crate::common::announced(&line).strip_prefix("codepool: api listening on ")
                {
                    if let Some(tx) = tx.take() {
                        let _ = tx.send(addr.trim().to_owned());
                    }
                }
                kept.lock().unwrap().push(line);
            }
        });
        let addr = tokio::time::timeout(Duration::from_secs(60), rx)
            .await
            .expect("the API listens within 60 s")
            .expect("the API exited before listening");
        Self { child, addr, log }
    }

    /// `METHOD path` with `body` as `key` (see [`http`]).
    pub(crate) async fn call(&self, method: &str, path: &str, key: &str, body: &[u8]) -> Exchange {
        http(&self.addr, method, path, Some(key), body).await
    }

    /// `POST path` with a JSON `body` as `key`.
    pub(crate) async fn post(&self, path: &str, key: &str, body: &[u8]) -> Exchange {
        self.call("POST", path, key, body).await
    }

    /// `POST path` with a `body` of `content_type` as `key`.
    pub(crate) async fn post_as(
        &self,
        path: &str,
        key: &str,
        content_type: &str,
        body: &[u8],
    ) -> Exchange {
        http_as(&self.addr, "POST", path, Some(key), content_type, body).await
    }

    /// `GET path` as `key`.
    pub(crate) async fn get(&self, path: &str, key: &str) -> Exchange {
        self.call("GET", path, key, b"").await
    }

    /// The API's log so far, one string.
    pub(crate) fn log_text(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    /// SIGTERM; the API must exit 0 within 10 s.
    pub(crate) async fn stop(mut self) {
        let pid = self.child.id().unwrap().to_string();
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status();
        let status = tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .expect("the API stops within 10 s of SIGTERM")
            .unwrap();
        assert!(
            status.success(),
            "exit {status}: {:?}",
            self.log.lock().unwrap()
        );
    }
}

/// One HTTP/1.1 exchange (`Connection: close`): status, headers, body.
pub(crate) async fn http(
    addr: &str,
    method: &str,
    path: &str,
    key: Option<&str>,
    body: &[u8],
) -> Exchange {
    http_as(addr, method, path, key, "application/json", body).await
}

/// [`http`] with a body of another content type.
pub(crate) async fn http_as(
    addr: &str,
    method: &str,
    path: &str,
    key: Option<&str>,
    content_type: &str,
    body: &[u8],
) -> Exchange {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n",
        body.len()
    );
    if let Some(k) = key {
        req.push_str(&format!("Authorization: Bearer {k}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    s.write_all(body).await.unwrap();
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut raw))
        .await
        .expect("an answer within 30 s")
        .unwrap();
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a head");
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.lines();
    let status = lines
        .next()
        .unwrap()
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: HashMap<String, String> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let body = raw[split + 4..].to_vec();
    // Every answer on a documented route holds to the OpenAPI document.
    let ct = headers.get("content-type").map(String::as_str);
    if let Err(e) = crate::openapi::contract().check(method, path, status, ct, &body) {
        panic!("the answer breaks the OpenAPI document: {e}");
    }
    (status, headers, body)
}

pub(crate) fn json_of(body: &[u8]) -> Value {
    serde_json::from_slice(body)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(body)))
}

/// `codepool api-keys create`; returns the secret.
pub(crate) async fn key(env: &TestEnv, name: &str, scopes: &str) -> String {
    let args = ["api-keys", "create", "--name", name, "--scopes", scopes];
    codepool_ok(env, &args).await.trim().to_owned()
}

pub(crate) fn order(id: &str, pool: &str, quantity: u32) -> Vec<u8> {
    json!({"order_id": id, "uid": "u-api", "phone": "+8613800000000", "pool": pool, "quantity": quantity})
        .to_string()
        .into_bytes()
}

#[tokio::test]
async fn an_order_placed_twice_over_http_and_once_over_amqp_gets_its_codes_once() {
    let env = TestEnv::with_pools("api_orders", &[("web", 20)]).await;
    let (api, shop) = api_with_key(&env, "shop", "orders:write,orders:read").await;

    let (status, headers, body) = api.post("/v1/orders", &shop, &order("W-1", "web", 3)).await;
    assert_eq!(status, 201, "{}", String::from_utf8_lossy(&body));
    assert!(headers.contains_key("x-request-id"));
    let first = json_of(&body);
    assert_eq!(first["state"], "granted");
    let codes: Vec<String> = first["codes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["code"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(codes.len(), 3);
    assert!(
        codes.iter().all(|c| c.starts_with("web-")),
        "plaintext for the shop: {codes:?}"
    );

    // A naive retry loop: the same codes, 200 this time.
    let (status, _, body) = api.post("/v1/orders", &shop, &order("W-1", "web", 3)).await;
    assert_eq!(status, 200);
    assert_eq!(json_of(&body)["codes"], first["codes"]);
    // The same order id with another quantity: a conflict, nothing granted.
    let (status, headers, body) = api.post("/v1/orders", &shop, &order("W-1", "web", 4)).await;
    assert_eq!(status, 409);
    assert_eq!(headers["content-type"], "application/problem+json");
    let p = json_of(&body);
    assert_eq!(p["field"], "order_id");
    assert!(
        p["detail"].as_str().unwrap().contains("new order_id"),
        "{p}"
    );
    assert_eq!(
        p["request_id"].as_str(),
        headers.get("x-request-id").map(String::as_str)
    );

    // The same order over AMQP: a dispatcher finds it granted; one code set.
    let d = start_daemon(env.command(&[])).await;
    let (conn, publisher) = env.amqp().await;
    let mut p = purchase("W-1", "web");
    p.uid = "u-api".into();
    p.quantity = 3;
    publish_one(&publisher, &p).await;
    let ch = conn.create_channel().await.unwrap();
    let t = env.topology();
    // The AMQP delivery settled.
    wait_depth(&ch, &t.sms_pending, 30, |n| n >= 2).await;
    d.stop().await;
    let issued = count_codes(&env, bson::doc! {"order_id": "W-1"}).await;
    assert_eq!(issued, 3, "one set of codes, whichever door");
    // Every event of the order, whichever door sent it, is the same event.
    let events: Vec<SmsPending> = drain(&ch, &t.sms_pending)
        .await
        .iter()
        .map(|e| serde_json::from_slice(&e.body).unwrap())
        .collect();
    // The first request texts the codes; the retry only answers (no second
    // SMS); the AMQP delivery re-sends the same event, as a redelivery does.
    assert_eq!(events.len(), 2, "{events:?}");
    assert!(
        events.iter().all(|e| e.event_id == "sms:W-1:0-2"),
        "{events:?}"
    );
    let sent: Vec<String> = events[0].all_codes().into_iter().map(|c| c.code).collect();
    assert_eq!(sent, codes);

    // Read it back: masked, with grant numbers and SMS state.
    let (status, _, body) = api.get("/v1/orders/W-1", &shop).await;
    assert_eq!(status, 200);
    let read = json_of(&body);
    assert_eq!(read["state"], "granted");
    assert!(read["codes"][0]["code"].as_str().unwrap().contains('*'));
    assert!(read["codes"][0]["grant_no"].is_string());
    api.stop().await;
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}

#[tokio::test]
async fn keys_scopes_and_bad_requests_get_problems_that_say_what_to_do() {
    let env = TestEnv::with_pools("api_keys", &[("web", 5)]).await;
    let reader = key(&env, "reader", "orders:read").await;
    let writer = key(&env, "writer", "orders:write").await;
    let api = ApiServer::start(&env, &["--rate-per-key", "5"]).await;
    let post = |k: Option<String>, body: Vec<u8>| {
        let addr = api.addr.clone();
        async move { http(&addr, "POST", "/v1/orders", k.as_deref(), &body).await }
    };

    // No key, a wrong key: 401 with a challenge.
    let (status, h, _) = post(None, order("K-1", "web", 1)).await;
    assert_eq!(status, 401);
    assert!(h["www-authenticate"].starts_with("Bearer"));
    let (status, _, _) = post(
        Some(format!("cpk_{}_{}", "0".repeat(16), "1".repeat(64))),
        order("K-1", "web", 1),
    )
    .await;
    assert_eq!(status, 401);
    // A key without the scope: 403, naming it.
    let (status, _, body) = post(Some(reader.clone()), order("K-1", "web", 1)).await;
    assert_eq!(status, 403);
    assert_eq!(json_of(&body)["scope"], "orders:write");
    // Reveal needs its own scope.
    let (status, _, _) = api.get("/v1/orders/K-1?reveal=true", &reader).await;
    assert_eq!(status, 403);

    // Bad input names the field; an unknown pool too.
    for (body, field) in [
        (
            br#"{"order_id":"K-2","uid":"u","phone":"call me","pool":"web"}"#.to_vec(),
            "phone",
        ),
        (
            br#"{"order_id":"K-3","uid":"u","phone":"+8613800000000","pool":"web","quantity":0}"#
                .to_vec(),
            "quantity",
        ),
        (
            br#"{"order_id":"K-4","uid":"u","phone":"+8613800000000","pool":"nowhere"}"#.to_vec(),
            "pool",
        ),
        (
            br#"{"uid":"u","phone":"+8613800000000","pool":"web"}"#.to_vec(),
            "order_id",
        ),
    ] {
        let (status, h, b) = post(Some(writer.clone()), body).await;
        assert_eq!(status, 422, "{}", String::from_utf8_lossy(&b));
        assert_eq!(h["content-type"], "application/problem+json");
        assert_eq!(json_of(&b)["field"], field);
    }
    // Not JSON, and a body over the limit: 4xx, never 500.
    let (status, _, _) = post(Some(writer.clone()), b"{not json".to_vec()).await;
    assert_eq!(status, 422);
    let (status, h, b) = post(Some(writer.clone()), vec![b'x'; 64 * 1024]).await;
    assert_eq!(status, 413, "{}", String::from_utf8_lossy(&b));
    assert_eq!(h["content-type"], "application/problem+json");
    assert!(json_of(&b)["detail"]
        .as_str()
        .unwrap()
        .contains("body-limit"));

    // Over the rate: 429 with Retry-After.
    let mut limited = None;
    for _ in 0..30 {
        let (status, h, _) = post(Some(writer.clone()), b"{}".to_vec()).await;
        if status == 429 {
            limited = Some(h);
            break;
        }
    }
    let h = limited.expect("the key was rate-limited");
    assert!(h["retry-after"].parse::<u64>().unwrap() >= 1);

    // A revoked key stops working within a second.
    let out = env.run(&["api-keys", "revoke", "--name", "reader"]).await;
    assert!(out.status.success());
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let (status, _, _) = api.get("/v1/orders/K-1", &reader).await;
    assert_eq!(status, 401);
    // Only the hash is stored.
    let stored = env
        .coll("api_keys")
        .find_one(bson::doc! {"name": "writer"})
        .await
        .unwrap()
        .unwrap();
    assert!(!stored
        .to_string()
        .contains(writer.rsplit('_').next().unwrap()));
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn an_empty_pool_answers_accepted_and_a_reveal_is_audited_with_the_key() {
    let env = TestEnv::with_pools("api_waiting", &[("few", 1)]).await;
    let (api, shop) = api_with_key(&env, "shop", "orders:write,orders:read,codes:reveal").await;
    let (status, _, body) = api.post("/v1/orders", &shop, &order("E-1", "few", 3)).await;
    assert_eq!(status, 202, "{}", String::from_utf8_lossy(&body));
    let b = json_of(&body);
    assert_eq!(b["state"], "partly_granted");
    assert_eq!(b["waiting_lines"], json!([1, 2]));
    let (status, _, body) = api.post("/v1/orders", &shop, &order("E-2", "few", 1)).await;
    assert_eq!(status, 202);
    assert_eq!(json_of(&body)["state"], "waiting");

    let (status, _, body) = api.get("/v1/orders/E-1?reveal=true", &shop).await;
    assert_eq!(status, 200);
    let read = json_of(&body);
    assert_eq!(read["codes"][0]["code"], "few-000001");
    assert_eq!(read["waiting_lines"], json!([1, 2]));
    let audit = env
        .coll("audit")
        .find_one(bson::doc! {"os_user": "api-key:shop"})
        .await
        .unwrap()
        .expect("the reveal is audited with the key's name");
    assert_eq!(audit.get_str("what").unwrap(), "order \"E-1\"");

    // Void with a reason: its code and what it waits for.
    let (status, _, _) = api.post("/v1/orders/E-1/void", &shop, b"{}").await;
    assert_eq!(status, 422);
    let (status, _, body) = api
        .post("/v1/orders/E-1/void", &shop, br#"{"reason":"refund"}"#)
        .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let v = json_of(&body);
    assert_eq!(
        (v["voided"].as_u64(), v["backorder_cancelled"].as_bool()),
        (Some(1), Some(true))
    );
    let (status, _, _) = api.get("/v1/orders/NOPE", &shop).await;
    assert_eq!(status, 404);
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn pools_are_listed_by_page_with_their_stock_and_administered_with_the_admin_scope() {
    let env = TestEnv::new("api_pools").await;
    for p in ["pa", "pb", "pc"] {
        env.fill_pool(p, 4).await;
    }
    let admin = key(&env, "ops", "admin").await;
    let (api, shop) = api_with_key(&env, "shop", "orders:write,orders:read").await;
    let call = |method: &'static str, path: String, k: String, body: Vec<u8>| {
        let addr = api.addr.clone();
        async move { http(&addr, method, &path, Some(&k), &body).await }
    };
    // An order takes a code of pa: its stock shows it.
    let (status, _, _) = call(
        "POST",
        "/v1/orders".into(),
        shop.clone(),
        order("P-1", "pa", 1),
    )
    .await;
    assert_eq!(status, 201);
    let (status, _, _) = call("GET", "/v1/pools".into(), shop.clone(), vec![]).await;
    assert_eq!(status, 403, "pools need the admin scope");

    let (status, _, body) = call(
        "POST",
        "/v1/pools".into(),
        admin.clone(),
        br#"{"name":"pd"}"#.to_vec(),
    )
    .await;
    assert_eq!(status, 201, "{}", String::from_utf8_lossy(&body));
    let (status, _, _) = call(
        "POST",
        "/v1/pools".into(),
        admin.clone(),
        br#"{"name":"pd"}"#.to_vec(),
    )
    .await;
    assert_eq!(status, 200, "creating it again changes nothing");
    let (status, _, body) = call(
        "POST",
        "/v1/pools".into(),
        admin.clone(),
        br#"{"name":"-bad"}"#.to_vec(),
    )
    .await;
    assert_eq!(status, 422);
    assert_eq!(json_of(&body)["field"], "name");

    // Two pages of two, then the end.
    let (status, _, body) = call("GET", "/v1/pools?limit=2".into(), admin.clone(), vec![]).await;
    assert_eq!(status, 200);
    let first = json_of(&body);
    let names: Vec<&str> = first["pools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["pa", "pb"]);
    assert_eq!(first["pools"][0]["stats"]["unissued"], 3);
    assert_eq!(first["pools"][0]["stats"]["issued"], 1);
    assert_eq!(first["next"], "pb");
    let (_, _, body) = call(
        "GET",
        "/v1/pools?limit=2&after=pb".into(),
        admin.clone(),
        vec![],
    )
    .await;
    let second = json_of(&body);
    let names: Vec<&str> = second["pools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["pc", "pd"]);
    let (_, _, body) = call(
        "GET",
        "/v1/pools?limit=2&after=pd".into(),
        admin.clone(),
        vec![],
    )
    .await;
    assert_eq!(json_of(&body)["next"], Value::Null);
    let (status, _, _) = call("GET", "/v1/pools?limit=0".into(), admin.clone(), vec![]).await;
    assert_eq!(status, 422);

    // Settings, a bad one naming its field, an unknown pool.
    let (status, _, body) = call(
        "PATCH",
        "/v1/pools/pb".into(),
        admin.clone(),
        br#"{"per_user":2,"grant_prefix":"PB"}"#.to_vec(),
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let pb = json_of(&body);
    assert_eq!(
        (pb["per_user"].as_i64(), pb["grant_prefix"].as_str()),
        (Some(2), Some("PB"))
    );
    let (status, _, body) = call(
        "PATCH",
        "/v1/pools/pb".into(),
        admin.clone(),
        br#"{"grant_prefix":"P-B"}"#.to_vec(),
    )
    .await;
    assert_eq!(status, 422);
    assert_eq!(json_of(&body)["field"], "grant_prefix");
    let (status, _, _) = call("GET", "/v1/pools/nope".into(), admin.clone(), vec![]).await;
    assert_eq!(status, 404);

    // Pause: an order waits; resume.
    let (status, _, body) = call("POST", "/v1/pools/pc/pause".into(), admin.clone(), vec![]).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let (status, _, body) = call(
        "POST",
        "/v1/orders".into(),
        shop.clone(),
        order("P-2", "pc", 1),
    )
    .await;
    assert_eq!(status, 202);
    assert_eq!(json_of(&body)["state"], "waiting");
    let (status, _, body) = call("POST", "/v1/pools/pc/resume".into(), admin.clone(), vec![]).await;
    assert_eq!(status, 200);
    assert_eq!(json_of(&body)["changed"], true);
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_client_that_never_finishes_its_request_head_is_disconnected() {
    let env = TestEnv::new("api_slow").await;
    let api = ApiServer::start(&env, &["--header-timeout", "1"]).await;
    let mut s = tokio::net::TcpStream::connect(&api.addr).await.unwrap();
    // Half a request head, then nothing (a slow-loris client).
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest)).await;
    assert!(closed.is_ok(), "the connection is still open after 5 s");
    // The server still serves everyone else.
    let (status, _) = crate::common::http_get(&api.addr, "/healthz")
        .await
        .expect("healthz");
    assert_eq!(status, 200);
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn dead_letters_are_listed_by_reason_and_replayed_once_the_cause_is_fixed() {
    let env = TestEnv::with_pools("api_dead", &[("known", 5)]).await;
    let admin = key(&env, "ops", "admin").await;
    let d = start_daemon(env.command(&[])).await;
    let api = ApiServer::start(&env, &[]).await;
    let (conn, publisher) = env.amqp().await;
    publish_one(&publisher, &purchase("DL-1", "later")).await;
    publish_bytes(&publisher, b"garbage", Some("DL-2")).await;
    let ch = conn.create_channel().await.unwrap();
    let t = env.topology();
    // Two dead letters.
    wait_depth(&ch, &t.purchases_dead, 20, |n| n == 2).await;
    let (status, _, body) = api
        .get("/v1/dead-letters?reason=unknown_pool", &admin)
        .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let listed = json_of(&body);
    assert_eq!(listed["dead_letters"].as_array().unwrap().len(), 1);
    assert_eq!(listed["dead_letters"][0]["message_id"], "DL-1");
    // The listing took nothing.
    wait_depth(&ch, &t.purchases_dead, 5, |n| n == 2).await;

    // Fix the cause, replay that reason only: DL-1 gets a code, DL-2 stays.
    env.fill_pool("later", 2).await;
    let (status, _, body) = api
        .post(
            "/v1/dead-letters/replay",
            &admin,
            br#"{"reason":"unknown_pool"}"#,
        )
        .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(json_of(&body)["replayed"], 1);
    eventually(Duration::from_secs(20), "DL-1 granted", || {
        let codes = env.coll("codes");
        async move {
            codes
                .count_documents(bson::doc! {"order_id": "DL-1"})
                .await
                .unwrap()
                == 1
        }
    })
    .await;
    let (_, _, body) = api.get("/v1/dead-letters", &admin).await;
    let left = json_of(&body);
    assert_eq!(left["dead_letters"].as_array().unwrap().len(), 1);
    assert_eq!(left["dead_letters"][0]["message_id"], "DL-2");
    let (status, _, _) = api.get("/v1/dead-letters?limit=0", &admin).await;
    assert_eq!(status, 422);
    api.stop().await;
    d.stop().await;
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_csv_uploaded_to_a_pool_is_imported_by_the_cli_rules_read_back_and_recalled() {
    let env = TestEnv::new("api_imports").await;
    let admin = key(&env, "ops", "admin").await;
    let (api, shop) = api_with_key(&env, "shop", "orders:write").await;
    let mut csv = String::from("code,expires_at\n");
    for i in 0..500 {
        csv.push_str(&format!("UP-{i:05}-ABCD,\n"));
    }
    csv.push_str("bad code with spaces and \u{200b},\n");
    let path = "/v1/pools/up/imports?file=partner-1.csv";
    let (status, _, body) = api.post_as(path, &admin, "text/csv", csv.as_bytes()).await;
    assert_eq!(status, 201, "{}", String::from_utf8_lossy(&body));
    let s = json_of(&body);
    assert_eq!(
        (s["inserted"].as_u64(), s["invalid"].as_u64()),
        (Some(500), Some(1))
    );
    assert_eq!(
        s["invalid_rows"][0]["line"], 502,
        "invalid rows by line number"
    );
    let id = s["import_id"].as_str().unwrap().to_owned();
    // The same file again changes nothing.
    let (status, _, body) = api.post_as(path, &admin, "text/csv", csv.as_bytes()).await;
    assert_eq!(status, 200);
    assert_eq!(json_of(&body)["duplicates"], 500);
    // A file whose header does not name the code column: nothing imported.
    let (status, _, body) = api
        .post_as("/v1/pools/up/imports", &admin, "text/csv", b"serial\nX-1\n")
        .await;
    assert_eq!(status, 422, "{}", String::from_utf8_lossy(&body));
    let (status, _, _) = api
        .post_as("/v1/pools/up/imports", &shop, "text/csv", csv.as_bytes())
        .await;
    assert_eq!(status, 403);

    // Orders take two codes; the recall voids the rest and lists those two.
    let (status, _, _) = api.post("/v1/orders", &shop, &order("UP-O", "up", 2)).await;
    assert_eq!(status, 201);
    let (status, _, body) = api.get(&format!("/v1/imports/{id}"), &admin).await;
    assert_eq!(status, 200);
    let record = json_of(&body);
    assert_eq!(
        (record["status"].as_str(), record["file"].as_str()),
        (Some("done"), Some("partner-1.csv"))
    );
    let (status, _, body) = api
        .post(
            &format!("/v1/imports/{id}/recall"),
            &admin,
            br#"{"reason":"partner leak"}"#,
        )
        .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let r = json_of(&body);
    assert_eq!(
        (r["voided"].as_u64(), r["issued"].as_u64()),
        (Some(498), Some(2))
    );
    assert!(r["held"][0]["code"].as_str().unwrap().contains('*'));
    let (status, _, _) = api
        .get("/v1/imports/0123456789abcdef01234567", &admin)
        .await;
    assert_eq!(status, 404);
    api.stop().await;
    env.cleanup().await;
}

/// The RabbitMQ connection pids whose client named them `name` (the
/// `connection_name` client property).
pub(crate) async fn connections_named(name: &str) -> Vec<String> {
    let listed = ["list_connections", "pid", "client_properties", "-q"];
    let out = rabbitmqctl(&[&listed[..], &["--no-table-headers"]].concat()).await;
    out.lines()
        .filter_map(|l| {
            let (pid, props) = l.split_once('\t')?;
            let named = format!("{{\"connection_name\",\"{name}\"}}");
            props.contains(&named).then(|| pid.trim().to_owned())
        })
        .collect()
}

#[tokio::test]
async fn the_api_connects_to_rabbitmq_again_after_losing_its_connection() {
    let env = TestEnv::with_pools("api_reconnect", &[("rc", 10)]).await;
    let (api, shop) = api_with_key(&env, "shop", "orders:write").await;
    let name = format!("codepool-api-{}", api.child.id().unwrap());
    eventually(
        Duration::from_secs(10),
        "the API's connection listed",
        || {
            let name = name.clone();
            async move { connections_named(&name).await.len() == 1 }
        },
    )
    .await;
    let before = connections_named(&name).await;
    rabbitmqctl(&["close_connection", &before[0], "test: broker restarted"]).await;
    eventually(Duration::from_secs(20), "a new connection", || {
        let (name, old) = (name.clone(), before[0].clone());
        async move {
            let now = connections_named(&name).await;
            now.len() == 1 && now[0] != old
        }
    })
    .await;
    eventually(Duration::from_secs(10), "ready again", || {
        let addr = api.addr.clone();
        async move {
            crate::common::http_get(&addr, "/readyz")
                .await
                .is_some_and(|(s, _)| s == 200)
        }
    })
    .await;
    // An order after the outage gets its event from the API itself.
    let (status, _, _) = api.post("/v1/orders", &shop, &order("RC-1", "rc", 1)).await;
    assert_eq!(status, 201);
    let conn = codepool_broker::connect(AMQP_URL, "test").await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    // Published once the answer is out (the answer waits for the claim).
    // RC-1's event.
    wait_depth(&ch, &env.topology().sms_pending, 10, |n| n == 1).await;
    api.stop().await;
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}

#[tokio::test]
async fn with_a_certificate_the_api_serves_https_and_refuses_plain_http() {
    let env = TestEnv::with_pools("api_tls", &[("tls", 3)]).await;
    let shop = key(&env, "shop", "orders:write").await;
    let dir = tempfile::tempdir().unwrap();
    let (cert, private) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    let made = std::process::Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
        ])
        .args(["-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"])
        .arg("-keyout")
        .arg(&private)
        .arg("-out")
        .arg(&cert)
        .output()
        .expect("openssl makes a test certificate");
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let (c, k) = (cert.to_str().unwrap(), private.to_str().unwrap());
    let api = ApiServer::start(&env, &["--tls-cert", c, "--tls-key", k]).await;
    let url = format!("https://{}/v1/orders", api.addr);
    let out = tokio::process::Command::new("curl")
        .args(["-sS", "--cacert", c, "-w", "\n%{http_code}", "-H"])
        .arg(format!("Authorization: Bearer {shop}"))
        .args([
            "-H",
            "Content-Type: application/json",
            "-d",
            &String::from_utf8(order("TLS-1", "tls", 1)).unwrap(),
            &url,
        ])
        .output()
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        text.ends_with("\n201"),
        "{text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("\"code\":\"tls-"), "{text}");
    // Plain HTTP on the TLS port gets no answer, and the server goes on.
    let mut s = tokio::net::TcpStream::connect(&api.addr).await.unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut raw = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(15), s.read_to_end(&mut raw)).await;
    assert!(
        !String::from_utf8_lossy(&raw).contains("200 OK"),
        "plain HTTP served"
    );
    let health = tokio::process::Command::new("curl")
        .args([
            "-sS",
            "--cacert",
            c,
            &format!("https://{}/healthz", api.addr),
        ])
        .output()
        .await
        .unwrap();
    assert!(
        health.status.success(),
        "{}",
        String::from_utf8_lossy(&health.stderr)
    );
    // A key file that is not a key: a clear error before anything starts.
    let out = env
        .run(&[
            "api",
            "--listen",
            "127.0.0.1:0",
            "--tls-cert",
            c,
            "--tls-key",
            c,
        ])
        .await;
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no private key") && err.contains("--tls-key"),
        "{err}"
    );
    api.stop().await;
    env.cleanup().await;
}

/// Sends `head` and then one byte of its body, never the rest; the answer
/// and how long it took, or `None` if the connection is still open after
/// `within`.
async fn stalled(addr: &str, head: &str, within: Duration) -> (Option<RawAnswer>, Duration) {
    let started = Instant::now();
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(b"n").await.unwrap();
    let got = read_answer(&mut s, within).await;
    (got, started.elapsed())
}

/// Whether the server closes `s` within `within` (reading whatever comes).
async fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    let mut sink = Vec::new();
    tokio::time::timeout(within, s.read_to_end(&mut sink))
        .await
        .is_ok()
}

#[tokio::test]
async fn a_slow_console_post_and_a_slow_probe_are_cut_at_the_request_timeout() {
    let env = TestEnv::new("api_slow_post").await;
    let api = ApiServer::start(&env, &["--request-timeout", "2"]).await;
    let head = "POST /console/signin HTTP/1.1\r\nHost: console\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: 100\r\n\r\n";
    let (got, took) = stalled(&api.addr, head, Duration::from_secs(15)).await;
    let got = got.expect("a slow sign-in is answered, not held");
    assert_eq!(got.status, 408, "{}", got.body);
    assert!(took < Duration::from_secs(8), "took {took:?}");
    let head = "GET /healthz HTTP/1.1\r\nHost: api\r\nContent-Length: 100\r\n\r\n";
    let mut s = TcpStream::connect(&api.addr).await.unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(b"n").await.unwrap();
    assert!(
        closed_within(&mut s, Duration::from_secs(8)).await,
        "a probe whose body never ends is closed"
    );
    // The dispatcher's probe port cuts idle and half-sent clients too.
    let mut cmd = env.command(&[]);
    cmd.env("CODEPOOL_HTTP_TIMEOUT", "2");
    let daemon = start_daemon(cmd).await;
    let mut idle = TcpStream::connect(&daemon.addr).await.unwrap();
    let mut half = TcpStream::connect(&daemon.addr).await.unwrap();
    half.write_all(b"GET /metrics HTTP/1.1\r\nHost: d")
        .await
        .unwrap();
    assert!(
        closed_within(&mut idle, Duration::from_secs(8)).await,
        "an idle connection is closed"
    );
    assert!(
        closed_within(&mut half, Duration::from_secs(8)).await,
        "a half-sent head is closed"
    );
    daemon.stop().await;
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn connections_beyond_the_cap_wait_until_one_closes() {
    let env = TestEnv::new("api_cap").await;
    let api = ApiServer::start(&env, &["--max-connections", "2", "--header-timeout", "30"]).await;
    let mut held = [
        TcpStream::connect(&api.addr).await.unwrap(),
        TcpStream::connect(&api.addr).await.unwrap(),
    ];
    // Both are taken by the server, however long that takes: each has
    // answered a request, and stays open.
    for s in &mut held {
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: api\r\n\r\n")
            .await
            .unwrap();
        let answer = read_answer(s, Duration::from_secs(10)).await;
        assert_eq!(answer.map(|a| a.status), Some(200), "a held connection");
    }
    let mut third = TcpStream::connect(&api.addr).await.unwrap();
    third
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: api\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let waited = read_answer(&mut third, Duration::from_millis(1500)).await;
    assert!(
        waited.is_none(),
        "a third connection is not served while two are open: {waited:?}"
    );
    drop(held);
    let got = read_answer(&mut third, Duration::from_secs(10)).await;
    assert_eq!(got.map(|a| a.status), Some(200));
    api.stop().await;
    env.cleanup().await;
}

/// A POST as `curl -X POST URL -H "Authorization: Bearer KEY"` sends it:
/// no body, no `Content-Length`, no `Content-Type`.
fn curl_post(path: &str, key: &str) -> Vec<u8> {
    format!("POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: curl/7.88.1\r\nAccept: */*\r\nAuthorization: Bearer {key}\r\n\r\n").into_bytes()
}

#[tokio::test]
async fn curl_s_bodiless_posts_resend_redeem_pause_and_resume() {
    let env = TestEnv::with_pools("api_curl", &[("cp", 5)]).await;
    let (api, k) = api_with_key(&env, "shop", "orders:write,orders:read,admin").await;
    let (status, _, body) = api.post("/v1/orders", &k, &order("C-1", "cp", 1)).await;
    assert_eq!(status, 201, "{}", String::from_utf8_lossy(&body));
    for path in [
        "/v1/orders/C-1/resend",
        "/v1/orders/C-1/redeem",
        "/v1/pools/cp/pause",
        "/v1/pools/cp/resume",
    ] {
        let a = exchange_from(&api.addr, Ipv4Addr::LOCALHOST, &curl_post(path, &k)).await;
        assert_eq!(a.status, 200, "{path}: {}", a.body);
    }
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn the_bearer_scheme_is_read_in_any_case_and_scopes_are_stored_once() {
    let env = TestEnv::with_pools("api_bearer", &[("bp", 2)]).await;
    let k = key(
        &env,
        "shop",
        "orders:read,orders:write,orders:read,orders:write",
    )
    .await;
    let api = ApiServer::start(&env, &[]).await;
    for scheme in ["bearer", "BEARER", "BeArEr"] {
        let req = format!("GET /v1/orders/none HTTP/1.1\r\nHost: api\r\nConnection: close\r\nAuthorization: {scheme} {k}\r\n\r\n");
        let a = exchange_from(&api.addr, Ipv4Addr::LOCALHOST, req.as_bytes()).await;
        assert_eq!(a.status, 404, "{scheme}: {}", a.body);
    }
    let out = env.run(&["api-keys", "list", "--json"]).await;
    assert!(out.status.success());
    let listed: Value = serde_json::from_slice(&out.stdout).expect("the keys as JSON");
    let scopes = listed[0]["scopes"].clone();
    assert_eq!(
        scopes,
        serde_json::json!(["orders:read", "orders:write"]),
        "{listed}"
    );
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_dead_letter_walk_stops_at_its_bound_and_says_so() {
    let env = TestEnv::new("api_dead_walk").await;
    let (api, admin) = api_with_key(&env, "ops", "admin").await;
    let (conn, publisher) = env.amqp().await;
    let mut pending = Vec::new();
    for i in 0..3000 {
        let reason = if i < 2990 {
            "invalid_json"
        } else {
            "unknown_pool"
        };
        pending.push(
            publisher
                .dead_letter(b"junk", None, reason, 0, None)
                .await
                .unwrap(),
        );
    }
    for p in pending {
        p.wait().await.unwrap();
    }
    let ch = conn.create_channel().await.unwrap();
    let q = env.topology().purchases_dead;
    // 3000 dead letters.
    wait_depth(&ch, &q, 20, |n| n == 3000).await;
    let started = Instant::now();
    let (status, _, body) = api
        .get("/v1/dead-letters?reason=unknown_pool", &admin)
        .await;
    assert_eq!(status, 200);
    let got = json_of(&body);
    assert_eq!(got["scanned"], 1000, "{got}");
    assert_eq!(got["stopped_early"], true, "{got}");
    assert_eq!(
        got["dead_letters"].as_array().map(Vec::len),
        Some(0),
        "{got}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    // Without a filter the limit ends the walk, and nothing is left out.
    let (_, _, body) = api.get("/v1/dead-letters?limit=5", &admin).await;
    let got = json_of(&body);
    assert_eq!(
        (got["scanned"].clone(), got["stopped_early"].clone()),
        (5.into(), false.into()),
        "{got}"
    );
    // Every letter back in the queue.
    wait_depth(&ch, &q, 20, |n| n == 3000).await;
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn answers_that_carry_plaintext_codes_are_never_stored_by_caches() {
    let env = TestEnv::with_pools("api_cache", &[("cc", 5)]).await;
    let (api, k) = api_with_key(&env, "shop", "orders:write,orders:read,codes:reveal").await;
    let placed = api.post("/v1/orders", &k, &order("N-1", "cc", 2)).await;
    let again = api.post("/v1/orders", &k, &order("N-1", "cc", 2)).await;
    let revealed = api.get("/v1/orders/N-1?reveal=true", &k).await;
    let missing = api.get("/v1/orders/nothing", &k).await;
    for (what, (status, headers, _), want) in [
        ("the first answer", placed, 201),
        ("the repeat", again, 200),
        ("the reveal", revealed, 200),
        ("a 404", missing, 404),
    ] {
        assert_eq!(status, want, "{what}");
        assert_eq!(
            headers.get("cache-control").map(String::as_str),
            Some("no-store"),
            "{what}"
        );
    }
    api.stop().await;
    env.cleanup().await;
}

/// What a raw request got: status, content type, body.
struct Got {
    status: u16,
    content_type: String,
    body: Vec<u8>,
}

/// Sends `raw` bytes as they are (a head and maybe a body) and reads the
/// answer until the server closes.
async fn raw(addr: &str, bytes: &[u8]) -> Got {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(bytes).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut out)).await;
    parse(&out)
}

fn parse(out: &[u8]) -> Got {
    let split = out
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or(out.len());
    let head = String::from_utf8_lossy(&out[..split]).into_owned();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let content_type = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-type:")
                .map(|v| v.trim().to_owned())
        })
        .unwrap_or_default();
    Got {
        status,
        content_type,
        body: out.get(split + 4..).unwrap_or_default().to_vec(),
    }
}

/// A request with the usual head: `Connection: close`, the key, the body.
fn request(method: &str, path: &str, key: &str, content_type: &str, body: &[u8]) -> Vec<u8> {
    let mut r = format!(
        "{method} {path} HTTP/1.1\r\nHost: api\r\nConnection: close\r\nAuthorization: Bearer {key}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    r.extend_from_slice(body);
    r
}

/// The head of a 10 MB order and its first 64 KiB: the server refuses it
/// by its length, without reading the rest.
fn ten_megabytes(key: &str) -> Vec<u8> {
    let mut r = format!(
        "POST /v1/orders HTTP/1.1\r\nHost: api\r\nConnection: close\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        10 * 1024 * 1024
    )
    .into_bytes();
    r.extend(std::iter::repeat_n(b'{', 64 * 1024));
    r
}

fn post_order(key: &str, body: &[u8]) -> Vec<u8> {
    request("POST", "/v1/orders", key, "application/json", body)
}

/// Asserts a 4xx problem whose detail says something.
fn assert_problem(what: &str, got: &Got, status: u16) {
    assert_eq!(
        got.status,
        status,
        "{what}: {}",
        String::from_utf8_lossy(&got.body)
    );
    assert_eq!(got.content_type, "application/problem+json", "{what}");
    let p: Value = serde_json::from_slice(&got.body).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(p["status"], status, "{what}");
    assert!(
        p["detail"].as_str().is_some_and(|d| d.len() > 10),
        "{what}: {p}"
    );
    assert!(p["request_id"].is_string(), "{what}: {p}");
}

/// Hostile orders and requests: (what, bytes, the status it must get).
fn cases(k: &str) -> Vec<(&'static str, Vec<u8>, u16)> {
    let ok = |extra: &str| {
        format!(r#"{{"order_id":"H-1","uid":"u","phone":"+8613800000000","pool":"hp"{extra}}}"#)
    };
    let long = "x".repeat(5000);
    let mut non_utf8 = br#"{"order_id":"H-2","uid":""#.to_vec();
    non_utf8.extend_from_slice(&[0xff, 0xfe, 0xc0]);
    non_utf8.extend_from_slice(br#"","phone":"+8613800000000","pool":"hp"}"#);
    let deep = format!("{}{}", "[".repeat(5000), "]".repeat(5000));
    vec![
        ("a wrong content type", request("POST", "/v1/orders", k, "text/plain", ok("").as_bytes()), 415),
        ("a form body", request("POST", "/v1/orders", k, "application/x-www-form-urlencoded", b"order_id=1"), 415),
        ("a 10 MB body", ten_megabytes(k), 413),
        ("duplicate JSON keys", post_order(k, br#"{"order_id":"a","order_id":"b","uid":"u","phone":"+8613800000000","pool":"hp"}"#), 422),
        ("{\"$ne\": …} as an id", post_order(k, br#"{"order_id":{"$ne":null},"uid":"u","phone":"+8613800000000","pool":"hp"}"#), 422),
        ("{\"$gt\": …} as a pool", post_order(k, br#"{"order_id":"H-3","uid":"u","phone":"+8613800000000","pool":{"$gt":""}}"#), 422),
        ("an overlong order id", post_order(k, format!(r#"{{"order_id":"{long}","uid":"u","phone":"+8613800000000","pool":"hp"}}"#).as_bytes()), 422),
        ("an overlong uid", post_order(k, format!(r#"{{"order_id":"H-4","uid":"{long}","phone":"+8613800000000","pool":"hp"}}"#).as_bytes()), 422),
        ("non-UTF-8 bytes in a field", post_order(k, &non_utf8), 422),
        ("a NUL in an id", post_order(k, br#"{"order_id":"H\u0000-5","uid":"u","phone":"+8613800000000","pool":"hp"}"#), 422),
        ("a right-to-left override in an id", post_order(k, "{\"order_id\":\"H-\u{202e}6\",\"uid\":\"u\",\"phone\":\"+8613800000000\",\"pool\":\"hp\"}".as_bytes()), 422),
        ("a quantity as a string", post_order(k, ok(r#","quantity":"2""#).as_bytes()), 422),
        ("a fractional quantity", post_order(k, ok(r#","quantity":2.5"#).as_bytes()), 422),
        ("a negative quantity", post_order(k, ok(r#","quantity":-1"#).as_bytes()), 422),
        ("a quantity of 1e400", post_order(k, ok(r#","quantity":1e400"#).as_bytes()), 422),
        ("a quantity over the maximum", post_order(k, ok(r#","quantity":101"#).as_bytes()), 422),
        ("a phone that is not one", post_order(k, br#"{"order_id":"H-7","uid":"u","phone":"+86 ' OR 1=1","pool":"hp"}"#), 422),
        ("path traversal as a pool", post_order(k, br#"{"order_id":"H-8","uid":"u","phone":"+8613800000000","pool":"../../etc"}"#), 422),
        ("an array body", post_order(k, b"[]"), 422),
        ("null", post_order(k, b"null"), 422),
        ("an empty body", post_order(k, b""), 422),
        ("JSON nested 5,000 deep", post_order(k, deep.as_bytes()), 422),
        ("not JSON at all", post_order(k, b"\x00\x01\x02binary"), 422),
        ("path traversal in an id", request("GET", "/v1/orders/..%2F..%2Fetc%2Fpasswd", k, "application/json", b""), 404),
        ("a dot-dot path", request("GET", "/v1/../../etc/passwd", k, "application/json", b""), 404),
        ("a bad percent escape in an id", request("GET", "/v1/orders/%ZZ%C0", k, "application/json", b""), 400),
        ("an unknown route", request("GET", "/v1/orders-and-more", k, "application/json", b""), 404),
        ("a method the route does not take", request("DELETE", "/v1/orders", k, "application/json", b""), 405),
        ("a key in the wrong scheme", request("POST", "/v1/orders", "x", "application/json", b"{}").replace_auth("Basic dXNlcjpwYXNz"), 401),
        ("a forged key", post_order("cpk_0000000000000000_ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff", ok("").as_bytes()), 401),
        ("a key of garbage", post_order("cpk_'--;DROP TABLE", ok("").as_bytes()), 401),
        ("a query that does not parse", request("GET", "/v1/orders/H-1?reveal=maybe", k, "application/json", b""), 400),
        ("a void without a reason", request("POST", "/v1/orders/H-1/void", k, "application/json", b"{}"), 422),
        ("an unknown pool", post_order(k, br#"{"order_id":"H-9","uid":"u","phone":"+8613800000000","pool":"nowhere"}"#), 422),
    ]
}

trait ReplaceAuth {
    fn replace_auth(self, with: &str) -> Vec<u8>;
}

impl ReplaceAuth for Vec<u8> {
    fn replace_auth(self, with: &str) -> Vec<u8> {
        String::from_utf8(self)
            .unwrap()
            .replace("Bearer x", with)
            .into_bytes()
    }
}

#[tokio::test]
async fn hostile_requests_get_their_problem_and_the_api_keeps_serving() {
    let env = TestEnv::with_pools("api_hostile_requests", &[("hp", 5)]).await;
    let k = key(&env, "shop", "orders:write,orders:read").await;
    let api = ApiServer::start(
        &env,
        &["--rate-per-key", "100000", "--request-timeout", "3"],
    )
    .await;
    let all = cases(&k);
    assert!(all.len() >= 30, "{} hostile requests", all.len());
    for (what, bytes, status) in &all {
        let got = raw(&api.addr, bytes).await;
        assert_problem(what, &got, *status);
        let alive = http_get(&api.addr, "/healthz").await;
        assert_eq!(
            alive.map(|(s, _)| s),
            Some(200),
            "still serving after {what}"
        );
    }
    // A huge header: 431, as a problem.
    let mut big = format!("GET /v1/orders/H-1 HTTP/1.1\r\nHost: api\r\nConnection: close\r\nAuthorization: Bearer {k}\r\nX-Junk: ").into_bytes();
    big.extend(std::iter::repeat_n(b'a', 64 * 1024));
    big.extend_from_slice(b"\r\n\r\n");
    assert_problem("a huge header", &raw(&api.addr, &big).await, 431);
    // A slow body: the request times out with 408, the server goes on.
    let mut s = tokio::net::TcpStream::connect(&api.addr).await.unwrap();
    let head = format!("POST /v1/orders HTTP/1.1\r\nHost: api\r\nConnection: close\r\nAuthorization: Bearer {k}\r\nContent-Type: application/json\r\nContent-Length: 200\r\n\r\n{{\"order_id\":");
    s.write_all(head.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut out)).await;
    assert_problem("a slow body", &parse(&out), 408);
    // Nothing panicked, nothing answered 500.
    let (status, metrics) = http_get(&api.addr, "/metrics").await.unwrap();
    assert_eq!(status, 200);
    assert!(!metrics.contains("status=\"500\""), "{metrics}");
    api.stop().await;
    env.cleanup().await;
}

/// An upload is imported while it is still arriving: the first rows are in
/// the pool before the client has sent the rest, so the body is streamed
/// through the importer, never held whole.
#[tokio::test]
async fn an_upload_is_imported_while_it_is_still_arriving() {
    let env = TestEnv::new("api_upload_stream").await;
    let (api, k) = api_with_key(&env, "ops", "admin").await;
    let rows = |range: std::ops::Range<u32>| -> String {
        range.map(|i| format!("ST-{i:07}-WXYZ\n")).collect()
    };
    let (first, rest) = (format!("code\n{}", rows(0..5_000)), rows(5_000..20_000));
    let total = first.len() + rest.len();
    let mut s = tokio::net::TcpStream::connect(&api.addr).await.unwrap();
    let head = format!("POST /v1/pools/st/imports?file=big.csv HTTP/1.1\r\nHost: api\r\nConnection: close\r\nAuthorization: Bearer {k}\r\nContent-Type: text/csv\r\nContent-Length: {total}\r\n\r\n");
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(first.as_bytes()).await.unwrap();
    // The request is open, three quarters of its body unsent: codes of the
    // first part must already be in the pool.
    crate::common::eventually(
        Duration::from_secs(30),
        "the first rows imported mid-upload",
        || {
            let codes = env.coll("codes");
            async move {
                codes
                    .count_documents(bson::doc! {"pool": "st"})
                    .await
                    .unwrap()
                    >= 1_000
            }
        },
    )
    .await;
    let mid = count_codes(&env, bson::doc! {"pool": "st"}).await;
    assert!(
        mid < 20_000,
        "not everything before the rest was sent: {mid}"
    );
    s.write_all(rest.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(60), s.read_to_end(&mut out))
        .await
        .unwrap()
        .unwrap();
    let got = parse(&out);
    assert_eq!(got.status, 201, "{}", String::from_utf8_lossy(&got.body));
    let summary: Value = serde_json::from_slice(&got.body).unwrap();
    assert_eq!(summary["inserted"], 20_000);
    api.stop().await;
    env.cleanup().await;
}

/// An order's codes go back only to the key that placed it: another key
/// posting the same order gets 409 and no code, and cannot void, redeem or
/// resend it; an order that came over AMQP is nobody's to repeat over
/// HTTP. The owner's own repeat is answered, and audited.
#[tokio::test]
async fn a_repeat_answers_codes_only_to_the_key_that_placed_the_order_and_is_audited() {
    let env = TestEnv::with_pools("api_owner", &[("own", 10)]).await;
    let a = key(&env, "shop-a", "orders:write,orders:read").await;
    let b = key(&env, "shop-b", "orders:write,orders:read").await;
    let (api, admin) = api_with_key(&env, "ops", "orders:write,orders:read,admin").await;
    let (status, _, body) = api.post("/v1/orders", &a, &order("O-1", "own", 2)).await;
    assert_eq!(status, 201, "{}", String::from_utf8_lossy(&body));
    let codes: Vec<String> = json_of(&body)["codes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["code"].as_str().unwrap().to_owned())
        .collect();
    let leaks = |body: &[u8]| {
        codes
            .iter()
            .any(|c| String::from_utf8_lossy(body).contains(c.as_str()))
    };

    let (status, _, body) = api.post("/v1/orders", &b, &order("O-1", "own", 2)).await;
    assert_eq!(status, 409, "{}", String::from_utf8_lossy(&body));
    assert!(json_of(&body)["type"]
        .as_str()
        .unwrap()
        .ends_with("conflicting-order"));
    assert!(!leaks(&body), "another key's repeat shows no code");
    for action in ["void", "redeem", "resend"] {
        let (status, _, body) = api
            .post(
                &format!("/v1/orders/O-1/{action}"),
                &b,
                br#"{"reason":"refund"}"#,
            )
            .await;
        assert_eq!(
            status,
            404,
            "{action} by another key: {}",
            String::from_utf8_lossy(&body)
        );
    }
    assert_eq!(
        order_statuses(&env, "O-1").await,
        vec![1, 1],
        "nothing changed"
    );

    let (status, _, body) = api.post("/v1/orders", &a, &order("O-1", "own", 2)).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert!(leaks(&body), "the owner's repeat gets its codes");
    let audited = env.coll("audit")
        .find_one(bson::doc! {"os_user": "api-key:shop-a", "command": {"$regex": "^POST /v1/orders, a repeat"}})
        .await
        .unwrap()
        .expect("the repeat is audited");
    assert_eq!(audited.get_i64("count").unwrap(), 2);

    // An order that came over AMQP is nobody's to repeat over HTTP.
    let daemon = start_daemon(env.command(&[])).await;
    let (_conn, publisher) = env.amqp().await;
    let mut amqp = purchase("AM-1", "own");
    amqp.uid = "u-api".into();
    publish_confirmed(&publisher, &[amqp]).await;
    eventually(Duration::from_secs(30), "AM-1 granted", || async {
        order_statuses(&env, "AM-1").await == vec![1]
    })
    .await;
    let (status, _, body) = api.post("/v1/orders", &a, &order("AM-1", "own", 1)).await;
    assert_eq!(status, 409, "{}", String::from_utf8_lossy(&body));
    assert!(
        !String::from_utf8_lossy(&body).contains("own-0"),
        "no code in the answer"
    );
    // A key with the admin scope acts on any order.
    let (status, _, _) = api
        .post("/v1/orders/O-1/void", &admin, br#"{"reason":"refund"}"#)
        .await;
    assert_eq!(status, 200);
    daemon.stop().await;
    api.stop().await;
    env.cleanup().await;
}

/// `NF-café` sent composed and then decomposed is one order: the second
/// post is a repeat with the same code, not a second grant.
#[tokio::test]
async fn an_order_id_sent_composed_and_decomposed_is_one_order() {
    let env = TestEnv::with_pools("api_nfc", &[("nf", 5)]).await;
    let (api, shop) = api_with_key(&env, "shop", "orders:write").await;
    let body = |id: &str| {
        serde_json::json!({"order_id": id, "uid": "b\u{e9}a", "phone": "+8613800000000", "pool": "nf"})
            .to_string()
            .into_bytes()
    };
    let (s1, _, b1) = api.post("/v1/orders", &shop, &body("NF-caf\u{e9}")).await;
    let (s2, _, b2) = api.post("/v1/orders", &shop, &body("NF-cafe\u{301}")).await;
    assert_eq!((s1, s2), (201, 200), "{}", String::from_utf8_lossy(&b2));
    assert_eq!(json_of(&b1)["codes"], json_of(&b2)["codes"]);
    assert_eq!(order_statuses(&env, "NF-caf\u{e9}").await, vec![1]);
    api.stop().await;
    env.cleanup().await;
}

/// An upload sent gzip-compressed with `Content-Encoding: gzip` is read
/// through a decoder; another encoding is refused with 415.
#[tokio::test]
async fn a_gzip_upload_with_its_content_encoding_is_imported() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let env = TestEnv::new("api_gzip").await;
    let (api, admin) = api_with_key(&env, "ops", "admin").await;
    let csv: String = "code\n".to_owned()
        + &(0..300)
            .map(|i| format!("GZ-{i:05}-AB\n"))
            .collect::<String>();
    let mut gz = std::process::Command::new("gzip")
        .arg("-c")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("gzip");
    {
        use std::io::Write;
        gz.stdin.take().unwrap().write_all(csv.as_bytes()).unwrap();
    }
    let body = gz.wait_with_output().unwrap().stdout;
    let send = |encoding: &'static str| {
        let (addr, admin, body) = (api.addr.clone(), admin.clone(), body.clone());
        async move {
            let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
            let head = format!(
                "POST /v1/pools/gz/imports?file=codes.csv.gz HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer {admin}\r\nContent-Type: text/csv\r\nContent-Encoding: {encoding}\r\nContent-Length: {}\r\n\r\n",
                body.len()
            );
            s.write_all(head.as_bytes()).await.unwrap();
            s.write_all(&body).await.unwrap();
            let mut raw = Vec::new();
            s.read_to_end(&mut raw).await.unwrap();
            let Some(split) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
                return (0, raw);
            };
            let status: u16 = String::from_utf8_lossy(&raw[9..12]).parse().unwrap();
            (status, raw[split + 4..].to_vec())
        }
    };
    let (status, body) = send("br").await;
    assert_eq!(
        status,
        415,
        "{} {}",
        String::from_utf8_lossy(&body),
        api.log_text()
    );
    let (status, body) = send("gzip").await;
    assert_eq!(
        status,
        201,
        "{} {}",
        String::from_utf8_lossy(&body),
        api.log_text()
    );
    assert_eq!(json_of(&body)["inserted"], 300);
    api.stop().await;
    env.cleanup().await;
}
