//! Issue 12: codes are secrets. Encrypted at rest, found by HMAC, revealed
//! only on purpose (and audited), keys verified before a dispatcher
//! consumes, rotated and migrated while dispatchers run. A process whose
//! key file lacks the newest key claims nothing (and `/readyz` says so no
//! later than the first refused order) until its key file is brought up
//! to date; a retired key missing from it blocks nothing.

use std::collections::HashSet;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use bson::{doc, Bson, Document};
use codepool_domain::{mask, SmsPending};
use codepool_issuance::Resend;
use codepool_store::ObjectId;
use futures::TryStreamExt;

use crate::api::order;
use crate::common::*;
use crate::fixtures::*;

/// Runs `codepool ARGS` in the test's namespace: (exit code, stdout, stderr).
async fn codepool(env: &TestEnv, args: &[&str]) -> (i32, String, String) {
    let out = env.run(args).await;
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Codes no other data could contain by chance.
fn secret_codes(n: usize) -> Vec<String> {
    (0..n)
        .map(|i| format!("ZQX{i:04}SECRET{:05}", i * 7919 % 100_000))
        .collect()
}

fn csv_of(codes: &[String]) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    writeln!(f, "code").unwrap();
    for c in codes {
        writeln!(f, "{c}").unwrap();
    }
    f.flush().unwrap();
    f
}

async fn import(env: &TestEnv, codes: &[String], pool: &str) {
    let f = csv_of(codes);
    let (code, out, err) =
        codepool(env, &["import", f.path().to_str().unwrap(), "--pool", pool]).await;
    assert_eq!(code, 0, "{out}{err}");
}

/// Every string in a BSON value, and every binary as lossy text.
fn texts(b: &Bson, out: &mut Vec<String>) {
    match b {
        Bson::String(s) => out.push(s.clone()),
        Bson::Binary(bin) => out.push(String::from_utf8_lossy(&bin.bytes).into_owned()),
        Bson::Document(d) => d.iter().for_each(|(k, v)| {
            out.push(k.clone());
            texts(v, out)
        }),
        Bson::Array(a) => a.iter().for_each(|v| texts(v, out)),
        other => out.push(other.to_string()),
    }
}

/// Every document of every collection of the test's database, as text.
async fn mongo_texts(env: &TestEnv) -> Vec<(String, String)> {
    let db = env.store.database();
    let mut out = Vec::new();
    for name in db.list_collection_names().await.unwrap() {
        let docs: Vec<Document> = db
            .collection::<Document>(&name)
            .find(doc! {})
            .await
            .unwrap()
            .try_collect()
            .await
            .unwrap();
        for d in docs {
            let mut t = Vec::new();
            texts(&Bson::Document(d), &mut t);
            out.push((name.clone(), t.join("\u{1}")));
        }
    }
    out
}

/// Every key under the test's Redis prefix with its values, as text.
async fn redis_texts(env: &TestEnv) -> Vec<String> {
    let client = redis::Client::open(env.redis_url.as_str()).unwrap();
    let mut c = client.get_multiplexed_async_connection().await.unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{}*", env.redis_prefix))
        .query_async(&mut c)
        .await
        .unwrap();
    let mut out = Vec::new();
    for k in keys {
        let kind: String = redis::cmd("TYPE")
            .arg(&k)
            .query_async(&mut c)
            .await
            .unwrap();
        let values: Vec<Vec<u8>> = match kind.as_str() {
            "string" => vec![redis::cmd("GET").arg(&k).query_async(&mut c).await.unwrap()],
            "zset" => redis::cmd("ZRANGE")
                .arg(&k)
                .arg(0)
                .arg(-1)
                .arg("WITHSCORES")
                .query_async(&mut c)
                .await
                .unwrap(),
            "hash" => redis::cmd("HGETALL")
                .arg(&k)
                .query_async(&mut c)
                .await
                .unwrap(),
            "list" => redis::cmd("LRANGE")
                .arg(&k)
                .arg(0)
                .arg(-1)
                .query_async(&mut c)
                .await
                .unwrap(),
            "set" => redis::cmd("SMEMBERS")
                .arg(&k)
                .query_async(&mut c)
                .await
                .unwrap(),
            other => panic!("unexpected Redis type {other} for {k}"),
        };
        out.push(k);
        out.extend(
            values
                .iter()
                .map(|v| String::from_utf8_lossy(v).into_owned()),
        );
    }
    out
}

