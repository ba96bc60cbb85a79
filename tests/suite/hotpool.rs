//! The Redis hot pool is only an accelerator: flushing or stopping Redis
//! mid-run loses nothing and issues nothing twice, and a stale candidate is
//! simply skipped.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use bson::doc;
use codepool_domain::Purchase;
use codepool_hotpool::{Candidate, RefillLock, Refilled};
use codepool_issuance::{ClaimOutcome, Resend};
use codepool_store::codes::ScanClaim;
use codepool_store::codes::ASKS_PER_QUERY;
use codepool_store::{CandidateAsk, ClaimAssignment, CodeId};
use futures::TryStreamExt;

use crate::common::*;
use crate::fixtures::*;

/// Claims `claimers × per_claimer` orders concurrently, in batches of 5,
/// calling `during` once half the batches are claimed: mid-run however
/// fast the machine is (after a fixed time, a fast one could be done and a
/// slow one not started). `during` gets the count of batches claimed.
async fn claims_with_fault<F, Fut>(
    env: &TestEnv,
    pool: &str,
    claimers: usize,
    per_claimer: usize,
    during: F,
) -> Vec<ClaimOutcome>
where
    F: FnOnce(Batches) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let (claimed, batches) = tokio::sync::watch::channel(0usize);
    let claimed = std::sync::Arc::new(claimed);
    let mut tasks = Vec::new();
    for c in 0..claimers {
        let engine = env.engine();
        let pool = pool.to_owned();
        let claimed = claimed.clone();
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            let purchases: Vec<Purchase> = (0..per_claimer)
                .map(|i| purchase(&format!("F-{c:02}-{i:04}"), &pool))
                .collect();
            for chunk in purchases.chunks(5) {
                let refs: Vec<&Purchase> = chunk.iter().collect();
                out.extend(
                    engine
                        .claim_batch(&refs, Resend::ByRedelivery)
                        .await
                        .expect("claims never fail on Redis trouble"),
                );
                claimed.send_modify(|n| *n += 1);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            out
        }));
    }
    // Held by the claimers alone: if they all end, waiting ends too.
    drop(claimed);
    let batches = Batches(batches);
    batches.reach(claimers * per_claimer.div_ceil(5) / 2).await;
    during(batches).await;
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.expect("claimer"));
    }
    all
}

/// The batches [`claims_with_fault`] has claimed so far.
struct Batches(tokio::sync::watch::Receiver<usize>);

impl Batches {
    fn now(&self) -> usize {
        *self.0.borrow()
    }

    /// Returns once `n` batches are claimed.
    async fn reach(&self, n: usize) {
        let mut rx = self.0.clone();
        rx.wait_for(|done| *done >= n)
            .await
            .expect("the claimers ended before that");
    }
}

fn assert_all_distinct(outcomes: &[ClaimOutcome], expected: usize) {
    let mut codes = HashSet::new();
    let mut orders = HashSet::new();
    for o in outcomes {
        let Some((grant, _)) = o.single() else {
            panic!("a purchase went without a code while the pool had enough");
        };
        assert!(
            codes.insert(grant.code.clone()),
            "code issued twice: {}",
            grant.code
        );
        assert!(orders.insert(grant.order_id.clone()));
    }
    assert_eq!(codes.len(), expected);
}

async fn issued_count(env: &TestEnv, pool: &str) -> u64 {
    count_codes(env, doc! {"pool": pool, "status": 1}).await
}

#[tokio::test]
async fn concurrent_claimers_through_the_hot_pool_never_share_a_code() {
    let redis = PrivateRedis::start().await;
    let env = TestEnv::with_redis("hot_concurrent", &redis.url()).await;
    env.fill_pool("hot", 1500).await;
    let outcomes = claims_with_fault(&env, "hot", 16, 80, |_| async {}).await;
    assert_all_distinct(&outcomes, 1280);
    assert_eq!(issued_count(&env, "hot").await, 1280);
    // The candidates came from Redis: its set holds every unissued code.
    assert!(!env.hot_pool().is_degraded());
    let client = redis::Client::open(redis.url().as_str()).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    let key = format!("{}:{{hot}}:hot", env.redis_prefix);
    let members: HashSet<String> = redis::cmd("ZRANGE")
        .arg(&key)
        .arg(0)
        .arg(-1)
        .query_async(&mut c)
        .await
        .unwrap();
    let unissued: Vec<bson::Document> =
        find_docs(&env, "codes", doc! {"pool": "hot", "status": 0}).await;
    assert_eq!(unissued.len(), 1500 - 1280);
    // Refills follow demand, so the codes past the high-water mark may not
    // be loaded yet; every code up to it is in the set.
    let hwm: i64 = redis::cmd("GET")
        .arg(format!("{}:{{hot}}:hwm", env.redis_prefix))
        .query_async::<Option<i64>>(&mut c)
        .await
        .unwrap()
        .unwrap_or(0);
    for d in &unissued {
        assert!(
            d.get_i64("seq").unwrap() > hwm
                || members.contains(&d.get_object_id("_id").unwrap().to_hex()),
            "an unissued code below the high-water mark is missing from the hot set"
        );
    }
    env.cleanup().await;
}

