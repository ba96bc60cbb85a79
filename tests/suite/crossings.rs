//! Where features cross: a checkout hold meets a recall, an expiry, a
//! per-user limit, a pause or another shop. Each of these failed on the
//! main of 2026-11-26 (issue "One gate for every code"); the gate
//! (`codepool_domain::gate`, `issuance::held::commit_paid`) holds them now.

use std::collections::HashSet;
use std::time::Duration;

use bson::doc;
use bson::oid::ObjectId;
use codepool_broker::Publisher;
use futures::StreamExt;
use serde_json::{json, Value};

use crate::api::{http, json_of, key, ApiServer};
use crate::common::*;

fn hold(id: &str, uid: &str, pool: &str, q: u32) -> Vec<u8> {
    json!({"hold_id": id, "uid": uid, "items": [{"pool": pool, "quantity": q}]})
        .to_string()
        .into_bytes()
}

fn paid(order: &str, uid: &str, pool: &str, q: u32, hold_id: &str) -> Vec<u8> {
    json!({"order_id": order, "uid": uid, "phone": "+8613800000000", "pool": pool,
           "quantity": q, "hold_id": hold_id})
    .to_string()
    .into_bytes()
}

fn plain(order: &str, uid: &str, pool: &str) -> Vec<u8> {
    json!({"order_id": order, "uid": uid, "phone": "+8613800000000", "pool": pool})
        .to_string()
        .into_bytes()
}

async fn ids(env: &TestEnv, filter: bson::Document) -> HashSet<ObjectId> {
    let mut out = HashSet::new();
    let mut cur = (env.store.database())
        .collection::<bson::Document>("codes")
        .find(filter)
        .await
        .unwrap();
    while let Some(d) = cur.next().await {
        out.insert(d.unwrap().get_object_id("_id").unwrap());
    }
    out
}

async fn hold_doc(env: &TestEnv, id: &str) -> bson::Document {
    (env.store.database())
        .collection::<bson::Document>("holds")
        .find_one(doc! {"_id": id})
        .await
        .unwrap()
        .expect("the hold")
}

/// Imports `codes` into `pool`; returns the run's import id.
async fn import(env: &TestEnv, pool: &str, codes: &[String]) -> String {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), format!("code\n{}\n", codes.join("\n"))).unwrap();
    let out = codepool_ok(
        env,
        &[
            "import",
            file.path().to_str().unwrap(),
            "--pool",
            pool,
            "--json",
        ],
    )
    .await;
    let summary: Value = serde_json::from_str(&out).unwrap();
    summary["import_id"].as_str().unwrap().to_owned()
}

async fn api(env: &TestEnv) -> (ApiServer, String) {
    let k = key(env, "checkout", "orders:write,orders:read").await;
    let api = ApiServer::start(env, &["--rate-per-key", "100000"]).await;
    (api, k)
}

async fn post(api: &ApiServer, k: &str, path: &str, body: &[u8]) -> (u16, Value) {
    let (s, _, b) = http(&api.addr, "POST", path, Some(k), body).await;
    (
        s,
        if b.is_empty() {
            Value::Null
        } else {
            json_of(&b)
        },
    )
}

