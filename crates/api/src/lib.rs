//! # codepool-api
//!
//! The HTTP door for shop backends. `POST /v1/orders` decides a purchase
//! through the same [`Intake`] as the dispatcher (known pool, conflicting
//! order, pause, per-user limit, the batched claim), publishes the same
//! SMS-pending events with the same `event_id`s through the same outbox,
//! and answers with the codes. The same request again gets the same codes;
//! an order sent by AMQP and by HTTP still gets its codes once.
//!
//! Every request needs an API key ([`keys`]) with the route's scope. Every
//! error is RFC 9457 `application/problem+json` whose `detail` says what to
//! do next, and every response carries `x-request-id`, which the logs
//! carry too.

mod batcher;
mod channels;
mod codes;
mod dead_letters;
mod generations;
mod holds;
mod imports;
mod items;
mod openapi;
mod orders;
mod pools;
pub mod port;
mod problem;
mod replace;
mod request;
mod shops;
mod state;
mod statements;
mod webhooks;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

pub use codepool_issuance::api_keys::{self as keys, KeyDoc, Scope};
pub use codepool_issuance::Broker;
pub use port::{serve_port, PortLimits, IMPORT_TIMEOUT};
pub use problem::Problem;
use request::RequestId;
pub use state::{Api, ApiConfig};

/// The `/v1` routes, with their limits, request ids and keys; their time
/// is bounded by the port they are served on ([`serve`]).
pub fn router(api: Arc<Api>) -> Router {
    // The marketplaces' own protocols: their own authentication and error
    // shapes, so outside the `/v1` key check and problem bodies.
    let (channels, channels_doc) = channels::documented().split_for_parts();
    let channels = channels::router(channels, api.clone());
    let (v1, doc) = documented().split_for_parts();
    let doc = Arc::new(openapi::complete(doc, channels_doc));
    let v1 = v1
        .fallback(
            |axum::Extension(id): axum::Extension<RequestId>| async move {
                Problem::new(
                    StatusCode::NOT_FOUND,
                    "not-found",
                    "no such route",
                    "the API's routes are under /v1; see docs/http-api.md",
                )
                .at(&id.0)
            },
        )
        .layer(DefaultBodyLimit::max(api.config.body_limit))
        .layer(middleware::from_fn_with_state(api.clone(), authenticate))
        .with_state(api);
    let doc = Router::new().route(
        "/openapi.json",
        get(move || {
            let doc = doc.clone();
            async move { axum::Json(doc.as_ref().clone()) }
        }),
    );
    v1.merge(doc)
        .layer(middleware::from_fn(with_request_id))
        .merge(channels)
}

/// The `/v1` routes with their OpenAPI annotations: the document is made
/// from the very routes served.
fn documented() -> OpenApiRouter<Arc<Api>> {
    OpenApiRouter::with_openapi(openapi::ApiDoc::openapi())
        .routes(routes!(orders::place))
        .routes(routes!(orders::read))
        .routes(routes!(orders::redeem))
        .routes(routes!(orders::void))
        .routes(routes!(orders::resend))
        .routes(routes!(replace::replace))
        .routes(routes!(codes::check))
        .routes(routes!(codes::redeem))
        .routes(routes!(holds::place))
        .routes(routes!(holds::read, holds::release))
        .routes(routes!(pools::list, pools::create))
        .routes(routes!(pools::show, pools::settings))
        .routes(routes!(pools::pause))
        .routes(routes!(pools::resume))
        .routes(routes!(imports::upload))
        .routes(routes!(imports::show))
        .routes(routes!(imports::recall))
        .routes(routes!(generations::start))
        .routes(routes!(generations::show))
        .routes(routes!(statements::statement))
        .routes(routes!(statements::lines))
        .routes(routes!(dead_letters::list))
        .routes(routes!(dead_letters::replay))
        .routes(routes!(shops::list, shops::create))
        .routes(routes!(shops::show, shops::set))
        .routes(routes!(webhooks::list, webhooks::add))
        .routes(routes!(webhooks::disable))
        .routes(routes!(webhooks::enable))
        .routes(routes!(webhooks::rotate))
        .routes(routes!(webhooks::deliveries))
        .routes(routes!(webhooks::replay))
}

