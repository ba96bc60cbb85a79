//! `codepool-bench dispatch --pools N --spread uniform|zipf` and
//! `--pool-size M`: does the dispatcher keep its rate as the catalogue
//! grows? Two dispatcher runs in one process, one after the other, each
//! from a cold start (fresh dispatcher, empty hot sets, empty caches):
//!
//! - many pools: the same purchases on one pool, then spread over N pools
//!   (uniformly, or Zipf(1.1): a few pools take most of the demand);
//! - huge pool: the same purchases on a pool of `purchases` + 10% codes,
//!   then on a pool of M codes.
//!
//! Each pool holds its demand plus 10% (at least 10 codes more), so no
//! run drains a pool to exhaustion. The report is the ratio of the two
//! rates, with the usual checks: no code twice, every order granted once,
//! every SMS-pending event confirmed, nothing left unacked.
//!
//! With `--cold` (issue 47), the many-pool comparison is the cold start
//! of a large catalogue with a backlog: every pool holds
//! `--codes-per-pool` codes (125 by default, several refills' worth of its
//! demand, so its first refill does not load it whole), the single pool
//! holds as many codes as all of them, and the clock stops when the last
//! code is issued (its claim written) rather than when the last purchase
//! is acked. Both sides start from the same state: the purchases queued,
//! Redis empty, a checkpoint, then the dispatcher started on the clock.
//!
//! Each run reports its stage timings: the dispatcher's own metrics
//! (`codepool_claim_stage_seconds` by stage, refills per pool by path,
//! pools found dry, pools per pairing round) read before and after it.
//!
//! With `--rounds R` the two sides alternate R times (A B, B A, A B, …),
//! each round on pools of its own, all imported first (so the catalogue
//! holds R times the pools), and the verdict is the median of the rounds'
//! ratios: on a shared machine one pair of runs moves by ±0.1 with the
//! host's load. Redis is emptied before every run, so each starts with
//! cold hot sets. The huge pool is shared by the rounds: in later ones the
//! codes earlier rounds issued lie at its front, and MongoDB's cache holds
//! its pages.

use std::path::Path;
use std::time::Duration;

use codepool_broker::Publisher;
use lapin::Connection;
use mongodb::bson::doc;
use serde_json::json;

use crate::dispatch::{check_dispatched, Checks, DispatchBenchArgs, Measured};
use crate::inproc::{self, depth};
use crate::{describe_cpu, Scratch};

pub use crate::scale_args::{ScaleArgs, Spread};

/// Goal 1 and 2 of issue 10.
const TARGET_MANY_POOLS: f64 = 0.9;
const TARGET_HUGE_POOL: f64 = 0.95;

/// One side of the comparison: purchases per pool and codes per pool.
#[derive(Clone)]
struct Side {
    tag: &'static str,
    what: String,
    /// Pool of each purchase, in publishing order.
    purchases: Vec<usize>,
    /// Pool names and their sizes.
    pools: Vec<(String, usize)>,
    /// Every round uses these same pools (the huge pool: too slow to fill
    /// once per round, and large enough for all of them).
    shared: bool,
    /// The shop the purchases name (its webhook endpoints subscribed).
    shop: Option<&'static str>,
}

impl Side {
    /// This side in round `r`: pools of its own unless shared.
    fn for_round(&self, r: u32) -> Side {
        let mut side = self.clone();
        if r > 0 && !self.shared {
            for (name, _) in &mut side.pools {
                *name = format!("r{r}-{name}");
            }
        }
        side
    }
}

/// One run of one side.
struct Run {
    measured: Measured,
    /// From the dispatcher's start to the last purchase acked (the same
    /// as `measured` unless the clock stops at the last code issued).
    settled_seconds: f64,
    checks: Checks,
    redis: Redis,
    /// Stage timings and claim counters of this run (see [`stages`]).
    stages: serde_json::Value,
}

/// Runs the comparison; writes `dispatch-pools-N-SPREAD.json` or
/// `dispatch-pool-size-M.json`.
/// [`run`] of owned flags (as the command line hands them over).
pub async fn run_owned(
    args: DispatchBenchArgs,
    scratch: &'static Scratch,
    out_dir: &Path,
) -> anyhow::Result<()> {
    run(&args, scratch, out_dir).await
}

