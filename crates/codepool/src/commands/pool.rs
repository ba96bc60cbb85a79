//! `codepool pool create|set|pause|resume|show`: create a pool before its
//! codes arrive, a pool's settings (low-stock threshold, grant-number
//! prefix, per-user limit), stop and restart its issuing, and its stock
//! and state at a glance.

use clap::{Args, Subcommand};
use codepool_store::pool_settings::PoolSettings;
use serde::Serialize;

use crate::config::Config;

#[derive(Debug, Args)]
#[command(after_help = "\
Examples:
  codepool pool create --pool game-x
  codepool pool set --pool game-x --low-stock 500
  codepool pool set --pool game-x --grant-prefix GX
  codepool pool set --pool game-x --low-stock 0        (alerts off)
  codepool pool set --pool game-x --per-user 1         (one code per user)
  codepool pool set --pool game-x --per-user 0         (unlimited, the default)
  codepool pool set --pool game-x --replacements-per-order 5
  codepool pool pause --pool game-x
  codepool pool resume --pool game-x
  codepool pool show
  codepool pool show --pool game-x --json

When unissued stock falls below --low-stock, dispatchers publish one
`pool.low_stock` event on the codepool.events exchange and log a warning;
the alert re-arms once stock is back at or above the threshold (an import).

A pool exists once it has held a code (an import creates it when the first
code lands) or once it is created here. Purchases for a pool that exists but
has no stock are backordered; purchases for any other pool are dead-lettered
as unknown_pool.

--per-user N: a user (uid) gets codes for at most N orders of the pool;
further purchases are refused (acked, no code, a `purchase.refused` event
with reason per_user_limit). A voided grant still counts. Orders granted
before the limit was set take no slot; waiting backorders are held to it.

--replacements-per-order N: support may replace at most N codes of one
order (`codepool replace`, 3 by default, 0 for none); the next one is
refused and changes nothing.

pause: purchases wait as backorders (nothing is issued) until resume,
which fulfils them oldest first. Both publish pool.paused / pool.resumed;
running dispatchers see the change within a second.")]
pub struct PoolArgs {
    #[command(subcommand)]
    pub action: PoolAction,
}

