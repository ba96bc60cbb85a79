//! Declared stock: what each channel tells its marketplace it may sell of
//! each mapped product, so that a marketplace never promises a key the
//! pool does not have.
//!
//! What a channel may sell of a product is the free codes of its pool,
//! capped by the channel (`--share PERCENT` of those free codes, `--max
//! N`): [`declarable`]. G2A reads it in every answer's `inventory_size`;
//! Eneba is told it through its API (`S_updateAuction(input: {id,
//! declaredStock})`), Kinguin through its own (`PATCH
//! /api/v1/offers/{offerId}` `{declaredStock, declaredTextStock}`), by
//! every granting process ([`run`], started with the process's background
//! work like the relay):
//! - on change: a grant, a hold or a release marks its pools
//!   ([`changed`]), and the products of those pools are declared again
//!   once a second at most (the debounce), each only when its amount
//!   differs from the last declaration;
//! - at once when a pool runs out ([`ran_out`]): 0 goes out without the
//!   debounce;
//! - on a schedule ([`DECLARE_EVERY`]): every product again, changed or
//!   not, so a declaration lost on the way is made good.
//!
//! The last declaration of each product is kept on the channel
//! (`declared`), so a reservation refused for lack of stock while the
//! channel promised some is counted, by any process, as an over-promise
//! (`codepool_channel_overpromised_total{channel}`). An amount the
//! marketplace refuses (Kinguin's "Max declared stock has been exceeded")
//! is logged and counted as a failed declaration, and not sent again on
//! change until the next scheduled round.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant};

use codepool_store::channels::{ChannelDoc, DealLine};
use codepool_store::{Store, StoreError};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::Kind;

/// How often every product of every channel is declared again.
pub const DECLARE_EVERY: Duration = Duration::from_secs(60);
/// The least time between two declarations on change (a pool that runs
/// out is declared at once).
pub const DEBOUNCE: Duration = Duration::from_secs(1);
/// Eneba's API (GraphQL) unless the channel names another.
pub const ENEBA_API_URL: &str = "https://api.eneba.com/";
/// Eneba's token endpoint unless the channel names another.
pub const ENEBA_AUTH_URL: &str = "https://user.eneba.com/oauth/token";
/// The OAuth client id every Eneba API consumer presents beside its own
/// id and secret (Eneba's published client's default).
pub const ENEBA_OAUTH_CLIENT: &str = "917611c2-70a5-11e9-97c4-46691b78bfa2";
/// How long one call to a marketplace's API may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// What a channel may sell of a product whose pool has `free` codes: the
/// free codes, capped by the channel's share of them and its maximum; none
/// while the channel is paused (it reserves nothing, so it promises
/// nothing: a marketplace that reserved what it was promised would count
/// each refusal as a failure).
pub fn cap(c: &ChannelDoc, free: u64) -> u64 {
    if c.paused {
        return 0;
    }
    let mut n = free;
    if let Some(p) = c.share_percent {
        n = n.min(free * p.clamp(0, 100) as u64 / 100);
    }
    if let Some(m) = c.max_stock {
        n = n.min(m.max(0) as u64);
    }
    n
}

/// What channel `c` may sell of a product of `pool` now.
pub async fn declarable(store: &Store, c: &ChannelDoc, pool: &str) -> Result<u64, StoreError> {
    Ok(cap(c, store.unissued_stock(pool).await?))
}

/// Pools whose free stock changed since the declarer last looked.
#[derive(Default)]
struct Changes {
    dirty: Mutex<BTreeSet<String>>,
    urgent: Mutex<bool>,
    notify: Notify,
}

static CHANGES: LazyLock<Changes> = LazyLock::new(Changes::default);

/// The free stock of `pools` changed (grants, holds, releases): their
/// products are declared again after the debounce.
pub fn changed<'a>(pools: impl IntoIterator<Item = &'a str>) {
    let mut any = false;
    if let Ok(mut d) = CHANGES.dirty.lock() {
        for p in pools {
            any |= d.insert(p.to_owned());
        }
    }
    if any {
        CHANGES.notify.notify_one();
    }
}

/// `pool` ran out (a grant or a hold found it empty): its products are
/// declared again now, not after the debounce.
pub fn ran_out(pool: &str) {
    if let Ok(mut d) = CHANGES.dirty.lock() {
        d.insert(pool.to_owned());
    }
    if let Ok(mut u) = CHANGES.urgent.lock() {
        *u = true;
    }
    CHANGES.notify.notify_one();
}

