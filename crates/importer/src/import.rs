//! One import run: stream rows, insert in batches, count, audit.

use std::fs::File;
use std::io::BufReader;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use codepool_domain::Pool;
use codepool_store::claims::{CrossPool, HeldElsewhere};
use codepool_store::codes::LookAlike;
use codepool_store::imports::{ImportRecord, RunState};
use codepool_store::{NewCode, ObjectId, Store, StoreError};
use serde::Serialize;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::csv_rows::{CodeRows, Header, HeaderError, Row, RowError};

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
    /// Import codes another pool holds already (an operator's deliberate
    /// choice); by default they are refused as cross-pool duplicates.
    pub allow_cross_pool: bool,
}

impl Default for ImportOptions {
    fn default() -> Self {
        Self {
            header: Header::default(),
            batch_size: 1000,
            concurrency: 3,
            keep_invalid: 1000,
            stop: CancellationToken::new(),
            allow_cross_pool: false,
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
    pub status: RunState,
    /// Empty for an interrupted run: only a whole file has a hash.
    pub sha256: String,
    pub rows: u64,
    pub inserted: u64,
    pub duplicates: u64,
    /// Rows refused: unreadable or malformed (with their reason), and
    /// look-alikes of a code the pool holds (`lookalikes` of them).
    pub invalid: u64,
    /// Of `invalid`, the codes refused as look-alikes: equal to a code of
    /// the pool under NFKC and case folding (NFKC only in a case-sensitive
    /// pool).
    pub lookalikes: u64,
    /// Of `invalid`, the codes refused because another pool holds them
    /// already (a code sits in one pool; `--allow-cross-pool` imports them).
    pub cross_pool: u64,
    /// The pools that hold the codes refused as cross-pool duplicates.
    pub cross_pool_pools: Vec<String>,
    /// The first invalid rows (up to `keep_invalid`), by line number.
    pub invalid_rows: Vec<InvalidRow>,
    pub seconds: f64,
    pub codes_per_second: f64,
    /// The unfinished run of the same file and pool this run completed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resumed_from: Option<String>,
}

impl ImportSummary {
    pub fn interrupted(&self) -> bool {
        self.status == RunState::Interrupted
    }
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
    pub lookalikes: u64,
    pub cross_pool: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    // The I/O error is part of the message, not a source: `{:#}` would
    // print it twice.
    #[error("cannot read {path}: {error}; check the path and permissions")]
    Open { path: String, error: std::io::Error },
    #[error(
        "{path} is a directory; give the path of a CSV file of codes (or - for standard input)"
    )]
    NotAFile { path: String },
    #[error("cannot import {path}: {error}")]
    Header { path: String, error: HeaderError },
    #[error("reading the file failed at byte {bytes}: {message}; fix the file and import it again (codes already imported count as duplicates)")]
    Read { bytes: u64, message: String },
    #[error("the file cannot be imported as it is: {0}")]
    Rows(RowError),
    #[error(transparent)]
    Pool(#[from] codepool_domain::InvalidPoolName),
    #[error(transparent)]
    FileName(#[from] codepool_domain::FileNameError),
    #[error("{0}. Nothing is half-written: import the same file again to finish (codes already imported count as duplicates)")]
    Store(StoreError),
    /// A recall of this run began while it was still inserting (after the
    /// run stalled past its lease): the run stopped, and inserts nothing
    /// more into a recalled import.
    #[error("import {0} was recalled while it ran; it stopped, inserting nothing more. Import the file again only if the recall was a mistake")]
    Recalled(String),
    /// The run this one would finish was recalled before it finished.
    #[error("run {run} of this file into this pool was recalled ({reason}) before it finished: the whole file is taken as leaked, so nothing was imported. Import the file the partner sends in its place")]
    FileRecalled { run: String, reason: String },
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
    /// Rows whose code appeared earlier in the file: duplicates, never sent.
    Repeats(u64),
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
    let file = if is_stdin(path) {
        STDIN_NAME.to_owned()
    } else {
        path.display().to_string()
    };
    import_rows(store, rows, &file, total_bytes, &pool, options, on_progress).await
}

/// [`import_file`] for any reader (an HTTP upload), recorded under `name`.
/// The reader is read on a blocking thread, a batch at a time: the input
/// is never held whole in memory. `size` is 0 when unknown.
pub async fn import_reader<R: std::io::Read + Send + 'static>(
    store: &Store,
    input: R,
    name: &str,
    size: u64,
    pool: &str,
    options: &ImportOptions,
    on_progress: &(dyn Fn(ImportProgress) + Send + Sync),
) -> Result<ImportSummary, ImportError> {
    let pool = Pool::new(pool)?;
    let name = codepool_domain::checked_file_name(name)?;
    let header = options.header.clone();
    let opened = tokio::task::spawn_blocking(move || CodeRows::open(input, &header))
        .await
        .map_err(|e| ImportError::Read {
            bytes: 0,
            message: format!("the reader thread failed: {e}"),
        })?;
    let rows = opened.map_err(|error| ImportError::Header {
        path: name.to_owned(),
        error,
    })?;
    import_rows(store, rows, name, size, &pool, options, on_progress).await
}

/// The run of an import whose header rule passed: nothing was written
/// before this.
async fn import_rows<R: std::io::Read + Send + 'static>(
    store: &Store,
    rows: CodeRows<R>,
    file: &str,
    total_bytes: u64,
    pool: &Pool,
    options: &ImportOptions,
    on_progress: &(dyn Fn(ImportProgress) + Send + Sync),
) -> Result<ImportSummary, ImportError> {
    let started = Instant::now();
    let earlier = store.unfinished_import(pool.as_str(), file).await?;
    if let Some(e) = earlier.as_ref().filter(|e| e.recalled_at.is_some()) {
        // Finishing it would put the rest of a leaked file on sale.
        return Err(ImportError::FileRecalled {
            run: e.id.to_hex(),
            reason: e.recall_reason.clone().unwrap_or_default(),
        });
    }
    let mut record = store
        .start_import(pool.as_str(), file, earlier.as_ref().map(|e| e.id))
        .await?;
    if let Some(e) = &earlier {
        info!(earlier = %e.id, status = %e.status, "an earlier import of this file into this pool did not finish; the codes it inserted are looked up and skipped, not inserted again");
    }

    // The reader runs on a blocking thread and hands over batches through a
    // small channel: memory is bounded by (channel + in-flight) batches.
    let (tx, mut rx) = mpsc::channel::<Piece>(4);
    let bytes = rows.bytes_counter();
    let batch_size = options.batch_size.max(1);
    let reader = tokio::task::spawn_blocking(move || read_rows(rows, batch_size, tx));

    let mut run = Run::new(store, pool.as_str(), record.id, options, total_bytes);
    run.lookup = earlier.is_some();
    run.claims_complete = store.claims_complete().await?;
    if !run.claims_complete {
        warn!("codes stored before cross-pool claims have none yet; exact copies are looked up in other pools, look-alikes are not. Run `codepool migrate` to claim them");
    }
    // A new record: nobody else holds it. Held while the run inserts, so a
    // recall waits for it ([`Store::take_run`]).
    if let Err(e) = store.take_run(record.id, &run.owner, LEASE).await {
        warn!(error = %e, "the run's lease was not taken; a recall is not held off while it runs");
    }
    let interrupted = run.consume(&mut rx, &bytes, on_progress).await;
    drop(rx);
    while run.absorb_next().await {}
    let _ = reader.await;
    run.progress.bytes_read = bytes.load(Ordering::Relaxed);
    on_progress(run.progress);
    if matches!(run.failure, Some(ImportError::Recalled(_))) {
        // Every insert of this run has landed: what landed after the
        // recall is voided as the recall voided the rest.
        match store.recall_rest(record.id).await {
            Ok(n) => info!(
                voided = n,
                "the run was recalled while it ran; its late codes are void"
            ),
            Err(e) => {
                warn!(error = %e, "the run was recalled while it ran, but its late codes were not voided; recall the import again")
            }
        }
    }
    let owner = run.owner.clone();
    let summary = run
        .close(&mut record, started.elapsed().as_secs_f64(), interrupted)
        .await;
    if let Err(e) = store.release_run(record.id, &owner).await {
        warn!(error = %e, "could not give the run up; its lease lapses on its own");
    }
    summary
}

