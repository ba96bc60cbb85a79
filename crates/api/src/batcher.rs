//! Concurrent HTTP orders share one claim write, as AMQP deliveries do.
//!
//! Each `POST /v1/orders` hands its purchase to the batcher and waits for
//! its step. The batcher takes whatever has queued meanwhile (up to
//! [`MAX_BATCH`]) as one batch, decides it through the same
//! [`codepool_dispatcher::Intake`] as the dispatcher (one policy read, one
//! batched, journaled claim, one backorder write), publishes the batch's
//! events together, and answers every request once they are confirmed;
//! then it records the confirmed events (off the relay's list), which the
//! answer need not wait for. At most [`IN_FLIGHT`] batches run at once;
//! while they do, new requests queue for the next.
//!
//! One batch at a time, recording included, is the fastest setting
//! measured (`codepool-bench api`, docs/benchmarks.md): the clients
//! answered by one batch are back by the time it has recorded its events,
//! so the next batch takes them all. Four at a time split 64 clients into
//! batches of about 10: mongod spent twice the CPU per grant, and grants
//! were 25–35% slower. Under more load a batch grows to [`MAX_BATCH`].

use std::sync::{Arc, Weak};

use codepool_dispatcher::plan::{BatchPlan, Step};
use codepool_dispatcher::ports::SmsLedger;
use codepool_dispatcher::{Marking, Resend};
use codepool_domain::{CodeId, Grant, Purchase};
use tokio::sync::{mpsc, oneshot, Semaphore};

use crate::Api;

/// Most orders decided together.
pub const MAX_BATCH: usize = 256;
/// Most batches decided at once.
pub const IN_FLIGHT: usize = 1;

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
}

