//! Which pool holds a code: a code sits in one pool as codepool compares
//! codes (DESIGN invariants 10 and 16), so a look-alike of another pool's
//! code is that code.
//!
//! The codes of one pool are kept apart by unique indexes on the pool
//! (`(pool, code_hmac)`, `(pool, code_fold_hmac)`). Across pools there is
//! no such index on `codes`: its unique indexes start with the pool (its
//! shard key), and how two codes compare depends on both pools' rules.
//! Instead every code claims its look-alike key in `code_claims` before
//! it is inserted: one document per key (`_id`, the HMAC of the code's
//! widest key, NFKC, case and confusables folded), listing the pools that
//! hold a code of that key (`e`). A claim is one atomic write on that
//! document, conditional on no other pool's entry being the same code,
//! so of two imports racing with one file into two pools, each code goes
//! to exactly one of them: the first claim of a key inserts the document,
//! every later one finds it and is refused or added by its condition.
//!
//! Two codes of different pools are one code when their keys are equal
//! with case folded and, wherever either pool folds confusables, with
//! confusables folded too ([`codepool_domain::cross_pool_keys`]). An
//! entry holds what that takes: the pool (`p`), whether it folds
//! confusables (`f`), the code's narrow key (`k`, case folded only), the
//! code's HMAC in its pool (`h`, to find the stored code for a report),
//! and the run that claimed it (`r`).
//!
//! A claim is written (journaled) before its code: a run killed between
//! the two leaves a claim without a code, and its pool keeps the code
//! until the run is finished (the same command again) or an operator
//! imports it elsewhere with `--allow-cross-pool`. A claim is never
//! removed: a voided code still sits in its pool.
//!
//! Codes imported before claims existed get theirs from `codepool
//! migrate` ([`Store::claims_backfill_batch`]); the look-alike pairs
//! found across pools then, or imported on purpose since, are marked
//! (`x`) and listed by [`Store::cross_pool_lookalikes`].

use std::collections::HashMap;

use bson::oid::ObjectId;
use bson::{doc, Bson, Document};
use codepool_domain::cross_pool_keys;
use futures::TryStreamExt;

use crate::codes::{code_id, CodeDoc, NewCode, CODES};
use crate::crypto::binary;
use crate::error::duplicates_only;
use crate::{Store, StoreError};

/// The collection of claims (migration 0025).
pub const CODE_CLAIMS: &str = "code_claims";

/// The `_migrations` record of the backfill of claims: where it got to,
/// and whether it finished.
pub(crate) const CLAIMS_BACKFILL: &str = "0025_code_claims_backfill";

/// How a claim treats another pool's claim on the same code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrossPool {
    /// Refused: a code sits in one pool.
    Refuse,
    /// Refused whenever another pool holds a code of the same widest key
    /// (confusables folded, whatever either pool does): for generated
    /// codes, which are drawn again at no cost, so no generated code reads
    /// like any other code.
    Strict,
    /// Claimed beside it (an operator's `--allow-cross-pool`, or the
    /// backfill recording what is stored): the pair is marked for the
    /// report.
    Allow,
}

/// The pool whose claim refused a code, and the run that made it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldElsewhere {
    pub pool: String,
    pub run: Option<ObjectId>,
}

/// One code to claim for its pool.
#[derive(Debug, Clone, Copy)]
pub struct ClaimItem<'a> {
    pub code: &'a str,
    /// The import or generation run that brings it.
    pub run: Option<ObjectId>,
}

/// What a claim did for one code.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Claimed {
    /// The pool holds the code's key now (or held it already).
    Ours,
    /// Refused: another pool holds the same code.
    Refused(HeldElsewhere),
    /// Claimed now beside another pool's claim on the same code
    /// (`Allow`): a new look-alike pair across pools.
    Shared,
}

/// A claim's entry as read back.
#[derive(Debug, Clone)]
struct Entry {
    pool: String,
    folds: bool,
    narrow: Vec<u8>,
    hmac: Vec<u8>,
    run: Option<ObjectId>,
}

