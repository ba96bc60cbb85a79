//! Bundles: one order of codes from several pools, granted whole or
//! waiting whole. A bundle claims in two steps through the same batched
//! claim as any order:
//!
//! 1. every line it lacks is claimed `held` ([`Resend::Hold`]) under its
//!    item's key ([`bundle_key`]), every bundle of the batch in one claim;
//! 2. a bundle whose every item got its codes commits them to the order's
//!    lines (4→1) in one write; one that fell short puts what it took back
//!    in stock (4→0) and waits whole as a backorder.
//!
//! A held code is never shown to anyone, so nothing of a bundle that could
//! not complete is seen. A process that dies between the two steps leaves
//! held codes: a redelivery (or a retry) finds them under the same keys
//! and completes the bundle, and the hold sweep returns any that are still
//! held after [`STRAY_AFTER`].

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::OnceLock;
use std::time::Duration;

use codepool_domain::{Code, Grant, Purchase};
use codepool_store::holds::{bundle_key, HeldCode};
use codepool_store::Store;
use tracing::{debug, info};

use crate::claim::{ClaimAsk, ClaimEngine, ClaimError, ClaimOutcome};
use crate::holds::{as_order_grant, commit, item_claims, item_offsets};
use crate::Resend;

/// How long a bundle's held code may stay held before the sweep returns
/// it to stock: far longer than a live bundle takes between its two steps.
pub const STRAY_AFTER: Duration = Duration::from_secs(60);

/// For the suite's crash test only: how long to wait between a bundle's
/// two steps (`CODEPOOL_TEST_BUNDLE_PAUSE_MS`), so a `kill -9` can land
/// there. Unset in production.
fn pause_between_steps() -> Option<Duration> {
    static PAUSE: OnceLock<Option<Duration>> = OnceLock::new();
    *PAUSE.get_or_init(|| {
        std::env::var("CODEPOOL_TEST_BUNDLE_PAUSE_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .map(Duration::from_millis)
    })
}

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
/// when the batch read them.
pub(crate) async fn claim_bundles(
    engine: &ClaimEngine,
    store: &Store,
    bundles: &[&Purchase],
    resend: Resend,
    held: &HashMap<String, Vec<Code>>,
) -> Result<Bundled, ClaimError> {
    let work: Vec<Work> = bundles.iter().map(|b| plan_work(b, held)).collect();
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
    if !asks.is_empty() {
        let outcomes = engine.claim_asks(&asks, Resend::Hold).await?;
        for (a, o) in asks.iter().zip(outcomes) {
            by_key.insert(a.purchase.order_id.clone(), o);
        }
        if let Some(pause) = pause_between_steps() {
            info!(
                ?pause,
                "bundle held; pausing before its commit (CODEPOOL_TEST_BUNDLE_PAUSE_MS)"
            );
            tokio::time::sleep(pause).await;
        }
    }
    let mut out = Bundled {
        outcomes: Vec::with_capacity(work.len()),
        short_pools: BTreeSet::new(),
    };
    let mut done: HashSet<&str> = HashSet::new();
    for w in &work {
        let outcome = settle(
            store,
            engine,
            w,
            &by_key,
            resend,
            &mut out.short_pools,
            &mut done,
        )
        .await?;
        out.outcomes.push(outcome);
    }
    Ok(out)
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

/// Commits a bundle that is whole; puts back what a short one took.
async fn settle<'w>(
    store: &Store,
    engine: &ClaimEngine,
    w: &'w Work<'_>,
    by_key: &HashMap<String, ClaimOutcome>,
    resend: Resend,
    short_pools: &mut BTreeSet<String>,
    done: &mut HashSet<&'w str>,
) -> Result<ClaimOutcome, ClaimError> {
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
        let released = store.release_held(&w.keys).await?;
        engine.offer(&released).await;
        debug!(order_id = %b.order_id, returned = released.len(), "bundle short; what it took is back in stock and it waits whole");
        let have: HashSet<u32> = grants.iter().map(|g| g.line).collect();
        let missing = (0..b.quantity).filter(|l| !have.contains(l)).collect();
        return Ok(ClaimOutcome::Claimed {
            grants,
            fresh: 0,
            missing,
        });
    }
    // A second delivery of the same bundle in this batch: the first one
    // committed; this one answers what the order holds.
    let first = done.insert(b.order_id.as_str());
    let mut fresh = 0;
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
    if first {
        fresh = commit(store, b, &w.keys, &held_codes, resend).await?.len() as u32;
    }
    grants.extend(order_grants);
    grants.sort_by_key(|g| g.line);
    Ok(ClaimOutcome::Claimed {
        grants,
        fresh,
        missing: Vec::new(),
    })
}
