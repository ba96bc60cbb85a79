//! Webhooks: what happened to a shop's orders and pools, told to the
//! shop's endpoints to the Standard Webhooks specification.
//!
//! - Recorded with the decision. A grant a shop has not seen in an HTTP
//!   answer (an AMQP purchase, a backorder fulfilled) is flagged
//!   `hook_pending` by the claim's own write; [`stage_grants`] turns the
//!   flags into events. Refusals are recorded with the batch's backorders,
//!   voids with the void, pool events where they are published. Event ids
//!   come from what they announce ([`events::event_id`]), so recording
//!   again changes nothing.
//! - Delivered at least once ([`deliver`]): one task per event and
//!   endpoint, leased by one process at a time, on the schedule
//!   [`deliver::SCHEDULE`], signed ([`sign`]), only to public addresses
//!   ([`guard`]).
//! - Managed here for every door: add, list, enable, disable, rotate the
//!   secret, deliveries and replay, each change audited.

pub mod deliver;
pub mod events;
pub mod guard;
pub mod sign;

use codepool_domain::{Code, Grant, PoolEvent};
use codepool_store::webhooks::{AttemptDoc, EndpointDoc, NewEvent, ReplayScope};
use codepool_store::{Store, StoreError};
use tracing::{debug, warn};

use crate::audit::{self, Actor};
use guard::{AddressError, AllowHosts};

pub use deliver::Deliverer;

/// How long a rotated-out secret keeps signing beside the new one.
pub const ROTATION_OVERLAP: chrono::Duration = chrono::Duration::hours(24);

/// Turns grants flagged `hook_pending` into `order.granted` /
/// `order.partly_granted` events, then takes the flags off. Returns how
/// many grants it took off the list.
pub async fn stage_grants(store: &Store, limit: i64) -> Result<usize, StoreError> {
    let codes = store.grants_owing_hooks(limit).await?;
    if codes.is_empty() {
        return Ok(0);
    }
    let grants: Vec<Grant> = codes.iter().filter_map(Code::grant).collect();
    let recorded: Vec<NewEvent> = events::parts(&grants)
        .into_values()
        .filter_map(|gs| {
            // Lines are claimed in order: the lines before this part's
            // first line were granted before it.
            let held = u64::from(gs[0].part) + gs.len() as u64;
            events::order_granted(&events::OrderPart { grants: gs, held })
        })
        .collect();
    store.record_webhook_events(&recorded).await?;
    let ids: Vec<_> = codes.iter().map(|c| c.id).collect();
    store.mark_hooks_recorded(&ids).await?;
    Ok(codes.len())
}

/// Records the webhook form of a pool event for every shop that orders
/// from the pool: one event per shop, named by `occurrence` (what makes
/// this event one of its kind: the crossing's or the exhaustion's number,
/// an import's time), so telling it again records nothing new. A
/// notification: a failure is logged and counted; `false` then.
pub async fn record_pool_event(store: &Store, event: &PoolEvent, occurrence: &str) -> bool {
    let result = async {
        let shops: Vec<String> = (store.shops().await?.into_iter())
            .filter(|s| s.allows(&event.pool))
            .map(|s| s.name)
            .collect();
        store
            .record_webhook_events(&events::pool_event(event, &shops, occurrence))
            .await
    }
    .await;
    if let Err(e) = &result {
        warn!(pool = %event.pool, event = %event.event, error = %e, "webhook event not recorded");
        metrics::counter!("codepool_webhook_record_failures_total", "event" => event.event.clone())
            .increment(1);
    }
    result.is_ok()
}

/// Records `order.voided` for the shops' grants among `voided`.
pub async fn record_voided(store: &Store, voided: &[Code], reason: &str) -> Result<(), StoreError> {
    let grants: Vec<Grant> = voided.iter().filter_map(Code::grant).collect();
    store
        .record_webhook_events(&events::order_voided(&grants, reason))
        .await
        .map(|_| ())
}

