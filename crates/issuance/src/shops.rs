//! Shops: each shop orders only from its own pools, and its orders are its
//! own. The rules live here, once, for every door: a shop is created and
//! changed here (audited), and [`Shops::admit`] holds every purchase that
//! names a shop (an API key's shop over HTTP, the `shop` field over AMQP)
//! to the shop's pools and makes the order the shop's (`owner`
//! `shop:NAME`), so that only the shop's keys read, repeat, void, redeem or
//! resend it.

use std::collections::HashMap;
use std::sync::RwLock;
use std::time::{Duration, Instant};

use codepool_domain::{Pool, PurchaseError};
use codepool_store::shops::{ShopDoc, EVERY_POOL};
use codepool_store::{Store, StoreError};

use crate::audit::{self, Actor, AuditKind};
use crate::plan::Admission;

/// How long a process trusts what it read of a shop: a change to a shop's
/// pools holds everywhere within this.
pub const SHOP_TTL: Duration = Duration::from_secs(1);

/// The owner recorded with a shop's orders.
pub fn owner_of(shop: &str) -> String {
    format!("{}{shop}", codepool_store::codes::SHOP_OWNER_PREFIX)
}

/// How the AMQP door marks a purchase that names a shop with the broker
/// user that published it (RabbitMQ's validated `user_id`), until the
/// shop admits it and its owner becomes the shop's.
pub const BROKER_USER_PREFIX: &str = "amqp-user:";

/// The owner the AMQP door records on a purchase that names a shop,
/// published by broker user `user` (none: the message carried no
/// `user_id`).
pub fn published_by(user: Option<&str>) -> Option<String> {
    user.map(|u| format!("{BROKER_USER_PREFIX}{u}"))
}

/// Holds an AMQP purchase to the rights of its publisher (`user`, the
/// broker user RabbitMQ vouches for; none when unknown): a purchase that
/// names a shop is marked with its publisher, and the shop admission
/// ([`Shops::admit`]) lets it through only from a broker user the shop
/// names; a purchase that names no shop is the operator's, so it comes
/// from one of the operator's broker users (`operators`: codepool's own and
/// `CODEPOOL_OPERATOR_BROKER_USERS`) or is refused `shop_not_yours` here,
/// before it can pay a hold or take a code. A shop's broker user thus
/// publishes its own shop's purchases and nothing else.
pub fn admit_publisher(
    p: &mut codepool_domain::Purchase,
    user: Option<&str>,
    operators: &[String],
) -> Result<(), PurchaseError> {
    if p.shop.is_some() {
        p.owner = published_by(user);
        return Ok(());
    }
    match user {
        Some(u) if operators.iter().any(|o| o == u) => Ok(()),
        _ => Err(PurchaseError::not_the_operators(user)),
    }
}

/// Whether purchase `p` may name `shop`: a purchase over HTTP carries its
/// key's owner (the API holds a shop's key to its shop; a key of no shop
/// is the operator's and may order for any shop); one over AMQP must come
/// from a broker user the shop names.
pub fn may_name(shop: &ShopDoc, p: &codepool_domain::Purchase) -> Result<(), PurchaseError> {
    match p.owner.as_deref() {
        Some(o) if o.starts_with(BROKER_USER_PREFIX) => {
            let user = &o[BROKER_USER_PREFIX.len()..];
            if shop.broker_users.iter().any(|u| u == user) {
                Ok(())
            } else {
                Err(PurchaseError::shop_not_yours(&shop.name, Some(user)))
            }
        }
        Some(_) => Ok(()),
        None => Err(PurchaseError::shop_not_yours(&shop.name, None)),
    }
}

/// The shop an order belongs to, from its owner; `None` for the
/// operator's orders.
pub fn shop_of(owner: Option<&str>) -> Option<&str> {
    owner?.strip_prefix(codepool_store::codes::SHOP_OWNER_PREFIX)
}

