//! Input a hostile or careless producer sends, against a running
//! dispatcher: every case ends as a dead letter with the right reason, and
//! nothing untrusted or noisy reaches the logs.

use std::io::Write;
use std::time::Duration;

use codepool_broker::Publisher;

use crate::common::{drain, eventually, queue_depth, start_daemon, TestEnv, AMQP_URL};

const PHONE: &str = "+8613800000000";

async fn publish_raw(publisher: &Publisher, body: &[u8], message_id: &str) {
    publisher
        .publish_purchase_bytes(body, Some(message_id))
        .await
        .expect("publish")
        .wait()
        .await
        .expect("confirm");
}

/// Waits for `n` dead letters and returns (message_id, reason) of each.
async fn dead_letters(env: &TestEnv, conn: &lapin::Connection, n: u32) -> Vec<(String, String)> {
    let ch = conn.create_channel().await.unwrap();
    let q = env.topology().purchases_dead;
    eventually(Duration::from_secs(30), "dead letters", || {
        let (ch, q) = (ch.clone(), q.clone());
        async move { queue_depth(&ch, &q).await >= n }
    })
    .await;
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
    let env = TestEnv::new("hostile_dead").await;
    env.fill_pool("real", 10).await;
    // A failed import into "ghost" leaves no pool behind.
    let dir = tempfile::tempdir().unwrap();
    let out = env
        .command(&["import", dir.path().to_str().unwrap(), "--pool", "ghost"])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(1));

    let daemon = start_daemon(env.command(&["--log-format", "json"])).await;
    let conn = codepool_broker::connect(AMQP_URL, "test").await.unwrap();
    let publisher = Publisher::new(&conn, env.topology()).await.unwrap();
    let twice = format!(
        r#"{{"order_id":"DUP-1","uid":"u","phone":"{PHONE}","pool":"real","order_id":"DUP-2"}}"#
    );
    publish_raw(&publisher, twice.as_bytes(), "M1").await;
    let ghost = format!(r#"{{"order_id":"G-1","uid":"u","phone":"{PHONE}","pool":"ghost"}}"#);
    publish_raw(&publisher, ghost.as_bytes(), "G-1").await;

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
    let codes = env.store.database().collection::<bson::Document>("codes");
    let granted = codes
        .count_documents(bson::doc! {"order_id": {"$exists": true}})
        .await
        .unwrap();
    assert_eq!(granted, 0, "neither order got a code");
    let backorders = env
        .store
        .database()
        .collection::<bson::Document>("backorders");
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
    let env = TestEnv::new("hostile_bidi").await;
    env.fill_pool("bidi", 5).await;
    let daemon = start_daemon(env.command(&["--log-format", "text"])).await;
    let conn = codepool_broker::connect(AMQP_URL, "test").await.unwrap();
    let publisher = Publisher::new(&conn, env.topology()).await.unwrap();
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
        publish_raw(&publisher, body.to_string().as_bytes(), order).await;
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
    let codes = env.store.database().collection::<bson::Document>("codes");
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

#[tokio::test]
async fn commands_that_use_the_broker_exit_without_lapin_errors() {
    let env = TestEnv::new("hostile_quiet").await;
    for round in 0..3 {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        writeln!(f, "code\nQUIET-{round}-1\nQUIET-{round}-2").unwrap();
        let out = env
            .command(&["import", f.path().to_str().unwrap(), "--pool", "quiet"])
            .output()
            .await
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{err}");
        assert!(err.contains("published pool.replenished"), "{err}");
        assert!(!err.contains("io_loop") && !err.contains("ERROR"), "{err}");
        let order = format!("Q-{round}");
        let out = env
            .command(&[
                "publish",
                "--pool",
                "quiet",
                "--order-id",
                &order,
                "--uid",
                "u",
                "--phone",
                PHONE,
            ])
            .output()
            .await
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{err}");
        assert!(!err.contains("io_loop") && !err.contains("ERROR"), "{err}");
    }
    env.cleanup().await;
}
