//! One listening port, whatever it serves (the API with its console and
//! probes, or a dispatcher's probes alone): every connection and every
//! request on it is bounded in time, the connections in number, and every
//! request carries an id. A slow or idle client cannot hold the port.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{ConnectInfo, Request};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::Router;
use tokio_util::sync::CancellationToken;
use tower_http::request_id::{
    MakeRequestId, PropagateRequestIdLayer, RequestId as TowerRequestId, SetRequestIdLayer,
};
use tower_http::trace::TraceLayer;

use crate::problem::Problem;

/// Longest an import upload may take (`/v1/…/imports`, `/console/…/imports`).
pub const IMPORT_TIMEOUT: Duration = Duration::from_secs(3600);

/// What bounds a port.
#[derive(Debug, Clone)]
pub struct PortLimits {
    /// Longest a whole request may take, reading its body included; then
    /// 408. Import uploads get [`IMPORT_TIMEOUT`].
    pub request_timeout: Duration,
    /// Longest a client may take to send a request's head (and longest an
    /// idle keep-alive connection stays open); then it is closed.
    pub header_timeout: Duration,
    /// Connections served at once; further ones wait to be accepted.
    pub max_connections: usize,
    /// Serve HTTPS with these settings.
    pub tls: Option<Arc<tokio_rustls::rustls::ServerConfig>>,
}

/// Binds `addr` now (a taken port fails at start) and serves `app` until
/// `stop`, within `limits`; in-flight requests finish (for up to the
/// request timeout), new connections are refused. Returns the bound
/// address and the task.
pub async fn serve_port(
    addr: SocketAddr,
    app: Router,
    limits: PortLimits,
    stop: CancellationToken,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<std::io::Result<()>>)> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let app = bounded(app, limits.request_timeout);
    let task = tokio::spawn(accept_loop(listener, app, limits, stop));
    Ok((bound, task))
}

/// Accepts connections while fewer than `max_connections` are open.
async fn accept_loop(
    listener: tokio::net::TcpListener,
    app: Router,
    limits: PortLimits,
    stop: CancellationToken,
) -> std::io::Result<()> {
    let connections = hyper_util::server::graceful::GracefulShutdown::new();
    let open = Arc::new(tokio::sync::Semaphore::new(limits.max_connections.max(1)));
    let tls = limits.tls.clone().map(tokio_rustls::TlsAcceptor::from);
    let header_timeout = limits.header_timeout;
    loop {
        let accepted = tokio::select! {
            _ = stop.cancelled() => break,
            permit = open.clone().acquire_owned() => match permit {
                Ok(permit) => tokio::select! {
                    _ = stop.cancelled() => break,
                    accepted = listener.accept() => accepted.map(|a| (a, permit)),
                },
                Err(_) => break,
            },
        };
        let ((stream, peer), permit) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Out of file descriptors and the like: wait, go on.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let (app, watcher, tls) = (app.clone(), connections.watcher(), tls.clone());
        tokio::spawn(async move {
            let _permit = permit;
            let Some(tls) = tls else {
                return serve_connection(stream, peer, app, header_timeout, watcher).await;
            };
            // The handshake is bounded like a request's head.
            match tokio::time::timeout(header_timeout, tls.accept(stream)).await {
                Ok(Ok(s)) => serve_connection(s, peer, app, header_timeout, watcher).await,
                Ok(Err(e)) => tracing::debug!(error = %e, "TLS handshake failed"),
                Err(_) => tracing::debug!("TLS handshake timed out"),
            }
        });
    }
    drop(listener);
    let _ = tokio::time::timeout(limits.request_timeout, connections.shutdown()).await;
    Ok(())
}

/// One HTTP/1.1 connection, plain or TLS, until it closes or the server
/// stops (then it finishes what it serves). Handlers see the client's
/// address as [`ConnectInfo`].
async fn serve_connection<I>(
    io: I,
    peer: SocketAddr,
    app: Router,
    header_timeout: Duration,
    watcher: hyper_util::server::graceful::Watcher,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |mut req: hyper::Request<_>| {
        req.extensions_mut().insert(ConnectInfo(peer));
        tower::ServiceExt::oneshot(app.clone(), req.map(axum::body::Body::new))
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(header_timeout)
        .serve_connection(hyper_util::rt::TokioIo::new(io), service);
    let _ = watcher.watch(conn).await;
}

/// `app` with the port's request id, a tracing span per request (carrying
/// that id, so every log line of the request names it) and the
/// whole-request timeout on every route.
fn bounded(app: Router, timeout: Duration) -> Router {
    app.layer(middleware::from_fn(move |req, next| {
        within(req, next, timeout)
    }))
    .layer(TraceLayer::new_for_http().make_span_with(request_span))
    .layer(PropagateRequestIdLayer::x_request_id())
    .layer(SetRequestIdLayer::x_request_id(NewRequestId))
    .layer(middleware::map_request(drop_unfit_request_id))
}

/// The span of one request: its id, method and path (never a body: codes
/// do not travel in paths).
fn request_span<B>(req: &axum::http::Request<B>) -> tracing::Span {
    let id = (req.headers().get("x-request-id"))
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    tracing::info_span!("request", request_id = %id, method = %req.method(), path = %req.uri().path())
}

/// A client's `x-request-id` is kept only when short and plain.
pub(crate) fn fit_request_id(v: &HeaderValue) -> bool {
    (1..=64).contains(&v.len()) && v.as_bytes().iter().all(|b| b.is_ascii_graphic())
}

async fn drop_unfit_request_id(mut req: Request) -> Request {
    if req
        .headers()
        .get("x-request-id")
        .is_some_and(|v| !fit_request_id(v))
    {
        req.headers_mut().remove("x-request-id");
    }
    req
}

/// A new request id: an ObjectId in hex, as the logs and the audit use.
#[derive(Debug, Clone, Copy)]
struct NewRequestId;

impl MakeRequestId for NewRequestId {
    fn make_request_id<B>(&mut self, _: &axum::http::Request<B>) -> Option<TowerRequestId> {
        HeaderValue::from_str(&bson::oid::ObjectId::new().to_hex())
            .ok()
            .map(TowerRequestId::new)
    }
}

/// Bounds the whole request; a request still running at the end gets 408
/// (a problem on `/v1`) and its connection is closed.
async fn within(req: Request, next: Next, timeout: Duration) -> Response {
    let path = req.uri().path().to_owned();
    // An upload of a partner's file takes as long as the file is large.
    let timeout = if req.method() == Method::POST && path.ends_with("/imports") {
        timeout.max(IMPORT_TIMEOUT)
    } else {
        timeout
    };
    let id = (req.headers().get("x-request-id"))
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    if let Ok(res) = tokio::time::timeout(timeout, next.run(req)).await {
        return res;
    }
    tracing::info!(request_id = %id, path = %path, "request timed out");
    let mut res = if path.starts_with("/v1/") {
        metrics::counter!("codepool_api_requests_total", "status" => "408").increment(1);
        Problem::new(
            StatusCode::REQUEST_TIMEOUT,
            "timeout",
            "request timed out",
            format!("the request took longer than {timeout:?}; send it again (the same order gets the same codes)"),
        )
        .at(&id)
        .into_response()
    } else {
        let text = format!("the request took longer than {timeout:?}; send it again\n");
        (StatusCode::REQUEST_TIMEOUT, text).into_response()
    };
    res.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    res
}
