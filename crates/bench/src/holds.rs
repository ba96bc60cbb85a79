//! `codepool-bench holds`: checkout holds and bundles against the orders
//! they ride on (issue 46's "Speed"), in one run on the same servers and
//! the same in-process API:
//!
//! - holds of one code per second against HTTP orders of one code per
//!   second (goal: at least 0.8×);
//! - 2-item bundles (one code from each of two pools) in codes per second
//!   against HTTP orders of quantity 2 (goal: at least 0.8×).
//!
//! Then the same bundles and orders of 2 through the AMQP dispatcher
//! (`holds_amqp.rs`), for the servers' CPU per bundle code at both doors.
//!
//! Each comparison alternates its two sides `--rounds` times (the side that
//! goes first alternates too) and judges the median of the rounds' ratios:
//! one pair of runs moves with the host's load. Every request must answer
//! 201, and every hold and bundle must hold or get distinct codes.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use codepool_api::Scope;
use serde_json::{json, Value};

use crate::api::{closed_loop, ApiServer, Http, Meter};
use crate::{inproc, Scratch};

/// Holds and bundles against the orders they ride on.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Example:\n  RUST_LOG=warn codepool-bench holds --requests 10000 --clients 64 --rounds 3\n\nWrites holds.json."
)]
pub struct HoldsBenchArgs {
    /// Requests of each side in each round.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(100..=1_000_000))]
    pub requests: u64,
    /// Concurrent keep-alive clients.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub clients: u64,
    /// Alternating rounds of each comparison (the median ratio is judged).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=20))]
    pub rounds: u64,
    /// Print the results as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Issue 46's goals.
const HOLDS_OVER_ORDERS: f64 = 0.8;
const BUNDLES_OVER_PAIRS: f64 = 0.8;
/// Requests sent before the measurement (connections, hot sets, caches).
const WARM: usize = 200;

/// One side of a comparison: what it sends.
#[derive(Clone, Copy)]
enum Side {
    Orders,
    Holds,
    Pairs,
    Bundles,
}

impl Side {
    fn name(self) -> &'static str {
        match self {
            Side::Orders => "HTTP orders of 1",
            Side::Holds => "holds of 1",
            Side::Pairs => "HTTP orders of 2",
            Side::Bundles => "2-item bundles",
        }
    }

    fn path(self) -> &'static str {
        match self {
            Side::Holds => "/v1/holds",
            _ => "/v1/orders",
        }
    }

    /// Codes each request gets.
    fn codes(self) -> u64 {
        match self {
            Side::Orders | Side::Holds => 1,
            Side::Pairs | Side::Bundles => 2,
        }
    }

    /// The body of request `i` of round tag `tag`.
    fn body(self, tag: &str, i: usize) -> Vec<u8> {
        let phone = format!("+86138{:08}", i % 100_000_000);
        match self {
            Side::Orders => json!({"order_id": format!("{tag}-o{i}"), "uid": format!("u{tag}{i}"), "phone": phone, "pool": "ho"}),
            Side::Pairs => json!({"order_id": format!("{tag}-p{i}"), "uid": format!("u{tag}{i}"), "phone": phone, "pool": "hq", "quantity": 2}),
            Side::Holds => json!({"hold_id": format!("{tag}-h{i}"), "uid": format!("u{tag}{i}"), "items": [{"pool": "hh", "quantity": 1}]}),
            Side::Bundles => json!({"order_id": format!("{tag}-b{i}"), "uid": format!("u{tag}{i}"), "phone": phone,
                                    "items": [{"pool": "hb1", "quantity": 1}, {"pool": "hb2", "quantity": 1}]}),
        }
        .to_string()
        .into_bytes()
    }
}

pub async fn run(
    args: HoldsBenchArgs,
    scratch: &'static Scratch,
    out_dir: &Path,
) -> anyhow::Result<()> {
    let result = measure(&args, scratch, out_dir).await;
    if let Err(e) = crate::delete_topology(&scratch.cfg, &[]).await {
        tracing::warn!(error = %e, "could not remove the benchmark queues");
    }
    result
}

