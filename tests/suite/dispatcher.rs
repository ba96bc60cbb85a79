//! The dispatcher end to end through RabbitMQ, as a real process. Input a
//! hostile or careless producer sends ends as a dead letter with the right
//! reason, and nothing untrusted or noisy reaches the logs; a long
//! multibyte order id is granted, texted and refused without costing the
//! other orders of its batch.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use bson::doc;
use std::sync::Arc;

use codepool_broker::{Publisher, Topology};
use codepool_domain::{SmsPending, SmsState};
use codepool_issuance::relay::relay_unconfirmed;
use codepool_issuance::{Outbox, Resend};
use codepool_store::pool_settings::PoolSettings;
use lapin::options::BasicGetOptions;

use crate::common::*;
use crate::fixtures::*;

#[tokio::test]
async fn every_order_gets_exactly_one_code_through_amqp_and_invalid_messages_are_dead_lettered() {
    let env = TestEnv::with_pools("dispatch_e2e", &[("e2e", 1200)]).await;
    let dispatcher = start_daemon(env.command(&[])).await;

    let (conn, publisher) = env.amqp().await;
    let orders: Vec<_> = (0..1000)
        .map(|i| purchase(&format!("E2E-{i:05}"), "e2e"))
        .collect();
    let mut confirms = Vec::new();
    for p in &orders {
        confirms.push(publisher.publish_purchase(p).await.unwrap());
    }
    // 100 duplicates of earlier orders.
    for p in orders.iter().step_by(10) {
        confirms.push(publisher.publish_purchase(p).await.unwrap());
    }
    let invalid: Vec<&[u8]> = vec![
        b"not json",
        br#"{"order_id":7,"uid":"u","phone":"+8613800000000","pool":"e2e"}"#,
        br#"{"uid":"u","phone":"+8613800000000","pool":"e2e"}"#,
        br#"{"order_id":"BAD-POOL","uid":"u","phone":"+8613800000000","pool":"no-such-pool"}"#,
        br#"{"order_id":"BAD-PHONE","uid":"u","phone":"call me","pool":"e2e"}"#,
    ];
    for body in &invalid {
        confirms.push(publisher.publish_purchase_bytes(body, None).await.unwrap());
    }
    for c in confirms {
        c.wait().await.unwrap();
    }

    let ch = conn.create_channel().await.unwrap();
    let t = env.topology();
    // Settled (acked) by the dispatcher, as its metrics count them: the
    // queues alone cannot tell, since deliveries it holds unacked are not
    // in the queue's count, and a publish it had to repeat (confirms slow
    // under load) adds an event before its purchase is acked.
    let addr = dispatcher.addr.clone();
    eventually(Duration::from_secs(60), "all purchases processed", || {
        let ch = ch.clone();
        let t = t.clone();
        let addr = addr.clone();
        async move {
            queue_depth(&ch, &t.sms_pending).await >= 1100
                && queue_depth(&ch, &t.purchases_dead).await >= 5
                && queue_depth(&ch, &t.purchases).await == 0
                && metric_sum(&[&addr], "codepool_end_to_end_seconds_count").await >= 1105.0
        }
    })
    .await;

    // SIGTERM: clean exit, quickly.
    let log = dispatcher.log.clone();
    let stopping = Instant::now();
    dispatcher.stop().await;
    assert!(stopping.elapsed() < Duration::from_secs(10));

    // Nothing left unacked: after the consumer is gone, the queue is empty.
    let left = queue_depth(&ch, &t.purchases).await;
    let warnings: Vec<String> = log
        .lock()
        .map(|l| {
            l.iter()
                .filter(|line| !line.contains(" INFO "))
                .cloned()
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(
        left,
        0,
        "purchases back in the queue after the stop; the dispatcher's warnings:\n{}",
        warnings.join("\n")
    );

    // In MongoDB: every order exactly one code.
    let codes = env.coll("codes");
    assert_eq!(
        codes
            .count_documents(doc! {"pool": "e2e", "status": 1})
            .await
            .unwrap(),
        1000
    );
    let ids: Vec<&str> = orders.iter().map(|p| p.order_id.as_str()).collect();
    let grants = env.store.grants_for_orders(&ids).await.unwrap().line0();
    assert_eq!(grants.len(), 1000);

    // Events: one code per order, never one code for two orders.
    let events = drain(&ch, &t.sms_pending).await;
    assert_eq!(
        events.len(),
        1100,
        "one event per delivery, duplicates re-sent"
    );
    let mut code_of: HashMap<String, String> = HashMap::new();
    for e in &events {
        let ev: SmsPending = serde_json::from_slice(&e.body).unwrap();
        assert_eq!(ev.event_id, format!("sms:{}", ev.order_id));
        assert_eq!(e.message_id.as_deref(), Some(ev.event_id.as_str()));
        let code = ev.code.clone().expect("an order of one code");
        let prev = code_of.insert(ev.order_id.clone(), code.clone());
        assert!(
            prev.is_none_or(|c| c == code),
            "order {} got two codes",
            ev.order_id
        );
        assert_eq!(Some(&grants[&ev.order_id].code), ev.code.as_ref());
    }
    let distinct: HashSet<&String> = code_of.values().collect();
    assert_eq!(distinct.len(), 1000, "a code went to two orders");

    // Exactly the invalid messages are dead-lettered, each with a reason.
    let dead = drain(&ch, &t.purchases_dead).await;
    assert_eq!(dead.len(), invalid.len());
    let reasons: Vec<String> = dead
        .iter()
        .map(|d| d.reason.clone().unwrap_or_default())
        .collect();
    for expected in [
        "not_json",
        "wrong_type",
        "missing_field",
        "unknown_pool",
        "invalid_phone",
    ] {
        assert!(
            reasons.iter().any(|r| r.starts_with(expected)),
            "no dead letter with reason {expected}: {reasons:?}"
        );
    }
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}

#[tokio::test]
async fn an_empty_pool_turns_purchases_into_backorders_fulfilled_after_the_next_import() {
    let env = TestEnv::with_pools("dispatch_backorder", &[("bo", 5)]).await;
    let dispatcher = start_daemon(env.command(&[])).await;
    let (conn, publisher) = env.amqp().await;
    let orders: Vec<_> = (0..20)
        .map(|i| purchase(&format!("BO-{i:03}"), "bo"))
        .collect();
    publish_confirmed(&publisher, &orders).await;
    let backorders = env.coll("backorders");
    eventually(Duration::from_secs(30), "15 backorders", || {
        let b = backorders.clone();
        async move {
            b.count_documents(doc! {"pool": "bo", "status": "waiting"})
                .await
                .unwrap()
                == 15
        }
    })
    .await;

    // New codes arrive through `codepool import`, which announces them.
    let mut f = tempfile::NamedTempFile::new().unwrap();
    use std::io::Write;
    writeln!(f, "code").unwrap();
    for i in 0..30 {
        writeln!(f, "BO-NEW-{i:03}").unwrap();
    }
    codepool_ok(
        &env,
        &["import", f.path().to_str().unwrap(), "--pool", "bo"],
    )
    .await;
    eventually(Duration::from_secs(30), "backorders fulfilled", || {
        let b = backorders.clone();
        async move {
            b.count_documents(doc! {"pool": "bo", "status": "fulfilled"})
                .await
                .unwrap()
                == 15
        }
    })
    .await;
    let ids: Vec<&str> = orders.iter().map(|p| p.order_id.as_str()).collect();
    let grants = env.store.grants_for_orders(&ids).await.unwrap().line0();
    assert_eq!(grants.len(), 20, "every order holds a code");
    let distinct: HashSet<&String> = grants.values().map(|g| &g.code).collect();
    assert_eq!(distinct.len(), 20);
    let ch = conn.create_channel().await.unwrap();
    eventually(Duration::from_secs(10), "20 SMS events", || {
        let ch = ch.clone();
        let q = env.topology().sms_pending;
        async move { queue_depth(&ch, &q).await == 20 }
    })
    .await;
    dispatcher.stop().await;
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}

#[tokio::test]
async fn dead_letters_are_listed_with_their_reason_and_replayed_once_the_pool_exists() {
    let env = TestEnv::with_pools("dispatch_replay", &[("known", 5)]).await;
    let dispatcher = start_daemon(env.command(&[])).await;
    let (conn, publisher) = env.amqp().await;
    let late = purchase("LATE-1", "late-pool");
    publish_one(&publisher, &late).await;
    publish_bytes(&publisher, b"garbage", Some("GARBAGE-1")).await;
    let ch = conn.create_channel().await.unwrap();
    let dead_q = env.topology().purchases_dead;
    eventually(Duration::from_secs(20), "two dead letters", || {
        let ch = ch.clone();
        let q = dead_q.clone();
        async move { queue_depth(&ch, &q).await == 2 }
    })
    .await;

    let out = env.run(&["dead-letters", "list", "--json"]).await;
    assert!(out.status.success());
    let listed: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(listed.len(), 2);
    assert!(listed.iter().any(|m| m["message_id"] == "LATE-1"
        && m["reason"].as_str().unwrap().starts_with("unknown_pool")));
    // Listing peeks and returns what it peeked: the broker puts the
    // messages back as the listing's channel closes, a moment later.
    // Listing must not consume.
    wait_depth(&ch, &dead_q, 5, |n| n == 2).await;

    // Fix the cause (the pool gets codes), then replay only that reason.
    env.fill_pool("late-pool", 3).await;
    codepool_ok(
        &env,
        &["dead-letters", "replay", "--reason", "unknown_pool"],
    )
    .await;
    eventually(
        Duration::from_secs(20),
        "the replayed purchase to be granted",
        || {
            let store = env.store.clone();
            async move {
                store
                    .grants_for_orders(&["LATE-1"])
                    .await
                    .unwrap()
                    .line0()
                    .len()
                    == 1
            }
        },
    )
    .await;
    let left = drain(&ch, &dead_q).await;
    assert_eq!(left.len(), 1, "the garbage message stays dead-lettered");
    assert_eq!(left[0].message_id.as_deref(), Some("GARBAGE-1"));
    dispatcher.stop().await;
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}

#[tokio::test]
async fn a_purchase_redelivered_up_to_the_delivery_limit_is_dead_lettered_with_its_reason() {
    let env = TestEnv::with_pools("delivery_limit", &[("limit", 10)]).await;
    let (conn, publisher, topology) = with_delivery_limit(&env).await;
    let poison = purchase("POISON-1", "limit");
    publish_confirmed(&publisher, std::slice::from_ref(&poison)).await;

    // The third delivery reaches the limit: dead-lettered with its reason, no code.
    let ch = deliver_past_the_limit(&env, &conn, &topology).await;
    let dead = drain(&ch, &topology.purchases_dead).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].message_id.as_deref(), Some("POISON-1"));
    let reason = dead[0].reason.clone().unwrap_or_default();
    assert!(reason.starts_with("delivery_limit"), "reason: {reason}");
    let granted = count_codes(&env, doc! {"order_id": "POISON-1"}).await;
    assert_eq!(granted, 0, "a dead-lettered purchase gets no code");
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}

