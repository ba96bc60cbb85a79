//! The `codes` collection: every code, its status and who got it.
//!
//! The one operation that decides ownership is [`Store::claim_candidates`]:
//! a batch of conditional updates `{_id, status: 0} → status 1` in a single
//! journaled command. The unique partial index on `(order_id, order_line)` makes
//! "one code per line of an order" a database guarantee. Codes are stored sealed and found by
//! their HMAC ([`crate::crypto`]); [`CodeDoc::into_code`] opens them.

use std::collections::{HashMap, HashSet};

use bson::oid::ObjectId;
use bson::{doc, Binary, Bson, DateTime, Document};
use codepool_domain::{Code, CodeId, CodeStatus, Holder, SmsEvent, SmsRecord, Transition};
use futures::TryStreamExt;
use mongodb::error::ErrorKind;
use mongodb::options::ReturnDocument;
use serde::{Deserialize, Serialize};

use crate::across::PoolOrder;
use crate::crypto::{binary, open_code, sealed_fields};
use crate::error::{is_duplicate_key, is_transient_code, DUPLICATE_KEY};
use crate::{durable, durable_doc, CodeKeys, Store, StoreError};

pub use crate::collections::CODES;
pub(crate) const SEQUENCES: &str = "sequences";

/// A code document as stored. The persistence form only: the store reads
/// it into the domain's [`Code`] ([`CodeDoc::into_code`]), and a document
/// that does not make a valid `Code` is an error, never skipped.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CodeDoc {
    #[serde(rename = "_id")]
    pub id: ObjectId,
    pub pool: String,
    /// Plaintext, only in documents from before encryption that
    /// `codepool migrate` has not sealed yet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<String>,
    /// `1 ‖ nonce ‖ ciphertext+tag`, see [`crate::crypto`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code_enc: Option<Binary>,
    /// Which key sealed `code_enc`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_id: Option<String>,
    /// HMAC-SHA-256 of `pool ‖ 0 ‖ code`: the unique index and lookups.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code_hmac: Option<Binary>,
    pub status: i32,
    pub seq: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_id: Option<ObjectId>,
    pub created_at: DateTime,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<DateTime>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub order_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phone: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub issued_at: Option<DateTime>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grant_no: Option<String>,
    /// The code's line in its order; absent for line 0 (every code issued
    /// before orders had quantities is line 0). Not `line`, which is the
    /// code's line in its CSV file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub order_line: Option<i64>,
    /// The order's quantity; absent for 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub order_qty: Option<i64>,
    /// The first line of the claim that issued it; absent for 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub order_part: Option<i64>,
    /// Who placed the order (`api-key-id:ID`); absent for one over AMQP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub used_at: Option<DateTime>,
    #[serde(default)]
    pub is_sms: i32,
    /// Set while the relay owes this grant its SMS-pending event.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sms_pending: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sms_published_at: Option<DateTime>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sms_sent_at: Option<DateTime>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sms_failed_at: Option<DateTime>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sms_error: Option<String>,
    #[serde(default)]
    pub sms_failures: i64,
    #[serde(default)]
    pub sms_resends: i64,
    #[serde(default)]
    pub sms_history: Vec<SmsHistoryEntry>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub voided_at: Option<DateTime>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub void_reason: Option<String>,
}

/// One stored step of a code's SMS history.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SmsHistoryEntry {
    pub event: String,
    pub at: DateTime,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub receipt_id: Option<String>,
}

/// The domain id of a stored code.
pub fn code_id(id: ObjectId) -> CodeId {
    CodeId::from_bytes(id.bytes())
}

/// The stored `_id` of a domain code id.
pub fn object_id(id: CodeId) -> ObjectId {
    ObjectId::from_bytes(id.bytes())
}

fn utc(t: Option<DateTime>) -> Option<chrono::DateTime<chrono::Utc>> {
    t.map(DateTime::to_chrono)
}

impl CodeDoc {
    /// The stored status, if it is one codepool knows.
    pub fn status(&self) -> Option<CodeStatus> {
        CodeStatus::from_i32(self.status)
    }

    /// Reads the document as a domain [`Code`], opening the sealed code
    /// with `keys`. An unknown status, or an issued code without its order,
    /// is corruption: an error naming the document, so no caller mistakes
    /// it for "no grant". A code the keys cannot open is an error too.
    pub fn into_code(self, keys: &CodeKeys) -> Result<Code, StoreError> {
        let sealed = match (&self.key_id, &self.code_enc) {
            (Some(k), Some(b)) => Some((k.as_str(), b.bytes.as_slice())),
            _ => None,
        };
        let code = open_code(keys, &self.pool, self.id, sealed, self.code.as_deref())?;
        let corrupt = |what: &str| StoreError::Corrupt {
            collection: CODES.into(),
            message: format!("code {} {what}", self.id),
        };
        let status = CodeStatus::from_i32(self.status)
            .ok_or_else(|| corrupt(&format!("has unknown status {}", self.status)))?;
        let holder = match (&self.order_id, self.issued_at) {
            (Some(order_id), Some(issued_at)) => Some(Holder {
                order_id: order_id.clone(),
                uid: self
                    .uid
                    .clone()
                    .ok_or_else(|| corrupt("is issued without uid"))?,
                phone: self.phone.clone().unwrap_or_default(),
                issued_at: issued_at.to_chrono(),
                grant_no: self.grant_no.clone(),
                line: small(self.order_line, 0)
                    .ok_or_else(|| corrupt("has an order line out of range"))?,
                quantity: small(self.order_qty, 1)
                    .ok_or_else(|| corrupt("has an order quantity out of range"))?,
                part: small(self.order_part, 0)
                    .ok_or_else(|| corrupt("has an order part out of range"))?,
                owner: self.owner.clone(),
            }),
            (Some(_), None) => return Err(corrupt("has an order_id but no issued_at")),
            (None, _) if matches!(status, CodeStatus::Issued | CodeStatus::Used) => {
                return Err(corrupt(&format!("is {status} but has no order_id")))
            }
            (None, _) => None,
        };
        Ok(Code {
            id: code_id(self.id),
            pool: self.pool,
            code,
            status,
            seq: self.seq,
            expires_at: utc(self.expires_at),
            holder,
            used_at: utc(self.used_at),
            voided_at: utc(self.voided_at),
            void_reason: self.void_reason,
            sms: SmsRecord {
                sent: self.is_sms == 1,
                published_at: utc(self.sms_published_at),
                awaiting_relay: self.sms_pending == Some(true),
                sent_at: utc(self.sms_sent_at),
                failed_at: utc(self.sms_failed_at),
                error: self.sms_error,
                failures: self.sms_failures,
                resends: self.sms_resends,
                history: self
                    .sms_history
                    .into_iter()
                    .map(|h| SmsEvent {
                        event: h.event,
                        at: h.at.to_chrono(),
                        error: h.error,
                    })
                    .collect(),
            },
        })
    }
}

/// A stored line, quantity or part: `default` when absent, `None` when it
/// does not fit.
fn small(v: Option<i64>, default: u32) -> Option<u32> {
    v.map_or(Some(default), |n| u32::try_from(n).ok())
}

/// A code read from a partner's file, ready to insert.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewCode {
    pub code: String,
    pub expires_at: Option<chrono::DateTime<chrono::Utc>>,
    /// Its line in the file (kept on the code, so that a later look-alike
    /// can name the line it matches).
    pub line: Option<u64>,
}

/// What inserting one batch of new codes did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct InsertOutcome {
    pub inserted: u64,
    /// Codes already in the pool, exactly as given.
    pub duplicates: u64,
    /// Codes refused because the pool holds one that reads the same
    /// (equal under NFKC and, unless the pool is case-sensitive, case
    /// folding): not counted in `duplicates`.
    pub lookalikes: Vec<LookAlike>,
}

/// A code refused as a look-alike of one the pool holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LookAlike {
    /// Its position in the batch given to the insert.
    pub index: usize,
    /// The line of the code it matches, when that code came from a file.
    pub of_line: Option<u64>,
    /// The import run that brought the code it matches.
    pub of_import: Option<ObjectId>,
}

/// The unique index that refuses a look-alike (migration 0011).
const FOLD_INDEX: &str = "pool_code_fold_unique";