#[tokio::test]
async fn a_redis_flushall_mid_run_loses_nothing_and_issues_nothing_twice() {
    let redis = PrivateRedis::start().await;
    let env = TestEnv::with_redis("hot_flush", &redis.url()).await;
    env.fill_pool("flush", 1200).await;
    let outcomes = claims_with_fault(&env, "flush", 10, 100, |_| redis.flushall()).await;
    assert_all_distinct(&outcomes, 1000);
    assert_eq!(issued_count(&env, "flush").await, 1000);
    // The hot set was rebuilt from MongoDB after the flush.
    let engine = env.engine();
    let more = engine
        .claim_batch(&[&purchase("AFTER-1", "flush")], Resend::ByRedelivery)
        .await
        .unwrap();
    assert!(more[0].single().is_some_and(|(_, fresh)| fresh));
    env.cleanup().await;
}

#[tokio::test]
async fn a_stopped_redis_mid_run_falls_back_to_mongodb_and_comes_back() {
    let mut redis = PrivateRedis::start().await;
    let env = TestEnv::with_redis("hot_stop", &redis.url()).await;
    env.fill_pool("stop", 1200).await;
    let hot = env.hot_pool();
    let outcomes = {
        let redis = &mut redis;
        // Down for a fifth of the run: 40 batches claimed without it.
        claims_with_fault(&env, "stop", 10, 100, |batches| async move {
            redis.stop();
            batches.reach(batches.now() + 40).await;
        })
        .await
    };
    assert_all_distinct(&outcomes, 1000);
    assert_eq!(issued_count(&env, "stop").await, 1000);
    assert!(hot.len("stop").await.is_err(), "Redis is stopped");
    assert!(hot.is_degraded());
    // Claims keep working with Redis down…
    let engine = env.engine();
    let down = engine
        .claim_batch(&[&purchase("DOWN-1", "stop")], Resend::ByRedelivery)
        .await
        .unwrap();
    assert!(down[0].single().is_some_and(|(_, fresh)| fresh));
    // …and the hot pool comes back on its own when Redis does.
    redis.restart().await;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let up = engine
        .claim_batch(&[&purchase("UP-1", "stop")], Resend::ByRedelivery)
        .await
        .unwrap();
    assert!(up[0].single().is_some_and(|(_, fresh)| fresh));
    assert!(
        hot.len("stop").await.unwrap() > 0,
        "hot set rebuilt after the restart"
    );
    assert!(!hot.is_degraded());
    assert_eq!(issued_count(&env, "stop").await, 1002);
    env.cleanup().await;
}

#[tokio::test]
async fn a_popped_candidate_already_issued_through_the_fallback_is_skipped() {
    let redis = PrivateRedis::start().await;
    let env = TestEnv::with_redis("hot_stale", &redis.url()).await;
    env.fill_pool("stale", 40).await;
    let engine = env.engine();
    // Load the hot set, then issue the oldest codes behind Redis's back.
    engine.refill("stale").await.unwrap();
    assert_eq!(env.hot_pool().len("stale").await.unwrap(), 40);
    let mut fallback_codes = HashSet::new();
    for i in 0..10 {
        let ScanClaim::Granted(doc) = env
            .store
            .claim_by_scan(
                "stale",
                &ClaimAssignment {
                    code_id: CodeId::from_bytes([0; 12]),
                    pool: "stale".into(),
                    order_id: format!("SCAN-{i}"),
                    uid: "u".into(),
                    phone: "+8613800000000".into(),
                    grant_no: None,
                    mv: codepool_domain::gate::Move::Claim,
                    resend: Resend::ByRedelivery,
                    line: 0,
                    quantity: 1,
                    part: 0,
                    owner: None,
                },
            )
            .await
            .unwrap()
        else {
            panic!("scan found no code");
        };
        fallback_codes.insert(doc.code);
    }
    // The oldest candidates in Redis are now stale; claims must skip them.
    let purchases: Vec<Purchase> = (0..30)
        .map(|i| purchase(&format!("HOT-{i}"), "stale"))
        .collect();
    let refs: Vec<&Purchase> = purchases.iter().collect();
    let outcomes = engine
        .claim_batch(&refs, Resend::ByRedelivery)
        .await
        .unwrap();
    assert_all_distinct(&outcomes, 30);
    for o in &outcomes {
        if let Some((grant, _)) = o.single() {
            assert!(
                !fallback_codes.contains(&grant.code),
                "a code issued by the fallback was issued again"
            );
        }
    }
    // The pool is now empty: one more is exhausted, not double-issued.
    let last = engine
        .claim_batch(&[&purchase("HOT-LAST", "stale")], Resend::ByRedelivery)
        .await
        .unwrap();
    assert!(last[0].is_exhausted(), "{:?}", last[0]);
    env.cleanup().await;
}

