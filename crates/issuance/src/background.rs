//! The background work of a process that grants, owned in one place.
//! Both the AMQP dispatcher and the HTTP API build their services with
//! [`Parts::new`] and start this work with [`start`], on the same
//! [`Schedules`]:
//!
//! - every [`holds::SWEEP_EVERY`]: expired holds' codes back to stock,
//!   their pools' waiting orders served first;
//! - every [`Schedules::sweep_every`]: the relay (events of grants no
//!   process saw confirmed for [`Schedules::relay_after`] are sent again,
//!   same event ids), then every pool's replaced codes waiting for their
//!   new one, and its waiting backorders;
//! - every [`StockConfig::sweep_every`](crate::stock::StockConfig), at the
//!   first quiet moment ([`Activity`]): expired codes voided, and every
//!   pool's stock re-checked (gauges, `pool.low_stock`);
//! - the shops' webhook deliverer, all the time;
//! - the channels' declared stock, on change and every
//!   [`DECLARE_EVERY`](crate::channels::stock::DECLARE_EVERY)
//!   ([`crate::channels::stock::run`]);
//! - the channels' calls by outcome, written every
//!   [`FLUSH_EVERY`](crate::channels::outcomes::FLUSH_EVERY)
//!   ([`crate::channels::outcomes::run`]).
//!
//! What it publishes goes out on the process's broker connection of the
//! moment (`publishing`): the API's, replaced after an outage, or the
//! dispatcher session's. Each round runs in a span of its own (`hold_sweep`,
//! `relay_sweep`, `catalogue_sweep`) naming the `background` door.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use codepool_broker::Publisher;
use codepool_store::Store;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::claim::ClaimEngine;
use crate::health::Health;
use crate::holds;
use crate::intake::Intake;
use crate::outbox::Outbox;
use crate::ports::CandidatePool;
use crate::stock::{StockConfig, StockWatch};
use crate::webhooks::{guard::AllowHosts, Deliverer};
use crate::Door;

/// The services of a process that grants, built once from the config by
/// [`Parts::new`]: the API's [`crate::Core`] holds them with its broker
/// connection, the dispatcher holds them with its sessions.
#[derive(Clone)]
pub struct Parts {
    /// The core's own: the doors call [`crate::doors`], the composition
    /// root builds the parts from a store ([`Parts::new`]).
    pub(crate) store: Store,
    /// Placing orders: known pools, policies, the claim.
    pub intake: Arc<Intake>,
    /// SMS-pending events, and their marks.
    pub outbox: Arc<Outbox>,
    /// The hot pool (a recall, a void or expiry clears codes from it).
    pub hot: Arc<dyn CandidatePool>,
    /// Stock gauges and low-stock alerts after grants.
    pub stock: Arc<StockWatch>,
    /// Batches being placed: the catalogue sweeps wait for a quiet moment.
    pub activity: Arc<Activity>,
    /// Webhook hosts let through whatever their address
    /// (`CODEPOOL_WEBHOOK_ALLOW_HOSTS`, read once with the config).
    pub allow_hosts: AllowHosts,
    /// The operator's broker users: codepool's own and
    /// `CODEPOOL_OPERATOR_BROKER_USERS` (read once with the config). Only
    /// they publish purchases of no shop over AMQP, and only their
    /// messages carry a dead letter's or a replay's record of its publisher.
    pub operator_broker_users: Arc<[String]>,
    /// Declares the channels' stock to their marketplaces.
    pub declarer: Arc<crate::channels::stock::Declarer>,
    /// Kinguin's bearer tokens, shared by the declarer and the uploader.
    pub kinguin_tokens: Arc<crate::channels::kinguin::client::Tokens>,
    /// The channels' calls by outcome, written every few seconds.
    pub outcomes: Arc<crate::channels::outcomes::Counter>,
}

impl Parts {
    pub fn new(
        store: Store,
        engine: ClaimEngine,
        hot: Arc<dyn CandidatePool>,
        allow_hosts: AllowHosts,
        operator_broker_users: Vec<String>,
    ) -> Self {
        let kinguin_tokens = Arc::new(crate::channels::kinguin::client::Tokens::default());
        Self {
            operator_broker_users: operator_broker_users.into(),
            intake: Arc::new(Intake::new(store.clone(), engine)),
            outbox: Arc::new(Outbox::new(Arc::new(store.clone()))),
            stock: StockWatch::new(store.clone(), StockConfig::granting()),
            declarer: crate::channels::stock::Declarer::new(store.clone(), kinguin_tokens.clone()),
            kinguin_tokens,
            outcomes: Arc::default(),
            store,
            hot,
            activity: Arc::default(),
            allow_hosts,
        }
    }
}

