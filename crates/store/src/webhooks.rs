//! Webhooks: a shop's endpoints (`webhook_endpoints`), the events owed to
//! them (`webhook_events`, the body sealed like a code), one delivery task
//! per event and endpoint (`webhook_tasks`, leased by the process that
//! delivers it) and one record per attempt (`webhook_attempts`, kept 30
//! days by a TTL index).
//!
//! Events and tasks have ids derived from what they announce, so writing
//! them again (after a crash, by a second process) changes nothing.

use bson::{doc, spec::BinarySubtype, Binary, Bson, DateTime, Document};
use futures::TryStreamExt;
use mongodb::options::ReturnDocument;
use serde::{Deserialize, Serialize};

use crate::error::duplicates_only;
// Leases, attempt records and task states are bookkeeping, not
// decisions: one lost in a crash means one more delivery of an event,
// which receivers drop by its `webhook-id`. So they are written
// `bookkeeping()`; events and tasks themselves are written `durable()`
// before the grant flags are removed.
use crate::{bookkeeping, durable, Store, StoreError};

pub const ENDPOINTS: &str = "webhook_endpoints";
pub const EVENTS: &str = "webhook_events";
pub const TASKS: &str = "webhook_tasks";
pub const ATTEMPTS: &str = "webhook_attempts";

/// A task's state, as stored (`state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskState {
    /// Due at `next_at`.
    Pending,
    /// A 2xx answer.
    Delivered,
    /// Every attempt of the schedule failed, or the endpoint answered 410.
    Failed,
    /// Its endpoint is disabled; enabling it makes the task due again.
    Held,
}

impl TaskState {
    pub fn as_str(self) -> &'static str {
        match self {
            TaskState::Pending => "pending",
            TaskState::Delivered => "delivered",
            TaskState::Failed => "failed",
            TaskState::Held => "held",
        }
    }
}

impl From<TaskState> for Bson {
    fn from(s: TaskState) -> Bson {
        Bson::String(s.as_str().to_owned())
    }
}

/// What one attempt came to, as recorded (`outcome`), shown to operators
/// and counted (`codepool_webhook_deliveries_total{outcome}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// A 2xx answer.
    Delivered,
    /// Any other answer, no answer, or no endpoint or event to send.
    Failed,
    /// 410 Gone: the endpoint is disabled.
    Gone,
    /// The address is not one deliveries may go to.
    Refused,
    /// The endpoint is disabled: not sent, the task waits.
    Held,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Delivered => "delivered",
            Outcome::Failed => "failed",
            Outcome::Gone => "gone",
            Outcome::Refused => "refused",
            Outcome::Held => "held",
        }
    }
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One signing secret of an endpoint, sealed at rest.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SecretDoc {
    pub key_id: String,
    pub sealed: Binary,
    pub created_at: DateTime,
    /// A rotated-out secret signs until then (both signatures are sent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retire_at: Option<DateTime>,
}

/// One endpoint of a shop.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EndpointDoc {
    #[serde(rename = "_id")]
    pub id: String,
    pub shop: String,
    pub url: String,
    /// The event types it receives, sorted.
    pub events: Vec<String>,
    pub enabled: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disabled_reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disabled_at: Option<DateTime>,
    /// Newest first.
    pub secrets: Vec<SecretDoc>,
    /// The first failed attempt since the last delivered one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failing_since: Option<DateTime>,
    pub created_at: DateTime,
}

impl EndpointDoc {
    pub fn wants(&self, kind: &str) -> bool {
        self.events.iter().any(|e| e == kind)
    }
}

/// An event to record: its id, the shop it is for, its type and its body
/// (JSON, sealed before it is written).
#[derive(Debug, Clone)]
pub struct NewEvent {
    pub id: String,
    pub shop: String,
    pub kind: String,
    pub body: String,
}

/// A recorded event, its body opened.
#[derive(Debug, Clone)]
pub struct Event {
    pub id: String,
    pub shop: String,
    pub kind: String,
    pub body: String,
    pub created_at: DateTime,
}

/// One delivery task: an event for an endpoint.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TaskDoc {
    #[serde(rename = "_id")]
    pub id: String,
    pub event: String,
    pub endpoint: String,
    pub shop: String,
    pub kind: String,
    pub state: TaskState,
    /// Attempts made so far.
    pub attempts: u32,
    pub next_at: DateTime,
    pub lease_until: DateTime,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_by: Option<String>,
    pub created_at: DateTime,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub done_at: Option<DateTime>,
}

