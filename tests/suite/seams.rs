//! The seams between the doors (issue 43, round three): rules that one door
//! kept and another did not. Each test is a hostile user's move against the
//! real servers.

use std::time::Duration;

use codepool_broker::Publisher;
use codepool_store::pool_settings::PoolSettings;

use crate::common::{
    drain, eventually, pool_events_handled, publish_confirmed, purchase, queue_depth, start_daemon,
    wait_settled, TestEnv, AMQP_URL,
};

/// A 128-character order id of two-byte letters is valid, yet `sms:<id>`
/// is longer than AMQP's 255-byte message id. Every event of such an order
/// is published (with a hashed message id), and the other orders of the
/// same batches still get theirs: nothing closes the connection.
#[tokio::test]
async fn a_long_multibyte_order_id_is_granted_texted_and_refused_without_costing_others() {
    let env = TestEnv::new("seam_long_id").await;
    env.fill_pool("game", 20).await;
    env.fill_pool("limited", 5).await;
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
    let conn = codepool_broker::connect(AMQP_URL, "test").await.unwrap();
    let publisher = Publisher::new(&conn, env.topology()).await.unwrap();

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

/// Adds `n` codes `PREFIX-000001`… to an existing pool.
async fn add_codes(env: &TestEnv, pool: &str, prefix: &str, n: usize) {
    let new: Vec<codepool_store::NewCode> = (1..=n)
        .map(|i| codepool_store::NewCode {
            code: format!("{prefix}-{i:06}"),
            line: None,
            expires_at: None,
        })
        .collect();
    let out = env
        .store
        .insert_codes(pool, bson::oid::ObjectId::new(), &new)
        .await
        .expect("insert");
    assert_eq!(out.inserted as usize, n);
}

/// Codes of `order` by status (0 unissued … 3 void).
async fn statuses(env: &TestEnv, order: &str) -> Vec<i32> {
    use futures::TryStreamExt;
    let mut s: Vec<i32> = env
        .store
        .database()
        .collection::<bson::Document>("codes")
        .find(bson::doc! {"order_id": order})
        .await
        .unwrap()
        .try_collect::<Vec<_>>()
        .await
        .unwrap()
        .iter()
        .map(|d| d.get_i32("status").unwrap())
        .collect();
    s.sort();
    s
}

/// A void is final: a waiting order voided, and a partly granted one
/// voided as a refund, get nothing when they come back after stock
/// arrives, over HTTP (409 `order-cancelled`) or over AMQP (no event).
#[tokio::test]
async fn a_cancelled_backorder_never_comes_back_through_either_door() {
    use crate::api::{http, json_of, key, order, ApiServer};
    let env = TestEnv::new("seam_cancelled").await;
    env.fill_pool("few", 2).await;
    let shop = key(&env, "shop", "orders:write,orders:read").await;
    let api = ApiServer::start(&env, &[]).await;
    let place = |id: &'static str, q: u32| {
        let addr = api.addr.clone();
        let shop = shop.clone();
        async move {
            http(
                &addr,
                "POST",
                "/v1/orders",
                Some(&shop),
                &order(id, "few", q),
            )
            .await
        }
    };
    let (status, _, body) = place("P-5", 5).await;
    assert_eq!(status, 202, "{}", String::from_utf8_lossy(&body));
    assert_eq!(json_of(&body)["state"], "partly_granted");
    let (status, _, _) = place("W-1", 1).await;
    assert_eq!(status, 202);
    for id in ["P-5", "W-1"] {
        let (status, _, body) = http(
            &api.addr,
            "POST",
            &format!("/v1/orders/{id}/void"),
            Some(&shop),
            br#"{"reason":"refund"}"#,
        )
        .await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        assert_eq!(json_of(&body)["backorder_cancelled"], true);
    }
    add_codes(&env, "few", "more", 10).await;
    for (id, q) in [("P-5", 5), ("W-1", 1)] {
        let (status, _, body) = place(id, q).await;
        assert_eq!(status, 409, "{id}: {}", String::from_utf8_lossy(&body));
        let b = json_of(&body);
        assert!(
            b["type"].as_str().unwrap().ends_with("order-cancelled"),
            "{b}"
        );
        assert!(
            body.windows(5).all(|w| w != b"more-"),
            "no code in the answer"
        );
    }
    api.stop().await;
    let conn = codepool_broker::connect(AMQP_URL, "test").await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    let t = env.topology();
    // P-5's first two codes were texted when they were granted.
    let first = drain(&ch, &t.sms_pending).await;
    assert!(first
        .iter()
        .all(|m| String::from_utf8_lossy(&m.body).contains("P-5")));

    // The same purchases over AMQP: acked, nothing granted, nothing texted.
    let daemon = start_daemon(env.command(&[])).await;
    let publisher = Publisher::new(&conn, env.topology()).await.unwrap();
    let mut again = vec![
        purchase("W-1", "few"),
        purchase("P-5", "few"),
        purchase("FRESH", "few"),
    ];
    for p in &mut again {
        p.uid = "u-api".into();
    }
    again[1].quantity = 5;
    publish_confirmed(&publisher, &again).await;
    eventually(Duration::from_secs(30), "the fresh order's event", || {
        let (ch, q) = (ch.clone(), t.sms_pending.clone());
        async move { queue_depth(&ch, &q).await >= 1 }
    })
    .await;
    eventually(Duration::from_secs(30), "every purchase acked", || {
        let (ch, q) = (ch.clone(), t.purchases.clone());
        async move { queue_depth(&ch, &q).await == 0 }
    })
    .await;
    let sms = drain(&ch, &t.sms_pending).await;
    assert_eq!(sms.len(), 1, "only FRESH is texted");
    assert!(String::from_utf8_lossy(&sms[0].body).contains("FRESH"));
    assert_eq!(statuses(&env, "W-1").await, Vec::<i32>::new());
    assert_eq!(
        statuses(&env, "P-5").await,
        vec![3, 3],
        "the two voided codes, nothing new"
    );
    daemon.stop().await;
    env.cleanup().await;
}