fn take_changes() -> (BTreeSet<String>, bool) {
    let dirty = CHANGES
        .dirty
        .lock()
        .map(|mut d| std::mem::take(&mut *d))
        .unwrap_or_default();
    let urgent = CHANGES
        .urgent
        .lock()
        .map(|mut u| std::mem::take(&mut *u))
        .unwrap_or_default();
    (dirty, urgent)
}

/// A reservation of `lines` was refused for lack of stock: each product
/// the channel last declared some of counts as an over-promise, and its
/// pool is declared again at once.
pub fn refused_for_stock(c: &ChannelDoc, lines: &[DealLine]) {
    for l in lines {
        if c.declared.get(&l.product).copied().unwrap_or(0) > 0 {
            metrics::counter!("codepool_channel_overpromised_total", "channel" => c.name.clone())
                .increment(1);
        }
        ran_out(&l.pool);
    }
}

/// Why a declaration did not reach the marketplace.
#[derive(Debug, thiserror::Error)]
pub enum DeclareError {
    #[error("the channel has no API credentials (api_client_id, api_secret)")]
    NoCredentials,
    #[error("{0}")]
    Store(#[from] StoreError),
    #[error("the marketplace's API: {0}")]
    Api(String),
    /// The marketplace refused the amount (Kinguin's 400 "Max declared
    /// stock has been exceeded"): the same amount again is refused again.
    #[error("the marketplace refused the declaration: {0}")]
    Refused(String),
}

/// Declares stock to the marketplaces' APIs (Eneba's, Kinguin's), keeping
/// each channel's access token until it expires.
pub struct Declarer {
    store: Store,
    client: reqwest::Client,
    tokens: Mutex<HashMap<String, (String, Instant)>>,
    /// Kinguin's tokens, shared with the process's uploader.
    kinguin: Arc<super::kinguin::client::Tokens>,
    /// The least amount the marketplace refused of each (channel,
    /// product): not sent again on change at that amount or above; the
    /// scheduled round tries again (the marketplace's limit may have
    /// been raised).
    refused: Mutex<HashMap<(String, String), u64>>,
}

impl Declarer {
    pub fn new(store: Store, kinguin: Arc<super::kinguin::client::Tokens>) -> Arc<Self> {
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .timeout(CALL_TIMEOUT)
            .user_agent(concat!("codepool-channels/", env!("CARGO_PKG_VERSION")))
            .build()
            .expect("the channels' HTTP client builds (rustls, no system settings read)");
        Arc::new(Self {
            store,
            client,
            tokens: Mutex::new(HashMap::new()),
            kinguin,
            refused: Mutex::new(HashMap::new()),
        })
    }

    /// Declares the products of every channel that pushes its stock
    /// ([`pushes`]) whose pool is one of `pools`
    /// (every product: `None`). `force`: each one, changed or not;
    /// otherwise only those whose amount differs from the last
    /// declaration. A channel that fails is logged and left for the next
    /// round; the others go on. How many declarations went out.
    pub async fn declare(&self, pools: Option<&BTreeSet<String>>, force: bool) -> usize {
        let channels = match self.store.channels().await {
            Ok(c) => c,
            Err(e) => {
                debug!(error = %e, "declared stock skipped; retried at the next change or round");
                return 0;
            }
        };
        let mut sent = 0;
        for c in channels.iter().filter(|c| pushes(c)) {
            match self.declare_channel(c, pools, force).await {
                Ok(n) => sent += n,
                Err(e) => {
                    warn!(channel = %c.name, error = %e, "declared stock not sent; retried at the next change or round");
                    declaration(c, "failed");
                }
            }
        }
        sent
    }

    /// Declares channel `c`'s products of `pools` (see [`Self::declare`]).
    /// A product whose amount the marketplace refuses is logged and
    /// counted, and the others go on; any other failure ends the round
    /// for the channel.
    pub async fn declare_channel(
        &self,
        c: &ChannelDoc,
        pools: Option<&BTreeSet<String>>,
        force: bool,
    ) -> Result<usize, DeclareError> {
        let mut free: HashMap<&str, u64> = HashMap::new();
        let mut sent = 0;
        for (product, pool) in &c.products {
            if pools.is_some_and(|p| !p.contains(pool)) {
                continue;
            }
            let n = match free.get(pool.as_str()) {
                Some(n) => *n,
                None => {
                    let n = self.store.unissued_stock(pool).await?;
                    free.insert(pool, n);
                    n
                }
            };
            let n = cap(c, n);
            if !force
                && (c.declared.get(product) == Some(&(n as i64)) || self.refuses(c, product, n))
            {
                continue;
            }
            match self.push(c, product, n).await {
                Ok(()) => {}
                Err(DeclareError::Refused(why)) => {
                    warn!(channel = %c.name, product = %product, declared = n, why = %why, "the marketplace refused a declared stock; not sent again at that amount until the next round");
                    declaration(c, "failed");
                    self.remember_refused(c, product, Some(n));
                    continue;
                }
                Err(e) => return Err(e),
            }
            self.remember_refused(c, product, None);
            self.store
                .record_declared(&c.name, product, n as i64)
                .await?;
            declaration(c, "completed");
            metrics::gauge!("codepool_channel_declared_stock", "channel" => c.name.clone(), "product" => product.clone()).set(n as f64);
            sent += 1;
        }
        Ok(sent)
    }

