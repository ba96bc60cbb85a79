//! The HTTP door under load, beside the AMQP door, with two API processes
//! and a dispatcher on one pool: every order gets exactly its codes, once,
//! whichever door and process it came by and however often it was sent;
//! an API process killed mid-load loses nothing.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use codepool_domain::SmsPending;
use futures::StreamExt;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::api::{key, order, ApiServer};
use crate::common::*;
use crate::fixtures::api_with_key;

/// One HTTP exchange that reports a dead server instead of panicking.
async fn try_post(addr: &str, path: &str, key: &str, body: &[u8]) -> Result<(u16, Value), String> {
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nAuthorization: Bearer {key}\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    s.write_all(body).await.map_err(|e| e.to_string())?;
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut raw))
        .await
        .map_err(|_| "no answer within 30 s".to_owned())?
        .map_err(|e| e.to_string())?;
    let split = (raw.windows(4).position(|w| w == b"\r\n\r\n")).ok_or("no head")?;
    let status = String::from_utf8_lossy(&raw[..split])
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or("no status")?;
    let body = serde_json::from_slice(&raw[split + 4..]).map_err(|e| e.to_string())?;
    Ok((status, body))
}

/// The codes an order's answer carries, by line.
fn codes_of(answer: &Value) -> Vec<String> {
    (answer["codes"].as_array().into_iter().flatten())
        .map(|c| c["code"].as_str().unwrap_or_default().to_owned())
        .collect()
}

/// Every code the database holds for orders whose id starts with one of
/// `prefixes`: order id → codes (plaintext), and each order's quantity.
async fn holdings(env: &TestEnv) -> HashMap<String, Vec<String>> {
    let mut out: HashMap<String, Vec<String>> = HashMap::new();
    let mut cursor = env
        .coll("codes")
        .find(bson::doc! {"order_id": {"$exists": true}})
        .await
        .unwrap();
    while let Some(d) = cursor.next().await {
        let d = d.unwrap();
        let order = d.get_str("order_id").unwrap().to_owned();
        out.entry(order).or_default().push(env.plain_code(&d));
    }
    out
}

/// Asserts every order holds exactly its quantity and no code is held
/// twice.
fn exactly_once(held: &HashMap<String, Vec<String>>, wanted: &HashMap<String, u32>) {
    let mut seen = HashSet::new();
    for (order, quantity) in wanted {
        let codes = held.get(order).map(Vec::as_slice).unwrap_or_default();
        assert_eq!(codes.len(), *quantity as usize, "order {order}: {codes:?}");
        for c in codes {
            assert!(seen.insert(c.clone()), "code {c} held twice");
        }
    }
    assert_eq!(
        held.len(),
        wanted.len(),
        "no order codepool was not asked for"
    );
}

/// The SMS-pending events on the queue: event id → its codes.
async fn events(env: &TestEnv) -> Vec<SmsPending> {
    let conn = codepool_broker::connect(AMQP_URL, "test").await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    let out = drain(&ch, &env.topology().sms_pending)
        .await
        .iter()
        .map(|t| serde_json::from_slice(&t.body).unwrap())
        .collect();
    let _ = conn.close(200, "bye").await;
    out
}

fn quantity_of(i: usize) -> u32 {
    if i % 10 == 3 {
        2
    } else {
        1
    }
}

