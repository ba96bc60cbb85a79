//! # codepool-console
//!
//! The operator console: pages rendered by the API server under
//! `/console`, for the people who answer "my code never arrived". Every
//! page calls the same operations as the CLI and the HTTP API (lookup,
//! resend, void, recall, pool settings, imports, dead letters, keys,
//! channels);
//! none is written twice.
//!
//! - [`operators`]: accounts from `codepool operators`, argon2id hashes,
//!   roles viewer < support < admin;
//! - [`sessions`]: a random cookie, its SHA-256 in MongoDB, a CSRF token
//!   per session, expiry and sign-out;
//! - [`throttle`]: sign-in attempts rationed per name and per client
//!   before the password check, and few checks at once;
//! - `pages/`: one module per page, GET and POST handlers side by side.
//!
//! Every read page works without JavaScript; the vendored htmx (served
//! from `/console/static/`, nothing from a CDN) only refreshes the stock
//! numbers in place. The Content-Security-Policy forbids inline script,
//! every string is escaped by the template engine (maud), and no page,
//! URL or log shows a plaintext code unless an admin reveals it (audited
//! before it is shown, shown once).

mod chart;
mod failure;
mod frame;
mod layout;
pub use codepool_issuance::operators;
mod pages;
pub mod sessions;
mod state;
pub mod throttle;

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Request};
use axum::http::{header, HeaderValue};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::Router;
use codepool_issuance::Core;

pub use operators::{OperatorDoc, Role};
pub use state::{Console, ConsoleConfig};

/// Largest form a console page posts (an import upload is streamed and
/// has no such limit).
const FORM_LIMIT: usize = 64 * 1024;

/// The Content-Security-Policy of every console response: scripts and
/// styles only from the console's own files, no inline script.
pub const CSP: &str = "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'";

/// Every console route, under `/console`.
pub fn router(core: Arc<Core>, cfg: ConsoleConfig) -> Router {
    let console = Arc::new(Console {
        core,
        cfg,
        throttle: throttle::Throttle::default(),
    });
    let upload = Router::new()
        .route(
            "/console/pools/{pool}/imports",
            post(pages::imports::upload),
        )
        .layer(DefaultBodyLimit::disable());
    Router::new()
        .route("/console", get(|| async { Redirect::to("/console/pools") }))
        .route(
            "/console/",
            get(|| async { Redirect::to("/console/pools") }),
        )
        .route("/console/static/{file}", get(pages::assets::file))
        .route(
            "/console/signin",
            get(pages::signin::form).post(pages::signin::submit),
        )
        .route("/console/signout", post(pages::signin::signout))
        .route(
            "/console/pools",
            get(pages::pools::list).post(pages::pools::create),
        )
        .merge(pool_routes())
        .merge(channel_routes())
        .route("/console/orders", get(pages::orders::search))
        .route("/console/orders/{id}", get(pages::orders::show))
        .route("/console/orders/{id}/resend", post(pages::orders::resend))
        .route("/console/orders/{id}/void", post(pages::orders::void))
        .route(
            "/console/orders/{id}/lines/{line}/replace",
            post(pages::orders::replace),
        )
        .route("/console/orders/{id}/reveal", post(pages::orders::reveal))
        .route("/console/dead-letters", get(pages::dead_letters::list))
        .route(
            "/console/dead-letters/replay",
            post(pages::dead_letters::replay),
        )
        .route(
            "/console/shops",
            get(pages::shops::list).post(pages::shops::create),
        )
        .route("/console/shops/pools", post(pages::shops::set_pools))
        .merge(shop_routes())
        .route(
            "/console/api-keys",
            get(pages::api_keys::list).post(pages::api_keys::create),
        )
        .route("/console/api-keys/revoke", post(pages::api_keys::revoke))
        .route(
            "/console/operators",
            get(pages::operators::list).post(pages::operators::create),
        )
        .route(
            "/console/operators/disable",
            post(pages::operators::disable),
        )
        .route("/console/audit", get(pages::audit::list))
        .layer(DefaultBodyLimit::max(FORM_LIMIT))
        .merge(upload)
        .layer(middleware::from_fn(guard_headers))
        .with_state(console)
}

/// One pool's page, its statement and its forms.
fn pool_routes() -> Router<Arc<Console>> {
    Router::new()
        .route("/console/pools/{pool}", get(pages::pool::show))
        .route("/console/pools/{pool}/live", get(pages::pool::live))
        .route(
            "/console/pools/{pool}/statement",
            get(pages::statement::show),
        )
        .route(
            "/console/pools/{pool}/settings",
            post(pages::pool::settings),
        )
        .route("/console/pools/{pool}/pause", post(pages::pool::pause))
        .route(
            "/console/pools/{pool}/generations",
            post(pages::generations::start),
        )
        .route("/console/pools/{pool}/resume", post(pages::pool::resume))
        .route("/console/imports/{id}/recall", post(pages::pool::recall))
}

/// The channels, one channel's page and its pause and resume.
fn channel_routes() -> Router<Arc<Console>> {
    Router::new()
        .route("/console/channels", get(pages::channels::list))
        .route("/console/channels/{name}", get(pages::channels::show))
        .route(
            "/console/channels/{name}/pause",
            post(pages::channels::pause),
        )
        .route(
            "/console/channels/{name}/resume",
            post(pages::channels::resume),
        )
}

/// One shop's page and its webhook forms.
fn shop_routes() -> Router<Arc<Console>> {
    Router::new()
        .route("/console/shops/{name}", get(pages::shop::show))
        .route("/console/shops/{name}/webhooks/add", post(pages::shop::add))
        .route(
            "/console/shops/{name}/webhooks/toggle",
            post(pages::shop::toggle),
        )
        .route(
            "/console/shops/{name}/webhooks/replay",
            post(pages::shop::replay),
        )
}

/// The headers every console response carries: the CSP, no sniffing, no
/// referrer to other sites, no framing, and no caching of pages (a page
/// may hold a buyer's phone number, or a code an admin revealed). The
/// referrer policy is `same-origin`, not `no-referrer`: under
/// `no-referrer` browsers send `Origin: null` with the console's own
/// forms, which sign-in refuses.
async fn guard_headers(req: Request, next: Next) -> Response {
    let is_static = req.uri().path().starts_with("/console/static/");
    let mut res = next.run(req).await.into_response();
    let h = res.headers_mut();
    h.insert("content-security-policy", HeaderValue::from_static(CSP));
    h.insert(
        "x-content-type-options",
        HeaderValue::from_static("nosniff"),
    );
    h.insert("referrer-policy", HeaderValue::from_static("same-origin"));
    h.insert("x-frame-options", HeaderValue::from_static("DENY"));
    if !is_static {
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    }
    res
}
