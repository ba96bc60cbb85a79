//! The claim: how a purchase gets exactly the codes it asked for. Read this
//! file top to bottom to know how ownership is decided.
//!
//! Each line of an order (0 to quantity − 1) is a *slot*: the unique
//! `(order_id, line)` index allows one code per slot. A batch claims the
//! first line each order asks for (its anchor) before any other: an order
//! id already taken by a different order (pool, buyer or quantity) shows
//! there, and that purchase gets nothing more. Only an order whose anchor
//! it holds, as the same order, claims its other lines, in a second write.
//! So no order ever gets more codes than its first purchase asked for.
//!
//! 0. The caller may hand in what the orders held when it read them (the
//!    intake reads it alongside the batch's policies). A line that read
//!    shows held is not claimed: a code once held stays held, so the read
//!    is what a claim's read-back would say. An order holding every line
//!    it asks (a retry, a redelivery) claims nothing.
//! 1. Every slot is paired with a *distinct* candidate popped from
//!    the pool's Redis hot set (for a set that ran short, taken from the
//!    refill that loads it), and all pairs are written in one journaled
//!    `update` command: "code `_id` goes to this line of this order if it
//!    is still unissued". MongoDB's condition is the only arbiter; the
//!    unique `(order_id, line)` index forbids a second code per line, so a
//!    line that already holds one (a redelivery or a duplicate) gets that
//!    one back.
//! 2. When the server reports that every statement landed, every pair
//!    won, and the candidates' codes (read while the write was in flight)
//!    make the grants. Otherwise which pairs won is read back by order.
//!    Slots whose candidate was already taken (by another dispatcher, or
//!    through the fallback path) try again with fresh candidates, a few
//!    rounds.
//! 3. Slots still without a code, or all slots when Redis is away, claim
//!    by scanning the pool in MongoDB (`findOneAndUpdate` on
//!    `(pool, status, seq)`). If that finds nothing, the pool is exhausted
//!    and the slots left wait as a backorder.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use codepool_domain::{Code, Grant, Purchase};
use codepool_hotpool::HotPoolError;
use codepool_store::codes::ScanClaim;
use codepool_store::{ClaimAssignment, ClaimWay, Resend};
use tracing::{debug, warn};

pub use crate::claim_error::ClaimError;
pub use refill::{Refill, RefillError};
use refill::{DRY_BACKOFF, PARALLEL_REFILLS};

mod bind;
mod refill;
use crate::ports::{Candidate, CandidatePool, ClaimStore, Numbering};
pub(crate) use bind::{bound_of, refused_by};

/// What a purchase got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// The order holds `grants` (by line) on the lines asked; `fresh` of
    /// them were issued by this call (the others it held before: a
    /// redelivery or a duplicate). `missing` lines have no code: the pool
    /// had no unissued, unexpired code left for them.
    Claimed {
        grants: Vec<Grant>,
        fresh: u32,
        missing: Vec<u32>,
    },
    /// The order id is held by a different order: `what` differs (pool,
    /// buyer or quantity). Nothing was claimed.
    Conflict { what: &'static str },
}

impl ClaimOutcome {
    /// Nothing could be claimed: every line asked waits for stock.
    pub fn exhausted(lines: Vec<u32>) -> Self {
        Self::Claimed {
            grants: Vec::new(),
            fresh: 0,
            missing: lines,
        }
    }

    /// The grants the order holds (none for a conflict).
    pub fn grants(&self) -> &[Grant] {
        match self {
            Self::Claimed { grants, .. } => grants,
            Self::Conflict { .. } => &[],
        }
    }

    /// The lines left without a code.
    pub fn missing(&self) -> &[u32] {
        match self {
            Self::Claimed { missing, .. } => missing,
            Self::Conflict { .. } => &[],
        }
    }

    /// How many codes this call issued.
    pub fn fresh(&self) -> u32 {
        match self {
            Self::Claimed { fresh, .. } => *fresh,
            Self::Conflict { .. } => 0,
        }
    }

    /// The one grant of an order of one code, and whether this call issued
    /// it: `None` when it holds none (or several).
    pub fn single(&self) -> Option<(Grant, bool)> {
        match self {
            Self::Claimed { grants, fresh, .. } if grants.len() == 1 => {
                Some((grants[0].clone(), *fresh == 1))
            }
            _ => None,
        }
    }

    /// The pool had nothing for this order: no code held, lines missing.
    pub fn is_exhausted(&self) -> bool {
        self.grants().is_empty() && !self.missing().is_empty()
    }
}

/// One order and the lines it asks codes for: every line for a purchase
/// (`0..quantity`), the waiting ones for a backorder.
#[derive(Debug, Clone, Copy)]
pub struct ClaimAsk<'a> {
    pub purchase: &'a Purchase,
    /// Ascending and below the purchase's quantity; empty asks for none.
    pub lines: &'a [u32],
}

