//! One connection's worth of dispatching: open the consumers, gather
//! deliveries into batches and hand each to a worker ([`crate::batch`]),
//! run the background sweeps; on a stop or a lost connection, finish what
//! is in flight and close. Whatever is still unacked goes back to the
//! queue and is redelivered.

use std::sync::Arc;
use std::time::Duration;

use codepool_broker::{BrokerError, ConsumerHandle, Publisher, PurchaseConsumers};
use codepool_domain::{PoolEvent, PoolEventKind};
use codepool_issuance::model::ObjectId;
use futures::stream::SelectAll;
use futures::{FutureExt, StreamExt};
use lapin::message::Delivery;
use lapin::{Connection, Consumer};
use tokio::sync::{Notify, Semaphore};
use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::acks::AckWindow;
use crate::daemon::{Dispatcher, SessionEnd};
use codepool_issuance::{background, Door};

/// The purchase queues' deliveries, merged (one queue, or every partition).
type Deliveries = futures::stream::BoxStream<'static, lapin::Result<Delivery>>;

/// How long background tasks get to finish after a stop signal; together
/// with the grace period for in-flight batches this keeps a stop under 10 s.
const BACKGROUND_STOP: Duration = Duration::from_millis(500);
/// A batch whose waiting deliveries fill at least this fraction of it is
/// filling fast, and lingers for the rest.
const LINGER_FROM: f64 = 0.5;
/// What the broker is told when a session closes its connection.
const STOPPING: &str = "codepool dispatcher stopping";

/// The background work of a session, stopped with it. Kept until the
/// connection is closed: it holds the consumers' channels.
struct Background {
    stop: CancellationToken,
    sweeper: JoinHandle<()>,
    /// Receipts and redemptions, and the background work every granting
    /// process runs ([`background::start`]).
    upkeep: JoinSet<()>,
    /// The consumers the tasks read: receipts, redemptions, pool events.
    consumers: Vec<ConsumerHandle>,
}

impl Dispatcher {
    pub(crate) async fn session(
        self: Arc<Self>,
        shutdown: &CancellationToken,
    ) -> Result<SessionEnd, BrokerError> {
        let cfg = &self.config;
        let conn = codepool_broker::connect(&cfg.amqp_url, &cfg.name).await?;
        let tag = format!("{}-{}", cfg.name, ObjectId::new().to_hex());
        let PurchaseConsumers {
            deliveries: mut consumer,
            handles: purchases,
        } = codepool_broker::consume_purchases(
            &conn,
            &cfg.topology,
            cfg.prefetch,
            &tag,
            &cfg.standby,
        )
        .await?;
        // Its dead letters are vouched for by its own broker user.
        let publisher = Publisher::new(&conn, cfg.topology.clone())
            .await?
            .as_user(&Publisher::user_of(&cfg.amqp_url));
        let mut background = self
            .clone()
            .start_background(&conn, &publisher, shutdown)
            .await?;
        self.health.set_amqp(true);
        self.amqp.ok();
        let queues = cfg.topology.purchase_queues().join(",");
        info!(%queues, prefetch = cfg.prefetch, batch = cfg.batch_size, "consuming purchases");

        let mut inflight = JoinSet::new();
        // Half the prefetch window may wait for an older batch (acks.rs).
        let acks = Arc::new(AckWindow::new(usize::from(cfg.prefetch) / 2));
        let end = self
            .clone()
            .consume(&mut consumer, &publisher, &acks, &mut inflight, shutdown)
            .await;
        // Consumers cancelled, confirms settled, channels kept open until
        // the connection closes them all (see codepool_broker::close).
        purchases.cancel().await;
        drop(consumer);
        self.set_publisher(None);
        self.wind_down(inflight, &mut background).await;
        acks.flush().await;
        publisher.settle().await;
        codepool_broker::close(conn, STOPPING).await;
        drop((purchases, background, publisher));
        Ok(end)
    }

