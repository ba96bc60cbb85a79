//! Orders for several codes against the real servers: every order holds
//! exactly its quantity of distinct codes, whatever the redeliveries,
//! duplicates, kill -9s and number of dispatchers; stock that runs short
//! is backordered by line and sent as a second part; per-user limits count
//! codes; an order id reused by another order gets nothing.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use bson::doc;
use codepool_domain::{Purchase, SmsPending};

use crate::common::*;
use crate::fixtures::*;

fn of(order: &str, pool: &str, quantity: u32) -> Purchase {
    Purchase {
        quantity,
        ..purchase(order, pool)
    }
}

/// A CSV file of these codes, with a header.
fn csv(codes: &[String]) -> tempfile::NamedTempFile {
    use std::io::Write;
    let mut f = tempfile::NamedTempFile::new().unwrap();
    writeln!(f, "code").unwrap();
    for c in codes {
        writeln!(f, "{c}").unwrap();
    }
    f
}

/// The issued codes of `pool` in MongoDB: (order, line) → code.
async fn held(env: &TestEnv, pool: &str) -> HashMap<(String, u32), String> {
    let codes = env
        .store
        .find_codes(&codepool_store::CodeQuery::GrantsOf(pool), 1_000_000)
        .await
        .expect("codes");
    let mut out = HashMap::new();
    for c in codes {
        let h = c.holder.clone().expect("a grant has a holder");
        let prev = out.insert((h.order_id.clone(), h.line), c.code.clone());
        assert!(
            prev.is_none(),
            "two codes on line {} of {}",
            h.line,
            h.order_id
        );
    }
    out
}

/// Every SMS-pending event in the queue, taken.
async fn events(ch: &lapin::Channel, env: &TestEnv) -> Vec<SmsPending> {
    drain(ch, &env.topology().sms_pending)
        .await
        .iter()
        .map(|e| {
            let ev: SmsPending = serde_json::from_slice(&e.body).expect("an SMS-pending event");
            assert_eq!(e.message_id.as_deref(), Some(ev.event_id.as_str()));
            ev
        })
        .collect()
}

/// SIGKILL: no graceful stop, deliveries in flight go back to the queue.
async fn kill_9(mut d: Daemon) {
    d.child.start_kill().expect("kill -9");
    let _ = d.child.wait().await;
}