#[derive(Debug, Subcommand)]
pub enum PoolAction {
    /// Create an empty pool on purpose: its purchases are backordered until
    /// codes are imported (idempotent).
    Create {
        /// The pool, e.g. game-x (A-Z a-z 0-9 . _ -).
        #[arg(long)]
        pool: String,
    },
    /// Change a pool's settings.
    Set {
        /// The pool (it must exist: import codes into it first).
        #[arg(long)]
        pool: String,
        /// Alert when unissued stock falls below N (0 turns alerts off).
        #[arg(long, value_name = "N")]
        low_stock: Option<i64>,
        /// Prefix of grant numbers, e.g. GX gives GX202611200001.
        #[arg(long, value_name = "PREFIX")]
        grant_prefix: Option<String>,
        /// Orders one user (uid) may get a code for; 0 is unlimited.
        #[arg(long, value_name = "N")]
        per_user: Option<i64>,
        /// The pool's platform tells ABC from abc: look-alike codes are then
        /// folded by Unicode NFKC only, not by case. Only before the pool's
        /// first import (`--case-sensitive-codes=false` turns it off).
        #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
        case_sensitive_codes: Option<bool>,
        /// People misread the pool's printed codes: O reads as 0, and I
        /// and L as 1. Look-alike codes fold them too (an import refuses
        /// GOLD beside G0LD), and a redemption finds the code however it
        /// was typed. Only before the pool's first import.
        #[arg(long, value_name = "BOOL", num_args = 0..=1, default_missing_value = "true")]
        fold_confusables: Option<bool>,
        /// The largest share of the pool's stock (free plus held), in
        /// percent, one buyer may hold in checkout holds at once (default
        /// 10; never less than one code).
        #[arg(long, value_name = "PERCENT")]
        hold_share: Option<i64>,
        /// Open checkout holds one buyer may have (default 5).
        #[arg(long, value_name = "N")]
        holds_per_uid: Option<i64>,
        /// The largest share of the pool's stock, in percent, one API key
        /// (or one shop's keys together) may hold in checkout holds at once
        /// (default 50; never less than one code).
        #[arg(long, value_name = "PERCENT")]
        hold_share_per_owner: Option<i64>,
        /// Codes of one order support may replace (`codepool replace`):
        /// 0 to 100 (default 3).
        #[arg(long, value_name = "N")]
        replacements_per_order: Option<i64>,
    },
    /// Stop issuing: purchases wait as backorders until `resume`.
    Pause {
        #[arg(long)]
        pool: String,
    },
    /// Issue again: waiting backorders are fulfilled, oldest first.
    Resume {
        #[arg(long)]
        pool: String,
    },
    /// Show pools with their settings and stock.
    Show {
        /// Only this pool.
        #[arg(long)]
        pool: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

async fn create(store: &codepool_store::Store, pool: &str) -> anyhow::Result<()> {
    let pool = codepool_domain::Pool::new(pool)?;
    let actor = super::actor("pool create");
    if codepool_issuance::controls::create_pool(store, pool.as_str(), &actor).await? {
        say!("pool {pool} created; it has no codes yet, so its purchases are backordered until `codepool import FILE --pool {pool}`");
    } else {
        say!("pool {pool} already exists; nothing changed");
    }
    Ok(())
}

#[derive(Serialize)]
struct PoolRow {
    pool: String,
    created_at: String,
    unissued: u64,
    low_stock: Option<i64>,
    low_stock_alerted: bool,
    grant_prefix: String,
    /// Orders per user; null is unlimited.
    per_user: Option<i64>,
    paused: bool,
}

pub async fn run(cfg: &Config, args: PoolArgs) -> anyhow::Result<u8> {
    let store = crate::context::store(cfg).await?;
    match args.action {
        PoolAction::Create { pool } => create(&store, &pool).await?,
        PoolAction::Set {
            pool,
            low_stock,
            grant_prefix,
            per_user,
            case_sensitive_codes,
            fold_confusables,
            hold_share,
            holds_per_uid,
            hold_share_per_owner,
            replacements_per_order,
        } => {
            let settings = PoolSettings {
                low_stock,
                grant_prefix,
                per_user,
                case_sensitive_codes,
                fold_confusables,
                hold_share,
                holds_per_uid,
                hold_share_per_owner,
                replacements_per_order,
            };
            set(&store, &pool, &settings).await?
        }
        PoolAction::Pause { pool } => pause(cfg, &store, &pool, true).await?,
        PoolAction::Resume { pool } => pause(cfg, &store, &pool, false).await?,
        PoolAction::Show { pool, json } => show(&store, pool, json).await?,
    }
    Ok(crate::exit::OK)
}

async fn set(
    store: &codepool_store::Store,
    pool: &str,
    settings: &PoolSettings,
) -> anyhow::Result<()> {
    let actor = super::actor("pool set");
    let what = format!("{settings:?}");
    use codepool_issuance::controls::PauseError;
    match codepool_issuance::controls::set_pool_settings(store, pool, settings, &what, &actor).await
    {
        Ok(()) => {}
        // In the CLI's words: its flags name the settings.
        Err(PauseError::Pool(e)) if e.setting().is_some() || e.rule().is_some() => {
            anyhow::bail!(e.in_words(|s| s.flag().to_owned()))
        }
        Err(PauseError::Pool(e @ codepool_store::pool_settings::PoolSettingsError::Nothing)) => {
            anyhow::bail!(e.in_words(|s| s.flag().to_owned()))
        }
        Err(e) => return Err(e.into()),
    }
    if let Some(n) = settings.low_stock {
        if n == 0 {
            say!("pool {pool}: low-stock alerts off");
        } else {
            let unissued = store.unissued_stock(pool).await?;
            say!("pool {pool}: alert when unissued stock falls below {n} (now {unissued})");
        }
    }
    if let Some(p) = &settings.grant_prefix {
        say!("pool {pool}: grant numbers start with {p} (running dispatchers switch within 30 s)");
    }
    match settings.per_user {
        Some(0) => say!("pool {pool}: no per-user limit"),
        Some(n) => say!("pool {pool}: at most {n} order(s) per user get a code; further purchases are refused (running dispatchers apply it within a second)"),
        None => {}
    }
    if let Some(n) = settings.replacements_per_order {
        say!("pool {pool}: support may replace at most {n} code(s) of one order");
    }
    match settings.case_sensitive_codes {
        Some(true) => say!("pool {pool}: codes are case-sensitive; look-alikes are folded by Unicode NFKC only"),
        Some(false) => say!("pool {pool}: codes ignore case; look-alikes are folded by Unicode NFKC and case folding"),
        None => {}
    }
    match settings.fold_confusables {
        Some(true) => {
            say!("pool {pool}: O reads as 0, and I and L as 1, in look-alikes and redemptions")
        }
        Some(false) => say!("pool {pool}: O and 0, I, L and 1 are different characters"),
        None => {}
    }
    Ok(())
}

async fn pause(
    cfg: &Config,
    store: &codepool_store::Store,
    pool: &str,
    paused: bool,
) -> anyhow::Result<()> {
    let (conn, publisher) = crate::context::publisher(cfg, "codepool-pool").await?;
    let actor = super::actor(if paused { "pool pause" } else { "pool resume" });
    let changed =
        codepool_issuance::controls::set_paused(store, &publisher, pool, paused, &actor).await;
    codepool_broker::close(conn, "codepool pool done").await;
    match (changed?, paused) {
        (true, true) => say!("pool {pool} paused: purchases wait as backorders until `codepool pool resume --pool {pool}`"),
        (false, true) => say!("pool {pool} was already paused; pool.paused announced again"),
        (true, false) => say!("pool {pool} resumed: dispatchers fulfil its backorders, oldest first"),
        (false, false) => say!("pool {pool} was not paused; pool.resumed announced again"),
    }
    Ok(())
}

async fn show(
    store: &codepool_store::Store,
    pool: Option<String>,
    json: bool,
) -> anyhow::Result<()> {
    let mut rows = Vec::new();
    for p in store.pools().await? {
        if pool.as_ref().is_some_and(|x| *x != p.name) {
            continue;
        }
        rows.push(PoolRow {
            unissued: store.unissued_stock(&p.name).await?,
            created_at: super::target::when(Some(p.created_at)),
            low_stock: p.low_stock.filter(|n| *n > 0),
            low_stock_alerted: p.low_stock_alerted,
            per_user: p.per_user.filter(|n| *n > 0),
            paused: p.paused,
            grant_prefix: p
                .grant_prefix
                .unwrap_or_else(|| codepool_issuance::grant_no::DEFAULT_GRANT_PREFIX.into()),
            pool: p.name,
        });
    }
    if let Some(p) = &pool {
        if rows.is_empty() {
            anyhow::bail!("pool {p:?} does not exist; import codes into it with `codepool import FILE --pool {p}`");
        }
    }
    if json {
        say_json!(serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    print_rows(&rows);
    Ok(())
}

fn print_rows(rows: &[PoolRow]) {
    say!(
        "{:<20} {:<7} {:>9} {:>10} {:<8} {:>8} {:<8} {:<20}",
        "POOL",
        "STATE",
        "UNISSUED",
        "LOW STOCK",
        "ALERT",
        "PER USER",
        "PREFIX",
        "CREATED"
    );
    for r in rows {
        say!(
            "{:<20} {:<7} {:>9} {:>10} {:<8} {:>8} {:<8} {:<20}",
            r.pool,
            if r.paused { "PAUSED" } else { "active" },
            r.unissued,
            r.low_stock.map_or("-".into(), |n| n.to_string()),
            match (r.low_stock, r.low_stock_alerted) {
                (None, _) => "off",
                (Some(_), true) => "SENT",
                (Some(_), false) => "armed",
            },
            r.per_user.map_or("-".into(), |n| n.to_string()),
            r.grant_prefix,
            r.created_at
        );
    }
    if rows.is_empty() {
        say!("(no pools yet: `codepool import FILE --pool NAME` or `codepool pool create --pool NAME` creates one)");
    }
}
