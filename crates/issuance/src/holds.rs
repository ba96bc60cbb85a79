//! Checkout holds: codes set aside for a buyer while they pay, shown to no
//! one, and either turned into the order's grants when the payment arrives
//! ([`commit_paid`], called by the intake for an order that names its
//! `hold_id`) or put back in stock when the hold is released or expires
//! ([`release`], [`expire_due`]), waiting backorders first.
//!
//! A hold claims through the same batched claim as an order, with
//! [`Move::Hold`]: its codes are `held` under keys of their own
//! ([`hold_key`]), so a retried hold takes no line twice, and commit and
//! release are conditional writes on "still held under this key", so a
//! payment racing an expiry gives each code to exactly one of them. A late
//! payment is never refused: whatever its hold no longer holds is claimed
//! from stock, or backordered, like any order.

use std::collections::{BTreeSet, HashMap, HashSet};

use bson::oid::ObjectId;
use bson::DateTime;
use codepool_domain::gate::{HoldEnd, Move, Refused};
use codepool_domain::{Item, Purchase, PurchaseError, RejectReason, MAX_ITEMS};
use codepool_store::holds::{HeldCode, HoldDoc, HoldState};
use codepool_store::{Store, StoreError};
use serde_json::{Map, Value};
use tracing::{info, warn};

use crate::batcher::{BatchError, Batcher, Pending, Shape, Shared};
use crate::claim::{ClaimAsk, ClaimError};
use crate::guard::Guard;
use crate::held::item_claims;
use crate::intake::Intake;
use crate::plan::{admit, Admission};
use crate::ClaimWay;

/// A hold's time to live when the request names none.
pub const DEFAULT_TTL_SECONDS: u64 = 900;
/// The longest a hold may last.
pub const MAX_TTL_SECONDS: u64 = 3600;
/// The largest share of a pool's stock (free plus held), in percent, that
/// one buyer may hold at once, unless the pool says otherwise.
pub const DEFAULT_HOLD_SHARE: u32 = 10;
/// How many open holds one buyer may have, unless the pool says otherwise.
pub const DEFAULT_HOLDS_PER_UID: u32 = 5;
/// The largest share of a pool's stock (free plus held), in percent, that
/// one shop's keys together may hold at once, unless the pool says
/// otherwise: no shop's checkout crowds the others out. A key of no shop
/// (the operator's own backend) may hold all of it unless the pool sets
/// `hold_share_per_owner`.
pub const DEFAULT_HOLD_SHARE_PER_SHOP: u32 = 50;

/// The share (percent) `owner` may hold of a pool whose setting is
/// `setting`.
fn owner_share(setting: Option<u32>, owner: &str) -> u32 {
    setting.unwrap_or(if crate::shops::shop_of(Some(owner)).is_some() {
        DEFAULT_HOLD_SHARE_PER_SHOP
    } else {
        100
    })
}

/// A request for a hold, as the doors hand it in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HoldRequest {
    pub hold_id: String,
    pub uid: String,
    pub items: Vec<Item>,
    pub ttl_seconds: u64,
}

impl HoldRequest {
    /// Parses and checks a hold body: `{"hold_id", "uid", "items":
    /// [{"pool", "quantity"}], "ttl_seconds"}`. Errors name their field.
    pub fn parse(body: &[u8]) -> Result<Self, PurchaseError> {
        let map: Map<String, Value> = serde_json::from_slice(body).map_err(|e| {
            PurchaseError::new(
                RejectReason::NotJson,
                format!("the body is not a JSON object ({e}); send {{\"hold_id\", \"uid\", \"items\": [{{\"pool\", \"quantity\"}}], \"ttl_seconds\"}}"),
            )
        })?;
        // The ids follow the rules of an order's (length, visible text).
        let hold_id = codepool_domain::purchase::required_id(&map, "hold_id")?;
        if let Some(prefix) = codepool_domain::purchase::channel_prefix(&hold_id) {
            return Err(PurchaseError::new(
                RejectReason::ConflictingOrder,
                format!("hold ids starting with {prefix:?} are a marketplace channel's own (eneba:, g2a:, kinguin:): pick another hold id"),
            )
            .on("hold_id"));
        }
        let uid = codepool_domain::purchase::required_id(&map, "uid")?;
        let items = match map.get("items") {
            Some(v) => codepool_domain::purchase::parse_items(v)?,
            None => {
                return Err(PurchaseError::new(
                    RejectReason::MissingField,
                    format!("field \"items\" is required: 1 to {MAX_ITEMS} items {{\"pool\", \"quantity\"}}"),
                )
                .on("items"))
            }
        };
        let ttl_seconds = match map.get("ttl_seconds") {
            None | Some(Value::Null) => DEFAULT_TTL_SECONDS,
            Some(Value::Number(n)) => match n.as_u64() {
                Some(t) if (1..=MAX_TTL_SECONDS).contains(&t) => t,
                _ => return Err(bad_ttl(&n.to_string())),
            },
            Some(other) => return Err(bad_ttl(&other.to_string())),
        };
        Ok(Self {
            hold_id,
            uid,
            items,
            ttl_seconds,
        })
    }
}

fn bad_ttl(got: &str) -> PurchaseError {
    PurchaseError::new(
        RejectReason::WrongType,
        format!("field \"ttl_seconds\" must be a whole number from 1 to {MAX_TTL_SECONDS}, not {got}; leave it out for {DEFAULT_TTL_SECONDS}"),
    )
    .on("ttl_seconds")
}

