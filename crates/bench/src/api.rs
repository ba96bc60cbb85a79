//! `codepool-bench api`: the HTTP door (issue 33's "Speed"), measured in one
//! run on the same servers against
//!
//! - the AMQP dispatcher on the same number of purchases (quantity 1),
//!   preloaded before its clock starts, as `dispatch` runs it;
//! - a baseline handler on the same HTTP stack (axum on hyper, the same
//!   client) doing what the peers do: one journaled `findOneAndUpdate` per
//!   request on a pool of the same `codes` collection (same shape, indexes
//!   and validator), opening the sealed code for the answer.
//!
//! Then the same orders again (already granted: repeats), round 1's AMQP
//! purchases again (the dispatcher's repeats), and the latency
//! of a grant at a fixed rate, open loop: requests start on a schedule
//! whatever the server does, and each counts from its scheduled start.
//!
//! The API runs in this process, built as `codepool api` builds it, with
//! the per-key rate limit raised out of the way. Its clients are hyper's
//! pooling client with keep-alive: `--clients` tasks, each sending its
//! next order as soon as the last is answered. No dispatcher runs during
//! the HTTP phases (the API publishes its own events with confirms), and
//! the API is idle while the dispatcher runs.

use std::collections::HashSet;
use std::future::IntoFuture;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use codepool_api::{Api, ApiConfig, Scope};
use codepool_broker::Publisher;
use codepool_dispatcher::DispatcherConfig;
use codepool_domain::{CodeStatus, Purchase};
use codepool_store::Store;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::{HttpConnector, HttpInfo};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use mongodb::bson::{doc, DateTime, Document};
use serde_json::{json, Value};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::dispatch::{check_dispatched, Measured};
use crate::inproc::{self, depth};
use crate::{describe_cpu, metric_sum, ms, percentile, CpuSnapshot, MachineCpu, MongoOps, Scratch};

/// HTTP grants against the AMQP dispatcher and a findOneAndUpdate handler.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Example:\n  RUST_LOG=warn codepool-bench --out-dir target/bench api --orders 20000 --clients 64\n\nWrites api.json. RUST_LOG=warn keeps per-request logging out of the measurement."
)]
pub struct ApiBenchArgs {
    /// Fresh orders over HTTP (and purchases over AMQP, requests to the
    /// baseline handler, repeats).
    #[arg(long, default_value_t = 20_000, value_parser = clap::value_parser!(u64).range(100..=1_000_000))]
    pub orders: u64,
    /// Concurrent keep-alive clients of the closed-loop phases.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub clients: u64,
    /// Requests per second of the open-loop latency phase.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=20_000))]
    pub rate: u32,
    /// Seconds of the open-loop latency phase.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=600))]
    pub seconds: u32,
    /// Rounds of the fresh-grant comparison: HTTP orders, the dispatcher,
    /// and the dispatcher held to the HTTP batches' mean size, in turn
    /// (the order reversed every other round); the median round is judged.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=9))]
    pub rounds: u64,
    /// The batch size of the held dispatcher, instead of the HTTP
    /// batches' mean (e.g. --clients: every client in one batch).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=256))]
    pub held_batch: Option<u64>,
    /// Print the results as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Issue 33's goals.
const HTTP_OVER_AMQP: f64 = 0.8;
const HTTP_OVER_BASELINE: f64 = 5.0;
const P99_MS: f64 = 20.0;
const REPEATS_OVER_FRESH: f64 = 3.0;
/// Issue 57: the servers' CPU per HTTP grant at most 1.3× the dispatcher's.
const CPU_HTTP_OVER_AMQP: f64 = 1.3;
/// The per-key limit of the benchmark's API (the product's default, 200/s,
/// would answer most of the load with 429).
const RATE_PER_KEY: u32 = 10_000_000;
/// Orders sent before a measurement (connections, hot pool, caches).
const WARM: usize = 200;
const POOL: &str = "api";
const BASELINE_POOL: &str = "baseline";

/// The batches the dispatcher is let make.
#[derive(Clone, Copy, PartialEq)]
enum Batches {
    /// Its own (up to `DispatcherConfig::DEFAULT_BATCH_SIZE`).
    Own,
    /// At most the mean size of the HTTP batches measured before it.
    AsHttp,
}

/// The pool (and order-id prefix) of a dispatcher phase.
fn amqp_pool(round: usize, batches: Batches) -> String {
    match batches {
        Batches::Own => format!("amqp{round}"),
        Batches::AsHttp => format!("amqps{round}"),
    }
}

/// One round of fresh grants: HTTP, the dispatcher, and the dispatcher
/// held to HTTP's batch size.
struct Round {
    http: HttpRun,
    amqp: HttpRun,
    amqp_as_http: HttpRun,
    /// The batch size the held dispatcher was let make.
    as_http_batch: usize,
}

impl Round {
    /// Its three phases each passed their checks.
    fn checks_ok(&self) -> bool {
        [&self.http, &self.amqp, &self.amqp_as_http]
            .iter()
            .all(|r| r.extra["checks"]["ok"].as_bool() == Some(true))
    }

    fn ratio(&self) -> f64 {
        self.http.m.per_sec() / self.amqp.m.per_sec().max(1e-9)
    }

