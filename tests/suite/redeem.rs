//! Redemption by code for the platform (issue 55 item 2), against the real
//! servers through real `codepool api` and dispatcher processes: exactly
//! one of 64 concurrent redemptions wins, `check` changes nothing, one
//! answer for every code a key may not learn about, a key that keeps
//! missing is slowed, look-alikes (case, and O/0 where the pool says so),
//! and every door's redemption audited once and told to the shop. Over
//! AMQP, `code.redeemed` is applied only from the configured broker users.

use std::collections::HashSet;
use std::time::Duration;

use bson::doc;
use futures::TryStreamExt;
use lapin::BasicProperties;
use serde_json::{json, Value};

use crate::api::{json_of, key, order, ApiServer};
use crate::common::*;
use crate::fixtures::*;
use crate::webhooks::{add_endpoint, publisher, verified_by_the_python_library};
use crate::webhooks::{Answer, Receiver};

/// `POST path` with `body` as `key`: status, headers and JSON.
async fn post(
    api: &ApiServer,
    key: &str,
    path: &str,
    body: Value,
) -> (u16, std::collections::HashMap<String, String>, Value) {
    let (status, headers, b) = api.post(path, key, body.to_string().as_bytes()).await;
    (status, headers, json_of(&b))
}

async fn check(api: &ApiServer, key: &str, code: &str) -> (u16, Value) {
    let (s, _, v) = post(api, key, "/v1/codes/check", json!({"code": code})).await;
    (s, v)
}

async fn redeem(api: &ApiServer, key: &str, code: &str, id: &str) -> (u16, Value) {
    let body = json!({"code": code, "redemption_id": id});
    let (s, _, v) = post(api, key, "/v1/codes/redeem", body).await;
    (s, v)
}

/// Places order `id` (one code of `pool`) with `key`; returns its code.
async fn place(api: &ApiServer, key: &str, id: &str, pool: &str) -> Value {
    let (status, _, b) = api.post("/v1/orders", key, &order(id, pool, 1)).await;
    assert_eq!(status, 201, "{}", String::from_utf8_lossy(&b));
    json_of(&b)["codes"][0].clone()
}

/// [`place`]'s code, as text.
async fn placed_code(api: &ApiServer, key: &str, id: &str, pool: &str) -> String {
    let code = place(api, key, id, pool).await;
    code["code"].as_str().expect("a code").to_owned()
}

/// A platform key: `codes:redeem`, of `shop` or of none.
async fn platform_key(env: &TestEnv, name: &str, shop: Option<&str>) -> String {
    let mut args = vec!["api-keys", "create", "--name", name, "--scopes"];
    args.push("codes:redeem");
    if let Some(s) = shop {
        args.extend(["--shop", s]);
    }
    codepool_ok(env, &args).await.trim().to_owned()
}

/// The code document holding `order`'s code.
async fn code_doc(env: &TestEnv, order: &str) -> bson::Document {
    env.coll("codes")
        .find_one(doc! {"order_id": order})
        .await
        .unwrap()
        .expect("the order holds a code")
}

/// The `what` of every audit record of kind `redeem`.
async fn redemptions_audited(env: &TestEnv) -> Vec<String> {
    let docs: Vec<bson::Document> = find_docs(env, "audit", doc! {"kind": "redeem"}).await;
    (docs.iter())
        .map(|d| d.get_str("what").unwrap_or_default().to_owned())
        .collect()
}

/// A problem's body without its request id: what two answers share when
/// they say the same.
fn said(v: &Value) -> Value {
    let mut v = v.clone();
    v.as_object_mut().unwrap().remove("request_id");
    v
}

#[tokio::test]
async fn sixty_four_concurrent_redemptions_of_one_code_give_one_200_and_63_conflicts() {
    let env = TestEnv::with_pools("redeem_race", &[("rr", 10)]).await;
    let shop_backend = key(&env, "backend", "orders:write").await;
    let platform = platform_key(&env, "platform", None).await;
    let api = ApiServer::start(&env, &[]).await;
    let code = placed_code(&api, &shop_backend, "RR-1", "rr").await;

    let tries = (0..64).map(|i| {
        let (api, platform, code) = (&api, &platform, &code);
        async move { redeem(api, platform, code, &format!("red-{i}")).await }
    });
    let answers = futures::future::join_all(tries).await;
    let won: Vec<&Value> = (answers.iter())
        .filter(|(s, _)| *s == 200)
        .map(|(_, v)| v)
        .collect();
    assert_eq!(won.len(), 1, "{answers:?}");
    let at = won[0]["redeemed_at"].as_str().unwrap();
    assert_eq!(won[0]["state"], "used");
    for (status, v) in answers.iter().filter(|(s, _)| *s != 200) {
        assert_eq!(*status, 409, "{v}");
        assert!(
            v["type"].as_str().unwrap().ends_with("already-redeemed"),
            "{v}"
        );
        assert_eq!(v["redeemed_at"], at, "the first redemption's time: {v}");
    }
    let d = code_doc(&env, "RR-1").await;
    assert_eq!(d.get_i32("status").unwrap(), 2);
    assert_eq!(redemptions_audited(&env).await.len(), 1, "one audit record");

    // The winner's id again: the same 200, and nothing else happens.
    let winner = (0..64)
        .find(|i| answers[*i].0 == 200)
        .map(|i| format!("red-{i}"))
        .unwrap();
    let (status, again) = redeem(&api, &platform, &code, &winner).await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(&again, won[0]);
    assert_eq!(redemptions_audited(&env).await.len(), 1);
    // That id on another code is refused, and that code stays issued.
    let other = placed_code(&api, &shop_backend, "RR-2", "rr").await;
    let (status, reused) = redeem(&api, &platform, &other, &winner).await;
    assert_eq!(status, 409, "{reused}");
    assert!(reused["type"]
        .as_str()
        .unwrap()
        .ends_with("conflicting-redemption"));
    assert_eq!(code_doc(&env, "RR-2").await.get_i32("status").unwrap(), 1);
    api.stop().await;
    env.cleanup().await;
}

