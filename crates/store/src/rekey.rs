//! Keeping the sealed codes and the key file in step:
//!
//! - [`Store::check_keys`]: before a dispatcher consumes anything, every key
//!   id used in the database is in the key file, and the file opens (and
//!   re-hashes) a code sealed under each;
//! - [`Store::seal_plaintext_batch`]: `codepool migrate` seals codes stored
//!   before encryption, in place;
//! - [`Store::rotate_batch`]: `codepool keys rotate` re-encrypts codes under
//!   the active key.
//!
//! Both rewrites are batches of updates conditional on the document still
//! holding what was read (the plaintext, or the old ciphertext), and touch
//! only the code's own fields. Claims match on `_id` and `status` and never
//! read the code, so a dispatcher running meanwhile neither skips a code nor
//! issues one twice; a rewrite interrupted anywhere resumes where it stopped.

use bson::{doc, Bson, Document};
use codepool_vault::VaultError;
use futures::TryStreamExt;
use mongodb::options::Hint;

use crate::codes::{CodeDoc, CODES};
use crate::crypto::{binary, code_aad, open_code, sealed_fields};
use crate::{Store, StoreError};

/// The registry of key ids that seal codes: one tiny document per key id,
/// written by whatever seals with a key (import, rotate, migrate) and by
/// every daemon's start-up check. A process reads it every few seconds to
/// learn, before it claims anything, that another host sealed codes with
/// a key its own key file lacks.
pub const KEY_IDS: &str = "key_ids";

/// The partial index over documents that still hold a plaintext `code`.
const PLAINTEXT_INDEX: &str = "pool_code_plain";

/// What [`Store::check_keys`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyCheck {
    /// Key ids used by sealed codes, each verified against the key file.
    pub key_ids: Vec<String>,
    /// Whether some codes are still plaintext (run `codepool migrate`).
    pub plaintext: bool,
}

/// How many codes one key id seals (`None`: plaintext, not sealed yet).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyUsage {
    pub key_id: Option<String>,
    pub codes: u64,
}

fn plaintext_filter() -> Document {
    doc! {"code": {"$exists": true}}
}

impl Store {
    /// Records that codes are (about to be) sealed under `key_id`, once per
    /// process and key.
    pub async fn register_key_id(&self, key_id: &str) -> Result<(), StoreError> {
        let known = (self.keys.registered.lock())
            .map(|r| r.contains(key_id))
            .unwrap_or(false);
        if known {
            return Ok(());
        }
        self.collection(KEY_IDS)
            .update_one(
                doc! {"_id": key_id},
                doc! {"$setOnInsert": {"at": bson::DateTime::now()}},
            )
            .upsert(true)
            .write_concern(crate::durable())
            .await?;
        if let Ok(mut r) = self.keys.registered.lock() {
            r.insert(key_id.to_owned());
        }
        Ok(())
    }

    /// Every key id the registry holds that this process's key file lacks,
    /// after reading the file again once: the codes sealed under them
    /// cannot be opened here, so nothing may be claimed here.
    pub async fn missing_key_ids(&self) -> Result<Vec<String>, StoreError> {
        let ring = self.keys.ring()?;
        let ids: Vec<Bson> = self.collection(KEY_IDS).distinct("_id", doc! {}).await?;
        let lacking: Vec<&str> = (ids.iter().filter_map(Bson::as_str))
            .filter(|id| !ring.has_key(id))
            .collect();
        if lacking.is_empty() {
            return Ok(Vec::new());
        }
        let ring = self.keys.reload().unwrap_or(ring);
        let mut missing = Vec::new();
        for id in lacking.into_iter().filter(|id| !ring.has_key(id)) {
            // A key no code uses any more (rotated away, then removed from
            // the key file) is retired: it leaves the registry.
            let used = self
                .collection(CODES)
                .find_one(doc! {"key_id": id})
                .projection(doc! {"_id": 1})
                .await?
                .is_some();
            let used = used || self.webhooks_use_key(id).await?;
            if used {
                missing.push(id.to_owned());
            } else {
                self.collection(KEY_IDS)
                    .delete_one(doc! {"_id": id})
                    .await?;
                if let Ok(mut r) = self.keys.registered.lock() {
                    r.remove(id);
                }
            }
        }
        Ok(missing)
    }