pub async fn run(
    args: &DispatchBenchArgs,
    scratch: &'static Scratch,
    out_dir: &Path,
) -> anyhow::Result<()> {
    let result = compare(args, scratch, out_dir).await;
    if let Err(e) = crate::delete_topology(&scratch.cfg, &[]).await {
        tracing::warn!(error = %e, "could not remove the benchmark queues");
    }
    result
}

async fn compare(
    args: &DispatchBenchArgs,
    scratch: &'static Scratch,
    out_dir: &Path,
) -> anyhow::Result<()> {
    let n = args.purchases as usize;
    let (base, other, name, target) = sides(args, n);
    let pairs = run_rounds(args, scratch, &base, &other).await?;
    // `codepool stats` of the larger side's biggest pool (goal 2: under 1 s
    // on a pool of 10,000,000 codes).
    let (biggest, biggest_size) = other
        .pools
        .iter()
        .max_by_key(|(_, n)| *n)
        .map_or((None, 0), |(p, n)| (Some(p.as_str()), *n));
    let stats_started = std::time::Instant::now();
    scratch.store.pool_stats(biggest).await?;
    let stats_seconds = stats_started.elapsed().as_secs_f64();
    let ratios: Vec<f64> = pairs
        .iter()
        .map(|(b, o)| o.measured.per_sec() / b.measured.per_sec().max(1e-9))
        .collect();
    let ratio = median(&ratios);
    let ok = pairs.iter().all(|(b, o)| b.checks.ok && o.checks.ok);
    let report = json!({
        "benchmark": name,
        "purchases": n,
        "rounds": pairs.iter().zip(&ratios).map(|((b, o), r)| json!({
            "results": [side_json(&base, b), side_json(&other, o)],
            "ratio": r,
        })).collect::<Vec<_>>(),
        "ratio": ratio,
        "ratios": ratios,
        "target": target,
        "target_met": ratio >= target,
        "checks_ok": ok,
        "stats_seconds": {"pool": biggest, "seconds": stats_seconds},
        "cold": args.scale.cold,
        "clock": if args.scale.cold { "from the dispatcher's start to the last code issued" } else { "from the dispatcher's start to the last purchase acked" },
        "note": "each run starts a fresh dispatcher on cold pools (cold start counted) with Redis emptied, after a MongoDB checkpoint; with several rounds the sides alternate (A B, B A, ...) and ratio is the median of the rounds' ratios; stages: seconds summed over concurrent tasks (they overlap), count of occurrences",
    });
    let (rendered, path) = crate::write_report(out_dir, &format!("{name}.json"), &report)?;
    if args.json {
        println!("{rendered}");
    } else {
        print_rounds(&base, &other, &pairs);
        println!(
            "codepool stats of {} ({} codes): {stats_seconds:.3} s",
            biggest.unwrap_or("-"),
            biggest_size
        );
        print_verdict(&base, &other, &ratios, target);
        println!("written to {}", path.display());
    }
    anyhow::ensure!(
        ok,
        "inconsistent results (see checks in {})",
        path.display()
    );
    Ok(())
}