/// A purchase's grant leaves nothing for the relay: the purchase is its
/// outbox, redelivered until its event is confirmed. When it is not
/// redelivered again (dead-lettered at its delivery limit, after a delivery
/// that claimed a code and crashed before its confirm), its grant is handed
/// to the relay, which sends the event and records it.
#[tokio::test]
async fn a_grant_whose_purchase_hit_the_delivery_limit_gets_its_event_from_the_relay() {
    let env = TestEnv::with_pools("limit_relay", &[("lr", 10)]).await;
    let (conn, publisher, topology) = with_delivery_limit(&env).await;
    let crashed = purchase("LR-1", "lr");
    publish_confirmed(&publisher, std::slice::from_ref(&crashed)).await;

    // The first delivery claims a code, then "crashes" before its confirm.
    let outcome = env
        .engine()
        .claim_batch(&[&crashed], Resend::ByRedelivery)
        .await
        .unwrap();
    let Some((grant, true)) = outcome[0].single() else {
        panic!("no fresh grant: {outcome:?}")
    };
    let soon = chrono::Utc::now() + chrono::Duration::seconds(5);
    assert!(
        env.store
            .unconfirmed_grants(soon, 10)
            .await
            .unwrap()
            .is_empty(),
        "a purchase's grant is not on the relay's list"
    );
    let ch = deliver_past_the_limit(&env, &conn, &topology).await;
    assert_eq!(drain(&ch, &topology.purchases_dead).await.len(), 1);
    assert!(
        drain(&ch, &topology.sms_pending).await.is_empty(),
        "no event yet"
    );

    // The grant is the relay's now; the relay sends it once and records it.
    let owed = env.store.unconfirmed_grants(soon, 10).await.unwrap();
    assert_eq!(owed.len(), 1, "handed to the relay");
    assert_eq!(owed[0].id, grant.code_id);
    assert_eq!(owed[0].sms_state(), SmsState::Pending);
    let outbox = Outbox::new(Arc::new(env.store.clone()));
    let relayed = relay_unconfirmed(&env.store, &outbox, &publisher, Duration::ZERO, 10)
        .await
        .unwrap();
    assert_eq!(relayed, 1);
    let events = drain(&ch, &topology.sms_pending).await;
    assert_eq!(events.len(), 1);
    let event: SmsPending = serde_json::from_slice(&events[0].body).unwrap();
    assert_eq!(
        (event.order_id.as_str(), event.code.as_deref().unwrap_or("")),
        ("LR-1", grant.code.as_str())
    );
    assert!(env
        .store
        .unconfirmed_grants(soon, 10)
        .await
        .unwrap()
        .is_empty());
    let code = env
        .store
        .grants_for_orders(&["LR-1"])
        .await
        .unwrap()
        .line0()["LR-1"]
        .clone();
    assert!(code.sms.published_at.is_some());
    assert_eq!(code.sms_state(), SmsState::Queued);
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}

