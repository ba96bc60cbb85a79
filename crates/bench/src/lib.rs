//! # codepool-bench
//!
//! Side-by-side benchmarks. Each compares approaches in
//! one process and one run, because absolute times drift on shared
//! machines; results are printed and written as JSON under target/bench/.
//!
//! Every run works in its own scratch space (a database
//! `codepool_bench_<pid>_<id>`, Redis keys under `codepool-bench-<pid>:<id>`,
//! queues named `bench-<pid>.<id>.…`) and removes it at the end, so a
//! benchmark can run next to a live deployment on the same servers. What a
//! killed run left is removed by the next run ([`codepool::scratch`]).

pub mod api;
pub mod channels;
pub mod claim;
pub mod crypto;
pub mod dispatch;
pub mod generate;
pub mod holds;
mod holds_amqp;
pub mod hooks;
pub mod import;
pub mod inproc;
pub mod latency;
pub mod partitions;
mod probe;
pub mod redeem;
pub mod scale;
pub mod scale_args;
pub mod seq;
pub mod split;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand};
use codepool_domain::CodeStatus;
use codepool_store::{NewCode, ObjectId, Store};
use futures::StreamExt;
use metrics_exporter_prometheus::PrometheusHandle;

use codepool::config::Config;

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Where JSON results go.
    #[arg(long, default_value = "target/bench", global = true)]
    pub out_dir: PathBuf,
    #[command(subcommand)]
    pub which: Which,
}

#[derive(Debug, Subcommand)]
pub enum Which {
    /// Sequence generators against the classic read-then-update loop.
    Seq(seq::SeqBenchArgs),
    /// The four claim strategies side by side, at several concurrencies.
    Claim(claim::ClaimBenchArgs),
    /// The dispatcher end to end against a pass-through and raw bulk updates.
    Dispatch(dispatch::DispatchBenchArgs),
    /// `codepool import` against raw insert_many of the same documents.
    Import(import::ImportBenchArgs),
    /// `codepool generate` against `codepool import` of as many codes, and
    /// a statement over them.
    Generate(generate::GenerateBenchArgs),
    /// What encryption at rest costs per code, against import and dispatch.
    Crypto(crypto::CryptoBenchArgs),
    /// Open-loop latency, purchase published → SMS-pending event.
    Latency(latency::LatencyBenchArgs),
    /// The HTTP API's grants against the AMQP dispatcher and a
    /// findOneAndUpdate handler; repeats; open-loop latency.
    Api(api::ApiBenchArgs),
    /// Checkout holds against HTTP orders, and 2-item bundles against
    /// orders of 2, in codes per second.
    Holds(holds::HoldsBenchArgs),
    /// Redemptions by code against HTTP orders; the p99 of a check; one
    /// code raced by every client.
    Redeem(redeem::RedeemBenchArgs),
    /// Eneba's RESERVE then PROVIDE, open loop, beside the shop's own HTTP
    /// orders on the same pool: the p99 of each call, and nothing oversold.
    Channels(channels::ChannelsBenchArgs),
}

pub async fn run(cfg: &Config, args: BenchArgs) -> anyhow::Result<u8> {
    std::fs::create_dir_all(&args.out_dir)?;
    match args.which {
        Which::Seq(a) => scratch(cfg, |s| seq::run(a, s, &args.out_dir)).await?,
        Which::Claim(a) => scratch(cfg, |s| claim::run(a, s, &args.out_dir)).await?,
        Which::Dispatch(a) if a.scale.compare_partitions.is_some() => {
            scratch(cfg, |s| partitions::run_owned(a, s, &args.out_dir)).await?
        }
        Which::Dispatch(a) if a.scale.is_scale_run() => {
            scratch(cfg, |s| scale::run_owned(a, s, &args.out_dir)).await?
        }
        Which::Dispatch(a) => scratch(cfg, |s| dispatch::run(a, s, &args.out_dir)).await?,
        Which::Import(a) => scratch(cfg, |s| import::run(a, s, &args.out_dir)).await?,
        Which::Generate(a) => scratch(cfg, |s| generate::run(a, s, &args.out_dir)).await?,
        Which::Crypto(a) => crypto::run(a, &args.out_dir)?,
        Which::Latency(a) => scratch(cfg, |s| latency::run(a, s, &args.out_dir)).await?,
        Which::Api(a) => scratch(cfg, |s| api::run(a, s, &args.out_dir)).await?,
        Which::Holds(a) => scratch(cfg, |s| holds::run(a, s, &args.out_dir)).await?,
        Which::Redeem(a) => scratch(cfg, |s| redeem::run(a, s, &args.out_dir)).await?,
        Which::Channels(a) => scratch(cfg, |s| channels::run(a, s, &args.out_dir)).await?,
    }
    Ok(codepool::exit::OK)
}

