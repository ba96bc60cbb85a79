//! Bundles: one order of codes from several pools, granted whole or
//! waiting whole. A bundle claims in two steps through the same batched
//! claim as any order:
//!
//! 1. every line it lacks is claimed `held` ([`Move::Hold`]) under its
//!    item's key ([`bundle_key`]), every bundle of the batch in one claim;
//! 2. a bundle whose every item got its codes commits them to the order's
//!    lines (4→1) in one write; one that fell short puts what it took back
//!    in stock (4→0) and waits whole as a backorder.
//!
//! A held code is never shown to anyone, so nothing of a bundle that could
//! not complete is seen. A process that dies between the two steps leaves
//! held codes: a redelivery (or a retry) finds them under the same keys
//! and completes the bundle, and the hold sweep returns any that are still
//! held after [`crate::held::BUNDLE_STRAY_AFTER`].

use std::collections::{BTreeSet, HashMap, HashSet};

use codepool_domain::gate::Move;
use codepool_domain::{Code, CodeId, Grant, Purchase};
use codepool_store::holds::{bundle_key, HeldCode};
use codepool_store::{ClaimAssignment, Store};
use tracing::{debug, info, warn};

use crate::claim::{ClaimAsk, ClaimEngine, ClaimError, ClaimOutcome};
use crate::held::{as_order_grant, commits_of, item_claims, item_offsets};
use crate::{ClaimWay, Resend};

/// What the bundles of a batch got, aligned with the input, and the pools
/// that left a bundle short.
pub(crate) struct Bundled {
    pub outcomes: Vec<ClaimOutcome>,
    pub short_pools: BTreeSet<String>,
}

/// One bundle's claim: its item keys, the item "orders" claimed held, and
/// the lines each still asks.
struct Work<'a> {
    bundle: &'a Purchase,
    keys: Vec<String>,
    claims: Vec<Purchase>,
    lines: Vec<Vec<u32>>,
    /// Its grants held before (by the order).
    before: Vec<Grant>,
}

/// Claims bundles whole or not at all. `held` holds what the orders held
/// when the batch read them. Runs in a `bundle` span with the number of
/// bundles; its claims are its `claim` spans.
#[tracing::instrument(name = "bundle", skip_all, fields(size = bundles.len()))]
pub(crate) async fn claim_bundles(
    engine: &ClaimEngine,
    store: &Store,
    bundles: &[&Purchase],
    resend: Resend,
    held: &HashMap<String, Vec<Code>>,
) -> Result<Bundled, ClaimError> {
    // An order id whose codes are another order's (other items, buyer or
    // key) gets nothing, and no code is shown: as a plain order's anchor.
    // So is one whose id another order took first (the order-id guard).
    let wanted: Vec<_> = bundles.iter().map(|b| crate::claim::bound_of(b)).collect();
    let bound = store.bind_orders(&wanted).await?;
    let conflicts: Vec<Option<&'static str>> = (bundles.iter().zip(&bound))
        .map(|(b, to)| crate::claim::refused_by(b, to).or_else(|| conflict(b, held)))
        .collect();
    let work: Vec<Work> = (bundles.iter().zip(&conflicts))
        .filter(|(_, c)| c.is_none())
        .map(|(b, _)| plan_work(b, held))
        .collect();
    let by_key = hold_items(engine, &work).await?;
    let mut out = Bundled {
        outcomes: Vec::with_capacity(work.len()),
        short_pools: BTreeSet::new(),
    };
    // Every whole bundle commits in one write; every short one puts back
    // what it took in one write.
    let mut done: HashSet<&str> = HashSet::new();
    let mut commits: Vec<(CodeId, String, ClaimAssignment)> = Vec::new();
    let mut put_back: Vec<String> = Vec::new();
    let mut decided = Vec::with_capacity(work.len());
    for w in &work {
        decided.push(settle(
            w,
            &by_key,
            resend,
            &mut out.short_pools,
            &mut done,
            &mut commits,
            &mut put_back,
        ));
    }
    if !commits.is_empty() {
        let refs: Vec<(CodeId, &str, ClaimAssignment)> = (commits.iter())
            .map(|(id, key, a)| (*id, key.as_str(), a.clone()))
            .collect();
        let moved = store.commit_held(&refs).await?;
        if moved < refs.len() as u64 {
            honest_outcomes(engine, store, &work, &commits, &mut decided).await?;
        }
    }
    if !put_back.is_empty() {
        let released = store.release_held(&put_back).await?;
        engine.offer(&released).await;
        debug!(
            returned = released.len(),
            "bundles short; what they took is back in stock and they wait whole"
        );
    }
    let mut decided = decided.into_iter();
    for c in conflicts {
        let outcome = match (c, decided.next()) {
            (Some(what), _) => ClaimOutcome::Conflict { what },
            (None, Some(o)) => o,
            (None, None) => unreachable!("one decision per bundle without a conflict"),
        };
        out.outcomes.push(outcome);
    }
    Ok(out)
}

