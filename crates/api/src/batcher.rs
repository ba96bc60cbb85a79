//! Concurrent HTTP orders share one claim write, as AMQP deliveries do.
//!
//! Each `POST /v1/orders` hands its purchase to the batcher and waits for
//! its step. The batcher takes whatever has queued meanwhile (up to
//! [`MAX_BATCH`]) as one batch and places it through the core
//! ([`placement::place`]: one policy read, one batched, journaled claim,
//! one backorder write), the same call as the dispatcher's. Every request is answered
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

use std::sync::{Arc, Mutex, Weak};

use codepool_domain::Purchase;
use codepool_issuance::audit::Actor;
use codepool_issuance::batcher::{BatchError, Pending, Reply, Shape};
use codepool_issuance::intake::PlaceError;
use codepool_issuance::placement::{self, Batch, Ending, Patience, Seen, Unplaced};
use codepool_issuance::placing::{self, Texting};
use codepool_issuance::plan::{BatchPlan, Step};
use codepool_issuance::{Door, Resend};
use tokio::sync::{oneshot, Semaphore};
use tokio_util::sync::CancellationToken;

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
    /// The order got no answer from its batch (the queue is full, the API
    /// is stopping, or the batch ended without answering).
    #[error(transparent)]
    Batch(#[from] BatchError),
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
            Self::Batch(_) => true,
        }
    }
}

struct Ask {
    purchase: Purchase,
    /// Who asks (`api-key:NAME`, and the request id): a repeat answered
    /// with codes is audited under it.
    actor: Actor,
}

type Answer = Result<Step, Failure>;

/// The orders waiting to be decided, batched by the core's batcher.
pub(crate) struct Batcher {
    batcher: codepool_issuance::batcher::Batcher<Ask, Answer>,
    /// One permit per batch being placed or announced.
    announcing: Arc<Semaphore>,
}

impl Batcher {
    /// The order batcher of `api` (held weakly: a batch that finds the
    /// API gone answers nothing, and its requests are told to send again).
    pub(crate) fn start(api: Weak<Core>) -> Self {
        let announcing = Arc::new(Semaphore::new(ANNOUNCING));
        let slots = announcing.clone();
        let work = move |asks: Vec<Pending<Ask, Answer>>| {
            let (api, slots) = (api.clone(), slots.clone());
            async move {
                let Some(api) = api.upgrade() else { return };
                // Taken before the batch is placed, so that `settle` sees it.
                let Ok(slot) = slots.acquire_owned().await else {
                    return;
                };
                // The next batch starts once this one is answered; its
                // announcements go on beside it.
                let (answered, next) = oneshot::channel::<()>();
                let span =
                    tracing::info_span!("batch", door = Door::Http.as_str(), size = asks.len());
                let placing = place(api, asks, answered);
                tokio::spawn(tracing::Instrument::instrument(
                    async move {
                        placing.await;
                        drop(slot);
                    },
                    span,
                ));
                let _ = next.await;
            }
        };
        let mut shape = Shape::one_at_a_time("orders", MAX_BATCH);
        shape.in_flight = IN_FLIGHT;
        Self {
            batcher: codepool_issuance::batcher::Batcher::new(shape, work),
            announcing,
        }
    }

    /// Takes no more orders, and waits, for up to `limit`, until every
    /// batch placed so far has been announced: a process that stops sends
    /// the events it owes instead of leaving them to a relay 30 seconds
    /// later. Whether all were.
    pub(crate) async fn settle(&self, limit: std::time::Duration) -> bool {
        let until = tokio::time::Instant::now() + limit;
        let taken = self.batcher.stopped(limit).await;
        let all = self.announcing.acquire_many(ANNOUNCING as u32);
        taken && matches!(tokio::time::timeout_at(until, all).await, Ok(Ok(_)))
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
        let actor = Actor {
            who,
            via: format!("POST /v1/orders, a repeat (request {request})"),
        };
        self.batcher.ask(Ask { purchase, actor }).await?
    }
}

