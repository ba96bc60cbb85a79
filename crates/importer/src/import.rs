//! One import run: stream rows, insert in batches, count, audit.

use std::fs::File;
use std::io::BufReader;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use codepool_domain::Pool;
use codepool_store::{NewCode, ObjectId, Store, StoreError};
use serde::Serialize;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tracing::warn;

use crate::csv_rows::{CodeRows, Row};

/// How an import runs. The defaults suit files of any size.
#[derive(Debug, Clone)]
pub struct ImportOptions {
    /// Codes per insert command.
    pub batch_size: usize,
    /// Insert commands in flight at once.
    pub concurrency: usize,
    /// Invalid rows kept with their details for the summary (all are counted).
    pub keep_invalid: usize,
}

impl Default for ImportOptions {
    fn default() -> Self {
        Self {
            batch_size: 1000,
            concurrency: 3,
            keep_invalid: 1000,
        }
    }
}

/// A row that was skipped, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct InvalidRow {
    pub line: u64,
    pub reason: String,
}

/// What an import did.
#[derive(Debug, Clone, Serialize)]
pub struct ImportSummary {
    pub import_id: String,
    pub pool: String,
    pub file: String,
    pub sha256: String,
    pub rows: u64,
    pub inserted: u64,
    pub duplicates: u64,
    pub invalid: u64,
    /// The first invalid rows (up to `keep_invalid`), with line numbers.
    pub invalid_rows: Vec<InvalidRow>,
    pub seconds: f64,
    pub codes_per_second: f64,
}

