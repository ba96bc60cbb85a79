//! `/channels/NAME/...`: the marketplaces' own protocols, one module per
//! marketplace ([`eneba`], [`g2a`], [`kinguin`]), each mapping its wire format to the
//! core's channel operations (`codepool_issuance::channels`) and the
//! core's errors back to the marketplace's own error shape. These routes
//! take no API key: each marketplace authenticates as its contract says
//! (Eneba's static bearer, G2A's OAuth2 tokens, Kinguin's
//! webhook secret), checked by the core.

mod eneba;
mod g2a;
mod kinguin;

use std::sync::Arc;

use axum::extract::DefaultBodyLimit;
use axum::routing::{delete, get, post};
use axum::Router;
use codepool_domain::Purchase;
use codepool_issuance::audit::Actor;
use codepool_issuance::channels::{Placer, Unplaced};
use codepool_issuance::plan::Step;

use crate::state::Api;

/// Most bytes of a marketplace's request body: an Eneba RESERVE or a G2A
/// reservation is well under a kilobyte.
pub const BODY_LIMIT: usize = 64 * 1024;

/// The channels' routes.
pub(crate) fn router(api: Arc<Api>) -> Router {
    Router::new()
        .route("/channels/{name}/eneba", post(eneba::callback))
        .route("/channels/{name}/kinguin", post(kinguin::webhook))
        .route("/channels/{name}/g2a/oauth/token", get(g2a::token))
        .route("/channels/{name}/g2a/healthcheck", get(g2a::healthcheck))
        .route("/channels/{name}/g2a/reservation", post(g2a::reserve))
        .route(
            "/channels/{name}/g2a/reservation/{rid}",
            axum::routing::put(g2a::renew).delete(g2a::release),
        )
        .route("/channels/{name}/g2a/order", post(g2a::order))
        .route(
            "/channels/{name}/g2a/order/{rid}/inventory",
            get(g2a::inventory).delete(g2a::returns),
        )
        .route(
            "/channels/{name}/g2a/order/{rid}/inventory/{id}",
            delete(g2a::returns_one),
        )
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(api)
}

/// The HTTP door places a channel's orders through its own order batch,
/// as it places `POST /v1/orders`.
#[async_trait::async_trait]
impl Placer for Api {
    async fn place(&self, purchase: Purchase, actor: Actor) -> Result<Step, Unplaced> {
        self.orders
            .decide(purchase, actor.who, actor.via)
            .await
            .map_err(|e| Unplaced {
                retryable: e.is_unavailable(),
                why: e.to_string(),
            })
    }
}

/// The secret of `Authorization: Bearer SECRET`.
fn bearer(headers: &axum::http::HeaderMap) -> Option<String> {
    headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(crate::bearer_token)
        .map(str::to_owned)
}
