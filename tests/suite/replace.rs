//! Replacing one code of an order (issue 55 item 1), against the real
//! servers through real `codepool api`, `dispatch` and CLI processes: one
//! id gives one new code however often (and however concurrently) it is
//! sent, the pool's cap, an empty pool's line served before older
//! backorders, another shop's key, the signed `code.replaced` webhook,
//! the new code's own `sms.pending` event, and the CLI, audited and
//! finished by a retry after a `kill -9` between the void and the claim.

use std::time::Duration;

use bson::doc;
use futures::{StreamExt, TryStreamExt};
use serde_json::{json, Value};

use crate::api::{json_of, key, order, ApiServer};
use crate::common::*;
use crate::fixtures::*;
use crate::webhooks::{add_endpoint, verified_by_the_python_library, Answer, Receiver};

fn path(order: &str, line: u32) -> String {
    format!("/v1/orders/{order}/lines/{line}/replace")
}

fn body(id: &str, reason: &str) -> Vec<u8> {
    json!({"replacement_id": id, "reason": reason})
        .to_string()
        .into_bytes()
}

/// `POST …/replace`: status and JSON.
async fn replace(
    api: &ApiServer,
    key: &str,
    order: &str,
    line: u32,
    id: &str,
    reason: &str,
) -> (u16, Value) {
    let (status, _, b) = api.post(&path(order, line), key, &body(id, reason)).await;
    (status, json_of(&b))
}

/// Places `id` (one code of `pool`) with `key`; returns its code.
async fn place(api: &ApiServer, key: &str, id: &str, pool: &str) -> Value {
    let (status, _, b) = api.post("/v1/orders", key, &order(id, pool, 1)).await;
    assert_eq!(status, 201, "{}", String::from_utf8_lossy(&b));
    json_of(&b)["codes"][0].clone()
}

/// Every code document of `order`, by line and replacement.
async fn codes_of(env: &TestEnv, order: &str) -> Vec<bson::Document> {
    env.coll("codes")
        .find(doc! {"order_id": order})
        .sort(doc! {"order_line": 1, "order_repl": 1})
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap()
}

async fn read(api: &ApiServer, key: &str, order: &str) -> Value {
    let (status, _, b) = api.get(&format!("/v1/orders/{order}"), key).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&b));
    json_of(&b)
}

/// The `sms.pending` events on the broker until one with `event_id`
/// arrives (within 30 s); every event drained so far.
async fn events_until(env: &TestEnv, event_id: &str) -> Vec<Value> {
    let conn = codepool_broker::connect(AMQP_URL, "replace-test")
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    let mut seen: Vec<Value> = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !seen.iter().any(|e| e["event_id"] == event_id) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no {event_id} event: {seen:?}"
        );
        for t in drain(&ch, &env.topology().sms_pending).await {
            seen.push(serde_json::from_slice(&t.body).unwrap());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = conn.close(200, "bye").await;
    seen
}

