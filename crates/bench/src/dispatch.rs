//! `codepool bench dispatch`: the dispatcher end to end, against the two
//! things it is made of, measured on the same servers in the same run:
//!
//! - a pass-through: consume preloaded messages with the same prefetch,
//!   batching and workers, publish each to a queue with confirms in flight
//!   together, ack; no database at all. Its queues are of the same type as
//!   the dispatcher's (quorum unless `--queue-type classic`);
//! - raw MongoDB: the same number of codes updated by `_id` with bulk
//!   `update` commands of one batch each, journaled with majority
//!   acknowledgement, as many in flight as the dispatcher has workers; no
//!   broker at all.
//!
//! The dispatcher's purchases are preloaded (with confirms) before its
//! clock starts; the clock stops when every purchase is granted, its
//! SMS-pending event confirmed and the purchase acked.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use codepool_broker::{Publisher, QueueType, Topology};
use codepool_dispatcher::{AckWindow, DispatcherConfig};
use codepool_domain::{CodeStatus, Purchase};
use codepool_issuance::plan::Settlement;
use codepool_store::ObjectId;
use futures::{StreamExt, TryStreamExt};
use lapin::message::Delivery;
use lapin::options::{BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection};
use mongodb::bson::{doc, DateTime, Document};
use serde_json::json;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::{describe_cpu, metric_sum, proc_status_kb, CpuSnapshot, Scratch};
use crate::inproc::{self, depth};

/// Measure the dispatcher against a pass-through and raw bulk updates.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Example:\n  RUST_LOG=warn codepool bench dispatch --purchases 20000 --json\n\nThe dispatcher logs every grant at info level; RUST_LOG=warn keeps the\nterminal out of the measurement."
)]
pub struct DispatchBenchArgs {
    /// Purchases the dispatcher handles (and messages / updates per baseline).
    #[arg(long, default_value_t = 20_000, value_parser = clap::value_parser!(u64).range(100..=2_000_000))]
    pub purchases: u64,
    /// Dispatcher prefetch (and the pass-through's); default as `codepool dispatch`.
    #[arg(long)]
    pub prefetch: Option<u16>,
    /// Purchases per batch (and statements per raw update command).
    #[arg(long)]
    pub batch_size: Option<usize>,
    /// Batches in flight (and raw update commands in flight).
    #[arg(long)]
    pub workers: Option<usize>,
    /// Also run the dispatcher on orders of this many codes each (as many
    /// codes as the quantity-1 run grants), and compare the two in codes
    /// per second.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=i64::from(codepool_domain::MAX_QUANTITY)))]
    pub quantity: u32,
    /// Print the results as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub scale: crate::scale_args::ScaleArgs,
}

impl DispatchBenchArgs {
    /// The dispatcher's defaults with this run's overrides; the baselines
    /// use the same prefetch, batch size and concurrency.
    pub(crate) fn dispatcher_config(&self) -> DispatcherConfig {
        let d = DispatcherConfig::default();
        DispatcherConfig {
            prefetch: self.prefetch.unwrap_or(d.prefetch).max(1),
            batch_size: self.batch_size.unwrap_or(d.batch_size).max(1),
            workers: self.workers.unwrap_or(d.workers).max(1),
            ..d
        }
    }
}