/// Progress as it happens, for a progress bar or log lines.
#[derive(Debug, Clone, Copy, Default)]
pub struct ImportProgress {
    pub bytes_read: u64,
    pub total_bytes: u64,
    pub rows: u64,
    pub inserted: u64,
    pub duplicates: u64,
    pub invalid: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error("cannot read {path}: {source}; check the path and permissions")]
    Open {
        path: String,
        source: std::io::Error,
    },
    #[error("reading the file failed at byte {bytes}: {message}; fix the file and run the same command again (codes already imported count as duplicates)")]
    Read { bytes: u64, message: String },
    #[error(transparent)]
    Pool(#[from] codepool_domain::InvalidPoolName),
    #[error("{0}. Nothing is half-written: run the same command again to finish the import (codes already imported count as duplicates)")]
    Store(#[from] StoreError),
}

/// Retries for a batch insert while MongoDB is unavailable.
const INSERT_RETRIES: u32 = 6;
const INSERT_BACKOFF: Duration = Duration::from_millis(250);

enum Piece {
    Codes(Vec<NewCode>),
    Invalid(InvalidRow),
    Rows(u64),
    Done(String),
    Failed(ImportError),
}

/// Imports `path` into `pool`. `on_progress` is called after every batch.
pub async fn import_file(
    store: &Store,
    path: &Path,
    pool: &str,
    options: &ImportOptions,
    on_progress: &(dyn Fn(ImportProgress) + Send + Sync),
) -> Result<ImportSummary, ImportError> {
    let pool = Pool::new(pool)?;
    let file = File::open(path).map_err(|source| ImportError::Open {
        path: path.display().to_string(),
        source,
    })?;
    let total_bytes = file.metadata().map(|m| m.len()).unwrap_or(0);
    let started = Instant::now();
    store.ensure_pool(pool.as_str()).await?;
    let mut record = store
        .start_import(pool.as_str(), &path.display().to_string())
        .await?;
    let import_id = record.id;

    // The reader runs on a blocking thread and hands over batches through a
    // small channel: memory is bounded by (channel + in-flight) batches.
    let (tx, mut rx) = mpsc::channel::<Piece>(4);
    let rows = CodeRows::new(BufReader::with_capacity(1 << 16, file));
    let bytes = rows.bytes_counter();
    let batch_size = options.batch_size.max(1);
    let reader = tokio::task::spawn_blocking(move || read_rows(rows, batch_size, tx));

    let mut progress = ImportProgress {
        total_bytes,
        ..ImportProgress::default()
    };
    let mut invalid_rows = Vec::new();
    let mut sha256 = String::new();
    let mut inflight: JoinSet<Result<(u64, u64), StoreError>> = JoinSet::new();
    let mut failure: Option<ImportError> = None;

    while let Some(piece) = rx.recv().await {
        match piece {
            Piece::Codes(batch) => {
                while inflight.len() >= options.concurrency.max(1) {
                    if let Some(done) = inflight.join_next().await {
                        absorb(done, &mut progress, &mut failure);
                    }
                }
                if failure.is_some() {
                    break;
                }
                let store = store.clone();
                let pool = pool.as_str().to_owned();
                inflight.spawn(async move { insert_batch(&store, &pool, import_id, batch).await });
            }
            Piece::Invalid(row) => {
                progress.invalid += 1;
                if invalid_rows.len() < options.keep_invalid {
                    invalid_rows.push(row);
                }
            }
            Piece::Rows(n) => {
                progress.rows = n;
                progress.bytes_read = bytes.load(Ordering::Relaxed);
                on_progress(progress);
            }
            Piece::Done(hash) => sha256 = hash,
            Piece::Failed(e) => {
                failure = Some(e);
                break;
            }
        }
    }
    drop(rx);
    while let Some(done) = inflight.join_next().await {
        absorb(done, &mut progress, &mut failure);
    }
    let _ = reader.await;
    progress.bytes_read = bytes.load(Ordering::Relaxed);
    on_progress(progress);

    let seconds = started.elapsed().as_secs_f64();
    record.sha256 = (!sha256.is_empty()).then(|| sha256.clone());
    record.status = if failure.is_some() { "failed" } else { "done" }.into();
    record.finished_at = Some(bson::DateTime::now());
    record.rows = progress.rows;
    record.inserted = progress.inserted;
    record.duplicates = progress.duplicates;
    record.invalid = progress.invalid;
    record.seconds = seconds;
    record.error = failure.as_ref().map(ToString::to_string);
    if let Err(e) = store.finish_import(&record).await {
        warn!(error = %e, "could not write the import audit record");
    }
    if let Some(e) = failure {
        return Err(e);
    }
    Ok(ImportSummary {
        import_id: import_id.to_hex(),
        pool: record.pool,
        file: record.file,
        sha256,
        rows: progress.rows,
        inserted: progress.inserted,
        duplicates: progress.duplicates,
        invalid: progress.invalid,
        invalid_rows,
        seconds,
        codes_per_second: if seconds > 0.0 {
            progress.inserted as f64 / seconds
        } else {
            0.0
        },
    })
}

fn absorb(
    done: Result<Result<(u64, u64), StoreError>, tokio::task::JoinError>,
    progress: &mut ImportProgress,
    failure: &mut Option<ImportError>,
) {
    match done {
        Ok(Ok((inserted, duplicates))) => {
            progress.inserted += inserted;
            progress.duplicates += duplicates;
        }
        Ok(Err(e)) => {
            failure.get_or_insert(ImportError::Store(e));
        }
        Err(e) => {
            failure.get_or_insert(ImportError::Read {
                bytes: progress.bytes_read,
                message: format!("insert task failed: {e}"),
            });
        }
    }
}

/// Inserts one batch, retrying while MongoDB is away. A retried batch is
/// counted exactly: codes of this run already present were ours.
async fn insert_batch(
    store: &Store,
    pool: &str,
    import_id: ObjectId,
    batch: Vec<NewCode>,
) -> Result<(u64, u64), StoreError> {
    let mut attempt = 0;
    loop {
        match store.insert_codes(pool, import_id, &batch).await {
            Ok(outcome) if attempt == 0 => return Ok((outcome.inserted, outcome.duplicates)),
            Ok(_) => {
                let ours = store.count_from_batch(pool, import_id, &batch).await?;
                return Ok((ours, batch.len() as u64 - ours));
            }
            Err(e) if e.is_unavailable() && attempt < INSERT_RETRIES => {
                attempt += 1;
                warn!(error = %e, attempt, "insert failed; retrying");
                tokio::time::sleep(INSERT_BACKOFF * 2u32.pow(attempt)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

fn read_rows<R: std::io::Read>(mut rows: CodeRows<R>, batch_size: usize, tx: mpsc::Sender<Piece>) {
    let mut batch = Vec::with_capacity(batch_size);
    let mut count = 0u64;
    let send = |piece: Piece| tx.blocking_send(piece).is_ok();
    for row in rows.by_ref() {
        match row {
            Ok(Row::Code {
                code, expires_at, ..
            }) => {
                count += 1;
                batch.push(NewCode { code, expires_at });
                if batch.len() >= batch_size {
                    let full = std::mem::replace(&mut batch, Vec::with_capacity(batch_size));
                    if !send(Piece::Codes(full)) || !send(Piece::Rows(count)) {
                        return;
                    }
                }
            }
            Ok(Row::Invalid { line, reason }) => {
                count += 1;
                if !send(Piece::Invalid(InvalidRow { line, reason })) {
                    return;
                }
            }
            Err(e) => {
                let bytes = rows.bytes_counter().load(Ordering::Relaxed);
                let _ = send(Piece::Failed(ImportError::Read {
                    bytes,
                    message: e.to_string(),
                }));
                return;
            }
        }
    }
    if !batch.is_empty() && !send(Piece::Codes(batch)) {
        return;
    }
    let _ = send(Piece::Rows(count));
    let _ = send(Piece::Done(rows.finish_sha256()));
}