/// An endpoint with pending tasks, and the first of them (the one due
/// first): the endpoint has a task due when `next_at` is past, and an
/// attempt in flight (somewhere) when `lease_until` is still ahead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    pub endpoint: String,
    pub next_at: DateTime,
    pub lease_until: DateTime,
}

/// One attempt of one task.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AttemptDoc {
    pub task: String,
    pub event: String,
    pub endpoint: String,
    pub shop: String,
    pub kind: String,
    /// 1 for the first attempt.
    pub attempt: u32,
    pub at: DateTime,
    pub outcome: Outcome,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u32>,
    pub latency_ms: u64,
    /// The first 1 KiB of the answer, or the error.
    pub response: String,
    /// The process that made it.
    pub by: String,
}

/// How a leased task ends its attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaskEnd {
    Delivered,
    /// Due again at this time.
    RetryAt(DateTime),
    Failed,
    Held,
}

/// A recorded event without its body: what a replay decides on.
#[derive(Debug, Clone, Deserialize)]
pub struct EventHead {
    #[serde(rename = "_id")]
    pub id: String,
    pub kind: String,
    pub created_at: DateTime,
}

/// Which events a replay sends again.
#[derive(Debug, Clone)]
pub enum ReplayScope {
    /// One event.
    Event(String),
    /// A shop's events since a time.
    Since(DateTime),
}

fn event_aad(id: &str) -> Vec<u8> {
    format!("webhook-event:{id}").into_bytes()
}

fn secret_aad(endpoint: &str) -> Vec<u8> {
    format!("webhook-secret:{endpoint}").into_bytes()
}

fn task_id(event: &str, endpoint: &str) -> String {
    format!("{event}/{endpoint}")
}

fn binary(bytes: Vec<u8>) -> Binary {
    Binary {
        subtype: BinarySubtype::Generic,
        bytes,
    }
}

/// A task of `event` for `endpoint`: due now, or held while the endpoint
/// is disabled (enabling it makes the task due).
fn new_task(event: &str, endpoint: &EndpointDoc, kind: &str, now: DateTime) -> Document {
    let state = if endpoint.enabled {
        TaskState::Pending
    } else {
        TaskState::Held
    };
    doc! {
        "_id": task_id(event, &endpoint.id), "event": event, "endpoint": &endpoint.id,
        "shop": &endpoint.shop, "kind": kind, "state": state, "attempts": 0,
        "next_at": now, "lease_until": DateTime::from_millis(0), "created_at": now,
    }
}

impl Store {
    /// Inserts `docs` unordered; documents already there (same `_id`) are
    /// skipped. Returns how many were new.
    async fn insert_new(&self, collection: &str, docs: Vec<Document>) -> Result<u64, StoreError> {
        let total = docs.len() as u64;
        if total == 0 {
            return Ok(0);
        }
        match self
            .collection(collection)
            .insert_many(docs)
            .ordered(false)
            .write_concern(durable())
            .await
        {
            Ok(r) => Ok(r.inserted_ids.len() as u64),
            Err(e) => Ok(total - duplicates_only(e)?.len() as u64),
        }
    }

    /// Adds an endpoint with its first secret (plaintext here, sealed at
    /// rest).
    pub async fn add_webhook_endpoint(
        &self,
        id: &str,
        shop: &str,
        url: &str,
        events: &[String],
        secret: &str,
    ) -> Result<EndpointDoc, StoreError> {
        let ring = self.keys.ring()?;
        let sealed = ring.seal(&secret_aad(id), secret);
        let now = DateTime::now();
        let endpoint = EndpointDoc {
            id: id.to_owned(),
            shop: shop.to_owned(),
            url: url.to_owned(),
            events: events.to_vec(),
            enabled: true,
            disabled_reason: None,
            disabled_at: None,
            secrets: vec![SecretDoc {
                key_id: sealed.key_id,
                sealed: binary(sealed.bytes),
                created_at: now,
                retire_at: None,
            }],
            failing_since: None,
            created_at: now,
        };
        self.typed::<EndpointDoc>(ENDPOINTS)
            .insert_one(&endpoint)
            .write_concern(durable())
            .await?;
        Ok(endpoint)
    }

