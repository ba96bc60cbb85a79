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
//! each fresh grant's event is owed by its outbox mark (`Resend::ByRelay`),
//! which the relay of every API process honours, exactly as for a process
//! that died between its claim and its confirm. Nothing is lost, and the
//! stable `event_id` makes a second send harmless.
//!
//! At most [`IN_FLIGHT`] batches are placed at once; while they are, new
//! requests queue for the next. One at a time is the fastest setting
//! measured (`codepool-bench api`, docs/benchmarks.md): the clients
//! answered by one batch are back by the time the next starts, so it takes
//! them all. At most [`ANNOUNCING`] batches' announcements wait for the
//! broker at once; a broker slower than that holds the next batch back.

use std::sync::{Arc, Weak};

use codepool_domain::{CodeId, Purchase};
use codepool_issuance::audit::{self, Actor};
use codepool_issuance::placing::{self, Texting};
use codepool_issuance::plan::{BatchPlan, Step};
use codepool_issuance::ports::SmsLedger;
use codepool_issuance::{Intake, Resend};
use tokio::sync::{mpsc, oneshot, Semaphore};

use crate::Api;

/// Most orders decided together.
pub const MAX_BATCH: usize = 256;
/// Most batches placed at once.
pub const IN_FLIGHT: usize = 1;
/// Most placed batches whose announcements wait for the broker at once.
pub const ANNOUNCING: usize = 8;
/// Longest a batch's announcements wait for the broker's confirms.
const ANNOUNCE_FOR: std::time::Duration = std::time::Duration::from_secs(20);

/// Why a batch could not be decided: every request in it gets this.
#[derive(Debug, Clone)]
pub(crate) struct Failure {
    pub message: String,
    /// MongoDB (or the broker) is away: 503, try again.
    pub unavailable: bool,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

struct Ask {
    purchase: Purchase,
    /// Who asks (`api-key:NAME`) and the request id: a repeat answered
    /// with codes is audited under them.
    who: String,
    request: String,
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
    pub(crate) fn start(api: Weak<Api>) -> Self {
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
        let gone = || Failure {
            message: "the API is stopping".into(),
            unavailable: true,
        };
        self.tx
            .send(Ask {
                purchase,
                who,
                request,
                reply,
            })
            .await
            .map_err(|_| gone())?;
        answer.await.map_err(|_| gone())?
    }
}

async fn run(api: Weak<Api>, mut rx: mpsc::Receiver<Ask>, announcing: Arc<Semaphore>) {
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
        let span = tracing::info_span!("batch", door = "http", size = asks.len());
        let work = async move {
            let plan = answer_batch(&api, asks).await;
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
/// whose announcements are still owed.
async fn answer_batch(api: &Api, asks: Vec<Ask>) -> Option<BatchPlan> {
    metrics::histogram!("codepool_api_batch_size").record(asks.len() as f64);
    let whom: Vec<(String, String)> = (asks.iter())
        .map(|a| (a.who.clone(), a.request.clone()))
        .collect();
    let (purchases, replies): (Vec<_>, Vec<_>) =
        asks.into_iter().map(|a| (a.purchase, a.reply)).unzip();
    match place(api.intake(), purchases).await {
        Ok(plan) => {
            // No record, no reveal: the repeats' audit records, one write
            // for the batch, before any answer.
            let audited = audit_repeats(api, &plan.steps, &whom).await;
            plan.steps.iter().for_each(placing::log_step);
            placing::count(&plan);
            for (reply, step) in replies.into_iter().zip(&plan.steps) {
                let answer = match (&audited, is_repeat(step)) {
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

/// Whether a step answers codes issued before its request (a repeat).
fn is_repeat(step: &Step) -> bool {
    matches!(step, Step::Grant { grants, fresh, .. }
        if (*fresh as usize) < grants.len() && grants.iter().any(|g| !g.revoked))
}

/// Records, in one durable write, every repeat of the batch that shows
/// codes again, with the key and request that asked.
async fn audit_repeats(
    api: &Api,
    steps: &[Step],
    whom: &[(String, String)],
) -> Result<(), Failure> {
    if !steps.iter().any(is_repeat) {
        return Ok(());
    }
    let reveals: Vec<codepool_store::audit::Reveal> = (steps.iter().zip(whom))
        .filter(|(s, _)| is_repeat(s))
        .filter_map(|(s, (who, request))| {
            let Step::Grant {
                purchase, grants, ..
            } = s
            else {
                return None;
            };
            let shown: Vec<CodeId> = (grants.iter())
                .filter(|g| !g.revoked)
                .map(|g| g.code_id)
                .collect();
            let actor = Actor {
                who: who.clone(),
                via: format!("POST /v1/orders, a repeat (request {request})"),
            };
            let what = format!("order {:?}", purchase.order_id);
            let count = shown.len() as u64;
            Some(audit::reveal_of(&actor, what, shown, count))
        })
        .collect();
    api.store()
        .record_reveals(&reveals)
        .await
        .map_err(|e| Failure {
            unavailable: e.is_unavailable(),
            message: format!("{e}; the repeat was not audited, so its codes are not shown"),
        })
}

/// Publishes what a placed batch owes, then takes the codes whose events
/// were confirmed off the relay's list. A mark not recorded (this process
/// stopped, MongoDB away) only means the relay sends the event again, with
/// the same `event_id`.
async fn announce(api: &Api, plan: &BatchPlan) {
    let broker = api.broker();
    let announcing = placing::announce(
        plan,
        api.outbox(),
        &broker.publisher,
        Texting::Fresh,
        None,
        api.store(),
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
    if announced.confirmed.is_empty() {
        return;
    }
    if let Err(e) = api.store().mark_published(&announced.confirmed).await {
        tracing::warn!(error = %e, "SMS marks not recorded; the relay sends the events again");
    }
}

/// The durable half of one batch through the core: claimed, with its
/// backorders recorded. No message of an HTTP order is redelivered: the
/// relay owes the events of a grant no one saw confirmed.
async fn place(intake: &Intake, purchases: Vec<Purchase>) -> Result<BatchPlan, Failure> {
    let n = purchases.len();
    let parsed = purchases.into_iter().map(Ok).collect();
    let plan = (intake.place(parsed, &[], Resend::ByRelay).await).map_err(|e| Failure {
        // A key missing from this process's key file: nothing was
        // claimed, and another API process (or this one, once its key
        // file is complete) takes the same request.
        unavailable: e.is_retryable(),
        message: e.to_string(),
    })?;
    if plan.steps.len() != n {
        return Err(Failure {
            message: format!("the core decided {} steps for {n} orders", plan.steps.len()),
            unavailable: false,
        });
    }
    Ok(plan)
}
