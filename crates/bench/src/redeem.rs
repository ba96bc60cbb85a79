//! `codepool-bench redeem`: redemption by code for the platform (issue 55
//! item 4), in one run on the same servers and the same in-process API:
//!
//! - redemptions per second (`POST /v1/codes/redeem`, a code each) against
//!   HTTP orders per second (`POST /v1/orders`), `--clients` keep-alive
//!   clients each; the two alternate `--rounds` times and the median ratio
//!   is judged (goal: at least 1.5×: a redemption claims nothing);
//! - the p99 of `POST /v1/codes/check` at `--rate` requests a second, open
//!   loop, each timed from its scheduled start (goal: at most 15 ms);
//! - `--clients` clients redeeming one code at once, each with its own
//!   redemption id: exactly one 200, every other answer 409.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use codepool_api::Scope;
use serde_json::{json, Value};
use tokio::task::JoinSet;

use crate::api::{closed_loop, ApiServer, Http};
use crate::{inproc, ms, percentile, CpuSnapshot, MongoOps, Scratch};

/// Redemptions against orders, the p99 of check, and one code raced.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Example:\n  RUST_LOG=warn codepool-bench redeem --requests 10000 --clients 64 --rounds 3 --rate 2000\n\nWrites redeem.json."
)]
pub struct RedeemBenchArgs {
    /// Orders, then redemptions of their codes, in each round.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(100..=1_000_000))]
    pub requests: u64,
    /// Concurrent keep-alive clients.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub clients: u64,
    /// Alternating rounds (the median ratio is judged).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=20))]
    pub rounds: u64,
    /// Checks per second of the open-loop phase.
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u32).range(1..=20_000))]
    pub rate: u32,
    /// Seconds of the open-loop phase.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=600))]
    pub seconds: u32,
    /// Print the results as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Issue 55's goals.
const REDEEMS_OVER_ORDERS: f64 = 1.5;
const CHECK_P99_MS: f64 = 15.0;
const WARM: usize = 200;
const POOL: &str = "rdm";

pub async fn run(
    args: RedeemBenchArgs,
    scratch: &'static Scratch,
    out_dir: &Path,
) -> anyhow::Result<()> {
    let result = measure(&args, scratch, out_dir).await;
    if let Err(e) = crate::delete_topology(&scratch.cfg, &[]).await {
        tracing::warn!(error = %e, "could not remove the benchmark queues");
    }
    result
}

fn say(args: &RedeemBenchArgs, s: impl std::fmt::Display) {
    if !args.json {
        eprintln!("{s}");
    }
}

fn order(tag: &str, i: usize) -> Vec<u8> {
    let phone = format!("+86138{:08}", i % 100_000_000);
    json!({"order_id": format!("{tag}-{i}"), "uid": format!("u{tag}{i}"), "phone": phone, "pool": POOL})
        .to_string()
        .into_bytes()
}

/// `n` orders from `clients` clients: their codes, and the time it took.
async fn orders(
    http: &Http,
    clients: usize,
    tag: &str,
    n: usize,
) -> anyhow::Result<(Vec<String>, Duration)> {
    let tag = Arc::<str>::from(tag);
    let (answers, took) = closed_loop(http, clients, n, Arc::new(move |i| order(&tag, i))).await?;
    let codes: Vec<String> = (answers.into_iter().flatten())
        .filter(|a| a.status == 201)
        .filter_map(|a| a.code)
        .collect();
    anyhow::ensure!(codes.len() == n, "{} of {n} orders granted", codes.len());
    Ok((codes, took))
}

/// One redemption of each of `codes`, ids tagged `tag`; the answers'
/// statuses, and the time it took.
async fn redemptions(
    http: &Http,
    clients: usize,
    tag: &str,
    codes: Arc<Vec<String>>,
) -> anyhow::Result<(Vec<u16>, Duration)> {
    let tag = Arc::<str>::from(tag);
    let n = codes.len();
    let body = Arc::new(move |i: usize| {
        json!({"code": codes[i], "redemption_id": format!("{tag}-{i}")})
            .to_string()
            .into_bytes()
    });
    let (answers, took) = closed_loop(http, clients, n, body).await?;
    Ok((
        answers.into_iter().flatten().map(|a| a.status).collect(),
        took,
    ))
}

async fn prepare(
    args: &RedeemBenchArgs,
    scratch: &'static Scratch,
) -> anyhow::Result<(ApiServer, String, String)> {
    let n = (args.requests * args.rounds) as usize + 2 * WARM + 1;
    say(
        args,
        format!("importing {n} codes into {} …", scratch.cfg.db),
    );
    inproc::fill_pools(scratch, &[(POOL.to_owned(), n)], 4).await?;
    let _ = crate::metrics();
    let actor = codepool_issuance::audit::Actor::os_user("bench", "localhost", "codepool-bench");
    let shop = codepool_api::keys::create(&scratch.store, "bench", &[Scope::OrdersWrite], &actor)
        .await?
        .token;
    let platform =
        codepool_api::keys::create(&scratch.store, "platform", &[Scope::CodesRedeem], &actor)
            .await?
            .token;
    Ok((ApiServer::start(scratch).await?, shop, platform))
}