/// Why a hold was not made (nothing is held), or not found.
#[derive(Debug, thiserror::Error)]
pub enum HoldError {
    /// A field, an unknown pool or a pool the shop may not use.
    #[error("{0}")]
    Invalid(PurchaseError),
    #[error("hold {0:?} was already made with other items, buyer or time to live; the first hold stands. Use a new hold_id for a new hold")]
    Conflict(String),
    #[error("out of stock: not enough free codes to hold every item; nothing was held ({})", free_words(.free))]
    InsufficientStock {
        /// What each pool of the request has free now.
        free: Vec<(String, u64)>,
    },
    #[error("pool {0:?} is paused; nothing was held. Try again once it is resumed")]
    Paused(String),
    #[error("buyer {uid:?} has had {limit} code(s) of pool {pool:?} (orders, paid and open holds counted), its per-user limit; its payment would be refused, so nothing was held")]
    PerUserLimit {
        uid: String,
        pool: String,
        limit: u32,
    },
    #[error("buyer {uid:?} would hold {wanted} codes of pool {pool:?}, over the {limit} one buyer may hold at once; nothing was held")]
    OverShare {
        uid: String,
        pool: String,
        wanted: u64,
        limit: u64,
    },
    #[error("buyer {uid:?} has {limit} open holds already, the most a buyer may have; pay for or release one first")]
    TooManyHolds { uid: String, limit: u64 },
    #[error("this key (or its shop) would hold {wanted} codes of pool {pool:?}, over the {limit} one key or shop may hold at once; nothing was held")]
    OwnerOverShare {
        pool: String,
        wanted: u64,
        limit: u64,
    },
    #[error("no hold {0:?} (of this key)")]
    NotFound(String),
    #[error(transparent)]
    Claim(#[from] ClaimError),
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The hold got no answer from its batch.
    #[error(transparent)]
    Batch(#[from] BatchError),
    /// Its whole batch failed: the same error for each hold of it.
    #[error(transparent)]
    Failed(Shared<HoldError>),
}

fn free_words(free: &[(String, u64)]) -> String {
    free.iter()
        .map(|(p, n)| format!("{p}: {n} free"))
        .collect::<Vec<_>>()
        .join(", ")
}

impl HoldError {
    /// MongoDB is away: the same request may be sent again.
    pub fn is_unavailable(&self) -> bool {
        match self {
            Self::Claim(e) => e.is_unavailable(),
            Self::Store(e) => e.is_unavailable(),
            Self::Batch(_) => true,
            Self::Failed(e) => e.is_unavailable(),
            _ => false,
        }
    }

    /// Worth answering "come back later": a server is away, or this
    /// process lacks a key codes are sealed with (it holds nothing until
    /// its key file has it, and reads the file again by itself).
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Claim(e) => e.is_retryable(),
            Self::Store(e) => e.is_retryable(),
            Self::Failed(e) => e.0.is_retryable(),
            _ => self.is_unavailable(),
        }
    }
}

/// A hold as a door shows it: its document, with its state as of now (a
/// held hold past its time is `expired`, whether or not the sweep has
/// returned its codes yet).
pub fn state_now(h: &HoldDoc) -> HoldState {
    if h.state == HoldState::Held && h.expires_at <= DateTime::now() {
        HoldState::Expired
    } else {
        h.state
    }
}

/// Whether the request asks for the same hold as `h`.
fn same_hold(h: &HoldDoc, req: &HoldRequest, owner: Option<&str>) -> bool {
    h.uid == req.uid
        && h.items == req.items
        && h.ttl_seconds == req.ttl_seconds as i64
        && h.owner.as_deref() == owner
}

/// A hold as its owner names it: the owner (`None`: no owner) and the hold
/// id. Hold ids are each owner's own.
type HoldName = (Option<String>, String);

/// A request for a hold and who makes it, as a batch takes it.
#[derive(Debug, Clone)]
pub struct HoldAsk {
    pub req: HoldRequest,
    /// The key (`api-key-id:ID`) that asks; a shop's key's holds are the
    /// shop's.
    pub owner: Option<String>,
    pub shop: Option<String>,
}

/// What one hold of a batch came to.
pub type Placed = Result<(HoldDoc, bool), HoldError>;

/// Places a batch of holds through one batched claim, each all or nothing,
/// answers aligned with `asks`: one round of reads (the ids, the buyers'
/// open holds, the pools' settings and stock), one journaled insert of the
/// new holds beside one journaled claim of every item, and one release of
/// what short holds took. An error is the batch's: nothing of it is held.
/// Runs in a `place_holds` span (with the batch's size); each hold placed
/// is one line naming it.
#[tracing::instrument(name = "place_holds", skip_all, fields(size = asks.len()))]
pub async fn place_many(intake: &Intake, asks: Vec<HoldAsk>) -> Result<Vec<Placed>, HoldError> {
    let mut out: Vec<Option<Placed>> = asks.iter().map(|_| None).collect();
    let read = read_batch(intake, &asks, &mut out).await?;
    let (todo, first) = sort_out(&asks, &read, &mut out);
    let limits = Limits {
        open: &read.open,
        owned: &read.owned,
        owners: &read.owners,
        docs: &read.docs,
        counted: &read.counted,
    };
    let todo = per_user_room(intake.store(), &asks, todo, &read, &mut out).await?;
    let todo = within_limits(intake.store(), &asks, todo, limits, &mut out).await?;
    let (holds, short) = record_and_claim(intake, &asks, &read.owners, &todo, &mut out).await?;
    let free = release_short(
        intake,
        &(holds.iter())
            .filter(|(_, h)| short.contains(&h.nonce))
            .map(|(_, h)| h)
            .collect::<Vec<_>>(),
    )
    .await?;
    for (k, h) in holds {
        if short.contains(&h.nonce) {
            metrics::counter!("codepool_holds_total", "outcome" => "short").increment(1);
            let free = (h.items.iter())
                .map(|i| (i.pool.clone(), free.get(&i.pool).copied().unwrap_or(0)))
                .collect();
            out[k] = Some(Err(HoldError::InsufficientStock { free }));
        } else {
            let shop = asks[k].shop.as_deref();
            info!(hold_id = %h.hold_id, uid = %h.uid, pool = h.items.first().map_or("", |i| i.pool.as_str()), shop, codes = h.quantity(), "hold placed");
            metrics::counter!("codepool_holds_total", "outcome" => "held").increment(1);
            crate::channels::stock::changed(h.items.iter().map(|i| i.pool.as_str()));
            out[k] = Some(Ok((h, true)));
        }
    }
    // Repeats within the batch (the same owner and hold id) get what the
    // first got.
    for (k, a) in asks.iter().enumerate() {
        if out[k].is_none() {
            let f = first[&name_of(&read.owners, k, a)];
            out[k] =
                Some(match &out[f] {
                    Some(Ok((h, _))) => again(h.clone(), &a.req, read.owners[k].as_deref()),
                    // A refusal of the same request: the same refusal (a
                    // marketplace delivers each callback twice at once).
                    Some(Err(e)) if asks[f].req == a.req => Err(refused_again(e)
                        .unwrap_or_else(|| HoldError::Conflict(a.req.hold_id.clone()))),
                    _ => Err(HoldError::Conflict(a.req.hold_id.clone())),
                });
        }
    }
    Ok(out.into_iter().flatten().collect())
}

