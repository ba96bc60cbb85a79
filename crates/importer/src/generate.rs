//! One generation run: codes of a pattern, their random symbols drawn from
//! the operating system's CSPRNG, inserted through the very path an import
//! takes ([`Store::insert_codes`]: sealed at rest, keyed by the same
//! HMACs), until the run holds its count.
//!
//! A run is an import with its own id (`source: generated`): recall,
//! stats, statements and export see it as they see a file. A code that
//! collides (with a code of this pool, a look-alike of one, or a code of
//! another pool) is drawn again, never refused. The run is idempotent by
//! its id: before drawing, it counts the codes its id already put in the
//! pool and makes only the rest, so a run killed halfway and started again
//! ends with exactly its count.

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use codepool_domain::{CodePattern, Pool};
use codepool_sequence::DailyNumbers;
use codepool_store::claims::CrossPool;
use codepool_store::imports::{GenerationSpec, ImportRecord, RunState, SOURCE_GENERATED};
use codepool_store::{NewCode, ObjectId, Store, StoreError};
use rand::TryRngCore;
use serde::Serialize;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// Most codes one run may make.
pub const MAX_COUNT: u64 = 10_000_000;
/// Batches in a row that place no code before the run gives up: the
/// pattern's codes are (nearly) all taken.
const FRUITLESS_BATCHES: u32 = 20;
const RETRIES: u32 = 6;
const BACKOFF: Duration = Duration::from_millis(250);
const PROGRESS_EVERY: Duration = Duration::from_secs(1);
/// How long a run's lease lasts unless renewed (it is, every [`RENEW_EVERY`]): a run
/// whose process died is taken up again at most this long after.
pub use crate::import::LEASE;
use crate::import::RENEW_EVERY;

/// What to generate.
#[derive(Debug, Clone)]
pub struct Generation {
    pub pool: String,
    pub count: u64,
    pub pattern: CodePattern,
    pub expires_at: Option<DateTime<Utc>>,
    /// The run to make or continue; a new one when `None`.
    pub run_id: Option<ObjectId>,
}

impl Generation {
    fn spec(&self) -> GenerationSpec {
        GenerationSpec {
            pattern: self.pattern.to_string(),
            count: self.count,
            check_char: self.pattern.has_check(),
            expires_at: self.expires_at.map(bson::DateTime::from_chrono),
        }
    }
}

/// How a run goes.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    /// Codes per insert.
    pub batch_size: usize,
    /// Inserts in flight at once: a batch is sealed and written while the
    /// next is drawn (as an import's batches).
    pub in_flight: usize,
    /// Cancelled to stop early: the batch in flight lands, the record says
    /// `interrupted`; the same run id finishes it.
    pub stop: CancellationToken,
    /// Where the random symbols' bytes come from: the operating system's
    /// CSPRNG, always, outside tests.
    pub random: ByteSource,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self {
            batch_size: 1000,
            in_flight: 3,
            stop: CancellationToken::new(),
            random: ByteSource::Os,
        }
    }
}

/// Fills a buffer with chosen bytes.
pub type FillBytes = std::sync::Arc<dyn Fn(&mut [u8]) + Send + Sync>;

/// The source of random bytes.
#[derive(Clone, Default)]
pub enum ByteSource {
    /// `rand::rngs::OsRng`: the operating system's CSPRNG.
    #[default]
    Os,
    /// Chosen bytes, for tests that need codes to collide.
    Chosen(FillBytes),
}

impl std::fmt::Debug for ByteSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ByteSource::Os => "Os",
            ByteSource::Chosen(_) => "Chosen",
        })
    }
}

impl ByteSource {
    fn fill(&self, bytes: &mut [u8]) -> Result<(), GenerateError> {
        match self {
            ByteSource::Os => rand::rngs::OsRng
                .try_fill_bytes(bytes)
                .map_err(|e| GenerateError::Random(e.to_string())),
            ByteSource::Chosen(fill) => {
                fill(bytes);
                Ok(())
            }
        }
    }
}

/// Progress as it happens.
#[derive(Debug, Clone, Copy, Default)]
pub struct GenerateProgress {
    pub count: u64,
    /// Codes the run holds so far.
    pub inserted: u64,
    pub redrawn: u64,
}

