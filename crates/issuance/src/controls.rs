//! Operator controls over a whole pool or delivery: pause and resume a
//! pool (`codepool pool pause|resume`), and recall an import (`codepool
//! void --import`). The CLI parses flags and prints; the rules are here.

use std::collections::BTreeMap;

use codepool_broker::{BrokerError, Publisher};
use codepool_domain::{Code, CodeId, PoolEvent, PoolEventKind};
use codepool_store::imports::ImportRecord;
use codepool_store::pool_settings::PoolSettingsError;
use codepool_store::{ObjectId, Store, StoreError};
use tracing::{debug, info, warn};

use crate::audit::{self, Actor, AuditKind};
use crate::ops::{checked_reason, MAX_REASON_CHARS};
use crate::ports::CandidatePool;

/// Codes voided per round of a recall.
const RECALL_ROUND: i64 = 1000;

#[derive(Debug, thiserror::Error)]
pub enum PauseError {
    #[error(transparent)]
    Pool(#[from] PoolSettingsError),
    #[error("the pool is changed, but the change was not audited: {0}")]
    Audit(#[from] StoreError),
    #[error("the pool is {state} in MongoDB, but RabbitMQ did not confirm the {event} event ({source}); run the command again so dispatchers hear it")]
    Unconfirmed {
        state: &'static str,
        event: &'static str,
        #[source]
        source: BrokerError,
    },
}

/// Pauses (`true`) or resumes (`false`) a pool and announces it with
/// `pool.paused` / `pool.resumed`. The event goes out even when the state
/// did not change, so running the command again repairs a lost event
/// (dispatchers fulfil a resumed pool's backorders when they hear it, and
/// their sweep does within seconds anyway). Returns whether it changed.
pub async fn set_paused(
    store: &Store,
    publisher: &Publisher,
    pool: &str,
    paused: bool,
    actor: &Actor,
) -> Result<bool, PauseError> {
    let changed = store.set_paused(pool, paused).await?;
    // Audited as soon as the state changed, whether or not the event is
    // confirmed below.
    let (kind, state) = if paused {
        (PoolEventKind::Paused, "paused")
    } else {
        (PoolEventKind::Resumed, "resumed")
    };
    let what = format!(
        "pool {pool:?} {state}{}",
        if changed { "" } else { " (it already was)" }
    );
    audit::record(
        store,
        actor,
        if paused {
            AuditKind::Pause
        } else {
            AuditKind::Resume
        },
        what,
    )
    .await?;
    let unconfirmed = |source| PauseError::Unconfirmed {
        state,
        event: kind.routing_key(),
        source,
    };
    publisher
        .publish_pool_event(&PoolEvent::new(kind, pool))
        .await
        .map_err(unconfirmed)?
        .wait()
        .await
        .map_err(unconfirmed)?;
    info!(pool, changed, "pool {state}");
    Ok(changed)
}

#[derive(Debug, thiserror::Error)]
pub enum RecallError {
    #[error("the reason must say why in 1 to {MAX_REASON_CHARS} characters of plain visible text (no control or bidi characters), e.g. --reason leaked")]
    Reason,
    #[error("{0:?} is not an import id; `codepool import --json` prints it as import_id (24 hexadecimal digits)")]
    BadId(String),
    #[error("no import {0}; check the id `codepool import --json` printed")]
    UnknownImport(String),
    #[error("run {0} (an import or a generation) is still inserting codes; nothing was voided. Wait for it to end (or stop it with Ctrl-C), then recall it: a recall now would miss the codes it inserts next. A run whose process died holds it off for 20 s at most")]
    Running(String),
    /// The run (and the runs linked to it) hold no code, but other runs
    /// of a file of that name in the pool do: they were not recalled.
    #[error("import {import} ({file} into pool {pool}) and the runs linked to it hold no code, so nothing was voided; other runs of {file} in pool {pool} hold codes: {}; recall those by their id", others.iter().map(|(id, n)| format!("{id} ({n} code(s))")).collect::<Vec<_>>().join(", "))]
    NothingRecalled {
        import: String,
        file: String,
        pool: String,
        /// The runs holding codes, with how many.
        others: Vec<(String, u64)>,
    },
    #[error("import {import} ({file} into pool {pool}) and the runs linked to it hold no code; nothing to recall")]
    Empty {
        import: String,
        file: String,
        pool: String,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// One run of the recalled file, and what the recall did to it.
#[derive(Debug, Clone)]
pub struct RecalledRun {
    pub id: ObjectId,
    /// The run's status in `imports` (`done`, `interrupted`, `running` …).
    pub status: codepool_store::imports::RunState,
    /// Codes the run put in (any status now).
    pub codes: u64,
    /// Unissued codes of the run voided by this recall.
    pub voided: u64,
}

/// What a recall did.
#[derive(Debug)]
pub struct Recall {
    /// The run named by the operator.
    pub import: ImportRecord,
    /// Every run of the same file into the same pool the recall covered
    /// (linked by `resumed_from` or by the file's sha256), oldest first.
    pub runs: Vec<RecalledRun>,
    /// Unissued codes voided by this run.
    pub voided: u64,
    /// Codes buyers already hold (issued or used), left alone: contact them.
    pub held: Vec<Code>,
    /// Runs of a file of the same name in the pool that the recall could
    /// not prove to be of another file (no hash: they never finished) and
    /// not chained to the named run, with the codes each holds: left
    /// alone, for the operator to recall by their own id.
    pub left: Vec<(ObjectId, u64)>,
}

/// Voids every still-unissued code of an import, each by the conditional
/// update on its status, so a concurrent claim either got the code first
/// (it is listed in `held`) or finds it void. The recall covers the whole
/// file in that pool: every run linked to the named one by `resumed_from`
/// or by the same sha256 (an interrupted run, the run that finished it, a
/// later re-import that inserted nothing). The voided codes leave the hot
/// pool (best effort: claims refuse them anyway).
pub async fn recall_import(
    store: &Store,
    hot: &dyn CandidatePool,
    import_id: &str,
    reason: &str,
    actor: &Actor,
) -> Result<Recall, RecallError> {
    let reason = checked_reason(reason).ok_or(RecallError::Reason)?;
    let id = ObjectId::parse_str(import_id.trim())
        .map_err(|_| RecallError::BadId(import_id.chars().take(40).collect()))?;
    let import = store
        .import_record(id)
        .await?
        .ok_or_else(|| RecallError::UnknownImport(id.to_hex()))?;
    let of_file = store.runs_of_file(&import).await?;
    // The recall holds every run of the file while it voids: a run still
    // inserting (an import, a generation) refuses it, and one that renews
    // its lease after this stops instead of inserting into a recalled run.
    let owner = format!("recall:{}", ObjectId::new().to_hex());
    let mut taken = Vec::new();
    let mut busy = None;
    for run in &of_file {
        match store
            .take_run(run.id, &owner, codepool_importer::LEASE)
            .await
        {
            Ok(None) => taken.push(run.id),
            Ok(Some(_)) => busy = Some(Err(RecallError::Running(run.id.to_hex()))),
            Err(e) => busy = Some(Err(e.into())),
        }
        if busy.is_some() {
            break;
        }
    }
    let result = match busy {
        Some(refused) => refused,
        None => recall_runs(store, hot, import, of_file, reason, actor).await,
    };
    for id in taken {
        if let Err(e) = store.release_run(id, &owner).await {
            warn!(error = %e, run = %id, "the recall's hold on the run was not given up; it lapses on its own");
        }
    }
    result
}

/// The recall of `of_file`, the runs of `import`'s file, once held.
async fn recall_runs(
    store: &Store,
    hot: &dyn CandidatePool,
    import: ImportRecord,
    of_file: Vec<ImportRecord>,
    reason: &str,
    actor: &Actor,
) -> Result<Recall, RecallError> {
    let id = import.id;
    let mut runs = Vec::new();
    let mut held = Vec::new();
    for run in of_file {
        let voided = recall_run(store, hot, run.id, reason).await?;
        let codes = store.codes_of_import(run.id).await?;
        held.extend(store.held_codes_of_import(run.id).await?);
        runs.push(RecalledRun {
            id: run.id,
            status: run.status,
            codes,
            voided,
        });
    }
    if runs.iter().all(|r| r.codes == 0) {
        return Err(nothing_recalled(store, &import, &runs).await);
    }
    held.sort_by_key(|c| c.holder.as_ref().map(|h| h.issued_at));
    let left = unproven_runs(store, &import, &runs).await?;
    let voided = runs.iter().map(|r| r.voided).sum();
    info!(import_id = %id, pool = %import.pool, runs = runs.len(), voided, held = held.len(), "import recalled");
    let what = format!(
        "import {} of pool {:?} ({} run(s) of the file): {voided} voided, {} held by buyers; reason {reason:?}",
        id.to_hex(),
        import.pool,
        runs.len(),
        held.len()
    );
    audit::record(store, actor, AuditKind::Recall, what).await?;
    Ok(Recall {
        import,
        runs,
        voided,
        held,
        left,
    })
}

/// The runs of a file of the same name in the pool, outside `runs`, that
/// hold codes and carry no hash (they never finished, so nothing proves
/// they are another file).
async fn unproven_runs(
    store: &Store,
    import: &ImportRecord,
    runs: &[RecalledRun],
) -> Result<Vec<(ObjectId, u64)>, StoreError> {
    let covered: Vec<ObjectId> = runs.iter().map(|r| r.id).collect();
    let mut left = Vec::new();
    for run in store
        .runs_named(&import.pool, &import.file, &covered)
        .await?
    {
        if run.sha256.as_deref().is_some_and(|h| !h.is_empty()) {
            continue;
        }
        let n = store.codes_of_import(run.id).await?;
        if n > 0 {
            left.push((run.id, n));
        }
    }
    Ok(left)
}

/// Voids the unissued codes of one run, in rounds; notes it on its record.
async fn recall_run(
    store: &Store,
    hot: &dyn CandidatePool,
    id: ObjectId,
    reason: &str,
) -> Result<u64, StoreError> {
    let (mut voided, mut after) = (0, None);
    loop {
        let round = store.recall_round(id, reason, RECALL_ROUND, after).await?;
        voided += round.voided;
        drop_candidates(hot, round.seen).await;
        after = round.next;
        if after.is_none() {
            break;
        }
    }
    store.mark_import_recalled(id, reason, voided).await?;
    Ok(voided)
}

/// The error of a recall whose runs hold no code: it names the other runs
/// of a file of that name in the pool that do.
async fn nothing_recalled(
    store: &Store,
    import: &ImportRecord,
    runs: &[RecalledRun],
) -> RecallError {
    let covered: Vec<ObjectId> = runs.iter().map(|r| r.id).collect();
    let mut others = Vec::new();
    match store.runs_named(&import.pool, &import.file, &covered).await {
        Ok(named) => {
            for run in named {
                match store.codes_of_import(run.id).await {
                    Ok(0) => {}
                    Ok(n) => others.push((run.id.to_hex(), n)),
                    Err(e) => return e.into(),
                }
            }
        }
        Err(e) => return e.into(),
    }
    let (import, file, pool) = (import.id.to_hex(), import.file.clone(), import.pool.clone());
    if others.is_empty() {
        return RecallError::Empty { import, file, pool };
    }
    RecallError::NothingRecalled {
        import,
        file,
        pool,
        others,
    }
}

async fn drop_candidates(hot: &dyn CandidatePool, seen: Vec<(String, CodeId)>) {
    let mut by_pool: BTreeMap<String, Vec<CodeId>> = BTreeMap::new();
    for (pool, id) in seen {
        by_pool.entry(pool).or_default().push(id);
    }
    for (pool, ids) in by_pool {
        if let Err(e) = hot.remove(&pool, &ids).await {
            debug!(pool, error = %e, "recalled codes stay hot-pool candidates until Redis is back; claims refuse them");
        }
    }
}

/// Changes a pool's settings, audited with `actor` (`what` says the
/// change in the door's own words, e.g. `low_stock=500`).
pub async fn set_pool_settings(
    store: &Store,
    pool: &str,
    settings: &codepool_store::pool_settings::PoolSettings,
    what: &str,
    actor: &Actor,
) -> Result<(), PauseError> {
    store.set_pool_settings(pool, settings).await?;
    let what = format!("pool {pool:?}: {what}");
    audit::record(store, actor, AuditKind::PoolSettings, what).await?;
    Ok(())
}

/// Creates a pool, audited with `actor`. Returns whether it is new.
pub async fn create_pool(store: &Store, pool: &str, actor: &Actor) -> Result<bool, StoreError> {
    let created = store.create_pool(pool).await?;
    let what = format!(
        "pool {pool:?} {}",
        if created {
            "created"
        } else {
            "already existed"
        }
    );
    audit::record(store, actor, AuditKind::PoolCreate, what).await?;
    Ok(created)
}

#[derive(Debug, thiserror::Error)]
pub enum ImportedError {
    #[error("the codes are imported, but the import was not audited: {0}")]
    Audit(#[from] StoreError),
    #[error("the codes are imported, but RabbitMQ did not confirm pool.replenished ({0}); dispatchers fulfil backorders at their next sweep")]
    Announce(#[from] BrokerError),
}

/// Announces that `inserted` new codes arrived in `pool` (`pool.replenished`),
/// confirmed, so dispatchers fulfil its backorders now rather than at their
/// next sweep, and records the shops' `pool.replenished` webhooks. Nothing
/// is announced for no new code.
pub async fn announce_replenished(
    store: &Store,
    publisher: &Publisher,
    pool: &str,
    inserted: u64,
) -> Result<(), BrokerError> {
    if inserted == 0 {
        return Ok(());
    }
    let mut event = PoolEvent::new(PoolEventKind::Replenished, pool);
    event.inserted = Some(inserted);
    crate::webhooks::record_pool_event(store, &event, &event.at).await;
    publisher.publish_pool_event(&event).await?.wait().await?;
    info!(pool, inserted, "published pool.replenished");
    Ok(())
}

#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error(transparent)]
    Broker(#[from] BrokerError),
    #[error("the dead letters were replayed, but the replay was not audited: {0}")]
    Audit(#[from] StoreError),
}

/// Sends dead letters (those whose reason starts with `reason`) back to
/// the purchases queue (see [`codepool_broker::dead_letters::replay`]),
/// each as the broker user that first published it (the record of
/// `operators` only), audited with `actor`. Returns what was replayed.
pub async fn replay_dead_letters(
    store: &Store,
    conn: &lapin::Connection,
    publisher: &Publisher,
    reason: Option<&str>,
    limit: usize,
    operators: &[String],
    actor: &Actor,
) -> Result<codepool_broker::dead_letters::Replayed, ReplayError> {
    let topology = publisher.topology();
    let sent =
        codepool_broker::dead_letters::replay(conn, publisher, topology, reason, limit, operators)
            .await?;
    let what = format!(
        "{} dead letter(s) replayed (reason filter {reason:?})",
        sent.len()
    );
    audit::record(store, actor, AuditKind::DeadLetterReplay, what).await?;
    Ok(sent)
}