fn bytes(d: &Document, key: &str) -> Vec<u8> {
    match d.get(key) {
        Some(Bson::Binary(b)) => b.bytes.clone(),
        _ => Vec::new(),
    }
}

fn entries(d: &Document) -> Vec<Entry> {
    let Ok(list) = d.get_array("e") else {
        return Vec::new();
    };
    list.iter()
        .filter_map(Bson::as_document)
        .map(|e| Entry {
            pool: e.get_str("p").unwrap_or_default().to_owned(),
            folds: e.get_bool("f").unwrap_or(false),
            narrow: bytes(e, "k"),
            hmac: bytes(e, "h"),
            run: e.get_object_id("r").ok(),
        })
        .collect()
}

/// Whether entries `a` and `b` (of different pools) are one code.
fn same_code(a: &Entry, b: &Entry) -> bool {
    a.pool != b.pool && (a.folds || b.folds || a.narrow == b.narrow)
}

/// One code's claim, ready to write.
struct Ask {
    wide: Vec<u8>,
    entry: Entry,
}

impl Ask {
    fn entry_doc(&self) -> Document {
        let e = &self.entry;
        let mut d = doc! {
            "p": &e.pool,
            "f": e.folds,
            "k": binary(e.narrow.clone()),
            "h": binary(e.hmac.clone()),
        };
        if let Some(r) = e.run {
            d.insert("r", r);
        }
        d
    }

    /// The `$elemMatch` of another pool's entry that is this code.
    fn conflict_filter(&self, mode: CrossPool) -> Document {
        let e = &self.entry;
        if e.folds || mode == CrossPool::Strict {
            return doc! {"p": {"$ne": &e.pool}};
        }
        doc! {"p": {"$ne": &e.pool}, "$or": [{"f": true}, {"k": binary(e.narrow.clone())}]}
    }

    fn conflict<'e>(&self, held: &'e [Entry], mode: CrossPool) -> Option<&'e Entry> {
        let strict = mode == CrossPool::Strict;
        (held.iter()).find(|h| same_code(&self.entry, h) || (strict && h.pool != self.entry.pool))
    }

    fn is_ours(&self, held: &[Entry]) -> bool {
        (held.iter()).any(|h| h.pool == self.entry.pool && h.narrow == self.entry.narrow)
    }
}

/// Rounds of read-then-conditional-write for one code before giving up
/// (each lost round means another pool's entry came in meanwhile).
const CLAIM_ROUNDS: usize = 8;

impl Store {
    /// Claims `codes` for `pool`, for run `run`, before they are inserted:
    /// for each, the other pool that holds it (as codepool compares codes)
    /// when `mode` refuses it, else `None`. A code this pool claimed
    /// before (an import run again) is the pool's already.
    pub async fn claim_codes(
        &self,
        pool: &str,
        run: ObjectId,
        codes: &[NewCode],
        mode: CrossPool,
    ) -> Result<Vec<Option<HeldElsewhere>>, StoreError> {
        let items: Vec<ClaimItem<'_>> = (codes.iter())
            .map(|c| ClaimItem {
                code: &c.code,
                run: Some(run),
            })
            .collect();
        Ok(self
            .claim(pool, &items, mode)
            .await?
            .into_iter()
            .map(|c| match c {
                Claimed::Refused(h) => Some(h),
                Claimed::Ours | Claimed::Shared => None,
            })
            .collect())
    }

