//! Issue 54, item 4: one shop's slow receiver delays nobody else's
//! webhooks.

use std::time::{Duration, Instant};

use bson::doc;

use crate::common::{eventually, publish_confirmed, start_daemon, TestEnv};
use crate::webhooks::{add_endpoint, publisher, shop, shop_purchase, Answer, Receiver};

/// How long the slow shop's receiver takes to answer: longer than an
/// attempt may take (`ATTEMPT_TIMEOUT`), so each of its attempts runs to
/// the timeout and fails.
const SLOW_ANSWER: Duration = Duration::from_secs(40);

#[tokio::test]
async fn a_slow_receiver_of_one_shop_does_not_delay_another_shops_webhooks() {
    assert!(SLOW_ANSWER > codepool_issuance::webhooks::deliver::ATTEMPT_TIMEOUT);
    let env = TestEnv::new("wh_fair").await;
    env.fill_pool("fs", 30).await;
    env.fill_pool("ff", 5).await;
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
    let tasks = env
        .store
        .database()
        .collection::<bson::Document>("webhook_tasks");
    let of_slow = doc! {"endpoint": &slow_endpoint, "state": "pending"};
    eventually(
        Duration::from_secs(30),
        "the slow shop's 20 events queued, its receiver holding attempts",
        || async {
            tasks.count_documents(of_slow.clone()).await.unwrap() == 20 && !slow.hits().is_empty()
        },
    )
    .await;

    // Then the fast shop's order: told within 2 s, the slow shop's
    // attempts still hanging.
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
        after < Duration::from_secs(2),
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