    fn json(&self, round: usize) -> Value {
        let cpu = |r: &HttpRun| crate::server_and_clients_ms(&r.m.cpu, r.m.items).0;
        json!({
            "round": round + 1,
            "http_per_sec": self.http.m.per_sec(),
            "amqp_per_sec": self.amqp.m.per_sec(),
            "amqp_as_http_per_sec": self.amqp_as_http.m.per_sec(),
            "http_mean_batch": self.http.extra["stages"]["mean_api_batch_size"],
            "amqp_as_http_batch_size": self.as_http_batch,
            "server_cpu_ms_per_item": {"http": cpu(&self.http), "amqp": cpu(&self.amqp), "amqp_as_http": cpu(&self.amqp_as_http)},
            "cpu_ms_per_item_by_process": {
                "http": per_item(&self.http), "amqp": per_item(&self.amqp), "amqp_as_http": per_item(&self.amqp_as_http),
            },
            "mongod_per_item": {
                "http": self.http.extra["mongod_per_item"], "amqp": self.amqp.extra["mongod_per_item"],
                "amqp_as_http": self.amqp_as_http.extra["mongod_per_item"],
            },
            "checks_ok": self.checks_ok(),
            "http_over_amqp": self.ratio(),
            "server_cpu_http_over_amqp": cpu(&self.http) / cpu(&self.amqp).max(1e-9),
            "server_cpu_http_over_amqp_as_http": cpu(&self.http) / cpu(&self.amqp_as_http).max(1e-9),
            "server_cpu_amqp_as_http_over_amqp": cpu(&self.amqp_as_http) / cpu(&self.amqp).max(1e-9),
        })
    }
}

/// A phase's CPU milliseconds per item, by process.
fn per_item(r: &HttpRun) -> Value {
    let per = |s: f64| s * 1000.0 / r.m.items.max(1) as f64;
    Value::Object(
        (r.m.cpu.iter())
            .map(|(p, s)| ((*p).to_owned(), json!(per(*s))))
            .collect(),
    )
}

/// The rounds of fresh grants, the median one (by HTTP / AMQP) apart, and
/// the codes round 1's HTTP orders got (the repeats must get them again).
struct Rounds {
    median: Round,
    all: Vec<Value>,
    /// Every phase of every round passed its checks.
    checks_ok: bool,
    first_codes: Vec<Option<String>>,
}

impl Rounds {
    /// The median over the rounds of one of their ratios.
    fn median_of(&self, key: &str) -> f64 {
        let mut v: Vec<f64> = self.all.iter().filter_map(|r| r[key].as_f64()).collect();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    }
}

/// `--rounds` rounds of HTTP orders, the dispatcher, and the dispatcher
/// held to the HTTP batches' mean size (measured in the rounds before),
/// the order reversed every other round.
async fn fresh_rounds(
    args: &ApiBenchArgs,
    scratch: &'static Scratch,
    http: &Http,
) -> anyhow::Result<Rounds> {
    let n = args.orders as usize;
    let (mut done, mut all, mut first_codes) = (Vec::new(), Vec::new(), Vec::new());
    let mut batches_seen: Vec<f64> = Vec::new();
    for round in 0..args.rounds as usize {
        let tag = format!("http{round}");
        let (mut h, mut a, mut s) = (None, None, None);
        let http_first = round % 2 == 0;
        for step in 0..3 {
            match (step, http_first) {
                (0, true) | (2, false) => {
                    say(
                        args,
                        format!(
                            "round {}: HTTP grants, {n} fresh orders from {} keep-alive clients …",
                            round + 1,
                            args.clients
                        ),
                    );
                    let run = http_phase(scratch, http, args, (Phase::Fresh, &tag), None).await?;
                    batches_seen.extend(run.extra["stages"]["mean_api_batch_size"].as_f64());
                    h = Some(run);
                }
                (1, _) => {
                    say(
                        args,
                        format!(
                            "round {}: AMQP dispatcher, {n} purchases, preloaded …",
                            round + 1
                        ),
                    );
                    let pool = amqp_pool(round, Batches::Own);
                    a = Some(
                        amqp_phase(scratch, n, &pool, DispatcherConfig::DEFAULT_BATCH_SIZE).await?,
                    );
                }
                _ => {
                    let size = held_size(args, &batches_seen);
                    say(
                        args,
                        format!(
                            "round {}: AMQP dispatcher held to batches of {size}, {n} purchases …",
                            round + 1
                        ),
                    );
                    let pool = amqp_pool(round, Batches::AsHttp);
                    s = Some((amqp_phase(scratch, n, &pool, size).await?, size));
                }
            }
        }
        let ((amqp_as_http, as_http_batch), http, amqp) =
            (s.expect("ran"), h.expect("ran"), a.expect("ran"));
        if round == 0 {
            first_codes.clone_from(&http.codes);
        }
        let r = Round {
            http,
            amqp,
            amqp_as_http,
            as_http_batch,
        };
        all.push(r.json(round));
        done.push(r);
    }
    done.sort_by(|a, b| a.ratio().total_cmp(&b.ratio()));
    let checks_ok = done.iter().all(Round::checks_ok);
    let median = done.swap_remove(done.len() / 2);
    Ok(Rounds {
        median,
        all,
        checks_ok,
        first_codes,
    })
}

/// The held dispatcher's batch size: `--held-batch`, or the mean of the
/// HTTP batches seen so far.
fn held_size(args: &ApiBenchArgs, batches_seen: &[f64]) -> usize {
    match args.held_batch {
        Some(b) => b as usize,
        None => mean(batches_seen).map_or(64, |m| m.round().max(1.0) as usize),
    }
}

fn mean(v: &[f64]) -> Option<f64> {
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

pub async fn run(
    args: ApiBenchArgs,
    scratch: &'static Scratch,
    out_dir: &Path,
) -> anyhow::Result<()> {
    let result = measure(&args, scratch, out_dir).await;
    if let Err(e) = crate::delete_topology(&scratch.cfg, &[]).await {
        tracing::warn!(error = %e, "could not remove the benchmark queues");
    }
    result
}

fn say(args: &ApiBenchArgs, s: impl std::fmt::Display) {
    if !args.json {
        eprintln!("{s}");
    }
}

async fn measure(
    args: &ApiBenchArgs,
    scratch: &'static Scratch,
    out_dir: &Path,
) -> anyhow::Result<()> {
    let n = args.orders as usize;
    let (api, token) = prepare(args, scratch).await?;
    let http = Http::new(api.addr, &token, args.clients as usize);
    let rounds = fresh_rounds(args, scratch, &http).await?;
    let (fresh, amqp) = (&rounds.median.http, &rounds.median.amqp);
    say(args, format!("HTTP repeats: round 1's {n} orders again …"));
    let repeats = http_phase(
        scratch,
        &http,
        args,
        (Phase::Repeat, "http0"),
        Some(&rounds.first_codes),
    )
    .await?;
    say(
        args,
        format!("AMQP repeats: round 1's {n} purchases again …"),
    );
    let pool = amqp_pool(0, Batches::Own);
    let mut amqp_repeats =
        amqp_phase(scratch, n, &pool, DispatcherConfig::DEFAULT_BATCH_SIZE).await?;
    amqp_repeats.m.name = "AMQP repeats";
    amqp_repeats.m.what = "round 1's purchases published again, already granted: answered from one read, each event sent again";
    say(
        args,
        format!("baseline handler: {n} requests, one findOneAndUpdate each …"),
    );
    let baseline = baseline_phase(scratch, args, &token).await?;
    let mut runs = Vec::new();
    for round in 0..args.rounds {
        say(
            args,
            format!(
                "latency, run {}: {}/s for {} s, open loop …",
                round + 1,
                args.rate,
                args.seconds
            ),
        );
        let http = Http::new(api.addr, &token, args.clients as usize);
        runs.push(latency_phase(scratch, args, &http, &format!("lat{round}")).await?);
    }
    let all = |key: &str| {
        runs.iter()
            .map(|r| r[key].as_u64().unwrap_or(0))
            .sum::<u64>()
    };
    let (sent, granted) = (all("sent"), all("granted"));
    let mut latency = crate::latency::median_run(runs);
    latency["all_runs"] = json!({"sent": sent, "granted": granted});
    api.stop().await?;
    let granted = crate::issued_and_distinct_orders(&scratch.store, POOL).await?;
    let report = report_json(
        args,
        [fresh, &repeats, &baseline, &amqp_repeats],
        amqp,
        (&rounds, &latency),
        granted,
    );
    let (rendered, path) = crate::write_report(out_dir, "api.json", &report)?;
    if args.json {
        println!("{rendered}");
    } else {
        print_table(args, &report);
        println!("written to {}", path.display());
    }
    anyhow::ensure!(
        report["checks"]["ok"].as_bool() == Some(true),
        "inconsistent results (see checks in {})",
        path.display()
    );
    Ok(())
}

/// Fills the three pools, creates the API key and starts the API.
async fn prepare(
    args: &ApiBenchArgs,
    scratch: &'static Scratch,
) -> anyhow::Result<(ApiServer, String)> {
    let n = args.orders as usize;
    let open = args.rate as usize * args.seconds as usize * args.rounds as usize;
    let rounds = args.rounds as usize;
    let mut sizes = vec![
        (POOL.to_owned(), rounds * (WARM + n) + open),
        (BASELINE_POOL.to_owned(), WARM + n),
    ];
    for round in 0..rounds {
        for batch in [Batches::Own, Batches::AsHttp] {
            sizes.push((amqp_pool(round, batch), n));
        }
    }
    let total: usize = sizes.iter().map(|(_, k)| k).sum();
    say(
        args,
        format!("importing {total} codes into {} …", scratch.cfg.db),
    );
    inproc::fill_pools(scratch, &sizes, 4).await?;
    // The metrics recorder first: the phases read the batch sizes from it.
    let _ = crate::metrics();
    let scopes = [Scope::OrdersWrite];
    let actor = codepool_issuance::audit::Actor::os_user("bench", "localhost", "codepool-bench");
    let token = codepool_api::keys::create(&scratch.store, "bench", &scopes, &actor)
        .await?
        .token;
    Ok((ApiServer::start(scratch).await?, token))
}

/// The API server in this process, built as `codepool api` builds it.
pub(crate) struct ApiServer {
    pub(crate) addr: SocketAddr,
    api: Arc<Api>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl ApiServer {
    pub(crate) async fn start(scratch: &'static Scratch) -> anyhow::Result<Self> {
        let (cfg, store) = (&scratch.cfg, &scratch.store);
        let parts = codepool::context::parts(cfg, store)?;
        let conn = Arc::new(codepool_broker::connect(&cfg.amqp_url, "codepool-bench-api").await?);
        let publisher = Publisher::new(&conn, cfg.topology())
            .await?
            .as_user(&Publisher::user_of(&cfg.amqp_url));
        cfg.topology().declare(publisher.channel()).await?;
        // The per-key limits out of the way: every client is one key.
        let config = ApiConfig {
            rate_per_key: RATE_PER_KEY,
            redeem_misses_per_minute: RATE_PER_KEY,
            ..ApiConfig::default()
        };
        let core = codepool_issuance::Core::new(parts, conn, publisher);
        let api = Api::new(core, config);
        let stop = CancellationToken::new();
        let listen: SocketAddr = "127.0.0.1:0".parse()?;
        let (addr, task) =
            codepool_api::serve(listen, api.clone(), axum::Router::new(), stop.clone()).await?;
        Ok(Self {
            addr,
            api,
            stop,
            task,
        })
    }

    pub(crate) async fn stop(self) -> anyhow::Result<()> {
        self.stop.cancel();
        self.task.await.context("the API server panicked")??;
        let broker = self.api.broker();
        broker.publisher.settle().await;
        let _ = broker.conn.close(200, "benchmark done").await;
        Ok(())
    }
}

/// hyper's pooling client (keep-alive) posting orders to one server.
#[derive(Clone)]
pub(crate) struct Http {
    client: Client<HttpConnector, Full<Bytes>>,
    uri: Uri,
    auth: Arc<str>,
}

/// What one request got back.
pub(crate) struct Answer {
    pub(crate) status: u16,
    /// The first code of the answer.
    pub(crate) code: Option<String>,
    /// When its claim was stamped (`issued_at`).
    issued_at: Option<String>,
    /// The client's port: which connection carried it.
    port: Option<u16>,
}

impl Http {
    fn new(addr: SocketAddr, token: &str, clients: usize) -> Self {
        Self::to(addr, token, clients, "/v1/orders")
    }

    /// A client posting to `path` of the server at `addr`.
    pub(crate) fn to(addr: SocketAddr, token: &str, clients: usize, path: &str) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(clients)
            .pool_idle_timeout(Duration::from_secs(60))
            .build(connector);
        Self {
            client,
            uri: format!("http://{addr}{path}").parse().expect("a valid URI"),
            auth: format!("Bearer {token}").into(),
        }
    }

    pub(crate) async fn post(&self, body: Vec<u8>) -> anyhow::Result<Answer> {
        let req = axum::http::Request::post(self.uri.clone())
            .header(header::AUTHORIZATION, &*self.auth)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))?;
        let res = self
            .client
            .request(req)
            .await
            .with_context(|| format!("POST {}", self.uri.path()))?;
        let status = res.status().as_u16();
        let port = res
            .extensions()
            .get::<HttpInfo>()
            .map(|i| i.local_addr().port());
        let bytes = res.into_body().collect().await?.to_bytes();
        let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        let code = v["codes"][0]["code"].as_str().map(str::to_owned);
        let issued_at = v["codes"][0]["issued_at"].as_str().map(str::to_owned);
        Ok(Answer {
            status,
            code,
            issued_at,
            port,
        })
    }
}

