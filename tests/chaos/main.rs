//! The chaos test: three real dispatcher processes, tens of thousands of
//! purchases (a smaller run inside `make test`, the full one in
//! `make chaos`), and every fault a deployment meets while they run:
//! `kill -9` of random dispatchers, a Redis FLUSHALL and a Redis outage,
//! every RabbitMQ connection closed, a MongoDB restart, and a pool smaller
//! than the demand until a second import. At the end everything is checked
//! directly in MongoDB and in the queues. In `make test` purchases are
//! spread over 2 partitions, so each kill moves a partition's single
//! active consumer to another dispatcher; `make chaos` runs the one queue.
//!
//! It restarts the shared servers, so it is a test binary of its own that
//! the Makefile runs after the rest of the suite.

#[path = "../suite/common.rs"]
mod common;

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use bson::doc;
use codepool_domain::{Purchase, SmsPending};
use futures::TryStreamExt;
use rand::Rng;

use crate::common::{
    drain, eventually, publish_with_retries, purchase, purchases_depth, TestEnv, AMQP_URL,
};

struct Scale {
    orders: usize,
    first_import: usize,
    second_import: usize,
    invalid: usize,
    publish_secs: u64,
    kill_every: Duration,
    /// Purchase partitions ([`partitions`]).
    partitions: u16,
}

/// The run's purchase partitions: 2 in `make test`, so dispatchers are
/// killed while each partition has one active consumer; 1 (the one queue)
/// in `make chaos`. `CODEPOOL_TEST_PARTITIONS=N` sets it for either.
fn partitions(quick: u16) -> u16 {
    std::env::var("CODEPOOL_TEST_PARTITIONS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(quick)
}

fn scale() -> Scale {
    if std::env::var("CODEPOOL_CHAOS").as_deref() == Ok("full") {
        Scale {
            orders: 30_000,
            first_import: 12_000,
            second_import: 60_000,
            invalid: 40,
            publish_secs: 60,
            kill_every: Duration::from_secs(3),
            partitions: partitions(1),
        }
    } else {
        Scale {
            orders: 3_000,
            first_import: 1_200,
            second_import: 6_000,
            invalid: 10,
            publish_secs: 20,
            kill_every: Duration::from_secs(4),
            partitions: partitions(2),
        }
    }
}

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Runs `scripts/services.sh ARGS` (stop/start one shared server).
async fn services(args: &[&str]) {
    let status = tokio::process::Command::new("bash")
        .arg(repo_root().join("scripts/services.sh"))
        .args(args)
        .stdout(std::process::Stdio::null())
        .status()
        .await
        .expect("run scripts/services.sh");
    assert!(status.success(), "scripts/services.sh {args:?} failed");
}

struct Dispatchers<'a> {
    env: &'a TestEnv,
    logs: PathBuf,
    running: Vec<tokio::process::Child>,
    started: usize,
    kills: usize,
}

impl<'a> Dispatchers<'a> {
    fn spawn(&mut self) {
        self.started += 1;
        let log = std::fs::File::create(self.logs.join(format!("dispatcher-{}.log", self.started)))
            .expect("log file");
        let child = self
            .env
            .command(&["dispatch", "--no-http"])
            .stderr(log)
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("spawn dispatcher");
        self.running.push(child);
    }

    async fn kill_one(&mut self) {
        let i = rand::rng().random_range(0..self.running.len());
        let mut victim = self.running.swap_remove(i);
        let _ = victim.start_kill(); // SIGKILL
        let _ = victim.wait().await;
        self.kills += 1;
        self.spawn();
    }

