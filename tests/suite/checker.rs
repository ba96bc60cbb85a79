//! The checker: from a seed, a random mix of every feature, from both
//! granting doors at once (two API processes, two dispatchers), under
//! `kill -9`, on the real servers; then the invariants of DESIGN.md,
//! checked over everything the run did (in the spirit of Jepsen's
//! checkers and TigerBeetle's VOPR).
//!
//! The operations: HTTP orders (quantities, bundles, repeats), AMQP
//! purchases with and without a shop (some naming another shop's hold),
//! holds placed, paid (over either door), released and left to expire
//! (short TTLs), imports (some of codes that expire within seconds, some
//! killed mid-file and run again), recall, expire, pause and resume, void,
//! redeem and resend, by three keys of two shops and the operator; and a
//! fault task that `kill -9`s a dispatcher or an API process and starts
//! another.
//!
//! The invariants, over the whole history:
//! 1. no code is held by two orders, and no order has more codes than it
//!    asked for;
//! 2. no expired, recalled or voided code is granted after its move;
//! 3. every per-user limit holds (holds and both doors counted);
//! 4. no shop's order or hold holds a code outside its pools, and no hold
//!    is paid by another shop's order;
//! 5. every granted code has its `sms.pending` event (deduplicated by
//!    `event_id`), for its own order;
//! 6. every import balances: its codes are unissued, held, issued, used or
//!    void, as many as it received;
//! 7. every pool's statement (`codepool statement`) ties out.
//!
//! `CODEPOOL_CHECK_SEED` replays a seed's mix (`make check SEED=…`);
//! `CODEPOOL_CHECK_SECS` sets how long it runs (45 s in `make test`, ten
//! minutes in `make chaos`). A failure prints its seed. The mix a seed
//! makes is the same every time; how the servers interleave it is not
//! (they are real), so a seed replays the same operations, not the same
//! schedule.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bson::oid::ObjectId;
use bson::{doc, Document};
use codepool_broker::Publisher;
use codepool_domain::{Purchase, SmsPending};
use futures::StreamExt;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::api::ApiServer;
use crate::common::*;

/// The pools of the mix: one free for all, one with a per-user limit, one
/// of each shop.
const FREE: &str = "cp-free";
const LIMITED: &str = "cp-limited";
const ACME: &str = "cp-acme";
const BOLT: &str = "cp-bolt";
const PER_USER: u64 = 2;
const POOLS: [&str; 4] = [FREE, LIMITED, ACME, BOLT];
const UIDS: [&str; 4] = ["u0", "u1", "u2", "u3"];

/// Who orders: a key and the pools it may order from.
#[derive(Clone)]
struct Actor {
    key: String,
    shop: Option<&'static str>,
    pools: &'static [&'static str],
}

