//! Scratch namespaces of test and benchmark runs on the shared servers: a
//! database, Redis keys under a prefix, and AMQP queues and exchanges
//! under a prefix. Each name carries the id of the process that owns it,
//! so a later run removes what a killed run left behind (its process is
//! gone) and never touches a live run's.
//!
//! Why it matters: a killed run's databases fill mongod's cache for every
//! later run, and its quorum queues hold RabbitMQ's file handles until the
//! broker stops answering.

use std::process::Stdio;

use codepool_store::Store;
use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};

/// How one kind of run names its namespaces: each prefix is followed by
/// the owner's process id and a separator.
#[derive(Debug, Clone, Copy)]
pub struct Family {
    pub db: &'static str,
    pub redis: &'static str,
    pub amqp: &'static str,
}

/// The test suite's namespaces.
pub const TESTS: Family = Family {
    db: "cpt_",
    redis: "cpt:",
    amqp: "cpt.",
};

/// `codepool-bench`'s namespaces.
pub const BENCHES: Family = Family {
    db: "codepool_bench_",
    redis: "codepool-bench-",
    amqp: "bench-",
};

/// The names of one namespace of this process.
#[derive(Debug, Clone)]
pub struct Names {
    pub db: String,
    /// Keys are `{redis_prefix}:…`.
    pub redis_prefix: String,
    /// Queues and exchanges are `{amqp_prefix}…` (it ends in a dot).
    pub amqp_prefix: String,
}

/// What a sweep removed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Swept {
    pub databases: usize,
    pub keys: usize,
    pub queues: usize,
    pub exchanges: usize,
}

impl Family {
    /// A new namespace of this process, told apart from its others by
    /// `label` (letters, digits and `_` only).
    pub fn names(&self, label: &str) -> Names {
        let pid = std::process::id();
        Names {
            db: format!("{}{pid}_{label}", self.db),
            redis_prefix: format!("{}{pid}:{label}", self.redis),
            amqp_prefix: format!("{}{pid}.{label}.", self.amqp),
        }
    }

    /// Removes the databases of this family whose process is gone.
    pub async fn sweep_databases(&self, store: &Store) -> usize {
        let client = store.database().client().clone();
        let mut dropped = 0;
        for name in store.database_names().await {
            if is_dead(owner(&name, self.db)) && client.database(&name).drop().await.is_ok() {
                dropped += 1;
            }
        }
        dropped
    }

    /// Removes the Redis keys of this family whose process is gone. A
    /// Redis Cluster (several comma-separated nodes) is left alone: its
    /// keys live on every node and `scripts/cluster.sh stop` wipes them.
    pub async fn sweep_redis(&self, url: &str) -> redis::RedisResult<usize> {
        if url.contains(',') {
            return Ok(0);
        }
        let (mut conn, keys) = redis_keys(url, &format!("{}*", self.redis)).await?;
        let dead: Vec<String> = keys
            .into_iter()
            .filter(|k| is_dead(owner(k, self.redis)))
            .collect();
        unlink(&mut conn, &dead).await?;
        Ok(dead.len())
    }

    /// Removes the queues and exchanges of this family whose process is
    /// gone. The broker is asked for its names with `rabbitmqctl`, so
    /// this works for a broker of this machine only; elsewhere (or without
    /// `rabbitmqctl`) nothing is swept.
    pub async fn sweep_broker(&self, amqp_url: &str) -> (usize, usize) {
        if !is_local(amqp_url) {
            return (0, 0);
        }
        let dead = |names: Vec<String>| -> Vec<String> {
            names
                .into_iter()
                .filter(|n| is_dead(owner(n, self.amqp)))
                .collect()
        };
        let queues = dead(broker_names("list_queues").await);
        let exchanges = dead(broker_names("list_exchanges").await);
        // Users a test made for a shop's backend are named like its queues.
        for user in dead(broker_users().await) {
            rabbitmqctl(&["delete_user", &user]).await;
        }
        if queues.is_empty() && exchanges.is_empty() {
            return (0, 0);
        }
        delete_amqp(amqp_url, &queues, &exchanges).await
    }

    /// Everything above: what dead runs of this family left.
    pub async fn sweep(&self, store: &Store, redis_url: &str, amqp_url: &str) -> Swept {
        let databases = self.sweep_databases(store).await;
        let keys = self.sweep_redis(redis_url).await.unwrap_or(0);
        let (queues, exchanges) = self.sweep_broker(amqp_url).await;
        Swept {
            databases,
            keys,
            queues,
            exchanges,
        }
    }
}

/// The process id a name of this family carries: the digits right after
/// `prefix`, followed by a separator.
fn owner(name: &str, prefix: &str) -> Option<u32> {
    let rest = name.strip_prefix(prefix)?;
    let end = rest.find(|c: char| !c.is_ascii_digit())?;
    let sep = rest[end..].chars().next()?;
    if end == 0 || !matches!(sep, '_' | ':' | '.' | '-') {
        return None;
    }
    rest[..end].parse().ok()
}

/// True when `pid` names no running process of this machine. A name
/// without an owner is not ours and is never dead.
fn is_dead(pid: Option<u32>) -> bool {
    match pid {
        Some(pid) if cfg!(target_os = "linux") => {
            !std::path::Path::new(&format!("/proc/{pid}")).exists()
        }
        _ => false,
    }
}

/// A broker of this machine: every node of the URL list on loopback.
fn is_local(amqp_url: &str) -> bool {
    amqp_url.split(',').all(|u| {
        let host = u
            .split("://")
            .nth(1)
            .unwrap_or(u)
            .rsplit('@')
            .next()
            .unwrap_or("");
        host.starts_with("127.0.0.1") || host.starts_with("localhost")
    })
}