/// A copy of a refusal that says why nothing was held, for a repeat of
/// the refused request.
fn refused_again(e: &HoldError) -> Option<HoldError> {
    Some(match e {
        HoldError::Invalid(p) => HoldError::Invalid(p.clone()),
        HoldError::InsufficientStock { free } => {
            HoldError::InsufficientStock { free: free.clone() }
        }
        HoldError::Paused(p) => HoldError::Paused(p.clone()),
        HoldError::PerUserLimit { uid, pool, limit } => HoldError::PerUserLimit {
            uid: uid.clone(),
            pool: pool.clone(),
            limit: *limit,
        },
        HoldError::OverShare {
            uid,
            pool,
            wanted,
            limit,
        } => HoldError::OverShare {
            uid: uid.clone(),
            pool: pool.clone(),
            wanted: *wanted,
            limit: *limit,
        },
        HoldError::TooManyHolds { uid, limit } => HoldError::TooManyHolds {
            uid: uid.clone(),
            limit: *limit,
        },
        HoldError::OwnerOverShare {
            pool,
            wanted,
            limit,
        } => HoldError::OwnerOverShare {
            pool: pool.clone(),
            wanted: *wanted,
            limit: *limit,
        },
        _ => return None,
    })
}

/// The name of ask `k`'s hold: its admitted owner and its hold id.
fn name_of(owners: &[Option<String>], k: usize, a: &HoldAsk) -> HoldName {
    (owners[k].clone(), a.req.hold_id.clone())
}

/// What a batch of holds reads before it decides anything.
struct BatchRead {
    /// Each ask's owner (a shop's hold is the shop's).
    owners: Vec<Option<String>>,
    /// The gate's guard over the pools' policies, read once.
    guard: Guard,
    /// The holds already recorded under the batch's ids, of every owner.
    existing: HashMap<HoldName, HoldDoc>,
    open: Vec<HoldDoc>,
    /// The codes the batch's owners (keys and shops) hold in open holds,
    /// per `(owner, pool)`, where a pool caps an owner's share.
    owned: HashMap<(String, String), u64>,
    docs: Vec<codepool_store::pools::PoolDoc>,
    counted: HashMap<String, u64>,
}

/// Everything the batch reads, at once: the pools' policies and the shops
/// (their pools must exist and be the shop's), the ids taken, the buyers'
/// open holds, the pools' settings and stock. Asks refused here are
/// answered in `out`.
async fn read_batch(
    intake: &Intake,
    asks: &[HoldAsk],
    out: &mut [Option<Placed>],
) -> Result<BatchRead, HoldError> {
    let store = intake.store();
    let probes: Vec<Purchase> = asks.iter().map(probe).collect();
    let mut names: Vec<&str> = probes.iter().flat_map(|p| p.pools()).collect();
    names.sort_unstable();
    names.dedup();
    let ids: Vec<&str> = asks.iter().map(|a| a.req.hold_id.as_str()).collect();
    let mut uids: Vec<&str> = asks.iter().map(|a| a.req.uid.as_str()).collect();
    uids.sort_unstable();
    uids.dedup();
    let admission = async {
        let policies = intake.policies.get_many(store, &names).await?;
        let admitted = admit(probes.iter().cloned().map(Ok).collect(), |p| {
            policies.contains_key(p)
        });
        let admitted = intake.shops.admit(store, admitted).await?;
        Ok::<_, StoreError>((policies, admitted))
    };
    let mut owners_asked: Vec<&str> = (asks.iter())
        .filter_map(|a| owner_of(a).map(|o| o.as_str()))
        .collect();
    owners_asked.sort_unstable();
    owners_asked.dedup();
    let (admission, existing, open, docs, counted) = futures::join!(
        admission,
        store.holds_named(&ids),
        store.open_holds_of_many(&uids),
        store.pools_named(&names),
        first_count(store, &names),
    );
    let docs = docs?;
    // Only an owner whose share some pool caps is counted (a key of no
    // shop is held back by the stock alone, by default).
    // The same rule as `within_limits`: a pool without a record has the
    // default setting.
    let setting =
        |pool: &str| (docs.iter().find(|p| p.name == pool)).and_then(|p| p.hold_share_per_owner());
    owners_asked.retain(|o| names.iter().any(|pool| owner_share(setting(pool), o) < 100));
    let owned = store.held_by_owners(&owners_asked, &names).await?;
    let (policies, admitted) = admission?;
    let mut owners: Vec<Option<String>> = Vec::with_capacity(asks.len());
    for (k, a) in admitted.into_iter().enumerate() {
        match a {
            Admission::Claim(p) => owners.push(p.owner),
            Admission::Reject(e) => {
                out[k] = Some(Err(HoldError::Invalid(e)));
                owners.push(None);
            }
            _ => owners.push(asks[k].owner.clone()),
        }
    }
    Ok(BatchRead {
        owners,
        guard: Guard::new(policies),
        existing: (existing?.into_iter())
            .map(|h| ((h.owner.clone(), h.hold_id.clone()), h))
            .collect(),
        open: open?,
        owned,
        docs,
        counted: counted?,
    })
}

/// Whose share a hold counts against: its shop's, for a shop's key (the
/// owner the shop admission will stamp), else its key's.
fn owner_of(a: &HoldAsk) -> Option<&String> {
    a.owner.as_ref()
}

