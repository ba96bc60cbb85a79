//! How the store keeps codes secret: the [`CodeKeys`] it reads and writes
//! codes with, and the stored form of a sealed code.
//!
//! A code document holds `code_enc` (XChaCha20-Poly1305, bound to the
//! document's pool and `_id`), `key_id` (which key sealed it) and
//! `code_hmac` (HMAC-SHA-256 of `pool ‖ 0 ‖ code`, for the unique index and
//! lookups). Documents from before encryption still hold a plaintext `code`
//! until `codepool migrate` seals them; reads accept both, so nothing is
//! skipped or issued twice while the migration runs.

use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use bson::oid::ObjectId;
use bson::spec::BinarySubtype;
use bson::{doc, Binary, Bson, Document, RawBson, RawDocumentBuf};
use codepool_vault::{keyfile, Keyring, VaultError};

use crate::StoreError;

/// The keyring the store uses, and the file it came from: when a document
/// names a key the ring lacks (another process ran `codepool keys add` and
/// is rotating), the file is read again once before giving up.
#[derive(Debug, Default)]
pub struct CodeKeys {
    path: Option<PathBuf>,
    ring: RwLock<Option<Arc<Keyring>>>,
    /// Key ids this process has recorded in the `key_ids` registry (see
    /// [`crate::rekey`]), so each is written once per process.
    pub(crate) registered: std::sync::Mutex<std::collections::HashSet<String>>,
}

impl CodeKeys {
    /// No keys: reading or writing a code fails and says how to get a key
    /// file. Enough for commands that never touch a code (stats, pools).
    pub fn none(path: Option<PathBuf>) -> Self {
        Self {
            path,
            ring: RwLock::new(None),
            registered: Default::default(),
        }
    }

    pub fn new(ring: Keyring, path: Option<PathBuf>) -> Self {
        Self {
            path,
            ring: RwLock::new(Some(Arc::new(ring))),
            registered: Default::default(),
        }
    }

    fn current(&self) -> Option<Arc<Keyring>> {
        self.ring.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn missing(&self) -> StoreError {
        let path = self
            .path
            .clone()
            .unwrap_or_else(keyfile::default_path)
            .display()
            .to_string();
        StoreError::Keys(VaultError::Missing { path })
    }

    /// The ring, or the error that says how to create a key file.
    pub fn ring(&self) -> Result<Arc<Keyring>, StoreError> {
        self.current().ok_or_else(|| self.missing())
    }

    /// A ring that holds `key_id`, reading the key file again if the one in
    /// memory does not.
    pub fn ring_with(&self, key_id: &str) -> Result<Arc<Keyring>, StoreError> {
        let ring = self.ring()?;
        if ring.has_key(key_id) {
            return Ok(ring);
        }
        self.reload()?;
        let ring = self.ring()?;
        if ring.has_key(key_id) {
            Ok(ring)
        } else {
            Err(VaultError::UnknownKey(key_id.to_owned()).into())
        }
    }

    /// Reads the key file again (a new key was added by another process).
    pub fn reload(&self) -> Result<Arc<Keyring>, StoreError> {
        let Some(path) = &self.path else {
            return self.ring();
        };
        let fresh = Arc::new(keyfile::load(path)?);
        *self.ring.write().unwrap_or_else(|e| e.into_inner()) = Some(fresh.clone());
        Ok(fresh)
    }
}

/// The associated data of a code's ciphertext: its pool and `_id`, so a
/// ciphertext copied into another document does not decrypt.
pub fn code_aad(pool: &str, id: ObjectId) -> Vec<u8> {
    let mut aad = Vec::with_capacity(16 + pool.len() + 12);
    aad.extend_from_slice(b"codepool.code.v1");
    aad.extend_from_slice(pool.as_bytes());
    aad.push(0);
    aad.extend_from_slice(&id.bytes());
    aad
}

pub(crate) fn binary(bytes: Vec<u8>) -> Bson {
    Bson::Binary(Binary {
        subtype: BinarySubtype::Generic,
        bytes,
    })
}

/// The stored fields of a sealed code: `code_enc`, `key_id`, `code_hmac`,
/// and `code_any_hmac` (the same in every pool, to find a code offered to
/// a second pool).
pub fn sealed_fields(ring: &Keyring, pool: &str, id: ObjectId, code: &str) -> Document {
    let mut fields = RawDocumentBuf::new();
    append_sealed(&mut fields, ring, pool, id, code);
    fields
        .to_document()
        .expect("a document just built from valid values reads back")
}

/// [`sealed_fields`] appended to a raw document (an import's, built
/// without a `Document` in between).
pub fn append_sealed(d: &mut RawDocumentBuf, ring: &Keyring, pool: &str, id: ObjectId, code: &str) {
    let sealed = ring.seal(&code_aad(pool, id), code);
    d.append("code_enc", raw_binary(sealed.bytes));
    d.append("key_id", sealed.key_id);
    d.append("code_hmac", raw_binary(ring.code_hmac(pool, code).to_vec()));
    d.append(
        "code_any_hmac",
        raw_binary(ring.any_pool_hmac(code).to_vec()),
    );
}

/// [`binary`] as a raw value.
pub(crate) fn raw_binary(bytes: Vec<u8>) -> RawBson {
    RawBson::Binary(Binary {
        subtype: BinarySubtype::Generic,
        bytes,
    })
}

/// The filter that finds `code` in `pool` by its HMAC; with `plaintext`,
/// also in a document `codepool migrate` has not sealed yet.
pub fn code_filter(ring: &Keyring, pool: &str, code: &str, plaintext: bool) -> Document {
    let hmac = doc! {"code_hmac": binary(ring.code_hmac(pool, code).to_vec())};
    if !plaintext {
        let mut filter = doc! {"pool": pool};
        filter.extend(hmac);
        return filter;
    }
    doc! {"pool": pool, "$or": [hmac, {"code": code}]}
}

/// Opens a stored code: `code_enc` under `key_id`, or a legacy plaintext.
pub(crate) fn open_code(
    keys: &CodeKeys,
    pool: &str,
    id: ObjectId,
    sealed: Option<(&str, &[u8])>,
    plain: Option<&str>,
) -> Result<String, StoreError> {
    match (sealed, plain) {
        (Some((key_id, bytes)), _) => {
            let ring = keys.ring_with(key_id)?;
            Ok(ring.open(key_id, &code_aad(pool, id), bytes)?)
        }
        (None, Some(plain)) => Ok(plain.to_owned()),
        (None, None) => Err(StoreError::Corrupt {
            collection: crate::collections::CODES.into(),
            message: format!("code {id} has neither code_enc with key_id nor a plaintext code"),
        }),
    }
}

impl crate::Store {
    /// The same store, reading and writing codes with `keys`.
    pub fn with_keys(mut self, keys: CodeKeys) -> Self {
        self.keys = Arc::new(keys);
        self
    }

