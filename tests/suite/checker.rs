//! The checker: from a seed, a random mix of every feature, from every
//! door at once (two API processes and their console, two dispatchers,
//! the CLI), under `kill -9`, on the real servers; then the invariants of
//! DESIGN.md, checked over everything the run did (in the spirit of
//! Jepsen's checkers and TigerBeetle's VOPR).
//!
//! The operations: HTTP orders (quantities, bundles, repeats), AMQP
//! purchases with and without a shop (some naming another shop's hold),
//! holds placed, paid (over either door), released and left to expire
//! (short TTLs), imports (some of codes that expire within seconds or
//! expired before they came, the first of every pool among them, some with
//! copies and look-alikes of codes already in a pool, some killed mid-file
//! and run again, some of one file into two pools at once), recall, expire,
//! pause and resume, void, redeem and resend, by three keys of two shops
//! and the operator; replacement of one code of an order over HTTP, the CLI
//! (some killed between the void and the claim, then run again with the
//! same id) and the console; generation of codes (`codepool generate`, some
//! killed mid-run and resumed by run id, the API's and the console's runs,
//! whose process the fault task may kill); check and redemption by code
//! over HTTP (three platform keys, fresh and reused redemption ids, codes
//! sold, never sold and unknown, typed as a buyer types them), redemption
//! over AMQP (by code and by order), by the order's route and by the CLI;
//! statements (CLI, API and the console's page, some cut by channel); the
//! console's void, resend, pause, resume and recall; the marketplaces,
//! selling shop acme's pools through its channels as each contract says
//! (retried after no answer as each marketplace retries): Eneba's RESERVE,
//! PROVIDE (of orders provided before too, some delivered twice at once)
//! and CANCEL (before and after PROVIDE), G2A's reservation, order (again,
//! some under another G2A order id), release, and return by the item id
//! of an earlier read, with tokens that run out mid-run, Kinguin's BUYING,
//! BOUGHT (twice at once, some with no BUYING before) and CANCELED, with a
//! simulated Kinguin taking the uploads (some answered "being
//! proceeded"), and reservations run past their time; and a fault task
//! that `kill -9`s a dispatcher or an API process and starts another.
//! Marketplace orders are voided, redeemed and resent like any other;
//! only the shop's replacements leave them alone.
//!
//! The invariants, over the whole history:
//! 1. no code is held by two orders, and no order has more codes than it
//!    asked for, even when two different orders race under one id in two
//!    pools; no code was given to two orders, by events or by marketplace
//!    answers and uploads;
//! 2. no expired, recalled or voided code is granted after its move;
//! 3. every per-user limit holds (holds and both doors counted);
//! 4. no shop's order or hold (a channel's included) holds a code outside
//!    its pools, and no hold is paid by another's order;
//! 5. every granted code has its `sms.pending` event (deduplicated by
//!    `event_id`), for its own order; a marketplace's sale has none;
//! 6. every import balances: its codes are unissued, held, issued, used or
//!    void, as many as it received;
//! 7. every statement ties out, whenever it is read, by every door, and
//!    so does each channel's cut, counting the codes the channel sold;
//! 8. a replaced code is void and never given again (to any order), and
//!    one replacement id gives one new code;
//! 9. a code is redeemed at most once, across doors: every answer that
//!    says so names the one redemption the code records;
//! 10. no two codes read the same: no two code documents hold the same
//!     folded code in any pools (look-alikes included), and a generated
//!     code collides with nothing;
//! 11. a code never sold (in stock, held, or voided before a sale) and a
//!     code of a pool the key may not see answer check and redeem like a
//!     code that does not exist, and are never used;
//! 12. every generation run, killed or not, ends with exactly its count;
//! 13. a retried provision gets the same keys: every Eneba PROVIDE of an
//!     order the same bytes, every G2A order answer the same items (and
//!     every inventory read some of them, under the same ids), every
//!     upload of a Kinguin reservation the same key, each its order's;
//! 14. no hold outlives its cancellation or its time: a marketplace order
//!     whose cancellation was answered holds nothing, no hold past its
//!     time still holds once the sweeps ran, no code is held for a hold
//!     that ended.
//!
//! The run prints how many of each operation ran, and how each ended.
//! `CODEPOOL_CHECK_SEED` replays a seed's mix (`make check SEED=…`);
//! `CODEPOOL_CHECK_SECS` sets how long it runs (45 s in `make test`, ten
//! minutes in `make chaos`). A failure prints its seed. The mix a seed
//! makes is the same every time; how the servers interleave it is not
//! (they are real), so a seed replays the same operations, not the same
//! schedule.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bson::oid::ObjectId;
use bson::{doc, Document};
use codepool_broker::Publisher;
use codepool_domain::purchase::channel_of;
use codepool_domain::{LookAlikeRule, Purchase, SmsPending};
use futures::StreamExt;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use tokio::io::AsyncWriteExt;

use crate::api::ApiServer;
use crate::common::*;
use crate::fixtures::raw_http;
use crate::marketplaces::*;
use crate::sharding::HARNESS;

/// The pools of the mix: one free for all, one with a per-user limit, one
/// of each shop, and one of generated codes with check symbols that
/// folds `O`/`0` and `I`/`L`/`1`.
const FREE: &str = "cp-free";
const LIMITED: &str = "cp-limited";
const ACME: &str = "cp-acme";
const BOLT: &str = "cp-bolt";
const GEN: &str = "cp-gen";
const PER_USER: u64 = 2;
/// The pools files are imported into.
const POOLS: [&str; 4] = [FREE, LIMITED, ACME, BOLT];
const ALL_POOLS: [&str; 5] = [FREE, LIMITED, ACME, BOLT, GEN];
const UIDS: [&str; 4] = ["u0", "u1", "u2", "u3"];
/// The platforms that check and redeem codes: of no shop, and of each.
const PLATFORMS: [Option<&str>; 3] = [None, Some("acme"), Some("bolt")];
/// The marketplace channels of shop acme: Eneba's two auctions (of its own
/// pool and of the shared one), G2A's product (its own pool) and
/// Kinguin's offer (the shared pool). Each channel's kind, by name.
const AUCTION_FREE: &str = "3b9e0c7a-1f42-4d6e-8a1b-5c2d7e9f0a13";
const CHANNELS: [(&str, &str); 3] = [("en", "eneba"), ("g2", "g2a"), ("kg", "kinguin")];
/// The shop whose channels they are.
const CHANNEL_SHOP: &str = "acme";
/// The console's operator.
const OPERATOR: &str = "checker";
const PASSWORD: &str = "the checker's long password";

fn shop_pools(shop: &str) -> &'static [&'static str] {
    match shop {
        "acme" => &[FREE, ACME],
        _ => &[FREE, BOLT],
    }
}

/// The pattern of the codes generated into `pool`, and whether they end
/// with a check symbol (only the pool of generated codes: a run without
/// them would end its promise).
fn pattern_of(pool: &str) -> (&'static str, bool) {
    match pool {
        GEN => ("GN-{random:4}-{random:4}-{random:4}", true),
        FREE => ("FR-{random:12}", false),
        LIMITED => ("LT-{random:12}", false),
        ACME => ("AC-{random:12}", false),
        _ => ("BT-{random:12}", false),
    }
}

/// When the codes of an imported file expire.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Expiry {
    Never,
    /// Within seconds.
    Soon,
    /// An hour ago.
    Gone,
}

/// Who orders: a key and the pools it may order from.
#[derive(Clone)]
struct Actor {
    key: String,
    shop: Option<&'static str>,
    pools: &'static [&'static str],
}

/// One check or redemption by code over HTTP, and its answer.
#[derive(Clone)]
struct Lookup {
    /// Which of [`PLATFORMS`] asked.
    platform: usize,
    /// The code document meant, or `None` for a code no pool holds.
    doc: Option<ObjectId>,
    redeem: bool,
    rid: Option<String>,
    /// Status and JSON, or `None` when no answer came (a killed process).
    answer: Option<(u16, Value)>,
}

/// A code picked to look up: a document's, as a buyer might type it.
#[derive(Clone)]
struct Picked {
    doc: Option<ObjectId>,
    pool: String,
    typed: String,
}

/// What the run did that the checks need.
#[derive(Default)]
struct History {
    /// Every order asked for: its codes wanted, buyer, and shop.
    orders: HashMap<String, (u32, String, Option<&'static str>)>,
    /// Who placed each order: an actor's index, `None` for the operator's
    /// AMQP purchases.
    placed_by: HashMap<String, Option<usize>>,
    /// HTTP order bodies, to repeat, with their key.
    bodies: Vec<(String, Vec<u8>)>,
    /// Holds placed: id → (actor, uid, pool, quantity).
    holds: HashMap<String, (Actor, String, String, u32)>,
    /// AMQP orders, to wait for.
    amqp: Vec<String>,
    /// Imports recalled, with the moment the recall had returned.
    recalls: Vec<(ObjectId, bson::DateTime)>,
    /// Import and generation runs (to recall).
    imports: Vec<ObjectId>,
    /// Codes written into import files, by pool (to copy into others).
    imported: Vec<(&'static str, String)>,
    paused: HashSet<&'static str>,
    /// Replacement ids asked for: id, order, line, reason.
    rids: Vec<(String, String, u32, String)>,
    /// The new grant number each answer of a replacement named.
    replaced: Vec<(String, String)>,
    /// Every check and redemption by code over HTTP.
    lookups: Vec<Lookup>,
    /// Redemption ids sent, with their platform and code (to send again).
    redemptions: Vec<(usize, String, Picked)>,
    /// Generation runs killed mid-run.
    killed_runs: HashSet<ObjectId>,
    /// Marketplace orders, by the channel order id each becomes
    /// (`eneba:en:ID`, `g2a:g2:RESERVATION`, `kinguin:kg:RESERVATION`),
    /// recorded once the marketplace's reservation was answered (or went
    /// unanswered).
    deals: BTreeMap<String, Deal>,
    /// Every answer that gave a channel order keys, as answered.
    provisions: HashMap<String, Vec<Provision>>,
    /// Channel orders whose cancellation (or release) was answered done.
    cancelled: HashSet<String>,
    /// What broke while the run went on (a statement that did not tie out).
    found: Vec<String>,
    /// Operations run, by kind: how many ended each way.
    ran: HashMap<&'static str, BTreeMap<String, u64>>,
}

/// A marketplace order of the run.
#[derive(Clone)]
struct Deal {
    /// Its channel's name ([`CHANNELS`]).
    channel: &'static str,
    /// The marketplace's id of it (Eneba's `orderId`, G2A's
    /// `reservation_id`, Kinguin's `reservationId`).
    external: String,
    keys: u32,
    /// G2A's order id for it.
    g2a_order: u64,
    /// Its reservation was answered as held.
    held: bool,
}

/// Keys a channel order was given in one answer.
#[derive(Clone)]
enum Provision {
    /// A PROVIDE's whole body (its keys must be the same bytes each time).
    Eneba(Vec<u8>),
    /// A G2A order's items, id and key.
    G2aOrder(Vec<(String, String)>),
    /// A G2A inventory read's items.
    G2aRead(Vec<(String, String)>),
}

impl Provision {
    fn kind(&self) -> &'static str {
        match self {
            Self::Eneba(_) => "a PROVIDE's answer",
            Self::G2aOrder(_) => "a G2A order's answer",
            Self::G2aRead(_) => "a G2A inventory read",
        }
    }

    fn keys(&self) -> Vec<String> {
        match self {
            Self::Eneba(b) => keys_of(b),
            Self::G2aOrder(items) | Self::G2aRead(items) => {
                items.iter().map(|(_, k)| k.clone()).collect()
            }
        }
    }
}

struct World {
    env: TestEnv,
    /// Kinguin's API, which the channel `kg` uploads keys to.
    kinguin: Kinguin,
    /// G2A's access token to channel `g2` (it lives 15 s: G2A fetches
    /// another when one is refused).
    g2a_token: Mutex<Option<String>>,
    apis: Mutex<Vec<Option<ApiServer>>>,
    daemons: Mutex<Vec<Option<Daemon>>>,
    publisher: Publisher,
    actors: Vec<Actor>,
    /// Keys of [`PLATFORMS`] (scope `codes:redeem`).
    platforms: Vec<String>,
    /// A key of no shop with `admin` (and orders): replaces any order's
    /// code, reads statements, starts generations.
    admin: String,
    /// The answer each platform gets for a code no pool holds, request id
    /// taken out.
    unknown: Vec<Value>,
    /// The console's session cookie and CSRF token.
    console: (String, String),
    /// Generation runs resumed by id after a kill, still running.
    resumes: Mutex<Vec<(ObjectId, tokio::process::Child)>>,
    /// When the mix ends.
    ends: Mutex<Option<Instant>>,
    history: Mutex<History>,
    files: tempfile::TempDir,
}

pub(crate) fn seed() -> u64 {
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
    let (violations, _) = run_mix(seed, secs(), false).await;
    assert!(
        violations.is_empty(),
        "seed {seed} (replay: make check SEED={seed}) broke {} invariant(s):\n{}",
        violations.len(),
        violations.join("\n")
    );
}

/// Runs the seeded mix for `secs` and checks it: returns the broken
/// invariants and, when `profiled`, the untargeted writes MongoDB's
/// profiler saw on sharded collections during the whole run
/// ([`crate::sharding`]).
pub(crate) async fn run_mix(seed: u64, secs: u64, profiled: bool) -> (Vec<String>, Vec<String>) {
    eprintln!("checker: seed {seed}, {secs} s (replay: make check SEED={seed})");
    let built = Instant::now();
    let world = Arc::new(World::build(seed, profiled).await);
    eprintln!(
        "checker: servers up and pools filled in {:.1} s",
        built.elapsed().as_secs_f64()
    );
    let deadline = Instant::now() + Duration::from_secs(secs);
    *world.ends.lock().unwrap() = Some(deadline);
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
    eprintln!("checker: seed {seed} ran:\n{}", world.report());
    let untargeted = if profiled {
        crate::sharding::untargeted_writes(&world.env).await
    } else {
        Vec::new()
    };
    // Nothing is left behind, pass or fail (CODEPOOL_CHECK_KEEP=1 keeps
    // the database of a failing seed to look at).
    let keep = !violations.is_empty() && std::env::var_os("CODEPOOL_CHECK_KEEP").is_some();
    let world = Arc::try_unwrap(world)
        .ok()
        .expect("the world is ours again");
    world.stop(keep).await;
    (violations, untargeted)
}

impl World {
    async fn build(seed: u64, profiled: bool) -> World {
        let env = TestEnv::new(&format!("checker_{}", seed % 100_000)).await;
        if profiled {
            crate::sharding::profile_writes(&env).await;
        }
        let files = tempfile::tempdir().unwrap();
        for p in ALL_POOLS {
            codepool_ok(&env, &["pool", "create", "--pool", p]).await;
            codepool_ok(&env, &["pool", "set", "--pool", p, "--hold-share", "50"]).await;
        }
        // Fixed before the pool's first code.
        codepool_ok(&env, &["pool", "set", "--pool", GEN, "--fold-confusables"]).await;
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
        let key = |name: &'static str, shop: Option<&'static str>, scopes: &'static str| {
            let env = &env;
            async move {
                let mut args = vec!["api-keys", "create", "--name", name];
                if let Some(s) = shop {
                    args.extend(["--shop", s]);
                }
                args.extend(["--scopes", scopes]);
                codepool_ok(env, &args).await.trim().to_owned()
            }
        };
        const ORDERS: &str = "orders:write,orders:read";
        let actors = vec![
            Actor {
                key: key("operator", None, ORDERS).await,
                shop: None,
                pools: &ALL_POOLS,
            },
            Actor {
                key: key("acme", Some("acme"), ORDERS).await,
                shop: Some("acme"),
                pools: &[FREE, ACME],
            },
            Actor {
                key: key("bolt", Some("bolt"), ORDERS).await,
                shop: Some("bolt"),
                pools: &[FREE, BOLT],
            },
        ];
        let platforms = vec![
            key("platform", None, "codes:redeem").await,
            key("acme-platform", Some("acme"), "codes:redeem").await,
            key("bolt-platform", Some("bolt"), "codes:redeem").await,
        ];
        let admin = key("support", None, "orders:write,orders:read,admin").await;
        operator(&env).await;
        // Shop acme sells on the marketplaces too; their reservations hold
        // for a minute (the least a channel allows), G2A's tokens live 15 s.
        let ttl = ["--hold-ttl", "60"];
        add_channel(
            &env,
            "en",
            "eneba",
            CHANNEL_SHOP,
            json!({"token": ENEBA_TOKEN}),
            &ttl,
        )
        .await;
        map(&env, "en", AUCTION, ACME).await;
        map(&env, "en", AUCTION_FREE, FREE).await;
        let g2a = json!({"client_id": G2A_ID, "client_secret": G2A_SECRET});
        let g2a_flags = ["--hold-ttl", "60", "--token-ttl", "15"];
        add_channel(&env, "g2", "g2a", CHANNEL_SHOP, g2a, &g2a_flags).await;
        map(&env, "g2", PRODUCT, ACME).await;
        let kinguin = Kinguin::start(KgFaults {
            busy: 3,
            ..KgFaults::default()
        })
        .await;
        let kg = kinguin_credentials(&kinguin);
        add_channel(&env, "kg", "kinguin", CHANNEL_SHOP, kg, &ttl).await;
        map(&env, "kg", OFFER, FREE).await;
        let mut apis = Vec::new();
        for _ in 0..2 {
            apis.push(Some(api(&env).await));
        }
        let mut daemons = Vec::new();
        for _ in 0..2 {
            daemons.push(Some(start_daemon(env.command(&[])).await));
        }
        let first = apis[0].as_ref().unwrap().addr.clone();
        let console = sign_in(&first).await;
        let mut unknown = Vec::new();
        for k in &platforms {
            let body = json!({"code": "CP-NOWHERE-0000"}).to_string();
            let (status, answer) = try_http(&first, "POST", "/v1/codes/check", k, body.as_bytes())
                .await
                .expect("the API answers");
            assert_eq!(status, 404, "{}", String::from_utf8_lossy(&answer));
            unknown.push(said(&json_or_null(&answer)));
        }
        let conn = codepool_broker::connect(AMQP_URL, "checker").await.unwrap();
        let publisher = Publisher::new(&conn, env.topology())
            .await
            .unwrap()
            .as_user("guest");
        let world = World {
            env,
            kinguin,
            g2a_token: Mutex::new(None),
            apis: Mutex::new(apis),
            daemons: Mutex::new(daemons),
            publisher,
            actors,
            platforms,
            admin,
            unknown,
            console,
            resumes: Mutex::new(Vec::new()),
            ends: Mutex::new(None),
            history: Mutex::new(History::default()),
            files,
        };
        let mut rng = StdRng::seed_from_u64(seed);
        // Codes that expired before they came come first: no door may give
        // them, whichever code it takes first.
        for p in POOLS {
            world.import(&mut rng, p, 5, Expiry::Gone, false).await;
            world.import(&mut rng, p, 40, Expiry::Never, false).await;
        }
        world.generate_cli(GEN, 40).await;
        world
    }

