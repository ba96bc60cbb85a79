//! The metrics a dispatcher exports, in one place: names, help texts and
//! latency buckets. [`describe`] registers them at start, so `/metrics`
//! lists every counter at zero before the first purchase arrives and a
//! dashboard never has to guess whether a series is missing or zero.
//! Labels never carry a code (codes are secrets); pools and reasons only.

use codepool_domain::{RefusalReason, RejectReason};

/// Bucket bounds (seconds) of the latency histograms: claims take
/// milliseconds when healthy and seconds while a server fails over.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

const COUNTERS: &[(&str, &str)] = &[
    (
        "codepool_holds_total",
        "Checkout holds asked for, by outcome (held, short, over_limit).",
    ),
    (
        "codepool_holds_ended_total",
        "Checkout holds ended, by state (committed, released, expired).",
    ),
    (
        "codepool_refusals_total",
        "Valid purchases refused by a pool policy (purchase.refused), by reason.",
    ),
    (
        "codepool_purchases_consumed_total",
        "Purchase messages received from the queue.",
    ),
    ("codepool_grants_total", "Codes granted to new orders."),
    (
        "codepool_duplicate_deliveries_total",
        "Purchases whose order already held a code (redeliveries, duplicates).",
    ),
    (
        "codepool_backorders_total",
        "Purchases recorded as backorders because their pool was empty.",
    ),
    (
        "codepool_backorders_fulfilled_total",
        "Backorders fulfilled after new codes arrived.",
    ),
    (
        "codepool_dead_letters_total",
        "Invalid purchases dead-lettered, by reason.",
    ),
    (
        "codepool_sms_relayed_total",
        "SMS-pending events re-published because their first publish was never confirmed.",
    ),
    (
        "codepool_sms_receipts_total",
        "SMS receipts applied, by result (sent, failed, duplicate, unknown_order, malformed).",
    ),
    (
        "codepool_redemptions_total",
        "code.redeemed events, by result (redeemed, duplicate, refused, malformed).",
    ),
    (
        "codepool_codes_expired_total",
        "Unissued codes voided by the expiry sweep, by pool.",
    ),
    (
        "codepool_low_stock_alerts_total",
        "pool.low_stock events published, by pool.",
    ),
    (
        "codepool_claim_races_total",
        "Hot-pool candidates lost to another claimer (retried).",
    ),
    (
        "codepool_claims_total",
        "Codes claimed, by path (hot pool or scan).",
    ),
    (
        "codepool_refill_pools_total",
        "Hot-set refills per pool, by path (batch: the pools a batch found short, together; one: a pool alone on the claim path; background: top-ups).",
    ),
    (
        "codepool_refill_dry_total",
        "Refills that reached the end of their pool (ended) or found nothing (empty): background top-ups of the pool pause.",
    ),
    (
        "codepool_refill_dry_skips_total",
        "Background top-ups skipped because the pool's last refill reached its end.",
    ),
    (
        "codepool_claim_round_pools_total",
        "Pools per round of pairing orders with candidates, added up (one round per batch unless races are lost).",
    ),
    (
        "codepool_hot_candidates_dropped_total",
        "Hot-pool candidates that were never claimable by their order (other_pool, retired, expired, missing): a stale or tampered Redis set.",
    ),
    (
        "codepool_webhook_deliveries_total",
        "Webhook delivery attempts, by outcome (delivered, failed, gone, refused, held).",
    ),
    (
        "codepool_webhook_endpoints_disabled_total",
        "Webhook endpoints disabled by a delivery, by reason (gone: 410; failing: 5 days without a delivery).",
    ),
    (
        "codepool_webhook_record_failures_total",
        "Pool events whose webhook events could not be recorded, by event.",
    ),
];

const HISTOGRAMS: &[(&str, &str)] = &[
    (
        "codepool_batcher_size",
        "Requests placed together in one batch, by batcher (orders: HTTP orders; holds; redemptions; checks).",
    ),
    (
        "codepool_batcher_wait_seconds",
        "How long a request waited for its batch to take it, by batcher (orders, holds, redemptions, checks).",
    ),
    (
        "codepool_claim_batch_seconds",
        "Claim latency: one batch of purchases, from candidates to grants read back.",
    ),
    ("codepool_batch_seconds", "One batch from receipt to acks."),
    (
        "codepool_claim_stage_seconds",
        "Where claims spend their time, by stage (pop, refill_short, complete, refill_one, busy_wait, background, refill_lock, candidates_query, candidates_rescan, refill_finish, numbers, claim_write, read_back, scan); stages overlap across concurrent batches.",
    ),
    (
        "codepool_webhook_delivery_seconds",
        "One webhook attempt, from request to the answer read (at most 15 s).",
    ),
    (
        "codepool_end_to_end_seconds",
        "Per purchase: received from the broker until acked (granted and SMS event confirmed).",
    ),
];

