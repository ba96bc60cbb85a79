//! Channels: a shop's accounts on the key marketplaces (Eneba, G2A,
//! Kinguin), each one more door of the shop's pools. A marketplace's
//! reservation is a hold, its provision the commit of that hold into an
//! order whose id is derived from the marketplace's, its cancellation a
//! release or a void: the same gate as the shop's own checkout, so one pool
//! sells everywhere and nothing is oversold.
//!
//! This module holds the rules every door of a channel shares: a channel
//! is added, mapped, paused and removed here (audited), its secrets are
//! kept here (what the marketplace presents, hashed; what codepool sends
//! out, sealed by the vault), and each marketplace's operations are a
//! module of their own where it has more than these ([`g2a`]'s tokens) over the core's holds and
//! placement. The HTTP door only translates the marketplace's wire format.

pub mod eneba;
pub mod g2a;
pub mod kinguin;
pub mod outcomes;
pub mod stock;

use std::collections::BTreeMap;

use bson::DateTime;
use codepool_domain::{Item, Pool, Purchase};
use codepool_store::channels::{ChannelDoc, DealDoc, DealLine, SealedSecret};
use codepool_store::{Store, StoreError};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use crate::audit::{self, Actor, AuditKind};
use crate::holds::{HoldAsk, HoldError, HoldRequest};
use crate::plan::Step;

pub use outcomes::Call;

pub use codepool_store::channels::{DealState, TokenDoc};

/// The longest a channel's reservation may hold its codes: Eneba's longest
/// payment wait.
pub const MAX_HOLD_TTL_SECONDS: u64 = 48 * 3600;
/// The fewest characters of a secret a marketplace presents: it is
/// compared by its SHA-256, so it must be too long to guess.
pub const MIN_SECRET_CHARS: usize = 32;
/// The longest marketplace product or order id codepool takes.
pub const MAX_EXTERNAL_ID: usize = 60;
/// How long a G2A access token lives unless the channel says otherwise.
pub const DEFAULT_TOKEN_TTL_SECONDS: u64 = 3600;

/// A marketplace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Eneba,
    G2a,
    Kinguin,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Eneba => "eneba",
            Self::G2a => "g2a",
            Self::Kinguin => "kinguin",
        }
    }

    /// How long a reservation holds its codes unless the channel says:
    /// Eneba's payment window; G2A publishes none (30 minutes, as its
    /// integrations use); Kinguin's delivery is pushed within the hour.
    pub fn default_ttl(self) -> u64 {
        match self {
            Self::Eneba => MAX_HOLD_TTL_SECONDS,
            Self::G2a => 1800,
            Self::Kinguin => 3600,
        }
    }

    /// The credential field that holds the secret the marketplace
    /// presents to codepool (hashed, never stored).
    fn inbound_field(self) -> &'static str {
        match self {
            Self::Eneba => "token",
            Self::G2a => "client_secret",
            Self::Kinguin => "webhook_secret",
        }
    }

    /// The credential fields codepool sends out (sealed).
    fn outbound_fields(self) -> &'static [&'static str] {
        match self {
            Self::Eneba => &["api_client_id", "api_secret"],
            Self::G2a => &[],
            Self::Kinguin => &["client_secret"],
        }
    }
}

impl std::str::FromStr for Kind {
    type Err = ChannelError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "eneba" => Ok(Self::Eneba),
            "g2a" => Ok(Self::G2a),
            "kinguin" => Ok(Self::Kinguin),
            other => Err(ChannelError::BadKind(other.chars().take(40).collect())),
        }
    }
}

/// What a cancellation after the keys were provided does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterProvide {
    /// Void the keys; Eneba is told 200: "deleted, never back in stock".
    Burn,
    /// Keep the keys sold; Eneba is told 500: the key returns to Eneba's
    /// own stock, and Eneba sells it again.
    Resell,
}

impl AfterProvide {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Burn => "burn",
            Self::Resell => "resell",
        }
    }

    pub fn of(c: &ChannelDoc) -> Self {
        if c.after_provide == "resell" {
            Self::Resell
        } else {
            Self::Burn
        }
    }
}

impl std::str::FromStr for AfterProvide {
    type Err = ChannelError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "burn" => Ok(Self::Burn),
            "resell" => Ok(Self::Resell),
            other => Err(ChannelError::BadAfterProvide(
                other.chars().take(40).collect(),
            )),
        }
    }
}