/// A benchmark's private corner of the servers: the configuration with the
/// database, Redis prefix and AMQP prefix of this run only.
pub struct Scratch {
    pub cfg: Config,
    pub store: Store,
}

/// Runs `body` in a fresh scratch space and removes it afterwards, whether
/// the benchmark succeeded or not.
async fn scratch<F, Fut>(cfg: &Config, body: F) -> anyhow::Result<()>
where
    F: FnOnce(&'static Scratch) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let id = format!("{:08x}", rand::random::<u32>());
    let names = codepool::scratch::BENCHES.names(&id);
    let mut cfg = cfg.clone();
    cfg.db = names.db;
    cfg.redis_prefix = names.redis_prefix;
    cfg.amqp_prefix = names.amqp_prefix;
    // A throwaway key file of this run (child processes get it too).
    let key_file = std::env::temp_dir().join(format!("codepool-bench-{id}.keys.json"));
    codepool_vault::keyfile::init(&key_file).context("creating the benchmark key file")?;
    cfg.key_file = Some(key_file);
    // A new scratch database: created and migrated here.
    let store = codepool::context::store_creating(&cfg)
        .await
        .context("preparing the benchmark database")?;
    // What killed bench runs left is removed first; what the server holds
    // besides can move every number, so it is said.
    let swept = codepool::scratch::BENCHES
        .sweep(&store, &cfg.redis_url, &cfg.amqp_url)
        .await;
    let held = store.database_names().await;
    eprintln!(
        "MongoDB holds {} database(s) as this run begins, this run's included ({} of killed bench runs dropped, and {} Redis keys, {} queues, {} exchanges of theirs)",
        held.len(),
        swept.databases,
        swept.keys,
        swept.queues,
        swept.exchanges
    );
    // Leaked on purpose (one per process): spawned tasks may borrow it.
    let scratch: &'static Scratch = Box::leak(Box::new(Scratch { cfg, store }));
    let result = body(scratch).await;
    scratch.clean_up().await;
    result
}

impl Scratch {
    /// Drops the database and deletes the Redis keys of this run. Best
    /// effort: failures are logged. (Benchmarks that declare queues delete
    /// them themselves, with [`delete_topology`].)
    async fn clean_up(&self) {
        if let Some(k) = &self.cfg.key_file {
            let _ = std::fs::remove_file(k);
        }
        if let Err(e) = self.store.drop_database().await {
            tracing::warn!(error = %e, db = %self.cfg.db, "could not drop the benchmark database");
        }
        if let Err(e) = delete_redis_keys(&self.cfg.redis_url, &self.cfg.redis_prefix).await {
            tracing::warn!(error = %e, "could not remove the benchmark Redis keys");
        }
    }
}

/// Deletes every key under `prefix:`.
pub(crate) async fn delete_redis_keys(url: &str, prefix: &str) -> redis::RedisResult<()> {
    codepool::scratch::delete_redis_keys(url, prefix)
        .await
        .map(drop)
}

/// How many keys are under `prefix:` and the bytes they take
/// (`MEMORY USAGE` of each, so other users of the server do not count).
pub(crate) async fn redis_footprint(url: &str, prefix: &str) -> redis::RedisResult<(u64, u64)> {
    let (mut conn, keys) = codepool::scratch::redis_keys(url, &format!("{prefix}:*")).await?;
    let mut bytes = 0;
    for chunk in keys.chunks(1000) {
        let mut pipe = redis::pipe();
        for k in chunk {
            pipe.cmd("MEMORY").arg("USAGE").arg(k).arg("SAMPLES").arg(0);
        }
        let sizes: Vec<Option<u64>> = pipe.query_async(&mut conn).await?;
        bytes += sizes.into_iter().flatten().sum::<u64>();
    }
    Ok((keys.len() as u64, bytes))
}