#[tokio::test]
async fn a_batch_over_a_hundred_cold_pools_refills_them_together_and_each_order_gets_its_own_pools_code(
) {
    let env = TestEnv::new("hot_cold_pools").await;
    let pools: Vec<String> = (0..100).map(|k| format!("cold-{k:03}")).collect();
    for pool in &pools {
        env.fill_pool(pool, 3).await;
    }
    let purchases: Vec<Purchase> = pools
        .iter()
        .flat_map(|pool| [1, 2].map(|i| purchase(&format!("{pool}-order-{i}"), pool)))
        .collect();
    let refs: Vec<&Purchase> = purchases.iter().collect();
    let out = env
        .engine()
        .claim_batch(&refs, Resend::ByRedelivery)
        .await
        .expect("claim");

    let mut codes = HashSet::new();
    for (p, o) in purchases.iter().zip(&out) {
        let Some((grant, true)) = o.single() else {
            panic!("{} was not granted a fresh code: {o:?}", p.order_id);
        };
        assert_eq!(grant.pool, p.pool);
        assert!(
            grant.code.starts_with(&format!("{}-", p.pool)),
            "{} got {} of another pool",
            p.order_id,
            grant.code
        );
        assert!(codes.insert(grant.code.clone()), "{} twice", grant.code);
    }
    // Each refill loaded the whole pool (three codes); one is left per set.
    let hot = env.hot_pool();
    for pool in &pools {
        assert_eq!(hot.len(pool).await.expect("redis"), 1, "{pool}'s set");
    }
    env.cleanup().await;
}

#[tokio::test]
async fn refill_locks_are_exclusive_and_go_back_with_what_was_loaded() {
    let env = TestEnv::new("hot_refill_locks").await;
    let hot = env.hot_pool();
    let ttl = Duration::from_secs(10);
    let held = hot.lock_refills(&["a", "b"], ttl).await.expect("redis");
    assert!(held.iter().all(Option::is_some), "both free at first");
    let again = hot
        .lock_refills(&["a", "b", "c"], ttl)
        .await
        .expect("redis");
    assert!(
        again[0].is_none() && again[1].is_none(),
        "held ones are busy"
    );
    let [a, b] = <[_; 2]>::try_from(held).expect("two").map(Option::unwrap);
    let c = again.into_iter().nth(2).flatten().expect("c was free");

    // More candidates than one Lua `unpack` takes; the mark moves up.
    let loaded: Vec<Candidate> = (1..=2500)
        .map(|seq| Candidate {
            id: format!("{seq:024x}"),
            seq,
        })
        .collect();
    let fill = |pool: &str, lock, candidates, mark| Refilled {
        pool: pool.to_owned(),
        candidates,
        high_water_mark: mark,
        lock,
    };
    // `b`'s lock is stale (its token changed hands): it stays locked.
    let stale_b = RefillLock {
        key: b.lock.key.clone(),
        token: "someone-else".into(),
    };
    hot.finish_refills(vec![
        fill("a", a.lock, loaded, 2500),
        fill("b", stale_b, Vec::new(), 0),
        fill("c", c.lock, Vec::new(), 7),
    ])
    .await
    .expect("redis");
    assert_eq!(hot.len("a").await.expect("redis"), 2500);

    let after = hot
        .lock_refills(&["a", "b", "c"], ttl)
        .await
        .expect("redis");
    let a = after[0].as_ref().expect("a released");
    assert_eq!((a.hwm, a.waiting), (2500, 2500));
    assert!(after[1].is_none(), "a stale token releases nothing");
    assert_eq!(after[2].as_ref().expect("c released").hwm, 7);

    // A refill that loaded less (a rescan) never lowers the mark.
    let [a, _, c] = <[_; 3]>::try_from(after).expect("three");
    hot.finish_refills(vec![
        fill("a", a.expect("a").lock, Vec::new(), 10),
        fill("c", c.expect("c").lock, Vec::new(), 7),
    ])
    .await
    .expect("redis");
    let a = hot.lock_refills(&["a"], ttl).await.expect("redis");
    assert_eq!(a[0].as_ref().expect("a released").hwm, 2500);
    drop(b);
    env.cleanup().await;
}

