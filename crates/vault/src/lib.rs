//! # codepool-vault
//!
//! An activation code is a bearer secret: whoever reads it can use it. This
//! crate holds what keeps codes secret at rest, and nothing else:
//!
//! - a [`Keyring`]: encryption keys by id (one of them active) and one
//!   stable HMAC key;
//! - [`Keyring::seal`] / [`Keyring::open`]: XChaCha20-Poly1305 with a random
//!   24-byte nonce per code, and associated data chosen by the caller (the
//!   store binds each ciphertext to its document, so ciphertexts cannot be
//!   swapped between documents);
//! - [`Keyring::code_hmac`]: HMAC-SHA-256 of `pool ‖ 0x00 ‖ code`, which the
//!   unique index, import dedupe and lookups use instead of the plaintext.
//!   The HMAC key never rotates: the unique index depends on it;
//! - [`keyfile`]: the JSON key file (mode 0600) that holds all of it.
//!
//! Pure computation apart from the key file; no database, no network.

pub mod keyfile;

use std::collections::BTreeMap;

use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use zeroize::Zeroizing;

/// Bytes of every key: encryption keys and the HMAC key.
pub const KEY_LEN: usize = 32;
/// Bytes of the random nonce stored in front of each ciphertext.
pub const NONCE_LEN: usize = 24;
/// The first byte of a sealed code: the format, so it can change later.
const FORMAT_V1: u8 = 1;

/// 32 secret bytes, wiped from memory when dropped.
pub type Secret = Zeroizing<[u8; KEY_LEN]>;

/// Why a key or a ciphertext could not be used. Each says what to do next.
#[derive(Debug, thiserror::Error)]
pub enum VaultError {
    #[error("no key file at {path}; create one with `codepool keys init`, or point CODEPOOL_KEY_FILE (or --key-file) at yours")]
    Missing { path: String },
    #[error("cannot use key file {path}: {message}")]
    Io { path: String, message: String },
    #[error(
        "{path} is not a codepool key file ({message}); restore the key file from your backup"
    )]
    Invalid { path: String, message: String },
    #[error("key file {path} can be read by other users (mode {mode:o}); run `chmod 600 {path}`")]
    Permissions { path: String, mode: u32 },
    #[error("a key file already exists at {path}; codepool never overwrites one, since losing it loses the codes. Use `codepool keys add` to add a key")]
    Exists { path: String },
    #[error("key {0:?} is used in the database but missing from the key file; restore the key file that holds it from your backup")]
    UnknownKey(String),
    #[error("the key file's HMAC key does not match the codes in the database: this key file is not the one the database was created with; point CODEPOOL_KEY_FILE at the right one")]
    WrongHmacKey,
    #[error("key {key_id:?} does not decrypt the stored codes: this key file is not the one the database was encrypted with; point CODEPOOL_KEY_FILE at the right one")]
    Decrypt { key_id: String },
}

/// Encryption keys by id, the active one, and the HMAC key.
///
/// New codes are sealed under the active key; any key of the ring opens
/// codes sealed under it, so rotation can re-encrypt at its own pace.
#[derive(Clone)]
pub struct Keyring {
    active: String,
    keys: BTreeMap<String, Secret>,
    hmac: Secret,
}

impl std::fmt::Debug for Keyring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key material.
        f.debug_struct("Keyring")
            .field("active", &self.active)
            .field("keys", &self.keys.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

/// A code sealed under one key: `key_id` and `1 ‖ nonce ‖ ciphertext+tag`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sealed {
    pub key_id: String,
    pub bytes: Vec<u8>,
}

fn random_secret() -> Secret {
    Zeroizing::new(rand::random::<[u8; KEY_LEN]>())
}

impl Keyring {
    /// A fresh ring: one random encryption key `k1` (active), one random
    /// HMAC key.
    pub fn generate() -> Self {
        let mut keys = BTreeMap::new();
        keys.insert("k1".to_owned(), random_secret());
        Self {
            active: "k1".into(),
            keys,
            hmac: random_secret(),
        }
    }

    /// A ring from its parts; `active` must be one of `keys`.
    pub fn from_parts(
        active: String,
        keys: BTreeMap<String, Secret>,
        hmac: Secret,
    ) -> Result<Self, String> {
        if !keys.contains_key(&active) {
            return Err(format!("the active key {active:?} is not among the keys"));
        }
        Ok(Self { active, keys, hmac })
    }

    pub fn active_id(&self) -> &str {
        &self.active
    }

