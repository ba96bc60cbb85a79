//! The failover test: three dispatcher processes work on replicated
//! servers (`scripts/cluster.sh`: a 3-member MongoDB replica set, a 3-node
//! RabbitMQ cluster with quorum queues, a 3-master Redis Cluster) while the
//! MongoDB primary is killed, the Redis master holding the pool's hot set is
//! shut down, and the RabbitMQ node the dispatchers are connected to is
//! stopped; each comes back. Then, checked in MongoDB and in the queues:
//! every order has exactly one code, no code is issued twice, every order's
//! SMS event is published, no purchase is left in the queue, and dead
//! letters are exactly the invalid messages.
//!
//! `make test` runs the short version (5,000 purchases, one round of
//! faults) with purchases spread over 2 partitions, each with one active
//! consumer that moves when its dispatcher's node stops; `make
//! chaos-cluster` sets `CODEPOOL_FAILOVER=full` for a long one with
//! repeated rounds on the one queue (`CODEPOOL_TEST_PARTITIONS=N` sets the
//! partitions of either). The cluster is started idempotently on its own
//! ports, so the single-node servers other tests use are never touched.

#[path = "../suite/common.rs"]
mod common;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use bson::doc;
use codepool_domain::{Purchase, SmsPending};
use futures::TryStreamExt;
use rand::Rng;

use crate::common::{
    drain, eventually, publish_with_retries, purchase, purchases_depth, Servers, TestEnv,
};

const POOL: &str = "failover";

struct Scale {
    orders: usize,
    invalid: usize,
    publish_secs: u64,
    rounds: usize,
    /// Purchase partitions ([`partitions`]).
    partitions: u16,
}