/// The OpenAPI document of the API (as `GET /openapi.json` serves it).
pub fn openapi_document() -> utoipa::openapi::OpenApi {
    openapi::complete(
        documented().into_openapi(),
        channels::documented().into_openapi(),
    )
}

/// Binds `addr` now (a taken port fails at start) and serves the API and
/// `extra` (the console, health and metrics) until `stop`, within the
/// port's limits ([`port::serve_port`]): every route's request is bounded
/// by [`ApiConfig::request_timeout`], a request's head by
/// [`ApiConfig::header_timeout`], the open connections by
/// [`ApiConfig::max_connections`]. Returns the bound address and the task.
pub async fn serve(
    addr: SocketAddr,
    api: Arc<Api>,
    extra: Router,
    stop: CancellationToken,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<std::io::Result<()>>)> {
    let limits = PortLimits {
        request_timeout: api.config.request_timeout,
        header_timeout: api.config.header_timeout,
        max_connections: api.config.max_connections,
        tls: api.config.tls.clone(),
    };
    port::serve_port(addr, extra.merge(router(api)), limits, stop).await
}

/// The TLS settings for `cert` and `key` (PEM files: the certificate chain
/// and its private key).
pub fn tls_config(
    cert: &std::path::Path,
    key: &std::path::Path,
) -> Result<Arc<tokio_rustls::rustls::ServerConfig>, String> {
    use tokio_rustls::rustls;
    let read = |p: &std::path::Path| {
        std::fs::read(p).map_err(|e| format!("cannot read {}: {e}", p.display()))
    };
    let certs: Vec<_> = rustls_pemfile::certs(&mut read(cert)?.as_slice())
        .collect::<Result<_, _>>()
        .map_err(|e| format!("{}: not a PEM certificate chain: {e}", cert.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "{}: no certificate in it (PEM, BEGIN CERTIFICATE)",
            cert.display()
        ));
    }
    let private = rustls_pemfile::private_key(&mut read(key)?.as_slice())
        .map_err(|e| format!("{}: not a PEM private key: {e}", key.display()))?
        .ok_or_else(|| {
            format!(
                "{}: no private key in it (PEM, BEGIN PRIVATE KEY)",
                key.display()
            )
        })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_single_cert(certs, private)
        .map_err(|e| format!("the key does not fit the certificate: {e}"))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// Gives every request an id (the port's, see [`port`]; else the client's
/// `x-request-id` if it is short and plain, else a new one), logs the
/// request under it, and puts the id on the response. Every answer is
/// `Cache-Control: no-store`: many carry codes in plaintext.
async fn with_request_id(mut req: Request, next: Next) -> Response {
    let id = req
        .headers()
        .get("x-request-id")
        .filter(|v| port::fit_request_id(v))
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .unwrap_or_else(|| bson::oid::ObjectId::new().to_hex());
    req.extensions_mut().insert(RequestId(id.clone()));
    // The port's request span (tower-http's TraceLayer, `port.rs`), with
    // this request's id: every line of the request is logged in it.
    let span = tracing::Span::current();
    let started = Instant::now();
    let res = match refused_early(&req) {
        Some(p) => p.at(&id).into_response(),
        None => next.run(req).instrument(span.clone()).await,
    };
    let mut res = as_problem(res, &id).await;
    let status = res.status().as_u16();
    span.in_scope(|| tracing::info!(status, ms = started.elapsed().as_millis() as u64, "served"));
    metrics::counter!("codepool_api_requests_total", "status" => status.to_string()).increment(1);
    metrics::histogram!("codepool_api_request_seconds").record(started.elapsed().as_secs_f64());
    let h = res.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&id) {
        h.insert("x-request-id", v);
    }
    h.insert(
        axum::http::header::CACHE_CONTROL,
        HeaderValue::from_static("no-store"),
    );
    res
}

/// Most bytes of request headers the API reads (hyper refuses far larger
/// heads itself).
pub const MAX_HEADER_BYTES: usize = 16 * 1024;