    pub fn key_ids(&self) -> impl Iterator<Item = &str> {
        self.keys.keys().map(String::as_str)
    }

    pub fn has_key(&self, id: &str) -> bool {
        self.keys.contains_key(id)
    }

    pub(crate) fn key(&self, id: &str) -> Option<&Secret> {
        self.keys.get(id)
    }

    pub(crate) fn hmac_key(&self) -> &Secret {
        &self.hmac
    }

    /// Adds a random key and makes it active; returns its id (`k2`, `k3`…).
    /// The HMAC key stays: the unique index depends on it.
    pub fn add_key(&mut self) -> String {
        let next = self
            .keys
            .keys()
            .filter_map(|id| id.strip_prefix('k')?.parse::<u64>().ok())
            .max()
            .unwrap_or(0)
            + 1;
        let id = format!("k{next}");
        self.keys.insert(id.clone(), random_secret());
        self.active = id.clone();
        id
    }

    /// Encrypts `code` under the active key, bound to `aad`.
    pub fn seal(&self, aad: &[u8], code: &str) -> Sealed {
        let key = &self.keys[&self.active];
        let nonce: [u8; NONCE_LEN] = rand::random();
        let cipher = XChaCha20Poly1305::new(key.as_ref().into());
        let payload = Payload {
            msg: code.as_bytes(),
            aad,
        };
        let ct = cipher
            .encrypt(XNonce::from_slice(&nonce), payload)
            .expect("XChaCha20-Poly1305 encryption of a short message cannot fail");
        let mut bytes = Vec::with_capacity(1 + NONCE_LEN + ct.len());
        bytes.push(FORMAT_V1);
        bytes.extend_from_slice(&nonce);
        bytes.extend_from_slice(&ct);
        Sealed {
            key_id: self.active.clone(),
            bytes,
        }
    }

    /// Decrypts a code sealed under `key_id` with the same `aad`. A wrong
    /// key, altered bytes or another document's ciphertext all fail here.
    pub fn open(&self, key_id: &str, aad: &[u8], bytes: &[u8]) -> Result<String, VaultError> {
        let key = self
            .keys
            .get(key_id)
            .ok_or_else(|| VaultError::UnknownKey(key_id.to_owned()))?;
        let failed = || VaultError::Decrypt {
            key_id: key_id.to_owned(),
        };
        if bytes.len() < 1 + NONCE_LEN || bytes[0] != FORMAT_V1 {
            return Err(failed());
        }
        let (nonce, ct) = bytes[1..].split_at(NONCE_LEN);
        let cipher = XChaCha20Poly1305::new(key.as_ref().into());
        let plain = cipher
            .decrypt(XNonce::from_slice(nonce), Payload { msg: ct, aad })
            .map_err(|_| failed())?;
        String::from_utf8(plain).map_err(|_| failed())
    }

    /// HMAC-SHA-256 of `pool ‖ 0x00 ‖ code` under the HMAC key. The pool is
    /// part of the input, so equal codes in two pools do not look equal in
    /// the database (pool names never contain a NUL byte).
    pub fn code_hmac(&self, pool: &str, code: &str) -> [u8; 32] {
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(self.hmac.as_ref())
            .expect("HMAC accepts any key length");
        mac.update(pool.as_bytes());
        mac.update(&[0]);
        mac.update(code.as_bytes());
        mac.finalize().into_bytes().into()
    }

    /// HMAC-SHA-256 of `"any" ‖ 0x00 ‖ code`: the same for a code in every
    /// pool, so a code offered to a second pool is found in the first
    /// (`code_any_hmac`). Tagged apart from [`Keyring::code_hmac`] (whose
    /// input starts with a pool name, never empty and never NUL).
    pub fn any_pool_hmac(&self, code: &str) -> [u8; 32] {
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(self.hmac.as_ref())
            .expect("HMAC accepts any key length");
        mac.update(b"any\0");
        mac.update(code.as_bytes());
        mac.finalize().into_bytes().into()
    }

    /// HMAC-SHA-256 of `"cross" ‖ 0x00 ‖ key`, where `key` is a code's
    /// look-alike key under a rule that is the same in every pool
    /// (`codepool_domain::cross_pool_keys`): what the registry of which pool
    /// holds a code (`code_claims`) is keyed by. Tagged apart from every
    /// other HMAC here, and the same in every pool, so a code offered to a
    /// second pool meets the first pool's claim.
    pub fn cross_hmac(&self, key: &str) -> [u8; 32] {
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(self.hmac.as_ref())
            .expect("HMAC accepts any key length");
        mac.update(b"cross\0");
        mac.update(key.as_bytes());
        mac.finalize().into_bytes().into()
    }

