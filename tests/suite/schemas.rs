//! The message contracts in `docs/schemas/` (JSON Schema draft 2020-12)
//! hold for the real traffic: every event a real dispatcher publishes
//! matches its schema, the purchases it grants match the purchase schema,
//! and the ones it dead-letters do not (except those that are well formed
//! but name an unknown pool or reuse an order id).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use codepool_broker::Publisher;
use futures::StreamExt;
use serde_json::{json, Value};

use crate::common::*;
use crate::deploy::repo;
use crate::fixtures::*;

/// A compiled schema of `docs/schemas/`, with format checks on
/// (`date-time` is an assertion here, not only an annotation).
pub struct Schema {
    name: String,
    validator: jsonschema::Validator,
}

impl Schema {
    pub fn load(name: &str) -> Self {
        let path = repo()
            .join("docs/schemas")
            .join(format!("{name}.schema.json"));
        let text = std::fs::read_to_string(&path).expect("the schema file");
        let schema: Value = serde_json::from_str(&text).expect("the schema is JSON");
        assert_eq!(
            schema["$schema"], "https://json-schema.org/draft/2020-12/schema",
            "{name}: draft 2020-12"
        );
        assert!(
            jsonschema::meta::is_valid(&schema),
            "{name} is not a valid JSON Schema"
        );
        let validator = jsonschema::options()
            .should_validate_formats(true)
            .build(&schema)
            .unwrap_or_else(|e| panic!("{name} does not compile: {e}"));
        Self {
            name: name.to_owned(),
            validator,
        }
    }

    /// Why `body` does not match, or `None` when it does.
    pub fn errors(&self, body: &[u8]) -> Option<String> {
        let value: Value = match serde_json::from_slice(body) {
            Ok(v) => v,
            Err(e) => return Some(format!("not JSON: {e}")),
        };
        let errors: Vec<String> = self
            .validator
            .iter_errors(&value)
            .map(|e| format!("{} at {}", e, e.instance_path()))
            .collect();
        (!errors.is_empty()).then(|| errors.join("; "))
    }

    pub fn assert_valid(&self, body: &[u8], what: &str) {
        if let Some(why) = self.errors(body) {
            panic!(
                "{what} does not match {}: {why}\n{}",
                self.name,
                String::from_utf8_lossy(body)
            );
        }
    }
}

/// Every schema, by the routing key of the messages it describes.
pub struct Schemas {
    pub purchase: Schema,
    by_key: Vec<(&'static str, Schema)>,
}

impl Schemas {
    pub fn load() -> Self {
        Self {
            purchase: Schema::load("purchase"),
            by_key: vec![
                ("sms.pending", Schema::load("sms-pending")),
                ("sms.sent", Schema::load("sms-receipt")),
                ("sms.failed", Schema::load("sms-receipt")),
                ("purchase.refused", Schema::load("purchase-refused")),
                ("code.redeemed", Schema::load("code-redeemed")),
                ("pool.", Schema::load("pool-event")),
            ],
        }
    }

    /// The schema of a message published with `routing_key`.
    pub fn for_key(&self, routing_key: &str) -> &Schema {
        self.by_key
            .iter()
            .find(|(k, _)| *k == routing_key || (k.ends_with('.') && routing_key.starts_with(k)))
            .map(|(_, s)| s)
            .unwrap_or_else(|| panic!("no schema in docs/schemas/ for {routing_key:?}"))
    }

    /// A purchase as the schema and the message rules around it say:
    /// at most 64 KiB, I-JSON (every name once), and valid.
    pub fn purchase_errors(&self, body: &[u8]) -> Option<String> {
        if body.len() > codepool_domain::MAX_MESSAGE_BYTES {
            return Some(format!("{} bytes: over 64 KiB", body.len()));
        }
        if let Some(name) = repeated_name(body) {
            return Some(format!("not I-JSON: {name:?} appears twice"));
        }
        self.purchase.errors(body)
    }
}

/// The first name a top-level JSON object repeats (RFC 7493 forbids it;
/// a schema validator only sees the last value).
fn repeated_name(body: &[u8]) -> Option<String> {
    struct Names(Option<String>);
    struct Visit;
    impl<'de> serde::de::Visitor<'de> for Visit {
        type Value = Names;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("an object")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(self, mut m: A) -> Result<Names, A::Error> {
            let mut seen = std::collections::HashSet::new();
            let mut repeated = None;
            while let Some((k, _)) = m.next_entry::<String, serde::de::IgnoredAny>()? {
                if !seen.insert(k.clone()) {
                    repeated.get_or_insert(k);
                }
            }
            Ok(Names(repeated))
        }
    }
    impl<'de> serde::Deserialize<'de> for Names {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            d.deserialize_map(Visit)
        }
    }
    serde_json::from_slice::<Names>(body).ok().and_then(|n| n.0)
}