/// One measured contender.
pub(crate) struct Measured {
    pub name: &'static str,
    pub what: &'static str,
    pub items: usize,
    pub elapsed: Duration,
    /// CPU seconds per process during the measurement.
    pub cpu: Vec<(&'static str, f64)>,
}

impl Measured {
    pub fn per_sec(&self) -> f64 {
        self.items as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Runs `codepool bench dispatch`; writes `out_dir/dispatch.json`
/// (`dispatch-classic.json` with `--queue-type classic`). With
/// `--pools`/`--pool-size` the scale comparison runs instead (`scale.rs`).
pub async fn run(
    args: DispatchBenchArgs,
    scratch: &'static Scratch,
    out_dir: &Path,
) -> anyhow::Result<()> {
    let cfg = &scratch.cfg;
    let pass_in = format!("{}passthrough.in", cfg.amqp_prefix);
    let pass_out = format!("{}passthrough.out", cfg.amqp_prefix);
    let result = measure_all(&args, scratch, out_dir, &pass_in, &pass_out).await;
    if let Err(e) = super::delete_topology(cfg, &[pass_in.clone(), pass_out.clone()]).await {
        tracing::warn!(error = %e, "could not remove the pass-through queues");
    }
    result
}

/// Preloads, runs both baselines and the dispatcher, checks, reports.
async fn measure_all(
    args: &DispatchBenchArgs,
    scratch: &'static Scratch,
    out_dir: &Path,
    pass_in: &str,
    pass_out: &str,
) -> anyhow::Result<()> {
    let n = args.purchases as usize;
    let config = args.dispatcher_config();
    let conn = prepare(args, scratch, pass_in, pass_out).await?;
    let (raw, pass) = baselines(args, scratch, &conn, pass_in, pass_out, &config).await?;
    say(args, "dispatcher …".into());
    let rss_before = proc_status_kb(None, "VmRSS");
    let hwm_reset = super::reset_peak_rss();
    let running = inproc::start(scratch, &config)?;
    let run = running.finish(n as u64).await?;
    let dispatcher = Measured {
        name: "dispatcher",
        what: "consume, claim (hot pool, batched), publish SMS-pending with confirms, ack",
        items: n,
        elapsed: run.elapsed,
        cpu: run.cpu,
    };
    let checks = check_dispatched(scratch, &conn, doc! {"pool": "dispatch"}, n, 0).await?;
    let several = match args.quantity {
        1 => None,
        q => Some(quantity_run(args, scratch, &conn, &config, q).await?),
    };
    let _ = conn.close(200, "benchmark done").await;
    let memory = Memory {
        rss_before_kb: rss_before,
        rss_max_kb: run.rss_max_kb,
        hwm_kb: proc_status_kb(None, "VmHWM"),
        hwm_reset,
    };
    // Both broker sides (dispatcher, pass-through) declare this type.
    let queue_type = scratch.cfg.topology().queues.queue_type;
    let all = [&dispatcher, &pass, &raw];
    let mut report = report_json(args, &config, queue_type, all, &checks, &memory);
    if let Some((m, ok)) = &several {
        report["quantity"] = quantity_json(args.quantity, m, *ok, &dispatcher);
    }
    let file = match queue_type {
        QueueType::Quorum => "dispatch.json".to_owned(),
        other => format!("dispatch-{}.json", other.as_str()),
    };
    let (rendered, path) = super::write_report(out_dir, &file, &report)?;
    if args.json {
        println!("{rendered}");
    } else {
        print_table(n, &config, all, &report, &memory);
        if let Some(q) = report.get("quantity") {
            println!(
                "orders of {} codes: {:.0} codes/s vs {:.0} codes/s for orders of 1 ({:.2}×, target ≥ {QUANTITY_TARGET}×)",
                q["quantity"], q["codes_per_sec"].as_f64().unwrap_or(0.0), q["quantity_1_codes_per_sec"].as_f64().unwrap_or(0.0), q["codes_per_sec_over_quantity_1"].as_f64().unwrap_or(0.0),
            );
        }
        println!("written to {}", path.display());
    }
    anyhow::ensure!(
        several.as_ref().is_none_or(|(_, ok)| *ok),
        "orders of {} codes were not granted exactly (see quantity in {})",
        args.quantity,
        path.display()
    );
    anyhow::ensure!(
        checks.ok,
        "the dispatcher's results are inconsistent (see checks in {})",
        path.display()
    );
    Ok(())
}

/// Orders of several codes must be granted at least this fraction of the
/// rate of orders of one, counted in codes.
const QUANTITY_TARGET: f64 = 0.9;

/// The dispatcher again, on orders of `q` codes each, as many codes in all
/// as the quantity-1 run: its rate counts codes. Also whether every order
/// got exactly `q` distinct codes, nothing was left and nothing died.
async fn quantity_run(
    args: &DispatchBenchArgs,
    scratch: &'static Scratch,
    conn: &Connection,
    config: &DispatcherConfig,
    q: u32,
) -> anyhow::Result<(Measured, bool)> {
    let orders = (args.purchases as usize / q as usize).max(1);
    let codes = orders * q as usize;
    let topology = scratch.cfg.topology();
    say(
        args,
        format!("orders of {q}: importing {codes} codes, preloading {orders} orders …"),
    );
    super::fill_pool(&scratch.store, "dispatchq", codes).await?;
    let publisher = Publisher::new(conn, topology.clone())
        .await?
        .as_user(&Publisher::user_of(&scratch.cfg.amqp_url));
    inproc::preload(orders, |i| {
        let p = Purchase {
            quantity: q,
            ..purchase("dispatchq", i)
        };
        let publisher = publisher.clone();
        async move { Ok(publisher.publish_purchase(&p).await?) }
    })
    .await?;
    let events_before = depth(conn, &topology.sms_pending).await?;
    say(args, format!("dispatcher, orders of {q} …"));
    let run = inproc::start(scratch, config)?
        .finish(orders as u64)
        .await?;
    let (granted, distinct) =
        super::issued_and_distinct_orders_where(&scratch.store, doc! {"pool": "dispatchq"}).await?;
    let left = depth(conn, &topology.purchases).await?;
    let dead = depth(conn, &topology.purchases_dead).await?;
    let events = depth(conn, &topology.sms_pending)
        .await?
        .saturating_sub(events_before);
    let ok = granted == codes as u64
        && distinct == orders as u64
        && left == 0
        && dead == 0
        && events >= orders as u32;
    let m = Measured {
        name: "dispatcher, orders of several",
        what: "the dispatcher on orders of --quantity codes; items are codes",
        items: codes,
        elapsed: run.elapsed,
        cpu: run.cpu,
    };
    Ok((m, ok))
}

/// The `quantity` part of the report: orders of `q` codes against orders of
/// one (`base`), in codes per second.
fn quantity_json(q: u32, m: &Measured, ok: bool, base: &Measured) -> serde_json::Value {
    let ratio = m.per_sec() / base.per_sec().max(1e-9);
    json!({
        "quantity": q,
        "orders": m.items / q as usize,
        "codes": m.items,
        "seconds": m.elapsed.as_secs_f64(),
        "codes_per_sec": m.per_sec(),
        "quantity_1_codes_per_sec": base.per_sec(),
        "codes_per_sec_over_quantity_1": ratio,
        "target": QUANTITY_TARGET,
        "target_met": ratio >= QUANTITY_TARGET,
        "checks_ok": ok,
    })
}

fn say(args: &DispatchBenchArgs, s: String) {
    if !args.json {
        eprintln!("{s}");
    }
}

/// Fills the two pools and preloads both input queues; returns the
/// connection the checks use afterwards.
async fn prepare(
    args: &DispatchBenchArgs,
    scratch: &'static Scratch,
    pass_in: &str,
    pass_out: &str,
) -> anyhow::Result<Connection> {
    let cfg = &scratch.cfg;
    let n = args.purchases as usize;
    let topology = cfg.topology();
    say(args, format!("importing 2 × {n} codes into {} …", cfg.db));
    super::fill_pool(&scratch.store, "dispatch", n).await?;
    super::fill_pool(&scratch.store, "raw", n).await?;
    say(
        args,
        format!("preloading 2 × {n} messages (persistent, confirmed) …"),
    );
    let conn = codepool_broker::connect(&cfg.amqp_url, "codepool-bench-dispatch-setup").await?;
    let ch = conn.create_channel().await?;
    topology.declare(&ch).await?;
    // The pass-through's queues are of the dispatcher's type, so the two
    // sides pay the broker the same: on one node a quorum queue moves a
    // persistent message for about half a classic queue's CPU.
    let queue_type = topology.queues.queue_type;
    for q in [pass_in, pass_out] {
        ch.queue_declare(q, durable_queue(), queue_type.declare_args())
            .await?;
    }
    let publisher = Publisher::new(&conn, topology.clone())
        .await?
        .as_user(&Publisher::user_of(&cfg.amqp_url));
    inproc::preload(n, |i| {
        let p = purchase("dispatch", i);
        let publisher = publisher.clone();
        async move { Ok(publisher.publish_purchase(&p).await?) }
    })
    .await?;
    inproc::preload(n, |i| {
        let p = purchase("passthrough", i);
        let publisher = publisher.clone();
        let q = pass_in.to_owned();
        async move {
            Ok(publisher
                .publish("", &q, &p.to_json(), persistent(&p.order_id))
                .await?)
        }
    })
    .await?;
    anyhow::ensure!(
        depth(&conn, &topology.purchases).await? == n as u32
            && depth(&conn, pass_in).await? == n as u32,
        "the preloaded queues do not hold {n} messages each"
    );
    Ok(conn)
}

/// Runs raw MongoDB, then the pass-through; returns them in that order.
async fn baselines(
    args: &DispatchBenchArgs,
    scratch: &'static Scratch,
    conn: &Connection,
    pass_in: &str,
    pass_out: &str,
    config: &DispatcherConfig,
) -> anyhow::Result<(Measured, Measured)> {
    let n = args.purchases as usize;
    say(args, "(b) raw MongoDB bulk updates by _id …".into());
    let cpu = CpuSnapshot::take();
    let mut raw = raw_updates(scratch, n, config.batch_size, config.workers).await?;
    raw.cpu = CpuSnapshot::take().since(&cpu);

    say(
        args,
        "(a) pass-through: consume, publish with confirms, ack …".into(),
    );
    let cpu = CpuSnapshot::take();
    let mut pass = pass_through(&scratch.cfg, pass_in, pass_out, n, config).await?;
    pass.cpu = CpuSnapshot::take().since(&cpu);
    anyhow::ensure!(
        depth(conn, pass_out).await? == n as u32,
        "the pass-through did not deliver {n} confirmed messages"
    );
    Ok((raw, pass))
}

/// The correctness checks of a dispatcher run on one pool.
pub(crate) struct Checks {
    pub granted: u64,
    pub orders: u64,
    pub left: u32,
    pub events: u32,
    pub dead: u32,
    pub ok: bool,
}

impl Checks {
    pub fn json(&self) -> serde_json::Value {
        json!({
            "granted": self.granted, "distinct_orders": self.orders, "left_in_queue": self.left,
            "sms_pending_events": self.events, "dead_letters": self.dead, "ok": self.ok,
        })
    }

    pub fn line(&self) -> String {
        format!(
            "checks {}: {} granted, {} distinct orders, {} SMS-pending events, {} left in the queue, {} dead letters",
            if self.ok { "✓" } else { "✗" },
            self.granted, self.orders, self.events, self.left, self.dead
        )
    }
}

/// Everything granted once, every event confirmed, every purchase acked
/// (unacked ones would be back in the queue now that it stopped).
/// `filter` selects the run's codes; `events_before` SMS-pending events
/// were already waiting from earlier runs.
pub(crate) async fn check_dispatched(
    scratch: &Scratch,
    conn: &Connection,
    filter: Document,
    n: usize,
    events_before: u32,
) -> anyhow::Result<Checks> {
    let topology = scratch.cfg.topology();
    let (granted, orders) = super::issued_and_distinct_orders_where(&scratch.store, filter).await?;
    let mut left = 0;
    for queue in topology.purchase_queues() {
        left += depth(conn, &queue).await?;
    }
    // The relay may re-send an event whose mark was not written yet (same
    // event_id, by design): at least one event per purchase.
    let events = depth(conn, &topology.sms_pending)
        .await?
        .saturating_sub(events_before);
    let dead = depth(conn, &topology.purchases_dead).await?;
    let ok =
        granted == n as u64 && orders == granted && left == 0 && events >= n as u32 && dead == 0;
    Ok(Checks {
        granted,
        orders,
        left,
        events,
        dead,
        ok,
    })
}

/// Memory of the benchmark process while the dispatcher ran.
struct Memory {
    rss_before_kb: Option<u64>,
    rss_max_kb: u64,
    hwm_kb: Option<u64>,
    hwm_reset: bool,
}

fn mb(kb: Option<u64>) -> Option<f64> {
    kb.map(|k| k as f64 / 1024.0)
}

/// The dispatcher's rate over its baselines.
struct Ratios {
    /// Over the pass-through's (goal 3).
    pass: f64,
    /// Over raw MongoDB's.
    raw: f64,
    /// Over both in series: the rate of grants that each cost the
    /// pass-through's broker work and then the raw update's database work,
    /// on the same cores, with nothing else: 1 / (1/pass + 1/raw).
    serial: f64,
}

fn ratios(all: [&Measured; 3]) -> Ratios {
    let [dispatcher, pass, raw] = all;
    let rate = |m: &Measured| m.per_sec().max(1e-9);
    let serial = 1.0 / (1.0 / rate(pass) + 1.0 / rate(raw));
    Ratios {
        pass: dispatcher.per_sec() / rate(pass),
        raw: dispatcher.per_sec() / rate(raw),
        serial: dispatcher.per_sec() / serial,
    }
}

/// mongod CPU seconds per item of a measurement.
fn mongod_cpu_per_item(m: &Measured) -> Option<f64> {
    let s = m.cpu.iter().find(|(n, _)| *n == "mongod")?.1;
    Some(s / m.items.max(1) as f64)
}

fn stages_json() -> Option<serde_json::Value> {
    let m = super::metrics()?;
    let mean = |name: &str| {
        let count = metric_sum(m, &format!("{name}_count"), None);
        (count > 0.0).then(|| metric_sum(m, &format!("{name}_sum"), None) / count * 1000.0)
    };
    Some(json!({
        "batches": metric_sum(m, "codepool_batch_seconds_count", None) as u64,
        "mean_batch_ms": mean("codepool_batch_seconds"),
        "mean_claim_batch_ms": mean("codepool_claim_batch_seconds"),
        "claims_hot": metric_sum(m, "codepool_claims_total", Some("path=\"hot\"")) as u64,
        "claims_scan": metric_sum(m, "codepool_claims_total", Some("path=\"scan\"")) as u64,
        "races": metric_sum(m, "codepool_claim_races_total", None) as u64,
    }))
}

/// Goal 3 of issue 10: the dispatcher at least this fraction of the pass-through.
const TARGET_RATIO: f64 = 0.75;
/// Goal 3: mongod CPU per grant at most this multiple of the raw update's.
const TARGET_MONGOD_CPU: f64 = 2.0;

fn report_json(
    args: &DispatchBenchArgs,
    config: &DispatcherConfig,
    queue_type: QueueType,
    all: [&Measured; 3],
    checks: &Checks,
    memory: &Memory,
) -> serde_json::Value {
    let r = ratios(all);
    let cpu_ratio = mongod_cpu_per_item(all[0])
        .zip(mongod_cpu_per_item(all[2]))
        .map(|(d, r)| d / r.max(1e-12));
    json!({
        "benchmark": "dispatch",
        "purchases": args.purchases,
        "write_concern": {"w": "majority", "j": true},
        "queue_type": queue_type.as_str(),
        "prefetch": config.prefetch,
        "batch_size": config.batch_size,
        "workers": config.workers,
        "linger_ms": config.linger.as_millis() as u64,
        "results": all.iter().map(|m| json!({
            "name": m.name,
            "what": m.what,
            "items": m.items,
            "seconds": m.elapsed.as_secs_f64(),
            "per_sec": m.per_sec(),
            "cpu_seconds": super::cpu_json(&m.cpu),
        })).collect::<Vec<_>>(),
        "cpu_note": "CPU seconds of this process and the local servers during each measurement; the machine has this many cores in total",
        "cores": cores(),
        "dispatcher_over_pass_through": r.pass,
        "dispatcher_over_raw_mongodb": r.raw,
        "dispatcher_over_both_in_series": r.serial,
        "both_in_series_note": "1 / (1/pass-through + 1/raw MongoDB): each grant's broker work, then its database work, on the same cores; reported, the target is against the pass-through",
        "target": TARGET_RATIO,
        "target_met": r.pass >= TARGET_RATIO,
        "mongod_cpu_per_grant_over_raw": cpu_ratio,
        "mongod_cpu_target": TARGET_MONGOD_CPU,
        "mongod_cpu_target_met": cpu_ratio.is_some_and(|r| r <= TARGET_MONGOD_CPU),
        "checks": checks.json(),
        "memory": {
            "rss_before_mb": mb(memory.rss_before_kb),
            "rss_max_sampled_mb": mb(Some(memory.rss_max_kb)),
            "peak_rss_mb": mb(memory.hwm_kb),
            "peak_is_dispatcher_phase_only": memory.hwm_reset,
            "note": "the dispatcher runs inside the benchmark process; the peak includes the benchmark's own memory",
        },
        "stages": stages_json(),
    })
}

fn cores() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0)
}

fn print_table(
    n: usize,
    config: &DispatcherConfig,
    all: [&Measured; 3],
    report: &serde_json::Value,
    memory: &Memory,
) {
    println!(
        "dispatcher end to end vs its two baselines, {n} purchases each; {} queues on both broker sides; writes journaled (w:majority, j:true); prefetch {}, batches of up to {}, {} workers, linger {} ms\n",
        report["queue_type"].as_str().unwrap_or("?"),
        config.prefetch, config.batch_size, config.workers, config.linger.as_millis()
    );
    println!("{:<12} {:>9} {:>10}  what", "", "seconds", "per sec");
    for m in all {
        let (secs, rate) = (m.elapsed.as_secs_f64(), m.per_sec());
        println!("{:<12} {secs:>9.2} {rate:>10.0}  {}", m.name, m.what);
    }
    println!("\nCPU seconds while each ran ({} cores):", cores());
    for m in all {
        println!("{:<12} {}", m.name, describe_cpu(&m.cpu));
    }
    let r = ratios(all);
    let tick = |ok: bool| if ok { "✓" } else { "✗" };
    println!(
        "\ndispatcher / pass-through = {:.2}x (target >= {TARGET_RATIO}x {}); dispatcher / raw MongoDB = {:.2}x; dispatcher / both in series = {:.2}x",
        r.pass,
        tick(r.pass >= TARGET_RATIO),
        r.raw,
        r.serial
    );
    if let Some(r) = report["mongod_cpu_per_grant_over_raw"].as_f64() {
        println!(
            "mongod CPU per grant / per raw update = {r:.2}x (target <= {TARGET_MONGOD_CPU}x {})",
            tick(r <= TARGET_MONGOD_CPU)
        );
    }
    let c = &report["checks"];
    println!(
        "checks {}: {} granted, {} distinct orders, {} SMS-pending events, {} left in the queue, {} dead letters",
        tick(c["ok"].as_bool() == Some(true)), c["granted"], c["distinct_orders"],
        c["sms_pending_events"], c["left_in_queue"], c["dead_letters"]
    );
    print_memory(memory);
    if let Some(s) = report["stages"].as_object() {
        println!(
            "stages: {} batches, mean batch {:.1} ms of which claim_batch {:.1} ms; claims hot {} / scan {}, races {}",
            s["batches"], s["mean_batch_ms"].as_f64().unwrap_or(0.0),
            s["mean_claim_batch_ms"].as_f64().unwrap_or(0.0), s["claims_hot"], s["claims_scan"], s["races"]
        );
    }
}

fn print_memory(memory: &Memory) {
    println!(
        "memory: RSS {:.1} MB before the dispatcher, peak {:.1} MB while it ran ({}; includes the benchmark's own memory)",
        mb(memory.rss_before_kb).unwrap_or(0.0),
        mb(memory.hwm_kb)
            .unwrap_or(0.0)
            .max(mb(Some(memory.rss_max_kb)).unwrap_or(0.0)),
        if memory.hwm_reset {
            "VmHWM reset before the start"
        } else {
            "sampled VmRSS"
        },
    );
}

fn purchase(pool: &str, i: usize) -> Purchase {
    inproc::purchase(pool, pool, i)
}

fn durable_queue() -> QueueDeclareOptions {
    QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    }
}