/// Publishes `n` purchases of `pool` and waits until the dispatcher has
/// granted them all (SMS-pending events queued).
async fn buy(env: &TestEnv, pool: &str, prefix: &str, n: usize) -> Vec<String> {
    let (_conn, publisher) = env.amqp().await;
    let orders: Vec<_> = (0..n)
        .map(|i| purchase(&format!("{prefix}-{i:05}"), pool))
        .collect();
    publish_confirmed(&publisher, &orders).await;
    orders.into_iter().map(|p| p.order_id).collect()
}

async fn wait_for_events(env: &TestEnv, n: u32) -> lapin::Channel {
    let conn = codepool_broker::connect(AMQP_URL, "test").await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    let t = env.topology();
    eventually(Duration::from_secs(90), "purchases granted", || {
        let (ch, t) = (ch.clone(), t.clone());
        async move {
            queue_depth(&ch, &t.sms_pending).await >= n && queue_depth(&ch, &t.purchases).await == 0
        }
    })
    .await;
    ch
}

#[tokio::test]
async fn secrets_no_plaintext_code_in_any_collection_or_redis_key_after_import_and_dispatch() {
    let env = TestEnv::new("secrets_scan").await;
    let codes = secret_codes(300);
    import(&env, &codes, "sec").await;
    let daemon = start_daemon(env.command(&[])).await;
    buy(&env, "sec", "SCAN", 200).await;
    let ch = wait_for_events(&env, 200).await;
    // An unknown pool (dead letter) and an exhausted pool (backorder) too.
    // The same secret code in a second pool, on purpose (a code sits in one
    // pool unless the operator says otherwise).
    let f = csv_of(&codes[..1]);
    let path = f.path().to_str().unwrap();
    let tiny = ["import", path, "--pool", "tiny", "--allow-cross-pool"];
    let (code, out, err) = codepool(&env, &tiny).await;
    assert_eq!(code, 0, "{out}{err}");
    buy(&env, "tiny", "TINY", 3).await;
    buy(&env, "nope", "DEAD", 1).await;
    wait_for_events(&env, 201).await;
    let (code, out, err) = codepool(&env, &["lookup", "--order", "SCAN-00001", "--reveal"]).await;
    assert_eq!(code, 0, "{err}");
    daemon.stop().await;

    // The SMS-pending events do carry the codes: that is their job.
    let events = drain(&ch, &env.topology().sms_pending).await;
    let sent: Vec<SmsPending> = events
        .iter()
        .map(|e| serde_json::from_slice(&e.body).unwrap())
        .collect();
    assert!(
        sent.len() >= 201
            && sent
                .iter()
                .all(|e| e.code.as_ref().is_some_and(|c| codes.contains(c)))
    );
    assert!(out.contains(
        sent.iter()
            .find(|e| e.order_id == "SCAN-00001")
            .and_then(|e| e.code.as_deref())
            .unwrap()
    ));

    let stored = mongo_texts(&env).await;
    assert!(
        stored.iter().any(|(c, _)| c == "audit"),
        "the reveal was audited"
    );
    assert!(stored.iter().filter(|(c, _)| c == "codes").count() >= 301);
    let redis = redis_texts(&env).await;
    assert!(!redis.is_empty(), "the hot pool was in use");
    for c in &codes {
        for (coll, text) in &stored {
            assert!(
                !text.contains(c.as_str()),
                "plaintext {c} in collection {coll}"
            );
        }
        assert!(
            !redis.iter().any(|t| t.contains(c.as_str())),
            "plaintext {c} in Redis"
        );
    }
    env.cleanup().await;
}

/// A copy of the test's key file as it is now, mode 0600.
fn copy_key_file(env: &TestEnv, name: &str) -> std::path::PathBuf {
    let copy = env.key_file.with_file_name(name);
    std::fs::copy(&env.key_file, &copy).unwrap();
    std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o600)).unwrap();
    copy
}