/// Every message published on the test's `sms` and `codepool.events`
/// exchanges, with its routing key, as it was published.
#[derive(Clone, Default)]
struct Heard(Arc<Mutex<Vec<Message>>>);

/// A routing key and a body.
type Message = (String, Vec<u8>);

impl Heard {
    async fn listen(conn: &lapin::Connection, env: &TestEnv) -> Self {
        let heard = Self::default();
        let t = env.topology();
        for exchange in [t.sms_exchange, t.events_exchange] {
            let mut consumer = codepool_broker::subscribe(conn, &exchange, "#")
                .await
                .expect("subscribe")
                .consumer;
            let into = heard.clone();
            tokio::spawn(async move {
                while let Some(Ok(d)) = consumer.next().await {
                    if let Ok(mut all) = into.0.lock() {
                        all.push((d.routing_key.as_str().to_owned(), d.data));
                    }
                }
            });
        }
        heard
    }

    fn all(&self) -> Vec<Message> {
        self.0.lock().map(|a| a.clone()).unwrap_or_default()
    }

    fn count(&self, key: &str) -> usize {
        self.all().iter().filter(|(k, _)| k == key).count()
    }

    async fn wait_for(&self, key: &str, n: usize) {
        eventually(Duration::from_secs(30), key, || async {
            self.count(key) >= n
        })
        .await;
    }
}

fn of_quantity(order: &str, pool: &str, quantity: u32) -> codepool_domain::Purchase {
    let mut p = purchase(order, pool);
    p.quantity = quantity;
    p
}

async fn count_codes(env: &TestEnv, order: &str) -> u64 {
    env.coll("codes")
        .count_documents(bson::doc! {"order_id": order})
        .await
        .expect("count")
}

/// One code, two, then four of a pool holding five with a low-stock
/// threshold of 3 (sms.pending of both shapes, pool.low_stock,
/// pool.exhausted), an import (pool.replenished and the backorder's
/// part), a per-user limit (purchase.refused), pause and resume.
async fn drive_every_event(env: &TestEnv, publisher: &Publisher, heard: &Heard) {
    publish_confirmed(
        publisher,
        &[purchase("S-1", "s"), of_quantity("S-2", "s", 2)],
    )
    .await;
    heard.wait_for("sms.pending", 2).await;
    heard.wait_for("pool.low_stock", 1).await;
    publish_confirmed(publisher, &[of_quantity("S-3", "s", 4)]).await;
    heard.wait_for("pool.exhausted", 1).await;

    let dir = tempfile::tempdir().expect("a temporary folder");
    let csv = dir.path().join("more.csv");
    std::fs::write(&csv, "code\nMORE-1\nMORE-2\nMORE-3\nMORE-4\nMORE-5\n").expect("csv");
    codepool_ok(env, &["import", csv.to_str().unwrap_or(""), "--pool", "s"]).await;
    heard.wait_for("pool.replenished", 1).await;
    eventually(Duration::from_secs(30), "S-3's backorder", || async {
        count_codes(env, "S-3").await == 4
    })
    .await;
    heard.wait_for("sms.pending", 4).await;

    let mut first = purchase("L-1", "lim");
    first.uid = "buyer-l".into();
    let mut second = purchase("L-2", "lim");
    second.uid = "buyer-l".into();
    publish_confirmed(publisher, &[first, second]).await;
    heard.wait_for("purchase.refused", 1).await;

    codepool_ok(env, &["pool", "pause", "--pool", "lim"]).await;
    codepool_ok(env, &["pool", "resume", "--pool", "lim"]).await;
    heard.wait_for("pool.resumed", 1).await;
}