/// The run's purchase partitions: `quick` unless `CODEPOOL_TEST_PARTITIONS`.
fn partitions(quick: u16) -> u16 {
    std::env::var("CODEPOOL_TEST_PARTITIONS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(quick)
}

fn scale() -> Scale {
    if std::env::var("CODEPOOL_FAILOVER").as_deref() == Ok("full") {
        Scale {
            orders: 30_000,
            invalid: 40,
            publish_secs: 240,
            rounds: 4,
            partitions: partitions(1),
        }
    } else {
        Scale {
            orders: 5_000,
            invalid: 10,
            publish_secs: 50,
            rounds: 1,
            partitions: partitions(2),
        }
    }
}

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Runs `scripts/cluster.sh ARGS` and returns its stdout.
async fn cluster(args: &[&str]) -> String {
    let child = tokio::process::Command::new("bash")
        .arg(repo_root().join("scripts/cluster.sh"))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .spawn()
        .expect("run scripts/cluster.sh");
    let out = child.wait_with_output().await.expect("scripts/cluster.sh");
    assert!(out.status.success(), "scripts/cluster.sh {args:?} failed");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Starts the cluster (idempotent) and reads the `CODEPOOL_*` it prints.
async fn start_cluster() -> Servers {
    let printed = cluster(&["start"]).await;
    let var = |name: &str| {
        printed
            .lines()
            .find_map(|l| l.strip_prefix(&format!("export {name}=")))
            .map(|v| v.trim_matches('\'').to_owned())
            .unwrap_or_else(|| panic!("scripts/cluster.sh start printed no {name}"))
    };
    Servers {
        mongo_uri: var("CODEPOOL_MONGODB_URI"),
        redis_url: var("CODEPOOL_REDIS_URL"),
        amqp_url: var("CODEPOOL_AMQP_URL"),
    }
}

/// The RabbitMQ node (1..=3) most dispatcher connections are on, read from
/// the server port of each connection (the list is cluster-wide).
async fn dispatchers_rabbit_node() -> String {
    for node in 1..=3 {
        let out = tokio::process::Command::new("rabbitmqctl")
            .args(["-q", "-n", &format!("rabbit-c{node}@localhost")])
            .args([
                "list_connections",
                "--no-table-headers",
                "port",
                "client_properties",
            ])
            .output()
            .await;
        let Ok(out) = out else { continue };
        if !out.status.success() {
            continue;
        }
        let mut by_port: HashMap<String, usize> = HashMap::new();
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let port = line.split_whitespace().next().unwrap_or_default();
            if line.contains(r#"{"connection_name","codepool-dispatch"#) {
                *by_port.entry(port.to_owned()).or_default() += 1;
            }
        }
        if let Some((port, _)) = by_port.into_iter().max_by_key(|(_, n)| *n) {
            if let Some(n) = port.parse::<u32>().ok().and_then(|p| p.checked_sub(5700)) {
                return n.to_string();
            }
        }
    }
    "1".to_owned()
}

/// One round of faults within `span`: kill the MongoDB primary, shut
/// down the Redis master of the pool, stop the dispatchers' RabbitMQ node;
/// each comes back a few seconds later.
async fn fault_round(span: Duration, log: &mut Vec<String>) {
    // three faults, each with ~5 s down and a restart, inside the publishing window
    let step = span / 6;
    tokio::time::sleep(step).await;
    let primary = cluster(&["mongo-primary"]).await.trim().to_owned();
    cluster(&["kill", "mongo", &primary]).await;
    log.push(format!("killed MongoDB primary {primary}"));
    tokio::time::sleep(Duration::from_secs(5)).await;
    cluster(&["start", "mongo", &primary]).await;

    tokio::time::sleep(step).await;
    let master = cluster(&["redis-master-of", POOL]).await.trim().to_owned();
    cluster(&["stop", "redis", &master]).await;
    log.push(format!("shut down Redis master {master}"));
    tokio::time::sleep(Duration::from_secs(5)).await;
    cluster(&["start", "redis", &master]).await;

    tokio::time::sleep(step).await;
    let node = dispatchers_rabbit_node().await;
    cluster(&["stop", "rabbitmq", &node]).await;
    log.push(format!("stopped RabbitMQ node {node}"));
    tokio::time::sleep(Duration::from_secs(5)).await;
    cluster(&["start", "rabbitmq", &node]).await;
}

/// The workload: every order once, about 5% delivered twice, and a few
/// invalid messages (which alone may be dead-lettered).
struct Workload {
    orders: Vec<Purchase>,
    bodies: Vec<(Vec<u8>, Option<String>)>,
    duplicates: usize,
    invalid: Vec<(Vec<u8>, Option<String>)>,
    invalid_ids: HashSet<String>,
}

fn workload(s: &Scale) -> Workload {
    // Orders of 1, 2 and 3 codes in turn.
    let orders: Vec<Purchase> = (0..s.orders)
        .map(|i| Purchase {
            quantity: (i % 3 + 1) as u32,
            ..purchase(&format!("FO-{i:06}"), POOL)
        })
        .collect();
    let mut bodies = Vec::new();
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
    let invalid =
        invalid_ids
            .iter()
            .enumerate()
            .map(|(i, id)| {
                let body = match i % 2 {
                0 => b"{not json".to_vec(),
                _ => br#"{"order_id":"X","uid":"u","phone":"+8613800000000","pool":"no-such-pool"}"#
                    .to_vec(),
            };
                (body, Some(id.clone()))
            })
            .collect();
    Workload {
        orders,
        bodies,
        duplicates,
        invalid,
        invalid_ids,
    }
}

struct Dispatchers {
    logs: PathBuf,
    running: Vec<tokio::process::Child>,
}

impl Dispatchers {
    fn start(env: &TestEnv, logs: PathBuf, n: usize) -> Self {
        let running = (1..=n)
            .map(|i| {
                let log = std::fs::File::create(logs.join(format!("dispatcher-{i}.log")))
                    .expect("log file");
                env.command(&["dispatch", "--no-http"])
                    .stderr(log)
                    .stdout(std::process::Stdio::null())
                    .spawn()
                    .expect("spawn dispatcher")
            })
            .collect();
        Self { logs, running }
    }

    /// SIGTERM to all; each must exit 0.
    async fn stop(&mut self) {
        for c in &self.running {
            if let Some(pid) = c.id() {
                let _ = std::process::Command::new("kill")
                    .args(["-TERM", &pid.to_string()])
                    .status();
            }
        }
        for mut c in self.running.drain(..) {
            let status = tokio::time::timeout(Duration::from_secs(15), c.wait())
                .await
                .expect("a dispatcher did not stop within 15s of SIGTERM")
                .expect("wait");
            assert!(
                status.success(),
                "a dispatcher exited with {status}; logs in {}",
                self.logs.display()
            );
        }
    }
}

/// What the checks found; every field but the counts must be empty.
#[derive(Default, Debug)]
struct Findings {
    orders_without_code: usize,
    orders_with_two_codes: usize,
    codes_issued_twice: usize,
    orders_without_event: usize,
    events_with_wrong_code: usize,
    purchases_left: u32,
    unexpected_dead_letters: Vec<String>,
    grants: usize,
    events: usize,
    dead_letters: usize,
}

impl Findings {
    fn is_clean(&self) -> bool {
        self.orders_without_code == 0
            && self.orders_with_two_codes == 0
            && self.codes_issued_twice == 0
            && self.orders_without_event == 0
            && self.events_with_wrong_code == 0
            && self.purchases_left == 0
            && self.unexpected_dead_letters.is_empty()
    }
}

/// Reads every grant from MongoDB and checks one code per order, one order
/// per code; returns the code of each order.
/// A line of an order: what one code is granted to.
type Line = (String, u32);

async fn check_grants(env: &TestEnv, w: &Workload, f: &mut Findings) -> HashMap<Line, String> {
    let codes = env.store.database().collection::<bson::Document>("codes");
    let issued: Vec<bson::Document> = codes
        .find(doc! {"pool": POOL, "order_id": {"$type": "string"}})
        .await
        .expect("read grants")
        .try_collect()
        .await
        .expect("read grants");
    f.grants = issued.len();
    let mut code_by_line: HashMap<Line, String> = HashMap::new();
    let mut line_by_code: HashMap<String, Line> = HashMap::new();
    for d in &issued {
        let Ok(order) = d.get_str("order_id") else {
            continue;
        };
        let line = (
            order.to_owned(),
            d.get_i64("order_line").unwrap_or(0) as u32,
        );
        // Codes are sealed at rest: open them with the test's key file.
        let code = env.plain_code(d);
        if code_by_line.insert(line.clone(), code.clone()).is_some() {
            f.orders_with_two_codes += 1;
        }
        if line_by_code.insert(code, line).is_some() {
            f.codes_issued_twice += 1;
        }
    }
    let quantity: HashMap<&str, u32> = (w.orders.iter())
        .map(|p| (p.order_id.as_str(), p.quantity))
        .collect();
    // A line past its order's quantity is a code too many.
    f.orders_with_two_codes += (code_by_line.keys())
        .filter(|(o, l)| quantity.get(o.as_str()).is_none_or(|q| l >= q))
        .count();
    f.orders_without_code = w
        .orders
        .iter()
        .filter(|p| (0..p.quantity).any(|l| !code_by_line.contains_key(&(p.order_id.clone(), l))))
        .count();
    code_by_line
}

/// Drains the SMS-pending and dead-letter queues and checks them against
/// the grants and the invalid messages.
async fn check_queues(
    channel: &lapin::Channel,
    env: &TestEnv,
    w: &Workload,
    code_by_line: &HashMap<Line, String>,
    f: &mut Findings,
) {
    let t = env.topology();
    f.purchases_left = purchases_depth(channel, &t).await;
    let events = drain(channel, &t.sms_pending).await;
    f.events = events.len();
    let mut evented: HashSet<Line> = HashSet::new();
    for e in &events {
        let Ok(ev) = serde_json::from_slice::<SmsPending>(&e.body) else {
            f.events_with_wrong_code += 1;
            continue;
        };
        for c in ev.all_codes() {
            let line = (ev.order_id.clone(), c.line);
            if code_by_line.get(&line) != Some(&c.code) {
                f.events_with_wrong_code += 1;
            }
            evented.insert(line);
        }
    }
    f.orders_without_event = code_by_line
        .keys()
        .filter(|line| !evented.contains(*line))
        .count();
    let dead = drain(channel, &t.purchases_dead).await;
    f.dead_letters = dead.len();
    let dead_ids: HashSet<String> = dead.iter().filter_map(|m| m.message_id.clone()).collect();
    f.unexpected_dead_letters = dead
        .iter()
        .filter(|m| {
            let invalid = m
                .message_id
                .as_ref()
                .is_some_and(|id| w.invalid_ids.contains(id));
            !invalid
                || m.reason
                    .as_deref()
                    .is_none_or(|r| r.starts_with("delivery_limit"))
        })
        .map(|m| format!("{:?}: {:?}", m.message_id, m.reason))
        .collect();
    for id in w.invalid_ids.difference(&dead_ids) {
        f.unexpected_dead_letters
            .push(format!("{id}: invalid but not dead-lettered"));
    }
}

/// Declares the queues (quorum, the default) before anything is published.
async fn declare_topology(env: &TestEnv) {
    let conn = codepool_broker::connect(&env.amqp_url, "failover-setup")
        .await
        .expect("RabbitMQ cluster answers");
    let channel = conn.create_channel().await.expect("channel");
    env.topology().declare(&channel).await.expect("declare");
    let _ = conn.close(200, "declared").await;
}

/// How many dispatcher logs report each outage: proof the faults hit them.
fn outages_seen(logs: &std::path::Path) -> HashMap<&'static str, usize> {
    let mut seen = HashMap::new();
    let entries = std::fs::read_dir(logs).expect("log dir");
    for entry in entries.flatten() {
        let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
        for (what, line) in [
            ("mongo", "MongoDB unavailable"),
            ("redis", "Redis unavailable"),
            ("rabbitmq", "RabbitMQ unavailable"),
        ] {
            if text.contains(line) {
                *seen.entry(what).or_default() += 1;
            }
        }
    }
    seen
}

