//! `codepool stats`: inventory per pool.

use clap::Args;
use serde::Serialize;

use crate::config::Config;

#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  codepool stats
  codepool stats --pool game-x --json")]
pub struct StatsArgs {
    /// Only this pool.
    #[arg(long)]
    pub pool: Option<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Serialize)]
struct Row {
    #[serde(flatten)]
    stats: codepool_store::stats::PoolStats,
    /// Candidates in the Redis hot set (null when Redis is unavailable).
    hot_pool: Option<u64>,
    /// Hours the unissued stock lasts at the last hour's rate.
    hours_left: Option<f64>,
    /// The pool's low-stock threshold (`codepool pool set --low-stock`).
    low_stock: Option<i64>,
}

pub async fn run(cfg: &Config, args: StatsArgs) -> anyhow::Result<u8> {
    let store = crate::context::store(cfg).await?;
    let hot = crate::context::hot_pool(cfg)?;
    let thresholds: std::collections::HashMap<String, i64> = store
        .pools()
        .await?
        .into_iter()
        .filter_map(|p| Some((p.name, p.low_stock.filter(|n| *n > 0)?)))
        .collect();
    let mut rows = Vec::new();
    for stats in store.pool_stats(args.pool.as_deref()).await? {
        let hot_pool = hot.len(&stats.pool).await.ok();
        let hours_left = (stats.issued_last_hour > 0)
            .then(|| stats.unissued as f64 / stats.issued_last_hour as f64);
        rows.push(Row {
            low_stock: thresholds.get(&stats.pool).copied(),
            stats,
            hot_pool,
            hours_left,
        });
    }
    if let Some(pool) = &args.pool {
        if rows.is_empty() {
            anyhow::bail!("pool {pool:?} does not exist; import codes into it with `codepool import FILE --pool {pool}`");
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(crate::exit::OK);
    }
    println!(
        "{:<20} {:>13} {:>9} {:>7} {:>7} {:>8} {:>10} {:>8} {:>7} {:>7} {:>9}",
        "POOL",
        "UNISSUED",
        "ISSUED",
        "USED",
        "VOID",
        "EXPIRED",
        "BACKORDERS",
        "HOT",
        "1H",
        "24H",
        "LASTS"
    );
    for r in &rows {
        let s = &r.stats;
        println!(
            "{:<20} {:>13} {:>9} {:>7} {:>7} {:>8} {:>10} {:>8} {:>7} {:>7} {:>9}",
            s.pool,
            match r.low_stock {
                Some(n) if (s.unissued as i64) < n => format!("{} LOW", s.unissued),
                _ => s.unissued.to_string(),
            },
            s.issued,
            s.used,
            s.void,
            s.expired,
            s.backorders_waiting,
            r.hot_pool.map_or("-".to_string(), |n| n.to_string()),
            s.issued_last_hour,
            s.issued_last_day,
            r.hours_left.map_or("-".to_string(), |h| format!("{h:.1}h")),
        );
    }
    if rows
        .iter()
        .any(|r| r.low_stock.is_some_and(|n| (r.stats.unissued as i64) < n))
    {
        println!("LOW: unissued stock below the pool's threshold; import more codes (`codepool import FILE --pool P`)");
    }
    if rows.is_empty() {
        println!("(no pools yet: `codepool import FILE --pool NAME` creates one)");
    }
    Ok(crate::exit::OK)
}
