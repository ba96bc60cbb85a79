//! Console sessions as stored: only the SHA-256 of the cookie's random
//! 256-bit token is kept, with the operator, a CSRF token of its own, and
//! an expiry that a TTL index enforces (and every read checks). The
//! console door sets and reads the cookie; disabling an operator ends all
//! of theirs ([`crate::operators::disable`]).

use bson::DateTime;
use rand::RngCore;
use sha2::{Digest, Sha256};

use codepool_store::{Store, StoreError};

/// A session as stored.
pub use codepool_store::operators::{SessionDoc, SESSIONS};

fn random_hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    rand::rng().fill_bytes(&mut buf);
    hex::encode(buf)
}

fn sha256_hex(s: &str) -> String {
    hex::encode(Sha256::digest(s.as_bytes()))
}

/// Opens a session for `operator`; returns the cookie's token.
pub async fn start(
    store: &Store,
    operator: &str,
    ttl: std::time::Duration,
) -> Result<String, StoreError> {
    let token = random_hex(32);
    let now = chrono::Utc::now();
    let ttl = chrono::Duration::from_std(ttl).unwrap_or(chrono::Duration::hours(8));
    let doc = SessionDoc {
        id: sha256_hex(&token),
        operator: operator.to_owned(),
        csrf: random_hex(32),
        created_at: DateTime::from_chrono(now),
        expires_at: DateTime::from_chrono(now + ttl),
    };
    store.insert_session(&doc).await?;
    Ok(token)
}

/// The live session of a cookie token.
pub async fn find(store: &Store, token: &str) -> Result<Option<SessionDoc>, StoreError> {
    if token.len() != 64 {
        return Ok(None);
    }
    store.live_session(&sha256_hex(token)).await
}

/// Ends one session.
pub async fn end(store: &Store, id: &str) -> Result<(), StoreError> {
    store.delete_session(id).await
}
