//! Delivering webhooks, at least once. Every process that grants runs a
//! [`Deliverer`]: it stages flagged grants into events, leases due tasks
//! (one process per task at a time: a lease outlasts an attempt's
//! timeout), signs and posts each, records the attempt and schedules the
//! next. A process killed mid-delivery leaves its lease to run out; the
//! task is then due for whoever leases it next, with the same
//! `webhook-id`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use codepool_store::webhooks::{AttemptDoc, EndpointDoc, TaskDoc, TaskEnd};
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

/// Attempts in flight at once per process.
const IN_FLIGHT: usize = 16;

/// Grant flags staged per round.
const STAGE_LIMIT: i64 = 500;

/// How often an idle deliverer looks for work.
const IDLE: Duration = Duration::from_millis(200);

/// See the module documentation.
pub struct Deliverer {
    store: Store,
    client: reqwest::Client,
    allow: AllowHosts,
    /// This process, in leases and attempt records.
    me: String,
    slots: Arc<Semaphore>,
}

/// What one attempt came to.
struct Verdict {
    outcome: &'static str,
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
        })
    }

    /// Stages and delivers until `stop`; attempts in flight then finish
    /// (each within [`ATTEMPT_TIMEOUT`]).
    pub async fn run(self: Arc<Self>, stop: CancellationToken) {
        let mut last_gauge = Instant::now() - Duration::from_secs(60);
        while !stop.is_cancelled() {
            let staged = match super::stage_grants(&self.store, STAGE_LIMIT).await {
                Ok(n) => n,
                Err(e) => {
                    debug!(error = %e, "webhook staging waits for MongoDB");
                    0
                }
            };
            let leased = self.deliver_due().await;
            if last_gauge.elapsed() >= Duration::from_secs(5) {
                last_gauge = Instant::now();
                self.gauge_oldest().await;
            }
            if staged == 0 && leased == 0 {
                tokio::select! {
                    _ = stop.cancelled() => {}
                    _ = tokio::time::sleep(IDLE) => {}
                }
            }
        }
        let _ = tokio::time::timeout(
            ATTEMPT_TIMEOUT + Duration::from_secs(1),
            self.slots.acquire_many(IN_FLIGHT as u32),
        )
        .await;
    }

    /// Leases due tasks while attempt slots are free and starts their
    /// attempts. Returns how many it leased.
    pub async fn deliver_due(self: &Arc<Self>) -> usize {
        let mut leased = 0;
        while let Ok(permit) = self.slots.clone().try_acquire_owned() {
            let task = match self
                .store
                .lease_webhook_task(&self.me, LEASE.as_millis() as i64)
                .await
            {
                Ok(Some(t)) => t,
                Ok(None) => break,
                Err(e) => {
                    debug!(error = %e, "webhook tasks wait for MongoDB");
                    break;
                }
            };
            leased += 1;
            let me = self.clone();
            tokio::spawn(async move {
                if let Err(e) = me.attempt(&task).await {
                    // The lease runs out and the task is due again.
                    warn!(task = %task.id, error = %e, "webhook attempt not recorded; it will be made again");
                }
                drop(permit);
            });
        }
        leased
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

    /// One attempt of one leased task, recorded.
    async fn attempt(&self, task: &TaskDoc) -> Result<(), StoreError> {
        let Some(endpoint) = self.store.webhook_endpoint(&task.endpoint).await? else {
            return self
                .end(
                    task,
                    TaskEnd::Failed,
                    verdict("failed", None, "the endpoint was removed"),
                    0,
                )
                .await;
        };
        if !endpoint.enabled {
            return self
                .end(
                    task,
                    TaskEnd::Held,
                    verdict("held", None, "the endpoint is disabled"),
                    0,
                )
                .await;
        }
        let Some(event) = self.store.webhook_event(&task.event).await? else {
            return self
                .end(
                    task,
                    TaskEnd::Failed,
                    verdict("failed", None, "the event is older than 30 days"),
                    0,
                )
                .await;
        };
        let secrets = self.store.open_webhook_secrets(&endpoint)?;
        let started = Instant::now();
        let v = self.post(&endpoint, &event.id, &event.body, &secrets).await;
        let latency = started.elapsed();
        metrics::histogram!("codepool_webhook_delivery_seconds").record(latency.as_secs_f64());
        metrics::counter!("codepool_webhook_deliveries_total", "outcome" => v.outcome).increment(1);
        let end = self.judge(task, &endpoint, &v).await?;
        if v.outcome == "delivered" {
            debug!(event = %event.id, endpoint = %endpoint.id, "webhook delivered");
        } else {
            info!(event = %event.id, endpoint = %endpoint.id, shop = %endpoint.shop, attempt = task.attempts + 1, outcome = v.outcome, status = v.status, "webhook not delivered");
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
            Err(e) => return verdict("refused", None, &e.to_string()),
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
                    "refused"
                } else {
                    "failed"
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
            200..=299 => "delivered",
            410 => "gone",
            _ => "failed",
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
        let delivered = v.outcome == "delivered";
        let since = self
            .store
            .note_webhook_result(&endpoint.id, delivered)
            .await?;
        if delivered {
            return Ok(TaskEnd::Delivered);
        }
        if v.outcome == "gone" {
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
            outcome: v.outcome.to_owned(),
            status: v.status,
            latency_ms,
            response: v.response,
            by: self.me.clone(),
        };
        if !self
            .store
            .end_webhook_attempt(task, &self.me, end, &attempt)
            .await?
        {
            debug!(task = %task.id, "webhook task's lease ran out before its attempt ended");
        }
        Ok(())
    }
}

fn verdict(outcome: &'static str, status: Option<u32>, response: &str) -> Verdict {
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