fn persistent(message_id: &str) -> BasicProperties {
    BasicProperties::default()
        .with_delivery_mode(2)
        .with_content_type("application/json".into())
        .with_message_id(message_id.into())
}

/// Baseline (b): `n` fresh codes claimed by `_id` in bulk `update`
/// commands of `batch` statements, `workers` in flight, journaled.
async fn raw_updates(
    scratch: &Scratch,
    n: usize,
    batch: usize,
    workers: usize,
) -> anyhow::Result<Measured> {
    let db = scratch.store.database();
    let ids = raw_pool_ids(scratch, n).await?;
    let chunks: Vec<(usize, Vec<ObjectId>)> = ids
        .chunks(batch.max(1))
        .enumerate()
        .map(|(k, c)| (k * batch, c.to_vec()))
        .collect();
    let started = Instant::now();
    let mut modified = 0i64;
    let mut stream = futures::stream::iter(chunks)
        .map(|(first, ids)| async move {
            db.run_command(doc! {
                "update": codepool_store::codes::CODES,
                "updates": raw_statements(first, &ids),
                "ordered": false,
                // `codepool_store::durable()`, in command form.
                "writeConcern": {"w": "majority", "j": true},
            })
            .await
        })
        .buffer_unordered(workers.max(1));
    while let Some(reply) = stream.next().await {
        let reply = reply?;
        anyhow::ensure!(
            !reply.contains_key("writeErrors") && !reply.contains_key("writeConcernError"),
            "raw bulk update failed: {reply}"
        );
        modified += match reply.get("nModified") {
            Some(mongodb::bson::Bson::Int32(v)) => i64::from(*v),
            Some(mongodb::bson::Bson::Int64(v)) => *v,
            _ => 0,
        };
    }
    let elapsed = started.elapsed();
    anyhow::ensure!(
        modified == n as i64,
        "raw bulk updates modified {modified} codes instead of {n}"
    );
    Ok(Measured {
        name: "raw MongoDB",
        what: "bulk update by _id {_id,status:0} -> issued, one command per batch, no broker",
        items: n,
        elapsed,
        cpu: Vec::new(),
    })
}

