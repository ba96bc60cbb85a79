//! Purchases: the events that ask codepool for a code, and the rules that
//! decide whether one is valid. An invalid purchase is never retried; it is
//! dead-lettered with a [`RejectReason`] so an operator can fix and replay it.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::pool::Pool;

/// A purchase message larger than this is refused unread: no real purchase
/// comes near it, and parsing arbitrary sizes is a memory risk.
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024;

const MAX_ID_LEN: usize = 128;
const MAX_TIME_LEN: usize = 64;

/// The most codes one order may ask for. A reseller's order of a hundred
/// cards is real; an order of a million is a typo that would empty a pool.
pub const MAX_QUANTITY: u32 = 100;

/// A valid purchase: one order of one buyer for `quantity` codes of one
/// pool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Purchase {
    pub order_id: String,
    pub uid: String,
    pub phone: String,
    pub pool: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub purchased_at: Option<String>,
    /// How many distinct codes the order gets: 1 to [`MAX_QUANTITY`].
    /// Absent on the wire when 1, so a purchase of one code reads exactly
    /// as before quantities existed.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub quantity: u32,
    /// Who placed the order, set by the door and never read from the
    /// message: `api-key-id:ID` (the API key's id) for an order placed over HTTP, `None` for a
    /// purchase that came over AMQP. A repeat of an order answers its codes
    /// only to its owner; see [`Purchase::owned_elsewhere`].
    #[serde(skip)]
    pub owner: Option<String>,
    /// The shop the order is for, when the sender names one (AMQP) or the
    /// API key belongs to one (HTTP): it may order only from the shop's
    /// pools, and the order is the shop's (`owner` `shop:NAME`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shop: Option<String>,
    /// The checkout hold this order pays for: its held codes become the
    /// order's. A hold that expired or was released still leaves the
    /// order to be granted from stock or backordered, never refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold_id: Option<String>,
    /// A bundle: the codes it takes from each pool. Empty for an order of
    /// one pool. For a bundle, `pool` is its first item's pool and
    /// `quantity` its total; its lines run item by item (item 0's lines
    /// first), so every line keeps its own pool.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub items: Vec<Item>,
}

/// One pool of a bundle (or of a hold), and how many codes it takes from
/// it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Item {
    pub pool: String,
    pub quantity: u32,
}

/// The most items of a bundle or a hold.
pub const MAX_ITEMS: usize = 10;

fn one() -> u32 {
    1
}

fn is_one(n: &u32) -> bool {
    *n == 1
}

/// The machine-readable class of a rejection. Used as a metric label and as
/// the first word of the `x-codepool-reason` header, so its set is closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RejectReason {
    TooLarge,
    NotJson,
    NotObject,
    MissingField,
    WrongType,
    TooLong,
    InvalidPhone,
    InvalidPool,
    InvalidTime,
    UnknownPool,
    DuplicateField,
    /// `quantity` is not a whole number from 1 to [`MAX_QUANTITY`].
    InvalidQuantity,
    /// The order id was seen before with another pool, buyer or quantity:
    /// the first order stands, this one is not granted.
    ConflictingOrder,
    /// A field holds a character nobody can see or type: a control, a
    /// format character such as a bidi override, a private-use or
    /// unassigned code point, or unusual whitespace ([`crate::text`]).
    InvalidChars,
    /// Valid or not, the message was delivered (and not settled) more often
    /// than the queue's delivery limit allows: a poison message.
    DeliveryLimit,
    /// The purchase names a shop that does not exist.
    UnknownShop,
    /// The purchase's shop may not order from its pool.
    PoolNotAllowed,
    /// An AMQP purchase names a shop its broker user may not publish for.
    ShopNotYours,
}

impl RejectReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::TooLarge => "too_large",
            Self::NotJson => "not_json",
            Self::NotObject => "not_object",
            Self::MissingField => "missing_field",
            Self::WrongType => "wrong_type",
            Self::TooLong => "too_long",
            Self::InvalidPhone => "invalid_phone",
            Self::InvalidPool => "invalid_pool",
            Self::InvalidTime => "invalid_time",
            Self::UnknownPool => "unknown_pool",
            Self::DuplicateField => "duplicate_field",
            Self::InvalidQuantity => "invalid_quantity",
            Self::ConflictingOrder => "conflicting_order",
            Self::InvalidChars => "invalid_chars",
            Self::DeliveryLimit => "delivery_limit",
            Self::UnknownShop => "unknown_shop",
            Self::PoolNotAllowed => "pool_not_allowed",
            Self::ShopNotYours => "shop_not_yours",
        }
    }
}

/// Why a message is not a valid purchase: a class, the field at fault (as
/// data, for a door to name: a JSON pointer, a form field) and a sentence
/// that tells the producer what to fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {detail}", reason.as_str())]
pub struct PurchaseError {
    pub reason: RejectReason,
    pub detail: String,
    /// The purchase field at fault, when the reason alone does not say.
    field: Option<String>,
    /// The pool the error is about, for an unknown pool or one the shop may
    /// not use.
    pool: Option<String>,
}

