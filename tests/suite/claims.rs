//! The claim engine against real MongoDB and Redis: one code per order,
//! one order per code, backorders when the pool runs dry.

use std::collections::HashSet;

use bson::doc;
use codepool_domain::Purchase;
use codepool_issuance::{ClaimOutcome, Resend};
use codepool_store::ClaimAssignment;

use crate::common::*;
use codepool_store::backorders::{Recorded, Waiting};

/// `claimers` tasks each claim `per_claimer` orders in batches of `batch`.
async fn run_claimers(
    env: &TestEnv,
    pool: &str,
    claimers: usize,
    per_claimer: usize,
    batch: usize,
) -> Vec<(Purchase, ClaimOutcome)> {
    let mut tasks = Vec::new();
    for c in 0..claimers {
        let engine = env.engine();
        let pool = pool.to_owned();
        tasks.push(tokio::spawn(async move {
            let purchases: Vec<Purchase> = (0..per_claimer)
                .map(|i| purchase(&format!("O-{c:02}-{i:04}"), &pool))
                .collect();
            let mut out = Vec::new();
            for chunk in purchases.chunks(batch) {
                let refs: Vec<&Purchase> = chunk.iter().collect();
                let outcomes = engine
                    .claim_batch(&refs, Resend::ByRedelivery)
                    .await
                    .expect("claim");
                out.extend(chunk.iter().cloned().zip(outcomes));
            }
            out
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.expect("claimer"));
    }
    all
}

#[tokio::test]
async fn twenty_concurrent_claimers_get_two_thousand_distinct_codes() {
    let env = TestEnv::with_pools("claims_distinct", &[("distinct", 2000)]).await;
    let results = run_claimers(&env, "distinct", 20, 100, 10).await;
    let mut codes = HashSet::new();
    let mut orders = HashSet::new();
    for (p, outcome) in &results {
        let Some((grant, fresh)) = outcome.single() else {
            panic!(
                "order {} got no code from a pool with enough codes",
                p.order_id
            );
        };
        assert!(fresh);
        assert_eq!(grant.order_id, p.order_id);
        assert!(
            codes.insert(grant.code.clone()),
            "code {} issued twice",
            grant.code
        );
        orders.insert(p.order_id.clone());
    }
    assert_eq!(codes.len(), 2000);
    assert_eq!(orders.len(), 2000);
    let coll = env.coll("codes");
    assert_eq!(
        coll.count_documents(doc! {"pool": "distinct", "status": 1})
            .await
            .unwrap(),
        2000
    );
    assert_eq!(
        coll.count_documents(doc! {"pool": "distinct", "status": 0})
            .await
            .unwrap(),
        0
    );
    env.cleanup().await;
}

#[tokio::test]
async fn two_thousand_claims_on_a_hundred_codes_issue_exactly_a_hundred_and_backorder_the_rest() {
    let env = TestEnv::with_pools("claims_backorder", &[("small", 100)]).await;
    let results = run_claimers(&env, "small", 20, 100, 10).await;
    let exhausted: Vec<&Purchase> = results
        .iter()
        .filter(|(_, o)| o.is_exhausted())
        .map(|(p, _)| p)
        .collect();
    let granted: HashSet<String> = results
        .iter()
        .filter_map(|(_, o)| o.single().map(|(grant, _)| grant.code))
        .collect();
    assert_eq!(granted.len(), 100);
    assert_eq!(exhausted.len(), 1900);
    // The dispatcher records exhausted purchases as backorders, durably.
    let waiting: Vec<Waiting> = exhausted
        .iter()
        .map(|p| Waiting {
            purchase: p,
            lines: &[0],
        })
        .collect();
    assert_eq!(
        env.store.record_backorders(&waiting).await.unwrap().new,
        1900
    );
    assert_eq!(
        env.store.record_backorders(&waiting[..10]).await.unwrap(),
        Recorded::default()
    );
    let backorders = env.coll("backorders");
    assert_eq!(
        backorders
            .count_documents(doc! {"pool": "small"})
            .await
            .unwrap(),
        1900
    );
    let coll = env.coll("codes");
    assert_eq!(
        coll.count_documents(doc! {"pool": "small", "status": 1})
            .await
            .unwrap(),
        100
    );
    env.cleanup().await;
}

#[tokio::test]
async fn an_order_never_gets_two_codes_whatever_the_duplicates() {
    let env = TestEnv::with_pools("claims_dupes", &[("dupes", 50)]).await;
    let engine = env.engine();
    let p = purchase("DUP-1", "dupes");
    let q = purchase("DUP-2", "dupes");
    // Duplicates inside one batch, then redeliveries in later batches.
    let first = engine
        .claim_batch(&[&p, &p, &q, &p], Resend::ByRedelivery)
        .await
        .unwrap();
    let code_of = |o: &ClaimOutcome| o.single().expect("granted, not exhausted").0.code;
    assert_eq!(code_of(&first[0]), code_of(&first[1]));
    assert_eq!(code_of(&first[0]), code_of(&first[3]));
    assert_ne!(code_of(&first[0]), code_of(&first[2]));
    let again = engine
        .claim_batch(&[&p], Resend::ByRedelivery)
        .await
        .unwrap();
    assert_eq!(code_of(&again[0]), code_of(&first[0]));
    assert_eq!(again[0].single().map(|(_, fresh)| fresh), Some(false));
    // Concurrent redeliveries from several claimers.
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let engine = env.engine();
        let p = p.clone();
        tasks.push(tokio::spawn(async move {
            engine
                .claim_batch(&[&p], Resend::ByRedelivery)
                .await
                .unwrap()
        }));
    }
    for t in tasks {
        assert_eq!(code_of(&t.await.unwrap()[0]), code_of(&first[0]));
    }
    let coll = env.coll("codes");
    assert_eq!(
        coll.count_documents(doc! {"order_id": "DUP-1"})
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        coll.count_documents(doc! {"pool": "dupes", "status": 1})
            .await
            .unwrap(),
        2
    );
    env.cleanup().await;
}

/// Two different orders sent under one id, naming different pools, at
/// the same moment: once `codes` is sharded by pool, its unique order-line
/// index is stated with the pool first, so only the order-id guard keeps
/// the id to one order. Exactly one of them gets codes; the other is a
/// conflict, and no code of its pool moves.
#[tokio::test]
async fn two_orders_under_one_id_in_two_pools_at_once_get_codes_for_one_of_them() {
    let env = TestEnv::with_pools("claims_one_id", &[("id-a", 60), ("id-b", 60)]).await;
    for round in 0..20 {
        let order = format!("TWIN-{round}");
        let mut tasks = Vec::new();
        for pool in ["id-a", "id-b", "id-a", "id-b"] {
            let engine = env.engine();
            let mut p = purchase(&order, pool);
            p.quantity = 2;
            tasks.push(tokio::spawn(async move {
                let got = engine.claim_batch(&[&p], Resend::ByRedelivery).await;
                (p.pool.clone(), got.expect("claim"))
            }));
        }
        let mut winners = HashSet::new();
        for t in tasks {
            let (pool, outcome) = t.await.unwrap();
            match outcome[0] {
                ClaimOutcome::Claimed { ref grants, .. } => {
                    assert_eq!(grants.len(), 2, "order {order} in {pool}: {grants:?}");
                    assert!(grants.iter().all(|g| g.pool == pool));
                    winners.insert(pool);
                }
                ClaimOutcome::Conflict { what } => assert_eq!(what, "pool"),
            }
        }
        assert_eq!(winners.len(), 1, "order {order} was granted in {winners:?}");
        let held = env
            .coll("codes")
            .count_documents(doc! {"order_id": &order})
            .await
            .unwrap();
        assert_eq!(held, 2, "order {order} holds {held} codes");
    }
    env.cleanup().await;
}

#[tokio::test]
async fn grants_carry_a_daily_grant_number_that_redeliveries_keep() {
    let env = TestEnv::with_pools("claims_grantno", &[("gno", 10)]).await;
    let engine = env.engine();
    let p = purchase("GNO-1", "gno");
    let first = engine
        .claim_batch(&[&p], Resend::ByRedelivery)
        .await
        .unwrap();
    let Some((grant, _)) = first[0].single() else {
        panic!("no grant")
    };
    let no = grant.grant_no.clone().expect("grant number");
    let today = chrono::Utc::now().format("%Y%m%d").to_string();
    assert!(no.starts_with(&format!("G{today}")), "{no}");
    assert!(no.len() >= 1 + 8 + 4);
    let again = engine
        .claim_batch(&[&p], Resend::ByRedelivery)
        .await
        .unwrap();
    let Some((g2, _)) = again[0].single() else {
        panic!("no grant")
    };
    assert_eq!(g2.grant_no.as_deref(), Some(no.as_str()));
    assert_eq!(
        g2.sms_pending()
            .expect("an issued grant has an SMS")
            .event_id,
        "sms:GNO-1"
    );
    env.cleanup().await;
}

#[tokio::test]
async fn a_redelivered_purchase_of_a_refunded_order_gets_no_second_code_and_no_text() {
    let env = TestEnv::with_pools("claims_refund", &[("refund", 5)]).await;
    let engine = env.engine();
    let p = purchase("REFUND-1", "refund");
    let first = engine
        .claim_batch(&[&p], Resend::ByRedelivery)
        .await
        .unwrap();
    let Some((grant, _)) = first[0].single() else {
        panic!("no grant")
    };
    assert!(!grant.revoked);
    env.store
        .void(
            codepool_store::lifecycle::CodeRef::Order("REFUND-1"),
            "refund",
        )
        .await
        .unwrap();
    let again = engine
        .claim_batch(&[&p], Resend::ByRedelivery)
        .await
        .unwrap();
    let Some((g2, fresh)) = again[0].single() else {
        panic!("no outcome")
    };
    assert!(!fresh);
    assert!(
        g2.revoked,
        "the order's code is void: the dispatcher must not text it"
    );
    assert_eq!(g2.code, grant.code);
    let coll = env.coll("codes");
    assert_eq!(
        coll.count_documents(doc! {"order_id": "REFUND-1"})
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        coll.count_documents(doc! {"pool": "refund", "status": 1})
            .await
            .unwrap(),
        0
    );
    assert_eq!(
        coll.count_documents(doc! {"pool": "refund", "status": 0})
            .await
            .unwrap(),
        4
    );
    env.cleanup().await;
}

#[tokio::test]
async fn a_claim_write_that_lands_whole_knows_its_grants_exactly_as_stored() {
    let env = TestEnv::with_pools("claims_write_grants", &[("wg", 6)]).await;
    let ids: Vec<_> = env
        .store
        .candidates_after("wg", 0, 10)
        .await
        .unwrap()
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    let store = &env.store;

    // Every statement lands: the write's grants are the stored ones. B's
    // event is owed by the relay (a backorder's), A's by its purchase.
    let by_relay = ClaimAssignment {
        resend: Resend::ByRelay,
        ..assign(ids[1], "wg", "B")
    };
    // A has no grant number (numbering was away): the field stays unset.
    let unnumbered = ClaimAssignment {
        grant_no: None,
        ..assign(ids[0], "wg", "A")
    };
    let write = store
        .claim_candidates(&[unnumbered, by_relay])
        .await
        .unwrap();
    assert!(write.order_taken.is_empty());
    let granted = write.granted.expect("a write that landed whole");
    let stored = store.grants_for_orders(&["A", "B"]).await.unwrap().line0();
    assert_eq!(granted.len(), 2);
    for order in ["A", "B"] {
        assert_eq!(
            granted[&(order.to_owned(), 0)],
            stored[order],
            "order {order}: the write's code differs from the stored one"
        );
    }
    assert!(!stored["A"].sms.awaiting_relay);
    assert_eq!(stored["A"].holder.as_ref().unwrap().grant_no, None);
    let raw = env.coll("codes");
    let absent =
        doc! {"order_id": "A", "grant_no": {"$exists": false}, "sms_pending": {"$exists": false}};
    assert_eq!(
        raw.count_documents(absent).await.unwrap(),
        1,
        "not even null"
    );
    assert!(stored["B"].holder.as_ref().unwrap().grant_no.is_some());
    assert!(stored["B"].sms.awaiting_relay);
    let soon = chrono::Utc::now() + chrono::Duration::seconds(5);
    let owed = store.unconfirmed_grants(soon, 10).await.unwrap();
    assert_eq!(owed.iter().map(|c| c.id).collect::<Vec<_>>(), vec![ids[1]]);
    store.mark_sms_published(&[("wg", ids[1])]).await.unwrap();
    assert!(store.unconfirmed_grants(soon, 10).await.unwrap().is_empty());

    // One candidate was taken already: which won is unknown to the write.
    let write = store
        .claim_candidates(&[assign(ids[1], "wg", "C"), assign(ids[2], "wg", "D")])
        .await
        .unwrap();
    assert!(write.order_taken.is_empty());
    assert!(
        write.granted.is_none(),
        "a write that lost a race guesses nothing"
    );
    let stored = store.grants_for_orders(&["C", "D"]).await.unwrap().line0();
    assert!(!stored.contains_key("C"));
    assert_eq!(stored["D"].id, ids[2]);

    // An order that holds a code is refused by the unique index; the rest
    // of the write still lands whole, without it.
    let write = store
        .claim_candidates(&[assign(ids[3], "wg", "A"), assign(ids[3], "wg", "E")])
        .await
        .unwrap();
    assert_eq!(write.order_taken, vec![0]);
    let granted = write.granted.expect("every statement not refused landed");
    assert_eq!(
        granted.keys().collect::<Vec<_>>(),
        vec![&("E".to_owned(), 0)]
    );
    assert_eq!(granted[&("E".to_owned(), 0)].id, ids[3]);

    // A holder stops the batch's single statement wherever it stands: the
    // claims before it landed, the rest land when claimed one by one, and
    // the refused order is named either way.
    let write = store
        .claim_candidates(&[assign(ids[4], "wg", "F"), assign(ids[5], "wg", "A")])
        .await
        .unwrap();
    assert_eq!(write.order_taken, vec![1]);
    let stored = store.grants_for_orders(&["F", "A"]).await.unwrap().line0();
    assert_eq!(stored["F"].id, ids[4]);
    assert_eq!(stored["A"].id, ids[0], "A keeps its code");
    if let Some(granted) = write.granted {
        assert_eq!(granted[&("F".to_owned(), 0)], stored["F"]);
    }
    let coll = env.coll("codes");
    let unissued = coll
        .count_documents(doc! {"_id": codepool_store::object_id(ids[5]), "status": 0})
        .await
        .unwrap();
    assert_eq!(
        unissued, 1,
        "the refused order's candidate stays in the pool"
    );
    env.cleanup().await;
}
