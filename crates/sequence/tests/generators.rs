//! The generators against the real MongoDB and Redis on 127.0.0.1 (or
//! `CODEPOOL_MONGODB_URI` / `CODEPOOL_REDIS_URL`).
//!
//! Every test uses its own database `cp_seq_<test>_<random>` and its own Redis
//! key prefix, and drops them at the end, so tests run in parallel and again.
//! Multi-process tests re-run this test binary with `--exact worker_entry`
//! and environment variables that tell the worker what to draw.

use std::collections::{HashMap, HashSet};
use std::error::Error;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use chrono::{DateTime, TimeZone, Utc};
use codepool_sequence::{
    Clock, CyclicCounter, DailyNumbers, SegmentAllocator, SequenceError, TimeId,
};
use mongodb::bson::doc;
use mongodb::Database;

type TestResult = Result<(), Box<dyn Error + Send + Sync>>;

const WORKERS: usize = 20;
const DRAWS: usize = 100;
const WORKER_ENV: &str = "CP_SEQ_WORKER";
const VALUE_MARK: &str = "SEQ-VALUE ";

fn mongo_uri() -> String {
    std::env::var("CODEPOOL_MONGODB_URI")
        .unwrap_or_else(|_| "mongodb://127.0.0.1:27017/?directConnection=true".to_owned())
}

