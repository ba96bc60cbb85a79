//! Claim candidates for the hot sets: each pool's next unissued codes after a `seq`, many pools in one command, and a cold pool's first window.

use super::*;

impl Store {
    /// Unissued, unexpired codes of `pool` after `after_seq`, oldest first:
    /// the candidates that refill the hot pool. Only ids and seqs travel.
    pub async fn candidates_after(
        &self,
        pool: &str,
        after_seq: i64,
        limit: i64,
    ) -> Result<Vec<(CodeId, i64)>, StoreError> {
        let mut found = self
            .candidates_after_many(&[CandidateAsk {
                pool,
                after_seq,
                limit,
            }])
            .await?;
        Ok(found.pop().unwrap_or_default())
    }

    /// [`Store::candidates_after`] for several pools, aligned with `asks`.
    /// Pools asked from their start (cold ones, and rescans) share three
    /// commands, each pool's read bounded by its limit
    /// ([`Store::first_candidates`]); the others, and any those did not
    /// answer, go in one `aggregate` per
    /// [`ASKS_PER_QUERY`] pools, each pool's bounded scan a `$unionWith`
    /// branch. Pools that start cold together (a batch of purchases over
    /// many pools) cost one command, not one each.
    pub async fn candidates_after_many(
        &self,
        asks: &[CandidateAsk<'_>],
    ) -> Result<Vec<Vec<(CodeId, i64)>>, StoreError> {
        let now = DateTime::now();
        let mut found = vec![Vec::new(); asks.len()];
        let (from_start, mut rest): (Vec<usize>, Vec<usize>) =
            (0..asks.len()).partition(|&i| asks[i].after_seq == 0);
        if from_start.len() > 1 {
            for (i, codes) in self.first_candidates(asks, from_start, now).await? {
                match codes {
                    Some(codes) => found[i] = codes,
                    None => rest.push(i),
                }
            }
        } else {
            rest.extend(from_start);
        }
        self.each_union_reply(
            rest.len(),
            |at| asks[rest[at]].pipeline(at, now),
            // Every candidate in the first reply: no getMore round trip.
            |chunk| chunk.map(|at| asks[rest[at]].limit.max(1)).sum(),
            |d| {
                let (at, id, seq) = candidate_fields(&d, rest.len())?;
                found[rest[at]].push((id, seq));
                Ok(())
            },
        )
        .await?;
        for codes in &mut found {
            codes.sort_unstable_by_key(|&(_, seq)| seq);
        }
        Ok(found)
    }

    /// The first candidates of the asks `which` (all from the start), each
    /// pool's read bounded by its own limit, whatever the pool's size, in
    /// three commands whatever the number of pools:
    ///
    /// 1. each pool's lowest and highest unissued `seq`: two index-only
    ///    `DISTINCT_SCAN`s of `pool_status_seq` (one key per pool each);
    /// 2. one `find` of every pool's window of `seq`, from its lowest
    ///    unissued code, as wide as its limit (a pool's codes have distinct
    ///    `seq`s, so a window holds at most that many): no pool reads past
    ///    what it asked for.
    ///
    /// A window that reaches the pool's highest unissued code read the
    /// whole pool; one that found its limit answered it. A window thinned
    /// by codes claimed or expired since (or between) is not an answer:
    /// `None`, and the caller reads that pool alone.
    ///
    /// A budgeted scan of the pools in index order (as stock counts do)
    /// has no bound per pool: each pool it passes costs all its unissued
    /// codes, so a 1,000-pool cold start over pools of 125 codes read every
    /// code twice (the scans cut at the budget and rescanned) to keep 64
    /// a pool.
    pub(super) async fn first_candidates(
        &self,
        asks: &[CandidateAsk<'_>],
        which: Vec<usize>,
        now: DateTime,
    ) -> Result<Vec<(usize, Option<Vec<(CodeId, i64)>>)>, StoreError> {
        let pools: Vec<&str> = which.iter().map(|&i| asks[i].pool).collect();
        // Along (pool, status, seq), a pool's unissued codes come in `seq`
        // order only because a claim takes codes of one status.
        debug_assert_eq!(Transition::Claim.from_codes().len(), 1);
        let (lowest, highest) = futures::try_join!(
            self.unissued_end(&pools, PoolOrder::Ascending),
            self.unissued_end(&pools, PoolOrder::Descending),
        )?;
        // Per ask: its window and whether it reaches the pool's last
        // unissued code; none for a pool without one.
        let windows: Vec<Option<(i64, i64, bool)>> = (which.iter())
            .map(|&i| {
                let pool = asks[i].pool;
                let (lo, hi) = (*lowest.get(pool)?, *highest.get(pool)?);
                let end = lo.saturating_add(asks[i].limit.max(1) - 1);
                Some((lo, end.min(hi), end >= hi))
            })
            .collect();
        let branches: Vec<Document> = (which.iter().zip(&windows))
            .filter_map(|(&i, w)| {
                let (lo, hi, _) = (*w)?;
                let mut branch = in_pool(asks[i].pool, unissued());
                branch.insert("seq", doc! {"$gte": lo, "$lte": hi});
                Some(branch)
            })
            .collect();
        let mut by_pool: HashMap<String, Vec<(CodeId, i64)>> = HashMap::new();
        if !branches.is_empty() {
            let most: i64 = (which.iter().zip(&windows))
                .filter(|(_, w)| w.is_some())
                .map(|(&i, _)| asks[i].limit.max(1))
                .sum();
            let filter = doc! {"$and": [{"$or": branches}, not_expired(now)]};
            let rows: Vec<Document> = self
                .collection(CODES)
                .find(filter)
                .projection(doc! {"_id": 1, "seq": 1, "pool": 1})
                .hint(mongodb::options::Hint::Name("pool_status_seq".into()))
                .batch_size(crate::one_batch_for(
                    usize::try_from(most).unwrap_or(usize::MAX),
                ))
                .await?
                .try_collect()
                .await?;
            for d in &rows {
                let (id, seq, pool) = candidate_of(d)?;
                by_pool.entry(pool.to_owned()).or_default().push((id, seq));
            }
        }
        Ok(which
            .into_iter()
            .zip(windows)
            .map(|(i, w)| {
                let Some((_, _, whole)) = w else {
                    // Nothing unissued: the pool's whole answer.
                    return (i, Some(Vec::new()));
                };
                // By `get`: two asks of one pool each get its window.
                let mut got = by_pool.get(asks[i].pool).cloned().unwrap_or_default();
                got.sort_unstable_by_key(|&(_, seq)| seq);
                let limit = usize::try_from(asks[i].limit.max(1)).unwrap_or(usize::MAX);
                got.truncate(limit);
                (i, (whole || got.len() >= limit).then_some(got))
            })
            .collect())
    }

    /// Each pool's lowest (ascending) or highest (descending) unissued
    /// `seq`, expired or not: a `DISTINCT_SCAN` of `pool_status_seq` that
    /// reads one key per pool. Pools without one are absent.
    pub(super) async fn unissued_end(
        &self,
        pools: &[&str],
        order: PoolOrder,
    ) -> Result<HashMap<String, i64>, StoreError> {
        let sign = match order {
            PoolOrder::Ascending => 1,
            PoolOrder::Descending => -1,
        };
        let mut filter = unissued();
        filter.insert("pool", doc! {"$in": pools});
        let rows: Vec<Document> = self
            .collection(CODES)
            .aggregate(vec![
                doc! {"$match": filter},
                doc! {"$sort": {"pool": sign, "status": sign, "seq": sign}},
                doc! {"$group": {"_id": "$pool", "seq": {"$first": "$seq"}}},
            ])
            .batch_size(crate::one_batch_for(pools.len()))
            .await?
            .try_collect()
            .await?;
        rows.iter()
            .map(|d| match (d.get_str("_id"), d.get_i64("seq")) {
                (Ok(pool), Ok(seq)) => Ok((pool.to_owned(), seq)),
                _ => Err(StoreError::Corrupt {
                    collection: CODES.into(),
                    message: format!("a pool's end of unissued codes reads {d}"),
                }),
            })
            .collect()
    }
}