fn say(args: &HoldsBenchArgs, s: impl std::fmt::Display) {
    if !args.json {
        eprintln!("{s}");
    }
}

/// One side's run: requests per second and codes per second, and the
/// servers' CPU (codepool, mongod, RabbitMQ, Redis; the clients' threads
/// apart) per code.
struct Run {
    seconds: f64,
    codes: u64,
    server_cpu_ms_per_code: f64,
    /// CPU ms per code by process, and mongod's commands and documents
    /// per code: where a side's cost goes.
    detail: Value,
}

impl Run {
    fn codes_per_sec(&self) -> f64 {
        self.codes as f64 / self.seconds
    }
}

async fn side(
    http: &Http,
    store: &codepool_store::Store,
    clients: usize,
    (side, tag): (Side, &str),
    n: usize,
) -> anyhow::Result<Run> {
    let tag = Arc::<str>::from(tag);
    let body = Arc::new(move |i: usize| side.body(&tag, i));
    let meter = Meter::start(store).await;
    let (answers, took) = closed_loop(http, clients, n, body).await?;
    let codes = n as u64 * side.codes();
    let (used, mut detail) = meter.finish(store, codes as usize).await;
    let (server_cpu_ms_per_code, _) = crate::server_and_clients_ms(&used, codes as usize);
    let per_code: serde_json::Map<String, Value> = (used.iter())
        .map(|(p, s)| ((*p).to_owned(), json!(s * 1000.0 / codes as f64)))
        .collect();
    detail["cpu_ms_per_code"] = Value::Object(per_code);
    let bad: Vec<u16> = (answers.iter().flatten())
        .map(|a| a.status)
        .filter(|s| *s != 201)
        .take(5)
        .collect();
    anyhow::ensure!(
        bad.is_empty(),
        "{}: answers other than 201: {bad:?}",
        side.name()
    );
    Ok(Run {
        seconds: took.as_secs_f64(),
        codes,
        server_cpu_ms_per_code,
        detail,
    })
}

/// Fills the pools of both doors, creates the key and starts the API.
async fn prepare(
    args: &HoldsBenchArgs,
    scratch: &'static Scratch,
    n: usize,
) -> anyhow::Result<(ApiServer, String)> {
    let mut sizes = vec![
        ("ho".to_owned(), n + WARM),
        ("hh".to_owned(), n + WARM),
        ("hq".to_owned(), 2 * n + WARM),
        ("hb1".to_owned(), n + WARM),
        ("hb2".to_owned(), n + WARM),
    ];
    sizes.extend(crate::holds_amqp::pools(n));
    let total: usize = sizes.iter().map(|s| s.1).sum();
    say(
        args,
        format!("importing {total} codes into {} …", scratch.cfg.db),
    );
    inproc::fill_pools(scratch, &sizes, 4).await?;
    let _ = crate::metrics();
    let scopes = [Scope::OrdersWrite, Scope::OrdersRead];
    let actor = codepool_issuance::audit::Actor::os_user("bench", "localhost", "codepool-bench");
    let token = codepool_api::keys::create(&scratch.store, "bench", &scopes, &actor)
        .await?
        .token;
    Ok((ApiServer::start(scratch).await?, token))
}

