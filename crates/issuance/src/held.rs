//! The held code's mechanics, shared by checkout holds (`holds.rs`),
//! bundles (`bundles.rs`) and paid orders (`intake.rs`): the per-item
//! claims a hold or a bundle makes, and the commit that moves held codes
//! to an order's lines. It depends on none of them, so the imports run one
//! way: intake and holds and bundles call down into this.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use codepool_domain::gate::{HoldEnd, HoldState, Move, Refused};

use crate::guard::Guard;
use codepool_domain::{CodeId, Grant, Item, PoolPolicy, Purchase};
use codepool_store::holds::{HeldCode, HoldDoc};
use codepool_store::{ClaimAssignment, Store, StoreError};
use tracing::{debug, info, warn};

use crate::Resend;

/// How long a bundle's held code may stay held before the sweep returns
/// it to stock: far longer than a live bundle takes between its two steps.
pub const BUNDLE_STRAY_AFTER: Duration = Duration::from_secs(60);

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

/// What paying for holds came to.
#[derive(Debug, Default)]
pub struct Paid {
    /// The codes committed, to count as fresh grants.
    pub committed: HashSet<CodeId>,
    /// Codes that went back to stock (a hold of a paused pool, or one its
    /// buyer's per-user limit refused), to offer as candidates again.
    pub released: Vec<HeldCode>,
}

/// The owner a purchase pays as: its key's, or for an AMQP purchase that
/// names a shop (and whose broker user the intake found the shop lets
/// publish for it) the shop's.
fn payer(p: &Purchase) -> Option<String> {
    match (&p.owner, &p.shop) {
        (Some(o), Some(shop)) if o.starts_with(crate::shops::BROKER_USER_PREFIX) => {
            Some(crate::shops::owner_of(shop))
        }
        (None, Some(shop)) => Some(crate::shops::owner_of(shop)),
        (owner, _) => owner.clone(),
    }
}

/// The hold purchase `p` names, among `holds` (every owner's holds of the
/// ids named). Hold ids are each owner's own, so it is the payer's hold of
/// that id: its own key's or shop's, else a hold of no owner. A purchase
/// of no key and no shop (an AMQP purchase naming no shop, the operator's
/// own backend) may pay the hold of any key of no shop ([`gate::may_pay`]):
/// it names the one of its buyer and items among those, the oldest if
/// several are.
fn named_hold<'h>(p: &Purchase, holds: &'h [HoldDoc]) -> Option<&'h HoldDoc> {
    let id = p.hold_id.as_deref()?;
    let of_id = holds.iter().filter(|h| h.hold_id == id);
    let Some(payer) = payer(p) else {
        let of_a_shop = |h: &&HoldDoc| {
            (h.owner.as_deref()).is_some_and(|o| o.starts_with(codepool_domain::SHOP_OWNER_PREFIX))
        };
        let fits = |h: &HoldDoc| {
            h.state == HoldState::Held && same_buyer(h, &p.uid) && h.items == p.items()
        };
        return (of_id.filter(|h| !of_a_shop(h))).min_by_key(|h| (!fits(h), h.created_at));
    };
    (of_id
        .clone()
        .find(|h| h.owner.as_deref() == Some(payer.as_str())))
    .or_else(|| of_id.clone().find(|h| h.owner.is_none()))
}

