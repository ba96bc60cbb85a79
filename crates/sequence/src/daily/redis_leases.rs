//! The Redis half of the daily numbers: a counter that may only count inside
//! leases reserved in MongoDB.
//!
//! Each day and prefix has one hash with three fields:
//! `value` (the last number handed out), `ceiling` (the end of the lease being
//! used) and `run_id` (the Redis server incarnation that last wrote it). One
//! Lua script reads and writes it atomically; see the parent module for why
//! this never repeats a number.
//!
//! On one server the run id is read once per connection and passed to the
//! script. On a Redis Cluster the hash lives on whichever master serves its
//! slot, which changes with failovers without the connection changing, so
//! the script reads the run id of the server that runs it (`INFO server`).

use std::time::Duration;

use codepool_redis::{RedisConnection, RedisTarget};
use redis::AsyncConnectionConfig;
use tokio::time::Instant;

/// A range of numbers `(start, end]` reserved in MongoDB for Redis to count in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Lease {
    pub start: u64,
    pub end: u64,
}

/// What the script did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Numbers `last - n + 1 ..= last` are ours.
    Issued { last: u64 },
    /// The lease in Redis has fewer than `n` numbers left (or none was installed).
    Exhausted { ceiling: u64 },
}

/// Redis could not be used for this call; the caller falls back to MongoDB.
#[derive(Debug)]
pub(crate) struct Unavailable(pub String);

/// The issue script. Keys and arguments:
/// `KEYS[1]` the day's hash; `ARGV` = n, floor, run_id (empty: this
/// server's), ttl seconds, lease start, lease end (`0 0` when no lease is offered).
const ISSUE_SCRIPT: &str = r#"
local key = KEYS[1]
local n = tonumber(ARGV[1])
local floor = tonumber(ARGV[2])
local run_id = ARGV[3]
if run_id == '' then
  run_id = string.match(redis.call('INFO', 'server'), 'run_id:(%w+)')
end
local ttl = tonumber(ARGV[4])
local lease_start = tonumber(ARGV[5])
local lease_end = tonumber(ARGV[6])

local state = redis.call('HMGET', key, 'value', 'ceiling', 'run_id')
local value = tonumber(state[1]) or 0
local ceiling = tonumber(state[2]) or 0

-- Written by another server incarnation (restored snapshot, promoted replica):
-- the rest of its lease may have been handed out already, so drop it.
if state[3] and state[3] ~= run_id then value = ceiling end
-- The caller already handed out a number above this one (from MongoDB):
-- drop the rest of the lease so its numbers keep increasing.
if value < floor then value = ceiling end

if lease_end > ceiling then
  -- A lease right behind the current one extends it; any other starts afresh.
  if lease_start ~= ceiling then value = lease_start end
  ceiling = lease_end
end

local issued = 0
if value + n <= ceiling then
  value = value + n
  issued = 1
end
redis.call('HSET', key, 'value', string.format('%d', value),
  'ceiling', string.format('%d', ceiling), 'run_id', run_id)
if redis.call('TTL', key) == -1 then redis.call('EXPIRE', key, ttl) end
if issued == 1 then return {1, value} end
return {0, ceiling}
"#;

/// How patient to be with Redis.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Patience {
    /// Longest wait for a connection or a reply.
    pub timeout: Duration,
    /// How long Redis is left alone after it failed.
    pub retry_after: Duration,
}

/// One Redis server (or a Redis Cluster), with the connection used to reach it.
pub(crate) struct RedisLeases {
    target: RedisTarget,
    script: redis::Script,
    key_ttl: Duration,
    link: tokio::sync::Mutex<Link>,
}

#[derive(Default)]
struct Link {
    live: Option<Live>,
    generation: u64,
    /// Do not try Redis again before this instant.
    down_until: Option<Instant>,
}

#[derive(Clone)]
struct Live {
    conn: RedisConnection,
    /// Empty on a cluster: the script asks the server that runs it.
    run_id: String,
    generation: u64,
}

impl RedisLeases {
    pub(crate) fn new(target: RedisTarget, key_ttl: Duration) -> Self {
        RedisLeases {
            target,
            script: redis::Script::new(ISSUE_SCRIPT),
            key_ttl,
            link: tokio::sync::Mutex::new(Link::default()),
        }
    }