impl Batcher {
    /// Starts the batching task for `api` (held weakly: the task ends with
    /// the API).
    pub(crate) fn start(api: Weak<Api>) -> Self {
        let (tx, rx) = mpsc::channel(MAX_BATCH * IN_FLIGHT * 4);
        tokio::spawn(run(api, rx));
        Self { tx }
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

async fn run(api: Weak<Api>, mut rx: mpsc::Receiver<Ask>) {
    let permits = Arc::new(Semaphore::new(IN_FLIGHT));
    while let Some(first) = rx.recv().await {
        let Ok(permit) = permits.clone().acquire_owned().await else {
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
        tokio::spawn(async move {
            let _permit = permit;
            metrics::histogram!("codepool_api_batch_size").record(asks.len() as f64);
            let whom: Vec<(String, String)> = (asks.iter())
                .map(|a| (a.who.clone(), a.request.clone()))
                .collect();
            let (purchases, replies): (Vec<_>, Vec<_>) =
                asks.into_iter().map(|a| (a.purchase, a.reply)).unzip();
            match decide_batch(&api, purchases).await {
                Ok((steps, confirmed)) => {
                    // No record, no reveal: the repeats' audit records,
                    // one write for the batch, before any answer.
                    let audited = audit_repeats(&api, &steps, &whom).await;
                    for (reply, step) in replies.into_iter().zip(steps) {
                        let answer = match (&audited, is_repeat(&step)) {
                            (Err(e), true) => Err(e.clone()),
                            _ => Ok(step),
                        };
                        let _ = reply.send(answer);
                    }
                    mark_sent(&api, &confirmed).await;
                }
                Err(e) => {
                    for reply in replies {
                        let _ = reply.send(Err(e.clone()));
                    }
                }
            }
        });
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
    let host = crate::orders::hostname();
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
            Some(codepool_store::audit::Reveal {
                os_user: who.clone(),
                host: host.clone(),
                command: format!("POST /v1/orders, a repeat (request {request})"),
                what: format!("order {:?}", purchase.order_id),
                count: shown.len() as u64,
                code_ids: shown,
            })
        })
        .collect();
    api.store
        .record_reveals(&reveals)
        .await
        .map_err(|e| Failure {
            unavailable: e.is_unavailable(),
            message: format!("{e}; the repeat was not audited, so its codes are not shown"),
        })
}

/// Takes the codes whose events were confirmed off the relay's list. A
/// mark not recorded (this process stopped, MongoDB away) only means the
/// relay sends the event again, with the same `event_id`.
async fn mark_sent(api: &Api, confirmed: &[CodeId]) {
    if confirmed.is_empty() {
        return;
    }
    if let Err(e) = api.store.mark_published(confirmed).await {
        tracing::warn!(error = %e, "SMS marks not recorded; the relay sends the events again");
    }
}

/// One batch through the shared core: plan, durable backorders, pool
/// notices, refusals and the fresh grants' events. The steps, one per
/// purchase, in order, and the codes whose events the broker confirmed
/// (to mark once the requests are answered).
async fn decide_batch(
    api: &Api,
    purchases: Vec<Purchase>,
) -> Result<(Vec<Step>, Vec<CodeId>), Failure> {
    let n = purchases.len();
    // No message of an HTTP order is redelivered: the relay owes the
    // events of a grant this process did not see confirmed.
    let parsed = purchases.into_iter().map(Ok).collect();
    let mut plan =
        (api.intake.decide(parsed, &[], Resend::ByRelay).await).map_err(|e| Failure {
            // A key missing from this process's key file: nothing was
            // claimed, and another API process (or this one, once its key
            // file is complete) takes the same request.
            unavailable: e.is_unavailable()
                || matches!(e, codepool_dispatcher::claim::ClaimError::KeysMissing(_)),
            message: e.to_string(),
        })?;
    (api.intake.record_backorders(&mut plan).await).map_err(|e| Failure {
        unavailable: e.is_unavailable(),
        message: e.to_string(),
    })?;
    if plan.steps.len() != n {
        return Err(Failure {
            message: format!("the core decided {} steps for {n} orders", plan.steps.len()),
            unavailable: false,
        });
    }
    let broker = api.broker();
    codepool_dispatcher::batch::announce_exhausted(&plan, &broker.publisher).await;
    let refusals = plan.refusals().into_iter().map(|(_, r)| {
        let publisher = &broker.publisher;
        async move {
            let event = r.event();
            let confirmed = codepool_broker::confirmed(publisher.publish_refused(&event).await).await;
            if let Err(e) = confirmed {
                tracing::warn!(error = %e, order_id = %r.purchase.order_id, "purchase.refused not confirmed; the refusal stands and is recorded");
            }
        }
    });
    futures::future::join_all(refusals).await;
    // Only what this batch issued is texted: a retried request gets its
    // codes in the answer, not a second SMS (`/resend` is for that). Marked
    // after the answers (see `mark_sent`): what the broker does not
    // confirm stays on the relay's list.
    let fresh: Vec<&Grant> = plan.steps.iter().flat_map(fresh_grants).collect();
    let mut confirmed = Vec::new();
    if !fresh.is_empty() {
        // `Unneeded` records nothing, so it cannot fail.
        if let Ok(sent) = (api.outbox)
            .send(&broker.publisher, &fresh, Marking::Unneeded)
            .await
        {
            confirmed = (fresh.iter().zip(&sent.results))
                .filter(|(g, r)| !g.revoked && r.is_ok())
                .map(|(g, _)| g.code_id)
                .collect();
        }
    }
    count(&plan);
    Ok((plan.steps, confirmed))
}

fn count(plan: &BatchPlan) {
    metrics::counter!("codepool_grants_total").increment(plan.fresh_grants);
    metrics::counter!("codepool_duplicate_deliveries_total").increment(plan.repeats);
    metrics::counter!("codepool_held_purchases_total").increment(plan.held);
}

/// The grants a step issued in this batch: the codes of one claim share a
/// part (the first line it claimed), the newest part of the order.
pub(crate) fn fresh_grants(step: &Step) -> Vec<&Grant> {
    let Step::Grant { grants, fresh, .. } = step else {
        return Vec::new();
    };
    if *fresh == 0 {
        return Vec::new();
    }
    let newest = grants.iter().map(|g| g.part).max();
    let issued: Vec<&Grant> = grants.iter().filter(|g| Some(g.part) == newest).collect();
    if issued.len() == *fresh as usize {
        issued
    } else {
        // Not one part (never expected): send them all; the same event
        // ids make a second send harmless.
        grants.iter().collect()
    }
}