/// A request refused before its route sees it: headers too large, or a
/// body that is not of the route's content type.
fn refused_early(req: &Request) -> Option<Problem> {
    let size: usize = (req.headers().iter())
        .map(|(k, v)| k.as_str().len() + v.len() + 4)
        .sum();
    if size > MAX_HEADER_BYTES {
        return Some(Problem::new(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "headers-too-large",
            "the request's headers are too large",
            format!("send at most {MAX_HEADER_BYTES} bytes of headers; an API request needs only Authorization and Content-Type"),
        ));
    }
    let method = req.method();
    let writes = *method == axum::http::Method::POST || *method == axum::http::Method::PATCH;
    // No body at all (curl -X POST sends neither a length nor a type).
    let headers = req.headers();
    let empty = match headers.get(axum::http::header::CONTENT_LENGTH) {
        Some(len) => len.as_bytes() == b"0",
        None => !headers.contains_key(axum::http::header::TRANSFER_ENCODING),
    };
    if !writes || empty || !req.uri().path().starts_with("/v1/") {
        return None;
    }
    let ct = req
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase();
    let essence = ct.split(';').next().unwrap_or("").trim();
    if req.uri().path().ends_with("/imports") {
        // A partner's CSV comes as the raw body, whatever it is labelled.
        return (essence.starts_with("multipart/") || essence.contains("json")).then(|| {
            Problem::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported-media-type",
                "the upload is not a CSV body",
                "send the file itself as the body: curl --data-binary @codes.csv -H 'Content-Type: text/csv'",
            )
        });
    }
    (essence != "application/json" && !essence.ends_with("+json")).then(|| {
        Problem::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported-media-type",
            "the body is not JSON",
            format!(
                "send the body as JSON with Content-Type: application/json (got {:?})",
                ct.chars().take(80).collect::<String>()
            ),
        )
    })
}

/// An error answered by axum itself (a body over the limit, a path or a
/// method it cannot route) as a problem, like every other error.
async fn as_problem(res: Response, id: &str) -> Response {
    let status = res.status();
    let is_problem = res
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes() == b"application/problem+json");
    if !(status.is_client_error() || status.is_server_error()) || is_problem {
        return res;
    }
    let (parts, body) = res.into_parts();
    let text = axum::body::to_bytes(body, 4096).await.unwrap_or_default();
    let said = String::from_utf8_lossy(&text).trim().to_owned();
    let detail = match status {
        StatusCode::PAYLOAD_TOO_LARGE => "the body is larger than this API accepts (--body-limit); an order is a few hundred bytes".to_owned(),
        StatusCode::METHOD_NOT_ALLOWED => "this route does not take that method; see docs/http-api.md".to_owned(),
        _ if said.is_empty() => "see docs/http-api.md for what this route takes".to_owned(),
        _ => format!("{said}; see docs/http-api.md for what this route takes"),
    };
    let mut out = Problem::new(
        status,
        "http-error",
        status.canonical_reason().unwrap_or("error"),
        detail,
    )
    .at(id)
    .into_response();
    for (k, v) in parts
        .headers
        .iter()
        .filter(|(k, _)| *k == axum::http::header::ALLOW)
    {
        out.headers_mut().insert(k.clone(), v.clone());
    }
    out
}

/// The token of `Bearer TOKEN`, the scheme in any case (RFC 9110 11.1).
fn bearer_token(authorization: &str) -> Option<&str> {
    let (scheme, token) = authorization.trim().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then_some(token.trim())
        .filter(|t| !t.is_empty())
}

/// Requires a valid key (`Authorization: Bearer cpk_…`) and under its rate.
async fn authenticate(State(api): State<Arc<Api>>, mut req: Request, next: Next) -> Response {
    let id = req
        .extensions()
        .get::<RequestId>()
        .map(|r| r.0.clone())
        .unwrap_or_default();
    let token = req
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_token);
    let Some(token) = token else {
        return Problem::unauthorized(
            "send an API key: Authorization: Bearer cpk_… (`codepool api-keys create` makes one)",
        )
        .at(&id)
        .into_response();
    };
    let key = match api.verify_key(&api.keys, token).await {
        Ok(Some(key)) => key,
        Ok(None) => return Problem::unauthorized(
            "this API key is not valid (unknown, revoked or mistyped); ask an operator for a key",
        )
        .at(&id)
        .into_response(),
        Err(e) => return Problem::unavailable(&e).at(&id).into_response(),
    };
    if let Err(wait) = api.take(&key.id) {
        metrics::counter!("codepool_api_rate_limited_total").increment(1);
        return Problem::too_many(wait).at(&id).into_response();
    }
    req.extensions_mut().insert(key);
    next.run(req).await
}
