//! Scans of several pools in one query.
//!
//! A batch of purchases over many pools needs a stock count of each. (Its
//! cold pools' first candidates are read by windows of `seq` instead,
//! each bounded by its pool's limit: see `Store::first_candidates`; a
//! count walks index keys only, a candidate read fetches every document
//! it passes.) Asked pool by pool (a
//! `$unionWith` branch each, [`crate::codes`]), mongod parses, plans and
//! runs every branch on its own: about 1 ms a pool at a 1,000-pool cold
//! start. Asked as one `$in` over the pools, sorted the way an index
//! already runs, they are one plan and one index scan, a third of that.
//!
//! Such a scan has no bound per pool, so it carries a budget instead: it
//! stops after as many matches as the per-pool bounds add up to. What it
//! returns is bounded by the number of pools and their bounds, not by any
//! pool's size; what it walks past besides is what a per-pool query walks
//! past too: the keys of codes claimed moments ago, not yet reconciled.
//! When the budget runs out, the pools the scan did not
//! answer ([`Reach::answered`]) are scanned again, and what is left goes
//! to the per-pool query. Every scan answers at least the pool it starts
//! with (the budget covers that pool's bound), so one big pool costs one
//! more scan, not a query for every pool behind it. A scan that answered
//! fewer than half its pools met big pools one after another (a catalogue
//! whose best sellers sort first): scanning again would answer a few at a
//! time, so the rest go to the per-pool query at once; and there are at
//! most [`SCANS_MOST`] scans.

use std::collections::HashMap;

use bson::{doc, Document};
use futures::TryStreamExt;

use crate::collections::{as_u64, CODES};
use crate::{Store, StoreError};

/// Most budgeted scans of the same pools before the ones still unanswered
/// go to the per-pool query.
pub(crate) const SCANS_MOST: usize = 4;

/// Whether the pools a scan of `scanned` left unanswered, `left` of them,
/// are worth another scan: only when it answered at least half.
pub(crate) fn worth_another_scan(scanned: usize, left: usize) -> bool {
    left > 0 && left * 2 <= scanned
}

/// Which way a scan walks the pools: by name, compared bytewise, as
/// MongoDB compares strings without a collation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PoolOrder {
    Ascending,
    Descending,
}

impl PoolOrder {
    fn sign(self) -> i32 {
        match self {
            PoolOrder::Ascending => 1,
            PoolOrder::Descending => -1,
        }
    }

    /// Of the pools a scan matched (in any order, as `$group` returns
    /// them), the one it reached last: the furthest in this order.
    fn furthest<'p>(self, pools: impl Iterator<Item = &'p str>) -> Option<&'p str> {
        match self {
            PoolOrder::Ascending => pools.max(),
            PoolOrder::Descending => pools.min(),
        }
    }
}

/// Adds up per-pool bounds into a budget, saturating: a threshold set near
/// `i64::MAX` must not wrap a budget around to a small one.
pub(crate) fn budget_of(bounds: impl Iterator<Item = u64>) -> u64 {
    bounds.fold(0, u64::saturating_add)
}

/// How far a budgeted scan of several pools got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Reach {
    order: PoolOrder,
    /// The pool the scan was in when its budget ran out; `None` when it
    /// finished within it.
    cut_at: Option<String>,
}

impl Reach {
    /// A scan in `order` that matched `spent` of its `budget`, the last of
    /// them (in scan order) in pool `last`.
    pub(crate) fn new(order: PoolOrder, spent: u64, budget: u64, last: Option<&str>) -> Self {
        Self {
            order,
            cut_at: last.filter(|_| spent >= budget).map(str::to_owned),
        }
    }

    /// Whether the scan answered `pool` in full, having found `got` of the
    /// `wanted` matches the caller needs there: always when it finished;
    /// otherwise for every pool it passed before the cut, and for the pool
    /// at the cut only if it had found enough there already.
    pub(crate) fn answered(&self, pool: &str, got: u64, wanted: u64) -> bool {
        let Some(cut) = self.cut_at.as_deref() else {
            return true;
        };
        got >= wanted
            || match self.order {
                PoolOrder::Ascending => pool < cut,
                PoolOrder::Descending => pool > cut,
            }
    }
}

