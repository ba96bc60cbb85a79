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
    /// Paused pools issue nothing (`codepool pool pause`).
    paused: bool,
    /// Orders refused by the per-user limit.
    refused: u64,
}

pub async fn run(cfg: &Config, args: StatsArgs) -> anyhow::Result<u8> {
    let store = crate::context::store(cfg).await?;
    let hot = crate::context::hot_pool(cfg)?;
    let pools: std::collections::HashMap<String, codepool_store::pools::PoolDoc> = store
        .pools()
        .await?
        .into_iter()
        .map(|p| (p.name.clone(), p))
        .collect();
    let mut rows = Vec::new();
    for stats in store.pool_stats(args.pool.as_deref()).await? {
        let hot_pool = hot.len(&stats.pool).await.ok();
        let hours_left = (stats.issued_last_hour > 0)
            .then(|| stats.unissued as f64 / stats.issued_last_hour as f64);
        let pool = pools.get(&stats.pool);
        rows.push(Row {
            low_stock: pool.and_then(|p| p.low_stock.filter(|n| *n > 0)),
            paused: pool.is_some_and(|p| p.paused),
            refused: store.refusal_count(&stats.pool).await?,
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
        say_json!(serde_json::to_string_pretty(&rows)?);
        return Ok(crate::exit::OK);
    }
    print_table(&rows);
    Ok(crate::exit::OK)
}

fn print_table(rows: &[Row]) {
    say!(
        "{:<20} {:<7} {:>13} {:>9} {:>7} {:>7} {:>7} {:>8} {:>10} {:>8} {:>8} {:>7} {:>7} {:>9}",
        "POOL",
        "STATE",
        "UNISSUED",
        "ISSUED",
        "USED",
        "VOID",
        "HELD",
        "EXPIRED",
        "BACKORDERS",
        "REFUSED",
        "HOT",
        "1H",
        "24H",
        "LASTS"
    );
    for r in rows {
        let s = &r.stats;
        say!(
            "{:<20} {:<7} {:>13} {:>9} {:>7} {:>7} {:>7} {:>8} {:>10} {:>8} {:>8} {:>7} {:>7} {:>9}",
            s.pool,
            if r.paused { "PAUSED" } else { "active" },
            match r.low_stock {
                Some(n) if (s.unissued as i64) < n => format!("{} LOW", s.unissued),
                _ => s.unissued.to_string(),
            },
            s.issued,
            s.used,
            s.void,
            s.held,
            s.expired,
            s.backorders_waiting,
            r.refused,
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
        say!("LOW: unissued stock below the pool's threshold; import more codes (`codepool import FILE --pool P`)");
    }
    if rows.iter().any(|r| r.paused) {
        say!("PAUSED: nothing is issued, purchases wait as backorders; `codepool pool resume --pool P` fulfils them");
    }
    if rows.is_empty() {
        say!("(no pools yet: `codepool import FILE --pool NAME` creates one)");
    }
}