#[tokio::test]
async fn http_and_amqp_orders_over_two_api_processes_and_a_dispatcher_each_get_exactly_their_codes()
{
    let env = TestEnv::with_pools("api_two_doors", &[("mix", 4_600)]).await;
    let shop = key(&env, "shop", "orders:write").await;
    let (a, b) = (
        ApiServer::start(&env, &["--rate-per-key", "100000"]).await,
        ApiServer::start(&env, &["--rate-per-key", "100000"]).await,
    );
    let d = start_daemon(env.command(&[])).await;
    let mut wanted: HashMap<String, u32> = HashMap::new();
    for i in 0..2_000 {
        wanted.insert(format!("H-{i}"), quantity_of(i));
        wanted.insert(format!("Q-{i}"), quantity_of(i));
    }

    // 2,000 over AMQP while 2,000 go over HTTP, 10% of them sent to both
    // API processes at the same moment.
    let (conn, publisher) = env.amqp().await;
    let amqp = async {
        for i in 0..2_000 {
            let mut p = purchase(&format!("Q-{i}"), "mix");
            p.quantity = quantity_of(i);
            publish_one(&publisher, &p).await;
        }
    };
    let http = futures::stream::iter(0..2_000)
        .map(|i| {
            let (a, b, shop) = (&a.addr, &b.addr, &shop);
            async move {
                let body = order(&format!("H-{i}"), "mix", quantity_of(i));
                let first = try_post(a, "/v1/orders", shop, &body);
                if i % 10 == 0 {
                    let (x, y) = tokio::join!(first, try_post(b, "/v1/orders", shop, &body));
                    let (x, y) = (x.unwrap(), y.unwrap());
                    assert_eq!(
                        codes_of(&x.1),
                        codes_of(&y.1),
                        "H-{i}: one order, one set of codes"
                    );
                    let mut statuses = [x.0, y.0];
                    statuses.sort();
                    assert_eq!(statuses, [200, 201], "H-{i}: one grant, one repeat");
                    x.1
                } else {
                    let (status, answer) = first.await.unwrap();
                    assert_eq!(status, 201, "H-{i}: {answer}");
                    answer
                }
            }
        })
        .buffer_unordered(32)
        .collect::<Vec<Value>>();
    let (answers, ()) = tokio::join!(http, amqp);
    assert!(answers.iter().all(|a| a["state"] == "granted"));

    eventually(Duration::from_secs(60), "the AMQP orders granted", || {
        let env = &env;
        async move {
            let held = holdings(env).await;
            (0..2_000)
                .all(|i| held.get(&format!("Q-{i}")).map(Vec::len) == Some(quantity_of(i) as usize))
        }
    })
    .await;
    d.stop().await;
    a.stop().await;
    b.stop().await;

    let held = holdings(&env).await;
    exactly_once(&held, &wanted);
    // Each order's answer is what the database holds for it.
    for answer in &answers {
        let id = answer["order_id"].as_str().unwrap();
        let mut mine = codes_of(answer);
        let mut stored = held[id].clone();
        mine.sort();
        stored.sort();
        assert_eq!(mine, stored, "{id}");
    }
    // One sms.pending event per grant, carrying its codes, whichever door.
    let sent = events(&env).await;
    let mut by_order: HashMap<String, Vec<String>> = HashMap::new();
    for e in &sent {
        let codes = e.all_codes().into_iter().map(|c| c.code);
        by_order
            .entry(e.order_id.clone())
            .or_default()
            .extend(codes);
    }
    for (order, mut codes) in by_order.clone() {
        let mut stored = held[&order].clone();
        codes.sort();
        stored.sort();
        assert_eq!(
            codes, stored,
            "{order}: one event with its codes, no second SMS"
        );
    }
    assert_eq!(by_order.len(), wanted.len(), "every order texted");
    // Nothing left unacked or dead.
    let ch = conn.create_channel().await.unwrap();
    assert_eq!(queue_depth(&ch, &env.topology().purchases).await, 0);
    assert_eq!(queue_depth(&ch, &env.topology().purchases_dead).await, 0);
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}

#[tokio::test]
async fn an_api_process_killed_mid_load_loses_nothing_and_a_retry_on_another_gets_the_same_codes() {
    // An API-only deployment: no dispatcher runs. The other API process's
    // relay sends the events the killed process owed.
    let env = TestEnv::with_pools("api_kill", &[("kp", 500)]).await;
    let shop = key(&env, "shop", "orders:write").await;
    let a = ApiServer::start(&env, &["--rate-per-key", "100000"]).await;
    let b = ApiServer::start(&env, &["--rate-per-key", "100000"]).await;
    let pid = a.child.id().unwrap().to_string();
    // Killed once it has answered KILL_AFTER orders, whatever the time that
    // takes: at most the 15 others in flight are answered after that, and
    // the rest find it gone.
    const KILL_AFTER: usize = 50;
    let answers = AtomicUsize::new(0);
    let first = futures::stream::iter(0..400)
        .map(|i| {
            let (addr, shop, answers, pid) = (&a.addr, &shop, &answers, pid.as_str());
            async move {
                let body = order(&format!("K-{i}"), "kp", 1);
                let answer = try_post(addr, "/v1/orders", shop, &body).await;
                if answer.is_ok() && answers.fetch_add(1, Ordering::SeqCst) + 1 == KILL_AFTER {
                    let killed = std::process::Command::new("kill")
                        .args(["-KILL", pid])
                        .status()
                        .unwrap();
                    assert!(killed.success(), "kill -KILL {pid}");
                }
                (i, answer)
            }
        })
        .buffer_unordered(16)
        .collect::<Vec<_>>()
        .await;
    let answered = first.iter().filter(|(_, r)| r.is_ok()).count();
    assert!(
        (KILL_AFTER..KILL_AFTER + 16).contains(&answered),
        "killed after {KILL_AFTER} answers: {answered} of 400 answered"
    );

    // The shop retries every order on the other process.
    for (i, was) in &first {
        let body = order(&format!("K-{i}"), "kp", 1);
        let (status, again) = try_post(&b.addr, "/v1/orders", &shop, &body).await.unwrap();
        assert!(status == 200 || status == 201, "K-{i}: {status} {again}");
        if let Ok((_, before)) = was {
            assert_eq!(
                codes_of(&again),
                codes_of(before),
                "K-{i}: the same code after the crash"
            );
        }
    }
    let held = holdings(&env).await;
    let wanted = (0..400).map(|i| (format!("K-{i}"), 1)).collect();
    exactly_once(&held, &wanted);
    // Every grant reaches its event: sent by a process, or by the relay
    // for those the killed process never confirmed.
    all_texted(&env, &held, Duration::from_secs(120)).await;
    b.stop().await;
    env.cleanup().await;
}

