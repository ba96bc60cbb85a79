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
use codepool_issuance::intake::PlaceError;
use codepool_issuance::placement::{self, Batch, Ending, Patience, Seen, Unplaced};
use codepool_issuance::placing::{self, Texting};
use codepool_issuance::plan::{BatchPlan, Step};
use codepool_issuance::{Door, Resend};
use tokio::sync::{mpsc, oneshot, OwnedSemaphorePermit, Semaphore};
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
            metrics::histogram!("codepool_api_batch_size").record(asks.len() as f64);
            let (batch, replies) = read(asks);
            let ending = Requests {
                replies: Mutex::new(Some(replies)),
                // The catalogue sweeps wait for a quiet moment; the next
                // batch starts once this one is answered.
                held: Mutex::new(Some((api.parts().activity.batch(), permit))),
            };
            let broker = api.broker();
            let stop = CancellationToken::new();
            let placed =
                placement::place(api.parts(), &broker.publisher, batch, &ending, &stop).await;
            if let Err(unplaced) = placed {
                ending.fail_all(match unplaced {
                    Unplaced::Failed(e) => Failure::Place(e),
                    Unplaced::Stopped => Failure::Stopping,
                });
            }
            drop(slot);
        };
        tokio::spawn(tracing::Instrument::instrument(work, span));
    }
}

/// The batch as this door reads it: each request's purchase and who asked
/// (a repeat answered with codes is audited under it), and where each
/// answer goes.
fn read(asks: Vec<Ask>) -> (Batch, Vec<Reply>) {
    let mut batch = Batch::default();
    let mut replies = Vec::with_capacity(asks.len());
    for a in asks {
        batch.parsed.push(Ok(a.purchase));
        batch.actors.push(Some(a.actor));
        replies.push(a.reply);
    }
    (batch, replies)
}

type Reply = oneshot::Sender<Result<Step, Failure>>;

/// The HTTP door's ending of a batch: every request answered as soon as
/// the batch is durable, before its events are announced. No message of
/// an HTTP order is redelivered: the batch's record owes the events of
/// the orders it granted ([`Resend::ByRecord`]), and the relay of every
/// API process sends those of a record that outlives its confirms.
struct Requests {
    replies: Mutex<Option<Vec<Reply>>>,
    /// What the batch holds until it is answered: the activity mark the
    /// sweeps wait on, and the permit of the batches placed at once.
    held: Mutex<
        Option<(
            codepool_issuance::background::BatchUnderway,
            OwnedSemaphorePermit,
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
            let _ = reply.send(Err(failure.clone()));
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
                let _ = reply.send(Err(Failure::Miscounted { got, asked }));
            }
        } else {
            for (reply, step) in replies.into_iter().zip(&plan.steps) {
                let answer = match (audited, placing::is_repeat(step)) {
                    (Err(e), true) => Err(Failure::Unaudited(e.clone())),
                    _ => Ok(step.clone()),
                };
                let _ = reply.send(answer);
            }
        }
        self.held.lock().unwrap_or_else(|e| e.into_inner()).take();
    }
}
