//! Redemption by code, for the platform that honours the codes: `check`
//! tells what became of a code, `redeem` uses it, exactly once.
//!
//! A code is found by its keyed hashes only ([`Store::find_sold_by_values`]),
//! never decrypted to be found, and only among the pools the platform's
//! key may see (its shop's, or every pool for a key of no shop). The
//! answer is never an oracle for guessing codes: a code the key may not
//! see, a code never issued (in stock, held, or expired or recalled before
//! it was sold) and a code that does not exist are one answer, `None`,
//! from the same query. The redemption itself is the one core
//! transition every door uses, made for many redemptions at once
//! ([`ops::redeem_ids`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use codepool_domain::{CodeStatus, LookAlikeRule};
use codepool_store::lifecycle::{RedemptionTag, Sold};
use codepool_store::redemptions::{ByValue, UsedById};
use codepool_store::{Store, StoreError};
use tokio::sync::Mutex;

use crate::audit::Actor;
use crate::batcher::{BatchError, Batcher, Pending, Shape};
use crate::ops;

/// How long the pools and their look-alike rules are kept before they are
/// read again: a new pool (or a shop's new pool) is searched within this.
pub const POOLS_TTL: Duration = Duration::from_secs(2);

/// Longest redemption id accepted.
pub const MAX_REDEMPTION_ID_CHARS: usize = 128;

/// What a platform may know of a code it names: its state, its pool, its
/// grant number and line; never the buyer, the phone or the order.
#[derive(Debug, Clone, PartialEq)]
pub struct Seen {
    pub state: SeenState,
    pub pool: String,
    pub grant_no: Option<String>,
    pub line: u32,
    pub issued_at: Option<DateTime<Utc>>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum SeenState {
    Issued,
    Used {
        at: Option<DateTime<Utc>>,
    },
    Void {
        at: Option<DateTime<Utc>>,
        reason: String,
    },
}

impl SeenState {
    pub fn as_str(&self) -> &'static str {
        match self {
            SeenState::Issued => "issued",
            SeenState::Used { .. } => "used",
            SeenState::Void { .. } => "void",
        }
    }
}

impl Seen {
    /// The code as a platform may see it; `None` for a code that was never
    /// issued to an order (in stock, held, void before it was sold).
    pub fn of(code: &Sold) -> Option<Seen> {
        let state = match code.status {
            CodeStatus::Issued => SeenState::Issued,
            CodeStatus::Used => SeenState::Used { at: code.used_at },
            CodeStatus::Void => SeenState::Void {
                at: code.voided_at,
                reason: code.void_reason.clone().unwrap_or_default(),
            },
            CodeStatus::Unissued | CodeStatus::Held => return None,
        };
        Some(Seen {
            state,
            pool: code.pool.clone(),
            grant_no: code.grant_no.clone(),
            line: code.line,
            issued_at: code.issued_at,
        })
    }
}

/// Why a redemption by code was refused. [`RedeemError::Unknown`] is one
/// answer for every code the key may not learn about.
#[derive(Debug, thiserror::Error)]
pub enum RedeemError {
    #[error("no code issued to an order matches; check that it was typed as printed")]
    Unknown,
    #[error("the code was already redeemed at {}", codepool_domain::when(*.at))]
    AlreadyRedeemed { at: Option<DateTime<Utc>> },
    #[error("the code was voided ({reason}); it cannot be redeemed")]
    Void {
        at: Option<DateTime<Utc>>,
        reason: String,
    },
    #[error("redemption id {0:?} already redeemed another code; send a new id for each code")]
    ConflictingId(String),
    #[error("a redemption id is 1 to {MAX_REDEMPTION_ID_CHARS} characters of plain visible text")]
    BadId,
    /// The key named too many codes that matched nothing
    /// ([`crate::by_code`]): nothing was looked up.
    #[error("this key (or the end user it named) named too many codes that match nothing; wait {wait} s, then send the request again")]
    Slowed { wait: u64 },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Batch(#[from] BatchError),
}

/// Who asks: the key's owner (it tags the key's redemptions) and the shop
/// it belongs to, if any (whose pools it may see).
#[derive(Debug, Clone, Copy)]
pub struct Platform<'a> {
    pub owner: &'a str,
    pub shop: Option<&'a str>,
}