    /// Claims each item for `pool`; see the module doc.
    async fn claim(
        &self,
        pool: &str,
        items: &[ClaimItem<'_>],
        mode: CrossPool,
    ) -> Result<Vec<Claimed>, StoreError> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let ring = self.keys.ring()?;
        let folds = self.fix_lookalike_rule(pool).await?.confusables;
        let asks: Vec<Ask> = (items.iter())
            .map(|i| {
                let keys = cross_pool_keys(i.code.trim());
                Ask {
                    wide: ring.cross_hmac(&keys.wide).to_vec(),
                    entry: Entry {
                        pool: pool.to_owned(),
                        folds,
                        narrow: ring.cross_hmac(&keys.narrow).to_vec(),
                        hmac: ring.code_hmac(pool, i.code).to_vec(),
                        run: i.run,
                    },
                }
            })
            .collect();
        // The first claim of a key: one insert for the whole batch.
        let docs: Vec<Document> = (asks.iter())
            .map(|a| doc! {"_id": binary(a.wide.clone()), "e": [a.entry_doc()]})
            .collect();
        let taken = match self
            .collection(CODE_CLAIMS)
            .insert_many(&docs)
            .ordered(false)
            .write_concern(crate::durable())
            .await
        {
            Ok(_) => Vec::new(),
            Err(e) => duplicates_only(e)?.into_iter().map(|w| w.index).collect(),
        };
        let mut out = vec![Claimed::Ours; asks.len()];
        if taken.is_empty() {
            return Ok(out);
        }
        // Keys claimed already (by this pool, or another): read them all
        // at once, then decide each; a conditional write adds an entry.
        let ids: Vec<Bson> = (taken.iter())
            .filter_map(|&i| asks.get(i))
            .map(|a| binary(a.wide.clone()))
            .collect();
        let found: Vec<Document> = self
            .collection(CODE_CLAIMS)
            .find(doc! {"_id": {"$in": ids}})
            .await?
            .try_collect()
            .await?;
        let mut held: HashMap<Vec<u8>, Vec<Entry>> = (found.iter())
            .map(|d| (bytes(d, "_id"), entries(d)))
            .collect();
        for i in taken {
            let Some(ask) = asks.get(i) else {
                continue;
            };
            out[i] = self.claim_taken(ask, &mut held, mode).await?;
        }
        Ok(out)
    }

    /// Decides one code whose key is claimed already (`held` holds what
    /// was read of it, refreshed here when a write loses a race).
    async fn claim_taken(
        &self,
        ask: &Ask,
        held: &mut HashMap<Vec<u8>, Vec<Entry>>,
        mode: CrossPool,
    ) -> Result<Claimed, StoreError> {
        for _ in 0..CLAIM_ROUNDS {
            let now = held.get(&ask.wide).map(Vec::as_slice).unwrap_or_default();
            let conflict = ask.conflict(now, mode).cloned();
            if let (Some(c), CrossPool::Refuse | CrossPool::Strict) = (&conflict, mode) {
                return Ok(Claimed::Refused(HeldElsewhere {
                    pool: c.pool.clone(),
                    run: c.run,
                }));
            }
            if ask.is_ours(now) {
                return Ok(Claimed::Ours);
            }
            let ours = doc! {"e": {"$not": {"$elemMatch": {"p": &ask.entry.pool, "k": binary(ask.entry.narrow.clone())}}}};
            let mut filter = doc! {"_id": binary(ask.wide.clone())};
            let mut update = doc! {"$push": {"e": ask.entry_doc()}};
            match mode {
                CrossPool::Refuse | CrossPool::Strict => {
                    let other = doc! {"e": {"$not": {"$elemMatch": ask.conflict_filter(mode)}}};
                    filter.insert("$and", vec![ours, other]);
                }
                CrossPool::Allow => {
                    filter.extend(ours);
                    if conflict.is_some() {
                        update.insert("$set", doc! {"x": true});
                    }
                }
            }
            let written = self
                .collection(CODE_CLAIMS)
                .update_one(filter, update)
                .upsert(false)
                .write_concern(crate::durable())
                .await?;
            if written.matched_count == 1 {
                return Ok(match conflict {
                    Some(_) => Claimed::Shared,
                    None => Claimed::Ours,
                });
            }
            // Another entry came in since the read: read it again.
            let fresh = self
                .collection(CODE_CLAIMS)
                .find_one(doc! {"_id": binary(ask.wide.clone())})
                .await?;
            held.insert(
                ask.wide.clone(),
                fresh.as_ref().map(entries).unwrap_or_default(),
            );
        }
        Err(StoreError::Unavailable(format!(
            "the claim of a code of pool {:?} lost {CLAIM_ROUNDS} races in a row; run the same command again",
            ask.entry.pool
        )))
    }

