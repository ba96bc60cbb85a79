//! The `imports` collection: one audit record per import run, so an
//! operator can answer "which file did these codes come from, and what
//! happened to its rows?".

use bson::oid::ObjectId;
use bson::{doc, DateTime};
use futures::TryStreamExt;
use serde::{Deserialize, Serialize};

use crate::{Store, StoreError};

pub const IMPORTS: &str = "imports";

/// An import run's state, stored by name: running, then ended once (a
/// rerun of an unfinished run's id makes it running again).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RunState {
    /// A process is making its codes, or was until it died.
    Running,
    /// Every row was read (every code made).
    Done,
    /// Stopped by an error.
    Failed,
    /// Stopped by the operator (Ctrl-C, SIGTERM).
    Interrupted,
}

impl RunState {
    /// The name stored and shown.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Done => "done",
            Self::Failed => "failed",
            Self::Interrupted => "interrupted",
        }
    }
}

impl std::fmt::Display for RunState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One import run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ImportRecord {
    #[serde(rename = "_id")]
    pub id: ObjectId,
    pub pool: String,
    pub file: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    pub status: RunState,
    pub started_at: DateTime,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<DateTime>,
    #[serde(default)]
    pub rows: u64,
    #[serde(default)]
    pub inserted: u64,
    #[serde(default)]
    pub duplicates: u64,
    #[serde(default)]
    pub invalid: u64,
    #[serde(default)]
    pub seconds: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The unfinished run of the same file and pool this run completes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed_from: Option<ObjectId>,
    /// Where the codes came from: absent for a file, [`SOURCE_GENERATED`]
    /// for a generation run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// What a generation run was asked for (a file's run has none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<GenerationSpec>,
    /// Until when a process holds the run to make its codes
    /// ([`Store::take_run`]); read only (the lease is written apart).
    #[serde(default, skip_serializing)]
    pub lease_until: Option<DateTime>,
    /// When and why the run was recalled ([`Store::mark_import_recalled`]);
    /// read only (the recall writes them apart).
    #[serde(default, skip_serializing)]
    pub recalled_at: Option<DateTime>,
    #[serde(default, skip_serializing)]
    pub recall_reason: Option<String>,
}

/// The fields of [`ImportRecord`] left out when empty: a finished record
/// without one has none.
const OPTIONAL_FIELDS: &[&str] = &[
    "sha256",
    "finished_at",
    "error",
    "resumed_from",
    "source",
    "generation",
];

impl ImportRecord {
    /// The run's state as a person reads it: its status, but `killed` for
    /// a run that says `running` while no process holds it (its process
    /// was killed, or stalled past its lease): it never finished, and
    /// nothing is making it. The same command again finishes it.
    pub fn state(&self) -> String {
        if self.status == RunState::Running && !self.being_made() {
            return KILLED.to_owned();
        }
        self.status.to_string()
    }

    /// A process is making this run's codes now (it holds a live lease).
    pub fn being_made(&self) -> bool {
        self.status == RunState::Running && self.lease_until.is_some_and(|t| t > DateTime::now())
    }
}

/// The `source` of a generation run's record.
pub const SOURCE_GENERATED: &str = "generated";

/// [`ImportRecord::state`] of a run whose process died before it ended.
pub const KILLED: &str = "killed";

/// What a generation run makes: `count` codes of `pattern`. Saved with the
/// run, so that running the same id again makes the rest of the same codes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerationSpec {
    /// The pattern, `{check}` written out when the codes carry one.
    pub pattern: String,
    pub count: u64,
    /// Whether the codes end with a Crockford check symbol.
    #[serde(default)]
    pub check_char: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<DateTime>,
}

impl ImportRecord {
    /// A run of `file` into `pool` starting now, with nothing done yet.
    pub fn running(id: ObjectId, pool: &str, file: &str) -> Self {
        ImportRecord {
            id,
            pool: pool.into(),
            file: file.into(),
            sha256: None,
            status: RunState::Running,
            started_at: DateTime::now(),
            finished_at: None,
            rows: 0,
            inserted: 0,
            duplicates: 0,
            invalid: 0,
            seconds: 0.0,
            error: None,
            resumed_from: None,
            source: None,
            generation: None,
            lease_until: None,
            recalled_at: None,
            recall_reason: None,
        }
    }
}

impl Store {
    /// Opens the audit record of a run; the caller fills in the counts and
    /// closes it with [`Store::finish_import`]. `resumed_from` (the earlier
    /// run of the file that did not finish) is written now, with the
    /// record: a run killed before its end still chains the runs before it
    /// to the runs after it, so a recall finds every run of the file.
    pub async fn start_import(
        &self,
        pool: &str,
        file: &str,
        resumed_from: Option<ObjectId>,
    ) -> Result<ImportRecord, StoreError> {
        let record = ImportRecord {
            resumed_from,
            ..ImportRecord::running(ObjectId::new(), pool, file)
        };
        self.typed::<ImportRecord>(IMPORTS)
            .insert_one(&record)
            .write_concern(crate::durable())
            .await?;
        Ok(record)
    }