/// Finds codes by value among the pools a key may see. The pools and
/// shops are read at most every [`POOLS_TTL`] of its clock (the system's,
/// or a test's [`crate::clock::ManualClock`]).
pub struct Finder {
    store: Store,
    clock: Arc<dyn crate::clock::Clock>,
    cached: Mutex<Option<(Instant, Arc<Visible>)>>,
    /// Concurrent redemptions, made together.
    redemptions: Batcher<Ask, Redeemed>,
    /// Concurrent checks, looked up together.
    checks: Batcher<Look, Checked>,
}

/// Every pool with its look-alike rule, and each shop's pools.
#[derive(Debug, Default)]
struct Visible {
    pools: Vec<(String, LookAlikeRule)>,
    shops: Vec<codepool_store::shops::ShopDoc>,
    /// The pools whose every code ends with a Crockford check symbol.
    checked: std::collections::HashSet<String>,
}

impl Visible {
    fn for_shop(&self, shop: Option<&str>) -> Vec<(String, LookAlikeRule)> {
        let Some(shop) = shop else {
            return self.pools.clone();
        };
        let Some(s) = self.shops.iter().find(|s| s.name == shop) else {
            return Vec::new();
        };
        let mut out = self.pools.clone();
        out.retain(|(p, _)| s.allows(p));
        out
    }
}

impl Finder {
    pub fn new(store: Store) -> Self {
        Self::with_clock(store, crate::clock::system())
    }

    /// A finder whose cache reads the time from `clock`.
    pub fn with_clock(store: Store, clock: Arc<dyn crate::clock::Clock>) -> Self {
        Finder {
            store: store.clone(),
            clock,
            cached: Mutex::new(None),
            redemptions: {
                let store = store.clone();
                Batcher::new(REDEMPTIONS, move |b| redeem_batch(store.clone(), b))
            },
            checks: Batcher::new(CHECKS, move |b| check_batch(store.clone(), b)),
        }
    }

    async fn visible(&self) -> Result<Arc<Visible>, StoreError> {
        let mut cached = self.cached.lock().await;
        let now = self.clock.now();
        if let Some((at, v)) = cached.as_ref() {
            if now.saturating_duration_since(*at) < POOLS_TTL {
                return Ok(v.clone());
            }
        }
        let pools = self.store.pools().await?;
        let v = Arc::new(Visible {
            pools: pools
                .iter()
                .map(|p| (p.name.clone(), p.lookalike_rule()))
                .collect(),
            shops: self.store.shops().await?,
            checked: (pools.iter())
                .filter(|p| p.check_symbols)
                .map(|p| p.name.clone())
                .collect(),
        });
        *cached = Some((now, v.clone()));
        Ok(v)
    }

    /// The pools `who` may find `code` in. A code whose check symbol fails
    /// is not searched for in the pools whose every code carries one: when
    /// those are all the key sees, there are none, and no lookup at all.
    async fn pools_for(
        &self,
        who: Platform<'_>,
        code: &str,
    ) -> Result<Vec<(String, LookAlikeRule)>, StoreError> {
        let visible = self.visible().await?;
        let mut pools = visible.for_shop(who.shop);
        if !visible.checked.is_empty() && !codepool_domain::crockford::check_ok(code) {
            pools.retain(|(p, _)| !visible.checked.contains(p));
        }
        Ok(pools)
    }

    /// What became of the code `code` names; changes nothing.
    ///
    /// Concurrent checks are looked up together, as redemptions are: the
    /// request joins the queue, and up to [`IN_FLIGHT`] tasks each take up
    /// to [`MAX_BATCH`] of it into one query ([`check_batch`]).
    pub async fn check(&self, who: Platform<'_>, code: &str) -> Result<Seen, RedeemError> {
        let pools = self.pools_for(who, code).await?;
        if pools.is_empty() {
            return Err(RedeemError::Unknown);
        }
        let ask = Look {
            code: code.to_owned(),
            pools,
        };
        self.checks.ask(ask).await?
    }

    /// Redeems the code `code` names, once: `redemption_id` again gets the
    /// same answer (`false`: not made now); any other redemption of a used
    /// code is [`RedeemError::AlreadyRedeemed`] with the first time.
    /// Returns the code as it is now.
    ///
    /// Concurrent redemptions are made together: the request joins the
    /// queue, and up to [`IN_FLIGHT`] tasks at a time (a second once
    /// [`SECOND_AT`] wait, or the running batch is [`SLOW_BATCH`] old)
    /// each take up to
    /// [`MAX_BATCH`] of it as one batch ([`redeem_batch`]).
    pub async fn redeem(
        &self,
        who: Platform<'_>,
        code: &str,
        redemption_id: &str,
        actor: &Actor,
    ) -> Result<(Seen, bool), RedeemError> {
        let id = checked_id(redemption_id).ok_or(RedeemError::BadId)?;
        let pools = self.pools_for(who, code).await?;
        if pools.is_empty() {
            return Err(RedeemError::Unknown);
        }
        let ask = Ask {
            code: code.to_owned(),
            pools,
            tag: RedemptionTag {
                id,
                by: who.owner.to_owned(),
            },
            actor: actor.clone(),
        };
        self.redemptions.ask(ask).await?
    }
}

