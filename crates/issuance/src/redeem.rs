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
use tokio::sync::{oneshot, Mutex};

use crate::audit::Actor;
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
    /// The redemptions waiting for a batch.
    queue: Arc<Queue<Ask>>,
    /// The checks waiting for a batch.
    checks: Arc<Queue<Look>>,
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
            store,
            clock,
            cached: Mutex::new(None),
            queue: Arc::new(Queue::new(SECOND_AT, SLOW_BATCH)),
            // A check's batch is one read, with no journaled write to share:
            // a second starts for the first check that waits (so `slow`
            // never matters here).
            checks: Arc::new(Queue::new(1, SLOW_BATCH)),
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
        let (reply, answer) = oneshot::channel();
        let ask = Look {
            code: code.to_owned(),
            pools,
            reply,
        };
        let batches = (&self.store, &self.checks, check_batch);
        queued(batches, ask, answer, "checks", "send it again").await
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
        let (reply, answer) = oneshot::channel();
        let ask = Ask {
            code: code.to_owned(),
            pools,
            tag: RedemptionTag {
                id,
                by: who.owner.to_owned(),
            },
            actor: actor.clone(),
            reply,
        };
        let batches = (&self.store, &self.queue, redeem_batch);
        let again = "send it again with the same redemption id";
        queued(batches, ask, answer, "redemptions", again).await
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

/// The queue is full.
struct Full;

/// What a queued ask's caller does next.
#[derive(Debug, PartialEq)]
enum Pushed {
    /// Start a task (counted already).
    Start,
    /// Wait; one task runs, and if the ask waits `slow` behind it, try
    /// [`Queue::kick`].
    MayKick,
    /// Wait; every task that may run does, and one takes the ask.
    Behind,
}

/// Queues `ask` on `queue`, starts a task that runs its batches with
/// `run` when the queue asks for one ([`Queue::push`]), and waits for
/// `answer`: 503 when the queue is full or the batch ended without
/// answering (`again` says what to send then). An ask still waiting once
/// the queue's `slow` has passed starts a task beside a batch that has
/// run that long ([`Queue::kick`]): no new request needs to come for it.
async fn queued<C, A, T, F, Fut>(
    (ctx, queue, run): (&C, &Arc<Queue<A>>, F),
    ask: A,
    answer: oneshot::Receiver<Result<T, RedeemError>>,
    what: &str,
    again: &str,
) -> Result<T, RedeemError>
where
    C: Clone + Send + 'static,
    A: Send + 'static,
    F: Fn(C, Vec<A>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let mut answer = answer;
    match queue.push(ask).map_err(|Full| busy(what))? {
        Pushed::Start => start(ctx.clone(), queue, run),
        Pushed::MayKick => {
            if let Ok(a) = tokio::time::timeout(queue.slow, &mut answer).await {
                return a.unwrap_or_else(|_| Err(stopped(what, again)));
            }
            if queue.kick() {
                start(ctx.clone(), queue, run);
            }
        }
        // Every task runs: one of them takes this ask.
        Pushed::Behind => {}
    }
    answer.await.unwrap_or_else(|_| Err(stopped(what, again)))
}

/// Starts a task counted as taking `queue` (its count raised already).
fn start<C, A, F, Fut>(ctx: C, queue: &Arc<Queue<A>>, run: F)
where
    C: Clone + Send + 'static,
    A: Send + 'static,
    F: Fn(C, Vec<A>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    tokio::spawn(drain(ctx, Taking::of(queue), run));
}

/// 503 for a request whose batch ended without answering it.
fn stopped(what: &str, again: &str) -> RedeemError {
    RedeemError::Store(StoreError::Unavailable(format!(
        "the batch of {what} stopped before it answered; {again}"
    )))
}

/// 503 for a request that found [`MAX_WAITING`] others waiting.
fn busy(what: &str) -> RedeemError {
    RedeemError::Store(StoreError::Unavailable(format!(
        "{MAX_WAITING} {what} are waiting for the database; send the request again in a few seconds"
    )))
}

