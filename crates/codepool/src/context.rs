//! Building the adapters a command needs from the configuration.

use std::sync::Arc;

use anyhow::Context;
use codepool_dispatcher::{ClaimConfig, ClaimEngine, GrantNumbers};
use codepool_hotpool::HotPool;
use codepool_store::Store;

use crate::config::Config;

/// Connects to MongoDB (failing clearly if it is unreachable) and applies
/// pending migrations.
pub async fn store(cfg: &Config) -> anyhow::Result<Store> {
    let store = Store::connect(&cfg.mongodb_uri, &cfg.db).await?;
    codepool_store::migrate::migrate(&store).await?;
    Ok(store)
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

pub fn claim_engine(cfg: &Config, store: &Store) -> anyhow::Result<ClaimEngine> {
    Ok(ClaimEngine::new(
        store.clone(),
        hot_pool(cfg)?,
        grant_numbers(cfg, store)?,
        ClaimConfig::default(),
    ))
}