/// What the SMS service and the platform send: a receipt of each kind and
/// a redemption of each form, built from the events heard. The dispatcher
/// applies them all.
async fn send_receipts_and_redemptions(
    daemon_addr: &str,
    env: &TestEnv,
    publisher: &Publisher,
    heard: &Heard,
) {
    let sms: Vec<Value> = heard
        .all()
        .iter()
        .filter(|(k, _)| k == "sms.pending")
        .filter_map(|(_, b)| serde_json::from_slice(b).ok())
        .collect();
    let by_order = |o: &str| {
        sms.iter()
            .find(|e| e["order_id"] == o)
            .cloned()
            .unwrap_or_default()
    };
    let (one, two) = (by_order("S-1"), by_order("S-2"));
    let t = env.topology();
    let messages = [
        (
            &t.sms_exchange,
            "sms.sent",
            json!({"event_id": one["event_id"], "order_id": "S-1"}),
        ),
        (
            &t.sms_exchange,
            "sms.failed",
            json!({"event_id": two["event_id"], "order_id": "S-2", "error": "handset unreachable"}),
        ),
        (
            &t.events_exchange,
            "code.redeemed",
            json!({"order_id": "S-1"}),
        ),
        (
            &t.events_exchange,
            "code.redeemed",
            json!({"pool": "s", "code": two["codes"][0]["code"]}),
        ),
    ];
    for (exchange, key, body) in messages {
        publish_to(
            publisher,
            exchange,
            key,
            body.to_string().as_bytes(),
            lapin::BasicProperties::default().with_user_id("guest".into()),
        )
        .await;
    }
    for (metric, n) in [
        ("codepool_sms_receipts_total{result=\"sent\"}", 1.0),
        ("codepool_sms_receipts_total{result=\"failed\"}", 1.0),
        ("codepool_redemptions_total{result=\"redeemed\"}", 2.0),
    ] {
        eventually(Duration::from_secs(20), metric, || async {
            metric_sum(&[daemon_addr], metric).await >= n
        })
        .await;
    }
}

#[tokio::test]
async fn every_event_a_real_dispatcher_publishes_matches_its_schema() {
    let schemas = Schemas::load();
    let env = TestEnv::with_pools("schemas_events", &[("s", 5), ("lim", 5)]).await;
    let low = ["pool", "set", "--pool", "s", "--low-stock", "3"];
    codepool_ok(&env, &low).await;
    pool_set(&env, "s", &["--grant-prefix", "GS"]).await;
    pool_set(&env, "lim", &["--per-user", "1"]).await;
    let daemon = start_daemon(env.command(&[])).await;
    let conn = codepool_broker::connect(AMQP_URL, "test")
        .await
        .expect("amqp");
    let heard = Heard::listen(&conn, &env).await;
    let publisher = Publisher::new(&conn, env.topology())
        .await
        .expect("publisher")
        .as_user("guest");

    drive_every_event(&env, &publisher, &heard).await;
    send_receipts_and_redemptions(&daemon.addr, &env, &publisher, &heard).await;

    let all = heard.all();
    for (key, body) in &all {
        schemas
            .for_key(key)
            .assert_valid(body, &format!("a {key} message"));
    }
    let kinds: std::collections::BTreeSet<&str> = all.iter().map(|(k, _)| k.as_str()).collect();
    for key in [
        "sms.pending",
        "sms.sent",
        "sms.failed",
        "pool.low_stock",
        "pool.exhausted",
        "pool.replenished",
        "pool.paused",
        "pool.resumed",
        "purchase.refused",
        "code.redeemed",
    ] {
        assert!(
            kinds.contains(key),
            "no {key} message was checked: {kinds:?}"
        );
    }
    // Both shapes of sms.pending were among them.
    let shapes: Vec<Value> = all
        .iter()
        .filter(|(k, _)| k == "sms.pending")
        .filter_map(|(_, b)| serde_json::from_slice(b).ok())
        .collect();
    assert!(shapes
        .iter()
        .any(|e| e["code"].is_string() && e.get("codes").is_none()));
    assert!(shapes
        .iter()
        .any(|e| e["codes"].is_array() && e.get("code").is_none()));

    daemon.stop().await;
    codepool_broker::close(conn, "done").await;
    env.cleanup().await;
}

const PHONE: &str = "+8613800000000";

