//! Redemption by code, in batches: codes found by value (their keyed
//! hashes, never opened to be found), then used, many at once.
//!
//! A platform's redemptions arrive concurrently, like orders. A batch of
//! them costs one query to find the codes ([`Store::find_sold_by_values`]),
//! one journaled `update` command ([`Store::redeem_ids`]: issued → used,
//! tagged with its redemption id) of one conditional statement for all
//! its codes (then one per code, when a redemption id already used
//! another code stops it), and, unless every code was used, one read of
//! the codes as they are now, to tell each redemption whether it was the
//! one that used its code. MongoDB decides each code
//! exactly as for a single redemption: the statement matches only an
//! issued code, so of any number of redemptions of one code, in one batch,
//! in two batches, or in two processes, exactly one uses it.

use std::collections::{HashMap, HashSet};

use bson::oid::ObjectId;
use bson::{doc, Bson, DateTime, Document};
use codepool_domain::{Code, CodeId, CodeStatus, LookAlikeRule};
use futures::TryStreamExt;

use crate::codes::{object_id, RedemptionTag, CODES};
use crate::error::{is_transient_code, DUPLICATE_KEY};
use crate::lifecycle::{Applied, Sold};
use crate::{one_batch_for, CodeDoc, Store, StoreError};

/// The redemption-id guard: one document per redemption id, `_id: {by, id}`.
pub const REDEMPTION_IDS: &str = "redemption_ids";

/// Most keyed hashes in one lookup query; a batch naming more codes (or
/// more pools per code) is looked up in several queries.
const MOST_HASHES: usize = 1024;

/// One lookup by value: the code as typed and the pools (with their
/// look-alike rules) it may be found in.
pub struct ByValue<'a> {
    pub code: &'a str,
    pub pools: &'a [(String, LookAlikeRule)],
}

/// The keyed hashes one lookup matches: the exact value in any of its
/// pools, or its look-alike key in each pool.
struct Wanted {
    exact: Vec<u8>,
    pools: HashSet<String>,
    folds: HashSet<(String, Vec<u8>)>,
}

impl Wanted {
    /// The hashes this lookup adds to a query.
    fn hashes(&self) -> usize {
        self.pools.len() + self.folds.len()
    }
}

/// The filter that finds every code of `wanted`, in two branches per
/// pool, however many codes: in each pool the lookups name, the exact
/// values of those lookups along `code_any_hmac` and their look-alike keys
/// along `(pool, code_fold_hmac)`. The server plans a few branches, not two
/// per code, and finds no document of a pool that no lookup asking for
/// that code names (they would count against the query's limit).
fn lookup_filter(wanted: &[&Wanted]) -> Document {
    type Hashes = (Vec<Bson>, Vec<Bson>);
    let mut by_pool: std::collections::BTreeMap<&str, Hashes> = Default::default();
    for w in wanted {
        for pool in &w.pools {
            let exacts = &mut by_pool.entry(pool.as_str()).or_default().0;
            exacts.push(crate::crypto::binary(w.exact.clone()));
        }
        for (pool, h) in &w.folds {
            let folds = &mut by_pool.entry(pool.as_str()).or_default().1;
            folds.push(crate::crypto::binary(h.clone()));
        }
    }
    let mut branches = Vec::with_capacity(2 * by_pool.len());
    for (pool, (exacts, folds)) in by_pool {
        if !exacts.is_empty() {
            branches.push(doc! {"pool": pool, "code_any_hmac": {"$in": exacts}});
        }
        if !folds.is_empty() {
            branches.push(doc! {"pool": pool, "code_fold_hmac": {"$in": folds}});
        }
    }
    doc! {"$or": branches}
}

/// What one redemption by id did.
#[derive(Debug, Clone, PartialEq)]
pub enum UsedById {
    /// This redemption used the code now.
    Now(Box<Applied>),
    /// This redemption (its tag) used the code before: the code as it is.
    Before(Box<Code>),
    /// Another redemption used the code, or it was voided: as it is now.
    Refused(Box<Code>),
    /// Not known: the store failed after part of the batch was written
    /// (the codes this round used are answered [`UsedById::Now`]); the
    /// same tag again is answered as made before, or made then.
    Unavailable(String),
    /// The tag's id already redeemed another code.
    Conflicting,
    /// No such code, or it is not issued (it never was sold).
    Gone,
}