/// Why a channel was not added or changed.
#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    #[error("invalid channel name {0:?}: use 1 to 64 characters from A-Z a-z 0-9 . _ -, starting with a letter or a digit")]
    BadName(String),
    #[error("unknown marketplace {0:?}: use eneba, g2a or kinguin")]
    BadKind(String),
    #[error("unknown policy {0:?} for a cancellation after provision: use burn or resell")]
    BadAfterProvide(String),
    #[error("the credentials file is not usable: {0}")]
    BadCredentials(String),
    #[error("invalid product id {0:?}: use 1 to 60 characters from A-Z a-z 0-9 _ -")]
    BadProduct(String),
    #[error(
        "invalid time to live {0}: a reservation holds its codes from 60 s to 48 h (172800 s)"
    )]
    BadTtl(u64),
    #[error("invalid share {0} %: a channel declares 0 to 100 % of its pools' free codes")]
    BadShare(u32),
    #[error("channel {0:?} exists already; remove it first, or pick another name")]
    Exists(String),
    #[error("no channel {0:?}; `codepool channels list` shows the channels")]
    Unknown(String),
    #[error("no shop {0:?}; `codepool shops list` shows the shops")]
    UnknownShop(String),
    #[error("pool {pool:?} is not one of shop {shop:?}'s pools (or does not exist); map a pool the shop orders from")]
    PoolNotShops { pool: String, shop: String },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The SHA-256 of a secret, hex.
pub fn secret_hash(secret: &str) -> String {
    hex::encode(Sha256::digest(secret.as_bytes()))
}

/// Whether `presented` is the secret whose hash is `hash`, compared in
/// constant time.
pub fn same_secret(hash: &str, presented: &str) -> bool {
    subtle::ConstantTimeEq::ct_eq(hash.as_bytes(), secret_hash(presented).as_bytes()).into()
}

/// Whether `id` is a product or order id codepool takes from a
/// marketplace: ASCII letters, digits, `_` and `-` (UUIDs and numbers).
pub fn valid_external_id(id: &str) -> bool {
    (1..=MAX_EXTERNAL_ID).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// What `channels add` is given.
#[derive(Debug, Clone)]
pub struct NewChannel {
    pub name: String,
    pub kind: Kind,
    pub shop: String,
    /// The credentials file's JSON object.
    pub credentials: Vec<u8>,
    pub hold_ttl_seconds: Option<u64>,
    pub after_provide: AfterProvide,
    pub token_ttl_seconds: Option<u64>,
    /// Caps on what the channel declares ([`stock::cap`]).
    pub caps: Caps,
}

/// A channel's caps on its declared stock: a percent of its pools' free
/// codes (`--share`), a number of codes (`--max`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Caps {
    pub share_percent: Option<u32>,
    pub max_stock: Option<u64>,
}

impl Caps {
    fn check(self) -> Result<(), ChannelError> {
        match self.share_percent {
            Some(p) if p > 100 => Err(ChannelError::BadShare(p)),
            _ => Ok(()),
        }
    }

    fn describe(self) -> String {
        match (self.share_percent, self.max_stock) {
            (None, None) => "declares all its pools have free".into(),
            (Some(p), None) => format!("declares {p} % of its pools' free codes"),
            (None, Some(m)) => format!("declares at most {m} codes a product"),
            (Some(p), Some(m)) => {
                format!("declares {p} % of its pools' free codes, at most {m} a product")
            }
        }
    }
}

/// The credentials file read: the inbound secret's hash, the client id,
/// the sealed outbound secrets and the base URL.
struct Credentials {
    inbound_hash: String,
    client_id: Option<String>,
    sealed: BTreeMap<String, SealedSecret>,
    base_url: Option<String>,
    api_url: Option<String>,
    auth_url: Option<String>,
}

fn text_field(map: &Map<String, Value>, field: &str) -> Result<Option<String>, ChannelError> {
    match map.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s))
            if !s.is_empty() && s.len() <= 1024 && s.chars().all(|c| c.is_ascii_graphic()) =>
        {
            Ok(Some(s.clone()))
        }
        Some(_) => Err(ChannelError::BadCredentials(format!(
            "field {field:?} must be visible ASCII text of at most 1024 characters"
        ))),
    }
}

/// The credentials file's URL field `f`, if any: an http(s) URL.
fn url_field(map: &Map<String, Value>, f: &str) -> Result<Option<String>, ChannelError> {
    let u = text_field(map, f)?;
    match &u {
        Some(s)
            if !matches!(
                url::Url::parse(s).map(|u| u.scheme().to_owned()).as_deref(),
                Ok("http" | "https")
            ) =>
        {
            Err(ChannelError::BadCredentials(format!(
                "{f:?} {s:?} is not an http(s) URL"
            )))
        }
        _ => Ok(u),
    }
}