#[tokio::test]
async fn orders_of_one_to_ten_codes_over_three_dispatchers_with_kill_9s_get_exactly_their_quantity()
{
    let env = TestEnv::with_pools("quantity_chaos", &[("qc", 12_000)]).await;
    let (conn, publisher) = env.amqp().await;
    let orders: Vec<Purchase> = (0..2000)
        .map(|i| of(&format!("QC-{i:05}"), "qc", (i % 10 + 1) as u32))
        .collect();
    let wanted: u32 = orders.iter().map(|p| p.quantity).sum();
    // 10% duplicated, each right behind its original or much later.
    let mut stream: Vec<&Purchase> = Vec::new();
    for (i, p) in orders.iter().enumerate() {
        stream.push(p);
        if i % 20 == 0 {
            stream.push(p);
        }
    }
    stream.extend(orders.iter().skip(5).step_by(20));
    let mut daemons = vec![
        start_daemon(env.command(&[])).await,
        start_daemon(env.command(&[])).await,
        start_daemon(env.command(&[])).await,
    ];
    let ch = conn.create_channel().await.unwrap();
    let t = env.topology();
    let mut confirms = Vec::new();
    for (k, p) in stream.iter().enumerate() {
        confirms.push(publisher.publish_purchase(p).await.unwrap());
        // Two kill -9s while purchases flow, each replaced by a new process.
        if k == stream.len() / 3 || k == 2 * stream.len() / 3 {
            tokio::time::sleep(Duration::from_millis(300)).await;
            kill_9(daemons.remove(0)).await;
            daemons.push(start_daemon(env.command(&[])).await);
        }
    }
    for c in confirms {
        c.wait().await.unwrap();
    }
    let issued = env.coll("codes");
    eventually(Duration::from_secs(240), "every code issued", || {
        let (issued, ch, q) = (issued.clone(), ch.clone(), t.purchases.clone());
        async move {
            issued
                .count_documents(doc! {"pool": "qc", "status": 1})
                .await
                .unwrap()
                >= u64::from(wanted)
                && queue_depth(&ch, &q).await == 0
        }
    })
    .await;
    for d in daemons {
        d.stop().await;
    }
    assert_eq!(
        queue_depth(&ch, &t.purchases).await,
        0,
        "nothing left unacked once the dispatchers are gone"
    );
    assert_eq!(queue_depth(&ch, &t.purchases_dead).await, 0);

    // Every order holds exactly its quantity, one code per line.
    let held = held(&env, "qc").await;
    assert_eq!(held.len() as u32, wanted, "never a code beyond a quantity");
    for p in &orders {
        for line in 0..p.quantity {
            assert!(
                held.contains_key(&(p.order_id.clone(), line)),
                "{} has no code on line {line} of {}",
                p.order_id,
                p.quantity
            );
        }
    }
    let distinct: HashSet<&String> = held.values().collect();
    assert_eq!(distinct.len(), held.len(), "a code went to two lines");

    // Every code reached an SMS-pending event, always its own.
    let mut evented: HashSet<(String, u32)> = HashSet::new();
    for ev in events(&ch, &env).await {
        let q = orders
            .iter()
            .find(|p| p.order_id == ev.order_id)
            .expect("an event of a known order")
            .quantity;
        assert_eq!(ev.quantity.unwrap_or(1), q);
        for c in ev.all_codes() {
            assert_eq!(
                held.get(&(ev.order_id.clone(), c.line)),
                Some(&c.code),
                "event {} carries a code its order does not hold",
                ev.event_id
            );
            evented.insert((ev.order_id.clone(), c.line));
        }
    }
    let unsent: Vec<_> = held.keys().filter(|k| !evented.contains(*k)).collect();
    assert!(unsent.is_empty(), "codes without an event: {unsent:?}");
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}