/// What a run did.
#[derive(Debug, Clone, Serialize)]
pub struct GenerateSummary {
    pub run_id: String,
    pub pool: String,
    pub pattern: String,
    pub count: u64,
    /// `done`, or `interrupted` (run the same id again to finish).
    pub status: RunState,
    /// Codes the run holds, this call's and earlier calls' of its id.
    pub inserted: u64,
    /// Of `inserted`, the codes this call made.
    pub inserted_now: u64,
    /// Codes drawn again because they collided with a code that exists
    /// (by every call of this run, as far as they recorded it).
    pub redrawn: u64,
    pub random_bits: u32,
    pub check_char: bool,
    pub seconds: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error(transparent)]
    Pool(#[from] codepool_domain::InvalidPoolName),
    #[error("a run makes 1 to {MAX_COUNT} codes, not {0}")]
    Count(u64),
    #[error("--expires-at {0} is not in the future: every code would be expired as it is made; give a later time, or none")]
    ExpiredAtBirth(String),
    #[error("run {id} exists and {why}; give a new --run-id, or the same pool, count and pattern to finish it")]
    OtherRun { id: String, why: String },
    #[error("the daily number could not be drawn: {0}")]
    Numbers(#[from] codepool_sequence::SequenceError),
    #[error("the pattern's codes are nearly all taken ({0} drawn again in a row); use a pattern with more random symbols")]
    Exhausted(u64),
    #[error("the operating system's random generator failed: {0}")]
    Random(String),
    #[error("{0}. Run the same command with the same --run-id to finish: it makes only the codes still missing")]
    Store(#[from] StoreError),
    #[error("run {id} is being made by another process now (it renewed its lease to {until}); nothing was made here. Wait for it to end, then run the same command to check it")]
    Busy { id: String, until: String },
    #[error("run {0} was taken over by another process while this one stalled; it stopped here, and that process finishes the run. Run the same command with the same --run-id to check it")]
    LeaseLost(String),
    /// The run was recalled while this process stalled past its lease: it
    /// stopped, and what it inserted after the recall is void too.
    #[error("run {id} was recalled ({reason}) while this process stalled; it stopped here, and the codes it made after the recall are void as the recall voided the rest. Start a new run (without --run-id) for new codes")]
    RecalledWhileRunning { id: String, reason: String },
    #[error("run {id} was recalled ({reason}); its codes are void, and a recalled run makes no more. Start a new run (without --run-id) for new codes")]
    Recalled { id: String, reason: String },
}

impl GenerateError {
    fn recalled(r: &ImportRecord) -> Option<GenerateError> {
        r.recalled_at.map(|_| GenerateError::Recalled {
            id: r.id.to_hex(),
            reason: r.recall_reason.clone().unwrap_or_default(),
        })
    }
}

/// Takes run `id` for `owner`: at once when no one holds it, after the
/// lease lapses when its holder died; [`GenerateError::Busy`] when its
/// holder keeps renewing it (it is alive and making the codes).
async fn take_lease(store: &Store, id: ObjectId, owner: &str) -> Result<(), GenerateError> {
    let mut first: Option<bson::DateTime> = None;
    loop {
        let Some(until) = store.take_run(id, owner, LEASE).await? else {
            return Ok(());
        };
        let seen = *first.get_or_insert(until);
        let waited_out = bson::DateTime::now().timestamp_millis() > seen.timestamp_millis() + 1000;
        if waited_out {
            return Err(GenerateError::Busy {
                id: id.to_hex(),
                until: until.try_to_rfc3339_string().unwrap_or_default(),
            });
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Makes (or finishes) generation run `g`. `numbers` serves `{number}`
/// (MongoDB alone when `None`).
pub async fn generate(
    store: &Store,
    numbers: Option<&DailyNumbers>,
    g: &Generation,
    options: &GenerateOptions,
    on_progress: &(dyn Fn(GenerateProgress) + Send + Sync),
) -> Result<GenerateSummary, GenerateError> {
    let (pool, mut record) = open_run(store, g).await?;
    let owner = ObjectId::new().to_hex();
    take_lease(store, record.id, &owner).await?;
    // A recall made between the record's reading and the lease: this run
    // makes nothing more.
    let recalled = match store.import_record(record.id).await {
        Ok(now) => now.as_ref().and_then(GenerateError::recalled),
        Err(e) => Some(e.into()),
    };
    if let Some(e) = recalled {
        if let Err(e) = store.release_run(record.id, &owner).await {
            warn!(error = %e, "could not give the run up; its lease lapses on its own");
        }
        return Err(e);
    }
    let result = run_leased(
        store,
        numbers,
        g,
        options,
        on_progress,
        (pool, &mut record),
        &owner,
    )
    .await;
    if let Err(e) = store.release_run(record.id, &owner).await {
        warn!(error = %e, "could not give the run up; its lease lapses on its own");
    }
    let (run, before, seconds) = result?;
    Ok(GenerateSummary {
        run_id: record.id.to_hex(),
        pool: record.pool,
        pattern: g.pattern.to_string(),
        count: g.count,
        status: record.status,
        inserted: run.0,
        inserted_now: run.0 - before,
        redrawn: run.1,
        random_bits: g.pattern.random_bits(),
        check_char: g.pattern.has_check(),
        seconds,
    })
}

/// The run, once this process holds its lease: makes the missing codes
/// and writes the record. Returns (codes of the run, redrawn), the codes
/// it held before, and the seconds.
async fn run_leased(
    store: &Store,
    numbers: Option<&DailyNumbers>,
    g: &Generation,
    options: &GenerateOptions,
    on_progress: &(dyn Fn(GenerateProgress) + Send + Sync),
    (pool, record): (Pool, &mut ImportRecord),
    owner: &str,
) -> Result<((u64, u64), u64, f64), GenerateError> {
    let started = Instant::now();
    let fallback;
    let numbers = match numbers {
        Some(n) => Some(n),
        None if g.pattern.has_number() => {
            // MongoDB serves the numbers alone: they never repeat either way.
            let db = store.database().clone();
            fallback = DailyNumbers::new(None, db, "", chrono_tz::UTC);
            Some(&fallback)
        }
        None => None,
    };
    let mut run = Draws {
        store,
        numbers,
        g,
        pool: pool.as_str(),
        id: record.id,
        held: store.codes_of_run(pool.as_str(), record.id).await?,
        // Counted on from what earlier calls of this run recorded.
        redrawn: record.duplicates,
        saved: Instant::now(),
        // Just taken by `take_lease`.
        renewed: Instant::now(),
        marked: false,
        owner,
    };
    if g.pattern.has_check() && !store.pool_holds_codes(pool.as_str()).await? {
        // Every code of the pool will carry a check symbol: a redemption
        // may refuse a code that fails it before looking it up.
        store.set_check_symbols(pool.as_str(), true).await?;
        run.marked = true;
    }
    let before = run.held;
    if before > 0 {
        info!(run = %record.id, held = before, "the run holds codes already; making only the rest");
    }
    let result = run.until_done(options, on_progress).await;
    let result = run.counted(result, options, on_progress).await;
    let result = recalled_meanwhile(store, record.id, result).await?;
    let interrupted = matches!(result, Ok(false));
    if run.held > before {
        run.settle_pool().await;
    }
    let seconds = started.elapsed().as_secs_f64();
    record.status = match (&result, interrupted) {
        (Err(_), _) => RunState::Failed,
        (Ok(_), true) => RunState::Interrupted,
        (Ok(_), false) => RunState::Done,
    };
    record.finished_at = Some(bson::DateTime::now());
    (record.rows, record.inserted, record.duplicates) = (run.held, run.held, run.redrawn);
    record.seconds = seconds;
    record.error = result.as_ref().err().map(ToString::to_string);
    if let Err(e) = store.finish_import(record).await {
        warn!(error = %e, "could not write the generation run's record");
    }
    result?;
    Ok(((run.held, run.redrawn), before, seconds))
}

impl Draws<'_> {
    /// Every insert of the run has landed or failed (`until_done` drains
    /// them on every way out): the run holds what the pool holds of it,
    /// counted, not the sum of what its batches answered (a batch drained
    /// after an error was never added). A count short of what the batches
    /// answered makes the rest.
    async fn counted(
        &mut self,
        mut result: Result<bool, GenerateError>,
        options: &GenerateOptions,
        on_progress: &(dyn Fn(GenerateProgress) + Send + Sync),
    ) -> Result<bool, GenerateError> {
        for _ in 0..3 {
            match self.store.codes_of_run(self.pool, self.id).await {
                Ok(held) => {
                    if held != self.held {
                        warn!(run = %self.id, counted = held, answered = self.held, "the run's codes counted in the pool differ from what its inserts answered; the count is recorded");
                    }
                    self.held = held;
                }
                Err(e) => {
                    warn!(error = %e, "the run's codes were not counted again at its end");
                    break;
                }
            }
            if !matches!(result, Ok(true)) || self.held >= self.g.count {
                break;
            }
            result = self.until_done(options, on_progress).await;
        }
        result
    }
}

/// A run that lost its lease: a recall may have taken it while it
/// stalled, and once its inserts have landed, what landed after the
/// recall is voided too (the run's result says so). `Err` when another
/// process holds the run and writes its record.
async fn recalled_meanwhile(
    store: &Store,
    id: ObjectId,
    result: Result<bool, GenerateError>,
) -> Result<Result<bool, GenerateError>, GenerateError> {
    if !matches!(result, Err(GenerateError::LeaseLost(_))) {
        return Ok(result);
    }
    match store.import_record(id).await {
        Ok(Some(now)) if now.recalled_at.is_some() => {
            if let Err(e) = store.recall_rest(id).await {
                warn!(error = %e, "the run's late codes were not voided after its recall; recall it again");
            }
            Ok(Err(GenerateError::RecalledWhileRunning {
                id: id.to_hex(),
                reason: now.recall_reason.unwrap_or_default(),
            }))
        }
        Ok(_) => Err(result
            .err()
            .unwrap_or_else(|| GenerateError::LeaseLost(id.to_hex()))),
        Err(e) => {
            warn!(error = %e, "could not read whether the run was recalled");
            Ok(result)
        }
    }
}

/// Opens the record of run `g` (its id: `g.run_id`, or a new one), or
/// takes up the record of its id when it has the same pool, count and
/// pattern; any other record of that id is an error. Nothing else is
/// written: a door that answers before the codes are made calls this
/// first, so the run can be read at once.
pub async fn open_run(
    store: &Store,
    g: &Generation,
) -> Result<(Pool, ImportRecord), GenerateError> {
    let pool = Pool::new(&g.pool)?;
    if !(1..=MAX_COUNT).contains(&g.count) {
        return Err(GenerateError::Count(g.count));
    }
    if let Some(t) = g.expires_at.filter(|t| *t <= chrono::Utc::now()) {
        return Err(GenerateError::ExpiredAtBirth(t.to_rfc3339()));
    }
    let id = g.run_id.unwrap_or_default();
    let spec = g.spec();
    let record = store
        .start_generation(id, pool.as_str(), spec.clone())
        .await?;
    let other = |why: String| GenerateError::OtherRun {
        id: id.to_hex(),
        why,
    };
    if record.source.as_deref() != Some(SOURCE_GENERATED) {
        return Err(other(format!("is the import of {:?}", record.file)));
    }
    if record.pool != pool.as_str() {
        return Err(other(format!("generates into pool {:?}", record.pool)));
    }
    if let Some(was) = record.generation.as_ref().filter(|was| **was != spec) {
        return Err(other(format!(
            "makes {} codes of {:?}",
            was.count, was.pattern
        )));
    }
    if let Some(e) = GenerateError::recalled(&record) {
        return Err(e);
    }
    if record.status != RunState::Running {
        store.restart_generation(id).await?;
    }
    Ok((pool, record))
}

/// The newest unfinished run (not done, not recalled) into `g`'s pool of
/// the same pattern, count, check symbol and expiry: what `codepool
/// generate` without `--run-id` takes up, as an import takes up the
/// unfinished run of its file, instead of making a second full run.
pub async fn unfinished_run(
    store: &Store,
    g: &Generation,
) -> Result<Option<ImportRecord>, GenerateError> {
    let pool = Pool::new(&g.pool)?;
    let spec = g.spec();
    let runs = store
        .unfinished_generations(pool.as_str(), &spec.pattern)
        .await?;
    Ok(runs
        .into_iter()
        .find(|r| r.generation.as_ref() == Some(&spec) && r.recalled_at.is_none()))
}

/// The drawing of one run.
struct Draws<'a> {
    store: &'a Store,
    numbers: Option<&'a DailyNumbers>,
    g: &'a Generation,
    pool: &'a str,
    id: ObjectId,
    /// Codes of the run in the pool (counted, then kept exact).
    held: u64,
    redrawn: u64,
    saved: Instant,
    /// The pool's `check_symbols` says what this run's codes are: set
    /// before the first code of a run with check symbols into an empty
    /// pool, cleared after the first code of any other run.
    marked: bool,
    /// This process's claim on the run ([`take_lease`]), renewed before
    /// a batch at most every [`RENEW_EVERY`], as an import's is.
    owner: &'a str,
    renewed: Instant,
}

impl Draws<'_> {
    /// Draws and inserts batches until the run holds its count (true) or
    /// a stop (false). Up to `options.in_flight` batches are sealed and
    /// written at once, and together they never ask for more than the run
    /// lacks: every code that lands is counted, so the run never exceeds
    /// its count. When an insert fails, the others in flight are waited
    /// for and the run's codes are counted again from the pool before
    /// going on, so a retry never counts one twice.
    async fn until_done(
        &mut self,
        options: &GenerateOptions,
        on_progress: &(dyn Fn(GenerateProgress) + Send + Sync),
    ) -> Result<bool, GenerateError> {
        let mut inflight: JoinSet<(u64, Result<u64, StoreError>)> = JoinSet::new();
        let mut asked = 0u64;
        let (mut fruitless, mut attempt) = (0u32, 0u32);
        loop {
            while inflight.len() < options.in_flight.max(1)
                && self.held + asked < self.g.count
                && !options.stop.is_cancelled()
            {
                let started = self
                    .start_batch(options, self.g.count - self.held - asked)
                    .await;
                let (want, batch) = match started {
                    Ok(b) => b,
                    Err(e) => return Err(drained(&mut inflight, e).await),
                };
                let (store, pool, id) = (self.store.clone(), self.pool.to_owned(), self.id);
                inflight.spawn(async move { (want, try_place(&store, &pool, id, &batch).await) });
                asked += want;
            }
            let Some(done) = inflight.join_next().await else {
                return Ok(self.held >= self.g.count);
            };
            let (want, placed) = match done {
                Ok(done) => done,
                Err(e) => {
                    let e = StoreError::Rejected(format!("an insert of the run stopped: {e}"));
                    return Err(drained(&mut inflight, e.into()).await);
                }
            };
            asked -= want;
            match placed {
                Ok(placed) => {
                    self.held += placed;
                    self.redrawn += want - placed;
                    if let Err(e) = self.mark_pool(placed).await {
                        return Err(drained(&mut inflight, e.into()).await);
                    }
                    fruitless = if placed == 0 { fruitless + 1 } else { 0 };
                }
                Err(e) if e.is_unavailable() && attempt < RETRIES => {
                    attempt += 1;
                    warn!(error = %e, attempt, "generation insert failed; retrying");
                    while inflight.join_next().await.is_some() {}
                    asked = 0;
                    tokio::time::sleep(BACKOFF * 2u32.pow(attempt)).await;
                    // What landed is counted, never guessed.
                    let held = self.store.codes_of_run(self.pool, self.id).await?;
                    self.redrawn += want.saturating_sub(held.saturating_sub(self.held));
                    self.held = held;
                }
                Err(e) => return Err(drained(&mut inflight, e.into()).await),
            }
            if fruitless >= FRUITLESS_BATCHES {
                return Err(drained(&mut inflight, GenerateError::Exhausted(self.redrawn)).await);
            }
            on_progress(GenerateProgress {
                count: self.g.count,
                inserted: self.held,
                redrawn: self.redrawn,
            });
            self.save_progress().await;
        }
    }

    /// The next batch, once the lease is renewed: at most `lacking` codes.
    async fn start_batch(
        &mut self,
        options: &GenerateOptions,
        lacking: u64,
    ) -> Result<(u64, Vec<NewCode>), GenerateError> {
        if self.renewed.elapsed() >= RENEW_EVERY {
            if !self.store.renew_run(self.id, self.owner, LEASE).await? {
                return Err(GenerateError::LeaseLost(self.id.to_hex()));
            }
            self.renewed = Instant::now();
        }
        let want = lacking.min(options.batch_size.max(1) as u64);
        Ok((want, self.draw(want as usize, &options.random).await?))
    }

    /// `n` new codes, distinct among themselves.
    async fn draw(&self, n: usize, random: &ByteSource) -> Result<Vec<NewCode>, GenerateError> {
        let numbers = match (self.g.pattern.has_number(), self.numbers) {
            (true, Some(daily)) => daily.next_n(self.pool, n as u32).await?,
            _ => Vec::new(),
        };
        let width = self.g.pattern.random_symbols();
        let mut bytes = vec![0u8; width * n];
        random.fill(&mut bytes)?;
        let mut seen = std::collections::HashSet::with_capacity(n);
        let mut codes = Vec::with_capacity(n);
        for i in 0..n {
            let number = numbers.get(i).map(|d| &d[self.pool.len().min(d.len())..]);
            let code = self
                .g
                .pattern
                .render(&bytes[i * width..(i + 1) * width], number);
            if seen.insert(code.clone()) {
                codes.push(NewCode {
                    code,
                    expires_at: self.g.expires_at,
                    line: None,
                });
            }
        }
        Ok(codes)
    }

    /// After codes landed: the pool exists, and its `pool.exhausted` alert
    /// may fire again (best effort, as after an import).
    async fn settle_pool(&self) {
        if let Err(e) = self.store.ensure_pool(self.pool).await {
            warn!(error = %e, "the pool's record was not created; `codepool pool create` makes it");
        }
        if let Err(e) = self.store.rearm_exhausted_alerts(&[self.pool]).await {
            warn!(error = %e, "pool.exhausted not re-armed; the next import re-arms it");
        }
    }

    /// After the first codes of a run without check symbols landed: the
    /// pool no longer promises one on every code.
    async fn mark_pool(&mut self, placed: u64) -> Result<(), StoreError> {
        if placed > 0 && !self.marked && !self.g.pattern.has_check() {
            self.store.set_check_symbols(self.pool, false).await?;
            self.marked = true;
        }
        Ok(())
    }

    /// The counts so far on the run's record, at most once a second.
    async fn save_progress(&mut self) {
        if self.saved.elapsed() < PROGRESS_EVERY {
            return;
        }
        self.saved = Instant::now();
        let counts = (self.held, self.redrawn, 0);
        if let Err(e) = self.store.import_progress(self.id, counts).await {
            warn!(error = %e, "could not record the run's progress");
        }
    }
}

/// Claims the codes of `batch` for `pool` and inserts those no other
/// pool holds (a look-alike of another pool's code included); returns
/// how many landed. The rest is drawn again by a later batch.
async fn try_place(
    store: &Store,
    pool: &str,
    id: ObjectId,
    batch: &[NewCode],
) -> Result<u64, StoreError> {
    let elsewhere = store
        .claim_codes(pool, id, batch, CrossPool::Strict)
        .await?;
    let mut fresh: Vec<NewCode> = (batch.iter().zip(&elsewhere))
        .filter(|(_, other)| other.is_none())
        .map(|(c, _)| c.clone())
        .collect();
    if !store.claims_complete().await? {
        // Codes stored before claims have none yet: their exact copies
        // are found by value.
        let old = store.codes_in_other_pools(pool, &fresh).await?;
        fresh = (fresh.into_iter().zip(old))
            .filter(|(_, other)| other.is_none())
            .map(|(c, _)| c)
            .collect();
    }
    Ok(store.insert_claimed(pool, id, &fresh).await?.inserted)
}

/// `e`, once every insert still in flight has landed or failed: a run
/// never ends with a write of its own still going.
async fn drained<T: 'static>(inflight: &mut JoinSet<T>, e: GenerateError) -> GenerateError {
    while inflight.join_next().await.is_some() {}
    e
}
