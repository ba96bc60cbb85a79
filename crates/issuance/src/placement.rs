//! One call places a batch of orders, whichever door it came by.
//!
//! [`place`] reads top to bottom, as every order goes:
//!
//! 1. **decide and claim** ([`Intake::decide`](crate::intake::Intake::decide)):
//!    known pools, the shop's pools and the publisher's right, conflicts,
//!    pauses and per-user limits, then one batched, journaled claim; every
//!    fresh grant's event is owed (by redelivery, by the relay's mark, or
//!    by the batch's record) before anything is published;
//! 2. **record backorders** (and the refusals' webhooks), durably;
//! 3. **audit repeats**: a repeat that shows its codes again is recorded
//!    with who asked, before anyone sees it;
//! 4. the door's **answer** ([`Ending::placed`]): the HTTP door answers
//!    each request here; nothing is shown before this point;
//! 5. **account**: the counters, and a stock check of the pools granted
//!    from;
//! 6. **announce**: `pool.exhausted`, `purchase.refused` and `sms.pending`
//!    through the outbox, beside the door's own publishes (the AMQP door's
//!    dead letters), publishing again what the broker did not confirm, as
//!    long as the door's [`Patience`] allows;
//! 7. **settle** what the batch owed: its record of owed events goes once
//!    every event is confirmed;
//! 8. the door's **ending** ([`Ending::settle`]): the AMQP door acks or
//!    requeues each delivery.
//!
//! Every wait for MongoDB or the broker is the one retry policy of
//! [`Retry`]. A door keeps only what is its own: how it reads its orders,
//! how patient it is, how it answers, and how it ends.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use codepool_broker::Publisher;
use tokio_util::sync::CancellationToken;
use tracing::{error, warn};

use crate::audit::Actor;
use crate::background::Parts;
use crate::claim::ClaimError;
use crate::intake::PlaceError;
use crate::outage::Retry;
use crate::placing::{self, Texting};
use crate::plan::{BatchPlan, Parsed};
use crate::{Door, Resend};

/// One batch of orders from a door.
#[derive(Debug, Clone, Default)]
pub struct Batch {
    /// Each order as the door read it: a purchase, or why it is not one.
    pub parsed: Vec<Parsed>,
    /// Who asked for each order, aligned with `parsed`: a repeat that
    /// shows its codes again is audited under it. `None`: the answer shows
    /// no codes to anyone (a delivery's ack).
    pub actors: Vec<Option<Actor>>,
    /// Orders dead-lettered at their delivery limit: a grant an earlier
    /// delivery made for one is handed to the relay.
    pub at_limit: Vec<String>,
}

/// How long a door waits for what the placement needs.
#[derive(Debug, Clone, Copy)]
pub struct Patience {
    /// Waits out an outage of MongoDB (and any error but a missing key)
    /// until stopped: a delivery can wait, unacked. `false`: the first
    /// failure ends the batch (a request answers 503 and is sent again).
    pub waits_for_mongo: bool,
    /// Longest the first announcement waits for the broker's confirms;
    /// what is not confirmed by then is the relay's. `None`: no limit.
    pub announce_for: Option<Duration>,
    /// How long what the broker did not confirm is published again, while
    /// the channel stays open.
    pub republish_for: Duration,
}

/// Why a batch was not placed.
#[derive(Debug, Clone)]
pub enum Unplaced {
    /// Nothing of it was claimed, or what was is owed by the relay.
    Failed(Arc<PlaceError>),
    /// The process is stopping.
    Stopped,
}

/// What the placement saw of the servers it needs, for a door's health.
#[derive(Debug)]
pub enum Seen<'a> {
    /// MongoDB answered (and whether claims fall back from Redis).
    Mongo { redis_degraded: bool },
    /// MongoDB, or a claim, failed; the batch is tried again or ends.
    MongoFailed(&'a PlaceError),
    /// The broker did not confirm this many publishes of the batch.
    Unconfirmed(usize),
    /// The broker confirmed everything after publishing again.
    BrokerBack,
}