impl Http {
    /// `POST` `body` to the client's path: the status and the answer's
    /// bytes as they came.
    pub(crate) async fn post_raw(&self, body: Vec<u8>) -> anyhow::Result<(u16, Bytes)> {
        let req = axum::http::Request::post(self.uri.clone())
            .header(header::AUTHORIZATION, &*self.auth)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))?;
        let res = self
            .client
            .request(req)
            .await
            .with_context(|| format!("POST {}", self.uri.path()))?;
        let status = res.status().as_u16();
        Ok((status, res.into_body().collect().await?.to_bytes()))
    }
}

/// The body of order `i` of `tag` in `pool`.
fn order(tag: &str, pool: &str, i: usize) -> Vec<u8> {
    inproc::purchase(tag, pool, i).to_json()
}

/// `n` orders from `clients` tasks, each sending its next as soon as its
/// last is answered; the answers by order number, and the time it took.
pub(crate) async fn closed_loop(
    http: &Http,
    clients: usize,
    n: usize,
    body: Arc<dyn Fn(usize) -> Vec<u8> + Send + Sync>,
) -> anyhow::Result<(Vec<Option<Answer>>, Duration)> {
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = JoinSet::new();
    for _ in 0..clients {
        let (http, next, body) = (http.clone(), next.clone(), body.clone());
        tasks.spawn_on(
            async move {
                let mut got = Vec::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        return anyhow::Ok(got);
                    }
                    got.push((i, http.post(body(i)).await?));
                }
            },
            crate::client_runtime(),
        );
    }
    let mut answers: Vec<Option<Answer>> = (0..n).map(|_| None).collect();
    while let Some(done) = tasks.join_next().await {
        for (i, a) in done?? {
            answers[i] = Some(a);
        }
    }
    Ok((answers, started.elapsed()))
}