async fn measure(
    args: &HoldsBenchArgs,
    scratch: &'static Scratch,
    out_dir: &Path,
) -> anyhow::Result<()> {
    let n = args.requests as usize * args.rounds as usize;
    let (api, token) = prepare(args, scratch, n).await?;
    let http = |side: Side| Http::to(api.addr, &token, args.clients as usize, side.path());
    // Warm every path once.
    for s in [Side::Orders, Side::Holds, Side::Pairs, Side::Bundles] {
        let clients = args.clients as usize;
        side(&http(s), &scratch.store, clients, (s, "warm"), WARM / 2).await?;
    }
    let holds = compare_paths(
        args,
        scratch,
        &http(Side::Orders),
        &http(Side::Holds),
        (Side::Orders, Side::Holds),
    )
    .await?;
    let bundles = compare_paths(
        args,
        scratch,
        &http(Side::Pairs),
        &http(Side::Bundles),
        (Side::Pairs, Side::Bundles),
    )
    .await?;
    // Every hold holds distinct codes, and every bundle got one code of
    // each pool (counted before the AMQP side runs: no hold expires).
    let held = crate::count_codes(
        &scratch.store,
        mongodb::bson::doc! {"pool": "hh", "status": 4},
    )
    .await?;
    let bundled = crate::count_codes(
        &scratch.store,
        mongodb::bson::doc! {"pool": {"$in": ["hb1", "hb2"]}, "status": 1},
    )
    .await?;
    // The API stops first, so none of its background work lands in the
    // AMQP side's CPU.
    api.stop().await?;
    let (rounds, per_round) = (args.rounds as usize, args.requests as usize);
    let amqp = crate::holds_amqp::compare(scratch, rounds, per_round, |s| say(args, s)).await?;
    let want_held = (n + WARM / 2) as u64;
    let report = json!({
        "benchmark": "holds",
        "requests_per_round": args.requests,
        "clients": args.clients,
        "rounds": args.rounds,
        "goals": {
            "holds_over_orders": goal(&holds, HOLDS_OVER_ORDERS),
            "bundles_over_pairs": goal(&bundles, BUNDLES_OVER_PAIRS),
        },
        "bundle_cpu_http_over_amqp": bundles_cpu_over(&bundles, &amqp),
        "holds_vs_orders": holds,
        "bundles_vs_pairs": bundles,
        "amqp_bundles_vs_pairs": amqp,
        "checks": {"held": held, "held_expected": want_held, "bundled_codes": bundled, "bundled_expected": 2 * want_held,
                   "amqp_ok": amqp["checks"]["ok"],
                   "ok": held == want_held && bundled == 2 * want_held && amqp["checks"]["ok"] == true},
    });
    let (rendered, path) = crate::write_report(out_dir, "holds.json", &report)?;
    if args.json {
        println!("{rendered}");
    } else {
        print_ratios(&report);
        println!("written to {}", path.display());
    }
    anyhow::ensure!(
        report["checks"]["ok"].as_bool() == Some(true),
        "inconsistent results (see checks in {})",
        path.display()
    );
    Ok(())
}

/// The servers' CPU per bundle code, HTTP over AMQP, medians of each
/// door's rounds.
fn bundles_cpu_over(http: &Value, amqp: &Value) -> Value {
    let median = |rows: &Value, pick: &dyn Fn(&Value) -> Option<f64>| {
        let mut v: Vec<f64> = rows
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(pick)
            .collect();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied()
    };
    let h = median(&http["rounds"], &|r| r["b_server_cpu_ms_per_code"].as_f64());
    let a = median(&amqp["rounds"], &|r| {
        r["bundles"]["server_cpu_ms_per_code"].as_f64()
    });
    json!({"http_ms": h, "amqp_ms": a, "ratio": h.zip(a).map(|(h, a)| h / a)})
}

/// A comparison's median against its target.
fn goal(c: &Value, target: f64) -> Value {
    let v = c["median_ratio"].as_f64().unwrap_or(0.0);
    json!({"target": target, "value": v, "met": v >= target})
}

