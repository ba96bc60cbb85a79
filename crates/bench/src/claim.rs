//! `codepool bench claim`: the four ways to hand out pooled codes, side by
//! side, on fresh identical pools, in one process and one run.
//!
//! 1. find the first unissued code, then update `{_id, status: 0}`; a miss
//!    (someone else got it first) starts over and counts as a retry;
//! 2. update one unissued code setting the order, then find it by order;
//! 3. `findOneAndUpdate` on the oldest unissued code;
//! 4. the real claim engine: distinct candidates from the Redis hot pool,
//!    claimed a batch of purchases at a time in one bulk write.
//!
//! Every write is journaled with majority acknowledgement, as in
//! production. Each run stops when its pool's codes are all claimed or its
//! time is up, whichever comes first; then it checks that no code went to
//! two claimers and no order holds two codes.

use std::collections::HashSet;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use codepool_domain::{CodeStatus, Purchase};
use codepool_issuance::{ClaimEngine, ClaimOutcome, Resend};
use codepool_store::{durable, ObjectId};
use mongodb::bson::{doc, DateTime, Document};
use mongodb::options::ReturnDocument;
use mongodb::Collection;
use serde_json::json;

use super::{metric_sum, ms, percentile, Scratch};

/// Compare the claim strategies at several concurrencies.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Example:\n  codepool bench claim --concurrency 1,8,32 --codes 20000 --json"
)]
pub struct ClaimBenchArgs {
    /// Concurrent claimers, one run of every strategy per value.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    pub concurrency: Vec<usize>,
    /// Codes in each strategy's pool (and the most claims one run makes).
    #[arg(long, default_value_t = 20_000, value_parser = clap::value_parser!(u64).range(100..=5_000_000))]
    pub codes: u64,
    /// Seconds one run may take before its claimers stop early; slow
    /// strategies are measured on the claims they made by then.
    #[arg(long, default_value_t = 4.0)]
    pub max_seconds: f64,
    /// Purchases per `claim_batch` call in strategy (4).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..=1000))]
    pub batch: u64,
    /// Print the results as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Strategy {
    FindThenUpdate,
    UpdateThenFind,
    FindOneAndUpdate,
    HotPoolBatched,
}

impl Strategy {
    const ALL: [Strategy; 4] = [
        Strategy::FindThenUpdate,
        Strategy::UpdateThenFind,
        Strategy::FindOneAndUpdate,
        Strategy::HotPoolBatched,
    ];

    fn number(self) -> usize {
        self as usize + 1
    }

    fn label(self) -> &'static str {
        match self {
            Strategy::FindThenUpdate => "(1) find, then update {_id,status:0}",
            Strategy::UpdateThenFind => "(2) update one, then find by order",
            Strategy::FindOneAndUpdate => "(3) findOneAndUpdate by seq",
            Strategy::HotPoolBatched => "(4) hot pool + batched claim_batch",
        }
    }
}

/// What one run (a strategy at a concurrency) did.
struct Run {
    strategy: Strategy,
    concurrency: usize,
    claims: usize,
    elapsed: Duration,
    retries: u64,
    /// Strategy (4) only: claims that went through the MongoDB scan path.
    scan_claims: Option<u64>,
    p50: Duration,
    p99: Duration,
    distinct_codes: bool,
    issued_in_db: u64,
    distinct_orders: u64,
}

impl Run {
    fn per_sec(&self) -> f64 {
        self.claims as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// No code twice, no order twice, and the database agrees with the claimers.
    fn ok(&self) -> bool {
        self.distinct_codes
            && self.issued_in_db == self.claims as u64
            && self.distinct_orders == self.issued_in_db
    }
}

/// What one claimer did.
#[derive(Default)]
struct Claimed {
    code_ids: Vec<ObjectId>,
    latencies: Vec<Duration>,
    retries: u64,
}

/// The shared to-do list of a run: order numbers handed out in order, and
/// the moment claimers stop taking new ones.
struct Work {
    pool: String,
    total: usize,
    next: AtomicUsize,
    deadline: Instant,
}

impl Work {
    /// The next `n` order numbers, or `None` when done or out of time.
    fn take(&self, n: usize) -> Option<std::ops::Range<usize>> {
        if Instant::now() >= self.deadline {
            return None;
        }
        let start = self.next.fetch_add(n, Ordering::Relaxed);
        (start < self.total).then(|| start..(start + n).min(self.total))
    }

