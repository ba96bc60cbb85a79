//! # codepool-hotpool
//!
//! The hot pool: per pool, a Redis sorted set of candidate code ids scored
//! by `seq` (oldest first). Claimers take *distinct* candidates with
//! `ZPOPMIN`, so concurrent claimers do not all fight over the first
//! unissued document in MongoDB.
//!
//! Redis holds no truth here. A candidate is only a hint: MongoDB's
//! conditional update on `{_id, status: 0}` decides who owns a code. If Redis
//! is flushed, the set is rebuilt from MongoDB; if it is down, every call
//! returns [`HotPoolError::Unavailable`] quickly and the caller claims
//! straight from MongoDB. Outages are logged once, not once per call.
//!
//! Keys of one pool share a hash tag (`codepool:{game-x}:hot`), so every
//! pipeline and script stays in one hash slot and the module works on a
//! Redis Cluster too: give [`HotPool::new`] a comma-separated list of URLs.
//! A cluster that lost a master (no coverage for a pool's slot) is an outage
//! like any other for that pool: its claims go to MongoDB.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use codepool_redis::{RedisConnection, RedisTarget};
use redis::aio::ConnectionManagerConfig;
use redis::AsyncCommands;
use tokio::sync::Mutex;
use tracing::{info, warn};

/// How long one Redis call may take before the caller stops waiting and
/// falls back to MongoDB. Redis answers in well under a millisecond when it
/// is healthy, so this only bounds the damage of a sick one.
pub const OP_TIMEOUT: Duration = Duration::from_millis(500);

/// How often to try to reconnect while Redis is down.
const RECONNECT_EVERY: Duration = Duration::from_secs(1);

/// A code id offered to claimers, with its `seq` (its score in the set).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Candidate {
    /// The code document's `_id`, as 24 hex characters.
    pub id: String,
    pub seq: i64,
}

#[derive(Debug, thiserror::Error)]
pub enum HotPoolError {
    #[error("Redis is unavailable ({0}); claims fall back to MongoDB until it is back (check CODEPOOL_REDIS_URL and that redis-server runs)")]
    Unavailable(String),
    #[error("invalid Redis URL: {0}; use something like redis://127.0.0.1:6379 (a comma-separated list for a Redis Cluster)")]
    Config(String),
}

/// Proof of holding a pool's refill lock; released only by its holder
/// (the unlock compares `token`). Public so that in-memory stand-ins of the
/// hot pool can hand out locks of their own in tests.
#[derive(Debug)]
pub struct RefillLock {
    pub key: String,
    pub token: String,
}

/// The Redis hot pools of all pools, behind one connection (to one server or
/// to a Redis Cluster).
#[derive(Clone)]
pub struct HotPool {
    inner: Arc<Inner>,
}

struct Inner {
    target: RedisTarget,
    prefix: String,
    conn: Mutex<ConnState>,
    down: AtomicBool,
}

struct ConnState {
    conn: Option<RedisConnection>,
    last_attempt: Option<Instant>,
}

impl HotPool {
    /// Prepares the hot pool on `url`: one Redis URL, or several separated
    /// by commas for a Redis Cluster. Does not connect: Redis may be down at
    /// start, and the daemon must start anyway.
    pub fn new(url: &str, prefix: &str) -> Result<Self, HotPoolError> {
        let target =
            RedisTarget::open(url, OP_TIMEOUT).map_err(|e| HotPoolError::Config(e.to_string()))?;
        Ok(Self {
            inner: Arc::new(Inner {
                target,
                prefix: prefix.to_owned(),
                conn: Mutex::new(ConnState {
                    conn: None,
                    last_attempt: None,
                }),
                down: AtomicBool::new(false),
            }),
        })
    }

    /// True while the last Redis call failed: claims are on the fallback path.
    pub fn is_degraded(&self) -> bool {
        self.inner.down.load(Ordering::Relaxed)
    }

    fn key(&self, pool: &str, what: &str) -> String {
        format!("{}:{{{pool}}}:{what}", self.inner.prefix)
    }