impl PurchaseError {
    pub fn new(reason: RejectReason, detail: impl Into<String>) -> Self {
        Self {
            reason,
            detail: detail.into(),
            field: None,
            pool: None,
        }
    }

    /// The same error, about `pool`.
    fn about(mut self, pool: &str) -> Self {
        self.pool = Some(pool.to_owned());
        self
    }

    /// The pool the error is about (an unknown pool, or one the shop may
    /// not use).
    pub fn pool(&self) -> Option<&str> {
        self.pool.as_deref()
    }

    /// The error as a shop is told it. A pool that does not exist and a
    /// pool of another shop get one and the same answer, `pool_not_allowed`,
    /// whose detail tells neither apart and names no operator's command:
    /// the shop learns nothing of the pools that are not its. Every other
    /// error is told as it is.
    pub fn as_told_to_shop(self) -> Self {
        match self.reason {
            RejectReason::UnknownPool | RejectReason::PoolNotAllowed => {
                let pool = self.pool.clone().unwrap_or_default();
                Self {
                    reason: RejectReason::PoolNotAllowed,
                    detail: format!("pool {pool:?} is not one this shop orders from; order from the shop's pools (GET /v1/pools lists them)"),
                    ..self
                }
            }
            _ => self,
        }
    }

    /// The same error, about `field`.
    pub fn on(mut self, field: &str) -> Self {
        self.field = Some(field.to_owned());
        self
    }

    /// The purchase field at fault, if one is: the one the error was made
    /// about, else the one its reason is always about.
    pub fn field(&self) -> Option<&str> {
        self.field.as_deref().or(match self.reason {
            RejectReason::InvalidPhone => Some("phone"),
            RejectReason::InvalidPool | RejectReason::UnknownPool => Some("pool"),
            RejectReason::InvalidTime => Some("purchased_at"),
            RejectReason::InvalidQuantity => Some("quantity"),
            RejectReason::ConflictingOrder => Some("order_id"),
            RejectReason::UnknownShop => Some("shop"),
            RejectReason::PoolNotAllowed => Some("pool"),
            RejectReason::ShopNotYours => Some("shop"),
            _ => None,
        })
    }

    /// The purchase names a pool that has never received codes.
    pub fn unknown_pool(pool: &str) -> Self {
        Self::new(
            RejectReason::UnknownPool,
            format!("pool {pool:?} has no codes; import codes into it with `codepool import FILE --pool {pool}`, then `codepool dead-letters replay`"),
        )
        .about(pool)
    }

    /// The order id is taken by an order that differs from this one in
    /// `what` (its pool, buyer or quantity).
    pub fn conflicting_order(order_id: &str, what: &str) -> Self {
        Self::new(
            RejectReason::ConflictingOrder,
            format!("order {order_id:?} was already placed with another {what}; the first order stands and this one gets nothing. Send a new order_id for a new order"),
        )
    }

    /// The purchase names a shop that was never created.
    pub fn unknown_shop(shop: &str) -> Self {
        Self::new(
            RejectReason::UnknownShop,
            format!("shop {shop:?} does not exist; create it (`codepool shops create --name {shop} --pools …`) or send the purchase without a shop, then `codepool dead-letters replay`"),
        )
    }

    /// An AMQP purchase names shop `shop`, and its broker user (`user`,
    /// none when the message carries no `user_id`) is not one the shop
    /// lets publish for it.
    pub fn shop_not_yours(shop: &str, user: Option<&str>) -> Self {
        let who = match user {
            Some(u) => format!("broker user {u:?} may not publish purchases for shop {shop:?}"),
            None => format!("a purchase for shop {shop:?} must carry its publisher's user_id"),
        };
        Self::new(
            RejectReason::ShopNotYours,
            format!("{who}; publish with user_id set to a broker user the shop names (`codepool shops set --name {shop} --broker-users USER`)"),
        )
    }

    /// An AMQP purchase names no shop, so it is the operator's, and its
    /// broker user (`user`, none when the message carries no `user_id`) is
    /// not one of the operator's.
    pub fn not_the_operators(user: Option<&str>) -> Self {
        let who = match user {
            Some(u) => format!("broker user {u:?} is not one of the operator's, and a purchase that names no shop is the operator's"),
            None => "a purchase that names no shop is the operator's, and must carry the user_id of one of the operator's broker users".to_owned(),
        };
        Self::new(
            RejectReason::ShopNotYours,
            format!("{who}; a shop's backend names its shop (\"shop\": \"NAME\"), the operator publishes with user_id set to codepool's broker user or one in CODEPOOL_OPERATOR_BROKER_USERS"),
        )
    }

