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
        if k == 0 {
            return Ok((Vec::new(), self.len(pool).await?));
        }
        let key = self.key(pool, "hot");
        let (raw, remaining): (Vec<(String, f64)>, u64) = self
            .run(|mut c| async move {
                redis::pipe()
                    .zpopmin(&key, k as isize)
                    .zcard(&key)
                    .query_async(&mut c)
                    .await
            })
            .await?;
        let got = raw
            .into_iter()
            .map(|(id, score)| Candidate {
                id,
                seq: score as i64,
            })
            .collect();
        Ok((got, remaining))
    }

    /// [`HotPool::pop`] for several pools in one round trip: a pipeline of
    /// `ZPOPMIN` + `ZCARD` per pool (each pool's keys share its hash tag).
    /// Results are aligned with `wants`; a `k` of 0 pops nothing.
    pub async fn pop_many(
        &self,
        wants: &[(&str, usize)],
    ) -> Result<Vec<(Vec<Candidate>, u64)>, HotPoolError> {
        if wants.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<(String, usize)> = wants
            .iter()
            .map(|(pool, k)| (self.key(pool, "hot"), *k))
            .collect();
        let raw: Vec<redis::Value> = self
            .run(|mut c| async move {
                let mut pipe = redis::pipe();
                for (key, k) in &keys {
                    pipe.zpopmin(key, *k as isize).zcard(key);
                }
                pipe.query_async(&mut c).await
            })
            .await?;
        let mut out = Vec::with_capacity(wants.len());
        for pair in raw.chunks(2) {
            let [popped, left] = pair else {
                return Err(HotPoolError::Unavailable("short pipeline reply".into()));
            };
            let popped: Vec<(String, f64)> = redis::from_redis_value(popped)
                .map_err(|e| HotPoolError::Unavailable(e.to_string()))?;
            let left: u64 = redis::from_redis_value(left)
                .map_err(|e| HotPoolError::Unavailable(e.to_string()))?;
            let got = popped
                .into_iter()
                .map(|(id, score)| Candidate {
                    id,
                    seq: score as i64,
                })
                .collect();
            out.push((got, left));
        }
        if out.len() != wants.len() {
            return Err(HotPoolError::Unavailable("short pipeline reply".into()));
        }
        Ok(out)
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
        let raw: Vec<redis::Value> = self
            .run(|mut c| {
                let asks = &asks;
                async move {
                    let mut pipe = redis::pipe();
                    for [lock, token, hwm, hot] in asks {
                        pipe.cmd("SET")
                            .arg(lock)
                            .arg(token)
                            .arg("NX")
                            .arg("PX")
                            .arg(ms);
                        pipe.get(hwm).zcard(hot);
                    }
                    pipe.query_async(&mut c).await
                }
            })
            .await?;
        if raw.len() != 3 * asks.len() {
            return Err(HotPoolError::Unavailable("short pipeline reply".into()));
        }
        let parse = |e: redis::RedisError| HotPoolError::Unavailable(e.to_string());
        let mut out = Vec::with_capacity(asks.len());
        for ([key, token, ..], reply) in asks.into_iter().zip(raw.chunks(3)) {
            let [locked, hwm, waiting] = reply else {
                unreachable!("chunks of 3")
            };
            if *locked == redis::Value::Nil {
                out.push(None);
                continue;
            }
            let hwm: Option<i64> = redis::from_redis_value(hwm).map_err(parse)?;
            out.push(Some(HeldRefill {
                lock: RefillLock { key, token },
                hwm: hwm.unwrap_or(0),
                waiting: redis::from_redis_value(waiting).map_err(parse)?,
            }));
        }
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
        self.run(|mut c| {
            let calls = &calls;
            async move {
                let mut pipe = redis::pipe();
                for (hot, hwm, f) in calls {
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
                    call.ignore();
                }
                pipe.query_async::<()>(&mut c).await
            }
        })
        .await
    }
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
