//! A generation run, whichever door asked for it (the CLI's `codepool
//! generate`, `POST /v1/pools/{pool}/generations`, the console's pool
//! page): codes made in the pool by [`codepool_importer::generate`], one
//! audit record worded here, then `pool.replenished` so that waiting
//! orders are served.

use codepool_broker::Publisher;
use codepool_store::{ObjectId, Store};

pub use codepool_importer::generate::open_run;
pub use codepool_importer::{
    GenerateError, GenerateOptions, GenerateProgress, GenerateSummary, Generation,
};

use crate::audit::{self, Actor, AuditKind};
use crate::controls::{announce_replenished, ImportedError};

/// The audit record's sentence for a generation run.
pub fn described(s: &GenerateSummary) -> String {
    format!(
        "generate run {} into pool {:?} of {:?}: {} of {} codes ({} now, {} redrawn), {}",
        s.run_id, s.pool, s.pattern, s.inserted, s.count, s.inserted_now, s.redrawn, s.status
    )
}

/// Records the run in the audit log with its actor.
pub async fn record(
    store: &Store,
    summary: &GenerateSummary,
    actor: &Actor,
) -> Result<(), ImportedError> {
    audit::record(store, actor, AuditKind::Generate, described(summary)).await?;
    Ok(())
}

/// Starts run `g` and returns its id once its record is written (so it
/// can be read at once), and whether it is an earlier run taken up; the
/// codes are made in the background, recorded with `actor` and announced
/// with `publisher`. A process that stops before the end leaves the run
/// `running`: the same id run again (by `codepool generate --run-id`)
/// makes the rest. Without a run id, the unfinished run of the same pool,
/// pattern, count, check symbol and expiry is taken up, as `codepool
/// generate` takes it up: asking again after a process died never makes a
/// second full run (a caller that wants one names a new id).
pub async fn start(
    store: &Store,
    publisher: Publisher,
    mut g: Generation,
    actor: Actor,
) -> Result<(ObjectId, bool), GenerateError> {
    let earlier = match g.run_id {
        Some(_) => None,
        None => codepool_importer::generate::unfinished_run(store, &g).await?,
    };
    let resumed = earlier.is_some();
    let id = (g.run_id).or(earlier.map(|r| r.id)).unwrap_or_default();
    g.run_id = Some(id);
    open_run(store, &g).await?;
    let store = store.clone();
    tokio::spawn(async move {
        let options = GenerateOptions::default();
        match codepool_importer::generate(&store, None, &g, &options, &|_| {}).await {
            Ok(s) => {
                tracing::info!(run = %s.run_id, pool = %s.pool, made = s.inserted_now, actor = %actor.who, "generation run done");
                let finished = async {
                    record(&store, &s, &actor).await?;
                    announce_replenished(&store, &publisher, &s.pool, s.inserted_now).await?;
                    Ok::<(), ImportedError>(())
                };
                if let Err(e) = finished.await {
                    tracing::warn!(error = %e, "generation run done; {e}");
                }
            }
            // The same run id sent again while its first request makes the
            // codes: that one answers for the run.
            Err(e @ GenerateError::Busy { .. }) => {
                tracing::info!(run = %id, error = %e, "the run is being made by another request")
            }
            Err(e) => tracing::error!(run = %id, error = %e, "generation run failed"),
        }
    });
    Ok((id, resumed))
}
