//! `/metrics` (Prometheus text), `/healthz` (alive) and `/readyz` (MongoDB
//! and RabbitMQ reachable, and the key file opens every code; Redis down is
//! reported as degraded, still ready).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;
use codepool_issuance::{Core, Health};
use metrics_exporter_prometheus::PrometheusHandle;
use tokio_util::sync::CancellationToken;

#[derive(Clone)]
struct AppState {
    health: Arc<Health>,
    metrics: PrometheusHandle,
    /// The core of a process that claims for HTTP orders: `/readyz` asks
    /// its key watch, when asked, what the order path asks before each
    /// batch ([`codepool_issuance::keywatch`]), so it turns not ready no
    /// later than the first order refused for a key the file lacks.
    core: Option<Arc<Core>>,
}

/// Connections a dispatcher's probe port serves at once (scrapers and
/// health checks need a few).
const PROBE_CONNECTIONS: usize = 64;

/// Binds `addr` now (so a taken port fails at start) and serves until
/// `stop`. Returns the bound address (port 0 picks a free one). A request
/// (its head included) that takes longer than `timeout` is cut, so an idle
/// or half-sent connection cannot hold the port.
pub async fn serve(
    addr: SocketAddr,
    health: Arc<Health>,
    metrics: PrometheusHandle,
    timeout: Duration,
    stop: CancellationToken,
) -> anyhow::Result<SocketAddr> {
    let limits = codepool_api::PortLimits {
        request_timeout: timeout,
        header_timeout: timeout,
        max_connections: PROBE_CONNECTIONS,
        tls: None,
    };
    let (bound, _task) = codepool_api::serve_port(addr, routes(health, metrics), limits, stop)
        .await
        .with_context(|| format!("cannot listen on {addr} for /metrics; pick another with --http ADDR (port 0 picks a free one) or turn it off with --no-http"))?;
    Ok(bound)
}

/// `/metrics`, `/healthz` and `/readyz`, to serve alone (a dispatcher,
/// whose consumer keeps `health` told of its keys).
pub fn routes(health: Arc<Health>, metrics: PrometheusHandle) -> Router {
    routes_of(AppState {
        health,
        metrics,
        core: None,
    })
}

/// [`routes`] beside the API: `/readyz` checks `core`'s keys at the time
/// of the request, as its order path does.
pub fn routes_checking_keys(
    health: Arc<Health>,
    metrics: PrometheusHandle,
    core: Arc<Core>,
) -> Router {
    routes_of(AppState {
        health,
        metrics,
        core: Some(core),
    })
}

fn routes_of(state: AppState) -> Router {
    Router::new()
        .route("/metrics", get(metrics_page))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(state)
}

/// The Prometheus recorder, with codepool's histogram buckets.
pub fn install_metrics() -> anyhow::Result<PrometheusHandle> {
    let handle = metrics_exporter_prometheus::PrometheusBuilder::new()
        .set_buckets_for_metric(
            metrics_exporter_prometheus::Matcher::Suffix("_seconds".into()),
            codepool_issuance::telemetry::LATENCY_BUCKETS,
        )
        .context("invalid histogram buckets")?
        .install_recorder()
        .context("cannot install the metrics recorder")?;
    codepool_issuance::telemetry::describe();
    Ok(handle)
}

async fn metrics_page(State(s): State<AppState>) -> String {
    s.metrics.render()
}

/// Longest `/readyz` waits for the key check.
const KEY_CHECK_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

async fn readyz(State(s): State<AppState>) -> (StatusCode, String) {
    let h = &s.health;
    if let Some(core) = &s.core {
        // The order path's own check, and its cached answer: reread at
        // most every RECHECK by whichever asks first, so an order refused
        // for a missing key is never answered while this says ready. A
        // registry that cannot be read leaves the last answer (MongoDB
        // down shows above). Bounded: a probe never waits on MongoDB's
        // server selection.
        let check = core.ensure_keys();
        if let Ok(Ok(keys)) = tokio::time::timeout(KEY_CHECK_WAIT, check).await {
            h.set_keys_missing(keys.is_err());
        }
    }
    let mut body = format!(
        "mongodb: {}\nrabbitmq: {}\nredis: {}\n",
        if h.mongo() { "up" } else { "down" },
        if h.amqp() { "up" } else { "down" },
        if h.redis_degraded() {
            "degraded (claims fall back to MongoDB)"
        } else {
            "up"
        },
    );
    if h.keys_missing() {
        body.push_str("keys: the key file lacks a key codes are sealed with (see the log); nothing is claimed\n");
    }
    if h.ready() {
        (StatusCode::OK, format!("ready\n{body}"))
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready\n{body}"),
        )
    }
}