/// The ids of pool `raw`, oldest first (exactly `n` of them).
async fn raw_pool_ids(scratch: &Scratch, n: usize) -> anyhow::Result<Vec<ObjectId>> {
    let ids: Vec<ObjectId> = scratch
        .store
        .database()
        .collection::<Document>(codepool_store::codes::CODES)
        .find(doc! {"pool": "raw", "status": CodeStatus::Unissued.as_i32()})
        .sort(doc! {"seq": 1})
        .projection(doc! {"_id": 1})
        .await?
        .map_ok(|d| d.get_object_id("_id").ok())
        .try_filter_map(|id| async move { Ok(id) })
        .try_collect()
        .await?;
    anyhow::ensure!(
        ids.len() == n,
        "pool raw holds {} codes instead of {n}",
        ids.len()
    );
    Ok(ids)
}

/// One raw claim statement per id: `{_id, status: 0}` → issued.
fn raw_statements(first: usize, ids: &[ObjectId]) -> Vec<Document> {
    let now = DateTime::now();
    ids.iter()
        .enumerate()
        .map(|(k, id)| {
            let p = purchase("raw", first + k);
            doc! {
                "q": {"_id": id, "status": CodeStatus::Unissued.as_i32()},
                "u": {"$set": {
                    "status": CodeStatus::Issued.as_i32(),
                    "order_id": &p.order_id, "uid": &p.uid, "phone": &p.phone,
                    "issued_at": now, "sms_pending": true,
                }},
            }
        })
        .collect()
}

