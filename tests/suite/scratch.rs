//! Tests and benches leave nothing behind: what a killed run left on the
//! servers (its database, Redis keys, queues and exchanges) is removed by
//! the next run, and a live run's namespace is never touched. Each demo
//! key file gets a demo database of its own.

use codepool::scratch::TESTS;
use lapin::options::{ExchangeDeclareOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::ExchangeKind;

use crate::common::*;

/// Declares a queue and an exchange named after `prefix`, a Redis key
/// under it, and a database `db` with one document.
async fn leave_behind(env: &TestEnv, db: &str, redis_prefix: &str, amqp_prefix: &str) {
    let client = env.store.database().client().clone();
    client
        .database(db)
        .collection::<bson::Document>("left")
        .insert_one(bson::doc! { "x": 1 })
        .await
        .unwrap();
    let mut r = redis_conn().await;
    redis::cmd("SET")
        .arg(format!("{redis_prefix}:left"))
        .arg(1)
        .query_async::<()>(&mut r)
        .await
        .unwrap();
    let conn = codepool_broker::connect(AMQP_URL, "scratch-test")
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    let (queue, events) = (
        format!("{amqp_prefix}purchases"),
        format!("{amqp_prefix}events"),
    );
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    let declared = ch.queue_declare(&queue, durable, FieldTable::default());
    declared.await.unwrap();
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    let kind = ExchangeKind::Topic;
    let declared = ch.exchange_declare(&events, kind, durable, FieldTable::default());
    declared.await.unwrap();
    let _ = conn.close(200, "bye").await;
}

async fn queue_exists(name: &str) -> bool {
    let conn = codepool_broker::connect(AMQP_URL, "scratch-test")
        .await
        .unwrap();
    let found = queue_counts(&conn, name).await.is_some();
    let _ = conn.close(200, "bye").await;
    found
}

/// A connection to the suite's Redis.
async fn redis_conn() -> redis::aio::MultiplexedConnection {
    let client = redis::Client::open(REDIS_URL).unwrap();
    client.get_multiplexed_async_connection().await.unwrap()
}

async fn key_exists(key: &str) -> bool {
    let mut r = redis_conn().await;
    redis::cmd("EXISTS")
        .arg(key)
        .query_async::<u32>(&mut r)
        .await
        .unwrap()
        == 1
}

#[tokio::test]
async fn a_killed_runs_namespace_is_swept_and_a_live_one_is_kept() {
    let env = TestEnv::new("scratch_sweep").await;
    // A process id above Linux's largest (2^22) is never running.
    let dead = 4_194_305 + rand::random::<u16>() as u32;
    let label = crate::common::suffix();
    let gone = (
        format!("cpt_{dead}_left_{label}"),
        format!("cpt:{dead}:left_{label}"),
        format!("cpt.{dead}.left_{label}."),
    );
    leave_behind(&env, &gone.0, &gone.1, &gone.2).await;
    // This process's own leftovers-to-be: it is alive, so they stay.
    let live = TESTS.names(&format!("kept_{label}"));
    leave_behind(&env, &live.db, &live.redis_prefix, &live.amqp_prefix).await;

    TESTS.sweep(&env.store, REDIS_URL, AMQP_URL).await;

    let dbs = env.store.database_names().await;
    assert!(!dbs.contains(&gone.0), "the dead run's database is dropped");
    assert!(!key_exists(&format!("{}:left", gone.1)).await);
    assert!(!queue_exists(&format!("{}purchases", gone.2)).await);
    assert!(dbs.contains(&live.db), "a live run's database is kept");
    assert!(key_exists(&format!("{}:left", live.redis_prefix)).await);
    assert!(queue_exists(&format!("{}purchases", live.amqp_prefix)).await);

    // The live one removes its own at the end.
    let client = env.store.database().client().clone();
    client.database(&live.db).drop().await.unwrap();
    codepool::scratch::delete_redis_keys(REDIS_URL, &live.redis_prefix)
        .await
        .unwrap();
    let (q, x) = codepool::scratch::delete_amqp(
        AMQP_URL,
        &[format!("{}purchases", live.amqp_prefix)],
        &[format!("{}events", live.amqp_prefix)],
    )
    .await;
    assert_eq!((q, x), (1, 1));
    assert!(!key_exists(&format!("{}:left", live.redis_prefix)).await);
    env.cleanup().await;
}

/// `scripts/demo-db.sh KEY_FILE`: the demo database chosen for a key file.
fn demo_db(key_file: &std::path::Path) -> String {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/demo-db.sh");
    let out = std::process::Command::new("bash")
        .arg(script)
        .arg(key_file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

#[tokio::test]
async fn each_demo_key_file_gets_its_own_demo_database() {
    let env = TestEnv::new("scratch_demo_db").await;
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a.json"), dir.path().join("b.json"));
    for k in [&a, &b] {
        output_ok(env.command(&["keys", "init"]).env("CODEPOOL_KEY_FILE", k)).await;
    }
    let (db_a, db_b) = (demo_db(&a), demo_db(&b));
    assert_ne!(db_a, db_b, "two checkouts, two demo databases");
    assert!(
        db_a.starts_with("codepool_demo_") && db_a.len() < 64,
        "{db_a}"
    );
    assert_eq!(demo_db(&a), db_a, "the same key file, the same database");
    // A rotation keeps the HMAC key, so the demo keeps its database.
    output_ok(env.command(&["keys", "add"]).env("CODEPOOL_KEY_FILE", &a)).await;
    assert_eq!(demo_db(&a), db_a);
    env.cleanup().await;
}