async fn measure(
    args: &RedeemBenchArgs,
    scratch: &'static Scratch,
    out_dir: &Path,
) -> anyhow::Result<()> {
    let (api, shop, platform) = prepare(args, scratch).await?;
    let clients = args.clients as usize;
    let ordering = Http::to(api.addr, &shop, clients, "/v1/orders");
    let redeeming = Http::to(api.addr, &platform, clients, "/v1/codes/redeem");
    let checking = Http::to(api.addr, &platform, clients, "/v1/codes/check");
    // Warm both paths.
    let (warm, _) = orders(&ordering, clients, "warm", WARM).await?;
    redemptions(&redeeming, clients, "warm", Arc::new(warm.clone())).await?;
    let (rounds, used) = alternate(args, scratch, &ordering, &redeeming, warm).await?;
    say(
        args,
        format!("check: {}/s for {} s, open loop …", args.rate, args.seconds),
    );
    let check = check_latency(args, &checking, Arc::new(used)).await?;
    let race = one_code_raced(&ordering, &redeeming, clients).await?;
    api.stop().await?;
    report(args, out_dir, rounds, check, race)
}

/// `--rounds` rounds of orders, then redemptions of their codes: each
/// round's rates and ratio, and every code redeemed.
async fn alternate(
    args: &RedeemBenchArgs,
    scratch: &Scratch,
    ordering: &Http,
    redeeming: &Http,
    mut used: Vec<String>,
) -> anyhow::Result<(Vec<Value>, Vec<String>)> {
    let (n, clients) = (args.requests as usize, args.clients as usize);
    let mut rounds = Vec::new();
    for r in 0..args.rounds {
        inproc::checkpoint(scratch).await?;
        let (cpu, ops) = (CpuSnapshot::take(), MongoOps::take(&scratch.store).await);
        let (codes, order_time) = orders(ordering, clients, &format!("r{r}"), n).await?;
        let order_used = CpuSnapshot::take().since(&cpu);
        let order_cpu = crate::server_and_clients_ms(&order_used, n);
        let order_ops = MongoOps::take(&scratch.store).await.per_item(&ops, n);
        inproc::checkpoint(scratch).await?;
        let codes = Arc::new(codes);
        let (cpu, ops) = (CpuSnapshot::take(), MongoOps::take(&scratch.store).await);
        let (statuses, redeem_time) =
            redemptions(redeeming, clients, &format!("r{r}"), codes.clone()).await?;
        let redeem_used = CpuSnapshot::take().since(&cpu);
        let redeem_cpu = crate::server_and_clients_ms(&redeem_used, n);
        let redeem_ops = MongoOps::take(&scratch.store).await.per_item(&ops, n);
        let ok = statuses.iter().filter(|s| **s == 200).count();
        anyhow::ensure!(ok == n, "round {r}: {ok} of {n} redemptions answered 200");
        let (o, d) = (
            n as f64 / order_time.as_secs_f64(),
            n as f64 / redeem_time.as_secs_f64(),
        );
        say(
            args,
            format!(
                "round {}: {o:.0} orders/s, {d:.0} redemptions/s ({:.2}×); servers' CPU per request {:.3} ms and {:.3} ms (clients {:.3} and {:.3} ms)",
                r + 1,
                d / o,
                order_cpu.0,
                redeem_cpu.0,
                order_cpu.1,
                redeem_cpu.1
            ),
        );
        rounds.push(
            json!({"orders_per_sec": o, "redemptions_per_sec": d, "ratio": d / o,
            "server_cpu_ms_per_order": order_cpu.0, "server_cpu_ms_per_redemption": redeem_cpu.0,
            "client_cpu_ms_per_order": order_cpu.1, "client_cpu_ms_per_redemption": redeem_cpu.1,
            "orders_cpu_seconds": crate::cpu_json(&order_used), "redemptions_cpu_seconds": crate::cpu_json(&redeem_used),
            "mongod_per_order": order_ops, "mongod_per_redemption": redeem_ops}),
        );
        used.extend(codes.iter().cloned());
    }
    Ok((rounds, used))
}

