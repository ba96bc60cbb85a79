//! The dispatcher daemon: its configuration, its state, and its life —
//! reconnect after broker outages, keep `/readyz` honest, stop gracefully.
//! One broker connection's work is a [`crate::session`]; one batch of
//! purchases is carried out by [`crate::batch`].

use std::sync::Arc;
use std::time::Duration;

use codepool_broker::{BrokerError, Topology};
use codepool_issuance::background::Parts;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info};

use codepool_issuance::health::Health;
use codepool_issuance::outage::{Outage, Retry};

/// How often a broker set-up that retrying cannot fix is checked again.
const PERMANENT_RETRY: Duration = Duration::from_secs(60);

/// How the daemon runs. Defaults suit one dispatcher on a small machine;
/// the CLI's defaults are these constants, written once.
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
    /// Most time a batch waits for more purchases once its first arrived
    /// (only while it is filling fast or other batches are in flight).
    pub linger: Duration,
    /// Time allowed to finish in-flight batches after a stop signal.
    pub grace: Duration,
    /// How often the background work runs (the same in every process
    /// that grants).
    pub schedules: codepool_issuance::background::Schedules,
    /// Connection name shown in RabbitMQ.
    pub name: String,
    /// Broker users whose `code.redeemed` events are applied (RabbitMQ
    /// validates a message's `user_id` against the user that published
    /// it). Empty: every redemption event is refused.
    pub redeemers: Vec<String>,
    /// With partitions: the ones this dispatcher subscribes to first, and
    /// how long it waits before standing by for the others.
    pub standby: codepool_broker::Standby,
}

impl DispatcherConfig {
    pub const DEFAULT_PREFETCH: u16 = 1024;
    pub const DEFAULT_BATCH_SIZE: usize = 256;
    /// Two batches in flight: one claiming while the other publishes, and
    /// the next gathering meanwhile until one of them finishes. Four gave
    /// the same maximum throughput on 2 cores, but at moderate load split
    /// the purchases into twice as many batches of two or three, each
    /// paying a journaled write, a read and the wake-ups of every server:
    /// at 1,000 purchases/s mongod used 25% more CPU and the dispatcher
    /// 20% more (`codepool-bench latency`, alternating runs).
    pub const DEFAULT_WORKERS: usize = 2;
    /// Long enough for a batch that waits on one in flight to be released
    /// by it finishing (6 to 10 ms at 1,000/s on 2 cores), not by the clock.
    pub const DEFAULT_LINGER_MS: u64 = 8;
    pub const DEFAULT_AMQP_URL: &'static str = "amqp://guest:guest@127.0.0.1:5672/%2f";
    /// With preferred partitions: how long a dispatcher waits before it
    /// subscribes to the others, long enough for dispatchers started
    /// together to take their own first.
    pub const DEFAULT_STANDBY_SECS: u64 = 5;
}

impl Default for DispatcherConfig {
    fn default() -> Self {
        Self {
            amqp_url: Self::DEFAULT_AMQP_URL.into(),
            topology: Topology::default(),
            prefetch: Self::DEFAULT_PREFETCH,
            batch_size: Self::DEFAULT_BATCH_SIZE,
            workers: Self::DEFAULT_WORKERS,
            linger: Duration::from_millis(Self::DEFAULT_LINGER_MS),
            grace: Duration::from_secs(7),
            schedules: Default::default(),
            name: format!("codepool-dispatch-{}", std::process::id()),
            redeemers: Vec::new(),
            standby: codepool_broker::Standby {
                prefer: Vec::new(),
                after: Duration::from_secs(Self::DEFAULT_STANDBY_SECS),
            },
        }
    }
}

/// How long the background work gets to finish after a stop (a webhook
/// attempt in flight; what it leaves is leased again by any process).
const BACKGROUND_GRACE: Duration = Duration::from_secs(2);

/// Stops the background work (its token is cancelled), waiting a moment.
async fn stop_background(tasks: &mut tokio::task::JoinSet<()>) {
    let done = tokio::time::timeout(BACKGROUND_GRACE, async {
        while tasks.join_next().await.is_some() {}
    });
    if done.await.is_err() {
        tasks.abort_all();
    }
}

/// Why a session ended (a session is one broker connection; see
/// `session.rs`, which adds the session's methods to [`Dispatcher`]).
pub(crate) enum SessionEnd {
    Shutdown,
    Lost(String),
    /// The key file lacks a key codes are sealed with: consuming stopped,
    /// and what was taken went back to the queue for other dispatchers.
    KeysMissing,
}

/// The daemon. Stateless: run as many as needed on one queue, or on the
/// same partitions.
pub struct Dispatcher {
    /// The services every granting process builds the same way
    /// ([`Parts::new`]): the store, the intake that decides batches
    /// (shared with the HTTP door's core), the outbox, the hot pool, the
    /// stock watch, and the activity the background sweeps wait on.
    pub(crate) parts: Parts,
    pub(crate) config: DispatcherConfig,
    pub(crate) health: Arc<Health>,
    pub(crate) mongo: Outage,
    pub(crate) amqp: Outage,
    /// The publisher of the session in progress (`None` between
    /// sessions), which the background work publishes on.
    publisher: Arc<std::sync::RwLock<Option<codepool_broker::Publisher>>>,
}

