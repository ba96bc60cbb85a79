//! Ids handed out from memory, out of ranges reserved in MongoDB.
//!
//! A process reserves `step` ids with one atomic `$inc` on the document
//! `sequences/{_id: "segment:<name>"}`: the new `value` `v` makes the range
//! `v - step + 1 ..= v` its own, and no other process can ever get an id of it.
//! Ids are then handed out from memory. Once 10% of the current range is used,
//! a background task reserves the next range (double buffer), so callers only
//! wait on MongoDB when they drain a whole range faster than one round trip.
//!
//! Ids left in memory when the process exits are lost: ids are unique and
//! increasing per process, not gap-free. The counter never wraps: a range that
//! would pass `i64::MAX` is refused with [`SequenceError::Exhausted`].

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use bson::{doc, Document};
use mongodb::options::ReturnDocument;
use mongodb::{Collection, Database};

use crate::counters::{self, check_name, is_duplicate_key};
use crate::SequenceError;

/// The step used when none is chosen.
pub const DEFAULT_STEP: u32 = 1_000;
/// The largest step accepted.
pub const MAX_STEP: u32 = 100_000;
/// Share of a range used before the next one is reserved in the background.
const PREFETCH_AT_PERCENT: u64 = 10;
/// Most ids one [`SegmentAllocator::next_n`] call may take.
pub const MAX_BATCH: usize = 1_000_000;

/// Hands out unique `u64` ids, reserving them from MongoDB `step` at a time.
///
/// Cheap to clone; clones share the ranges. Safe to use from many tasks and,
/// through the shared MongoDB document, from many processes.
#[derive(Clone)]
pub struct SegmentAllocator {
    inner: Arc<Inner>,
}

struct Inner {
    name: String,
    id: String,
    step: u32,
    counters: Collection<Document>,
    ranges: Mutex<Ranges>,
    /// Held while reserving a range, so one process reserves one at a time.
    reserving: tokio::sync::Mutex<()>,
}

/// The range being handed out and the one reserved behind it.
#[derive(Default)]
struct Ranges {
    current: Option<Range>,
    spare: Option<Range>,
    prefetching: bool,
}

#[derive(Debug, Clone, Copy)]
struct Range {
    next: u64,
    last: u64,
    /// Handing out this id starts the reservation of the next range.
    prefetch_at: u64,
}

impl Range {
    fn new(first: u64, last: u64) -> Self {
        let len = last - first + 1;
        let before_prefetch = (len * PREFETCH_AT_PERCENT).div_ceil(100).max(1);
        Range {
            next: first,
            last,
            prefetch_at: first + before_prefetch - 1,
        }
    }

    fn is_empty(&self) -> bool {
        self.next > self.last
    }
}

impl Ranges {
    /// Moves up to `want - out.len()` ids into `out`; returns true when the
    /// caller should start reserving the next range in the background.
    fn take(&mut self, want: usize, out: &mut Vec<u64>) -> bool {
        while out.len() < want {
            match self.current.as_mut() {
                Some(range) if !range.is_empty() => {
                    let available = range.last - range.next + 1;
                    let count = available.min((want - out.len()) as u64);
                    out.extend(range.next..range.next + count);
                    range.next += count;
                }
                _ => match self.spare.take() {
                    Some(spare) => self.current = Some(spare),
                    None => break,
                },
            }
        }
        let past_threshold = self
            .current
            .is_some_and(|range| range.next > range.prefetch_at);
        if past_threshold && self.spare.is_none() && !self.prefetching {
            self.prefetching = true;
            return true;
        }
        false
    }

    fn has_ids(&self) -> bool {
        self.current.is_some_and(|r| !r.is_empty()) || self.spare.is_some()
    }

    fn install(&mut self, range: Range) {
        if self.current.is_some_and(|r| !r.is_empty()) {
            self.spare = Some(range);
        } else {
            self.current = Some(range);
        }
    }
}

impl SegmentAllocator {
    /// An allocator for sequence `name` that reserves `step` ids at a time
    /// (`1..=MAX_STEP`). Does no I/O until the first id is drawn.
    pub fn new(db: Database, name: &str, step: u32) -> Result<Self, SequenceError> {
        check_name("sequence name", name)?;
        if !(1..=MAX_STEP).contains(&step) {
            return Err(SequenceError::InvalidStep {
                step,
                max: MAX_STEP,
            });
        }
        Ok(SegmentAllocator {
            inner: Arc::new(Inner {
                name: name.to_owned(),
                id: format!("segment:{name}"),
                step,
                counters: counters::collection(&db),
                ranges: Mutex::new(Ranges::default()),
                reserving: tokio::sync::Mutex::new(()),
            }),
        })
    }

    /// The sequence name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// How many ids one reservation takes.
    pub fn step(&self) -> u32 {
        self.inner.step
    }

    /// The next id.
    pub async fn next(&self) -> Result<u64, SequenceError> {
        let ids = self.next_n(1).await?;
        ids.first().copied().ok_or_else(|| SequenceError::Corrupt {
            id: self.inner.id.clone(),
            detail: "no id was reserved".to_owned(),
        })
    }