/// Baseline (a): consume `n` preloaded messages with the dispatcher's
/// prefetch, batching and workers, publish each to `out` with confirms in
/// flight together, then ack the batch. No database.
async fn pass_through(
    cfg: &codepool::config::Config,
    input: &str,
    out: &str,
    n: usize,
    config: &DispatcherConfig,
) -> anyhow::Result<Measured> {
    let conn = codepool_broker::connect(&cfg.amqp_url, "codepool-bench-passthrough").await?;
    let ch = conn.create_channel().await?;
    ch.basic_qos(config.prefetch, BasicQosOptions::default())
        .await?;
    let publisher = Publisher::new(&conn, Topology::with_prefix(&cfg.amqp_prefix)).await?;
    let mut consumer = ch
        .basic_consume(
            input,
            "codepool-bench-passthrough",
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let permits = Arc::new(Semaphore::new(config.workers.max(1)));
    let acked = Arc::new(AtomicUsize::new(0));
    // Acked as the dispatcher acks: one `multiple` ack per batch in order.
    let acks = Arc::new(AckWindow::new(usize::from(config.prefetch) / 2));
    let mut inflight: JoinSet<anyhow::Result<()>> = JoinSet::new();
    let mut consumed = 0;
    let started = Instant::now();
    while consumed < n {
        let first = consumer
            .next()
            .await
            .context("the broker closed the pass-through consumer")??;
        let mut batch = vec![first];
        let deadline = tokio::time::Instant::now() + config.linger;
        while batch.len() < config.batch_size && consumed + batch.len() < n {
            match tokio::time::timeout_at(deadline, consumer.next()).await {
                Ok(Some(d)) => batch.push(d?),
                Ok(None) | Err(_) => break,
            }
        }
        consumed += batch.len();
        acks.opened(&batch);
        let permit = permits.clone().acquire_owned().await?;
        let publisher = publisher.clone();
        let out = out.to_owned();
        let (acked, acks) = (acked.clone(), acks.clone());
        inflight.spawn(async move {
            forward(&publisher, &out, &batch, &acks).await?;
            acked.fetch_add(batch.len(), Ordering::Relaxed);
            drop(permit);
            Ok(())
        });
        while let Some(done) = inflight.try_join_next() {
            done??;
        }
    }
    while let Some(done) = inflight.join_next().await {
        done??;
    }
    acks.flush().await;
    let elapsed = started.elapsed();
    let _ = conn.close(200, "benchmark done").await;
    anyhow::ensure!(
        acked.load(Ordering::Relaxed) == n,
        "the pass-through acked fewer than {n} messages"
    );
    Ok(Measured {
        name: "pass-through",
        what: "consume, publish with confirms in flight together, ack; no database",
        items: n,
        elapsed,
        cpu: Vec::new(),
    })
}

async fn forward(
    publisher: &Publisher,
    out: &str,
    batch: &[Delivery],
    acks: &AckWindow,
) -> anyhow::Result<()> {
    // Started together, as the dispatcher publishes its events: the
    // connection writes the frames in one go.
    let confirms = futures::future::join_all(batch.iter().map(|d| {
        let id = d
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str().to_owned())
            .unwrap_or_default();
        publisher.publish("", out, &d.data, persistent(&id))
    }))
    .await;
    for c in confirms {
        c?.wait().await?;
    }
    acks.settle(batch, &vec![Settlement::Ack; batch.len()])
        .await;
    Ok(())
}
