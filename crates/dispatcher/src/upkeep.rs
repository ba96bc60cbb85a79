//! Upkeep: what a dispatcher session does besides purchases. It applies
//! SMS receipts ([`crate::receipts`]) and `code.redeemed` events
//! ([`crate::redemptions`]) from their durable queues, and every
//! [`StockConfig::sweep_every`](crate::stock::StockConfig), at the first
//! quiet moment, voids expired codes ([`crate::expiry`]) and re-checks
//! every pool's stock ([`crate::stock`]). All of it stops with the session.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use codepool_broker::{BrokerError, ConsumerHandle, Publisher};
use codepool_hotpool::HotPool;
use codepool_store::{Store, StoreError};
use futures::StreamExt;
use lapin::message::Delivery;
use lapin::options::BasicAckOptions;
use lapin::{Connection, Consumer};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::receipts::apply_receipt;
use crate::redemptions::apply_redemption;
use codepool_issuance::expiry::expire_codes;
use codepool_issuance::outage::Retry;
use codepool_issuance::stock::StockWatch;

/// Unacked receipts or redemptions one session holds at once.
const PREFETCH: u16 = 64;

/// The upkeep tasks of a session, and the consumers they read.
pub struct Upkeep {
    pub tasks: JoinSet<()>,
    /// Cancel these before stopping the tasks; keep them until the
    /// connection is closed (they hold the consumers' channels).
    pub consumers: Vec<ConsumerHandle>,
}

/// Opens the consumers (which may fail: nothing is spawned then) and
/// spawns the upkeep tasks (the queues are those of `publisher`'s
/// topology). Await the tasks after cancelling `stop`.
pub async fn spawn(
    conn: &Connection,
    store: Store,
    hot: HotPool,
    watch: Watch,
    publisher: Publisher,
    redeemers: Arc<Vec<String>>,
    stop: CancellationToken,
) -> Result<Upkeep, BrokerError> {
    let topology = publisher.topology();
    let receipts = codepool_broker::consume(conn, &topology.sms_receipts, PREFETCH).await?;
    let redemptions = codepool_broker::consume(conn, &topology.code_redeemed, PREFETCH).await?;
    let consumers = vec![receipts.handle, redemptions.handle];
    let mut tasks = JoinSet::new();
    tasks.spawn(consume(
        receipts.consumer,
        store.clone(),
        stop.clone(),
        |s, d| async move {
            let r = apply_receipt(&s, &d).await;
            (d, r)
        },
    ));
    tasks.spawn(consume(
        redemptions.consumer,
        store.clone(),
        stop.clone(),
        move |s, d| {
            let redeemers = redeemers.clone();
            async move {
                let r = apply_redemption(&s, &d, &redeemers).await;
                (d, r)
            }
        },
    ));
    tasks.spawn(sweep(store, hot, watch, publisher, stop));
    Ok(Upkeep { tasks, consumers })
}

/// Applies deliveries one by one, acking each once it is applied. While
/// MongoDB is away the delivery is retried with backoff; on stop it stays
/// unacked and is redelivered to the next consumer.
async fn consume<F, Fut>(mut consumer: Consumer, store: Store, stop: CancellationToken, apply: F)
where
    F: Fn(Store, Delivery) -> Fut,
    Fut: Future<Output = (Delivery, Result<(), StoreError>)>,
{
    let queue = consumer.queue().to_string();
    loop {
        let delivery = tokio::select! {
            _ = stop.cancelled() => return,
            next = consumer.next() => match next {
                Some(Ok(d)) => d,
                // Cancelled (the session is stopping), or the connection is
                // gone (the session notices and reconnects).
                _ => return,
            },
        };
        let mut delivery = delivery;
        let mut retry = Retry::new();
        loop {
            let (d, result) = apply(store.clone(), delivery).await;
            delivery = d;
            match result {
                Ok(()) => break,
                Err(e) => {
                    if retry.tries() == 0 {
                        warn!(queue, error = %e, "MongoDB unavailable; holding the message until it returns");
                    }
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(retry.delay()) => {}
                    }
                }
            }
        }
        if let Err(e) = delivery.acker.ack(BasicAckOptions::default()).await {
            debug!(queue, error = %e, "ack failed; the message will be redelivered and applied again harmlessly");
        }
    }
}

/// Every `sweep_every`: void expired codes, then re-check every pool's
/// stock (gauges, alerts, re-arming after imports). Both read the whole
/// catalogue, so a sweep first waits for a quiet moment ([`quiet`]): at a
/// start with purchases queued, the backlog is served before the catalogue
/// is counted.
async fn sweep(
    store: Store,
    hot: HotPool,
    Watch { stock, activity }: Watch,
    publisher: Publisher,
    stop: CancellationToken,
) {
    let every = stock.config().sweep_every;
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = quiet(&activity, every) => {}
        }
        if let Err(e) = expire_codes(&store, &hot, None).await {
            debug!(error = %e, "expiry sweep skipped");
        }
        if let Err(e) = stock.check_all(&publisher).await {
            debug!(error = %e, "stock sweep skipped");
        }
    }
}

/// What the sweep reads: the stock checks it runs, and the dispatcher's
/// activity it waits on.
pub struct Watch {
    pub stock: Arc<StockWatch>,
    pub activity: Arc<Activity>,
}

/// Whether the dispatcher is placing purchases: the batches underway, and
/// when the last one ended. Shared by a dispatcher's sessions.
#[derive(Debug, Default)]
pub struct Activity {
    state: Mutex<Batches>,
}

#[derive(Debug, Default)]
struct Batches {
    underway: usize,
    last_end: Option<Instant>,
}

impl Activity {
    /// A batch is underway until the returned guard is dropped.
    pub(crate) fn batch(self: &Arc<Self>) -> BatchUnderway {
        if let Ok(mut s) = self.state.lock() {
            s.underway += 1;
        }
        BatchUnderway(self.clone())
    }

    /// When the dispatcher will have been quiet for [`QUIET`], counting
    /// from `since` at the earliest; `None` while a batch is underway.
    fn quiet_at(&self, since: Instant) -> Option<Instant> {
        let s = self.state.lock().ok()?;
        (s.underway == 0).then(|| s.last_end.map_or(since, |t| t.max(since)) + QUIET)
    }
}

/// See [`Activity::batch`].
pub(crate) struct BatchUnderway(Arc<Activity>);

impl Drop for BatchUnderway {
    fn drop(&mut self) {
        if let Ok(mut s) = self.0.state.lock() {
            s.underway = s.underway.saturating_sub(1);
            s.last_end = Some(Instant::now());
        }
    }
}

/// How long the dispatcher must have had no batch underway for a sweep to
/// start: longer than a session takes to receive its first purchases, and
/// than the gap between two batches of a backlog.
const QUIET: Duration = Duration::from_secs(1);

/// How often a sweep waiting on a batch underway looks again.
const LOOK_AGAIN: Duration = Duration::from_millis(50);

/// Returns once the dispatcher has had no batch underway for [`QUIET`]
/// (counted from now at the earliest: a session's first batch comes a
/// moment after it starts), or after `most` whatever the load, so steady
/// traffic delays a sweep by one period at most.
async fn quiet(activity: &Activity, most: Duration) {
    let began = Instant::now();
    let deadline = began + most;
    loop {
        let now = Instant::now();
        if now >= deadline {
            return;
        }
        let wait = match activity.quiet_at(began) {
            Some(at) if now >= at => return,
            Some(at) => at - now,
            None => LOOK_AGAIN,
        };
        tokio::time::sleep(wait.min(deadline - now)).await;
    }
}