/// How often the background work runs. The defaults are every granting
/// process's; a test may shorten them.
#[derive(Debug, Clone, Copy)]
pub struct Schedules {
    /// The relay and the backorder sweep.
    pub sweep_every: Duration,
    /// A grant whose event is unconfirmed for this long is sent again.
    pub relay_after: Duration,
}

impl Default for Schedules {
    fn default() -> Self {
        Self {
            sweep_every: Duration::from_secs(10),
            relay_after: Duration::from_secs(30),
        }
    }
}

/// The broker publisher in use now (`None`: not connected; the work that
/// publishes waits for its next round).
pub type Publishing = Arc<dyn Fn() -> Option<Publisher> + Send + Sync>;

/// `publisher` if its channel is open: work that claims codes for waiting
/// orders does not start on a connection that cannot carry their events.
pub fn connected(publisher: Publisher) -> Option<Publisher> {
    publisher
        .channel()
        .status()
        .connected()
        .then_some(publisher)
}

/// Starts the background work (see the module doc) until `stop`. Await
/// the set after cancelling `stop`.
pub fn start(
    parts: &Parts,
    publishing: Publishing,
    health: Arc<Health>,
    schedules: Schedules,
    stop: CancellationToken,
) -> JoinSet<()> {
    let mut tasks = JoinSet::new();
    tasks.spawn(hold_sweep(parts.clone(), publishing.clone(), stop.clone()));
    tasks.spawn(relay_and_backorders(
        parts.clone(),
        publishing.clone(),
        health,
        schedules,
        stop.clone(),
    ));
    tasks.spawn(catalogue_sweep(parts.clone(), publishing, stop.clone()));
    tasks.spawn(crate::channels::stock::run(
        parts.declarer.clone(),
        crate::channels::stock::DECLARE_EVERY,
        stop.clone(),
    ));
    tasks.spawn(crate::channels::outcomes::run(
        parts.outcomes.clone(),
        parts.store.clone(),
        stop.clone(),
    ));
    let deliverer = Deliverer::new(parts.store.clone(), parts.allow_hosts.clone());
    tasks.spawn(deliverer.run(stop));
    tasks
}

/// Serves the waiting backorders of `pools` (oldest first), until `stop`.
pub async fn fulfil(
    parts: &Parts,
    publisher: &Publisher,
    pools: impl IntoIterator<Item = String>,
    stop: &CancellationToken,
) {
    for pool in pools {
        if stop.is_cancelled() {
            return;
        }
        let served = crate::backorders::fulfil_backorders(
            parts.intake.engine(),
            &parts.store,
            &parts.outbox,
            publisher,
            &pool,
            stop,
        );
        if let Err(e) = served.await {
            warn!(pool, error = %e, "fulfilling backorders failed; will retry at the next sweep");
        }
    }
}

/// Every [`holds::SWEEP_EVERY`]: expired holds' codes back to stock, their
/// pools' backorders served with them before anyone else takes them.
async fn hold_sweep(parts: Parts, publishing: Publishing, stop: CancellationToken) {
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(holds::SWEEP_EVERY) => {}
        }
        sweep_holds(&parts, &publishing, &stop).await;
    }
}

/// One round of [`hold_sweep`], in a `hold_sweep` span.
#[tracing::instrument(name = "hold_sweep", skip_all, fields(door = Door::Background.as_str()))]
async fn sweep_holds(parts: &Parts, publishing: &Publishing, stop: &CancellationToken) {
    let returned: BTreeSet<String> = match holds::expire_due(&parts.intake).await {
        Ok(pools) => pools,
        Err(e) => {
            debug!(error = %e, "hold sweep skipped; retried in {:?}", holds::SWEEP_EVERY);
            return;
        }
    };
    if returned.is_empty() {
        return;
    }
    // Nothing is claimed while the key file lacks a key codes are sealed
    // with (the relay's round says so in /readyz).
    if !matches!(parts.intake.keys().ensure(&parts.store).await, Ok(Ok(()))) {
        return;
    }
    if let Some(publisher) = publishing() {
        fulfil(parts, &publisher, returned, stop).await;
    }
}

/// Every `sweep_every`: the relay, then the pools with backorders
/// waiting (nothing is claimed while the key file lacks a key codes are
/// sealed with; `/readyz` says so).
async fn relay_and_backorders(
    parts: Parts,
    publishing: Publishing,
    health: Arc<Health>,
    schedules: Schedules,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(schedules.sweep_every);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        if let Some(publisher) = publishing() {
            relay_round(&parts, &publisher, &health, schedules, &stop).await;
        }
    }
}