    fn purchase(&self, i: usize) -> Purchase {
        Purchase {
            order_id: format!("{}-o{i}", self.pool),
            uid: format!("u{i}"),
            phone: format!("+86138{:08}", i % 100_000_000),
            pool: self.pool.clone(),
            purchased_at: None,
            quantity: 1,
            owner: None,
            hold_id: None,
            items: Vec::new(),
            shop: None,
        }
    }
}

/// Runs `codepool bench claim`; writes `out_dir/claim.json`. Fails if any
/// run handed a code out twice.
pub async fn run(
    args: ClaimBenchArgs,
    scratch: &'static Scratch,
    out_dir: &Path,
) -> anyhow::Result<()> {
    let mut concurrencies = args.concurrency.clone();
    concurrencies.retain(|c| *c > 0);
    anyhow::ensure!(
        !concurrencies.is_empty(),
        "give at least one concurrency, e.g. --concurrency 1,8,32"
    );
    let setup_seconds = prepare(&args, scratch, &concurrencies).await?;
    let mut runs = Vec::new();
    for &c in &concurrencies {
        for s in Strategy::ALL {
            if !args.json {
                eprintln!("running {} with {c} claimers …", s.label());
            }
            runs.push(one_run(&args, scratch, c, s).await?);
        }
    }
    report(&args, &runs, &concurrencies, setup_seconds, out_dir)
}

/// Fills one pool per concurrency and strategy, warms up; returns the
/// seconds it took.
async fn prepare(
    args: &ClaimBenchArgs,
    scratch: &'static Scratch,
    concurrencies: &[usize],
) -> anyhow::Result<f64> {
    let codes = args.codes as usize;
    if !args.json {
        eprintln!(
            "preparing {} pools of {codes} codes in {} …",
            concurrencies.len() * Strategy::ALL.len(),
            scratch.cfg.db
        );
    }
    let prepared = Instant::now();
    for &c in concurrencies {
        for s in Strategy::ALL {
            super::fill_pool(&scratch.store, &pool_name(c, s), codes).await?;
        }
    }
    let setup_seconds = prepared.elapsed().as_secs_f64();
    warm_up(scratch, concurrencies.iter().copied().max().unwrap_or(1)).await?;
    Ok(setup_seconds)
}

/// Engine counters read before and after a run.
fn engine_counts() -> Option<(f64, f64)> {
    let m = super::metrics()?;
    Some((
        metric_sum(m, "codepool_claim_races_total", None),
        metric_sum(m, "codepool_claims_total", Some("path=\"scan\"")),
    ))
}

/// `c` claimers of strategy `s` drain their pool; the run's numbers.
async fn one_run(
    args: &ClaimBenchArgs,
    scratch: &'static Scratch,
    c: usize,
    s: Strategy,
) -> anyhow::Result<Run> {
    let work = Arc::new(Work {
        pool: pool_name(c, s),
        total: args.codes as usize,
        next: AtomicUsize::new(0),
        deadline: Instant::now() + Duration::from_secs_f64(args.max_seconds),
    });
    let before = engine_counts();
    // One engine shared by all claimers, as in one dispatcher.
    let engine = codepool::context::claim_engine(&scratch.cfg, &scratch.store)?;
    let started = Instant::now();
    let tasks: Vec<_> = (0..c)
        .map(|_| match s {
            Strategy::HotPoolBatched => tokio::spawn(hot_pool_batched(
                engine.clone(),
                work.clone(),
                args.batch as usize,
            )),
            _ => tokio::spawn(classic(codes_collection(scratch), work.clone(), s)),
        })
        .collect();
    let mut all = Claimed::default();
    for t in tasks {
        let claimed = t.await.context("a claimer panicked")??;
        all.code_ids.extend(claimed.code_ids);
        all.latencies.extend(claimed.latencies);
        all.retries += claimed.retries;
    }
    let elapsed = started.elapsed();
    let mut scan_claims = None;
    if let (Some((races0, scans0)), Some((races1, scans1))) = (before, engine_counts()) {
        all.retries += (races1 - races0) as u64;
        scan_claims = (s == Strategy::HotPoolBatched).then_some((scans1 - scans0) as u64);
    }
    all.latencies.sort_unstable();
    let distinct_codes = all.code_ids.iter().collect::<HashSet<_>>().len() == all.code_ids.len();
    let (issued_in_db, distinct_orders) =
        super::issued_and_distinct_orders(&scratch.store, &work.pool).await?;
    Ok(Run {
        strategy: s,
        concurrency: c,
        claims: all.code_ids.len(),
        elapsed,
        retries: all.retries,
        scan_claims,
        p50: percentile(&all.latencies, 0.50),
        p99: percentile(&all.latencies, 0.99),
        distinct_codes,
        issued_in_db,
        distinct_orders,
    })
}

/// Ratios at concurrency 32 (or the highest one measured): the hot pool
/// over find-then-update and over findOneAndUpdate.
fn ratios(runs: &[Run], concurrencies: &[usize]) -> (usize, f64, f64) {
    let at = if concurrencies.contains(&32) {
        32
    } else {
        concurrencies.iter().copied().max().unwrap_or(1)
    };
    let rate = |s: Strategy| {
        runs.iter()
            .find(|r| r.concurrency == at && r.strategy == s)
            .map(Run::per_sec)
            .unwrap_or(0.0)
    };
    let over_1 = rate(Strategy::HotPoolBatched) / rate(Strategy::FindThenUpdate).max(1e-9);
    let over_3 = rate(Strategy::HotPoolBatched) / rate(Strategy::FindOneAndUpdate).max(1e-9);
    (at, over_1, over_3)
}

fn run_json(r: &Run) -> serde_json::Value {
    json!({
        "concurrency": r.concurrency,
        "strategy": r.strategy.number(),
        "label": r.strategy.label(),
        "claims": r.claims,
        "seconds": r.elapsed.as_secs_f64(),
        "claims_per_sec": r.per_sec(),
        "retries": r.retries,
        "scan_claims": r.scan_claims,
        "p50_ms": ms(r.p50),
        "p99_ms": ms(r.p99),
        "distinct_codes": r.distinct_codes,
        "issued_in_db": r.issued_in_db,
        "distinct_orders": r.distinct_orders,
        "no_code_twice": r.ok(),
    })
}

/// Writes `claim.json`, prints the table, fails on a code issued twice.
fn report(
    args: &ClaimBenchArgs,
    runs: &[Run],
    concurrencies: &[usize],
    setup_seconds: f64,
    out_dir: &Path,
) -> anyhow::Result<()> {
    let (at, over_1, over_3) = ratios(runs, concurrencies);
    let report = json!({
        "benchmark": "claim",
        "write_concern": {"w": "majority", "j": true},
        "codes_per_pool": args.codes,
        "max_seconds_per_run": args.max_seconds,
        "batch": args.batch,
        "setup_seconds": setup_seconds,
        "latency_note": "per claim for (1)-(3); for (4) every purchase's latency is its claim_batch call's latency",
        "retries_note": "(1): misses of the conditional update; (2),(3): none visible (MongoDB retries write conflicts inside the server); (4): orders that lost a race and took fresh candidates (codepool_claim_races_total)",
        "results": runs.iter().map(run_json).collect::<Vec<_>>(),
        "ratios": {
            "concurrency": at,
            "hot_pool_over_find_then_update": over_1,
            "hot_pool_over_find_one_and_update": over_3,
            "target_over_find_then_update": 20.0,
            "target_over_find_one_and_update": 5.0,
            "targets_met": over_1 >= 20.0 && over_3 >= 5.0,
        },
    });
    let (rendered, path) = super::write_report(out_dir, "claim.json", &report)?;
    if args.json {
        println!("{rendered}");
    } else {
        print_table(args, runs, setup_seconds);
        println!(
            "\nat concurrency {at}: (4)/(1) = {over_1:.1}x (target >= 20x {}), (4)/(3) = {over_3:.1}x (target >= 5x {})",
            mark(over_1 >= 20.0),
            mark(over_3 >= 5.0)
        );
        println!("written to {}", path.display());
    }
    if let Some(bad) = runs.iter().find(|r| !r.ok()) {
        anyhow::bail!(
            "{} at concurrency {} issued a code twice or lost track of one ({} claims, {} issued in MongoDB, {} distinct orders, distinct code ids: {}); this is a bug, please report it with {}",
            bad.strategy.label(),
            bad.concurrency,
            bad.claims,
            bad.issued_in_db,
            bad.distinct_orders,
            bad.distinct_codes,
            path.display()
        );
    }
    Ok(())
}

fn pool_name(concurrency: usize, s: Strategy) -> String {
    format!("claim-c{concurrency}-s{}", s.number())
}

fn codes_collection(scratch: &Scratch) -> Collection<Document> {
    scratch
        .store
        .database()
        .collection(codepool_store::codes::CODES)
}

/// Opens as many MongoDB connections as the largest run will use, so the
/// first run does not pay for connecting.
async fn warm_up(scratch: &'static Scratch, n: usize) -> anyhow::Result<()> {
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let coll = codes_collection(scratch);
            tokio::spawn(async move { coll.find_one(doc! {"pool": "-"}).await })
        })
        .collect();
    for t in tasks {
        t.await.context("warm-up panicked")??;
    }
    Ok(())
}