/// How long a running import holds off a recall unless it renews its
/// lease (it does, at most every [`RENEW_EVERY`], before a batch).
pub const LEASE: Duration = Duration::from_secs(20);
pub(crate) const RENEW_EVERY: Duration = Duration::from_secs(5);

/// The name an import from standard input is recorded under.
pub const STDIN_NAME: &str = "(stdin)";

/// `-` means standard input.
fn is_stdin(path: &Path) -> bool {
    path.as_os_str() == "-"
}

/// Opens the file (standard input for `-`; a FIFO or a pipe streams like
/// a file) and applies the header rule (on a blocking thread: it reads).
/// Nothing is written before this succeeds. The size is 0 when it cannot
/// be known beforehand.
async fn open_rows(
    path: &Path,
    header: &Header,
) -> Result<(CodeRows<BufReader<File>>, u64), ImportError> {
    let shown = path.display().to_string();
    let opened = if is_stdin(path) {
        Path::new("/dev/stdin")
    } else {
        path
    };
    let file = File::open(opened).map_err(|error| ImportError::Open {
        path: shown.clone(),
        error,
    })?;
    let meta = file.metadata().map_err(|error| ImportError::Open {
        path: shown.clone(),
        error,
    })?;
    if meta.is_dir() {
        return Err(ImportError::NotAFile { path: shown });
    }
    let size = if meta.is_file() { meta.len() } else { 0 };
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
    Ok((rows, size))
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
    inflight: JoinSet<Result<Inserted, StoreError>>,
    /// Look codes up before inserting them: this run finishes one that was
    /// killed. Off again after [`RESUME_MISSES`] batches in a row found
    /// none of their codes in (past the rows the earlier run inserted).
    lookup: bool,
    misses: u32,
    failure: Option<ImportError>,
    /// The other pools that hold codes refused as cross-pool duplicates.
    other_pools: std::collections::BTreeSet<String>,
    /// The pool document exists (created once the first code landed).
    pool_ready: bool,
    /// Every stored code has its cross-pool claim ([`Store::claims_complete`]);
    /// until `codepool migrate` ran the backfill, exact copies are also
    /// looked up in other pools, as before claims.
    claims_complete: bool,
    /// The pool's `check_symbols` promise is withdrawn for this run's codes.
    checks_cleared: bool,
    /// The pool's `pool.exhausted` latch was re-armed for this run's codes.
    rearmed: bool,
    /// When the progress was last written to the audit record.
    saved: Instant,
    /// This run's hold on its record ([`Store::take_run`]), and when it
    /// was last renewed.
    owner: String,
    renewed: Instant,
}

