//! How many codes each pool holds, known without counting them.
//!
//! Every insert reserves a range of `seq` values first
//! ([`Store::reserve_seq`]), and nothing is ever inserted into a range
//! again once its `insert_many` has returned, nor is a code ever deleted.
//! So when an insert returns, the number of codes in its range is final,
//! and [`Store::record_range`] writes it down in `code_ranges`.
//!
//! A pool's total is then the sum of its recorded ranges, plus a count of
//! the codes in the `seq` values no record covers: a batch still being
//! inserted, one whose process died before recording it, or codes inserted
//! before this ledger existed. Those gaps are counted from the
//! `(pool, status, seq)` index, so the total is exact either way; the
//! ledger only makes it cheap. Its cost is the number of ranges (one per
//! 1,000 imported codes) plus the gaps' codes, not the pool's size.

use bson::{doc, Bson, Document};
use futures::TryStreamExt;

use crate::codes::SEQUENCES;
use crate::collections::as_u64;
use crate::error::is_duplicate_key;
use crate::{Store, StoreError};

pub(crate) const CODE_RANGES: &str = "code_ranges";

/// One pool's recorded ranges, summed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Covered {
    /// Codes in the recorded ranges.
    codes: u64,
    /// `seq` values the recorded ranges span.
    span: u64,
}

impl Store {
    /// Records that `seq` values `first..=last` of `pool` hold exactly
    /// `codes` codes. Call it only after the insert into that range has
    /// returned. A record that fails to be written (or is written twice)
    /// costs speed, never exactness: its range is counted as a gap.
    pub(crate) async fn record_range(
        &self,
        pool: &str,
        first: i64,
        last: i64,
        codes: u64,
    ) -> Result<(), StoreError> {
        let record = doc! {"pool": pool, "first": first, "last": last, "codes": codes as i64};
        match self.collection(CODE_RANGES).insert_one(record).await {
            Ok(_) => Ok(()),
            Err(e) if is_duplicate_key(&e) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Every code `pool` holds, in any status: its recorded ranges plus an
    /// index count of the `seq` values no record covers.
    pub async fn codes_in_pool(&self, pool: &str) -> Result<u64, StoreError> {
        let last_seq = self.last_seq(pool).await?;
        if last_seq == 0 {
            return Ok(0);
        }
        // Ranges recorded after `last_seq` was read are left out, so a
        // range above it cannot stand in for a gap below it.
        let covered = self.covered(pool, last_seq).await?;
        if covered.span >= last_seq as u64 {
            return Ok(covered.codes);
        }
        let mut total = covered.codes;
        for (from, to) in self.gaps(pool, last_seq).await? {
            total += self.count_seq_range(pool, from, to).await?;
        }
        Ok(total)
    }

    /// The last `seq` value reserved in `pool` (0 when none was).
    async fn last_seq(&self, pool: &str) -> Result<i64, StoreError> {
        let d = self
            .collection(SEQUENCES)
            .find_one(doc! {"_id": format!("codes.seq:{pool}")})
            .await?;
        Ok(d.and_then(|d| d.get_i64("value").ok()).unwrap_or(0))
    }

    /// The ranges of `pool` up to `last_seq`, summed.
    async fn covered(&self, pool: &str, last_seq: i64) -> Result<Covered, StoreError> {
        let rows: Vec<Document> = self
            .collection(CODE_RANGES)
            .aggregate(vec![
                doc! {"$match": {"pool": pool, "last": {"$lte": last_seq}}},
                doc! {"$group": {
                    "_id": Bson::Null,
                    "codes": {"$sum": "$codes"},
                    "span": {"$sum": {"$add": [{"$subtract": ["$last", "$first"]}, 1_i64]}},
                }},
            ])
            .await?
            .try_collect()
            .await?;
        Ok(rows
            .first()
            .map(|d| Covered {
                codes: as_u64(d.get("codes")),
                span: as_u64(d.get("span")),
            })
            .unwrap_or_default())
    }

    /// The `seq` intervals in `1..=last_seq` no record covers, in order.
    async fn gaps(&self, pool: &str, last_seq: i64) -> Result<Vec<(i64, i64)>, StoreError> {
        let mut ranges = self
            .collection(CODE_RANGES)
            .find(doc! {"pool": pool, "last": {"$lte": last_seq}})
            .sort(doc! {"first": 1})
            .projection(doc! {"_id": 0, "first": 1, "last": 1})
            .await?;
        let mut gaps = Vec::new();
        let mut next = 1_i64;
        while let Some(r) = ranges.try_next().await? {
            let (Ok(first), Ok(last)) = (r.get_i64("first"), r.get_i64("last")) else {
                return Err(StoreError::Corrupt {
                    collection: CODE_RANGES.into(),
                    message: format!("a range of pool {pool} has no 64-bit first/last: {r}"),
                });
            };
            if first > next {
                gaps.push((next, first - 1));
            }
            next = next.max(last + 1);
        }
        if next <= last_seq {
            gaps.push((next, last_seq));
        }
        Ok(gaps)
    }

    /// Codes of `pool` with `seq` in `from..=to`, any status, counted on
    /// the `(pool, status, seq)` index without reading a document.
    async fn count_seq_range(&self, pool: &str, from: i64, to: i64) -> Result<u64, StoreError> {
        let mut n = 0;
        for status in 0..=3 {
            n += self
                .count_scan(
                    doc! {"pool": pool, "status": status, "seq": {"$gte": from, "$lte": to}},
                )
                .await?;
        }
        Ok(n)
    }
}
