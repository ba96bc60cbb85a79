//! A code's life after its claim: redeemed (1→2), voided (0→3, 1→3),
//! expired (0→3 with reason `expired`), and what the SMS service reports
//! about the text that carried it.
//!
//! Every transition is ONE conditional update on the current status, so
//! MongoDB decides, exactly as for the claim. When the update matches
//! nothing, the document is read to explain why (unknown, unissued, already
//! used, void) in words an operator can act on. Nothing here ever moves a
//! code back to status 0: an issued code has been seen by its buyer.

use std::collections::HashMap;

use bson::oid::ObjectId;
use bson::{doc, Bson, DateTime, Document};
use codepool_domain::{mask, when, Code, CodeId, CodeStatus, SetAside};
use futures::TryStreamExt;

use crate::backorders::{BackorderState, BACKORDERS};
use crate::codes::{code_id, object_id, CODES};
use crate::moves::StatusWrite;
use crate::{CodeDoc, Store, StoreError};

/// The reason recorded on codes voided by the expiry sweep.
pub const EXPIRED_REASON: &str = "expired";

/// SMS history entries kept per code; older ones are dropped.
const SMS_HISTORY_LEN: i32 = 20;

/// Codes voided per round of the expiry sweep.
const EXPIRE_BATCH: i64 = 1000;

/// Which code an operator (or an event) means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CodeRef<'a> {
    /// A code of a pool, as printed on the buyer's SMS.
    Code { pool: &'a str, code: &'a str },
    /// The codes granted to an order (every one of an order of several).
    Order(&'a str),
    /// One code by its id, as a lookup by value found it
    /// ([`Store::find_by_value`]).
    Id(CodeId),
}

pub use crate::codes::RedemptionTag;

/// A sold code as a lookup by value finds it: what a platform may know of
/// it, read without opening the code.
#[derive(Debug, Clone, PartialEq)]
pub struct Sold {
    pub id: CodeId,
    pub pool: String,
    pub status: CodeStatus,
    pub grant_no: Option<String>,
    pub line: u32,
    pub issued_at: Option<chrono::DateTime<chrono::Utc>>,
    pub used_at: Option<chrono::DateTime<chrono::Utc>>,
    pub voided_at: Option<chrono::DateTime<chrono::Utc>>,
    pub void_reason: Option<String>,
    /// The platform's redemption that used it, if one did by code.
    pub redemption: Option<RedemptionTag>,
}

impl Sold {
    pub(crate) fn of(d: &Document) -> Option<Sold> {
        let time = |k: &str| d.get_datetime(k).ok().map(|t| t.to_chrono());
        Some(Sold {
            id: code_id(d.get_object_id("_id").ok()?),
            pool: d.get_str("pool").ok()?.to_owned(),
            status: CodeStatus::from_i32(d.get_i32("status").ok()?)?,
            grant_no: d.get_str("grant_no").ok().map(str::to_owned),
            line: match d.get("order_line") {
                Some(Bson::Int64(l)) => u32::try_from(*l).ok()?,
                Some(Bson::Int32(l)) => u32::try_from(*l).ok()?,
                _ => 0,
            },
            issued_at: time("issued_at"),
            used_at: time("used_at"),
            voided_at: time("voided_at"),
            void_reason: d.get_str("void_reason").ok().map(str::to_owned),
            redemption: d
                .get_document("redemption")
                .ok()
                .and_then(|r| bson::from_document(r.clone()).ok()),
        })
    }
}

/// What a redemption did.
#[derive(Debug, Clone, PartialEq)]
pub enum Redeemed {
    /// Redeemed now: the codes as they were before.
    Now(Vec<Applied>),
    /// The same redemption (its [`RedemptionTag`]) was made before: the
    /// code as it is, used since then.
    Before(Box<Code>),
}

