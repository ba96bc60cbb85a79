//! `codepool seq …`: draw values from the sequence generators, one per line.
//!
//! Handy for operations (reserve a number by hand) and for seeing the
//! generators work against the configured MongoDB and Redis.

use std::io::{BufWriter, Write};

use anyhow::Context;
use clap::Subcommand;
use codepool_sequence::{
    daily, segment, time_id, CyclicCounter, DailyNumbers, SegmentAllocator, TimeId,
};

/// Most values one invocation prints.
const MAX_COUNT: u32 = 100_000;

/// Draw values from the sequence generators.
#[derive(Debug, clap::Args)]
pub struct SeqArgs {
    #[command(subcommand)]
    cmd: SeqCommand,
}

#[derive(Debug, Subcommand)]
enum SeqCommand {
    /// Draw ids from a segment allocator: unique increasing integers, reserved
    /// from MongoDB STEP at a time. Ids of a range this process does not use
    /// are skipped for good.
    #[command(after_help = "Example:\n  codepool seq next invoice --count 3 --step 100")]
    Next {
        /// Sequence name (letters, digits, '-', '_', '.').
        name: String,
        /// How many ids to print.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_COUNT)))]
        count: u32,
        /// Ids reserved per MongoDB round trip (1 to 100000).
        #[arg(long, default_value_t = segment::DEFAULT_STEP)]
        step: u32,
    },
    /// Draw daily business numbers PREFIX + yyyyMMdd + 4 or more digits,
    /// restarting at 0001 every day in the time zone ZONE; counted in Redis,
    /// in MongoDB while Redis is unavailable, never repeated.
    #[command(after_help = "Example:\n  codepool seq daily G --count 5 --tz Asia/Shanghai")]
    Daily {
        /// Number prefix (letters, digits, '-', '_', '.').
        prefix: String,
        /// How many numbers to print (drawn in one batch).
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=i64::from(daily::MAX_BATCH)))]
        count: u32,
        /// IANA time zone whose midnight starts a new day.
        #[arg(long, default_value = "UTC")]
        tz: String,
    },
    /// Draw values of a cyclic counter: 0, 1, …, MAX, then 0 again, shared by
    /// every process using the same NAME.
    #[command(after_help = "Example:\n  codepool seq cyclic shard --max 15 --count 20")]
    Cyclic {
        /// Counter name (letters, digits, '-', '_', '.').
        name: String,
        /// Largest value before the counter wraps to 0.
        #[arg(long)]
        max: u64,
        /// How many values to print.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_COUNT)))]
        count: u32,
    },
    /// Draw time-ordered ids yyyyMMddHHmmssSSSSSS (UTC, microseconds) plus a
    /// 2-digit serial shared by every process.
    #[command(after_help = "Example:\n  codepool seq timeid --count 3")]
    Timeid {
        /// How many ids to print.
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_COUNT)))]
        count: u32,
    },
}

/// Runs `codepool seq …` against `db` (and Redis at `redis_url`, keys under `redis_prefix`).
pub async fn run(
    args: SeqArgs,
    db: mongodb::Database,
    redis_url: &str,
    redis_prefix: &str,
) -> anyhow::Result<()> {
    let values: Vec<String> = match args.cmd {
        SeqCommand::Next { name, count, step } => {
            let ids = SegmentAllocator::new(db, &name, step)?;
            ids.next_n(count as usize)
                .await
                .with_context(|| format!("drawing ids from sequence {name:?}"))?
                .into_iter()
                .map(|id| id.to_string())
                .collect()
        }
        SeqCommand::Daily { prefix, count, tz } => {
            let tz: chrono_tz::Tz = tz.parse().map_err(|_| {
                anyhow::anyhow!(
                    "unknown time zone {tz:?}: use an IANA name such as UTC or Asia/Shanghai"
                )
            })?;
            let numbers = DailyNumbers::from_url(Some(redis_url), db, redis_prefix, tz)?;
            numbers
                .next_n(&prefix, count)
                .await
                .with_context(|| format!("drawing daily numbers for prefix {prefix:?}"))?
        }
        SeqCommand::Cyclic { name, max, count } => {
            let counter = CyclicCounter::new(db, &name, max)?;
            let mut values = Vec::with_capacity(count as usize);
            for _ in 0..count {
                let value = counter
                    .next()
                    .await
                    .with_context(|| format!("advancing cyclic counter {name:?}"))?;
                values.push(value.to_string());
            }
            values
        }
        SeqCommand::Timeid { count } => {
            let ids = TimeId::new(db, time_id::DEFAULT_NAME)?;
            let mut values = Vec::with_capacity(count as usize);
            for _ in 0..count {
                values.push(ids.next().await.context("making a time id")?);
            }
            values
        }
    };
    let mut out = BufWriter::new(std::io::stdout().lock());
    for value in values {
        writeln!(out, "{value}").context("writing to standard output")?;
    }
    out.flush().context("writing to standard output")?;
    Ok(())
}