/// What the run did that the checks need.
#[derive(Default)]
struct History {
    /// Every order asked for: its codes wanted, buyer, and shop.
    orders: HashMap<String, (u32, String, Option<&'static str>)>,
    /// HTTP order bodies, to repeat, with their key.
    bodies: Vec<(String, Vec<u8>)>,
    /// Holds placed: id → (actor, uid, pool, quantity).
    holds: HashMap<String, (Actor, String, String, u32)>,
    /// AMQP orders, to wait for.
    amqp: Vec<String>,
    /// Imports recalled, with the moment the recall had returned.
    recalls: Vec<(ObjectId, bson::DateTime)>,
    /// Import runs that finished.
    imports: Vec<ObjectId>,
    paused: HashSet<&'static str>,
    /// Operations run, by kind.
    ran: HashMap<&'static str, u64>,
}

struct World {
    env: TestEnv,
    apis: Mutex<Vec<Option<ApiServer>>>,
    daemons: Mutex<Vec<Option<Daemon>>>,
    publisher: Publisher,
    actors: Vec<Actor>,
    history: Mutex<History>,
    files: tempfile::TempDir,
}

fn seed() -> u64 {
    std::env::var("CODEPOOL_CHECK_SEED")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or_else(rand::random)
}

fn secs() -> u64 {
    std::env::var("CODEPOOL_CHECK_SECS")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(45)
}

#[tokio::test]
async fn a_seeded_mix_of_every_feature_under_kills_keeps_every_invariant() {
    let seed = seed();
    let secs = secs();
    eprintln!("checker: seed {seed}, {secs} s (replay: make check SEED={seed})");
    let world = Arc::new(World::build(seed).await);
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut tasks = Vec::new();
    for w in 0..3u64 {
        let world = world.clone();
        tasks.push(tokio::spawn(async move {
            let mut rng = StdRng::seed_from_u64(seed.wrapping_add(w + 1));
            let mut n = 0u64;
            while Instant::now() < deadline {
                world.step(&mut rng, w, n).await;
                n += 1;
            }
        }));
    }
    let faults = {
        let world = world.clone();
        tokio::spawn(async move {
            let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
            while Instant::now() + Duration::from_secs(3) < deadline {
                tokio::time::sleep(Duration::from_millis(rng.random_range(2500..6000))).await;
                world.kill_one(&mut rng).await;
            }
        })
    };
    for t in tasks {
        t.await.expect("a worker panicked");
    }
    faults.await.expect("the fault task panicked");
    let violations = world.settle_and_check().await;
    let ran = {
        let h = world.history.lock().unwrap();
        let mut ran: Vec<_> = h.ran.iter().map(|(k, v)| format!("{k} {v}")).collect();
        ran.sort();
        ran.join(", ")
    };
    eprintln!("checker: seed {seed} ran: {ran}");
    // Nothing is left behind, pass or fail (CODEPOOL_CHECK_KEEP=1 keeps
    // the database of a failing seed to look at).
    let keep = !violations.is_empty() && std::env::var_os("CODEPOOL_CHECK_KEEP").is_some();
    let world = Arc::try_unwrap(world)
        .ok()
        .expect("the world is ours again");
    world.stop(keep).await;
    assert!(
        violations.is_empty(),
        "seed {seed} (replay: make check SEED={seed}) broke {} invariant(s):\n{}",
        violations.len(),
        violations.join("\n")
    );
}

impl World {
    async fn build(seed: u64) -> World {
        let env = TestEnv::new(&format!("checker_{}", seed % 100_000)).await;
        let files = tempfile::tempdir().unwrap();
        for p in POOLS {
            codepool_ok(&env, &["pool", "create", "--pool", p]).await;
            codepool_ok(&env, &["pool", "set", "--pool", p, "--hold-share", "50"]).await;
        }
        codepool_ok(
            &env,
            &[
                "pool",
                "set",
                "--pool",
                LIMITED,
                "--per-user",
                &PER_USER.to_string(),
            ],
        )
        .await;
        codepool_ok(
            &env,
            &[
                "shops",
                "create",
                "--name",
                "acme",
                "--pools",
                &format!("{FREE},{ACME}"),
                "--broker-users",
                "guest",
            ],
        )
        .await;
        codepool_ok(
            &env,
            &[
                "shops",
                "create",
                "--name",
                "bolt",
                "--pools",
                &format!("{FREE},{BOLT}"),
                "--broker-users",
                "guest",
            ],
        )
        .await;
        let key = |name: &'static str, shop: Option<&'static str>| {
            let env = &env;
            async move {
                let mut args = vec!["api-keys", "create", "--name", name];
                if let Some(s) = shop {
                    args.extend(["--shop", s]);
                }
                args.extend(["--scopes", "orders:write,orders:read"]);
                codepool_ok(env, &args).await.trim().to_owned()
            }
        };
        let actors = vec![
            Actor {
                key: key("operator", None).await,
                shop: None,
                pools: &[FREE, LIMITED, ACME, BOLT],
            },
            Actor {
                key: key("acme", Some("acme")).await,
                shop: Some("acme"),
                pools: &[FREE, ACME],
            },
            Actor {
                key: key("bolt", Some("bolt")).await,
                shop: Some("bolt"),
                pools: &[FREE, BOLT],
            },
        ];
        let mut apis = Vec::new();
        for _ in 0..2 {
            apis.push(Some(api(&env).await));
        }
        let mut daemons = Vec::new();
        for _ in 0..2 {
            daemons.push(Some(start_daemon(env.command(&[])).await));
        }
        let conn = codepool_broker::connect(AMQP_URL, "checker").await.unwrap();
        let publisher = Publisher::new(&conn, env.topology())
            .await
            .unwrap()
            .as_user("guest");
        let world = World {
            env,
            apis: Mutex::new(apis),
            daemons: Mutex::new(daemons),
            publisher,
            actors,
            history: Mutex::new(History::default()),
            files,
        };
        let mut rng = StdRng::seed_from_u64(seed);
        for p in POOLS {
            world.import(&mut rng, p, 40, false).await;
        }
        world
    }

