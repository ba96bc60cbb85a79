//! Shared test fixtures: isolated namespaces on the real servers, a code
//! pool filler, the built binary, and a private Redis for fault tests.

#![allow(dead_code)]

use std::net::TcpListener;

use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};

use codepool_broker::Topology;
use codepool_domain::Purchase;
use codepool_hotpool::HotPool;
use codepool_issuance::{ClaimConfig, ClaimEngine, GrantNumbers, Resend};
use codepool_store::{ClaimAssignment, CodeKeys, NewCode, ObjectId, Store};
use lapin::options::{BasicAckOptions, BasicGetOptions, QueueDeleteOptions};

pub const MONGO_URI: &str = "mongodb://127.0.0.1:27017/?directConnection=true";
pub const REDIS_URL: &str = "redis://127.0.0.1:6379";
pub const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// The `codepool` binary built for this test run.
pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_codepool")
}

/// A short random suffix.
pub fn suffix() -> String {
    format!("{:08x}", rand::random::<u32>())
}

/// Done once per test process, before its first namespace.
static SWEPT: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();

/// Removes what test processes that are gone left on the servers: a run
/// killed before its cleanup (Ctrl-C, a timeout, `kill -9`) leaves its
/// databases, Redis keys and queues, and they weigh on every later run.
/// Databases are swept by every test process (listing them is cheap);
/// Redis keys and queues (`rabbitmqctl` takes half a second) at most once
/// every two minutes, by whichever test process comes first.
async fn sweep_dead_runs(store: &Store, servers: &Servers) {
    let family = codepool::scratch::TESTS;
    family.sweep_databases(store).await;
    let stamp = std::env::temp_dir().join("codepool-test-sweep.stamp");
    let due = std::fs::metadata(&stamp)
        .and_then(|m| m.modified())
        .map_or(true, |t| {
            t.elapsed().unwrap_or_default() > Duration::from_secs(120)
        });
    if due && std::fs::write(&stamp, b"").is_ok() {
        let _ = family.sweep_redis(&servers.redis_url).await;
        family.sweep_broker(&servers.amqp_url).await;
    }
}

/// Where a test's servers are: the single-node servers by default, the
/// replicated ones (`scripts/cluster.sh`) for the failover test.
#[derive(Debug, Clone)]
pub struct Servers {
    pub mongo_uri: String,
    pub redis_url: String,
    pub amqp_url: String,
}

impl Default for Servers {
    fn default() -> Self {
        Self {
            // `make cluster-sharded` points the tests at its mongos.
            mongo_uri: std::env::var("CODEPOOL_TEST_MONGODB_URI")
                .unwrap_or_else(|_| MONGO_URI.to_owned()),
            redis_url: REDIS_URL.to_owned(),
            amqp_url: AMQP_URL.to_owned(),
        }
    }
}

/// One test's private namespace on the shared servers.
pub struct TestEnv {
    pub name: String,
    pub mongo_uri: String,
    pub amqp_url: String,
    pub db: String,
    pub redis_url: String,
    pub redis_prefix: String,
    pub amqp_prefix: String,
    pub store: Store,
    /// This test's key file (`CODEPOOL_KEY_FILE` of every child process).
    pub key_file: std::path::PathBuf,
    _key_dir: Arc<tempfile::TempDir>,
    /// Purchase partitions of this namespace (`CODEPOOL_PARTITIONS` of
    /// every child process): 1 unless [`Self::with_partitions`].
    pub partitions: u16,
}

impl TestEnv {
    pub async fn new(test: &str) -> Self {
        Self::with_redis(test, REDIS_URL).await
    }

    pub async fn with_redis(test: &str, redis_url: &str) -> Self {
        let servers = Servers {
            redis_url: redis_url.to_owned(),
            ..Servers::default()
        };
        Self::on(test, servers).await
    }