/// One round of [`relay_and_backorders`], in a `relay_sweep` span.
#[tracing::instrument(name = "relay_sweep", skip_all, fields(door = Door::Background.as_str()))]
async fn relay_round(
    parts: &Parts,
    publisher: &Publisher,
    health: &Health,
    schedules: Schedules,
    stop: &CancellationToken,
) {
    let relayed = crate::relay::relay_unconfirmed(
        &parts.store,
        &parts.outbox,
        publisher,
        schedules.relay_after,
        1000,
    );
    if let Err(e) = relayed.await {
        debug!(error = %e, "relay skipped; retried at the next sweep");
    }
    match parts.intake.keys().ensure(&parts.store).await {
        Ok(Ok(())) => health.set_keys_missing(false),
        Ok(Err(_)) => {
            health.set_keys_missing(true);
            return;
        }
        Err(e) => {
            debug!(error = %e, "key check skipped; retried at the next sweep");
            return;
        }
    }
    let pools = match parts.store.pools_with_backorders().await {
        Ok(p) => p,
        Err(e) => {
            debug!(error = %e, "backorder sweep skipped; retried at the next sweep");
            return;
        }
    };
    crate::telemetry::record_backorders_waiting(&pools);
    // Replaced codes waiting for their new one are served first.
    let mut serve: BTreeSet<String> = pools.into_iter().collect();
    match parts.store.pools_with_replacements().await {
        Ok(p) => serve.extend(p),
        Err(e) => debug!(error = %e, "waiting replacements skipped; retried at the next sweep"),
    }
    fulfil(parts, publisher, serve, stop).await;
}

/// Every [`StockConfig::sweep_every`]: void expired codes, then re-check
/// every pool's stock (gauges, alerts, re-arming after imports). Both read
/// the whole catalogue, so a sweep first waits for a quiet moment
/// ([`quiet`]): at a start with purchases queued, the backlog is served
/// before the catalogue is counted.
async fn catalogue_sweep(parts: Parts, publishing: Publishing, stop: CancellationToken) {
    let every = parts.stock.config().sweep_every;
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = quiet(&parts.activity, every) => {}
        }
        sweep_catalogue(&parts, &publishing).await;
    }
}

/// One round of [`catalogue_sweep`], in a `catalogue_sweep` span.
#[tracing::instrument(name = "catalogue_sweep", skip_all, fields(door = Door::Background.as_str()))]
async fn sweep_catalogue(parts: &Parts, publishing: &Publishing) {
    if let Err(e) = crate::expiry::expire_codes(&parts.store, parts.hot.as_ref(), None).await {
        debug!(error = %e, "expiry sweep skipped");
    }
    let Some(publisher) = publishing() else {
        return;
    };
    if let Err(e) = parts.stock.check_all(&publisher).await {
        debug!(error = %e, "stock sweep skipped");
    }
}

/// Whether the process is placing orders: the batches underway, and when
/// the last one ended. Every door's batches count.
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
    pub fn batch(self: &Arc<Self>) -> BatchUnderway {
        if let Ok(mut s) = self.state.lock() {
            s.underway += 1;
        }
        BatchUnderway(self.clone())
    }

    /// When the process will have been quiet for [`QUIET`], counting from
    /// `since` at the earliest; `None` while a batch is underway.
    fn quiet_at(&self, since: Instant) -> Option<Instant> {
        let s = self.state.lock().ok()?;
        (s.underway == 0).then(|| s.last_end.map_or(since, |t| t.max(since)) + QUIET)
    }
}

/// See [`Activity::batch`].
pub struct BatchUnderway(Arc<Activity>);

impl Drop for BatchUnderway {
    fn drop(&mut self) {
        if let Ok(mut s) = self.0.state.lock() {
            s.underway = s.underway.saturating_sub(1);
            s.last_end = Some(Instant::now());
        }
    }
}

/// How long no batch may have been underway for a sweep to start: longer
/// than a session takes to receive its first purchases, and than the gap
/// between two batches of a backlog.
const QUIET: Duration = Duration::from_secs(1);

/// How often a sweep waiting on a batch underway looks again.
const LOOK_AGAIN: Duration = Duration::from_millis(50);

/// Returns once no batch has been underway for [`QUIET`] (counted from
/// now at the earliest), or after `most` whatever the load, so steady
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
