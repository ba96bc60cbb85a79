//! One key cannot hold a whole pool through made-up buyers, and a buyer's
//! case and width variants are one buyer for every per-buyer rule
//! (issue 54, item 3).

use bson::doc;
use serde_json::{json, Value};

use crate::api::{http, json_of, key, ApiServer};
use crate::common::*;

fn hold(id: &str, uid: &str, pool: &str, q: u32) -> Vec<u8> {
    json!({"hold_id": id, "uid": uid, "items": [{"pool": pool, "quantity": q}]})
        .to_string()
        .into_bytes()
}

async fn post(api: &ApiServer, k: &str, path: &str, body: &[u8]) -> (u16, Value) {
    let (s, _, b) = http(&api.addr, "POST", path, Some(k), body).await;
    (s, json_of(&b))
}

async fn held(env: &TestEnv, pool: &str) -> u64 {
    (env.store.database().collection::<bson::Document>("codes"))
        .count_documents(doc! {"pool": pool, "status": 4})
        .await
        .unwrap()
}

#[tokio::test]
async fn one_key_holds_at_most_its_share_of_a_pool_whatever_the_uids_it_sends() {
    let env = TestEnv::new("caps_owner").await;
    env.fill_pool("crowd", 20).await;
    // Each buyer may hold the whole pool; a shop may hold half of it.
    codepool_ok(
        &env,
        &["pool", "set", "--pool", "crowd", "--hold-share", "100"],
    )
    .await;
    let mut keys = Vec::new();
    for shop in ["greedy", "other"] {
        codepool_ok(
            &env,
            &["shops", "create", "--name", shop, "--pools", "crowd"],
        )
        .await;
        let args = [
            "api-keys",
            "create",
            "--name",
            shop,
            "--shop",
            shop,
            "--scopes",
            "orders:write,orders:read",
        ];
        keys.push(codepool_ok(&env, &args).await.trim().to_owned());
    }
    let (greedy, other) = (keys[0].clone(), keys[1].clone());
    let api = ApiServer::start(&env, &["--rate-per-key", "100000"]).await;
    for i in 0..10 {
        let (s, b) = post(
            &api,
            &greedy,
            "/v1/holds",
            &hold(&format!("G-{i}"), &format!("made-up-{i}"), "crowd", 1),
        )
        .await;
        assert_eq!(s, 201, "{b}");
    }
    let (s, b) = post(
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
    let (s, b) = post(&api, &other, "/v1/holds", &hold("O-1", "buyer", "crowd", 1)).await;
    assert_eq!(s, 201, "{b}");
    // The share is a pool setting.
    codepool_ok(
        &env,
        &[
            "pool",
            "set",
            "--pool",
            "crowd",
            "--hold-share-per-owner",
            "100",
        ],
    )
    .await;
    let (s, b) = post(
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
    let env = TestEnv::new("caps_buyer").await;
    env.fill_pool("fold", 40).await;
    codepool_ok(
        &env,
        &[
            "pool",
            "set",
            "--pool",
            "fold",
            "--hold-share",
            "100",
            "--holds-per-uid",
            "2",
        ],
    )
    .await;
    let k = key(&env, "shop", "orders:write,orders:read").await;
    let api = ApiServer::start(&env, &["--rate-per-key", "100000"]).await;
    let (s, b) = post(&api, &k, "/v1/holds", &hold("V-1", "mallory", "fold", 1)).await;
    assert_eq!(s, 201, "{b}");
    let (s, b) = post(&api, &k, "/v1/holds", &hold("V-2", "Mallory", "fold", 1)).await;
    assert_eq!(s, 201, "{b}");
    let (s, b) = post(
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
    codepool_ok(&env, &["pool", "set", "--pool", "once", "--per-user", "1"]).await;
    let order = |id: &str, uid: &str| {
        json!({"order_id": id, "uid": uid, "phone": "+8613800000000", "pool": "once"})
            .to_string()
            .into_bytes()
    };
    let (s, b) = post(&api, &k, "/v1/orders", &order("P-1", "mallory")).await;
    assert_eq!(s, 201, "{b}");
    for (id, uid) in [("P-2", "MALLORY"), ("P-3", "ｍａｌｌｏｒｙ")] {
        let (s, b) = post(&api, &k, "/v1/orders", &order(id, uid)).await;
        assert_eq!(s, 422, "{uid}: {b}");
        assert_eq!(b["limit"], 1, "{b}");
    }
    api.stop().await;
    env.cleanup().await;
}