impl CodeRef<'_> {
    /// The filter that finds the code: by its HMAC when named by value.
    async fn filter(&self, store: &Store) -> Result<Document, StoreError> {
        match self {
            CodeRef::Code { pool, code } => store.code_filter(pool, code).await,
            // An order's codes and a code by id are found in their pools
            // first (a read that may go to every shard), so the write names
            // them and goes to their shards alone (docs/scaling.md).
            CodeRef::Order(order) => {
                let pools = store.pools_holding(doc! {"order_id": *order}).await?;
                Ok(doc! {"pool": {"$in": pools}, "order_id": *order})
            }
            CodeRef::Id(id) => {
                let pools = store.pools_holding(doc! {"_id": object_id(*id)}).await?;
                Ok(doc! {"pool": {"$in": pools}, "_id": object_id(*id)})
            }
        }
    }

    /// How the code is named in messages: masked, because codes are secrets.
    pub fn describe(&self) -> String {
        match self {
            CodeRef::Code { pool, code } => format!("code {} in pool {pool:?}", mask(code)),
            CodeRef::Order(order) => format!("the codes of order {order:?}"),
            CodeRef::Id(id) => format!("code {id}"),
        }
    }
}

/// Why a lifecycle transition was refused. Each message says what to do next.
#[derive(Debug, thiserror::Error)]
pub enum LifecycleError {
    #[error("{what} does not exist; check the spelling, or find it with `codepool lookup`")]
    NotFound { what: String },
    #[error(
        "{what} was never issued, so it cannot be redeemed; only a code granted to an order can be"
    )]
    Unissued { what: String },
    #[error("{what} was already redeemed at {at}; nothing to do")]
    AlreadyUsed { what: String, at: String },
    #[error("{what} was voided at {at} ({reason}); a void code can be neither redeemed nor voided again")]
    Void {
        what: String,
        at: String,
        reason: String,
    },
    #[error("{what} was redeemed at {at}; a used code cannot be voided (the buyer has used it)")]
    Used { what: String, at: String },
    /// The redemption id was given to another code's redemption.
    #[error("redemption id {id:?} already redeemed another code; send a new id for each code")]
    ConflictingRedemption { id: String },
    /// A void starts from stock or from an order ([`Transition::Void`]),
    /// and a held code is in neither: its hold (or bundle) has it.
    #[error("{}", held_words(.what, .held))]
    Held { what: String, held: HeldBy },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Who has a held code, as a refusal to void it names them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldBy {
    /// The checkout hold or the bundle that holds it.
    pub by: SetAside,
    /// The hold's owner (`shop:NAME`, `api-key-id:ID`), if it has one.
    pub owner: Option<String>,
    /// When the hold ends unless it is paid or released first.
    pub until: Option<String>,
}

/// Why a held code was not voided, and what to do instead.
fn held_words(what: &str, held: &HeldBy) -> String {
    match &held.by {
        SetAside::Hold { hold_id } => format!(
            "{what} is held by checkout hold {hold_id:?}{}{}, so it cannot be voided: a void takes a code from stock or from an order, and a held code is in neither. Release the hold first (its owner: DELETE /v1/holds/{hold_id}), or let it be paid or expire, then void the code (once paid, void the order). To withdraw it now, with every code of its delivery, held or not, recall the import: `codepool void --import IMPORT_ID`",
            held.owner.as_deref().map_or(String::new(), |o| format!(" of {o}")),
            held.until.as_deref().map_or(String::new(), |t| format!(", until {t}")),
        ),
        SetAside::Bundle { order_id } => format!(
            "{what} is held for bundle order {order_id:?} while the bundle is put together, so it cannot be voided yet. In a moment it is the order's (void it with `codepool void --order {order_id}`) or back in stock (void it again then)"
        ),
    }
}

/// A transition that happened: the code as it was before, and when.
#[derive(Debug, Clone, PartialEq)]
pub struct Applied {
    pub before: Code,
    pub at: DateTime,
}