fn read_credentials(
    store: &Store,
    name: &str,
    kind: Kind,
    bytes: &[u8],
) -> Result<Credentials, ChannelError> {
    let map: Map<String, Value> = serde_json::from_slice(bytes).map_err(|e| {
        ChannelError::BadCredentials(format!("not a JSON object ({e}); see docs/channels.md"))
    })?;
    let field = kind.inbound_field();
    let inbound = text_field(&map, field)?.ok_or_else(|| {
        ChannelError::BadCredentials(format!(
            "a {} channel needs {field:?}: the secret the marketplace presents to codepool",
            kind.as_str()
        ))
    })?;
    if inbound.len() < MIN_SECRET_CHARS {
        return Err(ChannelError::BadCredentials(format!(
            "{field:?} must have at least {MIN_SECRET_CHARS} characters (`openssl rand -hex 32` makes one)"
        )));
    }
    let client_id = text_field(&map, "client_id")?;
    if kind == Kind::G2a && client_id.is_none() {
        return Err(ChannelError::BadCredentials(
            "a g2a channel needs \"client_id\": the client id G2A presents with its secret".into(),
        ));
    }
    let mut sealed = BTreeMap::new();
    for f in kind.outbound_fields() {
        if let Some(secret) = text_field(&map, f)? {
            let ring = store.keys().ring()?;
            let s = ring.seal(format!("channel:{name}:{f}").as_bytes(), &secret);
            sealed.insert(
                (*f).to_owned(),
                SealedSecret {
                    key_id: s.key_id,
                    bytes: bson::Binary {
                        subtype: bson::spec::BinarySubtype::Generic,
                        bytes: s.bytes,
                    },
                },
            );
        }
    }
    let url_field = |f: &str| url_field(&map, f);
    let base_url = url_field("base_url")?;
    // The token endpoint: Eneba's `auth_url`, Kinguin's `token_url`.
    let (api_url, auth_url) = match kind {
        Kind::Eneba => (url_field("api_url")?, url_field("auth_url")?),
        Kind::Kinguin => (None, url_field("token_url")?),
        Kind::G2a => (None, None),
    };
    if kind == Kind::Eneba
        && sealed.contains_key("api_secret") != sealed.contains_key("api_client_id")
    {
        return Err(ChannelError::BadCredentials(
            "Eneba's API needs both \"api_client_id\" and \"api_secret\" (or neither: stock is then not declared by codepool)".into(),
        ));
    }
    Ok(Credentials {
        inbound_hash: secret_hash(&inbound),
        client_id,
        sealed,
        base_url,
        api_url,
        auth_url,
    })
}

/// Adds a channel to a shop, audited with `actor`. The marketplace's
/// inbound secret is kept as its hash, the outbound ones sealed.
pub async fn add(
    store: &Store,
    new: NewChannel,
    actor: &Actor,
) -> Result<ChannelDoc, ChannelError> {
    Pool::new(&new.name).map_err(|_| ChannelError::BadName(new.name.chars().take(80).collect()))?;
    if store.shop(&new.shop).await?.is_none() {
        return Err(ChannelError::UnknownShop(new.shop.clone()));
    }
    let ttl = new.hold_ttl_seconds.unwrap_or(new.kind.default_ttl());
    if !(60..=MAX_HOLD_TTL_SECONDS).contains(&ttl) {
        return Err(ChannelError::BadTtl(ttl));
    }
    new.caps.check()?;
    let creds = read_credentials(store, &new.name, new.kind, &new.credentials)?;
    let doc = ChannelDoc {
        name: new.name.clone(),
        kind: new.kind.as_str().to_owned(),
        shop: new.shop.clone(),
        paused: false,
        inbound_hash: creds.inbound_hash,
        client_id: creds.client_id,
        sealed: creds.sealed,
        base_url: creds.base_url,
        products: BTreeMap::new(),
        hold_ttl_seconds: ttl as i64,
        after_provide: new.after_provide.as_str().to_owned(),
        token_ttl_seconds: (new.kind == Kind::G2a)
            .then(|| new.token_ttl_seconds.unwrap_or(DEFAULT_TOKEN_TTL_SECONDS) as i64),
        share_percent: new.caps.share_percent.map(|p| p as i32),
        max_stock: new.caps.max_stock.map(|m| m.min(i64::MAX as u64) as i64),
        api_url: creds.api_url,
        auth_url: creds.auth_url,
        declared: BTreeMap::new(),
        created_at: DateTime::now(),
        updated_at: None,
    };
    if !store.insert_channel(&doc).await? {
        return Err(ChannelError::Exists(new.name));
    }
    let what = format!(
        "channel {:?} ({}) added to shop {:?}; reservations hold {ttl} s; a cancellation after provision {}s; it {}",
        doc.name, doc.kind, doc.shop, doc.after_provide, new.caps.describe()
    );
    audit::record(store, actor, AuditKind::ChannelAdd, what).await?;
    Ok(doc)
}