/// Imports every round's pools, then runs the rounds, alternating which
/// side goes first so that a drift of the host's speed during the run
/// does not favour one side.
async fn run_rounds(
    args: &DispatchBenchArgs,
    scratch: &'static Scratch,
    base: &Side,
    other: &Side,
) -> anyhow::Result<Vec<(Run, Run)>> {
    let rounds = args.scale.rounds.max(1);
    let (mut bases, mut others) = (Vec::new(), Vec::new());
    for r in 0..rounds {
        bases.push(base.for_round(r));
        others.push(other.for_round(r));
    }
    // A shared pool appears once per round: filled once.
    let to_fill: Vec<(String, usize)> = (bases.iter().chain(&others))
        .flat_map(|side| side.pools.clone())
        .collect::<std::collections::BTreeMap<_, _>>()
        .into_iter()
        .collect();
    eprintln!(
        "importing {} codes ({rounds} round(s)) …",
        to_fill.iter().map(|(_, n)| n).sum::<usize>()
    );
    inproc::fill_pools(scratch, &to_fill, 4).await?;
    let conn = codepool_broker::connect(&scratch.cfg.amqp_url, "codepool-bench-scale").await?;
    let ch = conn.create_channel().await?;
    scratch.cfg.topology().declare(&ch).await?;
    let mut pairs = Vec::new();
    for r in 0..rounds {
        let (b, o) = (&bases[r as usize], &others[r as usize]);
        let pair = if r % 2 == 0 {
            let b = run_side(args, scratch, &conn, b, r).await?;
            (b, run_side(args, scratch, &conn, o, r).await?)
        } else {
            let o = run_side(args, scratch, &conn, o, r).await?;
            (run_side(args, scratch, &conn, b, r).await?, o)
        };
        pairs.push(pair);
    }
    let _ = ch.close(200, "benchmark done").await;
    let _ = conn.close(200, "benchmark done").await;
    Ok(pairs)
}

fn print_rounds(base: &Side, other: &Side, pairs: &[(Run, Run)]) {
    for (i, (b, o)) in pairs.iter().enumerate() {
        if pairs.len() > 1 {
            let first = if i % 2 == 0 { base.tag } else { other.tag };
            println!("round {} ({first} first):", i + 1);
        }
        print_side(base, b);
        print_side(other, o);
    }
}

fn print_verdict(base: &Side, other: &Side, ratios: &[f64], target: f64) {
    let ratio = median(ratios);
    let tick = if ratio >= target { "✓" } else { "✗" };
    let each: Vec<String> = ratios.iter().map(|r| format!("{r:.2}x")).collect();
    println!(
        "\n{} / {} = {ratio:.2}x (target >= {target}x {tick}){}",
        other.tag,
        base.tag,
        if ratios.len() > 1 {
            format!("; median of rounds {}", each.join(", "))
        } else {
            String::new()
        }
    );
}

/// The median of `xs` (the mean of the middle two for an even count).
fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The two sides, the report's name and the target ratio.
fn sides(args: &DispatchBenchArgs, n: usize) -> (Side, Side, String, f64) {
    let single = |tag: &'static str, size: usize| Side {
        tag,
        what: format!("{n} purchases on 1 pool of {size} codes"),
        purchases: vec![0; n],
        pools: vec![(format!("{tag}-pool"), size)],
        shared: false,
        shop: None,
    };
    if let Some(endpoints) = args.scale.webhook_endpoints {
        let hooks = Side {
            what: format!("{n} purchases of a shop with {endpoints} webhook endpoints"),
            shop: Some(crate::hooks::SHOP),
            ..single("hooks", with_headroom(n))
        };
        let name = format!("dispatch-webhooks-{endpoints}");
        return (
            single("none", with_headroom(n)),
            hooks,
            name,
            crate::hooks::TARGET,
        );
    }
    if let Some(size) = args.scale.pool_size {
        let name = format!("dispatch-pool-size-{size}");
        let small = single("small", with_headroom(n));
        // Every round takes its purchases from the one huge pool.
        let rounds = args.scale.rounds.max(1) as usize;
        let huge = Side {
            shared: true,
            ..single("huge", (size as usize).max(n * rounds + n / 10))
        };
        return (small, huge, name, TARGET_HUGE_POOL);
    }
    let pools = args.scale.pools.unwrap_or(1) as usize;
    let spread = args.scale.spread;
    let purchases = spread_purchases(n, pools, spread);
    let mut demand = vec![0usize; pools];
    purchases.iter().for_each(|&p| demand[p] += 1);
    let cold = args.scale.cold;
    let size = |k: usize| match cold {
        // Never fewer than the pool's demand: no run drains a pool.
        true => (args.scale.codes_per_pool as usize).max(with_headroom(demand[k])),
        false => with_headroom(demand[k]),
    };
    let many = Side {
        tag: "many",
        what: format!("{n} purchases over {pools} pools ({spread:?})"),
        purchases,
        pools: (0..pools)
            .map(|k| (format!("many-{k:05}"), size(k)))
            .collect(),
        shared: false,
        shop: None,
    };
    let mut name = format!("dispatch-pools-{pools}-{spread:?}").to_lowercase();
    let single_size = if cold {
        name.push_str("-cold");
        total(&many)
    } else {
        with_headroom(n)
    };
    (single("single", single_size), many, name, TARGET_MANY_POOLS)
}