/// Purchases a dispatcher grants, by message id.
fn granted_bodies() -> Vec<(&'static str, Vec<u8>)> {
    let pool = "real";
    vec![
        (
            "A-1",
            json!({"order_id": "A-1", "uid": "u1", "phone": PHONE, "pool": pool}),
        ),
        (
            "A-2",
            json!({"order_id": "A-2", "uid": "u1", "phone": PHONE, "pool": pool,
                   "purchased_at": "2026-11-20T10:00:00Z", "quantity": 3}),
        ),
        (
            "A-3",
            json!({"order_id": "A-3", "uid": "u1", "phone": "8613800000000", "pool": pool,
                   "purchased_at": null, "quantity": null}),
        ),
        (
            "A-4",
            json!({"order_id": "A-4", "uid": "u1", "phone": PHONE, "pool": pool, "channel": "web"}),
        ),
        (
            "订单 5",
            json!({"order_id": "订单 5", "uid": "用户 1", "phone": PHONE, "pool": pool}),
        ),
        (
            "A-6",
            json!({"order_id": "A-6", "uid": "u1", "phone": PHONE, "pool": pool, "purchased_at": ""}),
        ),
    ]
    .into_iter()
    .map(|(id, v)| (id, v.to_string().into_bytes()))
    .collect()
}

/// Purchases a dispatcher dead-letters, by message id.
fn dead_bodies() -> Vec<(&'static str, Vec<u8>)> {
    let ok = |id: &str| json!({"order_id": id, "uid": "u1", "phone": PHONE, "pool": "real"});
    let with = |id: &str, field: &str, value: Value| {
        let mut v = ok(id);
        v[field] = value;
        v.to_string().into_bytes()
    };
    let mut no_phone = ok("D-phone-missing");
    if let Some(o) = no_phone.as_object_mut() {
        o.remove("phone");
    }
    let twice = format!(
        r#"{{"order_id":"D-twice","uid":"u1","phone":"{PHONE}","pool":"real","uid":"u2"}}"#
    );
    vec![
        ("D-not-json", b"{\"order_id\": \"D-not-json\",".to_vec()),
        ("D-not-object", b"[\"D-not-object\"]".to_vec()),
        ("D-phone-missing", no_phone.to_string().into_bytes()),
        ("D-wrong-type", with("D-wrong-type", "uid", json!(123))),
        (
            "D-too-long",
            with("D-too-long", "uid", json!("u".repeat(129))),
        ),
        ("D-phone", with("D-phone", "phone", json!("+86-138-0000"))),
        ("D-pool", with("D-pool", "pool", json!("bad pool!"))),
        ("D-time", with("D-time", "purchased_at", json!("yesterday"))),
        ("D-bidi", with("D-bidi", "uid", json!("\u{202e}txt.exe"))),
        ("D-zwsp", with("D-zwsp", "uid", json!("u\u{200b}1"))),
        ("D-nbsp", with("D-nbsp", "uid", json!("u\u{a0}1"))),
        ("D-q0", with("D-q0", "quantity", json!(0))),
        ("D-qneg", with("D-qneg", "quantity", json!(-1))),
        ("D-qfrac", with("D-qfrac", "quantity", json!(2.5))),
        ("D-qstr", with("D-qstr", "quantity", json!("2"))),
        ("D-q101", with("D-q101", "quantity", json!(101))),
        (
            "D-large",
            with("D-large", "note", json!("x".repeat(70 * 1024))),
        ),
        ("D-twice", twice.into_bytes()),
        // Well formed, and dead for what no schema of one message can see:
        ("D-ghost", with("D-ghost", "pool", json!("ghost"))),
        ("A-1", with("A-1", "uid", json!("someone-else"))),
    ]
}