/// Some held codes were not committed: another attempt at the same bundle
/// (a redelivery on another dispatcher, a repeat on the other door) put
/// them back or committed its own to those lines first, or they expired
/// or were recalled while held. What this attempt still holds goes back,
/// and each whole bundle's outcome becomes what its order holds now, read
/// back: an event is only ever built from a code the order holds. Lines
/// nobody filled wait, like a backorder's.
async fn honest_outcomes(
    engine: &ClaimEngine,
    store: &Store,
    work: &[Work<'_>],
    commits: &[(CodeId, String, ClaimAssignment)],
    decided: &mut [ClaimOutcome],
) -> Result<(), ClaimError> {
    let whole: Vec<usize> = (0..work.len())
        .filter(|&k| decided[k].missing().is_empty())
        .collect();
    let keys: Vec<String> = (whole.iter())
        .flat_map(|&k| work[k].keys.iter().cloned())
        .collect();
    let released = store.release_held(&keys).await?;
    engine.offer(&released).await;
    let orders: Vec<&str> = (whole.iter())
        .map(|&k| work[k].bundle.order_id.as_str())
        .collect();
    let now = store.grants_for_orders(&orders).await?;
    let ours: HashSet<CodeId> = commits.iter().map(|(id, _, _)| *id).collect();
    for k in whole {
        let b = work[k].bundle;
        let mut grants: Vec<Grant> = (now.get(&b.order_id).into_iter().flatten())
            .filter_map(Code::grant)
            .collect();
        grants.sort_by_key(|g| g.line);
        let have: HashSet<u32> = grants.iter().map(|g| g.line).collect();
        let fresh = grants.iter().filter(|g| ours.contains(&g.code_id)).count() as u32;
        let missing: Vec<u32> = (0..b.quantity).filter(|l| !have.contains(l)).collect();
        if !missing.is_empty() {
            warn!(order_id = %b.order_id, missing = missing.len(), "a bundle's held codes left its hold before its commit (a concurrent attempt, an expiry or a recall); its missing lines wait");
        }
        decided[k] = ClaimOutcome::Claimed {
            grants,
            fresh,
            missing,
        };
    }
    Ok(())
}

/// Step 1: claims every line the bundles lack, held, in one claim.
/// Returns each item's outcome by its key.
async fn hold_items(
    engine: &ClaimEngine,
    work: &[Work<'_>],
) -> Result<HashMap<String, ClaimOutcome>, ClaimError> {
    let asks: Vec<ClaimAsk> = work
        .iter()
        .flat_map(|w| {
            w.claims
                .iter()
                .zip(&w.lines)
                .filter(|(_, l)| !l.is_empty())
                .map(|(purchase, lines)| ClaimAsk { purchase, lines })
        })
        .collect();
    let mut by_key: HashMap<String, ClaimOutcome> = HashMap::new();
    if asks.is_empty() {
        return Ok(by_key);
    }
    let outcomes = engine.claim_asks(&asks, ClaimWay::hold()).await?;
    for (a, o) in asks.iter().zip(outcomes) {
        by_key.insert(a.purchase.order_id.clone(), o);
    }
    if let Some(pause) = crate::failpoint::pause("bundle-pause") {
        info!(
            ?pause,
            "bundle held; pausing before its commit (failpoint bundle-pause)"
        );
        tokio::time::sleep(pause).await;
    }
    Ok(by_key)
}

/// What differs between bundle `b` and the order its id already names,
/// if that order holds codes: its items (a line's pool), its buyer, its
/// quantity, or its owner.
fn conflict(b: &Purchase, held: &HashMap<String, Vec<Code>>) -> Option<&'static str> {
    let codes = held.get(&b.order_id)?;
    for c in codes {
        let h = c.holder.as_ref()?;
        if c.pool != b.pool_of_line(h.line) {
            return Some("items (pool)");
        }
        let what = b.conflicts_with(&b.pool, &h.uid, h.quantity, h.owner.as_deref());
        if what.is_some() {
            return what;
        }
    }
    None
}

/// The work of one bundle: the lines its order does not hold yet, item by
/// item.
fn plan_work<'a>(b: &'a Purchase, held: &HashMap<String, Vec<Code>>) -> Work<'a> {
    let before: Vec<Grant> = held
        .get(&b.order_id)
        .into_iter()
        .flatten()
        .filter_map(Code::grant)
        .collect();
    let have: HashSet<u32> = before.iter().map(|g| g.line).collect();
    let items = b.items();
    let offsets = item_offsets(&items);
    let keys: Vec<String> = (0..items.len())
        .map(|i| bundle_key(&b.order_id, i))
        .collect();
    let claims = item_claims(&keys, &items, &b.uid, b.owner.as_ref());
    let lines = items
        .iter()
        .zip(&offsets)
        .map(|(item, off)| {
            (0..item.quantity)
                .filter(|j| !have.contains(&(off + j)))
                .collect()
        })
        .collect();
    Work {
        bundle: b,
        keys,
        claims,
        lines,
        before,
    }
}

