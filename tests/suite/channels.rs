//! Channels: a shop's Eneba, G2A (and Kinguin) accounts sell its pools
//! through `codepool api`, each under its marketplace's own protocol. The
//! tests play each marketplace as its published contract says
//! (../shared/marketplaces.md), with its faults: a client timeout while
//! codepool commits (the retry gets the same keys), every callback
//! delivered twice, CANCEL racing PROVIDE, CANCEL after PROVIDE, a token
//! that expires mid-run, a reservation past its time, returns that name
//! items of an earlier read. Bad input changes nothing. One pool sold by
//! the shop's own checkout, Eneba and G2A at once sells no code twice and
//! leaks no hold; nor does one sold by the shop and all three
//! marketplaces through two API processes, one of them killed mid-run,
//! each marketplace calling again as its contract says. The marketplaces'
//! calls and the simulated Kinguin are in `marketplaces.rs`.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use bson::doc;
use serde_json::{json, Value};

use crate::api::{http, json_of, ApiServer, Exchange};
use crate::common::*;
use crate::fixtures::*;
use crate::marketplaces::*;

/// A shop `acme` selling pool `pool` (of `n` codes) on Eneba (`en`, with
/// `extra` flags) and G2A (`g2`).
pub(crate) async fn selling(
    test: &str,
    pool: &str,
    n: usize,
    eneba: &[&str],
    g2a: &[&str],
) -> TestEnv {
    let env = TestEnv::new(test).await;
    env.fill_pool(pool, n).await;
    create_shop(&env, "acme", pool, &[]).await;
    add_channel(
        &env,
        "en",
        "eneba",
        "acme",
        json!({"token": ENEBA_TOKEN}),
        eneba,
    )
    .await;
    map(&env, "en", AUCTION, pool).await;
    add_channel(
        &env,
        "g2",
        "g2a",
        "acme",
        json!({"client_id": G2A_ID, "client_secret": G2A_SECRET}),
        g2a,
    )
    .await;
    map(&env, "g2", PRODUCT, pool).await;
    env
}

/// One Eneba callback, as Eneba sends it.
pub(crate) async fn eneba(api: &ApiServer, token: &str, body: Value) -> Exchange {
    http(
        &api.addr,
        "POST",
        "/channels/en/eneba",
        Some(token),
        body.to_string().as_bytes(),
    )
    .await
}

/// The plaintext codes the database gives `order`, sorted.
async fn codes_of(env: &TestEnv, order: &str) -> Vec<String> {
    let mut out: Vec<String> = find_docs(env, "codes", doc! {"order_id": order})
        .await
        .iter()
        .map(|d| env.plain_code(d))
        .collect();
    out.sort();
    out
}

async fn held(env: &TestEnv, pool: &str) -> u64 {
    count_codes(env, doc! {"pool": pool, "status": 4}).await
}

#[tokio::test]
async fn channels_are_added_mapped_paused_and_removed_each_audited_and_keep_no_secret_in_clear() {
    let env = TestEnv::new("channels_admin").await;
    env.fill_pool("gx", 5).await;
    env.fill_pool("other", 5).await;
    create_shop(&env, "acme", "gx", &[]).await;
    add_channel(
        &env,
        "en",
        "eneba",
        "acme",
        json!({"token": ENEBA_TOKEN}),
        &[],
    )
    .await;
    add_channel(
        &env,
        "kg",
        "kinguin",
        "acme",
        json!({"webhook_secret": G2A_SECRET, "client_id": "kid", "client_secret": "kinguin-outbound-secret", "base_url": "http://127.0.0.1:9"}),
        &["--after-provide", "resell"],
    )
    .await;

    // What the marketplaces present is hashed, what codepool sends out is
    // sealed: neither is stored as given.
    let raw = format!("{:?}", find_docs(&env, "channels", doc! {}).await);
    for secret in [ENEBA_TOKEN, G2A_SECRET, "kinguin-outbound-secret"] {
        assert!(!raw.contains(secret), "{secret} is stored in clear: {raw}");
    }

    // A short token, an unknown shop, an unknown kind, a name taken: refused, nothing added.
    let path = std::env::temp_dir().join(format!("cpt-{}-short.json", std::process::id()));
    std::fs::write(&path, json!({"token": "short"}).to_string()).unwrap();
    let file = path.to_str().unwrap();
    for args in [
        vec![
            "channels",
            "add",
            "--name",
            "x1",
            "--kind",
            "eneba",
            "--shop",
            "acme",
            "--credentials",
            file,
        ],
        vec![
            "channels",
            "add",
            "--name",
            "x2",
            "--kind",
            "eneba",
            "--shop",
            "nobody",
            "--credentials",
            file,
        ],
        vec![
            "channels",
            "add",
            "--name",
            "x3",
            "--kind",
            "ebay",
            "--shop",
            "acme",
            "--credentials",
            file,
        ],
        vec![
            "channels",
            "add",
            "--name",
            "en",
            "--kind",
            "eneba",
            "--shop",
            "acme",
            "--credentials",
            file,
        ],
        vec![
            "channels",
            "add",
            "--name",
            "x4",
            "--kind",
            "eneba",
            "--shop",
            "acme",
            "--credentials",
            file,
            "--hold-ttl",
            "999999",
        ],
    ] {
        let out = env.run(&args).await;
        assert!(!out.status.success(), "{args:?} was taken");
    }
    let _ = std::fs::remove_file(&path);
    assert_eq!(count_docs(&env, "channels", doc! {}).await, 2);

    // A pool not the shop's (or none): refused, the map unchanged.
    for pool in ["other", "missing"] {
        let out = env
            .run(&[
                "channels",
                "map",
                "--name",
                "en",
                "--product",
                AUCTION,
                "--pool",
                pool,
            ])
            .await;
        assert!(!out.status.success(), "{pool} was mapped");
    }
    let out = env
        .run(&[
            "channels",
            "map",
            "--name",
            "en",
            "--product",
            "a.b",
            "--pool",
            "gx",
        ])
        .await;
    assert!(!out.status.success(), "a dotted product id was mapped");
    map(&env, "en", AUCTION, "gx").await;
    codepool_ok(&env, &["channels", "pause", "--name", "en"]).await;

    let listed: Value =
        serde_json::from_str(&codepool_ok(&env, &["channels", "list", "--json"]).await).unwrap();
    assert_eq!(listed[0]["name"], "en");
    assert_eq!(listed[0]["state"], "paused");
    assert_eq!(listed[0]["products"], json!({AUCTION: "gx"}));
    assert_eq!(listed[0]["hold_ttl_seconds"], 172800);
    assert_eq!(listed[1]["after_provide"], "resell");
    assert_eq!(listed[1]["sealed_secrets"], json!(["client_secret"]));
    let shown: Value = serde_json::from_str(
        &codepool_ok(&env, &["channels", "show", "--name", "en", "--json"]).await,
    )
    .unwrap();
    assert_eq!(shown["reserved"], 0);

    codepool_ok(&env, &["channels", "resume", "--name", "en"]).await;
    codepool_ok(&env, &["channels", "remove", "--name", "kg"]).await;
    assert!(!env
        .run(&["channels", "remove", "--name", "kg"])
        .await
        .status
        .success());
    assert_eq!(count_docs(&env, "channels", doc! {}).await, 1);

    let mut kinds: Vec<String> = find_docs(&env, "audit", doc! {"kind": {"$regex": "^channel-"}})
        .await
        .iter()
        .map(|d| d.get_str("kind").unwrap_or_default().to_owned())
        .collect();
    kinds.sort();
    assert_eq!(
        kinds,
        vec![
            "channel-add",
            "channel-add",
            "channel-remove",
            "channel-set",
            "channel-set",
            "channel-set"
        ],
        "one record per change"
    );
    env.cleanup().await;
}

#[tokio::test]
async fn eneba_reserves_all_or_nothing_provides_the_same_keys_and_cancels_by_policy() {
    let env = selling("channels_eneba", "gx", 40, &[], &[]).await;
    let api = ApiServer::start(&env, &[]).await;

    // Bad input: a wrong token, an unknown channel, a malformed body, an
    // unknown auction. Each gets Eneba's shape and changes nothing.
    let (status, _, body) = eneba(&api, "wrong-token", reserve("o-0", 1)).await;
    assert_eq!(status, 401, "{}", String::from_utf8_lossy(&body));
    assert_eq!(json_of(&body)["action"], "RESERVE");
    assert_eq!(success(&body), false);
    let (status, _, _) = http(
        &api.addr,
        "POST",
        "/channels/nope/eneba",
        Some(ENEBA_TOKEN),
        reserve("o-0", 1).to_string().as_bytes(),
    )
    .await;
    assert_eq!(status, 404);
    let (status, _, body) = http(
        &api.addr,
        "POST",
        "/channels/en/eneba",
        Some(ENEBA_TOKEN),
        b"{\"action\":\"RESERVE\",\"orderId\":\"o-0\"",
    )
    .await;
    assert_eq!(status, 400, "{}", String::from_utf8_lossy(&body));
    assert_eq!(success(&body), false);
    let (status, _, body) = eneba(&api, ENEBA_TOKEN, json!({"action": "RESERVE", "orderId": "o-0", "auctions": [{"auctionId": "unknown-auction", "keyCount": 1}]})).await;
    assert_eq!(status, 200);
    assert_eq!(
        json_of(&body),
        json!({"action": "RESERVE", "orderId": "o-0", "success": false, "message": json_of(&body)["message"]})
    );
    // More than the pool can give to one order: all or nothing.
    let (_, _, body) = eneba(&api, ENEBA_TOKEN, reserve("o-big", 41)).await;
    assert_eq!(success(&body), false);
    assert_eq!(held(&env, "gx").await, 0, "bad input held nothing");
    assert_eq!(count_docs(&env, "channel_deals", doc! {}).await, 0);

    // RESERVE, delivered twice: one hold of 2.
    for _ in 0..2 {
        let (status, _, body) = eneba(&api, ENEBA_TOKEN, reserve("o-1", 2)).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        assert_eq!(
            json_of(&body),
            json!({"action": "RESERVE", "orderId": "o-1", "success": true})
        );
    }
    assert_eq!(held(&env, "gx").await, 2);

    // PROVIDE, delivered twice: the same bytes, the order's codes.
    let (status, _, first) = eneba(&api, ENEBA_TOKEN, provide("o-1")).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&first));
    assert_eq!(success(&first), true);
    let (_, _, again) = eneba(&api, ENEBA_TOKEN, provide("o-1")).await;
    assert_eq!(
        first, again,
        "a retried PROVIDE answers byte for byte the same"
    );
    let mut keys = keys_of(&first);
    keys.sort();
    assert_eq!(keys.len(), 2);
    assert_eq!(codes_of(&env, "eneba:en:o-1").await, keys);
    assert_eq!(held(&env, "gx").await, 0, "the hold became the order");
    assert_eq!(json_of(&first)["auctions"][0]["keys"][0]["type"], "TEXT");

    // CANCEL after PROVIDE (burn, the default): 200, the keys are void,
    // and the order provides nothing again.
    for _ in 0..2 {
        let (status, _, body) = eneba(&api, ENEBA_TOKEN, cancel("o-1")).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    }
    assert_eq!(
        count_codes(&env, doc! {"order_id": "eneba:en:o-1", "status": 3}).await,
        2,
        "burned"
    );
    let (_, _, body) = eneba(&api, ENEBA_TOKEN, provide("o-1")).await;
    assert_eq!(success(&body), false);

    // CANCEL before PROVIDE: the hold goes back; a later PROVIDE gets
    // nothing, and no code went to the order.
    eneba(&api, ENEBA_TOKEN, reserve("o-2", 2)).await;
    assert_eq!(held(&env, "gx").await, 2);
    let (status, _, _) = eneba(&api, ENEBA_TOKEN, cancel("o-2")).await;
    assert_eq!(status, 200);
    assert_eq!(held(&env, "gx").await, 0);
    let (_, _, body) = eneba(&api, ENEBA_TOKEN, provide("o-2")).await;
    assert_eq!(success(&body), false);
    let (_, _, body) = eneba(&api, ENEBA_TOKEN, reserve("o-2", 2)).await;
    assert_eq!(
        success(&body),
        false,
        "a cancelled order reserves nothing again"
    );
    assert!(codes_of(&env, "eneba:en:o-2").await.is_empty());
    // An unknown order: nothing to provide, nothing to cancel.
    let (_, _, body) = eneba(&api, ENEBA_TOKEN, provide("o-never")).await;
    assert_eq!(success(&body), false);
    let (status, _, _) = eneba(&api, ENEBA_TOKEN, cancel("o-never")).await;
    assert_eq!(status, 200);

    // A paused channel reserves nothing new.
    codepool_ok(&env, &["channels", "pause", "--name", "en"]).await;
    let (_, _, body) = eneba(&api, ENEBA_TOKEN, reserve("o-3", 1)).await;
    assert_eq!(success(&body), false);
    assert_eq!(held(&env, "gx").await, 0);
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn an_eneba_reservation_outlives_the_hour_after_which_a_checkout_holds_codes_are_strays() {
    let env = selling("channels_long_hold", "gx", 20, &[], &[]).await;
    let api = ApiServer::start(&env, &[]).await;
    let (_, _, body) = eneba(&api, ENEBA_TOKEN, reserve("l-1", 2)).await;
    assert_eq!(success(&body), true);
    // Two hours pass (Eneba's payment window is 48): the codes have been
    // held longer than any checkout hold lives.
    let ago =
        bson::DateTime::from_millis(bson::DateTime::now().timestamp_millis() - 2 * 3600 * 1000);
    env.coll("codes")
        .update_many(
            doc! {"pool": "gx", "status": 4},
            doc! {"$set": {"issued_at": ago}},
        )
        .await
        .unwrap();
    // The sweep (every 5 s) runs at least twice.
    tokio::time::sleep(Duration::from_secs(12)).await;
    assert_eq!(
        held(&env, "gx").await,
        2,
        "a live reservation's codes are no strays"
    );
    let held_ids: Vec<bson::Bson> = find_docs(&env, "codes", doc! {"pool": "gx", "status": 4})
        .await
        .iter()
        .map(|d| d.get("_id").unwrap().clone())
        .collect();
    let (_, _, body) = eneba(&api, ENEBA_TOKEN, provide("l-1")).await;
    assert_eq!(success(&body), true);
    let given: Vec<bson::Bson> = find_docs(&env, "codes", doc! {"order_id": "eneba:en:l-1"})
        .await
        .iter()
        .map(|d| d.get("_id").unwrap().clone())
        .collect();
    assert_eq!(given.len(), 2);
    assert!(
        given.iter().all(|g| held_ids.contains(g)),
        "the held codes were provided"
    );
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn eneba_resell_policy_keeps_provided_keys_sold_and_answers_500() {
    let env = selling(
        "channels_resell",
        "gx",
        20,
        &["--after-provide", "resell"],
        &[],
    )
    .await;
    let api = ApiServer::start(&env, &[]).await;
    eneba(&api, ENEBA_TOKEN, reserve("r-1", 1)).await;
    let (_, _, body) = eneba(&api, ENEBA_TOKEN, provide("r-1")).await;
    let keys = keys_of(&body);
    assert_eq!(keys.len(), 1);
    let (status, _, body) = eneba(&api, ENEBA_TOKEN, cancel("r-1")).await;
    assert_eq!(status, 500, "{}", String::from_utf8_lossy(&body));
    assert_eq!(json_of(&body)["action"], "CANCEL");
    assert_eq!(
        count_codes(&env, doc! {"order_id": "eneba:en:r-1", "status": 1}).await,
        1,
        "the key stays sold: Eneba resells it from its own stock"
    );
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn eneba_faults_timeouts_duplicates_and_cancel_racing_provide_leak_nothing() {
    let env = selling("channels_eneba_faults", "gx", 60, &[], &[]).await;
    let api = ApiServer::start(&env, &[]).await;

    // A client timeout while codepool commits: Eneba gives up on the first
    // PROVIDE (the connection drops before the answer) and retries; the
    // retry gets the keys the first committed.
    for i in 0..5 {
        let order = format!("t-{i}");
        eneba(&api, ENEBA_TOKEN, reserve(&order, 2)).await;
        let addr = api.addr.clone();
        let body = provide(&order).to_string();
        let cut = tokio::spawn(async move {
            http(
                &addr,
                "POST",
                "/channels/en/eneba",
                Some(ENEBA_TOKEN),
                body.as_bytes(),
            )
            .await
        });
        tokio::time::sleep(Duration::from_millis(5 * i)).await;
        cut.abort();
        let _ = cut.await;
        let (status, _, retry) = eneba(&api, ENEBA_TOKEN, provide(&order)).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&retry));
        let mut keys = keys_of(&retry);
        keys.sort();
        assert_eq!(keys.len(), 2, "{}", String::from_utf8_lossy(&retry));
        assert_eq!(codes_of(&env, &format!("eneba:en:{order}")).await, keys);
        let (_, _, third) = eneba(&api, ENEBA_TOKEN, provide(&order)).await;
        assert_eq!(retry, third);
    }

    // Every callback delivered twice at once, and CANCEL racing PROVIDE.
    let mut tasks = Vec::new();
    for i in 0..8 {
        let addr = api.addr.clone();
        tasks.push(tokio::spawn(async move {
            let order = format!("d-{i}");
            let send = |body: Value| {
                let addr = addr.clone();
                async move {
                    http(
                        &addr,
                        "POST",
                        "/channels/en/eneba",
                        Some(ENEBA_TOKEN),
                        body.to_string().as_bytes(),
                    )
                    .await
                }
            };
            let (a, b) = tokio::join!(send(reserve(&order, 1)), send(reserve(&order, 1)));
            assert_eq!(success(&a.2), success(&b.2));
            let racing = i % 2 == 0;
            let (p1, p2, c) = tokio::join!(send(provide(&order)), send(provide(&order)), async {
                if racing {
                    Some(send(cancel(&order)).await)
                } else {
                    None
                }
            });
            if let Some(c) = &c {
                assert_eq!(c.0, 200, "{}", String::from_utf8_lossy(&c.2));
            }
            (order, racing, p1, p2)
        }));
    }
    let mut seen: HashMap<String, String> = HashMap::new();
    for t in tasks {
        let (order, racing, p1, p2) = t.await.unwrap();
        let codes = codes_of(&env, &format!("eneba:en:{order}")).await;
        for p in [&p1, &p2] {
            if success(&p.2) == true {
                let mut keys = keys_of(&p.2);
                keys.sort();
                assert_eq!(keys, codes, "{order}: the keys given are the order's");
            }
        }
        if success(&p1.2) == true && success(&p2.2) == true {
            assert_eq!(p1.2, p2.2, "{order}: both deliveries got the same keys");
        }
        if racing {
            // Either the keys were provided, then burned, or the hold went back.
            let live = count_codes(
                &env,
                doc! {"order_id": format!("eneba:en:{order}"), "status": 1},
            )
            .await;
            assert_eq!(live, 0, "{order}: a cancelled order keeps no live key");
        } else {
            assert_eq!(codes.len(), 1, "{order}");
        }
        for c in codes {
            assert!(
                seen.insert(c.clone(), order.clone()).is_none(),
                "{c} went to two orders"
            );
        }
    }
    assert_eq!(held(&env, "gx").await, 0, "no hold leaks");
    api.stop().await;
    env.cleanup().await;
}