/// What happened to a voided code's hot-pool candidate, and to the order.
#[derive(Debug, Clone, PartialEq)]
pub enum VoidOutcome {
    /// These codes are void now: the one named, or every code of the
    /// order that was not void or used. `backorder_cancelled`: the order
    /// also waited for more codes (stock ran short), and no longer does.
    Voided {
        applied: Vec<Applied>,
        backorder_cancelled: bool,
    },
    /// The order held no code yet: its waiting backorder was cancelled, so
    /// it will not be fulfilled when stock arrives.
    BackorderCancelled { order_id: String },
}

/// Codes voided by one expiry run, by pool, so the caller can drop them
/// from the hot pool.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Expired {
    pub by_pool: Vec<(String, Vec<CodeId>)>,
}

impl Expired {
    pub fn total(&self) -> usize {
        self.by_pool.iter().map(|(_, ids)| ids.len()).sum()
    }
}

/// What the SMS service said about a grant's text (routing key of the
/// receipt: `sms.sent` or `sms.failed`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReceiptKind {
    Sent,
    Failed,
}

impl ReceiptKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Sent => "sent",
            Self::Failed => "failed",
        }
    }
}

/// What applying a receipt did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReceiptOutcome {
    Applied,
    /// The same receipt was applied before (a redelivery).
    Duplicate,
    /// No code is granted to that order.
    UnknownOrder,
}

/// Explains why a conditional transition on `doc` matched nothing.
fn refusal(what: String, code: Option<Code>, redeeming: bool) -> LifecycleError {
    let Some(code) = code else {
        return LifecycleError::NotFound { what };
    };
    match code.status {
        CodeStatus::Used if redeeming => LifecycleError::AlreadyUsed {
            what,
            at: when(code.used_at),
        },
        CodeStatus::Used => LifecycleError::Used {
            what,
            at: when(code.used_at),
        },
        CodeStatus::Void => LifecycleError::Void {
            what,
            at: when(code.voided_at),
            reason: code.void_reason.unwrap_or_else(|| "no reason given".into()),
        },
        CodeStatus::Unissued => LifecycleError::Unissued { what },
        // Held for a checkout: nobody has it yet, like an unissued code.
        CodeStatus::Held => LifecycleError::Unissued { what },
        // The status changed between the update and the read: the caller
        // may simply run the command again.
        CodeStatus::Issued => LifecycleError::Store(StoreError::Rejected(format!(
            "{what} changed while it was being updated (now {}); run the command again",
            code.status
        ))),
    }
}

impl Store {
    /// The pools of the codes `filter` finds.
    pub(crate) async fn pools_holding(&self, filter: Document) -> Result<Vec<Bson>, StoreError> {
        Ok(self.collection(CODES).distinct("pool", filter).await?)
    }

    /// The code `target` names (the first, for an order), as it is now.
    pub async fn find_code(&self, target: CodeRef<'_>) -> Result<Option<Code>, StoreError> {
        self.typed::<CodeDoc>(CODES)
            .find_one(target.filter(self).await?)
            .await?
            .map(|d| d.into_code(&self.keys))
            .transpose()
    }

    /// Applies `write` (a move and what it records, given a target) to the
    /// code `target` names, in one conditional update; returns the code as
    /// it was before, or `None` when nothing matched.
    async fn apply(
        &self,
        target: CodeRef<'_>,
        write: &(dyn Fn(Document) -> StatusWrite + Sync),
    ) -> Result<Option<Code>, StoreError> {
        let filter = target.filter(self).await?;
        self.write_status_one::<CodeDoc>(&write(filter))
            .await?
            .map(|d| d.into_code(&self.keys))
            .transpose()
    }