    /// The purchase's shop may not order from its pool.
    pub fn pool_not_allowed(shop: &str, pool: &str) -> Self {
        Self::new(
            RejectReason::PoolNotAllowed,
            format!("shop {shop:?} may not order from pool {pool:?}; order from one of the shop's pools, or add the pool to the shop (`codepool shops set --name {shop} --pools …`)"),
        )
        .about(pool)
    }

    /// The message was delivered `count` times without being settled and
    /// reached the queue's delivery limit.
    pub fn delivery_limit(count: u64, limit: u32) -> Self {
        Self::new(
            RejectReason::DeliveryLimit,
            format!("delivered {count} times without being settled (the delivery limit is {limit}); find the cause in the dispatchers' logs (a crash or an outage on every attempt), fix it, then `codepool dead-letters replay --reason delivery_limit`"),
        )
    }
}

impl Purchase {
    /// Parses and validates a purchase message body.
    pub fn parse(body: &[u8]) -> Result<Self, PurchaseError> {
        if body.len() > MAX_MESSAGE_BYTES {
            return Err(PurchaseError::new(
                RejectReason::TooLarge,
                format!(
                    "message is {} bytes; a purchase must be at most {MAX_MESSAGE_BYTES} bytes",
                    body.len()
                ),
            ));
        }
        let map = parse_object(body)?;
        let order_id = order_id_of(&map)?;
        let uid = required(&map, "uid", MAX_ID_LEN)?;
        let items = match map.get("items") {
            None | Some(Value::Null) => Vec::new(),
            Some(v) => parse_items(v)?,
        };
        let (pool, quantity) = if items.is_empty() {
            (required(&map, "pool", Pool::MAX_LEN)?, quantity(&map)?)
        } else if map.get("pool").is_some_and(|v| !v.is_null())
            || map.get("quantity").is_some_and(|v| !v.is_null())
        {
            return Err(PurchaseError::new(
                RejectReason::WrongType,
                "a bundle names its pools in \"items\"; leave \"pool\" and \"quantity\" out",
            )
            .on("items"));
        } else {
            (
                items[0].pool.clone(),
                items.iter().map(|i| i.quantity).sum(),
            )
        };
        let phone = required(&map, "phone", 32)?;
        let purchased_at = optional(&map, "purchased_at", MAX_TIME_LEN)?;
        let shop = shop_field(&map)?;
        let hold_id = optional(&map, "hold_id", MAX_ID_LEN)?;

        if let Err(e) = Pool::new(&pool) {
            return Err(PurchaseError::new(RejectReason::InvalidPool, e.to_string()));
        }
        if let Some(Err(e)) = shop.as_deref().map(Pool::new) {
            return Err(PurchaseError::new(
                RejectReason::UnknownShop,
                format!("invalid shop name {:?}: a shop is named like a pool (1 to {} characters from A-Z a-z 0-9 . _ -, starting with a letter or a digit)", e.name, e.max),
            )
            .on("shop"));
        }
        if !is_valid_phone(&phone) {
            return Err(PurchaseError::new(
                RejectReason::InvalidPhone,
                "phone must be an international number: optional '+' then 6 to 15 digits",
            ));
        }
        if let Some(t) = &purchased_at {
            if chrono::DateTime::parse_from_rfc3339(t).is_err() {
                return Err(PurchaseError::new(
                    RejectReason::InvalidTime,
                    "purchased_at must be an RFC 3339 time like 2026-11-20T10:00:00Z",
                ));
            }
        }
        Ok(Self {
            order_id,
            uid,
            phone,
            pool,
            purchased_at,
            quantity,
            owner: None,
            shop,
            hold_id,
            items,
        })
    }

    /// Whether the order is a bundle of several pools' codes.
    pub fn is_bundle(&self) -> bool {
        !self.items.is_empty()
    }

    /// The order's items: its own pool and quantity for an order of one
    /// pool.
    pub fn items(&self) -> Vec<Item> {
        if self.items.is_empty() {
            vec![Item {
                pool: self.pool.clone(),
                quantity: self.quantity,
            }]
        } else {
            self.items.clone()
        }
    }

    /// Every pool the order takes codes from, each once, in item order.
    pub fn pools(&self) -> Vec<&str> {
        if self.items.is_empty() {
            return vec![self.pool.as_str()];
        }
        let mut out: Vec<&str> = Vec::new();
        for i in &self.items {
            if !out.contains(&i.pool.as_str()) {
                out.push(&i.pool);
            }
        }
        out
    }

    /// The pool of line `line` (item by item).
    pub fn pool_of_line(&self, line: u32) -> &str {
        let mut end = 0;
        for i in &self.items {
            end += i.quantity;
            if line < end {
                return &i.pool;
            }
        }
        &self.pool
    }