    /// Receipts and redemptions (upkeep.rs), and the backorders of a pool
    /// served as soon as it is replenished or resumed. The daemon's
    /// background work ([`background::start`]) publishes on this session's
    /// publisher while it lasts.
    async fn start_background(
        self: Arc<Self>,
        conn: &Connection,
        publisher: &Publisher,
        shutdown: &CancellationToken,
    ) -> Result<Background, BrokerError> {
        let cfg = &self.config;
        // Stock arrived, or the pool was resumed: its backorders can go.
        let (mut stock_events, mut consumers) = (Vec::new(), Vec::new());
        for kind in [PoolEventKind::Replenished, PoolEventKind::Resumed] {
            let events =
                codepool_broker::subscribe(conn, &cfg.topology.events_exchange, kind.routing_key())
                    .await?;
            stock_events.push(events.consumer);
            consumers.push(events.handle);
        }
        let replenished = futures::stream::select_all(stock_events);
        let stop = shutdown.child_token();
        let upkeep = crate::upkeep::spawn(
            conn,
            std::sync::Arc::new(self.parts.clone()),
            publisher.topology(),
            std::sync::Arc::new(cfg.redeemers.clone()),
            stop.clone(),
        )
        .await?;
        consumers.extend(upkeep.consumers);
        // The daemon's background work publishes on this session's
        // connection until it ends (daemon.rs).
        self.set_publisher(Some(publisher.clone()));
        let sweeper = tokio::spawn(self.clone().sweep_loop(
            publisher.clone(),
            replenished,
            stop.clone(),
        ));
        Ok(Background {
            stop,
            sweeper,
            upkeep: upkeep.tasks,
            consumers,
        })
    }

    /// Gathers batches and hands each to a worker, `workers` at a time.
    /// A worker is secured first, then the batch is gathered: while every
    /// worker is busy, purchases wait in the prefetch window, so batches
    /// grow with load by themselves; and a batch gathered while others are
    /// in flight waits a moment for company (see [`Self::fill_batch`]).
    async fn consume(
        self: Arc<Self>,
        consumer: &mut Deliveries,
        publisher: &Publisher,
        acks: &Arc<AckWindow>,
        inflight: &mut JoinSet<()>,
        shutdown: &CancellationToken,
    ) -> SessionEnd {
        let permits = Arc::new(Semaphore::new(self.config.workers.max(1)));
        let finished = Arc::new(Notify::new());
        loop {
            let permit = tokio::select! {
                p = permits.clone().acquire_owned() => p,
                _ = shutdown.cancelled() => return SessionEnd::Shutdown,
            };
            let Ok(permit) = permit else {
                return SessionEnd::Shutdown;
            };
            if !self.parts.intake.keys().missing().is_empty() {
                return SessionEnd::KeysMissing;
            }
            let first = tokio::select! {
                biased;
                _ = shutdown.cancelled() => return SessionEnd::Shutdown,
                next = consumer.next() => next,
            };
            let first = match first {
                Some(Ok(d)) => d,
                Some(Err(e)) => return SessionEnd::Lost(e.to_string()),
                None => return SessionEnd::Lost("the broker closed the consumer".into()),
            };
            let (batch, lost) = self.fill_batch(first, consumer, &permits, &finished).await;
            acks.opened(&batch);
            let (this, publisher, stop) = (self.clone(), publisher.clone(), shutdown.clone());
            let (finished, acks) = (finished.clone(), acks.clone());
            let span = tracing::info_span!("batch", door = Door::Amqp.as_str(), size = batch.len());
            inflight.spawn(tracing::Instrument::instrument(
                async move {
                    this.process(batch, &publisher, &acks, &stop).await;
                    drop(permit);
                    finished.notify_waiters();
                },
                span,
            ));
            while inflight.try_join_next().is_some() {}
            if let Some(reason) = lost {
                return SessionEnd::Lost(reason);
            }
        }
    }

