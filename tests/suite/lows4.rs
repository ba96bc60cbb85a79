//! Issue 54, item 8 (the lows, each with a test):
//! - held codes are not counted as issued in the pool stats' rates.

use serde_json::{json, Value};

use crate::api::{http, json_of, key, order, ApiServer};
use crate::common::*;

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