    fn ran(&self, what: &'static str) {
        *self.history.lock().unwrap().ran.entry(what).or_default() += 1;
    }

    /// One operation, drawn from the seed.
    async fn step(&self, rng: &mut StdRng, worker: u64, n: u64) {
        let id = format!("C{worker}-{n}");
        match rng.random_range(0..100) {
            0..=21 => self.http_order(rng, &id).await,
            22..=25 => self.http_repeat(rng).await,
            26..=43 => self.amqp_purchase(rng, &id).await,
            44..=55 => self.hold(rng, &id).await,
            56..=65 => self.pay(rng, &id).await,
            66..=68 => self.release(rng).await,
            69..=73 => {
                let pool = POOLS[rng.random_range(0..POOLS.len())];
                let expiring = rng.random_bool(0.4);
                let n = rng.random_range(5..30);
                self.import(rng, pool, n, expiring).await
            }
            74 => self.interrupted_import(rng).await,
            75 => self.recall(rng).await,
            76..=79 => self.cli("expire", &["expire"]).await,
            80..=82 => self.pause_or_resume(rng).await,
            83..=87 => self.on_order(rng, "void").await,
            88..=93 => self.on_order(rng, "redeem").await,
            _ => self.on_order(rng, "resend").await,
        }
    }

    fn actor(&self, rng: &mut StdRng) -> Actor {
        self.actors[rng.random_range(0..self.actors.len())].clone()
    }

    fn api_addr(&self, rng: &mut StdRng) -> Option<String> {
        let apis = self.apis.lock().unwrap();
        let up: Vec<&ApiServer> = apis.iter().flatten().collect();
        if up.is_empty() {
            return None;
        }
        Some(up[rng.random_range(0..up.len())].addr.clone())
    }

    async fn post(&self, rng: &mut StdRng, key: &str, method: &str, path: &str, body: &[u8]) {
        if let Some(addr) = self.api_addr(rng) {
            let _ = try_http(&addr, method, path, key, body).await;
        }
    }

    async fn http_order(&self, rng: &mut StdRng, id: &str) {
        let a = self.actor(rng);
        let uid = UIDS[rng.random_range(0..UIDS.len())];
        let (body, wanted) = if rng.random_bool(0.15) && a.pools.len() > 1 {
            let items =
                json!([{"pool": a.pools[0], "quantity": 1}, {"pool": a.pools[1], "quantity": 1}]);
            (
                json!({"order_id": id, "uid": uid, "phone": "+8613800000000", "items": items}),
                2,
            )
        } else {
            let q = rng.random_range(1..=3);
            let pool = a.pools[rng.random_range(0..a.pools.len())];
            (
                json!({"order_id": id, "uid": uid, "phone": "+8613800000000", "pool": pool, "quantity": q}),
                q,
            )
        };
        let body = body.to_string().into_bytes();
        {
            let mut h = self.history.lock().unwrap();
            h.orders.insert(id.into(), (wanted, uid.into(), a.shop));
            h.bodies.push((a.key.clone(), body.clone()));
        }
        self.post(rng, &a.key, "POST", "/v1/orders", &body).await;
        self.ran("http order");
    }

    async fn http_repeat(&self, rng: &mut StdRng) {
        let again = {
            let h = self.history.lock().unwrap();
            (!h.bodies.is_empty()).then(|| h.bodies[rng.random_range(0..h.bodies.len())].clone())
        };
        if let Some((key, body)) = again {
            self.post(rng, &key, "POST", "/v1/orders", &body).await;
            self.ran("http repeat");
        }
    }