#[tokio::test]
async fn an_order_for_ten_against_a_pool_of_four_gets_four_now_and_six_after_an_import() {
    let env = TestEnv::new("quantity_partial").await;
    // Imported from a file, as partners deliver them: each code carries
    // its line in the file, which has nothing to do with its order's lines.
    let first = csv(&(0..4).map(|i| format!("QP-OLD-{i:03}")).collect::<Vec<_>>());
    codepool_ok(
        &env,
        &["import", first.path().to_str().unwrap(), "--pool", "qp"],
    )
    .await;
    let d = start_daemon(env.command(&[])).await;
    let (conn, publisher) = env.amqp().await;
    let order = of("QP-1", "qp", 10);
    publish_confirmed(&publisher, std::slice::from_ref(&order)).await;
    let ch = conn.create_channel().await.unwrap();
    let t = env.topology();
    // The first part.
    wait_depth(&ch, &t.sms_pending, 30, |n| n >= 1).await;
    let lookup = codepool_ok(&env, &["lookup", "--order", "QP-1", "--json"]).await;
    let found: serde_json::Value = serde_json::from_str(&lookup).unwrap();
    assert_eq!(found["codes"].as_array().unwrap().len(), 4, "{lookup}");
    assert_eq!(
        found["backorders"][0]["waiting_lines"],
        serde_json::json!([4, 5, 6, 7, 8, 9])
    );
    // A redelivery meanwhile changes nothing: the same four, the same event.
    publish_confirmed(&publisher, std::slice::from_ref(&order)).await;
    // Handled before the import: on a busy machine it could otherwise be
    // taken after the backorder was served, and re-send the whole order.
    // The first part re-sent.
    wait_depth(&ch, &t.sms_pending, 30, |n| n >= 2).await;

    let more = csv(&(0..20)
        .map(|i| format!("QP-NEW-{i:03}"))
        .collect::<Vec<_>>());
    codepool_ok(
        &env,
        &["import", more.path().to_str().unwrap(), "--pool", "qp"],
    )
    .await;
    let backorders = env.coll("backorders");
    eventually(Duration::from_secs(30), "the backorder fulfilled", || {
        let b = backorders.clone();
        async move {
            b.count_documents(doc! {"order_id": "QP-1", "status": "fulfilled"})
                .await
                .unwrap()
                == 1
        }
    })
    .await;
    // Three events.
    wait_depth(&ch, &t.sms_pending, 10, |n| n >= 3).await;
    d.stop().await;
    let held = held(&env, "qp").await;
    assert_eq!(held.len(), 10, "exactly ten, never more");
    let mut by_id: HashMap<String, Vec<u32>> = HashMap::new();
    for ev in events(&ch, &env).await {
        assert!(ev.code.is_none(), "an order of several has no single code");
        assert_eq!(ev.quantity, Some(10));
        let lines: Vec<u32> = ev.codes.iter().map(|c| c.line).collect();
        if let Some(before) = by_id.insert(ev.event_id.clone(), lines.clone()) {
            assert_eq!(before, lines, "one id, one content");
        }
    }
    assert_eq!(
        by_id,
        HashMap::from([
            ("sms:QP-1:0-3".to_owned(), vec![0, 1, 2, 3]),
            ("sms:QP-1:4-9".to_owned(), vec![4, 5, 6, 7, 8, 9]),
        ]),
        "two parts, two events; the redelivery re-sent the first"
    );
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_per_user_limit_counts_codes_and_refuses_an_order_whole() {
    let env = TestEnv::with_pools("quantity_limit", &[("ql", 50)]).await;
    pool_set(&env, "ql", &["--per-user", "3"]).await;
    let d = start_daemon(env.command(&[])).await;
    let (conn, publisher) = env.amqp().await;
    let buyer = |order: &str, q| Purchase {
        uid: "buyer-1".into(),
        ..of(order, "ql", q)
    };
    // One after the other, each settled before the next: the buyer's
    // first, second and third order.
    let ch = conn.create_channel().await.unwrap();
    let t = env.topology();
    let settled = |events: u32, refused: u64| {
        let (ch, q, store) = (ch.clone(), t.sms_pending.clone(), env.store.clone());
        async move {
            queue_depth(&ch, &q).await >= events
                && store.refusal_count("ql").await.unwrap() >= refused
        }
    };
    publish_confirmed(&publisher, &[buyer("QL-1", 2)]).await;
    eventually(Duration::from_secs(30), "QL-1 granted", || settled(1, 0)).await;
    publish_confirmed(&publisher, &[buyer("QL-2", 2)]).await;
    eventually(Duration::from_secs(30), "QL-2 refused", || settled(1, 1)).await;
    publish_confirmed(&publisher, &[buyer("QL-3", 1)]).await;
    eventually(Duration::from_secs(30), "QL-3 granted", || settled(2, 1)).await;
    let refusals = env.store.refusals_for_orders(&["QL-1", "QL-2", "QL-3"]);
    let refused: Vec<String> = refusals
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.order_id)
        .collect();
    assert_eq!(refused, ["QL-2"], "the second order would take 4 codes");
    d.stop().await;
    let held = held(&env, "ql").await;
    let mut lines: Vec<(String, u32)> = held.into_keys().collect();
    lines.sort();
    assert_eq!(
        lines,
        [("QL-1".into(), 0), ("QL-1".into(), 1), ("QL-3".into(), 0)],
        "the first and third granted whole, the second not at all"
    );
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}

