//! `codepool dead-letters replay` takes only what was dead when it started,
//! so a replay whose messages die again ends instead of replaying its own
//! output; each replayed message carries its replay count.

use std::time::Duration;

use crate::common::*;

#[tokio::test]
async fn a_replay_takes_only_what_was_dead_when_it_started_and_counts_replays() {
    let env = TestEnv::with_pools("replay_bounded", &[("rp", 5)]).await;
    let daemon = start_daemon(env.command(&[])).await;
    let (conn, publisher) = env.amqp().await;
    for i in 0..30 {
        publish_bytes(
            &publisher,
            format!("not json {i}").as_bytes(),
            Some(&format!("NJ-{i}")),
        )
        .await;
    }
    let ch = conn.create_channel().await.unwrap();
    let dead = env.topology().purchases_dead;
    eventually(Duration::from_secs(30), "30 dead letters", || {
        let (ch, dead) = (ch.clone(), dead.clone());
        async move { queue_depth(&ch, &dead).await == 30 }
    })
    .await;

    let out = tokio::time::timeout(
        Duration::from_secs(60),
        env.command(&[
            "dead-letters",
            "replay",
            "--reason",
            "not_json",
            "--wait",
            "30",
        ])
        .output(),
    )
    .await
    .expect("the replay ends")
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("replayed 30 purchase(s)"), "{text}");
    assert!(text.contains("30 of them came back dead"), "{text}");
    eventually(Duration::from_secs(30), "30 dead letters again", || {
        let (ch, dead) = (ch.clone(), dead.clone());
        async move { queue_depth(&ch, &dead).await == 30 }
    })
    .await;

    let out = env.run(&["dead-letters", "list", "--json"]).await;
    let listed: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(listed.len(), 30);
    assert!(listed.iter().all(|m| m["replays"] == 1), "{listed:?}");
    assert!(listed
        .iter()
        .all(|m| m["reason"].as_str().unwrap().starts_with("not_json")));

    // A second replay counts on.
    let out = env.run(&["dead-letters", "replay"]).await;
    assert!(String::from_utf8_lossy(&out.stdout).contains("replayed 30"));
    eventually(Duration::from_secs(30), "back again", || {
        let (ch, dead) = (ch.clone(), dead.clone());
        async move { queue_depth(&ch, &dead).await == 30 }
    })
    .await;
    let out = env.run(&["dead-letters", "list"]).await;
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.matches("replays: 2").count(), 30, "{text}");

    codepool_broker::close(conn, "done").await;
    daemon.stop().await;
    env.cleanup().await;
}

/// Issue 73, item 5: codepool records who published a purchase when it
/// dead-letters it, and a replay sends it back as that publisher's. The
/// documented fix for `shop_not_yours` (name the user, then replay) grants
/// the shop's purchase; a replay never turns a shop's purchase of no shop
/// into the operator's, and a record that codepool did not write (a user
/// with the old permissions writing into `purchases.dead`) counts for no
/// one.
#[tokio::test]
async fn a_dead_lettered_shop_purchase_replays_as_its_first_publisher() {
    use bson::doc;
    use lapin::types::{AMQPValue, FieldTable};

    use crate::fixtures::{broker_user, count_codes, create_shop, delete_broker_user};

    let env = TestEnv::with_pools("replay_publisher", &[("rp", 10)]).await;
    create_shop(&env, "acme", "rp", &[]).await;
    let documented = crate::fixtures::documented_shop_permissions(&env);
    let (acme_user, acme_url) = broker_user(&env, "acme-backend", &documented).await;
    // The permissions the docs gave before: write on every queue.
    let everything = [String::from("^$"), String::from(".*"), String::from("^$")];
    let (old_user, old_url) = broker_user(&env, "old-backend", &everything).await;
    let daemon = start_daemon(env.command(&[])).await;

    let acme_conn = codepool_broker::connect(&acme_url, "acme").await.unwrap();
    let acme = codepool_broker::Publisher::new(&acme_conn, env.topology())
        .await
        .unwrap()
        .as_user(&acme_user);
    let mut mine = purchase("RP-acme", "rp");
    mine.shop = Some("acme".into());
    // Its own shop's purchase, before the shop names it; one of no shop.
    publish_confirmed(&acme, &[mine, purchase("RP-noshop", "rp")]).await;
    // A forged record, straight into purchases.dead: "the operator
    // published this".
    let old_conn = codepool_broker::connect(&old_url, "old").await.unwrap();
    let old = codepool_broker::Publisher::new(&old_conn, env.topology())
        .await
        .unwrap();
    let mut headers = FieldTable::default();
    headers.insert(
        codepool_broker::PUBLISHER_HEADER.into(),
        AMQPValue::LongString("guest".into()),
    );
    headers.insert(
        codepool_broker::REASON_HEADER.into(),
        AMQPValue::LongString("unknown_pool: forged".into()),
    );
    let props = lapin::BasicProperties::default()
        .with_user_id(old_user.as_str().into())
        .with_message_id("RP-forged".into())
        .with_headers(headers);
    let forged = br#"{"order_id":"RP-forged","uid":"u","phone":"+8613800000000","pool":"rp"}"#;
    publish_to(&old, "", &env.topology().purchases_dead, forged, props).await;

    let (conn, _) = env.amqp().await;
    let ch = conn.create_channel().await.unwrap();
    let dead = env.topology().purchases_dead;
    eventually(Duration::from_secs(30), "3 dead letters", || {
        let (ch, dead) = (ch.clone(), dead.clone());
        async move { queue_depth(&ch, &dead).await == 3 }
    })
    .await;

    // The documented fix: name the broker user, then replay.
    codepool_ok(
        &env,
        &[
            "shops",
            "set",
            "--name",
            "acme",
            "--broker-users",
            &acme_user,
        ],
    )
    .await;
    // Every process sees a shop's change within a second.
    tokio::time::sleep(codepool_issuance::shops::SHOP_TTL).await;
    let out = codepool_ok(&env, &["dead-letters", "replay", "--wait", "30"]).await;
    assert!(out.contains("replayed 3 purchase(s)"), "{out}");
    assert!(out.contains("2 of them came back dead"), "{out}");
    let granted = |order: &'static str| {
        let env = &env;
        async move { count_codes(env, doc! {"order_id": order, "status": 1}).await }
    };
    eventually(
        Duration::from_secs(30),
        "the shop's purchase granted",
        || async { granted("RP-acme").await == 1 },
    )
    .await;
    assert_eq!(granted("RP-noshop").await, 0);
    assert_eq!(granted("RP-forged").await, 0);
    let code = env
        .coll("codes")
        .find_one(doc! {"order_id": "RP-acme"})
        .await
        .unwrap()
        .unwrap();
    assert_eq!(code.get_str("owner").unwrap(), "shop:acme");
    let back = drain(&ch, &dead).await;
    assert_eq!(back.len(), 2, "the two that are not the operator's");
    for d in &back {
        let reason = d.reason.clone().unwrap_or_default();
        assert!(reason.starts_with("shop_not_yours"), "{reason}");
    }

    daemon.stop().await;
    let _ = (
        acme_conn.close(200, "bye").await,
        old_conn.close(200, "bye").await,
    );
    codepool_broker::close(conn, "done").await;
    delete_broker_user(&acme_user).await;
    delete_broker_user(&old_user).await;
    env.cleanup().await;
}
