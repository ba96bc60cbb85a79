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
use codepool_domain::gate::Move;
use codepool_domain::{Code, CodeId, CodeStatus, Holder, SmsEvent, SmsRecord, Transition};
use futures::TryStreamExt;
use mongodb::options::ReturnDocument;
use serde::{Deserialize, Serialize};

use crate::across::PoolOrder;
use crate::crypto::{binary, open_code};
use crate::error::{duplicates_only, is_duplicate_key, is_transient_code, DUPLICATE_KEY};
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
    pub status: StoredStatus,
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
    /// The replacement of its order that gave it its line (1, 2, …);
    /// absent for the code the line got when the order was placed. Part
    /// of the unique `(order_id, order_line, order_repl)` index: a line
    /// keeps the codes it was given, one per replacement.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub order_repl: Option<i64>,
    /// Who placed the order (`api-key-id:ID`); absent for one over AMQP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub used_at: Option<DateTime>,
    /// Who redeemed the code, by which of their redemption ids (a platform
    /// redeeming by code); absent for a redemption without one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub redemption: Option<RedemptionTag>,
    /// The write that redeemed the code by its redemption id (one id per
    /// round of [`Store::redeem_ids`]): a round reading the code back
    /// knows by it whether its own statement made the change, where the
    /// time (to the millisecond) could be another round's too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub redeemed_in: Option<ObjectId>,
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

/// A redemption's own id, as the platform that redeemed named it, and who
/// that platform is (its API key's owner, `shop:NAME` or `api-key-id:ID`).
/// One platform's id names one redemption: the same id again is answered
/// as before, and the id on another code is refused (a unique index).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RedemptionTag {
    pub id: String,
    pub by: String,
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
/// The filter naming these codes by pool and id: the pools let a `mongos`
/// send the write to the shards that hold them (docs/scaling.md).
pub(crate) fn pooled_ids(codes: &[(&str, CodeId)]) -> Document {
    let mut pools: Vec<&str> = codes.iter().map(|(p, _)| *p).collect();
    pools.sort_unstable();
    pools.dedup();
    let ids: Vec<ObjectId> = codes.iter().map(|(_, id)| object_id(*id)).collect();
    doc! {"pool": {"$in": pools}, "_id": {"$in": ids}}
}

pub fn object_id(id: CodeId) -> ObjectId {
    ObjectId::from_bytes(id.bytes())
}

/// A code's status as its document stores it: one of [`CodeStatus`], by
/// its number, or a number codepool does not know (a corrupt document,
/// reported as such by [`CodeDoc::into_code`], never taken for a status).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoredStatus {
    Known(CodeStatus),
    Unknown(i32),
}

impl StoredStatus {
    /// The number stored.
    pub fn as_i32(self) -> i32 {
        match self {
            Self::Known(s) => s.as_i32(),
            Self::Unknown(n) => n,
        }
    }
}

impl From<CodeStatus> for StoredStatus {
    fn from(s: CodeStatus) -> Self {
        Self::Known(s)
    }
}

impl Serialize for StoredStatus {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_i32(self.as_i32())
    }
}

impl<'de> Deserialize<'de> for StoredStatus {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let n = i32::deserialize(d)?;
        Ok(CodeStatus::from_i32(n).map_or(Self::Unknown(n), Self::Known))
    }
}

fn utc(t: Option<DateTime>) -> Option<chrono::DateTime<chrono::Utc>> {
    t.map(DateTime::to_chrono)
}

impl CodeDoc {
    /// The stored status, if it is one codepool knows.
    pub fn status(&self) -> Option<CodeStatus> {
        match self.status {
            StoredStatus::Known(s) => Some(s),
            StoredStatus::Unknown(_) => None,
        }
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
        let status = self
            .status()
            .ok_or_else(|| corrupt(&format!("has unknown status {}", self.status.as_i32())))?;
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
                replacement: small(self.order_repl, 0)
                    .ok_or_else(|| corrupt("has a replacement number out of range"))?,
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
    /// The move that gives the code: a claim from stock, a hold, a
    /// backorder's fulfilment, a reissue, or a commit of a held code.
    pub mv: Move,
    /// How the grant's event is sent again: the relay's business, apart
    /// from the move.
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
    /// unconfirmed. The HTTP door's grants: the answer carried the codes.
    ByRelay,
    /// The relay, by a record of the batch: before the claim, the caller
    /// recorded the orders of the batch as owing their events
    /// ([`Store::owe_events`]), so the claim writes nothing per code for
    /// them, and takes the record away ([`Store::settle_owed`]) once every
    /// event is confirmed. The relay sends the events of the grants of a
    /// record that outlives its confirms. The HTTP door's grants: one
    /// insert and one delete per batch, where a mark per code
    /// ([`Resend::ByRelay`]) is a second update of every code.
    ByRecord,
    /// A backorder fulfilled: sent again by the relay like [`Resend::ByRelay`],
    /// and nobody has seen its codes yet, so a shop's order also owes its
    /// webhook (`hook_pending`), like a purchase over AMQP.
    Backorder,
    /// Nothing to send: no one has seen the code (a checkout hold, or a
    /// bundle being put together, claimed by [`Move::Hold`]); it becomes
    /// an order's only by [`Store::commit_held`].
    Nothing,
}

impl Resend {
    /// Whether the claim hands the grant to the relay (`sms_pending`).
    pub fn relays(self) -> bool {
        matches!(self, Self::ByRelay | Self::Backorder)
    }