/// Each comparison's median and rounds, one line each.
fn print_ratios(report: &Value) {
    for (what, key) in [
        ("holds of 1 / HTTP orders of 1", "holds_vs_orders"),
        (
            "2-item bundles / HTTP orders of 2 (codes/s)",
            "bundles_vs_pairs",
        ),
    ] {
        let c = &report[key];
        let rounds: Vec<String> = (c["rounds"].as_array().into_iter().flatten())
            .map(|r| format!("{:.2}", r["ratio"].as_f64().unwrap_or(0.0)))
            .collect();
        let cpu: Vec<String> = (c["rounds"].as_array().into_iter().flatten())
            .map(|r| {
                format!(
                    "{:.3}/{:.3}",
                    r["b_server_cpu_ms_per_code"].as_f64().unwrap_or(0.0),
                    r["a_server_cpu_ms_per_code"].as_f64().unwrap_or(0.0)
                )
            })
            .collect();
        println!(
            "{what}: median {:.2}× (rounds {}); servers' CPU per code, median {:.2}× (ms, rounds {})",
            c["median_ratio"].as_f64().unwrap_or(0.0),
            rounds.join(", "),
            c["median_cpu_ratio"].as_f64().unwrap_or(0.0),
            cpu.join(", ")
        );
    }
    let a = &report["amqp_bundles_vs_pairs"];
    let each: Vec<String> = (a["rounds"].as_array().into_iter().flatten())
        .map(|r| {
            format!(
                "{:.2} ({:.3}/{:.3} ms)",
                r["ratio"].as_f64().unwrap_or(0.0),
                r["bundles"]["server_cpu_ms_per_code"]
                    .as_f64()
                    .unwrap_or(0.0),
                r["pairs"]["server_cpu_ms_per_code"].as_f64().unwrap_or(0.0)
            )
        })
        .collect();
    println!(
        "AMQP 2-item bundles / AMQP orders of 2 (codes/s): median {:.2}× (rounds {}); servers' CPU per code, median {:.2}×",
        a["median_ratio"].as_f64().unwrap_or(0.0),
        each.join(", "),
        a["median_cpu_ratio"].as_f64().unwrap_or(0.0)
    );
    let c = &report["bundle_cpu_http_over_amqp"];
    println!(
        "servers' CPU per bundle code, HTTP / AMQP: {:.2}× ({:.3} vs {:.3} ms, medians)",
        c["ratio"].as_f64().unwrap_or(0.0),
        c["http_ms"].as_f64().unwrap_or(0.0),
        c["amqp_ms"].as_f64().unwrap_or(0.0)
    );
}

/// Alternating runs of two sides, each on its own path.
async fn compare_paths(
    args: &HoldsBenchArgs,
    scratch: &'static Scratch,
    http_a: &Http,
    http_b: &Http,
    (a, b): (Side, Side),
) -> anyhow::Result<Value> {
    let (n, clients) = (args.requests as usize, args.clients as usize);
    let mut rows = Vec::new();
    for round in 0..args.rounds {
        let order = if round % 2 == 0 {
            [(a, http_a, false), (b, http_b, true)]
        } else {
            [(b, http_b, true), (a, http_a, false)]
        };
        let mut runs: Vec<(bool, Run)> = Vec::new();
        for (s, http, is_b) in order {
            say(args, format!("round {}: {} × {n} …", round + 1, s.name()));
            let tag = format!("r{round}");
            let run = side(http, &scratch.store, clients, (s, &tag), n).await?;
            runs.push((is_b, run));
            // Quiet between sides: the relay's and the journal's catch-up
            // belong to neither.
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        let ra = runs
            .iter()
            .find(|(is_b, _)| !is_b)
            .map(|(_, r)| r)
            .expect("ran");
        let rb = runs
            .iter()
            .find(|(is_b, _)| *is_b)
            .map(|(_, r)| r)
            .expect("ran");
        rows.push(json!({
            "round": round + 1,
            "a_codes_per_sec": ra.codes_per_sec(),
            "b_codes_per_sec": rb.codes_per_sec(),
            "ratio": rb.codes_per_sec() / ra.codes_per_sec(),
            "a_server_cpu_ms_per_code": ra.server_cpu_ms_per_code,
            "b_server_cpu_ms_per_code": rb.server_cpu_ms_per_code,
            "cpu_ratio": rb.server_cpu_ms_per_code / ra.server_cpu_ms_per_code,
            "a_detail": ra.detail,
            "b_detail": rb.detail,
        }));
    }
    let median_of = |key: &str| {
        let mut v: Vec<f64> = rows.iter().filter_map(|r| r[key].as_f64()).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (median, cpu) = (median_of("ratio"), median_of("cpu_ratio"));
    Ok(
        json!({"a": a.name(), "b": b.name(), "rounds": rows, "median_ratio": median, "median_cpu_ratio": cpu}),
    )
}