/// Before any fault: a batch over pools whose keys live in different hash
/// slots claims through the Redis Cluster, not the MongoDB fallback. Every
/// Redis pipeline of the claim spans those pools, and a cluster refuses a
/// pipeline that crosses slots; the refills leave each pool's remaining
/// candidates in its hot set, which the fallback would not.
async fn many_pools_claim_through_the_hot_pool(env: &TestEnv) {
    let pools: Vec<String> = (0..12).map(|k| format!("slots-{k:02}")).collect();
    for pool in &pools {
        env.fill_pool(pool, 5).await;
    }
    let purchases: Vec<Purchase> = pools
        .iter()
        .flat_map(|pool| (0..2).map(move |i| purchase(&format!("{pool}-order-{i}"), pool)))
        .collect();
    let refs: Vec<&Purchase> = purchases.iter().collect();
    let engine = env.engine();
    let out = engine
        .claim_batch(&refs, codepool_issuance::Resend::ByRedelivery)
        .await
        .expect("claims on the cluster");
    let granted = out
        .iter()
        .filter(|o| o.single().is_some_and(|(_, fresh)| fresh))
        .count();
    assert_eq!(granted, purchases.len(), "every order granted: {out:?}");
    assert!(!engine.is_degraded(), "the claims fell back to MongoDB");
    let hot = env.hot_pool();
    for pool in &pools {
        assert_eq!(
            hot.len(pool).await.expect("redis cluster"),
            3,
            "{pool}'s hot set"
        );
    }
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dispatchers_survive_failover_of_every_server() {
    let started = Instant::now();
    let s = scale();
    let servers = start_cluster().await;
    let cluster_up = started.elapsed();
    let env = TestEnv::on("failover", servers)
        .await
        .with_partitions(s.partitions);
    many_pools_claim_through_the_hot_pool(&env).await;
    let logs = std::env::temp_dir().join(format!("codepool-failover-{}", env.db));
    std::fs::create_dir_all(&logs).expect("log dir");
    env.fill_pool(POOL, 2 * s.orders + 500).await;
    declare_topology(&env).await;

    let w = workload(&s);
    let mut dispatchers = Dispatchers::start(&env, logs.clone(), 3);
    publish_with_retries(&env, w.invalid.clone(), Duration::from_millis(10)).await;
    let work_started = Instant::now();
    let over = Duration::from_secs(s.publish_secs);
    let mut faults = Vec::new();
    let (reconnects, ()) =
        tokio::join!(publish_with_retries(&env, w.bodies.clone(), over), async {
            for _ in 0..s.rounds {
                fault_round(over / s.rounds as u32, &mut faults).await;
            }
        });
    let codes = env.store.database().collection::<bson::Document>("codes");
    let expected: u64 = w.orders.iter().map(|p| u64::from(p.quantity)).sum();
    eventually(
        Duration::from_secs(120),
        "every order to hold its codes",
        || {
            let codes = codes.clone();
            async move {
                let filter = doc! {"pool": POOL, "order_id": {"$type": "string"}};
                codes.count_documents(filter).await.unwrap_or(0) >= expected
            }
        },
    )
    .await;
    // The node of the set-up connection may have been stopped: connect anew.
    let conn = codepool_broker::connect(&env.amqp_url, "failover-check")
        .await
        .expect("RabbitMQ cluster answers");
    let channel = conn.create_channel().await.expect("channel");
    let t = env.topology();
    eventually(
        Duration::from_secs(60),
        "the purchases queues to drain",
        || {
            let (ch, t) = (channel.clone(), t.clone());
            async move { purchases_depth(&ch, &t).await == 0 }
        },
    )
    .await;
    let work = work_started.elapsed();
    tokio::time::sleep(Duration::from_secs(2)).await;
    dispatchers.stop().await;

    let outages = outages_seen(&logs);
    let mut f = Findings::default();
    let code_by_line = check_grants(&env, &w, &mut f).await;
    check_queues(&channel, &env, &w, &code_by_line, &mut f).await;
    println!(
        "failover: {} partition(s), {} orders (+{} duplicates, {} invalid), faults [{}], publisher reconnects {reconnects}, dispatchers that saw an outage {outages:?}, cluster up in {:.0}s, work {:.0}s, total {:.0}s; {f:?}",
        s.partitions, s.orders, w.duplicates, s.invalid, faults.join(", "),
        cluster_up.as_secs_f64(), work.as_secs_f64(), started.elapsed().as_secs_f64()
    );
    assert!(
        f.is_clean(),
        "invariants violated: {f:?}; dispatcher logs in {}",
        logs.display()
    );
    for what in ["redis", "rabbitmq"] {
        assert!(
            outages.contains_key(what),
            "no dispatcher noticed the {what} fault; logs in {}",
            logs.display()
        );
    }
    let _ = conn.close(200, "bye").await;
    env.cleanup().await;
    let _ = std::fs::remove_dir_all(&logs);
}