    /// The statement key of `pool`: HMAC-SHA-256 of `0xFF ‖ "statement" ‖
    /// 0x00 ‖ pool` under the HMAC key. An operator gives it to the partner
    /// that supplies the pool, who then matches a statement's lines
    /// ([`statement_hmac`]) with its own codes. It opens nothing: it is not
    /// the HMAC key nor a sealing key, and tells nothing of another pool's
    /// (the input starts with a byte no pool name, and so no other HMAC
    /// input here, starts with).
    pub fn statement_key(&self, pool: &str) -> [u8; 32] {
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(self.hmac.as_ref())
            .expect("HMAC accepts any key length");
        mac.update(b"\xffstatement\0");
        mac.update(pool.as_bytes());
        mac.finalize().into_bytes().into()
    }

    /// HMAC-SHA-256 of `"fold" ‖ 0x00 ‖ pool ‖ 0x00 ‖ key`, where `key` is a
    /// code's look-alike key (`codepool_domain::fold`): what the unique
    /// look-alike index holds. Tagged apart from [`Keyring::code_hmac`], so
    /// the two columns never compare equal for different inputs.
    pub fn fold_hmac(&self, pool: &str, key: &str) -> [u8; 32] {
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(self.hmac.as_ref())
            .expect("HMAC accepts any key length");
        mac.update(b"fold\0");
        mac.update(pool.as_bytes());
        mac.update(&[0]);
        mac.update(key.as_bytes());
        mac.finalize().into_bytes().into()
    }
}

/// HMAC-SHA-256 of a code (its UTF-8 bytes, nothing else) under a pool's
/// statement key ([`Keyring::statement_key`]): what a statement's lines
/// name a code by. A partner computes the same with any HMAC library.
pub fn statement_hmac(key: &[u8; 32], code: &str) -> [u8; 32] {
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC accepts any key length");
    mac.update(code.as_bytes());
    mac.finalize().into_bytes().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_code_opens_with_its_key_and_aad_only() {
        let ring = Keyring::generate();
        let s = ring.seal(b"doc-1", "QWER-1234");
        assert_eq!(s.key_id, "k1");
        assert!(!s.bytes.windows(9).any(|w| w == b"QWER-1234"));
        assert_eq!(ring.open("k1", b"doc-1", &s.bytes).unwrap(), "QWER-1234");
        assert!(matches!(
            ring.open("k1", b"doc-2", &s.bytes),
            Err(VaultError::Decrypt { .. })
        ));
        let other = Keyring::generate();
        assert!(matches!(
            other.open("k1", b"doc-1", &s.bytes),
            Err(VaultError::Decrypt { .. })
        ));
        assert!(matches!(
            ring.open("k9", b"doc-1", &s.bytes),
            Err(VaultError::UnknownKey(_))
        ));
    }

    #[test]
    fn the_same_code_seals_differently_every_time() {
        let ring = Keyring::generate();
        assert_ne!(ring.seal(b"a", "X").bytes, ring.seal(b"a", "X").bytes);
    }

    #[test]
    fn the_hmac_is_stable_per_pool_and_survives_a_new_key() {
        let mut ring = Keyring::generate();
        let h = ring.code_hmac("p", "QWER");
        assert_eq!(h, ring.code_hmac("p", "QWER"));
        assert_ne!(h, ring.code_hmac("q", "QWER"));
        assert_ne!(ring.code_hmac("p", "QWER"), ring.code_hmac("p\0Q", "WER"));
        let old = ring.seal(b"a", "X");
        assert_eq!(ring.add_key(), "k2");
        assert_eq!(ring.active_id(), "k2");
        assert_eq!(
            ring.code_hmac("p", "QWER"),
            h,
            "rotation keeps the HMAC key"
        );
        assert_eq!(ring.open("k1", b"a", &old.bytes).unwrap(), "X");
        assert_eq!(ring.seal(b"a", "X").key_id, "k2");
    }

    #[test]
    fn debug_never_prints_key_material() {
        let ring = Keyring::generate();
        let text = format!("{ring:?}");
        assert!(text.contains("k1"));
        assert!(!text.contains(&hex::encode(ring.hmac_key().as_ref())));
    }
}