/// Deletes the run's topology (and `extra_queues`) if it was declared.
/// Each delete gets its own channel: deleting what does not exist closes
/// the channel on some brokers.
pub async fn delete_topology(cfg: &Config, extra_queues: &[String]) -> anyhow::Result<()> {
    // Spelled out field by field: a new queue or exchange in the topology
    // does not compile here until its cleanup is added.
    let topology = cfg.topology();
    // The partitions a run of this prefix may have declared (the
    // partition bench uses 2).
    let partitions = topology
        .clone()
        .with_partitions(topology.partitions.max(8))
        .purchase_queues();
    let codepool_broker::Topology {
        purchases,
        purchases_exchange,
        purchases_dead,
        sms_exchange,
        sms_pending,
        sms_receipts,
        events_exchange,
        code_redeemed,
        purchases_refused,
        queues: _,
        partitions: _,
    } = topology;
    let conn = codepool_broker::connect(&cfg.amqp_url, "codepool-bench-cleanup").await?;
    let queues = [
        &purchases,
        &purchases_dead,
        &sms_pending,
        &sms_receipts,
        &code_redeemed,
        &purchases_refused,
    ]
    .into_iter()
    .chain(&partitions)
    .chain(extra_queues);
    for q in queues {
        let ch = conn.create_channel().await?;
        if ch
            .queue_delete(q, lapin::options::QueueDeleteOptions::default())
            .await
            .is_ok()
        {
            let _ = ch.close(200, "deleted").await;
        }
    }
    // The alternate exchanges of every partition count of `partitions`.
    let unrouted = (2..=partitions.len() as u16)
        .map(|n| cfg.topology().with_partitions(n).unrouted_exchange());
    for x in [purchases_exchange, sms_exchange, events_exchange]
        .into_iter()
        .chain(unrouted)
    {
        let ch = conn.create_channel().await?;
        if ch
            .exchange_delete(&x, lapin::options::ExchangeDeleteOptions::default())
            .await
            .is_ok()
        {
            let _ = ch.close(200, "deleted").await;
        }
    }
    let _ = conn.close(200, "benchmark done").await;
    Ok(())
}

/// Fills `pool` with `n` fresh unissued codes through the store's own
/// insert path (batches of 1000, four in flight).
pub async fn fill_pool(store: &Store, pool: &str, n: usize) -> anyhow::Result<()> {
    store.ensure_pool(pool).await?;
    let batch_id = ObjectId::new();
    let chunks: Vec<Vec<NewCode>> = (0..n)
        .collect::<Vec<_>>()
        .chunks(1000)
        .map(|c| {
            c.iter()
                .map(|i| NewCode {
                    code: format!("{pool}-{i:09}"),
                    line: None,
                    expires_at: None,
                })
                .collect()
        })
        .collect();
    let mut inserted = 0;
    let mut stream = futures::stream::iter(chunks)
        .map(|codes| async move { store.insert_codes(pool, batch_id, &codes).await })
        .buffer_unordered(4);
    while let Some(r) = stream.next().await {
        inserted += r.with_context(|| format!("filling pool {pool}"))?.inserted;
    }
    anyhow::ensure!(
        inserted == n as u64,
        "pool {pool}: inserted {inserted} codes instead of {n}"
    );
    Ok(())
}

/// How many codes match `filter`.
pub async fn count_codes(store: &Store, filter: mongodb::bson::Document) -> anyhow::Result<u64> {
    Ok(store
        .database()
        .collection::<mongodb::bson::Document>(codepool_store::codes::CODES)
        .count_documents(filter)
        .await?)
}

/// Issued codes of `pool` and how many distinct orders hold them: equal
/// when no order holds two codes. (That no code went to two claimers is
/// checked on the claimers' own lists of code ids.)
pub async fn issued_and_distinct_orders(store: &Store, pool: &str) -> anyhow::Result<(u64, u64)> {
    issued_and_distinct_orders_where(store, mongodb::bson::doc! {"pool": pool}).await
}

