//! Issue 54, item 8 (the lows, each with a test):
//! - held codes are not counted as issued in the pool stats' rates;
//! - a shop's key gets one answer for a pool it may not use, whether or not
//!   the pool exists;
//! - hold ids are each owner's own;
//! - a webhook replay sends events older than the endpoint only when asked
//!   to, audited as a reveal;
//! - `/readyz` turns not-ready no later than the first order refused for a
//!   stale key file.
//!
//! And from a hostile user's try of holds:
//! - `void --code` of a held code names its hold and says to release it
//!   first (a void starts from stock or an order, not from a hold);
//! - a code voided while held shows its hold, never the hold's internal key;
//! - a hold the stock cannot cover is 409 `insufficient-stock`, never a
//!   429 limit;
//! - a hold is paid by its buyer whatever the case or width of the uid.

use std::collections::HashSet;
use std::time::Duration;

use bson::doc;
use futures::StreamExt;
use serde_json::{json, Value};

use crate::api::{http, json_of, key, order, ApiServer};
use crate::common::*;
use crate::webhooks::{publisher, shop_purchase, Answer, Receiver};

fn hold(id: &str, uid: &str, pool: &str, quantity: u32) -> Vec<u8> {
    json!({"hold_id": id, "uid": uid, "items": [{"pool": pool, "quantity": quantity}]})
        .to_string()
        .into_bytes()
}

fn paid(order: &str, uid: &str, pool: &str, quantity: u32, hold_id: &str) -> Vec<u8> {
    json!({"order_id": order, "uid": uid, "phone": "+8613800000000", "pool": pool,
           "quantity": quantity, "hold_id": hold_id})
    .to_string()
    .into_bytes()
}

