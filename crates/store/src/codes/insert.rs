//! Importing codes: sequence numbers reserved per pool, the insert of a batch (look-alikes and codes of other pools found first), and the rows a resumed import still needs.

use bson::RawDocumentBuf;
use codepool_domain::LookAlikeRule;
use codepool_vault::Keyring;

use crate::crypto::{append_sealed, raw_binary};

use super::*;

/// The documents [`Store::insert_codes`] writes for `codes` of one batch:
/// sealed and keyed under `ring`'s active key, their look-alike key made
/// by `rule`, `seq` numbered from `first_seq` on, unissued. Built raw, as
/// they go on the wire: an import builds a million of them. Public so a
/// benchmark can insert exactly these without the import around them.
pub fn code_documents(
    ring: &Keyring,
    pool: &str,
    batch_id: ObjectId,
    codes: &[NewCode],
    first_seq: i64,
    rule: LookAlikeRule,
) -> Vec<RawDocumentBuf> {
    let now = DateTime::now();
    codes
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let id = ObjectId::new();
            let mut d = RawDocumentBuf::new();
            d.append("_id", id);
            d.append("pool", pool);
            append_sealed(&mut d, ring, pool, id, &c.code);
            let folded = codepool_domain::fold_by(&c.code, rule);
            d.append(
                "code_fold_hmac",
                raw_binary(ring.fold_hmac(pool, &folded).to_vec()),
            );
            if let Some(line) = c.line.and_then(|l| i64::try_from(l).ok()) {
                d.append("line", line);
            }
            d.append("status", CodeStatus::Unissued.as_i32());
            d.append("seq", first_seq + i as i64);
            d.append("batch_id", batch_id);
            d.append("created_at", now);
            d.append("is_sms", 0);
            if let Some(t) = c.expires_at {
                d.append("expires_at", DateTime::from_chrono(t));
            }
            d
        })
        .collect()
}

/// The bytes of binary field `key` of a raw document.
fn raw_bytes<'d>(d: &'d RawDocumentBuf, key: &str) -> Option<&'d [u8]> {
    d.get_binary(key).ok().map(|b| b.bytes)
}

/// The bytes of binary field `key` of a document.
fn doc_bytes<'d>(d: &'d Document, key: &str) -> Option<&'d [u8]> {
    match d.get(key) {
        Some(Bson::Binary(b)) => Some(&b.bytes),
        _ => None,
    }
}

impl Store {
    /// Reserves `n` consecutive `seq` values for `pool` with one atomic
    /// `$inc`; returns the first. Gaps are fine, order is what matters.
    pub async fn reserve_seq(&self, pool: &str, n: u64) -> Result<i64, StoreError> {
        let n = i64::try_from(n).map_err(|_| StoreError::Rejected("seq range too large".into()))?;
        let updated = self
            .collection(SEQUENCES)
            .find_one_and_update(
                doc! {"_id": format!("codes.seq:{pool}")},
                doc! {"$inc": {"value": n}},
            )
            .upsert(true)
            .return_document(ReturnDocument::After)
            .write_concern(durable())
            .await?;
        let end = updated
            .and_then(|d| d.get_i64("value").ok())
            .ok_or_else(|| StoreError::Corrupt {
                collection: SEQUENCES.into(),
                message: format!("codes.seq:{pool} has no 64-bit value"),
            })?;
        Ok(end - n + 1)
    }

    /// Inserts a batch of new codes (status 0, increasing `seq`), unordered.
    /// Codes already in the pool are counted as duplicates, never inserted
    /// twice: the unique index is on `(pool, code_hmac)`. Each code is stored
    /// sealed under the active key ([`crate::crypto`]), never in plaintext.
    /// `batch_id` ties the codes to their import run, which makes a retried
    /// batch count exactly. Each code's claim is recorded first
    /// ([`crate::claims`]), beside any other pool's: an import or a
    /// generation run claims with [`Store::claim_codes`] instead, refusing
    /// the codes another pool holds, then calls [`Store::insert_claimed`].
    pub async fn insert_codes(
        &self,
        pool: &str,
        batch_id: ObjectId,
        codes: &[NewCode],
    ) -> Result<InsertOutcome, StoreError> {
        use crate::claims::CrossPool;
        self.claim_codes(pool, batch_id, codes, CrossPool::Allow)
            .await?;
        self.insert_claimed(pool, batch_id, codes).await
    }