/// A redemption waiting for its batch.
struct Ask {
    code: String,
    pools: Vec<(String, LookAlikeRule)>,
    tag: RedemptionTag,
    actor: Actor,
    reply: oneshot::Sender<Result<(Seen, bool), RedeemError>>,
}

/// A check waiting for its batch.
struct Look {
    code: String,
    pools: Vec<(String, LookAlikeRule)>,
    reply: oneshot::Sender<Result<Seen, RedeemError>>,
}

/// The requests waiting for a batch, how many tasks are taking them,
/// and when the last batch was taken.
struct Queue<A> {
    waiting: std::sync::Mutex<Waiting<A>>,
    /// Requests waiting that start a batch beside one that runs.
    second_at: usize,
    /// How long after the last batch was taken a request (arriving, or
    /// waiting) starts a batch beside it, however few wait.
    slow: Duration,
}

struct Waiting<A> {
    asks: Vec<A>,
    tasks: usize,
    taken_at: Instant,
}

impl<A> Queue<A> {
    fn new(second_at: usize, slow: Duration) -> Self {
        Queue {
            waiting: std::sync::Mutex::new(Waiting {
                asks: Vec::new(),
                tasks: 0,
                taken_at: Instant::now(),
            }),
            second_at,
            slow,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Waiting<A>> {
        self.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `ask`: [`Pushed::Start`] when the caller must start a task
    /// to take it (none is taking the queue, or fewer than [`IN_FLIGHT`]
    /// are and `second_at` wait or the last batch was taken `slow` ago);
    /// [`Full`] when [`MAX_WAITING`] are waiting already.
    fn push(&self, ask: A) -> Result<Pushed, Full> {
        let mut q = self.lock();
        if q.asks.len() >= MAX_WAITING {
            return Err(Full);
        }
        q.asks.push(ask);
        if q.tasks == 0 {
            // The first batch after a quiet spell starts now.
            q.taken_at = Instant::now();
        }
        let beside = q.asks.len() >= self.second_at || q.taken_at.elapsed() >= self.slow;
        let more = q.tasks == 0 || (q.tasks < IN_FLIGHT && beside);
        q.tasks += usize::from(more);
        Ok(match more {
            true => Pushed::Start,
            false if q.tasks < IN_FLIGHT => Pushed::MayKick,
            false => Pushed::Behind,
        })
    }

    /// `true` (counted) when the caller must start a task beside the
    /// running batch: asks wait, fewer than [`IN_FLIGHT`] take the queue,
    /// and the last batch was taken `slow` ago or more.
    fn kick(&self) -> bool {
        let mut q = self.lock();
        let more = !q.asks.is_empty() && q.tasks < IN_FLIGHT && q.taken_at.elapsed() >= self.slow;
        q.tasks += usize::from(more);
        more
    }

    /// Up to [`MAX_BATCH`] of the queue; `None` when it is empty, and the
    /// caller's task ends.
    fn take(&self) -> Option<Vec<A>> {
        let mut q = self.lock();
        if q.asks.is_empty() {
            debug_assert!(q.tasks > 0, "only a counted task takes the queue");
            q.tasks = q.tasks.saturating_sub(1);
            return None;
        }
        q.taken_at = Instant::now();
        let n = q.asks.len().min(MAX_BATCH);
        Some(q.asks.drain(..n).collect())
    }
}

/// A task counted as taking a queue. Dropped before it found the queue
/// empty (stopped mid-batch, or before it first ran, as its runtime shuts
/// down), it takes itself off the count, so the next request starts
/// another.
struct Taking<A> {
    queue: Arc<Queue<A>>,
    ended: bool,
}

impl<A> Taking<A> {
    fn of(queue: &Arc<Queue<A>>) -> Self {
        Taking {
            queue: queue.clone(),
            ended: false,
        }
    }
}

impl<A> Drop for Taking<A> {
    fn drop(&mut self) {
        // A task that found the queue empty has said so, under the lock.
        if !self.ended {
            let mut q = self.queue.lock();
            q.tasks = q.tasks.saturating_sub(1);
        }
    }
}

/// Makes batches of the queue with `run`, one after another, until it is
/// empty. A batch that panics answers its own requests "send it again"
/// (their replies are dropped) and the task goes on with the next.
async fn drain<C: Clone, A, F, Fut>(ctx: C, mut taking: Taking<A>, run: F)
where
    F: Fn(C, Vec<A>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    use futures::FutureExt;
    while let Some(batch) = taking.queue.take() {
        let run = std::panic::AssertUnwindSafe(run(ctx.clone(), batch));
        if run.catch_unwind().await.is_err() {
            tracing::error!("a batch of redemptions or checks panicked; its requests were answered 503, and the next batch goes on");
        }
    }
    taking.ended = true;
}

/// One batch of checks: one query finds every code, and each request is
/// answered with what became of its code.
async fn check_batch(store: Store, mut batch: Vec<Look>) {
    // A check whose client went away is not looked up.
    batch.retain(|a| !a.reply.is_closed());
    if batch.is_empty() {
        return;
    }
    let lookups: Vec<ByValue<'_>> = (batch.iter())
        .map(|a| ByValue {
            code: &a.code,
            pools: &a.pools,
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
                let _ = a.reply.send(seen.ok_or(RedeemError::Unknown));
            }
        }
        Err(e) => {
            for a in batch {
                let _ = a.reply.send(Err(RedeemError::Store(e.for_each())));
            }
        }
    }
}

/// One batch: one query finds every code, the issued ones are used in one
/// journaled write ([`ops::redeem_ids`]), and each request is answered.
/// A code already used or void is answered from the lookup, as it cannot
/// change again.
async fn redeem_batch(store: Store, batch: Vec<Ask>) {
    let store = &store;
    let lookups: Vec<ByValue<'_>> = (batch.iter())
        .map(|a| ByValue {
            code: &a.code,
            pools: &a.pools,
        })
        .collect();
    let found = match store.find_sold_codes(&lookups).await {
        Ok(found) => found,
        Err(e) => {
            for a in batch {
                let _ = a.reply.send(Err(RedeemError::Store(e.for_each())));
            }
            return;
        }
    };
    let mut writes = Vec::new();
    let mut outcomes: Vec<Option<Outcome>> = Vec::with_capacity(batch.len());
    for (i, (a, sold)) in batch.iter().zip(&found).enumerate() {
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
        let _ = a.reply.send(answer);
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

#[cfg(test)]
mod tests {
    use super::*;

    type Asked = (u32, oneshot::Sender<u32>);

    /// Answers each ask with its number doubled; a batch with number 0
    /// waits for the gate to open, then panics.
    async fn doubled(mut gate: tokio::sync::watch::Receiver<bool>, batch: Vec<Asked>) {
        if batch.iter().any(|(n, _)| *n == 0) {
            let _ = gate.wait_for(|open| *open).await;
            panic!("a batch that panics");
        }
        for (n, reply) in batch {
            let _ = reply.send(n * 2);
        }
    }

    type Gate = tokio::sync::watch::Receiver<bool>;

    fn ask(queue: &Arc<Queue<Asked>>, gate: &Gate, n: u32) -> oneshot::Receiver<u32> {
        let (tx, rx) = oneshot::channel();
        if queue.push((n, tx)).ok().expect("room in the queue") == Pushed::Start {
            start(gate.clone(), queue, doubled);
        }
        rx
    }

    /// Both tasks take a batch that panics while more asks wait behind
    /// them, and no request comes after: the waiting asks are answered all
    /// the same.
    #[tokio::test]
    async fn a_panicking_batch_fails_its_own_asks_and_the_queue_goes_on() {
        let queue: Arc<Queue<Asked>> = Arc::new(Queue::new(SECOND_AT, SLOW_BATCH));
        let (open, gate) = tokio::sync::watch::channel(false);
        // Two tasks each take a batch that panics: the first its one ask,
        // the second (started once SECOND_AT wait) all of those.
        let mut failing = vec![ask(&queue, &gate, 0)];
        tokio::task::yield_now().await;
        failing.extend((0..SECOND_AT).map(|_| ask(&queue, &gate, 0)));
        tokio::task::yield_now().await;
        assert_eq!(queue.lock().tasks, IN_FLIGHT);
        assert!(
            queue.lock().asks.is_empty(),
            "both tasks took their batches"
        );
        let waiting: Vec<_> = (1..=5).map(|n| ask(&queue, &gate, n)).collect();
        open.send_replace(true);
        for rx in failing {
            assert!(
                rx.await.is_err(),
                "a panicking batch's ask is told it stopped"
            );
        }
        for (n, rx) in (1..=5).zip(waiting) {
            let answer = tokio::time::timeout(Duration::from_secs(5), rx).await;
            assert_eq!(answer.expect("answered, not stranded").unwrap(), 2 * n);
        }
        for _ in 0..4 {
            tokio::task::yield_now().await;
        }
        let q = queue.lock();
        assert!(q.asks.is_empty());
        assert_eq!(q.tasks, 0, "every task ended and said so");
    }

    /// One task takes the queue while fewer than SECOND_AT wait behind
    /// its batch; the request that makes SECOND_AT starts the second.
    #[tokio::test]
    async fn a_second_batch_starts_only_once_enough_wait() {
        // No batch is slow here, however long the test is kept waiting.
        let never = Duration::from_secs(3600);
        let queue: Arc<Queue<Asked>> = Arc::new(Queue::new(SECOND_AT, never));
        let (open, gate) = tokio::sync::watch::channel(false);
        // Waits inside its batch until the gate opens, then panics.
        let first = ask(&queue, &gate, 0);
        tokio::task::yield_now().await;
        assert_eq!(queue.lock().tasks, 1);
        let mut waiting: Vec<_> = (1..SECOND_AT as u32)
            .map(|n| ask(&queue, &gate, n))
            .collect();
        assert_eq!(queue.lock().tasks, 1, "too few wait for a second batch");
        tokio::task::yield_now().await;
        assert_eq!(queue.lock().tasks, 1, "too few wait for a second batch");
        assert_eq!(queue.lock().asks.len(), SECOND_AT - 1);
        waiting.push(ask(&queue, &gate, SECOND_AT as u32));
        // Counted at once; the new task has not run yet.
        assert_eq!(
            queue.lock().tasks,
            2,
            "SECOND_AT waiting start a second batch"
        );
        answered_beside((1..).zip(waiting), open, first).await;
    }

    /// A batch running its queue's `slow` or longer gets one beside it
    /// for the next ask, however few wait.
    #[tokio::test]
    async fn a_slow_batch_gets_a_second_beside_it() {
        // Slow enough that a busy test machine does not make it slow early.
        let slow = Duration::from_millis(300);
        let queue: Arc<Queue<Asked>> = Arc::new(Queue::new(SECOND_AT, slow));
        let (open, gate) = tokio::sync::watch::channel(false);
        let first = ask(&queue, &gate, 0);
        tokio::task::yield_now().await;
        let early = ask(&queue, &gate, 1);
        assert_eq!(queue.lock().tasks, 1, "a young batch is waited for");
        tokio::time::sleep(slow).await;
        let late = ask(&queue, &gate, 2);
        assert_eq!(queue.lock().tasks, 2, "a slow batch gets one beside it");
        answered_beside([(1, early), (2, late)], open, first).await;
    }

    /// Each of `asks` is answered (its number doubled) by a second batch
    /// while the first waits at the gate; then the gate opens, and the
    /// first batch ends with its ask unanswered.
    async fn answered_beside(
        asks: impl IntoIterator<Item = (u32, oneshot::Receiver<u32>)>,
        open: tokio::sync::watch::Sender<bool>,
        first: oneshot::Receiver<u32>,
    ) {
        for (n, rx) in asks {
            let answer = tokio::time::timeout(Duration::from_secs(5), rx).await;
            let answer = answer.expect("answered beside the waiting batch");
            assert_eq!(answer.unwrap(), 2 * n);
        }
        open.send_replace(true);
        assert!(first.await.is_err());
    }

    /// An ask that has waited the queue's `slow` behind a batch that has
    /// run as long starts a batch beside it, though no request comes after.
    #[tokio::test]
    async fn an_ask_that_waits_behind_a_slow_batch_starts_one_beside_it() {
        type Told = (u32, oneshot::Sender<Result<u32, RedeemError>>);
        /// Doubles each number; a batch with 0 waits for the gate.
        async fn told(mut gate: Gate, batch: Vec<Told>) {
            if batch.iter().any(|(n, _)| *n == 0) {
                let _ = gate.wait_for(|open| *open).await;
                return;
            }
            for (n, reply) in batch {
                let _ = reply.send(Ok(n * 2));
            }
        }
        let slow = Duration::from_millis(300);
        let queue: Arc<Queue<Told>> = Arc::new(Queue::new(SECOND_AT, slow));
        let (open, gate) = tokio::sync::watch::channel(false);
        let send = |n: u32| {
            let (queue, gate) = (queue.clone(), gate.clone());
            tokio::spawn(async move {
                let (tx, rx) = oneshot::channel();
                queued((&gate, &queue, told), (n, tx), rx, "asks", "again").await
            })
        };
        let first = send(0);
        tokio::task::yield_now().await;
        assert_eq!(queue.lock().tasks, 1, "the first batch waits for the gate");
        let waiting = send(1);
        let answer = tokio::time::timeout(Duration::from_secs(3), waiting).await;
        let answer = answer.expect("answered while the slow batch still runs");
        assert_eq!(answer.unwrap().unwrap(), 2);
        open.send_replace(true);
        assert!(first.await.unwrap().is_err(), "its batch ended unanswered");
    }

    /// A task dropped before it first ran (its runtime shutting down)
    /// takes itself off the count: the next ask starts another.
    #[tokio::test]
    async fn a_task_that_never_ran_is_not_counted() {
        let queue: Arc<Queue<Asked>> = Arc::new(Queue::new(SECOND_AT, SLOW_BATCH));
        let (_open, gate) = tokio::sync::watch::channel(true);
        let (tx, rx) = oneshot::channel();
        let pushed = queue.push((1, tx)).ok().expect("room");
        assert_eq!(pushed, Pushed::Start, "a first ask starts a task");
        drop(drain(gate.clone(), Taking::of(&queue), doubled));
        assert_eq!(queue.lock().tasks, 0);
        let next = ask(&queue, &gate, 2);
        assert_eq!(
            rx.await.unwrap(),
            2,
            "the waiting ask is taken by the next task"
        );
        assert_eq!(next.await.unwrap(), 4);
    }

    /// Checks start a second task for the first that waits, and then no
    /// caller waits on a timer for a kick; a redemption behind one task
    /// may kick, behind two it may not.
    #[test]
    fn each_push_tells_its_caller_what_to_do() {
        let never = Duration::from_secs(3600);
        let checks: Queue<u32> = Queue::new(1, never);
        let pushed: Vec<_> = (0..3).map(|n| checks.push(n).ok().unwrap()).collect();
        assert_eq!(pushed, [Pushed::Start, Pushed::Start, Pushed::Behind]);
        let redemptions: Queue<u32> = Queue::new(SECOND_AT, never);
        let pushed: Vec<_> = (0..SECOND_AT as u32 + 1)
            .map(|n| redemptions.push(n).ok().unwrap())
            .collect();
        assert_eq!(pushed[0], Pushed::Start);
        assert!(pushed[1..SECOND_AT - 1]
            .iter()
            .all(|p| *p == Pushed::MayKick));
        assert_eq!(pushed[SECOND_AT - 1], Pushed::Start, "the SECOND_AT-th");
        assert_eq!(pushed[SECOND_AT], Pushed::Behind);
    }

    #[tokio::test]
    async fn a_full_queue_refuses_at_once() {
        let queue: Arc<Queue<Asked>> = Arc::new(Queue::new(SECOND_AT, SLOW_BATCH));
        // Nobody takes this queue: every push is kept.
        let mut kept = Vec::new();
        for n in 0..MAX_WAITING {
            let (tx, rx) = oneshot::channel();
            assert!(queue.push((n as u32, tx)).is_ok());
            kept.push(rx);
        }
        let (tx, _rx) = oneshot::channel();
        assert!(
            queue.push((0, tx)).is_err(),
            "one past MAX_WAITING is refused"
        );
        assert_eq!(queue.lock().asks.len(), MAX_WAITING);
    }
}