/// [`issued_and_distinct_orders`] of the codes matching `filter`.
pub async fn issued_and_distinct_orders_where(
    store: &Store,
    mut filter: mongodb::bson::Document,
) -> anyhow::Result<(u64, u64)> {
    use mongodb::bson::doc;
    filter.insert("status", CodeStatus::Issued.as_i32());
    let mut cursor = store
        .database()
        .collection::<mongodb::bson::Document>(codepool_store::codes::CODES)
        .aggregate(vec![
            doc! {"$match": filter},
            doc! {"$group": {"_id": null, "n": {"$sum": 1}, "orders": {"$addToSet": "$order_id"}}},
            doc! {"$project": {"n": 1, "orders": {"$size": "$orders"}}},
        ])
        .await?;
    let Some(d) = cursor.next().await.transpose()? else {
        return Ok((0, 0));
    };
    let num = |k: &str| match d.get(k) {
        Some(mongodb::bson::Bson::Int32(v)) => *v as u64,
        Some(mongodb::bson::Bson::Int64(v)) => *v as u64,
        _ => 0,
    };
    Ok((num("n"), num("orders")))
}

/// The value at quantile `q` of sorted samples.
pub fn percentile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// A field of `/proc/<pid>/status` in kB (`VmHWM`, `VmRSS`); `None` when
/// the process is gone or the system has no procfs.
pub fn proc_status_kb(pid: Option<u32>, field: &str) -> Option<u64> {
    let path = match pid {
        Some(p) => format!("/proc/{p}/status"),
        None => "/proc/self/status".to_owned(),
    };
    let text = std::fs::read_to_string(path).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// CPU seconds used so far by this process and by the local servers
/// (`mongod`, RabbitMQ's `beam.smp`, `redis-server`), read from procfs.
/// Servers on other machines are simply absent. Two snapshots around a
/// phase show which process the time went to.
#[derive(Debug, Clone, Default)]
pub struct CpuSnapshot(Vec<(&'static str, u32, f64)>);

/// Clock ticks per second of `/proc/<pid>/stat` (`USER_HZ`, 100 on Linux).
const USER_HZ: f64 = 100.0;

impl CpuSnapshot {
    pub fn take() -> Self {
        let me = std::process::id();
        let mut found = Vec::new();
        if let Ok(dir) = std::fs::read_dir("/proc") {
            for entry in dir.flatten() {
                let Some(pid) = entry
                    .file_name()
                    .to_str()
                    .and_then(|s| s.parse::<u32>().ok())
                else {
                    continue;
                };
                let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
                let name = match comm.trim() {
                    "mongod" => "mongod",
                    "beam.smp" => "rabbitmq",
                    "redis-server" => "redis",
                    _ => continue,
                };
                found.push((name, pid));
            }
        }
        let mut taken: Vec<(&'static str, u32, f64)> = found
            .into_iter()
            .filter_map(|(name, pid)| Some((name, pid, cpu_seconds(pid)?)))
            .collect();
        // This process, its load generator's threads apart: what is left is
        // the server's (and the dispatcher's) own.
        let clients = client_thread_seconds();
        if let Some(all) = cpu_seconds(me) {
            taken.push(("codepool", me, all - clients));
            taken.push((CLIENTS, me, clients));
        }
        Self(taken)
    }

    /// CPU seconds per process since `before`, summed by name.
    pub fn since(&self, before: &CpuSnapshot) -> Vec<(&'static str, f64)> {
        let mut out: Vec<(&'static str, f64)> = Vec::new();
        for (name, pid, now) in &self.0 {
            let Some((_, _, then)) = before.0.iter().find(|(n, p, _)| p == pid && n == name) else {
                continue;
            };
            match out.iter_mut().find(|(n, _)| n == name) {
                Some((_, total)) => *total += now - then,
                None => out.push((name, now - then)),
            }
        }
        // Benches without a load generator do not show one.
        out.retain(|(n, s)| *n != CLIENTS || *s > 0.0);
        out
    }
}

/// What mongod was asked to do, from `serverStatus`: each command's count
/// (`metrics.commands.*.total`) and the documents read and written
/// (`metrics.document`). Two readings around a phase say how many round
/// trips, and of which kind, each item cost (the readings themselves and
/// the driver's `hello`s included: a few in all).
#[derive(Debug, Clone, Default)]
pub struct MongoOps(std::collections::BTreeMap<String, i64>);

impl MongoOps {
    pub async fn take(store: &Store) -> Self {
        let status = store
            .client()
            .database("admin")
            .run_command(bson::doc! {"serverStatus": 1})
            .await
            .unwrap_or_default();
        let mut counts = std::collections::BTreeMap::new();
        let metrics = status.get_document("metrics").ok();
        if let Some(commands) = metrics.and_then(|m| m.get_document("commands").ok()) {
            for (name, v) in commands {
                let total = v
                    .as_document()
                    .and_then(|d| d.get("total"))
                    .and_then(bson_number);
                if let Some(t) = total {
                    counts.insert(name.clone(), t);
                }
            }
        }
        if let Some(docs) = metrics.and_then(|m| m.get_document("document").ok()) {
            for (name, v) in docs {
                if let Some(t) = bson_number(v) {
                    counts.insert(format!("documents {name}"), t);
                }
            }
        }
        Self(counts)
    }

    /// Per `items`, what changed since `before` (zeros left out).
    pub fn per_item(&self, before: &MongoOps, items: usize) -> serde_json::Value {
        let per: serde_json::Map<String, serde_json::Value> = (self.0.iter())
            .filter_map(|(k, now)| {
                let d = now - before.0.get(k).copied().unwrap_or(0);
                (d > 0).then(|| (k.clone(), serde_json::json!(d as f64 / items.max(1) as f64)))
            })
            .collect();
        serde_json::Value::Object(per)
    }
}

fn bson_number(v: &bson::Bson) -> Option<i64> {
    match v {
        bson::Bson::Int32(n) => Some(i64::from(*n)),
        bson::Bson::Int64(n) => Some(*n),
        bson::Bson::Double(f) => Some(*f as i64),
        _ => None,
    }
}

/// The name the HTTP load generator's CPU is reported under.
pub const CLIENTS: &str = "clients";
/// The threads of the load generator's runtime are named so.
const CLIENT_THREAD: &str = "bench-client";

/// The runtime the HTTP load generator runs on: threads of their own, so
/// their CPU is told apart from the server's in this process (the kernel
/// accounts each thread, `/proc/self/task/*/stat`).
pub fn client_runtime() -> &'static tokio::runtime::Handle {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name(CLIENT_THREAD)
            .enable_all()
            .build()
            .expect("the load generator's runtime")
    })
    .handle()
}

/// CPU seconds of this process's load generator threads, so far.
fn client_thread_seconds() -> f64 {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    dir.flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm"))
                .is_ok_and(|c| c.trim().starts_with(CLIENT_THREAD))
        })
        .filter_map(|t| stat_seconds(&t.path().join("stat"), 11..=12))
        .sum()
}

