//! One key cannot hold a whole pool through made-up buyers, and a buyer's
//! case and width variants are one buyer for every per-buyer rule
//! (issue 54, item 3): a hold is paid by its buyer whatever the case of
//! the uid, and a hold and an order from stock count against one per-user
//! limit. A hold the stock cannot cover is 409 `insufficient-stock`,
//! never a 429 limit.

use bson::doc;
use serde_json::json;

use crate::api::{http, json_of, key, ApiServer};
use crate::common::*;
use crate::fixtures::*;

async fn held(env: &TestEnv, pool: &str) -> u64 {
    count_codes(env, doc! {"pool": pool, "status": 4}).await
}

#[tokio::test]
async fn one_key_holds_at_most_its_share_of_a_pool_whatever_the_uids_it_sends() {
    let env = TestEnv::with_pools("caps_owner", &[("crowd", 20)]).await;
    // Each buyer may hold the whole pool; a shop may hold half of it.
    pool_set(&env, "crowd", &["--hold-share", "100"]).await;
    let mut keys = Vec::new();
    for shop in ["greedy", "other"] {
        create_shop(&env, shop, "crowd", &[]).await;
        keys.push(shop_key(&env, shop, shop).await);
    }
    let (greedy, other) = (keys[0].clone(), keys[1].clone());
    let api = ApiServer::start(&env, &["--rate-per-key", "100000"]).await;
    for i in 0..10 {
        let (s, b) = post_json(
            &api,
            &greedy,
            "/v1/holds",
            &hold(&format!("G-{i}"), &format!("made-up-{i}"), "crowd", 1),
        )
        .await;
        assert_eq!(s, 201, "{b}");
    }
    let (s, b) = post_json(
        &api,
        &greedy,
        "/v1/holds",
        &hold("G-10", "made-up-10", "crowd", 1),
    )
    .await;
    assert_eq!(s, 429, "{b} {}", api.log_text());
    assert_eq!(b["cap"], "owner-share", "{b}");
    assert_eq!(b["limit"], 10, "{b}");
    assert_eq!(held(&env, "crowd").await, 10, "nothing more held");
    // Another key still holds, and orders are still served.
    let (s, b) = post_json(&api, &other, "/v1/holds", &hold("O-1", "buyer", "crowd", 1)).await;
    assert_eq!(s, 201, "{b}");
    // The share is a pool setting.
    pool_set(&env, "crowd", &["--hold-share-per-owner", "100"]).await;
    let (s, b) = post_json(
        &api,
        &greedy,
        "/v1/holds",
        &hold("G-11", "made-up-11", "crowd", 1),
    )
    .await;
    assert_eq!(s, 201, "{b}");
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn case_and_width_variants_of_a_uid_are_one_buyer_for_holds_and_per_user_limits() {
    let env = TestEnv::with_pools("caps_buyer", &[("fold", 40)]).await;
    pool_set(
        &env,
        "fold",
        &["--hold-share", "100", "--holds-per-uid", "2"],
    )
    .await;
    let k = key(&env, "shop", "orders:write,orders:read").await;
    let api = ApiServer::start(&env, &["--rate-per-key", "100000"]).await;
    let (s, b) = post_json(&api, &k, "/v1/holds", &hold("V-1", "mallory", "fold", 1)).await;
    assert_eq!(s, 201, "{b}");
    let (s, b) = post_json(&api, &k, "/v1/holds", &hold("V-2", "Mallory", "fold", 1)).await;
    assert_eq!(s, 201, "{b}");
    let (s, b) = post_json(
        &api,
        &k,
        "/v1/holds",
        &hold("V-3", "ｍａｌｌｏｒｙ", "fold", 1),
    )
    .await;
    assert_eq!(s, 429, "the third hold of one buyer: {b}");
    assert_eq!(b["cap"], "holds-per-buyer", "{b}");
    // Per-user limits fold the same way.
    env.fill_pool("once", 10).await;
    pool_set(&env, "once", &["--per-user", "1"]).await;
    let order = |id: &str, uid: &str| {
        json!({"order_id": id, "uid": uid, "phone": "+8613800000000", "pool": "once"})
            .to_string()
            .into_bytes()
    };
    let (s, b) = post_json(&api, &k, "/v1/orders", &order("P-1", "mallory")).await;
    assert_eq!(s, 201, "{b}");
    for (id, uid) in [("P-2", "MALLORY"), ("P-3", "ｍａｌｌｏｒｙ")] {
        let (s, b) = post_json(&api, &k, "/v1/orders", &order(id, uid)).await;
        assert_eq!(s, 422, "{uid}: {b}");
        assert_eq!(b["limit"], 1, "{b}");
    }
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_hold_the_stock_cannot_cover_is_409_insufficient_stock_not_a_429_limit() {
    let env = TestEnv::new("caps_hold_empty").await;
    env.store.ensure_pool("em").await.unwrap();
    env.fill_pool("few", 3).await;
    env.fill_pool("big", 100).await;
    let (api, k) = api_with_key(&env, "checkout", "orders:write,orders:read").await;
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
        assert_eq!(
            pool_statuses(&env, pool).await[4],
            0,
            "nothing held in {pool}"
        );
    }
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_hold_placed_for_mallory_is_paid_by_mallory_with_a_capital_m() {
    let env = TestEnv::with_pools("caps_hold_fold", &[("mc", 10)]).await;
    pool_set(&env, "mc", &["--hold-share", "100"]).await;
    let (api, k) = api_with_key(&env, "checkout", "orders:write,orders:read").await;
    let (s, _, b) = api
        .post("/v1/holds", &k, &hold("H-mc", "mallory", "mc", 2))
        .await;
    assert_eq!(s, 201, "{}", String::from_utf8_lossy(&b));
    let held = code_ids(&env, doc! {"pool": "mc", "status": 4}).await;
    assert_eq!(held.len(), 2);
    // The same buyer, folded: the order pays the hold with its held codes.
    let (s, _, b) = api
        .post("/v1/orders", &k, &paid("O-mc", "Mallory", "mc", 2, "H-mc"))
        .await;
    assert_eq!(s, 201, "{}", String::from_utf8_lossy(&b));
    assert_eq!(
        code_ids(&env, doc! {"order_id": "O-mc"}).await,
        held,
        "the held codes"
    );
    let (_, _, b) = api.get("/v1/holds/H-mc", &k).await;
    let b = json_of(&b);
    assert_eq!(b["state"], "committed", "{b}");
    assert_eq!(b["order_id"], "O-mc", "{b}");
    assert_eq!(
        pool_statuses(&env, "mc").await,
        [8, 2, 0, 0, 0],
        "nothing else taken"
    );
    api.stop().await;
    env.cleanup().await;
}

fn plain(order: &str, uid: &str, pool: &str) -> Vec<u8> {
    json!({"order_id": order, "uid": uid, "phone": "+8613800000000", "pool": pool})
        .to_string()
        .into_bytes()
}

#[tokio::test]
async fn a_hold_and_an_order_from_stock_count_against_one_per_user_limit() {
    let env = TestEnv::with_pools("caps_peruser", &[("pu", 10)]).await;
    pool_set(&env, "pu", &["--hold-share", "100", "--per-user", "1"]).await;
    let (api, k) = checkout_api(&env).await;
    let (s, b) = post_json(&api, &k, "/v1/holds", &hold("H-pu", "solo", "pu", 1)).await;
    assert_eq!(s, 201, "{b}");
    let (s, b) = post_json(&api, &k, "/v1/orders", &plain("O-stock", "solo", "pu")).await;
    assert_eq!(s, 201, "{b}");
    let (s, b) = post_json(
        &api,
        &k,
        "/v1/orders",
        &paid("O-hold", "solo", "pu", 1, "H-pu"),
    )
    .await;
    assert_eq!(s, 422, "refused, not granted: {b}");
    assert_eq!(
        b["type"].as_str().map(|t| t.ends_with("per-user-limit")),
        Some(true),
        "{b}"
    );
    let issued = code_ids(
        &env,
        doc! {"pool": "pu", "uid": "solo", "status": {"$in": [1, 2]}},
    )
    .await;
    assert_eq!(issued.len(), 1, "one buyer, one code");
    // The refused payment's hold is over, its code back in stock.
    assert_eq!(
        hold_doc(&env, "H-pu").await.get_str("state").unwrap(),
        "released"
    );
    assert!(code_ids(&env, doc! {"pool": "pu", "status": 4})
        .await
        .is_empty());
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_buyer_at_the_per_user_limit_cannot_open_a_hold_it_could_not_pay() {
    let env = TestEnv::with_pools("caps_peruser_hold", &[("ph", 10)]).await;
    pool_set(&env, "ph", &["--hold-share", "100", "--per-user", "2"]).await;
    let (api, k) = checkout_api(&env).await;
    let (s, b) = post_json(&api, &k, "/v1/orders", &plain("O-ph", "solo", "ph")).await;
    assert_eq!(s, 201, "{b}");
    // One code left of the limit: a hold of one is fine, a second is not
    // (paying both would pass the limit), nor is a hold of two.
    let (s, b) = post_json(&api, &k, "/v1/holds", &hold("H-two", "SOLO", "ph", 2)).await;
    assert_eq!(s, 422, "{b}");
    assert_eq!(
        b["type"].as_str().map(|t| t.ends_with("per-user-limit")),
        Some(true),
        "{b}"
    );
    assert_eq!(b["limit"], 2, "{b}");
    assert_eq!(b["pool"], "ph", "{b}");
    let (s, b) = post_json(&api, &k, "/v1/holds", &hold("H-one", "solo", "ph", 1)).await;
    assert_eq!(s, 201, "{b}");
    let (s, b) = post_json(&api, &k, "/v1/holds", &hold("H-more", "solo", "ph", 1)).await;
    assert_eq!(s, 422, "{b}");
    // The hold it could pay is paid.
    let (s, b) = post_json(
        &api,
        &k,
        "/v1/orders",
        &paid("O-one", "solo", "ph", 1, "H-one"),
    )
    .await;
    assert_eq!(s, 201, "{b}");
    assert_eq!(
        code_ids(&env, doc! {"pool": "ph", "status": 4}).await.len(),
        0,
        "nothing left held"
    );
    api.stop().await;
    env.cleanup().await;
}