    /// True once every code stored before claims existed has its claim
    /// (`codepool migrate` ran the backfill, or the database had no code
    /// when claims came). Until then an import also looks the exact code
    /// up in other pools, as before claims.
    pub async fn claims_complete(&self) -> Result<bool, StoreError> {
        let d = self
            .collection("_migrations")
            .find_one(doc! {"_id": CLAIMS_BACKFILL})
            .await?;
        Ok(d.is_some_and(|d| d.get_bool("done").unwrap_or(false)))
    }

    /// Where the backfill of claims got to (`None`: from the start).
    pub async fn claims_backfill_after(&self) -> Result<Option<ObjectId>, StoreError> {
        let d = self
            .collection("_migrations")
            .find_one(doc! {"_id": CLAIMS_BACKFILL})
            .await?;
        Ok(d.and_then(|d| d.get_object_id("after").ok()))
    }

    /// Records how far the backfill got, and whether it finished.
    pub async fn save_claims_backfill(
        &self,
        after: Option<ObjectId>,
        done: bool,
    ) -> Result<(), StoreError> {
        let mut set = doc! {"done": done, "at": bson::DateTime::now()};
        if let Some(a) = after {
            set.insert("after", a);
        }
        self.collection("_migrations")
            .update_one(doc! {"_id": CLAIMS_BACKFILL}, doc! {"$set": set})
            .upsert(true)
            .await?;
        Ok(())
    }

    /// At every start: a database without codes needs no backfill.
    pub(crate) async fn settle_claims_backfill(&self) -> Result<(), StoreError> {
        if self.claims_complete().await? {
            return Ok(());
        }
        let any = self
            .collection(CODES)
            .find_one(doc! {})
            .projection(doc! {"_id": 1})
            .await?;
        if any.is_none() {
            self.save_claims_backfill(None, true).await?;
        }
        Ok(())
    }

    /// Claims up to `limit` stored codes after `after` (in `_id` order)
    /// for their pools, beside any claim of another pool (what is stored
    /// is recorded, never refused). Returns the codes read, how many
    /// turned out to be a look-alike of another pool's code, and where
    /// the next batch starts.
    pub async fn claims_backfill_batch(
        &self,
        after: Option<ObjectId>,
        limit: i64,
    ) -> Result<(u64, u64, Option<ObjectId>), StoreError> {
        let mut filter = doc! {"code_enc": {"$exists": true}};
        if let Some(after) = after {
            filter.insert("_id", doc! {"$gt": after});
        }
        let docs: Vec<CodeDoc> = self
            .typed::<CodeDoc>(CODES)
            .find(filter)
            .sort(doc! {"_id": 1})
            .limit(limit)
            .await?
            .try_collect()
            .await?;
        let next = docs.last().map(|d| d.id);
        let read = docs.len() as u64;
        let mut by_pool: HashMap<String, Vec<(String, Option<ObjectId>)>> = HashMap::new();
        for d in docs {
            let (pool, run) = (d.pool.clone(), d.batch_id);
            let code = d.into_code(&self.keys)?;
            by_pool.entry(pool).or_default().push((code.code, run));
        }
        let mut shared = 0;
        for (pool, codes) in by_pool {
            let items: Vec<ClaimItem<'_>> = (codes.iter())
                .map(|(code, run)| ClaimItem { code, run: *run })
                .collect();
            let done = self.claim(&pool, &items, CrossPool::Allow).await?;
            shared += done.iter().filter(|c| **c == Claimed::Shared).count() as u64;
        }
        Ok((read, shared, next))
    }