/// `codepool dispatch` with another key file: exit status and stderr.
async fn dispatch_with_key_file(env: &TestEnv, key_file: &std::path::Path) -> (i32, String) {
    let out = tokio::time::timeout(
        Duration::from_secs(30),
        env.command(&["dispatch", "--no-http"])
            .env("CODEPOOL_KEY_FILE", key_file)
            .output(),
    )
    .await
    .expect("the dispatcher refuses at once")
    .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn secrets_a_wrong_missing_or_outdated_key_file_consumes_nothing() {
    let env = TestEnv::new("secrets_wrongkey").await;
    import(&env, &secret_codes(20), "wk").await;
    buy(&env, "wk", "WK", 5).await;
    let purchases_left = || async {
        let conn = codepool_broker::connect(AMQP_URL, "test").await.unwrap();
        let ch = conn.create_channel().await.unwrap();
        queue_depth(&ch, &env.topology().purchases).await
    };
    assert_eq!(purchases_left().await, 5);

    let dir = tempfile::tempdir().unwrap();
    let (code, err) = dispatch_with_key_file(&env, &dir.path().join("none.json")).await;
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("codepool keys init"), "{err}");

    let wrong = dir.path().join("wrong.json");
    codepool_vault::keyfile::init(&wrong).unwrap();
    let (code, err) = dispatch_with_key_file(&env, &wrong).await;
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("not the one"), "{err}");
    // Nor does an import seal codes with it.
    let f = csv_of(&secret_codes(30)[25..]);
    let out = env
        .command(&["import", f.path().to_str().unwrap(), "--pool", "wk"])
        .env("CODEPOOL_KEY_FILE", &wrong)
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not the one"));

    // A key added (and used) after this copy was taken: k2 is missing.
    let outdated = copy_key_file(&env, "outdated.json");
    let (code, out, err) = codepool(&env, &["keys", "add"]).await;
    assert_eq!(code, 0, "{out}{err}");
    import(&env, &secret_codes(25)[20..], "wk").await;
    let (code, err) = dispatch_with_key_file(&env, &outdated).await;
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("\"k2\"") && err.contains("missing"), "{err}");

    assert_eq!(purchases_left().await, 5, "nothing was consumed");
    assert_eq!(count_codes(&env, doc! {"status": 1}).await, 0);
    env.cleanup().await;
}

/// Every code of `pool` decrypted, with its status and order.
async fn decrypted(env: &TestEnv, pool: &str) -> Vec<(String, i32, Option<String>)> {
    let docs: Vec<Document> = find_docs(env, "codes", doc! {"pool": pool}).await;
    docs.iter()
        .map(|d| {
            let order = d.get_str("order_id").ok().map(str::to_owned);
            (env.plain_code(d), d.get_i32("status").unwrap(), order)
        })
        .collect()
}

/// Every issued code is distinct, every order holds one, and the codes are
/// exactly the imported ones.
fn assert_one_code_per_order(
    all: &[(String, i32, Option<String>)],
    codes: &[String],
    orders: usize,
) {
    let stored: HashSet<&str> = all.iter().map(|(c, _, _)| c.as_str()).collect();
    let imported: HashSet<&str> = codes.iter().map(String::as_str).collect();
    assert_eq!(stored, imported, "no code lost or altered");
    let issued: Vec<_> = all.iter().filter(|(_, s, _)| *s == 1).collect();
    assert_eq!(issued.len(), orders);
    let holders: HashSet<_> = issued.iter().map(|(_, _, o)| o.clone().unwrap()).collect();
    assert_eq!(holders.len(), orders, "no order holds two codes");
}

#[tokio::test]
async fn secrets_rotation_while_a_dispatcher_runs_loses_nothing_and_issues_nothing_twice() {
    let env = TestEnv::new("secrets_rotate").await;
    let codes = secret_codes(3000);
    import(&env, &codes, "rot").await;
    let daemon = start_daemon(env.command(&[])).await;
    let (code, out, err) = codepool(&env, &["keys", "add"]).await;
    assert_eq!(code, 0, "{out}{err}");
    // Purchases flow while the codes are re-encrypted in small batches.
    let buying = buy(&env, "rot", "ROT", 600);
    let rotating = codepool(&env, &["keys", "rotate", "--batch-size", "50"]);
    let (_, (code, out, err)) = tokio::join!(buying, rotating);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("under key k2"), "{out}");
    let ch = wait_for_events(&env, 600).await;
    daemon.stop().await;

    env.store.keys().reload().unwrap();
    assert_eq!(env.store.keys().ring().unwrap().active_id(), "k2");
    assert_eq!(env.store.count_to_rotate().await.unwrap(), 0);
    let (_, status, _) = codepool(&env, &["keys", "status"]).await;
    assert!(status.contains("k2") && status.contains("3000"), "{status}");
    let all = decrypted(&env, "rot").await;
    assert_one_code_per_order(&all, &codes, 600);
    let events = drain(&ch, &env.topology().sms_pending).await;
    let sent: HashSet<String> = events
        .iter()
        .filter_map(|e| serde_json::from_slice::<SmsPending>(&e.body).unwrap().code)
        .collect();
    let issued: HashSet<String> = all
        .iter()
        .filter(|a| a.1 == 1)
        .map(|a| a.0.clone())
        .collect();
    assert_eq!(sent, issued, "every event carries its grant's code");
    env.cleanup().await;
}