/// Maps a marketplace product to a pool of the channel's shop, audited.
pub async fn map(
    store: &Store,
    name: &str,
    product: &str,
    pool: &str,
    actor: &Actor,
) -> Result<ChannelDoc, ChannelError> {
    if !valid_external_id(product) {
        return Err(ChannelError::BadProduct(product.chars().take(80).collect()));
    }
    let channel = (store.channel(name).await?).ok_or_else(|| ChannelError::Unknown(name.into()))?;
    let shop = (store.shop(&channel.shop).await?)
        .ok_or_else(|| ChannelError::UnknownShop(channel.shop.clone()))?;
    let exists = !store.pools_named(&[pool]).await?.is_empty();
    if !exists || !shop.allows(pool) {
        return Err(ChannelError::PoolNotShops {
            pool: pool.chars().take(80).collect(),
            shop: shop.name,
        });
    }
    let channel = (store.map_channel_product(name, product, pool).await?)
        .ok_or_else(|| ChannelError::Unknown(name.into()))?;
    let what = format!("channel {name:?} sells pool {pool:?} as product {product:?}");
    audit::record(store, actor, AuditKind::ChannelSet, what).await?;
    Ok(channel)
}

/// Sets a channel's caps on its declared stock, audited.
pub async fn set_caps(
    store: &Store,
    name: &str,
    caps: Caps,
    actor: &Actor,
) -> Result<ChannelDoc, ChannelError> {
    caps.check()?;
    let channel = (store
        .set_channel_caps(
            name,
            caps.share_percent.map(|p| p as i32),
            caps.max_stock.map(|m| m.min(i64::MAX as u64) as i64),
        )
        .await?)
        .ok_or_else(|| ChannelError::Unknown(name.into()))?;
    let what = format!("channel {name:?} {}", caps.describe());
    audit::record(store, actor, AuditKind::ChannelSet, what).await?;
    Ok(channel)
}

/// Pauses (or resumes) a channel, audited: a paused channel reserves
/// nothing new and declares no stock ([`stock::cap`]); what it reserved
/// is still provided or cancelled. Its products are declared again at
/// the next change round of this process (every granting process's
/// schedule makes it good within a minute).
pub async fn set_paused(
    store: &Store,
    name: &str,
    paused: bool,
    actor: &Actor,
) -> Result<ChannelDoc, ChannelError> {
    let channel = (store.set_channel_paused(name, paused).await?)
        .ok_or_else(|| ChannelError::Unknown(name.into()))?;
    let what = format!(
        "channel {name:?} {}",
        if paused { "paused" } else { "resumed" }
    );
    audit::record(store, actor, AuditKind::ChannelSet, what).await?;
    stock::changed(channel.products.values().map(String::as_str));
    Ok(channel)
}

/// Removes a channel, audited: the marketplace's calls are refused from
/// then on; its open reservations expire with their holds.
pub async fn remove(store: &Store, name: &str, actor: &Actor) -> Result<(), ChannelError> {
    if !store.remove_channel(name).await? {
        return Err(ChannelError::Unknown(name.into()));
    }
    audit::record(
        store,
        actor,
        AuditKind::ChannelRemove,
        format!("channel {name:?} removed"),
    )
    .await?;
    Ok(())
}

/// The owner a channel's holds and orders are placed under, before the
/// shop admits them (they become the shop's).
pub fn placed_by(channel: &str) -> String {
    format!("channel:{channel}")
}

/// A marketplace order's hold id, derived from the channel and the
/// marketplace's id (`n`: the renewal).
pub fn hold_id_of(c: &ChannelDoc, external_id: &str, n: u32) -> String {
    match n {
        0 => format!("{}:{}:{external_id}", c.kind, c.name),
        n => format!("{}:{}:{external_id}#{n}", c.kind, c.name),
    }
}

/// A marketplace order's order id, derived from the channel and the
/// marketplace's id: a retry places the same order and gets its keys.
pub fn order_id_of(c: &ChannelDoc, external_id: &str) -> String {
    format!("{}:{}:{external_id}", c.kind, c.name)
}

/// The buyer a marketplace order's hold and order name: the marketplace
/// order itself (codepool never learns the marketplace's buyer).
fn uid_of(c: &ChannelDoc, external_id: &str) -> String {
    format!("{}:{external_id}", c.name)
}

/// Why a channel's call was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// No such channel, or not of this marketplace.
    #[error("no such channel")]
    UnknownChannel,
    /// The secret presented is not the channel's.
    #[error("the credentials are not this channel's")]
    Unauthorized,
    /// The body does not follow the marketplace's contract.
    #[error("{0}")]
    Malformed(String),
    /// A product the channel does not map.
    #[error("unknown product {0:?}")]
    UnknownProduct(String),
    #[error("the channel is paused")]
    Paused,
    /// The marketplace's order or reservation is unknown to codepool.
    #[error("unknown order or reservation {0:?}")]
    UnknownDeal(String),
    /// Cancelled (or released): it gets nothing again.
    #[error("the order or reservation was cancelled")]
    Cancelled,
    /// The reservation's time is up: its codes are back in stock.
    #[error("the reservation expired")]
    Expired,
    /// The reservation was ordered under another marketplace order.
    #[error("an order already exists for the reservation")]
    OrderExists,
    /// Not all keys could be held or provided; nothing was.
    #[error("not enough keys: {0}")]
    Unavailable(String),
    /// A key the marketplace asked to replace was not replaced (the
    /// order's replacement cap, a key no longer issued); nothing changed.
    #[error("the key was not replaced: {0}")]
    NotReplaced(String),
    /// MongoDB or the batch is away: the same call may be made again.
    #[error("try again: {0}")]
    Retry(String),
    #[error("{0}")]
    Failed(String),
}