/// How often a run's audit record gets its counts so far.
const PROGRESS_EVERY: Duration = Duration::from_secs(1);

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
            lookup: false,
            misses: 0,
            failure: None,
            other_pools: Default::default(),
            pool_ready: false,
            claims_complete: true,
            checks_cleared: false,
            rearmed: false,
            saved: Instant::now(),
            owner: ObjectId::new().to_hex(),
            renewed: Instant::now(),
        }
    }

    /// Renews the run's lease when it is due; false when a recall holds
    /// it (the run must insert nothing more).
    async fn renew(&mut self) -> bool {
        if self.renewed.elapsed() < RENEW_EVERY {
            return true;
        }
        match self
            .store
            .renew_run(self.import_id, &self.owner, LEASE)
            .await
        {
            Ok(true) => {
                self.renewed = Instant::now();
                true
            }
            Ok(false) => {
                self.failure = Some(ImportError::Recalled(self.import_id.to_hex()));
                false
            }
            // MongoDB is away: the inserts say so themselves.
            Err(e) => {
                warn!(error = %e, "the run's lease was not renewed");
                true
            }
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
                    if self.failure.is_some() || !self.renew().await {
                        return false;
                    }
                    let (store, pool, id) = (self.store.clone(), self.pool.clone(), self.import_id);
                    let mode = Mode {
                        lookup: self.lookup,
                        cross_pool: self.options.allow_cross_pool,
                        claims_complete: self.claims_complete,
                    };
                    self.inflight
                        .spawn(async move { insert_batch(&store, &pool, id, batch, mode).await });
                }
                Some(Piece::Repeats(n)) => self.progress.duplicates += n,
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
            Ok(Ok(done)) => {
                self.progress.inserted += done.inserted;
                self.progress.duplicates += done.duplicates;
                self.progress.lookalikes += done.lookalikes.len() as u64;
                self.progress.invalid += done.lookalikes.len() as u64;
                self.progress.cross_pool += done.cross_pool.len() as u64;
                self.progress.invalid += done.cross_pool.len() as u64;
                self.other_pools.extend(done.other_pools);
                for row in done.lookalikes.into_iter().chain(done.cross_pool) {
                    if self.invalid_rows.len() < self.options.keep_invalid {
                        self.invalid_rows.push(row);
                    }
                }
                self.count_lookup(done.found);
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
        if !self.rearmed && self.progress.inserted > 0 {
            self.rearm_exhausted().await;
        }
        self.save_progress().await;
        true
    }

    /// Codes came in: the pool's next shortage is a new exhaustion
    /// (`pool.exhausted` again). Done after the first batch that inserted
    /// (a run killed later still re-armed it) and again when the run ends.
    async fn rearm_exhausted(&mut self) {
        match self
            .store
            .rearm_exhausted_alerts(&[self.pool.as_str()])
            .await
        {
            Ok(()) => self.rearmed = true,
            Err(e) => warn!(error = %e, "pool.exhausted not re-armed; the next import re-arms it"),
        }
    }

    /// Writes the counts so far to the run's audit record, at most once a
    /// second: a killed run's record shows how far it got.
    async fn save_progress(&mut self) {
        if self.saved.elapsed() < PROGRESS_EVERY {
            return;
        }
        self.saved = Instant::now();
        let p = &self.progress;
        let counts = (p.inserted, p.duplicates, p.invalid);
        if let Err(e) = self.store.import_progress(self.import_id, counts).await {
            warn!(error = %e, "could not record the import's progress");
        }
    }

    /// Turns the lookups off once enough batches in a row found nothing.
    fn count_lookup(&mut self, found: Option<u64>) {
        match found {
            Some(0) if self.lookup => {
                self.misses += 1;
                if self.misses >= RESUME_MISSES {
                    self.lookup = false;
                    info!(
                        rows = self.progress.inserted + self.progress.duplicates,
                        "past the codes the earlier run inserted; plain inserts from here"
                    );
                }
            }
            Some(_) => self.misses = 0,
            None => {}
        }
    }

    /// A pool exists once it has held a code: created after the first
    /// batch that found or put codes in it, never before. Once this run
    /// put codes in, the pool no longer promises check symbols on every
    /// code (a file's codes carry none the pool could count on).
    async fn ensure_pool(&mut self) {
        let p = &self.progress;
        let settled = self.pool_ready && (self.checks_cleared || p.inserted == 0);
        if settled || p.inserted + p.duplicates == 0 {
            return;
        }
        let done = if p.inserted > 0 {
            let cleared = self.store.set_check_symbols(&self.pool, false).await;
            self.checks_cleared = cleared.is_ok();
            cleared
        } else {
            self.store.ensure_pool(&self.pool).await
        };
        match done {
            Ok(()) => self.pool_ready = true,
            Err(e) => {
                self.failure.get_or_insert(ImportError::Store(e));
            }
        }
    }

    /// Writes the audit record with the true counts and returns the summary
    /// (or the failure).
    async fn close(
        mut self,
        record: &mut ImportRecord,
        seconds: f64,
        interrupted: bool,
    ) -> Result<ImportSummary, ImportError> {
        if self.progress.inserted > 0 {
            self.rearm_exhausted().await;
        }
        let p = self.progress;
        let status = match (&self.failure, interrupted) {
            (Some(_), _) => RunState::Failed,
            (None, true) => RunState::Interrupted,
            (None, false) => RunState::Done,
        };
        // A stopped or failed run counts the rows it handled, not the rows
        // the reader had read ahead.
        let rows = if status == RunState::Done {
            p.rows
        } else {
            p.inserted + p.duplicates + p.invalid
        };
        let sha256 = if status == RunState::Done {
            self.sha256
        } else {
            String::new()
        };
        record.sha256 = (!sha256.is_empty()).then(|| sha256.clone());
        record.status = status;
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
        let mut invalid_rows = self.invalid_rows;
        invalid_rows.sort_by_key(|r| r.line);
        Ok(ImportSummary {
            import_id: self.import_id.to_hex(),
            pool: self.pool,
            file: record.file.clone(),
            status,
            sha256,
            rows,
            inserted: p.inserted,
            duplicates: p.duplicates,
            invalid: p.invalid,
            lookalikes: p.lookalikes,
            cross_pool: p.cross_pool,
            cross_pool_pools: self.other_pools.into_iter().collect(),
            invalid_rows,
            seconds,
            codes_per_second: if seconds > 0.0 {
                p.inserted as f64 / seconds
            } else {
                0.0
            },
            resumed_from: record.resumed_from.map(|id| id.to_hex()),
        })
    }
}