    /// What in `self` differs from `other`, an order with the same id:
    /// `None` when they are the same order (a redelivery or a duplicate).
    /// The phone may differ (a buyer may change it); the pool, the buyer
    /// and the quantity may not.
    pub fn differs_from(&self, pool: &str, uid: &str, quantity: u32) -> Option<&'static str> {
        if self.pool != pool {
            Some("pool")
        } else if self.uid != uid {
            Some("buyer (uid)")
        } else if self.quantity != quantity {
            Some("quantity")
        } else {
            None
        }
    }

    /// Whether an order held by `holder` (the owner recorded with its codes
    /// or backorder) is someone else's for this purchase. A purchase with an
    /// owner (an API key) may only repeat an order it placed itself: any
    /// other key, and an order that came over AMQP, is a conflict and gets
    /// no code. A purchase without one (AMQP) repeats any order: its answer
    /// goes to the SMS service, never back to the sender.
    pub fn owned_elsewhere(&self, holder: Option<&str>) -> bool {
        self.owner.is_some() && self.owner.as_deref() != holder
    }

    /// [`Self::differs_from`], then the owner: `"owner"` when the order
    /// is someone else's (see [`Self::owned_elsewhere`]).
    pub fn conflicts_with(
        &self,
        pool: &str,
        uid: &str,
        quantity: u32,
        owner: Option<&str>,
    ) -> Option<&'static str> {
        self.differs_from(pool, uid, quantity).or_else(|| {
            self.owned_elsewhere(owner)
                .then_some("owner (it was placed by another key or over AMQP)")
        })
    }

    /// The wire form, as `codepool publish` sends it.
    pub fn to_json(&self) -> Vec<u8> {
        // Serializing a struct of strings cannot fail.
        let mut v = serde_json::to_value(self).unwrap_or_default();
        // A bundle names its pools in `items` only.
        if let (true, Some(map)) = (self.is_bundle(), v.as_object_mut()) {
            map.remove("pool");
            map.remove("quantity");
        }
        serde_json::to_vec(&v).unwrap_or_default()
    }
}

/// The message's `order_id`: present, and not one of the ids a
/// marketplace channel's own orders have.
fn order_id_of(map: &Map<String, Value>) -> Result<String, PurchaseError> {
    let order_id = required(map, "order_id", MAX_ID_LEN)?;
    if let Some(prefix) = channel_prefix(&order_id) {
        return Err(PurchaseError::new(
            RejectReason::ConflictingOrder,
            format!("order ids starting with {prefix:?} are a marketplace channel's own (eneba:, g2a:, kinguin:): pick another order id"),
        )
        .on("order_id"));
    }
    Ok(order_id)
}

/// Parses the body as one JSON object whose keys are all different. JSON
/// allows a repeated key and serde keeps the last one, so `order_id` twice
/// would be granted under whichever value a parser picks: refuse it instead.
fn parse_object(body: &[u8]) -> Result<Map<String, Value>, PurchaseError> {
    use serde::de::Deserializer;
    let mut de = serde_json::Deserializer::from_slice(body);
    let parsed = de
        .deserialize_map(UniqueKeys)
        .and_then(|fields| de.end().map(|()| fields));
    match parsed {
        Ok(Fields {
            duplicate: Some(key),
            ..
        }) => {
            let key: String = key.chars().take(40).collect();
            Err(PurchaseError::new(
                RejectReason::DuplicateField,
                format!("field {key:?} appears more than once; send each field once"),
            )
            .on(&key))
        }
        Ok(Fields { map, .. }) => Ok(map),
        Err(e) if e.classify() == serde_json::error::Category::Data => Err(PurchaseError::new(
            RejectReason::NotObject,
            "body must be a JSON object like {\"order_id\":…,\"uid\":…,\"phone\":…,\"pool\":…}",
        )),
        Err(e) => Err(PurchaseError::new(
            RejectReason::NotJson,
            format!("body is not valid UTF-8 JSON ({e}); send one JSON object per message"),
        )),
    }
}

/// A top-level JSON object, and its first repeated key if any.
struct Fields {
    map: Map<String, Value>,
    duplicate: Option<String>,
}

/// Visits a JSON object keeping every key, so a repeated one is seen.
struct UniqueKeys;

impl<'de> serde::de::Visitor<'de> for UniqueKeys {
    type Value = Fields;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut access: A) -> Result<Fields, A::Error> {
        let mut map = Map::new();
        let mut duplicate = None;
        while let Some((key, value)) = access.next_entry::<String, Value>()? {
            if map.contains_key(&key) {
                duplicate.get_or_insert_with(|| key.clone());
            }
            map.insert(key, value);
        }
        Ok(Fields { map, duplicate })
    }
}

/// An id field of a JSON body (`order_id`, `uid`, `hold_id`), by the id
/// rules: a non-empty string of at most 128 visible characters, compared
/// as NFC. The error names `field`.
pub fn required_id(map: &Map<String, Value>, field: &str) -> Result<String, PurchaseError> {
    required(map, field, MAX_ID_LEN)
}

fn required(map: &Map<String, Value>, field: &str, max: usize) -> Result<String, PurchaseError> {
    match optional(map, field, max)? {
        Some(v) => Ok(v),
        None => Err(PurchaseError::new(
            RejectReason::MissingField,
            format!("field {field:?} is required and must be a non-empty string"),
        )
        .on(field)),
    }
}