impl From<StoreError> for CallError {
    fn from(e: StoreError) -> Self {
        if e.is_retryable() {
            Self::Retry(e.to_string())
        } else {
            Self::Failed(e.to_string())
        }
    }
}

impl From<HoldError> for CallError {
    fn from(e: HoldError) -> Self {
        if e.is_retryable() {
            return Self::Retry(e.to_string());
        }
        match e {
            HoldError::InsufficientStock { .. }
            | HoldError::Paused(_)
            | HoldError::OverShare { .. }
            | HoldError::TooManyHolds { .. }
            | HoldError::OwnerOverShare { .. } => Self::Unavailable(e.to_string()),
            HoldError::Invalid(pe) => Self::Unavailable(pe.detail),
            HoldError::Conflict(_) => Self::Failed(e.to_string()),
            HoldError::NotFound(id) => Self::UnknownDeal(id),
            other => Self::Failed(other.to_string()),
        }
    }
}

/// An order that could not be placed: whether the same call may succeed
/// later.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{why}")]
pub struct Unplaced {
    pub retryable: bool,
    pub why: String,
}

/// How a door places a channel's order: through its own batch of orders,
/// exactly as it places its own ([`crate::placement::place`]), with its
/// ending. The rules of the channel stay here.
#[async_trait::async_trait]
pub trait Placer: Send + Sync {
    async fn place(&self, purchase: Purchase, actor: Actor) -> Result<Step, Unplaced>;
}

/// How a door places a channel's holds: the core's hold batcher.
#[async_trait::async_trait]
pub trait Holder: Send + Sync {
    async fn hold(&self, ask: HoldAsk) -> crate::holds::Placed;
}

#[async_trait::async_trait]
impl Holder for crate::holds::HoldBatcher {
    async fn hold(&self, ask: HoldAsk) -> crate::holds::Placed {
        self.place(ask).await
    }
}

/// The channel `name` of marketplace `kind`, when `presented` is its
/// secret (compared in constant time).
pub async fn authorized(
    store: &Store,
    name: &str,
    kind: Kind,
    presented: Option<&str>,
) -> Result<ChannelDoc, CallError> {
    let c = match store.channel(name).await? {
        Some(c) if c.kind == kind.as_str() => c,
        _ => return Err(CallError::UnknownChannel),
    };
    match presented {
        Some(p) if same_secret(&c.inbound_hash, p) => Ok(c),
        _ => Err(CallError::Unauthorized),
    }
}

/// One line asked of a marketplace product: its pool, checked against
/// the channel's map.
pub fn line_of(c: &ChannelDoc, product: &str, quantity: u32) -> Result<DealLine, CallError> {
    let pool = c
        .products
        .get(product)
        .ok_or_else(|| CallError::UnknownProduct(product.chars().take(80).collect()))?;
    if quantity == 0 || quantity > codepool_domain::MAX_QUANTITY {
        return Err(CallError::Malformed(format!(
            "a quantity must be 1 to {}, not {quantity}",
            codepool_domain::MAX_QUANTITY
        )));
    }
    Ok(DealLine {
        product: product.to_owned(),
        pool: pool.clone(),
        quantity,
    })
}

/// A paused channel reserves nothing new (a channel's own switch, not a
/// pool's pause, which the guard decides).
fn taking(c: &ChannelDoc) -> Result<(), CallError> {
    (!c.paused).then_some(()).ok_or(CallError::Paused)
}