    /// The next `n` ids, increasing (not necessarily contiguous).
    pub async fn next_n(&self, n: usize) -> Result<Vec<u64>, SequenceError> {
        if !(1..=MAX_BATCH).contains(&n) {
            return Err(SequenceError::InvalidCount {
                count: n as u64,
                max: MAX_BATCH as u64,
            });
        }
        let mut out = Vec::with_capacity(n);
        loop {
            let prefetch = self.inner.ranges().take(n, &mut out);
            if prefetch {
                self.spawn_prefetch();
            }
            if out.len() == n {
                return Ok(out);
            }
            self.refill().await?;
        }
    }

    /// Reserves the next range in a background task.
    fn spawn_prefetch(&self) {
        let inner = Arc::clone(&self.inner);
        tokio::spawn(async move {
            let _reserving = inner.reserving.lock().await;
            {
                let mut ranges = inner.ranges();
                if ranges.spare.is_some() {
                    ranges.prefetching = false;
                    return;
                }
            }
            let reserved = inner.reserve().await;
            let mut ranges = inner.ranges();
            ranges.prefetching = false;
            match reserved {
                Ok(range) => ranges.install(range),
                // The caller that drains the range will reserve again and see the error.
                Err(err) => {
                    tracing::warn!(sequence = %inner.name, %err, "prefetching the next id range failed")
                }
            }
        });
    }

    /// Slow path: the ranges in memory are used up; reserve one and wait for it.
    async fn refill(&self) -> Result<(), SequenceError> {
        let _reserving = self.inner.reserving.lock().await;
        if self.inner.ranges().has_ids() {
            // Someone else (maybe the prefetch task) reserved while we waited.
            return Ok(());
        }
        let range = self.inner.reserve().await?;
        self.inner.ranges().install(range);
        Ok(())
    }
}

impl Inner {
    fn ranges(&self) -> MutexGuard<'_, Ranges> {
        // The guarded data stays consistent even if a holder panicked.
        self.ranges.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// One atomic `$inc`: the returned value `v` makes `v - step + 1 ..= v` ours.
    ///
    /// The filter only matches while the increment cannot pass `i64::MAX`.
    /// When it does not match, the upsert tries to insert an existing `_id`
    /// and fails with E11000, which also happens when two processes create the
    /// document at the same moment: one retry tells the two apart.
    async fn reserve(&self) -> Result<Range, SequenceError> {
        let step = i64::from(self.step);
        let filter = doc! { "_id": &self.id, "value": { "$not": { "$gt": i64::MAX - step } } };
        let update = doc! { "$inc": { "value": step } };
        let mut attempt = 0;
        let doc = loop {
            attempt += 1;
            let result = self
                .counters
                .find_one_and_update(filter.clone(), update.clone())
                .upsert(true)
                .return_document(ReturnDocument::After)
                .await;
            match result {
                Ok(Some(doc)) => break doc,
                Ok(None) => {
                    return Err(SequenceError::Corrupt {
                        id: self.id.clone(),
                        detail: "the upsert returned no document".to_owned(),
                    })
                }
                Err(err) if is_duplicate_key(&err) && attempt == 1 => continue,
                Err(err) if is_duplicate_key(&err) => return Err(self.explain_refusal().await),
                Err(err) => return Err(SequenceError::mongo("reserving an id range")(err)),
            }
        };
        let last = counters::required_value(&doc, &self.id)?;
        let first = last - step + 1;
        if first < 1 {
            return Err(SequenceError::Corrupt {
                id: self.id.clone(),
                detail: format!("`value` {last} is below the step {step}; ids must be positive"),
            });
        }
        Ok(Range::new(first as u64, last as u64))
    }

    /// The document exists but the reservation filter refused it: why?
    async fn explain_refusal(&self) -> SequenceError {
        let found = self.counters.find_one(doc! { "_id": &self.id }).await;
        match found {
            Ok(Some(doc)) => match counters::value_of(&doc, &self.id) {
                Ok(Some(_)) => SequenceError::Exhausted {
                    name: self.name.clone(),
                },
                Ok(None) => SequenceError::Corrupt {
                    id: self.id.clone(),
                    detail: "`value` is missing".to_owned(),
                },
                Err(err) => err,
            },
            Ok(None) => SequenceError::Corrupt {
                id: self.id.clone(),
                detail: "the document vanished while reserving".to_owned(),
            },
            Err(err) => SequenceError::mongo("reading a sequence document")(err),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefetch_starts_once_a_tenth_of_the_range_is_used() {
        let mut ranges = Ranges::default();
        ranges.install(Range::new(1, 100));
        let mut out = Vec::new();
        assert!(!ranges.take(9, &mut out));
        assert!(ranges.take(10, &mut out), "the 10th id starts the prefetch");
        assert!(!ranges.take(11, &mut out), "only one prefetch at a time");
        assert_eq!(out, (1..=11).collect::<Vec<_>>());
    }

    #[test]
    fn a_step_of_one_prefetches_at_once() {
        let mut ranges = Ranges::default();
        ranges.install(Range::new(7, 7));
        let mut out = Vec::new();
        assert!(ranges.take(1, &mut out));
        assert_eq!(out, vec![7]);
    }

    #[test]
    fn a_batch_spans_the_current_and_the_spare_range() {
        let mut ranges = Ranges::default();
        ranges.install(Range::new(1, 3));
        ranges.install(Range::new(11, 13));
        let mut out = Vec::new();
        ranges.take(5, &mut out);
        assert_eq!(out, vec![1, 2, 3, 11, 12]);
        assert!(ranges.has_ids());
        ranges.take(7, &mut out);
        assert_eq!(out.len(), 6, "only what is in memory");
        assert!(!ranges.has_ids());
    }
}