/// Batch sizes and claim times recorded so far (process-wide).
#[derive(Debug, Clone, Copy, Default)]
struct Stages {
    batches: f64,
    batched: f64,
    claims: f64,
    claim_seconds: f64,
}

impl Stages {
    fn take() -> Self {
        let Some(m) = crate::metrics() else {
            return Self::default();
        };
        Self {
            batches: metric_sum(m, "codepool_batcher_size_count", Some("batcher=\"orders\"")),
            batched: metric_sum(m, "codepool_batcher_size_sum", Some("batcher=\"orders\"")),
            claims: metric_sum(m, "codepool_claim_batch_seconds_count", None),
            claim_seconds: metric_sum(m, "codepool_claim_batch_seconds_sum", None),
        }
    }

    fn since(&self, before: &Stages) -> Value {
        let batches = self.batches - before.batches;
        let claims = self.claims - before.claims;
        json!({
            "api_batches": batches as u64,
            "mean_api_batch_size": (batches > 0.0).then(|| (self.batched - before.batched) / batches),
            "claim_batches": claims as u64,
            "mean_claim_batch_ms": (claims > 0.0).then(|| (self.claim_seconds - before.claim_seconds) / claims * 1000.0),
        })
    }
}

/// CPU per process, the machine's load and the stages during a phase.
pub(crate) struct Meter {
    cpu: CpuSnapshot,
    machine: Option<MachineCpu>,
    stages: Stages,
    mongo: MongoOps,
}

impl Meter {
    pub(crate) async fn start(store: &Store) -> Self {
        let mongo = MongoOps::take(store).await;
        Self {
            cpu: CpuSnapshot::take(),
            machine: MachineCpu::take(),
            stages: Stages::take(),
            mongo,
        }
    }

    /// What the phase of `items` used; mongod's commands per item too.
    pub(crate) async fn finish(
        self,
        store: &Store,
        items: usize,
    ) -> (Vec<(&'static str, f64)>, Value) {
        let cpu = CpuSnapshot::take().since(&self.cpu);
        let machine = self
            .machine
            .zip(MachineCpu::take())
            .map(|(b, a)| a.since(&b));
        let stages = Stages::take().since(&self.stages);
        let mongo = MongoOps::take(store).await.per_item(&self.mongo, items);
        (
            cpu,
            json!({"machine": machine, "stages": stages, "mongod_per_item": mongo}),
        )
    }
}

/// A closed-loop phase: what it measured, its extras (connections, load,
/// stages, checks) and the codes answered, by order number.
struct HttpRun {
    m: Measured,
    extra: Value,
    codes: Vec<Option<String>>,
}

#[derive(Clone, Copy, PartialEq)]
enum Phase {
    Fresh,
    Repeat,
    Baseline,
}

impl Phase {
    fn pool(self) -> &'static str {
        if self == Phase::Baseline {
            BASELINE_POOL
        } else {
            POOL
        }
    }