    /// Applies `write` to every code `target` names that its move can take:
    /// the code named, or each code of the order, one conditional update
    /// each. Empty when none could.
    async fn apply_all(
        &self,
        target: CodeRef<'_>,
        write: &(dyn Fn(Document) -> StatusWrite + Sync),
        at: DateTime,
    ) -> Result<Vec<Applied>, StoreError> {
        let mut done = Vec::new();
        // An order holds at most MAX_QUANTITY codes; the bound only guards
        // against a loop that a bug would make endless.
        for _ in 0..=codepool_domain::MAX_QUANTITY {
            match self.apply(target, write).await? {
                Some(before) => done.push(Applied { before, at }),
                None => break,
            }
            if matches!(target, CodeRef::Code { .. }) {
                break;
            }
        }
        Ok(done)
    }

    /// Redeems an issued code, or every issued code of an order: status
    /// 1 → 2 with `used_at`. When none is issued, the refusal says why
    /// (unissued, used or void).
    pub async fn redeem(&self, target: CodeRef<'_>) -> Result<Vec<Applied>, LifecycleError> {
        match self.redeem_tagged(target, None).await? {
            Redeemed::Now(done) => Ok(done),
            // Only a tagged redemption is recognised as made before.
            Redeemed::Before(c) => Err(refusal(target.describe(), Some(*c), true)),
        }
    }

    /// [`Store::redeem`], recording `tag` on the code: the same tag again
    /// is [`Redeemed::Before`], and a tag already on another code is
    /// [`LifecycleError::ConflictingRedemption`].
    pub async fn redeem_tagged(
        &self,
        target: CodeRef<'_>,
        tag: Option<&RedemptionTag>,
    ) -> Result<Redeemed, LifecycleError> {
        let now = DateTime::now();
        let mark = tag.map(|t| doc! {"id": &t.id, "by": &t.by});
        let write = |target: Document| StatusWrite::redeem(target, now, mark.clone());
        // A tagged redemption claims its id first, in the id's guard
        // ([`crate::redemptions::REDEMPTION_IDS`]): an id already on another
        // code is refused before any code moves.
        let guarded = match tag {
            Some(t) => match self.find_code(target).await? {
                Some(c) if self.guard_redemption(t, &c, now).await? => Some((t, c.id)),
                Some(_) => return Err(LifecycleError::ConflictingRedemption { id: t.id.clone() }),
                None => None,
            },
            None => None,
        };
        let done = self.apply_all(target, &write, now).await?;
        if !done.is_empty() {
            return Ok(Redeemed::Now(done));
        }
        let code = self.find_code(target).await?;
        if let Some((t, id)) = guarded {
            if !self.redeemed_with(id, t).await? {
                self.unguard_redemption(t, id).await;
            }
        }
        if let (Some(c), Some(t)) = (&code, tag) {
            if c.status == CodeStatus::Used && self.redeemed_with(c.id, t).await? {
                return Ok(Redeemed::Before(Box::new(c.clone())));
            }
        }
        Err(refusal(target.describe(), code, true))
    }

    /// True when code `id` was redeemed with `tag`.
    async fn redeemed_with(&self, id: CodeId, tag: &RedemptionTag) -> Result<bool, StoreError> {
        let filter =
            doc! {"_id": object_id(id), "redemption.id": &tag.id, "redemption.by": &tag.by};
        Ok(self
            .collection(CODES)
            .find_one(filter)
            .projection(doc! {"_id": 1})
            .await?
            .is_some())
    }

