//! Delivering webhooks, at least once. Every process that grants runs a
//! [`Deliverer`]: it stages flagged grants into events, leases due tasks
//! (one process per task at a time: a lease outlasts an attempt's
//! timeout), signs and posts each, records the attempt and schedules the
//! next. A process killed mid-delivery leaves its lease to run out; the
//! task is then due for whoever leases it next, with the same
//! `webhook-id`.
//!
//! Fair between endpoints: each round leases by turns, one endpoint after
//! another (not the oldest tasks of all endpoints), and an endpoint has at
//! most its share of the attempts in flight ([`share`]). An attempt not
//! answered within [`SLOW`] gives its slot back and waits on its
//! endpoint's share alone, so a slow or dead receiver holds up its own
//! deliveries and nobody else's.

use std::sync::Arc;
use std::time::{Duration, Instant};

use std::collections::HashMap;
use std::sync::Mutex;

use codepool_store::webhooks::{AttemptDoc, EndpointDoc, Event, Head, Outcome, TaskDoc, TaskEnd};
use codepool_store::{Store, StoreError};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::guard::{self, AllowHosts, GuardedResolver};
use super::sign;

/// When each attempt is made, after the one before: at once, then 5 s,
/// 5 min, 30 min, 2 h, 5 h, 10 h and 10 h.
pub const SCHEDULE: [Duration; 8] = [
    Duration::ZERO,
    Duration::from_secs(5),
    Duration::from_secs(5 * 60),
    Duration::from_secs(30 * 60),
    Duration::from_secs(2 * 3600),
    Duration::from_secs(5 * 3600),
    Duration::from_secs(10 * 3600),
    Duration::from_secs(10 * 3600),
];

/// How long one attempt may take.
pub const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(15);

/// How long a leased task is one process's: longer than an attempt and
/// its record. A process killed mid-attempt leaves the task to the next
/// process after this.
const LEASE: Duration = Duration::from_secs(20);

/// An endpoint failing this long (no delivery in between) is disabled.
pub const DISABLE_AFTER: chrono::Duration = chrono::Duration::days(5);

/// How much of an answer an attempt record keeps.
pub const RESPONSE_KEPT: usize = 1024;

/// Attempts in flight at once per process (answers coming back).
const IN_FLIGHT: usize = 16;

/// An attempt not answered within this gives its slot back to the other
/// endpoints and waits on its endpoint's share alone.
pub const SLOW: Duration = Duration::from_millis(500);

/// Attempts waiting on slow receivers at once per process; past this a
/// slow attempt keeps its slot.
const WAITING: usize = 64;

/// How many attempts one endpoint may have in flight in this process when
/// `most` may be in flight in all: a quarter of them (one while granting,
/// with 2), and one while the endpoint is failing, whatever the slots.
pub fn share(most: usize, failing: bool) -> usize {
    if failing {
        1
    } else {
        (most / 4).max(1)
    }
}

/// Grant flags staged per round.
const STAGE_LIMIT: i64 = 100;

/// How long an opened event is kept, and how many at most.
const EVENT_CACHED_FOR: Duration = Duration::from_secs(60);
const EVENTS_CACHED: usize = 10_000;

/// How often an idle deliverer looks for work.
const IDLE: Duration = Duration::from_millis(200);

/// Grants come first: while this process is granting (a code issued in
/// the last [`BUSY_FOR`]), webhooks go at a trickle — this many
/// attempts in flight, and staging at most every [`BUSY_STAGE_EVERY`], this
/// many grants at a time — and catch up when granting pauses. Nothing is
/// lost meanwhile: the flags and tasks wait in MongoDB.
const BUSY_IN_FLIGHT: usize = 2;
const BUSY_STAGE_LIMIT: i64 = 10;
const BUSY_STAGE_EVERY: Duration = Duration::from_secs(1);

/// How long after its last grant a process counts as granting.
const BUSY_FOR: Duration = Duration::from_secs(1);

/// How long a deliverer with every attempt slot taken waits to look again.
const FULL: Duration = Duration::from_millis(5);

/// Whether this process is granting, and when it may stage next.
struct Pace {
    issued: u64,
    granted_at: Instant,
    staged_at: Instant,
}

impl Pace {
    fn new() -> Self {
        Self {
            issued: crate::telemetry::issued_codes(),
            // A process that just started is likely draining a backlog: it
            // counts as granting until it has seen a quiet [`BUSY_FOR`].
            granted_at: Instant::now(),
            staged_at: Instant::now() - BUSY_STAGE_EVERY,
        }
    }