/// A G2A access token for channel `g2`.
async fn g2a_token(api: &ApiServer) -> String {
    let path = format!("/channels/g2/g2a/oauth/token?grant_type=client_credentials&client_id={G2A_ID}&client_secret={G2A_SECRET}");
    let (status, _, body) = http(&api.addr, "GET", &path, None, b"").await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let v = json_of(&body);
    assert_eq!(v["token_type"], "bearer");
    assert!(v["expires_in"].as_u64().is_some());
    v["access_token"].as_str().unwrap().to_owned()
}

async fn g2a(api: &ApiServer, method: &str, path: &str, token: &str, body: Value) -> Exchange {
    let body = if body.is_null() {
        Vec::new()
    } else {
        body.to_string().into_bytes()
    };
    http(
        &api.addr,
        method,
        &format!("/channels/g2{path}"),
        Some(token),
        &body,
    )
    .await
}

#[tokio::test]
async fn g2a_tokens_reservations_orders_inventory_and_returns_follow_the_contract() {
    let env = selling("channels_g2a", "gx", 40, &[], &["--token-ttl", "5"]).await;
    let api = ApiServer::start(&env, &[]).await;
    let (status, _, _) = http(&api.addr, "GET", "/channels/g2/g2a/healthcheck", None, b"").await;
    assert_eq!(status, 204);

    // Wrong client credentials, no token, a forged token: 401, nothing held.
    let bad = format!("/channels/g2/g2a/oauth/token?grant_type=client_credentials&client_id={G2A_ID}&client_secret=wrong");
    let (status, _, body) = http(&api.addr, "GET", &bad, None, b"").await;
    assert_eq!(status, 401, "{}", String::from_utf8_lossy(&body));
    assert!(json_of(&body)["code"].is_string());
    let (status, _, _) = g2a(&api, "POST", "/g2a/reservation", "forged", reservation(1)).await;
    assert_eq!(status, 401);
    let token = g2a_token(&api).await;
    // A malformed body, an unknown product: refused, nothing held.
    let (status, _, _) = g2a(
        &api,
        "POST",
        "/g2a/reservation",
        &token,
        json!({"product_id": 1}),
    )
    .await;
    assert_eq!(status, 400);
    let (status, _, _) = g2a(
        &api,
        "POST",
        "/g2a/reservation",
        &token,
        json!([{"product_id": 99, "quantity": 1}]),
    )
    .await;
    assert_eq!(status, 404);
    assert_eq!(held(&env, "gx").await, 0);

    let (status, _, body) = g2a(&api, "POST", "/g2a/reservation", &token, reservation(2)).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let v = json_of(&body);
    let rid = v["reservation_id"].as_str().unwrap().to_owned();
    assert!(rid.len() <= 36);
    assert_eq!(
        v["stock"][0]["product_id"],
        json!(PRODUCT.parse::<u64>().unwrap())
    );
    assert_eq!(v["stock"][0]["inventory_size"], 38);
    assert_eq!(held(&env, "gx").await, 2);

    // The token expires mid-run: 401, then a fresh one works.
    tokio::time::sleep(Duration::from_millis(5500)).await;
    let order = json!({"reservation_id": rid, "g2a_order_id": 7001});
    let (status, _, _) = g2a(&api, "POST", "/g2a/order", &token, order.clone()).await;
    assert_eq!(status, 401, "an expired token");
    assert_eq!(held(&env, "gx").await, 2, "nothing happened");
    // From here on G2A fetches a token whenever its last one ran out, as
    // its client does: a fresh one per call.
    let (status, _, first) = g2a(
        &api,
        "POST",
        "/g2a/order",
        &g2a_token(&api).await,
        order.clone(),
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&first));
    let items = inventory_of(&json_of(&first)["stock"]);
    assert_eq!(items.len(), 2);
    // The same order again (G2A timed out): the same keys and ids.
    let (status, _, again) = g2a(
        &api,
        "POST",
        "/g2a/order",
        &g2a_token(&api).await,
        order.clone(),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(inventory_of(&json_of(&again)["stock"]), items);
    // Another G2A order of the same reservation: 409, nothing more.
    let (status, _, _) = g2a(
        &api,
        "POST",
        "/g2a/order",
        &g2a_token(&api).await,
        json!({"reservation_id": rid, "g2a_order_id": 7002}),
    )
    .await;
    assert_eq!(status, 409);
    let order_id = format!("g2a:g2:{rid}");
    assert_eq!(codes_of(&env, &order_id).await.len(), 2);

    // The inventory, read twice: the same ids.
    let path = format!("/g2a/order/{rid}/inventory");
    let (status, _, read1) = g2a(&api, "GET", &path, &g2a_token(&api).await, Value::Null).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&read1));
    let (_, _, read2) = g2a(&api, "GET", &path, &g2a_token(&api).await, Value::Null).await;
    assert_eq!(inventory_of(&json_of(&read1)), items);
    assert_eq!(inventory_of(&json_of(&read2)), items);

    // A return naming an item from the first read: voided (never back in
    // stock). One naming an unknown item: 404, nothing changes.
    let (status, _, _) = g2a(
        &api,
        "DELETE",
        &format!("{path}?id[]={}&id[]=nope", items[0].0),
        &g2a_token(&api).await,
        Value::Null,
    )
    .await;
    assert_eq!(status, 404);
    assert_eq!(
        count_codes(&env, doc! {"order_id": &order_id, "status": 3}).await,
        0
    );
    let (status, _, body) = g2a(
        &api,
        "DELETE",
        &format!("{path}?id[]={}", items[0].0),
        &g2a_token(&api).await,
        Value::Null,
    )
    .await;
    assert_eq!(status, 204, "{}", String::from_utf8_lossy(&body));
    assert_eq!(
        count_codes(&env, doc! {"order_id": &order_id, "status": 3}).await,
        1
    );
    let (_, _, read3) = g2a(&api, "GET", &path, &g2a_token(&api).await, Value::Null).await;
    assert_eq!(inventory_of(&json_of(&read3)), items[1..].to_vec());
    assert_eq!(
        count_codes(&env, doc! {"pool": "gx", "status": 0}).await,
        38,
        "a returned key does not go back to stock"
    );

    // A reservation past its time: 410; renewed, it orders.
    let (_, _, body) = g2a(
        &api,
        "POST",
        "/g2a/reservation",
        &g2a_token(&api).await,
        reservation(1),
    )
    .await;
    let late = json_of(&body)["reservation_id"]
        .as_str()
        .unwrap()
        .to_owned();
    env.coll("holds")
        .update_one(
            doc! {"hold_id": format!("g2a:g2:{late}")},
            doc! {"$set": {"expires_at": bson::DateTime::from_millis(bson::DateTime::now().timestamp_millis() - 1000)}},
        )
        .await
        .unwrap();
    let late_order = json!({"reservation_id": late, "g2a_order_id": 7003});
    let (status, _, body) = g2a(
        &api,
        "POST",
        "/g2a/order",
        &g2a_token(&api).await,
        late_order.clone(),
    )
    .await;
    assert_eq!(status, 410, "{}", String::from_utf8_lossy(&body));
    assert!(codes_of(&env, &format!("g2a:g2:{late}")).await.is_empty());
    eventually(
        Duration::from_secs(20),
        "the expired hold's code back in stock",
        || async { held(&env, "gx").await == 0 },
    )
    .await;
    let (status, _, body) = g2a(
        &api,
        "PUT",
        &format!("/g2a/reservation/{late}"),
        &g2a_token(&api).await,
        Value::Null,
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(held(&env, "gx").await, 1);
    let (status, _, body) = g2a(
        &api,
        "POST",
        "/g2a/order",
        &g2a_token(&api).await,
        late_order,
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(codes_of(&env, &format!("g2a:g2:{late}")).await.len(), 1);

    // A released reservation: 204, back in stock, then 410 to order.
    let (_, _, body) = g2a(
        &api,
        "POST",
        "/g2a/reservation",
        &g2a_token(&api).await,
        reservation(3),
    )
    .await;
    let gone = json_of(&body)["reservation_id"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(held(&env, "gx").await, 3);
    let (status, _, _) = g2a(
        &api,
        "DELETE",
        &format!("/g2a/reservation/{gone}"),
        &g2a_token(&api).await,
        Value::Null,
    )
    .await;
    assert_eq!(status, 204);
    assert_eq!(held(&env, "gx").await, 0);
    let (status, _, _) = g2a(
        &api,
        "POST",
        "/g2a/order",
        &g2a_token(&api).await,
        json!({"reservation_id": gone, "g2a_order_id": 7004}),
    )
    .await;
    assert_eq!(status, 410);
    let (status, _, _) = g2a(
        &api,
        "DELETE",
        "/g2a/reservation/unknown-id",
        &g2a_token(&api).await,
        Value::Null,
    )
    .await;
    assert_eq!(status, 404);
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn one_pool_sold_by_the_shop_eneba_and_g2a_at_once_sells_no_code_twice_and_leaks_no_hold() {
    let env = selling("channels_mixed", "gx", 80, &[], &[]).await;
    let shop = shop_key(&env, "acme-1", "acme").await;
    let api = ApiServer::start(&env, &[]).await;
    let token = g2a_token(&api).await;
    let addr = api.addr.clone();

    let mut shop_orders = Vec::new();
    for i in 0..20 {
        let (addr, shop) = (addr.clone(), shop.clone());
        shop_orders.push(tokio::spawn(async move {
            let body = crate::api::order(&format!("S-{i}"), "gx", 1);
            let (status, _, body) = http(&addr, "POST", "/v1/orders", Some(&shop), &body).await;
            assert!(
                status == 201 || status == 202,
                "{status}: {}",
                String::from_utf8_lossy(&body)
            );
        }));
    }
    let mut enebas = Vec::new();
    for i in 0..16 {
        let addr = addr.clone();
        enebas.push(tokio::spawn(async move {
            let order = format!("m-{i}");
            let send = |body: Value| {
                let addr = addr.clone();
                async move {
                    http(
                        &addr,
                        "POST",
                        "/channels/en/eneba",
                        Some(ENEBA_TOKEN),
                        body.to_string().as_bytes(),
                    )
                    .await
                }
            };
            let (r, _) = tokio::join!(send(reserve(&order, 1)), send(reserve(&order, 1)));
            if success(&r.2) != true {
                return (order, None);
            }
            match i % 4 {
                // Abandoned: cancelled before provision.
                0 => {
                    send(cancel(&order)).await;
                    (order, None)
                }
                // Provided, then cancelled (burned).
                1 => {
                    send(provide(&order)).await;
                    send(cancel(&order)).await;
                    (order, None)
                }
                _ => {
                    let (a, b) = tokio::join!(send(provide(&order)), send(provide(&order)));
                    assert_eq!(a.2, b.2, "{order}: a retried provision gets the same keys");
                    (order, Some(keys_of(&a.2)))
                }
            }
        }));
    }
    let mut g2as = Vec::new();
    for i in 0..10u64 {
        let (addr, token) = (addr.clone(), token.clone());
        g2as.push(tokio::spawn(async move {
            let call = |method: &'static str, path: String, body: Value| {
                let (addr, token) = (addr.clone(), token.clone());
                async move {
                    let body = if body.is_null() {
                        Vec::new()
                    } else {
                        body.to_string().into_bytes()
                    };
                    http(
                        &addr,
                        method,
                        &format!("/channels/g2{path}"),
                        Some(&token),
                        &body,
                    )
                    .await
                }
            };
            let (status, _, body) = call("POST", "/g2a/reservation".into(), reservation(1)).await;
            if status != 200 {
                return None;
            }
            let rid = json_of(&body)["reservation_id"]
                .as_str()
                .unwrap()
                .to_owned();
            if i % 3 == 0 {
                call("DELETE", format!("/g2a/reservation/{rid}"), Value::Null).await;
                return None;
            }
            let order = json!({"reservation_id": rid, "g2a_order_id": 9000 + i});
            let (a, b) = tokio::join!(
                call("POST", "/g2a/order".into(), order.clone()),
                call("POST", "/g2a/order".into(), order)
            );
            assert_eq!(a.0, 200, "{}", String::from_utf8_lossy(&a.2));
            let ka = inventory_of(&json_of(&a.2)["stock"]);
            assert_eq!(
                ka,
                inventory_of(&json_of(&b.2)["stock"]),
                "the same keys twice"
            );
            Some(ka.into_iter().map(|(_, v)| v).collect::<Vec<_>>())
        }));
    }
    for t in shop_orders {
        t.await.unwrap();
    }
    let mut given: Vec<String> = Vec::new();
    for t in enebas {
        if let (_, Some(keys)) = t.await.unwrap() {
            given.extend(keys);
        }
    }
    for t in g2as {
        if let Some(keys) = t.await.unwrap() {
            given.extend(keys);
        }
    }
    for i in 0..20 {
        given.extend(codes_of(&env, &format!("S-{i}")).await);
    }
    let distinct: HashSet<&String> = given.iter().collect();
    assert_eq!(distinct.len(), given.len(), "no code sold twice");
    assert_eq!(given.len(), 20 + 8 + 6, "every sale got its code");
    assert_eq!(held(&env, "gx").await, 0, "no hold leaks after cancels");
    // Every code issued belongs to one of the sales above, or was burned.
    let issued = count_codes(&env, doc! {"pool": "gx", "status": 1}).await;
    assert_eq!(issued as usize, given.len());
    api.stop().await;
    env.cleanup().await;
}

/// Eneba's API as a seller's declarations reach it: `POST /oauth/token`
/// (`grant_type=api_consumer`, `id`, `secret`) and `POST /graphql`
/// (`S_updateAuction(input: {id, declaredStock})` under the bearer token),
/// each declaration recorded in the order it came.
struct EnebaApi {
    addr: std::net::SocketAddr,
    declared: std::sync::Arc<std::sync::Mutex<Vec<(String, u64)>>>,
}

const ENEBA_API_ID: &str = "eneba-auth-id";
const ENEBA_API_SECRET: &str = "eneba-api-secret-value";

impl EnebaApi {
    async fn start() -> Self {
        use axum::http::{HeaderMap, StatusCode};
        use std::sync::{Arc, Mutex};
        let declared: Arc<Mutex<Vec<(String, u64)>>> = Arc::default();
        let seen = declared.clone();
        let app = axum::Router::new()
            .route(
                "/oauth/token",
                axum::routing::post(|body: String| async move {
                    // The values sent here need no percent-decoding.
                    let form: HashMap<String, String> = (body.split('&'))
                        .filter_map(|kv| kv.split_once('='))
                        .map(|(k, v)| (k.to_owned(), v.to_owned()))
                        .collect();
                    let ok = form.get("grant_type").map(String::as_str) == Some("api_consumer")
                        && form.get("id").map(String::as_str) == Some(ENEBA_API_ID)
                        && form.get("secret").map(String::as_str) == Some(ENEBA_API_SECRET);
                    if !ok {
                        return (StatusCode::UNAUTHORIZED, "{}".to_owned());
                    }
                    let t = json!({"token_type": "Bearer", "expires_in": 2505600, "access_token": "sim-access-token"});
                    (StatusCode::OK, t.to_string())
                }),
            )
            .route(
                "/graphql",
                axum::routing::post(move |headers: HeaderMap, body: String| {
                    let seen = seen.clone();
                    async move {
                        let auth = headers
                            .get("authorization")
                            .and_then(|v| v.to_str().ok())
                            .unwrap_or_default();
                        if auth != "Bearer sim-access-token" {
                            return (StatusCode::UNAUTHORIZED, "{}".to_owned());
                        }
                        let q = json_of(body.as_bytes())["query"]
                            .as_str()
                            .unwrap_or_default()
                            .to_owned();
                        let id = q.split("id: \"").nth(1).and_then(|r| r.split('"').next());
                        let n = q
                            .split("declaredStock: ")
                            .nth(1)
                            .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
                            .and_then(|n| n.parse::<u64>().ok());
                        match (q.contains("S_updateAuction"), id, n) {
                            (true, Some(id), Some(n)) => {
                                seen.lock().unwrap().push((id.to_owned(), n));
                                let a = json!({"data": {"S_updateAuction": {"success": true, "actionId": "a-1"}}});
                                (StatusCode::OK, a.to_string())
                            }
                            _ => (
                                StatusCode::OK,
                                json!({"errors": [{"message": "bad query"}]}).to_string(),
                            ),
                        }
                    }
                }),
            );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        Self { addr, declared }
    }

    fn credentials(&self) -> Value {
        json!({"token": ENEBA_TOKEN, "api_client_id": ENEBA_API_ID, "api_secret": ENEBA_API_SECRET,
               "api_url": format!("http://{}/graphql", self.addr),
               "auth_url": format!("http://{}/oauth/token", self.addr)})
    }

    fn last(&self, auction: &str) -> Option<u64> {
        (self.declared.lock().unwrap().iter().rev())
            .find(|(a, _)| a == auction)
            .map(|(_, n)| *n)
    }

    /// Waits up to `within` for the last declaration of `auction` to be `n`.
    async fn declares(&self, auction: &str, n: u64, within: Duration) -> bool {
        let until = std::time::Instant::now() + within;
        while std::time::Instant::now() < until {
            if self.last(auction) == Some(n) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.last(auction) == Some(n)
    }
}

#[tokio::test]
async fn declared_stock_follows_the_pool_under_the_channels_cap_and_never_over_promises() {
    let env = TestEnv::new("channels_declare").await;
    env.fill_pool("gx", 10).await;
    create_shop(&env, "acme", "gx", &[]).await;
    let eneba_api = EnebaApi::start().await;
    add_channel(
        &env,
        "en",
        "eneba",
        "acme",
        eneba_api.credentials(),
        &["--max", "6"],
    )
    .await;
    // Mapped: declared at once, capped by --max.
    map(&env, "en", AUCTION, "gx").await;
    assert_eq!(eneba_api.last(AUCTION), Some(6), "{:?}", eneba_api.declared);
    // A share of the pool's free codes: 50 % of 10.
    codepool_ok(&env, &["channels", "set", "--name", "en", "--share", "50"]).await;
    assert_eq!(eneba_api.last(AUCTION), Some(5));
    for bad in [
        vec!["channels", "set", "--name", "en", "--share", "101"],
        vec!["channels", "set", "--name", "nope", "--max", "3"],
        vec!["channels", "set", "--name", "en", "--max", "-1"],
    ] {
        assert!(!env.run(&bad).await.status.success(), "{bad:?} was taken");
    }
    let shown: Value = serde_json::from_str(
        &codepool_ok(&env, &["channels", "show", "--name", "en", "--json"]).await,
    )
    .unwrap();
    assert_eq!(shown["share_percent"], 50);
    assert_eq!(shown["max_stock"], 6);
    assert_eq!(shown["declared"], json!({AUCTION: 5}));
    assert_eq!(
        count_docs(
            &env,
            "audit",
            doc! {"kind": "channel-set", "what": {"$regex": "50 %"}}
        )
        .await,
        1,
        "the cap is audited"
    );
    // G2A's inventory_size is the declared amount too.
    add_channel(
        &env,
        "g2",
        "g2a",
        "acme",
        json!({"client_id": G2A_ID, "client_secret": G2A_SECRET}),
        &["--max", "2"],
    )
    .await;
    map(&env, "g2", PRODUCT, "gx").await;

    let shop = shop_key(&env, "acme-1", "acme").await;
    let api = ApiServer::start(&env, &[]).await;
    let token = g2a_token(&api).await;
    let (status, _, body) = g2a(&api, "POST", "/g2a/reservation", &token, reservation(1)).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(
        json_of(&body)["stock"][0]["inventory_size"],
        2,
        "capped by --max"
    );
    let rid = json_of(&body)["reservation_id"]
        .as_str()
        .unwrap()
        .to_owned();
    g2a(
        &api,
        "DELETE",
        &format!("/g2a/reservation/{rid}"),
        &token,
        Value::Null,
    )
    .await;

    // The shop's own checkout sells 4: 6 free, Eneba is told 3 (on change).
    let order = crate::api::order("S-1", "gx", 4);
    let (status, _, body) = http(&api.addr, "POST", "/v1/orders", Some(&shop), &order).await;
    assert_eq!(status, 201, "{}", String::from_utf8_lossy(&body));
    assert!(
        eneba_api.declares(AUCTION, 3, Duration::from_secs(5)).await,
        "{:?}",
        eneba_api.declared
    );
    // Eneba reserves 1: 5 free, 50 % of them is 2.
    let (_, _, body) = eneba(&api, ENEBA_TOKEN, reserve("d-1", 1)).await;
    assert_eq!(success(&body), true, "{}", String::from_utf8_lossy(&body));
    assert!(
        eneba_api.declares(AUCTION, 2, Duration::from_secs(5)).await,
        "{:?}",
        eneba_api.declared
    );

    // No cap: all 5 free codes declared at once.
    codepool_ok(
        &env,
        &[
            "channels", "set", "--name", "en", "--share", "none", "--max", "none",
        ],
    )
    .await;
    assert_eq!(eneba_api.last(AUCTION), Some(5));
    // The codes go where codepool is not told (another system burns them):
    // Eneba's next reservation finds none though 5 were promised. It is
    // counted as an over-promise, and 0 is declared at once.
    env.coll("codes")
        .update_many(
            doc! {"pool": "gx", "status": 0},
            doc! {"$set": {"status": 3}},
        )
        .await
        .unwrap();
    let overpromised = "codepool_channel_overpromised_total{channel=\"en\"}";
    assert_eq!(metric_sum(&[&api.addr], overpromised).await, 0.0);
    let before = eneba_api.declared.lock().unwrap().len();
    let (_, _, body) = eneba(&api, ENEBA_TOKEN, reserve("d-2", 1)).await;
    assert_eq!(success(&body), false);
    assert!(
        eneba_api
            .declares(AUCTION, 0, Duration::from_millis(900))
            .await,
        "a pool that runs out declares 0 at once: {:?}",
        eneba_api.declared
    );
    assert_eq!(metric_sum(&[&api.addr], overpromised).await, 1.0);
    // Declared 0, the next refusal is no over-promise.
    let (_, _, body) = eneba(&api, ENEBA_TOKEN, reserve("d-3", 1)).await;
    assert_eq!(success(&body), false);
    assert_eq!(metric_sum(&[&api.addr], overpromised).await, 1.0);
    assert!(eneba_api.declared.lock().unwrap().len() > before);
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_channels_sales_are_named_and_cut_in_statements_and_lookup_and_told_by_webhook_without_sms(
) {
    let env = selling("channels_accounting", "gx", 30, &[], &[]).await;
    let shop = shop_key(&env, "acme-1", "acme").await;
    let admin = crate::api::key(&env, "ops", "admin").await;
    let hooks = crate::webhooks::Receiver::start(crate::webhooks::Answer::Ok).await;
    crate::webhooks::add_endpoint(&env, "acme", &hooks.url(), "order.granted").await;
    let api = ApiServer::start(&env, &[]).await;

    // The shop's own order, an Eneba order of 2 and a G2A order of 1.
    let order = crate::api::order("S-1", "gx", 1);
    let (status, _, _) = http(&api.addr, "POST", "/v1/orders", Some(&shop), &order).await;
    assert_eq!(status, 201);
    eneba(&api, ENEBA_TOKEN, reserve("a-1", 2)).await;
    let (_, _, body) = eneba(&api, ENEBA_TOKEN, provide("a-1")).await;
    assert_eq!(
        keys_of(&body).len(),
        2,
        "{}",
        String::from_utf8_lossy(&body)
    );
    let token = g2a_token(&api).await;
    let (_, _, body) = g2a(&api, "POST", "/g2a/reservation", &token, reservation(1)).await;
    let rid = json_of(&body)["reservation_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let (status, _, _) = g2a(
        &api,
        "POST",
        "/g2a/order",
        &token,
        json!({"reservation_id": rid, "g2a_order_id": 77}),
    )
    .await;
    assert_eq!(status, 200);

    // The shop hears of each marketplace sale as of its own orders that
    // it saw in no answer (its own HTTP order it has in the answer).
    let eneba_order = "eneba:en:a-1".to_owned();
    let g2a_order = format!("g2a:g2:{rid}");
    let until = std::time::Instant::now() + Duration::from_secs(15);
    let told = || -> HashSet<String> {
        (hooks.of_type("order.granted").iter())
            .filter_map(|h| h.json()["data"]["order_id"].as_str().map(str::to_owned))
            .collect()
    };
    while std::time::Instant::now() < until
        && !(told().contains(&eneba_order) && told().contains(&g2a_order))
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let told = told();
    for o in [&eneba_order, &g2a_order] {
        assert!(told.contains(o), "order.granted of {o}: {told:?}");
    }
    let eneba_told = hooks.of_type("order.granted");
    let eneba_told = eneba_told
        .iter()
        .find(|h| h.json()["data"]["order_id"] == eneba_order.as_str())
        .unwrap();
    assert_eq!(eneba_told.json()["data"]["shop"], "acme");
    assert_eq!(
        eneba_told.json()["data"]["codes"].as_array().map(Vec::len),
        Some(2)
    );

    // A marketplace sale has no phone: no SMS is owed for it.
    let (conn, _) = env.amqp().await;
    let ch = conn.create_channel().await.unwrap();
    let t = env.topology();
    wait_depth(&ch, &t.sms_pending, 30, |n| n >= 1).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let texted: Vec<String> = drain(&ch, &t.sms_pending)
        .await
        .iter()
        .map(|e| {
            json_of(&e.body)["order_id"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
        .collect();
    assert!(texted.contains(&"S-1".to_owned()), "{texted:?}");
    assert!(
        texted.iter().all(|o| o == "S-1"),
        "sms.pending only for the shop's own order: {texted:?}"
    );

    // lookup names the channel.
    let found: Value = serde_json::from_str(
        &codepool_ok(&env, &["lookup", "--order", &eneba_order, "--json"]).await,
    )
    .unwrap();
    let codes = found["codes"].as_array().cloned().unwrap_or_default();
    assert_eq!(codes.len(), 2, "{found}");
    assert!(codes.iter().all(|c| c["channel"] == "en"), "{found}");
    let table = codepool_ok(&env, &["lookup", "--order", &g2a_order]).await;
    assert!(table.contains("sold through channel g2"), "{table}");

    // Statement lines name the channel of each sale; a statement cut by
    // channel counts its sales and ties out.
    let lines = codepool_ok(&env, &["statement", "--pool", "gx", "--lines"]).await;
    let sold: Vec<&str> = lines
        .lines()
        .filter(|l| l.contains(",issued,"))
        .map(|l| l.rsplit(',').next().unwrap_or_default())
        .collect();
    let mut sold_sorted = sold.clone();
    sold_sorted.sort();
    assert_eq!(sold_sorted, vec!["", "en", "en", "g2"], "{lines}");
    for (channel, n) in [("en", 2), ("g2", 1)] {
        let s: Value = serde_json::from_str(
            &codepool_ok(
                &env,
                &["statement", "--pool", "gx", "--channel", channel, "--json"],
            )
            .await,
        )
        .unwrap();
        assert_eq!(s["total"]["balance"]["issued"], n, "{channel}: {s}");
        assert_eq!(s["total"]["moves"]["issued"], n, "{channel}: {s}");
        assert_eq!(s["total"]["received"], n, "{channel}: {s}");
        assert_eq!(s["total"]["balance"]["in_stock"], 0, "{channel}: {s}");
        assert_eq!(s["total"]["off_by"], 0, "{channel} ties out: {s}");
    }
    let (status, _, body) = api.get("/v1/statements?pool=gx&channel=en", &admin).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(json_of(&body)["total"]["balance"]["issued"], 2);
    let (status, _, _) = api.get("/v1/statements?pool=gx&channel=nope", &admin).await;
    assert_eq!(status, 404);
    assert!(!env
        .run(&["statement", "--pool", "gx", "--channel", "nope"])
        .await
        .status
        .success());

    // Another door cannot take a channel's order (or hold) id.
    for id in ["eneba:en:a-2", "G2A:g2:x", "kinguin:k:1"] {
        let order = crate::api::order(id, "gx", 1);
        let (status, _, body) = http(&api.addr, "POST", "/v1/orders", Some(&shop), &order).await;
        assert_eq!(status, 409, "{id}: {}", String::from_utf8_lossy(&body));
        assert_eq!(json_of(&body)["field"], "order_id", "{id}");
    }
    let hold =
        json!({"hold_id": "eneba:en:a-3", "uid": "u", "items": [{"pool": "gx", "quantity": 1}]});
    let (status, _, body) = http(
        &api.addr,
        "POST",
        "/v1/holds",
        Some(&shop),
        hold.to_string().as_bytes(),
    )
    .await;
    assert!(
        status == 409 || status == 422,
        "{status}: {}",
        String::from_utf8_lossy(&body)
    );
    assert_eq!(held(&env, "gx").await, 0);
    // The channel's own order stands as it was.
    let (_, _, body) = eneba(&api, ENEBA_TOKEN, reserve("a-2", 1)).await;
    assert_eq!(success(&body), true);
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn an_eneba_replacement_replaces_one_key_under_the_orders_cap_the_same_on_a_retry() {
    let env = selling("channels_replace", "gx", 30, &[], &[]).await;
    let api = ApiServer::start(&env, &[]).await;
    eneba(&api, ENEBA_TOKEN, reserve("r-1", 2)).await;
    let (_, _, body) = eneba(&api, ENEBA_TOKEN, provide("r-1")).await;
    let sold = keys_of(&body);
    assert_eq!(sold.len(), 2);
    let replace = |key: &str| json!({"action": "RESERVE", "orderId": "r-1", "auctionId": AUCTION, "keyId": key});
    let provide_key = |key: &str| json!({"action": "PROVIDE", "orderId": "r-1", "keyId": key});

    // The replacement's RESERVE, delivered twice: one replacement.
    for _ in 0..2 {
        let (status, _, body) = eneba(&api, ENEBA_TOKEN, replace("k-1")).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        assert_eq!(
            json_of(&body),
            json!({"action": "RESERVE", "orderId": "r-1", "success": true})
        );
    }
    let replaced = count_codes(
        &env,
        doc! {"order_id": "eneba:en:r-1", "status": 3, "void_reason": "replaced"},
    )
    .await;
    assert_eq!(replaced, 1, "one key replaced");
    // Its PROVIDE, with the key or without, three times: the same new key.
    let (status, _, first) = eneba(&api, ENEBA_TOKEN, provide_key("k-1")).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&first));
    let new = keys_of(&first);
    assert_eq!(new.len(), 1, "{}", String::from_utf8_lossy(&first));
    assert!(!sold.contains(&new[0]), "a fresh key");
    assert_eq!(json_of(&first)["auctions"][0]["auctionId"], AUCTION);
    let (_, _, again) = eneba(&api, ENEBA_TOKEN, provide_key("k-1")).await;
    assert_eq!(first, again);
    let (_, _, plain) = eneba(&api, ENEBA_TOKEN, provide("r-1")).await;
    assert_eq!(first, plain);
    let now = codes_of(&env, "eneba:en:r-1").await;
    assert!(now.contains(&new[0]));

    // Two more keys: the pool's cap is 3 replacements an order; the 4th
    // is refused (Eneba refunds), nothing voided.
    for key in ["k-2", "k-3"] {
        let (_, _, body) = eneba(&api, ENEBA_TOKEN, replace(key)).await;
        assert_eq!(
            success(&body),
            true,
            "{key}: {}",
            String::from_utf8_lossy(&body)
        );
    }
    let (_, _, body) = eneba(&api, ENEBA_TOKEN, replace("k-4")).await;
    assert_eq!(success(&body), false, "{}", String::from_utf8_lossy(&body));
    assert_eq!(
        count_codes(&env, doc! {"order_id": "eneba:en:r-1", "status": 3}).await,
        3
    );
    // Each key got its own new key; the lines were replaced in turn.
    let k2 = keys_of(&eneba(&api, ENEBA_TOKEN, provide_key("k-2")).await.2);
    let k3 = keys_of(&eneba(&api, ENEBA_TOKEN, provide_key("k-3")).await.2);
    assert_eq!((k2.len(), k3.len()), (1, 1));
    let all: HashSet<&String> = sold.iter().chain(&new).chain(&k2).chain(&k3).collect();
    assert_eq!(all.len(), 5, "no key given twice");

    // An unknown order, an order not provided, another auction: refused,
    // nothing changes.
    eneba(&api, ENEBA_TOKEN, reserve("r-2", 1)).await;
    for body in [
        json!({"action": "RESERVE", "orderId": "r-none", "auctionId": AUCTION, "keyId": "k-9"}),
        json!({"action": "RESERVE", "orderId": "r-2", "auctionId": AUCTION, "keyId": "k-9"}),
        json!({"action": "RESERVE", "orderId": "r-1", "auctionId": "other-auction", "keyId": "k-9"}),
    ] {
        let (status, _, answer) = eneba(&api, ENEBA_TOKEN, body.clone()).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(success(&answer), false, "{body}");
    }
    let (status, _, _) = eneba(
        &api,
        ENEBA_TOKEN,
        json!({"action": "RESERVE", "orderId": "r-1", "keyId": "k-9"}),
    )
    .await;
    assert_eq!(status, 400, "a replacement names its auction");
    assert_eq!(
        count_codes(&env, doc! {"order_id": "eneba:en:r-1", "status": 3}).await,
        3
    );
    api.stop().await;
    env.cleanup().await;
}

// ---------------------------------------------------------------- Kinguin

/// A shop `acme` selling pool `pool` (of `n` codes) on Kinguin (`kg`),
/// Kinguin's API being `sim`.
async fn selling_on_kinguin(test: &str, pool: &str, n: usize, sim: &Kinguin) -> TestEnv {
    selling_on_kinguin_with(test, pool, n, sim, json!({}), &[]).await
}

/// [`selling_on_kinguin`] with `creds` added to the channel's credentials
/// and `flags` to `channels add`.
async fn selling_on_kinguin_with(
    test: &str,
    pool: &str,
    n: usize,
    sim: &Kinguin,
    creds: Value,
    flags: &[&str],
) -> TestEnv {
    let env = TestEnv::new(test).await;
    env.fill_pool(pool, n).await;
    create_shop(&env, "acme", pool, &[]).await;
    let mut all = json!({"webhook_secret": KG_SECRET, "client_id": KG_CLIENT, "client_secret": KG_CLIENT_SECRET, "base_url": sim.url});
    for (k, v) in creds.as_object().into_iter().flatten() {
        all[k] = v.clone();
    }
    add_channel(&env, "kg", "kinguin", "acme", all, flags).await;
    map(&env, "kg", OFFER, pool).await;
    env
}

/// Kinguin delivers every webhook twice, at once: both get one answer.
async fn kg_twice(api: &ApiServer, hook: Value) -> (u16, Value) {
    let body = hook.to_string().into_bytes();
    let (a, b) = tokio::join!(
        kinguin_post(&api.addr, Some(KG_SECRET), &body),
        kinguin_post(&api.addr, Some(KG_SECRET), &body)
    );
    assert_eq!(a.0, b.0, "{hook}: {a:?} / {b:?}");
    a
}

fn kg_order(reservation: &str) -> String {
    format!("kinguin:kg:{reservation}")
}

/// The upload record of `reservation`.
async fn kg_upload(env: &TestEnv, reservation: &str) -> bson::Document {
    let id = format!("kg\u{1f}{reservation}");
    (find_docs(env, "kinguin_uploads", doc! {"_id": id}).await)
        .pop()
        .unwrap_or_default()
}

/// Sells `n` reservations (BUYING then BOUGHT, each delivered twice)
/// and waits until Kinguin holds each one's key: the key of its order,
/// sent the same on every attempt, no key twice.
async fn kg_sell_and_check(env: &TestEnv, api: &ApiServer, sim: &Kinguin, n: usize) {
    for i in 0..n {
        let r = format!("res-{i}");
        assert_eq!(kg_twice(api, kg_hook(&r, "BUYING")).await.0, 200);
        let (status, body) = kg_twice(api, kg_hook(&r, "BOUGHT")).await;
        assert_eq!(status, 200, "{body}");
    }
    eventually(Duration::from_secs(60), "every key uploaded", || async {
        count_docs(env, "kinguin_uploads", doc! {"upload": "uploaded"}).await == n as u64
    })
    .await;
    let stock = sim.stock();
    let mut keys = HashSet::new();
    for i in 0..n {
        let r = format!("res-{i}");
        let codes = codes_of(env, &kg_order(&r)).await;
        assert_eq!(codes.len(), 1, "{r}: one key per reservation");
        assert_eq!(
            stock.get(&r),
            Some(&codes[0]),
            "{r}: Kinguin holds its order's key"
        );
        for (ar, ak) in sim.attempts() {
            if ar == r {
                assert_eq!(ak, codes[0], "{r}: every attempt sent the same key");
            }
        }
        assert!(keys.insert(codes[0].clone()), "no key given twice");
    }
    assert_eq!(held(env, "kx").await, 0, "every hold committed");
}

#[tokio::test]
async fn kinguin_webhooks_hold_commit_upload_release_and_void_each_once() {
    let sim = Kinguin::start(KgFaults::default()).await;
    let env = selling_on_kinguin("kinguin_flow", "kx", 10, &sim).await;
    let api = ApiServer::start(&env, &[]).await;
    let body = |v: Value| v.to_string().into_bytes();

    // Refused, changing nothing: a wrong or missing secret, a body
    // outside the contract, an unknown offer.
    let (status, _) = kinguin_post(
        &api.addr,
        Some("not-the-secret-0123456789abcdef0123"),
        &body(kg_hook("r-1", "BUYING")),
    )
    .await;
    assert_eq!(status, 401);
    let (status, _) = kinguin_post(&api.addr, None, &body(kg_hook("r-1", "BUYING"))).await;
    assert_eq!(status, 401);
    let (status, b) =
        kinguin_post(&api.addr, Some(KG_SECRET), b"{\"reservationId\":\"r-1\"}").await;
    assert_eq!(status, 400);
    assert!(b["message"].as_str().unwrap().contains("offerId"), "{b}");
    let mut other = kg_hook("r-1", "BUYING");
    other["offerId"] = json!("not-mapped");
    let (status, b) = kinguin_post(&api.addr, Some(KG_SECRET), &body(other)).await;
    assert_eq!((status, b["error"].as_str()), (404, Some("unknown-offer")));
    assert_eq!(held(&env, "kx").await, 0);
    assert_eq!(count_docs(&env, "channel_deals", doc! {}).await, 0);

    // BUYING holds one key, once.
    let (status, b) = kg_twice(&api, kg_hook("r-1", "BUYING")).await;
    assert_eq!((status, b["result"].as_str()), (200, Some("held")), "{b}");
    assert_eq!(held(&env, "kx").await, 1);
    // BOUGHT commits it into the reservation's order and uploads it.
    let (status, b) = kg_twice(&api, kg_hook("r-1", "BOUGHT")).await;
    assert_eq!((status, b["result"].as_str()), (200, Some("bought")), "{b}");
    assert_eq!(held(&env, "kx").await, 0);
    let key = codes_of(&env, &kg_order("r-1")).await;
    assert_eq!(key.len(), 1);
    eventually(Duration::from_secs(20), "r-1 uploaded", || async {
        sim.stock().get("r-1") == Some(&key[0])
    })
    .await;
    eventually(Duration::from_secs(10), "r-1 recorded uploaded", || async {
        kg_upload(&env, "r-1").await.get_str("upload") == Ok("uploaded")
    })
    .await;
    assert_eq!(sim.attempts().len(), 1, "one upload for two BOUGHTs");
    // BOUGHT once more (Kinguin's retry): nothing more.
    kg_twice(&api, kg_hook("r-1", "BOUGHT")).await;
    assert_eq!(count_codes(&env, doc! {"pool": "kx", "status": 1}).await, 1);
    // DELIVERED is recorded; an unknown status is taken and changes nothing.
    let mut delivered = kg_hook("r-1", "DELIVERED");
    delivered["releasedStockId"] = json!("stock-r-1");
    assert_eq!(kg_twice(&api, delivered).await.0, 200);
    let (status, b) = kg_twice(&api, kg_hook("r-1", "CHATMESSAGE")).await;
    assert_eq!((status, b["result"].as_str()), (200, Some("recorded")));
    let rec = kg_upload(&env, "r-1").await;
    assert_eq!(rec.get_str("released_stock_id"), Ok("stock-r-1"));
    let statuses: Vec<&str> = (rec.get_array("statuses").unwrap().iter())
        .filter_map(|s| s.as_str())
        .collect();
    assert_eq!(statuses, ["BUYING", "BOUGHT", "DELIVERED", "CHATMESSAGE"]);
    assert_eq!(count_codes(&env, doc! {"pool": "kx", "status": 1}).await, 1);

    // CANCELED before BOUGHT releases the hold; a BOUGHT after gets nothing.
    kg_twice(&api, kg_hook("r-2", "BUYING")).await;
    assert_eq!(held(&env, "kx").await, 1);
    let (status, b) = kg_twice(&api, kg_hook("r-2", "CANCELED")).await;
    assert_eq!(
        (status, b["result"].as_str()),
        (200, Some("released")),
        "{b}"
    );
    assert_eq!(held(&env, "kx").await, 0);
    let (status, b) = kg_twice(&api, kg_hook("r-2", "BOUGHT")).await;
    assert_eq!(
        (status, b["error"].as_str()),
        (409, Some("cancelled")),
        "{b}"
    );
    assert!(codes_of(&env, &kg_order("r-2")).await.is_empty());
    // A cancellation that comes first: BUYING and BOUGHT after get nothing.
    kg_twice(&api, kg_hook("r-3", "REFUNDED")).await;
    assert_eq!(kg_twice(&api, kg_hook("r-3", "BUYING")).await.0, 409);
    assert_eq!(kg_twice(&api, kg_hook("r-3", "BOUGHT")).await.0, 409);
    assert_eq!(held(&env, "kx").await, 0);
    assert!(codes_of(&env, &kg_order("r-3")).await.is_empty());
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(!sim.stock().contains_key("r-2") && !sim.stock().contains_key("r-3"));

    // CANCELED after delivery: the key was shown, it is voided.
    let (status, b) = kg_twice(&api, kg_hook("r-1", "CANCELED")).await;
    assert_eq!((status, b["result"].as_str()), (200, Some("voided")), "{b}");
    assert_eq!(
        count_codes(&env, doc! {"order_id": kg_order("r-1"), "status": 3}).await,
        1
    );

    // A paused channel holds nothing new.
    codepool_ok(&env, &["channels", "pause", "--name", "kg"]).await;
    let (status, b) = kg_twice(&api, kg_hook("r-4", "BUYING")).await;
    assert_eq!((status, b["error"].as_str()), (409, Some("paused")), "{b}");
    assert_eq!(held(&env, "kx").await, 0);
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn kinguin_uploads_retry_through_busy_reservations_and_an_outage() {
    let sim = Kinguin::start(KgFaults {
        busy: 4,
        down: true,
        ..KgFaults::default()
    })
    .await;
    let env = selling_on_kinguin("kinguin_busy", "kx", 10, &sim).await;
    let api = ApiServer::start(&env, &[]).await;
    for i in 0..3 {
        let r = format!("res-{i}");
        kg_twice(&api, kg_hook(&r, "BUYING")).await;
        assert_eq!(kg_twice(&api, kg_hook(&r, "BOUGHT")).await.0, 200);
    }
    // Down for a while: the uploads wait, retried with backoff.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(sim.stock().is_empty());
    assert_eq!(
        count_docs(&env, "kinguin_uploads", doc! {"upload": "pending"}).await,
        3
    );
    let tried = find_docs(&env, "kinguin_uploads", doc! {}).await;
    let attempts = |d: &bson::Document| match d.get("attempts") {
        Some(bson::Bson::Int32(n)) => i64::from(*n),
        Some(bson::Bson::Int64(n)) => *n,
        _ => 0,
    };
    assert!(tried.iter().all(|d| attempts(d) >= 2), "{tried:?}");
    sim.set_down(false);
    // Then 409 "being proceeded" four times, then through.
    kg_sell_and_check(&env, &api, &sim, 3).await;
    assert!(sim.attempts().len() >= 3 + 4);
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn kinguin_upload_timed_out_but_stored_counts_once_kinguin_shows_the_same_key() {
    let sim = Kinguin::start(KgFaults {
        slow: 2,
        slow_for: Duration::from_millis(2500),
        ..KgFaults::default()
    })
    .await;
    let env = selling_on_kinguin("kinguin_slow", "kx", 10, &sim).await;
    let api = ApiServer::start(&env, &["--channel-call-timeout", "1"]).await;
    kg_sell_and_check(&env, &api, &sim, 2).await;
    // Each was sent again after its timeout, and met "Stock already uploaded".
    for r in ["res-0", "res-1"] {
        let n = sim.attempts().iter().filter(|(a, _)| a == r).count();
        assert!(n >= 2, "{r}: {n} attempts");
    }
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn kinguin_token_that_expires_mid_run_is_fetched_again() {
    let sim = Kinguin::start(KgFaults {
        token_life: Some(Duration::from_millis(700)),
        ..KgFaults::default()
    })
    .await;
    let env = selling_on_kinguin("kinguin_token", "kx", 10, &sim).await;
    let api = ApiServer::start(&env, &[]).await;
    kg_sell_and_check(&env, &api, &sim, 1).await;
    let before = sim.tokens_issued();
    tokio::time::sleep(Duration::from_secs(1)).await;
    // The token in hand says an hour, but Kinguin no longer takes it.
    kg_sell_and_check(&env, &api, &sim, 3).await;
    assert!(sim.tokens_issued() > before);
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn kinguin_refusals_and_another_key_already_uploaded_are_failures_not_successes() {
    let sim = Kinguin::start(KgFaults {
        invalid: vec!["res-0".into()],
        foreign: vec![("res-1".into(), "SOMEONE-ELSES-KEY".into())],
        ..KgFaults::default()
    })
    .await;
    let env = selling_on_kinguin("kinguin_refused", "kx", 10, &sim).await;
    let api = ApiServer::start(&env, &[]).await;
    for r in ["res-0", "res-1"] {
        kg_twice(&api, kg_hook(r, "BUYING")).await;
        assert_eq!(kg_twice(&api, kg_hook(r, "BOUGHT")).await.0, 200);
    }
    eventually(Duration::from_secs(20), "both given up", || async {
        count_docs(&env, "kinguin_uploads", doc! {"upload": "failed"}).await == 2
    })
    .await;
    assert!(kg_upload(&env, "res-0")
        .await
        .get_str("last_error")
        .unwrap()
        .contains("Invalid reservation ID"));
    assert!(kg_upload(&env, "res-1")
        .await
        .get_str("last_error")
        .unwrap()
        .contains("another key"));
    assert_eq!(
        sim.stock().get("res-1").map(String::as_str),
        Some("SOMEONE-ELSES-KEY")
    );
    // Given up once each: no retries after.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(sim.attempts().len(), 2);
    // The operator sees them.
    let shown = codepool_ok(&env, &["channels", "show", "--name", "kg", "--json"]).await;
    let shown: Value = serde_json::from_str(&shown).unwrap();
    assert_eq!(shown["uploads"]["failed"], 2, "{shown}");
    assert_eq!(shown["uploads"]["uploaded"], 0, "{shown}");
    // The log names the failure with the key masked, never in clear.
    let key = codes_of(&env, &kg_order("res-1")).await.remove(0);
    let log = api.log_text();
    assert!(log.contains("a Kinguin upload failed for good"), "{log}");
    assert!(!log.contains(&key));
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn kinguin_uploads_staged_before_a_kill_9_are_sent_by_the_next_granting_process_with_the_same_key(
) {
    let sim = Kinguin::start(KgFaults {
        down: true,
        ..KgFaults::default()
    })
    .await;
    let env = selling_on_kinguin("kinguin_kill", "kx", 10, &sim).await;
    let mut api = ApiServer::start(&env, &["--channel-call-timeout", "1"]).await;
    for r in ["res-0", "res-1"] {
        kg_twice(&api, kg_hook(r, "BUYING")).await;
        assert_eq!(kg_twice(&api, kg_hook(r, "BOUGHT")).await.0, 200);
    }
    let keys: Vec<String> = [
        codes_of(&env, &kg_order("res-0")).await,
        codes_of(&env, &kg_order("res-1")).await,
    ]
    .concat();
    assert_eq!(keys.len(), 2);
    // A third was held, and its BOUGHT staged its upload, when the
    // process died before the commit.
    kg_twice(&api, kg_hook("res-2", "BUYING")).await;
    let pid = api.child.id().unwrap().to_string();
    assert!(std::process::Command::new("kill")
        .args(["-KILL", &pid])
        .status()
        .unwrap()
        .success());
    let _ = api.child.wait().await;
    sim.set_down(false);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(sim.stock().is_empty(), "nobody uploads while no API runs");
    env.coll("kinguin_uploads")
        .update_one(
            doc! {"_id": "kg\u{1f}res-2"},
            doc! {"$set": {"upload": "pending", "order_id": kg_order("res-2"), "request_id": "req-2", "due_at": bson::DateTime::now()}},
        )
        .await
        .unwrap();
    // A dispatcher (a granting process too) sends the committed keys,
    // and leaves the uncommitted one to an API, which commits it.
    let d = start_daemon(env.command(&[])).await;
    eventually(
        Duration::from_secs(30),
        "the dispatcher sends the committed keys",
        || async { sim.stock().len() == 2 },
    )
    .await;
    assert_eq!(sim.stock().get("res-1"), Some(&keys[1]));
    assert!(codes_of(&env, &kg_order("res-2")).await.is_empty());
    d.stop().await;
    let api = ApiServer::start(&env, &["--channel-call-timeout", "1"]).await;
    eventually(
        Duration::from_secs(30),
        "the staged upload committed and sent",
        || async {
            let codes = codes_of(&env, &kg_order("res-2")).await;
            codes.len() == 1 && sim.stock().get("res-2") == Some(&codes[0])
        },
    )
    .await;
    kg_sell_and_check(&env, &api, &sim, 3).await;
    assert_eq!(sim.stock().get("res-0"), Some(&keys[0]));
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn one_pool_sold_by_the_shop_and_kinguin_at_once_never_shares_a_key() {
    let sim = Kinguin::start(KgFaults {
        busy: 3,
        ..KgFaults::default()
    })
    .await;
    let env = selling_on_kinguin("kinguin_mixed", "kx", 40, &sim).await;
    let shop = shop_key(&env, "acme-1", "acme").await;
    let api = ApiServer::start(&env, &[]).await;
    let addr = api.addr.clone();
    let mut shop_orders = Vec::new();
    for i in 0..20 {
        let (addr, shop) = (addr.clone(), shop.clone());
        shop_orders.push(tokio::spawn(async move {
            let body = crate::api::order(&format!("S-{i}"), "kx", 1);
            let (status, _, body) = http(&addr, "POST", "/v1/orders", Some(&shop), &body).await;
            assert!(
                status == 201 || status == 202,
                "{status}: {}",
                String::from_utf8_lossy(&body)
            );
        }));
    }
    let mut kinguins = Vec::new();
    for i in 0..12 {
        let addr = addr.clone();
        kinguins.push(tokio::spawn(async move {
            let r = format!("res-{i}");
            let send = |status: &'static str| {
                let (addr, r) = (addr.clone(), r.clone());
                async move {
                    kinguin_post(
                        &addr,
                        Some(KG_SECRET),
                        kg_hook(&r, status).to_string().as_bytes(),
                    )
                    .await
                }
            };
            let (a, b) = tokio::join!(send("BUYING"), send("BUYING"));
            // Both deliveries get one answer: held, or refused (the
            // shop's share of the pool is held already) with one reason.
            assert_eq!((a.0, &a.1["error"]), (b.0, &b.1["error"]), "{a:?} {b:?}");
            if a.0 == 409 {
                assert_eq!(a.1["error"], "out-of-stock", "{a:?}");
                return None;
            }
            assert_eq!(a.0, 200, "{a:?}");
            if i % 4 == 0 {
                send("CANCELED").await;
                return None;
            }
            let (a, b) = tokio::join!(send("BOUGHT"), send("BOUGHT"));
            assert_eq!((a.0, b.0), (200, 200), "{a:?} {b:?}");
            Some(r)
        }));
    }
    for t in shop_orders {
        t.await.unwrap();
    }
    let mut sold = Vec::new();
    for t in kinguins {
        sold.extend(t.await.unwrap());
    }
    assert!(sold.len() >= 3, "{sold:?}");
    let n = sold.len() as u64;
    eventually(Duration::from_secs(60), "every key uploaded", || async {
        count_docs(&env, "kinguin_uploads", doc! {"upload": "uploaded"}).await == n
    })
    .await;
    let stock = sim.stock();
    let mut given: Vec<String> = Vec::new();
    for r in &sold {
        let codes = codes_of(&env, &kg_order(r)).await;
        assert_eq!(codes.len(), 1);
        assert_eq!(stock.get(r), Some(&codes[0]));
        given.extend(codes);
    }
    for i in 0..20 {
        given.extend(codes_of(&env, &format!("S-{i}")).await);
    }
    let distinct: HashSet<&String> = given.iter().collect();
    assert_eq!(
        distinct.len(),
        given.len(),
        "no key shared between the shop and Kinguin"
    );
    assert_eq!(given.len(), 20 + sold.len());
    assert_eq!(held(&env, "kx").await, 0, "no hold leaks");
    api.stop().await;
    env.cleanup().await;
}

/// A webhook of replacement `reservation`, which replaces `from`'s key.
fn kg_replacement(reservation: &str, status: &str, from: &str) -> Value {
    let mut h = kg_hook(reservation, status);
    h["replacedFrom"] = json!(from);
    h
}

/// The one live (issued) key of `order`.
async fn live_key(env: &TestEnv, order: &str) -> String {
    let live = find_docs(env, "codes", doc! {"order_id": order, "status": 1}).await;
    assert_eq!(live.len(), 1, "{order}: one live key");
    env.plain_code(&live[0])
}

/// The channel `kg` as `channels show --json` shows it.
async fn kg_shown(env: &TestEnv) -> Value {
    let shown = codepool_ok(env, &["channels", "show", "--name", "kg", "--json"]).await;
    serde_json::from_str(&shown).unwrap()
}

#[tokio::test]
async fn kinguin_declared_stock_follows_the_pool_under_the_cap_and_is_0_at_once_when_it_runs_out() {
    let sim = Kinguin::start(KgFaults::default()).await;
    let env = selling_on_kinguin_with(
        "kinguin_declare",
        "kx",
        10,
        &sim,
        json!({}),
        &["--max", "6"],
    )
    .await;
    // Mapped: declared at once, capped by --max, all of it text stock.
    assert_eq!(sim.declarations(), [(6, 6, true)]);
    codepool_ok(&env, &["channels", "set", "--name", "kg", "--share", "50"]).await;
    assert_eq!(sim.declared(), Some(5));
    assert_eq!(kg_shown(&env).await["declared"], json!({OFFER: 5}));

    let api = ApiServer::start(&env, &[]).await;
    // BUYING holds one: 9 free, 50 % of them is 4.
    let (status, b) = kg_twice(&api, kg_hook("r-1", "BUYING")).await;
    assert_eq!(status, 200, "{b}");
    assert!(
        sim.declares(4, Duration::from_secs(5)).await,
        "{:?}",
        sim.declarations()
    );
    // The shop's own checkout sells 3: 6 free, 3 declared.
    let shop = shop_key(&env, "acme-1", "acme").await;
    let order = crate::api::order("S-1", "kx", 3);
    let (status, _, body) = http(&api.addr, "POST", "/v1/orders", Some(&shop), &order).await;
    assert_eq!(status, 201, "{}", String::from_utf8_lossy(&body));
    assert!(
        sim.declares(3, Duration::from_secs(5)).await,
        "{:?}",
        sim.declarations()
    );
    // No cap: the 6 free codes.
    let uncapped = [
        "channels", "set", "--name", "kg", "--share", "none", "--max", "none",
    ];
    codepool_ok(&env, &uncapped).await;
    assert_eq!(sim.declared(), Some(6));

    // The codes go where codepool is not told: the next BUYING finds none
    // though 6 were promised. An over-promise, and 0 declared at once.
    env.coll("codes")
        .update_many(
            doc! {"pool": "kx", "status": 0},
            doc! {"$set": {"status": 3}},
        )
        .await
        .unwrap();
    let overpromised = "codepool_channel_overpromised_total{channel=\"kg\"}";
    assert_eq!(metric_sum(&[&api.addr], overpromised).await, 0.0);
    let hook = kg_hook("r-2", "BUYING").to_string();
    let (status, b) = kinguin_post(&api.addr, Some(KG_SECRET), hook.as_bytes()).await;
    assert_eq!(
        (status, b["error"].as_str()),
        (409, Some("out-of-stock")),
        "{b}"
    );
    assert!(
        sim.declares(0, Duration::from_millis(900)).await,
        "a pool that runs out declares 0 at once: {:?}",
        sim.declarations()
    );
    assert_eq!(metric_sum(&[&api.addr], overpromised).await, 1.0);
    // Every declaration: as much text stock as stock, never over the cap
    // it was made under, each taken under a valid token.
    let all = sim.declarations();
    assert!(
        all.iter()
            .all(|(n, text, taken)| n == text && *n <= 6 && *taken),
        "{all:?}"
    );
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn kinguin_refusing_a_declared_stock_over_its_maximum_is_a_failure_counted_and_not_sent_again_on_change(
) {
    let sim = Kinguin::start(KgFaults {
        max_declared: Some(3),
        ..KgFaults::default()
    })
    .await;
    let env = selling_on_kinguin("kinguin_declare_max", "kx", 10, &sim).await;
    // `channels map` declared 10: refused.
    assert_eq!(sim.declarations(), [(10, 10, false)]);
    let api = ApiServer::start(&env, &[]).await;
    // The API's first round tries again, and counts the failure.
    let failed = "codepool_channel_declarations_total{channel=\"kg\",outcome=\"failed\"}";
    eventually(
        Duration::from_secs(10),
        "the first round refused",
        || async { metric_sum(&[&api.addr], failed).await >= 1.0 },
    )
    .await;
    assert_eq!(sim.declarations().len(), 2, "{:?}", sim.declarations());
    // Holds and releases move the pool between 9 and 10 free: 9 is tried
    // once, refused; neither amount again on the changes after.
    for i in 0..3 {
        let r = format!("m-{i}");
        assert_eq!(kg_twice(&api, kg_hook(&r, "BUYING")).await.0, 200);
        tokio::time::sleep(Duration::from_millis(1300)).await;
        assert_eq!(kg_twice(&api, kg_hook(&r, "CANCELED")).await.0, 200);
        tokio::time::sleep(Duration::from_millis(1300)).await;
    }
    let tried = sim.declarations();
    assert!(tried.len() <= 3, "retried on every change: {tried:?}");
    assert!(tried.iter().all(|d| !d.2), "{tried:?}");
    assert!(metric_sum(&[&api.addr], failed).await >= 2.0);
    assert!(api
        .log_text()
        .contains("Max declared stock has been exceeded"));
    // The pool shrinks under Kinguin's maximum: declared on the change.
    let free = find_docs(&env, "codes", doc! {"pool": "kx", "status": 0}).await;
    let gone: Vec<bson::Bson> = free
        .iter()
        .take(7)
        .map(|d| d.get("_id").unwrap().clone())
        .collect();
    env.coll("codes")
        .update_many(doc! {"_id": {"$in": gone}}, doc! {"$set": {"status": 3}})
        .await
        .unwrap();
    assert_eq!(kg_twice(&api, kg_hook("m-9", "BUYING")).await.0, 200);
    assert!(
        sim.declares(2, Duration::from_secs(5)).await,
        "{:?}",
        sim.declarations()
    );
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn kinguin_token_url_in_the_credentials_names_where_tokens_come_from() {
    let sim = Kinguin::start(KgFaults {
        token_path: Some("/identity/connect/token"),
        ..KgFaults::default()
    })
    .await;
    let url = format!("{}/identity/connect/token", sim.url);
    let creds = json!({ "token_url": url });
    let env = selling_on_kinguin_with("kinguin_token_url", "kx", 10, &sim, creds, &[]).await;
    assert_eq!(kg_shown(&env).await["token_url"], url.as_str());
    // `channels map` declared with a token from there.
    assert_eq!(sim.declarations(), [(10, 10, true)]);
    let api = ApiServer::start(&env, &[]).await;
    kg_sell_and_check(&env, &api, &sim, 2).await;
    // One token for `channels map`, one the API's declarer and uploader share.
    assert_eq!(sim.tokens_issued(), 2);
    // A token_url that is not an http(s) URL is refused.
    let path = std::env::temp_dir().join(format!("cpt-{}-kg-bad.json", std::process::id()));
    let bad = json!({"webhook_secret": KG_SECRET, "client_id": KG_CLIENT,
                     "client_secret": KG_CLIENT_SECRET, "base_url": sim.url, "token_url": "file:///etc/passwd"});
    std::fs::write(&path, bad.to_string()).unwrap();
    let args = [
        "channels",
        "add",
        "--name",
        "kg-bad",
        "--kind",
        "kinguin",
        "--shop",
        "acme",
        "--credentials",
        path.to_str().unwrap(),
    ];
    let out = env.run(&args).await;
    let _ = std::fs::remove_file(&path);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("token_url"));
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn kinguin_refunds_reversals_and_returns_void_the_key_once_never_back_in_stock() {
    let sim = Kinguin::start(KgFaults::default()).await;
    let env = selling_on_kinguin("kinguin_returns", "kx", 10, &sim).await;
    let api = ApiServer::start(&env, &[]).await;
    kg_sell_and_check(&env, &api, &sim, 4).await;
    for (r, status) in [
        ("res-0", "REFUNDED"),
        ("res-1", "REVERSED"),
        ("res-2", "RETURNED"),
    ] {
        // Kinguin retries, each retry delivered twice.
        for _ in 0..2 {
            let (code, b) = kg_twice(&api, kg_hook(r, status)).await;
            assert_eq!(
                (code, b["result"].as_str()),
                (200, Some("voided")),
                "{r} {status}: {b}"
            );
        }
        let order = kg_order(r);
        assert_eq!(
            count_codes(&env, doc! {"order_id": &order, "status": 3}).await,
            1
        );
        let voids = doc! {"kind": "void", "what": {"$regex": order.as_str()}};
        assert_eq!(
            count_docs(&env, "audit", voids).await,
            1,
            "{r}: voided once"
        );
    }
    // Never back in stock: 6 free of 10, the fourth still sold.
    assert_eq!(count_codes(&env, doc! {"pool": "kx", "status": 0}).await, 6);
    assert_eq!(
        count_codes(&env, doc! {"order_id": kg_order("res-3"), "status": 1}).await,
        1
    );
    // The retries were nothing to warn about.
    let log = api.log_text();
    assert!(!log.contains("was not voided"), "{log}");
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn kinguin_replacements_replace_the_key_under_the_orders_cap_and_upload_the_new_key_once() {
    let sim = Kinguin::start(KgFaults::default()).await;
    let env = selling_on_kinguin("kinguin_replace", "kx", 20, &sim).await;
    let api = ApiServer::start(&env, &[]).await;
    kg_sell_and_check(&env, &api, &sim, 1).await;
    let order = kg_order("res-0");
    // BUYING of a replacement holds nothing.
    let (status, b) = kg_twice(&api, kg_replacement("rep-1", "BUYING", "res-0")).await;
    assert_eq!((status, b["result"].as_str()), (200, Some("linked")), "{b}");
    assert_eq!(held(&env, "kx").await, 0);
    // BOUGHT replaces res-0's key; the new one goes to rep-1.
    let (status, b) = kg_twice(&api, kg_replacement("rep-1", "BOUGHT", "res-0")).await;
    assert_eq!(
        (status, b["result"].as_str()),
        (200, Some("replaced")),
        "{b}"
    );
    eventually(Duration::from_secs(20), "rep-1 uploaded", || async {
        kg_upload(&env, "rep-1").await.get_str("upload") == Ok("uploaded")
    })
    .await;
    let replaced = doc! {"order_id": &order, "status": 3, "void_reason": "replaced"};
    assert_eq!(count_codes(&env, replaced.clone()).await, 1);
    let live = doc! {"order_id": &order, "status": 1};
    assert_eq!(
        sim.stock().get("rep-1"),
        Some(&live_key(&env, &order).await)
    );
    assert_ne!(sim.stock().get("rep-1"), sim.stock().get("res-0"));
    // Redelivered, naming the link or not: nothing replaced or sent again.
    let uploads = sim.attempts().len();
    for hook in [
        kg_replacement("rep-1", "BOUGHT", "res-0"),
        kg_hook("rep-1", "BOUGHT"),
    ] {
        let (status, b) = kg_twice(&api, hook).await;
        assert_eq!(
            (status, b["result"].as_str()),
            (200, Some("replaced")),
            "{b}"
        );
    }
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(sim.attempts().len(), uploads);
    assert_eq!(count_codes(&env, replaced.clone()).await, 1);

    // A replacement of the replacement follows the link; the third is the
    // pool's cap (3 an order), the fourth is refused and changes nothing.
    for (r, from) in [("rep-2", "rep-1"), ("rep-3", "rep-2")] {
        assert_eq!(
            kg_twice(&api, kg_replacement(r, "BUYING", from)).await.0,
            200
        );
        let (status, b) = kg_twice(&api, kg_replacement(r, "BOUGHT", from)).await;
        assert_eq!(
            (status, b["result"].as_str()),
            (200, Some("replaced")),
            "{r}: {b}"
        );
        eventually(Duration::from_secs(20), "uploaded", || async {
            kg_upload(&env, r).await.get_str("upload") == Ok("uploaded")
        })
        .await;
    }
    let (status, b) = kg_twice(&api, kg_replacement("rep-4", "BOUGHT", "rep-3")).await;
    assert_eq!(
        (status, b["error"].as_str()),
        (409, Some("not-replaced")),
        "{b}"
    );
    assert!(b["message"].as_str().unwrap().contains("limit"), "{b}");
    assert_eq!(count_codes(&env, replaced.clone()).await, 3);
    assert!(kg_upload(&env, "rep-4").await.get("upload").is_none());
    let stock = sim.stock();
    assert_eq!(stock.get("rep-3"), Some(&live_key(&env, &order).await));
    let keys: HashSet<&String> = stock.values().collect();
    assert_eq!(
        (stock.len(), keys.len()),
        (4, 4),
        "a key of its own each: {stock:?}"
    );

    // Refused, changing nothing: an unknown reservation, one not bought,
    // itself, a sale of its own said to be a replacement.
    assert_eq!(kg_twice(&api, kg_hook("res-9", "BUYING")).await.0, 200);
    for (hook, status, error) in [
        (
            kg_replacement("rep-5", "BOUGHT", "nope"),
            404,
            "unknown-reservation",
        ),
        (
            kg_replacement("rep-6", "BOUGHT", "res-9"),
            404,
            "unknown-reservation",
        ),
        (
            kg_replacement("rep-7", "BOUGHT", "rep-7"),
            400,
            "bad-request",
        ),
        (kg_replacement("res-9", "BOUGHT", "res-0"), 409, "conflict"),
    ] {
        let (code, b) = kg_twice(&api, hook.clone()).await;
        assert_eq!(
            (code, b["error"].as_str()),
            (status, Some(error)),
            "{hook}: {b}"
        );
    }
    assert_eq!(count_codes(&env, replaced.clone()).await, 3);
    assert_eq!(held(&env, "kx").await, 1, "res-9's hold stands");

    // A replacement refunded: its key voided, once; never back in stock.
    for _ in 0..2 {
        let (status, b) = kg_twice(&api, kg_hook("rep-3", "REFUNDED")).await;
        assert_eq!((status, b["result"].as_str()), (200, Some("voided")), "{b}");
    }
    assert_eq!(
        count_codes(&env, doc! {"order_id": &order, "status": 3}).await,
        4
    );
    assert_eq!(count_codes(&env, live).await, 0);
    assert!(!api.log_text().contains("was not voided"));
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn kinguin_hostile_webhooks_huge_malformed_or_aimed_at_another_shop_change_nothing() {
    const OTHER_SECRET: &str = "other-shop-kinguin-secret-0123456789abcdef";
    const OTHER_OFFER: &str = "6a1d2e3f4b5c6d7e8f9a0b1c";
    let sim = Kinguin::start(KgFaults::default()).await;
    let env = selling_on_kinguin("kinguin_hostile", "kx", 10, &sim).await;
    // Another shop sells its own pool on Kinguin, through its own channel.
    env.fill_pool("ox", 5).await;
    create_shop(&env, "other", "ox", &[]).await;
    let creds = json!({"webhook_secret": OTHER_SECRET});
    add_channel(&env, "kgb", "kinguin", "other", creds, &[]).await;
    map(&env, "kgb", OTHER_OFFER, "ox").await;
    let api = ApiServer::start(&env, &[]).await;
    let body = |v: &Value| v.to_string().into_bytes();

    // The other shop's offer through this channel: unknown here. This
    // channel's secret at the other's URL: refused.
    let mut other = kg_hook("h-1", "BUYING");
    other["offerId"] = json!(OTHER_OFFER);
    let (status, b) = kinguin_post(&api.addr, Some(KG_SECRET), &body(&other)).await;
    assert_eq!(
        (status, b["error"].as_str()),
        (404, Some("unknown-offer")),
        "{b}"
    );
    let (status, _) = kinguin_post_at(&api.addr, "kgb", Some(KG_SECRET), &body(&other)).await;
    assert_eq!(status, 401);
    // The other channel sells h-1; a replacement here naming it finds
    // nothing of it.
    for s in ["BUYING", "BOUGHT"] {
        other["status"] = json!(s);
        let (status, b) =
            kinguin_post_at(&api.addr, "kgb", Some(OTHER_SECRET), &body(&other)).await;
        assert_eq!(status, 200, "{b}");
    }
    let hook = kg_replacement("h-2", "BOUGHT", "h-1");
    let (status, b) = kinguin_post(&api.addr, Some(KG_SECRET), &body(&hook)).await;
    assert_eq!(
        (status, b["error"].as_str()),
        (404, Some("unknown-reservation")),
        "{b}"
    );
    assert_eq!(
        count_codes(&env, doc! {"order_id": "kinguin:kgb:h-1", "status": 1}).await,
        1
    );

    // Over 64 KiB: 413 in Kinguin's shape, and only after the secret.
    let mut huge = kg_hook("h-3", "BUYING");
    huge["padding"] = json!("x".repeat(70 * 1024));
    let (status, b) = kinguin_post(&api.addr, Some(KG_SECRET), &body(&huge)).await;
    assert_eq!(
        (status, b["error"].as_str()),
        (413, Some("too-large")),
        "{b}"
    );
    let (status, _) = kinguin_post(&api.addr, None, &body(&huge)).await;
    assert_eq!(status, 401);
    // Malformed: 400, each with a message.
    let deep = format!("{}{}", "[".repeat(5000), "]".repeat(5000));
    let long = format!(
        r#"{{"reservationId":"{}","offerId":"{OFFER}","status":"BUYING"}}"#,
        "r".repeat(61)
    );
    let injected = format!(
        r#"{{"reservationId":"h-4","offerId":"{OFFER}","status":"BUYING","replacedFrom":{{"$ne":null}}}}"#
    );
    for bad in [
        &b""[..],
        b"{",
        b"null",
        b"\xff\xfe{}",
        deep.as_bytes(),
        long.as_bytes(),
        injected.as_bytes(),
    ] {
        let (status, b) = kinguin_post(&api.addr, Some(KG_SECRET), bad).await;
        let shown = String::from_utf8_lossy(&bad[..bad.len().min(60)]).into_owned();
        assert_eq!(
            (status, b["error"].as_str()),
            (400, Some("bad-request")),
            "{shown}: {b}"
        );
        assert!(
            b["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{shown}: {b}"
        );
    }
    // Nothing held or recorded for this channel.
    assert_eq!(held(&env, "kx").await, 0);
    assert_eq!(
        count_docs(&env, "channel_deals", doc! {"channel": "kg"}).await,
        0
    );
    assert_eq!(
        count_docs(&env, "kinguin_uploads", doc! {"channel": "kg"}).await,
        1,
        "h-2 only"
    );
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn kinguin_1000_buying_webhooks_at_once_on_a_pool_of_100_hold_100_and_declare_0() {
    let sim = Kinguin::start(KgFaults::default()).await;
    let env = selling_on_kinguin("kinguin_thousand", "kx", 100, &sim).await;
    // The shop may hold all of the pool: Kinguin is its only door here.
    let all = [
        "pool",
        "set",
        "--pool",
        "kx",
        "--hold-share-per-owner",
        "100",
    ];
    codepool_ok(&env, &all).await;
    // On a loaded 2-core test machine the last of 1,000 answers may come
    // after the 30 s a request may take by default.
    let api = ApiServer::start(&env, &["--request-timeout", "150"]).await;
    let mut tasks = Vec::new();
    for i in 0..1000 {
        let addr = api.addr.clone();
        tasks.push(tokio::spawn(async move {
            let hook = kg_hook(&format!("t-{i}"), "BUYING").to_string();
            let within = Duration::from_secs(150);
            // A connection the loaded listener dropped before answering is
            // sent again, as Kinguin re-sends a webhook (BUYING is
            // idempotent by reservation).
            for _ in 0..5 {
                let answer = kinguin_try(&addr, "kg", Some(KG_SECRET), hook.as_bytes(), within);
                if let Some(a) = answer.await {
                    return Some(a);
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            None
        }));
    }
    let mut taken = Vec::new();
    for (i, t) in tasks.into_iter().enumerate() {
        let (status, b) = t.await.unwrap().expect("an answer");
        match status {
            200 => {
                assert_eq!(b["result"], "held", "t-{i}: {b}");
                taken.push(format!("t-{i}"));
            }
            409 => assert_eq!(b["error"], "out-of-stock", "t-{i}: {b}"),
            _ => panic!("t-{i}: {status} {b}"),
        }
    }
    assert_eq!(taken.len(), 100);
    assert_eq!(held(&env, "kx").await, 100);
    assert_eq!(count_codes(&env, doc! {"pool": "kx", "status": 0}).await, 0);
    assert_eq!(
        count_docs(&env, "channel_deals", doc! {"channel": "kg"}).await,
        100
    );
    assert!(
        sim.declares(0, Duration::from_secs(30)).await,
        "{:?}",
        sim.declarations()
    );
    // Ten are bought, the others cancelled: ten keys sold, none twice.
    for (i, r) in taken.iter().enumerate() {
        let status = if i < 10 { "BOUGHT" } else { "CANCELED" };
        assert_eq!(kg_twice(&api, kg_hook(r, status)).await.0, 200, "{r}");
    }
    assert_eq!(held(&env, "kx").await, 0);
    assert_eq!(
        count_codes(&env, doc! {"pool": "kx", "status": 1}).await,
        10
    );
    assert!(
        sim.declares(90, Duration::from_secs(30)).await,
        "{:?}",
        sim.declarations()
    );
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_cancellation_killed_after_its_record_is_finished_by_the_marketplaces_retry() {
    let env = selling("channels_cancel_kill", "gx", 40, &[], &[]).await;
    let pauses = [("CODEPOOL_FAILPOINTS", "channel-cancel-pause=30000")];
    let mut doomed = ApiServer::start_with(&env, &[], &pauses).await;
    let token = g2a_token(&doomed).await;
    // Eneba order c-1 reserved, c-2 provided; a G2A reservation of 2.
    eneba(&doomed, ENEBA_TOKEN, reserve("c-1", 1)).await;
    eneba(&doomed, ENEBA_TOKEN, reserve("c-2", 1)).await;
    let (_, _, body) = eneba(&doomed, ENEBA_TOKEN, provide("c-2")).await;
    assert_eq!(
        keys_of(&body).len(),
        1,
        "{}",
        String::from_utf8_lossy(&body)
    );
    let (status, _, body) = g2a(&doomed, "POST", "/g2a/reservation", &token, reservation(2)).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let rid = json_of(&body)["reservation_id"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(held(&env, "gx").await, 3);

    // Each cancellation is recorded, and its process dies before it
    // releases the hold or burns the keys.
    let eneba_auth = format!("Bearer {ENEBA_TOKEN}");
    let g2a_auth = format!("Bearer {token}");
    let release = format!("/channels/g2/g2a/reservation/{rid}");
    let calls = [
        (
            "POST",
            "/channels/en/eneba",
            eneba_auth.clone(),
            cancel("c-1").to_string(),
        ),
        (
            "POST",
            "/channels/en/eneba",
            eneba_auth.clone(),
            cancel("c-2").to_string(),
        ),
        ("DELETE", release.as_str(), g2a_auth.clone(), String::new()),
    ];
    let mut cut = Vec::new();
    for (method, path, auth, body) in calls.clone() {
        let (addr, path) = (doomed.addr.clone(), path.to_owned());
        cut.push(tokio::spawn(async move {
            let headers = [("Authorization", auth.as_str())];
            raw_http(&addr, method, &path, &headers, body.as_bytes()).await
        }));
    }
    eventually(
        Duration::from_secs(10),
        "the three recorded cancelled",
        || async { count_docs(&env, "channel_deals", doc! {"state": "cancelled"}).await == 3 },
    )
    .await;
    doomed.child.start_kill().unwrap();
    let _ = doomed.child.wait().await;
    for c in cut {
        assert!(
            c.await.unwrap().is_none(),
            "no answer from a killed process"
        );
    }
    assert_eq!(
        held(&env, "gx").await,
        3,
        "nothing released before the kill"
    );

    // The marketplaces call again (Eneba retries CANCEL; G2A its
    // release): each finishes what the dead process began.
    let api = ApiServer::start(&env, &[]).await;
    for (method, path, auth, body) in calls {
        let headers = [("Authorization", auth.as_str())];
        let (status, _, answer) = raw_http(&api.addr, method, path, &headers, body.as_bytes())
            .await
            .expect("an answer");
        assert!(
            status == 200 || status == 204,
            "{method} {path}: {status} {}",
            String::from_utf8_lossy(&answer)
        );
    }
    assert_eq!(
        held(&env, "gx").await,
        0,
        "no hold outlives its cancellation"
    );
    assert_eq!(
        count_codes(&env, doc! {"order_id": "eneba:en:c-2", "status": 3}).await,
        1,
        "the key provided is burned"
    );
    assert_eq!(
        count_codes(&env, doc! {"pool": "gx", "status": 0}).await,
        39
    );
    api.stop().await;
    env.cleanup().await;
}

// ---------------------------------------------------------------- every door under kill -9

/// The API processes a run calls, by address: a killed one is taken
/// out, the one started in its place put in.
#[derive(Clone, Default)]
struct Live(Arc<std::sync::Mutex<Vec<String>>>);

impl Live {
    fn pick(&self, n: usize) -> Option<String> {
        let up = self.0.lock().unwrap();
        (!up.is_empty()).then(|| up[n % up.len()].clone())
    }

    fn put(&self, addr: &str) {
        self.0.lock().unwrap().push(addr.to_owned());
    }

    fn take(&self, addr: &str) {
        self.0.lock().unwrap().retain(|a| a != addr);
    }
}

/// Calls as a marketplace (or a shop's backend) makes them while API
/// processes die: to a live process picked by `n`, and, where its
/// contract retries, again to the next one after no answer (the process
/// died under the call) or a 503.
struct Caller {
    live: Live,
    /// Calls sent again after no answer or a 503.
    retried: std::sync::atomic::AtomicU32,
}

impl Caller {
    /// One attempt: the status and body, or `None`.
    async fn once(
        &self,
        n: usize,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Option<(u16, Vec<u8>)> {
        let addr = self.live.pick(n)?;
        let (status, _, body) = raw_http(&addr, method, path, headers, body).await?;
        Some((status, body))
    }

    /// Attempts until one is answered (other than 503), for up to 20 s.
    async fn retried(
        &self,
        n: usize,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> (u16, Vec<u8>) {
        for attempt in 0..80 {
            match self.once(n + attempt, method, path, headers, body).await {
                Some((status, body)) if status != 503 => return (status, body),
                _ => {
                    (self.retried).fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            }
        }
        panic!("{method} {path}: no API process answered within 20 s");
    }
}

/// How one marketplace order of the run ended, as the marketplace saw it.
#[derive(Debug, Clone, PartialEq)]
enum Fate {
    /// Its reservation was never answered: the marketplace gave up (Eneba
    /// then cancels it; G2A never learns its id).
    Unanswered,
    /// Cancelled or released before provision.
    Released,
    /// Let run out (the hold's time made past): its provision failed.
    RanOut,
    /// Still reserved when the run ends.
    Open,
    /// Provided: its keys, as every answer gave them.
    Sold(Vec<String>),
    /// Provided, then cancelled (Eneba, Kinguin: burned) or returned in
    /// part (G2A: the first key): the keys, and how many are void.
    Taken(Vec<String>, usize),
}

/// Makes the hold `hold_id` past its time, as if its time to live (a
/// minute at least) had passed: the hold sweep of a live process expires it.
async fn run_out(env: &TestEnv, hold_id: &str) {
    let past = bson::DateTime::from_millis(bson::DateTime::now().timestamp_millis() - 1000);
    env.coll("holds")
        .update_many(
            doc! {"hold_id": hold_id},
            doc! {"$set": {"expires_at": past}},
        )
        .await
        .unwrap();
}

/// Codes of `pool` held now, by the hold that holds them.
async fn held_by_hold(env: &TestEnv, pool: &str) -> HashMap<String, u64> {
    let mut out = HashMap::new();
    for d in find_docs(env, "codes", doc! {"pool": pool, "status": 4}).await {
        let key = d.get_str("order_id").unwrap_or_default();
        let hold = match codepool_domain::SetAside::of_key(key) {
            Some(codepool_domain::SetAside::Hold { hold_id }) => hold_id,
            _ => format!("(not a hold's: {key:?})"),
        };
        *out.entry(hold).or_default() += 1;
    }
    out
}

/// One Eneba order `k-{i}` of 1 or 2 keys, by Eneba's contract under
/// kill -9: RESERVE once (no answer: the order failed, and Eneba cancels
/// it), PROVIDE and CANCEL until answered; PROVIDE delivered twice at
/// once to two processes. By `i`: cancelled before provision, provided
/// then cancelled (burned), let run out, left open, or sold.
async fn eneba_order(env: &TestEnv, calls: &Caller, i: usize) -> (String, u32, Fate) {
    let order = format!("k-{i}");
    let keys = 1 + (i % 2) as u32;
    let auth = format!("Bearer {ENEBA_TOKEN}");
    let headers = [
        ("Authorization", auth.as_str()),
        ("Content-Type", "application/json"),
    ];
    let path = "/channels/en/eneba";
    let send = |n: usize, body: Value| async move {
        let (status, answer) = calls
            .retried(n, "POST", path, &headers, body.to_string().as_bytes())
            .await;
        assert!(
            status == 200,
            "{body}: {status} {}",
            String::from_utf8_lossy(&answer)
        );
        answer
    };
    let first = calls
        .once(
            i,
            "POST",
            path,
            &headers,
            reserve(&order, keys).to_string().as_bytes(),
        )
        .await;
    match first {
        Some((200, b)) if success(&b) == true => {}
        Some((200, b)) => panic!("{order}: RESERVE refused: {}", String::from_utf8_lossy(&b)),
        _ => {
            send(i, cancel(&order)).await;
            return (order, keys, Fate::Unanswered);
        }
    }
    let fate = match i % 6 {
        0 => {
            send(i, cancel(&order)).await;
            Fate::Released
        }
        1 => {
            let b = send(i, provide(&order)).await;
            assert_eq!(
                success(&b),
                true,
                "{order}: {}",
                String::from_utf8_lossy(&b)
            );
            send(i + 1, cancel(&order)).await;
            Fate::Taken(keys_of(&b), keys as usize)
        }
        2 => {
            run_out(env, &format!("eneba:en:{order}")).await;
            let b = send(i, provide(&order)).await;
            assert_eq!(
                success(&b),
                false,
                "{order} ran out: {}",
                String::from_utf8_lossy(&b)
            );
            send(i, cancel(&order)).await;
            Fate::RanOut
        }
        3 => Fate::Open,
        _ => {
            let (a, b) = tokio::join!(send(i, provide(&order)), send(i + 1, provide(&order)));
            assert_eq!(
                success(&a),
                true,
                "{order}: {}",
                String::from_utf8_lossy(&a)
            );
            let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
            assert_eq!(
                text(&a),
                text(&b),
                "{order}: every PROVIDE answers byte for byte the same keys"
            );
            // Eneba's retry after a timeout, later.
            let again = send(i + 2, provide(&order)).await;
            assert_eq!(
                text(&a),
                text(&again),
                "{order}: a retried PROVIDE gets the same keys"
            );
            Fate::Sold(keys_of(&a))
        }
    };
    (order, keys, fate)
}

/// One G2A reservation of 1 or 2 keys, by G2A's client under kill -9:
/// the reservation once (no answer: G2A never learns its id), the order
/// (delivered twice at once to two processes, and retried), the release
/// and the return until answered. By `i`: released, let run out (410),
/// left open, sold and one key returned (by the id of an earlier read),
/// or sold.
async fn g2a_order(env: &TestEnv, calls: &Caller, token: &str, i: usize) -> (String, u32, Fate) {
    let quantity = 1 + (i % 2) as u32;
    let auth = format!("Bearer {token}");
    let headers = [
        ("Authorization", auth.as_str()),
        ("Content-Type", "application/json"),
    ];
    let call = |n: usize, method: &'static str, path: String, body: Value| async move {
        let body = if body.is_null() {
            Vec::new()
        } else {
            body.to_string().into_bytes()
        };
        let path = format!("/channels/g2/g2a{path}");
        calls.retried(n, method, &path, &headers, &body).await
    };
    let first = calls
        .once(
            i,
            "POST",
            "/channels/g2/g2a/reservation",
            &headers,
            reservation(quantity).to_string().as_bytes(),
        )
        .await;
    let rid = match first {
        Some((200, b)) => json_of(&b)["reservation_id"].as_str().unwrap().to_owned(),
        Some((status, b)) if status != 503 => {
            panic!("reservation {i}: {status} {}", String::from_utf8_lossy(&b))
        }
        _ => return (format!("(unanswered {i})"), quantity, Fate::Unanswered),
    };
    let order = json!({"reservation_id": rid, "g2a_order_id": 50_000 + i});
    let fate = match i % 5 {
        0 => {
            let (status, b) = call(i, "DELETE", format!("/reservation/{rid}"), Value::Null).await;
            assert_eq!(status, 204, "{}", String::from_utf8_lossy(&b));
            Fate::Released
        }
        1 => {
            run_out(env, &format!("g2a:g2:{rid}")).await;
            let (status, b) = call(i, "POST", "/order".into(), order).await;
            assert_eq!(
                status,
                410,
                "{rid} ran out: {}",
                String::from_utf8_lossy(&b)
            );
            Fate::RanOut
        }
        2 => Fate::Open,
        k => {
            let (a, b) = tokio::join!(
                call(i, "POST", "/order".into(), order.clone()),
                call(i + 1, "POST", "/order".into(), order.clone())
            );
            assert_eq!(a.0, 200, "{}", String::from_utf8_lossy(&a.1));
            assert_eq!(b.0, 200, "{}", String::from_utf8_lossy(&b.1));
            let items = inventory_of(&json_of(&a.1)["stock"]);
            assert_eq!(items.len(), quantity as usize);
            assert_eq!(
                items,
                inventory_of(&json_of(&b.1)["stock"]),
                "{rid}: both deliveries of the order got the same keys"
            );
            let again = call(i + 2, "POST", "/order".into(), order).await;
            assert_eq!(
                inventory_of(&json_of(&again.1)["stock"]),
                items,
                "{rid}: a retried order gets the same keys"
            );
            let keys = items.iter().map(|(_, v)| v.clone()).collect();
            if k == 3 {
                let path = format!("/order/{rid}/inventory?id[]={}", items[0].0);
                let (status, b) = call(i + 1, "DELETE", path, Value::Null).await;
                assert_eq!(status, 204, "{}", String::from_utf8_lossy(&b));
                Fate::Taken(keys, 1)
            } else {
                Fate::Sold(keys)
            }
        }
    };
    (rid, quantity, fate)
}

/// One Kinguin reservation `res-{i}`, by Kinguin's webhooks under kill
/// -9: each re-sent until answered, BOUGHT delivered twice at once to two
/// processes. By `i`: cancelled before BOUGHT, bought then cancelled
/// (voided), let run out, left open, or sold.
async fn kinguin_order(env: &TestEnv, calls: &Caller, i: usize) -> (String, u32, Fate) {
    let r = format!("res-{i}");
    let headers = [
        ("X-Auth-Token", KG_SECRET),
        ("Content-Type", "application/json"),
    ];
    let hook = |n: usize, status: &'static str| {
        let (headers, r) = (headers, r.clone());
        async move {
            let body = kg_hook(&r, status).to_string();
            let (code, answer) = calls
                .retried(n, "POST", "/channels/kg/kinguin", &headers, body.as_bytes())
                .await;
            let answer = json_of(&answer);
            assert_eq!(code, 200, "{r} {status}: {answer}");
            answer["result"].as_str().unwrap_or_default().to_owned()
        }
    };
    assert_eq!(hook(i, "BUYING").await, "held");
    let fate = match i % 6 {
        0 => {
            assert_eq!(hook(i, "CANCELED").await, "released");
            Fate::Released
        }
        1 => {
            let (a, b) = tokio::join!(hook(i, "BOUGHT"), hook(i + 1, "BOUGHT"));
            assert_eq!((a.as_str(), b.as_str()), ("bought", "bought"));
            assert_eq!(hook(i, "CANCELED").await, "voided");
            Fate::Taken(codes_of(env, &format!("kinguin:kg:{r}")).await, 1)
        }
        2 => {
            run_out(env, &format!("kinguin:kg:{r}")).await;
            Fate::RanOut
        }
        3 => Fate::Open,
        _ => {
            let (a, b) = tokio::join!(hook(i, "BOUGHT"), hook(i + 1, "BOUGHT"));
            assert_eq!((a.as_str(), b.as_str()), ("bought", "bought"));
            Fate::Sold(codes_of(env, &format!("kinguin:kg:{r}")).await)
        }
    };
    (r, 1, fate)
}

/// The shop's own checkout: order `S-{i}` over HTTP, sent again (the same
/// order id) until answered.
async fn shop_order(calls: &Caller, key: &str, i: usize) -> String {
    let order = format!("S-{i}");
    let auth = format!("Bearer {key}");
    let headers = [
        ("Authorization", auth.as_str()),
        ("Content-Type", "application/json"),
    ];
    let body = crate::api::order(&order, "gx", 1);
    let (status, b) = calls
        .retried(i, "POST", "/v1/orders", &headers, &body)
        .await;
    assert!(
        status == 200 || status == 201,
        "{order}: {status} {}",
        String::from_utf8_lossy(&b)
    );
    order
}

#[tokio::test]
async fn one_pool_sold_by_the_shop_and_three_marketplaces_through_two_apis_under_kill_9_sells_no_key_twice_and_leaks_no_hold(
) {
    let sim = Kinguin::start(KgFaults {
        busy: 2,
        ..KgFaults::default()
    })
    .await;
    let env = selling("channels_kill9", "gx", 200, &[], &[]).await;
    add_channel(
        &env,
        "kg",
        "kinguin",
        "acme",
        kinguin_credentials(&sim),
        &[],
    )
    .await;
    map(&env, "kg", OFFER, "gx").await;
    let shop = shop_key(&env, "acme-1", "acme").await;
    let admin = crate::api::key(&env, "ops", "admin").await;
    // The process to be killed pauses each provision between its record
    // and its order, and each cancellation between its record and its
    // release, so the kill lands inside some.
    let pauses = [(
        "CODEPOOL_FAILPOINTS",
        "channel-commit-pause=1500,channel-cancel-pause=1500",
    )];
    let timeout = ["--channel-call-timeout", "1"];
    let (doomed, steady) = tokio::join!(
        ApiServer::start_with(&env, &timeout, &pauses),
        ApiServer::start(&env, &timeout)
    );
    let live = Live::default();
    live.put(&doomed.addr);
    live.put(&steady.addr);
    let calls = Caller {
        live: live.clone(),
        retried: Default::default(),
    };
    let token = g2a_token(&steady).await;

    let spread = |i: usize, every: u64| tokio::time::sleep(Duration::from_millis(every * i as u64));
    let started = std::time::Instant::now();
    let killer = async {
        tokio::time::sleep(Duration::from_millis(2500)).await;
        let mut doomed = doomed;
        live.take(&doomed.addr);
        doomed.child.start_kill().unwrap();
        let _ = doomed.child.wait().await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let fresh = ApiServer::start(&env, &timeout).await;
        live.put(&fresh.addr);
        fresh
    };
    let shops = futures::future::join_all((0..20).map(|i| {
        let (calls, shop) = (&calls, &shop);
        async move {
            spread(i, 250).await;
            shop_order(calls, shop, i).await
        }
    }));
    let enebas = futures::future::join_all((0..20).map(|i| {
        let (env, calls) = (&env, &calls);
        async move {
            spread(i, 250).await;
            eneba_order(env, calls, i).await
        }
    }));
    let g2as = futures::future::join_all((0..12).map(|i| {
        let (env, calls, token) = (&env, &calls, &token);
        async move {
            spread(i, 400).await;
            g2a_order(env, calls, token, i).await
        }
    }));
    let kinguins = futures::future::join_all((0..12).map(|i| {
        let (env, calls) = (&env, &calls);
        async move {
            spread(i, 400).await;
            kinguin_order(env, calls, i).await
        }
    }));
    let (fresh, shops, enebas, g2as, kinguins) =
        tokio::join!(killer, shops, enebas, g2as, kinguins);
    let retried = calls.retried.load(std::sync::atomic::Ordering::Relaxed);
    eprintln!(
        "the mix ran in {:.1} s; {retried} calls were sent again",
        started.elapsed().as_secs_f64()
    );
    assert!(retried > 0, "the kill hit no call in flight");

    // Every key Kinguin was sold is uploaded, the same on every attempt.
    let sold_on_kinguin: Vec<&String> = (kinguins.iter())
        .filter(|(_, _, f)| matches!(f, Fate::Sold(_)))
        .map(|(r, _, _)| r)
        .collect();
    eventually(
        Duration::from_secs(30),
        "every Kinguin sale uploaded",
        || async {
            let stock = sim.stock();
            sold_on_kinguin.iter().all(|r| stock.contains_key(*r))
        },
    )
    .await;
    let stock = sim.stock();
    for (r, _, fate) in &kinguins {
        let codes = codes_of(&env, &format!("kinguin:kg:{r}")).await;
        for (ar, key) in sim.attempts() {
            if ar == *r {
                assert_eq!(codes, vec![key], "{r}: every upload sent its order's key");
            }
        }
        if let Fate::Sold(keys) = fate {
            assert_eq!(stock.get(r), keys.first(), "{r}: Kinguin holds its key");
        }
    }

    // No key sold twice, or to two doors: every sale's keys are its
    // order's, and no two sales share one.
    let mut given: HashMap<String, String> = HashMap::new();
    let mut give = |order: String, keys: &[String]| {
        for k in keys {
            if let Some(other) = given.insert(k.clone(), order.clone()) {
                panic!("a key went to {other} and to {order}");
            }
        }
    };
    let (mut issued, mut void) = (HashMap::new(), HashMap::new());
    for o in &shops {
        let codes = codes_of(&env, o).await;
        assert_eq!(codes.len(), 1, "{o}");
        give(o.clone(), &codes);
        *issued.entry("shop").or_insert(0u64) += 1;
    }
    let sales = [
        ("en", "eneba:en:", &enebas),
        ("g2", "g2a:g2:", &g2as),
        ("kg", "kinguin:kg:", &kinguins),
    ];
    for (channel, prefix, orders) in sales {
        issued.insert(channel, 0);
        void.insert(channel, 0);
        for (id, n, fate) in orders.iter() {
            let order = format!("{prefix}{id}");
            let mut codes = codes_of(&env, &order).await;
            match fate {
                Fate::Sold(keys) | Fate::Taken(keys, _) => {
                    let mut keys = keys.clone();
                    keys.sort();
                    codes.sort();
                    assert_eq!(keys.len(), *n as usize, "{order}: {fate:?}");
                    assert_eq!(codes, keys, "{order}: the keys given are its order's");
                    give(order.clone(), &keys);
                    let gone = match fate {
                        Fate::Taken(_, gone) => *gone,
                        _ => 0,
                    };
                    let dead = count_codes(&env, doc! {"order_id": &order, "status": 3}).await;
                    assert_eq!(dead as usize, gone, "{order}: {fate:?}");
                    *issued.get_mut(channel).unwrap() += (keys.len() - gone) as u64;
                    *void.get_mut(channel).unwrap() += gone as u64;
                }
                _ => assert!(codes.is_empty(), "{order} ({fate:?}) got {codes:?}"),
            }
        }
    }
    let live_keys = count_codes(&env, doc! {"pool": "gx", "status": 1}).await;
    assert_eq!(
        live_keys,
        issued.values().sum::<u64>(),
        "every key sold is one of the sales above"
    );

    // No hold outlives its cancellation or its time: once the sweep ran,
    // what is held is what is still reserved, and the reservations G2A
    // never heard of (their process died before the answer).
    let open: HashMap<String, u64> = (sales.iter())
        .flat_map(|(_, prefix, orders)| orders.iter().map(move |o| (prefix, o)))
        .filter(|(_, (_, _, f))| *f == Fate::Open)
        .map(|(prefix, (id, n, _))| (format!("{prefix}{id}"), u64::from(*n)))
        .collect();
    let unheard: u64 = (g2as.iter())
        .filter(|(_, _, f)| *f == Fate::Unanswered)
        .map(|(_, n, _)| u64::from(*n))
        .sum();
    let known: HashSet<String> = (sales.iter())
        .flat_map(|(_, prefix, orders)| {
            orders.iter().map(move |(id, _, _)| format!("{prefix}{id}"))
        })
        .collect();
    eventually(
        Duration::from_secs(20),
        "the holds run out swept",
        || async {
            let now = bson::DateTime::now();
            count_docs(
                &env,
                "holds",
                doc! {"state": "held", "expires_at": {"$lt": now}},
            )
            .await
                == 0
        },
    )
    .await;
    let holding = held_by_hold(&env, "gx").await;
    let mut strays = 0;
    for (hold, n) in &holding {
        match open.get(hold) {
            Some(want) => assert_eq!(n, want, "{hold} holds what it reserved"),
            None if hold.starts_with("g2a:g2:") && !known.contains(hold) => strays += n,
            None => panic!(
                "{hold} holds {n} codes after it was cancelled, sold or ran out: {holding:?}"
            ),
        }
    }
    for (hold, want) in &open {
        assert_eq!(holding.get(hold), Some(want), "{hold} still holds its keys");
    }
    assert!(
        strays <= unheard,
        "{strays} codes held by reservations no one knows, of {unheard} unanswered"
    );

    // The reservations still open are cancelled; those no one knows run
    // out: nothing is held after.
    let eneba_auth = format!("Bearer {ENEBA_TOKEN}");
    let g2a_auth = format!("Bearer {token}");
    for (id, _, f) in &enebas {
        if *f == Fate::Open {
            let headers = [("Authorization", eneba_auth.as_str())];
            let body = cancel(id).to_string();
            let path = "/channels/en/eneba";
            let (status, _) = calls
                .retried(0, "POST", path, &headers, body.as_bytes())
                .await;
            assert_eq!(status, 200, "{id}");
        }
    }
    for (rid, _, f) in &g2as {
        if *f == Fate::Open {
            let headers = [("Authorization", g2a_auth.as_str())];
            let path = format!("/channels/g2/g2a/reservation/{rid}");
            let (status, _) = calls.retried(0, "DELETE", &path, &headers, b"").await;
            assert_eq!(status, 204, "{rid}");
        }
    }
    for (r, _, f) in &kinguins {
        if *f == Fate::Open {
            let headers = [("X-Auth-Token", KG_SECRET)];
            let body = kg_hook(r, "CANCELED").to_string();
            let path = "/channels/kg/kinguin";
            let (status, _) = calls
                .retried(0, "POST", path, &headers, body.as_bytes())
                .await;
            assert_eq!(status, 200, "{r}");
        }
    }
    for hold in holding.keys().filter(|h| !known.contains(*h)) {
        run_out(&env, hold).await;
    }
    eventually(Duration::from_secs(20), "nothing held", || async {
        held(&env, "gx").await == 0
    })
    .await;

    // The statement ties out per channel, and counts each channel's sales
    // as the marketplace saw them; the API's cut is the CLI's.
    for channel in ["en", "g2", "kg"] {
        let out = env
            .run(&["statement", "--pool", "gx", "--channel", channel, "--json"])
            .await;
        assert!(
            out.status.success(),
            "{channel}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let s: Value = serde_json::from_slice(&out.stdout).unwrap();
        let t = &s["total"];
        let voids: u64 = (t["balance"]["void"].as_object().unwrap().values())
            .filter_map(Value::as_u64)
            .sum();
        assert_eq!(t["off_by"], 0, "{channel}: {s}");
        assert_eq!(t["balance"]["issued"], issued[channel], "{channel}: {s}");
        assert_eq!(voids, void[channel], "{channel}: {s}");
        assert_eq!(
            t["received"],
            issued[channel] + void[channel],
            "{channel}: {s}"
        );
        assert_eq!(t["balance"]["in_stock"], 0, "{channel}: {s}");
        assert_eq!(t["balance"]["held"], 0, "{channel}: {s}");
        let path = format!("/v1/statements?pool=gx&channel={channel}");
        let (status, _, body) = fresh.get(&path, &admin).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        assert_eq!(
            json_of(&body)["total"]["balance"],
            t["balance"],
            "{channel}"
        );
    }
    codepool_ok(&env, &["statement", "--pool", "gx", "--json"]).await;
    fresh.stop().await;
    steady.stop().await;
    env.cleanup().await;
}