/// What differs between doors: how they ask, and how they end.
pub trait Ending: Send + Sync {
    /// The door, in every line and counter of the batch.
    fn door(&self) -> Door;
    /// What sends a fresh grant's event again if this process stops
    /// before the broker confirms it.
    fn resend(&self) -> Resend;
    /// Which grants of a step to text.
    fn texting(&self) -> Texting;
    /// How long the door waits.
    fn patience(&self) -> Patience;
    /// What the placement saw of MongoDB and the broker.
    fn saw(&self, _seen: Seen<'_>) {}
    /// The batch is durable: every grant journaled, every backorder
    /// recorded. `audited`: whether its repeats' reveals were recorded (a
    /// repeat's codes are shown only then).
    fn placed(&self, _plan: &BatchPlan, _audited: &Result<(), Arc<crate::StoreError>>) {}
    /// The door's own publishes for the positions in `only` (all when
    /// `None`), beside the core's events; the positions not confirmed.
    fn publish(
        &self,
        _plan: &BatchPlan,
        _publisher: &Publisher,
        _only: Option<&HashSet<usize>>,
    ) -> impl std::future::Future<Output = HashSet<usize>> + Send {
        async { HashSet::new() }
    }
    /// The door's last step, with the positions whose publishes stayed
    /// unconfirmed.
    fn settle(
        &self,
        _plan: &BatchPlan,
        _unconfirmed: &HashSet<usize>,
    ) -> impl std::future::Future<Output = ()> + Send {
        async {}
    }
}

/// Places `batch` through the core and ends it as `ending` says. The one
/// call of both doors; see the module's steps. An error: the batch was
/// not placed, nothing of it is shown, and the door ends it its way (a
/// 503, or deliveries left unacked or requeued).
pub async fn place<E: Ending>(
    parts: &Parts,
    publisher: &Publisher,
    batch: Batch,
    ending: &E,
    stop: &CancellationToken,
) -> Result<(), Unplaced> {
    let door = ending.door();
    // 1-2. Decided, claimed and backordered, durably.
    let plan = durable(parts, &batch, ending, stop).await?;
    // 3. No record, no reveal.
    let audited = audit_repeats(parts, &plan, &batch.actors).await;
    // 4. The door answers.
    ending.placed(&plan, &audited);
    // 5. Counted; pools that lost stock get a (throttled) check.
    placing::account(&plan, &parts.stock, publisher);
    // 6. Announced, published again while the door's patience lasts.
    let (texted, unconfirmed) = announce(parts, publisher, &plan, ending, stop).await;
    // 7. The batch's record of owed events goes once all were confirmed.
    if let (true, Some(owed)) = (texted, plan.owed) {
        if let Err(e) = parts.store.settle_owed(owed).await {
            tracing::debug!(error = %e, door = door.as_str(), "a batch's record of owed events stays; the relay sends them again");
        }
    }
    // 8. The door's ending.
    ending.settle(&plan, &unconfirmed).await;
    Ok(())
}

/// Steps 1 and 2: the batch's plan, claimed, with its backorders
/// recorded; tried again with [`Retry`] while the door waits.
async fn durable<E: Ending>(
    parts: &Parts,
    batch: &Batch,
    ending: &E,
    stop: &CancellationToken,
) -> Result<BatchPlan, Unplaced> {
    let at_limit: Vec<&str> = batch.at_limit.iter().map(String::as_str).collect();
    let mut retry = Retry::new();
    let mut plan = loop {
        let decided = parts
            .intake
            .decide(
                batch.parsed.clone(),
                &at_limit,
                ending.resend(),
                ending.door(),
            )
            .await;
        match decided {
            Ok(plan) => {
                ending.saw(Seen::Mongo {
                    redis_degraded: parts.intake.engine().is_degraded(),
                });
                break plan;
            }
            Err(e) => give_up_or_wait(ending, PlaceError::Claim(e), &mut retry, stop).await?,
        }
    };
    let mut retry = Retry::new();
    loop {
        match parts.intake.record_backorders(&mut plan).await {
            Ok(_) => return Ok(plan),
            Err(e) => give_up_or_wait(ending, PlaceError::Backorders(e), &mut retry, stop).await?,
        }
    }
}

/// After a failure of step 1 or 2: waits the retry's delay when the door
/// waits out the failure, or gives the batch up.
async fn give_up_or_wait<E: Ending>(
    ending: &E,
    e: PlaceError,
    retry: &mut Retry,
    stop: &CancellationToken,
) -> Result<(), Unplaced> {
    // A missing key is this process's, not MongoDB's: nothing was
    // claimed, the key watch has said so once, and the batch goes back.
    if matches!(&e, PlaceError::Claim(ClaimError::KeysMissing(_))) {
        return Err(Unplaced::Failed(Arc::new(e)));
    }
    ending.saw(Seen::MongoFailed(&e));
    if !ending.patience().waits_for_mongo {
        return Err(Unplaced::Failed(Arc::new(e)));
    }
    if !e.is_retryable() {
        error!(error = ?e, door = ending.door().as_str(), "placing a batch failed; it is tried again");
    }
    tokio::select! {
        _ = stop.cancelled() => Err(Unplaced::Stopped),
        _ = tokio::time::sleep(retry.delay()) => Ok(()),
    }
}

/// Step 3: the repeats among the plan's steps that show codes again,
/// recorded with who asked, in one durable write.
async fn audit_repeats(
    parts: &Parts,
    plan: &BatchPlan,
    actors: &[Option<Actor>],
) -> Result<(), Arc<crate::StoreError>> {
    let (steps, actors): (Vec<_>, Vec<_>) = (plan.steps.iter().zip(actors))
        .filter_map(|(s, a)| Some((s.clone(), a.clone()?)))
        .unzip();
    if steps.is_empty() {
        return Ok(());
    }
    placing::audit_repeats(&parts.store, &steps, &actors)
        .await
        .map_err(Arc::new)
}

/// Step 6: the core's announcements and the door's publishes, for the
/// positions in `only`, confirms in flight together; then again, with
/// [`Retry`], what the broker did not confirm, while the door's patience
/// lasts. Whether every `sms.pending` of the first round was confirmed,
/// and the positions still unconfirmed.
async fn announce<E: Ending>(
    parts: &Parts,
    publisher: &Publisher,
    plan: &BatchPlan,
    ending: &E,
    stop: &CancellationToken,
) -> (bool, HashSet<usize>) {
    let patience = ending.patience();
    let round = |only: Option<HashSet<usize>>| async move {
        let (announced, own) = tokio::join!(
            placing::announce(
                plan,
                &parts.outbox,
                publisher,
                ending.texting(),
                only.as_ref(),
                &parts.store,
                (ending.door(), ending.resend()),
            ),
            ending.publish(plan, publisher, only.as_ref()),
        );
        let mut unconfirmed = announced.unconfirmed;
        unconfirmed.extend(own);
        (announced.texted, unconfirmed)
    };
    let first = match patience.announce_for {
        Some(limit) => match tokio::time::timeout(limit, round(None)).await {
            Ok(done) => done,
            // A broker that blocks publishes (a memory alarm) must not
            // hold the next batches: what is not confirmed is the relay's.
            Err(_) => {
                warn!(door = ending.door().as_str(), "the broker did not confirm a batch's events within {limit:?}; the relay sends them");
                return (false, HashSet::new());
            }
        },
        None => round(None).await,
    };
    let (texted, mut unconfirmed) = first;
    let started = Instant::now();
    let mut retry = Retry::new();
    while !unconfirmed.is_empty() {
        ending.saw(Seen::Unconfirmed(unconfirmed.len()));
        if started.elapsed() >= patience.republish_for || !publisher.channel().status().connected()
        {
            break;
        }
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep(retry.delay()) => {}
        }
        unconfirmed = round(Some(unconfirmed)).await.1;
    }
    if retry.tries() > 0 && unconfirmed.is_empty() {
        ending.saw(Seen::BrokerBack);
    }
    (texted, unconfirmed)
}
