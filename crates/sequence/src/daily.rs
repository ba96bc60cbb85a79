//! Daily business numbers: `PREFIX + yyyyMMdd + counter`, the counter
//! restarting at `0001` every day in a configured time zone.
//!
//! The counter is padded to four digits and widens past 9999
//! (`G2026112010000`); it never wraps. Numbers from one process keep
//! increasing within a day; across processes they are unique, not gap-free.
//!
//! # Where the numbers come from
//!
//! Two stores count the same day: a MongoDB document
//! `sequences/{_id: "daily:<prefix>:<yyyyMMdd>", value}` and a Redis hash
//! `<key_prefix>:daily:{<prefix>}:<yyyyMMdd>` with fields `value`, `ceiling`
//! and `run_id`. MongoDB's `value` is the **reservation mark**: everything at
//! or below it has been given to someone. It only moves by `$inc` (or a
//! pipeline update that adds), so each reservation is an interval `(v - k, v]`
//! that no other reservation overlaps. Reservations are of two kinds:
//!
//! * a **lease**: an interval handed to Redis, which counts through it;
//! * a **direct issue**: numbers handed straight to a caller while Redis is
//!   unavailable (one `$inc` of `n`).
//!
//! In steady state a call is one Redis round trip: a Lua script increments
//! `value` by `n` if `value + n <= ceiling`, and sets the hash's expiry (48 h)
//! in the same atomic step, so the first call of a day needs no lock and has
//! no race. When the lease runs out, the process reserves the next one in
//! MongoDB and hands it to the script, which installs it and issues in the
//! same step. The next lease is reserved *conditionally*, only if MongoDB's
//! mark still equals the Redis ceiling, so it continues the current lease
//! exactly (the script then just raises `ceiling`) and the numbers stay
//! contiguous even when several processes run out at once: one wins, the
//! others wait a moment and find the lease installed. If that does not work
//! out after a few tries, the process reserves a lease above the mark
//! unconditionally and the script jumps to it.
//!
//! When Redis errors or does not answer within the timeout (300 ms by
//! default), the call is served by a direct issue from MongoDB, and Redis is
//! left alone for a second before being tried again.
//!
//! # Why no number is ever handed out twice
//!
//! 1. *Reservations are disjoint.* Every lease and every direct issue is an
//!    interval taken by one atomic increment of the same MongoDB field, so no
//!    two of them share a number, whichever process took them, and whether or
//!    not that process could reach Redis at the time. This is what makes a
//!    partial outage safe: a process that cannot reach Redis may issue from
//!    MongoDB while another one keeps issuing from Redis; their numbers come
//!    from different reservations.
//! 2. *Redis only issues inside leases.* The script issues `value + 1 ..=
//!    value + n` only when that is at most `ceiling`, and `(value, ceiling]`
//!    is always inside leases installed in this hash: a jump sets it to one
//!    fresh lease, an extension appends the lease that starts exactly at
//!    `ceiling`, and every other change only raises `value` (dropping
//!    numbers, which is always safe). A lost or expired hash reads as
//!    `(0, 0]`: nothing can be issued until a lease is installed. Each lease is
//!    sent to Redis once, by the process that reserved it, right after
//!    reserving it (the Redis client does not resend commands), so no lease
//!    is counted through twice.
//! 3. *Redis never goes back within a lease.* `value` only grows while the
//!    hash is written by the same Redis server process. A hash that comes back
//!    older than it was (a snapshot loaded at restart, a lagging replica
//!    promoted) was written by another incarnation: its `run_id` differs from
//!    the server's (read with `INFO` on every new connection and passed to the
//!    script), so the script drops the rest of that lease (`value :=
//!    ceiling`). Extending such a hash from its ceiling is still safe: the
//!    conditional reservation only succeeds if MongoDB's mark equals that
//!    ceiling, which means no lease beyond it was ever reserved, so nothing
//!    above it was issued before the rewind either.
//! 4. *Days are separate.* Every number carries its date, and each day has its
//!    own document and hash.
//!
//! Numbers from one process keep increasing: each process remembers the
//! highest number it handed out today (the *floor*). MongoDB's mark is above
//! every reservation, so a direct issue is above the floor; Redis gets the
//! floor too, and drops the rest of its lease when the floor is above it
//! (which happens after this process issued from MongoDB while Redis was
//! away), so the next number comes from a fresh lease above the mark.
//!
//! This relies on MongoDB keeping acknowledged writes (journaled,
//! majority-acknowledged on a replica set), and on Redis never rewinding a key
//! while the same server process runs, which holds for restarts, snapshot
//! loads and failovers alike.