/// Decides a bundle: whole, its held codes go to its order's lines
/// (added to `commits`); short, its keys go to `put_back` and it waits
/// whole. Returns its outcome as it will be once both are written.
fn settle<'w>(
    w: &'w Work<'_>,
    by_key: &HashMap<String, ClaimOutcome>,
    resend: Resend,
    short_pools: &mut BTreeSet<String>,
    done: &mut HashSet<&'w str>,
    commits: &mut Vec<(CodeId, String, ClaimAssignment)>,
    put_back: &mut Vec<String>,
) -> ClaimOutcome {
    let b = w.bundle;
    let offsets = item_offsets(&b.items());
    let asked = |i: usize| !w.lines[i].is_empty();
    let short: Vec<usize> = (0..w.keys.len())
        .filter(|&i| {
            asked(i)
                && by_key
                    .get(&w.keys[i])
                    .is_none_or(|o| !o.missing().is_empty())
        })
        .collect();
    let mut grants = w.before.clone();
    if !short.is_empty() {
        for &i in &short {
            short_pools.insert(w.claims[i].pool.clone());
        }
        put_back.extend(w.keys.iter().cloned());
        let have: HashSet<u32> = grants.iter().map(|g| g.line).collect();
        let missing = (0..b.quantity).filter(|l| !have.contains(l)).collect();
        return ClaimOutcome::Claimed {
            grants,
            fresh: 0,
            missing,
        };
    }
    // A second delivery of the same bundle in this batch: the first one
    // commits; this one answers what the order will hold.
    let first = done.insert(b.order_id.as_str());
    let mut held_codes = Vec::new();
    let mut order_grants = Vec::new();
    for (i, key) in w.keys.iter().enumerate() {
        let Some(o) = by_key.get(key).filter(|_| asked(i)) else {
            continue;
        };
        for g in o.grants() {
            held_codes.push(HeldCode {
                id: g.code_id,
                pool: g.pool.clone(),
                seq: 0,
                line: g.line,
                key: key.clone(),
            });
            order_grants.push(as_order_grant(g, b, offsets[i] + g.line));
        }
    }
    let fresh = if first {
        let mine = commits_of(b, &w.keys, &held_codes, Move::BundleCommit, resend);
        let n = mine.len() as u32;
        commits.extend(mine);
        n
    } else {
        0
    };
    grants.extend(order_grants);
    grants.sort_by_key(|g| g.line);
    ClaimOutcome::Claimed {
        grants,
        fresh,
        missing: Vec::new(),
    }
}