impl Dispatcher {
    pub fn new(parts: Parts, config: DispatcherConfig, health: Arc<Health>) -> Arc<Self> {
        Arc::new(Self {
            parts,
            config,
            health,
            mongo: Outage::new("MongoDB"),
            amqp: Outage::new("RabbitMQ"),
            publisher: Arc::default(),
        })
    }

    /// Puts the session's publisher in use for the background work, or
    /// none between sessions.
    pub(crate) fn set_publisher(&self, publisher: Option<codepool_broker::Publisher>) {
        *self.publisher.write().unwrap_or_else(|e| e.into_inner()) = publisher;
    }

    /// The background work every granting process runs
    /// ([`codepool_issuance::background::start`]), for the daemon's whole
    /// life: webhooks are delivered and expired holds returned while the
    /// broker is away too; what needs the broker waits for a session.
    fn start_granting_work(&self, stop: CancellationToken) -> tokio::task::JoinSet<()> {
        let slot = self.publisher.clone();
        let mut work = codepool_issuance::background::start(
            &self.parts,
            Arc::new(move || {
                let current = slot.read().unwrap_or_else(|e| e.into_inner()).clone();
                current.and_then(codepool_issuance::background::connected)
            }),
            self.health.clone(),
            self.config.schedules,
            stop.clone(),
        );
        // Kinguin's committed keys are uploaded from here too.
        let uploader = codepool_issuance::channels::kinguin::Uploader::sending(
            &self.parts,
            codepool_issuance::channels::kinguin::CALL_TIMEOUT,
        );
        work.spawn(uploader.run(stop));
        work
    }

    pub fn health(&self) -> &Arc<Health> {
        &self.health
    }

    /// Runs until `shutdown` is cancelled, reconnecting to RabbitMQ as often
    /// as needed. Returns once in-flight work is drained (or the grace
    /// period is over: what is left unacked is redelivered later). Fails
    /// only when RabbitMQ refuses who we are (the user or password):
    /// retrying cannot help.
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) -> Result<(), BrokerError> {
        let mut retry = Retry::new();
        let probe_stop = shutdown.child_token();
        let prober = tokio::spawn({
            let (this, stop) = (self.clone(), probe_stop.clone());
            async move { this.probe_loop(stop).await }
        });
        let mut background = self.start_granting_work(probe_stop.clone());
        loop {
            match self.clone().session(&shutdown).await {
                Ok(SessionEnd::Shutdown) => break,
                Ok(SessionEnd::KeysMissing) => {
                    // Unready and not consuming until the key file holds
                    // every key; checked again every few seconds.
                    if !self.wait_for_keys(&shutdown).await {
                        break;
                    }
                    retry.reset();
                    continue;
                }
                Ok(SessionEnd::Lost(reason)) => {
                    self.health.set_amqp(false);
                    self.amqp.failed(&reason);
                    retry.reset();
                }
                Err(e) if e.is_fatal() => {
                    self.health.set_amqp(false);
                    probe_stop.cancel();
                    let _ = prober.await;
                    stop_background(&mut background).await;
                    return Err(e);
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
                }
            }
            if shutdown.is_cancelled() {
                break;
            }
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(retry.delay()) => {}
            }
        }
        probe_stop.cancel();
        let _ = prober.await;
        stop_background(&mut background).await;
        info!("dispatcher stopped");
        Ok(())
    }

    /// Waits, unready, until the key file holds every key codes are sealed
    /// with (see [`crate::keywatch`]). False when stopped first.
    async fn wait_for_keys(&self, shutdown: &CancellationToken) -> bool {
        loop {
            self.health.set_keys_missing(true);
            tokio::select! {
                _ = shutdown.cancelled() => return false,
                _ = tokio::time::sleep(codepool_issuance::keywatch::RECHECK) => {}
            }
            if let Err(e) = self.parts.refresh_keys().await {
                debug!(error = %e, "key registry not read; trying again");
                continue;
            }
            if self.parts.intake.keys().missing().is_empty() {
                self.health.set_keys_missing(false);
                return true;
            }
        }
    }

    /// Keeps `/readyz` honest while no purchase arrives: probes MongoDB
    /// every 2 seconds.
    async fn probe_loop(&self, stop: CancellationToken) {
        loop {
            if self.parts.refresh_keys().await.is_ok() {
                self.health
                    .set_keys_missing(!self.parts.intake.keys().missing().is_empty());
            }
            let up = tokio::time::timeout(Duration::from_secs(3), self.parts.ping())
                .await
                .is_ok_and(|r| r.is_ok());
            self.health.set_mongo(up);
            self.health
                .set_redis_degraded(self.parts.intake.engine().is_degraded());
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(Duration::from_secs(2)) => {}
            }
        }
    }
}