    /// Voids an unissued or issued code, or every such code of an order:
    /// status → 3 with `voided_at` and `void_reason`. The order stays
    /// recorded on the code (so the order can never be granted another one
    /// by a redelivered purchase), and a pending SMS relay is called off.
    /// An order's waiting backorder (all of it, or the lines stock did not
    /// cover) is cancelled too.
    pub async fn void(
        &self,
        target: CodeRef<'_>,
        reason: &str,
    ) -> Result<VoidOutcome, LifecycleError> {
        let now = DateTime::now();
        let write = |target: Document| StatusWrite::void(target, now, reason);
        // The backorder is cancelled before the codes are voided: a
        // fulfilment that claims for the order after this write finds it
        // cancelled and withdraws its codes itself (see
        // [`Store::withdraw_cancelled`]), and one that claimed before it
        // has its codes voided by the step below. Either way the order
        // keeps no live code.
        // So are the order's replacements still waiting for their code
        // (see [`Store::cancel_replacements`]).
        let cancelled = match target {
            CodeRef::Order(order_id) => {
                let backorder = self.cancel_backorder(order_id, reason).await?;
                let replacements = self.cancel_replacements(order_id, reason).await?;
                backorder || replacements > 0
            }
            CodeRef::Code { .. } | CodeRef::Id(_) => false,
        };
        let applied = self.apply_all(target, &write, now).await?;
        if !applied.is_empty() {
            return Ok(VoidOutcome::Voided {
                applied,
                backorder_cancelled: cancelled,
            });
        }
        if let (true, CodeRef::Order(order_id)) = (cancelled, target) {
            return Ok(VoidOutcome::BackorderCancelled {
                order_id: order_id.to_owned(),
            });
        }
        let code = self.find_code(target).await?;
        if let Some(held) = self.held_by(code.as_ref()).await? {
            return Err(LifecycleError::Held {
                what: target.describe(),
                held,
            });
        }
        Err(refusal(target.describe(), code, false))
    }

    /// Who has `code`, when it is held (by a checkout hold or a bundle).
    async fn held_by(&self, code: Option<&Code>) -> Result<Option<HeldBy>, StoreError> {
        let Some(code) = code.filter(|c| c.status == CodeStatus::Held) else {
            return Ok(None);
        };
        let Some(by) = code.set_aside() else {
            return Ok(None);
        };
        let key = code.holder.as_ref().map(|h| h.order_id.as_str());
        let hold = match key {
            Some(key) => self.hold_of_key(key).await?,
            None => None,
        };
        Ok(Some(HeldBy {
            by,
            owner: hold.as_ref().and_then(|h| h.owner.clone()),
            until: hold.map(|h| when(Some(h.expires_at.to_chrono()))),
        }))
    }

    /// Of the codes just issued to `grants` (code id, order id) by a
    /// backorder's fulfilment, voids those whose order's backorder was
    /// cancelled meanwhile (an operator voided the order while the pool
    /// resumed), before any event is published for them, and returns
    /// their ids. Cancelling a backorder and fulfilling it exclude each
    /// other: see [`Store::void`].
    pub async fn withdraw_cancelled(
        &self,
        grants: &[(CodeId, &str)],
    ) -> Result<Vec<CodeId>, StoreError> {
        if grants.is_empty() {
            return Ok(Vec::new());
        }
        let mut orders: Vec<&str> = grants.iter().map(|(_, o)| *o).collect();
        orders.sort_unstable();
        orders.dedup();
        let docs: Vec<Document> = self
            .collection(BACKORDERS)
            .find(doc! {"order_id": {"$in": &orders}, "status": BackorderState::Cancelled.as_str()})
            .projection(doc! {"order_id": 1, "cancel_reason": 1, "pool": 1})
            .await?
            .try_collect()
            .await?;
        // The backorders' pools are their codes' (a backorder is fulfilled
        // from its own pool): the write names them.
        let mut pools: Vec<String> = (docs.iter())
            .filter_map(|d| d.get_str("pool").ok().map(str::to_owned))
            .collect();
        pools.sort_unstable();
        pools.dedup();
        let cancelled: HashMap<String, Option<String>> = docs
            .into_iter()
            .filter_map(|d| {
                let order = d.get_str("order_id").ok()?.to_owned();
                Some((order, d.get_str("cancel_reason").ok().map(str::to_owned)))
            })
            .collect();
        let ids: Vec<CodeId> = (grants.iter())
            .filter(|(_, o)| cancelled.contains_key(*o))
            .map(|(id, _)| *id)
            .collect();
        if ids.is_empty() {
            return Ok(ids);
        }
        let oids: Vec<ObjectId> = ids.iter().copied().map(object_id).collect();
        let pools: Vec<&str> = pools.iter().map(String::as_str).collect();
        self.write_status(&StatusWrite::withdrawn(
            doc! {"pool": {"$in": pools}, "_id": {"$in": oids}},
        ))
        .await?;
        Ok(ids)
    }