/// Why an endpoint was not added or changed.
#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    #[error("no shop is named {0:?}: create it first with `codepool shops create --name {0}`")]
    UnknownShop(String),
    #[error("no webhook endpoint has the id {0:?}: see `codepool webhooks list`")]
    UnknownEndpoint(String),
    #[error("{0:?} is not an event type; choose from {types}", types = events::EVENT_TYPES.join(", "))]
    UnknownEvent(String),
    #[error("name at least one event type, from {types}", types = events::EVENT_TYPES.join(", "))]
    NoEvents,
    #[error(transparent)]
    Address(#[from] AddressError),
    #[error("{0:?} is not an event id (msg_…) or a time (RFC 3339, e.g. 2026-11-25T10:00:00Z)")]
    Scope(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// An endpoint just added: its record, and its secret, shown this once.
#[derive(Debug)]
pub struct Added {
    pub endpoint: EndpointDoc,
    pub secret: String,
}

/// The event types in `list` (comma-separated, `*` for all), checked and
/// sorted.
pub fn event_types(list: &str) -> Result<Vec<String>, WebhookError> {
    let mut out = Vec::new();
    for t in list.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        if t == "*" {
            out.extend(events::EVENT_TYPES.iter().map(|t| (*t).to_owned()));
        } else if events::EVENT_TYPES.contains(&t) {
            out.push(t.to_owned());
        } else {
            return Err(WebhookError::UnknownEvent(t.to_owned()));
        }
    }
    out.sort();
    out.dedup();
    if out.is_empty() {
        return Err(WebhookError::NoEvents);
    }
    Ok(out)
}

/// Adds an endpoint to a shop, its address checked now (and again at
/// every delivery). Audited.
pub async fn add(
    store: &Store,
    shop: &str,
    url: &str,
    events: &str,
    allow: &AllowHosts,
    actor: &Actor,
) -> Result<Added, WebhookError> {
    let events = event_types(events)?;
    if store.shop(shop).await?.is_none() {
        return Err(WebhookError::UnknownShop(shop.to_owned()));
    }
    let url = guard::check_endpoint(url, allow).await?;
    let id = format!("ep_{}", hex::encode(rand::random::<[u8; 10]>()));
    let secret = sign::new_secret();
    let endpoint = store
        .add_webhook_endpoint(&id, shop, url.as_str(), &events, &secret)
        .await?;
    let what = format!(
        "webhook {id} of shop {shop:?} added: {url} for {}",
        events.join(",")
    );
    audit::record(store, actor, "webhook-add", what).await?;
    Ok(Added { endpoint, secret })
}

/// An endpoint, if it is the shop's (any shop's when `shop` is `None`).
pub async fn endpoint(
    store: &Store,
    id: &str,
    shop: Option<&str>,
) -> Result<EndpointDoc, WebhookError> {
    match store.webhook_endpoint(id).await? {
        Some(e) if shop.is_none_or(|s| s == e.shop) => Ok(e),
        _ => Err(WebhookError::UnknownEndpoint(id.to_owned())),
    }
}

/// Enables or disables an endpoint. Audited.
pub async fn set_enabled(
    store: &Store,
    id: &str,
    enabled: bool,
    actor: &Actor,
) -> Result<EndpointDoc, WebhookError> {
    let reason = format!("disabled by {}", actor.who);
    let after = store
        .set_webhook_enabled(id, enabled, &reason)
        .await?
        .ok_or_else(|| WebhookError::UnknownEndpoint(id.to_owned()))?;
    let (kind, done) = match enabled {
        true => ("webhook-enable", "enabled"),
        false => ("webhook-disable", "disabled"),
    };
    let what = format!("webhook {id} of shop {:?} {done}", after.shop);
    audit::record(store, actor, kind, what).await?;
    Ok(after)
}

/// Gives an endpoint a new secret; the old one signs too for
/// [`ROTATION_OVERLAP`]. Returns the new secret, shown this once. Audited.
pub async fn rotate_secret(store: &Store, id: &str, actor: &Actor) -> Result<String, WebhookError> {
    let secret = sign::new_secret();
    let until = bson::DateTime::from_chrono(chrono::Utc::now() + ROTATION_OVERLAP);
    let after = store
        .rotate_webhook_secret(id, &secret, until)
        .await?
        .ok_or_else(|| WebhookError::UnknownEndpoint(id.to_owned()))?;
    let what = format!(
        "webhook {id} of shop {:?}: secret rotated; the old one signs until {}",
        after.shop,
        until.try_to_rfc3339_string().unwrap_or_default()
    );
    audit::record(store, actor, "webhook-rotate", what).await?;
    Ok(secret)
}

/// What to replay: an event id (`msg_…`) or a time (RFC 3339).
pub fn replay_scope(what: &str) -> Result<ReplayScope, WebhookError> {
    let what = what.trim();
    if what.starts_with("msg_")
        && what.len() <= 64
        && what.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    {
        return Ok(ReplayScope::Event(what.to_owned()));
    }
    chrono::DateTime::parse_from_rfc3339(what)
        .map(|t| ReplayScope::Since(bson::DateTime::from_chrono(t.with_timezone(&chrono::Utc))))
        .map_err(|_| WebhookError::Scope(what.to_owned()))
}

/// Sends a shop's events again: one event, or every event since a time,
/// to one endpoint or to every endpoint of the shop that wants them.
/// Audited. Returns the deliveries made due.
pub async fn replay(
    store: &Store,
    shop: &str,
    scope: &ReplayScope,
    endpoint: Option<&str>,
    actor: &Actor,
) -> Result<u64, WebhookError> {
    if store.shop(shop).await?.is_none() {
        return Err(WebhookError::UnknownShop(shop.to_owned()));
    }
    if let Some(id) = endpoint {
        self::endpoint(store, id, Some(shop)).await?;
    }
    let due = store.replay_webhooks(shop, scope, endpoint).await?;
    let what = match scope {
        ReplayScope::Event(id) => format!("event {id}"),
        ReplayScope::Since(t) => format!(
            "events since {}",
            t.try_to_rfc3339_string().unwrap_or_default()
        ),
    };
    let to = endpoint.map_or_else(|| "every endpoint".to_owned(), |e| format!("endpoint {e}"));
    audit::record(
        store,
        actor,
        "webhook-replay",
        format!("shop {shop:?}: {what} replayed to {to}: {due} deliveries due"),
    )
    .await?;
    debug!(shop, due, "webhook replay");
    Ok(due)
}

/// The latest delivery attempts of a shop or one endpoint.
pub async fn deliveries(
    store: &Store,
    shop: Option<&str>,
    endpoint: Option<&str>,
    limit: i64,
) -> Result<Vec<AttemptDoc>, WebhookError> {
    Ok(store.webhook_attempts(shop, endpoint, limit).await?)
}
