//! The HTTP API against the real servers, through a real `codepool api`
//! process: keys and scopes, idempotent orders that share the dispatcher's
//! core and events, problems that name the field, limits.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use codepool_broker::Publisher;
use codepool_domain::SmsPending;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};

use crate::common::{drain, eventually, purchase, queue_depth, start_daemon, TestEnv, AMQP_URL};

/// A `codepool api` child process with its address.
pub(crate) struct ApiServer {
    pub(crate) child: tokio::process::Child,
    pub(crate) addr: String,
    log: Arc<std::sync::Mutex<Vec<String>>>,
}

impl ApiServer {
    pub(crate) async fn start(env: &TestEnv, extra: &[&str]) -> Self {
        let mut args = vec!["api", "--listen", "127.0.0.1:0"];
        args.extend_from_slice(extra);
        let mut child = env
            .command(&args)
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
) -> (u16, HashMap<String, String>, Vec<u8>) {
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
) -> (u16, HashMap<String, String>, Vec<u8>) {
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
    let out = env
        .command(&["api-keys", "create", "--name", name, "--scopes", scopes])
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

pub(crate) fn order(id: &str, pool: &str, quantity: u32) -> Vec<u8> {
    json!({"order_id": id, "uid": "u-api", "phone": "+8613800000000", "pool": pool, "quantity": quantity})
        .to_string()
        .into_bytes()
}

#[tokio::test]
async fn an_order_placed_twice_over_http_and_once_over_amqp_gets_its_codes_once() {
    let env = TestEnv::new("api_orders").await;
    env.fill_pool("web", 20).await;
    let shop = key(&env, "shop", "orders:write,orders:read").await;
    let api = ApiServer::start(&env, &[]).await;

    let (status, headers, body) = http(
        &api.addr,
        "POST",
        "/v1/orders",
        Some(&shop),
        &order("W-1", "web", 3),
    )
    .await;
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
    let (status, _, body) = http(
        &api.addr,
        "POST",
        "/v1/orders",
        Some(&shop),
        &order("W-1", "web", 3),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(json_of(&body)["codes"], first["codes"]);
    // The same order id with another quantity: a conflict, nothing granted.
    let (status, headers, body) = http(
        &api.addr,
        "POST",
        "/v1/orders",
        Some(&shop),
        &order("W-1", "web", 4),
    )
    .await;
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
    let conn = codepool_broker::connect(AMQP_URL, "test").await.unwrap();
    let publisher = Publisher::new(&conn, env.topology()).await.unwrap();
    let mut p = purchase("W-1", "web");
    p.uid = "u-api".into();
    p.quantity = 3;
    publisher
        .publish_purchase(&p)
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    let t = env.topology();
    eventually(Duration::from_secs(30), "the AMQP delivery settled", || {
        let (ch, q) = (ch.clone(), t.sms_pending.clone());
        async move { queue_depth(&ch, &q).await >= 2 }
    })
    .await;
    d.stop().await;
    let issued = env
        .store
        .database()
        .collection::<bson::Document>("codes")
        .count_documents(bson::doc! {"order_id": "W-1"})
        .await
        .unwrap();
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
    let (status, _, body) = http(&api.addr, "GET", "/v1/orders/W-1", Some(&shop), b"").await;
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
    let env = TestEnv::new("api_keys").await;
    env.fill_pool("web", 5).await;
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
    let (status, _, _) = http(
        &api.addr,
        "GET",
        "/v1/orders/K-1?reveal=true",
        Some(&reader),
        b"",
    )
    .await;
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
    let out = env
        .command(&["api-keys", "revoke", "--name", "reader"])
        .output()
        .await
        .unwrap();
    assert!(out.status.success());
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let (status, _, _) = http(&api.addr, "GET", "/v1/orders/K-1", Some(&reader), b"").await;
    assert_eq!(status, 401);
    // Only the hash is stored.
    let stored = env
        .store
        .database()
        .collection::<bson::Document>("api_keys")
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
    let env = TestEnv::new("api_waiting").await;
    env.fill_pool("few", 1).await;
    let shop = key(&env, "shop", "orders:write,orders:read,codes:reveal").await;
    let api = ApiServer::start(&env, &[]).await;
    let (status, _, body) = http(
        &api.addr,
        "POST",
        "/v1/orders",
        Some(&shop),
        &order("E-1", "few", 3),
    )
    .await;
    assert_eq!(status, 202, "{}", String::from_utf8_lossy(&body));
    let b = json_of(&body);
    assert_eq!(b["state"], "partly_granted");
    assert_eq!(b["waiting_lines"], json!([1, 2]));
    let (status, _, body) = http(
        &api.addr,
        "POST",
        "/v1/orders",
        Some(&shop),
        &order("E-2", "few", 1),
    )
    .await;
    assert_eq!(status, 202);
    assert_eq!(json_of(&body)["state"], "waiting");

    let (status, _, body) = http(
        &api.addr,
        "GET",
        "/v1/orders/E-1?reveal=true",
        Some(&shop),
        b"",
    )
    .await;
    assert_eq!(status, 200);
    let read = json_of(&body);
    assert_eq!(read["codes"][0]["code"], "few-000001");
    assert_eq!(read["waiting_lines"], json!([1, 2]));
    let audit = env
        .store
        .database()
        .collection::<bson::Document>("audit")
        .find_one(bson::doc! {"os_user": "api-key:shop"})
        .await
        .unwrap()
        .expect("the reveal is audited with the key's name");
    assert_eq!(audit.get_str("what").unwrap(), "order \"E-1\"");

    // Void with a reason: its code and what it waits for.
    let (status, _, _) = http(&api.addr, "POST", "/v1/orders/E-1/void", Some(&shop), b"{}").await;
    assert_eq!(status, 422);
    let (status, _, body) = http(
        &api.addr,
        "POST",
        "/v1/orders/E-1/void",
        Some(&shop),
        br#"{"reason":"refund"}"#,
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let v = json_of(&body);
    assert_eq!(
        (v["voided"].as_u64(), v["backorder_cancelled"].as_bool()),
        (Some(1), Some(true))
    );
    let (status, _, _) = http(&api.addr, "GET", "/v1/orders/NOPE", Some(&shop), b"").await;
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
    let shop = key(&env, "shop", "orders:write,orders:read").await;
    let api = ApiServer::start(&env, &[]).await;
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
    let env = TestEnv::new("api_dead").await;
    env.fill_pool("known", 5).await;
    let admin = key(&env, "ops", "admin").await;
    let d = start_daemon(env.command(&[])).await;
    let api = ApiServer::start(&env, &[]).await;
    let conn = codepool_broker::connect(AMQP_URL, "test").await.unwrap();
    let publisher = Publisher::new(&conn, env.topology()).await.unwrap();
    publisher
        .publish_purchase(&purchase("DL-1", "later"))
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    publisher
        .publish_purchase_bytes(b"garbage", Some("DL-2"))
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    let t = env.topology();
    eventually(Duration::from_secs(20), "two dead letters", || {
        let (ch, q) = (ch.clone(), t.purchases_dead.clone());
        async move { queue_depth(&ch, &q).await == 2 }
    })
    .await;
    let (status, _, body) = http(
        &api.addr,
        "GET",
        "/v1/dead-letters?reason=unknown_pool",
        Some(&admin),
        b"",
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let listed = json_of(&body);
    assert_eq!(listed["dead_letters"].as_array().unwrap().len(), 1);
    assert_eq!(listed["dead_letters"][0]["message_id"], "DL-1");
    eventually(Duration::from_secs(5), "the listing took nothing", || {
        let (ch, q) = (ch.clone(), t.purchases_dead.clone());
        async move { queue_depth(&ch, &q).await == 2 }
    })
    .await;

    // Fix the cause, replay that reason only: DL-1 gets a code, DL-2 stays.
    env.fill_pool("later", 2).await;
    let (status, _, body) = http(
        &api.addr,
        "POST",
        "/v1/dead-letters/replay",
        Some(&admin),
        br#"{"reason":"unknown_pool"}"#,
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(json_of(&body)["replayed"], 1);
    eventually(Duration::from_secs(20), "DL-1 granted", || {
        let codes = env.store.database().collection::<bson::Document>("codes");
        async move {
            codes
                .count_documents(bson::doc! {"order_id": "DL-1"})
                .await
                .unwrap()
                == 1
        }
    })
    .await;
    let (_, _, body) = http(&api.addr, "GET", "/v1/dead-letters", Some(&admin), b"").await;
    let left = json_of(&body);
    assert_eq!(left["dead_letters"].as_array().unwrap().len(), 1);
    assert_eq!(left["dead_letters"][0]["message_id"], "DL-2");
    let (status, _, _) = http(
        &api.addr,
        "GET",
        "/v1/dead-letters?limit=0",
        Some(&admin),
        b"",
    )
    .await;
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
    let shop = key(&env, "shop", "orders:write").await;
    let api = ApiServer::start(&env, &[]).await;
    let mut csv = String::from("code,expires_at\n");
    for i in 0..500 {
        csv.push_str(&format!("UP-{i:05}-ABCD,\n"));
    }
    csv.push_str("bad code with spaces and \u{200b},\n");
    let path = "/v1/pools/up/imports?file=partner-1.csv";
    let (status, _, body) = http_as(
        &api.addr,
        "POST",
        path,
        Some(&admin),
        "text/csv",
        csv.as_bytes(),
    )
    .await;
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
    let (status, _, body) = http_as(
        &api.addr,
        "POST",
        path,
        Some(&admin),
        "text/csv",
        csv.as_bytes(),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(json_of(&body)["duplicates"], 500);
    // A file whose header does not name the code column: nothing imported.
    let (status, _, body) = http_as(
        &api.addr,
        "POST",
        "/v1/pools/up/imports",
        Some(&admin),
        "text/csv",
        b"serial\nX-1\n",
    )
    .await;
    assert_eq!(status, 422, "{}", String::from_utf8_lossy(&body));
    let (status, _, _) = http_as(
        &api.addr,
        "POST",
        "/v1/pools/up/imports",
        Some(&shop),
        "text/csv",
        csv.as_bytes(),
    )
    .await;
    assert_eq!(status, 403);

    // Orders take two codes; the recall voids the rest and lists those two.
    let (status, _, _) = http(
        &api.addr,
        "POST",
        "/v1/orders",
        Some(&shop),
        &order("UP-O", "up", 2),
    )
    .await;
    assert_eq!(status, 201);
    let (status, _, body) = http(
        &api.addr,
        "GET",
        &format!("/v1/imports/{id}"),
        Some(&admin),
        b"",
    )
    .await;
    assert_eq!(status, 200);
    let record = json_of(&body);
    assert_eq!(
        (record["status"].as_str(), record["file"].as_str()),
        (Some("done"), Some("partner-1.csv"))
    );
    let (status, _, body) = http(
        &api.addr,
        "POST",
        &format!("/v1/imports/{id}/recall"),
        Some(&admin),
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
    let (status, _, _) = http(
        &api.addr,
        "GET",
        "/v1/imports/0123456789abcdef01234567",
        Some(&admin),
        b"",
    )
    .await;
    assert_eq!(status, 404);
    api.stop().await;
    env.cleanup().await;
}

/// The RabbitMQ connection pids whose client named them `name` (the
/// `connection_name` client property).
pub(crate) async fn connections_named(name: &str) -> Vec<String> {
    let out = tokio::process::Command::new("rabbitmqctl")
        .args([
            "list_connections",
            "pid",
            "client_properties",
            "-q",
            "--no-table-headers",
        ])
        .current_dir("/")
        .output()
        .await
        .expect("rabbitmqctl (make services installs it)");
    assert!(
        out.status.success(),
        "rabbitmqctl list_connections: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let (pid, props) = l.split_once('\t')?;
            let named = format!("{{\"connection_name\",\"{name}\"}}");
            props.contains(&named).then(|| pid.trim().to_owned())
        })
        .collect()
}

#[tokio::test]
async fn the_api_connects_to_rabbitmq_again_after_losing_its_connection() {
    let env = TestEnv::new("api_reconnect").await;
    env.fill_pool("rc", 10).await;
    let shop = key(&env, "shop", "orders:write").await;
    let api = ApiServer::start(&env, &[]).await;
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
    let out = tokio::process::Command::new("rabbitmqctl")
        .args(["close_connection", &before[0], "test: broker restarted"])
        .current_dir("/")
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
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
    let (status, _, _) = http(
        &api.addr,
        "POST",
        "/v1/orders",
        Some(&shop),
        &order("RC-1", "rc", 1),
    )
    .await;
    assert_eq!(status, 201);
    let conn = codepool_broker::connect(AMQP_URL, "test").await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    // Published once the answer is out (the answer waits for the claim).
    eventually(Duration::from_secs(10), "RC-1's event", || {
        let (ch, q) = (ch.clone(), env.topology().sms_pending.clone());
        async move { queue_depth(&ch, &q).await == 1 }
    })
    .await;
    api.stop().await;
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}

#[tokio::test]
async fn with_a_certificate_the_api_serves_https_and_refuses_plain_http() {
    let env = TestEnv::new("api_tls").await;
    env.fill_pool("tls", 3).await;
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
        .command(&[
            "api",
            "--listen",
            "127.0.0.1:0",
            "--tls-cert",
            c,
            "--tls-key",
            c,
        ])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no private key") && err.contains("--tls-key"),
        "{err}"
    );
    api.stop().await;
    env.cleanup().await;
}