    async fn connection(&self) -> Result<RedisConnection, HotPoolError> {
        let mut state = self.inner.conn.lock().await;
        if let Some(conn) = &state.conn {
            return Ok(conn.clone());
        }
        if let Some(at) = state.last_attempt {
            if at.elapsed() < RECONNECT_EVERY {
                return Err(HotPoolError::Unavailable("not connected".into()));
            }
        }
        state.last_attempt = Some(Instant::now());
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(OP_TIMEOUT)
            .set_response_timeout(OP_TIMEOUT)
            .set_number_of_retries(1)
            .set_max_delay(200);
        let conn =
            tokio::time::timeout(OP_TIMEOUT * 2, self.inner.target.connection_manager(config))
                .await
                .map_err(|_| HotPoolError::Unavailable("connect timed out".into()))?
                .map_err(|e| HotPoolError::Unavailable(e.to_string()))?;
        state.conn = Some(conn.clone());
        Ok(conn)
    }

    /// Runs one Redis call with a deadline and records the outage state.
    async fn run<T, F, Fut>(&self, f: F) -> Result<T, HotPoolError>
    where
        F: FnOnce(RedisConnection) -> Fut,
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        let result = match self.connection().await {
            Ok(conn) => match tokio::time::timeout(OP_TIMEOUT, f(conn)).await {
                Ok(Ok(v)) => Ok(v),
                Ok(Err(e)) => Err(HotPoolError::Unavailable(e.to_string())),
                Err(_) => Err(HotPoolError::Unavailable("timed out".into())),
            },
            Err(e) => Err(e),
        };
        match &result {
            Ok(_) => {
                if self.inner.down.swap(false, Ordering::Relaxed) {
                    info!("Redis is reachable again; claims use the hot pool");
                }
            }
            Err(e) => {
                if !self.inner.down.swap(true, Ordering::Relaxed) {
                    warn!(error = %e, "Redis unavailable; claims fall back to MongoDB until it returns");
                }
            }
        }
        result
    }

    /// Takes up to `k` distinct candidates, oldest first, and reports how
    /// many remain in the set (one round trip). Each candidate is handed to
    /// exactly one caller (until it is put back).
    pub async fn pop(&self, pool: &str, k: usize) -> Result<(Vec<Candidate>, u64), HotPoolError> {
        let mut popped = self.pop_many(&[(pool, k)]).await?;
        popped
            .pop()
            .ok_or_else(|| HotPoolError::Unavailable("short pipeline reply".into()))
    }

    /// [`HotPool::pop`] for several pools in one round trip: `ZPOPMIN` +
    /// `ZCARD` per pool ([`HotPool::per_pool`]). Results are aligned with
    /// `wants`; a `k` of 0 pops nothing.
    pub async fn pop_many(
        &self,
        wants: &[(&str, usize)],
    ) -> Result<Vec<(Vec<Candidate>, u64)>, HotPoolError> {
        let keys: Vec<(String, usize)> = wants
            .iter()
            .map(|(pool, k)| (self.key(pool, "hot"), *k))
            .collect();
        let replies = self
            .per_pool(keys.len(), 2, |pipe, i| {
                let (key, k) = &keys[i];
                pipe.zpopmin(key, *k as isize).zcard(key);
            })
            .await?;
        replies
            .into_iter()
            .map(|reply| {
                let [popped, left] = &reply[..] else {
                    return Err(HotPoolError::Unavailable("short pipeline reply".into()));
                };
                let popped: Vec<(String, f64)> = parse(popped)?;
                let got = popped
                    .into_iter()
                    .map(|(id, score)| Candidate {
                        id,
                        seq: score as i64,
                    })
                    .collect();
                Ok((got, parse(left)?))
            })
            .collect()
    }

    /// Runs `replies_each` commands for each of `n` pools (`add` appends
    /// pool `i`'s) and returns each pool's replies, in order, in one round
    /// trip: one pipeline on a single server; on a Redis Cluster, where a
    /// pipeline must stay in one hash slot, one pipeline per pool (a pool's
    /// keys share its hash tag), all sent at once.
    async fn per_pool(
        &self,
        n: usize,
        replies_each: usize,
        add: impl Fn(&mut redis::Pipeline, usize),
    ) -> Result<Vec<Vec<redis::Value>>, HotPoolError> {
        if n == 0 {
            return Ok(Vec::new());
        }
        let groups: Vec<std::ops::Range<usize>> = if self.inner.target.is_cluster() {
            (0..n).map(|i| i..i + 1).collect()
        } else {
            std::iter::once(0..n).collect()
        };
        let pipes: Vec<redis::Pipeline> = groups
            .into_iter()
            .map(|group| {
                let mut pipe = redis::pipe();
                group.for_each(|i| add(&mut pipe, i));
                pipe
            })
            .collect();
        let replies: Vec<Vec<redis::Value>> = self
            .run(|c| {
                let pipes = &pipes;
                async move {
                    futures::future::try_join_all(pipes.iter().map(|pipe| {
                        let mut c = c.clone();
                        async move { pipe.query_async::<Vec<redis::Value>>(&mut c).await }
                    }))
                    .await
                }
            })
            .await?;
        let flat: Vec<redis::Value> = replies.into_iter().flatten().collect();
        if flat.len() != n * replies_each {
            return Err(HotPoolError::Unavailable("short pipeline reply".into()));
        }
        Ok(flat.chunks(replies_each).map(<[_]>::to_vec).collect())
    }

    /// Returns candidates that were popped but not used.
    pub async fn put_back(&self, pool: &str, candidates: &[Candidate]) -> Result<(), HotPoolError> {
        if candidates.is_empty() {
            return Ok(());
        }
        let key = self.key(pool, "hot");
        let items: Vec<(f64, String)> = candidates
            .iter()
            .map(|c| (c.seq as f64, c.id.clone()))
            .collect();
        self.run(|mut c| async move { c.zadd_multiple::<_, _, _, ()>(key, &items).await })
            .await
    }

    /// Number of candidates waiting in the pool's set.
    pub async fn len(&self, pool: &str) -> Result<u64, HotPoolError> {
        let key = self.key(pool, "hot");
        self.run(|mut c| async move { c.zcard(key).await }).await
    }

    /// Drops candidates that must never be offered again (expired, voided).
    pub async fn remove(&self, pool: &str, ids: &[String]) -> Result<(), HotPoolError> {
        if ids.is_empty() {
            return Ok(());
        }
        let key = self.key(pool, "hot");
        let ids = ids.to_vec();
        self.run(|mut c| async move { c.zrem::<_, _, ()>(key, ids).await })
            .await
    }

    /// Tries to become the only refiller of each pool for `ttl`, and reads
    /// what a refiller needs once it holds a pool's lock, all in one round
    /// trip: per pool `SET lock NX PX`, then the largest `seq` ever loaded
    /// into its set (0 when unknown, for example after a flush: the refill
    /// then starts from the beginning) and how many candidates the set holds.
    /// Aligned with `pools`; `None` where another refiller holds the lock.
    pub async fn lock_refills(
        &self,
        pools: &[&str],
        ttl: Duration,
    ) -> Result<Vec<Option<HeldRefill>>, HotPoolError> {
        if pools.is_empty() {
            return Ok(Vec::new());
        }
        let asks: Vec<[String; 4]> = pools
            .iter()
            .map(|pool| {
                [
                    self.key(pool, "refill"),
                    format!("{:032x}", rand::random::<u128>()),
                    self.key(pool, "hwm"),
                    self.key(pool, "hot"),
                ]
            })
            .collect();
        let ms = ttl.as_millis() as u64;
        let sent = self
            .per_pool(asks.len(), 3, |pipe, i| {
                let [lock, token, hwm, hot] = &asks[i];
                pipe.cmd("SET")
                    .arg(lock)
                    .arg(token)
                    .arg("NX")
                    .arg("PX")
                    .arg(ms);
                pipe.get(hwm).zcard(hot);
            })
            .await;
        let replies = match sent {
            Ok(r) => r,
            Err(e) => {
                // Some locks may be set: give back whichever are ours.
                let _ = self.finish_refills(release_all(pools, asks)).await;
                return Err(e);
            }
        };
        let mut out = Vec::with_capacity(asks.len());
        let mut unreadable = Vec::new();
        for ((pool, [key, token, ..]), reply) in pools.iter().zip(asks).zip(replies) {
            let lock = RefillLock { key, token };
            let [locked, hwm, waiting] = &reply[..] else {
                unreachable!("three replies per pool")
            };
            if *locked == redis::Value::Nil {
                out.push(None);
                continue;
            }
            match (parse::<Option<i64>>(hwm), parse::<u64>(waiting)) {
                (Ok(hwm), Ok(waiting)) => out.push(Some(HeldRefill {
                    lock,
                    hwm: hwm.unwrap_or(0),
                    waiting,
                })),
                _ => {
                    // Not what codepool writes: leave the pool alone.
                    warn!(
                        pool,
                        "unreadable hot-pool state; this refill skips the pool"
                    );
                    unreadable.push(Refilled::release(pool, lock));
                    out.push(None);
                }
            }
        }
        let _ = self.finish_refills(unreadable).await;
        Ok(out)
    }

    /// Ends refills taken with [`HotPool::lock_refills`], in one round trip:
    /// per pool, one script adds the loaded candidates, raises the pool's
    /// high-water mark (never lowers it) and releases the lock if (and only
    /// if) this refiller still holds it. A lock that expired and was taken
    /// by another refiller is left alone.
    pub async fn finish_refills(&self, fills: Vec<Refilled>) -> Result<(), HotPoolError> {
        if fills.is_empty() {
            return Ok(());
        }
        let calls: Vec<(String, String, Refilled)> = fills
            .into_iter()
            .map(|f| (self.key(&f.pool, "hot"), self.key(&f.pool, "hwm"), f))
            .collect();
        self.per_pool(calls.len(), 1, |pipe, i| {
            let (hot, hwm, f) = &calls[i];
            let call = pipe
                .cmd("EVAL")
                .arg(FINISH_REFILL)
                .arg(3)
                .arg(hot)
                .arg(hwm)
                .arg(&f.lock.key)
                .arg(&f.lock.token)
                .arg(f.high_water_mark);
            for c in &f.candidates {
                call.arg(c.seq).arg(&c.id);
            }
        })
        .await
        .map(|_| ())
    }
}

