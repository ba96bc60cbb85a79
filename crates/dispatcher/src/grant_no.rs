//! Grant numbers: a daily business number per grant (`G20261120` + `0001`),
//! with a prefix per pool, from the `sequence` crate's daily generator.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use codepool_domain::Purchase;
use codepool_sequence::DailyNumbers;
use codepool_store::Store;
use tokio::sync::Mutex;

use crate::claim::ClaimError;

/// The prefix of grant numbers when a pool sets none.
pub const DEFAULT_GRANT_PREFIX: &str = "G";
const PREFIX_TTL: Duration = Duration::from_secs(30);

/// Hands out grant numbers for purchases, one round trip per pool per call.
pub struct GrantNumbers {
    daily: DailyNumbers,
    store: Store,
    prefixes: Mutex<HashMap<String, (String, Instant)>>,
}

impl GrantNumbers {
    pub fn new(daily: DailyNumbers, store: Store) -> Self {
        Self {
            daily,
            store,
            prefixes: Mutex::new(HashMap::new()),
        }
    }

    /// The pool's prefix (cached for a while). A store error is an error:
    /// numbering a grant with the wrong prefix would be a different grant
    /// number, not a fallback.
    async fn prefix(&self, pool: &str) -> Result<String, ClaimError> {
        if let Some((p, at)) = self.prefixes.lock().await.get(pool) {
            if at.elapsed() < PREFIX_TTL {
                return Ok(p.clone());
            }
        }
        let prefix = self
            .store
            .pool(pool)
            .await?
            .and_then(|doc| doc.grant_prefix)
            .unwrap_or_else(|| DEFAULT_GRANT_PREFIX.into());
        self.prefixes
            .lock()
            .await
            .insert(pool.to_owned(), (prefix.clone(), Instant::now()));
        Ok(prefix)
    }

    /// One number per purchase, aligned with the input.
    pub async fn for_purchases(
        &self,
        purchases: &[&Purchase],
    ) -> Result<Vec<Option<String>>, ClaimError> {
        let mut by_pool: HashMap<&str, Vec<usize>> = HashMap::new();
        for (i, p) in purchases.iter().enumerate() {
            by_pool.entry(p.pool.as_str()).or_default().push(i);
        }
        let mut out = vec![None; purchases.len()];
        for (pool, idxs) in by_pool {
            let prefix = self.prefix(pool).await?;
            let numbers = self.daily.next_n(&prefix, idxs.len() as u32).await?;
            for (i, n) in idxs.into_iter().zip(numbers) {
                out[i] = Some(n);
            }
        }
        Ok(out)
    }
}
