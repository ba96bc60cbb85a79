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
use axum::Router;
use codepool_domain::Purchase;
use codepool_issuance::audit::Actor;
use codepool_issuance::channels::{Placer, Unplaced};
use codepool_issuance::plan::Step;
use utoipa::openapi::schema::{Object, ObjectBuilder, SchemaType, Type};
use utoipa::openapi::security::{ApiKey, ApiKeyValue, HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::state::Api;

/// Most bytes of a marketplace's request body: an Eneba RESERVE or a G2A
/// reservation is well under a kilobyte.
pub const BODY_LIMIT: usize = 64 * 1024;

/// The channels' routes with their OpenAPI annotations: the document's
/// channel paths are made from the very routes served, each
/// marketplace's bodies and error shape beside its handlers.
pub(crate) fn documented() -> OpenApiRouter<Arc<Api>> {
    OpenApiRouter::new()
        .routes(routes!(eneba::callback))
        .routes(routes!(kinguin::webhook))
        .routes(routes!(g2a::token))
        .routes(routes!(g2a::healthcheck))
        .routes(routes!(g2a::reserve))
        .routes(routes!(g2a::renew, g2a::release))
        .routes(routes!(g2a::order))
        .routes(routes!(g2a::inventory, g2a::returns))
        .routes(routes!(g2a::returns_one))
}

/// The channels' routes, outside the `/v1` keys and problems, with their
/// own body limit.
pub(crate) fn router(routes: Router<Arc<Api>>, api: Arc<Api>) -> Router {
    routes
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(api)
}

/// The marketplaces' ways of authenticating, as the document names them.
pub(crate) fn security_schemes() -> Vec<(&'static str, SecurityScheme)> {
    let bearer = |what: &str| {
        SecurityScheme::Http(
            HttpBuilder::new()
                .scheme(HttpAuthScheme::Bearer)
                .description(Some(what))
                .build(),
        )
    };
    vec![
        (
            "eneba_token",
            bearer("the static bearer token registered with Eneba (the channel's `token`)"),
        ),
        (
            "g2a_token",
            bearer("an access token of `GET /channels/{name}/g2a/oauth/token`"),
        ),
        (
            "kinguin_secret",
            SecurityScheme::ApiKey(ApiKey::Header(ApiKeyValue::with_description(
                "X-Auth-Token",
                "the webhook secret set in Kinguin's merchant panel",
            ))),
        ),
    ]
}

/// A marketplace's id: a number, or text of 1 to 60 of A-Z a-z 0-9 `_`
/// `-`.
pub(crate) fn id_schema() -> Object {
    ObjectBuilder::new()
        .schema_type(SchemaType::from_iter([Type::Integer, Type::String]))
        .build()
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