/// A connection, a publisher and this test's topology with a delivery
/// limit of 2 on `purchases`, declared.
async fn with_delivery_limit(env: &TestEnv) -> (lapin::Connection, Publisher, Topology) {
    let mut topology = env.topology();
    topology.queues.delivery_limit = 2;
    let conn = codepool_broker::connect(AMQP_URL, "test").await.unwrap();
    let publisher = Publisher::new(&conn, topology.clone())
        .await
        .unwrap()
        .as_user("guest");
    topology.declare(publisher.channel()).await.unwrap();
    (conn, publisher, topology)
}

/// Takes the queued purchase twice without settling it (as if a dispatcher
/// crashed on it each time), then runs a dispatcher with the same limit
/// until the third delivery is dead-lettered, and stops it. Returns a
/// channel to drain the queues with.
async fn deliver_past_the_limit(
    env: &TestEnv,
    conn: &lapin::Connection,
    topology: &Topology,
) -> lapin::Channel {
    for _ in 0..2 {
        let ch = conn.create_channel().await.unwrap();
        let got = ch
            .basic_get(&topology.purchases, BasicGetOptions::default())
            .await
            .unwrap();
        assert!(got.is_some(), "the purchase is still queued");
        let _ = ch.close(200, "crashed").await;
    }
    let mut cmd = env.command(&[]);
    cmd.env("CODEPOOL_DELIVERY_LIMIT", "2");
    let dispatcher = start_daemon(cmd).await;
    let ch = conn.create_channel().await.unwrap();
    // The dead letter.
    wait_depth(&ch, &topology.purchases_dead, 30, |n| n >= 1).await;
    dispatcher.stop().await;
    ch
}