#[tokio::test]
async fn purchases_a_dispatcher_grants_match_the_schema_and_those_it_dead_letters_do_not() {
    let schemas = Schemas::load();
    let env = TestEnv::with_pools("schemas_purchases", &[("real", 20)]).await;
    let daemon = start_daemon(env.command(&[])).await;
    let (conn, publisher) = env.amqp().await;
    let (granted, dead) = (granted_bodies(), dead_bodies());
    for (id, body) in granted.iter().chain(&dead) {
        publish_bytes(&publisher, body, Some(id)).await;
    }

    let ch = conn.create_channel().await.expect("channel");
    let t = env.topology();
    eventually(Duration::from_secs(30), "every dead letter", || {
        let (ch, q) = (ch.clone(), t.purchases_dead.clone());
        let n = dead.len() as u32;
        async move { queue_depth(&ch, &q).await >= n }
    })
    .await;
    for (id, body) in &granted {
        eventually(Duration::from_secs(30), id, || async {
            count_codes(&env, id).await >= 1
        })
        .await;
        assert_eq!(schemas.purchase_errors(body), None, "{id} was granted");
    }
    let reasons: HashMap<String, String> = drain(&ch, &t.purchases_dead)
        .await
        .into_iter()
        .map(|m| {
            (
                m.message_id.unwrap_or_default(),
                m.reason.unwrap_or_default(),
            )
        })
        .collect();
    assert_eq!(reasons.len(), dead.len(), "{reasons:#?}");
    for (id, body) in &dead {
        let reason = reasons
            .get(*id)
            .unwrap_or_else(|| panic!("{id} not dead: {reasons:#?}"));
        let errors = schemas.purchase_errors(body);
        if reason.starts_with("unknown_pool") || reason.starts_with("conflicting_order") {
            assert_eq!(errors, None, "{id} ({reason}) is well formed");
        } else {
            assert!(
                errors.is_some(),
                "{id} was dead-lettered ({reason}) but matches the schema"
            );
        }
    }
    daemon.stop().await;
    codepool_broker::close(conn, "done").await;
    env.cleanup().await;
}

/// The examples of docs/messages.md: each line of its JSON blocks that is
/// whole JSON.
fn documented_examples() -> Vec<Value> {
    let doc = std::fs::read_to_string(repo().join("docs/messages.md")).expect("messages.md");
    doc.split("```json")
        .skip(1)
        .filter_map(|block| block.split("```").next())
        .flat_map(|block| block.lines().map(str::to_owned).collect::<Vec<_>>())
        .filter_map(|line| serde_json::from_str(&line).ok())
        .collect()
}

/// `v` with `field` set to `value`, or removed.
fn changed(mut v: Value, field: &str, value: Option<Value>) -> Vec<u8> {
    match value {
        Some(x) => v[field] = x,
        None => {
            if let Some(o) = v.as_object_mut() {
                o.remove(field);
            }
        }
    }
    v.to_string().into_bytes()
}