/// The asks to place: not answered yet, not a hold id its owner recorded
/// before (answered as it stands), not of a paused pool, and the first of
/// their owner and id in the batch (the others get what it gets). Returns
/// them, and the first ask of each owner's hold id.
fn sort_out(
    asks: &[HoldAsk],
    read: &BatchRead,
    out: &mut [Option<Placed>],
) -> (Vec<usize>, HashMap<HoldName, usize>) {
    let mut first: HashMap<HoldName, usize> = HashMap::new();
    let mut todo: Vec<usize> = Vec::new();
    for (k, a) in asks.iter().enumerate() {
        if out[k].is_some() {
            continue;
        }
        let name = name_of(&read.owners, k, a);
        let pools = a.req.items.iter().map(|i| i.pool.as_str());
        if let Some(h) = read.existing.get(&name) {
            out[k] = Some(again(h.clone(), &a.req, read.owners[k].as_deref()));
        } else if let Some(Refused::Paused { pool }) = read.guard.stopped(Move::Hold, pools) {
            out[k] = Some(Err(HoldError::Paused(pool)));
        } else if let std::collections::hash_map::Entry::Vacant(e) = first.entry(name) {
            e.insert(k);
            todo.push(k);
        }
    }
    (todo, first)
}

/// Records the holds at `todo` while their codes are claimed. Each attempt
/// holds under keys of its own (its nonce), so one that loses the race to
/// record its owner's hold id holds nothing under the winner's, gives back
/// what it took, and is answered with the winner's hold. Codes whose hold
/// was never recorded (the process died first) outlive every hold's time
/// and go back then (`expire_due`). Returns the holds recorded, each with
/// its ask, and the nonces of those that fell short.
async fn record_and_claim(
    intake: &Intake,
    asks: &[HoldAsk],
    owners: &[Option<String>],
    todo: &[usize],
    out: &mut [Option<Placed>],
) -> Result<(Vec<(usize, HoldDoc)>, HashSet<String>), HoldError> {
    let store = intake.store();
    let now = DateTime::now();
    let mut holds: Vec<HoldDoc> = (todo.iter())
        .map(|&k| new_hold(&asks[k].req, owners[k].clone(), now))
        .collect();
    let (recorded, short) = futures::join!(store.insert_holds(&holds), hold_codes(intake, &holds));
    let (recorded, mut short) = match (recorded, short) {
        (Ok(r), Ok(s)) => (r, s),
        (r, s) => {
            let keys: Vec<String> = holds.iter().flat_map(HoldDoc::keys).collect();
            let _ = store.release_held(&keys).await;
            let _ = store.forget_holds(&holds.iter().collect::<Vec<_>>()).await;
            r?;
            s?;
            unreachable!("one of the two failed");
        }
    };
    for (h, key) in holds.iter_mut().zip(&recorded) {
        if let Some(key) = key {
            h.id.clone_from(key);
        }
    }
    let mut placed: Vec<(usize, HoldDoc)> = todo.iter().copied().zip(holds).collect();
    if recorded.iter().all(Option::is_some) {
        return Ok((placed, short));
    }
    // Lost races: the owner's hold of that id was recorded first.
    let lost: Vec<&(usize, HoldDoc)> = (placed.iter().zip(&recorded))
        .filter(|(_, r)| r.is_none())
        .map(|(p, _)| p)
        .collect();
    let again_ids: Vec<&str> = lost.iter().map(|(_, h)| h.hold_id.as_str()).collect();
    let raced: HashMap<HoldName, HoldDoc> = (store.holds_named(&again_ids).await?.into_iter())
        .map(|h| ((h.owner.clone(), h.hold_id.clone()), h))
        .collect();
    for (k, _) in &lost {
        if let Some(h) = raced.get(&name_of(owners, *k, &asks[*k])) {
            out[*k] = Some(again(h.clone(), &asks[*k].req, owners[*k].as_deref()));
        }
    }
    let keys: Vec<String> = lost.iter().flat_map(|(_, h)| h.keys()).collect();
    let nonces: HashSet<String> = lost.iter().map(|(_, h)| h.nonce.clone()).collect();
    let released = store.release_held(&keys).await?;
    intake.engine().offer(&released).await;
    placed.retain(|(_, h)| !nonces.contains(&h.nonce));
    short.retain(|n| !nonces.contains(n));
    Ok((placed, short))
}

/// The hold's pools as a purchase, for the checks every order passes.
fn probe(a: &HoldAsk) -> Purchase {
    Purchase {
        order_id: a.req.hold_id.clone(),
        uid: a.req.uid.clone(),
        phone: String::new(),
        pool: a.req.items[0].pool.clone(),
        purchased_at: None,
        quantity: a.req.items.iter().map(|i| i.quantity).sum(),
        owner: a.owner.clone(),
        shop: a.shop.clone(),
        hold_id: None,
        items: a.req.items.clone(),
    }
}

fn new_hold(req: &HoldRequest, owner: Option<String>, now: DateTime) -> HoldDoc {
    HoldDoc {
        id: req.hold_id.clone(),
        hold_id: req.hold_id.clone(),
        uid: req.uid.clone(),
        buyer: codepool_domain::buyer_key(&req.uid),
        items: req.items.clone(),
        owner,
        ttl_seconds: req.ttl_seconds as i64,
        created_at: now,
        expires_at: DateTime::from_millis(now.timestamp_millis() + req.ttl_seconds as i64 * 1000),
        state: HoldState::Held,
        order_id: None,
        ended_at: None,
        nonce: ObjectId::new().to_hex(),
        bundle: false,
    }
}

/// Puts back what short holds took, and forgets them so the same request
/// may be made again later. Returns what each pool has free now.
async fn release_short(
    intake: &Intake,
    short: &[&HoldDoc],
) -> Result<HashMap<String, u64>, StoreError> {
    if short.is_empty() {
        return Ok(HashMap::new());
    }
    let store = intake.store();
    let keys: Vec<String> = short.iter().flat_map(|h| h.keys()).collect();
    let released = store.release_held(&keys).await?;
    intake.engine().offer(&released).await;
    store.forget_holds(short).await?;
    let pools: Vec<&str> = short
        .iter()
        .flat_map(|h| h.items.iter().map(|i| i.pool.as_str()))
        .collect();
    free_in(store, pools).await
}

/// What `pools` have free now, as a short hold's answer tells it.
async fn free_in(store: &Store, mut pools: Vec<&str>) -> Result<HashMap<String, u64>, StoreError> {
    pools.sort_unstable();
    pools.dedup();
    let asks: Vec<(&str, u64)> = pools.iter().map(|p| (*p, 1_000_000)).collect();
    let counts = store.unissued_counts_upto(&asks).await?;
    Ok(pools.into_iter().map(str::to_owned).zip(counts).collect())
}

