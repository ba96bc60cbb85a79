//! The dispatcher daemon: consume, batch, claim, publish, ack; reconnect
//! after broker outages; wait out database outages; stop gracefully.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use codepool_broker::{BrokerError, PendingConfirm, Publisher, Topology};
use codepool_domain::{PoolEvent, PoolEventKind, Purchase, PurchaseError};
use codepool_store::{ObjectId, Store};
use futures::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions,
    QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use tokio::sync::{RwLock, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::backorders::fulfil_backorders;
use crate::claim::{ClaimEngine, ClaimOutcome};
use crate::health::Health;
use crate::outage::{backoff, Outage};
use crate::relay::relay_unconfirmed;
use crate::stock::{StockConfig, StockWatch};

/// How long background tasks get to finish after a stop signal; together
/// with the grace period for in-flight batches this keeps a stop under 10 s.
const BACKGROUND_STOP: Duration = Duration::from_millis(500);

/// How often a broker set-up that retrying cannot fix is checked again.
const PERMANENT_RETRY: Duration = Duration::from_secs(60);

/// How the daemon runs. Defaults suit one dispatcher on a small machine.
#[derive(Debug, Clone)]
pub struct DispatcherConfig {
    pub amqp_url: String,
    pub topology: Topology,
    /// Unacked purchases the broker may hand us at once.
    pub prefetch: u16,
    /// Purchases claimed together in one bulk write.
    pub batch_size: usize,
    /// Batches processed at the same time.
    pub workers: usize,
    /// How long to wait for a batch to fill once its first purchase arrived.
    pub linger: Duration,
    /// Time allowed to finish in-flight batches after a stop signal.
    pub grace: Duration,
    /// How often the relay and the backorder sweep run.
    pub sweep_every: Duration,
    /// A grant whose event is unconfirmed for this long is re-published.
    pub relay_after: Duration,
    /// Connection name shown in RabbitMQ.
    pub name: String,
}

impl Default for DispatcherConfig {
    fn default() -> Self {
        Self {
            amqp_url: "amqp://guest:guest@127.0.0.1:5672/%2f".into(),
            topology: Topology::default(),
            prefetch: 1024,
            batch_size: 256,
            workers: 4,
            linger: Duration::from_millis(3),
            grace: Duration::from_secs(7),
            sweep_every: Duration::from_secs(10),
            relay_after: Duration::from_secs(30),
            name: format!("codepool-dispatch-{}", std::process::id()),
        }
    }
}

/// The daemon. Stateless: run as many as needed on one queue.
pub struct Dispatcher {
    store: Store,
    engine: ClaimEngine,
    config: DispatcherConfig,
    health: Arc<Health>,
    known_pools: RwLock<HashSet<String>>,
    mongo: Outage,
    amqp: Outage,
    /// Stock gauges and low-stock alerts (stock.rs).
    stock: Arc<StockWatch>,
    /// Codes whose SMS-pending event was confirmed, not yet marked in MongoDB.
    sms_marks: std::sync::Mutex<Vec<ObjectId>>,
}

enum SessionEnd {
    Shutdown,
    Lost(String),
}

impl Dispatcher {
    pub fn new(engine: ClaimEngine, config: DispatcherConfig, health: Arc<Health>) -> Arc<Self> {
        Arc::new(Self {
            stock: StockWatch::new(engine.store().clone(), StockConfig::default()),
            store: engine.store().clone(),
            engine,
            config,
            health,
            known_pools: RwLock::new(HashSet::new()),
            mongo: Outage::new("MongoDB"),
            amqp: Outage::new("RabbitMQ"),
            sms_marks: std::sync::Mutex::new(Vec::new()),
        })
    }

    pub fn health(&self) -> &Arc<Health> {
        &self.health
    }

    /// Runs until `shutdown` is cancelled, reconnecting to RabbitMQ as often
    /// as needed. Returns once in-flight work is drained (or the grace
    /// period is over: what is left unacked is redelivered later).
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) {
        let mut attempt = 0;
        let probe = self.clone();
        let probe_stop = shutdown.child_token();
        let prober = tokio::spawn({
            let stop = probe_stop.clone();
            async move { probe.probe_loop(stop).await }
        });
        loop {
            match self.clone().session(&shutdown).await {
                Ok(SessionEnd::Shutdown) => break,
                Ok(SessionEnd::Lost(reason)) => {
                    self.health.set_amqp(false);
                    self.amqp.failed(&reason);
                    attempt = 0;
                }
                Err(e) if e.is_permanent() => {
                    // e.g. a classic queue where quorum queues are configured:
                    // stay up and unready, say how to fix it, check again later.
                    self.health.set_amqp(false);
                    error!(error = %e, "not consuming purchases until this is fixed; checking again every minute");
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = tokio::time::sleep(PERMANENT_RETRY) => continue,
                    }
                }
                Err(e) => {
                    self.health.set_amqp(false);
                    self.amqp.failed(&e);
                    attempt += 1;
                }
            }
            if shutdown.is_cancelled() {
                break;
            }
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(backoff(attempt)) => {}
            }
        }
        probe_stop.cancel();
        let _ = prober.await;
        info!("dispatcher stopped");
    }

    /// Writes the pending "SMS event confirmed" marks (see `process`).
    async fn flush_sms_marks(&self) {
        let marks = match self.sms_marks.lock() {
            Ok(mut m) => std::mem::take(&mut *m),
            Err(_) => return,
        };
        for chunk in marks.chunks(5000) {
            if let Err(e) = self.store.mark_sms_published(chunk).await {
                debug!(error = %e, "SMS marks not written; the relay will re-send those events");
            }
        }
    }

    /// Keeps `/readyz` honest while no purchase arrives, and flushes the
    /// SMS marks a few times a second.
    async fn probe_loop(&self, stop: CancellationToken) {
        let mut last_probe = Instant::now() - Duration::from_secs(10);
        loop {
            self.flush_sms_marks().await;
            if last_probe.elapsed() < Duration::from_secs(2) {
                tokio::select! {
                    _ = stop.cancelled() => { self.flush_sms_marks().await; return; }
                    _ = tokio::time::sleep(Duration::from_millis(250)) => {}
                }
                continue;
            }
            last_probe = Instant::now();
            let up = tokio::time::timeout(Duration::from_secs(3), self.store.ping())
                .await
                .is_ok_and(|r| r.is_ok());
            self.health.set_mongo(up);
            self.health
                .set_redis_degraded(self.engine.hot_pool().is_degraded());
        }
    }

    async fn session(
        self: Arc<Self>,
        shutdown: &CancellationToken,
    ) -> Result<SessionEnd, BrokerError> {
        let cfg = &self.config;
        let conn = codepool_broker::connect(&cfg.amqp_url, &cfg.name).await?;
        let channel = conn.create_channel().await?;
        cfg.topology.declare(&channel).await?;
        channel
            .basic_qos(cfg.prefetch, BasicQosOptions::default())
            .await?;
        let publisher = Publisher::new(&conn, cfg.topology.clone()).await?;

        // Each dispatcher hears `pool.replenished` on its own queue.
        let events = conn.create_channel().await?;
        let queue = events
            .queue_declare(
                "",
                QueueDeclareOptions {
                    exclusive: true,
                    auto_delete: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await?;
        events
            .queue_bind(
                queue.name().as_str(),
                &cfg.topology.events_exchange,
                PoolEventKind::Replenished.routing_key(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let replenished = events
            .basic_consume(
                queue.name().as_str(),
                "",
                BasicConsumeOptions {
                    no_ack: true,
                    ..BasicConsumeOptions::default()
                },
                FieldTable::default(),
            )
            .await?;

        let tag = format!("{}-{}", cfg.name, ObjectId::new().to_hex());
        let mut consumer = channel
            .basic_consume(
                &cfg.topology.purchases,
                &tag,
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        self.health.set_amqp(true);
        self.amqp.ok();
        info!(queue = %cfg.topology.purchases, prefetch = cfg.prefetch, batch = cfg.batch_size, "consuming purchases");

        let session_stop = shutdown.child_token();
        // Receipts, redemptions, expiry and stock sweeps (upkeep.rs).
        let mut upkeep = crate::upkeep::spawn(
            &conn,
            &cfg.topology,
            self.store.clone(),
            self.engine.hot_pool().clone(),
            self.stock.clone(),
            publisher.clone(),
            session_stop.clone(),
        )
        .await?;
        let sweeper = tokio::spawn(self.clone().sweep_loop(
            publisher.clone(),
            replenished,
            session_stop.clone(),
        ));

        let permits = Arc::new(Semaphore::new(cfg.workers.max(1)));
        let mut inflight = JoinSet::new();
        let end = loop {
            let first = tokio::select! {
                biased;
                _ = shutdown.cancelled() => break SessionEnd::Shutdown,
                next = consumer.next() => next,
            };
            let first = match first {
                Some(Ok(d)) => d,
                Some(Err(e)) => break SessionEnd::Lost(e.to_string()),
                None => break SessionEnd::Lost("the broker closed the consumer".into()),
            };
            let mut batch = vec![first];
            let mut lost = None;
            let deadline = tokio::time::Instant::now() + cfg.linger;
            while batch.len() < cfg.batch_size {
                match tokio::time::timeout_at(deadline, consumer.next()).await {
                    Ok(Some(Ok(d))) => batch.push(d),
                    Ok(Some(Err(e))) => {
                        lost = Some(e.to_string());
                        break;
                    }
                    Ok(None) | Err(_) => break,
                }
            }
            let permit = tokio::select! {
                p = permits.clone().acquire_owned() => p,
                _ = shutdown.cancelled() => break SessionEnd::Shutdown,
            };
            let Ok(permit) = permit else {
                break SessionEnd::Shutdown;
            };
            let this = self.clone();
            let publisher = publisher.clone();
            let stop = shutdown.clone();
            inflight.spawn(async move {
                this.process(batch, &publisher, &stop).await;
                drop(permit);
            });
            while inflight.try_join_next().is_some() {}
            if let Some(reason) = lost {
                break SessionEnd::Lost(reason);
            }
        };

        // Stop deliveries, finish what is in flight, then close: whatever
        // is still unacked goes back to the queue.
        let _ = channel
            .basic_cancel(&tag, BasicCancelOptions::default())
            .await;
        let drained = tokio::time::timeout(cfg.grace, async {
            while inflight.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            warn!("grace period over with batches in flight; their purchases will be redelivered");
            inflight.abort_all();
        }
        // Background work (sweeps, backorder fulfilment, receipts) may be
        // mid-way through a long backlog: give it a moment, then abort it.
        // Nothing is lost: an unmarked backorder or unconfirmed event is
        // picked up again by the next sweep or the relay.
        session_stop.cancel();
        let mut sweeper = sweeper;
        if tokio::time::timeout(BACKGROUND_STOP, &mut sweeper)
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
        let _ = channel.close(200, "codepool dispatcher stopping").await;
        let _ = conn.close(200, "codepool dispatcher stopping").await;
        Ok(end)
    }

    /// Periodically re-publishes unconfirmed events and fulfils backorders;
    /// also fulfils a pool's backorders as soon as it is replenished.
    async fn sweep_loop(
        self: Arc<Self>,
        publisher: Publisher,
        mut replenished: lapin::Consumer,
        stop: CancellationToken,
    ) {
        let mut tick = tokio::time::interval(self.config.sweep_every);
        loop {
            let pools: Vec<String> = tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => {
                    if let Err(e) = relay_unconfirmed(&self.store, &publisher, self.config.relay_after, 1000).await {
                        debug!(error = %e, "relay skipped");
                    }
                    match self.store.pools_with_backorders().await {
                        Ok(p) => p,
                        Err(e) => { debug!(error = %e, "backorder sweep skipped"); continue; }
                    }
                }
                ev = replenished.next() => match ev {
                    Some(Ok(d)) => match serde_json::from_slice::<PoolEvent>(&d.data) {
                        Ok(e) => vec![e.pool],
                        Err(_) => continue,
                    },
                    _ => { stop.cancelled().await; return; }
                },
            };
            for pool in pools {
                if stop.is_cancelled() {
                    return;
                }
                if let Err(e) =
                    fulfil_backorders(&self.engine, &self.store, &publisher, &pool, &stop).await
                {
                    warn!(pool, error = %e, "fulfilling backorders failed; will retry at the next sweep");
                }
            }
        }
    }

    /// A delivery's purchase, unless it is invalid or has reached the
    /// queue's delivery limit (a poison message: dead-lettered with reason
    /// `delivery_limit` before the broker would drop it without one).
    fn parse(&self, delivery: &Delivery) -> Result<Purchase, PurchaseError> {
        let topology = &self.config.topology;
        if let Some(count) = topology.over_delivery_limit(&delivery.properties) {
            return Err(PurchaseError::delivery_limit(
                count,
                topology.queues.delivery_limit,
            ));
        }
        Purchase::parse(&delivery.data)
    }

    async fn pool_exists(&self, pool: &str) -> Result<bool, codepool_store::StoreError> {
        if self.known_pools.read().await.contains(pool) {
            return Ok(true);
        }
        let exists = self.store.pool(pool).await?.is_some();
        if exists {
            self.known_pools.write().await.insert(pool.to_owned());
        }
        Ok(exists)
    }

    /// Handles one batch of deliveries end to end. Never acks a purchase
    /// before its outcome is durable and its events are confirmed.
    async fn process(
        &self,
        deliveries: Vec<Delivery>,
        publisher: &Publisher,
        stop: &CancellationToken,
    ) {
        let received = Instant::now();
        metrics::counter!("codepool_purchases_consumed_total").increment(deliveries.len() as u64);

        let mut valid: Vec<(usize, Purchase)> = Vec::new();
        let mut dead: Vec<(usize, PurchaseError)> = Vec::new();
        for (i, d) in deliveries.iter().enumerate() {
            match self.parse(d) {
                Ok(p) => valid.push((i, p)),
                Err(e) => dead.push((i, e)),
            }
        }

        // Unknown pools and the claim both need MongoDB: wait it out.
        let mut attempt = 0;
        let outcomes = loop {
            match self.check_and_claim(&mut valid, &mut dead).await {
                Ok(o) => break o,
                Err(e) => {
                    self.health.set_mongo(!e.is_unavailable());
                    if e.is_unavailable() {
                        self.mongo.failed(&e);
                    } else {
                        error!(error = %e, "claim failed; retrying");
                    }
                    attempt += 1;
                    tokio::select! {
                        _ = stop.cancelled() => return, // unacked: redelivered later
                        _ = tokio::time::sleep(backoff(attempt)) => {}
                    }
                }
            }
        };
        self.mongo.ok();
        self.health.set_mongo(true);
        self.health
            .set_redis_degraded(self.engine.hot_pool().is_degraded());

        // Purchases of empty pools become backorders (durably) before the ack.
        let exhausted: Vec<&Purchase> = valid
            .iter()
            .zip(&outcomes)
            .filter(|(_, o)| matches!(o, ClaimOutcome::Exhausted))
            .map(|((_, p), _)| p)
            .collect();
        if !exhausted.is_empty() {
            let mut attempt = 0;
            loop {
                match self.store.record_backorders(&exhausted).await {
                    Ok(n) => {
                        metrics::counter!("codepool_backorders_total").increment(n);
                        break;
                    }
                    Err(e) => {
                        self.mongo.failed(&e);
                        attempt += 1;
                        tokio::select! {
                            _ = stop.cancelled() => return,
                            _ = tokio::time::sleep(backoff(attempt)) => {}
                        }
                    }
                }
            }
            let pools: HashSet<&str> = exhausted.iter().map(|p| p.pool.as_str()).collect();
            for pool in pools {
                warn!(
                    pool,
                    "pool exhausted; purchases are backordered until codes are imported"
                );
                if let Ok(c) = publisher
                    .publish_pool_event(&PoolEvent::new(PoolEventKind::Exhausted, pool))
                    .await
                {
                    let _ = c.wait().await;
                }
            }
        }

        // Publish every event with confirms in flight together.
        let mut confirms: Vec<(usize, Option<ObjectId>, Result<PendingConfirm, BrokerError>)> =
            Vec::new();
        let mut fresh_grants = 0u64;
        let mut repeats = 0u64;
        let mut seen: HashSet<&str> = HashSet::new();
        for ((i, p), outcome) in valid.iter().zip(&outcomes) {
            if let ClaimOutcome::Granted { grant, fresh } = outcome {
                // A second delivery of the same order in this batch is a repeat.
                let is_new = *fresh && seen.insert(p.order_id.as_str());
                if is_new {
                    fresh_grants += 1;
                } else {
                    repeats += 1;
                }
                let Some(event) = grant.sms_pending() else {
                    // Refunded: the order keeps its (void) code, nothing is sent.
                    info!(order_id = %p.order_id, pool = %p.pool, "order's code was revoked; not texted again");
                    continue;
                };
                info!(order_id = %p.order_id, pool = %p.pool, code = %grant.masked_code(), grant_no = grant.grant_no.as_deref().unwrap_or(""), fresh = is_new, "granted");
                let id = ObjectId::parse_str(&grant.code_id).ok();
                confirms.push((*i, id, publisher.publish_sms_pending(&event).await));
            }
        }
        for (i, e) in &dead {
            let d = &deliveries[*i];
            warn!(reason = e.reason.as_str(), detail = %e.detail, message_id = ?d.properties.message_id(), "purchase dead-lettered");
            metrics::counter!("codepool_dead_letters_total", "reason" => e.reason.as_str())
                .increment(1);
            confirms.push((
                *i,
                None,
                publisher
                    .dead_letter(&d.data, d.properties.message_id().as_ref(), &e.to_string())
                    .await,
            ));
        }
        let mut failed: HashSet<usize> = HashSet::new();
        let mut published = Vec::new();
        for (i, id, pending) in confirms {
            let result = match pending {
                Ok(c) => c.wait().await,
                Err(e) => Err(e),
            };
            match result {
                Ok(()) => published.extend(id),
                Err(e) => {
                    debug!(error = %e, "publish not confirmed; the purchase will be redelivered");
                    failed.insert(i);
                }
            }
        }

        // Ack what is settled; requeue the rest (a redelivery re-publishes
        // the same grant's event).
        for (i, d) in deliveries.iter().enumerate() {
            let result = if failed.contains(&i) {
                d.acker
                    .nack(BasicNackOptions {
                        requeue: true,
                        ..BasicNackOptions::default()
                    })
                    .await
            } else {
                d.acker.ack(BasicAckOptions::default()).await
            };
            if let Err(e) = result {
                debug!(error = %e, "ack failed; the broker will redeliver");
            }
        }
        metrics::counter!("codepool_grants_total").increment(fresh_grants);
        metrics::counter!("codepool_duplicate_deliveries_total").increment(repeats);
        metrics::histogram!("codepool_batch_seconds").record(received.elapsed().as_secs_f64());
        metrics::histogram!("codepool_end_to_end_seconds").record_many(
            received.elapsed().as_secs_f64(),
            deliveries.len() - failed.len(),
        );

        // Take confirmed grants off the relay's list, in one write for many
        // batches; not needed for correctness, so it does not hold the ack.
        if let Ok(mut marks) = self.sms_marks.lock() {
            marks.extend(published);
        }

        // Pools that just lost stock get a (throttled) stock check (stock.rs).
        let granted_pools: HashSet<&str> = valid
            .iter()
            .zip(&outcomes)
            .filter(|(_, o)| matches!(o, ClaimOutcome::Granted { fresh: true, .. }))
            .map(|((_, p), _)| p.pool.as_str())
            .collect();
        self.stock.after_grants(granted_pools, publisher);
    }

    /// Dead-letters purchases of unknown pools, then claims for the rest.
    async fn check_and_claim(
        &self,
        valid: &mut Vec<(usize, Purchase)>,
        dead: &mut Vec<(usize, PurchaseError)>,
    ) -> Result<Vec<ClaimOutcome>, crate::ClaimError> {
        let mut known: HashMap<String, bool> = HashMap::new();
        for (_, p) in valid.iter() {
            if !known.contains_key(&p.pool) {
                let exists = self.pool_exists(&p.pool).await?;
                known.insert(p.pool.clone(), exists);
            }
        }
        let (ok, unknown): (Vec<_>, Vec<_>) = std::mem::take(valid)
            .into_iter()
            .partition(|(_, p)| known.get(&p.pool).copied().unwrap_or(false));
        *valid = ok;
        dead.extend(
            unknown
                .into_iter()
                .map(|(i, p)| (i, PurchaseError::unknown_pool(&p.pool))),
        );
        let refs: Vec<&Purchase> = valid.iter().map(|(_, p)| p).collect();
        if refs.is_empty() {
            return Ok(Vec::new());
        }
        self.engine.claim_batch(&refs).await
    }
}