/// What one batch did. `found` is how many of its codes a lookup found
/// in the pool already (`None` without a lookup).
struct Inserted {
    inserted: u64,
    duplicates: u64,
    /// Rows refused as look-alikes, with the line they match.
    lookalikes: Vec<InvalidRow>,
    /// Rows refused because another pool holds their code.
    cross_pool: Vec<InvalidRow>,
    other_pools: Vec<String>,
    found: Option<u64>,
}

/// How a batch is inserted.
#[derive(Debug, Clone, Copy)]
struct Mode {
    /// Look the codes up first (finishing a killed run).
    lookup: bool,
    /// Codes other pools hold are imported too (`--allow-cross-pool`).
    cross_pool: bool,
    /// See [`Run::claims_complete`].
    claims_complete: bool,
}

/// Claims a batch's codes for `pool` ([`Store::claim_codes`]) and splits
/// it into the codes the pool now holds and the refused rows of those
/// another pool holds, as codepool compares codes (a look-alike of its
/// code included), with the pools' names; retried while MongoDB is away.
/// With `--allow-cross-pool` nothing is refused (the claims record both
/// pools, for `codepool lookalikes`).
async fn refuse_cross_pool(
    store: &Store,
    pool: &str,
    import_id: ObjectId,
    batch: Vec<NewCode>,
    mode: Mode,
) -> Result<(Vec<NewCode>, Vec<InvalidRow>, Vec<String>), StoreError> {
    let how = match mode.cross_pool {
        true => CrossPool::Allow,
        false => CrossPool::Refuse,
    };
    let mut attempt = 0;
    let mut elsewhere = loop {
        let found = match store.claim_codes(pool, import_id, &batch, how).await {
            Ok(found) if mode.cross_pool || mode.claims_complete => Ok(found),
            // Codes stored before claims have none yet: their exact copies
            // are found by value.
            Ok(found) => store.codes_in_other_pools(pool, &batch).await.map(|old| {
                (found.into_iter().zip(old))
                    .map(|(c, o)| c.or(o.map(|(pool, run)| HeldElsewhere { pool, run })))
                    .collect::<Vec<_>>()
            }),
            Err(e) => Err(e),
        };
        match found {
            Ok(found) => break found,
            Err(e) if e.is_unavailable() && attempt < INSERT_RETRIES => {
                attempt += 1;
                warn!(error = %e, attempt, "cross-pool claim failed; retrying");
                tokio::time::sleep(INSERT_BACKOFF * 2u32.pow(attempt)).await;
            }
            Err(e) => return Err(e),
        }
    };
    elsewhere.resize(batch.len(), None);
    let (mut kept, mut refused, mut pools) = (Vec::new(), Vec::new(), Vec::new());
    for (code, other) in batch.into_iter().zip(elsewhere) {
        let Some(HeldElsewhere { pool: other, run }) = other else {
            kept.push(code);
            continue;
        };
        let from = run.map(|id| format!(" (run {id})")).unwrap_or_default();
        refused.push(InvalidRow {
            line: code.line.unwrap_or(0),
            reason: format!(
                "cross_pool: pool {other:?} holds this code already{from}, or one that reads the same \
                 (equal under Unicode NFKC and case folding, and O/0, I/L/1 where either pool folds them); \
                 a code sits in one pool. Pass --allow-cross-pool if it is meant for both"
            ),
        });
        pools.push(other);
    }
    Ok((kept, refused, pools))
}