/// Names of the default node's queues or exchanges (`what`:
/// `list_queues` or `list_exchanges`); none when `rabbitmqctl` cannot
/// tell.
async fn broker_names(what: &str) -> Vec<String> {
    (rabbitmqctl(&["-q", what, "name", "--no-table-headers"]).await)
        .lines()
        .map(|l| l.trim().to_owned())
        .filter(|l| !l.is_empty())
        .collect()
}

/// Names of the default node's users; none when `rabbitmqctl` cannot
/// tell.
async fn broker_users() -> Vec<String> {
    (rabbitmqctl(&["-q", "list_users", "--no-table-headers"]).await)
        .lines()
        .filter_map(|l| l.split('\t').next())
        .map(|l| l.trim().to_owned())
        .filter(|l| !l.is_empty())
        .collect()
}

/// `rabbitmqctl ARGS`, its output (empty when it fails or takes over 30 s).
async fn rabbitmqctl(args: &[&str]) -> String {
    let out = tokio::process::Command::new("rabbitmqctl")
        .args(args)
        .current_dir("/")
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .output();
    match tokio::time::timeout(std::time::Duration::from_secs(30), out).await {
        Ok(Ok(out)) if out.status.success() => String::from_utf8_lossy(&out.stdout).into_owned(),
        _ => String::new(),
    }
}

/// Deletes `queues` and `exchanges`, each on a channel of its own (a
/// failed delete closes its channel); returns how many of each went.
pub async fn delete_amqp(
    amqp_url: &str,
    queues: &[String],
    exchanges: &[String],
) -> (usize, usize) {
    let Ok(conn) = codepool_broker::connect(amqp_url, "codepool-scratch-cleanup").await else {
        return (0, 0);
    };
    let (mut q, mut x) = (0, 0);
    for name in queues {
        if let Ok(ch) = conn.create_channel().await {
            let gone = ch.queue_delete(name, QueueDeleteOptions::default()).await;
            q += closed_if(&ch, gone.is_ok()).await;
        }
    }
    for name in exchanges {
        if let Ok(ch) = conn.create_channel().await {
            let gone = ch
                .exchange_delete(name, ExchangeDeleteOptions::default())
                .await;
            x += closed_if(&ch, gone.is_ok()).await;
        }
    }
    let _ = conn.close(200, "bye").await;
    (q, x)
}

/// 1 when a delete went through (its channel is then closed; a refused
/// delete has closed it already), else 0.
async fn closed_if(ch: &lapin::Channel, deleted: bool) -> usize {
    if deleted {
        let _ = ch.close(200, "deleted").await;
    }
    usize::from(deleted)
}

/// Every key matching `pattern` (SCAN, never KEYS, so a shared Redis is
/// not blocked), with a connection to act on them.
pub async fn redis_keys(
    url: &str,
    pattern: &str,
) -> redis::RedisResult<(redis::aio::MultiplexedConnection, Vec<String>)> {
    let client = redis::Client::open(url)?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let (mut cursor, mut all) = (0u64, Vec::new());
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await?;
        all.extend(keys);
        if next == 0 {
            return Ok((conn, all));
        }
        cursor = next;
    }
}

/// Deletes every key under `prefix:` on one Redis server (a cluster's
/// keys are left: see [`Family::sweep_redis`]).
pub async fn delete_redis_keys(url: &str, prefix: &str) -> redis::RedisResult<usize> {
    if url.contains(',') {
        return Ok(0);
    }
    let (mut conn, keys) = redis_keys(url, &format!("{prefix}:*")).await?;
    unlink(&mut conn, &keys).await?;
    Ok(keys.len())
}

async fn unlink(
    conn: &mut redis::aio::MultiplexedConnection,
    keys: &[String],
) -> redis::RedisResult<()> {
    for chunk in keys.chunks(1000) {
        redis::cmd("UNLINK")
            .arg(chunk)
            .query_async::<()>(conn)
            .await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_tells_its_owner_only_after_the_prefix_and_before_a_separator() {
        assert_eq!(owner("cpt_123_redeem_ab12", "cpt_"), Some(123));
        assert_eq!(owner("cpt:77:x:1", "cpt:"), Some(77));
        assert_eq!(owner("cpt.9.label.purchases", "cpt."), Some(9));
        assert_eq!(owner("codepool-bench-4-0a1b", "codepool-bench-"), Some(4));
        // Older names (a random hex id, no process id) are nobody's.
        assert_eq!(owner("codepool_bench_1234abcd", "codepool_bench_"), None);
        assert_eq!(owner("cpt_x_1", "cpt_"), None);
        assert_eq!(owner("cpt_", "cpt_"), None);
        assert_eq!(owner("codepool", "cpt_"), None);
    }

    #[test]
    fn a_live_process_is_not_dead_and_a_name_without_owner_never_is() {
        assert!(!is_dead(Some(std::process::id())));
        assert!(!is_dead(None));
        // Beyond Linux's largest pid (2^22).
        assert_eq!(is_dead(Some(4_194_305)), cfg!(target_os = "linux"));
    }

    #[test]
    fn names_carry_this_process_and_the_label() {
        let n = TESTS.names("redeem_ab12");
        let pid = std::process::id();
        assert_eq!(n.db, format!("cpt_{pid}_redeem_ab12"));
        assert_eq!(owner(&n.redis_prefix, TESTS.redis), Some(pid));
        assert_eq!(owner(&n.amqp_prefix, TESTS.amqp), Some(pid));
        assert!(is_local("amqp://guest:guest@127.0.0.1:5672/%2f"));
        assert!(!is_local("amqp://guest:guest@rabbit.example:5672/%2f"));
    }
}
