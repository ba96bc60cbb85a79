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