mod redis_leases;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bson::{doc, Document};
use chrono_tz::Tz;
use codepool_redis::RedisTarget;
use mongodb::options::ReturnDocument;
use mongodb::{Collection, Database};

use self::redis_leases::{Lease, Outcome, Patience, RedisLeases, Unavailable};
use crate::clock::{Clock, SystemClock};
use crate::counters::{self, check_name, is_duplicate_key};
use crate::SequenceError;

/// Numbers one lease holds unless a batch asks for more.
pub const DEFAULT_LEASE_SIZE: u32 = 1_000;
/// Most numbers one [`DailyNumbers::next_n`] call may take.
pub const MAX_BATCH: u32 = 100_000;
/// How long a Redis call may take before MongoDB serves the numbers.
pub const DEFAULT_REDIS_TIMEOUT: Duration = Duration::from_millis(300);
/// How long Redis is left alone after it failed.
pub const DEFAULT_REDIS_RETRY_AFTER: Duration = Duration::from_secs(1);
/// Expiry of a day's Redis hash: the day itself plus a margin for clocks and zones.
pub const KEY_TTL: Duration = Duration::from_secs(48 * 3600);
/// Tries to continue the current lease before reserving one above everything.
const CONTIGUOUS_LEASE_ATTEMPTS: u32 = 3;
/// Pause before looking again for the lease another process just won.
const LEASE_RACE_PAUSE: Duration = Duration::from_millis(2);
/// Fresh leases tried before this call is served from MongoDB instead.
const FRESH_LEASE_ATTEMPTS: u32 = 2;
/// The counter has at least this many digits.
const MIN_DIGITS: usize = 4;

/// Hands out `PREFIX + yyyyMMdd + counter` numbers, unique across processes.
///
/// Cheap to clone; clones share the Redis connection and the per-process floor.
#[derive(Clone)]
pub struct DailyNumbers {
    counters: Collection<Document>,
    key_prefix: String,
    tz: Tz,
    clock: Arc<dyn Clock>,
    lease_size: u32,
    patience: Patience,
    shared: Arc<Shared>,
}

struct Shared {
    redis: Option<RedisLeases>,
    /// One lease reservation at a time in this process.
    lease_gate: tokio::sync::Mutex<()>,
    /// Highest counter handed out by this process, per prefix, for its day.
    floors: Mutex<HashMap<String, Floor>>,
}

struct Floor {
    day: String,
    last: u64,
}

/// Why the Redis route gave up on a call.
enum RedisRoute {
    /// Serve the call from MongoDB.
    FallBack(String),
    /// MongoDB failed while reserving a lease.
    Failed(SequenceError),
}

impl From<Unavailable> for RedisRoute {
    fn from(Unavailable(reason): Unavailable) -> Self {
        RedisRoute::FallBack(reason)
    }
}

impl From<SequenceError> for RedisRoute {
    fn from(err: SequenceError) -> Self {
        RedisRoute::Failed(err)
    }
}

impl DailyNumbers {
    /// Numbers counted in `redis` (when given) and MongoDB `db`, with Redis
    /// keys under `key_prefix`, days in time zone `tz`. Does no I/O.
    pub fn new(redis: Option<redis::Client>, db: Database, key_prefix: &str, tz: Tz) -> Self {
        Self::with_target(redis.map(RedisTarget::Server), db, key_prefix, tz)
    }