fn with_headroom(demand: usize) -> usize {
    demand + demand / 10 + 10
}

fn total(side: &Side) -> usize {
    side.pools.iter().map(|(_, n)| n).sum()
}

/// The pool of each of `n` purchases: uniform or Zipf(1.1), drawn from a
/// fixed-seed generator so every run publishes the same sequence.
pub fn spread_purchases(n: usize, pools: usize, spread: Spread) -> Vec<usize> {
    let weights: Vec<f64> = (1..=pools)
        .map(|k| match spread {
            Spread::Uniform => 1.0,
            Spread::Zipf => 1.0 / (k as f64).powf(1.1),
        })
        .collect();
    let sum: f64 = weights.iter().sum();
    let mut cumulative = Vec::with_capacity(pools);
    let mut acc = 0.0;
    for w in &weights {
        acc += w / sum;
        cumulative.push(acc);
    }
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    (0..n)
        .map(|_| {
            // xorshift64*: deterministic, good enough to spread demand.
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            let x = (state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64;
            cumulative.partition_point(|&c| c < x).min(pools - 1)
        })
        .collect()
}

/// What one side left in Redis: hot sets, high-water marks, demand.
struct Redis {
    keys: u64,
    bytes: u64,
}

impl Redis {
    fn per_pool(&self, pools: usize) -> f64 {
        self.bytes as f64 / pools.max(1) as f64
    }
}

/// Preloads one side's purchases, runs a fresh dispatcher until they are
/// all done, checks them, and measures the Redis keys it added.
async fn run_side(
    args: &DispatchBenchArgs,
    scratch: &'static Scratch,
    conn: &Connection,
    side: &Side,
    round: u32,
) -> anyhow::Result<Run> {
    let n = side.purchases.len();
    let tag = format!("{}{round}", side.tag);
    let cfg = &scratch.cfg;
    // Cold: no hot set, mark or lease left by an earlier run.
    crate::delete_redis_keys(&cfg.redis_url, &cfg.redis_prefix).await?;
    let events_before = depth(conn, &cfg.topology().sms_pending).await?;
    eprintln!("{tag}: preloading {n} purchases …");
    let publisher = Publisher::new(conn, scratch.cfg.topology())
        .await?
        .as_user(&Publisher::user_of(&scratch.cfg.amqp_url));
    if let (Some(shop), Some(endpoints)) = (side.shop, args.scale.webhook_endpoints) {
        crate::hooks::prepare(scratch, shop, endpoints).await?;
    }
    inproc::preload(n, |i| {
        let pool = &side.pools[side.purchases[i]].0;
        let mut p = inproc::purchase(&tag, pool, i);
        p.shop = side.shop.map(str::to_owned);
        let publisher = publisher.clone();
        async move { Ok(publisher.publish_purchase(&p).await?) }
    })
    .await?;
    publisher.close("preloaded").await;
    let queue = scratch.cfg.topology().purchases;
    anyhow::ensure!(depth(conn, &queue).await? == n as u32, "preload incomplete");
    eprintln!("{tag}: dispatching …");
    let redis_before = crate::redis_footprint(&cfg.redis_url, &cfg.redis_prefix).await?;
    inproc::checkpoint(scratch).await?;
    let stages_before = stage_metrics();
    // Marks the clock's start in the log (where a profile's window opens).
    eprintln!("{tag}: dispatcher started");
    let running = inproc::start(scratch, &args.dispatcher_config())?;
    let run = running.finish(n as u64).await?;
    let mut stages = stages(&stages_before, &stage_metrics());
    if side.shop.is_some() {
        // What the run's webhooks came to, then a clean slate for the
        // next run: the other side must not deliver this side's backlog.
        let hooks = crate::hooks::settle(scratch).await?;
        if let Some(o) = stages.as_object_mut() {
            o.insert("webhooks".into(), hooks);
        }
    }
    let redis_after = crate::redis_footprint(&cfg.redis_url, &cfg.redis_prefix).await?;
    // Let the acks of the last batch land before counting what is left.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let filter = doc! {"order_id": {"$regex": format!("^{tag}-o")}};
    let checks = check_dispatched(scratch, conn, filter, n, events_before).await?;
    let measured = Measured {
        name: side.tag,
        what: "",
        items: n,
        elapsed: if args.scale.cold {
            run.issued
        } else {
            run.elapsed
        },
        cpu: run.cpu,
    };
    let redis = Redis {
        keys: redis_after.0.saturating_sub(redis_before.0),
        bytes: redis_after.1.saturating_sub(redis_before.1),
    };
    Ok(Run {
        measured,
        settled_seconds: run.elapsed.as_secs_f64(),
        checks,
        redis,
        stages,
    })
}

/// The series this benchmark's stage timings are read from.
const STAGE_SERIES: &[&str] = &[
    "codepool_claim_stage_seconds_sum",
    "codepool_claim_stage_seconds_count",
    "codepool_refill_pools_total",
    "codepool_refill_dry_total",
    "codepool_refill_dry_skips_total",
    "codepool_claim_round_pools_total",
    "codepool_claim_batch_seconds_sum",
    "codepool_claim_batch_seconds_count",
    "codepool_batch_seconds_sum",
    "codepool_batch_seconds_count",
    "codepool_claims_total",
    "codepool_claim_races_total",
];

/// Every series of [`STAGE_SERIES`] in the process's metrics, by its
/// full name with labels: the metrics are process-wide and cumulative, so a
/// run's own share is the difference of two readings.
fn stage_metrics() -> std::collections::BTreeMap<String, f64> {
    let Some(m) = crate::metrics() else {
        return Default::default();
    };
    m.render()
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let bare = series.split('{').next()?;
            STAGE_SERIES.contains(&bare).then_some(())?;
            Some((series.to_owned(), value.parse::<f64>().ok()?))
        })
        .collect()
}