fn bytes_of(d: &Document, key: &str) -> Option<Vec<u8>> {
    match d.get(key) {
        Some(Bson::Binary(b)) => Some(b.bytes.clone()),
        _ => None,
    }
}

impl Wanted {
    fn matches(&self, d: &Document) -> bool {
        let Ok(pool) = d.get_str("pool") else {
            return false;
        };
        let exact = bytes_of(d, "code_any_hmac").is_some_and(|h| h == self.exact);
        let folded = bytes_of(d, "code_fold_hmac")
            .is_some_and(|h| self.folds.contains(&(pool.to_owned(), h)));
        (exact && self.pools.contains(pool)) || folded
    }

    fn is_exact(&self, d: &Document) -> bool {
        bytes_of(d, "code_any_hmac").is_some_and(|h| h == self.exact)
    }

    /// The code this lookup names among `found`: an exact match wins;
    /// `None` also when look-alikes in two pools match and none exactly
    /// (which was meant is not known), and for a code never sold.
    fn choose<'d>(&self, found: &'d [Document]) -> Option<&'d Document> {
        let mine: Vec<&Document> = found.iter().filter(|d| self.matches(d)).collect();
        let chosen = match mine.iter().find(|d| self.is_exact(d)) {
            Some(d) => Some(*d),
            None if mine.len() == 1 => mine.first().copied(),
            None => None,
        };
        // Sold: issued, used, or void with the order it was sold to. A
        // held code, and one voided while held, was never sold: the void
        // clears the hold's fields (a code voided before that rule kept
        // its hold's key, which is no order's).
        let sold = [CodeStatus::Issued, CodeStatus::Used, CodeStatus::Void].map(CodeStatus::as_i32);
        chosen
            .filter(|d| {
                d.get_str("order_id").is_ok_and(|o| {
                    !o.starts_with(codepool_domain::HOLD_KEY_PREFIX)
                        && !o.starts_with(codepool_domain::BUNDLE_KEY_PREFIX)
                })
            })
            .filter(|d| d.get_i32("status").is_ok_and(|s| sold.contains(&s)))
    }
}

impl Store {
    fn wanted(&self, ask: &ByValue<'_>) -> Result<Wanted, StoreError> {
        let ring = self.keys.ring()?;
        let exact = ring.any_pool_hmac(ask.code).to_vec();
        let mut folds = HashSet::new();
        for (pool, rule) in ask.pools {
            let folded = codepool_domain::fold_by(ask.code, *rule);
            folds.insert((pool.clone(), ring.fold_hmac(pool, &folded).to_vec()));
        }
        Ok(Wanted {
            exact,
            pools: ask.pools.iter().map(|(p, _)| p.clone()).collect(),
            folds,
        })
    }