#[tokio::test]
async fn a_recall_reaches_into_holds_and_the_paid_hold_gets_no_code_of_the_leaked_file() {
    let env = TestEnv::new("cross_recall").await;
    let leaked: Vec<String> = (0..4).map(|i| format!("LEAK-{i:04}")).collect();
    let import_id = import(&env, "rc", &leaked).await;
    codepool_ok(
        &env,
        &["pool", "set", "--pool", "rc", "--hold-share", "100"],
    )
    .await;
    let (api, k) = api(&env).await;
    let (s, b) = post(&api, &k, "/v1/holds", &hold("H-rc", "buyer", "rc", 2)).await;
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
    let (s, b) = post(
        &api,
        &k,
        "/v1/orders",
        &paid("O-rc", "buyer", "rc", 2, "H-rc"),
    )
    .await;
    assert_eq!(s, 202, "{b}");
    assert_eq!(b["state"], "waiting");
    assert!(
        ids(&env, doc! {"batch_id": batch, "status": {"$in": [1, 2, 4]}})
            .await
            .is_empty()
    );
    let fresh: Vec<String> = (0..2).map(|i| format!("FRESH-{i:04}")).collect();
    let fresh_id = import(&env, "rc", &fresh).await;
    let fresh_batch = ObjectId::parse_str(&fresh_id).unwrap();
    // A dispatcher fulfils waiting orders after an import.
    let daemon = start_daemon(env.command(&[])).await;
    eventually(
        Duration::from_secs(30),
        "the waiting order is served from the new file",
        || async {
            ids(
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
    let env = TestEnv::new("cross_expiry").await;
    env.fill_pool("ex", 3).await;
    codepool_ok(
        &env,
        &["pool", "set", "--pool", "ex", "--hold-share", "100"],
    )
    .await;
    let (api, k) = api(&env).await;
    let (s, b) = post(&api, &k, "/v1/holds", &hold("H-ex", "buyer", "ex", 1)).await;
    assert_eq!(s, 201, "{b}");
    let held = ids(&env, doc! {"pool": "ex", "status": 4}).await;
    assert_eq!(held.len(), 1);
    let held_id = *held.iter().next().unwrap();
    // Its time runs out while it is held (the partner's expiry date).
    let past = bson::DateTime::from_millis(bson::DateTime::now().timestamp_millis() - 1000);
    (env.store.database())
        .collection::<bson::Document>("codes")
        .update_one(doc! {"_id": held_id}, doc! {"$set": {"expires_at": past}})
        .await
        .unwrap();
    let (s, b) = post(
        &api,
        &k,
        "/v1/orders",
        &paid("O-ex", "buyer", "ex", 1, "H-ex"),
    )
    .await;
    assert_eq!(s, 201, "granted from stock: {b}");
    let got = ids(&env, doc! {"order_id": "O-ex", "status": 1}).await;
    assert_eq!(got.len(), 1);
    assert!(!got.contains(&held_id), "the expired held code was issued");
    // `codepool expire` voids an expired held code too.
    codepool_ok(&env, &["expire", "--pool", "ex"]).await;
    let voided = ids(
        &env,
        doc! {"_id": held_id, "status": 3, "void_reason": "expired"},
    )
    .await;
    assert_eq!(voided.len(), 1, "expire skipped the held code");
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_hold_and_an_order_from_stock_count_against_one_per_user_limit() {
    let env = TestEnv::new("cross_peruser").await;
    env.fill_pool("pu", 10).await;
    codepool_ok(
        &env,
        &[
            "pool",
            "set",
            "--pool",
            "pu",
            "--hold-share",
            "100",
            "--per-user",
            "1",
        ],
    )
    .await;
    let (api, k) = api(&env).await;
    let (s, b) = post(&api, &k, "/v1/holds", &hold("H-pu", "solo", "pu", 1)).await;
    assert_eq!(s, 201, "{b}");
    let (s, b) = post(&api, &k, "/v1/orders", &plain("O-stock", "solo", "pu")).await;
    assert_eq!(s, 201, "{b}");
    let (s, b) = post(
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
    let issued = ids(
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
    assert!(ids(&env, doc! {"pool": "pu", "status": 4}).await.is_empty());
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_hold_paid_while_its_pool_is_paused_is_bound_to_that_order_and_no_other_order_uses_it() {
    let env = TestEnv::new("cross_pause").await;
    env.fill_pool("pz", 4).await;
    codepool_ok(
        &env,
        &["pool", "set", "--pool", "pz", "--hold-share", "100"],
    )
    .await;
    let (api, k) = api(&env).await;
    let (s, b) = post(&api, &k, "/v1/holds", &hold("H-pz", "buyer", "pz", 1)).await;
    assert_eq!(s, 201, "{b}");
    // Paused while the hold is live; a fresh API process (no cached
    // policy) takes the payment.
    api.stop().await;
    codepool_ok(&env, &["pool", "pause", "--pool", "pz"]).await;
    let api = ApiServer::start(&env, &["--rate-per-key", "100000"]).await;
    let (s, b) = post(
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
    assert!(ids(&env, doc! {"pool": "pz", "status": 4}).await.is_empty());
    // A second order naming the same hold is an order like any other:
    // it waits behind the pause too, and nothing is issued while paused.
    let (s, b) = post(
        &api,
        &k,
        "/v1/orders",
        &paid("O-2", "buyer", "pz", 1, "H-pz"),
    )
    .await;
    assert_eq!(s, 202, "{b}");
    assert!(ids(&env, doc! {"pool": "pz", "status": 1}).await.is_empty());
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn an_amqp_purchase_that_names_another_shop_never_pays_this_shops_hold() {
    let env = TestEnv::new("cross_shops").await;
    env.fill_pool("sx", 10).await;
    codepool_ok(
        &env,
        &["pool", "set", "--pool", "sx", "--hold-share", "100"],
    )
    .await;
    codepool_ok(
        &env,
        &["shops", "create", "--name", "acme", "--pools", "sx"],
    )
    .await;
    codepool_ok(
        &env,
        &[
            "shops",
            "create",
            "--name",
            "bolt",
            "--pools",
            "sx",
            "--broker-users",
            "guest",
        ],
    )
    .await;
    let acme = codepool_ok(
        &env,
        &[
            "api-keys",
            "create",
            "--name",
            "acme-1",
            "--shop",
            "acme",
            "--scopes",
            "orders:write,orders:read",
        ],
    )
    .await
    .trim()
    .to_owned();
    let api = ApiServer::start(&env, &[]).await;
    let (s, b) = post(&api, &acme, "/v1/holds", &hold("H-acme", "buyer", "sx", 1)).await;
    assert_eq!(s, 201, "{b}");
    let held = ids(&env, doc! {"pool": "sx", "status": 4}).await;
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
        ids(
            &env,
            doc! {"order_id": {"$in": ["O-bolt", "O-none"]}, "status": 1},
        )
        .await
        .len()
            == 2
    })
    .await;
    let got = ids(&env, doc! {"order_id": {"$in": ["O-bolt", "O-none"]}}).await;
    assert!(got.is_disjoint(&held), "another shop paid acme's hold");
    assert_eq!(
        hold_doc(&env, "H-acme").await.get_str("state").unwrap(),
        "held"
    );
    assert_eq!(ids(&env, doc! {"pool": "sx", "status": 4}).await, held);
    daemon.stop().await;
    api.stop().await;
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_hold_on_a_pool_taken_off_the_shop_is_not_paid_and_nothing_is_issued() {
    let env = TestEnv::new("cross_shop_pool").await;
    env.fill_pool("sp", 5).await;
    env.fill_pool("sq", 5).await;
    codepool_ok(
        &env,
        &["pool", "set", "--pool", "sp", "--hold-share", "100"],
    )
    .await;
    codepool_ok(
        &env,
        &["shops", "create", "--name", "sh", "--pools", "sp,sq"],
    )
    .await;
    let args = [
        "api-keys",
        "create",
        "--name",
        "sh-1",
        "--shop",
        "sh",
        "--scopes",
        "orders:write,orders:read",
    ];
    let k = codepool_ok(&env, &args).await.trim().to_owned();
    let api = ApiServer::start(&env, &[]).await;
    let (s, b) = post(&api, &k, "/v1/holds", &hold("H-sp", "buyer", "sp", 1)).await;
    assert_eq!(s, 201, "{b}");
    api.stop().await;
    codepool_ok(&env, &["shops", "set", "--name", "sh", "--pools", "sq"]).await;
    let api = ApiServer::start(&env, &[]).await;
    let (s, b) = post(
        &api,
        &k,
        "/v1/orders",
        &paid("O-sp", "buyer", "sp", 1, "H-sp"),
    )
    .await;
    assert_eq!(s, 403, "{b}");
    assert!(
        ids(&env, doc! {"order_id": "O-sp"}).await.is_empty(),
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
    let env = TestEnv::new("cross_bound").await;
    env.fill_pool("bd", 5).await;
    codepool_ok(
        &env,
        &["pool", "set", "--pool", "bd", "--hold-share", "100"],
    )
    .await;
    let (api, k) = api(&env).await;
    let (s, b) = post(&api, &k, "/v1/holds", &hold("H-bd", "buyer", "bd", 1)).await;
    assert_eq!(s, 201, "{b}");
    let (s, b) = post(
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
    (env.store.database().collection::<bson::Document>("holds"))
        .update_one(
            doc! {"_id": "H-bd"},
            doc! {"$set": {"state": "held"}, "$unset": {"ended_at": ""}},
        )
        .await
        .unwrap();
    let (s, b) = post(
        &api,
        &k,
        "/v1/orders",
        &paid("O-b", "buyer", "bd", 1, "H-bd"),
    )
    .await;
    assert_eq!(s, 201, "another order is served from stock: {b}");
    let h = hold_doc(&env, "H-bd").await;
    assert_eq!(h.get_str("order_id").unwrap(), "O-a", "{h}");
    let (s, b) = post(
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
    let env = TestEnv::new("cross_bundle_hold").await;
    let leaked: Vec<String> = (0..2).map(|i| format!("BH-LEAK-{i}")).collect();
    let import_id = import(&env, "ba", &leaked).await;
    env.fill_pool("bb", 5).await;
    for p in ["ba", "bb"] {
        codepool_ok(&env, &["pool", "set", "--pool", p, "--hold-share", "100"]).await;
    }
    let (api, k) = api(&env).await;
    let items = json!([{"pool": "ba", "quantity": 1}, {"pool": "bb", "quantity": 1}]);
    let body = json!({"hold_id": "H-bh", "uid": "buyer", "items": items});
    let (s, b) = post(&api, &k, "/v1/holds", body.to_string().as_bytes()).await;
    assert_eq!(s, 201, "{b}");
    codepool_ok(&env, &["void", "--import", &import_id, "--reason", "leak"]).await;
    let order = json!({"order_id": "O-bh", "uid": "buyer", "phone": "+8613800000000",
                       "items": items, "hold_id": "H-bh"});
    let (s, b) = post(&api, &k, "/v1/orders", order.to_string().as_bytes()).await;
    assert_eq!(s, 202, "waits whole: {b}");
    assert!(
        ids(&env, doc! {"order_id": "O-bh"}).await.is_empty(),
        "half a bundle was issued"
    );
    assert!(
        ids(&env, doc! {"status": 4}).await.is_empty(),
        "the hold's codes are back"
    );
    api.stop().await;
    env.cleanup().await;
}