/// `utime + stime` of a process and of its waited-for children (the
/// import child process), in seconds.
pub(crate) fn cpu_seconds(pid: u32) -> Option<f64> {
    stat_seconds(Path::new(&format!("/proc/{pid}/stat")), 11..=14)
}

/// The sum of `fields` (counted after the command name, so 11 is utime)
/// of a procfs `stat` file, in seconds.
fn stat_seconds(path: &Path, fields: std::ops::RangeInclusive<usize>) -> Option<f64> {
    let stat = std::fs::read_to_string(path).ok()?;
    // Fields after the command name (which may contain spaces), from field 3.
    let rest = stat.rsplit_once(')')?.1;
    let all: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = fields.filter_map(|i| all.get(i)?.parse::<f64>().ok()).sum();
    Some(ticks / USER_HZ)
}

/// The whole machine's CPU time from `/proc/stat`, in clock ticks summed
/// over its CPUs: busy (user, nice, system, irq, softirq), idle (with
/// iowait), and stolen by the hypervisor for other guests. Two readings
/// around a phase say how loaded the machine was, and how much of it a
/// noisy neighbour took.
#[derive(Debug, Clone, Copy)]
pub struct MachineCpu {
    busy: u64,
    idle: u64,
    steal: u64,
    cpus: usize,
}

/// The load between two [`MachineCpu`] readings.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct MachineLoad {
    pub busy_cores: f64,
    pub cores: usize,
    pub steal_pct: f64,
}

impl std::fmt::Display for MachineLoad {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "machine busy {:.2} of {} cores, steal {:.1}%",
            self.busy_cores, self.cores, self.steal_pct
        )
    }
}

