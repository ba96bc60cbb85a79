//! Checkout holds: codes set aside for a buyer while they pay, shown to no
//! one, and either turned into the order's grants when the payment arrives
//! ([`commit_paid`], called by the intake for an order that names its
//! `hold_id`) or put back in stock when the hold is released or expires
//! ([`release`], [`expire_due`]), waiting backorders first.
//!
//! A hold claims through the same batched claim as an order, with
//! [`Resend::Hold`]: its codes are `held` under keys of their own
//! ([`hold_key`]), so a retried hold takes no line twice, and commit and
//! release are conditional writes on "still held under this key", so a
//! payment racing an expiry gives each code to exactly one of them. A late
//! payment is never refused: whatever its hold no longer holds is claimed
//! from stock, or backordered, like any order.

use std::collections::{BTreeSet, HashMap, HashSet};

use bson::DateTime;
use codepool_domain::{CodeId, Grant, Item, Purchase, PurchaseError, RejectReason, MAX_ITEMS};
use codepool_store::holds::{HeldCode, HoldDoc, COMMITTED, EXPIRED, HELD, RELEASED};
use codepool_store::{ClaimAssignment, Store, StoreError};
use serde_json::{Map, Value};
use tracing::{info, warn};

use crate::claim::{ClaimAsk, ClaimError};
use crate::intake::Intake;
use crate::plan::{admit, Intake as Admitted};
use crate::Resend;

/// A hold's time to live when the request names none.
pub const DEFAULT_TTL_SECONDS: u64 = 900;
/// The longest a hold may last.
pub const MAX_TTL_SECONDS: u64 = 3600;
/// The largest share of a pool's stock (free plus held), in percent, that
/// one buyer may hold at once, unless the pool says otherwise.
pub const DEFAULT_HOLD_SHARE: u32 = 10;
/// How many open holds one buyer may have, unless the pool says otherwise.
pub const DEFAULT_HOLDS_PER_UID: u32 = 5;

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
        // The ids follow the rules of an order's (length, visible text):
        // the purchase parser checks them.
        let mut probe = serde_json::json!({"phone": "+10000000", "pool": "p"});
        for f in ["uid"] {
            if let Some(v) = map.get(f) {
                probe[f] = v.clone();
            }
        }
        probe["order_id"] = map.get("hold_id").cloned().unwrap_or(Value::Null);
        let p = Purchase::parse(probe.to_string().as_bytes()).map_err(|e| {
            if e.field() == Some("order_id") {
                let detail = e.detail.replace("\"order_id\"", "\"hold_id\"");
                PurchaseError::new(e.reason, detail).on("hold_id")
            } else {
                e
            }
        })?;
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
            hold_id: p.order_id,
            uid: p.uid,
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
    #[error("not enough stock to hold every item; nothing was held ({})", free_words(.free))]
    InsufficientStock {
        /// What each pool of the request has free now.
        free: Vec<(String, u64)>,
    },
    #[error("pool {0:?} is paused; nothing was held. Try again once it is resumed")]
    Paused(String),
    #[error("buyer {uid:?} would hold {wanted} codes of pool {pool:?}, over the {limit} one buyer may hold at once; nothing was held")]
    OverShare {
        uid: String,
        pool: String,
        wanted: u64,
        limit: u64,
    },
    #[error("buyer {uid:?} has {limit} open holds already, the most a buyer may have; pay for or release one first")]
    TooManyHolds { uid: String, limit: u64 },
    #[error("no hold {0:?} (of this key)")]
    NotFound(String),
    #[error(transparent)]
    Claim(#[from] ClaimError),
    #[error(transparent)]
    Store(#[from] StoreError),
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
            _ => false,
        }
    }
}

/// A hold as a door shows it: its document, with its state as of now (a
/// held hold past its time is `expired`, whether or not the sweep has
/// returned its codes yet).
pub fn state_now(h: &HoldDoc) -> &str {
    if h.state == HELD && h.expires_at <= DateTime::now() {
        EXPIRED
    } else {
        &h.state
    }
}

/// Whether the request asks for the same hold as `h`.
fn same_hold(h: &HoldDoc, req: &HoldRequest, owner: Option<&str>) -> bool {
    h.uid == req.uid
        && h.items == req.items
        && h.ttl_seconds == req.ttl_seconds as i64
        && h.owner.as_deref() == owner
}

