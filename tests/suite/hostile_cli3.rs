//! Bad input, round three, at the importer and the command line: a recall
//! that covers the whole leaked file, one file in two pools, stray quotes,
//! repeated codes, the key file as an export target, terminal escapes,
//! read-only commands on a mistyped database, wrong broker credentials,
//! gzip files, and clean exits.

use std::io::Write;
use std::time::{Duration, Instant};

use bson::doc;
use codepool_store::NewCode;

use crate::common::{codepool_ok, TestEnv};

fn csv_file(content: &[u8]) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().expect("temp file");
    f.write_all(content).expect("write");
    f
}

/// `codepool ARGS`: (exit code, stdout, stderr).
async fn codepool(env: &TestEnv, args: &[&str]) -> (i32, String, String) {
    let out = env.command(args).output().await.expect("run codepool");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `codepool import PATH --pool POOL --json [EXTRA]`: (exit code, summary).
async fn import_json(
    env: &TestEnv,
    path: &std::path::Path,
    pool: &str,
    extra: &[&str],
) -> (i32, serde_json::Value) {
    let mut args = vec!["import", path.to_str().unwrap(), "--pool", pool, "--json"];
    args.extend_from_slice(extra);
    let (code, out, err) = codepool(env, &args).await;
    let json = serde_json::from_str(&out)
        .unwrap_or_else(|_| panic!("no JSON summary (exit {code}): {err}"));
    (code, json)
}

async fn count(env: &TestEnv, filter: bson::Document) -> u64 {
    (env.store.database().collection::<bson::Document>("codes"))
        .count_documents(filter)
        .await
        .unwrap()
}

fn codes_file(prefix: &str, n: usize) -> tempfile::NamedTempFile {
    let mut content = String::from("code\n");
    for i in 0..n {
        content.push_str(&format!("{prefix}-{i:05}\n"));
    }
    csv_file(content.as_bytes())
}

#[tokio::test]
async fn recalling_a_resumed_import_voids_every_run_of_the_file() {
    let env = TestEnv::new("cli3_recall_runs").await;
    let file = codes_file("LEAK", 300);
    let name = file.path().display().to_string();
    // Run 1 was interrupted after 120 codes (what a SIGINT leaves).
    let mut first = env.store.start_import("leak", &name, None).await.unwrap();
    let codes: Vec<NewCode> = (0..120)
        .map(|i| NewCode {
            code: format!("LEAK-{i:05}"),
            expires_at: None,
            line: Some(i + 2),
        })
        .collect();
    env.store.ensure_pool("leak").await.unwrap();
    let o = env
        .store
        .insert_codes("leak", first.id, &codes)
        .await
        .unwrap();
    assert_eq!(o.inserted, 120);
    first.status = codepool_store::imports::RunState::Interrupted;
    first.inserted = 120;
    env.store.finish_import(&first).await.unwrap();
    // Run 2 finishes it; run 3 is a later re-import that inserts nothing.
    let (code, second) = import_json(&env, file.path(), "leak", &[]).await;
    assert_eq!(code, 0, "{second}");
    assert_eq!(second["inserted"], 180, "{second}");
    assert_eq!(second["resumed_from"], first.id.to_hex());
    let (code, third) = import_json(&env, file.path(), "leak", &[]).await;
    assert_eq!((code, third["inserted"].as_u64()), (0, Some(0)), "{third}");
    let third_id = third["import_id"].as_str().unwrap().to_owned();

    // Recalling the re-import voids the whole file, and says which runs.
    let out = codepool_ok(
        &env,
        &[
            "void",
            "--import",
            &third_id,
            "--reason",
            "partner leak",
            "--json",
        ],
    )
    .await;
    let r: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(r["voided"], 300, "{r}");
    let runs: Vec<&str> = (r["runs"].as_array().unwrap().iter())
        .map(|run| run["import_id"].as_str().unwrap())
        .collect();
    let second_id = second["import_id"].as_str().unwrap();
    assert_eq!(runs, [first.id.to_hex().as_str(), second_id, &third_id]);
    assert_eq!(count(&env, doc! {"pool": "leak", "status": 0}).await, 0);
    // Text output names the runs too.
    let (code, text, err) =
        codepool(&env, &["void", "--import", &third_id, "--reason", "again"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        text.contains("3 run(s)") && text.contains(&first.id.to_hex()),
        "{text}"
    );
    env.cleanup().await;
}

#[tokio::test]
async fn a_recall_of_a_run_without_codes_names_the_runs_that_hold_them_and_fails() {
    let env = TestEnv::new("cli3_recall_empty").await;
    let name = "partner.csv";
    // Two unlinked runs of a file named partner.csv: one holds codes.
    let holder = env.store.start_import("rp", name, None).await.unwrap();
    env.store.ensure_pool("rp").await.unwrap();
    let codes = [NewCode {
        code: "RP-1".into(),
        expires_at: None,
        line: Some(2),
    }];
    env.store
        .insert_codes("rp", holder.id, &codes)
        .await
        .unwrap();
    let mut empty = env.store.start_import("rp", name, None).await.unwrap();
    empty.status = codepool_store::imports::RunState::Done;
    empty.sha256 = Some("ab".repeat(32));
    env.store.finish_import(&empty).await.unwrap();
    let (code, _, err) = codepool(
        &env,
        &["void", "--import", &empty.id.to_hex(), "--reason", "leak"],
    )
    .await;
    assert_eq!(code, 1, "{err}");
    assert!(err.contains(&holder.id.to_hex()), "{err}");
    assert_eq!(count(&env, doc! {"status": 0}).await, 1, "nothing voided");
    env.cleanup().await;
}

#[tokio::test]
async fn one_file_imported_into_two_pools_is_refused_in_the_second_unless_allowed() {
    let env = TestEnv::new("cli3_cross_pool").await;
    let file = codes_file("XP", 50);
    let (code, first) = import_json(&env, file.path(), "xa", &[]).await;
    assert_eq!((code, first["inserted"].as_u64()), (0, Some(50)), "{first}");
    // Into a second pool: every code is a cross-pool duplicate, named.
    let (code, second) = import_json(&env, file.path(), "xb", &[]).await;
    assert_eq!(code, 1, "{second}");
    assert_eq!(second["inserted"], 0, "{second}");
    assert_eq!(second["cross_pool"], 50, "{second}");
    assert_eq!(second["cross_pool_pools"], serde_json::json!(["xa"]));
    let reason = second["invalid_rows"][0]["reason"].as_str().unwrap();
    assert!(
        reason.contains("cross_pool") && reason.contains("\"xa\""),
        "{reason}"
    );
    assert_eq!(count(&env, doc! {"pool": "xb"}).await, 0);
    // A file with some new codes: those go in, exit 3 (rows skipped).
    let mixed = csv_file(b"code\nXP-00001\nNEW-1\n");
    let (code, s) = import_json(&env, mixed.path(), "xb", &[]).await;
    assert_eq!(
        (code, s["inserted"].as_u64(), s["cross_pool"].as_u64()),
        (3, Some(1), Some(1)),
        "{s}"
    );
    // On purpose: the operator says so.
    let (code, third) = import_json(&env, file.path(), "xc", &["--allow-cross-pool"]).await;
    assert_eq!((code, third["inserted"].as_u64()), (0, Some(50)), "{third}");
    env.cleanup().await;
}

#[tokio::test]
async fn a_stray_quote_refuses_the_file_naming_its_line_and_the_lines_it_swallowed() {
    let env = TestEnv::new("cli3_stray_quote").await;
    let mut content = String::from("code\nOK-0002\n\"STRAY-0003\n");
    for i in 4..=2001 {
        content.push_str(&format!("CODE-{i:04}\n"));
    }
    let file = csv_file(content.as_bytes());
    let (code, _, err) = codepool(
        &env,
        &["import", file.path().to_str().unwrap(), "--pool", "sq"],
    )
    .await;
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("line 3") && err.contains("1998 line(s)") && err.contains("line 2001"),
        "{err}"
    );
    let record = (env.store.recent_imports(1).await.unwrap()).pop().unwrap();
    assert_eq!(record.status, codepool_store::imports::RunState::Failed);
    env.cleanup().await;
}

#[tokio::test]
async fn a_file_repeating_one_code_imports_in_bounded_time_counting_the_repeats() {
    let env = TestEnv::new("cli3_repeats").await;
    let content = format!("code\n{}", "SAME-CODE-1\n".repeat(100_000));
    let file = csv_file(content.as_bytes());
    let started = Instant::now();
    let (code, s) = import_json(&env, file.path(), "rep", &[]).await;
    let took = started.elapsed();
    assert_eq!(code, 0, "{s}");
    assert_eq!(
        (s["inserted"].as_u64(), s["duplicates"].as_u64()),
        (Some(1), Some(99_999)),
        "{s}"
    );
    assert!(
        took < Duration::from_secs(10),
        "100,000 repeats took {took:?}"
    );
    let record = env.store.recent_imports(1).await.unwrap().pop().unwrap();
    assert_eq!((record.inserted, record.duplicates), (1, 99_999));
    env.cleanup().await;
}

#[tokio::test]
async fn the_key_file_is_never_an_export_target_even_with_force() {
    let env = TestEnv::new("cli3_export_key").await;
    env.fill_pool("ek", 3).await;
    let before = std::fs::read(&env.key_file).unwrap();
    let key = env.key_file.to_str().unwrap();
    let (code, _, err) = codepool(
        &env,
        &[
            "export", "--pool", "ek", "--status", "unissued", "--force", "--out", key,
        ],
    )
    .await;
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("key file"), "{err}");
    assert_eq!(
        std::fs::read(&env.key_file).unwrap(),
        before,
        "the key file is unchanged"
    );
    // A hard link to it is the same file.
    let link = env.key_file.with_file_name("other-name.csv");
    std::fs::hard_link(&env.key_file, &link).unwrap();
    let (code, _, err) = codepool(
        &env,
        &[
            "export",
            "--pool",
            "ek",
            "--force",
            "--out",
            link.to_str().unwrap(),
        ],
    )
    .await;
    assert_eq!(code, 1, "{err}");
    assert_eq!(std::fs::read(&env.key_file).unwrap(), before);
    env.cleanup().await;
}