    async fn amqp_purchase(&self, rng: &mut StdRng, id: &str) {
        let a = self.actor(rng);
        let mut p = purchase(id, a.pools[rng.random_range(0..a.pools.len())]);
        p.uid = UIDS[rng.random_range(0..UIDS.len())].into();
        p.quantity = rng.random_range(1..=2);
        p.shop = a.shop.map(str::to_owned);
        self.publish(id, p, a.shop).await;
        self.ran("amqp purchase");
    }

    async fn publish(&self, id: &str, p: Purchase, shop: Option<&'static str>) {
        {
            let mut h = self.history.lock().unwrap();
            h.orders
                .insert(id.into(), (p.quantity, p.uid.clone(), shop));
            h.amqp.push(id.into());
        }
        publish_confirmed(&self.publisher, &[p]).await;
    }

    async fn hold(&self, rng: &mut StdRng, id: &str) {
        let a = self.actor(rng);
        let uid = UIDS[rng.random_range(0..UIDS.len())];
        let pool = a.pools[rng.random_range(0..a.pools.len())];
        let q = rng.random_range(1..=2);
        let hold_id = format!("H{id}");
        let body = json!({"hold_id": hold_id, "uid": uid, "items": [{"pool": pool, "quantity": q}],
                          "ttl_seconds": rng.random_range(1..=6)});
        self.history
            .lock()
            .unwrap()
            .holds
            .insert(hold_id, (a.clone(), uid.into(), pool.into(), q));
        self.post(
            rng,
            &a.key,
            "POST",
            "/v1/holds",
            body.to_string().as_bytes(),
        )
        .await;
        self.ran("hold");
    }

    /// Pays a hold, by HTTP or AMQP; now and then as the wrong shop.
    async fn pay(&self, rng: &mut StdRng, id: &str) {
        let picked = {
            let h = self.history.lock().unwrap();
            let mut ids: Vec<&String> = h.holds.keys().collect();
            ids.sort();
            (!ids.is_empty()).then(|| {
                let k = ids[rng.random_range(0..ids.len())].clone();
                (k.clone(), h.holds[&k].clone())
            })
        };
        let Some((hold_id, (a, uid, pool, q))) = picked else {
            return;
        };
        if rng.random_bool(0.5) {
            let body = json!({"order_id": id, "uid": uid, "phone": "+8613800000000", "pool": pool,
                              "quantity": q, "hold_id": hold_id});
            self.history
                .lock()
                .unwrap()
                .orders
                .insert(id.into(), (q, uid.clone(), a.shop));
            self.post(
                rng,
                &a.key,
                "POST",
                "/v1/orders",
                body.to_string().as_bytes(),
            )
            .await;
            self.ran("pay over http");
        } else {
            let shop = if rng.random_bool(0.2) {
                [None, Some("acme"), Some("bolt")][rng.random_range(0..3)]
            } else {
                a.shop
            };
            let mut p = purchase(id, &pool);
            p.uid = uid;
            p.quantity = q;
            p.shop = shop.map(str::to_owned);
            p.hold_id = Some(hold_id);
            self.publish(id, p, shop).await;
            self.ran("pay over amqp");
        }
    }

    async fn release(&self, rng: &mut StdRng) {
        let picked = {
            let h = self.history.lock().unwrap();
            let mut ids: Vec<&String> = h.holds.keys().collect();
            ids.sort();
            (!ids.is_empty()).then(|| {
                let k = ids[rng.random_range(0..ids.len())].clone();
                (k.clone(), h.holds[&k].0.key.clone())
            })
        };
        if let Some((hold_id, key)) = picked {
            self.post(rng, &key, "DELETE", &format!("/v1/holds/{hold_id}"), b"")
                .await;
            self.ran("release");
        }
    }