    /// A code issued in the last [`BUSY_FOR`].
    fn busy(&mut self) -> bool {
        let issued = crate::telemetry::issued_codes();
        if issued != self.issued {
            self.issued = issued;
            self.granted_at = Instant::now();
        }
        self.granted_at.elapsed() < BUSY_FOR
    }

    /// How many grants to stage now: none while tasks are still due, a
    /// few at most every [`BUSY_STAGE_EVERY`] while granting.
    fn stage_limit(&self, busy: bool, nothing_due: bool) -> i64 {
        match (busy, nothing_due) {
            (_, false) => 0,
            (false, true) => STAGE_LIMIT,
            (true, true) if self.staged_at.elapsed() >= BUSY_STAGE_EVERY => BUSY_STAGE_LIMIT,
            (true, true) => 0,
        }
    }

    /// `n` grants were staged, of at most `limit`: a full stage (a burst
    /// of grants) makes the next wait [`BUSY_STAGE_EVERY`] while granting.
    /// One that found fewer left nothing behind, so the next grant (another
    /// shop's, say) is staged at once.
    fn staged(&mut self, n: usize, limit: i64) {
        if n as i64 >= limit {
            self.staged_at = Instant::now();
        }
    }
}

/// See the module documentation.
pub struct Deliverer {
    store: Store,
    client: reqwest::Client,
    allow: AllowHosts,
    /// This process, in leases and attempt records.
    me: String,
    slots: Arc<Semaphore>,
    /// Attempts that gave their slot back ([`SLOW`]).
    waiting: Arc<Semaphore>,
    /// Attempts in flight per endpoint.
    flying: Mutex<HashMap<String, usize>>,
    /// The endpoint the last round leased for last: the next round starts
    /// after it.
    turn: Mutex<String>,
    /// Lease batches taken, for each batch's token.
    leases: std::sync::atomic::AtomicU64,
    events: Mutex<HashMap<String, (Instant, Arc<Event>)>>,
}

/// An endpoint and the secrets that sign for it now.
type Signing = (EndpointDoc, Vec<String>);

/// One attempt in flight for an endpoint, counted in
/// [`Deliverer::flying`] until it is dropped.
struct Flight {
    deliverer: Arc<Deliverer>,
    endpoint: String,
}

impl Flight {
    fn start(deliverer: &Arc<Deliverer>, endpoint: &str) -> Self {
        *deliverer
            .flying
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(endpoint.to_owned())
            .or_default() += 1;
        Self {
            deliverer: deliverer.clone(),
            endpoint: endpoint.to_owned(),
        }
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        let mut flying = self
            .deliverer
            .flying
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(n) = flying.get_mut(&self.endpoint) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                flying.remove(&self.endpoint);
            }
        }
    }
}

/// What one attempt came to.
struct Verdict {
    outcome: Outcome,
    status: Option<u32>,
    response: String,
}

impl Deliverer {
    pub fn new(store: Store, allow: AllowHosts) -> Arc<Self> {
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .timeout(ATTEMPT_TIMEOUT)
            .connect_timeout(Duration::from_secs(10))
            .user_agent(concat!("codepool-webhooks/", env!("CARGO_PKG_VERSION")))
            .dns_resolver(Arc::new(GuardedResolver {
                allow: allow.clone(),
            }))
            .build()
            .expect("the webhook HTTP client builds (rustls, no system settings read)");
        let me = format!(
            "{}:{}:{}",
            crate::audit::host(),
            std::process::id(),
            hex::encode(rand::random::<[u8; 4]>())
        );
        Arc::new(Self {
            store,
            client,
            allow,
            me,
            slots: Arc::new(Semaphore::new(IN_FLIGHT)),
            waiting: Arc::new(Semaphore::new(WAITING)),
            flying: Mutex::new(HashMap::new()),
            turn: Mutex::new(String::new()),
            leases: std::sync::atomic::AtomicU64::new(0),
            events: Mutex::new(HashMap::new()),
        })
    }