#[tokio::test]
async fn one_replacement_id_gives_one_new_code_with_its_own_sms_event() {
    let env = TestEnv::with_pools("replace_once", &[("ro", 10)]).await;
    let (api, k) = api_with_key(&env, "shop", "orders:write,orders:read").await;
    let old = place(&api, &k, "R-1", "ro").await;

    let (status, first) = replace(&api, &k, "R-1", 0, "T-1", "rejected by the platform").await;
    assert_eq!(status, 201, "{first}");
    assert_eq!(first["state"], "replaced");
    assert_eq!(first["old_grant_no"], old["grant_no"]);
    let new = &first["code"];
    assert_ne!(
        new["code"], old["code"],
        "a fresh code, in plaintext for the owner"
    );
    assert!(new["code"].as_str().unwrap().starts_with("ro-"));
    assert_ne!(new["grant_no"], old["grant_no"], "a new grant number");

    // The same id again: the same code, nothing else.
    let (status, again) = replace(&api, &k, "R-1", 0, "T-1", "rejected by the platform").await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["code"], first["code"]);
    // The id with another reason (or line) is another replacement: 409.
    let (status, other) = replace(&api, &k, "R-1", 0, "T-1", "another reason").await;
    assert_eq!(status, 409, "{other}");
    assert!(other["type"]
        .as_str()
        .unwrap()
        .ends_with("/conflicting-replacement"));
    let docs = codes_of(&env, "R-1").await;
    assert_eq!(docs.len(), 2, "the old code and one new code");
    assert_eq!(docs[0].get_i32("status").unwrap(), 3);
    assert_eq!(docs[0].get_str("void_reason").unwrap(), "replaced");
    assert_eq!(docs[1].get_i32("status").unwrap(), 1);
    assert_eq!(env.plain_code(&docs[1]), new["code"].as_str().unwrap());

    // The order shows the new code, and its replacement.
    let o = read(&api, &k, "R-1").await;
    assert_eq!(o["state"], "granted");
    assert_eq!(o["codes"].as_array().unwrap().len(), 1);
    assert_eq!(o["codes"][0]["grant_no"], new["grant_no"]);
    assert_eq!(o["replacements"][0]["replacement_id"], "T-1");
    assert_eq!(o["replacements"][0]["state"], "done");

    // Its own sms.pending event, under an id the first text did not use.
    let events = events_until(&env, "sms:R-1#r1").await;
    let ev = events
        .iter()
        .find(|e| e["event_id"] == "sms:R-1#r1")
        .unwrap();
    assert_eq!(ev["code"], new["code"]);
    assert_eq!(ev["grant_no"], new["grant_no"]);
    assert!(
        events
            .iter()
            .all(|e| e["event_id"] != "sms:R-1" || e["code"] == old["code"]),
        "the first event carries the old code only"
    );

    // Twelve requests with one new id at once: one code between them.
    place(&api, &k, "R-2", "ro").await;
    let answers: Vec<(u16, Value)> = futures::stream::iter(0..12)
        .map(|_| replace(&api, &k, "R-2", 0, "T-2", "rejected"))
        .buffer_unordered(12)
        .collect()
        .await;
    let codes: std::collections::HashSet<String> = (answers.iter())
        .map(|(s, a)| {
            assert!(*s == 201 || *s == 200, "{s} {a}");
            a["code"]["code"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(codes.len(), 1, "one new code: {answers:?}");
    assert_eq!(answers.iter().filter(|(s, _)| *s == 201).count(), 1);
    assert_eq!(codes_of(&env, "R-2").await.len(), 2);
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn the_fourth_replacement_of_an_order_is_refused_and_changes_nothing() {
    let env = TestEnv::with_pools("replace_cap", &[("rp", 10)]).await;
    // One order per buyer: a replacement is not a second purchase.
    pool_set(&env, "rp", &["--per-user", "1"]).await;
    let (api, k) = api_with_key(&env, "shop", "orders:write,orders:read").await;
    place(&api, &k, "Q-1", "rp").await;
    for id in ["a", "b", "c"] {
        let (status, r) = replace(&api, &k, "Q-1", 0, id, "rejected").await;
        assert_eq!(status, 201, "{id}: {r}");
    }
    let before = codes_of(&env, "Q-1").await;
    assert_eq!(before.len(), 4);

    let (status, refused) = replace(&api, &k, "Q-1", 0, "d", "rejected").await;
    assert_eq!(status, 429, "{refused}");
    assert!(refused["type"]
        .as_str()
        .unwrap()
        .ends_with("/replacement-limit"));
    assert_eq!(refused["limit"], 3);
    assert_eq!(codes_of(&env, "Q-1").await, before, "nothing changed");
    let recorded = count_docs(&env, "replacements", doc! {"order_id": "Q-1"}).await;
    assert_eq!(recorded, 3);
    // An id used before is still answered, past the cap.
    let (status, _) = replace(&api, &k, "Q-1", 0, "c", "rejected").await;
    assert_eq!(status, 200);
    // The limit holds for a second purchase of the buyer.
    let (status, _, b) = api.post("/v1/orders", &k, &order("Q-2", "rp", 1)).await;
    assert_eq!(status, 422, "{}", String::from_utf8_lossy(&b));
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_replacement_on_an_empty_pool_waits_and_is_served_before_older_backorders() {
    let env = TestEnv::with_pools("replace_wait", &[("rw", 1)]).await;
    let k = key(&env, "shop", "orders:write,orders:read").await;
    // One granting process (the API, whose sweep serves waiting lines every
    // 10 s): which waits longest is then decided by one process.
    let api = ApiServer::start(&env, &[]).await;
    let old = place(&api, &k, "E-1", "rw").await;
    // The pool is empty: E-2 waits, before the replacement.
    let (status, _, b) = api.post("/v1/orders", &k, &order("E-2", "rw", 1)).await;
    assert_eq!(status, 202, "{}", String::from_utf8_lossy(&b));

    let (status, waiting) = replace(&api, &k, "E-1", 0, "W-1", "rejected").await;
    assert_eq!(status, 202, "{waiting}");
    assert_eq!(waiting["state"], "waiting");
    assert_eq!(waiting["code"], Value::Null);
    let docs = codes_of(&env, "E-1").await;
    assert_eq!(docs.len(), 1);
    assert_eq!(
        docs[0].get_str("void_reason").unwrap(),
        "replaced",
        "void at once"
    );
    let o = read(&api, &k, "E-1").await;
    assert_eq!(o["state"], "waiting");
    assert_eq!(o["waiting_lines"], json!([0]));
    let (status, _) = replace(&api, &k, "E-1", 0, "W-1", "rejected").await;
    assert_eq!(status, 202, "the same id again: still waiting");

    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), "code\nRW-NEW-1\n").unwrap();
    codepool_ok(
        &env,
        &["import", file.path().to_str().unwrap(), "--pool", "rw"],
    )
    .await;
    eventually(Duration::from_secs(60), "E-1's line served", || async {
        read(&api, &k, "E-1").await["state"] == "granted"
    })
    .await;
    let o = read(&api, &k, "E-1").await;
    assert_eq!(o["codes"][0]["status"], "issued");
    assert_ne!(o["codes"][0]["grant_no"], old["grant_no"]);
    assert_eq!(o["replacements"][0]["state"], "done");
    assert_eq!(o["waiting_lines"], json!([]));
    assert_eq!(
        read(&api, &k, "E-2").await["state"],
        "waiting",
        "the older backorder waits"
    );
    let events = events_until(&env, "sms:E-1#r1").await;
    let ev = events
        .iter()
        .find(|e| e["event_id"] == "sms:E-1#r1")
        .unwrap();
    assert_eq!(ev["code"], "RW-NEW-1");
    // The same id now answers the code.
    let (status, done) = replace(&api, &k, "E-1", 0, "W-1", "rejected").await;
    assert_eq!(status, 200, "{done}");
    assert_eq!(done["code"]["code"], "RW-NEW-1");
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn the_new_code_obeys_expiry_and_a_paused_pool_makes_the_line_wait() {
    let env = TestEnv::new("replace_gate").await;
    // Two codes that expired an hour ago come first; they are never given.
    let codes = env.fill_pool_expiring("rz", 2, 5).await;
    let (api, k) = api_with_key(&env, "shop", "orders:write,orders:read").await;
    place(&api, &k, "Z-1", "rz").await;
    let (status, r) = replace(&api, &k, "Z-1", 0, "Z-a", "rejected").await;
    assert_eq!(status, 201, "{r}");
    let given = r["code"]["code"].as_str().unwrap();
    assert!(
        !codes[..2].iter().any(|c| c == given),
        "an expired code: {given}"
    );

    codepool_ok(&env, &["pool", "pause", "--pool", "rz"]).await;
    let (status, r) = replace(&api, &k, "Z-1", 0, "Z-b", "rejected").await;
    assert_eq!(status, 202, "a paused pool gives nothing: {r}");
    assert_eq!(read(&api, &k, "Z-1").await["state"], "waiting");
    codepool_ok(&env, &["pool", "resume", "--pool", "rz"]).await;
    eventually(
        Duration::from_secs(60),
        "Z-1's line served on resume",
        || async { read(&api, &k, "Z-1").await["state"] == "granted" },
    )
    .await;
    let docs = codes_of(&env, "Z-1").await;
    assert_eq!(docs.len(), 3);
    assert!(docs
        .iter()
        .all(|d| !codes[..2].contains(&env.plain_code(d))));
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn another_shops_key_gets_the_404_of_an_unknown_order() {
    let env = TestEnv::with_pools("replace_shops", &[("rs", 10)]).await;
    shop(&env, "acme", "rs").await;
    shop(&env, "globex", "rs").await;
    let acme = shop_key(&env, "acme-1", "acme").await;
    let globex = shop_key(&env, "globex-1", "globex").await;
    let (api, admin) = api_with_key(&env, "ops", "orders:write,orders:read,admin").await;
    let old = place(&api, &acme, "S-1", "rs").await;

    let (status, theirs) = replace(&api, &globex, "S-1", 0, "G-1", "rejected").await;
    assert_eq!(status, 404, "{theirs}");
    let (status, unknown) = replace(&api, &globex, "S-NONE", 0, "G-2", "rejected").await;
    assert_eq!(status, 404, "{unknown}");
    for field in ["type", "title", "status"] {
        assert_eq!(theirs[field], unknown[field], "{field}");
    }
    assert_eq!(
        theirs["detail"].as_str().unwrap().replace("S-1", "S-NONE"),
        unknown["detail"].as_str().unwrap(),
        "one answer for both"
    );
    assert_eq!(codes_of(&env, "S-1").await.len(), 1, "nothing changed");

    // The shop's own key replaces it (plaintext); an admin key any
    // (masked: it did not place the order).
    let (status, own) = replace(&api, &acme, "S-1", 0, "A-1", "rejected").await;
    assert_eq!(status, 201, "{own}");
    assert_ne!(own["code"]["code"], old["code"]);
    assert!(own["code"]["code"].as_str().unwrap().starts_with("rs-"));
    let (status, by_admin) = replace(&api, &admin, "S-1", 0, "A-2", "rejected").await;
    assert_eq!(status, 201, "{by_admin}");
    assert!(by_admin["code"]["code"].as_str().unwrap().contains('*'));
    // Ids are each shop's own: globex's A-1 is a replacement of its own,
    // neither refused nor told anything of acme's, and acme's A-1 is
    // still acme's.
    place(&api, &globex, "G-1", "rs").await;
    let (status, reused) = replace(&api, &globex, "G-1", 0, "A-1", "secret reason").await;
    assert_eq!(status, 201, "{reused}");
    assert_eq!(reused["order_id"], "G-1", "{reused}");
    let (status, again) = replace(&api, &globex, "G-1", 0, "A-1", "secret reason").await;
    assert_eq!(status, 200, "the same id again: {again}");
    assert_eq!(again["code"], reused["code"]);
    let (status, mine) = replace(&api, &acme, "S-1", 0, "A-1", "rejected").await;
    assert_eq!(status, 200, "acme's A-1 is acme's: {mine}");
    assert_eq!(mine["order_id"], "S-1");
    // Another of acme's ids on globex's order is told nothing of acme's.
    let (status, other) = replace(&api, &globex, "G-1", 0, "A-1", "another reason").await;
    assert_eq!(status, 409, "{other}");
    let detail = other["detail"].as_str().unwrap();
    assert!(
        !detail.contains("S-1") && !detail.contains("rejected"),
        "{detail}"
    );
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn the_shop_hears_code_replaced_signed_for_the_standardwebhooks_library() {
    let env = TestEnv::with_pools("replace_hook", &[("rh", 10)]).await;
    shop(&env, "acme", "rh").await;
    let receiver = Receiver::start(Answer::Ok).await;
    let (_, secret) = add_endpoint(&env, "acme", &receiver.url(), "code.replaced").await;
    let k = shop_key(&env, "acme-1", "acme").await;
    let api = ApiServer::start(&env, &[]).await;
    let old = place(&api, &k, "H-1", "rh").await;
    let (status, done) = replace(&api, &k, "H-1", 0, "HR-1", "rejected").await;
    assert_eq!(status, 201, "{done}");
    eventually(Duration::from_secs(30), "code.replaced", || async {
        !receiver.of_type("code.replaced").is_empty()
    })
    .await;
    let hit = receiver.of_type("code.replaced").remove(0);
    verified_by_the_python_library(&secret, &hit)
        .await
        .unwrap_or_else(|e| panic!("standardwebhooks refused the signature: {e}"));
    crate::schemas::Schema::load("webhook-event")
        .assert_valid(hit.body.as_bytes(), "code.replaced");
    let data = &hit.json()["data"];
    assert_eq!(data["order_id"], "H-1");
    assert_eq!(data["shop"], "acme");
    assert_eq!(data["line"], 0);
    assert_eq!(data["replacement_id"], "HR-1");
    assert_eq!(data["old_grant_no"], old["grant_no"]);
    assert_eq!(data["new_grant_no"], done["code"]["grant_no"]);
    for code in [&old["code"], &done["code"]["code"]] {
        assert!(
            !hit.body.contains(code.as_str().unwrap()),
            "no code in a webhook"
        );
    }
    // The same id again records nothing new.
    replace(&api, &k, "H-1", 0, "HR-1", "rejected").await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let ids: std::collections::HashSet<String> = (receiver.of_type("code.replaced").iter())
        .map(|h| h.id.clone())
        .collect();
    assert_eq!(ids.len(), 1);
    api.stop().await;
    env.cleanup().await;
}

/// Every audit record of `kind`, as (who, what).
async fn audited(env: &TestEnv, kind: &str) -> Vec<(String, String)> {
    let docs: Vec<bson::Document> = find_docs(env, "audit", doc! {"kind": kind}).await;
    (docs.iter())
        .map(|d| {
            let f = |k: &str| d.get_str(k).unwrap_or_default().to_owned();
            (f("os_user"), f("what"))
        })
        .collect()
}

#[tokio::test]
async fn the_cli_replaces_a_code_audited_and_says_the_id_to_run_it_again() {
    let env = TestEnv::with_pools("replace_cli", &[("rc", 5)]).await;
    let (api, k) = api_with_key(&env, "shop", "orders:write,orders:read").await;
    place(&api, &k, "C-1", "rc").await;
    let out = codepool_ok(
        &env,
        &[
            "replace", "--order", "C-1", "--line", "0", "--reason", "rejected",
        ],
    )
    .await;
    let id = out
        .split_whitespace()
        .find(|w| w.starts_with("rpl-"))
        .unwrap_or_else(|| panic!("a made-up id is printed: {out}"))
        .to_owned();
    assert!(out.contains("goes to the buyer by SMS"), "{out}");
    let records = audited(&env, "replace").await;
    assert_eq!(records.len(), 1, "{records:?}");
    assert!(records[0].0.starts_with("os-user:"), "{records:?}");
    assert!(
        records[0].1.contains("C-1") && records[0].1.contains(&id),
        "{records:?}"
    );

    let again = codepool_ok(
        &env,
        &[
            "replace",
            "--order",
            "C-1",
            "--line",
            "0",
            "--reason",
            "rejected",
            "--replacement-id",
            &id,
            "--json",
        ],
    )
    .await;
    let again: Value = serde_json::from_str(&again).unwrap();
    assert_eq!(again["again"], true);
    assert_eq!(again["state"], "replaced");
    assert_eq!(codes_of(&env, "C-1").await.len(), 2, "nothing more");
    assert_eq!(audited(&env, "replace").await.len(), 1);
    // A used code is not replaced.
    let (status, _, _) = api.post("/v1/orders/C-1/redeem", &k, b"").await;
    assert_eq!(status, 200);
    let refused = env
        .run(&[
            "replace", "--order", "C-1", "--line", "0", "--reason", "late",
        ])
        .await;
    assert_eq!(refused.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("redeemed"));
    api.stop().await;
    env.cleanup().await;
}

/// Needs the `failpoints` feature (`make test` builds with it): the CLI
/// pauses between the void of the old code and the claim of the new.
#[cfg(feature = "failpoints")]
#[tokio::test]
async fn a_kill_between_the_void_and_the_claim_is_finished_by_a_retry_with_the_same_id() {
    let env = TestEnv::with_pools("replace_kill", &[("rk", 5)]).await;
    let (api, k) = api_with_key(&env, "shop", "orders:write,orders:read").await;
    place(&api, &k, "K-1", "rk").await;
    let args = [
        "replace",
        "--order",
        "K-1",
        "--line",
        "0",
        "--reason",
        "rejected",
        "--replacement-id",
        "KR-1",
    ];
    let mut cmd = env.command(&args);
    cmd.env("CODEPOOL_FAILPOINTS", "replace-pause=60000");
    let mut child = cmd.spawn().unwrap();
    eventually(Duration::from_secs(20), "the old code void", || async {
        codes_of(&env, "K-1").await[0].get_str("replaced_by").ok() == Some("KR-1")
    })
    .await;
    child.start_kill().unwrap(); // SIGKILL
    let _ = child.wait().await;
    assert_eq!(
        codes_of(&env, "K-1").await.len(),
        1,
        "killed before the claim"
    );

    codepool_ok(&env, &args).await;
    let docs = codes_of(&env, "K-1").await;
    assert_eq!(docs.len(), 2, "the retry finished it: one new code");
    assert_eq!(docs[1].get_i32("status").unwrap(), 1);
    assert_eq!(docs[1].get_i64("order_repl").unwrap(), 1);
    let o = read(&api, &k, "K-1").await;
    assert_eq!(o["state"], "granted");
    assert_eq!(o["replacements"][0]["state"], "done");
    events_until(&env, "sms:K-1#r1").await;
    api.stop().await;
    env.cleanup().await;
}
