//! One import run: stream rows, insert in batches, count, audit.

use std::fs::File;
use std::io::BufReader;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use codepool_domain::Pool;
use codepool_store::imports::ImportRecord;
use codepool_store::{NewCode, ObjectId, Store, StoreError};
use serde::Serialize;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::csv_rows::{CodeRows, Header, HeaderError, Row};

/// How an import runs. The defaults suit files of any size.
#[derive(Debug, Clone)]
pub struct ImportOptions {
    /// How the first row is read (a header naming `code` by default).
    pub header: Header,
    /// Codes per insert command (at least 1).
    pub batch_size: usize,
    /// Insert commands in flight at once.
    pub concurrency: usize,
    /// Invalid rows kept with their details for the summary (all are counted).
    pub keep_invalid: usize,
    /// Cancelled to stop early (a signal): in-flight batches finish, the
    /// audit record says `interrupted` with the true counts.
    pub stop: CancellationToken,
}

impl Default for ImportOptions {
    fn default() -> Self {
        Self {
            header: Header::default(),
            batch_size: 1000,
            concurrency: 3,
            keep_invalid: 1000,
            stop: CancellationToken::new(),
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
    /// `done`, or `interrupted` when a signal stopped the run early (the
    /// counts are what it did; run the same command again to finish).
    pub status: String,
    /// Empty for an interrupted run: only a whole file has a hash.
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

impl ImportSummary {
    pub fn interrupted(&self) -> bool {
        self.status == STATUS_INTERRUPTED
    }
}

const STATUS_DONE: &str = "done";
const STATUS_FAILED: &str = "failed";
const STATUS_INTERRUPTED: &str = "interrupted";

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
    // The I/O error is part of the message, not a source: `{:#}` would
    // print it twice.
    #[error("cannot read {path}: {error}; check the path and permissions")]
    Open { path: String, error: std::io::Error },
    #[error("{path} is not a file (a directory?); give the path of a CSV file of codes")]
    NotAFile { path: String },
    #[error("cannot import {path}: {error}")]
    Header { path: String, error: HeaderError },
    #[error("reading the file failed at byte {bytes}: {message}; fix the file and run the same command again (codes already imported count as duplicates)")]
    Read { bytes: u64, message: String },
    #[error(transparent)]
    Pool(#[from] codepool_domain::InvalidPoolName),
    #[error("{0}. Nothing is half-written: run the same command again to finish the import (codes already imported count as duplicates)")]
    Store(StoreError),
}

impl From<StoreError> for ImportError {
    fn from(e: StoreError) -> Self {
        Self::Store(e)
    }
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
///
/// The header rule is checked before anything is written: a refused file
/// leaves no audit record and no pool. The pool is created when its first
/// code lands, so a failed or all-invalid import creates no empty pool.
pub async fn import_file(
    store: &Store,
    path: &Path,
    pool: &str,
    options: &ImportOptions,
    on_progress: &(dyn Fn(ImportProgress) + Send + Sync),
) -> Result<ImportSummary, ImportError> {
    let pool = Pool::new(pool)?;
    let (rows, total_bytes) = open_rows(path, &options.header).await?;
    let started = Instant::now();
    let mut record = store
        .start_import(pool.as_str(), &path.display().to_string())
        .await?;

    // The reader runs on a blocking thread and hands over batches through a
    // small channel: memory is bounded by (channel + in-flight) batches.
    let (tx, mut rx) = mpsc::channel::<Piece>(4);
    let bytes = rows.bytes_counter();
    let batch_size = options.batch_size.max(1);
    let reader = tokio::task::spawn_blocking(move || read_rows(rows, batch_size, tx));

    let mut run = Run::new(store, pool.as_str(), record.id, options, total_bytes);
    let interrupted = run.consume(&mut rx, &bytes, on_progress).await;
    drop(rx);
    while run.absorb_next().await {}
    let _ = reader.await;
    run.progress.bytes_read = bytes.load(Ordering::Relaxed);
    on_progress(run.progress);
    run.close(&mut record, started.elapsed().as_secs_f64(), interrupted)
        .await
}

/// Opens the file and applies the header rule (on a blocking thread: it
/// reads). Nothing is written before this succeeds.
async fn open_rows(
    path: &Path,
    header: &Header,
) -> Result<(CodeRows<BufReader<File>>, u64), ImportError> {
    let shown = path.display().to_string();
    let file = File::open(path).map_err(|error| ImportError::Open {
        path: shown.clone(),
        error,
    })?;
    let meta = file.metadata().map_err(|error| ImportError::Open {
        path: shown.clone(),
        error,
    })?;
    if !meta.is_file() {
        return Err(ImportError::NotAFile { path: shown });
    }
    let header = header.clone();
    let opened = tokio::task::spawn_blocking(move || {
        CodeRows::open(BufReader::with_capacity(1 << 16, file), &header)
    })
    .await
    .map_err(|e| ImportError::Read {
        bytes: 0,
        message: format!("the reader thread failed: {e}"),
    })?;
    let rows = opened.map_err(|error| ImportError::Header { path: shown, error })?;
    Ok((rows, meta.len()))
}

/// One run between its first row and its audit record.
struct Run<'a> {
    store: &'a Store,
    pool: String,
    import_id: ObjectId,
    options: &'a ImportOptions,
    progress: ImportProgress,
    invalid_rows: Vec<InvalidRow>,
    sha256: String,
    inflight: JoinSet<Result<(u64, u64), StoreError>>,
    failure: Option<ImportError>,
    /// The pool document exists (created once the first code landed).
    pool_ready: bool,
}

impl<'a> Run<'a> {
    fn new(
        store: &'a Store,
        pool: &str,
        import_id: ObjectId,
        options: &'a ImportOptions,
        total_bytes: u64,
    ) -> Self {
        Self {
            store,
            pool: pool.to_owned(),
            import_id,
            options,
            progress: ImportProgress {
                total_bytes,
                ..ImportProgress::default()
            },
            invalid_rows: Vec::new(),
            sha256: String::new(),
            inflight: JoinSet::new(),
            failure: None,
            pool_ready: false,
        }
    }

    /// Takes pieces from the reader until the file ends, a failure, or a
    /// stop request. True when stopped.
    async fn consume(
        &mut self,
        rx: &mut mpsc::Receiver<Piece>,
        bytes: &AtomicU64,
        on_progress: &(dyn Fn(ImportProgress) + Send + Sync),
    ) -> bool {
        loop {
            let piece = tokio::select! {
                biased;
                () = self.options.stop.cancelled() => return true,
                piece = rx.recv() => piece,
            };
            match piece {
                None => return false,
                Some(Piece::Codes(batch)) => {
                    while self.inflight.len() >= self.options.concurrency.max(1) {
                        self.absorb_next().await;
                    }
                    if self.failure.is_some() {
                        return false;
                    }
                    let (store, pool, id) = (self.store.clone(), self.pool.clone(), self.import_id);
                    self.inflight
                        .spawn(async move { insert_batch(&store, &pool, id, batch).await });
                }
                Some(Piece::Invalid(row)) => {
                    self.progress.invalid += 1;
                    if self.invalid_rows.len() < self.options.keep_invalid {
                        self.invalid_rows.push(row);
                    }
                }
                Some(Piece::Rows(n)) => {
                    self.progress.rows = n;
                    self.progress.bytes_read = bytes.load(Ordering::Relaxed);
                    on_progress(self.progress);
                }
                Some(Piece::Done(hash)) => self.sha256 = hash,
                Some(Piece::Failed(e)) => {
                    self.failure = Some(e);
                    return false;
                }
            }
        }
    }

    /// Waits for the next in-flight batch and counts it. False when none
    /// was in flight.
    async fn absorb_next(&mut self) -> bool {
        let Some(done) = self.inflight.join_next().await else {
            return false;
        };
        match done {
            Ok(Ok((inserted, duplicates))) => {
                self.progress.inserted += inserted;
                self.progress.duplicates += duplicates;
            }
            Ok(Err(e)) => {
                self.failure.get_or_insert(ImportError::Store(e));
            }
            Err(e) => {
                self.failure.get_or_insert(ImportError::Read {
                    bytes: self.progress.bytes_read,
                    message: format!("insert task failed: {e}"),
                });
            }
        }
        self.ensure_pool().await;
        true
    }

    /// A pool exists once it has held a code: created after the first
    /// batch that found or put codes in it, never before.
    async fn ensure_pool(&mut self) {
        if self.pool_ready || self.progress.inserted + self.progress.duplicates == 0 {
            return;
        }
        match self.store.ensure_pool(&self.pool).await {
            Ok(()) => self.pool_ready = true,
            Err(e) => {
                self.failure.get_or_insert(ImportError::Store(e));
            }
        }
    }

    /// Writes the audit record with the true counts and returns the summary
    /// (or the failure).
    async fn close(
        self,
        record: &mut ImportRecord,
        seconds: f64,
        interrupted: bool,
    ) -> Result<ImportSummary, ImportError> {
        let p = self.progress;
        let status = match (&self.failure, interrupted) {
            (Some(_), _) => STATUS_FAILED,
            (None, true) => STATUS_INTERRUPTED,
            (None, false) => STATUS_DONE,
        };
        // A stopped or failed run counts the rows it handled, not the rows
        // the reader had read ahead.
        let rows = if status == STATUS_DONE {
            p.rows
        } else {
            p.inserted + p.duplicates + p.invalid
        };
        let sha256 = if status == STATUS_DONE {
            self.sha256
        } else {
            String::new()
        };
        record.sha256 = (!sha256.is_empty()).then(|| sha256.clone());
        record.status = status.into();
        record.finished_at = Some(bson::DateTime::now());
        (record.rows, record.inserted) = (rows, p.inserted);
        (record.duplicates, record.invalid) = (p.duplicates, p.invalid);
        record.seconds = seconds;
        record.error = self.failure.as_ref().map(ToString::to_string);
        if let Err(e) = self.store.finish_import(record).await {
            warn!(error = %e, "could not write the import audit record");
        }
        if let Some(e) = self.failure {
            return Err(e);
        }
        Ok(ImportSummary {
            import_id: self.import_id.to_hex(),
            pool: self.pool,
            file: record.file.clone(),
            status: status.into(),
            sha256,
            rows,
            inserted: p.inserted,
            duplicates: p.duplicates,
            invalid: p.invalid,
            invalid_rows: self.invalid_rows,
            seconds,
            codes_per_second: if seconds > 0.0 {
                p.inserted as f64 / seconds
            } else {
                0.0
            },
        })
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