impl MachineCpu {
    /// `None` without procfs.
    pub fn take() -> Option<Self> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let line = stat.lines().find(|l| l.starts_with("cpu "))?;
        let f: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .filter_map(|v| v.parse().ok())
            .collect();
        let at = |i: usize| f.get(i).copied().unwrap_or(0);
        let cpus = stat
            .lines()
            .filter(|l| {
                l.strip_prefix("cpu")
                    .is_some_and(|n| n.starts_with(|c: char| c.is_ascii_digit()))
            })
            .count();
        Some(Self {
            busy: at(0) + at(1) + at(2) + at(5) + at(6),
            idle: at(3) + at(4),
            steal: at(7),
            cpus: cpus.max(1),
        })
    }

    /// Busy cores (of the machine's) and the share of time stolen, since
    /// `before`.
    pub fn since(&self, before: &MachineCpu) -> MachineLoad {
        let busy = self.busy.saturating_sub(before.busy) as f64;
        let idle = self.idle.saturating_sub(before.idle) as f64;
        let steal = self.steal.saturating_sub(before.steal) as f64;
        let total = busy + idle + steal;
        let share = |x: f64| if total > 0.0 { x / total } else { 0.0 };
        MachineLoad {
            busy_cores: share(busy) * self.cpus as f64,
            cores: self.cpus,
            steal_pct: share(steal) * 100.0,
        }
    }
}

/// `name 1.2 s, …` for a table line.
pub fn describe_cpu(used: &[(&'static str, f64)]) -> String {
    used.iter()
        .map(|(n, s)| format!("{n} {s:.1} s"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Milliseconds of CPU per item: of the servers (every process but the
/// load generator's threads), and of the load generator.
pub fn server_and_clients_ms(used: &[(&'static str, f64)], items: usize) -> (f64, f64) {
    let per = |s: f64| s * 1000.0 / items.max(1) as f64;
    // Folded from +0.0: an empty float sum is -0.0.
    let clients = used
        .iter()
        .filter(|(n, _)| *n == CLIENTS)
        .fold(0.0, |a, (_, s)| a + s);
    let all = used.iter().fold(0.0, |a, (_, s)| a + s);
    (per(all - clients), per(clients))
}

pub fn cpu_json(used: &[(&'static str, f64)]) -> serde_json::Value {
    serde_json::Value::Object(
        used.iter()
            .map(|(n, s)| ((*n).to_owned(), serde_json::json!(s)))
            .collect(),
    )
}

/// Resets this process's peak RSS (`VmHWM`) to its current RSS, so a later
/// reading is the peak of what came after. False if the kernel refused.
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// The Prometheus recorder of this process, installed on first use. The
/// benchmarks read the engine's own counters (`codepool_claims_total`,
/// `codepool_claim_races_total`, …) from it. `None` if another recorder was
/// installed first.
pub fn metrics() -> Option<&'static PrometheusHandle> {
    static HANDLE: OnceLock<Option<PrometheusHandle>> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            metrics_exporter_prometheus::PrometheusBuilder::new()
                .install_recorder()
                .ok()
        })
        .as_ref()
}

/// Sum of every series of metric `name` (all label sets) in the Prometheus
/// text, filtered by `label` (e.g. `path="scan"`) when given.
pub fn metric_sum(handle: &PrometheusHandle, name: &str, label: Option<&str>) -> f64 {
    handle
        .render()
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let bare = series.split('{').next()?;
            if bare != name {
                return None;
            }
            if let Some(label) = label {
                if !series.contains(label) {
                    return None;
                }
            }
            value.parse::<f64>().ok()
        })
        .fold(0.0, |a, b| a + b)
}

/// Writes `report` to `out_dir/name` and returns the rendered JSON.
pub fn write_report(
    out_dir: &Path,
    name: &str,
    report: &serde_json::Value,
) -> anyhow::Result<(String, PathBuf)> {
    let rendered = serde_json::to_string_pretty(report).context("rendering the JSON report")?;
    std::fs::create_dir_all(out_dir)
        .with_context(|| format!("creating the output folder {}", out_dir.display()))?;
    let path = out_dir.join(name);
    std::fs::write(&path, format!("{rendered}\n"))
        .with_context(|| format!("writing {}", path.display()))?;
    Ok((rendered, path))
}