/// Cancelling a backorder and fulfilling it exclude each other: orders
/// voided while their paused pool resumes keep no live code, and one whose
/// void answered "nothing voided" is never texted.
#[tokio::test]
async fn a_void_racing_a_resume_leaves_no_live_code_and_says_what_it_voided() {
    use crate::api::{http, json_of, key, order, ApiServer};
    let env = TestEnv::new("seam_void_race").await;
    env.fill_pool("race", 60).await;
    env.store.set_paused("race", true).await.expect("pause");
    let shop = key(&env, "shop", "orders:write,orders:read").await;
    let api = ApiServer::start(&env, &[]).await;
    let ids: Vec<String> = (0..40).map(|i| format!("R-{i}")).collect();
    for id in &ids {
        let (status, _, _) = http(
            &api.addr,
            "POST",
            "/v1/orders",
            Some(&shop),
            &order(id, "race", 1),
        )
        .await;
        assert_eq!(status, 202);
    }
    let daemon = start_daemon(env.command(&[])).await;
    let resume = env.command(&["pool", "resume", "--pool", "race"]).output();
    let voids = futures::future::join_all(ids.iter().map(|id| {
        let (addr, shop) = (api.addr.clone(), shop.clone());
        async move {
            let (status, _, body) = http(
                &addr,
                "POST",
                &format!("/v1/orders/{id}/void"),
                Some(&shop),
                br#"{"reason":"refund"}"#,
            )
            .await;
            assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
            json_of(&body)["voided"].as_u64().unwrap()
        }
    }));
    let (resumed, voided) = tokio::join!(resume, voids);
    assert!(resumed.unwrap().status.success());
    // Any fulfilment in flight finishes before the dispatcher reads the
    // next pool.resumed.
    let conn = codepool_broker::connect(AMQP_URL, "test").await.unwrap();
    let publisher = Publisher::new(&conn, env.topology()).await.unwrap();
    pool_events_handled(&env, &publisher, codepool_domain::PoolEventKind::Resumed).await;
    let ch = conn.create_channel().await.unwrap();
    let texted: Vec<String> = drain(&ch, &env.topology().sms_pending)
        .await
        .iter()
        .map(|m| {
            serde_json::from_slice::<serde_json::Value>(&m.body).unwrap()["order_id"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    for (id, n) in ids.iter().zip(voided) {
        let s = statuses(&env, id).await;
        assert!(!s.contains(&1), "{id} keeps a live code: {s:?}");
        if n == 0 {
            assert!(
                !texted.contains(id),
                "{id}: void said 0 voided, yet it was texted"
            );
        }
    }
    daemon.stop().await;
    api.stop().await;
    env.cleanup().await;
}

/// An order's codes go back only to the key that placed it: another key
/// posting the same order gets 409 and no code, and cannot void, redeem or
/// resend it; an order that came over AMQP is nobody's to repeat over
/// HTTP. The owner's own repeat is answered, and audited.
#[tokio::test]
async fn a_repeat_answers_codes_only_to_the_key_that_placed_the_order_and_is_audited() {
    use crate::api::{http, json_of, key, order, ApiServer};
    let env = TestEnv::new("seam_owner").await;
    env.fill_pool("own", 10).await;
    let a = key(&env, "shop-a", "orders:write,orders:read").await;
    let b = key(&env, "shop-b", "orders:write,orders:read").await;
    let admin = key(&env, "ops", "orders:write,orders:read,admin").await;
    let api = ApiServer::start(&env, &[]).await;
    let (status, _, body) = http(
        &api.addr,
        "POST",
        "/v1/orders",
        Some(&a),
        &order("O-1", "own", 2),
    )
    .await;
    assert_eq!(status, 201, "{}", String::from_utf8_lossy(&body));
    let codes: Vec<String> = json_of(&body)["codes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["code"].as_str().unwrap().to_owned())
        .collect();
    let leaks = |body: &[u8]| {
        codes
            .iter()
            .any(|c| String::from_utf8_lossy(body).contains(c.as_str()))
    };

    let (status, _, body) = http(
        &api.addr,
        "POST",
        "/v1/orders",
        Some(&b),
        &order("O-1", "own", 2),
    )
    .await;
    assert_eq!(status, 409, "{}", String::from_utf8_lossy(&body));
    assert!(json_of(&body)["type"]
        .as_str()
        .unwrap()
        .ends_with("conflicting-order"));
    assert!(!leaks(&body), "another key's repeat shows no code");
    for action in ["void", "redeem", "resend"] {
        let (status, _, body) = http(
            &api.addr,
            "POST",
            &format!("/v1/orders/O-1/{action}"),
            Some(&b),
            br#"{"reason":"refund"}"#,
        )
        .await;
        assert_eq!(
            status,
            404,
            "{action} by another key: {}",
            String::from_utf8_lossy(&body)
        );
    }
    assert_eq!(statuses(&env, "O-1").await, vec![1, 1], "nothing changed");

    let (status, _, body) = http(
        &api.addr,
        "POST",
        "/v1/orders",
        Some(&a),
        &order("O-1", "own", 2),
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert!(leaks(&body), "the owner's repeat gets its codes");
    let audited = env
        .store
        .database()
        .collection::<bson::Document>("audit")
        .find_one(bson::doc! {"os_user": "api-key:shop-a", "command": {"$regex": "^POST /v1/orders, a repeat"}})
        .await
        .unwrap()
        .expect("the repeat is audited");
    assert_eq!(audited.get_i64("count").unwrap(), 2);

    // An order that came over AMQP is nobody's to repeat over HTTP.
    let daemon = start_daemon(env.command(&[])).await;
    let conn = codepool_broker::connect(AMQP_URL, "test").await.unwrap();
    let publisher = Publisher::new(&conn, env.topology()).await.unwrap();
    let mut amqp = purchase("AM-1", "own");
    amqp.uid = "u-api".into();
    publish_confirmed(&publisher, &[amqp]).await;
    eventually(Duration::from_secs(30), "AM-1 granted", || async {
        statuses(&env, "AM-1").await == vec![1]
    })
    .await;
    let (status, _, body) = http(
        &api.addr,
        "POST",
        "/v1/orders",
        Some(&a),
        &order("AM-1", "own", 1),
    )
    .await;
    assert_eq!(status, 409, "{}", String::from_utf8_lossy(&body));
    assert!(
        !String::from_utf8_lossy(&body).contains("own-0"),
        "no code in the answer"
    );
    // A key with the admin scope acts on any order.
    let (status, _, _) = http(
        &api.addr,
        "POST",
        "/v1/orders/O-1/void",
        Some(&admin),
        br#"{"reason":"refund"}"#,
    )
    .await;
    assert_eq!(status, 200);
    daemon.stop().await;
    api.stop().await;
    env.cleanup().await;
}

/// Publishes `{"order_id": order}` as a `code.redeemed` event, with
/// `user_id` set or not, confirmed.
async fn publish_redeemed(publisher: &Publisher, env: &TestEnv, order: &str, user: Option<&str>) {
    let mut props = lapin::BasicProperties::default();
    if let Some(u) = user {
        props = props.with_user_id(u.into());
    }
    let body = serde_json::json!({ "order_id": order }).to_string();
    publisher
        .publish(
            &env.topology().events_exchange,
            "code.redeemed",
            body.as_bytes(),
            props,
        )
        .await
        .expect("publish")
        .wait()
        .await
        .expect("confirm");
}

/// A purchase producer cannot mark an order used (and so block its
/// refund): `code.redeemed` is applied only from the broker users named by
/// `--redeemers`, checked through RabbitMQ's validated `user_id`, and each
/// redemption applied is audited with that user.
#[tokio::test]
async fn only_the_configured_broker_user_redeems_and_each_redemption_is_audited() {
    let env = TestEnv::new("seam_redeem").await;
    env.fill_pool("red", 5).await;
    let mut cmd = env.command(&[]);
    cmd.env("CODEPOOL_REDEEMERS", "platform");
    let daemon = start_daemon(cmd).await;
    let conn = codepool_broker::connect(AMQP_URL, "test").await.unwrap();
    let publisher = Publisher::new(&conn, env.topology()).await.unwrap();
    publish_confirmed(&publisher, &[purchase("RD-1", "red")]).await;
    eventually(Duration::from_secs(30), "RD-1 granted", || async {
        statuses(&env, "RD-1").await == vec![1]
    })
    .await;
    // The shop's producer (guest): without user_id, and as itself.
    publish_redeemed(&publisher, &env, "RD-1", None).await;
    publish_redeemed(&publisher, &env, "RD-1", Some("guest")).await;
    eventually(Duration::from_secs(30), "both events refused", || async {
        (daemon.log_text())
            .matches("code.redeemed event refused")
            .count()
            == 2
    })
    .await;
    assert_eq!(statuses(&env, "RD-1").await, vec![1], "still issued");
    daemon.stop().await;

    // The platform's user may.
    let daemon = start_daemon(env.command(&[])).await;
    publish_redeemed(&publisher, &env, "RD-1", Some("guest")).await;
    eventually(Duration::from_secs(30), "RD-1 used", || async {
        statuses(&env, "RD-1").await == vec![2]
    })
    .await;
    // The record follows the redemption's own write.
    let audit = env.store.database().collection::<bson::Document>("audit");
    let by_guest = bson::doc! {"os_user": "amqp-user:guest", "kind": "redeem"};
    eventually(
        Duration::from_secs(10),
        "the redemption is audited with the broker user",
        || {
            let (audit, by_guest) = (audit.clone(), by_guest.clone());
            async move { audit.find_one(by_guest).await.unwrap().is_some() }
        },
    )
    .await;
    let record = audit.find_one(by_guest).await.unwrap().unwrap();
    assert!(record.get_str("what").unwrap().contains("RD-1"));
    daemon.stop().await;
    env.cleanup().await;
}

/// A dispatcher whose key file lacks the key another host now seals codes
/// with claims nothing: it goes unready, hands the purchase back and stops
/// consuming, with one error naming the key; once its key file holds the
/// key it serves the purchase.
#[tokio::test]
async fn a_process_without_the_newest_key_claims_nothing_and_resumes_with_it() {
    use crate::common::http_get;
    let env = TestEnv::new("seam_keys").await;
    env.fill_pool("k", 3).await;
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
    let conn = codepool_broker::connect(AMQP_URL, "test").await.unwrap();
    let publisher = Publisher::new(&conn, env.topology()).await.unwrap();
    publish_confirmed(&publisher, &[purchase("K-1", "k")]).await;
    // Judged once the dispatcher has stopped consuming and the purchase is
    // back in the queue (handed back, or never taken): nothing of this
    // process can claim it any more.
    let purchases = env.topology().purchases;
    eventually(
        Duration::from_secs(30),
        "the purchase waits in the queue, for any dispatcher, and none consumes",
        || async {
            let ch = conn.create_channel().await.unwrap();
            let q = ch
                .queue_declare(
                    &purchases,
                    lapin::options::QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    Default::default(),
                )
                .await
                .unwrap();
            let _ = ch.close(200, "looked").await;
            q.message_count() == 1 && q.consumer_count() == 0
        },
    )
    .await;
    assert_eq!(
        statuses(&env, "K-1").await,
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
        statuses(&env, "K-1").await == vec![1]
    })
    .await;
    assert!(http_get(&daemon.addr, "/readyz")
        .await
        .is_some_and(|(s, _)| s == 200));
    daemon.stop().await;
    env.cleanup().await;
}

/// The audit records of `who`, as (kind, command), oldest first.
pub(crate) async fn audited(env: &TestEnv, who: &str) -> Vec<(String, String)> {
    use futures::TryStreamExt;
    env.store
        .database()
        .collection::<bson::Document>("audit")
        .find(bson::doc! {"os_user": who})
        .sort(bson::doc! {"at": 1})
        .await
        .unwrap()
        .try_collect::<Vec<_>>()
        .await
        .unwrap()
        .iter()
        .map(|d| {
            (
                d.get_str("kind").unwrap().to_owned(),
                d.get_str("command").unwrap_or("").to_owned(),
            )
        })
        .collect()
}

/// Every change is audited by the core, whichever door made it: an
/// import, a pause and a resume, a void and a recall, through the CLI
/// (with the OS user) and through the API (with the key's name). The
/// console's are checked by its own tests.
#[tokio::test]
async fn changes_through_the_cli_and_the_api_are_audited_with_who_made_them() {
    use crate::api::{http, http_as, json_of, key, order, ApiServer};
    let env = TestEnv::new("seam_audit").await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("codes.csv");
    let csv: String = "code\n".to_owned()
        + &(0..20)
            .map(|i| format!("AU-{i:04}-XYZ\n"))
            .collect::<String>();
    std::fs::write(&file, &csv).unwrap();
    let run = |args: Vec<String>| {
        let mut c = env.command(&args.iter().map(String::as_str).collect::<Vec<_>>());
        c.env("USER", "alice");
        async move {
            let out = c.output().await.unwrap();
            assert!(
                out.status.success(),
                "{args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8_lossy(&out.stdout).into_owned()
        }
    };
    let f = file.to_str().unwrap().to_owned();
    let out = run(vec![
        "import".into(),
        f,
        "--pool".into(),
        "au".into(),
        "--json".into(),
    ])
    .await;
    let import_id = serde_json::from_str::<serde_json::Value>(&out).unwrap()["import_id"]
        .as_str()
        .unwrap()
        .to_owned();
    run(vec![
        "pool".into(),
        "pause".into(),
        "--pool".into(),
        "au".into(),
    ])
    .await;
    run(vec![
        "pool".into(),
        "resume".into(),
        "--pool".into(),
        "au".into(),
    ])
    .await;
    let shop = key(&env, "shop", "orders:write,orders:read").await;
    let admin = key(&env, "ops", "admin,orders:write").await;
    let api = ApiServer::start(&env, &[]).await;
    let (status, _, _) = http(
        &api.addr,
        "POST",
        "/v1/orders",
        Some(&shop),
        &order("AU-1", "au", 1),
    )
    .await;
    assert_eq!(status, 201);
    run(vec![
        "void".into(),
        "--order".into(),
        "AU-1".into(),
        "--reason".into(),
        "refund".into(),
    ])
    .await;
    run(vec![
        "void".into(),
        "--import".into(),
        import_id.clone(),
        "--reason".into(),
        "leak".into(),
    ])
    .await;

    let (status, _, _) = http(
        &api.addr,
        "POST",
        "/v1/orders",
        Some(&shop),
        &order("AU-2", "au", 1),
    )
    .await;
    assert_eq!(status, 202, "the pool is recalled: AU-2 waits");
    let (status, _, _) = http(
        &api.addr,
        "POST",
        "/v1/orders/AU-2/void",
        Some(&shop),
        br#"{"reason":"refund"}"#,
    )
    .await;
    assert_eq!(status, 200);
    let csv2: String = "code\n".to_owned()
        + &(0..5)
            .map(|i| format!("AV-{i:04}-XYZ\n"))
            .collect::<String>();
    let (status, _, body) = http_as(
        &api.addr,
        "POST",
        "/v1/pools/au/imports?file=more.csv",
        Some(&admin),
        "text/csv",
        csv2.as_bytes(),
    )
    .await;
    assert_eq!(status, 201);
    let second = json_of(&body)["import_id"].as_str().unwrap().to_owned();
    for p in ["pause", "resume"] {
        let (status, _, _) = http(
            &api.addr,
            "POST",
            &format!("/v1/pools/au/{p}"),
            Some(&admin),
            b"",
        )
        .await;
        assert_eq!(status, 200);
    }
    let (status, _, _) = http(
        &api.addr,
        "POST",
        &format!("/v1/imports/{second}/recall"),
        Some(&admin),
        br#"{"reason":"leak"}"#,
    )
    .await;
    assert_eq!(status, 200);
    api.stop().await;

    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    let cli = audited(&env, &format!("os-user:alice@{}", host.trim())).await;
    let kinds: Vec<&str> = cli.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        kinds,
        ["import", "pause", "resume", "void", "recall"],
        "{cli:?}"
    );
    assert!(
        cli.iter().all(|(_, c)| c.starts_with("codepool ")),
        "{cli:?}"
    );
    let kinds = |v: Vec<(String, String)>| v.into_iter().map(|(k, _)| k).collect::<Vec<_>>();
    assert_eq!(kinds(audited(&env, "api-key:shop").await), ["void"]);
    assert_eq!(
        kinds(audited(&env, "api-key:ops").await),
        ["import", "pause", "resume", "recall"]
    );
    env.cleanup().await;
}

/// `NF-café` sent composed and then decomposed is one order: the second
/// post is a repeat with the same code, not a second grant.
#[tokio::test]
async fn an_order_id_sent_composed_and_decomposed_is_one_order() {
    use crate::api::{http, json_of, key, ApiServer};
    let env = TestEnv::new("seam_nfc").await;
    env.fill_pool("nf", 5).await;
    let shop = key(&env, "shop", "orders:write").await;
    let api = ApiServer::start(&env, &[]).await;
    let body = |id: &str| {
        serde_json::json!({"order_id": id, "uid": "b\u{e9}a", "phone": "+8613800000000", "pool": "nf"})
            .to_string()
            .into_bytes()
    };
    let (s1, _, b1) = http(
        &api.addr,
        "POST",
        "/v1/orders",
        Some(&shop),
        &body("NF-caf\u{e9}"),
    )
    .await;
    let (s2, _, b2) = http(
        &api.addr,
        "POST",
        "/v1/orders",
        Some(&shop),
        &body("NF-cafe\u{301}"),
    )
    .await;
    assert_eq!((s1, s2), (201, 200), "{}", String::from_utf8_lossy(&b2));
    assert_eq!(json_of(&b1)["codes"], json_of(&b2)["codes"]);
    assert_eq!(statuses(&env, "NF-caf\u{e9}").await, vec![1]);
    api.stop().await;
    env.cleanup().await;
}

/// Read-only commands never migrate: a pending migration stays pending
/// (and is named), and a schema a newer codepool wrote is refused by
/// `migrate` and by every command, naming the migration it does not know.
#[tokio::test]
async fn commands_that_read_never_migrate_and_a_newer_schema_is_refused() {
    let env = TestEnv::new("seam_schema").await;
    env.fill_pool("sc", 1).await;
    let log = env
        .store
        .database()
        .collection::<bson::Document>("_migrations");
    log.delete_one(bson::doc! {"_id": "0014_codes_any_pool_index"})
        .await
        .unwrap();
    let out = env.command(&["stats"]).output().await.unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
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
        let out = env.command(args).output().await.unwrap();
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("9999_from_the_future") && err.contains("newer codepool"),
            "{args:?}: {err}"
        );
    }
    env.cleanup().await;
}

/// The JSON log line that grants an order carries the fields of the span
/// it ran in: over HTTP the order's own span (order id, pool, door), over
/// AMQP its batch's (door): an operator greps one order id and sees its
/// path, whichever door it came by.
#[tokio::test]
async fn an_orders_json_log_lines_carry_their_span_fields_from_either_door() {
    use crate::api::{http, key, order, ApiServer};
    let env = TestEnv::new("seam_spans").await;
    env.fill_pool("sp", 5).await;
    let shop = key(&env, "shop", "orders:write").await;
    let api = ApiServer::start(&env, &["--log-format", "json"]).await;
    let (status, _, _) = http(
        &api.addr,
        "POST",
        "/v1/orders",
        Some(&shop),
        &order("SP-1", "sp", 1),
    )
    .await;
    assert_eq!(status, 201);
    let line = |log: &str, message: &str, order: &str| -> Option<serde_json::Value> {
        log.lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find(|v| v["message"] == message && v.to_string().contains(order))
    };
    eventually(Duration::from_secs(10), "the order's log line", || async {
        line(&api.log_text(), "order placed", "SP-1").is_some()
    })
    .await;
    let placed = line(&api.log_text(), "order placed", "SP-1").unwrap();
    assert_eq!(placed["span"]["name"], "order", "{placed}");
    assert_eq!(
        (
            &placed["span"]["order_id"],
            &placed["span"]["pool"],
            &placed["span"]["door"]
        ),
        (
            &serde_json::json!("SP-1"),
            &serde_json::json!("sp"),
            &serde_json::json!("http")
        ),
        "{placed}"
    );
    // The batch that placed it logs the grant with the door it came by.
    eventually(
        Duration::from_secs(10),
        "SP-1 granted in the log",
        || async { line(&api.log_text(), "granted", "SP-1").is_some() },
    )
    .await;
    let granted = line(&api.log_text(), "granted", "SP-1").unwrap();
    assert_eq!(
        (&granted["order_id"], &granted["span"]["door"]),
        (&serde_json::json!("SP-1"), &serde_json::json!("http")),
        "{granted}"
    );
    api.stop().await;

    let daemon = start_daemon(env.command(&["--log-format", "json"])).await;
    let conn = codepool_broker::connect(AMQP_URL, "test").await.unwrap();
    let publisher = Publisher::new(&conn, env.topology()).await.unwrap();
    publish_confirmed(&publisher, &[purchase("SP-2", "sp")]).await;
    eventually(
        Duration::from_secs(20),
        "SP-2 granted in the log",
        || async { line(&daemon.log_text(), "granted", "SP-2").is_some() },
    )
    .await;
    let granted = line(&daemon.log_text(), "granted", "SP-2").unwrap();
    assert_eq!(
        (&granted["order_id"], &granted["span"]["door"]),
        (&serde_json::json!("SP-2"), &serde_json::json!("amqp")),
        "{granted}"
    );
    daemon.stop().await;
    env.cleanup().await;
}

/// An upload sent gzip-compressed with `Content-Encoding: gzip` is read
/// through a decoder; another encoding is refused with 415.
#[tokio::test]
async fn a_gzip_upload_with_its_content_encoding_is_imported() {
    use crate::api::{json_of, key, ApiServer};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let env = TestEnv::new("seam_gzip").await;
    let admin = key(&env, "ops", "admin").await;
    let api = ApiServer::start(&env, &[]).await;
    let csv: String = "code\n".to_owned()
        + &(0..300)
            .map(|i| format!("GZ-{i:05}-AB\n"))
            .collect::<String>();
    let mut gz = std::process::Command::new("gzip")
        .arg("-c")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("gzip");
    {
        use std::io::Write;
        gz.stdin.take().unwrap().write_all(csv.as_bytes()).unwrap();
    }
    let body = gz.wait_with_output().unwrap().stdout;
    let send = |encoding: &'static str| {
        let (addr, admin, body) = (api.addr.clone(), admin.clone(), body.clone());
        async move {
            let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
            let head = format!(
                "POST /v1/pools/gz/imports?file=codes.csv.gz HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer {admin}\r\nContent-Type: text/csv\r\nContent-Encoding: {encoding}\r\nContent-Length: {}\r\n\r\n",
                body.len()
            );
            s.write_all(head.as_bytes()).await.unwrap();
            s.write_all(&body).await.unwrap();
            let mut raw = Vec::new();
            s.read_to_end(&mut raw).await.unwrap();
            let Some(split) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
                return (0, raw);
            };
            let status: u16 = String::from_utf8_lossy(&raw[9..12]).parse().unwrap();
            (status, raw[split + 4..].to_vec())
        }
    };
    let (status, body) = send("br").await;
    assert_eq!(
        status,
        415,
        "{} {}",
        String::from_utf8_lossy(&body),
        api.log_text()
    );
    let (status, body) = send("gzip").await;
    assert_eq!(
        status,
        201,
        "{} {}",
        String::from_utf8_lossy(&body),
        api.log_text()
    );
    assert_eq!(json_of(&body)["inserted"], 300);
    api.stop().await;
    env.cleanup().await;
}

/// A key that seals no code any more (rotated away, then dropped from the
/// key file) does not hold a process unready: it leaves the registry.
#[tokio::test]
async fn a_retired_key_missing_from_the_key_file_blocks_nothing() {
    let env = TestEnv::new("seam_retired").await;
    env.fill_pool("rt", 2).await;
    let registry = env.store.database().collection::<bson::Document>("key_ids");
    registry
        .insert_one(bson::doc! {"_id": "k-retired"})
        .await
        .unwrap();
    let daemon = start_daemon(env.command(&[])).await;
    let conn = codepool_broker::connect(AMQP_URL, "test").await.unwrap();
    let publisher = Publisher::new(&conn, env.topology()).await.unwrap();
    publish_confirmed(&publisher, &[purchase("RT-1", "rt")]).await;
    eventually(Duration::from_secs(20), "RT-1 granted", || async {
        statuses(&env, "RT-1").await == vec![1]
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