    fn ran(&self, what: &'static str, outcome: impl Into<String>) {
        let mut h = self.history.lock().unwrap();
        *h.ran
            .entry(what)
            .or_default()
            .entry(outcome.into())
            .or_default() += 1;
    }

    /// One line per operation: how many ran, and how they ended.
    fn report(&self) -> String {
        let h = self.history.lock().unwrap();
        let mut rows: Vec<_> = h.ran.iter().collect();
        rows.sort_by_key(|(k, _)| **k);
        let total: u64 = rows.iter().flat_map(|(_, o)| o.values()).sum();
        let w = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0).max(9);
        let mut out = format!("  {:<w$} {:>6}  outcomes\n", "operation", "count");
        for (what, outcomes) in rows {
            let n: u64 = outcomes.values().sum();
            let ends: Vec<String> = outcomes.iter().map(|(o, k)| format!("{o}: {k}")).collect();
            out.push_str(&format!("  {what:<w$} {n:>6}  {}\n", ends.join(", ")));
        }
        out.push_str(&format!("  {:<w$} {total:>6}", "all"));
        out
    }

    /// One operation, drawn from the seed.
    async fn step(&self, rng: &mut StdRng, worker: u64, n: u64) {
        let id = format!("C{worker}-{n}");
        match rng.random_range(0..1200) {
            0..=139 => self.http_order(rng, &id).await,
            140..=149 => self.twin_orders(rng, &id).await,
            150..=174 => self.http_repeat(rng).await,
            175..=289 => self.amqp_purchase(rng, &id).await,
            290..=309 => self.replace_http(rng, &id).await,
            310..=389 => self.hold(rng, &id).await,
            390..=459 => self.pay(rng, &id).await,
            460..=479 => self.release(rng).await,
            480..=514 => {
                let pool = POOLS[rng.random_range(0..POOLS.len())];
                let expiry = match rng.random_range(0..10) {
                    0..=2 => Expiry::Soon,
                    3 => Expiry::Gone,
                    _ => Expiry::Never,
                };
                let copies = rng.random_bool(0.3);
                let n = rng.random_range(5..30);
                self.import(rng, pool, n, expiry, copies).await
            }
            515..=519 => self.racing_imports(rng).await,
            520..=527 => self.interrupted_import(rng).await,
            528..=535 => self.recall(rng).await,
            536..=559 => {
                let out = self.cli(&["expire"]).await;
                self.ran("expire (cli)", out);
            }
            560..=579 => self.pause_or_resume(rng).await,
            580..=604 => self.on_order(rng, "void").await,
            605..=624 => self.on_order(rng, "redeem").await,
            625..=644 => self.on_order(rng, "resend").await,
            645..=689 => self.replace_http(rng, &id).await,
            690..=704 => self.replace_cli(rng, &id).await,
            705..=711 => self.replace_cli_killed(rng, &id).await,
            712..=731 => self.replace_console(rng, &id).await,
            732..=746 => {
                let pool = ALL_POOLS[rng.random_range(0..ALL_POOLS.len())];
                let count = rng.random_range(5..40);
                self.generate_cli(pool, count).await
            }
            747..=752 => self.generate_killed(rng).await,
            753..=762 => self.generate_api(rng).await,
            763..=770 => self.generate_console(rng).await,
            771..=830 => self.check_http(rng).await,
            831..=890 => self.redeem_http(rng, &id).await,
            891..=910 => self.redeem_amqp_code(rng).await,
            911..=920 => self.redeem_amqp_order(rng).await,
            921..=930 => self.redeem_order_http(rng).await,
            931..=938 => self.redeem_cli_code(rng).await,
            939..=948 => self.statement_cli(rng).await,
            949..=958 => self.statement_api(rng).await,
            959..=964 => self.statement_console(rng).await,
            965..=974 => self.console_on_order(rng, "void").await,
            975..=982 => self.console_on_order(rng, "resend").await,
            983..=991 => self.console_pause_or_resume(rng).await,
            992..=999 => self.console_recall(rng).await,
            _ => self.marketplace(rng, &id).await,
        }
    }

    fn actor(&self, rng: &mut StdRng) -> (usize, Actor) {
        let i = rng.random_range(0..self.actors.len());
        (i, self.actors[i].clone())
    }

    fn api_addr(&self, rng: &mut StdRng) -> Option<String> {
        let apis = self.apis.lock().unwrap();
        let up: Vec<&ApiServer> = apis.iter().flatten().collect();
        if up.is_empty() {
            return None;
        }
        Some(up[rng.random_range(0..up.len())].addr.clone())
    }

    async fn post(
        &self,
        rng: &mut StdRng,
        key: &str,
        method: &str,
        path: &str,
        body: &[u8],
    ) -> Option<(u16, Vec<u8>)> {
        let addr = self.api_addr(rng)?;
        try_http(&addr, method, path, key, body).await
    }

    /// A random order of the run, sorted first so that a seed picks the
    /// same one.
    fn pick_order(&self, rng: &mut StdRng) -> Option<String> {
        let h = self.history.lock().unwrap();
        let mut ids: Vec<&String> = h.orders.keys().collect();
        ids.sort();
        (!ids.is_empty()).then(|| ids[rng.random_range(0..ids.len())].clone())
    }

    /// The key to act on `order` with: mostly the one that placed it (or
    /// its shop's), now and then the support key (`admin`: any order) or
    /// another actor's (which must be told nothing).
    fn key_for(&self, rng: &mut StdRng, order: &str) -> String {
        let placed = self
            .history
            .lock()
            .unwrap()
            .placed_by
            .get(order)
            .copied()
            .flatten();
        match (placed, rng.random_range(0..10)) {
            (Some(i), 0..=6) => self.actors[i].key.clone(),
            (_, 7) => self.actors[rng.random_range(0..self.actors.len())]
                .key
                .clone(),
            _ => self.admin.clone(),
        }
    }

    async fn http_order(&self, rng: &mut StdRng, id: &str) {
        let (i, a) = self.actor(rng);
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
            h.placed_by.insert(id.into(), Some(i));
            h.bodies.push((a.key.clone(), body.clone()));
        }
        let answer = self.post(rng, &a.key, "POST", "/v1/orders", &body).await;
        self.ran("order (http)", status_of(&answer));
    }

    /// One order id sent as two different orders at the same moment, one
    /// over HTTP and one over AMQP, naming two pools of the shop: only the
    /// order-id guard keeps them apart once `codes` is sharded by pool.
    /// Invariant 1 sees an id that holds more than it asked.
    async fn twin_orders(&self, rng: &mut StdRng, id: &str) {
        let (i, a) = self.actor(rng);
        let uid = UIDS[rng.random_range(0..UIDS.len())];
        let q = rng.random_range(1..=2);
        let (http_pool, amqp_pool) = (a.pools[0], a.pools[a.pools.len() - 1]);
        let body = json!({"order_id": id, "uid": uid, "phone": "+8613800000000",
                          "pool": http_pool, "quantity": q});
        let mut p = purchase(id, amqp_pool);
        p.uid = uid.into();
        p.quantity = q;
        p.shop = a.shop.map(str::to_owned);
        {
            let mut h = self.history.lock().unwrap();
            h.orders.insert(id.into(), (q, uid.into(), a.shop));
            h.placed_by.insert(id.into(), Some(i));
            h.amqp.push(id.into());
        }
        let body = body.to_string().into_bytes();
        let (answer, ()) = tokio::join!(
            self.post(rng, &a.key, "POST", "/v1/orders", &body),
            publish_confirmed(&self.publisher, std::slice::from_ref(&p)),
        );
        self.ran("twin orders, two pools (http + amqp)", status_of(&answer));
    }

    async fn http_repeat(&self, rng: &mut StdRng) {
        let again = {
            let h = self.history.lock().unwrap();
            (!h.bodies.is_empty()).then(|| h.bodies[rng.random_range(0..h.bodies.len())].clone())
        };
        if let Some((key, body)) = again {
            let answer = self.post(rng, &key, "POST", "/v1/orders", &body).await;
            self.ran("order again (http)", status_of(&answer));
        }
    }

    async fn amqp_purchase(&self, rng: &mut StdRng, id: &str) {
        let (_, a) = self.actor(rng);
        let mut p = purchase(id, a.pools[rng.random_range(0..a.pools.len())]);
        p.uid = UIDS[rng.random_range(0..UIDS.len())].into();
        p.quantity = rng.random_range(1..=2);
        p.shop = a.shop.map(str::to_owned);
        self.publish(id, p, a.shop).await;
        self.ran("purchase (amqp)", "confirmed");
    }

    async fn publish(&self, id: &str, p: Purchase, shop: Option<&'static str>) {
        {
            let mut h = self.history.lock().unwrap();
            h.orders
                .insert(id.into(), (p.quantity, p.uid.clone(), shop));
            let by = shop.and_then(|s| self.actors.iter().position(|a| a.shop == Some(s)));
            h.placed_by.insert(id.into(), by);
            h.amqp.push(id.into());
        }
        publish_confirmed(&self.publisher, &[p]).await;
    }

    async fn hold(&self, rng: &mut StdRng, id: &str) {
        let (_, a) = self.actor(rng);
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
        let answer = self
            .post(
                rng,
                &a.key,
                "POST",
                "/v1/holds",
                body.to_string().as_bytes(),
            )
            .await;
        self.ran("hold (http)", status_of(&answer));
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
            {
                let mut h = self.history.lock().unwrap();
                h.orders.insert(id.into(), (q, uid.clone(), a.shop));
                let by = self.actors.iter().position(|x| x.key == a.key);
                h.placed_by.insert(id.into(), by);
            }
            let answer = self
                .post(
                    rng,
                    &a.key,
                    "POST",
                    "/v1/orders",
                    body.to_string().as_bytes(),
                )
                .await;
            self.ran("pay a hold (http)", status_of(&answer));
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
            self.ran("pay a hold (amqp)", "confirmed");
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
            let answer = self
                .post(rng, &key, "DELETE", &format!("/v1/holds/{hold_id}"), b"")
                .await;
            self.ran("release a hold (http)", status_of(&answer));
        }
    }

    /// A file of `n` new codes into `pool` (expiring within seconds,
    /// expired already, or not); with `copies`, also rows that must be
    /// refused: a code the pool holds, a look-alike of one (another case),
    /// and a code of another pool.
    async fn import(
        &self,
        rng: &mut StdRng,
        pool: &'static str,
        n: usize,
        expiry: Expiry,
        copies: bool,
    ) {
        let name = format!("{}.csv", ObjectId::new().to_hex());
        let path = self.files.path().join(name);
        let mut text = String::from(match expiry {
            Expiry::Never => "code\n",
            _ => "code,expires_at\n",
        });
        let at = match expiry {
            Expiry::Gone => chrono::Utc::now() - chrono::Duration::hours(1),
            _ => chrono::Utc::now() + chrono::Duration::seconds(rng.random_range(2..10)),
        };
        let mut new = Vec::new();
        for _ in 0..n {
            new.push(format!(
                "{}-{:016X}",
                pool.to_uppercase(),
                rng.random::<u64>()
            ));
        }
        let mut rows = new.clone();
        if copies {
            let h = self.history.lock().unwrap();
            for _ in 0..3 {
                if h.imported.is_empty() {
                    break;
                }
                let (p, c) = &h.imported[rng.random_range(0..h.imported.len())];
                rows.push(match (*p == pool, rng.random_bool(0.5)) {
                    (true, true) => c.to_lowercase(),
                    _ => c.clone(),
                });
            }
        }
        for code in &rows {
            match expiry {
                Expiry::Never => text.push_str(&format!("{code}\n")),
                _ => text.push_str(&format!("{code},{}\n", at.to_rfc3339())),
            }
        }
        std::fs::write(&path, text).unwrap();
        let out = self
            .env
            .command(&["import", path.to_str().unwrap(), "--pool", pool, "--json"])
            .output()
            .await
            .unwrap();
        self.imported(&out);
        {
            let mut h = self.history.lock().unwrap();
            h.imported.extend(new.into_iter().map(|c| (pool, c)));
        }
        let what = match (expiry, copies) {
            (_, true) => "import with copies (cli)",
            (Expiry::Soon, _) => "import expiring (cli)",
            (Expiry::Gone, _) => "import expired (cli)",
            _ => "import (cli)",
        };
        self.ran(what, exit_of(&out));
    }

    /// Records the run of an import's JSON summary.
    fn imported(&self, out: &std::process::Output) {
        if let Ok(v) = serde_json::from_slice::<Value>(&out.stdout) {
            if let Some(id) = v["import_id"]
                .as_str()
                .and_then(|s| ObjectId::parse_str(s).ok())
            {
                self.history.lock().unwrap().imports.push(id);
            }
        }
    }

    /// One file of new codes imported into two pools at once: a code sits
    /// in one pool, so one of the two imports gets each code.
    async fn racing_imports(&self, rng: &mut StdRng) {
        let a = POOLS[rng.random_range(0..POOLS.len())];
        let b = loop {
            let b = POOLS[rng.random_range(0..POOLS.len())];
            if b != a {
                break b;
            }
        };
        let mut text = String::from("code\n");
        for _ in 0..rng.random_range(5..20) {
            text.push_str(&format!("RACE-{:016X}\n", rng.random::<u64>()));
        }
        let mut outs = Vec::new();
        let mut runs = Vec::new();
        for pool in [a, b] {
            let path = self
                .files
                .path()
                .join(format!("{}.csv", ObjectId::new().to_hex()));
            std::fs::write(&path, &text).unwrap();
            let path = path.to_str().unwrap().to_owned();
            runs.push(async move {
                self.env
                    .command(&["import", &path, "--pool", pool, "--json"])
                    .output()
                    .await
                    .unwrap()
            });
        }
        for out in futures::future::join_all(runs).await {
            self.imported(&out);
            outs.push(exit_of(&out));
        }
        self.ran("one file into two pools at once (cli)", outs.join(" + "));
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
        self.imported(&out);
        self.ran("import killed and run again (cli)", exit_of(&out));
    }

    fn pick_import(&self, rng: &mut StdRng) -> Option<ObjectId> {
        let h = self.history.lock().unwrap();
        (!h.imports.is_empty()).then(|| h.imports[rng.random_range(0..h.imports.len())])
    }

    async fn recall(&self, rng: &mut StdRng) {
        let Some(batch) = self.pick_import(rng) else {
            return;
        };
        let out = self
            .cli(&["void", "--import", &batch.to_hex(), "--reason", "leak"])
            .await;
        if out == "exit 0" {
            let at = bson::DateTime::now();
            self.history.lock().unwrap().recalls.push((batch, at));
        }
        self.ran("recall (cli)", out);
    }

    async fn pause_or_resume(&self, rng: &mut StdRng) {
        let pool = ALL_POOLS[rng.random_range(0..ALL_POOLS.len())];
        let paused = self.history.lock().unwrap().paused.contains(pool);
        let verb = if paused { "resume" } else { "pause" };
        let out = self.cli(&["pool", verb, "--pool", pool]).await;
        if out == "exit 0" {
            self.paused(pool, !paused);
        }
        self.ran(
            if paused {
                "resume (cli)"
            } else {
                "pause (cli)"
            },
            out,
        );
    }

    fn paused(&self, pool: &'static str, paused: bool) {
        let mut h = self.history.lock().unwrap();
        if paused {
            h.paused.insert(pool);
        } else {
            h.paused.remove(pool);
        }
    }

    /// `codepool void|redeem|resend --order` of an order of the run.
    async fn on_order(&self, rng: &mut StdRng, verb: &'static str) {
        let Some(order) = self.pick_order(rng) else {
            return;
        };
        let mut args = vec![verb, "--order", order.as_str()];
        if verb == "void" {
            args.extend(["--reason", "refund"]);
        }
        let out = self.cli(&args).await;
        self.ran(
            match verb {
                "void" => "void an order (cli)",
                "redeem" => "redeem an order (cli)",
                _ => "resend an order (cli)",
            },
            out,
        );
    }

    /// Runs a command; how it ended.
    async fn cli(&self, args: &[&str]) -> String {
        exit_of(&self.env.command(args).output().await.unwrap())
    }

    /// A replacement to ask for: a fresh one, of a line of an order of the
    /// run, or one asked before (the same again, which must change
    /// nothing, or with another reason, which must be refused).
    fn replacement(&self, rng: &mut StdRng, id: &str) -> Option<(String, u32, String, String)> {
        let again = {
            let h = self.history.lock().unwrap();
            (!h.rids.is_empty() && rng.random_bool(0.25))
                .then(|| h.rids[rng.random_range(0..h.rids.len())].clone())
        };
        if let Some((rid, order, line, reason)) = again {
            let reason = if rng.random_bool(0.3) {
                "another reason".to_owned()
            } else {
                reason
            };
            return Some((order, line, rid, reason));
        }
        let order = self.pick_order(rng)?;
        // A marketplace's order is not replaced by the shop's doors: its
        // marketplace is promised the same keys on every provision.
        if channel_of(&order).is_some() {
            return None;
        }
        let mut h = self.history.lock().unwrap();
        let wanted = h.orders[&order].0.max(1);
        let line = rng.random_range(0..wanted);
        let rid = format!("RP{id}");
        let reason = "code rejected".to_owned();
        h.rids
            .push((rid.clone(), order.clone(), line, reason.clone()));
        Some((order, line, rid, reason))
    }

    fn replaced(&self, rid: &str, grant: Option<&str>) {
        if let Some(g) = grant {
            let mut h = self.history.lock().unwrap();
            h.replaced.push((rid.to_owned(), g.to_owned()));
        }
    }

    /// `POST /v1/orders/{id}/lines/{line}/replace`.
    async fn replace_http(&self, rng: &mut StdRng, id: &str) {
        let Some((order, line, rid, reason)) = self.replacement(rng, id) else {
            return;
        };
        let key = self.key_for(rng, &order);
        let body = json!({"replacement_id": rid, "reason": reason}).to_string();
        let path = format!("/v1/orders/{}/lines/{line}/replace", path_part(&order));
        let answer = self.post(rng, &key, "POST", &path, body.as_bytes()).await;
        if let Some((200 | 201, b)) = &answer {
            let v = json_or_null(b);
            self.replaced(&rid, v["code"]["grant_no"].as_str());
        }
        self.ran("replace a code (http)", status_of(&answer));
    }

    fn replace_args(order: &str, line: u32, rid: &str, reason: &str) -> Vec<String> {
        [
            "replace",
            "--order",
            order,
            "--line",
            &line.to_string(),
            "--reason",
            reason,
            "--replacement-id",
            rid,
            "--json",
        ]
        .map(str::to_owned)
        .to_vec()
    }

    /// `codepool replace`.
    async fn replace_cli(&self, rng: &mut StdRng, id: &str) {
        let Some((order, line, rid, reason)) = self.replacement(rng, id) else {
            return;
        };
        let args = Self::replace_args(&order, line, &rid, &reason);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = self.env.command(&args).output().await.unwrap();
        if out.status.success() {
            let v = json_or_null(&out.stdout);
            self.replaced(&rid, v["new_grant_no"].as_str());
        }
        self.ran("replace a code (cli)", exit_of(&out));
    }

    /// `codepool replace` killed (paused between the void of the old code
    /// and the claim of the new, where the build has failpoints), then run
    /// again with the same id, which finishes it.
    async fn replace_cli_killed(&self, rng: &mut StdRng, id: &str) {
        let Some((order, line, rid, reason)) = self.replacement(rng, id) else {
            return;
        };
        let args = Self::replace_args(&order, line, &rid, &reason);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut cmd = self.env.command(&args);
        cmd.env("CODEPOOL_FAILPOINTS", "replace-pause=5000")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        let mut child = cmd.spawn().unwrap();
        tokio::time::sleep(Duration::from_millis(rng.random_range(100..1500))).await;
        let _ = child.start_kill();
        let _ = child.wait().await;
        let out = self.env.command(&args).output().await.unwrap();
        if out.status.success() {
            let v = json_or_null(&out.stdout);
            self.replaced(&rid, v["new_grant_no"].as_str());
        }
        self.ran("replace killed and run again (cli)", exit_of(&out));
    }

    /// The console's Replace button on an order's line.
    async fn replace_console(&self, rng: &mut StdRng, id: &str) {
        let Some((order, line, rid, reason)) = self.replacement(rng, id) else {
            return;
        };
        let path = format!("/console/orders/{}/lines/{line}/replace", path_part(&order));
        let answer = self
            .console_post(rng, &path, &[("reason", &reason), ("replacement_id", &rid)])
            .await;
        self.ran("replace a code (console)", status_of(&answer));
    }

    /// The arguments of `codepool generate` for a run of `count` codes
    /// into `pool`.
    fn generate_args(pool: &str, count: u64, run: Option<ObjectId>) -> Vec<String> {
        let (pattern, check) = pattern_of(pool);
        let mut args: Vec<String> = ["generate", "--pool", pool, "--pattern", pattern, "--json"]
            .map(str::to_owned)
            .to_vec();
        args.extend(["--count".to_owned(), count.to_string()]);
        if check {
            args.push("--check-char".into());
        }
        if let Some(run) = run {
            args.extend(["--run-id".to_owned(), run.to_hex()]);
        }
        args
    }

    /// `codepool generate`.
    async fn generate_cli(&self, pool: &str, count: u64) {
        let args = Self::generate_args(pool, count, None);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = self.env.command(&args).output().await.unwrap();
        self.imported_run(&out);
        self.ran("generate (cli)", exit_of(&out));
    }

    fn imported_run(&self, out: &std::process::Output) {
        // The run's first line names it before any code is made.
        let text = String::from_utf8_lossy(&out.stdout);
        let first = text.lines().next().unwrap_or_default();
        if let Ok(v) = serde_json::from_str::<Value>(first) {
            if let Some(id) = v["run_id"]
                .as_str()
                .and_then(|s| ObjectId::parse_str(s).ok())
            {
                self.history.lock().unwrap().imports.push(id);
            }
        }
    }

    /// `codepool generate --run-id` killed (`kill -9`) mid-run, then the
    /// same command again, left to run beside the mix: it takes the run up
    /// once the dead process's lease lapses and makes only what is missing.
    async fn generate_killed(&self, rng: &mut StdRng) {
        let pool = ALL_POOLS[rng.random_range(0..ALL_POOLS.len())];
        // The run is taken up once the dead process's lease lapses (20 s):
        // a kill this late would keep the checks waiting for it.
        let late = (self.ends.lock().unwrap())
            .is_some_and(|end| Instant::now() + Duration::from_secs(20) > end);
        if late {
            return self.generate_cli(pool, 20).await;
        }
        let run = ObjectId::new();
        let mut args = Self::generate_args(pool, 1500, Some(run));
        args.extend(["--batch-size".to_owned(), "100".to_owned()]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut child = self
            .env
            .command(&args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        tokio::time::sleep(Duration::from_millis(rng.random_range(200..1200))).await;
        let _ = child.start_kill();
        let _ = child.wait().await;
        {
            let mut h = self.history.lock().unwrap();
            h.imports.push(run);
            h.killed_runs.insert(run);
        }
        let again = self
            .env
            .command(&args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        self.resumes.lock().unwrap().push((run, again));
        self.ran("generate killed, resumed by id (cli)", "killed");
    }

    /// `POST /v1/pools/{pool}/generations`: the run is made in the API
    /// process, which the fault task may kill.
    async fn generate_api(&self, rng: &mut StdRng) {
        let pool = ALL_POOLS[rng.random_range(0..ALL_POOLS.len())];
        let (pattern, check) = pattern_of(pool);
        let run = ObjectId::new();
        let count = rng.random_range(5..400);
        let body = json!({"count": count, "pattern": pattern, "check_char": check, "run_id": run.to_hex()});
        let path = format!("/v1/pools/{pool}/generations");
        let answer = self
            .post(rng, &self.admin, "POST", &path, body.to_string().as_bytes())
            .await;
        self.history.lock().unwrap().imports.push(run);
        self.ran("generate (http)", status_of(&answer));
    }

    /// The pool page's Generate form (not in the pool of check symbols:
    /// the form's pattern has none).
    async fn generate_console(&self, rng: &mut StdRng) {
        let pool = POOLS[rng.random_range(0..POOLS.len())];
        let count = rng.random_range(5..200).to_string();
        let (pattern, _) = pattern_of(pool);
        let path = format!("/console/pools/{pool}/generations");
        let answer = self
            .console_post(rng, &path, &[("count", &count), ("pattern", pattern)])
            .await;
        self.ran("generate (console)", status_of(&answer));
    }

    /// A code to look up, as a buyer might type it: one a run sold, one
    /// never sold (in stock, held, voided unsold), one of the pool of check
    /// symbols (some with a wrong check symbol), or one no pool holds.
    async fn pick_code(&self, rng: &mut StdRng) -> Picked {
        let draw = rng.random_range(0..20);
        let filter = match draw {
            0..=9 => doc! {"status": {"$in": [1, 2, 3]}, "order_id": {"$exists": true}},
            10..=15 => doc! {"$or": [
                {"status": {"$in": [0, 4]}},
                {"status": 3, "order_id": {"$exists": false}},
            ]},
            16..=18 => doc! {"pool": GEN},
            _ => doc! {"_id": {"$exists": false}},
        };
        let pipeline = vec![doc! {"$match": filter}, doc! {"$sample": {"size": 1}}];
        let found = match self.codes().aggregate(pipeline).comment(HARNESS).await {
            Ok(mut cur) => cur.next().await.and_then(Result::ok),
            Err(_) => None,
        };
        let Some(d) = found else {
            let typed = format!("CP-NONE-{:016X}", rng.random::<u64>());
            return Picked {
                doc: None,
                pool: FREE.into(),
                typed,
            };
        };
        let pool = d.get_str("pool").unwrap_or_default().to_owned();
        let plain = self.env.plain_code(&d);
        let id = d.get_object_id("_id").ok();
        if pool == GEN && draw == 18 {
            // One symbol off: the check symbol fails, and the pool is not
            // even searched.
            let mut chars: Vec<char> = plain.chars().collect();
            let last = chars.len() - 1;
            chars[last] = if chars[last] == '7' { '8' } else { '7' };
            return Picked {
                doc: None,
                pool,
                typed: chars.into_iter().collect(),
            };
        }
        let typed = match rng.random_range(0..10) {
            0..=5 => plain.clone(),
            6 | 7 => plain.to_lowercase(),
            8 => format!("  {plain}\n"),
            _ if pool == GEN => plain.replace('0', "O").replace('1', "l"),
            _ => plain.to_lowercase(),
        };
        Picked {
            doc: id,
            pool,
            typed,
        }
    }

    fn platform(&self, rng: &mut StdRng) -> usize {
        match rng.random_range(0..4) {
            0 | 1 => 0,
            n => n - 1,
        }
    }

    async fn lookup(
        &self,
        rng: &mut StdRng,
        platform: usize,
        picked: &Picked,
        rid: Option<&str>,
    ) -> Option<(u16, Vec<u8>)> {
        let (path, body) = match rid {
            Some(rid) => (
                "/v1/codes/redeem",
                json!({"code": picked.typed, "redemption_id": rid}),
            ),
            None => ("/v1/codes/check", json!({"code": picked.typed})),
        };
        let key = self.platforms[platform].clone();
        let answer = self
            .post(rng, &key, "POST", path, body.to_string().as_bytes())
            .await;
        self.history.lock().unwrap().lookups.push(Lookup {
            platform,
            doc: picked.doc,
            redeem: rid.is_some(),
            rid: rid.map(str::to_owned),
            answer: answer.as_ref().map(|(s, b)| (*s, json_or_null(b))),
        });
        answer
    }

    /// `POST /v1/codes/check`.
    async fn check_http(&self, rng: &mut StdRng) {
        let picked = self.pick_code(rng).await;
        let platform = self.platform(rng);
        let answer = self.lookup(rng, platform, &picked, None).await;
        self.ran("check a code (http)", status_of(&answer));
    }

    /// `POST /v1/codes/redeem`: a fresh redemption id, or one sent before
    /// by the same platform (for its code again, or for another).
    async fn redeem_http(&self, rng: &mut StdRng, id: &str) {
        let again = {
            let h = self.history.lock().unwrap();
            (!h.redemptions.is_empty() && rng.random_bool(0.2))
                .then(|| h.redemptions[rng.random_range(0..h.redemptions.len())].clone())
        };
        let (platform, rid, picked) = match again {
            Some((platform, rid, before)) => {
                let picked = if rng.random_bool(0.5) {
                    before
                } else {
                    self.pick_code(rng).await
                };
                (platform, rid, picked)
            }
            None => {
                let picked = self.pick_code(rng).await;
                let platform = self.platform(rng);
                let rid = format!("RD{id}");
                self.history.lock().unwrap().redemptions.push((
                    platform,
                    rid.clone(),
                    picked.clone(),
                ));
                (platform, rid, picked)
            }
        };
        let answer = self.lookup(rng, platform, &picked, Some(&rid)).await;
        self.ran("redeem a code (http)", status_of(&answer));
    }

    /// A `code.redeemed` event, as the platform publishes it.
    async fn publish_redeemed(&self, body: Value) -> String {
        let t = self.env.topology();
        let props = lapin::BasicProperties::default().with_user_id("guest".into());
        let sent = self
            .publisher
            .publish(
                &t.events_exchange,
                "code.redeemed",
                body.to_string().as_bytes(),
                props,
            )
            .await;
        match sent {
            Ok(p) => match p.wait().await {
                Ok(()) => "confirmed".into(),
                Err(_) => "not confirmed".into(),
            },
            Err(_) => "refused".into(),
        }
    }

    async fn redeem_amqp_code(&self, rng: &mut StdRng) {
        let picked = self.pick_code(rng).await;
        let out = self
            .publish_redeemed(json!({"pool": picked.pool, "code": picked.typed}))
            .await;
        self.ran("redeem a code (amqp)", out);
    }

    async fn redeem_amqp_order(&self, rng: &mut StdRng) {
        let Some(order) = self.pick_order(rng) else {
            return;
        };
        let out = self.publish_redeemed(json!({"order_id": order})).await;
        self.ran("redeem an order (amqp)", out);
    }

    async fn redeem_order_http(&self, rng: &mut StdRng) {
        let Some(order) = self.pick_order(rng) else {
            return;
        };
        let key = self.key_for(rng, &order);
        let path = format!("/v1/orders/{}/redeem", path_part(&order));
        let answer = self.post(rng, &key, "POST", &path, b"").await;
        self.ran("redeem an order (http)", status_of(&answer));
    }

    async fn redeem_cli_code(&self, rng: &mut StdRng) {
        let picked = self.pick_code(rng).await;
        let out = self
            .cli(&["redeem", "--pool", &picked.pool, "--code", &picked.typed])
            .await;
        self.ran("redeem a code (cli)", out);
    }

    fn found(&self, what: String) {
        self.history.lock().unwrap().found.push(what);
    }

    /// `codepool statement`: exit 0 when every row ties out, 3 when one
    /// does not.
    async fn statement_cli(&self, rng: &mut StdRng) {
        let pool = ALL_POOLS[rng.random_range(0..ALL_POOLS.len())];
        let mut args = vec!["statement", "--pool", pool, "--json"];
        let channel = Self::cut_by_channel(rng);
        if let Some(c) = channel {
            args.extend(["--channel", c]);
        }
        let out = self.env.command(&args).output().await.unwrap();
        if out.status.code() == Some(3) {
            self.found(format!(
                "7: the statement of pool {pool} (cli, during the run, channel {channel:?}) does not tie out: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        let what = match channel {
            Some(_) => "statement cut by channel (cli)",
            None => "statement (cli)",
        };
        self.ran(what, exit_of(&out));
    }

    /// Now and then, a channel to cut a statement by.
    fn cut_by_channel(rng: &mut StdRng) -> Option<&'static str> {
        rng.random_bool(0.3)
            .then(|| CHANNELS[rng.random_range(0..CHANNELS.len())].0)
    }

    /// `GET /v1/statements`: its `discrepancies` are empty.
    async fn statement_api(&self, rng: &mut StdRng) {
        let pool = ALL_POOLS[rng.random_range(0..ALL_POOLS.len())];
        let mut path = format!("/v1/statements?pool={pool}");
        let channel = Self::cut_by_channel(rng);
        if let Some(c) = channel {
            path.push_str(&format!("&channel={c}"));
        }
        let answer = self.post(rng, &self.admin, "GET", &path, b"").await;
        if let Some((200, b)) = &answer {
            let v = json_or_null(b);
            match v["discrepancies"].as_array() {
                Some(d) if d.is_empty() => {}
                _ => self.found(format!(
                    "7: the statement of pool {pool} (http, during the run, channel {channel:?}) does not tie out: {v}"
                )),
            }
        }
        let what = match channel {
            Some(_) => "statement cut by channel (http)",
            None => "statement (http)",
        };
        self.ran(what, status_of(&answer));
    }

    /// The console's statement page: no row in red.
    async fn statement_console(&self, rng: &mut StdRng) {
        let pool = ALL_POOLS[rng.random_range(0..ALL_POOLS.len())];
        let path = format!("/console/pools/{pool}/statement");
        let answer = match self.api_addr(rng) {
            Some(addr) => raw_http(
                &addr,
                "GET",
                &path,
                &[("Cookie", self.console.0.as_str())],
                b"",
            )
            .await
            .map(|(s, _, b)| (s, b)),
            None => None,
        };
        if let Some((200, b)) = &answer {
            let page = String::from_utf8_lossy(b);
            if page.contains("do not tie out") {
                let at = page.find("do not tie out").unwrap_or(0);
                self.found(format!(
                    "7: the statement of pool {pool} (console, during the run) does not tie out: …{}…",
                    &page[at.saturating_sub(200)..(at + 100).min(page.len())]
                ));
            }
        }
        self.ran("statement (console)", status_of(&answer));
    }

    /// A console form posted with the session and its CSRF token.
    async fn console_post(
        &self,
        rng: &mut StdRng,
        path: &str,
        fields: &[(&str, &str)],
    ) -> Option<(u16, Vec<u8>)> {
        let addr = self.api_addr(rng)?;
        let mut form = format!("csrf={}", form_part(&self.console.1));
        for (k, v) in fields {
            form.push_str(&format!("&{k}={}", form_part(v)));
        }
        let headers = [
            ("Cookie", self.console.0.as_str()),
            ("Content-Type", "application/x-www-form-urlencoded"),
        ];
        raw_http(&addr, "POST", path, &headers, form.as_bytes())
            .await
            .map(|(s, _, b)| (s, b))
    }

    /// The order page's Void (with a reason) or Resend SMS.
    async fn console_on_order(&self, rng: &mut StdRng, verb: &'static str) {
        let Some(order) = self.pick_order(rng) else {
            return;
        };
        let path = format!("/console/orders/{}/{verb}", path_part(&order));
        let fields: &[(&str, &str)] = if verb == "void" {
            &[("reason", "refund")]
        } else {
            &[]
        };
        let answer = self.console_post(rng, &path, fields).await;
        let what = if verb == "void" {
            "void an order (console)"
        } else {
            "resend an order (console)"
        };
        self.ran(what, status_of(&answer));
    }

    async fn console_pause_or_resume(&self, rng: &mut StdRng) {
        let pool = ALL_POOLS[rng.random_range(0..ALL_POOLS.len())];
        let paused = self.history.lock().unwrap().paused.contains(pool);
        let verb = if paused { "resume" } else { "pause" };
        let answer = self
            .console_post(rng, &format!("/console/pools/{pool}/{verb}"), &[])
            .await;
        if matches!(answer, Some((303, _))) {
            self.paused(pool, !paused);
        }
        let what = if paused {
            "resume (console)"
        } else {
            "pause (console)"
        };
        self.ran(what, status_of(&answer));
    }

    async fn console_recall(&self, rng: &mut StdRng) {
        let Some(batch) = self.pick_import(rng) else {
            return;
        };
        let path = format!("/console/imports/{}/recall", batch.to_hex());
        let answer = self
            .console_post(rng, &path, &[("reason", "leak"), ("confirm", "yes")])
            .await;
        if matches!(answer, Some((200 | 303, _))) {
            let at = bson::DateTime::now();
            self.history.lock().unwrap().recalls.push((batch, at));
        }
        self.ran("recall (console)", status_of(&answer));
    }

    // ------------------------------------------------------------ marketplaces

    /// One marketplace call, drawn from the seed.
    async fn marketplace(&self, rng: &mut StdRng, id: &str) {
        match rng.random_range(0..100) {
            0..=14 => self.eneba_reserve(rng, id).await,
            15..=29 => self.eneba_provide(rng).await,
            30..=37 => self.eneba_cancel(rng).await,
            38..=49 => self.g2a_reserve(rng).await,
            50..=61 => self.g2a_order(rng).await,
            62..=66 => self.g2a_release(rng).await,
            67..=71 => self.g2a_return(rng).await,
            72..=81 => self.kinguin_buying(rng, id).await,
            82..=91 => self.kinguin_bought(rng, id).await,
            92..=95 => self.kinguin_canceled(rng).await,
            _ => self.run_out(rng).await,
        }
    }

    /// A marketplace's call with `headers`: to a live API process picked
    /// by the seed, then, while no answer comes (a process killed under
    /// it) or a 503, to another, up to `tries` attempts 300 ms apart, as
    /// the marketplace's contract retries. The status and body, or
    /// `None`. (The retries draw nothing from the seed.)
    async fn market(
        &self,
        rng: &mut StdRng,
        tries: u32,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Option<(u16, Vec<u8>)> {
        let addr = self.api_addr(rng);
        self.market_at(addr, tries, method, path, headers, body)
            .await
    }

    /// [`Self::market`], first to `addr`.
    async fn market_at(
        &self,
        mut addr: Option<String>,
        tries: u32,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Option<(u16, Vec<u8>)> {
        for attempt in 0..tries {
            if attempt > 0 {
                tokio::time::sleep(Duration::from_millis(300)).await;
                addr = self.next_api(addr.as_deref());
            }
            let Some(a) = addr.as_deref() else {
                continue;
            };
            match raw_http(a, method, path, headers, body).await {
                Some((503, _, _)) | None => {}
                Some((status, _, body)) => return Some((status, body)),
            }
        }
        None
    }

    /// A live API process other than `not` (or `not`, if it is the only one).
    fn next_api(&self, not: Option<&str>) -> Option<String> {
        let apis = self.apis.lock().unwrap();
        let up: Vec<&str> = apis.iter().flatten().map(|a| a.addr.as_str()).collect();
        (up.iter().find(|a| Some(**a) != not).or(up.first())).map(|a| (*a).to_owned())
    }

    /// A marketplace order of `channel` of the run, sorted first so that a
    /// seed picks the same one: mostly one held and not cancelled, as a
    /// marketplace goes on with, now and then any (one refused, cancelled,
    /// or never answered).
    fn pick_deal(&self, rng: &mut StdRng, channel: &str) -> Option<(String, Deal)> {
        let any = rng.random_bool(0.2);
        let h = self.history.lock().unwrap();
        let ids: Vec<(&String, &Deal)> = (h.deals.iter())
            .filter(|(k, d)| d.channel == channel && (any || d.held && !h.cancelled.contains(*k)))
            .collect();
        (!ids.is_empty()).then(|| {
            let (k, d) = ids[rng.random_range(0..ids.len())];
            (k.clone(), d.clone())
        })
    }

    /// Records a marketplace order once its reservation was answered (or
    /// went unanswered): from then on its order may get codes, and the
    /// marketplace may provide or cancel it.
    fn dealt(&self, order: &str, deal: Deal) {
        let mut h = self.history.lock().unwrap();
        let uid = format!("{}:{}", deal.channel, deal.external);
        h.orders.insert(order.into(), (deal.keys, uid, None));
        h.placed_by.insert(order.into(), None);
        h.deals.insert(order.into(), deal);
    }

    fn provided(&self, order: &str, p: Provision) {
        let mut h = self.history.lock().unwrap();
        h.provisions.entry(order.to_owned()).or_default().push(p);
    }

    /// How a marketplace's call ended: its status, and what the answer
    /// says in the marketplace's words (Eneba's `success`, or why not;
    /// G2A's `code`; Kinguin's `result` or `error`).
    fn market_said(answer: &Option<(u16, Vec<u8>)>) -> String {
        let Some((status, b)) = answer else {
            return "no answer".to_owned();
        };
        let v = json_or_null(b);
        let why = || {
            let m = v["message"].as_str().unwrap_or_default();
            [
                ("paused", "paused"),
                ("would hold", "over a share"),
                ("not enough", "out of stock"),
                ("cancelled", "cancelled"),
                ("expired", "expired"),
                ("unknown", "unknown"),
                ("already exists", "ordered"),
            ]
            .iter()
            .find(|(k, _)| m.contains(k))
            .map_or("", |(_, w)| w)
        };
        let said = match (&v["success"], &v["code"], &v["result"], &v["error"]) {
            (Value::Bool(true), ..) => "success".to_owned(),
            (Value::Bool(false), ..) => format!("refused, {}", why()),
            (_, Value::String(c), ..) => format!("{c}, {}", why()),
            (_, _, Value::String(r), _) => r.clone(),
            (_, _, _, Value::String(e)) => e.clone(),
            _ => return status_of(answer),
        };
        format!("{status} {}", said.trim_end_matches(", "))
    }

    async fn eneba_call(
        &self,
        rng: &mut StdRng,
        tries: u32,
        body: Value,
    ) -> Option<(u16, Vec<u8>)> {
        let auth = format!("Bearer {ENEBA_TOKEN}");
        let headers = [
            ("Authorization", auth.as_str()),
            ("Content-Type", "application/json"),
        ];
        let body = body.to_string();
        self.market(
            rng,
            tries,
            "POST",
            "/channels/en/eneba",
            &headers,
            body.as_bytes(),
        )
        .await
    }

    /// Eneba's RESERVE of 1 to 3 keys of one of its auctions: one attempt.
    async fn eneba_reserve(&self, rng: &mut StdRng, id: &str) {
        let external = format!("E{id}");
        let keys = rng.random_range(1..=3);
        let auction = [AUCTION, AUCTION_FREE][rng.random_range(0..2)];
        let answer = self
            .eneba_call(rng, 1, reserve_of(&external, auction, keys))
            .await;
        let deal = Deal {
            channel: "en",
            external: external.clone(),
            keys,
            g2a_order: 0,
            held: matches!(&answer, Some((200, b)) if success(b) == true),
        };
        self.dealt(&format!("eneba:en:{external}"), deal);
        self.ran("eneba RESERVE", Self::market_said(&answer));
    }

    /// Eneba's PROVIDE of one of its orders (reserved or provided before),
    /// up to three attempts; now and then delivered twice at once.
    async fn eneba_provide(&self, rng: &mut StdRng) {
        let Some((order, d)) = self.pick_deal(rng, "en") else {
            return;
        };
        let twice = rng.random_bool(0.3);
        let body = provide(&d.external);
        let answers = if twice {
            let mut other = StdRng::seed_from_u64(rng.random());
            let (a, b) = tokio::join!(
                self.eneba_call(rng, 3, body.clone()),
                self.eneba_call(&mut other, 3, body)
            );
            vec![a, b]
        } else {
            vec![self.eneba_call(rng, 3, body).await]
        };
        let mut said = Vec::new();
        for a in &answers {
            if let Some((200, b)) = a {
                if success(b) == true {
                    self.provided(&order, Provision::Eneba(b.clone()));
                }
            }
            said.push(Self::market_said(a));
        }
        let what = if twice {
            "eneba PROVIDE twice at once"
        } else {
            "eneba PROVIDE"
        };
        self.ran(what, said.join(" + "));
    }

    /// Eneba's CANCEL of one of its orders, before or after its PROVIDE:
    /// up to two attempts.
    async fn eneba_cancel(&self, rng: &mut StdRng) {
        let Some((order, d)) = self.pick_deal(rng, "en") else {
            return;
        };
        let answer = self.eneba_call(rng, 2, cancel(&d.external)).await;
        if matches!(answer, Some((200, _))) {
            self.history.lock().unwrap().cancelled.insert(order);
        }
        self.ran("eneba CANCEL", Self::market_said(&answer));
    }

    /// G2A's access token, fetched once it is refused (it lives 15 s).
    async fn g2a_token(&self, fresh: bool) -> Option<String> {
        if !fresh {
            if let Some(t) = self.g2a_token.lock().unwrap().clone() {
                return Some(t);
            }
        }
        let path = format!("/channels/g2/g2a/oauth/token?grant_type=client_credentials&client_id={G2A_ID}&client_secret={G2A_SECRET}");
        let first = self.next_api(None);
        let (status, body) = self.market_at(first, 2, "GET", &path, &[], b"").await?;
        let token = (status == 200)
            .then(|| {
                json_or_null(&body)["access_token"]
                    .as_str()
                    .map(str::to_owned)
            })
            .flatten()?;
        *self.g2a_token.lock().unwrap() = Some(token.clone());
        Some(token)
    }

    /// A call of G2A's client to channel `g2`: with its token, and again
    /// with a fresh one when the token is refused.
    async fn g2a_call(
        &self,
        rng: &mut StdRng,
        tries: u32,
        method: &str,
        path: &str,
        body: Value,
    ) -> Option<(u16, Vec<u8>)> {
        let body = if body.is_null() {
            Vec::new()
        } else {
            body.to_string().into_bytes()
        };
        let path = format!("/channels/g2/g2a{path}");
        let addr = self.api_addr(rng);
        let mut answer = None;
        for fresh in [false, true] {
            let token = self.g2a_token(fresh).await?;
            let auth = format!("Bearer {token}");
            let headers = [
                ("Authorization", auth.as_str()),
                ("Content-Type", "application/json"),
            ];
            answer = (self.market_at(addr.clone(), tries, method, &path, &headers, &body)).await;
            if !matches!(answer, Some((401, _))) {
                break;
            }
        }
        answer
    }

    /// G2A's reservation of 1 or 2 keys: one attempt (unanswered, G2A
    /// never learns its id, and the hold runs out).
    async fn g2a_reserve(&self, rng: &mut StdRng) {
        let keys = rng.random_range(1..=2);
        let g2a_order = rng.random_range(1..u64::from(u32::MAX));
        let answer = self
            .g2a_call(rng, 1, "POST", "/reservation", reservation(keys))
            .await;
        if let Some((200, b)) = &answer {
            if let Some(rid) = json_or_null(b)["reservation_id"].as_str() {
                let deal = Deal {
                    channel: "g2",
                    external: rid.to_owned(),
                    keys,
                    g2a_order,
                    held: true,
                };
                self.dealt(&format!("g2a:g2:{rid}"), deal);
            }
        }
        self.ran("g2a reservation", Self::market_said(&answer));
    }

    /// G2A's order of one of its reservations (ordered before or not), up
    /// to three attempts; now and then under another G2A order id.
    async fn g2a_order(&self, rng: &mut StdRng) {
        let Some((order, d)) = self.pick_deal(rng, "g2") else {
            return;
        };
        let g2a_order = if rng.random_bool(0.1) {
            d.g2a_order + 1
        } else {
            d.g2a_order
        };
        let body = json!({"reservation_id": d.external, "g2a_order_id": g2a_order});
        let answer = self.g2a_call(rng, 3, "POST", "/order", body).await;
        if let Some((200, b)) = &answer {
            let items = inventory_of(&json_or_null(b)["stock"]);
            self.provided(&order, Provision::G2aOrder(items));
        }
        self.ran("g2a order", Self::market_said(&answer));
    }

    /// G2A's release of one of its reservations: up to two attempts.
    async fn g2a_release(&self, rng: &mut StdRng) {
        let Some((order, d)) = self.pick_deal(rng, "g2") else {
            return;
        };
        let path = format!("/reservation/{}", d.external);
        let answer = self.g2a_call(rng, 2, "DELETE", &path, Value::Null).await;
        if matches!(answer, Some((204, _))) {
            self.history.lock().unwrap().cancelled.insert(order);
        }
        self.ran("g2a release", Self::market_said(&answer));
    }

    /// G2A reads an order's inventory, then returns one of its items by
    /// the id of an earlier read (the order's answer).
    async fn g2a_return(&self, rng: &mut StdRng) {
        let picked = {
            let h = self.history.lock().unwrap();
            let ordered: Vec<(&String, &Vec<(String, String)>)> = (h.provisions.iter())
                .filter_map(|(o, ps)| {
                    ps.iter().find_map(|p| match p {
                        Provision::G2aOrder(items) if !items.is_empty() => Some((o, items)),
                        _ => None,
                    })
                })
                .collect();
            let mut ordered = ordered;
            ordered.sort();
            (!ordered.is_empty()).then(|| {
                let (o, items) = ordered[rng.random_range(0..ordered.len())];
                (o.clone(), items[rng.random_range(0..items.len())].0.clone())
            })
        };
        let Some((order, item)) = picked else {
            return;
        };
        let rid = order.trim_start_matches("g2a:g2:").to_owned();
        let path = format!("/order/{rid}/inventory");
        let read = self.g2a_call(rng, 2, "GET", &path, Value::Null).await;
        if let Some((200, b)) = &read {
            self.provided(&order, Provision::G2aRead(inventory_of(&json_or_null(b))));
        }
        let path = format!("/order/{rid}/inventory?id[]={item}");
        let answer = self.g2a_call(rng, 2, "DELETE", &path, Value::Null).await;
        self.ran(
            "g2a read, then return by item id",
            format!(
                "{} + {}",
                Self::market_said(&read),
                Self::market_said(&answer)
            ),
        );
    }

    /// One Kinguin webhook of reservation `reservation`: the webhook and
    /// two retries.
    async fn kinguin_hook(
        &self,
        rng: &mut StdRng,
        reservation: &str,
        status: &str,
    ) -> Option<(u16, Vec<u8>)> {
        let headers = [
            ("X-Auth-Token", KG_SECRET),
            ("Content-Type", "application/json"),
        ];
        let body = kg_hook(reservation, status).to_string();
        self.market(
            rng,
            3,
            "POST",
            "/channels/kg/kinguin",
            &headers,
            body.as_bytes(),
        )
        .await
    }

    /// Kinguin's BUYING of a new reservation (one key of its offer).
    async fn kinguin_buying(&self, rng: &mut StdRng, id: &str) {
        let external = format!("K{id}");
        let answer = self.kinguin_hook(rng, &external, "BUYING").await;
        let deal = Deal {
            channel: "kg",
            external: external.clone(),
            keys: 1,
            g2a_order: 0,
            held: matches!(answer, Some((200, _))),
        };
        self.dealt(&format!("kinguin:kg:{external}"), deal);
        self.ran("kinguin BUYING", Self::market_said(&answer));
    }

    /// Kinguin's BOUGHT, delivered twice at once: of a reservation of the
    /// run, or now and then of one whose BUYING never came.
    async fn kinguin_bought(&self, rng: &mut StdRng, id: &str) {
        let picked = if rng.random_bool(0.15) {
            None
        } else {
            self.pick_deal(rng, "kg")
        };
        let (external, fresh) = match picked {
            Some((_, d)) => (d.external, false),
            None => (format!("K{id}"), true),
        };
        let mut other = StdRng::seed_from_u64(rng.random());
        let (a, b) = tokio::join!(
            self.kinguin_hook(rng, &external, "BOUGHT"),
            self.kinguin_hook(&mut other, &external, "BOUGHT")
        );
        if fresh {
            let deal = Deal {
                channel: "kg",
                external: external.clone(),
                keys: 1,
                g2a_order: 0,
                held: matches!(a, Some((200, _))) || matches!(b, Some((200, _))),
            };
            self.dealt(&format!("kinguin:kg:{external}"), deal);
        }
        self.ran(
            "kinguin BOUGHT twice at once",
            format!("{} + {}", Self::market_said(&a), Self::market_said(&b)),
        );
    }

    /// Kinguin's CANCELED of a reservation of the run, bought or not.
    async fn kinguin_canceled(&self, rng: &mut StdRng) {
        let Some((order, d)) = self.pick_deal(rng, "kg") else {
            return;
        };
        let answer = self.kinguin_hook(rng, &d.external, "CANCELED").await;
        if matches!(answer, Some((200, _))) {
            self.history.lock().unwrap().cancelled.insert(order);
        }
        self.ran("kinguin CANCELED", Self::market_said(&answer));
    }

    /// A marketplace reservation runs past its time, as if its minute had
    /// passed: its hold (and its renewals') is made past, and a sweep
    /// expires it.
    async fn run_out(&self, rng: &mut StdRng) {
        let channel = CHANNELS[rng.random_range(0..CHANNELS.len())].0;
        let Some((order, _)) = self.pick_deal(rng, channel) else {
            return;
        };
        let ids: Vec<String> = std::iter::once(order.clone())
            .chain((1..4).map(|n| format!("{order}#{n}")))
            .collect();
        let past = bson::DateTime::from_millis(bson::DateTime::now().timestamp_millis() - 1000);
        let done = (self.env.store.database().collection::<Document>("holds"))
            .update_many(
                doc! {"hold_id": {"$in": ids}, "state": "held"},
                doc! {"$set": {"expires_at": past}},
            )
            .await;
        let what = match done {
            Ok(r) if r.modified_count > 0 => "ran out",
            Ok(_) => "held nothing",
            Err(_) => "not written",
        };
        self.ran("a marketplace reservation runs out", what);
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
            self.ran("kill -9 an api", "restarted");
        } else {
            let killed = self.daemons.lock().unwrap()[which - 2].take();
            if let Some(mut d) = killed {
                let _ = d.child.start_kill();
                let _ = d.child.wait().await;
            }
            tokio::time::sleep(pause).await;
            let fresh = start_daemon(self.env.command(&[])).await;
            self.daemons.lock().unwrap()[which - 2] = Some(fresh);
            self.ran("kill -9 a dispatcher", "restarted");
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

    /// The checker's own reads of `codes`, named so that the profiler test
    /// leaves them out (`crate::sharding::HARNESS`).
    fn codes(&self) -> mongodb::Collection<Document> {
        self.env.store.database().collection("codes")
    }

    /// Every document of `coll` matching `filter`. A read the server's
    /// monitor cut (a loaded host, minutes into a long run) is read again
    /// whole: the checker judges codepool, not its own connection.
    async fn all(&self, coll: &str, filter: Document) -> Vec<Document> {
        let coll = self.env.store.database().collection::<Document>(coll);
        let mut tries = 0;
        loop {
            let read = async {
                let mut cur = coll.find(filter.clone()).comment(HARNESS).await?;
                let mut out = Vec::new();
                while let Some(d) = cur.next().await {
                    out.push(d?);
                }
                Ok::<_, mongodb::error::Error>(out)
            };
            match read.await {
                Ok(out) => return out,
                Err(e) if tries < 5 => {
                    tries += 1;
                    eprintln!("checker: reading {} again after {e}", coll.name());
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                Err(e) => panic!("reading {}: {e}", coll.name()),
            }
        }
    }

    /// Every generation run made to its end: the runs resumed after a kill
    /// finish, then any run left unfinished (its API process was killed)
    /// is finished by its id, as an operator would, until none is left.
    async fn finish_generations(&self) {
        let resumes = std::mem::take(&mut *self.resumes.lock().unwrap());
        let waits = resumes.into_iter().map(|(_, child)| async move {
            match tokio::time::timeout(Duration::from_secs(120), child.wait_with_output()).await {
                Ok(Ok(out)) => exit_of(&out),
                _ => "no end within 120 s".to_owned(),
            }
        });
        for out in futures::future::join_all(waits).await {
            self.ran("generate resumed by id, at its end (cli)", out);
        }
        let started = Instant::now();
        loop {
            let open = self
                .all(
                    "imports",
                    doc! {"source": "generated", "status": {"$ne": "done"},
                    "recalled_at": {"$exists": false}},
                )
                .await;
            if open.is_empty() || started.elapsed() > Duration::from_secs(120) {
                break;
            }
            let finish = open.iter().filter_map(|r| {
                let run = r.get_object_id("_id").ok()?;
                let pool = r.get_str("pool").ok()?.to_owned();
                let spec = r.get_document("generation").ok()?;
                let check = spec.get_bool("check_char").unwrap_or(false);
                let pattern = spec.get_str("pattern").ok()?;
                let pattern = match check {
                    true => pattern.strip_suffix("{check}").unwrap_or(pattern),
                    false => pattern,
                }
                .to_owned();
                let count = spec
                    .get_i64("count")
                    .or_else(|_| spec.get_i32("count").map(i64::from))
                    .ok()?
                    .to_string();
                let mut args = vec![
                    "generate".to_owned(),
                    "--pool".into(),
                    pool,
                    "--count".into(),
                    count,
                    "--pattern".into(),
                    pattern,
                    "--run-id".into(),
                    run.to_hex(),
                ];
                if check {
                    args.push("--check-char".into());
                }
                Some(async move {
                    let args: Vec<&str> = args.iter().map(String::as_str).collect();
                    exit_of(&self.env.command(&args).output().await.unwrap())
                })
            });
            for out in futures::future::join_all(finish).await {
                self.ran("generate finished by id, at the end (cli)", out);
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// Waits until every purchase is settled and every event is out, then
    /// checks the invariants over what the run left.
    async fn settle_and_check(&self) -> Vec<String> {
        let began = Instant::now();
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
        self.finish_generations().await;
        eprintln!(
            "checker: every generation run finished in {:.1} s",
            began.elapsed().as_secs_f64()
        );
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
        // Every code.redeemed event is applied (or dropped) before the
        // redemptions are counted.
        eventually(
            Duration::from_secs(120),
            "every code.redeemed event consumed",
            || async {
                let ready = queue_depth(&ch, &t.code_redeemed).await;
                if ready > 0 {
                    return false;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
                queue_depth(&ch, &t.code_redeemed).await == 0
            },
        )
        .await;
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
                    .comment(HARNESS)
                    .await
                    .unwrap()
                    + owed.count_documents(unsent).await.unwrap()
                    == 0
            },
        )
        .await;
        let events = drain(&ch, &t.sms_pending).await;
        eventually(
            Duration::from_secs(90),
            "every Kinguin upload sent or given up",
            || async {
                let uploads = self
                    .env
                    .store
                    .database()
                    .collection::<Document>("kinguin_uploads");
                uploads
                    .count_documents(doc! {"upload": "pending"})
                    .await
                    .unwrap()
                    == 0
            },
        )
        .await;
        eventually(
            Duration::from_secs(30),
            "every hold past its time swept",
            || async {
                let holds = self.env.store.database().collection::<Document>("holds");
                let due = doc! {"state": "held", "expires_at": {"$lt": bson::DateTime::now()}};
                holds.count_documents(due).await.unwrap() == 0
            },
        )
        .await;
        eprintln!("checker: settled in {:.1} s", began.elapsed().as_secs_f64());
        let _ = conn.close(200, "bye").await;
        let docs = self.all("codes", doc! {}).await;
        let granted = (docs.iter())
            .filter(|d| matches!(d.get_i32("status"), Ok(1 | 2)))
            .count();
        let committed = (self.env.store.database().collection::<Document>("holds"))
            .count_documents(doc! {"state": "committed"})
            .await
            .unwrap();
        eprintln!(
            "checker: checked {} codes, {granted} issued or used, {} sms.pending events, {committed} holds paid",
            docs.len(),
            events.len()
        );
        let docs: HashMap<ObjectId, Document> = (docs.into_iter())
            .filter_map(|d| Some((d.get_object_id("_id").ok()?, d)))
            .collect();
        let ring = self.env.store.keys().ring().unwrap();
        let plain: HashMap<ObjectId, String> = (docs.iter())
            .map(|(id, d)| (*id, open_code(&ring, d)))
            .collect();
        let mut v = std::mem::take(&mut self.history.lock().unwrap().found);
        self.check_codes(&events, &docs, &plain, &mut v).await;
        self.check_imports(&docs, &mut v).await;
        self.check_statements(&docs, &mut v).await;
        self.check_holds(&mut v).await;
        self.check_provisions(&docs, &plain, &mut v);
        self.check_hold_ends(&docs, &mut v).await;
        self.check_replacements(&docs, &mut v).await;
        self.check_redemptions(&docs, &mut v).await;
        self.check_lookalikes(&docs, &plain, &mut v).await;
        self.check_never_sold(&docs, &mut v);
        self.check_generations(&docs, &mut v).await;
        eprintln!(
            "checker: settled and checked in {:.1} s",
            began.elapsed().as_secs_f64()
        );
        v
    }

    /// 7: every pool's statement ties out, as the operator's command
    /// checks it (exit 0), whatever the mix did to its codes; and so does
    /// each channel's cut of each pool it sells, counting the codes the
    /// channel sold as they stand.
    async fn check_statements(&self, docs: &HashMap<ObjectId, Document>, v: &mut Vec<String>) {
        for (channel, kind) in CHANNELS {
            let prefix = format!("{kind}:{channel}:");
            for pool in shop_pools(CHANNEL_SHOP) {
                let args = ["statement", "--pool", pool, "--channel", channel, "--json"];
                let out = self.env.command(&args).output().await.unwrap();
                if out.status.code() != Some(0) {
                    v.push(format!(
                        "7: the statement of pool {pool} cut by channel {channel} exits {:?}: {}",
                        out.status.code(),
                        String::from_utf8_lossy(&out.stderr)
                    ));
                    continue;
                }
                let s = json_or_null(&out.stdout);
                let t = &s["total"];
                let mut sold = [0u64; 5];
                for d in docs.values() {
                    let order = d.get_str("order_id").unwrap_or_default();
                    if d.get_str("pool") == Ok(*pool) && order.starts_with(&prefix) {
                        if let Ok(st @ 0..=4) = d.get_i32("status") {
                            sold[st as usize] += 1;
                        }
                    }
                }
                let void: u64 = (t["balance"]["void"].as_object().into_iter().flatten())
                    .filter_map(|(_, n)| n.as_u64())
                    .sum();
                let said = [
                    t["received"].as_u64(),
                    t["balance"]["issued"].as_u64(),
                    t["balance"]["used"].as_u64(),
                    Some(void),
                    t["balance"]["in_stock"].as_u64(),
                    t["balance"]["held"].as_u64(),
                    t["off_by"].as_u64(),
                ];
                let want = [
                    sold[1] + sold[2] + sold[3],
                    sold[1],
                    sold[2],
                    sold[3],
                    0,
                    0,
                    0,
                ]
                .map(Some);
                if said != want || sold[0] + sold[4] > 0 {
                    v.push(format!(
                        "7: the statement of pool {pool} cut by channel {channel} says received, issued, used, void, in stock, held, off by {said:?}, but the channel's codes are {want:?} (and {} in stock or held under its orders): {t}",
                        sold[0] + sold[4]
                    ));
                }
            }
        }
        for pool in ALL_POOLS {
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

    async fn check_codes(
        &self,
        events: &[Taken],
        docs: &HashMap<ObjectId, Document>,
        plain: &HashMap<ObjectId, String>,
        v: &mut Vec<String>,
    ) {
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
        // A marketplace's sale has no phone: no text is owed for it.
        let mut texted: BTreeMap<&str, &str> = BTreeMap::new();
        for (code, to) in &sent {
            for o in to.iter().filter(|o| channel_of(o).is_some()) {
                texted.insert(o, code);
            }
        }
        for (order, code) in texted {
            v.push(format!(
                "5: an sms.pending event carries code {} for order {order}, a marketplace's sale, which has no phone",
                codepool_domain::mask(code)
            ));
        }
        // What the marketplaces were given, beside what was texted: no
        // code to two orders, whichever doors gave it.
        let mut given = sent.clone();
        for (order, keys) in self.marketplace_keys() {
            for k in keys {
                given.entry(k).or_default().insert(order.clone());
            }
        }
        for (code, to) in &given {
            if to.len() > 1 {
                v.push(format!(
                    "1: code {} was given to orders {to:?} (sms.pending events and marketplace answers)",
                    codepool_domain::mask(code)
                ));
            }
        }
        let mut per_order: HashMap<String, u32> = HashMap::new();
        let mut per_user: HashMap<String, u64> = HashMap::new();
        for (id, d) in docs.iter().filter(|(_, d)| d.contains_key("issued_at")) {
            let order = d.get_str("order_id").unwrap_or_default().to_owned();
            if order.starts_with('\u{1}') {
                continue; // held by a hold or a bundle, not an order's
            }
            let status = d.get_i32("status").unwrap_or(-1);
            let pool = d.get_str("pool").unwrap_or_default();
            let issued = d.get_datetime("issued_at").ok().copied();
            // A replaced code stays on its line beside the line's new code.
            if !d.contains_key("replaced_by") {
                *per_order.entry(order.clone()).or_default() += 1;
            }
            // A replacement's code is not a second purchase.
            if pool == LIMITED && !d.contains_key("order_repl") {
                let uid = d.get_str("uid").unwrap_or_default().to_owned();
                *per_user.entry(uid).or_default() += 1;
            }
            if let (Some(exp), Some(at)) = (d.get_datetime("expires_at").ok(), issued) {
                if at >= *exp {
                    v.push(format!(
                        "2: order {order} got a code at {at} that expired at {exp}: {}",
                        describe(d)
                    ));
                }
            }
            if let (Ok(batch), Some(at)) = (d.get_object_id("batch_id"), issued) {
                for (b, recalled) in &recalls {
                    if *b == batch && at > *recalled {
                        v.push(format!("2: order {order} got a code of import {b} at {at}, after its recall at {recalled}: {}", describe(d)));
                    }
                }
            }
            if let Some(channel) = d
                .get_str("owner")
                .ok()
                .and_then(|o| o.strip_prefix("channel:"))
            {
                if !shop_pools(CHANNEL_SHOP).contains(&pool) || channel_of(&order) != Some(channel)
                {
                    v.push(format!(
                        "4: channel {channel}'s order {order} of shop {CHANNEL_SHOP} holds a code of pool {pool}"
                    ));
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
            if matches!(status, 1 | 2) && channel_of(&order).is_none() {
                let plain = &plain[id];
                match sent.get(plain) {
                    Some(to) if to.contains(&order) => {}
                    _ => v.push(format!(
                        "5: order {order}'s code {} has no sms.pending event",
                        codepool_domain::mask(plain)
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

    async fn check_imports(&self, docs: &HashMap<ObjectId, Document>, v: &mut Vec<String>) {
        let mut by_run: HashMap<ObjectId, ([u64; 5], u64)> = HashMap::new();
        for d in docs.values() {
            let Ok(run) = d.get_object_id("batch_id") else {
                continue;
            };
            let (by_status, other) = by_run.entry(run).or_default();
            match d.get_i32("status") {
                Ok(s @ 0..=4) => by_status[s as usize] += 1,
                _ => *other += 1,
            }
        }
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
            let (by_status, other) = by_run.get(&id).copied().unwrap_or_default();
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
            let owned = owner.is_some_and(|o| o.starts_with("shop:") || o.starts_with("channel:"));
            for c in self.all("codes", doc! {"order_id": order}).await {
                let payer = c.get_str("owner").ok();
                if owned && payer != owner {
                    v.push(format!(
                        "4: hold {id} of {owner:?} was paid by order {order} of {payer:?}"
                    ));
                }
            }
        }
    }

    /// Every key each marketplace order was given: in an answer (Eneba's
    /// PROVIDE, G2A's order and inventory) or by an upload to Kinguin.
    fn marketplace_keys(&self) -> Vec<(String, Vec<String>)> {
        let mut out: Vec<(String, Vec<String>)> = Vec::new();
        let h = self.history.lock().unwrap();
        for (order, ps) in &h.provisions {
            for p in ps {
                out.push((order.clone(), p.keys()));
            }
        }
        for (r, key) in self.kinguin.attempts() {
            out.push((format!("kinguin:kg:{r}"), vec![key]));
        }
        out
    }

    /// 13: a retried provision gets the same keys: every PROVIDE of an
    /// Eneba order that gave keys answered the same bytes, every G2A order
    /// answer the same items (and every read of its inventory some of
    /// them, under the same ids), every upload of a Kinguin reservation
    /// the same key; and every key given is one of its order's codes.
    fn check_provisions(
        &self,
        docs: &HashMap<ObjectId, Document>,
        plain: &HashMap<ObjectId, String>,
        v: &mut Vec<String>,
    ) {
        let mut of_order: HashMap<&str, HashSet<&str>> = HashMap::new();
        for (id, d) in docs {
            if let Ok(o) = d.get_str("order_id") {
                of_order.entry(o).or_default().insert(plain[id].as_str());
            }
        }
        let provisions = self.history.lock().unwrap().provisions.clone();
        let mut answers = 0;
        for (order, ps) in &provisions {
            answers += ps.len();
            let first_eneba = ps.iter().find_map(|p| match p {
                Provision::Eneba(b) => Some(b),
                _ => None,
            });
            let first_order = ps.iter().find_map(|p| match p {
                Provision::G2aOrder(items) => Some(items),
                _ => None,
            });
            for p in ps {
                let same = match (p, first_eneba, first_order) {
                    (Provision::Eneba(b), Some(first), _) => b == first,
                    (Provision::G2aOrder(items), _, Some(first)) => items == first,
                    (Provision::G2aRead(items), _, Some(first)) => {
                        items.iter().all(|i| first.contains(i))
                    }
                    (Provision::G2aRead(_), _, None) => false,
                    _ => true,
                };
                if !same {
                    let masked: Vec<String> =
                        p.keys().iter().map(|k| codepool_domain::mask(k)).collect();
                    v.push(format!(
                        "13: order {order} was given keys {masked:?} in {}, not the keys of its first provision",
                        p.kind()
                    ));
                }
                for k in p.keys() {
                    if !of_order
                        .get(order.as_str())
                        .is_some_and(|c| c.contains(k.as_str()))
                    {
                        v.push(format!(
                            "13: order {order} was given key {}, which is not one of its codes",
                            codepool_domain::mask(&k)
                        ));
                    }
                }
            }
        }
        let mut uploaded: BTreeMap<String, HashSet<String>> = BTreeMap::new();
        for (r, key) in self.kinguin.attempts() {
            uploaded.entry(r).or_default().insert(key);
        }
        let stock = self.kinguin.stock();
        for (r, keys) in &uploaded {
            let order = format!("kinguin:kg:{r}");
            let theirs = of_order.get(order.as_str());
            if keys.len() > 1
                || !keys
                    .iter()
                    .all(|k| theirs.is_some_and(|c| c.contains(k.as_str())))
            {
                v.push(format!(
                    "13: Kinguin reservation {r} was uploaded {} different key(s), not all its order's",
                    keys.len()
                ));
            }
            if stock.get(r).is_some_and(|k| !keys.contains(k)) {
                v.push(format!(
                    "13: Kinguin holds another key for reservation {r} than codepool sent"
                ));
            }
        }
        eprintln!(
            "checker: checked {answers} marketplace answers with keys, {} Kinguin reservations uploaded",
            uploaded.len()
        );
    }

    /// 14: no hold outlives its cancellation or its time: a marketplace
    /// order whose cancellation (or release) was answered holds no code,
    /// no hold past its time still holds its codes once the sweeps ran,
    /// and no code is held for a hold that ended.
    async fn check_hold_ends(&self, docs: &HashMap<ObjectId, Document>, v: &mut Vec<String>) {
        let cancelled = self.history.lock().unwrap().cancelled.clone();
        let holds = self.all("holds", doc! {}).await;
        let grace = bson::DateTime::from_millis(bson::DateTime::now().timestamp_millis() - 20_000);
        let mut by_nonce: HashMap<&str, &Document> = HashMap::new();
        for h in &holds {
            if let Ok(n) = h.get_str("nonce") {
                by_nonce.insert(n, h);
            }
            let held = h.get_str("state") == Ok("held");
            if held && h.get_datetime("expires_at").is_ok_and(|e| *e < grace) {
                v.push(format!(
                    "14: hold {} is 20 s past its time and still holds its codes: {h}",
                    h.get_str("hold_id").unwrap_or_default()
                ));
            }
        }
        let mut held = 0;
        for d in docs.values().filter(|d| d.get_i32("status") == Ok(4)) {
            held += 1;
            let key = d.get_str("order_id").unwrap_or_default();
            let Some(codepool_domain::SetAside::Hold { hold_id }) =
                codepool_domain::SetAside::of_key(key)
            else {
                continue;
            };
            let base = hold_id.split('#').next().unwrap_or_default();
            if cancelled.contains(base) {
                v.push(format!(
                    "14: marketplace order {base} holds a code after its cancellation was answered: {}",
                    describe(d)
                ));
            }
            let nonce = (key.strip_prefix(codepool_domain::HOLD_KEY_PREFIX))
                .and_then(|r| r.split(':').nth(1))
                .unwrap_or_default();
            if let Some(h) = by_nonce.get(nonce) {
                let state = h.get_str("state").unwrap_or_default();
                // A code set aside in the last 20 s may still be on its way
                // back (the sweep ends the hold, then releases its codes).
                let settled = d.get_datetime("issued_at").is_ok_and(|t| *t < grace);
                if state != "held" && settled {
                    v.push(format!(
                        "14: a code is held for hold {hold_id}, which is {state}: {}",
                        describe(d)
                    ));
                }
            }
        }
        eprintln!(
            "checker: checked {} holds, {held} codes held, {} marketplace orders cancelled",
            holds.len(),
            cancelled.len()
        );
    }

    /// 8: a replaced code is void, keeps its order and line, and is never
    /// given again; a replacement's new code is its line's, and no code is
    /// given by two replacements; one replacement id was answered with one
    /// new code, whatever door and however often it was asked.
    async fn check_replacements(&self, docs: &HashMap<ObjectId, Document>, v: &mut Vec<String>) {
        for (id, d) in docs {
            let replaced =
                d.get_str("void_reason") == Ok("replaced") || d.contains_key("replaced_by");
            if replaced && d.get_i32("status") != Ok(3) {
                v.push(format!(
                    "8: code {id} was replaced, and is given again: {}",
                    describe(d)
                ));
            }
        }
        let mut olds: HashMap<ObjectId, Vec<String>> = HashMap::new();
        let mut news: HashMap<ObjectId, Vec<String>> = HashMap::new();
        for r in self.all("replacements", doc! {}).await {
            // The caller's id: the document's key is scoped by its owner.
            let rid = (r.get_str("replacement_id").or_else(|_| r.get_str("_id")))
                .unwrap_or_default()
                .to_owned();
            let order = r.get_str("order_id").unwrap_or_default();
            let state = r.get_str("state").unwrap_or_default();
            let (n, line) = (int(&r, "n"), int(&r, "line"));
            let Ok(old) = r.get_object_id("old_code") else {
                continue;
            };
            if matches!(state, "waiting" | "done") {
                olds.entry(old).or_default().push(rid.clone());
                match docs.get(&old) {
                    Some(d)
                        if d.get_str("replaced_by") == Ok(rid.as_str())
                            && d.get_i32("status") == Ok(3)
                            && d.get_str("order_id") == Ok(order) => {}
                    d => v.push(format!(
                        "8: replacement {rid} ({state}) of order {order} line {line:?}: its old code {old} is {}",
                        d.map_or("missing".to_owned(), describe)
                    )),
                }
            }
            if state != "done" {
                continue;
            }
            let Ok(new) = r.get_object_id("new_code") else {
                v.push(format!(
                    "8: replacement {rid} of order {order} is done without a new code"
                ));
                continue;
            };
            news.entry(new).or_default().push(rid.clone());
            match docs.get(&new) {
                Some(d)
                    if new != old
                        && d.get_str("order_id") == Ok(order)
                        && int(d, "order_line").unwrap_or(0) == line.unwrap_or(0)
                        && int(d, "order_repl") == n => {}
                d => v.push(format!(
                    "8: replacement {rid} (#{n:?}) of order {order} line {line:?} gave code {new}, which is {}",
                    d.map_or("missing".to_owned(), describe)
                )),
            }
        }
        for (code, rids) in olds.iter().filter(|(_, r)| r.len() > 1) {
            v.push(format!("8: code {code} was replaced by {rids:?}"));
        }
        for (code, rids) in news.iter().filter(|(_, r)| r.len() > 1) {
            v.push(format!("8: code {code} was given by replacements {rids:?}"));
        }
        eprintln!(
            "checker: checked {} replaced codes, {} replacements done",
            olds.len(),
            news.len()
        );
        let answered = self.history.lock().unwrap().replaced.clone();
        let mut by_rid: HashMap<&str, HashSet<&str>> = HashMap::new();
        let mut by_grant: HashMap<&str, HashSet<&str>> = HashMap::new();
        for (rid, grant) in &answered {
            by_rid.entry(rid).or_default().insert(grant);
            by_grant.entry(grant).or_default().insert(rid);
        }
        for (rid, grants) in by_rid.iter().filter(|(_, g)| g.len() > 1) {
            v.push(format!(
                "8: replacement {rid} was answered with new codes of grants {grants:?}"
            ));
        }
        for (grant, rids) in by_grant.iter().filter(|(_, r)| r.len() > 1) {
            v.push(format!(
                "8: replacements {rids:?} were all answered with the code of grant {grant}"
            ));
        }
    }

    /// 9: a code is redeemed once. Every answer that says a code is used
    /// (a redemption's 200, an `already-redeemed` 409, a check) names the
    /// time the code records; a redemption's 200 names the redemption id
    /// the code records; one platform's id redeemed one code; and the
    /// audit records no redemption twice, nor more codes used than are.
    async fn check_redemptions(&self, docs: &HashMap<ObjectId, Document>, v: &mut Vec<String>) {
        let lookups = self.history.lock().unwrap().lookups.clone();
        let used_ms = |d: &Document| d.get_datetime("used_at").ok().map(|t| t.timestamp_millis());
        let mut by_rid: HashMap<(usize, &str), HashSet<ObjectId>> = HashMap::new();
        for l in &lookups {
            let (Some(id), Some((status, body))) = (l.doc, &l.answer) else {
                continue;
            };
            let Some(d) = docs.get(&id) else {
                continue;
            };
            let said_at = body["redeemed_at"]
                .as_str()
                .and_then(|s| chrono::DateTime::parse_from_rfc3339(s).ok())
                .map(|t| t.timestamp_millis());
            let rid = l.rid.as_deref().unwrap_or_default();
            let kind = body["type"].as_str().unwrap_or_default();
            let says_used = match (l.redeem, status) {
                (true, 200) => {
                    by_rid.entry((l.platform, rid)).or_default().insert(id);
                    let tag =
                        (d.get_document("redemption").ok()).and_then(|t| t.get_str("id").ok());
                    if tag != Some(rid) || d.get_i32("status") != Ok(2) {
                        v.push(format!(
                            "9: redemption {rid} (platform {}) of code {id} was answered 200, but the code records redemption {tag:?}: {}",
                            l.platform,
                            describe(d)
                        ));
                    }
                    true
                }
                (true, 409) => kind.ends_with("already-redeemed"),
                (false, 200) => body["state"] == "used",
                _ => false,
            };
            if says_used && said_at != used_ms(d) {
                v.push(format!(
                    "9: a {} of code {id} (id {rid:?}) answered {status} redeemed at {:?}, but the code was used at {:?}: {}",
                    if l.redeem { "redemption" } else { "check" },
                    body["redeemed_at"],
                    d.get_datetime("used_at").ok(),
                    describe(d)
                ));
            }
        }
        for ((platform, rid), ids) in by_rid.iter().filter(|(_, i)| i.len() > 1) {
            v.push(format!(
                "9: redemption id {rid} of platform {platform} redeemed {} codes: {ids:?}",
                ids.len()
            ));
        }
        let tags: HashSet<&str> = (docs.values())
            .filter_map(|d| d.get_document("redemption").ok()?.get_str("id").ok())
            .collect();
        let mut audited = 0u64;
        let mut per_rid: HashMap<String, u32> = HashMap::new();
        for a in self.all("audit", doc! {"kind": "redeem"}).await {
            let what = a.get_str("what").unwrap_or_default();
            audited += (what.split(" code(s) used").next())
                .and_then(|s| s.rsplit(' ').next())
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or(0);
            if let Some(rid) =
                (what.split("redemption id \"").nth(1)).and_then(|r| r.split('"').next())
            {
                *per_rid.entry(rid.to_owned()).or_default() += 1;
            }
        }
        for (rid, n) in &per_rid {
            if *n > 1 {
                v.push(format!("9: redemption {rid} is audited {n} times"));
            }
            if !tags.contains(rid.as_str()) {
                v.push(format!(
                    "9: redemption {rid} is audited, but no code records it"
                ));
            }
        }
        let used = docs
            .values()
            .filter(|d| d.get_i32("status") == Ok(2))
            .count() as u64;
        eprintln!(
            "checker: checked {used} codes used, {audited} redemptions audited, {} checks and redemptions by code over http",
            lookups.len()
        );
        // A process killed between a redemption and its record leaves one
        // fewer; a code redeemed twice, one more.
        if audited > used {
            v.push(format!(
                "9: the audit records {audited} codes used by redemptions, but {used} codes are used"
            ));
        }
    }

    /// 10: no two code documents read the same: not in one pool under its
    /// look-alike rule, not in two pools under case and width folding,
    /// and no generated code under the strictest rule (`O`/`0`, `I`/`L`/`1`
    /// folded too).
    async fn check_lookalikes(
        &self,
        docs: &HashMap<ObjectId, Document>,
        plain: &HashMap<ObjectId, String>,
        v: &mut Vec<String>,
    ) {
        let generated: HashSet<ObjectId> =
            (self.all("imports", doc! {"source": "generated"}).await)
                .iter()
                .filter_map(|r| r.get_object_id("_id").ok())
                .collect();
        let strict = LookAlikeRule {
            case_sensitive: false,
            confusables: true,
        };
        let mut across: HashMap<String, Vec<ObjectId>> = HashMap::new();
        let mut within: HashMap<(String, String), Vec<ObjectId>> = HashMap::new();
        let mut strictly: HashMap<String, Vec<ObjectId>> = HashMap::new();
        for (id, d) in docs {
            let pool = d.get_str("pool").unwrap_or_default().to_owned();
            let code = &plain[id];
            let rule = LookAlikeRule {
                case_sensitive: false,
                confusables: pool == GEN,
            };
            across
                .entry(codepool_domain::fold_by(code, LookAlikeRule::default()))
                .or_default()
                .push(*id);
            within
                .entry((pool, codepool_domain::fold_by(code, rule)))
                .or_default()
                .push(*id);
            strictly
                .entry(codepool_domain::fold_by(code, strict))
                .or_default()
                .push(*id);
        }
        let mut groups: Vec<(&str, Vec<ObjectId>)> = Vec::new();
        groups.extend((across.into_values()).map(|g| ("in any pools", g)));
        groups.extend((within.into_values()).map(|g| ("in one pool", g)));
        groups.extend(
            (strictly.into_values())
                .filter(|g| g.iter().any(|id| generated.contains(id)))
                .map(|g| ("as a generated code", g)),
        );
        // One line per kind and set of imports: a race of two imports
        // gives every code of the file twice.
        let mut told = HashSet::new();
        let mut by_runs: BTreeMap<(&str, Vec<String>), Vec<String>> = BTreeMap::new();
        for (how, mut ids) in groups.into_iter().filter(|(_, g)| g.len() > 1) {
            ids.sort();
            if !told.insert(ids.clone()) {
                continue;
            }
            let runs: Vec<String> = (ids.iter())
                .map(|id| {
                    let d = &docs[id];
                    format!(
                        "pool {} import {}",
                        d.get_str("pool").unwrap_or_default(),
                        d.get_object_id("batch_id")
                            .map_or("-".into(), |b| b.to_hex())
                    )
                })
                .collect();
            let each: Vec<String> = (ids.iter())
                .map(|id| {
                    format!(
                        "{} {}",
                        codepool_domain::mask(&plain[id]),
                        describe(&docs[id])
                    )
                })
                .collect();
            by_runs
                .entry((how, runs))
                .or_default()
                .push(each.join(" and "));
        }
        for ((how, runs), codes) in by_runs {
            v.push(format!(
                "10: {} code(s) are held {how} more than once, by {}; the first: {}",
                codes.len(),
                runs.join(", "),
                codes[0]
            ));
        }
    }

    /// 11: a code never sold, a code of a pool the platform may not see,
    /// and a code no pool holds all get the answer of a code no pool holds
    /// (or a 429 or 503, or none from a killed process), from check and
    /// redeem alike; and no code never sold is used.
    fn check_never_sold(&self, docs: &HashMap<ObjectId, Document>, v: &mut Vec<String>) {
        for (id, d) in docs {
            if never_sold(d) && (d.contains_key("used_at") || d.contains_key("redemption")) {
                v.push(format!(
                    "11: code {id} was never sold, but is marked used: {}",
                    describe(d)
                ));
            }
        }
        let lookups = self.history.lock().unwrap().lookups.clone();
        let mut hidden = 0;
        for l in &lookups {
            let why = match l.doc.map(|id| docs.get(&id)) {
                None => "exists nowhere",
                Some(None) => continue,
                Some(Some(d)) if never_sold(d) => "was never sold",
                Some(Some(d)) => {
                    let pool = d.get_str("pool").unwrap_or_default();
                    match PLATFORMS[l.platform] {
                        Some(shop) if !shop_pools(shop).contains(&pool) => {
                            "is of a pool the key may not see"
                        }
                        _ => continue,
                    }
                }
            };
            hidden += 1;
            match &l.answer {
                None | Some((429 | 503, _)) => {}
                Some((404, b)) if said(b) == self.unknown[l.platform] => {}
                Some((status, body)) => v.push(format!(
                    "11: a {} of code {} (which {why}) by platform {:?} was answered {status} {body}, not as a code no pool holds ({}); the code: {}",
                    if l.redeem { "redemption" } else { "check" },
                    l.doc.map_or("-".to_owned(), |id| id.to_hex()),
                    PLATFORMS[l.platform],
                    self.unknown[l.platform],
                    l.doc.and_then(|id| docs.get(&id)).map_or("-".to_owned(), describe)
                )),
            }
        }
        eprintln!(
            "checker: checked {hidden} answers about codes never sold, unknown or out of sight"
        );
    }

    /// 12: every generation run (but a recalled one) is done and holds
    /// exactly its count: killed mid-run and resumed, made by an API
    /// process killed under it, or not.
    async fn check_generations(&self, docs: &HashMap<ObjectId, Document>, v: &mut Vec<String>) {
        let killed = self.history.lock().unwrap().killed_runs.clone();
        let mut held: HashMap<ObjectId, u64> = HashMap::new();
        for d in docs.values() {
            if let Ok(b) = d.get_object_id("batch_id") {
                *held.entry(b).or_default() += 1;
            }
        }
        let runs = self.all("imports", doc! {"source": "generated"}).await;
        eprintln!(
            "checker: checked {} generation runs, {} of them killed mid-run",
            runs.len(),
            killed.len()
        );
        let recorded: HashSet<ObjectId> = runs
            .iter()
            .filter_map(|r| r.get_object_id("_id").ok())
            .collect();
        for run in killed.iter().filter(|r| !recorded.contains(r)) {
            v.push(format!(
                "12: generation run {run}, killed and resumed, has no record"
            ));
        }
        for r in runs {
            let Ok(id) = r.get_object_id("_id") else {
                continue;
            };
            if r.contains_key("recalled_at") {
                continue;
            }
            let spec = r.get_document("generation").ok();
            let count = spec.and_then(|s| int(s, "count")).unwrap_or(-1);
            let status = r.get_str("status").unwrap_or_default();
            let n = held.get(&id).copied().unwrap_or(0) as i64;
            let how = if killed.contains(&id) {
                ", killed mid-run and resumed"
            } else {
                ""
            };
            if status != "done" || n != count {
                v.push(format!(
                    "12: generation run {id} of pool {:?}{how} is {status:?} and holds {n} codes, asked for {count}: {r}",
                    r.get_str("pool").unwrap_or_default()
                ));
            }
        }
    }
}

/// A code never sold to an order: in stock, held (by a hold or a bundle's
/// item), or voided without an order (expired or recalled in stock or
/// held).
fn never_sold(d: &Document) -> bool {
    match d.get_i32("status") {
        Ok(0 | 4) => true,
        Ok(3) => !d.get_str("order_id").is_ok_and(|o| !o.starts_with('\u{1}')),
        _ => false,
    }
}

/// A code document's code, opened with the run's keys (as
/// [`TestEnv::plain_code`] does, without reading the whole document).
fn open_code(ring: &codepool_vault::Keyring, d: &Document) -> String {
    let (Ok(id), Ok(pool), Ok(key), Ok(sealed)) = (
        d.get_object_id("_id"),
        d.get_str("pool"),
        d.get_str("key_id"),
        d.get_binary_generic("code_enc"),
    ) else {
        panic!("a sealed code: {}", describe(d));
    };
    let aad = codepool_store::crypto::code_aad(pool, id);
    ring.open(key, &aad, sealed).expect("the code opens")
}

/// A code document's state, for a finding: never its code.
fn describe(d: &Document) -> String {
    let mut out = Document::new();
    for k in [
        "_id",
        "pool",
        "status",
        "batch_id",
        "order_id",
        "order_line",
        "order_repl",
        "grant_no",
        "issued_at",
        "expires_at",
        "used_at",
        "redemption",
        "voided_at",
        "void_reason",
        "replaced_by",
        "owner",
    ] {
        if let Some(x) = d.get(k) {
            out.insert(k, x.clone());
        }
    }
    out.to_string()
}

/// An integer field, stored as either width.
fn int(d: &Document, k: &str) -> Option<i64> {
    d.get_i64(k)
        .ok()
        .or_else(|| d.get_i32(k).ok().map(i64::from))
}

async fn api(env: &TestEnv) -> ApiServer {
    ApiServer::start(
        env,
        &[
            "--rate-per-key",
            "1000000",
            "--redeem-misses-per-minute",
            "1000000",
            // Kinguin's uploads a killed process leased are taken up
            // within 8 s.
            "--channel-call-timeout",
            "2",
        ],
    )
    .await
}

/// The console's operator, an admin.
async fn operator(env: &TestEnv) {
    let args = [
        "operators",
        "add",
        "--name",
        OPERATOR,
        "--role",
        "admin",
        "--password-stdin",
    ];
    let mut child = env
        .command(&args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin
        .write_all(format!("{PASSWORD}\n").as_bytes())
        .await
        .unwrap();
    drop(stdin);
    let out = child.wait_with_output().await.unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Signs the operator in on the console at `addr`: its session cookie
/// (kept in MongoDB, so every API process takes it) and CSRF token.
async fn sign_in(addr: &str) -> (String, String) {
    let form = format!("name={OPERATOR}&password={}", form_part(PASSWORD));
    let headers = [("Content-Type", "application/x-www-form-urlencoded")];
    let (status, head, body) = raw_http(addr, "POST", "/console/signin", &headers, form.as_bytes())
        .await
        .expect("the console answers");
    assert_eq!(status, 303, "sign-in: {}", String::from_utf8_lossy(&body));
    let cookie = (head.lines())
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("set-cookie"))
        .and_then(|(_, v)| v.trim().split(';').next())
        .expect("a session cookie")
        .to_owned();
    let (status, _, page) = raw_http(
        addr,
        "GET",
        "/console/pools",
        &[("Cookie", cookie.as_str())],
        b"",
    )
    .await
    .expect("the console answers");
    assert_eq!(status, 200);
    let page = String::from_utf8_lossy(&page);
    let csrf = (page.split("name=\"csrf\" value=\"").nth(1))
        .and_then(|r| r.split('"').next())
        .expect("a CSRF token on the pools page")
        .to_owned();
    (cookie, csrf)
}

/// [`raw_http`] of a JSON body with a key: status and body.
async fn try_http(
    addr: &str,
    method: &str,
    path: &str,
    key: &str,
    body: &[u8],
) -> Option<(u16, Vec<u8>)> {
    let bearer = format!("Bearer {key}");
    let headers = [
        ("Content-Type", "application/json"),
        ("Authorization", bearer.as_str()),
    ];
    raw_http(addr, method, path, &headers, body)
        .await
        .map(|(s, _, b)| (s, b))
}

/// How an HTTP exchange ended: its status, and a problem's type.
fn status_of(answer: &Option<(u16, Vec<u8>)>) -> String {
    match answer {
        None => "no answer".to_owned(),
        Some((s, b)) => match json_or_null(b)["type"].as_str() {
            Some(t) => format!("{s} {}", t.rsplit('/').next().unwrap_or(t)),
            None => s.to_string(),
        },
    }
}

fn exit_of(out: &std::process::Output) -> String {
    match out.status.code() {
        Some(c) => format!("exit {c}"),
        None => "killed".to_owned(),
    }
}

fn json_or_null(body: &[u8]) -> Value {
    serde_json::from_slice(body).unwrap_or(Value::Null)
}

/// A problem's body without what differs between two answers that say
/// the same: the request id.
fn said(v: &Value) -> Value {
    let mut v = v.clone();
    if let Some(o) = v.as_object_mut() {
        o.remove("request_id");
        o.remove("instance");
    }
    v
}

/// A form field's value, percent-encoded.
fn form_part(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// An order id in a path.
fn path_part(s: &str) -> String {
    form_part(s)
}
