//! Following one order through the logs: with `--log-format json`, the
//! lines that name an order id (in a field of their own, or of a span they
//! were logged in) show its whole path through either door, its codes
//! masked: received, decided and granted, its `sms.pending` published;
//! and for a hold, placed, then paid by the order that committed it.

use std::time::Duration;

use serde_json::{json, Value};

use crate::api::{http, key, order, ApiServer};
use crate::common::*;

/// One JSON log line as an order's path shows it: its message, and the
/// names of the spans it was logged in, outermost first.
#[derive(Debug)]
struct Stage {
    message: String,
    spans: Vec<String>,
    line: Value,
}

impl Stage {
    fn is(&self, message: &str, span: &str) -> bool {
        self.message == message && self.spans.iter().any(|s| s == span)
    }

    /// The `door` field of the innermost span that names one.
    fn door(&self) -> Option<&str> {
        let spans = self.line["spans"].as_array()?;
        spans.iter().rev().find_map(|s| s["door"].as_str())
    }
}

/// Whether a JSON object holds `id` as one of its values.
fn holds(object: &Value, id: &str) -> bool {
    object
        .as_object()
        .is_some_and(|m| m.values().any(|v| v.as_str() == Some(id)))
}

/// The lines of `log` that name `id`, in a field of their own or of one
/// of their spans: what `grep` finds, read as JSON.
fn path_of(log: &str, id: &str) -> Vec<Stage> {
    log.lines()
        .filter(|l| l.contains(id))
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| {
            let spans = v["spans"].as_array().map(Vec::as_slice).unwrap_or(&[]);
            holds(v, id) || spans.iter().any(|s| holds(s, id))
        })
        .map(|line| Stage {
            message: line["message"].as_str().unwrap_or("").to_owned(),
            spans: (line["spans"].as_array().into_iter().flatten())
                .filter_map(|s| s["name"].as_str().map(str::to_owned))
                .collect(),
            line,
        })
        .collect()
}

/// The stages `id`'s path must show, each a message and the span it is
/// logged in; whether every one is there.
fn complete(log: &str, id: &str, wanted: &[(&str, &str)]) -> bool {
    let path = path_of(log, id);
    wanted
        .iter()
        .all(|(message, span)| path.iter().any(|s| s.is(message, span)))
}

/// Asserts `id`'s path: every stage of `wanted`, each line in a span of
/// the door it came by, and its codes masked.
fn check_path(log: &str, id: &str, door: &str, wanted: &[(&str, &str)]) {
    let path = path_of(log, id);
    let shown: Vec<(&str, &[String])> = (path.iter())
        .map(|s| (s.message.as_str(), s.spans.as_slice()))
        .collect();
    for (message, span) in wanted {
        assert!(
            path.iter().any(|s| s.is(message, span)),
            "{id}: no {message:?} line in a {span:?} span; its path: {shown:#?}"
        );
    }
    for s in &path {
        assert_eq!(s.door(), Some(door), "{id}: {}", s.line);
    }
    for g in path.iter().filter(|s| s.is("granted", "decide")) {
        let code = g.line["code"].as_str().unwrap_or("");
        assert!(code.contains('*'), "{id}: a code unmasked: {}", g.line);
    }
}

/// The path of a purchase over AMQP: each stage's message and span.
const AMQP: &[(&str, &str)] = &[
    ("purchase received", "purchase"),
    ("granted", "decide"),
    ("sms.pending published", "announce"),
];

/// The path of an HTTP order from stock.
const FROM_STOCK: &[(&str, &str)] = &[
    ("order placed", "order"),
    ("granted", "decide"),
    ("sms.pending published", "announce"),
];

/// The path of an HTTP order that pays for a hold.
const FROM_HOLD: &[(&str, &str)] = &[
    ("order placed", "order"),
    ("hold paid; its codes are the order's", "hold_commit"),
    ("granted", "decide"),
    ("sms.pending published", "announce"),
];

/// The path of the hold, by its id.
const THE_HOLD: &[(&str, &str)] = &[
    ("hold placed", "place_holds"),
    ("hold paid; its codes are the order's", "hold_commit"),
];