fn mark(ok: bool) -> &'static str {
    if ok {
        "✓"
    } else {
        "✗"
    }
}

/// The write every classic strategy makes: the same fields the engine sets
/// (minus the grant number, which the classic recipes have no generator for).
fn issue(p: &Purchase) -> Document {
    doc! {"$set": {
        "status": CodeStatus::Issued.as_i32(),
        "order_id": &p.order_id,
        "uid": &p.uid,
        "phone": &p.phone,
        "issued_at": DateTime::now(),
        "sms_pending": true,
    }}
}

/// Strategies (1) to (3): one claim per round trip(s), each journaled.
async fn classic(
    coll: Collection<Document>,
    work: Arc<Work>,
    s: Strategy,
) -> anyhow::Result<Claimed> {
    let mut out = Claimed::default();
    let unissued = doc! {"pool": &work.pool, "status": CodeStatus::Unissued.as_i32()};
    while let Some(range) = work.take(1) {
        for i in range {
            let p = work.purchase(i);
            let started = Instant::now();
            let id = match s {
                Strategy::FindThenUpdate => loop {
                    let first = coll
                        .find_one(unissued.clone())
                        .sort(doc! {"seq": 1})
                        .projection(doc! {"_id": 1})
                        .await?
                        .with_context(|| format!("pool {} ran dry", work.pool))?;
                    let id = first.get_object_id("_id")?;
                    let r = coll
                        .update_one(
                            doc! {"_id": id, "status": CodeStatus::Unissued.as_i32()},
                            issue(&p),
                        )
                        .write_concern(durable())
                        .await?;
                    if r.modified_count == 1 {
                        break id;
                    }
                    out.retries += 1;
                },
                Strategy::UpdateThenFind => {
                    let r = coll
                        .update_one(unissued.clone(), issue(&p))
                        .write_concern(durable())
                        .await?;
                    anyhow::ensure!(r.modified_count == 1, "pool {} ran dry", work.pool);
                    // `$type` lets MongoDB 6.0 use the partial `order_id`
                    // index (filter `{$type: "string"}`); without it this
                    // find scans the whole collection.
                    coll.find_one(doc! {"order_id": {"$eq": &p.order_id, "$type": "string"}})
                        .projection(doc! {"_id": 1})
                        .await?
                        .with_context(|| format!("order {} vanished after its update", p.order_id))?
                        .get_object_id("_id")?
                }
                Strategy::FindOneAndUpdate => coll
                    .find_one_and_update(unissued.clone(), issue(&p))
                    .sort(doc! {"seq": 1})
                    .projection(doc! {"_id": 1})
                    .return_document(ReturnDocument::After)
                    .write_concern(durable())
                    .await?
                    .with_context(|| format!("pool {} ran dry", work.pool))?
                    .get_object_id("_id")?,
                Strategy::HotPoolBatched => unreachable!("strategy (4) runs in hot_pool_batched"),
            };
            out.latencies.push(started.elapsed());
            out.code_ids.push(id);
        }
    }
    Ok(out)
}

