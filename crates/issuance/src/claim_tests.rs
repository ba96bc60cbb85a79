//! The claim engine's rules, run against in-memory fakes of its ports
//! (crate::fakes): distinct candidates, race rounds, put-back, the MongoDB
//! fallback, exhaustion, and errors that must never become outcomes.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use codepool_domain::{CodeStatus, Purchase};

use crate::claim::{ClaimAsk, ClaimConfig, ClaimEngine, ClaimError, ClaimOutcome};
use crate::fakes::{id, FakeHot, FakeNumbers, FakeStore};
use crate::ports::Candidate;
use crate::Resend;

struct Rig {
    store: Arc<FakeStore>,
    hot: Arc<FakeHot>,
    numbers: Arc<FakeNumbers>,
    engine: ClaimEngine,
}

fn rig(store: FakeStore) -> Rig {
    let store = Arc::new(store);
    let hot = Arc::new(FakeHot::default());
    let config = ClaimConfig {
        refill_batch: 50,
        low_water: 0,
        ..ClaimConfig::default()
    };
    let numbers = Arc::new(FakeNumbers::default());
    let engine = ClaimEngine::new(store.clone(), hot.clone(), numbers.clone(), config);
    Rig {
        store,
        hot,
        numbers,
        engine,
    }
}

fn purchases(pool: &str, orders: &[&str]) -> Vec<Purchase> {
    orders
        .iter()
        .map(|o| Purchase {
            order_id: (*o).into(),
            uid: format!("u-{o}"),
            phone: "+8613800000000".into(),
            pool: pool.into(),
            purchased_at: None,
            quantity: 1,
            owner: None,
            hold_id: None,
            items: Vec::new(),
            shop: None,
        })
        .collect()
}

async fn claim(r: &Rig, ps: &[Purchase]) -> Result<Vec<ClaimOutcome>, ClaimError> {
    let refs: Vec<&Purchase> = ps.iter().collect();
    r.engine.claim_batch(&refs, Resend::ByRedelivery).await
}

fn granted_ids(outcomes: &[ClaimOutcome]) -> Vec<codepool_domain::CodeId> {
    outcomes
        .iter()
        .flat_map(|o| o.grants().iter().map(|g| g.code_id))
        .collect()
}

#[tokio::test]
async fn every_order_gets_a_distinct_code_oldest_first() {
    let r = rig(FakeStore::with_pool("x", 1, 20));
    let ps = purchases("x", &["A", "B", "C", "D"]);
    let out = claim(&r, &ps).await.unwrap();
    let ids = granted_ids(&out);
    assert_eq!(ids, vec![id(1), id(2), id(3), id(4)]);
    assert!(out.iter().all(|o| o.fresh() == 1 && o.grants().len() == 1));
    assert_eq!(
        r.store.scans.load(Ordering::SeqCst),
        0,
        "the hot path needs no scan"
    );
    assert_eq!(
        r.store.read_backs.load(Ordering::SeqCst),
        0,
        "a write that landed whole needs no read-back"
    );
}

#[tokio::test]
async fn a_write_that_lost_a_race_reads_back_which_orders_won() {
    let r = rig(FakeStore::with_pool("x", 1, 10));
    r.hot.offer("x", &[Candidate { id: id(1), seq: 1 }]);
    r.store.set_status(id(1), CodeStatus::Void);
    let out = claim(&r, &purchases("x", &["A", "B"])).await.unwrap();
    assert!(
        r.store.read_backs.load(Ordering::SeqCst) >= 2,
        "both orders of the write that lost are read back"
    );
    let ids: HashSet<_> = granted_ids(&out).into_iter().collect();
    assert_eq!(ids.len(), 2);
    assert!(!ids.contains(&id(1)));
}

#[tokio::test]
async fn duplicates_in_one_batch_share_one_code() {
    let r = rig(FakeStore::with_pool("x", 1, 5));
    let out = claim(&r, &purchases("x", &["A", "A", "B"])).await.unwrap();
    let ids = granted_ids(&out);
    assert_eq!(ids[0], ids[1]);
    assert_ne!(ids[0], ids[2]);
    assert_eq!(r.store.issued().len(), 2);
}

#[tokio::test]
async fn a_redelivered_order_gets_its_code_back_and_the_candidate_returns() {
    let r = rig(FakeStore::with_pool("x", 1, 10));
    let first = claim(&r, &purchases("x", &["A"])).await.unwrap();
    let before = r.hot.len("x");
    let again = claim(&r, &purchases("x", &["A"])).await.unwrap();
    assert_eq!(granted_ids(&first), granted_ids(&again));
    assert_eq!(again[0].fresh(), 0);
    assert_eq!(again[0].grants().len(), 1);
    assert_eq!(r.hot.len("x"), before, "the unused candidate is put back");
    assert_eq!(r.store.issued().len(), 1);
}

