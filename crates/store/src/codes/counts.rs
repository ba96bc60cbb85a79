//! Reading codes and counting them: lookups by order, code or import, and bounded counts of unissued stock per pool.

use super::*;

impl Store {
    /// The codes an operator asked about, newest grant first.
    pub async fn find_codes(
        &self,
        query: &CodeQuery<'_>,
        limit: i64,
    ) -> Result<Vec<Code>, StoreError> {
        let filter = match query {
            CodeQuery::Order(o) => doc! {"order_id": *o},
            CodeQuery::Uid(u) => doc! {"uid": *u},
            CodeQuery::Phone(p) => doc! {"phone": *p},
            CodeQuery::Code { pool, code } => self.code_filter(pool, code).await?,
            // `issued_at` lets the partial `(pool, issued_at)` index serve
            // the newest grants first, without sorting a pool's grants.
            // A code a hold or a bundle set aside (its order_id an
            // internal key, held or voided while held) is no grant.
            CodeQuery::GrantsOf(pool) => doc! {
                "pool": *pool, "issued_at": {"$exists": true},
                "order_id": {"$type": "string", "$not": set_aside_key()},
            },
        };
        let docs: Vec<CodeDoc> = self
            .typed::<CodeDoc>(CODES)
            .find(filter)
            .sort(doc! {"issued_at": -1})
            .limit(limit)
            .await?
            .try_collect()
            .await?;
        docs.into_iter().map(|d| d.into_code(&self.keys)).collect()
    }

    /// Number of unissued, unexpired codes in `pool`, counted document by
    /// document. Costs as much as the pool is large: a reference for tests
    /// and checks; operators get [`Store::unissued_stock`], the claim path
    /// [`Store::unissued_count_upto`].
    pub async fn unissued_count(&self, pool: &str) -> Result<u64, StoreError> {
        let filter = claimable_in(pool, DateTime::now());
        Ok(self.collection(CODES).count_documents(filter).await?)
    }

    /// Unissued, unexpired codes in `pool`, counted up to `cap`: exact
    /// below it, `cap` at or above it. Its cost is bounded by `cap`, not by
    /// the pool's size.
    pub async fn unissued_count_upto(&self, pool: &str, cap: u64) -> Result<u64, StoreError> {
        let mut counts = self.unissued_counts_upto(&[(pool, cap)]).await?;
        Ok(counts.pop().unwrap_or(0))
    }

    /// [`Store::unissued_count_upto`] of several `(pool, cap)`, aligned
    /// with the input, in one `aggregate` per [`ASKS_PER_QUERY`] counts
    /// (each a `$unionWith` branch): a stock sweep over thousands of pools
    /// is a few dozen commands, not thousands.
    ///
    /// The stock is two counts in index order: the pool's expired
    /// unissued codes in `unissued_expiry` (up to the cap), then its
    /// unissued codes in `pool_status_seq` (up to twice the cap; an
    /// index-only scan), and the difference. MongoDB 6.0 reads each expired
    /// code to check the status its partial index already implies, so the
    /// count reads only the expired codes the expiry sweep has not voided
    /// yet (none in the usual case), never the stock. A pool holding `cap`
    /// or more of those is counted document by document instead.
    ///
    /// The two counts are a moment apart, like any count beside running
    /// claims. Expired codes are counted first, so a code the sweep voids
    /// in between lowers the answer until the next check, never raises it:
    /// a backorder sweep then fulfils fewer, not more than there is.
    pub async fn unissued_counts_upto(&self, asks: &[(&str, u64)]) -> Result<Vec<u64>, StoreError> {
        let now = DateTime::now();
        let cap = |i: usize| asks[i].1.clamp(1, i64::MAX as u64 / 2);
        let n = asks.len();
        let (mut expired, mut unissued) = if n > 1 {
            let pools: Vec<&str> = asks.iter().map(|a| a.0).collect();
            let caps: Vec<u64> = (0..n).map(cap).collect();
            self.count_across(&pools, &caps, now).await?
        } else {
            (vec![None; n], vec![None; n])
        };
        // Pools counted one by one: a single pool, or those the scans'
        // budgets did not reach. Count `2k` is pool `rest[k]`'s expired
        // codes, `2k + 1` its unissued ones; a chunk's branches run in
        // this order.
        let rest: Vec<usize> = (0..n)
            .filter(|&i| expired[i].is_none() || unissued[i].is_none())
            .collect();
        let counts = self
            .counts_upto(rest.len() * 2, |at| {
                let (pool, limit) = (asks[rest[at / 2]].0, cap(rest[at / 2]) as i64);
                match at % 2 {
                    0 => count_upto(
                        in_pool(pool, expired_unissued(now)),
                        CountFrom::Any,
                        limit,
                        at,
                    ),
                    _ => count_upto(unissued_in(pool), CountFrom::NewestFirst, limit * 2, at),
                }
            })
            .await?;
        for (k, &i) in rest.iter().enumerate() {
            (expired[i], unissued[i]) = (Some(counts[2 * k]), Some(counts[2 * k + 1]));
        }
        // Every count is known here: `rest` held each pool still without one.
        let expired = |i: usize| expired[i].unwrap_or(0).min(cap(i));
        let unissued = |i: usize| unissued[i].unwrap_or(0).min(cap(i) * 2);
        let mut stock: Vec<u64> = (0..n)
            .map(|i| unissued(i).saturating_sub(expired(i)).min(cap(i)))
            .collect();
        let unswept: Vec<usize> = (0..n).filter(|&i| expired(i) >= cap(i)).collect();
        if !unswept.is_empty() {
            let exact = self
                .counts_upto(unswept.len(), |at| {
                    let i = unswept[at];
                    let filter = claimable_in(asks[i].0, now);
                    count_upto(filter, CountFrom::NewestFirst, cap(i) as i64, at)
                })
                .await?;
            for (i, n) in unswept.into_iter().zip(exact) {
                stock[i] = n;
            }
        }
        Ok(stock)
    }

