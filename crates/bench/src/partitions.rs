//! `codepool-bench dispatch --compare-partitions N`: the same purchases of
//! eight pools through two dispatchers, on the one queue (competing
//! consumers, as before partitions) and on N partitions (each partition one
//! active consumer; each dispatcher prefers its own partitions and stands
//! by for the others), one after the other in one run, each from a cold
//! start (fresh dispatchers, Redis emptied, after a MongoDB checkpoint).
//!
//! Partitions exist to give purchases several queue leaders, on a cluster
//! whose nodes and dispatchers have cores of their own. On one 2-core
//! machine both sides share the same two cores with every server, so this
//! cannot show scaling, only what partitions cost: the partitioned side's
//! extra queues and consumers, and any imbalance between its dispatchers.

use std::path::Path;
use std::time::Duration;

use codepool_broker::{Publisher, Standby, Topology};
use codepool_dispatcher::DispatcherConfig;
use mongodb::bson::doc;
use serde_json::json;

use crate::dispatch::{check_dispatched, Checks, DispatchBenchArgs};
use crate::{inproc, Scratch};

/// Pools the purchases spread over, half in each of two partitions.
const POOLS: usize = 8;

/// One side's run.
struct Run {
    partitions: u16,
    seconds: f64,
    purchases: usize,
    cpu: Vec<(&'static str, f64)>,
    checks: Checks,
}

impl Run {
    fn per_sec(&self) -> f64 {
        self.purchases as f64 / self.seconds.max(1e-9)
    }
}

/// [`run`] of owned flags (as the command line hands them over).
pub async fn run_owned(
    args: DispatchBenchArgs,
    scratch: &'static Scratch,
    out_dir: &Path,
) -> anyhow::Result<()> {
    run(&args, scratch, out_dir).await
}

/// Runs the rounds (sides alternating: 1 N, N 1, …) and reports the
/// median of the rounds' ratios; writes `dispatch-partitions-N.json`.
pub async fn run(
    args: &DispatchBenchArgs,
    scratch: &Scratch,
    out_dir: &Path,
) -> anyhow::Result<()> {
    let n = args.scale.compare_partitions.unwrap_or(2);
    let mut rounds = Vec::new();
    for r in 0..args.scale.rounds.max(1) {
        let order = if r % 2 == 0 { [1, n] } else { [n, 1] };
        let mut pair = Vec::new();
        for partitions in order {
            pair.push(run_side(args, scratch, partitions, r).await?);
        }
        pair.sort_by_key(|run| run.partitions);
        rounds.push(pair);
    }
    report(args, n, &rounds, out_dir)
}

/// Pool names of `tag`, `POOLS / 2` in each partition of two (so the
/// partitioned side's dispatchers get the same share).
fn balanced_pools(tag: &str) -> Vec<String> {
    let mut per = [0usize; 2];
    let mut pools = Vec::new();
    for k in 0.. {
        if pools.len() == POOLS {
            break;
        }
        let name = format!("{tag}-pool{k}");
        let p = usize::from(codepool_broker::partition_of(&name, 2));
        if per[p] < POOLS / 2 {
            per[p] += 1;
            pools.push(name);
        }
    }
    pools
}

/// One side: its own queues (a prefix of its own, so the two partition
/// counts never meet) and pools, preloaded, then two dispatchers until
/// every purchase went end to end.
async fn run_side(
    args: &DispatchBenchArgs,
    scratch: &Scratch,
    partitions: u16,
    round: u32,
) -> anyhow::Result<Run> {
    let tag = format!("r{round}p{partitions}");
    let mut cfg = scratch.cfg.clone();
    cfg.amqp_prefix = format!("{}{tag}.", scratch.cfg.amqp_prefix);
    cfg.partitions = partitions;
    let side = Scratch {
        cfg,
        store: scratch.store.clone(),
    };
    let result = measure_side(args, &side, &tag).await;
    if let Err(e) = crate::delete_topology(&side.cfg, &[]).await {
        tracing::warn!(error = %e, "could not remove the benchmark queues");
    }
    let (seconds, cpu, checks) = result?;
    Ok(Run {
        partitions,
        seconds,
        purchases: args.purchases as usize,
        cpu,
        checks,
    })
}

type Measured = (f64, Vec<(&'static str, f64)>, Checks);

async fn measure_side(
    args: &DispatchBenchArgs,
    side: &Scratch,
    tag: &str,
) -> anyhow::Result<Measured> {
    let n = args.purchases as usize;
    let pools = balanced_pools(tag);
    let per_pool = n / POOLS + n / POOLS / 10 + 10;
    let sizes: Vec<(String, usize)> = pools.iter().map(|p| (p.clone(), per_pool)).collect();
    inproc::fill_pools(side, &sizes, 4).await?;
    let topology = side.cfg.topology();
    let conn = preload(side, &topology, &pools, tag, n).await?;
    crate::delete_redis_keys(&side.cfg.redis_url, &side.cfg.redis_prefix).await?;
    inproc::checkpoint(side).await?;
    println!(
        "{} partition(s), two dispatchers, {n} purchases over {POOLS} pools …",
        topology.partitions
    );
    let base = args.dispatcher_config();
    let config = |prefer: u16| DispatcherConfig {
        standby: Standby {
            prefer: if topology.is_partitioned() {
                (0..topology.partitions)
                    .filter(|p| p % 2 == prefer)
                    .collect()
            } else {
                Vec::new()
            },
            after: Duration::from_secs(DispatcherConfig::DEFAULT_STANDBY_SECS),
        },
        ..base.clone()
    };
    let first = inproc::start(side, &config(0))?;
    let second = inproc::start(side, &config(1))?;
    let ran = first.finish(n as u64).await;
    second.stop().await?;
    let ran = ran?;
    let filter = doc! {"pool": {"$in": &pools}};
    let checks = check_dispatched(side, &conn, filter, n, 0).await?;
    let _ = conn.close(200, "checked").await;
    Ok((ran.elapsed.as_secs_f64(), ran.cpu, checks))
}

/// Declares the side's topology and publishes its purchases, round robin
/// over the pools, confirmed.
async fn preload(
    side: &Scratch,
    topology: &Topology,
    pools: &[String],
    tag: &str,
    n: usize,
) -> anyhow::Result<lapin::Connection> {
    let conn = codepool_broker::connect(&side.cfg.amqp_url, "codepool-bench-partitions").await?;
    let publisher = Publisher::new(&conn, topology.clone())
        .await?
        .as_user(&Publisher::user_of(&side.cfg.amqp_url));
    topology.declare(publisher.channel()).await?;
    inproc::preload(n, |i| {
        let p = inproc::purchase(tag, &pools[i % pools.len()], i);
        let publisher = publisher.clone();
        async move { Ok(publisher.publish_purchase(&p).await?) }
    })
    .await?;
    Ok(conn)
}

fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    match xs.len() {
        0 => 0.0,
        n if n % 2 == 1 => xs[n / 2],
        n => (xs[n / 2 - 1] + xs[n / 2]) / 2.0,
    }
}

const NOTE: &str = "two dispatchers in the benchmark process on each side; the partitioned side's dispatchers each prefer half the partitions (single active consumer per partition), the one-queue side's compete on one queue. On a 2-core machine every server and both dispatchers share the same two cores: this cannot show scaling, only what partitions cost";

fn report(
    args: &DispatchBenchArgs,
    n: u16,
    rounds: &[Vec<Run>],
    out_dir: &Path,
) -> anyhow::Result<()> {
    let side_json = |r: &Run| {
        json!({
            "partitions": r.partitions, "dispatchers": 2, "purchases": r.purchases,
            "seconds": r.seconds, "purchases_per_sec": r.per_sec(),
            "cpu_seconds": crate::cpu_json(&r.cpu), "checks": r.checks.json(),
        })
    };
    let mut ratios: Vec<f64> = rounds
        .iter()
        .map(|pair| pair[1].per_sec() / pair[0].per_sec().max(1e-9))
        .collect();
    let ok = rounds.iter().flatten().all(|r| r.checks.ok);
    let report = json!({
        "benchmark": "dispatch-partitions",
        "purchases": args.purchases,
        "pools": POOLS,
        "rounds": rounds.iter().zip(&ratios).map(|(pair, ratio)| json!({
            "results": pair.iter().map(side_json).collect::<Vec<_>>(), "ratio": ratio,
        })).collect::<Vec<_>>(),
        "ratio": median(&mut ratios.clone()),
        "checks_ok": ok,
        "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
        "note": NOTE,
    });
    let name = format!("dispatch-partitions-{n}.json");
    let (rendered, path) = crate::write_report(out_dir, &name, &report)?;
    if args.json {
        println!("{rendered}");
    } else {
        for (pair, ratio) in rounds.iter().zip(&ratios) {
            for r in pair {
                println!(
                    "{} partition(s), 2 dispatchers: {} purchases in {:.2} s = {:.0}/s; cpu {}; {}",
                    r.partitions,
                    r.purchases,
                    r.seconds,
                    r.per_sec(),
                    crate::describe_cpu(&r.cpu),
                    r.checks.line()
                );
            }
            println!("{n} partitions / 1 queue = {ratio:.2}x");
        }
        println!(
            "median ratio {:.2}x; {NOTE}\nwritten to {}",
            median(&mut ratios),
            path.display()
        );
    }
    anyhow::ensure!(
        ok,
        "inconsistent results (see checks in {})",
        path.display()
    );
    Ok(())
}