/// Why a shop was not created or changed.
#[derive(Debug, thiserror::Error)]
pub enum ShopError {
    #[error("invalid shop name {0:?}: use 1 to 64 characters from A-Z a-z 0-9 . _ -, starting with a letter or a digit")]
    BadName(String),
    #[error("invalid pool {0:?} in the shop's pools: {1}")]
    BadPool(String, String),
    #[error("a shop needs at least one pool, or * for every pool")]
    NoPools,
    #[error("shop {0:?} exists already; change its pools with `shops set`")]
    Exists(String),
    #[error("no shop {0:?}; `codepool shops list` shows the shops")]
    Unknown(String),
    #[error("invalid broker user {0:?}: use the RabbitMQ user name as it is, in visible text")]
    BadBrokerUser(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl ShopError {
    /// The field at fault, for a door to name.
    pub fn field(&self) -> Option<&'static str> {
        match self {
            Self::BadName(_) | Self::Exists(_) | Self::Unknown(_) => Some("name"),
            Self::BadPool(..) | Self::NoPools => Some("pools"),
            Self::BadBrokerUser(_) => Some("broker_users"),
            Self::Store(_) => None,
        }
    }
}

/// Checks a shop's name.
pub fn valid_name(name: &str) -> Result<(), ShopError> {
    Pool::new(name)
        .map(|_| ())
        .map_err(|_| ShopError::BadName(name.chars().take(80).collect()))
}

/// A pool list as given (`game-x,game-y`, `*`), checked, deduplicated and
/// sorted; `*` alone when it is among them.
pub fn pool_list<S: AsRef<str>>(pools: &[S]) -> Result<Vec<String>, ShopError> {
    let mut out: Vec<String> = Vec::new();
    for p in pools
        .iter()
        .map(|p| p.as_ref().trim())
        .filter(|p| !p.is_empty())
    {
        if p == EVERY_POOL {
            return Ok(vec![EVERY_POOL.to_owned()]);
        }
        Pool::new(p).map_err(|e| ShopError::BadPool(p.to_owned(), e.to_string()))?;
        out.push(p.to_owned());
    }
    out.sort();
    out.dedup();
    if out.is_empty() {
        return Err(ShopError::NoPools);
    }
    Ok(out)
}

/// Creates a shop, audited with `actor`.
pub async fn create(
    store: &Store,
    name: &str,
    pools: &[String],
    actor: &Actor,
) -> Result<ShopDoc, ShopError> {
    valid_name(name)?;
    let pools = pool_list(pools)?;
    if !store.create_shop(name, &pools).await? {
        return Err(ShopError::Exists(name.to_owned()));
    }
    let what = format!("shop {name:?} created with pools {}", pools.join(","));
    audit::record(store, actor, AuditKind::ShopCreate, what).await?;
    store
        .shop(name)
        .await?
        .ok_or_else(|| ShopError::Unknown(name.to_owned()))
}

/// Replaces the broker users that may publish purchases for a shop over
/// AMQP, audited with `actor`.
pub async fn set_broker_users(
    store: &Store,
    name: &str,
    users: &[String],
    actor: &Actor,
) -> Result<ShopDoc, ShopError> {
    let mut users: Vec<String> = (users.iter())
        .map(|u| u.trim().to_owned())
        .filter(|u| !u.is_empty())
        .collect();
    if let Some(bad) = users
        .iter()
        .find(|u| codepool_domain::first_unreadable(u).is_some() || u.len() > 255)
    {
        return Err(ShopError::BadBrokerUser(bad.chars().take(80).collect()));
    }
    users.sort();
    users.dedup();
    let shop = (store.set_shop_broker_users(name, &users).await?)
        .ok_or_else(|| ShopError::Unknown(name.to_owned()))?;
    let what = format!("shop {name:?} takes AMQP purchases from broker users {users:?}");
    audit::record(store, actor, AuditKind::ShopSet, what).await?;
    Ok(shop)
}

/// Replaces a shop's pools, audited with `actor`.
pub async fn set_pools(
    store: &Store,
    name: &str,
    pools: &[String],
    actor: &Actor,
) -> Result<ShopDoc, ShopError> {
    let pools = pool_list(pools)?;
    let shop = (store.set_shop_pools(name, &pools).await?)
        .ok_or_else(|| ShopError::Unknown(name.to_owned()))?;
    let what = format!("shop {name:?} now orders from {}", pools.join(","));
    audit::record(store, actor, AuditKind::ShopSet, what).await?;
    Ok(shop)
}

/// The shops a process knows, each re-read after [`SHOP_TTL`].
#[derive(Debug)]
pub struct Shops {
    known: RwLock<HashMap<String, (Instant, Option<ShopDoc>)>>,
    /// Where the ages of the shops read are taken.
    clock: std::sync::Arc<dyn crate::clock::Clock>,
}

impl Default for Shops {
    fn default() -> Self {
        Self::with_clock(crate::clock::system())
    }
}

impl Shops {
    /// A cache whose shops age by `clock`.
    pub fn with_clock(clock: std::sync::Arc<dyn crate::clock::Clock>) -> Self {
        Self {
            known: RwLock::default(),
            clock,
        }
    }