/// A purchase over AMQP, an HTTP order from stock, and an HTTP order that
/// pays for a hold, with a dispatcher and an API process logging JSON:
/// the lines that name each order id (or the hold's) show each stage of
/// its path by message and span, in its door's spans, and no code in
/// plaintext. Before the core had spans, a grant's line named no step and
/// no publish named its order.
#[tokio::test]
async fn grepping_one_order_id_shows_its_path_through_either_door() {
    let env = TestEnv::new("spans_path").await;
    let codes = env.fill_pool("sp", 10).await;
    let shop = key(&env, "shop", "orders:write,orders:read").await;
    let daemon = start_daemon(env.command(&["--log-format", "json"])).await;
    let api = ApiServer::start(&env, &["--log-format", "json"]).await;

    // Over AMQP.
    let (conn, publisher) = env.amqp().await;
    publish_confirmed(&publisher, &[purchase("SA-1", "sp")]).await;
    // Over HTTP: an order from stock, and one that pays for a hold.
    let post = |path: &'static str, body: Vec<u8>| {
        let (addr, shop) = (api.addr.clone(), shop.clone());
        async move { http(&addr, "POST", path, Some(&shop), &body).await.0 }
    };
    assert_eq!(post("/v1/orders", order("SH-1", "sp", 1)).await, 201);
    let hold =
        json!({"hold_id": "SHOLD-1", "uid": "u-api", "items": [{"pool": "sp", "quantity": 1}]});
    assert_eq!(post("/v1/holds", hold.to_string().into_bytes()).await, 201);
    let paid = json!({"order_id": "SH-2", "uid": "u-api", "phone": "+8613800000000",
                      "pool": "sp", "hold_id": "SHOLD-1"});
    assert_eq!(post("/v1/orders", paid.to_string().into_bytes()).await, 201);

    eventually(
        Duration::from_secs(30),
        "every order's path in the logs",
        || async {
            let (d, a) = (daemon.log_text(), api.log_text());
            complete(&d, "SA-1", AMQP)
                && complete(&a, "SH-1", FROM_STOCK)
                && complete(&a, "SH-2", FROM_HOLD)
                && complete(&a, "SHOLD-1", THE_HOLD)
        },
    )
    .await;
    let (d, a) = (daemon.log_text(), api.log_text());
    check_path(&d, "SA-1", "amqp", AMQP);
    check_path(&a, "SH-1", "http", FROM_STOCK);
    check_path(&a, "SH-2", "http", FROM_HOLD);
    check_path(&a, "SHOLD-1", "http", THE_HOLD);
    // The hold's commit names the order that paid it.
    let commit = path_of(&a, "SHOLD-1")
        .into_iter()
        .find(|s| s.spans.iter().any(|n| n == "hold_commit"))
        .expect("the hold's commit");
    assert_eq!(commit.line["order_id"], "SH-2", "{}", commit.line);
    for code in &codes {
        for log in [&d, &a] {
            assert!(!log.contains(code.as_str()), "a plaintext code: {code}");
        }
    }
    codepool_broker::close(conn, "done").await;
    api.stop().await;
    daemon.stop().await;
    env.cleanup().await;
}

/// The JSON log line that grants an order carries the fields of the span
/// it ran in: over HTTP the order's own span (order id, pool, door), over
/// AMQP its batch's (door): an operator greps one order id and sees its
/// path, whichever door it came by.
#[tokio::test]
async fn an_orders_json_log_lines_carry_their_span_fields_from_either_door() {
    use crate::api::{key, order, ApiServer};
    let env = TestEnv::with_pools("spans_spans", &[("sp", 5)]).await;
    let shop = key(&env, "shop", "orders:write").await;
    let api = ApiServer::start(&env, &["--log-format", "json"]).await;
    let (status, _, _) = api.post("/v1/orders", &shop, &order("SP-1", "sp", 1)).await;
    assert_eq!(status, 201);
    let line = |log: &str, message: &str, order: &str| -> Option<serde_json::Value> {
        log.lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find(|v| v["message"] == message && v.to_string().contains(order))
    };
    eventually(Duration::from_secs(10), "the order's log line", || async {
        line(&api.log_text(), "order placed", "SP-1").is_some()
    })
    .await;
    let placed = line(&api.log_text(), "order placed", "SP-1").unwrap();
    assert_eq!(placed["span"]["name"], "order", "{placed}");
    assert_eq!(
        (
            &placed["span"]["order_id"],
            &placed["span"]["pool"],
            &placed["span"]["door"]
        ),
        (
            &serde_json::json!("SP-1"),
            &serde_json::json!("sp"),
            &serde_json::json!("http")
        ),
        "{placed}"
    );
    // The batch that placed it logs the grant with the door it came by.
    eventually(
        Duration::from_secs(10),
        "SP-1 granted in the log",
        || async { line(&api.log_text(), "granted", "SP-1").is_some() },
    )
    .await;
    let granted = line(&api.log_text(), "granted", "SP-1").unwrap();
    assert_eq!(
        (&granted["order_id"], &granted["span"]["door"]),
        (&serde_json::json!("SP-1"), &serde_json::json!("http")),
        "{granted}"
    );
    api.stop().await;

    let daemon = start_daemon(env.command(&["--log-format", "json"])).await;
    let (_conn, publisher) = env.amqp().await;
    publish_confirmed(&publisher, &[purchase("SP-2", "sp")]).await;
    eventually(
        Duration::from_secs(20),
        "SP-2 granted in the log",
        || async { line(&daemon.log_text(), "granted", "SP-2").is_some() },
    )
    .await;
    let granted = line(&daemon.log_text(), "granted", "SP-2").unwrap();
    assert_eq!(
        (&granted["order_id"], &granted["span"]["door"]),
        (&serde_json::json!("SP-2"), &serde_json::json!("amqp")),
        "{granted}"
    );
    daemon.stop().await;
    env.cleanup().await;
}