    /// [`Store::insert_codes`] of codes [`Store::claim_codes`] claimed
    /// for `pool` already.
    pub async fn insert_claimed(
        &self,
        pool: &str,
        batch_id: ObjectId,
        codes: &[NewCode],
    ) -> Result<InsertOutcome, StoreError> {
        if codes.is_empty() {
            return Ok(InsertOutcome::default());
        }
        let ring = self.keys.ring()?;
        self.register_key_id(ring.active_id()).await?;
        let rule = self.fix_lookalike_rule(pool).await?;
        let first_seq = self.reserve_seq(pool, codes.len() as u64).await?;
        let docs = code_documents(&ring, pool, batch_id, codes, first_seq, rule);
        let total = docs.len() as u64;
        let (mut outcome, refused) = self.insert_docs(&docs).await?;
        if !refused.is_empty() {
            outcome.lookalikes = self.look_alikes_among(pool, &docs, &refused).await?;
            outcome.duplicates -= outcome.lookalikes.len() as u64;
        }
        let last_seq = first_seq + total as i64 - 1;
        if let Err(e) = self
            .record_range(pool, first_seq, last_seq, outcome.inserted)
            .await
        {
            // The range is then counted from the index instead.
            tracing::debug!(pool, first_seq, last_seq, error = %e, "could not record an inserted seq range");
        }
        Ok(outcome)
    }

    /// `insert_many` of new code documents, unordered: duplicates are
    /// counted, any other refusal is an error. Also returns the positions
    /// the look-alike index refused.
    pub(super) async fn insert_docs(
        &self,
        docs: &[RawDocumentBuf],
    ) -> Result<(InsertOutcome, Vec<usize>), StoreError> {
        let total = docs.len() as u64;
        match self
            .db
            .collection::<RawDocumentBuf>(CODES)
            .insert_many(docs)
            .ordered(false)
            .write_concern(durable())
            .await
        {
            Ok(r) => Ok((
                InsertOutcome {
                    inserted: r.inserted_ids.len() as u64,
                    duplicates: total - r.inserted_ids.len() as u64,
                    lookalikes: Vec::new(),
                },
                Vec::new(),
            )),
            Err(e) => {
                let errors = duplicates_only(e)?;
                let duplicates = errors.len() as u64;
                // The server names the index that refused a document.
                let by_fold = errors
                    .iter()
                    .filter(|w| w.message.contains(FOLD_INDEX))
                    .map(|w| w.index)
                    .collect();
                Ok((
                    InsertOutcome {
                        inserted: total - duplicates,
                        duplicates,
                        lookalikes: Vec::new(),
                    },
                    by_fold,
                ))
            }
        }
    }

    /// Which of the documents at `refused` (turned away by the look-alike
    /// index) are look-alikes, and of which code: one whose stored code
    /// differs from theirs. A document whose exact code is in the pool is
    /// a plain duplicate, whichever index refused it first.
    pub(super) async fn look_alikes_among(
        &self,
        pool: &str,
        docs: &[RawDocumentBuf],
        refused: &[usize],
    ) -> Result<Vec<LookAlike>, StoreError> {
        let folds: Vec<Bson> = (refused.iter())
            .filter_map(|&i| raw_bytes(docs.get(i)?, "code_fold_hmac"))
            .map(|b| binary(b.to_vec()))
            .collect();
        let held: Vec<Document> = self
            .collection(CODES)
            .find(doc! {"pool": pool, "code_fold_hmac": {"$in": folds}})
            .projection(doc! {"code_hmac": 1, "code_fold_hmac": 1, "line": 1, "batch_id": 1})
            .await?
            .try_collect()
            .await?;
        let mut out = Vec::new();
        for &index in refused {
            let Some(ours) = docs.get(index) else {
                continue;
            };
            let matched = (held.iter())
                .find(|h| doc_bytes(h, "code_fold_hmac") == raw_bytes(ours, "code_fold_hmac"));
            match matched {
                Some(h) if doc_bytes(h, "code_hmac") != raw_bytes(ours, "code_hmac") => {
                    out.push(LookAlike {
                        index,
                        of_line: int_field(h, "line").and_then(|l| u64::try_from(l).ok()),
                        of_import: h.get_object_id("batch_id").ok(),
                    })
                }
                _ => {}
            }
        }
        Ok(out)
    }