    /// Voids unissued and held codes whose `expires_at` is at or before `now`, with
    /// reason `expired`, in `pool` or in every pool. Returns their ids by
    /// pool so the caller drops them from the hot pool. (The claim already
    /// refuses expired codes; this makes them visible as void and keeps the
    /// hot pool clean.)
    pub async fn expire(&self, pool: Option<&str>, now: DateTime) -> Result<Expired, StoreError> {
        let pools: Vec<String> = match pool {
            Some(p) => vec![p.to_owned()],
            None => self.pools().await?.into_iter().map(|p| p.name).collect(),
        };
        // Stock and live holds alike (the gate's Expire move), each on its
        // own partial index, so the sweep costs what has expired, not the
        // stock: `unissued_expiry` (status 0 with an expiry) gives one short
        // range per pool; `held_since` holds only held codes. A held code
        // that expired is never paid for: the payment takes another code.
        let mut by_pool: HashMap<String, Vec<CodeId>> = HashMap::new();
        for (status, index) in [
            (CodeStatus::Unissued, "unissued_expiry"),
            (CodeStatus::Held, "held_since"),
        ] {
            let pools =
                doc! {"pool": {"$in": &pools}, "expires_at": {"$exists": true, "$lte": now}};
            self.expire_matching(pools, status, index, &mut by_pool)
                .await?;
        }
        let mut by_pool: Vec<(String, Vec<CodeId>)> = by_pool.into_iter().collect();
        by_pool.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(Expired { by_pool })
    }

    /// Voids, as expired, every code in `status` matching `target` (found
    /// on `index`), a batch at a time, and adds their ids by pool to
    /// `by_pool`.
    async fn expire_matching(
        &self,
        target: Document,
        status: CodeStatus,
        index: &str,
        by_pool: &mut HashMap<String, Vec<CodeId>>,
    ) -> Result<(), StoreError> {
        let expire = |target: Document| StatusWrite::expired(target, status, EXPIRED_REASON);
        let filter = expire(target.clone()).filter();
        loop {
            let docs: Vec<Document> = self
                .collection(CODES)
                .find(filter.clone())
                .projection(doc! {"_id": 1, "pool": 1, "status": 1, "order_id": 1})
                .hint(mongodb::options::Hint::Name(index.into()))
                .limit(EXPIRE_BATCH)
                .await?
                .try_collect()
                .await?;
            let found = docs
                .iter()
                .map(|d| {
                    let corrupt = |e: bson::document::ValueAccessError| StoreError::Corrupt {
                        collection: CODES.into(),
                        message: format!("an expired code without an ObjectId _id or a pool: {e}"),
                    };
                    Ok((
                        d.get_object_id("_id").map_err(corrupt)?,
                        d.get_str("pool").map_err(corrupt)?,
                    ))
                })
                .collect::<Result<Vec<(ObjectId, &str)>, StoreError>>()?;
            if found.is_empty() {
                break;
            }
            let ids: Vec<ObjectId> = found.iter().map(|(id, _)| *id).collect();
            let mut batch = target.clone();
            if !batch.contains_key("pool") {
                let mut pools: Vec<&str> = found.iter().map(|(_, p)| *p).collect();
                pools.sort_unstable();
                pools.dedup();
                batch.insert("pool", doc! {"$in": pools});
            }
            batch.insert("_id", doc! {"$in": &ids});
            self.write_status(&expire(batch)).await?;
            self.note_voided_while_held(&crate::holds::was_held(&docs))
                .await?;
            // Whatever matched is void now, whoever voided it: none of
            // these ids may stay a claim candidate.
            for (id, pool) in &found {
                by_pool
                    .entry((*pool).to_owned())
                    .or_default()
                    .push(code_id(*id));
            }
            if (found.len() as i64) < EXPIRE_BATCH {
                break;
            }
        }
        Ok(())
    }

