//! Error messages that point at the real cause, and help that reads in
//! order: the command's own options first, the shared ones under
//! "Connection". Read-only commands refuse a database without codepool
//! data (and create none), wrong broker credentials are named, and short
//! commands, and those that use the broker, exit cleanly.

use std::io::Write;
use std::time::{Duration, Instant};

use crate::common::*;
use crate::fixtures::*;

async fn stderr_of(mut cmd: tokio::process::Command) -> (Option<i32>, String) {
    let out = cmd.output().await.expect("run codepool");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn an_empty_vhost_is_named_and_an_http_url_is_called_not_amqp() {
    let env = TestEnv::new("messages_amqp").await;
    let mut cmd = env.command(&["dead-letters", "list"]);
    cmd.env("CODEPOOL_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/");
    let (code, err) = stderr_of(cmd).await;
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains(r#"no vhost """#) && err.contains("%2f"),
        "{err}"
    );
    assert!(
        !err.contains("unreachable") && !err.contains("rabbitmq-server runs"),
        "{err}"
    );

    let mut cmd = env.command(&["dead-letters", "list"]);
    cmd.env("CODEPOOL_AMQP_URL", "http://guest:guest@127.0.0.1:15672/");
    let (code, err) = stderr_of(cmd).await;
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("not an amqp:// or amqps:// URL"), "{err}");
    assert!(!err.contains("unreachable"), "{err}");
    env.cleanup().await;
}

#[tokio::test]
async fn a_key_file_that_is_a_directory_is_called_a_directory() {
    let env = TestEnv::new("messages_keydir").await;
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = env.command(&["lookup", "--order", "O-1"]);
    cmd.env("CODEPOOL_KEY_FILE", dir.path());
    let (code, err) = stderr_of(cmd).await;
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("is a directory"), "{err}");
    assert!(!err.contains("chmod"), "{err}");
    env.cleanup().await;
}

#[tokio::test]
async fn help_lists_the_command_options_before_the_connection_ones() {
    let out = std::process::Command::new(crate::common::bin())
        .args(["export", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    let own = help.find("--since").expect("export's own option");
    let heading = help.find("Connection:").expect("a Connection heading");
    let redis = help.find("--redis-url").expect("the shared option");
    assert!(own < heading && heading < redis, "{help}");
}

#[tokio::test]
async fn a_silent_mongodb_gets_one_line_with_its_address_and_what_to_do() {
    let env = TestEnv::new("messages_mongo").await;
    let port = crate::common::free_port();
    let uri =
        format!("mongodb://127.0.0.1:{port}/?directConnection=true&serverSelectionTimeoutMS=500");
    let mut cmd = env.command(&["stats"]);
    cmd.env("CODEPOOL_MONGODB_URI", &uri);
    let (code, err) = stderr_of(cmd).await;
    assert_eq!(code, Some(1), "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line: {err}");
    assert!(lines[0].contains(&format!("127.0.0.1:{port}")), "{err}");
    assert!(lines[0].contains("make services"), "{err}");
    assert!(
        !err.contains("Topology") && !err.contains("labels"),
        "{err}"
    );
    env.cleanup().await;
}

#[tokio::test]
async fn read_only_commands_refuse_a_database_without_codepool_data_and_create_none() {
    let env = TestEnv::new("messages_no_db").await;
    let typo = format!("{}_typo", env.db);
    for args in [
        &["stats"][..],
        &["pool", "show"],
        &["lookup", "--order", "O-1"],
        &["export", "--pool", "p", "--out", "/tmp/never-written.csv"],
    ] {
        let out = env
            .command(args)
            .env("CODEPOOL_DB", &typo)
            .output()
            .await
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains(&typo) && err.contains("no codepool data"),
            "{args:?}: {err}"
        );
        assert!(
            err.contains(&env.db),
            "the databases there are listed: {err}"
        );
    }
    let names = env.store.client().list_database_names().await.unwrap();
    assert!(!names.contains(&typo), "{typo} was created");
    assert!(!std::path::Path::new("/tmp/never-written.csv").exists());
    env.cleanup().await;
}

#[tokio::test]
async fn dispatch_with_a_wrong_rabbitmq_password_says_so_and_exits_1() {
    let env = TestEnv::new("messages_amqp_auth").await;
    let started = Instant::now();
    let out = tokio::time::timeout(
        Duration::from_secs(30),
        env.command(&["dispatch", "--http", "127.0.0.1:0"])
            .env("CODEPOOL_AMQP_URL", "amqp://guest:wrong@127.0.0.1:5672/%2f")
            .output(),
    )
    .await
    .expect("dispatch exits on its own")
    .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("RabbitMQ refused the user or password in CODEPOOL_AMQP_URL"),
        "{err}"
    );
    assert!(!err.contains("wrong@"), "the password is not shown: {err}");
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "{:?}",
        started.elapsed()
    );
    env.cleanup().await;
}

#[tokio::test]
async fn short_commands_never_panic_at_exit() {
    let env = TestEnv::with_pools("messages_exit", &[("ex", 3)]).await;
    for i in 0..25 {
        let (code, _, err) = codepool(&env, &["stats"]).await;
        assert_eq!(code, 0, "run {i}: {err}");
        assert!(!err.contains("panicked"), "run {i}: {err}");
    }
    env.cleanup().await;
}

#[tokio::test]
async fn commands_that_use_the_broker_exit_without_lapin_errors() {
    let env = TestEnv::new("messages_quiet").await;
    for round in 0..3 {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        writeln!(f, "code\nQUIET-{round}-1\nQUIET-{round}-2").unwrap();
        let out = env
            .run(&["import", f.path().to_str().unwrap(), "--pool", "quiet"])
            .await;
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{err}");
        assert!(err.contains("published pool.replenished"), "{err}");
        assert!(!err.contains("io_loop") && !err.contains("ERROR"), "{err}");
        let order = format!("Q-{round}");
        let out = env
            .run(&[
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
            .await;
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{err}");
        assert!(!err.contains("io_loop") && !err.contains("ERROR"), "{err}");
    }
    env.cleanup().await;
}

/// Read-only commands never migrate: a pending migration stays pending
/// (and is named), and a schema a newer codepool wrote is refused by
/// `migrate` and by every command, naming the migration it does not know.
#[tokio::test]
async fn commands_that_read_never_migrate_and_a_newer_schema_is_refused() {
    let env = TestEnv::with_pools("messages_schema", &[("sc", 1)]).await;
    let log = env.coll("_migrations");
    log.delete_one(bson::doc! {"_id": "0014_codes_any_pool_index"})
        .await
        .unwrap();
    let out = output_ok(&mut env.command(&["stats"])).await;
    assert!(String::from_utf8_lossy(&out.stderr).contains("0014_codes_any_pool_index"));
    assert!(
        log.find_one(bson::doc! {"_id": "0014_codes_any_pool_index"})
            .await
            .unwrap()
            .is_none(),
        "stats applied nothing"
    );
    log.insert_one(bson::doc! {"_id": "9999_from_the_future"})
        .await
        .unwrap();
    for args in [&["stats"][..], &["migrate"][..]] {
        let out = env.run(args).await;
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("9999_from_the_future") && err.contains("newer codepool"),
            "{args:?}: {err}"
        );
    }
    env.cleanup().await;
}