    /// Sends one declaration to `c`'s marketplace.
    async fn push(&self, c: &ChannelDoc, product: &str, n: u64) -> Result<(), DeclareError> {
        if c.kind == Kind::Kinguin.as_str() {
            use super::kinguin::client::{declare, NotDeclared};
            return match declare(&self.client, &self.kinguin, &self.store, c, product, n).await {
                Ok(()) => Ok(()),
                Err(NotDeclared::Refused(why)) => Err(DeclareError::Refused(why)),
                Err(NotDeclared::Failed(why)) => Err(DeclareError::Api(why)),
            };
        }
        self.push_eneba(c, product, n).await
    }

    /// Whether the marketplace refused `n` of `product` (or less) since.
    fn refuses(&self, c: &ChannelDoc, product: &str, n: u64) -> bool {
        let refused = self.refused.lock().unwrap_or_else(|e| e.into_inner());
        (refused.get(&(c.name.clone(), product.to_owned()))).is_some_and(|least| n >= *least)
    }

    /// Records that the marketplace refused `n` of `product` (`None`: it
    /// took a declaration).
    fn remember_refused(&self, c: &ChannelDoc, product: &str, n: Option<u64>) {
        let mut refused = self.refused.lock().unwrap_or_else(|e| e.into_inner());
        let key = (c.name.clone(), product.to_owned());
        match n {
            Some(n) => {
                let least = refused.entry(key).or_insert(n);
                *least = (*least).min(n);
            }
            None => {
                refused.remove(&key);
            }
        }
    }

    /// An access token of Eneba's API for `c`, fetched when none is kept
    /// or it is about to expire.
    async fn token(&self, c: &ChannelDoc) -> Result<String, DeclareError> {
        if let Some((t, until)) = self
            .tokens
            .lock()
            .ok()
            .and_then(|t| t.get(&c.name).cloned())
        {
            if until > Instant::now() {
                return Ok(t);
            }
        }
        let id = self.open(c, "api_client_id")?;
        let secret = self.open(c, "api_secret")?;
        let url = c.auth_url.as_deref().unwrap_or(ENEBA_AUTH_URL);
        let form = url::form_urlencoded::Serializer::new(String::new())
            .append_pair("grant_type", "api_consumer")
            .append_pair("client_id", ENEBA_OAUTH_CLIENT)
            .append_pair("id", &id)
            .append_pair("secret", &secret)
            .finish();
        let answer = self
            .client
            .post(url)
            .header("content-type", "application/x-www-form-urlencoded")
            .body(form)
            .send()
            .await
            .map_err(|e| DeclareError::Api(format!("token: {e}")))?;
        let status = answer.status();
        let body = answer
            .bytes()
            .await
            .map_err(|e| DeclareError::Api(format!("token: {e}")))?;
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        let Some(token) = v["access_token"].as_str().filter(|_| status.is_success()) else {
            return Err(DeclareError::Api(format!("token: {status}")));
        };
        // Kept until a minute before it expires (Eneba's last 29 days).
        let life = v["expires_in"].as_u64().unwrap_or(3600).saturating_sub(60);
        let until = Instant::now() + Duration::from_secs(life);
        if let Ok(mut t) = self.tokens.lock() {
            t.insert(c.name.clone(), (token.to_owned(), until));
        }
        Ok(token.to_owned())
    }

    /// A sealed secret of `c`, opened.
    fn open(&self, c: &ChannelDoc, field: &str) -> Result<String, DeclareError> {
        let s = c.sealed.get(field).ok_or(DeclareError::NoCredentials)?;
        let ring = self.store.keys().ring_with(&s.key_id)?;
        let aad = format!("channel:{}:{field}", c.name);
        ring.open(&s.key_id, aad.as_bytes(), &s.bytes.bytes)
            .map_err(|e| DeclareError::Store(StoreError::from(e)))
    }

