//! An import, whichever door it came in by (the CLI, `POST
//! /v1/pools/{pool}/imports`, the console's upload form): the file's rows
//! into the pool ([`codepool_importer`]), then one audit record worded
//! here, then `pool.replenished` so that waiting orders are served. The
//! doors parse their own input and answer in their own words; the
//! sequence and its record are the core's.

use codepool_broker::Publisher;
use codepool_store::Store;

pub use codepool_importer::{
    Header, ImportError, ImportOptions, ImportProgress, ImportSummary, InvalidRow,
};

use crate::audit::{self, Actor, AuditKind};
use crate::controls::{announce_replenished, ImportedError};

/// The audit record's sentence for an import run.
pub fn described(s: &ImportSummary) -> String {
    format!(
        "import {} into pool {:?} from {:?}: {} rows, {} inserted, {} duplicates, {} invalid",
        s.import_id, s.pool, s.file, s.rows, s.inserted, s.duplicates, s.invalid
    )
}

/// Whether every row was invalid and nothing was imported (the doors
/// answer it as a failure: 422, exit 1).
pub fn all_rows_invalid(s: &ImportSummary) -> bool {
    s.invalid > 0 && s.inserted + s.duplicates == 0
}

/// Records the run in the audit log with its actor.
pub async fn record(
    store: &Store,
    summary: &ImportSummary,
    actor: &Actor,
) -> Result<(), ImportedError> {
    audit::record(store, actor, AuditKind::Import, described(summary)).await?;
    Ok(())
}

/// What an upload did: its summary, and whether its record and its
/// `pool.replenished` went out (the codes are imported either way).
pub struct Uploaded {
    pub summary: ImportSummary,
    pub finished: Result<(), ImportedError>,
}

/// Imports `input` (a CSV as `options` reads it) into `pool` under the
/// file name `name`, records it with `actor` and announces the new codes
/// with `publisher`. An error means nothing was imported; a run that
/// imported but could not be recorded or announced says so in
/// [`Uploaded::finished`].
pub async fn upload<R: std::io::Read + Send + 'static>(
    store: &Store,
    publisher: &Publisher,
    input: R,
    name: &str,
    pool: &str,
    options: &ImportOptions,
    actor: &Actor,
) -> Result<Uploaded, ImportError> {
    let summary =
        codepool_importer::import_reader(store, input, name, 0, pool, options, &|_| {}).await?;
    tracing::info!(pool, import_id = %summary.import_id, inserted = summary.inserted, invalid = summary.invalid, actor = %actor.who, "import uploaded");
    let finished = async {
        record(store, &summary, actor).await?;
        announce_replenished(store, publisher, pool, summary.inserted).await?;
        Ok(())
    }
    .await;
    Ok(Uploaded { summary, finished })
}
