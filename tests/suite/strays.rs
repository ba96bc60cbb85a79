//! Redis never decides which code an order gets: every candidate a hot set
//! offers must pass MongoDB's own condition (the order's pool, unissued,
//! not expired). Stray ids of every kind are put into a pool's hot set
//! while orders are claimed, and every order still holds a code of its
//! own pool.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bson::doc;
use codepool_hotpool::Candidate;
use codepool_issuance::Resend;
use codepool_store::ObjectId;

use crate::common::*;

/// The kinds of ids a stale, restored or tampered hot set can hold for
/// pool `pool`, ten of each: another pool's unissued codes, the pool's own
/// void codes, expired codes and codes issued already, and ids of nothing.
async fn strays_for(env: &TestEnv, pool: &str, other: &str) -> Vec<Candidate> {
    let codes = env.coll("codes");
    let ids_of = |filter: bson::Document| {
        let codes = codes.clone();
        async move {
            let found: Vec<bson::Document> =
                futures::TryStreamExt::try_collect(codes.find(filter).limit(10).await.unwrap())
                    .await
                    .unwrap();
            found
                .iter()
                .map(|d| d.get_object_id("_id").unwrap())
                .collect::<Vec<ObjectId>>()
        }
    };
    // Void ten unexpired codes of the pool.
    let fresh = doc! {"pool": pool, "status": 0, "expires_at": {"$exists": false}};
    let void = ids_of(fresh.clone()).await;
    codes
        .update_many(
            doc! {"_id": {"$in": &void}},
            doc! {"$set": {"status": 3, "voided_at": bson::DateTime::now(), "void_reason": "test"}},
        )
        .await
        .unwrap();
    // Issue ten through the engine, to real orders.
    let engine = env.engine();
    let pre: Vec<_> = (0..10)
        .map(|i| purchase(&format!("PRE-{i}"), pool))
        .collect();
    let refs: Vec<_> = pre.iter().collect();
    let outcomes = engine
        .claim_batch(&refs, Resend::ByRedelivery)
        .await
        .unwrap();
    let issued: Vec<ObjectId> = outcomes
        .iter()
        .map(|o| match o {
            o if o.single().is_some() => codepool_store::object_id(o.single().unwrap().0.code_id),
            other => panic!("a pre-order got {other:?}"),
        })
        .collect();
    let expired = ids_of(doc! {"pool": pool, "status": 0, "expires_at": {"$exists": true}}).await;
    let foreign = ids_of(doc! {"pool": other, "status": 0}).await;
    let missing: Vec<ObjectId> = (0..10).map(|_| ObjectId::new()).collect();
    let all = [void, issued, expired, foreign, missing].concat();
    assert_eq!(all.len(), 50, "ten strays of each kind");
    // Score 0: ahead of every real candidate (whose seq starts at 1).
    all.iter()
        .map(|id| Candidate {
            id: id.to_hex(),
            seq: 0,
        })
        .collect()
}

