//! Webhooks to the Standard Webhooks specification, against real servers
//! and a real receiver: signed deliveries checked with the official
//! `standardwebhooks` Python package, retries with the same `webhook-id`,
//! a process killed mid-delivery, backorders told when they are granted,
//! secret rotation, refused addresses, 410 and leases between processes,
//! and a replay that sends events older than the endpoint only when asked
//! to, audited as a reveal.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, StatusCode};
use bson::doc;
use serde_json::{json, Value};

use crate::api::{http, json_of, ApiServer};
use crate::common::*;
use crate::fixtures::*;

/// One request the receiver got.
#[derive(Debug, Clone)]
pub(crate) struct Hit {
    pub(crate) id: String,
    timestamp: String,
    signature: String,
    pub(crate) body: String,
    pub(crate) at: Instant,
}

impl Hit {
    pub(crate) fn json(&self) -> Value {
        serde_json::from_str(&self.body).expect("a webhook body is JSON")
    }
}

/// How the receiver answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Answer {
    Ok,
    /// 500 to the first request of each `webhook-id`, 200 after.
    FailFirst,
    Status(u16),
    /// Holds the first request of each id this long, then 200.
    HangFirst(Duration),
    /// Holds every request this long, then 200.
    Slow(Duration),
}

#[derive(Default)]
struct Seen {
    hits: Vec<Hit>,
    /// Requests of each id in flight now, and the most ever at once.
    in_flight: HashMap<String, usize>,
    overlap: usize,
    /// Requests in flight now, of any id, and the most ever at once.
    open: usize,
    most_open: usize,
}

/// A webhook receiver on 127.0.0.1 that records every request.
pub(crate) struct Receiver {
    addr: SocketAddr,
    seen: Arc<Mutex<Seen>>,
    answer: Arc<Mutex<Answer>>,
}