    /// The two counts of [`Store::unissued_counts_upto`] for all `pools`
    /// at once, in budgeted scans ([`crate::across`]): expired codes first,
    /// both from the highest pool name down (unissued keys from the
    /// highest `seq` down, see [`CountFrom::NewestFirst`]). `None` for a
    /// pool the scans did not answer.
    pub(super) async fn count_across(
        &self,
        pools: &[&str],
        caps: &[u64],
        now: DateTime,
    ) -> Result<(Vec<Option<u64>>, Vec<Option<u64>>), StoreError> {
        let down = PoolOrder::Descending;
        let filter = expired_unissued(now);
        let e = self
            .count_each(pools, caps, &filter, UNISSUED_EXPIRY, down)
            .await?;
        let twice: Vec<u64> = caps.iter().map(|c| c * 2).collect();
        let u = self
            .count_each(pools, &twice, &unissued(), POOL_STATUS_SEQ, down)
            .await?;
        Ok((e, u))
    }

    /// The `n` counts `branch(at)` describes ([`count_upto`]), aligned.
    pub(super) async fn counts_upto(
        &self,
        n: usize,
        branch: impl Fn(usize) -> Vec<Document>,
    ) -> Result<Vec<u64>, StoreError> {
        let mut counts = vec![0u64; n];
        self.each_union_reply(
            n,
            branch,
            |chunk| chunk.len() as i64,
            |d| {
                let at = int_field(&d, "_id").and_then(|i| usize::try_from(i).ok());
                match (at, int_field(&d, "n")) {
                    (Some(i), Some(c)) if i < counts.len() => {
                        counts[i] = c as u64;
                        Ok(())
                    }
                    _ => Err(StoreError::Corrupt {
                        collection: CODES.into(),
                        message: format!("a stock count answered {d}"),
                    }),
                }
            },
        )
        .await?;
        Ok(counts)
    }

    /// Runs `n` asks as one `aggregate` per [`ASKS_PER_QUERY`]: `branch(at)`
    /// is ask `at`'s pipeline (its replies carry `at`), the first of a chunk
    /// runs on `codes` and the others are `$unionWith` branches of it.
    /// `most` bounds a chunk's replies, which come in one reply
    /// ([`crate::one_batch_for`]); `each` takes every reply.
    pub(super) async fn each_union_reply(
        &self,
        n: usize,
        branch: impl Fn(usize) -> Vec<Document>,
        most: impl Fn(std::ops::Range<usize>) -> i64,
        mut each: impl FnMut(Document) -> Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        for start in (0..n).step_by(ASKS_PER_QUERY) {
            let chunk = start..(start + ASKS_PER_QUERY).min(n);
            let batch = crate::one_batch_for(usize::try_from(most(chunk.clone())).unwrap_or(0));
            let mut cursor = self
                .collection(CODES)
                .aggregate(union_of(chunk.map(&branch)))
                .batch_size(batch)
                .await?;
            while let Some(d) = cursor.try_next().await? {
                each(d)?;
            }
        }
        Ok(())
    }
}

/// Matches the internal keys of holds and bundles (they begin with a
/// control character no order id may hold).
fn set_aside_key() -> bson::Regex {
    bson::Regex {
        pattern: "^\\x01".to_owned(),
        options: String::new(),
    }
}