    /// A file of `n` new codes into `pool` (expiring within seconds, or
    /// not). Returns the run's id.
    async fn import(&self, rng: &mut StdRng, pool: &str, n: usize, expiring: bool) {
        let name = format!("{}.csv", ObjectId::new().to_hex());
        let path = self.files.path().join(name);
        let mut text = String::from(if expiring {
            "code,expires_at\n"
        } else {
            "code\n"
        });
        let soon = chrono::Utc::now() + chrono::Duration::seconds(rng.random_range(2..10));
        for _ in 0..n {
            let code = format!("{}-{:016X}", pool.to_uppercase(), rng.random::<u64>());
            if expiring {
                text.push_str(&format!("{code},{}\n", soon.to_rfc3339()));
            } else {
                text.push_str(&format!("{code}\n"));
            }
        }
        std::fs::write(&path, text).unwrap();
        let out = self
            .env
            .command(&["import", path.to_str().unwrap(), "--pool", pool, "--json"])
            .output()
            .await
            .unwrap();
        if let Ok(v) = serde_json::from_slice::<Value>(&out.stdout) {
            if let Some(id) = v["import_id"]
                .as_str()
                .and_then(|s| ObjectId::parse_str(s).ok())
            {
                self.history.lock().unwrap().imports.push(id);
            }
        }
        self.ran(if expiring {
            "import (expiring)"
        } else {
            "import"
        });
    }

    /// An import killed mid-file, then run again to the end.
    async fn interrupted_import(&self, rng: &mut StdRng) {
        let pool = POOLS[rng.random_range(0..POOLS.len())];
        let path = self
            .files
            .path()
            .join(format!("{}.csv", ObjectId::new().to_hex()));
        let mut text = String::from("code\n");
        for _ in 0..3000 {
            text.push_str(&format!(
                "{}-{:016X}\n",
                pool.to_uppercase(),
                rng.random::<u64>()
            ));
        }
        std::fs::write(&path, text).unwrap();
        let path = path.to_str().unwrap();
        let mut child = self
            .env
            .command(&["import", path, "--pool", pool])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        tokio::time::sleep(Duration::from_millis(rng.random_range(50..400))).await;
        let _ = child.start_kill();
        let _ = child.wait().await;
        let out = self
            .env
            .command(&["import", path, "--pool", pool, "--json"])
            .output()
            .await
            .unwrap();
        if let Ok(v) = serde_json::from_slice::<Value>(&out.stdout) {
            if let Some(id) = v["import_id"]
                .as_str()
                .and_then(|s| ObjectId::parse_str(s).ok())
            {
                self.history.lock().unwrap().imports.push(id);
            }
        }
        self.ran("import killed and resumed");
    }

    async fn recall(&self, rng: &mut StdRng) {
        let picked = {
            let h = self.history.lock().unwrap();
            (!h.imports.is_empty()).then(|| h.imports[rng.random_range(0..h.imports.len())])
        };
        let Some(batch) = picked else { return };
        let out = self
            .env
            .command(&["void", "--import", &batch.to_hex(), "--reason", "leak"])
            .output()
            .await
            .unwrap();
        if out.status.success() {
            let at = bson::DateTime::now();
            self.history.lock().unwrap().recalls.push((batch, at));
        }
        self.ran("recall");
    }

    async fn pause_or_resume(&self, rng: &mut StdRng) {
        let pool = POOLS[rng.random_range(0..POOLS.len())];
        let paused = self.history.lock().unwrap().paused.contains(pool);
        let verb = if paused { "resume" } else { "pause" };
        let out = (self.env.command(&["pool", verb, "--pool", pool]))
            .output()
            .await
            .unwrap();
        if out.status.success() {
            let mut h = self.history.lock().unwrap();
            if paused {
                h.paused.remove(pool);
            } else {
                h.paused.insert(pool);
            }
        }
        self.ran(if paused { "resume" } else { "pause" });
    }

    /// `codepool void|redeem|resend --order` of an order of the run.
    async fn on_order(&self, rng: &mut StdRng, verb: &'static str) {
        let picked = {
            let h = self.history.lock().unwrap();
            let mut ids: Vec<&String> = h.orders.keys().collect();
            ids.sort();
            (!ids.is_empty()).then(|| ids[rng.random_range(0..ids.len())].clone())
        };
        let Some(order) = picked else { return };
        let mut args = vec![verb, "--order", order.as_str()];
        if verb == "void" {
            args.extend(["--reason", "refund"]);
        }
        self.cli(verb, &args).await;
    }

    async fn cli(&self, what: &'static str, args: &[&str]) {
        let _ = self.env.command(args).output().await.unwrap();
        self.ran(what);
    }