/// One run's stage timings from two readings of [`stage_metrics`]: per
/// claim stage its seconds (summed over concurrent tasks, so they overlap)
/// and count; refills per pool by path; pools found dry; and the mean
/// batch, claim and pools per pairing round.
fn stages(
    before: &std::collections::BTreeMap<String, f64>,
    after: &std::collections::BTreeMap<String, f64>,
) -> serde_json::Value {
    let delta =
        |k: &str| after.get(k).copied().unwrap_or(0.0) - before.get(k).copied().unwrap_or(0.0);
    let label = |series: &str| -> String {
        series
            .split_once('{')
            .map(|(_, l)| {
                l.trim_end_matches('}')
                    .split('"')
                    .nth(1)
                    .unwrap_or("")
                    .to_owned()
            })
            .unwrap_or_default()
    };
    let mut by_stage = serde_json::Map::new();
    let mut counters = serde_json::Map::new();
    for k in after.keys() {
        let bare = k.split('{').next().unwrap_or("");
        let d = delta(k);
        match bare {
            "codepool_claim_stage_seconds_sum" => {
                let count = delta(&k.replacen("_sum", "_count", 1));
                by_stage.insert(
                    label(k),
                    json!({"seconds": (d * 1000.0).round() / 1000.0, "count": count as u64}),
                );
            }
            "codepool_claim_stage_seconds_count" => {}
            _ if bare.ends_with("_sum") || bare.ends_with("_count") => {}
            _ => {
                let name = bare.trim_start_matches("codepool_");
                let l = label(k);
                let key = if l.is_empty() {
                    name.to_owned()
                } else {
                    format!("{name}.{l}")
                };
                counters.insert(key, json!(d as u64));
            }
        }
    }
    let mean_ms = |name: &str| {
        let c = delta(&format!("{name}_count"));
        (c > 0.0).then(|| delta(&format!("{name}_sum")) / c * 1000.0)
    };
    let batches = delta("codepool_batch_seconds_count");
    let rounds = delta("codepool_claim_batch_seconds_count");
    json!({
        "batches": batches as u64,
        "mean_batch_ms": mean_ms("codepool_batch_seconds"),
        "mean_claim_batch_ms": mean_ms("codepool_claim_batch_seconds"),
        "claim_batches": rounds as u64,
        "pools_per_claim_round": (rounds > 0.0).then(|| delta("codepool_claim_round_pools_total") / rounds),
        "claim_stages": by_stage,
        "counters": counters,
    })
}

