//! API keys: a name, scopes, and a secret shown once. Only a SHA-256 hash
//! of the secret is stored (the secret is 256 random bits, so a fast hash
//! is enough: there is nothing to guess). A key reads as
//! `cpk_<id>_<secret>`; the id finds the key, the hash proves the secret.
//! Revoked keys stop working within [`KEY_TTL`] on every API process.
//! Creating and revoking a key are audited here, with whoever asked, so
//! the CLI and the console leave the same record (never the secret).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bson::DateTime;
use rand::RngCore;
use sha2::{Digest, Sha256};

use codepool_store::{Store, StoreError};

use crate::audit::{self, Actor, AuditKind};

/// The keys' collection and documents (the store reads and writes them;
/// the rules are here).
pub use codepool_store::api_keys::{KeyDoc, Scope, API_KEYS};

/// How long a process trusts what it read of a key: a revocation takes
/// effect within this long everywhere.
pub const KEY_TTL: Duration = Duration::from_secs(1);

/// Makes `purchase` the order of `key`: its owner is the key's (see
/// [`KeyDoc::owner`]), and a shop's key orders for its shop only. A shop's
/// key that names another shop is refused, on the `shop` field. The order
/// then belongs to the key: a repeat by any other key (or of an order that
/// came over AMQP) is a conflict, with no code.
pub fn stamp(
    key: &KeyDoc,
    purchase: &mut codepool_domain::Purchase,
) -> Result<(), codepool_domain::PurchaseError> {
    if let Some(shop) = &key.shop {
        if purchase.shop.as_ref().is_some_and(|s| s != shop) {
            return Err(codepool_domain::PurchaseError::new(
                codepool_domain::RejectReason::UnknownShop,
                format!("this key belongs to shop {shop:?} and orders only for it; leave \"shop\" out, or send {shop:?}"),
            )
            .on("shop"));
        }
        purchase.shop = Some(shop.clone());
    }
    purchase.owner = Some(key.owner());
    Ok(())
}

/// A new key: its record and the token to hand to the shop, once.
#[derive(Debug, Clone)]
pub struct NewKey {
    pub key: KeyDoc,
    pub token: String,
}

#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("a key named {0:?} exists already; pick another name, or revoke it first")]
    NameTaken(String),
    #[error("the name must be 1 to 64 letters, digits, '.', '_' or '-'")]
    BadName,
    #[error("name at least one scope: {}", Scope::ALL.map(Scope::as_str).join(", "))]
    NoScope,
    #[error("no key is named {0:?}; `codepool api-keys list` shows them")]
    Unknown(String),
    #[error("no shop {0:?}; create it first (`codepool shops create --name {0} --pools …`)")]
    UnknownShop(String),
    #[error("a shop's key cannot have the admin scope: admin acts on every shop's orders")]
    ShopAdmin,
    #[error(transparent)]
    Store(#[from] StoreError),
}

fn sha256_hex(s: &str) -> String {
    hex::encode(Sha256::digest(s.as_bytes()))
}

fn random_hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    rand::rng().fill_bytes(&mut buf);
    hex::encode(buf)
}

/// Equal in time that does not depend on where they differ.
fn same(a: &str, b: &str) -> bool {
    subtle::ConstantTimeEq::ct_eq(a.as_bytes(), b.as_bytes()).into()
}

/// The id and secret of a token `cpk_<id>_<secret>`.
fn split_token(token: &str) -> Option<(&str, &str)> {
    let rest = token.strip_prefix("cpk_")?;
    let (id, secret) = rest.split_once('_')?;
    (id.len() == 16 && secret.len() == 64).then_some((id, secret))
}

fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// Creates an operator's key. Names are unique among keys not revoked.
/// Audited with `actor`.
pub async fn create(
    store: &Store,
    name: &str,
    scopes: &[Scope],
    actor: &Actor,
) -> Result<NewKey, KeyError> {
    create_for(store, name, scopes, None, actor).await
}