#[tokio::test]
async fn candidates_taken_behind_the_hot_pools_back_are_retried_with_fresh_ones() {
    let r = rig(FakeStore::with_pool("x", 1, 10));
    // The first three are offered but were issued elsewhere meanwhile.
    r.hot.offer(
        "x",
        &(1..=3)
            .map(|i| Candidate {
                id: id(i),
                seq: i as i64,
            })
            .collect::<Vec<_>>(),
    );
    for i in 1..=3 {
        r.store.set_status(id(i), CodeStatus::Void);
    }
    let out = claim(&r, &purchases("x", &["A", "B", "C"])).await.unwrap();
    let ids: HashSet<_> = granted_ids(&out).into_iter().collect();
    assert_eq!(ids.len(), 3);
    assert!(
        ids.iter().all(|i| ![id(1), id(2), id(3)].contains(i)),
        "void codes are never issued"
    );
}

#[tokio::test]
async fn redis_away_means_the_mongodb_scan_not_an_error() {
    let r = rig(FakeStore::with_pool("x", 1, 5));
    r.hot.down.store(true, Ordering::SeqCst);
    let out = claim(&r, &purchases("x", &["A", "B"])).await.unwrap();
    assert_eq!(granted_ids(&out), vec![id(1), id(2)]);
    assert_eq!(r.store.scans.load(Ordering::SeqCst), 2);
    assert!(r.engine.is_degraded());
}

#[tokio::test]
async fn an_empty_pool_is_exhausted_only_after_the_scan_finds_nothing() {
    let r = rig(FakeStore::with_pool("x", 1, 3));
    let out = claim(&r, &purchases("x", &["A", "B", "C", "D", "E"]))
        .await
        .unwrap();
    assert_eq!(granted_ids(&out).len(), 3);
    assert_eq!(out.iter().filter(|o| o.is_exhausted()).count(), 2);
}

#[tokio::test]
async fn a_store_outage_is_an_error_and_the_candidates_go_back() {
    let r = rig(FakeStore::with_pool("x", 1, 10));
    r.store.outages.store(1, Ordering::SeqCst);
    let err = claim(&r, &purchases("x", &["A", "B"])).await.unwrap_err();
    assert!(err.is_unavailable());
    assert_eq!(r.hot.len("x"), 10, "popped candidates were put back");
    assert!(r.store.issued().is_empty());
    let out = claim(&r, &purchases("x", &["A", "B"])).await.unwrap();
    assert_eq!(granted_ids(&out).len(), 2, "the retry succeeds");
}

#[tokio::test]
async fn a_grant_read_back_without_its_fields_is_an_error_never_exhausted() {
    let r = rig(FakeStore::with_pool("x", 1, 10));
    claim(&r, &purchases("x", &["A"])).await.unwrap();
    // The redelivery's code is read back by order, and comes back corrupt.
    r.store.drop_holders.store(true, Ordering::SeqCst);
    let err = claim(&r, &purchases("x", &["A"])).await.unwrap_err();
    assert!(matches!(err, ClaimError::Inconsistent { ref order_id, .. } if order_id == "A"));
    assert!(!err.is_unavailable());
}

#[tokio::test]
async fn a_refill_rescans_from_the_start_once_past_the_high_water_mark() {
    let r = rig(FakeStore::with_pool("x", 1, 3));
    claim(&r, &purchases("x", &["A"])).await.unwrap();
    // Candidates 2 and 3 are lost from Redis (a flush); the high-water mark
    // says everything up to 3 was loaded already.
    r.hot.sets.lock().unwrap().clear();
    let out = claim(&r, &purchases("x", &["B", "C"])).await.unwrap();
    assert_eq!(granted_ids(&out), vec![id(2), id(3)]);
}

#[tokio::test]
async fn a_claimer_that_waited_for_another_refill_takes_its_candidates() {
    let r = rig(FakeStore::with_pool("x", 1, 5));
    // The set was empty when this claimer popped; by the time it holds the
    // refill lock, another claimer's refill has loaded every code.
    *r.hot.loaded_meanwhile.lock().unwrap() = (1..=5)
        .map(|i| Candidate {
            id: id(i),
            seq: i as i64,
        })
        .collect();
    let out = claim(&r, &purchases("x", &["A", "B"])).await.unwrap();
    assert_eq!(granted_ids(&out), vec![id(1), id(2)]);
    assert_eq!(
        r.store.refills.load(Ordering::SeqCst),
        0,
        "no second query for what the set already holds"
    );
    assert_eq!(r.store.refill_queries.load(Ordering::SeqCst), 0);
    assert_eq!(r.hot.len("x"), 3, "the others stay offered, once each");
}