/// Turns the holds that `purchases` pay for into their grants: each held
/// code still held under its hold goes to the order's matching line,
/// through the gate ([`codepool_domain::gate`]):
/// - a hold that is not the order's (another buyer, items, key or shop) is
///   left alone; the order is placed from stock like any other;
/// - a hold of a paused pool is bound to the order that paid it (no other
///   order can pay it) and its codes go back to stock; the order waits;
/// - a hold over its buyer's per-user limit (counting the orders the buyer
///   placed from stock meanwhile) is released; the order is refused;
/// - a held code that expired or was recalled while held is not moved
///   (the store's condition); the order's line is claimed from stock. A
///   hold that lost every code so is bound to the order and released, as
///   under a pause: it gave the order nothing.
pub async fn commit_paid(
    store: &Store,
    purchases: &[&Purchase],
    policies: &HashMap<String, PoolPolicy>,
    resend: Resend,
) -> Result<Paid, StoreError> {
    let ids: Vec<&str> = purchases
        .iter()
        .filter_map(|p| p.hold_id.as_deref())
        .collect();
    let mut paid = Paid::default();
    if ids.is_empty() {
        return Ok(paid);
    }
    let holds: Vec<HoldDoc> = store.holds_named(&ids).await?;
    let guard = Guard::new(policies.clone());
    let mut payable: Vec<(&Purchase, &HoldDoc)> = Vec::new();
    for p in purchases {
        let Some(h) = named_hold(p, &holds) else {
            continue;
        };
        if !pays(p, h) {
            continue;
        }
        if let Some(Refused::Paused { pool }) =
            guard.stopped(Move::Commit, h.items.iter().map(|i| i.pool.as_str()))
        {
            debug!(order_id = %p.order_id, hold_id = %h.hold_id, pool = %pool, "a paid hold of a paused pool: bound to its order, its codes back in stock; the order waits");
            paid.released
                .extend(end(store, h, HoldEnd::Released, Some(&p.order_id)).await?);
            continue;
        }
        payable.push((p, h));
    }
    // An order whose id another order took first pays nothing (the
    // order-id guard): its claim from stock is refused as a conflict.
    let wanted: Vec<_> = payable
        .iter()
        .map(|(p, _)| crate::claim::bound_of(p))
        .collect();
    let bound = store.bind_orders(&wanted).await?;
    let payable: Vec<(&Purchase, &HoldDoc)> = (payable.into_iter().zip(&bound))
        .filter(|((p, h), to)| {
            let what = crate::claim::refused_by(p, to);
            if let Some(what) = what {
                warn!(order_id = %p.order_id, hold_id = %h.hold_id, differs = what, "the order id names another order; the hold is not paid");
            }
            what.is_none()
        })
        .map(|(ph, _)| ph)
        .collect();
    let items: Vec<(&Purchase, Vec<Item>)> = (payable.iter())
        .map(|(p, h)| (*p, h.items.clone()))
        .collect();
    let slots = guard.take_slots(store, Move::Commit, &items).await?.allowed;
    for (p, h) in payable {
        if !slots.contains(p.order_id.as_str()) {
            debug!(order_id = %p.order_id, hold_id = %h.hold_id, "a paid hold over its buyer's per-user limit: released; the order is refused");
            paid.released
                .extend(end(store, h, HoldEnd::Released, None).await?);
            continue;
        }
        pay(store, p, h, resend, &mut paid).await?;
    }
    Ok(paid)
}

/// Whether order `p` may pay hold `h`: the hold is still held and not
/// bound to another order, its buyer and items are the order's, and the
/// payer may pay it ([`gate::may_pay`]). Otherwise the order is placed
/// from stock.
fn pays(p: &Purchase, h: &HoldDoc) -> bool {
    if h.state != HoldState::Held || h.order_id.as_ref().is_some_and(|o| *o != p.order_id) {
        return false;
    }
    if h.bundle || !same_buyer(h, &p.uid) || h.items != p.items() {
        warn!(order_id = %p.order_id, hold_id = %h.hold_id, "the order does not match its hold (buyer or items); it is placed from stock");
        return false;
    }
    if !Guard::may_pay(h.owner.as_deref(), payer(p).as_deref()) {
        warn!(order_id = %p.order_id, hold_id = %h.hold_id, "the order may not pay this hold (another key or shop); it is placed from stock");
        return false;
    }
    true
}

/// Whether `uid` is the buyer of hold `h`, as every per-buyer rule
/// compares buyers: by [`codepool_domain::buyer_key`] (NFKC and case
/// folding), so `Mallory` pays the hold placed for `mallory`.
fn same_buyer(h: &HoldDoc, uid: &str) -> bool {
    let key = codepool_domain::buyer_key(uid);
    if h.buyer.is_empty() {
        // A hold recorded before buyer keys were stored.
        return codepool_domain::buyer_key(&h.uid) == key;
    }
    h.buyer == key
}