/// Places a hold, all or nothing. `Ok((hold, true))` when this call made
/// it, `Ok((hold, false))` for the same request again.
pub async fn place(
    intake: &Intake,
    req: HoldRequest,
    owner: Option<String>,
    shop: Option<String>,
) -> Result<(HoldDoc, bool), HoldError> {
    let store = intake.store();
    // The hold's pools must exist and be the shop's; the owner of a shop's
    // hold is the shop, like its orders'.
    let probe = Purchase {
        order_id: req.hold_id.clone(),
        uid: req.uid.clone(),
        phone: String::new(),
        pool: req.items[0].pool.clone(),
        purchased_at: None,
        quantity: req.items.iter().map(|i| i.quantity).sum(),
        owner: owner.clone(),
        shop,
        hold_id: None,
        items: req.items.clone(),
    };
    let pools: Vec<String> = probe.pools().into_iter().map(str::to_owned).collect();
    let names: Vec<&str> = pools.iter().map(String::as_str).collect();
    let policies = intake.policies.get_many(store, &names).await?;
    let admitted = admit(vec![Ok(probe)], |p| policies.contains_key(p));
    let admitted = intake.shops.admit(store, admitted).await?;
    let owner = match admitted.into_iter().next() {
        Some(Admitted::Claim(p)) => p.owner,
        Some(Admitted::Reject(e)) => return Err(HoldError::Invalid(e)),
        _ => owner,
    };
    if let Some(h) = store.hold(&req.hold_id).await? {
        return again(h, &req, owner.as_deref());
    }
    if let Some(p) = pools
        .iter()
        .find(|p| policies.get(*p).is_some_and(|x| x.paused))
    {
        return Err(HoldError::Paused(p.clone()));
    }
    within_limits(store, &req).await?;
    let now = DateTime::now();
    let hold = HoldDoc {
        hold_id: req.hold_id.clone(),
        uid: req.uid.clone(),
        items: req.items.clone(),
        owner,
        ttl_seconds: req.ttl_seconds as i64,
        created_at: now,
        expires_at: DateTime::from_millis(now.timestamp_millis() + req.ttl_seconds as i64 * 1000),
        state: HELD.into(),
        order_id: None,
        ended_at: None,
        bundle: false,
    };
    // Recorded before anything is claimed: a process that dies mid-claim
    // leaves codes that expire with the hold.
    if !store.insert_hold(&hold).await? {
        let h = store
            .hold(&req.hold_id)
            .await?
            .ok_or_else(|| HoldError::NotFound(req.hold_id.clone()))?;
        return again(h, &req, hold.owner.as_deref());
    }
    let short = hold_codes(intake, &hold).await?;
    if short.is_empty() {
        info!(hold_id = %hold.hold_id, uid = %hold.uid, codes = hold.quantity(), "hold placed");
        metrics::counter!("codepool_holds_total", "outcome" => "held").increment(1);
        return Ok((hold, true));
    }
    // All or nothing: what was taken goes back, and the hold is forgotten
    // so the same request may be made again later.
    let released = store.release_held(&hold.keys()).await?;
    intake.engine().offer(&released).await;
    store.forget_hold(&hold.hold_id).await?;
    metrics::counter!("codepool_holds_total", "outcome" => "short").increment(1);
    let mut free = Vec::new();
    for i in &hold.items {
        free.push((
            i.pool.clone(),
            store.unissued_count_upto(&i.pool, 1_000_000).await?,
        ));
    }
    Err(HoldError::InsufficientStock { free })
}

/// The same hold id again: the hold as it is, or a conflict.
fn again(h: HoldDoc, req: &HoldRequest, owner: Option<&str>) -> Result<(HoldDoc, bool), HoldError> {
    if h.bundle || !same_hold(&h, req, owner) {
        return Err(HoldError::Conflict(req.hold_id.clone()));
    }
    Ok((h, false))
}

/// The buyer's caps: open holds, and each pool's share.
async fn within_limits(store: &Store, req: &HoldRequest) -> Result<(), HoldError> {
    let open = store.open_holds_of(&req.uid).await?;
    for item in &req.items {
        let (share, per_uid) = match store.pool(&item.pool).await? {
            Some(p) => (p.hold_share(), p.holds_per_uid()),
            None => (DEFAULT_HOLD_SHARE, DEFAULT_HOLDS_PER_UID),
        };
        if open.len() as u64 >= u64::from(per_uid) {
            return Err(HoldError::TooManyHolds {
                uid: req.uid.clone(),
                limit: u64::from(per_uid),
            });
        }
        let mine: u64 = open
            .iter()
            .map(|h| u64::from(h.quantity_in(&item.pool)))
            .sum();
        let wanted = mine + u64::from(item.quantity);
        // The stock is counted only as far as this question needs.
        let enough = wanted.saturating_mul(100) / u64::from(share.max(1)) + 1;
        let held = store.held_count(&item.pool).await?;
        let free = store.unissued_count_upto(&item.pool, enough).await?;
        let limit = ((free + held) * u64::from(share) / 100).max(1);
        if wanted > limit {
            metrics::counter!("codepool_holds_total", "outcome" => "over_limit").increment(1);
            return Err(HoldError::OverShare {
                uid: req.uid.clone(),
                pool: item.pool.clone(),
                wanted,
                limit,
            });
        }
    }
    Ok(())
}