#[tokio::test]
async fn read_only_commands_refuse_a_database_without_codepool_data_and_create_none() {
    let env = TestEnv::new("cli3_no_db").await;
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
    let env = TestEnv::new("cli3_amqp_auth").await;
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
    let env = TestEnv::new("cli3_exit").await;
    env.fill_pool("ex", 3).await;
    for i in 0..25 {
        let (code, _, err) = codepool(&env, &["stats"]).await;
        assert_eq!(code, 0, "run {i}: {err}");
        assert!(!err.contains("panicked"), "run {i}: {err}");
    }
    env.cleanup().await;
}

#[tokio::test]
async fn a_gzip_file_is_refused_as_gzip() {
    let env = TestEnv::new("cli3_gzip").await;
    let file =
        csv_file(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03\x4b\xce\x4f\x49\xe5\x02\x00\x00\x00");
    let (code, _, err) = codepool(
        &env,
        &["import", file.path().to_str().unwrap(), "--pool", "gz"],
    )
    .await;
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("gzip") && !err.contains("UTF-16"), "{err}");
    env.cleanup().await;
}

const EVIL: &str = "x\u{1b}]0;owned\u{7}\u{1b}[2J\u{202e}gpj.exe";

fn assert_no_raw_escapes(out: &str) {
    assert!(
        !out.contains('\u{1b}') && !out.contains('\u{202e}'),
        "{out:?}"
    );
}