#[tokio::test]
async fn an_order_id_reused_by_another_order_or_a_bad_quantity_is_dead_lettered() {
    let env = TestEnv::with_pools("quantity_conflict", &[("qx", 50), ("qy", 50)]).await;
    let d = start_daemon(env.command(&[])).await;
    let (conn, publisher) = env.amqp().await;
    let first = of("QX-1", "qx", 2);
    publish_confirmed(&publisher, std::slice::from_ref(&first)).await;
    let ch = conn.create_channel().await.unwrap();
    let t = env.topology();
    // The first order.
    wait_depth(&ch, &t.sms_pending, 30, |n| n >= 1).await;
    let conflicting = [
        of("QX-1", "qx", 5),
        of("QX-1", "qy", 2),
        Purchase {
            uid: "another-buyer".into(),
            ..first.clone()
        },
    ];
    publish_confirmed(&publisher, &conflicting).await;
    let bad: [&[u8]; 5] = [
        br#"{"order_id":"QB-0","uid":"u","phone":"+8613800000000","pool":"qx","quantity":0}"#,
        br#"{"order_id":"QB-1","uid":"u","phone":"+8613800000000","pool":"qx","quantity":-2}"#,
        br#"{"order_id":"QB-2","uid":"u","phone":"+8613800000000","pool":"qx","quantity":2.5}"#,
        br#"{"order_id":"QB-3","uid":"u","phone":"+8613800000000","pool":"qx","quantity":"2"}"#,
        br#"{"order_id":"QB-4","uid":"u","phone":"+8613800000000","pool":"qx","quantity":101}"#,
    ];
    for body in bad {
        publish_bytes(&publisher, body, None).await;
    }
    // Eight dead letters.
    wait_depth(&ch, &t.purchases_dead, 30, |n| n >= 8).await;
    d.stop().await;
    let mut reasons: Vec<String> = drain(&ch, &t.purchases_dead)
        .await
        .into_iter()
        .map(|d| {
            let r = d.reason.unwrap_or_default();
            r.split(':').next().unwrap_or_default().to_owned()
        })
        .collect();
    reasons.sort();
    assert_eq!(
        reasons,
        [
            "conflicting_order",
            "conflicting_order",
            "conflicting_order",
            "invalid_quantity",
            "invalid_quantity",
            "invalid_quantity",
            "invalid_quantity",
            "invalid_quantity"
        ]
    );
    let qx = held(&env, "qx").await;
    assert_eq!(qx.len(), 2, "the first order stands, with its two codes");
    assert!(held(&env, "qy").await.is_empty());
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}