    /// One endpoint.
    pub async fn webhook_endpoint(&self, id: &str) -> Result<Option<EndpointDoc>, StoreError> {
        Ok(self
            .typed::<EndpointDoc>(ENDPOINTS)
            .find_one(doc! {"_id": id})
            .await?)
    }

    /// The endpoints among `ids`, in one read.
    pub async fn webhook_endpoints_named(
        &self,
        ids: &[&str],
    ) -> Result<Vec<EndpointDoc>, StoreError> {
        self.find_in(ENDPOINTS, "_id", ids).await
    }

    /// The endpoints of a shop (every shop's when `None`), oldest first.
    pub async fn webhook_endpoints(
        &self,
        shop: Option<&str>,
    ) -> Result<Vec<EndpointDoc>, StoreError> {
        let filter = shop.map_or_else(Document::new, |s| doc! {"shop": s});
        Ok(self
            .typed::<EndpointDoc>(ENDPOINTS)
            .find(filter)
            .sort(doc! {"created_at": 1, "_id": 1})
            .await?
            .try_collect()
            .await?)
    }

    /// The signing secrets of an endpoint that sign now, newest first.
    pub fn open_webhook_secrets(&self, endpoint: &EndpointDoc) -> Result<Vec<String>, StoreError> {
        let now = DateTime::now();
        let aad = secret_aad(&endpoint.id);
        endpoint
            .secrets
            .iter()
            .filter(|s| s.retire_at.is_none_or(|t| t > now))
            .map(|s| {
                let ring = self.keys.ring_with(&s.key_id)?;
                ring.open(&s.key_id, &aad, &s.sealed.bytes)
                    .map_err(StoreError::from)
            })
            .collect()
    }

    /// Makes `secret` the endpoint's signing secret; the ones before sign
    /// too until `overlap_until`. `None` when there is no such endpoint.
    pub async fn rotate_webhook_secret(
        &self,
        id: &str,
        secret: &str,
        overlap_until: DateTime,
    ) -> Result<Option<EndpointDoc>, StoreError> {
        let Some(mut endpoint) = self.webhook_endpoint(id).await? else {
            return Ok(None);
        };
        let ring = self.keys.ring()?;
        let sealed = ring.seal(&secret_aad(id), secret);
        let now = DateTime::now();
        for s in &mut endpoint.secrets {
            s.retire_at = Some(s.retire_at.map_or(overlap_until, |t| t.min(overlap_until)));
        }
        endpoint
            .secrets
            .retain(|s| s.retire_at.is_none_or(|t| t > now));
        endpoint.secrets.insert(
            0,
            SecretDoc {
                key_id: sealed.key_id,
                sealed: binary(sealed.bytes),
                created_at: now,
                retire_at: None,
            },
        );
        let secrets = bson::to_bson(&endpoint.secrets)
            .map_err(|e| StoreError::Rejected(format!("secrets do not encode: {e}")))?;
        self.collection(ENDPOINTS)
            .update_one(doc! {"_id": id}, doc! {"$set": {"secrets": secrets}})
            .write_concern(durable())
            .await?;
        Ok(Some(endpoint))
    }

    /// Enables or disables an endpoint (with why). Enabling makes its held
    /// tasks due now and clears its failure streak. `None` when there is
    /// no such endpoint.
    pub async fn set_webhook_enabled(
        &self,
        id: &str,
        enabled: bool,
        reason: &str,
    ) -> Result<Option<EndpointDoc>, StoreError> {
        let update = if enabled {
            doc! {"$set": {"enabled": true}, "$unset": {"disabled_reason": "", "disabled_at": "", "failing_since": ""}}
        } else {
            doc! {"$set": {"enabled": false, "disabled_reason": reason, "disabled_at": DateTime::now()}}
        };
        let after = self
            .typed::<EndpointDoc>(ENDPOINTS)
            .find_one_and_update(doc! {"_id": id}, update)
            .return_document(ReturnDocument::After)
            .write_concern(durable())
            .await?;
        if after.is_some() && enabled {
            self.collection(TASKS)
                .update_many(
                    doc! {"endpoint": id, "state": TaskState::Held},
                    doc! {"$set": {"state": TaskState::Pending, "next_at": DateTime::now(), "lease_until": DateTime::from_millis(0)}},
                )
                .await?;
        }
        Ok(after)
    }