/// What one slot got.
#[derive(Debug, Clone, PartialEq, Eq)]
// Short-lived, one per slot of a batch: boxing the grant would cost an
// allocation per claimed code for no saving.
#[allow(clippy::large_enum_variant)]
enum SlotOutcome {
    Granted { grant: Grant, fresh: bool },
    Exhausted,
}

/// One line of one order, in a claim.
#[derive(Debug, Clone, Copy)]
struct Slot<'a> {
    purchase: &'a Purchase,
    line: u32,
    /// The first line the claim asks for (see [`Grant::part`]).
    part: u32,
}

/// Every line `0..quantity` of each purchase.
pub fn all_lines(purchases: &[&Purchase]) -> Vec<Vec<u32>> {
    purchases
        .iter()
        .map(|p| (0..p.quantity).collect())
        .collect()
}

/// The grant a code read back for `order_id` carries; an error when the
/// code has none (it would otherwise look like "no code").
fn grant_of(order_id: &str, code: &Code) -> Result<Grant, ClaimError> {
    code.grant().ok_or_else(|| {
        ClaimError::inconsistent(order_id, format!("code {} has no holder", code.id))
    })
}

/// The code on `line` among an order's codes read back. A code read back
/// without its holder matches any line, so [`grant_of`] reports it rather
/// than the line looking empty.
fn on_line(codes: Option<&Vec<Code>>, line: u32) -> Option<&Code> {
    codes?
        .iter()
        .find(|c| c.holder.as_ref().is_none_or(|h| h.line == line))
}

/// Knobs of the claim engine.
#[derive(Debug, Clone)]
pub struct ClaimConfig {
    /// Rounds of fresh candidates for orders that lost a race.
    pub race_rounds: usize,
    /// Most candidates loaded into a hot set per refill (a busy pool's).
    pub refill_batch: i64,
    /// Fewest candidates loaded per refill (a quiet pool's).
    pub min_refill: i64,
    /// How long a refiller may hold a pool's refill lock (and how long a
    /// claimer waits for someone else's refill).
    pub refill_lock_ttl: Duration,
    /// Below this many candidates (or half a refill, if less), the set
    /// is topped up in the background.
    pub low_water: u64,
}

impl Default for ClaimConfig {
    fn default() -> Self {
        Self {
            race_rounds: 3,
            refill_batch: 5000,
            min_refill: 64,
            refill_lock_ttl: Duration::from_secs(10),
            low_water: 2500,
        }
    }
}

/// Claims codes for purchases. Cheap to share between tasks.
#[derive(Clone)]
pub struct ClaimEngine {
    store: Arc<dyn ClaimStore>,
    hot: Arc<dyn CandidatePool>,
    numbers: Arc<dyn Numbering>,
    config: ClaimConfig,
    /// Pools whose last refill reached their end, and whether it found
    /// nothing at all.
    dry: Arc<std::sync::Mutex<HashMap<String, Dry>>>,
    /// Recent demand per pool, which sizes its refills.
    demand: Arc<crate::demand::Demand>,
}

/// A refill that reached the end of its pool: when, and whether it found
/// no candidate at all (the pool is sold out).
#[derive(Debug, Clone, Copy)]
struct Dry {
    at: Instant,
    empty: bool,
}

impl Dry {
    fn recent(&self) -> bool {
        self.at.elapsed() < DRY_BACKOFF
    }
}

/// One slot of a batch paired with the candidate it tries to claim.
struct Pairing<'a> {
    /// Position of the slot among the claim's slots.
    index: usize,
    slot: Slot<'a>,
    candidate: Candidate,
}

impl ClaimEngine {
    pub fn new(
        store: Arc<dyn ClaimStore>,
        hot: Arc<dyn CandidatePool>,
        numbers: Arc<dyn Numbering>,
        config: ClaimConfig,
    ) -> Self {
        Self {
            store,
            hot,
            numbers,
            config,
            dry: Arc::default(),
            demand: Arc::default(),
        }
    }

    /// True while the candidate pool is away and claims scan MongoDB.
    pub fn is_degraded(&self) -> bool {
        self.hot.is_degraded()
    }

    /// A grant number for one code of `p`'s pool, outside a claim (a
    /// replacement's new code).
    pub async fn grant_number(&self, p: &Purchase) -> Result<Option<String>, ClaimError> {
        Ok(self.numbers.for_purchases(&[p]).await?.pop().flatten())
    }

    /// Claims every line of every purchase (`quantity` codes each),
    /// returning outcomes aligned with the input. Purchases of the same
    /// order share one outcome. `resend` says what sends a fresh grant's
    /// event again if this process stops before it is confirmed.
    pub async fn claim_batch(
        &self,
        purchases: &[&Purchase],
        resend: Resend,
    ) -> Result<Vec<ClaimOutcome>, ClaimError> {
        self.claim_known(purchases, resend, &HashMap::new()).await
    }