/// One intended claim: give the code `code_id`, if it is an unissued and
/// unexpired code of `pool`, to this order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimAssignment {
    pub code_id: CodeId,
    /// The order's pool: a candidate of any other pool never matches.
    pub pool: String,
    pub order_id: String,
    pub uid: String,
    pub phone: String,
    pub grant_no: Option<String>,
    pub resend: Resend,
    /// Which line of the order this code is for.
    pub line: u32,
    /// The order's quantity.
    pub quantity: u32,
    /// The first line the claim that issues this code asks for.
    pub part: u32,
    /// Who placed the order (see [`codepool_domain::Purchase::owner`]).
    pub owner: Option<String>,
}

/// One line of one order: what the unique `(order_id, line)` index keys.
pub type Slot = (String, u32);

impl ClaimAssignment {
    /// The line of the order this assignment is for.
    pub fn slot(&self) -> Slot {
        (self.order_id.clone(), self.line)
    }
}

/// What sends a grant's SMS-pending event again when the process that
/// claimed it stops before the broker confirms the event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resend {
    /// The purchase message itself: the dispatcher acks it only once the
    /// event is confirmed, so until then the broker redelivers it and the
    /// redelivery publishes the event again. The claim records nothing
    /// more, and nothing is marked after the confirm.
    ByRedelivery,
    /// The relay: the claim flags the grant `sms_pending` in the same
    /// write, and the relay re-sends flagged grants whose event stays
    /// unconfirmed (backorders: no message of theirs is redelivered).
    ByRelay,
}

/// What a batch of conditional claim updates did. The update command only
/// reports how many statements matched, not which: when every statement
/// the unique index did not refuse matched, every one of them won, and
/// `granted` holds those codes as the write left them. Otherwise which
/// claims won is read back by order ([`Store::grants_for_orders`]).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct ClaimWrite {
    /// Positions (in the input) whose order already holds a code on their
    /// line: the unique `(order_id, line)` index refused them, so their
    /// candidate is still unissued.
    pub order_taken: Vec<usize>,
    /// The codes this write granted, by order and line, when it is known
    /// that every statement outside `order_taken` won; `None` when some
    /// lost (their candidate was taken meanwhile) or their codes could not
    /// be read.
    pub granted: Option<HashMap<Slot, Code>>,
    /// Positions whose candidate can never be claimed by its order, and
    /// why, as the codes read beside the write show them: another pool's
    /// code, a redeemed or void one, an expired one, or no code at all. A
    /// hot set that offered them was stale or tampered with; they are
    /// dropped, never put back.
    pub strays: Vec<(usize, Stray)>,
}

/// Why a candidate offered by a hot set failed the claim's condition for
/// good (as opposed to losing a race to another claimer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stray {
    /// No code has this id.
    Missing,
    /// A code of another pool.
    OtherPool,
    /// Redeemed or void: it left the pool for good.
    Retired,
    /// Unissued but past its expiry.
    Expired,
}

impl Stray {
    /// The label of `codepool_hot_candidates_dropped_total`.
    pub fn as_str(self) -> &'static str {
        match self {
            Stray::Missing => "missing",
            Stray::OtherPool => "other_pool",
            Stray::Retired => "retired",
            Stray::Expired => "expired",
        }
    }
}

/// The candidates of `assignments` (outside `order_taken`) that the codes
/// read beside the write show to be unclaimable by their order for good.
fn strays_among(
    codes: &HashMap<CodeId, Code>,
    assignments: &[ClaimAssignment],
    order_taken: &[usize],
    at: DateTime,
) -> Vec<(usize, Stray)> {
    let now = at.to_chrono();
    let why = |a: &ClaimAssignment| match codes.get(&a.code_id) {
        None => Some(Stray::Missing),
        Some(c) if c.pool != a.pool => Some(Stray::OtherPool),
        Some(c) if matches!(c.status, CodeStatus::Used | CodeStatus::Void) => Some(Stray::Retired),
        Some(c) if c.status == CodeStatus::Unissued && c.expires_at.is_some_and(|t| t <= now) => {
            Some(Stray::Expired)
        }
        Some(_) => None,
    };
    (assignments.iter().enumerate())
        .filter(|(k, _)| !order_taken.contains(k))
        .filter_map(|(k, a)| Some((k, why(a)?)))
        .collect()
}

/// The codes of a claim write of which every statement outside
/// `order_taken` won, as the write left them, by order and line; `None`
/// if one of them was not read.
fn issued_by(
    mut codes: HashMap<CodeId, Code>,
    assignments: &[ClaimAssignment],
    order_taken: &[usize],
    at: DateTime,
) -> Option<HashMap<Slot, Code>> {
    let mut out = HashMap::with_capacity(assignments.len());
    for (k, a) in assignments.iter().enumerate() {
        if order_taken.contains(&k) {
            continue;
        }
        let mut code = codes.remove(&a.code_id)?;
        code.status = Transition::Claim.to();
        code.holder = Some(Holder {
            order_id: a.order_id.clone(),
            uid: a.uid.clone(),
            phone: a.phone.clone(),
            issued_at: at.to_chrono(),
            grant_no: a.grant_no.clone(),
            line: a.line,
            quantity: a.quantity,
            part: a.part,
            owner: a.owner.clone(),
        });
        code.sms.awaiting_relay = a.resend == Resend::ByRelay;
        out.insert(a.slot(), code);
    }
    Some(out)
}