fn redis_url() -> String {
    std::env::var("CODEPOOL_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// A test's own database and Redis key prefix.
struct Scratch {
    db: Database,
    key_prefix: String,
}

impl Scratch {
    async fn new(test: &str) -> Result<Self, Box<dyn Error + Send + Sync>> {
        let unique = unique_suffix();
        let client = mongodb::Client::with_uri_str(mongo_uri()).await?;
        Ok(Scratch {
            db: client.database(&format!("cp_seq_{test}_{unique}")),
            key_prefix: format!("cp-seq-test-{test}-{unique}"),
        })
    }

    fn daily(&self, redis_url: Option<&str>) -> Result<DailyNumbers, SequenceError> {
        DailyNumbers::from_url(redis_url, self.db.clone(), &self.key_prefix, chrono_tz::UTC)
    }

    async fn finish(self) -> TestResult {
        self.db.drop().await?;
        let client = redis::Client::open(redis_url())?;
        let mut conn = client.get_multiplexed_async_connection().await?;
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{}:*", self.key_prefix))
            .query_async(&mut conn)
            .await?;
        if !keys.is_empty() {
            redis::cmd("DEL")
                .arg(keys)
                .query_async::<()>(&mut conn)
                .await?;
        }
        Ok(())
    }
}

fn unique_suffix() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("{:x}{:x}", std::process::id(), nanos)
}

/// A clock the test moves by hand.
#[derive(Clone)]
struct ManualClock(Arc<Mutex<DateTime<Utc>>>);

impl ManualClock {
    fn at(rfc3339: &str) -> Result<Self, chrono::ParseError> {
        let at = DateTime::parse_from_rfc3339(rfc3339)?.with_timezone(&Utc);
        Ok(ManualClock(Arc::new(Mutex::new(at))))
    }

    fn set(&self, rfc3339: &str) -> Result<(), chrono::ParseError> {
        let at = DateTime::parse_from_rfc3339(rfc3339)?.with_timezone(&Utc);
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = at;
        Ok(())
    }
}

impl Clock for ManualClock {
    fn now(&self) -> DateTime<Utc> {
        *self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Splits `G202611200001` into its day and counter, checking the format.
fn parse_number(prefix: &str, number: &str) -> (String, u64) {
    let rest = number
        .strip_prefix(prefix)
        .unwrap_or_else(|| panic!("{number} does not start with {prefix}"));
    assert!(
        rest.len() >= 12 && rest.bytes().all(|b| b.is_ascii_digit()),
        "{number} is not PREFIX + yyyyMMdd + 4 or more digits"
    );
    let (day, counter) = rest.split_at(8);
    let counter = counter.parse().unwrap_or_else(|e| panic!("{number}: {e}"));
    (day.to_owned(), counter)
}

fn today_utc() -> String {
    Utc::now().format("%Y%m%d").to_string()
}

fn assert_all_distinct<T: std::hash::Hash + Eq + std::fmt::Debug>(values: &[T], expected: usize) {
    let distinct: HashSet<&T> = values.iter().collect();
    assert_eq!(values.len(), expected, "wrong number of values");
    assert_eq!(
        distinct.len(),
        expected,
        "some values were handed out twice"
    );
}

/// Runs `WORKERS` copies of this test binary in worker mode and collects what they drew.
async fn run_worker_processes(
    kind: &str,
    scratch: &Scratch,
) -> Result<Vec<String>, Box<dyn Error + Send + Sync>> {
    let exe = std::env::current_exe()?;
    let mut children = Vec::new();
    for _ in 0..WORKERS {
        let child = tokio::process::Command::new(&exe)
            .args([
                "--exact",
                "worker_entry",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env(WORKER_ENV, kind)
            .env("CP_SEQ_DB", scratch.db.name())
            .env("CP_SEQ_KEY_PREFIX", &scratch.key_prefix)
            .env("CP_SEQ_DRAWS", DRAWS.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        children.push(child);
    }
    let mut values = Vec::new();
    for child in children {
        let output = child.wait_with_output().await?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success(),
            "worker failed: {}\n{stdout}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
        let drawn: Vec<String> = stdout
            .lines()
            // libtest may print "test worker_entry ... " on the same line first.
            .filter_map(|line| line.split_once(VALUE_MARK))
            .map(|(_, value)| value.trim().to_owned())
            .collect();
        assert_eq!(
            drawn.len(),
            DRAWS,
            "a worker drew too few values:\n{stdout}"
        );
        values.extend(drawn);
    }
    Ok(values)
}

/// Worker mode for the multi-process tests; returns at once in a normal run.
#[tokio::test]
async fn worker_entry() -> TestResult {
    let Ok(kind) = std::env::var(WORKER_ENV) else {
        return Ok(());
    };
    let db_name = std::env::var("CP_SEQ_DB")?;
    let key_prefix = std::env::var("CP_SEQ_KEY_PREFIX")?;
    let draws: usize = std::env::var("CP_SEQ_DRAWS")?.parse()?;
    let db = mongodb::Client::with_uri_str(mongo_uri())
        .await?
        .database(&db_name);
    let mut drawn = Vec::with_capacity(draws);
    match kind.as_str() {
        "segment" => {
            let ids = SegmentAllocator::new(db, "grants", 37)?;
            for _ in 0..draws {
                drawn.push(ids.next().await?.to_string());
            }
        }
        "daily" => {
            let numbers =
                DailyNumbers::from_url(Some(&redis_url()), db, &key_prefix, chrono_tz::UTC)?
                    .with_lease_size(50);
            for _ in 0..draws {
                drawn.push(numbers.next("G").await?);
            }
        }
        other => return Err(format!("unknown worker kind {other}").into()),
    }
    for value in drawn {
        println!("{VALUE_MARK}{value}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn segment_ids_are_distinct_across_20_tasks() -> TestResult {
    let scratch = Scratch::new("seg_tasks").await?;
    let ids = SegmentAllocator::new(scratch.db.clone(), "grants", 37)?;
    let mut tasks = Vec::new();
    for _ in 0..WORKERS {
        let ids = ids.clone();
        tasks.push(tokio::spawn(async move {
            let mut drawn = Vec::with_capacity(DRAWS);
            for _ in 0..DRAWS {
                drawn.push(ids.next().await?);
            }
            Ok::<_, SequenceError>(drawn)
        }));
    }
    let mut all = Vec::new();
    for task in tasks {
        let drawn = task.await??;
        assert!(
            drawn.windows(2).all(|w| w[0] < w[1]),
            "ids of one task increase"
        );
        all.extend(drawn);
    }
    assert_all_distinct(&all, WORKERS * DRAWS);
    scratch.finish().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn segment_ids_are_distinct_across_20_processes() -> TestResult {
    let scratch = Scratch::new("seg_procs").await?;
    let all = run_worker_processes("segment", &scratch).await?;
    assert_all_distinct(&all, WORKERS * DRAWS);
    scratch.finish().await
}

#[tokio::test]
async fn segment_batches_are_distinct_and_increasing() -> TestResult {
    let scratch = Scratch::new("seg_batch").await?;
    let ids = SegmentAllocator::new(scratch.db.clone(), "grants", 10)?;
    let mut all = Vec::new();
    for n in [1, 7, 25, 3, 100] {
        let batch = ids.next_n(n).await?;
        assert_eq!(batch.len(), n);
        all.extend(batch);
    }
    assert!(all.windows(2).all(|w| w[0] < w[1]));
    assert_eq!(all[0], 1, "a new sequence starts at 1");
    scratch.finish().await
}

#[tokio::test]
async fn a_segment_step_outside_1_to_100000_is_refused() -> TestResult {
    let scratch = Scratch::new("seg_step").await?;
    for step in [0, 100_001] {
        let refused = SegmentAllocator::new(scratch.db.clone(), "grants", step);
        assert!(matches!(refused, Err(SequenceError::InvalidStep { .. })));
    }
    assert!(SegmentAllocator::new(scratch.db.clone(), "grants", 100_000).is_ok());
    scratch.finish().await
}

#[tokio::test]
async fn a_segment_that_would_pass_i64_max_is_an_error_not_a_wrap() -> TestResult {
    let scratch = Scratch::new("seg_overflow").await?;
    scratch
        .db
        .collection::<mongodb::bson::Document>(codepool_sequence::COLLECTION)
        .insert_one(doc! { "_id": "segment:big", "value": i64::MAX - 5 })
        .await?;
    let ids = SegmentAllocator::new(scratch.db.clone(), "big", 5)?;
    let last = ids.next_n(5).await?;
    assert_eq!(
        last,
        ((i64::MAX - 4) as u64..=i64::MAX as u64).collect::<Vec<_>>()
    );
    let exhausted = ids.next().await;
    assert!(
        matches!(exhausted, Err(SequenceError::Exhausted { .. })),
        "{exhausted:?}"
    );
    let wider = SegmentAllocator::new(scratch.db.clone(), "big", 10)?;
    assert!(matches!(
        wider.next().await,
        Err(SequenceError::Exhausted { .. })
    ));
    scratch.finish().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn daily_numbers_are_distinct_across_20_tasks() -> TestResult {
    let scratch = Scratch::new("daily_tasks").await?;
    let numbers = scratch
        .daily(Some(&redis_url()))?
        .with_lease_size(50)
        // Generous: this test wants Redis used throughout, even on a busy machine.
        .with_redis_timeouts(Duration::from_secs(5), Duration::from_secs(1));
    let mut tasks = Vec::new();
    for _ in 0..WORKERS {
        let numbers = numbers.clone();
        tasks.push(tokio::spawn(async move {
            let mut drawn = Vec::with_capacity(DRAWS);
            for _ in 0..DRAWS {
                drawn.push(numbers.next("G").await?);
            }
            Ok::<_, SequenceError>(drawn)
        }));
    }
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await??);
    }
    assert_all_distinct(&all, WORKERS * DRAWS);
    let mut counters: Vec<u64> = all.iter().map(|n| parse_number("G", n).1).collect();
    counters.sort_unstable();
    assert_eq!(
        counters,
        (1..=(WORKERS * DRAWS) as u64).collect::<Vec<_>>(),
        "one process on a healthy Redis hands out 0001.. without gaps"
    );
    scratch.finish().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn daily_numbers_are_distinct_across_20_processes() -> TestResult {
    let scratch = Scratch::new("daily_procs").await?;
    let all = run_worker_processes("daily", &scratch).await?;
    assert_all_distinct(&all, WORKERS * DRAWS);
    let today = today_utc();
    let highest = all
        .iter()
        .map(|n| parse_number("G", n))
        .inspect(|(day, _)| assert_eq!(day, &today))
        .map(|(_, counter)| counter)
        .max();
    println!("2000 numbers from 20 processes, highest counter {highest:?}");
    scratch.finish().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_is_consecutive_numbers_from_one_round_trip() -> TestResult {
    let scratch = Scratch::new("daily_batch").await?;
    let numbers = scratch.daily(Some(&redis_url()))?.with_lease_size(100);
    let first = numbers.next_n("GX", 200).await?;
    let second = numbers.next_n("GX", 3).await?;
    let counters: Vec<u64> = first
        .iter()
        .chain(&second)
        .map(|n| parse_number("GX", n).1)
        .collect();
    assert_eq!(counters, (1..=203).collect::<Vec<_>>());
    assert!(matches!(
        numbers.next_n("GX", 0).await,
        Err(SequenceError::InvalidCount { .. })
    ));
    assert!(matches!(
        numbers.next("G X").await,
        Err(SequenceError::InvalidName { .. })
    ));
    scratch.finish().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn at_the_start_of_a_day_100_concurrent_callers_get_100_distinct_numbers() -> TestResult {
    let scratch = Scratch::new("daily_midnight").await?;
    // A fresh day whose key does not exist yet, in one process ...
    let clock = ManualClock::at("2026-11-21T00:00:00Z")?;
    let numbers = scratch.daily(Some(&redis_url()))?.with_clock(clock.clone());
    let calls: Vec<_> = (0..100)
        .map(|_| {
            let numbers = numbers.clone();
            tokio::spawn(async move { numbers.next("G").await })
        })
        .collect();
    let mut drawn = Vec::new();
    for call in calls {
        drawn.push(call.await??);
    }
    assert_all_distinct(&drawn, 100);
    let mut counters: Vec<u64> = drawn.iter().map(|n| parse_number("G", n).1).collect();
    counters.sort_unstable();
    assert_eq!(
        counters,
        (1..=100).collect::<Vec<_>>(),
        "the day starts at 0001"
    );

    // ... and over ten instances that race each other like ten processes.
    clock.set("2026-11-22T00:00:00Z")?;
    let instances: Vec<DailyNumbers> = (0..10)
        .map(|_| Ok(scratch.daily(Some(&redis_url()))?.with_clock(clock.clone())))
        .collect::<Result<_, SequenceError>>()?;
    let calls: Vec<_> = (0..100)
        .map(|i| {
            let numbers = instances[i % instances.len()].clone();
            tokio::spawn(async move { numbers.next("G").await })
        })
        .collect();
    let mut drawn = Vec::new();
    for call in calls {
        drawn.push(call.await??);
    }
    assert_all_distinct(&drawn, 100);
    assert!(drawn.iter().all(|n| parse_number("G", n).0 == "20261122"));
    assert!(
        drawn.iter().any(|n| n.ends_with("0001")),
        "the day starts at 0001: {drawn:?}"
    );
    scratch.finish().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_day_rolls_over_at_midnight_in_the_configured_time_zone() -> TestResult {
    let scratch = Scratch::new("daily_rollover").await?;
    let clock = ManualClock::at("2026-11-20T15:59:59Z")?;
    let shanghai = DailyNumbers::from_url(
        Some(&redis_url()),
        scratch.db.clone(),
        &scratch.key_prefix,
        chrono_tz::Asia::Shanghai,
    )?
    .with_clock(clock.clone());
    let utc = scratch.daily(Some(&redis_url()))?.with_clock(clock.clone());

    assert_eq!(shanghai.next("G").await?, "G202611200001");
    assert_eq!(shanghai.next("G").await?, "G202611200002");
    assert_eq!(utc.next("U").await?, "U202611200001");

    // 16:00 UTC is midnight in Shanghai: a new day there, the same day in UTC.
    clock.set("2026-11-20T16:00:00Z")?;
    assert_eq!(shanghai.next("G").await?, "G202611210001");
    assert_eq!(shanghai.next("G").await?, "G202611210002");
    assert_eq!(utc.next("U").await?, "U202611200002");

    // Midnight in UTC.
    clock.set("2026-11-21T00:00:00Z")?;
    assert_eq!(utc.next("U").await?, "U202611210001");
    assert_eq!(shanghai.next("G").await?, "G202611210003");

    // The MongoDB fallback follows the same days.
    let mongo_only = DailyNumbers::from_url(
        None,
        scratch.db.clone(),
        &scratch.key_prefix,
        chrono_tz::Asia::Shanghai,
    )?
    .with_clock(clock.clone());
    clock.set("2026-11-21T16:00:00Z")?;
    assert_eq!(mongo_only.next("M").await?, "M202611220001");
    scratch.finish().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_process_cut_off_from_redis_never_repeats_what_others_issue_from_redis() -> TestResult {
    let scratch = Scratch::new("daily_split").await?;
    let with_redis = scratch.daily(Some(&redis_url()))?.with_lease_size(20);
    // Nothing listens on port 1: every call falls back to MongoDB.
    let cut_off = scratch
        .daily(Some("redis://127.0.0.1:1"))?
        .with_redis_timeouts(Duration::from_millis(100), Duration::from_millis(10));
    let mongo_only = scratch.daily(None)?;
    let mut tasks = Vec::new();
    for i in 0..30 {
        let numbers = match i % 3 {
            0 => with_redis.clone(),
            1 => cut_off.clone(),
            _ => mongo_only.clone(),
        };
        tasks.push(tokio::spawn(async move {
            let mut drawn = Vec::new();
            for _ in 0..20 {
                drawn.extend(numbers.next_n("G", 3).await?);
            }
            Ok::<_, SequenceError>(drawn)
        }));
    }
    let mut all = Vec::new();
    for task in tasks {
        let drawn = task.await??;
        let counters: Vec<u64> = drawn.iter().map(|n| parse_number("G", n).1).collect();
        assert!(counters.windows(2).all(|w| w[0] < w[1]), "{counters:?}");
        all.extend(drawn);
    }
    assert_all_distinct(&all, 30 * 20 * 3);
    scratch.finish().await
}

/// A Redis server of this test's own, which it can stop and start.
struct PrivateRedis {
    port: u16,
    child: Option<tokio::process::Child>,
}

impl PrivateRedis {
    async fn start() -> Result<Self, Box<dyn Error + Send + Sync>> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let mut redis = PrivateRedis { port, child: None };
        redis.restart().await?;
        Ok(redis)
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Starts it empty, as after a restart without persistence.
    async fn restart(&mut self) -> TestResult {
        let child = tokio::process::Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .stdout(Stdio::null())
            .kill_on_drop(true)
            .spawn()?;
        self.child = Some(child);
        let client = redis::Client::open(self.url())?;
        for _ in 0..100 {
            if let Ok(mut conn) = client.get_multiplexed_async_connection().await {
                if redis::cmd("PING")
                    .query_async::<String>(&mut conn)
                    .await
                    .is_ok()
                {
                    return Ok(());
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err("the private redis-server did not start".into())
    }

    async fn stop(&mut self) -> TestResult {
        if let Some(mut child) = self.child.take() {
            child.kill().await?;
        }
        Ok(())
    }

    async fn key_count(&self) -> Result<usize, Box<dyn Error + Send + Sync>> {
        let client = redis::Client::open(self.url())?;
        let mut conn = client.get_multiplexed_async_connection().await?;
        Ok(redis::cmd("DBSIZE").query_async(&mut conn).await?)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stopping_and_restarting_redis_mid_run_never_repeats_a_number() -> TestResult {
    let scratch = Scratch::new("daily_restart").await?;
    let mut redis = PrivateRedis::start().await?;
    let retry_after = Duration::from_millis(100);
    let numbers = scratch
        .daily(Some(&redis.url()))?
        .with_lease_size(50)
        .with_redis_timeouts(Duration::from_millis(300), retry_after);
    // A second process keeps drawing in the background the whole time.
    let other = scratch
        .daily(Some(&redis.url()))?
        .with_lease_size(50)
        .with_redis_timeouts(Duration::from_millis(300), retry_after);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let background = {
        let stop = Arc::clone(&stop);
        tokio::spawn(async move {
            let mut drawn = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                drawn.extend(other.next_n("G", 2).await?);
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            Ok::<_, SequenceError>(drawn)
        })
    };

    let mut sequential = Vec::new();
    for _ in 0..100 {
        sequential.push(numbers.next("G").await?);
    }
    assert!(redis.key_count().await? > 0, "Redis counts while it is up");
    redis.stop().await?;
    for _ in 0..100 {
        sequential.push(numbers.next("G").await?);
    }
    redis.restart().await?;
    tokio::time::sleep(retry_after * 2).await;
    for _ in 0..100 {
        sequential.push(numbers.next("G").await?);
    }
    assert!(
        redis.key_count().await? > 0,
        "Redis is used again after it came back"
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let background = background.await??;
    redis.stop().await?;

    let counters: Vec<u64> = sequential.iter().map(|n| parse_number("G", n).1).collect();
    println!(
        "while up {:?}..{:?}, while down {:?}..{:?}, after restart {:?}..{:?}",
        counters.first(),
        counters.get(99),
        counters.get(100),
        counters.get(199),
        counters.get(200),
        counters.last()
    );
    assert!(
        counters.windows(2).all(|w| w[0] < w[1]),
        "numbers keep increasing: {counters:?}"
    );
    let mut all = sequential;
    let expected = all.len() + background.len();
    all.extend(background);
    assert_all_distinct(&all, expected);
    let today = today_utc();
    assert!(all.iter().all(|n| parse_number("G", n).0 == today));
    scratch.finish().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cyclic_counter_to_99_gives_each_value_20_times_to_20_workers() -> TestResult {
    let scratch = Scratch::new("cyclic").await?;
    let mut tasks = Vec::new();
    for _ in 0..WORKERS {
        // An instance per worker, as if each were its own process.
        let counter = CyclicCounter::new(scratch.db.clone(), "serial", 99)?;
        tasks.push(tokio::spawn(async move {
            let mut drawn = Vec::with_capacity(DRAWS);
            for _ in 0..DRAWS {
                drawn.push(counter.next().await?);
            }
            Ok::<_, SequenceError>(drawn)
        }));
    }
    let mut seen: HashMap<u64, usize> = HashMap::new();
    for task in tasks {
        for value in task.await?? {
            *seen.entry(value).or_default() += 1;
        }
    }
    assert_eq!(seen.len(), 100, "every value 0..=99 shows up");
    for value in 0..=99 {
        assert_eq!(seen.get(&value), Some(&WORKERS), "value {value}");
    }
    scratch.finish().await
}

#[tokio::test]
async fn a_cyclic_counter_starts_at_0_and_wraps_after_max() -> TestResult {
    let scratch = Scratch::new("cyclic_wrap").await?;
    let counter = CyclicCounter::new(scratch.db.clone(), "small", 2)?;
    let mut drawn = Vec::new();
    for _ in 0..7 {
        drawn.push(counter.next().await?);
    }
    assert_eq!(drawn, vec![0, 1, 2, 0, 1, 2, 0]);
    scratch.finish().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn time_ids_are_unique_and_ordered_by_time() -> TestResult {
    let scratch = Scratch::new("timeid").await?;
    let ids = TimeId::new(scratch.db.clone(), "timeid")?;
    let mut tasks = Vec::new();
    for _ in 0..10 {
        let ids = ids.clone();
        tasks.push(tokio::spawn(async move {
            let mut drawn = Vec::new();
            for _ in 0..30 {
                drawn.push(ids.next().await?);
            }
            Ok::<_, SequenceError>(drawn)
        }));
    }
    let mut all = Vec::new();
    for task in tasks {
        let drawn = task.await??;
        // Time first: one task's ids sort in the order they were made.
        let times: Vec<&str> = drawn.iter().map(|id| &id[..20]).collect();
        assert!(times.windows(2).all(|w| w[0] <= w[1]));
        all.extend(drawn);
    }
    assert_all_distinct(&all, 300);
    for id in &all {
        assert_eq!(id.len(), 22, "{id}");
        assert!(id.bytes().all(|b| b.is_ascii_digit()), "{id}");
        let at = chrono::NaiveDateTime::parse_from_str(&id[..20], "%Y%m%d%H%M%S%6f")?;
        let age = Utc::now().naive_utc() - at;
        assert!(
            age < chrono::Duration::minutes(5),
            "{id} is the current UTC time"
        );
    }

    let fixed = Utc
        .with_ymd_and_hms(2026, 11, 20, 15, 59, 59)
        .single()
        .ok_or("valid instant")?;
    let pinned = ids.clone().with_clock(move || fixed);
    let id = pinned.next().await?;
    assert!(id.starts_with("20261120155959000000"), "{id}");
    scratch.finish().await
}