fn optional(
    map: &Map<String, Value>,
    field: &str,
    max: usize,
) -> Result<Option<String>, PurchaseError> {
    match map.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => {
            // Ids are compared as NFC: `café` composed and decomposed print
            // the same, so they are the same order and the same buyer.
            use unicode_normalization::UnicodeNormalization;
            let s: String = s.trim().nfc().collect();
            let s = s.as_str();
            if s.is_empty() {
                Ok(None)
            } else if s.chars().count() > max {
                Err(PurchaseError::new(
                    RejectReason::TooLong,
                    format!("field {field:?} is longer than {max} characters"),
                )
                .on(field))
            } else if let Some(bad) = crate::text::first_unreadable(s) {
                Err(PurchaseError::new(
                    RejectReason::InvalidChars,
                    format!("field {field:?} contains {bad}; send it as plain visible text"),
                )
                .on(field))
            } else {
                Ok(Some(s.to_owned()))
            }
        }
        Some(other) => Err(PurchaseError::new(
            RejectReason::WrongType,
            format!(
                "field {field:?} must be a string, not {}",
                json_type_name(other)
            ),
        )
        .on(field)),
    }
}

/// The optional `shop`: absent for the operator's purchase, else a
/// shop's name. `null` and an empty string are refused: a purchase that
/// means the operator leaves the field out, and one that meant a shop and
/// lost its name on the way must not become the operator's.
fn shop_field(map: &Map<String, Value>) -> Result<Option<String>, PurchaseError> {
    let malformed = |got: &str| {
        PurchaseError::new(
            RejectReason::WrongType,
            format!("field \"shop\" must name a shop, not {got}; leave it out for a purchase of no shop"),
        )
        .on("shop")
    };
    match map.get("shop") {
        None => Ok(None),
        Some(Value::Null) => Err(malformed("null")),
        Some(Value::String(s)) if s.trim().is_empty() => Err(malformed("an empty string")),
        Some(_) => optional(map, "shop", Pool::MAX_LEN),
    }
}

/// A bundle's `items`: 1 to [`MAX_ITEMS`] objects `{"pool", "quantity"}`,
/// at most [`MAX_QUANTITY`] codes in all.
pub fn parse_items(v: &Value) -> Result<Vec<Item>, PurchaseError> {
    let bad = |detail: String| PurchaseError::new(RejectReason::WrongType, detail).on("items");
    let Value::Array(list) = v else {
        return Err(bad(format!(
            "field \"items\" must be an array of {{\"pool\", \"quantity\"}}, not {}",
            json_type_name(v)
        )));
    };
    if list.is_empty() || list.len() > MAX_ITEMS {
        return Err(bad(format!(
            "field \"items\" must hold 1 to {MAX_ITEMS} items, not {}",
            list.len()
        )));
    }
    let mut items = Vec::with_capacity(list.len());
    for (n, entry) in list.iter().enumerate() {
        let Value::Object(map) = entry else {
            return Err(bad(format!(
                "items[{n}] must be an object {{\"pool\", \"quantity\"}}"
            )));
        };
        let pool =
            required(map, "pool", Pool::MAX_LEN).map_err(|e| e.on(&format!("items[{n}].pool")))?;
        if let Err(e) = Pool::new(&pool) {
            return Err(PurchaseError::new(RejectReason::InvalidPool, e.to_string())
                .on(&format!("items[{n}].pool")));
        }
        let quantity = quantity(map).map_err(|e| e.on(&format!("items[{n}].quantity")))?;
        if items.iter().any(|i: &Item| i.pool == pool) {
            return Err(bad(format!(
                "pool {pool:?} appears twice in \"items\"; name each pool once with its quantity"
            )));
        }
        items.push(Item { pool, quantity });
    }
    let total: u32 = items.iter().map(|i| i.quantity).sum();
    if total > MAX_QUANTITY {
        return Err(PurchaseError::new(
            RejectReason::InvalidQuantity,
            format!(
                "the items ask for {total} codes in all; an order takes at most {MAX_QUANTITY}"
            ),
        )
        .on("items"));
    }
    Ok(items)
}

/// The optional `quantity`: a JSON integer from 1 to [`MAX_QUANTITY`];
/// 1 when absent or null.
fn quantity(map: &Map<String, Value>) -> Result<u32, PurchaseError> {
    let bad = |got: String| {
        PurchaseError::new(
            RejectReason::InvalidQuantity,
            format!("field \"quantity\" must be a whole number from 1 to {MAX_QUANTITY}, not {got}; leave it out for one code"),
        )
    };
    match map.get("quantity") {
        None | Some(Value::Null) => Ok(1),
        Some(Value::Number(n)) => match n.as_u64() {
            Some(q) if (1..=u64::from(MAX_QUANTITY)).contains(&q) => Ok(q as u32),
            _ => Err(bad(n.to_string())),
        },
        Some(other) => Err(bad(json_type_name(other).to_owned())),
    }
}