/// A reply of the type codepool wrote, or "unavailable".
fn parse<T: redis::FromRedisValue>(v: &redis::Value) -> Result<T, HotPoolError> {
    redis::from_redis_value(v).map_err(|e| HotPoolError::Unavailable(e.to_string()))
}

/// Releases of every lock `lock_refills` tried to take (each released only
/// if it was taken: the release compares the token).
fn release_all(pools: &[&str], asks: Vec<[String; 4]>) -> Vec<Refilled> {
    pools
        .iter()
        .zip(asks)
        .map(|(pool, [key, token, ..])| Refilled::release(pool, RefillLock { key, token }))
        .collect()
}

/// KEYS: the pool's set, its high-water mark, its refill lock. ARGV: the
/// lock's token, the new mark, then score/member pairs. `ZADD` takes them
/// in slices: Lua's `unpack` is limited to a few thousand values.
const FINISH_REFILL: &str = r"
local i = 3
while i <= #ARGV do
  local j = math.min(i + 999, #ARGV)
  redis.call('ZADD', KEYS[1], unpack(ARGV, i, j))
  i = j + 1
end
if tonumber(redis.call('GET', KEYS[2]) or '0') < tonumber(ARGV[2]) then
  redis.call('SET', KEYS[2], ARGV[2])
end
if redis.call('GET', KEYS[3]) == ARGV[1] then
  redis.call('DEL', KEYS[3])
end
return 1
";

/// A pool's refill lock, with what its set looked like when it was taken.
#[derive(Debug)]
pub struct HeldRefill {
    pub lock: RefillLock,
    /// The largest `seq` ever loaded into the set (0: unknown).
    pub hwm: i64,
    /// Candidates waiting in the set.
    pub waiting: u64,
}

/// What a refill loaded into a pool's set, and the lock it releases.
/// Callers with candidates of their own type map them with [`Refilled::map`].
#[derive(Debug)]
pub struct Refilled<C = Candidate> {
    pub pool: String,
    pub candidates: Vec<C>,
    /// The largest `seq` loaded so far (the set's mark is never lowered).
    pub high_water_mark: i64,
    pub lock: RefillLock,
}

impl<C> Refilled<C> {
    /// A refill that loads nothing and only gives its lock back (the mark
    /// is never lowered, so none is needed).
    pub fn release(pool: &str, lock: RefillLock) -> Self {
        Refilled {
            pool: pool.to_owned(),
            candidates: Vec::new(),
            high_water_mark: 0,
            lock,
        }
    }

    /// The same refill with its candidates converted.
    pub fn map<D>(self, f: impl FnMut(C) -> D) -> Refilled<D> {
        Refilled {
            pool: self.pool,
            candidates: self.candidates.into_iter().map(f).collect(),
            high_water_mark: self.high_water_mark,
            lock: self.lock,
        }
    }
}