    fn names(self) -> (&'static str, &'static str) {
        match self {
            Phase::Fresh => ("HTTP grants", "POST /v1/orders, fresh orders: batched claim, journaled, answered with the code; SMS-pending published and confirmed after the answer"),
            Phase::Repeat => ("HTTP repeats", "POST /v1/orders again for the same orders: the same codes, answered from one read; each answer with codes audited (one insert a batch), no event sent again"),
            Phase::Baseline => ("baseline handler", "axum on hyper: one findOneAndUpdate per request (journaled, w:majority), code opened and answered"),
        }
    }

    /// The status every answer must have.
    fn status(self) -> u16 {
        if self == Phase::Repeat {
            200
        } else {
            201
        }
    }
}

/// Warms up (fresh phases), checkpoints, then sends `--orders` orders of
/// `phase` from `--clients` clients and checks every answer: the right
/// status, a code each, no code twice, and for repeats the first answer's.
async fn http_phase(
    scratch: &Scratch,
    http: &Http,
    args: &ApiBenchArgs,
    (phase, tag): (Phase, &str),
    first: Option<&[Option<String>]>,
) -> anyhow::Result<HttpRun> {
    let (n, clients) = (args.orders as usize, args.clients as usize);
    let pool = phase.pool();
    if phase != Phase::Repeat {
        let warm_tag: Arc<str> = format!("warm{tag}").into();
        let warm = Arc::new(move |i| order(&warm_tag, pool, i));
        let (answers, _) = closed_loop(http, clients, WARM, warm).await?;
        anyhow::ensure!(
            answers.iter().flatten().all(|a| a.status == 201),
            "the warm-up of {} was not granted",
            phase.names().0
        );
    }
    inproc::checkpoint(scratch).await?;
    let meter = Meter::start(&scratch.store).await;
    let tag: Arc<str> = tag.into();
    let (answers, elapsed) =
        closed_loop(http, clients, n, Arc::new(move |i| order(&tag, pool, i))).await?;
    let (cpu, mut extra) = meter.finish(&scratch.store, n).await;
    let (name, what) = phase.names();
    let answers: Vec<Answer> = answers.into_iter().flatten().collect();
    let right = answers
        .iter()
        .filter(|a| a.status == phase.status())
        .count();
    let ports: HashSet<u16> = answers.iter().filter_map(|a| a.port).collect();
    let codes: Vec<Option<String>> = answers.iter().map(|a| a.code.clone()).collect();
    let distinct: HashSet<&String> = codes.iter().flatten().collect();
    let same = first.map(|f| {
        f.iter()
            .zip(&codes)
            .filter(|(a, b)| a.is_some() && a == b)
            .count()
    });
    let ok = answers.len() == n && right == n && distinct.len() == n && same.is_none_or(|s| s == n);
    extra["connections"] = json!(ports.len());
    extra["checks"] = json!({
        "answered": answers.len(), "expected_status": phase.status(), "with_expected_status": right,
        "distinct_codes": distinct.len(), "same_codes_as_first_answer": same, "ok": ok,
    });
    let m = Measured {
        name,
        what,
        items: n,
        elapsed,
        cpu,
    };
    Ok(HttpRun { m, extra, codes })
}

/// The dispatcher on `n` preloaded purchases (quantity 1), as `dispatch`
/// runs it, with its checks.
async fn amqp_phase(
    scratch: &'static Scratch,
    n: usize,
    pool: &str,
    batch_size: usize,
) -> anyhow::Result<HttpRun> {
    let topology = scratch.cfg.topology();
    let conn = inproc::preload_purchases(scratch, "codepool-bench-api-amqp", n, |i| {
        inproc::purchase(pool, pool, i)
    })
    .await?;
    let events_before = depth(&conn, &topology.sms_pending).await?;
    inproc::checkpoint(scratch).await?;
    let meter = Meter::start(&scratch.store).await;
    let config = DispatcherConfig {
        batch_size,
        ..DispatcherConfig::default()
    };
    let run = inproc::start(scratch, &config)?.finish(n as u64).await?;
    let (_, mut extra) = meter.finish(&scratch.store, n).await;
    let checks = check_dispatched(scratch, &conn, doc! {"pool": pool}, n, events_before).await?;
    let _ = conn.close(200, "benchmark done").await;
    extra["checks"] = checks.json();
    let m = Measured {
        name: "AMQP dispatcher",
        what: "preloaded purchases, quantity 1: consume, batched claim, SMS-pending confirmed, ack",
        items: n,
        elapsed: run.elapsed,
        cpu: run.cpu,
    };
    Ok(HttpRun {
        m,
        extra,
        codes: Vec::new(),
    })
}

/// The baseline server on its own port, measured like the API.
async fn baseline_phase(
    scratch: &Scratch,
    args: &ApiBenchArgs,
    token: &str,
) -> anyhow::Result<HttpRun> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    // As the API's server does: no Nagle delay on the answers.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let app = axum::Router::new()
        .route("/v1/orders", axum::routing::post(baseline_place))
        .with_state(scratch.store.clone());
    let stop = CancellationToken::new();
    let done = stop.clone();
    let server = tokio::spawn(
        axum::serve(listener, app)
            .with_graceful_shutdown(async move { done.cancelled().await })
            .into_future(),
    );
    let http = Http::new(addr, token, args.clients as usize);
    let run = http_phase(scratch, &http, args, (Phase::Baseline, "base"), None).await;
    stop.cancel();
    server.await.context("the baseline server panicked")??;
    run
}