impl Receiver {
    pub(crate) async fn start(answer: Answer) -> Self {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let answer = Arc::new(Mutex::new(answer));
        let (s, a) = (seen.clone(), answer.clone());
        let app = axum::Router::new().route(
            "/hooks",
            axum::routing::post(move |headers: HeaderMap, body: String| {
                let (seen, answer) = (s.clone(), a.clone());
                async move { receive(&seen, &answer, &headers, body).await }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        Self { addr, seen, answer }
    }

    pub(crate) fn url(&self) -> String {
        format!("http://{}/hooks", self.addr)
    }

    pub(crate) fn hits(&self) -> Vec<Hit> {
        self.seen.lock().unwrap().hits.clone()
    }

    pub(crate) fn of_type(&self, kind: &str) -> Vec<Hit> {
        (self.hits().into_iter())
            .filter(|h| h.json()["type"] == kind)
            .collect()
    }

    /// Every body received matches docs/schemas/webhook-event.schema.json.
    fn assert_schema(&self) {
        let schema = crate::schemas::Schema::load("webhook-event");
        for h in self.hits() {
            schema.assert_valid(h.body.as_bytes(), "a webhook body");
        }
    }

    fn set(&self, answer: Answer) {
        *self.answer.lock().unwrap() = answer;
    }

    /// The most requests it ever held at once.
    pub(crate) fn most_at_once(&self) -> usize {
        self.seen.lock().unwrap().most_open
    }
}

async fn receive(
    seen: &Mutex<Seen>,
    answer: &Mutex<Answer>,
    headers: &HeaderMap,
    body: String,
) -> StatusCode {
    let header = |k: &str| {
        (headers.get(k))
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    };
    let hit = Hit {
        id: header("webhook-id"),
        timestamp: header("webhook-timestamp"),
        signature: header("webhook-signature"),
        body,
        at: Instant::now(),
    };
    let (first, answer) = {
        let mut s = seen.lock().unwrap();
        let first = !s.hits.iter().any(|h| h.id == hit.id);
        s.hits.push(hit.clone());
        let n = s.in_flight.entry(hit.id.clone()).or_default();
        *n += 1;
        let n = *n;
        s.overlap = s.overlap.max(n);
        s.open += 1;
        s.most_open = s.most_open.max(s.open);
        (first, *answer.lock().unwrap())
    };
    let status = match answer {
        Answer::Ok => 200,
        Answer::FailFirst => {
            if first {
                500
            } else {
                200
            }
        }
        Answer::Status(s) => s,
        Answer::HangFirst(d) => {
            if first {
                tokio::time::sleep(d).await;
            }
            200
        }
        Answer::Slow(d) => {
            tokio::time::sleep(d).await;
            200
        }
    };
    let mut s = seen.lock().unwrap();
    *s.in_flight.get_mut(&hit.id).unwrap() -= 1;
    s.open -= 1;
    drop(s);
    StatusCode::from_u16(status).unwrap()
}

/// Checks a delivery with the official `standardwebhooks` package (PyPI),
/// as a receiver would. Returns the package's verdict.
pub(crate) async fn verified_by_the_python_library(secret: &str, hit: &Hit) -> Result<(), String> {
    let script = r#"
import json, sys
from standardwebhooks.webhooks import Webhook
req = json.load(sys.stdin)
Webhook(req["secret"]).verify(req["body"], req["headers"])
print("verified")
"#;
    let input = serde_json::json!({
        "secret": secret,
        "body": hit.body,
        "headers": {"webhook-id": hit.id, "webhook-timestamp": hit.timestamp, "webhook-signature": hit.signature},
    });
    let out = with_stdin(&mut python(script, &[]), input.to_string().as_bytes()).await;
    if out.status.success() && String::from_utf8_lossy(&out.stdout).contains("verified") {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// Checks a delivery with the `standardwebhooks` crate, as a Rust receiver
/// would (docs/webhooks.md).
fn verified_by_the_rust_library(secret: &str, hit: &Hit) -> Result<(), String> {
    let mut headers = axum::http::HeaderMap::new();
    for (k, v) in [
        ("webhook-id", &hit.id),
        ("webhook-timestamp", &hit.timestamp),
        ("webhook-signature", &hit.signature),
    ] {
        headers.insert(k, v.parse().unwrap());
    }
    let wh = standardwebhooks::Webhook::new(secret).map_err(|e| e.to_string())?;
    wh.verify(hit.body.as_bytes(), &headers)
        .map_err(|e| e.to_string())
}

/// Adds an endpoint for `shop`; returns its id and secret.
pub(crate) async fn add_endpoint(
    env: &TestEnv,
    shop: &str,
    url: &str,
    events: &str,
) -> (String, String) {
    let out = codepool_ok(
        env,
        &[
            "webhooks", "add", "--shop", shop, "--url", url, "--events", events, "--json",
        ],
    )
    .await;
    let v: Value = serde_json::from_str(&out).unwrap();
    let secret = v["secret"].as_str().unwrap().to_owned();
    assert!(secret.starts_with("whsec_"), "{out}");
    (v["id"].as_str().unwrap().to_owned(), secret)
}

pub(crate) fn shop_purchase(order: &str, pool: &str, shop: &str) -> codepool_domain::Purchase {
    let mut p = purchase(order, pool);
    p.shop = Some(shop.to_owned());
    p
}

pub(crate) async fn publisher(env: &TestEnv) -> (lapin::Connection, codepool_broker::Publisher) {
    let conn = codepool_broker::connect(AMQP_URL, "webhooks-test")
        .await
        .unwrap();
    let publisher = codepool_broker::Publisher::new(&conn, env.topology())
        .await
        .unwrap()
        .as_user("guest");
    env.topology().declare(publisher.channel()).await.unwrap();
    (conn, publisher)
}

/// The plaintext code an order holds in the database.
async fn code_of(env: &TestEnv, order: &str) -> String {
    let d = env
        .coll("codes")
        .find_one(bson::doc! {"order_id": order})
        .await
        .unwrap()
        .expect("the order holds a code");
    env.plain_code(&d)
}

#[tokio::test]
async fn an_amqp_order_is_told_by_a_signed_webhook_and_its_retry_keeps_the_id() {
    let env = TestEnv::with_pools("wh_retry", &[("wg", 10)]).await;
    shop(&env, "acme", "wg").await;
    let receiver = Receiver::start(Answer::FailFirst).await;
    let (endpoint, secret) =
        add_endpoint(&env, "acme", &receiver.url(), "order.granted,order.voided").await;
    let daemon = start_daemon(env.command(&[])).await;
    let (conn, publisher) = publisher(&env).await;
    publish_confirmed(
        &publisher,
        &[
            shop_purchase("WH-1", "wg", "acme"),
            shop_purchase("WH-2", "wg", "acme"),
            // Not a shop's order: no webhook.
            purchase("WH-3", "wg"),
        ],
    )
    .await;
    eventually(
        Duration::from_secs(30),
        "each event delivered on its retry",
        || async { receiver.hits().len() >= 4 },
    )
    .await;
    let hits = receiver.hits();
    let mut ids: Vec<&str> = hits.iter().map(|h| h.id.as_str()).collect();
    ids.dedup();
    ids.sort();
    ids.dedup();
    assert_eq!(
        ids.len(),
        2,
        "one id per event, kept by its retry: {hits:?}"
    );
    for id in ids {
        let tries: Vec<&Hit> = hits.iter().filter(|h| h.id == id).collect();
        assert_eq!(tries.len(), 2, "failed once, delivered on the retry");
        let gap = tries[1].at - tries[0].at;
        assert!(
            gap >= Duration::from_millis(4500),
            "the retry waits 5 s: {gap:?}"
        );
        assert_eq!(tries[0].body, tries[1].body, "a retry sends the same event");
        for t in &tries {
            verified_by_the_python_library(&secret, t)
                .await
                .unwrap_or_else(|e| panic!("standardwebhooks refused the signature: {e}"));
        }
        assert!(
            verified_by_the_python_library("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", tries[0])
                .await
                .is_err(),
            "another secret does not verify"
        );
        let body = tries[0].json();
        assert_eq!(body["type"], "order.granted");
        let order = body["data"]["order_id"].as_str().unwrap().to_owned();
        assert_eq!(body["data"]["shop"], "acme");
        assert_eq!(body["data"]["state"], "granted");
        assert_eq!(
            body["data"]["codes"][0]["code"].as_str().unwrap(),
            code_of(&env, &order).await,
            "the code in plaintext"
        );
    }
    assert!(
        !hits.iter().any(|h| h.body.contains("WH-3")),
        "an order of no shop is no shop's webhook"
    );
    receiver.assert_schema();

    // One record per attempt: the failure, then the delivery.
    let out = codepool_ok(
        &env,
        &["webhooks", "deliveries", "--id", &endpoint, "--json"],
    )
    .await;
    let attempts: Vec<Value> = serde_json::from_str(&out).unwrap();
    assert_eq!(attempts.len(), 4, "{out}");
    let outcomes: Vec<&str> = attempts
        .iter()
        .map(|a| a["outcome"].as_str().unwrap())
        .collect();
    assert_eq!(
        outcomes.iter().filter(|o| **o == "failed").count(),
        2,
        "{out}"
    );
    assert_eq!(
        outcomes.iter().filter(|o| **o == "delivered").count(),
        2,
        "{out}"
    );
    assert!(attempts
        .iter()
        .any(|a| a["status"] == 500 && a["attempt"] == 1));

    // A void is told too, and a replay sends an event again, same id, audited.
    receiver.set(Answer::Ok);
    codepool_ok(&env, &["void", "--order", "WH-1", "--reason", "refund"]).await;
    eventually(
        Duration::from_secs(20),
        "order.voided delivered",
        || async { !receiver.of_type("order.voided").is_empty() },
    )
    .await;
    let voided = receiver.of_type("order.voided")[0].json();
    assert_eq!(voided["data"]["order_id"], "WH-1");
    assert_eq!(voided["data"]["reason"], "refund");
    let granted_id = hits[0].id.clone();
    let before = receiver.hits().len();
    codepool_ok(
        &env,
        &[
            "webhooks",
            "replay",
            "--shop",
            "acme",
            "--event",
            &granted_id,
        ],
    )
    .await;
    eventually(
        Duration::from_secs(20),
        "the replayed event delivered",
        || async { receiver.hits().len() > before },
    )
    .await;
    assert_eq!(
        receiver.hits()[before].id,
        granted_id,
        "a replay keeps the event's id"
    );
    let audit = audit(&env).await;
    assert!(
        audit
            .iter()
            .any(|(kind, what)| kind == "webhook-replay" && what.contains(&granted_id)),
        "{audit:?}"
    );
    daemon.stop().await;
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}

/// Every audit record, as (kind, what).
async fn audit(env: &TestEnv) -> Vec<(String, String)> {
    let docs: Vec<bson::Document> = find_docs(env, "audit", bson::doc! {}).await;
    docs.iter()
        .map(|d| {
            let field = |k: &str| d.get_str(k).unwrap_or_default().to_owned();
            (field("kind"), field("what"))
        })
        .collect()
}

#[tokio::test]
async fn a_backordered_http_order_gets_its_codes_by_webhook_after_an_import() {
    let env = TestEnv::with_pools("wh_backorder", &[("wb", 1)]).await;
    pool_set(&env, "wb", &["--per-user", "2"]).await;
    shop(&env, "acme", "wb").await;
    let receiver = Receiver::start(Answer::Ok).await;
    let (_, secret) = add_endpoint(&env, "acme", &receiver.url(), "*").await;
    let key = shop_key(&env, "acme-1", "acme").await;
    let api = ApiServer::start(&env, &[]).await;
    let daemon = start_daemon(env.command(&[])).await;
    let order = |id: &str| {
        serde_json::json!({"order_id": id, "uid": "u-1", "phone": "+8613800000000", "pool": "wb", "quantity": 1})
            .to_string()
            .into_bytes()
    };
    // Answered with its code: the shop has it, no order.granted.
    let (status, _, body) = api.post("/v1/orders", &key, &order("HB-1")).await;
    assert_eq!(status, 201, "{}", String::from_utf8_lossy(&body));
    // No stock left: it waits.
    let (status, _, body) = api.post("/v1/orders", &key, &order("HB-2")).await;
    assert_eq!(status, 202, "{}", String::from_utf8_lossy(&body));
    assert_eq!(json_of(&body)["state"], "waiting");

    let mut csv = tempfile::NamedTempFile::new().unwrap();
    std::io::Write::write_all(&mut csv, b"code\nWB-NEW-0001\nWB-NEW-0002\n").unwrap();
    codepool_ok(
        &env,
        &["import", csv.path().to_str().unwrap(), "--pool", "wb"],
    )
    .await;
    eventually(Duration::from_secs(30), "HB-2's order.granted", || async {
        receiver
            .of_type("order.granted")
            .iter()
            .any(|h| h.json()["data"]["order_id"] == "HB-2")
    })
    .await;
    let granted = receiver.of_type("order.granted");
    let hb2 = granted
        .iter()
        .find(|h| h.json()["data"]["order_id"] == "HB-2")
        .unwrap();
    verified_by_the_python_library(&secret, hb2).await.unwrap();
    assert_eq!(
        hb2.json()["data"]["codes"][0]["code"].as_str().unwrap(),
        code_of(&env, "HB-2").await
    );
    assert!(
        !granted
            .iter()
            .any(|h| h.json()["data"]["order_id"] == "HB-1"),
        "an order answered with its codes gets no order.granted"
    );
    eventually(
        Duration::from_secs(20),
        "the shop's pool.replenished",
        || async {
            (receiver.of_type("pool.replenished").iter()).any(|h| h.json()["data"]["pool"] == "wb")
        },
    )
    .await;

    // A refusal by the pool's policy (2 orders per uid) is told too.
    let (status, _, body) = api.post("/v1/orders", &key, &order("HB-3")).await;
    assert_eq!(status, 422, "{}", String::from_utf8_lossy(&body));
    eventually(Duration::from_secs(20), "HB-3's order.refused", || async {
        (receiver.of_type("order.refused").iter()).any(|h| h.json()["data"]["order_id"] == "HB-3")
    })
    .await;
    receiver.assert_schema();
    daemon.stop().await;
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn after_a_rotation_deliveries_verify_with_the_old_secret_and_the_new() {
    let env = TestEnv::with_pools("wh_rotate", &[("wr", 5)]).await;
    shop(&env, "acme", "wr").await;
    let receiver = Receiver::start(Answer::Ok).await;
    let (endpoint, old) = add_endpoint(&env, "acme", &receiver.url(), "order.granted").await;
    let out = codepool_ok(&env, &["webhooks", "rotate-secret", "--id", &endpoint]).await;
    let new = (out.split_whitespace())
        .find(|w| w.starts_with("whsec_"))
        .expect("the new secret is printed")
        .to_owned();
    assert_ne!(new, old);
    let daemon = start_daemon(env.command(&[])).await;
    let (conn, publisher) = publisher(&env).await;
    publish_confirmed(&publisher, &[shop_purchase("WR-1", "wr", "acme")]).await;
    eventually(Duration::from_secs(20), "the event delivered", || async {
        !receiver.hits().is_empty()
    })
    .await;
    let hit = &receiver.hits()[0];
    assert_eq!(
        hit.signature.split(' ').count(),
        2,
        "two signatures: {}",
        hit.signature
    );
    verified_by_the_python_library(&new, hit).await.unwrap();
    verified_by_the_python_library(&old, hit).await.unwrap();
    verified_by_the_rust_library(&new, hit).unwrap();
    verified_by_the_rust_library(&old, hit).unwrap();
    assert!(verified_by_the_rust_library(&crate_secret_of_another(), hit).is_err());
    let audit = audit(&env).await;
    assert!(
        audit.iter().any(|(kind, _)| kind == "webhook-rotate"),
        "{audit:?}"
    );

    // A new encryption key and `keys rotate`: secrets and event bodies are
    // sealed again under it, and still sign and open.
    let key_ids = |collection: &'static str, field: &'static str| {
        let env = &env;
        async move {
            env.store
                .database()
                .collection::<bson::Document>(collection)
                .distinct(field, bson::doc! {})
                .await
                .unwrap()
        }
    };
    let before = key_ids("webhook_endpoints", "secrets.key_id").await;
    codepool_ok(&env, &["keys", "add"]).await;
    codepool_ok(&env, &["keys", "rotate"]).await;
    let after = key_ids("webhook_endpoints", "secrets.key_id").await;
    assert_eq!(after.len(), 1, "{after:?}");
    assert!(!before.contains(&after[0]), "{before:?} -> {after:?}");
    assert_eq!(key_ids("webhook_events", "key_id").await, after);
    let event = hit.id.clone();
    codepool_ok(
        &env,
        &["webhooks", "replay", "--shop", "acme", "--event", &event],
    )
    .await;
    eventually(
        Duration::from_secs(20),
        "replayed after the key rotation",
        || async { receiver.hits().len() >= 2 },
    )
    .await;
    verified_by_the_rust_library(&new, &receiver.hits()[1]).unwrap();
    assert_eq!(receiver.hits()[1].body, receiver.hits()[0].body);
    daemon.stop().await;
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}

fn crate_secret_of_another() -> String {
    codepool_issuance::webhooks::sign::new_secret()
}

#[tokio::test]
async fn inside_and_plain_http_addresses_are_refused_when_added_and_when_delivered() {
    let env = TestEnv::with_pools("wh_refused", &[("wf", 5)]).await;
    shop(&env, "acme", "wf").await;
    for url in [
        "http://shop.example/hooks",
        "https://127.0.0.1/hooks",
        "https://10.0.0.7/hooks",
        "https://192.168.1.1/hooks",
        "https://169.254.169.254/latest/meta-data",
        "https://[::1]/hooks",
        "https://localhost/hooks",
    ] {
        let out = env
            .command(&[
                "webhooks",
                "add",
                "--shop",
                "acme",
                "--url",
                url,
                "--events",
                "order.granted",
            ])
            .env_remove("CODEPOOL_WEBHOOK_ALLOW_HOSTS")
            .output()
            .await
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{url}: {err}");
        assert!(
            err.contains("public addresses") || err.contains("https only"),
            "{url}: {err}"
        );
    }
    let listed = codepool_ok(&env, &["webhooks", "list", "--shop", "acme", "--json"]).await;
    assert_eq!(
        serde_json::from_str::<Vec<Value>>(&listed).unwrap().len(),
        0
    );

    // Added while 127.0.0.1 was allowed; delivered by a process that does
    // not allow it: the address is checked again, and nothing is sent.
    let receiver = Receiver::start(Answer::Ok).await;
    let (endpoint, _) = add_endpoint(&env, "acme", &receiver.url(), "order.granted").await;
    let mut cmd = env.command(&[]);
    cmd.env_remove("CODEPOOL_WEBHOOK_ALLOW_HOSTS");
    let daemon = start_daemon(cmd).await;
    let (conn, publisher) = publisher(&env).await;
    publish_confirmed(&publisher, &[shop_purchase("WF-1", "wf", "acme")]).await;
    eventually(
        Duration::from_secs(20),
        "a refused attempt recorded",
        || async {
            let out = codepool_ok(
                &env,
                &["webhooks", "deliveries", "--id", &endpoint, "--json"],
            )
            .await;
            out.contains("\"refused\"")
        },
    )
    .await;
    assert!(
        receiver.hits().is_empty(),
        "nothing reached the inside address"
    );
    daemon.stop().await;
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_delivering_process_killed_mid_delivery_leaves_the_event_to_the_next() {
    let env = TestEnv::with_pools("wh_kill", &[("wk", 5)]).await;
    shop(&env, "acme", "wk").await;
    let receiver = Receiver::start(Answer::HangFirst(Duration::from_secs(60))).await;
    let (_, secret) = add_endpoint(&env, "acme", &receiver.url(), "order.granted").await;
    let mut first = start_daemon(env.command(&[])).await;
    let (conn, publisher) = publisher(&env).await;
    publish_confirmed(&publisher, &[shop_purchase("WK-1", "wk", "acme")]).await;
    eventually(
        Duration::from_secs(20),
        "the first attempt in flight",
        || async { !receiver.hits().is_empty() },
    )
    .await;
    let pid = first.child.id().unwrap().to_string();
    std::process::Command::new("kill")
        .args(["-KILL", &pid])
        .status()
        .unwrap();
    let _ = first.child.wait().await;
    receiver.set(Answer::Ok);
    let second = start_daemon(env.command(&[])).await;
    eventually(
        Duration::from_secs(45),
        "the event delivered by the next process",
        || async { receiver.hits().len() >= 2 },
    )
    .await;
    let hits = receiver.hits();
    assert_eq!(hits[0].id, hits[1].id, "the same event, the same id");
    verified_by_the_python_library(&secret, &hits[1])
        .await
        .unwrap();
    second.stop().await;
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}

#[tokio::test]
async fn two_processes_never_deliver_one_event_at_once_and_410_disables_the_endpoint() {
    let env = TestEnv::with_pools("wh_lease", &[("wl", 60)]).await;
    shop(&env, "acme", "wl").await;
    let receiver = Receiver::start(Answer::Slow(Duration::from_millis(200))).await;
    let (endpoint, _) = add_endpoint(&env, "acme", &receiver.url(), "*").await;
    let a = start_daemon(env.command(&[])).await;
    let b = start_daemon(env.command(&[])).await;
    let (conn, publisher) = publisher(&env).await;
    let orders: Vec<_> = (0..40)
        .map(|i| shop_purchase(&format!("WL-{i}"), "wl", "acme"))
        .collect();
    publish_confirmed(&publisher, &orders).await;
    eventually(
        Duration::from_secs(60),
        "40 order.granted delivered",
        || async { receiver.of_type("order.granted").len() >= 40 },
    )
    .await;
    // Each event delivered once: judged once every task is delivered (no
    // process leases it again) and every request the receiver got is
    // recorded as an attempt (none is still in flight).
    let db = env.store.database();
    let tasks = db.collection::<bson::Document>("webhook_tasks");
    let attempts = db.collection::<bson::Document>("webhook_attempts");
    let granted = bson::doc! {"kind": "order.granted"};
    let delivered = bson::doc! {"kind": "order.granted", "state": "delivered"};
    eventually(
        Duration::from_secs(30),
        "every delivery of order.granted recorded",
        || async {
            let received = receiver.of_type("order.granted").len() as u64;
            tasks.count_documents(delivered.clone()).await.unwrap() == 40
                && tasks.count_documents(granted.clone()).await.unwrap() == 40
                && attempts.count_documents(granted.clone()).await.unwrap() == received
        },
    )
    .await;
    let granted = receiver.of_type("order.granted");
    assert_eq!(granted.len(), 40, "each event delivered once");
    assert_eq!(
        receiver.seen.lock().unwrap().overlap,
        1,
        "no event twice at once"
    );

    // 410 Gone: the endpoint is disabled, and nothing more is sent.
    receiver.set(Answer::Status(410));
    publish_confirmed(&publisher, &[shop_purchase("WL-GONE", "wl", "acme")]).await;
    eventually(Duration::from_secs(20), "the endpoint disabled", || async {
        let out = codepool_ok(&env, &["webhooks", "list", "--shop", "acme", "--json"]).await;
        let list: Vec<Value> = serde_json::from_str(&out).unwrap();
        list[0]["enabled"] == false
    })
    .await;
    let out = codepool_ok(&env, &["webhooks", "list", "--json"]).await;
    assert!(out.contains("410"), "the reason says 410: {out}");
    let seen = receiver.hits().len();
    publish_confirmed(&publisher, &[shop_purchase("WL-AFTER", "wl", "acme")]).await;
    // Judged once WL-AFTER's event is staged (its task held for the
    // disabled endpoint) and no task is left to deliver.
    let codes = db.collection::<bson::Document>("codes");
    let staged = bson::doc! {"order_id": "WL-AFTER", "hook_pending": {"$exists": false}};
    eventually(
        Duration::from_secs(30),
        "WL-AFTER's event held, nothing due",
        || async {
            codes.count_documents(staged.clone()).await.unwrap() == 1
                && tasks
                    .count_documents(bson::doc! {"state": "held"})
                    .await
                    .unwrap()
                    >= 1
                && tasks
                    .count_documents(bson::doc! {"state": "pending"})
                    .await
                    .unwrap()
                    == 0
        },
    )
    .await;
    assert_eq!(
        receiver.hits().len(),
        seen,
        "a disabled endpoint gets nothing"
    );

    // Enabled again: what waited for it is delivered.
    receiver.set(Answer::Ok);
    codepool_ok(&env, &["webhooks", "enable", "--id", &endpoint]).await;
    eventually(
        Duration::from_secs(20),
        "WL-AFTER delivered once enabled",
        || async { receiver.hits().iter().any(|h| h.body.contains("WL-AFTER")) },
    )
    .await;
    a.stop().await;
    b.stop().await;
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}

#[tokio::test]
async fn an_endpoint_failing_for_five_days_is_disabled() {
    let env = TestEnv::with_pools("wh_5days", &[("wd", 5)]).await;
    shop(&env, "acme", "wd").await;
    let receiver = Receiver::start(Answer::Status(503)).await;
    let (endpoint, _) = add_endpoint(&env, "acme", &receiver.url(), "order.granted").await;
    let six_days_ago = bson::DateTime::from_chrono(chrono::Utc::now() - chrono::Duration::days(6));
    env.coll("webhook_endpoints")
        .update_one(
            bson::doc! {"_id": &endpoint},
            bson::doc! {"$set": {"failing_since": six_days_ago}},
        )
        .await
        .unwrap();
    let daemon = start_daemon(env.command(&[])).await;
    let (conn, publisher) = publisher(&env).await;
    publish_confirmed(&publisher, &[shop_purchase("WD-1", "wd", "acme")]).await;
    eventually(Duration::from_secs(20), "the endpoint disabled", || async {
        let out = codepool_ok(&env, &["webhooks", "list", "--json"]).await;
        out.contains("failed for 5 days")
    })
    .await;
    // The counter moves right after the write the listing reads.
    let disabled = "codepool_webhook_endpoints_disabled_total{reason=\"failing\"} 1";
    eventually(Duration::from_secs(5), "the disable counted", || async {
        let metrics = crate::common::http_get(&daemon.addr, "/metrics").await;
        metrics.is_some_and(|m| m.1.contains(disabled))
    })
    .await;
    let metrics = crate::common::http_get(&daemon.addr, "/metrics")
        .await
        .unwrap()
        .1;
    assert!(metrics.contains("codepool_webhook_deliveries_total{outcome=\"failed\"}"));
    daemon.stop().await;
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}

#[tokio::test]
async fn the_admin_api_adds_lists_rotates_disables_and_replays_endpoints() {
    let env = TestEnv::with_pools("wh_api", &[("wa", 5)]).await;
    shop(&env, "acme", "wa").await;
    let admin = crate::api::key(&env, "ops", "orders:write,orders:read,admin").await;
    let writer = crate::api::key(&env, "w", "orders:write").await;
    let receiver = Receiver::start(Answer::Ok).await;
    let api = ApiServer::start(&env, &[]).await;
    let new = |url: &str| {
        serde_json::json!({"shop": "acme", "url": url, "events": ["order.granted", "order.voided"]})
            .to_string()
            .into_bytes()
    };
    let (status, _, _) = api
        .post("/v1/webhooks", &writer, &new(&receiver.url()))
        .await;
    assert_eq!(status, 403, "admin only");
    for (url, field) in [
        ("https://169.254.169.254/x", "url"),
        ("http://shop.example/x", "url"),
    ] {
        let (status, _, body) = api.post("/v1/webhooks", &admin, &new(url)).await;
        assert_eq!(status, 422, "{url}: {}", String::from_utf8_lossy(&body));
        assert_eq!(json_of(&body)["field"], field);
    }
    let (status, _, body) = api
        .post("/v1/webhooks", &admin, &new(&receiver.url()))
        .await;
    assert_eq!(status, 201, "{}", String::from_utf8_lossy(&body));
    let added = json_of(&body);
    let id = added["id"].as_str().unwrap().to_owned();
    let secret = added["secret"].as_str().unwrap().to_owned();
    let (_, _, body) = api.get("/v1/webhooks?shop=acme", &admin).await;
    let listed = json_of(&body);
    assert_eq!(listed["endpoints"][0]["id"], id.as_str());
    assert!(
        listed["endpoints"][0].get("secret").is_none(),
        "the secret is shown once"
    );

    // A shop order over AMQP, delivered by the API process (every process
    // that grants delivers), then replayed through the API.
    let daemon = start_daemon(env.command(&[])).await;
    let (conn, publisher) = publisher(&env).await;
    publish_confirmed(&publisher, &[shop_purchase("WA-1", "wa", "acme")]).await;
    eventually(Duration::from_secs(20), "delivered", || async {
        !receiver.hits().is_empty()
    })
    .await;
    let event = receiver.hits()[0].id.clone();
    verified_by_the_python_library(&secret, &receiver.hits()[0])
        .await
        .unwrap();
    let path = format!("/v1/webhooks/{id}/rotate-secret");
    let (status, _, body) = api.post(&path, &admin, b"").await;
    assert_eq!(status, 200);
    let rotated = json_of(&body)["secret"].as_str().unwrap().to_owned();
    let replay = serde_json::json!({"shop": "acme", "event": event}).to_string();
    let (status, _, body) = api
        .post("/v1/webhooks/replay", &admin, replay.as_bytes())
        .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(json_of(&body)["due"], 1);
    eventually(Duration::from_secs(20), "replayed", || async {
        receiver.hits().len() >= 2
    })
    .await;
    let again = &receiver.hits()[1];
    assert_eq!(again.id, event);
    verified_by_the_python_library(&rotated, again)
        .await
        .unwrap();
    verified_by_the_python_library(&secret, again)
        .await
        .unwrap();
    let (_, _, body) = api
        .get(&format!("/v1/webhooks/{id}/deliveries"), &admin)
        .await;
    assert_eq!(json_of(&body)["deliveries"].as_array().unwrap().len(), 2);
    let (status, _, body) = api
        .post(&format!("/v1/webhooks/{id}/disable"), &admin, b"")
        .await;
    assert_eq!(status, 200);
    assert_eq!(json_of(&body)["enabled"], false);
    let (status, _, _) = api.post("/v1/webhooks/ep_nope/enable", &admin, b"").await;
    assert_eq!(status, 404);
    let kinds: Vec<String> = audit(&env).await.into_iter().map(|(k, _)| k).collect();
    for kind in [
        "webhook-add",
        "webhook-rotate",
        "webhook-replay",
        "webhook-disable",
    ] {
        assert!(kinds.iter().any(|k| k == kind), "{kind} audited: {kinds:?}");
    }
    daemon.stop().await;
    api.stop().await;
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}

/// `codepool webhooks add`; returns the endpoint's id.
async fn endpoint(env: &TestEnv, shop: &str, url: &str) -> String {
    let out = codepool_ok(
        env,
        &[
            "webhooks", "add", "--shop", shop, "--url", url, "--events", "*", "--json",
        ],
    )
    .await;
    let v: Value = serde_json::from_str(&out).unwrap();
    v["id"].as_str().unwrap().to_owned()
}

/// The audit's reveals, as (command, code ids).
async fn reveals(env: &TestEnv) -> Vec<(String, Vec<bson::oid::ObjectId>)> {
    let docs: Vec<bson::Document> = find_docs(env, "audit", doc! {"kind": "reveal"}).await;
    docs.iter()
        .map(|d| {
            let ids = (d.get_array("code_ids").unwrap().iter())
                .filter_map(|b| b.as_object_id())
                .collect();
            (d.get_str("command").unwrap_or_default().to_owned(), ids)
        })
        .collect()
}

#[tokio::test]
async fn a_replay_sends_events_older_than_the_endpoint_only_when_asked_and_audits_a_reveal() {
    let env = TestEnv::with_pools("wh_replay_old", &[("wr", 5)]).await;
    shop(&env, "acme", "wr").await;
    let first = Receiver::start(Answer::Ok).await;
    endpoint(&env, "acme", &first.url()).await;
    let daemon = start_daemon(env.command(&[])).await;
    let (conn, publisher) = publisher(&env).await;
    publish_confirmed(&publisher, &[shop_purchase("WR-1", "wr", "acme")]).await;
    eventually(
        Duration::from_secs(20),
        "order.granted delivered",
        || async { !first.hits().is_empty() },
    )
    .await;
    let event = first.hits()[0].id.clone();
    let code = code_ids(&env, doc! {"order_id": "WR-1"}).await;
    assert_eq!(code.len(), 1);

    // An endpoint added after the event: a replay leaves the event out
    // unless asked, and says so.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let late = Receiver::start(Answer::Ok).await;
    let id = endpoint(&env, "acme", &late.url()).await;
    let out = codepool_ok(
        &env,
        &[
            "webhooks", "replay", "--shop", "acme", "--event", &event, "--id", &id,
        ],
    )
    .await;
    assert!(out.contains("0 deliveries due"), "{out}");
    assert!(out.contains("--include-before-endpoint"), "{out}");
    let since = (chrono::Utc::now() - chrono::Duration::hours(1)).to_rfc3339();
    let out = codepool_ok(
        &env,
        &["webhooks", "replay", "--shop", "acme", "--since", &since],
    )
    .await;
    assert!(
        out.contains("1 deliveries due"),
        "only to the first endpoint: {out}"
    );
    let (api, admin) = api_with_key(&env, "ops", "admin").await;
    let replay = |include: Option<bool>| {
        let (addr, admin) = (api.addr.clone(), admin.clone());
        let mut body = json!({"shop": "acme", "event": event, "endpoint": id});
        if let Some(i) = include {
            body["include_before_endpoint"] = json!(i);
        }
        async move {
            let (s, _, b) = http(
                &addr,
                "POST",
                "/v1/webhooks/replay",
                Some(&admin),
                body.to_string().as_bytes(),
            )
            .await;
            assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
            json_of(&b)
        }
    };
    let r = replay(None).await;
    assert_eq!(r["due"], 0, "{r}");
    assert_eq!(r["left_out_before_endpoint"], 1, "{r}");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        late.hits().is_empty(),
        "an old event went to a new endpoint"
    );
    assert!(reveals(&env).await.is_empty());

    // Asked: sent, and audited as a reveal of the event's code.
    let out = codepool_ok(
        &env,
        &[
            "webhooks",
            "replay",
            "--shop",
            "acme",
            "--event",
            &event,
            "--id",
            &id,
            "--include-before-endpoint",
        ],
    )
    .await;
    assert!(out.contains("1 deliveries due"), "{out}");
    eventually(
        Duration::from_secs(20),
        "the old event delivered",
        || async { !late.hits().is_empty() },
    )
    .await;
    assert_eq!(late.hits()[0].id, event);
    let seen = reveals(&env).await;
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert!(seen[0].0.contains("webhooks replay"), "{seen:?}");
    assert_eq!(seen[0].1.iter().copied().collect::<HashSet<_>>(), code);
    let r = replay(Some(true)).await;
    assert_eq!(r["due"], 1, "{r}");
    let seen = reveals(&env).await;
    assert_eq!(seen.len(), 2, "{seen:?}");
    let by_key = seen.iter().find(|(c, _)| c.contains("/v1/webhooks/replay"));
    let by_key = by_key.unwrap_or_else(|| panic!("no reveal by the API key: {seen:?}"));
    assert_eq!(by_key.1.iter().copied().collect::<HashSet<_>>(), code);
    daemon.stop().await;
    api.stop().await;
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}