/// The same hold id again: the hold as it is, or a conflict.
fn again(h: HoldDoc, req: &HoldRequest, owner: Option<&str>) -> Placed {
    if h.bundle || !same_hold(&h, req, owner) {
        return Err(HoldError::Conflict(req.hold_id.clone()));
    }
    Ok((h, false))
}

/// How far a batch of holds first counts each pool's stock (free plus
/// held), in the same round trip as its other reads.
const FIRST_COUNT: u64 = 1000;

/// Each pool's stock (free plus held), counted no further than
/// [`FIRST_COUNT`] (free and held each).
async fn first_count(store: &Store, pools: &[&str]) -> Result<HashMap<String, u64>, StoreError> {
    let asks: Vec<(&str, u64)> = pools.iter().map(|p| (*p, FIRST_COUNT)).collect();
    let (free, held) = futures::join!(
        store.unissued_counts_upto(&asks),
        futures::future::try_join_all(pools.iter().map(|p| store.held_count_upto(p, FIRST_COUNT))),
    );
    Ok(pools
        .iter()
        .map(|p| p.to_string())
        .zip(free?.into_iter().zip(held?).map(|(f, h)| f + h))
        .collect())
}

/// What each buyer holds (open holds, codes per pool) and each owner holds
/// (codes per pool), as a batch of holds adds its own.
#[derive(Default)]
struct Tally {
    open_count: HashMap<String, u64>,
    holding: HashMap<(String, String), u64>,
    owned: HashMap<(String, String), u64>,
}

impl Tally {
    fn new(open: &[HoldDoc], owned: &HashMap<(String, String), u64>) -> Self {
        let mut t = Self {
            owned: owned.clone(),
            ..Self::default()
        };
        for h in open {
            let buyer = codepool_domain::buyer_key(&h.uid);
            *t.open_count.entry(buyer.clone()).or_default() += 1;
            for i in &h.items {
                *t.holding
                    .entry((buyer.clone(), i.pool.clone()))
                    .or_default() += u64::from(i.quantity);
            }
        }
        t
    }

    /// Why `req` (by `buyer`, for `owner`) is over a cap, if it is. `caps`
    /// gives a pool's open holds per buyer, codes per buyer and codes per
    /// owner (none: no cap).
    fn refusal(
        &self,
        req: &HoldRequest,
        buyer: &str,
        owner: Option<&String>,
        caps: &impl Fn(&str) -> (u64, u64, Option<u64>),
    ) -> Option<HoldError> {
        req.items.iter().find_map(|i| {
            let (per_uid, limit, owner_limit) = caps(&i.pool);
            if self.open_count.get(buyer).copied().unwrap_or(0) >= per_uid {
                return Some(HoldError::TooManyHolds {
                    uid: req.uid.clone(),
                    limit: per_uid,
                });
            }
            let key = (buyer.to_owned(), i.pool.clone());
            let wanted = self.holding.get(&key).copied().unwrap_or(0) + u64::from(i.quantity);
            if wanted > limit {
                return Some(HoldError::OverShare {
                    uid: req.uid.clone(),
                    pool: i.pool.clone(),
                    wanted,
                    limit,
                });
            }
            let (o, limit) = (owner?, owner_limit?);
            let key = (o.clone(), i.pool.clone());
            let wanted = self.owned.get(&key).copied().unwrap_or(0) + u64::from(i.quantity);
            (wanted > limit).then(|| HoldError::OwnerOverShare {
                pool: i.pool.clone(),
                wanted,
                limit,
            })
        })
    }

    /// A hold of the batch, within its caps, by `buyer` and `owner`.
    fn add(&mut self, buyer: &str, owner: Option<&String>, items: &[Item]) {
        *self.open_count.entry(buyer.to_owned()).or_default() += 1;
        for i in items {
            *self
                .holding
                .entry((buyer.to_owned(), i.pool.clone()))
                .or_default() += u64::from(i.quantity);
            if let Some(o) = owner {
                *self.owned.entry((o.clone(), i.pool.clone())).or_default() +=
                    u64::from(i.quantity);
            }
        }
    }
}

/// What the caps of a batch of holds are judged against.
struct Limits<'a> {
    /// The batch's buyers' open holds (by buyer key).
    open: &'a [HoldDoc],
    /// The codes the batch's owners hold, per `(owner, pool)`.
    owned: &'a HashMap<(String, String), u64>,
    /// Each ask's owner, as admitted.
    owners: &'a [Option<String>],
    docs: &'a [codepool_store::pools::PoolDoc],
    counted: &'a HashMap<String, u64>,
}

/// The pools' per-user limits, for the holds at `todo` ([`Guard::hold_room`]):
/// a hold whose payment the limit would refuse is refused now. Returns the
/// holds within them; the others are answered in `out`.
async fn per_user_room(
    store: &Store,
    asks: &[HoldAsk],
    todo: Vec<usize>,
    read: &BatchRead,
    out: &mut [Option<Placed>],
) -> Result<Vec<usize>, HoldError> {
    let mut open: HashMap<(String, String), u64> = HashMap::new();
    // Open holds past their time are expired, whether or not the sweep
    // has returned their codes yet: they will never be paid.
    let now = DateTime::now();
    for h in (read.open.iter()).filter(|h| h.state == HoldState::Held && h.expires_at > now) {
        let buyer = if h.buyer.is_empty() {
            codepool_domain::buyer_key(&h.uid)
        } else {
            h.buyer.clone()
        };
        for i in &h.items {
            *open.entry((i.pool.clone(), buyer.clone())).or_default() += u64::from(i.quantity);
        }
    }
    let wanted: Vec<(&str, &[Item])> = (todo.iter())
        .map(|&k| (asks[k].req.uid.as_str(), asks[k].req.items.as_slice()))
        .collect();
    let verdicts = read.guard.hold_room(store, &wanted, &open).await?;
    let mut within = Vec::with_capacity(todo.len());
    for (k, verdict) in todo.into_iter().zip(verdicts) {
        match verdict {
            Some(Refused::PerUserLimit { pool, limit }) => {
                metrics::counter!("codepool_holds_total", "outcome" => "per_user_limit")
                    .increment(1);
                out[k] = Some(Err(HoldError::PerUserLimit {
                    uid: asks[k].req.uid.clone(),
                    pool,
                    limit,
                }));
            }
            Some(Refused::Paused { pool }) => out[k] = Some(Err(HoldError::Paused(pool))),
            _ => within.push(k),
        }
    }
    Ok(within)
}