/// Places one batch through the core ([`placement::place`]); `answered`
/// goes once every request is answered.
async fn place(api: Arc<Core>, asks: Vec<Pending<Ask, Answer>>, answered: oneshot::Sender<()>) {
    let (batch, replies) = read(asks);
    let ending = Requests {
        replies: Mutex::new(Some(replies)),
        // The catalogue sweeps wait for a quiet moment.
        held: Mutex::new(Some((api.parts().activity.batch(), answered))),
    };
    let broker = api.broker();
    let stop = CancellationToken::new();
    let placed = placement::place(api.parts(), &broker.publisher, batch, &ending, &stop).await;
    if let Err(unplaced) = placed {
        ending.fail_all(match unplaced {
            Unplaced::Failed(e) => Failure::Place(e),
            Unplaced::Stopped => Failure::Batch(BatchError::Stopping { what: "orders" }),
        });
    }
}

/// The batch as this door reads it: each request's purchase and who asked
/// (a repeat answered with codes is audited under it), and where each
/// answer goes.
fn read(asks: Vec<Pending<Ask, Answer>>) -> (Batch, Vec<Reply<Answer>>) {
    let mut batch = Batch::default();
    let mut replies = Vec::with_capacity(asks.len());
    for p in asks {
        batch.parsed.push(Ok(p.ask.purchase));
        batch.actors.push(Some(p.ask.actor));
        replies.push(p.reply);
    }
    (batch, replies)
}

/// The HTTP door's ending of a batch: every request answered as soon as
/// the batch is durable, before its events are announced. No message of
/// an HTTP order is redelivered: the batch's record owes the events of
/// the orders it granted ([`Resend::ByRecord`]), and the relay of every
/// API process sends those of a record that outlives its confirms.
struct Requests {
    replies: Mutex<Option<Vec<Reply<Answer>>>>,
    /// What the batch holds until it is answered: the activity mark the
    /// sweeps wait on, and the batcher's wait for its next batch.
    held: Mutex<
        Option<(
            codepool_issuance::background::BatchUnderway,
            oneshot::Sender<()>,
        )>,
    >,
}

impl Requests {
    /// Answers every request not answered yet with `failure`.
    fn fail_all(&self, failure: Failure) {
        let replies = self
            .replies
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        for reply in replies.into_iter().flatten() {
            reply.send(Err(failure.clone()));
        }
        self.held.lock().unwrap_or_else(|e| e.into_inner()).take();
    }
}

impl Ending for Requests {
    fn door(&self) -> Door {
        Door::Http
    }

    /// The batch's record owes its events: one insert and one delete per
    /// batch, not a mark per code.
    fn resend(&self) -> Resend {
        Resend::ByRecord
    }

    /// A repeated request gets its codes in the answer, not a second SMS.
    fn texting(&self) -> Texting {
        Texting::Fresh
    }

    /// A request does not wait out an outage: it answers 503 and is sent
    /// again. A broker that does not confirm within [`ANNOUNCE_FOR`]
    /// leaves the events to the relay: it must not hold the next batches.
    fn patience(&self) -> Patience {
        Patience {
            waits_for_mongo: false,
            announce_for: Some(ANNOUNCE_FOR),
            republish_for: std::time::Duration::ZERO,
        }
    }

    fn saw(&self, seen: Seen<'_>) {
        if let Seen::Unconfirmed(n) = seen {
            tracing::warn!(
                unconfirmed = n,
                "events of answered orders not confirmed; the relay sends the SMS events again, and refusals stand"
            );
        }
    }

    /// Every request answered with its step; a repeat's codes only once its
    /// reveal was recorded.
    fn placed(&self, plan: &BatchPlan, audited: &Result<(), Arc<codepool_issuance::StoreError>>) {
        let replies = self
            .replies
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let replies = replies.unwrap_or_default();
        if plan.steps.len() != replies.len() {
            let (got, asked) = (plan.steps.len(), replies.len());
            for reply in replies {
                reply.send(Err(Failure::Miscounted { got, asked }));
            }
        } else {
            for (reply, step) in replies.into_iter().zip(&plan.steps) {
                let answer = match (audited, placing::is_repeat(step)) {
                    (Err(e), true) => Err(Failure::Unaudited(e.clone())),
                    _ => Ok(step.clone()),
                };
                reply.send(answer);
            }
        }
        self.held.lock().unwrap_or_else(|e| e.into_inner()).take();
    }
}