#[test]
fn the_documented_examples_and_fixtures_match_and_broken_messages_do_not() {
    let schemas = Schemas::load();
    let examples = documented_examples();
    assert!(examples.len() >= 5, "{examples:?}");
    for e in &examples {
        let body = e.to_string().into_bytes();
        if e["event"] == "purchase.refused" {
            schemas
                .for_key("purchase.refused")
                .assert_valid(&body, "an example");
        } else if e["event_id"]
            .as_str()
            .is_some_and(|id| id.starts_with("sms:"))
        {
            schemas
                .for_key("sms.pending")
                .assert_valid(&body, "an example");
        } else {
            assert_eq!(schemas.purchase_errors(&body), None, "{e}");
        }
    }
    // The sample purchases `make run` publishes.
    let fixtures =
        std::fs::read_to_string(repo().join("fixtures/purchases.jsonl")).expect("fixtures");
    for line in fixtures.lines().filter(|l| !l.trim().is_empty()) {
        assert_eq!(schemas.purchase_errors(line.as_bytes()), None, "{line}");
    }
    let sms = schemas.for_key("sms.pending");
    let at = "2026-11-20T10:00:00.123Z";
    let one = json!({"event_id": "sms:O-1", "order_id": "O-1", "uid": "u", "phone": PHONE,
                     "pool": "p", "code": "QWER-1234", "grant_no": "G1", "issued_at": at});
    sms.assert_valid(one.to_string().as_bytes(), "one code");
    let part = json!({"event_id": "sms:O-2:0-1", "order_id": "O-2", "uid": "u", "phone": PHONE,
                      "pool": "p", "quantity": 2,
                      "codes": [{"line": 0, "code": "A", "issued_at": at},
                                {"line": 1, "code": "B", "issued_at": at}]});
    sms.assert_valid(part.to_string().as_bytes(), "a part");
    for (what, body) in [
        (
            "one code and a list",
            changed(one.clone(), "codes", Some(part["codes"].clone())),
        ),
        ("one code without it", changed(one.clone(), "code", None)),
        (
            "a part with a code",
            changed(part.clone(), "code", Some(json!("X"))),
        ),
        ("a part without codes", changed(part.clone(), "codes", None)),
        (
            "a bad time",
            changed(one.clone(), "issued_at", Some(json!("yesterday"))),
        ),
    ] {
        assert!(sms.errors(&body).is_some(), "sms-pending accepts {what}");
    }
    let pool = schemas.for_key("pool.low_stock");
    let low = json!({"event": "pool.low_stock", "pool": "p", "at": at, "unissued": 3});
    pool.assert_valid(low.to_string().as_bytes(), "pool.low_stock");
    let unknown = changed(low.clone(), "event", Some(json!("pool.gone")));
    assert!(pool.errors(&unknown).is_some(), "an unknown pool event");
    assert!(pool.errors(&changed(low, "unissued", None)).is_some());
    let receipt = schemas.for_key("sms.sent");
    assert!(receipt.errors(br#"{"order_id":"O-1"}"#).is_some());
    let redeemed = schemas.for_key("code.redeemed");
    assert!(redeemed.errors(br#"{"pool":"p"}"#).is_some());
}

/// The text pattern the schemas share, read from the purchase schema.
fn text_pattern() -> String {
    let text = std::fs::read_to_string(repo().join("docs/schemas/purchase.schema.json")).unwrap();
    let schema: Value = serde_json::from_str(&text).unwrap();
    fn find(v: &Value) -> Option<String> {
        match v {
            Value::Object(m) => m
                .get("pattern")
                .and_then(Value::as_str)
                .filter(|p| p.contains("\\u202e") || p.contains("\\u2028"))
                .map(str::to_owned)
                .or_else(|| m.values().find_map(find)),
            Value::Array(a) => a.iter().find_map(find),
            _ => None,
        }
    }
    find(&schema).expect("the purchase schema has a text pattern")
}

/// The schemas' text pattern is written out as plain `\uXXXX` ranges (no
/// `\p{…}` classes, which Python's `re` cannot compile), and it refuses
/// exactly the characters codepool refuses in the Basic Multilingual
/// Plane: controls, format and bidi characters, private use and
/// whitespace other than an inner space (unassigned code points, which
/// change with each Unicode version, are left to codepool itself).
#[test]
fn the_text_pattern_refuses_what_codepool_refuses_without_unicode_classes() {
    use codepool_domain::text::{unreadable_kind, Unreadable};
    let pattern = text_pattern();
    assert!(!pattern.contains("\\p{"), "{pattern}");
    let schema = json!({"type": "string", "pattern": pattern});
    let v = jsonschema::validator_for(&schema).unwrap();
    let mut wrong = Vec::new();
    for cp in (0..0x10000u32).filter(|cp| !(0xd800..0xe000).contains(cp)) {
        let c = char::from_u32(cp).unwrap();
        let kind = unreadable_kind(c);
        if kind == Some(Unreadable::Unassigned) {
            continue;
        }
        let valid = v.is_valid(&json!(format!("a{c}b")));
        if valid != kind.is_none() {
            wrong.push(format!("U+{cp:04X} {kind:?} valid={valid}"));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} disagreements: {:?}",
        wrong.len(),
        &wrong[..wrong.len().min(20)]
    );
    assert!(!v.is_valid(&json!(" ")) && !v.is_valid(&json!("")));
    assert!(v.is_valid(&json!("游戏 X-1")));
}

/// An SMS service written in Python validates codepool's messages with
/// the most used validator, `jsonschema`: every schema compiles there and
/// judges a good and a hostile message as codepool does.
#[test]
fn every_schema_compiles_and_judges_text_in_pythons_jsonschema() {
    let python = repo().join(".services/venv/bin/python3");
    let script = r#"
import json, sys, glob, jsonschema
for path in sorted(glob.glob(sys.argv[1] + "/*.schema.json")):
    schema = json.load(open(path))
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator(schema).is_valid({})
good = {"order_id": "O-1 ü", "uid": "123213", "phone": "+8613800000000", "pool": "game-x"}
bad = dict(good, order_id="O-\u202e1")
v = jsonschema.Draft202012Validator(json.load(open(sys.argv[1] + "/purchase.schema.json")))
print(v.is_valid(good), v.is_valid(bad))
"#;
    let out = std::process::Command::new(&python)
        .args(["-c", script, repo().join("docs/schemas").to_str().unwrap()])
        .output()
        .unwrap_or_else(|e| panic!("{}: {e} (make services installs it)", python.display()));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "True False");
}
