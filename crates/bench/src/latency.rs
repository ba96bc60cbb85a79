//! `codepool-bench latency --rate R --seconds S`: open-loop latency from
//! publishing a purchase to its SMS-pending event arriving on the
//! `sms.pending` queue. Purchases are sent on a fixed schedule, whatever
//! the dispatcher does (open loop: a slow dispatcher does not slow the
//! sender down, so queueing delay shows up in the numbers). Each rate in
//! the list runs for S seconds against the same warm dispatcher.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::str::FromStr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use codepool_broker::Publisher;
use codepool_store::Store;
use futures::StreamExt;
use lapin::options::BasicConsumeOptions;
use lapin::types::FieldTable;
use lapin::Channel;
use serde_json::json;
use tokio::sync::Semaphore;

use crate::inproc;
use crate::probe::JournalProbe;
use crate::split::{Clock, Split};
use crate::{ms, percentile, Scratch};

/// Open-loop latency, purchase published → SMS-pending event consumed.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Examples:\n  codepool-bench latency --rate 100,1000,half --seconds 10\n  codepool-bench latency --rate 100,1000,2000 --seconds 10\n  codepool-bench latency --rate 1000 --workers 1 --linger-ms 0   # another dispatcher setting"
)]
pub struct LatencyBenchArgs {
    /// Purchases per second; a comma-separated list runs each in turn.
    /// `half` is half the maximum, measured first in the same run.
    #[arg(long, value_delimiter = ',', default_value = "100,1000,half")]
    pub rate: Vec<Rate>,
    /// Seconds of sending at each rate.
    #[arg(long, default_value_t = 10)]
    pub seconds: u32,
    /// Runs of each rate, one after the other; the run with the median
    /// p99 is reported (and judged), with every run's p99 beside it.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=9))]
    pub rounds: u32,
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

/// A rate to send at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rate {
    PerSec(u32),
    /// Half the maximum measured in the same run.
    HalfMax,
}

impl FromStr for Rate {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "half" => Ok(Rate::HalfMax),
            n => match n.parse::<u32>() {
                Ok(r) if r > 0 => Ok(Rate::PerSec(r)),
                _ => Err(format!(
                    "`{n}` is not a rate: give purchases per second (a whole number above 0) or `half`"
                )),
            },
        }
    }
}

/// When each order was sent, and when its event came back (with its code).
#[derive(Default)]
struct Ledger {
    sent: HashMap<String, Instant>,
    latencies: Vec<Duration>,
    /// The same latencies split at each grant's claim (`split.rs`).
    splits: Vec<Split>,
    codes: HashSet<String>,
    duplicates: u64,
    /// Events received so far.
    received: u64,
    /// Closed loop only: one permit back per event received.
    room: Option<Arc<Semaphore>>,
}

