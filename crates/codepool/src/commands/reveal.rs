//! Revealing codes on purpose: who asked, from where, for what. The
//! `audit` record is written before any code is shown.

use codepool_domain::CodeId;
use codepool_store::Store;

/// The operating-system user running this process.
pub fn os_user() -> String {
    for var in ["USER", "LOGNAME"] {
        if let Some(v) = std::env::var_os(var).filter(|v| !v.is_empty()) {
            return v.to_string_lossy().into_owned();
        }
    }
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self")
        .map_or_else(|_| "unknown".into(), |m| format!("uid {}", m.uid()))
}

/// This machine's host name.
pub fn host() -> String {
    codepool_issuance::audit::host()
}

/// Records the reveal; only when this succeeds may the caller show codes.
pub async fn record(
    store: &Store,
    command: &str,
    what: String,
    code_ids: Vec<CodeId>,
    count: u64,
) -> anyhow::Result<()> {
    let actor = super::actor(command);
    codepool_issuance::audit::reveal(store, &actor, what, code_ids, count)
        .await
        .map_err(|e| {
            anyhow::anyhow!("{e}; codes are only revealed once the reveal is recorded in the audit collection, so nothing was shown")
        })
}