/// Documents as a version before encryption stored them: plaintext `code`.
async fn insert_plaintext(env: &TestEnv, pool: &str, codes: &[String]) {
    env.store.ensure_pool(pool).await.unwrap();
    let first = env
        .store
        .reserve_seq(pool, codes.len() as u64)
        .await
        .unwrap();
    let now = bson::DateTime::now();
    let docs: Vec<Document> = codes
        .iter()
        .enumerate()
        .map(|(i, c)| {
            doc! {"_id": ObjectId::new(), "pool": pool, "code": c, "status": 0,
            "seq": first + i as i64, "created_at": now, "is_sms": 0}
        })
        .collect();
    env.coll("codes")
        .insert_many(docs)
        .bypass_document_validation(true)
        .await
        .unwrap();
}

#[tokio::test]
async fn secrets_migrate_encrypts_plaintext_in_place_while_codes_are_claimed() {
    let env = TestEnv::new("secrets_migrate").await;
    let codes = secret_codes(2500);
    insert_plaintext(&env, "old", &codes).await;
    // An import into a pool that still holds plaintext is refused.
    let f = csv_of(&secret_codes(1));
    let (code, _, err) = codepool(
        &env,
        &["import", f.path().to_str().unwrap(), "--pool", "old"],
    )
    .await;
    assert_eq!(code, 1);
    assert!(err.contains("codepool migrate"), "{err}");
    // Before the migration, a plaintext code is still found by value.
    let (code, out, err) = codepool(&env, &["lookup", "--pool", "old", "--code", &codes[7]]).await;
    assert_eq!(code, 0, "{out}{err}");

    let engine = env.engine();
    let claiming = async {
        let mut n = 0;
        for b in 0..40 {
            let batch: Vec<_> = (0..10)
                .map(|i| purchase(&format!("MIG-{b:03}-{i}"), "old"))
                .collect();
            let refs: Vec<_> = batch.iter().collect();
            let outcomes = engine
                .claim_batch(&refs, Resend::ByRedelivery)
                .await
                .expect("claim");
            n += outcomes.iter().filter(|o| o.single().is_some()).count();
        }
        n
    };
    let migrating = codepool(&env, &["migrate", "--batch-size", "100"]);
    let (claimed, (code, out, err)) = tokio::join!(claiming, migrating);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("encrypted 2500"), "{out}");
    assert_eq!(claimed, 400);
    assert!(!env.store.has_plaintext().await.unwrap());
    assert_one_code_per_order(&decrypted(&env, "old").await, &codes, 400);

    // Found by HMAC now, and the lookup masks it.
    let (code, out, _) = codepool(&env, &["lookup", "--pool", "old", "--code", &codes[2400]]).await;
    assert_eq!(code, 0);
    assert!(
        out.contains(&mask(&codes[2400])) && !out.contains(&codes[2400]),
        "{out}"
    );
    env.cleanup().await;
}

/// The reveal records in `audit`.
async fn audit_records(env: &TestEnv) -> Vec<Document> {
    find_docs(env, "audit", doc! {}).await
}