/// Which codes `lookup` shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CodeQuery<'a> {
    Order(&'a str),
    Uid(&'a str),
    /// The buyer's phone number, as the purchase carried it.
    Phone(&'a str),
    Code {
        pool: &'a str,
        code: &'a str,
    },
    /// The latest grants of a pool.
    GrantsOf(&'a str),
}

/// Outcome of a claim by scanning the pool (the path without Redis).
#[derive(Debug, Clone, PartialEq)]
pub enum ScanClaim {
    Granted(Box<Code>),
    /// The order already holds a code; read it with `grants_for_orders`.
    OrderAlreadyGranted,
    /// No unissued, unexpired code is left in the pool.
    Empty,
}

/// The filter part "not expired at `now`".
pub fn not_expired(now: DateTime) -> Document {
    doc! {"$or": [{"expires_at": Bson::Null}, {"expires_at": {"$gt": now}}]}
}

/// The codes a claim may take at `now`: unissued and unexpired.
fn claimable(now: DateTime) -> Document {
    let mut filter = unissued();
    filter.extend(not_expired(now));
    filter
}

/// [`claimable`] in `pool`.
fn claimable_in(pool: &str, now: DateTime) -> Document {
    in_pool(pool, claimable(now))
}

/// The unissued codes, expired or not: counted from `pool_status_seq`
/// alone, without reading a document.
fn unissued() -> Document {
    doc! {"status": {"$in": Transition::Claim.from_codes()}}
}

/// [`unissued`] in `pool`.
fn unissued_in(pool: &str) -> Document {
    in_pool(pool, unissued())
}

/// The unissued codes that have expired by `now` and are not voided yet:
/// found in the partial index `unissued_expiry`, which holds only unissued
/// codes that carry an expiry. (`expires_at` is a date or absent, so this
/// is exactly the complement of [`not_expired`].)
fn expired_unissued(now: DateTime) -> Document {
    let mut filter = unissued();
    filter.insert("expires_at", doc! {"$lte": now});
    filter
}

/// `filter` narrowed to `pool`.
fn in_pool(pool: &str, filter: Document) -> Document {
    let mut narrowed = doc! {"pool": pool};
    narrowed.extend(filter);
    narrowed
}

/// The key of `pool_status_seq`, which answers scans of unissued codes
/// over several pools in pool order.
const POOL_STATUS_SEQ: &[&str] = &["pool", "status", "seq"];
/// The key of `unissued_expiry`.
const UNISSUED_EXPIRY: &[&str] = &["pool", "expires_at"];

/// Which end of `(pool, status, seq)` a bounded count starts from.
#[derive(Clone, Copy, PartialEq, Eq)]
enum CountFrom {
    /// Whatever order the index the planner picks gives.
    Any,
    /// The highest `seq` down. Claims take the lowest `seq` first, and the
    /// index keys they delete stay behind as tombstones until their pages
    /// are reconciled (the snapshot history keeps them for minutes): a
    /// count from the bottom walks over every one of them, once a second
    /// per busy pool. From the top, a count up to its cap meets only the
    /// codes imported last. (At 1,000 claims/s, mongod's forward cursors
    /// skipped 19,700 and 21,200 entries in 15 s instead of 48,500 and
    /// 60,400.)
    NewestFirst,
}

/// A count of the documents matching `filter`, up to `limit`, tagged with
/// `at` (how [`Store::each_union_reply`] tells replies apart).
fn count_upto(filter: Document, from: CountFrom, limit: i64, at: usize) -> Vec<Document> {
    let mut pipeline = vec![doc! {"$match": filter}];
    if from == CountFrom::NewestFirst {
        pipeline.push(doc! {"$sort": {"seq": -1}});
    }
    pipeline.extend([
        doc! {"$limit": limit.max(1)},
        doc! {"$group": {"_id": {"$literal": at as i64}, "n": {"$sum": 1}}},
    ]);
    pipeline
}

/// Pools per refill query: enough to start a batch's cold pools together,
/// few enough that one query's reply stays well under a cursor batch.
pub const ASKS_PER_QUERY: usize = 64;

/// One pool's part of [`Store::candidates_after_many`]: up to `limit`
/// candidates with `seq` above `after_seq`.
#[derive(Debug, Clone, Copy)]
pub struct CandidateAsk<'a> {
    pub pool: &'a str,
    pub after_seq: i64,
    pub limit: i64,
}

impl CandidateAsk<'_> {
    /// The bounded scan of `(pool, status, seq)` that answers this ask;
    /// each code it returns carries `at`, the position of the ask.
    fn pipeline(&self, at: usize, now: DateTime) -> Vec<Document> {
        let mut filter = claimable_in(self.pool, now);
        filter.insert("seq", doc! {"$gt": self.after_seq});
        vec![
            doc! {"$match": filter},
            doc! {"$sort": {"seq": 1}},
            doc! {"$limit": self.limit.max(1)},
            doc! {"$project": {"_id": 1, "seq": 1, "at": {"$literal": at as i64}}},
        ]
    }
}

/// One `aggregate` pipeline answering every branch: the first branch runs
/// on `codes`, each other one is a `$unionWith` of it.
fn union_of(branches: impl IntoIterator<Item = Vec<Document>>) -> Vec<Document> {
    let mut branches = branches.into_iter();
    let mut pipeline = branches.next().unwrap_or_default();
    pipeline.extend(branches.map(|b| doc! {"$unionWith": {"coll": CODES, "pipeline": b}}));
    pipeline
}

/// The integer field `key` of `d`, as `$literal` and `$sum` write it.
fn int_field(d: &Document, key: &str) -> Option<i64> {
    match d.get(key) {
        Some(Bson::Int32(n)) => Some(i64::from(*n)),
        Some(Bson::Int64(n)) => Some(*n),
        _ => None,
    }
}

/// The id and seq of a candidate read by a refill.
fn id_and_seq(d: &Document) -> Option<(CodeId, i64)> {
    Some((
        code_id(d.get_object_id("_id").ok()?),
        d.get_i64("seq").ok()?,
    ))
}

/// The id, seq and pool of a candidate read by a scan of several pools.
fn candidate_of(d: &Document) -> Result<(CodeId, i64, &str), StoreError> {
    match (id_and_seq(d), d.get_str("pool")) {
        (Some((id, seq)), Ok(pool)) => Ok((id, seq, pool)),
        _ => Err(StoreError::Corrupt {
            collection: CODES.into(),
            message: format!("a code lacks an ObjectId _id, a 64-bit seq or its pool: {d}"),
        }),
    }
}

/// The ask position (below `asks`), id and seq of a candidate read by a
/// refill's per-pool branch.
fn candidate_fields(d: &Document, asks: usize) -> Result<(usize, CodeId, i64), StoreError> {
    let at = int_field(d, "at").and_then(|i| usize::try_from(i).ok());
    match (at, id_and_seq(d)) {
        (Some(i), Some((id, seq))) if i < asks => Ok((i, id, seq)),
        _ => Err(StoreError::Corrupt {
            collection: CODES.into(),
            message: format!("a code lacks an ObjectId _id or a 64-bit seq: {d}"),
        }),
    }
}

fn issue_set(a: &ClaimAssignment, now: DateTime) -> Document {
    let mut set = doc! {"status": Transition::Claim.to().as_i32(), "issued_at": now};
    for (field, value) in holder_fields(a) {
        if value != Bson::Null {
            set.insert(field, value);
        }
    }
    doc! {"$set": set}
}

/// What a claim records of its holder, field by field; `Null` for a field
/// the claim leaves unset (no grant number; no relay owed; line 0 of an
/// order of one, as every code was before quantities). The one list both
/// claim writes ([`issue_set`], [`claim_statement`]) take their fields
/// from.
fn holder_fields(a: &ClaimAssignment) -> [(&'static str, Bson); 9] {
    let unless = |n: u32, default: u32| {
        if n == default {
            Bson::Null
        } else {
            Bson::Int64(i64::from(n))
        }
    };
    [
        ("order_id", Bson::String(a.order_id.clone())),
        ("uid", Bson::String(a.uid.clone())),
        ("phone", Bson::String(a.phone.clone())),
        (
            "grant_no",
            a.grant_no.clone().map_or(Bson::Null, Bson::String),
        ),
        (
            "sms_pending",
            match a.resend {
                Resend::ByRelay => Bson::Boolean(true),
                Resend::ByRedelivery => Bson::Null,
            },
        ),
        ("order_line", unless(a.line, 0)),
        ("order_qty", unless(a.quantity, 1)),
        ("order_part", unless(a.part, 0)),
        ("owner", a.owner.clone().map_or(Bson::Null, Bson::String)),
    ]
}

/// The filter "code `_id` is still claimable at `now`" for these ids.
fn claimable_ids(ids: Bson, now: DateTime) -> Document {
    let mut q = doc! {"_id": ids};
    q.extend(claimable(now));
    q
}

/// One claim as its own update statement: code `_id`, of the order's
/// pool, still claimable.
fn claim_each(a: &ClaimAssignment, now: DateTime) -> Document {
    let mut q = claimable_ids(Bson::ObjectId(object_id(a.code_id)), now);
    q.insert("pool", a.pool.as_str());
    doc! {"q": q, "u": issue_set(a, now)}
}

/// Every claim of a batch as ONE multi-document update statement: each
/// claimable document among `ids` takes the holder at its own position
/// (`$indexOfArray`), so it sets exactly what [`issue_set`] would. Fields
/// an assignment leaves empty (no grant number, no relay) are not set.
fn claim_statement(assignments: &[ClaimAssignment], ids: &[ObjectId], now: DateTime) -> Document {
    // The holders' fields as columns, one value per assignment.
    let mut columns: Vec<(&str, Vec<Bson>)> = Vec::new();
    for (r, row) in assignments.iter().map(holder_fields).enumerate() {
        for (k, (field, value)) in row.into_iter().enumerate() {
            if r == 0 {
                columns.push((field, Vec::with_capacity(assignments.len())));
            }
            columns[k].1.push(value);
        }
    }
    let mut holder = doc! {"status": Transition::Claim.to().as_i32(), "issued_at": now};
    for (field, column) in columns {
        let at = doc! {"$arrayElemAt": [{"$literal": column}, "$$i"]};
        holder.insert(field, doc! {"$ifNull": [at, "$$REMOVE"]});
    }
    let ids: Vec<Bson> = ids.iter().copied().map(Bson::ObjectId).collect();
    let position = doc! {"$indexOfArray": [{"$literal": ids.clone()}, "$_id"]};
    let merged = doc! {"$mergeObjects": ["$$ROOT", {"$let": {"vars": {"i": position.clone()}, "in": holder}}]};
    // Each document must be a code of the pool of the order at its own
    // position: a hot set holding another pool's id grants nothing.
    let pools: Vec<Bson> = assignments
        .iter()
        .map(|a| Bson::String(a.pool.clone()))
        .collect();
    let own_pool = doc! {"$eq": ["$pool", {"$arrayElemAt": [{"$literal": pools}, position]}]};
    let mut q = claimable_ids(Bson::Document(doc! {"$in": ids}), now);
    q.insert("$expr", own_pool);
    doc! {
        "q": q,
        "u": [{"$replaceWith": merged}],
        "multi": true,
    }
}

/// True when the unique `(order_id, line)` index stopped a claim statement:
/// some line of the batch already holds a code.
fn stopped_by_a_holder(reply: &Document) -> bool {
    reply.get_array("writeErrors").is_ok_and(|errors| {
        errors
            .iter()
            .filter_map(Bson::as_document)
            .any(|e| e.get_i32("code") == Ok(DUPLICATE_KEY))
    })
}

/// What an `update` reply says of a batch of claims: the positions whose
/// order already holds a code, or the error that leaves the outcome
/// unknown (the caller reads grants back by order).
fn claim_reply(reply: &Document) -> Result<ClaimWrite, StoreError> {
    if let Ok(wce) = reply.get_document("writeConcernError") {
        return Err(StoreError::Unavailable(format!(
            "claim write concern not satisfied: {}",
            wce.get_str("errmsg").unwrap_or("unknown")
        )));
    }
    let mut out = ClaimWrite::default();
    for e in reply
        .get_array("writeErrors")
        .into_iter()
        .flatten()
        .filter_map(Bson::as_document)
    {
        let code = e.get_i32("code").unwrap_or(-1);
        let index = e.get_i32("index").unwrap_or(-1);
        let message = e.get_str("errmsg").unwrap_or("unknown");
        if code == DUPLICATE_KEY && index >= 0 {
            out.order_taken.push(index as usize);
        } else if is_transient_code(code) {
            return Err(StoreError::Unavailable(message.to_owned()));
        } else {
            return Err(StoreError::Rejected(format!("claim refused: {message}")));
        }
    }
    Ok(out)
}

/// The positions of an unordered `update` command's statements that a
/// unique index refused; any other error is an error.
pub(crate) fn duplicate_positions(reply: &Document) -> Result<Vec<usize>, StoreError> {
    claim_reply(reply).map(|w| w.order_taken)
}

impl Store {
    /// Runs `updates` on `codes` as ONE unordered, journaled `update`
    /// command (majority write concern) and returns the server's reply, so
    /// the caller reads its per-statement write errors.
    pub(crate) async fn update_codes(
        &self,
        updates: Vec<Document>,
    ) -> Result<Document, StoreError> {
        Ok(self
            .database()
            .run_command(doc! {
                "update": CODES,
                "updates": updates,
                "ordered": false,
                "writeConcern": durable_doc(),
            })
            .await?)
    }

    /// Reserves `n` consecutive `seq` values for `pool` with one atomic
    /// `$inc`; returns the first. Gaps are fine, order is what matters.
    pub async fn reserve_seq(&self, pool: &str, n: u64) -> Result<i64, StoreError> {
        let n = i64::try_from(n).map_err(|_| StoreError::Rejected("seq range too large".into()))?;
        let updated = self
            .collection(SEQUENCES)
            .find_one_and_update(
                doc! {"_id": format!("codes.seq:{pool}")},
                doc! {"$inc": {"value": n}},
            )
            .upsert(true)
            .return_document(ReturnDocument::After)
            .write_concern(durable())
            .await?;
        let end = updated
            .and_then(|d| d.get_i64("value").ok())
            .ok_or_else(|| StoreError::Corrupt {
                collection: SEQUENCES.into(),
                message: format!("codes.seq:{pool} has no 64-bit value"),
            })?;
        Ok(end - n + 1)
    }

    /// Inserts a batch of new codes (status 0, increasing `seq`), unordered.
    /// Codes already in the pool are counted as duplicates, never inserted
    /// twice: the unique index is on `(pool, code_hmac)`. Each code is stored
    /// sealed under the active key ([`crate::crypto`]), never in plaintext.
    /// `batch_id` ties the codes to their import run, which makes a retried
    /// batch count exactly.
    pub async fn insert_codes(
        &self,
        pool: &str,
        batch_id: ObjectId,
        codes: &[NewCode],
    ) -> Result<InsertOutcome, StoreError> {
        if codes.is_empty() {
            return Ok(InsertOutcome::default());
        }
        let ring = self.keys.ring()?;
        self.register_key_id(ring.active_id()).await?;
        let case_sensitive = self.case_sensitive_codes(pool).await?;
        let first_seq = self.reserve_seq(pool, codes.len() as u64).await?;
        let now = DateTime::now();
        let docs: Vec<Document> = codes
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let id = ObjectId::new();
                let mut d = doc! {"_id": id, "pool": pool};
                d.extend(sealed_fields(&ring, pool, id, &c.code));
                let folded = codepool_domain::fold(&c.code, case_sensitive);
                d.insert(
                    "code_fold_hmac",
                    binary(ring.fold_hmac(pool, &folded).to_vec()),
                );
                if let Some(line) = c.line.and_then(|l| i64::try_from(l).ok()) {
                    d.insert("line", line);
                }
                d.extend(doc! {
                    "status": CodeStatus::Unissued.as_i32(),
                    "seq": first_seq + i as i64,
                    "batch_id": batch_id,
                    "created_at": now,
                    "is_sms": 0,
                });
                if let Some(t) = c.expires_at {
                    d.insert("expires_at", DateTime::from_chrono(t));
                }
                d
            })
            .collect();
        let total = docs.len() as u64;
        let (mut outcome, refused) = self.insert_docs(&docs).await?;
        if !refused.is_empty() {
            outcome.lookalikes = self.look_alikes_among(pool, &docs, &refused).await?;
            outcome.duplicates -= outcome.lookalikes.len() as u64;
        }
        let last_seq = first_seq + total as i64 - 1;
        if let Err(e) = self
            .record_range(pool, first_seq, last_seq, outcome.inserted)
            .await
        {
            // The range is then counted from the index instead.
            tracing::debug!(pool, first_seq, last_seq, error = %e, "could not record an inserted seq range");
        }
        Ok(outcome)
    }

    /// `insert_many` of new code documents, unordered: duplicates are
    /// counted, any other refusal is an error. Also returns the positions
    /// the look-alike index refused.
    async fn insert_docs(
        &self,
        docs: &[Document],
    ) -> Result<(InsertOutcome, Vec<usize>), StoreError> {
        let total = docs.len() as u64;
        match self
            .collection(CODES)
            .insert_many(docs)
            .ordered(false)
            .write_concern(durable())
            .await
        {
            Ok(r) => Ok((
                InsertOutcome {
                    inserted: r.inserted_ids.len() as u64,
                    duplicates: total - r.inserted_ids.len() as u64,
                    lookalikes: Vec::new(),
                },
                Vec::new(),
            )),
            Err(e) => {
                let ErrorKind::InsertMany(failure) = e.kind.as_ref() else {
                    return Err(e.into());
                };
                if let Some(wce) = &failure.write_concern_error {
                    return Err(StoreError::Unavailable(format!(
                        "write concern not satisfied: {}",
                        wce.message
                    )));
                }
                let errors = failure.write_errors.as_deref().unwrap_or_default();
                if let Some(other) = errors.iter().find(|w| w.code != DUPLICATE_KEY) {
                    return Err(if is_transient_code(other.code) {
                        StoreError::Unavailable(other.message.clone())
                    } else {
                        StoreError::Rejected(other.message.clone())
                    });
                }
                let duplicates = errors.len() as u64;
                // The server names the index that refused a document.
                let by_fold = errors
                    .iter()
                    .filter(|w| w.message.contains(FOLD_INDEX))
                    .map(|w| w.index)
                    .collect();
                Ok((
                    InsertOutcome {
                        inserted: total - duplicates,
                        duplicates,
                        lookalikes: Vec::new(),
                    },
                    by_fold,
                ))
            }
        }
    }

    /// Which of the documents at `refused` (turned away by the look-alike
    /// index) are look-alikes, and of which code: one whose stored code
    /// differs from theirs. A document whose exact code is in the pool is
    /// a plain duplicate, whichever index refused it first.
    async fn look_alikes_among(
        &self,
        pool: &str,
        docs: &[Document],
        refused: &[usize],
    ) -> Result<Vec<LookAlike>, StoreError> {
        let folds: Vec<Bson> = (refused.iter())
            .filter_map(|&i| docs.get(i)?.get("code_fold_hmac").cloned())
            .collect();
        let held: Vec<Document> = self
            .collection(CODES)
            .find(doc! {"pool": pool, "code_fold_hmac": {"$in": folds}})
            .projection(doc! {"code_hmac": 1, "code_fold_hmac": 1, "line": 1, "batch_id": 1})
            .await?
            .try_collect()
            .await?;
        let mut out = Vec::new();
        for &index in refused {
            let Some(ours) = docs.get(index) else {
                continue;
            };
            let matched = held
                .iter()
                .find(|h| h.get("code_fold_hmac") == ours.get("code_fold_hmac"));
            match matched {
                Some(h) if h.get("code_hmac") != ours.get("code_hmac") => out.push(LookAlike {
                    index,
                    of_line: int_field(h, "line").and_then(|l| u64::try_from(l).ok()),
                    of_import: h.get_object_id("batch_id").ok(),
                }),
                _ => {}
            }
        }
        Ok(out)
    }

    /// [`Store::insert_codes`] of the codes not in `pool` yet, found with
    /// one indexed lookup first. For finishing an import that was killed:
    /// most of its codes are in already, and a rejected insert costs far
    /// more per code than the lookup. Also returns how many the lookup
    /// found (counted as duplicates in the outcome).
    pub async fn insert_missing_codes(
        &self,
        pool: &str,
        batch_id: ObjectId,
        codes: &[NewCode],
    ) -> Result<(InsertOutcome, u64), StoreError> {
        let hmacs = self.code_hmacs(pool, codes)?;
        let list: Vec<Bson> = hmacs.iter().map(|h| binary(h.clone())).collect();
        let found: Vec<Document> = self
            .collection(CODES)
            .find(doc! {"pool": pool, "code_hmac": {"$in": list}})
            .projection(doc! {"_id": 0, "code_hmac": 1})
            .await?
            .try_collect()
            .await?;
        let existing: HashSet<Vec<u8>> = found
            .iter()
            .filter_map(|d| match d.get("code_hmac") {
                Some(Bson::Binary(b)) => Some(b.bytes.clone()),
                _ => None,
            })
            .collect();
        let missing: Vec<NewCode> = codes
            .iter()
            .zip(&hmacs)
            .filter(|(_, h)| !existing.contains(*h))
            .map(|(c, _)| c.clone())
            .collect();
        let skipped = (codes.len() - missing.len()) as u64;
        let mut outcome = self.insert_codes(pool, batch_id, &missing).await?;
        outcome.duplicates += skipped;
        Ok((outcome, skipped))
    }

    /// For each of `codes`, another pool that holds it already (and the
    /// import that brought it there), found with one lookup on the
    /// `code_any_hmac` index (migration 0014): a code sits in one pool.
    pub async fn codes_in_other_pools(
        &self,
        pool: &str,
        codes: &[NewCode],
    ) -> Result<Vec<Option<(String, Option<ObjectId>)>>, StoreError> {
        let ring = self.keys.ring()?;
        let hmacs: Vec<Vec<u8>> = (codes.iter())
            .map(|c| ring.any_pool_hmac(&c.code).to_vec())
            .collect();
        let list: Vec<Bson> = hmacs.iter().map(|h| binary(h.clone())).collect();
        let found: Vec<Document> = self
            .collection(CODES)
            .find(doc! {"code_any_hmac": {"$in": list}, "pool": {"$ne": pool}})
            .projection(doc! {"_id": 0, "code_any_hmac": 1, "pool": 1, "batch_id": 1})
            .hint(mongodb::options::Hint::Name("code_any_hmac".into()))
            .await?
            .try_collect()
            .await?;
        let mut elsewhere: HashMap<Vec<u8>, (String, Option<ObjectId>)> = HashMap::new();
        for d in found {
            if let (Some(Bson::Binary(b)), Ok(p)) = (d.get("code_any_hmac"), d.get_str("pool")) {
                let batch = d.get_object_id("batch_id").ok();
                elsewhere
                    .entry(b.bytes.clone())
                    .or_insert((p.to_owned(), batch));
            }
        }
        Ok(hmacs.iter().map(|h| elsewhere.get(h).cloned()).collect())
    }

    /// The HMAC of each code in `pool`: what the unique index holds.
    fn code_hmacs(&self, pool: &str, codes: &[NewCode]) -> Result<Vec<Vec<u8>>, StoreError> {
        let ring = self.keys.ring()?;
        Ok(codes
            .iter()
            .map(|c| ring.code_hmac(pool, &c.code).to_vec())
            .collect())
    }

    /// How many of `codes` are in `pool` from import run `batch_id`: used to
    /// count a batch exactly after a retry whose first attempt may have
    /// landed.
    pub async fn count_from_batch(
        &self,
        pool: &str,
        batch_id: ObjectId,
        codes: &[NewCode],
    ) -> Result<u64, StoreError> {
        let list: Vec<Bson> = self
            .code_hmacs(pool, codes)?
            .into_iter()
            .map(binary)
            .collect();
        Ok(self
            .collection(CODES)
            .count_documents(doc! {"pool": pool, "code_hmac": {"$in": list}, "batch_id": batch_id})
            .await?)
    }

    /// Applies a batch of claims in ONE journaled `update` command: each is
    /// "give code `_id` to this order if it is still unissued and unexpired".
    /// This is the only write that moves a code from 0 to 1 besides
    /// [`Store::claim_by_scan`]; MongoDB's condition, checked per document
    /// as it is written, is the sole arbiter.
    ///
    /// The claims go as one multi-document statement ([`claim_statement`]):
    /// a third of the server's work of one statement per claim, which it
    /// parses, plans and commits one by one. An order that already holds a
    /// code (a redelivery) stops that statement at the unique index, so the
    /// batch is then written again one statement per claim, which names
    /// each refused order; claims that landed before the stop no longer
    /// match, and are read back by order.
    pub async fn claim_candidates(
        &self,
        assignments: &[ClaimAssignment],
    ) -> Result<ClaimWrite, StoreError> {
        if assignments.is_empty() {
            return Ok(ClaimWrite::default());
        }
        let now = DateTime::now();
        // The candidates' sealed codes are read while the journaled write is
        // in flight: a code's value, pool, seq and expiry never change, so
        // the read need not follow the write, and a fully landed write
        // needs no read-back by order afterwards.
        let ids: Vec<ObjectId> = assignments.iter().map(|a| object_id(a.code_id)).collect();
        let one = vec![claim_statement(assignments, &ids, now)];
        let (reply, read) = futures::join!(self.update_codes(one), self.codes_by_id(&ids));
        let mut reply = reply?;
        if stopped_by_a_holder(&reply) {
            tracing::debug!("an order of the batch already holds a code; claiming one by one");
            let each = assignments.iter().map(|a| claim_each(a, now)).collect();
            reply = self.update_codes(each).await?;
        }
        let mut out = claim_reply(&reply)?;
        // Every statement the index did not refuse matched: every claim won
        // (in a second write, a claim that landed in the first no longer
        // matches, so this holds only when the second write did it all).
        let landed = crate::collections::as_u64(reply.get("n"));
        match read {
            Ok(codes) if landed == (assignments.len() - out.order_taken.len()) as u64 => {
                out.granted = issued_by(codes, assignments, &out.order_taken, now);
            }
            Ok(codes) => out.strays = strays_among(&codes, assignments, &out.order_taken, now),
            Err(_) => {}
        }
        Ok(out)
    }

    /// The codes with these ids, opened, by id.
    async fn codes_by_id(&self, ids: &[ObjectId]) -> Result<HashMap<CodeId, Code>, StoreError> {
        let codes = self
            .opened_codes(doc! {"_id": {"$in": ids}}, ids.len())
            .await?;
        Ok(codes.into_iter().map(|c| (c.id, c)).collect())
    }

    /// The codes matching `filter`, at most `most` of them (in one reply),
    /// opened with the store's keys; one that does not open (or is
    /// corrupt) is an error, never skipped.
    async fn opened_codes(&self, filter: Document, most: usize) -> Result<Vec<Code>, StoreError> {
        let docs: Vec<CodeDoc> = self
            .typed::<CodeDoc>(CODES)
            .find(filter)
            .batch_size(crate::one_batch_for(most))
            .await?
            .try_collect()
            .await?;
        docs.into_iter().map(|d| d.into_code(&self.keys)).collect()
    }

    /// Claims the oldest unissued, unexpired code of `pool` for one order by
    /// scanning `(pool, status, seq)` with `findOneAndUpdate`. The path used
    /// when Redis is unavailable, and the final word on "the pool is empty".
    /// `claim.code_id` is ignored: the scan picks the code.
    pub async fn claim_by_scan(
        &self,
        pool: &str,
        claim: &ClaimAssignment,
    ) -> Result<ScanClaim, StoreError> {
        let now = DateTime::now();
        let filter = claimable_in(pool, now);
        let result = self
            .typed::<CodeDoc>(CODES)
            .find_one_and_update(filter, issue_set(claim, now))
            .sort(doc! {"seq": 1})
            .return_document(ReturnDocument::After)
            .write_concern(durable())
            .await;
        match result {
            Ok(Some(doc)) => Ok(ScanClaim::Granted(Box::new(doc.into_code(&self.keys)?))),
            Ok(None) => Ok(ScanClaim::Empty),
            Err(e) if is_duplicate_key(&e) => Ok(ScanClaim::OrderAlreadyGranted),
            Err(e) => Err(e.into()),
        }
    }

    /// The codes held by these orders, keyed by order id, each order's
    /// codes by line.
    pub async fn grants_for_orders(
        &self,
        order_ids: &[&str],
    ) -> Result<HashMap<String, Vec<Code>>, StoreError> {
        if order_ids.is_empty() {
            return Ok(HashMap::new());
        }
        let codes = self
            .opened_codes(doc! {"order_id": {"$in": order_ids}}, order_ids.len())
            .await?;
        // The filter matched on order_id, so a holder is always there;
        // `into_code` has already refused one without issued_at.
        let mut out: HashMap<String, Vec<Code>> = HashMap::new();
        for c in codes {
            if let Some(h) = &c.holder {
                out.entry(h.order_id.clone()).or_default().push(c);
            }
        }
        for codes in out.values_mut() {
            codes.sort_by_key(|c| c.holder.as_ref().map_or(0, |h| h.line));
        }
        Ok(out)
    }

    /// Unissued, unexpired codes of `pool` after `after_seq`, oldest first:
    /// the candidates that refill the hot pool. Only ids and seqs travel.
    pub async fn candidates_after(
        &self,
        pool: &str,
        after_seq: i64,
        limit: i64,
    ) -> Result<Vec<(CodeId, i64)>, StoreError> {
        let mut found = self
            .candidates_after_many(&[CandidateAsk {
                pool,
                after_seq,
                limit,
            }])
            .await?;
        Ok(found.pop().unwrap_or_default())
    }

    /// [`Store::candidates_after`] for several pools, aligned with `asks`.
    /// Pools asked from their start (cold ones, and rescans) share three
    /// commands, each pool's read bounded by its limit
    /// ([`Store::first_candidates`]); the others, and any those did not
    /// answer, go in one `aggregate` per
    /// [`ASKS_PER_QUERY`] pools, each pool's bounded scan a `$unionWith`
    /// branch. Pools that start cold together (a batch of purchases over
    /// many pools) cost one command, not one each.
    pub async fn candidates_after_many(
        &self,
        asks: &[CandidateAsk<'_>],
    ) -> Result<Vec<Vec<(CodeId, i64)>>, StoreError> {
        let now = DateTime::now();
        let mut found = vec![Vec::new(); asks.len()];
        let (from_start, mut rest): (Vec<usize>, Vec<usize>) =
            (0..asks.len()).partition(|&i| asks[i].after_seq == 0);
        if from_start.len() > 1 {
            for (i, codes) in self.first_candidates(asks, from_start, now).await? {
                match codes {
                    Some(codes) => found[i] = codes,
                    None => rest.push(i),
                }
            }
        } else {
            rest.extend(from_start);
        }
        self.each_union_reply(
            rest.len(),
            |at| asks[rest[at]].pipeline(at, now),
            // Every candidate in the first reply: no getMore round trip.
            |chunk| chunk.map(|at| asks[rest[at]].limit.max(1)).sum(),
            |d| {
                let (at, id, seq) = candidate_fields(&d, rest.len())?;
                found[rest[at]].push((id, seq));
                Ok(())
            },
        )
        .await?;
        for codes in &mut found {
            codes.sort_unstable_by_key(|&(_, seq)| seq);
        }
        Ok(found)
    }

    /// The first candidates of the asks `which` (all from the start), each
    /// pool's read bounded by its own limit, whatever the pool's size, in
    /// three commands whatever the number of pools:
    ///
    /// 1. each pool's lowest and highest unissued `seq`: two index-only
    ///    `DISTINCT_SCAN`s of `pool_status_seq` (one key per pool each);
    /// 2. one `find` of every pool's window of `seq`, from its lowest
    ///    unissued code, as wide as its limit (a pool's codes have distinct
    ///    `seq`s, so a window holds at most that many): no pool reads past
    ///    what it asked for.
    ///
    /// A window that reaches the pool's highest unissued code read the
    /// whole pool; one that found its limit answered it. A window thinned
    /// by codes claimed or expired since (or between) is not an answer:
    /// `None`, and the caller reads that pool alone.
    ///
    /// A budgeted scan of the pools in index order (as stock counts do)
    /// has no bound per pool: each pool it passes costs all its unissued
    /// codes, so a 1,000-pool cold start over pools of 125 codes read every
    /// code twice (the scans cut at the budget and rescanned) to keep 64
    /// a pool.
    async fn first_candidates(
        &self,
        asks: &[CandidateAsk<'_>],
        which: Vec<usize>,
        now: DateTime,
    ) -> Result<Vec<(usize, Option<Vec<(CodeId, i64)>>)>, StoreError> {
        let pools: Vec<&str> = which.iter().map(|&i| asks[i].pool).collect();
        // Along (pool, status, seq), a pool's unissued codes come in `seq`
        // order only because a claim takes codes of one status.
        debug_assert_eq!(Transition::Claim.from_codes().len(), 1);
        let (lowest, highest) = futures::try_join!(
            self.unissued_end(&pools, PoolOrder::Ascending),
            self.unissued_end(&pools, PoolOrder::Descending),
        )?;
        // Per ask: its window and whether it reaches the pool's last
        // unissued code; none for a pool without one.
        let windows: Vec<Option<(i64, i64, bool)>> = (which.iter())
            .map(|&i| {
                let pool = asks[i].pool;
                let (lo, hi) = (*lowest.get(pool)?, *highest.get(pool)?);
                let end = lo.saturating_add(asks[i].limit.max(1) - 1);
                Some((lo, end.min(hi), end >= hi))
            })
            .collect();
        let branches: Vec<Document> = (which.iter().zip(&windows))
            .filter_map(|(&i, w)| {
                let (lo, hi, _) = (*w)?;
                let mut branch = in_pool(asks[i].pool, unissued());
                branch.insert("seq", doc! {"$gte": lo, "$lte": hi});
                Some(branch)
            })
            .collect();
        let mut by_pool: HashMap<String, Vec<(CodeId, i64)>> = HashMap::new();
        if !branches.is_empty() {
            let most: i64 = (which.iter().zip(&windows))
                .filter(|(_, w)| w.is_some())
                .map(|(&i, _)| asks[i].limit.max(1))
                .sum();
            let filter = doc! {"$and": [{"$or": branches}, not_expired(now)]};
            let rows: Vec<Document> = self
                .collection(CODES)
                .find(filter)
                .projection(doc! {"_id": 1, "seq": 1, "pool": 1})
                .hint(mongodb::options::Hint::Name("pool_status_seq".into()))
                .batch_size(crate::one_batch_for(
                    usize::try_from(most).unwrap_or(usize::MAX),
                ))
                .await?
                .try_collect()
                .await?;
            for d in &rows {
                let (id, seq, pool) = candidate_of(d)?;
                by_pool.entry(pool.to_owned()).or_default().push((id, seq));
            }
        }
        Ok(which
            .into_iter()
            .zip(windows)
            .map(|(i, w)| {
                let Some((_, _, whole)) = w else {
                    // Nothing unissued: the pool's whole answer.
                    return (i, Some(Vec::new()));
                };
                // By `get`: two asks of one pool each get its window.
                let mut got = by_pool.get(asks[i].pool).cloned().unwrap_or_default();
                got.sort_unstable_by_key(|&(_, seq)| seq);
                let limit = usize::try_from(asks[i].limit.max(1)).unwrap_or(usize::MAX);
                got.truncate(limit);
                (i, (whole || got.len() >= limit).then_some(got))
            })
            .collect())
    }

    /// Each pool's lowest (ascending) or highest (descending) unissued
    /// `seq`, expired or not: a `DISTINCT_SCAN` of `pool_status_seq` that
    /// reads one key per pool. Pools without one are absent.
    async fn unissued_end(
        &self,
        pools: &[&str],
        order: PoolOrder,
    ) -> Result<HashMap<String, i64>, StoreError> {
        let sign = match order {
            PoolOrder::Ascending => 1,
            PoolOrder::Descending => -1,
        };
        let mut filter = unissued();
        filter.insert("pool", doc! {"$in": pools});
        let rows: Vec<Document> = self
            .collection(CODES)
            .aggregate(vec![
                doc! {"$match": filter},
                doc! {"$sort": {"pool": sign, "status": sign, "seq": sign}},
                doc! {"$group": {"_id": "$pool", "seq": {"$first": "$seq"}}},
            ])
            .batch_size(crate::one_batch_for(pools.len()))
            .await?
            .try_collect()
            .await?;
        rows.iter()
            .map(|d| match (d.get_str("_id"), d.get_i64("seq")) {
                (Ok(pool), Ok(seq)) => Ok((pool.to_owned(), seq)),
                _ => Err(StoreError::Corrupt {
                    collection: CODES.into(),
                    message: format!("a pool's end of unissued codes reads {d}"),
                }),
            })
            .collect()
    }

    /// Records that the SMS-pending events of these codes were confirmed by
    /// the broker, which takes them off the relay's list.
    pub async fn mark_sms_published(&self, code_ids: &[CodeId]) -> Result<(), StoreError> {
        if code_ids.is_empty() {
            return Ok(());
        }
        let code_ids: Vec<ObjectId> = code_ids.iter().copied().map(object_id).collect();
        // Not a decision, only bookkeeping for the relay: a lost mark means
        // one duplicate event (with the same event_id), so w:1 is enough.
        self.collection(CODES)
            .update_many(
                doc! {"_id": {"$in": code_ids}, "sms_pending": true},
                doc! {"$set": {"sms_published_at": DateTime::now()}, "$unset": {"sms_pending": ""}},
            )
            .write_concern(
                mongodb::options::WriteConcern::builder()
                    .w(mongodb::options::Acknowledgment::Nodes(1))
                    .build(),
            )
            .await?;
        Ok(())
    }

    /// Hands the grants these orders hold to the relay (`sms_pending`), for
    /// purchases settled without publishing their event: a purchase
    /// dead-lettered at its delivery limit may hold a grant from a delivery
    /// that crashed before its confirm, and no redelivery follows. Journaled
    /// before the caller acks. Returns how many grants were handed over.
    pub async fn hand_to_relay(&self, order_ids: &[&str]) -> Result<u64, StoreError> {
        if order_ids.is_empty() {
            return Ok(0);
        }
        let handed = self
            .collection(CODES)
            .update_many(
                doc! {"order_id": {"$in": order_ids}, "status": CodeStatus::Issued.as_i32()},
                doc! {"$set": {"sms_pending": true}},
            )
            .write_concern(durable())
            .await?;
        Ok(handed.modified_count)
    }

    /// Grants issued before `before` that the relay owes their SMS-pending
    /// event (`sms_pending`, see [`Resend::ByRelay`]): its work list.
    pub async fn unconfirmed_grants(
        &self,
        before: chrono::DateTime<chrono::Utc>,
        limit: i64,
    ) -> Result<Vec<Code>, StoreError> {
        let docs: Vec<CodeDoc> = self
            .typed::<CodeDoc>(CODES)
            .find(doc! {"sms_pending": true, "issued_at": {"$lt": DateTime::from_chrono(before)}})
            .sort(doc! {"issued_at": 1})
            .limit(limit)
            .await?
            .try_collect()
            .await?;
        docs.into_iter().map(|d| d.into_code(&self.keys)).collect()
    }

    /// The codes an operator asked about, newest grant first.
    pub async fn find_codes(
        &self,
        query: &CodeQuery<'_>,
        limit: i64,
    ) -> Result<Vec<Code>, StoreError> {
        let filter = match query {
            CodeQuery::Order(o) => doc! {"order_id": *o},
            CodeQuery::Uid(u) => doc! {"uid": *u},
            CodeQuery::Phone(p) => doc! {"phone": *p},
            CodeQuery::Code { pool, code } => self.code_filter(pool, code).await?,
            // `issued_at` lets the partial `(pool, issued_at)` index serve
            // the newest grants first, without sorting a pool's grants.
            CodeQuery::GrantsOf(pool) => doc! {
                "pool": *pool, "issued_at": {"$exists": true}, "order_id": {"$type": "string"},
            },
        };
        let docs: Vec<CodeDoc> = self
            .typed::<CodeDoc>(CODES)
            .find(filter)
            .sort(doc! {"issued_at": -1})
            .limit(limit)
            .await?
            .try_collect()
            .await?;
        docs.into_iter().map(|d| d.into_code(&self.keys)).collect()
    }

    /// Number of unissued, unexpired codes in `pool`, counted document by
    /// document. Costs as much as the pool is large: a reference for tests
    /// and checks; operators get [`Store::unissued_stock`], the claim path
    /// [`Store::unissued_count_upto`].
    pub async fn unissued_count(&self, pool: &str) -> Result<u64, StoreError> {
        let filter = claimable_in(pool, DateTime::now());
        Ok(self.collection(CODES).count_documents(filter).await?)
    }

    /// Unissued, unexpired codes in `pool`, counted up to `cap`: exact
    /// below it, `cap` at or above it. Its cost is bounded by `cap`, not by
    /// the pool's size.
    pub async fn unissued_count_upto(&self, pool: &str, cap: u64) -> Result<u64, StoreError> {
        let mut counts = self.unissued_counts_upto(&[(pool, cap)]).await?;
        Ok(counts.pop().unwrap_or(0))
    }

    /// [`Store::unissued_count_upto`] of several `(pool, cap)`, aligned
    /// with the input, in one `aggregate` per [`ASKS_PER_QUERY`] counts
    /// (each a `$unionWith` branch): a stock sweep over thousands of pools
    /// is a few dozen commands, not thousands.
    ///
    /// The stock is two counts in index order: the pool's expired
    /// unissued codes in `unissued_expiry` (up to the cap), then its
    /// unissued codes in `pool_status_seq` (up to twice the cap; an
    /// index-only scan), and the difference. MongoDB 6.0 reads each expired
    /// code to check the status its partial index already implies, so the
    /// count reads only the expired codes the expiry sweep has not voided
    /// yet (none in the usual case), never the stock. A pool holding `cap`
    /// or more of those is counted document by document instead.
    ///
    /// The two counts are a moment apart, like any count beside running
    /// claims. Expired codes are counted first, so a code the sweep voids
    /// in between lowers the answer until the next check, never raises it:
    /// a backorder sweep then fulfils fewer, not more than there is.
    pub async fn unissued_counts_upto(&self, asks: &[(&str, u64)]) -> Result<Vec<u64>, StoreError> {
        let now = DateTime::now();
        let cap = |i: usize| asks[i].1.clamp(1, i64::MAX as u64 / 2);
        let n = asks.len();
        let (mut expired, mut unissued) = if n > 1 {
            let pools: Vec<&str> = asks.iter().map(|a| a.0).collect();
            let caps: Vec<u64> = (0..n).map(cap).collect();
            self.count_across(&pools, &caps, now).await?
        } else {
            (vec![None; n], vec![None; n])
        };
        // Pools counted one by one: a single pool, or those the scans'
        // budgets did not reach. Count `2k` is pool `rest[k]`'s expired
        // codes, `2k + 1` its unissued ones; a chunk's branches run in
        // this order.
        let rest: Vec<usize> = (0..n)
            .filter(|&i| expired[i].is_none() || unissued[i].is_none())
            .collect();
        let counts = self
            .counts_upto(rest.len() * 2, |at| {
                let (pool, limit) = (asks[rest[at / 2]].0, cap(rest[at / 2]) as i64);
                match at % 2 {
                    0 => count_upto(
                        in_pool(pool, expired_unissued(now)),
                        CountFrom::Any,
                        limit,
                        at,
                    ),
                    _ => count_upto(unissued_in(pool), CountFrom::NewestFirst, limit * 2, at),
                }
            })
            .await?;
        for (k, &i) in rest.iter().enumerate() {
            (expired[i], unissued[i]) = (Some(counts[2 * k]), Some(counts[2 * k + 1]));
        }
        // Every count is known here: `rest` held each pool still without one.
        let expired = |i: usize| expired[i].unwrap_or(0).min(cap(i));
        let unissued = |i: usize| unissued[i].unwrap_or(0).min(cap(i) * 2);
        let mut stock: Vec<u64> = (0..n)
            .map(|i| unissued(i).saturating_sub(expired(i)).min(cap(i)))
            .collect();
        let unswept: Vec<usize> = (0..n).filter(|&i| expired(i) >= cap(i)).collect();
        if !unswept.is_empty() {
            let exact = self
                .counts_upto(unswept.len(), |at| {
                    let i = unswept[at];
                    let filter = claimable_in(asks[i].0, now);
                    count_upto(filter, CountFrom::NewestFirst, cap(i) as i64, at)
                })
                .await?;
            for (i, n) in unswept.into_iter().zip(exact) {
                stock[i] = n;
            }
        }
        Ok(stock)
    }

    /// The two counts of [`Store::unissued_counts_upto`] for all `pools`
    /// at once, in budgeted scans ([`crate::across`]): expired codes first,
    /// both from the highest pool name down (unissued keys from the
    /// highest `seq` down, see [`CountFrom::NewestFirst`]). `None` for a
    /// pool the scans did not answer.
    async fn count_across(
        &self,
        pools: &[&str],
        caps: &[u64],
        now: DateTime,
    ) -> Result<(Vec<Option<u64>>, Vec<Option<u64>>), StoreError> {
        let down = PoolOrder::Descending;
        let filter = expired_unissued(now);
        let e = self
            .count_each(pools, caps, &filter, UNISSUED_EXPIRY, down)
            .await?;
        let twice: Vec<u64> = caps.iter().map(|c| c * 2).collect();
        let u = self
            .count_each(pools, &twice, &unissued(), POOL_STATUS_SEQ, down)
            .await?;
        Ok((e, u))
    }

    /// The `n` counts `branch(at)` describes ([`count_upto`]), aligned.
    async fn counts_upto(
        &self,
        n: usize,
        branch: impl Fn(usize) -> Vec<Document>,
    ) -> Result<Vec<u64>, StoreError> {
        let mut counts = vec![0u64; n];
        self.each_union_reply(
            n,
            branch,
            |chunk| chunk.len() as i64,
            |d| {
                let at = int_field(&d, "_id").and_then(|i| usize::try_from(i).ok());
                match (at, int_field(&d, "n")) {
                    (Some(i), Some(c)) if i < counts.len() => {
                        counts[i] = c as u64;
                        Ok(())
                    }
                    _ => Err(StoreError::Corrupt {
                        collection: CODES.into(),
                        message: format!("a stock count answered {d}"),
                    }),
                }
            },
        )
        .await?;
        Ok(counts)
    }

    /// Runs `n` asks as one `aggregate` per [`ASKS_PER_QUERY`]: `branch(at)`
    /// is ask `at`'s pipeline (its replies carry `at`), the first of a chunk
    /// runs on `codes` and the others are `$unionWith` branches of it.
    /// `most` bounds a chunk's replies, which come in one reply
    /// ([`crate::one_batch_for`]); `each` takes every reply.
    async fn each_union_reply(
        &self,
        n: usize,
        branch: impl Fn(usize) -> Vec<Document>,
        most: impl Fn(std::ops::Range<usize>) -> i64,
        mut each: impl FnMut(Document) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        for start in (0..n).step_by(ASKS_PER_QUERY) {
            let chunk = start..(start + ASKS_PER_QUERY).min(n);
            let batch = crate::one_batch_for(usize::try_from(most(chunk.clone())).unwrap_or(0));
            let mut cursor = self
                .collection(CODES)
                .aggregate(union_of(chunk.map(&branch)))
                .batch_size(batch)
                .await?;
            while let Some(d) = cursor.try_next().await? {
                each(d)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc(status: i32) -> CodeDoc {
        CodeDoc {
            id: ObjectId::new(),
            pool: "x".into(),
            code: Some("QWER-1234".into()),
            code_enc: None,
            key_id: None,
            code_hmac: None,
            status,
            seq: 7,
            batch_id: None,
            created_at: DateTime::now(),
            expires_at: None,
            order_id: None,
            uid: None,
            phone: None,
            issued_at: None,
            grant_no: None,
            order_line: None,
            order_qty: None,
            order_part: None,
            used_at: None,
            is_sms: 0,
            sms_pending: None,
            sms_published_at: None,
            sms_sent_at: None,
            sms_failed_at: None,
            sms_error: None,
            sms_failures: 0,
            sms_resends: 0,
            sms_history: Vec::new(),
            voided_at: None,
            void_reason: None,
            owner: None,
        }
    }

    fn issued(status: i32) -> CodeDoc {
        CodeDoc {
            order_id: Some("O-1".into()),
            uid: Some("u".into()),
            phone: Some("+8613800000000".into()),
            issued_at: Some(DateTime::now()),
            grant_no: Some("G202611200001".into()),
            is_sms: 1,
            ..doc(status)
        }
    }

    #[test]
    fn an_unissued_document_reads_as_a_code_without_holder() {
        let d = doc(0);
        let id = d.id;
        let c = d.into_code(&CodeKeys::none(None)).unwrap();
        assert_eq!(c.status, CodeStatus::Unissued);
        assert_eq!(c.holder, None);
        assert_eq!(object_id(c.id), id, "ids survive the round trip");
    }

    #[test]
    fn an_issued_document_reads_with_its_holder_and_sms_record() {
        let c = issued(1).into_code(&CodeKeys::none(None)).unwrap();
        let h = c.holder.as_ref().unwrap();
        assert_eq!(h.order_id, "O-1");
        assert_eq!(h.grant_no.as_deref(), Some("G202611200001"));
        assert!(c.sms.sent);
        assert_eq!(c.grant().unwrap().order_id, "O-1");
    }

    #[test]
    fn an_unknown_status_is_corruption_not_a_guess() {
        assert!(matches!(
            doc(9).into_code(&CodeKeys::none(None)),
            Err(StoreError::Corrupt { .. })
        ));
    }

    #[test]
    fn an_issued_code_without_its_order_or_time_is_corruption() {
        assert!(matches!(
            doc(1).into_code(&CodeKeys::none(None)),
            Err(StoreError::Corrupt { .. })
        ));
        let mut no_time = issued(1);
        no_time.issued_at = None;
        assert!(matches!(
            no_time.into_code(&CodeKeys::none(None)),
            Err(StoreError::Corrupt { .. })
        ));
    }

    #[test]
    fn a_void_code_keeps_its_order_and_is_a_revoked_grant() {
        let c = issued(3).into_code(&CodeKeys::none(None)).unwrap();
        assert!(c.grant().unwrap().revoked);
        let never_issued = doc(3).into_code(&CodeKeys::none(None)).unwrap();
        assert_eq!(never_issued.grant(), None);
    }

    fn sealed(ring: &codepool_vault::Keyring, status: i32) -> CodeDoc {
        let mut d = doc(status);
        let fields = sealed_fields(ring, &d.pool, d.id, "QWER-1234");
        let bin = |k: &str| match fields.get(k) {
            Some(Bson::Binary(b)) => Some(b.clone()),
            _ => None,
        };
        d.code = None;
        d.code_enc = bin("code_enc");
        d.code_hmac = bin("code_hmac");
        d.key_id = fields.get_str("key_id").ok().map(str::to_owned);
        d
    }

    #[test]
    fn a_sealed_document_opens_with_its_keys_only() {
        let ring = codepool_vault::Keyring::generate();
        let keys = CodeKeys::new(ring.clone(), None);
        let d = sealed(&ring, 0);
        assert_eq!(d.clone().into_code(&keys).unwrap().code, "QWER-1234");
        let wrong = CodeKeys::new(codepool_vault::Keyring::generate(), None);
        assert!(matches!(
            d.clone().into_code(&wrong),
            Err(StoreError::Keys(codepool_vault::VaultError::Decrypt { .. }))
        ));
        let e = d.into_code(&CodeKeys::none(None)).unwrap_err();
        assert!(e.to_string().contains("codepool keys init"), "{e}");
    }

    #[test]
    fn a_ciphertext_moved_to_another_document_does_not_open() {
        let ring = codepool_vault::Keyring::generate();
        let keys = CodeKeys::new(ring.clone(), None);
        let mut other = sealed(&ring, 0);
        other.code_enc = sealed(&ring, 0).code_enc;
        assert!(other.into_code(&keys).is_err());
    }

    #[test]
    fn a_document_with_no_code_at_all_is_corruption() {
        let mut d = doc(0);
        d.code = None;
        assert!(matches!(
            d.into_code(&CodeKeys::none(None)),
            Err(StoreError::Corrupt { .. })
        ));
    }
}