    /// The shops named in `names` (`None`: no such shop), read at most
    /// once a [`SHOP_TTL`].
    pub async fn get_many(
        &self,
        store: &Store,
        names: &[&str],
    ) -> Result<HashMap<String, Option<ShopDoc>>, StoreError> {
        let mut out = HashMap::new();
        let mut stale = Vec::new();
        let now = self.clock.now();
        {
            let known = self.known.read().unwrap_or_else(|e| e.into_inner());
            for name in names {
                match known
                    .get(*name)
                    .filter(|(at, _)| now.duration_since(*at) < SHOP_TTL)
                {
                    Some((_, shop)) => {
                        out.insert((*name).to_owned(), shop.clone());
                    }
                    None => stale.push(*name),
                }
            }
        }
        if stale.is_empty() {
            return Ok(out);
        }
        let read = store.shops_named(&stale).await?;
        let mut known = self.known.write().unwrap_or_else(|e| e.into_inner());
        if known.len() > 10_000 {
            known.clear();
        }
        for name in stale {
            let shop = read.iter().find(|s| s.name == name).cloned();
            known.insert(name.to_owned(), (now, shop.clone()));
            out.insert(name.to_owned(), shop);
        }
        Ok(out)
    }

    /// Holds each purchase that names a shop to the shop's pools (an
    /// unknown shop or another pool is refused, nothing is claimed for it)
    /// and makes its order the shop's.
    pub async fn admit(
        &self,
        store: &Store,
        intake: Vec<Admission>,
    ) -> Result<Vec<Admission>, StoreError> {
        let mut names: Vec<&str> = (intake.iter())
            .filter_map(|i| match i {
                Admission::Claim(p) => p.shop.as_deref(),
                _ => None,
            })
            .collect();
        if names.is_empty() {
            return Ok(intake);
        }
        names.sort_unstable();
        names.dedup();
        let shops = self.get_many(store, &names).await?;
        Ok(intake
            .into_iter()
            .map(|i| match i {
                Admission::Claim(mut p) => {
                    let Some(name) = p.shop.clone() else {
                        return Admission::Claim(p);
                    };
                    match shops.get(&name).and_then(Option::as_ref) {
                        None => Admission::Reject(PurchaseError::unknown_shop(&name)),
                        Some(shop) if may_name(shop, &p).is_err() => {
                            Admission::Reject(may_name(shop, &p).expect_err("checked"))
                        }
                        Some(shop) if p.pools().iter().any(|x| !shop.allows(x)) => {
                            let pool = p.pools().into_iter().find(|x| !shop.allows(x));
                            Admission::Reject(PurchaseError::pool_not_allowed(
                                &name,
                                pool.unwrap_or_default(),
                            ))
                        }
                        Some(_) => {
                            p.owner = Some(owner_of(&name));
                            Admission::Claim(p)
                        }
                    }
                }
                other => other,
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_purchase_of_no_shop_comes_from_the_operators_broker_users_only() {
        let operators = vec!["codepool".to_owned(), "ops".to_owned()];
        let mut p = codepool_domain::Purchase::parse(
            br#"{"order_id":"O-1","uid":"u","phone":"+8613800000000","pool":"p"}"#,
        )
        .unwrap();
        for user in ["codepool", "ops"] {
            assert!(admit_publisher(&mut p, Some(user), &operators).is_ok());
            assert_eq!(p.owner, None, "the operator's order has no owner");
        }
        for user in [Some("acme-backend"), None] {
            let e = admit_publisher(&mut p, user, &operators).unwrap_err();
            assert_eq!(e.reason, codepool_domain::RejectReason::ShopNotYours);
        }
        // A purchase naming a shop carries its publisher to the shop's check.
        p.shop = Some("acme".into());
        admit_publisher(&mut p, Some("acme-backend"), &operators).unwrap();
        assert_eq!(p.owner.as_deref(), Some("amqp-user:acme-backend"));
    }

    #[test]
    fn pool_lists_are_checked_sorted_and_star_means_every_pool() {
        let l = pool_list(&["game-y", " game-x", "game-y", ""]).unwrap();
        assert_eq!(l, vec!["game-x", "game-y"]);
        assert_eq!(pool_list(&["game-x", "*"]).unwrap(), vec!["*"]);
        assert!(matches!(
            pool_list(&["bad pool"]),
            Err(ShopError::BadPool(..))
        ));
        assert!(matches!(pool_list::<&str>(&[]), Err(ShopError::NoPools)));
        assert!(valid_name("acme").is_ok() && valid_name("-acme").is_err());
    }
}