/// A queue that refuses publishes for a while (a quorum queue electing a
/// new leader after a node loss does) must not send valid purchases round
/// a requeue loop to the delivery limit: the batch publishes its events
/// again, with backoff, and the purchase is settled from its first
/// delivery once the queue accepts them.
#[tokio::test]
async fn events_the_broker_refuses_are_published_again_without_requeueing_the_purchase() {
    let env = TestEnv::with_pools("republish", &[("rp", 10)]).await;
    // A delivery limit of 2: a purchase requeued on each refusal would be
    // dead-lettered at its third delivery.
    let (conn, publisher, t) = with_delivery_limit(&env).await;
    let policy = format!("{}refuse", env.amqp_prefix);
    let pattern = format!("^{}$", t.sms_pending.replace('.', "\\."));
    rabbitmqctl(&[
        "set_policy",
        "--apply-to",
        "queues",
        "--priority",
        "100",
        &policy,
        &pattern,
        r#"{"max-length":1,"overflow":"reject-publish"}"#,
    ])
    .await;
    // A queue at its length limit refuses publishes: fill it until the
    // broker refuses one.
    let mut fillers = 0;
    loop {
        let confirm = publisher
            .publish("", &t.sms_pending, b"filler", Default::default())
            .await
            .unwrap();
        if confirm.wait().await.is_err() {
            break;
        }
        fillers += 1;
        assert!(fillers < 10, "the policy does not refuse publishes");
    }
    // Each refused publish of an SMS event is logged (at debug).
    let mut cmd = env.command(&[]);
    cmd.env("CODEPOOL_DELIVERY_LIMIT", "2")
        .env("RUST_LOG", "info,codepool_issuance::outbox=debug");
    let dispatcher = start_daemon(cmd).await;
    publish_confirmed(&publisher, &[purchase("RP-1", "rp")]).await;

    // The event is refused three times, each once the one before was
    // (whatever that takes on this machine); nothing is dead-lettered.
    let ch = conn.create_channel().await.unwrap();
    eventually(Duration::from_secs(30), "the grant", || async {
        dispatcher.log_text().contains("order_id=RP-1")
    })
    .await;
    eventually(Duration::from_secs(30), "three refused publishes", || {
        let (ch, q) = (ch.clone(), t.purchases_dead.clone());
        let refused = (dispatcher.log_text())
            .matches("SMS-pending event not confirmed")
            .count();
        async move { refused >= 3 || queue_depth(&ch, &q).await > 0 }
    })
    .await;
    assert_eq!(queue_depth(&ch, &t.purchases_dead).await, 0);
    // Room in the queue again: the next publish goes through. It may go
    // through while the fillers are being drained, and be drained with them.
    let drained = drain(&ch, &t.sms_pending).await;
    let (filler, event): (Vec<_>, Vec<_>) = drained.iter().partition(|m| m.body == b"filler");
    assert_eq!(filler.len(), fillers, "the fillers");
    let events_drained = event.len();
    eventually(Duration::from_secs(30), "the SMS event", || {
        let (ch, q) = (ch.clone(), t.sms_pending.clone());
        async move { events_drained + queue_depth(&ch, &q).await as usize >= 1 }
    })
    .await;
    // The purchase acked.
    wait_depth(&ch, &t.purchases, 10, |n| n == 0).await;
    let log = dispatcher.log_text();
    dispatcher.stop().await;
    let grants = log
        .lines()
        .filter(|l| l.contains("granted") && l.contains("order_id=RP-1"))
        .count();
    assert_eq!(grants, 1, "the purchase was redelivered:\n{log}");
    assert!(
        log.contains("did not confirm"),
        "the refused publishes are reported:\n{log}"
    );
    assert_eq!(queue_depth(&ch, &t.purchases_dead).await, 0);
    assert_eq!(
        events_drained + drain(&ch, &t.sms_pending).await.len(),
        1,
        "one event"
    );
    rabbitmqctl(&["clear_policy", &policy]).await;
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}