#[tokio::test]
async fn candidates_of_many_pools_come_back_aligned_bounded_and_in_order() {
    let env = TestEnv::new("hot_candidates_many").await;
    // More pools than one query asks for, so the asks span two queries.
    let pools: Vec<String> = (0..ASKS_PER_QUERY + 6)
        .map(|k| format!("m-{k:03}"))
        .collect();
    for pool in &pools {
        env.fill_pool(pool, 5).await;
    }
    // What each pool holds, read directly: (id, seq) oldest first.
    let mut stored = HashMap::new();
    for pool in &pools {
        stored.insert(
            pool.as_str(),
            stored_codes(&env, doc! {"pool": pool}, 0).await,
        );
    }
    let after = stored["m-000"][1].1;
    let asks: Vec<CandidateAsk> = pools
        .iter()
        .rev()
        .map(|pool| CandidateAsk {
            pool,
            after_seq: after,
            limit: 2,
        })
        .chain([CandidateAsk {
            pool: "no-such-pool",
            after_seq: 0,
            limit: 2,
        }])
        .collect();
    let found = env.store.candidates_after_many(&asks).await.expect("mongo");
    assert_eq!(found.len(), asks.len());
    assert!(found.last().expect("unknown pool").is_empty());
    for (ask, codes) in asks.iter().zip(&found).take(pools.len()) {
        let expected: Vec<_> = stored[ask.pool]
            .iter()
            .copied()
            .filter(|c| c.1 > after)
            .take(2)
            .collect();
        assert_eq!(expected.len(), 2, "{} has codes past the mark", ask.pool);
        assert_eq!(codes, &expected, "{}", ask.pool);
    }
    env.cleanup().await;
}

/// Pools refilled from their start are read together, each by a window of
/// `seq` from its lowest unissued code as wide as its limit; a window that
/// neither found its limit nor reached the pool's last unissued code (one
/// thinned by expired codes: "c", "g1") is asked again alone. "a" and "b"
/// get their limits from pools larger than them, "d" (no code) nothing.
/// Six pools of 100 codes that want 5 each read 5 each. Whatever the
/// pools' sizes, each pool reads at most its limit in the shared window
/// query.
#[tokio::test]
async fn cold_pools_refilled_together_get_their_oldest_claimable_codes() {
    let env = TestEnv::new("hot_candidates_cold").await;
    // (pool, expired codes, codes, limit)
    let pools = [
        ("a", 0, 20, 5),
        ("b", 0, 40, 30),
        ("c", 3, 10, 10),
        ("d", 0, 0, 4),
    ];
    let many = ["f1", "f2", "f3", "f4", "f5", "f6"].map(|f| (f, 0, 100, 5));
    // "g1" holds 3 expired codes its window skips; "g3" reads 10 of its
    // 100, and "g4" after it is answered by the same query.
    let windows = [
        ("g1", 3, 8, 10),
        ("g2", 0, 5, 10),
        ("g3", 0, 100, 10),
        ("g4", 0, 5, 10),
    ];
    let cases = [
        (&pools[..], vec![5, 30, 7, 0]),
        (&many[..], vec![5; 6]),
        (&windows[..], vec![5, 5, 10, 5]),
    ];
    for (case, sizes) in cases {
        cold_refill_case(&env, case, sizes).await;
    }
    env.cleanup().await;
}

/// Fills `pools` (pool, expired codes, codes, limit), refills them all
/// from their start together, and checks that each got its oldest
/// claimable codes, `sizes` of them.
async fn cold_refill_case(env: &TestEnv, pools: &[(&str, usize, usize, i64)], sizes: Vec<usize>) {
    let mut expected = Vec::new();
    for &(pool, expired, n, limit) in pools {
        env.fill_pool_expiring(pool, expired, n).await;
        let unexpired = doc! {"pool": pool, "expires_at": null};
        expected.push(stored_codes(env, unexpired, limit).await);
    }
    let asks: Vec<CandidateAsk> = pools
        .iter()
        .map(|&(pool, _, _, limit)| CandidateAsk {
            pool,
            after_seq: 0,
            limit,
        })
        .collect();
    let found = env.store.candidates_after_many(&asks).await.expect("mongo");
    assert_eq!(found.iter().map(Vec::len).collect::<Vec<_>>(), sizes);
    assert_eq!(found, expected);
}

/// The codes matching `filter` as (id, seq), oldest first, at most
/// `limit` of them (0: all), read directly from MongoDB.
async fn stored_codes(env: &TestEnv, filter: bson::Document, limit: i64) -> Vec<(CodeId, i64)> {
    let docs: Vec<bson::Document> = env
        .store
        .database()
        .collection::<bson::Document>(codepool_store::codes::CODES)
        .find(filter)
        .sort(doc! {"seq": 1})
        .limit(limit)
        .await
        .expect("mongo")
        .try_collect()
        .await
        .expect("mongo");
    docs.iter()
        .map(|d| {
            let id = codepool_store::code_id(d.get_object_id("_id").unwrap());
            (id, d.get_i64("seq").unwrap())
        })
        .collect()
}