/// One budgeted scan over several pools: `filter` (without the pool) in
/// the order of `index_order`, the key of the index that answers it with
/// `pool` first, so nothing is sorted in memory.
pub(crate) struct PoolScan<'a> {
    pub pools: &'a [&'a str],
    pub filter: Document,
    pub index_order: &'a [&'a str],
    pub order: PoolOrder,
    pub budget: u64,
}

impl PoolScan<'_> {
    fn pipeline(&self, tail: Vec<Document>) -> Vec<Document> {
        let mut filter = self.filter.clone();
        filter.insert("pool", doc! {"$in": self.pools});
        let mut sort = Document::new();
        for field in self.index_order {
            sort.insert(*field, self.order.sign());
        }
        let budget = i64::try_from(self.budget.max(1)).unwrap_or(i64::MAX);
        let mut pipeline = vec![
            doc! {"$match": filter},
            doc! {"$sort": sort},
            doc! {"$limit": budget},
        ];
        pipeline.extend(tail);
        pipeline
    }
}

/// Matches per pool, as a [`PoolScan`] counted them.
pub(crate) struct PoolCounts {
    pub counts: HashMap<String, u64>,
    pub reach: Reach,
}

impl PoolCounts {
    /// The count of `pool`, if the scan answered it (counting up to
    /// `wanted` is enough).
    pub(crate) fn of(&self, pool: &str, wanted: u64) -> Option<u64> {
        let n = self.counts.get(pool).copied().unwrap_or(0);
        self.reach.answered(pool, n, wanted).then_some(n)
    }
}

impl Store {
    /// Runs `scan` and counts its matches per pool, in the index alone
    /// when the index covers the filter.
    pub(crate) async fn count_pools(&self, scan: &PoolScan<'_>) -> Result<PoolCounts, StoreError> {
        let group = doc! {"$group": {"_id": "$pool", "n": {"$sum": 1}}};
        let rows: Vec<Document> = self
            .collection(CODES)
            .aggregate(scan.pipeline(vec![group]))
            .batch_size(crate::one_batch_for(scan.pools.len()))
            .await?
            .try_collect()
            .await?;
        let mut counts = HashMap::with_capacity(rows.len());
        for r in rows {
            let (Ok(pool), n) = (r.get_str("_id"), as_u64(r.get("n"))) else {
                return Err(StoreError::Corrupt {
                    collection: CODES.into(),
                    message: format!("a count of several pools answered {r}"),
                });
            };
            counts.insert(pool.to_owned(), n);
        }
        let spent = counts.values().fold(0, |a: u64, n| a.saturating_add(*n));
        let last = scan.order.furthest(counts.keys().map(String::as_str));
        let reach = Reach::new(scan.order, spent, scan.budget, last);
        Ok(PoolCounts { counts, reach })
    }
}

/// Runs `once` (one budgeted scan of the given asks, answering each with
/// `Some` or leaving it `None`) over `pending`, then again over what it
/// left while [`worth_another_scan`], up to [`SCANS_MOST`] scans. Returns
/// the answers, and the asks still unanswered.
pub(crate) async fn rescanning<T, F, Fut>(
    mut pending: Vec<usize>,
    mut once: F,
) -> Result<(Vec<(usize, T)>, Vec<usize>), StoreError>
where
    F: FnMut(Vec<usize>) -> Fut,
    Fut: std::future::Future<Output = Result<Vec<(usize, Option<T>)>, StoreError>>,
{
    let mut answered = Vec::with_capacity(pending.len());
    for _ in 0..SCANS_MOST {
        let scanned = pending.len();
        let mut left = Vec::new();
        for (i, answer) in once(pending).await? {
            match answer {
                Some(a) => answered.push((i, a)),
                None => left.push(i),
            }
        }
        pending = left;
        if !worth_another_scan(scanned, pending.len()) {
            break;
        }
    }
    Ok((answered, pending))
}

