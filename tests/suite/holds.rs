//! Checkout holds and bundles, against the real servers: the race for the
//! last codes, release and expiry serving backorders first, a late
//! payment, the per-buyer caps, bundles whole or waiting whole over both
//! doors, and a `kill -9` between a bundle's two claims.

use std::collections::HashSet;
use std::time::Duration;

use bson::doc;
use codepool_broker::Publisher;
use futures::StreamExt;
use serde_json::{json, Value};

use crate::api::{http, json_of, key, ApiServer};
use crate::common::*;

fn hold(id: &str, uid: &str, items: &[(&str, u32)], ttl: Option<u64>) -> Vec<u8> {
    let items: Vec<Value> = items
        .iter()
        .map(|(p, q)| json!({"pool": p, "quantity": q}))
        .collect();
    let mut body = json!({"hold_id": id, "uid": uid, "items": items});
    if let Some(t) = ttl {
        body["ttl_seconds"] = json!(t);
    }
    body.to_string().into_bytes()
}

fn paid(order: &str, uid: &str, pool: &str, quantity: u32, hold_id: &str) -> Vec<u8> {
    json!({"order_id": order, "uid": uid, "phone": "+8613800000000", "pool": pool,
           "quantity": quantity, "hold_id": hold_id})
    .to_string()
    .into_bytes()
}

fn bundle(order: &str, items: &[(&str, u32)]) -> Vec<u8> {
    let items: Vec<Value> = items
        .iter()
        .map(|(p, q)| json!({"pool": p, "quantity": q}))
        .collect();
    json!({"order_id": order, "uid": "u-b", "phone": "+8613800000000", "items": items})
        .to_string()
        .into_bytes()
}

async fn count(env: &TestEnv, filter: bson::Document) -> u64 {
    env.store
        .database()
        .collection::<bson::Document>("codes")
        .count_documents(filter)
        .await
        .unwrap()
}

/// The ids of the codes with `filter`.
async fn ids(env: &TestEnv, filter: bson::Document) -> HashSet<bson::oid::ObjectId> {
    let mut out = HashSet::new();
    let mut cur = env
        .store
        .database()
        .collection::<bson::Document>("codes")
        .find(filter)
        .await
        .unwrap();
    while let Some(d) = cur.next().await {
        out.insert(d.unwrap().get_object_id("_id").unwrap());
    }
    out
}

/// `codepool import` of these codes into `pool`.
async fn import(env: &TestEnv, pool: &str, codes: &[&str]) {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), format!("code\n{}\n", codes.join("\n"))).unwrap();
    codepool_ok(
        env,
        &["import", file.path().to_str().unwrap(), "--pool", pool],
    )
    .await;
}

async fn api_with_keys(env: &TestEnv) -> (ApiServer, String) {
    let k = key(env, "checkout", "orders:write,orders:read").await;
    let api = ApiServer::start(env, &["--rate-per-key", "100000"]).await;
    (api, k)
}