    /// Each lookup's code, if it was ever sold to an order. Found by keyed
    /// hashes alone: the exact value in any of the lookup's pools
    /// (`code_any_hmac`), or its look-alike key in each pool
    /// (`code_fold_hmac`), in ONE query of a few small fields for up to
    /// [`MOST_HASHES`] hashes, whatever the codes: an unknown code, a code
    /// of another pool and a code never sold cost the same.
    pub async fn find_sold_by_values(
        &self,
        asks: &[ByValue<'_>],
    ) -> Result<Vec<Option<Sold>>, StoreError> {
        let (wanted, found) = self.sold_matching(asks, false).await?;
        Ok(wanted
            .iter()
            .map(|w| w.as_ref().and_then(|w| w.choose(&found)).and_then(Sold::of))
            .collect())
    }

    /// [`Store::find_sold_by_values`], each code found read whole and
    /// opened as well: what a redemption made now tells its audit record
    /// and the shop.
    pub async fn find_sold_codes(
        &self,
        asks: &[ByValue<'_>],
    ) -> Result<Vec<Option<(Sold, Code)>>, StoreError> {
        let (wanted, found) = self.sold_matching(asks, true).await?;
        let mut out = Vec::with_capacity(wanted.len());
        for w in &wanted {
            let chosen = w.as_ref().and_then(|w| w.choose(&found));
            out.push(match chosen.and_then(|d| Some((Sold::of(d)?, d))) {
                Some((sold, d)) => {
                    let doc: CodeDoc =
                        bson::from_document(d.clone()).map_err(|e| StoreError::Corrupt {
                            collection: CODES.into(),
                            message: e.to_string(),
                        })?;
                    Some((sold, doc.into_code(&self.keys)?))
                }
                None => None,
            });
        }
        Ok(out)
    }

    /// The documents that may be the codes `asks` name, in as few queries
    /// as the clauses allow; whole, or a few small fields.
    async fn sold_matching(
        &self,
        asks: &[ByValue<'_>],
        whole: bool,
    ) -> Result<(Vec<Option<Wanted>>, Vec<Document>), StoreError> {
        let mut wanted = Vec::with_capacity(asks.len());
        for ask in asks {
            wanted.push(
                (!ask.pools.is_empty())
                    .then(|| self.wanted(ask))
                    .transpose()?,
            );
        }
        let mut found = Vec::new();
        let mut chunk: Vec<&Wanted> = Vec::new();
        let mut hashes = 0;
        for w in wanted.iter().flatten() {
            if !chunk.is_empty() && hashes + w.hashes() > MOST_HASHES {
                found.extend(self.matching(&chunk, whole).await?);
                (chunk, hashes) = (Vec::new(), 0);
            }
            hashes += w.hashes();
            chunk.push(w);
        }
        if !chunk.is_empty() {
            found.extend(self.matching(&chunk, whole).await?);
        }
        // Two queries may both find a code (two lookups naming its pool):
        // counted twice, it would read as two look-alikes of one lookup.
        let mut seen = HashSet::new();
        found.retain(|d| d.get_object_id("_id").map_or(true, |id| seen.insert(id)));
        Ok((wanted, found))
    }

    async fn matching(&self, wanted: &[&Wanted], whole: bool) -> Result<Vec<Document>, StoreError> {
        // A code and its look-alikes: a few documents at most.
        let most = 8 * wanted.len();
        let small = doc! {
            "_id": 1, "code_any_hmac": 1, "code_fold_hmac": 1, "pool": 1, "order_id": 1,
            "status": 1, "grant_no": 1, "order_line": 1, "issued_at": 1, "used_at": 1,
            "voided_at": 1, "void_reason": 1, "redemption": 1,
        };
        let codes = self.collection(CODES);
        let mut find = codes
            .find(lookup_filter(wanted))
            .limit(i64::try_from(most).unwrap_or(i64::MAX))
            .batch_size(one_batch_for(most));
        if !whole {
            find = find.projection(small);
        }
        Ok(find.await?.try_collect().await?)
    }

    /// Redeems each code of `asks` (each as a lookup read it: issued;
    /// issued → used, tagged) and tells each redemption what it did, in the
    /// order asked. One round is one journaled `update` command of one
    /// statement for all its codes (then, if a unique index stopped it,
    /// one of a statement per code), in which the first pending ask of
    /// each code names the code's tag; a later ask
    /// of the same code is answered from the code as it is then (its tag's
    /// [`UsedById::Before`], or [`UsedById::Refused`]). An ask whose code
    /// is still issued after its round (the statement made for it was
    /// another ask's, refused because that ask's id had redeemed another
    /// code) goes again in the next round: every round answers at least
    /// the asks that made its statements.
    pub async fn redeem_ids(
        &self,
        asks: &[(&Code, RedemptionTag)],
    ) -> Result<Vec<UsedById>, StoreError> {
        let mut out: Vec<Option<UsedById>> = vec![None; asks.len()];
        let mut pending: Vec<usize> = (0..asks.len()).collect();
        while !pending.is_empty() {
            let answered = self.redeem_round(asks, &pending).await?;
            let mut again = Vec::new();
            for (i, a) in pending.into_iter().zip(answered) {
                match a {
                    Some(a) => out[i] = Some(a),
                    None => again.push(i),
                }
            }
            pending = again;
        }
        Ok(out
            .into_iter()
            .map(|a| a.unwrap_or(UsedById::Gone))
            .collect())
    }

    /// One round of [`Store::redeem_ids`] over the asks `pending`: each
    /// one's answer, or `None` to go again. When every statement used its
    /// code, that is the answer; otherwise (another process got there
    /// first, a tag already redeemed another code) the codes are read back
    /// to tell which.
    async fn redeem_round(
        &self,
        asks: &[(&Code, RedemptionTag)],
        pending: &[usize],
    ) -> Result<Vec<Option<UsedById>>, StoreError> {
        let now = DateTime::now();
        // This round's own mark on the codes it uses: two rounds (two
        // batches, two processes) can share the millisecond of `now`.
        let round = ObjectId::new();
        let (owner, statement_of) = owners(asks, pending);
        // Each redemption id is claimed first, in its guard (one document
        // per id, whatever the pool: the rule spans shards). An id whose
        // guard names another code is refused; one whose guard names this
        // code (a retry, or a write that died before the code's) goes on.
        let mut conflicting = self.guard_ids(asks, &statement_of, now).await?;
        let written: Vec<usize> = (statement_of.iter().copied())
            .filter(|i| !conflicting.contains(i))
            .collect();
        // All the codes in one statement: the server parses, plans and
        // commits it once, not once per code.
        let mut modified = 0;
        if !written.is_empty() {
            let tags: Vec<(&Code, &RedemptionTag)> =
                (written.iter()).map(|&i| (asks[i].0, &asks[i].1)).collect();
            let reply = (self.update_codes(vec![redeem_statement(&tags, now, round)])).await?;
            conflicting.extend(
                refused_statements(&reply)?
                    .into_iter()
                    .filter_map(|s| written.get(s).copied()),
            );
            modified = match reply.get("nModified") {
                Some(Bson::Int32(n)) => usize::try_from(*n).unwrap_or(0),
                Some(Bson::Int64(n)) => usize::try_from(*n).unwrap_or(0),
                _ => 0,
            };
        }
        let now_codes: HashMap<CodeId, Now> =
            if conflicting.is_empty() && modified == statement_of.len() {
                all_used(asks, &owner, now, round)
            } else {
                self.codes_now(asks, owner.keys()).await?
            };
        let answers: Vec<Option<UsedById>> = pending
            .iter()
            .map(|&i| {
                if conflicting.contains(&i) {
                    return Some(UsedById::Conflicting);
                }
                let owns = owner.get(&asks[i].0.id) == Some(&i);
                answer(&asks[i], owns, &now_codes, now, round)
            })
            .collect();
        // An id whose code was used by another (or is gone) redeemed
        // nothing: its guard is taken back, so the id stays free for
        // another code, as it was before guards.
        let unused: Vec<Document> = (pending.iter().zip(&answers))
            .filter(|(i, a)| {
                written.contains(i)
                    && matches!(a, Some(UsedById::Refused(_)) | Some(UsedById::Gone))
            })
            .map(|(&i, _)| {
                let (code, tag) = &asks[i];
                doc! {"q": {"_id": {"by": &tag.by, "id": &tag.id}, "code": object_id(code.id)}, "limit": 1}
            })
            .collect();
        if !unused.is_empty() {
            let reply = self
                .database()
                .run_command(doc! {"delete": REDEMPTION_IDS, "deletes": unused, "ordered": false})
                .await;
            if let Err(e) = reply {
                tracing::warn!(error = %e, "redemption ids that used nothing keep their guards");
            }
        }
        Ok(answers)
    }

    /// Writes the guard of `tag` for `code` (one redemption): true when the
    /// id is this code's (new, or written before for it), false when it
    /// guards another code.
    pub(crate) async fn guard_redemption(
        &self,
        tag: &RedemptionTag,
        code: &Code,
        now: DateTime,
    ) -> Result<bool, StoreError> {
        let ask = [(code, tag.clone())];
        Ok(self.guard_ids(&ask, &[0], now).await?.is_empty())
    }

    /// Takes back the guard of `tag` on `code` when the code was not used
    /// under it (used by another, void, gone): the id stays free. A failure
    /// is logged: the guard then keeps the id on that code.
    pub(crate) async fn unguard_redemption(&self, tag: &RedemptionTag, code: CodeId) {
        let q = doc! {"_id": {"by": &tag.by, "id": &tag.id}, "code": object_id(code)};
        if let Err(e) = self.collection(REDEMPTION_IDS).delete_one(q).await {
            tracing::warn!(error = %e, "a redemption id that used nothing keeps its guard");
        }
    }

    /// Writes the guard of each ask of `statement_of`: `_id: {by, id}`,
    /// the code it redeems and its pool. Returns the asks whose id already
    /// guards another code. Journaled before the code moves, so an id
    /// never uses two codes, in any pools, on any shards.
    async fn guard_ids(
        &self,
        asks: &[(&Code, RedemptionTag)],
        statement_of: &[usize],
        now: DateTime,
    ) -> Result<HashSet<usize>, StoreError> {
        let key = |t: &RedemptionTag| doc! {"by": &t.by, "id": &t.id};
        let docs: Vec<Document> = (statement_of.iter())
            .map(|&i| {
                let (code, tag) = &asks[i];
                doc! {"_id": key(tag), "code": object_id(code.id), "pool": &code.pool, "at": now}
            })
            .collect();
        if docs.is_empty() {
            return Ok(HashSet::new());
        }
        let reply = self
            .database()
            .run_command(doc! {
                "insert": REDEMPTION_IDS,
                "documents": docs,
                "ordered": false,
                "writeConcern": crate::durable_doc(),
            })
            .await?;
        let taken: Vec<usize> = (refused_statements(&reply)?.into_iter())
            .filter_map(|s| statement_of.get(s).copied())
            .collect();
        if taken.is_empty() {
            return Ok(HashSet::new());
        }
        let keys: Vec<Document> = taken.iter().map(|&i| key(&asks[i].1)).collect();
        let guards: Vec<Document> = self
            .collection(REDEMPTION_IDS)
            .find(doc! {"_id": {"$in": keys}})
            .await?
            .try_collect()
            .await?;
        let guarded: HashMap<(String, String), ObjectId> = (guards.into_iter())
            .filter_map(|g| {
                let key = g.get_document("_id").ok()?;
                let (by, id) = (key.get_str("by").ok()?, key.get_str("id").ok()?);
                Some((
                    (by.to_owned(), id.to_owned()),
                    g.get_object_id("code").ok()?,
                ))
            })
            .collect();
        Ok(taken
            .into_iter()
            .filter(|&i| {
                let (code, tag) = &asks[i];
                // A guard read back is this id's for good: another code's
                // refuses the ask; a vanished one cannot be (guards are
                // never deleted), so it is refused too, to be safe.
                guarded.get(&(tag.by.clone(), tag.id.clone())) != Some(&object_id(code.id))
            })
            .collect())
    }

    /// The codes `ids` as they are now, with the redemption that used each
    /// and the round that wrote it.
    async fn codes_now(
        &self,
        asks: &[(&Code, RedemptionTag)],
        ids: impl Iterator<Item = &CodeId>,
    ) -> Result<HashMap<CodeId, Now>, StoreError> {
        let ids: Vec<_> = ids.map(|id| object_id(*id)).collect();
        let mut pools: Vec<&str> = asks.iter().map(|(c, _)| c.pool.as_str()).collect();
        pools.sort_unstable();
        pools.dedup();
        let docs: Vec<CodeDoc> = self
            .typed::<CodeDoc>(CODES)
            .find(doc! {"pool": {"$in": pools}, "_id": {"$in": &ids}})
            .batch_size(one_batch_for(ids.len()))
            .await?
            .try_collect()
            .await?;
        let mut out = HashMap::new();
        for d in docs {
            let (tag, made_in) = (d.redemption.clone(), d.redeemed_in);
            let code = d.into_code(&self.keys)?;
            out.insert(code.id, (tag, made_in, code));
        }
        Ok(out)
    }
}

/// What ask `(before, tag)` did in `round` (written at `now`), from its
/// code as the round left it; `owns` when its statement was the code's.
/// `None` when it goes again: its code is still issued, and the statement
/// made for it was another ask's.
fn answer(
    (before, tag): &(&Code, RedemptionTag),
    owns: bool,
    now_codes: &HashMap<CodeId, Now>,
    now: DateTime,
    round: ObjectId,
) -> Option<UsedById> {
    let Some((used_by, made_in, code)) = now_codes.get(&before.id) else {
        return Some(UsedById::Gone);
    };
    let by_this = used_by.as_ref() == Some(tag) && code.status == CodeStatus::Used;
    let at_now = *made_in == Some(round);
    Some(match code.status {
        _ if by_this && owns && at_now => UsedById::Now(Box::new(Applied {
            before: Code::clone(before),
            at: now,
        })),
        _ if by_this => UsedById::Before(Box::new(code.clone())),
        CodeStatus::Used | CodeStatus::Void => UsedById::Refused(Box::new(code.clone())),
        CodeStatus::Issued if !owns => return None,
        _ => UsedById::Gone,
    })
}

/// The ask that makes each code's statement (the first pending one that
/// names it), by code, and those asks in order.
fn owners(
    asks: &[(&Code, RedemptionTag)],
    pending: &[usize],
) -> (HashMap<CodeId, usize>, Vec<usize>) {
    let mut owner: HashMap<CodeId, usize> = HashMap::new();
    let mut statement_of = Vec::new();
    for &i in pending {
        let id = asks[i].0.id;
        if let std::collections::hash_map::Entry::Vacant(e) = owner.entry(id) {
            e.insert(i);
            statement_of.push(i);
        }
    }
    (owner, statement_of)
}

/// One statement that uses every code of `tags` still in a state of
/// `from`, each under its own tag: the tag is picked by the code's place
/// in the list, as a claim picks each code's order.
fn redeem_statement(tags: &[(&Code, &RedemptionTag)], now: DateTime, round: ObjectId) -> Document {
    let ids: Vec<Bson> = tags
        .iter()
        .map(|(c, _)| Bson::ObjectId(object_id(c.id)))
        .collect();
    let marks: Vec<Bson> = (tags.iter())
        .map(|(_, t)| Bson::Document(doc! {"id": &t.id, "by": &t.by}))
        .collect();
    let mut pools: Vec<&str> = tags.iter().map(|(c, _)| c.pool.as_str()).collect();
    pools.sort_unstable();
    pools.dedup();
    crate::moves::redeem_statement(ids, pools, marks, now, round)
}

/// A code as a round reads it back: the redemption that used it, the
/// round that wrote that, and the code.
type Now = (Option<RedemptionTag>, Option<ObjectId>, Code);

/// The codes as they are after `round`, whose every statement used its
/// code under its owner's tag.
fn all_used(
    asks: &[(&Code, RedemptionTag)],
    owner: &HashMap<CodeId, usize>,
    now: DateTime,
    round: ObjectId,
) -> HashMap<CodeId, Now> {
    (owner.iter())
        .map(|(id, i)| {
            let (before, tag) = &asks[*i];
            let mut used = Code::clone(before);
            used.status = CodeStatus::Used;
            used.used_at = Some(now.to_chrono());
            (*id, (Some(tag.clone()), Some(round), used))
        })
        .collect()
}

/// An error when the write concern of `reply`'s command was not met.
fn concern_met(reply: &Document) -> Result<(), StoreError> {
    match reply.get_document("writeConcernError") {
        Ok(wce) => Err(StoreError::Unavailable(format!(
            "write concern not satisfied: {}",
            wce.get_str("errmsg").unwrap_or("unknown")
        ))),
        Err(_) => Ok(()),
    }
}

/// The statements of an unordered write command that a unique index
/// refused (a redemption id already on another code). A write concern not
/// met, or a transient error, is the whole command's: "retry later" (the
/// same redemption ids again are answered as before); any other refusal is
/// the whole command's too.
pub(crate) fn refused_statements(reply: &Document) -> Result<Vec<usize>, StoreError> {
    concern_met(reply)?;
    let mut out = Vec::new();
    for e in reply
        .get_array("writeErrors")
        .map(|a| a.iter().filter_map(Bson::as_document).collect::<Vec<_>>())
        .unwrap_or_default()
    {
        let code = e.get_i32("code").unwrap_or(-1);
        let message = e.get_str("errmsg").unwrap_or("unknown");
        match (
            code,
            e.get_i32("index")
                .ok()
                .and_then(|i| usize::try_from(i).ok()),
        ) {
            (DUPLICATE_KEY, Some(i)) => out.push(i),
            (c, _) if is_transient_code(c) => {
                return Err(StoreError::Unavailable(message.to_owned()))
            }
            _ => return Err(StoreError::Rejected(message.to_owned())),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_duplicate_keys_are_a_statement_s_own_refusal() {
        let dup = doc! {"n": 1, "writeErrors": [
            {"index": 2, "code": DUPLICATE_KEY, "errmsg": "E11000"},
            {"index": 0, "code": DUPLICATE_KEY, "errmsg": "E11000"},
        ]};
        assert_eq!(refused_statements(&dup).unwrap(), vec![2, 0]);
        let wce = doc! {"n": 1, "writeConcernError": {"code": 64, "errmsg": "waiting"}};
        assert!(refused_statements(&wce).unwrap_err().is_unavailable());
        let other = doc! {"n": 0, "writeErrors": [{"index": 0, "code": 2, "errmsg": "bad"}]};
        assert!(matches!(
            refused_statements(&other),
            Err(StoreError::Rejected(_))
        ));
        assert!(refused_statements(&doc! {"n": 3}).unwrap().is_empty());
    }
}