    /// Disables an endpoint only while it is enabled (a delivery's
    /// verdict: 410, or failing too long); `true` when this call did it.
    pub async fn disable_webhook_if_enabled(
        &self,
        id: &str,
        reason: &str,
    ) -> Result<bool, StoreError> {
        let r = self
            .collection(ENDPOINTS)
            .update_one(
                doc! {"_id": id, "enabled": true},
                doc! {"$set": {"enabled": false, "disabled_reason": reason, "disabled_at": DateTime::now()}},
            )
            .write_concern(durable())
            .await?;
        Ok(r.modified_count == 1)
    }

    /// Records an endpoint's answer: a delivery ends its failure streak, a
    /// failure starts one. Returns when the streak began (`None` after a
    /// delivery).
    pub async fn note_webhook_result(
        &self,
        id: &str,
        delivered: bool,
    ) -> Result<Option<DateTime>, StoreError> {
        if delivered {
            self.collection(ENDPOINTS)
                .update_one(
                    doc! {"_id": id, "failing_since": {"$exists": true}},
                    doc! {"$unset": {"failing_since": ""}},
                )
                .await?;
            return Ok(None);
        }
        let after = self
            .typed::<EndpointDoc>(ENDPOINTS)
            .find_one_and_update(
                doc! {"_id": id},
                vec![doc! {"$set": {"failing_since": {"$ifNull": ["$failing_since", "$$NOW"]}}}],
            )
            .return_document(ReturnDocument::After)
            .await?;
        Ok(after.and_then(|e| e.failing_since))
    }

    /// Records events (bodies sealed) and one task per endpoint of each
    /// event's shop that subscribed to its type (held while the endpoint is
    /// disabled). Events and tasks already recorded are left as they are.
    /// Returns the tasks created.
    pub async fn record_webhook_events(&self, events: &[NewEvent]) -> Result<u64, StoreError> {
        if events.is_empty() {
            return Ok(0);
        }
        let mut shops: Vec<&str> = events.iter().map(|e| e.shop.as_str()).collect();
        shops.sort_unstable();
        shops.dedup();
        let endpoints: Vec<EndpointDoc> = self
            .typed::<EndpointDoc>(ENDPOINTS)
            .find(doc! {"shop": {"$in": &shops}})
            .await?
            .try_collect()
            .await?;
        let now = DateTime::now();
        let mut tasks = Vec::new();
        let mut docs = Vec::new();
        let ring = self.keys.ring()?;
        for e in events {
            let wanting: Vec<&EndpointDoc> = endpoints
                .iter()
                .filter(|p| p.shop == e.shop && p.wants(&e.kind))
                .collect();
            if wanting.is_empty() {
                continue;
            }
            let sealed = ring.seal(&event_aad(&e.id), &e.body);
            docs.push(doc! {
                "_id": &e.id, "shop": &e.shop, "kind": &e.kind, "key_id": sealed.key_id,
                "body": binary(sealed.bytes), "created_at": now,
            });
            tasks.extend(
                wanting
                    .into_iter()
                    .map(|p| new_task(&e.id, p, &e.kind, now)),
            );
        }
        self.insert_new(EVENTS, docs).await?;
        self.insert_new(TASKS, tasks).await
    }

    /// One event, its body opened.
    pub async fn webhook_event(&self, id: &str) -> Result<Option<Event>, StoreError> {
        let Some(d) = self.collection(EVENTS).find_one(doc! {"_id": id}).await? else {
            return Ok(None);
        };
        self.open_event(&d).map(Some)
    }

    fn open_event(&self, d: &Document) -> Result<Event, StoreError> {
        let field = |k: &str| d.get_str(k).map(str::to_owned).unwrap_or_default();
        let id = field("_id");
        let key_id = field("key_id");
        let bytes = match d.get("body") {
            Some(Bson::Binary(b)) => b.bytes.as_slice(),
            _ => &[],
        };
        let ring = self.keys.ring_with(&key_id)?;
        let body = ring
            .open(&key_id, &event_aad(&id), bytes)
            .map_err(StoreError::from)?;
        Ok(Event {
            shop: field("shop"),
            kind: field("kind"),
            created_at: d
                .get_datetime("created_at")
                .copied()
                .unwrap_or(DateTime::MIN),
            id,
            body,
        })
    }