    /// `S_updateAuction(input: {id: AUCTION, declaredStock: N})`.
    async fn push_eneba(&self, c: &ChannelDoc, auction: &str, n: u64) -> Result<(), DeclareError> {
        let url = c.api_url.as_deref().unwrap_or(ENEBA_API_URL);
        // The auction id is a product id codepool took (letters, digits,
        // `_`, `-`): safe inside the query's quotes.
        let query = format!(
            "mutation {{ S_updateAuction(input: {{id: \"{auction}\", declaredStock: {n}}}) {{ success actionId }} }}"
        );
        let body = serde_json::json!({ "query": query }).to_string();
        for attempt in 0..2 {
            let token = self.token(c).await?;
            let answer = self
                .client
                .post(url)
                .header("content-type", "application/json")
                .bearer_auth(&token)
                .body(body.clone())
                .send()
                .await
                .map_err(|e| DeclareError::Api(e.to_string()))?;
            let status = answer.status();
            if status == reqwest::StatusCode::UNAUTHORIZED && attempt == 0 {
                // The token expired early: a new one, once.
                if let Ok(mut t) = self.tokens.lock() {
                    t.remove(&c.name);
                }
                continue;
            }
            let bytes = answer
                .bytes()
                .await
                .map_err(|e| DeclareError::Api(e.to_string()))?;
            let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
            let ok = status.is_success()
                && v.get("errors").is_none()
                && v["data"]["S_updateAuction"]["success"] == serde_json::Value::Bool(true);
            if !ok {
                return Err(DeclareError::Api(format!(
                    "S_updateAuction {auction}: {status} {}",
                    String::from_utf8_lossy(&bytes)
                        .chars()
                        .take(200)
                        .collect::<String>()
                )));
            }
            return Ok(());
        }
        Err(DeclareError::Api("the API refused a fresh token".into()))
    }
}

/// Counts one declaration by its outcome (`completed`, `failed`).
fn declaration(c: &ChannelDoc, outcome: &'static str) {
    metrics::counter!("codepool_channel_declarations_total", "channel" => c.name.clone(), "outcome" => outcome).increment(1);
}

/// Whether `c` pushes its declarations: Eneba with API credentials,
/// Kinguin with its API client (the one its uploads use).
pub fn pushes(c: &ChannelDoc) -> bool {
    match c.kind.parse::<Kind>() {
        Ok(Kind::Eneba) => c.sealed.contains_key("api_secret"),
        Ok(Kind::Kinguin) => c.sealed.contains_key("client_secret") && c.base_url.is_some(),
        _ => false,
    }
}

/// Declares stock until `stop`: on change (at most once per
/// [`DEBOUNCE`], a pool that ran out at once) and every `every`.
pub async fn run(declarer: Arc<Declarer>, every: Duration, stop: CancellationToken) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last = Instant::now() - DEBOUNCE;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {
                let _ = take_changes();
                declarer.declare(None, true).await;
                last = Instant::now();
            }
            _ = CHANGES.notify.notified() => {
                let urgent = CHANGES.urgent.lock().map(|u| *u).unwrap_or(false);
                let wait = (last + DEBOUNCE).saturating_duration_since(Instant::now());
                if !urgent && !wait.is_zero() {
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(wait) => {}
                    }
                }
                let (pools, _) = take_changes();
                if !pools.is_empty() {
                    declarer.declare(Some(&pools), false).await;
                    last = Instant::now();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn channel(share: Option<i32>, max: Option<i64>) -> ChannelDoc {
        ChannelDoc {
            name: "en".into(),
            kind: "eneba".into(),
            shop: "acme".into(),
            paused: false,
            inbound_hash: String::new(),
            client_id: None,
            sealed: Default::default(),
            base_url: None,
            products: Default::default(),
            hold_ttl_seconds: 60,
            after_provide: "burn".into(),
            token_ttl_seconds: None,
            share_percent: share,
            max_stock: max,
            api_url: None,
            auth_url: None,
            declared: Default::default(),
            created_at: bson::DateTime::now(),
            updated_at: None,
        }
    }

    #[test]
    fn a_declaration_is_the_free_codes_capped_by_share_and_max() {
        assert_eq!(cap(&channel(None, None), 17), 17);
        assert_eq!(cap(&channel(Some(50), None), 17), 8);
        assert_eq!(cap(&channel(None, Some(5)), 17), 5);
        assert_eq!(cap(&channel(Some(50), Some(5)), 6), 3);
        assert_eq!(cap(&channel(Some(100), Some(50)), 0), 0, "none free: 0");
        let paused = ChannelDoc {
            paused: true,
            ..channel(None, None)
        };
        assert_eq!(cap(&paused, 17), 0, "a paused channel promises nothing");
    }
}