/// One claim "purchase" per item of a hold, under the item's key.
pub(crate) fn item_claims(
    keys: &[String],
    items: &[Item],
    uid: &str,
    owner: Option<&String>,
) -> Vec<Purchase> {
    keys.iter()
        .zip(items)
        .map(|(key, item)| Purchase {
            order_id: key.clone(),
            uid: uid.to_owned(),
            phone: String::new(),
            pool: item.pool.clone(),
            purchased_at: None,
            quantity: item.quantity,
            owner: owner.cloned(),
            shop: None,
            hold_id: None,
            items: Vec::new(),
        })
        .collect()
}

/// Claims every item of `hold`, held. Returns the pools that fell short.
async fn hold_codes(intake: &Intake, hold: &HoldDoc) -> Result<BTreeSet<String>, ClaimError> {
    let claims = item_claims(&hold.keys(), &hold.items, &hold.uid, hold.owner.as_ref());
    let lines: Vec<Vec<u32>> = claims.iter().map(|p| (0..p.quantity).collect()).collect();
    let asks: Vec<ClaimAsk> = claims
        .iter()
        .zip(&lines)
        .map(|(purchase, lines)| ClaimAsk { purchase, lines })
        .collect();
    let outcomes = intake.engine().claim_asks(&asks, Resend::Hold).await?;
    Ok(claims
        .iter()
        .zip(&outcomes)
        .filter(|(_, o)| !o.missing().is_empty() || o.grants().is_empty())
        .map(|(p, _)| p.pool.clone())
        .collect())
}

/// A hold, if it is `owner`'s.
pub async fn get(store: &Store, hold_id: &str, owner: Option<&str>) -> Result<HoldDoc, HoldError> {
    match store.hold(hold_id).await? {
        Some(h) if !h.bundle && owner_may_see(&h, owner) => Ok(h),
        _ => Err(HoldError::NotFound(hold_id.to_owned())),
    }
}

/// Another key's (or shop's) hold is not found, as if it did not exist.
/// No owner (an operator) sees every hold.
fn owner_may_see(h: &HoldDoc, owner: Option<&str>) -> bool {
    owner.is_none() || h.owner.as_deref() == owner
}

/// Releases a held hold: its codes go back to stock. Returns the hold and
/// the codes put back (their pools' backorders are served first by the
/// caller, see [`serve_returned`]). A hold no longer held is answered as
/// it is.
pub async fn release(
    intake: &Intake,
    hold_id: &str,
    owner: Option<&str>,
) -> Result<(HoldDoc, Vec<HeldCode>), HoldError> {
    let store = intake.store();
    let h = get(store, hold_id, owner).await?;
    if h.state != HELD {
        return Ok((h, Vec::new()));
    }
    // Codes first: a release that dies between the two leaves a held
    // hold, which expires and releases again.
    let released = store.release_held(&h.keys()).await?;
    store.end_hold(hold_id, RELEASED, None).await?;
    intake.engine().offer(&released).await;
    metrics::counter!("codepool_holds_ended_total", "state" => "released").increment(1);
    info!(hold_id, codes = released.len(), "hold released");
    let h = store.hold(hold_id).await?.unwrap_or(h);
    Ok((h, released))
}

/// Releases every hold whose time is up, and every bundle's held code
/// left behind by a process that died between a bundle's two claims.
/// Returns the pools that got codes back.
pub async fn expire_due(intake: &Intake) -> Result<BTreeSet<String>, StoreError> {
    let store = intake.store();
    let mut pools = BTreeSet::new();
    for h in store.due_holds(DateTime::now(), 500).await? {
        let released = store.release_held(&h.keys()).await?;
        store.end_hold(&h.hold_id, EXPIRED, None).await?;
        metrics::counter!("codepool_holds_ended_total", "state" => "expired").increment(1);
        info!(hold_id = %h.hold_id, codes = released.len(), "hold expired; its codes are back in stock");
        pools.extend(released.iter().map(|c| c.pool.clone()));
        intake.engine().offer(&released).await;
    }
    let strays = store
        .release_stray_bundle_codes(crate::bundles::STRAY_AFTER)
        .await?;
    if !strays.is_empty() {
        warn!(codes = strays.len(), "codes held by bundles that never completed (a process died between a bundle's two claims) are back in stock");
        pools.extend(strays.iter().map(|c| c.pool.clone()));
        intake.engine().offer(&strays).await;
    }
    Ok(pools)
}