    /// [`Self::claim_batch`], given what some of the orders held when the
    /// caller read them (see [`Self::claim_asks_known`]).
    pub async fn claim_known(
        &self,
        purchases: &[&Purchase],
        resend: Resend,
        known: &HashMap<String, Vec<Code>>,
    ) -> Result<Vec<ClaimOutcome>, ClaimError> {
        let lines = all_lines(purchases);
        let asks: Vec<ClaimAsk> = purchases
            .iter()
            .zip(&lines)
            .map(|(p, l)| ClaimAsk {
                purchase: p,
                lines: l,
            })
            .collect();
        self.claim_asks_known(&asks, ClaimWay::claim(resend), known)
            .await
    }

    /// Claims the lines each ask names, returning outcomes aligned with the
    /// input. Asks of the same order share the first one's outcome, unless
    /// they are a different order under the same id (a conflict).
    pub async fn claim_asks(
        &self,
        asks: &[ClaimAsk<'_>],
        way: ClaimWay,
    ) -> Result<Vec<ClaimOutcome>, ClaimError> {
        self.claim_asks_known(asks, way, &HashMap::new()).await
    }

    /// [`Self::claim_asks`], given what some of the orders held.
    ///
    /// `known` holds the codes some of these orders held when the caller
    /// read them (by order, as `grants_for_orders` returns them). The lines
    /// it shows held are not claimed again: a code once held stays held,
    /// so the read cannot be stale. An order holding every line it asks
    /// (a retry, a redelivery), or whose first line another order holds,
    /// claims nothing. Empty is always correct; it only costs a repeat
    /// the whole claim path.
    ///
    /// Every claim (orders, holds, bundles, backorders) runs in a `claim`
    /// span at debug, with the number of asks and what resends its events.
    #[tracing::instrument(
        name = "claim",
        level = "debug",
        skip_all,
        fields(asks = asks.len(), way = ?way)
    )]
    pub async fn claim_asks_known(
        &self,
        asks: &[ClaimAsk<'_>],
        way: ClaimWay,
        known: &HashMap<String, Vec<Code>>,
    ) -> Result<Vec<ClaimOutcome>, ClaimError> {
        let started = Instant::now();
        // One entry per distinct order; duplicates in the batch point at it.
        let mut first_of: HashMap<&str, usize> = HashMap::new();
        let mut unique: Vec<ClaimAsk> = Vec::new();
        for a in asks {
            first_of
                .entry(a.purchase.order_id.as_str())
                .or_insert_with(|| {
                    unique.push(*a);
                    unique.len() - 1
                });
        }
        let outcomes = self.claim_bound(&unique, way, known).await?;
        metrics::histogram!("codepool_claim_batch_seconds").record(started.elapsed().as_secs_f64());
        Ok(asks
            .iter()
            .map(|a| {
                let first = &unique[first_of[a.purchase.order_id.as_str()]];
                let p = first.purchase;
                match (a.purchase).conflicts_with(&p.pool, &p.uid, p.quantity, p.owner.as_deref()) {
                    Some(what) => ClaimOutcome::Conflict { what },
                    None => outcomes[first_of[a.purchase.order_id.as_str()]].clone(),
                }
            })
            .collect())
    }

    /// [`Self::claim_unique`] of the distinct orders whose ids are bound
    /// to them ([`codepool_store::order_ids`]); an order whose id another
    /// order took first is a conflict, and claims nothing.
    async fn claim_bound(
        &self,
        asks: &[ClaimAsk<'_>],
        way: ClaimWay,
        known: &HashMap<String, Vec<Code>>,
    ) -> Result<Vec<ClaimOutcome>, ClaimError> {
        // An order whose first line `known` shows held is a repeat: the
        // code on that line names its order, and `after_anchors` compares
        // the two. Only the others bind their id (one insert).
        let repeat = |a: &ClaimAsk| {
            let first = a.lines.first();
            first.is_some_and(|&l| on_line(known.get(&a.purchase.order_id), l).is_some())
        };
        let to_bind: Vec<usize> = (0..asks.len()).filter(|&i| !repeat(&asks[i])).collect();
        let wanted: Vec<_> = to_bind
            .iter()
            .map(|&i| bound_of(asks[i].purchase))
            .collect();
        let bound = self.store.bind_orders(&wanted).await?;
        let mut refused: Vec<Option<&'static str>> = vec![None; asks.len()];
        for (&i, b) in to_bind.iter().zip(&bound) {
            refused[i] = refused_by(asks[i].purchase, b);
        }
        let open: Vec<ClaimAsk> = (asks.iter().zip(&refused))
            .filter(|(_, r)| r.is_none())
            .map(|(a, _)| *a)
            .collect();
        let mut claimed = self.claim_unique(&open, way, known).await?.into_iter();
        refused
            .into_iter()
            .map(|r| match r {
                Some(what) => Ok(ClaimOutcome::Conflict { what }),
                None => claimed.next().ok_or_else(|| {
                    ClaimError::inconsistent("", "a claim answered fewer orders than it was given")
                }),
            })
            .collect()
    }

    /// The claim of distinct orders: anchors first, then the other lines
    /// of the orders that hold their anchor as the same order. An anchor
    /// `known` shows held is not claimed: that read is its outcome, as a
    /// claim's read-back would be.
    async fn claim_unique(
        &self,
        asks: &[ClaimAsk<'_>],
        way: ClaimWay,
        known: &HashMap<String, Vec<Code>>,
    ) -> Result<Vec<ClaimOutcome>, ClaimError> {
        let anchors: Vec<Slot> = asks
            .iter()
            .filter_map(|a| {
                let line = *a.lines.first()?;
                Some(Slot {
                    purchase: a.purchase,
                    line,
                    part: line,
                })
            })
            .collect();
        let read: Vec<Option<SlotOutcome>> = (anchors.iter())
            .map(|s| {
                let order_id = &s.purchase.order_id;
                on_line(known.get(order_id), s.line)
                    .map(|code| {
                        let grant = grant_of(order_id, code)?;
                        Ok(SlotOutcome::Granted {
                            grant,
                            fresh: false,
                        })
                    })
                    .transpose()
            })
            .collect::<Result<_, ClaimError>>()?;
        let open: Vec<Slot> = (anchors.iter().zip(&read))
            .filter(|(_, r)| r.is_none())
            .map(|(s, _)| *s)
            .collect();
        let (claimed, mut held) = self.claim_slots(&open, way).await?;
        let mut claimed = claimed.into_iter();
        let anchored: Vec<SlotOutcome> = read
            .into_iter()
            .filter_map(|r| r.or_else(|| claimed.next()))
            .collect();
        for a in asks {
            if let Some(codes) = known.get(&a.purchase.order_id) {
                (held.entry(a.purchase.order_id.clone())).or_insert_with(|| codes.clone());
            }
        }
        let (mut outcomes, rest) = after_anchors(asks, anchored, &held)?;
        let (more, _) = self.claim_slots(&rest, way).await?;
        let by_order: HashMap<&str, usize> = asks
            .iter()
            .enumerate()
            .map(|(i, a)| (a.purchase.order_id.as_str(), i))
            .collect();
        for (slot, got) in rest.iter().zip(more) {
            let i = by_order[slot.purchase.order_id.as_str()];
            if let ClaimOutcome::Claimed {
                grants,
                fresh,
                missing,
            } = &mut outcomes[i]
            {
                match got {
                    SlotOutcome::Granted { grant, fresh: f } => {
                        *fresh += u32::from(f);
                        grants.push(grant);
                    }
                    SlotOutcome::Exhausted => missing.push(slot.line),
                }
            }
        }
        add_held_before(asks, &mut outcomes, &held)?;
        Ok(outcomes)
    }

    /// Claims one code for every slot, returning outcomes aligned with the
    /// input, and the codes read back of orders that held some before.
    async fn claim_slots(
        &self,
        slots: &[Slot<'_>],
        way: ClaimWay,
    ) -> Result<(Vec<SlotOutcome>, HashMap<String, Vec<Code>>), ClaimError> {
        let mut outcomes: Vec<Option<SlotOutcome>> = vec![None; slots.len()];
        let mut held: HashMap<String, Vec<Code>> = HashMap::new();
        if slots.is_empty() {
            return Ok((Vec::new(), held));
        }
        // 1. Every slot tries for a fresh code. One that already holds a
        //    code is refused by the unique (order_id, line) index, and the
        //    read-back below returns the code it holds (`fresh: false`).
        let todo: Vec<usize> = (0..slots.len()).collect();

        // 2–3. Distinct candidates from the hot set, claimed in bulk.
        let (scan, spare) = self
            .claim_from_hot_set(slots, todo, way, &mut outcomes, &mut held)
            .await?;

        // 3. The scan: Redis away, hot set empty, or races kept being lost
        //    (with the numbers fetched for these slots and not used).
        if !scan.is_empty() {
            let started = Instant::now();
            let scanned = self
                .claim_by_scan(slots, &scan, spare, way, &mut outcomes, &mut held)
                .await;
            stage("scan", started);
            scanned?;
        }
        let outcomes = slots
            .iter()
            .zip(outcomes)
            .map(|(s, o)| {
                o.ok_or_else(|| {
                    ClaimError::inconsistent(&s.purchase.order_id, "no outcome was decided")
                })
            })
            .collect::<Result<_, _>>()?;
        Ok((outcomes, held))
    }

    /// Rounds of pairing orders with candidates and claiming them in bulk.
    /// Returns the orders left for the scan, and the grant numbers fetched
    /// for them but not used.
    async fn claim_from_hot_set(
        &self,
        slots: &[Slot<'_>],
        mut todo: Vec<usize>,
        way: ClaimWay,
        outcomes: &mut [Option<SlotOutcome>],
        held: &mut HashMap<String, Vec<Code>>,
    ) -> Result<(Vec<usize>, HashMap<usize, Option<String>>), ClaimError> {
        let mut scan: Vec<usize> = Vec::new();
        // Numbers fetched and not yet written, by order.
        let mut numbers: HashMap<usize, Option<String>> = HashMap::new();
        for _round in 0..self.config.race_rounds {
            if todo.is_empty() {
                break;
            }
            // Grant numbers come while candidates are paired, not after:
            // one round trip less per batch. Orders of a pool whose last
            // refill found nothing (sold out, lately) are numbered once
            // paired, so a sell-out does not spend a number per purchase.
            let early = self.not_sold_out(slots, &todo);
            let (pairs, early) = futures::join!(
                self.pair_with_candidates(slots, &todo, &mut scan),
                self.numbers_for(slots, &early)
            );
            // Failed early: the pairs ask again below.
            numbers.extend(early.unwrap_or_default());
            if pairs.is_empty() {
                todo.clear();
                break;
            }
            if let Err(e) = self.number_the_rest(slots, &pairs, &mut numbers).await {
                self.put_back(&pairs).await;
                return Err(e);
            }
            todo = self
                .claim_candidates(&pairs, &numbers, way, outcomes, held)
                .await?;
            // A pair's number went into the write (one that lost its race
            // is not used again); orders sent to the scan use theirs there.
            for p in &pairs {
                numbers.remove(&p.index);
            }
            if !todo.is_empty() {
                metrics::counter!("codepool_claim_races_total").increment(todo.len() as u64);
                debug!(
                    lost = todo.len(),
                    "candidates already taken; retrying with fresh ones"
                );
            }
        }
        scan.extend(todo);
        Ok((scan, numbers))
    }

    /// Adds to `numbers` one for every pair that has none yet.
    async fn number_the_rest(
        &self,
        slots: &[Slot<'_>],
        pairs: &[Pairing<'_>],
        numbers: &mut HashMap<usize, Option<String>>,
    ) -> Result<(), ClaimError> {
        let missing: Vec<usize> = (pairs.iter().map(|p| p.index))
            .filter(|i| !numbers.contains_key(i))
            .collect();
        if !missing.is_empty() {
            numbers.extend(self.numbers_for(slots, &missing).await?);
        }
        Ok(())
    }

    /// The slots of `todo` whose pool a refill did not lately find
    /// without a single candidate.
    fn not_sold_out(&self, slots: &[Slot<'_>], todo: &[usize]) -> Vec<usize> {
        let dry = self.dry.lock().ok();
        let sold_out = |pool: &str| {
            dry.as_ref()
                .and_then(|d| d.get(pool))
                .is_some_and(|d| d.empty && d.recent())
        };
        (todo.iter().copied())
            .filter(|&i| !sold_out(&slots[i].purchase.pool))
            .collect()
    }

    /// A grant number for each slot of `todo`, by its index.
    async fn numbers_for(
        &self,
        slots: &[Slot<'_>],
        todo: &[usize],
    ) -> Result<HashMap<usize, Option<String>>, ClaimError> {
        let purchases: Vec<&Purchase> = todo.iter().map(|&i| slots[i].purchase).collect();
        let started = Instant::now();
        let numbers = self.numbers.for_purchases(&purchases).await;
        stage("numbers", started);
        let numbers = numbers?;
        Ok(todo.iter().copied().zip(numbers).collect())
    }

    /// Pairs each order of `todo` with a distinct candidate of its pool.
    /// Oldest candidates go to the first orders; orders left without one
    /// (the set ran dry, or Redis is away) go to `scan`. Every pool of the
    /// batch pops in one round trip; pools that came up short are refilled
    /// concurrently.
    async fn pair_with_candidates<'a>(
        &self,
        slots: &[Slot<'a>],
        todo: &[usize],
        scan: &mut Vec<usize>,
    ) -> Vec<Pairing<'a>> {
        let mut by_pool: Vec<(&str, Vec<usize>)> = Vec::new();
        let mut slot: HashMap<&str, usize> = HashMap::new();
        for &i in todo {
            let pool = slots[i].purchase.pool.as_str();
            let at = *slot.entry(pool).or_insert_with(|| {
                by_pool.push((pool, Vec::new()));
                by_pool.len() - 1
            });
            by_pool[at].1.push(i);
        }
        let wants: Vec<(&str, usize)> = by_pool.iter().map(|(p, idxs)| (*p, idxs.len())).collect();
        self.demand.record(&wants);
        metrics::counter!("codepool_claim_round_pools_total").increment(wants.len() as u64);
        let started = Instant::now();
        let popped = self.hot.pop_many(&wants).await;
        stage("pop", started);
        let Ok(mut popped) = popped else {
            scan.extend(by_pool.into_iter().flat_map(|(_, idxs)| idxs));
            return Vec::new();
        };
        let started = Instant::now();
        let empty = self.refill_short(&wants, &mut popped).await;
        stage("refill_short", started);
        let started = Instant::now();
        let mut topped = Vec::with_capacity(wants.len());
        let mut popped = popped.into_iter().zip(empty);
        for chunk in wants.chunks(PARALLEL_REFILLS) {
            let mut pending = Vec::with_capacity(chunk.len());
            for (&(pool, k), ((got, left), empty)) in chunk.iter().zip(popped.by_ref()) {
                // A pool its refill just found empty is not refilled again.
                let k = if empty { got.len() } else { k };
                pending.push(self.complete(pool, k, got, left));
            }
            topped.extend(futures::future::join_all(pending).await);
        }
        stage("complete", started);
        let mut pairs = Vec::new();
        for ((_, idxs), candidates) in by_pool.into_iter().zip(topped) {
            let Ok(candidates) = candidates else {
                scan.extend(idxs);
                continue;
            };
            let mut candidates = candidates.into_iter();
            for index in idxs {
                match candidates.next() {
                    Some(candidate) => pairs.push(Pairing {
                        index,
                        slot: slots[index],
                        candidate,
                    }),
                    None => scan.push(index),
                }
            }
        }
        pairs
    }

    /// Writes all pairs in one command, learns which won (from the write
    /// itself when every pair landed, else by reading grants back by
    /// order), and returns the indexes of slots that must try again. The
    /// codes read back are kept in `held`, by order.
    async fn claim_candidates(
        &self,
        pairs: &[Pairing<'_>],
        numbers: &HashMap<usize, Option<String>>,
        way: ClaimWay,
        outcomes: &mut [Option<SlotOutcome>],
        held: &mut HashMap<String, Vec<Code>>,
    ) -> Result<Vec<usize>, ClaimError> {
        let assignments = pairs
            .iter()
            .map(|p| {
                let grant_no = numbers.get(&p.index).cloned().ok_or_else(|| {
                    ClaimError::inconsistent(
                        &p.slot.purchase.order_id,
                        "no grant number was fetched",
                    )
                })?;
                Ok(assignment(&p.slot, p.candidate, grant_no, way))
            })
            .collect::<Result<Vec<ClaimAssignment>, ClaimError>>()?;
        let started = Instant::now();
        let write = self.store.claim_candidates(&assignments).await;
        stage("claim_write", started);
        let write = match write {
            Ok(w) => w,
            Err(e) => {
                // Unknown which landed: give candidates back; the retry reads
                // grants by order, and conditions keep it exact.
                self.put_back(pairs).await;
                return Err(e.into());
            }
        };
        // Slots refused by the unique index already hold a code elsewhere;
        // their candidate is still unissued and goes back to the set.
        self.put_back(write.order_taken.iter().filter_map(|&k| pairs.get(k)))
            .await;

        let read_back = to_read_back(pairs, &write);
        if !read_back.is_empty() {
            let started = Instant::now();
            let read = self.store.grants_for_orders(&read_back).await;
            stage("read_back", started);
            held.extend(read?);
        }
        let granted = write.granted.unwrap_or_default();
        drop_strays(&write.strays);
        // A grant is ours (fresh) when it carries the code and the grant
        // number this very write assigned; the code id alone is not enough,
        // because a stale candidate can be the order's own, already issued,
        // code.
        let mut retry = Vec::new();
        for (p, a) in pairs.iter().zip(&assignments) {
            let order_id = &p.slot.purchase.order_id;
            let code = granted
                .get(&a.slot())
                .or_else(|| on_line(held.get(order_id), p.slot.line));
            let Some(code) = code else {
                retry.push(p.index);
                continue;
            };
            let grant = grant_of(order_id, code)?;
            let fresh =
                a.code_id == grant.code_id && a.grant_no.is_some() && a.grant_no == grant.grant_no;
            if fresh {
                metrics::counter!("codepool_claims_total", "path" => "hot").increment(1);
                crate::telemetry::record_issued(1);
            }
            outcomes[p.index] = Some(SlotOutcome::Granted { grant, fresh });
        }
        Ok(retry)
    }

    /// Offers codes back in stock (a released hold's) to their pools' hot
    /// sets, so the next claims find them at once. Best effort: a refill's
    /// rescan finds them too, and the scan always does.
    pub async fn offer(&self, codes: &[codepool_store::holds::HeldCode]) {
        let mut by_pool: HashMap<&str, Vec<Candidate>> = HashMap::new();
        for c in codes {
            by_pool.entry(c.pool.as_str()).or_default().push(Candidate {
                id: c.id,
                seq: c.seq,
            });
        }
        for (pool, candidates) in by_pool {
            let _ = self.hot.put_back(pool, &candidates).await;
            self.replenished(pool);
        }
    }

    /// Returns the candidates of these pairs to their pools' hot sets.
    async fn put_back<'p, 'a: 'p>(&self, pairs: impl IntoIterator<Item = &'p Pairing<'a>>) {
        let mut by_pool: HashMap<&str, Vec<Candidate>> = HashMap::new();
        for p in pairs {
            by_pool
                .entry(p.slot.purchase.pool.as_str())
                .or_default()
                .push(p.candidate);
        }
        for (pool, candidates) in by_pool {
            let _ = self.hot.put_back(pool, &candidates).await;
        }
    }

    /// Completes a pool's pop of `k` candidates (`got` so far, `remaining`
    /// left in its set): refills the hot set from MongoDB while it runs
    /// dry (or waits for the refill another claimer is doing). Fewer than
    /// `k` means the pool has no more candidates right now. When the set
    /// runs low, a background refill tops it up before it is empty. An
    /// error means Redis is away.
    async fn complete(
        &self,
        pool: &str,
        k: usize,
        mut got: Vec<Candidate>,
        mut remaining: u64,
    ) -> Result<Vec<Candidate>, HotPoolError> {
        let deadline = Instant::now() + self.config.refill_lock_ttl;
        while got.len() < k {
            let started = Instant::now();
            let refill = self.refill_for(pool, k - got.len()).await;
            stage("refill_one", started);
            metrics::counter!("codepool_refill_pools_total", "path" => "one").increment(1);
            match refill {
                Ok((Refill::Added(0), _)) => break,
                Ok((Refill::Added(n), kept)) => {
                    let installed = n - kept.len();
                    remaining = installed as u64;
                    got.extend(kept);
                    if got.len() >= k || installed == 0 {
                        continue;
                    }
                }
                Ok((Refill::Stocked, _)) => {}
                Ok((Refill::Busy, _)) if Instant::now() < deadline => {
                    let started = Instant::now();
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    stage("busy_wait", started);
                }
                Ok((Refill::Busy, _)) => break,
                Err(RefillError::Store(e)) => {
                    warn!(pool, error = %e, "hot pool refill failed");
                    break;
                }
                Err(RefillError::Redis(e)) => {
                    let _ = self.hot.put_back(pool, &got).await;
                    return Err(e);
                }
            }
            let (more, left) = self.hot.pop(pool, k - got.len()).await?;
            got.extend(more);
            remaining = left;
        }
        if remaining < self.low_water(pool) && got.len() == k {
            self.refill_in_background(pool);
        }
        Ok(got)
    }

    /// Claims one by one by scanning MongoDB; the first "nothing left" marks
    /// the rest of that pool's slots in this batch as exhausted.
    async fn claim_by_scan(
        &self,
        slots: &[Slot<'_>],
        idxs: &[usize],
        mut numbers: HashMap<usize, Option<String>>,
        way: ClaimWay,
        outcomes: &mut [Option<SlotOutcome>],
        held: &mut HashMap<String, Vec<Code>>,
    ) -> Result<(), ClaimError> {
        let mut empty_pools: Vec<&str> = Vec::new();
        let mut maybe_exhausted: Vec<usize> = Vec::new();
        for &i in idxs {
            let slot = &slots[i];
            let p = slot.purchase;
            if empty_pools.contains(&p.pool.as_str()) {
                maybe_exhausted.push(i);
                continue;
            }
            let grant_no = match numbers.remove(&i) {
                Some(n) => n,
                None => self.numbers.for_purchases(&[p]).await?.pop().flatten(),
            };
            let claim = assignment(slot, SCAN_PLACEHOLDER, grant_no, way);
            match self.store.claim_by_scan(&p.pool, &claim).await? {
                ScanClaim::Granted(code) => {
                    let grant = grant_of(&p.order_id, &code)?;
                    metrics::counter!("codepool_claims_total", "path" => "scan").increment(1);
                    crate::telemetry::record_issued(1);
                    outcomes[i] = Some(SlotOutcome::Granted { grant, fresh: true });
                }
                ScanClaim::OrderAlreadyGranted => maybe_exhausted.push(i),
                ScanClaim::Empty => {
                    empty_pools.push(p.pool.as_str());
                    maybe_exhausted.push(i);
                }
            }
        }
        // Before calling a slot exhausted, look once more: another
        // dispatcher may have just granted it (a concurrent duplicate).
        let mut orders: Vec<&str> = maybe_exhausted
            .iter()
            .map(|&i| slots[i].purchase.order_id.as_str())
            .collect();
        orders.sort_unstable();
        orders.dedup();
        let grants = self.store.grants_for_orders(&orders).await?;
        for i in maybe_exhausted {
            let order_id = &slots[i].purchase.order_id;
            outcomes[i] = Some(match on_line(grants.get(order_id), slots[i].line) {
                Some(code) => SlotOutcome::Granted {
                    grant: grant_of(order_id, code)?,
                    fresh: false,
                },
                None => SlotOutcome::Exhausted,
            });
        }
        held.extend(grants);
        Ok(())
    }
}

/// The orders a claim write must read back: when every statement landed
/// the write already knows its grants, and only orders that held a code
/// before are read; otherwise every order of the write.
fn to_read_back<'p>(pairs: &'p [Pairing<'_>], write: &codepool_store::ClaimWrite) -> Vec<&'p str> {
    let mut read_back: Vec<&str> = match &write.granted {
        Some(_) => (write.order_taken.iter())
            .filter_map(|&k| pairs.get(k))
            .map(|p| p.slot.purchase.order_id.as_str())
            .collect(),
        None => pairs
            .iter()
            .map(|p| p.slot.purchase.order_id.as_str())
            .collect(),
    };
    read_back.sort_unstable();
    read_back.dedup();
    read_back
}

/// Each ask's outcome from its anchor's, and the other lines to claim: those
/// of the orders that hold their anchor as the same order and did not hold
/// them before (`held`: codes read back by order). An anchor held by a
/// different order is a conflict; an anchor the pool had no code for
/// leaves every line of its ask waiting.
fn after_anchors<'a>(
    asks: &[ClaimAsk<'a>],
    anchored: Vec<SlotOutcome>,
    held: &HashMap<String, Vec<Code>>,
) -> Result<(Vec<ClaimOutcome>, Vec<Slot<'a>>), ClaimError> {
    let mut outcomes: Vec<ClaimOutcome> = Vec::with_capacity(asks.len());
    let mut rest: Vec<Slot> = Vec::new();
    let mut anchored = anchored.into_iter();
    for a in asks {
        let Some(&first) = a.lines.first() else {
            outcomes.push(ClaimOutcome::exhausted(Vec::new()));
            continue;
        };
        let p = a.purchase;
        let outcome = match anchored.next() {
            Some(SlotOutcome::Granted { grant, fresh }) => {
                match p.conflicts_with(
                    &grant.pool,
                    &grant.uid,
                    grant.quantity,
                    grant.owner.as_deref(),
                ) {
                    Some(what) => ClaimOutcome::Conflict { what },
                    None => {
                        let before = held.get(&p.order_id);
                        rest.extend(
                            (a.lines[1..].iter())
                                .filter(|&&line| on_line(before, line).is_none())
                                .map(|&line| Slot {
                                    purchase: p,
                                    line,
                                    part: first,
                                }),
                        );
                        ClaimOutcome::Claimed {
                            grants: vec![grant],
                            fresh: u32::from(fresh),
                            missing: Vec::new(),
                        }
                    }
                }
            }
            // The pool is empty for the anchor: it is for the others.
            Some(SlotOutcome::Exhausted) => ClaimOutcome::exhausted(a.lines.to_vec()),
            None => {
                return Err(ClaimError::inconsistent(
                    &p.order_id,
                    "no outcome was decided for its first line",
                ))
            }
        };
        outcomes.push(outcome);
    }
    Ok((outcomes, rest))
}

/// Adds to each granted outcome the codes its order held before this call
/// on the lines it asked for (read back while claiming its anchor), and
/// puts its grants in line order.
fn add_held_before(
    asks: &[ClaimAsk<'_>],
    outcomes: &mut [ClaimOutcome],
    held: &HashMap<String, Vec<Code>>,
) -> Result<(), ClaimError> {
    for (a, outcome) in asks.iter().zip(outcomes) {
        let ClaimOutcome::Claimed { grants, .. } = outcome else {
            continue;
        };
        if grants.is_empty() {
            continue;
        }
        for code in held.get(&a.purchase.order_id).into_iter().flatten() {
            let line = code.holder.as_ref().map_or(0, |h| h.line);
            if a.lines[1..].contains(&line) && !grants.iter().any(|g| g.line == line) {
                grants.push(grant_of(&a.purchase.order_id, code)?);
            }
        }
        grants.sort_by_key(|g| g.line);
    }
    Ok(())
}

/// Adds the time since `started` to `stage` of
/// `codepool_claim_stage_seconds`: where a claim's time goes.
fn stage(name: &'static str, started: Instant) {
    metrics::histogram!("codepool_claim_stage_seconds", "stage" => name)
        .record(started.elapsed().as_secs_f64());
}

/// The candidate of a scan claim is chosen by the store; this one is
/// never written.
const SCAN_PLACEHOLDER: Candidate = Candidate {
    id: codepool_domain::CodeId::from_bytes([0; 12]),
    seq: 0,
};

/// Counts the candidates the hot set offered that failed the claim's
/// condition for good (another pool's code, a retired or expired one, an
/// id of nothing). They were popped, so they are already gone from the
/// set; they are never put back.
fn drop_strays(strays: &[(usize, codepool_store::Stray)]) {
    if strays.is_empty() {
        return;
    }
    for (_, why) in strays {
        metrics::counter!("codepool_hot_candidates_dropped_total", "reason" => why.as_str())
            .increment(1);
    }
    warn!(
        dropped = strays.len(),
        "the hot set offered candidates that are not unissued codes of the order's pool; \
         dropped them (a stale or tampered Redis set: check CODEPOOL_REDIS_PREFIX is not shared)"
    );
}

/// "Give `candidate` to this line of this order."
fn assignment(
    slot: &Slot<'_>,
    candidate: Candidate,
    grant_no: Option<String>,
    way: ClaimWay,
) -> ClaimAssignment {
    let p = slot.purchase;
    ClaimAssignment {
        code_id: candidate.id,
        pool: p.pool.clone(),
        order_id: p.order_id.clone(),
        uid: p.uid.clone(),
        phone: p.phone.clone(),
        grant_no,
        mv: way.mv,
        resend: way.resend,
        line: slot.line,
        quantity: p.quantity,
        part: slot.part,
        owner: p.owner.clone(),
    }
}