    /// Verifies the key file against the database; see the module doc.
    pub async fn check_keys(&self) -> Result<KeyCheck, StoreError> {
        let ring = self.keys.ring()?;
        let used = self.collection(CODES).distinct("key_id", doc! {}).await?;
        let mut out = KeyCheck::default();
        for id in used.iter().filter_map(Bson::as_str) {
            self.keys.ring_with(id)?;
            let sample = self
                .typed::<CodeDoc>(CODES)
                .find_one(doc! {"key_id": id})
                .await?;
            if let Some(d) = sample {
                let (Some(enc), Some(stored)) = (&d.code_enc, &d.code_hmac) else {
                    return Err(StoreError::Corrupt {
                        collection: CODES.into(),
                        message: format!(
                            "code {} has key_id {id:?} but no code_enc or code_hmac",
                            d.id
                        ),
                    });
                };
                let code = open_code(&self.keys, &d.pool, d.id, Some((id, &enc.bytes)), None)?;
                if stored.bytes[..] != ring.code_hmac(&d.pool, &code)[..] {
                    return Err(VaultError::WrongHmacKey.into());
                }
            }
            self.register_key_id(id).await?;
            out.key_ids.push(id.to_owned());
        }
        out.plaintext = self.has_plaintext().await?;
        Ok(out)
    }

    /// Whether any code is still stored in plaintext.
    pub async fn has_plaintext(&self) -> Result<bool, StoreError> {
        Ok(self.count_plaintext(None, Some(1)).await? > 0)
    }

    /// Whether a code of `pool` is still stored in plaintext: importing
    /// into it now could store a code twice (plaintext and sealed).
    pub async fn pool_has_plaintext(&self, pool: &str) -> Result<bool, StoreError> {
        Ok(self.count_plaintext(Some(pool), Some(1)).await? > 0)
    }

    /// Codes still stored in plaintext, in `pool` or in every pool (at most
    /// `limit` counted).
    pub async fn count_plaintext(
        &self,
        pool: Option<&str>,
        limit: Option<u64>,
    ) -> Result<u64, StoreError> {
        let mut filter = plaintext_filter();
        if let Some(p) = pool {
            filter.insert("pool", p);
        }
        let codes = self.collection(CODES);
        let mut count = codes
            .count_documents(filter)
            .hint(Hint::Name(PLAINTEXT_INDEX.into()));
        if let Some(l) = limit {
            count = count.limit(l);
        }
        Ok(count.await?)
    }

    /// Codes per key id, plaintext ones under `None`.
    pub async fn codes_per_key(&self) -> Result<Vec<KeyUsage>, StoreError> {
        let rows: Vec<Document> = self
            .collection(CODES)
            .aggregate(vec![
                doc! {"$group": {"_id": "$key_id", "codes": {"$sum": 1}}},
                doc! {"$sort": {"_id": 1}},
            ])
            .await?
            .try_collect()
            .await?;
        Ok(rows
            .iter()
            .map(|r| KeyUsage {
                key_id: r.get_str("_id").ok().map(str::to_owned),
                codes: crate::collections::as_u64(r.get("codes")),
            })
            .collect())
    }