/// Holds the codes of a new marketplace order (all or nothing) and
/// records it as a reserved deal. A deal already recorded under the id is
/// answered as it stands.
pub(crate) async fn reserve(
    core: &crate::Core,
    holder: &dyn Holder,
    c: &ChannelDoc,
    external_id: &str,
    lines: Vec<DealLine>,
) -> Result<DealDoc, CallError> {
    let store = core.store();
    if let Some(d) = store.deal(&c.name, external_id).await? {
        return match d.state {
            DealState::Cancelled => Err(CallError::Cancelled),
            _ if d.lines != lines => Err(CallError::OrderExists),
            _ => Ok(d),
        };
    }
    if let Err(e) = taking(c) {
        reservation_failed(core, c);
        return Err(e);
    }
    let hold_id = hold_id_of(c, external_id, 0);
    hold(core, holder, c, external_id, &lines, &hold_id).await?;
    let deal = DealDoc {
        id: codepool_store::channels::deal_id(&c.name, external_id),
        channel: c.name.clone(),
        external_id: external_id.to_owned(),
        state: DealState::Reserved,
        lines,
        hold_id,
        holds: 1,
        order_id: order_id_of(c, external_id),
        marketplace_order: None,
        cancelled_after_provide: false,
        replaced: Vec::new(),
        created_at: DateTime::now(),
        updated_at: None,
    };
    if !store.insert_deal(&deal).await? {
        // Recorded by a concurrent delivery of the same call.
        let d = (store.deal(&c.name, external_id).await?)
            .ok_or_else(|| CallError::UnknownDeal(external_id.to_owned()))?;
        return match d.state {
            DealState::Cancelled => Err(CallError::Cancelled),
            _ => Ok(d),
        };
    }
    counted(core, c, Call::Reservation, true);
    Ok(deal)
}

/// Counts one call of a channel by its outcome ([`outcomes`]): the
/// metric, and the last hour the console shows.
pub fn counted(core: &crate::Core, c: &ChannelDoc, call: Call, ok: bool) {
    core.parts().outcomes.count(&c.name, call, ok);
}

/// Counts one reservation the marketplace sees fail (Eneba's hide rule
/// counts them): refused for stock, a paused channel, an unknown product.
fn reservation_failed(core: &crate::Core, c: &ChannelDoc) {
    counted(core, c, Call::Reservation, false);
}

/// Places (or finds again: hold ids are idempotent) the hold `hold_id`
/// of a deal's lines; it must hold every line now.
async fn hold(
    core: &crate::Core,
    holder: &dyn Holder,
    c: &ChannelDoc,
    external_id: &str,
    lines: &[DealLine],
    hold_id: &str,
) -> Result<(), CallError> {
    let items = lines
        .iter()
        .map(|l| Item {
            pool: l.pool.clone(),
            quantity: l.quantity,
        })
        .collect();
    let ask = HoldAsk {
        req: HoldRequest {
            hold_id: hold_id.to_owned(),
            uid: uid_of(c, external_id),
            items,
            ttl_seconds: c.hold_ttl_seconds.max(1) as u64,
        },
        owner: Some(placed_by(&c.name)),
        shop: Some(c.shop.clone()),
    };
    let (h, _) = holder.hold(ask).await.map_err(|e| {
        reservation_failed(core, c);
        if matches!(e, HoldError::InsufficientStock { .. }) {
            stock::refused_for_stock(c, lines);
        }
        CallError::from(e)
    })?;
    if crate::holds::state_now(&h) != codepool_store::holds::HoldState::Held {
        return Err(CallError::Expired);
    }
    Ok(())
}