    /// Whether a shop's grant claimed this way owes the shop a webhook:
    /// every grant but one the HTTP answer carried.
    pub fn owes_hook(self) -> bool {
        !matches!(self, Self::ByRelay | Self::ByRecord | Self::Nothing)
    }
}

/// How a claim gives its codes: the move, and how their events are sent
/// again. A claim names both; neither follows from the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimWay {
    pub mv: Move,
    pub resend: Resend,
}

impl ClaimWay {
    /// An order's claim from stock, its events sent again by `resend`.
    pub fn claim(resend: Resend) -> Self {
        Self {
            mv: Move::Claim,
            resend,
        }
    }

    /// A checkout hold, or a bundle being put together: nothing is sent.
    pub fn hold() -> Self {
        Self {
            mv: Move::Hold,
            resend: Resend::Nothing,
        }
    }

    /// A waiting order's fulfilment after an import.
    pub fn fulfil() -> Self {
        Self {
            mv: Move::Fulfil,
            resend: Resend::Backorder,
        }
    }
}

/// The owner recorded with a shop's orders: `shop:NAME`.
pub use codepool_domain::SHOP_OWNER_PREFIX;

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
        code.status = a.mv.to();
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
            replacement: 0,
        });
        code.sms.awaiting_relay = a.resend.relays();
        out.insert(a.slot(), code);
    }
    Some(out)
}

/// The codes of orders split into each line's code now, by order and line,
/// and the codes replaced since: a line keeps every code it was given
/// (one per replacement, the replaced ones void), and its code now is the
/// one of its latest replacement. Codes without an order stay in the first.
pub fn current_by_line(codes: Vec<Code>) -> (Vec<Code>, Vec<Code>) {
    let key = |c: &Code| c.holder.as_ref().map(|h| (h.order_id.clone(), h.line));
    let mut latest: HashMap<(String, u32), u32> = HashMap::new();
    for c in &codes {
        if let (Some(k), Some(h)) = (key(c), &c.holder) {
            let n = latest.entry(k).or_insert(h.replacement);
            *n = (*n).max(h.replacement);
        }
    }
    let (mut now, mut replaced): (Vec<Code>, Vec<Code>) =
        codes.into_iter().partition(|c| match (key(c), &c.holder) {
            (Some(k), Some(h)) => latest.get(&k) == Some(&h.replacement),
            _ => true,
        });
    let order = |c: &Code| {
        c.holder
            .as_ref()
            .map_or((0, 0), |h| (h.line, h.replacement))
    };
    now.sort_by_key(order);
    replaced.sort_by_key(order);
    (now, replaced)
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

pub use crate::moves::not_expired;

/// The codes a claim may take at `now`: unissued and unexpired.
fn claimable(now: DateTime) -> Document {
    crate::moves::movable(Move::Claim, now)
}

/// [`claimable`] in `pool`.
pub(crate) fn claimable_in(pool: &str, now: DateTime) -> Document {
    in_pool(pool, claimable(now))
}

/// The unissued codes, expired or not: counted from `pool_status_seq`
/// alone, without reading a document.
fn unissued() -> Document {
    crate::moves::from_filter(Move::Claim)
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
pub(crate) fn int_field(d: &Document, key: &str) -> Option<i64> {
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

mod candidates;
pub(crate) mod claim;
mod counts;
mod insert;
pub use insert::code_documents;
mod outbox;
pub use outbox::{OwedRecord, SMS_OWED};

pub(crate) use claim::duplicate_positions;

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
            status: CodeStatus::from_i32(status)
                .map_or(StoredStatus::Unknown(status), StoredStatus::Known),
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
            order_repl: None,
            used_at: None,
            redemption: None,
            redeemed_in: None,
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

    #[test]
    fn a_line_shows_the_code_of_its_latest_replacement() {
        let keys = CodeKeys::none(None);
        let on = |line: i64, repl: Option<i64>, status: i32| {
            let mut d = issued(status);
            d.order_line = (line > 0).then_some(line);
            d.order_qty = Some(2);
            d.order_repl = repl;
            d.into_code(&keys).unwrap()
        };
        let codes = vec![
            on(1, None, 1),
            on(0, Some(2), 1),
            on(0, None, 3),
            on(0, Some(1), 3),
        ];
        let (now, replaced) = current_by_line(codes);
        let seen = |cs: &[Code]| -> Vec<(u32, u32)> {
            cs.iter()
                .map(|c| c.holder.as_ref().map(|h| (h.line, h.replacement)).unwrap())
                .collect()
        };
        assert_eq!(seen(&now), [(0, 2), (1, 0)]);
        assert_eq!(seen(&replaced), [(0, 0), (0, 1)]);
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
        let fields = crate::crypto::sealed_fields(ring, &d.pool, d.id, "QWER-1234");
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