    /// `kill -9` of one granting process; another starts in its place.
    async fn kill_one(&self, rng: &mut StdRng) {
        let which = rng.random_range(0..4);
        let pause = Duration::from_millis(rng.random_range(200..1500));
        if which < 2 {
            let killed = self.apis.lock().unwrap()[which].take();
            if let Some(mut a) = killed {
                let _ = a.child.start_kill();
                let _ = a.child.wait().await;
            }
            tokio::time::sleep(pause).await;
            let fresh = api(&self.env).await;
            self.apis.lock().unwrap()[which] = Some(fresh);
            self.ran("kill -9 api");
        } else {
            let killed = self.daemons.lock().unwrap()[which - 2].take();
            if let Some(mut d) = killed {
                let _ = d.child.start_kill();
                let _ = d.child.wait().await;
            }
            tokio::time::sleep(pause).await;
            let fresh = start_daemon(self.env.command(&[])).await;
            self.daemons.lock().unwrap()[which - 2] = Some(fresh);
            self.ran("kill -9 dispatcher");
        }
    }

    /// Stops every process (the suite's own tests check a graceful stop)
    /// and drops what the run made, unless `keep`.
    async fn stop(self, keep: bool) {
        for mut a in self.apis.into_inner().unwrap().into_iter().flatten() {
            let _ = a.child.start_kill();
            let _ = a.child.wait().await;
        }
        for mut d in self.daemons.into_inner().unwrap().into_iter().flatten() {
            let _ = d.child.start_kill();
            let _ = d.child.wait().await;
        }
        if keep {
            eprintln!("checker: kept database {}", self.env.db);
        } else {
            self.env.cleanup().await;
        }
    }

    fn codes(&self) -> mongodb::Collection<Document> {
        self.env.store.database().collection("codes")
    }

    async fn all(&self, coll: &str, filter: Document) -> Vec<Document> {
        let mut out = Vec::new();
        let mut cur = (self.env.store.database().collection::<Document>(coll))
            .find(filter)
            .await
            .unwrap();
        while let Some(d) = cur.next().await {
            out.push(d.unwrap());
        }
        out
    }