    pub fn keys(&self) -> &CodeKeys {
        &self.keys
    }

    /// The filter that finds `code` in `pool` (see [`code_filter`]): the
    /// exact value, else the code that reads the same under the pool's
    /// look-alike rule (case, width, and `O`/`0`, `I`/`L`/`1` in a pool
    /// that folds confusables), as the platform's redemption by code finds
    /// it. The exact value wins: a look-alike of a code that predates the
    /// look-alike index holds no key of its own. The plaintext is only sent
    /// to MongoDB while the pool still holds plaintext codes (before
    /// `codepool migrate`), so it never lands in a server log otherwise.
    pub async fn code_filter(&self, pool: &str, code: &str) -> Result<Document, StoreError> {
        let ring = self.keys.ring()?;
        let code = code.trim();
        let plaintext = self.pool_has_plaintext(pool).await?;
        let exact = code_filter(&ring, pool, code, plaintext);
        let found = self
            .collection(crate::collections::CODES)
            .find_one(exact.clone())
            .projection(doc! {"_id": 1})
            .await?;
        if found.is_some() {
            return Ok(exact);
        }
        let rule = self.lookalike_rule(pool).await?;
        let folded = codepool_domain::fold_by(code, rule);
        Ok(doc! {"pool": pool, "code_fold_hmac": binary(ring.fold_hmac(pool, &folded).to_vec())})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lookup_filter_carries_the_plaintext_only_while_plaintext_is_stored() {
        let ring = Keyring::generate();
        let sealed_only = code_filter(&ring, "p", "QWER-1234", false).to_string();
        assert!(!sealed_only.contains("QWER-1234"), "{sealed_only}");
        let during_migration = code_filter(&ring, "p", "QWER-1234", true).to_string();
        assert!(during_migration.contains("QWER-1234"));
    }

    #[test]
    fn sealed_fields_hold_no_plaintext_and_open_with_the_same_aad() {
        let ring = Keyring::generate();
        let id = ObjectId::new();
        let fields = sealed_fields(&ring, "p", id, "QWER-1234");
        let Some(Bson::Binary(enc)) = fields.get("code_enc") else {
            panic!("no code_enc in {fields}");
        };
        assert!(!enc.bytes.windows(9).any(|w| w == b"QWER-1234"));
        let keys = CodeKeys::new(ring, None);
        let code = open_code(&keys, "p", id, Some(("k1", &enc.bytes)), None).unwrap();
        assert_eq!(code, "QWER-1234");
        assert!(open_code(&keys, "q", id, Some(("k1", &enc.bytes)), None).is_err());
    }
}