/// The most purchases one rate can send (sizes the pool up front): the
/// maximum phase and `half` are bounded by this rate.
const MOST_PER_SEC: usize = 12_000;
/// Purchases kept in flight while measuring the maximum: twice the
/// dispatcher's prefetch window, so it always has full batches to take.
const MAX_IN_FLIGHT: usize = 2 * codepool_dispatcher::DispatcherConfig::DEFAULT_PREFETCH as usize;

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
    let wants_max = args.rate.contains(&Rate::HalfMax);
    let per_sec = |r: &Rate| match r {
        Rate::PerSec(n) => *n as usize,
        Rate::HalfMax => MOST_PER_SEC / 2,
    };
    let most = (args.rate.iter().map(per_sec).sum::<usize>() * args.rounds as usize
        + if wants_max { MOST_PER_SEC } else { 0 })
        * args.seconds as usize;
    inproc::fill_pools(scratch, &[(POOL.to_owned(), most + most / 10 + 1000)], 4).await?;
    // The import's dirty pages are written now, not by a checkpoint in the
    // middle of the measurement.
    inproc::checkpoint(scratch).await?;
    let conn = codepool_broker::connect(&scratch.cfg.amqp_url, "codepool-bench-latency").await?;
    let ch = conn.create_channel().await?;
    scratch.cfg.topology().declare(&ch).await?;
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let listener = listen(&ch, &scratch.cfg.topology().sms_pending, ledger.clone()).await?;
    let publisher = Publisher::new(&conn, scratch.cfg.topology())
        .await?
        .as_user(&Publisher::user_of(&scratch.cfg.amqp_url));
    let config = codepool_dispatcher::DispatcherConfig {
        workers: args.workers,
        linger: Duration::from_millis(args.linger_ms),
        ..codepool_dispatcher::DispatcherConfig::default()
    };
    let running = inproc::start(scratch, &config)?;
    warm_up(&publisher, &ledger).await?;
    let (mut total, mut max) = (0, None);
    if wants_max {
        let (row, load) = saturate(&publisher, &ledger, args.seconds).await?;
        total += row["sent"].as_u64().unwrap_or_default() as usize;
        if !args.json {
            print_max(&row);
            println!("          {load}");
        }
        max = Some(row);
    }
    let max_per_sec = max.as_ref().and_then(|m| m["per_sec"].as_f64());
    let to = (&publisher, &scratch.store);
    let (rows, sent) = each_rate(&args, to, &ledger, max_per_sec).await?;
    total += sent;
    running.stop().await?;
    listener.abort();
    let _ = conn.close(200, "benchmark done").await;
    let (checks_ok, checks) = final_checks(scratch, &ledger, total).await?;
    let report = json!({
        "benchmark": "latency",
        "seconds_per_rate": args.seconds,
        "rounds": args.rounds,
        "dispatcher": {"batch_size": config.batch_size, "workers": config.workers,
                       "linger_ms": config.linger.as_millis() as u64, "prefetch": config.prefetch},
        "maximum": max,
        "results": rows,
        "targets": targets(&rows),
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

/// Each rate of `--rate` in turn, `half` resolved against `max_per_sec`.
/// Each rate `--rounds` times: the median run of each (by p99), with every
/// run's p99 beside it, and how many purchases were sent in all.
async fn each_rate(
    args: &LatencyBenchArgs,
    to: (&Publisher, &Store),
    ledger: &Arc<Mutex<Ledger>>,
    max_per_sec: Option<f64>,
) -> anyhow::Result<(Vec<serde_json::Value>, usize)> {
    let (mut rows, mut sent) = (Vec::new(), 0);
    for rate in &args.rate {
        let (rate, half) = match (rate, max_per_sec) {
            (Rate::PerSec(r), _) => (*r, false),
            (Rate::HalfMax, Some(m)) => (((m / 2.0) as u32).max(1), true),
            (Rate::HalfMax, None) => anyhow::bail!("no maximum was measured"),
        };
        let mut runs = Vec::new();
        for round in 0..args.rounds {
            let tag = format!("{}{round}-", if half { "h" } else { "r" });
            let (mut row, load) = one_rate(to, ledger, &tag, rate, args.seconds).await?;
            sent += row["sent"].as_u64().unwrap_or_default() as usize;
            if half {
                row["half_of_max_per_sec"] = json!(max_per_sec);
            }
            if !args.json {
                print_row(&row);
                println!("          {load}");
            }
            runs.push(row);
        }
        let row = median_run(runs);
        if !args.json && args.rounds > 1 {
            println!(
                "{rate:>6}/s  median of {} runs by p99: {} ms (runs {} ms)",
                args.rounds, row["p99_ms"], row["round_p99_ms"]
            );
        }
        rows.push(row);
    }
    Ok((rows, sent))
}

/// The run of the median p99, with every run's p99 (in run order) as
/// `round_p99_ms`.
pub(crate) fn median_run(mut runs: Vec<serde_json::Value>) -> serde_json::Value {
    let p99 = |r: &serde_json::Value| r["p99_ms"].as_f64().unwrap_or(f64::INFINITY);
    let each: Vec<f64> = runs.iter().map(p99).collect();
    runs.sort_by(|a, b| p99(a).total_cmp(&p99(b)));
    let mut row = runs.swap_remove(runs.len() / 2);
    row["round_p99_ms"] = json!(each);
    row
}

/// Issue 10's latency targets, each with whether this run met it.
fn targets(rows: &[serde_json::Value]) -> serde_json::Value {
    let p99_where = |f: &dyn Fn(&serde_json::Value) -> bool| {
        rows.iter()
            .find(|r| f(r))
            .and_then(|r| r["p99_ms"].as_f64())
    };
    let at_1000 = p99_where(&|r| r["rate"] == 1000 && r.get("half_of_max_per_sec").is_none());
    let at_half = p99_where(&|r| r.get("half_of_max_per_sec").is_some());
    json!({
        "p99_ms_at_1000_per_sec": P99_AT_1000_MS,
        "p99_ms_at_1000_per_sec_met": at_1000.map(|p| p <= P99_AT_1000_MS),
        "p99_ms_at_half_max": P99_AT_HALF_MAX_MS,
        "p99_ms_at_half_max_met": at_half.map(|p| p <= P99_AT_HALF_MAX_MS),
    })
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
    let clock = Clock::now();
    Ok(tokio::spawn(async move {
        while let Some(Ok(d)) = consumer.next().await {
            let at = Instant::now();
            let Ok(v) = serde_json::from_slice::<serde_json::Value>(&d.data) else {
                continue;
            };
            let order = v["order_id"].as_str().unwrap_or_default();
            let code = v["code"].as_str().unwrap_or_default().to_owned();
            let claimed = v["issued_at"].as_str().and_then(|t| clock.instant_of(t));
            let Ok(mut l) = ledger.lock() else { return };
            l.received += 1;
            if let Some(room) = &l.room {
                room.add_permits(1);
            }
            if let Some(sent) = l.sent.remove(order) {
                l.latencies.push(at - sent);
                if let Some(claimed) = claimed {
                    l.splits.push(Split::new(sent, claimed, at));
                }
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
    (publisher, store): (&Publisher, &Store),
    ledger: &Arc<Mutex<Ledger>>,
    tag: &str,
    rate: u32,
    seconds: u32,
) -> anyhow::Result<(serde_json::Value, String)> {
    let meter = Meter::start();
    let probe = JournalProbe::start(store);
    let (sent, lag) = send_at(publisher, ledger, tag, rate, seconds).await?;
    wait_drained(ledger, Duration::from_secs(60)).await?;
    let noise = probe.finish().await;
    let (load, load_json) = meter.finish();
    let stages = crate::split::summary(&take_splits(ledger), crate::split::Door::Amqp);
    let load = format!(
        "{load}\n          {}\n          {}",
        crate::probe::describe(&noise),
        crate::split::describe(&stages)
    );
    let mut lat = take_latencies(ledger);
    lat.sort();
    anyhow::ensure!(
        lat.len() == sent,
        "{} of {sent} events came back",
        lat.len()
    );
    let p = |q: f64| ms(percentile(&lat, q));
    let mut row = json!({
        "rate": rate, "sent": sent, "received": lat.len(),
        "p50_ms": p(0.50), "p90_ms": p(0.90), "p99_ms": p(0.99), "max_ms": p(1.0),
        "sender_worst_lag_ms": ms(lag), "host_noise": noise, "split_at_claim": stages,
    });
    merge(&mut row, load_json);
    Ok((row, load))
}

/// The maximum of this loop: [`MAX_IN_FLIGHT`] purchases kept in flight
/// for `seconds`, a new one sent as each event comes back. The rate is
/// events per second after the first second (which fills the pipeline).
async fn saturate(
    publisher: &Publisher,
    ledger: &Arc<Mutex<Ledger>>,
    seconds: u32,
) -> anyhow::Result<(serde_json::Value, String)> {
    anyhow::ensure!(
        seconds >= 2,
        "measuring the maximum needs --seconds 2 or more"
    );
    let room = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    let received = || ledger.lock().map(|l| l.received).unwrap_or_default();
    if let Ok(mut l) = ledger.lock() {
        l.room = Some(room.clone());
    }
    let meter = Meter::start();
    let started = tokio::time::Instant::now();
    let end = started + Duration::from_secs(seconds.into());
    let (mut sent, mut from) = (0usize, None);
    while sent < MOST_PER_SEC * seconds as usize {
        match tokio::time::timeout_at(end, room.acquire()).await {
            Ok(Ok(permit)) => permit.forget(),
            _ => break,
        }
        if from.is_none() && started.elapsed() >= Duration::from_secs(1) {
            from = Some((Instant::now(), received()));
        }
        let p = inproc::purchase("max", POOL, sent);
        if let Ok(mut l) = ledger.lock() {
            l.sent.insert(p.order_id.clone(), Instant::now());
        }
        let confirm = publisher.publish_purchase(&p).await?;
        tokio::spawn(async move { confirm.wait().await });
        sent += 1;
    }
    let (since, before) = from.context("the sender never got past the first second")?;
    let per_sec = (received() - before) as f64 / since.elapsed().as_secs_f64();
    if let Ok(mut l) = ledger.lock() {
        l.room = None;
    }
    wait_drained(ledger, Duration::from_secs(60)).await?;
    let (load, load_json) = meter.finish();
    take_latencies(ledger);
    let mut row = json!({"in_flight": MAX_IN_FLIGHT, "sent": sent, "per_sec": per_sec});
    merge(&mut row, load_json);
    Ok((row, load))
}

/// CPU used by each server and the machine between `start` and `finish`.
struct Meter {
    cpu: crate::CpuSnapshot,
    machine: Option<crate::MachineCpu>,
}

impl Meter {
    fn start() -> Self {
        Self {
            cpu: crate::CpuSnapshot::take(),
            machine: crate::MachineCpu::take(),
        }
    }

    /// A line for the terminal, and the same as JSON fields.
    fn finish(self) -> (String, serde_json::Value) {
        let cpu_seconds = crate::CpuSnapshot::take().since(&self.cpu);
        let machine = self
            .machine
            .zip(crate::MachineCpu::take())
            .map(|(before, after)| after.since(&before));
        let line = format!(
            "{}; cpu: {}",
            machine
                .as_ref()
                .map_or("machine load unknown".into(), |m| m.to_string()),
            crate::describe_cpu(&cpu_seconds)
        );
        let fields = json!({"cpu_seconds": crate::cpu_json(&cpu_seconds), "machine": machine});
        (line, fields)
    }
}

fn merge(row: &mut serde_json::Value, fields: serde_json::Value) {
    if let (Some(row), serde_json::Value::Object(fields)) = (row.as_object_mut(), fields) {
        row.extend(fields);
    }
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

fn take_splits(ledger: &Arc<Mutex<Ledger>>) -> Vec<Split> {
    ledger
        .lock()
        .map(|mut l| std::mem::take(&mut l.splits))
        .unwrap_or_default()
}

/// The latencies so far, their splits dropped with them.
fn take_latencies(ledger: &Arc<Mutex<Ledger>>) -> Vec<Duration> {
    ledger
        .lock()
        .map(|mut l| {
            l.splits.clear();
            std::mem::take(&mut l.latencies)
        })
        .unwrap_or_default()
}

fn print_max(r: &serde_json::Value) {
    println!(
        "maximum  {:>7.0}/s  closed loop, {} in flight, {} sent",
        r["per_sec"].as_f64().unwrap_or(0.0),
        r["in_flight"],
        r["sent"],
    );
}

fn print_row(r: &serde_json::Value) {
    let f = |v: &serde_json::Value| v.as_f64().unwrap_or(0.0);
    let half = if r.get("half_of_max_per_sec").is_some() {
        "  (half the maximum)"
    } else {
        ""
    };
    println!(
        "{:>6}/s  sent {:>6}  p50 {:>7.1} ms  p90 {:>7.1} ms  p99 {:>7.1} ms  max {:>7.1} ms{half}",
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
    // The warm-up's 50 too.
    let expected = total as u64 + 50;
    let ok =
        granted == expected && orders == granted && duplicates == 0 && codes as u64 == expected;
    Ok((
        ok,
        json!({"granted": granted, "distinct_orders": orders, "distinct_codes_in_events": codes,
               "duplicate_or_unknown_events": duplicates, "ok": ok}),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_whole_numbers_above_zero_or_half() {
        assert_eq!("half".parse::<Rate>(), Ok(Rate::HalfMax));
        assert_eq!(" 1000".parse::<Rate>(), Ok(Rate::PerSec(1000)));
        for bad in ["0", "-5", "fast", "1.5"] {
            let err = bad.parse::<Rate>().unwrap_err();
            assert!(err.contains("`half`"), "{bad}: {err}");
        }
    }

    #[test]
    fn the_run_of_the_median_p99_is_kept_with_every_run_beside_it() {
        let runs = vec![
            json!({"p99_ms": 31.0, "p50_ms": 9.0}),
            json!({"p99_ms": 18.0, "p50_ms": 7.0}),
            json!({"p99_ms": 24.0, "p50_ms": 8.0}),
        ];
        let row = median_run(runs);
        assert_eq!(row["p99_ms"], 24.0);
        assert_eq!(row["p50_ms"], 8.0);
        assert_eq!(row["round_p99_ms"], json!([31.0, 18.0, 24.0]));
        assert_eq!(median_run(vec![json!({"p99_ms": 5.0})])["p99_ms"], 5.0);
    }

    #[test]
    fn targets_judge_1000_per_sec_and_the_half_maximum_rows() {
        let rows = [
            json!({"rate": 100, "p99_ms": 9.0}),
            json!({"rate": 1000, "p99_ms": 30.0}),
            json!({"rate": 2845, "p99_ms": 90.0, "half_of_max_per_sec": 5691.0}),
        ];
        let t = targets(&rows);
        assert_eq!(t["p99_ms_at_1000_per_sec_met"], json!(false));
        assert_eq!(t["p99_ms_at_half_max_met"], json!(true));
        // Neither row sent: nothing to judge.
        let t = targets(&rows[..1]);
        assert!(t["p99_ms_at_1000_per_sec_met"].is_null());
        assert!(t["p99_ms_at_half_max_met"].is_null());
    }
}