    /// A namespace on `servers`.
    pub async fn on(test: &str, servers: Servers) -> Self {
        let s = suffix();
        let short: String = test
            .chars()
            .filter(|c| c.is_ascii_alphanumeric())
            .take(24)
            .collect();
        // The names carry this test process's id, so the next run can tell
        // a dead run's leftovers from a live one's.
        let names = codepool::scratch::TESTS.names(&format!("{short}_{s}"));
        let db = names.db;
        let store = Store::connect(&servers.mongo_uri, &db)
            .await
            .expect("MongoDB must run on 127.0.0.1:27017 (make services)");
        SWEPT
            .get_or_init(|| sweep_dead_runs(&store, &servers))
            .await;
        codepool_store::migrate::migrate(&store)
            .await
            .expect("migrate");
        // Through a mongos (`make cluster-sharded`), the test's database is
        // sharded by the operator's own script.
        if let Some(script) = std::env::var_os("CODEPOOL_TEST_SHARDING_JS") {
            let out = tokio::process::Command::new("mongosh")
                .arg("--quiet")
                .arg(&servers.mongo_uri)
                .arg("--eval")
                .arg(format!("var dbName = {db:?}"))
                .arg(script)
                .output()
                .await
                .expect("mongosh runs");
            assert!(
                out.status.success(),
                "sharding.js: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let key_dir = tempfile::tempdir().expect("a temporary folder");
        let key_file = key_dir.path().join("keys.json");
        let ring = codepool_vault::keyfile::init(&key_file).expect("key file");
        let store = store.with_keys(CodeKeys::new(ring, Some(key_file.clone())));
        Self {
            key_file,
            _key_dir: Arc::new(key_dir),
            name: test.to_owned(),
            mongo_uri: servers.mongo_uri,
            amqp_url: servers.amqp_url,
            redis_url: servers.redis_url,
            redis_prefix: names.redis_prefix,
            amqp_prefix: names.amqp_prefix,
            db,
            store,
            partitions: 1,
        }
    }

    /// The same namespace with purchases spread over `n` partitions: its
    /// topology, publishers and child processes all use them.
    pub fn with_partitions(mut self, n: u16) -> Self {
        self.partitions = n;
        self
    }

    /// [`Self::new`], with `pools` filled by [`Self::fill_pool`].
    pub async fn with_pools(test: &str, pools: &[(&str, usize)]) -> Self {
        let env = Self::new(test).await;
        for (pool, n) in pools {
            env.fill_pool(pool, *n).await;
        }
        env
    }

    pub fn topology(&self) -> Topology {
        Topology::with_prefix(&self.amqp_prefix).with_partitions(self.partitions)
    }

    pub fn hot_pool(&self) -> HotPool {
        HotPool::new(&self.redis_url, &self.redis_prefix).expect("redis url")
    }

    pub fn engine(&self) -> ClaimEngine {
        // One server, or the comma-separated nodes of a Redis Cluster.
        let daily = codepool_sequence::DailyNumbers::from_url(
            Some(&self.redis_url),
            self.store.database().clone(),
            &self.redis_prefix,
            chrono_tz::UTC,
        )
        .expect("redis url");
        ClaimEngine::new(
            Arc::new(self.store.clone()),
            Arc::new(self.hot_pool()),
            Arc::new(GrantNumbers::new(daily, self.store.clone())),
            ClaimConfig {
                refill_batch: 500,
                low_water: 250,
                ..ClaimConfig::default()
            },
        )
    }

    /// The collection `name` of this test's database.
    pub fn coll(&self, name: &str) -> mongodb::Collection<bson::Document> {
        self.store.database().collection::<bson::Document>(name)
    }

    /// The filter that finds `code` in `pool` (by its HMAC).
    pub fn code_filter(&self, pool: &str, code: &str) -> bson::Document {
        let ring = self.store.keys().ring().expect("keys");
        codepool_store::crypto::code_filter(&ring, pool, code, false)
    }

    /// The plaintext code of a raw `codes` document, decrypted with this
    /// test's keys.
    pub fn plain_code(&self, d: &bson::Document) -> String {
        let doc: codepool_store::CodeDoc = bson::from_document(d.clone()).expect("a code document");
        doc.into_code(self.store.keys()).expect("decrypts").code
    }

    /// A broker connection and a publisher to this namespace's topology,
    /// publishing purchases as the connection's broker user: the
    /// operator's (codepool's own), so purchases of no shop are taken.
    pub async fn amqp(&self) -> (lapin::Connection, codepool_broker::Publisher) {
        let conn = codepool_broker::connect(&self.amqp_url, "test")
            .await
            .expect("connect to RabbitMQ");
        let publisher = codepool_broker::Publisher::new(&conn, self.topology())
            .await
            .expect("a publisher")
            .as_user(&codepool_broker::Publisher::user_of(&self.amqp_url));
        (conn, publisher)
    }

    /// Runs `codepool ARGS` in this namespace; its output, whatever its
    /// exit status.
    pub async fn run(&self, args: &[&str]) -> std::process::Output {
        self.command(args).output().await.expect("run codepool")
    }

    /// Environment for a `codepool` child process in this namespace.
    pub fn command(&self, args: &[&str]) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(bin());
        cmd.args(args)
            .env("CODEPOOL_MONGODB_URI", &self.mongo_uri)
            .env("CODEPOOL_DB", &self.db)
            .env("CODEPOOL_REDIS_URL", &self.redis_url)
            .env("CODEPOOL_REDIS_PREFIX", &self.redis_prefix)
            .env("CODEPOOL_AMQP_URL", &self.amqp_url)
            .env("CODEPOOL_AMQP_PREFIX", &self.amqp_prefix)
            .env("CODEPOOL_PARTITIONS", self.partitions.to_string())
            .env("CODEPOOL_KEY_FILE", &self.key_file)
            // The test publishes code.redeemed as the platform would: with
            // user_id set to the broker user it connects as.
            .env("CODEPOOL_REDEEMERS", "guest")
            // Webhook receivers in tests listen on loopback.
            .env("CODEPOOL_WEBHOOK_ALLOW_HOSTS", "127.0.0.1")
            .env("RUST_LOG", "info")
            .kill_on_drop(true);
        cmd
    }

    /// Creates `pool` with `n` codes `PREFIX-000001`…, returns the codes.
    pub async fn fill_pool(&self, pool: &str, n: usize) -> Vec<String> {
        self.fill_pool_expiring(pool, 0, n).await
    }

    /// [`Self::fill_pool`] with `expired` codes that expired an hour ago
    /// first (the lowest `seq`s), then `n - expired` that never expire.
    pub async fn fill_pool_expiring(&self, pool: &str, expired: usize, n: usize) -> Vec<String> {
        self.store.ensure_pool(pool).await.expect("pool");
        let codes: Vec<String> = (1..=n).map(|i| format!("{pool}-{i:06}")).collect();
        let batch = ObjectId::new();
        let past = chrono::Utc::now() - chrono::Duration::hours(1);
        for (k, chunk) in codes.chunks(1000).enumerate() {
            let new: Vec<NewCode> = chunk
                .iter()
                .enumerate()
                .map(|(i, c)| NewCode {
                    code: c.clone(),
                    line: None,
                    expires_at: (k * 1000 + i < expired).then_some(past),
                })
                .collect();
            let out = self
                .store
                .insert_codes(pool, batch, &new)
                .await
                .expect("insert");
            assert_eq!(out.inserted as usize, chunk.len());
        }
        codes
    }

    /// Drops the database, this test's Redis keys, and its queues and
    /// exchanges.
    pub async fn cleanup(self) {
        let _ = self.store.drop_database().await;
        let _ = codepool::scratch::delete_redis_keys(&self.redis_url, &self.redis_prefix).await;
        if let Ok(conn) = codepool_broker::connect(&self.amqp_url, "cleanup").await {
            if let Ok(ch) = conn.create_channel().await {
                let t = self.topology();
                // The one purchases queue too, whatever the partitions.
                let single = Some(t.purchases.clone()).filter(|_| t.is_partitioned());
                for q in t.queue_names().iter().chain(&single) {
                    let _ = ch.queue_delete(q, QueueDeleteOptions::default()).await;
                }
                for e in [
                    &t.purchases_exchange,
                    &t.unrouted_exchange(),
                    &t.sms_exchange,
                    &t.events_exchange,
                ] {
                    let _ = ch.exchange_delete(e, Default::default()).await;
                }
            }
            let _ = conn.close(200, "bye").await;
        }
    }
}

pub fn purchase(order_id: &str, pool: &str) -> Purchase {
    Purchase {
        order_id: order_id.to_owned(),
        uid: format!("uid-{order_id}"),
        phone: "+8613800000000".into(),
        pool: pool.to_owned(),
        purchased_at: None,
        quantity: 1,
        owner: None,
        shop: None,
        hold_id: None,
        items: Vec::new(),
    }
}

/// [`purchase`] by the buyer `uid`.
pub fn purchase_by(order_id: &str, uid: &str, pool: &str) -> Purchase {
    Purchase {
        uid: uid.to_owned(),
        ..purchase(order_id, pool)
    }
}

/// "Give `code` of `pool` to `order`", as the claim engine writes it.
pub fn assign(code: codepool_domain::CodeId, pool: &str, order: &str) -> ClaimAssignment {
    ClaimAssignment {
        code_id: code,
        pool: pool.into(),
        order_id: order.into(),
        uid: format!("u-{order}"),
        phone: "+8613800000000".into(),
        grant_no: Some(format!("G-{order}")),
        mv: codepool_domain::gate::Move::Claim,
        resend: Resend::ByRedelivery,
        line: 0,
        quantity: 1,
        part: 0,
        owner: None,
    }
}

/// What a log line says: the line itself, or the `message` of a JSON line
/// (`--log-format json`).
pub fn announced(line: &str) -> String {
    serde_json::from_str::<serde_json::Value>(line)
        .ok()
        .and_then(|v| v["message"].as_str().map(str::to_owned))
        .unwrap_or_else(|| line.to_owned())
}

/// A `codepool dispatch` child process with its HTTP address.
pub struct Daemon {
    pub child: tokio::process::Child,
    pub addr: String,
    /// Every line the daemon wrote to stderr so far (its logs).
    pub log: Arc<std::sync::Mutex<Vec<String>>>,
    /// Reads stderr into `log`; ends when the daemon closes it.
    reader: tokio::task::JoinHandle<()>,
}

/// Starts `codepool dispatch --http 127.0.0.1:0` and waits until it
/// consumes; the address comes from `codepool: http listening on ADDR`.
pub async fn start_daemon(mut cmd: tokio::process::Command) -> Daemon {
    let mut child = cmd
        .args(["dispatch", "--http", "127.0.0.1:0"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn codepool dispatch");
    let stderr = child.stderr.take().expect("stderr");
    let (addr_tx, addr_rx) = tokio::sync::oneshot::channel();
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
    let log = Arc::new(std::sync::Mutex::new(Vec::new()));
    let kept = log.clone();
    let reader = tokio::spawn(async move {
        let mut lines = tokio::io::BufReader::new(stderr).lines();
        let (mut addr_tx, mut ready_tx) = (Some(addr_tx), Some(ready_tx));
        while let Ok(Some(line)) = lines.next_line().await {
            if let Ok(mut kept) = kept.lock() {
                kept.push(line.clone());
            }
            if let Some(addr) = announced(&line).strip_prefix("codepool: http listening on ") {
                if let Some(tx) = addr_tx.take() {
                    let _ = tx.send(addr.trim().to_owned());
                }
            }
            if line.contains("consuming purchases") {
                if let Some(tx) = ready_tx.take() {
                    let _ = tx.send(());
                }
            }
        }
    });
    let addr = tokio::time::timeout(Duration::from_secs(30), addr_rx)
        .await
        .expect("no `http listening` line within 30s")
        .expect("dispatcher exited before listening");
    tokio::time::timeout(Duration::from_secs(60), ready_rx)
        .await
        .expect("dispatcher did not consume within 60s")
        .expect("dispatcher exited before consuming");
    Daemon {
        child,
        addr,
        log,
        reader,
    }
}

/// A test that fails with a daemon running shows the daemon's warnings and
/// errors (and its last lines): the daemon's side of what went wrong.
impl Drop for Daemon {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        let log = self.log_text();
        let lines: Vec<&str> = log.lines().collect();
        let loud: Vec<&str> = lines
            .iter()
            .copied()
            .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
            .collect();
        let tail = &lines[lines.len().saturating_sub(20)..];
        let whole = std::env::temp_dir().join(format!(
            "codepool-daemon-{}.log",
            self.addr.replace([':', '.'], "-")
        ));
        let _ = std::fs::write(&whole, &log);
        eprintln!(
            "--- daemon {} (whole log in {}): {} warnings and errors, then its last lines ---\n{}\n...\n{}",
            self.addr,
            whole.display(),
            loud.len(),
            loud[loud.len().saturating_sub(40)..].join("\n"),
            tail.join("\n")
        );
    }
}

impl Daemon {
    /// The daemon's log so far, one string.
    pub fn log_text(&self) -> String {
        self.log.lock().map(|l| l.join("\n")).unwrap_or_default()
    }

    /// SIGTERM, then insist on exit status 0 within 10 seconds and on a
    /// stop that logs no error: an operator reads one as a failure.
    pub async fn stop(mut self) {
        if let Some(pid) = self.child.id() {
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
        }
        let status = tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .expect("dispatcher stops within 10s of SIGTERM")
            .expect("wait");
        assert!(status.success(), "dispatcher exit status {status}");
        let _ = tokio::time::timeout(Duration::from_secs(5), &mut self.reader).await;
        let log = self.log_text();
        let stopping = log
            .find("stop requested")
            .expect("the daemon logged its stop");
        let errors: Vec<&str> = log[stopping..]
            .lines()
            .filter(|l| l.contains(" ERROR "))
            .collect();
        assert!(
            errors.is_empty(),
            "errors logged while stopping: {errors:#?}"
        );
    }
}

/// Publishes purchases one by one, each confirmed by the broker.
pub async fn publish_confirmed(publisher: &codepool_broker::Publisher, purchases: &[Purchase]) {
    for p in purchases {
        publisher
            .publish_purchase(p)
            .await
            .expect("publish")
            .wait()
            .await
            .expect("confirm");
    }
}

/// Publishes one purchase, confirmed by the broker.
pub async fn publish_one(publisher: &codepool_broker::Publisher, purchase: &Purchase) {
    publish_confirmed(publisher, std::slice::from_ref(purchase)).await;
}

/// Publishes a raw purchase body, with `message_id` if any, confirmed.
pub async fn publish_bytes(
    publisher: &codepool_broker::Publisher,
    body: &[u8],
    message_id: Option<&str>,
) {
    let sent = publisher.publish_purchase_bytes(body, message_id).await;
    sent.expect("publish").wait().await.expect("confirm");
}

/// Publishes `body` to `exchange` under `routing_key`, confirmed.
pub async fn publish_to(
    publisher: &codepool_broker::Publisher,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    props: lapin::BasicProperties,
) {
    let sent = publisher.publish(exchange, routing_key, body, props).await;
    sent.expect("publish").wait().await.expect("confirm");
}

/// Publishes a pool event, confirmed.
pub async fn publish_pool_event(
    publisher: &codepool_broker::Publisher,
    event: &codepool_domain::PoolEvent,
) {
    let sent = publisher.publish_pool_event(event).await;
    sent.expect("publish").wait().await.expect("confirm");
}

/// Publishes `{"order_id": order}` as a `code.redeemed` event, with
/// `user_id` set or not, confirmed.
pub async fn publish_redeemed(
    publisher: &codepool_broker::Publisher,
    env: &TestEnv,
    order: &str,
    user: Option<&str>,
) {
    let mut props = lapin::BasicProperties::default();
    if let Some(u) = user {
        props = props.with_user_id(u.into());
    }
    let body = serde_json::json!({ "order_id": order }).to_string();
    publish_to(
        publisher,
        &env.topology().events_exchange,
        "code.redeemed",
        body.as_bytes(),
        props,
    )
    .await;
}

/// Publishes raw purchases with confirms in windows of 100, spread over
/// `over`, reconnecting (to any node of `env.amqp_url`) and re-sending a
/// window that was not confirmed: purchases are idempotent by order id, so
/// re-sending is safe. Returns how many times it reconnected.
pub async fn publish_with_retries(
    env: &TestEnv,
    bodies: Vec<(Vec<u8>, Option<String>)>,
    over: Duration,
) -> usize {
    let per_window = 100;
    let windows = bodies.len().div_ceil(per_window).max(1);
    let pause = over / windows as u32;
    let mut reconnects = 0;
    let mut conn: Option<lapin::Connection> = None;
    for window in bodies.chunks(per_window) {
        loop {
            let c = match &conn {
                Some(c) => c,
                None => match codepool_broker::connect(&env.amqp_url, "test-publisher").await {
                    Ok(c) => conn.insert(c),
                    Err(_) => {
                        tokio::time::sleep(Duration::from_millis(300)).await;
                        continue;
                    }
                },
            };
            if publish_window(c, env.topology(), window).await.is_ok() {
                break;
            }
            conn = None;
            reconnects += 1;
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        tokio::time::sleep(pause).await;
    }
    reconnects
}

async fn publish_window(
    conn: &lapin::Connection,
    topology: Topology,
    window: &[(Vec<u8>, Option<String>)],
) -> Result<(), codepool_broker::BrokerError> {
    let publisher = codepool_broker::Publisher::new(conn, topology)
        .await?
        .as_user("guest");
    let mut confirms = Vec::new();
    for (body, id) in window {
        confirms.push(
            publisher
                .publish_purchase_bytes(body, id.as_deref())
                .await?,
        );
    }
    for c in confirms {
        c.wait().await?;
    }
    publisher.close("window published").await;
    Ok(())
}

/// Purchases waiting right now (ready, not unacked) in every purchase
/// queue of `t` (the one queue, or all its partitions).
pub async fn purchases_depth(channel: &lapin::Channel, t: &Topology) -> u32 {
    let mut depth = 0;
    for q in t.purchase_queues() {
        depth += queue_depth(channel, &q).await;
    }
    depth
}

/// Messages in a queue right now (ready, not unacked).
pub async fn queue_depth(channel: &lapin::Channel, queue: &str) -> u32 {
    codepool_broker::queue_depth(channel, queue)
        .await
        .unwrap_or(0)
}

/// Waits up to `secs` seconds until the depth of `queue` is one `ok`
/// accepts.
pub async fn wait_depth(
    channel: &lapin::Channel,
    queue: &str,
    secs: u64,
    ok: impl Fn(u32) -> bool,
) {
    let start = Instant::now();
    loop {
        let depth = queue_depth(channel, queue).await;
        if ok(depth) {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(secs),
            "timed out after {secs} s waiting for the depth of {queue} (now {depth})"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What a passive declare of `queue` finds: its (messages, consumers), or
/// `None` when there is no such queue.
pub async fn queue_counts(conn: &lapin::Connection, queue: &str) -> Option<(u32, u32)> {
    let ch = conn.create_channel().await.expect("a channel");
    let passive = lapin::options::QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let found = ch.queue_declare(queue, passive, Default::default()).await;
    let _ = ch.close(200, "looked").await;
    found.ok().map(|q| (q.message_count(), q.consumer_count()))
}

/// A message taken off a queue.
pub struct Taken {
    pub body: Vec<u8>,
    pub reason: Option<String>,
    pub message_id: Option<String>,
}

/// Takes (and acks) every message in `queue`. What codepool publishes to
/// `sms.pending` and `purchases.refused` must match its schema in
/// `docs/schemas/`, in every test that drains those queues.
pub async fn drain(channel: &lapin::Channel, queue: &str) -> Vec<Taken> {
    let mut out = Vec::new();
    while let Ok(Some(msg)) = channel.basic_get(queue, BasicGetOptions::default()).await {
        let d = msg.delivery;
        let reason = codepool_broker::dead_letter_reason(&d.properties);
        let message_id = d.properties.message_id().as_ref().map(|s| s.to_string());
        let _ = d.acker.ack(BasicAckOptions::default()).await;
        out.push(Taken {
            body: d.data,
            reason,
            message_id,
        });
    }
    check_drained(queue, &out);
    out
}

/// Events codepool published (its event id as the message id), drained
/// from `sms.pending` or `purchases.refused`, match their schema in `docs/schemas/` (the full
/// checks are in `tests/suite/schemas.rs`).
fn check_drained(queue: &str, taken: &[Taken]) {
    static SCHEMAS: std::sync::OnceLock<Vec<(&str, jsonschema::Validator)>> =
        std::sync::OnceLock::new();
    let name = if queue.ends_with("sms.pending") {
        "sms-pending"
    } else if queue.ends_with("purchases.refused") {
        "purchase-refused"
    } else {
        return;
    };
    let schemas = SCHEMAS.get_or_init(|| {
        ["sms-pending", "purchase-refused"]
            .into_iter()
            .map(|name| {
                let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join(format!("../../docs/schemas/{name}.schema.json"));
                let text = std::fs::read_to_string(&path).expect("a schema of docs/schemas");
                let schema: serde_json::Value = serde_json::from_str(&text).expect("JSON");
                let validator = jsonschema::options()
                    .should_validate_formats(true)
                    .build(&schema)
                    .expect("the schema compiles");
                (name, validator)
            })
            .collect()
    });
    let Some((_, validator)) = schemas.iter().find(|(n, _)| *n == name) else {
        return;
    };
    // codepool's events carry their event_id as the message id; a test's
    // own filler messages carry none.
    let ours = |t: &&Taken| {
        t.message_id.as_deref().is_some_and(|id| {
            id.starts_with("sms:") || id.starts_with("refused:") || id.starts_with("sha256:")
        })
    };
    for t in taken.iter().filter(ours) {
        let body: serde_json::Value = serde_json::from_slice(&t.body)
            .unwrap_or_else(|e| panic!("{queue} holds a message that is not JSON ({e})"));
        let errors: Vec<String> = validator
            .iter_errors(&body)
            .map(|e| e.to_string())
            .collect();
        assert!(
            errors.is_empty(),
            "a message of {queue} breaks docs/schemas/{name}.schema.json: {errors:?}\n{body}"
        );
    }
}

/// Polls `check` until it returns true or `timeout` passes.
pub async fn eventually<F, Fut>(timeout: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        if check().await {
            return;
        }
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// A Redis server of this test's own, so a test can flush or stop it
/// without disturbing the others.
pub struct PrivateRedis {
    pub port: u16,
    child: Option<std::process::Child>,
}

impl PrivateRedis {
    pub async fn start() -> Self {
        let mut r = Self {
            port: free_port(),
            child: None,
        };
        r.restart().await;
        r
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub async fn restart(&mut self) {
        let child = std::process::Command::new("redis-server")
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server must be installed (make services installs it)");
        self.child = Some(child);
        let url = self.url();
        eventually(Duration::from_secs(10), "private redis to answer", || {
            let url = url.clone();
            async move {
                let Ok(client) = redis::Client::open(url.as_str()) else {
                    return false;
                };
                match client.get_multiplexed_async_connection().await {
                    Ok(mut c) => redis::cmd("PING")
                        .query_async::<String>(&mut c)
                        .await
                        .is_ok(),
                    Err(_) => false,
                }
            }
        })
        .await;
    }

    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub async fn flushall(&self) {
        let client = redis::Client::open(self.url().as_str()).expect("url");
        let mut c = client
            .get_multiplexed_async_connection()
            .await
            .expect("connect");
        let _: () = redis::cmd("FLUSHALL")
            .query_async(&mut c)
            .await
            .expect("flushall");
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A raw HTTP/1.0 GET: (status code, body). `None` if nothing answers.
pub async fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await
        .ok()?;
    let mut raw = String::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut raw))
        .await
        .ok()?
        .ok()?;
    let (head, body) = raw.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, body.to_owned()))
}

/// The sum of one counter over the daemons' `/metrics` pages.
pub async fn metric_sum(addrs: &[&str], line_prefix: &str) -> f64 {
    let mut sum = 0.0;
    for addr in addrs {
        let (_, page) = http_get(addr, "/metrics").await.expect("/metrics answers");
        sum += page
            .lines()
            .filter(|l| l.starts_with(line_prefix))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>();
    }
    sum
}

/// Line 0 of each order's codes, as `grants_for_orders` reads them: the
/// one code of an order of one.
pub trait Line0 {
    fn line0(self) -> std::collections::HashMap<String, codepool_domain::Code>;
}

impl Line0 for std::collections::HashMap<String, Vec<codepool_domain::Code>> {
    fn line0(self) -> std::collections::HashMap<String, codepool_domain::Code> {
        self.into_iter()
            .filter_map(|(order, codes)| Some((order, codes.into_iter().next()?)))
            .collect()
    }
}

/// Runs a `codepool` command in the test's namespace; panics unless it
/// exits 0. Returns its stdout.
pub async fn codepool_ok(env: &TestEnv, args: &[&str]) -> String {
    let out = env.command(args).output().await.expect("run codepool");
    assert!(
        out.status.success(),
        "codepool {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs `cmd`; panics unless it exits 0. Returns its output.
pub async fn output_ok(cmd: &mut tokio::process::Command) -> std::process::Output {
    let out = cmd.output().await.expect("run codepool");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Runs `cmd` with `input` on its standard input; its output.
pub async fn with_stdin(cmd: &mut tokio::process::Command, input: &[u8]) -> std::process::Output {
    let program = cmd.as_std().get_program().to_owned();
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{program:?} does not start: {e}"));
    let mut stdin = child.stdin.take().expect("stdin");
    stdin.write_all(input).await.expect("write to stdin");
    drop(stdin);
    child.wait_with_output().await.expect("wait")
}

/// The Python of the services venv (`make services` makes it, with the
/// packages the suite checks against) running `script` with `args`.
pub fn python(script: &str, args: &[&str]) -> tokio::process::Command {
    let python = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../.services/venv/bin/python"
    );
    let mut cmd = tokio::process::Command::new(python);
    cmd.arg("-c").arg(script).args(args);
    cmd
}

/// `rabbitmqctl ARGS` (`make services` installs it); panics unless it
/// exits 0. Returns its stdout.
pub async fn rabbitmqctl(args: &[&str]) -> String {
    let out = tokio::process::Command::new("rabbitmqctl")
        .args(args)
        .current_dir("/")
        .output()
        .await
        .expect("rabbitmqctl (make services installs it)");
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Purchases the dispatchers at `addrs` have settled so far: placed
/// (granted, backordered, refused or dead-lettered), their events
/// confirmed, and acked. Read from `codepool_end_to_end_seconds`, which a
/// batch records only after that.
pub async fn settled(addrs: &[&str]) -> u64 {
    metric_sum(addrs, "codepool_end_to_end_seconds_count").await as u64
}

/// Waits until the dispatchers at `addrs` have settled `n` purchases in
/// all: whatever they were going to do with them is done. A barrier for
/// a check that something did *not* happen to a purchase.
pub async fn wait_settled(addrs: &[&str], n: u64) {
    eventually(
        Duration::from_secs(60),
        &format!("{n} purchases settled"),
        || async { settled(addrs).await >= n },
    )
    .await;
}

/// The pool of [`pool_events_handled`]: after the test's own pools in
/// name order.
pub const BARRIER_POOL: &str = "zz-barrier";

/// A barrier behind pool events (`pool.replenished`, `pool.resumed`, which
/// a dispatcher reads from one queue per kind and handles one at a time,
/// each fulfilment finished before the next event is read). Publishes one
/// more event of `kind`, for a pool of its own with one purchase waiting
/// as a backorder and one code just added, and returns once that purchase
/// is granted: every event of that kind published before has been handled
/// by then, whatever the speed of the machine.
///
/// The backorder sweep (every 10 s) could serve it first, between the
/// code and the event: it goes through the pools with backorders in name
/// order, so it has then handled the test's pools first, the same way.
pub async fn pool_events_handled(
    env: &TestEnv,
    publisher: &codepool_broker::Publisher,
    kind: codepool_domain::PoolEventKind,
) {
    let order = format!("BARRIER-{}", suffix());
    env.store.ensure_pool(BARRIER_POOL).await.expect("pool");
    publish_confirmed(publisher, &[purchase(&order, BARRIER_POOL)]).await;
    let codes = env.store.database().collection::<bson::Document>("codes");
    let backorders = env
        .store
        .database()
        .collection::<bson::Document>("backorders");
    let waiting = bson::doc! {"order_id": &order, "status": "waiting"};
    eventually(
        Duration::from_secs(30),
        "the barrier's purchase waiting",
        || async {
            backorders
                .count_documents(waiting.clone())
                .await
                .unwrap_or(0)
                == 1
        },
    )
    .await;
    let code = NewCode {
        code: format!("{BARRIER_POOL}-{}", suffix()),
        line: None,
        expires_at: None,
    };
    (env.store)
        .insert_codes(BARRIER_POOL, ObjectId::new(), &[code])
        .await
        .expect("insert");
    let event = codepool_domain::PoolEvent::new(kind, BARRIER_POOL);
    publish_pool_event(publisher, &event).await;
    let granted = bson::doc! {"order_id": &order, "status": 1};
    eventually(
        Duration::from_secs(60),
        "the barrier's purchase granted",
        || async { codes.count_documents(granted.clone()).await.unwrap_or(0) == 1 },
    )
    .await;
}