/// The caps, for the holds at `todo`: a buyer's open holds and share of
/// each pool (buyers compared by [`codepool_domain::buyer_key`]), and the
/// share of each pool one key or one shop may hold, counting the batch's
/// earlier holds. Returns the holds within them; the others are answered
/// in `out`.
async fn within_limits(
    store: &Store,
    asks: &[HoldAsk],
    todo: Vec<usize>,
    limits: Limits<'_>,
    out: &mut [Option<Placed>],
) -> Result<Vec<usize>, HoldError> {
    if todo.is_empty() {
        return Ok(todo);
    }
    let mut pools: Vec<&str> = (todo.iter())
        .flat_map(|&k| asks[k].req.items.iter().map(|i| i.pool.as_str()))
        .collect();
    pools.sort_unstable();
    pools.dedup();
    let docs: HashMap<&str, &codepool_store::pools::PoolDoc> =
        (limits.docs.iter()).map(|p| (p.name.as_str(), p)).collect();
    let setting = |pool: &str| match docs.get(pool) {
        Some(p) => (p.hold_share(), p.holds_per_uid()),
        None => (DEFAULT_HOLD_SHARE, DEFAULT_HOLDS_PER_UID),
    };
    let owner_setting = |pool: &str| docs.get(pool).and_then(|p| p.hold_share_per_owner());
    let smallest_owner_share = |pool: &str| {
        (limits.owners.iter().flatten())
            .map(|o| owner_share(owner_setting(pool), o))
            .min()
            .unwrap_or(100)
    };
    let counted = (limits.open, limits.counted);
    let stock = stock_of(
        store,
        asks,
        &todo,
        &pools,
        counted,
        &setting,
        &smallest_owner_share,
    )
    .await?;
    let share_of = |pool: &str, percent: u32| {
        (stock.get(pool).copied().unwrap_or(0) * u64::from(percent) / 100).max(1)
    };
    // What each buyer and each owner holds, as the batch adds its own.
    let mut tally = Tally::new(limits.open, limits.owned);
    let mut within = Vec::with_capacity(todo.len());
    let mut refused: Vec<(usize, HoldError)> = Vec::new();
    for k in todo {
        let req = &asks[k].req;
        let buyer = codepool_domain::buyer_key(&req.uid);
        let owner = limits.owners.get(k).cloned().flatten();
        let caps = |pool: &str| {
            let (share, per_uid) = setting(pool);
            let owner_limit = (owner.as_ref())
                .map(|o| owner_share(owner_setting(pool), o))
                .filter(|percent| *percent < 100) // else the stock is the limit
                .map(|percent| share_of(pool, percent));
            (u64::from(per_uid), share_of(pool, share), owner_limit)
        };
        if let Some(e) = tally.refusal(req, &buyer, owner.as_ref(), &caps) {
            refused.push((k, e));
            continue;
        }
        tally.add(&buyer, owner.as_ref(), &req.items);
        within.push(k);
    }
    stock_first(store, asks, refused, out).await?;
    Ok(within)
}

/// Answers the asks a cap refused: out of stock first. A pool that cannot
/// cover an item now is a conflict with what the pool has (`409
/// insufficient-stock`), whatever the caps would say; a cap (`429
/// hold-limit`) answers only a hold the stock could cover. An empty pool's
/// share is one code, so without this a hold of two on it was told to
/// hold less, not that there is nothing to hold. Counts only for refused
/// asks, each pool no further than the most one of them asks of it.
async fn stock_first(
    store: &Store,
    asks: &[HoldAsk],
    refused: Vec<(usize, HoldError)>,
    out: &mut [Option<Placed>],
) -> Result<(), HoldError> {
    if refused.is_empty() {
        return Ok(());
    }
    let wants = |k: usize| {
        let mut per_pool: HashMap<&str, u64> = HashMap::new();
        for i in &asks[k].req.items {
            *per_pool.entry(i.pool.as_str()).or_default() += u64::from(i.quantity);
        }
        per_pool
    };
    let mut need: HashMap<&str, u64> = HashMap::new();
    for (k, _) in &refused {
        for (pool, n) in wants(*k) {
            let e = need.entry(pool).or_default();
            *e = (*e).max(n);
        }
    }
    let need: Vec<(&str, u64)> = need.into_iter().collect();
    let counted = store.unissued_counts_upto(&need).await?;
    let free: HashMap<&str, u64> = need.iter().map(|(p, _)| *p).zip(counted).collect();
    let mut short_pools: Vec<&str> = Vec::new();
    let mut short: Vec<usize> = Vec::new();
    for (k, e) in refused {
        let wanted = wants(k);
        if wanted
            .iter()
            .any(|(p, n)| free.get(p).copied().unwrap_or(0) < *n)
        {
            short_pools.extend(wanted.keys().copied());
            short.push(k);
        } else {
            metrics::counter!("codepool_holds_total", "outcome" => "over_limit").increment(1);
            out[k] = Some(Err(e));
        }
    }
    if short.is_empty() {
        return Ok(());
    }
    let free = free_in(store, short_pools).await?;
    for k in short {
        metrics::counter!("codepool_holds_total", "outcome" => "short").increment(1);
        let free = (asks[k].req.items.iter())
            .map(|i| (i.pool.clone(), free.get(&i.pool).copied().unwrap_or(0)))
            .collect();
        out[k] = Some(Err(HoldError::InsufficientStock { free }));
    }
    Ok(())
}