#[tokio::test]
async fn void_reasons_with_control_or_bidi_characters_are_refused() {
    let env = TestEnv::new("cli3_reason").await;
    let codes = env.fill_pool("vr", 2).await;
    for reason in [EVIL, "refund\u{202e}", "a\u{200b}b"] {
        let (code, _, err) = codepool(
            &env,
            &[
                "void", "--pool", "vr", "--code", &codes[0], "--reason", reason,
            ],
        )
        .await;
        assert_eq!(code, 1, "{reason:?}: {err}");
        assert!(err.contains("visible text"), "{err}");
        assert_no_raw_escapes(&err);
    }
    assert_eq!(count(&env, doc! {"status": 3}).await, 0, "nothing voided");
    env.cleanup().await;
}

#[tokio::test]
async fn lookup_and_dead_letters_list_escape_terminal_controls() {
    use lapin::options::BasicPublishOptions;
    let env = TestEnv::new("cli3_escapes").await;
    let codes = env.fill_pool("te", 2).await;
    // A reason stored before reasons were checked.
    let target = codepool_store::lifecycle::CodeRef::Code {
        pool: "te",
        code: &codes[0],
    };
    env.store.void(target, EVIL).await.unwrap();
    let (code, out, err) = codepool(&env, &["lookup", "--pool", "te", "--code", &codes[0]]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("\\u{1b}"), "{out}");
    assert_no_raw_escapes(&out);

    // A dead letter whose message id and body carry terminal commands.
    let conn = codepool_broker::connect(&env.amqp_url, "test")
        .await
        .unwrap();
    let publisher = codepool_broker::Publisher::new(&conn, env.topology())
        .await
        .unwrap();
    env.topology().declare(publisher.channel()).await.unwrap();
    let props = lapin::BasicProperties::default().with_message_id(EVIL.into());
    (publisher.channel())
        .basic_publish(
            "",
            &env.topology().purchases_dead,
            BasicPublishOptions::default(),
            format!("{{\"order_id\":\"{EVIL}\"}}").as_bytes(),
            props,
        )
        .await
        .unwrap()
        .await
        .unwrap();
    codepool_broker::close(conn, "done").await;
    let (code, out, err) = codepool(&env, &["dead-letters", "list"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("gpj.exe"), "{out}");
    assert_no_raw_escapes(&out);
    let (code, out, err) = codepool(&env, &["dead-letters", "list", "--json"]).await;
    assert_eq!(code, 0, "{err}");
    assert_no_raw_escapes(&out);
    let line: serde_json::Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
    assert_eq!(
        line["message_id"], EVIL,
        "JSON output stays valid JSON of the same text"
    );
    env.cleanup().await;
}

#[tokio::test]
async fn uploaded_file_names_are_base_names_of_visible_text() {
    use codepool_importer::{import_reader, ImportError, ImportOptions};
    let env = TestEnv::new("cli3_file_names").await;
    for name in [
        "../../etc/passwd",
        "a/b.csv",
        "x\u{1b}[2J.csv",
        "gpj.\u{202e}exe.csv",
    ] {
        let body: &'static [u8] = b"code\nFN-1\n";
        let r = import_reader(
            &env.store,
            body,
            name,
            0,
            "fn",
            &ImportOptions::default(),
            &|_| {},
        )
        .await;
        assert!(
            matches!(r, Err(ImportError::FileName(_))),
            "{name:?}: {r:?}"
        );
    }
    assert!(
        env.store.recent_imports(5).await.unwrap().is_empty(),
        "no run recorded"
    );
    let r = import_reader(
        &env.store,
        &b"code\nFN-1\n"[..],
        "partner.csv",
        0,
        "fn",
        &ImportOptions::default(),
        &|_| {},
    )
    .await;
    assert_eq!(r.unwrap().file, "partner.csv");
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
    let env = TestEnv::new("cli3_demo_db").await;
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a.json"), dir.path().join("b.json"));
    for k in [&a, &b] {
        let out = env
            .command(&["keys", "init"])
            .env("CODEPOOL_KEY_FILE", k)
            .output()
            .await
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let (db_a, db_b) = (demo_db(&a), demo_db(&b));
    assert_ne!(db_a, db_b, "two checkouts, two demo databases");
    assert!(
        db_a.starts_with("codepool_demo_") && db_a.len() < 64,
        "{db_a}"
    );
    assert_eq!(demo_db(&a), db_a, "the same key file, the same database");
    // A rotation keeps the HMAC key, so the demo keeps its database.
    let out = env
        .command(&["keys", "add"])
        .env("CODEPOOL_KEY_FILE", &a)
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(demo_db(&a), db_a);
    env.cleanup().await;
}