    /// Applies an SMS receipt to the codes of `order_id` its event carried:
    /// those on `lines`, or every code of the order (`None`: the event of a
    /// one-code order), given by its `replacement` (0: when the order was
    /// placed), so a late receipt of a replaced code's text does not mark
    /// the code that replaced it. `receipt_id` (the AMQP message id, when the SMS
    /// service sets one) makes a redelivered receipt a no-op; without it a
    /// repeated `sent` is still a no-op, and a repeated `failed` counts
    /// again.
    pub async fn apply_sms_receipt(
        &self,
        order_id: &str,
        lines: Option<&[u32]>,
        replacement: u32,
        kind: ReceiptKind,
        error: Option<&str>,
        receipt_id: Option<&str>,
    ) -> Result<ReceiptOutcome, StoreError> {
        let now = DateTime::now();
        let repl = match replacement {
            0 => Bson::Null,
            n => Bson::Int64(i64::from(n)),
        };
        let mut filter = doc! {"order_id": order_id, "order_repl": repl};
        if let Some(lines) = lines {
            // Line 0 is stored as no line at all.
            let lines: Vec<Bson> = lines
                .iter()
                .map(|&l| {
                    if l == 0 {
                        Bson::Null
                    } else {
                        Bson::Int64(i64::from(l))
                    }
                })
                .collect();
            filter.insert("order_line", doc! {"$in": lines});
        }
        match receipt_id {
            Some(id) => {
                filter.insert("sms_history.receipt_id", doc! {"$ne": id});
            }
            None if kind == ReceiptKind::Sent => {
                filter.insert("is_sms", doc! {"$ne": 1});
            }
            None => {}
        }
        let mut entry = doc! {"event": kind.as_str(), "at": now};
        if let Some(e) = error {
            entry.insert("error", e);
        }
        if let Some(id) = receipt_id {
            entry.insert("receipt_id", id);
        }
        let push = doc! {"sms_history": {"$each": [entry], "$slice": -SMS_HISTORY_LEN}};
        let update = match kind {
            ReceiptKind::Sent => doc! {
                "$set": {"is_sms": 1},
                "$min": {"sms_sent_at": now},
                "$push": push,
            },
            ReceiptKind::Failed => doc! {
                "$set": {"sms_failed_at": now, "sms_error": error.unwrap_or("unknown error")},
                "$inc": {"sms_failures": 1_i64},
                "$push": push,
            },
        };
        let r = self.collection(CODES).update_many(filter, update).await?;
        if r.matched_count > 0 {
            return Ok(ReceiptOutcome::Applied);
        }
        let known = self
            .collection(CODES)
            .count_documents(doc! {"order_id": order_id})
            .await?;
        Ok(if known > 0 {
            ReceiptOutcome::Duplicate
        } else {
            ReceiptOutcome::UnknownOrder
        })
    }

    /// Records that an order's SMS-pending event was published again by an
    /// operator (`codepool resend`), confirmed by the broker.
    pub async fn record_sms_resent(&self, code_ids: &[(&str, CodeId)]) -> Result<(), StoreError> {
        let now = DateTime::now();
        self.collection(CODES)
            .update_many(
                crate::codes::pooled_ids(code_ids),
                doc! {
                    "$set": {"sms_published_at": now, "sms_resent_at": now},
                    "$unset": {"sms_pending": ""},
                    "$inc": {"sms_resends": 1_i64},
                    "$push": {"sms_history": {"$each": [{"event": "resent", "at": now}], "$slice": -SMS_HISTORY_LEN}},
                },
            )
            .await?;
        Ok(())
    }
}