    /// Opens the record of generation run `id` (status `running`), or
    /// returns the record that has this id already: running the same id
    /// again continues that run.
    pub async fn start_generation(
        &self,
        id: ObjectId,
        pool: &str,
        spec: GenerationSpec,
    ) -> Result<ImportRecord, StoreError> {
        let record = ImportRecord {
            source: Some(SOURCE_GENERATED.into()),
            ..ImportRecord::running(id, pool, &format!("(generated {})", spec.pattern))
        };
        let record = ImportRecord {
            generation: Some(spec),
            ..record
        };
        let inserted = self
            .typed::<ImportRecord>(IMPORTS)
            .insert_one(&record)
            .write_concern(crate::durable())
            .await;
        match inserted {
            Ok(_) => Ok(record),
            Err(e) if crate::error::is_duplicate_key(&e) => {
                let found = self.import_record(id).await?;
                found.ok_or_else(|| StoreError::Rejected(format!("run {id} vanished")))
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Marks generation run `id` running again (a rerun of its id).
    pub async fn restart_generation(&self, id: ObjectId) -> Result<(), StoreError> {
        self.collection(IMPORTS)
            .update_one(
                doc! {"_id": id},
                doc! {"$set": {"status": RunState::Running.as_str()}, "$unset": {"finished_at": "", "error": ""}},
            )
            .await?;
        Ok(())
    }

    /// How many codes of `pool` import run `id` put there, counted on the
    /// `(batch_id, _id)` index.
    pub async fn codes_of_run(&self, pool: &str, id: ObjectId) -> Result<u64, StoreError> {
        Ok(self
            .collection(crate::collections::CODES)
            .count_documents(doc! {"batch_id": id, "pool": pool})
            .await?)
    }

    /// Closes the audit record with the run's counts.
    pub async fn finish_import(&self, record: &ImportRecord) -> Result<(), StoreError> {
        // Set, not replaced: what others wrote meanwhile (a recall's mark,
        // a lease) stays. A field the record lacks now is removed.
        let mut set = bson::to_document(record).map_err(|e| StoreError::Corrupt {
            collection: IMPORTS.into(),
            message: e.to_string(),
        })?;
        set.remove("_id");
        let mut unset = doc! {};
        for k in OPTIONAL_FIELDS {
            if !set.contains_key(*k) {
                unset.insert(*k, "");
            }
        }
        let mut update = doc! {"$set": set};
        if !unset.is_empty() {
            update.insert("$unset", unset);
        }
        self.collection(IMPORTS)
            .update_one(doc! {"_id": record.id}, update)
            .await?;
        Ok(())
    }

    /// Records a running import's counts so far: (inserted, duplicates,
    /// invalid).
    pub async fn import_progress(
        &self,
        id: ObjectId,
        (inserted, duplicates, invalid): (u64, u64, u64),
    ) -> Result<(), StoreError> {
        let n = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        self.collection(IMPORTS)
            .update_one(
                doc! {"_id": id, "status": RunState::Running.as_str()},
                doc! {"$set": {"inserted": n(inserted), "duplicates": n(duplicates), "invalid": n(invalid)}},
            )
            .await?;
        Ok(())
    }

    /// The newest run of `file` into `pool`, when it did not finish: it
    /// failed, was interrupted, or still says `running` because its
    /// process was killed.
    pub async fn unfinished_import(
        &self,
        pool: &str,
        file: &str,
    ) -> Result<Option<ImportRecord>, StoreError> {
        let newest = self
            .typed::<ImportRecord>(IMPORTS)
            .find_one(doc! {"pool": pool, "file": file})
            .sort(doc! {"started_at": -1})
            .await?;
        Ok(newest.filter(|r| r.status != RunState::Done))
    }

    /// The generation runs of `pattern` into `pool` that did not finish
    /// (failed, interrupted, or `running` because their process was
    /// killed or is still making them), newest first, by the `(pool,
    /// started_at)` index.
    pub async fn unfinished_generations(
        &self,
        pool: &str,
        pattern: &str,
    ) -> Result<Vec<ImportRecord>, StoreError> {
        Ok(self
            .typed::<ImportRecord>(IMPORTS)
            .find(doc! {
                "pool": pool,
                "source": SOURCE_GENERATED,
                "generation.pattern": pattern,
                "status": {"$ne": RunState::Done.as_str()},
            })
            .sort(doc! {"started_at": -1})
            .limit(100)
            .await?
            .try_collect()
            .await?)
    }

    /// The most recent runs, newest first.
    pub async fn recent_imports(&self, limit: i64) -> Result<Vec<ImportRecord>, StoreError> {
        Ok(self
            .typed::<ImportRecord>(IMPORTS)
            .find(doc! {})
            .sort(doc! {"started_at": -1})
            .limit(limit)
            .await?
            .try_collect()
            .await?)
    }

    /// A pool's runs, newest first, by the `(pool, started_at)` index.
    pub async fn imports_of(
        &self,
        pool: &str,
        limit: i64,
    ) -> Result<Vec<ImportRecord>, StoreError> {
        Ok(self
            .typed::<ImportRecord>(IMPORTS)
            .find(doc! {"pool": pool})
            .sort(doc! {"started_at": -1})
            .limit(limit)
            .await?
            .try_collect()
            .await?)
    }
}

impl Store {
    /// Every run of the same file into the same pool as `run`, `run`
    /// included, oldest first: runs with the same sha256 in the pool, and
    /// runs linked to those by `resumed_from` (an interrupted or killed run
    /// has no sha256; the run that finished it names it). A file has few
    /// runs, so the walk takes a few small queries on the pool's runs.
    pub async fn runs_of_file(&self, run: &ImportRecord) -> Result<Vec<ImportRecord>, StoreError> {
        let mut runs = vec![run.clone()];
        loop {
            let ids: Vec<ObjectId> = runs.iter().map(|r| r.id).collect();
            let earlier: Vec<ObjectId> = runs.iter().filter_map(|r| r.resumed_from).collect();
            let hashes: Vec<String> = runs.iter().filter_map(|r| r.sha256.clone()).collect();
            let linked: Vec<ImportRecord> = self
                .typed::<ImportRecord>(IMPORTS)
                .find(doc! {
                    "pool": &run.pool,
                    "_id": {"$nin": &ids},
                    "$or": [
                        {"sha256": {"$in": hashes}},
                        {"resumed_from": {"$in": &ids}},
                        {"_id": {"$in": earlier}},
                    ],
                })
                .await?
                .try_collect()
                .await?;
            if linked.is_empty() {
                break;
            }
            runs.extend(linked);
        }
        runs.sort_by_key(|r| (r.started_at, r.id));
        Ok(runs)
    }

    /// The other runs of `file` in `pool` (same name, not in `except`).
    pub async fn runs_named(
        &self,
        pool: &str,
        file: &str,
        except: &[ObjectId],
    ) -> Result<Vec<ImportRecord>, StoreError> {
        Ok(self
            .typed::<ImportRecord>(IMPORTS)
            .find(doc! {"pool": pool, "file": file, "_id": {"$nin": except}})
            .sort(doc! {"started_at": 1})
            .limit(100)
            .await?
            .try_collect()
            .await?)
    }
}

/// Who makes a generation run's codes now: one process at a time, so the
/// same run id sent twice at once (a retried request, two commands) never
/// makes its count twice. The owner renews its lease as it goes; a lease
/// left by a process that died lapses, and the next run of the id takes it.
impl Store {
    /// Takes run `id` for `owner` until `lease` from now, when no one
    /// holds it (or `owner` does, or its holder's lease lapsed). `Ok(None)`
    /// when taken; else `Ok(Some(until))`, the holder's lease end.
    pub async fn take_run(
        &self,
        id: ObjectId,
        owner: &str,
        lease: std::time::Duration,
    ) -> Result<Option<DateTime>, StoreError> {
        let now = DateTime::now();
        let until = DateTime::from_millis(now.timestamp_millis() + lease.as_millis() as i64);
        let taken = self
            .collection(IMPORTS)
            .update_one(
                doc! {"_id": id, "$or": [
                    {"lease_owner": {"$exists": false}},
                    {"lease_owner": owner},
                    {"lease_until": {"$lt": now}},
                ]},
                doc! {"$set": {"lease_owner": owner, "lease_until": until}},
            )
            .write_concern(crate::durable())
            .await?;
        if taken.matched_count == 1 {
            return Ok(None);
        }
        let held = self
            .collection(IMPORTS)
            .find_one(doc! {"_id": id})
            .projection(doc! {"lease_until": 1})
            .await?;
        Ok(Some(
            held.and_then(|d| d.get_datetime("lease_until").ok().copied())
                .unwrap_or(now),
        ))
    }

    /// Renews `owner`'s lease on run `id` for `lease` from now; false when
    /// `owner` no longer holds it (another process, or a recall, took it
    /// over while this one stalled, even if that one gave it up since): the
    /// run must insert nothing more.
    pub async fn renew_run(
        &self,
        id: ObjectId,
        owner: &str,
        lease: std::time::Duration,
    ) -> Result<bool, StoreError> {
        let now = DateTime::now();
        let until = DateTime::from_millis(now.timestamp_millis() + lease.as_millis() as i64);
        let renewed = self
            .collection(IMPORTS)
            .update_one(
                doc! {"_id": id, "lease_owner": owner},
                doc! {"$set": {"lease_until": until}},
            )
            .write_concern(crate::durable())
            .await?;
        Ok(renewed.matched_count == 1)
    }

    /// Gives run `id` up, if `owner` holds it.
    pub async fn release_run(&self, id: ObjectId, owner: &str) -> Result<(), StoreError> {
        self.collection(IMPORTS)
            .update_one(
                doc! {"_id": id, "lease_owner": owner},
                doc! {"$unset": {"lease_owner": "", "lease_until": ""}},
            )
            .write_concern(crate::durable())
            .await?;
        Ok(())
    }
}
