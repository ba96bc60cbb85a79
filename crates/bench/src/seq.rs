//! `codepool bench seq`: ids per second of each sequence generator, side by
//! side with the classic read-then-conditional-update loop on a MongoDB
//! counter, under the same concurrency, in one run.
//!
//! The classic loop reads the counter, then updates `{_id, value: read}` to
//! `read + 1`, and starts over when another caller got there first; its
//! retries are counted. Every generator draws the same number of ids with the
//! same number of concurrent callers, and the values are checked to be
//! distinct after the clock stops.

use std::collections::HashSet;
use std::future::Future;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context;
use codepool_sequence::{CyclicCounter, DailyNumbers, SegmentAllocator, TimeId, COLLECTION};
use mongodb::bson::{doc, Bson, Document};
use mongodb::{Collection, Database};
use serde_json::json;

/// Numbers per call in the batched daily-number run (a dispatcher claim batch).
const DAILY_BATCH: u32 = 100;

/// Measure the sequence generators against the classic read-then-update loop.
#[derive(Debug, clap::Args)]
#[command(after_help = "Example:\n  codepool bench seq --concurrency 16 --ids 20000 --json")]
pub struct SeqBenchArgs {
    /// Concurrent callers drawing from each generator.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub concurrency: u32,
    /// Ids drawn from each generator.
    #[arg(long, default_value_t = 20_000, value_parser = clap::value_parser!(u32).range(1..=10_000_000))]
    pub ids: u32,
    /// Print the results as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// What one generator did.
struct Measured {
    generator: &'static str,
    ids: usize,
    elapsed: Duration,
    retries: u64,
    /// `None` when values repeat by design (the cyclic counter).
    distinct: Option<bool>,
}

impl Measured {
    fn ids_per_sec(&self) -> f64 {
        self.ids as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// What one caller drew.
#[derive(Default)]
struct Drawn {
    values: Vec<String>,
    retries: u64,
}

/// Draws `quota` values one call at a time.
async fn one_by_one<F, Fut>(quota: usize, mut next: F) -> anyhow::Result<Drawn>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<String>>,
{
    let mut drawn = Drawn::default();
    for _ in 0..quota {
        drawn.values.push(next().await?);
    }
    Ok(drawn)
}

/// The names this run uses in MongoDB and Redis.
struct RunNames {
    run_id: String,
    classic_id: String,
    redis_prefix: String,
}

/// Runs `codepool bench seq`; writes `out_dir/seq.json`.
pub async fn run(
    args: SeqBenchArgs,
    scratch: &crate::Scratch,
    out_dir: &Path,
) -> anyhow::Result<()> {
    let db: Database = scratch.store.database().clone();
    let redis_url = scratch.cfg.redis_url.as_str();
    let run_id = format!("bench-{}", chrono::Utc::now().format("%Y%m%d%H%M%S%3f"));
    let names = RunNames {
        classic_id: format!("classic:{run_id}"),
        // Under the scratch prefix: a killed run's keys are swept with it.
        redis_prefix: format!("{}:seq", scratch.cfg.redis_prefix),
        run_id,
    };
    let counters: Collection<Document> = db.collection(COLLECTION);
    counters
        .update_one(
            doc! { "_id": &names.classic_id },
            doc! { "$setOnInsert": { "value": 0_i64 } },
        )
        .upsert(true)
        .await
        .context("creating the classic counter")?;
    let (c, n) = (args.concurrency as usize, args.ids as usize);
    let mut results = measure_counters(&db, &names, c, n).await?;
    results.extend(measure_daily(&db, redis_url, &names, c, n).await?);
    results.extend(measure_others(&db, &names, c, n).await?);
    clean_up(&counters, &names.run_id, redis_url, &names.redis_prefix).await;
    report(&args, &results, out_dir)
}

/// The classic read-then-update loop and the segment allocator.
async fn measure_counters(
    db: &Database,
    names: &RunNames,
    concurrency: usize,
    ids: usize,
) -> anyhow::Result<Vec<Measured>> {
    let counters: Collection<Document> = db.collection(COLLECTION);
    let id = names.classic_id.clone();
    let classic = measure(
        "classic read-then-update",
        concurrency,
        ids,
        1,
        move |quota| classic_loop(counters.clone(), id.clone(), quota),
    )
    .await?;
    let segments = SegmentAllocator::new(db.clone(), &names.run_id, 1_000)?;
    let segment =
        measure(
            "segment allocator (step 1000)",
            concurrency,
            ids,
            1,
            move |quota| {
                let segments = segments.clone();
                async move {
                    one_by_one(quota, || async { Ok(segments.next().await?.to_string()) }).await
                }
            },
        )
        .await?;
    Ok(vec![classic, segment])
}

/// Daily numbers: from Redis one by one and in batches, and from MongoDB.
async fn measure_daily(
    db: &Database,
    redis_url: &str,
    names: &RunNames,
    concurrency: usize,
    ids: usize,
) -> anyhow::Result<Vec<Measured>> {
    let daily = DailyNumbers::from_url(
        Some(redis_url),
        db.clone(),
        &names.redis_prefix,
        chrono_tz::UTC,
    )?;
    let redis_daily = daily.clone();
    let single = measure("daily number (Redis)", concurrency, ids, 1, move |quota| {
        let daily = redis_daily.clone();
        async move { one_by_one(quota, || async { Ok(daily.next("B").await?) }).await }
    })
    .await?;
    let batch = DAILY_BATCH as usize;
    let batched = measure(
        "daily number (Redis, batches of 100)",
        concurrency,
        ids,
        batch,
        move |quota| {
            let daily = daily.clone();
            async move {
                let mut drawn = Drawn::default();
                let mut left = quota;
                while left > 0 {
                    let n = left.min(batch);
                    drawn.values.extend(daily.next_n("BB", n as u32).await?);
                    left -= n;
                }
                Ok(drawn)
            }
        },
    )
    .await?;
    let mongo_daily = DailyNumbers::new(None, db.clone(), &names.redis_prefix, chrono_tz::UTC);
    let mongo = measure(
        "daily number (MongoDB fallback)",
        concurrency,
        ids,
        1,
        move |quota| {
            let daily = mongo_daily.clone();
            async move { one_by_one(quota, || async { Ok(daily.next("BM").await?) }).await }
        },
    )
    .await?;
    Ok(vec![single, batched, mongo])
}

/// The cyclic counter (values repeat by design) and time ids.
async fn measure_others(
    db: &Database,
    names: &RunNames,
    concurrency: usize,
    ids: usize,
) -> anyhow::Result<Vec<Measured>> {
    let cyclic = CyclicCounter::new(db.clone(), &names.run_id, 99)?;
    let mut cyclic_result = measure("cyclic counter (0..=99)", concurrency, ids, 1, move |quota| {
        let cyclic = cyclic.clone();
        async move { one_by_one(quota, || async { Ok(cyclic.next().await?.to_string()) }).await }
    })
    .await?;
    cyclic_result.distinct = None;
    let time_ids = TimeId::new(db.clone(), &format!("{}-timeid", names.run_id))?;
    let time = measure("time id", concurrency, ids, 1, move |quota| {
        let time_ids = time_ids.clone();
        async move { one_by_one(quota, || async { Ok(time_ids.next().await?) }).await }
    })
    .await?;
    Ok(vec![cyclic_result, time])
}

/// Writes `seq.json`, prints the table, fails on a repeated value.
fn report(args: &SeqBenchArgs, results: &[Measured], out_dir: &Path) -> anyhow::Result<()> {
    let classic = results[0].ids_per_sec();
    let report = json!({
        "benchmark": "seq",
        "concurrency": args.concurrency,
        "ids_per_generator": args.ids,
        "results": results.iter().map(|r| json!({
            "generator": r.generator,
            "ids": r.ids,
            "seconds": r.elapsed.as_secs_f64(),
            "ids_per_sec": r.ids_per_sec(),
            "ratio_to_classic": r.ids_per_sec() / classic,
            "retries": r.retries,
            "distinct": r.distinct,
        })).collect::<Vec<_>>(),
    });
    let (rendered, path) = crate::write_report(out_dir, "seq.json", &report)?;
    if args.json {
        println!("{rendered}");
    } else {
        print_table(results, args.concurrency as usize, classic);
        println!("\nwritten to {}", path.display());
    }
    if let Some(bad) = results.iter().find(|r| r.distinct == Some(false)) {
        anyhow::bail!(
            "{} handed out a value twice; this is a bug, please report it with {}",
            bad.generator,
            path.display()
        );
    }
    Ok(())
}

/// Draws `ids` values with `concurrency` callers, each running `draw(quota)`;
/// quotas are multiples of `unit` where possible.
async fn measure<F, Fut>(
    generator: &'static str,
    concurrency: usize,
    ids: usize,
    unit: usize,
    draw: F,
) -> anyhow::Result<Measured>
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = anyhow::Result<Drawn>> + Send + 'static,
{
    let quotas = split(ids, concurrency, unit);
    let started = Instant::now();
    let tasks: Vec<_> = quotas
        .into_iter()
        .filter(|quota| *quota > 0)
        .map(|quota| tokio::spawn(draw(quota)))
        .collect();
    let mut values = Vec::with_capacity(ids);
    let mut retries = 0;
    for task in tasks {
        let drawn = task
            .await
            .with_context(|| format!("a {generator} caller panicked"))?
            .with_context(|| format!("drawing from the {generator}"))?;
        values.extend(drawn.values);
        retries += drawn.retries;
    }
    let elapsed = started.elapsed();
    let distinct = values.iter().collect::<HashSet<_>>().len() == values.len();
    Ok(Measured {
        generator,
        ids: values.len(),
        elapsed,
        retries,
        distinct: Some(distinct),
    })
}

/// Shares `total` among `callers`, in multiples of `unit` except for the rest.
fn split(total: usize, callers: usize, unit: usize) -> Vec<usize> {
    let units = total / unit;
    let mut quotas: Vec<usize> = (0..callers)
        .map(|i| (units / callers + usize::from(i < units % callers)) * unit)
        .collect();
    if let Some(first) = quotas.first_mut() {
        *first += total % unit;
    }
    quotas
}

/// The classic recipe: read, then update only if nobody changed it; retry otherwise.
async fn classic_loop(
    counters: Collection<Document>,
    id: String,
    quota: usize,
) -> anyhow::Result<Drawn> {
    let mut drawn = Drawn::default();
    for _ in 0..quota {
        loop {
            let current = counters
                .find_one(doc! { "_id": &id })
                .await
                .context("reading the classic counter")?
                .and_then(|doc| match doc.get("value") {
                    Some(Bson::Int64(v)) => Some(*v),
                    Some(Bson::Int32(v)) => Some(i64::from(*v)),
                    _ => None,
                });
            let value = current.with_context(|| {
                format!("the classic counter {id:?} vanished; rerun the benchmark")
            })?;
            let result = counters
                .update_one(
                    doc! { "_id": &id, "value": value },
                    doc! { "$set": { "value": value + 1 } },
                )
                .await
                .context("updating the classic counter")?;
            let updated = (result.modified_count == 1).then_some(value + 1);
            match updated {
                Some(value) => {
                    drawn.values.push(value.to_string());
                    break;
                }
                None => drawn.retries += 1,
            }
        }
    }
    Ok(drawn)
}

fn print_table(results: &[Measured], concurrency: usize, classic: f64) {
    println!("sequence generators, {concurrency} concurrent callers each\n");
    println!(
        "{:<38} {:>9} {:>9} {:>11} {:>11} {:>9}  distinct",
        "generator", "ids", "seconds", "ids/s", "vs classic", "retries"
    );
    for r in results {
        let distinct = match r.distinct {
            Some(true) => "yes",
            Some(false) => "NO",
            None => "n/a",
        };
        println!(
            "{:<38} {:>9} {:>9.2} {:>11.0} {:>10.1}x {:>9}  {distinct}",
            r.generator,
            r.ids,
            r.elapsed.as_secs_f64(),
            r.ids_per_sec(),
            r.ids_per_sec() / classic,
            r.retries,
        );
    }
}

/// Removes this run's counters; best effort, the Redis keys expire anyway.
async fn clean_up(
    counters: &Collection<Document>,
    run_id: &str,
    redis_url: &str,
    redis_prefix: &str,
) {
    let pattern = mongodb::bson::Regex {
        pattern: regex_escape(run_id),
        options: String::new(),
    };
    if let Err(err) = counters
        .delete_many(doc! { "_id": { "$regex": pattern } })
        .await
    {
        tracing::warn!(%err, "could not remove the benchmark counters");
    }
    if let Err(err) = super::delete_redis_keys(redis_url, redis_prefix).await {
        tracing::warn!(%err, "could not remove the benchmark Redis keys");
    }
}

fn regex_escape(text: &str) -> String {
    text.chars()
        .flat_map(|c| {
            let escape = !c.is_ascii_alphanumeric();
            escape.then_some('\\').into_iter().chain(std::iter::once(c))
        })
        .collect()
}
