//! Concurrent HTTP orders share one claim write, as AMQP deliveries do.
//!
//! Each `POST /v1/orders` hands its purchase to the batcher and waits for
//! its step. The batcher takes whatever has queued meanwhile (up to
//! [`MAX_BATCH`]) as one batch and places it through the core
//! ([`Intake::place`]: one policy read, one batched, journaled claim, one
//! backorder write), the same as the dispatcher. Every request is answered
//! as soon as that durable half is done. What the batch owes then
//! (`sms.pending`, `purchase.refused`, `pool.exhausted`) is announced
//! after the answers, by a task of its own ([`codepool_issuance::placing`]):
//! before it grants anything, the batch records the orders it may grant as
//! owing their events (`Resend::ByRecord`, one document for the batch; see
//! `Intake::decide`), and the record goes once every fresh grant's event
//! is confirmed. The relay of every API process sends the events of a
//! record that outlives its confirms, exactly as for a process that died
//! between its claim and its confirm.
//! Nothing is lost, and the stable `event_id` makes a second send harmless.
//!
//! At most [`IN_FLIGHT`] batches are placed at once; while they are, new
//! requests queue for the next. One at a time is the fastest setting
//! measured (`codepool-bench api`, docs/benchmarks.md): the clients
//! answered by one batch are back by the time the next starts, so it takes
//! them all. At most [`ANNOUNCING`] batches' announcements wait for the
//! broker at once; a broker slower than that holds the next batch back.

use std::sync::{Arc, Weak};

use codepool_domain::Purchase;
use codepool_issuance::audit::Actor;
use codepool_issuance::intake::PlaceError;
use codepool_issuance::placing::{self, Texting};
use codepool_issuance::plan::{BatchPlan, Step};
use codepool_issuance::{Door, Intake, Resend};
use tokio::sync::{mpsc, oneshot, Semaphore};

use codepool_issuance::Core;

/// Most orders decided together.
pub const MAX_BATCH: usize = 256;
/// Most batches placed at once.
pub const IN_FLIGHT: usize = 1;
/// Most placed batches whose announcements wait for the broker at once.
pub const ANNOUNCING: usize = 8;
/// Longest a batch's announcements wait for the broker's confirms.
const ANNOUNCE_FOR: std::time::Duration = std::time::Duration::from_secs(20);

/// Why a batch could not be decided: every request in it gets this (one
/// error, shared).
#[derive(Debug, Clone, thiserror::Error)]
pub(crate) enum Failure {
    /// Nothing of the batch was claimed, or what was is owed by the relay.
    #[error(transparent)]
    Place(Arc<PlaceError>),
    /// A repeat's codes are shown only once its reveal is recorded.
    #[error("the repeat was not audited, so its codes are not shown: {0}")]
    Unaudited(Arc<codepool_issuance::StoreError>),
    #[error("the core decided {got} steps for {asked} orders")]
    Miscounted { got: usize, asked: usize },
    #[error("the API is stopping")]
    Stopping,
}

impl Failure {
    /// MongoDB (or the broker) is away, this process misses a key, or it
    /// is stopping: 503, and the same request succeeds later (here or on
    /// another API process).
    pub(crate) fn is_unavailable(&self) -> bool {
        match self {
            Self::Place(e) => e.is_retryable(),
            Self::Unaudited(e) => e.is_unavailable(),
            Self::Miscounted { .. } => false,
            Self::Stopping => true,
        }
    }
}

struct Ask {
    purchase: Purchase,
    /// Who asks (`api-key:NAME`, and the request id): a repeat answered
    /// with codes is audited under it.
    actor: Actor,
    reply: oneshot::Sender<Result<Step, Failure>>,
}

/// The queue of orders waiting to be decided.
pub(crate) struct Batcher {
    tx: mpsc::Sender<Ask>,
    /// One permit per batch being placed or announced.
    announcing: Arc<Semaphore>,
}

impl Batcher {
    /// Starts the batching task for `api` (held weakly: the task ends with
    /// the API).
    pub(crate) fn start(api: Weak<Core>) -> Self {
        let (tx, rx) = mpsc::channel(MAX_BATCH * IN_FLIGHT * 4);
        let announcing = Arc::new(Semaphore::new(ANNOUNCING));
        tokio::spawn(run(api, rx, announcing.clone()));
        Self { tx, announcing }
    }

    /// Waits, for up to `limit`, until every batch placed so far has been
    /// announced: a process that stops sends the events it owes instead of
    /// leaving them to a relay 30 seconds later. Whether all were.
    pub(crate) async fn settle(&self, limit: std::time::Duration) -> bool {
        let all = self.announcing.acquire_many(ANNOUNCING as u32);
        matches!(tokio::time::timeout(limit, all).await, Ok(Ok(_)))
    }

    /// Decides one purchase in the next batch: its step, once the batch's
    /// grants are durable and their events published (or left to the
    /// relay when the broker did not confirm).
    pub(crate) async fn decide(
        &self,
        purchase: Purchase,
        who: String,
        request: String,
    ) -> Result<Step, Failure> {
        let (reply, answer) = oneshot::channel();
        self.tx
            .send(Ask {
                purchase,
                actor: Actor {
                    who,
                    via: format!("POST /v1/orders, a repeat (request {request})"),
                },
                reply,
            })
            .await
            .map_err(|_| Failure::Stopping)?;
        answer.await.map_err(|_| Failure::Stopping)?
    }
}

