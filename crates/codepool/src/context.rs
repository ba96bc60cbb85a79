//! Building the adapters a command needs from the configuration.

use std::sync::Arc;

use anyhow::Context;
use codepool_broker::Publisher;
use codepool_dispatcher::{ClaimConfig, ClaimEngine, GrantNumbers};
use codepool_hotpool::HotPool;
use codepool_store::{CodeKeys, Store};

use crate::config::Config;

/// Connects to MongoDB (failing clearly if it is unreachable), applies
/// pending migrations, and loads the key file (see [`code_keys`]).
pub async fn store(cfg: &Config) -> anyhow::Result<Store> {
    let store = Store::connect(&cfg.mongodb_uri, &cfg.db).await?;
    codepool_store::migrate::migrate(&store).await?;
    Ok(store.with_keys(code_keys(cfg)?))
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

/// A publisher on a fresh connection, with the topology declared.
pub async fn publisher(cfg: &Config, name: &str) -> anyhow::Result<(lapin::Connection, Publisher)> {
    let conn = codepool_broker::connect(&cfg.amqp_url, name).await?;
    let publisher = Publisher::new(&conn, cfg.topology()).await?;
    cfg.topology().declare(publisher.channel()).await?;
    Ok((conn, publisher))
}