/// Redemptions sent at once are made in one batch: each still gets its
/// own answer. One id sent twice at once (a client's retry racing the
/// first) is one redemption, answered alike; one id on two codes at once
/// redeems one of them; a void, an unknown and a used code in the same
/// batch are refused as alone; and each redemption made is audited once.
#[tokio::test]
async fn a_batch_of_concurrent_redemptions_answers_each_as_if_alone() {
    let env = TestEnv::with_pools("redeem_batch", &[("rb", 40)]).await;
    let backend = key(&env, "backend", "orders:write").await;
    let platform = platform_key(&env, "platform", None).await;
    let api = ApiServer::start(&env, &[]).await;
    let mut codes = Vec::new();
    for i in 0..28 {
        let code = placed_code(&api, &backend, &format!("RB-{i}"), "rb").await;
        codes.push(code);
    }
    codepool_ok(&env, &["void", "--order", "RB-20", "--reason", "refund"]).await;
    let (status, _) = redeem(&api, &platform, &codes[21], "before").await;
    assert_eq!(status, 200);

    // 0..19: one redemption each, and codes 0..3 once more under the same
    // id; codes 22 and 23 under one id; 20 void, 21 used, and an unknown.
    let mut asks: Vec<(String, String)> = (0..20)
        .map(|i| (codes[i].clone(), format!("id-{i}")))
        .collect();
    asks.extend((0..4).map(|i| (codes[i].clone(), format!("id-{i}"))));
    asks.push((codes[22].clone(), "shared".into()));
    asks.push((codes[23].clone(), "shared".into()));
    asks.push((codes[20].clone(), "on-void".into()));
    asks.push((codes[21].clone(), "on-used".into()));
    asks.push(("RB-NO-SUCH-CODE-0".into(), "on-unknown".into()));
    // 24..27: first under the id that redeemed code 21 (refused), then
    // under a fresh one, which still redeems the code.
    for (i, code) in codes.iter().enumerate().skip(24) {
        asks.push((code.clone(), "before".into()));
        asks.push((code.clone(), format!("fresh-{i}")));
    }
    let tries = asks
        .iter()
        .map(|(code, id)| redeem(&api, &platform, code, id));
    let answers = futures::future::join_all(tries).await;

    for (i, (status, v)) in answers.iter().enumerate().take(20) {
        assert_eq!(*status, 200, "code {i}: {v}");
        assert_eq!(v["state"], "used");
        assert_eq!(
            code_doc(&env, &format!("RB-{i}"))
                .await
                .get_i32("status")
                .unwrap(),
            2
        );
    }
    for i in 0..4 {
        assert_eq!(
            answers[20 + i],
            answers[i],
            "the same id at once is answered alike"
        );
    }
    let shared: Vec<u16> = answers[24..26].iter().map(|(s, _)| *s).collect();
    assert!(
        shared.contains(&200) && shared.contains(&409),
        "{:?}",
        &answers[24..26]
    );
    let loser = &answers[24 + shared.iter().position(|s| *s == 409).unwrap()].1;
    assert!(
        loser["type"]
            .as_str()
            .unwrap()
            .ends_with("conflicting-redemption"),
        "{loser}"
    );
    let statuses = [
        code_doc(&env, "RB-22").await.get_i32("status").unwrap(),
        code_doc(&env, "RB-23").await.get_i32("status").unwrap(),
    ];
    assert_eq!(
        statuses.iter().filter(|s| **s == 2).count(),
        1,
        "{statuses:?}"
    );
    assert_eq!(answers[26].0, 409);
    assert!(answers[26].1["type"].as_str().unwrap().ends_with("/void"));
    assert_eq!(answers[26].1["reason"], "refund");
    assert_eq!(answers[27].0, 409);
    assert!(answers[27].1["type"]
        .as_str()
        .unwrap()
        .ends_with("already-redeemed"));
    assert_eq!(answers[28].0, 404, "{:?}", answers[28]);
    for (k, pair) in answers[29..].chunks(2).enumerate() {
        let (refused, fresh) = (&pair[0], &pair[1]);
        // Refused either way: its id redeemed code 21, and when the fresh
        // one was made first, the code is used.
        assert_eq!(refused.0, 409, "{refused:?}");
        let kind = refused.1["type"].as_str().unwrap();
        assert!(
            kind.ends_with("conflicting-redemption") || kind.ends_with("already-redeemed"),
            "{refused:?}"
        );
        assert_eq!(fresh.0, 200, "code {}: {fresh:?}", 24 + k);
        assert_eq!(fresh.1["state"], "used");
    }
    // The one before, the twenty, one of the two under "shared", and the
    // four fresh ones.
    assert_eq!(redemptions_audited(&env).await.len(), 26);
    api.stop().await;
    env.cleanup().await;
}