    /// Every endpoint with a pending task, in `_id` order, with its first
    /// pending task (the one due first). One index key per endpoint (a
    /// distinct scan of `pending_by_endpoint`), however long the backlogs
    /// are.
    pub async fn webhook_heads(&self) -> Result<Vec<Head>, StoreError> {
        let pipeline = vec![
            doc! {"$match": {"state": TaskState::Pending}},
            doc! {"$sort": {"state": 1, "endpoint": 1, "next_at": 1, "_id": 1}},
            doc! {"$group": {
                "_id": "$endpoint",
                "next_at": {"$first": "$next_at"},
                "lease_until": {"$first": "$lease_until"},
            }},
            doc! {"$sort": {"_id": 1}},
        ];
        let docs: Vec<Document> = self
            .collection(TASKS)
            .aggregate(pipeline)
            .await?
            .try_collect()
            .await?;
        Ok(docs
            .iter()
            .map(|d| Head {
                endpoint: d.get_str("_id").unwrap_or_default().to_owned(),
                next_at: d.get_datetime("next_at").copied().unwrap_or(DateTime::MIN),
                lease_until: d
                    .get_datetime("lease_until")
                    .copied()
                    .unwrap_or(DateTime::MIN),
            })
            .collect())
    }

    /// Leases, for each `(endpoint, most)` of `wants`, up to `most` of the
    /// endpoint's due tasks, those due first, for `lease_ms`, under `token`
    /// (unique per call): a leased task is nobody else's until the lease
    /// ends. Three round trips whatever `wants` holds; each endpoint's
    /// tasks are read from its own range of `pending_by_endpoint`, so one
    /// endpoint's backlog costs the others nothing.
    pub async fn lease_webhook_tasks(
        &self,
        token: &str,
        lease_ms: i64,
        wants: &[(&str, i64)],
    ) -> Result<Vec<TaskDoc>, StoreError> {
        let now = DateTime::now();
        let due = doc! {"state": TaskState::Pending, "next_at": {"$lte": now}, "lease_until": {"$lte": now}};
        let of = |endpoint: &str, most: i64| {
            let mut matching = due.clone();
            matching.insert("endpoint", endpoint);
            vec![
                doc! {"$match": matching},
                doc! {"$sort": {"next_at": 1}},
                doc! {"$limit": most},
                doc! {"$project": {"_id": 1}},
            ]
        };
        let mut wanted = wants.iter().filter(|(_, most)| *most > 0);
        let Some((first, most)) = wanted.next() else {
            return Ok(Vec::new());
        };
        let mut pipeline = of(first, *most);
        pipeline.extend(
            wanted.map(|(e, most)| doc! {"$unionWith": {"coll": TASKS, "pipeline": of(e, *most)}}),
        );
        let ids: Vec<Document> = self
            .collection(TASKS)
            .aggregate(pipeline)
            .await?
            .try_collect()
            .await?;
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let ids: Vec<Bson> = ids
            .into_iter()
            .filter_map(|d| d.get("_id").cloned())
            .collect();
        let mut filter = due;
        filter.insert("_id", doc! {"$in": &ids});
        // Another process may lease some of them between the two steps:
        // the condition leaves those to it.
        self.collection(TASKS)
            .update_many(
                filter,
                doc! {"$set": {"lease_until": DateTime::from_millis(now.timestamp_millis() + lease_ms), "lease_by": token}},
            )
            .write_concern(bookkeeping())
            .await?;
        // By `_id` (its index), then the token: which of them this call won.
        Ok(self
            .typed::<TaskDoc>(TASKS)
            .find(doc! {"_id": {"$in": ids}, "lease_by": token})
            .await?
            .try_collect()
            .await?)
    }

