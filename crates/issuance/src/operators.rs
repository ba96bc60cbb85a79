//! Operator accounts: a name, a role and an argon2id hash of a password.
//! Accounts come from the CLI (`codepool operators add|list|disable|passwd`)
//! or from an admin's console page; a disabled account cannot sign in and
//! its sessions end at once. Adding, disabling and a new password are
//! audited here, with whoever asked, so the CLI and the console leave the
//! same record (never the password).

use argon2::password_hash::{PasswordHash, PasswordHasher, PasswordVerifier, SaltString};
use argon2::Argon2;
use bson::DateTime;
use rand::RngCore;

use crate::audit::{self, Actor, AuditKind};
use codepool_store::{Store, StoreError};

/// The operators' and their sessions' collections, and the documents
/// (the store reads and writes them; the rules are here).
pub use codepool_store::operators::{OperatorDoc, Role, OPERATORS, SESSIONS};

/// Shortest and longest password accepted.
pub const MIN_PASSWORD: usize = 10;
pub const MAX_PASSWORD: usize = 1024;

#[derive(Debug, thiserror::Error)]
pub enum OperatorError {
    #[error("an operator named {0:?} exists already; pick another name, or change its password with `codepool operators passwd`")]
    NameTaken(String),
    #[error("the name must be 1 to 64 letters, digits, '.', '_' or '-'")]
    BadName,
    #[error("the password must be {MIN_PASSWORD} to {MAX_PASSWORD} characters")]
    BadPassword,
    #[error("no operator is named {0:?}; `codepool operators list` shows them")]
    Unknown(String),
    #[error("the password could not be hashed: {0}")]
    Hash(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

pub fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// An argon2id hash of `password` (OWASP's default parameters), computed
/// off the async threads.
pub async fn hash_password(password: &str) -> Result<String, OperatorError> {
    let chars = password.chars().count();
    if !(MIN_PASSWORD..=MAX_PASSWORD).contains(&chars) {
        return Err(OperatorError::BadPassword);
    }
    let password = password.to_owned();
    let mut salt = [0u8; 16];
    rand::rng().fill_bytes(&mut salt);
    tokio::task::spawn_blocking(move || {
        let salt = SaltString::encode_b64(&salt).map_err(|e| OperatorError::Hash(e.to_string()))?;
        Argon2::default()
            .hash_password(password.as_bytes(), &salt)
            .map(|h| h.to_string())
            .map_err(|e| OperatorError::Hash(e.to_string()))
    })
    .await
    .map_err(|e| OperatorError::Hash(e.to_string()))?
}

/// A hash that matches no password anyone types, checked when the name
/// is unknown so that a wrong name takes as long as a wrong password.
fn decoy() -> &'static str {
    static DECOY: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    DECOY.get_or_init(|| {
        let salt = SaltString::encode_b64(b"codepool-decoy!!").expect("16 bytes encode");
        Argon2::default()
            .hash_password(b"\0no operator has this password\0", &salt)
            .map(|h| h.to_string())
            .unwrap_or_default()
    })
}

/// Whether `password` matches `hash` (argon2id, constant time), off the
/// async threads; `None` checks against a decoy and is false.
pub async fn verify_password(hash: Option<&str>, password: &str) -> bool {
    let (hash, password) = (hash.map(str::to_owned), password.to_owned());
    tokio::task::spawn_blocking(move || {
        let known = hash.is_some();
        let hash = hash.unwrap_or_else(|| decoy().to_owned());
        let ok = PasswordHash::new(&hash)
            .map(|h| {
                Argon2::default()
                    .verify_password(password.as_bytes(), &h)
                    .is_ok()
            })
            .unwrap_or(false);
        ok && known
    })
    .await
    .unwrap_or(false)
}

/// Creates an operator. Audited with `actor` (`operator-add`).
pub async fn add(
    store: &Store,
    name: &str,
    role: Role,
    password: &str,
    actor: &Actor,
) -> Result<OperatorDoc, OperatorError> {
    if !valid_name(name) {
        return Err(OperatorError::BadName);
    }
    let op = OperatorDoc {
        name: name.to_owned(),
        role,
        hash: hash_password(password).await?,
        created_at: DateTime::now(),
        password_changed_at: None,
        disabled_at: None,
    };
    if !store.insert_operator(&op).await? {
        return Err(OperatorError::NameTaken(name.to_owned()));
    }
    let what = format!("operator {:?} added as {}", op.name, role.as_str());
    audit::record(store, actor, AuditKind::OperatorAdd, what).await?;
    Ok(op)
}

/// Every operator, by name.
pub async fn list(store: &Store) -> Result<Vec<OperatorDoc>, OperatorError> {
    Ok(store.operators().await?)
}

/// The operator named `name`, enabled or not.
pub async fn find(store: &Store, name: &str) -> Result<Option<OperatorDoc>, StoreError> {
    store.operator(name).await
}

/// Disables an operator and ends its sessions. Audited with `actor`
/// (`operator-disable`).
pub async fn disable(
    store: &Store,
    name: &str,
    actor: &Actor,
) -> Result<OperatorDoc, OperatorError> {
    let op = (store.disable_operator(name).await?)
        .ok_or_else(|| OperatorError::Unknown(name.to_owned()))?;
    end_sessions(store, name).await?;
    let what = format!("operator {:?} disabled", op.name);
    audit::record(store, actor, AuditKind::OperatorDisable, what).await?;
    Ok(op)
}

/// Ends every console session of `operator`: a disabled operator, or one
/// whose password changed, is signed out everywhere.
async fn end_sessions(store: &Store, operator: &str) -> Result<u64, StoreError> {
    store.end_operator_sessions(operator).await
}

/// Sets a new password (and enables the account again); its sessions end.
/// Audited with `actor` (`operator-passwd`; the password never is).
pub async fn passwd(
    store: &Store,
    name: &str,
    password: &str,
    actor: &Actor,
) -> Result<(), OperatorError> {
    let hash = hash_password(password).await?;
    let before = (store.set_operator_password(name, &hash).await?)
        .ok_or_else(|| OperatorError::Unknown(name.to_owned()))?;
    end_sessions(store, name).await?;
    let enabled = if before.disabled_at.is_some() {
        "; the account is enabled again"
    } else {
        ""
    };
    let what = format!("password of operator {:?} changed{enabled}", before.name);
    audit::record(store, actor, AuditKind::OperatorPasswd, what).await?;
    Ok(())
}

/// The enabled operator `name` if `password` is its password. An unknown
/// name costs the same hash as a known one.
pub async fn authenticate(
    store: &Store,
    name: &str,
    password: &str,
) -> Result<Option<OperatorDoc>, StoreError> {
    let op = if valid_name(name) {
        find(store, name).await?
    } else {
        None
    };
    let ok = verify_password(op.as_ref().map(|o| o.hash.as_str()), password).await;
    Ok(op.filter(|o| ok && o.disabled_at.is_none()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_password_verifies_against_its_own_hash_only() {
        let h = hash_password("correct horse battery").await.unwrap();
        assert!(h.starts_with("$argon2id$"), "{h}");
        assert!(verify_password(Some(&h), "correct horse battery").await);
        assert!(!verify_password(Some(&h), "correct horse batterz").await);
        assert!(!verify_password(None, "correct horse battery").await);
        assert!(matches!(
            hash_password("short").await,
            Err(OperatorError::BadPassword)
        ));
    }

    #[test]
    fn roles_hold_the_roles_below_them() {
        assert!(Role::Admin > Role::Support && Role::Support > Role::Viewer);
        for r in Role::ALL {
            assert_eq!(Role::parse(r.as_str()), Some(r));
        }
        assert_eq!(Role::parse("root"), None);
        assert!(valid_name("alice.b-2") && !valid_name("a b") && !valid_name(""));
    }
}