    /// The look-alike pairs stored across pools: codes of two pools that
    /// are one code as codepool compares them, found by the backfill or
    /// imported on purpose (`--allow-cross-pool`). At most `limit` keys
    /// are read, after `after` (a key's hex id, to page on).
    pub async fn cross_pool_lookalikes(
        &self,
        after: Option<&str>,
        limit: i64,
    ) -> Result<Vec<CrossPoolPair>, StoreError> {
        let mut filter = doc! {"x": true};
        if let Some(after) = after.and_then(|a| hex::decode(a).ok()) {
            filter.insert("_id", doc! {"$gt": binary(after)});
        }
        let docs: Vec<Document> = self
            .collection(CODE_CLAIMS)
            .find(filter)
            .sort(doc! {"_id": 1})
            .limit(limit)
            .await?
            .try_collect()
            .await?;
        let mut pairs = Vec::new();
        for d in docs {
            let key = hex::encode(bytes(&d, "_id"));
            let held = entries(&d);
            let mut stored: Vec<Option<ClaimedCode>> = Vec::with_capacity(held.len());
            for e in &held {
                stored.push(self.claimed_code(e).await?);
            }
            for (i, a) in held.iter().enumerate() {
                for (j, b) in held.iter().enumerate().skip(i + 1) {
                    if !same_code(a, b) {
                        continue;
                    }
                    if let (Some(Some(a)), Some(Some(b))) = (stored.get(i), stored.get(j)) {
                        pairs.push(CrossPoolPair {
                            key: key.clone(),
                            first: a.clone(),
                            second: b.clone(),
                        });
                    }
                }
            }
        }
        Ok(pairs)
    }

    /// The stored code an entry names, if it was stored.
    async fn claimed_code(&self, e: &Entry) -> Result<Option<ClaimedCode>, StoreError> {
        let d = self
            .typed::<CodeDoc>(CODES)
            .find_one(doc! {"pool": &e.pool, "code_hmac": binary(e.hmac.clone())})
            .await?;
        let Some(d) = d else {
            return Ok(None);
        };
        let (id, run) = (d.id, d.batch_id);
        let code = d.into_code(&self.keys)?;
        Ok(Some(ClaimedCode {
            pool: e.pool.clone(),
            code: code_id(id).to_string(),
            masked: code.masked(),
            status: code.status.to_string(),
            order_id: code.order_holder().map(|h| h.order_id.clone()),
            import: run.map(|r| r.to_hex()),
        }))
    }
}

/// A stored code of a look-alike pair across pools.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ClaimedCode {
    pub pool: String,
    /// The code's id (24 hex digits).
    pub code: String,
    pub masked: String,
    /// `unissued`, `issued`, `used`, `void`, `held`.
    pub status: String,
    /// The order it was sold to, if any.
    pub order_id: Option<String>,
    pub import: Option<String>,
}

/// Two stored codes of different pools that are one code.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct CrossPoolPair {
    /// Their claim's key (hex), to page on.
    pub key: String,
    pub first: ClaimedCode,
    pub second: ClaimedCode,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(pool: &str, folds: bool, narrow: &[u8]) -> Entry {
        Entry {
            pool: pool.into(),
            folds,
            narrow: narrow.to_vec(),
            hmac: Vec::new(),
            run: None,
        }
    }

    #[test]
    fn confusables_count_wherever_either_pool_folds_them() {
        // Same wide key (one claim document), different narrow keys: `O1`
        // against `01`.
        let (a, b) = (entry("a", false, b"o1"), entry("b", false, b"01"));
        assert!(!same_code(&a, &b), "neither pool folds them");
        assert!(same_code(&entry("a", true, b"o1"), &b));
        assert!(same_code(&a, &entry("b", true, b"01")));
        assert!(
            same_code(&a, &entry("b", false, b"o1")),
            "equal narrow keys"
        );
        assert!(!same_code(&a, &entry("a", true, b"o1")), "one pool");
    }

    #[test]
    fn across_pools_case_and_width_are_folded() {
        let k = |c: &str| cross_pool_keys(c);
        assert_eq!(k("RACE-1").narrow, k("race-1").narrow);
        assert_eq!(k("RACE-1").narrow, k("ＲＡＣＥ-1").narrow);
        assert_ne!(k("RACE-O1").narrow, k("RACE-01").narrow);
        assert_eq!(k("RACE-O1").wide, k("race-01").wide);
    }
}