    /// Ends the attempt made on a task leased with [`Store::lease_webhook_tasks`],
    /// and records the attempt. `false` when the lease was lost (another
    /// process took the task over): nothing is changed then but the
    /// attempt record.
    pub async fn end_webhook_attempt(
        &self,
        task: &TaskDoc,
        end: TaskEnd,
        attempt: &AttemptDoc,
    ) -> Result<bool, StoreError> {
        let by = task.lease_by.as_deref().unwrap_or_default();
        self.typed::<AttemptDoc>(ATTEMPTS)
            .insert_one(attempt)
            .write_concern(bookkeeping())
            .await?;
        let now = DateTime::now();
        let set = match end {
            TaskEnd::Delivered => doc! {"state": TaskState::Delivered, "done_at": now},
            TaskEnd::Failed => doc! {"state": TaskState::Failed, "done_at": now},
            TaskEnd::Held => doc! {"state": TaskState::Held},
            TaskEnd::RetryAt(at) => doc! {"next_at": at},
        };
        let mut set = set;
        set.insert("lease_until", DateTime::from_millis(0));
        let inc = if end == TaskEnd::Held { 0 } else { 1 };
        let r = self
            .collection(TASKS)
            .update_one(
                doc! {"_id": &task.id, "lease_by": by, "attempts": task.attempts},
                doc! {"$set": set, "$inc": {"attempts": inc}, "$unset": {"lease_by": ""}},
            )
            .write_concern(bookkeeping())
            .await?;
        Ok(r.matched_count == 1)
    }

    /// The latest attempts for an endpoint (every endpoint of `shop` when
    /// `endpoint` is `None`), newest first.
    pub async fn webhook_attempts(
        &self,
        shop: Option<&str>,
        endpoint: Option<&str>,
        limit: i64,
    ) -> Result<Vec<AttemptDoc>, StoreError> {
        let mut filter = Document::new();
        if let Some(s) = shop {
            filter.insert("shop", s);
        }
        if let Some(e) = endpoint {
            filter.insert("endpoint", e);
        }
        Ok(self
            .typed::<AttemptDoc>(ATTEMPTS)
            .find(filter)
            .sort(doc! {"at": -1})
            .limit(limit)
            .await?
            .try_collect()
            .await?)
    }

    /// What a replay of a shop's events in `scope` may send: the events (id,
    /// type and time, no body) and the endpoints they may go to (`endpoint`,
    /// or every enabled endpoint of the shop). The caller picks the pairs
    /// ([`EndpointDoc::wants`], and the events older than an endpoint only
    /// when asked) and makes them due with [`Store::make_webhooks_due`].
    pub async fn replay_candidates(
        &self,
        shop: &str,
        scope: &ReplayScope,
        endpoint: Option<&str>,
    ) -> Result<(Vec<EventHead>, Vec<EndpointDoc>), StoreError> {
        let mut filter = doc! {"shop": shop};
        match scope {
            ReplayScope::Event(id) => filter.insert("_id", id.as_str()),
            ReplayScope::Since(t) => filter.insert("created_at", doc! {"$gte": *t}),
        };
        let mut targets = doc! {"shop": shop, "enabled": true};
        if let Some(e) = endpoint {
            targets.insert("_id", e);
        }
        let endpoints: Vec<EndpointDoc> = self
            .typed::<EndpointDoc>(ENDPOINTS)
            .find(targets)
            .await?
            .try_collect()
            .await?;
        let events: Vec<EventHead> = self
            .typed::<EventHead>(EVENTS)
            .find(filter)
            .projection(doc! {"kind": 1, "created_at": 1})
            .await?
            .try_collect()
            .await?;
        Ok((events, endpoints))
    }

    /// Makes each `(event, endpoint)` due again now, whatever became of its
    /// task before. Returns the tasks made due.
    pub async fn make_webhooks_due(
        &self,
        due: &[(&EventHead, &EndpointDoc)],
    ) -> Result<u64, StoreError> {
        let now = DateTime::now();
        for (e, p) in due {
            self.collection(TASKS)
                .update_one(
                    doc! {"_id": task_id(&e.id, &p.id)},
                    doc! {
                        "$set": {"state": TaskState::Pending, "attempts": 0, "next_at": now, "lease_until": DateTime::from_millis(0)},
                        "$unset": {"done_at": "", "lease_by": ""},
                        "$setOnInsert": {"event": &e.id, "endpoint": &p.id, "shop": &p.shop, "kind": &e.kind, "created_at": now},
                    },
                )
                .upsert(true)
                .write_concern(durable())
                .await?;
        }
        Ok(due.len() as u64)
    }