    /// Adds to `first` every delivery already waiting, up to `batch_size`.
    /// Then it lingers, at most `linger`, for more, only when that saves
    /// work:
    /// - the window is filling fast (this drain found at least
    ///   [`LINGER_FROM`] of a batch), or
    /// - another batch is in flight: a batch started now would run beside
    ///   it with a handful of purchases, and each batch costs a journaled
    ///   write and a publish round, whatever its size. Under load those
    ///   tiny concurrent batches are what the machine spends its time on.
    ///   This wait ends as soon as a batch in flight finishes.
    ///
    /// At low load nothing is in flight: the purchase goes alone, at once.
    /// Returns the batch, and why the consumer failed if it did.
    async fn fill_batch(
        &self,
        first: Delivery,
        consumer: &mut Deliveries,
        permits: &Semaphore,
        finished: &Notify,
    ) -> (Vec<Delivery>, Option<String>) {
        let size = self.config.batch_size;
        let mut batch = vec![first];
        while batch.len() < size {
            match consumer.next().now_or_never() {
                Some(Some(Ok(d))) => batch.push(d),
                Some(Some(Err(e))) => return (batch, Some(e.to_string())),
                Some(None) | None => break,
            }
        }
        // Registered before the count is read, so a batch that finishes in
        // between still ends the wait.
        let batch_done = finished.notified();
        tokio::pin!(batch_done);
        batch_done.as_mut().enable();
        let filling_fast = batch.len() as f64 >= size as f64 * LINGER_FROM;
        // This call holds one permit; the others taken are batches in flight.
        let in_flight = self
            .config
            .workers
            .max(1)
            .saturating_sub(permits.available_permits() + 1);
        if !filling_fast && in_flight == 0 {
            return (batch, None);
        }
        let deadline = tokio::time::Instant::now() + self.config.linger;
        while batch.len() < size {
            tokio::select! {
                next = tokio::time::timeout_at(deadline, consumer.next()) => match next {
                    Ok(Some(Ok(d))) => batch.push(d),
                    Ok(Some(Err(e))) => return (batch, Some(e.to_string())),
                    Ok(None) | Err(_) => break,
                },
                _ = &mut batch_done, if !filling_fast => break,
            }
        }
        (batch, None)
    }

    /// Finishes in-flight batches within the grace period, then cancels
    /// the background consumers, gives the background work a moment and
    /// aborts it. Nothing is lost: an unacked
    /// purchase is redelivered, an unmarked backorder or unconfirmed event
    /// is picked up again by the next sweep or the relay.
    async fn wind_down(&self, mut inflight: JoinSet<()>, background: &mut Background) {
        let drained = tokio::time::timeout(self.config.grace, async {
            while inflight.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            warn!("grace period over with batches in flight; their purchases will be redelivered");
            inflight.abort_all();
        }
        let Background {
            stop,
            sweeper,
            upkeep,
            consumers,
        } = background;
        // Cancelled while the tasks still hold them: a consumer dropped
        // active would be cancelled by lapin behind the connection's close.
        futures::future::join_all(consumers.iter().map(ConsumerHandle::cancel)).await;
        stop.cancel();
        if tokio::time::timeout(BACKGROUND_STOP, &mut *sweeper)
            .await
            .is_err()
        {
            sweeper.abort();
        }
        let upkeep_done = tokio::time::timeout(BACKGROUND_STOP, async {
            while upkeep.join_next().await.is_some() {}
        })
        .await;
        if upkeep_done.is_err() {
            upkeep.abort_all();
        }
    }

    /// Fulfils a pool's backorders as soon as it is replenished or
    /// resumed (the periodic sweep is [`background::start`]'s).
    async fn sweep_loop(
        self: Arc<Self>,
        publisher: Publisher,
        mut replenished: SelectAll<Consumer>,
        stop: CancellationToken,
    ) {
        loop {
            let pool = tokio::select! {
                _ = stop.cancelled() => return,
                ev = replenished.next() => match ev {
                    Some(Ok(d)) => match serde_json::from_slice::<PoolEvent>(&d.data) {
                        Ok(e) => e.pool,
                        Err(e) => {
                            warn!(error = %e, "ignored a pool.replenished/pool.resumed event that is not a pool event");
                            continue;
                        }
                    },
                    _ => { stop.cancelled().await; return; }
                },
            };
            self.parts.stock.forget(&pool);
            self.parts.intake.engine().replenished(&pool);
            // Nothing is claimed here either while the key file lacks a
            // key codes are sealed with (see keywatch.rs).
            if !matches!(self.parts.ensure_keys().await, Ok(Ok(()))) {
                continue;
            }
            // Its lines (the core's `fulfil` span) name the door that heard it.
            let span = tracing::info_span!("pool_event", door = Door::Amqp.as_str(), pool = %pool);
            let served = background::fulfil(&self.parts, &publisher, [pool], &stop);
            tracing::Instrument::instrument(served, span).await;
        }
    }
}