    async fn stop_all(&mut self) -> Vec<std::process::ExitStatus> {
        for c in &self.running {
            if let Some(pid) = c.id() {
                let _ = std::process::Command::new("kill")
                    .args(["-TERM", &pid.to_string()])
                    .status();
            }
        }
        let mut statuses = Vec::new();
        for mut c in self.running.drain(..) {
            let s = tokio::time::timeout(Duration::from_secs(15), c.wait())
                .await
                .expect("a dispatcher did not stop within 15s of SIGTERM")
                .expect("wait");
            statuses.push(s);
        }
        statuses
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_keeps_every_invariant() {
    let s = scale();
    let env = TestEnv::new("chaos").await.with_partitions(s.partitions);
    let logs = std::env::temp_dir().join(format!("codepool-chaos-{}", env.db));
    std::fs::create_dir_all(&logs).unwrap();
    env.fill_pool("chaos", s.first_import).await;
    // Declare the topology before anything is published.
    {
        let conn = codepool_broker::connect(AMQP_URL, "chaos-setup")
            .await
            .unwrap();
        let ch = conn.create_channel().await.unwrap();
        env.topology().declare(&ch).await.unwrap();
        let _ = conn.close(200, "ok").await;
    }

    // The workload: valid orders of 1 to 3 codes, ~5% duplicates, a few
    // invalid messages.
    let orders: Vec<Purchase> = (0..s.orders)
        .map(|i| Purchase {
            quantity: (i % 3 + 1) as u32,
            ..purchase(&format!("CH-{i:06}"), "chaos")
        })
        .collect();
    let mut bodies: Vec<(Vec<u8>, Option<String>)> = Vec::new();
    let mut rng = rand::rng();
    let mut duplicates = 0;
    for (i, p) in orders.iter().enumerate() {
        bodies.push((p.to_json(), Some(p.order_id.clone())));
        if i > 0 && rng.random_bool(0.05) {
            let earlier = &orders[rng.random_range(0..i)];
            bodies.push((earlier.to_json(), Some(earlier.order_id.clone())));
            duplicates += 1;
        }
    }
    let invalid_ids: HashSet<String> = (0..s.invalid).map(|i| format!("BAD-{i:03}")).collect();
    let invalid: Vec<(Vec<u8>, Option<String>)> = invalid_ids
        .iter()
        .enumerate()
        .map(|(i, id)| {
            let body = match i % 3 {
                0 => b"{not json".to_vec(),
                1 => {
                    br#"{"order_id":1,"uid":"u","phone":"+8613800000000","pool":"chaos"}"#.to_vec()
                }
                _ => {
                    br#"{"order_id":"X","uid":"u","phone":"+8613800000000","pool":"no-such-pool"}"#
                        .to_vec()
                }
            };
            (body, Some(id.clone()))
        })
        .collect();

    let mut d = Dispatchers {
        env: &env,
        logs: logs.clone(),
        running: Vec::new(),
        started: 0,
        kills: 0,
    };
    for _ in 0..3 {
        d.spawn();
    }
    publish_with_retries(&env, invalid, Duration::from_millis(10)).await;

    let started = Instant::now();
    let publisher = {
        let env_ref: &TestEnv = &env;
        let bodies = bodies.clone();
        let over = Duration::from_secs(s.publish_secs);
        async move { publish_with_retries(env_ref, bodies, over).await }
    };
    let deadline = started + Duration::from_secs(s.publish_secs + 5);
    let kills = async {
        while Instant::now() + s.kill_every < deadline {
            tokio::time::sleep(s.kill_every).await;
            d.kill_one().await;
        }
    };
    let faults = async {
        let mut restarts = 0;
        let plan = s.publish_secs as f64;
        let until =
            |f: f64| tokio::time::sleep_until((started + Duration::from_secs_f64(plan * f)).into());
        until(0.2).await;
        let client = redis::Client::open(env.redis_url.as_str()).unwrap();
        let mut c = client.get_multiplexed_async_connection().await.unwrap();
        let _: () = redis::cmd("FLUSHALL").query_async(&mut c).await.unwrap();

        until(0.35).await;
        services(&["stop", "--force", "redis"]).await;
        tokio::time::sleep(Duration::from_secs(3)).await;
        services(&["start", "redis"]).await;
        restarts += 1;

        until(0.5).await;
        let status = tokio::process::Command::new("rabbitmqctl")
            .arg("close_all_connections")
            .arg("chaos test")
            .stdout(std::process::Stdio::null())
            .status()
            .await
            .expect("rabbitmqctl");
        assert!(status.success(), "rabbitmqctl close_all_connections failed");

        until(0.65).await;
        services(&["stop", "--force", "mongo"]).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        services(&["start", "mongo"]).await;
        restarts += 1;

        // Codes ran out long ago: backorders pile up until this import.
        until(0.85).await;
        let mut f = tempfile::NamedTempFile::new().unwrap();
        writeln!(f, "code").unwrap();
        for i in 0..s.second_import {
            writeln!(f, "CHAOS-NEW-{i:06}").unwrap();
        }
        let out = env
            .command(&["import", f.path().to_str().unwrap(), "--pool", "chaos"])
            .output()
            .await
            .unwrap();
        assert!(
            out.status.success(),
            "second import: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        restarts
    };
    let (publisher_reconnects, (), restarts) = tokio::join!(publisher, kills, faults);

    // Let the survivors finish: every valid order ends with its codes.
    let codes = env.store.database().collection::<bson::Document>("codes");
    let expected: u64 = orders.iter().map(|p| u64::from(p.quantity)).sum();
    eventually(
        Duration::from_secs(120),
        "every order to hold its codes",
        || {
            let codes = codes.clone();
            async move {
                codes
                    .count_documents(doc! {"pool": "chaos", "order_id": {"$type": "string"}})
                    .await
                    .unwrap_or(0)
                    == expected
            }
        },
    )
    .await;
    let conn = codepool_broker::connect(AMQP_URL, "chaos-check")
        .await
        .unwrap();
    let ch = conn.create_channel().await.unwrap();
    let t = env.topology();
    eventually(
        Duration::from_secs(60),
        "the purchases queues to drain",
        || {
            let (ch, t) = (ch.clone(), t.clone());
            async move { purchases_depth(&ch, &t).await == 0 }
        },
    )
    .await;
    // Give in-flight acks a moment, then stop everyone gracefully.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let statuses = d.stop_all().await;
    for st in &statuses {
        assert!(
            st.success(),
            "a dispatcher exited with {st} on SIGTERM; logs in {}",
            logs.display()
        );
    }
    // Nothing was left unacked: with every consumer gone, the queue is empty.
    assert_eq!(
        purchases_depth(&ch, &t).await,
        0,
        "unacked purchases were left behind"
    );

    // In MongoDB: one code per line of an order, one line per code.
    let issued: Vec<bson::Document> = codes
        .find(doc! {"pool": "chaos", "order_id": {"$type": "string"}})
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    let mut code_by_line: HashMap<(String, u32), String> = HashMap::new();
    let mut line_by_code: HashMap<String, (String, u32)> = HashMap::new();
    let mut violations = 0;
    for doc in &issued {
        let order = doc.get_str("order_id").unwrap().to_owned();
        let line = doc.get_i64("order_line").unwrap_or(0) as u32;
        let code = env.plain_code(doc);
        if code_by_line
            .insert((order.clone(), line), code.clone())
            .is_some()
        {
            violations += 1;
        }
        if line_by_code.insert(code, (order, line)).is_some() {
            violations += 1;
        }
    }
    for p in &orders {
        for line in 0..p.quantity {
            if !code_by_line.contains_key(&(p.order_id.clone(), line)) {
                violations += 1;
            }
        }
    }
    if code_by_line.len() as u64 != expected {
        violations += 1;
    }
    // Backorders: created only while codes ran out, all fulfilled since.
    let backorders = env
        .store
        .database()
        .collection::<bson::Document>("backorders");
    let bo_total = backorders.count_documents(doc! {}).await.unwrap();
    let bo_waiting = backorders
        .count_documents(doc! {"status": "waiting"})
        .await
        .unwrap();
    violations += bo_waiting as usize;

    // Every grant has an SMS-pending event, always with its own code.
    let events = drain(&ch, &t.sms_pending).await;
    let mut evented: HashSet<(String, u32)> = HashSet::new();
    for e in &events {
        let ev: SmsPending = serde_json::from_slice(&e.body).unwrap();
        for c in ev.all_codes() {
            let line = (ev.order_id.clone(), c.line);
            if code_by_line.get(&line) != Some(&c.code) {
                violations += 1;
            }
            evented.insert(line);
        }
    }
    let missing_events = code_by_line
        .keys()
        .filter(|line| !evented.contains(*line))
        .count();
    violations += missing_events;

    // Exactly the invalid messages are dead-lettered (a redelivery after a
    // kill may dead-letter one twice; what counts is which messages).
    let dead = drain(&ch, &t.purchases_dead).await;
    let dead_ids: HashSet<String> = dead.iter().filter_map(|m| m.message_id.clone()).collect();
    if dead_ids != invalid_ids {
        violations += 1;
    }
    assert!(dead.iter().all(|m| m.reason.is_some()));

    println!(
        "chaos: {} partition(s), purchases {} (valid orders {}, duplicates {duplicates}, invalid {}), dispatcher kills {}, server restarts {restarts}, publisher reconnects {publisher_reconnects}, grants {}, backorders {bo_total} (waiting {bo_waiting}), sms events {}, dead letters {} ({} distinct), violations {violations}, {:.0}s",
        s.partitions,
        bodies.len() + s.invalid,
        s.orders,
        s.invalid,
        d.kills,
        issued.len(),
        events.len(),
        dead.len(),
        dead_ids.len(),
        started.elapsed().as_secs_f64(),
    );
    assert_eq!(missing_events, 0, "grants without an SMS-pending event");
    assert!(
        bo_total > 0,
        "the pool never ran out, so backorders were not exercised"
    );
    assert_eq!(
        dead_ids, invalid_ids,
        "dead letters are not exactly the invalid messages"
    );
    assert_eq!(
        violations,
        0,
        "invariants violated; dispatcher logs in {}",
        logs.display()
    );
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
    let _ = std::fs::remove_dir_all(&logs);
}
