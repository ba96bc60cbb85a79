//! Checkout holds and bundles, against the real servers: the race for the
//! last codes, release and expiry serving backorders first, a late
//! payment, the per-buyer caps, bundles whole or waiting whole over both
//! doors, and a `kill -9` between a bundle's two claims. Held codes are
//! not counted as issued, hold ids are each owner's own, a held code is
//! voided only once its hold is released and never shows the hold's
//! internal key; and where holds cross a recall, an expiry, a pause or
//! another shop, the gate (`codepool_domain::gate`,
//! `issuance::held::commit_paid`) holds.

use std::time::Duration;

use bson::doc;
use bson::oid::ObjectId;
use codepool_broker::Publisher;
use futures::StreamExt;
use serde_json::{json, Value};

use crate::api::{http, json_of, key, order, ApiServer};
use crate::common::*;
use crate::fixtures::*;
use crate::webhooks::{publisher, shop_purchase};

fn hold_items(id: &str, uid: &str, items: &[(&str, u32)], ttl: Option<u64>) -> Vec<u8> {
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

fn bundle(order: &str, items: &[(&str, u32)]) -> Vec<u8> {
    let items: Vec<Value> = items
        .iter()
        .map(|(p, q)| json!({"pool": p, "quantity": q}))
        .collect();
    json!({"order_id": order, "uid": "u-b", "phone": "+8613800000000", "items": items})
        .to_string()
        .into_bytes()
}

#[tokio::test]
async fn a_thousand_concurrent_holds_on_the_last_fifty_codes_hold_exactly_fifty() {
    let env = TestEnv::with_pools("holds_race", &[("last", 50)]).await;
    let (api, k) = checkout_api(&env).await;
    let statuses: Vec<(u16, Value)> = futures::stream::iter(0..1000)
        .map(|i| {
            let (addr, k) = (api.addr.clone(), k.clone());
            async move {
                let body = hold_items(
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
    assert_eq!(
        count_codes(&env, doc! {"pool": "last", "status": 4}).await,
        50
    );
    assert_eq!(
        count_codes(&env, doc! {"pool": "last", "status": 0}).await,
        0
    );
    assert_eq!(
        count_codes(&env, doc! {"pool": "last", "status": 1}).await,
        0
    );
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
        .run(&["export", "--pool", "last", "--status", "held", "--reveal"])
        .await;
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
    let env = TestEnv::with_pools("holds_release", &[("rel", 3)]).await;
    pool_set(&env, "rel", &["--hold-share", "100"]).await;
    let (api, k) = checkout_api(&env).await;
    let post = |body: Vec<u8>| {
        let (addr, k) = (api.addr.clone(), k.clone());
        async move {
            let (s, _, b) = http(&addr, "POST", "/v1/holds", Some(&k), &body).await;
            (s, json_of(&b))
        }
    };
    let (s, a) = post(hold_items("HA", "ua", &[("rel", 2)], Some(3))).await;
    assert_eq!(s, 201, "{a}");
    let (s, b) = post(hold_items("HB", "ub", &[("rel", 1)], None)).await;
    assert_eq!(s, 201, "{b}");
    // Everything is held: orders wait, oldest first.
    for (o, q) in [("O-1", 1), ("O-2", 2)] {
        let (s, _, body) = api
            .post("/v1/orders", &k, &crate::api::order(o, "rel", q))
            .await;
        assert_eq!(s, 202, "{}", String::from_utf8_lossy(&body));
    }
    // The same hold again: 200. Another body under its id: 409.
    let (s, again) = post(hold_items("HB", "ub", &[("rel", 1)], None)).await;
    assert_eq!((s, again["state"].as_str()), (200, Some("held")));
    let (s, _) = post(hold_items("HB", "ub", &[("rel", 2)], None)).await;
    assert_eq!(s, 409);

    // Released: its code goes to the oldest waiting order.
    let (s, _, body) = api.call("DELETE", "/v1/holds/HB", &k, b"").await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(json_of(&body)["state"], "released");
    eventually(
        Duration::from_secs(20),
        "O-1 gets the released code",
        || async { count_codes(&env, doc! {"order_id": "O-1", "status": 1}).await == 1 },
    )
    .await;
    assert_eq!(
        count_codes(&env, doc! {"order_id": "O-2"}).await,
        0,
        "O-2 waits for two"
    );

    // HA expires: its two codes come back within 60 s, to O-2.
    let (s, _, body) = api.get("/v1/holds/HA", &k).await;
    assert_eq!(s, 200);
    let expires =
        chrono::DateTime::parse_from_rfc3339(json_of(&body)["expires_at"].as_str().unwrap())
            .unwrap();
    eventually(
        Duration::from_secs(70),
        "O-2 gets the expired hold's codes",
        || async { count_codes(&env, doc! {"order_id": "O-2", "status": 1}).await == 2 },
    )
    .await;
    let late = chrono::Utc::now().signed_duration_since(expires);
    assert!(
        late < chrono::Duration::seconds(60),
        "back within 60 s of expires_at, took {late}"
    );
    let (_, _, body) = api.get("/v1/holds/HA", &k).await;
    assert_eq!(json_of(&body)["state"], "expired");
    assert_eq!(
        count_codes(&env, doc! {"pool": "rel", "status": 4}).await,
        0
    );
    // Another key's hold is not found.
    let other = key(&env, "other", "orders:write,orders:read").await;
    let (s, _, _) = api.get("/v1/holds/HA", &other).await;
    assert_eq!(s, 404);
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_paid_hold_becomes_the_order_once_and_a_late_payment_is_never_refused() {
    let env = TestEnv::with_pools("holds_commit", &[("pay", 3)]).await;
    pool_set(&env, "pay", &["--hold-share", "100"]).await;
    let (api, k) = checkout_api(&env).await;
    let (s, _, _) = api
        .post(
            "/v1/holds",
            &k,
            &hold_items("HP", "buyer", &[("pay", 2)], None),
        )
        .await;
    assert_eq!(s, 201);
    let held = code_ids(&env, doc! {"pool": "pay", "status": 4}).await;
    assert_eq!(held.len(), 2);
    // Paid: the held codes become the order's, exactly once.
    let (s, _, body) = api
        .post("/v1/orders", &k, &paid("OP", "buyer", "pay", 2, "HP"))
        .await;
    assert_eq!(s, 201, "{}", String::from_utf8_lossy(&body));
    let first = json_of(&body);
    assert_eq!(first["state"], "granted");
    assert_eq!(
        code_ids(&env, doc! {"order_id": "OP", "status": 1}).await,
        held,
        "the held codes, no others"
    );
    let (s, _, body) = api
        .post("/v1/orders", &k, &paid("OP", "buyer", "pay", 2, "HP"))
        .await;
    assert_eq!(s, 200);
    assert_eq!(
        json_of(&body)["codes"],
        first["codes"],
        "a retry gets the same codes"
    );
    let (_, _, body) = api.get("/v1/holds/HP", &k).await;
    assert_eq!(
        (
            json_of(&body)["state"].clone(),
            json_of(&body)["order_id"].clone()
        ),
        (json!("committed"), json!("OP"))
    );

    // A hold that expired unpaid; its code is taken by someone else
    // meanwhile; the late payment waits as a backorder, never refused.
    let (s, _, _) = api
        .post(
            "/v1/holds",
            &k,
            &hold_items("HL", "late", &[("pay", 1)], Some(1)),
        )
        .await;
    assert_eq!(s, 201);
    eventually(
        Duration::from_secs(30),
        "the expired hold's code is back",
        || async { count_codes(&env, doc! {"pool": "pay", "status": 0}).await == 1 },
    )
    .await;
    let (s, _, _) = api
        .post("/v1/orders", &k, &crate::api::order("O-other", "pay", 1))
        .await;
    assert_eq!(s, 201);
    let (s, _, body) = api
        .post("/v1/orders", &k, &paid("OL", "late", "pay", 1, "HL"))
        .await;
    assert_eq!(
        s,
        202,
        "backordered, not refused: {}",
        String::from_utf8_lossy(&body)
    );
    assert_eq!(json_of(&body)["state"], "waiting");
    // With stock, a late payment is granted from it.
    import_codes(&env, "pay", &["pay-NEW-1", "pay-NEW-2"]).await;
    let (s, _, _) = api
        .post(
            "/v1/holds",
            &k,
            &hold_items("HM", "late2", &[("pay", 1)], Some(1)),
        )
        .await;
    assert_eq!(s, 201);
    eventually(
        Duration::from_secs(30),
        "the second expired hold's code is back",
        || async { count_codes(&env, doc! {"pool": "pay", "status": 4}).await == 0 },
    )
    .await;
    let (s, _, body) = api
        .post("/v1/orders", &k, &paid("OM", "late2", "pay", 1, "HM"))
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
    let env = TestEnv::with_pools("holds_caps", &[("cap", 100)]).await;
    let (api, k) = checkout_api(&env).await;
    let post = |id: &str, uid: &str, q: u32| {
        let (addr, k, body) = (
            api.addr.clone(),
            k.clone(),
            hold_items(id, uid, &[("cap", q)], None),
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
    assert_eq!(
        count_codes(&env, doc! {"pool": "cap", "status": 4}).await,
        0
    );
    let (s, _) = post("G-1", "greedy", 10).await;
    assert_eq!(s, 201);
    let (s, _) = post("G-2", "greedy", 1).await;
    assert_eq!(s, 429, "the eleventh code is over the share");
    assert_eq!(
        count_codes(&env, doc! {"pool": "cap", "status": 4}).await,
        10
    );
    // Open holds per buyer.
    pool_set(&env, "cap", &["--holds-per-uid", "2"]).await;
    for i in 0..2 {
        let (s, _) = post(&format!("M-{i}"), "many", 1).await;
        assert_eq!(s, 201);
    }
    let (s, p) = post("M-2", "many", 1).await;
    assert_eq!(s, 429, "{p}");
    assert_eq!(p["limit"], 2);
    // Bad settings are refused with the rule.
    let out = env
        .run(&["pool", "set", "--pool", "cap", "--hold-share", "0"])
        .await;
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
    let env = TestEnv::with_pools("bundle_http", &[("ba", 5)]).await;
    codepool_ok(&env, &["pool", "create", "--pool", "bb"]).await;
    let (api, k) = checkout_api(&env).await;
    let (s, _, body) = api
        .post("/v1/orders", &k, &bundle("BO-1", &[("ba", 2), ("bb", 1)]))
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
    assert_eq!(count_codes(&env, doc! {"pool": "ba", "status": 0}).await, 5);
    // A bundle naming an unknown pool is refused whole.
    let (s, _, body) = api
        .post("/v1/orders", &k, &bundle("BO-2", &[("ba", 1), ("nope", 1)]))
        .await;
    assert_eq!(s, 422);
    assert_eq!(json_of(&body)["field"], "pool");
    assert_eq!(count_codes(&env, doc! {"pool": "ba", "status": 0}).await, 5);

    // Codes arrive in the second pool: a dispatcher grants it whole.
    let d = start_daemon(env.command(&[])).await;
    import_codes(&env, "bb", &["bb-ONLY-0001"]).await;
    eventually(
        Duration::from_secs(40),
        "the bundle is granted whole",
        || async { count_codes(&env, doc! {"order_id": "BO-1", "status": 1}).await == 3 },
    )
    .await;
    assert_eq!(
        count_codes(&env, doc! {"order_id": "BO-1", "pool": "ba"}).await,
        2
    );
    assert_eq!(
        count_codes(
            &env,
            doc! {"order_id": "BO-1", "pool": "bb", "order_line": 2}
        )
        .await,
        1
    );
    // Another attempt at the same bundle (the API's backorder sweep beside
    // the dispatcher's) may still hold a code it is about to put back.
    eventually(Duration::from_secs(20), "nothing left held", || async {
        count_codes(&env, doc! {"status": 4}).await == 0
    })
    .await;
    let (s, _, body) = api.get("/v1/orders/BO-1", &k).await;
    assert_eq!(s, 200);
    assert_eq!(json_of(&body)["codes"].as_array().unwrap().len(), 3);
    // The same order again: its codes, each with its pool. Under the same
    // id with other items, or by another key: 409, and no code shown.
    let same = bundle("BO-1", &[("ba", 2), ("bb", 1)]);
    let (s, _, body) = api.post("/v1/orders", &k, &same).await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&body));
    let pools: Vec<Value> = (json_of(&body)["codes"].as_array().unwrap().iter())
        .map(|c| c["pool"].clone())
        .collect();
    assert_eq!(pools, vec![json!("ba"), json!("ba"), json!("bb")]);
    let other = bundle("BO-1", &[("ba", 1), ("bb", 2)]);
    let (s, _, body) = api.post("/v1/orders", &k, &other).await;
    assert_eq!(s, 409, "{}", String::from_utf8_lossy(&body));
    assert!(
        !String::from_utf8_lossy(&body).contains("ba-"),
        "no code shown"
    );
    let thief = key(&env, "thief", "orders:write").await;
    let (s, _, body) = api.post("/v1/orders", &thief, &same).await;
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
    let env = TestEnv::with_pools("bundle_amqp", &[("qa", 4)]).await;
    codepool_ok(&env, &["pool", "create", "--pool", "qb"]).await;
    let d = start_daemon(env.command(&[])).await;
    let (_conn, publisher) = env.amqp().await;
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
        count_codes(&env, doc! {"pool": "qa", "status": 0}).await,
        4,
        "nothing taken from qa"
    );
    // One code in qb is not enough: it still waits whole. A bundle waits
    // under its first item's pool: stock news of qa makes the dispatcher
    // try it now (not at its next sweep), and it is judged once that news
    // has been handled.
    import_codes(&env, "qb", &["qb-ONE-0001"]).await;
    let news = codepool_domain::PoolEvent::new(codepool_domain::PoolEventKind::Replenished, "qa");
    publish_pool_event(&publisher, &news).await;
    pool_events_handled(
        &env,
        &publisher,
        codepool_domain::PoolEventKind::Replenished,
    )
    .await;
    assert_eq!(
        count_codes(&env, doc! {"order_id": "BQ-1"}).await,
        0,
        "no half bundle"
    );
    assert_eq!(
        count_codes(&env, doc! {"status": 4}).await,
        0,
        "what it tried is back in stock"
    );
    import_codes(&env, "qb", &["qb-TWO-0002"]).await;
    eventually(Duration::from_secs(40), "granted whole", || async {
        count_codes(&env, doc! {"order_id": "BQ-1", "status": 1}).await == 4
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
        assert_eq!(count_codes(&env, f).await, 1, "line {line} of pool {pool}");
    }
    // A redelivery of the same bundle is the same order: nothing more,
    // once the dispatcher has settled it.
    let before = settled(&[&d.addr]).await;
    publish_confirmed(&publisher, &[p]).await;
    wait_settled(&[&d.addr], before + 1).await;
    assert_eq!(count_codes(&env, doc! {"order_id": "BQ-1"}).await, 4);
    d.stop().await;
    env.cleanup().await;
}

/// Needs the `failpoints` feature (`make test` builds with it): the
/// dispatcher pauses between the bundle's two claims.
#[cfg(feature = "failpoints")]
#[tokio::test]
async fn a_kill_between_a_bundles_two_claims_loses_no_code_and_shows_none() {
    let env = TestEnv::with_pools("bundle_kill", &[("ka", 3), ("kb", 3)]).await;
    let mut cmd = env.command(&[]);
    cmd.env("CODEPOOL_FAILPOINTS", "bundle-pause=60000");
    let mut d = start_daemon(cmd).await;
    let (_conn, publisher) = env.amqp().await;
    let p = codepool_domain::Purchase::parse(&bundle("BK-1", &[("ka", 2), ("kb", 1)])).unwrap();
    publish_confirmed(&publisher, &[p]).await;
    eventually(
        Duration::from_secs(20),
        "the bundle's codes are held",
        || async { count_codes(&env, doc! {"status": 4}).await == 3 },
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
    assert_eq!(count_codes(&env, doc! {"order_id": "BK-1"}).await, 0);
    let out = env.run(&["lookup", "--uid", "u-b"]).await;
    assert!(!String::from_utf8_lossy(&out.stdout).contains("ka-"));
    // The redelivery completes it whole with the same codes.
    let held = code_ids(&env, doc! {"status": 4}).await;
    let d = start_daemon(env.command(&[])).await;
    eventually(
        Duration::from_secs(30),
        "the bundle is granted whole",
        || async { count_codes(&env, doc! {"order_id": "BK-1", "status": 1}).await == 3 },
    )
    .await;
    assert_eq!(code_ids(&env, doc! {"order_id": "BK-1"}).await, held);
    // No code lost: 3 issued, 3 in stock, none held.
    assert_eq!(count_codes(&env, doc! {"status": 0}).await, 3);
    assert_eq!(count_codes(&env, doc! {"status": 4}).await, 0);
    d.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn held_codes_are_not_counted_as_issued_in_the_last_hour_or_day() {
    let env = TestEnv::with_pools("holds_held_rate", &[("rate", 40)]).await;
    let backend = key(&env, "backend", "orders:write,orders:read").await;
    let (api, admin) = api_with_key(&env, "ops", "admin").await;
    let (s, _, b) = api
        .post("/v1/holds", &backend, &hold("H-rate", "u-hold", "rate", 3))
        .await;
    assert_eq!(s, 201, "{}", String::from_utf8_lossy(&b));
    let (s, _, b) = api
        .post("/v1/orders", &backend, &order("R-1", "rate", 2))
        .await;
    assert_eq!(s, 201, "{}", String::from_utf8_lossy(&b));

    // `codepool stats`: three held, two issued, and only the two issued
    // in the last hour and day.
    let out = codepool_ok(&env, &["stats", "--pool", "rate", "--json"]).await;
    let row = &serde_json::from_str::<Value>(&out).unwrap()[0];
    assert_eq!(row["held"], 3, "{out}");
    assert_eq!(row["issued"], 2, "{out}");
    assert_eq!(row["issued_last_hour"], 2, "{out}");
    assert_eq!(row["issued_last_day"], 2, "{out}");

    // GET /v1/pools says the same.
    let (s, _, b) = api.get("/v1/pools", &admin).await;
    assert_eq!(s, 200);
    let stats = &json_of(&b)["pools"][0]["stats"];
    assert_eq!(stats["held"], 3, "{stats}");
    assert_eq!(stats["issued_last_hour"], 2, "{stats}");
    assert_eq!(stats["issued_last_day"], 2, "{stats}");

    // A used code still counts; the hold, paid, counts once it is issued.
    codepool_ok(&env, &["redeem", "--order", "R-1"]).await;
    let (s, _, b) = api
        .post(
            "/v1/orders",
            &backend,
            &paid("R-2", "u-hold", "rate", 3, "H-rate"),
        )
        .await;
    assert_eq!(s, 201, "{}", String::from_utf8_lossy(&b));
    let out = codepool_ok(&env, &["stats", "--pool", "rate", "--json"]).await;
    let row = &serde_json::from_str::<Value>(&out).unwrap()[0];
    assert_eq!(row["held"], 0, "{out}");
    assert_eq!(row["issued_last_hour"], 5, "{out}");
    assert_eq!(row["issued_last_day"], 5, "{out}");
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn two_shops_and_a_backend_each_use_hold_id_cart_1_and_each_pays_its_own() {
    let env = TestEnv::with_pools("holds_hold_ns", &[("hx", 40)]).await;
    pool_set(&env, "hx", &["--hold-share", "100"]).await;
    // The suite publishes as the broker's guest user.
    for shop in ["acme", "bolt"] {
        crate::fixtures::shop(&env, shop, "hx").await;
    }
    let acme = shop_key(&env, "acme-1", "acme").await;
    let bolt = shop_key(&env, "bolt-1", "bolt").await;
    let (api, backend) = api_with_key(&env, "backend", "orders:write,orders:read").await;

    // One hold id, three owners: three holds.
    for (k, uid, n) in [(&acme, "ann", 1), (&bolt, "bob", 2), (&backend, "cy", 3)] {
        let (s, _, b) = api
            .post("/v1/holds", k, &hold("cart-1", uid, "hx", n))
            .await;
        assert_eq!(s, 201, "{uid}: {}", String::from_utf8_lossy(&b));
        assert_eq!(json_of(&b)["hold_id"], "cart-1");
    }
    // Each sees its own; the same request again is the same hold.
    for (k, uid) in [(&acme, "ann"), (&bolt, "bob"), (&backend, "cy")] {
        let (s, _, b) = api.get("/v1/holds/cart-1", k).await;
        assert_eq!(s, 200);
        assert_eq!(json_of(&b)["uid"], uid);
    }
    let (s, _, _) = api
        .post("/v1/holds", &acme, &hold("cart-1", "ann", "hx", 1))
        .await;
    assert_eq!(s, 200, "a repeat");
    let (s, _, _) = api
        .post("/v1/holds", &acme, &hold("cart-1", "ann", "hx", 2))
        .await;
    assert_eq!(s, 409, "another hold under acme's own id");
    let held_by = |uid: &'static str| code_ids(&env, doc! {"status": 4, "uid": uid});
    let (ann, bob, cy) = (
        held_by("ann").await,
        held_by("bob").await,
        held_by("cy").await,
    );
    assert_eq!((ann.len(), bob.len(), cy.len()), (1, 2, 3));

    // acme pays its own hold over HTTP.
    let (s, _, b) = api
        .post("/v1/orders", &acme, &paid("A-1", "ann", "hx", 1, "cart-1"))
        .await;
    assert_eq!(s, 201, "{}", String::from_utf8_lossy(&b));
    assert_eq!(code_ids(&env, doc! {"order_id": "A-1"}).await, ann);
    let state = |k: String| {
        let addr = api.addr.clone();
        async move {
            let (_, _, b) = http(&addr, "GET", "/v1/holds/cart-1", Some(&k), b"").await;
            json_of(&b)["state"].as_str().unwrap().to_owned()
        }
    };
    assert_eq!(state(acme.clone()).await, "committed");
    assert_eq!(state(bolt.clone()).await, "held");
    assert_eq!(state(backend.clone()).await, "held");

    // Over AMQP: bolt's purchase pays bolt's hold; a purchase naming no
    // shop pays the hold of the key of no shop.
    let daemon = start_daemon(env.command(&[])).await;
    let (conn, publisher) = publisher(&env).await;
    let mut theirs = shop_purchase("B-1", "hx", "bolt");
    theirs.uid = "bob".into();
    theirs.quantity = 2;
    theirs.hold_id = Some("cart-1".into());
    let mut nobody = purchase("C-1", "hx");
    nobody.uid = "cy".into();
    nobody.quantity = 3;
    nobody.hold_id = Some("cart-1".into());
    publish_confirmed(&publisher, &[theirs, nobody]).await;
    eventually(Duration::from_secs(30), "both orders placed", || async {
        code_ids(
            &env,
            doc! {"order_id": {"$in": ["B-1", "C-1"]}, "status": 1},
        )
        .await
        .len()
            == 5
    })
    .await;
    assert_eq!(code_ids(&env, doc! {"order_id": "B-1"}).await, bob);
    assert_eq!(code_ids(&env, doc! {"order_id": "C-1"}).await, cy);
    // A payment moves the codes, then ends the hold: the hold is
    // committed a moment after its codes are the order's.
    eventually(Duration::from_secs(10), "both holds committed", || async {
        state(bolt.clone()).await == "committed" && state(backend.clone()).await == "committed"
    })
    .await;

    // A release touches only the releasing owner's hold.
    let (s, _, b) = api
        .post("/v1/holds", &bolt, &hold("cart-2", "bob", "hx", 1))
        .await;
    assert_eq!(s, 201, "{}", String::from_utf8_lossy(&b));
    let (s, _, b) = api
        .post("/v1/holds", &acme, &hold("cart-2", "ann", "hx", 1))
        .await;
    assert_eq!(s, 201, "{}", String::from_utf8_lossy(&b));
    let (s, _, b) = api.call("DELETE", "/v1/holds/cart-2", &bolt, b"").await;
    assert_eq!(s, 200);
    assert_eq!(json_of(&b)["state"], "released");
    let (_, _, b) = api.get("/v1/holds/cart-2", &acme).await;
    assert_eq!(json_of(&b)["state"], "held");
    assert_eq!(json_of(&b)["uid"], "ann");
    daemon.stop().await;
    api.stop().await;
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}

#[tokio::test]
async fn void_of_a_held_code_names_its_hold_says_to_release_it_first_and_changes_nothing() {
    let env = TestEnv::with_pools("holds_void_held", &[("vh", 3)]).await;
    pool_set(&env, "vh", &["--hold-share", "100"]).await;
    let (api, k) = api_with_key(&env, "checkout", "orders:write,orders:read").await;
    let (s, _, b) = api
        .post("/v1/holds", &k, &hold("H-vh", "vic", "vh", 1))
        .await;
    assert_eq!(s, 201, "{}", String::from_utf8_lossy(&b));
    let codes = env.coll("codes");
    let held = codes
        .find_one(doc! {"pool": "vh", "status": 4})
        .await
        .unwrap()
        .expect("the held code");
    let code = env.plain_code(&held);
    assert_eq!(pool_statuses(&env, "vh").await, [2, 0, 0, 0, 1]);

    // Voided while held: refused, naming the hold and what to do; nothing moves.
    let void = ["void", "--code", &code, "--pool", "vh", "--reason", "leak"];
    let out = env.run(&void).await;
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("held by checkout hold \"H-vh\""), "{err}");
    assert!(err.contains("Release the hold first"), "{err}");
    assert!(err.contains("DELETE /v1/holds/H-vh"), "{err}");
    assert!(!err.contains("redeemed"), "not a redeem: {err}");
    assert!(!err.contains("hold:0"), "no internal key: {err}");
    assert_eq!(
        pool_statuses(&env, "vh").await,
        [2, 0, 0, 0, 1],
        "nothing moved"
    );
    let (_, _, b) = api.get("/v1/holds/H-vh", &k).await;
    assert_eq!(json_of(&b)["state"], "held", "the hold stands");

    // As told: the hold released, the code is stock again and is voided.
    let (s, _, b) = api.call("DELETE", "/v1/holds/H-vh", &k, b"").await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    let out = codepool_ok(&env, &void).await;
    assert!(out.contains("voided unissued code"), "{out}");
    assert_eq!(pool_statuses(&env, "vh").await, [2, 0, 0, 1, 0]);
    let now = codes
        .find_one(doc! {"_id": held.get_object_id("_id").unwrap()})
        .await
        .unwrap()
        .unwrap();
    assert_eq!(now.get_i32("status").unwrap(), 3);
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_code_voided_while_held_shows_its_hold_and_never_the_internal_key() {
    let env = TestEnv::new("holds_void_key").await;
    let leaked: Vec<String> = (0..3).map(|i| format!("LEAK-{i:04}")).collect();
    let import_id = import_codes(&env, "rh", &leaked).await;
    pool_set(&env, "rh", &["--hold-share", "100"]).await;
    let (api, k) = api_with_key(&env, "checkout", "orders:write,orders:read").await;
    let (s, _, b) = api
        .post("/v1/holds", &k, &hold("H-rh", "rhu", "rh", 2))
        .await;
    assert_eq!(s, 201, "{}", String::from_utf8_lossy(&b));
    let held = env
        .coll("codes")
        .find_one(doc! {"pool": "rh", "status": 4})
        .await
        .unwrap()
        .expect("a held code");
    let code = env.plain_code(&held);
    codepool_ok(&env, &["void", "--import", &import_id, "--reason", "leak"]).await;
    assert_eq!(pool_statuses(&env, "rh").await, [0, 0, 0, 3, 0]);

    // No output shows the internal key, raw or escaped.
    let leaks = |text: &str| {
        text.contains('\u{1}')
            || text.contains("\\u{1}")
            || text.contains("\\u0001")
            || text.contains("hold:0")
            || text.contains("hold:1")
    };
    let by_code = ["lookup", "--code", &code, "--pool", "rh"];
    let table = codepool_ok(&env, &by_code).await;
    assert!(!leaks(&table), "{table}");
    assert!(table.contains("hold: H-rh"), "{table}");
    let mut by_code_json = by_code.to_vec();
    by_code_json.push("--json");
    let out = codepool_ok(&env, &by_code_json).await;
    assert!(!leaks(&out), "{out}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["codes"][0]["status"], "void", "{v}");
    assert_eq!(v["codes"][0]["hold_id"], "H-rh", "{v}");
    assert_eq!(v["codes"][0]["order_id"], Value::Null, "{v}");
    assert_eq!(v["codes"][0]["sms"]["state"], "-", "never texted: {v}");
    for args in [
        &["lookup", "--uid", "rhu"][..],
        &["lookup", "--uid", "rhu", "--json"][..],
        &["lookup", "--pool", "rh", "--json"][..],
    ] {
        let out = env.run(args).await;
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(!leaks(&text), "{args:?}: {text}");
    }
    // The pool's latest grants: a code a hold set aside was never granted.
    let out = (env.command(&["lookup", "--pool", "rh", "--json"]).output())
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "nothing found");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["codes"].as_array().unwrap().len(), 0, "{v}");
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("void.csv");
    let path = csv.to_str().unwrap();
    codepool_ok(
        &env,
        &["export", "--pool", "rh", "--status", "void", "--out", path],
    )
    .await;
    let text = std::fs::read_to_string(&csv).unwrap();
    assert!(!leaks(&text), "{text}");
    assert_eq!(text.lines().count(), 4, "a header and three codes: {text}");
    for line in text.lines().skip(1) {
        let cells: Vec<&str> = line.split(',').collect();
        assert_eq!(cells[3], "", "no order id: {line}");
    }
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_recall_reaches_into_holds_and_the_paid_hold_gets_no_code_of_the_leaked_file() {
    let env = TestEnv::new("holds_recall").await;
    let leaked: Vec<String> = (0..4).map(|i| format!("LEAK-{i:04}")).collect();
    let import_id = import_codes(&env, "rc", &leaked).await;
    pool_set(&env, "rc", &["--hold-share", "100"]).await;
    let (api, k) = checkout_api(&env).await;
    let (s, b) = post_json(&api, &k, "/v1/holds", &hold("H-rc", "buyer", "rc", 2)).await;
    assert_eq!(s, 201, "{b}");
    let batch = ObjectId::parse_str(&import_id).unwrap();
    let out = codepool_ok(
        &env,
        &["void", "--import", &import_id, "--reason", "leak", "--json"],
    )
    .await;
    let out: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(out["voided"], 4, "stock and held codes alike: {out}");
    // Paid after the recall: the buyer waits for new stock; no code of
    // the leaked file is issued.
    let (s, b) = post_json(
        &api,
        &k,
        "/v1/orders",
        &paid("O-rc", "buyer", "rc", 2, "H-rc"),
    )
    .await;
    assert_eq!(s, 202, "{b}");
    assert_eq!(b["state"], "waiting");
    assert!(
        code_ids(&env, doc! {"batch_id": batch, "status": {"$in": [1, 2, 4]}})
            .await
            .is_empty()
    );
    // The hold gave the order nothing: released, bound to the order that
    // paid it (as under a pause), never `committed`.
    let (s, _, b) = api.get("/v1/holds/H-rc", &k).await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    let h = json_of(&b);
    assert_eq!(h["state"], "released", "{h}");
    assert_eq!(h["order_id"], "O-rc", "{h}");
    // The recalled held codes keep nothing of the hold.
    assert!(
        code_ids(
            &env,
            doc! {"batch_id": batch, "order_id": {"$exists": true}}
        )
        .await
        .is_empty(),
        "a recalled held code kept its hold's key"
    );
    let fresh: Vec<String> = (0..2).map(|i| format!("FRESH-{i:04}")).collect();
    let fresh_id = import_codes(&env, "rc", &fresh).await;
    let fresh_batch = ObjectId::parse_str(&fresh_id).unwrap();
    // A dispatcher fulfils waiting orders after an import.
    let daemon = start_daemon(env.command(&[])).await;
    eventually(
        Duration::from_secs(30),
        "the waiting order is served from the new file",
        || async {
            code_ids(
                &env,
                doc! {"order_id": "O-rc", "status": 1, "batch_id": fresh_batch},
            )
            .await
            .len()
                == 2
        },
    )
    .await;
    daemon.stop().await;
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_held_code_that_expires_while_held_is_never_committed_and_expire_voids_it() {
    let env = TestEnv::with_pools("holds_expiry", &[("ex", 3)]).await;
    pool_set(&env, "ex", &["--hold-share", "100"]).await;
    let (api, k) = checkout_api(&env).await;
    let (s, b) = post_json(&api, &k, "/v1/holds", &hold("H-ex", "buyer", "ex", 1)).await;
    assert_eq!(s, 201, "{b}");
    let held = code_ids(&env, doc! {"pool": "ex", "status": 4}).await;
    assert_eq!(held.len(), 1);
    let held_id = *held.iter().next().unwrap();
    // Its time runs out while it is held (the partner's expiry date).
    let past = bson::DateTime::from_millis(bson::DateTime::now().timestamp_millis() - 1000);
    env.coll("codes")
        .update_one(doc! {"_id": held_id}, doc! {"$set": {"expires_at": past}})
        .await
        .unwrap();
    let (s, b) = post_json(
        &api,
        &k,
        "/v1/orders",
        &paid("O-ex", "buyer", "ex", 1, "H-ex"),
    )
    .await;
    assert_eq!(s, 201, "granted from stock: {b}");
    let got = code_ids(&env, doc! {"order_id": "O-ex", "status": 1}).await;
    assert_eq!(got.len(), 1);
    assert!(!got.contains(&held_id), "the expired held code was issued");
    // `codepool expire` voids an expired held code too.
    codepool_ok(&env, &["expire", "--pool", "ex"]).await;
    let voided = code_ids(
        &env,
        doc! {"_id": held_id, "status": 3, "void_reason": "expired"},
    )
    .await;
    assert_eq!(voided.len(), 1, "expire skipped the held code");
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_hold_paid_while_its_pool_is_paused_is_bound_to_that_order_and_no_other_order_uses_it() {
    let env = TestEnv::with_pools("holds_pause", &[("pz", 4)]).await;
    pool_set(&env, "pz", &["--hold-share", "100"]).await;
    let (api, k) = checkout_api(&env).await;
    let (s, b) = post_json(&api, &k, "/v1/holds", &hold("H-pz", "buyer", "pz", 1)).await;
    assert_eq!(s, 201, "{b}");
    // Paused while the hold is live; a fresh API process (no cached
    // policy) takes the payment.
    api.stop().await;
    codepool_ok(&env, &["pool", "pause", "--pool", "pz"]).await;
    let api = ApiServer::start(&env, &["--rate-per-key", "100000"]).await;
    let (s, b) = post_json(
        &api,
        &k,
        "/v1/orders",
        &paid("O-1", "buyer", "pz", 1, "H-pz"),
    )
    .await;
    assert_eq!(s, 202, "{b}");
    let h = hold_doc(&env, "H-pz").await;
    assert_eq!(h.get_str("state").unwrap(), "released", "{h}");
    assert_eq!(h.get_str("order_id").unwrap(), "O-1", "bound to its order");
    assert!(code_ids(&env, doc! {"pool": "pz", "status": 4})
        .await
        .is_empty());
    // A second order naming the same hold is an order like any other:
    // it waits behind the pause too, and nothing is issued while paused.
    let (s, b) = post_json(
        &api,
        &k,
        "/v1/orders",
        &paid("O-2", "buyer", "pz", 1, "H-pz"),
    )
    .await;
    assert_eq!(s, 202, "{b}");
    assert!(code_ids(&env, doc! {"pool": "pz", "status": 1})
        .await
        .is_empty());
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn an_amqp_purchase_that_names_another_shop_never_pays_this_shops_hold() {
    let env = TestEnv::with_pools("holds_shops", &[("sx", 10)]).await;
    pool_set(&env, "sx", &["--hold-share", "100"]).await;
    create_shop(&env, "acme", "sx", &[]).await;
    shop(&env, "bolt", "sx").await;
    let acme = shop_key(&env, "acme-1", "acme").await;
    let api = ApiServer::start(&env, &[]).await;
    let (s, b) = post_json(&api, &acme, "/v1/holds", &hold("H-acme", "buyer", "sx", 1)).await;
    assert_eq!(s, 201, "{b}");
    let held = code_ids(&env, doc! {"pool": "sx", "status": 4}).await;
    let daemon = start_daemon(env.command(&[])).await;
    let conn = codepool_broker::connect(AMQP_URL, "test").await.unwrap();
    let publisher = Publisher::new(&conn, env.topology())
        .await
        .unwrap()
        .as_user("guest");
    let mut theirs = purchase("O-bolt", "sx");
    theirs.uid = "buyer".into();
    theirs.shop = Some("bolt".into());
    theirs.hold_id = Some("H-acme".into());
    // And one that names no shop at all.
    let mut nobody = purchase("O-none", "sx");
    nobody.uid = "buyer".into();
    nobody.hold_id = Some("H-acme".into());
    publish_confirmed(&publisher, &[theirs, nobody]).await;
    eventually(Duration::from_secs(30), "both orders placed", || async {
        code_ids(
            &env,
            doc! {"order_id": {"$in": ["O-bolt", "O-none"]}, "status": 1},
        )
        .await
        .len()
            == 2
    })
    .await;
    let got = code_ids(&env, doc! {"order_id": {"$in": ["O-bolt", "O-none"]}}).await;
    assert!(got.is_disjoint(&held), "another shop paid acme's hold");
    assert_eq!(
        hold_doc(&env, "H-acme").await.get_str("state").unwrap(),
        "held"
    );
    assert_eq!(code_ids(&env, doc! {"pool": "sx", "status": 4}).await, held);
    daemon.stop().await;
    api.stop().await;
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_hold_on_a_pool_taken_off_the_shop_is_not_paid_and_nothing_is_issued() {
    let env = TestEnv::with_pools("holds_shop_pool", &[("sp", 5), ("sq", 5)]).await;
    pool_set(&env, "sp", &["--hold-share", "100"]).await;
    create_shop(&env, "sh", "sp,sq", &[]).await;
    let k = shop_key(&env, "sh-1", "sh").await;
    let api = ApiServer::start(&env, &[]).await;
    let (s, b) = post_json(&api, &k, "/v1/holds", &hold("H-sp", "buyer", "sp", 1)).await;
    assert_eq!(s, 201, "{b}");
    api.stop().await;
    codepool_ok(&env, &["shops", "set", "--name", "sh", "--pools", "sq"]).await;
    let api = ApiServer::start(&env, &[]).await;
    let (s, b) = post_json(
        &api,
        &k,
        "/v1/orders",
        &paid("O-sp", "buyer", "sp", 1, "H-sp"),
    )
    .await;
    assert_eq!(s, 403, "{b}");
    assert!(
        code_ids(&env, doc! {"order_id": "O-sp"}).await.is_empty(),
        "a code was issued"
    );
    assert_eq!(
        hold_doc(&env, "H-sp").await.get_str("state").unwrap(),
        "held"
    );
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_hold_left_bound_by_a_crash_is_paid_by_no_other_order_and_its_own_retry_ends_it() {
    let env = TestEnv::with_pools("holds_bound", &[("bd", 5)]).await;
    pool_set(&env, "bd", &["--hold-share", "100"]).await;
    let (api, k) = checkout_api(&env).await;
    let (s, b) = post_json(&api, &k, "/v1/holds", &hold("H-bd", "buyer", "bd", 1)).await;
    assert_eq!(s, 201, "{b}");
    let (s, b) = post_json(
        &api,
        &k,
        "/v1/orders",
        &paid("O-a", "buyer", "bd", 1, "H-bd"),
    )
    .await;
    assert_eq!(s, 201, "{b}");
    // What a kill -9 between the commit of the codes and the end of the
    // hold leaves: the hold still held, bound to the order that has its
    // codes.
    env.coll("holds")
        .update_one(
            doc! {"_id": "H-bd"},
            doc! {"$set": {"state": "held"}, "$unset": {"ended_at": ""}},
        )
        .await
        .unwrap();
    let (s, b) = post_json(
        &api,
        &k,
        "/v1/orders",
        &paid("O-b", "buyer", "bd", 1, "H-bd"),
    )
    .await;
    assert_eq!(s, 201, "another order is served from stock: {b}");
    let h = hold_doc(&env, "H-bd").await;
    assert_eq!(h.get_str("order_id").unwrap(), "O-a", "{h}");
    let (s, b) = post_json(
        &api,
        &k,
        "/v1/orders",
        &paid("O-a", "buyer", "bd", 1, "H-bd"),
    )
    .await;
    assert_eq!(s, 200, "{b}");
    let h = hold_doc(&env, "H-bd").await;
    assert_eq!(
        (h.get_str("state").unwrap(), h.get_str("order_id").unwrap()),
        ("committed", "O-a"),
        "{h}"
    );
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_bundle_paying_a_hold_whose_code_was_recalled_waits_whole() {
    let env = TestEnv::new("holds_bundle_hold").await;
    let leaked: Vec<String> = (0..2).map(|i| format!("BH-LEAK-{i}")).collect();
    let import_id = import_codes(&env, "ba", &leaked).await;
    env.fill_pool("bb", 5).await;
    for p in ["ba", "bb"] {
        pool_set(&env, p, &["--hold-share", "100"]).await;
    }
    let (api, k) = checkout_api(&env).await;
    let items = json!([{"pool": "ba", "quantity": 1}, {"pool": "bb", "quantity": 1}]);
    let body = json!({"hold_id": "H-bh", "uid": "buyer", "items": items});
    let (s, b) = post_json(&api, &k, "/v1/holds", body.to_string().as_bytes()).await;
    assert_eq!(s, 201, "{b}");
    codepool_ok(&env, &["void", "--import", &import_id, "--reason", "leak"]).await;
    let order = json!({"order_id": "O-bh", "uid": "buyer", "phone": "+8613800000000",
                       "items": items, "hold_id": "H-bh"});
    let (s, b) = post_json(&api, &k, "/v1/orders", order.to_string().as_bytes()).await;
    assert_eq!(s, 202, "waits whole: {b}");
    assert!(
        code_ids(&env, doc! {"order_id": "O-bh"}).await.is_empty(),
        "half a bundle was issued"
    );
    assert!(
        code_ids(&env, doc! {"status": 4}).await.is_empty(),
        "the hold's codes are back"
    );
    api.stop().await;
    env.cleanup().await;
}
