//! Issue 54, items 4 and 5: one shop's slow receiver delays nobody else's
//! webhooks, and each shop hears of a pool running out once per time it
//! runs out, however many processes and doors claim from it.

use std::time::{Duration, Instant};

use bson::doc;
use lapin::options::{QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::FieldTable;

use crate::api::{http, ApiServer};
use crate::common::*;
use crate::fixtures::*;
use crate::webhooks::{add_endpoint, publisher, shop_purchase, Answer, Receiver};

/// How long the slow shop's receiver takes to answer: longer than an
/// attempt may take (`ATTEMPT_TIMEOUT`), so each of its attempts runs to
/// the timeout and fails.
const SLOW_ANSWER: Duration = Duration::from_secs(40);

#[tokio::test]
async fn a_slow_receiver_of_one_shop_does_not_delay_another_shops_webhooks() {
    assert!(SLOW_ANSWER > codepool_issuance::webhooks::deliver::ATTEMPT_TIMEOUT);
    let env = TestEnv::with_pools("wh_fair", &[("fs", 30), ("ff", 5)]).await;
    shop(&env, "slowshop", "fs").await;
    shop(&env, "fastshop", "ff").await;
    let slow = Receiver::start(Answer::Slow(SLOW_ANSWER)).await;
    let fast = Receiver::start(Answer::Ok).await;
    let (slow_endpoint, _) = add_endpoint(&env, "slowshop", &slow.url(), "order.granted").await;
    add_endpoint(&env, "fastshop", &fast.url(), "order.granted").await;
    let mut daemon = start_daemon(env.command(&[])).await;
    let (conn, publisher) = publisher(&env).await;

    // The slow shop's backlog first: 20 orders granted, their events
    // queued, and its receiver holding attempts.
    let backlog: Vec<_> = (0..20)
        .map(|i| shop_purchase(&format!("FS-{i}"), "fs", "slowshop"))
        .collect();
    publish_confirmed(&publisher, &backlog).await;
    let tasks = env.coll("webhook_tasks");
    let of_slow = doc! {"endpoint": &slow_endpoint, "state": "pending"};
    eventually(
        Duration::from_secs(30),
        "the slow shop's 20 events queued, its receiver holding attempts",
        || async {
            tasks.count_documents(of_slow.clone()).await.unwrap() == 20 && !slow.hits().is_empty()
        },
    )
    .await;

    // Then the fast shop's order: told while the slow shop's attempts
    // still hang. Behind the backlog it would wait for the slow receiver's
    // 40 s answers (29.5 s on the unfair code); on time it takes a grant
    // and a delivery round (0.8 s on a quiet host, 2.4 s beside a release
    // build), so 8 s tells the two apart on a loaded host too.
    let placed = Instant::now();
    publish_confirmed(&publisher, &[shop_purchase("FF-1", "ff", "fastshop")]).await;
    eventually(
        Duration::from_secs(60),
        "the fast shop's order.granted",
        || async { !fast.of_type("order.granted").is_empty() },
    )
    .await;
    let told = fast.of_type("order.granted")[0].clone();
    assert_eq!(told.json()["data"]["order_id"], "FF-1");
    let after = told.at - placed;
    assert!(
        after < Duration::from_secs(8),
        "the fast shop's order.granted came {after:?} after its order, behind the slow shop's backlog"
    );
    assert_eq!(
        tasks.count_documents(of_slow.clone()).await.unwrap(),
        20,
        "the slow shop's backlog is still there, none of it delivered"
    );
    // An endpoint's share of a process's 16 attempt slots: a quarter.
    let share = 4;
    assert!(
        slow.most_at_once() <= share,
        "the slow endpoint had {} attempts in flight at once, over its share of {share}",
        slow.most_at_once()
    );
    // Its attempts hang for 15 s more: no graceful stop to wait for.
    daemon.child.kill().await.unwrap();
    let _ = daemon.child.wait().await;
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}

/// A queue of this test's own bound to `routing_key` on the events
/// exchange; returns its name.
async fn listen(env: &TestEnv, ch: &lapin::Channel, routing_key: &str) -> String {
    let topology = env.topology();
    topology.declare(ch).await.unwrap();
    let name = format!(
        "{}test.{routing_key}",
        topology.purchases.trim_end_matches("purchases")
    );
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    ch.queue_declare(&name, durable, FieldTable::default())
        .await
        .unwrap();
    ch.queue_bind(
        &name,
        &topology.events_exchange,
        routing_key,
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    name
}

/// Two dispatchers and an API server claim from `pool` at once, `amqp`
/// orders by AMQP and `web` over HTTP (ids `{round}-A…`, `{round}-H…`),
/// then stop once every order is granted or waits: every announcement of
/// theirs is made by then.
async fn claim_at_once(env: &TestEnv, pool: &str, round: &str, amqp: usize, web: usize) {
    let dispatchers = [
        start_daemon(env.command(&[])).await,
        start_daemon(env.command(&[])).await,
    ];
    let api = ApiServer::start(env, &[]).await;
    let key = crate::api::key(env, &format!("k-{round}"), "orders:write").await;
    let (conn, publisher) = publisher(env).await;
    let orders: Vec<_> = (0..amqp)
        .map(|i| purchase(&format!("{round}-A{i}"), pool))
        .collect();
    let over_http = futures::future::join_all((0..web).map(|i| {
        let body = crate::api::order(&format!("{round}-H{i}"), pool, 1);
        let (addr, key) = (api.addr.clone(), key.clone());
        async move { http(&addr, "POST", "/v1/orders", Some(&key), &body).await.0 }
    }));
    let ((), statuses) = tokio::join!(publish_confirmed(&publisher, &orders), over_http);
    assert!(
        statuses.iter().all(|s| *s == 201 || *s == 202),
        "{statuses:?}"
    );
    let db = env.store.database();
    let mine = doc! {"order_id": {"$regex": format!("^{round}-")}};
    eventually(
        Duration::from_secs(60),
        "every order granted or waiting",
        || async {
            let granted = db
                .collection::<bson::Document>("codes")
                .count_documents(mine.clone())
                .await
                .unwrap();
            let waiting = db
                .collection::<bson::Document>("backorders")
                .count_documents(mine.clone())
                .await
                .unwrap();
            granted + waiting == (amqp + web) as u64
        },
    )
    .await;
    for d in dispatchers {
        d.stop().await;
    }
    api.stop().await;
    let _ = conn.close(200, "bye").await;
}

/// Delivers every webhook recorded so far (one dispatcher, until no task
/// is left to deliver), then stops.
async fn deliver_all(env: &TestEnv) {
    let deliverer = start_daemon(env.command(&[])).await;
    let tasks = env.coll("webhook_tasks");
    eventually(
        Duration::from_secs(60),
        "every webhook delivered",
        || async {
            tasks
                .count_documents(doc! {"state": {"$ne": "delivered"}})
                .await
                .unwrap()
                == 0
        },
    )
    .await;
    deliverer.stop().await;
}

#[tokio::test]
async fn each_shop_hears_once_each_time_a_pool_runs_out_through_either_door() {
    let env = TestEnv::with_pools("wh_exhaust", &[("px", 4)]).await;
    let receivers = [
        ("acme", Receiver::start(Answer::Ok).await),
        ("globex", Receiver::start(Answer::Ok).await),
    ];
    for (name, receiver) in &receivers {
        shop(&env, name, "px").await;
        add_endpoint(&env, name, &receiver.url(), "pool.exhausted").await;
    }
    let conn = codepool_broker::connect(AMQP_URL, "test").await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    let heard = listen(&env, &ch, "pool.exhausted").await;

    // Two dispatchers and the HTTP door run the pool dry together: 20
    // orders for 4 codes, refused in many batches.
    claim_at_once(&env, "px", "R1", 12, 8).await;
    deliver_all(&env).await;
    let told = |kind: &'static str| {
        receivers
            .iter()
            .map(|(name, r)| {
                let hits = r.of_type(kind);
                for h in &hits {
                    let data = &h.json()["data"];
                    assert_eq!(data["shop"], *name, "each shop's own event: {}", h.body);
                    assert_eq!(data["pool"], "px");
                }
                hits
            })
            .collect::<Vec<_>>()
    };
    for hits in told("pool.exhausted") {
        assert_eq!(hits.len(), 1, "one pool.exhausted per shop: {hits:?}");
    }
    assert_eq!(
        queue_depth(&ch, &heard).await,
        1,
        "one on the events exchange"
    );

    // An import refills it (the oldest backorders take the new codes), and
    // it runs out again: once more for each shop.
    let mut csv = tempfile::NamedTempFile::new().unwrap();
    std::io::Write::write_all(&mut csv, b"code\nPX-NEW-0001\nPX-NEW-0002\nPX-NEW-0003\n").unwrap();
    codepool_ok(
        &env,
        &["import", csv.path().to_str().unwrap(), "--pool", "px"],
    )
    .await;
    claim_at_once(&env, "px", "R2", 10, 6).await;
    deliver_all(&env).await;
    for hits in told("pool.exhausted") {
        assert_eq!(hits.len(), 2, "once per exhaustion: {hits:?}");
        assert_ne!(hits[0].id, hits[1].id, "two exhaustions, two events");
    }
    assert_eq!(queue_depth(&ch, &heard).await, 2);
    let _ = ch.queue_delete(&heard, QueueDeleteOptions::default()).await;
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}