    /// The ids of the codes order `order_id` holds (or held: whatever their
    /// status now) on `lines`, read from the `(order_id, line)` index.
    pub async fn code_ids_on_lines(
        &self,
        order_id: &str,
        lines: &[u32],
    ) -> Result<Vec<codepool_domain::CodeId>, StoreError> {
        let docs: Vec<Document> = self
            .collection(crate::codes::CODES)
            .find(doc! {"order_id": order_id})
            .projection(doc! {"_id": 1, "order_line": 1})
            .await?
            .try_collect()
            .await?;
        Ok(docs
            .iter()
            .filter(|d| {
                let line = crate::collections::as_u64(d.get("order_line"));
                lines.iter().any(|l| u64::from(*l) == line)
            })
            .filter_map(|d| d.get_object_id("_id").ok())
            .map(crate::codes::code_id)
            .collect())
    }

    /// When the oldest task still due was created; `None` when none is.
    pub async fn oldest_undelivered_webhook(&self) -> Result<Option<DateTime>, StoreError> {
        let oldest = self
            .typed::<TaskDoc>(TASKS)
            .find_one(doc! {"state": TaskState::Pending})
            .sort(doc! {"created_at": 1})
            .await?;
        Ok(oldest.map(|t| t.created_at))
    }

    /// Whether an endpoint secret or an event body is sealed with `key_id`.
    pub(crate) async fn webhooks_use_key(&self, key_id: &str) -> Result<bool, StoreError> {
        Ok(self
            .collection(EVENTS)
            .find_one(doc! {"key_id": key_id})
            .await?
            .is_some()
            || self
                .collection(ENDPOINTS)
                .find_one(doc! {"secrets.key_id": key_id})
                .await?
                .is_some())
    }

    /// Endpoints and events sealed with a key other than `active`.
    pub(crate) async fn webhooks_to_rotate(&self, active: &str) -> Result<u64, StoreError> {
        let events = self
            .collection(EVENTS)
            .count_documents(doc! {"key_id": {"$ne": active}})
            .await?;
        let endpoints = self
            .collection(ENDPOINTS)
            .count_documents(doc! {"secrets.key_id": {"$ne": active}})
            .await?;
        Ok(events + endpoints)
    }

    /// Re-seals up to `limit` endpoints' secrets and events' bodies under
    /// the active key; returns how many documents changed.
    pub(crate) async fn rotate_webhooks(&self, limit: i64) -> Result<u64, StoreError> {
        let ring = self.keys.ring()?;
        let active = ring.active_id().to_owned();
        let mut changed = 0;
        let endpoints: Vec<EndpointDoc> = self
            .typed::<EndpointDoc>(ENDPOINTS)
            .find(doc! {"secrets.key_id": {"$ne": &active}})
            .limit(limit)
            .await?
            .try_collect()
            .await?;
        for mut e in endpoints {
            let aad = secret_aad(&e.id);
            for s in &mut e.secrets {
                if s.key_id != active {
                    let old = self.keys.ring_with(&s.key_id)?;
                    let plain = old.open(&s.key_id, &aad, &s.sealed.bytes)?;
                    let sealed = ring.seal(&aad, &plain);
                    s.key_id = sealed.key_id;
                    s.sealed = binary(sealed.bytes);
                }
            }
            let secrets = bson::to_bson(&e.secrets)
                .map_err(|err| StoreError::Rejected(format!("secrets do not encode: {err}")))?;
            self.collection(ENDPOINTS)
                .update_one(doc! {"_id": &e.id}, doc! {"$set": {"secrets": secrets}})
                .write_concern(durable())
                .await?;
            changed += 1;
        }
        let events: Vec<Document> = self
            .collection(EVENTS)
            .find(doc! {"key_id": {"$ne": &active}})
            .limit(limit)
            .await?
            .try_collect()
            .await?;
        for d in events {
            let event = self.open_event(&d)?;
            let sealed = ring.seal(&event_aad(&event.id), &event.body);
            self.collection(EVENTS)
                .update_one(
                    doc! {"_id": &event.id},
                    doc! {"$set": {"key_id": sealed.key_id, "body": binary(sealed.bytes)}},
                )
                .await?;
            changed += 1;
        }
        Ok(changed)
    }
}