    /// Runs the issue script once: takes `n` numbers above `floor`, after
    /// installing `lease` if one is given.
    pub(crate) async fn issue(
        &self,
        key: &str,
        n: u64,
        floor: u64,
        lease: Option<Lease>,
        patience: Patience,
    ) -> Result<Outcome, Unavailable> {
        let mut live = self.connection(patience).await?;
        let lease = lease.unwrap_or(Lease { start: 0, end: 0 });
        let mut invocation = self.script.key(key);
        invocation
            .arg(n)
            .arg(floor)
            .arg(&live.run_id)
            .arg(self.key_ttl.as_secs().max(1))
            .arg(lease.start)
            .arg(lease.end);
        let reply = tokio::time::timeout(
            patience.timeout,
            invocation.invoke_async::<Vec<i64>>(&mut live.conn),
        )
        .await;
        let reason = match reply {
            Ok(Ok(reply)) => match reply.as_slice() {
                [1, last] if *last > 0 => return Ok(Outcome::Issued { last: *last as u64 }),
                [0, ceiling] if *ceiling >= 0 => {
                    return Ok(Outcome::Exhausted {
                        ceiling: *ceiling as u64,
                    })
                }
                other => format!("unexpected script reply {other:?}"),
            },
            Ok(Err(err)) => err.to_string(),
            Err(_) => format!("no reply within {:?}", patience.timeout),
        };
        // A command that timed out may still run on the server; the numbers it
        // took are lost, never handed out twice. Drop the connection anyway:
        // a late reply must not be read as the answer to the next command.
        self.mark_down(live.generation, &reason, patience).await;
        Err(Unavailable(reason))
    }

    /// The live connection, connecting (and learning the server's run id) if needed.
    async fn connection(&self, patience: Patience) -> Result<Live, Unavailable> {
        let mut link = self.link.lock().await;
        if let Some(live) = &link.live {
            return Ok(live.clone());
        }
        if link.down_until.is_some_and(|until| Instant::now() < until) {
            return Err(Unavailable("Redis was unavailable moments ago".to_owned()));
        }
        match tokio::time::timeout(patience.timeout, self.connect(patience.timeout)).await {
            Ok(Ok((conn, run_id))) => {
                if link.down_until.take().is_some() {
                    tracing::info!(run_id = %run_id, "Redis is reachable again; daily numbers use it again");
                }
                link.generation += 1;
                let live = Live {
                    conn,
                    run_id,
                    generation: link.generation,
                };
                link.live = Some(live.clone());
                Ok(live)
            }
            Ok(Err(err)) => Err(went_down(&mut link, err.to_string(), patience)),
            Err(_) => Err(went_down(
                &mut link,
                format!("no connection within {:?}", patience.timeout),
                patience,
            )),
        }
    }

    async fn connect(&self, timeout: Duration) -> redis::RedisResult<(RedisConnection, String)> {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(timeout)
            .set_response_timeout(timeout);
        let mut conn = self.target.multiplexed(&config).await?;
        if self.target.is_cluster() {
            return Ok((conn, String::new()));
        }
        let info: String = redis::cmd("INFO")
            .arg("server")
            .query_async(&mut conn)
            .await?;
        let run_id = info
            .lines()
            .find_map(|line| line.trim().strip_prefix("run_id:"))
            .map(str::to_owned)
            .ok_or_else(|| {
                redis::RedisError::from((
                    redis::ErrorKind::ResponseError,
                    "INFO server has no run_id",
                ))
            })?;
        Ok((conn, run_id))
    }

    async fn mark_down(&self, generation: u64, reason: &str, patience: Patience) {
        let mut link = self.link.lock().await;
        if link.live.as_ref().map(|l| l.generation) == Some(generation) {
            link.live = None;
            went_down(&mut link, reason.to_owned(), patience);
        }
    }
}

/// Leaves Redis alone for a while; warns once per outage.
fn went_down(link: &mut Link, reason: String, patience: Patience) -> Unavailable {
    if link.down_until.is_none() {
        tracing::warn!(%reason, retry_after = ?patience.retry_after,
            "Redis is unavailable; daily numbers continue from MongoDB");
    }
    link.down_until = Some(Instant::now() + patience.retry_after);
    Unavailable(reason)
}