/// Stock (free plus held) of `pools`, counted only as far as the largest
/// share the asks at `todo` need. The batch's first count (`counted`)
/// answers every pool it covered: it is exact below its cap, and at the
/// cap it is enough for any share that asks no more. Only a pool whose
/// count stopped short of a larger need is counted again, that far.
async fn stock_of<'p>(
    store: &Store,
    asks: &[HoldAsk],
    todo: &[usize],
    pools: &[&'p str],
    (open, counted): (&[HoldDoc], &HashMap<String, u64>),
    setting: &impl Fn(&str) -> (u32, u32),
    owner_share: &impl Fn(&str) -> u32,
) -> Result<HashMap<&'p str, u64>, HoldError> {
    let mut need: HashMap<&str, u64> = HashMap::new();
    for &k in todo {
        let buyer = codepool_domain::buyer_key(&asks[k].req.uid);
        for i in &asks[k].req.items {
            let mine: u64 = (open
                .iter()
                .filter(|h| codepool_domain::buyer_key(&h.uid) == buyer))
            .map(|h| u64::from(h.quantity_in(&i.pool)))
            .sum();
            // The smaller share decides how far the stock must be counted.
            let share = setting(&i.pool).0.min(owner_share(&i.pool));
            let enough =
                (mine + u64::from(i.quantity)).saturating_mul(100) / u64::from(share.max(1)) + 1;
            let e = need.entry(i.pool.as_str()).or_default();
            *e = (*e).max(enough);
        }
    }
    let mut stock: HashMap<&str, u64> = HashMap::new();
    let mut again: Vec<(&str, u64)> = Vec::new();
    for p in pools {
        let have = counted.get(*p).copied().unwrap_or(0);
        let needs = need.get(p).copied().unwrap_or(1);
        if have < FIRST_COUNT || needs <= have {
            stock.insert(p, have);
        } else {
            again.push((p, needs));
        }
    }
    if !again.is_empty() {
        let (free, held) = futures::join!(
            store.unissued_counts_upto(&again),
            futures::future::try_join_all(
                again.iter().map(|(p, cap)| store.held_count_upto(p, *cap))
            ),
        );
        for ((p, _), n) in again
            .iter()
            .zip(free?.into_iter().zip(held?).map(|(f, h)| f + h))
        {
            stock.insert(p, n);
        }
    }
    Ok(stock)
}

/// Claims every item of `holds`, held, in one batched claim. Returns the
/// nonces of the holds that fell short.
async fn hold_codes(intake: &Intake, holds: &[HoldDoc]) -> Result<HashSet<String>, ClaimError> {
    if holds.is_empty() {
        return Ok(HashSet::new());
    }
    let claims: Vec<(usize, Purchase)> = (holds.iter().enumerate())
        .flat_map(|(n, h)| {
            item_claims(&h.keys(), &h.items, &h.uid, h.owner.as_ref())
                .into_iter()
                .map(move |p| (n, p))
        })
        .collect();
    let lines: Vec<Vec<u32>> = claims
        .iter()
        .map(|(_, p)| (0..p.quantity).collect())
        .collect();
    let asks: Vec<ClaimAsk> = claims
        .iter()
        .zip(&lines)
        .map(|((_, purchase), lines)| ClaimAsk { purchase, lines })
        .collect();
    let outcomes = intake.engine().claim_asks(&asks, ClaimWay::hold()).await?;
    Ok(claims
        .iter()
        .zip(&outcomes)
        .filter(|(_, o)| !o.missing().is_empty() || o.grants().is_empty())
        .map(|((n, _), _)| holds[*n].nonce.clone())
        .collect())
}

/// `owner`'s hold `hold_id` (`None`: a hold of no owner). Hold ids are
/// each owner's own: another owner's hold of the same id is not this one.
pub async fn get(store: &Store, hold_id: &str, owner: Option<&str>) -> Result<HoldDoc, HoldError> {
    match store.hold(owner, hold_id).await? {
        Some(h) if !h.bundle => Ok(h),
        _ => Err(HoldError::NotFound(hold_id.to_owned())),
    }
}

/// Releases `owner`'s held hold `hold_id`: its codes go back to stock.
/// Returns the hold and the codes put back (their pools' backorders are
/// served first by the caller, see [`serve_returned`]). A hold no longer
/// held is answered as it is.
pub async fn release(
    intake: &Intake,
    hold_id: &str,
    owner: Option<&str>,
) -> Result<(HoldDoc, Vec<HeldCode>), HoldError> {
    let store = intake.store();
    let h = get(store, hold_id, owner).await?;
    if h.state != HoldState::Held {
        return Ok((h, Vec::new()));
    }
    // Codes first: a release that dies between the two leaves a held
    // hold, which expires and releases again.
    let released = store.return_held(&h.keys()).await?;
    store.end_hold(&h.id, HoldEnd::Released, None).await?;
    intake.engine().offer(&released).await;
    crate::channels::stock::changed(released.iter().map(|c| c.pool.as_str()));
    metrics::counter!("codepool_holds_ended_total", "state" => "released").increment(1);
    info!(hold_id, codes = released.len(), "hold released");
    let h = store.hold_by_key(&h.id).await?.unwrap_or(h);
    Ok((h, released))
}

/// Releases every hold whose time is up, and every bundle's held code
/// left behind by a process that died between a bundle's two claims.
/// Returns the pools that got codes back.
pub async fn expire_due(intake: &Intake) -> Result<BTreeSet<String>, StoreError> {
    let store = intake.store();
    let mut pools = BTreeSet::new();
    for h in store.due_holds(DateTime::now(), 500).await? {
        let released = store.return_held(&h.keys()).await?;
        store.end_hold(&h.id, HoldEnd::Expired, None).await?;
        metrics::counter!("codepool_holds_ended_total", "state" => "expired").increment(1);
        info!(hold_id = %h.hold_id, codes = released.len(), "hold expired; its codes are back in stock");
        pools.extend(released.iter().map(|c| c.pool.clone()));
        intake.engine().offer(&released).await;
    }
    record_held(store).await;
    let strays = store
        .release_stray_held(
            crate::held::BUNDLE_STRAY_AFTER,
            std::time::Duration::from_secs(MAX_TTL_SECONDS + 300),
        )
        .await?;
    if !strays.is_empty() {
        warn!(codes = strays.len(), "codes held by a bundle or a hold that no process finished (it died between its steps) are back in stock");
        pools.extend(strays.iter().map(|c| c.pool.clone()));
        intake.engine().offer(&strays).await;
    }
    crate::channels::stock::changed(pools.iter().map(String::as_str));
    Ok(pools)
}