async fn run(api: Weak<Core>, mut rx: mpsc::Receiver<Ask>, announcing: Arc<Semaphore>) {
    let permits = Arc::new(Semaphore::new(IN_FLIGHT));
    while let Some(first) = rx.recv().await {
        let Ok(permit) = permits.clone().acquire_owned().await else {
            break;
        };
        // Taken before the batch is placed, so that `settle` sees it.
        let Ok(slot) = announcing.clone().acquire_owned().await else {
            break;
        };
        // Everything that queued while the batches in flight ran.
        let mut asks = vec![first];
        while asks.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(ask) => asks.push(ask),
                Err(_) => break,
            }
        }
        let Some(api) = api.upgrade() else { break };
        // The batch's lines (grants, refusals, publishes) carry the door,
        // as the AMQP door's do; each request's own lines carry its order.
        let span = tracing::info_span!("batch", door = Door::Http.as_str(), size = asks.len());
        let work = async move {
            // The catalogue sweeps wait for a quiet moment.
            let underway = api.parts().activity.batch();
            let plan = answer_batch(&api, asks).await;
            drop(underway);
            drop(permit);
            if let Some(plan) = plan {
                announce(&api, &plan).await;
            }
            drop(slot);
        };
        tokio::spawn(tracing::Instrument::instrument(work, span));
    }
}

/// Places one batch and answers every request in it. The placed plan,
/// whose announcements are still owed (`plan.owed` names the record that
/// owes its events).
async fn answer_batch(api: &Core, asks: Vec<Ask>) -> Option<BatchPlan> {
    metrics::histogram!("codepool_api_batch_size").record(asks.len() as f64);
    let (rest, replies): (Vec<_>, Vec<_>) = (asks.into_iter())
        .map(|a| ((a.purchase, a.actor), a.reply))
        .unzip();
    let (purchases, actors): (Vec<_>, Vec<_>) = rest.into_iter().unzip();
    match place(api.intake(), purchases).await {
        Ok(plan) => {
            // No record, no reveal: the repeats' audit records, one write
            // for the batch, before any answer.
            let audited = placing::audit_repeats(api.store(), &plan.steps, &actors)
                .await
                .map_err(|e| Failure::Unaudited(Arc::new(e)));
            placing::account(&plan, api.stock(), &api.broker().publisher);
            for (reply, step) in replies.into_iter().zip(&plan.steps) {
                let answer = match (&audited, placing::is_repeat(step)) {
                    (Err(e), true) => Err(e.clone()),
                    _ => Ok(step.clone()),
                };
                let _ = reply.send(answer);
            }
            Some(plan)
        }
        Err(e) => {
            for reply in replies {
                let _ = reply.send(Err(e.clone()));
            }
            None
        }
    }
}

/// Publishes what a placed batch owes; once every grant's event is
/// confirmed, the batch's record (`plan.owed`) leaves the relay's list. A
/// record left (an event not confirmed, this process stopped, MongoDB
/// away) only means the relay sends the batch's events again, with the
/// same `event_id`s.
async fn announce(api: &Core, plan: &BatchPlan) {
    let broker = api.broker();
    let announcing = placing::announce(
        plan,
        api.outbox(),
        &broker.publisher,
        Texting::Fresh,
        None,
        api.store(),
        Door::Http,
    );
    // A broker that blocks publishes (a memory alarm) must not hold the
    // next batches: what is not confirmed by then is the relay's.
    let Ok(announced) = tokio::time::timeout(ANNOUNCE_FOR, announcing).await else {
        tracing::warn!(
            "the broker did not confirm a batch's events within {ANNOUNCE_FOR:?}; the relay sends them"
        );
        return;
    };
    if !announced.unconfirmed.is_empty() {
        tracing::warn!(
            unconfirmed = announced.unconfirmed.len(),
            "events of answered orders not confirmed; the relay sends the SMS events again, and refusals stand"
        );
    }
    if let (true, Some(owed)) = (announced.texted, plan.owed) {
        if let Err(e) = api.store().settle_owed(owed).await {
            tracing::debug!(error = %e, "a batch's record of owed events stays; the relay sends them again");
        }
    }
}

/// The durable half of one batch through the core: the orders it may grant
/// recorded as owing their events, then claimed, with its backorders
/// recorded. No
/// message of an HTTP order is redelivered: the relay owes the events of
/// a batch no one saw confirmed.
async fn place(intake: &Intake, purchases: Vec<Purchase>) -> Result<BatchPlan, Failure> {
    let asked = purchases.len();
    let parsed = purchases.into_iter().map(Ok).collect();
    // A key missing from this process's key file: nothing was claimed,
    // and another API process (or this one, once its key file is
    // complete) takes the same request.
    let plan = (intake
        .place(parsed, &[], Resend::ByRecord, Door::Http)
        .await)
        .map_err(|e| Failure::Place(Arc::new(e)))?;
    if plan.steps.len() != asked {
        let got = plan.steps.len();
        return Err(Failure::Miscounted { got, asked });
    }
    Ok(plan)
}