#[tokio::test]
async fn void_and_redeem_by_order_act_on_every_code_and_by_code_on_one() {
    let env = TestEnv::with_pools("quantity_ops", &[("qo", 3)]).await;
    let d = start_daemon(env.command(&[])).await;
    let (_conn, publisher) = env.amqp().await;
    // QO-1 first and whole, then QO-2 gets the last code and waits for two.
    publish_confirmed(&publisher, &[of("QO-1", "qo", 2)]).await;
    let codes = env.coll("codes");
    eventually(Duration::from_secs(30), "QO-1 granted", || {
        let c = codes.clone();
        async move { c.count_documents(doc! {"order_id": "QO-1"}).await.unwrap() == 2 }
    })
    .await;
    publish_confirmed(&publisher, &[of("QO-2", "qo", 3)]).await;
    let backorders = env.coll("backorders");
    eventually(Duration::from_secs(30), "QO-2 partly backordered", || {
        let b = backorders.clone();
        async move {
            b.count_documents(doc! {"order_id": "QO-2", "status": "waiting"})
                .await
                .unwrap()
                == 1
        }
    })
    .await;
    d.stop().await;
    let held = held(&env, "qo").await;
    assert_eq!(held.len(), 3);

    // redeem --code: that one code only.
    let one = &held[&("QO-1".to_owned(), 1)];
    let out = codepool_ok(&env, &["redeem", "--pool", "qo", "--code", one]).await;
    assert_eq!(out.lines().count(), 1, "{out}");
    // void --order: every code it holds, and what it still waits for.
    let out = codepool_ok(&env, &["void", "--order", "QO-2", "--reason", "refund"]).await;
    assert!(out.contains("backorder"), "{out}");
    // redeem --order: the one code of QO-1 still issued.
    let out = codepool_ok(&env, &["redeem", "--order", "QO-1"]).await;
    assert_eq!(out.lines().count(), 1, "{out}");

    let statuses: HashMap<(String, u32), String> = env
        .store
        .find_codes(&codepool_store::CodeQuery::GrantsOf("qo"), 100)
        .await
        .unwrap()
        .into_iter()
        .map(|c| {
            let h = c.holder.clone().unwrap();
            ((h.order_id, h.line), c.status.name().to_owned())
        })
        .collect();
    assert_eq!(statuses[&("QO-1".to_owned(), 0)], "used");
    assert_eq!(statuses[&("QO-1".to_owned(), 1)], "used");
    let voided = statuses
        .iter()
        .filter(|((o, _), s)| o == "QO-2" && *s == "void")
        .count();
    assert_eq!(voided, held.keys().filter(|(o, _)| o == "QO-2").count());
    assert_eq!(
        backorders
            .count_documents(doc! {"order_id": "QO-2", "status": "cancelled"})
            .await
            .unwrap(),
        1
    );
    // export: one row per code, with its line.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("qo.csv");
    codepool_ok(
        &env,
        &[
            "export",
            "--pool",
            "qo",
            "--status",
            "used,void",
            "--out",
            path.to_str().unwrap(),
        ],
    )
    .await;
    let csv = std::fs::read_to_string(&path).unwrap();
    let mut rows = csv.lines();
    let header: Vec<&str> = rows.next().unwrap().split(',').collect();
    let line_col = header
        .iter()
        .position(|h| *h == "line")
        .expect("a line column");
    let order_col = header.iter().position(|h| *h == "order_id").unwrap();
    let mut exported: Vec<(String, String)> = rows
        .map(|r| {
            let cells: Vec<&str> = r.split(',').collect();
            (cells[order_col].to_owned(), cells[line_col].to_owned())
        })
        .collect();
    exported.sort();
    assert_eq!(exported.len(), 3, "{csv}");
    assert_eq!(exported[0], ("QO-1".to_owned(), "0".to_owned()));
    assert_eq!(exported[1], ("QO-1".to_owned(), "1".to_owned()));
    env.cleanup().await;
}

/// The last code of a pool, raced by two batches at once (their refills
/// both find it): exactly one order gets it, every round.
#[tokio::test]
async fn the_last_code_raced_by_two_batches_goes_to_exactly_one_order() {
    let env = TestEnv::new("quantity_race").await;
    for round in 0..40 {
        let pool = format!("t{round}");
        env.fill_pool(&pool, 1).await;
        let (e1, e2) = (env.engine(), env.engine());
        let a = [purchase(&format!("A{round}"), &pool)];
        let b = [
            purchase(&format!("B{round}"), &pool),
            purchase(&format!("C{round}"), &pool),
        ];
        let (ra, rb) = tokio::join!(
            async {
                let refs: Vec<&Purchase> = a.iter().collect();
                e1.claim_batch(&refs, codepool_issuance::Resend::ByRedelivery)
                    .await
            },
            async {
                let refs: Vec<&Purchase> = b.iter().collect();
                e2.claim_batch(&refs, codepool_issuance::Resend::ByRedelivery)
                    .await
            }
        );
        let granted = ra
            .unwrap()
            .iter()
            .chain(rb.unwrap().iter())
            .filter(|o| !o.grants().is_empty())
            .count();
        assert_eq!(granted, 1, "round {round}");
    }
}