/// Sets `codepool_pool_held` for every pool that holds codes, and to 0
/// for those that held some at the last count and hold none now.
async fn record_held(store: &Store) {
    static SEEN: std::sync::Mutex<BTreeSet<String>> = std::sync::Mutex::new(BTreeSet::new());
    let Ok(held) = store.held_by_pool().await else {
        return;
    };
    let Ok(mut seen) = SEEN.lock() else {
        return;
    };
    let now: BTreeSet<String> = held.iter().map(|(p, _)| p.clone()).collect();
    for gone in seen.difference(&now) {
        metrics::gauge!("codepool_pool_held", "pool" => gone.clone()).set(0.0);
    }
    for (pool, n) in held {
        metrics::gauge!("codepool_pool_held", "pool" => pool).set(n as f64);
    }
    *seen = now;
}

/// How often a granting process returns expired holds' codes to stock:
/// well inside the minute within which they must come back.
pub const SWEEP_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// Serves the waiting backorders of `pools` with codes just returned to
/// stock, before anyone else can take them (oldest first, as after an
/// import).
pub async fn serve_returned(core: &crate::Core, pools: &BTreeSet<String>) {
    let stop = tokio_util::sync::CancellationToken::new();
    let publisher = core.broker().publisher;
    for pool in pools {
        if let Err(e) = crate::backorders::fulfil_backorders(
            core.intake().engine(),
            core.store(),
            core.outbox(),
            &publisher,
            pool,
            &stop,
        )
        .await
        {
            warn!(pool, error = %e, "backorders not served with the returned codes; the dispatchers' sweep serves them");
        }
    }
}

/// Most holds placed together.
pub const MAX_HOLD_BATCH: usize = 256;

/// Concurrent holds share one claim, as concurrent orders do: each
/// request hands its hold to the core's batcher ([`crate::batcher`]) and
/// waits for its answer; whatever has queued meanwhile (up to
/// [`MAX_HOLD_BATCH`]) is placed as one batch ([`place_many`]), one batch
/// at a time.
pub struct HoldBatcher {
    batcher: Batcher<HoldAsk, Placed>,
}

impl HoldBatcher {
    /// A batcher placing holds through `core`. Each batch runs in a
    /// `batch` span naming the door that asks and its size.
    pub fn start(core: std::sync::Arc<crate::Core>, door: crate::Door) -> Self {
        let work = move |batch: Vec<Pending<HoldAsk, Placed>>| {
            let core = core.clone();
            async move {
                let (asks, replies): (Vec<HoldAsk>, Vec<_>) =
                    batch.into_iter().map(|p| (p.ask, p.reply)).unzip();
                let span = tracing::info_span!("batch", door = door.as_str(), size = asks.len());
                let placed = place_many(core.intake(), asks);
                match tracing::Instrument::instrument(placed, span).await {
                    Ok(placed) => {
                        for (reply, p) in replies.into_iter().zip(placed) {
                            reply.send(p);
                        }
                    }
                    Err(e) => {
                        let shared = Shared(std::sync::Arc::new(e));
                        for reply in replies {
                            reply.send(Err(HoldError::Failed(shared.clone())));
                        }
                    }
                }
            }
        };
        let shape = Shape::one_at_a_time("holds", MAX_HOLD_BATCH);
        Self {
            batcher: Batcher::new(shape, work),
        }
    }

    /// Places one hold with whatever else is asked meanwhile.
    pub async fn place(&self, ask: HoldAsk) -> Placed {
        self.batcher.ask(ask).await?
    }

    /// Takes no more holds, and waits up to `limit` for those queued.
    pub async fn stopped(&self, limit: std::time::Duration) -> bool {
        self.batcher.stopped(limit).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::held::item_offsets;

    #[test]
    fn a_hold_request_parses_with_its_default_time_to_live_and_names_its_bad_field() {
        let r = HoldRequest::parse(
            br#"{"hold_id":"H-1","uid":"u1","items":[{"pool":"a","quantity":2}]}"#,
        )
        .unwrap();
        assert_eq!(
            (r.hold_id.as_str(), r.uid.as_str(), r.ttl_seconds),
            ("H-1", "u1", DEFAULT_TTL_SECONDS)
        );
        assert_eq!(
            r.items,
            vec![Item {
                pool: "a".into(),
                quantity: 2
            }]
        );
        for (body, field) in [
            (
                r#"{"uid":"u1","items":[{"pool":"a","quantity":1}]}"#,
                "hold_id",
            ),
            (
                r#"{"hold_id":"H\u0007","uid":"u1","items":[{"pool":"a","quantity":1}]}"#,
                "hold_id",
            ),
            (
                r#"{"hold_id":"H-1","items":[{"pool":"a","quantity":1}]}"#,
                "uid",
            ),
            (r#"{"hold_id":"H-1","uid":"u1"}"#, "items"),
            (r#"{"hold_id":"H-1","uid":"u1","items":[]}"#, "items"),
            (
                r#"{"hold_id":"H-1","uid":"u1","items":[{"pool":"a","quantity":1}],"ttl_seconds":3601}"#,
                "ttl_seconds",
            ),
            (
                r#"{"hold_id":"H-1","uid":"u1","items":[{"pool":"a","quantity":1}],"ttl_seconds":0}"#,
                "ttl_seconds",
            ),
        ] {
            let e = HoldRequest::parse(body.as_bytes()).unwrap_err();
            assert_eq!(e.field(), Some(field), "{body}: {e}");
        }
    }

    #[test]
    fn items_run_line_after_line() {
        let items = [
            Item {
                pool: "a".into(),
                quantity: 2,
            },
            Item {
                pool: "b".into(),
                quantity: 3,
            },
            Item {
                pool: "c".into(),
                quantity: 1,
            },
        ];
        assert_eq!(item_offsets(&items), vec![0, 2, 5]);
        // A key begins with a control character, which no order id holds.
        for key in [
            codepool_store::holds::hold_key("H", 0),
            codepool_store::holds::bundle_key("O", 1),
        ] {
            assert!(key.starts_with('\u{1}'), "{key:?}");
        }
    }
}