fn side_json(side: &Side, run: &Run) -> serde_json::Value {
    let Run {
        measured: m,
        checks: c,
        redis: r,
        ..
    } = run;
    json!({
        "redis": {"keys": r.keys, "bytes": r.bytes, "bytes_per_pool": r.per_pool(side.pools.len())},
        "name": side.tag,
        "what": side.what,
        "pools": side.pools.len(),
        "codes": total(side),
        "seconds": m.elapsed.as_secs_f64(),
        "per_sec": m.per_sec(),
        "settled_seconds": run.settled_seconds,
        "stages": run.stages,
        "cpu_seconds": crate::cpu_json(&m.cpu),
        "checks": c.json(),
    })
}

fn print_side(side: &Side, run: &Run) {
    let Run {
        measured: m,
        checks: c,
        redis: r,
        stages,
        ..
    } = run;
    println!(
        "{:<7} {:>8.2} s {:>8.0}/s  {}\n        cpu: {}\n        redis: {} keys, {} bytes after the run ({:.0} bytes per pool)\n        {}",
        side.tag,
        m.elapsed.as_secs_f64(),
        m.per_sec(),
        side.what,
        describe_cpu(&m.cpu),
        r.keys,
        r.bytes,
        r.per_pool(side.pools.len()),
        c.line()
    );
    let stage_line: Vec<String> = stages["claim_stages"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(k, v)| {
            format!(
                "{k} {:.2}s/{}",
                v["seconds"].as_f64().unwrap_or(0.0),
                v["count"]
            )
        })
        .collect();
    println!(
        "        stages: {} batches of {:.1} ms (claims {:.1} ms, {:.1} pools a round); {}\n        counters: {}",
        stages["batches"],
        stages["mean_batch_ms"].as_f64().unwrap_or(0.0),
        stages["mean_claim_batch_ms"].as_f64().unwrap_or(0.0),
        stages["pools_per_claim_round"].as_f64().unwrap_or(0.0),
        stage_line.join(", "),
        stages["counters"]
    );
    if let Some(h) = stages.get("webhooks") {
        println!(
            "        webhooks: {} events recorded and {} deliveries during the run; then {:.0} deliveries/s catching up",
            h["events_recorded"],
            h["deliveries_during_run"],
            h["catch_up_deliveries_per_second"].as_f64().unwrap_or(0.0)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_verdict_is_the_median_of_the_rounds() {
        assert_eq!(median(&[0.8]), 0.8);
        assert_eq!(median(&[1.1, 0.7, 0.9]), 0.9);
        assert!((median(&[1.0, 0.8, 0.9, 0.7]) - 0.85).abs() < 1e-12);
    }

    #[test]
    fn each_round_has_pools_of_its_own_except_a_shared_pool() {
        let side = Side {
            tag: "many",
            what: String::new(),
            purchases: vec![0, 1],
            pools: vec![("many-00000".into(), 5), ("many-00001".into(), 5)],
            shared: false,
            shop: None,
        };
        assert_eq!(side.for_round(0).pools, side.pools);
        let names: Vec<String> = side.for_round(2).pools.into_iter().map(|p| p.0).collect();
        assert_eq!(names, ["r2-many-00000", "r2-many-00001"]);
        let huge = Side {
            shared: true,
            ..side
        };
        assert_eq!(huge.for_round(2).pools, huge.pools);
    }
}