#[tokio::test]
async fn pools_do_not_share_candidates() {
    let store = FakeStore::with_pool("x", 1, 2);
    store.add("y", 100, 2);
    let r = rig(store);
    let mut ps = purchases("x", &["A"]);
    ps.extend(purchases("y", &["B"]));
    let out = claim(&r, &ps).await.unwrap();
    assert_eq!(granted_ids(&out), vec![id(1), id(100)]);
}

#[tokio::test]
async fn a_batch_over_many_pools_grants_every_order_a_code_of_its_own_pool() {
    let store = FakeStore::with_pool("p0", 1, 3);
    for k in 1..40 {
        store.add(&format!("p{k}"), 1 + k * 5, 3);
    }
    let r = rig(store);
    let ps: Vec<Purchase> = (0..40)
        .flat_map(|k| purchases(&format!("p{k}"), &[&format!("A{k}"), &format!("B{k}")]))
        .collect();
    let out = claim(&r, &ps).await.unwrap();
    let ids = granted_ids(&out);
    assert_eq!(ids.len(), 80, "every order of every pool is granted");
    assert_eq!(
        ids.iter().collect::<HashSet<_>>().len(),
        80,
        "no code twice"
    );
    assert_eq!(
        r.store.scans.load(Ordering::SeqCst),
        0,
        "cold pools refill, no scan"
    );
    assert_eq!(
        r.store.refill_queries.load(Ordering::SeqCst),
        1,
        "the forty cold pools are refilled by one query"
    );
}

#[tokio::test]
async fn a_cold_pool_hands_its_claimer_the_oldest_of_the_load_without_a_second_pop() {
    let r = rig(FakeStore::with_pool("x", 1, 10));
    let out = claim(&r, &purchases("x", &["A", "B", "C"])).await.unwrap();
    assert_eq!(granted_ids(&out), vec![id(1), id(2), id(3)]);
    assert_eq!(
        r.hot.pops.load(Ordering::SeqCst),
        1,
        "one pop found the set empty; the load itself supplied the claim"
    );
    assert_eq!(r.hot.len("x"), 7, "the rest of the load waits in the set");
    let out = claim(&r, &purchases("x", &["D"])).await.unwrap();
    assert_eq!(granted_ids(&out), vec![id(4)], "the set's oldest next");
}

#[tokio::test]
async fn a_refiller_takes_the_sets_older_candidates_before_its_own_load() {
    let r = rig(FakeStore::with_pool("x", 1, 5));
    // The set was empty when this claimer popped; by the time it holds the
    // refill lock, another refill has put candidate 1 there. Its own load
    // (2 to 5) goes to the set too, and the claimer pops the oldest.
    *r.hot.loaded_meanwhile.lock().unwrap() = vec![Candidate { id: id(1), seq: 1 }];
    let out = claim(&r, &purchases("x", &["A", "B"])).await.unwrap();
    assert_eq!(granted_ids(&out), vec![id(1), id(2)]);
    assert_eq!(r.hot.len("x"), 3, "3, 4 and 5 wait, once each");
}

#[tokio::test]
async fn a_sold_out_pool_spends_no_grant_number_per_purchase() {
    let r = rig(FakeStore::with_pool("x", 1, 2));
    claim(&r, &purchases("x", &["A", "B"])).await.unwrap();
    // This batch finds the pool empty (its refill loads nothing).
    let out = claim(&r, &purchases("x", &["C", "D", "E"])).await.unwrap();
    assert!(out.iter().all(ClaimOutcome::is_exhausted));
    let before = r.numbers.issued();
    let out = claim(&r, &purchases("x", &["F", "G", "H"])).await.unwrap();
    assert!(out.iter().all(ClaimOutcome::is_exhausted));
    assert_eq!(
        r.numbers.issued() - before,
        1,
        "only the scan that found the pool empty took a number"
    );
}

fn with_quantity(mut ps: Vec<Purchase>, q: u32) -> Vec<Purchase> {
    for p in &mut ps {
        p.quantity = q;
    }
    ps
}

#[tokio::test]
async fn an_order_of_several_gets_that_many_distinct_codes_one_per_line() {
    let r = rig(FakeStore::with_pool("x", 1, 20));
    let ps = with_quantity(purchases("x", &["A", "B"]), 3);
    let out = claim(&r, &ps).await.unwrap();
    for o in &out {
        let lines: Vec<u32> = o.grants().iter().map(|g| g.line).collect();
        assert_eq!(lines, [0, 1, 2]);
        assert!(o.grants().iter().all(|g| g.quantity == 3 && g.part == 0));
        assert_eq!(o.fresh(), 3);
        assert!(o.missing().is_empty());
    }
    let ids: HashSet<_> = granted_ids(&out).into_iter().collect();
    assert_eq!(ids.len(), 6, "no code twice");
    // Again: the same codes, none fresh, none more issued.
    let again = claim(&r, &ps).await.unwrap();
    assert_eq!(granted_ids(&again), granted_ids(&out));
    assert!(again.iter().all(|o| o.fresh() == 0));
    assert_eq!(r.store.issued().len(), 6);
}