/// Pays hold `h` with order `p`, whose slot is taken: binds the hold to
/// the order, moves its codes to the order's lines and ends it. Runs in a
/// `hold_commit` span naming the order, the hold and the shop.
#[tracing::instrument(
    name = "hold_commit",
    skip_all,
    fields(order_id = %p.order_id, hold_id = %h.hold_id, shop = p.shop.as_deref())
)]
async fn pay(
    store: &Store,
    p: &Purchase,
    h: &HoldDoc,
    resend: Resend,
    paid: &mut Paid,
) -> Result<(), StoreError> {
    // Bound to this order first (durably): if this process dies after the
    // codes move, the hold is this order's, and no other order can pay it;
    // the same order's retry finishes it.
    if !store.bind_hold(&h.id, &p.order_id).await? {
        return Ok(());
    }
    // A bundle is granted whole or waits whole: a held code recalled or
    // expired while held would leave it half granted, so its hold goes back
    // to stock and the bundle claims whole like any order.
    if p.is_bundle() && store.live_held_count(&h.keys()).await? < u64::from(h.quantity()) {
        paid.released
            .extend(end(store, h, HoldEnd::Released, Some(&p.order_id)).await?);
        return Ok(());
    }
    let held = store.held_codes(&h.keys()).await?;
    if held.is_empty() {
        // Every code it held was recalled or expired while held: the order
        // gets nothing of it, and is placed from stock (or waits). Bound to
        // the order, as under a pause, so no other order pays it.
        debug!(order_id = %p.order_id, hold_id = %h.hold_id, "a paid hold whose codes were all voided while held: bound to its order, released; the order is placed from stock");
        paid.released
            .extend(end(store, h, HoldEnd::Released, Some(&p.order_id)).await?);
        return Ok(());
    }
    let moved = commit(store, p, &h.keys(), &held, resend).await?;
    let codes = moved.len();
    paid.committed.extend(moved);
    store
        .end_hold(&h.id, HoldEnd::Committed, Some(&p.order_id))
        .await?;
    metrics::counter!("codepool_holds_ended_total", "state" => "committed").increment(1);
    info!(order_id = %p.order_id, hold_id = %h.hold_id, codes, "hold paid; its codes are the order's");
    Ok(())
}

/// Ends hold `h` in `state` and puts its codes back in stock. Returns the
/// codes released.
async fn end(
    store: &Store,
    h: &HoldDoc,
    end: HoldEnd,
    order_id: Option<&str>,
) -> Result<Vec<HeldCode>, StoreError> {
    if !store.end_hold(&h.id, end, order_id).await? {
        return Ok(Vec::new());
    }
    metrics::counter!("codepool_holds_ended_total", "state" => end.state().as_str()).increment(1);
    store.return_held(&h.keys()).await
}

/// Moves `held` (codes held under `keys`, item by item) to the lines of
/// order `p`: item `i`'s line `j` becomes the order's line
/// `offset(i) + j`. Returns the codes moved.
async fn commit(
    store: &Store,
    p: &Purchase,
    keys: &[String],
    held: &[HeldCode],
    resend: Resend,
) -> Result<Vec<CodeId>, StoreError> {
    let commits = commits_of(p, keys, held, Move::Commit, resend);
    let refs: Vec<(CodeId, &str, ClaimAssignment)> = (commits.iter())
        .map(|(id, key, a)| (*id, key.as_str(), a.clone()))
        .collect();
    store.commit_held(&refs).await?;
    Ok(commits.iter().map(|(id, _, _)| *id).collect())
}

/// What [`commit`] writes: each held code, its key, and the order's line
/// it goes to.
pub(crate) fn commits_of(
    p: &Purchase,
    keys: &[String],
    held: &[HeldCode],
    mv: Move,
    resend: Resend,
) -> Vec<(CodeId, String, ClaimAssignment)> {
    let offsets = item_offsets(&p.items());
    held.iter()
        .filter_map(|c| {
            let item = keys.iter().position(|k| *k == c.key)?;
            Some((
                c.id,
                c.key.clone(),
                order_line(p, c, offsets[item] + c.line, mv, resend),
            ))
        })
        .collect()
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
fn order_line(p: &Purchase, c: &HeldCode, line: u32, mv: Move, resend: Resend) -> ClaimAssignment {
    ClaimAssignment {
        code_id: c.id,
        pool: c.pool.clone(),
        order_id: p.order_id.clone(),
        uid: p.uid.clone(),
        phone: p.phone.clone(),
        grant_no: None,
        mv,
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