#[tokio::test]
async fn secrets_codes_show_masked_unless_revealed_and_every_reveal_is_audited() {
    let env = TestEnv::new("secrets_reveal").await;
    let codes = env.fill_pool("rv", 40).await;
    let engine = env.engine();
    let buyers: Vec<_> = (0..10)
        .map(|i| purchase(&format!("RV-{i}"), "rv"))
        .collect();
    engine
        .claim_batch(&buyers.iter().collect::<Vec<_>>(), Resend::ByRedelivery)
        .await
        .unwrap();
    let (_, out, _) = codepool(&env, &["lookup", "--pool", "rv", "--json"]).await;
    assert!(!codes.iter().any(|c| out.contains(c.as_str())), "{out}");
    assert!(audit_records(&env).await.is_empty(), "no reveal, no record");

    let (code, out, err) = codepool(&env, &["lookup", "--order", "RV-3", "--reveal"]).await;
    assert_eq!(code, 0, "{err}");
    assert!(codes.iter().any(|c| out.contains(c.as_str())), "{out}");
    let audit = audit_records(&env).await;
    assert_eq!(audit.len(), 1);
    let a = &audit[0];
    // Recorded by the core like every other door's: who (the OS user at
    // this host) and the command.
    assert_eq!(a.get_str("command").unwrap(), "codepool lookup --reveal");
    assert!(a.get_str("what").unwrap().contains("RV-3"));
    assert!(a.get_str("os_user").unwrap().starts_with("os-user:"));
    assert!(!a.get_str("host").unwrap().is_empty());
    assert!(a.get_datetime("at").is_ok());
    assert_eq!(a.get_array("code_ids").unwrap().len(), 1);

    // export: masked by default, clear with --reveal (audited), mode 0600.
    let dir = tempfile::tempdir().unwrap();
    let masked = dir.path().join("masked.csv");
    let (code, out, err) = codepool(
        &env,
        &[
            "export",
            "--pool",
            "rv",
            "--status",
            "issued",
            "--out",
            masked.to_str().unwrap(),
        ],
    )
    .await;
    assert_eq!(code, 0, "{out}{err}");
    let text = std::fs::read_to_string(&masked).unwrap();
    assert_eq!(text.lines().count(), 11, "{text}");
    assert!(!codes.iter().any(|c| text.contains(c.as_str())), "{text}");
    let clear = dir.path().join("clear.csv");
    let (code, _, err) = codepool(
        &env,
        &[
            "export",
            "--pool",
            "rv",
            "--status",
            "unissued,issued",
            "--reveal",
            "--out",
            clear.to_str().unwrap(),
        ],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    let text = std::fs::read_to_string(&clear).unwrap();
    assert!(codes.iter().all(|c| text.contains(c.as_str())));
    let mode = std::fs::metadata(&clear).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let audit = audit_records(&env).await;
    assert_eq!(audit.len(), 2);
    assert_eq!(
        audit[1].get_str("command").unwrap(),
        "codepool export --reveal"
    );
    assert_eq!(audit[1].get_i64("count").unwrap(), 40);
    env.cleanup().await;
}

#[tokio::test]
async fn secrets_help_never_prints_credentials_from_the_environment() {
    let env = TestEnv::new("secrets_help").await;
    for cmd in [
        &["stats", "--help"][..],
        &["--help"],
        &["dispatch", "--help"],
    ] {
        let out = env
            .command(cmd)
            .env(
                "CODEPOOL_MONGODB_URI",
                "mongodb://admin:m0ngoS3cret@db:27017",
            )
            .env("CODEPOOL_AMQP_URL", "amqp://app:rabb1tS3cret@mq:5672/%2f")
            .env("CODEPOOL_REDIS_URL", "redis://:red1sS3cret@cache:6379")
            .output()
            .await
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("CODEPOOL_AMQP_URL"), "{text}");
        for secret in ["m0ngoS3cret", "rabb1tS3cret", "red1sS3cret"] {
            assert!(!text.contains(secret), "{cmd:?} printed {secret}");
        }
    }
    env.cleanup().await;
}

#[tokio::test]
async fn secrets_keys_init_writes_a_private_file_and_never_overwrites_one() {
    let env = TestEnv::new("secrets_init").await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("conf/keys.json");
    let init = |p: &std::path::Path| {
        let mut cmd = env.command(&["keys", "init"]);
        cmd.env("CODEPOOL_KEY_FILE", p);
        cmd
    };
    let out = init(&path).output().await.unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("back it up"));
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let before = std::fs::read(&path).unwrap();
    let out = init(&path).output().await.unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("never overwrites"));
    assert_eq!(
        std::fs::read(&path).unwrap(),
        before,
        "the key file is untouched"
    );
    env.cleanup().await;
}