/// Most redemptions (or checks) made together.
pub const MAX_BATCH: usize = 256;
/// Most batches made at once, of redemptions and of checks each: while
/// one waits for its journaled write (or its read), the next is looked
/// up. Two batches may hold the same code (or the same redemption id);
/// MongoDB's conditional update lets one of them use it, and the other
/// reads back what happened, as between two processes.
pub const IN_FLIGHT: usize = 2;
/// Redemptions that must be waiting before a batch starts beside one
/// that runs (or the running one is [`SLOW_BATCH`] old); fewer wait for
/// it to end, and go together in the next. Every batch pays for a
/// lookup, a journaled write and an audit insert, however few its
/// redemptions: a second batch started for every few made them small, and
/// each redemption dearer. With 64 clients, batches of 20 instead of 15
/// (`codepool-bench redeem`, docs/benchmarks.md). Below 30, the lookups
/// one key may have in flight by default (`--redeem-misses-per-minute`):
/// one key alone reaches it only while the running batch holds few of
/// its redemptions; else it relies on [`SLOW_BATCH`].
pub const SECOND_AT: usize = 24;
/// A batch that has run this long is slow (a journal stall, a failover):
/// a redemption that arrives then, or has waited this long, starts a
/// batch beside it, however few wait. Under the bench's full load a batch
/// takes about 5–10 ms (its size over the rate of redemptions).
pub const SLOW_BATCH: Duration = Duration::from_millis(20);
/// Most redemptions (or checks) waiting for a batch: past it a request is
/// answered 503 at once, rather than queued behind minutes of work.
pub const MAX_WAITING: usize = 16 * MAX_BATCH;
/// Longest a batch of checks waits for its query: past it, its checks are
/// answered 503 and the next batch goes on.
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(10);

/// A redemption waiting for its batch.
struct Ask {
    code: String,
    pools: Vec<(String, LookAlikeRule)>,
    tag: RedemptionTag,
    actor: Actor,
}

/// A check waiting for its batch.
struct Look {
    code: String,
    pools: Vec<(String, LookAlikeRule)>,
}

type Redeemed = Result<(Seen, bool), RedeemError>;
type Checked = Result<Seen, RedeemError>;

/// How redemptions are batched (see the constants).
const REDEMPTIONS: Shape = Shape {
    name: "redemptions",
    max_batch: MAX_BATCH,
    in_flight: IN_FLIGHT,
    max_waiting: MAX_WAITING,
    second_at: SECOND_AT,
    slow: SLOW_BATCH,
};

/// A check's batch is one read, with no journaled write to share: a
/// second starts for the first check that waits (so `slow` never matters
/// here).
const CHECKS: Shape = Shape {
    name: "checks",
    second_at: 1,
    ..REDEMPTIONS
};

/// One batch of checks: one query finds every code, and each request is
/// answered with what became of its code.
async fn check_batch(store: Store, mut batch: Vec<Pending<Look, Checked>>) {
    // A check whose client went away is not looked up.
    batch.retain(|a| !a.reply.is_closed());
    if batch.is_empty() {
        return;
    }
    let lookups: Vec<ByValue<'_>> = (batch.iter())
        .map(|p| ByValue {
            code: &p.ask.code,
            pools: &p.ask.pools,
        })
        .collect();
    let found = tokio::time::timeout(CHECK_TIMEOUT, store.find_sold_by_values(&lookups)).await;
    let found = found.unwrap_or_else(|_| {
        Err(StoreError::Unavailable(format!(
            "MongoDB did not answer the lookup within {CHECK_TIMEOUT:?}; send the check again"
        )))
    });
    match found {
        Ok(found) => {
            for (a, sold) in batch.into_iter().zip(found) {
                let seen = sold.as_ref().and_then(Seen::of);
                a.reply.send(seen.ok_or(RedeemError::Unknown));
            }
        }
        Err(e) => {
            for a in batch {
                a.reply.send(Err(RedeemError::Store(e.for_each())));
            }
        }
    }
}