/// Strategy (4): the production claim path, `batch` purchases per call.
async fn hot_pool_batched(
    engine: ClaimEngine,
    work: Arc<Work>,
    batch: usize,
) -> anyhow::Result<Claimed> {
    let mut out = Claimed::default();
    while let Some(range) = work.take(batch) {
        let purchases: Vec<Purchase> = range.map(|i| work.purchase(i)).collect();
        let refs: Vec<&Purchase> = purchases.iter().collect();
        let started = Instant::now();
        let outcomes = engine.claim_batch(&refs, Resend::ByRedelivery).await?;
        let took = started.elapsed();
        for (p, o) in purchases.iter().zip(outcomes) {
            match o {
                ClaimOutcome::Claimed {
                    grants,
                    fresh,
                    missing,
                } if missing.is_empty() => {
                    if fresh as usize != grants.len() {
                        anyhow::bail!(
                            "order {} already held a code before its first claim",
                            p.order_id
                        )
                    }
                    out.code_ids
                        .extend(grants.iter().map(|g| codepool_store::object_id(g.code_id)));
                    out.latencies.push(took);
                }
                ClaimOutcome::Claimed { .. } => {
                    anyhow::bail!("pool {} reported exhausted with codes left", work.pool)
                }
                ClaimOutcome::Conflict { what } => {
                    anyhow::bail!("order {} conflicts with itself ({what})", p.order_id)
                }
            }
        }
    }
    Ok(out)
}