#[tokio::test]
async fn a_thousand_concurrent_holds_on_the_last_fifty_codes_hold_exactly_fifty() {
    let env = TestEnv::new("holds_race").await;
    env.fill_pool("last", 50).await;
    let (api, k) = api_with_keys(&env).await;
    let statuses: Vec<(u16, Value)> = futures::stream::iter(0..1000)
        .map(|i| {
            let (addr, k) = (api.addr.clone(), k.clone());
            async move {
                let body = hold(
                    &format!("H-{i}"),
                    &format!("buyer-{i}"),
                    &[("last", 1)],
                    None,
                );
                let (status, _, body) = http(&addr, "POST", "/v1/holds", Some(&k), &body).await;
                (status, json_of(&body))
            }
        })
        .buffer_unordered(250)
        .collect()
        .await;
    let held = statuses.iter().filter(|(s, _)| *s == 201).count();
    let refused = statuses
        .iter()
        .filter(|(s, _)| *s == 409 || *s == 429)
        .count();
    assert_eq!(held, 50, "exactly the last 50 codes are held");
    assert_eq!(held + refused, 1000, "every other hold is 409 or 429");
    let short = statuses
        .iter()
        .find(|(s, _)| *s == 409)
        .map(|(_, b)| b.clone())
        .expect("a 409");
    assert_eq!(
        short["type"].as_str().unwrap().rsplit('/').next(),
        Some("insufficient-stock"),
        "{short}"
    );
    assert_eq!(short["free"][0]["pool"], "last", "{short}");
    // No code held twice, and none shown: the answers carry no code.
    assert_eq!(count(&env, doc! {"pool": "last", "status": 4}).await, 50);
    assert_eq!(count(&env, doc! {"pool": "last", "status": 0}).await, 0);
    assert_eq!(count(&env, doc! {"pool": "last", "status": 1}).await, 0);
    for (_, b) in statuses.iter().filter(|(s, _)| *s == 201) {
        assert_eq!(b["state"], "held");
        assert!(b.get("codes").is_none(), "a hold shows no code: {b}");
    }
    // The stats count them as held, not issued.
    let stats = codepool_ok(&env, &["stats", "--pool", "last", "--json"]).await;
    let stats: Value = serde_json::from_str(&stats).unwrap();
    let row = &stats[0];
    assert_eq!(row["held"], 50, "{stats}");
    assert_eq!(row["issued"], 0, "{stats}");
    // A held code is in no lookup and no export.
    let export = env
        .command(&["export", "--pool", "last", "--status", "held", "--reveal"])
        .output()
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&export.stdout);
    assert!(
        !text.contains("last-"),
        "an export shows no held code: {text}"
    );
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn release_and_expiry_return_codes_to_waiting_backorders_first() {
    let env = TestEnv::new("holds_release").await;
    env.fill_pool("rel", 3).await;
    codepool_ok(
        &env,
        &["pool", "set", "--pool", "rel", "--hold-share", "100"],
    )
    .await;
    let (api, k) = api_with_keys(&env).await;
    let post = |body: Vec<u8>| {
        let (addr, k) = (api.addr.clone(), k.clone());
        async move {
            let (s, _, b) = http(&addr, "POST", "/v1/holds", Some(&k), &body).await;
            (s, json_of(&b))
        }
    };
    let (s, a) = post(hold("HA", "ua", &[("rel", 2)], Some(3))).await;
    assert_eq!(s, 201, "{a}");
    let (s, b) = post(hold("HB", "ub", &[("rel", 1)], None)).await;
    assert_eq!(s, 201, "{b}");
    // Everything is held: orders wait, oldest first.
    for (o, q) in [("O-1", 1), ("O-2", 2)] {
        let (s, _, body) = http(
            &api.addr,
            "POST",
            "/v1/orders",
            Some(&k),
            &crate::api::order(o, "rel", q),
        )
        .await;
        assert_eq!(s, 202, "{}", String::from_utf8_lossy(&body));
    }
    // The same hold again: 200. Another body under its id: 409.
    let (s, again) = post(hold("HB", "ub", &[("rel", 1)], None)).await;
    assert_eq!((s, again["state"].as_str()), (200, Some("held")));
    let (s, _) = post(hold("HB", "ub", &[("rel", 2)], None)).await;
    assert_eq!(s, 409);

    // Released: its code goes to the oldest waiting order.
    let (s, _, body) = http(&api.addr, "DELETE", "/v1/holds/HB", Some(&k), b"").await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(json_of(&body)["state"], "released");
    eventually(
        Duration::from_secs(20),
        "O-1 gets the released code",
        || async { count(&env, doc! {"order_id": "O-1", "status": 1}).await == 1 },
    )
    .await;
    assert_eq!(
        count(&env, doc! {"order_id": "O-2"}).await,
        0,
        "O-2 waits for two"
    );

    // HA expires: its two codes come back within 60 s, to O-2.
    let (s, _, body) = http(&api.addr, "GET", "/v1/holds/HA", Some(&k), b"").await;
    assert_eq!(s, 200);
    let expires =
        chrono::DateTime::parse_from_rfc3339(json_of(&body)["expires_at"].as_str().unwrap())
            .unwrap();
    eventually(
        Duration::from_secs(70),
        "O-2 gets the expired hold's codes",
        || async { count(&env, doc! {"order_id": "O-2", "status": 1}).await == 2 },
    )
    .await;
    let late = chrono::Utc::now().signed_duration_since(expires);
    assert!(
        late < chrono::Duration::seconds(60),
        "back within 60 s of expires_at, took {late}"
    );
    let (_, _, body) = http(&api.addr, "GET", "/v1/holds/HA", Some(&k), b"").await;
    assert_eq!(json_of(&body)["state"], "expired");
    assert_eq!(count(&env, doc! {"pool": "rel", "status": 4}).await, 0);
    // Another key's hold is not found.
    let other = key(&env, "other", "orders:write,orders:read").await;
    let (s, _, _) = http(&api.addr, "GET", "/v1/holds/HA", Some(&other), b"").await;
    assert_eq!(s, 404);
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_paid_hold_becomes_the_order_once_and_a_late_payment_is_never_refused() {
    let env = TestEnv::new("holds_commit").await;
    env.fill_pool("pay", 3).await;
    codepool_ok(
        &env,
        &["pool", "set", "--pool", "pay", "--hold-share", "100"],
    )
    .await;
    let (api, k) = api_with_keys(&env).await;
    let (s, _, _) = http(
        &api.addr,
        "POST",
        "/v1/holds",
        Some(&k),
        &hold("HP", "buyer", &[("pay", 2)], None),
    )
    .await;
    assert_eq!(s, 201);
    let held = ids(&env, doc! {"pool": "pay", "status": 4}).await;
    assert_eq!(held.len(), 2);
    // Paid: the held codes become the order's, exactly once.
    let (s, _, body) = http(
        &api.addr,
        "POST",
        "/v1/orders",
        Some(&k),
        &paid("OP", "buyer", "pay", 2, "HP"),
    )
    .await;
    assert_eq!(s, 201, "{}", String::from_utf8_lossy(&body));
    let first = json_of(&body);
    assert_eq!(first["state"], "granted");
    assert_eq!(
        ids(&env, doc! {"order_id": "OP", "status": 1}).await,
        held,
        "the held codes, no others"
    );
    let (s, _, body) = http(
        &api.addr,
        "POST",
        "/v1/orders",
        Some(&k),
        &paid("OP", "buyer", "pay", 2, "HP"),
    )
    .await;
    assert_eq!(s, 200);
    assert_eq!(
        json_of(&body)["codes"],
        first["codes"],
        "a retry gets the same codes"
    );
    let (_, _, body) = http(&api.addr, "GET", "/v1/holds/HP", Some(&k), b"").await;
    assert_eq!(
        (
            json_of(&body)["state"].clone(),
            json_of(&body)["order_id"].clone()
        ),
        (json!("committed"), json!("OP"))
    );

    // A hold that expired unpaid; its code is taken by someone else
    // meanwhile; the late payment waits as a backorder, never refused.
    let (s, _, _) = http(
        &api.addr,
        "POST",
        "/v1/holds",
        Some(&k),
        &hold("HL", "late", &[("pay", 1)], Some(1)),
    )
    .await;
    assert_eq!(s, 201);
    eventually(
        Duration::from_secs(30),
        "the expired hold's code is back",
        || async { count(&env, doc! {"pool": "pay", "status": 0}).await == 1 },
    )
    .await;
    let (s, _, _) = http(
        &api.addr,
        "POST",
        "/v1/orders",
        Some(&k),
        &crate::api::order("O-other", "pay", 1),
    )
    .await;
    assert_eq!(s, 201);
    let (s, _, body) = http(
        &api.addr,
        "POST",
        "/v1/orders",
        Some(&k),
        &paid("OL", "late", "pay", 1, "HL"),
    )
    .await;
    assert_eq!(
        s,
        202,
        "backordered, not refused: {}",
        String::from_utf8_lossy(&body)
    );
    assert_eq!(json_of(&body)["state"], "waiting");
    // With stock, a late payment is granted from it.
    import(&env, "pay", &["pay-NEW-1", "pay-NEW-2"]).await;
    let (s, _, _) = http(
        &api.addr,
        "POST",
        "/v1/holds",
        Some(&k),
        &hold("HM", "late2", &[("pay", 1)], Some(1)),
    )
    .await;
    assert_eq!(s, 201);
    eventually(
        Duration::from_secs(30),
        "the second expired hold's code is back",
        || async { count(&env, doc! {"pool": "pay", "status": 4}).await == 0 },
    )
    .await;
    let (s, _, body) = http(
        &api.addr,
        "POST",
        "/v1/orders",
        Some(&k),
        &paid("OM", "late2", "pay", 1, "HM"),
    )
    .await;
    assert_eq!(
        s,
        201,
        "granted from stock: {}",
        String::from_utf8_lossy(&body)
    );
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn one_buyer_cannot_hold_a_whole_pool() {
    let env = TestEnv::new("holds_caps").await;
    env.fill_pool("cap", 100).await;
    let (api, k) = api_with_keys(&env).await;
    let post = |id: &str, uid: &str, q: u32| {
        let (addr, k, body) = (
            api.addr.clone(),
            k.clone(),
            hold(id, uid, &[("cap", q)], None),
        );
        async move {
            let (s, _, b) = http(&addr, "POST", "/v1/holds", Some(&k), &body).await;
            (s, json_of(&b))
        }
    };
    // 10% of 100 by default.
    let (s, p) = post("G-all", "greedy", 100).await;
    assert_eq!(s, 429, "{p}");
    assert_eq!(p["limit"], 10, "{p}");
    assert!(
        p["detail"].as_str().unwrap().contains("nothing was held"),
        "{p}"
    );
    assert_eq!(count(&env, doc! {"pool": "cap", "status": 4}).await, 0);
    let (s, _) = post("G-1", "greedy", 10).await;
    assert_eq!(s, 201);
    let (s, _) = post("G-2", "greedy", 1).await;
    assert_eq!(s, 429, "the eleventh code is over the share");
    assert_eq!(count(&env, doc! {"pool": "cap", "status": 4}).await, 10);
    // Open holds per buyer.
    codepool_ok(
        &env,
        &["pool", "set", "--pool", "cap", "--holds-per-uid", "2"],
    )
    .await;
    for i in 0..2 {
        let (s, _) = post(&format!("M-{i}"), "many", 1).await;
        assert_eq!(s, 201);
    }
    let (s, p) = post("M-2", "many", 1).await;
    assert_eq!(s, 429, "{p}");
    assert_eq!(p["limit"], 2);
    // Bad settings are refused with the rule.
    let out = env
        .command(&["pool", "set", "--pool", "cap", "--hold-share", "0"])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("1 to 100"));
    // The buyer's holds show in `codepool lookup`.
    let found = codepool_ok(&env, &["lookup", "--uid", "greedy"]).await;
    assert!(
        found.contains("hold: G-1") && found.contains("10 × cap"),
        "{found}"
    );
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_bundle_waits_whole_for_an_empty_pool_and_is_granted_whole_after_an_import() {
    let env = TestEnv::new("bundle_http").await;
    env.fill_pool("ba", 5).await;
    codepool_ok(&env, &["pool", "create", "--pool", "bb"]).await;
    let (api, k) = api_with_keys(&env).await;
    let (s, _, body) = http(
        &api.addr,
        "POST",
        "/v1/orders",
        Some(&k),
        &bundle("BO-1", &[("ba", 2), ("bb", 1)]),
    )
    .await;
    assert_eq!(s, 202, "{}", String::from_utf8_lossy(&body));
    let waiting = json_of(&body);
    assert_eq!(waiting["state"], "waiting");
    assert_eq!(waiting["waiting_lines"], json!([0, 1, 2]));
    assert_eq!(
        waiting["items"],
        json!([{"pool": "ba", "quantity": 2}, {"pool": "bb", "quantity": 1}])
    );
    // Nothing is taken from the first pool while it waits.
    assert_eq!(count(&env, doc! {"pool": "ba", "status": 0}).await, 5);
    // A bundle naming an unknown pool is refused whole.
    let (s, _, body) = http(
        &api.addr,
        "POST",
        "/v1/orders",
        Some(&k),
        &bundle("BO-2", &[("ba", 1), ("nope", 1)]),
    )
    .await;
    assert_eq!(s, 422);
    assert_eq!(json_of(&body)["field"], "pool");
    assert_eq!(count(&env, doc! {"pool": "ba", "status": 0}).await, 5);

    // Codes arrive in the second pool: a dispatcher grants it whole.
    let d = start_daemon(env.command(&[])).await;
    import(&env, "bb", &["bb-ONLY-0001"]).await;
    eventually(
        Duration::from_secs(40),
        "the bundle is granted whole",
        || async { count(&env, doc! {"order_id": "BO-1", "status": 1}).await == 3 },
    )
    .await;
    assert_eq!(
        count(&env, doc! {"order_id": "BO-1", "pool": "ba"}).await,
        2
    );
    assert_eq!(
        count(
            &env,
            doc! {"order_id": "BO-1", "pool": "bb", "order_line": 2}
        )
        .await,
        1
    );
    // Another attempt at the same bundle (the API's backorder sweep beside
    // the dispatcher's) may still hold a code it is about to put back.
    eventually(Duration::from_secs(20), "nothing left held", || async {
        count(&env, doc! {"status": 4}).await == 0
    })
    .await;
    let (s, _, body) = http(&api.addr, "GET", "/v1/orders/BO-1", Some(&k), b"").await;
    assert_eq!(s, 200);
    assert_eq!(json_of(&body)["codes"].as_array().unwrap().len(), 3);
    // The same order again: its codes, each with its pool. Under the same
    // id with other items, or by another key: 409, and no code shown.
    let same = bundle("BO-1", &[("ba", 2), ("bb", 1)]);
    let (s, _, body) = http(&api.addr, "POST", "/v1/orders", Some(&k), &same).await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&body));
    let pools: Vec<Value> = (json_of(&body)["codes"].as_array().unwrap().iter())
        .map(|c| c["pool"].clone())
        .collect();
    assert_eq!(pools, vec![json!("ba"), json!("ba"), json!("bb")]);
    let other = bundle("BO-1", &[("ba", 1), ("bb", 2)]);
    let (s, _, body) = http(&api.addr, "POST", "/v1/orders", Some(&k), &other).await;
    assert_eq!(s, 409, "{}", String::from_utf8_lossy(&body));
    assert!(
        !String::from_utf8_lossy(&body).contains("ba-"),
        "no code shown"
    );
    let thief = key(&env, "thief", "orders:write").await;
    let (s, _, body) = http(&api.addr, "POST", "/v1/orders", Some(&thief), &same).await;
    assert_eq!(s, 409);
    assert!(
        !String::from_utf8_lossy(&body).contains("ba-"),
        "no code shown"
    );
    d.stop().await;
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn the_same_bundle_over_amqp_waits_whole_and_is_granted_whole() {
    let env = TestEnv::new("bundle_amqp").await;
    env.fill_pool("qa", 4).await;
    codepool_ok(&env, &["pool", "create", "--pool", "qb"]).await;
    let d = start_daemon(env.command(&[])).await;
    let conn = codepool_broker::connect(AMQP_URL, "test").await.unwrap();
    let publisher = Publisher::new(&conn, env.topology()).await.unwrap();
    let p = codepool_domain::Purchase::parse(&bundle("BQ-1", &[("qa", 2), ("qb", 2)])).unwrap();
    publish_confirmed(&publisher, std::slice::from_ref(&p)).await;
    eventually(
        Duration::from_secs(20),
        "the bundle waits as a backorder",
        || async {
            env.store
                .backorders_for_orders(&["BQ-1"])
                .await
                .unwrap()
                .len()
                == 1
        },
    )
    .await;
    assert_eq!(
        count(&env, doc! {"pool": "qa", "status": 0}).await,
        4,
        "nothing taken from qa"
    );
    // One code in qb is not enough: it still waits whole. A bundle waits
    // under its first item's pool: stock news of qa makes the dispatcher
    // try it now (not at its next sweep), and it is judged once that news
    // has been handled.
    import(&env, "qb", &["qb-ONE-0001"]).await;
    let news = codepool_domain::PoolEvent::new(codepool_domain::PoolEventKind::Replenished, "qa");
    let confirm = publisher.publish_pool_event(&news).await.unwrap();
    confirm.wait().await.unwrap();
    pool_events_handled(
        &env,
        &publisher,
        codepool_domain::PoolEventKind::Replenished,
    )
    .await;
    assert_eq!(
        count(&env, doc! {"order_id": "BQ-1"}).await,
        0,
        "no half bundle"
    );
    assert_eq!(
        count(&env, doc! {"status": 4}).await,
        0,
        "what it tried is back in stock"
    );
    import(&env, "qb", &["qb-TWO-0002"]).await;
    eventually(Duration::from_secs(40), "granted whole", || async {
        count(&env, doc! {"order_id": "BQ-1", "status": 1}).await == 4
    })
    .await;
    let lines = [("qa", 0), ("qa", 1), ("qb", 2), ("qb", 3)];
    for (pool, line) in lines {
        let mut f = doc! {"order_id": "BQ-1", "pool": pool};
        if line > 0 {
            f.insert("order_line", line as i64);
        } else {
            f.insert("order_line", doc! {"$exists": false});
        }
        assert_eq!(count(&env, f).await, 1, "line {line} of pool {pool}");
    }
    // A redelivery of the same bundle is the same order: nothing more,
    // once the dispatcher has settled it.
    let before = settled(&[&d.addr]).await;
    publish_confirmed(&publisher, &[p]).await;
    wait_settled(&[&d.addr], before + 1).await;
    assert_eq!(count(&env, doc! {"order_id": "BQ-1"}).await, 4);
    d.stop().await;
    env.cleanup().await;
}

/// Needs the `failpoints` feature (`make test` builds with it): the
/// dispatcher pauses between the bundle's two claims.
#[cfg(feature = "failpoints")]
#[tokio::test]
async fn a_kill_between_a_bundles_two_claims_loses_no_code_and_shows_none() {
    let env = TestEnv::new("bundle_kill").await;
    env.fill_pool("ka", 3).await;
    env.fill_pool("kb", 3).await;
    let mut cmd = env.command(&[]);
    cmd.env("CODEPOOL_FAILPOINTS", "bundle-pause=60000");
    let mut d = start_daemon(cmd).await;
    let conn = codepool_broker::connect(AMQP_URL, "test").await.unwrap();
    let publisher = Publisher::new(&conn, env.topology()).await.unwrap();
    let p = codepool_domain::Purchase::parse(&bundle("BK-1", &[("ka", 2), ("kb", 1)])).unwrap();
    publish_confirmed(&publisher, &[p]).await;
    eventually(
        Duration::from_secs(20),
        "the bundle's codes are held",
        || async { count(&env, doc! {"status": 4}).await == 3 },
    )
    .await;
    // kill -9 between the hold and the commit.
    let pid = d.child.id().unwrap().to_string();
    let status = std::process::Command::new("kill")
        .args(["-KILL", &pid])
        .status()
        .unwrap();
    assert!(status.success());
    let _ = d.child.wait().await;
    // None shown: the order holds no code, and no lookup shows the held.
    assert_eq!(count(&env, doc! {"order_id": "BK-1"}).await, 0);
    let out = env
        .command(&["lookup", "--uid", "u-b"])
        .output()
        .await
        .unwrap();
    assert!(!String::from_utf8_lossy(&out.stdout).contains("ka-"));
    // The redelivery completes it whole with the same codes.
    let held = ids(&env, doc! {"status": 4}).await;
    let d = start_daemon(env.command(&[])).await;
    eventually(
        Duration::from_secs(30),
        "the bundle is granted whole",
        || async { count(&env, doc! {"order_id": "BK-1", "status": 1}).await == 3 },
    )
    .await;
    assert_eq!(ids(&env, doc! {"order_id": "BK-1"}).await, held);
    // No code lost: 3 issued, 3 in stock, none held.
    assert_eq!(count(&env, doc! {"status": 0}).await, 3);
    assert_eq!(count(&env, doc! {"status": 4}).await, 0);
    d.stop().await;
    env.cleanup().await;
}