#[tokio::test]
async fn stray_ids_in_a_hot_set_never_grant_a_code_of_another_pool_or_state() {
    let env = TestEnv::new("strays_engine").await;
    env.fill_pool_expiring("hp", 20, 400).await;
    env.fill_pool("hugep", 100).await;
    let strays = strays_for(&env, "hp", "hugep").await;
    let stray_ids: HashSet<String> = strays.iter().map(|c| c.id.clone()).collect();
    let hot = env.hot_pool();

    // Under load: four claimers while the strays are put back into the set
    // again and again.
    let stop = Arc::new(AtomicBool::new(false));
    let injector = {
        let (hot, strays, stop) = (env.hot_pool(), strays.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                hot.put_back("hp", &strays).await.unwrap();
                tokio::time::sleep(Duration::from_millis(3)).await;
            }
        })
    };
    let mut claimers = Vec::new();
    for t in 0..4 {
        let engine = env.engine();
        claimers.push(tokio::spawn(async move {
            let mut got = Vec::new();
            for b in 0..5 {
                let batch: Vec<_> = (0..10)
                    .map(|i| purchase(&format!("L-{t}-{b}-{i}"), "hp"))
                    .collect();
                let refs: Vec<_> = batch.iter().collect();
                let outcomes = engine
                    .claim_batch(&refs, Resend::ByRedelivery)
                    .await
                    .unwrap();
                got.extend(batch.iter().map(|p| p.order_id.clone()).zip(outcomes));
            }
            got
        }));
    }
    let mut outcomes = Vec::new();
    for c in claimers {
        outcomes.extend(c.await.unwrap());
    }
    stop.store(true, Ordering::Relaxed);
    injector.await.unwrap();

    // Every order holds one code of its own pool, none twice, no stray.
    let mut seen = HashSet::new();
    for (order, outcome) in &outcomes {
        let Some((grant, _)) = outcome.single() else {
            panic!("order {order} got {outcome:?}");
        };
        assert!(seen.insert(grant.code_id), "code {} twice", grant.code_id);
        assert!(
            !stray_ids.contains(&grant.code_id.to_hex()),
            "order {order} got stray {}",
            grant.code_id
        );
    }
    let orders: Vec<&str> = outcomes.iter().map(|(o, _)| o.as_str()).collect();
    let held = env.store.grants_for_orders(&orders).await.unwrap().line0();
    assert_eq!(held.len(), 200);
    assert!(
        held.values().all(|c| c.pool == "hp"),
        "a code of another pool"
    );

    // The other pool and the retired codes are untouched.
    let codes = env.coll("codes");
    let count = |f| {
        let codes = codes.clone();
        async move { codes.count_documents(f).await.unwrap() }
    };
    assert_eq!(count(doc! {"pool": "hugep", "status": 0}).await, 100);
    assert_eq!(count(doc! {"pool": "hp", "status": 3}).await, 10);
    let expired = doc! {"pool": "hp", "status": 0, "expires_at": {"$exists": true}};
    assert_eq!(count(expired).await, 20);

    // Strays that fail the condition are dropped, never put back: one
    // last batch pops all fifty (score 0 comes first), and none is left.
    hot.put_back("hp", &strays).await.unwrap();
    let last: Vec<_> = (0..60).map(|i| purchase(&format!("Z-{i}"), "hp")).collect();
    let refs: Vec<_> = last.iter().collect();
    let engine = env.engine();
    for o in engine
        .claim_batch(&refs, Resend::ByRedelivery)
        .await
        .unwrap()
    {
        let Some((grant, _)) = o.single() else {
            panic!("{o:?}")
        };
        assert!(!stray_ids.contains(&grant.code_id.to_hex()));
    }
    let (rest, _) = hot.pop("hp", 10_000).await.unwrap();
    assert!(
        rest.iter().all(|c| !stray_ids.contains(&c.id)),
        "a stray went back into the hot set"
    );
    env.cleanup().await;
}

/// The issue's own reproduction: another pool's ids copied into a pool's
/// hot set under a running dispatcher. Orders get their own pool's codes,
/// and the dispatcher counts what it dropped.
#[tokio::test]
async fn a_dispatcher_drops_another_pools_ids_and_counts_them() {
    let env = TestEnv::with_pools("strays_daemon", &[("hp", 100), ("hugep", 100)]).await;
    let dispatcher = start_daemon(env.command(&[])).await;
    let (conn, publisher) = env.amqp().await;
    // Warm both pools' hot sets, then copy hugep's candidates into hp's.
    publish_confirmed(
        &publisher,
        &[purchase("W-hp", "hp"), purchase("W-hugep", "hugep")],
    )
    .await;
    eventually(Duration::from_secs(30), "the warm-up grants", || async {
        env.store
            .grants_for_orders(&["W-hp", "W-hugep"])
            .await
            .unwrap()
            .line0()
            .len()
            == 2
    })
    .await;
    let hot = env.hot_pool();
    let (theirs, _) = hot.pop("hugep", 20).await.unwrap();
    assert_eq!(theirs.len(), 20);
    let stolen: Vec<Candidate> = theirs
        .iter()
        .map(|c| Candidate {
            id: c.id.clone(),
            seq: 0,
        })
        .collect();
    hot.put_back("hp", &stolen).await.unwrap();
    hot.put_back("hugep", &theirs).await.unwrap();

    let orders: Vec<_> = (0..30)
        .map(|i| purchase(&format!("XP-{i}"), "hp"))
        .collect();
    publish_confirmed(&publisher, &orders).await;
    let ids: Vec<&str> = orders.iter().map(|p| p.order_id.as_str()).collect();
    eventually(Duration::from_secs(30), "thirty grants", || async {
        env.store
            .grants_for_orders(&ids)
            .await
            .unwrap()
            .line0()
            .len()
            == 30
    })
    .await;
    let held = env.store.grants_for_orders(&ids).await.unwrap().line0();
    assert!(
        held.values().all(|c| c.pool == "hp"),
        "an hp order got a hugep code"
    );
    let dropped = metric_sum(
        &[&dispatcher.addr],
        "codepool_hot_candidates_dropped_total{reason=\"other_pool\"}",
    )
    .await;
    assert!(
        dropped >= 20.0,
        "dropped {dropped}, expected the 20 stolen ids"
    );
    let codes = env.coll("codes");
    let hugep_left = codes
        .count_documents(doc! {"pool": "hugep", "status": 0})
        .await
        .unwrap();
    assert_eq!(hugep_left, 99, "hugep's stock fell for hp's orders");
    dispatcher.stop().await;
    codepool_broker::close(conn, "done").await;
    env.cleanup().await;
}