fn json_type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The prefixes of the order ids codepool derives for the marketplaces'
/// channels (`eneba:CHANNEL:ID`, …): no order that comes in through a
/// door may take one, or it would take a channel's order.
pub const CHANNEL_ORDER_PREFIXES: [&str; 3] = ["eneba:", "g2a:", "kinguin:"];

/// The channel prefix `order_id` starts with, if any (in any case: ids
/// are compared as given, but a look-alike is refused too).
pub fn channel_prefix(order_id: &str) -> Option<&'static str> {
    CHANNEL_ORDER_PREFIXES.into_iter().find(|p| {
        order_id
            .get(..p.len())
            .is_some_and(|head| head.eq_ignore_ascii_case(p))
    })
}

/// The channel whose sale order `order_id` is (`eneba:NAME:…` → `NAME`);
/// `None` for an order of a shop's own doors.
pub fn channel_of(order_id: &str) -> Option<&str> {
    let prefix = CHANNEL_ORDER_PREFIXES
        .into_iter()
        .find(|p| order_id.starts_with(p))?;
    let (name, _) = order_id[prefix.len()..].split_once(':')?;
    (!name.is_empty()).then_some(name)
}

fn is_valid_phone(phone: &str) -> bool {
    let digits = phone.strip_prefix('+').unwrap_or(phone);
    (6..=15).contains(&digits.len()) && digits.bytes().all(|b| b.is_ascii_digit())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn reason(body: &str) -> RejectReason {
        Purchase::parse(body.as_bytes()).unwrap_err().reason
    }

    #[test]
    fn a_channels_order_ids_are_its_own() {
        for id in ["eneba:en:o-1", "G2A:g2:x", "kinguin:k:1"] {
            let body =
                format!(r#"{{"order_id":"{id}","uid":"u1","phone":"+8613800000000","pool":"p"}}"#);
            let e = Purchase::parse(body.as_bytes()).unwrap_err();
            assert_eq!(e.reason, RejectReason::ConflictingOrder, "{id}");
            assert_eq!(e.field(), Some("order_id"));
        }
        assert!(Purchase::parse(
            br#"{"order_id":"eneba-1","uid":"u1","phone":"+8613800000000","pool":"p"}"#
        )
        .is_ok());
        assert_eq!(channel_of("eneba:acme-en:o-1"), Some("acme-en"));
        assert_eq!(channel_of("g2a:g2:8f2c"), Some("g2"));
        assert_eq!(channel_of("S-1"), None);
        assert_eq!(channel_of("eneba::x"), None);
    }

    #[test]
    fn a_shop_is_told_the_same_of_an_unknown_pool_and_a_pool_not_its() {
        let unknown = PurchaseError::unknown_pool("p").as_told_to_shop();
        let theirs = PurchaseError::pool_not_allowed("acme", "p").as_told_to_shop();
        assert_eq!(unknown, theirs);
        assert_eq!(unknown.reason, RejectReason::PoolNotAllowed);
        assert_eq!(unknown.field(), Some("pool"));
        assert!(!unknown.detail.contains('`'), "{}", unknown.detail);
        let other = PurchaseError::new(RejectReason::InvalidPhone, "bad");
        assert_eq!(other.clone().as_told_to_shop(), other);
    }

    #[test]
    fn ids_sent_composed_or_decomposed_are_the_same_order() {
        let nfc =
            br#"{"order_id":"NF-caf\u00e9","uid":"b\u00e9a","phone":"+8613800000000","pool":"p"}"#;
        let nfd = br#"{"order_id":"NF-cafe\u0301","uid":"be\u0301a","phone":"+8613800000000","pool":"p"}"#;
        let (a, b) = (Purchase::parse(nfc).unwrap(), Purchase::parse(nfd).unwrap());
        assert_eq!(a, b);
        assert_eq!(a.order_id, "NF-caf\u{e9}");
    }

    #[test]
    fn a_bundle_names_its_pools_in_items_and_round_trips() {
        let p = Purchase::parse(br#"{"order_id":"B-1","uid":"u1","phone":"+8613800000000","items":[{"pool":"a","quantity":2},{"pool":"b","quantity":1}]}"#).unwrap();
        assert!(p.is_bundle());
        assert_eq!((p.pool.as_str(), p.quantity), ("a", 3));
        assert_eq!(p.pools(), vec!["a", "b"]);
        assert_eq!(
            (p.pool_of_line(0), p.pool_of_line(1), p.pool_of_line(2)),
            ("a", "a", "b")
        );
        assert_eq!(Purchase::parse(&p.to_json()).unwrap(), p);
        for (bad, field) in [
            (r#""items":[{"pool":"a","quantity":1}],"pool":"a""#, "items"),
            (r#""items":[]"#, "items"),
            (
                r#""items":[{"pool":"a","quantity":1},{"pool":"a","quantity":2}]"#,
                "items",
            ),
            (
                r#""items":[{"pool":"a","quantity":60},{"pool":"b","quantity":41}]"#,
                "items",
            ),
            (
                r#""items":[{"pool":"a","quantity":0}]"#,
                "items[0].quantity",
            ),
            (r#""items":[{"pool":"a b","quantity":1}]"#, "items[0].pool"),
            (r#""items":"a""#, "items"),
        ] {
            let body = format!(r#"{{"order_id":"B-1","uid":"u1","phone":"+8613800000000",{bad}}}"#);
            let e = Purchase::parse(body.as_bytes()).unwrap_err();
            assert_eq!(e.field(), Some(field), "{bad}: {e}");
        }
        let eleven: Vec<String> = (0..11)
            .map(|i| format!(r#"{{"pool":"p{i}","quantity":1}}"#))
            .collect();
        let body = format!(
            r#"{{"order_id":"B-1","uid":"u1","phone":"+8613800000000","items":[{}]}}"#,
            eleven.join(",")
        );
        assert!(Purchase::parse(body.as_bytes()).is_err());
    }

    #[test]
    fn a_null_or_empty_shop_is_malformed_not_the_operators() {
        let base = r#"{"order_id":"S-1","uid":"u1","phone":"+8613800000000","pool":"p""#;
        for shop in ["null", r#""""#, r#""  ""#] {
            let e = Purchase::parse(format!(r#"{base},"shop":{shop}}}"#).as_bytes()).unwrap_err();
            assert_eq!(e.reason, RejectReason::WrongType, "{shop}: {e}");
            assert_eq!(e.field(), Some("shop"), "{shop}");
        }
        let none = Purchase::parse(format!("{base}}}").as_bytes()).unwrap();
        assert_eq!(none.shop, None);
        let named = Purchase::parse(format!(r#"{base},"shop":" acme "}}"#).as_bytes()).unwrap();
        assert_eq!(named.shop.as_deref(), Some("acme"));
    }

    #[test]
    fn a_complete_purchase_parses() {
        let p = Purchase::parse(br#"{"order_id":"O-1","uid":"u1","phone":"+8613800000000","pool":"game-x","purchased_at":"2026-11-20T10:00:00Z"}"#).unwrap();
        assert_eq!(p.order_id, "O-1");
        assert_eq!(p.pool, "game-x");
        assert_eq!(p.purchased_at.as_deref(), Some("2026-11-20T10:00:00Z"));
        assert_eq!(Purchase::parse(&p.to_json()).unwrap(), p);
    }

    #[test]
    fn quantity_is_a_whole_number_from_one_to_the_maximum() {
        let with = |q: &str| {
            Purchase::parse(
                format!(r#"{{"order_id":"O-1","uid":"u1","phone":"+8613800000000","pool":"p","quantity":{q}}}"#)
                    .as_bytes(),
            )
        };
        assert_eq!(with("1").unwrap().quantity, 1);
        assert_eq!(with("null").unwrap().quantity, 1);
        assert_eq!(with("7").unwrap().quantity, 7);
        assert_eq!(
            with(&MAX_QUANTITY.to_string()).unwrap().quantity,
            MAX_QUANTITY
        );
        for bad in [
            "0",
            "-1",
            "2.0",
            "1.5",
            "\"2\"",
            "true",
            "[2]",
            "101",
            "1e2",
            "18446744073709551616",
        ] {
            let e = with(bad).unwrap_err();
            assert_eq!(e.reason, RejectReason::InvalidQuantity, "{bad}");
            assert!(e.detail.contains("1 to 100"), "{}", e.detail);
        }
        let one = Purchase::parse(
            br#"{"order_id":"O-1","uid":"u1","phone":"+8613800000000","pool":"p"}"#,
        )
        .unwrap();
        assert_eq!(one.quantity, 1);
        assert!(
            !String::from_utf8(one.to_json())
                .unwrap()
                .contains("quantity"),
            "one code reads as before"
        );
        let five = with("5").unwrap();
        assert_eq!(Purchase::parse(&five.to_json()).unwrap(), five);
    }

    #[test]
    fn an_order_differs_by_pool_buyer_or_quantity_not_phone() {
        let p = Purchase::parse(
            br#"{"order_id":"O-1","uid":"u1","phone":"+8613800000000","pool":"p","quantity":2}"#,
        )
        .unwrap();
        assert_eq!(p.differs_from("p", "u1", 2), None);
        assert_eq!(p.differs_from("q", "u1", 2), Some("pool"));
        assert_eq!(p.differs_from("p", "u2", 2), Some("buyer (uid)"));
        assert_eq!(p.differs_from("p", "u1", 3), Some("quantity"));
    }

    #[test]
    fn ids_with_invisible_characters_are_invalid_chars() {
        for (field, value) in [
            ("order_id", "O-\u{202e}1001"),
            ("uid", "\u{202e}txt.exe"),
            ("uid", "u\u{200b}1"),
            ("order_id", "O-\u{ad}1"),
            ("order_id", "O-\u{7}1"),
            ("uid", "u\u{a0}1"),
        ] {
            let mut body =
                serde_json::json!({"order_id":"o","uid":"u","phone":"+123456","pool":"p"});
            body[field] = value.into();
            let err = Purchase::parse(body.to_string().as_bytes()).unwrap_err();
            assert_eq!(err.reason, RejectReason::InvalidChars, "{field}={value:?}");
            assert!(err.to_string().starts_with("invalid_chars: field"), "{err}");
            assert!(err.to_string().contains("U+"), "{err}");
        }
        // Other scripts and inner spaces are plain text.
        let body = r#"{"order_id":"订单 1","uid":"ключ","phone":"+123456","pool":"p"}"#;
        assert!(Purchase::parse(body.as_bytes()).is_ok());
    }

    #[test]
    fn invalid_messages_say_why() {
        assert_eq!(reason("nope"), RejectReason::NotJson);
        assert_eq!(reason("[1,2]"), RejectReason::NotObject);
        assert_eq!(
            reason(r#"{"uid":"u","phone":"+123456","pool":"p"}"#),
            RejectReason::MissingField
        );
        assert_eq!(
            reason(r#"{"order_id":7,"uid":"u","phone":"+123456","pool":"p"}"#),
            RejectReason::WrongType
        );
        assert_eq!(
            reason(r#"{"order_id":"o","uid":"u","phone":"call me","pool":"p"}"#),
            RejectReason::InvalidPhone
        );
        assert_eq!(
            reason(r#"{"order_id":"o","uid":"u","phone":"+123456","pool":"a b"}"#),
            RejectReason::InvalidPool
        );
        assert_eq!(
            reason(
                r#"{"order_id":"o","uid":"u","phone":"+123456","pool":"p","purchased_at":"yesterday"}"#
            ),
            RejectReason::InvalidTime
        );
        let long = format!(
            r#"{{"order_id":"{}","uid":"u","phone":"+123456","pool":"p"}}"#,
            "o".repeat(200)
        );
        assert_eq!(reason(&long), RejectReason::TooLong);
        let huge = format!(r#"{{"order_id":"{}"}}"#, "o".repeat(MAX_MESSAGE_BYTES));
        assert_eq!(reason(&huge), RejectReason::TooLarge);
        assert_eq!(
            Purchase::parse(&[0xff, 0xfe, b'{']).unwrap_err().reason,
            RejectReason::NotJson
        );
    }

    #[test]
    fn a_repeated_field_is_refused_not_last_one_wins() {
        let e = Purchase::parse(
            br#"{"order_id":"O-1","uid":"u","phone":"+123456","pool":"p","order_id":"O-2"}"#,
        )
        .unwrap_err();
        assert_eq!(e.reason, RejectReason::DuplicateField);
        assert!(e.detail.contains("order_id"), "{e}");
        // The same key spelled with an escape is the same key.
        assert_eq!(
            reason(
                r#"{"order_id":"O-1","uid":"u","phone":"+123456","pool":"p","order\u005fid":"O-2"}"#
            ),
            RejectReason::DuplicateField
        );
        assert_eq!(
            reason(r#"{"order_id":"O-1","uid":"u","phone":"+123456","pool":"p","x":1,"x":2}"#),
            RejectReason::DuplicateField
        );
        // Nested objects are values: their keys are not the purchase's.
        assert_eq!(
            reason(r#"{"order_id":{"a":1,"a":2},"uid":"u","phone":"+123456","pool":"p"}"#),
            RejectReason::WrongType
        );
        assert_eq!(reason(r#"{"order_id":"O-1"} {}"#), RejectReason::NotJson);
        assert_eq!(reason("\"text\""), RejectReason::NotObject);
        assert_eq!(reason("null"), RejectReason::NotObject);
    }

    #[test]
    fn the_error_text_starts_with_the_reason_class() {
        let e = Purchase::parse(b"{}").unwrap_err();
        assert!(e.to_string().starts_with("missing_field: "), "{e}");
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(body in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = Purchase::parse(&body);
        }

        #[test]
        fn any_json_value_types_give_a_clear_error_or_a_purchase(
            order in prop_oneof![Just(serde_json::json!(null)), any::<i64>().prop_map(|v| serde_json::json!(v)), ".{0,200}".prop_map(|s| serde_json::json!(s))],
            phone in prop_oneof![Just(serde_json::json!([1])), "[+0-9]{0,20}".prop_map(|s| serde_json::json!(s))],
        ) {
            let body = serde_json::json!({"order_id": order, "uid": "u", "phone": phone, "pool": "p"});
            match Purchase::parse(body.to_string().as_bytes()) {
                Ok(p) => prop_assert!(!p.order_id.is_empty() && p.order_id.chars().count() <= 128),
                Err(e) => prop_assert!(!e.detail.is_empty()),
            }
        }
    }
}