impl Store {
    /// Per pool of `pools` (aligned), its matches of `filter` counted up to
    /// at least `wanted[i]`, by budgeted scans in `order` along
    /// `index_order` ([`rescanning`]); `None` for a pool still unanswered.
    pub(crate) async fn count_each(
        &self,
        pools: &[&str],
        wanted: &[u64],
        filter: &Document,
        index_order: &[&str],
        order: PoolOrder,
    ) -> Result<Vec<Option<u64>>, StoreError> {
        let once = |pending: Vec<usize>| async move {
            let names: Vec<&str> = pending.iter().map(|&i| pools[i]).collect();
            let scan = PoolScan {
                pools: &names,
                filter: filter.clone(),
                index_order,
                order,
                budget: budget_of(pending.iter().map(|&i| wanted[i])),
            };
            let counted = self.count_pools(&scan).await?;
            Ok(pending
                .into_iter()
                .map(|i| (i, counted.of(pools[i], wanted[i])))
                .collect())
        };
        let (answered, _) = rescanning((0..pools.len()).collect(), once).await?;
        let mut counts = vec![None; pools.len()];
        for (i, n) in answered {
            counts[i] = Some(n);
        }
        Ok(counts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scan_within_its_budget_answers_every_pool() {
        let r = Reach::new(PoolOrder::Ascending, 9, 10, Some("m"));
        for pool in ["a", "m", "z"] {
            assert!(r.answered(pool, 0, 5));
        }
    }

    #[test]
    fn a_cut_scan_answers_the_pools_before_the_cut_and_enough_at_it() {
        let up = Reach::new(PoolOrder::Ascending, 10, 10, Some("m"));
        assert!(up.answered("a", 0, 5), "passed: an empty pool");
        assert!(up.answered("l", 2, 5), "passed: all it had");
        assert!(!up.answered("m", 2, 5), "cut short");
        assert!(up.answered("m", 5, 5), "cut, but found enough");
        assert!(!up.answered("n", 0, 5), "never reached");

        let down = Reach::new(PoolOrder::Descending, 10, 10, Some("m"));
        assert!(down.answered("z", 0, 5));
        assert!(!down.answered("m", 4, 5));
        assert!(!down.answered("a", 0, 5));
    }

    #[test]
    fn the_cut_is_at_the_pool_a_scan_reached_last() {
        let matched = ["b", "d", "a", "c"];
        assert_eq!(
            PoolOrder::Ascending.furthest(matched.into_iter()),
            Some("d")
        );
        assert_eq!(
            PoolOrder::Descending.furthest(matched.into_iter()),
            Some("a")
        );
        assert_eq!(PoolOrder::Ascending.furthest(std::iter::empty()), None);
    }

    #[test]
    fn budgets_saturate() {
        assert_eq!(
            budget_of([u64::MAX / 2, u64::MAX / 2, 5].into_iter()),
            u64::MAX
        );
        assert_eq!(budget_of([2, 3].into_iter()), 5);
    }

    #[test]
    fn another_scan_only_after_one_that_answered_half() {
        assert!(worth_another_scan(10, 5));
        assert!(!worth_another_scan(10, 6), "a run of big pools");
        assert!(!worth_another_scan(10, 0), "nothing left");
    }

    #[test]
    fn pool_names_compare_bytewise_like_mongodb() {
        // "Z" < "a" < "é" in UTF-8 bytes, whatever a locale would say.
        let up = Reach::new(PoolOrder::Ascending, 3, 3, Some("a"));
        assert!(up.answered("Z", 0, 1));
        assert!(!up.answered("é", 0, 1));
    }

    #[test]
    fn the_pipeline_sorts_along_the_index_and_stops_at_the_budget() {
        let scan = PoolScan {
            pools: &["a", "b"],
            filter: doc! {"status": 0},
            index_order: &["pool", "status", "seq"],
            order: PoolOrder::Descending,
            budget: 7,
        };
        let p = scan.pipeline(vec![]);
        assert_eq!(
            p,
            vec![
                doc! {"$match": {"status": 0, "pool": {"$in": ["a", "b"]}}},
                doc! {"$sort": {"pool": -1, "status": -1, "seq": -1}},
                doc! {"$limit": 7_i64},
            ]
        );
    }
}