/// Waits for `n` dead letters and returns (message_id, reason) of each.
async fn dead_letters(env: &TestEnv, conn: &lapin::Connection, n: u32) -> Vec<(String, String)> {
    let ch = conn.create_channel().await.unwrap();
    let q = env.topology().purchases_dead;
    // Dead letters.
    wait_depth(&ch, &q, 30, |d| d >= n).await;
    drain(&ch, &q)
        .await
        .into_iter()
        .map(|t| {
            (
                t.message_id.unwrap_or_default(),
                t.reason.unwrap_or_default(),
            )
        })
        .collect()
}

#[tokio::test]
async fn a_repeated_key_and_a_pool_left_by_a_failed_import_are_dead_lettered() {
    let env = TestEnv::with_pools("dispatch_dead", &[("real", 10)]).await;
    // A failed import into "ghost" leaves no pool behind.
    let dir = tempfile::tempdir().unwrap();
    let out = env
        .run(&["import", dir.path().to_str().unwrap(), "--pool", "ghost"])
        .await;
    assert_eq!(out.status.code(), Some(1));

    let daemon = start_daemon(env.command(&["--log-format", "json"])).await;
    let (conn, publisher) = env.amqp().await;
    let twice = format!(
        r#"{{"order_id":"DUP-1","uid":"u","phone":"{PHONE}","pool":"real","order_id":"DUP-2"}}"#
    );
    publish_bytes(&publisher, twice.as_bytes(), Some("M1")).await;
    let ghost = format!(r#"{{"order_id":"G-1","uid":"u","phone":"{PHONE}","pool":"ghost"}}"#);
    publish_bytes(&publisher, ghost.as_bytes(), Some("G-1")).await;

    let mut dead = dead_letters(&env, &conn, 2).await;
    dead.sort();
    assert_eq!(dead.len(), 2, "{dead:?}");
    assert!(
        dead[0].0 == "G-1" && dead[0].1.starts_with("unknown_pool"),
        "{dead:?}"
    );
    assert!(
        dead[1].0 == "M1" && dead[1].1.starts_with("duplicate_field"),
        "{dead:?}"
    );
    let codes = env.coll("codes");
    let granted = codes
        .count_documents(bson::doc! {"order_id": {"$exists": true}})
        .await
        .unwrap();
    assert_eq!(granted, 0, "neither order got a code");
    let backorders = env.coll("backorders");
    let waiting = backorders.count_documents(bson::doc! {}).await.unwrap();
    assert_eq!(waiting, 0, "the ghost pool's purchase is not backordered");

    // JSON logs carry the message id as a plain string.
    let log = daemon.log_text();
    assert!(log.contains(r#""message_id":"M1""#), "{log}");
    assert!(!log.contains("ShortString"), "{log}");
    codepool_broker::close(conn, "done").await;
    daemon.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn ids_with_bidi_and_format_characters_are_dead_letters_and_never_raw_in_logs() {
    let env = TestEnv::with_pools("dispatch_bidi", &[("bidi", 5)]).await;
    let daemon = start_daemon(env.command(&["--log-format", "text"])).await;
    let (conn, publisher) = env.amqp().await;
    // A bidi override in an order id, a uid that shows as "exe.txt", a
    // zero-width space and a soft hyphen: none is granted.
    let bodies = [
        ("O-\u{202e}1001", "u"),
        ("O-1002", "\u{202e}txt.exe"),
        ("O-\u{200b}1003", "u"),
        ("O-1004", "u\u{ad}4"),
    ];
    for (order, uid) in bodies {
        let body =
            serde_json::json!({"order_id": order, "uid": uid, "phone": PHONE, "pool": "bidi"});
        publish_bytes(&publisher, body.to_string().as_bytes(), Some(order)).await;
    }
    let dead = dead_letters(&env, &conn, 4).await;
    assert_eq!(dead.len(), 4, "{dead:?}");
    for (id, reason) in &dead {
        assert!(
            reason.starts_with("invalid_chars: field"),
            "{id:?}: {reason}"
        );
        assert!(reason.contains("U+"), "the code point is named: {reason}");
    }
    let codes = env.coll("codes");
    assert_eq!(
        codes
            .count_documents(bson::doc! {"status": 1})
            .await
            .unwrap(),
        0
    );
    let log = daemon.log.clone();
    codepool_broker::close(conn, "done").await;
    daemon.stop().await;
    // The whole log, to its last line, before it is searched.
    eventually(Duration::from_secs(10), "the daemon's last line", || {
        let log = log.clone();
        async move {
            log.lock()
                .unwrap()
                .iter()
                .any(|l| l.contains("dispatcher stopped"))
        }
    })
    .await;
    let log = log.lock().unwrap().join("\n");
    for raw in ['\u{202e}', '\u{200b}', '\u{ad}'] {
        assert!(!log.contains(raw), "no raw {raw:?} in the log: {log}");
    }
    assert!(
        !log.contains("io_loop") && !log.contains("being shutdown"),
        "a clean stop logs no lapin error: {log}"
    );
    env.cleanup().await;
}

/// A 128-character order id of two-byte letters is valid, yet `sms:<id>`
/// is longer than AMQP's 255-byte message id. Every event of such an order
/// is published (with a hashed message id), and the other orders of the
/// same batches still get theirs: nothing closes the connection.
#[tokio::test]
async fn a_long_multibyte_order_id_is_granted_texted_and_refused_without_costing_others() {
    let env = TestEnv::with_pools("dispatch_long_id", &[("game", 20), ("limited", 5)]).await;
    env.store
        .set_pool_settings(
            "limited",
            &PoolSettings {
                per_user: Some(1),
                ..PoolSettings::default()
            },
        )
        .await
        .expect("settings");
    let daemon = start_daemon(env.command(&[])).await;
    let (conn, publisher) = env.amqp().await;

    let long = "ü".repeat(128);
    let mut batch = vec![purchase(&long, "game")];
    batch[0].uid = "u-long".into();
    batch.extend((0..5).map(|i| purchase(&format!("N-{i}"), "game")));
    // The same buyer twice in a limited pool: the second is refused, and
    // `refused:<id>` is as long as the grant's event id.
    let mut first = purchase(&format!("{}1", "ß".repeat(127)), "limited");
    let mut second = purchase(&format!("{}2", "ß".repeat(127)), "limited");
    first.uid = "same-buyer".into();
    second.uid = "same-buyer".into();
    batch.push(first);
    publish_confirmed(&publisher, &batch).await;
    publish_confirmed(&publisher, &[second.clone()]).await;

    let ch = conn.create_channel().await.unwrap();
    let t = env.topology();
    eventually(Duration::from_secs(30), "7 SMS events and 1 refusal", || {
        let ch = ch.clone();
        let (sms, refused) = (t.sms_pending.clone(), t.purchases_refused.clone());
        async move { queue_depth(&ch, &sms).await >= 7 && queue_depth(&ch, &refused).await >= 1 }
    })
    .await;
    // Nothing more comes: no event is sent twice by a relay that never
    // got its confirm. Judged once every purchase is settled (its events
    // confirmed before its ack), with no grant left for the relay.
    wait_settled(&[&daemon.addr], 8).await;
    let later = chrono::Utc::now() + chrono::Duration::days(1);
    let owed = env.store.unconfirmed_grants(later, 10).await.unwrap();
    assert!(owed.is_empty(), "grants left for the relay: {owed:?}");
    let sms = drain(&ch, &t.sms_pending).await;
    let mut orders: Vec<String> = sms
        .iter()
        .map(|m| {
            let v: serde_json::Value = serde_json::from_slice(&m.body).unwrap();
            v["order_id"].as_str().unwrap().to_owned()
        })
        .collect();
    orders.sort();
    let mut expected: Vec<String> = batch.iter().map(|p| p.order_id.clone()).collect();
    expected.sort();
    assert_eq!(orders, expected, "every order texted exactly once");
    let long_event = sms
        .iter()
        .find(|m| m.body.windows(long.len()).any(|w| w == long.as_bytes()))
        .unwrap();
    let id = long_event.message_id.as_deref().unwrap();
    assert!(id.starts_with("sha256:") && id.len() <= 255, "{id}");
    let refused = drain(&ch, &t.purchases_refused).await;
    assert_eq!(refused.len(), 1);
    let v: serde_json::Value = serde_json::from_slice(&refused[0].body).unwrap();
    assert_eq!(v["order_id"], second.order_id.as_str());
    assert_eq!(v["event_id"], format!("refused:{}", second.order_id));
    assert!(
        !daemon.log_text().contains("connection closed")
            && !daemon.log_text().contains("reconnect"),
        "the broker connection was never dropped"
    );
    daemon.stop().await;
    env.cleanup().await;
}

/// Pools of both partitions of two (`pd` and `part-b` hash to 0, `pa` and
/// `pb` to 1).
const PARTITIONED_POOLS: [&str; 4] = ["pa", "pb", "pd", "part-b"];

/// `n` purchases spread over [`PARTITIONED_POOLS`], ids `PREFIX-i`.
fn spread(prefix: &str, n: usize) -> Vec<codepool_domain::Purchase> {
    (0..n)
        .map(|i| {
            let pool = PARTITIONED_POOLS[i % PARTITIONED_POOLS.len()];
            purchase(&format!("{prefix}-{i:04}"), pool)
        })
        .collect()
}

/// A dispatcher of `env` that takes partition `prefer` first and stands by
/// for the other `standby` seconds later.
fn preferring(env: &TestEnv, prefer: u16, standby: u64) -> tokio::process::Command {
    let mut cmd = env.command(&[]);
    cmd.env("CODEPOOL_PREFER_PARTITIONS", prefer.to_string())
        .env("CODEPOOL_STANDBY_SECS", standby.to_string());
    cmd
}

/// Every order of `orders` holds exactly one code, no code went to two
/// orders, each order's SMS event carries its code, and no purchase waits.
async fn granted_exactly_once(env: &TestEnv, conn: &lapin::Connection, orders: usize) {
    let codes = env.coll("codes");
    eventually(Duration::from_secs(60), "every order granted", || {
        let codes = codes.clone();
        async move {
            let issued = doc! {"order_id": {"$type": "string"}};
            codes.count_documents(issued).await.unwrap_or(0) >= orders as u64
        }
    })
    .await;
    let ch = conn.create_channel().await.unwrap();
    let t = env.topology();
    wait_depth(&ch, &t.partition_queue(0), 30, |n| n == 0).await;
    wait_depth(&ch, &t.partition_queue(1), 30, |n| n == 0).await;
    let mut by_order: HashMap<String, String> = HashMap::new();
    let mut holders: HashSet<String> = HashSet::new();
    let issued: Vec<bson::Document> = {
        use futures::TryStreamExt;
        let found = codes.find(doc! {"order_id": {"$type": "string"}}).await;
        found.unwrap().try_collect().await.unwrap()
    };
    for d in &issued {
        let code = env.plain_code(d);
        let order = d.get_str("order_id").unwrap().to_owned();
        assert!(holders.insert(code.clone()), "{code} issued twice");
        assert!(
            by_order.insert(order.clone(), code).is_none(),
            "{order} got two codes"
        );
    }
    assert_eq!(by_order.len(), orders, "orders granted");
    for m in drain(&ch, &t.sms_pending).await {
        let ev: SmsPending = serde_json::from_slice(&m.body).unwrap();
        assert_eq!(
            by_order.get(&ev.order_id),
            ev.all_codes().first().map(|c| &c.code)
        );
    }
}

/// Two partitions, two dispatchers that each prefer one: each partition
/// has one active consumer (each dispatcher consumes exactly its own
/// partition's purchases), and when one is killed its partition moves to
/// the other, which stood by: nothing lost, nothing issued twice.
#[tokio::test]
async fn two_dispatchers_share_two_partitions_and_a_killed_ones_partition_moves_to_the_other() {
    let env = TestEnv::new("partitions").await.with_partitions(2);
    for pool in PARTITIONED_POOLS {
        env.fill_pool(pool, 200).await;
    }
    let t = env.topology();
    let of = |p: &codepool_domain::Purchase| codepool_broker::partition_of(&p.pool, 2);
    // Started together: each takes its own partition before standing by.
    let (a, b) = tokio::join!(
        start_daemon(preferring(&env, 0, 8)),
        start_daemon(preferring(&env, 1, 8))
    );
    let (conn, publisher) = env.amqp().await;
    let first = spread("P1", 200);
    publish_confirmed(&publisher, &first).await;
    wait_settled(&[&a.addr, &b.addr], 200).await;
    let consumed = |addr: String| async move {
        metric_sum(&[&addr], "codepool_purchases_consumed_total").await as usize
    };
    let zero = first.iter().filter(|p| of(p) == 0).count();
    assert!(zero > 0 && zero < first.len(), "both partitions in use");
    assert_eq!(
        consumed(a.addr.clone()).await,
        zero,
        "a took partition 0 alone"
    );
    assert_eq!(
        consumed(b.addr.clone()).await,
        200 - zero,
        "b took partition 1 alone"
    );
    // Both stand by for the other's partition once the standby is over:
    // two consumers on each partition, one of them active.
    eventually(
        Duration::from_secs(30),
        "two consumers per partition",
        || {
            let t = t.clone();
            async move {
                let listed = rabbitmqctl(&["-q", "list_consumers", "queue_name", "active"]).await;
                t.purchase_queues().iter().all(|q| {
                    let mine: Vec<&str> = (listed.lines())
                        .filter_map(|l| l.strip_prefix(&format!("{q}\t")))
                        .collect();
                    mine.len() == 2 && mine.iter().filter(|a| a.trim() == "true").count() == 1
                })
            }
        },
    )
    .await;
    // kill -9 of a while it works, then more purchases of both partitions.
    let second = spread("P2", 400);
    publish_confirmed(&publisher, &second[..200]).await;
    let mut a = a;
    let _ = a.child.start_kill();
    let _ = a.child.wait().await;
    publish_confirmed(&publisher, &second[200..]).await;
    granted_exactly_once(&env, &conn, 600).await;
    // Everything after the kill went to b, partition 0's purchases too.
    let one_before = second[..200].iter().filter(|p| of(p) == 1).count();
    let by_b = consumed(b.addr.clone()).await;
    assert!(
        by_b >= (200 - zero) + one_before + 200,
        "b took partition 0 over: it consumed {by_b}"
    );
    b.stop().await;
    drop(a);
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}

/// A replayed dead letter goes to its pool's partition, as its first
/// publish did; a purchase whose routing key names no partition (a shop
/// backend that predates partitions) lands in partition 0, not nowhere.
#[tokio::test]
async fn a_replayed_dead_letter_lands_in_its_pools_partition() {
    let env = TestEnv::new("partreplay").await.with_partitions(2);
    let (conn, publisher) = env.amqp().await;
    let t = env.topology();
    t.declare(publisher.channel()).await.unwrap();
    // "pa" is partition 1: not where a message routed by nothing goes.
    assert_eq!(codepool_broker::partition_of("pa", 2), 1);
    let body = purchase("LATE-1", "pa").to_json();
    let id = "LATE-1".into();
    let sent = publisher.dead_letter(&body, Some(&id), "unknown_pool: pa", 0, Some("guest"));
    sent.await.unwrap().wait().await.unwrap();
    env.fill_pool("pa", 2).await;
    let out = codepool_ok(&env, &["dead-letters", "replay"]).await;
    assert!(out.contains("each to its pool's partition"), "{out}");
    let ch = conn.create_channel().await.unwrap();
    assert_eq!(queue_depth(&ch, &t.partition_queue(1)).await, 1, "{out}");
    assert_eq!(queue_depth(&ch, &t.partition_queue(0)).await, 0);
    let props = lapin::BasicProperties::default().with_user_id("guest".into());
    let other = purchase("ANY-1", "pa").to_json();
    publish_to(&publisher, &t.purchases_exchange, "any key", &other, props).await;
    assert_eq!(queue_depth(&ch, &t.partition_queue(0)).await, 1);
    // Both are granted wherever they wait.
    let dispatcher = start_daemon(env.command(&[])).await;
    wait_settled(&[&dispatcher.addr], 2).await;
    dispatcher.stop().await;
    let issued = doc! {"pool": "pa", "order_id": {"$in": ["LATE-1", "ANY-1"]}};
    assert_eq!(env.coll("codes").count_documents(issued).await.unwrap(), 2);
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}

/// A dispatcher set to another partition count than the queues it finds
/// stops at once (exit status 1), says what to do, and declares nothing;
/// so does a publisher, which publishes nothing.
#[tokio::test]
async fn a_dispatcher_set_to_another_partition_count_than_the_queues_stops_and_says_what_to_do() {
    let env = TestEnv::new("partcount").await.with_partitions(2);
    let (conn, publisher) = env.amqp().await;
    let t = env.topology();
    t.declare(publisher.channel()).await.unwrap();
    for n in ["3", "1"] {
        let mut cmd = env.command(&["dispatch", "--no-http"]);
        cmd.env("CODEPOOL_PARTITIONS", n);
        let out = tokio::time::timeout(Duration::from_secs(60), cmd.output())
            .await
            .expect("the dispatcher stops by itself")
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "CODEPOOL_PARTITIONS={n}: {err}");
        assert!(err.contains("RabbitMQ holds 2 partitions"), "{err}");
        assert!(err.contains(&format!("set to {n} partition(s)")), "{err}");
        assert!(err.contains("docs/scaling.md"), "{err}");
    }
    // A publisher set to another count publishes nothing, and declares nothing.
    let mut cmd = env.command(&["publish", "--pool", "pa", "--order-id", "X-1", "--uid", "u"]);
    cmd.args(["--phone", "+8613800000000"])
        .env("CODEPOOL_PARTITIONS", "3");
    let out = cmd.output().await.unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("nothing was published") && err.contains("RabbitMQ holds 2 partitions"),
        "{err}"
    );
    assert_eq!(queue_counts(&conn, &t.partition_queue(2)).await, None);
    assert_eq!(queue_counts(&conn, &t.purchases).await, None);
    for q in t.purchase_queues() {
        assert_eq!(queue_counts(&conn, &q).await, Some((0, 0)), "{q}");
    }
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}
