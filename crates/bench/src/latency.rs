//! `codepool-bench latency --rate R --seconds S`: open-loop latency from
//! publishing a purchase to its SMS-pending event arriving on the
//! `sms.pending` queue. Purchases are sent on a fixed schedule, whatever
//! the dispatcher does (open loop: a slow dispatcher does not slow the
//! sender down, so queueing delay shows up in the numbers). Each rate in
//! the list runs for S seconds against the same warm dispatcher.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use codepool_broker::Publisher;
use futures::StreamExt;
use lapin::options::BasicConsumeOptions;
use lapin::types::FieldTable;
use lapin::Channel;
use serde_json::json;

use crate::inproc;
use crate::{ms, percentile, Scratch};

/// Open-loop latency, purchase published → SMS-pending event consumed.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Examples:\n  codepool-bench latency --rate 100,1000,2000 --seconds 10\n  codepool-bench latency --rate 1000 --workers 1 --linger-ms 0   # another dispatcher setting"
)]
pub struct LatencyBenchArgs {
    /// Purchases per second; a comma-separated list runs each in turn.
    #[arg(long, value_delimiter = ',', default_value = "100,1000")]
    pub rate: Vec<u32>,
    /// Seconds of sending at each rate.
    #[arg(long, default_value_t = 10)]
    pub seconds: u32,
    /// Batches the dispatcher processes at the same time.
    #[arg(long, default_value_t = codepool_dispatcher::DispatcherConfig::DEFAULT_WORKERS)]
    pub workers: usize,
    /// How long a filling batch may wait for more purchases, in ms.
    #[arg(long, default_value_t = codepool_dispatcher::DispatcherConfig::DEFAULT_LINGER_MS)]
    pub linger_ms: u64,
    /// Print the results as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// When each order was sent, and when its event came back (with its code).
#[derive(Default)]
struct Ledger {
    sent: HashMap<String, Instant>,
    latencies: Vec<Duration>,
    codes: HashSet<String>,
    duplicates: u64,
}

/// Latency targets of issue 10 (p99, ms) at 1,000/s and at half the maximum.
const P99_AT_1000_MS: f64 = 25.0;
const P99_AT_HALF_MAX_MS: f64 = 100.0;
const POOL: &str = "latency";

pub async fn run(
    args: LatencyBenchArgs,
    scratch: &'static Scratch,
    out_dir: &Path,
) -> anyhow::Result<()> {
    let result = measure(args, scratch, out_dir).await;
    if let Err(e) = crate::delete_topology(&scratch.cfg, &[]).await {
        tracing::warn!(error = %e, "could not remove the benchmark queues");
    }
    result
}

async fn measure(
    args: LatencyBenchArgs,
    scratch: &'static Scratch,
    out_dir: &Path,
) -> anyhow::Result<()> {
    let total: usize = args
        .rate
        .iter()
        .map(|r| *r as usize * args.seconds as usize)
        .sum();
    inproc::fill_pools(scratch, &[(POOL.to_owned(), total + total / 10 + 1000)], 4).await?;
    // The import's dirty pages are written now, not by a checkpoint in the
    // middle of the measurement.
    inproc::checkpoint(scratch).await?;
    let conn = codepool_broker::connect(&scratch.cfg.amqp_url, "codepool-bench-latency").await?;
    let ch = conn.create_channel().await?;
    scratch.cfg.topology().declare(&ch).await?;
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let listener = listen(&ch, &scratch.cfg.topology().sms_pending, ledger.clone()).await?;
    let publisher = Publisher::new(&conn, scratch.cfg.topology()).await?;
    let config = codepool_dispatcher::DispatcherConfig {
        workers: args.workers,
        linger: Duration::from_millis(args.linger_ms),
        ..codepool_dispatcher::DispatcherConfig::default()
    };
    let running = inproc::start(scratch, &config)?;
    warm_up(&publisher, &ledger).await?;
    let mut rows = Vec::new();
    for &rate in &args.rate {
        let (row, load) = one_rate(&publisher, &ledger, rate, args.seconds).await?;
        if !args.json {
            print_row(&row);
            println!("          {load}");
        }
        rows.push(row);
    }
    running.stop().await?;
    listener.abort();
    let _ = conn.close(200, "benchmark done").await;
    let (checks_ok, checks) = final_checks(scratch, &ledger, total).await?;
    let report = json!({
        "benchmark": "latency",
        "seconds_per_rate": args.seconds,
        "dispatcher": {"batch_size": config.batch_size, "workers": config.workers,
                       "linger_ms": config.linger.as_millis() as u64, "prefetch": config.prefetch},
        "results": rows,
        "targets": {"p99_ms_at_1000_per_sec": P99_AT_1000_MS, "p99_ms_at_half_max": P99_AT_HALF_MAX_MS},
        "checks": checks,
    });
    let (rendered, path) = crate::write_report(out_dir, "latency.json", &report)?;
    if args.json {
        println!("{rendered}");
    } else {
        println!("checks: {checks}\nwritten to {}", path.display());
    }
    anyhow::ensure!(checks_ok, "inconsistent results: {checks}");
    Ok(())
}

/// Consumes `sms.pending` (auto-ack) and records each event's latency.
async fn listen(
    ch: &Channel,
    queue: &str,
    ledger: Arc<Mutex<Ledger>>,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let mut consumer = ch
        .basic_consume(
            queue,
            "codepool-bench-latency",
            BasicConsumeOptions {
                no_ack: true,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        )
        .await?;
    Ok(tokio::spawn(async move {
        while let Some(Ok(d)) = consumer.next().await {
            let at = Instant::now();
            let Ok(v) = serde_json::from_slice::<serde_json::Value>(&d.data) else {
                continue;
            };
            let order = v["order_id"].as_str().unwrap_or_default();
            let code = v["code"].as_str().unwrap_or_default().to_owned();
            let Ok(mut l) = ledger.lock() else { return };
            if let Some(sent) = l.sent.remove(order) {
                l.latencies.push(at - sent);
            } else {
                l.duplicates += 1;
            }
            if !l.codes.insert(code) {
                l.duplicates += 1;
            }
        }
    }))
}

/// A few purchases first, so the hot pool and caches are warm.
async fn warm_up(publisher: &Publisher, ledger: &Arc<Mutex<Ledger>>) -> anyhow::Result<()> {
    let row = send_at(publisher, ledger, "warm", 50, 1).await?;
    anyhow::ensure!(row.0 == 50, "warm-up incomplete");
    wait_drained(ledger, Duration::from_secs(30)).await?;
    take_latencies(ledger);
    Ok(())
}

/// Sends `rate` purchases a second for `seconds`, on schedule; returns how
/// many were sent and how late the sender fell behind at worst.
async fn send_at(
    publisher: &Publisher,
    ledger: &Arc<Mutex<Ledger>>,
    tag: &str,
    rate: u32,
    seconds: u32,
) -> anyhow::Result<(usize, Duration)> {
    let n = rate as usize * seconds as usize;
    let started = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    let (mut sent, mut worst_lag) = (0usize, Duration::ZERO);
    while sent < n {
        tick.tick().await;
        let due = ((started.elapsed().as_secs_f64() * rate as f64) as usize + 1).min(n);
        while sent < due {
            let scheduled = started + Duration::from_secs_f64(sent as f64 / rate as f64);
            worst_lag = worst_lag.max(scheduled.elapsed());
            let p = inproc::purchase(&format!("{tag}{rate}"), POOL, sent);
            if let Ok(mut l) = ledger.lock() {
                // Latency counts from the scheduled time: lag of the sender
                // is the system's too.
                l.sent.insert(p.order_id.clone(), scheduled);
            }
            let confirm = publisher.publish_purchase(&p).await?;
            tokio::spawn(async move { confirm.wait().await });
            sent += 1;
        }
    }
    Ok((sent, worst_lag))
}

async fn one_rate(
    publisher: &Publisher,
    ledger: &Arc<Mutex<Ledger>>,
    rate: u32,
    seconds: u32,
) -> anyhow::Result<(serde_json::Value, String)> {
    let (cpu, machine) = (crate::CpuSnapshot::take(), crate::MachineCpu::take());
    let (sent, lag) = send_at(publisher, ledger, "r", rate, seconds).await?;
    wait_drained(ledger, Duration::from_secs(60)).await?;
    let cpu_seconds = crate::CpuSnapshot::take().since(&cpu);
    let machine = machine
        .zip(crate::MachineCpu::take())
        .map(|(before, after)| after.since(&before));
    let load = format!(
        "{}; cpu: {}",
        machine
            .as_ref()
            .map_or("machine load unknown".into(), |m| m.to_string()),
        crate::describe_cpu(&cpu_seconds)
    );
    let mut lat = take_latencies(ledger);
    lat.sort();
    anyhow::ensure!(
        lat.len() == sent,
        "{} of {sent} events came back",
        lat.len()
    );
    let p = |q: f64| ms(percentile(&lat, q));
    let row = json!({
        "rate": rate, "sent": sent, "received": lat.len(),
        "p50_ms": p(0.50), "p90_ms": p(0.90), "p99_ms": p(0.99), "max_ms": p(1.0),
        "sender_worst_lag_ms": ms(lag),
        "cpu_seconds": crate::cpu_json(&cpu_seconds),
        "machine": machine,
    });
    Ok((row, load))
}

/// Waits until every sent order's event came back.
async fn wait_drained(ledger: &Arc<Mutex<Ledger>>, limit: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + limit;
    loop {
        let left = ledger.lock().map(|l| l.sent.len()).unwrap_or(usize::MAX);
        if left == 0 {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "{left} events never came back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn take_latencies(ledger: &Arc<Mutex<Ledger>>) -> Vec<Duration> {
    ledger
        .lock()
        .map(|mut l| std::mem::take(&mut l.latencies))
        .unwrap_or_default()
}

fn print_row(r: &serde_json::Value) {
    let f = |v: &serde_json::Value| v.as_f64().unwrap_or(0.0);
    println!(
        "{:>6}/s  sent {:>6}  p50 {:>7.1} ms  p90 {:>7.1} ms  p99 {:>7.1} ms  max {:>7.1} ms",
        r["rate"],
        r["sent"],
        f(&r["p50_ms"]),
        f(&r["p90_ms"]),
        f(&r["p99_ms"]),
        f(&r["max_ms"]),
    );
}

/// No code twice, every order granted once, no event for an unknown order.
async fn final_checks(
    scratch: &Scratch,
    ledger: &Arc<Mutex<Ledger>>,
    total: usize,
) -> anyhow::Result<(bool, serde_json::Value)> {
    let (granted, orders) = crate::issued_and_distinct_orders(&scratch.store, POOL)
        .await
        .context("counting grants")?;
    let (codes, duplicates) = ledger
        .lock()
        .map(|l| (l.codes.len(), l.duplicates))
        .unwrap_or_default();
    let expected = total as u64 + 50;
    let ok =
        granted == expected && orders == granted && duplicates == 0 && codes as u64 == expected;
    Ok((
        ok,
        json!({"granted": granted, "distinct_orders": orders, "distinct_codes_in_events": codes,
               "duplicate_or_unknown_events": duplicates, "ok": ok}),
    ))
}