const GAUGES: &[(&str, &str)] = &[
    (
        "codepool_console_names_locked",
        "Operator names some address must wait on before its next sign-in attempt (sustained guessing).",
    ),
    (
        "codepool_pool_held",
        "Codes held for checkouts (and bundles being put together) per pool (every 5 s).",
    ),
    (
        "codepool_pool_unissued",
        "Unissued, unexpired codes per pool (refreshed after grants and every minute).",
    ),
    (
        "codepool_redis_fallback_active",
        "1 while Redis is unavailable and claims scan MongoDB instead.",
    ),
    (
        "codepool_ready",
        "1 while MongoDB and RabbitMQ are reachable (what /readyz answers 200 for).",
    ),
    (
        "codepool_pool_low_stock_threshold",
        "Each pool's low-stock threshold (0: none), as its last stock check read it.",
    ),
    (
        "codepool_pool_backorders_waiting",
        "1 while a pool has backorders waiting, as the last backorder sweep found.",
    ),
    (
        "codepool_sms_relay_backlog",
        "Grants whose SMS-pending event was never confirmed, found by the relay's last round (at most one round).",
    ),
    (
        "codepool_webhook_oldest_undelivered_seconds",
        "Age of the oldest webhook delivery still due (0 when none is), checked every 5 s.",
    ),
];

/// Every dead-letter reason, so each series starts at zero.
const REJECT_REASONS: &[RejectReason] = &[
    RejectReason::TooLarge,
    RejectReason::NotJson,
    RejectReason::NotObject,
    RejectReason::MissingField,
    RejectReason::WrongType,
    RejectReason::TooLong,
    RejectReason::InvalidPhone,
    RejectReason::InvalidPool,
    RejectReason::InvalidTime,
    RejectReason::UnknownPool,
    RejectReason::DuplicateField,
    RejectReason::InvalidChars,
    RejectReason::DeliveryLimit,
    RejectReason::UnknownShop,
    RejectReason::PoolNotAllowed,
    RejectReason::ShopNotYours,
];

/// Describes every metric and registers the unlabelled ones (and dead
/// letters per reason) at zero. Call once after installing the recorder.
pub fn describe() {
    for (name, help) in COUNTERS {
        metrics::describe_counter!(*name, *help);
    }
    for (name, help) in HISTOGRAMS {
        metrics::describe_histogram!(*name, metrics::Unit::Seconds, *help);
    }
    for (name, help) in GAUGES {
        metrics::describe_gauge!(*name, *help);
    }
    for name in [
        "codepool_purchases_consumed_total",
        "codepool_grants_total",
        "codepool_duplicate_deliveries_total",
        "codepool_backorders_total",
        "codepool_backorders_fulfilled_total",
        "codepool_sms_relayed_total",
    ] {
        metrics::counter!(name).increment(0);
    }
    for reason in REJECT_REASONS {
        metrics::counter!("codepool_dead_letters_total", "reason" => reason.as_str()).increment(0);
    }
    for why in [
        codepool_store::Stray::Missing,
        codepool_store::Stray::OtherPool,
        codepool_store::Stray::Retired,
        codepool_store::Stray::Expired,
    ] {
        metrics::counter!("codepool_hot_candidates_dropped_total", "reason" => why.as_str())
            .increment(0);
    }
    metrics::counter!("codepool_refusals_total", "reason" => RefusalReason::PerUserLimit.as_str())
        .increment(0);
    metrics::gauge!("codepool_redis_fallback_active").set(0.0);
    metrics::gauge!("codepool_ready").set(0.0);
    metrics::gauge!("codepool_sms_relay_backlog").set(0.0);
    for outcome in ["delivered", "failed", "gone", "refused", "held"] {
        metrics::counter!("codepool_webhook_deliveries_total", "outcome" => outcome).increment(0);
    }
    for reason in ["gone", "failing"] {
        metrics::counter!("codepool_webhook_endpoints_disabled_total", "reason" => reason)
            .increment(0);
    }
    metrics::gauge!("codepool_webhook_oldest_undelivered_seconds").set(0.0);
    for outcome in ["held", "short", "over_limit"] {
        metrics::counter!("codepool_holds_total", "outcome" => outcome).increment(0);
    }
    for state in ["committed", "released", "expired"] {
        metrics::counter!("codepool_holds_ended_total", "state" => state).increment(0);
    }
}

/// The pools that had backorders waiting at the last sweep, so a pool
/// whose backorders were all fulfilled goes back to 0.
static WAITING_POOLS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// Sets `codepool_pool_backorders_waiting` from a sweep's pools with
/// backorders waiting: 1 for those, 0 for pools that had some before.
pub fn record_backorders_waiting(pools: &[String]) {
    let Ok(mut before) = WAITING_POOLS.lock() else {
        return;
    };
    for pool in before.iter().filter(|p| !pools.contains(p)) {
        metrics::gauge!("codepool_pool_backorders_waiting", "pool" => pool.clone()).set(0.0);
    }
    for pool in pools {
        metrics::gauge!("codepool_pool_backorders_waiting", "pool" => pool.clone()).set(1.0);
    }
    *before = pools.to_vec();
}

/// Purchases settled (acked with their outcome durable) by every
/// dispatcher of this process: what `codepool_end_to_end_seconds_count`
/// counts, readable without rendering the metrics (a benchmark polls it).
static SETTLED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

pub fn record_settled(n: u64) {
    SETTLED.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
}

/// See [`SETTLED`].
pub fn settled_purchases() -> u64 {
    SETTLED.load(std::sync::atomic::Ordering::Relaxed)
}

/// Codes issued (claimed fresh) by every claim engine of this process,
/// readable without rendering the metrics: a benchmark stops its clock
/// when the last code is issued.
static ISSUED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

pub(crate) fn record_issued(n: u64) {
    ISSUED.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
}

/// See [`ISSUED`].
pub fn issued_codes() -> u64 {
    ISSUED.load(std::sync::atomic::Ordering::Relaxed)
}