/// The same redemption sent four times at once, forty times over, to two
/// API processes: their batches can write the same millisecond, and only
/// the batch whose statement used the code may audit it. (Within one
/// process, a few redemptions wait for the running batch.)
#[tokio::test]
async fn the_same_redemption_at_once_in_two_batches_is_audited_once() {
    let env = TestEnv::with_pools("redeem_twice", &[("rt", 40)]).await;
    let backend = key(&env, "backend", "orders:write").await;
    let platform = platform_key(&env, "platform", None).await;
    let api = ApiServer::start(&env, &[]).await;
    let other = ApiServer::start(&env, &[]).await;
    for i in 0..40 {
        let code = placed_code(&api, &backend, &format!("RT-{i}"), "rt").await;
        let id = format!("twice-{i}");
        let tries = [&api, &other, &api, &other].map(|a| redeem(a, &platform, &code, &id));
        let answers = futures::future::join_all(tries).await;
        for (status, v) in &answers {
            assert_eq!(*status, 200, "round {i}: {v}");
            assert_eq!(v["redeemed_at"], answers[0].1["redeemed_at"], "round {i}");
        }
        assert_eq!(
            redemptions_audited(&env).await.len(),
            i + 1,
            "round {i}: one audit record per redemption made"
        );
    }
    api.stop().await;
    other.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn check_changes_nothing_and_never_shows_the_buyer() {
    let env = TestEnv::with_pools("redeem_check", &[("rc", 10)]).await;
    let backend = key(&env, "backend", "orders:write").await;
    let platform = platform_key(&env, "platform", None).await;
    let api = ApiServer::start(&env, &[]).await;
    let granted = place(&api, &backend, "RC-1", "rc").await;
    let code = granted["code"].as_str().unwrap();
    // What a redemption would change (the SMS fields change on their own:
    // the API publishes the grant's event after its answer).
    let lifecycle = |d: bson::Document| {
        ["status", "used_at", "redemption", "voided_at"].map(|f| d.get(f).cloned())
    };
    let before = lifecycle(code_doc(&env, "RC-1").await);

    for typed in [code.to_owned(), code.to_lowercase()] {
        let (status, seen) = check(&api, &platform, &typed).await;
        assert_eq!(status, 200, "{seen}");
        assert_eq!(seen["state"], "issued");
        assert_eq!(seen["pool"], "rc");
        assert_eq!(seen["grant_no"], granted["grant_no"]);
        let text = seen.to_string();
        for private in ["u-api", "+8613800000000", "RC-1", code] {
            assert!(!text.contains(private), "{private} in {text}");
        }
    }
    assert_eq!(
        lifecycle(code_doc(&env, "RC-1").await),
        before,
        "check changed nothing"
    );
    assert!(redemptions_audited(&env).await.is_empty());

    // Redeemed: check tells when; void after sale: check tells why, and
    // redeem refuses with the reason.
    let (status, used) = redeem(&api, &platform, code, "R-1").await;
    assert_eq!(status, 200, "{used}");
    let (_, seen) = check(&api, &platform, code).await;
    assert_eq!(seen["state"], "used");
    assert_eq!(seen["redeemed_at"], used["redeemed_at"]);
    let voided = placed_code(&api, &backend, "RC-2", "rc").await;
    codepool_ok(&env, &["void", "--order", "RC-2", "--reason", "refund"]).await;
    let (_, seen) = check(&api, &platform, &voided).await;
    assert_eq!(seen["state"], "void");
    assert_eq!(seen["void_reason"], "refund");
    let (status, refused) = redeem(&api, &platform, &voided, "R-2").await;
    assert_eq!(status, 409, "{refused}");
    assert!(refused["type"].as_str().unwrap().ends_with("/void"));
    assert_eq!(refused["reason"], "refund");
    api.stop().await;
    env.cleanup().await;
}

/// Checks sent at once are looked up together: each is answered as if
/// alone, whatever else its batch holds. Issued, used and void codes, an
/// unknown one, and one code asked by two keys (a shop's platform, which
/// may not see it, and the operator's, which may) each get the answer the
/// same check gets alone, and a shop's own sold code is seen by both;
/// nothing changes.
#[tokio::test]
async fn a_batch_of_concurrent_checks_answers_each_as_if_alone() {
    let env = TestEnv::with_pools("check_batch", &[("ca", 20), ("cb", 5)]).await;
    shop(&env, "globex", "cb").await;
    let backend = key(&env, "backend", "orders:write").await;
    let platform = platform_key(&env, "platform", None).await;
    let globex = platform_key(&env, "globex-platform", Some("globex")).await;
    let api = ApiServer::start(&env, &["--redeem-misses-per-minute", "1000"]).await;
    let mut codes = Vec::new();
    for i in 0..12 {
        codes.push(placed_code(&api, &backend, &format!("CA-{i}"), "ca").await);
    }
    codepool_ok(&env, &["void", "--order", "CA-10", "--reason", "refund"]).await;
    let (status, _) = redeem(&api, &platform, &codes[11], "used-11").await;
    assert_eq!(status, 200);
    let mut asks: Vec<(&str, String)> = codes
        .iter()
        .map(|c| (platform.as_str(), c.clone()))
        .collect();
    asks.extend(codes.iter().map(|c| (globex.as_str(), c.clone())));
    asks.extend((0..4).map(|i| (platform.as_str(), format!("CA-NO-SUCH-{i}"))));
    asks.push((platform.as_str(), codes[3].to_uppercase()));
    // Globex's own sold code: both keys see it.
    let globex_shop = shop_key(&env, "globex-1", "globex").await;
    let theirs = placed_code(&api, &globex_shop, "CB-1", "cb").await;
    asks.push((platform.as_str(), theirs.clone()));
    asks.push((globex.as_str(), theirs));
    // What a check could change (the SMS fields change on their own).
    let lifecycle = |docs: Vec<bson::Document>| {
        (docs.into_iter())
            .map(|d| ["status", "used_at", "redemption", "voided_at"].map(|f| d.get(f).cloned()))
            .collect::<Vec<_>>()
    };
    let before = lifecycle(pool_codes(env.store.database(), "ca").await);

    // Four times over at once, so that batches hold many asks each.
    let at_once = (0..4).flat_map(|_| asks.iter().map(|(k, c)| check(&api, k, c)));
    let all = futures::future::join_all(at_once).await;
    let mut alone = Vec::new();
    for (k, c) in &asks {
        alone.push(check(&api, k, c).await);
    }
    let said_all = |answers: &[(u16, Value)]| {
        (answers.iter())
            .map(|(s, v)| (*s, said(v)))
            .collect::<Vec<_>>()
    };
    for together in all.chunks(asks.len()) {
        assert_eq!(
            said_all(together),
            said_all(&alone),
            "answered at once as one at a time"
        );
    }
    let together = &all[..asks.len()];
    for (i, (status, seen)) in together.iter().enumerate().take(12) {
        assert_eq!(*status, 200, "code {i}: {seen}");
        let state = match i {
            10 => "void",
            11 => "used",
            _ => "issued",
        };
        assert_eq!(seen["state"], state, "code {i}: {seen}");
    }
    assert_eq!(together[10].1["void_reason"], "refund");
    let unknown = said(&together[24].1);
    for (status, answer) in &together[12..28] {
        assert_eq!(*status, 404, "{answer}");
        assert_eq!(said(answer), unknown, "one answer for every miss");
    }
    assert_eq!(together[28], together[3], "a look-alike finds its code");
    assert_eq!(together[29].0, 200, "{:?}", together[29]);
    assert_eq!(together[29].1["pool"], "cb");
    assert_eq!(
        together[29], together[30],
        "the shop's key sees its own code"
    );
    assert_eq!(
        lifecycle(pool_codes(env.store.database(), "ca").await),
        before,
        "checks changed nothing"
    );
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn unknown_other_shops_and_unsold_codes_get_one_answer() {
    let env = TestEnv::with_pools("redeem_oracle", &[("oa", 10)]).await;
    let unsold = env.fill_pool("ob", 10).await;
    shop(&env, "acme", "oa").await;
    shop(&env, "globex", "ob").await;
    let acme = shop_key(&env, "acme-1", "acme").await;
    let globex_platform = platform_key(&env, "globex-platform", Some("globex")).await;
    let operator_platform = platform_key(&env, "platform", None).await;
    let api = ApiServer::start(&env, &["--redeem-misses-per-minute", "1000"]).await;
    let acmes = placed_code(&api, &acme, "OA-1", "oa").await;
    // A code held by a checkout hold: never sold either.
    let (status, _, hold) = post(
        &api,
        &acme,
        "/v1/holds",
        json!({"hold_id": "H-1", "uid": "u-1", "items": [{"pool": "oa", "quantity": 1}]}),
    )
    .await;
    assert_eq!(status, 201, "{hold}");
    let held: String = {
        let d = env
            .coll("codes")
            .find_one(doc! {"pool": "oa", "status": 4})
            .await
            .unwrap()
            .expect("a held code");
        env.plain_code(&d)
    };

    let mut answers = Vec::new();
    for code in [acmes.as_str(), "NO-SUCH-CODE-1", &unsold[0], &held] {
        let (s1, c) = check(&api, &globex_platform, code).await;
        let (s2, r) = redeem(&api, &globex_platform, code, "G-1").await;
        assert_eq!((s1, s2), (404, 404), "{code}: {c} {r}");
        answers.push(said(&c));
        answers.push(said(&r));
    }
    assert!(
        answers.windows(2).all(|w| w[0] == w[1]),
        "one answer for all: {answers:?}"
    );
    // The operator's platform key sees every pool: acme's code is there,
    // still unsold codes are not.
    let (status, seen) = check(&api, &operator_platform, &acmes).await;
    assert_eq!(status, 200, "{seen}");
    let (status, _) = check(&api, &operator_platform, &unsold[0]).await;
    assert_eq!(status, 404);
    assert_eq!(code_doc(&env, "OA-1").await.get_i32("status").unwrap(), 1);
    // A key without the scope is refused outright.
    let (status, _) = check(&api, &acme, &acmes).await;
    assert_eq!(status, 403);
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_key_that_keeps_missing_is_slowed_and_counted() {
    let env = TestEnv::with_pools("redeem_misses", &[("rm", 10)]).await;
    let backend = key(&env, "backend", "orders:write").await;
    let guesser = platform_key(&env, "guesser", None).await;
    let honest = platform_key(&env, "honest", None).await;
    let api = ApiServer::start(&env, &["--redeem-misses-per-minute", "5"]).await;
    let code = placed_code(&api, &backend, "RM-1", "rm").await;
    for i in 0..5 {
        let (status, v) = check(&api, &guesser, &format!("GUESS-{i}")).await;
        assert_eq!(status, 404, "{v}");
    }
    let (status, headers, v) = post(
        &api,
        &guesser,
        "/v1/codes/check",
        json!({"code": "GUESS-5"}),
    )
    .await;
    assert_eq!(status, 429, "{v}");
    assert!(v["type"].as_str().unwrap().ends_with("redeem-misses"));
    let wait: u64 = headers["retry-after"].parse().unwrap();
    assert!((1..=60).contains(&wait), "{wait}");
    // Slowed: even a real code is not looked up for this key now.
    let (status, _) = redeem(&api, &guesser, &code, "X-1").await;
    assert_eq!(status, 429);
    assert_eq!(code_doc(&env, "RM-1").await.get_i32("status").unwrap(), 1);
    // Another key is not.
    let (status, v) = check(&api, &honest, &code).await;
    assert_eq!(status, 200, "{v}");
    let misses = metric_sum(
        &[&api.addr],
        "codepool_redeem_misses_total{key=\"guesser\"}",
    )
    .await;
    assert_eq!(misses, 5.0, "the lookups that missed, not the 429s");

    // A burst at once cannot outrun the budget: a lookup reserves its miss
    // before it runs, and the others wait for their turn.
    let burst = platform_key(&env, "burst", None).await;
    let tries = (0..40).map(|i| {
        let (api, burst) = (&api, &burst);
        async move { check(api, burst, &format!("BURST-{i}")).await.0 }
    });
    let statuses = futures::future::join_all(tries).await;
    let looked_up = statuses.iter().filter(|s| **s == 404).count();
    assert!(
        (5..=6).contains(&looked_up),
        "at most the budget looked up: {statuses:?}"
    );
    assert_eq!(
        looked_up + statuses.iter().filter(|s| **s == 429).count(),
        40
    );
    // Spaces and a line end around a real code are not part of it.
    let (status, v) = check(&api, &honest, &format!("  {code}\n")).await;
    assert_eq!(status, 200, "{v}");
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn o_and_zero_are_one_code_only_in_a_pool_that_says_so() {
    let env = TestEnv::new("redeem_fold").await;
    codepool_ok(&env, &["pool", "create", "--pool", "cf"]).await;
    pool_set(&env, "cf", &["--fold-confusables"]).await;
    env.fill_pool("cf", 5).await;
    env.fill_pool("plain", 5).await;
    // Fixed once the pool holds codes.
    let out = env
        .run(&["pool", "set", "--pool", "plain", "--fold-confusables"])
        .await;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--fold-confusables"), "{err}");
    // The value it has already is no change, and is not refused.
    pool_set(&env, "cf", &["--fold-confusables"]).await;
    // An import fixes the rule as it starts: a pool whose first import
    // runs refuses the change even before a code lands.
    codepool_ok(&env, &["pool", "create", "--pool", "fresh"]).await;
    env.store.fix_lookalike_rule("fresh").await.unwrap();
    let out = env
        .run(&["pool", "set", "--pool", "fresh", "--fold-confusables"])
        .await;
    assert!(
        !out.status.success(),
        "the rule is fixed once an import began"
    );

    let backend = key(&env, "backend", "orders:write").await;
    let platform = platform_key(&env, "platform", None).await;
    let api = ApiServer::start(&env, &[]).await;
    assert_eq!(
        place(&api, &backend, "F-1", "cf").await["code"],
        "cf-000001"
    );
    assert_eq!(
        place(&api, &backend, "F-2", "plain").await["code"],
        "plain-000001"
    );
    let (status, v) = check(&api, &platform, "CF-OOOOOl").await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["pool"], "cf");
    let (status, v) = check(&api, &platform, "PLAIN-OOOOO1").await;
    assert_eq!(
        status, 404,
        "O is not 0 in a pool that does not say so: {v}"
    );
    let (status, v) = check(&api, &platform, "PLAIN-000001").await;
    assert_eq!(status, 200, "case folds by default: {v}");
    // The CLI finds a code by value under the same rule.
    codepool_ok(&env, &["redeem", "--pool", "cf", "--code", " CF-OOOOOl "]).await;
    assert_eq!(code_doc(&env, "F-1").await.get_i32("status").unwrap(), 2);
    let out = env
        .run(&["redeem", "--pool", "plain", "--code", "PLAIN-OOOOO1"])
        .await;
    assert!(!out.status.success(), "O is not 0 in pool plain");
    codepool_ok(
        &env,
        &["redeem", "--pool", "plain", "--code", "PLAIN-000001"],
    )
    .await;
    assert_eq!(code_doc(&env, "F-2").await.get_i32("status").unwrap(), 2);
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn every_door_redeems_through_one_function_audited_once_and_told_to_the_shop() {
    let env = TestEnv::with_pools("redeem_doors", &[("rd", 20)]).await;
    shop(&env, "acme", "rd").await;
    let receiver = Receiver::start(Answer::Ok).await;
    let (_, secret) = add_endpoint(&env, "acme", &receiver.url(), "code.redeemed").await;
    let acme = shop_key(&env, "acme-1", "acme").await;
    let platform = platform_key(&env, "acme-platform", Some("acme")).await;
    let daemon = start_daemon(env.command(&[])).await;
    let api = ApiServer::start(&env, &[]).await;
    let mut codes = Vec::new();
    for order in ["D-HTTP-CODE", "D-HTTP-ORDER", "D-AMQP-CODE", "D-AMQP-ORDER"] {
        codes.push(place(&api, &acme, order, "rd").await["code"].clone());
    }
    // Each door twice: the second changes nothing.
    for _ in 0..2 {
        let (status, v) = redeem(&api, &platform, codes[0].as_str().unwrap(), "P-1").await;
        assert_eq!(status, 200, "{v}");
        let (status, _, _) = api.post("/v1/orders/D-HTTP-ORDER/redeem", &acme, b"").await;
        assert!(status == 200 || status == 409, "{status}");
    }
    let (conn, publisher) = publisher(&env).await;
    let events = env.topology().events_exchange;
    // The platform's event names the code as the buyer typed it: case
    // folds, as in the pool's own look-alike rule.
    let typed = codes[2].as_str().unwrap().to_uppercase();
    for body in [
        json!({"pool": "rd", "code": typed}),
        json!({"order_id": "D-AMQP-ORDER"}),
        json!({"pool": "rd", "code": typed}),
        json!({"order_id": "D-AMQP-ORDER"}),
    ] {
        let (body, guest) = (
            body.to_string(),
            BasicProperties::default().with_user_id("guest".into()),
        );
        publish_to(&publisher, &events, "code.redeemed", body.as_bytes(), guest).await;
    }
    eventually(Duration::from_secs(30), "four codes used", || async {
        let mut used = 0;
        for order in ["D-HTTP-CODE", "D-HTTP-ORDER", "D-AMQP-CODE", "D-AMQP-ORDER"] {
            used += (code_doc(&env, order).await.get_i32("status").unwrap() == 2) as u32;
        }
        used == 4
    })
    .await;
    eventually(Duration::from_secs(30), "four code.redeemed", || async {
        let ids: HashSet<String> = (receiver.of_type("code.redeemed").iter())
            .map(|h| h.id.clone())
            .collect();
        ids.len() == 4
    })
    .await;
    // The AMQP repeats were consumed (as duplicates) before counting.
    eventually(Duration::from_secs(30), "two AMQP repeats", || async {
        let line = "codepool_redemptions_total{result=\"duplicate\"}";
        metric_sum(&[&daemon.addr], line).await >= 2.0
    })
    .await;
    let audited = redemptions_audited(&env).await;
    assert_eq!(audited.len(), 4, "one record per redemption: {audited:?}");
    let hit = receiver.of_type("code.redeemed").remove(0);
    verified_by_the_python_library(&secret, &hit)
        .await
        .unwrap_or_else(|e| panic!("standardwebhooks refused the signature: {e}"));
    crate::schemas::Schema::load("webhook-event")
        .assert_valid(hit.body.as_bytes(), "code.redeemed");
    for code in &codes {
        assert!(
            !hit.body.contains(code.as_str().unwrap()),
            "no code in a webhook"
        );
    }
    let orders: HashSet<String> = (receiver.of_type("code.redeemed").iter())
        .map(|h| h.json()["data"]["order_id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(orders.len(), 4, "{orders:?}");
    let _ = conn.close(200, "bye").await;
    api.stop().await;
    daemon.stop().await;
    env.cleanup().await;
}

/// A batch of lookups, each naming one pool, of codes that sit in all of
/// ten pools (imported with `--allow-cross-pool`): each lookup finds its
/// own pool's code. A batch query that looked for every code in every
/// pool of the batch found ten documents per code against a limit of
/// eight per lookup, and lookups lost their code at random.
#[tokio::test]
async fn a_batch_finds_each_code_in_its_own_pool_when_the_code_sits_in_many() {
    use codepool_domain::LookAlikeRule;
    use codepool_store::redemptions::ByValue;

    let env = TestEnv::new("redeem_many_pools").await;
    let pools: Vec<String> = (0..10).map(|p| format!("mp{p}")).collect();
    let codes: Vec<String> = (0..40).map(|i| format!("MANY-POOLS-{i:03}")).collect();
    for pool in &pools {
        let codes: Vec<&str> = codes.iter().map(String::as_str).collect();
        sold_codes(&env, pool, &codes).await;
    }
    let names: Vec<Vec<(String, LookAlikeRule)>> = (0..codes.len())
        .map(|i| vec![(pools[i % pools.len()].clone(), LookAlikeRule::default())])
        .collect();
    let asks: Vec<ByValue<'_>> = (codes.iter().zip(&names))
        .map(|(code, pools)| ByValue { code, pools })
        .collect();
    let found = env.store.find_sold_by_values(&asks).await.unwrap();
    for (i, sold) in found.iter().enumerate() {
        let sold = sold
            .as_ref()
            .unwrap_or_else(|| panic!("lookup {i} lost its code"));
        assert_eq!(sold.pool, pools[i % pools.len()], "lookup {i}");
    }
    env.cleanup().await;
}

/// One batch in which one redemption id names two codes: the batch's one
/// statement for all its codes stops at the unique index part done (the
/// codes before the refused one, in `_id` order, are used), and the
/// statements per code that follow name the refused one. Each ask is
/// answered once: the lone id's and one of the shared id's made now, the
/// other conflicting; asked again, the made ones are answered as before.
#[tokio::test]
async fn a_batch_stopped_by_a_shared_redemption_id_answers_every_code_once() {
    use codepool_domain::LookAlikeRule;
    use codepool_store::lifecycle::RedemptionTag;
    use codepool_store::redemptions::{ByValue, UsedById};

    let env = TestEnv::new("redeem_shared_id").await;
    let pool = "sh";
    let codes = ["SHARED-A", "SHARED-B", "SHARED-C"];
    sold_codes(&env, pool, &codes).await;
    let rule = vec![(pool.to_owned(), LookAlikeRule::default())];
    let asks: Vec<ByValue<'_>> = (codes.iter())
        .map(|code| ByValue { code, pools: &rule })
        .collect();
    let found = env.store.find_sold_codes(&asks).await.unwrap();
    let code = |i: usize| &found[i].as_ref().expect("sold").1;
    // In `_id` order A < B < C: A and B are used before C is refused.
    assert!(code(0).id < code(1).id && code(1).id < code(2).id);
    let tag = |id: &str| RedemptionTag {
        id: id.to_owned(),
        by: "platform".to_owned(),
    };
    let batch = vec![
        (code(2), tag("shared")),
        (code(0), tag("lone")),
        (code(1), tag("shared")),
    ];
    let done = env.store.redeem_ids(&batch).await.unwrap();
    assert!(matches!(done[1], UsedById::Now(_)), "{:?}", done[1]);
    assert!(
        matches!(
            (&done[0], &done[2]),
            (UsedById::Conflicting, UsedById::Now(_)) | (UsedById::Now(_), UsedById::Conflicting)
        ),
        "{done:?}"
    );
    let status = |d: &bson::Document| d.get_i32("status").unwrap();
    let now = pool_codes(env.store.database(), pool).await;
    let used: Vec<i32> = now.iter().map(status).collect();
    assert_eq!(used.iter().filter(|s| **s == 2).count(), 2, "{used:?}");
    assert_eq!(used[0], 2, "the lone id's code is used");
    // Asked again: the made ones as before, the refused one still refused.
    let again = env.store.redeem_ids(&batch).await.unwrap();
    assert!(matches!(again[1], UsedById::Before(_)), "{:?}", again[1]);
    let winner = usize::from(matches!(done[0], UsedById::Conflicting)) * 2;
    let loser = 2 - winner;
    assert!(
        matches!(again[winner], UsedById::Before(_)),
        "{:?}",
        again[winner]
    );
    assert!(
        matches!(again[loser], UsedById::Conflicting),
        "{:?}",
        again[loser]
    );
    env.cleanup().await;
}

/// Inserts `codes` into `pool` and marks them sold, as a grant leaves
/// them: issued to orders of the pool, one each, in `_id` order.
async fn sold_codes(env: &TestEnv, pool: &str, codes: &[&str]) {
    use codepool_store::NewCode;

    env.store.ensure_pool(pool).await.unwrap();
    let new: Vec<NewCode> = (codes.iter())
        .map(|c| NewCode {
            code: (*c).to_owned(),
            line: None,
            expires_at: None,
        })
        .collect();
    let batch = bson::oid::ObjectId::new();
    let out = env.store.insert_codes(pool, batch, &new).await.unwrap();
    assert_eq!(out.inserted, codes.len() as u64);
    let coll = env.coll("codes");
    let docs = pool_codes(env.store.database(), pool).await;
    for (k, d) in docs.iter().enumerate() {
        let set = doc! {"status": 1, "order_id": format!("{pool}-O{k}"), "order_line": 0,
        "uid": format!("{pool}-U{k}"), "issued_at": bson::DateTime::now(), "grant_no": format!("{pool}-G{k}")};
        let id = d.get_object_id("_id").unwrap();
        coll.update_one(doc! {"_id": id}, doc! {"$set": set})
            .await
            .unwrap();
    }
}

/// Every code document of `pool`, in `_id` order.
async fn pool_codes(db: &mongodb::Database, pool: &str) -> Vec<bson::Document> {
    let coll = db.collection::<bson::Document>("codes");
    (coll.find(doc! {"pool": pool}).sort(doc! {"_id": 1}))
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap()
}

/// A purchase producer cannot mark an order used (and so block its
/// refund): `code.redeemed` is applied only from the broker users named by
/// `--redeemers`, checked through RabbitMQ's validated `user_id`, and each
/// redemption applied is audited with that user.
#[tokio::test]
async fn only_the_configured_broker_user_redeems_and_each_redemption_is_audited() {
    let env = TestEnv::with_pools("redeem_redeem", &[("red", 5)]).await;
    let mut cmd = env.command(&[]);
    cmd.env("CODEPOOL_REDEEMERS", "platform");
    let daemon = start_daemon(cmd).await;
    let (_conn, publisher) = env.amqp().await;
    publish_confirmed(&publisher, &[purchase("RD-1", "red")]).await;
    eventually(Duration::from_secs(30), "RD-1 granted", || async {
        order_statuses(&env, "RD-1").await == vec![1]
    })
    .await;
    // The shop's producer (guest): without user_id, and as itself.
    publish_redeemed(&publisher, &env, "RD-1", None).await;
    publish_redeemed(&publisher, &env, "RD-1", Some("guest")).await;
    eventually(Duration::from_secs(30), "both events refused", || async {
        (daemon.log_text())
            .matches("code.redeemed event refused")
            .count()
            == 2
    })
    .await;
    assert_eq!(order_statuses(&env, "RD-1").await, vec![1], "still issued");
    daemon.stop().await;

    // The platform's user may.
    let daemon = start_daemon(env.command(&[])).await;
    publish_redeemed(&publisher, &env, "RD-1", Some("guest")).await;
    eventually(Duration::from_secs(30), "RD-1 used", || async {
        order_statuses(&env, "RD-1").await == vec![2]
    })
    .await;
    // The record follows the redemption's own write.
    let audit = env.coll("audit");
    let by_guest = bson::doc! {"os_user": "amqp-user:guest", "kind": "redeem"};
    eventually(
        Duration::from_secs(10),
        "the redemption is audited with the broker user",
        || {
            let (audit, by_guest) = (audit.clone(), by_guest.clone());
            async move { audit.find_one(by_guest).await.unwrap().is_some() }
        },
    )
    .await;
    let record = audit.find_one(by_guest).await.unwrap().unwrap();
    assert!(record.get_str("what").unwrap().contains("RD-1"));
    daemon.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_code_voided_while_held_answers_like_an_unknown_one_and_spends_a_miss() {
    let env = TestEnv::new("redeem_held_void").await;
    let codes: Vec<String> = (0..4).map(|i| format!("HV-{i:04}")).collect();
    let run = import_codes(&env, "hv", &codes).await;
    pool_set(&env, "hv", &["--hold-share", "100"]).await;
    let backend = key(&env, "backend", "orders:write,orders:read").await;
    let platform = platform_key(&env, "platform", None).await;
    let api = ApiServer::start(&env, &["--redeem-misses-per-minute", "3"]).await;
    let (status, _, b) = post(
        &api,
        &backend,
        "/v1/holds",
        json!({"hold_id": "H-hv", "uid": "u-hv", "items": [{"pool": "hv", "quantity": 2}]}),
    )
    .await;
    assert_eq!(status, 201, "{b}");
    let held: Vec<bson::Document> =
        find_docs(&env, "codes", doc! {"pool": "hv", "status": 4}).await;
    assert_eq!(held.len(), 2);
    // One held code expires while held, the other is recalled with its file.
    let past = bson::DateTime::from_millis(bson::DateTime::now().timestamp_millis() - 1000);
    env.coll("codes")
        .update_one(
            doc! {"_id": held[0].get_object_id("_id").unwrap()},
            doc! {"$set": {"expires_at": past}},
        )
        .await
        .unwrap();
    codepool_ok(&env, &["expire", "--pool", "hv"]).await;
    codepool_ok(&env, &["void", "--import", &run, "--reason", "leak"]).await;
    // Each looks exactly like a code voided in stock: no order, no grant
    // number, no time it was issued.
    for d in &held {
        let now = env
            .coll("codes")
            .find_one(doc! {"_id": d.get_object_id("_id").unwrap()})
            .await
            .unwrap()
            .unwrap();
        assert_eq!(now.get_i32("status").unwrap(), 3, "{now}");
        for field in [
            "order_id",
            "grant_no",
            "issued_at",
            "uid",
            "order_line",
            "owner",
        ] {
            assert!(!now.contains_key(field), "{field} left on {now}");
        }
    }
    // Answered as a code no pool holds, from check and redeem alike, and
    // each answer spends a miss.
    let (_, unknown) = check(&api, &platform, "NO-SUCH-CODE").await;
    for d in &held {
        let code = env.plain_code(d);
        let (status, c) = check(&api, &platform, &code).await;
        assert_eq!(status, 404, "{code}: {c}");
        assert_eq!(said(&c), said(&unknown));
    }
    let (status, r) = redeem(&api, &platform, &env.plain_code(&held[0]), "R-hv").await;
    assert_eq!(status, 429, "three misses spent the budget of 3: {r}");
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_strangers_misses_never_slow_another_end_user_of_the_platform() {
    let env = TestEnv::with_pools("redeem_end_users", &[("eu", 10)]).await;
    let backend = key(&env, "backend", "orders:write").await;
    let platform = platform_key(&env, "platform", None).await;
    let api = ApiServer::start(&env, &["--redeem-misses-per-minute", "3"]).await;
    let code = placed_code(&api, &backend, "EU-1", "eu").await;
    let as_user = |user: &str, code: &str| json!({"code": code, "end_user": user});
    // The stranger at the activation page spends his own budget.
    for i in 0..3 {
        let (s, _, v) = post(
            &api,
            &platform,
            "/v1/codes/check",
            as_user("203.0.113.9", &format!("GUESS-{i}")),
        )
        .await;
        assert_eq!(s, 404, "{v}");
    }
    let (s, h, v) = post(
        &api,
        &platform,
        "/v1/codes/check",
        as_user("203.0.113.9", "GUESS-3"),
    )
    .await;
    assert_eq!(s, 429, "{v}");
    assert!(h.contains_key("retry-after"));
    // The buyer behind him is not slowed, nor is the key's own budget.
    let (s, _, v) = post(
        &api,
        &platform,
        "/v1/codes/check",
        as_user("198.51.100.7", &code),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    let body = json!({"code": code, "redemption_id": "R-eu", "end_user": "198.51.100.7"});
    let (s, _, v) = post(&api, &platform, "/v1/codes/redeem", body).await;
    assert_eq!(s, 200, "{v}");
    let (s, v) = check(&api, &platform, &code).await;
    assert_eq!(s, 200, "{v}");
    // An end user that is no readable text is refused, naming the field.
    let (s, _, v) = post(&api, &platform, "/v1/codes/check", as_user("", &code)).await;
    assert_eq!(s, 422, "{v}");
    assert_eq!(v["field"], "end_user", "{v}");
    api.stop().await;
    env.cleanup().await;
}