/// A key of `shop` with `orders:write,orders:read`.
async fn shop_key(env: &TestEnv, name: &str, shop: &str) -> String {
    codepool_ok(
        env,
        &[
            "api-keys",
            "create",
            "--name",
            name,
            "--shop",
            shop,
            "--scopes",
            "orders:write,orders:read",
        ],
    )
    .await
    .trim()
    .to_owned()
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

#[tokio::test]
async fn held_codes_are_not_counted_as_issued_in_the_last_hour_or_day() {
    let env = TestEnv::new("lows4_held_rate").await;
    env.fill_pool("rate", 40).await;
    let backend = key(&env, "backend", "orders:write,orders:read").await;
    let admin = key(&env, "ops", "admin").await;
    let api = ApiServer::start(&env, &[]).await;
    let (s, _, b) = http(
        &api.addr,
        "POST",
        "/v1/holds",
        Some(&backend),
        &hold("H-rate", "u-hold", "rate", 3),
    )
    .await;
    assert_eq!(s, 201, "{}", String::from_utf8_lossy(&b));
    let (s, _, b) = http(
        &api.addr,
        "POST",
        "/v1/orders",
        Some(&backend),
        &order("R-1", "rate", 2),
    )
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
    let (s, _, b) = http(&api.addr, "GET", "/v1/pools", Some(&admin), b"").await;
    assert_eq!(s, 200);
    let stats = &json_of(&b)["pools"][0]["stats"];
    assert_eq!(stats["held"], 3, "{stats}");
    assert_eq!(stats["issued_last_hour"], 2, "{stats}");
    assert_eq!(stats["issued_last_day"], 2, "{stats}");

    // A used code still counts; the hold, paid, counts once it is issued.
    codepool_ok(&env, &["redeem", "--order", "R-1"]).await;
    let (s, _, b) = http(
        &api.addr,
        "POST",
        "/v1/orders",
        Some(&backend),
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
async fn a_shops_key_gets_one_answer_for_an_unknown_pool_and_another_shops_pool() {
    let env = TestEnv::new("lows4_pool_oracle").await;
    env.fill_pool("mine", 10).await;
    env.fill_pool("theirs", 10).await;
    codepool_ok(
        &env,
        &["shops", "create", "--name", "acme", "--pools", "mine"],
    )
    .await;
    codepool_ok(
        &env,
        &["shops", "create", "--name", "bolt", "--pools", "theirs"],
    )
    .await;
    let acme = shop_key(&env, "acme-1", "acme").await;
    let backend = key(&env, "backend", "orders:write,orders:read").await;
    let api = ApiServer::start(&env, &[]).await;

    // The same problem for a pool of another shop and a pool that does not
    // exist, on both routes, with no operator command in it.
    let answer = |path: &'static str, pool: &'static str| {
        let (addr, acme) = (api.addr.clone(), acme.clone());
        async move {
            let body = if path == "/v1/orders" {
                order(&format!("O-{pool}"), pool, 1)
            } else {
                hold(&format!("H-{pool}"), "u-1", pool, 1)
            };
            let (s, _, b) = http(&addr, "POST", path, Some(&acme), &body).await;
            let p = json_of(&b);
            let detail = p["detail"]
                .as_str()
                .unwrap_or_default()
                .replace(pool, "POOL");
            (
                s,
                p["type"].clone(),
                p["title"].clone(),
                p["field"].clone(),
                detail,
            )
        }
    };
    for path in ["/v1/orders", "/v1/holds"] {
        let theirs = answer(path, "theirs").await;
        let nowhere = answer(path, "nowhere").await;
        assert_eq!(theirs, nowhere, "{path}: one answer for both");
        let detail = &theirs.4;
        assert!(
            !detail.contains("codepool ") && !detail.contains("dead-letters"),
            "{path}: an operator command in {detail:?}"
        );
        assert!(
            !detail.contains("exist") && !detail.contains("has no codes"),
            "{path}: {detail:?}"
        );
        assert_eq!(theirs.0, 403, "{path}: {theirs:?}");
    }
    assert_eq!(
        ids(&env, doc! {"status": {"$ne": 0}}).await.len(),
        0,
        "nothing granted or held"
    );

    // An operator's key (no shop) keeps the precise answer.
    let (s, _, b) = http(
        &api.addr,
        "POST",
        "/v1/orders",
        Some(&backend),
        &order("O-op", "nowhere", 1),
    )
    .await;
    assert_eq!(s, 422);
    assert!(json_of(&b)["type"]
        .as_str()
        .unwrap()
        .ends_with("/unknown-pool"));
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn two_shops_and_a_backend_each_use_hold_id_cart_1_and_each_pays_its_own() {
    let env = TestEnv::new("lows4_hold_ns").await;
    env.fill_pool("hx", 40).await;
    codepool_ok(
        &env,
        &["pool", "set", "--pool", "hx", "--hold-share", "100"],
    )
    .await;
    // The suite publishes as the broker's guest user.
    for shop in ["acme", "bolt"] {
        let args = [
            "shops",
            "create",
            "--name",
            shop,
            "--pools",
            "hx",
            "--broker-users",
            "guest",
        ];
        codepool_ok(&env, &args).await;
    }
    let acme = shop_key(&env, "acme-1", "acme").await;
    let bolt = shop_key(&env, "bolt-1", "bolt").await;
    let backend = key(&env, "backend", "orders:write,orders:read").await;
    let api = ApiServer::start(&env, &[]).await;

    // One hold id, three owners: three holds.
    for (k, uid, n) in [(&acme, "ann", 1), (&bolt, "bob", 2), (&backend, "cy", 3)] {
        let (s, _, b) = http(
            &api.addr,
            "POST",
            "/v1/holds",
            Some(k),
            &hold("cart-1", uid, "hx", n),
        )
        .await;
        assert_eq!(s, 201, "{uid}: {}", String::from_utf8_lossy(&b));
        assert_eq!(json_of(&b)["hold_id"], "cart-1");
    }
    // Each sees its own; the same request again is the same hold.
    for (k, uid) in [(&acme, "ann"), (&bolt, "bob"), (&backend, "cy")] {
        let (s, _, b) = http(&api.addr, "GET", "/v1/holds/cart-1", Some(k), b"").await;
        assert_eq!(s, 200);
        assert_eq!(json_of(&b)["uid"], uid);
    }
    let (s, _, _) = http(
        &api.addr,
        "POST",
        "/v1/holds",
        Some(&acme),
        &hold("cart-1", "ann", "hx", 1),
    )
    .await;
    assert_eq!(s, 200, "a repeat");
    let (s, _, _) = http(
        &api.addr,
        "POST",
        "/v1/holds",
        Some(&acme),
        &hold("cart-1", "ann", "hx", 2),
    )
    .await;
    assert_eq!(s, 409, "another hold under acme's own id");
    let held_by = |uid: &'static str| ids(&env, doc! {"status": 4, "uid": uid});
    let (ann, bob, cy) = (
        held_by("ann").await,
        held_by("bob").await,
        held_by("cy").await,
    );
    assert_eq!((ann.len(), bob.len(), cy.len()), (1, 2, 3));

    // acme pays its own hold over HTTP.
    let (s, _, b) = http(
        &api.addr,
        "POST",
        "/v1/orders",
        Some(&acme),
        &paid("A-1", "ann", "hx", 1, "cart-1"),
    )
    .await;
    assert_eq!(s, 201, "{}", String::from_utf8_lossy(&b));
    assert_eq!(ids(&env, doc! {"order_id": "A-1"}).await, ann);
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
        ids(
            &env,
            doc! {"order_id": {"$in": ["B-1", "C-1"]}, "status": 1},
        )
        .await
        .len()
            == 5
    })
    .await;
    assert_eq!(ids(&env, doc! {"order_id": "B-1"}).await, bob);
    assert_eq!(ids(&env, doc! {"order_id": "C-1"}).await, cy);
    // A payment moves the codes, then ends the hold: the hold is
    // committed a moment after its codes are the order's.
    eventually(Duration::from_secs(10), "both holds committed", || async {
        state(bolt.clone()).await == "committed" && state(backend.clone()).await == "committed"
    })
    .await;

    // A release touches only the releasing owner's hold.
    let (s, _, b) = http(
        &api.addr,
        "POST",
        "/v1/holds",
        Some(&bolt),
        &hold("cart-2", "bob", "hx", 1),
    )
    .await;
    assert_eq!(s, 201, "{}", String::from_utf8_lossy(&b));
    let (s, _, b) = http(
        &api.addr,
        "POST",
        "/v1/holds",
        Some(&acme),
        &hold("cart-2", "ann", "hx", 1),
    )
    .await;
    assert_eq!(s, 201, "{}", String::from_utf8_lossy(&b));
    let (s, _, b) = http(&api.addr, "DELETE", "/v1/holds/cart-2", Some(&bolt), b"").await;
    assert_eq!(s, 200);
    assert_eq!(json_of(&b)["state"], "released");
    let (_, _, b) = http(&api.addr, "GET", "/v1/holds/cart-2", Some(&acme), b"").await;
    assert_eq!(json_of(&b)["state"], "held");
    assert_eq!(json_of(&b)["uid"], "ann");
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
    use futures::TryStreamExt;
    let docs: Vec<bson::Document> = env
        .store
        .database()
        .collection::<bson::Document>("audit")
        .find(doc! {"kind": "reveal"})
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
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
    let env = TestEnv::new("lows4_replay_old").await;
    env.fill_pool("wr", 5).await;
    codepool_ok(
        &env,
        &[
            "shops",
            "create",
            "--name",
            "acme",
            "--pools",
            "wr",
            "--broker-users",
            "guest",
        ],
    )
    .await;
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
    let code = ids(&env, doc! {"order_id": "WR-1"}).await;
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
    let admin = key(&env, "ops", "admin").await;
    let api = ApiServer::start(&env, &[]).await;
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

#[tokio::test]
async fn readyz_turns_not_ready_no_later_than_the_first_order_refused_for_a_stale_key_file() {
    let env = TestEnv::new("lows4_keys_ready").await;
    env.fill_pool("kr", 50).await;
    let backend = key(&env, "backend", "orders:write").await;
    let api = ApiServer::start(&env, &[]).await;
    let ready = || {
        let addr = api.addr.clone();
        async move { http_get(&addr, "/readyz").await.map(|(s, _)| s) }
    };
    eventually(Duration::from_secs(15), "ready", || async {
        ready().await == Some(200)
    })
    .await;
    // Another host adds a key and seals the codes with it.
    let dir = tempfile::tempdir().unwrap();
    let other = dir.path().join("keys.json");
    std::fs::copy(&env.key_file, &other).unwrap();
    for args in [["keys", "add"], ["keys", "rotate"]] {
        let out = env
            .command(&args)
            .env("CODEPOOL_KEY_FILE", &other)
            .output()
            .await
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // Orders until the first 503: /readyz already says not ready.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut n = 0;
    loop {
        assert!(std::time::Instant::now() < deadline, "no order was refused");
        n += 1;
        let (s, _, b) = http(
            &api.addr,
            "POST",
            "/v1/orders",
            Some(&backend),
            &order(&format!("KR-{n}"), "kr", 1),
        )
        .await;
        if s == 503 {
            assert_eq!(
                ready().await,
                Some(503),
                "an order got 503 while /readyz said ready"
            );
            break;
        }
        assert_eq!(s, 201, "{}", String::from_utf8_lossy(&b));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The key file brought up to date: ready again, and orders go on.
    std::fs::copy(&other, &env.key_file).unwrap();
    eventually(Duration::from_secs(20), "ready again", || async {
        ready().await == Some(200)
    })
    .await;
    let (s, _, b) = http(
        &api.addr,
        "POST",
        "/v1/orders",
        Some(&backend),
        &order("KR-last", "kr", 1),
    )
    .await;
    assert_eq!(s, 201, "{}", String::from_utf8_lossy(&b));
    api.stop().await;
    env.cleanup().await;
}

/// Imports `codes` into `pool` with `codepool import`; returns the run's
/// import id.
async fn import(env: &TestEnv, pool: &str, codes: &[String]) -> String {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), format!("code\n{}\n", codes.join("\n"))).unwrap();
    let path = file.path().to_str().unwrap();
    let out = codepool_ok(env, &["import", path, "--pool", pool, "--json"]).await;
    let summary: Value = serde_json::from_str(&out).unwrap();
    summary["import_id"].as_str().unwrap().to_owned()
}

/// How many codes of `pool` are in each status (0 unissued, 1 issued, 2
/// used, 3 void, 4 held).
async fn statuses(env: &TestEnv, pool: &str) -> [u64; 5] {
    let codes = env.store.database().collection::<bson::Document>("codes");
    let mut out = [0; 5];
    for (s, n) in out.iter_mut().enumerate() {
        *n = codes
            .count_documents(doc! {"pool": pool, "status": s as i32})
            .await
            .unwrap();
    }
    out
}

#[tokio::test]
async fn void_of_a_held_code_names_its_hold_says_to_release_it_first_and_changes_nothing() {
    let env = TestEnv::new("lows4_void_held").await;
    env.fill_pool("vh", 3).await;
    codepool_ok(
        &env,
        &["pool", "set", "--pool", "vh", "--hold-share", "100"],
    )
    .await;
    let k = key(&env, "checkout", "orders:write,orders:read").await;
    let api = ApiServer::start(&env, &[]).await;
    let (s, _, b) = http(
        &api.addr,
        "POST",
        "/v1/holds",
        Some(&k),
        &hold("H-vh", "vic", "vh", 1),
    )
    .await;
    assert_eq!(s, 201, "{}", String::from_utf8_lossy(&b));
    let codes = env.store.database().collection::<bson::Document>("codes");
    let held = codes
        .find_one(doc! {"pool": "vh", "status": 4})
        .await
        .unwrap()
        .expect("the held code");
    let code = env.plain_code(&held);
    assert_eq!(statuses(&env, "vh").await, [2, 0, 0, 0, 1]);

    // Voided while held: refused, naming the hold and what to do; nothing moves.
    let void = ["void", "--code", &code, "--pool", "vh", "--reason", "leak"];
    let out = env.command(&void).output().await.unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("held by checkout hold \"H-vh\""), "{err}");
    assert!(err.contains("Release the hold first"), "{err}");
    assert!(err.contains("DELETE /v1/holds/H-vh"), "{err}");
    assert!(!err.contains("redeemed"), "not a redeem: {err}");
    assert!(!err.contains("hold:0"), "no internal key: {err}");
    assert_eq!(statuses(&env, "vh").await, [2, 0, 0, 0, 1], "nothing moved");
    let (_, _, b) = http(&api.addr, "GET", "/v1/holds/H-vh", Some(&k), b"").await;
    assert_eq!(json_of(&b)["state"], "held", "the hold stands");

    // As told: the hold released, the code is stock again and is voided.
    let (s, _, b) = http(&api.addr, "DELETE", "/v1/holds/H-vh", Some(&k), b"").await;
    assert_eq!(s, 200, "{}", String::from_utf8_lossy(&b));
    let out = codepool_ok(&env, &void).await;
    assert!(out.contains("voided unissued code"), "{out}");
    assert_eq!(statuses(&env, "vh").await, [2, 0, 0, 1, 0]);
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
    let env = TestEnv::new("lows4_void_key").await;
    let leaked: Vec<String> = (0..3).map(|i| format!("LEAK-{i:04}")).collect();
    let import_id = import(&env, "rh", &leaked).await;
    codepool_ok(
        &env,
        &["pool", "set", "--pool", "rh", "--hold-share", "100"],
    )
    .await;
    let k = key(&env, "checkout", "orders:write,orders:read").await;
    let api = ApiServer::start(&env, &[]).await;
    let (s, _, b) = http(
        &api.addr,
        "POST",
        "/v1/holds",
        Some(&k),
        &hold("H-rh", "rhu", "rh", 2),
    )
    .await;
    assert_eq!(s, 201, "{}", String::from_utf8_lossy(&b));
    let held = env
        .store
        .database()
        .collection::<bson::Document>("codes")
        .find_one(doc! {"pool": "rh", "status": 4})
        .await
        .unwrap()
        .expect("a held code");
    let code = env.plain_code(&held);
    codepool_ok(&env, &["void", "--import", &import_id, "--reason", "leak"]).await;
    assert_eq!(statuses(&env, "rh").await, [0, 0, 0, 3, 0]);

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
        let out = env.command(args).output().await.unwrap();
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
async fn a_hold_the_stock_cannot_cover_is_409_insufficient_stock_not_a_429_limit() {
    let env = TestEnv::new("lows4_hold_empty").await;
    env.store.ensure_pool("em").await.unwrap();
    env.fill_pool("few", 3).await;
    env.fill_pool("big", 100).await;
    let k = key(&env, "checkout", "orders:write,orders:read").await;
    let api = ApiServer::start(&env, &[]).await;
    let place = |id: &'static str, pool: &'static str, n: u32| {
        let (addr, k) = (api.addr.clone(), k.clone());
        async move {
            let (s, _, b) = http(
                &addr,
                "POST",
                "/v1/holds",
                Some(&k),
                &hold(id, "eve", pool, n),
            )
            .await;
            (s, json_of(&b))
        }
    };
    // An empty pool, and one with less than asked: out of stock, whatever
    // a buyer's share of so small a pool would be.
    for (id, pool, n, free) in [
        ("H-e1", "em", 1, 0),
        ("H-e2", "em", 2, 0),
        ("H-f5", "few", 5, 3),
    ] {
        let (s, b) = place(id, pool, n).await;
        assert_eq!(s, 409, "{pool} × {n}: {b}");
        assert_eq!(
            b["type"].as_str().unwrap().rsplit('/').next(),
            Some("insufficient-stock"),
            "{b}"
        );
        assert_eq!(b["free"], json!([{"pool": pool, "free": free}]), "{b}");
        let detail = b["detail"].as_str().unwrap();
        assert!(detail.starts_with("out of stock"), "{b}");
        assert!(detail.contains("try again after the next import"), "{b}");
    }
    // A pool that can cover it: the buyer's share (10% of 100) is the limit.
    let (s, b) = place("H-b20", "big", 20).await;
    assert_eq!(s, 429, "{b}");
    assert_eq!(b["cap"], "buyer-share", "{b}");
    assert_eq!(b["limit"], 10, "{b}");
    for pool in ["em", "few", "big"] {
        assert_eq!(statuses(&env, pool).await[4], 0, "nothing held in {pool}");
    }
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_hold_placed_for_mallory_is_paid_by_mallory_with_a_capital_m() {
    let env = TestEnv::new("lows4_hold_fold").await;
    env.fill_pool("mc", 10).await;
    codepool_ok(
        &env,
        &["pool", "set", "--pool", "mc", "--hold-share", "100"],
    )
    .await;
    let k = key(&env, "checkout", "orders:write,orders:read").await;
    let api = ApiServer::start(&env, &[]).await;
    let (s, _, b) = http(
        &api.addr,
        "POST",
        "/v1/holds",
        Some(&k),
        &hold("H-mc", "mallory", "mc", 2),
    )
    .await;
    assert_eq!(s, 201, "{}", String::from_utf8_lossy(&b));
    let held = ids(&env, doc! {"pool": "mc", "status": 4}).await;
    assert_eq!(held.len(), 2);
    // The same buyer, folded: the order pays the hold with its held codes.
    let (s, _, b) = http(
        &api.addr,
        "POST",
        "/v1/orders",
        Some(&k),
        &paid("O-mc", "Mallory", "mc", 2, "H-mc"),
    )
    .await;
    assert_eq!(s, 201, "{}", String::from_utf8_lossy(&b));
    assert_eq!(
        ids(&env, doc! {"order_id": "O-mc"}).await,
        held,
        "the held codes"
    );
    let (_, _, b) = http(&api.addr, "GET", "/v1/holds/H-mc", Some(&k), b"").await;
    let b = json_of(&b);
    assert_eq!(b["state"], "committed", "{b}");
    assert_eq!(b["order_id"], "O-mc", "{b}");
    assert_eq!(
        statuses(&env, "mc").await,
        [8, 2, 0, 0, 0],
        "nothing else taken"
    );
    api.stop().await;
    env.cleanup().await;
}
