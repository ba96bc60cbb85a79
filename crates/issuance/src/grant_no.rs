//! Grant numbers: a daily business number per grant (`G20261120` + `0001`),
//! with a prefix per pool, from the `sequence` crate's daily generator.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use codepool_domain::Purchase;
use codepool_sequence::DailyNumbers;
use codepool_store::pools::PoolDoc;
use codepool_store::Store;
use tokio::sync::Mutex;

use crate::claim::ClaimError;
use crate::policy::{whole_catalogue, CatalogueGate, REFRESH_AHEAD};

/// The prefix of grant numbers when a pool sets none.
pub const DEFAULT_GRANT_PREFIX: &str = "G";
const PREFIX_TTL: Duration = Duration::from_secs(30);

/// Hands out grant numbers for purchases, one round trip per prefix per call.
pub struct GrantNumbers {
    daily: DailyNumbers,
    store: Store,
    prefixes: Mutex<HashMap<String, (String, Instant)>>,
    /// Whole reads of the catalogue, at most every [`REFRESH_AHEAD`]
    /// (prefixes read together expire together).
    catalogue: std::sync::Mutex<CatalogueGate>,
}

impl GrantNumbers {
    pub fn new(daily: DailyNumbers, store: Store) -> Self {
        Self {
            daily,
            store,
            prefixes: Mutex::new(HashMap::new()),
            catalogue: std::sync::Mutex::default(),
        }
    }

    /// Each pool's prefix (cached for a while; the pools not cached are
    /// read in one query). A store error is an error: numbering a grant
    /// with the wrong prefix would be a different grant number, not a
    /// fallback.
    async fn prefixes(&self, pools: &[&str]) -> Result<HashMap<String, String>, ClaimError> {
        let mut out = HashMap::with_capacity(pools.len());
        let mut missing = Vec::new();
        {
            let cache = self.prefixes.lock().await;
            for pool in pools {
                match cache.get(*pool) {
                    Some((p, at)) if at.elapsed() < PREFIX_TTL => {
                        out.insert((*pool).to_owned(), p.clone());
                    }
                    _ => missing.push(*pool),
                }
            }
        }
        if missing.is_empty() {
            return Ok(out);
        }
        let (docs, complete) = self.read(&missing).await?;
        let mut cache = self.prefixes.lock().await;
        if complete {
            // The whole catalogue came back: every pool's prefix is cached.
            let now = Instant::now();
            for d in &docs {
                let prefix = d.grant_prefix.as_deref().unwrap_or(DEFAULT_GRANT_PREFIX);
                cache.insert(d.name.clone(), (prefix.to_owned(), now));
            }
        }
        for pool in missing {
            let prefix = docs
                .iter()
                .find(|d| d.name == pool)
                .and_then(|d| d.grant_prefix.clone())
                .unwrap_or_else(|| DEFAULT_GRANT_PREFIX.into());
            cache.insert(pool.to_owned(), (prefix.clone(), Instant::now()));
            out.insert(pool.to_owned(), prefix);
        }
        Ok(out)
    }

    /// The pools of `missing`, or the whole catalogue when it is small
    /// (as the policy cache reads it, at most every
    /// [`REFRESH_AHEAD`]): a batch over many pools then rarely meets a
    /// prefix that is not cached. Also says whether it is the whole
    /// catalogue.
    async fn read(&self, missing: &[&str]) -> Result<(Vec<PoolDoc>, bool), ClaimError> {
        let whole =
            (self.catalogue.lock()).is_ok_and(|mut g| g.take(Instant::now(), REFRESH_AHEAD));
        if whole {
            if let Some(docs) = whole_catalogue(&self.store).await {
                return Ok((docs, true));
            }
            if let Ok(mut gate) = self.catalogue.lock() {
                gate.refused();
            }
        }
        Ok((self.store.pools_named(missing).await?, false))
    }

    /// One number per purchase, aligned with the input: one round trip per
    /// distinct prefix (pools without a prefix of their own share one), not
    /// per pool.
    pub async fn for_purchases(
        &self,
        purchases: &[&Purchase],
    ) -> Result<Vec<Option<String>>, ClaimError> {
        let mut pools: Vec<&str> = purchases.iter().map(|p| p.pool.as_str()).collect();
        pools.sort_unstable();
        pools.dedup();
        let prefixes = self.prefixes(&pools).await?;
        let mut by_prefix: HashMap<&str, Vec<usize>> = HashMap::new();
        for (i, p) in purchases.iter().enumerate() {
            let prefix = prefixes
                .get(p.pool.as_str())
                .map_or(DEFAULT_GRANT_PREFIX, String::as_str);
            by_prefix.entry(prefix).or_default().push(i);
        }
        let mut out = vec![None; purchases.len()];
        for (prefix, idxs) in by_prefix {
            let numbers = self.daily.next_n(prefix, idxs.len() as u32).await?;
            for (i, n) in idxs.into_iter().zip(numbers) {
                out[i] = Some(n);
            }
        }
        Ok(out)
    }
}