#[tokio::test]
async fn readyz_turns_not_ready_no_later_than_the_first_order_refused_for_a_stale_key_file() {
    let env = TestEnv::with_pools("secrets_keys_ready", &[("kr", 50)]).await;
    let (api, backend) = api_with_key(&env, "backend", "orders:write").await;
    let ready = || {
        let addr = api.addr.clone();
        async move { http_get(&addr, "/readyz").await.map(|(s, _)| s) }
    };
    eventually(Duration::from_secs(15), "ready", || async {
        ready().await == Some(200)
    })
    .await;
    // Another host adds a key and seals the codes with it.
    let dir = tempfile::tempdir().unwrap();
    let other = dir.path().join("keys.json");
    std::fs::copy(&env.key_file, &other).unwrap();
    for args in [["keys", "add"], ["keys", "rotate"]] {
        output_ok(env.command(&args).env("CODEPOOL_KEY_FILE", &other)).await;
    }
    // Orders until the first 503: /readyz already says not ready.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut n = 0;
    loop {
        assert!(std::time::Instant::now() < deadline, "no order was refused");
        n += 1;
        let (s, _, b) = api
            .post("/v1/orders", &backend, &order(&format!("KR-{n}"), "kr", 1))
            .await;
        if s == 503 {
            assert_eq!(
                ready().await,
                Some(503),
                "an order got 503 while /readyz said ready"
            );
            break;
        }
        assert_eq!(s, 201, "{}", String::from_utf8_lossy(&b));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The key file brought up to date: ready again, and orders go on.
    std::fs::copy(&other, &env.key_file).unwrap();
    eventually(Duration::from_secs(20), "ready again", || async {
        ready().await == Some(200)
    })
    .await;
    let (s, _, b) = api
        .post("/v1/orders", &backend, &order("KR-last", "kr", 1))
        .await;
    assert_eq!(s, 201, "{}", String::from_utf8_lossy(&b));
    api.stop().await;
    env.cleanup().await;
}

/// A dispatcher whose key file lacks the key another host now seals codes
/// with claims nothing: it goes unready, hands the purchase back and stops
/// consuming, with one error naming the key; once its key file holds the
/// key it serves the purchase.
#[tokio::test]
async fn a_process_without_the_newest_key_claims_nothing_and_resumes_with_it() {
    let env = TestEnv::with_pools("secrets_keys", &[("k", 3)]).await;
    let daemon = start_daemon(env.command(&[])).await;
    // Another host: a copy of the key file, a new key, codes sealed with it.
    let dir = tempfile::tempdir().unwrap();
    let other = dir.path().join("keys.json");
    std::fs::copy(&env.key_file, &other).unwrap();
    let as_other = |args: &[&str]| {
        let mut c = env.command(args);
        c.env("CODEPOOL_KEY_FILE", &other);
        c
    };
    assert!(as_other(&["keys", "add"])
        .output()
        .await
        .unwrap()
        .status
        .success());
    let out = as_other(&["keys", "rotate"]).output().await.unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    eventually(
        Duration::from_secs(15),
        "the dispatcher goes unready",
        || async {
            http_get(&daemon.addr, "/readyz")
                .await
                .is_some_and(|(s, body)| s == 503 && body.contains("keys"))
        },
    )
    .await;
    let (conn, publisher) = env.amqp().await;
    publish_confirmed(&publisher, &[purchase("K-1", "k")]).await;
    // Judged once the dispatcher has stopped consuming and the purchase is
    // back in the queue (handed back, or never taken): nothing of this
    // process can claim it any more.
    let purchases = env.topology().purchases;
    eventually(
        Duration::from_secs(30),
        "the purchase waits in the queue, for any dispatcher, and none consumes",
        || async { queue_counts(&conn, &purchases).await == Some((1, 0)) },
    )
    .await;
    assert_eq!(
        order_statuses(&env, "K-1").await,
        Vec::<i32>::new(),
        "nothing claimed"
    );
    let log = daemon.log_text();
    assert_eq!(
        log.matches("that this process's key file lacks").count(),
        1,
        "one error naming the key:\n{log}"
    );
    assert!(log.contains("k2"), "{log}");

    // The key file is brought up to date: the same process serves it.
    std::fs::copy(&other, &env.key_file).unwrap();
    eventually(Duration::from_secs(20), "K-1 granted", || async {
        order_statuses(&env, "K-1").await == vec![1]
    })
    .await;
    assert!(http_get(&daemon.addr, "/readyz")
        .await
        .is_some_and(|(s, _)| s == 200));
    daemon.stop().await;
    env.cleanup().await;
}

/// A key that seals no code any more (rotated away, then dropped from the
/// key file) does not hold a process unready: it leaves the registry.
#[tokio::test]
async fn a_retired_key_missing_from_the_key_file_blocks_nothing() {
    let env = TestEnv::with_pools("secrets_retired", &[("rt", 2)]).await;
    let registry = env.coll("key_ids");
    registry
        .insert_one(bson::doc! {"_id": "k-retired"})
        .await
        .unwrap();
    let daemon = start_daemon(env.command(&[])).await;
    let (_conn, publisher) = env.amqp().await;
    publish_confirmed(&publisher, &[purchase("RT-1", "rt")]).await;
    eventually(Duration::from_secs(20), "RT-1 granted", || async {
        order_statuses(&env, "RT-1").await == vec![1]
    })
    .await;
    assert!(registry
        .find_one(bson::doc! {"_id": "k-retired"})
        .await
        .unwrap()
        .is_none());
    daemon.stop().await;
    env.cleanup().await;
}

/// Reads of codes sealed with a key this process lacks (an order, a
/// replacement, a redemption by code) and a checkout hold of them answer
/// the documented 503 `unavailable` with `Retry-After`, as orders do,
/// never 500 `internal`.
#[tokio::test]
async fn reads_of_codes_under_a_key_the_process_lacks_answer_503_and_retry_after() {
    let env = TestEnv::with_pools("secrets_keys_reads", &[("kk", 20)]).await;
    let (api, backend) = api_with_key(&env, "backend", "orders:write,orders:read").await;
    let platform = codepool_ok(
        &env,
        &[
            "api-keys",
            "create",
            "--name",
            "platform",
            "--scopes",
            "codes:redeem",
        ],
    )
    .await
    .trim()
    .to_owned();
    let (s, _, b) = api
        .post("/v1/orders", &backend, &order("KK-1", "kk", 1))
        .await;
    assert_eq!(s, 201, "{}", String::from_utf8_lossy(&b));
    let code = crate::api::json_of(&b)["codes"][0]["code"]
        .as_str()
        .unwrap()
        .to_owned();
    // Another host adds a key and seals every code with it.
    let dir = tempfile::tempdir().unwrap();
    let other = dir.path().join("keys.json");
    std::fs::copy(&env.key_file, &other).unwrap();
    for args in [["keys", "add"], ["keys", "rotate"]] {
        output_ok(env.command(&args).env("CODEPOOL_KEY_FILE", &other)).await;
    }
    let replace = serde_json::json!({"replacement_id": "R-kk", "reason": "rejected"}).to_string();
    let redeem = serde_json::json!({"code": code, "redemption_id": "X-kk"}).to_string();
    let hold = serde_json::json!({"hold_id": "H-kk", "uid": "kk-buyer", "items": [{"pool": "kk", "quantity": 1}]}).to_string();
    let answers = [
        (
            "GET /v1/orders/KK-1",
            api.get("/v1/orders/KK-1", &backend).await,
        ),
        (
            "replace",
            api.post(
                "/v1/orders/KK-1/lines/0/replace",
                &backend,
                replace.as_bytes(),
            )
            .await,
        ),
        (
            "redeem",
            api.post("/v1/codes/redeem", &platform, redeem.as_bytes())
                .await,
        ),
        (
            "POST /v1/holds",
            api.post("/v1/holds", &backend, hold.as_bytes()).await,
        ),
    ];
    for (what, (status, headers, body)) in answers {
        let body = String::from_utf8_lossy(&body);
        assert_eq!(status, 503, "{what}: {body}");
        assert!(headers.contains_key("retry-after"), "{what}: {headers:?}");
        assert!(body.contains("/unavailable"), "{what}: {body}");
    }
    assert_eq!(
        find_docs(
            &env,
            "codes",
            doc! {"pool": "kk", "status": {"$in": [2, 3, 4]}}
        )
        .await
        .len(),
        0,
        "nothing redeemed, replaced or held"
    );
    api.stop().await;
    env.cleanup().await;
}