    /// Like [`DailyNumbers::new`] on one Redis server or a Redis Cluster.
    pub fn with_target(redis: Option<RedisTarget>, db: Database, key_prefix: &str, tz: Tz) -> Self {
        let redis = redis.map(|target| RedisLeases::new(target, KEY_TTL));
        DailyNumbers {
            counters: counters::collection(&db),
            key_prefix: key_prefix.to_owned(),
            tz,
            clock: Arc::new(SystemClock),
            lease_size: DEFAULT_LEASE_SIZE,
            patience: Patience {
                timeout: DEFAULT_REDIS_TIMEOUT,
                retry_after: DEFAULT_REDIS_RETRY_AFTER,
            },
            shared: Arc::new(Shared {
                redis,
                lease_gate: tokio::sync::Mutex::new(()),
                floors: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// Like [`DailyNumbers::new`] with a Redis URL, or a comma-separated
    /// list of them for a Redis Cluster (`None`: MongoDB only).
    pub fn from_url(
        redis_url: Option<&str>,
        db: Database,
        key_prefix: &str,
        tz: Tz,
    ) -> Result<Self, SequenceError> {
        let target = redis_url
            .map(|url| {
                RedisTarget::open(url, DEFAULT_REDIS_TIMEOUT).map_err(|source| {
                    SequenceError::RedisUrl {
                        url: url.to_owned(),
                        source,
                    }
                })
            })
            .transpose()?;
        Ok(Self::with_target(target, db, key_prefix, tz))
    }

    /// Reads the time from `clock` instead of the system clock.
    pub fn with_clock(mut self, clock: impl Clock + 'static) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// Numbers per lease (at least 1; a batch larger than this takes a lease
    /// of its own size).
    pub fn with_lease_size(mut self, lease_size: u32) -> Self {
        self.lease_size = lease_size.max(1);
        self
    }

    /// How long a Redis call may take before MongoDB serves the numbers, and
    /// how long Redis is left alone after it failed.
    pub fn with_redis_timeouts(mut self, timeout: Duration, retry_after: Duration) -> Self {
        self.patience = Patience {
            timeout,
            retry_after,
        };
        self
    }

    /// The time zone whose days the numbers follow.
    pub fn time_zone(&self) -> Tz {
        self.tz
    }

    /// The next number for `prefix`.
    pub async fn next(&self, prefix: &str) -> Result<String, SequenceError> {
        let mut numbers = self.next_n(prefix, 1).await?;
        numbers.pop().ok_or_else(|| SequenceError::Corrupt {
            id: daily_id(prefix, &self.today()),
            detail: "no number was issued".to_owned(),
        })
    }

    /// The next `n` numbers for `prefix`, consecutive and increasing, in one
    /// round trip (to Redis, or to MongoDB when Redis is unavailable).
    pub async fn next_n(&self, prefix: &str, n: u32) -> Result<Vec<String>, SequenceError> {
        check_name("number prefix", prefix)?;
        if !(1..=MAX_BATCH).contains(&n) {
            return Err(SequenceError::InvalidCount {
                count: u64::from(n),
                max: u64::from(MAX_BATCH),
            });
        }
        let day = self.today();
        let n = u64::from(n);
        let floor = self.floor(prefix, &day);
        let last = self.issue(prefix, &day, n, floor).await?;
        self.raise_floor(prefix, &day, last);
        Ok((last + 1 - n..=last)
            .map(|counter| format_daily_number(prefix, &day, counter))
            .collect())
    }

    /// `yyyyMMdd` of the clock's current instant in the configured time zone.
    fn today(&self) -> String {
        self.clock
            .now()
            .with_timezone(&self.tz)
            .format("%Y%m%d")
            .to_string()
    }

    /// Takes `n` consecutive counters above `floor`; returns the last one.
    async fn issue(
        &self,
        prefix: &str,
        day: &str,
        n: u64,
        floor: u64,
    ) -> Result<u64, SequenceError> {
        let id = daily_id(prefix, day);
        if let Some(redis) = &self.shared.redis {
            let key = format!("{}:daily:{{{prefix}}}:{day}", self.key_prefix);
            match self.issue_from_redis(redis, &key, &id, n, floor).await {
                Ok(last) => return Ok(last),
                Err(RedisRoute::Failed(err)) => return Err(err),
                Err(RedisRoute::FallBack(reason)) => {
                    tracing::debug!(%id, %reason, "daily number served by MongoDB");
                }
            }
        }
        self.reserve(&id, n, "issuing daily numbers from MongoDB")
            .await
    }

    async fn issue_from_redis(
        &self,
        redis: &RedisLeases,
        key: &str,
        id: &str,
        n: u64,
        floor: u64,
    ) -> Result<u64, RedisRoute> {
        if let Outcome::Issued { last } = redis.issue(key, n, floor, None, self.patience).await? {
            return Ok(last);
        }
        // The lease is used up: reserve the next one, one caller per process.
        let _gate = self.shared.lease_gate.lock().await;
        let mut ceiling = match redis.issue(key, n, floor, None, self.patience).await? {
            Outcome::Issued { last } => return Ok(last),
            Outcome::Exhausted { ceiling } => ceiling,
        };
        let size = n.max(u64::from(self.lease_size));
        for attempt in 1..=CONTIGUOUS_LEASE_ATTEMPTS {
            let lease = self.reserve_lease_at(id, ceiling, size).await?;
            if lease.is_none() {
                // Another process may have won this lease and be installing it.
                tokio::time::sleep(LEASE_RACE_PAUSE * attempt).await;
            }
            match redis.issue(key, n, floor, lease, self.patience).await? {
                Outcome::Issued { last } => return Ok(last),
                Outcome::Exhausted { ceiling: now } => ceiling = now,
            }
        }
        for _ in 0..FRESH_LEASE_ATTEMPTS {
            let last = self
                .reserve(id, size, "reserving a lease of daily numbers")
                .await?;
            let lease = Lease {
                start: last - size,
                end: last,
            };
            if let Outcome::Issued { last } = redis
                .issue(key, n, floor, Some(lease), self.patience)
                .await?
            {
                return Ok(last);
            }
        }
        Err(RedisRoute::FallBack(
            "other processes kept installing newer leases".to_owned(),
        ))
    }

    /// Reserves `k` numbers above the mark with one `$inc`; returns the new mark.
    async fn reserve(&self, id: &str, k: u64, action: &'static str) -> Result<u64, SequenceError> {
        let k = i64::try_from(k).map_err(|_| SequenceError::InvalidCount {
            count: k,
            max: u64::from(MAX_BATCH),
        })?;
        let update = doc! { "$inc": { "value": k } };
        let doc = self
            .upsert(id, update, ReturnDocument::After, action)
            .await?;
        let mark = doc
            .as_ref()
            .map(|d| counters::required_value(d, id))
            .transpose()?
            .unwrap_or(0);
        if mark < k {
            return Err(SequenceError::Corrupt {
                id: id.to_owned(),
                detail: format!("`value` {mark} is below the {k} numbers just added"),
            });
        }
        Ok(mark as u64)
    }

    /// Reserves `(ceiling, ceiling + size]` only if the mark is still at
    /// `ceiling`, in one pipeline update; `None` if someone reserved first.
    async fn reserve_lease_at(
        &self,
        id: &str,
        ceiling: u64,
        size: u64,
    ) -> Result<Option<Lease>, SequenceError> {
        let (Ok(at), Ok(len)) = (i64::try_from(ceiling), i64::try_from(size)) else {
            return Ok(None);
        };
        let mark = doc! { "$ifNull": ["$value", 0_i64] };
        let pipeline = vec![doc! {
            "$set": {
                "value": {
                    "$cond": [
                        { "$eq": [mark.clone(), at] },
                        { "$add": [mark.clone(), len] },
                        mark,
                    ]
                }
            }
        }];
        let before = self
            .upsert(
                id,
                pipeline,
                ReturnDocument::Before,
                "reserving a lease of daily numbers",
            )
            .await?;
        // No document before: the mark was 0.
        let before = match before {
            Some(doc) => counters::value_of(&doc, id)?.unwrap_or(0),
            None => 0,
        };
        Ok((before == at).then_some(Lease {
            start: ceiling,
            end: ceiling + size,
        }))
    }

    /// One `findOneAndUpdate` upsert on the day's document, retried once if
    /// two processes created the document at the same moment.
    async fn upsert(
        &self,
        id: &str,
        update: impl Into<mongodb::options::UpdateModifications> + Clone,
        returned: ReturnDocument,
        action: &'static str,
    ) -> Result<Option<Document>, SequenceError> {
        let mut retried = false;
        loop {
            let result = self
                .counters
                .find_one_and_update(doc! { "_id": id }, update.clone())
                .upsert(true)
                .return_document(returned.clone())
                .await;
            match result {
                Ok(doc) => return Ok(doc),
                Err(err) if is_duplicate_key(&err) && !retried => retried = true,
                Err(err) => return Err(SequenceError::mongo(action)(err)),
            }
        }
    }

    fn floor(&self, prefix: &str, day: &str) -> u64 {
        let floors = self
            .shared
            .floors
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        floors
            .get(prefix)
            .filter(|f| f.day == day)
            .map_or(0, |f| f.last)
    }

    fn raise_floor(&self, prefix: &str, day: &str, last: u64) {
        let mut floors = self
            .shared
            .floors
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match floors.get_mut(prefix) {
            Some(floor) if floor.day == day => floor.last = floor.last.max(last),
            _ => {
                floors.insert(
                    prefix.to_owned(),
                    Floor {
                        day: day.to_owned(),
                        last,
                    },
                );
            }
        }
    }
}

/// `_id` of the MongoDB counter for `prefix` on `day`.
fn daily_id(prefix: &str, day: &str) -> String {
    format!("daily:{prefix}:{day}")
}

/// `prefix + day + counter`, the counter zero-padded to at least four digits.
pub fn format_daily_number(prefix: &str, day: &str, counter: u64) -> String {
    format!("{prefix}{day}{counter:0width$}", width = MIN_DIGITS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_counter_is_padded_to_four_digits() {
        assert_eq!(format_daily_number("G", "20261120", 1), "G202611200001");
        assert_eq!(format_daily_number("GX", "20261120", 42), "GX202611200042");
        assert_eq!(format_daily_number("G", "20261120", 9999), "G202611209999");
    }

    #[test]
    fn past_9999_the_counter_widens_and_never_wraps() {
        assert_eq!(
            format_daily_number("G", "20261120", 10_000),
            "G2026112010000"
        );
        assert_eq!(
            format_daily_number("G", "20261120", 1_234_567),
            "G202611201234567"
        );
    }
}
