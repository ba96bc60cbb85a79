//! Building the adapters a command needs from the configuration.

use std::sync::Arc;

use anyhow::Context;
use codepool_broker::Publisher;
use codepool_hotpool::HotPool;
use codepool_issuance::{ClaimConfig, ClaimEngine, GrantNumbers};
use codepool_store::{CodeKeys, Store};

use crate::config::Config;

/// Connects to MongoDB (failing clearly if it is unreachable) and to a
/// database that holds codepool's data, and loads the key file (see
/// [`code_keys`]). It never migrates: only `migrate`, `import` and the
/// daemons do; pending migrations are named on stderr, and a schema newer
/// than this binary knows is refused. A database without codepool's
/// data (a mistyped `CODEPOOL_DB`) is refused, never created: only
/// `migrate`, `import` and the daemons create one ([`store_creating`]).
pub async fn store(cfg: &Config) -> anyhow::Result<Store> {
    let store = Store::connect(&cfg.mongodb_uri, &cfg.db).await?;
    remember(&store);
    if !store.holds_codepool_data().await? {
        let mut names = store.database_names().await;
        names.retain(|n| !["admin", "config", "local"].contains(&n.as_str()));
        let there = if names.is_empty() {
            "none but MongoDB's own".to_owned()
        } else {
            names.join(", ")
        };
        anyhow::bail!(
            "database {:?} holds no codepool data, and this command does not create one; check CODEPOOL_DB (or --db). The databases there: {there}. To start a new one, run `codepool migrate` (or `codepool import`) with that name",
            cfg.db
        );
    }
    let schema = codepool_store::migrate::schema_state(&store).await?;
    if !schema.unknown.is_empty() {
        anyhow::bail!(
            "database {:?} was migrated by a newer codepool (migrations this binary does not know: {}); run that newer codepool binary",
            cfg.db,
            schema.unknown.join(", ")
        );
    }
    if !schema.pending.is_empty() {
        eprintln!(
            "warning: database {:?} lacks {} migration(s) of this codepool ({}); run `codepool migrate`",
            cfg.db,
            schema.pending.len(),
            schema.pending.join(", ")
        );
    }
    Ok(store.with_keys(code_keys(cfg)?))
}

/// [`store`] that creates and migrates the database when it is new: for
/// `codepool import`, which brings the first codes.
pub async fn store_creating(cfg: &Config) -> anyhow::Result<Store> {
    let store = Store::connect(&cfg.mongodb_uri, &cfg.db).await?;
    remember(&store);
    codepool_store::migrate::migrate(&store).await?;
    Ok(store.with_keys(code_keys(cfg)?))
}

/// The MongoDB clients this process opened, shut down before it exits
/// ([`shutdown_clients`]).
static CLIENTS: std::sync::Mutex<Vec<mongodb::Client>> = std::sync::Mutex::new(Vec::new());

/// Keeps the store's client for [`shutdown_clients`].
pub fn remember(store: &Store) {
    if let Ok(mut clients) = CLIENTS.lock() {
        clients.push(store.client().clone());
    }
}

/// Shuts the remembered MongoDB clients down while the runtime still
/// runs: a client dropped as the runtime ends may panic in its own drop.
/// Bounded: a handle still open does not hold the exit up.
pub async fn shutdown_clients() {
    let clients = CLIENTS.lock().map(|mut c| std::mem::take(&mut *c));
    for client in clients.unwrap_or_default() {
        let _ = tokio::time::timeout(
            std::time::Duration::from_secs(5),
            client.shutdown().immediate(true),
        )
        .await;
    }
}

/// The keys codes are sealed with. A missing key file is not an error
/// yet: commands that never touch a code (stats, pools) work without one,
/// and the others fail saying how to create it. A file that exists but is
/// unreadable, malformed or readable by others is refused now.
pub fn code_keys(cfg: &Config) -> anyhow::Result<CodeKeys> {
    let path = cfg.key_path();
    match codepool_vault::keyfile::load(&path) {
        Ok(ring) => Ok(CodeKeys::new(ring, Some(path))),
        Err(codepool_vault::VaultError::Missing { .. }) => Ok(CodeKeys::none(Some(path))),
        Err(e) => Err(e.into()),
    }
}

pub fn hot_pool(cfg: &Config) -> anyhow::Result<HotPool> {
    Ok(HotPool::new(&cfg.redis_url, &cfg.redis_prefix)?)
}

pub fn grant_numbers(cfg: &Config, store: &Store) -> anyhow::Result<Arc<GrantNumbers>> {
    let daily = codepool_sequence::DailyNumbers::from_url(
        Some(&cfg.redis_url),
        store.database().clone(),
        &cfg.redis_prefix,
        chrono_tz::UTC,
    )
    .context("invalid CODEPOOL_REDIS_URL")?;
    Ok(Arc::new(GrantNumbers::new(daily, store.clone())))
}

/// The claim engine over the production adapters: MongoDB, the Redis hot
/// pool, and grant numbers.
pub fn claim_engine(cfg: &Config, store: &Store) -> anyhow::Result<ClaimEngine> {
    claim_engine_with(store, hot_pool(cfg)?, grant_numbers(cfg, store)?)
}

/// [`claim_engine`] over an existing hot pool (the daemon shares it).
pub fn claim_engine_with(
    store: &Store,
    hot: HotPool,
    numbers: Arc<GrantNumbers>,
) -> anyhow::Result<ClaimEngine> {
    Ok(ClaimEngine::new(
        Arc::new(store.clone()),
        Arc::new(hot),
        numbers,
        ClaimConfig::default(),
    ))
}

/// The services of a process that grants, built once from the config:
/// the API's core and the dispatcher take the same ones.
pub fn parts(cfg: &Config, store: &Store) -> anyhow::Result<codepool_issuance::background::Parts> {
    let hot = hot_pool(cfg)?;
    let engine = claim_engine_with(store, hot.clone(), grant_numbers(cfg, store)?)?;
    Ok(codepool_issuance::background::Parts::new(
        store.clone(),
        engine,
        Arc::new(hot),
        cfg.allow_hosts(),
        cfg.operator_users(),
    ))
}

/// A publisher on a fresh connection, with the topology declared.
pub async fn publisher(cfg: &Config, name: &str) -> anyhow::Result<(lapin::Connection, Publisher)> {
    let conn = codepool_broker::connect(&cfg.amqp_url, name).await?;
    let publisher = Publisher::new(&conn, cfg.topology())
        .await?
        .as_user(&Publisher::user_of(&cfg.amqp_url));
    cfg.topology()
        .declare_checked(&conn, publisher.channel())
        .await?;
    Ok((conn, publisher))
}