/// Writes redeem.json and prints its rows.
fn report(
    args: &RedeemBenchArgs,
    out_dir: &Path,
    rounds: Vec<Value>,
    check: Value,
    race: Value,
) -> anyhow::Result<()> {
    let mut ratios: Vec<f64> = rounds.iter().filter_map(|r| r["ratio"].as_f64()).collect();
    ratios.sort_by(f64::total_cmp);
    let median = ratios[ratios.len() / 2];
    let p99 = check["p99_ms"].as_f64().unwrap_or(f64::MAX);
    let report = json!({
        "benchmark": "redeem",
        "command": format!("codepool-bench redeem --requests {} --clients {} --rounds {} --rate {} --seconds {}",
                           args.requests, args.clients, args.rounds, args.rate, args.seconds),
        "rounds": rounds,
        "redemptions_over_orders": {"median": median, "target": REDEEMS_OVER_ORDERS, "met": median >= REDEEMS_OVER_ORDERS},
        "check": check,
        "check_p99": {"ms": p99, "target_ms": CHECK_P99_MS, "met": p99 <= CHECK_P99_MS},
        "one_code_raced": race,
        "checks": {"ok": race["ok"], "every_check_answered_200": check["answered_200"] == check["sent"]},
    });
    let (rendered, path) = crate::write_report(out_dir, "redeem.json", &report)?;
    if args.json {
        println!("{rendered}");
    } else {
        println!(
            "redemptions/orders, median of {}: {median:.2}× (goal ≥ {REDEEMS_OVER_ORDERS}×)",
            args.rounds
        );
        println!(
            "check at {}/s: p50 {} ms, p99 {p99:.1} ms (goal ≤ {CHECK_P99_MS} ms), {} of {} answered 200",
            args.rate, check["p50_ms"], check["answered_200"], check["sent"]
        );
        if check["failed"].as_u64().unwrap_or(0) > 0 {
            println!(
                "  {} checks failed (the first: {}): the server could not keep up with {}/s on this host; try a lower --rate",
                check["failed"], check["first_failure"], args.rate
            );
        }
        println!(
            "{} clients on one code: {} × 200, {} × 409",
            args.clients, race["ok_200"], race["conflicts_409"]
        );
        println!("written to {}", path.display());
    }
    anyhow::ensure!(
        race["ok"].as_bool() == Some(true),
        "one code raced by {} clients: not exactly one 200 ({race})",
        args.clients
    );
    Ok(())
}

/// Checks of `codes` (in turn) at `--rate` a second for `--seconds`, each
/// started on its schedule whatever came back; latency from the scheduled
/// start.
async fn check_latency(
    args: &RedeemBenchArgs,
    http: &Http,
    codes: Arc<Vec<String>>,
) -> anyhow::Result<Value> {
    let (rate, n) = (args.rate, args.rate as usize * args.seconds as usize);
    let started = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    let (mut sent, mut tasks) = (0usize, JoinSet::new());
    while sent < n {
        tick.tick().await;
        let due = ((started.elapsed().as_secs_f64() * f64::from(rate)) as usize + 1).min(n);
        while sent < due {
            let scheduled = started + Duration::from_secs_f64(sent as f64 / f64::from(rate));
            let body = json!({"code": codes[sent % codes.len()]})
                .to_string()
                .into_bytes();
            let http = http.clone();
            tasks.spawn_on(
                async move {
                    let a = http.post(body).await;
                    (scheduled.elapsed(), a)
                },
                crate::client_runtime(),
            );
            sent += 1;
        }
    }
    // An overloaded server answers late, refuses connections or says 503:
    // each is counted and timed like any answer, so the run still reports
    // the tail it made, and says how many checks failed.
    let (mut lat, mut ok, mut failed) = (Vec::with_capacity(n), 0usize, 0usize);
    let mut first_failure = None;
    while let Some(done) = tasks.join_next().await {
        let (took, answer) = done?;
        match answer {
            Ok(a) if a.status == 200 => ok += 1,
            Ok(a) => {
                failed += 1;
                first_failure.get_or_insert_with(|| format!("status {}", a.status));
            }
            Err(e) => {
                failed += 1;
                first_failure.get_or_insert_with(|| format!("{e:#}"));
            }
        }
        lat.push(took);
    }
    lat.sort();
    let p = |q: f64| ms(percentile(&lat, q));
    Ok(json!({
        "rate": rate, "seconds": args.seconds, "sent": n, "answered_200": ok,
        "failed": failed, "first_failure": first_failure,
        "p50_ms": p(0.5), "p90_ms": p(0.9), "p99_ms": p(0.99), "max_ms": p(1.0),
    }))
}

/// One fresh code, redeemed by `clients` clients at once with their own
/// ids: exactly one 200, the others 409.
async fn one_code_raced(
    ordering: &Http,
    redeeming: &Http,
    clients: usize,
) -> anyhow::Result<Value> {
    let (codes, _) = orders(ordering, 1, "race", 1).await?;
    let code = Arc::new(codes);
    let mut tasks = JoinSet::new();
    for i in 0..clients {
        let (http, code) = (redeeming.clone(), code.clone());
        tasks.spawn_on(
            async move {
                let body = json!({"code": code[0], "redemption_id": format!("race-{i}")});
                http.post(body.to_string().into_bytes()).await
            },
            crate::client_runtime(),
        );
    }
    let (mut won, mut lost, mut other) = (0, 0, 0);
    while let Some(done) = tasks.join_next().await {
        match done??.status {
            200 => won += 1,
            409 => lost += 1,
            _ => other += 1,
        }
    }
    Ok(json!({
        "clients": clients, "ok_200": won, "conflicts_409": lost, "other": other,
        "ok": won == 1 && lost == clients - 1,
    }))
}