/// One batch: one query finds every code, the issued ones are used in one
/// journaled write ([`ops::redeem_ids`]), and each request is answered.
/// A code already used or void is answered from the lookup, as it cannot
/// change again.
async fn redeem_batch(store: Store, batch: Vec<Pending<Ask, Redeemed>>) {
    let store = &store;
    let lookups: Vec<ByValue<'_>> = (batch.iter())
        .map(|p| ByValue {
            code: &p.ask.code,
            pools: &p.ask.pools,
        })
        .collect();
    let found = match store.find_sold_codes(&lookups).await {
        Ok(found) => found,
        Err(e) => {
            for p in batch {
                p.reply.send(Err(RedeemError::Store(e.for_each())));
            }
            return;
        }
    };
    let mut writes = Vec::new();
    let mut outcomes: Vec<Option<Outcome>> = Vec::with_capacity(batch.len());
    for (i, (p, sold)) in batch.iter().zip(&found).enumerate() {
        let a = &p.ask;
        let outcome = match sold.as_ref().filter(|(s, _)| Seen::of(s).is_some()) {
            None => Some(Err(RedeemError::Unknown)),
            Some((s, code)) if s.status == CodeStatus::Issued => {
                writes.push((i, (code, a.tag.clone(), &a.actor)));
                None
            }
            Some((s, _)) => Some(answered(s, &a.tag)),
        };
        outcomes.push(outcome);
    }
    let asks: Vec<_> = writes.iter().map(|(_, w)| w.clone()).collect();
    let done = ops::redeem_ids(store, &asks).await;
    for (k, (i, (_, tag, _))) in writes.iter().enumerate() {
        outcomes[*i] = Some(match &done {
            Ok(done) => match done.get(k) {
                Some(UsedById::Now(a)) => Ok((Some(a.at.to_chrono()), true)),
                Some(UsedById::Before(c)) => Ok((c.used_at, false)),
                Some(UsedById::Refused(c)) => {
                    Err(refused(c.status, c.used_at, c.voided_at, &c.void_reason))
                }
                Some(UsedById::Conflicting) => Err(RedeemError::ConflictingId(tag.id.clone())),
                Some(UsedById::Unavailable(e)) => {
                    Err(RedeemError::Store(StoreError::Unavailable(e.clone())))
                }
                Some(UsedById::Gone) | None => Err(RedeemError::Unknown),
            },
            Err(e) => Err(RedeemError::Store(e.for_each())),
        });
    }
    for ((a, sold), outcome) in batch.into_iter().zip(found).zip(outcomes) {
        let answer = outcome
            .unwrap_or(Err(RedeemError::Unknown))
            .and_then(|(at, now)| {
                let mut seen = (sold.as_ref())
                    .and_then(|(s, _)| Seen::of(s))
                    .ok_or(RedeemError::Unknown)?;
                seen.state = SeenState::Used { at };
                Ok((seen, now))
            });
        a.reply.send(answer);
    }
}

/// The answer for a code the lookup found used or void: it cannot change
/// again, so no write is needed.
fn answered(s: &Sold, tag: &RedemptionTag) -> Outcome {
    if s.status == CodeStatus::Used && s.redemption.as_ref() == Some(tag) {
        return Ok((s.used_at, false));
    }
    Err(refused(s.status, s.used_at, s.voided_at, &s.void_reason))
}

/// What a redemption gets: when the code was used, and whether now.
type Outcome = Result<(Option<DateTime<Utc>>, bool), RedeemError>;

/// A code that cannot be redeemed (used by another redemption, or void),
/// in the platform's terms.
fn refused(
    status: CodeStatus,
    used_at: Option<DateTime<Utc>>,
    voided_at: Option<DateTime<Utc>>,
    reason: &Option<String>,
) -> RedeemError {
    match status {
        CodeStatus::Used => RedeemError::AlreadyRedeemed { at: used_at },
        CodeStatus::Void => RedeemError::Void {
            at: voided_at,
            reason: reason.clone().unwrap_or_default(),
        },
        _ => RedeemError::Unknown,
    }
}

/// A redemption id, trimmed and compared as NFC (as a replacement id);
/// `None` when empty, too long or unreadable.
pub fn checked_id(id: &str) -> Option<String> {
    codepool_domain::text::client_id(id, MAX_REDEMPTION_ID_CHARS)
}
