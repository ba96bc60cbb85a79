//! `codepool bench dispatch`: the dispatcher end to end, against the two
//! things it is made of, measured on the same servers in the same run:
//!
//! - a pass-through: consume preloaded messages with the same prefetch,
//!   batching and workers, publish each to a queue with confirms in flight
//!   together, ack; no database at all;
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
use codepool_broker::{PendingConfirm, Publisher, Topology};
use codepool_dispatcher::{Dispatcher, DispatcherConfig, Health};
use codepool_domain::{CodeStatus, Purchase};
use codepool_store::ObjectId;
use futures::{StreamExt, TryStreamExt};
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection};
use mongodb::bson::{doc, DateTime, Document};
use serde_json::json;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::{describe_cpu, metric_sum, proc_status_kb, CpuSnapshot, Scratch};

/// Publishes in flight at once while preloading.
const PRELOAD_WINDOW: usize = 2000;
/// Longest the dispatcher may go without progress before the run fails.
const STALL_LIMIT: Duration = Duration::from_secs(30);

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
    /// Print the results as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

impl DispatchBenchArgs {
    /// The dispatcher's defaults with this run's overrides; the baselines
    /// use the same prefetch, batch size and concurrency.
    fn dispatcher_config(&self) -> DispatcherConfig {
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
struct Measured {
    name: &'static str,
    what: &'static str,
    items: usize,
    elapsed: Duration,
    /// CPU seconds per process during the measurement.
    cpu: Vec<(&'static str, f64)>,
}

impl Measured {
    fn per_sec(&self) -> f64 {
        self.items as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Runs `codepool bench dispatch`; writes `out_dir/dispatch.json`.
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
    let cfg = &scratch.cfg;
    let store = &scratch.store;
    let n = args.purchases as usize;
    let config = args.dispatcher_config();
    let topology = cfg.topology();
    let say = |s: String| {
        if !args.json {
            eprintln!("{s}");
        }
    };
    let metrics = super::metrics();

    say(format!("importing 2 × {n} codes into {} …", cfg.db));
    super::fill_pool(store, "dispatch", n).await?;
    super::fill_pool(store, "raw", n).await?;

    say(format!(
        "preloading 2 × {n} messages (persistent, confirmed) …"
    ));
    let conn = codepool_broker::connect(&cfg.amqp_url, "codepool-bench-dispatch-setup").await?;
    let ch = conn.create_channel().await?;
    topology.declare(&ch).await?;
    for q in [pass_in, pass_out] {
        ch.queue_declare(q, durable_queue(), FieldTable::default())
            .await?;
    }
    let publisher = Publisher::new(&conn, topology.clone()).await?;
    preload(n, |i| {
        let p = purchase("dispatch", i);
        let publisher = publisher.clone();
        async move { Ok(publisher.publish_purchase(&p).await?) }
    })
    .await?;
    preload(n, |i| {
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

    say("(b) raw MongoDB bulk updates by _id …".into());
    let cpu = CpuSnapshot::take();
    let mut raw = raw_updates(scratch, n, config.batch_size, config.workers).await?;
    raw.cpu = CpuSnapshot::take().since(&cpu);

    say("(a) pass-through: consume, publish with confirms, ack …".into());
    let cpu = CpuSnapshot::take();
    let mut pass = pass_through(cfg, pass_in, pass_out, n, &config).await?;
    pass.cpu = CpuSnapshot::take().since(&cpu);
    anyhow::ensure!(
        depth(&conn, pass_out).await? == n as u32,
        "the pass-through did not deliver {n} confirmed messages"
    );

    say("dispatcher …".into());
    let rss_before = proc_status_kb(None, "VmRSS");
    let hwm_reset = super::reset_peak_rss();
    let hot = codepool::context::hot_pool(cfg)?;
    let numbers = codepool::context::grant_numbers(cfg, store)?;
    let engine = codepool::context::claim_engine_with(store, hot.clone(), numbers)?;
    let dispatcher = Dispatcher::new(
        engine,
        store.clone(),
        hot,
        DispatcherConfig {
            amqp_url: cfg.amqp_url.clone(),
            topology: topology.clone(),
            name: "codepool-bench-dispatch".into(),
            ..config.clone()
        },
        Arc::new(Health::default()),
    );
    let stop = CancellationToken::new();
    let cpu = CpuSnapshot::take();
    let started = Instant::now();
    let daemon = tokio::spawn(dispatcher.run(stop.clone()));
    let mut rss_max = 0u64;
    let mut last = (0usize, Instant::now());
    loop {
        tokio::time::sleep(Duration::from_millis(10)).await;
        rss_max = rss_max.max(proc_status_kb(None, "VmRSS").unwrap_or(0));
        let done = match metrics {
            Some(m) => metric_sum(m, "codepool_end_to_end_seconds_count", None) as usize,
            None => {
                // Without metrics: all granted and none left unacked.
                let granted = issued(scratch, "dispatch").await? as usize;
                if granted == n && depth(&conn, &topology.purchases).await? == 0 {
                    n
                } else {
                    granted.min(n - 1)
                }
            }
        };
        if done >= n {
            break;
        }
        if done > last.0 {
            last = (done, Instant::now());
        } else if last.1.elapsed() > STALL_LIMIT {
            stop.cancel();
            let _ = daemon.await;
            anyhow::bail!(
                "the dispatcher made no progress for {STALL_LIMIT:?} at {done} of {n} purchases"
            );
        }
    }
    let mut elapsed = started.elapsed();
    stop.cancel();
    daemon.await.context("the dispatcher panicked")?;
    if metrics.is_none() {
        // Ready 0 is not acked 0: count the drain of in-flight batches.
        elapsed = started.elapsed();
    }
    let cpu = CpuSnapshot::take().since(&cpu);
    let hwm = proc_status_kb(None, "VmHWM");
    let dispatcher = Measured {
        name: "dispatcher",
        what: "consume, claim (hot pool, batched), publish SMS-pending with confirms, ack",
        items: n,
        elapsed,
        cpu,
    };

    // Everything granted once, every event confirmed, every purchase acked
    // (unacked ones would be back in the queue now that it stopped).
    let (granted, orders) = super::issued_and_distinct_orders(store, "dispatch").await?;
    let left = depth(&conn, &topology.purchases).await?;
    let events = depth(&conn, &topology.sms_pending).await?;
    let dead = depth(&conn, &topology.purchases_dead).await?;
    let ok =
        granted == n as u64 && orders == granted && left == 0 && events == n as u32 && dead == 0;
    let _ = conn.close(200, "benchmark done").await;

    let stages = metrics.map(|m| {
        let mean = |name: &str| {
            let count = metric_sum(m, &format!("{name}_count"), None);
            (count > 0.0).then(|| metric_sum(m, &format!("{name}_sum"), None) / count * 1000.0)
        };
        json!({
            "batches": metric_sum(m, "codepool_batch_seconds_count", None) as u64,
            "mean_batch_ms": mean("codepool_batch_seconds"),
            "mean_claim_batch_ms": mean("codepool_claim_batch_seconds"),
            "claims_hot": metric_sum(m, "codepool_claims_total", Some("path=\"hot\"")) as u64,
            "claims_scan": metric_sum(m, "codepool_claims_total", Some("path=\"scan\"")) as u64,
            "races": metric_sum(m, "codepool_claim_races_total", None) as u64,
        })
    });

    let slower = if raw.per_sec() < pass.per_sec() {
        &raw
    } else {
        &pass
    };
    let ratio = dispatcher.per_sec() / slower.per_sec().max(1e-9);
    let mb = |kb: Option<u64>| kb.map(|k| k as f64 / 1024.0);
    let report = json!({
        "benchmark": "dispatch",
        "purchases": n,
        "write_concern": {"w": "majority", "j": true},
        "prefetch": config.prefetch,
        "batch_size": config.batch_size,
        "workers": config.workers,
        "linger_ms": config.linger.as_millis() as u64,
        "results": ([&dispatcher, &pass, &raw]).iter().map(|m| json!({
            "name": m.name,
            "what": m.what,
            "items": m.items,
            "seconds": m.elapsed.as_secs_f64(),
            "per_sec": m.per_sec(),
            "cpu_seconds": super::cpu_json(&m.cpu),
        })).collect::<Vec<_>>(),
        "cpu_note": "CPU seconds of this process and the local servers during each measurement; the machine has this many cores in total",
        "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "slower_baseline": slower.name,
        "dispatcher_over_slower_baseline": ratio,
        "target": 0.5,
        "target_met": ratio >= 0.5,
        "checks": {
            "granted": granted, "distinct_orders": orders, "left_in_queue": left,
            "sms_pending_events": events, "dead_letters": dead, "ok": ok,
        },
        "memory": {
            "rss_before_mb": mb(rss_before),
            "rss_max_sampled_mb": mb(Some(rss_max)),
            "peak_rss_mb": mb(hwm),
            "peak_is_dispatcher_phase_only": hwm_reset,
            "note": "the dispatcher runs inside the benchmark process; the peak includes the benchmark's own memory",
        },
        "stages": stages,
    });
    let (rendered, path) = super::write_report(out_dir, "dispatch.json", &report)?;
    if args.json {
        println!("{rendered}");
    } else {
        println!(
            "dispatcher end to end vs its two baselines, {n} purchases each; writes journaled (w:majority, j:true); prefetch {}, batches of {}, {} workers, linger {} ms\n",
            config.prefetch,
            config.batch_size,
            config.workers,
            config.linger.as_millis()
        );
        println!("{:<12} {:>9} {:>10}  what", "", "seconds", "per sec");
        for m in [&dispatcher, &pass, &raw] {
            println!(
                "{:<12} {:>9.2} {:>10.0}  {}",
                m.name,
                m.elapsed.as_secs_f64(),
                m.per_sec(),
                m.what
            );
        }
        println!(
            "\nCPU seconds while each ran ({} cores):",
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(0)
        );
        for m in [&dispatcher, &pass, &raw] {
            println!("{:<12} {}", m.name, describe_cpu(&m.cpu));
        }
        println!(
            "\ndispatcher / slower baseline ({}) = {ratio:.2}x (target >= 0.5x {})",
            slower.name,
            if ratio >= 0.5 { "✓" } else { "✗" }
        );
        println!(
            "checks {}: {granted} granted, {orders} distinct orders, {events} SMS-pending events, {left} left in the queue, {dead} dead letters",
            if ok { "✓" } else { "✗" }
        );
        println!(
            "memory: RSS {:.1} MB before the dispatcher, peak {:.1} MB while it ran ({}; includes the benchmark's own memory)",
            mb(rss_before).unwrap_or(0.0),
            mb(hwm).unwrap_or(0.0).max(mb(Some(rss_max)).unwrap_or(0.0)),
            if hwm_reset { "VmHWM reset before the start" } else { "sampled VmRSS" },
        );
        if let Some(s) = &report["stages"].as_object() {
            println!(
                "stages: {} batches, mean batch {:.1} ms of which claim_batch {:.1} ms; claims hot {} / scan {}, races {}",
                s["batches"], s["mean_batch_ms"].as_f64().unwrap_or(0.0),
                s["mean_claim_batch_ms"].as_f64().unwrap_or(0.0), s["claims_hot"], s["claims_scan"], s["races"]
            );
        }
        println!("written to {}", path.display());
    }
    anyhow::ensure!(
        ok,
        "the dispatcher's results are inconsistent (see checks in {})",
        path.display()
    );
    Ok(())
}

fn purchase(pool: &str, i: usize) -> Purchase {
    Purchase {
        order_id: format!("{pool}-o{i}"),
        uid: format!("u{i}"),
        phone: format!("+86138{:08}", i % 100_000_000),
        pool: pool.to_owned(),
        purchased_at: None,
    }
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

/// Ready messages in `queue` (a passive declare; unacked ones are not counted).
async fn depth(conn: &Connection, queue: &str) -> anyhow::Result<u32> {
    let ch = conn.create_channel().await?;
    let n = codepool_broker::queue_depth(&ch, queue)
        .await
        .with_context(|| format!("reading the depth of {queue}"))?;
    let _ = ch.close(200, "done").await;
    Ok(n)
}

async fn issued(scratch: &Scratch, pool: &str) -> anyhow::Result<u64> {
    Ok(scratch
        .store
        .database()
        .collection::<Document>(codepool_store::codes::CODES)
        .count_documents(doc! {"pool": pool, "status": CodeStatus::Issued.as_i32()})
        .await?)
}

/// Publishes `n` messages, `PRELOAD_WINDOW` confirms in flight at a time.
async fn preload<F, Fut>(n: usize, publish: F) -> anyhow::Result<()>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<PendingConfirm>>,
{
    let mut start = 0;
    while start < n {
        let end = (start + PRELOAD_WINDOW).min(n);
        let mut confirms = Vec::with_capacity(end - start);
        for i in start..end {
            confirms.push(publish(i).await?);
        }
        for c in confirms {
            c.wait().await?;
        }
        start = end;
    }
    Ok(())
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
    let ids: Vec<ObjectId> = db
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
    let chunks: Vec<(usize, Vec<ObjectId>)> = ids
        .chunks(batch.max(1))
        .enumerate()
        .map(|(k, c)| (k * batch, c.to_vec()))
        .collect();
    let started = Instant::now();
    let mut modified = 0i64;
    let mut stream = futures::stream::iter(chunks)
        .map(|(first, ids)| async move {
            let now = DateTime::now();
            let updates: Vec<Document> = ids
                .iter()
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
                .collect();
            db.run_command(doc! {
                "update": codepool_store::codes::CODES,
                "updates": updates,
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
        let permit = permits.clone().acquire_owned().await?;
        let publisher = publisher.clone();
        let out = out.to_owned();
        let acked = acked.clone();
        inflight.spawn(async move {
            forward(&publisher, &out, &batch).await?;
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

async fn forward(publisher: &Publisher, out: &str, batch: &[Delivery]) -> anyhow::Result<()> {
    let mut confirms = Vec::with_capacity(batch.len());
    for d in batch {
        let id = d
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str().to_owned())
            .unwrap_or_default();
        confirms.push(publisher.publish("", out, &d.data, persistent(&id)).await?);
    }
    for c in confirms {
        c.wait().await?;
    }
    for d in batch {
        d.acker.ack(BasicAckOptions::default()).await?;
    }
    Ok(())
}
