//! Channels: a shop's Eneba, G2A (and Kinguin) accounts sell its pools
//! through `codepool api`, each under its marketplace's own protocol. The
//! tests play each marketplace as its published contract says
//! (../shared/marketplaces.md), with its faults: a client timeout while
//! codepool commits (the retry gets the same keys), every callback
//! delivered twice, CANCEL racing PROVIDE, CANCEL after PROVIDE, a token
//! that expires mid-run, a reservation past its time, returns that name
//! items of an earlier read. Bad input changes nothing. One pool sold by
//! the shop's own checkout, Eneba and G2A at once sells no code twice and
//! leaks no hold.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use bson::doc;
use serde_json::{json, Value};

use crate::api::{http, json_of, ApiServer, Exchange};
use crate::common::*;
use crate::fixtures::*;

const ENEBA_TOKEN: &str = "eneba-static-bearer-0123456789abcdef0123456789";
const G2A_ID: &str = "g2a-client";
const G2A_SECRET: &str = "g2a-client-secret-0123456789abcdef0123456789";
const AUCTION: &str = "8f2c1a52-6a1e-4b8e-9a55-0c9a3e1f0b7d";
const PRODUCT: &str = "10000045532001";

/// `codepool channels add`, credentials written to a file; `extra` flags.
async fn add_channel(
    env: &TestEnv,
    name: &str,
    kind: &str,
    shop: &str,
    creds: Value,
    extra: &[&str],
) {
    let path = std::env::temp_dir().join(format!("cpt-{}-{name}.json", std::process::id()));
    std::fs::write(&path, creds.to_string()).unwrap();
    let file = path.to_str().unwrap().to_owned();
    let mut args = vec![
        "channels",
        "add",
        "--name",
        name,
        "--kind",
        kind,
        "--shop",
        shop,
        "--credentials",
        &file,
    ];
    args.extend_from_slice(extra);
    codepool_ok(env, &args).await;
    let _ = std::fs::remove_file(path);
}

async fn map(env: &TestEnv, name: &str, product: &str, pool: &str) {
    codepool_ok(
        env,
        &[
            "channels",
            "map",
            "--name",
            name,
            "--product",
            product,
            "--pool",
            pool,
        ],
    )
    .await;
}

/// A shop `acme` selling pool `pool` (of `n` codes) on Eneba (`en`, with
/// `extra` flags) and G2A (`g2`).
async fn selling(test: &str, pool: &str, n: usize, eneba: &[&str], g2a: &[&str]) -> TestEnv {
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
async fn eneba(api: &ApiServer, token: &str, body: Value) -> Exchange {
    http(
        &api.addr,
        "POST",
        "/channels/en/eneba",
        Some(token),
        body.to_string().as_bytes(),
    )
    .await
}

fn reserve(order: &str, keys: u32) -> Value {
    json!({"action": "RESERVE", "orderId": order, "auctions": [
        {"auctionId": AUCTION, "keyCount": keys, "price": {"amount": 1599, "currency": "EUR"}}
    ]})
}

fn provide(order: &str) -> Value {
    json!({"action": "PROVIDE", "orderId": order})
}

fn cancel(order: &str) -> Value {
    json!({"action": "CANCEL", "orderId": order})
}

/// The keys of a PROVIDE answer.
fn keys_of(body: &[u8]) -> Vec<String> {
    let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    (v["auctions"].as_array().into_iter().flatten())
        .flat_map(|a| a["keys"].as_array().cloned().unwrap_or_default())
        .filter_map(|k| k["value"].as_str().map(str::to_owned))
        .collect()
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

fn success(body: &[u8]) -> Value {
    json_of(body)["success"].clone()
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