/// Whether a deal's hold still holds its codes now.
async fn still_held(core: &crate::Core, c: &ChannelDoc, d: &DealDoc) -> Result<bool, CallError> {
    let owner = crate::shops::owner_of(&c.shop);
    match crate::holds::get(core.store(), &d.hold_id, Some(&owner)).await {
        Ok(h) => Ok(crate::holds::state_now(&h) == codepool_store::holds::HoldState::Held),
        Err(HoldError::NotFound(_)) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Releases a deal's hold: its codes go back to stock, waiting orders
/// first.
async fn release(core: &crate::Core, c: &ChannelDoc, hold_id: &str) -> Result<(), CallError> {
    let owner = crate::shops::owner_of(&c.shop);
    match crate::holds::release(core.intake(), hold_id, Some(&owner)).await {
        Ok((_, returned)) => {
            if !returned.is_empty() {
                let pools = returned.iter().map(|c| c.pool.clone()).collect();
                crate::holds::serve_returned(core, &pools).await;
            }
            Ok(())
        }
        Err(HoldError::NotFound(_)) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// One key provided: the line of the order, its product, its code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Key {
    /// A stable id of the key within its order (its code document's id).
    pub id: String,
    pub product: String,
    pub value: String,
    /// Voided since (cancelled after provision, or returned).
    pub revoked: bool,
}

/// The purchase a deal's order is: the same every time it is placed, so
/// a retry is a repeat of it and gets the same codes.
fn purchase_of(c: &ChannelDoc, d: &DealDoc) -> Purchase {
    let quantity = d.lines.iter().map(|l| l.quantity).sum();
    let items = if d.lines.len() > 1 {
        d.lines
            .iter()
            .map(|l| Item {
                pool: l.pool.clone(),
                quantity: l.quantity,
            })
            .collect()
    } else {
        Vec::new()
    };
    Purchase {
        order_id: d.order_id.clone(),
        uid: uid_of(c, &d.external_id),
        phone: String::new(),
        pool: d.lines.first().map(|l| l.pool.clone()).unwrap_or_default(),
        purchased_at: None,
        quantity,
        owner: Some(placed_by(&c.name)),
        shop: Some(c.shop.clone()),
        hold_id: Some(d.hold_id.clone()),
        items,
    }
}

/// Places a provided deal's order (again: the same order, the same keys)
/// and returns its keys, line by line. An order that could not get every
/// key from its hold is voided at once (nothing waits as a backorder, no
/// key is shown) and the deal cancelled.
pub(crate) async fn keys_of(
    core: &crate::Core,
    placer: &dyn Placer,
    c: &ChannelDoc,
    d: &DealDoc,
    via: &str,
) -> Result<Vec<Key>, CallError> {
    let actor = Actor {
        who: placed_by(&c.name),
        via: via.to_owned(),
    };
    let step = placer
        .place(purchase_of(c, d), actor.clone())
        .await
        .map_err(|e| {
            if e.retryable {
                CallError::Retry(e.why)
            } else {
                CallError::Failed(e.why)
            }
        })?;
    let grants = match step {
        Step::Grant {
            grants, missing, ..
        } if missing.is_empty() => grants,
        Step::Grant { .. } | Step::Backorder { .. } => {
            // Short: the hold ran out before the order. Nothing is shown,
            // nothing waits.
            let _ = core
                .void(
                    codepool_store::lifecycle::CodeRef::Order(&d.order_id),
                    "channel: the reservation could not be provided",
                    &actor,
                )
                .await;
            core.store().cancel_deal(&c.name, &d.external_id).await?;
            return Err(CallError::Expired);
        }
        Step::Cancelled(_) => return Err(CallError::Cancelled),
        Step::Refused(r) => return Err(CallError::Unavailable(format!("{:?}", r.reason))),
        Step::DeadLetter(e) => return Err(CallError::Failed(e.detail)),
    };
    // The shop hears of the sale as of its own orders: the keys went to
    // the marketplace, not in an answer to the shop.
    if let Err(e) = crate::webhooks::record_granted(core.store(), &grants).await {
        tracing::warn!(order_id = %d.order_id, error = %e, "a channel sale's webhook event was not recorded; the next provision of the order records it");
    }
    let mut keys = Vec::with_capacity(grants.len());
    let mut grants = grants;
    grants.sort_by_key(|g| g.line);
    let mut offset = 0;
    for l in &d.lines {
        for g in grants
            .iter()
            .filter(|g| g.line >= offset && g.line < offset + l.quantity)
        {
            keys.push(Key {
                id: g.code_id.to_string(),
                product: l.product.clone(),
                value: g.code.clone(),
                revoked: g.revoked,
            });
        }
        offset += l.quantity;
    }
    Ok(keys)
}

/// Counts one provision of a channel by its outcome.
fn provided(core: &crate::Core, c: &ChannelDoc, ok: bool) {
    counted(core, c, Call::Provision, ok);
}

/// Moves a reserved deal whose hold still holds to provided, then places
/// its order; a provided deal is placed again (the same keys).
pub(crate) async fn provide(
    core: &crate::Core,
    placer: &dyn Placer,
    c: &ChannelDoc,
    external_id: &str,
    marketplace_order: Option<&str>,
    via: &str,
) -> Result<Vec<Key>, CallError> {
    let store = core.store();
    let d = (store.deal(&c.name, external_id).await?)
        .ok_or_else(|| CallError::UnknownDeal(external_id.to_owned()))?;
    let d = match d.state {
        DealState::Cancelled => return Err(CallError::Cancelled),
        DealState::Provided => {
            if marketplace_order.is_some() && d.marketplace_order.as_deref() != marketplace_order {
                return Err(CallError::OrderExists);
            }
            d
        }
        DealState::Reserved => {
            if !still_held(core, c, &d).await? {
                provided(core, c, false);
                return Err(CallError::Expired);
            }
            let moved = store
                .move_deal(
                    &c.name,
                    external_id,
                    &[DealState::Reserved, DealState::Provided],
                    DealState::Provided,
                    marketplace_order,
                )
                .await?;
            if let Some(pause) = crate::failpoint::pause("channel-commit-pause") {
                // Recorded provided, its order not placed yet.
                tokio::time::sleep(pause).await;
            }
            match moved {
                Some(d) => d,
                None => {
                    // Cancelled meanwhile, or ordered under another order.
                    let now = store.deal(&c.name, external_id).await?;
                    return Err(match now.map(|d| d.state) {
                        Some(DealState::Provided) => CallError::OrderExists,
                        _ => CallError::Cancelled,
                    });
                }
            }
        }
    };
    let keys = match keys_of(core, placer, c, &d, via).await {
        Ok(keys) if keys.iter().any(|k| k.revoked) => Err(CallError::Cancelled),
        other => other,
    };
    provided(core, c, keys.is_ok());
    keys
}

/// What a cancellation did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cancelled {
    /// Before provision: the hold is released (or there was none).
    Released,
    /// After provision, by the channel's policy.
    AfterProvide(AfterProvide),
}

/// Cancels a marketplace order: before provision its hold is released;
/// after, its keys are voided (`burn`) or kept sold (`resell`), as the
/// channel says. A provision racing it either gave its keys before (then
/// they are handled as after provision) or gets nothing.
pub(crate) async fn cancel(
    core: &crate::Core,
    placer: &dyn Placer,
    c: &ChannelDoc,
    external_id: &str,
    via: &str,
) -> Result<Cancelled, CallError> {
    let store = core.store();
    let before = store.cancel_deal(&c.name, external_id).await?;
    if let Some(pause) = crate::failpoint::pause("channel-cancel-pause") {
        // Recorded cancelled, its hold not released (or its keys not
        // voided) yet.
        tokio::time::sleep(pause).await;
    }
    let Some(d) = before else {
        // Nothing recorded: a hold left by a reservation that died before
        // its record still goes back.
        release(core, c, &hold_id_of(c, external_id, 0)).await?;
        return Ok(Cancelled::Released);
    };
    let after = d.state == DealState::Provided || d.cancelled_after_provide;
    if !after {
        release(core, c, &d.hold_id).await?;
        return Ok(Cancelled::Released);
    }
    let policy = AfterProvide::of(c);
    if policy == AfterProvide::Burn {
        let actor = Actor {
            who: placed_by(&c.name),
            via: via.to_owned(),
        };
        // The order exists, or is being placed: placing it again waits
        // for it (or places it, if its provision died), then it is voided.
        let _ = keys_of(core, placer, c, &d, via).await;
        let order = codepool_store::lifecycle::CodeRef::Order(&d.order_id);
        void_sold(core, order, &actor).await?;
    }
    Ok(Cancelled::AfterProvide(policy))
}

/// Voids keys a marketplace was given and then cancelled, returned or
/// refunded: never back in stock. Keys void already (the same
/// cancellation again) are done; a key the buyer redeemed is left, said.
pub(crate) async fn void_sold(
    core: &crate::Core,
    target: codepool_store::lifecycle::CodeRef<'_>,
    actor: &Actor,
) -> Result<(), CallError> {
    use codepool_store::lifecycle::LifecycleError;
    match core
        .void(target, "channel: cancelled after provision", actor)
        .await
    {
        Ok(_) | Err(crate::ops::VoidError::Lifecycle(LifecycleError::Void { .. })) => Ok(()),
        Err(crate::ops::VoidError::Lifecycle(LifecycleError::Store(e))) => Err(e.into()),
        Err(e) => {
            tracing::warn!(target = %target.describe(), error = %e, "a cancelled channel sale was not voided");
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_is_compared_by_its_hash_and_ids_are_plain_text() {
        let h = secret_hash("a-long-secret");
        assert_ne!(h, "a-long-secret");
        assert!(same_secret(&h, "a-long-secret"));
        assert!(!same_secret(&h, "a-long-secreT"));
        assert!(valid_external_id("8f2c1a52-6a1e-4b8e-9a55-0c9a3e1f0b7d"));
        assert!(valid_external_id("10000045532001"));
        for bad in ["", "a.b", "$set", "a b", "x\u{7}", &"a".repeat(61)] {
            assert!(!valid_external_id(bad), "{bad:?}");
        }
        assert!("ebay".parse::<Kind>().is_err());
        assert_eq!("g2a".parse::<Kind>().unwrap(), Kind::G2a);
        assert_eq!(
            "resell".parse::<AfterProvide>().unwrap(),
            AfterProvide::Resell
        );
    }

    #[test]
    fn a_marketplace_order_names_one_hold_and_one_order_of_its_channel() {
        let c = ChannelDoc {
            name: "acme-en".into(),
            kind: "eneba".into(),
            shop: "acme".into(),
            paused: false,
            inbound_hash: String::new(),
            client_id: None,
            sealed: BTreeMap::new(),
            base_url: None,
            products: BTreeMap::new(),
            hold_ttl_seconds: 60,
            after_provide: "burn".into(),
            token_ttl_seconds: None,
            share_percent: None,
            max_stock: None,
            api_url: None,
            auth_url: None,
            declared: BTreeMap::new(),
            created_at: DateTime::now(),
            updated_at: None,
        };
        assert_eq!(hold_id_of(&c, "o-1", 0), "eneba:acme-en:o-1");
        assert_eq!(hold_id_of(&c, "o-1", 2), "eneba:acme-en:o-1#2");
        assert_eq!(order_id_of(&c, "o-1"), "eneba:acme-en:o-1");
        assert!(line_of(&c, "unknown", 1).is_err());
        assert!(taking(&c).is_ok());
        assert!(taking(&ChannelDoc { paused: true, ..c }).is_err());
    }
}