/// The refused row of a look-alike, naming the code it reads like.
fn lookalike_row(batch: &[NewCode], import_id: ObjectId, l: &LookAlike) -> InvalidRow {
    let line = batch.get(l.index).and_then(|c| c.line).unwrap_or(0);
    let matched = match (l.of_line, l.of_import) {
        (Some(of), Some(id)) if id == import_id => format!("the code on line {of} of this file"),
        (Some(of), Some(id)) => format!("the code on line {of} of import {id}"),
        (_, Some(id)) => format!("a code of import {id}"),
        _ => "a code the pool holds".to_owned(),
    };
    InvalidRow {
        line,
        reason: format!(
            "lookalike: reads the same as {matched} (equal under Unicode NFKC and case folding); \
             ask the partner which one is meant"
        ),
    }
}

/// Batches in a row whose lookup found nothing before lookups stop.
const RESUME_MISSES: u32 = 8;

/// Inserts one batch (after a lookup of the codes already in, when
/// `lookup`), retrying while MongoDB is away. A retried batch is counted
/// exactly: codes of this run already present were ours.
async fn insert_batch(
    store: &Store,
    pool: &str,
    import_id: ObjectId,
    batch: Vec<NewCode>,
    mode: Mode,
) -> Result<Inserted, StoreError> {
    let (batch, cross_pool, other_pools) =
        refuse_cross_pool(store, pool, import_id, batch, mode).await?;
    let mut attempt = 0;
    loop {
        let result = if mode.lookup {
            store
                .insert_missing_codes(pool, import_id, &batch)
                .await
                .map(|(o, found)| (o, Some(found)))
        } else {
            store
                .insert_claimed(pool, import_id, &batch)
                .await
                .map(|o| (o, None))
        };
        match result {
            Ok((o, found)) if attempt == 0 => {
                let lookalikes = (o.lookalikes.iter())
                    .map(|l| lookalike_row(&batch, import_id, l))
                    .collect();
                return Ok(Inserted {
                    inserted: o.inserted,
                    duplicates: o.duplicates,
                    lookalikes,
                    cross_pool,
                    other_pools,
                    found,
                });
            }
            Ok((_, found)) => {
                // A retry cannot tell look-alikes from codes its first
                // attempt inserted: the rest count as duplicates.
                let ours = store.count_from_batch(pool, import_id, &batch).await?;
                return Ok(Inserted {
                    inserted: ours,
                    duplicates: batch.len() as u64 - ours,
                    lookalikes: Vec::new(),
                    cross_pool,
                    other_pools,
                    found,
                });
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

/// The codes a file has shown so far, to collapse repeats before they
/// reach MongoDB (a repeat costs a rejected insert there). Each code is kept
/// as 16 bytes of its SHA-256; past [`SEEN_LIMIT`] codes the set is
/// cleared, so memory stays bounded and later repeats are still counted as
/// duplicates by the unique index, just more slowly.
struct Seen(std::collections::HashSet<[u8; 16]>);

/// Codes remembered at most (about 50 MB).
const SEEN_LIMIT: usize = 1 << 21;

impl Seen {
    /// True the first time a code is seen.
    fn first(&mut self, code: &str) -> bool {
        use sha2::{Digest, Sha256};
        let digest = Sha256::digest(code.as_bytes());
        let mut key = [0u8; 16];
        key.copy_from_slice(&digest[..16]);
        if self.0.len() >= SEEN_LIMIT {
            self.0.clear();
        }
        self.0.insert(key)
    }
}

fn read_rows<R: std::io::Read>(mut rows: CodeRows<R>, batch_size: usize, tx: mpsc::Sender<Piece>) {
    let mut batch = Vec::with_capacity(batch_size);
    let (mut count, mut repeats) = (0u64, 0u64);
    let mut seen = Seen(Default::default());
    let send = |piece: Piece| tx.blocking_send(piece).is_ok();
    for row in rows.by_ref() {
        match row {
            Ok(Row::Code {
                code,
                expires_at,
                line,
            }) => {
                count += 1;
                if !seen.first(&code) {
                    repeats += 1;
                    if repeats % 1024 == 0
                        && !(send(Piece::Repeats(std::mem::take(&mut repeats)))
                            && send(Piece::Rows(count)))
                    {
                        return;
                    }
                    continue;
                }
                batch.push(NewCode {
                    code,
                    expires_at,
                    line: Some(line),
                });
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
            Err(RowError::Csv(e)) => {
                let bytes = rows.bytes_counter().load(Ordering::Relaxed);
                let _ = send(Piece::Failed(ImportError::Read {
                    bytes,
                    message: e.to_string(),
                }));
                return;
            }
            Err(error) => {
                // The rows read before go in (a whole batch is sent first).
                if !batch.is_empty() && !send(Piece::Codes(std::mem::take(&mut batch))) {
                    return;
                }
                let _ = send(Piece::Failed(ImportError::Rows(error)));
                return;
            }
        }
    }
    if !batch.is_empty() && !send(Piece::Codes(batch)) {
        return;
    }
    if repeats > 0 && !send(Piece::Repeats(repeats)) {
        return;
    }
    let _ = send(Piece::Rows(count));
    let _ = send(Piece::Done(rows.finish_sha256()));
}
