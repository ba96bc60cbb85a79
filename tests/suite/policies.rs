//! Pool policies and controls against the real servers: the per-user limit
//! across two dispatcher processes with redeliveries, pause and resume,
//! and recalling an import while purchases are being dispatched; orders
//! voided while their paused pool resumes keep no live code.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use bson::doc;
use codepool_domain::{PoolEvent, PoolEventKind, Purchase, PurchaseRefused, SmsPending};
use futures::StreamExt;

use crate::common::*;
use crate::fixtures::*;

fn of_user(order: &str, pool: &str, uid: &str) -> Purchase {
    Purchase {
        uid: uid.to_owned(),
        ..purchase(order, pool)
    }
}

#[tokio::test]
async fn a_per_user_limit_is_exact_across_two_dispatchers_with_redeliveries() {
    let env = TestEnv::with_pools("policies_per_user", &[("one", 100), ("three", 100)]).await;
    pool_set(&env, "one", &["--per-user", "1"]).await;
    pool_set(&env, "three", &["--per-user", "3"]).await;
    let a = start_daemon(env.command(&[])).await;
    let b = start_daemon(env.command(&[])).await;

    // 30 orders of one user per pool at once, and every tenth order twice
    // (a redelivery), interleaved so both dispatchers see both pools.
    let (conn, publisher) = env.amqp().await;
    let mut orders = Vec::new();
    for i in 0..30 {
        orders.push(of_user(&format!("ONE-{i:02}"), "one", "buyer-1"));
        orders.push(of_user(&format!("THREE-{i:02}"), "three", "buyer-1"));
    }
    let repeats: Vec<Purchase> = orders.iter().step_by(10).cloned().collect();
    let mut confirms = Vec::new();
    for p in orders.iter().chain(&repeats) {
        confirms.push(publisher.publish_purchase(p).await.unwrap());
    }
    for c in confirms {
        c.wait().await.unwrap();
    }

    let ch = conn.create_channel().await.unwrap();
    let t = env.topology();
    let deliveries = (orders.len() + repeats.len()) as u32;
    eventually(Duration::from_secs(60), "every delivery settled", || {
        let (ch, t) = (ch.clone(), t.clone());
        async move {
            let settled = queue_depth(&ch, &t.sms_pending).await
                + queue_depth(&ch, &t.purchases_refused).await;
            settled >= deliveries && queue_depth(&ch, &t.purchases).await == 0
        }
    })
    .await;

    for (pool, limit) in [("one", 1u64), ("three", 3)] {
        let granted = count_docs(&env, "codes", doc! {"pool": pool, "uid": "buyer-1"}).await;
        let refused = count_docs(&env, "refusals", doc! {"pool": pool, "uid": "buyer-1"}).await;
        assert_eq!(granted, limit, "pool {pool}: exactly {limit} grant(s)");
        assert_eq!(refused, 30 - limit, "pool {pool}: the rest refused");
    }
    assert_eq!(count_docs(&env, "backorders", doc! {}).await, 0);
    assert_eq!(
        queue_depth(&ch, &t.purchases_dead).await,
        0,
        "a refusal is not a dead letter"
    );

    // The events: one per refused delivery, every refused order, the same
    // event again for a redelivery; never for an order that got a code.
    let refused_events = drain(&ch, &t.purchases_refused).await;
    let sms = drain(&ch, &t.sms_pending).await;
    let granted: HashSet<String> = sms
        .iter()
        .map(|m| {
            serde_json::from_slice::<SmsPending>(&m.body)
                .unwrap()
                .order_id
        })
        .collect();
    assert_eq!(granted.len(), 4);
    let mut refused_orders: HashMap<String, String> = HashMap::new();
    for m in &refused_events {
        let e: PurchaseRefused = serde_json::from_slice(&m.body).unwrap();
        assert_eq!(e.reason.as_str(), "per_user_limit");
        assert_eq!(e.uid, "buyer-1");
        assert_eq!(m.message_id.as_deref(), Some(e.event_id.as_str()));
        assert!(
            !granted.contains(&e.order_id),
            "{} both granted and refused",
            e.order_id
        );
        let before = refused_orders.insert(e.order_id.clone(), e.refused_at.clone());
        assert!(
            before.is_none_or(|at| at == e.refused_at),
            "a redelivery is refused the same way"
        );
    }
    assert_eq!(refused_orders.len(), 29 + 27);
    assert_eq!(refused_events.len() + sms.len(), deliveries as usize);
    assert_eq!(
        metric_sum(
            &[&a.addr, &b.addr],
            "codepool_refusals_total{reason=\"per_user_limit\"}"
        )
        .await,
        56.0
    );

    // `lookup --order` tells the operator why an order got nothing.
    let refused_order = refused_orders.keys().next().unwrap().clone();
    let out = codepool_ok(&env, &["lookup", "--order", &refused_order, "--json"]).await;
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["refusals"][0]["reason"], "per_user_limit");
    assert_eq!(v["codes"].as_array().map(Vec::len), Some(0));

    // A voided grant still counts: the buyer of pool "one" stays at its limit.
    let holder = granted
        .iter()
        .find(|o| o.starts_with("ONE-"))
        .unwrap()
        .clone();
    codepool_ok(&env, &["void", "--order", &holder, "--reason", "refund"]).await;
    publish_confirmed(&publisher, &[of_user("ONE-LATE", "one", "buyer-1")]).await;
    eventually(
        Duration::from_secs(20),
        "the late order refused",
        || async { count_docs(&env, "refusals", doc! {"_id": "ONE-LATE"}).await == 1 },
    )
    .await;

    a.stop().await;
    b.stop().await;
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_paused_pool_holds_purchases_as_backorders_and_resume_fulfils_the_oldest_first() {
    let env = TestEnv::with_pools("policies_pause", &[("p", 3)]).await;
    let daemon = start_daemon(env.command(&[])).await;
    let (conn, publisher) = env.amqp().await;
    let t = env.topology();
    let mut paused_events = codepool_broker::subscribe(&conn, &t.events_exchange, "pool.paused")
        .await
        .unwrap()
        .consumer;
    let mut resumed_events = codepool_broker::subscribe(&conn, &t.events_exchange, "pool.resumed")
        .await
        .unwrap()
        .consumer;

    // One grant first, so the dispatcher has the pool's policy cached.
    publish_confirmed(&publisher, &[purchase("P-FIRST", "p")]).await;
    eventually(Duration::from_secs(20), "the first grant", || async {
        count_docs(&env, "codes", doc! {"pool": "p", "status": 1}).await == 1
    })
    .await;

    codepool_ok(&env, &["pool", "pause", "--pool", "p"]).await;
    let ev = tokio::time::timeout(Duration::from_secs(5), paused_events.next())
        .await
        .expect("pool.paused published")
        .unwrap()
        .unwrap();
    let ev: PoolEvent = serde_json::from_slice(&ev.data).unwrap();
    assert_eq!((ev.event.as_str(), ev.pool.as_str()), ("pool.paused", "p"));
    let shown = codepool_ok(&env, &["pool", "show", "--pool", "p", "--json"]).await;
    assert!(shown.contains(r#""paused": true"#), "{shown}");
    let stats = codepool_ok(&env, &["stats", "--pool", "p", "--json"]).await;
    assert!(stats.contains(r#""paused": true"#), "{stats}");

    // A dispatcher sees the pause within a second.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let waiting: Vec<_> = (0..6).map(|i| purchase(&format!("P-{i}"), "p")).collect();
    publish_confirmed(&publisher, &waiting).await;
    eventually(Duration::from_secs(20), "6 backorders", || async {
        count_docs(&env, "backorders", doc! {"pool": "p", "status": "waiting"}).await == 6
    })
    .await;
    // Stock news must not fulfil them while paused (the pool has 2 codes):
    // dispatchers fulfil on pool.replenished, and must skip a paused pool.
    publish_pool_event(&publisher, &PoolEvent::new(PoolEventKind::Replenished, "p")).await;
    pool_events_handled(&env, &publisher, PoolEventKind::Replenished).await;
    assert_eq!(
        count_docs(&env, "codes", doc! {"pool": "p", "status": 1}).await,
        1,
        "nothing issued while paused"
    );
    let ch = conn.create_channel().await.unwrap();
    assert_eq!(
        queue_depth(&ch, &t.purchases_dead).await,
        0,
        "not dead-lettered"
    );

    codepool_ok(&env, &["pool", "resume", "--pool", "p"]).await;
    tokio::time::timeout(Duration::from_secs(5), resumed_events.next())
        .await
        .expect("pool.resumed published");
    eventually(
        Duration::from_secs(20),
        "2 backorders fulfilled",
        || async {
            count_docs(
                &env,
                "backorders",
                doc! {"pool": "p", "status": "fulfilled"},
            )
            .await
                == 2
        },
    )
    .await;
    // Oldest first: the two fulfilled are the first two recorded.
    let backorders = env.store.waiting_backorders("p", 10).await.unwrap();
    assert_eq!(backorders.len(), 4, "no stock for the rest");
    let all: Vec<bson::Document> = env
        .coll("backorders")
        .find(doc! {"pool": "p"})
        .sort(doc! {"created_at": 1, "_id": 1})
        .await
        .unwrap()
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let statuses: Vec<&str> = all.iter().map(|d| d.get_str("status").unwrap()).collect();
    assert_eq!(
        statuses,
        [
            "fulfilled",
            "fulfilled",
            "waiting",
            "waiting",
            "waiting",
            "waiting"
        ]
    );

    daemon.stop().await;
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_recall_racing_with_dispatch_voids_or_leaves_issued_each_code_never_both() {
    let env = TestEnv::new("policies_recall").await;
    let mut f = tempfile::NamedTempFile::new().unwrap();
    {
        use std::io::Write;
        writeln!(f, "code").unwrap();
        for i in 0..1000 {
            writeln!(f, "RECALL-{i:05}").unwrap();
        }
    }
    let out = codepool_ok(
        &env,
        &[
            "import",
            f.path().to_str().unwrap(),
            "--pool",
            "r",
            "--json",
        ],
    )
    .await;
    let summary: serde_json::Value = serde_json::from_str(&out).unwrap();
    let import_id = summary["import_id"].as_str().unwrap().to_owned();
    let a = start_daemon(env.command(&[])).await;
    let b = start_daemon(env.command(&[])).await;

    let (conn, publisher) = env.amqp().await;
    let orders: Vec<_> = (0..800)
        .map(|i| purchase(&format!("R-{i:04}"), "r"))
        .collect();
    // Published over about six seconds, so that the recall (a CLI
    // process) lands while dispatch is under way even on a busy machine.
    let publishing = {
        let (publisher, orders) = (publisher.clone(), orders.clone());
        tokio::spawn(async move {
            for chunk in orders.chunks(50) {
                publish_confirmed(&publisher, chunk).await;
                tokio::time::sleep(Duration::from_millis(400)).await;
            }
        })
    };
    eventually(Duration::from_secs(30), "dispatch under way", || async {
        count_docs(&env, "codes", doc! {"pool": "r", "status": 1}).await >= 50
    })
    .await;
    let out = codepool_ok(
        &env,
        &[
            "void",
            "--import",
            &import_id,
            "--reason",
            "partner leak",
            "--json",
        ],
    )
    .await;
    let recall: serde_json::Value = serde_json::from_str(&out).unwrap();
    publishing.await.unwrap();

    let ch = conn.create_channel().await.unwrap();
    let t = env.topology();
    let started = std::time::Instant::now();
    loop {
        let granted = count_docs(
            &env,
            "codes",
            doc! {"pool": "r", "order_id": {"$exists": true}},
        )
        .await;
        let waiting = count_docs(&env, "backorders", doc! {"pool": "r", "status": "waiting"}).await;
        if granted + waiting == 800 && queue_depth(&ch, &t.purchases).await == 0 {
            break;
        }
        if started.elapsed() > Duration::from_secs(60) {
            let logs = format!("{}\n----\n{}", a.log_text(), b.log_text());
            let bad: Vec<&str> = logs.lines().filter(|l| !l.contains(" INFO ")).collect();
            panic!(
                "DEBUG granted {granted} waiting {waiting}; logs:\n{}",
                bad.join("\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let issued = count_docs(&env, "codes", doc! {"pool": "r", "status": 1}).await;
    let void = count_docs(&env, "codes", doc! {"pool": "r", "status": 3}).await;
    assert_eq!(
        count_docs(&env, "codes", doc! {"pool": "r", "status": 0}).await,
        0
    );
    assert_eq!(issued + void, 1000, "every code issued or voided");
    assert!(
        (50..800).contains(&issued),
        "the recall raced with dispatch ({issued} issued)"
    );
    assert_eq!(
        count_docs(
            &env,
            "codes",
            doc! {"pool": "r", "status": 3, "order_id": {"$exists": true}}
        )
        .await,
        0,
        "no voided code was ever issued"
    );
    // What the recall reported is exactly what happened: after it, no
    // code of the import could be issued any more.
    assert_eq!(recall["voided"].as_u64(), Some(void));
    assert_eq!(recall["issued"].as_u64(), Some(issued));
    let listed = recall["held"].as_array().unwrap();
    assert!(
        listed
            .iter()
            .all(|h| h["code"].as_str().unwrap().contains('*')),
        "codes masked"
    );
    assert!(listed.iter().all(|h| h["order_id"].is_string()));

    // Every SMS event carries an issued code.
    let events = drain(&ch, &t.sms_pending).await;
    let grants = env
        .store
        .grants_for_orders(
            &orders
                .iter()
                .map(|p| p.order_id.as_str())
                .collect::<Vec<_>>(),
        )
        .await
        .unwrap()
        .line0();
    assert_eq!(grants.len() as u64, issued);
    for e in &events {
        let ev: SmsPending = serde_json::from_slice(&e.body).unwrap();
        assert_eq!(Some(&grants[&ev.order_id].code), ev.code.as_ref());
    }

    // Running it again voids nothing more.
    let again = codepool_ok(
        &env,
        &[
            "void", "--import", &import_id, "--reason", "again", "--json",
        ],
    )
    .await;
    let again: serde_json::Value = serde_json::from_str(&again).unwrap();
    assert_eq!(again["voided"].as_u64(), Some(0));

    a.stop().await;
    b.stop().await;
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}

#[tokio::test]
async fn backorders_waiting_when_a_limit_is_set_are_held_to_it_when_stock_arrives() {
    let env = TestEnv::new("policies_backorder_limit").await;
    codepool_ok(&env, &["pool", "create", "--pool", "late"]).await;
    let daemon = start_daemon(env.command(&[])).await;
    let (conn, publisher) = env.amqp().await;
    let orders: Vec<_> = (0..3)
        .map(|i| of_user(&format!("L-{i}"), "late", "buyer-9"))
        .collect();
    publish_confirmed(&publisher, &orders).await;
    eventually(Duration::from_secs(20), "3 backorders", || async {
        count_docs(
            &env,
            "backorders",
            doc! {"pool": "late", "status": "waiting"},
        )
        .await
            == 3
    })
    .await;

    pool_set(&env, "late", &["--per-user", "1"]).await;
    let mut f = tempfile::NamedTempFile::new().unwrap();
    {
        use std::io::Write;
        writeln!(f, "code\nLATE-1\nLATE-2\nLATE-3\nLATE-4").unwrap();
    }
    codepool_ok(
        &env,
        &["import", f.path().to_str().unwrap(), "--pool", "late"],
    )
    .await;
    eventually(
        Duration::from_secs(30),
        "1 fulfilled, 2 refused",
        || async {
            count_docs(
                &env,
                "backorders",
                doc! {"pool": "late", "status": "fulfilled"},
            )
            .await
                == 1
                && count_docs(
                    &env,
                    "backorders",
                    doc! {"pool": "late", "status": "refused"},
                )
                .await
                    == 2
        },
    )
    .await;
    assert_eq!(count_docs(&env, "codes", doc! {"uid": "buyer-9"}).await, 1);
    assert_eq!(
        count_docs(&env, "refusals", doc! {"uid": "buyer-9"}).await,
        2
    );
    let ch = conn.create_channel().await.unwrap();
    let refused = drain(&ch, &env.topology().purchases_refused).await;
    assert_eq!(refused.len(), 2);

    daemon.stop().await;
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}

/// Pauses `pool` directly in MongoDB, behind the policy cache's back.
async fn pause_behind_the_cache(env: &TestEnv, pool: &str) {
    env.coll("pools")
        .update_one(doc! {"_id": pool}, doc! {"$set": {"paused": true}})
        .await
        .expect("pause");
}

#[tokio::test]
async fn a_recall_walks_its_import_once_in_rounds_past_the_codes_handed_out() {
    let env = TestEnv::with_pools("policies_recall_rounds", &[("rw", 23), ("other", 5)]).await;
    let store = &env.store;
    let codes = store.database().collection::<bson::Document>("codes");
    let of_rw = codes.find_one(doc! {"pool": "rw"}).await.unwrap().unwrap();
    let batch = of_rw.get_object_id("batch_id").unwrap();
    // Hand out eight codes spread over the import, so rounds read past them.
    let candidates = store.candidates_after("rw", 0, 23).await.unwrap();
    let held: Vec<_> = candidates.iter().step_by(3).map(|(id, _)| *id).collect();
    let assignments: Vec<_> = held
        .iter()
        .enumerate()
        .map(|(i, id)| assign(*id, "rw", &format!("W-{i}")))
        .collect();
    let write = store.claim_candidates(&assignments).await.unwrap();
    assert!(write.order_taken.is_empty());
    assert_eq!(held.len(), 8);

    // Rounds of 4: 15 unissued codes take 4 rounds, each after the last.
    let (mut after, mut seen, mut voided, mut rounds) = (None, Vec::new(), 0, 0);
    loop {
        let round = store.recall_round(batch, "leak", 4, after).await.unwrap();
        rounds += 1;
        assert!(round.seen.iter().all(|(pool, _)| pool == "rw"));
        voided += round.voided;
        seen.extend(round.seen.into_iter().map(|(_, id)| id));
        after = round.next;
        if after.is_none() {
            break;
        }
        assert!(rounds < 10, "the walk ends");
    }
    assert_eq!(rounds, 4);
    assert_eq!(voided, 15);
    let distinct: HashSet<_> = seen.iter().collect();
    assert_eq!(distinct.len(), 15, "each code seen once");
    assert!(held.iter().all(|id| !distinct.contains(id)));
    assert_eq!(
        count_docs(&env, "codes", doc! {"pool": "rw", "status": 3}).await,
        15
    );
    assert_eq!(
        count_docs(&env, "codes", doc! {"pool": "rw", "status": 1}).await,
        8
    );
    assert_eq!(
        count_docs(&env, "codes", doc! {"pool": "other", "status": 0}).await,
        5
    );
    // A second walk finds nothing left, and the held codes are listed.
    let again = store.recall_round(batch, "leak", 4, None).await.unwrap();
    assert_eq!((again.seen.len(), again.voided, again.next), (0, 0, None));
    assert_eq!(store.held_codes_of_import(batch).await.unwrap().len(), 8);
    env.cleanup().await;
}

#[tokio::test]
async fn the_policy_cache_reads_a_small_catalogue_whole_and_names_pools_in_a_large_one() {
    use codepool_issuance::policy::PolicyCache;
    let env = TestEnv::new("policies_catalogue").await;
    for pool in ["a", "b"] {
        env.store.create_pool(pool).await.expect("create pool");
    }
    // The cache's clock is the test's: a policy ages when it is moved.
    let clock = codepool_issuance::clock::ManualClock::new();
    let cache = PolicyCache::with_clock(clock.clone());
    let got = cache.get_many(&env.store, &["a", "missing"]).await.unwrap();
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        ["a"],
        "an unknown pool is not found"
    );
    // `b` came with the whole catalogue: within a second it is answered
    // from the cache, not read (the pause is not seen yet); after that it is.
    pause_behind_the_cache(&env, "b").await;
    let got = cache.get_many(&env.store, &["b"]).await.unwrap();
    assert!(
        !got["b"].paused,
        "b was read with the catalogue, before the pause"
    );
    clock.advance(codepool_issuance::policy::POLICY_TTL / 2);
    let got = cache.get_many(&env.store, &["b"]).await.unwrap();
    assert!(!got["b"].paused, "still within its TTL");
    clock.advance(codepool_issuance::policy::POLICY_TTL / 2);
    let got = cache.get_many(&env.store, &["b"]).await.unwrap();
    assert!(got["b"].paused, "read again once its policy aged");

    // A catalogue too large to read whole: every pool a batch meets is
    // read by name, so a pause behind the cache is seen at once.
    let now = bson::DateTime::now();
    let most = codepool_issuance::policy::CATALOGUE_MOST;
    let many: Vec<bson::Document> = (0..=most)
        .map(|i| doc! {"_id": format!("p{i:05}"), "created_at": now, "low_stock_alerted": false})
        .collect();
    env.coll("pools")
        .insert_many(many)
        .await
        .expect("insert pools");
    let cache = PolicyCache::default();
    let got = cache.get_many(&env.store, &["p00000"]).await.unwrap();
    assert!(got.contains_key("p00000"));
    pause_behind_the_cache(&env, "p00001").await;
    let got = cache.get_many(&env.store, &["p00001"]).await.unwrap();
    assert!(got["p00001"].paused, "not cached from a whole read");
    env.cleanup().await;
}

#[tokio::test]
async fn a_pool_document_that_does_not_decode_holds_up_only_its_own_pool() {
    use codepool_issuance::policy::PolicyCache;
    let env = TestEnv::new("policies_bad_pool").await;
    env.store.create_pool("good").await.expect("create pool");
    env.coll("pools")
        .insert_one(doc! {"_id": "bad", "paused": "not a bool"})
        .await
        .expect("insert a malformed pool");
    let cache = PolicyCache::default();
    let got = cache
        .get_many(&env.store, &["good"])
        .await
        .expect("the whole read fails to decode; the read by name answers");
    assert!(got.contains_key("good"));
    assert!(
        cache.get_many(&env.store, &["bad"]).await.is_err(),
        "the malformed pool's own purchases wait"
    );
    env.cleanup().await;
}

/// A revoked key stops working once its cache entry ages past
/// `KEY_TTL`, not before: the verifier's clock is moved by the test, not
/// waited out. The same for a shop whose pools changed.
#[tokio::test]
async fn the_key_and_shop_caches_age_by_their_clock() {
    use codepool_issuance::api_keys::{self, Scope, Verifier, KEY_TTL};
    use codepool_issuance::audit::Actor;
    use codepool_issuance::shops::{Shops, SHOP_TTL};
    let env = TestEnv::new("policies_clock").await;
    let actor = Actor::os_user("test", "host", "test");
    let made = api_keys::create(&env.store, "k", &[Scope::OrdersRead], &actor)
        .await
        .expect("key");
    let clock = codepool_issuance::clock::ManualClock::new();
    let verifier = Verifier::with_clock(clock.clone());
    let seen = verifier.verify(&env.store, &made.token).await.unwrap();
    assert_eq!(seen.map(|k| k.name), Some("k".to_owned()));
    api_keys::revoke(&env.store, "k", &actor)
        .await
        .expect("revoke");
    let cached = verifier.verify(&env.store, &made.token).await.unwrap();
    assert!(cached.is_some(), "within KEY_TTL the cached key answers");
    clock.advance(KEY_TTL);
    let aged = verifier.verify(&env.store, &made.token).await.unwrap();
    assert!(aged.is_none(), "read again once aged: revoked");

    env.store.create_pool("p1").await.expect("pool");
    env.store.create_pool("p2").await.expect("pool");
    codepool_issuance::shops::create(&env.store, "acme", &["p1".to_owned()], &actor)
        .await
        .expect("shop");
    let shops = Shops::with_clock(clock.clone());
    let pools =
        |s: &std::collections::HashMap<String, Option<codepool_issuance::model::ShopDoc>>| {
            s["acme"]
                .as_ref()
                .map(|d| d.pools.clone())
                .unwrap_or_default()
        };
    let first = shops.get_many(&env.store, &["acme"]).await.unwrap();
    assert_eq!(pools(&first), ["p1"]);
    codepool_issuance::shops::set_pools(&env.store, "acme", &["p2".to_owned()], &actor)
        .await
        .expect("set pools");
    let cached = shops.get_many(&env.store, &["acme"]).await.unwrap();
    assert_eq!(pools(&cached), ["p1"], "within SHOP_TTL");
    clock.advance(SHOP_TTL);
    let aged = shops.get_many(&env.store, &["acme"]).await.unwrap();
    assert_eq!(pools(&aged), ["p2"], "read again once aged");
    env.cleanup().await;
}

/// Cancelling a backorder and fulfilling it exclude each other: orders
/// voided while their paused pool resumes keep no live code, and one whose
/// void answered "nothing voided" is never texted.
#[tokio::test]
async fn a_void_racing_a_resume_leaves_no_live_code_and_says_what_it_voided() {
    use crate::api::{http, json_of, order};
    let env = TestEnv::with_pools("policies_void_race", &[("race", 60)]).await;
    env.store.set_paused("race", true).await.expect("pause");
    let (api, shop) = api_with_key(&env, "shop", "orders:write,orders:read").await;
    let ids: Vec<String> = (0..40).map(|i| format!("R-{i}")).collect();
    for id in &ids {
        let (status, _, _) = api.post("/v1/orders", &shop, &order(id, "race", 1)).await;
        assert_eq!(status, 202);
    }
    let daemon = start_daemon(env.command(&[])).await;
    let resume = env.command(&["pool", "resume", "--pool", "race"]).output();
    let voids = futures::future::join_all(ids.iter().map(|id| {
        let (addr, shop) = (api.addr.clone(), shop.clone());
        async move {
            let (status, _, body) = http(
                &addr,
                "POST",
                &format!("/v1/orders/{id}/void"),
                Some(&shop),
                br#"{"reason":"refund"}"#,
            )
            .await;
            assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
            json_of(&body)["voided"].as_u64().unwrap()
        }
    }));
    let (resumed, voided) = tokio::join!(resume, voids);
    assert!(resumed.unwrap().status.success());
    // Any fulfilment in flight finishes before the dispatcher reads the
    // next pool.resumed.
    let (conn, publisher) = env.amqp().await;
    pool_events_handled(&env, &publisher, codepool_domain::PoolEventKind::Resumed).await;
    let ch = conn.create_channel().await.unwrap();
    let texted: Vec<String> = drain(&ch, &env.topology().sms_pending)
        .await
        .iter()
        .map(|m| {
            serde_json::from_slice::<serde_json::Value>(&m.body).unwrap()["order_id"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    for (id, n) in ids.iter().zip(voided) {
        let s = order_statuses(&env, id).await;
        assert!(!s.contains(&1), "{id} keeps a live code: {s:?}");
        if n == 0 {
            assert!(
                !texted.contains(id),
                "{id}: void said 0 voided, yet it was texted"
            );
        }
    }
    daemon.stop().await;
    api.stop().await;
    env.cleanup().await;
}