    /// Stages and delivers until `stop`; attempts in flight then finish
    /// (each within [`ATTEMPT_TIMEOUT`]).
    pub async fn run(self: Arc<Self>, stop: CancellationToken) {
        let mut last_gauge = Instant::now() - Duration::from_secs(60);
        let mut pace = Pace::new();
        while !stop.is_cancelled() {
            let busy = pace.busy();
            let most = if busy { BUSY_IN_FLIGHT } else { IN_FLIGHT };
            let room = most.saturating_sub(IN_FLIGHT - self.slots.available_permits());
            // Leased in batches of at least half the slots: a lease costs
            // three round trips however many it takes.
            let batch = room >= most.div_ceil(2);
            let leased = match batch {
                false => 0,
                true => self.deliver_due(room, most).await,
            };
            // Staged only once what is due is delivered: events wait as
            // flags rather than as tasks nobody can take yet.
            let limit = pace.stage_limit(busy, batch && leased < room);
            let staged = match limit {
                0 => 0,
                limit => super::stage_grants(&self.store, limit)
                    .await
                    .unwrap_or_else(|e| {
                        debug!(error = %e, "webhook staging waits for MongoDB");
                        0
                    }),
            };
            if limit > 0 {
                pace.staged(staged, limit);
            }
            if last_gauge.elapsed() >= Duration::from_secs(5) {
                last_gauge = Instant::now();
                self.gauge_oldest().await;
            }
            // Granting, or nothing to do: look again later. Every slot
            // taken: as soon as half are free again.
            let wait = if busy || (batch && leased == 0 && staged == 0) {
                IDLE
            } else if !batch {
                FULL
            } else {
                continue;
            };
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = tokio::time::sleep(wait) => {}
            }
        }
        let _ = tokio::time::timeout(ATTEMPT_TIMEOUT + Duration::from_secs(1), async {
            let _ = self.slots.acquire_many(IN_FLIGHT as u32).await;
            let _ = self.waiting.acquire_many(WAITING as u32).await;
        })
        .await;
    }

    /// Leases up to `room` due tasks, in one batch, by turns between the
    /// endpoints, each within its share of `most` ([`share`]), and starts
    /// their attempts. Returns how many it leased.
    pub async fn deliver_due(self: &Arc<Self>, room: usize, most: usize) -> usize {
        let token = format!(
            "{}:{}",
            self.me,
            self.leases
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let heads = match self.store.webhook_heads().await {
            Ok(h) => h,
            Err(e) => {
                debug!(error = %e, "webhook tasks wait for MongoDB");
                return 0;
            }
        };
        let open = self.open_endpoints(heads, room, most);
        if open.is_empty() {
            return 0;
        }
        let ids: Vec<&str> = open.iter().map(|h| h.endpoint.as_str()).collect();
        // Read when the batch is leased: a rotation, a disable or an
        // enable just before holds for it.
        let endpoints = match self.endpoints_of(&ids).await {
            Ok(e) => e,
            Err(e) => {
                debug!(error = %e, "webhook endpoints wait for MongoDB");
                return 0;
            }
        };
        let wants = self.by_turns(&open, &endpoints, room, most);
        // The next round goes on after the endpoints this one looked at,
        // leased or not.
        if let Some(last) = open.last() {
            *self.turn.lock().unwrap_or_else(|e| e.into_inner()) = last.endpoint.clone();
        }
        let tasks = match self
            .store
            .lease_webhook_tasks(&token, LEASE.as_millis() as i64, &wants)
            .await
        {
            Ok(t) => t,
            Err(e) => {
                debug!(error = %e, "webhook tasks wait for MongoDB");
                return 0;
            }
        };
        let leased = tasks.len();
        for task in tasks {
            // Leased within `room`: a permit is free for each.
            let Ok(permit) = self.slots.clone().acquire_owned().await else {
                break;
            };
            let endpoint = endpoints.get(&task.endpoint).cloned();
            self.launch(task, endpoint, permit);
        }
        leased
    }

    /// Makes the attempt of a leased task in the background, in flight for
    /// its endpoint until it ends. Not answered within [`SLOW`], it gives
    /// `slot` back to the other endpoints while it waits (if there is room
    /// to wait).
    fn launch(
        self: &Arc<Self>,
        task: TaskDoc,
        endpoint: Option<Arc<Signing>>,
        slot: tokio::sync::OwnedSemaphorePermit,
    ) {
        let flight = Flight::start(self, &task.endpoint);
        let me = self.clone();
        tokio::spawn(async move {
            let work = me.attempt(&task, endpoint);
            tokio::pin!(work);
            let mut slot = Some(slot);
            let mut waiting = None;
            let done = tokio::select! {
                done = &mut work => done,
                () = tokio::time::sleep(SLOW) => {
                    if let Ok(w) = me.waiting.clone().try_acquire_owned() {
                        waiting = Some(w);
                        slot = None;
                    }
                    work.await
                }
            };
            if let Err(e) = done {
                // The lease runs out and the task is due again.
                warn!(task = %task.id, error = %e, "webhook attempt not recorded; it will be made again");
            }
            drop((slot, waiting, flight));
        });
    }

    /// The endpoints with a task due that may have one more attempt in
    /// flight here (within the most a share of `most` can be), starting
    /// after the one the last round ended with, at most `room` of them.
    fn open_endpoints(&self, heads: Vec<Head>, room: usize, most: usize) -> Vec<Head> {
        let now = bson::DateTime::now();
        let after = self.turn.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let flying = self.flying.lock().unwrap_or_else(|e| e.into_inner());
        // Heads come in endpoint order: the turn goes on from `after`.
        let (before, from) = heads
            .into_iter()
            .filter(|h| h.next_at <= now)
            .filter(|h| flying.get(&h.endpoint).copied().unwrap_or(0) < share(most, false))
            .partition::<Vec<Head>, _>(|h| h.endpoint <= after);
        from.into_iter().chain(before).take(room).collect()
    }

    /// How many tasks to lease of each endpoint of `open` (in turn order):
    /// one each by turns, again while room is left, each up to its share.
    /// A failing endpoint gets one attempt at a time, and none while
    /// another process is trying it.
    fn by_turns<'a>(
        &self,
        open: &'a [Head],
        endpoints: &HashMap<String, Arc<Signing>>,
        room: usize,
        most: usize,
    ) -> Vec<(&'a str, i64)> {
        let now = bson::DateTime::now();
        let flying = self.flying.lock().unwrap_or_else(|e| e.into_inner());
        let left: Vec<usize> = open
            .iter()
            .map(|h| {
                let failing = endpoints
                    .get(&h.endpoint)
                    .is_some_and(|e| e.0.failing_since.is_some());
                let busy = flying.get(&h.endpoint).copied().unwrap_or(0);
                if failing && h.lease_until > now {
                    0
                } else {
                    share(most, failing).saturating_sub(busy)
                }
            })
            .collect();
        let wants = allot(left, room);
        open.iter()
            .zip(wants)
            .filter(|(_, n)| *n > 0)
            .map(|(h, n)| (h.endpoint.as_str(), n as i64))
            .collect()
    }

    /// The endpoints named and the secrets that sign for them, in one
    /// query.
    async fn endpoints_of(
        &self,
        ids: &[&str],
    ) -> Result<HashMap<String, Arc<Signing>>, StoreError> {
        let mut out = HashMap::with_capacity(ids.len());
        for endpoint in self.store.webhook_endpoints_named(ids).await? {
            let secrets = self.store.open_webhook_secrets(&endpoint)?;
            out.insert(endpoint.id.clone(), Arc::new((endpoint, secrets)));
        }
        Ok(out)
    }

    /// An event, its body opened, kept a while: every endpoint of the
    /// shop delivers the same one.
    async fn event(&self, id: &str) -> Result<Option<Arc<Event>>, StoreError> {
        if let Some((_, e)) = self
            .events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(id)
        {
            return Ok(Some(e.clone()));
        }
        let Some(event) = self.store.webhook_event(id).await? else {
            return Ok(None);
        };
        let e = Arc::new(event);
        let mut cache = self.events.lock().unwrap_or_else(|e| e.into_inner());
        if cache.len() >= EVENTS_CACHED {
            cache.retain(|_, (at, _)| at.elapsed() < EVENT_CACHED_FOR);
            if cache.len() >= EVENTS_CACHED {
                cache.clear();
            }
        }
        cache.insert(id.to_owned(), (Instant::now(), e.clone()));
        Ok(Some(e))
    }

    async fn gauge_oldest(&self) {
        if let Ok(oldest) = self.store.oldest_undelivered_webhook().await {
            let age = oldest.map_or(0.0, |t| {
                (chrono::Utc::now() - t.to_chrono())
                    .num_milliseconds()
                    .max(0) as f64
                    / 1000.0
            });
            metrics::gauge!("codepool_webhook_oldest_undelivered_seconds").set(age);
        }
    }

    /// One attempt of one leased task, recorded, in a `webhook_attempt`
    /// span naming the shop, the event, its kind, the endpoint and the
    /// attempt's number.
    #[tracing::instrument(
        name = "webhook_attempt",
        skip_all,
        fields(
            door = crate::Door::Background.as_str(),
            shop = %task.shop,
            kind = %task.kind,
            event = %task.event,
            endpoint = %task.endpoint,
            attempt = task.attempts + 1,
        )
    )]
    async fn attempt(
        &self,
        task: &TaskDoc,
        endpoint: Option<Arc<Signing>>,
    ) -> Result<(), StoreError> {
        let Some(cached) = endpoint else {
            return self
                .end(
                    task,
                    TaskEnd::Failed,
                    verdict(Outcome::Failed, None, "the endpoint was removed"),
                    0,
                )
                .await;
        };
        let (endpoint, secrets) = &*cached;
        if !endpoint.enabled {
            return self
                .end(
                    task,
                    TaskEnd::Held,
                    verdict(Outcome::Held, None, "the endpoint is disabled"),
                    0,
                )
                .await;
        }
        let Some(event) = self.event(&task.event).await? else {
            return self
                .end(
                    task,
                    TaskEnd::Failed,
                    verdict(Outcome::Failed, None, "the event is older than 30 days"),
                    0,
                )
                .await;
        };
        let started = Instant::now();
        let v = self.post(endpoint, &event.id, &event.body, secrets).await;
        let latency = started.elapsed();
        metrics::histogram!("codepool_webhook_delivery_seconds").record(latency.as_secs_f64());
        metrics::counter!("codepool_webhook_deliveries_total", "outcome" => v.outcome.as_str())
            .increment(1);
        let end = self.judge(task, endpoint, &v).await?;
        if v.outcome == Outcome::Delivered {
            debug!(event = %event.id, endpoint = %endpoint.id, "webhook delivered");
        } else {
            info!(event = %event.id, endpoint = %endpoint.id, shop = %endpoint.shop, attempt = task.attempts + 1, outcome = v.outcome.as_str(), status = v.status, "webhook not delivered");
        }
        self.end(task, end, v, latency.as_millis() as u64).await
    }

    /// Posts the signed event to the endpoint, its address checked first.
    async fn post(
        &self,
        endpoint: &EndpointDoc,
        id: &str,
        body: &str,
        secrets: &[String],
    ) -> Verdict {
        let url = match guard::check_url(&endpoint.url, &self.allow) {
            Ok(url) => url,
            Err(e) => return verdict(Outcome::Refused, None, &e.to_string()),
        };
        let ts = chrono::Utc::now().timestamp();
        let sent = self
            .client
            .post(url)
            .header("content-type", "application/json")
            .header("webhook-id", id)
            .header("webhook-timestamp", ts.to_string())
            .header("webhook-signature", sign::header(secrets, id, ts, body))
            .body(body.to_owned())
            .send()
            .await;
        let mut answer = match sent {
            Ok(a) => a,
            Err(e) => {
                let outcome = if is_refused_address(&e) {
                    Outcome::Refused
                } else {
                    Outcome::Failed
                };
                return verdict(outcome, None, &error_chain(&e));
            }
        };
        let status = answer.status().as_u16();
        let mut kept = Vec::new();
        while kept.len() < RESPONSE_KEPT {
            match answer.chunk().await {
                Ok(Some(c)) => {
                    kept.extend_from_slice(&c[..c.len().min(RESPONSE_KEPT - kept.len())])
                }
                _ => break,
            }
        }
        let outcome = match status {
            200..=299 => Outcome::Delivered,
            410 => Outcome::Gone,
            _ => Outcome::Failed,
        };
        verdict(
            outcome,
            Some(u32::from(status)),
            &String::from_utf8_lossy(&kept),
        )
    }

    /// What becomes of the task after this attempt, and of its endpoint:
    /// 410 disables it; so does failing for [`DISABLE_AFTER`].
    async fn judge(
        &self,
        task: &TaskDoc,
        endpoint: &EndpointDoc,
        v: &Verdict,
    ) -> Result<TaskEnd, StoreError> {
        let delivered = v.outcome == Outcome::Delivered;
        if delivered {
            // A streak to end (as the endpoint was last read): one write,
            // not one per delivery.
            if endpoint.failing_since.is_some() {
                self.store.note_webhook_result(&endpoint.id, true).await?;
            }
            return Ok(TaskEnd::Delivered);
        }
        let since = self.store.note_webhook_result(&endpoint.id, false).await?;
        if v.outcome == Outcome::Gone {
            self.disable(endpoint, "the endpoint answered 410 Gone", "gone")
                .await?;
            return Ok(TaskEnd::Failed);
        }
        if since.is_some_and(|t| chrono::Utc::now() - t.to_chrono() >= DISABLE_AFTER) {
            self.disable(endpoint, "every delivery failed for 5 days", "failing")
                .await?;
            return Ok(TaskEnd::Held);
        }
        let next = task.attempts as usize + 1;
        Ok(match SCHEDULE.get(next) {
            Some(wait) => TaskEnd::RetryAt(bson::DateTime::from_millis(
                bson::DateTime::now().timestamp_millis() + wait.as_millis() as i64,
            )),
            None => TaskEnd::Failed,
        })
    }

    async fn disable(
        &self,
        endpoint: &EndpointDoc,
        reason: &str,
        label: &'static str,
    ) -> Result<(), StoreError> {
        if self
            .store
            .disable_webhook_if_enabled(&endpoint.id, reason)
            .await?
        {
            warn!(endpoint = %endpoint.id, shop = %endpoint.shop, reason, "webhook endpoint disabled; enable it with `codepool webhooks enable` once it answers");
            metrics::counter!("codepool_webhook_endpoints_disabled_total", "reason" => label)
                .increment(1);
        }
        Ok(())
    }

    async fn end(
        &self,
        task: &TaskDoc,
        end: TaskEnd,
        v: Verdict,
        latency_ms: u64,
    ) -> Result<(), StoreError> {
        let attempt = AttemptDoc {
            task: task.id.clone(),
            event: task.event.clone(),
            endpoint: task.endpoint.clone(),
            shop: task.shop.clone(),
            kind: task.kind.clone(),
            attempt: task.attempts + 1,
            at: bson::DateTime::now(),
            outcome: v.outcome,
            status: v.status,
            latency_ms,
            response: v.response,
            by: self.me.clone(),
        };
        if !self.store.end_webhook_attempt(task, end, &attempt).await? {
            debug!(task = %task.id, "webhook task's lease ran out before its attempt ended");
        }
        Ok(())
    }
}