/// Creates a key, of `shop` when given (which must exist, and whose keys
/// may not have the admin scope). Audited with `actor` (`api-key-create`:
/// the name, shop and scopes, never the secret); the secret is for the
/// caller to show once.
pub async fn create_for(
    store: &Store,
    name: &str,
    scopes: &[Scope],
    shop: Option<&str>,
    actor: &Actor,
) -> Result<NewKey, KeyError> {
    if !valid_name(name) {
        return Err(KeyError::BadName);
    }
    if scopes.is_empty() {
        return Err(KeyError::NoScope);
    }
    if let Some(shop) = shop {
        if scopes.contains(&Scope::Admin) {
            return Err(KeyError::ShopAdmin);
        }
        if store.shop(shop).await?.is_none() {
            return Err(KeyError::UnknownShop(shop.to_owned()));
        }
    }
    if store.live_api_key(name).await?.is_some() {
        return Err(KeyError::NameTaken(name.to_owned()));
    }
    let (id, secret) = (random_hex(8), random_hex(32));
    // Each scope once, in the order first given.
    let mut scopes = scopes.to_vec();
    let mut seen = std::collections::HashSet::new();
    scopes.retain(|s| seen.insert(*s));
    let key = KeyDoc {
        id: id.clone(),
        name: name.to_owned(),
        hash: sha256_hex(&secret),
        scopes,
        created_at: DateTime::now(),
        revoked_at: None,
        shop: shop.map(str::to_owned),
    };
    store.insert_api_key(&key).await?;
    let scopes = key.scopes.iter().map(|s| s.as_str()).collect::<Vec<_>>();
    let of = (key.shop.as_deref()).map_or(String::new(), |s| format!(" of shop {s:?}"));
    let what = format!(
        "API key {:?}{of} created with scopes {}",
        key.name,
        scopes.join(",")
    );
    audit::record(store, actor, AuditKind::ApiKeyCreate, what).await?;
    Ok(NewKey {
        key,
        token: format!("cpk_{id}_{secret}"),
    })
}

/// Every key, newest first.
pub async fn list(store: &Store) -> Result<Vec<KeyDoc>, KeyError> {
    Ok(store.api_keys().await?)
}

/// Revokes the live key named `name`. Audited with `actor`
/// (`api-key-revoke`).
pub async fn revoke(store: &Store, name: &str, actor: &Actor) -> Result<KeyDoc, KeyError> {
    let revoked =
        (store.revoke_api_key(name).await?).ok_or_else(|| KeyError::Unknown(name.to_owned()))?;
    let what = format!("API key {:?} ({}) revoked", revoked.name, revoked.id);
    audit::record(store, actor, AuditKind::ApiKeyRevoke, what).await?;
    Ok(revoked)
}

/// Verifies tokens against the stored keys, each key read at most once a
/// [`KEY_TTL`] per process.
pub struct Verifier {
    cache: Mutex<HashMap<String, (Instant, Option<KeyDoc>)>>,
    /// Where the ages of the keys read are taken.
    clock: std::sync::Arc<dyn crate::clock::Clock>,
}

impl Default for Verifier {
    fn default() -> Self {
        Self::with_clock(crate::clock::system())
    }
}

impl Verifier {
    /// A verifier whose cached keys age by `clock`.
    pub fn with_clock(clock: std::sync::Arc<dyn crate::clock::Clock>) -> Self {
        Self {
            cache: Mutex::default(),
            clock,
        }
    }

    /// The key a token proves, if any (`None`: no such key, a wrong
    /// secret, or a revoked key).
    pub async fn verify(&self, store: &Store, token: &str) -> Result<Option<KeyDoc>, StoreError> {
        let Some((id, secret)) = split_token(token) else {
            return Ok(None);
        };
        let now = self.clock.now();
        let cached = self.cache.lock().ok().and_then(|c| {
            c.get(id)
                .filter(|(at, _)| now.duration_since(*at) < KEY_TTL)
                .map(|(_, k)| k.clone())
        });
        let key = match cached {
            Some(k) => k,
            None => {
                let k = store.api_key(id).await?;
                if let Ok(mut c) = self.cache.lock() {
                    if c.len() > 10_000 {
                        c.clear();
                    }
                    c.insert(id.to_owned(), (now, k.clone()));
                }
                k
            }
        };
        Ok(key.filter(|k| k.revoked_at.is_none() && same(&k.hash, &sha256_hex(secret))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_split_only_in_their_own_shape() {
        let token = format!("cpk_{}_{}", "a".repeat(16), "b".repeat(64));
        assert_eq!(split_token(&token).map(|(i, _)| i.len()), Some(16));
        for bad in [
            "",
            "cpk_",
            "Bearer x",
            "cpk_short_secret",
            &token[..token.len() - 1],
        ] {
            assert!(split_token(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn scopes_read_as_they_print() {
        for s in Scope::ALL {
            assert_eq!(Scope::parse(s.as_str()), Some(s));
        }
        assert_eq!(Scope::parse("orders:delete"), None);
        assert!(same("abc", "abc") && !same("abc", "abd") && !same("abc", "ab"));
    }
}