/// Waits until every code of `held` has been in an `sms.pending` event;
/// panics after `within` with how many never were.
async fn all_texted(env: &TestEnv, held: &HashMap<String, Vec<String>>, within: Duration) {
    let mut texted: HashSet<String> = HashSet::new();
    let deadline = tokio::time::Instant::now() + within;
    loop {
        for e in events(env).await {
            texted.extend(e.all_codes().into_iter().map(|c| c.code));
        }
        let owed: Vec<&String> = held
            .values()
            .flatten()
            .filter(|c| !texted.contains(*c))
            .collect();
        if owed.is_empty() {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} grants never texted within {within:?}, e.g. {:?}",
            owed.len(),
            owed.first()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[tokio::test]
async fn an_api_only_deployment_whose_broker_connection_keeps_closing_texts_every_grant() {
    // No dispatcher runs. The API answers each order once its claim is
    // journaled; its events are owed by its batch's record, and the API's own
    // relay sends whatever a closed connection swallowed.
    let env = TestEnv::with_pools("api_flap", &[("fp", 400)]).await;
    let shop = key(&env, "shop", "orders:write").await;
    let api = ApiServer::start(&env, &["--rate-per-key", "100000"]).await;
    let name = format!("codepool-api-{}", api.child.id().unwrap());
    let closed = std::sync::atomic::AtomicUsize::new(0);
    let closer = async {
        for _ in 0..6 {
            tokio::time::sleep(Duration::from_millis(250)).await;
            for pid in crate::api::connections_named(&name).await {
                let out = tokio::process::Command::new("rabbitmqctl")
                    .args(["close_connection", &pid, "test: connection closed again"])
                    .current_dir("/")
                    .output()
                    .await
                    .unwrap();
                if out.status.success() {
                    closed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }
        }
    };
    let load = futures::stream::iter(0..300)
        .map(|i| {
            let (addr, shop) = (&api.addr, &shop);
            async move {
                let body = order(&format!("F-{i}"), "fp", 1);
                (i, try_post(addr, "/v1/orders", shop, &body).await)
            }
        })
        .buffer_unordered(8)
        .collect::<Vec<_>>();
    let (first, ()) = tokio::join!(load, closer);
    assert!(
        closed.load(std::sync::atomic::Ordering::Relaxed) >= 2,
        "the API's connection was closed while it took orders"
    );
    // An order answered 503 (none expected) is simply sent again.
    for (i, was) in &first {
        if !matches!(was, Ok((201, _))) {
            let body = order(&format!("F-{i}"), "fp", 1);
            let (status, again) = try_post(&api.addr, "/v1/orders", &shop, &body)
                .await
                .unwrap();
            assert!(status == 200 || status == 201, "F-{i}: {status} {again}");
        }
    }
    let held = holdings(&env).await;
    let wanted = (0..300).map(|i| (format!("F-{i}"), 1)).collect();
    exactly_once(&held, &wanted);
    // A batch whose confirm a closed connection swallowed is sent by the
    // relay once its record is 30 s old, and a record whose events were
    // not all confirmed then is looked at again a minute later: on a busy
    // host that is the schedule to wait for, not 60 s.
    all_texted(&env, &held, Duration::from_secs(150)).await;
    api.stop().await;
    env.cleanup().await;
}

#[tokio::test]
async fn an_http_batch_owes_its_events_by_one_record_that_the_relay_honours_when_no_confirm_came() {
    let env = TestEnv::with_pools("api_owed", &[("ow", 10)]).await;
    let (api, shop) = api_with_key(&env, "shop", "orders:write").await;
    let before = bson::DateTime::now();
    for i in 0..3 {
        let body = order(&format!("W-{i}"), "ow", 2);
        let (status, answer) = try_post(&api.addr, "/v1/orders", &shop, &body)
            .await
            .unwrap();
        assert!(status == 200 || status == 201, "W-{i}: {status} {answer}");
    }
    let db = env.store.database();
    let owed = db.collection::<bson::Document>(codepool_store::codes::SMS_OWED);
    let codes = db.collection::<bson::Document>("codes");
    // Each batch's record goes once its events are confirmed, and no code
    // was written a second time to say so.
    eventually(
        Duration::from_secs(20),
        "the batches' records settled",
        || async { owed.count_documents(bson::doc! {}).await.unwrap() == 0 },
    )
    .await;
    let marked = bson::doc! {"$or": [{"sms_pending": {"$exists": true}}, {"sms_published_at": {"$exists": true}}]};
    assert_eq!(codes.count_documents(marked).await.unwrap(), 0);
    let first = events(&env).await;
    let mut texted: Vec<&str> = first.iter().map(|e| e.order_id.as_str()).collect();
    texted.sort();
    assert_eq!(texted, ["W-0", "W-1", "W-2"]);
    api.stop().await;

    // A record whose confirms never came (its process died after the
    // claim): the relay sends the events of the grants its orders were
    // issued since, with their first event ids. An order that was never
    // claimed holds nothing, and a voided code is not texted. A record
    // written after W-2's grant (W-2 a repeat there) owes nothing: its own
    // batch texted it. Each record stays, out of the relay's list, until
    // it is ten minutes old (a batch still being placed may land more).
    codes
        .update_one(
            bson::doc! {"order_id": "W-1"},
            bson::doc! {"$set": {"status": 3, "void_reason": "refund"}},
        )
        .await
        .unwrap();
    let write = |at: bson::DateTime, orders: &[&str]| {
        let record = bson::doc! {"_id": bson::oid::ObjectId::new(), "orders": orders, "at": at};
        let owed = owed.clone();
        async move { owed.insert_one(record).await.unwrap() }
    };
    write(before, &["W-0", "W-1", "never-claimed"]).await;
    // Past the second's margin the relay allows for the clock.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    env.store.owe_events(&["W-2"]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    let (conn, publisher) = env.amqp().await;
    let outbox = codepool_issuance::Outbox::new(std::sync::Arc::new(env.store.clone()));
    let relay = || {
        let relay = codepool_issuance::relay::relay_unconfirmed;
        relay(&env.store, &outbox, &publisher, Duration::ZERO, 100)
    };
    assert_eq!(
        relay().await.unwrap(),
        3,
        "W-0's two codes and W-1's live one"
    );
    let again = events(&env).await;
    let ids = |es: &[SmsPending], o: &str| -> Vec<String> {
        let of = es.iter().filter(|e| e.order_id == o);
        of.map(|e| e.event_id.clone()).collect()
    };
    assert_eq!(again.len(), 2, "one event per order: {again:?}");
    assert_eq!(ids(&again, "W-0"), ids(&first, "W-0"), "the same event id");
    let live = again.iter().find(|e| e.order_id == "W-1").unwrap();
    assert_eq!(live.all_codes().len(), 1, "only W-1's live code: {live:?}");
    let relayed = bson::doc! {"relayed": true};
    assert_eq!(owed.count_documents(relayed).await.unwrap(), 2);
    // Back for its last pass at ten minutes old; the record that owed
    // nothing yet, in a minute (its batch may still land grants).
    let next_at = |order: &'static str| {
        let owed = owed.clone();
        async move {
            let r = owed
                .find_one(bson::doc! {"orders": order})
                .await
                .unwrap()
                .unwrap();
            r.get_datetime("next_at").unwrap().timestamp_millis()
        }
    };
    assert_eq!(next_at("W-0").await, before.timestamp_millis() + 600_000);
    let soon = next_at("W-2").await - bson::DateTime::now().timestamp_millis();
    assert!(
        (0..=61_000).contains(&soon),
        "W-2's record back in {soon} ms"
    );
    assert_eq!(
        relay().await.unwrap(),
        0,
        "sent once until they come of age"
    );

    // A record ten minutes old: its events go once more, and it goes.
    let old = bson::DateTime::from_millis(before.timestamp_millis() - 601_000);
    write(old, &["W-0"]).await;
    assert_eq!(relay().await.unwrap(), 2);
    assert_eq!(ids(&events(&env).await, "W-0"), ids(&first, "W-0"));
    assert_eq!(owed.count_documents(bson::doc! {}).await.unwrap(), 2);
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
}