#[tokio::test]
async fn an_order_larger_than_the_stock_gets_what_there_is_and_the_rest_waits() {
    let r = rig(FakeStore::with_pool("x", 1, 4));
    let ps = with_quantity(purchases("x", &["A"]), 10);
    let out = claim(&r, &ps).await.unwrap();
    assert_eq!(out[0].grants().len(), 4);
    assert_eq!(out[0].missing(), [4, 5, 6, 7, 8, 9]);
    assert!(!out[0].is_exhausted(), "partly granted is not exhausted");
    // Codes arrive; the backorder asks for its waiting lines only.
    r.store.add("x", 100, 10);
    r.engine.replenished("x");
    let lines: Vec<u32> = (4..10).collect();
    let asks = [ClaimAsk {
        purchase: &ps[0],
        lines: &lines,
    }];
    let later = r
        .engine
        .claim_asks(&asks, codepool_store::ClaimWay::claim(Resend::ByRelay))
        .await
        .unwrap();
    let got: Vec<(u32, u32)> = later[0].grants().iter().map(|g| (g.line, g.part)).collect();
    assert_eq!(got, [(4, 4), (5, 4), (6, 4), (7, 4), (8, 4), (9, 4)]);
    assert_eq!(r.store.issued().len(), 10, "never beyond the quantity");
}

#[tokio::test]
async fn the_same_order_id_with_another_quantity_pool_or_buyer_gets_nothing() {
    let r = rig(FakeStore::with_pool("x", 1, 30));
    let first = with_quantity(purchases("x", &["A"]), 2);
    claim(&r, &first).await.unwrap();
    let mut more = with_quantity(purchases("x", &["A"]), 5);
    let mut buyer = first.clone();
    buyer[0].uid = "someone-else".into();
    more.extend(buyer);
    for p in more {
        let out = claim(&r, std::slice::from_ref(&p)).await.unwrap();
        assert!(matches!(out[0], ClaimOutcome::Conflict { .. }), "{out:?}");
    }
    assert_eq!(r.store.issued().len(), 2, "the first order stands, alone");
    // In one batch: the first of the batch stands, the other conflicts.
    let mut batch = with_quantity(purchases("x", &["B"]), 1);
    batch.extend(with_quantity(purchases("x", &["B"]), 3));
    let out = claim(&r, &batch).await.unwrap();
    assert_eq!(out[0].grants().len(), 1);
    assert!(matches!(
        out[1],
        ClaimOutcome::Conflict { what: "quantity" }
    ));
    assert_eq!(r.store.issued().len(), 3);
}

#[tokio::test]
async fn orders_a_read_shows_holding_every_line_claim_nothing_and_spend_no_number() {
    use crate::ports::ClaimStore;
    let r = rig(FakeStore::with_pool("x", 1, 30));
    let first = with_quantity(purchases("x", &["A", "B", "E"]), 2);
    let out = claim(&r, &first).await.unwrap();
    let numbers = r.numbers.issued();
    let pops = r.hot.pops.load(Ordering::SeqCst);
    let mut known = r.store.grants_for_orders(&["A", "B", "E"]).await.unwrap();
    // E's read shows one line of two: it goes the whole path.
    known.get_mut("E").unwrap().truncate(1);
    let mut again = with_quantity(purchases("x", &["A", "B", "E", "D"]), 2);
    again[1].uid = "someone-else".into();
    let refs: Vec<&Purchase> = again.iter().collect();
    let got = (r.engine)
        .claim_known(&refs, Resend::ByRedelivery, &known)
        .await
        .unwrap();
    assert_eq!(
        got[0].grants(),
        out[0].grants(),
        "A: the same codes, none fresh"
    );
    assert_eq!(got[0].fresh(), 0);
    assert!(
        matches!(
            got[1],
            ClaimOutcome::Conflict {
                what: "buyer (uid)"
            }
        ),
        "{:?}",
        got[1]
    );
    assert_eq!(got[2].grants(), out[2].grants(), "E: its codes, read back");
    assert_eq!(got[2].fresh(), 0);
    assert_eq!(got[3].grants().len(), 2);
    assert_eq!(got[3].fresh(), 2, "D is new");
    assert_eq!(r.store.issued().len(), 8);
    // Only E (which claimed again) and D took candidates and numbers.
    // E's first line, D's two.
    assert_eq!(r.numbers.issued() - numbers, 3, "A and B spent no number");
    assert!(r.hot.pops.load(Ordering::SeqCst) > pops);
}