    /// Seals up to `limit` plaintext codes in place; returns how many were
    /// sealed (0: none left).
    pub async fn seal_plaintext_batch(&self, limit: i64) -> Result<u64, StoreError> {
        let ring = self.keys.ring()?;
        self.register_key_id(ring.active_id()).await?;
        let docs: Vec<CodeDoc> = self
            .typed::<CodeDoc>(CODES)
            .find(plaintext_filter())
            .hint(Hint::Name(PLAINTEXT_INDEX.into()))
            .limit(limit)
            .await?
            .try_collect()
            .await?;
        let updates = docs
            .iter()
            .filter_map(|d| {
                let code = d.code.as_deref()?;
                Some(doc! {
                    "q": {"pool": &d.pool, "_id": d.id, "code": code},
                    "u": {"$set": sealed_fields(&ring, &d.pool, d.id, code), "$unset": {"code": ""}},
                })
            })
            .collect();
        self.bulk_update(updates, "sealing plaintext codes").await
    }

    /// Codes sealed under a key other than the active one.
    pub async fn count_to_rotate(&self) -> Result<u64, StoreError> {
        let ring = self.keys.ring()?;
        let codes = self
            .collection(CODES)
            .count_documents(doc! {"key_id": {"$exists": true, "$ne": ring.active_id()}})
            .await?;
        Ok(codes + self.webhooks_to_rotate(ring.active_id()).await?)
    }

    /// Re-encrypts up to `limit` codes sealed under other keys with the
    /// active key; returns how many (0: all codes use the active key). The
    /// HMAC stays: it does not depend on the encryption key.
    pub async fn rotate_batch(&self, limit: i64) -> Result<u64, StoreError> {
        let ring = self.keys.ring()?;
        self.register_key_id(ring.active_id()).await?;
        let docs: Vec<CodeDoc> = self
            .typed::<CodeDoc>(CODES)
            .find(doc! {"key_id": {"$exists": true, "$ne": ring.active_id()}})
            .limit(limit)
            .await?
            .try_collect()
            .await?;
        if docs.is_empty() {
            // The codes are done: webhook secrets and event bodies, which
            // hold codes too, are sealed with the same keys.
            return self.rotate_webhooks(limit).await;
        }
        let mut updates = Vec::with_capacity(docs.len());
        for d in &docs {
            let (Some(old_key), Some(old)) = (&d.key_id, &d.code_enc) else {
                continue;
            };
            let old_ring = self.keys.ring_with(old_key)?;
            let code = old_ring.open(old_key, &code_aad(&d.pool, d.id), &old.bytes)?;
            let sealed = ring.seal(&code_aad(&d.pool, d.id), &code);
            updates.push(doc! {
                "q": {"pool": &d.pool, "_id": d.id, "key_id": old_key, "code_enc": binary(old.bytes.clone())},
                "u": {"$set": {"code_enc": binary(sealed.bytes), "key_id": sealed.key_id}},
            });
        }
        self.bulk_update(updates, "re-encrypting codes").await
    }

    /// Runs conditional updates in one journaled command; returns how many
    /// documents changed. Any write error stops the run with its message.
    async fn bulk_update(&self, updates: Vec<Document>, what: &str) -> Result<u64, StoreError> {
        if updates.is_empty() {
            return Ok(0);
        }
        let reply = self.update_codes(updates).await?;
        if let Ok(errors) = reply.get_array("writeErrors") {
            let first = errors
                .iter()
                .filter_map(Bson::as_document)
                .map(|e| e.get_str("errmsg").unwrap_or("unknown").to_owned())
                .next()
                .unwrap_or_default();
            return Err(StoreError::Rejected(format!(
                "{what}: {} document(s) refused, e.g. {first}; fix that document, then run the command again (it resumes)",
                errors.len()
            )));
        }
        if let Ok(wce) = reply.get_document("writeConcernError") {
            return Err(StoreError::Unavailable(format!(
                "{what}: write concern not satisfied: {}",
                wce.get_str("errmsg").unwrap_or("unknown")
            )));
        }
        Ok(match reply.get("nModified") {
            Some(Bson::Int32(n)) => *n as u64,
            Some(Bson::Int64(n)) => *n as u64,
            _ => 0,
        })
    }
}