/// Shares `room` between endpoints that may take up to `left[i]` more
/// each: one each by turns, again while room is left.
fn allot(mut left: Vec<usize>, mut room: usize) -> Vec<usize> {
    let mut wants = vec![0usize; left.len()];
    while room > 0 {
        let before = room;
        for (want, left) in wants.iter_mut().zip(left.iter_mut()) {
            if room > 0 && *left > 0 {
                *want += 1;
                *left -= 1;
                room -= 1;
            }
        }
        if room == before {
            break;
        }
    }
    wants
}

fn verdict(outcome: Outcome, status: Option<u32>, response: &str) -> Verdict {
    let mut response = response.to_owned();
    if response.len() > RESPONSE_KEPT {
        let mut cut = RESPONSE_KEPT;
        while !response.is_char_boundary(cut) {
            cut -= 1;
        }
        response.truncate(cut);
    }
    Verdict {
        outcome,
        status,
        response,
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// Whether a send failed because the name resolved to an inside address.
fn is_refused_address(e: &reqwest::Error) -> bool {
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if s.downcast_ref::<guard::AddressError>().is_some() {
            return true;
        }
        source = s.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endpoint_gets_its_share_and_no_more() {
        assert_eq!(share(IN_FLIGHT, false), 4);
        assert_eq!(share(BUSY_IN_FLIGHT, false), 1, "one each while granting");
        assert_eq!(
            share(IN_FLIGHT, true),
            1,
            "a failing endpoint: one at a time"
        );
    }

    #[test]
    fn room_is_shared_by_turns() {
        // The first endpoint could take 4, but the others each get a turn.
        assert_eq!(allot(vec![4, 1, 4], 4), vec![2, 1, 1]);
        assert_eq!(allot(vec![4, 4, 4], 2), vec![1, 1, 0]);
        // Room left over when every endpoint is at its share.
        assert_eq!(allot(vec![1, 0, 2], 16), vec![1, 0, 2]);
        assert_eq!(allot(vec![], 16), Vec::<usize>::new());
    }
}
