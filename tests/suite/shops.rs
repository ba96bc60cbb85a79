//! Shops: each shop's keys, pools and orders are its own, through both
//! doors. A shop's key orders only from its pools, reads and changes only
//! its shop's orders, and a shop's pool list shows only its pools; a
//! purchase over AMQP that names a shop obeys the same rules. A shop's key
//! gets one answer for a pool it may not use, whether or not it exists.

use std::time::Duration;

use bson::doc;
use codepool_broker::Publisher;
use serde_json::{json, Value};

use crate::api::{http, json_of, key, order, ApiServer};
use crate::common::*;
use crate::fixtures::*;

async fn cli(env: &TestEnv, args: &[&str]) -> String {
    let out = env.run(args).await;
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The codes the database holds for `order`.
async fn held(env: &TestEnv, order: &str) -> usize {
    count_codes(env, bson::doc! {"order_id": order}).await as usize
}

fn codes_in(body: &[u8]) -> Vec<String> {
    let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    (v["codes"].as_array().into_iter().flatten())
        .filter_map(|c| c["code"].as_str().map(str::to_owned))
        .collect()
}

#[tokio::test]
async fn a_shops_keys_order_from_its_pools_and_act_on_its_orders_only() {
    let env = TestEnv::new("shops_http").await;
    for pool in ["game-x", "game-y", "game-z"] {
        env.fill_pool(pool, 10).await;
    }
    create_shop(&env, "acme", "game-x,game-y", &[]).await;
    create_shop(&env, "bolt", "game-x,game-z", &[]).await;
    let listed: Value =
        serde_json::from_str(&cli(&env, &["shops", "list", "--json"]).await).unwrap();
    assert_eq!(listed[0]["name"], "acme");
    assert_eq!(listed[0]["pools"], json!(["game-x", "game-y"]));
    let acme = shop_key(&env, "acme-1", "acme").await;
    let acme2 = shop_key(&env, "acme-2", "acme").await;
    let bolt = shop_key(&env, "bolt-1", "bolt").await;
    let api = ApiServer::start(&env, &[]).await;

    // Another shop's pool: 403, and nothing is granted.
    let (status, _, body) = api
        .post("/v1/orders", &acme, &order("A-0", "game-z", 1))
        .await;
    assert_eq!(status, 403, "{}", String::from_utf8_lossy(&body));
    assert!(
        json_of(&body)["type"]
            .as_str()
            .unwrap()
            .ends_with("pool-not-allowed"),
        "{}",
        String::from_utf8_lossy(&body)
    );
    assert_eq!(held(&env, "A-0").await, 0);

    let (status, _, first) = api
        .post("/v1/orders", &acme, &order("A-1", "game-x", 2))
        .await;
    assert_eq!(status, 201, "{}", String::from_utf8_lossy(&first));
    let codes = codes_in(&first);
    assert_eq!(codes.len(), 2);

    // Another shop: 404 on every route, 409 with no code when it posts it.
    for (method, path) in [
        ("GET", "/v1/orders/A-1"),
        ("POST", "/v1/orders/A-1/void"),
        ("POST", "/v1/orders/A-1/redeem"),
        ("POST", "/v1/orders/A-1/resend"),
    ] {
        let body = if method == "GET" {
            b"".to_vec()
        } else {
            br#"{"reason":"test"}"#.to_vec()
        };
        let (status, _, answer) = api.call(method, path, &bolt, &body).await;
        assert_eq!(
            status,
            404,
            "{method} {path}: {}",
            String::from_utf8_lossy(&answer)
        );
    }
    let (status, _, answer) = api
        .post("/v1/orders", &bolt, &order("A-1", "game-x", 2))
        .await;
    assert_eq!(status, 409, "{}", String::from_utf8_lossy(&answer));
    assert!(json_of(&answer)["type"]
        .as_str()
        .unwrap()
        .ends_with("conflicting-order"));
    for c in &codes {
        assert!(
            !String::from_utf8_lossy(&answer).contains(c.as_str()),
            "no code in a conflict"
        );
    }
    assert_eq!(held(&env, "A-1").await, 2, "nothing more was claimed");

    // The same shop's other key: the same codes, audited as a repeat.
    let (status, _, again) = api
        .post("/v1/orders", &acme2, &order("A-1", "game-x", 2))
        .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&again));
    assert_eq!(codes_in(&again), codes);
    let repeat = env
        .coll("audit")
        .find_one(bson::doc! {"os_user": "api-key:acme-2"})
        .await
        .unwrap();
    assert!(
        repeat
            .as_ref()
            .is_some_and(|d| d.get_str("what").unwrap_or("").contains("A-1")),
        "{repeat:?}"
    );
    let (status, _, _) = api.get("/v1/orders/A-1", &acme2).await;
    assert_eq!(status, 200);

    // A shop's pool list shows its pools only.
    let (status, _, pools) = api.get("/v1/pools", &acme).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&pools));
    let names: Vec<String> = (json_of(&pools)["pools"].as_array().unwrap().iter())
        .map(|p| p["name"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(names, vec!["game-x", "game-y"]);
    // Another shop's pool and one that does not exist: one 404, which
    // tells the shop's key what it can do, not an admin's instruction.
    let (status, _, theirs) = api.get("/v1/pools/game-z", &acme).await;
    assert_eq!(status, 404);
    let (status, _, none) = api.get("/v1/pools/no-such-pool", &acme).await;
    assert_eq!(status, 404);
    let (theirs, none) = (json_of(&theirs), json_of(&none));
    let detail = theirs["detail"].as_str().unwrap();
    assert!(!detail.contains("POST /v1/pools"), "{detail}");
    assert!(detail.contains("GET /v1/pools"), "{detail}");
    assert_eq!(
        detail.replace("game-z", "no-such-pool"),
        none["detail"].as_str().unwrap(),
        "one answer for both"
    );
    let (status, _, _) = api.get("/v1/pools/game-y", &acme).await;
    assert_eq!(status, 200);

    // A shop's key cannot be an admin key, nor belong to no shop.
    let out = env
        .run(&[
            "api-keys", "create", "--name", "x", "--shop", "acme", "--scopes", "admin",
        ])
        .await;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("admin"));
    let out = env
        .run(&[
            "api-keys",
            "create",
            "--name",
            "y",
            "--shop",
            "nope",
            "--scopes",
            "orders:read",
        ])
        .await;
    assert!(
        !out.status.success() && String::from_utf8_lossy(&out.stderr).contains("no shop \"nope\"")
    );

    // Shops through the admin API: created, listed, changed, refused.
    let admin = key(&env, "ops", "admin").await;
    let (status, _, body) = api
        .post("/v1/shops", &admin, br#"{"name":"cargo","pools":["*"]}"#)
        .await;
    assert_eq!(status, 201, "{}", String::from_utf8_lossy(&body));
    let (status, _, _) = api
        .post("/v1/shops", &admin, br#"{"name":"cargo","pools":["*"]}"#)
        .await;
    assert_eq!(status, 409);
    let (status, _, body) = api
        .call(
            "PATCH",
            "/v1/shops/cargo",
            &admin,
            br#"{"pools":["bad pool"]}"#,
        )
        .await;
    assert_eq!(status, 422);
    assert_eq!(json_of(&body)["field"], "pools");
    let (status, _, body) = api
        .call(
            "PATCH",
            "/v1/shops/cargo",
            &admin,
            br#"{"pools":["game-y"]}"#,
        )
        .await;
    assert_eq!(
        (status, json_of(&body)["pools"].clone()),
        (200, json!(["game-y"]))
    );
    let (status, _, body) = api.get("/v1/shops", &admin).await;
    assert_eq!(status, 200);
    assert_eq!(json_of(&body)["shops"].as_array().unwrap().len(), 3);
    let (status, _, _) = api.get("/v1/shops", &acme).await;
    assert_eq!(status, 403, "a shop's key is no admin");
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_purchase_over_amqp_that_names_a_shop_is_held_to_its_pools_and_is_its_order() {
    let env = TestEnv::with_pools("shops_amqp", &[("game-x", 10), ("game-z", 10)]).await;
    shop(&env, "acme", "game-x").await;
    create_shop(&env, "bolt", "*", &[]).await;
    let acme = shop_key(&env, "acme-1", "acme").await;
    let bolt = shop_key(&env, "bolt-1", "bolt").await;
    let daemon = start_daemon(env.command(&[])).await;
    let conn = codepool_broker::connect(AMQP_URL, "test").await.unwrap();
    let publisher = Publisher::new(&conn, env.topology())
        .await
        .unwrap()
        .as_user("guest");
    let mut granted = purchase("M-1", "game-x");
    granted.shop = Some("acme".into());
    let mut other_pool = purchase("M-2", "game-z");
    other_pool.shop = Some("acme".into());
    let mut unknown = purchase("M-3", "game-x");
    unknown.shop = Some("nope".into());
    publish_confirmed(&publisher, &[granted.clone(), other_pool, unknown]).await;
    let ch = conn.create_channel().await.unwrap();
    let t = env.topology();
    eventually(
        Duration::from_secs(30),
        "one grant and two dead letters",
        || {
            let ch = ch.clone();
            let (sms, dead) = (t.sms_pending.clone(), t.purchases_dead.clone());
            async move { queue_depth(&ch, &sms).await >= 1 && queue_depth(&ch, &dead).await >= 2 }
        },
    )
    .await;
    let mut reasons: Vec<String> = drain(&ch, &t.purchases_dead)
        .await
        .iter()
        .map(|d| {
            d.reason
                .clone()
                .unwrap_or_default()
                .split(':')
                .next()
                .unwrap_or_default()
                .trim()
                .to_owned()
        })
        .collect();
    reasons.sort();
    assert_eq!(reasons, vec!["pool_not_allowed", "unknown_shop"]);
    assert_eq!(held(&env, "M-2").await + held(&env, "M-3").await, 0);
    daemon.stop().await;

    // The shop's keys read it and post it again; another shop's do not.
    let api = ApiServer::start(&env, &[]).await;
    let (status, _, _) = api.get("/v1/orders/M-1", &acme).await;
    assert_eq!(status, 200);
    let (status, _, _) = api.get("/v1/orders/M-1", &bolt).await;
    assert_eq!(status, 404);
    let body = serde_json::to_vec(
        &json!({"order_id": "M-1", "uid": granted.uid, "phone": granted.phone, "pool": "game-x"}),
    )
    .unwrap();
    let (status, _, again) = api.post("/v1/orders", &acme, &body).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&again));
    assert_eq!(codes_in(&again).len(), 1);
    let (status, _, _) = api.post("/v1/orders", &bolt, &body).await;
    assert_eq!(status, 409);
    api.stop().await;
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_shops_key_gets_one_answer_for_an_unknown_pool_and_another_shops_pool() {
    let env = TestEnv::with_pools("shops_pool_oracle", &[("mine", 10), ("theirs", 10)]).await;
    create_shop(&env, "acme", "mine", &[]).await;
    create_shop(&env, "bolt", "theirs", &[]).await;
    let acme = shop_key(&env, "acme-1", "acme").await;
    let (api, backend) = api_with_key(&env, "backend", "orders:write,orders:read").await;

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
        code_ids(&env, doc! {"status": {"$ne": 0}}).await.len(),
        0,
        "nothing granted or held"
    );

    // An operator's key (no shop) keeps the precise answer.
    let (s, _, b) = api
        .post("/v1/orders", &backend, &order("O-op", "nowhere", 1))
        .await;
    assert_eq!(s, 422);
    assert!(json_of(&b)["type"]
        .as_str()
        .unwrap()
        .ends_with("/unknown-pool"));
    api.stop().await;
    env.cleanup().await;
}