/// `POST /v1/orders` of the baseline: what the peers do, one atomic
/// read-and-write of the first free code per request.
async fn baseline_place(State(store): State<Store>, body: Bytes) -> Response {
    let purchase = match Purchase::parse(&body) {
        Ok(p) => p,
        Err(e) => return (StatusCode::UNPROCESSABLE_ENTITY, e.detail).into_response(),
    };
    match baseline_grant(&store, &purchase).await {
        Ok(Some(code)) => (
            StatusCode::CREATED,
            axum::Json(json!({"order_id": purchase.order_id, "codes": [{"code": code}]})),
        )
            .into_response(),
        Ok(None) => (StatusCode::CONFLICT, "the pool is empty").into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

async fn baseline_grant(store: &Store, p: &Purchase) -> anyhow::Result<Option<String>> {
    let codes = store
        .database()
        .collection::<Document>(codepool_store::codes::CODES);
    let found = codes
        .find_one_and_update(
            doc! {"pool": &p.pool, "status": CodeStatus::Unissued.as_i32()},
            doc! {"$set": {
                "status": CodeStatus::Issued.as_i32(), "order_id": &p.order_id, "uid": &p.uid,
                "phone": &p.phone, "issued_at": DateTime::now(), "sms_pending": true,
            }},
        )
        .sort(doc! {"seq": 1})
        .return_document(mongodb::options::ReturnDocument::After)
        .write_concern(codepool_store::durable())
        .await?;
    let Some(d) = found else { return Ok(None) };
    let id = d.get_object_id("_id")?;
    let key_id = d.get_str("key_id")?;
    let sealed = d.get_binary_generic("code_enc")?;
    let ring = store.keys().ring_with(key_id)?;
    let aad = codepool_store::crypto::code_aad(&p.pool, id);
    Ok(Some(ring.open(key_id, &aad, sealed)?))
}

/// Fresh orders at `--rate` a second for `--seconds`, each started on its
/// schedule whatever came back; latency from the scheduled start.
async fn latency_phase(
    scratch: &Scratch,
    args: &ApiBenchArgs,
    http: &Http,
    tag: &str,
) -> anyhow::Result<Value> {
    let (rate, n) = (args.rate, args.rate as usize * args.seconds as usize);
    // Connections opened and the code paths warm: the warm-up orders again.
    closed_loop(
        http,
        args.clients as usize,
        WARM,
        Arc::new(|i| order("warmhttp0", POOL, i)),
    )
    .await?;
    inproc::checkpoint(scratch).await?;
    let meter = Meter::start(&scratch.store).await;
    let probe = crate::probe::JournalProbe::start(&scratch.store);
    let started = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    let (mut sent, mut lag, mut tasks) = (0usize, Duration::ZERO, JoinSet::new());
    while sent < n {
        tick.tick().await;
        let due = ((started.elapsed().as_secs_f64() * f64::from(rate)) as usize + 1).min(n);
        while sent < due {
            let scheduled = started + Duration::from_secs_f64(sent as f64 / f64::from(rate));
            lag = lag.max(scheduled.elapsed());
            let (http, body) = (http.clone(), order(tag, POOL, sent));
            tasks.spawn_on(
                async move {
                    let a = http.post(body).await;
                    (scheduled, scheduled.elapsed(), a)
                },
                crate::client_runtime(),
            );
            sent += 1;
        }
    }
    let (mut lat, mut ok, mut ports) = (Vec::with_capacity(n), 0, HashSet::new());
    let (clock, mut splits) = (crate::split::Clock::now(), Vec::with_capacity(n));
    while let Some(done) = tasks.join_next().await {
        let (scheduled, took, answer) = done?;
        let a = answer?;
        ok += usize::from(a.status == 201 && a.code.is_some());
        ports.extend(a.port);
        lat.push(took);
        if let Some(claimed) = a.issued_at.as_deref().and_then(|t| clock.instant_of(t)) {
            splits.push(crate::split::Split::new(
                scheduled,
                claimed,
                scheduled + took,
            ));
        }
    }
    let noise = probe.finish().await;
    let (cpu, mut row) = meter.finish(&scratch.store, n).await;
    crate::probe::uncount(&mut row["mongod_per_item"], &noise, n);
    lat.sort();
    let p = |q: f64| ms(percentile(&lat, q));
    merge(
        &mut row,
        json!({
            "host_noise": noise, "split_at_claim": crate::split::summary(&splits, crate::split::Door::Http),
            "rate": rate, "seconds": args.seconds, "sent": n, "granted": ok, "connections": ports.len(),
            "p50_ms": p(0.5), "p90_ms": p(0.9), "p99_ms": p(0.99), "max_ms": p(1.0),
            "sender_worst_lag_ms": ms(lag), "cpu_seconds": crate::cpu_json(&cpu),
            "target_p99_ms": P99_MS, "target_met": p(0.99) <= P99_MS,
        }),
    );
    Ok(row)
}

fn merge(row: &mut Value, fields: Value) {
    if let (Some(row), Value::Object(fields)) = (row.as_object_mut(), fields) {
        row.extend(fields);
    }
}

fn result_json(r: &HttpRun) -> Value {
    let (server, clients) = crate::server_and_clients_ms(&r.m.cpu, r.m.items);
    let mut v = json!({
        "name": r.m.name, "what": r.m.what, "items": r.m.items,
        "seconds": r.m.elapsed.as_secs_f64(), "per_sec": r.m.per_sec(),
        "cpu_seconds": crate::cpu_json(&r.m.cpu),
        "server_cpu_ms_per_item": server, "client_cpu_ms_per_item": clients,
    });
    merge(&mut v, r.extra.clone());
    v
}

fn ratio(value: f64, target: f64, at_least: bool) -> Value {
    let met = if at_least {
        value >= target
    } else {
        value <= target
    };
    json!({"value": value, "target": target, "met": met})
}

fn report_json(
    args: &ApiBenchArgs,
    [fresh, repeats, baseline, amqp_repeats]: [&HttpRun; 4],
    amqp: &HttpRun,
    (rounds, latency): (&Rounds, &Value),
    (granted, orders): (u64, u64),
) -> Value {
    let rate = |r: &HttpRun| r.m.per_sec().max(1e-9);
    let cpu = |r: &HttpRun| crate::server_and_clients_ms(&r.m.cpu, r.m.items).0;
    // Each round's warm-up and fresh orders, and the open-loop ones.
    let runs = &latency["all_runs"];
    let expected = args.rounds * (WARM as u64 + args.orders) + runs["sent"].as_u64().unwrap_or(0);
    let pool_ok = granted == orders && granted == expected;
    let m = &rounds.median;
    let ok = [repeats, baseline, amqp_repeats]
        .iter()
        .all(|r| r.extra["checks"]["ok"].as_bool() == Some(true))
        && rounds.checks_ok
        && runs["granted"] == runs["sent"]
        && pool_ok;
    let p99 = latency["p99_ms"].as_f64().unwrap_or(f64::INFINITY);
    // Each closed-loop client has one order in flight: no rate beats
    // clients / the latency of one grant, and the p50 at the open-loop
    // rate (small batches, a quiet machine) is a generous floor for it.
    let ceiling = latency["p50_ms"]
        .as_f64()
        .map(|p50| args.clients as f64 / (p50 / 1000.0).max(1e-9));
    let mut results: Vec<Value> = [fresh, amqp, baseline, repeats, amqp_repeats]
        .map(result_json)
        .into();
    let mut held = result_json(&m.amqp_as_http);
    held["name"] = json!("AMQP, HTTP batches");
    let why = match args.held_batch {
        Some(_) => "--held-batch",
        None => "the HTTP batches' mean before it",
    };
    held["what"] = json!(format!(
        "the dispatcher held to batches of {} ({why})",
        m.as_http_batch
    ));
    results.insert(2, held);
    json!({
        "benchmark": "api",
        "orders": args.orders,
        "clients": args.clients,
        "write_concern": {"w": "majority", "j": true},
        "api_rate_per_key": RATE_PER_KEY,
        "rounds": args.rounds,
        "dispatcher": {"batch_size": DispatcherConfig::default().batch_size, "workers": DispatcherConfig::default().workers},
        "fresh_rounds": rounds.all,
        "median_round": "results hold the round whose HTTP / AMQP ratio is the median; the ratios are the medians of the rounds' own",
        "fairness": "one process on the same cores: the HTTP clients run in it during the HTTP phases, on a runtime of their own whose threads' CPU is reported apart (clients) from the server's (codepool), the AMQP purchases are preloaded before the dispatcher's clock; no dispatcher runs during the HTTP phases (the API publishes and confirms its own events); a checkpoint (fsync) before each measurement",
        "results": results,
        "latency": latency,
        "closed_loop_ceiling": {
            "per_sec": ceiling,
            "over_amqp": ceiling.map(|c| c / rate(amqp)),
            "note": "clients / p50 latency of a grant at the open-loop rate (Little's law): no closed loop of this many clients is faster",
        },
        "ratios": {
            "http_over_amqp": ratio(rounds.median_of("http_over_amqp"), HTTP_OVER_AMQP, true),
            "http_over_baseline": ratio(rate(fresh) / rate(baseline), HTTP_OVER_BASELINE, true),
            "repeats_over_fresh": ratio(rate(repeats) / rate(fresh), REPEATS_OVER_FRESH, true),
            "server_cpu_repeats_http_over_amqp": cpu(repeats) / cpu(amqp_repeats).max(1e-9),
            "server_cpu_http_over_amqp": ratio(rounds.median_of("server_cpu_http_over_amqp"), CPU_HTTP_OVER_AMQP, false),
            "server_cpu_http_over_amqp_as_http": rounds.median_of("server_cpu_http_over_amqp_as_http"),
            "server_cpu_amqp_as_http_over_amqp": rounds.median_of("server_cpu_amqp_as_http_over_amqp"),
            "p99_ms_at_rate": ratio(p99, P99_MS, false),
        },
        "checks": {"api_pool_granted": granted, "api_pool_distinct_orders": orders,
                   "api_pool_expected": expected, "ok": ok},
    })
}

fn print_table(args: &ApiBenchArgs, report: &Value) {
    println!(
        "HTTP API against the AMQP dispatcher and a findOneAndUpdate handler, {} orders each, {} keep-alive clients; writes journaled (w:majority, j:true)\nno dispatcher ran during the HTTP phases (the API publishes and confirms its own events); the API's per-key limit raised to {RATE_PER_KEY}/s\n",
        args.orders, args.clients
    );
    println!(
        "{:<17} {:>8} {:>9} {:>6} {:>10}  what",
        "", "seconds", "per sec", "conns", "mean batch"
    );
    let f = |v: &Value| v.as_f64().unwrap_or(0.0);
    for r in report["results"].as_array().into_iter().flatten() {
        let batch = r["stages"]["mean_api_batch_size"]
            .as_f64()
            .map_or("-".into(), |b| format!("{b:.1}"));
        let conns = r["connections"]
            .as_u64()
            .map_or("-".into(), |c| c.to_string());
        println!(
            "{:<17} {:>8.2} {:>9.0} {conns:>6} {batch:>10}  {}",
            r["name"].as_str().unwrap_or("?"),
            f(&r["seconds"]),
            f(&r["per_sec"]),
            r["what"].as_str().unwrap_or("")
        );
    }
    println!(
        "\nCPU per item, servers (codepool, mongod, RabbitMQ, Redis) and the HTTP clients apart:"
    );
    for r in report["results"].as_array().into_iter().flatten() {
        println!(
            "{:<17} servers {:.3} ms, clients {:.3} ms",
            r["name"].as_str().unwrap_or("?"),
            f(&r["server_cpu_ms_per_item"]),
            f(&r["client_cpu_ms_per_item"])
        );
    }
    println!("\nmongod's commands and documents per item (serverStatus):");
    for r in report["results"].as_array().into_iter().flatten() {
        let per = r["mongod_per_item"].as_object();
        let listed: Vec<String> = per
            .into_iter()
            .flatten()
            .filter(|(_, v)| v.as_f64().unwrap_or(0.0) >= 0.005)
            .map(|(k, v)| format!("{k} {:.3}", v.as_f64().unwrap_or(0.0)))
            .collect();
        println!(
            "{:<17} {}",
            r["name"].as_str().unwrap_or("?"),
            listed.join(", ")
        );
    }
    println!("\nCPU seconds and machine load while each ran:");
    for r in report["results"].as_array().into_iter().flatten() {
        let cpu: Vec<(&'static str, f64)> =
            ["codepool", "mongod", "rabbitmq", "redis", crate::CLIENTS]
                .into_iter()
                .filter_map(|k| Some((k, r["cpu_seconds"][k].as_f64()?)))
                .collect();
        let load = &r["machine"];
        println!(
            "{:<17} {}; busy {:.2} of {} cores, steal {:.1}%; mean claim batch {:.1} ms",
            r["name"].as_str().unwrap_or("?"),
            describe_cpu(&cpu),
            f(&load["busy_cores"]),
            load["cores"],
            f(&load["steal_pct"]),
            f(&r["stages"]["mean_claim_batch_ms"])
        );
    }
    print_goals(report);
}

fn print_goals(report: &Value) {
    let l = &report["latency"];
    let f = |v: &Value| v.as_f64().unwrap_or(0.0);
    println!(
        "\nlatency at {}/s open loop for {} s, the run of the median p99 (runs' p99 {} ms): p50 {:.1} ms, p90 {:.1} ms, p99 {:.1} ms, max {:.1} ms ({} granted of {}, {} connections, mean batch {:.1}, sender lag ≤ {:.1} ms)",
        l["rate"], l["seconds"], l["round_p99_ms"], f(&l["p50_ms"]), f(&l["p90_ms"]), f(&l["p99_ms"]), f(&l["max_ms"]),
        l["granted"], l["sent"], l["connections"], f(&l["stages"]["mean_api_batch_size"]), f(&l["sender_worst_lag_ms"])
    );
    println!("{}", crate::probe::describe(&l["host_noise"]));
    println!("{}", crate::split::describe(&l["split_at_claim"]));
    let c = &report["closed_loop_ceiling"];
    println!(
        "closed-loop ceiling: {} clients / p50 {:.1} ms = {:.0}/s, {:.2}× the dispatcher (Little's law; the HTTP grants reached {:.0}/s)",
        report["clients"], f(&l["p50_ms"]), f(&c["per_sec"]), f(&c["over_amqp"]), f(&report["results"][0]["per_sec"])
    );
    let tick = |r: &Value| {
        if r["met"].as_bool() == Some(true) {
            "✓"
        } else {
            "✗"
        }
    };
    for row in report["fresh_rounds"].as_array().into_iter().flatten() {
        let c = &row["server_cpu_ms_per_item"];
        println!(
            "round {}: HTTP {:.0}/s (batches of {:.1}), AMQP {:.0}/s, AMQP in batches of {} {:.0}/s; servers' CPU per grant {:.3} / {:.3} / {:.3} ms",
            row["round"], f(&row["http_per_sec"]), f(&row["http_mean_batch"]), f(&row["amqp_per_sec"]),
            row["amqp_as_http_batch_size"], f(&row["amqp_as_http_per_sec"]),
            f(&c["http"]), f(&c["amqp"]), f(&c["amqp_as_http"])
        );
    }
    let r = &report["ratios"];
    let held = &report["fresh_rounds"][0]["amqp_as_http_batch_size"];
    println!(
        "server CPU, HTTP / AMQP held to batches of {held} = {:.2}× (AMQP in batches of {held} / in its own: {:.2}×; medians of the rounds)",
        f(&r["server_cpu_http_over_amqp_as_http"]),
        f(&r["server_cpu_amqp_as_http_over_amqp"])
    );
    println!(
        "server CPU per repeat, HTTP / AMQP = {:.2}×",
        f(&r["server_cpu_repeats_http_over_amqp"])
    );
    for (label, key, unit, cmp) in [
        ("HTTP / AMQP dispatcher", "http_over_amqp", "×", "≥"),
        ("HTTP / baseline handler", "http_over_baseline", "×", "≥"),
        ("repeats / fresh grants", "repeats_over_fresh", "×", "≥"),
        (
            "server CPU, HTTP / AMQP",
            "server_cpu_http_over_amqp",
            "×",
            "≤",
        ),
        ("p99 at the open-loop rate", "p99_ms_at_rate", " ms", "≤"),
    ] {
        let v = &r[key];
        println!(
            "{label:<26} = {:.2}{unit} (target {cmp} {}{unit} {})",
            f(&v["value"]),
            v["target"],
            tick(v)
        );
    }
    let c = &report["checks"];
    println!(
        "checks {}: every answer of its status with its own code, repeats got the first answers' codes, the dispatcher's checks; pool {}: {} granted to {} distinct orders",
        if c["ok"].as_bool() == Some(true) { "✓" } else { "✗" }, POOL, c["api_pool_granted"], c["api_pool_distinct_orders"]
    );
}