fn print_table(args: &ClaimBenchArgs, runs: &[Run], setup_seconds: f64) {
    println!(
        "claim strategies: fresh pools of {} codes each (filled in {setup_seconds:.1} s), writes journaled with majority acknowledgement (w:majority, j:true), each run stops after {} s or when its pool is drained; (4) claims {} purchases per call\n",
        args.codes, args.max_seconds, args.batch
    );
    println!(
        "{:>5}  {:<38} {:>7} {:>7} {:>10} {:>8} {:>8} {:>8}  no code twice",
        "conc", "strategy", "claims", "seconds", "claims/s", "retries", "p50 ms", "p99 ms"
    );
    for r in runs {
        let scan = r
            .scan_claims
            .filter(|n| *n > 0)
            .map(|n| format!(" ({n} via scan)"))
            .unwrap_or_default();
        println!(
            "{:>5}  {:<38} {:>7} {:>7.2} {:>10.0} {:>8} {:>8.1} {:>8.1}  {} {}/{}/{}{scan}",
            r.concurrency,
            r.strategy.label(),
            r.claims,
            r.elapsed.as_secs_f64(),
            r.per_sec(),
            r.retries,
            ms(r.p50),
            ms(r.p99),
            mark(r.ok()),
            r.claims,
            r.issued_in_db,
            r.distinct_orders,
        );
    }
    println!(
        "\nno code twice: claims by the claimers / issued in MongoDB / distinct orders among them, all equal and every code id distinct."
    );
    println!("retries: (1) conditional-update misses; (2),(3) happen inside the server, not visible; (4) orders that lost a race and took fresh candidates.");
    println!("latency: per claim for (1)-(3); for (4) a purchase's latency is its whole claim_batch call.");
}