    /// [`Store::insert_claimed`] of the codes not in `pool` yet, found with
    /// one indexed lookup first. For finishing an import that was killed:
    /// most of its codes are in already, and a rejected insert costs far
    /// more per code than the lookup. Also returns how many the lookup
    /// found (counted as duplicates in the outcome).
    pub async fn insert_missing_codes(
        &self,
        pool: &str,
        batch_id: ObjectId,
        codes: &[NewCode],
    ) -> Result<(InsertOutcome, u64), StoreError> {
        let hmacs = self.code_hmacs(pool, codes)?;
        let list: Vec<Bson> = hmacs.iter().map(|h| binary(h.clone())).collect();
        let found: Vec<Document> = self
            .collection(CODES)
            .find(doc! {"pool": pool, "code_hmac": {"$in": list}})
            .projection(doc! {"_id": 0, "code_hmac": 1})
            .await?
            .try_collect()
            .await?;
        let existing: HashSet<Vec<u8>> = found
            .iter()
            .filter_map(|d| match d.get("code_hmac") {
                Some(Bson::Binary(b)) => Some(b.bytes.clone()),
                _ => None,
            })
            .collect();
        let missing: Vec<NewCode> = codes
            .iter()
            .zip(&hmacs)
            .filter(|(_, h)| !existing.contains(*h))
            .map(|(c, _)| c.clone())
            .collect();
        let skipped = (codes.len() - missing.len()) as u64;
        let mut outcome = self.insert_claimed(pool, batch_id, &missing).await?;
        outcome.duplicates += skipped;
        Ok((outcome, skipped))
    }

    /// For each of `codes`, another pool that holds it already (and the
    /// import that brought it there), found with one lookup on the
    /// `code_any_hmac` index (migration 0014): a code sits in one pool.
    pub async fn codes_in_other_pools(
        &self,
        pool: &str,
        codes: &[NewCode],
    ) -> Result<Vec<Option<(String, Option<ObjectId>)>>, StoreError> {
        let ring = self.keys.ring()?;
        let hmacs: Vec<Vec<u8>> = (codes.iter())
            .map(|c| ring.any_pool_hmac(&c.code).to_vec())
            .collect();
        let list: Vec<Bson> = hmacs.iter().map(|h| binary(h.clone())).collect();
        let found: Vec<Document> = self
            .collection(CODES)
            .find(doc! {"code_any_hmac": {"$in": list}, "pool": {"$ne": pool}})
            .projection(doc! {"_id": 0, "code_any_hmac": 1, "pool": 1, "batch_id": 1})
            .hint(mongodb::options::Hint::Name("code_any_hmac".into()))
            .await?
            .try_collect()
            .await?;
        let mut elsewhere: HashMap<Vec<u8>, (String, Option<ObjectId>)> = HashMap::new();
        for d in found {
            if let (Some(Bson::Binary(b)), Ok(p)) = (d.get("code_any_hmac"), d.get_str("pool")) {
                let batch = d.get_object_id("batch_id").ok();
                elsewhere
                    .entry(b.bytes.clone())
                    .or_insert((p.to_owned(), batch));
            }
        }
        Ok(hmacs.iter().map(|h| elsewhere.get(h).cloned()).collect())
    }

    /// The HMAC of each code in `pool`: what the unique index holds.
    pub(super) fn code_hmacs(
        &self,
        pool: &str,
        codes: &[NewCode],
    ) -> Result<Vec<Vec<u8>>, StoreError> {
        let ring = self.keys.ring()?;
        Ok(codes
            .iter()
            .map(|c| ring.code_hmac(pool, &c.code).to_vec())
            .collect())
    }

    /// How many of `codes` are in `pool` from import run `batch_id`: used to
    /// count a batch exactly after a retry whose first attempt may have
    /// landed.
    pub async fn count_from_batch(
        &self,
        pool: &str,
        batch_id: ObjectId,
        codes: &[NewCode],
    ) -> Result<u64, StoreError> {
        let list: Vec<Bson> = self
            .code_hmacs(pool, codes)?
            .into_iter()
            .map(binary)
            .collect();
        Ok(self
            .collection(CODES)
            .count_documents(doc! {"pool": pool, "code_hmac": {"$in": list}, "batch_id": batch_id})
            .await?)
    }
}