    /// Waits until every purchase is settled and every event is out, then
    /// checks the invariants over what the run left.
    async fn settle_and_check(&self) -> Vec<String> {
        let paused: Vec<&str> = self
            .history
            .lock()
            .unwrap()
            .paused
            .iter()
            .copied()
            .collect();
        for p in paused {
            codepool_ok(&self.env, &["pool", "resume", "--pool", p]).await;
        }
        let amqp: Vec<String> = self.history.lock().unwrap().amqp.clone();
        let conn = codepool_broker::connect(AMQP_URL, "checker-drain")
            .await
            .unwrap();
        let ch = conn.create_channel().await.unwrap();
        let t = self.env.topology();
        let mut dead: HashSet<String> = HashSet::new();
        let amqp = &amqp;
        let settled = |dead: HashSet<String>| async move {
            let mut open: HashSet<String> = amqp.iter().cloned().collect();
            for o in dead {
                open.remove(&o);
            }
            for (coll, field) in [
                ("codes", "order_id"),
                ("backorders", "order_id"),
                ("refusals", "_id"),
            ] {
                if open.is_empty() {
                    break;
                }
                let ids: Vec<&String> = open.iter().collect();
                let found = self.all(coll, doc! {field: {"$in": ids}}).await;
                for d in found {
                    if let Ok(o) = d.get_str(field) {
                        open.remove(o);
                    }
                }
            }
            open
        };
        let started = Instant::now();
        loop {
            for m in drain(&ch, &t.purchases_dead).await {
                if let Ok(p) = serde_json::from_slice::<Value>(&m.body) {
                    if let Some(o) = p["order_id"].as_str() {
                        dead.insert(o.to_owned());
                    }
                }
                if let Some(o) = m.message_id {
                    dead.insert(o);
                }
            }
            let open = settled(dead.clone()).await;
            if open.is_empty() {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(180),
                "purchases never settled: {:?}",
                open.iter().take(10).collect::<Vec<_>>()
            );
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        eventually(
            Duration::from_secs(180),
            "every granted code's event is out",
            || async {
                let owed = (self.env.store.database())
                    .collection::<Document>(codepool_store::codes::SMS_OWED);
                // A record the relay sent stays ten minutes, marked.
                let unsent = doc! {"relayed": {"$ne": true}};
                self.codes()
                    .count_documents(doc! {"sms_pending": true})
                    .await
                    .unwrap()
                    + owed.count_documents(unsent).await.unwrap()
                    == 0
            },
        )
        .await;
        let events = drain(&ch, &t.sms_pending).await;
        let _ = conn.close(200, "bye").await;
        let granted = (self.codes())
            .count_documents(doc! {"status": {"$in": [1, 2]}})
            .await
            .unwrap();
        let committed = (self.env.store.database().collection::<Document>("holds"))
            .count_documents(doc! {"state": "committed"})
            .await
            .unwrap();
        eprintln!(
            "checker: checked {granted} codes issued or used, {} sms.pending events, {committed} holds paid",
            events.len()
        );
        let mut v = Vec::new();
        self.check_codes(&events, &mut v).await;
        self.check_imports(&mut v).await;
        self.check_statements(&mut v).await;
        self.check_holds(&mut v).await;
        v
    }

    /// 7: every pool's statement ties out, as the operator's command
    /// checks it (exit 0), whatever the mix did to its codes.
    async fn check_statements(&self, v: &mut Vec<String>) {
        for pool in POOLS {
            let out = (self.env.command(&["statement", "--pool", pool, "--json"]))
                .output()
                .await
                .unwrap();
            match out.status.code() {
                Some(0) => {}
                // A pool the mix never filled has no record yet.
                Some(1) if String::from_utf8_lossy(&out.stderr).contains("does not exist") => {}
                code => v.push(format!(
                    "7: the statement of pool {pool} exits {code:?}: {}",
                    String::from_utf8_lossy(&out.stderr)
                )),
            }
        }
    }

    async fn check_codes(&self, events: &[Taken], v: &mut Vec<String>) {
        let (orders, recalls) = {
            let h = self.history.lock().unwrap();
            (h.orders.clone(), h.recalls.clone())
        };
        // The events: code → orders it was sent for.
        let mut sent: HashMap<String, HashSet<String>> = HashMap::new();
        let mut seen_ids = HashSet::new();
        for e in events {
            let ev: SmsPending = serde_json::from_slice(&e.body).expect("an sms.pending event");
            if !seen_ids.insert(ev.event_id.clone()) {
                continue;
            }
            let codes = ev
                .code
                .iter()
                .cloned()
                .chain(ev.codes.iter().map(|c| c.code.clone()));
            for c in codes {
                sent.entry(c).or_default().insert(ev.order_id.clone());
            }
        }
        for (code, to) in &sent {
            if to.len() > 1 {
                v.push(format!(
                    "1: code {} was sent for orders {to:?}",
                    codepool_domain::mask(code)
                ));
            }
        }
        let docs = self
            .all("codes", doc! {"issued_at": {"$exists": true}})
            .await;
        let mut per_order: HashMap<String, u32> = HashMap::new();
        let mut per_user: HashMap<String, u64> = HashMap::new();
        let shop_pools = |s: &str| match s {
            "acme" => vec![FREE, ACME],
            _ => vec![FREE, BOLT],
        };
        for d in &docs {
            let order = d.get_str("order_id").unwrap_or_default().to_owned();
            if order.starts_with('\u{1}') {
                continue; // held by a hold or a bundle, not an order's
            }
            let status = d.get_i32("status").unwrap_or(-1);
            let pool = d.get_str("pool").unwrap_or_default();
            let issued = d.get_datetime("issued_at").ok().copied();
            *per_order.entry(order.clone()).or_default() += 1;
            if pool == LIMITED {
                let uid = d.get_str("uid").unwrap_or_default().to_owned();
                *per_user.entry(uid).or_default() += 1;
            }
            if let (Some(exp), Some(at)) = (d.get_datetime("expires_at").ok(), issued) {
                if at >= *exp {
                    v.push(format!(
                        "2: order {order} got a code at {at} that expired at {exp}"
                    ));
                }
            }
            if let (Ok(batch), Some(at)) = (d.get_object_id("batch_id"), issued) {
                for (b, recalled) in &recalls {
                    if *b == batch && at > *recalled {
                        v.push(format!("2: order {order} got a code of import {b} at {at}, after its recall at {recalled}"));
                    }
                }
            }
            if let Some(owner) = d
                .get_str("owner")
                .ok()
                .and_then(|o| o.strip_prefix("shop:"))
            {
                if !shop_pools(owner).contains(&pool) {
                    v.push(format!(
                        "4: shop {owner}'s order {order} holds a code of pool {pool}"
                    ));
                }
                if let Some((_, _, Some(s))) = orders.get(&order) {
                    if *s != owner {
                        v.push(format!(
                            "4: order {order} of shop {s} is recorded as shop {owner}'s"
                        ));
                    }
                }
            }
            if matches!(status, 1 | 2) {
                let plain = self.env.plain_code(d);
                match sent.get(&plain) {
                    Some(to) if to.contains(&order) => {}
                    _ => v.push(format!(
                        "5: order {order}'s code {} has no sms.pending event",
                        codepool_domain::mask(&plain)
                    )),
                }
            }
        }
        for (order, n) in per_order {
            match orders.get(&order) {
                Some((wanted, _, _)) if n > *wanted => v.push(format!(
                    "1: order {order} holds {n} codes, asked for {wanted}"
                )),
                None => v.push(format!(
                    "1: codes were issued to {order:?}, which no one ordered"
                )),
                _ => {}
            }
        }
        for (uid, n) in per_user {
            if n > PER_USER {
                v.push(format!(
                    "3: buyer {uid} got {n} codes of {LIMITED}, over its limit of {PER_USER}"
                ));
            }
        }
    }

    async fn check_imports(&self, v: &mut Vec<String>) {
        let runs = self.all("imports", doc! {"status": "done"}).await;
        for r in runs {
            let Ok(id) = r.get_object_id("_id") else {
                continue;
            };
            let received = r
                .get_i64("inserted")
                .map(|n| n as u64)
                .or_else(|_| r.get_i32("inserted").map(|n| n as u64))
                .unwrap_or(0);
            let mut by_status = [0u64; 5];
            let mut other = 0;
            for d in self.all("codes", doc! {"batch_id": id}).await {
                match d.get_i32("status") {
                    Ok(s @ 0..=4) => by_status[s as usize] += 1,
                    _ => other += 1,
                }
            }
            let total: u64 = by_status.iter().sum();
            if other > 0 || total != received {
                v.push(format!("6: import {id} received {received} but holds unissued {} + held {} + issued {} + used {} + void {} (+{other} unknown)",
                    by_status[0], by_status[4], by_status[1], by_status[2], by_status[3]));
            }
        }
    }

    async fn check_holds(&self, v: &mut Vec<String>) {
        for h in self
            .all(
                "holds",
                doc! {"state": "committed", "bundle": {"$ne": true}},
            )
            .await
        {
            let (Ok(id), Ok(order)) = (h.get_str("_id"), h.get_str("order_id")) else {
                continue;
            };
            let owner = h.get_str("owner").ok();
            for c in self.all("codes", doc! {"order_id": order}).await {
                let payer = c.get_str("owner").ok();
                if owner.is_some_and(|o| o.starts_with("shop:")) && payer != owner {
                    v.push(format!(
                        "4: hold {id} of {owner:?} was paid by order {order} of {payer:?}"
                    ));
                }
            }
        }
    }
}

async fn api(env: &TestEnv) -> ApiServer {
    ApiServer::start(env, &["--rate-per-key", "1000000"]).await
}

/// One HTTP exchange that tolerates a server that is down or dies: the
/// status and body, or `None`.
async fn try_http(
    addr: &str,
    method: &str,
    path: &str,
    key: &str,
    body: &[u8],
) -> Option<(u16, Vec<u8>)> {
    let go = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\nAuthorization: Bearer {key}\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).await.ok()?;
        s.write_all(body).await.ok()?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).await.ok()?;
        let split = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
        let status = String::from_utf8_lossy(&raw[..split])
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()?;
        Some((status, raw[split + 4..].to_vec()))
    };
    tokio::time::timeout(Duration::from_secs(20), go)
        .await
        .ok()
        .flatten()
}
