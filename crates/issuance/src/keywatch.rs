//! Whether this process can open every code it might claim. Another host
//! may add a key and seal codes with it (`keys add` + `keys rotate`, or an
//! import with a newer key file). A process whose key file lacks that key
//! must claim nothing: it could not text the code, and an HTTP buyer would
//! be told nothing was granted while the relay of another process texts
//! it later. So before each batch the intake asks this watch, which reads
//! the `key_ids` registry at most every [`RECHECK`] and reads the key file
//! again when the registry names a key it lacks.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use codepool_store::{Store, StoreError};
use tracing::{error, info};

/// How often the registry is read again.
pub const RECHECK: Duration = Duration::from_secs(2);

/// The key ids the last check found missing from this process's key file.
#[derive(Debug, Default)]
pub struct KeyWatch {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    checked: Option<Instant>,
    missing: Vec<String>,
}

/// Codes are sealed with keys this process's key file lacks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("codes are sealed with key {} that this process's key file lacks; nothing is claimed here until the key file holds it: copy the key file from the host that ran `codepool keys add`, then this process picks it up within seconds", .ids.join(", "))]
pub struct KeysMissing {
    pub ids: Vec<String>,
}

impl KeyWatch {
    /// The missing keys as last checked (no I/O), for readiness.
    pub fn missing(&self) -> Vec<String> {
        self.state
            .lock()
            .map(|s| s.missing.clone())
            .unwrap_or_default()
    }

    /// Checks again if the last check is older than [`RECHECK`], then
    /// answers whether claims may go on. A transition is logged once.
    pub async fn ensure(&self, store: &Store) -> Result<Result<(), KeysMissing>, StoreError> {
        let due = (self.state.lock())
            .map(|s| s.checked.is_none_or(|t| t.elapsed() >= RECHECK))
            .unwrap_or(true);
        if due {
            self.refresh(store).await?;
        }
        let missing = self.missing();
        Ok(if missing.is_empty() {
            Ok(())
        } else {
            Err(KeysMissing { ids: missing })
        })
    }

    /// Checks again now, whenever the last check was (a claim just met a
    /// code sealed with a key the ring lacks), then answers whether claims
    /// may go on.
    pub async fn recheck(&self, store: &Store) -> Result<Result<(), KeysMissing>, StoreError> {
        self.refresh(store).await?;
        let missing = self.missing();
        Ok(if missing.is_empty() {
            Ok(())
        } else {
            Err(KeysMissing { ids: missing })
        })
    }

    /// Reads the registry (and the key file, when it names a key the ring
    /// lacks) now.
    pub async fn refresh(&self, store: &Store) -> Result<(), StoreError> {
        let missing = store.missing_key_ids().await?;
        let Ok(mut s) = self.state.lock() else {
            return Ok(());
        };
        if missing != s.missing {
            if missing.is_empty() {
                info!("the key file now holds every key codes are sealed with; claiming again");
            } else {
                error!(missing = ?missing, "{}", KeysMissing { ids: missing.clone() });
            }
            metrics::gauge!("codepool_keys_missing").set(missing.len() as f64);
        }
        s.missing = missing;
        s.checked = Some(Instant::now());
        Ok(())
    }
}