/// Turns the holds that `purchases` pay for into their grants: each held
/// code still held under its hold goes to the order's matching line.
/// A hold that is not the order's (another buyer, key or items) is left
/// alone; the order is placed from stock like any other. Returns the codes
/// committed, to count as fresh grants.
pub async fn commit_paid(
    store: &Store,
    purchases: &[&Purchase],
    resend: Resend,
) -> Result<HashSet<CodeId>, StoreError> {
    let ids: Vec<&str> = purchases
        .iter()
        .filter_map(|p| p.hold_id.as_deref())
        .collect();
    if ids.is_empty() {
        return Ok(HashSet::new());
    }
    let holds: HashMap<String, HoldDoc> = store
        .holds_by_id(&ids)
        .await?
        .into_iter()
        .map(|h| (h.hold_id.clone(), h))
        .collect();
    let mut committed = HashSet::new();
    for p in purchases {
        let Some(h) = p.hold_id.as_ref().and_then(|id| holds.get(id)) else {
            continue;
        };
        if h.bundle
            || h.uid != p.uid
            || h.items != p.items()
            || !owner_may_see(h, p.owner.as_deref())
        {
            warn!(order_id = %p.order_id, hold_id = %h.hold_id, "the order does not match its hold (buyer, items or key); it is placed from stock");
            continue;
        }
        let held = store.held_codes(&h.keys()).await?;
        committed.extend(commit(store, p, &h.keys(), &held, resend).await?);
        store
            .end_hold(&h.hold_id, COMMITTED, Some(&p.order_id))
            .await?;
        metrics::counter!("codepool_holds_ended_total", "state" => "committed").increment(1);
    }
    Ok(committed)
}

/// Moves `held` (codes held under `keys`, item by item) to the lines of
/// order `p`: item `i`'s line `j` becomes the order's line
/// `offset(i) + j`. Returns the codes moved.
pub(crate) async fn commit(
    store: &Store,
    p: &Purchase,
    keys: &[String],
    held: &[HeldCode],
    resend: Resend,
) -> Result<Vec<CodeId>, StoreError> {
    let offsets = item_offsets(&p.items());
    let commits: Vec<(CodeId, &str, ClaimAssignment)> = held
        .iter()
        .filter_map(|c| {
            let item = keys.iter().position(|k| *k == c.key)?;
            Some((
                c.id,
                c.key.as_str(),
                order_line(p, c, offsets[item] + c.line, resend),
            ))
        })
        .collect();
    store.commit_held(&commits).await?;
    Ok(commits.iter().map(|(id, _, _)| *id).collect())
}

/// The first order line of each item.
pub(crate) fn item_offsets(items: &[Item]) -> Vec<u32> {
    items
        .iter()
        .scan(0, |at, i| {
            let first = *at;
            *at += i.quantity;
            Some(first)
        })
        .collect()
}

/// What a claim of line `line` of order `p` would write, for held code `c`.
fn order_line(p: &Purchase, c: &HeldCode, line: u32, resend: Resend) -> ClaimAssignment {
    ClaimAssignment {
        code_id: c.id,
        pool: c.pool.clone(),
        order_id: p.order_id.clone(),
        uid: p.uid.clone(),
        phone: p.phone.clone(),
        grant_no: None,
        resend,
        line,
        quantity: p.quantity,
        part: 0,
        owner: p.owner.clone(),
    }
}

/// A held grant as its order's: the same code, on the order's line.
pub(crate) fn as_order_grant(g: &Grant, p: &Purchase, line: u32) -> Grant {
    Grant {
        order_id: p.order_id.clone(),
        uid: p.uid.clone(),
        phone: p.phone.clone(),
        line,
        quantity: p.quantity,
        part: 0,
        owner: p.owner.clone(),
        ..g.clone()
    }
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

/// Every [`SWEEP_EVERY`] until `stop`: expired holds' codes back to
/// stock, their pools' backorders served first. Run by every process
/// that grants.
pub async fn sweep_loop(
    core: std::sync::Arc<crate::Core>,
    stop: tokio_util::sync::CancellationToken,
) {
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(SWEEP_EVERY) => {}
        }
        match expire_due(core.intake()).await {
            Ok(pools) if !pools.is_empty() => serve_returned(&core, &pools).await,
            Ok(_) => {}
            Err(e) => tracing::debug!(error = %e, "hold sweep skipped; retried in {SWEEP_EVERY:?}"),
        }
    }
}
