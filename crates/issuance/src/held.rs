//! The held code's mechanics, shared by checkout holds (`holds.rs`),
//! bundles (`bundles.rs`) and paid orders (`intake.rs`): the per-item
//! claims a hold or a bundle makes, and the commit that moves held codes
//! to an order's lines. It depends on none of them, so the imports run one
//! way: intake and holds and bundles call down into this.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use codepool_domain::{CodeId, Grant, Item, Purchase};
use codepool_store::holds::{HeldCode, HoldDoc, COMMITTED};
use codepool_store::{ClaimAssignment, Store, StoreError};
use tracing::warn;

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

/// Another key's (or shop's) hold is not found, as if it did not exist.
/// No owner (an operator) sees every hold.
pub(crate) fn owner_may_see(h: &HoldDoc, owner: Option<&str>) -> bool {
    owner.is_none() || h.owner.as_deref() == owner
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
async fn commit(
    store: &Store,
    p: &Purchase,
    keys: &[String],
    held: &[HeldCode],
    resend: Resend,
) -> Result<Vec<CodeId>, StoreError> {
    let commits = commits_of(p, keys, held, resend);
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
    resend: Resend,
) -> Vec<(CodeId, String, ClaimAssignment)> {
    let offsets = item_offsets(&p.items());
    held.iter()
        .filter_map(|c| {
            let item = keys.iter().position(|k| *k == c.key)?;
            Some((
                c.id,
                c.key.clone(),
                order_line(p, c, offsets[item] + c.line, resend),
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
