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

use crate::audit::{self, Actor, AuditKind};
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
    record_granted(store, &grants).await?;
    let ids: Vec<_> = codes.iter().map(|c| (c.pool.as_str(), c.id)).collect();
    store.mark_hooks_recorded(&ids).await?;
    Ok(codes.len())
}

/// Records the `order.granted` / `order.partly_granted` events of
/// `grants` (those of shops' orders): for grants the shop saw in no
/// answer of its own, such as a marketplace channel's sale, whose keys
/// went to the marketplace. Recording them again records nothing new.
pub async fn record_granted(store: &Store, grants: &[Grant]) -> Result<(), StoreError> {
    let recorded: Vec<NewEvent> = events::parts(grants)
        .into_values()
        .filter_map(|gs| {
            // Lines are claimed in order: the lines before this part's
            // first line were granted before it.
            let held = u64::from(gs[0].part) + gs.len() as u64;
            events::order_granted(&events::OrderPart { grants: gs, held })
        })
        .collect();
    store.record_webhook_events(&recorded).await.map(drop)
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

/// Records `code.redeemed` for the shops' codes among `redeemed` (each as
/// it was before, with when it was redeemed).
pub async fn record_redeemed(
    store: &Store,
    redeemed: &[codepool_store::lifecycle::Applied],
) -> Result<(), StoreError> {
    let events: Vec<_> = redeemed
        .iter()
        .filter_map(|a| events::code_redeemed(&a.before, a.at.to_chrono()))
        .collect();
    store.record_webhook_events(&events).await.map(|_| ())
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
    audit::record(store, actor, AuditKind::WebhookAdd, what).await?;
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
        true => (AuditKind::WebhookEnable, "enabled"),
        false => (AuditKind::WebhookDisable, "disabled"),
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
    audit::record(store, actor, AuditKind::WebhookRotate, what).await?;
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

/// What a replay made due.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Replayed {
    /// Deliveries made due.
    pub due: u64,
    /// Deliveries left out: events older than the endpoint they would go
    /// to, not asked for (`include_before_endpoint`).
    pub left_out: u64,
}

/// Whether events of type `kind` carry codes in plaintext.
fn carries_codes(kind: &str) -> bool {
    kind == events::ORDER_GRANTED || kind == events::ORDER_PARTLY_GRANTED
}

/// Sends a shop's events again: one event, or every event since a time,
/// to one endpoint or to every endpoint of the shop that wants them.
///
/// An endpoint gets only events recorded since it was added, unless
/// `include_before_endpoint`: an endpoint added later (a new receiver, or
/// someone else's) never saw the shop's earlier codes, and a replay would
/// send them in plaintext. When asked, the codes such a replay sends to an
/// endpoint that never had them are a reveal: audited, code ids and all,
/// before anything is made due (no record, no replay). The replay itself
/// is audited too. Returns what was made due and what was left out.
pub async fn replay(
    store: &Store,
    shop: &str,
    scope: &ReplayScope,
    endpoint: Option<&str>,
    include_before_endpoint: bool,
    actor: &Actor,
) -> Result<Replayed, WebhookError> {
    if store.shop(shop).await?.is_none() {
        return Err(WebhookError::UnknownShop(shop.to_owned()));
    }
    if let Some(id) = endpoint {
        self::endpoint(store, id, Some(shop)).await?;
    }
    let (found, endpoints) = store.replay_candidates(shop, scope, endpoint).await?;
    let mut due = Vec::new();
    let mut left_out = 0;
    // Events with codes that go to an endpoint added after them.
    let mut revealed: Vec<&str> = Vec::new();
    for e in &found {
        for p in endpoints.iter().filter(|p| p.wants(&e.kind)) {
            if e.created_at < p.created_at {
                if !include_before_endpoint {
                    left_out += 1;
                    continue;
                }
                if carries_codes(&e.kind) && !revealed.contains(&e.id.as_str()) {
                    revealed.push(&e.id);
                }
            }
            due.push((e, p));
        }
    }
    let what = match scope {
        ReplayScope::Event(id) => format!("event {id}"),
        ReplayScope::Since(t) => format!(
            "events since {}",
            t.try_to_rfc3339_string().unwrap_or_default()
        ),
    };
    let to = endpoint.map_or_else(|| "every endpoint".to_owned(), |e| format!("endpoint {e}"));
    if !revealed.is_empty() {
        let ids = revealed_codes(store, &revealed).await?;
        let count = ids.len() as u64;
        let what = format!(
            "shop {shop:?}: {what} replayed to {to}, which was added after {} of them ({}): their codes in plaintext",
            revealed.len(),
            revealed.join(", ")
        );
        audit::reveal(store, actor, what, ids, count).await?;
    }
    let made = store.make_webhooks_due(&due).await?;
    let older = if include_before_endpoint {
        "events older than their endpoint included"
    } else {
        "events older than their endpoint left out"
    };
    audit::record(
        store,
        actor,
        AuditKind::WebhookReplay,
        format!("shop {shop:?}: {what} replayed to {to}: {made} deliveries due, {left_out} left out ({older})"),
    )
    .await?;
    debug!(shop, due = made, left_out, "webhook replay");
    Ok(Replayed {
        due: made,
        left_out,
    })
}

/// The codes the granted events `ids` carry, by id: each event's order and
/// lines, as its body names them.
async fn revealed_codes(
    store: &Store,
    ids: &[&str],
) -> Result<Vec<codepool_domain::CodeId>, WebhookError> {
    let mut out = Vec::new();
    for id in ids {
        let Some(event) = store.webhook_event(id).await? else {
            continue;
        };
        let body: serde_json::Value = serde_json::from_str(&event.body).unwrap_or_default();
        let data = &body["data"];
        let Some(order) = data["order_id"].as_str() else {
            continue;
        };
        let lines: Vec<u32> = (data["codes"].as_array().into_iter().flatten())
            .filter_map(|c| c["line"].as_u64())
            .filter_map(|l| u32::try_from(l).ok())
            .collect();
        for code in store.code_ids_on_lines(order, &lines).await? {
            if !out.contains(&code) {
                out.push(code);
            }
        }
    }
    Ok(out)
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
